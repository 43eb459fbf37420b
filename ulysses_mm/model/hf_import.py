"""``model.init_from``: start from a transformers Llama, Qwen2 or Qwen3 checkpoint.

The backbone's parameter names are already those of ``transformers`` (``model.layers.0.
self_attn.q_proj.weight`` …), so the decoder loads tensor by tensor. The vocabulary is
the one thing that differs: a checkpoint's embedding and LM-head rows are one
modality's (``model.text_modality``) slice of the token space, and the rows of the
specials and of every other modality keep the initialisation the config gives. A
checkpoint written by ``ulysses-mm export`` carries its ``token_space.json``; when that
space is the model's, every row loads (export → init_from is the identity).

Nothing is guessed: an architecture field or a tensor shape that differs from the
config is refused with a one-line message naming the first difference, and
``ulysses-mm config --from-hf DIR`` prints the model section that matches.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ulysses_mm.config import ConfigError, ModelConfig, RopeConfig, from_dict, to_dict
from ulysses_mm.config.schema import ROPE_NEEDS, ROPE_USES
from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import SPACE_FILE, TokenSpace

SUPPORTED = ("llama", "qwen2", "qwen3")
# ModelConfig fields an init_from checkpoint fixes, in the order they are compared
ARCH_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_norm",
    "attention_bias",
    "rms_norm_eps",
)


# config.json's numbers read into the model section (its RoPE's are read by _rope)
_NUMBERS = (
    *(k for k in ARCH_FIELDS if k not in ("qk_norm", "attention_bias")),
    "max_position_embeddings",
    "vocab_size",
)


class InitFromError(DataError):
    """A checkpoint that cannot start this run; ``str(e)`` is one line naming the directory."""


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a mapping (one-line error when unreadable)."""
    p = Path(path) / "config.json"
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise InitFromError(f"init_from {path}: cannot read {p}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InitFromError(f"init_from {path}: {p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InitFromError(f"init_from {path}: {p} is not a JSON object")
    return data


def _rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The RopeConfig fields (the set ones) of the positions transformers computes for
    config ``hf``: ``rope_scaling`` (older config.json: ``type`` or ``rope_type``) over
    ``rope_parameters``, θ from them or from the top-level ``rope_theta``, and the
    original length where transformers takes it (llama3 and yarn: a top-level
    ``original_max_position_embeddings`` first; dynamic: ``max_position_embeddings``)."""
    section = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise InitFromError(f"{where}: rope_parameters {params!r} is not a mapping")
    rope_kind = params.get("rope_type", params.get("type", "default"))
    if rope_kind not in ROPE_NEEDS:
        raise InitFromError(
            f"{where}: RoPE kind {rope_kind!r} is not supported (supported: {', '.join(ROPE_NEEDS)})"
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise InitFromError(f"{where}: partial_rotary_factor {partial} is not supported (only 1)")
    theta = _number(params, "rope_theta", where, section)
    theta = _number(hf, "rope_theta", where) if theta is None else theta
    out: dict[str, Any] = {"theta": 10000.0 if theta is None else theta, "kind": rope_kind}
    # transformers reads only the keys a RoPE kind uses (and warns of the others)
    out |= {
        k: _number(params, k, where, section)
        for k in ROPE_USES[rope_kind]
        if params.get(k) is not None
    }
    max_positions = hf.get("max_position_embeddings")
    if rope_kind in ("llama3", "yarn"):
        original = _number(hf, "original_max_position_embeddings", where) or out.get(
            "original_max_position_embeddings", max_positions
        )
        if original is not None:
            out["original_max_position_embeddings"] = original
    if rope_kind == "dynamic":
        out.pop("original_max_position_embeddings", None)
        if max_positions is not None:
            out["original_max_position_embeddings"] = max_positions
    missing = [k for k in ROPE_NEEDS[rope_kind] if k not in out]
    if missing:
        raise InitFromError(f"{where}: its {rope_kind} RoPE has no {missing[0]} (rope_parameters)")
    try:
        rope = from_dict(RopeConfig, out, "model.rope")
    except ConfigError as e:
        raise InitFromError(f"{where}: its {rope_kind} RoPE: {e}") from None
    return rope_fields(rope)


def _number(hf: Mapping[str, Any], key: str, where: str, section: str = "") -> Any:
    """``hf[key]`` (None when absent; ``section``: the mapping of config.json it is in),
    refused in one line when it is a number written as a string, whichever key it is:
    config.json's numbers are JSON numbers, as the run schema's are YAML numbers
    (``"5e5"`` is text to transformers too: its arithmetic fails on it later)."""
    value = hf.get(key)
    if isinstance(value, str):
        name = f"{section}.{key}" if section else key
        raise InitFromError(
            f"{where}: {name} is the string {value!r}, not a number; write it without quotes"
        )
    return value


def rope_fields(rope: RopeConfig) -> dict[str, Any]:
    """``rope`` as a mapping of its set fields (those not at their unset default)."""
    unset = RopeConfig()
    return {
        k: v for k, v in to_dict(rope).items() if k in ("theta", "kind") or v != getattr(unset, k)
    }


def hf_model_fields(path: str | Path, hf: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ModelConfig fields (architecture, plus ``init_from``) that match a checkpoint,
    and ``vocab_size``: its vocabulary (rows of the embedding)."""
    where = f"init_from {path}"
    hf = read_hf_config(path) if hf is None else hf
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise InitFromError(f"{where}: model_type {model_type!r} is not one of {list(SUPPORTED)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise InitFromError(f"{where}: hidden_act {hf['hidden_act']!r} (only silu/SwiGLU)")
    if hf.get("use_sliding_window"):
        raise InitFromError(f"{where}: sliding-window attention is not supported")
    if model_type == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise InitFromError(f"{where}: a Llama with attention_bias/mlp_bias is not supported")
    if model_type == "qwen3" and hf.get("attention_bias"):
        raise InitFromError(f"{where}: a Qwen3 with attention_bias is not supported")
    try:
        return _fields(hf, model_type, f"{where}: {Path(path) / 'config.json'}")
    except InitFromError:
        raise
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        what = f"has no {e}" if isinstance(e, KeyError) else f"has a bad value ({_line(e)})"
        raise InitFromError(f"{where}: {Path(path) / 'config.json'} {what}") from None


def _fields(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    for key in _NUMBERS:
        _number(hf, key, where)
    heads = int(hf["num_attention_heads"])
    return dict(
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=_head_dim(hf, model_type, heads, where),
        qk_norm=model_type == "qwen3",
        attention_bias=model_type == "qwen2",
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope(hf, where),
        max_position_embeddings=int(hf.get("max_position_embeddings", 1 << 20)),
        vocab_size=int(hf["vocab_size"]),
    )


def _head_dim(hf: dict[str, Any], model_type: str, heads: int, where: str) -> int:
    """The head dim transformers gives config ``hf``: Llama's and Qwen2's ``head_dim`` or
    hidden_size / heads; Qwen3's ``head_dim``, 128 when absent, and ``null`` refused (its
    config class refuses it: a Qwen3's head dim is not derived from the hidden size)."""
    if model_type != "qwen3":
        return int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    if "head_dim" in hf and hf["head_dim"] is None:
        raise InitFromError(
            f"{where}: a Qwen3's head_dim is null; write the checkpoint's head "
            "dim there (Qwen3's config refuses null: it is not hidden_size / heads)"
        )
    return int(hf.get("head_dim", 128))


def model_section(path: str | Path, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``model:`` section ``base`` (a config file's) made to start from checkpoint
    ``path``: its architecture, ``init_from``, and the modality ``text_modality`` sized to
    its vocabulary (kept in its place, else last) — or, for an ``ulysses-mm export``, the
    whole token space of its token_space.json."""
    out = dict(base or {})
    fields = hf_model_fields(path)
    vocab = fields.pop("vocab_size")
    exported = _exported_space(Path(path))
    if exported is not None:
        modalities = exported.vocab()
    else:
        modalities = dict(out.get("modalities") or {})
        modalities[str(out.get("text_modality", "text"))] = vocab
    return out | fields | {"init_from": str(path), "modalities": modalities}


def check_matches(cfg: ModelConfig, path: str | Path, fields: dict[str, Any]) -> None:
    """Refuse a checkpoint whose architecture differs from ``cfg``: the first difference.
    The RoPE is not compared: positions are no weights, and a run that extends a model's
    context trains with another RoPE than the checkpoint's (``config --from-hf`` prints
    the checkpoint's as the starting point)."""
    for name in ARCH_FIELDS:
        mine, theirs = getattr(cfg, name), fields[name]
        if mine != theirs:
            raise InitFromError(
                f"init_from {path}: the checkpoint has {name}={theirs}, the config "
                f"model.{name}={mine} (`ulysses-mm config --from-hf {path}` prints the match)"
            )


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The checkpoint's safetensors files, and the index's tensor -> file map (None for
    a single ``model.safetensors``); an index that is not JSON, has no weight_map or
    names a missing file is one line naming it."""
    where = f"init_from {path}"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()
            ):
                raise TypeError("weight_map is not a mapping of tensor names to files")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            why = "no weight_map" if isinstance(e, KeyError) else _line(e)
            raise InitFromError(f"{where}: {index} is not a safetensors index: {why}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise InitFromError(f"{where}: {index} names {f.name}, which is not there")
        return files, weight_map
    single = path / "model.safetensors"
    if not single.is_file():
        raise InitFromError(f"{where}: no model.safetensors or model.safetensors.index.json there")
    return [single], None


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _safe_open(f: Path, path: Path) -> Any:
    """``safetensors.safe_open`` (reads the header only); an unreadable file is one line
    naming it."""
    from safetensors import (  # lazy: only reading safetensors files needs it
        SafetensorError,
        safe_open,
    )

    try:
        return safe_open(str(f), framework="pt")
    except (SafetensorError, OSError) as e:
        raise InitFromError(
            f"init_from {path}: {f} is not a readable safetensors file ({_line(e)})"
        ) from None


def check_weights_readable(path: Path) -> None:
    """Every safetensors file of checkpoint ``path`` has a readable header (no tensor is
    read): what a launcher can check before it starts processes."""
    files, _ = _weight_files(path)
    for f in files:
        _safe_open(f, path)


def _open_tensors(path: Path) -> dict[str, Any]:
    """Tensor name -> an open safetensors file holding it (one file or an indexed set)."""
    files, weight_map = _weight_files(path)
    handles = {f.name: _safe_open(f, path) for f in files}
    if weight_map is not None:
        return {name: handles[f] for name, f in weight_map.items()}
    (handle,) = handles.values()
    return {name: handle for name in handle.keys()}  # noqa: SIM118 (not a dict)


def _shape(handle: Any, name: str) -> list[int]:
    return list(handle.get_slice(name).get_shape())


def _exported_space(path: Path) -> TokenSpace | None:
    p = path / SPACE_FILE
    if not p.is_file():
        return None
    try:
        return TokenSpace.from_dict(json.loads(p.read_text()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise InitFromError(f"init_from {path}: {p} is not a token space: {_line(e)}") from None


def check_init_from(cfg: ModelConfig, space: TokenSpace, path: str | Path) -> slice:
    """Everything about checkpoint ``path`` that its config.json (and token_space.json)
    decide, and that its safetensors headers are readable, without reading a tensor: the
    architecture and the vocabulary against ``cfg`` and ``space``. Returns the
    token-space rows its vocabulary goes to (cheap enough for a launcher to run before it
    starts processes)."""
    path = Path(path)
    where = f"init_from {path}"
    fields = hf_model_fields(path)
    check_matches(cfg, path, fields)
    check_weights_readable(path)
    exported = _exported_space(path)
    if exported is not None and exported != space:
        raise InitFromError(
            f"{where}: its token_space.json ({exported.describe()}) is not the run's "
            f"({space.describe()})"
        )
    if exported is not None:
        rows = slice(0, space.vocab_size)
    else:
        if cfg.text_modality not in space.modalities:
            raise InitFromError(
                f"{where}: the token space {list(space.modalities)} has no modality "
                f"{cfg.text_modality!r} (model.text_modality) to take its vocabulary"
            )
        r = space.range(cfg.text_modality)
        rows = slice(r.start, r.stop)
    if fields["vocab_size"] != rows.stop - rows.start:
        what = "token space" if exported is not None else f"modality {cfg.text_modality!r}"
        raise InitFromError(
            f"{where}: the checkpoint has vocab_size={fields['vocab_size']}, the {what} "
            f"has {rows.stop - rows.start} ids (model.modalities.{cfg.text_modality})"
        )
    return rows


@torch.no_grad()
def load_pretrained(model: Any, path: str | Path) -> None:
    """Load checkpoint ``path`` into ``model`` (a MultimodalLM, before Ulysses or the
    engine wrap it): backbone as is, vocabulary rows into the text range (all rows when
    the checkpoint is an export of this very token space). Refuses any difference."""
    path = Path(path)
    where = f"init_from {path}"
    cfg: ModelConfig = model.config
    space: TokenSpace = model.space
    rows = check_init_from(cfg, space, path)
    full = rows.stop - rows.start == space.vocab_size and rows.start == 0
    want_vocab = rows.stop - rows.start
    tensors = _open_tensors(path)

    def read(name: str, shape: list[int]) -> torch.Tensor:
        if name not in tensors:
            raise InitFromError(f"{where}: the checkpoint has no tensor {name}")
        got = _shape(tensors[name], name)
        if got != shape:
            raise InitFromError(f"{where}: tensor {name} has shape {got}, the model {shape}")
        return tensors[name].get_tensor(name)

    state = model.state_dict()
    backbone = [k for k in state if k.startswith("model.") and k != "model.embed_tokens.weight"]
    known = set(backbone) | {"model.embed_tokens.weight", "lm_head.weight"}
    extra = sorted(k for k in tensors if k not in known and "rotary_emb" not in k)
    if extra:
        raise InitFromError(f"{where}: tensor {extra[0]} has no place in the model")
    for name in backbone:
        state[name].copy_(read(name, list(state[name].shape)))
    d = cfg.hidden_size
    embed = read("model.embed_tokens.weight", [want_vocab, d])
    model.model.embed_tokens.weight[rows] = embed.to(model.model.embed_tokens.weight.dtype)
    lm_head = read("lm_head.weight", [want_vocab, d]) if "lm_head.weight" in tensors else embed
    heads = model.heads
    if full:
        ns = space.num_specials
        heads.special.weight.copy_(lm_head[:ns])
        for r in space.ranges:
            heads.heads[r.name].weight.copy_(lm_head[r.start : r.stop])
    else:
        heads.heads[cfg.text_modality].weight.copy_(lm_head)
