"""Hybrid Ulysses × ring on real gloo process groups against one process.

Loss and every gradient (fp32, assert_close) for (U, R) in (1,2), (2,1), (1,4), (2,2),
(4,1); MHA, GQA with kv < U, MQA; packed documents that cross rank and zigzag-chunk
boundaries, one-token documents; 2 heads at sp=4 (only possible with a ring); dp × sp.
One world per layout, several cases inside it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo import run_distributed
from torch.testing import assert_close

from ulysses_mm.config import ModelConfig, ParallelConfig
from ulysses_mm.core.layout import Layout, LayoutError, valid_sp_sizes
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.batch import make_labels
from ulysses_mm.loader.synthetic import packed_doc_ids, random_batch
from ulysses_mm.model import build_model
from ulysses_mm.model.attention import DocumentMask, LocalAttention
from ulysses_mm.parallel import (
    Mesh,
    apply_loss_balance,
    apply_ulysses,
    loss_weights,
    unmasked_pairs,
    zigzag_order,
)
from ulysses_mm.parallel.ring import new_ring_stats, ring_theory_bytes
from ulysses_mm.parallel.slice import ring_order, sp_slice
from ulysses_mm.train.step import forward_backward

VOCAB = {"dna": 16, "audio": 64, "video": 96}
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2)


def _loss_and_grads(model, batch, mesh):
    weights = loss_weights(model.space.modalities, {"audio": 0.5})
    share, report = forward_backward(model, batch, weights, mesh)
    return share, report, {n: p.grad.clone() for n, p in model.named_parameters()}


def _one_doc_tokens(batch):
    """Cut the first 6 tokens into one-token documents (doc ids stay increasing)."""
    doc = batch.doc_ids.clone()
    doc[:, :6] = torch.arange(-6, 0)
    doc = torch.cumsum(torch.cat([torch.ones_like(doc[:, :1]), doc[:, 1:] != doc[:, :-1]], 1), 1)
    return doc


def _parity(rank, world, sp, ring, cases):
    mesh = Mesh.build(sp, world // sp, ring)
    space = TokenSpace.from_vocab(VOCAB)
    out = []
    for i, (model_kw, seq_len, min_doc) in enumerate(cases):
        cfg = ModelConfig(modalities=VOCAB, **TINY, **model_kw)
        batch = random_batch(space, mesh.dp, seq_len, seed=3 + i, min_doc=min_doc)
        if min_doc == 1:
            # one-token documents at the start: rebuild doc ids and labels
            batch.doc_ids = _one_doc_tokens(batch)
            labels, mods = make_labels(batch.input_ids.numpy(), batch.doc_ids.numpy(), space)
            batch.labels, batch.label_modality = torch.from_numpy(labels), torch.from_numpy(mods)
        ref = build_model(cfg, space, "sdpa_dense", seed=11)
        _, ref_report, ref_grads = _loss_and_grads(ref, batch, Mesh.single())

        model = build_model(cfg, space, "sdpa_dense", seed=11)
        stats = new_ring_stats()
        apply_ulysses(model, mesh, ring_stats=stats)
        apply_loss_balance(model, mesh)
        local = sp_slice(batch.rows(mesh.dp_rank, mesh.dp_rank + 1), mesh.sp_rank, sp, ring)
        share, report, grads = _loss_and_grads(model, local, mesh)
        total = share.detach().clone()
        dist.all_reduce(total)
        assert_close(total, torch.tensor(ref_report.total), rtol=1e-6, atol=1e-6)
        assert report.counts == ref_report.counts
        for name, g in grads.items():
            dist.all_reduce(g)
            assert_close(g, ref_grads[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
        if ring > 1:
            # every layer's ring sends what ring_theory_bytes says (blocks no query sees
            # skip their compute, not their hop)
            fwd, bwd = ring_theory_bytes(
                seq_len,
                ring,
                sp // ring,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                micro_batch=1,
                elem_bytes=4,
            )
            layers = cfg.num_hidden_layers
            assert stats["forward_calls"] == stats["backward_calls"] == layers
            assert stats["forward_bytes"] == layers * fwd
            assert stats["backward_bytes"] == layers * bwd
        out.append((report.total, dict(stats)))
    return out


MHA = dict(num_attention_heads=4, num_key_value_heads=4)
GQA = dict(num_attention_heads=4, num_key_value_heads=2)
MQA = dict(num_attention_heads=4, num_key_value_heads=1)
TWO_HEADS = dict(num_attention_heads=2, num_key_value_heads=1)


def test_ring_sp2():
    # (1,2) pure ring: MHA with short documents crossing chunks, MQA with one-token docs
    run_distributed(_parity, 2, 2, 2, [(MHA, 64, 3), (MQA, 64, 1), (GQA, 32, 20)])


def test_ring_sp4_world4():
    # (1,4) pure ring, (2,2) hybrid (GQA kv 2 = U, MQA kv 1 < U), 2 heads at sp=4, (4,1)
    for ring, cases in [
        (4, [(MHA, 64, 3), (TWO_HEADS, 64, 1)]),
        (2, [(GQA, 64, 3), (MQA, 64, 1), (TWO_HEADS, 64, 12)]),
        (1, [(MQA, 64, 3)]),  # (4,1): today's Ulysses
    ]:
        results = run_distributed(_parity, 4, 4, ring, cases)
        assert len({r[0][0] for r in results}) == 1


def test_dp_times_sp():
    # world 4 = dp 2 × sp 2: (2,1) today's Ulysses through the same harness, and (1,2)
    for ring in (1, 2):
        run_distributed(_parity, 4, 2, ring, [(MQA, 64, 3)])


def _attention_skip(rank, world, doc):
    # ring attention alone against one process; counts the blocks it skipped
    mesh = Mesh.build(world, 1, world)
    stats = new_ring_stats()
    from ulysses_mm.parallel.ring import RingAttention

    attn = RingAttention(mesh.ring_group, mesh.ring_members, mesh.ring_rank, stats)
    n, h, d = doc.shape[1], 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, h, d, generator=g) for _ in range(3))
    mask = DocumentMask(doc)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = LocalAttention("sdpa_dense")(*ref_in, mask)
    gout = torch.randn(ref.shape, generator=g)
    ref.backward(gout)
    idx = ring_order(mask.doc_index, world).view(world, -1)[mesh.ring_rank]
    loc = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
    out = attn(*loc, DocumentMask(doc))
    out.backward(gout[:, idx])
    assert_close(out, ref[:, idx], rtol=1e-5, atol=1e-6)
    for a, b in zip(loc, ref_in):
        assert_close(a.grad, b.grad[:, idx], rtol=1e-5, atol=1e-5)
    return stats["skipped"]


def _attention_skips(rank, world, docs):
    return [_attention_skip(rank, world, doc) for doc in docs]


def test_ring_attention_skips_blocks_nobody_sees():
    # 4 ranks of 8 tokens. One-token documents: a query sees only itself, so every block
    # but a rank's own is skipped (R − 1 per rank); one document: none is.
    n = 32
    docs = [torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long)]
    skipped = run_distributed(_attention_skips, 4, docs)
    assert skipped == [[3, 0]] * 4


def test_ring_layout_balances_causal_work():
    # one document: the classic zigzag; packed documents of any length: every rank within
    # 10 % (the contiguous split is far off)
    doc = torch.zeros(1, 1024, dtype=torch.long)
    for ring in (2, 4, 8):
        zig = unmasked_pairs(doc, ring)
        assert max(zig) <= 1.1 * min(zig), zig
        plain = unmasked_pairs(doc, ring, contiguous=True)
        assert max(plain) > 1.1 * min(plain)  # the contiguous split is unbalanced
        assert sum(zig) == sum(plain) == 1024 * 1025 // 2
    for ring, mean in ((2, 300), (4, 40), (4, 900), (8, 3), (8, 2000)):
        doc = packed_doc_ids(2, 4096, mean, seed=ring)
        work = unmasked_pairs(doc, ring)
        assert max(work) <= 1.1 * min(work), (ring, mean, work)
        assert sum(work) == sum(unmasked_pairs(doc, ring, contiguous=True))


def test_ring_order_is_a_permutation_of_equal_parts():
    # every slot of every row holds N/2R tokens, whatever the documents
    for ring, mean in ((2, 5), (4, 37), (8, 100)):
        doc = packed_doc_ids(3, 1024, mean, seed=mean)
        docs = DocumentMask(doc).doc_index
        order = ring_order(docs, ring)
        for row in order:
            assert sorted(row.tolist()) == list(range(1024))
            for part in row.view(ring, -1):  # a rank's tokens stay in global order
                assert torch.all(part[1:] > part[:-1])
    assert torch.equal(
        zigzag_order(16, 2), torch.tensor([0, 1, 2, 3, 12, 13, 14, 15] + list(range(4, 12)))
    )


def test_sp_slice_ring_layout_keeps_every_label():
    space = TokenSpace.from_vocab(VOCAB)
    batch = random_batch(space, 2, 64, seed=5, pad_tail=False, min_doc=9)
    parts = [sp_slice(batch, r, 4, ring_size=2) for r in range(4)]
    order = ring_order(DocumentMask(batch.doc_ids).doc_index, 2)
    got = torch.cat([p.input_ids for p in parts], 1)
    assert torch.equal(got, batch.input_ids.gather(1, order))
    assert torch.equal(torch.cat([p.labels for p in parts], 1), batch.labels.gather(1, order))
    assert sum(p.num_targets for p in parts) == batch.num_targets
    assert all(torch.equal(p.doc_ids, batch.doc_ids) for p in parts)
    # one document, ring 2 over sp 4: rank 0 = first half of chunk 0, rank 1 = chunk 3
    one = random_batch(space, 1, 64, seed=5, pad_tail=False, min_doc=64)
    assert int(one.doc_ids.max()) == int(one.doc_ids.min())
    zig = zigzag_order(64, 2)
    assert torch.equal(sp_slice(one, 0, 4, ring_size=2).input_ids[0], one.input_ids[0, zig[:16]])
    assert zig[:16].tolist() == list(range(16))
    assert zig[16:32].tolist() == list(range(48, 64))


def test_ring_layout_check():
    # sp is bounded by the heads only through U = sp / R
    assert Layout.resolve(8, 8, ring_size=4, num_heads=2, seq_len=64).dp == 1
    with pytest.raises(LayoutError, match=r"ulysses=4 \(sp / ring\) does not divide the 2"):
        Layout(sp=8, ring_size=2).check(num_heads=2, seq_len=64)
    with pytest.raises(LayoutError, match=r"2·sp=8 .* sequence of 36 tokens"):
        Layout(sp=4, ring_size=2).check(num_heads=4, seq_len=36)
    with pytest.raises(LayoutError, match="ring=3 does not divide sp=4"):
        Layout(sp=4, ring_size=3)
    assert valid_sp_sizes(num_heads=2, seq_len=64, ring=2) == [2, 4]
    assert valid_sp_sizes(num_heads=2, seq_len=64, world=8, ring=4) == [4, 8]
    with pytest.raises(ValueError, match="parallel.ring"):
        ParallelConfig(sp=4, ring=3)


def test_verify_ring_cli(capsys):
    """`ulysses-mm verify --sp 4 --ring 2` with 2 heads (sp beyond the heads) passes and
    prints the ring's bytes against theory and the per-rank work; a ring the sequence
    cannot take is refused in one line before any process starts."""
    from ulysses_mm.cli import main

    args = ["verify", "--sp", "4", "--ring", "2", "--seq-len", "64"]
    heads = ["model.num_attention_heads=2", "model.num_key_value_heads=1"]
    assert main([*args, *heads, "model.hidden_size=32", "model.num_hidden_layers=1"]) == 0
    out = capsys.readouterr().out
    assert "dp=1 × sp=4 (ulysses 2 × ring 2)" in out and "PASS" in out
    fwd = next(line for line in out.splitlines() if "forward  measured" in line).split()
    assert fwd[2] == fwd[-1]  # measured == theory
    assert "unmasked query-key pairs per ring rank" in out
    assert main(["verify", "--sp", "4", "--ring", "2", "--seq-len", "36"]) == 2
    assert "2·sp=8" in capsys.readouterr().err


def _engine_ring(rank, world):
    # as training builds it: open_world → Mesh.build(ring) → apply_ulysses → DeepSpeed
    # ZeRO-2, Setup.slice_of slices the zigzag layout
    from deepspeed.utils import safe_get_full_grad
    from test_engine import SPACE, _cfg, _engine_backward, _reference_grads, _setup

    cfg = _cfg(2)
    cfg.parallel.ring = world
    setup = _setup(cfg, world)
    assert setup.mesh.ring_size == world
    b = random_batch(SPACE, 1, 128, seed=10)
    want_losses, want = _reference_grads(cfg, [b])
    report = _engine_backward(setup.engine, setup.slice_of(b), setup.mesh)
    for name, p in setup.engine.module.named_parameters():
        assert_close(safe_get_full_grad(p), want[name], rtol=1e-4, atol=1e-6)
    assert report.total == pytest.approx(want_losses[0], rel=1e-6)
    setup.engine.step()


def test_ring_through_the_runtime_and_deepspeed():
    run_distributed(_engine_ring, 2, timeout=200)
