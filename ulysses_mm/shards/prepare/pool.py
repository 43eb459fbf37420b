"""The tokenizing pool of ``prepare``: spawned worker processes, one input per task.

A worker turns an input into token documents with the pipeline's tokenizer for it,
validates them and writes its staged entry (:mod:`ulysses_mm.shards.prepare.route`); what became of
the input travels back as an :class:`~ulysses_mm.shards.prepare.route.Outcome`. An input that
cannot be decoded is recorded with its one-line reason. A worker process that dies (a
decoder crash, the OOM killer) costs only the input it was decoding: :func:`run_pool`
reruns the unfinished tasks one per fresh process to find it.

Spawned workers import this module and :mod:`~ulysses_mm.shards.prepare.route` only, so neither
torch nor webdataset (packing and shard writing) is loaded in them; a tokenizer's own
imports (biopython, PyAV, decord) happen on its first use.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.core import storage
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.shards.prepare.route import Outcome, Task, commit, skipped, write_documents
from ulysses_mm.tokenize import registry
from ulysses_mm.tokenize.base import DecodeError, Tokenizer, TokenizerSpec


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker process is started with (picklable)."""

    spec_paths: list[str]
    kinds: dict[str, str]  # extra tokenizer kinds, kind -> "module:Class"
    space: dict[str, Any]  # TokenSpace.to_dict()
    storage_options: dict[str, Any]
    parent_pid: int


@dataclass
class _Worker:
    """This process's tokenizers, loaded on first use: a DNA-only worker never imports video."""

    specs: dict[str, TokenizerSpec]
    space: TokenSpace
    storage_options: dict[str, Any]
    tokenizers: dict[str, Tokenizer] = field(default_factory=dict)

    def tokenizer(self, modality: str) -> Tokenizer:
        if modality not in self.tokenizers:
            self.tokenizers[modality] = registry.load_tokenizer(self.specs[modality])
        return self.tokenizers[modality]


# The one worker of this process, set by _init (a pool's initializer is the only hook a
# spawned process gets; the main process never sets it).
_worker: _Worker | None = None


def _watch_parent(ppid: int) -> None:
    # A SIGKILLed parent cannot stop its pool; do not outlive it.
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(1)


def _init(config: WorkerConfig) -> None:
    global _worker
    threading.Thread(target=_watch_parent, args=(config.parent_pid,), daemon=True).start()
    for kind, target in config.kinds.items():
        registry.register_kind(kind, target)
    specs = {s.modality: s for s in (TokenizerSpec.load(p) for p in config.spec_paths)}
    _worker = _Worker(specs, TokenSpace.from_dict(config.space), config.storage_options)


def one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def check_document(tokens: Any, modality: str, space: TokenSpace) -> np.ndarray:
    """A document's tokens as the token-space dtype, or ValueError saying what is wrong."""
    t = np.asarray(tokens)
    if t.ndim != 1 or t.dtype.kind not in "iu":
        raise ValueError(f"tokens must be a 1-D integer array, got {t.dtype} {t.shape}")
    if len(t) < 2 or t[0] != DOC_START or t[-1] != DOC_END:
        raise ValueError("tokens must run from <doc> to </doc>")
    if int(t.min()) < 0 or int(t.max()) >= space.vocab_size:
        raise ValueError(
            f"ids {int(t.min())}..{int(t.max())} fall outside the token space 0..{space.vocab_size - 1}"
        )
    if (t[1:-1] <= DOC_END).any():
        raise ValueError("<pad>, <doc> or </doc> inside the document")
    if modality not in space.modalities:
        raise ValueError(
            f"modality {modality!r} is not in the token space {list(space.modalities)}"
        )
    return t.astype(space.dtype(), copy=False)


def tokenize(task: Task) -> Outcome:
    """Tokenize one input into its staged entry (in a worker process); its outcome."""
    w = _worker
    assert w is not None, "tokenize runs in a worker process started by run_pool"
    space = w.space
    docs: list[np.ndarray] = []
    mods: list[int] = []
    fetched: Path | None = None
    try:
        tok = w.tokenizer(task.modality)
        local = storage.fetch(task.source, Path(task.fetch_dir), w.storage_options)
        fetched = None if storage.is_local(task.source) else local
        for doc in tok.encode_file(str(local), space):
            try:
                docs.append(check_document(doc.tokens, doc.modality, space))
            except ValueError as e:
                raise DecodeError(
                    f"tokenizer {tok.spec.name!r} produced an invalid document {doc.key!r}: {e}"
                ) from e
            mods.append(space.index(doc.modality))
        if not docs:
            raise DecodeError("no documents (empty input)")
    except DecodeError as e:
        outcome = skipped(task.source, one_line(str(e)) or type(e).__name__, modality=task.modality)
    except Exception as e:  # a tokenizer that broke the contract; keep going, say so
        outcome = skipped(
            task.source,
            f"unexpected {type(e).__name__}: {one_line(str(e))}",
            modality=task.modality,
            reusable=False,  # may be transient (network, memory): retried by the next run
        )
    else:
        tokens = np.concatenate(docs)
        # a tokenizer of records (text's .jsonl lines) may count those it skipped
        outcome = Outcome(
            task.source,
            "ok",
            modality=task.modality,
            documents=len(docs),
            tokens=len(tokens),
            skipped_records=int(getattr(tok, "skipped_records", 0) or 0),
            skip_reason=one_line(str(getattr(tok, "first_skip_reason", "") or "")),
        )
        write_documents(
            task.staged,
            tokens,
            np.array([len(d) for d in docs], np.int64),
            np.array(mods, np.int64),
        )
    finally:
        if fetched is not None:
            fetched.unlink(missing_ok=True)
    if outcome.reusable:  # the outcome commits the entry: written after the documents
        commit(task.staged, outcome)
    return outcome


def run_pool(
    tasks: list[Task], workers: int, config: WorkerConfig
) -> Iterator[tuple[Task, Outcome]]:
    """Each task with its outcome, as they finish. If a worker process dies, the
    unfinished tasks are rerun one per fresh process so the one that kills its process is
    found and recorded, and every other input still gets done."""
    ctx = multiprocessing.get_context("spawn")
    retry: list[Task] = []
    with cf.ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=_init, initargs=(config,)
    ) as pool:
        futures = {pool.submit(tokenize, t): t for t in tasks}
        for fut in cf.as_completed(futures):
            try:
                yield futures[fut], fut.result()
            except cf.process.BrokenProcessPool:
                retry.append(futures[fut])
    for task in sorted(retry, key=lambda t: t.index):
        try:
            with cf.ProcessPoolExecutor(
                max_workers=1, mp_context=ctx, initializer=_init, initargs=(config,)
            ) as pool:
                yield task, pool.submit(tokenize, task).result()
        except cf.process.BrokenProcessPool:
            yield (
                task,
                skipped(
                    task.source,
                    "the worker process died while decoding this file (crash or out of memory)",
                    modality=task.modality,
                    reusable=False,
                    crashed=True,
                ),
            )
