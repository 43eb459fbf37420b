"""``attn_implementation="ulysses_mm"`` on real gloo groups against transformers itself.

The reference is the unmodified transformers model (SDPA) in one process, run on every
document of every packed sample separately (so it cannot attend across documents): its
token-weighted mean loss and every parameter's gradient, fp32. The same weights with our
backend on a world of 4 give the same loss and gradients for: Llama at sp=2 × dp=2
(documents from cu_seq_lens), Qwen2 at sp=4 (2 kv heads < 4 ranks: replicated; documents
from the gathered position_ids alone), Qwen3 with 2 query heads at sp=4 = 2 × ring 2 (sp
above the head count), Mistral at sp=4 = 2 × ring 2. Samples hold documents that cross
rank and zigzag boundaries, one-token documents, a continued document at the start and a
pad tail. One world for the module.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo import run_distributed
from hf_models import tiny_hf_model
from torch.testing import assert_close

from ulysses_mm.core.errors import UnsupportedError
from ulysses_mm.core.format import IGNORE
from ulysses_mm.core.layout import Layout, LayoutError

VOCAB = 96
TOL = dict(rtol=1e-5, atol=1e-6)
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    head_dim=16,
    rms_norm_eps=1e-6,
)


def _model(kind: str, heads: int, kv_heads: int, attn: str, seed: int = 0):
    model = tiny_hf_model(
        kind, seed, 0.05, num_attention_heads=heads, num_key_value_heads=kv_heads, **SHAPE
    )
    model.set_attn_implementation(attn)
    return model


def _sample(seq_len: int, lengths: list[int], seed: int, first_offset: int = 0):
    """input_ids, position_ids and shift_labels [N] of documents of ``lengths`` then a pad
    tail; the first document continues one that began ``first_offset`` tokens earlier."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (seq_len,), generator=g)
    pos, targets, spans, at = [], torch.full((seq_len,), IGNORE), [], 0
    for i, n in enumerate(lengths):
        start = first_offset if i == 0 else 0
        pos.append(torch.arange(start, start + n))
        targets[at : at + n - 1] = ids[at + 1 : at + n]
        spans.append((at, at + n, start))
        at += n
    pad = seq_len - at
    ids[at:] = 0
    pos.append(torch.arange(pad))  # the pad tail: one run of its own, no targets
    return ids, torch.cat(pos), targets, spans


def _reference(model, samples):
    """Loss and gradients of transformers' own model, one document at a time."""
    model.zero_grad()
    count = 0
    losses = []
    for ids, _, targets, spans in samples:
        for s, e, offset in spans:
            out = model(
                input_ids=ids[None, s:e], position_ids=torch.arange(offset, offset + e - s)[None]
            )
            losses.append(
                torch.nn.functional.cross_entropy(
                    out.logits[0], targets[s:e], ignore_index=IGNORE, reduction="sum"
                )
            )
        count += int((targets != IGNORE).sum())
    loss = torch.stack(losses).sum() / count
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ours(model, samples, mesh, with_cu: bool = True):
    from ulysses_mm.hf import shard_inputs

    model.zero_grad()
    mine = samples[mesh.dp_rank :: mesh.dp]
    batch = {
        "input_ids": torch.stack([s[0] for s in mine]),
        "position_ids": torch.stack([s[1] for s in mine]),
        "shift_labels": torch.stack([s[2] for s in mine]),
    }
    inputs = shard_inputs(batch, mesh)
    if not with_cu:
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            inputs.pop(key)
    count = torch.tensor(sum(int((s[2] != IGNORE).sum()) for s in samples))
    share = model(**inputs, num_items_in_batch=count).loss  # this rank's sum / global count
    share.backward()
    loss = share.detach().clone()
    dist.all_reduce(loss)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # the SP ranks' partial sums and the DP groups' samples
        grads[n] = g
    return float(loss), grads


CASES = [
    # kind, heads, kv heads, sp, ring, seq_len, document lengths per sample, with cu_seq_lens
    ("llama", 4, 2, 2, 1, 64, [[20, 1, 1, 17, 12], [33, 2, 25]], True),
    ("qwen2", 4, 2, 4, 1, 96, [[40, 1, 30, 20], [70, 16]], False),
    ("qwen3", 2, 1, 4, 2, 96, [[23, 1, 41, 25], [96]], True),
    ("mistral", 4, 2, 4, 2, 128, [[5, 60, 1, 1, 50], [100, 20]], True),
]


def _parity(rank, world):
    from ulysses_mm.hf import register
    from ulysses_mm.parallel import Mesh

    out = []
    for i, (kind, heads, kv, sp, ring, n, docs, with_cu) in enumerate(CASES):
        mesh = Mesh.build(sp, world // sp, ring)
        samples = [
            _sample(n, lengths, seed=10 * i + j, first_offset=7) for j, lengths in enumerate(docs)
        ]
        ref = _model(kind, heads, kv, "sdpa")
        ref_loss, ref_grads = _reference(ref, samples)
        register(mesh)
        model = _model(kind, heads, kv, "ulysses_mm")
        loss, grads = _ours(model, samples, mesh, with_cu)
        assert_close(torch.tensor(loss), torch.tensor(ref_loss), **TOL)
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            assert_close(
                g, ref_grads[name], **TOL, msg=lambda m, where=f"{kind} {name}": f"{where}: {m}"
            )
        assert any(float(g.abs().max()) > 0 for g in grads.values())
        out.append(ref_loss)
    # a ring needs the whole sequence's documents: positions alone are refused, in one line
    register(Mesh.build(4, 1, 2))
    model = _model("llama", 4, 2, "ulysses_mm")
    ids, pos, _, _ = _sample(64, [30, 34], seed=1)
    try:
        model(input_ids=ids[None, :16], position_ids=pos[None, :16])
    except UnsupportedError as e:
        assert "shard_inputs" in str(e)
    else:
        raise AssertionError("a ring without cu_seq_lens_q was not refused")
    return out


def test_hf_backend_matches_transformers_in_one_process():
    results = run_distributed(_parity, 4, timeout=240)
    assert all(r == results[0] for r in results)  # every rank checked the same references
    assert len(results[0]) == len(CASES)


def test_layout_refused_in_one_line():
    """3 query heads cannot split over a Ulysses group of 2; the error lists what works."""
    from ulysses_mm.hf.attention import Backend
    from ulysses_mm.parallel import Mesh

    mesh = Mesh(Layout(dp=1, sp=2), rank=0)
    with pytest.raises(LayoutError, match=r"sp sizes that do: \[1, 3\]"):
        Backend(mesh).module(3, 1)
