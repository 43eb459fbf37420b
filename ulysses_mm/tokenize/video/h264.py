"""kind ``video-h264``: video as the bytes of its H.264 bitstream, two bytes per id.

The clip's sampled frames (sampling, document framing and audio interleaving:
:mod:`ulysses_mm.tokenize.video.base`) go through libx264 (PyAV's bundled encoder) with no
B-frames and no look-ahead (``tune=zerolatency``: one packet per frame, in display order),
one thread (the bytes are a function of the frames and the params), average-bitrate rate
control at ``tokens_per_frame`` ids a frame and a VBV buffer of two seconds' bits (no
frame bursts far above it; a keyframe every ``keyint`` frames costs several times the
average). Each frame's packet becomes ids: a byte pair ``(a, b)`` is id ``256·a + b``, an
odd last byte ``c`` is id ``65536 + c`` (vocab 65,792); then ``<eof>``. So a frame is a
variable number of ids (its packet), ``tokens_per_frame`` on average.

Motion compensation, intra prediction, transforms and entropy coding let H.264 spend its
ids where the picture needs them, which a per-patch code cannot (the README's video table
compares the kinds). The price: ids are entropy-coded bytes (language models do learn
codec bytes — JPEG-LM, Han et al. 2024 — but a wrong id garbles the picture until the next
keyframe). Decoding never fails on ids a model wrote: a frame the decoder rejects repeats
the previous one (grey at the start), so every ``<eof>`` gives exactly one frame.

Local ids are ragged: one clip's ids are a 1-D array whose frames end at ``FRAME_END``
(−1); unified ids put ``<eof>`` there.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import EOF, TokenSpace
from ulysses_mm.tokenize.base import TokenizerSpec
from ulysses_mm.tokenize.params import ParamSchema, check_choice
from ulysses_mm.tokenize.video.base import FRAME_PARAMS, VideoTokenizer

FRAME_END = -1  # a frame's end in ragged local ids
PAIRS = 1 << 16  # ids 0 .. 65535: byte pairs
VOCAB = PAIRS + 256  # then 65536 + c: a packet's odd last byte
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower")

_SCHEMA: ParamSchema = {
    **FRAME_PARAMS,
    "tokens_per_frame": ((int,), 240),  # the rate control's average ids per frame
    "keyint": ((int,), 64),  # frames between keyframes
    "preset": ((str,), "medium"),  # libx264's speed/efficiency preset
}


def packet_ids(packet: bytes) -> np.ndarray:
    """A packet's bytes as ids: byte pairs (big-endian 16-bit), an odd last byte apart."""
    b = np.frombuffer(packet, dtype=np.uint8)
    even = b[: b.size - (b.size % 2)].astype(np.int64)
    ids = even[0::2] * 256 + even[1::2]
    if b.size % 2:
        ids = np.append(ids, PAIRS + int(b[-1]))
    return ids


def ids_packet(ids: np.ndarray) -> bytes:
    """Inverse of :func:`packet_ids` (an odd-byte id anywhere but last is kept as one byte)."""
    ids = np.asarray(ids, dtype=np.int64)
    single = ids >= PAIRS
    out = np.empty((ids.size, 2), dtype=np.uint8)
    out[:, 0] = np.where(single, ids - PAIRS, ids >> 8)
    out[:, 1] = ids & 0xFF
    keep = np.ones(out.shape, dtype=bool)
    keep[single, 1] = False
    return out[keep].tobytes()


class H264VideoTokenizer(VideoTokenizer):
    """kind ``video-h264``: one document per clip; each frame's H.264 packet as ids, then
    ``<eof>`` (see the module docstring)."""

    schema: ParamSchema = _SCHEMA

    def __init__(self, spec: TokenizerSpec) -> None:
        super().__init__(spec)
        p = self.params
        where = spec.where
        check_choice(spec, "preset", p["preset"], PRESETS)
        if p["size"] < 16 or p["size"] % 16:
            raise DataError(f"{where}: param 'size' must be a multiple of 16, got {p['size']}")
        for key in ("tokens_per_frame", "keyint"):
            if p[key] < 1:
                raise DataError(f"{where}: param {key!r} must be >= 1")
        if spec.vocab_size != VOCAB:
            raise DataError(f"{where}: a video-h264 spec has vocab_size {VOCAB}")
        import av

        try:
            av.codec.Codec("libx264", "w")
        except (av.error.FFmpegError, ValueError) as e:  # UnknownCodecError: a ValueError
            raise DataError(
                f"{where}: this PyAV has no libx264 encoder ({type(e).__name__}); install "
                "PyAV's wheel (pip install av), which bundles it"
            ) from None
        self.tokens_per_frame = p["tokens_per_frame"]  # on average

    # ------------------------------------------------------------------ encode
    def _codec(self) -> Any:
        import av

        ctx = av.CodecContext.create("libx264", "w")
        ctx.width = ctx.height = self.size
        ctx.pix_fmt = "yuv420p"
        rate = Fraction(self.fps).limit_denominator(1001)
        ctx.framerate, ctx.time_base = rate, 1 / rate
        ctx.thread_count = 1
        bits = int(self.tokens_per_frame * 16 * self.fps)
        ctx.bit_rate = bits
        ctx.gop_size = self.params["keyint"]
        ctx.options = {
            "preset": self.params["preset"],
            "tune": "zerolatency",
            "threads": "1",
            "maxrate": str(bits),
            "bufsize": str(2 * bits),
            "keyint_min": str(self.params["keyint"]),
            "sc_threshold": "0",  # keyframes on the grid only: a function of the frame count
        }
        return ctx

    def encoder(self) -> Callable[[np.ndarray], np.ndarray]:
        """A per-clip encoder: batches of a clip's frames, in order -> ragged local ids
        (each frame's packet, then ``FRAME_END``)."""
        import av

        ctx = self._codec()
        count = 0

        def encode(frames: np.ndarray) -> np.ndarray:
            nonlocal count
            out: list[np.ndarray] = []
            for x in frames:
                vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(x), format="rgb24")
                vf.pts = count
                count += 1
                packets = ctx.encode(vf)
                if len(packets) != 1:  # zerolatency: exactly one packet per frame
                    raise RuntimeError(f"libx264 gave {len(packets)} packets for one frame")
                out += [packet_ids(bytes(packets[0])), np.array([FRAME_END])]
            return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

        return encode

    def frame_rows(self, ids: np.ndarray, start: int) -> list[np.ndarray]:
        """Ragged local ids as unified ids, one array per frame: its packet, then ``<eof>``."""
        ends = ids == FRAME_END
        unified = np.where(ends, EOF, ids + start)
        return np.split(unified, np.flatnonzero(ends)[:-1] + 1)

    # ------------------------------------------------------------------ decode
    def decode_ids(self, ids: np.ndarray) -> np.ndarray:
        """Ragged local ids -> uint8 frames [t, size, size, 3], one per ``FRAME_END``.
        A packet the decoder rejects (ids a model wrote) repeats the previous frame."""
        import av

        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size and (ids.min() < FRAME_END or ids.max() >= VOCAB):
            raise ValueError(f"video-h264 local id out of range 0..{VOCAB - 1}")
        ends = np.flatnonzero(ids == FRAME_END)
        dec = av.CodecContext.create("h264", "r")
        dec.thread_count = 1
        prev: np.ndarray = np.full((self.size, self.size, 3), 128, dtype=np.uint8)
        out = np.empty((ends.size, self.size, self.size, 3), dtype=np.uint8)
        start = 0
        for i, end in enumerate(ends.tolist()):
            packet = ids_packet(ids[start:end])
            start = end + 1
            got: np.ndarray | None = None
            try:
                for f in dec.decode(av.Packet(packet)) if packet else ():
                    got = f.to_ndarray(format="rgb24")
            except av.error.FFmpegError:
                got = None
            if got is not None and got.shape == prev.shape and got.dtype == np.uint8:
                prev = got
            out[i] = prev
        return out

    def split(self, tokens: np.ndarray, space: TokenSpace) -> tuple[np.ndarray, np.ndarray]:
        """(ragged video local ids, audio local ids [n]) of one clip's unified ids: video ids
        and ``<eof>`` in order (ids after the last ``<eof>`` are an unfinished frame and
        dropped); other specials dropped; audio ids only if this spec interleaves audio."""
        seq, audio = self.video_run(tokens, space)
        eofs = np.flatnonzero(seq == EOF)
        seq = seq[: eofs[-1] + 1] if eofs.size else seq[:0]
        video = np.where(seq == EOF, FRAME_END, seq - space.range(self.modality).start)
        return video, audio
