"""``ulysses-mm pipelines`` and ``ulysses-mm configs``: what ships by name, one line each;
``ulysses-mm configs NAME`` prints one file, to read or to copy and edit."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ulysses_mm.core.resources import resource
from ulysses_mm.core.shipped import FOLDERS, SUFFIX, describe, names

# folder -> the command that runs one of its files by name
_RUNS = {"pipelines": "prepare", "configs": "train"}


def _cmd(args: argparse.Namespace) -> int:
    folder = args.command
    if args.name is not None:
        print(resource(folder).joinpath(f"{args.name}{SUFFIX}").read_text(encoding="utf-8"), end="")
        return 0
    rows = describe(folder)
    width = max(len(name) for name, _ in rows)
    for name, text in rows:
        print(f"{name:<{width}}  {text}")
    print(
        f"(in {resource(folder)}; `ulysses-mm {folder} NAME` prints one, "
        f"`ulysses-mm {_RUNS[folder]} NAME` runs it)"
    )
    return 0


def _name_of(folder: str) -> Callable[[str], str]:
    """An argparse ``type=``: a name ``folder`` ships, else one line listing them."""

    def check(value: str) -> str:
        if value not in names(folder):
            raise argparse.ArgumentTypeError(
                f"no shipped {FOLDERS[folder]} {value!r} (shipped: {', '.join(names(folder))})"
            )
        return value

    return check


def add(sub: argparse._SubParsersAction) -> None:
    """Both listing commands."""
    for folder, what in FOLDERS.items():
        p = sub.add_parser(
            folder,
            help=f"list the shipped {what}s by name, or print one",
            description=(
                f"The {what}s that ship with the package, one line each; any command that "
                f"takes a {what} file also takes one of these names (a local file of the "
                "same name wins)."
            ),
        )
        p.add_argument(
            "name",
            nargs="?",
            default=None,
            type=_name_of(folder),
            metavar="NAME",
            help=f"print this {what}",
        )
        p.set_defaults(func=_cmd)
