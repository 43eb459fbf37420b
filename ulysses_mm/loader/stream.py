"""The training loader: shards by URL through fsspec, read as a webdataset pipeline in
the order :mod:`~ulysses_mm.loader.order` gives, one DP rank's micro-batches at a time,
resumable at any sample (:mod:`~ulysses_mm.loader.state`); a step's samples spread over
the DP ranks by their attention work when asked (:mod:`~ulysses_mm.loader.balance`).

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import webdataset as wds

from ulysses_mm.config import DataConfig
from ulysses_mm.core.errors import DataError, first_line
from ulysses_mm.core.format import (
    SEGMENTS_KEY,
    TOKENS_KEY,
    PackedSample,
    ShardFormatError,
    load_npy,
)
from ulysses_mm.loader import state
from ulysses_mm.loader.balance import StepWork, Work, assign, in_order, sample_work
from ulysses_mm.loader.fetch import Prefetcher, fetch_shard
from ulysses_mm.loader.mix_tally import MixTally
from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.loader.order import GlobalOrder, Sources, check_enough_samples, rank_positions

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


@dataclass(frozen=True)
class StreamOptions:
    """How a stream orders and fetches: the order's seed and shuffle, and the fetch
    policy (:func:`~ulysses_mm.loader.fetch.fetch_shard`, the prefetch budget)."""

    seed: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 0
    retries: int = 5
    backoff_s: float = 0.5
    timeouts: tuple[float, float] | None = None  # (connect, read) seconds of a remote read
    prefetch_bytes: int = 0

    @classmethod
    def from_config(cls, d: DataConfig) -> StreamOptions:
        """The training stream's options from ``data.*``."""
        return cls(
            seed=d.seed,
            shuffle=d.shuffle,
            shuffle_buffer=d.shuffle_buffer if d.shuffle else 0,
            retries=d.retries,
            backoff_s=d.retry_backoff_s,
            timeouts=d.timeouts,
            prefetch_bytes=d.prefetch_bytes,
        )

    def in_order(self) -> StreamOptions:
        """The same fetch policy over the samples in their stored order (evaluation)."""
        return replace(self, seed=0, shuffle=False, shuffle_buffer=0)


class ShardStream:
    """Micro-batches of packed samples for DP rank ``dp_rank`` of ``dp``: its
    ``micro_batch`` positions of each global micro-batch of :class:`GlobalOrder`.

    ``sources`` is one manifest, or several as ``[(manifest, weight), ...]``; an entry
    ``(manifest, weight, {modality: weight})`` also weights the modalities inside it."""

    def __init__(
        self,
        sources: Sources,
        dp_rank: int,
        dp: int,
        micro_batch: int,
        options: StreamOptions = StreamOptions(),
        cache: NodeCache | None = None,
        work: Work | None = None,
    ) -> None:
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} is outside dp={dp}")
        o = options
        self.order = GlobalOrder(sources, dp * micro_batch, o.seed, o.shuffle, o.shuffle_buffer)
        if not self.order.mixed:
            check_enough_samples(self.order.manifests[0], dp, micro_batch)
        self.dp_rank, self.dp, self.micro_batch = dp_rank, dp, micro_batch
        self.positions = rank_positions(dp_rank, micro_batch)
        self.work = work
        self._pairs = [np.asarray(m.sample_pairs or [], np.float64) for m in self.order.manifests]
        if work is not None:
            lacking = [m.location for m in self.order.manifests if m.sample_pairs is None]
            if lacking:
                raise DataError(
                    f"{lacking[0]} records no sample_pairs (written by an older prepare): "
                    "prepare it again, or set data.balance=false"
                )
        # the last step's work per (micro-step, DP rank): (in order, as read)
        self.last_work: tuple[StepWork, StepWork] | None = None
        self.options, self.cache = options, cache
        self.cursor = self.order.start()
        self.tally = MixTally(self.order)
        # the live shards: about two per source (the buffer blends seams) and the one before
        self._keep = 3 * len(self.order.sources)
        self._prefetch = (
            Prefetcher(self._load, o.prefetch_bytes, keep=self._keep)
            if o.prefetch_bytes > 0
            else None
        )
        self._recent: dict[tuple[int, int], list[PackedSample]] = {}

    # --------------------------------------------------------------- reading
    def _load(self, key: tuple[int, int]) -> list[PackedSample]:
        """The samples of shard ``key`` = (manifest number, shard number)."""
        m, shard = key
        manifest = self.order.manifests[m]
        entry = manifest.shards[shard]
        location = manifest.shard_location(shard)
        o = self.options

        def fetch() -> bytes:
            return fetch_shard(manifest, shard, o.retries, o.backoff_s, o.timeouts)

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
        source = self.order.sources[s]
        manifest = source.manifest
        shard = int(source.shards_of(np.array([index]))[0])
        at = index - manifest.shards[shard].first_sample
        sample = self._shard((source.m, shard))[at]
        key = manifest.sample_key(shard, index)  # within its partition, when there are several
        if sample.index != key:
            raise ShardFormatError(
                f"{manifest.shard_location(shard)}: sample {at} has key {sample.index}, "
                f"expected {key}"
            )
        return sample if key == index else replace(sample, index=index)

    def upcoming_shards(self, positions: int = 0) -> list[tuple[tuple[int, int], int]]:
        """The shards the next ``positions`` positions read, in first-use order, with sizes
        (by default up to ``_LOOKAHEAD`` positions, and no more than one pass over the data)."""
        sources = self.order.sources
        if positions <= 0:
            total = sum(source.n for source in sources)
            positions = max(self.order.global_batch, min(_LOOKAHEAD, total))
        src, idx, _ = self.order.span(self.cursor, positions)
        first: dict[tuple[int, int], int] = {}  # (manifest, shard): first position
        for s, source in enumerate(sources):
            sel = np.flatnonzero(src == s)
            shards = source.shards_of(idx[sel])
            _, at = np.unique(shards, return_index=True)
            for i in at:  # pools of one manifest share its shards
                key = (source.m, int(shards[i]))
                first[key] = min(first.get(key, int(sel[i])), int(sel[i]))
        return [
            (key, self.order.manifests[key[0]].shards[key[1]].bytes)
            for key in sorted(first, key=first.__getitem__)
        ]

    def next_batch(self) -> list[PackedSample]:
        """This DP rank's ``micro_batch`` samples of the next global micro-batch."""
        if self._prefetch is not None and not self._prefetch.busy:  # first batch, or resumed
            self._prefetch.schedule(self.upcoming_shards())
        src, idx, after = self.order.span(self.cursor, self.order.global_batch)
        mine = self.positions
        samples = [self._sample(int(s), int(i)) for s, i in zip(src[mine], idx[mine])]
        self.cursor = after
        self.tally.add(src, idx)
        if self._prefetch is not None:
            self._prefetch.schedule(self.upcoming_shards())
        return samples

    def next_step(self, count: int) -> list[list[PackedSample]]:
        """This DP rank's ``count`` micro-batches of the next optimizer step: with
        ``work``, the step's samples spread by their work (:func:`~ulysses_mm.loader.
        balance.assign`; the same samples, the same cursor after), else in order."""
        if self.work is None:
            return [self.next_batch() for _ in range(count)]
        if self._prefetch is not None and not self._prefetch.busy:
            self._prefetch.schedule(self.upcoming_shards())
        src, idx, after = self.order.span(self.cursor, count * self.order.global_batch)
        tokens = np.array([self.order.manifests[self.order.sources[s].m].seq_len for s in src])
        pairs = np.array([self._pairs[self.order.sources[s].m][i] for s, i in zip(src, idx)])
        work = sample_work(pairs, tokens, self.work.linear)
        dp, mb = self.dp, self.micro_batch
        plan = assign(work, dp, mb, count) if self.work.balance else in_order(count, dp, mb)
        self.last_work = (StepWork.of(work, in_order(count, dp, mb)), StepWork.of(work, plan))
        out = [
            [self._sample(int(src[p]), int(idx[p])) for p in plan[k, self.dp_rank]]
            for k in range(count)
        ]
        self.cursor = after
        self.tally.add(src, idx)
        if self._prefetch is not None:
            self._prefetch.schedule(self.upcoming_shards())
        return out

    def __iter__(self) -> Iterator[list[PackedSample]]:
        while True:
            yield self.next_batch()

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()

    def set_interrupt(self, interrupt: Callable[[], bool] | None) -> None:
        """Give up a wait for a shard when ``interrupt()`` is true (``FetchInterrupted``)."""
        if self._prefetch is not None:
            self._prefetch.interrupt = interrupt

    @property
    def waited_s(self) -> float:
        """Seconds ``next_batch`` spent waiting for shards (0 without prefetch)."""
        return self._prefetch.waited_s if self._prefetch is not None else 0.0

    def mix_shares(self) -> dict[str, float]:
        """What the run drew so far, against the weights (:meth:`MixTally.mix_shares`)."""
        return self.tally.mix_shares(self.cursor.counts)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Identical on every rank: where the global order stands (no layout in it)."""
        return state.state_dict(self.order, self.cursor)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.cursor = state.restore(self.order, saved)
        self.tally.replay(self.cursor)
