"""One runtime for every caller: open the world, build model → Ulysses → engine, and one
training step.

``ulysses-mm train`` (the loop), ``measure`` (the estimate's check and the GPU benchmark),
``verify``, the benchmarks and the tests all call these three pieces; none of them writes
the sequence out again:

- :func:`open_world`: join the world a launcher describes (torchrun, the DeepSpeed
  launcher, ``--nproc``), or make a one-process world for DeepSpeed; the :class:`Mesh`;
  the device.
- :func:`build_runtime`: the model of the run config, Ulysses applied by
  :func:`~ulysses_mm.parallel.apply_ulysses`, the DeepSpeed engine (handed the model on the
  host: DeepSpeed casts it to the training precision before it moves it to the GPU).
- :func:`forward_backward` / :func:`train_step`: forward this rank's slice → the global
  loss (:func:`~ulysses_mm.parallel.global_loss`) → its loss scale → backward (→ the
  optimizer step), the loss scaled once, in one place.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ulysses_mm.config import RunConfig
from ulysses_mm.data.batch import Batch, sp_slice
from ulysses_mm.model import MultimodalLM, build_model
from ulysses_mm.model.attention import resolve_kernel
from ulysses_mm.parallel import CommStats, LossReport, Mesh, apply_ulysses, global_loss
from ulysses_mm.parallel.loss import loss_weights
from ulysses_mm.parallel.mesh import default_backend, in_launched_world, init_distributed
from ulysses_mm.tokenspace import TokenSpace


@dataclass(frozen=True)
class World:
    """This process's place in the run: the mesh, its device and the backend."""

    mesh: Mesh
    device: torch.device
    backend: str  # the torch.distributed backend ("none" for a lone process)


def _single_process_env() -> None:
    """DeepSpeed needs a process group even for one process; describe a one-rank world on
    a free loopback port (it would otherwise go looking for MPI)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def _group_env() -> None:
    """A process group made by hand (tests' spawner) describes itself to DeepSpeed, which
    reads RANK, LOCAL_RANK and WORLD_SIZE, as a launcher would have set them."""
    rank = str(dist.get_rank())
    os.environ.setdefault("RANK", rank)
    os.environ.setdefault("LOCAL_RANK", rank)
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))


def open_world(cfg: RunConfig, engine: bool = True, device: str | None = None) -> World:
    """Join the launched world (or the process group already made), build the mesh of
    ``parallel.sp`` × ``parallel.dp`` and pick the device: this rank's GPU under NCCL,
    else the CPU (``device`` overrides). ``engine``: also initialise DeepSpeed's
    communication (a lone process then gets a one-rank group, which DeepSpeed needs)."""
    backend = default_backend(cfg.parallel.backend)
    if dist.is_initialized():
        backend = str(dist.get_backend())
        _group_env()
    elif in_launched_world():
        init_distributed(backend, cfg.parallel.timeout_s)
    elif engine:
        _single_process_env()
        init_distributed(backend, cfg.parallel.timeout_s)
    if engine:
        import deepspeed

        deepspeed.init_distributed(backend, verbose=False)
    mesh = Mesh.build(cfg.parallel.sp, cfg.parallel.dp, cfg.parallel.ring)
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local}" if backend == "nccl" else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return World(mesh, dev, backend if dist.is_initialized() else "none")


def build_parallel_model(
    cfg: RunConfig, space: TokenSpace, mesh: Mesh, kernel: str, stats: CommStats | None = None
) -> MultimodalLM:
    """The run's model (seeded by ``train.seed``) with Ulysses applied over ``mesh.sp``,
    on the host; ``model.init_from`` loads a pretrained checkpoint into it first."""
    model = build_model(cfg.model, space, kernel, seed=cfg.train.seed)
    if cfg.model.init_from:
        from ulysses_mm.model.hf_import import load_pretrained

        load_pretrained(model, cfg.model.init_from)
    return apply_ulysses(model, mesh, stats)


@dataclass
class Runtime:
    """What a rank trains with: the model, its DeepSpeed engine and the loss weights."""

    cfg: RunConfig
    world: World
    space: TokenSpace
    kernel: str
    model: MultimodalLM
    engine: Any
    optimizer: Any
    scheduler: Any
    weights: Tensor

    @property
    def mesh(self) -> Mesh:
        return self.world.mesh

    @property
    def device(self) -> torch.device:
        return self.world.device

    def local(self, batch: Batch) -> Batch:
        """This rank's sequence-parallel slice of ``batch``, on its device."""
        return sp_slice(batch, self.mesh.sp_rank, self.mesh.sp, self.mesh.ring).to(self.device)


def build_runtime(
    cfg: RunConfig, space: TokenSpace, world: World, stats: CommStats | None = None
) -> Runtime:
    """Model → :func:`apply_ulysses` → DeepSpeed engine for this rank of ``world``."""
    from ulysses_mm.train.engine import build_engine

    kernel = resolve_kernel(cfg.parallel.attention, world.device.type, cfg.deepspeed.precision)
    model = build_parallel_model(cfg, space, world.mesh, kernel, stats)
    engine, optimizer, scheduler = build_engine(model, cfg, world.mesh)
    if world.device.type == "cuda":
        # logged and measured peaks are those of training, not of setting up
        torch.cuda.synchronize(world.device)
        torch.cuda.reset_peak_memory_stats(world.device)
    weights = loss_weights(space.modalities, cfg.model.loss_weights, world.device)
    return Runtime(cfg, world, space, kernel, model, engine, optimizer, scheduler, weights)


def _is_engine(module: nn.Module) -> bool:
    ds = sys.modules.get("deepspeed")  # an engine exists only once DeepSpeed is imported
    return ds is not None and isinstance(module, ds.DeepSpeedEngine)


def loss_of(
    module: nn.Module, local: Batch, weights: Tensor, mesh: Mesh
) -> tuple[Tensor, LossReport]:
    """Forward this rank's slice through ``module`` (a model or its DeepSpeed engine):
    (this rank's share of the global loss, the global report)."""
    sums, counts = module(
        local.input_ids, local.position_ids, local.doc_ids, local.labels, local.label_modality
    )
    model = cast(MultimodalLM, module.module if _is_engine(module) else module)
    return global_loss(sums, counts, weights, mesh, model.space.modalities)


def forward_backward(
    module: nn.Module, local: Batch, weights: Tensor, mesh: Mesh, scale: float = 1.0
) -> tuple[Tensor, LossReport]:
    """Forward, global loss, backward of this rank's share (times ``scale``); returns
    (the share, detached; the global report).

    Through a DeepSpeed engine the share is multiplied by the engine's loss scale
    (:func:`~ulysses_mm.train.engine.loss_scale`), so its dp-average of the gradients is
    the single-process gradient of the global batch; through a plain model the gradients
    summed over every rank are."""
    share, report = loss_of(module, local, weights, mesh)
    if _is_engine(module):
        from ulysses_mm.train.engine import loss_scale

        module.backward(share * (loss_scale(mesh) * scale))  # type: ignore[operator]
    else:
        (share * scale).backward()
    return share.detach(), report


@dataclass
class StepResult:
    """One optimizer step: each micro-batch's loss report and the gradient norm."""

    reports: list[LossReport] = field(default_factory=list)
    grad_norm: float = math.nan


def train_step(rt: Runtime, batches: Iterable[Batch], grad_norm: bool = True) -> StepResult:
    """One optimizer step over ``batches`` (the micro-batches of gradient accumulation,
    whole samples: each is sliced for this rank here): forward, backward and the
    engine's step for each (DeepSpeed steps the optimizer at the accumulation boundary)."""
    out = StepResult()
    pending = math.nan
    it = iter(batches)
    nxt = next(it, None)
    while nxt is not None:
        batch, nxt = nxt, next(it, None)
        _, report = forward_backward(rt.engine, rt.local(batch), rt.weights, rt.mesh)
        out.reports.append(report)
        if grad_norm and nxt is None and rt.engine.zero_optimization_stage() == 0:
            pending = _grad_norm(rt.model)  # reduced already; ZeRO-0 keeps no norm
        rt.engine.step()
    if grad_norm:
        out.grad_norm = _float(rt.engine.get_global_grad_norm(), pending)
    return out


def _float(x: Any, default: float = math.nan) -> float:
    if x is None:
        return default
    return float(x.item() if isinstance(x, torch.Tensor) else x)


@torch.no_grad()
def _grad_norm(model: nn.Module) -> float:
    grads = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else math.nan
