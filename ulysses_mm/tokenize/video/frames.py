"""Video files to frames: probe, then frames sampled at a rate, resized and centre-cropped.

Per file::

    probe (PyAV: streams, declared duration, a demux pass that surfaces truncation)
    -> frames at t0 + k/fps, each the frame on screen at that time (decord; PyAV where
       decord has no wheel, cannot open the file, or the codec is AV1)
    -> resize so the short side is ``size`` (FFmpeg swscale, bicubic), centre-crop
       to ``size × size``

Sampling rule, identical for both decoders: with t0 the first frame's presentation time
and ``end`` the end of the last frame, output frame k (k = 0, 1, … while t0 + k/fps < end)
is the last frame whose presentation time is <= t0 + k/fps.

Decoders run single-threaded: the pipeline parallelises across files. Every video kind
samples its frames here (:mod:`ulysses_mm.tokenize.video.base`), and ``tokenizer fit``
samples its training frames here too, so a codebook is fitted on what it will quantise.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ulysses_mm.tokenize.base import DecodeError
from ulysses_mm.tokenize.media import ffmpeg_log, first_error, open_media, stream_summary

_NO_DECORD_CODECS = {"av1", "libdav1d", "libaom-av1", "libsvtav1"}
# Seconds. Container timestamps are rounded (WebM/Matroska to the millisecond), so a sample
# time up to 1 ms before a frame's start picks that frame: at exactly the native rate every
# frame is taken once. (Frames are >= 4 ms apart below 250 fps, so this never skips one.)
_EPS = 1e-3


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
    import av  # lazy: heavy (av)

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


def decord_or_none() -> Any:
    """decord, imported on first use with FFmpeg's console chatter silenced; None if absent."""
    global _decord_ready
    try:
        import decord  # lazy: heavy (decord)
    except ImportError:
        return None
    if not _decord_ready:
        decord.logging.set_level(decord.logging.QUIET)
        _decord_ready = True
    return decord


def _frames_decord(
    path: str, probe: VideoProbe, fps: float, size: int, limit: int | None, batch: int
) -> Iterator[np.ndarray]:
    decord = decord_or_none()
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
    import av  # lazy: heavy (av)

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
        backend == "auto" and probe.codec not in _NO_DECORD_CODECS and decord_or_none() is not None
    )
    if use_decord:
        decord = decord_or_none()
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
