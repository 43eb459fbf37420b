"""A run that grows its context in stages (``configs/debug-stages.yaml``): 1,024 → 4,096 →
16,384 tokens with SP 1 → 2 → 4 and YaRN from the second stage, on 4 processes.

One world per module: the staged run itself, its resume from the middle of the second
stage, and the same stages on one process (the micro-batch grown to keep each stage's
global batch), which every layout must match."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from helpers.train_data import prepare_dna, train_rows

CONFIG = REPO / "configs" / "debug-stages.yaml"
LONGEST = 16384


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    # records of a few hundred bases: 16K-token samples of ~30 documents each
    return root, prepare_dna(root, "train", records=300, seq_len=LONGEST, seed=0, length=700)


def _config(root: Path, name: str, edit=None) -> Path:
    cfg = yaml.safe_load(CONFIG.read_text())
    if edit is not None:
        edit(cfg)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def staged(data):
    root, manifest = data
    run = root / "staged"
    rows = train_rows(_config(root, "staged"), run, f"data.train={manifest}", nproc=4)
    return run, rows


def test_the_run_moves_through_its_stages(staged):
    run, rows = staged
    assert sorted(rows) == list(range(1, 13))
    stage = {s: r["stage"] for s, r in rows.items()}
    length = {s: r["seq_len"] for s, r in rows.items()}
    assert [stage[s] for s in (1, 4, 5, 8, 9, 12)] == [0, 0, 1, 1, 2, 2]
    assert [length[s] for s in (1, 5, 9)] == [1024, 4096, LONGEST]
    # the re-warm-up: each later stage's first step runs at half the schedule's lr
    assert rows[5]["lr"] < rows[4]["lr"] and rows[9]["lr"] < rows[8]["lr"]
    saved = yaml.safe_load((run / "checkpoints" / "step_00000012" / "run_config.yaml").read_text())
    assert saved["model"]["rope"]["kind"] == "yarn" and saved["model"]["rope"]["factor"] == 16.0
    assert saved["parallel"]["sp"] == 4 and saved["data"]["seq_len"] == LONGEST


def test_every_stage_gives_the_loss_of_one_process(data, staged):
    """SP 1 → 2 → 4 over 4 processes (dp 4 → 2 → 1) against one process with the same
    global batches (micro-batch 4 → 2 → 1): the engine's optimizer state and gradient
    average carry across the re-layouts."""
    root, manifest = data
    _, rows = staged

    def one_process(cfg):
        for stage, mb in zip(cfg["train"]["stages"], (4, 2, 1)):
            stage["data"]["micro_batch_size"] = mb
            stage["parallel"] = {"sp": 1}

    cfg = _config(root, "one-process", one_process)
    ref = train_rows(cfg, root / "one-process", f"data.train={manifest}", nproc=1)
    got = [rows[s]["loss"] for s in range(1, 13)]
    want = [ref[s]["loss"] for s in range(1, 13)]
    assert got == pytest.approx(want, rel=2e-5, abs=1e-6)


def test_resume_in_the_middle_of_a_later_stage_repeats_the_losses(data, staged):
    """Stopped after step 6 (stage 1 of steps 5-8, sp 2): the resumed run lays out stage 1,
    finishes it, moves to stage 2 and logs the uninterrupted run's losses exactly."""
    root, manifest = data
    run, rows = staged
    resumed = root / "resumed"
    shutil.copytree(run, resumed)
    for ckpt in (resumed / "checkpoints").glob("step_*"):
        if int(ckpt.name.removeprefix("step_")) > 6:
            shutil.rmtree(ckpt)
    (resumed / "checkpoints" / "latest").write_text("step_00000006")
    saved = yaml.safe_load(
        (resumed / "checkpoints" / "step_00000006" / "run_config.yaml").read_text()
    )
    assert saved["parallel"]["sp"] == 2  # the checkpoint holds the stage it was taken in
    got = train_rows(CONFIG, resumed, f"data.train={manifest}", "--resume", nproc=4)
    assert sorted(got) == list(range(1, 13))
    assert [got[s]["loss"] for s in range(7, 13)] == [rows[s]["loss"] for s in range(7, 13)]


def test_the_export_loads_in_transformers_with_the_last_stage_rope(data, staged, tmp_path):
    run, _ = staged
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "ulysses_mm", "export", str(run / "checkpoints"), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    from transformers import AutoConfig

    rope = AutoConfig.from_pretrained(out).rope_parameters
    assert rope["rope_type"] == "yarn"
    assert rope["factor"] == 16.0 and rope["original_max_position_embeddings"] == 1024


def test_report_marks_where_each_stage_begins(staged, tmp_path):
    """The report's curves are the logged rows, and its PNG (9 × 7 in at 110 dpi) draws
    one dotted red line through both panels where each later stage begins."""
    import matplotlib.image as mpimg
    import numpy as np

    from ulysses_mm.tools.report import loss_series, plot, read_metrics

    run, rows = staged
    series = loss_series(read_metrics(run))
    assert series.stage_starts == [(5, 1, 4096), (9, 2, LONGEST)]
    assert series.steps == list(range(1, 13))
    assert series.total == [rows[s]["loss"] for s in range(1, 13)]
    assert series.lr == [rows[s]["lr"] for s in range(1, 13)]
    png = plot(run, tmp_path / "loss.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (990, 770)  # width, height
    img = mpimg.imread(png)
    assert img.shape[:2] == (770, 990)
    r, g, b = img[..., 0], img[..., 1], img[..., 2]
    red = (r - g > 0.25) & (r - b > 0.25)  # tab:red, the stage lines and their labels
    columns = np.nonzero(red.sum(axis=0) >= 200)[0]  # a line through both panels
    lines = np.split(columns, np.nonzero(np.diff(columns) > 1)[0] + 1)
    assert len(lines) == 2, columns  # steps 4.5 and 8.5
    left, right = (line.mean() for line in lines)
    assert 0.25 < left / 990 < 0.5 < right / 990 < 0.8
