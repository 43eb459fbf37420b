"""Audio as mu-law ids (kind ``audio-mulaw``): one token per sample of the waveform
:mod:`ulysses_mm.tokenize.audio.waveform` reads (resampled to the spec's rate, mono).

Tokens are WaveNet-style mu-law codes: ``mu = 2**bits - 1``,
``y = sign(x)·ln(1 + mu|x|)/ln(1 + mu)``, ``q = round((y + 1)/2 · mu)``, one token per
sample, ``2**bits`` ids: mu-law trades resolution at loud levels for range, so quiet
passages keep their detail.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.tokenize.audio.base import AudioTokenizer
from ulysses_mm.tokenize.audio.waveform import RESAMPLERS
from ulysses_mm.tokenize.base import Tokenizer, TokenizerSpec, TokenUnit
from ulysses_mm.tokenize.params import ParamSchema, check_choice, spec_params

_SCHEMA: ParamSchema = {
    "sample_rate": ((int,), 16000),
    "bits": ((int,), 8),
    "max_seconds": ((int, float, type(None)), None),  # decode at most this much (null: all)
    # sharp | soxr (libsoxr's VHQ filter alone) | swr (FFmpeg's): see the module docstring
    "resampler": ((str,), "sharp"),
}


# --------------------------------------------------------------------------- mu-law
def mulaw_encode(x: np.ndarray, bits: int = 8) -> np.ndarray:
    """float waveform in [-1, 1] (clipped) -> codes 0 .. 2**bits - 1 (uint8/uint16)."""
    mu = float(2**bits - 1)
    x = np.clip(np.asarray(x, dtype=np.float32), -1.0, 1.0)
    y = np.sign(x) * (np.log1p(mu * np.abs(x)) / np.float32(np.log1p(mu)))
    q = np.floor((y + 1.0) * (0.5 * mu) + 0.5)
    return q.astype(np.uint8 if bits <= 8 else np.uint16)


def mulaw_decode(q: np.ndarray, bits: int = 8) -> np.ndarray:
    """codes 0 .. 2**bits - 1 -> float32 waveform in [-1, 1]."""
    mu = 2**bits - 1
    y = np.asarray(q, dtype=np.float32) * np.float32(2.0 / mu) - 1.0
    x = np.sign(y) * np.expm1(np.abs(y) * np.float32(np.log1p(mu))) / np.float32(mu)
    return x.astype(np.float32, copy=False)


# --------------------------------------------------------------------------- tokenizer
class MulawTokenizer(AudioTokenizer):
    """kind ``audio-mulaw``: one document per file, one mu-law token per sample."""

    def __init__(self, spec: TokenizerSpec) -> None:
        super().__init__(spec)
        p = spec_params(spec, _SCHEMA)
        where = spec.where
        if not 2 <= p["bits"] <= 16:
            raise DataError(f"{where}: param 'bits' must be 2..16, got {p['bits']}")
        if not 1000 <= p["sample_rate"] <= 192000:
            raise DataError(f"{where}: param 'sample_rate' must be 1000..192000")
        if p["max_seconds"] is not None and p["max_seconds"] <= 0:
            raise DataError(f"{where}: param 'max_seconds' must be > 0 or null")
        if spec.vocab_size != 2 ** p["bits"]:
            raise DataError(
                f"{where}: vocab_size {spec.vocab_size} must be 2**bits = {2 ** p['bits']}"
            )
        check_choice(spec, "resampler", p["resampler"], RESAMPLERS)
        self.params: dict[str, Any] = p
        self.rate: int = p["sample_rate"]
        self.bits: int = p["bits"]

    @property
    def ids_per_second(self) -> float:
        return float(self.rate)

    def encode_waveform(self, samples: np.ndarray) -> np.ndarray:
        """float32 mono at the spec's rate -> local ids."""
        return mulaw_encode(samples, self.bits)

    def decode_waveform(self, ids: np.ndarray) -> np.ndarray:
        """local ids -> float32 waveform at the spec's rate."""
        return mulaw_decode(ids, self.bits)

    @classmethod
    def token_labels(
        cls, entry: Mapping[str, Any], size: int, vocabulary: Sequence[str] | None = None
    ) -> list[str]:
        """The signed mu-law level of each id (``+0``, ``-127``)."""
        half = 1 << (int((entry.get("params") or {}).get("bits", 8)) - 1)
        return [f"{k - half:+d}" for k in range(size)]

    @classmethod
    def unit(
        cls, entry: Mapping[str, Any], size: int, load: Callable[[], Tokenizer]
    ) -> TokenUnit | None:
        """Bits per sample: every id is one."""
        return TokenUnit("sample", np.ones(size))
