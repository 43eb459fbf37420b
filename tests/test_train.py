"""Training end to end on CPU with real processes: prepare -> train at SP=2 -> the loss falls,
checkpoints, W&B offline history, evaluation, report, export; SIGKILL and resume gives the
losses of an uninterrupted run; S3 (moto on 127.0.0.1) gives the losses of local disk; and
dp=2×sp=1, dp=1×sp=2 and one process give the same loss for the same global batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO
from torch.testing import assert_close
from train_data import prepare_dna
from wandb_records import history

STEPS, CKPT_EVERY, SEQ = 12, 4, 512

BASE = {
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
    "train": {"steps": STEPS, "checkpoint_every": CKPT_EVERY, "keep_checkpoints": 2, "seed": 3},
    "deepspeed": {"optimizer": {"lr": 0.01, "weight_decay": 0.0}, "scheduler": {"warmup_steps": 2}},
    "logging": {"wandb": "disabled"},
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def _config(tmp: Path, name: str, **sections) -> Path:
    cfg = json.loads(json.dumps(BASE))
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (
        f"{' '.join(cmd[1:])} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    )
    return out


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "ulysses_mm", *args], timeout)


def _train(config: Path, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    return _cli("train", str(config), "--nproc", str(nproc), *overrides)


def _losses(run_dir: Path, kind: str = "train") -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    key = "loss" if kind == "train" else f"{kind}/loss"
    return {r["step"]: r[key] for r in map(json.loads, lines) if r["kind"] == kind}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return {
        "root": root,
        "train": prepare_dna(root, "train", records=60, seq_len=SEQ, seed=0),
        "eval": prepare_dna(root, "eval", records=8, seq_len=SEQ, seed=1),
    }


@pytest.fixture(scope="module")
def reference(data):
    """The uninterrupted SP=2 run on 2 processes, with evaluation and W&B offline."""
    run = data["root"] / "ref"
    cfg = _config(
        data["root"],
        "ref",
        data={"train": str(data["train"]), "eval": str(data["eval"])},
        train={"out_dir": str(run), "eval_every": 4, "eval_batches": 2},
        logging={"wandb": "offline"},
    )
    out = _train(cfg)
    return {"run": run, "config": cfg, "stdout": out.stdout}


def test_loss_falls_and_checkpoints_are_written(reference):
    run = reference["run"]
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = losses[1], sum(losses[s] for s in (STEPS - 1, STEPS)) / 2
    assert last < 0.6 * first, losses
    evals = _losses(run, "eval")
    assert sorted(evals) == [4, 8, 12] and evals[12] < evals[4]
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{STEPS:08d}"
    kept = sorted(p.name for p in ckpts.iterdir() if p.is_dir())
    assert kept == [f"step_{STEPS - CKPT_EVERY:08d}", f"step_{STEPS:08d}"]  # keep_checkpoints=2
    final = ckpts / f"step_{STEPS:08d}"
    for name in (
        "model.safetensors",
        "run_config.yaml",
        "token_space.json",
        "mp_rank_00_model_states.pt",
    ):
        assert (final / name).is_file(), name
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-2])
    for key in (
        "loss/dna",
        "bits_per_base/dna",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "peak_memory_mb",
    ):
        assert record.get(key) is not None and record[key] == record[key], key  # present, not NaN
    assert "checkpoint:" in reference["stdout"] and "wandb:" in reference["stdout"]


def test_wandb_offline_run_holds_the_history(reference):
    run = reference["run"]
    (wandb_dir,) = (run / "wandb").glob("offline-run-*")
    rows = history(wandb_dir)
    train_rows = [r for r in rows if "loss" in r]
    assert [int(r["_step"]) for r in train_rows] == list(range(1, STEPS + 1))
    losses = _losses(run)
    assert [float(r["loss"]) for r in train_rows] == pytest.approx(
        [losses[s] for s in range(1, STEPS + 1)]
    )
    assert any("eval/loss/dna" in r for r in rows)


def test_report_plots_the_curves(reference, tmp_path):
    png = tmp_path / "loss.png"
    _cli("report", str(reference["run"]), "--png", str(png), timeout=120)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_export_loads_in_transformers_and_gives_the_backbone_hidden_states(reference, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ulysses_mm.config import RunConfig, from_dict
    from ulysses_mm.model import build_model
    from ulysses_mm.tokenspace import TokenSpace

    out = tmp_path / "hf"
    _cli("export", str(reference["run"]), str(out), timeout=120)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    final = reference["run"] / "checkpoints" / f"step_{STEPS:08d}"
    cfg = from_dict(RunConfig, yaml.safe_load((final / "run_config.yaml").read_text()))
    space = TokenSpace.from_dict(json.loads((final / "token_space.json").read_text()))
    ours = build_model(cfg.model, space)
    ours.load_state_dict(load_file(str(final / "model.safetensors")))
    ids = torch.randint(0, space.vocab_size, (1, 64))
    pos = torch.arange(64)[None]
    with torch.no_grad():
        want = ours(ids, pos, torch.zeros_like(ids))
        got = hf.model(input_ids=ids, position_ids=pos).last_hidden_state
        assert_close(got, want, rtol=1e-4, atol=1e-4)
        logits = hf(input_ids=ids, position_ids=pos).logits
        assert_close(logits, want @ ours.heads.lm_head_weight().T, rtol=1e-4, atol=1e-4)
    assert hf.config.vocab_size == space.vocab_size


def test_sigkill_then_resume_gives_the_uninterrupted_losses(data, reference):
    run = data["root"] / "killed"
    cfg = _config(
        data["root"], "killed", data={"train": str(data["train"])}, train={"out_dir": str(run)}
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "ulysses_mm", "train", str(cfg), "--nproc", "2"],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    latest = run / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    try:
        while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: our own process group
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    resumed_from = int(latest.read_text().strip().removeprefix("step_"))
    assert resumed_from < STEPS
    _train(cfg, "--resume")
    got, want = _losses(run), _losses(reference["run"])
    assert sorted(got) == list(range(1, STEPS + 1))  # no step lost or logged twice
    assert [got[s] for s in range(resumed_from + 1, STEPS + 1)] == [
        want[s] for s in range(resumed_from + 1, STEPS + 1)
    ]


def test_shards_on_s3_give_the_local_losses(data, reference, s3_server):
    import fsspec

    opts = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    fs = fsspec.filesystem("s3", **opts)
    bucket = f"train-{uuid.uuid4().hex[:8]}"  # moto keeps buckets for the whole process
    fs.mkdir(bucket)
    fs.put(str(data["train"].parent) + "/", f"{bucket}/train/", recursive=True)
    run = data["root"] / "s3"
    cfg = _config(
        data["root"],
        "s3",
        data={"train": f"s3://{bucket}/train/manifest.json", "storage_options": opts},
        train={"out_dir": str(run), "steps": STEPS, "checkpoint_every": 0},
    )
    _train(cfg)
    assert _losses(run) == _losses(reference["run"])


def test_dp_and_sp_give_the_loss_of_one_process(data):
    """The same global batch of 2 samples: one process with 2, dp=2 × sp=1 with 1 each,
    dp=1 × sp=2 with 2 (each rank half of every sample)."""
    losses = {}
    for layout, (nproc, sp, mb) in {
        "one-process": (1, 1, 2),
        "dp2-sp1": (2, 1, 1),
        "dp1-sp2": (2, 2, 2),
    }.items():
        run = data["root"] / f"layout-{layout}"
        cfg = _config(
            data["root"],
            f"layout-{layout}",
            data={"train": str(data["train"]), "micro_batch_size": mb},
            parallel={"sp": sp},
            train={"out_dir": str(run), "steps": 3, "checkpoint_every": 0},
        )
        if layout == "dp1-sp2":  # joining a world torchrun made, as on a cluster
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            _run([*torchrun, "--nproc_per_node", "2", "-m", "ulysses_mm", "train", str(cfg)])
        else:
            _train(cfg, nproc=nproc)
        losses[layout] = [_losses(run)[s] for s in (1, 2, 3)]
    for layout in ("dp2-sp1", "dp1-sp2"):
        assert losses[layout] == pytest.approx(losses["one-process"], rel=2e-5, abs=1e-6), losses
