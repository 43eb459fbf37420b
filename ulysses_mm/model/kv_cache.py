"""Decoding one document a token at a time: a key/value cache, and the recompute baseline.

:class:`CachedDecoder` runs the prompt once (the prefill), keeping every layer's keys and
values (RoPE applied), then feeds one token per step: only that token goes through the
layers, and its query attends to the cached keys. :class:`RecomputeDecoder` runs the whole
sequence again at each step: the same hidden states, at a cost that grows with the
context (what the cache saves; ``benchmarks/bench_generate.py`` measures both).

The prefill calls each layer's injected attention ``core`` with a document mask, so a
model made sequence-parallel (:func:`ulysses_mm.parallel.apply_ulysses`) prefills with
its sequence-parallel kernel and each process keeps the keys and values of its own
tokens. A decode step's attention over cached keys returns its log-sum-exp beside its
output; ``merge`` (identity here; :mod:`ulysses_mm.parallel.decode` for caches split
over processes) combines partial results. This module knows nothing of process groups.

Dims: b batch, t tokens fed in a call, T tokens cached, hq/hk query/key-value heads,
d head dim, D hidden.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from ulysses_mm.model.attention import DocumentMask
from ulysses_mm.model.llama import DecoderLayer, MultimodalLM

# (partial output [b, t, hq, d] fp32, its log-sum-exp [b, t, hq] fp32) -> output [b, t, hq, d]
Merge = Callable[[Tensor, Tensor], Tensor]


def local_merge(out: Tensor, lse: Tensor) -> Tensor:
    """One process holds every cached key: its partial output is the output."""
    return out


class KVCache:
    """Per layer, keys and values [b, hk, capacity, d] (head-major, so a step's
    attention multiplies them as they lie) and how many are filled."""

    def __init__(
        self,
        layers: int,
        batch: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.capacity = capacity
        self.length = 0

    @classmethod
    def for_model(cls, model: MultimodalLM, batch: int, capacity: int) -> KVCache:
        p = next(model.parameters())
        attn = cast(DecoderLayer, model.model.layers[0]).self_attn
        return cls(
            len(model.model.layers),
            batch,
            capacity,
            attn.num_kv_heads,
            attn.head_dim,
            p.dtype,
            p.device,
        )

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Put k, v [b, t, hk, d] after the filled part (:meth:`advance` commits them)."""
        t = k.shape[1]
        if self.length + t > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} tokens is full ({self.length} + {t})")
        self.k[layer][:, :, self.length : self.length + t] = k.transpose(1, 2)
        self.v[layer][:, :, self.length : self.length + t] = v.transpose(1, 2)

    def view(self, layer: int, extra: int = 0) -> tuple[Tensor, Tensor]:
        """The filled keys and values of ``layer`` [b, hk, T, d] and ``extra`` written
        after them."""
        end = self.length + extra
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, t: int) -> None:
        self.length += t


def attend(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Queries [b, t, hq, d], the last t of the T cached keys/values [b, hk, T, d] ->
    (output [b, t, hq, d], log-sum-exp [b, t, hq]), both fp32; query i sees keys up to
    T - t + i. Products run in the cache's dtype, the softmax in fp32. No keys (T = 0):
    output 0, log-sum-exp -inf (a part that weighs nothing in a merge)."""
    b, t, hq, d = q.shape
    hk, T = k.shape[1], k.shape[2]
    rep = hq // hk
    # [b, t, hq, d] -> [b, hk, rep·t, d]: query head i reads kv head i // rep
    qh = q.to(k.dtype).permute(0, 2, 1, 3).reshape(b, hk, rep * t, d)
    scores = torch.matmul(qh, k.transpose(-1, -2)).float() / math.sqrt(d)  # [b, hk, rep·t, T]
    if t > 1:
        qpos = (T - t + torch.arange(t, device=q.device)).repeat(rep)  # [rep·t]
        allowed = torch.arange(T, device=q.device)[None, :] <= qpos[:, None]
        scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [b, hk, rep·t]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.matmul(probs.to(v.dtype), v).float()  # [b, hk, rep·t, d]
    out = out.reshape(b, hq, t, d).transpose(1, 2)  # -> [b, t, hq, d]
    return out, lse.reshape(b, hq, t).transpose(1, 2)  # [b, t, hq]


class CachedDecoder:
    """Prefill once, then one token per step through a :class:`KVCache`.

    ``keep`` (prefill): which of this process's prompt tokens go into the cache (the
    padding a sequence-parallel split adds does not); ``store`` (step): whether this
    process keeps the new token's keys and values (one process of a split cache does).
    ``stepwise``: :meth:`start` feeds the prompt through :meth:`step`."""

    def __init__(
        self,
        model: MultimodalLM,
        capacity: int,
        batch: int = 1,
        merge: Merge = local_merge,
        stepwise: bool = False,
    ) -> None:
        self.model = model
        self.layers = [cast(DecoderLayer, layer) for layer in model.model.layers]
        self.cache = KVCache.for_model(model, batch, capacity)
        self.merge = merge
        self.stepwise = stepwise  # prefill token by token, never calling the attention core
        self.position = 0  # the document position of the next token

    @torch.no_grad()
    def prefill(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        doc_ids: Tensor,
        keep: Tensor | None = None,
        positions: int | None = None,
    ) -> Tensor:
        """This process's prompt tokens input_ids/position_ids [b, n] (doc_ids [b, s] of
        the whole sequence) -> hidden states [b, n, D]; their keys and values (where
        ``keep`` [n] is True) go into the cache. ``positions``: the prompt's length
        (default n), where the first step continues."""
        bb = self.model.model
        mask = DocumentMask(doc_ids)
        x = bb.embed_tokens(input_ids)  # [b, n, D]
        cos, sin = bb.rotary_emb(position_ids, x.dtype)
        kept = 0
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, cos, sin)  # [b, n, h, d]
            ks, vs = (k, v) if keep is None else (k[:, keep], v[:, keep])
            self.cache.write(i, ks, vs)
            kept = ks.shape[1]
            o = layer.self_attn.core(q, k, v, mask)  # [b, n, hq, d]
            x = layer.after_attention(x, o)
        self.cache.advance(kept)
        self.position = input_ids.shape[1] if positions is None else positions
        return bb.norm(x)

    def start(self, input_ids: Tensor) -> Tensor:
        """A prompt [b, n] (one document from its ``<doc>``) -> its last hidden state [b, D].
        ``stepwise``: one token at a time (one process of a sequence-parallel model, whose
        attention core would wait for the others)."""
        b, n = input_ids.shape
        if self.stepwise:
            for i in range(n):
                hidden = self.step(input_ids[:, i : i + 1])
            return hidden
        pos = torch.arange(n, device=input_ids.device).expand(b, n)
        return self.prefill(input_ids, pos, torch.zeros_like(input_ids))[:, -1]

    @torch.no_grad()
    def step(self, input_ids: Tensor, store: bool = True) -> Tensor:
        """One token per row, input_ids [b, 1], at the next position -> hidden [b, D]."""
        bb = self.model.model
        b = input_ids.shape[0]
        x = bb.embed_tokens(input_ids)  # [b, 1, D]
        pos = torch.full((b, 1), self.position, dtype=torch.long, device=input_ids.device)
        cos, sin = bb.rotary_emb(pos, x.dtype)
        extra = 1 if store else 0
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, cos, sin)  # [b, 1, h, d]
            if store:
                self.cache.write(i, k, v)
            ks, vs = self.cache.view(i, extra)  # [b, hk, T, d]
            out, lse = attend(q, ks, vs)
            o = self.merge(out, lse).to(x.dtype)  # [b, 1, hq, d]
            x = layer.after_attention(x, o)
        self.cache.advance(extra)
        self.position += 1
        return bb.norm(x)[:, 0]


class RecomputeDecoder:
    """The baseline without a cache: every step runs the whole sequence again (one
    document) and returns the last token's hidden state."""

    def __init__(self, model: MultimodalLM) -> None:
        self.model = model
        self.ids: Tensor | None = None

    @torch.no_grad()
    def _run(self) -> Tensor:
        assert self.ids is not None
        b, n = self.ids.shape
        pos = torch.arange(n, device=self.ids.device).expand(b, n)
        doc = torch.zeros_like(self.ids)
        return self.model.hidden_states(self.ids, pos, doc)  # [b, n, D]

    def start(self, input_ids: Tensor) -> Tensor:
        """A prompt [b, n] -> its last hidden state [b, D]."""
        self.ids = input_ids
        return self._run()[:, -1]

    def step(self, input_ids: Tensor) -> Tensor:
        """One more token per row [b, 1] -> its hidden state [b, D]."""
        assert self.ids is not None
        self.ids = torch.cat([self.ids, input_ids], dim=1)
        return self._run()[:, -1]
