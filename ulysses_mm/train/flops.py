"""Model FLOPs utilisation: the FLOPs a training step does, and the device's peak.

The FLOPs are counted from the model and the batch (decoder parameters, causal attention
inside documents, each modality's head), not timed: MFU is those FLOPs over the step
time and the world's peak. The peak is ``train.peak_tflops`` or a known GPU's dense figure
from its spec sheet; on any other device no MFU is logged.
"""

from __future__ import annotations

import re

import torch

from ulysses_mm.config import ModelConfig, RunConfig
from ulysses_mm.model import MultimodalLM

# Dense (no sparsity) peak TFLOP/s of known GPUs, by a pattern of the name
# torch.cuda.get_device_name gives: (bf16/fp16 tensor cores, fp32). The first match wins,
# so each specific name comes before the family name it contains.
_GPU_PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    (r"\bGH200\b", 989.0, 67.0),
    (r"\bH200 NVL\b", 835.0, 60.0),
    (r"\bH200\b", 989.0, 67.0),
    (r"\bH100 PCIe\b", 756.0, 51.0),
    (r"\bH100 NVL\b", 835.0, 60.0),
    (r"\bH100\b", 989.0, 67.0),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"\bA100\b", 312.0, 19.5),
    (r"\bL40S\b", 362.0, 91.6),
    (r"\bL40\b", 181.0, 90.5),
    (r"\bL4\b", 121.0, 30.3),
    (r"\bA10G?\b", 125.0, 31.2),
    (r"\b4090\b", 165.0, 82.6),
)


def known_peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of a GPU named ``device_name`` at ``precision`` (bf16, fp16 or
    fp32); None for a device the table does not know."""
    for pattern, half, single in _GPU_PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return single if precision == "fp32" else half
    return None


def peak_tflops(cfg: RunConfig, device: torch.device) -> float | None:
    """``train.peak_tflops`` when set, else the table's figure for a CUDA device; None
    when unknown (a CPU, an unlisted GPU), and then no MFU is logged: a guessed peak gives
    a figure that reads like a measurement."""
    if cfg.train.peak_tflops > 0:
        return cfg.train.peak_tflops
    if device.type == "cuda":
        return known_peak_tflops(torch.cuda.get_device_name(device), cfg.deepspeed.precision)
    return None


def train_flops(
    model: MultimodalLM, tokens: int, attn_pairs: float, head_targets: dict[str, int]
) -> float:
    """FLOPs of forward+backward: 6 per parameter per token in the decoder, 6·D per
    (query, key) pair per layer for causal attention inside documents, and 6·D·vocab_m per
    target in the head of its modality."""
    cfg, space = model.config, model.space
    assert cfg.head_dim is not None
    dense = sum(
        p.numel() for n, p in model.model.named_parameters() if not n.startswith("embed_tokens")
    )
    attn = 6.0 * 2 * cfg.num_attention_heads * cfg.head_dim * attn_pairs * cfg.num_hidden_layers
    heads = sum(
        6.0 * cfg.hidden_size * (space.num_specials + space.range(m).size) * n
        for m, n in head_targets.items()
    )
    return 6.0 * dense * tokens + attn + heads


def causal_pairs(doc_ids: torch.Tensor) -> float:
    """Σ over documents of L·(L+1)/2: the (query, key) pairs causal attention computes."""
    total = 0.0
    for row in doc_ids:
        _, counts = torch.unique_consecutive(row, return_counts=True)
        c = counts.double()
        total += float((c * (c + 1) / 2).sum())
    return total


def pairs_per_token(c: ModelConfig) -> float:
    """The decoder's dense FLOPs per token over its attention FLOPs per (query, key) pair
    (:func:`train_flops`'s two terms): what a token of linear work weighs in pairs. From
    the config's dimensions, so a partitioned model (ZeRO-3) gives the same figure."""
    assert c.head_dim is not None
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    d = c.hidden_size
    per_layer = 2 * d * q + 2 * d * kv + 3 * d * c.intermediate_size + 2 * d
    return per_layer / (2.0 * q)
