"""The loader's order: a bounded shuffle buffer across shard seams, mixing several
manifests by weight, both functions of (seed, epoch) only, and a resume with another dp
that continues the same global sequence."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from train_data import prepare_dna

from ulysses_mm.loader.mixing import mix_error, sources_of
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.shards.manifest import Manifest


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[Manifest, Manifest]:
    root = tmp_path_factory.mktemp("order")
    a = Manifest.load(str(prepare_dna(root, "a", records=40, seq_len=256, seed=1)))
    b = Manifest.load(str(prepare_dna(root, "b", records=14, seq_len=256, seed=5)))
    return a, b


def _global(streams: list[ShardStream], steps: int) -> list[tuple[str, int]]:
    """The global sample sequence the DP ranks see together (rank order inside a step)."""
    out = []
    for _ in range(steps):
        for st in streams:
            out += [(st.order.manifests[0].name, s.index) for s in st.next_batch()]
    return out


def _mixed(pairs, dp, mb, seed=0, **kw) -> list[ShardStream]:
    return [ShardStream(pairs, r, dp, mb, StreamOptions(seed=seed, **kw)) for r in range(dp)]


def _tokens(st: ShardStream, steps: int) -> list[bytes]:
    return [s.tokens.tobytes() for _ in range(steps) for s in st.next_batch()]


def test_the_shuffle_buffer_blends_shard_seams_boundedly(two):
    a, _ = two
    plain = ShardStream(a, 0, 1, 1, StreamOptions(seed=3))
    buffered = ShardStream(a, 0, 1, 1, StreamOptions(seed=3, shuffle_buffer=64))
    buf = buffered.order.sources[0].buffer
    assert buf >= 2  # capped at half a typical shard
    base, order = plain.order.epoch_order(0), buffered.order.epoch_order(0)
    assert sorted(order.tolist()) == list(range(a.num_samples))
    moved = np.abs(np.argsort(order) - np.argsort(base))
    assert 0 < moved.max() < buf
    shard_of = [a.shard_of_sample(int(i))[0] for i in order]
    assert 1 + sum(x != y for x, y in itertools.pairwise(shard_of)) > len(a.shards)
    again = ShardStream(a, 0, 1, 1, StreamOptions(seed=3, shuffle_buffer=64))
    assert again.order.epoch_order(0).tolist() == order.tolist()  # a function of (seed, epoch)
    assert again.order.epoch_order(1).tolist() != order.tolist()
    # the samples read are the ones the order names
    assert [buffered.next_batch()[0].index for _ in range(10)] == order[:10].tolist()


def test_sources_get_their_weights_share_deterministically(two):
    a, b = two
    w = [0.7, 0.3]
    st = ShardStream([(a, w[0]), (b, w[1])], 0, 1, 4, StreamOptions(seed=11, shuffle_buffer=8))
    seen = [st.next_batch() for _ in range(250)]
    err = mix_error(st.cursor.counts.tolist(), w)
    print(
        f"mix after {int(st.cursor.counts.sum())} samples: counts {st.cursor.counts.tolist()} error {err:.4f}"
    )
    assert err <= 0.02
    # a source's first n draws are each of its samples once (then its next epoch)
    src = sources_of(np.arange(1000), w, 11)
    idx = [s.index for batch in seen for s in batch]
    b_draws = [i for i, s in zip(idx, src) if s == 1]
    assert sorted(b_draws[: b.num_samples]) == list(range(b.num_samples))
    assert b_draws[: b.num_samples] != b_draws[b.num_samples : 2 * b.num_samples]
    # the same seed gives the same samples; another seed does not
    again = ShardStream([(a, w[0]), (b, w[1])], 0, 1, 4, StreamOptions(seed=11, shuffle_buffer=8))
    assert [s.index for _ in range(20) for s in again.next_batch()] == idx[:80]
    other = ShardStream([(a, w[0]), (b, w[1])], 0, 1, 4, StreamOptions(seed=12, shuffle_buffer=8))
    assert [s.index for _ in range(20) for s in other.next_batch()] != idx[:80]
    # the samples are the sources' own (tokens of a sample of b in b's shards)
    tokens = {s.tokens.tobytes() for s in ShardStream(b, 0, 1, b.num_samples).next_batch()}
    first_b = next(s for s, k in zip(itertools.chain(*seen), src) if k == 1)
    assert first_b.tokens.tobytes() in tokens


def test_weights_and_sources_must_match_on_resume(two):
    a, b = two
    state = ShardStream([(a, 0.7), (b, 0.3)], 0, 1, 2).state_dict()
    with pytest.raises(ValueError, match="mixing weights"):
        ShardStream([(a, 0.5), (b, 0.5)], 0, 1, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="belongs to other shards"):
        ShardStream([(b, 0.7), (a, 0.3)], 0, 1, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle_buffer=4 but the checkpoint was made with 0"):
        ShardStream([(a, 0.7), (b, 0.3)], 0, 1, 2, StreamOptions(shuffle_buffer=4)).load_state_dict(
            state
        )


@pytest.mark.parametrize("mixed", [False, True])
def test_resuming_with_another_dp_continues_the_same_global_order(two, mixed):
    a, b = two
    pairs = [(a, 0.6), (b, 0.4)] if mixed else a
    kw = {"shuffle_buffer": 8}

    def run(dp: int, mb: int, steps: int, state=None) -> tuple[list[int], dict]:
        streams = _mixed(pairs, dp, mb, seed=5, **kw)
        if state is not None:
            for st in streams:
                st.load_state_dict(state)
        seen = []
        for _ in range(steps):
            for st in streams:
                seen += [s.index for s in st.next_batch()]
        assert len({str(st.state_dict()) for st in streams}) == 1  # every rank agrees
        return seen, streams[0].state_dict()

    # dp 2 × mb 2 for 3 steps, then dp 3 × mb 2 (and back to dp 1 × mb 4) from the checkpoint
    head, state = run(2, 2, 3)
    middle, state = run(3, 2, 2, state)
    tail, _ = run(1, 4, 2, state)
    resumed = head + middle + tail
    # mixed: epochs follow one another with nothing dropped, so a long run crosses them;
    # one source: stay inside the first epoch (its tail depends on the global batch)
    uninterrupted, _ = run(1, 1, len(resumed))
    assert len(resumed) == 12 + 12 + 8
    assert resumed == uninterrupted
    if mixed:
        long_a, state = run(2, 3, 10)
        long_b, _ = run(4, 1, 15, state)
        assert long_a + long_b == run(1, 2, 60)[0]  # 120 samples: several epochs of b


def test_plan_run_checks_every_mixed_manifest_and_the_loader_budgets(two, tmp_path):
    from ulysses_mm.config import RunConfig, load_config
    from ulysses_mm.train.plan import plan_run

    a, b = two
    short = Manifest.load(str(prepare_dna(tmp_path, "short", records=6, seq_len=128, seed=3)))

    def plan(*overrides: str):
        return plan_run(load_config(RunConfig, None, list(overrides)), world=1)

    mix = f"data.train={{{a.location}: 0.7, {b.location}: 0.3}}"
    p = plan(mix)
    assert [(m.location, w) for m, w in p.sources] == [(a.location, 0.7), (b.location, 0.3)]
    with pytest.raises(ValueError, match=rf"the shards of {short.location} hold samples of 128"):
        plan(f"data.train={{{a.location}: 0.5, {short.location}: 0.5}}")
    with pytest.raises(ValueError, match=rf"the weight of {b.location} is 0"):
        plan(f"data.train={{{a.location}: 1, {b.location}: 0}}")
    with pytest.raises(ValueError, match=r"data.cache_bytes=1000 cannot hold two shards"):
        plan(mix, f"data.cache_dir={tmp_path / 'cache'}", "data.cache_bytes=1000")
    with pytest.raises(ValueError, match=r"data.read_timeout_s=0.0: give a positive"):
        plan(mix, "data.read_timeout_s=0")


def test_sources_are_labelled_by_their_directory(two):
    a, b = two
    assert ShardStream([(a, 1), (b, 1)], 0, 1, 1).tally.source_labels == ["a", "b"]
    assert ShardStream([(a, 1), (a, 1)], 0, 1, 1).tally.source_labels == ["0.a", "1.a"]


def test_a_short_eval_manifest_is_named_data_eval(two, tmp_path):
    """Evaluation shards whose samples are shorter than the run's data.seq_len, or fewer
    than one global micro-batch, or missing: the one line says they are data.eval's."""
    from ulysses_mm.config import RunConfig, load_config
    from ulysses_mm.core.errors import DataError, UserError
    from ulysses_mm.train.plan import plan_run

    a, _ = two
    short = Manifest.load(str(prepare_dna(tmp_path, "short", records=6, seq_len=128, seed=3)))

    def plan(*overrides: str):
        return plan_run(load_config(RunConfig, None, [f"data.train={a.location}", *overrides]), 1)

    with pytest.raises(DataError) as e:
        plan(f"data.eval={short.location}", "data.seq_len=256")
    assert str(e.value).startswith(
        f"data.eval: data.seq_len=256 but the shards of {short.location} hold samples of 128"
    )
    few = short.num_samples + 1
    with pytest.raises(DataError) as e:
        plan(f"data.eval={short.location}", f"data.micro_batch_size={few}")
    assert str(e.value) == (
        f"data.eval: {short.location} holds {short.num_samples} samples, fewer than one "
        f"global micro-batch (dp 1 × micro_batch {few})"
    )
    missing = tmp_path / "none" / "manifest.json"
    with pytest.raises(UserError, match=r"^data\.eval: .*none/manifest\.json"):
        plan(f"data.eval={missing}")
