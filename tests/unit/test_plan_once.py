"""The pre-flight of a training run: the parent plans it once (a rank in its process trains
on that plan; ranks of their own processes plan again), and the memory budget,
``train.gpu_mem_gib``, is checked inside it, so every route through ``run_train`` gets it."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
from conftest import REPO
from helpers.train_data import prepare_dna

from ulysses_mm.config import ConfigError, RunConfig, load_config
from ulysses_mm.tools.estimate.stages import check_stages_fit
from ulysses_mm.train import loop, plan
from ulysses_mm.train.loop import TrainResult


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return prepare_dna(tmp_path_factory.mktemp("plan"), "d", records=40, seq_len=256)


def _cfg(manifest, tmp_path, *overrides: str) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [
            f"data.train={manifest}",
            f"train.out_dir={tmp_path / 'run'}",
            "train.steps=2",
            "model.num_attention_heads=4",
            "model.num_key_value_heads=2",
            "logging.wandb=disabled",
            *overrides,
        ],
    )


@pytest.fixture
def plans(monkeypatch):
    """Every plan_run call of the parent and of a rank in its process."""
    calls: list[plan.RunPlan | None] = []  # None: a call that raised
    real = plan.plan_run

    def counting(*args, **kwargs):
        calls.append(None)
        calls[-1] = real(*args, **kwargs)
        return calls[-1]

    monkeypatch.setattr(loop, "plan_run", counting)
    return calls


class _Rank:
    """A rank that records the plan it was handed and trains nothing."""

    given: ClassVar[list[plan.RunPlan | None]] = []

    def __init__(self, cfg, resume=False, stop=None, started=None, plan=None):
        self.cfg = cfg
        _Rank.given.append(plan)

    def run(self) -> TrainResult:
        return TrainResult(self.cfg.train.steps, self.cfg.train.out_dir, "", None, math.nan)


def test_one_process_is_planned_once_and_trains_on_that_plan(
    manifest, tmp_path, plans, monkeypatch
):
    monkeypatch.setattr(loop, "Trainer", _Rank)
    _Rank.given = []
    memory = []

    def check(cfg, world, manifest_seq_len, *, space):
        memory.append((world, manifest_seq_len, space.vocab_size))
        check_stages_fit(cfg, world, manifest_seq_len, space=space)

    cfg = _cfg(manifest, tmp_path, "train.gpu_mem_gib=80")
    result = loop.run_train(cfg, None, memory=check)
    assert result["steps"] == 2
    assert len(plans) == 1  # the parent's, handed to the rank in its process
    assert _Rank.given == [plans[0]]
    assert memory == [(1, 256, plans[0].space.vocab_size)]


def test_ranks_of_their_own_processes_plan_again(manifest, tmp_path, plans, monkeypatch):
    handed = []

    def world(fn, nproc, *args, **kwargs):
        handed.append(args[3])  # the plan train_worker gets
        return [{"steps": 2}]

    monkeypatch.setattr(loop.launch, "run_world", world)
    cfg = _cfg(manifest, tmp_path, "parallel.sp=2")
    assert loop.run_train(cfg, 2)["steps"] == 2
    assert len(plans) == 1 and handed == [None]  # a plan is not sent to other processes


def test_the_memory_budget_is_checked_in_the_preflight(manifest, tmp_path, plans, monkeypatch):
    started = []
    monkeypatch.setattr(loop.launch, "run_world", lambda *a, **k: started.append(1))
    cfg = _cfg(manifest, tmp_path, "train.gpu_mem_gib=0.001")
    with pytest.raises(ConfigError) as e:
        loop.run_train(cfg, None, memory=check_stages_fit)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("stage 0 (steps 1-2) needs ")
    assert "GiB per GPU at 256 tokens on 1 GPUs" in line
    assert "more than train.gpu_mem_gib=0.001 GiB" in line
    assert len(plans) == 1 and not started  # refused before any process starts


def test_no_budget_no_memory_check(manifest, tmp_path):
    asked = []
    cfg = _cfg(manifest, tmp_path)
    assert cfg.train.gpu_mem_gib == 0
    plan.plan_run(cfg, 1, memory=lambda *a, **k: asked.append(a))
    assert asked == []


def test_the_train_command_plans_once_with_its_budget(
    manifest, tmp_path, plans, monkeypatch, capsys
):
    """``ulysses-mm train`` with train.gpu_mem_gib: one plan, the budget checked in it (it
    planned the run three times: once for the budget, once in run_train, once in the rank)."""
    from ulysses_mm.cli import main

    monkeypatch.setattr(loop, "Trainer", _Rank)
    _Rank.given = []
    args = [f"data.train={manifest}", f"train.out_dir={tmp_path / 'run'}", "train.steps=2"]
    args += ["logging.wandb=disabled", "parallel.sp=1"]
    config = REPO / "configs" / "debug-tiny.yaml"
    assert main(["train", str(config), *args, "train.gpu_mem_gib=80"]) == 0
    assert len(plans) == 1 and _Rank.given == [plans[0]]
    assert "trained 2 steps" in capsys.readouterr().out
    plans.clear()
    assert main(["train", str(config), *args, "train.gpu_mem_gib=0.001"]) == 2
    assert len(plans) == 1 and len(_Rank.given) == 1  # refused in the plan: no rank
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than train.gpu_mem_gib=0.001 GiB" in err[0]
