"""Windows: samples of ``length`` tokens cut out of longer packed samples, so a run's
stage at a shorter length trains on shards packed once at the longest one.

Cutting. Sample ``i`` of ``S`` tokens holds ``k = S // length`` windows; window ``w`` is
tokens ``[w·length, (w+1)·length)`` (a tail shorter than ``length`` is unused). A window
is a sample boundary like any other: its segment table is the sample's clipped to it, so
:func:`make_batch` of a window gives exactly that slice of the whole sample's document
ids, and attention never crosses a document. Positions (``data.window_positions``): the
piece at a window's start restarts at position 0 ("restart", the default: a stage at
``length`` trains positions below ``length``, as the model is later used at that length
from a document's start), or keeps its place in its document, its position offset
advanced by the tokens before the cut ("continue": the window's positions are that slice
of the whole sample's). For RoPE kinds with fixed frequencies the two give the same
attention (it depends on position differences only); dynamic NTK, which grows θ with the
longest position seen, does not. The label of a window's last token is ignored, as at any sample
end. Window ``w`` of sample ``i`` has index ``i·k + w`` (``index // k`` is the sample, and
at ``length`` = S the index is the sample's).

Order. Each DP rank takes whole samples and cuts them into windows itself, so every
sample is read (fetched and decoded) by one DP rank only and the bytes a node fetches are
the shards' bytes, as for unwindowed runs. A global micro-batch has ``dp × micro_batch``
lanes (lane j is DP rank ``j // micro_batch``'s place ``j % micro_batch``); each lane
holds one sample and gives one window of it per micro-batch, in turn. A lane whose sample
is used up takes the next sample of the samples' global order (:class:`ShardStream` with
dp 1 and micro-batch 1 underneath), lanes refilled in lane order: a pure function of the
order and the samples' window counts (their sources' ``seq_len // length``), which every
rank tracks for every lane without reading, so the sequence depends on the seed and the
layout only. The order runs on across epochs (no tail is dropped). A rank's prefetcher is
given the shards of its own lanes' next samples only.

State. ``{"windows": 2, "length", "stream", "lanes", "slots", "pending"}``: the order's
state after the last sample handed to a lane; the lane count; each lane's partly used
sample as ``[lane, source, sample, used]``; and samples handed back by an elastic resume
that the next refills take first. Identical on every rank. A resume with the same
``dp × micro_batch`` puts every sample back in its lane (exact); with another, the partly
used samples (the pending ones first, then the lanes' in lane order) go to the lanes that
refill first, their used windows skipped: no window is repeated or lost. A state of
another ``length`` (a run moving on to its next stage) continues at the next whole
sample, the partly used ones dropped; a version-1 state (one sample in use for every rank)
continues that sample's windows; a :class:`ShardStream` state is a sample boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.format import (
    NUM_COLUMNS,
    SEG_LENGTH,
    SEG_POS,
    SEG_START,
    PackedSample,
)
from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.loader.order import GlobalOrder, Sources, rank_positions
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.shards.manifest import Manifest

WINDOW_STATE_VERSION = 2


WindowPositions = Literal["restart", "continue"]


def cut_windows(
    sample: PackedSample, length: int, positions: WindowPositions = "restart"
) -> list[PackedSample]:
    """The ``S // length`` windows of ``length`` tokens of ``sample`` (module docstring).
    ``positions``: when windows are shorter than the sample, the piece at a window's start
    is positioned from 0 ("restart": no position reaches ``length``) or where it stands in
    its document ("continue"). Windows as long as the sample are the sample, as packed."""
    if length < 1:
        raise ValueError(f"windows need length >= 1, got {length}")
    if positions not in ("restart", "continue"):
        raise ValueError(f"window positions {positions!r} is not 'restart' or 'continue'")
    k = len(sample.tokens) // length
    seg = np.asarray(sample.segments, dtype=np.int64).reshape(-1, NUM_COLUMNS)
    starts, ends = seg[:, SEG_START], seg[:, SEG_START] + seg[:, SEG_LENGTH]
    out = []
    for w in range(k):
        a, b = w * length, (w + 1) * length
        rows = seg[(starts < b) & (ends > a)].copy()
        lo = np.maximum(rows[:, SEG_START], a)
        if positions == "continue" or length == len(sample.tokens):
            rows[:, SEG_POS] += lo - rows[:, SEG_START]  # tokens of the piece before the cut
        else:
            rows[lo == a, SEG_POS] = 0  # the piece at the window's start begins its positions
        rows[:, SEG_LENGTH] = np.minimum(rows[:, SEG_START] + rows[:, SEG_LENGTH], b) - lo
        rows[:, SEG_START] = lo - a
        out.append(PackedSample(sample.index * k + w, sample.tokens[a:b], rows))
    return out


def check_window_length(manifest: Manifest, length: int) -> None:
    """Windows of ``length`` tokens fit the manifest's samples (one line if not)."""
    if length > manifest.seq_len:
        raise DataError(
            f"{manifest.location}: windows of {length} tokens are longer than its samples "
            f"of {manifest.seq_len} tokens"
        )


def check_enough_windows(manifest: Manifest, length: int, dp: int, micro_batch: int) -> None:
    """One global micro-batch of windows of ``length`` tokens out of the manifest."""
    windows = manifest.num_samples * (manifest.seq_len // length)
    if windows < dp * micro_batch:
        what = "samples" if length == manifest.seq_len else f"windows of {length} tokens"
        raise DataError(
            f"{manifest.location} holds {windows} {what}, fewer than one global micro-batch "
            f"(dp {dp} × micro_batch {micro_batch})"
        )


class WindowOrder:
    """The windows' global order over the samples' :class:`GlobalOrder` (``base``)."""

    def __init__(self, base: GlobalOrder, length: int, global_batch: int) -> None:
        self.base, self.length, self.global_batch = base, length, global_batch
        self.manifests = base.manifests
        # windows in a sample of each source
        self.windows = [src.manifest.seq_len // length for src in base.sources]

    @property
    def batches_per_epoch(self) -> int:
        """Global micro-batches of windows in one pass over the (first) manifest."""
        m = self.manifests[0]
        return m.num_samples * (m.seq_len // self.length) // self.global_batch


@dataclass
class _Lane:
    """A sample in a lane: its source and index, its window count, the windows used; its
    windows once this rank has read it (only this rank's lanes are read)."""

    src: int
    idx: int
    count: int
    used: int
    windows: list[PackedSample] | None = None


class WindowStream:
    """Micro-batches of windows of ``length`` tokens for DP rank ``dp_rank`` of ``dp``: one
    window from each of its ``micro_batch`` lanes (module docstring). ``sources`` and
    ``options`` (default ``StreamOptions()``) as for :class:`ShardStream`."""

    def __init__(
        self,
        sources: Sources,
        dp_rank: int,
        dp: int,
        micro_batch: int,
        length: int,
        options: StreamOptions | None = None,
        cache: NodeCache | None = None,
        positions: WindowPositions = "restart",
    ) -> None:
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} is outside dp={dp}")
        if length < 1:
            raise ValueError(f"windows need length >= 1, got {length}")
        self.base = ShardStream(sources, 0, 1, 1, options or StreamOptions(), cache)
        try:
            for m in self.base.order.manifests:
                check_window_length(m, length)
            if not self.base.order.mixed:
                check_enough_windows(self.base.order.manifests[0], length, dp, micro_batch)
        except BaseException:
            self.base.close()
            raise
        self.length, self.positions = length, positions
        self.order = WindowOrder(self.base.order, length, dp * micro_batch)
        self.mine = rank_positions(dp_rank, micro_batch)
        self.lanes: list[_Lane | None] = [None] * (dp * micro_batch)
        self.pending: list[tuple[int, int, int]] = []  # (source, sample, used) to hand first

    # --------------------------------------------------------------- reading
    def _take(self) -> tuple[int, int, int]:
        """The next sample a lane refills with: a pending one, else the order's next."""
        if self.pending:
            return self.pending.pop(0)
        src, idx, self.base.cursor = self.base.order.span(self.base.cursor, 1)
        self.base.tally.add(src, idx)
        return int(src[0]), int(idx[0]), 0

    def next_batch(self) -> list[PackedSample]:
        """This DP rank's ``micro_batch`` windows of the next global micro-batch."""
        out: list[PackedSample] = []
        for j, lane in enumerate(self.lanes):
            if lane is None or lane.used >= lane.count:
                src, idx, used = self._take()
                lane = self.lanes[j] = _Lane(src, idx, self.order.windows[src], used)
                if used >= lane.count:
                    raise DataError(
                        f"the loader state uses {used} windows of a sample that holds "
                        f"{lane.count} windows of {self.length} tokens"
                    )
            if self.mine.start <= j < self.mine.stop:
                if lane.windows is None:
                    self._prefetch()
                    sample = self.base._sample(lane.src, lane.idx)
                    lane.windows = cut_windows(sample, self.length, self.positions)
                out.append(lane.windows[lane.used])
            lane.used += 1
        return out

    def _upcoming(self, wanted: int) -> list[tuple[int, int]]:
        """(source, sample) of this rank's next ``wanted`` samples to read, in the order it
        will read them: its lanes' unread samples, then the refills of a dry run of the
        lanes (counts only) over the order ahead."""
        mine = range(self.mine.start, self.mine.stop)
        out = [(ln.src, ln.idx) for j in mine if (ln := self.lanes[j]) and ln.windows is None]
        left = [ln.count - ln.used if ln else 0 for ln in self.lanes]
        queue = [(s, i) for s, i, _ in self.pending]
        queue_left = [self.order.windows[s] - u for s, _, u in self.pending]
        src, idx, _ = self.base.order.span(self.base.cursor, max(1, wanted * len(self.lanes)))
        ahead = iter(zip(src.tolist(), idx.tolist(), strict=True))
        while len(out) < wanted:
            for j in range(len(self.lanes)):
                if left[j] <= 0:
                    if queue:
                        s, i = queue.pop(0)
                        left[j] = queue_left.pop(0)
                    else:
                        nxt = next(ahead, None)
                        if nxt is None:
                            return out
                        (s, i), left[j] = nxt, self.order.windows[nxt[0]]
                    if j in mine:
                        out.append((s, i))
                left[j] -= 1
        return out

    def _prefetch(self) -> None:
        """Give the prefetcher the shards of this rank's next samples (its own only)."""
        fetcher = self.base._prefetch
        if fetcher is None:
            return
        sources = self.base.order.sources
        keys: dict[tuple[int, int], int] = {}
        for s, i in self._upcoming(4 * max(1, self.mine.stop - self.mine.start)):
            source = sources[s]
            shard = int(source.shards_of(np.array([i]))[0])
            keys.setdefault((source.m, shard), source.manifest.shards[shard].bytes)
        fetcher.schedule(list(keys.items()))

    def __iter__(self) -> Iterator[list[PackedSample]]:
        while True:
            yield self.next_batch()

    def close(self) -> None:
        self.base.close()

    def set_interrupt(self, interrupt: Callable[[], bool] | None) -> None:
        self.base.set_interrupt(interrupt)

    @property
    def waited_s(self) -> float:
        """Seconds spent waiting for shards (0 without prefetch)."""
        return self.base.waited_s

    def mix_shares(self) -> dict[str, float]:
        """What the run drew so far, by samples (:meth:`ShardStream.mix_shares`)."""
        return self.base.mix_shares()

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Identical on every rank: the order after the last sample handed out, and every
        partly used sample (module docstring)."""
        slots = [
            [j, ln.src, ln.idx, ln.used]
            for j, ln in enumerate(self.lanes)
            if ln is not None and ln.used < ln.count
        ]
        return {
            "windows": WINDOW_STATE_VERSION,
            "length": self.length,
            "stream": self.base.state_dict(),
            "lanes": len(self.lanes),
            "slots": slots,
            "pending": [list(p) for p in self.pending],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue where ``saved`` stands (module docstring)."""
        self.lanes = [None] * len(self.lanes)
        self.pending = []
        if "windows" not in saved:
            self.base.load_state_dict(saved)
            return
        version, length = saved["windows"], saved.get("length")
        if version not in (1, WINDOW_STATE_VERSION):
            raise DataError(f"window loader state version {version} is not {WINDOW_STATE_VERSION}")
        if not isinstance(length, int) or length < 1:
            raise DataError(f"window loader state has length={length!r}")
        self.base.load_state_dict(saved["stream"])
        if version == 1:
            self._load_v1(saved.get("used"), length)
            return
        slots, pending, lanes = saved.get("slots"), saved.get("pending"), saved.get("lanes")
        if not (
            isinstance(lanes, int)
            and isinstance(slots, list)
            and isinstance(pending, list)
            and all(_ints(x, 4) and 0 <= x[0] < lanes for x in slots)
            and all(_ints(x, 3) for x in pending)
        ):
            raise DataError(f"window loader state has malformed lanes: {saved!r}"[:300])
        if length != self.length:
            return  # the next stage: the partly used samples are dropped
        self.pending = [(s, i, u) for s, i, u in pending]
        if lanes == len(self.lanes):
            for j, s, i, u in slots:
                self.lanes[j] = _Lane(s, i, self.order.windows[s], u)
        else:  # elastic: the lanes' samples after the pending ones, in lane order
            self.pending += [(s, i, u) for _, s, i, u in sorted(slots)]

    def _load_v1(self, used: Any, length: int) -> None:
        """A version-1 state: ``stream`` stands before the sample in use, of which ``used``
        windows are taken; its windows continue first (at the same length)."""
        if not isinstance(used, int) or used < 0:
            raise DataError(f"window loader state has used={used!r}")
        if not used:
            return
        src, idx, self.base.cursor = self.base.order.span(self.base.cursor, 1)
        self.base.tally.add(src, idx)
        if length == self.length:
            self.pending = [(int(src[0]), int(idx[0]), used)]


def _ints(x: Any, n: int) -> bool:
    return isinstance(x, list) and len(x) == n and all(isinstance(v, int) and v >= 0 for v in x)


class InOrderWindows:
    """Every window once, for evaluation: DP rank ``dp_rank`` of ``dp`` reads its own
    samples of ``manifest`` in their stored order (positions ``dp_rank``, ``dp_rank + dp``,
    …: :class:`ShardStream` with micro-batch 1), cuts each into its windows of ``length``
    tokens and yields them ``micro_batch`` at a time. Every rank yields
    :attr:`batches_per_epoch` batches: the samples of an epoch's tail shorter than dp and
    the windows of a rank's tail shorter than a micro-batch are left out."""

    def __init__(
        self,
        manifest: Manifest,
        dp_rank: int,
        dp: int,
        micro_batch: int,
        length: int,
        options: StreamOptions,
        positions: WindowPositions = "restart",
    ) -> None:
        check_window_length(manifest, length)
        check_enough_windows(manifest, length, dp, micro_batch)
        self.base = ShardStream(manifest, dp_rank, dp, 1, options.in_order())
        self.length, self.micro_batch, self.positions = length, micro_batch, positions
        k = manifest.seq_len // length
        self.batches_per_epoch = manifest.num_samples // dp * k // micro_batch
        self._ready: list[PackedSample] = []

    def next_batch(self) -> list[PackedSample]:
        while len(self._ready) < self.micro_batch:
            (sample,) = self.base.next_batch()
            self._ready += cut_windows(sample, self.length, self.positions)
        out, self._ready = self._ready[: self.micro_batch], self._ready[self.micro_batch :]
        return out

    def close(self) -> None:
        self.base.close()
