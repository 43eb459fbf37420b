"""``ulysses-mm export``: a checkpoint to a transformers Llama checkpoint (Qwen3 when
``model.qk_norm``, Qwen2 when ``model.attention_bias``).

The backbone's parameter names are already ``LlamaModel``'s (under ``model.``); the
per-modality heads, concatenated in token-id order (shared specials, then each modality's
range), are exactly one ``lm_head`` over the whole token space. The result — config.json
and model.safetensors, with the token space and the tokenizer record beside them (what
``ulysses-mm generate`` reads) — loads with ``AutoModelForCausalLM.from_pretrained`` and
gives the backbone's hidden states. (A softmax over that ``lm_head`` is the joint
distribution; the training objective was each modality's head over its own slice of it.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ulysses_mm.config import ConfigError, ModelConfig, RunConfig, from_dict, read_yaml
from ulysses_mm.core.errors import StorageError
from ulysses_mm.core.storage import atomic_local_dir
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, PAD, TokenSpace
from ulysses_mm.train.checkpoint import (
    CONFIG_FILE,
    MODEL_FILE,
    SPACE_FILE,
    TOKENIZERS_FILE,
    read_checkpoint_dir,
)


def hf_state_dict(weights: dict[str, torch.Tensor], space: TokenSpace) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in weights.items() if k.startswith("model.") and "rotary_emb" not in k}
    parts = [weights["heads.special.weight"]] + [
        weights[f"heads.heads.{r.name}.weight"] for r in space.ranges
    ]
    out["lm_head.weight"] = torch.cat(parts).contiguous()
    return out


def hf_config_for(model: ModelConfig, vocab_size: int, dtype: torch.dtype) -> Any:
    """The transformers config of the backbone: Llama, or Qwen3 (q/k norm) or Qwen2 (q/k/v
    biases), whose parameter names are the backbone's; its ``rope_parameters`` (and, for
    the dynamic kind, ``max_position_embeddings``) make transformers compute the same
    positions (:meth:`ModelConfig.to_llama_config_kwargs`)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config  # lazy: heavy (transformers)

    kwargs = model.to_llama_config_kwargs()
    kwargs["max_position_embeddings"] = max_positions_for(model)
    if model.qk_norm and model.attention_bias:
        raise ConfigError(
            "model.qk_norm with model.attention_bias has no transformers architecture "
            "(Qwen3 biases o_proj too)"
        )
    cls: type[Any] = LlamaConfig
    arch = "LlamaForCausalLM"
    if model.qk_norm or model.attention_bias:
        for key in ("attention_bias", "mlp_bias"):
            kwargs.pop(key)
        kwargs["use_sliding_window"] = False
        cls, arch = (
            (Qwen3Config, "Qwen3ForCausalLM")
            if model.qk_norm
            else (Qwen2Config, "Qwen2ForCausalLM")
        )
    return cls(
        vocab_size=vocab_size,
        pad_token_id=PAD,
        bos_token_id=DOC_START,
        eos_token_id=DOC_END,
        architectures=[arch],
        dtype=str(dtype).removeprefix("torch."),
        **kwargs,
    )


def max_positions_for(model: ModelConfig) -> int:
    """The exported ``max_position_embeddings``: for YaRN the length its ``factor`` scales
    the original context to (original × factor), which transformers checks on every load
    and warns about when the ratio differs from the factor; for the other kinds the
    backbone's (:meth:`ModelConfig.to_llama_config_kwargs`). A factor that does not give a
    whole length keeps the backbone's (transformers then warns, as it would for anyone's)."""
    rope = model.rope
    default = int(model.to_llama_config_kwargs()["max_position_embeddings"])
    if rope.kind != "yarn" or not rope.original_max_position_embeddings or rope.factor is None:
        return default
    scaled = rope.original_max_position_embeddings * rope.factor
    return int(scaled) if float(scaled).is_integer() else default


# what an export directory holds: the model, its config, the token space and (from a run
# that has one) the tokenizer record
EXPORT_FILES = ("config.json", "model.safetensors", SPACE_FILE, TOKENIZERS_FILE)


def check_export_dir(out: Path) -> None:
    """``out`` is absent, empty or an earlier export (its files are export's, the model
    and the token space among them): an export replaces the directory whole, so a
    directory of other files (a run, a checkpoint, a folder of one's own) is refused in
    one line before anything is read or written."""
    if not out.exists():
        return
    if not out.is_dir():
        raise StorageError(f"{out} is a file; give a directory to write the model in")
    names = sorted(p.name for p in out.iterdir())
    others = [n for n in names if n not in EXPORT_FILES]
    if others or (names and not {"model.safetensors", SPACE_FILE} <= set(names)):
        shown = ", ".join(others[:3] or names[:3]) + (", …" if len(others or names) > 3 else "")
        raise StorageError(
            f"{out} holds files that are not an earlier export's ({shown}); export "
            "replaces its directory whole: give a new or empty directory"
        )


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """Write checkpoint ``checkpoint`` (a run dir, its checkpoints dir or a step dir) as a
    transformers model in directory ``out``: new, empty, or an earlier export it
    replaces (:func:`check_export_dir`)."""
    out = Path(out)
    check_export_dir(out)
    src = read_checkpoint_dir(Path(checkpoint))
    cfg = from_dict(RunConfig, read_yaml(src / CONFIG_FILE))
    space = TokenSpace.from_dict(json.loads((src / SPACE_FILE).read_text()))
    weights = load_file(str(src / MODEL_FILE))
    state = hf_state_dict(weights, space)
    dtype = next(iter(state.values())).dtype
    hf_config = hf_config_for(cfg.model, space.vocab_size, dtype)
    with atomic_local_dir(out, replace=True) as tmp:  # whole or absent, plain file modes
        hf_config.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / SPACE_FILE).write_text(json.dumps(space.to_dict(), indent=1) + "\n")
        if (src / TOKENIZERS_FILE).is_file():  # what `generate` tokenizes and decodes with
            shutil.copyfile(src / TOKENIZERS_FILE, tmp / TOKENIZERS_FILE)
    return out
