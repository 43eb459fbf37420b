"""Windows read only their rank's share: bytes a node fetches, counted at an HTTP server.

Samples of 256 tokens, one to a shard, so a shard is one sample and the bytes a node
fetches say exactly which samples its ranks read. dp = 2, micro-batch 2, windows of 64:
each DP rank reads whole samples and cuts them itself, so the two ranks' shards are
disjoint and each node (its own server and cache) fetches its rank's samples' shards and
nothing else, as an unwindowed run's ranks do; two ranks sharing a node's cache fetch every
shard once. A rank's prefetcher asks only for shards of its own next samples."""

from __future__ import annotations

import dataclasses
import http.server
import io
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import REPO, serve_dir
from train_data import learnable_fasta

from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.loader.window import WindowStream
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare

S, LENGTH, DP, MB = 256, 64, 2, 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Manifest:
    root = tmp_path_factory.mktemp("bytes")
    learnable_fasta(root / "src.fa", 24, 900, 7)
    cfg = load_pipeline_config(
        REPO / "pipelines" / "dna.yaml",
        [
            f"sources=[{root / 'src.fa'}]",
            f"output={root / 'ds'}",
            f"pack.seq_len={S}",
            "shards.max_samples=1",
            "progress=false",
        ],
    )
    prepare(cfg, out=io.StringIO())
    m = Manifest.load(str(root / "ds" / "manifest.json"))
    assert all(s.samples == 1 for s in m.shards) and m.num_samples >= 16
    return m


def _counting_handler() -> type[http.server.SimpleHTTPRequestHandler]:
    """A handler class of its own (one per node's server) that counts the body bytes it
    sends per path."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        sent: ClassVar[dict[str, int]] = {}
        lock = threading.Lock()

        def do_GET(self):
            path = Path(self.translate_path(self.path))
            size = path.stat().st_size if path.is_file() else 0
            with self.lock:
                self.sent[self.path.lstrip("/")] = self.sent.get(self.path.lstrip("/"), 0) + size
            super().do_GET()

        def log_message(self, *args):
            pass

    Handler.sent = {}
    return Handler


def _over_http(dataset: Manifest, url: str) -> Manifest:
    return dataclasses.replace(dataset, where=dataset.where.at(f"{url}/manifest.json"))


def _shard_bytes(dataset: Manifest, samples: set[int]) -> dict[str, int]:
    return {s.url: s.bytes for s in dataset.shards if s.first_sample in samples}


def _stream(windowed: bool, m: Manifest, rank: int, cache=None, prefetch: int = 0):
    opts = StreamOptions(seed=3, prefetch_bytes=prefetch)
    if windowed:
        return WindowStream(m, rank, DP, MB, LENGTH, opts, cache)
    return ShardStream(m, rank, DP, MB, opts, cache)


def _sample_of(windowed: bool, index: int) -> int:
    return index // (S // LENGTH) if windowed else index


@pytest.mark.parametrize("windowed", [True, False], ids=["windows", "whole samples"])
def test_each_node_fetches_its_own_ranks_samples_once(dataset, windowed, tmp_path):
    """One rank per node, each node its own server and cache: a node's bytes are exactly
    its rank's samples' shards, and the nodes' shards are disjoint."""
    steps = 4 * (S // LENGTH) if windowed else 4  # 16 samples either way
    handlers = [_counting_handler() for _ in range(DP)]
    read: list[set[int]] = []
    for rank, handler in enumerate(handlers):
        with serve_dir(Path(dataset.location).parent, handler) as url:
            cache = NodeCache(tmp_path / f"node{rank}", max_bytes=1 << 30)
            st = _stream(windowed, _over_http(dataset, url), rank, cache)
            got = {_sample_of(windowed, w.index) for _ in range(steps) for w in st.next_batch()}
            st.close()
        read.append(got)
    assert not read[0] & read[1] and len(read[0] | read[1]) == 16
    for rank, handler in enumerate(handlers):
        assert handler.sent == _shard_bytes(dataset, read[rank])  # each shard once, no other
    total = sum(sum(h.sent.values()) for h in handlers)
    assert total == sum(_shard_bytes(dataset, read[0] | read[1]).values())


@pytest.mark.parametrize("windowed", [True, False], ids=["windows", "whole samples"])
def test_two_ranks_of_one_node_fetch_each_shard_once(dataset, windowed, tmp_path):
    handler = _counting_handler()
    steps = 4 * (S // LENGTH) if windowed else 4
    read: set[int] = set()
    with serve_dir(Path(dataset.location).parent, handler) as url:
        cache = NodeCache(tmp_path / "node", max_bytes=1 << 30)
        ranks = [_stream(windowed, _over_http(dataset, url), r, cache) for r in range(DP)]
        for _ in range(steps):
            for st in ranks:
                read |= {_sample_of(windowed, w.index) for w in st.next_batch()}
        for st in ranks:
            st.close()
    assert len(read) == 16
    assert handler.sent == _shard_bytes(dataset, read)


def test_a_ranks_prefetcher_asks_only_for_its_own_samples(dataset, tmp_path):
    """With a prefetch budget, rank 0 of 2 fetches ahead, but only shards it reads itself
    (checked against what it goes on to read), never rank 1's."""
    handler = _counting_handler()
    k = S // LENGTH
    with serve_dir(Path(dataset.location).parent, handler) as url:
        st = _stream(True, _over_http(dataset, url), 0, prefetch=1 << 30)
        first = {w.index // k for _ in range(2 * k) for w in st.next_batch()}
        for _ in range(100):  # the prefetcher's thread: give it a moment to fetch ahead
            if len(handler.sent) > len(first):
                break
            time.sleep(0.05)
        fetched = set(handler.sent)
        later = {w.index // k for _ in range(6 * k) for w in st.next_batch()}
        st.close()
    other = _stream(True, dataset, 1)  # rank 1, read locally: which samples are its
    theirs = {w.index // k for _ in range(8 * k) for w in other.next_batch()}
    other.close()
    assert len(first) == 2 * MB and len(fetched) > len(first)  # it fetched ahead
    assert fetched <= set(_shard_bytes(dataset, first | later))  # of its own samples
    assert not fetched & set(_shard_bytes(dataset, theirs))
