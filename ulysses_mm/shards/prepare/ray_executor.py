"""The Ray executor: each partition is one Ray task running
:func:`~ulysses_mm.shards.prepare.executor.run_partition`, anywhere in the cluster.

Ray is imported here only, and this module only when a pipeline says ``engine: ray``
(``ulysses-mm prepare PIPELINE --engine ray``), so the local executor needs no Ray. With no
address a local Ray is started (``workers`` CPUs, default all) and shut down at the end; an
address (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``) joins a running cluster, whose
nodes must have ulysses-mm installed and see the pipeline's tokenizer specs at the same
paths; inputs and output are best given as URLs every node can reach.

A task whose worker process dies (killed, out of memory, its node lost) is retried by Ray
(``max_retries``); a retried partition starts again from its inputs, so its bytes do not
change. A task that raises fails the run at once, in one line naming the partition, its
traceback in ``STAGING/logs/partition-PPPPP.log``; the partitions already written stay,
and the next run skips them.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ulysses_mm.core.errors import ConfigError, StorageError, UnsupportedError, first_line
from ulysses_mm.shards.prepare.executor import Progress, partition_failed, run_partition
from ulysses_mm.shards.prepare.partition import Job, PartitionResult, PartitionTask

MAX_RETRIES = 3  # attempts after a worker process dies, per partition
CONNECT_S = 10.0  # seconds a cluster's head may take to accept a connection
HANDSHAKE_S = 3.0  # seconds it may take to answer that connection as a gRPC server


def check_ready(address: str) -> None:
    """What a run can know before it writes anything: Ray is installed, the address is
    ``auto``, ``HOST:PORT`` or ``ray://HOST:PORT``, ``auto`` finds a cluster, and the head
    accepts a connection within :data:`CONNECT_S` and answers it as a gRPC server (HTTP/2,
    what Ray's GCS and client server speak) within :data:`HANDSHAKE_S`. Ray's own client
    retries for minutes, printing warnings, whatever listens there."""
    _import_ray()
    if not address:
        return
    if address == "auto":
        from ray._private.services import (
            canonicalize_bootstrap_address_or_die,  # lazy: heavy (ray), optional
        )

        try:
            address = canonicalize_bootstrap_address_or_die("auto")
        except (ConnectionError, ValueError) as e:
            raise StorageError(f"cannot join a Ray cluster at auto: {_one_line(e)}") from None
    scheme, sep, hostport = address.rpartition("://")
    host, _, port = hostport.rpartition(":")
    if (sep and scheme != "ray") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--address must be auto, HOST:PORT or ray://HOST:PORT, got {address!r}")
    try:
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_S)
    except OSError as e:
        raise StorageError(
            f"cannot join a Ray cluster at {address}: nothing accepts connections there "
            f"({e.strerror or type(e).__name__}); start it with `ray start --head` or fix "
            "--address"
        ) from None
    with sock:
        if os.environ.get("RAY_USE_TLS", "0") in ("0", ""):  # a TLS head is left to Ray
            answer = _http2_answer(sock)
            if answer is not None:
                raise StorageError(
                    f"cannot join a Ray cluster at {address}: what listens there is not a Ray "
                    f"head ({answer}); give the head's GCS address (`ray start --head` prints "
                    "it, port 6379 by default), not the dashboard's"
                )


# HTTP/2's client connection preface and an empty SETTINGS frame: a gRPC server answers
# with a SETTINGS frame (9-byte header, type 4, stream 0); an HTTP/1 server with text.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _http2_answer(sock: socket.socket) -> str | None:
    """``None`` if the peer answers the HTTP/2 preface with a SETTINGS frame within
    :data:`HANDSHAKE_S`, else what it did instead, in a few words."""
    sock.settimeout(HANDSHAKE_S)
    got = b""
    try:
        sock.sendall(_PREFACE)
        while len(got) < 9:
            chunk = sock.recv(9 - len(got))
            if not chunk:
                break
            got += chunk
    except TimeoutError:
        return f"no HTTP/2 answer within {HANDSHAKE_S:g} s"
    except OSError as e:
        return f"the connection failed: {e.strerror or type(e).__name__}"
    if len(got) == 9 and got[3] == 4 and got[5:9] == bytes(4):
        return None
    if not got:
        return "it closed the connection"
    text = got.split(b"\r\n")[0].decode("ascii", "replace")
    return f"it answered {text!r}, not HTTP/2" if text.isprintable() else "not HTTP/2"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _import_ray() -> Any:
    try:
        import ray  # lazy: heavy (ray), optional
    except ImportError:
        raise UnsupportedError(
            "engine=ray needs Ray: pip install 'ulysses-mm[ray]' (or engine=local)"
        ) from None
    return ray


def connect(address: str, cpus: int) -> tuple[Any, bool]:
    """``(ray, started)``: the ray module, connected (``started``: this call started a
    local Ray, which the caller shuts down)."""
    ray = _import_ray()
    if ray.is_initialized():
        return ray, False
    kw: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address:
        kw["address"] = address
    else:  # a local Ray of our own
        kw.update(include_dashboard=False, num_cpus=cpus or None)
    try:
        ray.init(**kw)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"at {address}" if address else "locally"
        raise StorageError(f"cannot start or join a Ray cluster {where}: {e}") from None
    return ray, True


class RayExecutor:
    """Partitions as Ray tasks, at most ``workers`` at a time (0: as many as the cluster
    has CPUs for, ``cpus`` each)."""

    name = "ray"

    def __init__(self, address: str = "", workers: int = 0, cpus: float = 1.0) -> None:
        self.address = address
        self.workers = workers
        self.cpus = cpus

    def run(
        self, job: Job, tasks: Sequence[PartitionTask], progress: Progress
    ) -> list[PartitionResult]:
        ray, started = connect(self.address, self.workers)
        try:
            return self._run(ray, job, tasks, progress)
        finally:
            if started:
                ray.shutdown()

    def _run(
        self, ray: Any, job: Job, tasks: Sequence[PartitionTask], progress: Progress
    ) -> list[PartitionResult]:
        remote = ray.remote(num_cpus=self.cpus, max_retries=MAX_RETRIES, retry_exceptions=False)(
            run_partition
        )
        window = self.workers or max(1, int(ray.cluster_resources().get("CPU", 1) // self.cpus))
        todo = list(tasks)
        running: dict[Any, PartitionTask] = {}
        results: dict[int, PartitionResult] = {}
        job_ref = ray.put(job)
        try:
            while todo or running:
                while todo and len(running) < window:
                    t = todo.pop(0)
                    running[remote.remote(job_ref, t)] = t
                ready, _ = ray.wait(list(running), num_returns=1)
                for ref in ready:
                    t = running.pop(ref)
                    results[t.index] = self._get(ray, ref, t, job)
                    progress.partition_done(results[t.index], inputs_counted=False)
        finally:
            for ref in running:  # a failed run: stop what is still going
                ray.cancel(ref, force=True)
        return [results[t.index] for t in tasks]

    @staticmethod
    def _get(ray: Any, ref: Any, task: PartitionTask, job: Job) -> PartitionResult:
        log_dir = Path(job.staging) / "logs"
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            raise partition_failed(task, first_line(cause), log_dir, _plain(str(e))) from None
        except ray.exceptions.RayError as e:  # the worker died on every attempt, a lost node
            why = (
                f"its worker died on each of {MAX_RETRIES + 1} attempts (crash, out of memory or "
                f"a lost node): {type(e).__name__}"
            )
            raise partition_failed(task, why, log_dir, _plain(str(e))) from None


def _plain(text: str) -> str:
    """Ray's traceback text without its terminal colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
