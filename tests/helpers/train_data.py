"""Small real datasets for the loader and training tests, made with the real DNA pipeline.

``learnable_fasta`` writes records that repeat one short motif from a random phase: a
stream a tiny model learns in a few steps, so a falling loss means training works.
``train_rows`` runs ``ulysses-mm train`` as a user would and reads back what it logged.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from conftest import REPO

from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare

MOTIF = "ACGTTGCAAGTC"
# records of unequal length: a few as long as a sample of 256 tokens among many short ones,
# so packed samples differ in attention work (balanced steps)
MIXED_LENGTHS = [700, 40, 60, 30, 50, 900, 45, 35, 55, 65, 25, 800, 40, 30, 60, 50] * 3


def learnable_fasta(
    path: Path, records: int, length: int, seed: int, lengths: list[int] | None = None
) -> Path:
    """``records`` records of [length/2, length) bases, or of ``lengths`` when given."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for i in range(records):
            phase = int(rng.integers(len(MOTIF)))
            n = int(rng.integers(length // 2, length)) if lengths is None else lengths[i]
            seq = (MOTIF * (n // len(MOTIF) + 2))[phase : phase + n]
            f.write(f">rec{i}\n")
            for j in range(0, n, 70):
                f.write(seq[j : j + 70] + "\n")
    return path


def prepare_dna(
    root: Path,
    name: str,
    records: int,
    seq_len: int,
    seed: int = 0,
    length: int = 900,
    lengths: list[int] | None = None,
) -> Path:
    """Prepare a learnable DNA dataset under ``root/name`` (records as
    :func:`learnable_fasta` writes them); returns its manifest path."""
    src = root / f"{name}-src"
    src.mkdir(parents=True, exist_ok=True)
    learnable_fasta(src / f"{name}.fa", records, length, seed, lengths)
    out = root / name
    cfg = load_pipeline_config(
        REPO / "pipelines" / "dna.yaml",
        [
            f"sources=[{src}/*.fa]",
            f"output={out}",
            f"pack.seq_len={seq_len}",
            "shards.max_samples=4",
            "progress=false",
        ],
    )
    prepare(cfg, out=io.StringIO())
    manifest = out / "manifest.json"
    assert Manifest.load(str(manifest)).num_samples > 0
    return manifest


def train_rows(config: Path, out_dir: Path, *overrides: str, nproc: int = 1) -> dict[int, dict]:
    """``ulysses-mm train CONFIG train.out_dir=OUT_DIR OVERRIDES --nproc N`` in a subprocess
    (it must succeed): the training rows of its metrics.jsonl, by step."""
    out = subprocess.run(
        [sys.executable, "-m", "ulysses_mm", "train", str(config), f"train.out_dir={out_dir}"]
        + list(overrides)
        + ["--nproc", str(nproc)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def run_config(tmp: Path, manifest: Path, **model) -> Path:
    """A debug run config over ``manifest`` (W&B off), model fields overridden by ``model``."""
    cfg = {
        "model": {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, **model},
        "data": {"train": str(manifest)},
        "train": {"out_dir": str(tmp / "run")},
        "logging": {"wandb": "disabled"},
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def refused(capsys, *argv: str) -> str:
    """``ulysses-mm train ARGV`` refused in one line (exit 2); the line."""
    from ulysses_mm.cli import main

    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


def tiny_run(**train) -> dict:
    """The run config of the CLI training tests: a tiny model (a step takes tens of ms) at
    sp 2 on 2 processes, W&B off; ``train`` keys over the defaults."""
    return {
        "model": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "loss_tile_tokens": 128,
        },
        "parallel": {"sp": 2, "timeout_s": 120},
        "data": {"micro_batch_size": 1, "seed": 5},
        "train": {"keep_checkpoints": 2, "seed": 3, **train},
        "deepspeed": {
            "optimizer": {"lr": 0.01, "weight_decay": 0.0},
            "scheduler": {"warmup_steps": 2},
        },
        "logging": {"wandb": "disabled"},
    }


def write_config(root: Path, name: str, base: dict, **sections) -> Path:
    """``base`` with ``sections`` merged over its sections, as ``root/name.yaml``."""
    cfg = copy.deepcopy(base)
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli_env() -> dict[str, str]:
    """The environment a ``python -m ulysses_mm`` subprocess of a test runs in."""
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def logged(run: Path, event: str = "train") -> dict[int, float]:
    """The losses a run logged in its metrics.jsonl, by step, of the rows whose ``kind``
    field is ``event`` (train or eval)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    key = "loss" if event == "train" else f"{event}/loss"
    return {r["step"]: r[key] for r in map(json.loads, lines) if r["kind"] == event}
