"""W&B history after kill -9 and resume: every step once, none missing.

A process logs steps 1..7 with a checkpoint at 5 and is killed with SIGKILL (with its
whole process group, W&B's service included, which had stored nothing yet); the resumed
logger redoes 6..12 and is killed after the checkpoint at 10; the next one ends at 13. The offline runs' histories ``wandb sync`` would upload hold each of
1..13 exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import REPO
from wandb_records import history

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from ulysses_mm.config import RunConfig, load_config
    from ulysses_mm.train.logger import MetricsLogger

    run = Path(sys.argv[1])
    cfg = load_config(RunConfig, None, ["logging.wandb=offline", f"train.out_dir={run}"])
    logger = MetricsLogger(cfg, run, True, resume_step=int(sys.argv[2]))
    for step in range(int(sys.argv[2]) + 1, int(sys.argv[3]) + 1):
        logger.log(step, {"kind": "train", "loss": 1.0 / step})
        if step % 5 == 0:
            logger.checkpointed(step)
    {ending}
    """
)


def _run(run: Path, start: int, stop: int, ending: str) -> int:
    # W&B names an offline run's folder by the second it began (and the run id, which a
    # resume keeps): two runs within one second would share a folder, which no real kill
    # and restart does
    time.sleep(1.1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("{ending}", ending), str(run), str(start), str(stop)],
        env=env,
        cwd=REPO,
        start_new_session=True,
        timeout=120,
    )
    return proc.returncode


def _steps(run: Path) -> list[int]:
    steps = []
    for d in (run / "wandb").glob("offline-run-*"):
        steps += [int(r["_step"]) for r in history(d) if "loss" in r]  # type: ignore[call-overload]
    return sorted(steps)


def test_kill_9_then_resume_leaves_no_gap_and_no_duplicate(tmp_path):
    run = tmp_path / "run"
    # killed twice past a checkpoint (5, then 10): the steps after it are redone
    assert _run(run, 0, 7, "os.killpg(os.getpgrp(), signal.SIGKILL)") == -signal.SIGKILL
    assert _run(run, 5, 12, "os.killpg(os.getpgrp(), signal.SIGKILL)") == -signal.SIGKILL
    assert _run(run, 10, 13, "logger.finish()") == 0
    assert _steps(run) == list(range(1, 14))
    assert len(list((run / "wandb" / "superseded").glob("offline-run-*"))) == 2
