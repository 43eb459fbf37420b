"""Video as VQ tokens (kind ``video-vq``): sampled frames -> patches -> codebook ids.

Per file::

    frames sampled at the spec's fps, resized and centre-cropped to ``size × size``
       (:mod:`ulysses_mm.tokenize.video.frames`)
    -> patchify: [t, S, S, 3] -> [t, (S/p)², p·p·3], patches in raster order
    -> nearest codeword of a k-means codebook fitted on data (``tokenizers/*.npy``,
       written by ``ulysses-mm tokenizer fit video``), one id per patch
    -> ``<doc> <|video|> f0 <eof> f1 <eof> … </doc>``  (``<eof>`` is the shared special 3)

With ``params.audio = {"spec": "audio-mulaw-16k.json"}`` (a spec path relative to this
spec) and ``chunk_frames = k``, the clip's audio track is tokenized by that audio spec and
interleaved per time chunk of k frames (k/fps seconds)::

    <doc> <|video|> k frames <|audio|> the chunk's samples <|video|> k frames … </doc>

The document's primary modality stays ``video``; a clip with no audio track gives a
video-only document; the dataset's token space must hold the audio modality too (see
:meth:`VqVideoTokenizer.companion_specs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, EOF, TokenSpace
from ulysses_mm.tokenize.audio import MulawTokenizer, load_waveform, mulaw_decode
from ulysses_mm.tokenize.base import (
    ParamSchema,
    TokenDocument,
    Tokenizer,
    TokenizerSpec,
    check_choice,
    spec_params,
)
from ulysses_mm.tokenize.kmeans import Codebook
from ulysses_mm.tokenize.video.frames import VideoProbe, decord_or_none, probe_video, sample_frames

_SCHEMA: ParamSchema = {
    "fps": ((int, float), 8.0),
    "size": ((int,), 256),
    "patch": ((int,), 16),
    "max_frames": ((int, type(None)), None),  # cap per file (null: the whole clip)
    "backend": ((str,), "auto"),  # auto | decord | pyav
    "audio": ((dict, type(None)), None),  # {"spec": "audio-….json"}: interleave the audio
    "chunk_frames": ((int,), 8),  # frames per interleaving chunk (with "audio")
    "fit": ((dict,), {}),  # provenance written by `tokenizer fit`; not used to tokenize
}


# --------------------------------------------------------------------------- patches
def patchify(frames: np.ndarray, patch: int) -> np.ndarray:
    """[t, S, S, 3] -> [t·(S/p)², p·p·3], patches in raster order, pixels (y, x, rgb)."""
    t, s = frames.shape[0], frames.shape[1]
    g = s // patch
    x = frames.reshape(t, g, patch, g, patch, 3).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(t * g * g, patch * patch * 3)


def unpatchify(patches: np.ndarray, size: int, patch: int) -> np.ndarray:
    """Inverse of :func:`patchify`: [t·(S/p)², p·p·3] -> [t, S, S, 3]."""
    g = size // patch
    t = patches.shape[0] // (g * g)
    x = patches.reshape(t, g, g, patch, patch, 3).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(t, size, size, 3)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images/videos (peak 255)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def load_codebook(spec: TokenizerSpec, patch: int) -> Codebook:
    where = spec.path or spec.name
    if spec.artifact is None:
        raise ValueError(f"{where}: a video-vq spec needs an 'artifact' (the codebook .npy)")
    try:
        arr = np.load(spec.artifact_path(), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot load codebook {spec.artifact}: {e}") from e
    d = patch * patch * 3
    if arr.ndim != 2 or arr.shape[1] != d or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(
            f"{where}: codebook {spec.artifact} must be float [vocab_size, patch·patch·3 = {d}], "
            f"got {arr.dtype} {list(arr.shape)}"
        )
    if arr.shape[0] != spec.vocab_size:
        raise ValueError(
            f"{where}: codebook has {arr.shape[0]} codewords, vocab_size is {spec.vocab_size}"
        )
    if not np.isfinite(arr).all():
        raise ValueError(f"{where}: codebook {spec.artifact} holds NaN or inf")
    return Codebook(arr.astype(np.float32))


# --------------------------------------------------------------------------- tokenizer
class VqVideoTokenizer(Tokenizer):
    """kind ``video-vq``: one document per clip, ``(size/patch)²`` ids + ``<eof>`` per frame."""

    schema: ParamSchema = _SCHEMA  # a subclass kind may add params

    def __init__(self, spec: TokenizerSpec) -> None:
        super().__init__(spec)
        p = spec_params(spec, self.schema)
        where = spec.path or spec.name
        check_choice(spec, "backend", p["backend"], ("auto", "decord", "pyav"))
        if p["backend"] == "decord" and decord_or_none() is None:
            raise ValueError(f"{where}: backend 'decord' asked for, but decord is not installed")
        if not p["fps"] > 0:
            raise ValueError(f"{where}: param 'fps' must be > 0")
        if p["size"] < 1 or p["patch"] < 1 or p["size"] % p["patch"]:
            raise ValueError(f"{where}: 'size' ({p['size']}) must be a multiple of 'patch'")
        if p["max_frames"] is not None and p["max_frames"] < 1:
            raise ValueError(f"{where}: param 'max_frames' must be >= 1 or null")
        if p["chunk_frames"] < 1:
            raise ValueError(f"{where}: param 'chunk_frames' must be >= 1")
        self.params: dict[str, Any] = p
        self.fps = float(p["fps"])
        self.size: int = p["size"]
        self.patch: int = p["patch"]
        self.tokens_per_frame = (self.size // self.patch) ** 2  # then one <eof>
        self.load_artifact()
        self.audio: MulawTokenizer | None = None
        if p["audio"] is not None:
            self.audio = self._load_audio(p["audio"])

    def load_artifact(self) -> None:
        """The learned state the spec's artifact holds (here: the k-means codebook)."""
        self.codebook = load_codebook(self.spec, self.patch)

    def _load_audio(self, cfg: dict[str, Any]) -> MulawTokenizer:
        from ulysses_mm.tokenize.registry import load_tokenizer

        where = self.spec.path or self.spec.name
        if set(cfg) != {"spec"} or not isinstance(cfg["spec"], str):
            raise ValueError(f'{where}: param \'audio\' must be {{"spec": "<audio spec>.json"}}')
        path = Path(self.spec.path).parent / cfg["spec"] if self.spec.path else Path(cfg["spec"])
        if not path.is_file():
            raise ValueError(f"{where}: audio spec {cfg['spec']} not found (looked at {path})")
        audio = load_tokenizer(path)
        if not isinstance(audio, MulawTokenizer) or audio.modality == self.modality:
            raise ValueError(f"{where}: {cfg['spec']} is not an audio tokenizer spec")
        return audio

    def companion_specs(self) -> list[TokenizerSpec]:
        """The audio spec of an interleaving spec: its modality must be in the token space."""
        return [] if self.audio is None else [self.audio.spec]

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

    def encode_frames(self, frames: np.ndarray) -> np.ndarray:
        """[t, size, size, 3] uint8 -> local ids [t, (size/patch)²] int64."""
        ids = self.codebook.encode(patchify(frames, self.patch))
        return ids.reshape(frames.shape[0], self.tokens_per_frame)

    def encoder(self) -> Callable[[np.ndarray], np.ndarray]:
        """A per-clip encoder: batches of a clip's frames, in order -> local ids [t, N].
        (Here frames are independent; a predictive kind keeps state across batches.)"""
        return self.encode_frames

    def frame_rows(self, ids: np.ndarray, start: int) -> np.ndarray | list[np.ndarray]:
        """A clip's local ids (the encoder's output) as unified ids, one row per frame:
        here [t, N + 1], each frame's patches then ``<eof>``."""
        frames = np.empty((ids.shape[0], self.tokens_per_frame + 1), dtype=np.int64)
        frames[:, :-1] = ids + start
        frames[:, -1] = EOF
        return frames

    def check_audio_range(self, space: TokenSpace) -> None:
        """Refuse a token space whose range for the interleaved audio differs from the
        audio spec's (KeyError if the space lacks that modality)."""
        if self.audio is not None:
            ar = space.range(self.audio.modality)
            if ar.size != self.audio.spec.vocab_size:
                raise ValueError(
                    f"{self.spec.path}: the token space's {self.audio.modality} range has "
                    f"{ar.size} ids, {self.audio.spec.name} uses {self.audio.spec.vocab_size}"
                )

    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        source = str(path)
        r = space.range(self.modality)  # KeyError now if the space lacks video
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
                out.append(np.array([v_tok]))  # back to video after an audio run
            out.append(np.concatenate(frames[bounds[c] : bounds[c + 1]]))
            in_audio = bool(cut[c + 1] > cut[c])
            if in_audio:
                out.append(np.array([a_tok]))
                out.append(codes[cut[c] : cut[c + 1]])
        return out

    # ------------------------------------------------------------------ decode
    def decode_ids(self, ids: np.ndarray) -> np.ndarray:
        """local ids [t, (size/patch)²] -> uint8 frames [t, size, size, 3]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1, self.tokens_per_frame)
        if ids.size and (ids.min() < 0 or ids.max() >= self.codebook.size):
            raise ValueError(f"video local id out of range 0..{self.codebook.size - 1}")
        px = self.codebook.decode(ids.ravel())
        frames = unpatchify(px, self.size, self.patch)
        return np.clip(np.rint(frames), 0, 255).astype(np.uint8)

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

    def split(self, tokens: np.ndarray, space: TokenSpace) -> tuple[np.ndarray, np.ndarray]:
        """(video local ids [t, N], audio local ids [n]) of one clip's unified ids.

        Video ids must come in whole frames, each closed by ``<eof>``; other specials are
        dropped; audio ids are accepted only if this spec interleaves audio."""
        t, is_video, audio = self.classify(tokens, space)
        vr = space.range(self.modality)
        seq = t[is_video | (t == EOF)]
        eofs = np.flatnonzero(seq == EOF)
        lengths = np.diff(np.concatenate([[-1], eofs])) - 1
        n = self.tokens_per_frame
        if (lengths != n).any() or seq.size != eofs.size * (n + 1):
            raise ValueError(f"video ids do not form whole frames of {n} ids, each then <eof>")
        video = seq[seq != EOF].reshape(-1, n) - vr.start
        return video, audio

    def decode(self, tokens: np.ndarray, space: TokenSpace) -> np.ndarray:
        """Unified ids of one clip -> uint8 frames [t, size, size, 3] (audio runs skipped)."""
        return self.decode_ids(self.split(tokens, space)[0])

    def decode_av(self, tokens: np.ndarray, space: TokenSpace) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 frames [t, size, size, 3], float32 waveform at the audio spec's rate)."""
        video, audio = self.split(tokens, space)
        wave = np.zeros(0, dtype=np.float32)
        if self.audio is not None:
            wave = mulaw_decode(audio, self.audio.bits)
        return self.decode_ids(video), wave
