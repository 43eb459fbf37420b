"""Training end to end on CPU with real processes: prepare -> train at SP=2 -> the loss falls,
checkpoints, W&B offline history, evaluation, report, export; SIGKILL and resume gives the
losses of an uninterrupted run; S3 (moto on 127.0.0.1) gives the losses of local disk; and
dp=2×sp=1, dp=1×sp=2 and one process give the same loss for the same global batch."""

from __future__ import annotations

import json
import os
import shutil
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
from train_data import cli_env, logged, prepare_dna, tiny_run, write_config
from wandb_records import history

STEPS, CKPT_EVERY, SEQ = 12, 4, 512

BASE = tiny_run(steps=STEPS, checkpoint_every=CKPT_EVERY, peak_tflops=0.1)
# (a CPU has no known peak: MFU is logged only with one given)


_env = cli_env


def _config(tmp: Path, name: str, **sections) -> Path:
    return write_config(tmp, name, BASE, **sections)


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


_losses = logged


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
    from ulysses_mm.core.tokenspace import TokenSpace
    from ulysses_mm.model import build_model

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
        want = ours.hidden_states(ids, pos, torch.zeros_like(ids))
        got = hf.model(input_ids=ids, position_ids=pos).last_hidden_state
        assert_close(got, want, rtol=1e-4, atol=1e-4)
        logits = hf(input_ids=ids, position_ids=pos).logits
        assert_close(logits, want @ ours.heads.lm_head_weight().T, rtol=1e-4, atol=1e-4)
    assert hf.config.vocab_size == space.vocab_size


def _alternating_history(steps: int = 40) -> list[dict]:
    """Odd steps mostly DNA (loss near 1.4), even steps mostly video (near 5): the total
    jumps from step to step while each modality falls slowly."""
    records = []
    for step in range(1, steps + 1):
        dna, video = 1.4 - 0.005 * step, 5.0 - 0.02 * step
        share = 0.9 if step % 2 else 0.1
        records.append(
            {
                "step": step,
                "kind": "train",
                "loss": share * dna + (1 - share) * video,
                "loss/dna": dna,
                "loss/video": video,
                "lr": 1e-3,
            }
        )
        if step % 10 == 0:
            records.append({"step": step, "kind": "eval", "eval/loss/dna": dna})
    return records


def test_report_smooths_the_total_and_keeps_each_modality(tmp_path):
    from ulysses_mm.tools.report import loss_series, plot

    records = _alternating_history()
    s = loss_series(records)
    jumps = [abs(b - a) for a, b in zip(s.total, s.total[1:])]
    smooth_jumps = [abs(b - a) for a, b in zip(s.total_smoothed, s.total_smoothed[1:])]
    assert sum(smooth_jumps) < sum(jumps) / 4
    assert max(smooth_jumps[10:]) < min(jumps) / 4  # once ten steps are in the average
    assert s.total_smoothed[0] == pytest.approx(s.total[0])  # debiased: starts at the first value
    assert sorted(s.modalities) == ["dna", "video"] and s.evals["dna"][0] == [10, 20, 30, 40]
    assert s.modalities["video"][1] == [r["loss/video"] for r in records if r["kind"] == "train"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    png = plot(run, tmp_path / "plots" / "loss.png")
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("umask,folder,file", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_export_honours_the_umask(tmp_path, umask, folder, file):
    from safetensors.torch import save_file

    from ulysses_mm.config import RunConfig, load_config, to_dict
    from ulysses_mm.core.tokenspace import TokenSpace
    from ulysses_mm.model import build_model
    from ulysses_mm.train.checkpoint import CONFIG_FILE, MODEL_FILE, SPACE_FILE
    from ulysses_mm.train.export import export

    cfg = load_config(RunConfig, None, [f"model.{k}={v}" for k, v in BASE["model"].items()])
    space = TokenSpace.from_vocab({"dna": 10})
    weights = build_model(cfg.model, space, seed=0).state_dict()
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    save_file({k: v.clone().contiguous() for k, v in weights.items()}, str(ckpt / MODEL_FILE))
    (ckpt / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(cfg)))
    (ckpt / SPACE_FILE).write_text(json.dumps(space.to_dict()))
    old = os.umask(umask)
    try:
        out = export(ckpt, tmp_path / "exports" / "hf")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == folder
    files = sorted(out.iterdir())
    assert {p.name for p in files} >= {"config.json", "model.safetensors", "token_space.json"}
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: file for p in files}


def test_mfu_needs_a_known_peak():
    from ulysses_mm.config import RunConfig, load_config
    from ulysses_mm.train.flops import known_peak_tflops, peak_tflops

    cfg = load_config(RunConfig)
    assert peak_tflops(cfg, torch.device("cpu")) is None  # no guess: no MFU on a CPU
    given = load_config(RunConfig, None, ["train.peak_tflops=2.5"])
    assert peak_tflops(given, torch.device("cpu")) == 2.5
    for name, precision, want in [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA L4", "fp16", 121.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.0),
        ("NVIDIA GeForce GTX 1080", "fp32", None),
    ]:
        assert known_peak_tflops(name, precision) == want, name


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


def test_resume_with_a_ring_gives_the_uninterrupted_losses_and_weights(data):
    """Hybrid Ulysses × ring (parallel.ring=2 over sp=2: a pure ring, zigzag slices): a run
    resumed from its step-3 checkpoint logs steps 4..6 and ends on the weights of the run
    that never stopped, bitwise."""
    from safetensors.torch import load_file

    run, resumed = data["root"] / "ring", data["root"] / "ring-resumed"
    cfg = _config(
        data["root"],
        "ring",
        data={"train": str(data["train"])},
        parallel={"sp": 2, "ring": 2},
        train={"out_dir": str(run), "steps": 6, "checkpoint_every": 3},
    )
    _train(cfg)
    # the same run as if stopped after step 3: latest on step 3, nothing saved after it
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    (resumed / "checkpoints" / "latest").write_text("step_00000003")
    _train(cfg, f"train.out_dir={resumed}", "--resume")
    got, want = _losses(resumed), _losses(run)
    assert sorted(got) == list(range(1, 7))  # steps past the checkpoint redone, once each
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]
    final = Path("checkpoints", "step_00000006", "model.safetensors")
    a, b = load_file(run / final), load_file(resumed / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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
