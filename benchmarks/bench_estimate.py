"""The memory estimate beside measurement: per-rank peak of one real training step.

For each case, ``ulysses-mm estimate``'s arithmetic (``device="cpu"``: the tensors of a
CPU process) is printed beside the peak that ``ulysses_mm.tools.measure`` measures on the same
run (DeepSpeed engine, gloo, SP ranks as local processes started by torch's elastic
launcher), and the part above what was live before the step. tests/distributed/test_estimate.py
asserts the same figures within 15 %.

    python benchmarks/bench_estimate.py                      # debug-tiny and small, SP=1, 2
    python benchmarks/bench_estimate.py --config configs/small.yaml --seq-len 4096 --sp 2
    python benchmarks/bench_estimate.py --modes    # the memory modes on small.yaml, SP=1

``--modes`` measures one config (default configs/small.yaml at 8,192 tokens, SP=1) four
times in the same run: without the memory modes, with checkpoints offloaded to the host
(``model.offload_checkpoints``), with the sequence-tiled layer (``model.layer_tile_tokens``)
and with both. Per variant: the peak above the step's start per token, measured and
estimated, the factor by which each shrinks against the run without the modes, what the
offload holds in host memory (apart from the peak), and the CPU step time as tokens/s.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
DEFAULT = [
    ("configs/debug-tiny.yaml", 8192),
    ("configs/small.yaml", 2048),
]


def measured_and_estimated(cfg, sp: int, seq_len: int, doc_len: int):
    """(the measured rank with the highest peak, the estimate, the estimated peak above the
    step start: the peak less what lives between steps)."""
    from ulysses_mm.config import to_dict
    from ulysses_mm.parallel.launch import launch_local
    from ulysses_mm.tools.estimate import EstimateOptions, estimate
    from ulysses_mm.tools.measure import measure_launched

    res = launch_local(measure_launched, sp, to_dict(cfg), seq_len, doc_len)
    m = max(res.values(), key=lambda r: r["peak"])
    est = estimate(cfg, seq_len, EstimateOptions(device="cpu"))
    between = [
        t.bytes
        for t in est.phase("optimizer step").terms
        if t.name not in ("gradients", "optimizer step temporaries")
    ]
    return m, est, est.peak - sum(between)


def main() -> None:
    from ulysses_mm.config import RunConfig, load_config

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=None, help="one run config (default: debug-tiny, small)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sample N")
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2], help="SP sizes (default 1 2)")
    ap.add_argument("--doc-len", type=int, default=1024, help="document length (default 1024)")
    ap.add_argument("--modes", action="store_true", help="compare the memory modes (SP=1)")
    ap.add_argument("--tile", type=int, default=1024, help="layer tile for --modes (1024)")
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    from _results import record

    if args.modes:
        figures = modes(args)
        print(" ".join(f"{k}={v:.3f}" for k, v in figures.items()))
        record("bench_estimate", figures, smoke=args.smoke, extra={"modes": True})
        return
    cases = [(args.config, args.seq_len or 8192)] if args.config else DEFAULT
    if args.smoke:  # debug-tiny, one process, 1,024 tokens
        cases, args.sp, args.doc_len = [("configs/debug-tiny.yaml", 1024)], [1], 256
    ratios = {}
    print(
        f"{'config':<28s}{'N':>7s}{'SP':>4s}  {'estimated MiB':>14s}{'measured MiB':>14s}"
        f"{'ratio':>7s}  {'above the step start: est.':>27s}{'meas.':>9s}{'ratio':>7s}  phase"
    )
    for path, seq_len in cases:
        for sp in args.sp:
            cfg = load_config(RunConfig, REPO / path, [*args.overrides, f"parallel.sp={sp}"])
            m, est, e_above = measured_and_estimated(cfg, sp, seq_len, args.doc_len)
            m_above = m["peak"] - m["base"]
            mib = 2**20
            print(
                f"{Path(path).name:<28s}{seq_len:>7d}{sp:>4d}  {est.peak / mib:>14.2f}"
                f"{m['peak'] / mib:>14.2f}{est.peak / m['peak']:>7.3f}  {e_above / mib:>27.2f}"
                f"{m_above / mib:>9.2f}{e_above / m_above:>7.3f}  {est.peak_phase}",
                flush=True,
            )
            ratios[f"{Path(path).stem}_n{seq_len}_sp{sp}"] = est.peak / m["peak"]
    line = f"min_est_over_measured={min(ratios.values()):.3f} max_est_over_measured={max(ratios.values()):.3f}"
    print(line)
    record(
        "bench_estimate",
        {**ratios, "min": min(ratios.values()), "max": max(ratios.values())},
        smoke=args.smoke,
    )


def modes(args) -> dict[str, float]:
    """The memory modes side by side; returns each mode's estimate / measured ratio."""
    from ulysses_mm.config import RunConfig, load_config

    path = args.config or "configs/small.yaml"
    seq_len = args.seq_len or 8192
    ckpt = "model.activation_checkpointing=true"
    tiles = [f"model.layer_tile_tokens={args.tile}", "model.mlp_tile_tokens=0"]  # MLP in them
    variants = {
        "none": [ckpt, "model.offload_checkpoints=false", "model.layer_tile_tokens=0"],
        "offload": [ckpt, "model.offload_checkpoints=true", "model.layer_tile_tokens=0"],
        "tiles": [ckpt, "model.offload_checkpoints=false", *tiles],
        "both": [ckpt, "model.offload_checkpoints=true", *tiles],
    }
    print(f"{path}, {seq_len:,} tokens, SP=1: peak above the step's start, bytes per token")
    print(
        f"{'mode':<9s}{'measured':>10s}{'estimated':>11s}{'ratio':>7s}{'meas. ×':>9s}"
        f"{'est. ×':>8s}{'host MiB':>10s}{'tokens/s':>10s}{'cost':>8s}  estimate's peak phase"
    )
    first: dict[str, float] = {}
    ratios = {}
    for name, ov in variants.items():
        cfg = load_config(RunConfig, REPO / path, [*args.overrides, *ov, "parallel.sp=1"])
        m, est, e_above = measured_and_estimated(cfg, 1, seq_len, args.doc_len)
        meas = (m["peak"] - m["base"]) / seq_len
        est_pt = e_above / seq_len
        tps = m["tokens_per_s"]
        first = first or {"meas": meas, "est": est_pt, "tps": tps}
        ratios[f"{name}_est_over_measured"] = est_pt / meas
        print(
            f"{name:<9s}{meas:>10,.0f}{est_pt:>11,.0f}{est_pt / meas:>7.3f}"
            f"{first['meas'] / meas:>9.2f}{first['est'] / est_pt:>8.2f}"
            f"{m['host'] / 2**20:>10.1f}{tps:>10.0f}{tps / first['tps'] - 1:>+8.0%}  "
            f"{est.peak_phase}",
            flush=True,
        )
    return ratios


if __name__ == "__main__":
    main()
