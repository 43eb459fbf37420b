"""One download per node (a shared cache with a lock, LRU-bounded, atomic, sha256-checked)
and prefetch on a background thread (steps do not wait for a download that is shorter
than the steps it feeds; the bytes held ahead stay within the budget)."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import os
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import serve_dir
from train_data import prepare_dna

from ulysses_mm.core.storage import Location
from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.shards.manifest import Manifest


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Manifest:
    root = tmp_path_factory.mktemp("cache")
    return Manifest.load(str(prepare_dna(root, "ds", records=24, seq_len=256, seed=4)))


class _Handler(http.server.SimpleHTTPRequestHandler):
    sent: ClassVar[dict[str, int]] = {}
    delay_s: ClassVar[float] = 0.0
    lock = threading.Lock()

    def do_GET(self):
        time.sleep(self.delay_s)
        path = Path(self.translate_path(self.path))
        size = path.stat().st_size if path.is_file() else 0
        with self.lock:
            self.sent[self.path] = self.sent.get(self.path, 0) + size
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def server(dataset):
    try:
        with serve_dir(Path(dataset.location).parent, _Handler) as url:
            yield dataclasses.replace(dataset, where=dataset.where.at(f"{url}/manifest.json"))
    finally:
        _Handler.sent.clear()
        _Handler.delay_s = 0.0


def _run_ranks(rank, ranks: int) -> None:
    """``rank(r)`` for each of ``ranks`` ranks on threads at once (one node's ranks)."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_ranks_of_a_node_download_each_shard_once(server, tmp_path):
    _Handler.delay_s = 0.05  # so the ranks really overlap on the same shard
    ranks, results, errors = 4, {}, []

    def rank(r: int) -> None:
        try:
            cache = NodeCache(tmp_path / "node", max_bytes=1 << 30)
            st = ShardStream(
                server, 0, 1, 1, StreamOptions(seed=1), cache=cache
            )  # all ranks: same samples
            results[r] = [st.next_batch()[0].tokens.tobytes() for _ in range(server.num_samples)]
        except Exception as e:  # surfaced below
            errors.append(e)

    _run_ranks(rank, ranks)
    assert not errors, errors
    assert all(results[r] == results[0] for r in range(ranks))
    total = sum(s.bytes for s in server.shards)
    assert sum(_Handler.sent.values()) == total  # bytes sent per node = shard bytes × 1
    assert sorted(p.name for p in (tmp_path / "node").glob("*.tar")) == sorted(
        f"{s.sha256}.tar" for s in server.shards
    )


def test_on_s3_the_server_sends_each_shard_once_per_node(dataset, s3_counted, tmp_path):
    """Counted at the server (a proxy in front of moto): 4 ranks, one node cache."""
    s3fs = pytest.importorskip("s3fs")
    opts = {"endpoint_url": s3_counted.url, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir("node")
    fs.put(str(Path(dataset.location).parent), "node/ds", recursive=True)
    remote = Manifest.load(Location("s3://node/ds/manifest.json", opts))
    s3_counted.reset()
    ranks, errors = 4, []

    def rank(r: int) -> None:
        try:
            cache = NodeCache(tmp_path / "node", max_bytes=1 << 30)
            st = ShardStream(
                remote, r % 2, 2, 1, StreamOptions(seed=1, timeouts=(5.0, 30.0)), cache=cache
            )
            for _ in range(remote.num_samples // 2):
                st.next_batch()
        except Exception as e:  # surfaced below
            errors.append(e)

    _run_ranks(rank, ranks)
    assert not errors, errors
    total = sum(s.bytes for s in remote.shards)
    # every shard's bytes once, plus HTTP headers: not × 4 ranks, not even × 1.25
    print(f"S3 server sent {s3_counted.sent} B for {total} B of shards to 4 ranks")
    assert total <= s3_counted.sent < 1.25 * total


def test_the_cache_evicts_least_recently_used_and_refetches_damage(tmp_path):
    blobs = {hashlib.sha256(b).hexdigest(): b for b in (bytes([i]) * 1000 for i in range(4))}
    keys = list(blobs)
    fetched: list[str] = []

    def fetch(k: str):
        def go() -> bytes:
            fetched.append(k)
            return blobs[k]

        return go

    cache = NodeCache(tmp_path, max_bytes=2500)  # room for two
    for k in keys[:2]:
        assert cache.get(k, fetch(k)) == blobs[k]
    old = time.time() - 100
    os.utime(cache.path(keys[0]), (old, old))
    os.utime(cache.path(keys[1]), (old + 1, old + 1))
    assert cache.get(keys[0], fetch(keys[0])) == blobs[keys[0]]  # a hit: now most recent
    cache.get(keys[2], fetch(keys[2]))
    assert not cache.path(keys[1]).exists()  # the least recently used went
    assert cache.path(keys[0]).exists() and cache.path(keys[2]).exists()
    assert fetched == [keys[0], keys[1], keys[2]] and cache.evictions == 1
    cache.path(keys[0]).write_bytes(b"damaged")
    assert cache.get(keys[0], fetch(keys[0])) == blobs[keys[0]]  # checked, fetched anew
    assert fetched[-1] == keys[0]

    def broken() -> bytes:
        raise OSError("server gone")

    with pytest.raises(OSError, match="server gone"):
        cache.get(keys[3], broken)
    assert not cache.path(keys[3]).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # nothing partial


def test_prefetch_hides_downloads_behind_steps(server):
    _Handler.delay_s = 0.15  # each shard takes 0.15 s; its 4 samples train for 0.2 s
    budget = 2 * max(s.bytes for s in server.shards)
    st = ShardStream(server, 0, 1, 1, StreamOptions(shuffle=False, prefetch_bytes=budget))
    n = server.num_samples
    for _ in range(n):
        st.next_batch()
        assert st._prefetch is not None
        held = sum(server.shards[k[1]].bytes for k in st._prefetch._futures)
        assert held <= budget
        time.sleep(0.05)  # the step
    st.close()
    fetch_s = len(server.shards) * _Handler.delay_s
    # only the first shard is waited for in full
    assert st.waited_s < _Handler.delay_s + 0.25 * fetch_s, (st.waited_s, fetch_s)
    cold = ShardStream(server, 0, 1, 1, StreamOptions(shuffle=False))
    t0 = time.perf_counter()
    for _ in range(n):
        cold.next_batch()
    assert time.perf_counter() - t0 >= fetch_s  # without prefetch every download is waited
