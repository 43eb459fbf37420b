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
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ulysses_mm.config import RunConfig, from_dict, to_dict
from ulysses_mm.data.batch import make_batch, sp_slice
from ulysses_mm.data.manifest import Manifest
from ulysses_mm.data.stream import ShardStream
from ulysses_mm.model import build_model
from ulysses_mm.model.attention import resolve_kernel
from ulysses_mm.parallel import Mesh, apply_ulysses, global_loss, loss_weights
from ulysses_mm.parallel.mesh import default_backend, in_launched_world, init_distributed
from ulysses_mm.parallel.ulysses import check_sp_shapes
from ulysses_mm.tokenspace import TokenSpace
from ulysses_mm.train import checkpoint
from ulysses_mm.train.engine import build_engine, loss_scale
from ulysses_mm.train.metrics import (
    MetricsLogger,
    causal_pairs,
    peak_memory_mb,
    peak_tflops,
    train_flops,
)

LN2 = math.log(2.0)


@dataclass
class TrainResult:
    steps: int
    run_dir: str
    checkpoint: str
    wandb_dir: str | None
    final_loss: float


def _single_process_env() -> None:
    """DeepSpeed needs a process group even for one process; make a one-rank world on a
    free loopback port (it would otherwise go looking for MPI)."""
    if in_launched_world():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def model_space(cfg: RunConfig, manifest: Manifest) -> TokenSpace:
    """The model's token space: the config's when it names one (and it must match the
    data's), else the data's."""
    if cfg.model.modalities:
        space = TokenSpace.from_vocab(cfg.model.modalities)
        manifest.check_token_space(space)
        return space
    return manifest.token_space


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class Trainer:
    def __init__(self, cfg: RunConfig, resume: bool = False) -> None:
        _single_process_env()
        init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s)
        import deepspeed

        deepspeed.init_distributed(default_backend(cfg.parallel.backend), verbose=False)
        self.cfg = cfg
        self.mesh = Mesh.build(cfg.parallel.sp, cfg.parallel.dp)
        self.rank0 = self.mesh.rank == 0
        self.device = _device(default_backend(cfg.parallel.backend))
        self.run_dir = Path(cfg.train.out_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        opts = cfg.data.storage_options
        if not cfg.data.train:
            raise ValueError("data.train is empty: give the manifest of the training shards")
        self.manifest = Manifest.load(cfg.data.train, opts)
        self.space = model_space(cfg, self.manifest)
        seq_len = cfg.data.seq_len or self.manifest.seq_len
        if seq_len != self.manifest.seq_len:
            raise ValueError(
                f"data.seq_len={seq_len} but the shards of {self.manifest.location} hold samples "
                f"of {self.manifest.seq_len} tokens; prepare the data again or set data.seq_len=0"
            )
        check_sp_shapes(seq_len, cfg.model.num_attention_heads, self.mesh.sp)
        self.eval_manifest = Manifest.load(cfg.data.eval, opts) if cfg.data.eval else None
        if self.eval_manifest is not None:
            self.eval_manifest.check_token_space(self.space)

        kernel = resolve_kernel(cfg.parallel.attention, self.device.type)
        model = build_model(cfg.model, self.space, kernel, seed=cfg.train.seed)
        apply_ulysses(model, self.mesh)
        self.engine, self.optimizer, self.scheduler = build_engine(
            model.to(self.device), cfg, self.mesh
        )
        self.model = model
        self.weights = loss_weights(self.space.modalities, cfg.model.loss_weights, self.device)
        self.stream = ShardStream(
            self.manifest,
            dp_rank=self.mesh.dp_rank,
            dp=self.mesh.dp,
            micro_batch=cfg.data.micro_batch_size,
            seed=cfg.data.seed,
            shuffle=cfg.data.shuffle,
            retries=cfg.data.retries,
            backoff_s=cfg.data.retry_backoff_s,
        )
        self.step = 0
        if resume:
            client = checkpoint.load(self.engine, self.ckpt_dir)
            self.step = int(client["step"])
            self.stream.load_state_dict(client["loader"])
        self.logger = MetricsLogger(cfg, self.run_dir, self.rank0, resume_step=self.step)
        self.tflops = peak_tflops(cfg, self.device)

    # ------------------------------------------------------------------ pieces
    def _local_batch(self, samples):
        batch = make_batch(
            [s.tokens.astype("int64") for s in samples], [s.segments for s in samples], self.space
        )
        return batch, sp_slice(batch, self.mesh.sp_rank, self.mesh.sp).to(self.device)

    def _forward(self, local):
        sums, counts = self.engine(
            local.input_ids, local.position_ids, local.doc_ids, local.labels, local.label_modality
        )
        return global_loss(sums, counts, self.weights, self.mesh, self.space.modalities)

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        gas = self.cfg.deepspeed.gradient_accumulation_steps
        sums = {m: 0.0 for m in self.space.modalities}
        counts = {m: 0 for m in self.space.modalities}
        totals, tokens, pairs = [], 0, 0.0
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step applies
        grad_norm = math.nan
        for micro in range(gas):
            full, local = self._local_batch(self.stream.next_batch())
            share, report = self._forward(local)
            self.engine.backward(share * loss_scale(self.mesh))
            if micro == gas - 1 and self.engine.zero_optimization_stage() == 0:
                grad_norm = _grad_norm(self.model)  # reduced already; ZeRO-0 keeps no norm
            self.engine.step()
            totals.append(report.total)
            for m, v in report.per_modality.items():
                sums[m] += v * report.counts[m]
                counts[m] += report.counts[m]
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
            "grad_norm": _float(self.engine.get_global_grad_norm(), grad_norm),
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
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        assert self.eval_manifest is not None
        stream = ShardStream(
            self.eval_manifest,
            dp_rank=self.mesh.dp_rank,
            dp=self.mesh.dp,
            micro_batch=self.cfg.data.micro_batch_size,
            seed=0,
            shuffle=False,
            retries=self.cfg.data.retries,
            backoff_s=self.cfg.data.retry_backoff_s,
        )
        batches = min(self.cfg.train.eval_batches, stream.batches_per_epoch)
        sums = {m: 0.0 for m in self.space.modalities}
        counts = {m: 0 for m in self.space.modalities}
        self.engine.eval()
        for _ in range(batches):
            _, local = self._local_batch(stream.next_batch())
            _, report = self._forward(local)
            for m, v in report.per_modality.items():
                sums[m] += v * report.counts[m]
                counts[m] += report.counts[m]
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
        return checkpoint.save(
            self.engine,
            self.ckpt_dir,
            self.step,
            {"loader": self.stream.state_dict()},
            to_dict(self.cfg),
            self.space,
            self.cfg.train.keep_checkpoints,
        )

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
        wandb_dir = self.logger.finish()
        return TrainResult(
            self.step, str(self.run_dir), str(saved), wandb_dir, float(last.get("loss", math.nan))
        )


def _float(x: Any, default: float = math.nan) -> float:
    if x is None:
        return default
    return float(x.item() if isinstance(x, torch.Tensor) else x)


@torch.no_grad()
def _grad_norm(model: torch.nn.Module) -> float:
    grads = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else math.nan


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
    return run_world(train_worker, nproc, to_dict(cfg), resume)[0]
