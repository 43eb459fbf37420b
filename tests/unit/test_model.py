"""The backbone is Llama (checked against transformers), documents are isolated in every
kernel, and tiling / checkpointing / per-modality routing do not change the maths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from ulysses_mm.config import ConfigError, ModelConfig
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import IGNORE, Offload, apply_memory_policy, available_kernels, build_model
from ulysses_mm.model.attention import DocumentMask, LocalAttention
from ulysses_mm.model.memory import plain_model
from ulysses_mm.parallel import Mesh, global_loss, loss_weights
from ulysses_mm.train.step import forward_backward

VOCAB = {"dna": 16, "audio": 64, "video": 96}
SPACE = TokenSpace.from_vocab(VOCAB)


def _set_kernel(model, kernel: str) -> None:
    for m in model.modules():
        if isinstance(m, LocalAttention):
            m.kernel = kernel


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_backbone_matches_transformers_llama(kv_heads):
    from transformers import LlamaConfig, LlamaModel

    cfg = ModelConfig(modalities=VOCAB, num_key_value_heads=kv_heads, rope={"theta": 500000.0})
    ours = build_model(cfg, seed=0).model.eval()
    hf_cfg = LlamaConfig(vocab_size=SPACE.vocab_size, **cfg.to_llama_config_kwargs())
    hf_cfg._attn_implementation = "eager"
    hf = LlamaModel(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    ids = torch.randint(0, SPACE.vocab_size, (2, 50))
    pos = torch.arange(50).expand(2, 50)
    with torch.no_grad():
        want = hf(input_ids=ids, position_ids=pos).last_hidden_state
        got = ours(ids, pos, torch.zeros(2, 50, dtype=torch.long))  # the Backbone
    assert_close(got, want, rtol=1e-5, atol=1e-5)


def _hidden(model, batch, input_ids=None):
    ids = batch.input_ids if input_ids is None else input_ids
    return model.hidden_states(ids, batch.position_ids, batch.doc_ids)


@pytest.mark.parametrize("kernel", available_kernels(training=False))
def test_changing_one_document_changes_no_other(kernel):
    model = build_model(ModelConfig(modalities=VOCAB, num_key_value_heads=2), seed=0)
    _set_kernel(model, kernel)
    batch = random_batch(SPACE, 2, 160, seed=1, min_doc=10)
    target = batch.doc_ids[0] == batch.doc_ids[0, 80]  # the document around the middle of row 0
    changed = batch.input_ids.clone()
    rng = torch.Generator().manual_seed(0)
    changed[0, target] = torch.randint(
        SPACE.num_specials, SPACE.vocab_size, (int(target.sum()),), generator=rng
    )
    grad_ctx = torch.no_grad() if kernel == "flex" else torch.enable_grad()
    with grad_ctx:
        before, after = _hidden(model, batch), _hidden(model, batch, changed)
    assert not torch.allclose(before[0, target], after[0, target])  # the edited document moved
    assert_close(after[0, ~target], before[0, ~target], rtol=0, atol=1e-6)
    assert_close(after[1], before[1], rtol=0, atol=0)


def test_kernels_agree():
    model = build_model(ModelConfig(modalities=VOCAB, num_key_value_heads=1), seed=0)
    batch = random_batch(SPACE, 2, 128, seed=2)
    outs = {}
    for kernel in available_kernels(training=False):
        _set_kernel(model, kernel)
        with torch.no_grad():
            outs[kernel] = _hidden(model, batch)
    for kernel, out in outs.items():
        assert_close(out, outs["sdpa_varlen"], rtol=1e-5, atol=1e-5, msg=kernel)


def test_unknown_and_unavailable_kernels_are_refused():
    with pytest.raises(ValueError, match="unknown attention kernel 'nope'"):
        LocalAttention("nope")
    if "flash_varlen" not in available_kernels(device="cuda"):
        with pytest.raises(RuntimeError, match="needs flash-attn and a CUDA GPU"):
            LocalAttention("flash_varlen")
    q = torch.randn(1, 8, 2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        LocalAttention("flex")(q, q, q, DocumentMask(torch.zeros(1, 8, dtype=torch.long)))


def _loss_grads(cfg: ModelConfig, batch, weights=None):
    model = build_model(cfg, SPACE, seed=4)
    apply_memory_policy(model, cfg)
    w = loss_weights(SPACE.modalities, weights or {})
    loss, report = forward_backward(model, batch, w, Mesh.single())
    return loss, {n: p.grad for n, p in model.named_parameters()}, model, report


@pytest.mark.parametrize(
    "variant",
    [
        dict(loss_tile_tokens=7),
        dict(mlp_tile_tokens=13),
        dict(activation_checkpointing=True),
        dict(activation_checkpointing=True, mlp_tile_tokens=32, loss_tile_tokens=50),
    ],
)
def test_tiling_and_checkpointing_change_nothing(variant):
    batch = random_batch(SPACE, 2, 96, seed=3)
    base = ModelConfig(modalities=VOCAB, num_key_value_heads=2, loss_tile_tokens=100000)
    loss0, grads0, _, _ = _loss_grads(base, batch)
    loss1, grads1, _, _ = _loss_grads(ModelConfig(**{**base.__dict__, **variant}), batch)
    assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    for name in grads0:
        assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-7, msg=name)


def test_each_target_uses_its_modality_head():
    batch = random_batch(SPACE, 1, 128, seed=6)
    weights = {"dna": 2.0, "video": 0.25}
    loss, _, model, report = _loss_grads(
        ModelConfig(modalities=VOCAB, loss_tile_tokens=9), batch, weights
    )
    with torch.no_grad():
        hidden = _hidden(model, batch)[0]
        full = hidden @ model.heads.lm_head_weight().T  # [n, vocab]: the heads, concatenated
    ns = SPACE.num_specials
    per_mod, means = {}, {}
    for i, r in enumerate(SPACE.ranges):
        sel = (batch.label_modality[0] == i) & (batch.labels[0] != IGNORE)
        cols = list(range(ns)) + list(range(r.start, r.stop))
        logits = full[sel][:, cols]
        target = batch.labels[0, sel]
        local = torch.where(target < ns, target, target - r.start + ns)
        per_mod[r.name] = F.cross_entropy(logits, local, reduction="sum")
        means[r.name] = per_mod[r.name] / sel.sum()
        assert report.counts[r.name] == int(sel.sum())
        assert report.per_modality[r.name] == pytest.approx(float(means[r.name]), rel=1e-5)
    w = {m: weights.get(m, 1.0) for m in VOCAB}
    expected = sum(w[m] * means[m] for m in VOCAB) / sum(w.values())
    assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_absent_modality_does_not_dilute_the_loss():
    batch = random_batch(TokenSpace.from_vocab({"dna": 16}), 1, 64, seed=1)
    cfg = ModelConfig(modalities={"dna": 16, "audio": 32})
    model = build_model(cfg, seed=0)
    sums, counts, *_ = model.loss_terms(_hidden(model, batch), batch.labels, batch.label_modality)
    loss, report = global_loss(
        sums,
        counts,
        loss_weights(model.space.modalities, {}),
        Mesh.single(),
        model.space.modalities,
    )
    assert report.counts["audio"] == 0 and "audio" not in report.per_modality
    assert_close(loss, sums[0] / counts[0])


def test_target_outside_its_modality_range_is_an_error():
    model = build_model(ModelConfig(modalities=VOCAB), seed=0)
    batch = random_batch(SPACE, 1, 32, seed=0)
    labels = batch.labels.clone()
    mods = batch.label_modality.clone()
    i = int(torch.nonzero(labels[0] >= SPACE.range("audio").start)[0])
    mods[0, i] = SPACE.index("dna")  # an audio or video token routed to the dna head
    with pytest.raises(ValueError, match="neither a special nor in the range of modality 'dna'"):
        model.loss_terms(_hidden(model, batch), labels, mods)


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            dict(layer_tile_tokens=64, mlp_tile_tokens=32),
            r"^model.mlp_tile_tokens does nothing under model.layer_tile_tokens .*"
            r"set model.mlp_tile_tokens=0$",
        ),
        (
            dict(activation_checkpointing=True, offload_checkpoints=True, num_hidden_layers=1),
            r"^model.offload_checkpoints does nothing with model.num_hidden_layers=1 ",
        ),
        (dict(offload_checkpoints=True), r"^model.offload_checkpoints needs model.activation_chec"),
    ],
    ids=["mlp-tiles-under-layer-tiles", "offload-one-layer", "offload-without-checkpointing"],
)
def test_memory_options_that_would_do_nothing_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(modalities=VOCAB, **fields)


def test_the_memory_policy_is_applied_from_outside_and_can_be_replaced():
    """A built model is plain; the policy wraps methods of the built model (its state dict
    unchanged), and applying another policy replaces it."""
    cfg = ModelConfig(modalities=VOCAB, activation_checkpointing=True, layer_tile_tokens=16)
    model = build_model(cfg, SPACE, seed=0)
    keys = list(model.state_dict())
    layer = model.model.layers[0]
    assert "qkv" not in vars(layer) and "run_layers" not in vars(model.model)
    assert apply_memory_policy(model, cfg) is None
    assert "qkv" in vars(layer) and "run_layers" in vars(model.model)
    assert list(model.state_dict()) == keys
    offload = Offload()
    on = ModelConfig(
        modalities=VOCAB, activation_checkpointing=True, offload_checkpoints=True, mlp_tile_tokens=8
    )
    assert apply_memory_policy(model, on, offload) is offload
    assert "after_attention" not in vars(layer) and "forward" in vars(layer.mlp)
    plain_model(model)
    assert not any(k in vars(m) for m in model.modules() for k in ("qkv", "run_layers", "forward"))


def test_the_embedding_has_its_own_init_std_when_given():
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, modalities={"dna": 512})
    plain = build_model(ModelConfig(**shape, initializer_range=0.02), seed=0)
    wide = build_model(ModelConfig(**shape, initializer_range=0.02, embedding_init_std=1.0), seed=0)
    for model, want in ((plain, 0.02), (wide, 1.0)):
        std = float(model.model.embed_tokens.weight.std())
        assert abs(std - want) < 0.05 * want, (std, want)
        q = float(model.model.layers[0].self_attn.q_proj.weight.std())
        assert abs(q - 0.02) < 0.002  # every other weight keeps initializer_range
