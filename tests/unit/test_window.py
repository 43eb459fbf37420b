"""Windows cut out of longer packed samples: each is exactly its slice of the whole
sample's model inputs; the window stream visits every window once per epoch, splits each
global micro-batch over DP ranks, and resumes exactly, with another layout or (at the next
whole sample) another length."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from train_data import prepare_dna

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.format import IGNORE, SEG_LENGTH, SEG_POS, SEG_START, PackedSample
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


@pytest.mark.parametrize("positions", ["continue", "restart"])
@pytest.mark.parametrize("length", [64, 96, S])
def test_windows_are_slices_of_the_whole_samples_inputs(dataset, samples, length, positions):
    space, k = dataset.token_space, S // length
    continued = crossing = 0
    for sample in samples:
        whole = _batch(sample, space)
        windows = cut_windows(sample, length, positions)
        assert len(windows) == k  # 96: the tail of 64 tokens is unused
        continued += int(sample.segments[0, SEG_POS] > 0)
        for w, win in enumerate(windows):
            a, b = w * length, (w + 1) * length
            got = _batch(win, space)
            assert win.index == sample.index * k + w
            np.testing.assert_array_equal(got.input_ids[0], whole.input_ids[0, a:b])
            pos = whole.position_ids[0, a:b].clone()
            if positions == "restart" and length < S:
                # the piece at the window's start counts from 0, the others as in the sample
                seg = win.segments
                n = int(seg[0, SEG_LENGTH]) if len(seg) and seg[0, SEG_START] == 0 else 0
                pos[:n] = torch.arange(n)
                assert int(got.position_ids[0].max()) < length
            np.testing.assert_array_equal(got.position_ids[0], pos)
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
            first = sample.segments[(sample.segments[:, SEG_START] < a)]  # pieces before a
            ends = first[:, SEG_START] + first[:, SEG_LENGTH]
            crossing += int(bool((ends > a).any()))  # a document the window cuts
    assert continued > 0 and (length == S or crossing > 0)  # both cases were met


def test_a_padded_tail_gives_windows_without_documents():
    seg = np.array([[0, 5, 0, 7, 3], [5, 2, 0, 8, 0]], dtype=np.int64)
    sample = PackedSample(4, np.arange(12, dtype=np.uint8), seg)
    a, b, c = cut_windows(sample, 4, "continue")
    assert [w.index for w in (a, b, c)] == [12, 13, 14]
    np.testing.assert_array_equal(a.segments, [[0, 4, 0, 7, 3]])
    np.testing.assert_array_equal(b.segments, [[0, 1, 0, 7, 7], [1, 2, 0, 8, 0]])
    # restart: each window's first piece counts from 0, a document starting inside keeps 0
    a, b, _ = cut_windows(sample, 4, "restart")
    np.testing.assert_array_equal(a.segments, [[0, 4, 0, 7, 0]])
    np.testing.assert_array_equal(b.segments, [[0, 1, 0, 7, 0], [1, 2, 0, 8, 0]])
    # a window as long as the sample is the sample, its packed offset kept
    (whole,) = cut_windows(sample, 12, "restart")
    np.testing.assert_array_equal(whole.segments, seg)
    with pytest.raises(ValueError, match="'restart' or 'continue'"):
        cut_windows(sample, 4, "zero")  # type: ignore[arg-type]
    assert c.segments.shape == (0, 5) and c.real_tokens == 0


def _lanes(samples: list[tuple[int, int]], lanes: int, steps: int) -> list[list[int]]:
    """The module docstring's order, written out: ``samples`` as (index, windows) in the
    order's sequence; per micro-batch, each lane's window id (a used-up lane takes the next
    sample, lanes in order)."""
    held: list[list[int]] = [[0, 0, 0] for _ in range(lanes)]  # index, windows, used
    feed = iter(samples)
    out = []
    for _ in range(steps):
        row = []
        for lane in held:
            if lane[2] >= lane[1]:
                lane[0], lane[1] = next(feed)
                lane[2] = 0
            row.append(lane[0] * lane[1] + lane[2])
            lane[2] += 1
        out.append(row)
    return out


def _order(sources, opts, n: int, length: int) -> list[tuple[int, int]]:
    st = ShardStream(sources, 0, 1, 1, opts)
    return [(s.index, len(s.tokens) // length) for _ in range(n) for s in st.next_batch()]


def _count_reads(st: WindowStream) -> list[int]:
    """The samples ``st`` reads (fetches and decodes), appended as it reads them."""
    read: list[int] = []
    sample = st.base._sample

    def counted(src: int, index: int) -> PackedSample:
        read.append(index)
        return sample(src, index)

    st.base._sample = counted  # type: ignore[method-assign]
    return read


def test_each_rank_reads_whole_samples_and_takes_each_window_once(dataset):
    length, opts = 64, StreamOptions(seed=3)
    k, n = S // length, dataset.num_samples
    single = WindowStream(dataset, 0, 1, 1, length, opts)
    epoch = _ids(single.next_batch() for _ in range(n * k))
    assert sorted(epoch) == list(range(n * k))  # every window once
    samples = ShardStream(dataset, 0, 1, 1, opts).order.epoch_order(0).tolist()
    assert epoch == [i * k + w for i in samples for w in range(k)]  # each sample's in turn
    assert single.order.batches_per_epoch == n * k
    # dp 3 × micro_batch 2: six lanes, rank r's are 2r and 2r+1; an SP twin agrees
    dp, mb = 3, 2
    steps = k * (n // (dp * mb))  # every lane through n // 6 whole samples of epoch 0
    ranks = [WindowStream(dataset, r, dp, mb, length, opts) for r in range(dp)]
    reads = [_count_reads(r) for r in ranks]
    twin = WindowStream(dataset, 1, dp, mb, length, opts)
    want = _lanes(_order(dataset, opts, n, length), dp * mb, steps)
    by_sample: dict[int, set[int]] = {}
    for step in range(steps):
        per_rank = [r.next_batch() for r in ranks]
        assert _ids([twin.next_batch()]) == _ids([per_rank[1]])
        assert [s.index for b in per_rank for s in b] == want[step]
        for r, b in enumerate(per_rank):
            for w in b:
                by_sample.setdefault(w.index // k, set()).add(r)
    assert all(len(r) == 1 for r in by_sample.values())  # a sample's windows: one rank's
    # each rank read each of its samples once, and only its own
    for r, got in enumerate(reads):
        assert sorted(got) == sorted(i for i, owners in by_sample.items() if owners == {r})
    assert sorted(i for g in reads for i in g) == sorted(samples[: dp * mb * (n // (dp * mb))])
    assert ranks[0].state_dict() == ranks[2].state_dict() == twin.state_dict()
    assert ranks[0].order.batches_per_epoch == n * k // (dp * mb)


def test_resume_mid_sample_is_exact(dataset):
    length, opts = 64, StreamOptions(seed=5)
    for dp, mb in ((1, 3), (2, 2)):
        a = [WindowStream(dataset, r, dp, mb, length, opts) for r in range(dp)]
        for _ in range(5):
            for st in a:
                st.next_batch()
        state = a[0].state_dict()
        assert state["length"] == length and state["lanes"] == dp * mb
        assert state["slots"]  # in the middle of samples
        rest = [[st.next_batch() for st in a] for _ in range(40)]  # crosses an epoch
        b = [WindowStream(dataset, r, dp, mb, length, opts) for r in range(dp)]
        for st in b:
            st.load_state_dict(state)
        assert b[0].state_dict() == state
        again = [[st.next_batch() for st in b] for _ in range(40)]
        assert [_ids(x) for x in again] == [_ids(x) for x in rest]
        assert all(
            np.array_equal(x.segments, y.segments)
            for p, q in zip(rest, again)
            for bp, bq in zip(p, q)
            for x, y in zip(bp, bq)
        )


def test_a_changed_layout_loses_and_repeats_no_window(dataset):
    length, opts = 64, StreamOptions(seed=1)
    k = S // length
    a = [WindowStream(dataset, r, 2, 3, length, opts) for r in range(2)]
    before = []
    for _ in range(3):
        for st in a:
            before += _ids([st.next_batch()])
    state = a[1].state_dict()
    partly = {(i, u) for _, _, i, u in state["slots"]}
    assert partly  # every lane is 3 windows into a sample of 4
    b = [WindowStream(dataset, r, 3, 2, length, opts) for r in range(3)]
    for st in b:
        st.load_state_dict(state)
    after = []
    for _ in range(k):
        for st in b:
            after += _ids([st.next_batch()])
    assert not set(before) & set(after) and len(after) == len(set(after))
    for i, used in partly:  # what the old lanes left is taken first, nothing of it lost
        assert {i * k + w for w in range(used, k)} <= set(after[: 6 * k])
        assert {i * k + w for w in range(used)} <= set(before)


def test_a_changed_length_continues_at_the_next_whole_sample(dataset):
    opts = StreamOptions(seed=4)
    order = ShardStream(dataset, 0, 1, 1, opts).order.epoch_order(0).tolist()
    a = WindowStream(dataset, 0, 1, 3, 64, opts)
    a.next_batch()  # window 0 of each of the first three samples
    b = WindowStream(dataset, 0, 1, 2, 128, opts)
    b.load_state_dict(a.state_dict())
    assert _ids([b.next_batch()]) == [order[3] * 2, order[4] * 2]
    for _ in range(3):
        a.next_batch()  # 4 windows of 4: the three samples used up
    assert a.state_dict()["slots"] == []
    b.load_state_dict(a.state_dict())
    assert _ids([b.next_batch()]) == [order[3] * 2, order[4] * 2]
    # a whole-sample stream's state is a sample boundary
    shards = ShardStream(dataset, 0, 2, 2, opts)
    shards.next_batch()
    b.load_state_dict(shards.state_dict())
    assert _ids([b.next_batch()]) == [order[4] * 2, order[5] * 2]


def test_a_version_1_state_continues_its_sample(dataset):
    opts = StreamOptions(seed=4)
    order = ShardStream(dataset, 0, 1, 1, opts).order.epoch_order(0).tolist()
    start = ShardStream(dataset, 0, 1, 1, opts).state_dict()
    old = {"windows": 1, "length": 64, "used": 3, "stream": start}  # 3 of sample 0's 4 taken
    b = WindowStream(dataset, 0, 1, 2, 64, opts)
    b.load_state_dict(old)
    assert _ids([b.next_batch()]) == [order[0] * 4 + 3, order[1] * 4]
    b.load_state_dict({**old, "length": 128})  # another length: the next whole sample
    assert _ids([b.next_batch()]) == [order[1] * 4, order[2] * 4]
    with pytest.raises(DataError, match="version 7"):
        b.load_state_dict({**old, "windows": 7})


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
    want = _lanes(_order(sources, opts, 30, 64), 5, 5)
    a = WindowStream(sources, 0, 1, 5, 64, opts)
    got = [_ids([a.next_batch()])]
    state = a.state_dict()
    got += [_ids([a.next_batch()]) for _ in range(4)]
    assert got == want
    b = WindowStream(sources, 0, 1, 5, 64, opts)
    b.load_state_dict(state)
    assert [_ids([b.next_batch()]) for _ in range(4)] == got[1:]
    assert b.mix_shares() == a.mix_shares()


ROPES = [
    dict(kind="default"),
    dict(kind="linear", factor=2.0),
    dict(kind="yarn", factor=2.0, original_max_position_embeddings=64),
    dict(
        kind="llama3",
        factor=2.0,
        original_max_position_embeddings=64,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    ),
    dict(kind="dynamic", factor=2.0, original_max_position_embeddings=64),
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["kind"])
def test_restarted_positions_change_only_what_depends_on_absolute_length(dataset, samples, rope):
    # windows of 64 whose first document continues to position ~200: RoPE with fixed
    # frequencies sees position differences only (the same hidden states either way);
    # dynamic NTK grows θ with the longest position, so continuing changes what it computes
    from ulysses_mm.config import ModelConfig, RopeConfig
    from ulysses_mm.model import build_model

    space = dataset.token_space
    cfg = ModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope=RopeConfig(**rope),
    )
    pairs = [
        (c, r)
        for s in samples[:4]
        for c, r in zip(cut_windows(s, 64, "continue"), cut_windows(s, 64), strict=True)
        if c.segments[0, SEG_POS] > 64  # a document the window cuts late in it
    ]
    assert pairs
    for cont, rest in pairs:
        outs = []
        for win in (cont, rest):
            batch = _batch(win, space)
            model = build_model(cfg, space, seed=0).eval()  # dynamic's θ: fresh for each
            with torch.no_grad():
                outs.append(model.hidden_states(batch.input_ids, batch.position_ids, batch.doc_ids))
        if rope["kind"] == "dynamic":
            assert not torch.allclose(outs[0], outs[1], atol=1e-3)
        else:
            torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)
