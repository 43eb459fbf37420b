"""benchmarks/bench_context_extension.py --quick runs end to end (recall data at three
lengths, the stage-1 run, zero-shot scores with every way's RoPE, one extension stage per
way appended to a copy of the stage-1 run) and writes every curve: keys by way, stage and
length, every bucket's accuracy a fraction of its answers, and a last line of headline
accuracies that are the curves' (the figures themselves are the benchmark's to report)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "bench_context_extension.py"
WAYS = ("plain", "yarn")  # --quick's


def test_quick_run_writes_every_curve(tmp_path):
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
            "--png",
            str(tmp_path / "curves.png"),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    doc = json.loads(out.read_text())
    curves = doc["curves"]
    want = {"base/L0"} | {f"zero_shot/{w}/{f}x" for w in WAYS for f in (2, 4, 8)}
    want |= {f"extended/4x/0.5/{w}" for w in WAYS}
    assert set(curves) == want
    for name, curve in curves.items():
        assert curve, name
        for b in curve:
            assert b["lo"] < b["hi"] and b["answers"] >= 0, (name, b)
            if b["answers"]:
                hits = b["accuracy"] * b["answers"]
                assert abs(hits - round(hits)) < 1e-6, (name, b)  # a fraction of its answers
                assert b["bits"] >= 0
    last = res.stdout.strip().splitlines()[-1]
    figures = {k: float(v) for k, v in (pair.split("=", 1) for pair in last.split())}
    assert set(figures) == set(doc["headline"])
    assert all(math.isclose(figures[k], v, abs_tol=1e-4) for k, v in doc["headline"].items())
    base = [b["accuracy"] for b in curves["base/L0"] if b["answers"]]
    assert math.isclose(figures["L0_min_bucket_acc"], min(base), abs_tol=1e-4)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    # --replot reports the same figures from the JSON alone
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--replot", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1] == last
