"""Per-rank peak memory of one forward+backward at fixed N, for SP = 1, 2, 4.

The whole model (embedding, decoder layers with Ulysses attention, tiled per-modality loss)
runs on a packed sample of N tokens; each rank's peak tensor memory during forward+backward
is measured with ``ulysses_mm.tools.memory.TensorMemoryTracker`` (it tracks every
tensor storage the process allocates: parameters, gradients, activations, temporaries), and
printed as a ratio to SP=1. Ulysses keeps N/P tokens per rank everywhere except inside
attention, where it holds all N tokens on H/P heads, so activations should scale as 1/P.

    python benchmarks/bench_sp_memory.py [--seq-len 16384] [--sp 1 2 4]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


def worker(args: argparse.Namespace) -> dict:
    import torch

    from ulysses_mm.config import ModelConfig
    from ulysses_mm.loader.synthetic import random_batch
    from ulysses_mm.model import apply_memory_policy, build_model
    from ulysses_mm.parallel import Mesh, apply_loss_balance, apply_ulysses, loss_weights
    from ulysses_mm.parallel.mesh import in_launched_world, init_distributed
    from ulysses_mm.parallel.slice import sp_slice
    from ulysses_mm.tools.memory import TensorMemoryTracker
    from ulysses_mm.train.step import forward_backward

    torch.set_num_threads(1)
    if in_launched_world():
        init_distributed("gloo")
    mesh = Mesh.build(args.P)
    cfg = ModelConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        modalities={"dna": 16, "audio": 256, "video": 512},
        loss_tile_tokens=1024,
    )
    model = build_model(cfg, seed=0)
    apply_memory_policy(model, cfg)
    apply_ulysses(model, mesh)
    apply_loss_balance(model, mesh)
    batch = sp_slice(
        random_batch(
            model.space, 1, args.seq_len, seed=0, min_doc=args.doc_len, max_doc=args.doc_len
        ),
        mesh.sp_rank,
        mesh.sp,
    )
    weights = loss_weights(model.space.modalities, {})

    def step() -> None:
        forward_backward(model, batch, weights, mesh)

    step()  # warm-up: gradients exist from here on, as in training
    tracker = TensorMemoryTracker()
    tracker.track_module(model)
    tracker.track(vars(batch).values())
    with tracker:
        step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"P": args.P, "peak": tracker.peak, "params": params}


def main() -> None:
    from ulysses_mm.parallel.launch import launch_local

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--seq-len", type=int, default=16384, help="tokens per sample N (fixed across SP)"
    )
    ap.add_argument("--hidden", type=int, default=256, help="model width D")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--doc-len", type=int, default=2048, help="packed document length")
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="SP sizes")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.seq_len, args.hidden, args.layers, args.doc_len, args.sp = 1024, 64, 1, 256, [2]
    print(
        f"per-rank peak memory, one forward+backward, N={args.seq_len}, D={args.hidden}, {args.layers} layers, fp32"
    )
    print(
        f"{'SP':>3} {'peak MiB':>10} {'ratio to SP=1':>14} {'goal 1.15/P':>12} {'params+grads MiB':>17}"
    )
    base = None
    ratios = {}
    for P in args.sp:
        args.P = P
        res = launch_local(worker, P, args) if P > 1 else {0: worker(args)}
        peak = max(r["peak"] for r in res.values())
        base = base or peak
        fixed = 2 * res[0]["params"] / 2**20
        print(f"{P:>3} {peak / 2**20:>10.1f} {peak / base:>14.3f} {1.15 / P:>12.3f} {fixed:>17.1f}")
        ratios[f"peak_ratio_sp{P}"] = peak / base
    from _results import record

    print(" ".join(f"{k}={v:.3f}" for k, v in ratios.items()))
    record("bench_sp_memory", ratios, smoke=args.smoke)


if __name__ == "__main__":
    main()
