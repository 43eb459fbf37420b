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

Signals: the agent forwards the ones it is given (``signals``) to every worker and waits
``grace_s`` for them to leave before it kills them; a worker whose launcher dies (even by
SIGKILL) is ended by the kernel (``PR_SET_PDEATHSIG``). What a killed launch leaves
behind (its multiprocessing semaphores in ``/dev/shm``, the agent's log folder) is
recorded in the log directory and removed by the next launch there.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulysses_mm.core.errors import Interrupted, WorkerError
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


LAUNCHED_HERE = "ULYSSES_MM_LOCAL_LAUNCH"  # set in the workers launch_local starts


def die_with_parent() -> None:
    """Have the kernel end this process (SIGKILL) when the process that started it dies,
    so a launcher killed with SIGKILL leaves no rank behind (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)


def _local_rank(fn: Callable[..., Any], log_dir: str, *args: Any) -> Any:
    """:func:`_guarded` in a worker process :func:`launch_local` started: a failure leaves
    at once (exit 1), its line in ``rank-N.error`` for the parent to print, not waiting
    for threads (a prefetch, a storage client's event loop) that may never return."""
    die_with_parent()
    os.environ[LAUNCHED_HERE] = "1"
    try:
        result = _guarded(fn, log_dir, *args)
    except WorkerError:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)
    close_world()
    return result


@dataclass(frozen=True)
class Signals:
    """What the launcher does with signals: forwards ``names`` to its workers, and waits
    ``grace_s`` for them to leave before it kills them."""

    names: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    grace_s: int = 30


def launch_local(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    signals: Signals = Signals(),
    agent_logs: Path | None = None,
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` fresh processes on this machine; returns
    {rank: return value}. ``fn`` must be importable (a module-level function)."""
    from torch.distributed.elastic.multiprocessing import (
        DefaultLogsSpecs,  # lazy: torch.distributed.elastic, only a launch needs it
    )
    from torch.distributed.launcher.api import (  # lazy: torch.distributed.elastic, only a launch needs it
        LaunchConfig,
        elastic_launch,
    )

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
        signals_to_handle=",".join(signals.names),
        shutdown_timeout=signals.grace_s,
        logs_specs=DefaultLogsSpecs(log_dir=str(agent_logs) if agent_logs else None),
    )
    return elastic_launch(config, fn)(*args)


def in_process(nproc: int | None) -> bool:
    """Whether :func:`run_world` runs its ranks' function in this process: a rank of a
    launched world, or one process (``nproc`` 1 or None)."""
    return in_launched_world() or not nproc or nproc == 1


def run_world(
    fn: Callable[..., Any],
    nproc: int | None,
    *args: Any,
    log_dir: str | Path | None = None,
    signals: Signals = Signals(),
) -> list[Any]:
    """Run ``fn`` on every rank: in the current launched world if there is one, else in
    ``nproc`` local processes (or in this process when nproc is 1 or None).

    A failing rank raises :class:`WorkerError` here: one line naming the rank (the first
    to fail), its traceback in ``log_dir`` (default: a fresh temporary directory). A
    signal the launcher got (and forwarded) raises :class:`Interrupted` once the workers
    are gone; what they did with it is theirs to record."""
    logs = str(log_dir or tempfile.mkdtemp(prefix="ulysses-mm-logs-"))
    for stale in Path(logs).glob("rank-*.error"):  # an earlier run's, in the same run dir
        stale.unlink(missing_ok=True)
    if in_process(nproc):
        return [_guarded(fn, logs, *args)]
    assert nproc is not None  # in_process: None is one process
    from torch.distributed.elastic.multiprocessing.api import (
        SignalException,  # lazy: torch.distributed.elastic, only a launch needs it
    )
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,  # lazy: torch.distributed.elastic, only a launch needs it
    )

    agent_dir = Path(logs) / "agent"
    remove_leftovers(Path(logs))
    record_launch(Path(logs))

    # the elastic agent logs every failure at length; the user gets one line instead
    agent_logs = [
        logging.getLogger(n)
        for n in (
            "torch.distributed.elastic",
            "torch.distributed.elastic.agent.server.api",
            "torch.distributed.elastic.multiprocessing.api",
            "torch.distributed",
            "torch.multiprocessing",
        )
    ]
    levels = [lg.level for lg in agent_logs]
    for lg in agent_logs:
        lg.setLevel(logging.CRITICAL)
    try:
        results = launch_local(
            _local_rank, nproc, fn, logs, *args, signals=signals, agent_logs=agent_dir
        )
    except SignalException as e:
        _clear_line()
        raise Interrupted(f"ended by {e.sigval.name}", int(e.sigval)) from None
    except ChildFailedError as e:
        _clear_line()
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
        shutil.rmtree(agent_dir, ignore_errors=True)
        (Path(logs) / _LAUNCH_FILE).unlink(missing_ok=True)
    return [results[r] for r in sorted(results)]


def _clear_line() -> None:
    """A rank the agent ended may have left a progress bar half drawn: clear it, as tqdm
    does, so the line printed next stands alone."""
    with contextlib.suppress(Exception):
        sys.stderr.write("\r" + " " * shutil.get_terminal_size().columns + "\r")
        sys.stderr.flush()


_LAUNCH_FILE = "launch.json"
_SEMAPHORES = Path("/dev/shm")


def record_launch(logs: Path) -> None:
    """Note this launcher (pid, start time) in ``logs``: if it is killed, the next launch
    there removes what it left (:func:`remove_leftovers`)."""
    logs.mkdir(parents=True, exist_ok=True)
    info = {"pid": os.getpid(), "started": time.time()}
    (logs / _LAUNCH_FILE).write_text(json.dumps(info) + "\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mapped_shm() -> set[int]:
    """The inodes of the ``/dev/shm`` files some live process has mapped (an open
    semaphore is mapped, under the temporary name it was made with: hence inodes)."""
    mapped: set[int] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/dev/shm/"):
                    mapped.add(int(fields[4]))
    return mapped


def remove_leftovers(logs: Path) -> list[str]:
    """What a killed launch recorded in ``logs`` left: the agent's log folder, and the
    multiprocessing semaphores created since it started that no live process holds
    (its own, whose cleanup died with it). Nothing while that launcher lives."""
    record = logs / _LAUNCH_FILE
    try:
        info = json.loads(record.read_text())
        pid, started = int(info["pid"]), float(info["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if _alive(pid) and pid != os.getpid():
        return []
    removed = []
    if (logs / "agent").is_dir():
        shutil.rmtree(logs / "agent", ignore_errors=True)
        removed.append(str(logs / "agent"))
    if _SEMAPHORES.is_dir():
        held = _mapped_shm()
        for sem in _SEMAPHORES.glob("sem.mp-*"):
            with contextlib.suppress(OSError):
                st = sem.stat()
                if (
                    st.st_uid == os.getuid()
                    and st.st_mtime >= started - 1
                    and st.st_ino not in held
                ):
                    sem.unlink()
                    removed.append(str(sem))
    record.unlink(missing_ok=True)
    return removed


def _first_error_line(logs: Path) -> str | None:
    """The line of the rank that failed first, by when its ``rank-N.error`` was written:
    the agent sees every rank gone at once, and the peers of a failed rank fail after it
    with a broken collective, which is not the cause."""
    found = []
    for f in logs.glob("rank-*.error"):
        with contextlib.suppress(OSError):
            found.append((f.stat().st_mtime_ns, f.read_text().strip()))
    return min(found)[1] if found else None
