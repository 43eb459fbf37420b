"""A run's stages through the estimate: every stage (``train.stages``, each a whole run
config, :func:`ulysses_mm.config.run_stages`) estimated on one world of GPUs, the stage
with the largest total (the peak stage) found, and the plan refused in one line where a
stage does not fit.

The world is fixed for a run; each stage brings its own length, micro-batch, sp, ring and
head groups, so dp = world / the stage's sp. ``ulysses-mm estimate`` prints one line per
stage and the peak stage's breakdown (:func:`run_staged_cli`); the train pre-flight calls
:func:`check_stages_fit` before any process starts. Both are arithmetic over the configs
(nothing is allocated), so they cost milliseconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from ulysses_mm.config import RunConfig, Stage, run_stages, to_dict
from ulysses_mm.core.errors import ConfigError, UserError
from ulysses_mm.core.layout import LayoutError, valid_head_groups, valid_sp_sizes
from ulysses_mm.core.storage import Location
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.tools.estimate.render import render
from ulysses_mm.tools.estimate.render_time import duration, headline, render_time
from ulysses_mm.tools.estimate.result import Estimate, EstimateOptions, estimate, host_refusal
from ulysses_mm.tools.estimate.search import head_group_choices, head_groups_arg
from ulysses_mm.tools.estimate.shape import token_space
from ulysses_mm.tools.estimate.step_time import StepTime, TimeSetup, step_time
from ulysses_mm.tools.estimate.units import GiB


@dataclass(frozen=True)
class StageEstimate:
    """One stage and its estimate on the run's world."""

    stage: Stage
    est: Estimate
    staged: bool  # the run has train.stages (keys are then named train.stages[i].…)

    @property
    def where(self) -> str:
        """The prefix of the keys this stage sets: ``train.stages[i].`` (none unstaged)."""
        return f"train.stages[{self.stage.index}]." if self.staged else ""

    def to_dict(self) -> dict[str, Any]:
        """The stage's line of the JSON's ``stages``."""
        step, est = self.est.step, self.est
        return {
            "index": self.stage.index,
            "start": self.stage.start,
            "steps": self.stage.steps,
            "end": self.stage.end,
            "seq_len": step.seq_len,
            "micro_batch": step.micro_batch,
            "sp": step.sp,
            "ring": step.ring_size,
            "dp": step.dp,
            "head_groups": step.head_groups,
            "rope": to_dict(self.stage.cfg.model.rope),
            "peak_phase": est.peak_phase,
            "peak": est.peak,
            "total": est.total,
            "fits": est.fits,
            "host_per_node": est.host_per_node,
            "host_fits": est.host_fits,
        }


def stage_world(cfg: RunConfig, gpus: int | None = None) -> int:
    """The run's world: ``gpus`` when given, else parallel.sp × parallel.dp when dp is set,
    else the largest sp of its stages (one DP group)."""
    if gpus is not None:
        return gpus
    if cfg.parallel.dp:
        return cfg.parallel.sp * cfg.parallel.dp
    return max(s.cfg.parallel.sp for s in run_stages(cfg))


def estimate_stages(
    cfg: RunConfig,
    world: int,
    seq_len: int = 0,
    head_groups: int | str | None = None,
    opts: EstimateOptions | None = None,
) -> list[StageEstimate]:
    """Every stage of ``cfg`` estimated on ``world`` GPUs with its own sp (dp = world / sp);
    a stage whose data.seq_len is 0 takes ``seq_len``. ``head_groups``: None = each stage's
    parallel.head_groups, a count for every stage, or ``auto`` (per stage, the count with the
    lowest total, the fewest among equals). ``opts``: the rest of the estimate's options
    (its gpus, sp and head_groups are the stage's). A layout a stage cannot run is refused naming the stage."""
    stages = run_stages(cfg)
    out = []
    for stage in stages:
        n = stage.seq_len or seq_len
        if not n:
            raise UserError(
                f"{stage.describe()}: data.seq_len is 0 (the manifest's); give --seq-len N"
            )
        sp = stage.cfg.parallel.sp
        at = replace(opts or EstimateOptions(), gpus=world, sp=sp)
        try:
            if head_groups == "auto":
                tried = [
                    estimate(stage.cfg, n, replace(at, head_groups=c))
                    for c in head_group_choices(stage.cfg, world, sp)
                ]
                est = min(tried, key=lambda e: (e.total, e.step.head_groups))
            else:
                assert not isinstance(head_groups, str), head_groups
                est = estimate(stage.cfg, n, replace(at, head_groups=head_groups))
        except LayoutError as e:
            raise LayoutError(f"{stage.describe()}: {e}") from None
        out.append(StageEstimate(stage, est, bool(cfg.train.stages)))
    return out


def peak_stage(rows: list[StageEstimate]) -> StageEstimate:
    """The stage with the largest total (the first among equals)."""
    return max(rows, key=lambda r: (r.est.total, -r.stage.index))


def what_helps(row: StageEstimate) -> str:
    """What would lower this stage's total, from the settings it does not use yet."""
    cfg, step, where = row.stage.cfg, row.est.step, row.where
    m, ds = cfg.model, cfg.deepspeed
    out = []
    more_sp = [
        p
        for p in valid_sp_sizes(m.num_attention_heads, step.seq_len, step.gpus, ring=step.ring_size)
        if p > step.sp
    ]
    if more_sp:
        out.append(f"{where}parallel.sp={more_sp[0]}")
    groups = valid_head_groups(m.num_attention_heads, m.num_key_value_heads, step.ulysses_size)
    more_groups = [c for c in groups if c > step.head_groups]
    if more_groups:
        out.append(f"{where}parallel.head_groups={more_groups[0]}")
    if not m.activation_checkpointing:
        out.append("model.activation_checkpointing=true")
    elif not m.offload_checkpoints:
        out.append("model.offload_checkpoints=true")
    if not m.layer_tile_tokens:
        out.append("model.layer_tile_tokens=8192")
    if ds.zero_stage < 3:
        out.append("deepspeed.zero_stage=3")
    if ds.offload_optimizer == "none":
        out.append("deepspeed.offload_optimizer=cpu")
    if step.micro_batch > 1:
        out.append(f"{where}data.micro_batch_size=1")
    return "try " + ", ".join([*out, f"or a shorter {where}data.seq_len"])


def over_budget(rows: list[StageEstimate], budget: str) -> str | None:
    """The one line that refuses the stages over their GPU's memory (``budget`` names it:
    ``--gpu-mem 80 GiB``), naming the first and what would help; None when all fit."""
    over = [r for r in rows if r.est.fits is False]
    if not over:
        return None
    first, est = over[0], over[0].est
    step = est.step
    also = f" (so do {', '.join(f'stage {r.stage.index}' for r in over[1:])})" if over[1:] else ""
    return (
        f"{first.stage.describe()} needs {est.total / GiB:.2f} GiB per GPU at "
        f"{step.seq_len:,} tokens on {step.gpus} GPUs (sp {step.sp}, head groups "
        f"{step.head_groups}), more than {budget}{also}; {what_helps(first)}"
    )


def check_stages_fit(
    cfg: RunConfig,
    world: int,
    manifest_seq_len: int,
    device: str = "cuda",
    *,
    space: TokenSpace | None = None,
) -> None:
    """The train pre-flight: when train.gpu_mem_gib > 0, every stage of ``cfg`` estimated
    on ``world`` GPUs (a stage whose data.seq_len is 0 at ``manifest_seq_len``) must fit
    it, else a :class:`ConfigError` names the first stage that does not, its total, the
    budget and what would help. ``device``: ``cuda`` (what ``ulysses-mm estimate``
    assumes; ``cuda:0`` counts as cuda) or ``cpu`` (tensor memory only). ``space``: the
    token space trained on (default: model.modalities, else the shipped specs')."""
    budget = cfg.train.gpu_mem_gib
    if not budget:
        return
    dev = "cuda" if device.split(":")[0] == "cuda" else "cpu"
    if space is None:
        space, _ = token_space(cfg)
    try:
        opts = EstimateOptions(device=dev, space=space, gpu_mem_gib=budget)
        rows = estimate_stages(cfg, world, manifest_seq_len, opts=opts)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    line = over_budget(rows, f"train.gpu_mem_gib={budget:g} GiB")
    if line:
        raise ConfigError(line)


def rope_text(cfg: RunConfig) -> str:
    """A stage's RoPE in a few characters: ``θ 500000, llama3 ×16``."""
    rope = cfg.model.rope
    scaled = rope.kind != "default" and rope.factor is not None
    return f"θ {rope.theta:g}" + (f", {rope.kind} ×{rope.factor:g}" if scaled else "")


def render_stages(rows: list[StageEstimate], config: str = "") -> str:
    """One line per stage (steps, length, layout, total, fits) with the peak marked."""
    peak = peak_stage(rows)
    est0 = rows[0].est
    mem = f" of {est0.gpu_mem / GiB:g} GiB" if est0.gpu_mem is not None else ""
    out = [
        f"ulysses-mm estimate{': ' + config if config else ''}: {len(rows)} stages on "
        f"{est0.step.gpus} GPUs{mem}",
        f"  {'stage':<7s}{'steps':>13s}{'seq_len':>12s}{'micro-batch':>13s}"
        f"{'sp × ring':>11s}{'dp':>4s}{'head groups':>13s}   {'rope':<22s}{'total GiB':>9s}   fits",
    ]
    for r in rows:
        s, step, est = r.stage, r.est.step, r.est
        steps = f"{s.start + 1}-{s.end}"
        fits = "-"
        if est.gpu_mem is not None:
            spare = (est.gpu_mem - est.total) / GiB
            fits = f"yes, {spare:.2f} spare" if spare >= 0 else f"NO, {-spare:.2f} over"
        if est.host_fits is False:
            fits += " (host memory over)"
        mark = "  <- peak" if r is peak else ""
        out.append(
            f"  {s.index:<7d}{steps:>13s}{step.seq_len:>12,}{step.micro_batch:>13d}"
            f"{f'{step.sp} × {step.ring_size}':>11s}{step.dp:>4d}{step.head_groups:>13d}"
            f"   {rope_text(s.cfg):<22s}{est.total / GiB:>9.2f}   {fits}{mark}"
        )
    return "\n".join(out)


def render_stage_times(rows: list[StageEstimate], times: list[StepTime], timing: TimeSetup) -> str:
    """One time line per stage and the whole run's time (--time)."""
    world = rows[0].est.step.gpus
    lines = [f"time on {world} × {timing.device.name} ({times[0].docs}):"]
    total = 0.0
    for row, st in zip(rows, times, strict=True):
        run = row.stage.steps * st.step_s
        total += run
        lines.append(
            f"  stage {row.stage.index:<3} {headline(st)} · {row.stage.steps} steps in "
            f"{duration(run)}"
        )
    lines.append(f"  the whole run: {duration(total)}")
    return "\n".join(lines)


def run_staged_cli(
    args: Any, cfg: RunConfig, opts: EstimateOptions, timing: TimeSetup | None = None
) -> int:
    """``ulysses-mm estimate`` on a config with train.stages: the per-stage table, then the
    peak stage's breakdown (or the JSON of it with ``stages`` and ``peak_stage``); with
    --gpu-mem, a plan whose peak stage does not fit is refused after them. ``opts`` are the
    command's options for :func:`estimate`; with ``timing`` (--time), each stage's step time
    and the whole run's time (each stage's steps × its step time) follow the table.

    Each stage sets its own layout, so --sp and --max (one length) are refused; --seq-len
    gives the length of the stages whose data.seq_len is 0 (else --manifest's seq_len), and
    --head-groups C or auto applies to every stage."""
    if args.sp is not None:
        raise UserError(
            "--sp: each stage of this config sets its own parallel.sp (train.stages); "
            "give --gpus for the world (dp = gpus / a stage's sp)"
        )
    if args.max:
        raise UserError(
            "--max finds one length, and each stage of this config has its own; estimate the "
            "stages (drop --max), or one layout with train.stages=[] and its parallel.sp"
        )
    stages = run_stages(cfg)
    unset = [s for s in stages if not s.seq_len]
    seq_len = args.seq_len or 0
    if seq_len and not unset:
        raise UserError(
            "--seq-len gives the length of stages whose data.seq_len is 0, and every stage of "
            "this config sets its own; drop --seq-len"
        )
    if unset and not seq_len and args.manifest:
        seq_len = Manifest.load(Location(args.manifest, cfg.data.storage_options)).seq_len
    rows = estimate_stages(
        cfg,
        stage_world(cfg, args.gpus),
        seq_len,
        head_groups_arg(getattr(args, "head_groups", None)),
        opts,
    )
    peak = peak_stage(rows)
    host_over = next((r for r in rows if r.est.host_fits is False), None)
    line = over_budget(rows, f"--gpu-mem {args.gpu_mem:g} GiB") if args.gpu_mem else None
    times = (
        [step_time(r.stage.cfg, r.est, *timing.args()) for r in rows] if timing is not None else []
    )
    if args.json:
        out = peak.est.to_dict()
        out["stages"] = [r.to_dict() for r in rows]
        for row, st in zip(out["stages"], times, strict=False):
            row["time"] = st.to_dict()
        if times:
            out["run_time_s"] = sum(r.stage.steps * st.step_s for r, st in zip(rows, times))
        out["peak_stage"] = peak.stage.index
        print(json.dumps(out, indent=1))
    else:
        print(render_stages(rows, str(args.config)) + "\n")
        if timing is not None:
            print(render_stage_times(rows, times, timing) + "\n")
        print(f"{peak.stage.describe()}, the peak stage:")
        print(render(peak.est, args.phases))
        if timing is not None:
            print()
            print(render_time(times[rows.index(peak)], peak.est.step.gpus, timing.budget))
    if host_over is not None:
        raise UserError(f"{host_over.stage.describe()}: {host_refusal(host_over.est)}")
    if line:
        raise UserError(line)
    return 0
