"""``estimate --best``: every layout a world of GPUs allows for one config and length (sp =
U × R dividing the world, U the heads and 2·sp the sequence when R > 1, the head groups U
allows: :mod:`ulysses_mm.core.layout`'s checks), each estimated for memory and time; the
layouts that fit ranked by tokens per second."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ulysses_mm.config import RunConfig
from ulysses_mm.core.layout import LayoutError, valid_head_groups, valid_sp_sizes
from ulysses_mm.tools.estimate.devices import DeviceKind, Efficiency
from ulysses_mm.tools.estimate.documents import DocLengths
from ulysses_mm.tools.estimate.result import Estimate, EstimateOptions, estimate
from ulysses_mm.tools.estimate.step_time import FlopRates, StepTime, step_time


@dataclass(frozen=True)
class Candidate:
    """One layout, its memory estimate and its step time."""

    est: Estimate
    time: StepTime

    @property
    def fits(self) -> bool:
        return self.est.fits is not False and self.est.host_fits is not False

    def describe(self) -> str:
        return self.est.step.layout.describe()


def layouts(cfg: RunConfig, gpus: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(sp, ring, head groups) of every layout a world of ``gpus`` allows at ``seq_len``."""
    m = cfg.model
    out = []
    for ring in (r for r in range(1, gpus + 1) if gpus % r == 0):
        for sp in valid_sp_sizes(m.num_attention_heads, seq_len, gpus, limit=gpus, ring=ring):
            ulysses = sp // ring
            for c in valid_head_groups(m.num_attention_heads, m.num_key_value_heads, ulysses):
                out.append((sp, ring, c))
    return out


def rank_layouts(
    cfg: RunConfig,
    seq_len: int,
    opts: EstimateOptions,
    rates: FlopRates,
    docs: DocLengths,
    dev: DeviceKind,
    eff: Efficiency,
) -> list[Candidate]:
    """Every layout of ``opts.gpus`` GPUs estimated at ``seq_len``, fastest (most tokens
    per second) first; the ones that do not fit ``opts.gpu_mem_gib`` (or the host) last."""
    assert opts.gpus is not None
    found = []
    for sp, ring, c in layouts(cfg, opts.gpus, seq_len):
        at = replace(cfg, parallel=replace(cfg.parallel, ring=ring, sp=sp, dp=0, head_groups=c))
        try:
            est = estimate(at, seq_len, replace(opts, sp=sp, head_groups=c))
        except LayoutError:
            continue
        found.append(Candidate(est, step_time(at, est, rates, docs, dev, eff)))
    found.sort(key=lambda k: (not k.fits, -k.time.tokens_per_s, k.est.total))
    return found
