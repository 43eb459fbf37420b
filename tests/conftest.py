"""Shared test setup: quiet W&B, a cached DeepSpeed extension dir, the repo on sys.path."""

from __future__ import annotations

import contextlib
import http.server
import io
import os
import socket
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from byte_proxy import ByteCountingProxy

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# benchmarks run by tests write their result files here, never into benchmarks/results
os.environ.setdefault("ULYSSES_MM_BENCH_RESULTS", tempfile.mkdtemp(prefix="ulysses-mm-bench-"))


# `make test-fast` (pytest -m "not slow") is the unit tests and these end-to-end modules;
# everything else under e2e/ and distributed/ (training runs, forked gloo worlds, launched
# processes, wheel builds) is marked slow here, so a new module there is slow until listed.
FAST_E2E = {
    "test_cli.py",
    "test_cli_sweep.py",
    "test_faults_new_commands.py",
    "test_hf_tokenizer.py",
    "test_inspect.py",
    "test_prepare.py",
    "test_video_samples.py",
}


def pytest_collection_modifyitems(config, items):
    """Slow tests get the ``slow`` marker (see FAST_E2E); GPU-only tests skip themselves
    where no CUDA device is (the CPU suite is the contract)."""
    import pytest
    import torch

    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name == "distributed" or (
            path.parent.name == "e2e" and path.name not in FAST_E2E
        ):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def require_fixture(present: bool, what: str) -> None:
    """Skip a test whose fixture (sample files, a tokenizer spec) this checkout lacks, as a
    user's clone without ../shared may; under CI (CI=true), where every fixture must be
    there, fail instead, so the suite never runs fewer tests than it says."""
    if present:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"fixture missing under CI=true: {what}", pytrace=False)
    pytest.skip(f"{what} not in this checkout")


def tar_of(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@contextlib.contextmanager
def serve_dir(
    root: str | Path, handler: type[http.server.SimpleHTTPRequestHandler]
) -> Iterator[str]:
    """Serve ``root`` over HTTP on 127.0.0.1 with ``handler`` (a SimpleHTTPRequestHandler);
    yields the base URL and stops the server on exit."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a, **k: handler(*a, directory=str(root), **k)
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def s3_server(monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_counted(s3_server) -> Iterator[ByteCountingProxy]:
    """The moto S3 server behind a byte-counting TCP proxy (moto reports no traffic):
    point clients at ``proxy.url``; ``proxy.sent`` is what the server sent them."""
    port = int(s3_server.rsplit(":", 1)[1])
    with ByteCountingProxy(("127.0.0.1", port)) as proxy:
        yield proxy
