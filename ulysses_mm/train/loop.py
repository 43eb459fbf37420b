"""``ulysses-mm train``: stream shards into a DeepSpeed Ulysses run.

Per optimizer step, each DP group reads its micro-batches, every SP rank keeps its slice,
the engine runs forward (per-modality CE sums and counts), the loss share is reduced to a
token-weighted mean over dp × sp and back-propagated, and the engine steps. Rank 0 logs,
evaluates on held-out shards every ``train.eval_every`` steps, and every rank takes part in
checkpoints every ``train.checkpoint_every`` steps and at the end.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ulysses_mm.config import RunConfig, from_dict, to_dict
from ulysses_mm.core.layout import check_layout
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.batch import Batch, make_batch
from ulysses_mm.loader.mixing import modality_pools
from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.loader.stream import ShardStream
from ulysses_mm.model.attention import check_kernel_config
from ulysses_mm.model.hf_import import check_init_from
from ulysses_mm.parallel import Mesh
from ulysses_mm.parallel.mesh import in_launched_world, open_world
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.train import checkpoint
from ulysses_mm.train.engine import ds_config
from ulysses_mm.train.metrics import (
    MetricsLogger,
    causal_pairs,
    peak_memory_mb,
    peak_tflops,
    train_flops,
)
from ulysses_mm.train.step import build_setup, forward_loss, train_step

LN2 = math.log(2.0)


@dataclass
class TrainResult:
    steps: int
    run_dir: str
    checkpoint: str
    wandb_dir: str | None
    final_loss: float


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
        """The sources as :class:`ShardStream` takes them, modality weights included."""
        mods = self.modalities or [{} for _ in self.sources]
        return [(m, w, mw) for (m, w), mw in zip(self.sources, mods)]


def train_entries(cfg: RunConfig) -> list[tuple[str, float, dict[str, float]]]:
    """``data.train`` as (manifest location, weight, modality weights) entries."""
    d = cfg.data
    if not d.train:
        raise ValueError("data.train is empty: give the manifest of the training shards")
    mix = {d.train: 1.0} if isinstance(d.train, str) else dict(d.train)
    entries = []
    for location, value in mix.items():
        weight, mods = (
            (value, {}) if isinstance(value, (int, float)) else (value.weight, value.modalities)
        )
        if not weight > 0 or not math.isfinite(weight):
            raise ValueError(
                f"data.train: the weight of {location} is {weight}; give a positive one"
            )
        entries.append((location, float(weight), dict(mods)))
    return entries


def plan_run(cfg: RunConfig, world: int, resume: bool = False) -> RunPlan:
    """Every check the config, the manifests and the checkpoint decide, in one place: run
    by the parent before it starts processes (one line, exit 2) and by each rank again.

    The layout (sp and dp against the world, the heads and the sequence), the attention
    kernel against the precision, DeepSpeed's settings, a pretrained start
    (``model.init_from``) against the model, the data's token space against the model's
    and the checkpoint's (every mixed manifest's alike), the sequence length against the
    shards', the loader's budgets, and that a resumed run has a checkpoint."""
    entries = train_entries(cfg)
    d = cfg.data
    timeouts = loader_timeouts(cfg)
    sources = [(Manifest.load(loc, d.storage_options, timeouts), w) for loc, w, _ in entries]
    modalities = [mods for *_, mods in entries]
    manifest = sources[0][0]
    space = model_space(cfg, manifest)
    seq_len = cfg.data.seq_len or manifest.seq_len
    for source, _ in sources:
        if seq_len != source.seq_len:
            raise ValueError(
                f"data.seq_len={seq_len} but the shards of {source.location} hold samples "
                f"of {source.seq_len} tokens; prepare the data again or set data.seq_len=0"
            )
        source.check_token_space(space)
    for (source, _), mods in zip(sources, modalities):
        if mods:  # names, presence, weights, and that the samples can give them
            where = f"data.train: {source.location}"
            modality_pools(source.sample_tokens(), source.token_space.modalities, mods, where)
    check_loader_config(cfg, sources)
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
    )
    ds_config(
        cfg, Mesh(dp=dp, sp=cfg.parallel.sp, rank=0, ring=cfg.parallel.ring)
    )  # DeepSpeed settings that clash
    if cfg.model.init_from:
        check_init_from(cfg.model, space, cfg.model.init_from)
    eval_manifest = Manifest.load(d.eval, d.storage_options, timeouts) if d.eval else None
    if eval_manifest is not None:
        eval_manifest.check_token_space(space)
    if resume:
        ckpt_dir = Path(cfg.train.out_dir) / "checkpoints"
        tag = checkpoint.latest_tag(ckpt_dir)
        if tag is None:
            raise FileNotFoundError(
                f"--resume: no checkpoint to resume from in {ckpt_dir} (no 'latest' file)"
            )
        saved = checkpoint.saved_token_space(ckpt_dir / tag)
        if saved is not None and saved != space:
            raise ValueError(
                f"--resume: checkpoint {ckpt_dir / tag} was trained on the "
                f"{saved.describe()}, but this run's is the {space.describe()}"
            )
    return RunPlan(manifest, eval_manifest, space, seq_len, sources, modalities)


def loader_timeouts(cfg: RunConfig) -> tuple[float, float]:
    """(connect, read) seconds of every remote read, manifests and shards alike."""
    d = cfg.data
    for key in ("connect_timeout_s", "read_timeout_s"):
        if not getattr(d, key) > 0:
            raise ValueError(f"data.{key}={getattr(d, key)}: give a positive number of seconds")
    return d.connect_timeout_s, d.read_timeout_s


def check_loader_config(cfg: RunConfig, sources: list[tuple[Manifest, float]]) -> None:
    d = cfg.data
    for key in ("prefetch_bytes", "cache_bytes", "shuffle_buffer"):
        if getattr(d, key) < 0:
            raise ValueError(f"data.{key}={getattr(d, key)} is negative")
    if d.cache_dir:
        largest = max(s.bytes for m, _ in sources for s in m.shards)
        if d.cache_bytes < 2 * largest:
            raise ValueError(
                f"data.cache_bytes={d.cache_bytes} cannot hold two shards of {largest} bytes "
                f"(the one read and the one fetched); raise it or set data.cache_dir=''"
            )


def world_size(nproc: int | None) -> int:
    """The processes the run will have: the launcher's world, else ``--nproc``, else 1."""
    if in_launched_world():
        return int(os.environ["WORLD_SIZE"])
    return nproc or 1


class Trainer:
    def __init__(self, cfg: RunConfig, resume: bool = False) -> None:
        self.cfg = cfg
        self.world = open_world(cfg)
        self.mesh = self.world.mesh
        self.device = self.world.device
        self.rank0 = self.mesh.rank == 0
        self.run_dir = Path(cfg.train.out_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        plan = plan_run(cfg, self.mesh.world_size, resume)
        self.manifest, self.eval_manifest, self.space = (
            plan.manifest,
            plan.eval_manifest,
            plan.space,
        )
        d = cfg.data
        self.cache = NodeCache(d.cache_dir, d.cache_bytes) if d.cache_dir else None
        self.rt = build_setup(cfg, self.space, self.world)
        self.engine, self.optimizer, self.model = self.rt.engine, self.rt.optimizer, self.rt.model
        self.weights = self.rt.weights
        self.stream = self._stream(plan.stream_sources, cfg.data.seed, cfg.data.shuffle)
        self.step = 0
        if resume:
            client = checkpoint.load(self.engine, self.ckpt_dir)
            self.step = int(client["step"])
            self.stream.load_state_dict(client["loader"])
        self.logger = MetricsLogger(cfg, self.run_dir, self.rank0, resume_step=self.step)
        self.tflops = peak_tflops(cfg, self.device)

    # ------------------------------------------------------------------ pieces
    def _stream(
        self,
        sources: Manifest | list[tuple[Manifest, float, dict[str, float]]],
        seed: int,
        shuffle: bool,
    ) -> ShardStream:
        d = self.cfg.data
        return ShardStream(
            sources,
            dp_rank=self.mesh.dp_rank,
            dp=self.mesh.dp,
            micro_batch=d.micro_batch_size,
            seed=seed,
            shuffle=shuffle,
            retries=d.retries,
            backoff_s=d.retry_backoff_s,
            shuffle_buffer=d.shuffle_buffer if shuffle else 0,
            timeouts=loader_timeouts(self.cfg),
            cache=self.cache,
            prefetch_bytes=d.prefetch_bytes,
        )

    def _batch(self, samples) -> Batch:
        tokens = np.stack([s.tokens.astype("int64") for s in samples])
        return make_batch(tokens, [s.segments for s in samples], self.space)

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        gas = self.cfg.deepspeed.gradient_accumulation_steps
        sums = {m: 0.0 for m in self.space.modalities}
        counts = {m: 0 for m in self.space.modalities}
        totals, tokens, pairs = [], 0, 0.0
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step applies
        fulls: list[Batch] = []

        def micro_batches():
            for _ in range(gas):
                fulls.append(self._batch(self.stream.next_batch()))
                yield fulls[-1]

        result = train_step(self.rt, micro_batches())
        for report in result.reports:
            totals.append(report.total)
            for m, v in report.per_modality.items():
                sums[m] += v * report.counts[m]
                counts[m] += report.counts[m]
        for full in fulls:
            tokens += full.input_ids.numel()
            pairs += causal_pairs(full.doc_ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.step += 1
        tokens *= self.mesh.dp  # every DP group processed as many
        pairs *= self.mesh.dp
        flops = train_flops(self.model, tokens, pairs, {m: counts[m] for m in counts})
        metrics: dict[str, Any] = {
            "kind": "train",
            "loss": sum(totals) / len(totals),
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens_per_s": tokens / dt,
            "step_time_s": dt,
            **(
                {"mfu": flops / dt / (self.mesh.world_size * self.tflops * 1e12)}
                if self.tflops
                else {}
            ),
            "peak_memory_mb": peak_memory_mb(self.device),
        }
        for m in self.space.modalities:
            if counts[m]:
                metrics[f"loss/{m}"] = sums[m] / counts[m]
                metrics[f"targets/{m}"] = counts[m]
        if "dna" in self.space.modalities and counts.get("dna"):
            metrics["bits_per_base/dna"] = metrics["loss/dna"] / LN2  # one token per base
        # each manifest's share of the samples, each weighted modality's of its manifest's tokens
        for label, share in self.stream.mix_shares().items():
            metrics[f"mix/{label}"] = share
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        assert self.eval_manifest is not None
        stream = self._stream(self.eval_manifest, seed=0, shuffle=False)
        batches = min(self.cfg.train.eval_batches, stream.batches_per_epoch)
        sums = {m: 0.0 for m in self.space.modalities}
        counts = {m: 0 for m in self.space.modalities}
        self.engine.eval()
        for _ in range(batches):
            local = self.rt.slice_of(self._batch(stream.next_batch()))
            _, report = forward_loss(self.engine, local, self.weights, self.mesh)
            for m, v in report.per_modality.items():
                sums[m] += v * report.counts[m]
                counts[m] += report.counts[m]
        stream.close()
        self.engine.train()
        out: dict[str, Any] = {"kind": "eval", "eval/batches": batches}
        weighted, wsum = 0.0, 0.0
        for i, m in enumerate(self.space.modalities):
            if counts[m]:
                out[f"eval/loss/{m}"] = sums[m] / counts[m]
                weighted += float(self.weights[i]) * out[f"eval/loss/{m}"]
                wsum += float(self.weights[i])
        out["eval/loss"] = weighted / wsum if wsum else math.nan
        if out.get("eval/loss/dna") is not None:
            out["eval/bits_per_base/dna"] = out["eval/loss/dna"] / LN2
        return out

    def save(self) -> Path:
        path = checkpoint.save(
            self.engine,
            self.ckpt_dir,
            self.step,
            {"loader": self.stream.state_dict()},
            to_dict(self.cfg),
            self.space,
            self.cfg.train.keep_checkpoints,
        )
        self.logger.checkpointed(self.step)  # W&B gets only steps a resume will not redo
        return path

    def run(self) -> TrainResult:
        t = self.cfg.train
        last: dict[str, Any] = {}
        saved = self.ckpt_dir / (checkpoint.latest_tag(self.ckpt_dir) or "")
        progress = None
        if self.rank0:
            from tqdm import tqdm

            progress = tqdm(
                total=t.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True
            )
        while self.step < t.steps:
            last = self.train_step()
            if self.step % t.log_every == 0 or self.step == t.steps:
                self.logger.log(self.step, last)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(
                    loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}"
                )
            if self.eval_manifest is not None and t.eval_every and self.step % t.eval_every == 0:
                self.logger.log(self.step, self.evaluate())
            if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or self.step == t.steps:
                saved = self.save()
        if progress is not None:
            progress.close()
        self.stream.close()
        wandb_dir = self.logger.finish()
        return TrainResult(
            self.step, str(self.run_dir), str(saved), wandb_dir, float(last.get("loss", math.nan))
        )


def train_worker(cfg_dict: dict[str, Any], resume: bool) -> dict[str, Any]:
    trainer = Trainer(from_dict(RunConfig, cfg_dict), resume)
    result = trainer.run()
    if dist.is_initialized():
        dist.barrier()
    return vars(result)


def run_train(cfg: RunConfig, nproc: int | None, resume: bool) -> dict[str, Any]:
    """Train in this process's launched world, or start ``nproc`` local processes."""
    from ulysses_mm.parallel.launch import run_world

    if nproc and in_launched_world():
        raise ValueError(
            "--nproc starts local processes; under torchrun or the DeepSpeed launcher leave it out"
        )
    plan_run(cfg, world_size(nproc), resume)  # what the config decides fails here, not in a rank
    logs = Path(cfg.train.out_dir) / "logs"
    return run_world(train_worker, nproc, to_dict(cfg), resume, log_dir=logs)[0]
