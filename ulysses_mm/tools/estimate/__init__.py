"""``ulysses-mm estimate``: per-GPU memory of a training run, from its config alone.

Arithmetic over the run config, the token space and the step's sizes (nothing is built or
run): what each tensor of THIS implementation occupies on one rank at each phase of a
training step, and the peak over the phases. It answers "does N tokens fit on G GPUs of
M GB" and, by bisection over N, "what is the longest sequence that fits", so a layout can
be chosen before any GPU is held.

- ``shape.py``: the model's dimensions, the token space, the step's sizes (:class:`StepShape`).
- ``zero.py``: parameters, gradients and optimizer states under DeepSpeed's ZeRO stages.
- ``activations.py``: what a layer saves and the working sets; ``ring.py`` ring attention's.
- ``comm.py``: the bytes one rank sends per layer.
- ``phases.py``: the tensors live at each phase's high point.
- ``result.py``: :func:`estimate` (its options one :class:`EstimateOptions`), the peak,
  allocator headroom and runtime reserve.
- ``head_groups.py``: attention in head groups' sets (``parallel.head_groups``).
- ``search.py``: :func:`max_seq_len`, the longest sequence that fits (and
  :func:`best_head_groups`, over every head-group count).
- ``render.py``: the breakdown as text; ``cli.py``: the command.
- ``--time``: ``devices.py`` the GPU kinds' datasheet rows and the one efficiency set,
  ``documents.py`` the documents' attention pairs, ``step_time.py`` the step's time,
  ``render_time.py`` its lines, ``fastest.py`` ``--best`` over every layout of the world.
"""

from ulysses_mm.tools.estimate.activations import Activations, flex_block_mask_bytes
from ulysses_mm.tools.estimate.cli import run_cli
from ulysses_mm.tools.estimate.phases import Phase, Term
from ulysses_mm.tools.estimate.render import render
from ulysses_mm.tools.estimate.result import (
    CONTEXT_RESERVE_GIB,
    NCCL_GIB_PER_COMMUNICATOR,
    Estimate,
    EstimateOptions,
    estimate,
)
from ulysses_mm.tools.estimate.search import MAX_GRANULARITY, best_head_groups, max_seq_len
from ulysses_mm.tools.estimate.shape import (
    ModelShape,
    StepShape,
    model_shape,
    step_shape,
    token_space,
)
from ulysses_mm.tools.estimate.units import GiB
from ulysses_mm.tools.estimate.zero import DS_ZERO_DEFAULTS, ZeroStates

__all__ = [
    "CONTEXT_RESERVE_GIB",
    "DS_ZERO_DEFAULTS",
    "MAX_GRANULARITY",
    "NCCL_GIB_PER_COMMUNICATOR",
    "Activations",
    "Estimate",
    "EstimateOptions",
    "GiB",
    "ModelShape",
    "Phase",
    "StepShape",
    "Term",
    "ZeroStates",
    "best_head_groups",
    "estimate",
    "flex_block_mask_bytes",
    "max_seq_len",
    "model_shape",
    "render",
    "run_cli",
    "step_shape",
    "token_space",
]
