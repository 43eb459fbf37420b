"""Attention in groups of heads (``parallel.head_groups`` = C > 1: C head groups).

Each Ulysses rank runs attention on hq/U query heads; here it runs them in C groups of
hg = hq/(U·C), one after another: group g's q, k, v go through their own all-to-all
(sequence -> heads), the local kernel runs on them, its output comes back (heads ->
sequence) and is written into the group's slots of ONE output buffer; the group's q, k,
v are then freed. Only one group's q, k, v after the all-to-all and one group's kernel
working set are alive at a time, so those shrink by C.

Backward recomputes per group (:class:`_GroupedAttention`): group g's q, k, v and output
gradient travel again, the kernel runs forward with autograd and back, and the gradients
of q, k, v travel home into one dq, dk, dv; dq is written over the output gradient's
heads as each group is done with them (the output gradient is the function's own copy),
so the two are one buffer. What the layer keeps between forward and backward is the
caller's q, k, v (and the output buffer, as o_proj's input), not the kernel's saved set.

Key/value heads (e = lcm(hk, U) after Ulysses replication, e/U per rank): when C divides
e/U, group g takes e/(U·C) of them (kv groups stay whole); when e/U divides C, each group
takes the one kv head its query heads read, and it travels with every group that reads
it. Replicated kv heads (e > hk) are gathered from the original heads by index, and their
gradients summed back into them.

Overlap: on CUDA the forward's exchanges run on a side stream, ordered against the
compute stream by events: the next group's all-to-all runs while this group's kernel
computes, and this group's output exchange while the next group's kernel computes. The
backward runs in order on every device: a group's kernel backward is the high point of
the step, and fetching the next group beside it would add a group's inputs to it. On CPU
the same code runs in order.

Dims: b batch, n = s/U tokens of this rank (N/(U·R) under a ring), s the sequence the
local kernel sees, U Ulysses ranks, C groups, hg query and eg kv heads per group and rank,
d head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ulysses_mm.core.layout import head_group_sizes
from ulysses_mm.model.attention import DocumentMask
from ulysses_mm.model.offload import side_stream
from ulysses_mm.parallel.comm import Exchange, heads_to_seq_parts, seq_to_heads_parts


@dataclass
class HeadGroups:
    """Which heads group g holds: on rank j, query heads j·hq/U + g·hg + [0, hg) and kv
    heads (expanded numbering) j·e/U + ``kv_slots[g]``. Without replication the kv heads
    are views of k, v; replicated ones are gathered by ``kv_index[g]``, the ORIGINAL kv
    head of each in send order [U × eg]."""

    ulysses_size: int
    num_heads: int
    num_kv_heads: int
    kv_expanded: int
    count: int  # C: the number of groups
    kv_index: list[Tensor | None] = field(init=False)

    def __post_init__(self) -> None:
        U, C, e = self.ulysses_size, self.count, self.kv_expanded
        self.el = el = e // U
        self.hg, self.eg = head_group_sizes(self.num_heads, self.num_kv_heads, U, C)
        # the rank's kv heads group g reads: its own share, or the one its queries share
        self.kv_slots = [(g * el // C, g * el // C + self.eg) for g in range(C)]
        rep = e // self.num_kv_heads  # expanded heads per original kv head
        self.kv_index = []
        for a, b in self.kv_slots:
            if rep == 1:
                self.kv_index.append(None)
            else:
                heads = [(j * el + i) // rep for j in range(U) for i in range(a, b)]
                self.kv_index.append(torch.tensor(heads, dtype=torch.long))
        # a kv head's gradient comes from several groups (shared or replicated): summed
        self.kv_shared = rep > 1 or el % C != 0

    def q_part(self, t: Tensor, g: int) -> Tensor:
        """[b, n, hq, d] -> group g's [b, n, U, hg, d] (a view)."""
        b, n, _, d = t.shape
        return t.view(b, n, self.ulysses_size, self.count, self.hg, d)[:, :, :, g]

    def kv_part(self, t: Tensor, g: int) -> Tensor:
        """[b, n, hk, d] -> group g's [b, n, U, eg, d] (a view, or gathered by index)."""
        b, n, _, d = t.shape
        idx = self.kv_index[g]
        if idx is None:
            a, z = self.kv_slots[g]
            return t.view(b, n, self.ulysses_size, self.el, d)[:, :, :, a:z]
        return t.index_select(2, idx.to(t.device)).view(b, n, self.ulysses_size, self.eg, d)

    def q_put(self, dst: Tensor, src: Tensor, g: int) -> None:
        """Write group g's [b, n, U, hg, d] into its slots of ``dst`` [b, n, hq, d]."""
        self.q_part(dst, g).copy_(src)

    def kv_add(self, dst: Tensor, src: Tensor, g: int) -> None:
        """Group g's kv gradients [b, n, U, eg, d] into ``dst`` [b, n, hk, d]: written
        where the group owns its kv heads, summed where heads are shared or replicated."""
        idx = self.kv_index[g]
        if idx is not None:
            b, n, _, d = dst.shape
            dst.index_add_(2, idx.to(dst.device), src.reshape(b, n, -1, d))
        elif self.kv_shared:
            self.kv_part(dst, g).add_(src)
        else:
            self.kv_part(dst, g).copy_(src)


class _Schedule:
    """Where the exchanges run. On CUDA: a side stream, ordered by events; a fetch starts
    at once and is waited for when taken. On CPU: in order; a fetch runs when taken."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.side = side_stream(device, "head group exchanges")

    def fetch(self, fn: Callable[[], list[Tensor]], reads: list[Tensor]) -> Any:
        """Start ``fn`` (an exchange whose inputs are ``reads``); :meth:`take` its result."""
        if not self.cuda:
            return fn
        self.side.wait_stream(self.main)  # its inputs are written by the compute stream
        with torch.cuda.stream(self.side):
            out = fn()
        event = torch.cuda.Event()
        event.record(self.side)
        for t in reads:
            t.record_stream(self.side)  # not reused before the side stream has read it
        return out, event

    def take(self, handle: Any) -> list[Tensor]:
        if not self.cuda:
            return handle()
        out, event = handle
        self.main.wait_event(event)
        for t in out:
            t.record_stream(self.main)  # made on the side stream, used on this one
        return out

    def post(self, fn: Callable[[], None], reads: list[Tensor]) -> None:
        """Run ``fn`` (an exchange and the writes of what arrived) after the compute
        stream's work so far; :meth:`finish` waits for every one."""
        if not self.cuda:
            fn()
            return
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            fn()
        for t in reads:
            t.record_stream(self.side)

    def finish(self) -> None:
        if self.cuda:
            self.main.wait_stream(self.side)


@dataclass
class GroupRun:
    """What one call of grouped attention needs besides q, k, v: the kernel, the mask,
    the groups, and the exchange (None without Ulysses: U = 1)."""

    local: nn.Module
    mask: DocumentMask
    groups: HeadGroups
    exchange: Exchange | None

    def to_heads(self, parts: list[Tensor], direction: str) -> list[Tensor]:
        """[b, n, U, h_i, d] each -> [b, s, h_i, d] each."""
        if self.exchange is None:
            return [p.flatten(2, 3) for p in parts]  # U = 1: a view
        return seq_to_heads_parts(self.exchange, parts, direction)

    def to_seq(self, tensors: list[Tensor], direction: str) -> list[Tensor]:
        """[b, s, h_i, d] each -> [b, n, U, h_i, d] each."""
        if self.exchange is None:
            return [t.unsqueeze(2) for t in tensors]
        return heads_to_seq_parts(self.exchange, tensors, direction)


class _GroupedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: GroupRun, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # type: ignore[override]
        G, C = run.groups, run.groups.count
        sched = _Schedule(q.device)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # each group writes its heads

        def scatter(g: int) -> Any:
            def run_it() -> list[Tensor]:
                parts = [G.q_part(q, g), G.kv_part(k, g), G.kv_part(v, g)]
                return run.to_heads(parts, "forward")

            return sched.fetch(run_it, [q, k, v])

        def gather(o: Tensor, g: int) -> None:
            (back,) = run.to_seq([o], "forward")
            G.q_put(out, back, g)

        pending = scatter(0)
        for g in range(C):
            qg, kg, vg = sched.take(pending)
            if g + 1 < C:
                pending = scatter(g + 1)  # CUDA: travels while this group computes
            og = run.local(qg, kg, vg, run.mask)  # [b, s, hg, d]
            del qg, kg, vg
            sched.post(functools.partial(gather, og, g), [og, out])
            del og
        sched.finish()
        ctx.run = run
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # In order on every device: a group's kernel backward is the step's high point, so
        # no second group is fetched beside it. ``dout`` is this function's own (a copy,
        # see _OwnGrad): group g's dq goes into its heads once their dout has been read.
        run: GroupRun = ctx.run
        q, k, v = ctx.saved_tensors
        G, C = run.groups, run.groups.count
        dq = dout.contiguous()
        new = torch.zeros if G.kv_shared else torch.empty  # shared kv heads' gradients add up
        dk = new(k.shape, dtype=k.dtype, device=k.device)
        dv = new(v.shape, dtype=v.dtype, device=v.device)
        for g in range(C):
            parts = [G.q_part(q, g), G.kv_part(k, g), G.kv_part(v, g), G.q_part(dq, g)]
            qg, kg, vg, dg = run.to_heads(parts, "backward")
            del parts
            leaves = [t.detach().requires_grad_(True) for t in (qg, kg, vg)]
            del qg, kg, vg
            with torch.enable_grad():
                og = run.local(*leaves, run.mask)
            grads = list(torch.autograd.grad(og, leaves, dg))
            del og, leaves, dg
            gq, gk, gv = run.to_seq(grads, "backward")
            del grads
            G.q_put(dq, gq, g)  # over group g's dout, read by now
            G.kv_add(dk, gk, g)
            G.kv_add(dv, gv, g)
            del gq, gk, gv
        ctx.run = None
        return None, dq, dk, dv


class _OwnGrad(torch.autograd.Function):
    """Identity whose backward hands on a copy of the gradient: the incoming one may be
    held elsewhere (a caller's tensor) and is freed here when it is not, so grouped
    attention's backward may write dq into the copy."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.clone(memory_format=torch.contiguous_format)


def grouped_attention(run: GroupRun, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention of q [b, n, hq, d], k, v [b, n, hk, d] (this rank's tokens) in the
    groups of ``run``; returns [b, n, hq, d]."""
    return _OwnGrad.apply(_GroupedAttention.apply(run, q, k, v))


def exchange_heads(
    num_heads: int, num_kv_heads: int, ulysses_size: int, groups: int
) -> tuple[int, int]:
    """Heads (of head_dim values each, per token of the sequence) one layer's all-to-alls
    carry, forward and backward: q, k, v in and the output back; backward the output
    gradient in and the q, k, v gradients back and, with ``groups`` > 1, q, k, v again
    for the recomputation. A kv head shared by several groups travels with each."""
    # every group's kv heads on every rank: e = lcm(hk, U) at C = 1
    U, C = ulysses_size, groups
    kv = U * C * head_group_sizes(num_heads, num_kv_heads, U, C)[1]
    if C == 1:
        return 2 * num_heads + 2 * kv, 2 * num_heads + 2 * kv
    return 2 * num_heads + 2 * kv, 3 * num_heads + 4 * kv
