"""RoPE kinds (model.rope) against transformers, both ways: each kind's frequencies are
transformers' bit for bit; a tiny random transformers Llama (llama3, dynamic, default),
Qwen3 (yarn) and Qwen2 (linear), imported, gives its logits and every parameter gradient
at positions far past the original context; its export loads in transformers with the
same rope_parameters and logits. Also: dynamic NTK's state and its ``seen_length`` hook,
``set_rope``, ``config --from-hf`` of Llama-3.1 and YaRN checkpoints, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from hf_models import tiny_hf_model
from torch.testing import assert_close

from ulysses_mm.config import ConfigError, ModelConfig, RopeConfig, RunConfig, from_dict, to_dict
from ulysses_mm.model import build_model
from ulysses_mm.model.hf_import import (
    InitFromError,
    check_matches,
    hf_model_fields,
    load_pretrained,
    model_section,
)
from ulysses_mm.model.llama import RotaryEmbedding

VOCAB = 64
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # 8 frequencies: llama3's three bands and yarn's ramp all have members
    rms_norm_eps=1e-6,
)
ORIGINAL = 32  # the pretraining context of every scaled kind below
N, OFFSET = 160, 48  # positions 48 .. 207: far past it
# (transformers model, its rope_parameters, its max_position_embeddings)
CASES = {
    "llama-llama3": (
        "llama",
        dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=ORIGINAL,
        ),
        8 * ORIGINAL,
    ),
    "qwen3-yarn": (
        "qwen3",
        dict(
            rope_type="yarn",
            rope_theta=1000.0,
            factor=4.0,
            original_max_position_embeddings=ORIGINAL,
        ),
        4 * ORIGINAL,
    ),
    "qwen2-linear": ("qwen2", dict(rope_type="linear", rope_theta=10000.0, factor=4.0), 256),
    "llama-dynamic": ("llama", dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0), ORIGINAL),
    "llama-default": ("llama", dict(rope_type="default", rope_theta=500000.0), 256),
}


def _hf(case: str, path):
    model_type, rope, max_positions = CASES[case]
    hf = tiny_hf_model(
        model_type,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        rope_parameters=dict(rope),
        max_position_embeddings=max_positions,
        **SHAPE,
    )
    hf.eval().save_pretrained(path)
    return hf


def _imported(path):
    fields = hf_model_fields(path)
    vocab = fields.pop("vocab_size")
    cfg = ModelConfig(**fields, modalities={"text": vocab}, init_from=str(path))
    model = build_model(cfg, seed=3)
    load_pretrained(model, path)
    return model.eval()


def _positions() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, VOCAB, (1, N), generator=g)
    return raw, torch.arange(OFFSET, OFFSET + N)[None]


def _logits(model, ids, pos):
    """Our per-modality heads concatenated: the whole token space's lm_head."""
    hidden = model.hidden_states(ids, pos, torch.zeros_like(ids))
    return hidden @ model.heads.lm_head_weight().T


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_the_transformers_logits_and_gradients(case, tmp_path):
    hf = _hf(case, tmp_path / "hf")
    model = _imported(tmp_path / "hf")
    rope = model.model.rotary_emb
    assert model.config.rope.kind == CASES[case][1]["rope_type"]
    assert torch.equal(rope.inv_freq, hf.model.rotary_emb.inv_freq)
    raw, pos = _positions()
    r = model.space.range("text")
    ours = _logits(model, raw + r.start, pos)[..., r.start : r.stop]
    theirs = hf(input_ids=raw, position_ids=pos).logits
    # the same fp32 frequencies (dynamic's grown for position 207) and cos/sin scale; the
    # angles differ by transformers' fp32 rounding of position × frequency only
    assert torch.equal(rope.inv_freq, hf.model.rotary_emb.inv_freq)
    assert rope.attention_scaling == hf.model.rotary_emb.attention_scaling
    if case == "qwen3-yarn":
        assert rope.attention_scaling > 1.0
    assert_close(ours, theirs, rtol=1e-5, atol=2e-5)
    weight = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(1))
    (ours * weight).sum().backward()
    (theirs * weight).sum().backward()
    params = dict(model.named_parameters())
    for name, p in hf.named_parameters():
        if name == "model.embed_tokens.weight":
            got = params[name].grad[r.start : r.stop]
        elif name == "lm_head.weight":
            got = model.heads.heads["text"].weight.grad
        else:
            got = params[name].grad
        # fp32 sums over 160 positions: within 1e-5 of each gradient's scale
        assert_close(got, p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()), msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_transformers_our_positions(case, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ulysses_mm.train.export import export

    hf = _hf(case, tmp_path / "hf")
    model = _imported(tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(ckpt / "model.safetensors"))
    run = RunConfig(model=model.config)
    (ckpt / "run_config.yaml").write_text(yaml.safe_dump(to_dict(run)))
    (ckpt / "token_space.json").write_text(json.dumps(model.space.to_dict()))
    out = export(ckpt, tmp_path / "export")
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.config.rope_parameters == model.config.rope.rope_parameters()
    assert back.config.rope_parameters == hf.config.rope_parameters
    raw, pos = _positions()
    ids = raw + model.space.range("text").start
    with torch.no_grad():
        assert_close(back(input_ids=ids, position_ids=pos).logits, _logits(model, ids, pos))
    assert torch.equal(back.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    # and the export imports as the same model
    assert from_dict(ModelConfig, model_section(out)).rope == model.config.rope


KINDS = [
    dict(kind="default"),
    dict(kind="linear", factor=3.0),
    dict(kind="dynamic", factor=4.0, original_max_position_embeddings=ORIGINAL),
    dict(kind="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    dict(
        kind="yarn",
        factor=8.0,
        original_max_position_embeddings=64,
        mscale=0.707,
        mscale_all_dim=1.0,
        beta_fast=16.0,
        beta_slow=2.0,
        truncate=False,
    ),
    dict(kind="yarn", factor=2.5, original_max_position_embeddings=40, attention_factor=1.3),
    dict(
        kind="llama3",
        factor=8.0,
        original_max_position_embeddings=ORIGINAL,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    ),
]


def _hf_rotary(cfg: ModelConfig):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(LlamaConfig(vocab_size=8, **cfg.to_llama_config_kwargs()))


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("kw", KINDS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_every_kinds_frequencies_are_transformers_bit_for_bit(kw, theta, head_dim):
    cfg = ModelConfig(head_dim=head_dim, rope=RopeConfig(theta=theta, **kw))
    hf = _hf_rotary(cfg)
    ours = RotaryEmbedding(head_dim, cfg.rope, cfg.max_position_embeddings)
    assert ours.inv_freq.dtype == torch.float32
    assert torch.equal(ours.inv_freq, hf.inv_freq)
    assert ours.attention_scaling == hf.attention_scaling
    pos = torch.arange(100)[None]
    oc, os_ = ours(pos, torch.float32)
    hc, hs = hf(torch.zeros(1, 100, 1), pos)
    assert_close(oc, hc, rtol=0, atol=2e-5)
    assert_close(os_, hs, rtol=0, atol=2e-5)


def test_dynamic_grows_and_resets_as_transformers_does():
    cfg = ModelConfig(head_dim=16, rope=RopeConfig(**KINDS[2]))
    hf = _hf_rotary(cfg)
    ours = RotaryEmbedding(16, cfg.rope, cfg.max_position_embeddings)
    start = ours.inv_freq.clone()
    for length in [10, 200, 150, 500, 31, 40, 32, 33, 33, 20]:
        pos = torch.arange(length)[None]
        ours(pos, torch.float32)
        hf(torch.zeros(1, length, 1), pos)
        assert torch.equal(ours.inv_freq, hf.inv_freq), length
    assert torch.equal(ours.inv_freq, start)  # back below the original length


def test_dynamic_asks_seen_length_for_the_whole_sequences_length():
    from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters

    cfg = ModelConfig(head_dim=16, rope=RopeConfig(**KINDS[2]))
    hf_config = _hf_rotary(cfg).config
    ours = RotaryEmbedding(16, cfg.rope, cfg.max_position_embeddings)
    asked = []

    def whole(local: torch.Tensor) -> torch.Tensor:  # what an all-reduce MAX would give
        asked.append(int(local))
        return torch.full_like(local, 400)

    ours.seen_length = whole
    ours(torch.arange(40, 50)[None], torch.float32)  # this process holds 40 .. 49
    assert asked == [50]
    want, _ = _compute_dynamic_ntk_parameters(hf_config, seq_len=torch.tensor(400))
    assert torch.equal(ours.inv_freq, want)
    alone = RotaryEmbedding(16, cfg.rope, cfg.max_position_embeddings)
    alone(torch.arange(40, 50)[None], torch.float32)
    assert not torch.equal(alone.inv_freq, ours.inv_freq)
    # the other kinds never ask
    plain = RotaryEmbedding(16, RopeConfig(**KINDS[3]), cfg.max_position_embeddings)
    plain.seen_length = whole
    plain(torch.arange(50)[None], torch.float32)
    assert asked == [50]


def test_set_rope_switches_the_kind_in_place_on_its_device():
    llama3 = RopeConfig(**KINDS[-1])
    rope = RotaryEmbedding(16, RopeConfig(**KINDS[3]), 1 << 20)
    rope.bfloat16()  # an engine's cast
    rope.set_rope(llama3)
    fresh = RotaryEmbedding(16, llama3, 1 << 20)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, fresh.inv_freq)
    pos = torch.arange(300)[None]
    assert all(
        torch.equal(a, b) for a, b in zip(rope(pos, torch.float32), fresh(pos, torch.float32))
    )
    rope.to("meta")
    rope.set_rope(RopeConfig(**KINDS[2]))
    assert rope.inv_freq.device.type == "meta"


def test_the_backbone_takes_model_rope_and_the_theta_form_still_builds():
    cfg = ModelConfig(modalities={"dna": 8}, rope={"kind": "linear", "factor": 2.0})
    rotary = build_model(cfg).model.rotary_emb
    assert rotary.rope == cfg.rope
    assert torch.equal(rotary.inv_freq, RotaryEmbedding(16, 10000.0).inv_freq / 2.0)


def _config_json(path, **fields):
    path.mkdir()
    shape = dict(SHAPE, vocab_size=VOCAB)
    (path / "config.json").write_text(json.dumps(shape | fields))
    return path


LLAMA31 = dict(
    model_type="llama",
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)
QWEN3_YARN = dict(
    model_type="qwen3",
    rope_theta=1000000.0,
    max_position_embeddings=131072,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768),
)


@pytest.mark.parametrize(
    "hf,want",
    [
        (
            LLAMA31,
            dict(
                theta=500000.0,
                kind="llama3",
                factor=8.0,
                original_max_position_embeddings=8192,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
            ),
        ),
        (
            QWEN3_YARN,
            dict(theta=1000000.0, kind="yarn", factor=4.0, original_max_position_embeddings=32768),
        ),
    ],
    ids=["llama3.1", "qwen3-yarn"],
)
def test_config_from_hf_prints_the_checkpoints_rope(hf, want, tmp_path, capsys):
    from ulysses_mm.cli import main

    path = _config_json(tmp_path / "hf", **hf)
    section = model_section(path)
    assert section["rope"] == want  # only the keys set
    assert from_dict(ModelConfig, section).rope == RopeConfig(**want)
    assert main(["config", "--from-hf", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["model"]
    cfg = from_dict(ModelConfig, printed)
    assert cfg.rope == RopeConfig(**want)
    # the checkpoint's own config matches, and so does one that extends its positions
    # further (RoPE is no weight: a context-extension run starts from the checkpoint)
    fields = hf_model_fields(path)
    check_matches(cfg, path, fields)
    check_matches(from_dict(ModelConfig, printed | {"rope": want | {"factor": 16.0}}), path, fields)
    wider = from_dict(ModelConfig, printed | {"hidden_size": 2 * printed["hidden_size"]})
    with pytest.raises(InitFromError, match=r"hidden_size=") as e:
        check_matches(wider, path, fields)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "rope,message",
    [
        (
            dict(rope_type="longrope", short_factor=[1.0], long_factor=[2.0]),
            r"RoPE kind 'longrope' is not supported \(supported: default, linear, dynamic, "
            r"yarn, llama3\)",
        ),
        (
            dict(rope_type="yarn", original_max_position_embeddings=32),
            r"its yarn RoPE has no factor",
        ),
        (
            dict(rope_type="linear", factor=-2.0),
            r"model\.rope\.factor must be .*1024.*, got -2\.0",
        ),
        (
            dict(rope_type="yarn", factor=1e308, original_max_position_embeddings=32),
            r"model\.rope\.factor must be .*1024.*, got 1e\+308",
        ),
        (
            dict(rope_type="yarn", factor="8", original_max_position_embeddings=32),
            r"config\.json: rope_parameters\.factor is the string '8', not a number; write it "
            r"without quotes$",
        ),
        (
            dict(rope_type="default", rope_theta="5e5"),
            r"config\.json: rope_parameters\.rope_theta is the string '5e5', not a number; "
            r"write it without quotes$",
        ),
        (
            dict(rope_type="default", partial_rotary_factor=0.5),
            r"partial_rotary_factor 0\.5 is not supported",
        ),
    ],
    ids=[
        "longrope",
        "yarn-without-factor",
        "negative-factor",
        "huge-factor",
        "string-factor",
        "string-theta",
        "partial",
    ],
)
def test_a_rope_we_cannot_compute_is_one_line(rope, message, tmp_path):
    path = _config_json(tmp_path / "hf", model_type="llama", rope_parameters=rope)
    with pytest.raises(InitFromError, match=message) as e:
        hf_model_fields(path)
    assert str(e.value).startswith(f"init_from {path}: ") and "\n" not in str(e.value)


def test_keys_a_kind_does_not_use_are_refused():
    with pytest.raises(ConfigError, match=r"model\.rope\.factor is not used by .*kind=default"):
        RopeConfig(factor=2.0)
    with pytest.raises(ConfigError, match=r"model\.rope\.truncate is not used by .*kind=llama3"):
        RopeConfig(**KINDS[-1], truncate=False)
    with pytest.raises(ConfigError, match=r"model\.rope\.kind=yarn needs model\.rope\.factor"):
        RopeConfig(kind="yarn", original_max_position_embeddings=8)


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "llama3"])
def test_a_factor_is_bounded_for_every_kind_and_below_1_warns_once_in_one_line(kind):
    """1e308 (yarn would scale attention ×72) is refused naming the key and its range; a
    shrink (0.25) is computed as transformers computes it, with one warning line, as
    transformers gives one."""
    base = next(kw for kw in KINDS if kw["kind"] == kind)
    with pytest.raises(ConfigError, match=r"^model\.rope\.factor must be .*1024.*, got 1e\+308$"):
        RopeConfig(**base | {"factor": 1e308})
    RopeConfig(**base | {"factor": 1024.0})  # the bound itself is a factor
    with pytest.warns(UserWarning) as caught:
        rope = RopeConfig(**base | {"factor": 0.25})
    (w,) = caught
    assert str(w.message) == (
        f"model.rope.factor=0.25 is below 1: the {kind} RoPE shrinks the context instead of "
        "extending it (transformers warns of it too)"
    )
    cfg = ModelConfig(head_dim=16, rope=rope)
    ours = RotaryEmbedding(16, cfg.rope, cfg.max_position_embeddings)
    hf = _hf_rotary(cfg)
    assert torch.equal(ours.inv_freq, hf.inv_freq)
    assert ours.attention_scaling == hf.attention_scaling


def test_numbers_written_as_strings_are_refused_alike_in_yaml_and_in_config_json(tmp_path):
    """The run schema takes YAML numbers only (text never turns into a number silently),
    for θ as for the factor, saying why it got text (quotes, or YAML 1.1 reading an exponent
    without a dot as text); config.json's RoPE the same, its top-level rope_theta too."""
    for key, value, why in (
        ("theta", "5e5", " (YAML reads 5e5 as text; write 5.0e+5)"),
        ("factor", "8", "; write it without quotes"),
    ):
        rope = {"kind": "linear", "factor": 2.0} | {key: value}
        with pytest.raises(ConfigError) as e:
            from_dict(RunConfig, {"model": {"rope": rope}})
        assert str(e.value) == f"model.rope.{key}: expected a number, got str {value!r}{why}"
    text = yaml.safe_load("model: {rope: {theta: 5e5}}")  # PyYAML: YAML 1.1
    with pytest.raises(ConfigError, match=r"write 5\.0e\+5\)$"):
        from_dict(RunConfig, text)
    assert (
        from_dict(RunConfig, yaml.safe_load("model: {rope: {theta: 5.0e+5}}")).model.rope.theta
        == 5e5
    )
    path = _config_json(tmp_path / "hf", model_type="llama", rope_theta="5e5")
    with pytest.raises(InitFromError) as e:
        hf_model_fields(path)
    assert str(e.value) == (
        f"init_from {path}: {path / 'config.json'}: rope_theta is the string '5e5', not a "
        "number; write it without quotes"
    )
    path = _config_json(tmp_path / "hf2", model_type="llama", hidden_size="64")
    with pytest.raises(InitFromError, match=r": hidden_size is the string '64', not a number"):
        hf_model_fields(path)


def test_a_qwen3_head_dim_is_its_own_null_refused_absent_128(tmp_path):
    """transformers' Qwen3Config refuses head_dim null and defaults an absent one to 128
    (not hidden_size / heads, as Llama's does)."""
    path = _config_json(tmp_path / "null", model_type="qwen3", head_dim=None)
    with pytest.raises(InitFromError) as e:
        hf_model_fields(path)
    assert str(e.value).startswith(f"init_from {path}: {path / 'config.json'}: a Qwen3's head_dim")
    assert "\n" not in str(e.value)
    absent = {k: v for k, v in SHAPE.items() if k != "head_dim"}
    for model_type, want in (("qwen3", 128), ("llama", 64 // 4)):
        d = tmp_path / model_type
        d.mkdir()
        (d / "config.json").write_text(
            json.dumps(absent | dict(vocab_size=VOCAB, model_type=model_type))
        )
        assert hf_model_fields(d)["head_dim"] == want


@pytest.mark.parametrize("factor, want", [(16.0, 16 * ORIGINAL), (2.5, 2.5 * ORIGINAL)])
def test_a_yarn_export_loads_in_transformers_without_the_factor_warning(factor, want, tmp_path):
    """transformers warns on every load when YaRN's factor differs from
    max_position_embeddings / original: the export writes the scaled length."""
    import logging

    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from ulysses_mm.train.export import hf_config_for

    rope = dict(kind="yarn", factor=factor, original_max_position_embeddings=ORIGINAL)
    cfg = from_dict(ModelConfig, {**SHAPE, "modalities": {"text": VOCAB}, "rope": rope})
    cfg.max_position_embeddings = 4 * ORIGINAL  # the run's: a ratio of 4, not the factor
    hf_config_for(cfg, VOCAB + 8, torch.float32).save_pretrained(tmp_path)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = hf_logging.get_logger("transformers.modeling_rope_utils")
    logger.addHandler(handler)
    try:
        back = AutoConfig.from_pretrained(tmp_path)
    finally:
        logger.removeHandler(handler)
    assert back.max_position_embeddings == want
    assert back.rope_parameters["factor"] == factor
    assert [r.getMessage() for r in records if "factor" in r.getMessage()] == []
