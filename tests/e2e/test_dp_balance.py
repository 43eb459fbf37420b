"""Balanced steps end to end: ``ulysses-mm train`` at dp 2 with gradient accumulation over
samples of unequal attention work logs the same losses with ``data.balance`` on and off
(the step's loss does not depend on where its samples are), a shorter slowest-rank work
when on, and a balanced run resumed — on the same layout, bitwise; on another dp, up to
summation order — continues the uninterrupted run."""

from __future__ import annotations

import shutil

import pytest
from train_data import MIXED_LENGTHS, prepare_dna, tiny_run, train_rows, write_config

STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp-balance")
    manifest = prepare_dna(root, "mixed", len(MIXED_LENGTHS), 256, seed=3, lengths=MIXED_LENGTHS)
    base = tiny_run(steps=STEPS, checkpoint_every=2)
    cfg = write_config(
        root,
        "run",
        base,
        data={"train": str(manifest), "micro_batch_size": 1, "seed": 5},
        parallel={"sp": 1, "timeout_s": 120},
        deepspeed={**base["deepspeed"], "gradient_accumulation_steps": 2},
    )
    on = train_rows(cfg, root / "on", nproc=2)
    off = train_rows(cfg, root / "off", "data.balance=false", nproc=2)
    return {"root": root, "config": cfg, "on": on, "off": off}


def test_balanced_steps_give_the_unbalanced_losses_and_less_waiting(runs):
    on, off = runs["on"], runs["off"]
    assert sorted(on) == sorted(off) == list(range(1, STEPS + 1))
    for step in on:
        assert on[step]["loss"] == pytest.approx(off[step]["loss"], rel=1e-6), step
        # off: read in order; on: the same steps' samples spread by work
        assert off[step]["balance/max_over_mean"] == off[step]["balance/in_order_max_over_mean"]
        assert on[step]["balance/in_order_max_over_mean"] == pytest.approx(
            off[step]["balance/in_order_max_over_mean"]
        )
        assert 1.0 <= on[step]["balance/max_over_mean"] <= off[step]["balance/max_over_mean"]
    gains = [off[s]["balance/max_over_mean"] / on[s]["balance/max_over_mean"] for s in on]
    assert max(gains) > 1.05, gains


def test_a_balanced_run_resumes_exactly_also_on_another_dp(runs):
    root, cfg = runs["root"], runs["config"]
    resumed = root / "resumed"
    shutil.copytree(root / "on", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    (resumed / "checkpoints" / "latest").write_text("step_00000002")
    again = train_rows(cfg, resumed, "--resume", nproc=2)
    assert [again[s]["loss"] for s in (3, 4)] == [runs["on"][s]["loss"] for s in (3, 4)]
    # elastic: dp 1 × sp 2 with micro-batches of 2 reads the same 4 samples a step
    elastic = root / "elastic"
    shutil.copytree(resumed, elastic)
    shutil.rmtree(elastic / "checkpoints" / "step_00000004")
    (elastic / "checkpoints" / "latest").write_text("step_00000002")
    moved = train_rows(
        cfg, elastic, "--resume", "parallel.sp=2", "data.micro_batch_size=2", nproc=2
    )
    for s in (3, 4):
        assert moved[s]["loss"] == pytest.approx(runs["on"][s]["loss"], rel=1e-5), s
