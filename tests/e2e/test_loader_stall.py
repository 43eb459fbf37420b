"""A shard server that stalls or fails ends ``ulysses-mm train`` in bounded time, in one line.

Each case runs ``ulysses-mm train`` as a user would (a subprocess), against a loopback HTTP
server that serves the manifest and then, for the shards, accepts and never answers, or
answers 500 or 404; a manifest that answers 500 is one line too. What is asserted: the exit
code, one stderr line naming the URL, and the wall time — at most the read timeout times
the attempts plus a few seconds of process start, whatever the server keeps doing.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO
from train_data import prepare_dna

READ_S, CONNECT_S = 3.0, 1.0
START_S = 45.0  # interpreter, torch and DeepSpeed imports, process start (a loaded CPU)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small prepared dataset's directory (its manifest.json and shards)."""
    root = tmp_path_factory.mktemp("stall")
    return prepare_dna(root, "ds", records=12, seq_len=256, seed=2).parent


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, root: Path, shard_mode: str, manifest_mode: str = "ok") -> None:
        self.root, self.shard_mode, self.manifest_mode = root, shard_mode, manifest_mode
        self.stopping = threading.Event()
        self.requests: list[str] = []
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        s = self.server
        s.requests.append(self.path)
        mode = s.manifest_mode if self.path.endswith("manifest.json") else s.shard_mode
        if mode == "stall":  # the request was read; no byte of an answer ever comes
            s.stopping.wait(600)
            return
        if mode != "ok":
            self.send_error(int(mode))
            return
        path = s.root / self.path.lstrip("/").split("?", 1)[0]
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def serve(dataset) -> Iterator:
    """``serve(shard_mode, manifest_mode="ok")`` -> base URL of a server over ``dataset``:
    a mode is "ok", "stall", or an HTTP status ("500", "404")."""
    servers: list[_Server] = []

    def start(shard_mode: str, manifest_mode: str = "ok") -> str:
        server = _Server(dataset, shard_mode, manifest_mode)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    try:
        yield start
    finally:
        for server in servers:
            server.stopping.set()
            server.shutdown()
            server.server_close()


def _train(tmp: Path, base: str, nproc: int, *extra: str) -> tuple[int, list[str], float]:
    """``ulysses-mm train`` against ``base``: (exit code, stderr lines, wall seconds)."""
    args = [sys.executable, "-m", "ulysses_mm", "train", str(REPO / "configs/debug-tiny.yaml")]
    args += [
        f"data.train={base}/manifest.json",
        f"train.out_dir={tmp / 'run'}",
        "parallel.sp=1",
        "train.steps=2",
        "logging.wandb=disabled",
        f"data.read_timeout_s={READ_S}",
        f"data.connect_timeout_s={CONNECT_S}",
        "data.retry_backoff_s=0.1",
        *extra,
        "--nproc",
        str(nproc),
    ]
    t0 = time.monotonic()
    out = subprocess.run(
        args,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
        capture_output=True,  # bytes: text mode would turn the bar's "\r" into "\n"
        timeout=300,
    )
    took = time.monotonic() - t0
    # the lines a terminal shows: the text after a line's last carriage return (rank 0's
    # progress bar redraws itself, and is cleared when the run fails)
    stderr = out.stderr.decode(errors="replace")
    shown = (line.rsplit("\r", 1)[-1] for line in stderr.split("\n"))
    lines = [line for line in shown if line.strip()]
    print(
        f"[{' '.join(extra)} --nproc {nproc}] exit {out.returncode}, {len(lines)} stderr "
        f"lines, {took:.1f}s"
    )
    return out.returncode, lines, took


def _one_line(lines: list[str]) -> str:
    assert len(lines) == 1, "\n".join(lines[-40:])
    print(f"  {lines[0]}")
    return lines[0]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_shard_server_that_never_answers_ends_the_run_in_one_line(tmp_path, serve, nproc):
    base = serve("stall")
    retries = 2
    code, lines, took = _train(tmp_path, base, nproc, f"data.retries={retries}")
    line = _one_line(lines)
    assert code == 1, line
    assert f"could not read shard {base}/" in line and "after 2 attempts" in line, line
    assert "rank " in line, line
    bound = retries * (CONNECT_S + READ_S) + 0.1 + START_S
    assert took < bound, f"took {took:.1f}s, bound {bound:.1f}s"


@pytest.mark.parametrize("status", ["500", "404"])
def test_a_shard_error_status_is_one_line_naming_the_url_and_status(tmp_path, serve, status):
    base = serve(status)
    code, lines, took = _train(tmp_path, base, 1, "data.retries=3")
    line = _one_line(lines)
    assert code == 1, line
    assert f"{base}/" in line and status in line, line
    assert took < START_S + 3, f"took {took:.1f}s"


@pytest.mark.parametrize("status", ["500", "404"])
def test_a_manifest_error_status_is_one_line_naming_the_url(tmp_path, serve, status):
    base = serve("ok", manifest_mode=status)
    code, lines, took = _train(tmp_path, base, 1, "data.retries=1")
    line = _one_line(lines)
    assert code == 2, line
    assert f"{base}/manifest.json" in line and status in line, line
    assert took < START_S, f"took {took:.1f}s"


def test_a_manifest_server_that_never_answers_is_one_line_within_the_read_timeout(tmp_path, serve):
    """One streamed GET, not a size request and then a read: the stall is waited out once."""
    base = serve("ok", manifest_mode="stall")
    code, lines, took = _train(tmp_path, base, 1)
    line = _one_line(lines)
    assert code == 2, line
    assert f"cannot read manifest {base}/manifest.json: no answer within the timeouts" in line
    bound = CONNECT_S + READ_S + START_S
    assert took < bound, f"took {took:.1f}s, bound {bound:.1f}s"


@pytest.fixture
def moto_process(monkeypatch) -> Iterator[tuple[subprocess.Popen, str]]:
    """The moto S3 server in a process of its own, which the test can SIGSTOP; it is
    continued and stopped (by its PID) when the test ends."""
    pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-p", str(port), "-H", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline and proc.poll() is None, "moto did not start"
            time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir("bucket")
        yield proc, endpoint
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["paused", "killed"])
def test_an_s3_server_stopped_mid_run_ends_the_run_in_one_line(
    tmp_path, dataset, moto_process, sig
):
    """Stop the object store once the ranks train. Paused (SIGSTOP): their reads stall (the
    kernel still accepts connections); killed (SIGKILL): connections are refused. Either
    way the reads fail after the retries, and the launcher ends the world."""
    import s3fs

    proc, endpoint = moto_process
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    fs.put(str(dataset) + "/", "bucket/ds/", recursive=True)
    run = tmp_path / "run"
    retries = 2
    args = [sys.executable, "-m", "ulysses_mm", "train", str(REPO / "configs/debug-tiny.yaml")]
    args += [
        "data.train=s3://bucket/ds/manifest.json",
        f"data.storage_options={{endpoint_url: '{endpoint}'}}",
        f"train.out_dir={run}",
        "parallel.sp=1",
        "train.steps=100000",  # keeps reading shards (no prefetch: one read per shard change)
        "train.checkpoint_every=0",
        "data.prefetch_bytes=0",
        "logging.wandb=disabled",
        f"data.read_timeout_s={READ_S}",
        f"data.connect_timeout_s={CONNECT_S}",
        f"data.retries={retries}",
        "data.retry_backoff_s=0.1",
        "--nproc",
        "2",
    ]
    train = subprocess.Popen(
        args,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 240
        while not run.exists():  # the ranks made their logger: training starts
            assert train.poll() is None, train.stderr.read().decode() if train.stderr else ""
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.02)
        time.sleep(1.0)
        proc.send_signal(sig)
        t0 = time.monotonic()
        _, err = train.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    shown = (line.rsplit("\r", 1)[-1] for line in err.decode(errors="replace").split("\n"))
    lines = [line for line in shown if line.strip()]
    print(
        f"[s3 {sig.name} --nproc 2] exit {train.returncode}, {len(lines)} stderr lines, {took:.1f}s"
    )
    line = _one_line(lines)
    assert train.returncode == 1, line
    assert "rank " in line and "s3://bucket/ds/" in line, line
    bound = retries * (CONNECT_S + READ_S) + 0.1 + 10
    assert took < bound, f"took {took:.1f}s after {sig.name}, bound {bound:.1f}s"


def test_inspect_reading_a_stalled_shard_is_one_error_in_bounded_time(serve):
    """``inspect`` and the demo read shards through read_verified_shard, which has the
    manifest's timeouts: a server that accepts and never answers is one error naming the
    shard, not a hang."""
    from ulysses_mm.core.storage import Location
    from ulysses_mm.shards.manifest import Manifest, ShardIntegrityError, read_verified_shard

    base = serve("stall")
    m = Manifest.load(Location(f"{base}/manifest.json", timeouts=(CONNECT_S, READ_S)))
    t0 = time.monotonic()
    with pytest.raises(ShardIntegrityError, match=f"cannot read shard {base}/shard-") as e:
        read_verified_shard(m, 0, timeouts=(CONNECT_S, 1.0))
    took = time.monotonic() - t0
    assert "\n" not in str(e.value)
    assert took < CONNECT_S + 1.0 + 5, f"took {took:.1f}s"
