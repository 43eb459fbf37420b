"""Sampling a document's continuation within one modality's head.

Each step asks the tokenizer's :class:`~ulysses_mm.tokenize.grammar.Grammar` what may come
next: an id it forces (a video frame's ``<eof>``, the ``<|audio|>`` that opens a clip's
interleaved audio) is taken as is; otherwise the logits of the head it names (that
modality's specials and range, :meth:`ModalityHeads.logits`) are restricted to the ids it
allows and sampled (temperature, top-k, top-p) with a generator seeded once, on the CPU,
so a seed gives the same ids on any device whose logits agree. ``</doc>`` ends the
document early where the grammar allows it.

The decoder (:class:`~ulysses_mm.model.kv_cache.CachedDecoder`, the recompute baseline,
or the sequence-parallel one of :mod:`ulysses_mm.parallel.decode`) turns ids into hidden
states; its ``agree`` makes every process continue with the same id (a single process
keeps its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from ulysses_mm.core.tokenspace import DOC_END
from ulysses_mm.model.llama import MultimodalLM
from ulysses_mm.tokenize.grammar import Grammar, Next


class Decoder(Protocol):
    def start(self, input_ids: Tensor) -> Tensor:
        """A prompt [1, n] -> the hidden state [1, D] that predicts the next id."""
        ...

    def step(self, input_ids: Tensor) -> Tensor:
        """The id just chosen [1, 1] -> the hidden state [1, D] that predicts the next."""
        ...


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every allowed id."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Generated:
    """The ids after the prompt (``</doc>`` last when the model ended the document) and
    how many of them were sampled (the rest were forced by the grammar)."""

    ids: list[int] = field(default_factory=list)
    sampled: int = 0

    @property
    def ended(self) -> bool:
        return bool(self.ids) and self.ids[-1] == DOC_END


def allowed_mask(nxt: Next, model: MultimodalLM) -> Tensor:
    """Boolean [specials + V_head] over the head's ids: what ``nxt`` allows."""
    space = model.space
    ns, r = space.num_specials, space.range(nxt.head)
    mask = torch.zeros(ns + r.size, dtype=torch.bool)
    mask[ns + nxt.lo - r.start : ns + nxt.hi - r.start] = True
    for s in nxt.specials:
        mask[s] = True
    return mask


def pick(logits: Tensor, mask: Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """An index of ``logits`` [V] (fp32, CPU) where ``mask`` is True."""
    x = logits.float().masked_fill(~mask, -torch.inf)
    if sampling.temperature <= 0:
        return int(torch.argmax(x))
    x = x / sampling.temperature
    if 0 < sampling.top_k < int(mask.sum()):
        kth = torch.topk(x, sampling.top_k).values[-1]
        x = x.masked_fill(x < kth, -torch.inf)
    probs = torch.softmax(x, dim=-1)
    if sampling.top_p < 1.0:
        p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(p, 0) - p  # mass of the ids ranked above each
        drop = order[before >= sampling.top_p]  # the best id always stays
        probs[drop] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator))


def head_id(index: int, head: str, model: MultimodalLM) -> int:
    """A head's output index -> the unified token id."""
    ns = model.space.num_specials
    return index if index < ns else model.space.range(head).start + index - ns


def agree_local(token: int) -> int:
    return token


@torch.no_grad()
def generate(
    model: MultimodalLM,
    decoder: Decoder,
    grammar: Grammar,
    prompt: list[int],
    new_tokens: int,
    sampling: Sampling,
    agree: Callable[[int], int] = agree_local,
) -> Generated:
    """Up to ``new_tokens`` ids after ``prompt`` (a document's ids from its ``<doc>``)."""
    for t in prompt:
        grammar.feed(int(t))
    device = next(model.parameters()).device
    hidden = decoder.start(torch.tensor([prompt], dtype=torch.long, device=device))
    generator = torch.Generator().manual_seed(sampling.seed)
    out = Generated()
    for i in range(new_tokens):
        nxt = grammar.next()
        if nxt.forced is not None:
            token = nxt.forced
        else:
            logits = model.heads.logits(hidden, nxt.head)[0].float().cpu()  # [ns + V]
            index = pick(logits, allowed_mask(nxt, model), sampling, generator)
            token = head_id(index, nxt.head, model)
            out.sampled += 1
        token = int(agree(token))
        out.ids.append(token)
        grammar.feed(token)
        if token == DOC_END:
            break
        if i + 1 < new_tokens:
            hidden = decoder.step(torch.tensor([[token]], dtype=torch.long, device=device))
    return out
