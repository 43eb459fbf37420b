"""Errors the CLI turns into one line (torch-free, so the CLI imports it cheaply)."""


class WorkerError(RuntimeError):
    """A rank failed; the message is one line naming the rank, the traceback is in the
    rank's log file."""


def first_line(e: BaseException) -> str:
    """``Type: the first line of its message`` (a bare ``Type`` when the message is empty,
    as a timeout's often is)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
