"""Small helpers every tokenizer shares: checked spec params, document framing, local ids.

Kept apart from :mod:`ulysses_mm.modalities.base` (the contract) so the contract stays a
short list of names; these are conveniences built on it.

A spec's ``params`` are checked like the run config: an unknown key or a wrong type is a
``ValueError`` naming the spec file, the key and what is allowed, so a typo in a spec
never silently falls back to a default.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ulysses_mm.modalities.base import TokenizerSpec
from ulysses_mm.tokenspace import DOC_END, DOC_START, TokenSpace

# A param's schema: (accepted python types, default). ``None`` in the types allows null.
ParamSchema = Mapping[str, tuple[tuple[type, ...], Any]]


def spec_params(spec: TokenizerSpec, schema: ParamSchema) -> dict[str, Any]:
    """``spec.params`` checked against ``schema`` and completed with its defaults."""
    out: dict[str, Any] = {}
    for key, value in spec.params.items():
        if key not in schema:
            close = difflib.get_close_matches(key, list(schema), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{spec.path or spec.name}: unknown param {key!r} for kind {spec.kind!r}{hint}; "
                f"allowed: {sorted(schema)}"
            )
        types, _ = schema[key]
        ok = (value is None and type(None) in types) or (
            value is not None
            and isinstance(value, tuple(t for t in types if t is not type(None)))
            and not (isinstance(value, bool) and bool not in types)
        )
        if not ok:
            names = "/".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(
                f"{spec.path or spec.name}: param {key!r} must be {names}, got {value!r}"
            )
        out[key] = value
    for key, (_, default) in schema.items():
        out.setdefault(key, default)
    return out


def check_choice(spec: TokenizerSpec, key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(
            f"{spec.path or spec.name}: param {key!r} must be one of {list(choices)}, got {value!r}"
        )


class DocumentFramer:
    """Frames 0-based local ids of one modality as ``<doc> <|modality|> ids… </doc>``.

    Built once per file (the space lookups are then out of the per-document path, which
    matters for FASTQ files of many short reads)."""

    def __init__(self, space: TokenSpace, modality: str) -> None:
        r = space.range(modality)
        self.dtype = space.dtype()
        self.start = r.start
        self.size = r.size
        self.boundary = space.boundary_token(modality)

    def __call__(self, local: np.ndarray) -> np.ndarray:
        out = np.empty(local.shape[0] + 3, dtype=self.dtype)
        out[0] = DOC_START
        out[1] = self.boundary
        np.add(local, self.start, out=out[2:-1], dtype=self.dtype, casting="unsafe")
        out[-1] = DOC_END
        return out


def wrap_document(space: TokenSpace, modality: str, local: np.ndarray) -> np.ndarray:
    """``<doc> <|modality|> ids… </doc>`` in the space's dtype, from 0-based local ids."""
    return DocumentFramer(space, modality)(local)


def local_ids(tokens: np.ndarray, space: TokenSpace, modality: str) -> np.ndarray:
    """The ids of ``modality`` in ``tokens`` as 0-based local ids (int64), specials dropped.

    Raises ValueError if an id belongs to another modality or lies outside the space:
    decoding tokens of the wrong modality is a caller's bug, not bad data.
    """
    t = np.asarray(tokens).astype(np.int64, copy=False).ravel()
    r = space.range(modality)
    special = t < space.num_specials
    inside = (t >= r.start) & (t < r.stop)
    bad = ~(special | inside)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"token {int(t[i])} at position {i} is not a special or a {modality} id "
            f"({r.start}..{r.stop - 1}) in {space.describe()}"
        )
    return t[inside] - r.start
