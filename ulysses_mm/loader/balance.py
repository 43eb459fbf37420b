"""Balanced steps: a global step's samples spread over DP ranks and micro-steps by their
attention work.

Inside an SP group every rank holds a slice of the same sample, so sequence parallelism
is balanced by construction; across DP groups it is not. With attention isolated inside
documents, a packed sample's attention costs Σ lᵢ(lᵢ+1)/2 over its documents (its causal
pairs), while its linear layers cost the same for every sample of ``seq_len`` tokens: at
1M tokens one whole chromosome costs about a hundred times the attention of a hundred
10K-token clips. Each micro-step ends in collectives every DP rank joins (the global
loss's all-reduce, the gradient reduction at the boundary), so a micro-step lasts as
long as its slowest rank, and a step as the sum over its micro-steps.

:func:`assign` places the ``gas × dp × micro_batch`` samples of one step (the positions
of :class:`~ulysses_mm.loader.order.GlobalOrder` the step reads, unchanged) so that the
sum over micro-steps of the slowest rank's work is small: the samples sorted by work,
heaviest first, fill the micro-steps in turn (one micro-step holds samples of similar
work, so no rank waits long for another), and inside a micro-step each sample goes to
the rank with the least work that still has room (LPT with ``micro_batch`` places per
rank). Ties go by position, so the plan is a pure function of the step's samples — of
the seed and the step — the same on every rank, and a resume (also onto another dp, whose
steps are other positions anyway) continues it. The loss does not change: the step's
loss is token-weighted over the whole step (:func:`~ulysses_mm.parallel.global_loss`
with the step's counts), whichever rank and micro-step hold a sample.

The work of a sample is its causal pairs plus ``linear`` pair-equivalents per token (the
dense layers' FLOPs per token over attention's FLOPs per pair,
:func:`~ulysses_mm.train.flops.pairs_per_token`), so a figure of work is comparable
across samples of any length. The pairs come from the manifest (``sample_pairs``,
written by ``prepare``, :func:`~ulysses_mm.core.format.sample_pairs`), so no rank reads another rank's shards to plan.

Dims: S = gas·dp·mb samples of a step; plans are int64 ``[gas, dp, mb]`` of positions
0..S-1 in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Work:
    """How a stream weighs its samples: ``linear`` pair-equivalents per token, and
    whether it balances steps by that work (else it only measures it)."""

    linear: float
    balance: bool = True


def sample_work(pairs: np.ndarray, tokens: np.ndarray | int, linear: float) -> np.ndarray:
    """Work of each sample in pair-equivalents: its causal pairs + ``linear`` per token."""
    return np.asarray(pairs, dtype=np.float64) + float(linear) * np.asarray(tokens, np.float64)


def in_order(count: int, dp: int, micro_batch: int) -> np.ndarray:
    """The unbalanced plan: micro-step k, rank r reads positions
    ``k·dp·mb + [r·mb, (r+1)·mb)`` (:func:`~ulysses_mm.loader.order.rank_positions`)."""
    return np.arange(count * dp * micro_batch, dtype=np.int64).reshape(count, dp, micro_batch)


def assign(work: np.ndarray, dp: int, micro_batch: int, count: int) -> np.ndarray:
    """The balanced plan ``[count, dp, micro_batch]`` for one step's ``work`` (module
    docstring); each rank's positions ascending inside a micro-step."""
    S = count * dp * micro_batch
    work = np.asarray(work, dtype=np.float64)
    if work.shape != (S,):
        raise ValueError(f"work holds {work.shape} samples, the step {S}")
    order = np.lexsort((np.arange(S), -work))  # heaviest first, ties by position
    plan = np.empty((count, dp, micro_batch), dtype=np.int64)
    per = dp * micro_batch
    for k in range(count):
        load = np.zeros(dp)
        filled = np.zeros(dp, dtype=np.int64)
        for i in order[k * per : (k + 1) * per]:
            room = np.flatnonzero(filled < micro_batch)
            r = int(room[np.argmin(load[room])])  # the least loaded with room, lowest rank
            plan[k, r, filled[r]] = i
            filled[r] += 1
            load[r] += work[i]
        plan[k].sort(axis=1)
    return plan


@dataclass(frozen=True)
class StepWork:
    """One step's work per (micro-step, DP rank) under a plan, and what it implies."""

    per_rank: np.ndarray  # [count, dp] pair-equivalents

    @classmethod
    def of(cls, work: np.ndarray, plan: np.ndarray) -> StepWork:
        return cls(np.asarray(work, dtype=np.float64)[plan].sum(axis=2))

    @property
    def critical(self) -> float:
        """The step's length in work: each micro-step waits for its slowest rank."""
        return float(self.per_rank.max(axis=1).sum())

    @property
    def mean(self) -> float:
        """The step's work per rank, were it spread evenly."""
        return float(self.per_rank.mean(axis=1).sum())

    @property
    def max_over_mean(self) -> float:
        """≥ 1: how much longer the step is than a perfectly even one (1 when it is)."""
        return self.critical / self.mean if self.mean > 0 else 1.0


@dataclass(frozen=True)
class Imbalance:
    """Steps drawn at random from a dataset's samples: the mean over them of the slowest
    rank's work over the mean work (:attr:`StepWork.max_over_mean`), read in order and
    balanced; their ratio is the speedup balancing gives a step bound by compute."""

    in_order: float
    balanced: float
    steps: int

    @property
    def speedup(self) -> float:
        return self.in_order / self.balanced


def simulate(
    work: np.ndarray, dp: int, micro_batch: int, count: int, steps: int = 64, seed: int = 0
) -> Imbalance:
    """:class:`Imbalance` over ``steps`` steps, each ``count × dp × micro_batch`` samples
    drawn without replacement from ``work`` (each sample's work), as a shuffled order
    reads them (with replacement when the dataset holds fewer)."""
    work = np.asarray(work, dtype=np.float64)
    S = count * dp * micro_batch
    rng = np.random.default_rng(seed)
    order = in_order(count, dp, micro_batch)
    crit_in = crit_bal = mean = 0.0
    for _ in range(steps):
        step = work[rng.choice(len(work), S, replace=len(work) < S)]
        read = StepWork.of(step, order)
        crit_in += read.critical
        crit_bal += StepWork.of(step, assign(step, dp, micro_batch, count)).critical
        mean += read.mean
    if mean <= 0:
        return Imbalance(1.0, 1.0, steps)
    return Imbalance(crit_in / mean, crit_bal / mean, steps)
