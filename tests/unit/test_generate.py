"""Generation pieces in one process: the KV cache against recomputing the sequence, the
tokenizers' grammars, the sampler, and the evaluation's bins and units."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from torch.testing import assert_close

from ulysses_mm.config import ModelConfig
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, EOF, TokenSpace
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import apply_memory_policy, build_model
from ulysses_mm.model.generate import Sampling, allowed_mask, generate, pick
from ulysses_mm.model.kv_cache import CachedDecoder, RecomputeDecoder, attend
from ulysses_mm.tokenize.audio.output import WavMedia
from ulysses_mm.tokenize.grammar import Grammar, Next
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.video.output import Mp4Media
from ulysses_mm.train.evaluate import log_edges, position_bins

SPECS = REPO / "tokenizers"
SPACE = TokenSpace.from_vocab({"dna": 10, "audio": 256, "video": 256, "text": 256})


def _model(**kw):
    cfg = ModelConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kw.pop("kv", 2),
        **kw,
    )
    model = build_model(cfg, SPACE, seed=3)
    apply_memory_policy(model, cfg)
    return model.eval()


@pytest.mark.parametrize("kw", [{}, {"kv": 1, "qk_norm": True}, {"kv": 4, "layer_tile_tokens": 16}])
def test_cached_steps_give_the_hidden_states_of_recomputing(kw):
    torch.manual_seed(0)
    model = _model(**kw)
    ids = torch.randint(SPACE.num_specials, SPACE.vocab_size, (1, 60))
    cached, full = CachedDecoder(model, 60), RecomputeDecoder(model)
    assert_close(cached.start(ids[:, :37]), full.start(ids[:, :37]), rtol=1e-5, atol=1e-5)
    for i in range(37, 60):
        step = ids[:, i : i + 1]
        assert_close(cached.step(step), full.step(step), rtol=1e-5, atol=1e-5)
    assert cached.cache.length == 60 and cached.position == 60
    stepwise = CachedDecoder(model, 60, stepwise=True)  # never calls the attention core
    assert_close(stepwise.start(ids[:, :37]), full.start(ids[:, :37]), rtol=1e-5, atol=1e-5)


def test_attend_is_causal_attention_with_its_log_sum_exp():
    torch.manual_seed(1)
    q = torch.randn(2, 3, 4, 8)
    k, v = torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    out, lse = attend(q, k.transpose(1, 2), v.transpose(1, 2))  # the cache is [b, hk, T, d]
    # the 3 queries are the last 3 of 10 positions: SDPA with the matching causal mask
    mask = torch.arange(10)[None, :] <= (7 + torch.arange(3))[:, None]
    kr, vr = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), attn_mask=mask
    ).transpose(1, 2)
    assert_close(out, ref, rtol=1e-5, atol=1e-6)
    scores = torch.einsum("bthd,bshd->bths", q, kr) / math.sqrt(8)
    ref_lse = scores.masked_fill(~mask[None, :, None, :], -math.inf).logsumexp(-1)
    assert_close(lse, ref_lse)
    empty = torch.zeros(2, 2, 0, 8)
    empty_out, empty_lse = attend(q[:, -1:], empty, empty)
    assert (empty_out == 0).all() and torch.isinf(empty_lse).all()


def test_the_sampler_keeps_to_the_allowed_ids_and_its_seed():
    logits = torch.tensor([5.0, 1.0, 4.0, 3.0, 2.0, 0.0])
    mask = torch.tensor([False, True, True, True, True, True])

    def draw(s: Sampling, seed: int) -> int:
        return pick(logits, mask, s, torch.Generator().manual_seed(seed))

    assert pick(logits, mask, Sampling(temperature=0), torch.Generator()) == 2  # greedy, not 0
    gen = torch.Generator().manual_seed(7)
    many = [pick(logits, mask, Sampling(top_k=2), gen) for _ in range(200)]
    assert set(many) == {2, 3}
    gen = torch.Generator().manual_seed(7)
    nucleus = [pick(logits, mask, Sampling(top_p=0.5), gen) for _ in range(200)]
    assert set(nucleus) == {2}  # id 2 alone holds more than half the allowed mass
    assert [draw(Sampling(), s) for s in range(20)] == [draw(Sampling(), s) for s in range(20)]
    assert len({draw(Sampling(temperature=5.0), s) for s in range(50)}) > 2


def _feed(grammar: Grammar, ids) -> None:
    for t in ids:
        grammar.feed(int(t))


def test_dna_grammar_allows_its_range_and_the_end():
    dna = load_tokenizer(SPECS / "dna-base.json")
    g = Grammar(dna, SPACE)
    assert g.next().forced == SPACE.boundary_token("dna")  # nothing fed: <|dna|> first
    _feed(g, [DOC_START, SPACE.boundary_token("dna")])
    r = SPACE.range("dna")
    assert g.next() == Next("dna", r.start, r.stop, (DOC_END,))
    assert Grammar(dna, SPACE, end=False).next().forced is not None
    no_end = Grammar(dna, SPACE, end=False)
    _feed(no_end, [DOC_START, SPACE.boundary_token("dna")])
    assert no_end.next().specials == ()


def test_video_grammar_forces_whole_frames_and_the_interleaved_audio():
    video = load_tokenizer(SPECS / "video-vq-av.json")  # 256 ids a frame, 4 frames a chunk
    g = Grammar(video, SPACE)
    vr, ar = SPACE.range("video"), SPACE.range("audio")
    _feed(g, [DOC_START, SPACE.boundary_token("video")])
    seen = []
    for _ in range(4 * 257 + 1 + 8000 + 1 + 257):
        nxt = g.next()
        t = nxt.forced if nxt.forced is not None else nxt.lo  # the lowest allowed id
        seen.append((nxt.head, nxt.forced, nxt.lo, nxt.hi))
        g.feed(t)
    heads = [h for h, *_ in seen]
    forced = [f for _, f, *_ in seen]
    assert forced[256] == EOF and forced[255] is None and forced[4 * 257 - 1] == EOF
    assert forced[4 * 257] == SPACE.boundary_token("audio")  # after 4 frames, the audio
    assert heads[4 * 257 + 1 : 4 * 257 + 1 + 8000] == ["audio"] * 8000  # 0.5 s at 16 kHz
    assert forced[4 * 257 + 1 + 8000] == SPACE.boundary_token("video")
    assert forced[-1] == EOF and heads[-2] == "video"
    for head, f, lo, hi in seen:  # what is sampled is of the head's own range
        if f is None:
            assert (lo, hi) == ((ar.start, ar.stop) if head == "audio" else (vr.start, vr.stop))
    # a clip without its audio track (more than 4 frames in a chunk) is left alone
    g2 = Grammar(video, SPACE)
    _feed(g2, [DOC_START, SPACE.boundary_token("video")])
    _feed(g2, ([vr.start] * 256 + [EOF]) * 5)
    assert g2.next() == Next("video", vr.start, vr.stop)


def _generated(model, tok, space: TokenSpace, new: int) -> list[int]:
    prompt = [DOC_START, space.boundary_token(tok.modality)]
    decoder = CachedDecoder(model, len(prompt) + new)
    got = generate(model, decoder, Grammar(tok, space, end=False), prompt, new, Sampling())
    assert len(got.ids) == new and got.sampled > 0
    return got.ids


def test_generated_ids_decode_in_every_kind(tmp_path):
    """An untrained model's ids, within the grammar, decode through each tokenizer (the
    same seed giving the same ids)."""
    h264 = json.loads((SPECS / "video-h264.json").read_text())
    h264["params"] |= {"tokens_per_frame": 8}  # frames of 4 · 2 · 8 = 64 ids at most
    (tmp_path / "h264.json").write_text(json.dumps(h264))
    h264_space = TokenSpace.from_vocab({"video": 65792})
    h264_model = build_model(
        ModelConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1), h264_space
    )
    model = _model()
    for spec, new, m, space, frames in (
        (SPECS / "dna-base.json", 40, model, SPACE, 0),
        (SPECS / "audio-mulaw-16k.json", 50, model, SPACE, 0),
        (SPECS / "text-bytes.json", 30, model, SPACE, 0),
        (SPECS / "video-vq.json", 257 + 20, model, SPACE, 1),  # a frame, a part frame
        (tmp_path / "h264.json", 2 * 65 + 5, h264_model.eval(), h264_space, 2),
    ):
        tok = load_tokenizer(spec)
        ids = _generated(m, tok, space, new)
        assert _generated(m, tok, space, new) == ids
        media = tok.media(space, [DOC_START, space.boundary_token(tok.modality)], ids)
        if isinstance(media, Mp4Media):
            assert media.frames.shape == (frames, 256, 256, 3), spec
        elif isinstance(media, WavMedia):
            assert len(media.wave) == new
        else:
            assert len(media.to_bytes()) > 0 and media.describe()


def test_allowed_mask_is_the_heads_slice():
    model = _model()
    r = SPACE.range("audio")
    mask = allowed_mask(Next("audio", r.start + 4, r.start + 8, (EOF,)), model)
    ns = SPACE.num_specials
    assert mask.shape == (ns + r.size,)
    assert np.flatnonzero(mask.numpy()).tolist() == [EOF, ns + 4, ns + 5, ns + 6, ns + 7]


def test_loss_by_bin_adds_up_to_the_training_loss_terms():
    model = _model()
    batch = random_batch(SPACE, 2, 96, seed=4, min_doc=5)
    edges = torch.tensor(log_edges())
    bins = position_bins(batch, edges)
    with torch.no_grad():
        sums, counts, *_ = model(
            batch.input_ids, batch.position_ids, batch.doc_ids, batch.labels, batch.label_modality
        )
        sums_b, counts_b, by_bin, hits = model(
            batch.input_ids,
            batch.position_ids,
            batch.doc_ids,
            batch.labels,
            batch.label_modality,
            bins,
            len(edges) - 1,
        )
    assert_close(sums_b, sums)
    assert_close(counts_b, counts)
    assert_close(by_bin.sum(1), sums, rtol=1e-5, atol=1e-5)  # every target is in a bin
    # hits: per bin, the targets the argmax of their modality's head gets right
    with torch.no_grad():
        hidden = model.hidden_states(batch.input_ids, batch.position_ids, batch.doc_ids)
    want = torch.zeros_like(hits)
    weight = model.heads.lm_head_weight()
    for m, r in enumerate(SPACE.ranges):  # a modality's head: the specials and its range
        ids = torch.cat([torch.arange(SPACE.num_specials), torch.arange(r.start, r.stop)])
        guess = ids[(hidden @ weight[ids].T).argmax(-1)]
        mask = (batch.label_modality == m) & (bins >= 0)
        right = mask & (guess == batch.labels)
        want[m] += torch.bincount(bins[right], minlength=len(edges) - 1).to(want.dtype)
    assert hits.sum() > 0 and torch.equal(hits, want)
    pos = batch.position_ids[bins >= 0] + 1
    lo, hi = edges[bins[bins >= 0]], edges[bins[bins >= 0] + 1]
    assert ((lo <= pos) & (pos < hi)).all()
    assert log_edges()[:12] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13]
    assert {2**k for k in range(30)} <= set(log_edges())
