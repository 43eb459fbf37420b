"""``ulysses-mm train``: stream shards into a DeepSpeed Ulysses run.

Per optimizer step, each DP group reads its micro-batches, every SP rank keeps its slice,
the engine runs forward (per-modality CE sums and counts), the loss share is reduced to a
token-weighted mean over dp × sp and back-propagated, and the engine steps. Rank 0 logs,
evaluates on held-out shards every ``train.eval_every`` steps, and every rank takes part in
checkpoints every ``train.checkpoint_every`` steps and at the end.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ulysses_mm.config import RunConfig, Stage, from_dict, run_stages, stage_of, to_dict
from ulysses_mm.core.errors import UserError
from ulysses_mm.loader.batch import Batch, samples_batch
from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.loader.order import Sources
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.loader.window import WindowStream
from ulysses_mm.parallel import apply_loss_balance, apply_ulysses
from ulysses_mm.parallel.mesh import Mesh, in_launched_world, open_world
from ulysses_mm.tokenize.table import TokenizerTable
from ulysses_mm.train import checkpoint
from ulysses_mm.train.evaluate import EvalResult, evaluate_batches, units_for
from ulysses_mm.train.flops import causal_pairs, peak_tflops, train_flops
from ulysses_mm.train.logger import MetricsLogger
from ulysses_mm.train.metrics import ModalitySums, peak_memory_mb
from ulysses_mm.train.plan import plan_run, world_size
from ulysses_mm.train.samples import wandb_media, write_samples
from ulysses_mm.train.step import build_setup, train_step

Stream = ShardStream | WindowStream


@dataclass
class TrainResult:
    steps: int
    run_dir: str
    checkpoint: str
    wandb_dir: str | None
    final_loss: float


class Trainer:
    """One rank of a training run: the plan, the setup (model → Ulysses → engine), the
    stream of this rank's samples, the logger; :meth:`run` steps to ``train.steps``."""

    def __init__(self, cfg: RunConfig, resume: bool = False) -> None:
        self.cfg = cfg
        self.stages = run_stages(cfg)
        self.stage = self.stages[0]
        # the engine is built on the first stage's layout; later stages lay the model out
        # again on meshes of their own (the engine's gradient average stays the first's)
        self.world = open_world(self.stage.cfg)
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
        self.sources, self.windows = plan.stream_sources, plan.windows
        d = cfg.data
        self.cache = NodeCache(d.cache_dir, d.cache_bytes) if d.cache_dir else None
        self.tokenizers = TokenizerTable.merged(
            TokenizerTable.from_manifest(m.tokenizers, m.config) for m, _ in plan.sources
        )
        self.units = units_for(self.space, self.tokenizers)
        stage_lr = self._stage_lr if len(self.stages) > 1 else None
        self.rt = build_setup(self.stage.cfg, self.space, self.world, stage_lr=stage_lr)
        self.engine, self.optimizer, self.model = self.rt.engine, self.rt.optimizer, self.rt.model
        self.weights = self.rt.weights
        self.options = StreamOptions.from_config(d)
        self.step = 0
        client: dict[str, Any] = {}
        if resume:
            client = checkpoint.load(self.engine, self.ckpt_dir)
            self.step = int(client["step"])
        self.stream = self._stream(self.sources, self.options)
        if resume:
            self._enter(stage_of(self.stages, self.step))
            self.stream.load_state_dict(client["loader"])
        self.logger = MetricsLogger(cfg, self.run_dir, self.rank0, resume_step=self.step)
        self.tflops = peak_tflops(cfg, self.device)

    # ------------------------------------------------------------------ stages
    def _stage_lr(self, step: int) -> float:
        """The re-warm-up factor of run step ``step`` (1-based), from its stage."""
        return stage_of(self.stages, step - 1).lr_factor(step)

    def _enter(self, stage: Stage) -> None:
        """Move the run to ``stage``: its mesh and attention layout, its RoPE, a stream of
        its windows continuing where the global order stands (the rest of a partly used
        sample skipped when the length changes); the engine and its optimizer state carry
        over."""
        if stage.index == self.stage.index:
            return
        old, new = self.stage.cfg, stage.cfg
        layout = (new.parallel.sp, new.parallel.ring, new.parallel.head_chunks)
        if (old.parallel.sp, old.parallel.ring, old.parallel.head_chunks) != layout:
            p = new.parallel
            mesh = Mesh.build(p.sp, p.dp, p.ring)  # collective: every rank enters together
            self.world = replace(self.world, mesh=mesh)
            self.mesh = mesh
            self.rt.world = self.world
            apply_ulysses(self.model, mesh, head_groups=p.head_chunks)
            apply_loss_balance(self.model, mesh)
        if old.model.rope != new.model.rope:
            self.model.model.rotary_emb.set_rope(new.model.rope)
            self.model.config.rope = new.model.rope  # what samples and generation read
        state = self.stream.state_dict()
        self.stream.close()
        self.stage = stage
        self.stream = self._stream(self.sources, self.options)
        self.stream.load_state_dict(state)

    # ------------------------------------------------------------------ pieces
    def _stream(self, sources: Sources, options: StreamOptions, eval: bool = False) -> Stream:
        """This rank's stream of the stage's samples (windows of its length when the run
        cuts them)."""
        m, mb = self.mesh, self.stage.cfg.data.micro_batch_size
        if not self.windows:
            return ShardStream(sources, m.dp_rank, m.dp, mb, options, self.cache)
        full = self.eval_manifest if eval and self.eval_manifest else self.manifest
        length = self.stage.cfg.data.seq_len or full.seq_len
        return WindowStream(sources, m.dp_rank, m.dp, mb, length, options, self.cache)

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        gas = self.cfg.deepspeed.gradient_accumulation_steps
        sums = ModalitySums(self.space.modalities)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step applies
        fulls: list[Batch] = []

        def micro_batches():
            for _ in range(gas):
                fulls.append(samples_batch(self.stream.next_batch(), self.space))
                yield fulls[-1]

        result = train_step(self.rt, micro_batches())
        for report in result.reports:
            sums.add(report)
        totals = [report.total for report in result.reports]
        tokens = sum(full.input_ids.numel() for full in fulls)
        pairs = sum(causal_pairs(full.doc_ids) for full in fulls)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.step += 1
        tokens *= self.mesh.dp  # every DP group processed as many
        pairs *= self.mesh.dp
        flops = train_flops(self.model, tokens, pairs, dict(sums.counts))
        metrics: dict[str, Any] = {
            "kind": "train",
            "stage": self.stage.index,
            "seq_len": int(fulls[0].input_ids.shape[1]),
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
            **sums.metrics(targets=True),
        }
        # each manifest's share of the samples, each weighted modality's of its manifest's tokens
        for label, share in self.stream.mix_shares().items():
            metrics[f"mix/{label}"] = share
        return metrics

    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        """The held-out figures of :func:`~ulysses_mm.train.evaluate.evaluate_batches`
        (what ``ulysses-mm evaluate`` computes) over ``train.eval_batches`` micro-batches."""
        assert self.eval_manifest is not None
        stream = self._stream(self.eval_manifest, self.options.in_order(), eval=True)
        count = min(self.cfg.train.eval_batches, stream.order.batches_per_epoch)
        self.engine.eval()
        try:
            batches = (samples_batch(stream.next_batch(), self.space) for _ in range(count))
            result = evaluate_batches(self.rt, batches, self.units)
        finally:
            stream.close()
            self.engine.train()
        return result

    def eval_media(self, result: EvalResult) -> dict[str, Any] | None:
        """W&B objects of an evaluation: its loss-by-position chart and, with
        ``logging.samples``, one generated document per modality (rank 0 generates; the
        other ranks wait for it at the next collective)."""
        samples = {}
        if self.cfg.logging.samples and self.rank0:
            self.engine.eval()
            try:
                samples = write_samples(
                    self.model,
                    self.tokenizers,
                    self.run_dir / "samples",
                    self.step,
                    self.cfg.logging.sample_tokens,
                    self.cfg.train.seed,
                )
            finally:
                self.engine.train()
        if self.logger.run is None:
            return None
        return wandb_media(samples, result.bins)

    def save(self) -> Path:
        stage = self.stage
        path = checkpoint.save(
            self.engine,
            self.ckpt_dir,
            step=self.step,
            client_state={
                "loader": self.stream.state_dict(),
                "stage": stage.index,
                "stage_step": self.step - stage.start,
            },
            # the model as this stage trains it (its RoPE, its layout)
            config=to_dict(stage.cfg),
            space=self.space,
            keep=self.cfg.train.keep_checkpoints,
            tokenizers=self.tokenizers.to_dict(),
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

            # one bar in one process: a thread lock, not tqdm's default multiprocessing
            # lock, whose semaphore a rank ended by the launcher would leave behind
            tqdm.set_lock(threading.RLock())
            progress = tqdm(
                total=t.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True
            )
        try:
            while self.step < t.steps:
                self._enter(stage_of(self.stages, self.step))
                last = self.train_step()
                if self.step % t.log_every == 0 or self.step == t.steps:
                    self.logger.log(self.step, last)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(
                        loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}"
                    )
                if (
                    self.eval_manifest is not None
                    and t.eval_every
                    and self.step % t.eval_every == 0
                ):
                    result = self.evaluate()
                    metrics = {"kind": "eval", **result.metrics("eval/")}
                    self.logger.log(self.step, metrics, self.eval_media(result))
                if (
                    t.checkpoint_every and self.step % t.checkpoint_every == 0
                ) or self.step == t.steps:
                    saved = self.save()
        except BaseException:
            # the error's line must stand alone: the bar is cleared, not left half drawn
            if progress is not None:
                progress.leave = False
                progress.close()
            self.stream.close()  # never waits on a fetch still in flight
            raise
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
        raise UserError(
            "--nproc starts local processes; under torchrun or the DeepSpeed launcher leave it out"
        )
    plan_run(cfg, world_size(nproc), resume)  # what the config decides fails here, not in a rank
    logs = Path(cfg.train.out_dir) / "logs"
    return run_world(train_worker, nproc, to_dict(cfg), resume, log_dir=logs)[0]
