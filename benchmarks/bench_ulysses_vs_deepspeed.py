"""Ulysses attention vs DeepSpeed's ``DistributedAttention``, side by side, on gloo.

Both wrap the SAME local kernel (PyTorch SDPA, causal, document-masked) and get identical
q, k, v; the script times forward+backward of each (interleaved, after warm-up, slowest
rank counts) at SP=2 and SP=4 and prints the time ratio ours/DeepSpeed and the max
difference of outputs and input gradients. DeepSpeed issues one all-to-all each for q, k
and v; ours packs them into one.

    python benchmarks/bench_ulysses_vs_deepspeed.py [--seq-len 16384] [--heads 8] [--iters 5]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def worker(args: argparse.Namespace) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.sequence.layer import DistributedAttention

    from ulysses_mm.model.attention import DocumentMask, LocalAttention
    from ulysses_mm.parallel import Mesh, UlyssesAttention
    from ulysses_mm.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    init_distributed("gloo")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    P, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh.build(P)
    b, s, h, d = 1, args.seq_len, args.heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    grad_out = torch.randn(b, s, h, d, generator=g)
    doc = (torch.arange(s) // args.doc_len).unsqueeze(0)  # packed documents of doc_len tokens
    n = s // P
    sl = slice(rank * n, (rank + 1) * n)

    ours = UlyssesAttention(LocalAttention("sdpa_varlen"), mesh.sp_group, h, h)
    theirs = DistributedAttention(
        LocalAttention("sdpa_varlen"), mesh.sp_group, scatter_idx=2, gather_idx=1
    )

    def run(which: str):
        ins = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
        mask = DocumentMask(doc)
        if which == "ours":
            out = ours(*ins, mask)
        else:
            out = theirs(*ins, 0, None, mask)  # batch_dim_idx=0, no rotary
        out.backward(grad_out[:, sl])
        return out.detach(), [t.grad for t in ins]

    (o1, g1), (o2, g2) = run("ours"), run("deepspeed")
    max_diff = max(
        float((o1 - o2).abs().max()), *(float((a - c).abs().max()) for a, c in zip(g1, g2))
    )
    times: dict[str, list[float]] = {"ours": [], "deepspeed": []}
    for _ in range(args.warmup):
        run("ours"), run("deepspeed")
    for i in range(args.iters):
        for which in ("ours", "deepspeed") if i % 2 == 0 else ("deepspeed", "ours"):
            dist.barrier()
            t0 = time.perf_counter()
            run(which)
            dt = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            times[which].append(float(dt))
    diff = torch.tensor(max_diff)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return {"P": P, "times": times, "max_diff": float(diff)}


def main() -> None:
    from ulysses_mm.parallel.launch import launch_local

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-len", type=int, default=16384, help="full sequence length N")
    ap.add_argument(
        "--heads",
        type=int,
        default=8,
        help="attention heads (even: DeepSpeed needs heads % P == 0)",
    )
    ap.add_argument("--head-dim", type=int, default=64, help="head dimension")
    ap.add_argument("--doc-len", type=int, default=1024, help="packed document length")
    ap.add_argument("--iters", type=int, default=6, help="timed iterations per implementation")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    ap.add_argument("--sp", type=int, nargs="+", default=[2, 4], help="SP sizes to run")
    args = ap.parse_args()
    print(
        f"Ulysses vs deepspeed.sequence.layer.DistributedAttention, gloo on CPU, fwd+bwd; "
        f"b=1 N={args.seq_len} heads={args.heads} d={args.head_dim}, documents of {args.doc_len} tokens"
    )
    print(f"{'SP':>3} {'ours (s)':>10} {'DeepSpeed (s)':>14} {'ratio':>7} {'max |diff|':>11}")
    for P in args.sp:
        res = launch_local(worker, P, args)[0]
        ours = sorted(res["times"]["ours"])[len(res["times"]["ours"]) // 2]
        ds = sorted(res["times"]["deepspeed"])[len(res["times"]["deepspeed"]) // 2]
        print(f"{P:>3} {ours:>10.4f} {ds:>14.4f} {ours / ds:>7.3f} {res['max_diff']:>11.2e}")
    print("ratio = median time ours / median time DeepSpeed (goal <= 0.9)")


if __name__ == "__main__":
    main()
