"""The loss's targets spread evenly over the ranks of a sequence-parallel group.

Under SP each rank holds N/sp tokens and computes the loss of its own targets, each
through the head of its modality. A head's logits are as wide as its modality's
vocabulary (a text head 128K, a DNA head 10 + the specials), so the loss's working set
follows the mix of a rank's targets: the rank whose slice holds more text than its peers
peaks higher, and the padded tail of a sample lightens the last rank. Every rank runs
the same program and is sized for the worst, so the peaks should match.

:class:`TargetBalance` moves the hidden states of the targets (only positions that have
one) through one all-to-all so that every rank gets an equal share (±1) of each
modality's targets in the group, interleaved so that each loss tile holds the same mix;
every rank then holds the same number of rows (padded with rows without a target), so
every rank runs as many loss tiles (ZeRO-3 gathers each head once per tile on every
rank). The loss terms (per-modality sums and counts) are additive, so the global loss
and every gradient are those of the unbalanced loss; the hidden states' gradients travel
back through the reverse exchange.

Dims: T = b·n tokens of this rank, D hidden, M modalities, P ranks of the group, k rows
this rank receives (k_max the most any rank receives).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ulysses_mm.core.format import IGNORE
from ulysses_mm.model.llama import MultimodalLM
from ulysses_mm.parallel.mesh import Mesh


class _ExchangeRows(torch.autograd.Function):
    """All-to-all of rows with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, send: list[int], recv: list[int], group: Any
    ) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def share_bounds(total: Tensor, P: int) -> Tensor:
    """[M] totals -> [P + 1, M] bounds: rank j takes targets [bounds[j], bounds[j + 1])."""
    j = torch.arange(P + 1, dtype=torch.long)[:, None]
    return j * total[None, :] // P


def received_targets(every: Tensor, bounds: Tensor) -> Tensor:
    """[P(dest), P(source), M] targets each rank gets from each rank: the overlap of the
    source's targets [start, end) of a modality with the destination's share of it."""
    start = torch.cumsum(every, 0) - every  # [P, M] each source's first global index
    end = start + every
    lo, hi = bounds[:-1, None], bounds[1:, None]  # [P, 1, M] each destination's share
    return (torch.minimum(end, hi) - torch.maximum(start, lo)).clamp(min=0)


class TargetBalance:
    """Rearrange (hidden, labels, modality) so every rank of ``group`` (``size`` ranks,
    this one ``rank``) computes the loss of an equal share of every modality's targets.
    Set as ``model.target_exchange`` by :func:`apply_loss_balance`."""

    def __init__(self, group: Any, size: int, rank: int, modalities: int) -> None:
        self.group, self.P, self.rank, self.M = group, size, rank, modalities

    def __call__(
        self, hidden: Tensor, labels: Tensor, label_modality: Tensor, bins: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The rearranged (hidden [1, k_max, D], labels, label_modality, bins [1, k_max]);
        ``bins`` (a position bin per token, -1 for none: evaluation's) travel with their
        targets, and rows without a target get -1."""
        P, M, dev = self.P, self.M, hidden.device
        D = hidden.shape[-1]
        mods = torch.where(labels == IGNORE, -1, label_modality).reshape(-1)  # [T]
        rows = torch.nonzero(mods >= 0).flatten()  # positions with a target, in order
        m_rows = mods[rows]
        counts = torch.bincount(m_rows, minlength=M)  # [M]
        gathered = [torch.empty_like(counts) for _ in range(P)]
        dist.all_gather(gathered, counts, group=self.group)
        every = torch.stack(gathered).cpu()  # [P, M]: every rank's targets per modality
        bounds = share_bounds(every.sum(0), P)  # [P + 1, M]
        received = received_targets(every, bounds)  # [P(dest), P(source), M]
        k = received[self.rank].sum(1)  # rows this rank gets, per source
        k_max = int(received.sum((1, 2)).max())
        if k_max == 0:  # no target anywhere: every rank keeps its rows (as many tiles)
            return hidden, labels, label_modality, bins
        # where each of this rank's targets goes: its modality's global index among the
        # group's targets (ranks in order), against the ranks' shares
        offset = every[: self.rank].sum(0)  # [M] targets of this modality on ranks before
        index = torch.zeros_like(m_rows)
        for m in range(M):
            sel = m_rows == m
            index[sel] = torch.arange(int(sel.sum()), device=dev) + int(offset[m])
        b_rows = bounds.to(dev)[:, m_rows]  # [P + 1, targets]
        dest = (index[None, :] >= b_rows[1:]).sum(0)  # the share it falls in
        order = torch.argsort(dest * M + m_rows, stable=True)  # by destination, then modality
        send = torch.bincount(dest, minlength=P).tolist()
        rows = rows[order]
        h = _ExchangeRows.apply(
            hidden.reshape(-1, D).index_select(0, rows), send, k.tolist(), self.group
        )  # [k, D]: by source, each source's rows by modality
        columns = [labels.reshape(-1)[rows], mods[rows]]  # with each target: what it is
        if bins is not None:
            columns.append(bins.reshape(-1).to(mods.dtype)[rows])
        pair = torch.stack(columns, 1)  # [targets, 2 or 3]
        got = pair.new_empty((int(k.sum()), pair.shape[1]))
        dist.all_to_all_single(got, pair.contiguous(), k.tolist(), send, group=self.group)
        place = self._interleave(got[:, 1])  # the same mix in every tile
        # k_max rows on every rank: the rows without a target (zeros, no label) last
        h = h.new_zeros(k_max, D).index_copy(0, place, h)
        empty = got.new_tensor([IGNORE, -1, -1][: pair.shape[1]])
        out = empty.repeat(k_max, 1).index_copy_(0, place, got)
        moved_bins = out[None, :, 2].to(bins.dtype) if bins is not None else None
        return h[None], out[None, :, 0], out[None, :, 1], moved_bins

    def _interleave(self, m: Tensor) -> Tensor:
        """Where each received row (modality ``m``) goes so that every modality is spread
        evenly: row i of a modality with c rows is placed by (i + ½)/c."""
        key = torch.empty(len(m), dtype=torch.float64, device=m.device)
        for mod in range(self.M):
            sel = m == mod
            c = int(sel.sum())
            if c:
                key[sel] = (torch.arange(c, dtype=torch.float64, device=m.device) + 0.5) / c
        order = torch.argsort(key, stable=True)  # row order[i] goes to place i
        place = torch.empty_like(order)
        place[order] = torch.arange(len(order), device=m.device)
        return place


def apply_loss_balance(model: MultimodalLM, mesh: Mesh) -> MultimodalLM:
    """Spread the loss's targets evenly over the ranks of ``mesh``'s SP group, in place:
    every rank then computes the loss of an equal share of each modality's targets, so
    the ranks' loss working sets (and peaks) match. Sets ``model.target_exchange`` (an
    extra all-to-all before the heads) when ``mesh.sp`` > 1, clears it otherwise (a model
    laid out again)."""
    model.target_exchange = None
    if mesh.sp > 1:
        model.target_exchange = TargetBalance(
            mesh.sp_group, mesh.sp, mesh.sp_rank, len(model.space.ranges)
        )
    return model
