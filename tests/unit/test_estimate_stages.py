"""``ulysses-mm estimate`` on a run with train.stages, and the train pre-flight
(:func:`ulysses_mm.tools.estimate.stages.check_stages_fit`): every stage estimated with its
own length, micro-batch and layout on one world, the peak stage's breakdown, and a stage
that does not fit refused in one line naming it. Arithmetic only: milliseconds a case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ulysses_mm import cli
from ulysses_mm.config import ConfigError, RunConfig, load_config, run_stages
from ulysses_mm.tools.estimate import EstimateOptions, GiB, estimate
from ulysses_mm.tools.estimate.stages import (
    check_stages_fit,
    estimate_stages,
    peak_stage,
    stage_world,
)

REPO = Path(__file__).resolve().parents[2]

# debug-tiny's shape over a pinned token space, growing 64K -> 256K -> 1M tokens in three
# stages: sp 2 -> 4 -> 4, the last with its attention in two head groups
STAGED = """
model:
  hidden_size: 64
  intermediate_size: 172
  num_hidden_layers: 2
  num_attention_heads: 8
  num_key_value_heads: 2
  loss_tile_tokens: 2048
  modalities: {dna: 10}
parallel:
  sp: 2
train:
  steps: 30
  stages:
    - steps: 10
      data: {seq_len: 65536, micro_batch_size: 2}
    - steps: 10
      warmup_steps: 2
      data: {seq_len: 262144, micro_batch_size: 1}
      parallel: {sp: 4}
      model: {rope: {kind: yarn, factor: 4.0, original_max_position_embeddings: 65536}}
    - steps: 10
      data: {seq_len: 1048576}
      parallel: {head_groups: 2}
"""


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    path = tmp_path / "staged.yaml"
    path.write_text(STAGED)
    return path


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["estimate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_every_stage_is_its_own_estimate_and_the_longest_is_the_peak(staged: Path):
    cfg = load_config(RunConfig, staged)
    assert stage_world(cfg) == 4  # parallel.dp 0: the largest stage sp
    rows = estimate_stages(cfg, 4, opts=EstimateOptions(device="cpu"))
    layouts = [
        (r.est.step.seq_len, r.est.step.micro_batch, r.est.step.sp, r.est.step.dp) for r in rows
    ]
    assert layouts == [(65536, 2, 2, 2), (262144, 1, 4, 1), (1048576, 1, 4, 1)]
    assert [r.est.step.head_groups for r in rows] == [1, 1, 2]
    # each stage's figure is the plain estimate of that stage's run config
    for r, stage in zip(rows, run_stages(cfg), strict=True):
        sp = stage.cfg.parallel.sp
        assert (
            r.est.total
            == estimate(
                stage.cfg, stage.seq_len, EstimateOptions(gpus=4, sp=sp, device="cpu")
            ).total
        )
    assert peak_stage(rows).stage.index == 2


def test_cli_prints_a_line_per_stage_then_the_peak_stages_breakdown(capsys, staged: Path):
    rc, out, _ = _cli(capsys, str(staged), "--gpus", "8", "--gpu-mem", "80")
    assert rc == 0
    table, _, breakdown = out.partition("the peak stage:")
    lines = table.splitlines()
    assert "3 stages on 8 GPUs of 80 GiB" in lines[0]
    rows = [line.split() for line in lines[2:5]]
    assert [r[:2] for r in rows] == [["0", "1-10"], ["1", "11-20"], ["2", "21-30"]]
    assert [r[2] for r in rows] == ["65,536", "262,144", "1,048,576"]
    assert [r[7] for r in rows] == ["4", "2", "2"]  # dp = 8 / the stage's sp
    assert [r[8] for r in rows] == ["1", "1", "2"]  # head groups
    assert "yarn ×4" in lines[3] and "yes," in lines[4] and lines[4].endswith("<- peak")
    assert "stage 2 (steps 21-30), the peak stage:" in out
    assert "1,048,576 tokens per sample, 262,144 per GPU" in breakdown
    assert "attention in 2 head groups" in breakdown and "of 80 GiB: fits" in breakdown


def test_cli_json_has_the_stages_and_the_peak(capsys, staged: Path):
    rc, out, _ = _cli(capsys, str(staged), "--gpus", "4", "--json", "--device", "cpu")
    data = json.loads(out)
    assert rc == 0 and data["peak_stage"] == 2
    assert [s["seq_len"] for s in data["stages"]] == [65536, 262144, 1048576]
    assert [(s["start"], s["end"], s["sp"], s["dp"]) for s in data["stages"]] == [
        (0, 10, 2, 2),
        (10, 20, 4, 1),
        (20, 30, 4, 1),
    ]
    assert data["stages"][1]["rope"]["kind"] == "yarn" and data["stages"][2]["head_groups"] == 2
    # the top level is the peak stage's estimate
    assert data["layout"]["seq_len"] == 1048576 and data["total"] == data["stages"][2]["total"]
    assert max(s["total"] for s in data["stages"]) == data["total"]


def test_cli_refuses_a_stage_that_does_not_fit_in_one_line(capsys, staged: Path):
    cfg = load_config(RunConfig, staged)
    totals = [r.est.total / GiB for r in estimate_stages(cfg, 8)]
    mem = round((totals[1] + totals[2]) / 2, 2)  # stage 2 is over, 0 and 1 fit
    rc, out, err = _cli(capsys, str(staged), "--gpus", "8", "--gpu-mem", f"{mem:g}")
    assert rc == 2 and "<- peak" in out  # the table and breakdown come first
    line = err.strip()
    assert "\n" not in line
    assert f"stage 2 (steps 21-30) needs {totals[2]:.2f} GiB per GPU" in line
    assert f"more than --gpu-mem {mem:g} GiB" in line and "so do" not in line
    assert "train.stages[2].parallel.sp=8" in line  # its head groups are already the most
    assert "model.activation_checkpointing=true" in line


def test_cli_refusals_of_flags_one_layout_means(capsys, staged: Path):
    rc, _, err = _cli(capsys, str(staged), "--sp", "2")
    assert rc == 2 and "--sp: each stage of this config sets its own parallel.sp" in err
    rc, _, err = _cli(capsys, str(staged), "--max", "--gpu-mem", "80")
    assert rc == 2 and "--max finds one length" in err
    rc, _, err = _cli(capsys, str(staged), "--seq-len", "8192")
    assert rc == 2 and "drop --seq-len" in err
    rc, _, err = _cli(capsys, str(staged), "--gpus", "6")
    assert rc == 2 and "stage 0 (steps 1-10): sp=2" not in err and "stage 1 (steps 11-20)" in err


def test_seq_len_fills_the_stages_that_take_the_manifests(capsys, staged: Path):
    text = STAGED.replace(
        "data: {seq_len: 65536, micro_batch_size: 2}", "data: {micro_batch_size: 2}"
    )
    staged.write_text(text)
    rc, _, err = _cli(capsys, str(staged))
    assert rc == 2 and "stage 0 (steps 1-10): data.seq_len is 0" in err
    rc, out, _ = _cli(capsys, str(staged), "--seq-len", "8192", "--json", "--device", "cpu")
    assert rc == 0
    assert [s["seq_len"] for s in json.loads(out)["stages"]] == [8192, 262144, 1048576]


def test_pre_flight_passes_fails_and_is_off_without_a_budget(staged: Path):
    cfg = load_config(RunConfig, staged)
    check_stages_fit(cfg, 8, 65536, "cuda")  # gpu_mem_gib 0: no check
    totals = [r.est.total / GiB for r in estimate_stages(cfg, 8)]
    cfg.train.gpu_mem_gib = max(totals) + 0.01
    check_stages_fit(cfg, 8, 65536, "cuda:0")
    cfg.train.gpu_mem_gib = (totals[0] + totals[1]) / 2  # stages 1 and 2 are over
    with pytest.raises(ConfigError) as e:
        check_stages_fit(cfg, 8, 65536, "cuda")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("stage 1 (steps 11-20) needs")
    assert f"{totals[1]:.2f} GiB per GPU" in msg and "(so do stage 2)" in msg
    assert f"train.gpu_mem_gib={cfg.train.gpu_mem_gib:g} GiB" in msg
    assert "train.stages[1].parallel.sp=8, train.stages[1].parallel.head_groups=2" in msg
    # a stage that takes the manifest's length is estimated at it
    staged.write_text(STAGED.replace("seq_len: 65536, micro_batch_size", "micro_batch_size"))
    cfg = load_config(RunConfig, staged, ["train.gpu_mem_gib=0.001"])
    with pytest.raises(ConfigError, match=r"stage 0 \(steps 1-10\) needs .* at 131,072 tokens"):
        check_stages_fit(cfg, 4, 131072, "cpu")


def test_an_unstaged_run_is_one_stage():
    cfg = load_config(RunConfig, REPO / "configs" / "debug-tiny.yaml", ["train.gpu_mem_gib=0.001"])
    with pytest.raises(ConfigError, match=r"stage 0 \(steps 1-40\) needs .* at 8,192 tokens"):
        check_stages_fit(cfg, 2, 8192, "cpu")


def test_the_1m_recipe_fits_8_gpus_of_80_gib():
    cfg = load_config(RunConfig, REPO / "configs" / "llama3.1-8b-1m.yaml")
    assert cfg.train.gpu_mem_gib == 80
    check_stages_fit(cfg, 8, 1 << 20, "cuda")
    rows = estimate_stages(cfg, 8, opts=EstimateOptions(gpu_mem_gib=80))
    assert [r.est.step.seq_len for r in rows] == [1 << 17, 1 << 18, 1 << 19, 1 << 20]
    assert all(r.est.fits for r in rows)
