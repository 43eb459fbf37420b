"""Ending a run on purpose: a signal or a time budget stops it at a step boundary, on every
rank together, with a checkpoint; the run then exits with :data:`EXIT_STOPPED`.

A signal handler only records the signal (Megatron-LM's ``--exit-signal-handler``,
Lightning's requeue handler): saving inside a handler would run in the middle of a step
or a collective. The ranks agree at every step boundary with one all-reduce of a few
integers (:func:`agree`), also between evaluation batches and while a rank waits for a
shard, so a signal that reached one rank, or only the launcher, stops all of them at the
same step.

A terminal's Ctrl-C reaches the launcher and every rank, and the launcher forwards it
again: copies within :data:`DEBOUNCE_S` of the first are that same request. A signal
after that is a second request, and it ends the process at once (exit 128 + the signal's
number); ``latest`` still names the last complete checkpoint.

The budget (``train.max_minutes``) is the same path with elapsed time (Megatron-LM's
``--exit-duration-in-mins``): a rank votes to stop when what is left of the budget would
not cover the slowest recent step and a save.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ulysses_mm.core.storage import atomic_write_local

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on a signal or a time budget; the same command continues
DEBOUNCE_S = 2.0
STOPPED_FILE = "stopped.json"  # RUN_DIR/stopped.json: the last stop, removed when a run starts


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequests:
    """The signals of ``train.stop_signals`` turned into a flag (:attr:`signum`)."""

    def __init__(self, names: list[str], announce: str | None = None) -> None:
        self.signals = [signal.Signals[n] for n in names]
        self.announce = announce  # what a second signal prints before leaving (None: nothing)
        self.signum: int | None = None
        self.first_at = 0.0
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> StopRequests:
        """Handle the signals (in the main thread only, where Python runs handlers)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first_at = signum, now
            return
        if now - self.first_at < DEBOUNCE_S:
            return  # the same request, delivered again (process group, then the launcher)
        if self.announce:
            os.write(2, self.announce.format(signal=signal_name(signum)).encode() + b"\n")
        os._exit(128 + signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal_name(self.signum) if self.signum is not None else ""


class Budget:
    """``train.max_minutes`` from ``started`` (epoch seconds: when the command began),
    judged from the measured step and save times."""

    def __init__(self, max_minutes: float, started: float) -> None:
        self.seconds = max_minutes * 60.0
        self.started = started
        self.steps: deque[float] = deque(maxlen=8)
        self.save_s = 0.0  # the last save's cost (its blocking part plus the wait for it)

    def step_took(self, seconds: float) -> None:
        self.steps.append(seconds)

    def save_took(self, seconds: float) -> None:
        self.save_s = seconds

    def left(self) -> float:
        return self.started + self.seconds - time.time()

    def exhausted(self) -> bool:
        """Whether the next step and a save, with a margin, no longer fit."""
        if not self.seconds:
            return False
        step = max(self.steps, default=0.0)
        save = self.save_s or 2 * step  # no save measured yet: assume two steps' worth
        return self.left() < 1.2 * (step + save) + 1.0


def agree(flags: list[int], device: Any = None) -> list[int]:
    """Each flag's maximum over every rank (one all-reduce; the flags as given when there
    is no process group)."""
    import torch  # lazy: the CLI reads this module's codes and records torch-free
    import torch.distributed as dist  # lazy: the CLI stays torch-free

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(flags)
    t = torch.tensor(flags, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


@dataclass
class StopRecord:
    """What a stopped run leaves in ``RUN_DIR/stopped.json`` for the launcher, a job
    script and the user: where it stopped, why, and its checkpoint."""

    step: int
    steps: int
    reason: str  # a signal's name, or "time budget"
    checkpoint: str  # the checkpoint that holds ``step`` ('' when none was needed)
    started: float  # the command's start (epoch seconds): which run wrote it

    def write(self, run_dir: Path) -> None:
        atomic_write_local(run_dir / STOPPED_FILE, (json.dumps(asdict(self)) + "\n").encode())

    @classmethod
    def read(cls, run_dir: Path, started: float) -> StopRecord | None:
        """The record the run begun at ``started`` wrote (None when it wrote none)."""
        try:
            data = json.loads((run_dir / STOPPED_FILE).read_text())
            record = cls(**data)
        except (OSError, ValueError, TypeError):
            return None
        return record if math.isclose(record.started, started, abs_tol=1e-3) else None

    def line(self, command: str) -> str:
        where = f"checkpoint {self.checkpoint}" if self.checkpoint else "no step to save"
        return (
            f"stopped on {self.reason} after step {self.step} of {self.steps}; {where}; "
            f"continue with: {command}"
        )


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval √(2 × save time × mean time between failures)."""
    return math.sqrt(2.0 * save_s * mtbf_s)
