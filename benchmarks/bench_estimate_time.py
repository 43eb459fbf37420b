"""``estimate --time`` against measured training steps on this machine: predicted over
measured step time, one row per layout, length and document length.

The prediction needs a device row, and this machine's is measured here first (the ``cpu``
entry, :class:`ulysses_mm.tools.estimate.devices.DeviceKind`), never fitted to the steps:

- the matmul rate of one thread: a ``Linear(D, MLP)`` forward + backward on 8,192 tokens;
- the attention kernel (the model's ``sdpa_varlen``, forward + backward) on one causal
  document at two lengths: its rate per pair in model FLOPs (12·h·d per pair, as
  ``train_flops`` counts them) and its cost per query row;
- gloo all-to-all between two local processes: latency and bandwidth from two sizes;
- memory bandwidth (a large copy), for the optimizer step;
- the element-wise work the model does outside matmuls and attention, its own pieces at
  its shapes: a layer's norms, residual adds, RoPE and SwiGLU gate per token, and the
  loss's softmax cross-entropy per target and vocabulary entry.

Its efficiencies are :data:`~ulysses_mm.tools.estimate.devices.MEASURED` (the rates are
achieved rates; communication exposed). Then real training steps
(:class:`ulysses_mm.tools.measure.StepRunner`: the DeepSpeed engine, gloo, fp32) run for
``configs/debug-tiny.yaml`` at each row's layout (one process; two processes as sp 2, or as
dp 2), length and document length, the fastest of ``--steps`` steps on the slowest rank
counting, and ``estimate --time``'s arithmetic predicts each from the config alone.

    python benchmarks/bench_estimate_time.py [--steps 3] [--quick]

Last line: ``worst_ratio=X median_ratio=Y rows=N`` (predicted / measured; the worst is the
one furthest from 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

CONFIG = "configs/debug-tiny.yaml"
# (processes, sp, seq_len, doc_len, overrides): doc_len = seq_len is one document a sample
ROWS: list[tuple[int, int, int, int, tuple[str, ...]]] = [
    (1, 1, 4096, 4096, ()),
    (1, 1, 16384, 2048, ()),
    (1, 1, 8192, 8192, ("model.activation_checkpointing=true",)),
    (2, 2, 8192, 8192, ()),
    (2, 2, 16384, 2048, ()),
    (2, 2, 16384, 16384, ()),
    (2, 1, 8192, 1024, ()),
]
QUICK = [ROWS[0], (2, 2, 8192, 2048, ())]


def _cfg(sp: int, overrides: tuple[str, ...]):
    from ulysses_mm.config import RunConfig, load_config

    return load_config(RunConfig, CONFIG, [f"parallel.sp={sp}", *overrides])


def _measure_rows(rows: list, steps: int) -> list[tuple[float, dict[str, float]]]:
    """Each row's fastest step (seconds) on this rank, in this process's world, and the
    rates :func:`calibrate` measures just before it (every rank at once): the machine's
    load drifts, so each row is predicted from rates measured beside it."""
    import torch
    import torch.distributed as dist

    from ulysses_mm.parallel.mesh import open_world
    from ulysses_mm.tools.measure import StepRunner

    torch.set_num_threads(1)
    out = []
    for _, sp, seq_len, doc_len, overrides in rows:
        cfg = _cfg(sp, overrides)
        runner = StepRunner(cfg, open_world(cfg, device="cpu"))
        try:
            if dist.is_initialized():
                dist.barrier()
            rates = calibrate(cfg, sp // cfg.parallel.ring)
            runner.measure(seq_len, doc_len)  # the first step at this length
            batch = runner.batch(seq_len, doc_len)
            best = float("inf")
            for _ in range(steps):
                t0 = time.perf_counter()
                runner.step(batch)
                best = min(best, time.perf_counter() - t0)
            out.append((best, rates))
        finally:
            runner.close()
    return out


def _all_to_all(sizes: tuple[int, int]) -> list[float]:
    """Seconds of one gloo all-to-all of each size (bytes each rank holds), the fastest of 5."""
    import torch
    import torch.distributed as dist

    out = []
    for size in sizes:
        x = torch.ones(size // 4)
        y = torch.empty_like(x)
        dist.barrier()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            dist.all_to_all_single(y, x)
            best = min(best, time.perf_counter() - t0)
        out.append(best)
    return out


A2A_SIZES = (1 << 16, 1 << 23)
ATTENTION_LENGTHS = (1024, 8192)


def worker(rows: list, steps: int) -> dict:
    """One rank of the two-process world: the all-to-all microbenchmark, then its rows."""
    import torch

    from ulysses_mm.parallel.mesh import open_world

    torch.set_num_threads(1)
    open_world(_cfg(2, ()), device="cpu")
    return {"a2a": _all_to_all(A2A_SIZES), "steps": _measure_rows(rows, steps)}


def calibrate(cfg, ulysses: int = 1) -> dict[str, float]:
    """This process's rates in one thread, at the model's shapes: the matmul rate over the
    layer's and the widest head's Linear shapes (forward + backward on 8,192 tokens); the
    model's own attention kernel on one causal document at each of
    :data:`ATTENTION_LENGTHS`, on the heads a rank of a Ulysses group of ``ulysses`` holds,
    which gives its rate per pair (model FLOPs) and its cost per query row; the copy
    bandwidth."""
    import torch

    from ulysses_mm.model.attention import DocumentMask, LocalAttention
    from ulysses_mm.tools.estimate.shape import model_shape
    from ulysses_mm.tools.measure import run_space

    torch.set_num_threads(1)
    sh = model_shape(cfg, run_space(cfg))
    tokens, d = 8192, sh.hidden

    def fastest(fn, n: int = 5) -> float:
        fn()
        best = float("inf")
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    shapes = [(d, sh.q_width), (d, sh.kv_width), (d, sh.kv_width), (sh.q_width, d)]
    shapes += [(d, sh.inter), (d, sh.inter), (sh.inter, d), (d, sh.widest_head)]
    total = seconds = 0.0
    for fan_in, fan_out in shapes:
        lin = torch.nn.Linear(fan_in, fan_out, bias=False)
        x = torch.randn(tokens, fan_in, requires_grad=True)
        g = torch.randn(tokens, fan_out)
        seconds += fastest(lambda lin=lin, x=x, g=g: lin(x).backward(g))
        total += 6 * tokens * fan_in * fan_out
    matmul_flops = total / seconds
    h, hd = sh.heads // ulysses, sh.head_dim
    kv = sh.kv_expanded(ulysses) // ulysses
    kernel = LocalAttention("sdpa_varlen")

    def attention_s(length: int) -> float:
        q = torch.randn(1, length, h, hd, requires_grad=True)
        k, v = (torch.randn(1, length, kv, hd, requires_grad=True) for _ in range(2))
        go = torch.randn(1, length, h, hd)
        mask = DocumentMask(torch.zeros(1, length, dtype=torch.long))
        return fastest(lambda: kernel(q, k, v, mask).backward(go))

    # t(l) = pairs · 12·h·d / rate + l · h · row: two lengths give the rate and the per-row cost
    short, long = ATTENTION_LENGTHS
    t_short, t_long = attention_s(short), attention_s(long)
    flops = [12 * h * hd * n * (n + 1) / 2 for n in ATTENTION_LENGTHS]
    # solve [flops_i, rows_i] · [1/rate, row] = t_i
    rows = [n * h for n in ATTENTION_LENGTHS]
    det = flops[0] * rows[1] - flops[1] * rows[0]
    inv_rate = (t_short * rows[1] - t_long * rows[0]) / det
    row = max(0.0, (flops[0] * t_long - flops[1] * t_short) / det)
    attn = 1 / inv_rate if inv_rate > 0 else flops[1] / t_long
    a = torch.ones(1 << 24)
    b = torch.empty_like(a)
    copy = 2 * a.numel() * 4 / fastest(lambda: b.copy_(a))
    return {
        "matmul_flops": matmul_flops,
        "attention_flops": attn,
        "attention_row_s": row,
        "copy_bytes_s": copy,
        **elementwise(sh, tokens, fastest),
    }


def elementwise(sh, tokens: int, fastest) -> dict[str, float]:
    """The model's own element-wise pieces at its shapes, forward + backward on ``tokens``
    tokens: one layer's two RMSNorms, two residual adds, RoPE on q and k and SwiGLU's gate
    (seconds per token per layer), and the loss's softmax cross-entropy over the widest
    head (seconds per target per vocabulary entry)."""
    import torch
    import torch.nn.functional as F

    from ulysses_mm.model.llama import RMSNorm
    from ulysses_mm.model.rope import apply_rope

    d, hd = sh.hidden, sh.head_dim

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(1, tokens, *shape, requires_grad=True)

    x, o, m = leaf(d), leaf(d), leaf(d)
    q, k = leaf(sh.heads, hd), leaf(sh.kv_heads, hd)
    gate, up = leaf(sh.inter), leaf(sh.inter)
    cos, sin = torch.randn(1, tokens, hd), torch.randn(1, tokens, hd)
    norms = RMSNorm(d, 1e-5), RMSNorm(d, 1e-5)

    def layer() -> None:
        r = x + o
        outs = [norms[0](x), norms[1](r), r + m, apply_rope(q, cos, sin), apply_rope(k, cos, sin)]
        outs.append(F.silu(gate) * up)
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    logits = torch.randn(tokens, sh.widest_head, requires_grad=True)
    labels = torch.randint(0, sh.widest_head, (tokens,))
    loss = fastest(lambda: F.cross_entropy(logits, labels, reduction="sum").backward())
    return {
        "token_layer_s": fastest(layer) / tokens,
        "target_vocab_s": loss / (tokens * sh.widest_head),
    }


def main() -> None:
    from ulysses_mm.parallel.launch import launch_local

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (the fastest counts)")
    ap.add_argument("--quick", action="store_true", help="two rows, one timed step each")
    ap.add_argument("--smoke", action="store_true", help="--quick (the smoke test)")
    args = ap.parse_args()
    quick = args.quick or args.smoke
    rows = QUICK if quick else ROWS
    steps = 1 if quick else args.steps

    solo = [r for r in rows if r[0] == 1]
    pair = [r for r in rows if r[0] == 2]
    measured: dict[int, float] = {}
    rates: dict[int, dict[str, float]] = {}
    for r, (s, rate) in zip(solo, _measure_rows(solo, steps)):
        measured[rows.index(r)], rates[rows.index(r)] = s, rate
    res = launch_local(worker, 2, pair, steps)
    for i, r in enumerate(pair):
        # the slower rank: its step, and each rate's lower figure
        measured[rows.index(r)] = max(res[rank]["steps"][i][0] for rank in res)
        rates[rows.index(r)] = {
            k: min(res[rank]["steps"][i][1][k] for rank in res) for k in res[0]["steps"][i][1]
        }
    # all-to-all: t = latency + sent / bandwidth, sent = (U-1)/U of what a rank holds
    t_small, t_big = (max(res[rank]["a2a"][i] for rank in res) for i in range(2))
    sent = [s / 2 for s in A2A_SIZES]
    bandwidth = (sent[1] - sent[0]) / max(t_big - t_small, 1e-9)
    latency = max(0.0, t_small - sent[0] / bandwidth)
    print(rows_table(rows, measured, rates, bandwidth, latency, quick))


def cpu_entry(rates: dict[str, float], bandwidth: float, latency: float, name: str):
    """The measured ``cpu`` device row."""
    from ulysses_mm.tools.estimate.devices import DeviceKind

    return DeviceKind(
        name,
        peak_flops=rates["matmul_flops"],
        memory_gib=0.0,
        hbm_bytes_s=rates["copy_bytes_s"],
        intra_bytes_s=bandwidth,
        inter_bytes_s=bandwidth,
        pcie_bytes_s=rates["copy_bytes_s"],
        source="benchmarks/bench_estimate_time.py microbenchmarks, one thread a process",
        attention_flops=rates["attention_flops"],
        attention_row_s=rates["attention_row_s"],
        token_layer_s=rates["token_layer_s"],
        target_vocab_s=rates["target_vocab_s"],
        intra_latency_s=latency,
        inter_latency_s=latency,
    )


def _rates_text(rates: dict[str, float]) -> str:
    return (
        f"matmul {rates['matmul_flops'] / 1e9:.1f} GFLOP/s, attention "
        f"{rates['attention_flops'] / 1e9:.1f} GFLOP/s + {rates['attention_row_s'] * 1e6:.2f} µs "
        f"a row, element-wise {rates['token_layer_s'] * 1e6:.2f} µs a token a layer + "
        f"{rates['target_vocab_s'] * 1e9:.2f} ns a target a vocabulary entry, copy "
        f"{rates['copy_bytes_s'] / 1e9:.1f} GB/s"
    )


def rows_table(rows, measured, rates, bandwidth, latency, quick) -> str:
    from dataclasses import replace

    from ulysses_mm.tools.estimate import EstimateOptions, estimate
    from ulysses_mm.tools.estimate.devices import MEASURED
    from ulysses_mm.tools.estimate.documents import doc_lengths
    from ulysses_mm.tools.estimate.step_time import flop_rates, step_time
    from ulysses_mm.tools.measure import run_space

    lines = [
        f"estimate --time against measured steps: {CONFIG}, fp32, CPU/gloo, one thread a process",
        f"gloo all-to-all between the two: {bandwidth / 1e9:.2f} GB/s + {latency * 1e6:.0f} µs a "
        "call",
        f"{'layout':<14} {'seq_len':>8} {'doc_len':>8} {'extra':<24} {'measured s':>11} "
        f"{'predicted s':>12} {'ratio':>6}   compute / attention / element-wise / a2a / dp (s); the cpu "
        "entry measured beside the row",
    ]
    table = []
    for i, (procs, sp, seq_len, doc_len, overrides) in enumerate(rows):
        cfg = _cfg(sp, overrides)
        space = run_space(cfg)
        est = estimate(cfg, seq_len, EstimateOptions(gpus=procs, sp=sp, space=space, device="cpu"))
        est = replace(est, gpus_per_node=2)
        cpu = cpu_entry(
            rates[i], bandwidth, latency, f"cpu ({procs} process{'es' if procs > 1 else ''})"
        )
        st = step_time(cfg, est, flop_rates(cfg, space), doc_lengths(str(doc_len)), cpu, MEASURED)
        ratio = st.step_s / measured[i]
        layout = f"dp {procs // sp} × sp {sp}"
        parts = " / ".join(
            f"{st.exposed[k]:.3f}"
            for k in ("compute", "attention", "element-wise", "all-to-all", "dp comm")
        )
        extra = ",".join(o.split(".")[-1] for o in overrides) or "-"
        lines.append(
            f"{layout:<14} {seq_len:>8,} {doc_len:>8,} {extra:<24} {measured[i]:>11.3f} "
            f"{st.step_s:>12.3f} {ratio:>6.2f}   {parts}; {_rates_text(rates[i])}"
        )
        table.append(
            {
                "processes": procs,
                "sp": sp,
                "seq_len": seq_len,
                "doc_len": doc_len,
                "overrides": list(overrides),
                "measured_s": measured[i],
                "predicted_s": st.step_s,
                "ratio": ratio,
                "exposed": st.exposed,
                "cpu_entry": rates[i],
            }
        )
    ratios = [t["ratio"] for t in table]
    worst = max(ratios, key=lambda r: max(r, 1 / r))
    lines.append(
        f"worst ratio {worst:.2f} (within ±25 %: {all(0.75 <= r <= 1.25 for r in ratios)})"
    )
    lines.append(
        f"worst_ratio={worst:.3f} median_ratio={statistics.median(ratios):.3f} rows={len(ratios)}"
    )
    from _results import record

    record(
        "bench_estimate_time",
        {"worst_ratio": worst, "median_ratio": statistics.median(ratios), "rows": len(ratios)},
        smoke=quick,
        extra={
            "config": CONFIG,
            "all_to_all": {"bytes_s": bandwidth, "latency_s": latency},
            "table": table,
        },
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
