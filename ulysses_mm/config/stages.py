"""A run's shape in time: ``train.stages`` as whole run configs, one per stage.

Each stage is the run config with the stage's settings over the stage before's (the first
stage's over the run's own): ``data.seq_len``, ``data.micro_batch_size``, ``model.rope.*``
(a stage that names another RoPE kind starts from that kind's defaults, θ kept) and
``parallel.sp`` / ``ring`` / ``head_chunks``. A stage is therefore checked by the
same schema as any run, and everything downstream (the pre-flight, the loop, the
estimate) takes a stage's :class:`~ulysses_mm.config.RunConfig` as it takes a run's. A run
without stages is one stage: the run as configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ulysses_mm.config.parse import ConfigError, deep_merge, from_dict, to_dict

if TYPE_CHECKING:
    from ulysses_mm.config.schema import RunConfig


@dataclass(frozen=True)
class Stage:
    """Stage ``index``: optimizer steps ``start + 1 .. start + steps`` of the run, trained
    as ``cfg`` says (its ``train.stages`` empty), re-warmed up over ``warmup_steps``."""

    index: int
    start: int
    steps: int
    warmup_steps: int
    cfg: RunConfig

    @property
    def end(self) -> int:
        """The run's step count once this stage is done."""
        return self.start + self.steps

    @property
    def seq_len(self) -> int:
        """The stage's ``data.seq_len`` (0 = the shards')."""
        return self.cfg.data.seq_len

    def lr_factor(self, step: int) -> float:
        """The stage's re-warm-up factor on the run's lr at run step ``step`` (1-based)."""
        k = step - self.start
        if self.warmup_steps and 1 <= k < self.warmup_steps:
            return k / self.warmup_steps
        return 1.0

    @property
    def key(self) -> str:
        """``train.stages[1] (steps 21-40)``: how a one-line error names the stage."""
        return f"train.stages[{self.index}] (steps {self.start + 1}-{self.end})"

    def describe(self) -> str:
        """``stage 1 (steps 21-40)``, as one-line errors and the report name it."""
        return f"stage {self.index} (steps {self.start + 1}-{self.end})"


def _overrides(stage: Any) -> dict[str, Any]:
    """The keys a stage sets, as a partial run config."""
    out: dict[str, Any] = {}
    data = {k: v for k, v in to_dict(stage.data).items() if v is not None}
    parallel = {k: v for k, v in to_dict(stage.parallel).items() if v is not None}
    if data:
        out["data"] = data
    if parallel:
        out["parallel"] = parallel
    if stage.model.rope:
        out["model"] = {"rope": dict(stage.model.rope)}
    return out


def run_stages(cfg: RunConfig) -> list[Stage]:
    """The run's stages, each a whole run config; a stage whose settings make a bad run
    config raises one line naming it (``train.stages[1]: model.rope.kind=yarn needs …``)."""
    from ulysses_mm.config.schema import RunConfig

    if not cfg.train.stages:
        return [Stage(0, 0, cfg.train.steps, 0, cfg)]
    base = to_dict(cfg)
    base["train"]["stages"] = []
    stages, start = [], 0
    for i, stage in enumerate(cfg.train.stages):
        kind = stage.model.rope.get("kind")
        if kind is not None and kind != base["model"]["rope"]["kind"]:
            # another kind starts from its own defaults: the keys of the kind before go
            # (a kind refuses keys it does not use), θ stays unless the stage sets it
            base["model"]["rope"] = {"theta": base["model"]["rope"]["theta"]}
        base = deep_merge(base, _overrides(stage))
        try:
            run = from_dict(RunConfig, base)
        except ConfigError as e:
            raise ConfigError(f"train.stages[{i}]: {e}") from None
        stages.append(Stage(i, start, stage.steps, stage.warmup_steps, run))
        start += stage.steps
    return stages


def stage_of(stages: list[Stage], steps_done: int) -> Stage:
    """The stage that runs the next step after ``steps_done`` (the last one once all ran)."""
    for stage in stages:
        if steps_done < stage.end:
            return stage
    return stages[-1]
