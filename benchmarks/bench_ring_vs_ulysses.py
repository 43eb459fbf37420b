"""Ulysses, ring and the hybrid head to head: bytes per rank per layer and time.

Part 1 (measured, gloo on CPU): at P = 2 and 4, a small model runs one forward and one
backward under pure Ulysses (U = P, R = 1), pure ring (U = 1, R = P) and the hybrid
(U = 2, R = P/2); the bytes each rank sent per layer (all-to-all counter + ring counter)
are printed beside theory, with the time of forward + backward.

Part 2 (balance): the causal work of each ring rank (unmasked query-key pairs) under the
document zigzag layout and under the plain contiguous split, max/min over ranks, for one
document and for random packings of documents of several mean lengths.

Part 3 (theory): for P = 8 … 1024 GPUs, N/P tokens per GPU, a Llama-8B-like attention
(32 heads, 8 kv, D = 4096, bf16), the bytes per GPU per layer and the time they take at
intra-node (NVLink) and inter-node (InfiniBand) bandwidth, for Ulysses (while P divides
the heads), ring, and the hybrid with U = 8 inside a node and the ring across nodes.

    python benchmarks/bench_ring_vs_ulysses.py [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def theory(N: int, H: int, kv: int, d: int, U: int, R: int, elem: int = 4) -> tuple[int, int]:
    """(forward, backward) bytes per rank per layer: Ulysses all-to-all over U on N/R
    tokens (q, k, v in, out back; backward the same), plus the ring's K/V blocks (and,
    backward, K/V again and dK/dV home in fp32)."""
    e = math.lcm(kv, U) if U > 1 else kv
    a2a = (N // R) * (2 * H * d + 2 * e * d) // U * (U - 1) // U * elem if U > 1 else 0
    block = (N // R) * 2 * (e // U if U > 1 else e) * d
    ring_f = (R - 1) * block * elem
    ring_b = ring_f + R * block * 4 if R > 1 else 0
    return a2a + ring_f, a2a + ring_b


def worker(args: argparse.Namespace, P: int, ring: int) -> dict:
    import torch

    from ulysses_mm.config import ModelConfig
    from ulysses_mm.loader.synthetic import random_batch
    from ulysses_mm.model import build_model
    from ulysses_mm.parallel import CommStats, Mesh, apply_loss_balance, apply_ulysses, loss_weights
    from ulysses_mm.parallel.mesh import init_distributed
    from ulysses_mm.parallel.ring import new_ring_stats
    from ulysses_mm.parallel.slice import sp_slice
    from ulysses_mm.train.step import forward_loss

    torch.set_num_threads(1)
    init_distributed("gloo")
    mesh = Mesh.build(P, 1, ring)
    cfg = ModelConfig(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv,
        modalities={"dna": 16, "audio": 256},
    )
    model = build_model(cfg, seed=0)
    stats, rstats = CommStats(), new_ring_stats()
    apply_ulysses(model, mesh, stats, rstats)
    apply_loss_balance(model, mesh)
    batch = random_batch(model.space, 1, args.seq_len, seed=0)
    local = sp_slice(batch, mesh.sp_rank, P, ring)
    weights = loss_weights(model.space.modalities, {})
    forward_loss(model, local, weights, mesh)[0].backward()  # warm-up: lazy setup is not timed
    f0, b0 = stats.forward_bytes + rstats["forward_bytes"], stats.backward_bytes
    b0 += rstats["backward_bytes"]
    t0 = time.perf_counter()
    share, _ = forward_loss(model, local, weights, mesh)
    t1 = time.perf_counter()
    f_bytes = stats.forward_bytes + rstats["forward_bytes"] - f0
    share.backward()
    t2 = time.perf_counter()
    b_bytes = stats.backward_bytes + rstats["backward_bytes"] - b0
    return {"fwd": f_bytes, "bwd": b_bytes, "t_fwd": t1 - t0, "t_bwd": t2 - t1}


def measured(args: argparse.Namespace) -> dict[str, float]:
    """The measured table; returns measured / theory bytes per layout."""
    from ulysses_mm.parallel.launch import launch_local

    N, L, H, kv = args.seq_len, args.layers, args.heads, args.kv
    d = args.hidden // H
    print(f"measured: N={N}, D={args.hidden}, {H} heads / {kv} kv, {L} layers, fp32, gloo")
    print(
        f"{'P':>2} {'layout':>14} {'fwd bytes':>11} {'theory':>11} {'bwd bytes':>11} "
        f"{'theory':>11} {'fwd s':>7} {'bwd s':>7}"
    )
    figures = {}
    for P in (2,) if args.smoke else (2, 4):
        layouts = [("ulysses", P, 1), ("ring", 1, P)] + ([("hybrid", 2, 2)] if P == 4 else [])
        layouts = layouts[1:2] if args.smoke else layouts  # the ring alone
        for name, U, R in layouts:
            res = launch_local(worker, P, args, P, R)
            r = max(res.values(), key=lambda x: x["fwd"] + x["bwd"])
            tf, tb = theory(N, H, kv, d, U, R)
            figures[f"{name}_p{P}_fwd_over_theory"] = r["fwd"] / L / tf
            figures[f"{name}_p{P}_bwd_over_theory"] = r["bwd"] / L / tb
            print(
                f"{P:>2} {name + f' {U}×{R}':>14} {r['fwd'] / L:>11,.0f} {tf:>11,} "
                f"{r['bwd'] / L:>11,.0f} {tb:>11,} {r['t_fwd']:>7.3f} {r['t_bwd']:>7.3f}"
            )
    return figures


def theory_table(args: argparse.Namespace) -> None:
    H, kv, D, elem = 32, 8, 4096, 2
    d = D // H
    nvlink, ib = args.nvlink * 1e9, args.ib * 1e9
    per_gpu = args.tokens_per_gpu
    print()
    print(
        f"theory: {H} heads / {kv} kv, D={D}, bf16, {per_gpu} tokens per GPU, "
        f"NVLink {args.nvlink:g} GB/s, InfiniBand {args.ib:g} GB/s per GPU, 8 GPUs a node"
    )
    print(f"{'P':>5} {'layout':>16} {'fwd MB/layer':>13} {'fwd ms/layer':>13} {'note':>28}")
    for P in (8, 16, 32, 64, 128, 256, 512, 1024):
        N = per_gpu * P
        rows = []
        if H % P == 0:
            f, _ = theory(N, H, kv, d, P, 1, elem)
            bw = nvlink if P <= 8 else ib  # the all-to-all leaves the node beyond 8
            rows.append((f"ulysses {P}×1", f, f / bw, "a2a " + ("NVLink" if P <= 8 else "IB")))
        else:
            rows.append((f"ulysses {P}×1", None, None, f"impossible: {H} heads"))
        f, _ = theory(N, H, kv, d, 1, P, elem)
        # a ring inside one node runs on NVLink; across nodes its slowest hop (IB) paces it
        ring_bw = nvlink if P <= 8 else ib
        rows.append((f"ring 1×{P}", f, f / ring_bw, "ring over " + ("NVLink" if P <= 8 else "IB")))
        U, R = min(8, P), P // min(8, P)
        f, _ = theory(N, H, kv, d, U, R, elem)
        a2a, _ = theory(N, H, kv, d, U, 1, elem)
        a2a = a2a // R
        t = a2a / nvlink + (f - a2a) / ib
        rows.append((f"hybrid {U}×{R}", f, t, "a2a NVLink" + (", ring IB" if R > 1 else "")))
        best = min((r for r in rows if r[2] is not None), key=lambda r: r[2])
        for name, f, t, note in rows:
            mark = " ← fastest" if best[0] == name else ""
            if f is None:
                print(f"{P:>5} {name:>16} {'—':>13} {'—':>13} {note:>28}")
            else:
                print(f"{P:>5} {name:>16} {f / 1e6:>13.1f} {t * 1e3:>13.3f} {note:>28}{mark}")
    print(
        "time = bytes / bandwidth, no overlap with compute; the ring's per-step transfers hide "
        "behind block attention when compute per block exceeds them"
    )


def balance_table(args: argparse.Namespace) -> None:
    import torch

    from ulysses_mm.loader.synthetic import packed_doc_ids
    from ulysses_mm.parallel.slice import unmasked_pairs

    n = args.balance_len

    print()
    print(f"causal work per ring rank (unmasked query-key pairs), max/min, N={n}")
    print(f"{'documents':>24} {'R':>3} {'document zigzag':>16} {'contiguous':>11}")
    cases = [("one document", torch.zeros(1, n, dtype=torch.long))]
    cases += [(f"packed, mean {m} tokens", packed_doc_ids(1, n, m)) for m in (8, 256, 2048)]
    for name, doc in cases:
        for R in (2, 4, 8):
            z, c = unmasked_pairs(doc, R), unmasked_pairs(doc, R, contiguous=True)
            print(f"{name:>24} {R:>3} {max(z) / min(z):>16.3f} {max(c) / min(c):>11.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens N (measured part)")
    ap.add_argument("--hidden", type=int, default=64, help="model width D (measured part)")
    ap.add_argument("--heads", type=int, default=4, help="query heads (measured part)")
    ap.add_argument("--kv", type=int, default=2, help="kv heads (measured part)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (measured part)")
    ap.add_argument("--tokens-per-gpu", type=int, default=32768, help="theory part")
    ap.add_argument("--nvlink", type=float, default=900.0, help="GB/s intra-node per GPU")
    ap.add_argument("--ib", type=float, default=50.0, help="GB/s inter-node per GPU")
    ap.add_argument("--balance-len", type=int, default=8192, help="tokens N (balance part)")
    ap.add_argument("--theory-only", action="store_true", help="skip the measured part")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.seq_len, args.balance_len = 256, 1024
    figures = {}
    if not args.theory_only:
        figures = measured(args)
        balance_table(args)
    theory_table(args)
    from _results import record

    ratios = list(figures.values()) or [float("nan")]
    print(f"min_over_theory={min(ratios):.4f} max_over_theory={max(ratios):.4f}")
    record("bench_ring_vs_ulysses", figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
