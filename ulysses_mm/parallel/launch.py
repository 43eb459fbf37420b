"""Start local worker processes with torch's elastic launcher (what torchrun uses), or run
in the world a launcher already made. Nothing home-made: under torchrun or the DeepSpeed
launcher the environment describes the world and we join it; with ``--nproc N`` we ask
``torch.distributed.launcher`` for N local processes on a free loopback port.

A rank that fails reaches the user as one line naming the rank and what went wrong; its
full traceback goes to ``LOG_DIR/rank-N.log`` (the run directory's ``logs/`` for train).

A failed run ends in bounded time whatever its threads still wait on (a stalled storage
server, a collective whose peer is gone): a local worker process whose rank failed leaves
with ``os._exit`` once its error line is written, skipping interpreter shutdown, and the
elastic agent, seeing it gone, ends the rest of the world (SIGTERM, then SIGKILL), as
torchrun does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ulysses_mm.core.errors import WorkerError
from ulysses_mm.parallel.mesh import close_world, in_launched_world


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _guarded(fn: Callable[..., Any], log_dir: str, *args: Any) -> Any:
    """``fn(*args)`` on this rank; on failure the traceback goes to ``rank-N.log`` and a
    one-line :class:`WorkerError` (also left in ``rank-N.error`` for the parent) is
    raised."""
    try:
        return fn(*args)
    except Exception as e:
        rank = int(os.environ.get("RANK", "0"))
        logs = Path(log_dir)
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"rank-{rank}.log"
        log.write_text(traceback.format_exc())
        line = f"rank {rank}: {_one_line(e)} (traceback in {log})"
        (logs / f"rank-{rank}.error").write_text(line + "\n")
        raise WorkerError(line) from None


def _local_rank(fn: Callable[..., Any], log_dir: str, *args: Any) -> Any:
    """:func:`_guarded` in a worker process :func:`launch_local` started: a failure leaves
    at once (exit 1), its line in ``rank-N.error`` for the parent to print, not waiting
    for threads (a prefetch, a storage client's event loop) that may never return."""
    try:
        result = _guarded(fn, log_dir, *args)
    except WorkerError:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)
    close_world()
    return result


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` fresh processes on this machine; returns
    {rank: return value}. ``fn`` must be importable (a module-level function)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # As torchrun does: don't let N processes each start a thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ulysses-mm-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    return elastic_launch(config, fn)(*args)


def run_world(
    fn: Callable[..., Any], nproc: int | None, *args: Any, log_dir: str | Path | None = None
) -> list[Any]:
    """Run ``fn`` on every rank: in the current launched world if there is one, else in
    ``nproc`` local processes (or in this process when nproc is 1 or None).

    A failing rank raises :class:`WorkerError` here: one line naming the rank (the first
    to fail), its traceback in ``log_dir`` (default: a fresh temporary directory)."""
    logs = str(log_dir or tempfile.mkdtemp(prefix="ulysses-mm-logs-"))
    for stale in Path(logs).glob("rank-*.error"):  # an earlier run's, in the same run dir
        stale.unlink(missing_ok=True)
    if in_launched_world() or not nproc or nproc == 1:
        return [_guarded(fn, logs, *args)]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # the elastic agent logs every failure at length; the user gets one line instead
    agent_logs = [
        logging.getLogger(n)
        for n in ("torch.distributed.elastic", "torch.distributed", "torch.multiprocessing")
    ]
    levels = [lg.level for lg in agent_logs]
    for lg in agent_logs:
        lg.setLevel(logging.CRITICAL)
    try:
        results = launch_local(_local_rank, nproc, fn, logs, *args)
    except ChildFailedError as e:
        # a rank the agent ended may have left a progress bar half drawn: clear it, as
        # tqdm does, so the error line stands alone
        with contextlib.suppress(Exception):
            sys.stderr.write("\r" + " " * shutil.get_terminal_size().columns + "\r")
            sys.stderr.flush()
        first = _first_error_line(Path(logs))
        if first is not None:
            raise WorkerError(first) from None
        rank, failure = e.get_first_failure()
        raise WorkerError(
            f"rank {rank}: exited with code {failure.exitcode} (see {failure.error_file or logs})"
        ) from None
    finally:
        for lg, level in zip(agent_logs, levels):
            lg.setLevel(level)
    return [results[r] for r in sorted(results)]


def _first_error_line(logs: Path) -> str | None:
    """The line of the rank that failed first, by when its ``rank-N.error`` was written:
    the agent sees every rank gone at once, and the peers of a failed rank fail after it
    with a broken collective, which is not the cause."""
    found = []
    for f in logs.glob("rank-*.error"):
        with contextlib.suppress(OSError):
            found.append((f.stat().st_mtime_ns, f.read_text().strip()))
    return min(found)[1] if found else None
