"""kind video-h264: frames through libx264, each frame's slices as 16-bit ids then <eof>:
only coded slices in the ids, every frame bounded, a wrong id healed by the next intra
refresh sweep, decoding from any frame."""

from __future__ import annotations

import numpy as np
import pytest
from media_factory import TEST_DATA, TOKENIZERS, smooth_frames, tone, write_video

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, EOF
from ulysses_mm.tokenize.base import TokenizerSpec, build_token_space
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.video.fidelity import psnr
from ulysses_mm.tokenize.video.frames import sample_frames
from ulysses_mm.tokenize.video.h264 import (
    FRAME_END,
    PAIRS,
    VOCAB,
    H264VideoTokenizer,
    ids_packet,
    packet_ids,
    yuv420_rgb,
)

KEYINT = 8  # refresh period of the test spec: a sweep of the 4 macroblock columns, then 4


def _spec(**params) -> TokenizerSpec:
    base = {
        "fps": 8.0,
        "size": 64,
        "tokens_per_frame": 48,
        "keyint": KEYINT,
        "slice_bytes": 64,
        "preset": "fast",
    }
    return TokenizerSpec("h264-test", "video", "video-h264", VOCAB, {**base, **params})


def _clip(t=32, seed=0):
    return smooth_frames(np.random.default_rng(seed), t, 64, 64)


def _frames_of(ids: np.ndarray) -> list[np.ndarray]:
    """Ragged local ids -> each frame's ids."""
    ends = np.flatnonzero(ids == FRAME_END)
    return np.split(ids, ends + 1)[: len(ends)]


def nal_units(data: bytes) -> list[tuple[int, int]]:
    """(nal_unit_type, SEI payload type or -1) of each NAL unit of an Annex B byte string:
    split at start codes 00 00 01 (a 00 before one is the 4-byte form), read independently
    of the tokenizer's FFmpeg filter."""
    starts = []
    i = data.find(b"\x00\x00\x01")
    while i >= 0:
        starts.append(i + 3)
        i = data.find(b"\x00\x00\x01", i + 3)
    out = []
    for k, s in enumerate(starts):
        end = starts[k + 1] - 3 if k + 1 < len(starts) else len(data)
        unit = data[s:end]
        kind = unit[0] & 0x1F if unit else -1
        payload = -1
        if kind == 6:  # sei_message: payload type as a run of 0xFF bytes and a last byte
            j, payload = 1, 0
            while j < len(unit) and unit[j] == 0xFF:
                payload, j = payload + 255, j + 1
            payload += unit[j] if j < len(unit) else 0
        out.append((kind, payload))
    return out


def _clip_with_a_cut(t=40):
    return np.concatenate([_clip(t // 2, seed=0), _clip(t - t // 2, seed=5)])


@pytest.fixture(scope="module")
def coded():
    """(tokenizer, frames, ids, clean decode) of a 40-frame clip with a cut halfway."""
    tok = H264VideoTokenizer(_spec())
    frames = _clip_with_a_cut()
    ids = tok.encode_frames(frames)
    return tok, frames, ids, tok.decode_ids(ids)


def test_decoded_pictures_interpolate_chroma():
    """The decoder's yuv420p pictures become RGB by the encoder's matrix (BT.601, limited
    range) with bilinear chroma: closer to the frames than FFmpeg's own conversion, which
    repeats each chroma sample over its 2x2 block; a flat colour comes back as it was."""
    import av

    frames = _clip(4, seed=2)
    ours, ffmpeg = [], []
    for x in frames:
        yuv = av.VideoFrame.from_ndarray(x, format="rgb24").reformat(format="yuv420p")
        ours.append(yuv420_rgb(yuv.to_ndarray()))
        ffmpeg.append(yuv.to_ndarray(format="rgb24"))
    assert psnr(frames, np.stack(ours)) > psnr(frames, np.stack(ffmpeg)) + 2.0
    assert psnr(frames, np.stack(ours)) > 45.0
    flat = np.empty((32, 48, 3), dtype=np.uint8)
    flat[:] = (200, 90, 30)
    yuv = av.VideoFrame.from_ndarray(flat, format="rgb24").reformat(format="yuv420p")
    assert np.abs(yuv420_rgb(yuv.to_ndarray()).astype(int) - flat).max() <= 2


def test_packet_ids_round_trip():
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 7, 1000, 1001):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        ids = packet_ids(data)
        assert len(ids) == (n + 1) // 2 and (ids < VOCAB).all() and (ids >= 0).all()
        assert ids_packet(ids) == data


def test_encode_is_deterministic_one_packet_per_frame_and_at_the_rate():
    tok = H264VideoTokenizer(_spec())
    frames = _clip()
    a = np.concatenate([tok.encoder()(frames[:10]), tok.encoder()(frames[10:])])
    enc = tok.encoder()  # one clip in two batches: the encoder keeps its state
    b = np.concatenate([enc(frames[:10]), enc(frames[10:])])
    c = np.concatenate([(e := tok.encoder())(frames[:10]), e(frames[10:])])
    assert np.array_equal(b, c)  # the bytes are a function of the frames and the params
    assert not np.array_equal(a, b)  # a new encoder starts a new stream (an IDR frame)
    assert int((b == FRAME_END).sum()) == len(frames)
    per = np.diff(np.concatenate([[-1], np.flatnonzero(b == FRAME_END)])) - 1
    assert (per > 0).all()
    assert per.mean() <= 1.25 * 48  # average rate control
    dec = tok.decode_ids(b)
    assert dec.shape == frames.shape and dec.dtype == np.uint8
    assert psnr(frames, dec) > 28.0  # 64x64 at 48 ids, refreshed every 8 frames


def test_the_ids_are_coded_slices_only(coded):
    """No SEI (x264's version and options string, payload type 5 user data unregistered),
    no SPS/PPS: each frame is one or more slice NAL units, an IDR only first."""
    _, frames, ids, _ = coded
    per = [ids_packet(f[:-1]) for f in _frames_of(ids)]
    assert len(per) == len(frames)
    units = [nal_units(p) for p in per]
    assert all(u and {k for k, _ in u} <= {1, 5} for u in units)
    assert not any((6, 5) in u for u in units)
    assert {k for k, _ in units[0]} == {5} and all(k == 1 for u in units[1:] for k, _ in u)
    assert max(len(u) for u in units) > 1  # slices of <= 64 bytes: big frames have several
    assert all(len(p) <= 64 * len(u) for p, u in zip(per, units))
    assert b"x264" not in b"".join(per)
    # keyframe refresh instead: an IDR every keyint frames, still nothing but slices
    key = H264VideoTokenizer(_spec(intra_refresh=False)).encode_frames(frames[:17])
    types = [{k for k, _ in nal_units(ids_packet(f[:-1]))} for f in _frames_of(key)]
    assert [i for i, t in enumerate(types) if t == {5}] == [0, KEYINT, 2 * KEYINT]
    assert all(t <= {1, 5} for t in types)


def test_the_stream_headers_are_a_function_of_the_params(coded):
    tok = coded[0]
    head = tok.headers()
    assert [k for k, _ in nal_units(head)] == [7, 8]  # SPS, PPS
    assert H264VideoTokenizer(_spec()).headers() == head
    assert H264VideoTokenizer(_spec(size=128)).headers() != head


def test_every_frame_is_bounded_even_the_first_and_a_cut(coded):
    tok, frames, ids, dec = coded
    per = np.array([len(f) - 1 for f in _frames_of(ids)])
    assert per.mean() <= 1.15 * tok.tokens_per_frame  # average rate control
    assert per.max() <= 2.5 * per.mean()  # the VBV buffer: 2 frames at the average
    # a whole-frame keyframe every 8 frames under the same buffer is bounded too
    key = H264VideoTokenizer(_spec(intra_refresh=False, buffer_frames=8.0))
    per_key = np.array([len(f) - 1 for f in _frames_of(key.encode_frames(frames))])
    assert per_key.max() > 2.5 * per_key.mean()  # ... only by the buffer: here a spike
    assert psnr(frames, dec) > 27.0


def test_a_wrong_id_heals_within_two_refresh_periods(coded):
    """One wrong id spoils its frame and what predicts from it until an intra refresh sweep
    has passed over the spoilt area; from then on the frames are exactly the clean ones."""
    tok, frames, ids, clean = coded
    ends = np.flatnonzero(ids == FRAME_END)
    for k in (3, 9, 22):
        bad = ids.copy()
        at = (ends[k - 1] + ends[k]) // 2
        bad[at] = (bad[at] + 12345) % PAIRS
        out = tok.decode_ids(bad)
        assert out.shape == frames.shape  # frame ends are specials: nothing shifts
        assert np.array_equal(out[:k], clean[:k]) and not np.array_equal(out[k], clean[k])
        assert np.array_equal(out[k + 2 * KEYINT :], clean[k + 2 * KEYINT :])


def test_decoding_may_start_at_any_frame(coded):
    """A packed sample that continues a clip starts at some frame: the decoder has the
    stream headers from the params, and the frames are the clean ones once the first sweep
    that starts there has passed (grey and partial pictures before)."""
    tok, frames, ids, clean = coded
    ends = np.flatnonzero(ids == FRAME_END)
    for s in (1, 5, 9, 13):
        out = tok.decode_ids(ids[ends[s - 1] + 1 :])
        assert out.shape == frames[s:].shape
        healed = -(-s // KEYINT) * KEYINT + KEYINT  # the end of the next sweep
        assert np.array_equal(out[healed - s :], clean[healed:])
        assert psnr(frames[healed:], out[healed - s :]) > 27.0


def test_wrong_ids_cannot_replace_the_stream_headers(coded):
    """Ids that spell an SPS/PPS (or any NAL unit but a slice) never reach the decoder: a
    model cannot change the picture size or the coding tools for the frames after."""
    tok, frames, ids, clean = coded
    other = H264VideoTokenizer(_spec(size=128)).headers()  # a valid SPS/PPS, other size
    ends = np.flatnonzero(ids == FRAME_END)
    k = 12
    bad = np.concatenate([ids[: ends[k - 1] + 1], packet_ids(other), ids[ends[k - 1] + 1 :]])
    out = tok.decode_ids(bad)
    assert out.shape == frames.shape
    assert np.array_equal(out, clean)


def test_decoding_ids_a_model_wrote_never_fails():
    tok = H264VideoTokenizer(_spec())
    frames = _clip(12)
    ids = tok.encode_frames(frames)
    rng = np.random.default_rng(1)
    ends = np.flatnonzero(ids == FRAME_END)
    # garbage ids in every frame but the first, and an empty frame
    bad = ids.copy()
    body = bad != FRAME_END
    body[: ends[0]] = False
    bad[body] = rng.integers(0, VOCAB, int(body.sum()))
    bad = np.insert(bad, ends[3] + 1, FRAME_END)
    out = tok.decode_ids(bad)
    assert out.shape == (len(frames) + 1, 64, 64, 3)
    assert np.array_equal(out[0], tok.decode_ids(ids)[0])  # the intact keyframe
    noise = rng.integers(0, VOCAB, 500)
    noise[::50] = FRAME_END
    assert tok.decode_ids(noise).shape == (10, 64, 64, 3)  # grey or whatever decodes
    with pytest.raises(ValueError, match="out of range"):
        tok.decode_ids(np.array([VOCAB, FRAME_END]))


def test_a_pyav_without_libx264_is_one_clear_error(monkeypatch):
    import av

    def no_x264(name, mode="r"):
        raise av.codec.codec.UnknownCodecError(name)

    monkeypatch.setattr(av.codec, "Codec", no_x264)
    with pytest.raises(ValueError, match="h264-test: this PyAV has no libx264 encoder"):
        H264VideoTokenizer(_spec())


def test_a_pyav_that_cannot_filter_packets_is_one_clear_error(monkeypatch):
    import av

    def old_pyav(description, in_stream=None, out_stream=None):
        raise TypeError("Argument 'in_stream' has incorrect type")

    monkeypatch.setattr(av, "BitStreamFilterContext", old_pyav)
    with pytest.raises(ValueError, match="h264-test: this PyAV cannot filter H.264 packets"):
        H264VideoTokenizer(_spec())


def test_bad_params_are_one_clear_error():
    with pytest.raises(ValueError, match="multiple of 16"):
        H264VideoTokenizer(_spec(size=60))
    with pytest.raises(ValueError, match="preset"):
        H264VideoTokenizer(_spec(preset="warp"))
    with pytest.raises(ValueError, match="tokens_per_frame"):
        H264VideoTokenizer(_spec(tokens_per_frame=0))
    with pytest.raises(ValueError, match="slice_bytes"):
        H264VideoTokenizer(_spec(slice_bytes=10))
    with pytest.raises(ValueError, match="buffer_frames' must be >= 2"):
        H264VideoTokenizer(_spec(buffer_frames=1.5))  # libx264 would quietly make it 2
    with pytest.raises(ValueError, match="intra_refresh"):
        H264VideoTokenizer(_spec(intra_refresh="yes"))
    # what libx264 itself refuses (a buffer below its floor at this rate) names the params
    with pytest.raises(ValueError, match=r"libx264 refuses these params .*tokens_per_frame=4"):
        H264VideoTokenizer(_spec(tokens_per_frame=4))
    with pytest.raises(ValueError, match="vocab_size 65792"):
        H264VideoTokenizer(TokenizerSpec("x", "video", "video-h264", 256, {}))


def test_a_file_round_trips_through_unified_ids(tmp_path):
    frames = _clip(24)
    path = write_video(tmp_path / "clip.mp4", frames, fps=8)
    tok = load_tokenizer(_spec())
    space = build_token_space([tok.spec])
    (doc,) = tok.encode_file(str(path), space)
    t = doc.tokens.astype(np.int64)
    assert t[0] == DOC_START and t[1] == space.boundary_token("video") and t[-1] == DOC_END
    assert int((t == EOF).sum()) == 24
    dec = tok.decode(t, space)
    assert dec.shape == (24, 64, 64, 3)
    assert psnr(frames, dec) > 28.0
    # a stream cut mid-frame (a packed sample's end) decodes its whole frames only
    cut = t[: np.flatnonzero(t == EOF)[9] + 5]
    assert tok.decode(cut, space).shape == (10, 64, 64, 3)


def test_audio_interleaves_with_ragged_frames(tmp_path):
    frames = _clip(16)
    path = write_video(tmp_path / "av.mp4", frames, fps=8, audio=tone(2.0, 48000))
    spec = _spec(audio={"spec": str(TOKENIZERS / "audio-mulaw-16k.json")}, chunk_frames=4)
    tok = load_tokenizer(spec)
    space = build_token_space([tok.spec, *tok.companion_specs()])
    (doc,) = tok.encode_file(str(path), space)
    t = doc.tokens.astype(np.int64)
    assert int((t == EOF).sum()) == 16
    assert int((t == space.boundary_token("audio")).sum()) == 4  # one audio span per chunk
    video, wave = tok.decode_av(t, space)
    assert video.shape == (16, 64, 64, 3) and wave.size > 1.5 * 16000


def test_the_default_video_spec_on_a_clip_it_never_saw():
    """pipelines/video.yaml's spec (nothing fitted) on the rabbit clip's first 24 frames
    (the README's video table has whole clips, and wrong ids): at most 256 ids a frame on
    average, no frame above 2.5 times that, no encoder SEI."""
    assert "video-h264.json" in (TOKENIZERS.parent / "pipelines" / "video.yaml").read_text()
    tok = load_tokenizer(TokenizerSpec.load(TOKENIZERS / "video-h264.json"))
    assert isinstance(tok, H264VideoTokenizer) and tok.tokens_per_frame <= 256
    frames = np.concatenate(
        list(sample_frames(str(TEST_DATA / "rabbit_toy_320x240.webm"), 8.0, 256, 24))
    )
    ids = tok.encode_frames(frames)
    per = [len(f) - 1 for f in _frames_of(ids)]
    assert len(per) == 24 and np.mean(per) <= 256 and max(per) <= 2.5 * np.mean(per)
    assert not any(k == 6 for f in _frames_of(ids) for k, _ in nal_units(ids_packet(f[:-1])))
    assert psnr(frames, tok.decode_ids(ids)) > 29.0
