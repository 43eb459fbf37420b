"""Audio in: any container PyAV (FFmpeg) decodes -> mono float32 waveform at a given rate.

Decoding goes through PyAV for every format (wav, flac, ogg/vorbis/opus, mp3, and the audio
track of mp4/webm/mkv …) so there is one code path and one set of failure modes.
The downmix to mono is libswresample's (``av.AudioResampler``), to 16-bit mono: with an
integer output FFmpeg normalises its downmix matrix so it cannot clip (for stereo it is
exactly the mean of the two channels; a float output is not normalised, so a centred
source would come out louder). 16-bit PCM is mu-law's classic input, quantised far finer
than any mu-law code. The rate change is, by param ``resampler``,

- ``"sharp"`` (the default): libsoxr to twice the spec's rate, then the linear-phase
  low-pass of :func:`sharp_lowpass` and every other sample: flat almost to the output
  Nyquist;
- ``"soxr"``: libsoxr's very-high-quality filter alone, whose pass band ends sooner; or
- ``"swr"``: libswresample's default filter, which rolls off sooner still.

The README's resampling row measures them against an ideal band-limited resample.

A bad input raises :class:`DecodeError` with the reason that was actually observed:

- empty file; not a media file FFmpeg can open; no audio stream (listing what streams
  there are);
- an FFmpeg exception while decoding, or an error the decoder logs (corrupt packets);
- truncation: a WAV shorter than its RIFF header declares; an Ogg file whose last page
  is cut short or lacks the end-of-stream flag; or fewer seconds decoded than the stream
  header declares (more than 0.1 s + 1% short; skipped when FFmpeg itself says the
  duration is only estimated from the bitrate);
- nothing decoded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.tokenize.base import DecodeError
from ulysses_mm.tokenize.media import (
    check_file,
    ffmpeg_log,
    first_error,
    open_media,
    stream_summary,
)


# --------------------------------------------------------------------------- decoding
@dataclass
class Waveform:
    samples: np.ndarray  # float32 [n], mono
    rate: int
    start_time: float  # seconds, presentation time of the first sample in the container
    declared_seconds: float | None  # what the header says the stream lasts, if it says


def check_container_complete(path: str) -> None:
    """Structural truncation checks FFmpeg does not make: RIFF/WAV size, Ogg last page."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        head = f.read(12)
        if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
            declared = struct.unpack("<I", head[4:8])[0] + 8
            # 0 / 0xFFFFFFFF: written by a streaming encoder that never went back to fill it.
            # One byte of slack: some writers declare an odd chunk's pad byte but omit it.
            if 8 < declared < 0xFFFFFFFF + 8 and size < declared - 1:
                raise DecodeError(
                    f"{path}: truncated WAV: the RIFF header declares {declared} bytes, the "
                    f"file has {size}"
                )
        elif head[:4] == b"OggS":
            window = min(size, 65536 + 27 + 255)  # an Ogg page is at most 65307 bytes
            f.seek(size - window)
            tail = f.read(window)
            pos = tail.rfind(b"OggS")
            while pos >= 0 and (len(tail) - pos < 27 or tail[pos + 4] != 0):
                pos = tail.rfind(b"OggS", 0, pos)
            if pos < 0:
                raise DecodeError(f"{path}: corrupt Ogg: no page header in the last 64 KiB")
            nseg = tail[pos + 26]
            table = tail[pos + 27 : pos + 27 + nseg]
            page_end = pos + 27 + nseg + sum(table)
            if len(table) < nseg or page_end > len(tail):
                raise DecodeError(f"{path}: truncated Ogg: the last page is cut short")
            if not tail[pos + 5] & 0x04:
                raise DecodeError(
                    f"{path}: truncated Ogg: the last page does not carry the end-of-stream flag"
                )


RESAMPLERS = ("sharp", "soxr", "swr")


def sharp_lowpass(out_rate: int) -> np.ndarray:
    """The ``"sharp"`` resampler's last filter, at twice ``out_rate``: linear phase (odd
    length, Kaiser-windowed sinc), pass band to 0.99375 of the output Nyquist, a 100 dB
    stop band from the Nyquist on. Kaiser's formula gives its length for that transition;
    the ratios are fixed, so the length is the same at any rate."""
    fs = 2.0 * out_rate
    pass_end, stop_begin, atten_db = 0.99375 * out_rate / 2, out_rate / 2, 100.0
    n = int(np.ceil((atten_db - 7.95) / (2.285 * 2 * np.pi * (stop_begin - pass_end) / fs))) | 1
    fc = 0.5 * (pass_end + stop_begin) / fs  # cycles per sample at fs
    k = np.arange(n) - (n - 1) / 2
    h = 2 * fc * np.sinc(2 * fc * k) * np.kaiser(n, 0.1102 * (atten_db - 8.7))
    return h / h.sum()


class _HalveFIR:
    """Streaming FIR filter + keep every other sample (overlap-save FFT convolution).

    Input is cut into fixed blocks counted from the stream's start, so how the caller
    chunks it does not change a single output sample. The filter's delay, (taps - 1) / 2
    samples, is dropped, so output ``k`` is the filtered input at ``2k``.
    """

    def __init__(self, taps: np.ndarray) -> None:
        self.n = taps.shape[0]
        self.nfft = 1 << int(np.ceil(np.log2(4 * self.n)))
        self.block = self.nfft - self.n + 1
        self.spectrum = np.fft.rfft(taps.astype(np.float32), self.nfft)
        self.history = np.zeros(self.n - 1, dtype=np.float32)
        self.pending: list[np.ndarray] = []
        self.pending_samples = 0
        self.skip = (self.n - 1) // 2  # the filter's delay, still to drop
        self.produced = 0  # full-rate outputs past the delay so far (their parity)

    def _run(self, x: np.ndarray) -> np.ndarray:
        seg = np.concatenate([self.history, x])  # [n - 1 + len(x)]
        y = np.fft.irfft(np.fft.rfft(seg, self.nfft) * self.spectrum, self.nfft)
        y = y[self.n - 1 : self.n - 1 + x.shape[0]]  # the part free of circular wrap
        self.history = seg[-(self.n - 1) :]
        drop = min(self.skip, y.shape[0])
        y, self.skip = y[drop:], self.skip - drop
        out = y[self.produced % 2 :: 2]
        self.produced += y.shape[0]
        return out.astype(np.float32, copy=False)

    def push(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        if x.shape[0]:
            self.pending.append(np.asarray(x, dtype=np.float32))
            self.pending_samples += x.shape[0]
        if last:  # flush the delay line with silence (what an ideal resample sees too)
            self.pending.append(np.zeros((self.n - 1) // 2, dtype=np.float32))
            self.pending_samples += (self.n - 1) // 2
        if self.pending_samples < self.block and not last:
            return np.zeros(0, dtype=np.float32)
        data = np.concatenate(self.pending)
        outs = []
        full = data.shape[0] if last else data.shape[0] - data.shape[0] % self.block
        for i in range(0, full, self.block):
            outs.append(self._run(data[i : i + self.block]))
        self.pending = [data[full:]]
        self.pending_samples = data.shape[0] - full
        return np.concatenate(outs) if outs else np.zeros(0, dtype=np.float32)


class _RateStream:
    """One input rate -> ``out_rate``, streamed: libsoxr alone (``sharp=False``: its
    very-high-quality filter) or libsoxr's high-quality filter to twice ``out_rate`` (its
    pass band ends well above the band kept) then :func:`sharp_lowpass` and every other
    sample. Exact across chunks either way."""

    def __init__(self, in_rate: int, out_rate: int, sharp: bool) -> None:
        import soxr  # lazy: optional (soxr), only resampling needs it

        self.ratio = out_rate / in_rate
        self.samples_in = 0
        self.samples_out = 0
        self.halve = _HalveFIR(sharp_lowpass(out_rate)) if sharp else None
        mid = 2 * out_rate if sharp else out_rate
        self.soxr = None
        if in_rate != mid:
            quality = "HQ" if sharp else "VHQ"
            self.soxr = soxr.ResampleStream(in_rate, mid, 1, dtype="float32", quality=quality)

    def resample_chunk(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        self.samples_in += x.shape[0]
        y = np.asarray(x, dtype=np.float32)
        if self.soxr is not None:
            y = np.asarray(self.soxr.resample_chunk(y, last=last), dtype=np.float32)
        if self.halve is None:
            return y
        y = self.halve.push(y, last=last)
        if last:  # the sharp path's length is the ideal one: round(n * out / in)
            y = y[: max(0, round(self.samples_in * self.ratio) - self.samples_out)]
        self.samples_out += y.shape[0]
        return y


class _Resampler:
    """Decoded frames -> mono float32 at ``rate``, in batches of about half a second.

    The downmix is libswresample's (``av.AudioResampler``) to 16-bit mono at the source
    rate (see the module docstring for why 16-bit). The rate change is then
    :class:`_RateStream` (``"sharp"``: with :func:`sharp_lowpass`; ``"soxr"``: libsoxr
    alone), or for ``"swr"`` libswresample's own filter in the same call as the downmix.

    PyAV's resampler is a filter graph whose per-call overhead dominates for codecs with
    small frames (mp3, vorbis), so decoded frames of the same format are joined in an
    ``av.AudioFifo`` (FFmpeg's sample FIFO, any format, no copy through numpy) before each
    call.
    """

    def __init__(self, rate: int, method: str = "sharp") -> None:
        self.rate = rate
        self.method = method
        self.resampler: Any = None
        self.soxr: _RateStream | None = None  # the rate change for the current input rate
        self.pending: Any = None  # an av.AudioFifo of frames of one format
        self.pending_samples = 0
        self.key: tuple[str, str, int] | None = None
        self.out: list[np.ndarray] = []
        self.samples = 0

    def push(self, frame: Any) -> None:
        key = (frame.format.name, frame.layout.name, frame.sample_rate)
        if key != self.key:
            self._flush_pending()
            if self.key is not None and key[2] != self.key[2]:
                self._finish_rate()  # a new input rate: end the old filter's stream
            self.key = key
        if self.pending is None:
            import av  # lazy: heavy (av)

            self.pending = av.AudioFifo()
        frame.pts = None  # the fifo joins samples; it need not check their timing
        self.pending.write(frame)
        self.pending_samples += frame.samples
        if self.pending_samples >= frame.sample_rate // 2:
            self._flush_pending()

    def _flush_pending(self) -> None:
        import av  # lazy: heavy (av)

        if self.pending is None or not self.pending_samples or self.key is None:
            return
        frame = self.pending.read()
        self.pending, self.pending_samples = None, 0
        if self.resampler is None:
            out_rate = self.rate if self.method == "swr" else None  # None: keep the input's
            self.resampler = av.AudioResampler(format="s16", layout="mono", rate=out_rate)
        self._take(self.resampler.resample(frame), last=False)

    def _to_rate(self, mono: np.ndarray, in_rate: int, last: bool) -> np.ndarray:
        if self.method == "swr" or in_rate == self.rate:
            return mono
        if self.soxr is None:
            self.soxr = _RateStream(in_rate, self.rate, sharp=self.method == "sharp")
        return np.asarray(self.soxr.resample_chunk(mono, last=last), dtype=np.float32)

    def _take(self, frames: list[Any], last: bool) -> None:
        for f in frames:
            a = f.to_ndarray()[0].astype(np.float32) * np.float32(1.0 / 32768.0)  # [1, n] -> [n]
            self._append(self._to_rate(a, f.sample_rate, last=False))
        if last and self.soxr is not None:
            self._append(self.soxr.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
            self.soxr = None

    def _append(self, a: np.ndarray) -> None:
        if a.shape[0]:
            self.out.append(np.asarray(a, dtype=np.float32))
            self.samples += a.shape[0]

    def _finish_rate(self) -> None:
        if self.resampler is not None:
            self._take(self.resampler.resample(None), last=True)
        self.resampler = None

    def finish(self) -> np.ndarray:
        self._flush_pending()
        self._finish_rate()
        if not self.out:
            return np.zeros(0, dtype=np.float32)
        return np.clip(np.concatenate(self.out), -1.0, 1.0)


def load_waveform(
    path: str, rate: int, max_seconds: float | None = None, resampler: str = "sharp"
) -> Waveform:
    """Decode the first audio stream of ``path``; mono float32 in [-1, 1] at ``rate``
    (``resampler``: "sharp", "soxr" or "swr", see :class:`_Resampler`)."""
    import av  # lazy: heavy (av)

    check_file(path)
    check_container_complete(path)
    limit = None if max_seconds is None else round(max_seconds * rate)
    capped = False
    start_time: float | None = None
    resample = _Resampler(rate, resampler)
    with ffmpeg_log() as logs:
        container = open_media(path)
        with container:
            if not container.streams.audio:
                raise DecodeError(f"{path}: no audio stream (streams: {stream_summary(container)})")
            stream = container.streams.audio[0]
            stream.codec_context.thread_count = 1
            declared = None
            if stream.duration is not None and stream.time_base is not None:
                declared = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                declared = container.duration / 1e6
            seconds_in = 0.0
            try:
                for frame in container.decode(stream):
                    if start_time is None and frame.time is not None:
                        start_time = float(frame.time)
                    resample.push(frame)
                    seconds_in += frame.samples / frame.sample_rate
                    if max_seconds is not None and seconds_in >= max_seconds + 0.1:
                        capped = True
                        break
                samples = resample.finish()
            except av.error.FFmpegError as e:
                raise DecodeError(
                    f"{path}: corrupt or truncated audio: {e.strerror} after {seconds_in:.2f} s"
                ) from None
            except ValueError as e:  # the resampler refuses a mid-stream layout change
                raise DecodeError(f"{path}: audio format changes mid-stream: {e}") from None
    error = first_error(logs)
    if error is not None:
        raise DecodeError(f"{path}: the decoder reported an error: {error}")
    if samples.shape[0] == 0:
        raise DecodeError(f"{path}: no audio samples decoded")
    seconds = samples.shape[0] / rate
    estimated = any("Estimating duration from bitrate" in m for _, _, m in logs)
    short = declared is not None and seconds < declared - (0.1 + 0.01 * declared)
    if short and not capped and not estimated:
        raise DecodeError(
            f"{path}: truncated audio: decoded {seconds:.2f} s of the {declared:.2f} s "
            "the stream header declares"
        )
    if limit is not None:
        samples = samples[:limit]
    return Waveform(samples, rate, start_time or 0.0, declared)
