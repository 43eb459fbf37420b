"""The longest sequence that fits a GPU: the estimate grows with the length, so doubling
then bisection over multiples of sp × :data:`MAX_GRANULARITY` tokens finds it."""

from __future__ import annotations

from typing import Any

from ulysses_mm.config import RunConfig
from ulysses_mm.tools.estimate.result import Estimate, estimate

# A sequence length searched by --max is a multiple of sp × this.
MAX_GRANULARITY = 1024


def max_seq_len(
    cfg: RunConfig, gpu_mem_gib: float, limit: int = 1 << 34, **kw: Any
) -> tuple[int, Estimate]:
    """The longest sequence (a multiple of sp × MAX_GRANULARITY tokens) whose estimate
    fits ``gpu_mem_gib``, and its estimate; (0, the estimate at the smallest length) when
    none does. ``kw`` as for :func:`estimate`. The estimate grows with the length, so
    doubling then bisection finds it."""
    first = estimate(cfg, _granule(cfg, kw), gpu_mem_gib=gpu_mem_gib, **kw)
    g = first.step.sp * MAX_GRANULARITY
    if not first.fits:
        return 0, first
    lo, best = 1, first
    hi = 2
    while hi * g <= limit:
        est = estimate(cfg, hi * g, gpu_mem_gib=gpu_mem_gib, **kw)
        if not est.fits:
            break
        lo, best, hi = hi, est, hi * 2
    else:
        return lo * g, best
    while hi - lo > 1:
        mid = (lo + hi) // 2
        est = estimate(cfg, mid * g, gpu_mem_gib=gpu_mem_gib, **kw)
        if est.fits:
            lo, best = mid, est
        else:
            hi = mid
    return lo * g, best


def _granule(cfg: RunConfig, kw: dict[str, Any]) -> int:
    sp = kw.get("sp")
    if sp is None:
        sp = kw.get("gpus") or cfg.parallel.sp
    return int(sp) * MAX_GRANULARITY
