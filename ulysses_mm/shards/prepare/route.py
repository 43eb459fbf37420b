"""What ``prepare`` does with each input: which tokenizer reads it, and what became of it.

An input is routed by its file name to one of the pipeline's tokenizers (:func:`route`),
then tokenized into a staged entry in the staging directory, named by a hash of (input
path, size, mtime or ETag, tokenizer spec and artifact hashes, token space)::

    STAGING/documents/part-PPPPP/KEY.{tokens,docs}   the documents (:mod:`.staged`)
    STAGING/documents/part-PPPPP/KEY.json            the input's :class:`Outcome`, written
                                                     after them: the entry's commit mark

A rerun finds committed entries and does not tokenize those inputs again
(:func:`plan_inputs`). Every value here is numpy or plain Python: spawned workers import
this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ulysses_mm.config import PipelineConfig
from ulysses_mm.core import storage
from ulysses_mm.core.errors import UserError
from ulysses_mm.core.resources import shipped_tokenizer_names
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.shards.prepare import staged
from ulysses_mm.shards.prepare.staged import PrepareError
from ulysses_mm.tokenize import registry
from ulysses_mm.tokenize.base import TokenizerSpec, build_token_space

STAGED_VERSION = 2


# ------------------------------------------------------------------------ routing


def route(source: str, kinds: Mapping[str, str], extra: Mapping[str, Sequence[str]]) -> str | None:
    """The modality whose tokenizer reads ``source``, by file name (None: unsupported).

    ``kinds`` maps each of the pipeline's modalities to its tokenizer kind. Tried in
    order, the first table listing an ending of the name for one of those modalities
    wins: the pipeline's own ``extra`` (modality -> suffixes), then the suffixes each kind
    is registered with, then the kinds' fallback suffixes (so a video container goes to
    the video tokenizer when there is one, else to the audio tokenizer, for its sound
    track)."""
    name = source.rstrip("/").rsplit("/", 1)[-1].lower()
    registered = {m: registry.kind(k) for m, k in kinds.items()}
    tables: list[Mapping[str, Sequence[str]]] = [
        extra,
        {m: k.suffixes for m, k in registered.items()},
        {m: k.fallback_suffixes for m, k in registered.items()},
    ]
    for table in tables:
        for modality, suffixes in table.items():
            if modality in kinds and any(name.endswith(s.lower()) for s in suffixes):
                return modality
    return None


def load_specs(cfg: PipelineConfig) -> tuple[list[TokenizerSpec], TokenSpace]:
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
        if not storage.is_url(p) and not Path(p).exists():
            raise PrepareError(
                f"tokenizer spec {p}: no such file, nor a shipped spec of that name "
                f"(shipped: {', '.join(shipped_tokenizer_names())})"
            )
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
        except UserError as e:  # its one line names the spec and what to fix
            raise PrepareError(str(e)) from e
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


# ------------------------------------------------------------------------ outcomes


@dataclass(frozen=True)
class Outcome:
    """What became of one input: tokenized (``status == "ok"``) or skipped with a reason."""

    source: str
    status: str  # "ok" | "skipped"
    modality: str = ""
    reason: str = ""  # one line, for a skipped input
    documents: int = 0
    tokens: int = 0
    reusable: bool = True  # False: perhaps transient (network, memory); the next run retries
    crashed: bool = False  # its worker process died
    skipped_records: int = 0  # records of an ok input its tokenizer skipped (bad .jsonl lines)
    skip_reason: str = ""  # the first of them, one line

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: str | bytes) -> Outcome:
        raw = json.loads(data)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def skipped(source: str, reason: str, **kw: Any) -> Outcome:
    return Outcome(source, "skipped", reason=reason, **kw)


@dataclass(frozen=True)
class Task:
    """One input for a worker to tokenize into its staged entry."""

    index: int  # position in the sorted input list
    source: str
    modality: str
    staged: str  # staged entry stem: STEM.npz (documents) and STEM.json (outcome)
    fetch_dir: str  # where a remote input is copied for decoding


@dataclass(frozen=True)
class Result:
    """An input's outcome and the staged entry holding its documents (when ok)."""

    outcome: Outcome
    staged: str = ""
    reused: bool = False  # found in the staging directory, not tokenized by this run
    held: Any = None  # a StagedWriter this process holds the documents in, not committed


@dataclass
class Plan:
    """Every input either known already (unsupported, unreadable, staged by an earlier run) or a task."""

    known: dict[int, Result]  # by input index
    tasks: list[Task]


# ------------------------------------------------------------------- the staging directory


def staging_dir(cfg: PipelineConfig) -> Path:
    if cfg.staging:
        return Path(cfg.staging)
    output = storage.Location(cfg.output)
    if output.is_local:
        return Path(str(output.local_path).rstrip("/") + ".staging")
    digest = hashlib.sha256(cfg.output.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"ulysses-mm-staging-{digest}"


def partition_staging(staging: str | Path, index: int) -> Path:
    """Partition ``index``'s staged entries: its own directory, which only the one attempt
    at the partition running at a time writes to."""
    return Path(staging) / "documents" / f"part-{index:05d}"


def staged_key(
    source: str,
    identity: Mapping[str, Any],
    modality: str,
    spec: TokenizerSpec,
    space: TokenSpace,
) -> str:
    ident = {
        "v": STAGED_VERSION,
        "source": source,
        "input": dict(identity),
        "modality": modality,
        "spec": [spec.sha256, spec.artifact_sha256],
        "space": space.to_dict(),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:40]


def commit(stem: str, outcome: Outcome) -> None:
    storage.atomic_write_local(Path(stem + ".json"), outcome.to_json())


def plan_inputs(
    inputs: Sequence[storage.InputFile],
    first_input: int,
    specs: Sequence[TokenizerSpec],
    space: TokenSpace,
    suffixes: Mapping[str, Sequence[str]],
    staged_dir: Path,
) -> Plan:
    """Route every input of a partition (numbered from ``first_input``); what is known
    already (unsupported, or staged by an earlier run), and a task for each of the rest."""
    by_modality = {s.modality: s for s in specs}
    kinds = {s.modality: s.kind for s in specs}
    staged_dir.mkdir(parents=True, exist_ok=True)
    storage.Location(str(staged_dir)).remove_stale_temps()
    fetch_dir = staged_dir.parent.parent / "fetch"
    plan = Plan({}, [])
    for i, f in enumerate(inputs, start=first_input):
        source = f.location
        modality = route(source, kinds, suffixes)
        if modality is None:
            suffix = Path(source.rsplit("/", 1)[-1]).suffix or "(none)"
            reason = (
                f"unsupported file type {suffix}: no tokenizer for it in this pipeline "
                f"(modalities {list(by_modality)})"
            )
            plan.known[i] = Result(skipped(source, reason))
            continue
        key = staged_key(source, f.identity, modality, by_modality[modality], space)
        stem = str(staged_dir / key)
        if os.path.exists(stem + ".json"):
            done = Outcome.from_json(Path(stem + ".json").read_bytes())
            if not done.ok or staged.exists(stem):
                plan.known[i] = Result(done, stem, reused=True)
                continue
        plan.tasks.append(Task(i, source, modality, stem, str(fetch_dir / key)))
    return plan
