"""The order of samples: a pure function of (seed, epoch, manifest), identical on every
rank and independent of the layout, so a run resumed with another dp continues the same
global sequence of samples, none repeated or skipped.

Order. Epoch e of a source visits each of its samples once: shards in a permutation drawn
from (seed, e), inside each shard its samples in a permutation drawn from (seed, e, shard),
and then a bounded shuffle buffer blends the seams between shards (every sample moves by
less than ``shuffle_buffer`` positions, at most half a typical shard, drawn from (seed, e)
again, so about two shards are live at a time). Position p of the epoch is thus a pure
function of (seed, e, p).

Mixing. With several sources (manifests with weights), global position p draws from the
source :func:`~ulysses_mm.loader.mixing.sources_of` assigns it (a pure function of
(seed, p) that gives every source its weight's share to within O(log p) positions); the
source's own counter says which of its samples comes next, and a source that runs out
starts its next epoch. With one source, an epoch's tail shorter than a global
micro-batch is dropped.

Modalities. A manifest given per-modality weights (``(manifest, weight, {modality:
weight})``) becomes one source per weighted modality: the samples that modality dominates,
in an order of their own drawn the same way (shards permuted, samples shuffled inside
each, the bounded buffer), drawn at the rates
:func:`~ulysses_mm.loader.mixing.modality_pools` solves so that each modality's share of the
manifest's tokens is its weight; the manifest's share of all draws stays its weight.

The state of the order is a :class:`Cursor` (epoch, position, per-source counters).

Split. Each optimizer micro-step consumes ``dp × micro_batch`` consecutive positions; DP
rank r takes positions ``[r·mb, (r+1)·mb)`` of them (:func:`rank_positions`). Every SP
rank of a DP group asks for the same rank r and so gets the same samples (it then keeps
its own slice).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.loader.mixing import ModalityPool, modality_pools, normalised, sources_of
from ulysses_mm.shards.manifest import Manifest

# one manifest, or several as [(manifest, weight), ...]; an entry
# (manifest, weight, {modality: weight}) also weights the modalities inside it
Sources = Manifest | Sequence[tuple[Manifest, float] | tuple[Manifest, float, Mapping[str, float]]]


class SourceOrder:
    """One manifest's sample order, epoch by epoch; or, with ``pool``, the order of the
    samples one modality dominates: its shards in a permutation drawn from (seed, epoch),
    its samples in each shard in a random order, and the same bounded buffer. That costs
    O(pool + shards) per epoch, whatever the manifest's size, so a small pool drawn often
    (many epochs in a look-ahead) stays cheap."""

    def __init__(
        self,
        manifest: Manifest,
        seed: list[int],
        shuffle: bool,
        shuffle_buffer: int,
        m: int = 0,
        pool: ModalityPool | None = None,
    ) -> None:
        self.manifest = manifest
        self.m = m  # which of the stream's manifests
        self.modality = pool.modality if pool is not None else ""
        self.members = pool.members if pool is not None else None
        self.seed, self.shuffle = seed, shuffle
        typical = int(np.median([s.samples for s in manifest.shards]))
        # samples move by less than half a typical shard, so about two shards are live
        self.buffer = max(0, min(shuffle_buffer, typical // 2)) if shuffle else 0
        self.n = manifest.num_samples if self.members is None else len(self.members)
        self.firsts = np.array([s.first_sample for s in manifest.shards], dtype=np.int64)
        self._member_shards = self.shards_of(self.members) if self.members is not None else None
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 4:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = self.make_order(epoch)
        return self._orders[epoch]

    def make_order(self, epoch: int) -> np.ndarray:
        """Sample indices in the order epoch ``epoch`` visits them (not cached)."""
        shards = self.manifest.shards
        if self.members is not None:
            return self._pool_order(epoch)
        if not self.shuffle:
            return np.arange(self.n, dtype=np.int64)
        rng = np.random.default_rng([*self.seed, epoch])
        parts = []
        for s in rng.permutation(len(shards)):
            inner = np.random.default_rng([*self.seed, epoch, int(s)]).permutation(
                shards[s].samples
            )
            parts.append(shards[s].first_sample + inner)
        order = np.concatenate(parts).astype(np.int64)
        return self._buffered(order, epoch)

    def _pool_order(self, epoch: int) -> np.ndarray:
        assert self.members is not None and self._member_shards is not None
        if not self.shuffle:
            return self.members
        rng = np.random.default_rng([*self.seed, epoch])
        rank = np.empty(len(self.firsts), dtype=np.int64)  # each shard's place this epoch
        rank[rng.permutation(len(self.firsts))] = np.arange(len(self.firsts))
        inside = rng.random(self.n)  # a random order inside each shard
        order = self.members[np.lexsort((inside, rank[self._member_shards]))]
        return self._buffered(order, epoch)

    def _buffered(self, order: np.ndarray, epoch: int) -> np.ndarray:
        if self.buffer <= 1:
            return order
        n = len(order)
        jitter = np.random.default_rng([*self.seed, epoch, 0x627566]).uniform(0, self.buffer, n)
        return order[np.argsort(np.arange(n) + jitter, kind="stable")]

    def take(self, counters: np.ndarray) -> np.ndarray:
        """Sample indices of this source's ``k``-th draws (epochs follow one another)."""
        out = np.empty(len(counters), dtype=np.int64)
        epochs = counters // self.n
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.order(int(e))[counters[sel] % self.n]
        return out

    def shards_of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.firsts, indices, side="right") - 1


@dataclass
class Cursor:
    """Where the global order stands: the epoch (one source), the next position, and the
    draws from each source so far. The same on every rank; no layout in it."""

    epoch: int = 0
    position: int = 0
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def rank_positions(dp_rank: int, micro_batch: int) -> slice:
    """The positions of a global micro-batch that DP rank ``dp_rank`` reads."""
    return slice(dp_rank * micro_batch, (dp_rank + 1) * micro_batch)


def check_enough_samples(manifest: Manifest, dp: int, micro_batch: int) -> None:
    """A stream of one source drops an epoch's tail shorter than a global micro-batch, so
    the manifest must hold at least one."""
    if manifest.num_samples < dp * micro_batch:
        raise DataError(
            f"{manifest.location} holds {manifest.num_samples} samples, fewer than one "
            f"global micro-batch (dp {dp} × micro_batch {micro_batch})"
        )


class GlobalOrder:
    """The sources of a stream and the global order they make (see the module docstring)."""

    def __init__(
        self,
        sources: Sources,
        global_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 0,
    ) -> None:
        entries = [(sources, 1.0)] if isinstance(sources, Manifest) else list(sources)
        if not entries:
            raise ValueError("the loader needs at least one manifest")
        self.manifests: list[Manifest] = [e[0] for e in entries]
        # per manifest: its modality weights ({} = drawn as a whole)
        self.modality_weights: list[dict[str, float]] = [
            {k: float(v) for k, v in e[2].items()} if len(e) > 2 else {}  # type: ignore[misc]
            for e in entries
        ]
        shares = normalised([e[1] for e in entries])
        # per manifest with modality weights: each sample's real tokens per modality
        self.sample_tokens = {
            j: m.sample_tokens() for j, m in enumerate(self.manifests) if self.modality_weights[j]
        }
        # the sources drawn from: a manifest, or one per weighted modality of a manifest
        plan: list[tuple[int, ModalityPool | None, float]] = []
        for j, (m, mw) in enumerate(zip(self.manifests, self.modality_weights)):
            if not mw:
                plan.append((j, None, float(shares[j])))
                continue
            pools = modality_pools(self.sample_tokens[j], m.token_space.modalities, mw, m.location)
            plan += [(j, p, float(shares[j]) * p.rate) for p in pools]
        self.weights = [w for *_, w in plan]
        self.mixed = len(plan) > 1 or plan[0][1] is not None
        self.global_batch = global_batch
        self.seed, self.shuffle, self.shuffle_buffer = seed, shuffle, shuffle_buffer
        self.sources = [
            SourceOrder(
                self.manifests[j],
                [seed] if not self.mixed else [seed, 0x737263, i],
                shuffle,
                shuffle_buffer,
                j,
                pool,
            )
            for i, (j, pool, _) in enumerate(plan)
        ]
        # per manifest with modality weights: the sources of its modalities
        self.pools_of = {
            j: [s for s, (m, *_) in enumerate(plan) if m == j] for j in self.sample_tokens
        }

    def start(self) -> Cursor:
        return Cursor(0, 0, np.zeros(len(self.sources), dtype=np.int64))

    @property
    def batches_per_epoch(self) -> int:
        return self.manifests[0].num_samples // self.global_batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Global sample indices in the order epoch ``epoch`` visits them (one source)."""
        return self.sources[0].make_order(epoch)

    def span(self, cursor: Cursor, n: int) -> tuple[np.ndarray, np.ndarray, Cursor]:
        """The next ``n`` positions from ``cursor``: (source of each, sample index of each,
        the cursor after them)."""
        epoch, position, counts = cursor.epoch, cursor.position, cursor.counts
        if self.mixed:
            src = sources_of(np.arange(position, position + n), self.weights, self.seed)
            idx = np.empty(n, dtype=np.int64)
            counts = counts.copy()
            for s, source in enumerate(self.sources):
                sel = src == s
                k = counts[s] + np.arange(int(sel.sum()), dtype=np.int64)
                idx[sel] = source.take(k)
                counts[s] += len(k)
            return src, idx, Cursor(epoch, position + n, counts)
        source, gb, parts = self.sources[0], self.global_batch, []
        left = n
        while left > 0:
            if position + gb > source.n:  # drop the tail shorter than a global batch
                epoch, position = epoch + 1, 0
            end = position + (source.n - position) // gb * gb
            take = min(left, end - position)
            parts.append(source.order(epoch)[position : position + take])
            position += take
            left -= take
        idx = np.concatenate(parts)
        return np.zeros(n, dtype=np.int64), idx, Cursor(epoch, position, counts + n)
