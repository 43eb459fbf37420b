"""One download per node: a shard cache in a node-local directory that every rank shares.

Files are named by the shard's sha256 (``<sha256>.tar``), so a name is its own identity
and two datasets holding the same shard share one copy. A rank that wants a missing shard
takes an exclusive ``flock`` on ``.<sha256>.lock``; the first one downloads (through the
caller's ``fetch``, which checks the bytes against the manifest) and publishes the file
atomically (temporary sibling, fsync, rename); the others block on the lock and then read
the finished file. So the server sends each shard once per node, not once per rank.

A file read back is checked against its sha256 again (a cache on a shared disk can be
damaged); a bad one is removed and fetched anew. After each download the least recently
used files (by mtime, touched on every hit) are removed until the directory holds at most
``max_bytes`` — never the file just written. Lock files stay (they are empty); removing
one while a rank waits on it would let two ranks download at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ulysses_mm.core.storage import Location, atomic_write_local


class NodeCache:
    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        Location(str(self.directory)).remove_stale_temps()
        self.max_bytes = max_bytes
        self.hits = self.misses = self.evictions = 0
        self.fetched_bytes = 0  # what this process downloaded into the cache
        self._stats_lock = threading.Lock()

    def path(self, sha256: str) -> Path:
        return self.directory / f"{sha256}.tar"

    def _read(self, sha256: str) -> bytes | None:
        path = self.path(sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != sha256:
            path.unlink(missing_ok=True)  # damaged in the cache: fetch it again
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # least recently used = oldest mtime
        return data

    def get(self, sha256: str, fetch: Callable[[], bytes]) -> bytes:
        """The bytes whose sha256 is ``sha256``: from the cache, or fetched once per node
        by whichever rank takes the lock first."""
        data = self._read(sha256)
        if data is not None:
            self._count("hits")
            return data
        with open(self.directory / f".{sha256}.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = self._read(sha256)  # another rank may have fetched it while we waited
                if data is not None:
                    self._count("hits")
                    return data
                data = fetch()
                atomic_write_local(self.path(sha256), data)
                self._count("misses")
                with self._stats_lock:
                    self.fetched_bytes += len(data)
                self._evict(keep=self.path(sha256))
                return data
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _count(self, what: str) -> None:
        with self._stats_lock:
            setattr(self, what, getattr(self, what) + 1)

    def _evict(self, keep: Path) -> None:
        with open(self.directory / ".evict.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = []
            for p in self.directory.glob("*.tar"):
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime_ns, st.st_size, p))
            total = sum(size for _, size, _ in entries)
            for _, size, p in sorted(entries, key=lambda e: e[0]):
                if total <= self.max_bytes:
                    break
                if p == keep:
                    continue
                p.unlink(missing_ok=True)
                total -= size
                self._count("evictions")
            fcntl.flock(lock, fcntl.LOCK_UN)
