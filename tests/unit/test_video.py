"""Video tokenizer: frame-accurate sampling, crop, VQ quality bounds, fit CLI, A/V interleave,
true errors. Clips are encoded in the test with PyAV (H.264 mp4, VP9 webm, AV1 mkv)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
from media_factory import (
    TEST_DATA,
    TOKENIZERS,
    index_frame,
    read_index,
    smooth_frames,
    tone,
    write_audio,
    write_video,
)

from ulysses_mm.cli import main
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, EOF, TokenSpace
from ulysses_mm.tokenize.base import DecodeError, TokenizerSpec, build_token_space
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.video.fidelity import psnr
from ulysses_mm.tokenize.video.frames import sample_frames
from ulysses_mm.tokenize.video.kmeans import Codebook
from ulysses_mm.tokenize.video.vq import VqVideoTokenizer, patchify, unpatchify

try:
    import decord  # noqa: F401  (x86-64 wheels only; PyAV decodes elsewhere)

    HAVE_DECORD = True
except ImportError:
    HAVE_DECORD = False
needs_decord = pytest.mark.skipif(not HAVE_DECORD, reason="decord has no wheel here")
BACKENDS = ["decord", "pyav"] if HAVE_DECORD else ["pyav"]

NATIVE_FPS = 30
CLIP_FRAMES = 60  # 2 s
BLOBS = smooth_frames(np.random.default_rng(0), 70)  # fit on the first 40, hold out the rest


@pytest.fixture(scope="module")
def index_clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2 s clips at 30 fps whose frame i shows i in binary bars (128x96, 4:3)."""
    d = tmp_path_factory.mktemp("index")
    frames = np.stack([index_frame(i) for i in range(CLIP_FRAMES)])
    clips = {
        "mp4": write_video(d / "index.mp4", frames, NATIVE_FPS),
        "webm": write_video(d / "index.webm", frames, NATIVE_FPS),
    }
    return clips


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny codebook fitted through the CLI on a generated clip (64x64, 8x8 patches, 32 words)."""
    d = tmp_path_factory.mktemp("fit")
    clip = write_video(d / "train.mp4", BLOBS[:40], 20)
    out = d / "specs" / "tiny-vq.json"
    rc = main(
        ["tokenizer", "fit", "video", str(clip), "--out", str(out), "--size", "64",
         "--patch", "8", "--codebook-size", "32", "--fps", "10", "--iters", "15", "--seed", "1"]
    )  # fmt: skip
    assert rc == 0
    return out


def expected_indices(fps: float, frames: int = CLIP_FRAMES, native: int = NATIVE_FPS) -> list[int]:
    """Frame on screen at k/fps for every k with k/fps < the clip's end (frames/native)."""
    count = math.ceil((frames / native - 1e-6) * fps)
    return [min(frames - 1, math.floor(k * native / fps + 1e-4)) for k in range(count)]


# --------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("container", ["mp4", "webm"])
@pytest.mark.parametrize("backend", [pytest.param("decord", marks=needs_decord), "pyav"])
@pytest.mark.parametrize("fps", [30, 8, 7.5, 12])
def test_sampling_is_frame_accurate(
    index_clips: dict[str, Path], container: str, backend: str, fps: float
) -> None:
    frames = np.concatenate(
        list(sample_frames(str(index_clips[container]), fps, 32, None, backend))
    )
    assert frames.shape[1:] == (32, 32, 3) and frames.dtype == np.uint8
    assert [read_index(f) for f in frames] == expected_indices(fps)


def test_max_frames_and_batches(index_clips: dict[str, Path]) -> None:
    for backend in BACKENDS:
        batches = list(sample_frames(str(index_clips["mp4"]), 30, 32, 25, backend, batch=10))
        assert [len(b) for b in batches] == [10, 10, 5]
        assert [read_index(f) for f in np.concatenate(batches)] == list(range(25))


def test_av1_falls_back_to_pyav(tmp_path: Path) -> None:
    if "libsvtav1" not in av.codecs_available:
        pytest.skip("no AV1 encoder in this PyAV build")
    frames = np.stack([index_frame(i) for i in range(20)])
    clip = write_video(tmp_path / "av1.mkv", frames, 10, codec="libsvtav1")
    got = np.concatenate(list(sample_frames(str(clip), 5, 32)))  # auto: decord cannot
    assert [read_index(f) for f in got] == list(range(0, 20, 2))
    if not HAVE_DECORD:
        return
    with pytest.raises(DecodeError, match="decord cannot decode it"):
        list(sample_frames(str(clip), 5, 32, backend="decord"))


def test_resize_keeps_aspect_then_centre_crops(tmp_path: Path) -> None:
    """16:9 frames, green in the central 90x90 square, red/blue outside it: the crop of an
    aspect-keeping resize is all green (a squash to square would show red and blue)."""
    f = np.zeros((90, 160, 3), dtype=np.uint8)
    f[:, :35] = (255, 0, 0)
    f[:, 35:125, 1] = 255
    f[:, 125:] = (0, 0, 255)
    clip = write_video(tmp_path / "wide.mp4", np.stack([f] * 10), 10)
    for backend in BACKENDS:
        (frames,) = sample_frames(str(clip), 10, 32, 1, backend)
        inner = frames[0, 2:-2, 2:-2].astype(int)  # away from the edges' scaler/chroma bleed
        assert inner[..., 1].min() > 200 and inner[..., 0].max() < 60 and inner[..., 2].max() < 60


@needs_decord
def test_decord_and_pyav_agree_on_a_real_clip() -> None:
    path = str(TEST_DATA / "rabbit_toy_320x240.webm")
    a = np.concatenate(list(sample_frames(path, 4, 128, backend="decord")))
    b = np.concatenate(list(sample_frames(path, 4, 128, backend="pyav")))
    assert a.shape == b.shape == (32, 128, 128, 3)  # 7.8 s at 4 fps
    assert psnr(a, b) > 35.0  # same frames; only the scalers' rounding differs


# --------------------------------------------------------------------------- VQ
def test_patchify_round_trip() -> None:
    x = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    p = patchify(x, 8)
    assert p.shape == (3 * 16, 192)
    assert np.array_equal(p[1].reshape(8, 8, 3), x[0, 0:8, 8:16])  # raster order
    assert np.array_equal(unpatchify(p, 32, 8), x)


def test_codebook_encode_is_the_nearest_codeword() -> None:
    rng = np.random.default_rng(0)
    c = rng.uniform(0, 255, (50, 12)).astype(np.float32)
    x = rng.uniform(0, 255, (999, 12)).astype(np.float32)
    brute = ((x[:, None, :] - c[None]) ** 2).sum(-1).argmin(1)
    assert np.array_equal(Codebook(c).encode(x), brute)


def test_fit_cli_writes_spec_and_artifact(fitted: Path) -> None:
    spec = json.loads(fitted.read_text())
    art = fitted.parent / spec["artifact"]
    assert spec["kind"] == "video-vq" and spec["modality"] == "video" and spec["vocab_size"] == 32
    assert spec["artifact"] == "tiny-vq.npy"
    assert hashlib.sha256(art.read_bytes()).hexdigest() == spec["artifact_sha256"]
    cb = np.load(art, allow_pickle=False)
    assert cb.shape == (32, 8 * 8 * 3) and cb.dtype == np.float16
    assert spec["params"]["size"] == 64 and spec["params"]["patch"] == 8
    assert spec["params"]["fit"]["sources"] == ["train.mp4"]  # names, never machine paths
    assert sorted(p.name for p in fitted.parent.iterdir()) == ["tiny-vq.json", "tiny-vq.npy"]
    tok = load_tokenizer(fitted)
    assert isinstance(tok, VqVideoTokenizer) and tok.tokens_per_frame == 64


def test_fit_cli_errors_are_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.json"
    wav = write_audio(tmp_path / "voice.wav", tone(0.5, 16000), 16000)
    cases = [
        ([str(wav)], "cannot fit on the sources: .*voice.wav: no video stream"),
        ([], "give SOURCES to fit on, or --codebook"),
        ([str(wav), "--chunk-frames", "4"], "--chunk-frames only applies with --audio-spec"),
        (["--codebook", "cb.npy", "--iters", "3"], "--iters only apply when fitting"),
    ]
    for extra, reason in cases:
        assert main(["tokenizer", "fit", "video", *extra, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert re.search(reason, err), err
    assert not list(tmp_path.glob("x*"))


def test_fitted_codebook_psnr_on_held_out_clip(fitted: Path, tmp_path: Path) -> None:
    """Bound: the fit reports its training PSNR (k-means on 8x8 patches of moving blobs);
    the scene's later frames, never seen by the fit, must come within 3 dB of it, and the
    fitted codebook must beat random codebooks of the same size by a clear margin."""
    tok = load_tokenizer(fitted)
    assert isinstance(tok, VqVideoTokenizer)
    clip = write_video(tmp_path / "held_out.mp4", BLOBS[40:], 20)
    frames = np.concatenate(list(tok.frames(str(clip))))
    rec = tok.decode_ids(tok.encode_frames(frames))
    fitted_db = psnr(rec, frames)
    train_db = json.loads(fitted.read_text())["params"]["fit"]["psnr_db"]
    assert fitted_db > train_db - 3.0, (fitted_db, train_db)
    rng = np.random.default_rng(0)
    patches = patchify(frames, 8)
    baselines = {
        "uniform": rng.uniform(0, 255, (32, 192)),
        "sampled patches": patches[rng.choice(len(patches), 32, replace=False)],
    }
    for name, cb in baselines.items():
        book = Codebook(cb.astype(np.float32))
        base_db = psnr(unpatchify(book.decode(book.encode(patches)), 64, 8), frames)
        print(f"held-out {fitted_db:.2f} dB (fit {train_db} dB); {name} codebook {base_db:.2f} dB")
        assert fitted_db > base_db + 1.0, (name, fitted_db, base_db)


def test_shipped_codebook_on_the_real_clip() -> None:
    """tokenizers/video-vq.json (256 words, 16x16 patches, fitted on the CC0 toy clips):
    on the WebM copy of the rabbit clip (another encoding of a training clip) it must
    clear a floor and beat random codebooks (uniform noise; 256 patches sampled from the
    clip itself)."""
    spec = TokenizerSpec.load(TOKENIZERS / "video-vq.json")
    tok = VqVideoTokenizer(dataclasses.replace(spec, params={**spec.params, "max_frames": 24}))
    path = str(TEST_DATA / "rabbit_toy_320x240.webm")
    space = TokenSpace.from_vocab({"video": 256})
    (doc,) = tok.encode_file(path, space)
    rec = tok.decode(doc.tokens, space)
    frames = np.concatenate(list(tok.frames(path)))
    assert rec.shape == frames.shape == (24, 256, 256, 3) and rec.dtype == np.uint8
    fitted_db = psnr(rec, frames)
    assert fitted_db > 24.0, fitted_db
    rng = np.random.default_rng(0)
    patches = patchify(frames, 16)
    for cb in (
        rng.uniform(0, 255, (256, 768)),
        patches[rng.choice(len(patches), 256, replace=False)],
    ):
        book = Codebook(cb.astype(np.float32))
        base_db = psnr(unpatchify(book.decode(book.encode(patches)), 256, 16), frames)
        print(f"rabbit webm {fitted_db:.2f} dB; random codebook {base_db:.2f} dB")
        assert fitted_db > base_db + 0.5, (fitted_db, base_db)


def test_document_layout(fitted: Path, index_clips: dict[str, Path]) -> None:
    tok = load_tokenizer(fitted)
    space = TokenSpace.from_vocab({"dna": 300, "video": 32})  # video ids above 255
    (doc,) = tok.encode_file(str(index_clips["mp4"]), space)
    t = doc.tokens.astype(np.int64)
    assert doc.key == f"{index_clips['mp4']}#video" and doc.modality == "video"
    assert doc.tokens.dtype == np.uint16
    assert t[0] == DOC_START and t[1] == space.boundary_token("video") and t[-1] == DOC_END
    body = t[2:-1].reshape(20, 65)  # 2 s at 10 fps, 64 patches + <eof>
    assert (body[:, -1] == EOF).all()
    r = space.range("video")
    assert ((body[:, :-1] >= r.start) & (body[:, :-1] < r.stop)).all()
    assert tok.decode(t, space).shape == (20, 64, 64, 3)
    with pytest.raises(ValueError, match="whole frames"):
        tok.decode(t[:-10], space)
    with pytest.raises(ValueError, match="not a special, video"):
        tok.decode(np.array([space.range("dna").start]), space)


# --------------------------------------------------------------------------- audio + video
def _av_spec(fitted: Path, d: Path, chunk: int) -> Path:
    shutil.copy(TOKENIZERS / "audio-mulaw-16k.json", d / "audio-mulaw-16k.json")
    spec = json.loads(fitted.read_text())
    shutil.copy(fitted.parent / spec["artifact"], d / spec["artifact"])
    spec["params"].update(audio={"spec": "audio-mulaw-16k.json"}, chunk_frames=chunk)
    out = d / "tiny-av.json"
    out.write_text(json.dumps(spec))
    return out


def test_audio_interleaved_per_chunk(fitted: Path, tmp_path: Path) -> None:
    clip = write_video(
        tmp_path / "av.mp4",
        np.stack([index_frame(i) for i in range(CLIP_FRAMES)]),
        NATIVE_FPS,
        audio=tone(2.0, 48000, 500.0, 0.5),
    )
    tok = load_tokenizer(_av_spec(fitted, tmp_path, chunk=4))  # 4 frames at 10 fps = 0.4 s
    assert isinstance(tok, VqVideoTokenizer) and tok.audio is not None
    (audio_spec,) = tok.companion_specs()
    space = build_token_space([tok.spec, audio_spec])
    (doc,) = tok.encode_file(str(clip), space)
    t = doc.tokens.astype(np.int64)
    v, a = space.boundary_token("video"), space.boundary_token("audio")
    assert t[0] == DOC_START and t[1] == v and t[-1] == DOC_END
    # spans: <|video|> 4 frames <|audio|> 0.4 s of samples, five times
    marks = np.flatnonzero((t == v) | (t == a))
    assert t[marks].tolist() == [v, a] * 5
    ar, vr = space.range("audio"), space.range("video")
    for i in range(5):
        video_span = t[marks[2 * i] + 1 : marks[2 * i + 1]]
        end = marks[2 * i + 2] if 2 * i + 2 < len(marks) else len(t) - 1
        audio_span = t[marks[2 * i + 1] + 1 : end]
        assert len(video_span) == 4 * 65 and (video_span[64::65] == EOF).all()
        assert ((video_span != EOF) == ((video_span >= vr.start) & (video_span < vr.stop))).all()
        assert abs(len(audio_span) - 6400) <= 1  # 0.4 s at 16 kHz
        assert ((audio_span >= ar.start) & (audio_span < ar.stop)).all()
    frames, wave = tok.decode_av(t, space)
    assert frames.shape == (20, 64, 64, 3)
    assert abs(len(wave) - 32000) <= 5
    assert [read_index(f) for f in tok.decode(t, space)] != []  # video decodes past audio spans
    peak = np.fft.rfftfreq(len(wave), 1 / 16000)[np.abs(np.fft.rfft(wave)).argmax()]
    assert peak == pytest.approx(500, abs=3)
    with pytest.raises(KeyError, match="audio"):
        list(tok.encode_file(str(clip), TokenSpace.from_vocab({"video": 32})))


def test_av_spec_on_a_clip_without_audio_gives_video_only(
    fitted: Path, tmp_path: Path, index_clips: dict[str, Path]
) -> None:
    tok = load_tokenizer(_av_spec(fitted, tmp_path, chunk=2))
    space = TokenSpace.from_vocab({"video": 32, "audio": 256})
    (doc,) = tok.encode_file(str(index_clips["webm"]), space)
    assert space.boundary_token("audio") not in doc.tokens
    assert len(doc.tokens) == 3 + 20 * 65


def test_shipped_av_spec_loads_with_its_audio() -> None:
    tok = load_tokenizer(TOKENIZERS / "video-vq-av.json")
    assert isinstance(tok, VqVideoTokenizer)
    assert [s.name for s in tok.companion_specs()] == ["audio-mulaw-16k"]


# --------------------------------------------------------------------------- bad inputs
def test_bad_inputs(fitted: Path, tmp_path: Path, index_clips: dict[str, Path]) -> None:
    tok = load_tokenizer(fitted)
    space = TokenSpace.from_vocab({"video": 32})
    data = index_clips["mp4"].read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) // 2])  # moov at the front: opens, data ends early
    webm = index_clips["webm"].read_bytes()
    cut_webm = tmp_path / "cut.webm"
    cut_webm.write_bytes(webm[: int(len(webm) * 0.6)])
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    text = tmp_path / "notes.mp4"
    text.write_text("not a video\n" * 50)
    wav = write_audio(tmp_path / "voice.wav", tone(0.5, 16000), 16000)
    cases = [
        (cut, r"corrupt or truncated video|truncated video"),
        (cut_webm, r"corrupt or truncated video|truncated video"),
        (empty, "empty file"),
        (text, "not a media file FFmpeg can open"),
        (wav, r"no video stream \(streams: audio pcm_s16le\)"),
        (tmp_path / "missing.webm", "no such file"),
    ]
    for path, reason in cases:
        with pytest.raises(DecodeError, match=reason) as e:
            list(tok.encode_file(str(path), space))
        assert str(path) in str(e.value)


def test_mp4_without_its_index(tmp_path: Path) -> None:
    """mp4 written without faststart keeps its index (moov) at the end: cut it off."""
    frames = np.stack([index_frame(i) for i in range(30)])
    path = tmp_path / "tail.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = 128, 96, "yuv420p"
        for i, f in enumerate(frames):
            vf = av.VideoFrame.from_ndarray(f, format="rgb24")
            vf.pts = i
            for p in s.encode(vf):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    data = path.read_bytes()
    assert data.rfind(b"moov") > len(data) // 2
    path.write_bytes(data[: data.rfind(b"moov") - 4])
    with pytest.raises(DecodeError, match=r"moov atom not found|Invalid data"):
        list(sample_frames(str(path), 10, 32))


def test_spec_is_checked(fitted: Path) -> None:
    spec = TokenizerSpec.load(fitted)
    for params, reason in [
        ({"size": 60}, "multiple of 'patch'"),
        ({"fps": 0}, "'fps' must be > 0"),
        ({"backend": "opencv"}, "must be one of"),
        ({"max_frame": 8}, "did you mean 'max_frames'"),
        ({"patch": 16}, r"must be float \[vocab_size, patch·patch·3 = 768\]"),
        ({"audio": {"spec": "nowhere.json"}}, "audio spec nowhere.json not found"),
    ]:
        with pytest.raises(ValueError, match=reason):
            VqVideoTokenizer(dataclasses.replace(spec, params={**spec.params, **params}))
    with pytest.raises(ValueError, match="codewords, vocab_size is 33"):
        VqVideoTokenizer(dataclasses.replace(spec, vocab_size=33))
