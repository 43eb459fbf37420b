"""Reading shards off the training step: bounded retries with timeouts, and a background
thread that fetches the next shards while the current ones train.

Fault policy (each kind of failure has one meaning):

* a transport fault (refused or reset connection, a connect or read timeout, a 5xx, 408
  or 429 status, a short read) is retried ``retries`` times with exponential backoff, then
  raised as one :class:`~ulysses_mm.core.errors.StorageError` line naming the URL. With
  ``timeouts=(c, r)`` a server that stalls costs at most ``c + r`` seconds per attempt,
  so a read gives up after at most
  ``retries·(c + r) + backoff·(2^(retries−1) − 1)`` seconds;
* any other 4xx status (404, 403: a missing object, a refused permission) is raised at
  once, as one line naming the URL and the status: asking again gets the same answer;
* bytes whose size or sha256 differ from the manifest are a data error
  (:class:`~ulysses_mm.shards.manifest.ShardIntegrityError`), raised at once: fetching the
  same object again returns the same wrong bytes.

The :class:`Prefetcher` holds one worker thread. The stream tells it, after every batch,
which shards come next (in order, with their sizes); it keeps as many of them fetched or
in flight as fit in ``max_bytes`` (at least the next one), and drops what the order no
longer needs. An error raised on the worker reaches the training thread unchanged, when
it asks for that shard. The worker is a daemon thread that nothing ever joins: a process
whose run failed exits at once, even while the worker still waits on a stalled server
(a ``ThreadPoolExecutor`` worker would be joined at interpreter exit, after every shard
still queued had been tried in turn).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ulysses_mm.core import storage
from ulysses_mm.core.errors import StorageError, first_line
from ulysses_mm.shards.manifest import Manifest, ShardIntegrityError, verify_shard_bytes


def fetch_shard(
    manifest: Manifest,
    shard: int,
    retries: int = 5,
    backoff_s: float = 0.5,
    timeouts: tuple[float, float] | None = None,
) -> bytes:
    """A shard's bytes, checked against the manifest (see the module docstring)."""
    entry = manifest.shards[shard]
    where = manifest.shard_where(shard).with_timeouts(timeouts)
    location = where.url
    retries = max(1, retries)
    delay = backoff_s
    for attempt in range(1, retries + 1):
        try:
            data = where.read_bytes()
        # transport faults arrive as many types (OSError, aiohttp, botocore, asyncio
        # timeouts); storage turns them into ReadError, which says whether to retry
        except Exception as e:
            if isinstance(e, storage.ReadError) and not e.retryable:
                raise StorageError(
                    f"could not read shard {location}: {e} (not retried: the server refuses it)"
                ) from e
            if attempt == retries:
                raise StorageError(
                    f"could not read shard {location} after {retries} attempts: {_why(e)}"
                ) from e
            time.sleep(delay)
            delay *= 2
            continue
        try:
            verify_shard_bytes(entry, data, location)
        except ShardIntegrityError as e:
            raise ShardIntegrityError(
                f"{e} — a data error, not retried: prepare the shard again or fix the manifest"
            ) from None
        return data
    raise AssertionError("unreachable")


def _why(e: BaseException) -> str:
    return str(e) if isinstance(e, storage.ReadError) else first_line(e)


class FetchInterrupted(Exception):
    """A wait for a shard was given up because :attr:`Prefetcher.interrupt` said so (a
    signal asked the run to stop)."""


class Prefetcher:
    """Loads keys on one background thread, ahead of need, within a byte budget. While the
    caller waits for a key, ``interrupt`` (when set) is asked every fraction of a second
    whether to give up (:class:`FetchInterrupted`)."""

    def __init__(self, load: Callable[[Any], Any], max_bytes: int, keep: int = 3) -> None:
        self._load = load
        self.max_bytes = max_bytes
        self._keep = keep  # recently used results kept for samples still to come
        self._queue: queue.SimpleQueue[tuple[Hashable, Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="shard-prefetch", daemon=True)
        self._thread.start()
        self._futures: OrderedDict[Hashable, Future] = OrderedDict()
        self._recent: OrderedDict[Hashable, Future] = OrderedDict()
        self._closed = False
        self.waited_s = 0.0  # time the caller spent blocked on a result
        self.loaded_s = 0.0  # time the worker spent loading
        self.interrupt: Callable[[], bool] | None = None

    def _work(self) -> None:
        while (item := self._queue.get()) is not None and not self._closed:
            key, fut = item
            if not fut.set_running_or_notify_cancel():
                continue  # dropped from the schedule before its turn
            t0 = time.perf_counter()
            try:
                fut.set_result(self._load(key))
            except BaseException as e:  # reaches the caller of get(key)
                fut.set_exception(e)
            finally:
                self.loaded_s += time.perf_counter() - t0
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[1].cancel()

    def _submit(self, key: Hashable) -> Future:
        if self._closed:
            raise RuntimeError("the prefetcher is closed")
        fut: Future = Future()
        self._queue.put((key, fut))
        return fut

    @property
    def busy(self) -> bool:
        """Whether anything is fetched or in flight (False before the first schedule)."""
        return bool(self._futures or self._recent)

    def get(self, key: Hashable) -> Any:
        fut = self._recent.pop(key, None) or self._futures.pop(key, None)
        if fut is None:
            fut = self._submit(key)
        t0 = time.perf_counter()
        try:
            result = self._wait(fut, key)
        finally:
            self.waited_s += time.perf_counter() - t0
        self._recent[key] = fut
        while len(self._recent) > self._keep:
            self._recent.popitem(last=False)
        return result

    def _wait(self, fut: Future, key: Hashable) -> Any:
        if self.interrupt is None:
            return fut.result()
        while True:
            try:
                return fut.result(timeout=0.1)
            except FutureTimeout:
                if self.interrupt():
                    self._futures[key] = fut  # still wanted when the run goes on
                    raise FetchInterrupted(f"gave up waiting for {key}") from None

    def schedule(self, upcoming: Sequence[tuple[Hashable, int]]) -> None:
        """``upcoming``: the next keys in the order they will be asked for, with sizes."""
        wanted: list[Hashable] = []
        total = 0
        for key, size in upcoming:
            if key in self._recent:
                continue
            if wanted and total + size > self.max_bytes:
                break
            wanted.append(key)
            total += size
        for key in list(self._futures):
            if key not in wanted:
                fut = self._futures.pop(key)
                fut.cancel()
        for key in wanted:
            if key not in self._futures:
                self._futures[key] = self._submit(key)

    def close(self) -> None:
        """Cancel what is queued and let the worker go; never waits for it (a load in
        flight ends by its own timeouts, and the daemon worker never delays exit)."""
        self._closed = True
        for fut in self._futures.values():
            fut.cancel()
        self._futures.clear()
        self._recent.clear()
        self._queue.put(None)
