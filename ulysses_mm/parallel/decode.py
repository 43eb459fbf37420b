"""Decoding with a prompt split over the sequence-parallel group: a prompt longer than one
device holds is prefilled by the Ulysses model, and its key/value cache stays split.

Prefill: the prompt (padded to a multiple of the group with ``<pad>`` in a document of
its own, which no prompt token sees) is laid out as training lays out a sample
(:func:`~ulysses_mm.parallel.slice.sp_slice`'s order), each rank runs its N/P tokens
through the sequence-parallel model and keeps its prompt tokens' keys and values. The
hidden state of the last prompt token goes from the rank holding it to every rank.

Steps: every rank runs the new token through the token-wise parts (the same input, so the
same result); attention is split: each rank attends over its own cached keys, returning
its output and log-sum-exp, and one all-gather per layer merges the parts exactly
(``o = Σ_r e^{lse_r - lse} o_r``). The new token's keys and values go to one rank, in
turn. The sampled id is rank 0's, broadcast, so every rank continues with it.

Dims: b batch, t tokens, hq heads, d head dim, P the group's size, N the padded prompt.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ulysses_mm.core.tokenspace import PAD
from ulysses_mm.model.kv_cache import CachedDecoder
from ulysses_mm.model.llama import MultimodalLM
from ulysses_mm.parallel.mesh import Mesh
from ulysses_mm.parallel.slice import sp_index


def padded_length(n: int, sp: int, ring: int = 1) -> int:
    """The smallest length >= n + 1 that the layout splits evenly (one pad at least, so
    the padding is a document of its own even when n already fits)."""
    unit = sp * (2 if ring > 1 else 1)
    return -(-(n + 1) // unit) * unit


class SequenceParallelDecoder:
    """A :class:`~ulysses_mm.model.kv_cache.CachedDecoder` over a model made
    sequence-parallel by :func:`~ulysses_mm.parallel.apply_ulysses` on ``mesh``."""

    def __init__(self, model: MultimodalLM, mesh: Mesh, prompt: int, new_tokens: int) -> None:
        self.mesh = mesh
        self.sp = mesh.sp
        self.group = mesh.sp_group
        self.root = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        capacity = (
            padded_length(prompt, self.sp, mesh.ring_size) // self.sp + new_tokens // self.sp + 1
        )
        self.inner = CachedDecoder(model, capacity, merge=self.merge)
        self.steps = 0

    def merge(self, out: Tensor, lse: Tensor) -> Tensor:
        """Every rank's partial attention [b, t, hq, d] (fp32) and log-sum-exp [b, t, hq]
        -> the attention over all cached keys, in one all-gather."""
        flat = torch.cat([out.flatten(), lse.flatten()])
        parts = [torch.empty_like(flat) for _ in range(self.sp)]
        dist.all_gather(parts, flat, group=self.group)
        stacked = torch.stack(parts)  # [P, b·t·hq·d + b·t·hq]
        outs = stacked[:, : out.numel()].view(self.sp, *out.shape)  # [P, b, t, hq, d]
        lses = stacked[:, out.numel() :].view(self.sp, *lse.shape)  # [P, b, t, hq]
        top = lses.max(dim=0).values  # [b, t, hq]
        w = torch.exp(lses - top).nan_to_num(0.0)  # a rank without keys weighs 0
        return (w[..., None] * outs).sum(0) / w.sum(0)[..., None]

    def start(self, input_ids: Tensor) -> Tensor:
        """The prompt [1, n], whole on every rank -> the last token's hidden state [1, D]."""
        b, n = input_ids.shape
        total = padded_length(n, self.sp, self.mesh.ring_size)
        device = input_ids.device
        ids = torch.full((b, total), PAD, dtype=torch.long, device=device)
        ids[:, :n] = input_ids
        doc = torch.ones((b, total), dtype=torch.long, device=device)
        doc[:, :n] = 0  # the padding is a document of its own
        pos = torch.arange(total, device=device)
        pos = torch.where(pos < n, pos, pos - n).expand(b, total)
        idx = sp_index(doc, self.mesh.sp_rank, self.sp, self.mesh.ring_size)[0]
        keep = idx < n
        hidden = self.inner.prefill(ids[:, idx], pos[:, idx], doc, keep=keep, positions=n)
        last = torch.zeros_like(hidden[:, 0])
        here = torch.nonzero(idx == n - 1).flatten()
        if here.numel():
            last = hidden[:, int(here[0])]
        dist.all_reduce(last, group=self.group)  # only the holder's is not zero
        return last

    def step(self, input_ids: Tensor) -> Tensor:
        owner = self.steps % self.sp == self.mesh.sp_rank
        self.steps += 1
        return self.inner.step(input_ids, store=owner)

    def agree(self, token: int) -> int:
        """Rank 0's id, on every rank."""
        t = torch.tensor([token], dtype=torch.long)
        if dist.get_backend(self.group) == "nccl":
            t = t.cuda()
        dist.broadcast(t, src=self.root, group=self.group)
        return int(t.item())
