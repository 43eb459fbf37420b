"""Checkpoints: DeepSpeed state, loader state, config and token space, and a
``latest`` pointer that never points at a partial checkpoint.

Layout under ``RUN_DIR/checkpoints``::

    step_00000040/            DeepSpeed's files: mp_rank_00_model_states.pt (model, client
                              state; zero_pp_rank_R_... per rank under ZeRO-3) and, under
                              ZeRO >= 1, zero_pp_rank_R_mp_rank_00_optim_states.pt
        model.safetensors     the consolidated weights (what ``ulysses-mm export`` reads)
        run_config.yaml       the resolved run config
        token_space.json      the model's token space
        tokenizers.json       the tokenizer specs of its training data (what ``generate``
                              and ``evaluate`` tokenize and decode with)
    latest                    the tag of the newest COMPLETE checkpoint

Every rank writes its DeepSpeed files, then all ranks meet at a barrier, and only then
rank 0 replaces ``latest`` atomically (temporary file + rename). A crash at any point
leaves ``latest`` on the previous complete checkpoint; DeepSpeed reads ``latest`` too,
so its own ``load_checkpoint(dir)`` agrees. :func:`check_complete` checks that a
resumed checkpoint has those files, for the run's ZeRO stage, before any process
starts. Loading goes through the engine's safe (``weights_only``) reader; nothing here
unpickles.
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
from ulysses_mm.core.tokenspace import SPACE_FILE, TokenSpace

LATEST = "latest"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "run_config.yaml"
TOKENIZERS_FILE = "tokenizers.json"
# DeepSpeed's optimizer partitions, one per rank (ZeRO >= 1; bf16_ before them in bf16)
_OPTIM_PARTITIONS = "*zero_pp_rank_*_mp_rank_00_optim_states.pt"


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
    *,
    step: int,
    client_state: dict[str, Any],
    config: dict[str, Any],
    space: TokenSpace,
    keep: int,
    tokenizers: dict[str, Any] | None = None,
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
        if tokenizers is not None:
            _atomic_text(path / TOKENIZERS_FILE, json.dumps(tokenizers, indent=1) + "\n")
    _barrier()  # every rank's files are on disk
    if rank0:
        _atomic_text(ckpt_dir / LATEST, tag + "\n")
        prune(ckpt_dir, keep)
    _barrier()
    return ckpt_dir / tag


def latest_tag(ckpt_dir: Path) -> str | None:
    """The tag ``latest`` names (None without a ``latest`` file); a pointer that cannot be
    read, is empty, names anything but a directory beside it (a path, ``..``) or names
    none is a :class:`DataError` naming it."""
    pointer = ckpt_dir / LATEST
    if not pointer.exists():
        return None
    try:
        tag = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or "not text"
        raise DataError(f"cannot read the checkpoint pointer {pointer}: {why}") from None
    if not tag:
        raise DataError(f"{pointer} is empty; it must name a checkpoint directory beside it")
    if tag in (".", "..") or "/" in tag or "\\" in tag or not tag.isprintable():
        raise DataError(
            f"{pointer} names {tag!r}, which is not a checkpoint directory beside it "
            "(a tag is a plain directory name)"
        )
    if not (ckpt_dir / tag).is_dir():
        raise DataError(f"{pointer} names {tag}, which does not exist")
    return tag


def model_states(zero_stage: int) -> str:
    """The pattern of DeepSpeed's model-state files in a tag directory: one file below
    ZeRO-3, one per data-parallel rank under it (``engine._get_ckpt_name``)."""
    if zero_stage == 3:
        return "zero_pp_rank_*_mp_rank_00_model_states.pt"
    return "mp_rank_00_model_states.pt"


def _saved_zero_stage(path: Path) -> int | None:
    """The ZeRO stage in the checkpoint's run_config.yaml (None when it records none)."""
    f = path / CONFIG_FILE
    if not f.is_file():
        return None
    try:
        data = yaml.safe_load(f.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise DataError(f"--resume: {f} is not readable YAML: {type(e).__name__}") from None
    ds = data.get("deepspeed") if isinstance(data, dict) else None
    stage = ds.get("zero_stage") if isinstance(ds, dict) else None
    return stage if isinstance(stage, int) else None


def check_complete(path: Path, zero_stage: int, ranks: int | None = None) -> None:
    """Checkpoint ``path`` (a tag directory) holds what resuming reads: DeepSpeed's model
    states for ``deepspeed.zero_stage`` (each a readable torch zip archive), its
    optimizer partitions under ZeRO >= 1, and the consolidated weights this module adds.
    With ``ranks`` (this run's dp × sp), partitioned states must come from as many ranks:
    DeepSpeed partitions them over dp × sp and does not re-partition them on load.
    A :class:`DataError` names the path and the first missing file."""
    import zipfile

    saved = _saved_zero_stage(path)
    if saved is not None and saved != zero_stage:
        raise DataError(
            f"--resume: checkpoint {path} was saved with deepspeed.zero_stage={saved}, this "
            f"run has deepspeed.zero_stage={zero_stage}; DeepSpeed resumes only the stage it saved"
        )
    pattern = model_states(zero_stage)
    found = sorted(path.glob(pattern))
    if not found:
        other = model_states(0 if zero_stage == 3 else 3)
        hint = (
            f"; it holds {other}, written under another deepspeed.zero_stage"
            if any(path.glob(other))
            else ""
        )
        raise DataError(
            f"--resume: checkpoint {path} has no {pattern} (DeepSpeed's model states for "
            f"deepspeed.zero_stage={zero_stage}){hint}"
        )
    partitions = sorted(path.glob(_OPTIM_PARTITIONS))
    if zero_stage >= 1 and not partitions:
        raise DataError(
            f"--resume: checkpoint {path} has no zero_pp_rank_*_optim_states.pt (DeepSpeed's "
            f"optimizer partitions for deepspeed.zero_stage={zero_stage})"
        )
    saved_ranks = len(partitions) or (len(found) if zero_stage == 3 else None)
    if ranks is not None and saved_ranks is not None and saved_ranks != ranks:
        raise DataError(
            f"--resume: checkpoint {path} holds the ZeRO partitions of {saved_ranks} ranks, "
            f"this run has dp × sp = {ranks}; DeepSpeed reloads partitioned states only onto "
            f"as many ranks (resume on {saved_ranks} ranks, or `ulysses-mm export {path} DIR` "
            "and start a new run with model.init_from=DIR)"
        )
    for f in found + partitions:
        if not zipfile.is_zipfile(f):
            raise DataError(f"--resume: {f} is not a torch checkpoint (truncated or empty?)")
    if not (path / MODEL_FILE).is_file():
        raise DataError(f"--resume: checkpoint {path} has no {MODEL_FILE}; it is incomplete")


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
