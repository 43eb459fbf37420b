"""``ulysses-mm report``: loss curves per modality from a run's ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (was logging.jsonl off?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(run_dir: str | Path, png: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no training steps")
    mods = sorted({k.removeprefix("loss/") for r in train for k in r if k.startswith("loss/")})
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[3, 1])
    steps = [r["step"] for r in train]
    ax.plot(steps, [r["loss"] for r in train], color="black", lw=2, label="total (weighted)")
    for m in mods:
        pts = [(r["step"], r[f"loss/{m}"]) for r in train if r.get(f"loss/{m}") is not None]
        if pts:
            ax.plot(*zip(*pts), lw=1.2, label=f"{m} (train)")
        epts = [
            (r["step"], r[f"eval/loss/{m}"]) for r in evals if r.get(f"eval/loss/{m}") is not None
        ]
        if epts:
            ax.plot(*zip(*epts), "o--", ms=4, label=f"{m} (eval)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"{run_dir.name}: loss per modality")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax_lr.plot(steps, [r.get("lr", 0.0) for r in train], color="tab:gray")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
