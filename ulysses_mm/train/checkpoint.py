"""Checkpoints: DeepSpeed state, loader state, config and token space, and a
``latest`` pointer that never points at a partial checkpoint.

Layout under ``RUN_DIR/checkpoints``::

    step_00000040/            DeepSpeed's files (model, optimizer / ZeRO partitions, client state)
        model.safetensors     the consolidated weights (what ``ulysses-mm export`` reads)
        run_config.yaml       the resolved run config
        token_space.json      the model's token space
    latest                    the tag of the newest COMPLETE checkpoint

Every rank writes its DeepSpeed files, then all ranks meet at a barrier, and only then
rank 0 replaces ``latest`` atomically (temporary file + rename). A crash at any point
leaves ``latest`` on the previous complete checkpoint; DeepSpeed reads ``latest`` too,
so its own ``load_checkpoint(dir)`` agrees. Loading goes through the engine's safe
(``weights_only``) reader; nothing here unpickles.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.storage import atomic_write_local
from ulysses_mm.core.tokenspace import TokenSpace

LATEST = "latest"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "run_config.yaml"
SPACE_FILE = "token_space.json"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _atomic_text(path: Path, text: str) -> None:
    atomic_write_local(path, text.encode())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def consolidated_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Full model weights on rank 0 (None elsewhere); collective under ZeRO-3."""
    if engine.zero_optimization_stage() == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()  # gathers every partition
    else:
        sd = engine.module.state_dict()
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def save(
    engine,
    ckpt_dir: Path,
    step: int,
    client_state: dict[str, Any],
    config: dict[str, Any],
    space: TokenSpace,
    keep: int,
) -> Path:
    from safetensors.torch import save as save_safetensors

    tag = tag_for(step)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    _barrier()
    engine.save_checkpoint(
        str(ckpt_dir), tag=tag, client_state={"step": step, **client_state}, save_latest=False
    )
    weights = consolidated_state_dict(engine)
    if rank0:
        path = ckpt_dir / tag
        assert weights is not None
        atomic_write_local(
            path / MODEL_FILE, save_safetensors(weights, metadata={"step": str(step)})
        )
        _atomic_text(path / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False))
        _atomic_text(path / SPACE_FILE, json.dumps(space.to_dict(), indent=1) + "\n")
    _barrier()  # every rank's files are on disk
    if rank0:
        _atomic_text(ckpt_dir / LATEST, tag + "\n")
        prune(ckpt_dir, keep)
    _barrier()
    return ckpt_dir / tag


def latest_tag(ckpt_dir: Path) -> str | None:
    """The tag ``latest`` names (None without a ``latest`` file); a pointer that is empty
    or names no checkpoint directory is a :class:`DataError` naming it."""
    pointer = ckpt_dir / LATEST
    if not pointer.exists():
        return None
    tag = pointer.read_text().strip()
    if not tag:
        raise DataError(f"{pointer} is empty; it must name a checkpoint directory beside it")
    if not (ckpt_dir / tag).is_dir():
        raise DataError(f"{pointer} names {tag}, which does not exist")
    return tag


def prune(ckpt_dir: Path, keep: int) -> None:
    """Remove checkpoints older than the newest ``keep`` complete ones, and any partial
    one (a tag newer than ``latest`` left by a crash is overwritten on the next save)."""
    current = latest_tag(ckpt_dir)
    if current is None:
        return
    tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step_"))
    complete = [t for t in tags if t <= current]
    doomed = complete[:-keep] if keep > 0 else []
    for tag in doomed:
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)


def saved_token_space(path: Path) -> TokenSpace | None:
    """The token space a checkpoint (tag directory) was trained on, when it recorded one."""
    f = path / SPACE_FILE
    if not f.exists():
        return None
    try:
        return TokenSpace.from_dict(json.loads(f.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{f}: not a token space: {e}") from e


def load(engine, ckpt_dir: Path) -> dict[str, Any]:
    """Restore the engine from ``latest``; returns the client state (step, loader, ...)."""
    tag = latest_tag(ckpt_dir)
    if tag is None:
        raise DataError(f"no checkpoint to resume from in {ckpt_dir} (no '{LATEST}' file)")
    path, client = engine.load_checkpoint(
        str(ckpt_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise DataError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    return client


def read_checkpoint_dir(path: Path) -> Path:
    """A checkpoint directory from a run dir, a checkpoints dir or a tag dir."""
    for candidate in (path, path / "checkpoints"):
        if (candidate / MODEL_FILE).exists():
            return candidate
        tag = latest_tag(candidate) if (candidate / LATEST).exists() else None
        if tag is not None:
            return candidate / tag
    raise DataError(f"{path}: no checkpoint found (expected {MODEL_FILE} or a '{LATEST}' pointer)")
