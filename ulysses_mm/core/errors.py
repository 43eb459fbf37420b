"""User errors and bugs are different things.

A :class:`UserError` is something the user can fix — a config value, a bad input file or
shard, a layout that cannot work, a server that stayed unreachable after the retries, a
checksum that does not match. Its message says what is wrong and where, and the CLI
prints it as one line (exit :attr:`UserError.exit_code`). Anything else is a bug and keeps
its traceback. Torch-free, so the CLI imports it cheaply.

Each subclass also derives from the builtin a caller would expect (``ValueError`` for a
bad value, ``OSError`` for storage), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; ``str(e)`` is the one line the CLI prints."""

    exit_code = 2
    prefix = ""  # printed before the message ("config error: ")


class ConfigError(UserError, ValueError):
    """A configuration value or key is invalid; the message names the key's full path."""

    prefix = "config error: "


class DataError(UserError, ValueError):
    """An input file, shard, manifest or checkpoint is not what it must be; the message
    names it."""


class StorageError(UserError, OSError):
    """A location cannot be read or written (missing, refused, still failing after the
    retries); the message names it."""


class NotFoundError(StorageError, FileNotFoundError):
    """A file or directory the user named (or a run needs) does not exist."""


class RangeError(UserError, IndexError):
    """An index the user gave (a sample, a shard) is out of range."""


class UnsupportedError(UserError, RuntimeError):
    """What was asked for cannot run here (a kernel, a backend, a device, a launcher)."""


class WorkerError(UserError, RuntimeError):
    """A rank failed; the message is one line naming the rank, the traceback is in the
    rank's log file."""

    exit_code = 1


def first_line(e: BaseException) -> str:
    """``Type: the first line of its message`` (a bare ``Type`` when the message is empty,
    as a timeout's often is)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


class Interrupted(UserError):
    """A signal ended the command before it could stop cleanly (the launcher was
    signalled, or a second signal came): exit 128 + the signal's number, as a shell
    reports a process a signal ended."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
