"""Per-rank peak memory of one training step under SP, with the loss's targets spread
over the SP group (``ulysses_mm.parallel.loss_balance``) and without.

The step is the training path (the run config's model, Ulysses, the DeepSpeed engine,
global loss, backward, optimizer step); the batch is a random packed multimodal sample
(documents of random modality and length, some switching modality, the tail padded) over
a token space with a text head (``--text-vocab``) beside the shipped DNA, audio and video
heads. Each rank's peak tensor memory above the step's start is counted with
``TensorMemoryTracker``; the ratio of the highest to the lowest rank is printed for each
SP size, balanced and not, measured side by side in one world.

    python benchmarks/bench_rank_balance.py [--config configs/debug-tiny.yaml] [--seq-len 32768]
        [--sp 2 4] [--text-vocab 32000] [overrides (default: fp32 ZeRO-1)]

Last line: ``max_over_min_sp2=X max_over_min_sp4=Y`` (balanced).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

# fp32 ZeRO-1 (as the comparison with the ALST stack ran), buckets sized for a tiny model
ZERO1 = [
    "deepspeed.zero_stage=1",
    "deepspeed.extra={zero_optimization: {reduce_bucket_size: 200000}}",
]


def worker(args: argparse.Namespace) -> dict:
    import gc

    import torch

    from ulysses_mm.config import RunConfig, load_config
    from ulysses_mm.core.tokenspace import TokenSpace
    from ulysses_mm.loader.synthetic import random_batch
    from ulysses_mm.parallel.mesh import open_world
    from ulysses_mm.tools.memory import TensorMemoryTracker
    from ulysses_mm.train.step import build_setup, train_step

    torch.set_num_threads(1)
    vocab = {"text": args.text_vocab, "dna": 10, "audio": 256, "video": 256}
    mods = "{" + ", ".join(f"{k}: {v}" for k, v in vocab.items()) + "}"
    cfg = load_config(
        RunConfig,
        args.config,
        [*args.overrides, f"parallel.sp={args.P}", f"model.modalities={mods}"],
    )
    space = TokenSpace.from_vocab(vocab)
    tracker = TensorMemoryTracker()
    tracker.__enter__()
    setup = build_setup(cfg, space, open_world(cfg, device="cpu"))
    balance = setup.model.target_exchange
    train_step(setup, [random_batch(space, 1, 16 * args.P, seed=1)], grad_norm=False)  # warm-up
    batch = random_batch(space, 1, args.seq_len, seed=args.seed, max_doc=args.max_doc or None)
    out = {}
    for name, exchange in (("unbalanced", None), ("balanced", balance)):
        setup.model.target_exchange = exchange
        gc.collect()
        tracker.peak = start = tracker.live
        train_step(setup, [batch], grad_norm=False)
        out[name] = tracker.peak - start
    tracker.__exit__(None, None, None)
    local = setup.slice_of(batch)
    kept = local.label_modality[local.labels != -100]
    out["targets"] = torch.bincount(kept, minlength=len(vocab)).tolist()
    return out


def main() -> None:
    from ulysses_mm.parallel.launch import launch_local

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config", default="configs/debug-tiny.yaml", help="run config (model, engine)"
    )
    ap.add_argument("--seq-len", type=int, default=32768, help="tokens per sample N")
    ap.add_argument("--sp", type=int, nargs="+", default=[2, 4], help="SP sizes")
    ap.add_argument("--text-vocab", type=int, default=32000, help="the text head's width")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sample")
    ap.add_argument(
        "--max-doc", type=int, default=0, help="longest document (lengths from 4; default N/8)"
    )
    ap.add_argument(
        "overrides",
        nargs="*",
        default=ZERO1,
        help="section.key=value config overrides (default: fp32 ZeRO-1, small buckets)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.seq_len, args.sp, args.text_vocab = 1024, [2], 1000
    print(
        f"per-rank peak above the step's start, one training step of {args.config} "
        f"{' '.join(args.overrides)}, "
        f"N={args.seq_len}, token space text {args.text_vocab} + dna, audio, video (CPU, gloo)"
    )
    print(
        f"{'SP':>3} {'rank':>4} {'targets (text, dna, audio, video)':>36} "
        f"{'unbalanced MiB':>15} {'balanced MiB':>13}"
    )
    ratios = {}
    for P in args.sp:
        args.P = P
        res = launch_local(worker, P, args)
        for r in sorted(res):
            v = res[r]
            print(
                f"{P:>3} {r:>4} {v['targets']!s:>36} {v['unbalanced'] / 2**20:>15.1f} "
                f"{v['balanced'] / 2**20:>13.1f}"
            )
        for name in ("unbalanced", "balanced"):
            peaks = [res[r][name] for r in res]
            ratios[name, P] = max(peaks) / min(peaks)
        print(
            f"    max/min over ranks: unbalanced {ratios['unbalanced', P]:.3f}, balanced "
            f"{ratios['balanced', P]:.3f}"
        )
    line = " ".join(f"max_over_min_sp{P}={ratios['balanced', P]:.3f}" for P in args.sp)
    print(line)
    from _results import record

    record(
        "bench_rank_balance",
        {f"{name}_max_over_min_sp{P}": r for (name, P), r in ratios.items()},
        smoke=args.smoke,
    )


if __name__ == "__main__":
    main()
