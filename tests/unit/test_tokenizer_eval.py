"""``ulysses-mm tokenizer eval``: fidelity of any spec on any files, as text or one JSON,
and with ``--damage`` under random wrong ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from media_factory import (
    TEST_DATA,
    TOKENIZERS,
    smooth_frames,
    tone,
    write_audio,
    write_fasta,
    write_video,
)

from ulysses_mm.cli import main
from ulysses_mm.tokenize.audio.fidelity import snr_db
from ulysses_mm.tokenize.evaluate import flip_ids
from ulysses_mm.tokenize.registry import load_tokenizer


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict]:
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


def test_dna_exact_only_where_the_policy_keeps_every_letter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fa = write_fasta(tmp_path / "x.fa", [("a", "ACGTacgtN"), ("b", "ACRYGT")])
    rc, doc = _json(
        capsys, ["tokenizer", "eval", str(TOKENIZERS / "dna-lossless.json"), str(fa), "--json"]
    )
    assert rc == 0 and doc["measure"] == "exact"
    (entry,) = doc["files"]
    assert entry["exact"] is True and entry["records"] == 2 and entry["bases"] == 15
    rc, doc = _json(
        capsys, ["tokenizer", "eval", str(TOKENIZERS / "dna-base.json"), str(fa), "--json"]
    )
    (entry,) = doc["files"]
    assert rc == 0 and entry["exact"] is False and entry["mismatches"] == 2  # R, Y -> N
    assert doc["summary"]["exact"] is False


def test_audio_snr_and_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wav = write_audio(tmp_path / "t.wav", tone(0.5, 16000, 440.0, 0.5), 16000)
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio at all")
    spec = str(TOKENIZERS / "audio-mulaw-16k.json")
    rc, doc = _json(capsys, ["tokenizer", "eval", spec, str(wav), str(bad), "--json"])
    assert rc == 1  # one file could not be read; the other is still measured
    good, err = doc["files"]
    # the SNR of textbook 8-bit mu-law (mu = 255, round half up) of the tone, here in float64
    x = tone(0.5, 16000, 440.0, 0.5).astype(np.float64)
    y = np.sign(x) * np.log1p(255 * np.abs(x)) / np.log1p(255)
    q = np.floor((y + 1) * 127.5 + 0.5) / 127.5 - 1
    back = np.sign(q) * np.expm1(np.abs(q) * np.log1p(255)) / 255
    textbook = 10 * np.log10(np.sum(x * x) / np.sum((x - back) ** 2))
    assert abs(good["snr_db"] - textbook) < 0.05, (good["snr_db"], textbook)  # 16-bit wav
    assert (good["seconds"], good["tokens"], good["tokens_per_second"]) == (0.5, 8000, 16000.0)
    assert "error" in err and "bad.wav" in err["error"] and "snr_db" not in err
    assert doc["summary"] == {
        "files": 2,
        "errors": 1,
        "mean_snr_db": good["snr_db"],
        "min_snr_db": good["snr_db"],
    }


def test_video_psnr_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    """The figures are the clip's: its sampled frames against the frames their ids decode
    to, PSNR over every pixel computed here; the text line says the same numbers."""
    clip = str(TEST_DATA / "rabbit_toy_320x240.webm")
    spec = str(TOKENIZERS / "video-vq.json")
    rc, doc = _json(capsys, ["tokenizer", "eval", spec, clip, "--json"])
    (entry,) = doc["files"]
    assert rc == 0 and doc["measure"] == "psnr_db"
    tok = load_tokenizer(spec)
    encode = tok.encoder()
    batches = list(tok.frames(clip))
    ref = np.concatenate(batches).astype(np.float64)
    dec = tok.decode_ids(np.concatenate([encode(b) for b in batches])).astype(np.float64)
    mse = ((ref - dec) ** 2).mean(axis=(1, 2, 3))  # per frame
    psnr, worst = (10 * np.log10(255**2 / m) for m in (mse.mean(), mse.max()))
    assert ref.shape == (entry["frames"], 256, 256, 3) and entry["frames"] > 10
    assert abs(entry["psnr_db"] - psnr) <= 0.006  # rounded to 0.01 dB
    assert abs(entry["worst_frame_psnr_db"] - worst) <= 0.006
    assert 20.0 < entry["psnr_db"] < 35.0  # the codebook's own fit: 25.97 dB
    assert entry["tokens_per_frame"] == entry["max_tokens_per_frame"] == (256 // 16) ** 2
    assert main(["tokenizer", "eval", spec, clip]) == 0
    line, summary = capsys.readouterr().out.splitlines()
    head = (
        f"{clip}: PSNR {entry['psnr_db']} dB (worst frame {entry['worst_frame_psnr_db']} dB) "
        f"over {entry['frames']} frames, 256 tokens/frame, encode "
    )
    assert line.startswith(head) and line.endswith(" frames/s"), line
    p = entry["psnr_db"]
    assert summary == f"video-vq: 1 files, 0 errors; mean_psnr_db {p}, min_psnr_db {p}"


def test_snr_db() -> None:
    x = np.sin(np.arange(1000) / 7.0)
    assert snr_db(x, x) == float("inf")
    assert abs(snr_db(x, 0.9 * x) - 20.0) < 1e-9  # error 0.1·x: 20 dB


def test_flip_ids_replaces_exactly_that_many_by_other_ids() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, 2000)
    ids[::100] = -1  # a ragged kind's frame ends stay where they are
    bad = flip_ids(ids, 0.01, np.random.default_rng(1), vocab=300)
    changed = np.flatnonzero(bad != ids)
    assert len(changed) == round(0.01 * 1980) and (ids[changed] >= 0).all()
    assert (bad[ids < 0] == -1).all() and (bad >= -1).all() and (bad < 300).all()
    assert np.array_equal(bad, flip_ids(ids, 0.01, np.random.default_rng(1), vocab=300))
    assert (flip_ids(ids[:10], 1e-6, rng, vocab=300) != ids[:10]).sum() == 1  # at least one
    # a codec's id stays in its quantizer's codebook (ids q*16 .. q*16+15)
    codec = np.tile(np.arange(4) * 16 + 3, 500)
    bad = flip_ids(codec, 0.2, rng, vocab=64, codebook=16)
    assert (bad // 16 == codec // 16).all() and (bad != codec).sum() == 400


def test_damage_reports_psnr_and_snr_under_wrong_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--damage on an H.264 spec, the per-patch codebook and mu-law audio: decoded after
    random wrong ids, the mean and the worst seed, per rate; dna refused in one line."""
    clip = write_video(
        tmp_path / "clip.mp4", smooth_frames(np.random.default_rng(0), 24, 64, 64), fps=8
    )
    spec = tmp_path / "h264.json"
    params = {"size": 64, "tokens_per_frame": 48, "keyint": 8, "slice_bytes": 64}
    spec.write_text(
        json.dumps(
            {
                "name": "h",
                "modality": "video",
                "kind": "video-h264",
                "vocab_size": 65792,
                "params": params,
            }
        )
    )
    argv = ["tokenizer", "eval", str(spec), str(clip), "--damage", "0.005", "--damage", "0.05"]
    rc, doc = _json(capsys, [*argv, "--seeds", "3", "--json"])
    (entry,) = doc["files"]
    low, high = entry["damaged"]
    assert rc == 0 and (low["rate"], high["rate"], low["seeds"]) == (0.005, 0.05, 3)
    assert entry["psnr_db"] > low["psnr_db"] > high["psnr_db"]
    assert low["worst_psnr_db"] <= low["psnr_db"]
    assert doc["summary"]["damaged"][1] == {
        "rate": 0.05,
        "mean_psnr_db": high["psnr_db"],
        "min_psnr_db": high["worst_psnr_db"],
    }
    assert main([*argv, "--seeds", "3"]) == 0
    assert f"0.5 % ids wrong: {low['psnr_db']} dB" in capsys.readouterr().out
    # the per-patch codebook: a wrong id is one wrong patch
    vq = str(TOKENIZERS / "video-vq.json")
    rc, doc = _json(capsys, ["tokenizer", "eval", vq, str(clip), "--damage", "0.01", "--json"])
    (entry,) = doc["files"]
    assert rc == 0 and entry["psnr_db"] - 1.0 < entry["damaged"][0]["worst_psnr_db"]
    wav = write_audio(tmp_path / "t.wav", tone(0.5, 16000, 440.0, 0.5), 16000)
    mulaw = str(TOKENIZERS / "audio-mulaw-16k.json")
    rc, doc = _json(capsys, ["tokenizer", "eval", mulaw, str(wav), "--damage", "0.01", "--json"])
    (entry,) = doc["files"]
    assert rc == 0 and entry["snr_db"] > entry["damaged"][0]["snr_db"]
    fa = write_fasta(tmp_path / "x.fa", [("a", "ACGT")])
    dna = str(TOKENIZERS / "dna-base.json")
    assert main(["tokenizer", "eval", dna, str(fa), "--damage", "0.1"]) == 2
    assert main(["tokenizer", "eval", mulaw, str(wav), "--damage", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--damage measures video and audio" in err[0]
    assert "--damage must be a finite number within (0, 1], got 2" in err[1]
