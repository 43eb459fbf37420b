"""The DeepSpeed engine, built from the run config, with the sequence-parallel group
handed to it.

DeepSpeed learns about Ulysses through an ``mpu`` object (the interface of
``deepspeed.runtime.sequence_parallel.parallel_state_sp``): gradients are then reduced
and ZeRO partitions laid over the sequence-data-parallel group (all dp × sp ranks) and
averaged by dp = world / sp. Our per-rank loss share (see ``parallel.loss``) adds up over
all ranks to the global loss, so :func:`loss_scale` multiplies it by dp to undo that
average: the optimizer then sees exactly the single-process gradient.

Checkpoints are read back without unpickling arbitrary objects: the engine's checkpoint
reader is replaced by one that calls ``torch.load(weights_only=True)`` with only the few
DeepSpeed classes its state holds allow-listed.

The engine's ZeRO stages call torch collectives that torch marks deprecated; the
``FutureWarning`` each rank would print names torch's code, not a thing the user can
change, so :func:`quiet_deprecated_collectives` filters exactly those messages.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ulysses_mm.config import RunConfig, deep_merge
from ulysses_mm.parallel.mesh import Mesh
from ulysses_mm.train.schedule import lr_schedule

# The torch.distributed functions DeepSpeed (0.19) calls that torch (2.13) marks
# deprecated, each warning once per rank from torch's collective wrapper.
DEPRECATED_COLLECTIVES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "_all_gather_base",
    "_reduce_scatter_base",
    "all_reduce_coalesced",
)


def quiet_deprecated_collectives() -> None:
    """Filter torch's ``FutureWarning`` on the :data:`DEPRECATED_COLLECTIVES` (by its
    message and torch's module), in this process; every other warning still shows."""
    names = "|".join(re.escape(n) for n in DEPRECATED_COLLECTIVES)
    warnings.filterwarnings(
        "ignore",
        message=rf"`torch\.distributed\.({names})` ",
        category=FutureWarning,
        module=r"torch\.distributed\.",
    )


class SequenceParallelMPU:
    """Our :class:`Mesh` in the shape DeepSpeed's engine and ZeRO query."""

    initialize_sequence_parallel = True  # marks an SP-aware mpu for deepspeed.utils.groups

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def get_sequence_parallel_group(self):
        return self.mesh.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.sp

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.sp_rank

    def get_sequence_data_parallel_group(self):
        return self.mesh.world_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.mesh.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.mesh.rank

    # DeepSpeed aliases model parallelism to SP for this kind of mpu
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


def loss_scale(mesh: Mesh) -> float:
    """Factor on each rank's loss share so DeepSpeed's dp-average yields the global gradient."""
    return float(mesh.dp)


def ds_config(cfg: RunConfig, mesh: Mesh) -> dict[str, Any]:
    """The ds_config dict for this run on ``mesh`` (``deepspeed.extra`` merged last; the
    settings that clash are refused by :class:`~ulysses_mm.config.DeepSpeedConfig`)."""
    sp = mesh.sp
    d = cfg.deepspeed
    opt = d.optimizer
    zero: dict[str, Any] = {"stage": d.zero_stage}
    if d.zero_stage == 3 and sp > 1:
        # ZeRO-3's reduce-scatter path averages gradients over all dp × sp ranks (it does
        # not undo the SP factor), which halves them at sp=2; its contiguous all-reduce path
        # divides by dp as the other stages do. tests/distributed/test_engine.py checks the gradients.
        zero["reduce_scatter"] = False
    if d.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": d.offload_optimizer}
    if d.offload_param != "none":  # with ZeRO-3 (DeepSpeedConfig checks it)
        zero["offload_param"] = {"device": d.offload_param}
    params: dict[str, Any] = {"lr": opt.lr, "eps": opt.eps, "weight_decay": opt.weight_decay}
    if opt.type != "SGD":
        params["betas"] = list(opt.betas)
        # torch's Adam(W) inside DeepSpeed: no JIT-compiled op; CPU offload needs DeepSpeed's
        params["torch_adam"] = opt.torch_adam and d.offload_optimizer == "none"
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.data.micro_batch_size,
        "gradient_accumulation_steps": d.gradient_accumulation_steps,
        "gradient_clipping": d.gradient_clipping,
        "zero_optimization": zero,
        "bf16": {"enabled": d.precision == "bf16"},
        "fp16": {"enabled": d.precision == "fp16"},
        "optimizer": {"type": opt.type, "params": params},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "checkpoint": {"use_node_local_storage": False},
    }
    # No "scheduler" entry: the LR schedule (deepspeed.scheduler) is handed to
    # deepspeed.initialize by build_engine; see ulysses_mm.train.schedule for why it is
    # not DeepSpeed's WarmupCosineLR / WarmupLR.
    return copy.deepcopy(deep_merge(config, d.extra))


def _safe_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # lazy: DeepSpeed
    from deepspeed.runtime.zero.config import ZeroStageEnum  # lazy: DeepSpeed
    from deepspeed.utils.tensor_fragment import fragment_address  # lazy: DeepSpeed

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_engine_class():
    from deepspeed.runtime.checkpoint_engine import torch_checkpoint_engine  # lazy: DeepSpeed

    class SafeTorchCheckpointEngine(torch_checkpoint_engine.TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True``."""

        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(_safe_globals()):
                return torch.load(path, map_location=map_location, weights_only=True)

    return SafeTorchCheckpointEngine


def build_engine(
    model: torch.nn.Module,
    cfg: RunConfig,
    mesh: Mesh,
    stage_lr: Callable[[int], float] | None = None,
):
    """``deepspeed.initialize`` for this run; returns (engine, optimizer, scheduler).
    ``stage_lr`` multiplies the schedule's lr of each step (a staged run's re-warm-ups)."""
    import deepspeed  # lazy: after import_deepspeed named the accelerator (open_world)

    quiet_deprecated_collectives()
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config(cfg, mesh),
        mpu=SequenceParallelMPU(mesh) if mesh.sp > 1 else None,
        lr_scheduler=lr_schedule(cfg.deepspeed.scheduler, cfg.train.steps, stage_lr),
    )
    engine.checkpoint_engine = safe_engine_class()(engine._config)
    return engine, optimizer, scheduler
