"""The checkpoint pointer: replaced only after a checkpoint is complete; old ones pruned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.train import checkpoint

SPACE = TokenSpace.from_vocab({"dna": 10})


class FakeEngine:
    """What checkpoint.save needs of a DeepSpeed engine; can crash mid-save."""

    def __init__(self, crash: bool = False) -> None:
        self.crash = crash
        self.module = torch.nn.Linear(2, 2)

    def zero_optimization_stage(self) -> int:
        return 0

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False  # the pointer is ours to write
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"partial")
        if self.crash:
            raise RuntimeError("disk full")


def _save(root: Path, step: int, engine=None, keep: int = 2) -> Path:
    return checkpoint.save(
        engine or FakeEngine(),
        root,
        step=step,
        client_state={"loader": {"position": step}},
        config={"train": {}},
        space=SPACE,
        keep=keep,
    )


def test_latest_moves_only_when_a_checkpoint_is_complete(tmp_path):
    _save(tmp_path, 10)
    assert checkpoint.latest_tag(tmp_path) == "step_00000010"
    with pytest.raises(RuntimeError, match="disk full"):
        _save(tmp_path, 20, FakeEngine(crash=True))
    assert checkpoint.latest_tag(tmp_path) == "step_00000010"  # not the partial step 20
    assert not (tmp_path / "step_00000020" / checkpoint.MODEL_FILE).exists()
    done = _save(tmp_path, 20)
    assert checkpoint.latest_tag(tmp_path) == "step_00000020"
    for name in (checkpoint.MODEL_FILE, checkpoint.CONFIG_FILE, checkpoint.SPACE_FILE):
        assert (done / name).is_file()
    assert checkpoint.read_checkpoint_dir(tmp_path) == done


def test_old_checkpoints_are_pruned(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "step_00000003",
        "step_00000004",
    ]
    assert not list(tmp_path.glob(".*.tmp"))


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no checkpoint to resume from"):
        checkpoint.load(FakeEngine(), tmp_path)
    (tmp_path / "latest").write_text("step_00000099\n")
    with pytest.raises(DataError, match="names step_00000099, which does not exist"):
        checkpoint.latest_tag(tmp_path)
    (tmp_path / "latest").write_text("\n")
    with pytest.raises(DataError, match=rf"{tmp_path / 'latest'} is empty"):
        checkpoint.latest_tag(tmp_path)


@pytest.mark.parametrize("pointer", ["../../../", "/etc", "a/b", "..", ".", "x\\y", "a\tb"])
def test_a_pointer_outside_the_checkpoint_directory_is_refused(tmp_path, pointer):
    (tmp_path / "a").mkdir()
    (tmp_path / "latest").write_text(pointer + "\n")
    with pytest.raises(DataError, match="which is not a checkpoint directory beside it"):
        checkpoint.latest_tag(tmp_path)


def test_a_saved_checkpoint_is_complete_and_a_partial_one_is_not(tmp_path):
    done = _save(tmp_path, 10)
    (done / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(DataError, match="has no mp_rank_00_model_states.pt"):
        checkpoint.check_complete(done, 0)
    torch.save({}, done / "mp_rank_00_model_states.pt")
    checkpoint.check_complete(done, 0)
    with pytest.raises(DataError, match="optimizer partitions for deepspeed.zero_stage=2"):
        checkpoint.check_complete(done, 2)
    torch.save({}, done / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    checkpoint.check_complete(done, 2)
    with pytest.raises(DataError, match="has no zero_pp_rank_\\*_mp_rank_00_model_states.pt"):
        checkpoint.check_complete(done, 3)
    (done / "run_config.yaml").write_text("deepspeed: {zero_stage: 3}\n")
    with pytest.raises(DataError, match="was saved with deepspeed.zero_stage=3"):
        checkpoint.check_complete(done, 0)
    (done / "run_config.yaml").write_text("deepspeed: [\n")
    with pytest.raises(DataError, match="run_config.yaml is not readable YAML"):
        checkpoint.check_complete(done, 0)
