"""Video through a learned tokenizer (kind ``video-codec``): frames -> a neural codec's ids.

The clip is sampled as every video kind samples it (fps, resize, centre crop: see
:mod:`ulysses_mm.tokenize.video.base`), then coded ``window_frames`` frames at a time (the
codec's own window; the last window's missing frames repeat the clip's last frame)::

    [window_frames, S, S, 3] -> codec -> [latents, S/s, S/s] ids
    -> one row per latent step: (S/s)² ids, then ``<eof>``

so a row stands for ``temporal`` frames (a causal codec's first row of each window for
one), every row costs the same ids, and a sampler forces ``<eof>`` after each row as it
does for ``video-vq``. Decoding groups rows back into windows (a window cut short is
completed by repeating its last row and cut back to the frames its rows hold).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError, UserError
from ulysses_mm.core.tokenspace import EOF, TokenSpace
from ulysses_mm.tokenize.base import Entry, Tokenizer, TokenizerSpec, TokenUnit
from ulysses_mm.tokenize.params import ParamSchema, check_choice
from ulysses_mm.tokenize.video.base import FRAME_PARAMS, VideoTokenizer
from ulysses_mm.tokenize.video.codec.models import FORMATS, VideoCodec, open_codec
from ulysses_mm.tokenize.video.frames import VideoProbe
from ulysses_mm.tokenize.video.output import Mp4Media, trim_unfinished_frame

_SCHEMA: ParamSchema = {
    **FRAME_PARAMS,
    "format": ((str,), "emu3"),  # emu3 | cosmos
    "model": ((str,), ""),  # the codec's directory, relative to the spec (never downloaded)
    "window_frames": (
        (int, type(None)),
        None,
    ),  # frames per codec call (default: emu3 one step, cosmos 1 + 2·temporal)
    "temporal": ((int, type(None)), None),  # cosmos: frames per latent step (default 8)
    "spatial": ((int, type(None)), None),  # cosmos: pixels per id along a side (default 16)
    "device": ((str,), "auto"),  # auto (a GPU where there is one) | cpu | cuda | cuda:N
    "dtype": ((str,), "float32"),  # float32 | bfloat16 | float16
}
_DTYPES = ("float32", "bfloat16", "float16")


class CodecVideoTokenizer(VideoTokenizer):
    """kind ``video-codec``: a neural codec's ids, one row of ``(size/spatial)²`` ids and
    ``<eof>`` per latent step."""

    schema: ParamSchema = _SCHEMA

    def __init__(self, spec: TokenizerSpec) -> None:
        super().__init__(spec)
        p, where = self.params, spec.where
        check_choice(spec, "format", p["format"], FORMATS)
        check_choice(spec, "dtype", p["dtype"], _DTYPES)
        if not p["model"]:
            raise DataError(f"{where}: kind 'video-codec' needs params.model (a local directory)")
        if p["audio"] is not None:
            raise DataError(
                f"{where}: kind 'video-codec' does not interleave audio (its rows are latent "
                "steps, not frames); drop params.audio and give the audio its own spec"
            )
        if p["format"] == "emu3":
            for key in ("temporal", "spatial"):
                if p[key] is not None:
                    raise DataError(
                        f"{where}: params.{key} applies to format 'cosmos'; an Emu3VQVAE's "
                        "factors come from its config.json"
                    )
        else:
            p["temporal"] = 8 if p["temporal"] is None else p["temporal"]
            p["spatial"] = 16 if p["spatial"] is None else p["spatial"]
            if p["temporal"] < 1 or p["spatial"] < 1:
                raise DataError(f"{where}: params.temporal and params.spatial must be >= 1")
        spec_dir = Path(spec.path).parent if spec.path else Path.cwd()
        self.codec: VideoCodec = open_codec(where, spec_dir, p, spec.vocab_size)
        c = self.codec
        if c.codebook != spec.vocab_size:
            raise DataError(
                f"{where}: vocab_size is {spec.vocab_size}, the codec in {c.path} has "
                f"{c.codebook} codes"
            )
        if self.size % c.spatial:
            raise DataError(
                f"{where}: 'size' ({self.size}) must be a multiple of the codec's spatial "
                f"factor {c.spatial}"
            )
        window = p["window_frames"]
        if window is None:
            window = c.frames(3 if c.causal else 1)
        if not c.whole(window):
            step = "1 + k·" if c.causal else "k·"
            raise DataError(
                f"{where}: params.window_frames ({window}) must be {step}{c.temporal} frames, "
                f"k >= {0 if c.causal else 1} (whole latent steps of the codec)"
            )
        self.window = int(window)  # frames per codec call
        self.rows_per_window = c.latents(self.window)
        self.tokens_per_frame = (self.size // c.spatial) ** 2  # ids per row (a latent step)
        self.frames_per_row = self.window / self.rows_per_window

    # ------------------------------------------------------------------ encode
    def frames(self, path: str, probe: VideoProbe | None = None) -> Iterator[np.ndarray]:
        """The sampled frames in windows of ``window_frames``, the last completed by
        repeating the clip's last frame."""
        held = np.zeros((0, self.size, self.size, 3), dtype=np.uint8)
        for batch in super().frames(path, probe):
            held = np.concatenate([held, batch])
            whole = len(held) // self.window * self.window
            if whole:
                yield held[:whole]
                held = held[whole:]
        if len(held):
            pad = np.repeat(held[-1:], self.window - len(held), axis=0)
            yield np.concatenate([held, pad])

    def encode_frames(self, frames: np.ndarray) -> np.ndarray:
        """[k·window_frames, size, size, 3] uint8 -> local ids [rows, (size/spatial)²]."""
        out = [
            self.codec.encode(frames[i : i + self.window])
            for i in range(0, len(frames), self.window)
        ]
        ids = np.concatenate(out) if out else np.zeros((0, 1, 1), dtype=np.int64)
        return ids.reshape(-1, self.tokens_per_frame)

    def encoder(self) -> Callable[[np.ndarray], np.ndarray]:
        """Windows are coded independently: the encoder is :meth:`encode_frames`."""
        return self.encode_frames

    def frame_rows(self, ids: np.ndarray, start: int) -> np.ndarray:
        """Local ids [rows, N] as unified ids [rows, N + 1]: a latent step, then ``<eof>``."""
        rows = np.empty((ids.shape[0], self.tokens_per_frame + 1), dtype=np.int64)
        rows[:, :-1] = ids + start
        rows[:, -1] = EOF
        return rows

    # ------------------------------------------------------------------ decode
    def decode_ids(self, ids: np.ndarray) -> np.ndarray:
        """local ids [rows, (size/spatial)²] -> uint8 frames [t, size, size, 3]."""
        n, side = self.tokens_per_frame, self.size // self.codec.spatial
        ids = np.asarray(ids, dtype=np.int64).reshape(-1, n)
        if ids.size and (ids.min() < 0 or ids.max() >= self.codec.codebook):
            raise ValueError(f"video local id out of range 0..{self.codec.codebook - 1}")
        out = [np.zeros((0, self.size, self.size, 3), dtype=np.uint8)]
        k = self.rows_per_window
        for i in range(0, len(ids), k):
            rows = ids[i : i + k]
            have = len(rows)
            if have < k:  # a window cut short: complete it, keep the frames its rows hold
                rows = np.concatenate([rows, np.repeat(rows[-1:], k - have, axis=0)])
            frames = self.codec.decode(rows.reshape(k, side, side))
            out.append(frames[: self.codec.frames(have)])
        return np.concatenate(out)

    def split(self, tokens: np.ndarray, space: TokenSpace) -> tuple[np.ndarray, np.ndarray]:
        """(video local ids [rows, N], no audio) of one clip's unified ids: whole rows, each
        closed by ``<eof>``."""
        seq, audio = self.tracks(tokens, space)
        eofs = np.flatnonzero(seq == EOF)
        lengths = np.diff(np.concatenate([[-1], eofs])) - 1
        n = self.tokens_per_frame
        if (lengths != n).any() or seq.size != eofs.size * (n + 1):
            raise ValueError(f"video ids do not form whole rows of {n} ids, each then <eof>")
        return seq[seq != EOF].reshape(-1, n) - space.range(self.modality).start, audio

    def frames_of_rows(self, rows: int) -> int:
        """Frames the first ``rows`` rows of a clip decode to."""
        k = self.rows_per_window
        rest = rows % k
        return rows // k * self.window + (self.codec.frames(rest) if rest else 0)

    # ------------------------------------------------------------------ contract
    @classmethod
    def token_labels(
        cls, entry: Mapping[str, Any], size: int, vocabulary: Sequence[str] | None = None
    ) -> list[str]:
        """The codec's code of each id (``c42``)."""
        return [f"c{k}" for k in range(size)]

    @classmethod
    def unit(
        cls, entry: Mapping[str, Any], size: int, load: Callable[[], Tokenizer]
    ) -> TokenUnit | None:
        """Bits per frame: a row's ``<eof>`` counts the frames its latent step holds (on
        average over a window: a causal codec's first step holds one)."""
        try:
            tok = load()
        except (LookupError, OSError, ValueError, UserError):
            return None  # the codec is not here or not usable here: nats per token only
        assert isinstance(tok, CodecVideoTokenizer)
        return TokenUnit("frame", np.zeros(size), eof=tok.frames_per_row)

    def prompt_ids_for_seconds(
        self, space: TokenSpace, body: list[int], seconds: float
    ) -> list[int]:
        """The prompt's first rows covering ``round(seconds · fps)`` frames (at least one)."""
        frames = max(1, round(seconds * self.fps))
        eofs = np.flatnonzero(np.asarray(body) == EOF)
        rows = next((r for r in range(1, len(eofs) + 1) if self.frames_of_rows(r) >= frames), 0)
        return body if not rows or rows == len(eofs) else body[: int(eofs[rows - 1]) + 1]

    def media(
        self,
        space: TokenSpace,
        prompt: Sequence[int],
        new: Sequence[int],
        with_prompt: bool = False,
    ) -> Any:
        """The whole rows' frames as H.264 in an MP4 (ids after the last ``<eof>`` are a
        row cut short: dropped), the prompt's frames cut off unless ``with_prompt``."""

        p = np.asarray(list(prompt), dtype=np.int64)
        r = space.range(self.modality)
        ids = trim_unfinished_frame(np.concatenate([p, np.asarray(new, np.int64)]), r.start, r.stop)
        frames = self.decode(ids, space)
        skip = 0 if with_prompt else self.frames_of_rows(int((p == EOF).sum()))
        c = self.codec
        hint = (
            f"a {self.spec.name} row is {self.tokens_per_frame} ids and <eof>, "
            f"{c.temporal} frames ({'the first of a window: 1' if c.causal else 'each'})"
        )
        return Mp4Media(frames[skip:], self.fps, None, 0, hint)

    def fidelity(self, path: str, damage: Sequence[float] = (), seeds: int = 5) -> Entry:
        """PSNR as every video kind measures it (the sampled frames, the last window
        completed, against the decoded ones), ids per frame over the rows' frames."""
        entry = super().fidelity(path, damage, seeds)
        per = self.tokens_per_frame / self.frames_per_row
        entry["tokens_per_frame"] = entry["max_tokens_per_frame"] = round(per, 1)
        entry["ids_per_row"] = self.tokens_per_frame
        return entry

    def describe_codec(self) -> dict[str, Any]:
        c = self.codec
        return {
            "format": self.params["format"],
            "codes": c.codebook,
            "temporal": c.temporal,
            "spatial": c.spatial,
            "ids_per_row": self.tokens_per_frame,
            "frames_per_row": self.frames_per_row,
        }
