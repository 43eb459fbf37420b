"""Audio tokenizer: mu-law SNR bounds, every container, downmix/resample, true errors.

SNR bounds, justified: a b-bit mu-law code is a uniform b-bit quantiser of the companded
signal y = ln(1 + mu|x|)/ln(1 + mu); its SNR is about 6.02·b + 4.77 - 20·log10(ln(1 + mu))
≈ 48.2 + 4.8 - 14.9 ≈ 38 dB at 8 bits, nearly independent of the level for signals well
above -40 dBFS. We assert 35 dB for a full-scale sine (3 dB margin) and 30 dB for real
speech, whose quiet passages sit nearer the companding's linear region.
"""

from __future__ import annotations

import dataclasses
import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest
from media_factory import (
    TEST_DATA,
    TOKENIZERS,
    index_frame,
    snr_db,
    tone,
    write_audio,
    write_video,
)

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.tokenize.audio.mulaw import MulawTokenizer, mulaw_decode, mulaw_encode
from ulysses_mm.tokenize.audio.waveform import _RateStream, load_waveform
from ulysses_mm.tokenize.base import DecodeError, TokenizerSpec
from ulysses_mm.tokenize.registry import load_tokenizer


def tokenizer(**params) -> MulawTokenizer:
    spec = TokenizerSpec.load(TOKENIZERS / "audio-mulaw-16k.json")
    bits = params.get("bits", 8)
    spec = dataclasses.replace(spec, vocab_size=2**bits, params={**spec.params, **params})
    return MulawTokenizer(spec)


def space(bits: int = 8) -> TokenSpace:
    return TokenSpace.from_vocab({"audio": 2**bits})


# --------------------------------------------------------------------------- mu-law
def test_mulaw_codes_cover_the_range_monotonically() -> None:
    x = np.linspace(-1, 1, 100_001, dtype=np.float32)
    q = mulaw_encode(x)
    assert q.dtype == np.uint8 and q.min() == 0 and q.max() == 255
    assert (np.diff(q.astype(int)) >= 0).all()
    assert len(np.unique(q)) == 256
    y = mulaw_decode(np.arange(256))
    assert y.dtype == np.float32 and (np.diff(y) > 0).all()
    assert y[0] == pytest.approx(-1.0) and y[-1] == pytest.approx(1.0)
    # the finest steps are near zero, the coarsest near full scale (companding)
    assert np.diff(y)[127] < np.diff(y)[0] / 50
    assert mulaw_encode(np.array([-3.0, 3.0])).tolist() == [0, 255]  # clipped


@pytest.mark.parametrize(("amp", "bound"), [(0.999, 35.0), (0.1, 35.0), (0.01, 30.0)])
def test_mulaw_sine_snr(amp: float, bound: float) -> None:
    s = tone(1.0, 16000, 440.0, amp)
    snr = snr_db(s, mulaw_decode(mulaw_encode(s)))
    assert snr > bound, f"{snr:.1f} dB"
    assert snr < 45.0  # an 8-bit code cannot do much better than ~38 dB: no free lunch


def test_mulaw_more_bits_more_snr() -> None:
    s = tone(1.0, 16000, 440.0, 0.9)
    snrs = [snr_db(s, mulaw_decode(mulaw_encode(s, b), b)) for b in (4, 8, 12, 16)]
    assert all(b - a > 15 for a, b in itertools.pairwise(snrs))  # ~6 dB per bit
    assert mulaw_encode(s, 12).dtype == np.uint16


def test_real_speech_round_trip_snr() -> None:
    tok = load_tokenizer(TOKENIZERS / "audio-mulaw-16k.json")
    assert isinstance(tok, MulawTokenizer)
    path = TEST_DATA / "ljspeech_LJ001-0001.wav"
    wave = tok.load(str(path))
    assert wave.rate == 16000 and wave.samples.shape[0] == pytest.approx(9.655 * 16000, abs=2)
    (doc,) = tok.encode_file(str(path), space())
    assert doc.key == f"{path}#audio" and doc.modality == "audio"
    assert len(doc.tokens) == wave.samples.shape[0] + 3
    snr = snr_db(wave.samples, tok.decode(doc.tokens, space()))
    assert snr > 30.0, f"{snr:.1f} dB"


# --------------------------------------------------------------------------- containers
@pytest.mark.parametrize("suffix", [".wav", ".flac", ".ogg", ".mp3"])
def test_every_container_resampled_downmixed_and_tokenized(tmp_path: Path, suffix: str) -> None:
    """A 44.1 kHz stereo tone -> 16 kHz mono tokens; the decode matches the analytic tone."""
    rate, seconds = 44100, 1.5
    x = tone(seconds, rate, 440.0, 0.9)
    path = write_audio(tmp_path / f"tone{suffix}", np.stack([x, x], 1), rate)
    tok = tokenizer()
    (doc,) = tok.encode_file(str(path), space())
    t = doc.tokens
    assert t[0] == DOC_START and t[1] == space().boundary_token("audio") and t[-1] == DOC_END
    n = len(t) - 3
    lossless = suffix in (".wav", ".flac")
    # lossy codecs may add up to a frame of encoder padding FFmpeg does not trim
    assert abs(n - seconds * 16000) <= (2 if lossless else 0.03 * 16000)
    y = tok.decode(t, space())
    ref = tone(n / 16000, 16000, 440.0, 0.9)
    if lossless:  # sample-aligned: resampling (~90 dB) + mu-law (~38 dB)
        assert snr_db(ref[100:-100], y[100:-100]) > 35.0
    # any codec: the tone is still 440 Hz at the same level (mono = mean, no +3 dB)
    spectrum = np.abs(np.fft.rfft(y * np.hanning(n)))
    assert np.fft.rfftfreq(n, 1 / 16000)[spectrum.argmax()] == pytest.approx(440, abs=2)
    assert np.sqrt(np.mean(y[2000:-2000] ** 2)) == pytest.approx(0.9 / np.sqrt(2), rel=0.06)


def test_downmix_is_the_channel_mean(tmp_path: Path) -> None:
    x = tone(1.0, 16000, 300.0, 0.8)
    opposite = write_audio(tmp_path / "opp.wav", np.stack([x, -x], 1), 16000)
    one_side = write_audio(tmp_path / "left.wav", np.stack([x, np.zeros_like(x)], 1), 16000)
    quiet = load_waveform(str(opposite), 16000).samples
    half = load_waveform(str(one_side), 16000).samples
    assert np.abs(quiet).max() < 1e-3  # L + R cancel
    assert snr_db(x / 2, half) > 60.0  # (L + 0) / 2


def test_bits_and_rate_come_from_the_spec(tmp_path: Path) -> None:
    path = write_audio(tmp_path / "t.wav", tone(1.0, 22050), 22050)
    tok = tokenizer(sample_rate=8000, bits=10)
    (doc,) = tok.encode_file(str(path), space(10))
    assert len(doc.tokens) - 3 == pytest.approx(8000, abs=2)
    assert doc.tokens.dtype == np.uint16 and doc.tokens[2:-1].max() > 255
    y = tok.decode(doc.tokens, space(10))
    assert snr_db(tone(len(y) / 8000, 8000)[50:-50], y[50:-50]) > 45.0  # 10 bits: ~12 dB more


def test_max_seconds_caps_decoding(tmp_path: Path) -> None:
    path = write_audio(tmp_path / "long.flac", tone(5.0, 16000), 16000)
    (doc,) = tokenizer(max_seconds=1.25).encode_file(str(path), space())
    assert len(doc.tokens) - 3 == 20000


def test_audio_track_of_video_containers(tmp_path: Path) -> None:
    frames = np.stack([index_frame(i, 64, 64) for i in range(30)])
    for suffix in (".mp4", ".webm"):
        path = write_video(tmp_path / f"clip{suffix}", frames, 30, audio=tone(1.0, 48000, 500.0))
        (doc,) = tokenizer().encode_file(str(path), space())
        y = tokenizer().decode(doc.tokens, space())
        assert abs(len(y) - 16000) < 400  # codec priming/padding only
        peak = np.fft.rfftfreq(len(y), 1 / 16000)[np.abs(np.fft.rfft(y)).argmax()]
        assert peak == pytest.approx(500, abs=3)


def test_wide_space_ids_do_not_wrap(tmp_path: Path) -> None:
    path = write_audio(tmp_path / "t.wav", tone(0.5, 16000), 16000)
    sp = TokenSpace.from_vocab({"dna": 300, "audio": 256})
    (doc,) = tokenizer().encode_file(str(path), sp)
    assert doc.tokens.dtype == np.uint16
    local = doc.tokens[2:-1].astype(int) - sp.range("audio").start
    assert local.min() >= 0 and local.max() == 255
    wave = load_waveform(str(path), 16000).samples
    assert np.array_equal(local, mulaw_encode(wave))


# --------------------------------------------------------------------------- bad inputs
def _cut(src: Path, dst: Path, fraction: float = 0.5) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: int(len(data) * fraction)])
    return dst


@pytest.mark.parametrize(
    ("suffix", "reason"),
    [
        (".wav", "truncated WAV: the RIFF header declares"),
        (".flac", "corrupt or truncated|truncated audio"),
        (".ogg", "truncated Ogg"),
        (".mp3", "truncated audio: decoded"),
    ],
)
def test_truncated_files(tmp_path: Path, suffix: str, reason: str) -> None:
    x = tone(4.0, 44100, 330.0, 0.5)
    full = write_audio(tmp_path / f"full{suffix}", np.stack([x, x], 1), 44100)
    tokenizer().load(str(full))  # the whole file is fine
    cut = _cut(full, tmp_path / f"cut{suffix}")
    with pytest.raises(DecodeError, match=reason) as e:
        tokenizer().load(str(cut))
    assert str(cut) in str(e.value)


def test_truncated_real_wav(tmp_path: Path) -> None:
    cut = _cut(TEST_DATA / "ljspeech_LJ001-0001.wav", tmp_path / "lj.wav", 0.7)
    with pytest.raises(DecodeError, match="truncated WAV"):
        list(tokenizer().encode_file(str(cut), space()))


def test_bad_inputs(tmp_path: Path) -> None:
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    text = tmp_path / "notes.wav"
    text.write_text("this is not audio, just text in a file named .wav\n" * 20)
    silent_clip = write_video(tmp_path / "video_only.mp4", np.stack([index_frame(0, 64, 64)] * 5))
    cases = [
        (empty, "empty file"),
        (text, "not a media file FFmpeg can open"),
        (silent_clip, r"no audio stream \(streams: video h264\)"),
        (tmp_path / "missing.flac", "no such file"),
    ]
    for path, reason in cases:
        with pytest.raises(DecodeError, match=reason):
            list(tokenizer().encode_file(str(path), space()))


def test_corrupt_bytes_in_the_middle(tmp_path: Path) -> None:
    x = tone(3.0, 44100, 330.0, 0.5)
    src = write_audio(tmp_path / "ok.flac", x, 44100)
    data = bytearray(src.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 4000] = (
        np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    )
    bad = tmp_path / "bad.flac"
    bad.write_bytes(bytes(data))
    with pytest.raises(DecodeError, match=r"error|corrupt") as e:
        tokenizer().load(str(bad))
    assert str(bad) in str(e.value)


def test_spec_is_checked() -> None:
    spec = TokenizerSpec.load(TOKENIZERS / "audio-mulaw-16k.json")
    with pytest.raises(ValueError, match=r"2\*\*bits = 256"):
        MulawTokenizer(dataclasses.replace(spec, vocab_size=255))
    with pytest.raises(ValueError, match="did you mean 'sample_rate'"):
        MulawTokenizer(dataclasses.replace(spec, params={"samplerate": 8000}))
    with pytest.raises(ValueError, match="must be int"):
        MulawTokenizer(dataclasses.replace(spec, params={"bits": 8.0}))


def test_copy_is_readable_through_any_name(tmp_path: Path) -> None:
    """Formats are sniffed by FFmpeg from the bytes, not from the file name."""
    odd = tmp_path / "speech.bin"
    shutil.copy(TEST_DATA / "ljspeech_LJ001-0001.wav", odd)
    assert tokenizer(max_seconds=1.0).load(str(odd)).samples.shape[0] == 16000


# --------------------------------------------------------------------------- resampling
def _ideal_resample(x: np.ndarray, rate: int, out_rate: int) -> np.ndarray:
    """Brick-wall band-limited resample (FFT, periodic signal): the reference."""
    n = x.shape[0]
    m = n * out_rate // rate
    spectrum = np.fft.rfft(x.astype(np.float64))[: m // 2 + 1]
    return np.fft.irfft(spectrum, m) * (m / n)


def _synth(kind: str, rate: int = 44100, seconds: float = 1.0) -> np.ndarray:
    """Speech-like (glottal harmonics under formants), music (a chord, rich harmonics) or a
    bird-like call (fast chirps sweeping 6.5-7.5 kHz); faded in and out (periodic-safe)."""
    t = np.arange(int(rate * seconds)) / rate
    rng = np.random.default_rng(0)
    x = np.zeros_like(t)
    if kind == "speech":
        phase = 2 * np.pi * np.cumsum(120 + 30 * np.sin(2 * np.pi * 3 * t)) / rate
        for k in range(1, 90):  # harmonics to ~13 kHz, formants at 500 / 1500 / 2500 Hz
            f = 120 * k
            env = sum(np.exp(-(((f - c) / 300) ** 2)) for c in (500, 1500, 2500)) + 0.02
            x += env / k**0.5 * np.sin(k * phase + rng.uniform(0, 6.3))
    elif kind == "music":
        for f0 in (220.0, 277.2, 329.6, 440.0):
            for k in range(1, 40):
                if f0 * k < rate / 2:
                    x += np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6.3)) / k**1.5
    else:  # bird: 8 syllables, each a 60 ms sweep 6.5 -> 7.5 kHz
        for s in range(8):
            t0 = 0.05 + s * 0.11
            local = t - t0
            on = (local >= 0) & (local < 0.06)
            f = 6500 + 1000 * local / 0.06
            x += on * np.sin(2 * np.pi * np.cumsum(f) / rate) * np.sin(np.pi * local / 0.06) ** 2
    fade = np.minimum(1.0, np.minimum(t, seconds - t) / 0.02)
    x = x * fade
    return (0.5 * x / np.abs(x).max()).astype(np.float32)


@pytest.mark.parametrize("kind", ["speech", "music", "bird"])
def test_resample_matches_an_ideal_band_limited_one(tmp_path: Path, kind: str) -> None:
    x = _synth(kind)
    path = write_audio(tmp_path / f"{kind}.wav", x, 44100)
    ref = _ideal_resample(x, 44100, 16000)
    got = load_waveform(str(path), 16000).samples
    assert got.shape[0] == ref.shape[0]
    assert snr_db(ref, got) >= 30.0, f"{kind}: {snr_db(ref, got):.1f} dB"
    if kind == "bird":  # libswresample's default filter loses the call's top (the old path)
        old = load_waveform(str(path), 16000, resampler="swr").samples
        assert snr_db(ref, old[: ref.shape[0]]) < 25.0, f"swr: {snr_db(ref, old):.1f} dB"


def _tone_rms(tmp_path: Path, f: float) -> float:
    """RMS of what the 16 kHz resample holds of a 44.1 kHz tone of amplitude 0.5 at ``f``
    Hz (edges dropped); a tone above the Nyquist measures what folds back."""
    path = write_audio(tmp_path / f"t{int(f)}.wav", tone(1.0, 44100, f, 0.5), 44100)
    y = load_waveform(str(path), 16000).samples[2000:-2000]
    return float(np.sqrt(np.mean(y.astype(np.float64) ** 2)))


def _gain_db(rms: float) -> float:
    return float(20 * np.log10(np.sqrt(2) * rms / 0.5))


def test_16k_keeps_the_band_to_7500_hz(tmp_path: Path) -> None:
    for f in (1000.0, 7000.0, 7500.0):
        gain_db = _gain_db(_tone_rms(tmp_path, f))
        assert abs(gain_db) < 1.0, f"{f} Hz: {gain_db:.2f} dB"
    alias = _tone_rms(tmp_path, 8200.0)
    assert alias < 0.5 * 10 ** (-60 / 20)  # stop band: no alias at 7.8 kHz


def _top_band(rate: int, seconds: float = 1.0) -> np.ndarray:
    """Most of its energy at 7.6-7.95 kHz (flat-spectrum noise, shaped by FFT), the rest a
    speech-like low band; faded in and out so a periodic reference and a stream agree."""
    n = round(rate * seconds)
    rng = np.random.default_rng(1)
    f = np.fft.rfftfreq(n, 1 / rate)
    spectrum = rng.standard_normal(f.shape[0]) + 1j * rng.standard_normal(f.shape[0])
    gain = ((f >= 7600) & (f <= 7950)) + 0.3 * ((f >= 100) & (f <= 3000))
    x = np.fft.irfft(spectrum * gain, n)
    t = np.arange(n) / rate
    x *= np.minimum(1.0, np.minimum(t, seconds - t) / 0.05)
    return (0.5 * x / np.abs(x).max()).astype(np.float32)


@pytest.mark.parametrize("rate", [44100, 22050])
def test_sharp_resample_keeps_7_6_to_7_95_khz(tmp_path: Path, rate: int) -> None:
    """The default filter is flat to 7.95 kHz: a signal with most of its energy at
    7.6-7.95 kHz still matches an ideal band-limited resample; libsoxr's VHQ alone cannot."""
    x = _top_band(rate)
    path = write_audio(tmp_path / "top.wav", x, rate)
    ref = _ideal_resample(x, rate, 16000)
    got = load_waveform(str(path), 16000).samples
    assert got.shape[0] == ref.shape[0]
    assert snr_db(ref, got) >= 30.0, f"sharp: {snr_db(ref, got):.1f} dB"
    old = load_waveform(str(path), 16000, resampler="soxr").samples[: ref.shape[0]]
    assert snr_db(ref, old) < 10.0, f"soxr: {snr_db(ref, old):.1f} dB"


def test_sharp_resample_is_flat_to_7950_hz(tmp_path: Path) -> None:
    for f in (7500.0, 7800.0, 7950.0):
        gain_db = _gain_db(_tone_rms(tmp_path, f))
        assert abs(gain_db) < 0.1, f"{f} Hz: {gain_db:.2f} dB"
    for f in (8000.0, 8050.0):  # the stop band starts at the Nyquist: nothing folds back
        assert _tone_rms(tmp_path, f) < 0.5 * 10 ** (-90 / 20), f"{f} Hz leaks"


@pytest.mark.parametrize(
    ("rate", "sharp"), [(44100, True), (22050, True), (32000, True), (48000, False)]
)
def test_streamed_resample_is_exact_across_chunks(rate: int, sharp: bool) -> None:
    """Chunk sizes do not change a sample: the FIR runs on blocks counted from the start."""
    x = _synth("speech", rate, 3.0)
    whole = _RateStream(rate, 16000, sharp)
    expect = np.concatenate([whole.resample_chunk(x), whole.resample_chunk(x[:0], last=True)])
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.integers(0, x.shape[0], 40))
    chunked = _RateStream(rate, 16000, sharp)
    parts = [chunked.resample_chunk(c) for c in np.split(x, cuts)]
    got = np.concatenate([*parts, chunked.resample_chunk(x[:0], last=True)])
    np.testing.assert_array_equal(got, expect)
    if sharp:
        assert got.shape[0] == round(x.shape[0] * 16000 / rate)


def test_resampler_param_is_checked() -> None:
    with pytest.raises(ValueError, match="resampler"):
        tokenizer(resampler="linear")
