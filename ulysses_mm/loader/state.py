"""The loader's checkpoint state: where the global order stands, and what it is an order of.

The state is a :class:`~ulysses_mm.loader.order.Cursor` with what made the order: the
seed, the shuffle settings, the mixing weights and, per source, its shards' sha256 (and
the modality it draws). A resume restores the cursor only onto the same order, so a run
resumed onto other data or other settings fails in one line instead of reading another
sequence of samples. No layout is in it: a run resumed with another dp reads on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.loader.order import Cursor, GlobalOrder

STATE_VERSION = 2


def _identity(order: GlobalOrder) -> list[list[str]]:
    """Per source: its manifest's shard hashes (and the modality it draws, if one)."""
    return [
        [s.sha256 for s in src.manifest.shards]
        + ([f"modality={src.modality}"] if src.modality else [])
        for src in order.sources
    ]


def state_dict(order: GlobalOrder, cursor: Cursor) -> dict[str, Any]:
    """Identical on every rank: where the global order stands (no layout in it)."""
    return {
        "version": STATE_VERSION,
        "epoch": cursor.epoch,
        "position": cursor.position,
        "counts": [int(c) for c in cursor.counts],
        "seed": order.seed,
        "shuffle": order.shuffle,
        "shuffle_buffer": order.shuffle_buffer,
        "weights": order.weights,
        "sources": _identity(order),
    }


def restore(order: GlobalOrder, state: dict[str, Any]) -> Cursor:
    """The cursor ``state`` holds, once it is known to be a state of ``order``."""
    version = state.get("version")
    if version == 1:  # one source, no shuffle buffer, no counters
        state = {
            **state,
            "sources": [state["shards"]],
            "shuffle_buffer": 0,
            "weights": [1.0],
            "counts": [0],
        }
    elif version != STATE_VERSION:
        raise DataError(f"loader state version {version} is not {STATE_VERSION}")
    if state["sources"] != _identity(order):
        where = ", ".join(m.location for m in order.manifests)
        raise DataError(f"the checkpoint's loader state belongs to other shards than {where}")
    for key in ("seed", "shuffle", "shuffle_buffer"):
        if state[key] != getattr(order, key):
            raise DataError(
                f"resuming with {key}={getattr(order, key)} but the checkpoint was made with "
                f"{state[key]}"
            )
    if not np.allclose(state["weights"], order.weights):
        raise DataError(
            f"resuming with mixing weights {order.weights} but the checkpoint was made "
            f"with {state['weights']}"
        )
    counts = np.asarray(state["counts"], dtype=np.int64)
    epoch, position = state["epoch"], state["position"]
    if not all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0
        for v in (epoch, position)
    ):
        raise DataError(
            f"the loader state's epoch and position must be integers >= 0, got {epoch!r}, "
            f"{position!r}"
        )
    if counts.shape != (len(order.weights),) or (counts < 0).any():
        raise DataError(
            f"the loader state's counts must be {len(order.weights)} integers >= 0, got "
            f"{state['counts']!r}"
        )
    return Cursor(int(epoch), int(position), counts)
