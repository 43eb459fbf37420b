"""Context extension on the retrieval probe: does a model extended in stages *use* its new
length? Each way of extending RoPE is one ``train.stages`` run of the product.

Data (``ulysses-mm probe write --task recall``, DNA): documents of L tokens whose filler
is plain, with P keys (lowercase bases, each unique in its document) planted with a value
(one uppercase base) and asked for again later, at distances log-uniform from 4 tokens to
the document's length (5 pairs a document). One training set mixes three sources, every
sample packed at 8·L0 tokens: documents of L0 (8 to a sample), of 4·L0 (2 to a sample)
and of 8·L0 (one), weighted 0.8 / 0.1 / 0.1, so stage 1 cuts windows of L0 out of the
same shards a stage at 4·L0 or 8·L0 reads whole (``loader/window.py``: windows, each DP
rank its own samples). A window of L0 cut out of a long document holds queries whose key
is in an earlier window, which nothing can answer: with the three weighted alike (0.5 /
0.25 / 0.25) the stage-1 model had not learned recall after 4,000 steps, at 0.6 / 0.2 /
0.2 it answered 51 % after 6,000, at 0.8 / 0.1 / 0.1 88 %. Held out: documents of L0,
2·L0, 4·L0 and 8·L0.

Runs (``ulysses-mm train CONFIG --nproc 2``, a small model: hidden 64, 2 layers, 4 heads,
token embedding initialised N(0, 1) as torchtitan's Llama: with transformers' 0.02 this
model learns recall several times slower):

1. **Stage 1** (the base run): ``--steps`` steps at L0, dp 2, global batch 16, a flat
   learning rate ``--lr`` after 50 warm-up steps. Scored at L0 (every distance bucket
   must be answered, the issue's ≥ 90 %), and zero-shot at 2×, 4×, 8× with each way's
   RoPE applied at scoring (``probe score --rope``).
2. **Stage 2**, per way and per ``--runs`` entry ``F:budget`` (length F·L0, steps a
   fraction of the stage-1 steps; default 4:0.05, 4:0.2, 8:0.05): the base run directory
   copied, and the same command run again with a second stage appended (a resume: the
   run continues from its stage-1 checkpoint), at F·L0 tokens, SP 2 (a re-layout: dp 2
   → sp 2, global batch 8), the way's RoPE, a re-warm-up of 5 steps, at a fine-tuning
   learning rate ``--ft-lr`` (a third of the peak). Scored at F·L0.

Ways: plain (the checkpoint's RoPE), theta (θ × F², as "adjusted base frequency"), linear
(positions / F), dynamic (NTK, θ grows past the original length), yarn and llama3 (Llama
3.1's low/high frequency factors 1/4), the scaled kinds with original length L0.

Figures: accuracy (exact answer) and bits per answer by distance bucket for every curve,
in ``--json`` under ``curves`` keyed ``base/L0``, ``zero_shot/<way>/<F>x``,
``extended/<F>x/<budget>/<way>``; the last line holds the headline accuracies (pooled
over the distances in (L0, F·L0]). A PNG of the curves with ``--png``.

    python benchmarks/bench_context_extension.py [--json FILE] [--png FILE]
    python benchmarks/bench_context_extension.py --quick     # smoke test: tiny steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TQDM_DISABLE", "1")  # the scores' and trainings' bars: the table only

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

WAYS = ("plain", "theta", "linear", "dynamic", "yarn", "llama3")
THETA = 10000.0  # RopeConfig's default θ, the stage-1 model's
FACTORS = (2, 4, 8)  # zero-shot lengths, × L0
WEIGHTS = {1: 0.8, 4: 0.1, 8: 0.1}  # training sources: documents of F·L0 tokens
PAIRS = 5
GLOBAL_BATCH = 16  # stage 1
EXTEND_BATCH = 8  # stage 2: samples of F·L0 tokens


def rope_of(way: str, factor: int, length: int) -> dict[str, Any]:
    """The ``model.rope`` of one way at ``factor`` × ``length`` ({} = the checkpoint's)."""
    f = float(factor)
    if way == "plain":
        return {}
    if way == "theta":
        return {"theta": THETA * f * f}
    if way == "linear":
        return {"kind": "linear", "factor": f}
    if way in ("dynamic", "yarn"):
        return {"kind": way, "factor": f, "original_max_position_embeddings": length}
    if way == "llama3":
        return {
            "kind": "llama3",
            "factor": f,
            "original_max_position_embeddings": length,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        }
    raise ValueError(way)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``ulysses-mm ARGS`` as a user runs it (it must succeed)."""
    cmd = [sys.executable, "-m", "ulysses_mm", *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"ulysses-mm {' '.join(args)} failed:\n{res.stderr[-3000:]}")
    return res


def write_data(out: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The three training sources (all samples 8·L0 tokens, ``--samples`` of them shared
    by the weights) and the held-out sets."""
    L0, longest = args.length, 8 * args.length
    made: dict[str, Path] = {}
    for f, weight in WEIGHTS.items():
        n = f * L0
        docs = max(1, round(weight * args.samples)) * (longest // n)
        extra = [f"--eval-lengths={2 * L0},{4 * L0},{8 * L0}"] if f == 1 else []
        d = out / f"recall{n}"
        cli(
            "probe", "write", str(d), "--task", "recall", "--length", str(n),
            "--pairs", str(PAIRS), "--documents", str(docs),
            "--eval-documents", str(args.eval_documents), "--pack", str(longest // n),
            "--seed", str(args.seed + n), *extra,
        )  # fmt: skip
        made[f"train{n}"] = d / "train" / "manifest.json"
    made[f"eval{L0}"] = out / f"recall{L0}" / "eval" / "manifest.json"
    for f in FACTORS:
        made[f"eval{f * L0}"] = out / f"recall{L0}" / f"eval-L{f * L0}" / "manifest.json"
    return made


def run_config(data: dict[str, Path], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    L0 = args.length
    weights = {f * L0: w for f, w in WEIGHTS.items()}
    return {
        "model": {
            "hidden_size": 64,
            "intermediate_size": 172,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "embedding_init_std": 1.0,
            "rope": {"theta": THETA},
        },
        "data": {
            "train": {str(data[f"train{n}"]): w for n, w in weights.items()},
            "micro_batch_size": GLOBAL_BATCH // 2,
        },
        "train": {
            "steps": args.steps,
            "log_every": 10,
            "seed": args.seed,
            "out_dir": str(out),
            "checkpoint_every": 0,
            "stages": [{"steps": args.steps, "data": {"seq_len": L0}, "parallel": {"sp": 1}}],
        },
        "deepspeed": {
            "optimizer": {"lr": args.lr, "weight_decay": 0.0},
            "scheduler": {"type": "WarmupLR", "warmup_steps": 50 if not args.quick else 1},
        },
        "logging": {"wandb": "disabled"},
    }


def train(cfg: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """``ulysses-mm train PATH --nproc 2``: the run's training rows."""
    import yaml

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cli("train", str(path), "--nproc", "2")
    run = Path(cfg["train"]["out_dir"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in rows if r["kind"] == "train"), key=lambda r: r["step"])


def score(run: Path, manifest: Path, rope: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """``ulysses-mm probe score`` with ``rope`` applied: its JSON."""
    out = tmp / "score.json"
    extra = ["--rope", ",".join(f"{k}={v}" for k, v in rope.items())] if rope else []
    cli("probe", "score", str(run), str(manifest), "--sp", "1", "--json", str(out), *extra)
    return json.loads(out.read_text())


def buckets(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [dict(b) for b in result["buckets"]]


def accuracy_in(curve: list[dict[str, Any]], lo: int, hi: int) -> float:
    """Answers right at distances in (lo, hi], pooled over the buckets inside it."""
    rows = [b for b in curve if b["lo"] >= lo and b["hi"] <= hi + 1 and b["answers"]]
    n = sum(b["answers"] for b in rows)
    return sum(b["accuracy"] * b["answers"] for b in rows) / n if n else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--length", type=int, default=128, help="L0, tokens per document (128)")
    ap.add_argument("--steps", type=int, default=8000, help="stage-1 steps at L0 (8000)")
    ap.add_argument(
        "--runs",
        default="4:0.05,4:0.2,8:0.05",
        help="stage-2 runs as F:budget, F·L0 tokens for budget × --steps steps",
    )
    ap.add_argument("--lr", type=float, default=0.003, help="stage-1 lr (0.003)")
    ap.add_argument("--ft-lr", type=float, default=0.001, help="stage-2 lr (0.001)")
    ap.add_argument(
        "--samples", type=int, default=16000, help="training samples of 8·L0 tokens (16000)"
    )
    ap.add_argument("--eval-documents", type=int, default=96, help="held-out documents (96)")
    ap.add_argument(
        "--ways", default=None, help=f"comma-separated of {WAYS} (all; --quick: plain,yarn)"
    )
    ap.add_argument("--seed", type=int, default=0, help="model init and probe data (0)")
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write every curve here")
    ap.add_argument("--png", default=None, metavar="FILE", help="draw the curves here")
    ap.add_argument("--quick", "--smoke", action="store_true", help="tiny sizes and steps")
    ap.add_argument(
        "--replot", default=None, metavar="FILE", help="report a --json FILE again, no training"
    )
    args = ap.parse_args()
    if args.replot:
        doc = json.loads(Path(args.replot).read_text())
        args.length, args.steps = doc["length"], doc["steps"]
        runs = [(int(r["factor"]), float(r["budget"])) for r in doc["runs"]]
        ways = [w for w in WAYS if f"zero_shot/{w}/2x" in doc["curves"]]
        wall = doc["headline"]["wall_s"]
        report(args, ways, doc["curves"], doc["stage_seconds"], runs, wall)
        return
    if args.quick:
        args.length, args.steps, args.samples, args.eval_documents = 32, 4, 8, 8
        args.runs = "4:0.5"
        args.ways = args.ways or "plain,yarn"
    ways = [w for w in (args.ways or ",".join(WAYS)).split(",") if w]
    if unknown := [w for w in ways if w not in WAYS]:
        ap.error(f"--ways: unknown {unknown} (of {WAYS})")
    if args.out:
        bench(args, ways, Path(args.out))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-ctx-") as tmp:
            bench(args, ways, Path(tmp))


def bench(args: argparse.Namespace, ways: list[str], out: Path) -> None:
    t0 = time.perf_counter()
    L0 = args.length
    out.mkdir(parents=True, exist_ok=True)
    data = write_data(out, args)
    print(
        f"context extension on the recall probe: L0={L0} tokens; tiny model (D=64, 2 layers, "
        f"4 heads, embedding init N(0, 1)), global batch {GLOBAL_BATCH}, lr {args.lr}, "
        f"stage 2 lr {args.ft_lr}; data written in {time.perf_counter() - t0:.0f} s"
    )
    base_cfg = run_config(data, args, out / "base")
    rows = train(base_cfg, out / "base.yaml")
    curves: dict[str, list[dict[str, Any]]] = {}
    curves["base/L0"] = buckets(score(out / "base", data[f"eval{L0}"], {}, out))
    print(
        f"stage 1: {args.steps} steps at {L0} ({time.perf_counter() - t0:.0f} s so far), "
        f"final loss {rows[-1]['loss']:.4f}; accuracy by distance at L0: "
        + " ".join(f"≤{b['hi'] - 1}:{b['accuracy']:.2f}" for b in curves["base/L0"])
    )
    for way in ways:
        for f in FACTORS:
            rope = rope_of(way, f, L0)
            curves[f"zero_shot/{way}/{f}x"] = buckets(
                score(out / "base", data[f"eval{f * L0}"], rope, out)
            )
    runs = [(int(f), float(b)) for f, b in (r.split(":") for r in args.runs.split(",") if r)]
    seconds: dict[str, float] = {}
    for f, budget in runs:
        steps = max(1, round(budget * args.steps))
        for way in ways:
            key = f"extended/{f}x/{budget:g}/{way}"
            run = out / f"{f}x-{budget:g}-{way}"
            shutil.copytree(out / "base", run)
            cfg = run_config(data, args, run)
            cfg["train"]["steps"] = args.steps + steps
            cfg["deepspeed"]["optimizer"]["lr"] = args.ft_lr  # the resumed run's peak
            stage = {
                "steps": steps,
                "warmup_steps": min(5, steps),
                "data": {"seq_len": f * L0, "micro_batch_size": EXTEND_BATCH},
                "parallel": {"sp": 2},
            }
            if rope := rope_of(way, f, L0):
                stage["model"] = {"rope": rope}
            cfg["train"]["stages"].append(stage)
            t = time.perf_counter()
            train(cfg, out / f"{run.name}.yaml")
            seconds[key] = time.perf_counter() - t
            curves[key] = buckets(score(run, data[f"eval{f * L0}"], rope, out))
            shutil.rmtree(run / "checkpoints", ignore_errors=True)  # disk: keep the rows
            print(f"{key}: {steps} steps in {seconds[key]:.0f} s", flush=True)
    report(args, ways, curves, seconds, runs, time.perf_counter() - t0)


def report(
    args: argparse.Namespace,
    ways: list[str],
    curves: dict[str, list[dict[str, Any]]],
    seconds: dict[str, float],
    runs: list[tuple[int, float]],
    wall: float,
) -> None:
    L0 = args.length
    print("\naccuracy at distances in (L0, F·L0] (zero-shot: the L0 model, the way's RoPE)")
    head = f"{'way':<8s}" + "".join(f"{'zero ' + str(f) + 'x':>9s}" for f in FACTORS)
    head += "".join(f"{f'{f}x @{b:g}':>10s}" for f, b in runs)
    print(head)
    headline: dict[str, float] = {
        "L0_min_bucket_acc": min(b["accuracy"] for b in curves["base/L0"] if b["answers"])
    }
    columns = ["way", *(f"zero-shot {f}x" for f in FACTORS)]
    columns += [f"{f}x, {round(b * args.steps)} steps" for f, b in runs]
    rows = []
    for way in ways:
        line, row = f"{way:<8s}", [way]
        for f in FACTORS:
            acc = accuracy_in(curves[f"zero_shot/{way}/{f}x"], L0, f * L0)
            line += f"{acc:>9.2f}"
            row.append(round(acc, 3))
            headline[f"zero_{way}_{f}x"] = acc
        for f, b in runs:
            acc = accuracy_in(curves[f"extended/{f}x/{b:g}/{way}"], L0, f * L0)
            line += f"{acc:>10.2f}"
            row.append(round(acc, 3))
            headline[f"ext_{way}_{f}x_{b:g}"] = acc
        print(line)
        rows.append(row)
    for f, b in runs:
        top = max(headline[f"ext_{w}_{f}x_{b:g}"] for w in ways)
        best = [w for w in ways if headline[f"ext_{w}_{f}x_{b:g}"] >= top - 5e-4]
        headline[f"best_{f}x_{b:g}_acc"] = top
        print(f"best after the {f}x stage of {round(b * args.steps)} steps ({top:.3f}): {best}")
    headline["wall_s"] = wall
    if args.json and not getattr(args, "replot", None):
        doc = {
            "length": L0,
            "steps": args.steps,
            "runs": [{"factor": f, "budget": b} for f, b in runs],
            "curves": curves,
            "stage_seconds": seconds,
            "headline": headline,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.png:
        plot(curves, ways, runs, Path(args.png))
    print(" ".join(f"{k}={v:.4f}" if math.isfinite(v) else f"{k}={v}" for k, v in headline.items()))
    sys.path.insert(0, str(Path(__file__).parent))
    from _results import record

    table = {
        "columns": columns,
        "rows": rows,
        "notes": f"exact-answer accuracy at distances in (L0, F·L0], L0 = {L0}; the L0 model "
        f"after {args.steps} steps answers ≥ {headline['L0_min_bucket_acc']:.2f} in every "
        "distance bucket up to L0",
    }
    record(
        "bench_context_extension",
        headline,
        smoke=args.quick,
        extra={"tables": {"accuracy": table}, "curves": curves},
    )


def plot(
    curves: dict[str, list[dict[str, Any]]],
    ways: list[str],
    runs: list[tuple[int, float]],
    path: Path,
) -> None:
    """Accuracy against distance: the base at L0, each way zero-shot at the longest
    extension, and each way after each extension stage (its largest budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    largest = {f: max(b for g, b in runs if g == f) for f, _ in runs}
    panels = [(f"zero-shot at {max(largest)}x", f"zero_shot/{{way}}/{max(largest)}x")]
    panels += [
        (f"after the {f}x stage ({b:g} of the steps)", f"extended/{f}x/{b:g}/{{way}}")
        for f, b in largest.items()
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), sharey=True)
    for ax, (title, pattern) in zip(axes if len(panels) > 1 else [axes], panels, strict=True):
        base = curves["base/L0"]
        ax.plot(
            [b["hi"] - 1 for b in base],
            [b["accuracy"] for b in base],
            "k--",
            label="L0 model at L0",
        )
        for way in ways:
            c = curves[pattern.format(way=way)]
            ax.plot(
                [b["hi"] - 1 for b in c], [b["accuracy"] for b in c], marker="o", ms=3, label=way
            )
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel("distance (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("exact-answer accuracy")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
