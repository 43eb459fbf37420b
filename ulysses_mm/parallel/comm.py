"""The differentiable all-to-all Ulysses is built on, and a byte counter for it.

One exchange moves a ``[P, ...]`` buffer: chunk j goes to rank j, which receives it as its
chunk r. Ulysses uses it in two layouts that are each other's inverse:

- sequence -> heads: tensors ``[b, s/P, h_i, d]`` (q, k and v together) become
  ``[b, s, h_i/P, d]``: this rank's heads over the whole sequence;
- heads -> sequence: ``[b, s, h_i/P, d]`` back to ``[b, s/P, h_i, d]``.

The backward of each is the other applied to the gradients (the exchange is its own
adjoint), so :class:`_SeqToHeads` and :class:`_HeadsToSeq` call each other's kernels.
Several tensors travel in ONE exchange, packed along the head dim.

Buffers: the send buffer is dead as soon as the exchange returns, so it comes from a
:class:`Workspace` reused by every exchange of the model (one allocation instead of one
per layer and direction); only what a rank receives is allocated, and the received q, k, v
are handed to the kernel as views of it (no unpacking copy when b = 1). Head groups
(:mod:`ulysses_mm.parallel.head_groups`) exchange one group of heads at a time through the
``*_parts`` forms, which take and give each tensor as ``[b, s/P, P, h_i/P, d]`` (chunk j:
rank j's heads), and allocate the send buffer per exchange (an :class:`Exchange` without
workspace), so it is not alive while a group's kernel runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class CommStats:
    """Bytes this rank sent to OTHER ranks through all-to-all, per direction of autograd.

    Attach one to :func:`ulysses_mm.parallel.apply_ulysses` to measure; nothing global."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_calls: int = 0
    backward_calls: int = 0
    per_call: list[tuple[str, int]] = field(default_factory=list)

    def record(self, direction: str, tensor: Tensor, size: int) -> None:
        sent = tensor.numel() * tensor.element_size() * (size - 1) // size
        if direction == "forward":
            self.forward_bytes += sent
            self.forward_calls += 1
        else:
            self.backward_bytes += sent
            self.backward_calls += 1
        self.per_call.append((direction, sent))

    def reset(self) -> None:
        self.forward_bytes = self.backward_bytes = self.forward_calls = self.backward_calls = 0
        self.per_call.clear()


class Workspace:
    """Send buffers, one per (dtype, device), grown to the largest exchange and reused."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def get(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = math.prod(shape)
        key = (dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(*shape)


@dataclass
class Exchange:
    """Where an exchange runs: the SP group and its size, the send workspace, the counter."""

    group: Any
    size: int  # the ranks of the group
    workspace: Workspace | None
    stats: CommStats | None = None

    def send_buffer(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """The workspace's buffer, or a fresh one (freed once the exchange is done)."""
        if self.workspace is None:
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        return self.workspace.get(shape, dtype, device)

    def run(self, send: Tensor, direction: str) -> Tensor:
        if self.stats is not None:
            self.stats.record(direction, send, self.size)
        recv = torch.empty(send.shape, dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv


def seq_to_heads_parts(ex: Exchange, parts: Sequence[Tensor], direction: str) -> list[Tensor]:
    """``[b, s/P, P, h_i/P, d]`` each (chunk j: rank j's heads) -> ``[b, s, h_i/P, d]`` each,
    in one exchange (views of what arrived)."""
    P = ex.size
    b, n, _, _, d = parts[0].shape
    heads = [t.shape[3] for t in parts]
    send = ex.send_buffer((P, b, n, sum(heads), d), parts[0].dtype, parts[0].device)
    off = 0
    for t, h in zip(parts, heads):
        # [b, s/P, P, h/P, d] -> [P, b, s/P, h/P, d]: chunk j is rank j's heads
        send[..., off : off + h, :].copy_(t.permute(2, 0, 1, 3, 4))
        off += h
    recv = ex.run(send, direction)  # [P(src = sequence chunk), b, s/P, hc, d]
    full = recv.permute(1, 0, 2, 3, 4).reshape(b, P * n, sum(heads), d)  # -> [b, s, hc, d]
    return list(full.split(heads, dim=2))  # [b, s, h_i/P, d] views


def seq_to_heads(ex: Exchange, tensors: Sequence[Tensor], direction: str) -> list[Tensor]:
    """``[b, s/P, h_i, d]`` each -> ``[b, s, h_i/P, d]`` each, in one exchange."""
    P = ex.size
    b, n, _, d = tensors[0].shape
    # [b, s/P, h, d] -> [b, s/P, P, h/P, d]: rank j's heads are the j-th block of h/P
    return seq_to_heads_parts(
        ex, [t.reshape(b, n, P, t.shape[2] // P, d) for t in tensors], direction
    )


def heads_to_seq_parts(ex: Exchange, tensors: Sequence[Tensor], direction: str) -> list[Tensor]:
    """``[b, s, h_i/P, d]`` each -> ``[b, s/P, P, h_i/P, d]`` each (chunk j: the heads rank
    j held), in one exchange (views of what arrived)."""
    P = ex.size
    b, s, _, d = tensors[0].shape
    n = s // P
    heads = [t.shape[2] for t in tensors]
    send = ex.send_buffer((P, b, n, sum(heads), d), tensors[0].dtype, tensors[0].device)
    off = 0
    for t, h in zip(tensors, heads):
        # [b, s, h/P, d] -> [b, P, s/P, h/P, d] -> [P, b, s/P, h/P, d]: chunk j is rank j's sequence
        send[..., off : off + h, :].copy_(t.unflatten(1, (P, n)).permute(1, 0, 2, 3, 4))
        off += h
    recv = ex.run(send, direction)  # [P(src = head group), b, s/P, hc, d]
    outs, off = [], 0
    for h in heads:
        # [P, b, s/P, h/P, d] -> [b, s/P, P, h/P, d]
        outs.append(recv[..., off : off + h, :].permute(1, 2, 0, 3, 4))
        off += h
    return outs


def heads_to_seq(ex: Exchange, tensors: Sequence[Tensor], direction: str) -> list[Tensor]:
    """``[b, s, h_i/P, d]`` each -> ``[b, s/P, h_i, d]`` each, in one exchange."""
    P = ex.size
    b, s, _, d = tensors[0].shape
    parts = heads_to_seq_parts(ex, tensors, direction)
    # [b, s/P, P, h/P, d] -> [b, s/P, h, d]
    return [t.reshape(b, s // P, P * t.shape[3], d) for t in parts]


def _grads(
    grads: Sequence[Tensor | None], like: Sequence[tuple[torch.Size, torch.dtype, torch.device]]
) -> list[Tensor]:
    return [
        g if g is not None else torch.zeros(s, dtype=t, device=dv)
        for g, (s, t, dv) in zip(grads, like)
    ]


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex: Exchange, *tensors: Tensor):  # type: ignore[override]
        ctx.ex = ex
        outs = seq_to_heads(ex, tensors, "forward")
        ctx.like = [(o.shape, o.dtype, o.device) for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        return (None, *heads_to_seq(ctx.ex, _grads(grads, ctx.like), "backward"))


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex: Exchange, *tensors: Tensor):  # type: ignore[override]
        ctx.ex = ex
        outs = heads_to_seq(ex, tensors, "forward")
        ctx.like = [(o.shape, o.dtype, o.device) for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        return (None, *seq_to_heads(ctx.ex, _grads(grads, ctx.like), "backward"))


def scatter_heads(ex: Exchange, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Differentiable sequence -> heads exchange of several tensors at once."""
    return _SeqToHeads.apply(ex, *tensors)


def gather_heads(ex: Exchange, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Differentiable heads -> sequence exchange of several tensors at once."""
    return _HeadsToSeq.apply(ex, *tensors)
