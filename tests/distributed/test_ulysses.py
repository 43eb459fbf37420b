"""Ulysses on real gloo process groups against a single-process reference.

Every check compares outputs AND gradients with ``torch.testing.assert_close`` (fp32,
tight tolerances): the attention wrapper alone, and the whole model with packed documents,
GQA/MQA with fewer kv heads than P, and dp × sp.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo import run_distributed
from torch.testing import assert_close

from ulysses_mm.config import ModelConfig
from ulysses_mm.core.layout import Layout, valid_sp_sizes
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.batch import Batch
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import apply_memory_policy, build_model
from ulysses_mm.model.attention import DocumentMask, LocalAttention
from ulysses_mm.parallel import (
    CommStats,
    Mesh,
    UlyssesAttention,
    apply_loss_balance,
    apply_ulysses,
    loss_weights,
)
from ulysses_mm.parallel.slice import sp_slice
from ulysses_mm.train.step import forward_backward

VOCAB = {"dna": 16, "audio": 64, "video": 96}
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)


def _loss_and_grads(model, batch: Batch, mesh: Mesh):
    weights = loss_weights(model.space.modalities, {"audio": 0.5})
    share, report = forward_backward(model, batch, weights, mesh)
    return share, report, {n: p.grad.clone() for n, p in model.named_parameters()}


def _model_parity(rank, world, sp, model_kw, seq_len, micro_batch, kernel, before=None):
    """``before``: (sp, ring) of a layout applied first and replaced (a staged run)."""
    dp = world // sp
    first = Mesh.build(before[0], world // before[0], before[1]) if before else None
    mesh = Mesh.build(sp, dp)
    cfg = ModelConfig(modalities=VOCAB, **model_kw)
    space = TokenSpace.from_vocab(VOCAB)
    batch = random_batch(space, dp * micro_batch, seq_len, seed=3, min_doc=3)
    assert len(torch.unique(batch.doc_ids[0])) > 4, "want several packed documents"

    ref = build_model(cfg, space, kernel, seed=11)
    apply_memory_policy(ref, cfg)
    _, ref_report, ref_grads = _loss_and_grads(ref, batch, Mesh.single())

    model = build_model(cfg, space, kernel, seed=11)
    apply_memory_policy(model, cfg)
    if first is not None:
        apply_ulysses(model, first, head_groups=2)
        apply_loss_balance(model, first)
    apply_ulysses(model, mesh)
    apply_loss_balance(model, mesh)
    local = sp_slice(
        batch.rows(mesh.dp_rank * micro_batch, (mesh.dp_rank + 1) * micro_batch), mesh.sp_rank, sp
    )
    share, report, grads = _loss_and_grads(model, local, mesh)

    # the shares of all ranks add up to the single-process loss
    total = share.detach().clone()
    dist.all_reduce(total)
    assert_close(total, torch.tensor(ref_report.total), rtol=1e-6, atol=1e-6)
    assert report.total == pytest.approx(ref_report.total, rel=1e-6)
    assert report.counts == ref_report.counts
    for name, g in grads.items():
        dist.all_reduce(g)
        assert_close(g, ref_grads[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
    return report.total


@pytest.mark.parametrize(
    "world,sp,model_kw",
    [
        pytest.param(2, 2, dict(num_attention_heads=4, num_key_value_heads=4), id="sp2-mha"),
        pytest.param(4, 4, dict(num_attention_heads=4, num_key_value_heads=1), id="sp4-mqa-kv1<P"),
        pytest.param(
            4,
            4,
            dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=64),
            id="sp4-gqa-kv2<P",
        ),
        pytest.param(4, 2, dict(num_attention_heads=4, num_key_value_heads=2), id="dp2xsp2"),
        pytest.param(
            2,
            2,
            dict(
                num_attention_heads=6,
                num_key_value_heads=3,
                hidden_size=48,
                activation_checkpointing=True,
                mlp_tile_tokens=40,
                loss_tile_tokens=33,
            ),
            id="sp2-kv3-ckpt-tiled",
        ),
        pytest.param(
            4,
            4,
            dict(
                num_key_value_heads=2,
                rope=dict(kind="yarn", factor=8.0, original_max_position_embeddings=8),
            ),
            id="sp4-rope-yarn",
        ),
    ],
)
def test_model_matches_single_process(world, sp, model_kw):
    totals = run_distributed(_model_parity, world, sp, model_kw, 192, 1, "sdpa_varlen")
    assert len(set(totals)) == 1  # every rank reports the same global loss


def test_dynamic_rope_sees_the_whole_sequences_length():
    """Dynamic NTK rescales by the longest position + 1 of the sequence: at 160 tokens
    rank 0's slice reaches position 27 and rank 1's 32, and both must rescale by 33."""
    kw = dict(rope=dict(kind="dynamic", factor=4.0), max_position_embeddings=8)
    totals = run_distributed(_model_parity, 2, 2, kw, 160, 1, "sdpa_varlen")
    assert len(set(totals)) == 1


def test_a_model_laid_out_again_matches_single_process():
    """Laid out as sp 4 = 2 Ulysses × 2 ring in head groups, then as dp 2 × sp 2 (a run
    moving to its next stage): the second layout replaces the first entirely."""
    kw = dict(num_attention_heads=4, num_key_value_heads=2)
    totals = run_distributed(_model_parity, 4, 2, kw, 192, 1, "sdpa_varlen", (4, 2))
    assert len(set(totals)) == 1


def test_model_matches_single_process_dense_kernel_batch2():
    run_distributed(_model_parity, 2, 2, dict(num_key_value_heads=1), 128, 2, "sdpa_dense")


def _attention_parity(rank, world, shapes, kernel):
    mesh = Mesh.build(world)
    for b, s, hq, hk, d in shapes:
        g = torch.Generator().manual_seed(100 + hq * 10 + hk)
        q = torch.randn(b, s, hq, d, generator=g)
        k = torch.randn(b, s, hk, d, generator=g)
        v = torch.randn(b, s, hk, d, generator=g)
        doc = torch.cumsum(torch.rand(b, s, generator=g) < 0.08, dim=1)
        grad_out = torch.randn(b, s, hq, d, generator=g)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = LocalAttention(kernel)(*ref_in, DocumentMask(doc))
        ref.backward(grad_out)

        n = s // world
        sl = slice(rank * n, (rank + 1) * n)
        local_in = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
        stats = CommStats()
        attn = UlyssesAttention(LocalAttention(kernel), mesh.sp_group, hq, hk, stats)
        out = attn(*local_in, DocumentMask(doc))
        out.backward(grad_out[:, sl])
        assert_close(out, ref[:, sl], rtol=1e-5, atol=1e-6)
        for got, want in zip(local_in, ref_in):
            assert_close(got.grad, want.grad[:, sl], rtol=1e-5, atol=1e-6)
        # one packed exchange in, one out, each way; bytes as theory says
        e = attn.kv_expanded
        sent = b * n * (2 * hq + 2 * e) * d * 4 * (world - 1) // world
        assert stats.forward_calls == 2 and stats.backward_calls == 2
        assert stats.forward_bytes == sent and stats.backward_bytes == sent


@pytest.mark.parametrize("kernel", ["sdpa_varlen", "sdpa_dense"])
def test_attention_matches_local_sp2(kernel):
    shapes = [(1, 64, 4, 4, 8), (2, 48, 4, 1, 8), (1, 32, 6, 3, 4), (1, 40, 2, 2, 16)]
    run_distributed(_attention_parity, 2, shapes, kernel)


def test_attention_matches_local_sp4():
    shapes = [(1, 64, 8, 8, 8), (1, 64, 4, 1, 8), (2, 32, 8, 2, 4), (1, 48, 12, 6, 4)]
    run_distributed(_attention_parity, 4, shapes, "sdpa_varlen")


def _bad_shapes(rank, world):
    mesh = Mesh.build(world)
    messages = []
    model = build_model(
        ModelConfig(modalities=VOCAB, num_attention_heads=6, num_key_value_heads=6, hidden_size=48),
        seed=0,
    )
    try:
        apply_ulysses(model, mesh)
    except ValueError as e:
        messages.append(str(e))
    attn = UlyssesAttention(LocalAttention(), mesh.sp_group, 4, 4)
    q = torch.randn(1, 8, 4, 8)
    try:  # this rank holds 8 tokens but the mask says the sequence has 30
        attn(q, q, q, DocumentMask(torch.zeros(1, 30, dtype=torch.long)))
    except ValueError as e:
        messages.append(str(e))
    dist.barrier()  # every rank got here: nobody is stuck inside a collective
    return messages


def test_bad_shapes_fail_before_any_collective():
    for msgs in run_distributed(_bad_shapes, 4, timeout=120):
        assert len(msgs) == 2
        assert "sp=4 does not divide the 6 query heads" in msgs[0] and "[1, 2, 3, 6]" in msgs[0]
        assert "30 tokens cannot be split evenly over sp=4" in msgs[1]
        assert "[1, 2]" in msgs[1]


def test_layout_check_lists_what_works():
    Layout(sp=4).check(num_heads=8, seq_len=1024)
    with pytest.raises(ValueError, match=r"sp=3 does not divide the 8 query heads.*\[1, 2, 4, 8\]"):
        Layout(sp=3).check(num_heads=8, seq_len=1024)
    with pytest.raises(ValueError, match=r"sequence of 1000 tokens.*\[1, 2, 4, 8\]"):
        Layout(sp=16).check(num_heads=8, seq_len=1000)
    with pytest.raises(ValueError, match=r"sequence of 1001 tokens.*\[1\]"):
        Layout(sp=2).check(num_heads=8, seq_len=1001)
    # the world: sp must divide it and dp × sp fill it; dp 0 resolves to world / sp
    assert Layout.resolve(8, 2, num_heads=8) == Layout(dp=4, sp=2)
    with pytest.raises(
        ValueError, match=r"sp=4 does not divide the world of 6 processes.*\[1, 2\]"
    ):
        Layout.resolve(6, 4, num_heads=8)
    with pytest.raises(ValueError, match=r"dp=3 × sp=2 = 6 but the world has 4 processes"):
        Layout.resolve(4, 2, dp=3)
    # kv heads never limit sp (they are replicated), but must divide the query heads
    assert Layout.resolve(8, 8, num_heads=8, num_kv_heads=1).dp == 1
    with pytest.raises(ValueError, match="not a multiple of the 3 key/value heads"):
        Layout(sp=2).check(num_heads=8, num_kv_heads=3)
    assert valid_sp_sizes(num_heads=32, seq_len=96, world=6) == [1, 2]
    assert valid_sp_sizes(num_heads=12) == [1, 2, 3, 4, 6, 12]


def _shift_after_slice_loses_targets(rank, world):
    # Counter-check: slicing BEFORE shifting drops the label at every slice boundary, so the
    # counts (and the loss) would differ from one process. Ours shifts first.
    space = TokenSpace.from_vocab(VOCAB)
    batch = random_batch(space, 1, 64, seed=5, pad_tail=False, min_doc=40)
    local = sp_slice(batch, rank, world)
    kept = torch.tensor(float(local.num_targets))
    dist.all_reduce(kept)
    return int(kept), batch.num_targets, int(local.labels[0, -1])


def test_labels_shifted_before_slicing():
    results = run_distributed(_shift_after_slice_loses_targets, 2)
    for kept, total, _ in results:
        assert kept == total
    # rank 0's last token predicts rank 1's first one: the label is kept (not ignored)
    assert results[0][2] != -100
