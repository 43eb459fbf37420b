"""The one differentiable collective Ulysses needs, and a byte counter for it.

All-to-all over dim 0 of a ``[P, ...]`` tensor is its own adjoint: chunk j of rank r goes
to rank j as its chunk r, so the backward of the exchange is the same exchange applied to
the gradient. The layout changes around it (which dim is scattered, which gathered) are
ordinary autograd ops; that is how the backward swaps scatter and gather.
"""

from __future__ import annotations

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

    def record(self, direction: str, tensor: Tensor, world: int) -> None:
        sent = tensor.numel() * tensor.element_size() * (world - 1) // world
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


def _exchange(x: Tensor, group: Any) -> Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Any, stats: CommStats | None) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.stats = group, stats
        world = dist.get_world_size(group)
        if stats is not None:
            stats.record("forward", x, world)
        return _exchange(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        if ctx.stats is not None:
            ctx.stats.record("backward", grad, dist.get_world_size(ctx.group))
        return _exchange(grad.contiguous(), ctx.group), None, None


def all_to_all(x: Tensor, group: Any, stats: CommStats | None = None) -> Tensor:
    """Exchange chunk ``j`` of dim 0 with rank ``j`` of ``group`` (x is ``[P, ...]``)."""
    return _AllToAll.apply(x, group, stats)
