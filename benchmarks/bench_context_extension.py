"""Context extension on the copy probe: a tiny model trained at L0 bases, then carried to
factor × L0 with unchanged RoPE, a raised θ, linear interpolation, YaRN and Llama 3.1's
scaling.

1. ``probe write`` at L0 (samples of 2·L0+4 tokens) and at L1 = factor·L0 (2·L1+4).
2. The tiny model of tests/e2e/test_probe.py (hidden 64, 2 layers, 4 heads, 2 kv heads,
   micro-batch 8, lr 0.003) trains at L0 in one process (``ulysses-mm train``) until it
   copies, and is exported (``ulysses-mm export``).
3. From that export (``model.init_from``) each way trains ``--extend-steps`` steps on the
   L1 probe, only ``model.rope`` differing:
     plain   the checkpoint's RoPE (θ = 10,000, default kind)
     theta   θ × ``--theta-mult`` (default factor², as "adjusted base frequency" / LWM
             raise θ; default kind)
     linear  kind linear, factor (position interpolation: positions divided by factor, so
             the copy's offset L1 turns exactly as L0 did)
     yarn    kind yarn, factor, original_max_position_embeddings = 2·L0+4 (attention
             factor, beta_fast/slow: transformers' defaults)
     llama3  kind llama3, factor, original_max_position_embeddings = 2·L0+4,
             low_freq_factor 1, high_freq_factor 4 (Llama 3.1's)
4. Per way: the training loss of its step 1 (the batch's loss before any update at L1,
   the first row of its metrics.jsonl), of its last step, and the held-out bits per base
   of each half at L1 after the stage (``probe score``); beside them the L0 model's
   held-out bits per base at L0 and, unchanged, at L1. The loss is the token mean over
   the whole sample: ~ (2 bits + copy bits)/2 · ln 2 nats.

Trainings are subprocesses as a user runs them, two at a time (one thread each: this is
meant for a 2-core machine); scores run in this process.

    python benchmarks/bench_context_extension.py [--factor 8] [--json FILE]
    python benchmarks/bench_context_extension.py --quick     # smoke test: tiny steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TQDM_DISABLE", "1")  # the scores' and trainings' bars: the table only

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

WAYS = ("plain", "theta", "linear", "yarn", "llama3")
THETA = 10000.0  # RopeConfig's default θ, the L0 model's


def rope_of(way: str, args: argparse.Namespace) -> dict[str, Any]:
    """The ``model.rope`` section of one way ({} = the checkpoint's)."""
    original = 2 * args.length + 4
    if way == "plain":
        return {}
    if way == "theta":
        return {"theta": THETA * args.theta_mult}
    if way == "linear":
        return {"kind": "linear", "factor": float(args.factor)}
    if way == "yarn":
        return {
            "kind": "yarn",
            "factor": float(args.factor),
            "original_max_position_embeddings": original,
        }
    if way == "llama3":
        return {
            "kind": "llama3",
            "factor": float(args.factor),
            "original_max_position_embeddings": original,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        }
    raise ValueError(way)


def run_config(
    train: Path, steps: int, warmup: int, lr: float, args: argparse.Namespace, **model: Any
) -> dict[str, Any]:
    return {
        "model": {
            "hidden_size": 64,
            "intermediate_size": 172,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            **model,
        },
        "parallel": {"sp": 1},
        "data": {"train": str(train), "micro_batch_size": args.micro_batch},
        "train": {"steps": steps, "log_every": 1, "seed": args.seed},
        "deepspeed": {
            "optimizer": {"lr": lr, "weight_decay": 0.0},
            "scheduler": {"warmup_steps": warmup},
        },
        "logging": {"wandb": "disabled"},
    }


def train(cfg: dict[str, Any], run: Path) -> list[dict[str, Any]]:
    """``ulysses-mm train CONFIG --nproc 1`` (it must succeed): its training rows."""
    import yaml

    run.parent.mkdir(parents=True, exist_ok=True)
    path = run.parent / f"{run.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "ulysses_mm", "train", str(path), f"train.out_dir={run}"]
    res = subprocess.run(
        [*cmd, "--nproc", "1"],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in rows if r["kind"] == "train"), key=lambda r: r["step"])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--length", type=int, default=64, help="bases per half at L0 (64)")
    ap.add_argument("--factor", type=int, default=8, help="L1 = factor · L0 (8)")
    ap.add_argument("--steps", type=int, default=250, help="training steps at L0 (250)")
    ap.add_argument("--extend-steps", type=int, default=40, help="steps at L1 per way (40)")
    ap.add_argument("--lr", type=float, default=0.003, help="peak lr at L0 (0.003)")
    ap.add_argument("--extend-lr", type=float, default=None, help="peak lr at L1 (--lr)")
    ap.add_argument("--extend-warmup", type=int, default=5, help="warm-up steps at L1 (5)")
    ap.add_argument("--micro-batch", type=int, default=8, help="samples per step (8)")
    ap.add_argument(
        "--theta-mult", type=float, default=None, help="θ multiplier of 'theta' (factor²)"
    )
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated of {WAYS}")
    ap.add_argument("--seed", type=int, default=0, help="model init and probe bases (0)")
    ap.add_argument("--jobs", type=int, default=2, help="trainings at a time (2)")
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the figures here")
    ap.add_argument(
        "--quick", "--smoke", action="store_true", help="tiny sizes and steps (smoke test)"
    )
    args = ap.parse_args()
    if args.quick:
        args.length, args.factor, args.steps, args.extend_steps = 8, 2, 4, 2
    if args.extend_lr is None:
        args.extend_lr = args.lr
    if args.theta_mult is None:
        args.theta_mult = float(args.factor**2)
    ways = [w for w in args.ways.split(",") if w]
    if unknown := [w for w in ways if w not in WAYS]:
        ap.error(f"--ways: unknown {unknown} (of {WAYS})")
    if args.out:
        bench(args, ways, Path(args.out))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-ctx-") as tmp:
            bench(args, ways, Path(tmp))


def bench(args: argparse.Namespace, ways: list[str], out: Path) -> None:
    from ulysses_mm.tools.probe import score, write_probe
    from ulysses_mm.train.export import export

    t0 = time.perf_counter()
    L0, L1, mb = args.length, args.factor * args.length, args.micro_batch
    short = write_probe(out / f"probe{L0}", L0, args.steps * mb, 64, seed=args.seed)
    long = write_probe(out / f"probe{L1}", L1, args.extend_steps * mb, 32, seed=args.seed + 2)
    print(
        f"context extension on the copy probe: L0={L0} bases ({2 * L0 + 4} tokens), "
        f"L1={L1} ({2 * L1 + 4} tokens, ×{args.factor}); tiny model (D=64, 2 layers, 4 heads, "
        f"2 kv), micro-batch {mb}, lr {args.lr}"
    )
    base = out / "base"
    rows = train(run_config(short.train, args.steps, 10, args.lr, args), base)
    exported = export(base, out / "base-hf")
    base_short, base_long = (
        score(str(base), str(short.eval), 1),
        score(str(base), str(long.eval), 1),
    )
    print(
        f"L0 stage: {args.steps} steps ({time.perf_counter() - t0:.0f} s so far), final loss "
        f"{rows[-1]['loss']:.4f}; held out at L0: {base_short[0]:.3f} / {base_short[1]:.3f} "
        f"bits/base (first / copied half); unchanged at L1: {base_long[0]:.3f} / "
        f"{base_long[1]:.3f}"
    )

    def extend(way: str) -> dict[str, Any]:
        model = {"init_from": str(exported)}
        if rope := rope_of(way, args):
            model["rope"] = rope
        cfg = run_config(
            long.train, args.extend_steps, args.extend_warmup, args.extend_lr, args, **model
        )
        run = out / way
        t = time.perf_counter()
        r = train(cfg, run)
        return {"rows": r, "run": run, "seconds": time.perf_counter() - t}

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = dict(zip(ways, pool.map(extend, ways), strict=True))
    figures: dict[str, float] = {
        "L0_first_bits": base_short[0],
        "L0_copy_bits": base_short[1],
        "L1_plain_first_bits_before": base_long[0],
        "L1_plain_copy_bits_before": base_long[1],
    }
    describe = {
        "plain": f"θ={THETA:g} (the checkpoint's)",
        "theta": f"θ={THETA * args.theta_mult:g} (×{args.theta_mult:g})",
        "linear": f"linear ×{args.factor} (positions / {args.factor})",
        "yarn": f"yarn ×{args.factor}, orig {2 * L0 + 4}",
        "llama3": f"llama3 ×{args.factor}, orig {2 * L0 + 4}, 1/4",
    }
    print(
        f"\nextension to L1={L1} from the L0 export, {args.extend_steps} steps each "
        "(bits/base held out at L1 after the stage)"
    )
    print(
        f"{'way':<7s} {'RoPE':<30s} {'step-1 loss':>11s} {'final loss':>10s} "
        f"{'first bits':>10s} {'copy bits':>9s} {'s':>5s}"
    )
    print(
        f"{'before':<7s} {'θ=10000, no step at L1':<30s} {'':>11s} {'':>10s} "
        f"{base_long[0]:>10.3f} {base_long[1]:>9.3f} {'':>5s}"
    )
    for way, res in results.items():
        first, copy = score(str(res["run"]), str(long.eval), 1)
        step1, final = res["rows"][0]["loss"], res["rows"][-1]["loss"]
        assert res["rows"][0]["step"] == 1
        print(
            f"{way:<7s} {describe[way]:<30s} {step1:>11.4f} {final:>10.4f} {first:>10.3f} "
            f"{copy:>9.3f} {res['seconds']:>5.0f}"
        )
        figures |= {
            f"{way}_step1_loss": step1,
            f"{way}_final_loss": final,
            f"{way}_first_bits": first,
            f"{way}_copy_bits": copy,
        }
    wall = time.perf_counter() - t0
    print(
        f"loss: nats per token over the whole sample (~(2 + copy bits)/2·ln 2); step-1: the "
        f"first batch at L1, before any update; wall {wall:.0f} s"
    )
    figures["wall_s"] = wall
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    print(" ".join(f"{k}={v:.4f}" if math.isfinite(v) else f"{k}={v}" for k, v in figures.items()))
    from _results import record

    record("bench_context_extension", figures, smoke=args.quick)


if __name__ == "__main__":
    main()
