"""Where per-step metrics go: Weights & Biases and a local JSONL file.

Only rank 0 writes. W&B runs online, offline (the default when no API key is set: the run
lands in RUN_DIR/wandb and can be ``wandb sync``-ed later) or not at all, as
``logging.wandb`` says. ``metrics.jsonl`` gets one JSON object per logged step either way,
so a run can be plotted (``ulysses-mm report``) without W&B.

W&B history survives a kill -9 without gaps or duplicates. A step reaches W&B only once a
checkpoint covers it (:meth:`MetricsLogger.checkpointed`): steps after the last checkpoint
are redone by the resumed run, so sending them early would log them twice. What W&B had
not yet stored when the process died (its service buffers; offline, the whole run file
can still be empty) is handed over again from ``metrics.jsonl`` on resume: online, the
steps from the server's next step (``run.step``) up to the checkpoint; offline, every step
up to the checkpoint, into the new offline run directory, and the killed runs'
directories of the same run id move to ``RUN_DIR/wandb/superseded`` so that
``wandb sync`` sees each step once. The W&B charts thus trail training by up to
``train.checkpoint_every`` steps; ``metrics.jsonl`` does not.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

from ulysses_mm.config import RunConfig, to_dict
from ulysses_mm.core.storage import atomic_write_local


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    """What W&B charts as a metric: not ``kind``, not lists."""
    return {k: v for k, v in metrics.items() if k != "kind" and not isinstance(v, list)}


def wandb_mode(setting: str) -> str:
    if setting != "auto":
        return setting
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class MetricsLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing."""

    def __init__(self, cfg: RunConfig, run_dir: Path, active: bool, resume_step: int = 0) -> None:
        self.active = active
        self.jsonl = run_dir / "metrics.jsonl" if cfg.logging.jsonl else None
        self.run: Any = None
        if not active:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.jsonl is not None:
            self._truncate_after(resume_step)
        self.pending: list[tuple[int, dict[str, Any]]] = []  # steps no checkpoint covers yet
        mode = wandb_mode(cfg.logging.wandb)
        if mode != "disabled":
            import wandb  # lazy: heavy (wandb), optional

            id_file = run_dir / "wandb_id.txt"
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
            self.run = wandb.init(
                project=cfg.logging.project,
                name=cfg.logging.run_name or run_dir.name,
                id=run_id,
                resume="allow",
                mode=mode,  # type: ignore[arg-type]
                dir=str(run_dir),
                config=to_dict(cfg),
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            )
            if resume_step:
                self._replay(run_dir, run_id, mode, resume_step)

    def _truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint (they are about to be redone)."""
        assert self.jsonl is not None
        if not self.jsonl.exists():
            return
        keep = [
            line
            for line in self.jsonl.read_text().splitlines()
            if line and json.loads(line)["step"] <= step
        ]
        atomic_write_local(self.jsonl, "".join(line + "\n" for line in keep).encode())

    def _replay(self, run_dir: Path, run_id: str, mode: str, resume_step: int) -> None:
        """Hand W&B the steps up to the checkpoint it may not hold (see the module docstring)."""
        first = 1
        if mode == "offline":
            current = Path(self.run.dir).parent.resolve()
            superseded = run_dir / "wandb" / "superseded"
            for old in (run_dir / "wandb").glob(f"offline-run-*-{run_id}"):
                if old.resolve() != current:
                    superseded.mkdir(parents=True, exist_ok=True)
                    old.rename(superseded / old.name)
        else:
            first = int(self.run.step)  # the server's next step
        if self.jsonl is None or not self.jsonl.exists():
            return
        for line in self.jsonl.read_text().splitlines():
            record = json.loads(line) if line else {}
            step = record.pop("step", None)
            if step is not None and first <= step <= resume_step:
                self.run.log(_scalars(record), step=step)

    def log(self, step: int, metrics: dict[str, Any], media: dict[str, Any] | None = None) -> None:
        """``metrics`` go to metrics.jsonl and W&B (lists, such as the eval's loss by
        position, to metrics.jsonl only); ``media`` (W&B objects: charts, audio, video)
        to W&B only."""
        if not self.active:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in metrics.items()
        }
        if self.jsonl is not None:
            with self.jsonl.open("a") as f:
                f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.run is not None:
            self.pending.append((step, {**_scalars(metrics), **(media or {})}))

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` is on disk: W&B may now have the steps up to it."""
        if self.run is None:
            return
        for s, metrics in self.pending:
            if s <= step:
                self.run.log(metrics, step=s)
        self.pending = [(s, m) for s, m in self.pending if s > step]

    def finish(self) -> str | None:
        if self.run is None:
            return None
        for s, metrics in self.pending:  # the run ended normally: nothing will be redone
            self.run.log(metrics, step=s)
        self.pending = []
        directory = str(Path(self.run.dir).parent)
        self.run.finish()
        return directory
