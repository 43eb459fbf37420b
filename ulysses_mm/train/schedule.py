"""The learning-rate schedule: linear warm-up from the first step to the exact peak, then
cosine down to ``min_lr_ratio`` of it (``WarmupCosineLR``) or flat (``WarmupLR``).

Not DeepSpeed's classes of those names: they set the rate of iteration -1 (0) before the
first step and step after each optimizer step, so with ``warmup_min_ratio`` 0 steps 1 and 2
both run at lr 0 (the weights unchanged), and the cosine takes over one step before the
warm-up reaches its peak, which is never applied. Here optimizer step k (1-based) runs at
``peak · lr_factor(k)``; DeepSpeed calls :meth:`WarmupSchedule.step` after each step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ulysses_mm.config import SchedulerConfig


def lr_factor(step: int, warmup: int, total: int, min_ratio: float, cosine: bool) -> float:
    """Fraction of the peak lr optimizer step ``step`` (1-based) applies: ``step/warmup``
    up to step ``warmup`` (1.0 there, exactly), then a cosine from 1 at the peak step to
    ``min_ratio`` at step ``total`` (and after), or 1.0 without the cosine."""
    peak_step = max(warmup, 1)
    if step < peak_step:
        return step / peak_step
    if not cosine:
        return 1.0
    progress = min(1.0, (step - peak_step) / max(1, total - peak_step))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupSchedule:
    """Sets each param group's lr to its peak (the optimizer's lr when built) times
    :func:`lr_factor` of the next step. Its state is the number of steps taken, so a
    resumed run with more ``train.steps`` follows the new cosine."""

    def __init__(
        self,
        optimizer: Any,
        warmup: int,
        total: int,
        min_ratio: float,
        cosine: bool,
        stage_lr: Callable[[int], float] | None = None,
    ):
        self.optimizer = optimizer
        self.warmup, self.total, self.min_ratio, self.cosine = warmup, total, min_ratio, cosine
        self.stage_lr = stage_lr
        self.peaks = [float(g["lr"]) for g in optimizer.param_groups]
        self.steps = 0  # optimizer steps taken
        self._apply()

    def _apply(self) -> None:
        step = self.steps + 1
        f = lr_factor(step, self.warmup, self.total, self.min_ratio, self.cosine)
        if self.stage_lr is not None:
            f *= self.stage_lr(step)
        for group, peak in zip(self.optimizer.param_groups, self.peaks, strict=True):
            group["lr"] = peak * f

    def step(self, *_: Any, **__: Any) -> None:
        self.steps += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # a checkpoint of DeepSpeed's WarmupLR / WarmupCosineLR counts from -1
        self.steps = int(state["steps"] if "steps" in state else state["last_batch_iteration"] + 1)
        self._apply()


def lr_schedule(
    s: SchedulerConfig, total_steps: int, stage_lr: Callable[[int], float] | None = None
) -> Any:
    """``deepspeed.initialize``'s ``lr_scheduler``: a factory of the run's schedule on
    DeepSpeed's optimizer, or None for ``type: none`` (with ``stage_lr``, a staged run's
    re-warm-up factor of each step, a flat schedule that applies it)."""
    if s.type == "none" and stage_lr is None:
        return None
    cosine = s.type == "WarmupCosineLR"
    warmup = s.warmup_steps if s.type != "none" else 0

    def build(optimizer: Any) -> WarmupSchedule:
        return WarmupSchedule(optimizer, warmup, total_steps, s.min_lr_ratio, cosine, stage_lr)

    return build
