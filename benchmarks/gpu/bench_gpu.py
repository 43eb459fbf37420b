"""GPU benchmark: tokens/s, MFU and peak memory against sequence length, and the longest
sequence that trains.

On one GPU: a sweep of sequence lengths N (doubling from --min-len up to the memory
estimate's longest fit) at SP=1 on one DeepSpeed engine of the run config (default
configs/llama-1b.yaml: bf16, ZeRO-2, checkpointed, tiled), synthetic packed data
(documents of --doc-len tokens, all of the widest-head modality), flash-attn's varlen
kernel when it is installed (``parallel.attention=auto``), SDPA otherwise. Where several
GPUs are visible, the same at SP = 2, 4, 8 (those that fit the GPUs and divide the heads),
one process per GPU (torch's elastic launcher, NCCL). Per point: the mean of --steps
training steps after a warm-up, tokens/s, MFU (model FLOPs of
``ulysses_mm.train.flops.train_flops`` / step time / (GPUs × peak TFLOP/s)), the peak of
``torch.cuda.max_memory_allocated`` over the ranks, and ``ulysses-mm estimate``'s figures
beside it.

The longest sequence that trains: the sweep stops at the first out-of-memory; then fresh
processes probe the estimate's longest fit and bisect between the longest length that
trained and the shortest that did not, while the budget allows (--max-probes). The run
keeps to --budget-s: before each point the time of the next one is predicted from the last
(linear in N: documents have a fixed length) and the point is skipped when it would not
finish in time.

Writes OUT/bench_gpu.json and OUT/bench_gpu.png (atomically). No downloads, synthetic data.
Where CUDA is absent it prints "no GPU: skipped" and exits 0, unless --device cpu: a smoke
run of the same code on CPU processes (gloo) with tiny sizes (the tests run it). --dry-run
prints the plan and runs nothing.

    python benchmarks/gpu/bench_gpu.py                      # within --budget-s (420 s)
    python benchmarks/gpu/bench_gpu.py --config configs/llama3-8b.yaml --sp 8
    python benchmarks/gpu/bench_gpu.py --device cpu --out build/bench-cpu   # smoke run
    python benchmarks/gpu/bench_gpu.py --memory-mode none   # without offload and layer tiles

``--memory-mode`` sets the memory modes (``model.offload_checkpoints``,
``model.layer_tile_tokens``): as the config has them (the shipped GPU configs: both on),
none, one or both; ``--head-groups C`` runs attention in C head groups
(``parallel.head_groups``); the estimate beside each point counts the same settings.

    python benchmarks/gpu/bench_gpu.py --config configs/llama3-8b.yaml --head-groups 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

os.environ.setdefault("OMP_NUM_THREADS", "1")

GiB = 1 << 30


# ----------------------------------------------------------------------------- workers


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def is_oom(e: BaseException) -> bool:
    """An out-of-memory, whether torch raised its OutOfMemoryError or a plain RuntimeError
    with the allocator's message ("CUDA out of memory", NCCL/cuBLAS "out of memory")."""
    import torch

    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def _cause(e: BaseException) -> str:
    first = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def recorded_worker(*args: Any) -> None:
    """:func:`sweep_worker`, and any failure it did not record itself (one before the
    first length: building the engine, joining the world) appended to the progress file
    with its cause, so that the report can show it."""
    try:
        sweep_worker(*args)
    except BaseException as e:
        if not getattr(e, "_bench_recorded", False):
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
            _append(
                args[5],
                {"event": "error", "rank": rank, "oom": is_oom(e), "error": _cause(e)},
            )
        raise


def sweep_worker(
    cfg_dict: dict[str, Any],
    lengths: list[int],
    doc_len: int,
    steps: int,
    deadline: float,
    progress: str,
    simulate_oom_at: int,
) -> None:
    """On every rank of a launched world: build the engine once, then measure each length
    in turn. Rank 0 appends events to ``progress`` (JSON lines); a rank that runs out of
    memory records it and raises, so the launcher stops the world. ``simulate_oom_at``
    raises an out-of-memory as the allocator of some releases does: a plain RuntimeError."""
    import torch
    import torch.distributed as dist

    from ulysses_mm.config import RunConfig, from_dict
    from ulysses_mm.parallel.mesh import open_world
    from ulysses_mm.tools.measure import StepRunner
    from ulysses_mm.train.flops import peak_tflops

    cfg = from_dict(RunConfig, cfg_dict)
    place = open_world(cfg)
    mesh = place.mesh
    rank0 = mesh.rank == 0
    t_build = time.time()
    runner = StepRunner(cfg, place)
    tflops = peak_tflops(cfg, runner.device) or float("nan")  # unknown peak: MFU nan
    if rank0:
        _append(
            progress, {"event": "ready", "build_s": time.time() - t_build, "kernel": runner.kernel}
        )
    last: tuple[int, float] | None = None
    try:
        for n in lengths:
            # rank 0 decides (from its clock) whether the point fits the budget; all follow
            go = torch.ones(1, device=runner.device)
            if rank0 and last is not None:
                predicted = (steps + 1) * last[1] * n / last[0]
                if time.time() + predicted > deadline:
                    go.zero_()
                    _append(progress, {"event": "skip", "seq_len": n, "predicted_s": predicted})
            if mesh.distributed:
                dist.broadcast(go, 0)
            if not bool(go.item()):
                break
            if rank0:
                _append(progress, {"event": "start", "seq_len": n})
            try:
                if simulate_oom_at and n >= simulate_oom_at:
                    raise RuntimeError(f"CUDA out of memory (simulated at {n} tokens)")
                m = runner.measure(n, doc_len, steps)
            except Exception as e:
                event = "oom" if is_oom(e) else "error"
                _append(
                    progress,
                    {"event": event, "seq_len": n, "rank": mesh.rank, "error": _cause(e)},
                )
                e._bench_recorded = True  # type: ignore[attr-defined]
                raise
            peak = torch.tensor([float(m.peak)], device=runner.device)
            if mesh.distributed:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            last = (n, m.step_s)
            if rank0:
                rec = m.to_dict()
                rec.update(
                    event="done",
                    peak=int(peak.item()),
                    mfu=m.flops / m.step_s / (mesh.world_size * tflops * 1e12),
                    peak_tflops=tflops,
                )
                _append(progress, rec)
    finally:
        runner.close()


# ----------------------------------------------------------------------------- plan


def _pow2_lengths(lo: int, hi: int, granule: int) -> list[int]:
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 2
    return [x for x in out if x % granule == 0]


def make_plan(args: argparse.Namespace, n_gpus: int, gpu_mem_gib: float | None) -> dict:
    from ulysses_mm.config import RunConfig, load_config
    from ulysses_mm.tools.estimate import EstimateOptions, max_seq_len

    base = load_config(RunConfig, args.config, args.overrides)
    heads = base.model.num_attention_heads
    sps = args.sp or [p for p in (1, 2, 4, 8) if p <= n_gpus and heads % p == 0]
    cuda = args.device == "cuda"
    plan: dict[str, Any] = {"sp": {}, "gpu_mem_gib": gpu_mem_gib}
    for sp in sps:
        if sp > n_gpus:
            raise SystemExit(f"--sp {sp} needs {sp} GPUs; {n_gpus} visible")
        cfg = load_config(
            RunConfig,
            args.config,
            [
                *args.overrides,
                f"parallel.sp={sp}",
                "parallel.dp=1",
                f"parallel.timeout_s={args.collective_timeout}",
                *([] if cuda else ["parallel.backend=gloo"]),  # --device cpu: never NCCL
            ],
        )
        granule = sp * args.granularity
        est_max = None
        if gpu_mem_gib:
            est_max, _ = max_seq_len(
                cfg,
                EstimateOptions(
                    gpu_mem_gib=gpu_mem_gib, gpus=sp, sp=sp, device="cuda" if cuda else "cpu"
                ),
            )
        if args.seq_lens:
            lengths = [n for n in args.seq_lens if n % sp == 0]
        else:
            top = est_max or args.min_len * sp * 64
            lengths = _pow2_lengths(args.min_len * sp, top, sp)
        plan["sp"][sp] = {
            "cfg": cfg,
            "lengths": lengths,
            "estimated_max": est_max,
            "granule": granule,
        }
    return plan


def _estimates(cfg: Any, n: int, sp: int, device: str, gpu_mem_gib: float | None) -> dict:
    from ulysses_mm.tools.estimate import EstimateOptions, estimate

    e = estimate(cfg, n, EstimateOptions(gpus=sp, sp=sp, device=device, gpu_mem_gib=gpu_mem_gib))
    return {"est_peak": e.peak, "est_total": e.total, "est_fits": e.fits}


# ----------------------------------------------------------------------------- running


def _launch(sp: int, *args: Any) -> tuple[bool, str]:
    from ulysses_mm.parallel.launch import launch_local

    try:
        launch_local(recorded_worker, sp, *args)
        return True, ""
    except Exception as e:  # a worker failed (out of memory, or an error): its log says
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _worker_error(events: list[dict[str, Any]], launch_error: str) -> str:
    """The real cause of a failed launch: the first error a worker recorded, else what
    the launcher said."""
    for e in events:
        if e["event"] == "error":
            return f"{e['error']} (rank {e['rank']})"
    return launch_error


def _read(progress: str) -> list[dict[str, Any]]:
    if not os.path.exists(progress):
        return []
    with open(progress) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_sp(args, sp: int, spec: dict, deadline: float, out_dir: Path, gpu_mem: float | None):
    """The sweep at one SP size, then the probes for its longest trainable length."""
    from ulysses_mm.config import to_dict

    cfg = spec["cfg"]
    cfg_dict = to_dict(cfg)
    device = args.device
    points: list[dict[str, Any]] = []
    sweep_end = time.time() + (deadline - time.time()) * 0.6
    progress = str(out_dir / f".progress_sp{sp}_sweep.jsonl")
    if os.path.exists(progress):
        os.remove(progress)
    t0 = time.time()
    ok, err = _launch(
        sp,
        cfg_dict,
        spec["lengths"],
        args.doc_len,
        args.steps,
        sweep_end,
        progress,
        args.simulate_oom_at,
    )
    events = _read(progress)
    ready = next((e for e in events if e["event"] == "ready"), None)
    startup = (ready or {}).get("build_s", 0.0) + 10.0
    kernel = (ready or {}).get("kernel", "")
    last_ok, first_fail, step_at = 0, 0, None
    cause = _worker_error(events, err)
    for ev in events:
        if ev["event"] == "done":
            rec = {"sp": sp, "seq_len": ev["seq_len"], "status": "ok", "kernel": kernel}
            rec.update(
                step_s=ev["step_s"],
                tokens_per_s=ev["tokens_per_s"],
                mfu=ev["mfu"],
                peak_gib=ev["peak"] / GiB,
            )
            points.append(rec)
            last_ok, step_at = ev["seq_len"], (ev["seq_len"], ev["step_s"])
        elif ev["event"] == "oom":
            if not first_fail:
                first_fail = ev["seq_len"]
                points.append({"sp": sp, "seq_len": ev["seq_len"], "status": "oom"})
        elif ev["event"] == "skip":
            points.append({"sp": sp, "seq_len": ev["seq_len"], "status": "skipped (budget)"})
    failed_early = ""
    if not ok and not first_fail:
        started = [e["seq_len"] for e in events if e["event"] == "start"]
        if started:
            points.append({"sp": sp, "seq_len": started[-1], "status": f"error: {cause}"})
        else:  # no length to put it at: the report carries it beside the SP size
            failed_early = cause
    for p in points:
        p.update(_estimates(cfg, p["seq_len"], sp, "cuda" if device == "cuda" else "cpu", gpu_mem))

    # the longest length that trains: probe the estimate's longest fit, then bisect
    longest = {
        "trained": last_ok,
        "failed": first_fail or None,
        "estimated": spec["estimated_max"],
        "probes": [],
        "sweep_s": time.time() - t0,
    }
    if failed_early:
        longest["error"] = f"failed before its first length: {failed_early}"
    granule = spec["granule"]
    lo, hi = last_ok, first_fail or None
    for _ in range(args.max_probes):
        if not lo:
            break
        target = spec["estimated_max"] if spec["estimated_max"] else None
        if hi is None:
            cand = target if target and target > lo else None
        else:
            cand = target if target and lo < target < hi else (lo + hi) // 2
        if cand is None:
            break
        cand = cand // granule * granule
        if cand <= lo or (hi is not None and cand >= hi):
            break
        predicted = startup + 3 * (step_at[1] * cand / step_at[0] if step_at else 0)
        if time.time() + predicted > deadline:
            longest["probes"].append({"seq_len": cand, "status": "skipped (budget)"})
            break
        progress = str(out_dir / f".progress_sp{sp}_probe{cand}.jsonl")
        if os.path.exists(progress):
            os.remove(progress)
        ok, err = _launch(
            sp, cfg_dict, [cand], args.doc_len, 1, deadline, progress, args.simulate_oom_at
        )
        evs = _read(progress)
        done = next((e for e in evs if e["event"] == "done"), None)
        if done:
            lo, step_at = cand, (cand, done["step_s"])
            rec = {"seq_len": cand, "status": "ok", "peak_gib": done["peak"] / GiB}
            rec.update(step_s=done["step_s"], tokens_per_s=done["tokens_per_s"], mfu=done["mfu"])
        else:
            oom = any(e["event"] == "oom" or e.get("oom") for e in evs)
            hi = cand
            rec = {"seq_len": cand, "status": "oom" if oom else f"error: {_worker_error(evs, err)}"}
        rec.update(_estimates(cfg, cand, sp, "cuda" if device == "cuda" else "cpu", gpu_mem))
        longest["probes"].append(rec)
        if hi is not None and hi - lo <= max(granule, lo // 20):
            break
    longest["trained"], longest["failed"] = lo, hi
    return points, longest


def _cuda_devices() -> tuple[int, str, int]:
    """(GPUs visible, the first one's name, its memory in bytes), asked in a child process
    so that this one never holds a CUDA context (it would take memory from GPU 0)."""
    import subprocess

    code = (
        "import json, torch; p = torch.cuda.get_device_properties(0); "
        "print(json.dumps([torch.cuda.device_count(), p.name, p.total_memory]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    n, name, total = json.loads(out.strip().splitlines()[-1])
    return int(n), str(name), int(total)


def _shown(path: Path) -> str:
    """A config path as the user would write it: relative to the repository if inside."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for sp in sorted({p["sp"] for p in result["points"]}):
        probes = result["longest"].get(str(sp), {}).get("probes", [])
        ok = [p for p in result["points"] if p["sp"] == sp and p["status"] == "ok"]
        ok = sorted(ok + [p for p in probes if p["status"] == "ok"], key=lambda p: p["seq_len"])
        bad = [p for p in result["points"] if p["sp"] == sp and p["status"] == "oom"]
        bad += [p for p in probes if p["status"] == "oom"]
        xs = [p["seq_len"] for p in ok]
        axes[0].plot(xs, [p["tokens_per_s"] for p in ok], "o-", label=f"SP={sp}")
        axes[1].plot(xs, [100 * p["mfu"] for p in ok], "o-", label=f"SP={sp}")
        (line,) = axes[2].plot(xs, [p["peak_gib"] for p in ok], "o-", label=f"SP={sp} measured")
        est = sorted(
            [p for p in result["points"] if p["sp"] == sp and "est_peak" in p]
            + [p for p in probes if "est_peak" in p],
            key=lambda p: p["seq_len"],
        )
        axes[2].plot(
            [p["seq_len"] for p in est],
            [p["est_peak"] / GiB for p in est],
            "--",
            color=line.get_color(),
            label=f"SP={sp} estimated tensor peak",
        )
        if bad:
            axes[2].plot(
                [p["seq_len"] for p in bad],
                [p["est_peak"] / GiB for p in bad],
                "x",
                color=line.get_color(),
                markersize=10,
                label=f"SP={sp} out of memory",
            )
        longest = result["longest"].get(str(sp), {})
        if longest.get("trained"):
            for ax in axes:
                ax.axvline(longest["trained"], color=line.get_color(), linestyle=":", alpha=0.6)
    if result.get("gpu_mem_gib"):
        axes[2].axhline(result["gpu_mem_gib"], color="gray", linestyle="-.", label="GPU memory")
    titles = ["tokens/s (all GPUs)", "MFU (%)", "peak memory per GPU (GiB)"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{result['config']} on {result['device_name']} — dotted: longest sequence that trained",
        fontsize=10,
    )
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# --memory-mode: config overrides applied before the command line's (model.offload_checkpoints
# needs model.activation_checkpointing; layer tiles of 8,192 tokens, 128 on CPU)
MEMORY_MODES: dict[str, list[str]] = {
    "config": [],
    "none": ["model.offload_checkpoints=false", "model.layer_tile_tokens=0"],
    "offload": [
        "model.activation_checkpointing=true",
        "model.offload_checkpoints=true",
        "model.layer_tile_tokens=0",
    ],
    "tiles": [
        "model.offload_checkpoints=false",
        "model.layer_tile_tokens={tile}",
        "model.mlp_tile_tokens=0",  # the layer tiles hold the MLP
    ],
    "both": [
        "model.activation_checkpointing=true",
        "model.offload_checkpoints=true",
        "model.layer_tile_tokens={tile}",
        "model.mlp_tile_tokens=0",
    ],
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config", default=None, help="run config (default configs/llama-1b.yaml; cpu: debug-tiny)"
    )
    ap.add_argument(
        "--out", default="build/bench-gpu", help="output directory (default build/bench-gpu)"
    )
    ap.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cuda, or cpu for a smoke run"
    )
    ap.add_argument(
        "--sp",
        type=int,
        nargs="+",
        default=None,
        help="SP sizes (default 1, 2, 4, 8 as GPUs allow)",
    )
    ap.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        default=None,
        help="lengths to sweep (default: doubling to the estimate's longest fit)",
    )
    ap.add_argument(
        "--min-len",
        type=int,
        default=None,
        help="first length per GPU of the doubling sweep (default 8192; cpu 256)",
    )
    ap.add_argument(
        "--doc-len", type=int, default=None, help="document length (default 32768; cpu 256)"
    )
    ap.add_argument(
        "--steps", type=int, default=2, help="timed steps per point after the warm-up (default 2)"
    )
    ap.add_argument(
        "--budget-s", type=float, default=420.0, help="wall-clock budget in seconds (default 420)"
    )
    ap.add_argument(
        "--max-probes",
        type=int,
        default=3,
        help="fresh-process probes for the longest length (default 3)",
    )
    ap.add_argument(
        "--granularity",
        type=int,
        default=None,
        help="probe resolution per GPU in tokens (default 1024; cpu 128)",
    )
    ap.add_argument(
        "--gpu-mem",
        type=float,
        default=None,
        help="GiB per GPU for the estimate (default: the device's)",
    )
    ap.add_argument(
        "--collective-timeout",
        type=int,
        default=120,
        help="parallel.timeout_s for the runs (default 120)",
    )
    ap.add_argument(
        "--simulate-oom-at",
        type=int,
        default=0,
        help="raise out-of-memory from this length on (to test that path, e.g. on CPU)",
    )
    ap.add_argument(
        "--memory-mode",
        choices=list(MEMORY_MODES),
        default="config",
        help="the memory modes: as the config sets them (default), none, offloaded "
        "checkpoints only, layer tiles only, or both",
    )
    ap.add_argument(
        "--head-groups",
        type=int,
        default=None,
        help="attention in C groups of heads (parallel.head_groups; default: the config's)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a run of seconds on the CPU: --device cpu --sp 1 --seq-lens 256 --steps 1, no probes",
    )
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return ap


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on the device: a GPU model and lengths, or tiny CPU ones."""
    if args.smoke:
        args.device, args.sp, args.seq_lens, args.steps, args.max_probes = "cpu", [1], [256], 1, 0
        args.overrides = ["train.peak_tflops=0.1", *args.overrides]  # MFU needs a peak
    cpu = args.device == "cpu"
    args.config = Path(
        args.config or REPO / "configs" / ("debug-tiny.yaml" if cpu else "llama-1b.yaml")
    )
    args.min_len = args.min_len or (256 if cpu else 8192)
    args.doc_len = args.doc_len or (256 if cpu else 32768)
    args.granularity = args.granularity or (128 if cpu else 1024)
    tile = 128 if cpu else 8192
    mode = [o.format(tile=tile) for o in MEMORY_MODES[args.memory_mode]]
    if args.head_groups is not None:
        mode.append(f"parallel.head_groups={args.head_groups}")
    args.overrides = [*mode, *args.overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve(build_parser().parse_args(argv))
    cpu = args.device == "cpu"
    import torch

    if not cpu and not torch.cuda.is_available():
        print("no GPU: skipped (CUDA is not available; --device cpu runs a smoke test)")
        return 0
    started = time.time()
    deadline = started + args.budget_s
    if cpu:
        n_gpus, name, gpu_mem = max(args.sp or [1, 2]), "CPU (gloo processes)", args.gpu_mem
        args.sp = args.sp or [1, 2]
    else:
        n_gpus, name, total = _cuda_devices()
        gpu_mem = args.gpu_mem or total / GiB
    flash = importlib.util.find_spec("flash_attn") is not None
    plan = make_plan(args, n_gpus, gpu_mem)
    print(
        f"bench_gpu: {_shown(args.config)} on {n_gpus} × {name}"
        + (f" ({gpu_mem:.1f} GiB)" if gpu_mem else "")
        + f", flash-attn {'present' if flash else 'absent'}, budget {args.budget_s:.0f} s"
    )
    for sp, spec in plan["sp"].items():
        est = spec["estimated_max"]
        print(
            f"  SP={sp}: lengths {', '.join(f'{n:,}' for n in spec['lengths'])}"
            + (f"; estimate's longest fit {est:,}" if est else "")
        )
    if args.dry_run:
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "config": _shown(args.config),
        "memory_mode": args.memory_mode,
        "head_groups": args.head_groups,
        "overrides": args.overrides,
        "device": args.device,
        "device_name": name,
        "gpus": n_gpus,
        "gpu_mem_gib": gpu_mem,
        "torch": torch.__version__,
        "flash_attn": flash,
        "doc_len": args.doc_len,
        "steps": args.steps,
        "budget_s": args.budget_s,
        "points": [],
        "longest": {},
    }
    sps = list(plan["sp"])
    for i, sp in enumerate(sps):
        share_end = time.time() + (deadline - time.time()) / (len(sps) - i)
        points, longest = run_sp(args, sp, plan["sp"][sp], share_end, out_dir, gpu_mem)
        result["points"] += points
        result["longest"][str(sp)] = longest
        if longest.get("error"):
            print(f"  SP={sp}: {longest['error']}", flush=True)
        for p in points:
            if p["status"] == "ok":
                print(
                    f"  SP={sp} N={p['seq_len']:>9,}  {p['tokens_per_s']:>10,.0f} tok/s  MFU "
                    f"{100 * p['mfu']:5.1f}%  peak {p['peak_gib']:7.2f} GiB  (estimated tensor "
                    f"peak {p['est_peak'] / GiB:7.2f}, total {p['est_total'] / GiB:7.2f})",
                    flush=True,
                )
            else:
                print(f"  SP={sp} N={p['seq_len']:>9,}  {p['status']}", flush=True)
        print(
            f"  SP={sp}: longest sequence that trained {longest['trained']:,}"
            + (f", shortest that did not {longest['failed']:,}" if longest["failed"] else "")
            + (
                f"; the estimate's longest fit {longest['estimated']:,}"
                if longest["estimated"]
                else ""
            ),
            flush=True,
        )
    result["wall_s"] = time.time() - started
    for f in out_dir.glob(".progress_*.jsonl"):
        f.unlink()
    js = out_dir / "bench_gpu.json"
    tmp = js.with_name(js.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, js)
    png = out_dir / "bench_gpu.png"
    plot(result, png)
    print(f"wrote {js} and {png} in {result['wall_s']:.0f} s")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _results import record

    figures = {f"longest_trained_sp{sp}": v.get("trained") for sp, v in result["longest"].items()}
    best = max(
        (p for p in result["points"] if p["status"] == "ok"),
        key=lambda p: p.get("mfu", 0),
        default={},
    )
    figures |= {"best_mfu": best.get("mfu"), "best_tokens_per_s": best.get("tokens_per_s")}
    record("bench_gpu", figures, smoke=args.smoke, gpu=not cpu, extra={"points": result["points"]})
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
