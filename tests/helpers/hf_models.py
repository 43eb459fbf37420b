"""Tiny transformers models for the tests that hold ours against theirs."""

from __future__ import annotations

from typing import Any

import torch


def tiny_hf_model(model_type: str, seed: int = 0, perturb: float = 0.1, **config: Any) -> Any:
    """A randomly initialised transformers causal LM of ``model_type`` (llama, qwen2, qwen3,
    mistral) built from ``config``, every parameter (norms and biases too) moved away from
    its init by ``perturb``-sized noise so each one matters."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    cfg_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[model_type]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**config))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * perturb)
    return model
