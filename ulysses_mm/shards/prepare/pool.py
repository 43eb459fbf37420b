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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.core import storage
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.shards.prepare import staged
from ulysses_mm.shards.prepare.route import Outcome, Task, commit, skipped
from ulysses_mm.tokenize import registry
from ulysses_mm.tokenize.base import DecodeError, TokenBlock, Tokenizer, TokenizerSpec

CRASHED = "the worker process died while decoding this file (crash or out of memory)"


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker process is started with (picklable)."""

    spec_paths: list[str]
    kinds: dict[str, str]  # extra tokenizer kinds, kind -> "module:Class"
    space: dict[str, Any]  # TokenSpace.to_dict()
    store: storage.Location  # the output; its storage options reach the inputs too
    parent_pid: int


@dataclass
class Loaded:
    """A process's specs, token space and tokenizers for a run, each tokenizer loaded on
    first use: a DNA-only worker never imports video."""

    specs: list[TokenizerSpec]
    space: TokenSpace
    tokenizers: dict[str, Tokenizer] = field(default_factory=dict)

    def tokenizer(self, modality: str) -> Tokenizer:
        if modality not in self.tokenizers:
            spec = next(s for s in self.specs if s.modality == modality)
            self.tokenizers[modality] = registry.load_tokenizer(spec)
        return self.tokenizers[modality]


_loaded: dict[str, Loaded] = {}


def loaded(config: WorkerConfig) -> Loaded:
    """This process's :class:`Loaded` for ``config``: its extra kinds registered and its
    specs read once per process, whichever engine runs in it."""
    key = repr((config.spec_paths, sorted(config.kinds.items()), config.space))
    if key not in _loaded:
        for kind, target in config.kinds.items():
            registry.register_kind(kind, target)
        specs = [TokenizerSpec.load(p) for p in config.spec_paths]
        _loaded[key] = Loaded(specs, TokenSpace.from_dict(config.space))
    return _loaded[key]


# What this pool process was started with, set by _init (a pool's initializer is the only
# hook a spawned process gets; the main process never sets it).
_config: WorkerConfig | None = None


def _watch_parent(ppid: int) -> None:
    # A SIGKILLed parent cannot stop its pool; do not outlive it.
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(1)


def _init(config: WorkerConfig) -> None:
    global _config
    threading.Thread(target=_watch_parent, args=(config.parent_pid,), daemon=True).start()
    _config = config
    loaded(config)


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


def _blocks(tok: Tokenizer, path: str, space: TokenSpace) -> Iterator[TokenBlock]:
    """A non-streaming tokenizer's documents, each checked, one block each."""
    for doc in tok.encode_file(path, space):
        try:
            tokens = check_document(doc.tokens, doc.modality, space)
        except ValueError as e:
            raise DecodeError(
                f"tokenizer {tok.spec.name!r} produced an invalid document {doc.key!r}: {e}"
            ) from e
        yield TokenBlock(
            tokens,
            np.array([len(tokens)], np.int64),
            np.array([space.index(doc.modality)], np.int64),
        )


def tokenize_input(
    task: Task, tok: Tokenizer, space: TokenSpace, store: storage.Location
) -> Outcome:
    """Tokenize one input into its staged entry, committed for the process that packs it
    and for later runs; its outcome. ``store``: a location whose storage options reach
    the input."""
    outcome, _ = _tokenize(task, tok, space, store, staged.StagedWriter(task.staged, space))
    if outcome.reusable:  # the outcome commits the entry: written after the documents
        commit(task.staged, outcome)
    return outcome


def tokenize_held(
    task: Task, tok: Tokenizer, space: TokenSpace, store: storage.Location, hold: int
) -> tuple[Outcome, staged.StagedWriter | None]:
    """Tokenize one input for this process to pack: its outcome and its entry, held in
    memory up to ``hold`` bytes (then in a local file), never committed."""
    writer = staged.StagedWriter(task.staged, space, hold=hold)
    return _tokenize(task, tok, space, store, writer)


def _tokenize(
    task: Task,
    tok: Tokenizer,
    space: TokenSpace,
    store: storage.Location,
    writer: staged.StagedWriter,
) -> tuple[Outcome, staged.StagedWriter | None]:
    """The input's outcome, and ``writer`` holding its documents when it is ok. A streaming
    tokenizer reads the input where it is (a bucket's object included); any other gets a
    local file (a remote input is copied for it, then removed)."""
    fetched: Path | None = None
    source = store.at(task.source)
    try:
        if tok.streams:
            with source.open_input() as f:
                for block in tok.encode_stream(f, task.source, space):
                    writer.add(block)
        else:
            local = source.fetch(Path(task.fetch_dir))
            fetched = None if source.is_local else local
            for block in _blocks(tok, str(local), space):
                writer.add(block)
        if not writer.documents:
            raise DecodeError("no documents (empty input)")
        writer.commit()
    except DecodeError as e:
        writer.abort()
        reason = one_line(str(e)) or type(e).__name__
        return skipped(task.source, reason, modality=task.modality), None
    except Exception as e:  # a tokenizer that broke the contract; keep going, say so
        writer.abort()
        return skipped(
            task.source,
            f"unexpected {type(e).__name__}: {one_line(str(e))}",
            modality=task.modality,
            reusable=False,  # may be transient (network, memory): retried by the next run
        ), None
    except BaseException:
        writer.abort()
        raise
    finally:
        if fetched is not None:
            fetched.unlink(missing_ok=True)
    # a tokenizer of records (text's .jsonl lines) may count those it skipped
    outcome = Outcome(
        task.source,
        "ok",
        modality=task.modality,
        documents=writer.documents,
        tokens=writer.tokens,
        skipped_records=tok.skipped_records,
        skip_reason=one_line(tok.first_skip_reason),
    )
    return outcome, writer


def tokenize(task: Task) -> Outcome:
    """Tokenize one input in a worker process started by :func:`run_pool`."""
    config = _config
    assert config is not None, "tokenize runs in a worker process started by run_pool"
    w = loaded(config)
    try:
        tok = w.tokenizer(task.modality)
    except Exception as e:
        return skipped(
            task.source,
            f"unexpected {type(e).__name__}: {one_line(str(e))}",
            modality=task.modality,
            reusable=False,
        )
    return tokenize_input(task, tok, w.space, config.store)


def run_pool(
    tasks: Iterable[Task], workers: int, config: WorkerConfig, window: int = 0
) -> Iterator[tuple[Task, Outcome]]:
    """Each task with its outcome, as they finish, with at most ``window`` (default 4 per
    worker) submitted and unfinished at a time, so a long input list is never all in
    flight. If a worker process dies, the unfinished tasks are rerun one per fresh
    process so the one that kills its process is found and recorded, and every other
    input still gets done (the rest in a fresh pool)."""
    ctx = multiprocessing.get_context("spawn")
    window = window or 4 * workers
    pending = iter(tasks)
    exhausted = False
    while not exhausted:
        retry: list[Task] = []
        with cf.ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=_init, initargs=(config,)
        ) as pool:
            futures: dict[cf.Future[Outcome], Task] = {}
            broken = False
            while True:
                while not broken and len(futures) < window:
                    task = next(pending, None)
                    if task is None:
                        exhausted = True
                        break
                    futures[pool.submit(tokenize, task)] = task
                if not futures:
                    break
                done, _ = cf.wait(futures, return_when=cf.FIRST_COMPLETED)
                for fut in sorted(done, key=lambda f: futures[f].index):
                    task = futures.pop(fut)
                    try:
                        outcome = fut.result()
                    except cf.process.BrokenProcessPool:
                        retry.append(task)
                        broken = True
                        continue
                    yield task, outcome
        for task in sorted(retry, key=lambda t: t.index):
            yield task, _alone(task, config, ctx)


def _alone(task: Task, config: WorkerConfig, ctx: Any) -> Outcome:
    """Tokenize ``task`` in a process of its own: its outcome, or that it killed it."""
    try:
        with cf.ProcessPoolExecutor(
            max_workers=1, mp_context=ctx, initializer=_init, initargs=(config,)
        ) as pool:
            return pool.submit(tokenize, task).result()
    except cf.process.BrokenProcessPool:
        return skipped(
            task.source,
            CRASHED,
            modality=task.modality,
            reusable=False,
            crashed=True,
        )
