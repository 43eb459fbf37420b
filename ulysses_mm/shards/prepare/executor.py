"""What runs a pipeline's partitions: this machine's process pool, or Ray.

Both executors do the same three things to a partition, with the same functions, so the
bytes do not depend on the executor or on how many workers it has:

1. :func:`~ulysses_mm.shards.prepare.partition.completed`: an earlier run finished it
   (fragment and shards checked): take that;
2. :mod:`~ulysses_mm.shards.prepare.pool`'s tokenizing of each input not already staged
   into a staged entry (committed in the partition's staging directory for another
   process to pack; held in memory, spilling to a local file, for this one);
3. :func:`~ulysses_mm.shards.prepare.assemble.write_partition`: pack its inputs in input
   order into its shards and fragment.

:func:`run_partition` is the three in one process: a Ray task runs it. :class:`LocalExecutor`
tokenizes with a pool of worker processes, ahead of and across partitions, while this
process packs the partitions one after the other, as they become ready.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from ulysses_mm.core.errors import first_line
from ulysses_mm.shards.prepare.assemble import InOrder, write_partition
from ulysses_mm.shards.prepare.partition import Job, PartitionResult, PartitionTask, completed
from ulysses_mm.shards.prepare.pool import CRASHED, Loaded, loaded, run_pool, tokenize_held
from ulysses_mm.shards.prepare.route import (
    Plan,
    PrepareError,
    Result,
    Task,
    partition_staging,
    plan_inputs,
    skipped,
)


class PartitionError(PrepareError):
    """A partition failed for a reason that is not one of its inputs (the output cannot be
    written, a bug): the run stops; the message names the partition, one line. Exit 1, as
    for a failed worker rank: its traceback is in a log file."""

    exit_code = 1


def partition_failed(
    task: PartitionTask, error: str, log_dir: Path, details: str
) -> PartitionError:
    """The error for a failed partition, its traceback (``details``) kept in a log file."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"partition-{task.index:05d}.log"
    log.write_text(details)
    return PartitionError(f"{task.describe()} failed: {error} (traceback in {log})")


class Progress:
    """The run's progress bar on the driver (tqdm, stderr): inputs done of all, tokens,
    tokens/s, partitions done."""

    def __init__(self, inputs: int, partitions: int, enabled: bool) -> None:
        self.t0 = time.perf_counter()
        self.partitions = partitions
        self.parts_done = 0
        self.tokens = 0
        self.bar = tqdm(
            total=inputs, unit="file", desc="prepare", disable=not enabled, file=sys.stderr
        )

    def inputs_done(self, n: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.update(n)
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix(
            tokens=human(self.tokens),
            tok_s=human(rate),
            parts=f"{self.parts_done}/{self.partitions}",
        )

    def partition_done(self, result: PartitionResult, inputs_counted: bool) -> None:
        self.parts_done += 1
        self.inputs_done(
            0 if inputs_counted else len(result.entries), 0 if inputs_counted else result.tokens
        )

    def close(self, keep: bool = True) -> None:
        """End the bar; ``keep=False`` (the run failed) erases it, so the error line that
        follows stands alone."""
        self.bar.leave = keep
        self.bar.close()


def human(n: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


class Executor(Protocol):
    name: str

    def run(
        self, job: Job, tasks: Sequence[PartitionTask], progress: Progress
    ) -> list[PartitionResult]:
        """Every partition's result, in partition order."""
        ...


# ------------------------------------------------------------------ one process


def plan_partition(job: Job, task: PartitionTask, ctx: Loaded) -> Plan:
    return plan_inputs(
        task.inputs,
        task.first_input,
        ctx.specs,
        ctx.space,
        job.suffixes,
        partition_staging(job.staging, task.index),
    )


# A Ray task packs what it tokenized itself: an input's documents wait in memory up to this
# many bytes, then in a local file, never committed (the task's unit of resume is the
# partition's fragment).
HOLD_BYTES = 64 << 20
# An input its worker process died on this many times (a decoder crash, the OOM killer) is
# skipped as the local pool skips one that kills a process of its own.
CRASHES_TO_SKIP = 2


def run_partition(job: Job, task: PartitionTask) -> PartitionResult:
    """The whole partition in this process: taken from an earlier run if that finished
    it, else its inputs tokenized one after the other and packed into its shards.

    Before an input is tokenized, a count of attempts at it is left in the staging
    directory and removed after: when the executor runs the partition again because its
    process died, an input found with :data:`CRASHES_TO_SKIP` attempts is the one that
    killed it (twice, so a worker killed from outside costs nothing) and is recorded as
    skipped; its partition then finishes."""
    done = completed(job, task)
    if done is not None:
        return done
    ctx = loaded(job.worker)
    plan = plan_partition(job, task, ctx)
    tasks = {t.index: t for t in plan.tasks}

    def results() -> Iterator[Result]:
        for i in range(task.first_input, task.first_input + len(task.inputs)):
            if i in plan.known:
                yield plan.known[i]
                continue
            t = tasks[i]
            try:
                tok = ctx.tokenizer(t.modality)
            except Exception as e:  # cannot happen for specs the driver loaded; say so
                raise RuntimeError(f"tokenizer for {t.modality}: {e}") from e
            mark = Path(t.staged + ".attempts")  # survives this process, not a success
            attempts = int(mark.read_text() or 0) if mark.exists() else 0
            if attempts >= CRASHES_TO_SKIP:
                outcome = skipped(
                    t.source, CRASHED, modality=t.modality, reusable=False, crashed=True
                )
                held = None
            else:
                mark.write_text(str(attempts + 1))
                store = job.worker.store
                outcome, held = tokenize_held(t, tok, ctx.space, store, HOLD_BYTES)
            mark.unlink(missing_ok=True)
            yield Result(outcome, t.staged, held=held)

    result = write_partition(job, task, ctx.space, results())
    if not job.keep_staging:
        shutil.rmtree(partition_staging(job.staging, task.index), ignore_errors=True)
    return result


# ------------------------------------------------------------------ the local pool


class LocalExecutor:
    """Partitions on this machine: ``workers`` processes tokenize inputs (across
    partitions, a bounded number ahead), this process packs each partition in turn."""

    name = "local"

    def __init__(self, workers: int) -> None:
        self.workers = workers or os.cpu_count() or 1

    def run(
        self, job: Job, tasks: Sequence[PartitionTask], progress: Progress
    ) -> list[PartitionResult]:
        ctx = loaded(job.worker)
        results: dict[int, PartitionResult] = {}
        todo: list[tuple[PartitionTask, Plan]] = []
        for t in tasks:
            done = completed(job, t)
            if done is not None:
                results[t.index] = done
                progress.partition_done(done, inputs_counted=False)
            else:
                todo.append((t, plan_partition(job, t, ctx)))
        stream = self._tokenized(job, todo)
        log_dir = Path(job.staging) / "logs"

        def counted(done: Result) -> None:
            progress.inputs_done(1, done.outcome.tokens if done.outcome.ok else 0)

        for t, _ in todo:
            mine = (next(stream) for _ in range(len(t.inputs)))
            try:
                results[t.index] = write_partition(job, t, ctx.space, mine, counted)
            except PrepareError:
                raise
            except Exception as e:
                raise partition_failed(t, first_line(e), log_dir, traceback.format_exc()) from e
            progress.partition_done(results[t.index], inputs_counted=True)
            if not job.keep_staging:
                shutil.rmtree(partition_staging(job.staging, t.index), ignore_errors=True)
        return [results[t.index] for t in tasks]

    def _tokenized(self, job: Job, todo: list[tuple[PartitionTask, Plan]]) -> Iterator[Result]:
        """Every input's result of the partitions to do, in their input order: the known
        ones as they come, the others as the pool finishes them."""
        order: InOrder[Result] = InOrder()
        position: dict[int, int] = {}  # input index -> place in this stream
        known: list[tuple[int, Result]] = []
        work: list[Task] = []
        for t, plan in todo:
            for i in range(t.first_input, t.first_input + len(t.inputs)):
                position[i] = len(position)
                if i in plan.known:
                    known.append((position[i], plan.known[i]))
            work += plan.tasks
        yield from order.put_all(known)
        if work:
            n = min(self.workers, len(work))
            for task, outcome in run_pool(work, n, job.worker):
                yield from order.put(position[task.index], Result(outcome, task.staged))
