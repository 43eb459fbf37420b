"""Input sharding for sequence parallelism: which tokens each SP rank holds.

:func:`sp_slice` keeps rank r's tokens ``[r·N/P, (r+1)·N/P)`` of every per-token field but
the full ``doc_ids``, which the attention kernel needs after the all-to-all. Labels are
shifted before slicing (:func:`ulysses_mm.loader.batch.make_batch`), so the label at a
slice boundary is kept.

With a ring (R > 1) each row is first put in the ring layout, the document zigzag that
balances causal work: every document of a packed sample is cut into 2R consecutive slots
(sizes differing by at most one; the remainders of successive documents go round the
slots, so each slot of the sample holds exactly N/2R tokens); ring rank j holds slots j
and 2R−1−j of every document, in global order (:func:`ring_order`). With one document
this is the classic zigzag of chunks j and 2R−1−j. Inside a Ulysses group of U ranks the
N/R tokens of a ring rank are split contiguously: SP rank ``j·U + u`` holds
``ring_order(...)[:, (j·U+u)·N/sp : ...]``. At R = 1 the order is the identity.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ulysses_mm.core.layout import Layout
from ulysses_mm.loader.batch import Batch
from ulysses_mm.model.attention import DocumentMask


def sp_slice(batch: Batch, sp_rank: int, sp: int, ring_size: int = 1) -> Batch:
    """Rank ``sp_rank`` of ``sp``: its contiguous 1/sp of every per-token field (of the
    ring layout, :func:`ring_order`, when ``ring_size`` > 1); doc_ids
    stay whole."""
    n = batch.input_ids.shape[-1]
    Layout(sp=sp, ring_size=ring_size).check(seq_len=n)
    if sp == 1:
        return batch
    chunk = n // sp
    if ring_size == 1:
        sl = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
        take = lambda t: t[:, sl]  # noqa: E731
    else:
        idx = sp_index(batch.doc_ids, sp_rank, sp, ring_size)
        take = lambda t: t.gather(1, idx)  # noqa: E731
    return replace(
        batch,
        input_ids=take(batch.input_ids),
        position_ids=take(batch.position_ids),
        labels=take(batch.labels),
        label_modality=take(batch.label_modality),
    )


def sp_index(doc_ids: Tensor, sp_rank: int, sp: int, ring_size: int = 1) -> Tensor:
    """[b, N/sp] the positions of each row of ``doc_ids`` [b, N] that rank ``sp_rank``
    holds, in the order :func:`sp_slice` gives it."""
    chunk = doc_ids.shape[-1] // sp
    order = ring_order(DocumentMask(doc_ids).doc_index, ring_size)  # the identity at ring_size 1
    return order[:, sp_rank * chunk : (sp_rank + 1) * chunk]


def doc_spans(doc_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(per token of ``doc_index`` [b, N]: its document's index over the flattened batch and
    its document's global start in its row, both [b, N]; each document's length [docs])."""
    b, n = doc_index.shape
    flat = (
        doc_index.long() + torch.arange(b, device=doc_index.device)[:, None] * (n + 1)
    ).flatten()
    _, inverse, lengths = torch.unique_consecutive(flat, return_inverse=True, return_counts=True)
    starts = torch.cumsum(lengths, 0) - lengths  # flat start of each document
    row_start = (torch.arange(b, device=doc_index.device) * n)[:, None]
    doc = inverse.view(b, n)
    return doc, starts[doc] - row_start, lengths


def ring_order(doc_index: Tensor, ring_size: int) -> Tensor:
    """[b, N] permutation of each row whose consecutive N/R pieces are the ring ranks'
    tokens (document zigzag, see the module docstring); needs N % 2R == 0."""
    b, n = doc_index.shape
    if ring_size == 1:
        return torch.arange(n, device=doc_index.device).expand(b, n).clone()
    return document_zigzag(doc_spans(doc_index), ring_size)


def document_zigzag(spans: tuple[Tensor, Tensor, Tensor], ring_size: int) -> Tensor:
    """:func:`ring_order` (R > 1) from :func:`doc_spans`' output."""
    doc, start, d_len = spans
    b, n = doc.shape
    pos = torch.arange(n, device=doc.device).expand(b, n)
    s = 2 * ring_size
    if n % s:
        raise ValueError(f"ring={ring_size} needs a sequence divisible by {s}, got {n}")
    # per document: base slot size and the remainder's first slot (remainders go round)
    rem = d_len % s
    c = (torch.cumsum(rem, 0) - rem) % s
    base = d_len // s
    offset = pos - start
    slot = torch.zeros_like(offset)
    for k in range(1, s):
        # slot boundary k: k·base + how many of the rem extra tokens fall in slots < k
        wrap = torch.clamp(torch.clamp(c + rem - s, max=k), min=0)
        extra = torch.clamp(torch.clamp(c + rem, max=k) - c, min=0)
        bound = k * base + extra + wrap
        slot += offset >= bound[doc]
    pair = torch.minimum(slot, s - 1 - slot)  # slots j and s-1-j: one rank's zigzag pair
    return torch.argsort(pair * n + pos, dim=1)


def zigzag_order(seq_len: int, ring_size: int) -> Tensor:
    """:func:`ring_order` of one document filling the sequence: ring rank j's tokens are
    chunks j and 2R−1−j of 2R."""
    return ring_order(torch.zeros(1, seq_len, dtype=torch.long), ring_size)[0]


def _allowed(q_idx: Tensor, q_doc: Tensor, k_idx: Tensor, k_doc: Tensor) -> Tensor:
    """[b, nq, nk] boolean: same document and key not in the future (idx, doc: [b, n])."""
    causal = k_idx[:, None, :] <= q_idx[:, :, None]
    return causal & (q_doc[:, :, None] == k_doc[:, None, :])


def unmasked_pairs(doc_ids: Tensor, ring_size: int, contiguous: bool = False) -> list[int]:
    """Per ring rank, the query-key pairs its attention computes (causal, document-masked)
    over ``doc_ids`` [b, N]: the work each rank of the ring does. ``contiguous`` counts
    the plain N/R split instead of the ring layout (to show the imbalance it removes)."""
    docs = DocumentMask(doc_ids).doc_index
    b, n = docs.shape
    order = (
        torch.arange(n, device=docs.device).expand(b, n)
        if contiguous
        else ring_order(docs, ring_size)
    )
    every = torch.arange(n, device=docs.device).expand(b, n)
    counts = []
    for j in range(ring_size):
        idx = order[:, j * n // ring_size : (j + 1) * n // ring_size]
        counts.append(int(_allowed(idx, docs.gather(1, idx), every, docs).sum()))
    return counts
