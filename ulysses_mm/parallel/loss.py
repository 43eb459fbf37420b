"""The global loss: each modality's token-weighted mean over the whole (dp × sp) batch.

Each rank has per-modality (sum of cross-entropy, target count) over its own tokens. The
counts are all-reduced (they carry no gradient); each rank's share of the loss is then
``Σ_m w_m · sum_m / count_m(global) / Σ_present w_m``, so the shares of all ranks add up to
exactly the single-process loss, and so do their gradients: summing gradients over every
rank (what the engine's reduction does, up to its averaging factor) gives the gradient of
one process on the same global batch.

With ``step_counts`` (the targets of each modality in a whole optimizer step: every
micro-batch of gradient accumulation, every DP group) a share divides by those instead, so
the shares of all micro-steps add up to the token-weighted loss of the whole step — which
does not depend on which micro-step or rank holds a sample (balanced steps move them), and
accumulating k micro-batches gives the gradient of one batch k times larger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ulysses_mm.core.errors import ConfigError
from ulysses_mm.parallel.mesh import Mesh


@dataclass
class LossReport:
    """Global figures (identical on every rank), detached."""

    total: float
    per_modality: dict[str, float]  # mean CE (nats) per target token, modalities present
    counts: dict[str, int]
    # evaluation only: THIS rank's CE sums per (modality, position bin) [M, bins], not reduced
    by_bin: Tensor | None = None
    hits_by_bin: Tensor | None = None  # and how many of those targets the argmax gets right


def loss_weights(modalities: Sequence[str], weights: Mapping[str, float], device=None) -> Tensor:
    unknown = set(weights) - set(modalities)
    if unknown:
        raise ConfigError(
            f"loss weights name modalities {sorted(unknown)} not in {list(modalities)}"
        )
    return torch.tensor([float(weights.get(m, 1.0)) for m in modalities], device=device)


def global_loss(
    sums: Tensor,
    counts: Tensor,
    weights: Tensor,
    mesh: Mesh,
    modalities: Sequence[str],
    step_counts: Tensor | None = None,
) -> tuple[Tensor, LossReport]:
    """(this rank's share of the loss, for backward; the global report). With
    ``step_counts`` [M], the share is of the whole step's loss (module docstring); the
    report is this micro-batch's either way."""
    counts_g = counts.detach().clone()
    sums_g = sums.detach().clone()
    if mesh.distributed:
        both = torch.cat([counts_g, sums_g])
        dist.all_reduce(both, group=mesh.world_group)
        counts_g, sums_g = both.split(len(modalities))
    w = weights.to(sums.dtype) * (counts_g > 0)
    wsum = w.sum()
    if float(wsum) == 0.0:
        share = sums.sum() * 0.0  # no target anywhere: a zero loss that still has a graph
        return share, LossReport(0.0, {}, {m: 0 for m in modalities})
    if step_counts is None:
        share = (w * sums / counts_g.clamp(min=1)).sum() / wsum
    else:
        c = step_counts.to(sums.dtype)
        ws = weights.to(sums.dtype) * (c > 0)
        share = (ws * sums / c.clamp(min=1)).sum() / ws.sum().clamp(min=1e-30)
    means = sums_g / counts_g.clamp(min=1)
    total = float((w * means).sum() / wsum)
    per = {m: float(means[i]) for i, m in enumerate(modalities) if counts_g[i] > 0}
    return share, LossReport(total, per, {m: int(counts_g[i]) for i, m in enumerate(modalities)})
