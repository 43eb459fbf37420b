"""Saving without stopping: a checkpoint is copied to host memory while the step loop
waits, then written (and, for a remote ``train.checkpoint_dir``, uploaded) in the
background; ``latest`` moves only once every rank's files are complete.

DeepSpeed writes its files through a pluggable ``CheckpointEngine``;
:class:`SnapshotEngine` is one whose ``save`` hands each file to the :class:`Saver`, which
copies the state into one host buffer (:func:`~ulysses_mm.train.serialize.pack`: the live
tensors change at the next step) and queues the file on the rank's :class:`Writer` thread;
with ``train.save_writer=process`` a writer process serializes them
(:mod:`~ulysses_mm.train.serialize`), so ``torch.save`` does not hold the training
process's GIL. DeepSpeed's own asynchronous
engines are not used: its ``DecoupledCheckpointEngine`` writes from a subprocess through
the FastCheckpointEngine's async-io op (libaio), and DataStates is a separate package that
is not on PyPI.

The ranks learn that every rank's files are done from the flags they already all-reduce at
each step boundary (:func:`~ulysses_mm.train.stop.agree`), so completing a checkpoint costs
no collective of its own and no rank ever waits for another's disk. A write that fails
fails the run with one line naming the checkpoint; a write still running after
``train.save_timeout_s`` does too (a stalled file system or object store).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from ulysses_mm.core.errors import StorageError, first_line
from ulysses_mm.core.storage import atomic_write_local
from ulysses_mm.core.tokenspace import SPACE_FILE, TokenSpace
from ulysses_mm.train import checkpoint, serialize
from ulysses_mm.train.checkpoint import CONFIG_FILE, MODEL_FILE, TOKENIZERS_FILE, CheckpointDir
from ulysses_mm.train.engine import safe_engine_class
from ulysses_mm.train.serialize import WriterProcess


class Writer:
    """Runs write jobs in order on one daemon thread (or at once, when not asynchronous).
    :meth:`done` and :meth:`wait` raise the first job's error, as one line naming what it
    wrote."""

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self._jobs: queue.SimpleQueue[tuple[str, Callable[[], None]] | None] = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def put(self, what: str, job: Callable[[], None]) -> None:
        if not self.asynchronous:
            self._run(what, job)
            self._raise()
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work, name="checkpoint-writer", daemon=True
            )
            self._thread.start()
        with self._lock:
            self._pending += 1
        self._jobs.put((what, job))

    def _run(self, what: str, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # reaches the step loop at its next look
            with self._lock:
                if self._error is None:
                    self._error = StorageError(f"{what}: {first_line(e)}")

    def _work(self) -> None:
        # below training on shared cores (Linux applies it to this thread alone)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), serialize.WRITER_NICE)
        while (item := self._jobs.get()) is not None:
            self._run(*item)
            with self._lock:
                self._pending -= 1
                self._idle.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        """Whether every job put so far has finished (raises a job's error)."""
        self._raise()
        with self._lock:
            return self._pending == 0

    def wait(self, timeout_s: float, what: str) -> None:
        """Block until every job has finished; a :class:`StorageError` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageError(
                        f"{what} is still being written after {timeout_s:.0f} s "
                        "(train.save_timeout_s): is the file system or object store stalled?"
                    )
                self._idle.wait(min(left, 1.0))
        self._raise()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)


def snapshot_engine_class():
    """DeepSpeed's checkpoint engine interface whose ``save`` hands each file to the
    :class:`Saver` (loading stays the safe ``weights_only`` reader)."""
    base = safe_engine_class()

    class SnapshotEngine(base):  # type: ignore[misc, valid-type]
        def __init__(self, config_params: Any, saver: Saver) -> None:
            super().__init__(config_params)
            self.saver = saver
            self.written: list[Path] = []  # this rank's files of the checkpoint being saved

        def create(self, info: Any) -> None:
            self.written = []

        def save(self, state_dict: Any, path: str) -> None:
            self.written.append(Path(path))
            self.saver.queue("torch", state_dict, Path(path))

        def commit(self, info: Any) -> bool:
            return True

        def preserves_storage_sharing(self) -> bool:
            # synchronous: DeepSpeed clones the state before save (what it always does);
            # in the background the saver copies it into one buffer itself, once
            return not self.saver.writer.asynchronous

    return SnapshotEngine


@dataclass
class Pending:
    """A checkpoint whose files are being written: committed once every rank's are."""

    step: int
    tag: str
    started: float
    blocked_s: float = 0.0


class Saver:
    """One rank's side of saving: :meth:`start` (blocking only for the copy), then
    :meth:`local_done` at each step boundary, :meth:`commit` once every rank is done."""

    def __init__(self, engine, ckpt: CheckpointDir, staging: Path, cfg_train: Any) -> None:
        self.engine = engine
        self.ckpt = ckpt
        self.staging = staging if not ckpt.is_local else ckpt.local_path
        self.keep = cfg_train.keep_checkpoints
        self.timeout_s = cfg_train.save_timeout_s
        self.writer = Writer(cfg_train.async_save)
        self.writer_setting = cfg_train.save_writer
        self.process: WriterProcess | None = None
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.pin = torch.cuda.is_available() and next(engine.module.parameters()).is_cuda
        engine.checkpoint_engine = snapshot_engine_class()(engine._config, self)
        self.pending: Pending | None = None
        self.saves: list[tuple[float, float]] = []  # (blocking s, written s) of each save

    def start(
        self,
        step: int,
        client_state: dict[str, Any],
        config: dict[str, Any],
        space: TokenSpace,
        tokenizers: dict[str, Any] | None,
    ) -> Pending:
        """Copy this step's state and queue its files. Collective (DeepSpeed's barriers;
        ZeRO-3 gathers the weights)."""
        assert self.pending is None, "a save is in flight: finish it first"
        t0 = time.perf_counter()
        tag = checkpoint.tag_for(step)
        if self.rank0:
            self.staging.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(
            str(self.staging),
            tag=tag,
            client_state={"step": step, **client_state},
            save_latest=False,
        )
        files = list(self.engine.checkpoint_engine.written)
        weights = checkpoint.consolidated_state_dict(self.engine)
        path = self.staging / tag
        if self.rank0:
            assert weights is not None
            texts = {
                CONFIG_FILE: yaml.safe_dump(config, sort_keys=False),
                SPACE_FILE: json.dumps(space.to_dict(), indent=1) + "\n",
                checkpoint.RESUME_FILE: json.dumps(client_state.get("resume", {}), indent=1) + "\n",
            }
            if tokenizers is not None:
                texts[TOKENIZERS_FILE] = json.dumps(tokenizers, indent=1) + "\n"
            self.queue("safetensors", weights, path / MODEL_FILE, {"step": str(step)})

            def write_texts() -> None:
                for name, text in texts.items():
                    atomic_write_local(path / name, text.encode())

            self.writer.put(str(path), write_texts)
            files += [path / MODEL_FILE, *(path / name for name in texts)]
        if not self.ckpt.is_local:
            self.writer.put(str(self.ckpt.url_of(tag)), lambda: self._upload(tag, files))
        self.pending = Pending(step, tag, t0, blocked_s=time.perf_counter() - t0)
        return self.pending

    def queue(self, fmt: str, obj: Any, path: Path, metadata: dict[str, str] | None = None) -> None:
        """Write ``obj`` to ``path``: at once, or (asynchronous) after copying it into one
        host buffer, on the writer process or thread (``train.save_writer``)."""
        if not self.writer.asynchronous:
            self.writer.put(str(path), lambda: serialize.write(fmt, obj, path, metadata, False))
            return
        if self.writer_setting == "process":
            size = serialize.nbytes(obj)
            if not serialize.shm_fits(size):
                raise StorageError(
                    f"train.save_writer=process: {path.name} needs {2 * size:,} bytes free in "
                    "/dev/shm, which has less; set train.save_writer=thread"
                )
            copy = serialize.pack(obj, shared=True)
            if self.process is None:
                self.process = serialize.WriterProcess()
            proc = self.process
            self.writer.put(str(path), lambda: proc.write(fmt, copy, path, metadata))
        else:
            copy = serialize.pack(obj, pin=self.pin)
            self.writer.put(str(path), lambda: serialize.write(fmt, copy, path, metadata))

    def _upload(self, tag: str, files: list[Path]) -> None:
        for f in files:
            self.ckpt.upload(tag, f)
        for f in files:
            f.unlink(missing_ok=True)

    def local_done(self) -> bool:
        """Whether this rank has nothing in flight (raises a failed write's error)."""
        if self.pending is None:
            return True
        if time.perf_counter() - self.pending.started > self.timeout_s and not self.writer.done():
            self.writer.wait(0.0, self.describe())
        return self.writer.done()

    def describe(self) -> str:
        assert self.pending is not None
        return f"checkpoint {self.ckpt.url_of(self.pending.tag)}"

    def wait(self) -> None:
        """Block until this rank's files of the pending checkpoint are written."""
        if self.pending is None:
            return
        left = self.timeout_s - (time.perf_counter() - self.pending.started)
        self.writer.wait(max(left, 0.0), self.describe())

    def commit(self) -> Pending | None:
        """Every rank's files are complete (the caller knows it from the agreement): rank 0
        moves ``latest`` to the pending checkpoint and prunes old ones."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if self.rank0:
            try:
                self.ckpt.set_latest(pending.tag)
                self.ckpt.prune(self.keep)
            except Exception as e:  # a storage failure is the checkpoint's one line
                raise StorageError(
                    f"checkpoint {self.ckpt.url_of(pending.tag)}: {first_line(e)}"
                ) from None
            if not self.ckpt.is_local:
                shutil.rmtree(self.staging / pending.tag, ignore_errors=True)
        written = time.perf_counter() - pending.started
        self.saves.append((pending.blocked_s, written))
        return pending

    def close(self) -> None:
        self.writer.close()
        if self.process is not None:
            self.process.close()
            self.process = None
