"""What a person opens of audio ids: a WAV file (the standard library's ``wave``, 16-bit
PCM)."""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ulysses_mm.tokenize.write import Media


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """float waveform in [-1, 1] (mono [n], or [n, channels]) -> 16-bit PCM WAV."""
    x = np.asarray(samples, dtype=np.float32)
    x = x[:, None] if x.ndim == 1 else x
    pcm = np.clip(np.rint(x * 32767.0), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(pcm.shape[1])
        w.setsampwidth(2)
        w.setframerate(int(rate))
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


@dataclass
class WavMedia(Media):
    """A waveform at ``rate``."""

    wave: np.ndarray
    rate: int
    suffix: ClassVar[str] = "wav"
    shown_as: ClassVar[str] = "audio"

    def to_bytes(self, record_id: str = "generated", description: str = "") -> bytes:
        return wav_bytes(self.wave, self.rate)

    def describe(self) -> str:
        n = len(self.wave)
        return f"{n / self.rate:.2f} s of audio ({n:,} samples at {self.rate} Hz)"
