"""``ulysses-mm tokenizer eval``: fidelity of any spec on any files, as text or one JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from media_factory import TEST_DATA, TOKENIZERS, tone, write_audio, write_fasta

from ulysses_mm.cli import main
from ulysses_mm.tokenize.evaluate import snr_db


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
    assert 30.0 < good["snr_db"] < 45.0  # 8-bit mu-law: ~38 dB
    assert good["tokens_per_second"] == 16000.0
    assert "error" in err and "bad.wav" in err["error"] and "snr_db" not in err
    assert doc["summary"] == {
        "files": 2,
        "errors": 1,
        "mean_snr_db": good["snr_db"],
        "min_snr_db": good["snr_db"],
    }


def test_video_psnr_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    clip = str(TEST_DATA / "rabbit_toy_320x240.webm")
    spec = str(TOKENIZERS / "video-vq.json")
    assert main(["tokenizer", "eval", spec, clip]) == 0
    text = capsys.readouterr().out
    assert "PSNR" in text and "dB" in text and "tokens/frame" in text
    rc, doc = _json(capsys, ["tokenizer", "eval", spec, clip, "--json"])
    (entry,) = doc["files"]
    assert rc == 0 and doc["measure"] == "psnr_db"
    assert entry["frames"] > 10 and entry["tokens_per_frame"] > 0
    assert 15.0 < entry["worst_frame_psnr_db"] <= entry["psnr_db"] < 60.0


def test_snr_db() -> None:
    x = np.sin(np.arange(1000) / 7.0)
    assert snr_db(x, x) == float("inf")
    assert abs(snr_db(x, 0.9 * x) - 20.0) < 1e-9  # error 0.1·x: 20 dB
