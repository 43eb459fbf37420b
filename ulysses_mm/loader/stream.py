"""The training loader: shards by URL through fsspec, read as a webdataset pipeline, in an
order that is a function of (seed, epoch, manifest), resumable at any sample.

Order. Epoch e of a source visits each of its samples once: shards in a permutation drawn
from (seed, e), inside each shard its samples in a permutation drawn from (seed, e, shard),
and then a bounded shuffle buffer blends the seams between shards (every sample moves by
less than ``shuffle_buffer`` positions, at most half a typical shard, drawn from (seed, e)
again, so about two shards are live at a time). Position p of the epoch is thus a pure function of (seed, e, p).

Mixing. With several sources (manifests with weights), global position p draws from the
source :func:`~ulysses_mm.loader.mixing.sources_of` assigns it (a pure function of
(seed, p) that gives every source its weight's share to within O(log p) positions); the
source's own counter says which of its samples comes next, and a source that runs out
starts its next epoch. With one source, an epoch's tail shorter than a global
micro-batch is dropped, as before.

Modalities. A manifest given per-modality weights (``(manifest, weight, {modality:
weight})``) becomes one source per weighted modality: the samples that modality dominates,
in an order of their own drawn the same way (shards permuted, samples shuffled inside
each, the bounded buffer), drawn at the rates
:func:`~ulysses_mm.loader.mixing.modality_pools` solves so that each modality's share of the
manifest's tokens is its weight; the manifest's share of all draws stays its weight.

The loader's whole state is therefore (epoch, position, per-source counters): identical on
every rank and independent of the layout, so a run resumed with another dp continues the
same global sequence of samples, none repeated or skipped.

Split. Each optimizer micro-step consumes ``dp × micro_batch`` consecutive positions; DP
rank r takes positions ``[r·mb, (r+1)·mb)`` of them. Every SP rank of a DP group asks
for the same rank r and so gets the same samples (it then keeps its own slice).

Reading. A shard is fetched whole (:mod:`ulysses_mm.loader.fetch`: timeouts, bounded
retries, sha256 checked, a data error never retried), through the node's shared cache
when there is one (:mod:`ulysses_mm.loader.node_cache`), on a background thread ahead of need
when ``prefetch_bytes`` > 0, and expanded by webdataset's tar iterators
(``tar_file_expander`` + ``group_by_keys``); only ``.npy`` members are decoded, with
``allow_pickle=False`` — a member of any other kind is refused, so no path ever unpickles.
A tar that does not parse is one error line naming the shard.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import webdataset as wds

from ulysses_mm.core.errors import first_line
from ulysses_mm.core.format import (
    SEGMENTS_KEY,
    TOKENS_KEY,
    PackedSample,
    ShardFormatError,
    load_npy,
)
from ulysses_mm.loader.fetch import Prefetcher, fetch_shard
from ulysses_mm.loader.mixing import ModalityPool, mix_error, modality_pools, normalised, sources_of
from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.shards.manifest import Manifest

STATE_VERSION = 2
_LOOKAHEAD = 1 << 14  # positions the prefetcher looks ahead for shards to fetch


def _decode_npy_only(sample: dict[str, Any], where: str) -> PackedSample:
    key = sample["__key__"]
    extra = sorted(
        k for k in sample if not k.startswith("__") and k not in (TOKENS_KEY, SEGMENTS_KEY)
    )
    if extra:
        raise ShardFormatError(
            f"{where}: sample {key} has members {extra}; only .npy arrays are read"
        )
    if TOKENS_KEY not in sample or SEGMENTS_KEY not in sample:
        raise ShardFormatError(f"{where}: sample {key} lacks {TOKENS_KEY} or {SEGMENTS_KEY}")
    tokens = load_npy(sample[TOKENS_KEY], f"{where}: {key}.{TOKENS_KEY}")
    segments = load_npy(sample[SEGMENTS_KEY], f"{where}: {key}.{SEGMENTS_KEY}")
    try:
        index = int(key)
    except ValueError:
        raise ShardFormatError(f"{where}: sample key {key!r} is not a sample number") from None
    return PackedSample(index, tokens, segments)


def shard_samples(data: bytes, where: str) -> list[PackedSample]:
    """Decode one shard's bytes with a webdataset pipeline (tar members -> samples).

    A tar that does not parse (truncated, corrupt headers) raises one
    :class:`ShardFormatError` line naming ``where``, even when its sha256 matched: the
    manifest then describes bytes that were broken when the shard was written."""
    pipeline = wds.DataPipeline(
        lambda: iter([{"url": where, "stream": io.BytesIO(data)}]),
        wds.tariterators.tar_file_expander,
        wds.tariterators.group_by_keys,
        wds.map(lambda s: _decode_npy_only(s, where)),
    )
    try:
        return list(pipeline)
    except ShardFormatError:
        raise
    # tarfile, webdataset's grouping and numpy each report a damaged archive their way
    except (tarfile.TarError, EOFError, OSError, ValueError, KeyError, UnicodeError) as e:
        raise ShardFormatError(
            f"shard {where} is not a readable tar of samples ({first_line(e)}); "
            "it was damaged when written: prepare it again"
        ) from None


class _Source:
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
            self._orders[epoch] = self._make_order(epoch)
        return self._orders[epoch]

    def _make_order(self, epoch: int) -> np.ndarray:
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


class ShardStream:
    """Micro-batches of packed samples for one DP rank (see the module docstring).

    ``manifest`` is one manifest, or several as ``[(manifest, weight), ...]``; an entry
    ``(manifest, weight, {modality: weight})`` also weights the modalities inside it."""

    def __init__(
        self,
        manifest: Manifest
        | Sequence[tuple[Manifest, float] | tuple[Manifest, float, Mapping[str, float]]],
        dp_rank: int,
        dp: int,
        micro_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        retries: int = 5,
        backoff_s: float = 0.5,
        shuffle_buffer: int = 0,
        timeouts: tuple[float, float] | None = None,
        cache: NodeCache | None = None,
        prefetch_bytes: int = 0,
    ) -> None:
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} is outside dp={dp}")
        entries = [(manifest, 1.0)] if isinstance(manifest, Manifest) else list(manifest)
        if not entries:
            raise ValueError("the loader needs at least one manifest")
        self.manifests: list[Manifest] = [e[0] for e in entries]
        self.manifest = self.manifests[0]
        # per manifest: its modality weights ({} = drawn as a whole)
        self.modality_weights: list[dict[str, float]] = [
            {k: float(v) for k, v in e[2].items()} if len(e) > 2 else {}  # type: ignore[misc]
            for e in entries
        ]
        shares = normalised([e[1] for e in entries])
        # per manifest with modality weights: each sample's real tokens per modality
        self._tables = {
            j: m.sample_tokens() for j, m in enumerate(self.manifests) if self.modality_weights[j]
        }
        # the sources drawn from: a manifest, or one per weighted modality of a manifest
        plan: list[tuple[int, ModalityPool | None, float]] = []
        for j, (m, mw) in enumerate(zip(self.manifests, self.modality_weights)):
            if not mw:
                plan.append((j, None, float(shares[j])))
                continue
            pools = modality_pools(self._tables[j], m.token_space.modalities, mw, m.location)
            plan += [(j, p, float(shares[j]) * p.rate) for p in pools]
        self.weights = [w for *_, w in plan]
        self.mixed = len(plan) > 1 or plan[0][1] is not None
        self.dp_rank, self.dp, self.micro_batch = dp_rank, dp, micro_batch
        self.seed, self.shuffle, self.shuffle_buffer = seed, shuffle, shuffle_buffer
        self.retries, self.backoff_s, self.timeouts = max(1, retries), backoff_s, timeouts
        self.cache = cache
        self.global_batch = dp * micro_batch
        if not self.mixed and self.manifest.num_samples < self.global_batch:
            raise ValueError(
                f"{self.manifest.location} holds {self.manifest.num_samples} samples, fewer "
                f"than one global micro-batch (dp {dp} × micro_batch {micro_batch})"
            )
        self.sources = [
            _Source(
                self.manifests[j],
                [seed] if not self.mixed else [seed, 0x737263, i],
                shuffle,
                shuffle_buffer,
                j,
                pool,
            )
            for i, (j, pool, _) in enumerate(plan)
        ]
        self.epoch = 0
        self.position = 0
        self.counts = np.zeros(len(plan), dtype=np.int64)  # draws per source so far
        # per manifest with modality weights: its sources, and the tokens drawn from it so far
        # (every rank's, kept on each)
        self._pools_of = {j: [s for s, (m, *_) in enumerate(plan) if m == j] for j in self._tables}
        self._drawn = {j: np.zeros(t.shape[1], dtype=np.int64) for j, t in self._tables.items()}
        # the live shards: about two per source (the buffer blends seams) and the one before
        self._keep = 3 * len(plan)
        self._prefetch = (
            Prefetcher(self._load, prefetch_bytes, keep=self._keep) if prefetch_bytes > 0 else None
        )
        self._recent: dict[tuple[int, int], list[PackedSample]] = {}

    def _manifest_labels(self) -> list[str]:
        labels = [
            m.location.rstrip("/").rsplit("/", 2)[-2] if "/" in m.location else m.name
            for m in self.manifests
        ]
        if len(set(labels)) < len(labels):
            labels = [f"{i}.{label}" for i, label in enumerate(labels)]
        return labels

    @property
    def source_labels(self) -> list[str]:
        """A short distinct name per source: the directory of its manifest (else numbered),
        and ``/modality`` for a modality's share of a manifest."""
        labels = self._manifest_labels()
        return [
            labels[src.m] + (f"/{src.modality}" if src.modality else "") for src in self.sources
        ]

    def _tokens_of(self, src: np.ndarray, idx: np.ndarray) -> dict[int, np.ndarray]:
        """Per weighted manifest: real tokens per modality of the drawn samples given."""
        return {
            j: table[idx[np.isin(src, self._pools_of[j])]].sum(axis=0)
            for j, table in self._tables.items()
        }

    def drawn_tokens(self) -> dict[int, np.ndarray]:
        """For each manifest with modality weights (by its number): the real tokens of each
        modality (token-space order) in the samples drawn from it so far, on every rank
        together (from the manifest's record, not the shards)."""
        return {j: t.copy() for j, t in self._drawn.items()}

    def mix_shares(self) -> dict[str, float]:
        """What the run drew so far, against the weights: each manifest's share of the
        samples (``label``; with several manifests) and each weighted modality's share of
        its manifest's tokens (``label/modality``)."""
        labels = self._manifest_labels()
        out: dict[str, float] = {}
        if len(self.manifests) > 1:
            per = np.zeros(len(self.manifests))
            for source, c in zip(self.sources, self.counts):
                per[source.m] += c
            for j, share in enumerate(per / max(1.0, per.sum())):
                out[labels[j]] = float(share)
        for j, tokens in self._drawn.items():
            names = self.manifests[j].token_space.modalities
            listed = [k for k, n in enumerate(names) if n in self.modality_weights[j]]
            total = max(1, int(tokens[listed].sum()))
            for k in listed:
                out[f"{labels[j]}/{names[k]}"] = float(tokens[k] / total)
        return out

    def modality_mix_error(self) -> float:
        """The largest |token share − weight| / weight over the weighted modalities of every
        manifest, over the run so far (0 when no manifest weights its modalities)."""
        err = 0.0
        for j, tokens in self.drawn_tokens().items():
            names = self.manifests[j].token_space.modalities
            mw = self.modality_weights[j]
            listed = [k for k, n in enumerate(names) if n in mw]
            err = max(err, mix_error(tokens[listed].tolist(), [mw[names[k]] for k in listed]))
        return err

    # ----------------------------------------------------------------- order
    @property
    def batches_per_epoch(self) -> int:
        return self.manifest.num_samples // self.global_batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Global sample indices in the order epoch ``epoch`` visits them (one source)."""
        return self.sources[0]._make_order(epoch)

    def _span(
        self, epoch: int, position: int, counts: np.ndarray, n: int
    ) -> tuple[np.ndarray, np.ndarray, int, int, np.ndarray]:
        """The next ``n`` positions from a state: (sources, sample indices, new state)."""
        if self.mixed:
            src = sources_of(np.arange(position, position + n), self.weights, self.seed)
            idx = np.empty(n, dtype=np.int64)
            counts = counts.copy()
            for s, source in enumerate(self.sources):
                sel = src == s
                k = counts[s] + np.arange(int(sel.sum()), dtype=np.int64)
                idx[sel] = source.take(k)
                counts[s] += len(k)
            return src, idx, epoch, position + n, counts
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
        counts = counts + n
        return np.zeros(n, dtype=np.int64), idx, epoch, position, counts

    # --------------------------------------------------------------- reading
    def _load(self, key: tuple[int, int]) -> list[PackedSample]:
        """The samples of shard ``key`` = (manifest number, shard number)."""
        m, shard = key
        manifest = self.manifests[m]
        entry = manifest.shards[shard]
        location = manifest.shard_location(shard)

        def fetch() -> bytes:
            return fetch_shard(manifest, shard, self.retries, self.backoff_s, self.timeouts)

        data = self.cache.get(entry.sha256, fetch) if self.cache is not None else fetch()
        samples = shard_samples(data, location)
        if len(samples) != entry.samples:
            raise ShardFormatError(
                f"{location}: holds {len(samples)} samples, the manifest says {entry.samples}"
            )
        return samples

    def _shard(self, key: tuple[int, int]) -> list[PackedSample]:
        if self._prefetch is not None:
            return self._prefetch.get(key)
        if key not in self._recent:
            if len(self._recent) >= self._keep:
                self._recent.pop(next(iter(self._recent)))
            self._recent[key] = self._load(key)
        return self._recent[key]

    def _sample(self, s: int, index: int) -> PackedSample:
        source = self.sources[s]
        manifest = source.manifest
        shard = int(source.shards_of(np.array([index]))[0])
        sample = self._shard((source.m, shard))[index - manifest.shards[shard].first_sample]
        if sample.index != index:
            raise ShardFormatError(
                f"{manifest.shard_location(shard)}: sample {index - manifest.shards[shard].first_sample} "
                f"has key {sample.index}, expected {index}"
            )
        return sample

    def upcoming_shards(self, positions: int = 0) -> list[tuple[tuple[int, int], int]]:
        """The shards the next ``positions`` positions read, in first-use order, with sizes
        (by default up to ``_LOOKAHEAD`` positions, and no more than one pass over the data)."""
        if positions <= 0:
            total = sum(source.n for source in self.sources)
            positions = max(self.global_batch, min(_LOOKAHEAD, total))
        src, idx, *_ = self._span(self.epoch, self.position, self.counts, positions)
        first: dict[tuple[int, int], int] = {}  # (manifest, shard): first position
        for s, source in enumerate(self.sources):
            sel = np.flatnonzero(src == s)
            shards = source.shards_of(idx[sel])
            _, at = np.unique(shards, return_index=True)
            for i in at:  # pools of one manifest share its shards
                key = (source.m, int(shards[i]))
                first[key] = min(first.get(key, int(sel[i])), int(sel[i]))
        return [
            (key, self.manifests[key[0]].shards[key[1]].bytes)
            for key in sorted(first, key=first.__getitem__)
        ]

    def next_batch(self) -> list[PackedSample]:
        """This DP rank's ``micro_batch`` samples of the next global micro-batch."""
        if self._prefetch is not None and not self._prefetch.busy:  # first batch, or resumed
            self._prefetch.schedule(self.upcoming_shards())
        src, idx, epoch, position, counts = self._span(
            self.epoch, self.position, self.counts, self.global_batch
        )
        if not self.mixed:  # the epoch a batch belongs to (the tail rolls over first)
            self.epoch = epoch
        lo = self.dp_rank * self.micro_batch
        samples = [
            self._sample(int(s), int(i))
            for s, i in zip(src[lo : lo + self.micro_batch], idx[lo : lo + self.micro_batch])
        ]
        self.epoch, self.position, self.counts = epoch, position, counts
        for j, tokens in self._tokens_of(src, idx).items():
            self._drawn[j] += tokens
        if self._prefetch is not None:
            self._prefetch.schedule(self.upcoming_shards())
        return samples

    def __iter__(self) -> Iterator[list[PackedSample]]:
        while True:
            yield self.next_batch()

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()

    @property
    def waited_s(self) -> float:
        """Seconds ``next_batch`` spent waiting for shards (0 without prefetch)."""
        return self._prefetch.waited_s if self._prefetch is not None else 0.0

    # ----------------------------------------------------------------- state
    def _identity(self) -> list[list[str]]:
        """Per source: its manifest's shard hashes (and the modality it draws, if one)."""
        return [
            [s.sha256 for s in src.manifest.shards]
            + ([f"modality={src.modality}"] if src.modality else [])
            for src in self.sources
        ]

    def state_dict(self) -> dict[str, Any]:
        """Identical on every rank: where the global order stands (no layout in it)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "counts": [int(c) for c in self.counts],
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "weights": self.weights,
            "sources": self._identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
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
            raise ValueError(f"loader state version {version} is not {STATE_VERSION}")
        if state["sources"] != self._identity():
            where = ", ".join(m.location for m in self.manifests)
            raise ValueError(f"the checkpoint's loader state belongs to other shards than {where}")
        for key in ("seed", "shuffle", "shuffle_buffer"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"resuming with {key}={getattr(self, key)} but the checkpoint was made with {state[key]}"
                )
        if not np.allclose(state["weights"], self.weights):
            raise ValueError(
                f"resuming with mixing weights {self.weights} but the checkpoint was made "
                f"with {state['weights']}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.counts = np.asarray(state["counts"], dtype=np.int64)
        if self._tables:  # the tokens drawn so far: replay the order up to the position
            src, idx, *_ = self._span(0, 0, np.zeros_like(self.counts), self.position)
            self._drawn = self._tokens_of(src, idx)
