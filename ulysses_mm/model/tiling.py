"""Sequence tiles (``model.layer_tile_tokens``, the heads' loss tiles): token-wise work
in tiles along the sequence, each recomputed in backward.

:func:`tile_map` applies a token-wise
function to tiles of its inputs along the sequence, each tile checkpointed (recomputed in
backward), and concatenates the outputs. The gradient of an input is written tile by tile
into one buffer (:class:`_TileView`), so backward never holds zero-padded whole-sequence
copies of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


class _TileGrad:
    """The one gradient buffer the tiles of an input write into."""

    def __init__(self, x: Tensor, tiles: int, dim: int) -> None:
        # the input's metadata only: a reference would keep it alive in the graph
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.left, self.dim = tiles, dim
        self.buf: Tensor | None = None


class _TileView(torch.autograd.Function):
    """``x.narrow(dim, start, stop - start)`` whose gradient goes into the input's shared buffer; the last
    tile to get its gradient hands the whole buffer to ``x`` (the others hand none)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, state: _TileGrad, start: int, stop: int
    ) -> Tensor:
        ctx.state, ctx.start, ctx.stop = state, start, stop
        return x.narrow(state.dim, start, stop - start)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        st: _TileGrad = ctx.state
        if st.buf is None:
            st.buf = torch.zeros(st.shape, dtype=st.dtype, device=st.device)
        st.buf.narrow(st.dim, ctx.start, ctx.stop - ctx.start).copy_(grad)
        st.left -= 1
        if st.left:
            return None, None, None, None
        out, st.buf = st.buf, None
        return out, None, None, None


def tiles(x: Tensor, tile: int, dim: int = 1) -> list[Tensor]:
    """``x`` cut into tiles of ``tile`` along ``dim`` (views); in backward their gradients
    fill one buffer, handed to ``x`` once every tile's has arrived."""
    n = x.shape[dim]
    bounds = [(s, min(s + tile, n)) for s in range(0, n, tile)]
    if len(bounds) == 1:
        return [x]
    if not (x.requires_grad and torch.is_grad_enabled()):
        return [x.narrow(dim, s, e - s) for s, e in bounds]
    state = _TileGrad(x, len(bounds), dim)
    return [_TileView.apply(x, state, s, e) for s, e in bounds]


def tile_map(fn: Callable[..., Any], tile: int, *inputs: Tensor) -> Any:
    """``fn(*inputs)`` computed on tiles of ``tile`` tokens along dim 1 of every input
    (each [b, n, ...]), each tile recomputed in backward; ``fn`` returns one tensor or a
    tuple of them, each [b, t, ...], concatenated back along dim 1."""
    n = inputs[0].shape[1]
    if tile <= 0 or n <= tile:
        return fn(*inputs)
    grad = torch.is_grad_enabled()
    outs = []
    for parts in zip(*(tiles(t, tile) for t in inputs), strict=True):
        outs.append(checkpoint(fn, *parts, use_reentrant=False) if grad else fn(*parts))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(list(o), dim=1) for o in zip(*outs, strict=True))
    return torch.cat(outs, dim=1)
