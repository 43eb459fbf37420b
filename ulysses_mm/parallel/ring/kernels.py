"""The block kernels of ring attention: a block's varlen calls forward and backward, with
its log-sum-exp, and the merge of partial outputs through it.

:class:`FlashBlockKernel` runs each call as flash-attn's ``_flash_attn_varlen_forward/backward``
(CUDA, bf16/fp16; at most ``FLASH_MAX_DOCS`` segments a call); :class:`TorchBlockKernel` runs
the same segments as masked dense products with the exact LSE (fp32), one row's queries
at a time, wherever flash-attn does not.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from ulysses_mm.model.attention import FLASH_MAX_DOCS
from ulysses_mm.parallel.ring.plan import VarlenCall


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """(out [b, nq, h, d], lse [b, h, nq]) of q against one k/v block under ``allowed``;
    rows with no allowed key get out 0 and lse −inf."""
    rep = q.shape[2] // k.shape[2]
    kr = k.repeat_interleave(rep, dim=2) if rep > 1 else k
    vr = v.repeat_interleave(rep, dim=2) if rep > 1 else v
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [b, h, nq]
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, vr)
    return out, lse


def _block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    scale: float,
    lse: Tensor,
    dout: Tensor,
    delta: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block, given the FINAL lse [b, h, nq] and delta = rowsum(dO·O)."""
    rep = q.shape[2] // k.shape[2]
    kr = k.repeat_interleave(rep, dim=2) if rep > 1 else k
    vr = v.repeat_interleave(rep, dim=2) if rep > 1 else v
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.exp(s - lse[..., None])  # [b, h, nq, nk]
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vr)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    if rep > 1:
        b, nk, _, d = dk.shape
        dk = dk.view(b, nk, k.shape[2], rep, d).sum(3)
        dv = dv.view(b, nk, k.shape[2], rep, d).sum(3)
    return dq, dk, dv


class BlockKernel:
    """A varlen block kernel: a call cut into pieces (:meth:`VarlenCall.pieces`,
    within the kernel's ``limits``), each run by ``piece_forward`` / ``piece_backward``."""

    name = ""

    @classmethod
    def limits(cls, g: VarlenCall) -> tuple[int, int]:
        """(most queries, most segments) of one call; 0: no bound."""
        raise NotImplementedError

    @classmethod
    def piece_forward(
        cls, q: Tensor, k: Tensor, v: Tensor, g: VarlenCall, scale: float
    ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    @classmethod
    def piece_backward(
        cls,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        g: VarlenCall,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    @classmethod
    def forward(
        cls, q: Tensor, k: Tensor, v: Tensor, g: VarlenCall, scale: float
    ) -> tuple[Tensor, Tensor]:
        """(out [Tq, h, d] fp32, lse [Tq, h]) of the call.s gathered rows."""
        out = q.new_empty(q.shape, dtype=torch.float32)
        lse = q.new_empty(q.shape[:2], dtype=torch.float32)
        for qs, ks, piece in g.pieces(*cls.limits(g)):
            out[qs], lse[qs] = cls.piece_forward(q[qs], k[ks], v[ks], piece, scale)
        return out, lse

    @classmethod
    def backward(
        cls,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        g: VarlenCall,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) fp32 of the call ``g``, from the FINAL out and lse [Tq, h] of its rows
        (a key row may serve several pieces: its gradients add up)."""
        dq = q.new_empty(q.shape, dtype=torch.float32)
        dk = k.new_zeros(k.shape, dtype=torch.float32)
        dv = v.new_zeros(v.shape, dtype=torch.float32)
        for qs, ks, p in g.pieces(*cls.limits(g)):
            dq[qs], dk_p, dv_p = cls.piece_backward(
                dout[qs], q[qs], k[ks], v[ks], out[qs], lse[qs], p, scale
            )
            dk[ks] += dk_p
            dv[ks] += dv_p
        return dq, dk, dv


class TorchBlockKernel(BlockKernel):
    """The PyTorch block kernel: masked dense products (fp32), one per piece of at most one
    row's queries, so its scores are [h, ≤ n, ≤ n] whatever the batch."""

    name = "torch"

    @classmethod
    def limits(cls, g: VarlenCall) -> tuple[int, int]:
        return g.cap, 0

    @classmethod
    def piece_forward(
        cls, q: Tensor, k: Tensor, v: Tensor, g: VarlenCall, scale: float
    ) -> tuple[Tensor, Tensor]:
        o, lse = _block_forward(
            q.float()[None], k.float()[None], v.float()[None], g.allowed()[None], scale
        )
        return o[0], lse[0].T

    @classmethod
    def piece_backward(
        cls,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        g: VarlenCall,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        do = dout.float()
        delta = (do * out.float()).sum(-1)  # [tq, h]
        dq, dk, dv = _block_backward(
            q.float()[None],
            k.float()[None],
            v.float()[None],
            g.allowed()[None],
            scale,
            lse.T[None],
            do[None],
            delta.T[None],
        )
        return dq[0], dk[0], dv[0]


def _call(fn: Any, **kw: Any) -> Any:
    """Call a flash-attn internal by keyword, across its versions: ``window_size`` is one
    tuple before 2.7 and two ints from 2.7; arguments a version lacks are dropped."""
    target = getattr(fn, "_init_fn", fn)  # 2.7 wraps them as torch custom ops
    params = inspect.signature(target).parameters
    if "window_size" in params:
        kw["window_size"] = (-1, -1)
    else:
        kw["window_size_left"], kw["window_size_right"] = -1, -1
    return fn(**{k: v for k, v in kw.items() if k in params})


class FlashBlockKernel(BlockKernel):
    """flash-attn's varlen forward/backward with the LSE (CUDA, bf16/fp16), one call per
    ``FLASH_MAX_DOCS`` segments."""

    name = "flash_varlen"

    @classmethod
    def limits(cls, g: VarlenCall) -> tuple[int, int]:
        return 0, FLASH_MAX_DOCS

    @classmethod
    def piece_forward(
        cls, q: Tensor, k: Tensor, v: Tensor, g: VarlenCall, scale: float
    ) -> tuple[Tensor, Tensor]:
        from flash_attn.flash_attn_interface import (
            _flash_attn_varlen_forward,  # lazy: optional (flash_attn)
        )

        res = _call(
            _flash_attn_varlen_forward,
            q=q.contiguous(),
            k=k.contiguous(),
            v=v.contiguous(),
            cu_seqlens_q=g.cu_q,
            cu_seqlens_k=g.cu_k,
            max_seqlen_q=g.max_q,
            max_seqlen_k=g.max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=g.causal,
            softcap=0.0,
            alibi_slopes=None,
            return_softmax=False,
        )
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])  # 2.7 | 2.5–2.6
        if lse.dim() != 2 or lse.shape[1] != q.shape[0]:
            raise RuntimeError(
                f"flash-attn returned a padded LSE {tuple(lse.shape)}; ring attention needs "
                "flash-attn >= 2.5 (LSE [heads, total tokens])"
            )
        return out.float(), lse.T.float()

    @classmethod
    def piece_backward(
        cls,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        g: VarlenCall,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        from flash_attn.flash_attn_interface import (
            _flash_attn_varlen_backward,  # lazy: optional (flash_attn)
        )

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call(
            _flash_attn_varlen_backward,
            dout=dout.to(q.dtype).contiguous(),
            q=q,
            k=k,
            v=v,
            out=out.to(q.dtype).contiguous(),
            softmax_lse=lse.T.float().contiguous(),
            dq=dq,
            dk=dk,
            dv=dv,
            cu_seqlens_q=g.cu_q,
            cu_seqlens_k=g.cu_k,
            max_seqlen_q=g.max_q,
            max_seqlen_k=g.max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=g.causal,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=None,
        )
        return dq.float(), dk.float(), dv.float()


def block_forward(
    kernel: type[BlockKernel],
    qf: Tensor,
    kf: Tensor,
    vf: Tensor,
    calls: list[VarlenCall],
    scale: float,
) -> tuple[Tensor, Tensor]:
    """(out [T, h, d] fp32, lse [T, h]) of flat queries ``qf`` against one flat key block;
    queries in no call get 0 and −inf."""
    out = qf.new_zeros(qf.shape, dtype=torch.float32)
    lse = qf.new_full(qf.shape[:2], float("-inf"), dtype=torch.float32)
    for g in calls:
        o, l_ = kernel.forward(qf[g.q_sel], kf[g.k_sel], vf[g.k_sel], g, scale)
        out[g.q_sel] = o
        lse[g.q_sel] = l_
    return out, lse


def merge(out: Tensor, lse: Tensor, o_b: Tensor, l_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge a block's partial (out [T, h, d], lse [T, h]) into the running one."""
    new = torch.logaddexp(lse, l_b)
    safe = torch.where(torch.isinf(new), 0.0, new)
    return out * torch.exp(lse - safe)[..., None] + o_b * torch.exp(l_b - safe)[..., None], new
