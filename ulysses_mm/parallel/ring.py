"""Ring attention over packed documents, the R axis of hybrid Ulysses × ring.

Layout (zigzag, for causal load balance): the sequence of N tokens is cut into 2R chunks
of c = N/2R; ring rank j holds chunks j and 2R−1−j (:func:`ring_indices`). Inside a
Ulysses group of U ranks those N/R tokens are split contiguously, so SP rank
``j·U + u`` holds ``zigzag_order(N, R)[(j·U+u)·N/sp : (j·U+u+1)·N/sp]`` (see
:func:`ulysses_mm.data.batch.sp_slice`); after the Ulysses all-to-all, ring rank j sees
its N/R tokens on H/U heads. At R = 1 the order is the identity.

Forward: each ring rank computes attention of its queries against its own K/V block, then
R−1 times receives the previous rank's block (the next one already in flight while the
current one is computed: isend/irecv) and merges the partial outputs through their
log-sum-exp. A block where no query may see any key (another document, or the future) is
skipped. Backward: the K/V blocks travel the ring again in the same order; dQ accumulates
locally, dK/dV accumulate on a buffer that travels with its block and arrives home after
R hops. The block kernel is plain PyTorch math with the exact LSE (CPU, any dtype).

Dims: b batch, n = N/R tokens of this ring rank, h query heads here, hk kv heads here
(h % hk == 0: query head i reads kv head i // (h/hk)), d head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ulysses_mm.model.attention import DocumentMask


def ring_indices(seq_len: int, ring: int, ring_rank: int) -> Tensor:
    """Global token indices held by ring rank ``ring_rank`` (zigzag: chunks j, 2R−1−j)."""
    if ring == 1:
        return torch.arange(seq_len)
    c = seq_len // (2 * ring)
    j = ring_rank
    return torch.cat(
        [torch.arange(j * c, (j + 1) * c), torch.arange((2 * ring - 1 - j) * c, (2 * ring - j) * c)]
    )


def zigzag_order(seq_len: int, ring: int) -> Tensor:
    """The permutation of the sequence whose consecutive N/R pieces are the ring ranks'."""
    return torch.cat([ring_indices(seq_len, ring, j) for j in range(ring)])


def _allowed(q_idx: Tensor, q_run: Tensor, k_idx: Tensor, k_run: Tensor) -> Tensor:
    """[b, nq, nk] boolean: same document and key not in the future."""
    causal = k_idx[None, None, :] <= q_idx[None, :, None]
    return causal & (q_run[:, :, None] == k_run[:, None, :])


def unmasked_pairs(doc_ids: Tensor, ring: int, contiguous: bool = False) -> list[int]:
    """Per ring rank, the query-key pairs its attention computes (causal, document-masked)
    over ``doc_ids`` [b, N]: the work each rank of the ring does. ``contiguous`` counts
    the plain N/R split instead of the zigzag (to show the imbalance zigzag removes)."""
    mask = DocumentMask(doc_ids)
    n = mask.seq_len
    runs = mask.run_ids
    counts = []
    for j in range(ring):
        idx = (
            torch.arange(j * n // ring, (j + 1) * n // ring)
            if contiguous
            else ring_indices(n, ring, j)
        )
        allowed = _allowed(idx, runs[:, idx], torch.arange(n), runs)
        counts.append(int(allowed.sum()))
    return counts


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
        idx: list[Tensor],
        runs: list[Tensor],
        stats: dict[str, int] | None,
    ) -> Tensor:
        R = ring.R
        scale = 1.0 / math.sqrt(q.shape[-1])
        q_idx, q_run = idx[ring_rank], runs[ring_rank]
        kv = torch.stack([k, v]).contiguous()
        if stats is not None:
            stats["forward_calls"] += 1
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full(q.shape[:1] + q.shape[2:3] + q.shape[1:2], float("-inf"))
        lse = lse.to(q.device)
        for step in range(R):
            reqs: list[Any] = []
            if step < R - 1:
                nxt, reqs = ring.start(kv)  # the next block travels while this one computes
                if stats is not None:
                    stats["forward_bytes"] += kv.numel() * kv.element_size()
            src = (ring_rank - step) % R
            allowed = _allowed(q_idx, q_run, idx[src], runs[src])
            if bool(allowed.any()):
                o_b, l_b = _block_forward(q.float(), kv[0].float(), kv[1].float(), allowed, scale)
                new = torch.logaddexp(lse, l_b)
                new_safe = torch.where(torch.isinf(new), 0.0, new)
                w_old = torch.exp(lse - new_safe).transpose(1, 2)[..., None]
                w_new = torch.exp(l_b - new_safe).transpose(1, 2)[..., None]
                out = out * w_old + o_b * w_new
                lse = new
            elif stats is not None:
                stats["skipped"] += 1
            if reqs:
                _Ring.wait(reqs)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.ring_rank, ctx.idx, ctx.runs, ctx.stats = ring, ring_rank, idx, runs, stats
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring, ring_rank, idx, runs, stats = ctx.ring, ctx.ring_rank, ctx.idx, ctx.runs, ctx.stats
        R = ring.R
        scale = 1.0 / math.sqrt(q.shape[-1])
        dout = dout.float()
        qf = q.float()
        delta = (dout * out).sum(-1).transpose(1, 2)  # [b, h, nq]
        q_idx, q_run = idx[ring_rank], runs[ring_rank]
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # travels with its block
        dq = torch.zeros_like(qf)
        if stats is not None:
            stats["backward_calls"] += 1
        for step in range(R):
            reqs: list[Any] = []
            if step < R - 1:
                nxt, reqs = ring.start(kv)
            src = (ring_rank - step) % R
            allowed = _allowed(q_idx, q_run, idx[src], runs[src])
            if bool(allowed.any()):
                dq_b, dk_b, dv_b = _block_backward(
                    qf, kv[0].float(), kv[1].float(), allowed, scale, lse, dout, delta
                )
                dq += dq_b
                dkv[0] += dk_b
                dkv[1] += dv_b
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
        return (
            dq.to(q.dtype),
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
    this ring rank's N/R tokens (zigzag layout) on the heads it owns; the mask holds the
    full sequence's doc_ids in global order."""

    def __init__(
        self, group: Any, ranks: tuple[int, ...], ring_rank: int, stats: dict[str, int] | None
    ) -> None:
        super().__init__()
        self.ring = _Ring(group, ranks, ring_rank)
        self.ring_rank = ring_rank
        self.stats = stats

    def extra_repr(self) -> str:
        return f"ring={self.ring.R}, ring_rank={self.ring_rank}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
        R = self.ring.R
        n = mask.seq_len
        if q.shape[1] * R != n:
            raise ValueError(
                f"ring attention: this ring rank holds {q.shape[1]} tokens but the sequence "
                f"of {n} tokens over ring={R} needs {n // R}"
            )
        key = ("ring", R)
        cache = mask._cache
        if key not in cache:
            runs = mask.run_ids
            idx = [ring_indices(n, R, j).to(runs.device) for j in range(R)]
            cache[key] = (idx, [runs[:, i] for i in idx])
        idx, runs = cache[key]
        return _RingAttentionFn.apply(q, k, v, self.ring, self.ring_rank, idx, runs, self.stats)


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
