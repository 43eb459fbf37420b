"""``ulysses-mm pipelines`` and ``ulysses-mm configs``: what ships by name, one line each;
``ulysses-mm configs NAME`` prints one file, to read or to copy and edit."""

from __future__ import annotations

import argparse
import functools

from ulysses_mm.core.checks import CheckError
from ulysses_mm.core.shipped import FOLDERS, listing, shipped_name


def _name(folder: str, value: str) -> str:
    try:
        return shipped_name(folder, value)
    except CheckError as e:  # argparse prints an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(e)) from None


def _cmd(args: argparse.Namespace) -> int:
    print(listing(args.command, args.name), end="")
    return 0


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
            type=functools.partial(_name, folder),
            metavar="NAME",
            help=f"print this {what}",
        )
        p.set_defaults(func=_cmd)
