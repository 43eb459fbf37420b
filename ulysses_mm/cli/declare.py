"""Commands declared from dataclasses, as transformers' ``HfArgumentParser`` does.

A command's options are the fields of its options dataclasses, each declared with
:func:`ulysses_mm.config.parse.option`, the metadata the config schema uses: help, default,
:class:`~ulysses_mm.core.checks.Range`, path kind, choices. :func:`add_fields` turns a
dataclass into flags (the type checks the range and the path; the help is the text, the
range and the default, so each bound is written once), :func:`read` turns parsed
arguments back into the dataclass. The field's annotation gives the flag's shape: ``bool``
a switch, ``int`` / ``float`` a checked number, ``list[int]`` comma-separated integers,
``list[X]`` several words (a positional) or a repeated flag (``repeat=True``),
``int | str`` a count or the one word of ``word=``, ``dict`` a JSON mapping.

:class:`Parser` builds a subcommand's flags only when it is chosen or its help is shown,
so a command that needs torch imports it only when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from ulysses_mm.config.parse import option
from ulysses_mm.core import checks, shipped

# argparse's "argument --x: must be …" from a check's type: read as "--x must be …"
_ARGUMENT = re.compile(r"^argument ([^:]+): ")
_CHOICE = re.compile(r"invalid choice: '([^']*)'")
OVERRIDES = "section.key=value overrides, applied after the file (CLI > file > defaults)"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: message`` (exit 2), instead
    of the usage block and ``error:``; ``--help`` still prints the help. ``declare``, if
    given, adds the parser's arguments the first time it parses or shows its help."""

    def __init__(self, *a: Any, declare: Callable[[Parser], None] | None = None, **kw: Any):
        super().__init__(*a, **kw)
        self._declare = declare
        self.unknown: Callable[[str], str] | None = None  # the line for an unknown command

    def fill(self) -> Parser:
        """Add the declared arguments now (once)."""
        declare, self._declare = self._declare, None
        if declare is not None:
            declare(self)
        return self

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        return self.fill() and super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        return self.fill() and super().format_help()

    def format_usage(self) -> str:
        return self.fill() and super().format_usage()

    def error(self, message: str) -> NoReturn:
        m, choice = _ARGUMENT.match(message), _CHOICE.search(message)
        if choice and self.unknown is not None:
            message = self.unknown(choice[1])
        elif m:
            rest = message[m.end() :]
            message = f"{m[1]} {rest}" if rest.startswith("must ") else f"{m[1]}: {rest}"
        self.exit(2, f"{self.prog}: {' '.join(message.split())}\n")


def leaves(
    parser: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(command words, parser with its arguments) of every leaf command, once each."""
    if isinstance(parser, Parser):
        parser.fill()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield words, parser
        return
    seen: set[int] = set()
    for name, child in subs[0].choices.items():
        if id(child) not in seen:  # an alias names a parser already walked
            seen.add(id(child))
            yield from leaves(child, (*words, name))


def load(target: str | type) -> type:
    """A class, or the class ``"module:Class"`` names, imported now."""
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    cls: type = getattr(importlib.import_module(module), attr)
    return cls


def command(
    sub: argparse._SubParsersAction,
    name: str,
    text: str,
    options: Sequence[str | type],
    run: Callable[..., int],
    description: str | None = None,
    **kw: Any,
) -> Parser:
    """Subcommand ``name``: its arguments are the fields of ``options`` (dataclasses, or
    ``"module:Class"`` imported when the command is chosen), and it runs ``run`` with one
    instance of each."""

    def declare(p: Parser) -> None:
        classes = [load(o) for o in options]
        for cls in classes:
            add_fields(p, cls)
        p.set_defaults(func=lambda args: run(*(read(cls, args) for cls in classes)))

    parser: Parser = sub.add_parser(name, help=text, description=description, declare=declare, **kw)
    return parser


def positional(text: str, path: str | None = None, **cli: Any) -> Any:
    """A required positional argument (``path``: what it must be)."""
    return option(text, path=path, positional=True, **cli)


def overrides(example: str = "") -> Any:
    """The ``section.key=value`` words a command applies over its config file."""
    return option(OVERRIDES + example, factory=list, positional=True)


def _shape(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """(the annotation less ``None``, its arguments): ``int | None`` is ``int``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if len(args) == 1:
            return _shape(args[0])
        return tp, tuple(args)
    return tp, tuple(args)


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def help_text(f: dataclasses.Field) -> str:
    """The field's help, then its range and default: written once, in the declaration."""
    r: checks.Range | None = f.metadata.get("range")
    extra = [str(r)] if r is not None and (r.low is not None or r.high is not None) else []
    if not (f.default is None or f.default is False or f.default in ("", dataclasses.MISSING)):
        extra.append(f"default {_shown(f.default)}")
    return "; ".join([f.metadata.get("help", ""), *extra]).replace("%", "%%")


def _number_type(f: dataclasses.Field, base: Any) -> Callable[[str], Any]:
    r = f.metadata.get("range")
    assert r is not None, f"option {f.name}: a number needs its range (ge/gt/le/lt)"
    if base is float:
        return checks.arg_type("number", lambda v: checks.number(v, within=r), str(r))
    return checks.arg_type("integer", lambda v: checks.integer(v, within=r), str(r))


def _word_or_count(word: str, f: dataclasses.Field) -> Callable[[str], int | str]:
    r = f.metadata["range"]

    def parse(value: str) -> int | str:
        if value == word:
            return value
        try:
            return checks.integer(value, within=r)
        except checks.CheckError:
            raise checks.CheckError(
                f"must be {word} or an integer {r.said}, got {value!r}"
            ) from None

    return checks.arg_type("integer", parse, f"{word} or {r}")


def _mapping(text: str) -> dict:
    """A JSON (or YAML) mapping."""
    import yaml  # lazy: the parser is built on every command; only this option reads YAML

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON mapping, got {text!r}")
    return value


def _type(f: dataclasses.Field, tp: Any, cli: dict[str, Any]) -> dict[str, Any]:
    """The argparse keywords of a field's type: ``type``, ``nargs``, ``action``."""
    base, args = _shape(tp)
    origin = typing.get_origin(base)
    if base is bool:
        return {"action": "store_true"}
    if "path" in f.metadata:
        check = f.metadata["path"]
        fn = {**checks.PATHS, **shipped.PATHS}[check]
        exist = cli.get("exist", False)
        kw: dict[str, Any] = {
            "type": checks.arg_type(
                check,
                lambda v: fn(v, exist=exist) if check.startswith("in_") else fn(v),
                "exists" if exist else "",
            )
        }
        if origin is list:
            kw["nargs"] = cli.get("nargs", "*")
        return kw
    if origin is list and args == (int,):
        r = f.metadata.get("range") or checks.Range(0, checks.INT64_SAFE, high_open=True)
        inc, least = cli.get("increasing", False), cli.get("min_items", 1)
        parse = lambda v: checks.int_list(v, within=r, increasing=inc, min_items=least)  # noqa: E731
        return {
            "type": checks.arg_type("int_list", parse, str(r) + (", increasing" if inc else ""))
        }
    if origin is list:
        kw = {"type": _number_type(f, args[0])} if args[0] in (int, float) else {}
        return (
            {**kw, "action": "append"}
            if cli.get("repeat")
            else {**kw, "nargs": cli.get("nargs", "*")}
        )
    if base in (int, float):
        return {"type": _number_type(f, base)}
    if set(args) == {int, str}:
        return {"type": _word_or_count(cli["word"], f)}
    if base is dict or origin is dict:
        return {"type": _mapping}
    return {}


def add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    """Every field of dataclass ``cls`` as an argument of ``parser``: ``--field-name`` (or
    the field's ``flags``), a positional with ``positional=True``."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not f.init or "help" not in meta:
            continue
        cli = dict(meta.get("cli", {}))
        kw = {"help": help_text(f), **_type(f, hints[f.name], cli)}
        if "choices" in meta:
            kw["choices"] = meta["choices"]
        if "metavar" in cli:
            kw["metavar"] = cli["metavar"]
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kw["default"] = f.default_factory()
        target: Any = parser
        if "group" in cli:
            if cli["group"] not in groups:
                groups[cli["group"]] = parser.add_mutually_exclusive_group()
            target = groups[cli["group"]]
        if cli.get("positional"):
            if "default" in kw and "nargs" not in kw:
                kw["nargs"] = "?"
            target.add_argument(f.name, **kw)
        else:
            flags = cli.get("flags") or ("--" + f.name.replace("_", "-"),)
            required = "default" not in kw
            target.add_argument(*flags, dest=f.name, required=required, **kw)
        for alias, hint in cli.get("aliases", {}).items():
            _add_alias(target, alias, f.name, hint, kw.get("type"))


def _add_alias(parser: Any, alias: str, dest: str, hint: str, type_: Any) -> None:
    """A hidden old spelling of a flag that still works and says, in one line, the new one."""

    class Hinted(argparse.Action):
        def __call__(self, p: Any, namespace: Any, value: Any, option: Any = None) -> None:
            print(f"{p.prog}: {hint}", file=sys.stderr)
            setattr(namespace, dest, value)

    parser.add_argument(alias, dest=dest, type=type_, action=Hinted, help=argparse.SUPPRESS)


def read(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass ``cls`` of what ``args`` holds for its fields (the rest keep their
    defaults)."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})
