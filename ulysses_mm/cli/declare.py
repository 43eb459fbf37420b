"""Commands declared from dataclasses, as transformers' ``HfArgumentParser`` does.

A command's arguments are the fields of its dataclasses, each declared with
:func:`ulysses_mm.config.parse.option`, the metadata the config schema uses: help, default,
:class:`~ulysses_mm.core.checks.Range`, path kind, choices. :func:`add_fields` turns a
dataclass into arguments (the type checks the range or the path; the help shows the range
and the default, so each bound is written once), :func:`read` turns them back into the
dataclass. The annotation gives the shape: ``bool`` a switch, ``int`` / ``float`` a
checked number, ``list[int]`` comma-separated integers, ``list[X]`` several words (or a
repeated flag, ``repeat=True``), ``int | str`` a count or the one word ``word=``, ``dict``
a JSON mapping. The first dataclass's docstring is the command's description and its
``main()`` carries the command out, given the others.

:class:`Parser` adds a command's arguments only once it is chosen or its help shown.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from ulysses_mm.core import checks, shipped

_ARGUMENT = re.compile(r"^argument ([^:]+): ")  # "argument --x: must be …" reads "--x must be …"
_CHOICE = re.compile(r"invalid choice: '([^']*)'")
_PATHS = {**checks.PATHS, **shipped.PATHS}  # what a path must be: a file, a shipped name, …


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: message`` (exit 2), instead
    of the usage block and ``error:``; ``--help`` still prints the help. ``declare``, if
    given, adds the arguments the first time the parser parses or shows its help;
    ``unknown`` words the line for an unknown subcommand."""

    def __init__(self, *a: Any, declare: Callable[[Parser], None] | None = None, **kw: Any):
        super().__init__(*a, **kw)
        self._declare = declare
        self.unknown: Callable[[str], str] | None = None

    def fill(self) -> None:
        """Add the declared arguments now (once)."""
        declare, self._declare = self._declare, None
        if declare is not None:
            declare(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.fill()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.fill()
        return super().format_help()

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
    sub: argparse._SubParsersAction, name: str, text: str, options: Sequence[str | type], **kw: Any
) -> Parser:
    """Subcommand ``name``: its arguments are the fields of ``options`` (dataclasses, or
    ``"module:Class"`` imported when the command is chosen); the first one's ``main()``
    carries it out, given an instance of each of the others."""

    def declare(p: Parser) -> None:
        classes = [load(o) for o in options]
        for cls in classes:
            add_fields(p, cls)
        doc = classes[0].__doc__ or ""
        if p.description is None and not doc.startswith(f"{classes[0].__name__}("):
            p.description = inspect.cleandoc(doc).replace("``", "")  # a docstring of its own
        p.set_defaults(func=lambda args: _main([read(cls, args) for cls in classes]))

    parser: Parser = sub.add_parser(name, help=text, declare=declare, **kw)
    return parser


def _main(parsed: list[Any]) -> int:
    return int(parsed[0].main(*parsed[1:]))


def _shape(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """(the annotation less ``None``, its arguments): ``int | None`` is ``int``."""
    args = tuple(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return _shape(args[0])
    return tp, args


def help_text(f: dataclasses.Field) -> str:
    """The field's help, then its range and default: written once, in the declaration."""
    r: checks.Range | None = f.metadata.get("range")
    extra = [str(r)] if r is not None and (r.low is not None or r.high is not None) else []
    if not (f.default is None or f.default is False or f.default in ("", dataclasses.MISSING)):
        extra.append(
            f"default {f.default:g}" if isinstance(f.default, float) else f"default {f.default}"
        )
    return "; ".join([f.metadata.get("help", ""), *extra]).replace("%", "%%")


def _checked(f: dataclasses.Field, tp: Any, word: str | None = None) -> Callable[[str], Any]:
    """The ``type=`` of a number of ``tp`` within the field's range (or the one ``word``)."""
    r = f.metadata.get("range")
    assert r is not None, f"option {f.name}: a number needs its range (ge/gt/le/lt)"
    check = checks.number if tp is float else checks.integer

    def parse(value: str) -> Any:
        if word is not None and value == word:
            return value
        try:
            return check(value, within=r)
        except checks.CheckError:
            if word is None:
                raise
            raise checks.CheckError(r.refusal("", repr(value), f"{word} or an integer")) from None

    return checks.arg_type("number" if tp is float else "integer", parse, str(r), r)


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


def _shaped(f: dataclasses.Field, tp: Any, cli: dict[str, Any]) -> dict[str, Any]:
    """The argparse keywords of a field's annotation: ``type``, ``nargs``, ``action``."""
    base, args = _shape(tp)
    many = typing.get_origin(base) is list
    if base is bool:
        return {"action": "store_true"}
    if "path" in f.metadata:
        check, exist = f.metadata["path"], cli.get("exist", False)
        fn = _PATHS[check]
        parse = (lambda v: fn(v, exist=exist)) if check.startswith("in_") else fn
        kw: dict[str, Any] = {"type": checks.arg_type(check, parse, "exists" if exist else "")}
        return {**kw, "nargs": cli.get("nargs", "*")} if many else kw
    if many and args == (int,) and not cli.get("repeat"):
        r = f.metadata.get("range") or checks.Range(0, checks.INT64_SAFE, high_open=True)
        inc, least = cli.get("increasing", False), cli.get("min_items", 1)
        ints = lambda v: checks.int_list(v, within=r, increasing=inc, min_items=least)  # noqa: E731
        return {"type": checks.arg_type("int_list", ints, f"{r}{', increasing' if inc else ''}", r)}
    if many:
        kw = {"type": _checked(f, args[0])} if args[0] in (int, float) else {}
        return (
            {**kw, "action": "append"}
            if cli.get("repeat")
            else {**kw, "nargs": cli.get("nargs", "*")}
        )
    if base in (int, float):
        return {"type": _checked(f, base)}
    if set(args) == {int, str}:
        return {"type": _checked(f, int, cli["word"])}
    return {"type": _mapping} if base is dict else {}


def add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    """Every field of dataclass ``cls`` that has help as an argument of ``parser``:
    ``--field-name`` (or the field's ``flags``; ``aliases``: hidden old spellings with a
    one-line hint), or a positional with ``positional=True``."""
    hints = typing.get_type_hints(cls)
    exclusive: dict[str, Any] = {}  # mutually exclusive flags, by the name they share
    for f in dataclasses.fields(cls):
        if not f.init or "help" not in f.metadata:
            continue
        cli = dict(f.metadata.get("cli", {}))
        kw = {"help": help_text(f), **_shaped(f, hints[f.name], cli)}
        kw.update({k: cli[k] for k in ("metavar",) if k in cli})
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kw["default"] = f.default_factory()
        target: Any = parser
        if "exclusive" in cli:
            if cli["exclusive"] not in exclusive:
                exclusive[cli["exclusive"]] = parser.add_mutually_exclusive_group()
            target = exclusive[cli["exclusive"]]
        if cli.get("positional"):
            nargs = {"nargs": "?"} if "default" in kw and "nargs" not in kw else {}
            target.add_argument(f.name, **kw, **nargs)
            continue
        flags = cli.get("flags") or ("--" + f.name.replace("_", "-"),)
        target.add_argument(*flags, dest=f.name, required="default" not in kw, **kw)
        for alias, hint in cli.get("aliases", {}).items():
            hidden = {"dest": f.name, "type": kw.get("type"), "help": argparse.SUPPRESS}
            target.add_argument(alias, action=_hinted(hint), **hidden)


def _hinted(hint: str) -> type[argparse.Action]:
    """An old spelling of a flag: it still works, and says the new one in one line."""

    class Hinted(argparse.Action):
        def __call__(self, p: Any, namespace: Any, value: Any, flag: Any = None) -> None:
            print(f"{p.prog}: {hint}", file=sys.stderr)
            setattr(namespace, self.dest, value)

    return Hinted


def read(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass ``cls`` of what ``args`` holds for its fields (others keep defaults)."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})
