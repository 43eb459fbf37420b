"""The CLI stays thin: commands are declared from their options dataclasses, so cli/ holds
no long argparse builders (a budget of lines and of function length), and its output
stops quietly when the reader leaves."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ulysses_mm.cli

CLI = Path(ulysses_mm.cli.__file__).parent
MAX_LINES = 852  # two thirds of the CLI before its commands were declared from dataclasses
MAX_FUNCTION_LINES = 60


def test_cli_is_declared_not_written_out():
    files = sorted(CLI.glob("*.py"))
    total = sum(len(p.read_text().splitlines()) for p in files)
    assert total <= MAX_LINES, f"cli/ is {total} lines (budget {MAX_LINES})"
    long = [
        f"{p.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for p in files
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


def test_a_reader_that_leaves_ends_the_command_quietly():
    """``ulysses-mm configs | head -1``: no BrokenPipeError traceback, SIGPIPE's status."""
    cmd = [sys.executable, "-c", "from ulysses_mm.cli import main; raise SystemExit(main())"]
    proc = subprocess.Popen(
        [*cmd, "configs"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes: its first print meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err, err
