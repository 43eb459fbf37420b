"""The checkpoint pointer: replaced only after a checkpoint is complete (written in the
background or not); old ones pruned; a failed or stalled background write is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ulysses_mm.config import TrainConfig
from ulysses_mm.core.errors import DataError, StorageError
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.train import checkpoint
from ulysses_mm.train.checkpoint import CheckpointDir
from ulysses_mm.train.saver import Saver, Writer
from ulysses_mm.train.serialize import pack

SPACE = TokenSpace.from_vocab({"dna": 10})


class FakeEngine:
    """What the saver needs of a DeepSpeed engine: its files go through
    ``checkpoint_engine.save`` as DeepSpeed's do; can crash mid-save, in the blocking
    part (``crash``) or in the background write (``fail_write``)."""

    _config = None

    def __init__(self, crash: bool = False, fail_write: bool = False) -> None:
        self.crash = crash
        self.fail_write = fail_write
        self.module = torch.nn.Linear(2, 2)
        self.checkpoint_engine = None

    def zero_optimization_stage(self) -> int:
        return 0

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False  # the pointer is ours to write
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.create(None)
        state = {"module": self.module.state_dict(), **client_state}
        if self.fail_write:
            state["unpicklable"] = lambda: None  # torch.save fails on the writer thread
        self.checkpoint_engine.save(state, str(Path(save_dir) / tag / "mp_rank_00_model_states.pt"))
        if self.crash:
            raise RuntimeError("disk full")


def _saver(
    root: Path, engine=None, keep: int = 2, asynchronous: bool = False, writer: str = "thread"
) -> Saver:
    t = TrainConfig(
        keep_checkpoints=keep, async_save=asynchronous, save_timeout_s=60, save_writer=writer
    )
    return Saver(engine or FakeEngine(), CheckpointDir(str(root)), root / "staging", t)


def _save(root: Path, step: int, engine=None, keep: int = 2, asynchronous: bool = False) -> Path:
    saver = _saver(root, engine, keep, asynchronous)
    saver.start(step, {"loader": {"position": step}}, {"train": {}}, SPACE, None)
    saver.wait()
    saver.commit()
    return root / checkpoint.tag_for(step)


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


@pytest.mark.parametrize(
    ("asynchronous", "writer"), [(False, "thread"), (True, "thread"), (True, "process")]
)
def test_a_save_writes_every_file_and_the_pointer_last(tmp_path, asynchronous, writer):
    engine = FakeEngine()
    saver = _saver(tmp_path, engine, asynchronous=asynchronous, writer=writer)
    pending = saver.start(5, {"loader": {"position": 5}}, {"train": {}}, SPACE, {"t": 1})
    with torch.no_grad():
        engine.module.weight.add_(1.0)  # the next step changes the live weights
    saver.wait()
    assert checkpoint.latest_tag(tmp_path) is None  # not before every rank's files are done
    assert saver.commit() is pending
    assert checkpoint.latest_tag(tmp_path) == "step_00000005"
    checkpoint.check_complete(tmp_path / "step_00000005", 0)
    saved = torch.load(tmp_path / "step_00000005" / "mp_rank_00_model_states.pt", weights_only=True)
    assert torch.equal(saved["module"]["weight"] + 1.0, engine.module.weight.detach())
    assert len(saver.saves) == 1 and saver.saves[0][0] <= saver.saves[0][1]
    assert (saver.process is not None) == (writer == "process")
    saver.close()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_failed_background_write_is_one_line_and_latest_stays(tmp_path, writer):
    _save(tmp_path, 10)
    saver = _saver(tmp_path, FakeEngine(fail_write=True), asynchronous=True, writer=writer)
    saver.start(20, {"loader": {}}, {"train": {}}, SPACE, None)
    with pytest.raises(StorageError, match="mp_rank_00_model_states.pt: "):
        saver.wait()
    assert checkpoint.latest_tag(tmp_path) == "step_00000010"
    assert not (tmp_path / "step_00000020" / "mp_rank_00_model_states.pt").exists()
    saver.close()


def test_a_stalled_writer_times_out_in_one_line():
    import threading

    writer = Writer(asynchronous=True)
    gate = threading.Event()
    writer.put("checkpoint s3://b/step_00000003", gate.wait)
    assert not writer.done()
    with pytest.raises(StorageError, match="still being written after 0 s"):
        writer.wait(0.2, "checkpoint s3://b/step_00000003")
    gate.set()
    writer.wait(5.0, "x")
    assert writer.done()
    writer.close()


@pytest.mark.parametrize("shared", [False, True])
def test_a_packed_copy_does_not_follow_the_live_state(shared):
    base = torch.arange(6.0)
    live = {"a": torch.ones(3), "b": [base[::2], 4], "c": (torch.ones(1, dtype=torch.int8),)}
    copy = pack(live, shared=shared)
    live["a"].add_(1)
    base.add_(1)
    assert copy["a"].tolist() == [1, 1, 1] and copy["b"][0].tolist() == [0, 2, 4]
    assert copy["b"][1] == 4 and isinstance(copy["c"], tuple)
    assert copy["c"][0].dtype == torch.int8
    assert copy["a"].untyped_storage().data_ptr() == copy["b"][0].untyped_storage().data_ptr()
    assert copy["a"].is_shared() == shared
