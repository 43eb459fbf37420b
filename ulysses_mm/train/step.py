"""One setup and one step for every caller: build model → Ulysses → engine, and one
training step.

``ulysses-mm train`` (the loop), ``measure`` (the estimate's check and the GPU benchmark),
``verify``, the benchmarks and the tests all call these pieces; none of them writes
the sequence out again:

- :func:`~ulysses_mm.parallel.mesh.open_world` (first): join the world a launcher
  describes, the :class:`Mesh`, the device.
- :func:`build_setup`: the model of the run config, its memory policy applied by
  :func:`~ulysses_mm.model.apply_memory_policy`, Ulysses by
  :func:`~ulysses_mm.parallel.apply_ulysses` and the loss balance by
  :func:`~ulysses_mm.parallel.apply_loss_balance`, the DeepSpeed engine (handed the model
  on the host: DeepSpeed casts it to the training precision before it moves it to the GPU).
- :func:`build_inference_setup`: the same model with trained weights, laid out the same
  way, without an engine (evaluation, generation).
- :func:`forward_backward` / :func:`train_step`: forward this rank's slice → the global
  loss (:func:`~ulysses_mm.parallel.global_loss`) → its loss scale → backward (→ the
  optimizer step), the loss scaled once, in one place.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ulysses_mm.config import RunConfig
from ulysses_mm.core.format import IGNORE
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.batch import Batch
from ulysses_mm.model import LossOutput, MultimodalLM, Offload, apply_memory_policy, build_model
from ulysses_mm.model.attention import PRECISION_DTYPES, resolve_kernel
from ulysses_mm.model.hf_import import load_pretrained
from ulysses_mm.parallel import (
    CommStats,
    LossReport,
    Mesh,
    apply_loss_balance,
    apply_ulysses,
    global_loss,
)
from ulysses_mm.parallel.loss import loss_weights
from ulysses_mm.parallel.mesh import Place
from ulysses_mm.parallel.slice import sp_slice
from ulysses_mm.train import engine as deepspeed_engine


def lay_out(
    model: MultimodalLM,
    cfg: RunConfig,
    mesh: Mesh,
    stats: CommStats | None = None,
    offload: Offload | None = None,
    head_groups: int | None = None,
) -> Offload | None:
    """Lay a built model out for this run, in place, the one way every caller does (the
    setup, a stage's entry, evaluation): the memory policy of ``cfg.model`` (``offload``:
    the host copies' owner, made when the policy offloads and none is given; returned),
    Ulysses over ``mesh.sp`` (in ``head_groups`` groups of heads, default
    ``parallel.head_groups``), the loss balance over the SP group."""
    offload = apply_memory_policy(model, cfg.model, offload)
    groups = cfg.parallel.head_groups if head_groups is None else head_groups
    apply_ulysses(model, mesh, stats, head_groups=groups)
    apply_loss_balance(model, mesh)
    return offload


def build_parallel_model(
    cfg: RunConfig,
    space: TokenSpace,
    mesh: Mesh,
    kernel: str,
    stats: CommStats | None = None,
    offload: Offload | None = None,
) -> MultimodalLM:
    """The run's model (seeded by ``train.seed``) laid out by :func:`lay_out`, on the
    host; ``model.init_from`` loads a pretrained checkpoint into it first."""
    model = build_model(cfg.model, space, kernel, seed=cfg.train.seed)
    if cfg.model.init_from:
        load_pretrained(model, cfg.model.init_from)
    lay_out(model, cfg, mesh, stats, offload)
    return model


@dataclass
class Setup:
    """What a rank trains with: the model, its DeepSpeed engine and the loss weights."""

    cfg: RunConfig
    place: Place
    space: TokenSpace
    kernel: str
    model: MultimodalLM
    engine: Any
    optimizer: Any
    scheduler: Any
    weights: Tensor
    # the layout the engine was built on: its gradient average (and so the loss scale)
    # stays that layout's when a staged run lays the model out again
    engine_mesh: Mesh | None = None
    # the host copies of offloaded checkpoints (model.offload_checkpoints), else None
    offload: Offload | None = None

    @property
    def mesh(self) -> Mesh:
        return self.place.mesh

    @property
    def device(self) -> torch.device:
        return self.place.device

    def slice_of(self, batch: Batch) -> Batch:
        """This rank's sequence-parallel slice of ``batch``, on its device."""
        return sp_slice(batch, self.mesh.sp_rank, self.mesh.sp, self.mesh.ring_size).to(self.device)


def build_setup(
    cfg: RunConfig,
    space: TokenSpace,
    place: Place,
    stats: CommStats | None = None,
    stage_lr: Callable[[int], float] | None = None,
) -> Setup:
    """Model → :func:`lay_out` → DeepSpeed engine on this process's ``place``
    (``stage_lr``: a staged run's re-warm-up factor of each step, on the schedule's lr)."""

    kernel = resolve_kernel(cfg.parallel.attention, place.device.type, cfg.deepspeed.precision)
    offload = Offload() if cfg.model.offload_checkpoints else None
    model = build_parallel_model(cfg, space, place.mesh, kernel, stats, offload)
    engine, optimizer, scheduler = deepspeed_engine.build_engine(model, cfg, place.mesh, stage_lr)
    if place.device.type == "cuda":
        # logged and measured peaks are those of training, not of setting up
        torch.cuda.synchronize(place.device)
        torch.cuda.reset_peak_memory_stats(place.device)
    weights = loss_weights(space.modalities, cfg.model.loss_weights, place.device)
    return Setup(
        cfg, place, space, kernel, model, engine, optimizer, scheduler, weights, place.mesh, offload
    )


def build_inference_setup(
    cfg: RunConfig,
    space: TokenSpace,
    place: Place,
    load: Callable[[MultimodalLM], None],
    dtype: torch.dtype | None = None,
) -> Setup:
    """What evaluation and generation run on this process's ``place``: the run's model with
    its weights put in by ``load``, its memory policy, Ulysses (all heads at once) and the
    loss balance applied over ``place.mesh``, cast to ``dtype``
    (default: the training precision, as DeepSpeed casts it) on the device, in eval mode.
    No engine and no optimizer state: ``engine`` is the model itself, which
    :func:`forward_loss` takes as it takes an engine."""
    dtype = dtype or PRECISION_DTYPES[cfg.deepspeed.precision]
    kernel = resolve_kernel(cfg.parallel.attention, place.device.type, dtype)
    model = build_model(cfg.model, space, kernel, seed=cfg.train.seed)
    load(model)
    # all heads at once: there is no backward to save memory for
    offload = lay_out(model, cfg, place.mesh, head_groups=1)
    model.to(device=place.device, dtype=dtype).eval()
    weights = loss_weights(space.modalities, cfg.model.loss_weights, place.device)
    return Setup(cfg, place, space, kernel, model, model, None, None, weights, None, offload)


def _is_engine(module: nn.Module) -> bool:
    ds = sys.modules.get("deepspeed")  # an engine exists only once DeepSpeed is imported
    return ds is not None and isinstance(module, ds.DeepSpeedEngine)


def forward_loss(
    module: nn.Module,
    local: Batch,
    weights: Tensor,
    mesh: Mesh,
    bins: Tensor | None = None,
    num_bins: int = 0,
    step_counts: Tensor | None = None,
) -> tuple[Tensor, LossReport]:
    """Forward this rank's slice through ``module`` (a model or its DeepSpeed engine):
    (this rank's share of the global loss, the global report). With ``bins`` [b, n] (each
    target's bin, -1 for none; evaluation), the report also holds this rank's CE sums per
    modality and bin (``by_bin``). With ``step_counts`` the share is of the whole step's
    loss (:func:`~ulysses_mm.parallel.global_loss`)."""
    args = (local.input_ids, local.position_ids, local.doc_ids, local.labels, local.label_modality)
    out: LossOutput = module(*args) if bins is None else module(*args, bins, num_bins)
    model = cast(MultimodalLM, module.module if _is_engine(module) else module)
    share, report = global_loss(
        out.ce_sum, out.targets, weights, mesh, model.space.modalities, step_counts
    )
    if out.ce_by_bin is not None:
        report.by_bin = out.ce_by_bin.detach()
    if out.hits_by_bin is not None:
        report.hits_by_bin = out.hits_by_bin.detach()
    return share, report


def forward_backward(
    module: nn.Module,
    local: Batch,
    weights: Tensor,
    mesh: Mesh,
    scale: float = 1.0,
    engine_mesh: Mesh | None = None,
    step_counts: Tensor | None = None,
) -> tuple[Tensor, LossReport]:
    """Forward, global loss, backward of this rank's share (times ``scale``); returns
    (the share, detached; the global report).

    Through a DeepSpeed engine the share is multiplied by the engine's loss scale
    (:func:`~ulysses_mm.train.engine.loss_scale` of ``engine_mesh``, the layout the
    engine was built on; default ``mesh``), so its dp-average of the gradients is the
    single-process gradient of the global batch; through a plain model the gradients
    summed over every rank are. With ``step_counts`` (:func:`step_counts`) the share is
    already of the whole step's loss, so the engine does not divide it by the
    accumulation steps again."""
    share, report = forward_loss(module, local, weights, mesh, step_counts=step_counts)
    if _is_engine(module):
        factor = deepspeed_engine.loss_scale(engine_mesh or mesh) * scale
        whole_step = step_counts is not None
        module.backward(share * factor, scale_wrt_gas=not whole_step)  # type: ignore[operator]
    else:
        (share * scale).backward()
    return share.detach(), report


@dataclass
class StepResult:
    """One optimizer step: each micro-batch's loss report and the gradient norm."""

    reports: list[LossReport] = field(default_factory=list)
    grad_norm: float = math.nan


def step_counts(batches: Sequence[Batch], mesh: Mesh, modalities: int, device: Any) -> Tensor:
    """[M] float64: the targets of each modality in a whole step, ``batches`` (this DP
    group's micro-batches, whole samples) summed over every DP group (one all-reduce)."""
    counts = torch.zeros(modalities, dtype=torch.float64)
    for b in batches:
        which = b.label_modality[b.labels != IGNORE]
        counts += torch.bincount(which[which >= 0], minlength=modalities).double()
    counts = counts.to(device)
    if mesh.dp > 1:
        dist.all_reduce(counts, group=mesh.dp_group)
    return counts


def train_step(setup: Setup, batches: Iterable[Batch], grad_norm: bool = True) -> StepResult:
    """One optimizer step over ``batches`` (the micro-batches of gradient accumulation,
    whole samples: each is sliced for this rank here): forward, backward and the
    engine's step for each (DeepSpeed steps the optimizer at the accumulation boundary).
    The step's loss is token-weighted over all of them (:func:`step_counts`), so it does
    not depend on how the step's samples are spread over micro-steps and DP ranks."""
    out = StepResult()
    pending = math.nan
    batches = list(batches)
    counts = step_counts(batches, setup.mesh, len(setup.space.modalities), setup.weights.device)
    it = iter(batches)
    nxt = next(it, None)
    while nxt is not None:
        batch, nxt = nxt, next(it, None)
        local = setup.slice_of(batch)
        _, report = forward_backward(
            setup.engine,
            local,
            setup.weights,
            setup.mesh,
            engine_mesh=setup.engine_mesh,
            step_counts=counts,
        )
        out.reports.append(report)
        if grad_norm and nxt is None and setup.engine.zero_optimization_stage() == 0:
            pending = _grad_norm(setup.model)  # reduced already; ZeRO-0 keeps no norm
        setup.engine.step()
    if grad_norm:
        out.grad_norm = _float(setup.engine.get_global_grad_norm(), pending)
    return out


def _float(x: Any, default: float = math.nan) -> float:
    if x is None:
        return default
    return float(x.item() if isinstance(x, torch.Tensor) else x)


@torch.no_grad()
def _grad_norm(model: nn.Module) -> float:
    grads = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else math.nan
