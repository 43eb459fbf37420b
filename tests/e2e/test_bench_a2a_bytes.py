"""benchmarks/bench_a2a_bytes.py prints its table without the profiler's chatter."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "bench_a2a_bytes.py"

# Load the benchmark as its workers do (module code only, not main), then profile as the
# worker does: Kineto's profiler_start / profiler_stop lines must not reach stderr.
PROBE = f"""
import importlib.util, torch
spec = importlib.util.spec_from_file_location("bench", {str(SCRIPT)!r})
spec.loader.exec_module(importlib.util.module_from_spec(spec))
from torch.profiler import profile
with profile(record_shapes=True) as prof:
    torch.ones(4) + 1
assert any(e.name for e in prof.events())  # the profile still records
print("row")
"""


def test_profiler_lines_are_silenced():
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    res = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "row"
    assert "profiler_start" not in res.stderr and "profiler_stop" not in res.stderr, res.stderr
