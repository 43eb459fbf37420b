"""What a command was given, checked before any work or process starts. Torch-free.

Two faces over one set of rules: plain functions (``number``, ``integer``, ``int_list``,
``out_file``, ``out_dir``, ``in_file``, ``in_dir``, ``in_path``, ``not_inside``) that
raise :class:`CheckError` — a :class:`~ulysses_mm.core.errors.UserError`, so the CLI
prints it as one line, exit 2 — and ``argparse`` ``type=`` factories of the same names
with an ``_arg`` suffix (and ``count_arg``, ``seed_arg``, ``count_or_arg`` over
``integer``), which raise ``argparse.ArgumentTypeError`` with the same message.

Each factory's callable carries ``check`` (its kind: ``number``, ``integer``,
``int_list``, ``out_file``, ``out_dir``, ``in_file``, ``in_dir``, ``in_path``) and
``bounds`` (a short text), so a test can find every checked option by reading the
parsers.

Paths with a scheme (``s3://…``, ``memory://…``) are remote: they are left to the
storage layer, which reaches them.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ulysses_mm.core.errors import UserError

T = TypeVar("T")

# Bounds shared by several options (a count beyond them is a typo, or would exhaust memory
# or overflow an int64 product long before it did anything useful).
INT64_SAFE = 2**62  # an index or position: below it, sums and products of two stay in int64
MAX_SEED = 2**32 - 1  # numpy's legacy seeding takes no more
MAX_PROCESSES = 1024  # local processes one command starts
MAX_TOKENS = 10**9  # tokens one process generates, or bases of one probe half


class CheckError(UserError, ValueError):
    """A command-line value is out of its domain; the message names the bound."""


# ------------------------------------------------------------------------ numbers


def _bounds_text(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    parts = []
    if ge is not None:
        parts.append(f">= {ge:g}")
    if gt is not None:
        parts.append(f"> {gt:g}")
    if le is not None:
        parts.append(f"<= {le:g}")
    if lt is not None:
        parts.append(f"< {lt:g}")
    return " and ".join(parts)


def _int_text(n: int) -> str:
    """``2^62`` for a large power of two, else ``1,000,000``."""
    if n >= 1 << 20 and n & (n - 1) == 0:
        return f"2^{n.bit_length() - 1}"
    return f"{n:,}"


def _named(name: str, text: str) -> str:
    return f"{name} {text}" if name else text


def number(
    value: str | float,
    name: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    says: str = "",
) -> float:
    """``value`` as a finite float within the bounds given (nan and inf are refused);
    ``says``, if given, is how the message writes the bounds (``0 < RATE <= 1``)."""
    bounds = says or _bounds_text(ge, gt, le, lt)
    what = f"must be a finite number{' ' + bounds if bounds else ''}"
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise CheckError(_named(name, f"{what}, got {value!r}")) from None
    if (
        not math.isfinite(x)
        or (ge is not None and x < ge)
        or (gt is not None and x <= gt)
        or (le is not None and x > le)
        or (lt is not None and x >= lt)
    ):
        raise CheckError(_named(name, f"{what}, got {value}"))
    return x


def integer(value: str | int, name: str = "", *, ge: int = 0, le: int = INT64_SAFE) -> int:
    """``value`` as an int in ``[ge, le]`` (decimal digits only: no ``1e3``, no ``1.5``).
    A count is ``ge=1``; an index or an "0 = default" option ``ge=0``. The message names
    the bound that was crossed."""
    try:
        x = int(value)
    except (TypeError, ValueError):
        what = f"must be an integer >= {ge} and <= {_int_text(le)}"
        raise CheckError(_named(name, f"{what}, got {value!r}")) from None
    if x < ge:
        raise CheckError(_named(name, f"must be at least {ge}, got {value}"))
    if x > le:
        raise CheckError(_named(name, f"must be at most {_int_text(le)}, got {value}"))
    return x


def int_list(
    value: str,
    name: str = "",
    *,
    ge: int = 0,
    lt: int = INT64_SAFE,
    increasing: bool = False,
    min_items: int = 1,
) -> list[int]:
    """A comma-separated list of at least ``min_items`` ints, each in ``[ge, lt)`` (strictly
    increasing if asked)."""
    order = ", increasing" if increasing else ""
    least = f"{min_items} or more " if min_items > 1 else ""
    what = f"must be {least}integers >= {ge} and < {_int_text(lt)} separated by commas{order}"
    try:
        items = [int(x) for x in str(value).split(",")]
    except ValueError:
        raise CheckError(_named(name, f"{what}, got {value!r}")) from None
    bad = [x for x in items if not ge <= x < lt]
    if bad:
        raise CheckError(_named(name, f"{what}, got {bad[0]}"))
    if len(items) < min_items or (increasing and any(b <= a for a, b in itertools.pairwise(items))):
        raise CheckError(_named(name, f"{what}, got {value}"))
    return items


# ------------------------------------------------------------------------ paths


def is_remote(value: str) -> bool:
    """A URL with a scheme (``s3://``, ``memory://``, ``file://``): not a local path."""
    return "://" in str(value)


def _writable_dir(path: Path) -> bool:
    """A directory the user may write into: access says so and a write bit is set (the
    bits count too, so a directory marked read-only is refused even for root)."""
    mode = path.stat().st_mode
    return os.access(path, os.W_OK | os.X_OK) and bool(
        mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    )


def _check_ancestors(path: Path, name: str) -> None:
    """The nearest existing ancestor of ``path`` is a writable directory (so the missing
    parents can be made); nothing on the way is a file."""
    parent = path.absolute().parent
    while not parent.exists():
        if parent.is_symlink():  # a dangling link on the way
            raise CheckError(_named(name, f"{path}: {parent} is a broken link"))
        parent = parent.parent
    if not parent.is_dir():
        raise CheckError(_named(name, f"{path}: {parent} is a file, not a directory"))
    if not _writable_dir(parent):
        raise CheckError(_named(name, f"{path}: {parent} is not writable"))


def out_file(value: str, name: str = "") -> str:
    """A file to write: not an existing directory, and its directory exists or can be
    made. Returned unchanged."""
    if not value:
        raise CheckError(_named(name, "must be a file path, got ''"))
    if is_remote(value):
        return value
    path = Path(value)
    if path.is_dir():
        raise CheckError(_named(name, f"{value} is a directory, expected a file to write"))
    if path.exists() and not os.access(path, os.W_OK):
        raise CheckError(_named(name, f"{value} is not writable"))
    _check_ancestors(path, name)
    return value


def out_dir(value: str, name: str = "") -> str:
    """A directory to write into: not an existing file, and it exists writable or can be
    made. Returned unchanged."""
    if not value:
        raise CheckError(_named(name, "must be a directory path, got ''"))
    if is_remote(value):
        return value
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise CheckError(_named(name, f"{value} is a file, expected a directory to write"))
    if path.is_dir():
        if not _writable_dir(path):
            raise CheckError(_named(name, f"{value} is not writable"))
        return value
    _check_ancestors(path, name)
    return value


def not_inside(out: str, source: str, name: str = "") -> str:
    """``out`` is neither ``source`` nor inside it (a writer must not write into what it
    reads). Remote paths are compared as written."""
    if is_remote(out) or is_remote(source):
        inside = out.rstrip("/") == source.rstrip("/") or out.startswith(source.rstrip("/") + "/")
    else:
        o, s = Path(out).resolve(), Path(source).resolve()
        inside = o == s or s in o.parents
    if inside:
        raise CheckError(_named(name, f"{out} is inside {source}, which it reads"))
    return out


def in_path(value: str, name: str = "", *, exist: bool = True) -> str:
    """An input (a file or a directory). ``exist=False`` lets a missing one through, for
    the command to name with what it expected. Returned unchanged."""
    if not value:
        raise CheckError(_named(name, "must be a path, got ''"))
    if exist and not is_remote(value) and not Path(value).exists():
        raise CheckError(_named(name, f"{value}: no such file or directory"))
    return value


def in_file(value: str, name: str = "", *, exist: bool = True) -> str:
    """An input file: not a directory (and, with ``exist``, there)."""
    in_path(value, name, exist=exist)
    if not is_remote(value) and Path(value).is_dir():
        raise CheckError(_named(name, f"{value} is a directory, expected a file"))
    return value


def in_dir(value: str, name: str = "", *, exist: bool = True) -> str:
    """An input directory: not a file (and, with ``exist``, there)."""
    in_path(value, name, exist=exist)
    if not is_remote(value) and Path(value).exists() and not Path(value).is_dir():
        raise CheckError(_named(name, f"{value} is a file, expected a directory"))
    return value


# ------------------------------------------------------------------------ argparse types


def _arg(check: str, bounds: str, fn: Callable[[str], T]) -> Callable[[str], T]:
    """``fn`` as an argparse ``type=``: its refusal becomes ``ArgumentTypeError`` (whose
    message argparse prints as is), marked with ``check`` and ``bounds``."""

    def parse(value: str) -> T:
        try:
            return fn(value)
        except CheckError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = check
    marked: Any = parse
    marked.check = check
    marked.bounds = bounds
    return parse


def number_arg(
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    says: str = "",
) -> Callable[[str], float]:
    """``type=`` for a finite float within the bounds."""
    return _arg(
        "number",
        says or _bounds_text(ge, gt, le, lt),
        lambda v: number(v, ge=ge, gt=gt, le=le, lt=lt, says=says),
    )


def integer_arg(*, ge: int = 0, le: int = INT64_SAFE) -> Callable[[str], int]:
    """``type=`` for an int in ``[ge, le]``."""
    return _arg("integer", f">= {ge} and <= {le}", lambda v: integer(v, ge=ge, le=le))


def count_arg(le: int) -> Callable[[str], int]:
    """``type=`` for a count: an int in ``[1, le]``."""
    return integer_arg(ge=1, le=le)


def seed_arg() -> Callable[[str], int]:
    """``type=`` for a seed: an int in ``[0, 2**32 - 1]``."""
    return integer_arg(ge=0, le=MAX_SEED)


def count_or_arg(word: str, le: int) -> Callable[[str], int | str]:
    """``type=`` for a count in ``[1, le]`` or the one word ``word`` (e.g. ``auto``)."""

    def parse(value: str) -> int | str:
        if value == word:
            return value
        try:
            return integer(value, ge=1, le=le)
        except CheckError:
            raise CheckError(
                f"must be a positive integer or {word} (at most {_int_text(le)}), got {value!r}"
            ) from None

    return _arg("integer", f"{word} or >= 1 and <= {le}", parse)


def int_list_arg(
    *, ge: int = 0, lt: int = INT64_SAFE, increasing: bool = False, min_items: int = 1
) -> Callable[[str], list[int]]:
    """``type=`` for comma-separated ints in ``[ge, lt)``."""
    return _arg(
        "int_list",
        f">= {ge} and < {lt}" + (", increasing" if increasing else ""),
        lambda v: int_list(v, ge=ge, lt=lt, increasing=increasing, min_items=min_items),
    )


def out_file_arg() -> Callable[[str], str]:
    """``type=`` for a file to write (see :func:`out_file`)."""
    return _arg("out_file", "", out_file)


def out_dir_arg() -> Callable[[str], str]:
    """``type=`` for a directory to write (see :func:`out_dir`)."""
    return _arg("out_dir", "", out_dir)


# The input types refuse the wrong kind; a missing input is left to the command (which
# names it with what it expected there: a run directory, a manifest, …) unless ``exist``.


def in_file_arg(*, exist: bool = False) -> Callable[[str], str]:
    """``type=`` for an input file: not an existing directory (a URL passes)."""
    return _arg("in_file", "exists" if exist else "", lambda v: in_file(v, exist=exist))


def in_dir_arg(*, exist: bool = False) -> Callable[[str], str]:
    """``type=`` for an input directory: not an existing file (a URL passes)."""
    return _arg("in_dir", "exists" if exist else "", lambda v: in_dir(v, exist=exist))


def in_path_arg(*, exist: bool = False) -> Callable[[str], str]:
    """``type=`` for an input file or directory, not empty (a URL passes)."""
    return _arg("in_path", "exists" if exist else "", lambda v: in_path(v, exist=exist))
