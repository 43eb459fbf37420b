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


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.hidden_size=0", r"model.hidden_size must be >= 1, got 0"),
        ("model.intermediate_size=0", r"model.intermediate_size must be >= 1, got 0"),
        ("model.num_hidden_layers=0", r"model.num_hidden_layers must be >= 1, got 0"),
        ("model.num_attention_heads=0", r"model.num_attention_heads must be >= 1, got 0"),
        ("model.num_key_value_heads=0", r"model.num_key_value_heads must be >= 1, got 0"),
        ("model.max_position_embeddings=0", r"model.max_position_embeddings must be >= 1"),
        ("model.head_dim=0", r"model.head_dim must be >= 1, got 0"),
        ("model.rms_norm_eps=0", r"model.rms_norm_eps must be > 0, got 0.0"),
        ("model.rope.theta=-1", r"model.rope.theta must be > 0, got -1.0"),
        ("model.initializer_range=-0.1", r"model.initializer_range must be >= 0"),
        (
            "model.loss_weights={dna: -1}",
            r"model.loss_weights.dna must be within 0 .. 1e\+06, got -1.0",
        ),
        (
            "model.loss_weights={dna: .nan}",
            r"model.loss_weights.dna must be within 0 .. 1e\+06, got nan",
        ),
        ("parallel.timeout_s=0", r"parallel.timeout_s must be >= 1, got 0"),
        ("data.train={a.json: 0}", r"data.train: the weight of a.json is 0.0; give a positive one"),
        (
            "data.train={a.json: .inf}",
            r"data.train: the weight of a.json is inf; give a positive one",
        ),
        (
            "data.train={a.json: {modalities: {dna: -1}}}",
            r"data.train: a.json: the weight of dna is -1.0; give a positive one",
        ),
        ("data.seq_len=-1", r"data.seq_len must be >= 0, got -1"),
        ("data.micro_batch_size=0", r"data.micro_batch_size must be >= 1, got 0"),
        ("data.seed=-1", r"data.seed must be within 0 .. 2\*\*63 - 1, got -1"),
        ("data.shuffle_buffer=-1", r"data.shuffle_buffer must be >= 0, got -1"),
        ("data.retries=-1", r"data.retries must be >= 0, got -1"),
        ("data.retry_backoff_s=-1", r"data.retry_backoff_s must be >= 0, got -1.0"),
        ("data.prefetch_bytes=-1", r"data.prefetch_bytes must be >= 0, got -1"),
        ("data.cache_bytes=-1", r"data.cache_bytes must be >= 0, got -1"),
        ("data.connect_timeout_s=0", r"data.connect_timeout_s=0.0: give a positive number"),
        ("data.read_timeout_s=-2", r"data.read_timeout_s=-2.0: give a positive number"),
        ("deepspeed.gradient_accumulation_steps=0", r"gradient_accumulation_steps must be >= 1"),
        ("deepspeed.gradient_clipping=-1", r"deepspeed.gradient_clipping must be >= 0"),
        ("deepspeed.offload_param=cpu", r"deepspeed.offload_param needs deepspeed.zero_stage=3"),
        ("deepspeed.extra={scheduler: {type: WarmupLR}}", r"both set the LR schedule"),
        ("deepspeed.optimizer.lr=-1", r"deepspeed.optimizer.lr must be >= 0, got -1.0"),
        ("deepspeed.optimizer.eps=0", r"deepspeed.optimizer.eps must be > 0, got 0.0"),
        ("deepspeed.optimizer.weight_decay=-1", r"deepspeed.optimizer.weight_decay must be >= 0"),
        ("deepspeed.optimizer.betas=[0.9]", r"deepspeed.optimizer.betas must be two numbers"),
        ("deepspeed.optimizer.betas=[0.9, 1]", r"deepspeed.optimizer.betas must be two numbers"),
        ("deepspeed.scheduler.warmup_steps=-1", r"deepspeed.scheduler.warmup_steps must be >= 0"),
        ("deepspeed.scheduler.min_lr_ratio=2", r"deepspeed.scheduler.min_lr_ratio must be within"),
        ("train.steps=0", r"train.steps must be >= 1, got 0"),
        ("train.log_every=0", r"train.log_every must be >= 1, got 0"),
        ("train.eval_batches=0", r"train.eval_batches must be >= 1, got 0"),
        ("train.eval_every=-1", r"train.eval_every must be >= 0, got -1"),
        ("train.checkpoint_every=-1", r"train.checkpoint_every must be >= 0, got -1"),
        ("train.keep_checkpoints=-1", r"train.keep_checkpoints must be >= 0, got -1"),
        ("train.peak_tflops=-1", r"train.peak_tflops must be >= 0, got -1.0"),
        ("train.seed=-1", r"train.seed must be within 0 .. 2\*\*63 - 1, got -1"),
        (f"train.seed={2**63}", rf"train.seed must be within 0 .. 2\*\*63 - 1, got {2**63}"),
        ("train.seed=99999999999999999999999", r"train.seed must be within 0 .. 2\*\*63 - 1"),
        ("train.steps=-3", r"train.steps must be >= 1, got -3"),
        ("train.checkpoint_every=-5", r"train.checkpoint_every must be >= 0, got -5"),
        ("parallel.dp=-1", r"parallel.dp must be >= 0, got -1"),
        ("model.modalities={dna: 0}", r"model.modalities.dna must be >= 1, got 0"),
        ("model.loss_tile_tokens=0", r"model.loss_tile_tokens must be >= 1, got 0"),
        ("model.loss_weights={dna: 1.0e+308}", r"model.loss_weights.dna must be within 0 \.\. 1e"),
        (
            "data.train={a.json: 1.0e+308}",
            r"the weight of a.json is 1e\+308; give .* within \(0, 1e\+06\]",
        ),
        (
            "data.train={a.json: {modalities: {dna: 1.0e+308}}}",
            r"a.json: the weight of dna is 1e\+308; give .* within \(0, 1e\+06\]",
        ),
    ],
)
def test_values_are_checked_when_the_config_is_built(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, [override])


def test_the_edges_of_the_ranges_are_accepted():
    cfg = load_config(
        RunConfig,
        None,
        [
            "data.retries=0",
            "data.shuffle_buffer=0",
            "data.prefetch_bytes=0",
            f"data.seed={2**63 - 1}",
            "train.seed=0",
            "train.steps=1",
            "train.checkpoint_every=0",
            "model.loss_weights={dna: 0}",
            "deepspeed.scheduler.min_lr_ratio=1",
        ],
    )
    assert cfg.data.seed == 2**63 - 1 and cfg.data.timeouts == (10.0, 60.0)


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
    # a shell glob with braces inside a flow list: one line, not a yaml ParserError traceback
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
    assert any(key == "model.hidden_size" for key, *_ in rows)
    assert all(text for *_, text in rows), [k for k, *_, t in rows if not t]


def test_every_numeric_key_states_its_range():
    rows = {key: (tp, rng) for key, tp, rng, _ in describe(RunConfig)}
    numeric = [k for k, (tp, _) in rows.items() if tp in ("int", "float", "int | None")]
    assert numeric and all(rows[k][1] for k in numeric), [k for k in numeric if not rows[k][1]]
    assert rows["train.steps"][1] == ">= 1"
    assert rows["model.rms_norm_eps"][1] == "> 0"
    assert rows["train.seed"][1] == "0 .. 2**63 - 1"
    assert rows["deepspeed.optimizer.betas"][1] == "[0, 1)"
    assert rows["data.train"][1] == ""  # a string or a mix: no range of its own


def test_config_keys_prints_the_ranges(capsys):
    from ulysses_mm.cli import main

    assert main(["config", "--keys"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert ">= 1" in lines["train.steps"] and "Optimizer steps to run." in lines["train.steps"]
    assert "0 .. 2**63 - 1" in lines["data.seed"]
    assert "0 .. 1e+06" in lines["model.loss_weights"]
    assert " - " in lines["data.train"]  # no range of its own


def test_the_range_is_the_one_the_check_enforces():
    from dataclasses import fields

    from ulysses_mm.config import TrainConfig

    for f in fields(TrainConfig):
        r = f.metadata.get("range")
        if r is None or r.low is None:
            continue
        below = r.low - 1 if isinstance(getattr(TrainConfig(), f.name), int) else r.low - 0.5
        with pytest.raises(ConfigError, match=rf"train\.{f.name} must be .*{r.low}"):
            TrainConfig(**{f.name: below})


def test_llama_mapping_is_one_to_one():
    from transformers import LlamaConfig

    cfg = ModelConfig(num_key_value_heads=2)
    hf = LlamaConfig(vocab_size=100, **cfg.to_llama_config_kwargs())
    for key, value in cfg.to_llama_config_kwargs().items():
        assert getattr(hf, key) == value, key


def test_cli_drops_the_deepspeed_launchers_local_rank(capsys):
    from conftest import REPO

    from ulysses_mm.cli import main

    cfg = str(REPO / "configs" / "debug-tiny.yaml")
    assert main(["config", cfg, "--local_rank=3", "model.hidden_size=96", "--local_rank", "1"]) == 0
    assert "hidden_size: 96" in capsys.readouterr().out
