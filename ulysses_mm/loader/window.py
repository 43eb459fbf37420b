"""Windows: samples of ``length`` tokens cut out of longer packed samples, so a run's
stage at a shorter length trains on shards packed once at the longest one.

Cutting. Sample ``i`` of ``S`` tokens holds ``k = S // length`` windows; window ``w`` is
tokens ``[w·length, (w+1)·length)`` (a tail shorter than ``length`` is unused). A window
is a sample boundary like any other: its segment table is the sample's clipped to it, a
piece that continues from the window before keeps its place in its document (its
position offset advanced by the tokens before the cut), so :func:`make_batch` of a window
gives exactly that slice of the whole sample's position and document ids, and attention
never crosses a document. The label of a window's last token is ignored, as at any sample
end. Window ``w`` of sample ``i`` has index ``i·k + w`` (``index // k`` is the sample, and
at ``length`` = S the index is the sample's).

Order. The windows' global order is the samples' (:class:`ShardStream` with dp 1 and
micro-batch 1 underneath, so every rank reads the same samples), each sample's windows
in turn; each global micro-batch is the next ``dp × micro_batch`` windows, of which DP
rank r takes ``[r·mb, (r+1)·mb)``. A rank reads only the samples it takes a window of. The
window sequence runs on across epochs (no tail is dropped), so it depends on nothing of
the layout.

State. ``{"windows": version, "length", "used", "stream"}``: the underlying stream's state
before the sample in use, and how many of its windows are used (0 at a sample boundary,
with ``stream`` after the last whole sample). Identical on every rank, whatever dp and
micro_batch: a resume with another layout continues the same global window sequence. A
state of another ``length`` (a run moving on to its next stage) continues at the next
whole sample, the rest of the partly used one skipped; a :class:`ShardStream` state is
a sample boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.format import (
    NUM_COLUMNS,
    SEG_LENGTH,
    SEG_POS,
    SEG_START,
    PackedSample,
)
from ulysses_mm.loader import state
from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.loader.order import Cursor, GlobalOrder, Sources, rank_positions
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.shards.manifest import Manifest

WINDOW_STATE_VERSION = 1


def cut_windows(sample: PackedSample, length: int) -> list[PackedSample]:
    """The ``S // length`` windows of ``length`` tokens of ``sample`` (module docstring)."""
    if length < 1:
        raise ValueError(f"windows need length >= 1, got {length}")
    k = len(sample.tokens) // length
    seg = np.asarray(sample.segments, dtype=np.int64).reshape(-1, NUM_COLUMNS)
    starts, ends = seg[:, SEG_START], seg[:, SEG_START] + seg[:, SEG_LENGTH]
    out = []
    for w in range(k):
        a, b = w * length, (w + 1) * length
        rows = seg[(starts < b) & (ends > a)].copy()
        lo = np.maximum(rows[:, SEG_START], a)
        rows[:, SEG_POS] += lo - rows[:, SEG_START]  # tokens of the piece before the cut
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
class _InUse:
    """The sample whose windows are being taken: the cursor before it, its windows (None:
    not read, this rank takes none of them), how many there are and how many are used."""

    before: Cursor
    windows: list[PackedSample] | None
    count: int
    used: int


class WindowStream:
    """Micro-batches of windows of ``length`` tokens for DP rank ``dp_rank`` of ``dp``: its
    ``micro_batch`` windows of each global micro-batch (module docstring). ``sources`` and
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
        self.length = length
        self.order = WindowOrder(self.base.order, length, dp * micro_batch)
        self.positions = rank_positions(dp_rank, micro_batch)
        self._current: _InUse | None = None
        self._resume_used = 0  # windows already used of the next sample (after a resume)

    # --------------------------------------------------------------- reading
    def _takes_any(self, at: int, count: int) -> bool:
        """Whether this rank takes one of ``count`` windows that start at place ``at`` of
        a global micro-batch (and run on into the ones after it)."""
        gb, mine = self.order.global_batch, self.positions
        if count >= gb:
            return mine.stop > mine.start
        return any(mine.start <= (at + j) % gb < mine.stop for j in range(count))

    def _next_sample(self, at: int) -> _InUse:
        """Move to the next sample of the order; read it if this rank takes a window of it."""
        base = self.base
        before = base.cursor
        src, idx, after = base.order.span(before, 1)
        count = self.order.windows[int(src[0])]
        used, self._resume_used = self._resume_used, 0
        if used >= count:
            raise DataError(
                f"the loader state uses {used} windows of a sample that holds {count} "
                f"windows of {self.length} tokens"
            )
        windows = None
        if self._takes_any(at, count - used):
            (sample,) = base.next_batch()
            windows = cut_windows(sample, self.length)
        else:  # nobody on this rank needs it: move the order on without reading it
            base.cursor = after
            base.tally.add(src, idx)
        return _InUse(before, windows, count, used)

    def next_batch(self) -> list[PackedSample]:
        """This DP rank's ``micro_batch`` windows of the next global micro-batch."""
        gb, mine = self.order.global_batch, self.positions
        out: list[PackedSample] = []
        at = 0
        while at < gb:
            cur = self._current
            if cur is None or cur.used == cur.count:
                cur = self._current = self._next_sample(at)
            take = min(cur.count - cur.used, gb - at)
            lo, hi = max(at, mine.start), min(at + take, mine.stop)
            if lo < hi:
                assert cur.windows is not None
                out += cur.windows[cur.used + lo - at : cur.used + hi - at]
            cur.used += take
            at += take
        return out

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
        """Identical on every rank: the sample order's state before the sample in use and
        the windows used of it (no layout in it)."""
        cur = self._current
        if cur is not None and cur.used < cur.count:
            stream, used = state.state_dict(self.base.order, cur.before), cur.used
        else:  # at a sample boundary (or resumed, nothing read yet)
            stream, used = self.base.state_dict(), self._resume_used
        return {
            "windows": WINDOW_STATE_VERSION,
            "length": self.length,
            "used": used,
            "stream": stream,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue where ``saved`` stands; at the next whole sample if it was cut into
        windows of another length. A :class:`ShardStream` state is a sample boundary."""
        self._current, self._resume_used = None, 0
        if "windows" not in saved:
            self.base.load_state_dict(saved)
            return
        if saved["windows"] != WINDOW_STATE_VERSION:
            raise DataError(
                f"window loader state version {saved['windows']} is not {WINDOW_STATE_VERSION}"
            )
        used, length = saved.get("used"), saved.get("length")
        if not isinstance(used, int) or not isinstance(length, int) or used < 0 or length < 1:
            raise DataError(f"window loader state has used={used!r}, length={length!r}")
        self.base.load_state_dict(saved["stream"])
        if not used:
            return
        if length == self.length:
            self._resume_used = used
            return
        base = self.base  # another length: skip the rest of the partly used sample
        src, idx, base.cursor = base.order.span(base.cursor, 1)
        base.tally.add(src, idx)
