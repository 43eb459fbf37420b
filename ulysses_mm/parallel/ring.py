"""Ring attention over packed documents, the R axis of hybrid Ulysses × ring.

Layout: every rank keeps its tokens in the document zigzag of
:func:`ulysses_mm.parallel.slice.ring_order` (causal load balance); after the Ulysses
all-to-all, ring rank j sees its N/R tokens on H/U heads.

Forward: each ring rank computes attention of its queries against its own K/V block, then
R−1 times receives the previous rank's block (the next one already in flight while the
current one is computed: isend/irecv) and merges the partial outputs through their
log-sum-exp. A block where no query may see any key (another document, or the future) is
skipped. Backward: the K/V blocks travel the ring again in the same order; dQ accumulates
locally, dK/dV accumulate on a buffer that travels with its block and arrives home after
R hops.

Block kernel: because every rank keeps its tokens in global order, the keys a query may
see in a block are one contiguous run of that block (its document's keys up to its
position). :func:`block_tiles` cuts a (query block, key block) pair into varlen segments
that are either full (every query of the segment sees the same keys) or causal aligned
bottom-right (each next query sees one key more): exactly flash-attn's varlen calls with
``causal=False`` / ``causal=True``. On CUDA in bf16/fp16 with flash-attn (kernel ``auto`` or
``flash_varlen``) each group runs as ``_flash_attn_varlen_forward/backward`` calls with
their LSE (at most 65,535 segments a call); elsewhere the same segments run through a PyTorch
kernel with the exact LSE (fp32).

Dims: b batch, n = N/R tokens of this ring rank, h query heads here, hk kv heads here
(h % hk == 0: query head i reads kv head i // (h/hk)), d head dim; "flat" tensors are
[b·n, heads, d] and LSEs [b·n, heads].
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ulysses_mm.model.attention import FLASH_MAX_DOCS, DocumentMask, resolve_kernel
from ulysses_mm.parallel.slice import doc_spans, document_zigzag, ring_order


@dataclass
class TileGroup:
    """One varlen call: query rows ``q_sel`` (of the flat [b·nq] block) in segments
    ``cu_q`` against key rows ``k_sel`` (of the flat [b·nk] block, a row may repeat) in
    segments ``cu_k``; ``causal``: aligned bottom-right, else full."""

    q_sel: Tensor
    k_sel: Tensor
    cu_q: Tensor  # int32 [segments + 1]
    cu_k: Tensor
    max_q: int
    max_k: int
    causal: bool
    cap: int = 0  # queries of one row: a dense kernel's piece
    _pieces: dict[tuple[int, int], list[tuple[slice, slice, TileGroup]]] = field(
        default_factory=dict, repr=False
    )

    def pieces(
        self, max_queries: int = 0, max_segments: int = 0
    ) -> list[tuple[slice, slice, TileGroup]]:
        """The call cut at segment boundaries into pieces of at most ``max_queries``
        queries and ``max_segments`` segments (0: no bound): (query rows, key rows, the
        piece as a call of its own). A dense kernel bounds the queries (one row's worth:
        [h, ≤ n, ≤ n] scores whatever the batch), flash-attn the segments per call."""
        key = (max_queries, max_segments)
        if key not in self._pieces:
            cq, ck = self.cu_q.tolist(), self.cu_k.tolist()
            m = len(cq) - 1
            cuts, s0 = [], 0
            for i in range(m):
                if i > s0 and (
                    (max_queries and cq[i + 1] - cq[s0] > max_queries)
                    or (max_segments and i - s0 >= max_segments)
                ):
                    cuts.append((s0, i))
                    s0 = i
            cuts.append((s0, m))
            self._pieces[key] = [
                (
                    slice(cq[a], cq[b]),
                    slice(ck[a], ck[b]),
                    TileGroup(
                        self.q_sel[cq[a] : cq[b]],
                        self.k_sel[ck[a] : ck[b]],
                        self.cu_q[a : b + 1] - cq[a],
                        self.cu_k[a : b + 1] - ck[a],
                        self.max_q,
                        self.max_k,
                        self.causal,
                    ),
                )
                for a, b in cuts
            ]
        return self._pieces[key]

    @property
    def pairs(self) -> int:
        """Query-key pairs this call computes."""
        lq = (self.cu_q[1:] - self.cu_q[:-1]).long()
        lk = (self.cu_k[1:] - self.cu_k[:-1]).long()
        if self.causal:
            return int((lq * lk - lq * (lq - 1) // 2).sum())
        return int((lq * lk).sum())

    def allowed(self) -> Tensor:
        """[Tq, Tk] boolean of this call (for the PyTorch kernel)."""
        lq = (self.cu_q[1:] - self.cu_q[:-1]).long()
        lk = (self.cu_k[1:] - self.cu_k[:-1]).long()
        seg = torch.arange(len(lq), device=lq.device)
        sq, sk = seg.repeat_interleave(lq), seg.repeat_interleave(lk)
        ok = sq[:, None] == sk[None, :]
        if self.causal:
            pq = torch.arange(len(sq), device=lq.device) - self.cu_q[:-1].long()[sq]
            pk = torch.arange(len(sk), device=lq.device) - self.cu_k[:-1].long()[sk]
            ok &= pk[None, :] <= (pq + (lk - lq)[sq])[:, None]
        return ok


def block_tiles(q_idx: Tensor, q_start: Tensor, k_idx: Tensor) -> list[TileGroup]:
    """The varlen calls (at most two: full, causal) that compute queries at global
    positions ``q_idx`` [b, nq] (their documents starting at ``q_start``) against keys at
    ``k_idx`` [b, nk] (both sorted per row). A query sees the keys of its document at or
    before it: one contiguous run [kstart, kend) of the key block. Consecutive queries
    with the same kstart whose kend stays put form a full segment; whose kend grows by one,
    a causal one. Queries that see nothing are in no segment."""
    b = q_idx.shape[0]
    nk = k_idx.shape[1]
    dev = q_idx.device
    kend = torch.searchsorted(k_idx, q_idx, right=True)
    kstart = torch.searchsorted(k_idx, q_start.contiguous())
    sees = (kend > kstart).flatten()
    rows = torch.arange(b, device=dev)[:, None] * nk
    v = torch.nonzero(sees).flatten()
    if v.numel() == 0:
        return []
    ks = (kstart + rows).flatten()[v]
    ke = (kend + rows).flatten()[v]
    step = ke[1:] - ke[:-1]
    cont = (v[1:] == v[:-1] + 1) & (ks[1:] == ks[:-1]) & ((step == 0) | (step == 1))
    brk = ~cont
    brk[1:] |= cont[:-1] & cont[1:] & (step[1:] != step[:-1])
    starts = torch.cat(
        [torch.zeros(1, dtype=torch.long, device=dev), torch.nonzero(brk).flatten() + 1]
    )
    ends = torch.cat([starts[1:], torch.tensor([len(v)], device=dev)])
    lq = ends - starts
    causal = (lq > 1) & (torch.cat([step, step.new_zeros(1)])[starts] == 1)
    k0, lk = ks[starts], ke[ends - 1] - ks[starts]
    seg_of = torch.arange(len(starts), device=dev).repeat_interleave(lq)
    groups = []
    for flag in (False, True):
        pick = causal == flag
        if not bool(pick.any()):
            continue
        glq, glk, gk0 = lq[pick], lk[pick], k0[pick]
        cu_q = torch.zeros(len(glq) + 1, dtype=torch.int32, device=dev)
        cu_q[1:] = torch.cumsum(glq, 0)
        cu_k = torch.zeros(len(glk) + 1, dtype=torch.int32, device=dev)
        cu_k[1:] = torch.cumsum(glk, 0)
        within = torch.arange(int(cu_k[-1]), device=dev) - cu_k[:-1].long().repeat_interleave(glk)
        groups.append(
            TileGroup(
                q_sel=v[pick[seg_of]],
                k_sel=gk0.repeat_interleave(glk) + within,
                cu_q=cu_q,
                cu_k=cu_k,
                max_q=int(glq.max()),
                max_k=int(glk.max()),
                causal=flag,
                cap=q_idx.shape[1],
            )
        )
    return groups


@dataclass
class RingPlan:
    """What every ring rank needs about one batch's layout, computed once per mask:
    each ring rank's global token positions, their documents' starts, and the varlen
    tiles of every (query rank, key rank) pair it meets."""

    idx: list[Tensor]  # [b, n] global positions per ring rank
    start: list[Tensor]  # [b, n] global start of each token's document
    tiles: dict[tuple[int, int], list[TileGroup]] = field(default_factory=dict)

    @classmethod
    def of(cls, mask: DocumentMask, ring: int) -> RingPlan:
        key = ("ring", ring)
        if key not in mask._cache:
            runs = mask.run_ids
            n = mask.seq_len // ring
            spans = doc_spans(runs)
            start = spans[1]
            order = document_zigzag(spans, ring) if ring > 1 else ring_order(runs, 1)
            idx = [order[:, j * n : (j + 1) * n].contiguous() for j in range(ring)]
            mask._cache[key] = cls(idx, [start.gather(1, i) for i in idx])
        plan: RingPlan = mask._cache[key]
        return plan

    def block(self, q_rank: int, k_rank: int) -> list[TileGroup]:
        if (q_rank, k_rank) not in self.tiles:
            self.tiles[q_rank, k_rank] = block_tiles(
                self.idx[q_rank], self.start[q_rank], self.idx[k_rank]
            )
        return self.tiles[q_rank, k_rank]


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
    """A varlen block kernel: a group's calls cut into pieces (:meth:`TileGroup.pieces`,
    within the kernel's ``limits``), each run by ``piece_forward`` / ``piece_backward``."""

    name = ""

    @classmethod
    def limits(cls, g: TileGroup) -> tuple[int, int]:
        """(most queries, most segments) of one call; 0: no bound."""
        raise NotImplementedError

    @classmethod
    def piece_forward(
        cls, q: Tensor, k: Tensor, v: Tensor, g: TileGroup, scale: float
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
        g: TileGroup,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    @classmethod
    def forward(
        cls, q: Tensor, k: Tensor, v: Tensor, g: TileGroup, scale: float
    ) -> tuple[Tensor, Tensor]:
        """(out [Tq, h, d] fp32, lse [Tq, h]) of the group's gathered rows."""
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
        g: TileGroup,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) fp32 of the group, from the FINAL out and lse [Tq, h] of its rows
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


class TorchTiles(BlockKernel):
    """The PyTorch block kernel: masked dense products (fp32), one per piece of at most one
    row's queries, so its scores are [h, ≤ n, ≤ n] whatever the batch."""

    name = "torch"

    @classmethod
    def limits(cls, g: TileGroup) -> tuple[int, int]:
        return g.cap, 0

    @classmethod
    def piece_forward(
        cls, q: Tensor, k: Tensor, v: Tensor, g: TileGroup, scale: float
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
        g: TileGroup,
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


class FlashTiles(BlockKernel):
    """flash-attn's varlen forward/backward with the LSE (CUDA, bf16/fp16), one call per
    ``FLASH_MAX_DOCS`` segments."""

    name = "flash_varlen"

    @classmethod
    def limits(cls, g: TileGroup) -> tuple[int, int]:
        return 0, FLASH_MAX_DOCS

    @classmethod
    def piece_forward(
        cls, q: Tensor, k: Tensor, v: Tensor, g: TileGroup, scale: float
    ) -> tuple[Tensor, Tensor]:
        from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

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
        g: TileGroup,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

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
    groups: list[TileGroup],
    scale: float,
) -> tuple[Tensor, Tensor]:
    """(out [T, h, d] fp32, lse [T, h]) of flat queries ``qf`` against one flat key block;
    queries in no group get 0 and −inf."""
    out = qf.new_zeros(qf.shape, dtype=torch.float32)
    lse = qf.new_full(qf.shape[:2], float("-inf"), dtype=torch.float32)
    for g in groups:
        o, l_ = kernel.forward(qf[g.q_sel], kf[g.k_sel], vf[g.k_sel], g, scale)
        out[g.q_sel] = o
        lse[g.q_sel] = l_
    return out, lse


def merge(out: Tensor, lse: Tensor, o_b: Tensor, l_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge a block's partial (out [T, h, d], lse [T, h]) into the running one."""
    new = torch.logaddexp(lse, l_b)
    safe = torch.where(torch.isinf(new), 0.0, new)
    return out * torch.exp(lse - safe)[..., None] + o_b * torch.exp(l_b - safe)[..., None], new


class _Ring:
    """Point-to-point ring steps: send to the next ring rank, receive from the previous."""

    def __init__(self, group: Any, ranks: tuple[int, ...], ring_rank: int) -> None:
        self.group = group
        self.R = len(ranks)
        self.next = ranks[(ring_rank + 1) % self.R]
        self.prev = ranks[(ring_rank - 1) % self.R]

    def start(self, send: Tensor, tag: int = 0) -> tuple[Tensor, list[Any]]:
        """Send ``send`` on and receive the previous rank's (``tag`` keeps two exchanges
        in flight at once apart)."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(reqs: list[Any]) -> None:
        for r in reqs:
            r.wait()


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        ring: _Ring,
        ring_rank: int,
        plan: RingPlan,
        kernel: type[BlockKernel],
        stats: dict[str, int] | None,
    ) -> Tensor:
        R = ring.R
        b, n, h, d = q.shape
        scale = 1.0 / math.sqrt(d)
        qf = q.reshape(b * n, h, d)
        kv = torch.stack([k, v]).reshape(2, b * n, k.shape[2], d).contiguous()
        if stats is not None:
            stats["forward_calls"] += 1
        out = q.new_zeros((b * n, h, d), dtype=torch.float32)
        lse = q.new_full((b * n, h), float("-inf"), dtype=torch.float32)
        for step in range(R):
            reqs: list[Any] = []
            if step < R - 1:
                nxt, reqs = ring.start(kv)  # the next block travels while this one computes
                if stats is not None:
                    stats["forward_bytes"] += kv.numel() * kv.element_size()
            groups = plan.block(ring_rank, (ring_rank - step) % R)
            if groups:
                o_b, l_b = block_forward(kernel, qf, kv[0], kv[1], groups, scale)
                out, lse = merge(out, lse, o_b, l_b)
            elif stats is not None:
                stats["skipped"] += 1
            if reqs:
                _Ring.wait(reqs)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.ring_rank, ctx.plan, ctx.kernel, ctx.stats = (
            ring,
            ring_rank,
            plan,
            kernel,
            stats,
        )
        return out.view(b, n, h, d).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring, ring_rank, plan, kernel, stats = (
            ctx.ring,
            ctx.ring_rank,
            ctx.plan,
            ctx.kernel,
            ctx.stats,
        )
        R = ring.R
        b, n, h, d = q.shape
        scale = 1.0 / math.sqrt(d)
        qf = q.reshape(b * n, h, d)
        df = dout.reshape(b * n, h, d)
        kv = torch.stack([k, v]).reshape(2, b * n, k.shape[2], d).contiguous()
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # travels with its block
        dq = torch.zeros_like(qf, dtype=torch.float32)
        if stats is not None:
            stats["backward_calls"] += 1
        for step in range(R):
            reqs: list[Any] = []
            if step < R - 1:
                nxt, reqs = ring.start(kv)
            for g in plan.block(ring_rank, (ring_rank - step) % R):
                dq_g, dk_g, dv_g = kernel.backward(
                    df[g.q_sel],
                    qf[g.q_sel],
                    kv[0][g.k_sel],
                    kv[1][g.k_sel],
                    out[g.q_sel],
                    lse[g.q_sel],
                    g,
                    scale,
                )
                dq.index_add_(0, g.q_sel, dq_g)
                dkv[0].index_add_(0, g.k_sel, dk_g)
                dkv[1].index_add_(0, g.k_sel, dv_g)
            if R > 1:
                # the accumulated dK/dV of block src go on with it; after R hops they are home
                dkv_next, dreqs = ring.start(dkv, tag=1)
                if stats is not None:
                    stats["backward_bytes"] += dkv.numel() * dkv.element_size()
                _Ring.wait(dreqs)
                dkv = dkv_next
            if reqs:
                _Ring.wait(reqs)
                if stats is not None:
                    stats["backward_bytes"] += kv.numel() * kv.element_size()
                kv = nxt
        dkv = dkv.view(2, b, n, k.shape[2], d)
        return (
            dq.view(b, n, h, d).to(q.dtype),
            dkv[0].to(k.dtype),
            dkv[1].to(v.dtype),
            None,
            None,
            None,
            None,
            None,
        )


class RingAttention(nn.Module):
    """Attention ``(q, k, v, DocumentMask) -> out`` across a ring of R ranks: q, k, v are
    this ring rank's N/R tokens (:func:`ring_order` layout) on the heads it owns; the mask
    holds the full sequence's doc_ids in global order. ``kernel`` is the attention kernel
    setting (``auto``, ``flash_varlen``, ...): flash-attn's varlen kernel runs the blocks
    where it would run (CUDA, bf16/fp16), PyTorch's exact kernel elsewhere."""

    def __init__(
        self,
        group: Any,
        ranks: tuple[int, ...],
        ring_rank: int,
        stats: dict[str, int] | None,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.ring = _Ring(group, ranks, ring_rank)
        self.ring_rank = ring_rank
        self.stats = stats
        self.kernel = kernel

    def extra_repr(self) -> str:
        return f"ring={self.ring.R}, ring_rank={self.ring_rank}, kernel={self.kernel}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
        R = self.ring.R
        n = mask.seq_len
        if q.shape[1] * R != n:
            raise ValueError(
                f"ring attention: this ring rank holds {q.shape[1]} tokens but the sequence "
                f"of {n} tokens over ring={R} needs {n // R}"
            )
        name = resolve_kernel(self.kernel, q.device.type, q.dtype)
        kernel = FlashTiles if name == "flash_varlen" else TorchTiles
        plan = RingPlan.of(mask, R)
        return _RingAttentionFn.apply(q, k, v, self.ring, self.ring_rank, plan, kernel, self.stats)


def new_ring_stats() -> dict[str, int]:
    """Counters a :class:`RingAttention` adds to: bytes each rank sent around the ring
    (forward: K/V blocks; backward: K/V blocks again and the dK/dV that travel home),
    calls, and blocks skipped because no query may see them."""
    return {
        "forward_bytes": 0,
        "backward_bytes": 0,
        "forward_calls": 0,
        "backward_calls": 0,
        "skipped": 0,
    }


def ring_theory_bytes(
    seq_len: int,
    ring: int,
    ulysses: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    micro_batch: int = 1,
    elem_bytes: int = 4,
    grad_bytes: int = 4,
) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends around the ring per layer: R−1 K/V blocks
    of N/R tokens on lcm(hk, U)/U kv heads forward; the same again backward plus R hops
    of their dK/dV (accumulated in fp32: ``grad_bytes``)."""
    if ring == 1:
        return 0, 0
    e = math.lcm(num_kv_heads, ulysses) // ulysses if ulysses > 1 else num_kv_heads
    block = micro_batch * (seq_len // ring) * 2 * e * head_dim
    return (ring - 1) * block * elem_bytes, (
        ring - 1
    ) * block * elem_bytes + ring * block * grad_bytes
