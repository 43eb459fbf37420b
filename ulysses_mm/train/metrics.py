"""The loss figures a run logs, summed over micro-batches the one way training and
evaluation both use.

Each micro-batch's :class:`~ulysses_mm.parallel.LossReport` holds every modality's mean
loss over the global batch and its target count; a modality's loss over several
micro-batches is the target-weighted mean of those means (the sum of its losses over all
its targets, over their number), not the mean of the means. DNA has one token per base,
so its loss in bits is bits per base.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Sequence

import torch

from ulysses_mm.parallel import LossReport

LN2 = math.log(2.0)


class ModalitySums:
    """Per modality: the loss summed over its targets, and their number."""

    def __init__(self, modalities: Sequence[str]) -> None:
        self.modalities = list(modalities)
        self.sums = {m: 0.0 for m in self.modalities}
        self.counts = {m: 0 for m in self.modalities}

    def add(self, report: LossReport) -> None:
        for m, v in report.per_modality.items():
            self.sums[m] += v * report.counts[m]
            self.counts[m] += report.counts[m]

    def means(self) -> dict[str, float]:
        """Each modality's mean loss per target, for the modalities that had targets."""
        return {m: self.sums[m] / self.counts[m] for m in self.modalities if self.counts[m]}

    def weighted_mean(self, weights: Sequence[float]) -> float:
        """The mean of the modalities' losses weighted by ``weights`` (token-space order),
        over the modalities that had targets (NaN when none had)."""
        means = self.means()
        pairs = [(float(w), means[m]) for m, w in zip(self.modalities, weights) if m in means]
        wsum = sum(w for w, _ in pairs)
        return sum(w * v for w, v in pairs) / wsum if wsum else math.nan

    def metrics(self, prefix: str = "", targets: bool = False) -> dict[str, float]:
        """``{prefix}loss/<m>`` (and ``targets/<m>`` when asked) for each modality with
        targets, then ``{prefix}bits_per_base/dna`` when DNA had some."""
        out: dict[str, float] = {}
        for m, mean in self.means().items():
            out[f"{prefix}loss/{m}"] = mean
            if targets:
                out[f"targets/{m}"] = self.counts[m]
        if f"{prefix}loss/dna" in out:
            out[f"{prefix}bits_per_base/dna"] = out[f"{prefix}loss/dna"] / LN2
        return out


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB
