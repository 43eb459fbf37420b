"""A trained model, opened for ``generate`` and ``evaluate``: from a checkpoint or an export.

- a run directory, its ``checkpoints/`` or one ``step_*`` directory (``ulysses-mm train``):
  ``run_config.yaml``, ``token_space.json``, ``model.safetensors`` and the tokenizer record
  ``tokenizers.json`` (a checkpoint without one takes it from its run's data manifests);
- an ``ulysses-mm export`` directory: ``config.json``, ``model.safetensors``,
  ``token_space.json`` and ``tokenizers.json``. A transformers checkpoint without
  ``token_space.json`` has no modality heads and is refused.

What the user can get wrong (no such directory, a modality the model lacks, a tokenizer
that cannot be found) is one line naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from ulysses_mm.config import RunConfig, from_dict, read_yaml
from ulysses_mm.core.errors import DataError, NotFoundError, first_line
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.model import MultimodalLM
from ulysses_mm.model.attention import PRECISION_DTYPES
from ulysses_mm.model.hf_import import load_pretrained, model_section
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.tokenize.base import Tokenizer
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.table import TokenizerTable
from ulysses_mm.train.checkpoint import (
    CONFIG_FILE,
    LATEST,
    MODEL_FILE,
    SPACE_FILE,
    TOKENIZERS_FILE,
    read_checkpoint_dir,
)
from ulysses_mm.train.plan import train_entries


@dataclass
class Trained:
    """What a checkpoint or export holds: its run config (for an export, the model
    section of its config.json), token space, tokenizer record and weights."""

    path: Path
    cfg: RunConfig
    space: TokenSpace
    tokenizers: TokenizerTable
    export: bool = False
    step: int | None = None

    def check_modality(self, modality: str) -> None:
        if modality not in self.space.modalities:
            raise DataError(
                f"{self.path}: the model has no {modality!r} modality (its token space: "
                f"{', '.join(self.space.modalities)})"
            )

    def tokenizer(self, modality: str, spec: str | None = None) -> Tokenizer:
        """``modality``'s tokenizer: ``spec`` when given (its modality and vocabulary must be
        the model's), else the one the record names."""
        self.check_modality(modality)
        if spec is not None:
            tok = load_tokenizer(spec)
            size = self.space.range(modality).size
            if tok.modality != modality or tok.spec.vocab_size != size:
                raise DataError(
                    f"{spec}: a {tok.modality} tokenizer of {tok.spec.vocab_size} ids; the "
                    f"model's {modality} range has {size}"
                )
            return tok
        try:
            return self.tokenizers.tokenizer(modality)
        except LookupError as e:
            raise DataError(
                f"{self.path}: cannot load the {modality} tokenizer of its training data: {e} "
                "(give its spec with --tokenizer)"
            ) from None

    def dtype(self, name: str = "auto") -> torch.dtype:
        """``name`` (fp32, bf16, fp16) or, for auto, the precision the model trained in."""
        if name != "auto":
            return PRECISION_DTYPES[name]
        return PRECISION_DTYPES[self.cfg.deepspeed.precision]

    @torch.no_grad()
    def load_into(self, model: MultimodalLM) -> None:
        """Put the trained weights into ``model`` (built from :attr:`cfg` and :attr:`space`)."""
        if self.export:
            load_pretrained(model, self.path)
            return
        from safetensors.torch import load_file  # lazy: only a safetensors checkpoint needs it

        state = load_file(str(self.path / MODEL_FILE))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DataError(
                f"{self.path / MODEL_FILE}: does not fit the model of its run_config.yaml "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )


def open_trained(path: str | Path) -> Trained:
    """A checkpoint (run dir, checkpoints dir or step dir) or an export directory, its
    weights files checked to be whole."""
    trained = _open(path)
    for f in sorted(trained.path.glob("*.safetensors")):
        check_weights(f)
    return trained


def check_weights(f: Path) -> None:
    """A safetensors file whose header reads and whose data it covers is all there (a
    truncated or overwritten file fails here, in one line, not when it is loaded)."""
    from safetensors import (  # lazy: only a safetensors checkpoint needs it
        SafetensorError,
        safe_open,
    )

    try:
        with safe_open(str(f), "pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise DataError(f"{f}: not a whole safetensors file ({first_line(e)})") from None


def _open(path: str | Path) -> Trained:
    p = Path(path)
    if not p.exists():
        raise NotFoundError(f"{p}: no such checkpoint or export directory")
    if (p / "config.json").is_file() and not (p / CONFIG_FILE).is_file():
        return _open_export(p)
    if not any(
        (c / MODEL_FILE).is_file() or (c / LATEST).is_file() for c in (p, p / "checkpoints")
    ):
        raise DataError(
            f"{p}: not a checkpoint (no {MODEL_FILE} or '{LATEST}') nor an export (no config.json)"
        )
    src = read_checkpoint_dir(p)
    cfg = from_dict(RunConfig, read_yaml(src / CONFIG_FILE))
    space = _space(src / SPACE_FILE)
    record = src / TOKENIZERS_FILE
    if record.is_file():
        tokenizers = TokenizerTable.from_dict(json.loads(record.read_text()))
    else:
        tokenizers = _tokenizers_of_run(cfg)
    step = int(src.name.rsplit("_", 1)[1]) if src.name.startswith("step_") else None
    # what evaluation and generation build: the weights come from the checkpoint
    cfg = replace(cfg, model=replace(cfg.model, init_from=""))
    return Trained(src, cfg, space, tokenizers, export=False, step=step)


def _space(f: Path) -> TokenSpace:
    if not f.is_file():
        raise DataError(f"{f.parent}: has no {f.name} (no token space: not an ulysses-mm model)")
    try:
        return TokenSpace.from_dict(json.loads(f.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{f}: not a token space: {e}") from None


def _open_export(p: Path) -> Trained:
    if not (p / SPACE_FILE).is_file():
        raise DataError(
            f"{p}: a transformers checkpoint without {SPACE_FILE}: not an ulysses-mm export "
            "(its vocabulary has no modality ranges to sample within)"
        )
    space = _space(p / SPACE_FILE)
    cfg = from_dict(RunConfig, {"model": model_section(p)})
    cfg = replace(cfg, model=replace(cfg.model, init_from=""))
    hf = json.loads((p / "config.json").read_text())
    dtype = str(hf.get("dtype") or hf.get("torch_dtype"))
    if dtype in ("bfloat16", "float16"):
        precision: Literal["bf16", "fp16"] = "bf16" if dtype == "bfloat16" else "fp16"
        cfg = replace(cfg, deepspeed=replace(cfg.deepspeed, precision=precision))
    record = p / TOKENIZERS_FILE
    table = (
        TokenizerTable.from_dict(json.loads(record.read_text()))
        if record.is_file()
        else TokenizerTable()
    )
    return Trained(p, cfg, space, table, export=True)


def _tokenizers_of_run(cfg: RunConfig) -> TokenizerTable:
    """The tokenizer record of a checkpoint saved without one: from its data manifests
    (an empty record when they cannot be read)."""

    tables = []
    d = cfg.data
    for location, _, _ in train_entries(cfg):
        try:
            m = Manifest.load(d.location(location), d.max_manifest_bytes)
        except (OSError, ValueError):
            continue
        tables.append(TokenizerTable.from_manifest(m.tokenizers, m.config))
    return TokenizerTable.merged(tables)
