"""The schema machinery: dataclasses are the schema, YAML only gives values.

Precedence, lowest to highest: the dataclass defaults, the YAML file, then
``section.key=value`` arguments on the command line. Every value is checked against the
field's type; an unknown key or a wrong type raises :class:`ConfigError` naming the key's
full path (``model.hidden_size``) and, for unknown keys, the closest valid name. A
numeric field states its valid range in :func:`option`; :func:`check_ranges` (called by
each section's ``__post_init__``) enforces it and :func:`describe` shows it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from ulysses_mm.core.checks import SEED_MAX as SEED_MAX  # the schema's seeds name it here
from ulysses_mm.core.checks import Range
from ulysses_mm.core.errors import ConfigError

T = TypeVar("T")


def option(
    text: str,
    default: Any = dataclasses.MISSING,
    factory: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    path: str | None = None,
    choices: Sequence[Any] | None = None,
    **cli: Any,
) -> Any:
    """A dataclass field with help text (shown by ``ulysses-mm config --keys`` and a
    command's ``--help``) and, for a numeric key, its valid :class:`Range` (``ge``/``gt``
    low bound, ``le``/``lt`` high bound; for a mapping or a list, of each value), checked
    by :func:`check_ranges` and by the command line. ``path`` names what a path must be (a
    key of :data:`ulysses_mm.core.checks.PATHS`: ``in_file``, ``out_dir``, …), ``choices``
    the values allowed. A command's option may say how it is spelled (``cli``:
    ``flags=("-v", "--verbose")``, ``metavar``, ``positional=True``, ``exclusive`` (a name
    the flags that exclude each other share), ``repeat=True``); see :mod:`ulysses_mm.cli.declare`."""
    metadata: dict[str, Any] = {"help": text, "cli": cli}
    r = Range.of(ge, gt, le, lt)
    if r is not None:
        metadata["range"] = r
    if path is not None:
        metadata["path"] = path
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def positional(text: str, path: str | None = None, **cli: Any) -> Any:
    """A command's required positional argument (``path``: what it must be)."""
    return option(text, path=path, positional=True, **cli)


def overrides(example: str = "") -> Any:
    """A command's ``section.key=value`` words, applied over its config file."""
    text = "section.key=value overrides, applied after the file (CLI > file > defaults)"
    return option(text + example, factory=list, positional=True)


def range_of(cls: type, name: str) -> Range:
    """The range :func:`option` gave field ``name`` of dataclass ``cls``."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata["range"]
    raise KeyError(name)


def check_ranges(where: str, obj: Any) -> None:
    """Every field of dataclass ``obj`` that has a range holds a value in it (each value
    of a mapping or list); the error names the key as ``where.name``."""
    for f in dataclasses.fields(obj):
        r = f.metadata.get("range")
        if r is None:
            continue
        value = getattr(obj, f.name)
        key = f"{where}.{f.name}"
        if isinstance(value, Mapping):
            for k, v in value.items():
                r.check(f"{key}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                r.check(f"{key}[{i}]", v)
        elif value is not None:
            r.check(key, value)


def check_flags(obj: Any) -> None:
    """Every field of a command's options dataclass that has a range holds a value in it
    (each item of a list), the error naming its flag (``--new-tokens``): what the command
    line checks, for a caller that builds the options in code."""
    for f in dataclasses.fields(obj):
        r, value = f.metadata.get("range"), getattr(obj, f.name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if r is not None and v is not None:
                r.check("--" + f.name.replace("_", "-"), v)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _closest(name: str, options: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.0)
    return match[0] if match else ""


def _as_text(value: Any) -> str:
    """Why a number arrived as a string, for its refusal (a key takes YAML numbers only, so
    text never turns into a number silently): quoted, or an exponent that YAML 1.1 reads as
    text (PyYAML reads ``5e5`` as a string and ``5.0e+5`` as a number)."""
    if not isinstance(value, str):
        return ""
    try:
        float(value)
    except ValueError:
        return ""
    if not isinstance(yaml.safe_load(value), str):
        return "; write it without quotes"
    mantissa, e, exponent = value.strip().lower().partition("e")
    if not e or not mantissa or not exponent:
        return ""
    mantissa += "" if "." in mantissa else ".0"
    exponent = exponent if exponent[0] in "+-" else "+" + exponent
    return f" (YAML reads {value} as text; write {mantissa}e{exponent})"


def _is_mapping_type(tp: Any) -> bool:
    return get_origin(tp) is dict or tp is dict or dataclasses.is_dataclass(tp)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (converted where lossless)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Union or origin is types.UnionType:
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors, alike = [], []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
                if isinstance(value, Mapping) == _is_mapping_type(arg):
                    alike.append(str(e))  # the error of the type the value has the shape of
        if len(errors) > 1 and len(alike) == 1:
            errors = alike
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{path}: {value!r} matches no type of {tp}"
        )
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        raise ConfigError(f"{path}: {value!r} is not one of {list(allowed)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # type: ignore[arg-type]
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{path}: expected a mapping for section {_type_name(tp)}, got {value!r}"
            )
        return from_dict(tp, value, path)  # type: ignore[arg-type]
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = get_args(tp)[:1] or (Any,)
        return [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        kt, vt = get_args(tp) or (Any, Any)
        return {_coerce(kt, k, f"{path}"): _coerce(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(
            f"{path}: expected an integer, got {type(value).__name__} {value!r}{_as_text(value)}"
        )
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(
            f"{path}: expected a number, got {type(value).__name__} {value!r}{_as_text(value)}"
        )
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    renamed: Mapping[str, str] = getattr(cls, "RENAMED", {})
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key in renamed:  # an old name still read, with a one-line hint
            key, old = renamed[key], full
            full = f"{path}.{key}" if path else key
            if key in data:
                raise ConfigError(
                    f"'{old}' is the old name of '{full}' and both are given; keep '{full}'"
                )
            warnings.warn(
                f"'{old}' is now '{full}'; rename it in the config", FutureWarning, stacklevel=2
            )
        if key not in names:
            near = _closest(str(key), names)
            hint = f"; did you mean '{path + '.' if path else ''}{near}'?" if near else ""
            raise ConfigError(f"unknown key '{full}'{hint}")
        kwargs[key] = _coerce(hints[key], value, full)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from e


def to_dict(obj: Any) -> dict[str, Any]:
    """The plain-data form of a config (round-trips through :func:`from_dict`)."""
    return dataclasses.asdict(obj)


class _Replace(dict):
    """A mapping given whole by an override (``model.modalities={text: 8}``): it replaces
    the value at its key, where a mapping read from a file merges into the one below it."""


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """``["model.hidden_size=128", "data.train=s3://b/m.json"]`` to a nested mapping.

    Values are parsed as YAML scalars/flows (``3``, ``true``, ``[1, 2]``, ``{a: 1}``). An
    override replaces the value at its key: merged with :func:`deep_merge`, a mapping
    value does not merge into the file's mapping at that key (``'model.modalities={}'``
    empties it), while overrides of different keys of one section still combine."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}' has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(
                f"override '{item}': the value is not YAML ({problem}); a string with "
                "YAML's special characters needs quotes inside the shell's: "
                f"""{key}='"..."'"""
            ) from None
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override '{item}' conflicts with an earlier override of '{part}'"
                )
            node = child
        node[parts[-1]] = _Replace(value) if isinstance(value, dict) else value
    return nested


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: mappings merge key by key, anything else replaces, and so
    does a mapping that came whole from an override (see :func:`parse_overrides`). The
    mappings of ``top`` are copied into plain dicts."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping):
            below = out.get(key)
            merge = isinstance(below, Mapping) and not isinstance(value, _Replace)
            out[key] = deep_merge(below if merge else {}, value)  # type: ignore[arg-type]
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with ``yaml.safe_load`` (never the unsafe loader)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    base: Mapping[str, Any] | None = None,
) -> T:
    """defaults < ``base`` (an embedded default) < file at ``path`` < ``overrides``."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = deep_merge(data, read_yaml(path))
    data = deep_merge(data, parse_overrides(overrides))
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{e}") from None


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, valid range or '', help) for every leaf key of a schema, for
    ``config --keys``."""
    rows: list[tuple[str, str, str, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key + "."))  # type: ignore[arg-type]
        else:
            r = f.metadata.get("range")
            rows.append((key, _type_name(tp), str(r) if r else "", f.metadata.get("help", "")))
    return rows
