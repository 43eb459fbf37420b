"""Windows cut out of longer packed samples: each is exactly its slice of the whole
sample's model inputs; the window stream visits every window once per epoch, splits each
global micro-batch over DP ranks, and resumes exactly, with another layout or (at the next
whole sample) another length."""

from __future__ import annotations

import numpy as np
import pytest
from train_data import prepare_dna

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.format import IGNORE, SEG_POS, SEG_START, PackedSample
from ulysses_mm.loader.batch import make_batch
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.loader.window import WindowStream, cut_windows
from ulysses_mm.shards.manifest import Manifest

S = 256


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Manifest:
    # documents of 100-200 bases in samples of 256: several per sample, many crossing a
    # window boundary, and one continuing from the sample before in most samples
    root = tmp_path_factory.mktemp("window")
    return Manifest.load(str(prepare_dna(root, "ds", records=30, seq_len=S, seed=2, length=200)))


@pytest.fixture(scope="module")
def samples(dataset) -> list[PackedSample]:
    st = ShardStream(dataset, 0, 1, 1, StreamOptions().in_order())
    return [st.next_batch()[0] for _ in range(dataset.num_samples)]


def _batch(sample: PackedSample, space):
    return make_batch(sample.tokens[None].astype(np.int64), [sample.segments], space)


def _ids(batches) -> list[int]:
    return [s.index for b in batches for s in b]


def _same_doc(doc: np.ndarray) -> np.ndarray:
    return (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)


@pytest.mark.parametrize("length", [64, 96, S])
def test_windows_are_slices_of_the_whole_samples_inputs(dataset, samples, length):
    space, k = dataset.token_space, S // length
    continued = crossing = 0
    for sample in samples:
        whole = _batch(sample, space)
        windows = cut_windows(sample, length)
        assert len(windows) == k  # 96: the tail of 64 tokens is unused
        continued += int(sample.segments[0, SEG_POS] > 0)
        for w, win in enumerate(windows):
            a, b = w * length, (w + 1) * length
            got = _batch(win, space)
            assert win.index == sample.index * k + w
            np.testing.assert_array_equal(got.input_ids[0], whole.input_ids[0, a:b])
            np.testing.assert_array_equal(got.position_ids[0], whole.position_ids[0, a:b])
            # labels: the whole sample's, but none across the window's end
            want = whole.labels[0, a:b].clone()
            want[-1] = IGNORE
            np.testing.assert_array_equal(got.labels[0], want)
            mods = whole.label_modality[0, a:b].clone()
            mods[-1] = -1
            np.testing.assert_array_equal(got.label_modality[0], mods)
            # the same tokens share a document (renumbered ids separate them the same way)
            np.testing.assert_array_equal(
                _same_doc(got.doc_ids[0].numpy()), _same_doc(whole.doc_ids[0, a:b].numpy())
            )
            first = win.segments[:1]  # none in a window of the last sample's padding
            crossing += int(len(first) > 0 and first[0, SEG_POS] > 0 and first[0, SEG_START] == 0)
    assert continued > 0 and (length == S or crossing > continued)  # both cases were met


def test_a_padded_tail_gives_windows_without_documents():
    seg = np.array([[0, 5, 0, 7, 3], [5, 2, 0, 8, 0]], dtype=np.int64)
    sample = PackedSample(4, np.arange(12, dtype=np.uint8), seg)
    a, b, c = cut_windows(sample, 4)
    assert [w.index for w in (a, b, c)] == [12, 13, 14]
    np.testing.assert_array_equal(a.segments, [[0, 4, 0, 7, 3]])
    np.testing.assert_array_equal(b.segments, [[0, 1, 0, 7, 7], [1, 2, 0, 8, 0]])
    assert c.segments.shape == (0, 5) and c.real_tokens == 0


def test_every_window_of_an_epoch_once_and_dp_ranks_split_the_sequence(dataset):
    length, opts = 64, StreamOptions(seed=3)
    k, n = S // length, dataset.num_samples
    single = WindowStream(dataset, 0, 1, 1, length, opts)
    epoch = _ids(single.next_batch() for _ in range(n * k))
    assert sorted(epoch) == list(range(n * k))  # every window once
    samples = ShardStream(dataset, 0, 1, 1, opts).order.epoch_order(0).tolist()
    assert epoch == [i * k + w for i in samples for w in range(k)]  # each sample's in turn
    assert single.order.batches_per_epoch == n * k
    in_order = WindowStream(dataset, 0, 1, 2, length, opts.in_order())
    assert _ids(in_order.next_batch() for _ in range(3)) == list(range(6))
    # dp 3 × micro_batch 2: rank r takes places [2r, 2r+2) of each 6 windows; an SP twin agrees
    dp, mb = 3, 2
    ranks = [WindowStream(dataset, r, dp, mb, length, opts) for r in range(dp)]
    twin = WindowStream(dataset, 1, dp, mb, length, opts)
    reference = WindowStream(dataset, 0, 1, 1, length, opts)
    for _ in range(n * k // (dp * mb) + 3):  # on into the next epoch
        per_rank = [r.next_batch() for r in ranks]
        assert _ids([twin.next_batch()]) == _ids([per_rank[1]])
        want = [reference.next_batch()[0] for _ in range(dp * mb)]
        got = [s for b in per_rank for s in b]
        assert [s.index for s in got] == [s.index for s in want]
        assert all(np.array_equal(g.tokens, w.tokens) for g, w in zip(got, want))
    assert ranks[0].state_dict() == ranks[2].state_dict() == twin.state_dict()
    assert ranks[0].order.batches_per_epoch == n * k // (dp * mb)


def test_resume_mid_sample_is_exact_and_the_state_has_no_layout(dataset):
    length, opts = 64, StreamOptions(seed=5)
    a = WindowStream(dataset, 0, 1, 3, length, opts)
    for _ in range(5):
        a.next_batch()
    state = a.state_dict()
    assert state["used"] == 15 % 4 and state["length"] == length  # in the middle of a sample
    rest = [a.next_batch() for _ in range(40)]  # crosses an epoch
    b = WindowStream(dataset, 0, 1, 3, length, opts)
    b.load_state_dict(state)
    assert b.state_dict() == state
    again = [b.next_batch() for _ in range(40)]
    assert _ids(again) == _ids(rest)
    assert all(
        np.array_equal(x.segments, y.segments) for p, q in zip(rest, again) for x, y in zip(p, q)
    )
    # 15 windows read as 1 × 15, 3 × 5 or 5 × 3 (rank 1 of dp 5): one state
    for dp, mb, steps in ((1, 15, 1), (5, 1, 3)):
        st = WindowStream(dataset, dp - 1, dp, mb, length, opts)
        for _ in range(steps):
            st.next_batch()
        assert st.state_dict() == state


def test_a_changed_layout_continues_the_same_window_sequence(dataset):
    length, opts = 64, StreamOptions(seed=1)
    reference = WindowStream(dataset, 0, 1, 1, length, opts)
    sequence = _ids(reference.next_batch() for _ in range(60))
    a = [WindowStream(dataset, r, 2, 3, length, opts) for r in range(2)]
    for _ in range(3):
        for st in a:
            st.next_batch()
    state = a[1].state_dict()  # 18 windows read: 4 samples and 2 windows of the fifth
    b = [WindowStream(dataset, r, 3, 2, length, opts) for r in range(3)]
    for st in b:
        st.load_state_dict(state)
    got = []
    for _ in range(5):
        got += [i for st in b for i in _ids([st.next_batch()])]
    assert got == sequence[18:48]


def test_a_changed_length_continues_at_the_next_whole_sample(dataset):
    opts = StreamOptions(seed=4)
    order = ShardStream(dataset, 0, 1, 1, opts).order.epoch_order(0).tolist()
    a = WindowStream(dataset, 0, 1, 3, 64, opts)
    a.next_batch()  # windows 0-2 of the first sample
    b = WindowStream(dataset, 0, 1, 2, 128, opts)
    b.load_state_dict(a.state_dict())
    assert _ids([b.next_batch()]) == [order[1] * 2, order[1] * 2 + 1]
    a.next_batch()  # the first sample's last window and 2 of the second's
    b.load_state_dict(a.state_dict())
    assert _ids([b.next_batch()]) == [order[2] * 2, order[2] * 2 + 1]
    a.next_batch()
    a.next_batch()  # 12 windows: at a sample boundary, nothing skipped
    assert a.state_dict()["used"] == 0
    b.load_state_dict(a.state_dict())
    assert _ids([b.next_batch()]) == [order[3] * 2, order[3] * 2 + 1]
    # a whole-sample stream's state is a sample boundary
    shards = ShardStream(dataset, 0, 2, 2, opts)
    shards.next_batch()
    b.load_state_dict(shards.state_dict())
    assert _ids([b.next_batch()]) == [order[4] * 2, order[4] * 2 + 1]


def test_a_window_longer_than_the_samples_is_one_line(dataset):
    with pytest.raises(DataError) as e:
        WindowStream(dataset, 0, 1, 1, S + 1)
    msg = str(e.value)
    assert "\n" not in msg and dataset.location in msg and f"{S + 1}" in msg and f"{S}" in msg
    with pytest.raises(DataError, match="fewer than one global micro-batch"):
        WindowStream(dataset, 0, 4, dataset.num_samples, S // 2)


def test_mixed_sources_cut_each_sample_by_its_own_length(dataset, tmp_path):
    short = Manifest.load(str(prepare_dna(tmp_path, "short", records=8, seq_len=128, seed=3)))
    sources = [(dataset, 1.0), (short, 1.0)]
    opts = StreamOptions(seed=2)
    samples = ShardStream(sources, 0, 1, 1, opts)
    want = []
    for _ in range(16):
        (s,) = samples.next_batch()
        k = len(s.tokens) // 64
        want += [s.index * k + w for w in range(k)]
    a = WindowStream(sources, 0, 1, 5, 64, opts)
    got = _ids([a.next_batch()])
    state = a.state_dict()
    got += _ids(a.next_batch() for _ in range(4))
    assert got == want[:25]
    b = WindowStream(sources, 0, 1, 5, 64, opts)
    b.load_state_dict(state)
    assert _ids(b.next_batch() for _ in range(4)) == got[5:]
    assert b.mix_shares() == a.mix_shares()
