"""What a person opens of video ids: an MP4 (PyAV: H.264 video, AAC audio when the clip's
audio was interleaved). Shared by every video kind."""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import numpy as np

from ulysses_mm.core.tokenspace import EOF
from ulysses_mm.tokenize.write import Media


def mp4_bytes(
    frames: np.ndarray,
    fps: float,
    audio: np.ndarray | None = None,
    rate: int = 16000,
    crf: int = 18,
) -> bytes:
    """uint8 frames [t, h, w, 3] at ``fps`` as H.264 (yuv420p; h and w even), with a mono
    waveform (float, ``rate`` Hz) as AAC when given, in an MP4."""
    import av  # lazy: heavy (av)

    frames = np.asarray(frames, dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        fr = Fraction(fps).limit_denominator(1001)
        vs = out.add_stream("libx264", rate=fr)
        vs.width, vs.height = int(frames.shape[2]), int(frames.shape[1])
        vs.pix_fmt = "yuv420p"
        vs.options = {"crf": str(crf)}
        aus = None
        if audio is not None and len(audio):
            aus = out.add_stream("aac", rate=int(rate))
            aus.layout = "mono"
        for i, f in enumerate(frames):
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            vf.pts = i
            vf.time_base = 1 / fr
            out.mux(vs.encode(vf))
        out.mux(vs.encode(None))
        if aus is not None:
            assert audio is not None
            wave_f32 = np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0)[None, :]
            af = av.AudioFrame.from_ndarray(wave_f32, format="flt", layout="mono")
            af.sample_rate = int(rate)
            af.pts = 0
            out.mux(aus.encode(af))
            out.mux(aus.encode(None))
    return buf.getvalue()


def trim_unfinished_frame(ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Drop the video ids after the last ``<eof>`` (a frame cut short); other ids stay."""
    eofs = np.flatnonzero(ids == EOF)
    last = int(eofs[-1]) if eofs.size else -1
    tail = ids[last + 1 :]
    video = (tail >= lo) & (tail < hi)
    return np.concatenate([ids[: last + 1], tail[~video]])


@dataclass
class Mp4Media(Media):
    """Frames at ``fps``, with a waveform at ``rate`` when the clip's audio was
    interleaved; ``hint``: what a frame costs, for the error when there is no frame."""

    frames: np.ndarray
    fps: float
    wave: np.ndarray | None = None
    rate: int = 0
    hint: str = ""
    suffix: ClassVar[str] = "mp4"
    shown_as: ClassVar[str] = "video"

    def to_bytes(self, record_id: str = "generated", description: str = "") -> bytes:
        return mp4_bytes(self.frames, self.fps, self.wave, self.rate or 16000)

    def describe(self) -> str:
        t = len(self.frames)
        sound = (
            f", {len(self.wave) / self.rate:.2f} s of audio"
            if self.wave is not None and len(self.wave)
            else ""
        )
        return f"{t} frames at {self.fps:g} fps{sound}"

    def lacking(self) -> str:
        if len(self.frames):
            return ""
        return f"no whole video frame; raise --new-tokens ({self.hint})"
