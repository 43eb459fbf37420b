"""``model.init_from``: tiny random transformers Llama / Qwen2 / Qwen3 checkpoints, saved by
the test, load into the backbone and give the transformers model's logits and loss (SP=1
and SP=2); export → init_from is the identity on every modality; a checkpoint that does
not match the config is refused naming the first difference; ``config --from-hf``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from gloo import run_distributed
from hf_models import tiny_hf_model
from torch.testing import assert_close

from ulysses_mm.config import ModelConfig, RopeConfig, RunConfig, to_dict
from ulysses_mm.core.format import IGNORE
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.batch import Batch
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import build_model
from ulysses_mm.model.hf_import import (
    InitFromError,
    hf_model_fields,
    load_pretrained,
    model_section,
)
from ulysses_mm.parallel import Mesh, apply_loss_balance, apply_ulysses
from ulysses_mm.parallel.loss import loss_weights
from ulysses_mm.parallel.slice import sp_slice
from ulysses_mm.train.step import forward_backward

REPO = Path(__file__).resolve().parents[2]
TEXT_VOCAB = 300
SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
)
HF_SHAPE = SHAPE | {"rope_theta": 10000.0}  # as a transformers config
OUR_SHAPE = SHAPE | {"rope": RopeConfig(theta=10000.0)}  # as a ModelConfig


def _save_hf(model_type: str, path, seed: int = 0):
    """A tiny randomly initialised transformers model of ``model_type``, saved as safetensors."""
    hf = tiny_hf_model(
        model_type, seed, vocab_size=TEXT_VOCAB, tie_word_embeddings=False, **HF_SHAPE
    )
    hf.eval().save_pretrained(path)
    return hf


def _imported(model_type: str, path, modalities: dict[str, int] | None = None):
    fields = hf_model_fields(path)
    vocab = fields.pop("vocab_size")
    mods = dict(modalities or {"dna": 10}) | {"text": vocab}
    cfg = ModelConfig(**fields, modalities=mods, init_from=str(path))
    model = build_model(cfg, seed=5)
    load_pretrained(model, path)
    return model.eval()


def _text_batch(space: TokenSpace, n: int, seed: int = 0) -> tuple[Batch, torch.Tensor]:
    """One text document filling the sample (what a transformers model sees: no specials),
    and its ids in the checkpoint's own vocabulary."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, TEXT_VOCAB, (1, n), generator=g)
    r, m = space.range("text"), space.index("text")
    labels = torch.full_like(raw, IGNORE)
    labels[:, :-1] = raw[:, 1:] + r.start
    mods = torch.where(labels == IGNORE, -1, m)
    batch = Batch(raw + r.start, torch.arange(n)[None], labels, mods, torch.zeros_like(raw))
    return batch, raw


def _reference_loss(hf, model, raw: torch.Tensor) -> torch.Tensor:
    """The transformers model's next-token loss, over the text head's outputs: its logits
    behind the shared specials' (the text head also predicts </doc>)."""
    with torch.no_grad():
        out = hf(input_ids=raw, output_hidden_states=True)
        special = model.heads.special(out.hidden_states[-1])
        logits = torch.cat([special, out.logits], dim=-1)[0, :-1]
        ns = model.space.num_specials
        return torch.nn.functional.cross_entropy(logits.float(), raw[0, 1:] + ns)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_import_gives_the_transformers_logits_and_loss(model_type, tmp_path):
    hf = _save_hf(model_type, tmp_path / "hf")
    model = _imported(model_type, tmp_path / "hf")
    assert model.config.qk_norm == (model_type == "qwen3")
    assert model.config.attention_bias == (model_type == "qwen2")
    batch, raw = _text_batch(model.space, 48)
    with torch.no_grad():
        hidden = model.hidden_states(batch.input_ids, batch.position_ids, batch.doc_ids)
        want = hf(input_ids=raw).logits
    # the text head's own range is exactly the transformers LM head
    assert_close(model.heads.heads["text"](hidden), want, rtol=1e-5, atol=1e-5)
    r = model.space.range("text")
    assert_close(model.heads.lm_head_weight()[r.start : r.stop], hf.lm_head.weight)
    # the other rows keep the configured (random) init, not zeros or the checkpoint's
    assert model.model.embed_tokens.weight[: r.start].std() > 0.01
    weights = loss_weights(model.space.modalities, {})
    _, report = forward_backward(model, batch, weights, Mesh.single())
    ref = _reference_loss(hf, model, raw)
    assert report.per_modality["text"] == pytest.approx(float(ref), rel=1e-5)


def _sp2_loss(rank, world, path, want):
    model = _imported("qwen3", path)
    mesh = Mesh.build(world)
    apply_ulysses(model, mesh)
    apply_loss_balance(model, mesh)
    batch, _ = _text_batch(model.space, 48)
    weights = loss_weights(model.space.modalities, {})
    _, report = forward_backward(model, sp_slice(batch, rank, world), weights, Mesh.build(world))
    assert report.total == pytest.approx(want, rel=1e-5), (report.total, want)
    return report.total


def test_import_loss_equals_transformers_at_sp2(tmp_path):
    hf = _save_hf("qwen3", tmp_path / "hf")
    model = _imported("qwen3", tmp_path / "hf")
    _, raw = _text_batch(model.space, 48)
    want = float(_reference_loss(hf, model, raw))
    totals = run_distributed(_sp2_loss, 2, str(tmp_path / "hf"), want, timeout=180)
    assert totals[0] == totals[1] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize(
    "arch,kw",
    [
        ("LlamaForCausalLM", {}),
        ("Qwen3ForCausalLM", dict(qk_norm=True)),
        ("Qwen2ForCausalLM", dict(attention_bias=True)),
    ],
    ids=["llama", "qwen3", "qwen2"],
)
def test_export_then_init_from_gives_the_same_logits_on_every_modality(arch, kw, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ulysses_mm.train.export import export

    vocab = {"dna": 10, "audio": 32, "video": 24, "text": 40}
    cfg = RunConfig()
    cfg.model = ModelConfig(**OUR_SHAPE, **kw, modalities=vocab)
    space = TokenSpace.from_vocab(vocab)
    src = build_model(cfg.model, space, seed=1)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(
        {k: v.contiguous() for k, v in src.state_dict().items()}, str(ckpt / "model.safetensors")
    )
    (ckpt / "run_config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (ckpt / "token_space.json").write_text(json.dumps(space.to_dict()))
    out = export(ckpt, tmp_path / "hf")
    hf_json = json.loads((out / "config.json").read_text())
    assert hf_json["architectures"] == [arch]

    fields = hf_model_fields(out)
    assert fields.pop("vocab_size") == space.vocab_size
    # config --from-hf of an export gives back its whole token space
    assert model_section(out, {"modalities": {"text": 1}})["modalities"] == vocab
    dst = build_model(ModelConfig(**fields, modalities=vocab, init_from=str(out)), space, seed=9)
    load_pretrained(dst, out)
    batch = random_batch(space, 2, 96, seed=4, min_doc=3)
    with torch.no_grad():
        got = dst.hidden_states(batch.input_ids, batch.position_ids, batch.doc_ids)
        want = src.hidden_states(batch.input_ids, batch.position_ids, batch.doc_ids)
        assert_close(got, want, rtol=0, atol=0)
        for name in space.modalities:
            assert_close(dst.heads.logits(got, name), src.heads.logits(want, name), rtol=0, atol=0)
        # and transformers reads the export as the same model
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        ids = batch.input_ids[:1]
        assert_close(
            hf(input_ids=ids).logits,
            src.hidden_states(ids, torch.arange(96)[None], torch.zeros_like(ids))
            @ src.heads.lm_head_weight().T,
            rtol=1e-4,
            atol=1e-4,
        )


def test_a_checkpoint_that_differs_from_the_config_is_refused(tmp_path):
    path = tmp_path / "hf"
    _save_hf("qwen3", path)
    fields = hf_model_fields(path)
    fields.pop("vocab_size")
    mods = {"dna": 10, "text": TEXT_VOCAB}
    wider = ModelConfig(**(fields | {"intermediate_size": 96}), modalities=mods)
    with pytest.raises(
        InitFromError, match=r"intermediate_size=64, the config model\.intermediate_size=96"
    ):
        load_pretrained(build_model(wider), path)
    no_norm = ModelConfig(**(fields | {"qk_norm": False}), modalities=mods)
    with pytest.raises(InitFromError, match=r"qk_norm=True, the config model\.qk_norm=False"):
        load_pretrained(build_model(no_norm), path)
    small = ModelConfig(**fields, modalities={"dna": 10, "text": 100})
    with pytest.raises(InitFromError, match=r"vocab_size=300, the modality 'text' has 100 ids"):
        load_pretrained(build_model(small), path)
    no_text = ModelConfig(**fields, modalities={"dna": 10})
    with pytest.raises(InitFromError, match=r"has no modality 'text'"):
        load_pretrained(build_model(no_text), path)
    with pytest.raises(InitFromError, match=r"cannot read .*config\.json"):
        load_pretrained(build_model(no_text), tmp_path / "missing")
    # a tensor whose shape differs from its config.json (a corrupted checkpoint)
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    state["model.layers.1.self_attn.k_norm.weight"] = torch.ones(4)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = build_model(ModelConfig(**fields, modalities=mods))
    with pytest.raises(InitFromError, match=r"k_norm\.weight has shape \[4\], the model \[8\]"):
        load_pretrained(model, path)


def test_config_from_hf_prints_the_matching_run_config(tmp_path):
    path = tmp_path / "hf"
    _save_hf("qwen3", path)
    base = tmp_path / "run.yaml"
    base.write_text(yaml.safe_dump({"model": {"modalities": {"dna": 10, "audio": 256}}}))
    out = subprocess.run(
        [sys.executable, "-m", "ulysses_mm", "config", str(base), "--from-hf", str(path)]
        + ["train.steps=7"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cfg = yaml.safe_load(out)
    model = cfg["model"]
    assert model["init_from"] == str(path)
    assert model["modalities"] == {"dna": 10, "audio": 256, "text": TEXT_VOCAB}
    assert model["qk_norm"] is True and model["attention_bias"] is False
    assert {k: model[k] for k in SHAPE} == SHAPE
    assert ModelConfig(**model).rope == OUR_SHAPE["rope"]
    assert cfg["train"]["steps"] == 7
    # and the run's model, built from it, starts from the checkpoint
    from safetensors.torch import load_file

    from ulysses_mm.train.step import build_parallel_model

    run = RunConfig(model=ModelConfig(**model))
    space = TokenSpace.from_vocab(run.model.modalities)
    built = build_parallel_model(run, space, Mesh.single(), "sdpa_varlen")
    r = space.range("text")
    state = load_file(str(path / "model.safetensors"))
    assert_close(built.model.embed_tokens.weight[r.start :], state["model.embed_tokens.weight"])
    assert_close(built.heads.heads["text"].weight, state["lm_head.weight"])


def test_tied_embeddings_load_into_the_text_head_too(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=TEXT_VOCAB, tie_word_embeddings=True, **HF_SHAPE))
    hf.eval().save_pretrained(tmp_path / "hf")
    model = _imported("qwen3", tmp_path / "hf")
    batch, raw = _text_batch(model.space, 32)
    with torch.no_grad():
        hidden = model.hidden_states(batch.input_ids, batch.position_ids, batch.doc_ids)
        assert_close(model.heads.heads["text"](hidden), hf(input_ids=raw).logits)
    assert_close(model.heads.heads["text"].weight, hf.model.embed_tokens.weight)


@pytest.mark.parametrize("kw", [dict(qk_norm=True), dict(attention_bias=True)])
def test_estimate_counts_the_qk_norms_and_biases(kw):
    from ulysses_mm.tools.estimate import model_shape

    cfg = RunConfig(model=ModelConfig(**OUR_SHAPE, **kw, modalities={"dna": 10, "text": 40}))
    space = TokenSpace.from_vocab(cfg.model.modalities)
    model = build_model(cfg.model, space)
    assert model_shape(cfg, space).params == sum(p.numel() for p in model.parameters())


def test_the_shipped_finetune_config_is_what_from_hf_prints_for_qwen3_4b(tmp_path):
    """Qwen3-4B's published config.json (no weights needed) gives the shipped model section."""
    from transformers import Qwen3Config

    from ulysses_mm.config import load_config

    qwen3_4b = dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    )
    Qwen3Config(**qwen3_4b).save_pretrained(tmp_path / "Qwen3-4B")
    fields = hf_model_fields(tmp_path / "Qwen3-4B")
    shipped = load_config(RunConfig, REPO / "configs" / "qwen3-4b-finetune.yaml").model
    assert shipped.modalities[shipped.text_modality] == fields.pop("vocab_size")
    assert shipped.rope == RopeConfig(**fields.pop("rope"))
    assert {k: getattr(shipped, k) for k in fields} == fields


def test_a_sharded_checkpoint_loads_like_one_file(tmp_path):
    hf = _save_hf("llama", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one, sharded = _imported("llama", tmp_path / "one"), _imported("llama", tmp_path / "sharded")
    for (name, a), (_, b) in zip(one.state_dict().items(), sharded.state_dict().items()):
        assert_close(a, b, rtol=0, atol=0, msg=name)
