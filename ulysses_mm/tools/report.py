"""``ulysses-mm report``: loss curves per modality from a run's ``metrics.jsonl``.

A packed sample is mostly one modality, so the total loss of a step jumps with the mix of
that step's batch (DNA near 1.4 nats, video near 5): the raw total hides learning. The
plot shows each modality's curve, and the total smoothed by a debiased exponential moving
average, with the raw total faint behind it. A run that grows its context in stages has
each stage's first step marked, with its length.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ulysses_mm.core.errors import DataError, NotFoundError
from ulysses_mm.core.storage import atomic_write_local

SMOOTHING = 0.9  # EMA factor of the smoothed total: about the last 10 steps count


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise NotFoundError(f"{path} does not exist (was logging.jsonl off?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ema(values: Sequence[float], beta: float = SMOOTHING) -> list[float]:
    """Exponential moving average, debiased (the first value is itself, not pulled toward
    0); a missing or non-finite value leaves the average where it was."""
    out: list[float] = []
    avg, weight = 0.0, 0.0
    for v in values:
        if v is not None and math.isfinite(v):
            avg = beta * avg + (1 - beta) * v
            weight = beta * weight + (1 - beta)
        out.append(avg / weight if weight else math.nan)
    return out


@dataclass
class LossSeries:
    """What ``plot`` draws: (steps, values) per curve."""

    steps: list[int]
    total: list[float]
    total_smoothed: list[float]
    beta: float
    lr: list[float]
    modalities: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    evals: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    # (first step, stage, seq_len) of each stage of a staged run after its first
    stage_starts: list[tuple[int, int, int]] = field(default_factory=list)


def loss_series(records: Sequence[dict], beta: float = SMOOTHING) -> LossSeries:
    """The curves of a run's metrics records (``kind`` train and eval)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    mods = sorted({k.removeprefix("loss/") for r in train for k in r if k.startswith("loss/")})
    total = [math.nan if r.get("loss") is None else float(r["loss"]) for r in train]
    out = LossSeries(
        steps=[r["step"] for r in train],
        total=total,
        total_smoothed=ema(total, beta),
        beta=beta,
        lr=[r.get("lr", 0.0) for r in train],
    )
    stage = train[0].get("stage") if train else None
    for r in train:
        if r.get("stage") is not None and r["stage"] != stage:
            stage = r["stage"]
            out.stage_starts.append((int(r["step"]), int(stage), int(r.get("seq_len") or 0)))
    for m in mods:
        pts = [(r["step"], r[f"loss/{m}"]) for r in train if r.get(f"loss/{m}") is not None]
        if pts:
            out.modalities[m] = ([s for s, _ in pts], [v for _, v in pts])
        epts = [
            (r["step"], r[f"eval/loss/{m}"]) for r in evals if r.get(f"eval/loss/{m}") is not None
        ]
        if epts:
            out.evals[m] = ([s for s, _ in epts], [v for _, v in epts])
    return out


def plot(run_dir: str | Path, png: str | Path) -> Path:
    import matplotlib  # lazy: heavy (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: heavy (matplotlib)

    run_dir = Path(run_dir)
    s = loss_series(read_metrics(run_dir))
    if not s.steps:
        raise DataError(f"{run_dir / 'metrics.jsonl'} holds no training steps")
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[3, 1])
    ax.plot(s.steps, s.total, color="black", lw=0.8, alpha=0.25, label="total (raw)")
    ax.plot(
        s.steps,
        s.total_smoothed,
        color="black",
        lw=2,
        label=f"total (weighted), EMA {s.beta:g}",
    )
    for i, m in enumerate(sorted(set(s.modalities) | set(s.evals))):
        color = f"C{i}"
        if m in s.modalities:
            ax.plot(*s.modalities[m], color=color, lw=1.2, label=f"{m} (train)")
        if m in s.evals:
            ax.plot(*s.evals[m], "o--", color=color, ms=4, label=f"{m} (eval)")
    for step, stage, seq_len in s.stage_starts:  # a staged run: where each stage begins
        for a in (ax, ax_lr):
            a.axvline(step - 0.5, color="tab:red", lw=1, ls=":")
        what = f"stage {stage}" + (f": {seq_len:,} tokens" if seq_len else "")
        ax.annotate(
            what,
            (step - 0.5, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            fontsize=8,
            color="tab:red",
        )
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"{run_dir.name}: loss per modality")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax_lr.plot(s.steps, s.lr, color="tab:gray")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    png = Path(png)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_local(png, buf.getvalue())  # the old file or the whole new one
    return png
