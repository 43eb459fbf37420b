"""Balanced steps: a sample's work from its documents, a plan that is a permutation of the
step and shortens it, the manifest's record of each sample's pairs, a stream that reads the
same samples and resumes exactly, and a step loss that does not depend on the plan."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pytest
import torch
from torch.testing import assert_close
from train_data import MIXED_LENGTHS, prepare_dna

from ulysses_mm.config import ModelConfig
from ulysses_mm.core.format import NUM_COLUMNS, SEG_DOC, SEG_LENGTH, SEG_MODALITY, sample_pairs
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.balance import StepWork, Work, assign, in_order, sample_work, simulate
from ulysses_mm.loader.batch import Batch
from ulysses_mm.loader.stream import ShardStream, StreamOptions, shard_samples
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import apply_memory_policy, build_model
from ulysses_mm.parallel import Mesh, loss_weights
from ulysses_mm.shards.manifest import Manifest, ManifestError, read_shard
from ulysses_mm.train.step import forward_backward, step_counts

LENGTHS = MIXED_LENGTHS


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Manifest:
    root = tmp_path_factory.mktemp("balance")
    path = prepare_dna(root, "mixed", len(LENGTHS), seq_len=256, seed=3, lengths=LENGTHS)
    return Manifest.load(str(path))


def _segments(rows: list[tuple[int, int, int]]) -> np.ndarray:
    """(length, modality, doc) rows, contiguous from 0."""
    seg = np.zeros((len(rows), NUM_COLUMNS), dtype=np.int64)
    start = 0
    for i, (n, m, d) in enumerate(rows):
        seg[i, 0], seg[i, SEG_LENGTH], seg[i, SEG_MODALITY], seg[i, SEG_DOC] = start, n, m, d
        start += n
    return seg


def test_a_documents_pieces_count_as_one_document():
    # document 4 in two modality spans (3 + 5 tokens), then document 5 of 2 tokens
    assert sample_pairs(_segments([(3, 0, 4), (5, 1, 4), (2, 0, 5)])) == 8 * 9 // 2 + 3
    assert sample_pairs(np.zeros((0, NUM_COLUMNS), dtype=np.int64)) == 0


def test_the_heavy_samples_share_a_micro_step():
    # in order each micro-step holds a heavy and a light sample: both wait on the heavy one
    work = np.array([100.0, 1.0, 1.0, 100.0])
    plan = assign(work, dp=2, micro_batch=1, count=2)
    assert plan[:, :, 0].tolist() == [[0, 3], [1, 2]]
    assert StepWork.of(work, in_order(2, 2, 1)).critical == 200
    assert StepWork.of(work, plan).critical == 101
    assert StepWork.of(work, plan).max_over_mean == pytest.approx(101 / 101)


@pytest.mark.parametrize("dp,mb,count", [(2, 1, 4), (4, 2, 2), (8, 3, 3), (3, 1, 1)])
def test_a_plan_is_a_permutation_that_shortens_the_step(dp, mb, count):
    rng = np.random.default_rng(dp * 100 + mb * 10 + count)
    gains = []
    for _ in range(20):
        work = sample_work(rng.pareto(1.2, count * dp * mb) * 1e4, 256, 355.0)
        plan = assign(work, dp, mb, count)
        assert plan.shape == (count, dp, mb)
        assert sorted(plan.ravel().tolist()) == list(range(count * dp * mb))
        assert (np.diff(plan, axis=2) > 0).all()  # each rank's positions ascending
        np.testing.assert_array_equal(plan, assign(work.copy(), dp, mb, count))  # a function
        before, after = StepWork.of(work, in_order(count, dp, mb)), StepWork.of(work, plan)
        assert after.mean == pytest.approx(before.mean)  # the same work, spread otherwise
        if mb == 1:  # sorted micro-steps are optimal then
            assert after.critical <= before.critical + 1e-9
        gains.append(before.critical / after.critical)
    assert np.mean(gains) > 1.05 or dp * mb == 3  # (one micro-step of one sample each: even)
    with pytest.raises(ValueError, match="work holds"):
        assign(np.ones(5), dp, mb, count)


def test_the_manifest_records_each_samples_pairs(mixed, tmp_path):
    assert mixed.sample_pairs is not None and len(mixed.sample_pairs) == mixed.num_samples
    for k in range(len(mixed.shards)):
        for s in shard_samples(read_shard(mixed.shard_location(k)), mixed.shard_location(k)):
            assert mixed.sample_pairs[s.index] == sample_pairs(s.segments)
    assert len(set(mixed.sample_pairs)) > 3, "want samples of unequal work"
    body = json.loads(mixed.to_json())
    body["sample_pairs"][2] = 256 * 257  # more pairs than a sample of 256 tokens has
    bad = tmp_path / "manifest.json"
    bad.write_text(json.dumps(body))
    with pytest.raises(ManifestError, match=r"sample_pairs\[2\] = 65792 is outside"):
        Manifest.load(str(bad))
    body["sample_pairs"] = "lots"
    bad.write_text(json.dumps(body))
    with pytest.raises(ManifestError, match="sample_pairs must be a list of integers, got str"):
        Manifest.load(str(bad))
    del body["sample_pairs"]  # an older prepare's: still read
    bad.write_text(json.dumps(body))
    assert Manifest.load(str(bad)).sample_pairs is None


def _streams(manifest: Manifest, dp: int, mb: int, balance: bool) -> list[ShardStream]:
    work = Work(355.0, balance)
    return [ShardStream(manifest, r, dp, mb, StreamOptions(seed=5), work=work) for r in range(dp)]


def test_balanced_steps_read_the_same_samples_and_resume(mixed):
    dp, mb, gas, steps = 2, 1, 3, 4
    plain, balanced = _streams(mixed, dp, mb, False), _streams(mixed, dp, mb, True)
    gain = []
    for _ in range(steps):
        a = [[[s.index for s in b] for b in st.next_step(gas)] for st in plain]
        b = [[[s.index for s in b] for b in st.next_step(gas)] for st in balanced]
        assert all(len(r) == gas and all(len(m) == mb for m in r) for r in a + b)
        flat = lambda ranks: sorted(i for r in ranks for m in r for i in m)  # noqa: E731
        assert flat(a) == flat(b)  # the step's samples, spread otherwise
        ia, ib = plain[0].last_work, balanced[0].last_work
        assert ia is not None and ib is not None
        assert ia[0].per_rank.tolist() == ia[1].per_rank.tolist()  # off: read in order
        assert ib[0].critical == pytest.approx(ia[1].critical)
        assert ib[1].critical <= ia[1].critical + 1e-9
        gain.append(ia[1].critical / ib[1].critical)
    assert max(gain) > 1.0, gain
    assert balanced[0].state_dict() == plain[0].state_dict()  # the cursor knows no plan
    # a resume continues the same plan
    state = balanced[1].state_dict()
    nxt = [[s.index for s in m] for m in balanced[1].next_step(gas)]
    again = _streams(mixed, dp, mb, True)[1]
    again.load_state_dict(state)
    assert [[s.index for s in m] for m in again.next_step(gas)] == nxt


def test_a_manifest_without_pairs_cannot_be_balanced(mixed, tmp_path):
    body = json.loads(mixed.to_json())
    del body["sample_pairs"]
    old = Manifest.from_dict(body, "old/manifest.json")
    with pytest.raises(Exception, match="records no sample_pairs .* data.balance=false"):
        ShardStream(old, 0, 2, 1, work=Work(1.0))


def test_the_step_loss_does_not_depend_on_which_micro_step_holds_a_sample():
    """Two micro-steps of two samples each, grouped two ways: with the step's counts the
    shares add up to one loss and one gradient (without them they would not)."""
    vocab = {"dna": 16, "audio": 64}
    space = TokenSpace.from_vocab(vocab)
    cfg = ModelConfig(modalities=vocab, hidden_size=32, intermediate_size=64)
    rows = random_batch(space, 4, 48, seed=2)
    # unequal targets per sample, so per-micro-step means would differ
    rows.labels[0, :30] = -100

    def run(groups, whole_step: bool):
        model = build_model(cfg, space, seed=1)
        apply_memory_policy(model, cfg)
        w = loss_weights(space.modalities, {"audio": 2.0})
        micro = [_cat(rows, [a, b]) for a, b in groups]
        counts = step_counts(micro, Mesh.single(), len(space.modalities), "cpu")
        total = 0.0
        for m in micro:
            share, _ = forward_backward(
                model, m, w, Mesh.single(), scale=1.0 if whole_step else 0.5,
                step_counts=counts if whole_step else None,
            )  # fmt: skip
            total += float(share) * (1.0 if whole_step else 0.5)
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_a, grads_a = run([(0, 1), (2, 3)], True)
    loss_b, grads_b = run([(0, 3), (1, 2)], True)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for n in grads_a:
        assert_close(grads_a[n], grads_b[n], rtol=1e-5, atol=1e-7, msg=n)
    # the per-micro-step mean the loss was before: it moves with the grouping
    assert run([(0, 1), (2, 3)], False)[0] != pytest.approx(run([(0, 3), (1, 2)], False)[0])


def _cat(batch: Batch, rows: list[int]) -> Batch:
    return Batch(**{f.name: getattr(batch, f.name)[rows] for f in fields(batch)})


def test_step_counts_are_the_targets_of_every_micro_batch():
    space = TokenSpace.from_vocab({"dna": 16, "audio": 64})
    a, b = random_batch(space, 2, 32, seed=1), random_batch(space, 3, 32, seed=2)
    counts = step_counts([a, b], Mesh.single(), 2, "cpu")
    want = [
        sum(int(((x.labels != -100) & (x.label_modality == m)).sum()) for x in (a, b))
        for m in range(2)
    ]
    assert counts.tolist() == want and counts.dtype == torch.float64


def test_simulated_steps_of_a_long_tailed_corpus_gain_by_balancing():
    """A tenth of the samples one whole 1M-token document, the rest a hundred of 10K: each
    micro-step of mixed samples waits on its heaviest, balanced ones mostly do not."""
    n, rng = 1 << 20, np.random.default_rng(0)
    work = np.where(rng.random(400) < 0.1, n * (n + 1) / 2, 100 * 10_000 * 10_001 / 2)
    work = sample_work(work, n, 26_600.0)
    small, large = simulate(work, 2, 1, 4, steps=16), simulate(work, 64, 1, 4, steps=16)
    assert 1.0 <= large.balanced < large.in_order and large.speedup > 2.5, large
    assert 1.0 <= small.balanced <= small.in_order, small
    assert simulate(np.full(50, 7.0), 8, 2, 2).speedup == pytest.approx(1.0)  # even: no gain
