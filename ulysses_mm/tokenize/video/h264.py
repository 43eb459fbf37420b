"""kind ``video-h264``: video as the slices of its H.264 bitstream, two bytes per id.

The clip's sampled frames (sampling, document framing and audio interleaving:
:mod:`ulysses_mm.tokenize.video.base`) go through libx264 (PyAV's bundled encoder) with no
B-frames and no look-ahead (``tune=zerolatency``: one packet per frame, in display order)
and one thread (the bytes are a function of the frames and the params). Each frame's
packet keeps only its coded slices (NAL types 1 and 5, FFmpeg's ``filter_units`` bitstream
filter): no SEI (x264's version and option string, recovery points), no SPS/PPS. A byte
pair ``(a, b)`` is id ``256·a + b``, an odd last byte ``c`` is id ``65536 + c`` (vocab
65,792); then ``<eof>``. So a frame is a variable number of ids, ``tokens_per_frame`` on
average.

The stream is built for ids a model writes, not for a file:

- **Even cost per frame.** With ``intra_refresh`` (x264's periodic intra refresh) no frame
  is coded whole after the first: a column of intra macroblocks sweeps the picture once
  every ``keyint`` frames (at least one macroblock column a frame) and motion vectors
  never reach from the refreshed part into the stale one. Average-bitrate rate control at
  ``tokens_per_frame`` ids a frame, with a VBV buffer of ``buffer_frames`` frames'
  worth (filled at twice the average rate, half full at the start; at least 2, one frame
  at that rate), bounds every frame, the first included; a tight rate tolerance holds a
  clip's average near ``tokens_per_frame`` when its content gets harder on the way. ``intra_refresh: false`` puts a keyframe every ``keyint`` frames
  instead, under the same bound.
- **Damage stays local and heals.** Each slice holds at most ``slice_bytes`` bytes (x264
  splits a frame by size; a start code begins each slice, a point to resync): a wrong id
  spoils the rest of its slice (concealed from the previous frame where the decoder sees
  the error), what is predicted from it stays wrong until an intra refresh sweep has passed
  over it, and from then on the frames are exactly the undamaged ones (within two refresh
  periods). Frames are delimited by ``<eof>``, a
  special outside the video range, so wrong video ids never shift the following frames.
- **Any frame is a place to start.** The SPS/PPS are a function of the params; they are
  kept out of the ids and the decoder makes them itself (:meth:`H264VideoTokenizer.headers`),
  so a packed sample that continues a clip decodes from its first whole frame, and the
  picture is complete once a sweep has passed.
- **Fidelity first.** x264's psychovisual options are off (``tune=psnr``): the ids are
  judged by how close the decoded frames are to the input, in RGB, so chroma gets a finer
  quantizer than x264 gives it by default, and the decoder interpolates it back to full
  size (:func:`yuv420_rgb`) rather than repeating each sample over its 2x2 block.

Decoding never fails on ids a model wrote: only slice NAL units reach the decoder (so
wrong ids cannot replace its SPS/PPS), a frame the decoder rejects repeats the previous one
(grey at the start), and the decoder holds no frame back (``low_delay``), so every
``<eof>`` gives exactly one frame.

Local ids are ragged: one clip's ids are a 1-D array whose frames end at ``FRAME_END``
(−1); unified ids put ``<eof>`` there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import EOF, TokenSpace
from ulysses_mm.tokenize.base import Layout, TokenizerSpec
from ulysses_mm.tokenize.params import ParamSchema, check_choice
from ulysses_mm.tokenize.video.base import FRAME_PARAMS, VideoTokenizer

FRAME_END = -1  # a frame's end in ragged local ids
PAIRS = 1 << 16  # ids 0 .. 65535: byte pairs
VOCAB = PAIRS + 256  # then 65536 + c: a packet's odd last byte
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower")
# FFmpeg's bitstream filter keeping only coded slices (non-IDR 1, IDR 5) of a packet.
SLICES_ONLY = "filter_units=pass_types=1|5"
# FFmpeg's H.264 decoder: every frame out at once, even one decoded without its references
DECODER_OPTIONS = {"flags": "+low_delay", "flags2": "+showall"}

_SCHEMA: ParamSchema = {
    **FRAME_PARAMS,
    "tokens_per_frame": ((int,), 248),  # the rate control's average ids per frame
    "keyint": ((int,), 32),  # frames per refresh period (a sweep, or a keyframe)
    "intra_refresh": ((bool,), True),  # periodic intra refresh instead of keyframes
    "slice_bytes": ((int,), 150),  # bytes per slice at most (0: one slice per frame)
    "buffer_frames": ((int, float), 2.0),  # VBV buffer, in frames at tokens_per_frame
    "preset": ((str,), "slower"),  # libx264's speed/efficiency preset
}


def _upsample(c: np.ndarray) -> np.ndarray:
    """A chroma plane at twice its size, bilinear (each sample sits at the centre of its
    2x2 luma block, as the encoder's conversion averaged it), edges repeated."""
    p = np.pad(c.astype(np.float32), 1, mode="edge")
    rows = np.empty((2 * c.shape[0], p.shape[1]), dtype=np.float32)
    rows[0::2] = 0.75 * p[1:-1] + 0.25 * p[:-2]
    rows[1::2] = 0.75 * p[1:-1] + 0.25 * p[2:]
    out = np.empty((rows.shape[0], 2 * c.shape[1]), dtype=np.float32)
    out[:, 0::2] = 0.75 * rows[:, 1:-1] + 0.25 * rows[:, :-2]
    out[:, 1::2] = 0.75 * rows[:, 1:-1] + 0.25 * rows[:, 2:]
    return out


def yuv420_rgb(yuv: np.ndarray) -> np.ndarray:
    """A decoded yuv420p picture (PyAV's [3h/2, w] planes: Y, then U, then V) as uint8 RGB
    [h, w, 3]: BT.601 limited range, the encoder's conversion, with the chroma interpolated
    (FFmpeg's own conversion repeats each chroma sample over its 2x2 block)."""
    h = yuv.shape[0] * 2 // 3
    w = yuv.shape[1]
    y = (yuv[:h].astype(np.float32) - 16) * np.float32(255 / 219)
    u = _upsample(yuv[h : h + h // 4].reshape(h // 2, w // 2)) - 128
    v = _upsample(yuv[h + h // 4 :].reshape(h // 2, w // 2)) - 128
    k = np.float32(255 / 224)
    rgb = np.stack(
        [y + 1.402 * k * v, y - 0.344136 * k * u - 0.714136 * k * v, y + 1.772 * k * u], axis=-1
    )
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)


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
    """kind ``video-h264``: one document per clip; each frame's H.264 slices as ids, then
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
        if p["slice_bytes"] != 0 and p["slice_bytes"] < 64:
            raise DataError(f"{where}: param 'slice_bytes' must be 0 (one slice) or >= 64")
        if not p["buffer_frames"] >= 2:  # libx264 raises a smaller buffer to 2 anyway
            raise DataError(
                f"{where}: param 'buffer_frames' must be >= 2 (the buffer holds at least one "
                "frame at the peak rate, twice the average)"
            )
        if spec.vocab_size != VOCAB:
            raise DataError(f"{where}: a video-h264 spec has vocab_size {VOCAB}")
        import av  # lazy: heavy (av)

        try:
            av.codec.Codec("libx264", "w")
        except (av.error.FFmpegError, ValueError) as e:  # UnknownCodecError: a ValueError
            raise DataError(
                f"{where}: this PyAV has no libx264 encoder ({type(e).__name__}); install "
                "PyAV's wheel (pip install av), which bundles it"
            ) from None
        try:
            self._slices_only()
        except (av.error.FFmpegError, TypeError) as e:  # TypeError: PyAV < 18
            raise DataError(
                f"{where}: this PyAV cannot filter H.264 packets ({type(e).__name__}: {e}); "
                "install PyAV >= 18 (pip install -U av)"
            ) from None
        self.tokens_per_frame = p["tokens_per_frame"]  # on average
        self._headers: bytes | None = None
        try:  # what libx264 refuses (a rate too low for its buffer, say) is the spec's fault
            self.headers()
        except av.error.FFmpegError as e:
            raise DataError(
                f"{where}: libx264 refuses these params ({type(e).__name__}: {e.strerror}; "
                f"tokens_per_frame={p['tokens_per_frame']}, buffer_frames={p['buffer_frames']}, "
                f"size={p['size']}, fps={p['fps']})"
            ) from None

    # ------------------------------------------------------------------ encode
    def _codec(self) -> Any:
        import av  # lazy: heavy (av)

        p = self.params
        ctx = av.CodecContext.create("libx264", "w")
        ctx.width = ctx.height = self.size
        ctx.pix_fmt = "yuv420p"
        rate = Fraction(self.fps).limit_denominator(1001)
        ctx.framerate, ctx.time_base = rate, 1 / rate
        ctx.thread_count = 1
        ctx.flags |= av.codec.context.Flags.global_header  # SPS/PPS in extradata, not packets
        frame_bits = self.tokens_per_frame * 16
        bits = int(frame_bits * self.fps)
        ctx.bit_rate = bits
        ctx.gop_size = p["keyint"]
        x264 = [
            f"keyint={p['keyint']}",
            f"min-keyint={p['keyint']}",
            "scenecut=0",  # refresh on the grid only: a function of the frame count
            "vbv-init=0.5",  # the first frame gets half the buffer, like any other
            # a clip's average close to tokens_per_frame even when its content gets harder
            # on the way (no look-ahead: x264's default tolerance lets short clips overshoot)
            "ratetol=0.25",
            # PSNR is measured on RGB, where chroma errors count as much as luma ones
            "chroma-qp-offset=-2",
        ]
        if p["intra_refresh"]:
            x264.append("intra-refresh=1")
        if p["slice_bytes"]:
            x264.append(f"slice-max-size={p['slice_bytes']}")
        ctx.options = {
            "preset": p["preset"],
            "tune": "psnr,zerolatency",
            "threads": "1",
            # the buffer fills at twice the average rate, so it bounds a frame, not a second
            "maxrate": str(2 * bits),
            "bufsize": str(int(p["buffer_frames"] * frame_bits)),
            "x264-params": ":".join(x264),
        }
        return ctx

    @staticmethod
    def _slices_only() -> Any:
        import av  # lazy: heavy (av)

        return av.BitStreamFilterContext(SLICES_ONLY, "h264")

    def headers(self) -> bytes:
        """The stream's SPS and PPS (Annex B): what libx264 writes for these params, made
        once per tokenizer by opening an encoder; the decoder starts from them."""
        if self._headers is None:
            ctx = self._codec()
            ctx.open()
            self._headers = bytes(ctx.extradata or b"")
        return self._headers

    def encoder(self) -> Callable[[np.ndarray], np.ndarray]:
        """A per-clip encoder: batches of a clip's frames, in order -> ragged local ids
        (each frame's slices, then ``FRAME_END``)."""
        import av  # lazy: heavy (av)

        ctx = self._codec()
        slices = self._slices_only()
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
                kept = slices.filter(packets[0])
                data = b"".join(bytes(k) for k in kept)
                out += [packet_ids(data), np.array([FRAME_END])]
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
        Ids may start at any frame of a clip; a packet the decoder rejects (ids a model
        wrote) repeats the previous frame."""
        import av  # lazy: heavy (av)

        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size and (ids.min() < FRAME_END or ids.max() >= VOCAB):
            raise ValueError(f"video-h264 local id out of range 0..{VOCAB - 1}")
        ends = np.flatnonzero(ids == FRAME_END)
        dec = av.CodecContext.create("h264", "r")
        dec.thread_count = 1
        dec.extradata = self.headers()
        dec.options = dict(DECODER_OPTIONS)
        slices = self._slices_only()
        prev: np.ndarray = np.full((self.size, self.size, 3), 128, dtype=np.uint8)
        out = np.empty((ends.size, self.size, self.size, 3), dtype=np.uint8)
        start = 0
        for i, end in enumerate(ends.tolist()):
            packet = ids_packet(ids[start:end])
            start = end + 1
            got: np.ndarray | None = None
            try:
                for kept in slices.filter(av.Packet(packet)) if packet else ():
                    for f in dec.decode(kept):
                        got = yuv420_rgb(f.to_ndarray(format="yuv420p"))
            except av.error.FFmpegError:
                got = None
            if got is not None and got.shape == prev.shape and got.dtype == np.uint8:
                prev = got
            out[i] = prev
        return out

    # ------------------------------------------------------------------ contract
    @classmethod
    def token_labels(
        cls, entry: Mapping[str, Any], size: int, vocabulary: Sequence[str] | None = None
    ) -> list[str]:
        """The packet bytes of each id in hex (``1a2b``; an odd last byte ``1a``)."""
        return [f"{k:04x}" if k < PAIRS else f"{k - PAIRS:02x}" for k in range(size)]

    def frame_layout(self) -> Layout:
        """Ragged frames: slice ids or ``<eof>`` (a bad slice is concealed), ``<eof>``
        forced once a frame holds 4 VBV buffers' worth of ids, far past any frame the
        encoder writes, so a model that never closes a frame still makes frames."""
        buffer = float(self.params.get("buffer_frames", 2.0))
        return Layout(ragged=True, max_frame=int(4 * buffer * self.tokens_per_frame))

    def split(self, tokens: np.ndarray, space: TokenSpace) -> tuple[np.ndarray, np.ndarray]:
        """(ragged video local ids, audio local ids [n]) of one clip's unified ids: video ids
        and ``<eof>`` in order (ids after the last ``<eof>`` are an unfinished frame and
        dropped); other specials dropped; audio ids only if this spec interleaves audio."""
        seq, audio = self.tracks(tokens, space)
        eofs = np.flatnonzero(seq == EOF)
        seq = seq[: eofs[-1] + 1] if eofs.size else seq[:0]
        video = np.where(seq == EOF, FRAME_END, seq - space.range(self.modality).start)
        return video, audio
