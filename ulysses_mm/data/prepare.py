"""``ulysses-mm prepare``: raw files to packed WebDataset shards and a manifest, restartably.

Two phases, chosen so that a run killed at any instant (SIGKILL included) and started
again ends with exactly the bytes of an uninterrupted run:

1. **Tokenize** (a pool of spawned worker processes). Each input is routed by its file
   suffix to one of the pipeline's tokenizers and turned into token documents, which are
   validated and written, atomically, to a cache file in the staging directory named by
   a hash of (input path, size, mtime or ETag, tokenizer spec and artifact hashes, token
   space). A rerun finds finished entries and does not tokenize those inputs again. An
   input that cannot be decoded is recorded with its one-line reason and skipped.
2. **Pack and write** (this process, overlapping phase 1). Inputs are taken in sorted
   order and their documents in file order, whatever order the workers finish in, so
   packing, document ids, shard boundaries and bytes are a function of the inputs and
   the config alone. Shards appear under their final names only when complete (see
   :mod:`ulysses_mm.storage`); ``manifest.json`` is written last. A previous
   dataset's manifest is removed just before its first shard is replaced, so a manifest
   never describes shards it does not match. The staging directory is removed at the end
   unless ``keep_staging``.

Paths: relative paths written in a pipeline file resolve against the file's directory
(so ``pipelines/dna.yaml`` works from any working directory); relative paths given as
``key=value`` overrides on the command line resolve against the current directory.

This module is imported by every worker process; it keeps torch and webdataset (pulled
in by packing and shard writing) out of the workers by importing them where used.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from ulysses_mm import storage
from ulysses_mm.config import (
    ConfigError,
    PipelineConfig,
    deep_merge,
    from_dict,
    parse_overrides,
    read_yaml,
    to_dict,
)
from ulysses_mm.data.manifest import MANIFEST_NAME, InputEntry, Manifest, ShardEntry
from ulysses_mm.modalities import registry
from ulysses_mm.modalities.base import (
    DecodeError,
    Tokenizer,
    TokenizerSpec,
    build_token_space,
    spec_table,
)
from ulysses_mm.tokenspace import DOC_END, DOC_START, TokenSpace

if TYPE_CHECKING:
    from ulysses_mm.data.shards import ShardRecord

CACHE_VERSION = 1

# File suffixes per modality (lower case; ".gz" variants added for DNA). A file goes to
# the first modality, in the order of cfg.suffixes then this table, that lists a suffix it
# ends with AND has a tokenizer in the pipeline: a video container goes to the video
# tokenizer when there is one, else to the audio tokenizer (its sound track).
_DNA = [".fa", ".fasta", ".fna", ".ffn", ".frn", ".fas", ".fastq", ".fq", ".gb", ".gbk", ".gbff"]
DEFAULT_SUFFIXES: dict[str, list[str]] = {
    "dna": _DNA + [s + ".gz" for s in _DNA],
    "video": [".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v"],
    "audio": [".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".aac"]
    + [".mp4", ".webm", ".mkv", ".mov", ".m4v"],
}

# Config keys holding paths, resolved against the pipeline file's directory (file values)
# or the working directory (command-line values). URLs are left alone.
_PATH_KEYS = ("sources", "tokenizers", "output", "staging")
# Config keys that say where and how a run happened, not what it produced: left out of
# the manifest so equal data give equal manifest bytes (storage options may hold secrets).
_RUN_ONLY_KEYS = ("output", "staging", "keep_staging", "workers", "progress", "storage_options")


class PrepareError(RuntimeError):
    """The run cannot produce a dataset (every input failed, no inputs, bad spec ...)."""


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


def route(source: str, modalities: Sequence[str], extra: Mapping[str, Sequence[str]]) -> str | None:
    """The modality whose tokenizer reads ``source``, by file suffix (None: unsupported)."""
    name = source.rstrip("/").rsplit("/", 1)[-1].lower()
    for table in (extra, DEFAULT_SUFFIXES):
        for modality, suffixes in table.items():
            if modality in modalities and any(name.endswith(s.lower()) for s in suffixes):
                return modality
    return None


# ---------------------------------------------------------------- worker process
# State of a worker process, set by _worker_init.
_W: dict[str, Any] = {}


@dataclass(frozen=True)
class _Task:
    index: int  # position in the sorted input list
    source: str
    modality: str
    cache: str  # cache path stem: STEM.npz (documents) and STEM.json (result)
    fetch_dir: str  # where a remote input is copied for decoding


def _watch_parent(ppid: int) -> None:
    # A SIGKILLed parent cannot stop its pool; do not outlive it.
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(1)


def _worker_init(
    spec_paths: list[str],
    kinds: dict[str, str],
    space: dict[str, Any],
    storage_options: dict[str, Any],
    ppid: int,
) -> None:
    threading.Thread(target=_watch_parent, args=(ppid,), daemon=True).start()
    for kind, target in kinds.items():
        registry.register_kind(kind, target)
    specs = {s.modality: s for s in (TokenizerSpec.load(p) for p in spec_paths)}
    _W.update(
        specs=specs,
        tokenizers={},
        space=TokenSpace.from_dict(space),
        storage_options=storage_options,
    )


def _tokenizer(modality: str) -> Tokenizer:
    cache: dict[str, Tokenizer] = _W["tokenizers"]
    if modality not in cache:  # loaded on first use: a DNA-only worker never imports video
        cache[modality] = registry.load_tokenizer(_W["specs"][modality])
    return cache[modality]


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _check_document(tokens: Any, modality: str, space: TokenSpace) -> np.ndarray:
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


def _tokenize(task: _Task) -> dict[str, Any]:
    """Tokenize one input into its cache entry; returns the entry's result record."""
    space: TokenSpace = _W["space"]
    result: dict[str, Any] = {"source": task.source, "modality": task.modality}
    docs: list[np.ndarray] = []
    mods: list[int] = []
    cacheable = True
    fetched: Path | None = None
    try:
        tok = _tokenizer(task.modality)
        local = storage.fetch(task.source, Path(task.fetch_dir), _W["storage_options"])
        fetched = None if storage.is_local(task.source) else local
        for doc in tok.encode_file(str(local), space):
            try:
                docs.append(_check_document(doc.tokens, doc.modality, space))
            except ValueError as e:
                raise DecodeError(
                    f"tokenizer {tok.spec.name!r} produced an invalid document {doc.key!r}: {e}"
                ) from e
            mods.append(space.index(doc.modality))
        if not docs:
            raise DecodeError("no documents (empty input)")
    except DecodeError as e:
        docs, mods = [], []
        result.update(status="skipped", reason=_one_line(str(e)) or type(e).__name__)
    except Exception as e:  # a tokenizer that broke the contract; keep going, say so
        docs, mods = [], []
        cacheable = False  # may be transient (network, memory): retried by the next run
        result.update(
            status="skipped", reason=f"unexpected {type(e).__name__}: {_one_line(str(e))}"
        )
    finally:
        if fetched is not None:
            fetched.unlink(missing_ok=True)
    if docs:
        tokens = np.concatenate(docs)
        result.update(status="ok", documents=len(docs), tokens=len(tokens))
        _write_npz(
            Path(task.cache + ".npz"),
            tokens=tokens,
            lengths=np.array([len(d) for d in docs], np.int64),
            modalities=np.array(mods, np.int64),
        )
    result["cacheable"] = cacheable
    if cacheable:  # the .json is the entry's commit mark: written after the .npz
        storage.atomic_write_local(Path(task.cache + ".json"), json.dumps(result).encode())
    result["index"] = task.index
    return result


def _write_npz(path: Path, **arrays: np.ndarray) -> None:
    with storage.atomic_local_file(path) as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]


def _load_block(stem: str, n_docs: int, where: str) -> Any:
    from ulysses_mm.data.packing import DocumentBlock

    with np.load(stem + ".npz", allow_pickle=False) as z:
        block = DocumentBlock(z["tokens"], z["lengths"], z["modalities"])
    if len(block.lengths) != n_docs:
        raise PrepareError(
            f"cache entry of {where} holds {len(block.lengths)} documents, expected {n_docs}"
        )
    return block


# ------------------------------------------------------------------- main process


@dataclass
class PrepareResult:
    manifest: Manifest
    location: str  # of manifest.json
    reused: int  # inputs taken from the staging cache
    seconds: float
    crashed: list[str] = field(default_factory=list)  # inputs whose worker process died


def _cache_key(
    source: str, modality: str, spec: TokenizerSpec, space: TokenSpace, so: Mapping[str, Any]
) -> str:
    ident = {
        "v": CACHE_VERSION,
        "source": source,
        "input": storage.input_identity(source, so),
        "modality": modality,
        "spec": [spec.sha256, spec.artifact_sha256],
        "space": space.to_dict(),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:40]


def _staging_dir(cfg: PipelineConfig) -> Path:
    if cfg.staging:
        return Path(cfg.staging)
    if storage.is_local(cfg.output):
        return Path(str(storage.local_path(cfg.output)).rstrip("/") + ".staging")
    digest = hashlib.sha256(cfg.output.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"ulysses-mm-staging-{digest}"


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


def _run_pool(
    tasks: list[_Task], workers: int, initargs: tuple[Any, ...]
) -> Iterator[dict[str, Any]]:
    """Results of ``tasks`` as they finish. If a worker process dies (a decoder crash,
    the OOM killer), the unfinished tasks are rerun one per fresh process so the one that
    kills its process is found and recorded, and every other input still gets done."""
    ctx = multiprocessing.get_context("spawn")
    retry: list[_Task] = []
    with cf.ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=_worker_init, initargs=initargs
    ) as pool:
        futures = {pool.submit(_tokenize, t): t for t in tasks}
        for fut in cf.as_completed(futures):
            try:
                yield fut.result()
            except cf.process.BrokenProcessPool:
                retry.append(futures[fut])
    for task in sorted(retry, key=lambda t: t.index):
        try:
            with cf.ProcessPoolExecutor(
                max_workers=1, mp_context=ctx, initializer=_worker_init, initargs=initargs
            ) as pool:
                yield pool.submit(_tokenize, task).result()
        except cf.process.BrokenProcessPool:
            yield {
                "index": task.index,
                "source": task.source,
                "modality": task.modality,
                "status": "skipped",
                "reason": "the worker process died while decoding this file (crash or out of memory)",
                "cacheable": False,
                "crashed": True,
            }


_SHARD_RE = re.compile(r"^shard-(\d{6})\.tar$")


class _Output:
    """Where finished shards and the manifest go (a local directory or a URL)."""

    def __init__(self, cfg: PipelineConfig, staging: Path) -> None:
        self.url = cfg.output
        self.so = dict(cfg.storage_options)
        self.local = storage.is_local(cfg.output)
        storage.makedirs(self.url, self.so)
        # shards are written where they can be published atomically: in the output
        # directory itself (rename) or a local upload area (upload, then move)
        self.write_dir = storage.local_path(self.url) if self.local else staging / "upload"
        self.write_dir.mkdir(parents=True, exist_ok=True)
        storage.remove_stale_temps(self.url, self.so)
        if not self.local:
            for p in self.write_dir.iterdir():
                p.unlink()
        self.claimed = False
        self.manifest_url = storage.join(self.url, MANIFEST_NAME)

    def publish(self, tmp: Path, record: ShardRecord) -> None:
        if not self.claimed:  # the old manifest must go before its first shard changes
            storage.remove(self.manifest_url, self.so)
            self.claimed = True
        storage.publish_file(tmp, storage.join(self.url, record.name), self.so)

    def remove_stale_shards(self, keep: int) -> None:
        for name in storage.list_names(self.url, self.so):
            m = _SHARD_RE.match(name)
            if m and int(m.group(1)) >= keep:
                storage.remove(storage.join(self.url, name), self.so)


def _load_specs(cfg: PipelineConfig) -> tuple[list[TokenizerSpec], TokenSpace]:
    """The pipeline's tokenizer specs (each checked to load) and their token space."""
    if not cfg.output:
        raise PrepareError("no output: set output=DIR_OR_URL")
    if not cfg.sources:
        raise PrepareError("no sources: set sources=[PATH_OR_GLOB, ...]")
    if not cfg.tokenizers:
        raise PrepareError("no tokenizers: set tokenizers=[tokenizers/NAME.json, ...]")
    for kind, target in cfg.tokenizer_kinds.items():
        registry.register_kind(kind, target)
    specs = []
    for p in cfg.tokenizers:
        try:
            spec = TokenizerSpec.load(p)
        except (OSError, ValueError) as e:
            raise PrepareError(f"tokenizer spec {p}: {e}") from e
        if spec.kind not in registry.kinds():
            raise PrepareError(
                f"tokenizer spec {p}: unknown kind {spec.kind!r}; known: {registry.kinds()}"
            )
        try:  # fail here, once, rather than once per input in the workers
            registry.load_tokenizer(spec)
        except Exception as e:
            raise PrepareError(f"tokenizer spec {p}: cannot load: {type(e).__name__}: {e}") from e
        specs.append(spec)
    try:
        space = build_token_space(specs)
    except ValueError as e:
        raise PrepareError(str(e)) from e
    unknown = set(cfg.suffixes) - set(space.modalities)
    if unknown:
        raise PrepareError(
            f"suffixes names modalities {sorted(unknown)} without a tokenizer "
            f"(have {list(space.modalities)})"
        )
    return specs, space


def _plan(
    cfg: PipelineConfig,
    files: list[str],
    specs: list[TokenizerSpec],
    space: TokenSpace,
    staging: Path,
) -> tuple[dict[int, dict[str, Any]], list[_Task]]:
    """Route every input; (results known already — unsupported or cached — by input
    index, tasks for the workers)."""
    by_modality = {s.modality: s for s in specs}
    cache_dir = staging / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    storage.remove_stale_temps(str(cache_dir))
    results: dict[int, dict[str, Any]] = {}
    tasks: list[_Task] = []
    for i, source in enumerate(files):
        modality = route(source, list(by_modality), cfg.suffixes)
        if modality is None:
            suffix = Path(source.rsplit("/", 1)[-1]).suffix or "(none)"
            results[i] = {
                "source": source,
                "status": "skipped",
                "reason": f"unsupported file type {suffix}: no tokenizer for it in this pipeline "
                f"(modalities {list(by_modality)})",
            }
            continue
        try:
            key = _cache_key(source, modality, by_modality[modality], space, cfg.storage_options)
        except OSError as e:
            results[i] = {"source": source, "status": "skipped", "reason": f"cannot stat: {e}"}
            continue
        stem = str(cache_dir / key)
        if os.path.exists(stem + ".json"):
            done = json.loads(Path(stem + ".json").read_text())
            if done.get("status") != "ok" or os.path.exists(stem + ".npz"):
                results[i] = {**done, "cached": True, "cache": stem}
                continue
        tasks.append(_Task(i, source, modality, stem, str(staging / "fetch" / key)))
    return results, tasks


def prepare(cfg: PipelineConfig, out: TextIO | None = None) -> PrepareResult:
    """Run a pipeline; returns the manifest written. Raises PrepareError when no dataset
    can be made (every input failed, no inputs matched, a bad spec)."""
    from tqdm import tqdm

    from ulysses_mm.data.packing import Packer
    from ulysses_mm.data.shards import ShardWriter

    out = out or sys.stdout
    t0 = time.perf_counter()
    so = dict(cfg.storage_options)
    specs, space = _load_specs(cfg)
    staging = _staging_dir(cfg)
    files, unmatched = storage.expand_sources(cfg.sources, so)
    results, tasks = _plan(cfg, files, specs, space, staging)
    n_inputs = len(files)
    reused = sum(1 for r in results.values() if r.get("cached"))

    # ---- run: tokenize in workers, pack and write here in input order
    output = _Output(cfg, staging)
    packer = Packer(cfg.pack.seq_len, space.dtype())
    writer = ShardWriter(
        output.write_dir, output.publish, cfg.shards.max_bytes, cfg.shards.max_samples
    )
    entries: list[InputEntry] = []
    crashed: list[str] = []
    total_tokens = 0
    bar = tqdm(
        total=n_inputs, unit="file", desc="prepare", disable=not cfg.progress, file=sys.stderr
    )
    next_index = 0
    counts = np.zeros(len(space.modalities), dtype=np.int64)  # real tokens per modality

    def write_samples(samples: Iterator[Any]) -> None:
        for sample in samples:
            seg = sample.segments
            np.add.at(counts, seg[:, 2], seg[:, 1])
            writer.write(sample)

    def drain() -> None:
        nonlocal next_index, total_tokens
        while next_index in results:
            r = results[next_index]
            if r["status"] == "ok":
                block = _load_block(r["cache"], r["documents"], r["source"])
                entries.append(
                    InputEntry(
                        r["source"],
                        "ok",
                        modality=r["modality"],
                        documents=r["documents"],
                        tokens=r["tokens"],
                        first_doc_id=packer.next_doc,
                    )
                )
                write_samples(packer.add(block))
                total_tokens += r["tokens"]
            else:
                entries.append(InputEntry(r["source"], "skipped", reason=r["reason"]))
            next_index += 1
            bar.update(1)
            rate = total_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(
                tokens=_human(total_tokens), tok_s=_human(rate), samples=packer.next_sample
            )

    cache_of = {t.index: t.cache for t in tasks}
    try:
        drain()
        if tasks:
            workers = min(cfg.workers or os.cpu_count() or 1, len(tasks))
            initargs = (
                [s.path for s in specs],
                dict(cfg.tokenizer_kinds),
                space.to_dict(),
                so,
                os.getpid(),
            )
            for r in _run_pool(tasks, workers, initargs):
                if r.get("crashed"):
                    crashed.append(r["source"])
                results[r["index"]] = {**r, "cache": cache_of[r["index"]]}
                drain()
        assert next_index == n_inputs
        ok = [e for e in entries if e.status == "ok"]
        if not ok:
            writer.abort()
            entries += [InputEntry(p, "skipped", reason="matches no file") for p in unmatched]
            reasons = "; ".join(f"{Path(e.source).name}: {e.reason}" for e in entries[:5])
            more = f" (and {len(entries) - 5} more)" if len(entries) > 5 else ""
            raise PrepareError(
                f"every input failed ({len(entries)} inputs), no dataset written: {reasons}{more}"
                if entries
                else "no input files"
            )
        write_samples(packer.finish())
        records = writer.close()
    except BaseException:
        writer.abort()
        bar.close()
        raise
    bar.close()
    entries += [InputEntry(p, "skipped", reason="matches no file") for p in unmatched]
    output.remove_stale_shards(len(records))
    num_samples = packer.next_sample
    manifest = Manifest(
        name=cfg.name,
        token_space=space,
        tokenizers=dict(spec_table(specs)),
        seq_len=cfg.pack.seq_len,
        shards=[ShardEntry(r.name, r.samples, r.first_sample, r.bytes, r.sha256) for r in records],
        inputs=entries,
        num_documents=packer.next_doc,
        tokens={m: int(c) for m, c in zip(space.modalities, counts)},
        pad_tokens=num_samples * cfg.pack.seq_len - int(counts.sum()),
        config=_recorded_config(cfg),
    )
    manifest.save(output.manifest_url, so)
    if not cfg.keep_staging:
        shutil.rmtree(staging, ignore_errors=True)
    result = PrepareResult(manifest, output.manifest_url, reused, time.perf_counter() - t0, crashed)
    print_summary(result, out)
    return result


def print_summary(result: PrepareResult, out: TextIO) -> None:
    m = result.manifest
    ok = sum(1 for e in m.inputs if e.status == "ok")
    skipped = m.skipped
    real = sum(m.tokens.values())
    size = sum(s.bytes for s in m.shards)
    print(
        f"prepared {m.name or 'dataset'}: {len(m.inputs)} inputs ({ok} ok, {len(skipped)} skipped, "
        f"{result.reused} from cache), {m.num_documents} documents",
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
