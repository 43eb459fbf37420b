"""What a command or a config was given, checked before any work or process starts.
Torch-free.

:class:`Range` is the one range type: the valid values of a numeric config key or
command-line option, declared once in a field's metadata (:func:`ulysses_mm.config.parse.option`),
shown in ``config --keys`` and in ``--help``, and enforced by :meth:`Range.check` (a config
value) and :func:`number` / :func:`integer` / :func:`int_list` (a command-line word).
Paths: ``out_file``, ``out_dir``, ``in_file``, ``in_dir``, ``in_path``, ``not_inside``.
Each raises :class:`CheckError` — a :class:`~ulysses_mm.core.errors.UserError`, so the CLI
prints it as one line, exit 2. :func:`arg_type` makes any of them an ``argparse``
``type=`` that carries ``check`` (its name) and ``bounds`` (the range's text), so a test
finds every checked option by reading the parsers.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ulysses_mm.core.errors import ConfigError, UserError

T = TypeVar("T")

# Bounds shared by several options (a count beyond them is a typo, or would exhaust memory
# or overflow an int64 product long before it did anything useful).
INT64_SAFE = 2**62  # an index or position: below it, sums and products of two stay in int64
MAX_SEED = 2**32 - 1  # numpy's legacy seeding takes no more
SEED_MAX = 2**63 - 1  # numpy's and torch's generators take any of 0 .. 2**63 - 1
MAX_PROCESSES = 1024  # local processes one command starts
MAX_TOKENS = 10**9  # tokens one process generates, or bases of one probe half


class CheckError(UserError, ValueError):
    """A command-line value is out of its domain; the message names the bound."""


def _num(x: float) -> str:
    """A bound as people write it: ``2**63 - 1``, ``2**30``, ``10**6``, ``1e+06``, ``65536``."""
    whole = isinstance(x, int) or float(x).is_integer()
    n = int(x) if whole else 0
    if n >= 1 << 20 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    if n >= 1 << 20 and n & (n + 1) == 0:
        return f"2**{n.bit_length()} - 1"
    if not isinstance(x, int):
        return f"{x:g}"
    if x >= 10**6 and str(x).rstrip("0") == "1":
        return f"10**{len(str(x)) - 1}"
    return str(x)


@dataclass(frozen=True)
class Range:
    """The valid values of a number: ``low`` and ``high`` bounds (None = unbounded), each
    included unless ``*_open``; a float must also be finite."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    @classmethod
    def of(
        cls,
        ge: float | None = None,
        gt: float | None = None,
        le: float | None = None,
        lt: float | None = None,
    ) -> Range | None:
        """The range of ``ge``/``gt`` (low) and ``le``/``lt`` (high); None if none is given."""
        if ge is None and gt is None and le is None and lt is None:
            return None
        low, high = (gt if gt is not None else ge), (lt if lt is not None else le)
        return cls(low, high, gt is not None, lt is not None)

    def __str__(self) -> str:
        lo, hi = self.low, self.high
        if hi is None:
            return "any" if lo is None else f"{'>' if self.low_open else '>='} {_num(lo)}"
        if lo is None:
            return f"{'<' if self.high_open else '<='} {_num(hi)}"
        if not (self.low_open or self.high_open):
            return f"{_num(lo)} .. {_num(hi)}"
        return (
            f"{'(' if self.low_open else '['}{_num(lo)}, {_num(hi)}{')' if self.high_open else ']'}"
        )

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        lo, hi = self.low, self.high
        if lo is not None and (value <= lo if self.low_open else value < lo):
            return False
        return not (hi is not None and (value >= hi if self.high_open else value > hi))

    @property
    def said(self) -> str:
        """The range in a sentence: ``within 1 .. 8``, ``>= 0``; '' when unbounded."""
        if self.low is None and self.high is None:
            return ""
        return f"within {self}" if self.low is not None and self.high is not None else str(self)

    def refusal(self, key: str, value: Any, what: str = "") -> str:
        """``KEY must be [WHAT ][within ]RANGE, got VALUE``: the one message of a value
        outside the range (``what``: ``a finite number``, ``an integer``)."""
        must = " ".join(x for x in (what, self.said) if x)
        return f"{key + ' ' if key else ''}must be {must}, got {value}"

    def check(self, key: str, value: float, error: type[UserError] = ConfigError) -> None:
        """Raise ``error`` (a config key's by default) naming ``key`` unless ``value`` is in
        the range."""
        if not self.contains(value):
            raise error(self.refusal(key, value))


_ANY = Range()


def number(
    value: str | float,
    name: str = "",
    *,
    within: Range | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> float:
    """``value`` as a finite float in ``within`` (or the range of ``ge``/``gt``/``le``/``lt``);
    nan and inf are refused."""
    r = within or Range.of(ge, gt, le, lt) or _ANY
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise CheckError(r.refusal(name, repr(value), "a finite number")) from None
    if not r.contains(x):
        raise CheckError(r.refusal(name, value, "a finite number"))
    return x


def integer(
    value: str | int,
    name: str = "",
    *,
    within: Range | None = None,
    ge: int | None = None,
    le: int | None = None,
) -> int:
    """``value`` as an int in ``within`` (default ``[ge or 0, le or 2**62]``): decimal digits
    only, no ``1e3``, no ``1.5``."""
    r = within or Range(0 if ge is None else ge, INT64_SAFE if le is None else le)
    try:
        x = int(value)
    except (TypeError, ValueError):
        raise CheckError(r.refusal(name, repr(value), "an integer")) from None
    if not r.contains(x):
        raise CheckError(r.refusal(name, value, "an integer"))
    return x


def int_list(
    value: str,
    name: str = "",
    *,
    within: Range | None = None,
    increasing: bool = False,
    min_items: int = 1,
) -> list[int]:
    """A comma-separated list of at least ``min_items`` ints, each in ``within`` (default
    ``[0, 2**62)``; strictly increasing if asked)."""
    r = within or Range(0, INT64_SAFE, high_open=True)
    order = ", increasing" if increasing else ""
    least = f"{min_items} or more " if min_items > 1 else ""
    what = f"{least}integers {r.said} separated by commas{order}"
    try:
        items = [int(x) for x in str(value).split(",")]
    except ValueError:
        raise CheckError(f"{name + ' ' if name else ''}must be {what}, got {value!r}") from None
    bad = [x for x in items if not r.contains(x)]
    if bad:
        raise CheckError(f"{name + ' ' if name else ''}must be {what}, got {bad[0]}")
    if len(items) < min_items or (increasing and any(b <= a for a, b in itertools.pairwise(items))):
        raise CheckError(f"{name + ' ' if name else ''}must be {what}, got {value}")
    return items


def _named(name: str, text: str) -> str:
    return f"{name} {text}" if name else text


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

PATHS: dict[str, Callable[..., str]] = {
    "out_file": out_file,
    "out_dir": out_dir,
    "in_file": in_file,
    "in_dir": in_dir,
    "in_path": in_path,
}


def arg_type(
    check: str, fn: Callable[[str], T], bounds: str = "", within: Range | None = None
) -> Callable[[str], T]:
    """``fn`` as an argparse ``type=``: its refusal becomes ``ArgumentTypeError`` (whose
    message argparse prints as is), marked with ``check`` (``number``, ``integer``,
    ``int_list``, a key of :data:`PATHS`), ``bounds`` (the range's text) and ``range``."""

    def parse(value: str) -> T:
        try:
            return fn(value)
        except CheckError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = check
    marked: Any = parse
    marked.check = check
    marked.bounds = bounds
    marked.range = within
    return parse
