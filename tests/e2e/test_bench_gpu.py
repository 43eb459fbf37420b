"""benchmarks/gpu/bench_gpu.py off the GPU: it skips cleanly without CUDA, plans the GPU
sweep from the memory estimate, and its whole path (engine per SP size, sweep, simulated
out-of-memory — raised as the plain RuntimeError some paths raise —, fresh-process probes,
JSON and PNG) runs on CPU processes with tiny sizes, as does a worker that fails before its
first length.
On a machine with a GPU, the ``gpu`` test runs it for real on the debug model."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.tools.estimate import EstimateOptions, max_seq_len

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "bench_gpu.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_skips_cleanly_without_a_gpu():
    res = _run()
    assert res.returncode == 0, res.stderr
    assert "no GPU: skipped" in res.stdout


def test_plan_for_one_and_eight_gpus():
    bench = _module()
    args = bench.resolve(bench.build_parser().parse_args([]))
    assert args.config == REPO / "configs" / "llama-1b.yaml" and args.doc_len == 32768
    plan = bench.make_plan(args, n_gpus=1, gpu_mem_gib=139.8)
    assert list(plan["sp"]) == [1]
    spec = plan["sp"][1]
    cfg = load_config(RunConfig, REPO / "configs" / "llama-1b.yaml")
    longest, _ = max_seq_len(cfg, EstimateOptions(gpu_mem_gib=139.8, gpus=1, sp=1))
    assert spec["estimated_max"] == longest > 0
    lengths = spec["lengths"]
    assert lengths[0] == 8192 and lengths[-1] <= longest < 2 * lengths[-1]
    assert all(b == 2 * a for a, b in itertools.pairwise(lengths))
    plan8 = bench.make_plan(args, n_gpus=8, gpu_mem_gib=79.6)
    assert list(plan8["sp"]) == [1, 2, 4, 8]
    for sp, spec in plan8["sp"].items():
        assert spec["cfg"].parallel.sp == sp and spec["cfg"].parallel.dp == 1
        assert spec["lengths"][0] == 8192 * sp and all(n % sp == 0 for n in spec["lengths"])
    # more GPUs in the SP group: a longer estimated fit
    fits = [plan8["sp"][sp]["estimated_max"] for sp in (1, 2, 4, 8)]
    assert fits == sorted(fits) and fits[0] < fits[-1]
    assert plan8["sp"][1]["cfg"].parallel.backend == "auto"


def test_cpu_smoke_plan_never_takes_nccl():
    """--device cpu means gloo, even on a machine with GPUs."""
    bench = _module()
    args = bench.resolve(bench.build_parser().parse_args(["--device", "cpu"]))
    plan = bench.make_plan(args, n_gpus=2, gpu_mem_gib=None)
    assert {spec["cfg"].parallel.backend for spec in plan["sp"].values()} == {"gloo"}


def test_cpu_smoke_run_sweeps_probes_and_writes_json_and_png(tmp_path: Path):
    out = tmp_path / "bench"
    res = _run(
        "train.peak_tflops=0.1",  # a CPU has no known peak; MFU needs one
        "--device",
        "cpu",
        "--out",
        str(out),
        "--sp",
        "1",
        "2",
        "--seq-lens",
        "256",
        "512",
        "--simulate-oom-at",
        "512",
        "--max-probes",
        "1",
        "--steps",
        "1",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "bench_gpu.json").read_text())
    assert data["config"] == "configs/debug-tiny.yaml" and data["device"] == "cpu"
    by = {(p["sp"], p["seq_len"]): p for p in data["points"]}
    for sp in (1, 2):
        ok = by[(sp, 256)]
        assert ok["status"] == "ok" and ok["tokens_per_s"] > 0 and 0 < ok["mfu"] < 1
        # the measured peak is the estimate's (the CPU tensor figure) within 15 %
        assert ok["peak_gib"] * 2**30 == pytest.approx(ok["est_peak"], rel=0.15)
        assert by[(sp, 512)]["status"] == "oom"
    # SP=1 probes between 256 (trained) and 512 (out of memory) at 128-token resolution
    one = data["longest"]["1"]
    assert one["failed"] == 512 and one["probes"][0]["seq_len"] == 384
    assert one["probes"][0]["status"] == "ok" and one["trained"] == 384
    # SP=2: 256-token resolution leaves nothing between 256 and 512 to probe
    two = data["longest"]["2"]
    assert (two["trained"], two["failed"], two["probes"]) == (256, 512, [])
    assert (out / "bench_gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".progress_*"))
    assert "SP=1: longest sequence that trained 384, shortest that did not 512" in res.stdout


def test_out_of_memory_is_recognised_whatever_exception_carries_it():
    bench = _module()
    assert bench.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    # some releases and paths (cuBLAS, NCCL, the caching allocator's retry) raise plain ones
    assert bench.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert bench.is_oom(RuntimeError("NCCL error: unhandled cuda error, out of memory"))
    assert not bench.is_oom(RuntimeError("shape '[2, 8]' is invalid for input of size 3"))
    assert not bench.is_oom(ValueError("out of memory"))  # not a runtime failure


def test_a_worker_failing_before_its_first_length_is_reported(tmp_path: Path):
    """The engine cannot be built (an explicit flash_varlen without flash-attn or a GPU):
    no length ever starts, yet the JSON and PNG are written and name the real cause."""
    out = tmp_path / "bench"
    res = _run(
        "--device",
        "cpu",
        "--out",
        str(out),
        "--sp",
        "1",
        "--seq-lens",
        "256",
        "--max-probes",
        "0",
        "--steps",
        "1",
        "deepspeed.precision=bf16",
        "parallel.attention=flash_varlen",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "bench_gpu.json").read_text())
    assert data["points"] == []  # no made-up point at seq_len 0
    error = data["longest"]["1"]["error"]
    assert error.startswith("failed before its first length: UnsupportedError: ")
    assert "needs flash-attn and a CUDA GPU" in error and "(rank 0)" in error
    assert data["longest"]["1"]["trained"] == 0
    assert (out / "bench_gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SP=1: failed before its first length: UnsupportedError:" in res.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_run_on_the_debug_model(tmp_path: Path):
    res = _run(
        "--config",
        str(REPO / "configs" / "debug-tiny.yaml"),
        "--out",
        str(tmp_path),
        "--sp",
        "1",
        "--seq-lens",
        "8192",
        "16384",
        "--max-probes",
        "0",
        "--budget-s",
        "180",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp_path / "bench_gpu.json").read_text())
    ok = [p for p in data["points"] if p["status"] == "ok"]
    assert len(ok) == 2 and all(p["tokens_per_s"] > 0 and p["peak_gib"] > 0 for p in ok)
