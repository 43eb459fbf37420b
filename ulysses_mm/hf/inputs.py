"""Model inputs in the Hugging Face convention, and their one split over a sequence-parallel
group for our attention backend.

A sample is ``input_ids``, ``position_ids`` that restart at every document, and the
targets twice: ``labels`` in the transformers convention (the model shifts them: ignored
at every document's first token and at pads) and ``shift_labels`` already shifted (the
target of token t is token t + 1 of its document; what DeepSpeed's sequence-parallel
adapter and the Trainer's sequence-parallel loss read). Shifting ``labels`` by one gives
``shift_labels`` exactly, so every consumer sees the same targets.

Documents are the spans of consecutive positions: a new one starts wherever
``position_ids[t] != position_ids[t - 1] + 1``, transformers' own rule for packed
sequences (``masking_utils.find_packed_sequence_indices``). The packer starts every
document at position 0, except a long document's continuation at the very start of a
sample, so the rule finds exactly the packed documents.

:func:`shard_inputs` keeps this SP rank's tokens of a batch of whole samples (the slice
of :func:`~ulysses_mm.parallel.slice.sp_slice`, in the ring layout when ``ring`` > 1;
targets shifted before the slice) and describes the whole sequence's documents to the
backend as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (transformers' flash-attention keywords),
which every layer receives, so no layer has to gather the positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ulysses_mm.core.format import IGNORE
from ulysses_mm.loader.batch import Batch
from ulysses_mm.parallel.mesh import Mesh
from ulysses_mm.parallel.slice import doc_spans, sp_slice


def document_ids(position_ids: Tensor) -> Tensor:
    """[b, N] index of each token's document in its row, counted from 0 (a new document
    wherever the position does not follow the previous one by one)."""
    step = torch.diff(position_ids, dim=-1) != 1
    start = torch.zeros_like(position_ids, dtype=torch.int32)
    start[..., 1:] = step.to(torch.int32)
    return torch.cumsum(start, dim=-1, dtype=torch.int32)


def cu_seq_lens(doc_ids: Tensor) -> Tensor:
    """int32 [documents + 1]: where each document of the flattened [b, N] batch starts,
    and the total (flash-attention's ``cu_seqlens``; documents never span rows)."""
    lengths = doc_spans(doc_ids)[2]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=doc_ids.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu


def documents_from_cu(cu: Tensor, batch: int, seq_len: int) -> Tensor:
    """[batch, seq_len] document index of every token from ``cu_seq_lens`` over the
    flattened batch (the inverse of :func:`cu_seq_lens`)."""
    total = int(cu[-1])
    if total != batch * seq_len:
        raise ValueError(
            f"cu_seq_lens covers {total} tokens but the batch holds {batch} × {seq_len}"
        )
    tokens = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu[1:].to(tokens.dtype), tokens, right=True)
    return doc.view(batch, seq_len).to(torch.int32)


def shifted(labels: Tensor) -> Tensor:
    """``shift_labels`` from transformers-convention ``labels``: position t's target is
    label t + 1; the last position has none."""
    out = torch.full_like(labels, IGNORE)
    out[..., :-1] = labels[..., 1:]
    return out


def shard_inputs(batch: Mapping[str, Any], mesh: Mesh) -> dict[str, Any]:
    """This SP rank's model inputs from a batch of whole samples (``input_ids``,
    ``position_ids`` and ``shift_labels`` or ``labels``, each [b, N]).

    Returns ``input_ids``, ``position_ids`` and ``shift_labels`` of its N/sp tokens,
    ``labels`` equal to ``shift_labels`` (so a transformers model computes the loss on
    exactly those targets), and ``cu_seq_lens_q/k``, ``max_length_q/k`` describing the
    documents of the whole sequence (in global order) for the ``ulysses_mm`` backend.
    Every SP rank of a group must pass the same samples."""
    input_ids = torch.as_tensor(batch["input_ids"])
    position_ids = torch.as_tensor(batch["position_ids"])
    if input_ids.ndim == 1:
        input_ids, position_ids = input_ids[None], position_ids[None]
    if "shift_labels" in batch:
        targets = torch.as_tensor(batch["shift_labels"]).view_as(input_ids)
    else:
        targets = shifted(torch.as_tensor(batch["labels"]).view_as(input_ids))
    doc_ids = document_ids(position_ids)
    full = Batch(input_ids, position_ids, targets, torch.zeros_like(targets), doc_ids)
    local = sp_slice(full, mesh.sp_rank, mesh.sp, mesh.ring_size)
    cu = cu_seq_lens(doc_ids)
    longest = int(torch.diff(cu).max())
    targets = local.labels.contiguous()
    return {
        "input_ids": local.input_ids.contiguous(),
        "position_ids": local.position_ids.contiguous(),
        "labels": targets,
        "shift_labels": targets,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }
