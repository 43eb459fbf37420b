"""Saving without stopping training, measured: how long a checkpoint blocks the step loop
written synchronously and in the background, and what the per-step agreement costs.

**Saves.** One process (a one-rank gloo world), a real DeepSpeed engine (ZeRO 0, fp32,
torch's AdamW) on a model large enough that writing its checkpoint takes seconds (default
D 1024, 8 layers, SwiGLU 2816: 91 M parameters, a 1.02 GiB DeepSpeed file of weights and
optimizer state and 0.34 GiB of safetensors weights; the process peaks near 5 GiB),
trained on random packed batches of ``--seq-len`` tokens. Saves go through
:class:`ulysses_mm.train.saver.Saver` as the trainer makes them (``start``, ``wait``,
``commit``), into a temporary directory (``--dir``; the files are fsync-ed) removed after
each save. ``--repeats`` rounds, each a synchronous save (``train.async_save=false``),
then background ones written by a thread and by a writer process
(``train.save_writer=thread`` / ``process``), and in each:

- ``plain step``: a step with no save around it (the baseline);
- ``step + save``: a step and the ``start`` that follows it, the time the loop loses to
  that step and its checkpoint (``start`` = the blocking part);
- ``next step``: the step after the save. In the background modes it runs while the
  writer writes the files and competes with it for the cores (and, a thread, for the
  GIL: the figure is what that step took, contention included; ``overlapped`` says
  whether the writer was still busy when it ended);
- ``written``: from ``start`` until this rank's files are on disk (a no-op job queued on
  the writer after them marks the time; synchronously, ``start`` itself);
- ``lost``: ``start`` + next step − plain step, what the save cost the loop (its blocking
  part and the next step's slowdown).

**Agreement.** The trainer all-reduces 3 int64 flags at every step boundary
(:func:`ulysses_mm.train.stop.agree`). In a 2-process gloo world on this machine
(``launch_local``), ``--agree-calls`` calls are timed on each rank, beside steps of
debug-tiny (D 64, 2 layers, sp 2, ``--debug-seq`` tokens, the same ``train_step``) in the
same world; the slower rank counts for both.

Every figure is the median over the rounds (min and max printed too). The last line is
``blocking_ratio=B step_save_ratio=S lost_ratio=L thread_lost_ratio=T agree_step_ratio=A``
(writer process / synchronous for the blocking time of ``start``, step + save and the
time lost; the thread's lost time over the synchronous one; one agreement over one debug
step, goal ≤ 0.01).

    PYTHONPATH=. python benchmarks/bench_async_save.py [--hidden 1024] [--layers 8] \
        [--seq-len 256] [--repeats 5] [--agree-calls 1000]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

MODES = ("sync", "thread", "process")


def _save_cfg(args: argparse.Namespace, out_dir: Path):
    from ulysses_mm.config import RunConfig, load_config

    return load_config(
        RunConfig,
        None,
        [
            f"model.hidden_size={args.hidden}",
            f"model.intermediate_size={args.intermediate}",
            f"model.num_hidden_layers={args.layers}",
            f"model.num_attention_heads={args.heads}",
            f"model.num_key_value_heads={args.heads // 4 or 1}",
            "parallel.sp=1",
            "deepspeed.zero_stage=0",
            "deepspeed.precision=fp32",
            f"train.out_dir={out_dir}",
        ],
    )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _spread(values: list[float], scale: float = 1.0, fmt: str = ".3f") -> str:
    """``median (min–max)``."""
    if not values:
        return "-"
    v = [x * scale for x in values]
    return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}–{max(v):{fmt}})"


def _files_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def measure_saves(args: argparse.Namespace, root: Path) -> dict:
    """The save rounds in this process (a one-rank world): per mode, lists of seconds."""
    import torch

    from ulysses_mm.config import to_dict
    from ulysses_mm.loader.synthetic import random_batch
    from ulysses_mm.parallel.mesh import open_world
    from ulysses_mm.tools.measure import run_space
    from ulysses_mm.train.checkpoint import CheckpointDir
    from ulysses_mm.train.saver import Saver
    from ulysses_mm.train.step import build_setup, train_step

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = _save_cfg(args, root / "run")
    space = run_space(cfg)
    setup = build_setup(cfg, space, open_world(cfg, device="cpu"))
    params = sum(p.numel() for p in setup.model.parameters())
    batch = random_batch(space, cfg.data.micro_batch_size, args.seq_len, seed=0)
    config = to_dict(cfg)
    step_no = 0

    def step() -> float:
        nonlocal step_no
        t0 = time.perf_counter()
        train_step(setup, [batch])
        step_no += 1
        return time.perf_counter() - t0

    savers: dict[str, tuple[Saver, object]] = {}
    for mode in MODES:  # one saver per mode for the whole run, as the trainer has one
        ckpt = root / f"ckpt-{mode}"
        train = replace(
            cfg.train,
            async_save=mode != "sync",
            save_writer=mode if mode != "sync" else "thread",
            save_timeout_s=3600.0,
        )
        saver = Saver(setup.engine, CheckpointDir(str(ckpt)), ckpt / "staging", train)
        savers[mode] = (saver, setup.engine.checkpoint_engine)

    def one_save(mode: str) -> dict[str, float]:
        ckpt = root / f"ckpt-{mode}"
        saver, engine = savers[mode]
        setup.engine.checkpoint_engine = engine
        try:
            out = {"plain_s": step()}
            t0 = time.perf_counter()
            out["step_s"] = step()
            pending = saver.start(
                step_no,
                client_state={"loader": {}, "stage": 0, "stage_step": step_no, "resume": {}},
                config=config,
                space=space,
                tokenizers=None,
            )
            out["step_save_s"] = time.perf_counter() - t0
            out["blocked_s"] = pending.blocked_s
            # the writer runs its jobs in order: this one's time is when the files are written
            finished: list[float] = []
            saver.writer.put("timer", lambda: finished.append(time.perf_counter()))
            out["next_step_s"] = step()
            out["overlapped"] = float(not saver.writer.done())
            saver.wait()
            out["written_s"] = finished[0] - pending.started
            saver.commit()
            out["bytes"] = float(_files_bytes(ckpt))
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
        return out

    for _ in range(args.warmup_steps):
        step()
    for mode in MODES:  # first-save work (imports, the writer process's start) not timed
        one_save(mode)
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            rounds[mode].append(one_save(mode))
            print(
                f"  round {r + 1} {mode:>5}: "
                + " ".join(f"{k}={v:.3f}" for k, v in rounds[mode][-1].items() if k != "bytes"),
                flush=True,
            )
    for saver, _ in savers.values():
        saver.close()
    return {
        "params": params,
        "threads": torch.get_num_threads(),
        "bytes": rounds["sync"][0]["bytes"],
        "rounds": rounds,
    }


def agree_worker(args: argparse.Namespace) -> dict[str, float]:
    """One rank of the 2-process world: debug-tiny steps at sp 2, then ``agree`` calls."""
    import torch
    import torch.distributed as dist

    from ulysses_mm.config import RunConfig, load_config
    from ulysses_mm.loader.synthetic import random_batch
    from ulysses_mm.parallel.mesh import open_world
    from ulysses_mm.tools.measure import run_space
    from ulysses_mm.train.step import build_setup, train_step
    from ulysses_mm.train.stop import agree

    torch.set_num_threads(1)
    cfg = load_config(
        RunConfig,
        "configs/debug-tiny.yaml",
        ["parallel.sp=2", f"train.out_dir={args.tmp}/agree-run"],
    )
    space = run_space(cfg)
    setup = build_setup(cfg, space, open_world(cfg, device="cpu"))
    batch = random_batch(space, cfg.data.micro_batch_size, args.debug_seq, seed=0)
    for _ in range(2):
        train_step(setup, [batch])
    steps = []
    for _ in range(args.debug_steps):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(setup, [batch])
        steps.append(time.perf_counter() - t0)
    # agree() and the bare collective (a tensor made once, no list round trip), for
    # comparison, in interleaved blocks
    t = torch.zeros(3, dtype=torch.int64)
    calls = {
        "agree": lambda: agree([0, 0, 0]),
        "bare": lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX),
    }
    for fn in calls.values():
        for _ in range(10):
            fn()
    spent = dict.fromkeys(calls, 0.0)
    blocks = 10 if args.agree_calls >= 100 else 1
    for _ in range(blocks):
        for name, fn in calls.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.agree_calls // blocks):
                fn()
            spent[name] += time.perf_counter() - t0
    done = blocks * (args.agree_calls // blocks)
    assert agree([0, dist.get_rank(), 0]) == [0, 1, 0]  # the maximum over both ranks
    agree_s, bare_s = spent["agree"] / done, spent["bare"] / done
    return {"step_s": statistics.median(steps), "agree_s": agree_s, "all_reduce_s": bare_s}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hidden", type=int, default=1024, help="model width D")
    ap.add_argument("--intermediate", type=int, default=2816, help="SwiGLU inner width")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers")
    ap.add_argument("--heads", type=int, default=16, help="query heads (kv heads: a quarter)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sample of the big model")
    ap.add_argument("--repeats", type=int, default=5, help="rounds of sync + background saves")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads of the save part (0: torch's)"
    )
    ap.add_argument("--agree-calls", type=int, default=1000, help="timed agree() calls per rank")
    ap.add_argument("--debug-seq", type=int, default=512, help="tokens per debug-tiny sample")
    ap.add_argument("--debug-steps", type=int, default=10, help="timed debug-tiny steps")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: tmp)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the smoke test)")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.intermediate, args.layers, args.heads = 64, 172, 2, 4
        args.seq_len, args.repeats, args.warmup_steps = 64, 1, 1
        args.agree_calls, args.debug_seq, args.debug_steps = 100, 128, 2

    from ulysses_mm.parallel.launch import launch_local

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-async-save-", dir=args.dir) as tmp:
        args.tmp = tmp
        # the 2-process world first: this process joins its own one-rank world after
        res = launch_local(agree_worker, 2, args)
        saves = measure_saves(args, Path(tmp))
    load_after = os.getloadavg()
    agree_s = max(r["agree_s"] for r in res.values())
    all_reduce_s = max(r["all_reduce_s"] for r in res.values())
    debug_step_s = max(r["step_s"] for r in res.values())

    rounds = saves["rounds"]
    for r in [r for m in MODES for r in rounds[m]]:
        # what the save cost the loop: its blocking part and the next step's slowdown
        r["lost_s"] = r["blocked_s"] + r["next_step_s"] - r["plain_s"]
    col = {m: {k: [r[k] for r in rounds[m]] for k in rounds[m][0]} for m in MODES}
    med = {m: {k: _median(v) for k, v in col[m].items()} for m in MODES}
    print(
        f"saves: D {args.hidden}, {args.layers} layers, SwiGLU {args.intermediate} "
        f"({saves['params'] / 1e6:.1f} M parameters), N={args.seq_len}, ZeRO 0, fp32, AdamW, "
        f"1 process, {saves['threads']} torch threads, {os.cpu_count()} cores; "
        f"{saves['bytes'] / 2**30:.2f} GiB per checkpoint (fsync-ed); {args.repeats} rounds, "
        f"seconds, median (min–max); load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after"
    )
    rows = [
        ("plain step (no save)", "plain_s"),
        ("step before the save", "step_s"),
        ("start() blocks", "blocked_s"),
        ("step + save", "step_save_s"),
        ("next step", "next_step_s"),
        ("written (start → on disk)", "written_s"),
        ("lost (see below)", "lost_s"),
    ]
    print(f"{'':<28}{'synchronous':>26}{'writer thread':>26}{'writer process':>26}")
    for label, key in rows:
        print(f"{label:<28}" + "".join(f"{_spread(col[m][key]):>26}" for m in MODES))
    overlapped = sum(col["process"]["overlapped"])
    print(
        "lost = start() + next step − plain step (what the save cost the loop: its "
        "blocking part and the next step's slowdown)"
    )
    print(
        f"writer process: still busy when the next step ended in {overlapped:.0f} of "
        f"{args.repeats} rounds; next step / plain step = "
        f"{med['process']['next_step_s'] / med['process']['plain_s']:.2f} (thread: "
        f"{med['thread']['next_step_s'] / med['thread']['plain_s']:.2f})"
    )
    blocking_ratio = med["process"]["blocked_s"] / med["sync"]["blocked_s"]
    step_save_ratio = med["process"]["step_save_s"] / med["sync"]["step_save_s"]
    lost_ratio = med["process"]["lost_s"] / med["sync"]["lost_s"]
    thread_lost_ratio = med["thread"]["lost_s"] / med["sync"]["lost_s"]
    agree_ratio = agree_s / debug_step_s
    print(
        f"agreement: 2 gloo processes, agree([0, 0, 0]) {agree_s * 1e6:.1f} µs per call "
        f"(bare all_reduce {all_reduce_s * 1e6:.1f} µs; slower rank, {args.agree_calls} "
        f"calls); debug-tiny step at sp 2, N={args.debug_seq}: {debug_step_s * 1e3:.1f} ms; "
        f"agree / step = {agree_ratio * 100:.3f} %"
    )
    print(
        f"blocking_ratio={blocking_ratio:.4f} step_save_ratio={step_save_ratio:.4f} "
        f"lost_ratio={lost_ratio:.4f} thread_lost_ratio={thread_lost_ratio:.4f} "
        f"agree_step_ratio={agree_ratio:.5f}"
    )
    from _results import record

    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    record(
        "bench_async_save",
        {
            **{f"{m}_{k}": v for m in MODES for k, v in med[m].items() if k != "bytes"},
            "blocking_ratio": blocking_ratio,
            "step_save_ratio": step_save_ratio,
            "lost_ratio": lost_ratio,
            "thread_lost_ratio": thread_lost_ratio,
            "checkpoint_gib": saves["bytes"] / 2**30,
            "params_m": saves["params"] / 1e6,
            "agree_us": agree_s * 1e6,
            "all_reduce_us": all_reduce_s * 1e6,
            "debug_step_ms": debug_step_s * 1e3,
            "agree_step_ratio": agree_ratio,
            "peak_rss_mib": peak_rss_mib,
        },
        smoke=args.smoke,
        extra={
            "rounds": rounds,
            "agree_ranks": res,
            "settings": {k: v for k, v in vars(args).items() if k not in ("tmp", "dir", "smoke")},
            "loadavg": {"before": load_before, "after": load_after},
            "notes": (
                "medians of the rounds (seconds); thread / process = train.async_save=true "
                "with train.save_writer=thread / process; ratios are process / sync; "
                "agree vs a debug-tiny step in a 2-process gloo world"
            ),
        },
    )


if __name__ == "__main__":
    main()
