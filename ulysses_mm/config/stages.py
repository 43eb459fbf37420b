"""A run's shape in time: ``train.stages`` as whole run configs, one per stage.

A stage is its steps, a re-warm-up, and the keys it sets over the stage before's (the first
stage's over the run's own), dotted (``data.seq_len: 512``) or nested (``data: {seq_len:
512}``). Which keys a stage may set is one list, :data:`~ulysses_mm.config.schema.STAGE_KEYS`
(``data.seq_len``, ``data.micro_batch_size``, ``model.rope.*``, the SP layout); a stage is
checked by building its whole :class:`~ulysses_mm.config.RunConfig`
(:meth:`~ulysses_mm.config.RunConfig.stage_configs`), so everything downstream (the
pre-flight, the loop, the estimate) takes a stage's config as it takes a run's. A run
without stages is one stage: the run as configured.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def run_stages(cfg: RunConfig) -> list[Stage]:
    """The run's stages, each with its whole run config."""
    if not cfg.train.stages:
        return [Stage(0, 0, cfg.train.steps, 0, cfg)]
    stages, start = [], 0
    for i, (stage, run) in enumerate(zip(cfg.train.stages, cfg.stage_configs(), strict=True)):
        stages.append(Stage(i, start, stage["steps"], stage["warmup_steps"], run))
        start += stage["steps"]
    return stages


def stage_of(stages: list[Stage], steps_done: int) -> Stage:
    """The stage that runs the next step after ``steps_done`` (the last one once all ran)."""
    for stage in stages:
        if steps_done < stage.end:
            return stage
    return stages[-1]
