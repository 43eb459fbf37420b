"""benchmarks/bench_context_extension.py --quick runs end to end (probe data at two
lengths, the L0 training, export, one extension run per RoPE way from the export, the
scores) and ends in its key=value line: every expected key, every value finite (the
figures themselves are the benchmark's to report, not this test's)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "bench_context_extension.py"
WAYS = ("plain", "theta", "linear", "yarn", "llama3")
KEYS = {
    "L0_first_bits",
    "L0_copy_bits",
    "L1_plain_first_bits_before",
    "L1_plain_copy_bits_before",
    "wall_s",
} | {f"{w}_{k}" for w in WAYS for k in ("step1_loss", "final_loss", "first_bits", "copy_bits")}


def test_quick_run_ends_in_finite_figures(tmp_path):
    out = tmp_path / "figures.json"
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--out",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    last = res.stdout.strip().splitlines()[-1]
    figures = dict(pair.split("=", 1) for pair in last.split())
    assert set(figures) == KEYS, last
    values = {k: float(v) for k, v in figures.items()}
    assert all(math.isfinite(v) for v in values.values()), last
    assert json.loads(out.read_text()).keys() == KEYS
