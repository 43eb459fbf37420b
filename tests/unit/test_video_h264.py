"""kind video-h264: frames through libx264, each frame's packet as 16-bit ids then <eof>."""

from __future__ import annotations

import numpy as np
import pytest
from media_factory import TEST_DATA, TOKENIZERS, smooth_frames, tone, write_video

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, EOF
from ulysses_mm.tokenize.base import TokenizerSpec, build_token_space
from ulysses_mm.tokenize.evaluate import psnr
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.video.frames import sample_frames
from ulysses_mm.tokenize.video.h264 import (
    FRAME_END,
    VOCAB,
    H264VideoTokenizer,
    ids_packet,
    packet_ids,
)


def _spec(**params) -> TokenizerSpec:
    base = {"fps": 8.0, "size": 64, "tokens_per_frame": 48, "keyint": 16, "preset": "fast"}
    return TokenizerSpec("h264-test", "video", "video-h264", VOCAB, {**base, **params})


def _clip(t=32, seed=0):
    return smooth_frames(np.random.default_rng(seed), t, 64, 64)


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
    assert not np.array_equal(a, b)  # a new encoder starts a new stream (a keyframe)
    assert int((b == FRAME_END).sum()) == len(frames)
    per = np.diff(np.concatenate([[-1], np.flatnonzero(b == FRAME_END)])) - 1
    assert (per > 0).all()
    assert per.mean() <= 1.25 * 48  # average rate control (keyframes cost more)
    dec = tok.decode_ids(b)
    assert dec.shape == frames.shape and dec.dtype == np.uint8
    assert psnr(frames, dec) > 33.0


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


def test_bad_params_are_one_clear_error():
    with pytest.raises(ValueError, match="multiple of 16"):
        H264VideoTokenizer(_spec(size=60))
    with pytest.raises(ValueError, match="preset"):
        H264VideoTokenizer(_spec(preset="warp"))
    with pytest.raises(ValueError, match="tokens_per_frame"):
        H264VideoTokenizer(_spec(tokens_per_frame=0))
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
    assert int((t == space.boundary_token("audio")).sum()) == 4  # one audio run per chunk
    video, wave = tok.decode_av(t, space)
    assert video.shape == (16, 64, 64, 3) and wave.size > 1.5 * 16000


def test_the_default_video_spec_on_a_clip_it_never_saw():
    """pipelines/video.yaml's spec (nothing fitted) on the rabbit clip's first 24 frames
    (the README's video table has the whole clip; here the keyframe weighs more)."""
    assert "video-h264.json" in (TOKENIZERS.parent / "pipelines" / "video.yaml").read_text()
    tok = load_tokenizer(TokenizerSpec.load(TOKENIZERS / "video-h264.json"))
    assert isinstance(tok, H264VideoTokenizer) and tok.tokens_per_frame <= 256
    frames = np.concatenate(
        list(sample_frames(str(TEST_DATA / "rabbit_toy_320x240.webm"), 8.0, 256, 24))
    )
    ids = tok.encode_frames(frames)
    assert int((ids == FRAME_END).sum()) == 24
    assert psnr(frames, tok.decode_ids(ids)) > 28.0
