"""Ulysses sequence parallelism: attention over the full sequence on H/P heads.

Each rank holds N/P tokens. Before attention, one all-to-all scatters heads and gathers
the sequence (q, k and v travel together in ONE collective); the injected local kernel then
runs causal, document-masked attention over all N tokens on its heads; a second all-to-all
brings the output back to sequence shards. Autograd is exact: each all-to-all's backward is
the same exchange (see :mod:`comm`).

Dims: b batch, s full sequence, s/P local, P the Ulysses group's size (``ulysses_size``;
the whole SP group's, sp, without a ring), hq query heads, hk key/value heads,
e = lcm(hk, P) key/value heads after replication, d head dim, hc = hq/P + 2e/P heads
carried per rank in the packed exchange.

GQA/MQA with hk < P (or hk not a multiple of P): every kv head is repeated e/hk times, so
the e heads split evenly and rank r's query heads [r·hq/P, (r+1)·hq/P) find their kv head
among its e/P. This always works when P divides hq (lcm(hk, P) divides hq because hk and P
both do). Shapes that cannot work are refused before any collective is issued.

Hybrid (``mesh.ring_size`` = R > 1): the all-to-all runs over the Ulysses group of
U = sp/R consecutive ranks and the local kernel is :class:`~ulysses_mm.parallel.ring.RingAttention`
across the R Ulysses groups (each rank then holds N/(U·R) tokens; kv heads are replicated
to lcm(hk, U)).

Head groups (``head_groups`` = C > 1, set by ``parallel.head_groups``, also without
sequence parallelism): the exchange and the kernel run for one group of hq/(U·C) query
heads at a time, each recomputed in backward (:mod:`ulysses_mm.parallel.head_groups`).

Pieces of the sequence have one word each: a *tile* is a piece of this rank's tokens
that memory-saving code recomputes (:mod:`ulysses_mm.model.tiling`), a *block* the tokens
of one ring rank (:mod:`ulysses_mm.parallel.ring`), a *head group* a share of the heads.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import torch.distributed as dist
from torch import Tensor, nn

from ulysses_mm.core.layout import Layout, LayoutError, expanded_kv_heads, valid_sp_sizes
from ulysses_mm.model.attention import DocumentMask, LocalAttention
from ulysses_mm.model.llama import Attention, DecoderLayer, MultimodalLM
from ulysses_mm.parallel.comm import CommStats, Exchange, Workspace, gather_heads, scatter_heads
from ulysses_mm.parallel.head_groups import GroupRun, HeadGroups, grouped_attention
from ulysses_mm.parallel.mesh import Mesh
from ulysses_mm.parallel.ring import RingAttention


class UlyssesAttention(nn.Module):
    """Wrap a local attention ``(q, k, v, DocumentMask) -> out`` for sequence parallelism
    over the ``ulysses_size`` ranks of ``group`` (None: one rank, where only
    ``head_groups`` > 1 changes anything); ``ring_size``: the ring the local kernel runs
    across (the sequence is N / (ulysses_size · ring_size) tokens per rank)."""

    def __init__(
        self,
        local: nn.Module,
        group: Any,
        num_heads: int,
        num_kv_heads: int,
        stats: CommStats | None = None,
        workspace: Workspace | None = None,
        ring_size: int = 1,
        head_groups: int = 1,
    ) -> None:
        super().__init__()
        self.local = local
        self.group = group
        self.ulysses_size = dist.get_world_size(group) if group is not None else 1
        self.ring_size = ring_size
        U = self.ulysses_size
        layout = Layout(sp=U * ring_size, ring_size=ring_size, head_groups=head_groups)
        layout.check(num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.kv_expanded = expanded_kv_heads(num_heads, num_kv_heads, U)
        self.stats = stats
        self.workspace = workspace or Workspace()
        self.head_groups = head_groups
        self.grouping = HeadGroups(U, num_heads, num_kv_heads, self.kv_expanded, head_groups)

    def extra_repr(self) -> str:
        groups = f", head_groups={self.head_groups}" if self.head_groups > 1 else ""
        return (
            f"ulysses_size={self.ulysses_size}, heads={self.num_heads}, "
            f"kv_heads={self.num_kv_heads}->{self.kv_expanded}{groups}"
        )

    def _check(self, q: Tensor, k: Tensor, mask: DocumentMask) -> None:
        # Every rank sees the same shapes, so all raise together, before any collective.
        _, n, hq, _ = q.shape
        if hq != self.num_heads or k.shape[2] != self.num_kv_heads:
            raise ValueError(
                f"expected {self.num_heads}/{self.num_kv_heads} heads, got {hq}/{k.shape[2]}"
            )
        if mask.seq_len != n * self.ulysses_size * self.ring_size:
            works = valid_sp_sizes(self.num_heads, mask.seq_len)
            raise LayoutError(
                f"sequence of {mask.seq_len} tokens cannot be split evenly over "
                f"sp={self.ulysses_size * self.ring_size} "
                f"(this rank holds {n}); sp sizes that divide both the sequence and the "
                f"{self.num_heads} heads: {works}"
            )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
        P = self.ulysses_size
        if P == 1 and self.head_groups == 1:
            return self.local(q, k, v, mask)
        self._check(q, k, mask)
        if self.head_groups > 1:
            # one group of heads at a time; the send buffers are made per exchange
            ex = Exchange(self.group, P, None, self.stats) if P > 1 else None
            return grouped_attention(GroupRun(self.local, mask, self.grouping, ex), q, k, v)
        rep = self.kv_expanded // self.num_kv_heads
        if rep > 1:
            # [b, s/P, hk, d] -> [b, s/P, e, d]: kv head j becomes heads j·rep .. j·rep+rep-1
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        ex = Exchange(self.group, P, self.workspace, self.stats)
        # q, k, v in ONE exchange: [b, s/P, h, d] -> [b, s, h/P, d] each (views of what arrived)
        ql, kl, vl = scatter_heads(ex, q, k, v)
        out = self.local(ql, kl, vl, mask)  # [b, s, hq/P, d]
        (back,) = gather_heads(ex, out)  # -> [b, s/P, hq, d]
        return back


def attention_modules(model: MultimodalLM) -> list[Attention]:
    """The attention of every decoder layer, by its path on the model
    (``model.layers[i].self_attn``: transformers' Llama layout)."""
    return [cast(DecoderLayer, layer).self_attn for layer in model.model.layers]


def _seen_length(group: Any) -> Any:
    """The longest position + 1 of the whole sequence from one rank's slice (dynamic NTK
    RoPE rescales by it, so every rank of the SP group must see the same)."""

    def seen(local: Tensor) -> Tensor:
        out = local.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        return out

    return seen


def apply_ulysses(
    model: MultimodalLM,
    mesh: Mesh,
    stats: CommStats | None = None,
    ring_stats: dict[str, int] | None = None,
    head_groups: int | None = None,
) -> MultimodalLM:
    """Make every decoder layer's attention kernel (``model.layers[i].self_attn.core``)
    sequence-parallel over ``mesh.sp`` = U × R ranks, in place: Ulysses over the
    U = ``mesh.ulysses_size`` ranks of the Ulysses group and, when ``mesh.ring_size`` = R > 1,
    ring attention across the R groups (``ring_stats`` counts its bytes); with
    C = ``head_groups`` > 1 (default the mesh's layout's) in C groups of heads (also at
    sp = 1), and the RoPE's view of the sequence's length made the SP group's (the loss's
    balance over the SP group is :func:`~ulysses_mm.parallel.apply_loss_balance`'s). Raises
    before any collective if the heads do not split over U (and C).

    A model laid out before is laid out again (a run moving to its next stage): every
    layer goes back to its local kernel first, so the new layout replaces the old."""
    layout = mesh.layout if head_groups is None else replace(mesh.layout, head_groups=head_groups)
    attns = attention_modules(model)
    for heads in dict.fromkeys((a.num_heads, a.num_kv_heads) for a in attns):
        layout.check(*heads)
    for attn in attns:  # back to the local kernel of a layout applied before
        core = attn.core.local if isinstance(attn.core, UlyssesAttention) else attn.core
        attn.core = LocalAttention(core.kernel) if isinstance(core, RingAttention) else core
    model.model.rotary_emb.seen_length = _seen_length(mesh.sp_group) if mesh.sp > 1 else None
    if mesh.sp == 1 and layout.head_groups == 1:
        return model
    workspace = Workspace()  # one send buffer for every layer: exchanges never overlap
    for attn in attns:
        core = attn.core
        if mesh.ring_size > 1:
            kernel = core.kernel if isinstance(core, LocalAttention) else "auto"
            core = RingAttention(
                mesh.ring_group, mesh.ring_members, mesh.ring_rank, ring_stats, kernel
            )
        attn.core = UlyssesAttention(
            core,
            mesh.ulysses_group,
            attn.num_heads,
            attn.num_kv_heads,
            stats,
            workspace,
            ring_size=mesh.ring_size,
            head_groups=layout.head_groups,
        )
    return model
