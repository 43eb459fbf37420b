"""Ids a model wrote, decoded by their tokenizer (:func:`decode_media`), to the files people
open: FASTA (biopython), WAV (the standard library's ``wave``, 16-bit PCM), MP4 (PyAV:
H.264 video, AAC audio when the clip's audio was interleaved) and UTF-8 text.
:func:`write_file` writes through a temporary sibling renamed into place, so a reader
never sees half of a file.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from ulysses_mm.core.storage import atomic_write_local
from ulysses_mm.core.tokenspace import EOF, TokenSpace
from ulysses_mm.tokenize.base import Tokenizer


def fasta_bytes(sequence: str, record_id: str, description: str = "") -> bytes:
    from Bio.Seq import Seq
    from Bio.SeqIO import write
    from Bio.SeqRecord import SeqRecord

    buf = io.StringIO()
    write(SeqRecord(Seq(sequence), id=record_id, description=description), buf, "fasta")
    return buf.getvalue().encode("ascii")


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


def mp4_bytes(
    frames: np.ndarray,
    fps: float,
    audio: np.ndarray | None = None,
    rate: int = 16000,
    crf: int = 18,
) -> bytes:
    """uint8 frames [t, h, w, 3] at ``fps`` as H.264 (yuv420p; h and w even), with a mono
    waveform (float, ``rate`` Hz) as AAC when given, in an MP4."""
    import av

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


def write_file(path: str | Path, data: bytes) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_local(p, data)
    return p


@dataclass
class Media:
    """Decoded ids, ready to write: DNA or text (``text``), a waveform at ``rate``, or
    frames at ``fps`` (with a waveform when the clip's audio was interleaved)."""

    kind: str  # "fasta", "wav", "mp4", "txt"
    text: str = ""
    wave: np.ndarray | None = None
    rate: int = 0
    frames: np.ndarray | None = None
    fps: float = 0.0

    @property
    def no_frames(self) -> bool:
        """Video ids that held no whole frame: no MP4 to write."""
        return self.kind == "mp4" and (self.frames is None or not len(self.frames))

    def to_bytes(self, record_id: str = "generated", description: str = "") -> bytes:
        if self.kind == "fasta":
            return fasta_bytes(self.text, record_id, description)
        if self.kind == "wav":
            assert self.wave is not None
            return wav_bytes(self.wave, self.rate)
        if self.kind == "mp4":
            assert self.frames is not None
            return mp4_bytes(self.frames, self.fps, self.wave, self.rate or 16000)
        return self.text.encode("utf-8")

    def describe(self) -> str:
        if self.kind == "fasta":
            return f"{len(self.text):,} bases"
        if self.kind == "wav":
            n = 0 if self.wave is None else len(self.wave)
            return f"{n / self.rate:.2f} s of audio ({n:,} samples at {self.rate} Hz)"
        if self.kind == "mp4":
            t = 0 if self.frames is None else len(self.frames)
            sound = (
                f", {len(self.wave) / self.rate:.2f} s of audio"
                if self.wave is not None and len(self.wave)
                else ""
            )
            return f"{t} frames at {self.fps:g} fps{sound}"
        return f"{len(self.text):,} characters"


def _trim_unfinished_frame(ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Drop the video ids after the last ``<eof>`` (a frame cut short); other ids stay."""
    eofs = np.flatnonzero(ids == EOF)
    last = int(eofs[-1]) if eofs.size else -1
    tail = ids[last + 1 :]
    video = (tail >= lo) & (tail < hi)
    return np.concatenate([ids[: last + 1], tail[~video]])


def decode_media(
    tokenizer: Tokenizer,
    space: TokenSpace,
    prompt: Sequence[int],
    new: Sequence[int],
    with_prompt: bool = False,
) -> Media:
    """``new`` ids (after ``prompt``, a document's ids from its ``<doc>``) decoded by
    ``tokenizer``: the continuation alone, or everything with ``with_prompt``. The whole
    document is decoded at once (an H.264 frame needs the frames before it), then the
    prompt's share is cut off."""
    from ulysses_mm.tokenize.audio import MulawTokenizer
    from ulysses_mm.tokenize.video.base import VideoTokenizer

    p = np.asarray(list(prompt), dtype=np.int64)
    allids = np.asarray(list(prompt) + list(new), dtype=np.int64)
    m = tokenizer.modality
    if isinstance(tokenizer, VideoTokenizer):
        r = space.range(m)
        allids = _trim_unfinished_frame(allids, r.start, r.stop)
        fps = tokenizer.fps
        skip_frames = 0 if with_prompt else int((p == EOF).sum())
        wave = None
        rate = 0
        if tokenizer.audio is not None and tokenizer.audio.modality in space.modalities:
            frames, wave = tokenizer.decode_av(allids, space)
            a = space.range(tokenizer.audio.modality)
            skip_audio = 0 if with_prompt else int(((p >= a.start) & (p < a.stop)).sum())
            wave, rate = wave[skip_audio:], tokenizer.audio.rate
        else:
            frames = tokenizer.decode(allids, space)
        return Media("mp4", frames=frames[skip_frames:], fps=fps, wave=wave, rate=rate)
    data = tokenizer.decode(allids, space)
    if isinstance(data, str):
        kind = "fasta" if m == "dna" or tokenizer.spec.kind.startswith("dna") else "txt"
        if with_prompt:
            return Media(kind, text=data)
        head = tokenizer.decode(p, space)
        text = (
            data[len(head) :]
            if data.startswith(head)
            else tokenizer.decode(allids[len(p) :], space)
        )
        return Media(kind, text=text)
    wave_all = np.asarray(data, dtype=np.float32)
    rate = int(getattr(tokenizer, "rate", 0) or tokenizer.spec.params.get("sample_rate", 16000))
    if with_prompt:
        return Media("wav", wave=wave_all, rate=rate)
    if isinstance(tokenizer, MulawTokenizer):
        r = space.range(m)
        skip = int(((p >= r.start) & (p < r.stop)).sum())
    else:
        skip = len(np.asarray(tokenizer.decode(p, space)))
    return Media("wav", wave=wave_all[skip:], rate=rate)
