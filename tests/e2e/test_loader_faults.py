"""Loader faults: a stalled server ends in one line naming the URL within the stated bound
(HTTP and S3), a sha256 mismatch is one data-error line and is not retried, a tar that
does not parse although its sha256 matches is one line naming the shard."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import socket
import time
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import REPO, serve_dir
from train_data import prepare_dna

from ulysses_mm.core.format import ShardFormatError
from ulysses_mm.core.storage import Location
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.shards.manifest import Manifest, ManifestError, ShardEntry, ShardIntegrityError


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Manifest:
    root = tmp_path_factory.mktemp("faults")
    return Manifest.load(str(prepare_dna(root, "ds", records=12, seq_len=256, seed=2)))


@pytest.fixture
def stalled_server():
    """A server that accepts connections (the kernel's backlog) and never answers: what a
    paused (SIGSTOP-ed) object store looks like from the client."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _moved(m: Manifest, base: str, **opts) -> Manifest:
    """The same manifest as if loaded from ``base``: shards resolve there."""
    return dataclasses.replace(m, where=Location(f"{base}/manifest.json", opts))


CONNECT_S, READ_S, RETRIES, BACKOFF_S = 0.3, 0.5, 2, 0.05
# the bound fetch.py states: retries·(connect + read) + backoff·(2^(retries−1) − 1)
BOUND_S = RETRIES * (CONNECT_S + READ_S) + BACKOFF_S * (2 ** (RETRIES - 1) - 1)


def _stalled_read(m: Manifest) -> tuple[str, float]:
    st = ShardStream(
        m,
        0,
        1,
        1,
        StreamOptions(
            shuffle=False, retries=RETRIES, backoff_s=BACKOFF_S, timeouts=(CONNECT_S, READ_S)
        ),
    )
    t0 = time.monotonic()
    with pytest.raises(OSError) as info:
        st.next_batch()
    return str(info.value), time.monotonic() - t0


def test_a_stalled_http_server_ends_in_one_line_within_the_bound(dataset, stalled_server):
    base = f"http://127.0.0.1:{stalled_server}"
    message, took = _stalled_read(_moved(dataset, base))
    url = f"{base}/{dataset.shards[0].url}"
    assert message.startswith(f"could not read shard {url} after {RETRIES} attempts")
    assert "\n" not in message
    assert took < BOUND_S + 1.0, f"took {took:.2f}s, bound {BOUND_S:.2f}s"


def test_a_stalled_server_holding_the_manifest_is_one_line_not_a_hang(tmp_path, stalled_server):
    """The parent reads the manifest before any process starts: with the run's timeouts,
    not for as long as the server holds the connection."""
    from ulysses_mm.cli import main

    url = f"http://127.0.0.1:{stalled_server}/ds/manifest.json"
    t0 = time.monotonic()
    with pytest.raises(ManifestError, match=f"cannot read manifest {url}: .*Timeout"):
        Manifest.load(Location(url, timeouts=(CONNECT_S, READ_S)))
    assert time.monotonic() - t0 < CONNECT_S + READ_S + 1.0
    args = ["train", str(REPO / "configs/debug-tiny.yaml"), "parallel.sp=1", f"data.train={url}"]
    args += [f"data.connect_timeout_s={CONNECT_S}", f"data.read_timeout_s={READ_S}"]
    t0 = time.monotonic()
    assert main([*args, "--nproc", "1"]) == 2
    assert time.monotonic() - t0 < CONNECT_S + READ_S + 5.0


def test_a_stalled_s3_server_ends_in_one_line_within_the_bound(
    dataset, stalled_server, monkeypatch
):
    pytest.importorskip("s3fs")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    endpoint = f"http://127.0.0.1:{stalled_server}"
    m = _moved(dataset, "s3://bucket/ds", client_kwargs={"endpoint_url": endpoint})
    message, took = _stalled_read(m)
    assert message.startswith(f"could not read shard s3://bucket/ds/{dataset.shards[0].url}")
    assert "\n" not in message
    assert took < BOUND_S + 1.5, f"took {took:.2f}s, bound {BOUND_S:.2f}s"  # + client start


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    gets: ClassVar[dict[str, int]] = {}

    def do_GET(self):
        self.gets[self.path] = self.gets.get(self.path, 0) + 1
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def http_root(tmp_path):
    try:
        with serve_dir(tmp_path, _CountingHandler) as url:
            yield tmp_path, url
    finally:
        _CountingHandler.gets.clear()


def _copy(dataset: Manifest, root: Path) -> None:
    src = Path(dataset.location).parent
    for entry in dataset.shards:
        (root / entry.url).parent.mkdir(parents=True, exist_ok=True)
        (root / entry.url).write_bytes((src / entry.url).read_bytes())


def test_a_sha256_mismatch_is_one_data_error_line_and_not_retried(dataset, http_root):
    root, base = http_root
    _copy(dataset, root)
    shard = root / dataset.shards[0].url
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    st = ShardStream(
        _moved(dataset, base), 0, 1, 1, StreamOptions(shuffle=False, retries=5, backoff_s=0.01)
    )
    with pytest.raises(ShardIntegrityError) as info:
        st.next_batch()
    message = str(info.value)
    assert f"shard {base}/{dataset.shards[0].url}: sha256" in message
    assert "a data error, not retried" in message and "\n" not in message
    assert _CountingHandler.gets == {f"/{dataset.shards[0].url}": 1}


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_broken_tar_with_a_matching_sha256_is_one_line_naming_the_shard(
    dataset, tmp_path, damage
):
    src = Path(dataset.location).parent
    good = (src / dataset.shards[0].url).read_bytes()
    bad = good[: len(good) // 2 + 100] if damage == "truncated" else b"\x13" * 4096
    (tmp_path / "bad.tar").write_bytes(bad)
    entry = dataclasses.replace(
        dataset.shards[0],
        url=str(tmp_path / "bad.tar"),
        bytes=len(bad),
        sha256=hashlib.sha256(bad).hexdigest(),
    )
    shards: list[ShardEntry] = [entry, *dataset.shards[1:]]
    m = dataclasses.replace(dataset, shards=shards)
    st = ShardStream(m, 0, 1, 1, StreamOptions(shuffle=False))
    with pytest.raises(ShardFormatError) as info:
        st.next_batch()
    message = str(info.value)
    assert str(tmp_path / "bad.tar") in message and "\n" not in message
