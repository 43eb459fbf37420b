"""A stage (``train.stages[i]``) is its steps, a re-warm-up and dotted keys over the stage
before's: nested YAML and dotted keys give the same run, a key outside the one allow-list
(``STAGE_KEYS``) or a bad value is one line naming the stage and the key, and a warm-up
longer than its stage is refused."""

from __future__ import annotations

import pytest

from ulysses_mm.config import ConfigError, RunConfig, from_dict, load_config, run_stages, to_dict
from ulysses_mm.config.schema import STAGE_KEYS

ALLOWED = (
    "a stage sets steps, warmup_steps and data.seq_len, data.micro_batch_size, "
    "data.window_positions, model.rope.*, parallel.sp, parallel.ring, parallel.head_groups"
)


def _run(*stages: dict, steps: int | None = None) -> RunConfig:
    total = steps if steps is not None else sum(s.get("steps", 0) for s in stages)
    return from_dict(RunConfig, {"train": {"steps": total, "stages": list(stages)}})


def _refusal(*stages: dict) -> str:
    with pytest.raises(ConfigError) as e:
        _run(*stages, steps=sum(max(1, s.get("steps", 1)) for s in stages))
    line = str(e.value)
    assert "\n" not in line
    return line


def test_nested_and_dotted_stages_are_the_same_run():
    nested = _run(
        {"steps": 2, "data": {"seq_len": 512}},
        {
            "steps": 3,
            "warmup_steps": 1,
            "parallel": {"sp": 2},
            "model": {
                "rope": {"kind": "yarn", "factor": 4, "original_max_position_embeddings": 512}
            },
        },
    )
    dotted = _run(
        {"steps": 2, "data.seq_len": 512},
        {
            "steps": 3,
            "warmup_steps": 1,
            "parallel.sp": 2,
            "model.rope.kind": "yarn",
            "model.rope.factor": 4,
            "model.rope": {"original_max_position_embeddings": 512},  # a dotted section
        },
    )
    assert nested.train.stages == dotted.train.stages
    assert nested.train.stages[1] == {
        "steps": 3,
        "warmup_steps": 1,
        "parallel.sp": 2,
        "model.rope.kind": "yarn",
        "model.rope.factor": 4,
        "model.rope.original_max_position_embeddings": 512,
    }
    stages = run_stages(dotted)
    assert [(s.start, s.steps, s.warmup_steps) for s in stages] == [(0, 2, 0), (2, 3, 1)]
    # each stage's whole config: its keys over the stage before's
    first, second = (s.cfg for s in stages)
    assert (first.data.seq_len, first.parallel.sp, first.model.rope.kind) == (512, 1, "default")
    assert (second.data.seq_len, second.parallel.sp) == (512, 2)
    assert (second.model.rope.kind, second.model.rope.factor) == ("yarn", 4.0)
    assert second.train.stages == [] and second.train.steps == 5
    # the flat form round-trips (what a rank rebuilds from the parent's dict)
    assert from_dict(RunConfig, to_dict(dotted)).train.stages == dotted.train.stages


def test_another_rope_kind_starts_from_its_defaults_theta_kept():
    cfg = _run(
        {"steps": 1, "model.rope": {"theta": 5e5, "kind": "linear", "factor": 2}},
        {"steps": 1, "model.rope.kind": "default"},  # linear's factor goes with it
        {"steps": 1, "model.rope.kind": "dynamic", "model.rope.factor": 8},
    )
    ropes = [s.cfg.model.rope for s in run_stages(cfg)]
    assert [(r.kind, r.factor, r.theta) for r in ropes] == [
        ("linear", 2.0, 5e5),
        ("default", None, 5e5),
        ("dynamic", 8.0, 5e5),
    ]


def test_null_is_the_stage_befores():
    cfg = _run({"steps": 1, "data.seq_len": 256}, {"steps": 1, "data": {"seq_len": None}})
    assert [s.cfg.data.seq_len for s in run_stages(cfg)] == [256, 256]


@pytest.mark.parametrize(
    ("stage", "key"),
    [
        ({"model": {"hidden_size": 128}}, "model.hidden_size"),
        ({"parallel.dp": 2}, "parallel.dp"),
        ({"deepspeed": {"zero_stage": 3}}, "deepspeed.zero_stage"),
        ({"train.steps": 3}, "train.steps"),
    ],
)
def test_a_key_not_allowed_is_one_line_naming_it_and_the_allowed_keys(stage, key):
    line = _refusal({"steps": 4}, {"steps": 4, **stage})
    assert line == f"train.stages[1]: {key} is not a key a stage may set; {ALLOWED}"


@pytest.mark.parametrize(
    ("stage", "key", "near"),
    [
        ({"data": {"seqlen": 512}}, "data.seqlen", "data.seq_len"),
        ({"model.rope_theta": 3}, "model.rope_theta", "model.rope"),
    ],
)
def test_a_misspelt_key_gets_the_closest_allowed_one(stage, key, near):
    line = _refusal({"steps": 4, **stage})
    assert (
        line
        == f"train.stages[0]: {key} is not a key a stage may set (did you mean {near}?); {ALLOWED}"
    )


def test_every_allowed_key_is_a_key_of_the_run_config():
    run = to_dict(RunConfig())
    for key in STAGE_KEYS:
        node = run
        for part in key.split("."):
            assert part in node, key
            node = node[part]


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        ({"data.seq_len": -1}, "data.seq_len must be >= 0, got -1"),
        ({"data": {"micro_batch_size": 0}}, "data.micro_batch_size must be >= 1, got 0"),
        ({"parallel.sp": "two"}, "parallel.sp: expected an integer, got str 'two'"),
        (
            {"model": {"rope": {"kind": "yarn"}}},
            "model.rope.kind=yarn needs model.rope.factor",
        ),
        ({"model.rope.factor": 2.0}, "model.rope.factor is not used by model.rope.kind=default"),
        ({"model.rope.kind": "ntk"}, "model.rope.kind: 'ntk' is not one of"),
    ],
)
def test_a_bad_value_is_the_schemas_message_naming_the_stage(stage, message):
    line = _refusal({"steps": 2}, {"steps": 2, **stage})
    assert line.startswith(f"train.stages[1]: {message}")


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (
            [{"steps": 1, "warmup_steps": 50}, {"steps": 9}],
            "train.stages[0].warmup_steps=50 is longer than the stage (steps: 1); give at most 1",
        ),
        ([{"steps": 0}], "train.stages[0].steps must be >= 1, got 0"),
        ([{"warmup_steps": 1}], "train.stages[0]: give its steps (steps: N)"),
        (
            [{"steps": 1, "data": {"seq_len": 4}, "data.seq_len": 8}],
            "train.stages[0]: data.seq_len is given twice (nested and dotted); give it once",
        ),
        (
            [{"steps": 1, "model.rope": 5, "model.rope.kind": "yarn"}],
            "train.stages[0]: model.rope and model.rope.kind both set model.rope; give one",
        ),
    ],
)
def test_a_stages_own_keys_are_checked_in_one_line(stages, message):
    assert _refusal(*stages) == message


def test_a_warmup_as_long_as_its_stage_passes():
    cfg = _run({"steps": 2, "warmup_steps": 2})
    (stage,) = run_stages(cfg)
    assert [stage.lr_factor(k) for k in (1, 2)] == [0.5, 1.0]


def test_a_config_file_names_itself_and_the_stage(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "train:\n  steps: 3\n  stages:\n    - steps: 3\n      model: {num_hidden_layers: 4}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, path)
    assert str(e.value) == (
        f"{path}: train.stages[0]: model.num_hidden_layers is not a key a stage may set; {ALLOWED}"
    )


def test_an_old_key_name_in_a_stage_is_read_with_a_one_line_hint():
    with pytest.warns(FutureWarning) as caught:
        cfg = from_dict(
            RunConfig,
            {
                "model": {"num_attention_heads": 8},
                "train": {"steps": 2, "stages": [{"steps": 2, "parallel": {"head_chunks": 2}}]},
            },
        )
    assert [str(w.message) for w in caught] == [
        "'train.stages[0].parallel.head_chunks' is now 'train.stages[0].parallel.head_groups'; "
        "rename it in the config"
    ]
    assert cfg.train.stages == [{"steps": 2, "warmup_steps": 0, "parallel.head_groups": 2}]
    assert run_stages(cfg)[0].cfg.parallel.head_groups == 2
