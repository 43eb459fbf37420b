"""A tokenizer spec's ``params`` checked against its kind's schema.

Each kind declares a :data:`ParamSchema` (accepted types and a default per key);
:func:`spec_params` refuses an unknown key (with a "did you mean") or a value of the wrong
type, and fills in the defaults, so no kind reads an unchecked param and no typo in a
spec silently does nothing. The errors are :class:`~ulysses_mm.core.errors.DataError`
naming the spec file: the user fixes the spec.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from ulysses_mm.core.errors import DataError
from ulysses_mm.tokenize.base import TokenizerSpec

# A param's schema: (accepted python types, default). ``None`` in the types allows null.
ParamSchema = Mapping[str, tuple[tuple[type, ...], Any]]


def spec_params(spec: TokenizerSpec, schema: ParamSchema) -> dict[str, Any]:
    """``spec.params`` checked against ``schema`` and completed with its defaults."""
    out: dict[str, Any] = {}
    for key, value in spec.params.items():
        if key not in schema:
            close = difflib.get_close_matches(key, list(schema), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DataError(
                f"{spec.where}: unknown param {key!r} for kind {spec.kind!r}{hint}; "
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
            raise DataError(f"{spec.where}: param {key!r} must be {names}, got {value!r}")
        out[key] = value
    for key, (_, default) in schema.items():
        out.setdefault(key, default)
    return out


def check_choice(spec: TokenizerSpec, key: str, value: Any, choices: tuple[str, ...]) -> None:
    """DataError naming the spec unless param ``key``'s ``value`` is one of ``choices``."""
    if value not in choices:
        raise DataError(
            f"{spec.where}: param {key!r} must be one of {list(choices)}, got {value!r}"
        )
