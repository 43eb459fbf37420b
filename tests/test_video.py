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
from typing import Any

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
from ulysses_mm.tokenize.kmeans import Codebook
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.video.frames import sample_frames
from ulysses_mm.tokenize.video.vq import VqVideoTokenizer, patchify, psnr, unpatchify

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
    its fit reports ~26 dB on the training patches; on the WebM copy of the rabbit clip
    (another encoding of a training clip) we assert > 24 dB and a win over random
    codebooks (uniform noise ~10 dB; 256 patches sampled from the clip itself)."""
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
    # runs: <|video|> 4 frames <|audio|> 0.4 s of samples, five times
    marks = np.flatnonzero((t == v) | (t == a))
    assert t[marks].tolist() == [v, a] * 5
    ar, vr = space.range("audio"), space.range("video")
    for i in range(5):
        video_run = t[marks[2 * i] + 1 : marks[2 * i + 1]]
        end = marks[2 * i + 2] if 2 * i + 2 < len(marks) else len(t) - 1
        audio_run = t[marks[2 * i + 1] + 1 : end]
        assert len(video_run) == 4 * 65 and (video_run[64::65] == EOF).all()
        assert ((video_run != EOF) == ((video_run >= vr.start) & (video_run < vr.stop))).all()
        assert abs(len(audio_run) - 6400) <= 1  # 0.4 s at 16 kHz
        assert ((audio_run >= ar.start) & (audio_run < ar.stop)).all()
    frames, wave = tok.decode_av(t, space)
    assert frames.shape == (20, 64, 64, 3)
    assert abs(len(wave) - 32000) <= 5
    assert [read_index(f) for f in tok.decode(t, space)] != []  # video decodes past audio runs
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


# --------------------------------------------------------------------------- video-gsvq
@pytest.fixture(scope="module")
def gsvq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny predictive gain-shape model fitted on one synthetic clip + generated ones."""
    d = tmp_path_factory.mktemp("gsvq")
    clip = write_video(d / "fit.mp4", smooth_frames(np.random.default_rng(1), 24, 96, 128))
    args = ["tokenizer", "fit", "video", str(clip), "--kind", "video-gsvq", "--size", "64"]
    args += ["--dims", "24", "--shapes", "32", "--levels", "6", "--synthetic", "3"]
    args += ["--iters", "4", "--out", str(d / "gs.json")]
    assert main(args) == 0
    return d / "gs.json"


def test_gsvq_fit_writes_a_small_spec_that_records_its_fit(gsvq: Path) -> None:
    spec = json.loads(gsvq.read_text())
    assert spec["kind"] == "video-gsvq" and spec["vocab_size"] == 1 + 4 * 32 * 6
    assert spec["artifact"] == "gs.npz"
    assert spec["params"]["fit"]["sources"] == ["fit.mp4"]
    assert spec["params"]["fit"]["synthetic_clips"] == 3
    with np.load(gsvq.with_suffix(".npz"), allow_pickle=False) as z:
        assert z["basis"].shape == (24, 16 * 16 * 3) and z["shapes"].shape == (32, 24)
        assert np.allclose(np.linalg.norm(z["shapes"], axis=1), 1.0, atol=1e-4)
        assert (np.diff(z["gains"]) > 0).all()


def test_gsvq_closed_loop_round_trip_and_document(gsvq: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(gsvq)
    frames = smooth_frames(np.random.default_rng(7), 12, 64, 64)  # not fitted on
    enc = tok.encoder()  # type: ignore[attr-defined]
    ids = np.concatenate([enc(frames[:5]), enc(frames[5:])])  # state kept across batches
    assert ids.shape == (12, 16) and np.array_equal(ids, tok.encode_frames(frames))  # type: ignore[attr-defined]
    dec = tok.decode_ids(ids)  # type: ignore[attr-defined]
    assert dec.shape == frames.shape and dec.dtype == np.uint8
    # the decoder's frames are exactly those the encoder predicted from (no drift) and each
    # frame is at least as good as coding it alone (intra) would be
    assert psnr(frames, dec) > 24.0
    alone = np.stack([tok.decode_ids(tok.encode_frames(f[None]))[0] for f in frames])  # type: ignore[attr-defined]
    assert psnr(frames, dec) >= psnr(frames, alone)
    with pytest.raises(ValueError, match="out of range"):
        tok.decode_ids(np.full((1, 16), tok.spec.vocab_size))  # type: ignore[attr-defined]
    clip = write_video(tmp_path / "c.webm", frames, fps=8)
    space = build_token_space([tok.spec])
    (doc,) = tok.encode_file(str(clip), space)
    t = doc.tokens.astype(np.int64)
    assert t[0] == DOC_START and t[-1] == DOC_END and (t == EOF).sum() == 12
    assert tok.decode(t, space).shape == (12, 64, 64, 3)


def test_gsvq_artifact_is_checked(
    gsvq: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = json.loads(gsvq.read_text())
    spec["vocab_size"] = 100
    spec["artifact"] = str(gsvq.with_suffix(".npz"))
    (tmp_path / "bad.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="vocab_size is 100"):
        load_tokenizer(tmp_path / "bad.json")
    out = str(tmp_path / "x.json")
    assert main(["tokenizer", "fit", "video", "x.mp4", "--synthetic", "2", "--out", out]) == 2
    assert "--synthetic applies to --kind video-gsvq only" in capsys.readouterr().err


def test_shipped_gsvq_on_a_clip_it_was_not_fitted_on() -> None:
    """The gain-shape spec was fitted on the pig clip and synthetic clips; the rabbit clip
    is held out: measured 26.1 dB on these 24 frames at 256 tokens
    per frame, its motion-compensated prediction 1.4 dB above the same model's plain layout
    (24.7 dB)."""
    spec = TokenizerSpec.load(TOKENIZERS / "video-gsvq.json")
    assert "rabbit" not in " ".join(spec.params["fit"]["sources"])
    assert (spec.params["motion"], spec.params["local"], spec.vocab_size) == (12, 2, 120458)
    assert spec.vocab_size <= 131072
    tok = load_tokenizer(spec)
    clip = str(TEST_DATA / "rabbit_toy_320x240.webm")
    frames = np.concatenate(list(sample_frames(clip, 8.0, 256, 24, "auto")))
    dec = tok.decode_ids(tok.encode_frames(frames))  # type: ignore[attr-defined]
    assert tok.tokens_per_frame == 256  # type: ignore[attr-defined]
    assert psnr(frames, dec) > 25.5
    plain = _with_motion(TOKENIZERS / "video-gsvq.json", 0, 0)
    assert psnr(frames, dec) > psnr(frames, plain.decode_ids(plain.encode_frames(frames))) + 1.0


# --------------------------------------------------------------------------- video-gsvq motion
def _panning(t: int, size: int = 64, step: tuple[int, int] = (2, -3)) -> np.ndarray:
    """A textured scene the camera pans over by ``step`` pixels a frame: [t, size, size, 3]."""
    big = smooth_frames(np.random.default_rng(3), 1, 2 * size, 2 * size)[0].astype(np.float32)
    noise = np.random.default_rng(4).uniform(-1, 1, (2 * size, 2 * size)).astype(np.float32)
    for axis in (0, 1, 0, 1):  # smoothed: a texture a shift shows in, not a periodic one
        noise = (noise + np.roll(noise, 1, axis) + np.roll(noise, -1, axis)) / 3
    big += 120 * noise[..., None]
    big = np.clip(big, 0, 255).astype(np.uint8)
    oy, ox = size // 2, size // 2
    return np.stack(
        [
            big[
                oy - k * step[0] : oy - k * step[0] + size,
                ox - k * step[1] : ox - k * step[1] + size,
            ]
            for k in range(t)
        ]
    )


def _with_motion(gsvq: Path, motion: int, local: int) -> Any:
    from ulysses_mm.tokenize.video.gainshape import MotionLayout, load_model

    spec = TokenizerSpec.load(gsvq)
    layout = MotionLayout(load_model(spec, 16).per_mode, motion, local)
    params = {**spec.params, "motion": motion, "local": local}
    return load_tokenizer(dataclasses.replace(spec, params=params, vocab_size=layout.vocab_size))


def test_global_motion_finds_a_known_pan() -> None:
    import torch

    from ulysses_mm.tokenize.video.gainshape import _luma, global_motion

    frames = torch.from_numpy(_panning(2, 64, (3, -5))).to(torch.float32)
    assert global_motion(_luma(frames[0]), _luma(frames[1]), 6) == (3, -5)
    assert global_motion(_luma(frames[0]), _luma(frames[0]), 6) == (0, 0)


def test_gsvq_motion_closed_loop_and_its_ids(gsvq: Path) -> None:
    """Motion-compensated ids: one motion id per frame after the first, at position t mod N,
    and the decoder tracks the encoder exactly."""
    from ulysses_mm.tokenize.video.gainshape import MotionLayout

    frames = _panning(10)
    moving = _with_motion(gsvq, 4, 1)
    enc = moving.encoder()
    ids = np.concatenate([enc(frames[:4]), enc(frames[4:])])  # state kept across batches
    assert np.array_equal(ids, moving.encode_frames(frames))
    lay: MotionLayout = moving.layout
    assert moving.spec.vocab_size == 9 * (1 + lay.per_mode) + lay.per_mode + 81
    n = ids.shape[1]
    for t in range(ids.shape[0]):
        is_motion = ids[t] >= lay.motion_start
        assert is_motion.sum() == (t > 0) and (t == 0 or is_motion[t % n])
    # closed loop: the decoder's frames are the encoder's predictions, frame by frame
    coder = moving.coder()
    x = torch_patches(frames)
    encoded = []
    for i in range(frames.shape[0]):
        coder.encode(x[i], moving.model.project(x[i]))
        encoded.append(coder.prev.numpy().astype(np.uint8))
    dec = moving.decode_ids(ids)
    assert np.array_equal(dec, unpatchify(np.concatenate(encoded), 64, 16))
    bad = ids.copy()
    bad[1, 0] = bad[1, 1]  # frame 1's slot (position 1) holds a motion id; put one elsewhere
    with pytest.raises(ValueError, match="motion id outside"):
        moving.decode_ids(bad)
    bad = ids.copy()
    bad[1, 1] = 0
    with pytest.raises(ValueError, match="not a motion id"):
        moving.decode_ids(bad)


def test_shipped_gsvq_model_with_motion_gains_on_a_pan() -> None:
    """The shipped model with params motion/local on a 256×256 camera pan (the previous
    frame displaced, then refined per patch) beats its plain layout (measured 0.74 / 0.82 /
    0.87 dB for motion 8 / + local 1 / + local 2)."""
    frames = _panning(8, 256, (4, 5))
    spec = TOKENIZERS / "video-gsvq.json"
    plain = _with_motion(spec, 0, 0)
    base = psnr(frames, plain.decode_ids(plain.encode_frames(frames)))
    for motion, local, bound in ((8, 0, 0.5), (8, 1, 0.6), (8, 2, 0.6)):
        tok = _with_motion(spec, motion, local)
        gain = psnr(frames, tok.decode_ids(tok.encode_frames(frames))) - base
        assert gain > bound, f"motion {motion}, local {local}: {gain:.2f} dB"


def torch_patches(frames: np.ndarray) -> Any:
    import torch

    x = torch.from_numpy(patchify(frames, 16)).to(torch.float32)
    return x.reshape(frames.shape[0], -1, x.shape[1])


def test_gsvq_motion_params_are_checked(gsvq: Path, tmp_path: Path) -> None:
    spec = json.loads(gsvq.read_text())
    spec["params"]["motion"] = 4
    spec["artifact"] = str(gsvq.with_suffix(".npz"))
    (tmp_path / "m.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"motion 4, local 0\) makes 850 ids, vocab_size is 769"):
        load_tokenizer(tmp_path / "m.json")
    spec["params"]["local"] = 9
    (tmp_path / "m.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="'local' 0..3"):
        load_tokenizer(tmp_path / "m.json")


def test_gsvq_fit_with_motion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clip = write_video(tmp_path / "fit.mp4", _panning(10))
    args = ["tokenizer", "fit", "video", str(clip), "--kind", "video-gsvq", "--size", "64"]
    args += ["--dims", "16", "--shapes", "16", "--levels", "4", "--iters", "2"]
    args += ["--motion", "3", "--local", "1", "--out", str(tmp_path / "m.json")]
    assert main(args) == 0
    spec = json.loads((tmp_path / "m.json").read_text())
    assert (spec["params"]["motion"], spec["params"]["local"]) == (3, 1)
    assert spec["vocab_size"] == 9 * (1 + 2 * 16 * 4) + 2 * 16 * 4 + 7 * 7
    tok = load_tokenizer(tmp_path / "m.json")
    frames = _panning(6)
    assert tok.decode_ids(tok.encode_frames(frames)).shape == frames.shape  # type: ignore[attr-defined]
    out = str(tmp_path / "x.json")
    assert main(["tokenizer", "fit", "video", "x.mp4", "--motion", "2", "--out", out]) == 2
    assert "--motion and --local apply to --kind video-gsvq only" in capsys.readouterr().err


def test_gsvq_motion_fast_paths_match_the_straightforward_computation(gsvq: Path) -> None:
    """The encoder's vectorised stages (one padded buffer, one step for inter and intra,
    batched refinements, strided views) give what a per-candidate / per-patch loop gives."""
    import torch

    from ulysses_mm.tokenize.video.gainshape import _luma, global_motion

    tok = _with_motion(gsvq, 4, 2)
    coder, model, lay = tok.coder(), tok.model, tok.layout
    frames = _panning(4, 64, (2, -3))
    x = torch_patches(frames)
    pad, size, p, n = lay.motion + lay.local, 64, 16, 4
    found, chosen = [], set()
    for i in range(frames.shape[0]):
        # the padded previous image: F.pad's replicate
        img = coder._padded()
        want = torch.nn.functional.pad(
            torch.from_numpy(unpatchify(coder.prev.numpy(), size, p)[0]).permute(2, 0, 1)[None],
            (pad,) * 4,
            mode="replicate",
        )[0].permute(1, 2, 0)
        assert torch.equal(img, want)
        luma, xl = _luma(img), _luma(torch.from_numpy(frames[i]).to(torch.float32))
        # the global displacement: each candidate's error on its own, the first least
        a, b, m = luma[pad : pad + size, pad : pad + size], xl, lay.motion
        g = global_motion(a, b, m)
        found.append(g)
        errs = {
            (dy, dx): float(
                (
                    (
                        a[m - dy : size - m - dy : 3, m - dx : size - m - dx : 3].double()
                        - b[m : size - m : 3, m : size - m : 3].double()
                    )
                    ** 2
                ).sum()
            )
            for dy in range(-m, m + 1)
            for dx in range(-m, m + 1)
        }
        assert errs[g] <= errs[(0, 0)] and (g == (0, 0) or errs[g] < errs[(0, 0)])
        # the per-patch offsets: each patch's error for each offset, the first least
        off = coder.choose_offsets(luma, xl, g)
        chosen |= set(off.tolist())
        for k in range(n * n):
            y0, x0 = (k // n) * p, (k % n) * p
            e = [
                float(
                    (
                        (
                            luma[
                                pad - g[0] - oy + y0 : pad - g[0] - oy + y0 + p : 2,
                                pad - g[1] - ox + x0 : pad - g[1] - ox + x0 + p,
                            ].double()
                            - xl[y0 : y0 + p : 2, x0 : x0 + p].double()
                        )
                        ** 2
                    ).sum()
                )
                for oy, ox in lay.offsets
            ]
            assert int(off[k]) == int(np.argmin(e)), (i, k)
        # the displaced patches: each patch cut from the padded image on its own
        disp = coder._displaced(img, g, off)
        for k in range(n * n):
            oy, ox = lay.offsets[int(off[k])]
            y0 = pad - g[0] - oy + (k // n) * p
            x0 = pad - g[1] - ox + (k % n) * p
            assert torch.equal(disp[k], img[y0 : y0 + p, x0 : x0 + p].reshape(-1))
        # one step: its reconstruction is what the decoder makes of its ids
        ids, rec = model.step(x[i], disp, model.project(x[i]))
        assert torch.equal(rec, model.reconstruct(ids, disp))
        coder.encode(x[i], model.project(x[i]))
    assert len(set(found)) > 1 and len(chosen) > 4  # the choices were not all alike
