"""Attention in head groups (``parallel.head_groups``) changes no number.

For C in {2, 4}: the attention alone (outputs and q, k, v gradients against one local
kernel over the whole sequence, fp32) and the whole model (loss and every parameter
gradient against the same layout at C = 1) at SP 1, 2 and 4, with a ring of 2 ((U, R) =
(1, 2) and (2, 2)), MHA, GQA and MQA (kv heads split over the groups, shared by several
groups, or replicated for Ulysses), packed documents on every CPU kernel (sdpa_varlen,
sdpa_dense, and flex without gradients), with layer tiles, activation checkpointing and
checkpoints offloaded to the host, and through the DeepSpeed engine. SP=1 runs in this
process; every other layout runs in ONE gloo world of 4 (dp × sp meshes built inside it).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo import run_distributed
from torch.testing import assert_close

from ulysses_mm.config import ModelConfig, RunConfig, load_config
from ulysses_mm.core.layout import Layout, LayoutError, valid_head_groups
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import Offload, apply_memory_policy, build_model
from ulysses_mm.model.attention import DocumentMask, LocalAttention
from ulysses_mm.parallel import (
    CommStats,
    Mesh,
    UlyssesAttention,
    apply_loss_balance,
    apply_ulysses,
    loss_weights,
)
from ulysses_mm.parallel.head_groups import HeadGroups, exchange_heads
from ulysses_mm.parallel.slice import sp_slice
from ulysses_mm.train.step import forward_backward

VOCAB = {"dna": 16, "audio": 64, "video": 96}
SPACE = TokenSpace.from_vocab(VOCAB)
TOL = dict(rtol=1e-5, atol=1e-6)
# 16 query heads: C = 4 leaves one or more per group at U = 4
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=16)
MODES = dict(
    activation_checkpointing=True,
    offload_checkpoints=True,
    layer_tile_tokens=16,
    loss_tile_tokens=40,
)


def _attention(q, k, v, doc, kernel, group, chunks, rank, world, stats=None):
    """Outputs and input gradients of this rank's slice through UlyssesAttention."""
    n = q.shape[1] // world
    sl = slice(rank * n, (rank + 1) * n)
    ins = [t[:, sl].clone().requires_grad_(torch.is_grad_enabled()) for t in (q, k, v)]
    hq, hk = q.shape[2], k.shape[2]
    attn = UlyssesAttention(LocalAttention(kernel), group, hq, hk, stats, head_groups=chunks)
    out = attn(*ins, DocumentMask(doc))
    if not out.requires_grad:
        return out, []
    g = torch.Generator().manual_seed(7)
    grad = torch.randn(q.shape, generator=g)[:, sl]
    kept = grad.clone()
    out.backward(grad)
    assert torch.equal(grad, kept)  # the caller's gradient is read, never written
    return out, [t.grad for t in ins]


ATTENTION_SHAPES = [
    # b, s, hq, hk, d, C: kv split over groups, shared by groups, replicated for Ulysses
    (1, 64, 8, 8, 8, 2),
    (1, 64, 16, 2, 4, 4),
    (2, 48, 16, 4, 4, 2),
    (1, 48, 16, 1, 4, 4),
]


def _attention_cases(rank, world, group, flex: bool = False):
    for i, (b, s, hq, hk, d, chunks) in enumerate(ATTENTION_SHAPES):
        g = torch.Generator().manual_seed(hq * 10 + hk)
        q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hk, hk))
        doc = torch.cumsum(torch.rand(b, s, generator=g) < 0.08, dim=1)
        for kernel in ("sdpa_varlen", "sdpa_dense"):
            ref, ref_grads = _attention(q, k, v, doc, kernel, None, 1, 0, 1)
            stats = CommStats()
            out, grads = _attention(q, k, v, doc, kernel, group, chunks, rank, world, stats)
            n = s // world
            sl = slice(rank * n, (rank + 1) * n)
            assert_close(out, ref[:, sl], **TOL)
            for got, want in zip(grads, ref_grads):
                assert_close(got, want[:, sl], **TOL)
            if world > 1:  # C exchanges each way per call, the bytes the theory says
                fwd, bwd = exchange_heads(hq, hk, world, chunks)
                per_head = b * n * d * 4 * (world - 1) // world
                assert (stats.forward_calls, stats.backward_calls) == (2 * chunks, 2 * chunks)
                assert stats.forward_bytes == fwd * per_head
                assert stats.backward_bytes == bwd * per_head
        if not flex or i:  # (eager flex on CPU is slow: one shape)
            continue
        with torch.no_grad():  # flex: no backward on CPU
            ref, _ = _attention(q, k, v, doc, "flex", None, 1, 0, 1)
            out, _ = _attention(q, k, v, doc, "flex", group, chunks, rank, world)
        assert_close(out, ref[:, slice(rank * (s // world), (rank + 1) * (s // world))], **TOL)


def _model(cfg: ModelConfig, mesh: Mesh, chunks: int, offloads: list[Offload]):
    model = build_model(cfg, SPACE, "sdpa_varlen", seed=11)
    offload = apply_memory_policy(model, cfg)
    if offload is not None:
        offloads.append(offload)
    apply_ulysses(model, mesh, head_groups=chunks)
    return apply_loss_balance(model, mesh)


def _loss_and_grads(model, batch, mesh):
    share, report = forward_backward(model, batch, loss_weights(SPACE.modalities, {}), mesh)
    return share.detach(), report, {n: p.grad.clone() for n, p in model.named_parameters()}


MODEL_CASES = [
    # (extra model fields, C values): GQA kv 4 (split or shared), MQA (replicated), modes
    (dict(num_key_value_heads=4), (2, 4)),
    (dict(num_key_value_heads=1), (4,)),
    (dict(num_key_value_heads=4, **MODES), (2,)),
]


def _model_cases(mesh: Mesh, seq_len: int = 96) -> list[str]:
    """Every MODEL_CASES case at C in its values against C = 1 on ``mesh``."""
    done = []
    offloads: list[Offload] = []
    for i, (extra, chunk_values) in enumerate(MODEL_CASES):
        cfg = ModelConfig(modalities=VOCAB, **TINY, **extra)
        batch = random_batch(SPACE, mesh.dp, seq_len, seed=5 + i, min_doc=3)
        local = sp_slice(
            batch.rows(mesh.dp_rank, mesh.dp_rank + 1), mesh.sp_rank, mesh.sp, mesh.ring_size
        )
        share0, report0, grads0 = _loss_and_grads(_model(cfg, mesh, 1, offloads), local, mesh)
        for chunks in chunk_values:
            share, report, grads = _loss_and_grads(_model(cfg, mesh, chunks, offloads), local, mesh)
            assert_close(share, share0, rtol=1e-6, atol=1e-7)
            assert report.total == pytest.approx(report0.total, rel=1e-6)
            for name, g in grads.items():
                what = f"C={chunks} {name}"
                assert_close(g, grads0[name], **TOL, msg=lambda m, w=what: f"{w}: {m}")
            done.append(f"{i}:C={chunks}")
        assert all(o.host.live == 0 for o in offloads)
    return done


def _engine_case(rank, world) -> bool:
    """C = 2 against C = 1 through the DeepSpeed engine (ZeRO-2, sp = 2 × dp = 2)."""
    from deepspeed.utils import safe_get_full_grad

    from ulysses_mm.parallel.mesh import open_world
    from ulysses_mm.train.step import build_setup

    batch = random_batch(SPACE, 2, 96, seed=9)
    out = []
    for chunks in (1, 2):
        cfg = load_config(
            RunConfig,
            None,
            [
                "model.modalities={dna: 16, audio: 64, video: 96}",
                "model.hidden_size=64",
                "model.intermediate_size=96",
                "model.num_attention_heads=8",
                "model.num_key_value_heads=2",
                "model.activation_checkpointing=true",
                "deepspeed.zero_stage=2",
                "deepspeed.gradient_clipping=0.0",
                "deepspeed.scheduler.type=none",
                "parallel.sp=2",
                f"parallel.head_groups={chunks}",
            ],
        )
        setup = build_setup(cfg, SPACE, open_world(cfg, device="cpu"))
        rows = batch.rows(setup.mesh.dp_rank, setup.mesh.dp_rank + 1)
        loss, _ = forward_backward(setup.engine, setup.slice_of(rows), setup.weights, setup.mesh)
        grads = {
            n: safe_get_full_grad(p).clone() for n, p in setup.engine.module.named_parameters()
        }
        out.append((loss, grads))
        setup.engine.destroy()
    (loss1, g1), (loss2, g2) = out
    assert_close(loss2, loss1, rtol=1e-6, atol=1e-7)
    for name in g1:
        assert_close(g2[name], g1[name], **TOL, msg=name)
    return True


def _world4(rank, world):
    results = {}
    # SP = 4
    mesh = Mesh.build(4)
    _attention_cases(mesh.sp_rank, 4, mesh.sp_group)
    results["sp4"] = _model_cases(mesh)
    # SP = 2 (× dp 2)
    mesh = Mesh.build(2, 2)
    _attention_cases(mesh.sp_rank, 2, mesh.sp_group, flex=True)
    results["sp2"] = _model_cases(mesh)
    # ring 2: (U, R) = (1, 2) under dp 2, and (2, 2)
    results["u1r2"] = _model_cases(Mesh.build(2, 2, 2))
    results["u2r2"] = _model_cases(Mesh.build(4, 1, 2))
    results["engine"] = _engine_case(rank, world)
    dist.barrier()
    return results


def test_head_groups_change_nothing_in_a_world_of_4():
    for res in run_distributed(_world4, 4, timeout=300):
        want = ["0:C=2", "0:C=4", "1:C=4", "2:C=2"]
        assert res["sp4"] == res["sp2"] == res["u1r2"] == res["u2r2"] == want
        assert res["engine"] is True


def test_head_groups_change_nothing_in_one_process():
    _attention_cases(0, 1, None)
    assert _model_cases(Mesh.single()) == ["0:C=2", "0:C=4", "1:C=4", "2:C=2"]


def test_groups_take_the_heads_their_queries_read():
    # U = 2, 16 query / 4 kv heads: e/U = 2 kv heads per rank, C = 2 splits them
    g = HeadGroups(2, 16, 4, 4, 2)
    assert (g.hg, g.eg, g.kv_slots, g.kv_shared) == (4, 1, [(0, 1), (1, 2)], False)
    # C = 4: each group reads one kv head (a view), shared with the next group
    g = HeadGroups(2, 16, 4, 4, 4)
    assert g.hg == 2 and g.kv_slots == [(0, 1), (0, 1), (1, 2), (1, 2)] and g.kv_shared
    assert g.kv_index == [None] * 4
    # MQA at U = 4: the one kv head replicated to 4 (gathered by index), read by both groups
    g = HeadGroups(4, 16, 1, 4, 2)
    assert [t.tolist() for t in g.kv_index] == [[0, 0, 0, 0], [0, 0, 0, 0]]
    # every query head of group g reads a kv head of group g (the kernel's GQA mapping)
    q = torch.arange(16.0).view(1, 1, 16, 1)
    k = torch.arange(4.0).view(1, 1, 4, 1)
    g = HeadGroups(2, 16, 4, 4, 4)
    for c in range(4):
        qh = g.q_part(q, c).reshape(-1).tolist()  # [U × hg] query heads
        kh = g.kv_part(k, c).reshape(-1).tolist()  # [U × eg] their kv heads
        assert [int(h) // 4 for h in qh] == [int(kh[j]) for j in range(2) for _ in range(2)]
    # a shared head's gradient is the sum of its groups'
    dk = torch.zeros(1, 1, 4, 1)
    for c in range(4):
        g.kv_add(dk, torch.ones(1, 1, 2, 1, 1), c)
    assert dk.flatten().tolist() == [2.0, 2.0, 2.0, 2.0]


def test_layout_refuses_head_groups_that_do_not_split_the_heads():
    assert valid_head_groups(32, 8, 8) == [1, 2, 4]
    assert valid_head_groups(32, 8, 1) == [1, 2, 4, 8, 16, 32]
    assert valid_head_groups(12, 4, 1) == [1, 2, 4, 12]  # 3, 6: a group would straddle
    Layout(sp=8, head_groups=4).check(num_heads=32, num_kv_heads=8)
    with pytest.raises(
        LayoutError, match=r"head_groups=8 does not split the 4 query heads .*\[1, 2, 4\]"
    ):
        Layout(sp=8, head_groups=8).check(num_heads=32, num_kv_heads=8)
    # with a ring, the groups split the heads of a Ulysses rank (U = sp / R)
    Layout(sp=8, ring_size=2, head_groups=8).check(num_heads=32, num_kv_heads=8, seq_len=64)
    cfg = load_config(RunConfig, None, ["parallel.head_groups=3"])
    m = cfg.model
    with pytest.raises(LayoutError, match="head_groups=3"):
        Layout.from_config(cfg.parallel, 1).check(m.num_attention_heads, m.num_key_value_heads)
