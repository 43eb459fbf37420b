"""Ring attention's block kernel in one process: the varlen tiles of every (query rank,
key rank) pair, merged through their LSE, equal dense attention in the ring layout; and
the flash-attn path's plumbing (keyword names across versions, LSE layout, the final
out/LSE in backward) against a stand-in with flash-attn's varlen semantics (segments,
causal aligned bottom-right), since CI has no GPU."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from torch.testing import assert_close

from ulysses_mm.loader.synthetic import packed_doc_ids
from ulysses_mm.model.attention import DocumentMask, LocalAttention
from ulysses_mm.parallel.ring import (
    FlashBlockKernel,
    RingPlan,
    TorchBlockKernel,
    block_forward,
    merge,
)
from ulysses_mm.parallel.ring import kernels as ring_kernels
from ulysses_mm.parallel.slice import _allowed


def _ring_forward(kernel, q, k, v, plan, ring):
    """Every ring rank's output, as the ring computes it: its blocks merged by LSE."""
    h, d = q.shape[2:]
    outs = []
    for j in range(ring):
        qf = q.gather(1, plan.idx[j][..., None, None].expand(-1, -1, h, d)).reshape(-1, h, d)
        out = torch.zeros(qf.shape)
        lse = torch.full(qf.shape[:2], float("-inf"))
        for src in range(ring):
            sel = plan.idx[src][..., None, None].expand(-1, -1, k.shape[2], d)
            kf, vf = (t.gather(1, sel).reshape(-1, k.shape[2], d) for t in (k, v))
            o_b, l_b = block_forward(kernel, qf, kf, vf, plan.block(j, src), 1 / math.sqrt(d))
            out, lse = merge(out, lse, o_b, l_b)
        outs.append((out, lse))
    return outs


@pytest.mark.parametrize(
    ("ring", "mean", "heads"), [(2, 20, (4, 4)), (4, 7, (4, 2)), (4, 300, (2, 1))]
)
def test_tiles_merged_equal_dense_attention(ring, mean, heads):
    b, n, d = 2, 256, 8
    h, hk = heads
    doc = packed_doc_ids(b, n, mean, seed=ring + mean)
    mask = DocumentMask(doc)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, n, h, d, generator=g)
    k, v = (torch.randn(b, n, hk, d, generator=g) for _ in range(2))
    ref = LocalAttention("sdpa_dense")(q, k, v, mask)
    plan = RingPlan.of(mask, ring)
    docs = mask.doc_index
    cut = []
    for j, (out, _) in enumerate(_ring_forward(TorchBlockKernel, q, k, v, plan, ring)):
        want = ref.gather(1, plan.idx[j][..., None, None].expand(-1, -1, h, d))
        assert_close(out.view(b, -1, h, d), want, rtol=1e-5, atol=1e-6)
        # the tiles compute exactly the allowed pairs, no more
        for src in range(ring):
            allowed = _allowed(
                plan.idx[j],
                docs.gather(1, plan.idx[j]),
                plan.idx[src],
                docs.gather(1, plan.idx[src]),
            )
            assert sum(t.pairs for t in plan.block(j, src)) == int(allowed.sum())
            # the dense kernel works a row's worth of queries at a time, not b rows at once
            for grp in plan.block(j, src):
                assert all(qs.stop - qs.start <= n // ring for qs, _, _ in grp.pieces(grp.cap))
                cut.append(len(grp.pieces(grp.cap)))
    assert max(cut) > 1


def test_tiles_of_one_document_are_one_call_per_block():
    # the zigzag blocks of one document: the own block is one causal call, the others one
    # full call (or nothing): no fragmentation into many small segments
    plan = RingPlan.of(DocumentMask(torch.zeros(1, 64, dtype=torch.long)), 4)
    for j in range(4):
        for src in range(4):
            groups = plan.block(j, src)
            assert len(groups) == 1
            assert groups[0].causal == (j == src)
            assert len(groups[0].cu_q) == 2


# --- a stand-in for flash_attn.flash_attn_interface (fp32, loops over segments) ---------


def _segments(cu_q, cu_k):
    return list(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()))


def _probs(q, k, scale, causal, lse=None):
    rep = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(rep, 1)) * scale
    lq, lk = q.shape[0], k.shape[0]
    if causal:  # flash-attn: aligned bottom-right
        ok = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        s = s.masked_fill(~ok, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]), lse, rep


def _fwd_27(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
            seqused_k=None, zero_tensors=False):  # fmt: skip
    assert (window_size_left, window_size_right, dropout_p, softcap) == (-1, -1, 0.0, 0.0)
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[1], q.shape[0])
    for q0, q1, k0, k1 in _segments(cu_seqlens_q, cu_seqlens_k):
        assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
        p, l_, rep = _probs(q[q0:q1], k[k0:k1], softmax_scale, causal)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v[k0:k1].float().repeat_interleave(rep, 1))
        lse[:, q0:q1] = l_
    return out, lse, None, None


def _bwd_27(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
            window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
            zero_tensors=False):  # fmt: skip
    dq.zero_(), dk.zero_(), dv.zero_()
    for q0, q1, k0, k1 in _segments(cu_seqlens_q, cu_seqlens_k):
        p, _, rep = _probs(q[q0:q1], k[k0:k1], softmax_scale, causal, softmax_lse[:, q0:q1])
        do, o = dout[q0:q1].float(), out[q0:q1].float()
        kr, vr = (t[k0:k1].float().repeat_interleave(rep, 1) for t in (k, v))
        dvr = torch.einsum("hqk,qhd->khd", p, do)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vr) - (do * o).sum(-1).T[..., None])
        dq[q0:q1] += torch.einsum("hqk,khd->qhd", ds, kr) * softmax_scale
        dkr = torch.einsum("hqk,qhd->khd", ds, q[q0:q1].float()) * softmax_scale
        hk = k.shape[1]
        dk[k0:k1] += dkr.view(k1 - k0, hk, rep, -1).sum(2)
        dv[k0:k1] += dvr.view(k1 - k0, hk, rep, -1).sum(2)
    return dq, dk, dv, None


def _fwd_26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
            return_softmax=False, block_table=None):  # fmt: skip
    assert window_size == (-1, -1)
    out, lse, _, _ = _fwd_27(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p, softmax_scale, causal)  # fmt: skip
    return out, q, k, v, out, lse, None, None


def _bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
            alibi_slopes, deterministic, rng_state=None):  # fmt: skip
    assert window_size == (-1, -1)
    return _bwd_27(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, -1, -1, softcap,
                   alibi_slopes, deterministic)  # fmt: skip


@pytest.mark.parametrize(("version", "max_docs"), [("2.6", 65_535), ("2.7", 65_535), ("2.7", 2)])
def test_flash_path_matches_the_torch_kernel(monkeypatch, version, max_docs):
    # max_docs: flash-attn takes at most 65,535 segments per call; 2 cuts every call
    monkeypatch.setattr(ring_kernels, "FLASH_MAX_DOCS", max_docs)
    fwd, bwd = (_fwd_26, _bwd_26) if version == "2.6" else (_fwd_27, _bwd_27)
    pkg = types.ModuleType("flash_attn")
    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_varlen_forward, mod._flash_attn_varlen_backward = fwd, bwd
    pkg.flash_attn_interface = mod
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)
    b, n, h, hk, d, ring = 2, 128, 4, 2, 8, 4
    mask = DocumentMask(packed_doc_ids(b, n, 25, seed=7))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, n, h, d, generator=g)
    k, v = (torch.randn(b, n, hk, d, generator=g) for _ in range(2))
    plan = RingPlan.of(mask, ring)
    want = _ring_forward(TorchBlockKernel, q, k, v, plan, ring)
    got = _ring_forward(FlashBlockKernel, q, k, v, plan, ring)
    scale = 1 / math.sqrt(d)
    for j, ((o_w, l_w), (o_g, l_g)) in enumerate(zip(want, got)):
        assert_close(o_g, o_w, rtol=1e-5, atol=1e-6)
        assert_close(l_g, l_w, rtol=1e-5, atol=1e-6)
        qf = q.gather(1, plan.idx[j][..., None, None].expand(-1, -1, h, d)).reshape(-1, h, d)
        dout = torch.randn(qf.shape, generator=g)
        for src in range(ring):
            sel = plan.idx[src][..., None, None].expand(-1, -1, hk, d)
            kf, vf = (t.gather(1, sel).reshape(-1, hk, d) for t in (k, v))
            for grp in plan.block(j, src):
                args = (dout[grp.q_sel], qf[grp.q_sel], kf[grp.k_sel], vf[grp.k_sel],
                        o_w[grp.q_sel], l_w[grp.q_sel], grp, scale)  # fmt: skip
                for a, w in zip(FlashBlockKernel.backward(*args), TorchBlockKernel.backward(*args)):
                    assert_close(a, w, rtol=1e-5, atol=1e-5)
