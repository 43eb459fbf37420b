"""``ulysses-mm prepare``: raw files to packed WebDataset shards and a manifest, restartably,
on this machine or on a Ray cluster.

The sorted inputs are cut into partitions (:mod:`ulysses_mm.shards.prepare.partition`, a
function of the inputs' sizes alone), and an executor (:mod:`ulysses_mm.shards.prepare.executor`:
this machine's process pool, or Ray's tasks) does each partition:

1. **Tokenize**. Each input is routed by its file name to one of the pipeline's
   tokenizers and turned into token documents, which are checked and written, as they
   stream out of the tokenizer, to a staged entry in the staging directory
   (:mod:`ulysses_mm.shards.prepare.staged`). A rerun finds finished entries and does not
   tokenize those inputs again. An input that cannot be decoded is recorded with its
   one-line reason and skipped.
2. **Pack and write** (:mod:`ulysses_mm.shards.prepare.assemble`). The partition's inputs
   are taken in sorted order and their documents in file order, whatever order the workers
   finish in, so packing, document ids, shard boundaries and bytes are a function of the
   inputs and the config alone, on any executor with any number of workers. Shards appear
   under their final names only when complete (:mod:`ulysses_mm.shards.prepare.publish`);
   the partition's fragment is written last, so a killed run, started again, skips the
   partitions it finished.

``manifest.json`` is written last, from every partition's result; the staging directory
is removed at the end unless ``keep_staging``.

A run in which no input gives a document writes nothing and leaves nothing behind: the
output directories it created and its staging directory are removed, and the error says
why each input failed, in one line.

Paths: relative paths written in a pipeline file resolve against the file's directory
(so ``pipelines/dna.yaml`` works from any working directory); relative paths given as
``key=value`` overrides on the command line resolve against the current directory. A
shipped pipeline given by name (``prepare dna``) reads its inputs from the wheel or the
clone and writes (``output``, ``staging``) under the working directory, as if it were the
clone's root: ``../build/shards/dna`` is ``./build/shards/dna``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ulysses_mm.config import (
    ConfigError,
    PipelineConfig,
    deep_merge,
    from_dict,
    parse_overrides,
    read_yaml,
    to_dict,
)
from ulysses_mm.core import storage
from ulysses_mm.core.resources import shipped_tokenizer
from ulysses_mm.core.shipped import find, named
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.shards.manifest import (
    MANIFEST_NAME,
    InputEntry,
    Manifest,
    PartitionEntry,
    ShardEntry,
)
from ulysses_mm.shards.prepare.executor import Executor, LocalExecutor, Progress, human
from ulysses_mm.shards.prepare.partition import (
    Job,
    PartitionResult,
    PartitionTask,
    partition_inputs,
    remove_fragments,
)
from ulysses_mm.shards.prepare.pool import WorkerConfig
from ulysses_mm.shards.prepare.publish import remove_stale_shards
from ulysses_mm.shards.prepare.ray_executor import RayExecutor, check_ready
from ulysses_mm.shards.prepare.route import PrepareError, load_specs, staging_dir
from ulysses_mm.tokenize.base import TokenizerSpec, spec_table

__all__ = ["PrepareError", "PrepareResult", "load_pipeline_config", "prepare", "print_summary"]

# Config keys holding paths, resolved against the pipeline file's directory (file values)
# or the working directory (command-line values). URLs are left alone.
_PATH_KEYS = ("sources", "tokenizers", "output", "staging")
_WRITTEN_KEYS = ("output", "staging")
# Config keys that say where and how a run happened, not what it produced: left out of
# the manifest so equal data give equal manifest bytes (storage options may hold secrets).
_RUN_ONLY_KEYS = (
    "output",
    "staging",
    "keep_staging",
    "workers",
    "progress",
    "storage_options",
    "engine",
    "ray_address",
)
_PARTITION_KEYS = ("partition_bytes", "partitions")


# ------------------------------------------------------------------------ config


def _resolve_path(value: str, base: Path) -> str:
    if not value or storage.is_url(value):
        return value
    p = Path(os.path.expanduser(value))
    return os.path.normpath(p if p.is_absolute() else (base / p))


def _resolve_spec(value: str, base: Path) -> str:
    """A tokenizer spec path, or the shipped spec a bare NAME / NAME.json means when no such
    file is at ``base`` (``tokenizers=[dna-base]``)."""
    path = _resolve_path(value, base)
    if storage.is_url(path) or Path(path).exists():
        return path
    shipped = shipped_tokenizer(value)
    return str(shipped) if shipped is not None else path


def _resolve_paths(
    data: dict[str, Any], base: Path, written_base: Path | None = None
) -> dict[str, Any]:
    out = dict(data)
    for key in _PATH_KEYS:
        resolve = _resolve_spec if key == "tokenizers" else _resolve_path
        at = written_base if written_base is not None and key in _WRITTEN_KEYS else base
        value = out.get(key)
        if isinstance(value, str):
            out[key] = resolve(value, at)
        elif isinstance(value, list):
            out[key] = [resolve(v, at) if isinstance(v, str) else v for v in value]
    return out


def load_pipeline_config(
    path: str | Path | None, overrides: Sequence[str] = (), cwd: Path | None = None
) -> PipelineConfig:
    """defaults < the pipeline file (paths relative to it; a bare name is the shipped
    pipeline) < overrides (paths relative to ``cwd``, default the working directory)."""
    data: dict[str, Any] = {}
    here = (cwd or Path.cwd()).resolve()
    if path is not None:
        file = find("pipelines", path)
        parent = file.resolve().parent
        # a shipped pipeline named writes under here, as if here were a clone's root
        written = here / parent.name if named("pipelines", path) is not None else None
        data = _resolve_paths(read_yaml(file), parent, written)
    data = deep_merge(data, _resolve_paths(parse_overrides(overrides), here))
    try:
        return from_dict(PipelineConfig, data)
    except ConfigError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{e}") from None


# ------------------------------------------------------------------------ the run


@dataclass(kw_only=True)
class PrepareResult:
    manifest: Manifest
    location: str  # of manifest.json
    reused: int  # inputs taken from the staging directory
    seconds: float
    crashed: list[str] = field(default_factory=list)  # inputs whose worker process died
    executor: str = "local"
    partitions: int = 1
    resumed: int = 0  # partitions an earlier run had finished


def prepare(cfg: PipelineConfig, out: TextIO | None = None) -> PrepareResult:
    """Run a pipeline; returns the manifest written. Raises PrepareError when no dataset
    can be made (every input failed, no inputs matched, a bad spec, a partition failed)."""
    out = out or sys.stdout
    t0 = time.perf_counter()
    dest = cfg.output_location
    specs, space = load_specs(cfg)
    staging = staging_dir(cfg)
    # the directories this run creates, so that a run that writes nothing removes them
    new_dirs = [storage.Location(str(staging)).missing_dirs(), dest.missing_dirs()]
    inputs, unmatched = storage.list_inputs(dest.at(s) for s in cfg.sources)
    ranges = partition_inputs(
        [f.size for f in inputs], cfg.shards.partition_bytes, cfg.shards.partitions
    )
    job = Job(
        worker=_worker_config(cfg, specs, space),
        suffixes={k: list(v) for k, v in cfg.suffixes.items()},
        output=dest,
        staging=str(staging),
        seq_len=cfg.pack.seq_len,
        max_bytes=cfg.shards.max_bytes,
        max_samples=cfg.shards.max_samples,
        multi=len(ranges) > 1,
        keep_staging=cfg.keep_staging,
        data_key=_data_key(cfg, specs, space),
    )
    tasks = [PartitionTask(p, a, inputs[a:b]) for p, (a, b) in enumerate(ranges)]
    unmatched_entries = [InputEntry(p, "skipped", reason="matches no file") for p in unmatched]
    if not inputs:  # before any folder or bar
        raise PrepareError(_nothing_written(unmatched_entries))
    executor = _executor(cfg)  # one that cannot start fails here, before anything is written
    dest.makedirs()
    dest.remove_stale_temps()
    staging.mkdir(parents=True, exist_ok=True)
    progress = Progress(len(inputs), len(tasks), cfg.progress)
    try:
        results = executor.run(job, tasks, progress) if tasks else []
    except BaseException:
        progress.close(keep=False)
        raise
    entries = [e for r in results for e in r.entries] + unmatched_entries
    written = any(e.status == "ok" for e in entries)
    progress.close(keep=written)
    if not written:  # nothing to write: leave nothing behind
        _remove_traces(cfg, staging, new_dirs)
        raise PrepareError(_nothing_written(entries))
    manifest = _manifest(cfg, specs, space, tasks, results, entries)
    remove_stale_shards(dest, {s.url for s in manifest.shards})
    where = dest.join(MANIFEST_NAME)
    manifest.save(where)
    remove_fragments(dest)
    if not cfg.keep_staging:
        shutil.rmtree(staging, ignore_errors=True)
    result = PrepareResult(
        manifest=manifest,
        location=where.url,
        reused=sum(r.reused_inputs for r in results),
        seconds=time.perf_counter() - t0,
        crashed=[c for r in results for c in r.crashed],
        executor=executor.name,
        partitions=len(tasks),
        resumed=sum(r.resumed for r in results),
    )
    print_summary(result, out)
    return result


def _executor(cfg: PipelineConfig) -> Executor:
    if cfg.engine == "ray":
        check_ready(cfg.ray_address)
        return RayExecutor(cfg.ray_address, cfg.workers)
    return LocalExecutor(cfg.workers)


def _manifest(
    cfg: PipelineConfig,
    specs: list[TokenizerSpec],
    space: TokenSpace,
    tasks: list[PartitionTask],
    results: list[PartitionResult],
    entries: list[InputEntry],
) -> Manifest:
    """The dataset's manifest from its partitions' results: their samples and documents
    numbered on across partitions."""
    multi = len(results) > 1
    shards: list[ShardEntry] = []
    parts: list[PartitionEntry] = []
    spans: list[tuple[str, int]] = []
    pairs: list[int] | None = []
    counts = [0] * len(space.modalities)
    first_sample = first_doc = 0
    for task, r in zip(tasks, results):
        for rec in r.shards:
            shards.append(
                ShardEntry(
                    url=rec.name,
                    samples=rec.samples,
                    first_sample=first_sample + rec.first_sample,
                    bytes=rec.bytes,
                    sha256=rec.sha256,
                    partition=r.index if multi else None,
                )
            )
        for e in r.entries:
            if e.status == "ok":
                e.first_doc_id += first_doc
        part_spans = [(space.modalities[m], t) for m, t in r.spans]
        parts.append(
            PartitionEntry(
                first_input=task.first_input,
                inputs=len(task.inputs),
                input_bytes=task.bytes,
                first_sample=first_sample,
                samples=r.samples,
                first_doc_id=first_doc,
                documents=r.documents,
                runs=len(part_spans),
            )
        )
        spans += part_spans
        pairs = pairs + r.pairs if pairs is not None and r.pairs is not None else None
        counts = [a + b for a, b in zip(counts, r.counts)]
        first_sample += r.samples
        first_doc += r.documents
    return Manifest(
        name=cfg.name,
        token_space=space,
        tokenizers=dict(spec_table(specs)),
        seq_len=cfg.pack.seq_len,
        shards=shards,
        inputs=entries,
        num_documents=first_doc,
        tokens={m: int(c) for m, c in zip(space.modalities, counts)},
        pad_tokens=first_sample * cfg.pack.seq_len - sum(counts),
        config=_recorded_config(cfg, multi),
        modality_runs=spans,
        partitions=parts if multi else None,
        sample_pairs=pairs,
    )


def _worker_config(
    cfg: PipelineConfig, specs: list[TokenizerSpec], space: TokenSpace
) -> WorkerConfig:
    return WorkerConfig(
        [s.path for s in specs],
        dict(cfg.tokenizer_kinds),
        space.to_dict(),
        cfg.output_location,
        os.getpid(),
    )


def _data_key(cfg: PipelineConfig, specs: list[TokenizerSpec], space: TokenSpace) -> str:
    """Identifies what shapes the data: the recorded config, the token space, the specs."""
    ident = {
        "config": _recorded_config(cfg, multi=True),
        "space": space.to_dict(),
        "specs": [[s.sha256, s.artifact_sha256] for s in specs],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def _remove_traces(cfg: PipelineConfig, staging: Path, new_dirs: list[list[str]]) -> None:
    """After a run that wrote nothing: its fragments and empty partition folders, its
    staging directory (unless ``keep_staging``) and the directories it created, where they
    are empty."""
    remove_fragments(cfg.output_location)
    remove_stale_shards(cfg.output_location, ())
    if not cfg.keep_staging:
        shutil.rmtree(staging, ignore_errors=True)
    for dirs in new_dirs:  # each deepest first: stop at the first one still in use
        for d in dirs:
            if not cfg.output_location.at(d).remove_empty_dir():
                break


def _nothing_written(entries: list[InputEntry]) -> str:
    """One line: why no dataset was written."""
    if not entries:
        return "no input files"
    reasons = "; ".join(f"{Path(e.source).name}: {e.reason}" for e in entries[:5])
    more = f" (and {len(entries) - 5} more)" if len(entries) > 5 else ""
    return f"every input failed ({len(entries)} inputs), no dataset written: {reasons}{more}"


def _recorded_config(cfg: PipelineConfig, multi: bool) -> dict[str, Any]:
    """The config that shaped the data. How the inputs were partitioned is part of it only
    when there are several partitions: the bytes of a dataset of one are the same whatever
    setting made it one."""
    data = to_dict(cfg)
    for key in _RUN_ONLY_KEYS:
        data.pop(key, None)
    if not multi:
        for key in _PARTITION_KEYS:
            data["shards"].pop(key, None)
    return data


def print_summary(result: PrepareResult, out: TextIO) -> None:
    m = result.manifest
    ok = sum(1 for e in m.inputs if e.status == "ok")
    skipped = m.skipped
    real = sum(m.tokens.values())
    size = sum(s.bytes for s in m.shards)
    print(
        f"prepared {m.name or 'dataset'}: {len(m.inputs)} inputs ({ok} ok, {len(skipped)} skipped, "
        f"{result.reused} reused from staging), {m.num_documents} documents",
        file=out,
    )
    per_mod = ", ".join(f"{k} {v:,}" for k, v in m.tokens.items())
    print(f"  tokens: {per_mod}; pad {m.pad_tokens:,}", file=out)
    print(
        f"  {m.num_samples} samples × {m.seq_len:,} tokens in {len(m.shards)} shards "
        f"({size / 2**20:.1f} MiB) -> {result.location}",
        file=out,
    )
    parts = f"{result.partitions} partition{'s' * (result.partitions != 1)}"
    if result.resumed:
        parts += f" ({result.resumed} finished by an earlier run)"
    print(
        f"  {result.seconds:.1f} s, {human(real / max(result.seconds, 1e-9))} tokens/s; "
        f"{parts} on the {result.executor} executor",
        file=out,
    )
    for e in skipped:
        print(f"  skipped {e.source}: {e.reason}", file=out)
