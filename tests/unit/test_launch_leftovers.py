"""What a killed launch leaves (its semaphores in /dev/shm, the agent's log folder) is
removed by the next launch in the same log directory, and only that: nothing while the
recorded launcher lives, no semaphore a live process holds, none made before it started."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ulysses_mm.parallel.launch import record_launch, remove_leftovers

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this system")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_launchers_leftovers_go_and_nothing_else(tmp_path):
    started = time.time()
    (tmp_path / "launch.json").write_text(json.dumps({"pid": _dead_pid(), "started": started}))
    (tmp_path / "agent" / "run-1").mkdir(parents=True)
    orphan = SHM / f"sem.mp-test{uuid.uuid4().hex[:8]}"
    orphan.write_bytes(b"\0" * 32)
    older = SHM / f"sem.mp-test{uuid.uuid4().hex[:8]}"
    older.write_bytes(b"\0" * 32)
    os.utime(older, (started - 3600, started - 3600))  # made before that launch
    held = multiprocessing.get_context("spawn").Lock()  # a live process's semaphore
    try:
        before = {p.name for p in SHM.glob("sem.mp-*")} - {orphan.name, older.name}
        removed = remove_leftovers(tmp_path)
        assert str(orphan) in removed and not orphan.exists()
        assert older.exists()
        assert {p.name for p in SHM.glob("sem.mp-*")} >= before  # held ones stay
        assert not (tmp_path / "agent").exists() and not (tmp_path / "launch.json").exists()
    finally:
        older.unlink(missing_ok=True)
        orphan.unlink(missing_ok=True)
        del held


def test_a_live_launchers_files_are_left_alone(tmp_path):
    record_launch(tmp_path)
    other = json.loads((tmp_path / "launch.json").read_text())
    other["pid"] = os.getppid()  # alive, and not this process
    (tmp_path / "launch.json").write_text(json.dumps(other))
    (tmp_path / "agent").mkdir()
    assert remove_leftovers(tmp_path) == []
    assert (tmp_path / "agent").is_dir() and (tmp_path / "launch.json").exists()
