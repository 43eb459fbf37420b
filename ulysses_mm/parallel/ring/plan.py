"""The varlen calls of ring attention: which keys of a block each query may see.

Because every rank keeps its tokens in global order (the document zigzag of
:func:`ulysses_mm.parallel.slice.ring_order`), the keys a query may see in a block are one
contiguous span of that block (its document's keys up to its position). :func:`block_calls`
cuts a (query block, key block) pair into varlen segments that are either full (every
query of the segment sees the same keys) or causal aligned bottom-right (each next query
sees one key more): exactly flash-attn's varlen calls with ``causal=False`` /
``causal=True``. :class:`RingPlan` holds them for one batch, computed once per mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ulysses_mm.model.attention import DocumentMask
from ulysses_mm.parallel.slice import doc_spans, document_zigzag, ring_order


@dataclass
class VarlenCall:
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
    _pieces: dict[tuple[int, int], list[tuple[slice, slice, VarlenCall]]] = field(
        default_factory=dict, repr=False
    )

    def pieces(
        self, max_queries: int = 0, max_segments: int = 0
    ) -> list[tuple[slice, slice, VarlenCall]]:
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
                    VarlenCall(
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


def block_calls(q_idx: Tensor, q_start: Tensor, k_idx: Tensor) -> list[VarlenCall]:
    """The varlen calls (at most two: full, causal) that compute queries at global
    positions ``q_idx`` [b, nq] (their documents starting at ``q_start``) against keys at
    ``k_idx`` [b, nk] (both sorted per row). A query sees the keys of its document at or
    before it: one contiguous span [kstart, kend) of the key block. Consecutive queries
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
    calls = []
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
        calls.append(
            VarlenCall(
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
    return calls


@dataclass
class RingPlan:
    """What every ring rank needs about one batch's layout, computed once per mask:
    each ring rank's global token positions, their documents' starts, and the varlen
    calls of every (query rank, key rank) pair it meets."""

    idx: list[Tensor]  # [b, n] global positions per ring rank
    start: list[Tensor]  # [b, n] global start of each token's document
    calls: dict[tuple[int, int], list[VarlenCall]] = field(default_factory=dict)

    @classmethod
    def of(cls, mask: DocumentMask, ring_size: int) -> RingPlan:
        key = ("ring", ring_size)
        if key not in mask._cache:
            docs = mask.doc_index
            n = mask.seq_len // ring_size
            spans = doc_spans(docs)
            start = spans[1]
            order = document_zigzag(spans, ring_size) if ring_size > 1 else ring_order(docs, 1)
            idx = [order[:, j * n : (j + 1) * n].contiguous() for j in range(ring_size)]
            mask._cache[key] = cls(idx, [start.gather(1, i) for i in idx])
        plan: RingPlan = mask._cache[key]
        return plan

    def block(self, q_rank: int, k_rank: int) -> list[VarlenCall]:
        if (q_rank, k_rank) not in self.calls:
            self.calls[q_rank, k_rank] = block_calls(
                self.idx[q_rank], self.start[q_rank], self.idx[k_rank]
            )
        return self.calls[q_rank, k_rank]
