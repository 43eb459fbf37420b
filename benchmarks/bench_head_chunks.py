"""Attention in head groups (``parallel.head_chunks`` = C): measured peak memory above the
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

    python benchmarks/bench_head_chunks.py [--seq-len 8192] [--sp 2] [--steps 3]

Last line: ``shrink_c4=X est_shrink_c4=Y step_time_ratio_c4=Z`` (the peak above the
step's start at C=1 over C=4, measured and estimated; C=4's step time over C=1's).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

CHUNKS = (1, 2, 4)
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


def _cfg(args: argparse.Namespace, chunks: int):
    from ulysses_mm.config import RunConfig, load_config

    return load_config(
        RunConfig,
        args.config,
        [*SHAPE, f"parallel.sp={args.sp}", f"parallel.head_chunks={chunks}"],
    )


def worker(args: argparse.Namespace) -> dict:
    import time

    import torch

    from ulysses_mm.parallel.mesh import open_world
    from ulysses_mm.tools.measure import StepRunner

    torch.set_num_threads(1)
    runners, out = {}, {}
    try:
        for chunks in CHUNKS:
            cfg = _cfg(args, chunks)
            runners[chunks] = StepRunner(cfg, open_world(cfg, device="cpu"))
            # memory: the first step at this length, as the estimate counts it (the
            # buffers it makes included)
            out[chunks] = runners[chunks].measure(args.seq_len, args.doc_len).to_dict()
        # time: the same steps, the three settings interleaved round by round
        batch = runners[1].batch(args.seq_len, args.doc_len)
        times: dict[int, list[float]] = {c: [] for c in CHUNKS}
        for r in range(args.steps):
            for chunks in CHUNKS[r % 2 :: 1] + CHUNKS[: r % 2]:
                t0 = time.perf_counter()
                runners[chunks].step(batch)
                times[chunks].append(time.perf_counter() - t0)
        for chunks in CHUNKS:
            out[chunks]["step_s"] = min(times[chunks])
    finally:
        for chunks in reversed(list(runners)):  # memory trackers leave in reverse order
            runners[chunks].close()
    return out


def _estimated(args: argparse.Namespace, chunks: int) -> tuple[int, int]:
    """(estimated peak, estimated bytes live at the step's start) on CPU."""
    from ulysses_mm.tools.estimate import EstimateOptions, estimate

    est = estimate(_cfg(args, chunks), args.seq_len, EstimateOptions(device="cpu"))
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
    args = ap.parse_args()
    res = launch_local(worker, args.sp, args) if args.sp > 1 else {0: worker(args)}
    tokens = args.seq_len // args.sp
    print(
        f"head chunks, {args.config} + {' '.join(SHAPE)}; sp {args.sp}, N={args.seq_len} "
        f"({tokens:,} tokens per rank), fp32, CPU/gloo"
    )
    print(
        f"{'C':>2} {'meas peak MiB':>14} {'above start B/token':>20} {'est B/token':>12} "
        f"{'est/meas':>9} {'tokens/s':>9}"
    )
    above, est_above, step = {}, {}, {}
    for c in CHUNKS:
        worst = max((res[r][c] for r in res), key=lambda m: m["peak"])
        above[c] = (worst["peak"] - worst["base"]) / tokens
        peak, base = _estimated(args, c)
        est_above[c] = (peak - base) / tokens
        step[c] = max(res[r][c]["step_s"] for r in res)
        print(
            f"{c:>2} {worst['peak'] / 2**20:>14.2f} {above[c]:>20.1f} {est_above[c]:>12.1f} "
            f"{est_above[c] / above[c]:>9.3f} {worst['tokens'] / step[c]:>9.0f}"
        )
    print(
        f"shrink_c4={above[1] / above[4]:.3f} est_shrink_c4={est_above[1] / est_above[4]:.3f} "
        f"step_time_ratio_c4={step[4] / step[1]:.3f}"
    )


if __name__ == "__main__":
    main()
