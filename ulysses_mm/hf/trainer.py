"""The Transformers ``Trainer`` on our shards: the data state in every checkpoint, and a
resume that continues the same order.

:class:`ShardStateCallback` writes the :class:`~ulysses_mm.hf.dataset.ShardDataset` state
reached by the steps trained (not by what the dataloader read ahead) as
``ulysses_mm_data.json`` into each ``checkpoint-N`` (JSON, written atomically by the main
process), and loads it when the Trainer resumes from ``checkpoint-N``. The Trainer's own
fast-forward (``skip_first_batches``) must then be off: ``ignore_data_skip=True``.

The dataset is the whole stream (``reader=None``) that Accelerate splits over the
processes, ``readers × micro_batch`` = world size × ``per_device_train_batch_size``. A
step trains ``gradient_accumulation_steps × per_device_train_batch_size × world / sp``
samples: under Accelerate's DeepSpeed sequence parallelism an SP group trains its ranks'
samples one after another. With dp = world / sp = 1 the resumed order is exactly the
uninterrupted one; with dp > 1 it is when the checkpoint step × gradient accumulation is
a multiple of sp (DeepSpeed's adapter reads sp micro-batches at a time).

:func:`weights_only_checkpoints` makes DeepSpeed's torch checkpoint engine, which the
Trainer resumes through and which by default unpickles whatever a checkpoint holds, load
weights only, with just the DeepSpeed classes its states hold allowed, as our own engine
does. :func:`start_deepspeed` starts DeepSpeed as ``ulysses-mm train`` does: nothing
compiled on a CPU run, no warning that is not the user's to act on.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.core.storage import atomic_write_local
from ulysses_mm.hf.dataset import ShardDataset
from ulysses_mm.parallel.mesh import import_deepspeed
from ulysses_mm.train.engine import quiet_deprecated_collectives, safe_engine_class

DATA_STATE = "ulysses_mm_data.json"


def start_deepspeed() -> None:
    """DeepSpeed for a ``Trainer`` or ``SFTTrainer`` run, started as ``ulysses-mm train``
    starts it; call it first (the ``TrainingArguments`` import DeepSpeed).

    The deprecation warnings of the torch collectives DeepSpeed's ZeRO calls are filtered
    (:func:`~ulysses_mm.train.engine.quiet_deprecated_collectives`). On a host without CUDA
    DeepSpeed is imported for gloo (:func:`~ulysses_mm.parallel.mesh.import_deepspeed`: the
    CPU named as its accelerator, its shared-memory op, which training never calls, not
    compiled) and its communication started here, over gloo: Accelerate starts it only off
    the CPU (``accelerate/state.py``, ``PartialState``: ``if not cpu ...:
    deepspeed.comm.init_distributed``). The arguments then need ``use_cpu=True``: without
    it, on a host without CUDA, Accelerate counts one process and does not split the
    dataloader, and DeepSpeed's SP adapter would train every sample sp times."""
    quiet_deprecated_collectives()
    if torch.cuda.is_available():
        return
    import_deepspeed("gloo").init_distributed(dist_backend="gloo", verbose=False)


def world_size() -> int:
    """The processes of the run (the Trainer's ``args.world_size`` can say 1 before its
    state is set up)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def parallelism_config(args: Any) -> Any:
    """The Accelerator's parallelism config: ``args.parallelism_config``, or, where that
    is None (``accelerate launch --config_file`` with ``parallelism_config_sp_size``), the
    one Accelerate built from its environment (``AcceleratorState``)."""
    pc = getattr(args, "parallelism_config", None)
    if pc is None:
        from accelerate.state import AcceleratorState  # lazy: read on the YAML route only

        pc = AcceleratorState._shared_state.get("parallelism_config")
    return pc


def sp_size(args: Any) -> int:
    """The sequence-parallel size the Accelerator trains with (see
    :func:`parallelism_config`)."""
    pc = parallelism_config(args)
    return int(pc.sp_size) if pc is not None and pc.sp_size else 1


def samples_per_step(args: Any) -> int:
    """Samples of the global stream one optimizer step trains."""
    per_refill = args.per_device_train_batch_size * world_size()
    return args.gradient_accumulation_steps * per_refill // sp_size(args)


class ShardStateCallback(TrainerCallback):
    """Save the data state with every checkpoint; load it on resume (see the module
    docstring). ``resume_from``: the checkpoint directory when it is not
    ``output_dir/checkpoint-<step>``."""

    def __init__(self, dataset: ShardDataset, resume_from: str | Path | None = None) -> None:
        if dataset.reader is not None:
            raise ConfigError(
                "the Trainer splits the dataset over its processes: give it the whole stream "
                "(ShardDataset(..., reader=None))"
            )
        self.dataset = dataset
        self.resume_from = resume_from
        self.start_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        per_refill = args.per_device_train_batch_size * world_size()
        if self.dataset.batch_items != per_refill:
            raise ConfigError(
                f"ShardDataset steps {self.dataset.batch_items} samples at a time, the Trainer "
                f"reads {per_refill} (per_device_train_batch_size × world size): give it "
                "readers=world size and micro_batch=per_device_train_batch_size"
            )
        self.start_step = state.global_step
        if state.global_step == 0:
            return
        if not args.ignore_data_skip:
            raise ConfigError(
                "resuming on a ShardDataset: set TrainingArguments(ignore_data_skip=True) (the "
                "dataset continues from its own state; the Trainer would skip batches again)"
            )
        where = Path(self.resume_from or Path(args.output_dir) / f"checkpoint-{state.global_step}")
        path = where / DATA_STATE
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: no readable data state to resume from ({e})") from None
        self.dataset.load_state_dict(saved)

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        trained = (state.global_step - self.start_step) * samples_per_step(args)
        data = self.dataset.state_after(trained)
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        atomic_write_local(folder / DATA_STATE, (json.dumps(data) + "\n").encode())


@contextlib.contextmanager
def weights_only_checkpoints() -> Iterator[None]:
    """Inside the block DeepSpeed's torch checkpoint engine loads with
    ``weights_only=True`` (an allow-list of its own classes) instead of unpickling."""
    from deepspeed.runtime.checkpoint_engine import torch_checkpoint_engine  # lazy: DeepSpeed

    TorchCheckpointEngine = torch_checkpoint_engine.TorchCheckpointEngine
    original = TorchCheckpointEngine.load
    TorchCheckpointEngine.load = safe_engine_class().load  # type: ignore[method-assign]
    try:
        yield
    finally:
        TorchCheckpointEngine.load = original  # type: ignore[method-assign]
