"""Every benchmark runs end to end at its smallest size (``--smoke``), ends its output with
its ``key=value`` line and writes its figures as
``<results dir>/<bench>_<hardware>_<date>.json`` (a temporary directory here, through
``ULYSSES_MM_BENCH_RESULTS``). The figures themselves are each benchmark's to report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

BENCH = REPO / "benchmarks"
# every script, with what its smoke run needs besides --smoke
SCRIPTS: dict[str, list[str]] = {
    "bench_a2a_bytes.py": [],
    "bench_async_save.py": [],
    "bench_audio.py": [],
    "bench_context_extension.py": ["--ways", "plain"],
    "bench_dna.py": [],
    "bench_dp_balance.py": [],
    "bench_estimate.py": [],
    "bench_estimate_time.py": [],
    "bench_generate.py": ["--device", "cpu"],
    "bench_head_groups.py": [],
    "bench_hf_backend.py": [],
    "bench_loader.py": [],
    "bench_pack.py": [],
    "bench_preemption.py": [],
    "bench_prepare_scale.py": [],
    "bench_rank_balance.py": [],
    "bench_ring_vs_ulysses.py": [],
    "bench_sp_memory.py": [],
    "bench_ulysses_vs_deepspeed.py": [],
    "bench_video.py": [],
    "bench_video_codec.py": [],
    "bench_video_tokens.py": [],
    "gpu/bench_gpu.py": ["--out", "{tmp}/bench-gpu"],
}


def test_every_benchmark_is_listed():
    scripts = {p.relative_to(BENCH).as_posix() for p in BENCH.rglob("bench_*.py")}
    assert scripts == set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_smoke_run_writes_its_figures(script: str, tmp_path: Path):
    env = {**os.environ, "ULYSSES_MM_BENCH_RESULTS": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke"]
        + [a.format(tmp=tmp_path) for a in SCRIPTS[script]],
        cwd=REPO,  # the scripts name configs/ relative to the repository
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    last = res.stdout.strip().splitlines()[-1]
    assert "=" in last and " " not in last.split("=")[0], last
    name = Path(script).stem
    (written,) = tmp_path.glob(f"{name}_*_*.json")
    doc = json.loads(written.read_text())
    assert doc["bench"] == name and doc["smoke"] is True and doc["figures"]
    assert written.name == f"{name}_{doc['hardware']}_{doc['date']}.json"
