"""Video: frames sampled at the spec's fps -> square crops -> patches -> codebook ids.

Pipeline per file (kind ``video-vq``)::

    probe (PyAV: streams, declared duration, a demux pass that surfaces truncation)
    -> frames at t0 + k/fps, each the frame on screen at that time (decord; PyAV where
       decord has no wheel, cannot open the file, or the codec is AV1)
    -> resize so the short side is ``size`` (FFmpeg swscale, bicubic), centre-crop
       to ``size × size``
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

Sampling rule, identical for both decoders: with t0 the first frame's presentation time
and ``end`` the end of the last frame, output frame k (k = 0, 1, … while t0 + k/fps < end)
is the last frame whose presentation time is <= t0 + k/fps.

Decoders run single-threaded: the pipeline parallelises across files.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.modalities.audio import MulawTokenizer, load_waveform, mulaw_decode
from ulysses_mm.modalities.base import DecodeError, TokenDocument, Tokenizer, TokenizerSpec
from ulysses_mm.modalities.kmeans import Codebook
from ulysses_mm.modalities.media import ffmpeg_log, first_error, open_media, stream_summary
from ulysses_mm.modalities.util import ParamSchema, check_choice, spec_params
from ulysses_mm.tokenspace import DOC_END, DOC_START, EOF, TokenSpace

VIDEO_SUFFIXES = {".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".mpg", ".mpeg", ".ogv", ".ts"}
_NO_DECORD_CODECS = {"av1", "libdav1d", "libaom-av1", "libsvtav1"}
# Seconds. Container timestamps are rounded (WebM/Matroska to the millisecond), so a sample
# time up to 1 ms before a frame's start picks that frame: at exactly the native rate every
# frame is taken once. (Frames are >= 4 ms apart below 250 fps, so this never skips one.)
_EPS = 1e-3

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


# --------------------------------------------------------------------------- probing
@dataclass
class VideoProbe:
    width: int
    height: int
    codec: str
    start_seconds: float  # presentation time of the first frame (container timeline)
    declared_seconds: float | None  # what the stream (else the container) header says
    data_seconds: float | None  # the end of the last video packet actually in the file
    has_audio: bool


def probe_video(path: str) -> VideoProbe:
    """Open with PyAV, pick the video stream, demux its packets (no decoding) to find where
    the data really ends; FFmpeg errors on the way (partial file, premature end) and a data
    end well short of the declared duration are DecodeErrors."""
    import av

    with ffmpeg_log() as logs:
        container = open_media(path)
        with container:
            streams = [
                s
                for s in container.streams.video
                if not (s.disposition & av.stream.Disposition.attached_pic)
            ]
            if not streams:
                pics = len(container.streams.video)
                what = " (only a cover-art picture)" if pics else ""
                raise DecodeError(
                    f"{path}: no video stream{what} (streams: {stream_summary(container)})"
                )
            stream = streams[0]
            tb = stream.time_base
            declared = None
            if stream.duration is not None and tb is not None:
                declared = float(stream.duration * tb)
            elif container.duration is not None:
                declared = container.duration / 1e6
            start = float(stream.start_time * tb) if stream.start_time is not None else 0.0
            end: float | None = None
            try:
                for packet in container.demux(stream):
                    if packet.pts is not None and tb is not None:
                        t = float((packet.pts + (packet.duration or 0)) * tb)
                        end = t if end is None else max(end, t)
            except av.error.FFmpegError as e:
                raise DecodeError(f"{path}: corrupt or truncated video: {e.strerror}") from None
            probe = VideoProbe(
                width=stream.codec_context.width,
                height=stream.codec_context.height,
                codec=stream.codec_context.name,
                start_seconds=start,
                declared_seconds=declared,
                data_seconds=None if end is None else end - start,
                has_audio=bool(container.streams.audio),
            )
    error = first_error(logs)
    if error is not None:
        raise DecodeError(f"{path}: corrupt or truncated video: {error}")
    if probe.width <= 0 or probe.height <= 0:
        raise DecodeError(f"{path}: video stream has no frame size ({probe.codec})")
    if probe.data_seconds is None:
        raise DecodeError(f"{path}: the video stream holds no packets")
    d = probe.declared_seconds
    if d is not None and probe.data_seconds < d - (0.25 + 0.02 * d):
        raise DecodeError(
            f"{path}: truncated video: its packets end at {probe.data_seconds:.2f} s, the "
            f"header declares {d:.2f} s"
        )
    return probe


# --------------------------------------------------------------------------- sampling
def resized_shape(width: int, height: int, size: int) -> tuple[int, int]:
    """(w, h) with the short side = size and the aspect ratio kept (before the crop)."""
    s = size / min(width, height)
    return max(size, round(width * s)), max(size, round(height * s))


def centre_crop(frames: np.ndarray, size: int) -> np.ndarray:
    """[t, h, w, 3] -> [t, size, size, 3] (a view)."""
    h, w = frames.shape[1:3]
    y, x = (h - size) // 2, (w - size) // 2
    return frames[:, y : y + size, x : x + size]


def sample_indices(starts: np.ndarray, end: float, fps: float, limit: int | None) -> np.ndarray:
    """Index of the frame on screen at t0 + k/fps, for every k with that time before end."""
    t0 = float(starts[0])
    times = t0 + np.arange(_sample_count(t0, end, fps, limit)) / fps
    idx = np.searchsorted(starts, times + _EPS, side="right") - 1
    return np.clip(idx, 0, len(starts) - 1)


_decord_ready = False


def _decord() -> Any:
    """decord, imported on first use with FFmpeg's console chatter silenced; None if absent."""
    global _decord_ready
    try:
        import decord
    except ImportError:
        return None
    if not _decord_ready:
        decord.logging.set_level(decord.logging.QUIET)
        _decord_ready = True
    return decord


def _frames_decord(
    path: str, probe: VideoProbe, fps: float, size: int, limit: int | None, batch: int
) -> Iterator[np.ndarray]:
    decord = _decord()
    w, h = resized_shape(probe.width, probe.height, size)
    vr = decord.VideoReader(path, ctx=decord.cpu(0), width=w, height=h, num_threads=1)
    n = len(vr)
    if n == 0:
        raise DecodeError(f"{path}: no video frames")
    ts = np.asarray(vr.get_frame_timestamp(np.arange(n)), dtype=np.float64)  # [n, 2]
    idx = sample_indices(ts[:, 0], float(ts[-1, 1]), fps, limit)
    for s in range(0, len(idx), batch):
        frames = vr.get_batch(idx[s : s + batch]).asnumpy()  # [b, h, w, 3] uint8
        yield np.ascontiguousarray(centre_crop(frames, size))


def _sample_count(t0: float, end: float, fps: float, limit: int | None) -> int:
    """How many sample times t0 + k/fps (+ _EPS) fall before ``end``."""
    count = max(1, math.ceil((end - t0 - _EPS) * fps))
    return count if limit is None else min(count, limit)


def _decoded_intervals(container: Any, stream: Any) -> Iterator[tuple[Any, float, float]]:
    """(frame, start, end) in presentation order; a frame is on screen until the next one."""
    rate = float(stream.average_rate or stream.guessed_rate or 25)
    prev: Any = None
    prev_t = 0.0
    for i, frame in enumerate(container.decode(stream)):
        t = float(frame.time) if frame.time is not None else i / rate
        if prev is not None:
            yield prev, prev_t, t
        prev, prev_t = frame, t
    if prev is not None:
        dur = float(prev.duration * prev.time_base) if prev.duration else 1.0 / rate
        yield prev, prev_t, prev_t + dur


def _frames_pyav(
    path: str, probe: VideoProbe, fps: float, size: int, limit: int | None, batch: int
) -> Iterator[np.ndarray]:
    import av

    w, h = resized_shape(probe.width, probe.height, size)
    out: list[np.ndarray] = []
    emitted = 0
    t0: float | None = None
    try:
        with av.open(path) as container:
            stream = next(
                s
                for s in container.streams.video
                if not (s.disposition & av.stream.Disposition.attached_pic)
            )
            stream.codec_context.thread_count = 1
            for frame, start, end in _decoded_intervals(container, stream):
                if t0 is None:
                    t0 = start
                upto = _sample_count(t0, end, fps, limit)  # samples before this frame's end
                if upto > emitted:
                    a = frame.to_ndarray(width=w, height=h, format="rgb24", interpolation="BICUBIC")
                    crop = centre_crop(a[None], size)[0]
                    for _ in range(upto - emitted):
                        out.append(crop)
                        if len(out) == batch:
                            yield np.stack(out)
                            out = []
                    emitted = upto
                if limit is not None and emitted >= limit:
                    break
    except av.error.FFmpegError as e:
        raise DecodeError(f"{path}: corrupt video: {e.strerror} after {emitted} frames") from None
    if out:
        yield np.stack(out)
    if emitted == 0:
        raise DecodeError(f"{path}: no video frames decoded")


def sample_frames(
    path: str,
    fps: float,
    size: int,
    max_frames: int | None = None,
    backend: str = "auto",
    batch: int = 32,
    probe: VideoProbe | None = None,
) -> Iterator[np.ndarray]:
    """uint8 frames [b, size, size, 3] in batches, sampled at ``fps`` (see module doc)."""
    probe = probe or probe_video(path)
    use_decord = backend == "decord" or (
        backend == "auto" and probe.codec not in _NO_DECORD_CODECS and _decord() is not None
    )
    if use_decord:
        decord = _decord()
        if decord is None:
            raise ValueError("backend 'decord' asked for, but decord is not installed here")
        gen = _frames_decord(path, probe, fps, size, max_frames, batch)
        try:
            first = next(gen)
        except decord.DECORDError as e:
            if backend == "decord":
                raise DecodeError(f"{path}: decord cannot decode it: {str(e)[-200:]}") from None
        else:  # decord opened the file: it decodes the rest (no fallback mid-clip)
            yield first
            try:
                yield from gen
            except decord.DECORDError as e:
                raise DecodeError(f"{path}: corrupt video (decord): {str(e)[-200:]}") from None
            return
    yield from _frames_pyav(path, probe, fps, size, max_frames, batch)


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

    def __init__(self, spec: TokenizerSpec) -> None:
        super().__init__(spec)
        p = spec_params(spec, _SCHEMA)
        where = spec.path or spec.name
        check_choice(spec, "backend", p["backend"], ("auto", "decord", "pyav"))
        if p["backend"] == "decord" and _decord() is None:
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
        self.codebook = load_codebook(spec, self.patch)
        self.audio: MulawTokenizer | None = None
        if p["audio"] is not None:
            self.audio = self._load_audio(p["audio"])

    def _load_audio(self, cfg: dict[str, Any]) -> MulawTokenizer:
        from ulysses_mm.modalities.registry import load_tokenizer

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

    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        source = str(path)
        r = space.range(self.modality)  # KeyError now if the space lacks video
        if self.audio is not None:
            ar = space.range(self.audio.modality)  # ... or the audio it interleaves
            if ar.size != self.audio.spec.vocab_size:
                raise ValueError(
                    f"{self.spec.path}: the token space's {self.audio.modality} range has "
                    f"{ar.size} ids, {self.audio.spec.name} uses {self.audio.spec.vocab_size}"
                )
        probe = probe_video(source)
        ids = np.concatenate([self.encode_frames(b) for b in self.frames(source, probe)])
        # [t, N + 1] unified ids: each frame's patches, then <eof>
        frames = np.empty((ids.shape[0], self.tokens_per_frame + 1), dtype=np.int64)
        frames[:, :-1] = ids + r.start
        frames[:, -1] = EOF
        body = [np.array([DOC_START, space.boundary_token(self.modality)])]
        if self.audio is not None and probe.has_audio:
            body += self._interleave(source, frames, space, probe)
        else:
            body.append(frames.ravel())
        body.append(np.array([DOC_END]))
        tokens = np.concatenate(body).astype(space.dtype())
        yield TokenDocument(source, f"{source}#{self.modality}", self.modality, tokens)

    def _interleave(
        self, source: str, frames: np.ndarray, space: TokenSpace, probe: VideoProbe
    ) -> list[np.ndarray]:
        """Chunks of k frames, each followed by the audio of its k/fps seconds."""
        assert self.audio is not None
        t, k = frames.shape[0], self.params["chunk_frames"]
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
            out.append(frames[bounds[c] : bounds[c + 1]].ravel())
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

    def split(self, tokens: np.ndarray, space: TokenSpace) -> tuple[np.ndarray, np.ndarray]:
        """(video local ids [t, N], audio local ids [n]) of one clip's unified ids.

        Video ids must come in whole frames, each closed by ``<eof>``; other specials are
        dropped; audio ids are accepted only if this spec interleaves audio."""
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
        seq = t[is_video | (t == EOF)]
        eofs = np.flatnonzero(seq == EOF)
        lengths = np.diff(np.concatenate([[-1], eofs])) - 1
        n = self.tokens_per_frame
        if (lengths != n).any() or seq.size != eofs.size * (n + 1):
            raise ValueError(f"video ids do not form whole frames of {n} ids, each then <eof>")
        video = seq[seq != EOF].reshape(-1, n) - vr.start
        return video, t[is_audio] - a_start

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
