"""Held-out loss as training computes it, in the units people quote, and by position.

Every batch goes through :func:`~ulysses_mm.train.step.forward_loss`, the forward of a
training step (this rank's slice under the run's sequence-parallel layout, the global
per-modality loss), asked for the cross-entropy per position bin too. So the periodic
eval of ``ulysses-mm train`` and ``ulysses-mm evaluate`` on the same batches give the same
figures. Per modality:

- nats per token: its mean cross-entropy over its targets (what training logs);
- bits per unit, where the tokenizer kind says what a token is worth
  (:meth:`Tokenizer.unit <ulysses_mm.tokenize.base.Tokenizer.unit>`): DNA bits per base,
  mu-law audio bits per sample, text bits per UTF-8 byte (each target id counts the bytes
  it decodes to), codec audio bits per second, video bits per frame (per ``<eof>``).
  The bits of every target of the modality (its specials too) over the units;
- loss against position inside documents: the target's position (``position_ids`` + 1,
  which carries on across samples for a long document), in log-spaced bins (4 per
  octave, up to the longest document seen), or in the bins a caller gives (the probe's
  two halves).

Dims: M modalities, B bins.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ulysses_mm.core.format import IGNORE
from ulysses_mm.core.tokenspace import EOF, TokenSpace
from ulysses_mm.loader.batch import Batch
from ulysses_mm.tokenize.table import TokenizerTable
from ulysses_mm.train.metrics import LN2, ModalitySums
from ulysses_mm.train.step import Setup, forward_loss

PER_OCTAVE = 4
MAX_OCTAVES = 41  # positions up to 2^41: more than any document


def log_edges() -> list[int]:
    """Integer bin edges, :data:`PER_OCTAVE` a doubling, every power of two one of them:
    0, 1, 2, …, 8, 10, 11, 13, 16, 19, 23, 27, 32, … (each bin is ``[edge_i, edge_i+1)``)."""
    raw = [0] + [round(2 ** (j / PER_OCTAVE)) for j in range(PER_OCTAVE * MAX_OCTAVES + 1)]
    return sorted(set(raw))


@dataclass(frozen=True)
class Unit:
    """What a modality's token is worth: ``name`` (base, sample, byte, second, frame) and,
    per head output (the specials, then the range), the units of that target."""

    name: str
    table: Tensor  # float64 [specials + V_m]


def units_for(space: TokenSpace, tokenizers: TokenizerTable) -> dict[str, Unit]:
    """The unit of each modality whose tokenizer kind gives one (:meth:`Tokenizer.unit
    <ulysses_mm.tokenize.base.Tokenizer.unit>`)."""
    ns = space.num_specials
    out: dict[str, Unit] = {}
    for m in space.modalities:
        entry = tokenizers.entries.get(m) or {}
        cls = tokenizers.kind_class(m)
        if cls is None:
            continue
        size = space.range(m).size
        unit = cls.unit(entry, size, functools.partial(tokenizers.tokenizer, m))
        if unit is None:
            continue
        table = np.zeros(ns + size, dtype=np.float64)
        table[ns:] = unit.weights
        table[EOF] = unit.eof
        out[m] = Unit(unit.name, torch.from_numpy(table))
    return out


def position_bins(local: Batch, edges: Tensor) -> Tensor:
    """[b, n] bin of each target's position (-1 where no target or outside the edges)."""
    pos = local.position_ids + 1  # the predicted token's position in its document
    b = torch.bucketize(pos, edges, right=True) - 1
    out_of = (b < 0) | (b >= len(edges) - 1) | (local.labels == IGNORE)
    return torch.where(out_of, torch.full_like(b, -1), b)


@dataclass
class EvalResult:
    """Figures over the whole evaluated set, identical on every rank."""

    modalities: list[str]
    loss: float  # the weighted mean of the modalities' losses (training's total)
    nats: dict[str, float]  # per token, modalities with targets
    targets: dict[str, int]
    units: dict[str, tuple[str, float]]  # modality -> (unit, units counted)
    edges: list[int]
    bins: dict[str, list[tuple[int, int, float, int]]]  # (lo, hi, nats per token, targets)
    batches: int = 0
    samples: int = 0
    # per modality, beside ``bins``: how many of each bin's targets the model's first guess
    # (argmax) gets right
    hits: dict[str, list[int]] = field(default_factory=dict)
    binned_by: str = "position"  # what the bins are of: "distance" for the recall probe

    def bits_per_unit(self) -> dict[str, tuple[str, float]]:
        out = {}
        for m, (name, count) in self.units.items():
            if m in self.nats and count > 0:
                out[m] = (name, self.nats[m] * self.targets[m] / LN2 / count)
        return out

    def metrics(self, prefix: str = "eval/") -> dict[str, Any]:
        """Scalars (``loss``, ``loss/<m>`` in nats per token, ``bits_per_<unit>/<m>``) and,
        per modality, ``position/<m>``: the bins as [lo, hi, nats per token, targets]."""
        out: dict[str, Any] = {f"{prefix}batches": self.batches, f"{prefix}loss": self.loss}
        for m, v in self.nats.items():
            out[f"{prefix}loss/{m}"] = v
        for m, (name, v) in self.bits_per_unit().items():
            out[f"{prefix}bits_per_{name}/{m}"] = v
        for m, rows in self.bins.items():
            out[f"{prefix}position/{m}"] = [list(r) for r in rows]
        return out

    def to_json(self) -> dict[str, Any]:
        per = {}
        bpu = self.bits_per_unit()
        for m in self.modalities:
            if m not in self.nats:
                continue
            entry: dict[str, Any] = {
                "targets": self.targets[m],
                "nats_per_token": self.nats[m],
                "bits_per_token": self.nats[m] / LN2,
            }
            if m in bpu:
                name, v = bpu[m]
                entry[f"bits_per_{name}"] = v
                entry[f"{name}s"] = self.units[m][1]
            right = self.hits.get(m)
            entry[f"by_{self.binned_by}"] = [
                {"lo": lo, "hi": hi, "nats_per_token": v, "targets": n}
                | ({"right": right[j], "accuracy": right[j] / n} if right else {})
                for j, (lo, hi, v, n) in enumerate(self.bins.get(m, []))
            ]
            per[m] = entry
        return {
            "loss": self.loss,
            "batches": self.batches,
            "samples": self.samples,
            "modalities": per,
        }


@torch.no_grad()
def evaluate_batches(
    setup: Setup,
    batches: Iterable[Batch | tuple[Batch, Tensor]],
    units: Mapping[str, Unit] | None = None,
    edges: Sequence[int] | None = None,
) -> EvalResult:
    """Evaluate whole samples (each sliced for this rank here) through ``setup.engine``.

    ``edges``: position bins (default :func:`log_edges`); ``units``: :func:`units_for`.
    A batch given as (batch, bins) brings its own [b, N] bin of each target (-1: none)
    instead of its position's (the recall probe's distance buckets; ``edges`` then name
    the buckets), sliced for this rank as the labels are."""
    space, device = setup.space, setup.device
    mods = list(space.modalities)
    edge_list = list(edges) if edges is not None else log_edges()
    edge_t = torch.tensor(edge_list, dtype=torch.long, device=device)
    nb = len(edge_list) - 1
    units = units or {}
    tables = {m: u.table.to(device) for m, u in units.items()}
    # this rank's sums, reduced once at the end: CE and targets per (modality, bin) and
    # units per modality
    by_bin = torch.zeros(len(mods), nb, dtype=torch.float64, device=device)
    bin_counts = torch.zeros(len(mods), nb, dtype=torch.float64, device=device)
    hits = torch.zeros(len(mods), nb, dtype=torch.float64, device=device)
    unit_counts = torch.zeros(len(mods), dtype=torch.float64, device=device)
    sums = ModalitySums(mods)  # the global per-modality figures, as training sums them
    count = samples = 0
    for item in batches:
        batch, given = item if isinstance(item, tuple) else (item, None)
        count += 1
        samples += batch.input_ids.shape[0]
        local = setup.slice_of(batch)
        if given is None:
            bins = position_bins(local, edge_t)
        else:  # the given bins, sliced as the labels are
            bins = setup.slice_of(replace(batch, labels=given)).labels
            bins = torch.where(local.labels == IGNORE, torch.full_like(bins, -1), bins)
        _, report = forward_loss(setup.engine, local, setup.weights, setup.mesh, bins, nb)
        sums.add(report)
        assert report.by_bin is not None and report.hits_by_bin is not None
        by_bin += report.by_bin.double()
        hits += report.hits_by_bin.double()
        target_mod = torch.where(local.labels == IGNORE, -1, local.label_modality)
        for i, m in enumerate(mods):
            sel = target_mod == i
            hit = sel & (bins >= 0)
            bin_counts[i] += torch.bincount(bins[hit], minlength=nb)[:nb].double()
            if m in tables:
                unit_counts[i] += tables[m][
                    setup.model.heads.head_index(local.labels[sel], m)
                ].sum()
    reduced = torch.cat([by_bin.flatten(), bin_counts.flatten(), unit_counts, hits.flatten()])
    seen = torch.tensor([float(samples)], dtype=torch.float64, device=device)
    if setup.mesh.distributed:
        dist.all_reduce(reduced, group=setup.mesh.world_group)
        dist.all_reduce(seen, group=setup.mesh.world_group)
        seen /= setup.mesh.sp  # every sp rank of a dp group read the same samples
    m_, b_ = len(mods), nb
    by_bin = reduced[: m_ * b_].view(m_, b_).cpu()
    bin_counts = reduced[m_ * b_ : 2 * m_ * b_].view(m_, b_).cpu()
    unit_counts = reduced[2 * m_ * b_ : 2 * m_ * b_ + m_].cpu()
    hits = reduced[2 * m_ * b_ + m_ :].view(m_, b_).cpu()
    bins_out: dict[str, list[tuple[int, int, float, int]]] = {}
    hits_out: dict[str, list[int]] = {}
    for i, m in enumerate(mods):
        kept = [j for j in range(b_) if bin_counts[i, j] > 0]
        if kept:
            hits_out[m] = [int(hits[i, j]) for j in kept]
        rows = [
            (
                edge_list[j],
                edge_list[j + 1],
                float(by_bin[i, j] / bin_counts[i, j]),
                int(bin_counts[i, j]),
            )
            for j in range(b_)
            if bin_counts[i, j] > 0
        ]
        if rows:
            bins_out[m] = rows
    return EvalResult(
        modalities=mods,
        loss=sums.weighted_mean(setup.weights.tolist()),
        nats=sums.means(),
        targets={m: c for m, c in sums.counts.items() if c},
        units={m: (units[m].name, float(unit_counts[i])) for i, m in enumerate(mods) if m in units},
        edges=edge_list,
        bins=bins_out,
        batches=count,
        samples=int(seen.item()),
        hits=hits_out,
    )
