"""Fork N gloo processes on CPU, run a function on each, fail loudly and never hang.

Each worker joins a real gloo process group (file store, no ports), runs
``fn(rank, world_size, *args)`` and reports its return value or traceback. A worker that
raises fails the test with its traceback; a world that does not finish in ``timeout``
seconds is killed and fails the test (so a collective that would hang cannot stall CI).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def _entry(fn, rank, world_size, store_path, queue, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the
    per-rank results (rank order). ``fn`` must be a module-level function."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, store, queue, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                if all(p.exitcode is not None for p in procs):
                    break  # every process is gone; whatever reported has reported
                continue
            results[rank] = (ok, payload)
            if not ok:
                # the others may now wait forever in a collective: collect briefly, then stop
                deadline = min(deadline, time.monotonic() + 3.0)
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failures = [f"rank {r}:\n{payload}" for r, (ok, payload) in sorted(results.items()) if not ok]
    if failures:
        raise AssertionError("distributed worker failed\n" + "\n".join(failures))
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        codes = {i: p.exitcode for i, p in enumerate(procs)}
        raise AssertionError(
            f"ranks {missing} did not finish within {timeout}s (exit codes {codes})"
        )
    return [results[r][1] for r in range(world_size)]
