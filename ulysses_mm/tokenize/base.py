"""The contract between modality tokenizers and the pipeline that packs their output.

A tokenizer is described by a JSON spec in ``tokenizers/`` (data, never Python) and built
by :func:`load_tokenizer`. It turns one input file into one or more
:class:`TokenDocument` (a FASTA file with several records gives several), each already in
the unified token space: ``<doc> <|m|> … </doc>``. A document may switch modality with
another ``<|m|>`` (a clip interleaving video and audio). A bad input raises
:class:`DecodeError` with a one-line reason; the pipeline records it and goes on.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace


class DecodeError(DataError):
    """An input cannot be turned into tokens; ``str(e)`` is the one-line reason."""


@dataclass(frozen=True)
class TokenizerSpec:
    """A parsed ``tokenizers/*.json`` file."""

    name: str
    modality: str
    kind: str  # which implementation: see ulysses_mm.tokenize.registry
    vocab_size: int  # ids this tokenizer uses inside its modality range
    params: dict[str, Any] = field(default_factory=dict)
    artifact: str | None = None  # learned state (e.g. a codebook), relative to the spec
    artifact_sha256: str | None = None
    path: str = ""  # where the spec was read from
    sha256: str = ""  # of the spec file's bytes (recorded in manifests)

    @classmethod
    def load(cls, path: str | Path) -> TokenizerSpec:
        p = Path(path)
        raw = p.read_bytes()
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: tokenizer spec is not valid JSON: {e}") from e
        required = {"name", "modality", "kind", "vocab_size"}
        allowed = required | {"params", "artifact", "artifact_sha256", "description"}
        if not isinstance(data, dict) or not required <= set(data):
            raise ValueError(f"{p}: tokenizer spec needs keys {sorted(required)}")
        unknown = set(data) - allowed
        if unknown:
            raise ValueError(
                f"{p}: unknown tokenizer spec keys {sorted(unknown)}; allowed {sorted(allowed)}"
            )
        spec = cls(
            name=str(data["name"]),
            modality=str(data["modality"]),
            kind=str(data["kind"]),
            vocab_size=int(data["vocab_size"]),
            params=dict(data.get("params") or {}),
            artifact=data.get("artifact"),
            artifact_sha256=data.get("artifact_sha256"),
            path=str(p),
            sha256=hashlib.sha256(raw).hexdigest(),
        )
        if spec.artifact is not None:
            art = spec.artifact_path()
            if not art.is_file():
                raise ValueError(f"{p}: artifact {art} does not exist")
            digest = hashlib.sha256(art.read_bytes()).hexdigest()
            if spec.artifact_sha256 and digest != spec.artifact_sha256:
                raise ValueError(
                    f"{p}: artifact {art} has sha256 {digest[:16]}…, the spec expects "
                    f"{spec.artifact_sha256[:16]}…"
                )
        return spec

    def artifact_path(self) -> Path:
        assert self.artifact is not None
        return (Path(self.path).parent / self.artifact).resolve()

    def manifest_entry(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "modality": self.modality,
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "params": self.params,
            "spec_sha256": self.sha256,
            "artifact_sha256": self.artifact_sha256,
        }


@dataclass
class TokenDocument:
    """One document, ready to pack: ids in the unified space from ``<doc>`` to ``</doc>``."""

    source: str  # the input file (path or URL)
    key: str  # stable and unique in a dataset, e.g. "file.fa#chrI"
    modality: str  # the primary modality (the segment table's modality column)
    tokens: np.ndarray  # 1-D integer array


class Tokenizer(ABC):
    """Raw file -> token documents, and tokens -> something a person can inspect."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec

    @property
    def modality(self) -> str:
        return self.spec.modality

    @abstractmethod
    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        """Decode and tokenize one file; raise DecodeError for a bad input."""

    def companion_specs(self) -> list[TokenizerSpec]:
        """Specs of the other modalities this tokenizer's documents also hold (a video spec
        that interleaves the clip's audio names its audio spec): a token space for data
        from this tokenizer must include their modalities too. Default: none."""
        return []

    @abstractmethod
    def decode(self, tokens: np.ndarray, space: TokenSpace) -> Any:
        """Unified-space ids of this modality (specials allowed) back to data:
        DNA a str, audio a float32 waveform, video uint8 frames [t, h, w, 3]."""


def build_token_space(specs: Sequence[TokenizerSpec]) -> TokenSpace:
    """The dataset's token space from the specs a pipeline names, in that order."""
    vocab: dict[str, int] = {}
    for s in specs:
        if s.modality in vocab:
            raise ValueError(f"two tokenizer specs for modality {s.modality!r} ({s.path})")
        vocab[s.modality] = s.vocab_size
    return TokenSpace.from_vocab(vocab)


def spec_table(specs: Sequence[TokenizerSpec]) -> Mapping[str, dict[str, Any]]:
    return {s.modality: s.manifest_entry() for s in specs}


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
