"""Generation and evaluation on real gloo groups against one process.

A prompt prefilled by 2 sequence-parallel ranks (Ulysses, and a pure ring) with its KV
cache split over them gives the hidden states and the sampled ids of one process's
cache; evaluation at sp=2 gives one process's figures, loss by position included."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from gloo import run_distributed
from torch.testing import assert_close

from ulysses_mm.config import ModelConfig, RunConfig
from ulysses_mm.core.tokenspace import DOC_START, TokenSpace
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import build_model
from ulysses_mm.model.generate import Sampling, generate
from ulysses_mm.model.kv_cache import CachedDecoder
from ulysses_mm.parallel import Mesh, apply_loss_balance, apply_ulysses
from ulysses_mm.parallel.decode import SequenceParallelDecoder
from ulysses_mm.parallel.mesh import Place
from ulysses_mm.tokenize.grammar import Grammar
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.train.evaluate import evaluate_batches
from ulysses_mm.train.step import build_inference_setup

SPACE = TokenSpace.from_vocab({"dna": 10, "audio": 64})
MODEL = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=1,
)  # fmt: skip
TOL = dict(rtol=1e-5, atol=1e-5)


def _model():
    return build_model(ModelConfig(**MODEL), SPACE, seed=5).eval()


def _decode(ring: int) -> dict:
    mesh = Mesh.build(2, ring_size=ring)
    torch.manual_seed(0)
    prompt = torch.randint(SPACE.num_specials, SPACE.vocab_size, (1, 37))
    steps = torch.randint(SPACE.num_specials, SPACE.vocab_size, (1, 9))
    ref = CachedDecoder(_model(), 60)
    model = apply_loss_balance(apply_ulysses(_model(), mesh), mesh)
    sp = SequenceParallelDecoder(model, mesh, prompt.shape[1], 20)
    assert_close(sp.start(prompt), ref.start(prompt), **TOL)
    for i in range(steps.shape[1]):
        assert_close(sp.step(steps[:, i : i + 1]), ref.step(steps[:, i : i + 1]), **TOL)
    # the cache is split: each rank holds its own prompt tokens and every other new one
    held = torch.tensor([sp.inner.cache.length])
    dist.all_reduce(held)
    assert int(held) == 37 + 9 and sp.inner.cache.length < 37
    dna = load_tokenizer("tokenizers/dna-base.json")
    ids = [DOC_START, SPACE.boundary_token("dna")] + [SPACE.range("dna").start + 1] * 30
    greedy = Sampling(temperature=0.0)
    single = generate(_model(), CachedDecoder(_model(), 80), Grammar(dna, SPACE), ids, 40, greedy)
    sampled = Sampling(seed=3)
    single_s = generate(
        _model(), CachedDecoder(_model(), 80), Grammar(dna, SPACE), ids, 40, sampled
    )
    out = {}
    for name, s in (("greedy", greedy), ("sampled", sampled)):
        d = SequenceParallelDecoder(model, mesh, len(ids), 40)
        out[name] = generate(model, d, Grammar(dna, SPACE), ids, 40, s, agree=d.agree).ids
    return {"greedy": (out["greedy"], single.ids), "sampled": (out["sampled"], single_s.ids)}


def _evaluate(mesh: Mesh) -> dict:
    cfg = RunConfig(model=ModelConfig(**MODEL))
    state = _model().state_dict()
    place = Place(mesh, torch.device("cpu"), "gloo" if mesh.distributed else "none")
    setup = build_inference_setup(cfg, SPACE, place, lambda m: m.load_state_dict(state))
    batches = [random_batch(SPACE, 1, 64, seed=s, min_doc=9) for s in range(3)]
    return asdict(evaluate_batches(setup, batches))


def _worker(rank, world):
    return {
        "ulysses": _decode(ring=1),
        "ring": _decode(ring=2),
        "eval": _evaluate(Mesh.build(2)),
        "eval_single": _evaluate(Mesh.single()),
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=180)


@pytest.mark.parametrize("layout", ["ulysses", "ring"])
def test_split_prefill_and_cache_match_one_process(results, layout):
    for rank in results:  # every rank continues with the same ids: one process's
        for parallel, single in rank[layout].values():
            assert parallel == single
    assert results[0][layout]["greedy"] == results[1][layout]["greedy"]


def test_evaluation_at_sp2_gives_the_figures_of_one_process(results):
    par, one = results[0]["eval"], results[0]["eval_single"]
    assert par == results[1]["eval"]  # identical on every rank
    assert par["targets"] == one["targets"] and par["samples"] == one["samples"] == 3
    assert_close(par["loss"], one["loss"], **TOL)
    for m in one["nats"]:
        assert_close(par["nats"][m], one["nats"][m], **TOL)
    assert set(par["bins"]) == set(one["bins"]) and par["bins"]
    for m, rows in one["bins"].items():
        got = par["bins"][m]
        assert [r[:2] + r[3:] for r in got] == [r[:2] + r[3:] for r in rows]  # edges, counts
        assert_close(torch.tensor([r[2] for r in got]), torch.tensor([r[2] for r in rows]), **TOL)
