"""What every subcommand's parser shares: the one-line error and the overrides' help."""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

# argparse's "argument --x: must be …" from a check's type: read as "--x must be …"
_ARGUMENT = re.compile(r"^argument ([^:]+): ")


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: message`` (exit 2), instead
    of the usage block and ``error:``; ``--help`` still prints the help."""

    def error(self, message: str) -> NoReturn:
        m = _ARGUMENT.match(message)
        if m:
            rest = message[m.end() :]
            message = f"{m[1]} {rest}" if rest.startswith("must ") else f"{m[1]}: {rest}"
        line = " ".join(message.split())
        self.exit(2, f"{self.prog}: {line}\n")


def overrides_help() -> str:
    return "section.key=value overrides, applied after the file (CLI > file > defaults)"
