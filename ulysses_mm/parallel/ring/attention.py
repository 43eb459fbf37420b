"""Ring attention across R ranks: the point-to-point ring, the autograd function that
sends K/V blocks around it, the module, and the bytes it sends.

Forward: each ring rank computes attention of its queries against its own K/V block, then
R−1 times receives the previous rank's block (the next one already in flight while the
current one is computed: isend/irecv) and merges the partial outputs through their
log-sum-exp. A block where no query may see any key (another document, or the future) is
skipped. Backward: the K/V blocks travel the ring again in the same order; dQ accumulates
locally, dK/dV accumulate on a buffer that travels with its block and arrives home after
R hops.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ulysses_mm.model.attention import DocumentMask, resolve_kernel
from ulysses_mm.parallel.ring.kernels import (
    BlockKernel,
    FlashBlockKernel,
    TorchBlockKernel,
    block_forward,
    merge,
)
from ulysses_mm.parallel.ring.plan import RingPlan


class _Ring:
    """Point-to-point ring steps: send to the next ring rank, receive from the previous."""

    def __init__(self, group: Any, members: tuple[int, ...], ring_rank: int) -> None:
        self.group = group
        self.R = len(members)
        self.next = members[(ring_rank + 1) % self.R]
        self.prev = members[(ring_rank - 1) % self.R]

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
            calls = plan.block(ring_rank, (ring_rank - step) % R)
            if calls:
                o_b, l_b = block_forward(kernel, qf, kv[0], kv[1], calls, scale)
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
    this ring rank's N/R tokens (:func:`~ulysses_mm.parallel.slice.ring_order` layout) on
    the heads it owns; the mask holds the full sequence's doc_ids in global order.
    ``kernel`` is the attention kernel setting (``auto``, ``flash_varlen``, ...):
    flash-attn's varlen kernel runs the blocks where it would run (CUDA, bf16/fp16),
    PyTorch's exact kernel elsewhere."""

    def __init__(
        self,
        group: Any,
        members: tuple[int, ...],
        ring_rank: int,
        stats: dict[str, int] | None,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.ring = _Ring(group, members, ring_rank)
        self.ring_rank = ring_rank
        self.stats = stats
        self.kernel = kernel

    def extra_repr(self) -> str:
        return f"ring_size={self.ring.R}, ring_rank={self.ring_rank}, kernel={self.kernel}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
        R = self.ring.R
        n = mask.seq_len
        if q.shape[1] * R != n:
            raise ValueError(
                f"ring attention: this ring rank holds {q.shape[1]} tokens but the sequence "
                f"of {n} tokens over ring={R} needs {n // R}"
            )
        name = resolve_kernel(self.kernel, q.device.type, q.dtype)
        kernel = FlashBlockKernel if name == "flash_varlen" else TorchBlockKernel
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
    ring_size: int,
    ulysses_size: int,
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
    R, U = ring_size, ulysses_size
    if R == 1:
        return 0, 0
    e = math.lcm(num_kv_heads, U) // U if U > 1 else num_kv_heads
    block = micro_batch * (seq_len // R) * 2 * e * head_dim
    return (R - 1) * block * elem_bytes, (R - 1) * block * elem_bytes + R * block * grad_bytes
