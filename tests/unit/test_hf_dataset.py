"""Our shards as a dataset for the HF stack: the loader's fields, order, split, mixing and
exact resume, checked against the training loader itself on data the real DNA pipeline
prepared; Accelerate's own split of the whole stream; torchdata's StatefulDataLoader;
the ``datasets`` factory split by node."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from train_data import prepare_dna

from ulysses_mm.config import DataConfig
from ulysses_mm.core.errors import DataError, UnsupportedError
from ulysses_mm.core.format import IGNORE
from ulysses_mm.hf.dataset import ShardDataset, hf_dataset
from ulysses_mm.hf.inputs import document_ids, shifted
from ulysses_mm.loader.batch import samples_batch
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.model.attention import DocumentMask
from ulysses_mm.shards.manifest import Manifest

DATA = DataConfig(seed=3, shuffle_buffer=4, prefetch_bytes=0)


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("hfdata")
    a = prepare_dna(root, "a", records=30, seq_len=128, seed=1, length=120)
    b = prepare_dna(root, "b", records=20, seq_len=128, seed=2, length=300)
    return str(a), str(b)


def _ids(items) -> list[list[int]]:
    return [item["input_ids"].tolist() for item in items]


def _stream_ids(stream: ShardStream, batches: int) -> list[list[int]]:
    return [s.tokens.astype(np.int64).tolist() for _ in range(batches) for s in stream.next_batch()]


def test_fields_are_the_loaders_batch_in_the_hf_convention(manifests):
    ds = ShardDataset(manifests[0], data=DATA)
    items = list(itertools.islice(ds, 12))
    stream = ShardStream(Manifest.load(manifests[0]), 0, 1, 1, StreamOptions.from_config(DATA))
    batch = samples_batch([s for _ in range(12) for s in stream.next_batch()], ds.space)
    multi = 0
    for i, item in enumerate(items):
        assert item["input_ids"].tolist() == batch.input_ids[i].tolist()
        assert item["shift_labels"].tolist() == batch.labels[i].tolist()  # our shifted targets
        assert shifted(item["labels"]).tolist() == item["shift_labels"].tolist()
        assert item["labels"][0] == IGNORE
        docs = document_ids(item["position_ids"][None])
        real = batch.doc_ids[i] >= 0
        # the documents the positions describe are the packer's; the pad tail is one more
        want = DocumentMask(batch.doc_ids[i : i + 1]).doc_index[0]
        assert docs[0].tolist() == want.tolist()
        assert item["position_ids"][real].tolist() == batch.position_ids[i][real].tolist()
        pads = item["position_ids"][~real]
        assert pads.tolist() == list(range(len(pads)))
        assert (item["shift_labels"][~real] == IGNORE).all()
        multi += int(docs[0, -1]) > 0
    assert multi >= 6, "want samples that pack several documents"


def test_readers_get_the_loaders_dp_split_and_the_whole_stream_splits_the_same(manifests):
    from accelerate.data_loader import IterableDatasetShard

    m = Manifest.load(manifests[0])
    options = StreamOptions.from_config(DATA)
    for r in range(2):
        mine = _ids(itertools.islice(ShardDataset(manifests[0], 2, 2, r, DATA), 10))
        ours = _stream_ids(ShardStream(m, r, 2, 2, options), 5)
        assert mine == ours
        # Accelerate's own split of the whole stream gives process r the same samples
        whole = ShardDataset(manifests[0], micro_batch=2, readers=2, data=DATA)
        shard = IterableDatasetShard(whole, batch_size=2, num_processes=2, process_index=r)
        assert _ids(itertools.islice(shard, 10)) == ours
    a = _ids(itertools.islice(ShardDataset(manifests[0], 2, 2, 0, DATA), 6))
    b = _ids(itertools.islice(ShardDataset(manifests[0], 2, 2, 1, DATA), 6))
    assert not set(map(tuple, a)) & set(map(tuple, b))  # DP readers read different samples


def test_a_weighted_mixture_is_the_loaders(manifests, tmp_path):
    mix = {manifests[0]: 3.0, manifests[1]: 1.0}
    cache = DataConfig(seed=3, prefetch_bytes=1 << 20, cache_dir=str(tmp_path / "cache"))
    ds = ShardDataset(mix, 1, 2, 1, cache)
    sources = [(Manifest.load(manifests[0]), 3.0), (Manifest.load(manifests[1]), 1.0)]
    stream = ShardStream(sources, 1, 2, 1, StreamOptions.from_config(cache))
    assert _ids(itertools.islice(ds, 16)) == _stream_ids(stream, 16)
    assert len(list((tmp_path / "cache").glob("*.tar"))) >= 2  # read through the node cache
    ds.close()


@pytest.mark.parametrize("reader", [None, 1])
def test_resume_continues_exactly_mid_batch(manifests, reader):
    mix = {manifests[0]: 1.0, manifests[1]: 1.0}
    full = _ids(itertools.islice(ShardDataset(mix, 3, 2, reader, DATA), 20))
    first = ShardDataset(mix, 3, 2, reader, DATA)
    it = iter(first)
    head = _ids(itertools.islice(it, 7))  # mid-way through a stream batch
    saved = first.state_dict()
    ahead = _ids(itertools.islice(it, 5))  # read ahead, as a prefetching loader does
    assert first.state_after(7) == saved  # the state of any item count, after the fact
    again = ShardDataset(mix, 3, 2, reader, DATA)
    again.load_state_dict(saved)
    rest = _ids(itertools.islice(again, 13))
    assert head + rest == full
    assert ahead == rest[:5]
    assert again.state_after(13) == first.state_after(20) == again.state_dict()


def test_resume_is_refused_on_other_data_or_another_split(manifests):
    ds = ShardDataset(manifests[0], data=DATA)
    list(itertools.islice(ds, 3))
    saved = ds.state_dict()
    with pytest.raises(DataError, match="other shards"):
        ShardDataset(manifests[1], data=DATA).load_state_dict(saved)
    with pytest.raises(DataError, match="seed"):
        ShardDataset(manifests[0], data=DataConfig(seed=4, shuffle_buffer=4)).load_state_dict(saved)
    with pytest.raises(DataError, match="readers × micro_batch"):
        ShardDataset(manifests[0], 2, data=DATA).load_state_dict(saved)


def test_torchdata_stateful_dataloader_saves_the_state(manifests):
    from torchdata.stateful_dataloader import StatefulDataLoader

    mix = {manifests[0]: 1.0, manifests[1]: 2.0}
    full = [
        b["input_ids"]
        for b in itertools.islice(
            StatefulDataLoader(ShardDataset(mix, 2, data=DATA), batch_size=2), 6
        )
    ]
    loader = StatefulDataLoader(ShardDataset(mix, 2, data=DATA), batch_size=2)
    it = iter(loader)
    head = [next(it)["input_ids"] for _ in range(3)]
    saved = loader.state_dict()
    resumed = StatefulDataLoader(ShardDataset(mix, 2, data=DATA), batch_size=2)
    resumed.load_state_dict(saved)
    rest = [b["input_ids"] for b in itertools.islice(resumed, 3)]
    for a, b in zip(head + rest, full):
        assert torch.equal(a, b)


def test_accelerates_stateful_dataloader_resumes_past_its_read_ahead(manifests):
    """Accelerate (use_stateful_dataloader) prepares the loader with its dispatcher, which
    reads a batch ahead; its saved state is still the consumed one."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration

    acc = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    try:

        def prepared():
            ds = ShardDataset(manifests[0], 2, data=DATA)
            return acc.prepare(torch.utils.data.DataLoader(ds, batch_size=2))

        full = [b["input_ids"] for b in itertools.islice(prepared(), 6)]
        loader = prepared()
        it = iter(loader)
        head = [next(it)["input_ids"] for _ in range(3)]
        saved = loader.state_dict()
        assert saved["dataset_state"]["loader"]["position"] == 6  # 3 batches of 2, not 4
        resumed = prepared()
        resumed.load_state_dict(saved)
        rest = [b["input_ids"] for b in itertools.islice(resumed, 3)]
        for a, b in zip(head + rest, full):
            assert torch.equal(a, b)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_more_than_one_worker_is_refused(manifests, monkeypatch):
    """Each DataLoader worker would replay the one stream: the dataset refuses inside a
    worker of several (asked as DataLoader workers ask, through get_worker_info)."""
    import ulysses_mm.hf.dataset as module

    monkeypatch.setattr(module, "get_worker_info", lambda: SimpleNamespace(num_workers=2))
    with pytest.raises(UnsupportedError, match="num_workers 0 or 1"):
        next(iter(ShardDataset(manifests[0], data=DATA)))
    monkeypatch.setattr(module, "get_worker_info", lambda: SimpleNamespace(num_workers=1))
    assert next(iter(ShardDataset(manifests[0], data=DATA)))["input_ids"].shape == (128,)


def test_datasets_factory_splits_by_node_like_the_readers(manifests):
    from accelerate.data_loader import prepare_data_loader
    from datasets.distributed import split_dataset_by_node

    ds = hf_dataset(manifests[0], micro_batch=2, readers=2, data=DATA)
    assert ds.n_shards == 2
    for r in range(2):
        want = _ids(itertools.islice(ShardDataset(manifests[0], 2, 2, r, DATA), 6))
        node = split_dataset_by_node(ds, rank=r, world_size=2)
        assert _ids(itertools.islice(node, 6)) == want
        # Accelerate shards a datasets stream by process when it does not dispatch
        loader = prepare_data_loader(
            torch.utils.data.DataLoader(ds, batch_size=2),
            num_processes=2,
            process_index=r,
            dispatch_batches=False,
            put_on_device=False,
        )
        got = [row.tolist() for b in itertools.islice(loader, 3) for row in b["input_ids"]]
        assert got == want
