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
        resume.json           the step, its stage and the stages trained so far (what a
                              resumed run must keep)
    latest                    the tag of the newest COMPLETE checkpoint

Every rank writes its files (:mod:`~ulysses_mm.train.saver`, in the background), and only
once every rank's are complete rank 0 replaces ``latest`` atomically (temporary file +
rename). A crash at any point leaves ``latest`` on the previous complete checkpoint;
DeepSpeed reads ``latest`` too, so its own ``load_checkpoint(dir)`` agrees. The directory
may be an fsspec URL (:class:`CheckpointDir`): files are written locally, uploaded, and
``latest`` is written last. :func:`check_complete` checks that a
resumed checkpoint has those files, for the run's ZeRO stage, before any process
starts. Loading goes through the engine's safe (``weights_only``) reader; nothing here
unpickles.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import zipfile
from collections.abc import Iterator, Mapping
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from ulysses_mm.core import storage
from ulysses_mm.core.errors import DataError, StorageError, UserError, first_line
from ulysses_mm.core.storage import atomic_write_local
from ulysses_mm.core.tokenspace import SPACE_FILE, TokenSpace

LATEST = "latest"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "run_config.yaml"
TOKENIZERS_FILE = "tokenizers.json"
RESUME_FILE = "resume.json"  # the run's stage table as trained so far (what a resume must keep)
# DeepSpeed's optimizer partitions, one per rank (ZeRO >= 1; bf16_ before them in bf16)
_OPTIM_PARTITIONS = "*zero_pp_rank_*_mp_rank_00_optim_states.pt"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _atomic_text(path: Path, text: str) -> None:
    atomic_write_local(path, text.encode())


def consolidated_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Full model weights on rank 0 (None elsewhere); collective under ZeRO-3."""
    if engine.zero_optimization_stage() == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()  # gathers every partition
    else:
        sd = engine.module.state_dict()
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


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


def _saved_zero_stage(text: str | None, where: str) -> int | None:
    """The ZeRO stage in a checkpoint's run_config.yaml text (None when it records none)."""
    if text is None:
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise DataError(f"--resume: {where} is not readable YAML: {type(e).__name__}") from None
    ds = data.get("deepspeed") if isinstance(data, dict) else None
    stage = ds.get("zero_stage") if isinstance(ds, dict) else None
    return stage if isinstance(stage, int) else None


def check_complete(path: Path, zero_stage: int, ranks: int | None = None) -> None:
    """Local checkpoint ``path`` (a tag directory) is complete (:func:`check_files`), and
    DeepSpeed's states are readable torch zip archives."""

    config = path / CONFIG_FILE
    try:
        text = config.read_text() if config.is_file() else None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--resume: {config} is not readable YAML: {type(e).__name__}") from None
    names = sorted(p.name for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    for name in check_files(str(path), names, text, zero_stage, ranks):
        if not zipfile.is_zipfile(path / name):
            raise DataError(
                f"--resume: {path / name} is not a torch checkpoint (truncated or empty?)"
            )


def check_files(
    where: str, names: list[str], config_text: str | None, zero_stage: int, ranks: int | None
) -> list[str]:
    """Checkpoint ``where`` (its file ``names``) holds what resuming reads: DeepSpeed's
    model states for ``deepspeed.zero_stage``, its optimizer partitions under ZeRO >= 1,
    and the consolidated weights this module adds. With ``ranks`` (this run's dp × sp),
    partitioned states must come from as many ranks: DeepSpeed partitions them over
    dp × sp and does not re-partition them on load. A :class:`DataError` names the
    checkpoint and the first missing file; returns DeepSpeed's state files."""
    saved = _saved_zero_stage(config_text, f"{where}/{CONFIG_FILE}")
    if saved is not None and saved != zero_stage:
        raise DataError(
            f"--resume: checkpoint {where} was saved with deepspeed.zero_stage={saved}, this "
            f"run has deepspeed.zero_stage={zero_stage}; DeepSpeed resumes only the stage it saved"
        )
    pattern = model_states(zero_stage)
    found = [n for n in names if fnmatch(n, pattern)]
    if not found:
        other = model_states(0 if zero_stage == 3 else 3)
        hint = (
            f"; it holds {other}, written under another deepspeed.zero_stage"
            if any(fnmatch(n, other) for n in names)
            else ""
        )
        raise DataError(
            f"--resume: checkpoint {where} has no {pattern} (DeepSpeed's model states for "
            f"deepspeed.zero_stage={zero_stage}){hint}"
        )
    partitions = [n for n in names if fnmatch(n, _OPTIM_PARTITIONS)]
    if zero_stage >= 1 and not partitions:
        raise DataError(
            f"--resume: checkpoint {where} has no zero_pp_rank_*_optim_states.pt (DeepSpeed's "
            f"optimizer partitions for deepspeed.zero_stage={zero_stage})"
        )
    saved_ranks = len(partitions) or (len(found) if zero_stage == 3 else None)
    if ranks is not None and saved_ranks is not None and saved_ranks != ranks:
        raise DataError(
            f"--resume: checkpoint {where} holds the ZeRO partitions of {saved_ranks} ranks, "
            f"this run has dp × sp = {ranks}; DeepSpeed reloads partitioned states only onto "
            f"as many ranks (resume on {saved_ranks} ranks, or `ulysses-mm export {where} DIR` "
            "and start a new run with model.init_from=DIR)"
        )
    if MODEL_FILE not in names:
        raise DataError(f"--resume: checkpoint {where} has no {MODEL_FILE}; it is incomplete")
    return found + partitions


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


class CheckpointDir:
    """``train.checkpoint_dir``: a local directory or an fsspec URL (``s3://…``), with what
    the run does there (the pointer, the tags' files, uploads, downloads, pruning)."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.where = storage.Location(self.url, dict(options or {}))

    @classmethod
    def of(cls, cfg: Any) -> CheckpointDir:
        """The run config's checkpoint directory (storage options: ``data.storage_options``)."""
        t = cfg.train
        url = t.checkpoint_dir or str(Path(t.out_dir) / "checkpoints")
        return cls(url, cfg.data.storage_options)

    @property
    def is_local(self) -> bool:
        return self.where.is_local

    @property
    def local_path(self) -> Path:
        return self.where.local_path

    def url_of(self, tag: str, name: str = "") -> str:
        return f"{self.url}/{tag}" + (f"/{name}" if name else "")

    def latest_tag(self) -> str | None:
        """The tag ``latest`` names (None without one); see :func:`latest_tag`."""
        if self.is_local:
            return latest_tag(self.local_path)
        pointer = self.where.join(LATEST)
        with self._reaching(pointer.url):
            if not pointer.exists():
                return None
            data = pointer.read_bytes()
        try:
            tag = data.decode().strip()
        except UnicodeDecodeError:
            raise DataError(f"cannot read the checkpoint pointer {pointer}: not text") from None
        if not tag or "/" in tag or tag in (".", "..") or not tag.isprintable():
            raise DataError(f"{pointer} names {tag!r}, which is not a checkpoint directory")
        if not self.names(tag):
            raise DataError(f"{pointer} names {tag}, which does not exist")
        return tag

    def names(self, tag: str) -> list[str]:
        """The file names of checkpoint ``tag``."""
        if self.is_local:
            path = self.local_path / tag
            return sorted(p.name for p in path.iterdir() if p.is_file()) if path.is_dir() else []
        try:
            with self._reaching(self.url_of(tag)):
                return sorted(self.where.join(tag).list_names())
        except FileNotFoundError:
            return []

    def read_text(self, tag: str, name: str) -> str | None:
        url = self.url_of(tag, name)
        with self._reaching(url):
            where = self.where.at(url)
            if not where.exists():
                return None
            return where.read_bytes().decode()

    @staticmethod
    @contextlib.contextmanager
    def _reaching(url: str) -> Iterator[None]:
        """A remote fault reaching ``url`` (a refused connection, a timeout, a denied
        request) as one :class:`StorageError` line naming it; a missing file stays
        ``FileNotFoundError``."""
        try:
            yield
        except (FileNotFoundError, UserError):
            raise
        except Exception as e:
            raise StorageError(f"{url}: {first_line(e)}") from None

    def set_latest(self, tag: str) -> None:
        if self.is_local:
            _atomic_text(self.local_path / LATEST, tag + "\n")
        else:
            self.where.join(LATEST).atomic_write((tag + "\n").encode())

    def upload(self, tag: str, local_file: Path) -> None:
        """Copy ``local_file`` to ``tag/`` here (a temporary key, then moved)."""
        fs, path = self.where.at(self.url_of(tag, local_file.name)).filesystem()
        tmp = f"{path}.partial"
        fs.put_file(str(local_file), tmp)
        fs.mv(tmp, path)

    def download(self, tag: str, dest: Path) -> Path:
        """Checkpoint ``tag`` as a local directory ``dest/tag`` beside a ``latest`` naming
        it (what DeepSpeed's loader reads); returns ``dest``."""
        (dest / tag).mkdir(parents=True, exist_ok=True)
        for name in self.names(tag):
            if name.endswith(".partial"):
                continue
            data = self.where.at(self.url_of(tag, name)).read_bytes()
            atomic_write_local(dest / tag / name, data)
        _atomic_text(dest / LATEST, tag + "\n")
        return dest

    def prune(self, keep: int) -> None:
        """Remove checkpoints older than the newest ``keep`` complete ones."""
        if self.is_local:
            prune(self.local_path, keep)
            return
        current = self.latest_tag()
        if current is None or keep <= 0:
            return
        fs, root = self.where.filesystem()
        tags = sorted(
            p.rstrip("/").rsplit("/", 1)[-1]
            for p in fs.ls(root, detail=False)
            if p.rstrip("/").rsplit("/", 1)[-1].startswith("step_")
        )
        complete = [t for t in tags if t <= current]
        for tag in complete[:-keep]:
            fs.rm(f"{root}/{tag}", recursive=True)
