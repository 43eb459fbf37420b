"""What the config and the manifests already decide fails in the parent before any
process starts (one line, exit 2), and a failing rank reaches the user as one line naming
the rank, its traceback in a log file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_data import prepare_dna, refused, run_config

from ulysses_mm.core.errors import WorkerError
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.parallel.launch import run_world

SEQ = 256


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    return prepare_dna(tmp_path_factory.mktemp("preflight"), "dna", records=6, seq_len=SEQ)


@pytest.fixture
def no_processes(monkeypatch):
    """Starting any process is a failure of the test: the parent must refuse first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr("ulysses_mm.parallel.launch.run_world", refuse)


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--nproc", "2", "parallel.sp=3"], "sp=3 does not divide the 4 query heads"),
        (["--nproc", "2", "parallel.sp=2", "parallel.dp=2"], "dp=2 × sp=2 = 4 but the world has 2"),
        (["--nproc", "3", "parallel.sp=2"], "sp=2 does not divide the world of 3 processes"),
        (["parallel.head_groups=3"], "head_groups=3 does not split the 4 query heads"),
        (["'model.modalities={dna: 12}'"], "differs from the model's"),
        ([f"data.seq_len={2 * SEQ}"], f"hold samples of {SEQ} tokens"),
        (["--resume"], "no checkpoint to resume from"),
        (["parallel.attention=flash_varlen"], "flash_varlen"),
        (["deepspeed.offload_param=cpu"], "offload_param needs deepspeed.zero_stage=3"),
        (["deepspeed.extra={scheduler: {type: WarmupLR}}"], "both set the LR schedule"),
        (["model.init_from=/nonexistent/ckpt"], "/nonexistent/ckpt"),
        (["data.micro_batch_size=100000"], "fewer than one global micro-batch"),
        (["train.steps=0"], "train.steps must be >= 1"),
        # a run in stages: every stage checked, the error naming it
        (
            ["train.steps=4", "train.stages=[{steps: 2}, {steps: 2, data: {seq_len: 512}}]"],
            "train.stages[1] (steps 3-4): data.seq_len=512 but the shards of",
        ),
        (
            ["train.steps=4", "train.stages=[{steps: 4, data: {seq_len: 100}}]"],
            f"hold samples of {SEQ} tokens, and a run trains on whole samples or on windows",
        ),
        (
            [
                "--nproc",
                "2",
                "train.steps=4",
                "train.stages=[{steps: 2}, {steps: 2, parallel: {sp: 3}}]",
            ],
            "train.stages[1] (steps 3-4): sp=3 does not divide the 4 query heads",
        ),
        (["train.steps=4", "train.stages=[{steps: 2}, {steps: 3}]"], "add up to 2 + 3 = 5"),
        (
            ["train.stages=[{steps: 100, model: {rope: {kind: yarn}}}]"],
            "train.stages[0]: model.rope.kind=yarn needs model.rope.factor",
        ),
        (["train.gpu_mem_gib=0.001"], "more than train.gpu_mem_gib=0.001"),
    ],
)
def test_config_errors_fail_in_the_parent(tmp_path, manifest, no_processes, capsys, args, expect):
    overrides = [a.strip("'") for a in args if "=" in a]
    options = [a for a in args if "=" not in a]
    err = refused(capsys, str(run_config(tmp_path, manifest)), *overrides, *options)
    assert expect in err, err


def test_resume_onto_another_token_space_is_refused(tmp_path, manifest, no_processes, capsys):
    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / "step_00000004").mkdir(parents=True)
    torch.save({}, ckpt / "step_00000004" / "mp_rank_00_model_states.pt")
    (ckpt / "step_00000004" / "model.safetensors").write_bytes(b"")
    (ckpt / "latest").write_text("step_00000004\n")
    other = TokenSpace.from_vocab({"dna": 10, "audio": 256})
    (ckpt / "step_00000004" / "token_space.json").write_text(json.dumps(other.to_dict()))
    err = refused(capsys, str(run_config(tmp_path, manifest)), "--resume")
    assert "was trained on the" in err and "step_00000004" in err, err


def _fails_on_rank_one() -> int:
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose\nsecond line")
    return 7


def test_a_failing_rank_is_one_line_with_its_traceback_in_a_log(tmp_path):
    with pytest.raises(WorkerError) as info:
        run_world(_fails_on_rank_one, 2, log_dir=tmp_path / "logs")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("rank 1: ValueError: boom on purpose"), msg
    log = tmp_path / "logs" / "rank-1.log"
    assert str(log) in msg
    text = log.read_text()
    assert "Traceback" in text and "_fails_on_rank_one" in text and "second line" in text


def _rank_one_fails_then_rank_zero_loses_its_peer() -> int:
    """Rank 1 fails first; rank 0, in a collective with it, fails after with a broken
    connection, which is not the cause."""
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(0.5)  # rank 0 waits in the barrier
        raise ValueError("the cause, on rank 1")
    dist.barrier()  # fails as soon as rank 1's process is gone
    raise AssertionError("rank 0's barrier should have failed")


def test_the_line_is_the_first_failure_not_a_peer_that_lost_it(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-0.error").write_text("rank 0: an earlier run's error\n")  # stale
    with pytest.raises(WorkerError) as info:
        run_world(_rank_one_fails_then_rank_zero_loses_its_peer, 2, log_dir=logs)
    assert str(info.value).startswith("rank 1: ValueError: the cause, on rank 1"), info.value
