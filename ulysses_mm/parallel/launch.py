"""Start local worker processes with torch's elastic launcher (what torchrun uses), or run
in the world a launcher already made. Nothing home-made: under torchrun or the DeepSpeed
launcher the environment describes the world and we join it; with ``--nproc N`` we ask
``torch.distributed.launcher`` for N local processes on a free loopback port.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from ulysses_mm.parallel.mesh import in_launched_world


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


def run_world(fn: Callable[..., Any], nproc: int | None, *args: Any) -> list[Any]:
    """Run ``fn`` on every rank: in the current launched world if there is one, else in
    ``nproc`` local processes (or in this process when nproc is 1 or None)."""
    if in_launched_world():
        return [fn(*args)]
    if not nproc or nproc == 1:
        return [fn(*args)]
    results = launch_local(fn, nproc, *args)
    return [results[r] for r in sorted(results)]
