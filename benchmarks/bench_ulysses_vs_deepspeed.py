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
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch


class _PassThrough(torch.nn.Module):
    """A local 'attention' that costs nearly nothing (out = q + k + v), to time the Ulysses
    machinery alone: layout changes, all-to-alls, and their backward."""

    def forward(self, q, k, v, mask):
        return q + k + v


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

    local = LocalAttention("sdpa_varlen") if args.kernel == "sdpa" else _PassThrough()
    ours = UlyssesAttention(local, mesh.sp_group, h, h)
    theirs = DistributedAttention(local, mesh.sp_group, scatter_idx=2, gather_idx=1)

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
    cpu: dict[str, list[float]] = {"ours": [], "deepspeed": []}
    for _ in range(args.warmup):
        run("ours"), run("deepspeed")
    for i in range(args.iters):
        for which in ("ours", "deepspeed") if i % 2 == 0 else ("deepspeed", "ours"):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            run(which)
            # wall: the slowest rank sets the pace; CPU: the work all ranks did (all
            # threads, gloo's included), which other load on a shared host does not inflate
            dt = torch.tensor(
                [time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64
            )
            wall, work = dt.clone(), dt.clone()
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(work, op=dist.ReduceOp.SUM)
            times[which].append(float(wall[0]))
            cpu[which].append(float(work[1]))
    diff = torch.tensor(max_diff)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return {"P": P, "times": times, "cpu": cpu, "max_diff": float(diff)}


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
    ap.add_argument(
        "--kernel",
        choices=["sdpa", "none"],
        default="sdpa",
        help="local kernel both wrap: SDPA per document, or none (times the all-to-all machinery alone)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.seq_len, args.doc_len, args.iters, args.warmup, args.sp = 512, 128, 2, 0, [2]
    print(
        f"Ulysses vs deepspeed.sequence.layer.DistributedAttention, gloo on CPU, fwd+bwd; "
        f"b=1 N={args.seq_len} heads={args.heads} d={args.head_dim}, documents of {args.doc_len} tokens, "
        f"local kernel: {'SDPA' if args.kernel == 'sdpa' else 'none (q + k + v)'}"
    )
    print(
        f"{'SP':>3} {'wall ours':>10} {'wall DS':>9} {'ratio':>6}   {'CPU ours':>9} {'CPU DS':>8} {'ratio':>6}   {'max |diff|':>10}"
    )
    figures = {}
    for P in args.sp:
        res = launch_local(worker, P, args)[0]
        w_ours, w_ds = (statistics.median(res["times"][k]) for k in ("ours", "deepspeed"))
        c_ours, c_ds = (statistics.median(res["cpu"][k]) for k in ("ours", "deepspeed"))
        print(
            f"{P:>3} {w_ours:>10.4f} {w_ds:>9.4f} {w_ours / w_ds:>6.3f}   {c_ours:>9.4f} {c_ds:>8.4f} "
            f"{c_ours / c_ds:>6.3f}   {res['max_diff']:>10.2e}"
        )
        figures |= {f"wall_ratio_sp{P}": w_ours / w_ds, f"cpu_ratio_sp{P}": c_ours / c_ds}
        figures[f"max_diff_sp{P}"] = res["max_diff"]
    print("ratio = median ours / median DeepSpeed over interleaved iterations (goal <= 0.9);")
    print("wall = slowest rank's elapsed seconds, CPU = seconds of CPU all ranks used")
    from _results import record

    print(" ".join(f"{k}={v:.4g}" for k, v in figures.items()))
    record("bench_ulysses_vs_deepspeed", figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
