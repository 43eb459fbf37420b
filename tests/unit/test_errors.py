"""A user error is one line; a bug keeps its traceback (the CLI catches only UserError)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ulysses_mm.core import errors

# Run the CLI with ulysses_mm.config.load_config replaced by one that raises ``EXC``.
_PROBE = """
import sys
import ulysses_mm.cli.setup as cli_setup
from ulysses_mm.cli import main
from ulysses_mm.core import errors

def boom(*a, **k):
    raise eval(sys.argv[1])

cli_setup.load_config = boom
raise SystemExit(main(["config", "configs/debug-tiny.yaml"]))
"""


def _run(exc: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, exc], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "exc",
    [
        'ValueError("deep inside numpy: operands could not be broadcast")',
        'FileNotFoundError(2, "No such file", "/nowhere/x.npy")',
        'KeyError("head")',
        'IndexError("list index out of range")',
        'RuntimeError("boom")',
    ],
)
def test_a_bug_shows_its_traceback_and_exits_1(exc):
    proc = _run(exc)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert "in boom" in proc.stderr  # the frame that raised is shown


USER_ERRORS = [
    (errors.ConfigError, "config error: "),
    (errors.DataError, ""),
    (errors.StorageError, ""),
    (errors.NotFoundError, ""),
    (errors.RangeError, ""),
    (errors.UnsupportedError, ""),
    (errors.WorkerError, ""),
]


@pytest.mark.parametrize(("cls", "prefix"), USER_ERRORS, ids=lambda c: getattr(c, "__name__", ""))
def test_a_user_error_is_one_line_with_its_exit_code(cls, prefix):
    proc = _run(f'errors.{cls.__name__}("shards/x.tar: sample 3 lacks tokens.npy")')
    assert proc.returncode == cls.exit_code, proc.stderr
    assert proc.stderr == f"ulysses-mm config: {prefix}shards/x.tar: sample 3 lacks tokens.npy\n"


def test_user_errors_keep_the_builtin_a_caller_expects():
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.DataError, ValueError)
    assert issubclass(errors.NotFoundError, FileNotFoundError)
    assert issubclass(errors.RangeError, IndexError)
    assert issubclass(errors.UnsupportedError, RuntimeError)
    assert not issubclass(ValueError, errors.UserError)
    assert errors.WorkerError.exit_code == 1 and errors.UserError.exit_code == 2
