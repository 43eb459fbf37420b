"""``inspect``: manifest summary, segment table, and a PNG of one sample whose panels are
decoded through the manifest's tokenizers — checked against the inputs, not just drawn."""

from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from pipeline_fakes import VIDEO, make_inputs, write_pipeline

from ulysses_mm.cli import main
from ulysses_mm.shards.inspect import (
    decode_sample,
    find_tokenizer,
    inspect_dataset,
    load_sample,
    modality_tokens,
    open_target,
    render_png,
)
from ulysses_mm.shards.manifest import Manifest, ShardIntegrityError
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare

BASES = "ACGTN"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, Path]:
    """(inputs dir, dataset dir): everything in 2 samples of 4096 tokens, one shard."""
    root = tmp_path_factory.mktemp("inspect")
    data = make_inputs(root, n_dna=3)
    out = root / "out"
    spec = write_pipeline(root, str(out), seq_len=4096, workers=1, shards={"max_bytes": 1 << 20})
    prepare(load_pipeline_config(spec))
    return data, out


def true_frames(data: Path) -> np.ndarray:
    raw = np.frombuffer((data / "clip.vid").read_bytes(), np.uint8).astype(np.int64)
    gray = (raw % 64 * 255 // 63).astype(np.uint8).reshape(-1, 4, 4)
    return np.repeat(gray[..., None], 3, axis=3)


def test_summary_and_segment_table(dataset, capsys):
    _, out = dataset
    assert inspect_dataset(str(out / "manifest.json"), sample=1) == 0
    text = capsys.readouterr().out
    m = Manifest.load(str(out))
    assert "dataset fake" in text and m.token_space.describe() in text
    assert "tokenizer video: frames (kind test-frames" in text
    assert "skipped " in text and "corrupt.seq: line 2: illegal character 'X'" in text
    sample, _ = load_sample(open_target(str(out)), 1)
    table = text[text.index("sample 1 (") :].splitlines()
    assert table[0].startswith(f"sample 1 (shard-000000.tar #1): {len(sample.segments)} segments")
    rows = [line.split() for line in table[2:]]
    assert len(rows) == len(sample.segments)
    for row, seg in zip(rows, sample.segments.tolist()):
        start, length, mod, doc, pos = seg
        assert row == [
            str(rows.index(row)),
            str(start),
            str(length),
            m.token_space.modalities[mod],
            str(doc),
            str(pos),
        ]


def test_png_panels_decode_to_the_inputs(dataset, tmp_path):
    data, out = dataset
    m = Manifest.load(str(out))
    target = open_target(str(out))
    samples = [load_sample(target, k)[0] for k in range(m.num_samples)]
    decoded = {d.modality: d for s in samples for d in decode_sample(m, s) if not d.error}
    # DNA: the bases of every DNA document, in order, GC track drawn from them
    dna = "".join(decoded_dna(m, s) for s in samples)
    genomes = "".join(
        line.strip()
        for p in sorted(data.glob("genome*.seq"))
        for line in p.read_text().splitlines()
    )
    assert dna == genomes
    # video: whole frames, equal to the clip's frames
    video = [d for s in samples for d in decode_sample(m, s) if d.modality == "video"]
    frames = np.concatenate([d.data for d in video])
    np.testing.assert_array_equal(frames, true_frames(data))
    # audio: the speech file's samples (plus the fake interleaved audio of the clip)
    speech = np.frombuffer((data / "speech.snd").read_bytes(), np.uint8)
    wave = np.concatenate(
        [d.data for s in samples for d in decode_sample(m, s) if d.modality == "audio"]
    )
    assert len(wave) == len(speech) + 2 * (20 // VIDEO["chunk_frames"])
    assert "audio" in decoded
    png = tmp_path / "s.png"
    assert inspect_dataset(str(out), sample=0, png=str(png)) == 0
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600
    assert image.std() > 0.05  # not a blank canvas


def decoded_dna(m: Manifest, sample) -> str:
    (d,) = [d for d in decode_sample(m, sample) if d.modality == "dna"] or [None]
    return d.data if d is not None else ""


def test_frames_cut_at_sample_boundaries_are_dropped_not_garbled(tmp_path):
    """With samples shorter than the clip, each sample shows only whole frames, in order."""
    data = make_inputs(tmp_path, n_dna=0, bad=False)
    out = tmp_path / "out"
    prepare(load_pipeline_config(write_pipeline(tmp_path, str(out), seq_len=50, workers=1)))
    m = Manifest.load(str(out))
    truth = [f.tobytes() for f in true_frames(data)]
    seen = []
    for k in range(m.num_samples):
        s, _ = load_sample(open_target(str(out)), k)
        for d in decode_sample(m, s):
            if d.modality == "video":
                assert not d.error
                seen += [f.tobytes() for f in d.data]
    assert seen and all(f in truth for f in seen)
    idx = [truth.index(f) for f in seen]
    assert idx == sorted(idx) and len(set(idx)) == len(idx)


def test_missing_tokenizer_is_named_in_the_figure(dataset, tmp_path):
    _, out = dataset
    m = Manifest.load(str(out))
    m.tokenizers["video"] = {
        **m.tokenizers["video"],
        "spec_sha256": "0" * 64,
        "artifact_sha256": "1" * 64,
    }
    m.tokenizers["audio"] = {**m.tokenizers["audio"], "spec_sha256": "0" * 64, "kind": "gone-kind"}
    with pytest.raises(LookupError, match="learned artifact"):
        find_tokenizer(m, "video")
    s, _ = load_sample(open_target(str(out)), 0)  # the clip (with audio) and DNA
    decoded = {d.modality: d for d in decode_sample(m, s)}
    assert set(decoded) == {"dna", "audio", "video"}
    assert decoded["video"].error.startswith("video tokenizer not available: no spec file")
    assert "unknown tokenizer kind 'gone-kind'" in decoded["audio"].error
    assert decoded["dna"].data and not decoded["dna"].error
    png = tmp_path / "missing.png"
    render_png(str(png), s, m.token_space, list(decoded.values()))
    assert matplotlib.image.imread(png).shape[0] > 300


def test_inspect_a_shard_with_and_without_its_manifest(dataset, tmp_path, capsys):
    _, out = dataset
    assert inspect_dataset(str(out / "shard-000000.tar"), sample=1) == 0
    text = capsys.readouterr().out
    assert "dataset fake" in text and "sample 1 (shard-000000.tar #1)" in text
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(out / "shard-000000.tar", lone / "shard-000000.tar")
    png = tmp_path / "lone.png"
    assert inspect_dataset(str(lone / "shard-000000.tar"), sample=0, png=str(png)) == 0
    text = capsys.readouterr().out
    assert "no manifest.json beside it" in text and png.is_file()
    s, _ = load_sample(open_target(str(lone / "shard-000000.tar")), 0)
    assert set(modality_tokens(s, Manifest.load(str(out)).token_space)) <= {"dna", "audio", "video"}


def test_cli_inspect(dataset, tmp_path, capsys):
    _, out = dataset
    png = tmp_path / "cli.png"
    assert main(["inspect", str(out), "--sample", "1", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["inspect", str(out), "--sample", "99"]) == 2  # a user error: one line, exit 2
    assert "sample 99 is not in this dataset" in capsys.readouterr().err
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    shard = bad / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:-512])
    with pytest.raises(ShardIntegrityError, match="truncated or replaced"):
        inspect_dataset(str(bad), sample=0)
