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

import os
from dataclasses import dataclass, field
from pathlib import Path

from ulysses_mm.config import RunConfig
from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.core.layout import check_layout
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.mixing import modality_pools
from ulysses_mm.loader.order import check_enough_samples
from ulysses_mm.model.attention import check_kernel_config
from ulysses_mm.model.hf_import import check_init_from
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


def plan_run(cfg: RunConfig, world: int, resume: bool = False) -> RunPlan:
    """Every check the manifests, the world and the checkpoint decide, in one place: run
    by the parent before it starts processes (one line, exit 2) and by each rank again.

    The layout (sp and dp against the world, the heads and the sequence), the attention
    kernel against the precision, a pretrained start (``model.init_from``) against the
    model, the data's token space against the model's and the checkpoint's (every mixed
    manifest's alike), the sequence length against the shards', the shards against the
    global micro-batch and the node cache, and that a resumed run has a checkpoint."""
    entries = train_entries(cfg)
    d = cfg.data
    sources = [
        (Manifest.load(loc, d.storage_options, d.timeouts, d.max_manifest_bytes), w)
        for loc, w, _ in entries
    ]
    modalities = [mods for *_, mods in entries]
    manifest = sources[0][0]
    space = model_space(cfg, manifest)
    seq_len = cfg.data.seq_len or manifest.seq_len
    for source, _ in sources:
        if seq_len != source.seq_len:
            raise DataError(
                f"data.seq_len={seq_len} but the shards of {source.location} hold samples "
                f"of {source.seq_len} tokens; prepare the data again or set data.seq_len=0"
            )
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
    m = cfg.model
    dp = check_layout(
        cfg.parallel.sp,
        dp=cfg.parallel.dp,
        world=world,
        num_heads=m.num_attention_heads,
        num_kv_heads=m.num_key_value_heads,
        seq_len=seq_len,
        ring=cfg.parallel.ring,
        head_chunks=cfg.parallel.head_chunks,
    )
    if len(sources) == 1 and not modalities[0]:  # one source drops a short epoch tail
        check_enough_samples(manifest, dp, d.micro_batch_size)
    if cfg.model.init_from:
        check_init_from(cfg.model, space, cfg.model.init_from)
    eval_manifest = (
        Manifest.load(d.eval, d.storage_options, d.timeouts, d.max_manifest_bytes)
        if d.eval
        else None
    )
    if eval_manifest is not None:
        eval_manifest.check_token_space(space)
        check_enough_samples(eval_manifest, dp, d.micro_batch_size)
    if resume:
        check_resume(cfg, space, ranks=dp * cfg.parallel.sp)
    return RunPlan(manifest, eval_manifest, space, seq_len, sources, modalities)


def check_resume(cfg: RunConfig, space: TokenSpace, ranks: int | None = None) -> None:
    """A resumed run has a checkpoint: ``latest`` names a directory beside it that holds
    every file resuming reads (for this run's ZeRO stage and, with ``ranks``, its number of
    partitions), trained on this run's token space."""
    ckpt_dir = Path(cfg.train.out_dir) / "checkpoints"
    tag = checkpoint.latest_tag(ckpt_dir)
    if tag is None:
        raise DataError(f"--resume: no checkpoint to resume from in {ckpt_dir} (no 'latest' file)")
    checkpoint.check_complete(ckpt_dir / tag, cfg.deepspeed.zero_stage, ranks)
    saved = checkpoint.saved_token_space(ckpt_dir / tag)
    if saved is not None and saved != space:
        raise DataError(
            f"--resume: checkpoint {ckpt_dir / tag} was trained on the "
            f"{saved.describe()}, but this run's is the {space.describe()}"
        )


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
