"""Plain-PyTorch model code: backbone, attention kernels, per-modality heads."""

from ulysses_mm.model.attention import DocumentMask, LocalAttention, available_kernels
from ulysses_mm.model.heads import IGNORE, ModalityHeads
from ulysses_mm.model.llama import Backbone, MultimodalLM, build_model

__all__ = [
    "IGNORE",
    "Backbone",
    "DocumentMask",
    "LocalAttention",
    "ModalityHeads",
    "MultimodalLM",
    "available_kernels",
    "build_model",
]
