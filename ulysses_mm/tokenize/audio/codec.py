"""Audio as neural codec tokens (kind ``audio-codec``): transformers' EnCodec, DAC or Mimi.

For users who have a codec's weights. The spec names a model directory (``params.model``:
a path, relative to the spec or absolute, holding ``config.json`` and the weights) or a
Hugging Face id already in the local cache. Nothing is ever downloaded at run time
(``local_files_only``); a model that is not there is one line naming what is missing.

Per file: mono waveform at the model's sampling rate (the ``audio-mulaw`` decode and
libsoxr resample) -> the codec's residual-VQ codes ``[n_q, frames]`` -> ids frame by
frame, quantizer by quantizer, quantizer q's code c as ``q·codebook_size + c`` (so
``vocab_size = n_q·codebook_size`` and every id says which quantizer it came from)::

    <doc> <|audio|> f0q0 f0q1 … f0q(n-1) f1q0 … </doc>

``params.num_quantizers`` picks how many quantizers are kept (EnCodec: from its bandwidth,
``n_q = bandwidth·1000 / (frame_rate·log2(codebook_size))``). Tokens per second,
``frame_rate·n_q``, must be written in the spec as ``params.tokens_per_second`` and is
checked against the model, so a spec says what a second of audio costs in tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tokenize.audio.base import AudioTokenizer
from ulysses_mm.tokenize.audio.waveform import RESAMPLERS
from ulysses_mm.tokenize.base import Layout, Tokenizer, TokenizerSpec, TokenUnit
from ulysses_mm.tokenize.params import ParamSchema, check_choice, spec_params

_SCHEMA: ParamSchema = {
    "model": ((str,), ""),  # directory (relative to the spec) or a cached HF model id
    "num_quantizers": ((int,), 0),  # codebooks kept per frame
    "tokens_per_second": ((int, float), 0),  # frame_rate · num_quantizers, checked
    "max_seconds": ((int, float, type(None)), None),
    "resampler": ((str,), "sharp"),
}

_FAMILIES = ("encodec", "dac", "mimi")


def resolve_model_dir(spec: TokenizerSpec, name: str) -> Path:
    """The model's local directory; DataError (one line) if it is not on this machine."""
    where = spec.where
    p = Path(name).expanduser()
    if not p.is_absolute() and spec.path:
        p = Path(spec.path).parent / p
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise DataError(f"{where}: codec model directory {p} has no config.json")
        return p
    if name.count("/") == 1 and not name.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download  # lazy: only downloading a codec needs it

            return Path(snapshot_download(name, local_files_only=True))
        except Exception:  # any failure means: not in the local cache
            pass
    raise DataError(
        f"{where}: codec model {name!r} not found: no directory {p} and not in the local "
        "Hugging Face cache (models are never downloaded at run time; put the weights there)"
    )


class CodecAudioTokenizer(AudioTokenizer):
    """kind ``audio-codec``: one document per file, ``n_q`` ids per codec frame."""

    def __init__(self, spec: TokenizerSpec) -> None:
        super().__init__(spec)
        p = spec_params(spec, _SCHEMA)
        where = spec.where
        check_choice(spec, "resampler", p["resampler"], RESAMPLERS)
        if not p["model"]:
            raise DataError(f"{where}: param 'model' (the codec's directory or id) is required")
        if p["num_quantizers"] < 1:
            raise DataError(f"{where}: param 'num_quantizers' must be >= 1")
        self.params: dict[str, Any] = p
        self.model_dir = resolve_model_dir(spec, p["model"])
        from transformers import AutoConfig, AutoModel  # lazy: heavy (transformers)

        config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        self.family = config.model_type
        if self.family not in _FAMILIES:
            raise DataError(
                f"{where}: {self.model_dir} is a {self.family!r} model, not one of {_FAMILIES}"
            )
        if getattr(config, "audio_channels", 1) != 1:
            raise DataError(f"{where}: only mono codecs are supported")
        self.model = AutoModel.from_pretrained(self.model_dir, local_files_only=True).eval()
        self.rate = int(config.sampling_rate)
        self.codebook_size = int(config.codebook_size)
        self.n_q = int(p["num_quantizers"])
        self.frame_rate = float(self._frame_rate(config))
        if spec.vocab_size != self.n_q * self.codebook_size:
            raise DataError(
                f"{where}: vocab_size {spec.vocab_size} must be num_quantizers × codebook_size "
                f"= {self.n_q} × {self.codebook_size}"
            )
        tps = self.frame_rate * self.n_q
        if not math.isclose(float(p["tokens_per_second"]), tps, rel_tol=1e-6):
            raise DataError(
                f"{where}: params.tokens_per_second is {p['tokens_per_second']}, the model "
                f"makes {tps:g} ({self.frame_rate:g} frames/s × {self.n_q} quantizers)"
            )
        self.tokens_per_second = tps
        if self.family == "encodec":
            self._bandwidth()  # fail at load if no target bandwidth gives n_q

    def _frame_rate(self, config: Any) -> float:
        if self.family == "encodec":
            return float(config.frame_rate)
        if self.family == "dac":
            return self.rate / float(config.hop_length)
        return float(config.frame_rate)  # mimi

    def _bandwidth(self) -> float:
        """EnCodec picks its quantizers by bandwidth (kbps), one of the model's targets."""
        per_q = self.frame_rate * math.log2(self.codebook_size) / 1000.0
        bands = [float(b) for b in self.model.config.target_bandwidths]
        for b in bands:
            if max(1, math.floor(b / per_q + 1e-9)) == self.n_q:
                return b
        raise DataError(
            f"{self.spec.where}: EnCodec {self.model_dir.name} has no "
            f"bandwidth giving {self.n_q} quantizers (targets {bands} kbps, "
            f"{per_q:g} kbps each)"
        )

    # ------------------------------------------------------------------ encode
    def encode_waveform(self, samples: np.ndarray) -> np.ndarray:
        """float32 mono at the model's rate -> local ids [frames·n_q] (frame-major)."""
        import torch  # lazy: the tokenize layer stays torch-free

        x = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))[None, None]
        with torch.inference_mode():
            if self.family == "encodec":
                out = self.model.encode(x, bandwidth=self._bandwidth())
                codes = out.audio_codes[0, 0]  # [chunks=1, b, n_q, frames] -> [n_q, frames]
            elif self.family == "mimi":
                codes = self.model.encode(x, num_quantizers=self.n_q).audio_codes[0]
            else:
                codes = self.model.encode(x).audio_codes[0]
        codes = codes[: self.n_q].to(torch.int64).numpy()
        if codes.shape[0] != self.n_q:
            raise ValueError(
                f"the codec gave {codes.shape[0]} quantizers, the spec wants {self.n_q}"
            )
        offsets = (np.arange(self.n_q, dtype=np.int64) * self.codebook_size)[:, None]
        return (codes + offsets).T.reshape(-1)

    # ------------------------------------------------------------------ decode
    def codes_of(self, ids: np.ndarray) -> np.ndarray:
        """local ids [frames·n_q] -> codes [n_q, frames]; ValueError if not whole frames."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size % self.n_q:
            raise ValueError(f"{ids.size} codec ids are not whole frames of {self.n_q}")
        per = ids.reshape(-1, self.n_q).T  # [n_q, frames]
        q = per // self.codebook_size
        if (q != np.arange(self.n_q)[:, None]).any():
            raise ValueError("codec ids out of order: each frame must run quantizer 0..n_q-1")
        return per - q * self.codebook_size

    def decode_waveform(self, ids: np.ndarray) -> np.ndarray:
        import torch  # lazy: the tokenize layer stays torch-free

        codes = torch.from_numpy(self.codes_of(ids))[None]  # [1, n_q, frames]
        with torch.inference_mode():
            if self.family == "encodec":
                wav = self.model.decode(codes[None], [None]).audio_values
            else:
                wav = self.model.decode(audio_codes=codes).audio_values
        return wav.reshape(-1).float().numpy()

    # ------------------------------------------------------------------ contract
    @property
    def ids_per_second(self) -> float:
        return float(self.tokens_per_second)

    def damage_alphabet(self) -> tuple[int, int]:
        """A damaged id stays within its quantizer's codebook, so the ids still decode."""
        return self.spec.vocab_size, self.codebook_size

    @classmethod
    def token_labels(
        cls, entry: Mapping[str, Any], size: int, vocabulary: Sequence[str] | None = None
    ) -> list[str]:
        """Quantizer and code of each id (``q1:17``)."""
        n_q = int((entry.get("params") or {}).get("num_quantizers", 0))
        if n_q <= 0:
            return super().token_labels(entry, size, vocabulary)
        book = size // n_q
        return [f"q{k // book}:{k % book}" for k in range(size)]

    @classmethod
    def unit(
        cls, entry: Mapping[str, Any], size: int, load: Callable[[], Tokenizer]
    ) -> TokenUnit | None:
        """Bits per second: each id is 1/tokens_per_second of one."""
        tps = float((entry.get("params") or {}).get("tokens_per_second") or 0)
        return TokenUnit("second", np.full(size, 1.0 / tps)) if tps > 0 else None

    def layout(self, space: TokenSpace) -> Layout:
        """Each frame runs quantizer 0..n_q-1, each id from its quantizer's codebook."""
        return Layout(quantizers=self.n_q, codebook_size=self.codebook_size)
