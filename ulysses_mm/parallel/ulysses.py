"""Ulysses sequence parallelism: attention over the full sequence on H/P heads.

Each rank holds N/P tokens. Before attention, one all-to-all scatters heads and gathers
the sequence (q, k and v travel together in ONE collective); the injected local kernel then
runs causal, document-masked attention over all N tokens on its heads; a second all-to-all
brings the output back to sequence shards. Autograd is exact: each all-to-all's backward is
the same exchange (see :mod:`comm`).

Dims: b batch, s full sequence, s/P local, P sp size, hq query heads, hk key/value heads,
e = lcm(hk, P) key/value heads after replication, d head dim, hc = hq/P + 2e/P heads
carried per rank in the packed exchange.

GQA/MQA with hk < P (or hk not a multiple of P): every kv head is repeated e/hk times, so
the e heads split evenly and rank r's query heads [r·hq/P, (r+1)·hq/P) find their kv head
among its e/P. This always works when P divides hq (lcm(hk, P) divides hq because hk and P
both do). Shapes that cannot work are refused before any collective is issued.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from ulysses_mm.model.attention import DocumentMask
from ulysses_mm.parallel.comm import CommStats, Exchange, Workspace, gather_heads, scatter_heads
from ulysses_mm.parallel.mesh import Mesh


def _divisors(n: int, limit: int = 128) -> list[int]:
    return [p for p in range(1, min(n, limit) + 1) if n % p == 0]


def check_heads(num_heads: int, sp: int) -> None:
    if num_heads % sp:
        raise ValueError(
            f"Ulysses needs the query heads ({num_heads}) divisible by the sequence-parallel "
            f"size sp={sp}; sp sizes that work with {num_heads} heads: {_divisors(num_heads)}"
        )


def check_sp_shapes(seq_len: int, num_heads: int, sp: int) -> None:
    """Refuse (before any process or collective starts) an sp that cannot split both the
    sequence and the query heads; the message lists the sp sizes that would work."""
    if seq_len % sp or num_heads % sp:
        works = [p for p in _divisors(num_heads) if seq_len % p == 0]
        what = []
        if num_heads % sp:
            what.append(f"the {num_heads} query heads")
        if seq_len % sp:
            what.append(f"the sequence of {seq_len} tokens")
        raise ValueError(
            f"sp={sp} does not divide {' and '.join(what)}; sp sizes that divide both "
            f"{num_heads} heads and {seq_len} tokens: {works}"
        )


def expanded_kv_heads(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """kv heads after replication so that they split evenly over ``sp`` ranks."""
    e = math.lcm(num_kv_heads, sp)
    assert num_heads % e == 0, (num_heads, num_kv_heads, sp)
    return e


class UlyssesAttention(nn.Module):
    """Wrap a local attention ``(q, k, v, DocumentMask) -> out`` for sequence parallelism."""

    def __init__(
        self,
        local: nn.Module,
        group: Any,
        num_heads: int,
        num_kv_heads: int,
        stats: CommStats | None = None,
        workspace: Workspace | None = None,
    ) -> None:
        super().__init__()
        self.local = local
        self.group = group
        self.sp = dist.get_world_size(group) if group is not None else 1
        check_heads(num_heads, self.sp)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.kv_expanded = expanded_kv_heads(num_heads, num_kv_heads, self.sp)
        self.stats = stats
        self.workspace = workspace or Workspace()

    def extra_repr(self) -> str:
        return f"sp={self.sp}, heads={self.num_heads}, kv_heads={self.num_kv_heads}->{self.kv_expanded}"

    def _check(self, q: Tensor, k: Tensor, mask: DocumentMask) -> None:
        # Every rank sees the same shapes, so all raise together, before any collective.
        _, n, hq, _ = q.shape
        if hq != self.num_heads or k.shape[2] != self.num_kv_heads:
            raise ValueError(
                f"expected {self.num_heads}/{self.num_kv_heads} heads, got {hq}/{k.shape[2]}"
            )
        if mask.seq_len != n * self.sp:
            works = [p for p in _divisors(self.num_heads) if mask.seq_len % p == 0]
            raise ValueError(
                f"sequence of {mask.seq_len} tokens cannot be split evenly over sp={self.sp} "
                f"(this rank holds {n}); sp sizes that divide both the sequence and the "
                f"{self.num_heads} heads: {works}"
            )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
        P = self.sp
        if P == 1:
            return self.local(q, k, v, mask)
        self._check(q, k, mask)
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


def apply_ulysses(model: nn.Module, mesh: Mesh, stats: CommStats | None = None) -> nn.Module:
    """Make every attention of ``model`` sequence-parallel over ``mesh.sp`` (in place).

    Works on any module tree whose attention modules carry ``num_heads``,
    ``num_kv_heads`` and an injected ``core`` (see :class:`ulysses_mm.model.llama.Attention`).
    Raises before any collective if the heads do not split over ``mesh.sp``."""
    attns: list[Any] = [
        m for m in model.modules() if hasattr(m, "core") and hasattr(m, "num_heads")
    ]
    if not attns:
        raise ValueError("apply_ulysses found no attention module with an injected 'core'")
    for attn in attns:
        check_heads(attn.num_heads, mesh.sp)
    if mesh.sp == 1:
        return model
    workspace = Workspace()  # one send buffer for every layer: exchanges never overlap
    for attn in attns:
        core = attn.core.local if isinstance(attn.core, UlyssesAttention) else attn.core
        attn.core = UlyssesAttention(
            core, mesh.sp_group, attn.num_heads, attn.num_kv_heads, stats, workspace
        )
    return model
