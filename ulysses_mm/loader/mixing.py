"""Which source each position of a mixed stream draws from: a pure function of (seed, position).

Position p takes the source whose slice of [0, 1) (cut in proportion to the weights) holds
``frac(offset + p / φ)``. This golden-ratio (Kronecker) sequence is the most even way to
spread points over [0, 1): over any stretch of N positions, every source gets its weight's
share to within O(log N) positions, not the O(√N) of independent draws. A resumed run
only needs the position, and every rank computes the same assignment with no
communication.

Modalities inside one manifest. A packed sample can hold several modalities, so a manifest
with per-modality weights is split into one source per weighted modality: the samples it
dominates (most of their tokens are of it). Drawing pool k at rate r_k gives modality m
``Σ_k r_k·A[k, m]`` tokens per draw, where ``A[k, m]`` is the mean tokens of m in a sample of
pool k; :func:`modality_pools` solves ``r·A = c·w`` for the rates, so the expected token
shares are the weights exactly, however many samples straddle a modality boundary (as long
as the solution is positive). The sources are then mixed like manifests, at the rates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ulysses_mm.core.errors import ConfigError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / φ, odd


def normalised(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"mixing weights must be positive numbers, got {list(weights)}")
    return w / w.sum()


def sources_of(positions: np.ndarray, weights: Sequence[float], seed: int) -> np.ndarray:
    """The source index of each global position (int64 array like ``positions``)."""
    cum = np.cumsum(normalised(weights))
    offset = np.uint64(np.random.default_rng([seed, 0x6D6978]).integers(0, 2**63))
    with np.errstate(over="ignore"):
        u64 = positions.astype(np.uint64) * _GOLDEN + offset  # wraps mod 2^64
    u = (u64 >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    return np.minimum(np.searchsorted(cum, u, side="right"), len(cum) - 1).astype(np.int64)


def mix_error(counts: Sequence[int], weights: Sequence[float]) -> float:
    """Largest |share − weight| / weight over the sources (each share against its weight,
    relative to the weight)."""
    c = np.asarray(counts, dtype=np.float64)
    w = normalised(weights)
    if c.sum() == 0:
        return 0.0
    return float(np.max(np.abs(c / c.sum() - w) / w))


@dataclass
class ModalityPool:
    """The samples of one manifest that one modality dominates, and how often to draw them."""

    modality: str
    members: np.ndarray  # int64 sample indices, ascending
    rate: float  # share of the manifest's draws (the pools' rates sum to 1)


def modality_pools(
    sample_tokens: np.ndarray,
    names: Sequence[str],
    weights: Mapping[str, float],
    where: str,
) -> list[ModalityPool]:
    """Split a manifest's samples by dominant modality and solve the rates that give each
    weighted modality its weight's share of the tokens (see the module docstring).

    ``sample_tokens`` is ``[samples, len(names)]`` (:meth:`Manifest.sample_tokens`). The
    modalities not in ``weights`` are left out: the samples they dominate are never drawn.
    Raises :class:`ConfigError` (one line naming ``where``) for an unknown or absent
    modality, a weight that is not positive, or weights the samples cannot give."""
    for name, w in weights.items():
        if name not in names:
            raise ConfigError(
                f"{where}: unknown modality {name!r} (the token space has {', '.join(names)})"
            )
        if not (isinstance(w, (int, float)) and np.isfinite(w) and w > 0):
            raise ConfigError(f"{where}: the weight of {name} is {w}; give a positive one")
    held = [n for k, n in enumerate(names) if sample_tokens[:, k].sum() > 0]
    for name in weights:
        if name not in held:
            raise ConfigError(
                f"{where}: holds no {name} tokens (it holds {', '.join(held) or 'nothing'})"
            )
    cols = [names.index(n) for n in names if n in weights]  # token-space order
    target = normalised([weights[names[k]] for k in cols])
    dominant = np.argmax(sample_tokens, axis=1)
    pools, rows = [], []
    for k in cols:
        members = np.flatnonzero(dominant == k).astype(np.int64)
        if not len(members):
            raise ConfigError(
                f"{where}: no sample is mostly {names[k]} (its tokens are scattered through "
                "samples of other modalities), so it cannot be weighted"
            )
        pools.append(members)
        rows.append(sample_tokens[members][:, cols].mean(axis=0))
    a = np.array(rows, dtype=np.float64)  # [pool, modality]: mean tokens per draw
    try:
        rates = np.linalg.solve(a.T, target)
    except np.linalg.LinAlgError:
        rates = np.full(len(cols), -1.0)
    if not np.all(np.isfinite(rates)) or np.any(rates <= 0):
        raise ConfigError(
            f"{where}: its samples mix modalities too evenly to give "
            f"{', '.join(f'{names[k]} {x:.3g}' for k, x in zip(cols, target))} of the tokens; "
            "prepare it with the modalities in separate inputs or weight it as a whole"
        )
    rates = rates / rates.sum()
    return [ModalityPool(names[k], members, float(r)) for k, members, r in zip(cols, pools, rates)]
