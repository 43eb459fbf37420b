"""The memory policy, applied to a finished model in one call: :func:`apply_memory_policy`.

The model's code is plain (each decoder layer runs ``qkv`` → attention kernel →
``after_attention``; the backbone runs its layers one after another). What trades compute
for memory is installed here, from outside, on the built model, as torchtitan's
``apply_ac`` wraps the blocks of a model that knows nothing of it:

- ``model.activation_checkpointing``: every decoder layer recomputed in backward;
- ``model.offload_checkpoints``: the checkpointed layer inputs kept in host memory
  (:class:`~ulysses_mm.model.offload.Offload`, owned by the caller);
- ``model.layer_tile_tokens``: a layer's token-wise steps (norms, projections, MLP,
  residual adds) and the final norm in recomputed tiles along the sequence
  (:func:`~ulysses_mm.model.tiling.tile_map`);
- ``model.mlp_tile_tokens``: the MLP alone in recomputed tiles;
- ``model.loss_tile_tokens``: the heads' loss tiles.

Each is installed as a per-instance replacement of one method (``Backbone.run_layers``,
``DecoderLayer.qkv`` / ``after_attention``, ``MLP.forward``, ``RMSNorm.forward``), so
parameter names and the state dict stay the model's own. Applying the policy again first
puts every method back, so the new policy replaces the old. Which combinations are
refused (one would do nothing) is :class:`~ulysses_mm.config.ModelConfig`'s to say.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ulysses_mm.config import ModelConfig
from ulysses_mm.model.attention import DocumentMask
from ulysses_mm.model.llama import MLP, Backbone, DecoderLayer, MultimodalLM, RMSNorm
from ulysses_mm.model.offload import Offload
from ulysses_mm.model.tiling import tile_map

# the methods a policy may replace, per class: what plain_model puts back
_SEAMS: dict[type[nn.Module], tuple[str, ...]] = {
    Backbone: ("run_layers",),
    DecoderLayer: ("qkv", "after_attention"),
    MLP: ("forward",),
    RMSNorm: ("forward",),
}


def _install(module: nn.Module, name: str, fn: Callable[..., Any]) -> None:
    object.__setattr__(module, name, fn)  # an instance attribute: shadows the method


def _plain(module: nn.Module, name: str) -> Callable[..., Any]:
    """``module``'s own method ``name``, whatever a policy installed over it."""
    return getattr(type(module), name).__get__(module)  # type: ignore[no-any-return]


def plain_model(model: MultimodalLM) -> None:
    """Take every memory policy off ``model``, in place: each method is the class's again."""
    for module in model.modules():
        for name in _SEAMS.get(type(module), ()):
            module.__dict__.pop(name, None)


def _checkpointed_layers(
    backbone: Backbone, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask
) -> Tensor:
    # every layer recomputed in backward (nothing to recompute without autograd)
    grad = torch.is_grad_enabled()
    for layer in backbone.layers:
        if grad:
            x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
        else:
            x = layer(x, cos, sin, mask)
    return x


def _offloaded_layers(
    backbone: Backbone, offload: Offload, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask
) -> Tensor:
    if not torch.is_grad_enabled():
        return _plain(backbone, "run_layers")(x, cos, sin, mask)  # type: ignore[no-any-return]
    return offload.run_layers(list(backbone.layers), x, cos, sin, mask)


def _marked_qkv(
    qkv: Callable[..., tuple[Tensor, Tensor, Tensor]], offload: Offload, *args: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    # an offloaded layer fetches the input of the one before once past its attention
    q, k, v = qkv(*args)
    offload.prefetch_after(q)
    return q, k, v


def _tiled_mlp(mlp: Callable[[Tensor], Tensor], tile: int, x: Tensor) -> Tensor:
    # the [n, intermediate] activations exist for one tile at a time
    if x.shape[1] <= tile or not torch.is_grad_enabled():
        return mlp(x)
    parts = [
        checkpoint(mlp, t, use_reentrant=False)
        for t in x.split(tile, dim=1)  # [b, n, D] -> tiles of [b, tile, D]
    ]
    return torch.cat(parts, dim=1)


def apply_memory_policy(
    model: MultimodalLM, cfg: ModelConfig, offload: Offload | None = None
) -> Offload | None:
    """Install ``cfg``'s memory policy on ``model``, in place (a policy installed before is
    taken off first). Returns the :class:`Offload` whose layers' inputs go to the host
    (``offload`` when given, else a new one) when ``cfg.offload_checkpoints``, else None.

    Outputs and gradients are those of the plain model: tiles and checkpoints only change
    what is kept between forward and backward."""
    plain_model(model)
    model.heads.tile_tokens = cfg.loss_tile_tokens
    backbone = model.model
    layers = [layer for layer in backbone.layers if isinstance(layer, DecoderLayer)]
    tile = cfg.layer_tile_tokens
    if tile:
        # token-wise steps in recomputed tiles: kept are x, the kernel's q, k, v, its
        # output (and what the kernel saves), not the norms' or the MLP's activations
        for layer in layers:
            _install(layer, "qkv", functools.partial(tile_map, _plain(layer, "qkv"), tile))
            after = _plain(layer, "after_attention")
            _install(layer, "after_attention", functools.partial(tile_map, after, tile))
        norm = backbone.norm
        _install(norm, "forward", functools.partial(tile_map, _plain(norm, "forward"), tile))
    if cfg.mlp_tile_tokens:
        for layer in layers:
            mlp = layer.mlp
            _install(
                mlp,
                "forward",
                functools.partial(_tiled_mlp, _plain(mlp, "forward"), cfg.mlp_tile_tokens),
            )
    if cfg.offload_checkpoints:
        offload = offload if offload is not None else Offload()
        for layer in layers:
            _install(layer, "qkv", functools.partial(_marked_qkv, layer.qkv, offload))
        _install(backbone, "run_layers", functools.partial(_offloaded_layers, backbone, offload))
        return offload
    if cfg.activation_checkpointing:
        _install(backbone, "run_layers", functools.partial(_checkpointed_layers, backbone))
    return None
