"""A saved :class:`ShardDataset` state is input: checked against its schema and ranges
before the stream moves, each fault one :class:`DataError` line; ``hf_dataset`` refuses
what ``ShardDataset`` refuses."""

from __future__ import annotations

import pytest
from train_data import prepare_dna

from ulysses_mm.core.errors import DataError
from ulysses_mm.hf.dataset import ShardDataset, hf_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfstate")
    ds = ShardDataset(str(prepare_dna(root, "a", records=12, seq_len=128, length=120)), 2)
    yield ds
    ds.close()


@pytest.mark.parametrize(
    ("saved", "says"),
    [
        ({}, "lacks loader, taken"),
        ([], "is a list, not a mapping"),
        ({"loader": "garbage", "taken": 0}, "loader is a str, not a mapping"),
        ({"loader": {"version": 2}, "taken": 0}, "not a loader state"),
        ({"loader": {}, "taken": 10**9}, "taken is 1000000000: it must be an integer in [0, 2)"),
        ({"loader": {}, "taken": -1}, "taken is -1"),
        ({"loader": {}, "taken": "1"}, "taken is '1'"),
        ({"loader": {}, "taken": 0, "batch_items": 8}, "steps 8 items at a time"),
    ],
)
def test_a_bad_saved_state_is_one_data_error_line(dataset, saved, says):
    good = dataset.state_dict()
    if isinstance(saved, dict) and saved.get("loader") == {}:
        saved = {**saved, "loader": good["loader"]}
    with pytest.raises(DataError) as err:
        dataset.load_state_dict(saved)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)
    dataset.load_state_dict(good)  # a refused state changed nothing
    assert dataset.state_dict() == good


def test_hf_dataset_refuses_no_readers_as_shard_dataset_does():
    for make in (ShardDataset, hf_dataset):
        with pytest.raises(ValueError, match="readers and micro_batch must be >= 1, got 0"):
            make("unused", 1, 0)
