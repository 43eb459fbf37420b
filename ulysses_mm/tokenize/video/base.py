"""What every video kind shares: sampled frames in, one clip document out, audio optional.

A video kind says how a clip's frames become local ids (:meth:`VideoTokenizer.encoder`),
how those ids become rows of unified ids, one row per frame ending in ``<eof>``
(:meth:`~VideoTokenizer.frame_rows`), and the way back (:meth:`~VideoTokenizer.split`,
:meth:`~VideoTokenizer.decode_ids`). This class does the rest, the same for every kind::

    frames sampled at the spec's fps, resized and centre-cropped to ``size × size``
       (:mod:`ulysses_mm.tokenize.video.frames`)
    -> the kind's ids, one row per frame
    -> ``<doc> <|video|> row0 row1 … </doc>``  (each row closed by ``<eof>``, special 3)

With ``params.audio = {"spec": "audio-mulaw-16k.json"}`` (a spec path relative to this
spec) and ``chunk_frames = k``, the clip's audio track is tokenized by that audio spec and
interleaved per time chunk of k frames (k/fps seconds)::

    <doc> <|video|> k frames <|audio|> the chunk's samples <|video|> k frames … </doc>

The document's primary modality stays ``video``; a clip with no audio track gives a
video-only document; the dataset's token space must hold the audio modality too (see
:meth:`VideoTokenizer.companion_specs`).

It also gives the rest of the :class:`~ulysses_mm.tokenize.base.Tokenizer` contract for
every video kind: the unit (bits per frame, one ``<eof>`` each), the layout (fixed frames
of ``tokens_per_frame`` ids, the audio interleaving; a ragged kind overrides
:meth:`~VideoTokenizer.frame_layout`), an MP4 of generated ids, the prompt's first
seconds, the PSNR fidelity measure and the frame strip of ``inspect --png``. A kind in a
subpackage (``video/<kind>/``) subclasses it and reuses
:mod:`~ulysses_mm.tokenize.video.frames`, :mod:`~ulysses_mm.tokenize.video.output` and
:mod:`~ulysses_mm.tokenize.video.fidelity`.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, EOF, TokenSpace
from ulysses_mm.tokenize.audio.mulaw import MulawTokenizer, mulaw_decode
from ulysses_mm.tokenize.audio.waveform import load_waveform
from ulysses_mm.tokenize.base import (
    Entry,
    Interleave,
    Layout,
    TokenDocument,
    Tokenizer,
    TokenizerSpec,
    TokenUnit,
)
from ulysses_mm.tokenize.params import ParamSchema, check_choice, spec_params
from ulysses_mm.tokenize.picture import draw_frames
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.video.fidelity import eval_video, video_line
from ulysses_mm.tokenize.video.frames import VideoProbe, decord_or_none, probe_video, sample_frames
from ulysses_mm.tokenize.video.output import Mp4Media, trim_unfinished_frame
from ulysses_mm.tokenize.write import Media

BACKENDS = ("auto", "decord", "pyav")

# The params every video kind takes; a kind's schema adds its own.
FRAME_PARAMS: ParamSchema = {
    "fps": ((int, float), 8.0),
    "size": ((int,), 256),
    "max_frames": ((int, type(None)), None),  # cap per file (null: the whole clip)
    "backend": ((str,), "auto"),  # auto | decord | pyav
    "audio": ((dict, type(None)), None),  # {"spec": "audio-….json"}: interleave the audio
    "chunk_frames": ((int,), 8),  # frames per interleaving chunk (with "audio")
}


class VideoTokenizer(Tokenizer):
    """One document per clip: the kind's ids for each sampled frame, each frame then
    ``<eof>``, the clip's audio interleaved per chunk if the spec names an audio spec."""

    schema: ParamSchema = FRAME_PARAMS  # a kind's class sets its own, FRAME_PARAMS and more
    tokens_per_frame: int  # ids per frame (a kind with variable frames: on average)
    fidelity_measure = "psnr_db"
    damages = True

    def __init__(self, spec: TokenizerSpec) -> None:
        super().__init__(spec)
        p = spec_params(spec, self.schema)
        where = spec.where
        check_choice(spec, "backend", p["backend"], BACKENDS)
        if p["backend"] == "decord" and decord_or_none() is None:
            raise DataError(f"{where}: backend 'decord' asked for, but decord is not installed")
        if not p["fps"] > 0:
            raise DataError(f"{where}: param 'fps' must be > 0")
        if p["max_frames"] is not None and p["max_frames"] < 1:
            raise DataError(f"{where}: param 'max_frames' must be >= 1 or null")
        if p["chunk_frames"] < 1:
            raise DataError(f"{where}: param 'chunk_frames' must be >= 1")
        self.params: dict[str, Any] = p
        self.fps = float(p["fps"])
        self.size: int = p["size"]
        self.audio: MulawTokenizer | None = None
        if p["audio"] is not None:
            self.audio = self._load_audio(p["audio"])

    def _load_audio(self, cfg: dict[str, Any]) -> MulawTokenizer:
        where = self.spec.where
        if set(cfg) != {"spec"} or not isinstance(cfg["spec"], str):
            raise DataError(f'{where}: param \'audio\' must be {{"spec": "<audio spec>.json"}}')
        path = Path(self.spec.path).parent / cfg["spec"] if self.spec.path else Path(cfg["spec"])
        if not path.is_file():
            raise DataError(f"{where}: audio spec {cfg['spec']} not found (looked at {path})")
        audio = load_tokenizer(path)
        if not isinstance(audio, MulawTokenizer) or audio.modality == self.modality:
            raise DataError(f"{where}: {cfg['spec']} is not an audio tokenizer spec")
        return audio

    def companion_specs(self) -> list[TokenizerSpec]:
        """The audio spec of an interleaving spec: its modality must be in the token space."""
        return [] if self.audio is None else [self.audio.spec]

    # ------------------------------------------------------------------ the kind's part
    @abstractmethod
    def encoder(self) -> Callable[[np.ndarray], np.ndarray]:
        """A per-clip encoder: batches of a clip's uint8 frames [b, size, size, 3], in
        order -> the kind's local ids for them (a kind may keep state across batches)."""

    def encode_frames(self, frames: np.ndarray) -> np.ndarray:
        """[t, size, size, 3] uint8 (one whole clip) -> the kind's local ids."""
        return self.encoder()(frames)

    @abstractmethod
    def frame_rows(self, ids: np.ndarray, start: int) -> np.ndarray | list[np.ndarray]:
        """A clip's local ids (the encoder's output) as unified ids (the video range starts
        at ``start``), one row per frame, each ending in ``<eof>``."""

    @abstractmethod
    def decode_ids(self, ids: np.ndarray) -> np.ndarray:
        """The kind's local ids of one clip -> uint8 frames [t, size, size, 3]."""

    @abstractmethod
    def split(self, tokens: np.ndarray, space: TokenSpace) -> tuple[np.ndarray, np.ndarray]:
        """(the kind's video local ids, audio local ids [n]) of one clip's unified ids."""

    # ------------------------------------------------------------------ encode
    def frames(self, path: str, probe: VideoProbe | None = None) -> Iterator[np.ndarray]:
        """Sampled, cropped uint8 frames [b, size, size, 3], in batches."""
        return sample_frames(
            path,
            self.fps,
            self.size,
            self.params["max_frames"],
            self.params["backend"],
            probe=probe,
        )

    def check_audio_range(self, space: TokenSpace) -> None:
        """Refuse a token space whose range for the interleaved audio differs from the
        audio spec's (KeyError if the space lacks that modality)."""
        if self.audio is not None:
            ar = space.range(self.audio.modality)
            if ar.size != self.audio.spec.vocab_size:
                raise DataError(
                    f"{self.spec.where}: the token space's {self.audio.modality} range has "
                    f"{ar.size} ids, {self.audio.spec.name} uses {self.audio.spec.vocab_size}"
                )

    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        source = str(path)
        r = space.range(self.modality)  # KeyError here if the space lacks video
        self.check_audio_range(space)
        probe = probe_video(source)
        encode = self.encoder()
        ids = np.concatenate([encode(b) for b in self.frames(source, probe)])
        frames = self.frame_rows(ids, r.start)
        body = [np.array([DOC_START, space.boundary_token(self.modality)])]
        if self.audio is not None and probe.has_audio:
            body += self._interleave(source, frames, space, probe)
        else:
            body.append(np.concatenate(frames))
        body.append(np.array([DOC_END]))
        tokens = np.concatenate(body).astype(space.dtype())
        yield TokenDocument(source, f"{source}#{self.modality}", self.modality, tokens)

    def _interleave(
        self,
        source: str,
        frames: np.ndarray | list[np.ndarray],
        space: TokenSpace,
        probe: VideoProbe,
    ) -> list[np.ndarray]:
        """Chunks of k frames (rows, each a frame's unified ids and ``<eof>``), each followed
        by the audio of its k/fps seconds."""
        assert self.audio is not None
        t, k = len(frames), self.params["chunk_frames"]
        # decode the audio the sampled frames cover (all of it unless max_frames cut the clip)
        wave = load_waveform(source, self.audio.rate, probe.start_seconds + t / self.fps + 0.5)
        bounds = np.unique(np.minimum(np.arange(0, t + k, k), t))  # frame index per chunk edge
        # Audio sample i plays at wave.start_time + i/rate; frame j at probe.start + j/fps.
        at = probe.start_seconds + bounds / self.fps - wave.start_time
        cut = np.clip(np.round(at * wave.rate).astype(np.int64), 0, wave.samples.shape[0])
        audio_start = space.range(self.audio.modality).start
        codes = self.audio.encode_waveform(wave.samples[: cut[-1]]).astype(np.int64) + audio_start
        v_tok = space.boundary_token(self.modality)
        a_tok = space.boundary_token(self.audio.modality)
        out: list[np.ndarray] = []
        in_audio = False
        for c in range(len(bounds) - 1):
            if in_audio:
                out.append(np.array([v_tok]))  # back to video after an audio span
            out.append(np.concatenate(frames[bounds[c] : bounds[c + 1]]))
            in_audio = bool(cut[c + 1] > cut[c])
            if in_audio:
                out.append(np.array([a_tok]))
                out.append(codes[cut[c] : cut[c + 1]])
        return out

    # ------------------------------------------------------------------ decode
    def classify(
        self, tokens: np.ndarray, space: TokenSpace
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(one clip's unified ids as int64, which are video ids, the audio local ids):
        anything but specials, video ids and (if this spec interleaves audio) audio ids is
        refused, naming the first."""
        t = np.asarray(tokens).astype(np.int64, copy=False).ravel()
        vr = space.range(self.modality)
        is_video = (t >= vr.start) & (t < vr.stop)
        is_audio = np.zeros_like(is_video)
        a_start = 0
        if self.audio is not None and self.audio.modality in space.modalities:
            ar = space.range(self.audio.modality)
            a_start = ar.start
            is_audio = (t >= ar.start) & (t < ar.stop)
        bad = ~(is_video | is_audio | (t < space.num_specials))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"token {int(t[i])} at position {i} is not a special, video"
                f"{' or audio' if self.audio is not None else ''} id in {space.describe()}"
            )
        return t, is_video, t[is_audio] - a_start

    def tracks(self, tokens: np.ndarray, space: TokenSpace) -> tuple[np.ndarray, np.ndarray]:
        """(the clip's video ids and ``<eof>`` in order, unified; audio local ids [n])."""
        t, is_video, audio = self.classify(tokens, space)
        return t[is_video | (t == EOF)], audio

    def decode(self, tokens: np.ndarray, space: TokenSpace) -> np.ndarray:
        """Unified ids of one clip -> uint8 frames [t, size, size, 3] (audio spans skipped)."""
        return self.decode_ids(self.split(tokens, space)[0])

    def decode_av(self, tokens: np.ndarray, space: TokenSpace) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 frames [t, size, size, 3], float32 waveform at the audio spec's rate)."""
        video, audio = self.split(tokens, space)
        wave = np.zeros(0, dtype=np.float32)
        if self.audio is not None:
            wave = mulaw_decode(audio, self.audio.bits)
        return self.decode_ids(video), wave

    # ------------------------------------------------------------------ contract
    @classmethod
    def unit(
        cls, entry: Mapping[str, Any], size: int, load: Callable[[], Tokenizer]
    ) -> TokenUnit | None:
        """Bits per frame: each frame's ``<eof>`` counts one."""
        return TokenUnit("frame", np.zeros(size), eof=1.0)

    def frame_layout(self) -> Layout:
        """How a frame's ids are laid out: by default exactly ``tokens_per_frame`` ids,
        then ``<eof>``."""
        return Layout(frame=self.tokens_per_frame)

    def layout(self, space: TokenSpace) -> Layout:
        """:meth:`frame_layout`, with the audio interleaved per chunk of frames when the spec
        interleaves it and ``space`` holds its modality."""
        frame = self.frame_layout()
        if self.audio is None or self.audio.modality not in space.modalities:
            return frame
        k = int(self.params["chunk_frames"])
        chunks = Interleave(self.audio.modality, k, k / self.fps, int(self.audio.rate))
        return dataclasses.replace(frame, interleave=chunks)

    def prompt_ids_for_seconds(
        self, space: TokenSpace, body: list[int], seconds: float
    ) -> list[int]:
        """The prompt's first ``round(seconds · fps)`` frames (at least one)."""
        frames = max(1, round(seconds * self.fps))
        eofs = np.flatnonzero(np.asarray(body) == EOF)
        return body if len(eofs) <= frames else body[: int(eofs[frames - 1]) + 1]

    def media(
        self,
        space: TokenSpace,
        prompt: Sequence[int],
        new: Sequence[int],
        with_prompt: bool = False,
    ) -> Media:
        """The whole frames as H.264 in an MP4, with the interleaved audio as AAC. The whole
        document is decoded at once (an H.264 frame needs the frames before it), then the
        prompt's frames are cut off; video ids after the last ``<eof>`` (a frame cut short)
        are dropped."""

        p = np.asarray(list(prompt), dtype=np.int64)
        allids = np.asarray(list(prompt) + list(new), dtype=np.int64)
        r = space.range(self.modality)
        allids = trim_unfinished_frame(allids, r.start, r.stop)
        skip_frames = 0 if with_prompt else int((p == EOF).sum())
        wave = None
        rate = 0
        if self.audio is not None and self.audio.modality in space.modalities:
            frames, wave = self.decode_av(allids, space)
            a = space.range(self.audio.modality)
            skip_audio = 0 if with_prompt else int(((p >= a.start) & (p < a.stop)).sum())
            wave, rate = wave[skip_audio:], self.audio.rate
        else:
            frames = self.decode(allids, space)
        hint = f"a {self.spec.name} frame is about {self.tokens_per_frame} ids"
        if self.audio is not None:
            k = self.params["chunk_frames"]
            hint += f", and every {k} frames {k / self.fps:g} s of audio at {self.audio.rate} ids/s"
        return Mp4Media(frames[skip_frames:], self.fps, wave, rate, hint)

    def fidelity(self, path: str, damage: Sequence[float] = (), seeds: int = 5) -> Entry:
        """PSNR of the decoded frames against the sampled ones (see
        :func:`~ulysses_mm.tokenize.video.fidelity.eval_video`)."""

        return eval_video(self, path, damage, seeds)

    @classmethod
    def fidelity_line(cls, entry: Entry) -> str:
        return video_line(entry)

    def picture(self, fig: Any, cell: Any, data: Any, name: str) -> None:
        draw_frames(fig, cell, np.asarray(data), name)
