"""Plain-PyTorch model code: backbone, attention kernels, per-modality heads, and the
memory policy applied to a built model."""

from ulysses_mm.model.attention import DocumentMask, LocalAttention, available_kernels
from ulysses_mm.model.heads import IGNORE, LossOutput, ModalityHeads
from ulysses_mm.model.llama import Backbone, MultimodalLM, build_model
from ulysses_mm.model.memory import apply_memory_policy
from ulysses_mm.model.offload import Offload

__all__ = [
    "IGNORE",
    "Backbone",
    "DocumentMask",
    "LocalAttention",
    "LossOutput",
    "ModalityHeads",
    "MultimodalLM",
    "Offload",
    "apply_memory_policy",
    "available_kernels",
    "build_model",
]
