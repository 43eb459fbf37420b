"""``ulysses-mm prepare``: raw files to packed WebDataset shards and a manifest, restartably.

Two phases, chosen so that a run killed at any instant (SIGKILL included) and started
again ends with exactly the bytes of an uninterrupted run:

1. **Tokenize** (a pool of spawned worker processes, :mod:`ulysses_mm.shards.prepare.pool`).
   Each input is routed by its file name to one of the pipeline's tokenizers and turned
   into token documents, which are validated and written, atomically, to a staged entry in
   the staging directory (:mod:`ulysses_mm.shards.prepare.route`). A rerun finds finished entries
   and does not tokenize those inputs again. An input that cannot be decoded is recorded
   with its one-line reason and skipped.
2. **Pack and write** (this process, overlapping phase 1, :mod:`ulysses_mm.shards.prepare.assemble`).
   Inputs are taken in sorted order and their documents in file order, whatever order the
   workers finish in, so packing, document ids, shard boundaries and bytes are a function
   of the inputs and the config alone. Shards appear under their final names only when
   complete (:mod:`ulysses_mm.shards.prepare.publish`); ``manifest.json`` is written last. The
   staging directory is removed at the end unless ``keep_staging``.

A run in which no input gives a document writes nothing and leaves nothing behind: the
output directories it created and its staging directory are removed, and the error says
why each input failed, in one line.

Paths: relative paths written in a pipeline file resolve against the file's directory
(so ``pipelines/dna.yaml`` works from any working directory); relative paths given as
``key=value`` overrides on the command line resolve against the current directory.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

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
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.shards.manifest import InputEntry, Manifest, ShardEntry
from ulysses_mm.shards.prepare.assemble import Assembler, InOrder
from ulysses_mm.shards.prepare.pool import WorkerConfig, run_pool
from ulysses_mm.shards.prepare.publish import Output
from ulysses_mm.shards.prepare.route import (
    Plan,
    PrepareError,
    Result,
    load_specs,
    plan_inputs,
    staging_dir,
)
from ulysses_mm.shards.writer import ShardRecord, ShardWriter
from ulysses_mm.tokenize.base import TokenizerSpec, spec_table

__all__ = ["PrepareError", "PrepareResult", "load_pipeline_config", "prepare", "print_summary"]

# Config keys holding paths, resolved against the pipeline file's directory (file values)
# or the working directory (command-line values). URLs are left alone.
_PATH_KEYS = ("sources", "tokenizers", "output", "staging")
# Config keys that say where and how a run happened, not what it produced: left out of
# the manifest so equal data give equal manifest bytes (storage options may hold secrets).
_RUN_ONLY_KEYS = ("output", "staging", "keep_staging", "workers", "progress", "storage_options")


# ------------------------------------------------------------------------ config


def _resolve_path(value: str, base: Path) -> str:
    if not value or storage.is_url(value):
        return value
    p = Path(os.path.expanduser(value))
    return os.path.normpath(p if p.is_absolute() else (base / p))


def _resolve_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    out = dict(data)
    for key in _PATH_KEYS:
        value = out.get(key)
        if isinstance(value, str):
            out[key] = _resolve_path(value, base)
        elif isinstance(value, list):
            out[key] = [_resolve_path(v, base) if isinstance(v, str) else v for v in value]
    return out


def load_pipeline_config(
    path: str | Path | None, overrides: Sequence[str] = (), cwd: Path | None = None
) -> PipelineConfig:
    """defaults < the pipeline file (paths relative to it) < overrides (paths relative to
    ``cwd``, default the working directory)."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _resolve_paths(read_yaml(path), Path(path).resolve().parent)
    data = deep_merge(
        data, _resolve_paths(parse_overrides(overrides), (cwd or Path.cwd()).resolve())
    )
    try:
        return from_dict(PipelineConfig, data)
    except ConfigError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{e}") from None


# ------------------------------------------------------------------------ the run


@dataclass
class PrepareResult:
    manifest: Manifest
    location: str  # of manifest.json
    reused: int  # inputs taken from the staging directory
    seconds: float
    crashed: list[str] = field(default_factory=list)  # inputs whose worker process died


def prepare(cfg: PipelineConfig, out: TextIO | None = None) -> PrepareResult:
    """Run a pipeline; returns the manifest written. Raises PrepareError when no dataset
    can be made (every input failed, no inputs matched, a bad spec)."""
    out = out or sys.stdout
    t0 = time.perf_counter()
    so = dict(cfg.storage_options)
    specs, space = load_specs(cfg)
    staging = staging_dir(cfg)
    # the directories this run creates, so that a run that writes nothing removes them
    new_dirs = [storage.missing_dirs(str(staging)), storage.missing_dirs(cfg.output, so)]
    files, unmatched = storage.expand_sources(cfg.sources, so)
    plan = plan_inputs(cfg, files, specs, space, staging)

    output = Output(cfg, staging)
    writer = ShardWriter(
        output.write_dir, output.publish, cfg.shards.max_bytes, cfg.shards.max_samples
    )
    assembler = Assembler(space, cfg.pack.seq_len, writer)
    crashed: list[str] = []
    bar = tqdm(
        total=len(files), unit="file", desc="prepare", disable=not cfg.progress, file=sys.stderr
    )
    try:
        for done in _in_input_order(plan, _worker_config(cfg, specs, space), cfg.workers):
            assembler.add(done)
            if done.outcome.crashed:
                crashed.append(done.outcome.source)
            bar.update(1)
            rate = assembler.tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(
                tokens=_human(assembler.tokens),
                tok_s=_human(rate),
                samples=assembler.packer.next_sample,
            )
        assert len(assembler.entries) == len(files)
        entries = assembler.entries + [
            InputEntry(p, "skipped", reason="matches no file") for p in unmatched
        ]
        if not assembler.any_ok:  # nothing to write: leave nothing behind
            writer.abort()
            _remove_traces(cfg, staging, new_dirs)
            raise PrepareError(_nothing_written(entries))
        records = assembler.finish()
    except BaseException:
        writer.abort()
        bar.close()
        raise
    bar.close()
    output.remove_stale_shards(len(records))
    manifest = _manifest(cfg, specs, space, assembler, records, entries)
    manifest.save(output.manifest_url, so)
    if not cfg.keep_staging:
        shutil.rmtree(staging, ignore_errors=True)
    result = PrepareResult(
        manifest, output.manifest_url, plan.reused, time.perf_counter() - t0, crashed
    )
    print_summary(result, out)
    return result


def _manifest(
    cfg: PipelineConfig,
    specs: list[TokenizerSpec],
    space: TokenSpace,
    assembler: Assembler,
    records: list[ShardRecord],
    entries: list[InputEntry],
) -> Manifest:
    counts = assembler.counts
    return Manifest(
        name=cfg.name,
        token_space=space,
        tokenizers=dict(spec_table(specs)),
        seq_len=cfg.pack.seq_len,
        shards=[ShardEntry(r.name, r.samples, r.first_sample, r.bytes, r.sha256) for r in records],
        inputs=entries,
        num_documents=assembler.packer.next_doc,
        tokens={m: int(c) for m, c in zip(space.modalities, counts)},
        pad_tokens=assembler.packer.next_sample * cfg.pack.seq_len - int(counts.sum()),
        config=_recorded_config(cfg),
        modality_runs=assembler.modality_runs,
    )


def _worker_config(
    cfg: PipelineConfig, specs: list[TokenizerSpec], space: TokenSpace
) -> WorkerConfig:
    return WorkerConfig(
        [s.path for s in specs],
        dict(cfg.tokenizer_kinds),
        space.to_dict(),
        dict(cfg.storage_options),
        os.getpid(),
    )


def _in_input_order(plan: Plan, config: WorkerConfig, workers: int) -> Iterator[Result]:
    """Every input's result in input order: the known ones first, the others as the
    workers finish them."""
    order: InOrder[Result] = InOrder()
    yield from order.put_all(plan.known.items())
    if plan.tasks:
        n = min(workers or os.cpu_count() or 1, len(plan.tasks))
        for task, outcome in run_pool(plan.tasks, n, config):
            yield from order.put(task.index, Result(outcome, task.staged))


def _remove_traces(cfg: PipelineConfig, staging: Path, new_dirs: list[list[str]]) -> None:
    """After a run that wrote nothing: its staging directory (unless ``keep_staging``) and
    the directories it created, where they are empty."""
    if not cfg.keep_staging:
        shutil.rmtree(staging, ignore_errors=True)
    for dirs in new_dirs:  # each deepest first: stop at the first one still in use
        for d in dirs:
            if not storage.remove_empty_dir(d, cfg.storage_options):
                break


def _nothing_written(entries: list[InputEntry]) -> str:
    """One line: why no dataset was written."""
    if not entries:
        return "no input files"
    reasons = "; ".join(f"{Path(e.source).name}: {e.reason}" for e in entries[:5])
    more = f" (and {len(entries) - 5} more)" if len(entries) > 5 else ""
    return f"every input failed ({len(entries)} inputs), no dataset written: {reasons}{more}"


def _recorded_config(cfg: PipelineConfig) -> dict[str, Any]:
    data = to_dict(cfg)
    for key in _RUN_ONLY_KEYS:
        data.pop(key, None)
    return data


def _human(n: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


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
    print(
        f"  {result.seconds:.1f} s, {_human(real / max(result.seconds, 1e-9))} tokens/s",
        file=out,
    )
    for e in skipped:
        print(f"  skipped {e.source}: {e.reason}", file=out)
