"""Attention in head groups (``parallel.head_groups`` = C): measured peak memory above the
step's start per token and tokens/s for C = 1, 2, 4 at one shape, beside the estimate.

The shape is debug-tiny (D 64) with 8 query / 2 kv heads of 32 (the heads four times
wider than the model, as attention's share of memory is at long context), 4 layers, and
the memory modes of the large configs on (activation checkpointing, checkpoints offloaded
to the host, layer tiles of 1,024 tokens, loss tiles of 512), SP=2, 8,192 tokens in
documents of 1,024: there attention's kept q, k, v and its working sets make the peak.
Each C runs training steps of the real training path (``ulysses_mm.tools.measure``:
DeepSpeed engine, gloo, fp32), all three in one world: the first step at this length
gives the memory (the peak counts every tensor, ``TensorMemoryTracker``; the rank with the
highest peak counts, and ``estimate(device="cpu")`` gives the same quantity), then
``--steps`` rounds of one step per C, interleaved, give the time (the fastest of each C,
the slowest rank).

The whole measurement is made ``--repeats`` times (default 5), each in a fresh world, and
each figure printed as min / median / max.

    python benchmarks/bench_head_groups.py [--seq-len 8192] [--sp 2] [--steps 3] [--repeats 5]

Last line: ``shrink_c4=X shrink_c4_min=.. shrink_c4_max=.. est_shrink_c4=Y
step_time_ratio_c4=Z`` (the peak above the step's start at C=1 over C=4, measured (the
median, its min and max) and estimated; C=4's step time over C=1's, the fastest of each).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

GROUPS = (1, 2, 4)
SHAPE = [
    "model.num_attention_heads=8",
    "model.num_key_value_heads=2",
    "model.head_dim=32",
    "model.num_hidden_layers=4",
    "model.activation_checkpointing=true",
    "model.offload_checkpoints=true",
    "model.layer_tile_tokens=1024",
    "model.loss_tile_tokens=512",
]


def _cfg(args: argparse.Namespace, groups: int):
    from ulysses_mm.config import RunConfig, load_config

    return load_config(
        RunConfig,
        args.config,
        [*SHAPE, f"parallel.sp={args.sp}", f"parallel.head_groups={groups}"],
    )


def worker(args: argparse.Namespace) -> dict:
    import gc
    import time

    import torch

    from ulysses_mm.parallel.mesh import open_world
    from ulysses_mm.tools.measure import StepRunner

    torch.set_num_threads(1)
    runners, out = {}, {}
    try:
        for groups in GROUPS:
            cfg = _cfg(args, groups)
            runners[groups] = StepRunner(cfg, open_world(cfg, device="cpu"))
            # memory: the first step at this length, as the estimate counts it (the
            # buffers it makes included). The cycle collector is off for it: when it runs
            # depends on what other threads (gloo, the offload) allocate, and the tensors
            # a collection frees early or late moved the peak from run to run.
            gc.collect()
            gc.disable()
            try:
                out[groups] = runners[groups].measure(args.seq_len, args.doc_len).to_dict()
            finally:
                gc.enable()
        # time: the same steps, the three settings interleaved round by round
        batch = runners[1].batch(args.seq_len, args.doc_len)
        times: dict[int, list[float]] = {c: [] for c in GROUPS}
        for r in range(args.steps):
            for groups in GROUPS[r % 2 :: 1] + GROUPS[: r % 2]:
                t0 = time.perf_counter()
                runners[groups].step(batch)
                times[groups].append(time.perf_counter() - t0)
        for groups in GROUPS:
            out[groups]["step_s"] = min(times[groups])
    finally:
        for groups in reversed(list(runners)):  # memory trackers leave in reverse order
            runners[groups].close()
    return out


def _estimated(args: argparse.Namespace, groups: int) -> tuple[int, int]:
    """(estimated peak, estimated bytes live at the step's start) on CPU."""
    from ulysses_mm.tools.estimate import EstimateOptions, estimate

    est = estimate(_cfg(args, groups), args.seq_len, EstimateOptions(device="cpu"))
    before = est.phase("optimizer step")
    base = sum(
        t.bytes for t in before.terms if t.name not in ("gradients", "optimizer step temporaries")
    )
    return est.peak, base


def main() -> None:
    from ulysses_mm.parallel.launch import launch_local

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="configs/debug-tiny.yaml", help="base run config")
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per sample N")
    ap.add_argument("--doc-len", type=int, default=1024, help="packed document length")
    ap.add_argument("--sp", type=int, default=2, help="SP size (processes)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per C (the fastest counts)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the smoke test)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="measurements, each in a fresh world: min / median / max of each figure (5)",
    )
    args = ap.parse_args()
    if args.smoke:
        args.seq_len, args.doc_len, args.steps, args.repeats = 2048, 512, 1, 1
    tokens = args.seq_len // args.sp
    # per repeat and C: the highest rank's peak, its bytes above the step's start per
    # token, the slowest rank's step time
    peaks: dict[int, list[float]] = {c: [] for c in GROUPS}
    above: dict[int, list[float]] = {c: [] for c in GROUPS}
    step: dict[int, list[float]] = {c: [] for c in GROUPS}
    tokens_per_step = 0
    for _ in range(max(1, args.repeats)):
        res = launch_local(worker, args.sp, args) if args.sp > 1 else {0: worker(args)}
        for c in GROUPS:
            worst = max((res[r][c] for r in res), key=lambda m: m["peak"])
            peaks[c].append(worst["peak"] / 2**20)
            above[c].append((worst["peak"] - worst["base"]) / tokens)
            step[c].append(max(res[r][c]["step_s"] for r in res))
            tokens_per_step = worst["tokens"]
    print(
        f"head groups, {args.config} + {' '.join(SHAPE)}; sp {args.sp}, N={args.seq_len} "
        f"({tokens:,} tokens per rank), fp32, CPU/gloo; {len(peaks[1])} measurements, "
        "min / median / max"
    )
    print(
        f"{'C':>2} {'meas peak MiB':>22} {'above start B/token':>26} {'est B/token':>12} "
        f"{'est/meas':>9} {'tokens/s':>9}"
    )
    est_above = {}
    for c in GROUPS:
        peak, base = _estimated(args, c)
        est_above[c] = (peak - base) / tokens
        mid = statistics.median(above[c])
        print(
            f"{c:>2} {_spread(peaks[c], '.2f'):>22} {_spread(above[c], '.1f'):>26} "
            f"{est_above[c]:>12.1f} {est_above[c] / mid:>9.3f} "
            f"{tokens_per_step / min(step[c]):>9.0f}"
        )
    shrink = [a / b for a, b in zip(above[1], above[4])]
    print(f"shrink_c4 (min / median / max): {_spread(shrink, '.3f')}")
    best = {c: min(step[c]) for c in GROUPS}
    print(
        f"shrink_c4={statistics.median(shrink):.3f} shrink_c4_min={min(shrink):.3f} "
        f"shrink_c4_max={max(shrink):.3f} est_shrink_c4={est_above[1] / est_above[4]:.3f} "
        f"step_time_ratio_c4={best[4] / best[1]:.3f}"
    )
    from _results import record

    record(
        "bench_head_groups",
        {
            "above": {c: statistics.median(v) for c, v in above.items()},
            "above_min": {c: min(v) for c, v in above.items()},
            "above_max": {c: max(v) for c, v in above.items()},
            "peak_mib": peaks,
            "shrink_c4": shrink,
            "est_above": est_above,
            "step_s": best,
        },
        smoke=args.smoke,
    )


def _spread(values: list[float], fmt: str) -> str:
    """``min / median / max``."""
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{lo:{fmt}} / {mid:{fmt}} / {hi:{fmt}}"


if __name__ == "__main__":
    main()
