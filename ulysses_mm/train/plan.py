"""The pre-flight of ``ulysses-mm train``: every check that needs the manifests, the world
or the checkpoint, run by the parent before any process starts (so what the user can fix
is one line, exit 2, not a failing rank) and by each rank again, which then trains on the
plan's manifests and token space.

What the config decides alone is checked by the schema's ``__post_init__``; what is left
here is the data's sizes and token spaces against the run, the layout against the world,
the attention kernel against the precision, a pretrained start against the model, and a
resumed run's checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ulysses_mm.config import RunConfig, Stage, run_stages, stage_of, to_dict
from ulysses_mm.core import checks
from ulysses_mm.core.errors import ConfigError, DataError, UserError
from ulysses_mm.core.layout import Layout
from ulysses_mm.core.tokenspace import SPACE_FILE, TokenSpace
from ulysses_mm.loader.mixing import modality_pools
from ulysses_mm.loader.order import check_enough_samples
from ulysses_mm.loader.window import check_enough_windows
from ulysses_mm.model.attention import check_kernel_config
from ulysses_mm.model.hf_import import ARCH_FIELDS, check_init_from
from ulysses_mm.parallel.mesh import in_launched_world
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.train import checkpoint


def model_space(cfg: RunConfig, manifest: Manifest) -> TokenSpace:
    """The model's token space: the config's when it names one (and it must match the
    data's), else the data's."""
    if cfg.model.modalities:
        space = TokenSpace.from_vocab(cfg.model.modalities)
        manifest.check_token_space(space)
        return space
    return manifest.token_space


@dataclass
class RunPlan:
    """What the config and the manifests decide before any process starts."""

    manifest: Manifest
    eval_manifest: Manifest | None
    space: TokenSpace
    seq_len: int
    sources: list[tuple[Manifest, float]] = field(default_factory=list)
    modalities: list[dict[str, float]] = field(default_factory=list)  # per source ({} = none)
    stages: list[Stage] = field(default_factory=list)  # the run's, each a whole run config
    windows: bool = False  # samples cut into windows of each stage's length
    resumed: dict[str, Any] = field(default_factory=dict)  # the checkpoint's resume.json

    @property
    def stream_sources(self) -> list[tuple[Manifest, float, dict[str, float]]]:
        """The sources as :class:`~ulysses_mm.loader.stream.ShardStream` takes them,
        modality weights included."""
        mods = self.modalities or [{} for _ in self.sources]
        return [(m, w, mw) for (m, w), mw in zip(self.sources, mods)]


def train_entries(cfg: RunConfig) -> list[tuple[str, float, dict[str, float]]]:
    """``data.train`` as (manifest location, weight, modality weights) entries (the
    weights are checked by :class:`~ulysses_mm.config.DataConfig`)."""
    d = cfg.data
    if not d.train:
        raise ConfigError("data.train is empty: give the manifest of the training shards")
    mix = {d.train: 1.0} if isinstance(d.train, str) else dict(d.train)
    entries = []
    for location, value in mix.items():
        weight, mods = (
            (value, {}) if isinstance(value, (int, float)) else (value.weight, value.modalities)
        )
        entries.append((location, float(weight), dict(mods)))
    return entries


def stage_seq_len(stage: Stage, source: Manifest) -> int:
    """The tokens per sample stage ``stage`` trains on from ``source``: its data.seq_len,
    cut as windows out of the source's samples (0: the samples' own length)."""
    seq_len = stage.seq_len or source.seq_len
    if seq_len > source.seq_len or source.seq_len % seq_len:
        raise DataError(
            f"data.seq_len={seq_len} but the shards of {source.location} hold samples of "
            f"{source.seq_len} tokens, and a run trains on whole samples or on windows cut "
            "out of them; set data.seq_len to a divisor of it or prepare the data at a "
            "longer pack.seq_len"
        )
    return seq_len


@contextmanager
def naming(stage: Stage, staged: bool) -> Iterator[None]:
    """A user error raised inside names the stage it is about (when the run has stages)."""
    try:
        yield
    except UserError as e:
        if not staged:
            raise
        raise type(e)(f"{stage.key}: {e}") from None


@contextmanager
def _about_eval() -> Iterator[None]:
    """A user error raised inside is about the evaluation shards: it says ``data.eval``
    (the messages of a manifest name its location, which may be the train's twin)."""
    try:
        yield
    except UserError as e:
        raise type(e)(f"data.eval: {e}") from None


class MemoryCheck(Protocol):
    """The memory budget's check (the estimate's ``check_stages_fit``): every stage of the
    run on ``world`` GPUs (a stage whose data.seq_len is 0 at ``manifest_seq_len``, the
    shards' length) within ``train.gpu_mem_gib``, else one ConfigError naming the first
    stage over it."""

    def __call__(
        self, cfg: RunConfig, world: int, manifest_seq_len: int, *, space: TokenSpace
    ) -> None: ...


def plan_run(
    cfg: RunConfig, world: int, resume: bool = False, memory: MemoryCheck | None = None
) -> RunPlan:
    """Every check the manifests, the world and the checkpoint decide, in one place: run
    by the parent before it starts processes (one line, exit 2) and by each rank again.

    For each stage (a run without ``train.stages`` is one): the layout (sp and dp against
    the world, the heads and the sequence), the sequence length against the shards' (a
    divisor of it: windows), the shards against the global micro-batch and, with
    ``train.gpu_mem_gib``, the estimate's memory against it; once: the attention kernel
    against the precision, a pretrained start (``model.init_from``) against the model, the
    data's token space against the model's and the checkpoint's (every mixed manifest's
    alike), the node cache, and that a resumed run has a checkpoint. A stage's error
    names the stage. With ``train.gpu_mem_gib`` set, ``memory`` (the parent's) checks
    every stage against it once the data's length and token space are known."""
    entries = train_entries(cfg)
    d = cfg.data
    sources = [(Manifest.load(d.location(loc), d.max_manifest_bytes), w) for loc, w, _ in entries]
    modalities = [mods for *_, mods in entries]
    manifest = sources[0][0]
    space = model_space(cfg, manifest)
    for source, _ in sources:
        source.check_token_space(space)
    for (source, _), mods in zip(sources, modalities):
        if mods:  # names, presence, and that the samples can give the weights
            where = f"data.train: {source.location}"
            modality_pools(source.sample_tokens(), source.token_space.modalities, mods, where)
    check_loader_config(cfg, sources)
    if cfg.logging.samples and cfg.deepspeed.zero_stage == 3:
        raise ConfigError(
            "logging.samples generates on rank 0 alone, which ZeRO-3's partitioned weights do "
            "not allow; set deepspeed.zero_stage below 3 or logging.samples=false"
        )
    check_kernel_config(cfg.parallel.attention, cfg.deepspeed.precision)
    if cfg.model.init_from:
        check_init_from(cfg.model, space, cfg.model.init_from)
    eval_manifest = None
    if d.eval:
        with _about_eval():
            eval_manifest = Manifest.load(d.location(d.eval), d.max_manifest_bytes)
            eval_manifest.check_token_space(space)
    stages = run_stages(cfg)
    staged = bool(cfg.train.stages)
    dps, seq_lens = [], []
    for stage in stages:
        with naming(stage, staged):
            dp, seq_len = _check_stage(stage, world, sources, modalities, eval_manifest)
        dps.append(dp)
        seq_lens.append(seq_len)
    resumed: dict[str, Any] = {}
    if resume:
        ranks = dps[0] * stages[0].cfg.parallel.sp
        resumed = check_resume(cfg, space, manifest.seq_len, ranks=ranks)
    if memory is not None and cfg.train.gpu_mem_gib:
        memory(cfg, world, manifest.seq_len, space=space)
    windows = staged or any(seq_lens[0] != m.seq_len for m, _ in sources)
    return RunPlan(
        manifest, eval_manifest, space, seq_lens[0], sources, modalities, stages, windows, resumed
    )


def _check_stage(
    stage: Stage,
    world: int,
    sources: list[tuple[Manifest, float]],
    modalities: list[dict[str, float]],
    eval_manifest: Manifest | None,
) -> tuple[int, int]:
    """One stage's checks against the data and the world: (its dp, its seq_len)."""
    cfg = stage.cfg
    m, mb = cfg.model, cfg.data.micro_batch_size
    seq_len = stage_seq_len(stage, sources[0][0])
    for source, _ in sources[1:]:
        if stage_seq_len(stage, source) != seq_len:
            first = sources[0][0]
            raise DataError(
                f"the shards of {source.location} hold samples of {source.seq_len} tokens, "
                f"those of {first.location} of {first.seq_len}; set data.seq_len to a length "
                "that divides both"
            )
    dp = Layout.from_config(
        cfg.parallel,
        world,
        num_heads=m.num_attention_heads,
        num_kv_heads=m.num_key_value_heads,
        seq_len=seq_len,
    ).dp
    manifest = sources[0][0]
    if len(sources) == 1 and not modalities[0]:  # one source drops a short epoch tail
        if seq_len == manifest.seq_len:
            check_enough_samples(manifest, dp, mb)
        else:
            check_enough_windows(manifest, seq_len, dp, mb)
    if eval_manifest is not None:
        with _about_eval():
            eval_len = (
                stage_seq_len(stage, eval_manifest) if stage.seq_len else eval_manifest.seq_len
            )
            check_enough_windows(eval_manifest, eval_len, dp, mb)
    return dp, seq_len


def resume_record(stages: list[Stage], step: int, shard_len: int) -> dict[str, Any]:
    """What a checkpoint at ``step`` keeps of the run (``resume.json``): the stages trained
    so far, each by what makes it that stage (its steps, length and RoPE), and the model's
    architecture."""
    current = stage_of(stages, step - 1) if step else stages[0]
    model = stages[0].cfg.model
    return {
        "step": step,
        "stage": current.index,
        "stages": [_stage_row(s, shard_len) for s in stages[: current.index + 1]],
        "architecture": {k: getattr(model, k) for k in ARCH_FIELDS},
    }


def _stage_row(stage: Stage, shard_len: int) -> dict[str, Any]:
    return {
        "start": stage.start,
        "steps": stage.steps,
        "seq_len": stage.seq_len or shard_len,
        "rope": to_dict(stage.cfg.model.rope),
    }


def check_resume_matches(saved: dict[str, Any], cfg: RunConfig, where: str, shard_len: int) -> None:
    """A run resumed from checkpoint ``where`` (its ``resume.json`` ``saved``) trains what
    the checkpoint was trained as: the same architecture, its stage and every stage before
    it unchanged (steps, length, RoPE), and steps left to run. What elastic resume allows
    (dp, micro-batch, the SP layout, stages after the checkpoint's) may change."""
    step = int(saved.get("step", 0))
    if cfg.train.steps < step:
        raise ConfigError(
            f"train.steps={cfg.train.steps} but checkpoint {where} is at step {step}; raise "
            f"train.steps above {step} to train on, or export the checkpoint"
        )
    arch = saved.get("architecture", {})
    for key, value in arch.items():
        now = getattr(cfg.model, key)
        if now != value:
            raise ConfigError(
                f"model.{key}={now} but checkpoint {where} was trained with {value}; a resumed "
                "run keeps the model's architecture (start a new run with model.init_from)"
            )
    stages = run_stages(cfg)
    rows = saved.get("stages", [])
    staged = bool(cfg.train.stages)
    for i, row in enumerate(rows):
        if i >= len(stages) or (not staged and len(rows) > 1):
            raise ConfigError(
                f"checkpoint {where} was trained in train.stages[{i}] (steps "
                f"{row['start'] + 1}-{row['start'] + row['steps']}), which this config "
                f"{'no longer has' if staged else 'lacks (train.stages is empty)'}; a resumed "
                "run keeps the stages it has trained"
            )
        now = _stage_row(stages[i], shard_len)
        last = i == len(rows) - 1
        name_of = stages[i].key if staged else "the run"
        if last and now["start"] < step and now["start"] + now["steps"] < step:
            raise ConfigError(
                f"{name_of}: it ends at step {now['start'] + now['steps']}, but checkpoint "
                f"{where} was saved inside it at step {step}; a resumed run keeps the stages "
                "it has trained"
            )
        for key in ("start", "steps", "seq_len", "rope"):
            if key == "steps" and last:
                continue  # the checkpoint's own stage may grow, or shrink down to its step
            if now[key] != row[key]:
                name = {"start": "start step", "steps": "steps", "seq_len": "data.seq_len"}.get(
                    key, "model.rope"
                )
                shown = (lambda v: v) if key != "rope" else _rope_text
                raise ConfigError(
                    f"{name_of}: its {name} is "
                    f"{shown(now[key])}, but checkpoint {where} (step {step}) was trained with "
                    f"{shown(row[key])}; a resumed run keeps the stages it has trained (stages "
                    "after the checkpoint's may change)"
                )


def _rope_text(rope: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in rope.items() if v is not None)


def check_resume(
    cfg: RunConfig, space: TokenSpace, shard_len: int, ranks: int | None = None
) -> dict[str, Any]:
    """A resumed run has a checkpoint: ``latest`` names a checkpoint that holds every file
    resuming reads (for this run's ZeRO stage and, with ``ranks``, its number of
    partitions), trained on this run's token space and as this config trains it
    (:func:`check_resume_matches`). Returns its ``resume.json`` record ({} when it has none)."""
    ckpt = checkpoint.CheckpointDir.of(cfg)
    tag = ckpt.latest_tag()
    if tag is None:
        raise DataError(f"--resume: no checkpoint to resume from in {ckpt.url} (no 'latest' file)")
    where = ckpt.url_of(tag)
    if ckpt.is_local:
        checkpoint.check_complete(ckpt.local_path / tag, cfg.deepspeed.zero_stage, ranks)
    else:
        names = ckpt.names(tag)
        text = ckpt.read_text(tag, checkpoint.CONFIG_FILE)
        checkpoint.check_files(where, names, text, cfg.deepspeed.zero_stage, ranks)
    text = ckpt.read_text(tag, SPACE_FILE)
    if text is not None:
        try:
            saved_space = TokenSpace.from_dict(json.loads(text))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{where}/{SPACE_FILE}: not a token space: {e}") from None
        if saved_space != space:
            raise DataError(
                f"--resume: checkpoint {where} was trained on the "
                f"{saved_space.describe()}, but this run's is the {space.describe()}"
            )
    text = ckpt.read_text(tag, checkpoint.RESUME_FILE)
    record: dict[str, Any] = {}
    if text is not None:
        try:
            record = json.loads(text)
        except ValueError:
            raise DataError(f"{where}/{checkpoint.RESUME_FILE} is not JSON") from None
        check_resume_matches(record, cfg, where, shard_len)
    return record


def holds_a_run(cfg: RunConfig) -> str | None:
    """What in the run directory (or the checkpoint directory) says a run is there: a
    checkpoint pointer or metrics (None: nothing)."""
    ckpt = checkpoint.CheckpointDir.of(cfg)
    tag = ckpt.latest_tag()
    if tag is not None:
        return f"checkpoint {ckpt.url_of(tag)}"
    metrics = Path(cfg.train.out_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        return f"metrics {metrics}"
    return None


def resolve_resume(cfg: RunConfig) -> bool:
    """``train.resume`` against the run directory: whether this run resumes. ``auto``
    resumes when there is a checkpoint; ``never`` refuses a directory that holds a run;
    ``restart`` first moves such a run aside (:func:`set_aside`, in the parent only)."""
    t = cfg.train
    checks.out_dir(t.out_dir, "train.out_dir")
    if t.checkpoint_dir:
        checks.out_dir(t.checkpoint_dir, "train.checkpoint_dir")
    mode = t.resume
    if mode == "always":
        return True
    if mode == "auto":
        return checkpoint.CheckpointDir.of(cfg).latest_tag() is not None
    found = holds_a_run(cfg)
    if found is not None and mode == "never":
        raise ConfigError(
            f"train.resume=never but {cfg.train.out_dir} holds a run ({found}); continue it "
            "with train.resume=auto, start over with train.resume=restart (the old run is "
            "moved to RUN_DIR/previous/), or choose another train.out_dir"
        )
    return False


def check_loader_config(cfg: RunConfig, sources: list[tuple[Manifest, float]]) -> None:
    """The node cache holds the shard read and the one fetched ahead."""
    d = cfg.data
    if d.cache_dir:
        largest = max(s.bytes for m, _ in sources for s in m.shards)
        if d.cache_bytes < 2 * largest:
            raise ConfigError(
                f"data.cache_bytes={d.cache_bytes} cannot hold two shards of {largest} bytes "
                f"(the one read and the one fetched); raise it or set data.cache_dir=''"
            )


def world_size(nproc: int | None) -> int:
    """The processes the run will have: the launcher's world, else ``--nproc``, else 1."""
    if in_launched_world():
        return int(os.environ["WORLD_SIZE"])
    return nproc or 1
