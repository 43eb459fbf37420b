"""What every audio kind shares: a file's waveform in, one document of ids out, and back.

A kind says how a mono float32 waveform at :attr:`AudioTokenizer.rate` becomes local ids
(:meth:`~AudioTokenizer.encode_waveform`) and the way back
(:meth:`~AudioTokenizer.decode_waveform`), and how many ids a second of audio costs
(:attr:`~AudioTokenizer.ids_per_second`). This class gives the rest of the
:class:`~ulysses_mm.tokenize.base.Tokenizer` contract: the document, the decode, the
prompt's first seconds, a WAV file of generated ids, the SNR fidelity measure and the
waveform panel of ``inspect --png``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tokenize.audio.fidelity import audio_line, eval_audio
from ulysses_mm.tokenize.audio.output import WavMedia
from ulysses_mm.tokenize.audio.waveform import Waveform, load_waveform
from ulysses_mm.tokenize.base import Entry, TokenDocument, Tokenizer
from ulysses_mm.tokenize.framing import DocumentFramer, local_ids
from ulysses_mm.tokenize.picture import draw_waveform
from ulysses_mm.tokenize.write import Media


class AudioTokenizer(Tokenizer):
    """One document per file: the file's waveform (mono, resampled to ``rate``) as ids."""

    fidelity_measure = "snr_db"
    damages = True
    rate: int  # samples per second of the waveform the kind reads and writes
    params: dict[str, Any]

    @property
    @abstractmethod
    def ids_per_second(self) -> float:
        """Ids a second of audio costs."""

    @abstractmethod
    def encode_waveform(self, samples: np.ndarray) -> np.ndarray:
        """float32 mono at ``rate`` -> local ids [n]."""

    @abstractmethod
    def decode_waveform(self, ids: np.ndarray) -> np.ndarray:
        """local ids -> float32 waveform at ``rate``."""

    # ------------------------------------------------------------------ encode
    def load(self, path: str) -> Waveform:
        return load_waveform(path, self.rate, self.params["max_seconds"], self.params["resampler"])

    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        frame = DocumentFramer(space, self.modality)
        wave = self.load(str(path))
        yield TokenDocument(
            str(path),
            f"{path}#{self.modality}",
            self.modality,
            frame(self.encode_waveform(wave.samples)),
        )

    def decode(self, tokens: np.ndarray, space: TokenSpace) -> np.ndarray:
        """Unified ids (specials dropped) -> float32 waveform at ``self.rate``."""
        return self.decode_waveform(local_ids(tokens, space, self.modality))

    # ------------------------------------------------------------------ contract
    def prompt_ids_for_seconds(
        self, space: TokenSpace, body: list[int], seconds: float
    ) -> list[int]:
        return body[: max(1, round(seconds * float(self.ids_per_second)))]

    def samples_in_prompt(self, space: TokenSpace, prompt: np.ndarray) -> int:
        """Waveform samples the prompt's ids decode to (what :meth:`media` cuts off)."""
        return len(np.asarray(self.decode(prompt, space)))

    def media(
        self,
        space: TokenSpace,
        prompt: Sequence[int],
        new: Sequence[int],
        with_prompt: bool = False,
    ) -> Media:
        """The waveform as 16-bit PCM WAV."""

        p = np.asarray(list(prompt), dtype=np.int64)
        allids = np.asarray(list(prompt) + list(new), dtype=np.int64)
        wave = np.asarray(self.decode(allids, space), dtype=np.float32)
        if not with_prompt:
            wave = wave[self.samples_in_prompt(space, p) :]
        return WavMedia(wave, self.rate)

    def fidelity(self, path: str, damage: Sequence[float] = (), seeds: int = 5) -> Entry:
        """SNR of the decoded waveform against the one read (see
        :func:`~ulysses_mm.tokenize.audio.fidelity.eval_audio`)."""

        return eval_audio(self, path, damage, seeds)

    @classmethod
    def fidelity_line(cls, entry: Entry) -> str:
        return audio_line(entry)

    def picture(self, fig: Any, cell: Any, data: Any, name: str) -> None:
        draw_waveform(fig, cell, np.asarray(data), self.rate, name)
