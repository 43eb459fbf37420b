"""A resume keeps what the checkpoint was trained as: its stage and the ones before it
(steps, length, RoPE), the architecture, steps left to run; what elastic resume allows
(micro-batch, SP layout, stages after the checkpoint's, the checkpoint's own stage
growing) still passes. Each refusal is one ConfigError naming the stage and the key."""

from __future__ import annotations

import copy

import pytest

from ulysses_mm.config import RunConfig, from_dict, run_stages
from ulysses_mm.core.errors import ConfigError
from ulysses_mm.train.plan import check_resume_matches, resume_record

SHARDS = 4096  # the shards' samples
STAGED = {
    "model": {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2},
    "train": {
        "steps": 8,
        "stages": [
            {"steps": 4, "data": {"seq_len": 1024}, "parallel": {"sp": 1}},
            {
                "steps": 4,
                "data": {"seq_len": 2048},
                "parallel": {"sp": 2},
                "model": {
                    "rope": {
                        "kind": "yarn",
                        "factor": 2.0,
                        "original_max_position_embeddings": 1024,
                    }
                },
            },
        ],
    },
}


def _cfg(change=None) -> RunConfig:
    d = copy.deepcopy(STAGED)
    if change:
        change(d)
    return from_dict(RunConfig, d)


def _saved(step: int = 5) -> dict:
    return resume_record(run_stages(_cfg()), step, SHARDS)


def _check(change, step: int = 5) -> None:
    check_resume_matches(_saved(step), _cfg(change), "ckpt/step_00000005", SHARDS)


def _stage1(d):
    return d["train"]["stages"][1]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: _stage1(d)["data"].update(seq_len=1024), "its data.seq_len is 1024"),
        (
            lambda d: _stage1(d)["model"].update(rope={"kind": "linear", "factor": 8.0}),
            "its model.rope is",
        ),
        (lambda d: d["train"].update(stages=d["train"]["stages"][:1], steps=4), "is at step 5"),
        (
            lambda d: d["train"].update(stages=[], steps=8),
            "lacks (train.stages is empty)",
        ),
        (
            lambda d: (
                d["train"]["stages"][0].update(steps=5),
                _stage1(d).update(steps=3),
            ),
            "its steps is 5",
        ),
        (lambda d: d["model"].update(hidden_size=64), "model.hidden_size=64"),
        (lambda d: d["train"].update(steps=4, stages=[]), "train.steps=4"),
    ],
)
def test_a_changed_run_is_refused(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _check(change)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: _stage1(d)["parallel"].update(sp=1),  # the SP layout within a stage
        lambda d: _stage1(d)["data"].update(micro_batch_size=2),
        lambda d: (  # a stage appended after the checkpoint's
            d["train"]["stages"].append({"steps": 4, "data": {"seq_len": 4096}}),
            d["train"].update(steps=12),
        ),
        lambda d: (_stage1(d).update(steps=8), d["train"].update(steps=12)),  # its own grows
    ],
)
def test_what_elastic_resume_allows_passes(change):
    _check(change)


def test_a_stage_ending_before_its_checkpoint_is_refused():
    def shrink(d):
        _stage1(d).update(steps=1)
        d["train"]["stages"].append({"steps": 3, "data": {"seq_len": 4096}})

    _check(shrink)  # ends exactly at the checkpoint (step 5): allowed
    with pytest.raises(ConfigError, match="was saved inside it at step 6"):
        check_resume_matches(_saved(6), _cfg(shrink), "ckpt/step_00000006", SHARDS)
