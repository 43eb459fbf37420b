"""Reading shards off the training step: bounded retries with timeouts, and a background
thread that fetches the next shards while the current ones train.

Fault policy (each kind of failure has one meaning):

* a transport fault (refused or reset connection, a connect or read timeout, an HTTP
  error status, a short read) is retried ``retries`` times with exponential backoff, then
  raised as one :class:`~ulysses_mm.core.errors.StorageError` line naming the URL. With
  ``timeouts=(c, r)`` a server that stalls costs at most ``c + r`` seconds per attempt,
  so a read gives up after at most
  ``retries·(c + r) + backoff·(2^(retries−1) − 1)`` seconds;
* bytes whose size or sha256 differ from the manifest are a data error
  (:class:`~ulysses_mm.shards.manifest.ShardIntegrityError`), raised at once: fetching the
  same object again returns the same wrong bytes.

The :class:`Prefetcher` holds one worker thread. The stream tells it, after every batch,
which shards come next (in order, with their sizes); it keeps as many of them fetched or
in flight as fit in ``max_bytes`` (at least the next one), and drops what the order no
longer needs. An error raised on the worker reaches the training thread unchanged, when
it asks for that shard.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
    location = manifest.shard_location(shard)
    retries = max(1, retries)
    delay = backoff_s
    for attempt in range(1, retries + 1):
        try:
            data = storage.read_bytes(location, manifest.storage_options, timeouts)
        # transport faults arrive as many types (OSError, aiohttp, botocore, asyncio
        # timeouts): all are retried, boundedly
        except Exception as e:
            if attempt == retries:
                raise StorageError(
                    f"could not read shard {location} after {retries} attempts: {first_line(e)}"
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


class Prefetcher:
    """Loads keys on one background thread, ahead of need, within a byte budget."""

    def __init__(self, load: Callable[[Any], Any], max_bytes: int, keep: int = 3) -> None:
        self._load = load
        self.max_bytes = max_bytes
        self._keep = keep  # recently used results kept for samples still to come
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shard-prefetch")
        self._futures: OrderedDict[Hashable, Future] = OrderedDict()
        self._recent: OrderedDict[Hashable, Future] = OrderedDict()
        self.waited_s = 0.0  # time the caller spent blocked on a result
        self.loaded_s = 0.0  # time the worker spent loading

    def _timed(self, key: Hashable) -> Any:
        t0 = time.perf_counter()
        try:
            return self._load(key)
        finally:
            self.loaded_s += time.perf_counter() - t0

    @property
    def busy(self) -> bool:
        """Whether anything is fetched or in flight (False before the first schedule)."""
        return bool(self._futures or self._recent)

    def get(self, key: Hashable) -> Any:
        fut = self._recent.pop(key, None) or self._futures.pop(key, None)
        if fut is None:
            fut = self._pool.submit(self._timed, key)
        t0 = time.perf_counter()
        try:
            result = fut.result()
        finally:
            self.waited_s += time.perf_counter() - t0
        self._recent[key] = fut
        while len(self._recent) > self._keep:
            self._recent.popitem(last=False)
        return result

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
                self._futures[key] = self._pool.submit(self._timed, key)

    def close(self) -> None:
        for fut in self._futures.values():
            fut.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
