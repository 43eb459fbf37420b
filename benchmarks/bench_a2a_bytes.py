"""All-to-all bytes one rank sends per layer, measured, against theory.

The model runs one forward and one backward under ``torch.profiler`` with shapes recorded;
every ``gloo:all_to_all`` the process group executed is read back from the trace, and the
bytes it sent to OTHER ranks ((P−1)/P of its buffer) are summed per layer. Theory for
multi-head attention: q, k, v in and the output back, each N/P × D per rank, so
4·N·D/P·(P−1)/P elements per layer and direction; with GQA k and v carry e = lcm(kv, P)
heads instead of H. Ulysses' own counter (``CommStats``) is printed beside the profiler.

    python benchmarks/bench_a2a_bytes.py [--seq-len 4096]
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch.profiler's Kineto logs a USDT "profiler_start"/"profiler_stop" line to stderr
# around every profile, at its highest level: 6 is above every level it has, so its lines
# stop (the table is printed by this process on stdout). The workers inherit it.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

CASES = [  # (P, heads, kv heads)
    (2, 8, 8),
    (4, 8, 8),
    (4, 8, 2),
    (4, 8, 1),
]


def worker(args: argparse.Namespace, P: int, heads: int, kv: int) -> dict:
    import torch
    from torch.profiler import profile

    from ulysses_mm.config import ModelConfig
    from ulysses_mm.loader.synthetic import random_batch
    from ulysses_mm.model import build_model
    from ulysses_mm.parallel import CommStats, Mesh, apply_loss_balance, apply_ulysses, loss_weights
    from ulysses_mm.parallel.mesh import init_distributed
    from ulysses_mm.parallel.slice import sp_slice
    from ulysses_mm.train.step import forward_loss

    torch.set_num_threads(1)
    init_distributed("gloo")
    mesh = Mesh.build(P)
    cfg = ModelConfig(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        modalities={"dna": 16, "audio": 256},
    )
    model = build_model(cfg, seed=0)
    assert next(model.parameters()).dtype == torch.float32
    stats = CommStats()
    apply_ulysses(model, mesh, stats)
    apply_loss_balance(model, mesh)
    batch = sp_slice(random_batch(model.space, 1, args.seq_len, seed=0), mesh.sp_rank, P)

    def sent(prof) -> int:
        total = 0
        for e in prof.events():
            if e.name == "gloo:all_to_all":
                numel = math.prod(e.input_shapes[0])
                total += numel * 4 * (P - 1) // P  # fp32; 1/P of the buffer stays here
        return total

    with profile(record_shapes=True) as fwd:
        share, _ = forward_loss(model, batch, loss_weights(model.space.modalities, {}), mesh)
    with profile(record_shapes=True) as bwd:
        share.backward()
    return {
        "fwd": sent(fwd),
        "bwd": sent(bwd),
        "counter_fwd": stats.forward_bytes,
        "counter_bwd": stats.backward_bytes,
    }


def main() -> None:
    from ulysses_mm.parallel.launch import launch_local

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens N")
    ap.add_argument("--hidden", type=int, default=256, help="model width D")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    cases = CASES[:1] if args.smoke else CASES
    if args.smoke:
        args.seq_len, args.hidden, args.layers = 256, 64, 1
    N, D, L = args.seq_len, args.hidden, args.layers
    print(f"all-to-all bytes sent per rank per layer, N={N}, D={D}, fp32 (4 bytes)")
    print(
        f"{'P':>2} {'heads':>5} {'kv':>3} {'e':>3} {'measured fwd':>13} {'measured bwd':>13} {'counter fwd':>12} {'theory':>11} {'4ND/P(P-1)/P':>13} {'fwd/theory':>10} {'bwd/theory':>10}"
    )
    ratios = []
    for P, heads, kv in cases:
        res = launch_local(worker, P, args, P, heads, kv)
        r = max(res.values(), key=lambda x: x["fwd"])
        d = D // heads
        e = math.lcm(kv, P)
        theory = N * (2 * heads * d + 2 * e * d) // P * (P - 1) // P * 4
        mha = 4 * N * D // P * (P - 1) // P * 4
        ratios += [r["fwd"] / L / theory, r["bwd"] / L / theory]
        print(
            f"{P:>2} {heads:>5} {kv:>3} {e:>3} {r['fwd'] / L:>13,.0f} {r['bwd'] / L:>13,.0f} "
            f"{r['counter_fwd'] / L:>12,.0f} {theory:>11,} {mha:>13,} {r['fwd'] / L / theory:>10.4f} {r['bwd'] / L / theory:>10.4f}"
        )
    print(
        "theory = N·(2·H·d + 2·e·d)/P·(P−1)/P·4 bytes (equals 4·N·D/P·(P−1)/P·4 when e = H); goal: within 1 %"
    )
    from _results import key_values, record

    line = f"min_over_theory={min(ratios):.4f} max_over_theory={max(ratios):.4f}"
    print(line)
    record("bench_a2a_bytes", key_values(line), smoke=args.smoke)


if __name__ == "__main__":
    main()
