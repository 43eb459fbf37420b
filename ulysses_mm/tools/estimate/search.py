"""The longest sequence that fits a GPU (and its node's host memory): the estimate grows
with the length, so doubling then bisection over multiples of sp ×
:data:`MAX_GRANULARITY` tokens finds it; :func:`best_head_groups` tries every head-group
count the layout allows."""

from __future__ import annotations

from dataclasses import replace

from ulysses_mm.config import RunConfig
from ulysses_mm.core.errors import UserError
from ulysses_mm.core.layout import valid_head_groups
from ulysses_mm.tools.estimate.result import Estimate, EstimateOptions, estimate
from ulysses_mm.tools.estimate.shape import gpus_and_sp

# A sequence length searched by --max is a multiple of sp × this.
MAX_GRANULARITY = 1024


def max_seq_len(
    cfg: RunConfig, opts: EstimateOptions, limit: int = 1 << 34
) -> tuple[int, Estimate]:
    """The longest sequence (a multiple of sp × MAX_GRANULARITY tokens) whose estimate
    fits ``opts.gpu_mem_gib`` (and ``opts.host_mem_gib`` per node when given), and its
    estimate; (0, the estimate at the smallest length) when none does. The estimate grows
    with the length, so doubling then bisection finds it."""
    first = estimate(cfg, _granule(cfg, opts), opts)
    g = first.step.sp * MAX_GRANULARITY
    if not _fits(first):
        return 0, first
    lo, best = 1, first
    hi = 2
    while hi * g <= limit:
        est = estimate(cfg, hi * g, opts)
        if not _fits(est):
            break
        lo, best, hi = hi, est, hi * 2
    else:
        return lo * g, best
    while hi - lo > 1:
        mid = (lo + hi) // 2
        est = estimate(cfg, mid * g, opts)
        if _fits(est):
            lo, best = mid, est
        else:
            hi = mid
    return lo * g, best


def _fits(est: Estimate) -> bool:
    return bool(est.fits) and est.host_fits is not False


def head_group_choices(cfg: RunConfig, gpus: int | None, sp: int | None) -> list[int]:
    """The head-group counts the layout allows (each rank's query heads split evenly)."""
    m = cfg.model
    ulysses = max(1, gpus_and_sp(cfg, gpus, sp)[1] // cfg.parallel.ring)
    return valid_head_groups(m.num_attention_heads, m.num_key_value_heads, ulysses)


def best_head_groups(
    cfg: RunConfig, opts: EstimateOptions, limit: int = 1 << 34
) -> tuple[int, Estimate, dict[int, int]]:
    """:func:`max_seq_len` for every head-group count the layout allows (``opts.head_groups``
    is not used): (the longest sequence, its estimate, {C: longest at C}); among equals the
    fewest groups (fewer, larger exchanges and kernel calls)."""
    found: dict[int, tuple[int, Estimate]] = {}
    for c in head_group_choices(cfg, opts.gpus, opts.sp):
        found[c] = max_seq_len(cfg, replace(opts, head_groups=c), limit)
    best = max(found, key=lambda c: (found[c][0], -c))
    n, est = found[best]
    return n, est, {c: v[0] for c, v in found.items()}


def _granule(cfg: RunConfig, opts: EstimateOptions) -> int:
    return gpus_and_sp(cfg, opts.gpus, opts.sp)[1] * MAX_GRANULARITY


def head_groups_arg(value: str | None) -> int | str | None:
    """``--head-groups``: a count, ``auto``, or None (the config's)."""
    if value is None or value == "auto":
        return value
    try:
        groups = int(value)
    except ValueError:
        groups = 0
    if groups < 1:
        raise UserError(f"--head-groups must be a positive integer or auto, got {value!r}")
    return groups
