"""Errors the CLI turns into one line (torch-free, so the CLI imports it cheaply)."""


class WorkerError(RuntimeError):
    """A rank failed; the message is one line naming the rank, the traceback is in the
    rank's log file."""
