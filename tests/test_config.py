"""The config schema: types enforced, unknown keys named with the closest valid one,
precedence CLI > file > defaults."""

from __future__ import annotations

import pytest

from ulysses_mm.config import (
    ConfigError,
    ModelConfig,
    RunConfig,
    deep_merge,
    describe,
    from_dict,
    load_config,
    parse_overrides,
    to_dict,
)


def _write(tmp_path, text: str):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_precedence_cli_over_file_over_defaults(tmp_path):
    p = _write(tmp_path, "model:\n  hidden_size: 128\n  num_hidden_layers: 3\ntrain:\n  steps: 7\n")
    cfg = load_config(RunConfig, p, ["model.hidden_size=256", "data.train=s3://bucket/m.json"])
    assert cfg.model.hidden_size == 256  # CLI
    assert cfg.model.num_hidden_layers == 3  # file
    assert cfg.train.steps == 7  # file
    assert cfg.model.num_attention_heads == 4  # default
    assert cfg.data.train == "s3://bucket/m.json"
    assert cfg.model.head_dim == 64  # derived after all sources merged


def test_unknown_key_names_full_path_and_closest(tmp_path):
    p = _write(tmp_path, "model:\n  hiden_size: 128\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'model.hiden_size'; did you mean 'model.hidden_size'\?"
    ):
        load_config(RunConfig, p)
    with pytest.raises(ConfigError, match=r"unknown key 'modle'; did you mean 'model'\?"):
        load_config(RunConfig, None, ["modle.hidden_size=3"])
    with pytest.raises(
        ConfigError, match=r"'deepspeed.optimizer.lrr'; did you mean 'deepspeed.optimizer.lr'"
    ):
        load_config(RunConfig, None, ["deepspeed.optimizer.lrr=0.1"])


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.hidden_size=12.5", r"model.hidden_size: expected an integer, got float 12.5"),
        ("model.hidden_size=true", r"model.hidden_size: expected an integer, got bool True"),
        (
            "model.activation_checkpointing=yes please",
            r"model.activation_checkpointing: expected true or false",
        ),
        ("parallel.attention=fastest", r"parallel.attention: 'fastest' is not one of"),
        ("deepspeed.zero_stage=4", r"deepspeed.zero_stage: 4 is not one of \[0, 1, 2, 3\]"),
        ("model.modalities={dna: many}", r"model.modalities.dna: expected an integer"),
        ("deepspeed.optimizer.betas=0.9", r"deepspeed.optimizer.betas: expected a list"),
        ("model=3", r"model: expected a mapping for section ModelConfig"),
    ],
)
def test_wrong_types_are_rejected_with_the_key_path(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, [override])


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="must be a multiple of model.num_key_value_heads"):
        load_config(RunConfig, None, ["model.num_attention_heads=4", "model.num_key_value_heads=3"])
    with pytest.raises(ConfigError, match="parallel.sp must be >= 1"):
        load_config(RunConfig, None, ["parallel.sp=0"])


def test_float_accepts_int_and_roundtrip():
    cfg = load_config(RunConfig, None, ["deepspeed.optimizer.lr=1", "model.loss_weights={dna: 2}"])
    assert cfg.deepspeed.optimizer.lr == 1.0 and isinstance(cfg.deepspeed.optimizer.lr, float)
    assert from_dict(RunConfig, to_dict(cfg)) == cfg


def test_overrides_parse_yaml_values():
    assert parse_overrides(["a.b=3", "a.c=[1, 2]", "d=x=y"]) == {
        "a": {"b": 3, "c": [1, 2]},
        "d": "x=y",
    }
    with pytest.raises(ConfigError, match="not of the form section.key=value"):
        parse_overrides(["model.hidden_size"])


def test_an_override_that_is_not_yaml_is_one_config_error():
    # a shell glob with braces inside a flow list used to end in a yaml ParserError traceback
    with pytest.raises(
        ConfigError, match=r"override 'sources=\[a/\*\.\{mp4,webm\}\]': the value is not YAML"
    ):
        parse_overrides(["sources=[a/*.{mp4,webm}]"])
    with pytest.raises(ConfigError, match="model.modalities='\"...\"'"):
        parse_overrides(["model.modalities={dna: ["])


def test_an_override_replaces_the_value_at_its_key(tmp_path):
    p = _write(
        tmp_path,
        "model:\n  modalities: {dna: 10, audio: 256, video: 256}\n  num_attention_heads: 8\n"
        "  num_key_value_heads: 2\n",
    )
    assert load_config(RunConfig, p).model.modalities == {"dna": 10, "audio": 256, "video": 256}
    assert load_config(RunConfig, p, ["model.modalities={}"]).model.modalities == {}
    cfg = load_config(RunConfig, p, ["model.modalities={text: 151931}"])
    assert cfg.model.modalities == {"text": 151931}
    # dotted overrides of different keys of one section still combine, over the file
    cfg = load_config(RunConfig, p, ["model.hidden_size=64", "model.num_hidden_layers=2"])
    assert (cfg.model.hidden_size, cfg.model.num_hidden_layers) == (64, 2)
    assert (cfg.model.num_attention_heads, cfg.model.num_key_value_heads) == (8, 2)
    assert cfg.model.modalities == {"dna": 10, "audio": 256, "video": 256}
    # the last override of a key wins; a later dotted override adds to an earlier mapping
    cfg = load_config(
        RunConfig,
        p,
        ["model.modalities.audio=7", "model.modalities={dna: 3}", "model.modalities.video=5"],
    )
    assert cfg.model.modalities == {"dna": 3, "video": 5}


def test_override_mappings_come_out_plain():
    """The replace mark stays inside the config merge: ``deepspeed.extra`` still merges
    into the generated ds_config key by key."""
    cfg = load_config(
        RunConfig, None, ["deepspeed.extra.zero_optimization={reduce_bucket_size: 8}"]
    )
    assert type(cfg.deepspeed.extra["zero_optimization"]) is dict
    merged = deep_merge({"zero_optimization": {"stage": 2}}, cfg.deepspeed.extra)
    assert merged["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 8}
    assert type(deep_merge({}, parse_overrides(["a={b: {c: 1}}"]))["a"]) is dict


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(RunConfig, _write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(RunConfig, _write(tmp_path, "model: [\n"))
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(RunConfig, tmp_path / "missing.yaml")


def test_every_key_is_documented():
    rows = describe(RunConfig)
    assert any(key == "model.hidden_size" for key, _, _ in rows)
    assert all(text for _, _, text in rows), [k for k, _, t in rows if not t]


def test_llama_mapping_is_one_to_one():
    from transformers import LlamaConfig

    cfg = ModelConfig(num_key_value_heads=2)
    hf = LlamaConfig(vocab_size=100, **cfg.to_llama_config_kwargs())
    for key, value in cfg.to_llama_config_kwargs().items():
        if key == "rope_theta" and not hasattr(hf, key):  # transformers 5 keeps it here
            assert hf.rope_parameters["rope_theta"] == value
        else:
            assert getattr(hf, key) == value, key


def test_cli_drops_the_deepspeed_launchers_local_rank(capsys):
    from conftest import REPO

    from ulysses_mm.cli import main

    cfg = str(REPO / "configs" / "debug-tiny.yaml")
    assert main(["config", cfg, "--local_rank=3", "model.hidden_size=96", "--local_rank", "1"]) == 0
    assert "hidden_size: 96" in capsys.readouterr().out
