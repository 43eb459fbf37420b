"""From a tokenizer spec to a tokenizer: ``spec.kind`` names the implementation."""

from __future__ import annotations

import importlib
from pathlib import Path

from ulysses_mm.modalities.base import Tokenizer, TokenizerSpec

# kind -> "module:Class", imported on first use (video needs decord/PyAV, DNA biopython).
_KINDS: dict[str, str] = {
    "dna-base": "ulysses_mm.modalities.dna:DnaTokenizer",
    "audio-mulaw": "ulysses_mm.modalities.audio:MulawTokenizer",
    "video-vq": "ulysses_mm.modalities.video:VqVideoTokenizer",
}


def register_kind(kind: str, target: str | type[Tokenizer]) -> None:
    """Make ``kind`` resolvable; ``target`` is a Tokenizer class or "module:Class"."""
    if isinstance(target, str):
        _KINDS[kind] = target
    else:
        _KINDS[kind] = f"{target.__module__}:{target.__qualname__}"


def kinds() -> list[str]:
    return sorted(_KINDS)


def load_tokenizer(spec: TokenizerSpec | str | Path) -> Tokenizer:
    if not isinstance(spec, TokenizerSpec):
        spec = TokenizerSpec.load(spec)
    if spec.kind not in _KINDS:
        raise ValueError(f"{spec.path}: unknown tokenizer kind {spec.kind!r}; known: {kinds()}")
    module, _, name = _KINDS[spec.kind].partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(spec)
