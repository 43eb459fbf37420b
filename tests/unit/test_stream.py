"""The training loader: deterministic order, DP/SP split, exact resume, safe decoding,
bounded retries over a flaky HTTP server, token-space checks."""

from __future__ import annotations

import http.server
import io
import itertools
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from conftest import serve_dir, tar_of
from train_data import prepare_dna

from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.core.format import ShardFormatError
from ulysses_mm.loader.stream import ShardStream, StreamOptions, shard_samples
from ulysses_mm.shards.manifest import Manifest, ManifestError
from ulysses_mm.train.plan import model_space


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Manifest:
    root = tmp_path_factory.mktemp("stream")
    return Manifest.load(str(prepare_dna(root, "ds", records=40, seq_len=256, seed=1)))


def _indices(batches) -> list[list[int]]:
    return [[s.index for s in b] for b in batches]


def test_order_is_a_function_of_seed_epoch_and_manifest(dataset):
    assert len(dataset.shards) > 2, "want several shards"
    a = ShardStream(dataset, 0, 1, 1, StreamOptions(seed=7))
    b = ShardStream(dataset, 0, 1, 1, StreamOptions(seed=7))
    n = dataset.num_samples
    np.testing.assert_array_equal(a.order.epoch_order(0), b.order.epoch_order(0))
    assert sorted(a.order.epoch_order(0).tolist()) == list(range(n))  # each sample once per epoch
    assert a.order.epoch_order(0).tolist() != a.order.epoch_order(1).tolist()
    assert (
        a.order.epoch_order(0).tolist()
        != ShardStream(dataset, 0, 1, 1, StreamOptions(seed=8)).order.epoch_order(0).tolist()
    )
    assert ShardStream(dataset, 0, 1, 1, StreamOptions(shuffle=False)).order.epoch_order(
        3
    ).tolist() == list(range(n))
    # shards stay contiguous in the order (a shard is read once per epoch)
    shard_of = [dataset.shard_of_sample(int(i))[0] for i in a.order.epoch_order(0)]
    runs = 1 + sum(x != y for x, y in itertools.pairwise(shard_of))
    assert runs == len(dataset.shards)


def test_dp_ranks_split_the_global_batch_and_sp_ranks_agree(dataset):
    dp, mb = 3, 2
    streams = [ShardStream(dataset, r, dp, mb, StreamOptions(seed=1)) for r in range(dp)]
    twin = ShardStream(dataset, 1, dp, mb, StreamOptions(seed=1))  # another SP rank of DP group 1
    single = ShardStream(
        dataset, 0, 1, dp * mb, StreamOptions(seed=1)
    )  # one process, same global batch
    for _ in range(5):
        per_rank = [[s.index for s in st.next_batch()] for st in streams]
        assert [s.index for s in twin.next_batch()] == per_rank[1]
        flat = [i for r in per_rank for i in r]
        assert len(set(flat)) == dp * mb
        assert flat == [s.index for s in single.next_batch()]


def test_epochs_roll_over_dropping_a_short_tail(dataset):
    st = ShardStream(dataset, 0, 1, 3, StreamOptions(seed=0))
    per_epoch = dataset.num_samples // 3
    seen = _indices(st.next_batch() for _ in range(per_epoch))
    assert st.cursor.epoch == 0
    st.next_batch()
    assert st.cursor.epoch == 1 and st.cursor.position == 3
    assert len({i for b in seen for i in b}) == per_epoch * 3


def test_resume_mid_shard_is_exact(dataset):
    a = ShardStream(dataset, 1, 2, 1, StreamOptions(seed=3))
    first = _indices(a.next_batch() for _ in range(7))
    state = a.state_dict()
    rest = _indices(a.next_batch() for _ in range(dataset.num_samples))  # crosses an epoch
    b = ShardStream(dataset, 1, 2, 1, StreamOptions(seed=3))
    b.load_state_dict(state)
    assert _indices(b.next_batch() for _ in range(dataset.num_samples)) == rest
    assert first  # the state was taken in the middle of the order
    with pytest.raises(ValueError, match="seed=4 but the checkpoint was made with 3"):
        ShardStream(dataset, 1, 2, 1, StreamOptions(seed=4)).load_state_dict(state)


def test_state_from_other_shards_is_refused(dataset, tmp_path):
    other = Manifest.load(str(prepare_dna(tmp_path, "other", records=12, seq_len=256, seed=9)))
    state = ShardStream(other, 0, 1, 1).state_dict()
    with pytest.raises(ValueError, match="belongs to other shards"):
        ShardStream(dataset, 0, 1, 1).load_state_dict(state)


def test_samples_match_the_packed_tokens(dataset):
    st = ShardStream(dataset, 0, 1, 1, StreamOptions(shuffle=False))
    s = st.next_batch()[0]
    assert s.index == 0 and s.tokens.dtype == np.uint8 and len(s.tokens) == dataset.seq_len
    assert s.segments[0, 0] == 0 and s.segments[:, 1].sum() <= dataset.seq_len


def test_only_npy_members_are_decoded():
    npy = io.BytesIO()
    np.save(npy, np.zeros(4, np.uint8))
    seg = io.BytesIO()
    np.save(seg, np.zeros((1, 5), np.int64))
    evil = tar_of(
        {
            "000000000.tokens.npy": npy.getvalue(),
            "000000000.segments.npy": seg.getvalue(),
            "000000000.meta.pyd": b"\x80\x04N.",
        }
    )
    with pytest.raises(
        ShardFormatError, match=r"has members \['meta.pyd'\]; only .npy arrays are read"
    ):
        shard_samples(evil, "evil.tar")
    obj = io.BytesIO()
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    pickled = tar_of(
        {"000000000.tokens.npy": obj.getvalue(), "000000000.segments.npy": seg.getvalue()}
    )
    with pytest.raises(ShardFormatError, match="not a plain .npy array"):
        shard_samples(pickled, "pickled.tar")


class _FlakyHandler(http.server.SimpleHTTPRequestHandler):
    failures: ClassVar[dict[str, int]] = {}

    def do_GET(self):
        left = self.failures.get(self.path, 0)
        if left:
            self.failures[self.path] = left - 1
            self.send_error(503, "busy")
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def http_dataset(dataset):
    try:
        with serve_dir(Path(dataset.location).parent, _FlakyHandler) as url:
            yield url
    finally:
        _FlakyHandler.failures.clear()


def test_network_faults_are_retried_then_named(dataset, http_dataset):
    m = Manifest.load(f"{http_dataset}/manifest.json")
    first = "/" + m.shards[0].url
    _FlakyHandler.failures[first] = 2  # two 503s, then the shard
    st = ShardStream(m, 0, 1, 1, StreamOptions(shuffle=False, retries=3, backoff_s=0.01))
    local = ShardStream(dataset, 0, 1, 1, StreamOptions(shuffle=False))
    assert np.array_equal(st.next_batch()[0].tokens, local.next_batch()[0].tokens)
    assert _FlakyHandler.failures[first] == 0

    _FlakyHandler.failures["/" + m.shards[1].url] = 100  # down for good
    st = ShardStream(
        m, 0, 1, m.shards[0].samples + 1, StreamOptions(shuffle=False, retries=3, backoff_s=0.01)
    )
    with pytest.raises(
        OSError, match=rf"could not read shard {http_dataset}/{m.shards[1].url} after 3 attempts"
    ):
        st.next_batch()


def test_token_space_mismatch_names_both(dataset):
    cfg = load_config(RunConfig, None, ["model.modalities={dna: 16}"])
    with pytest.raises(
        ManifestError,
        match=r"dna 5\.\.14.*differs from the model's TokenSpace\(vocab=21.*dna 5\.\.20",
    ):
        model_space(cfg, dataset)
    assert model_space(load_config(RunConfig), dataset) == dataset.token_space
