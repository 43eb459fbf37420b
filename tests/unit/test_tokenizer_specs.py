"""Every shipped spec loads and builds its tokenizer; every real shared file is tokenised by
the matching tokenizer or fails with a true DecodeError reason."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import require_fixture
from media_factory import SHARED_DATA, TOKENIZERS

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.tokenize.base import DecodeError, TokenizerSpec, build_token_space
from ulysses_mm.tokenize.registry import kinds, load_tokenizer

SPECS = sorted(TOKENIZERS.glob("*.json"))


def test_tokenizers_dir_is_data_only() -> None:
    assert not (TOKENIZERS / "__init__.py").exists()  # would shadow HF `tokenizers`
    assert not list(TOKENIZERS.glob("*.py"))
    names = {p.stem for p in SPECS}
    assert {"dna-base", "audio-mulaw-16k", "video-vq", "video-vq-av"} <= names
    assert set(kinds()) >= {"dna-base", "audio-mulaw", "video-vq"}


@pytest.mark.parametrize("path", SPECS, ids=[p.name for p in SPECS])
def test_every_spec_loads(path: Path) -> None:
    raw = json.loads(path.read_text())
    spec = TokenizerSpec.load(path)  # checks the artifact's sha256
    assert spec.name == path.stem == raw["name"]
    assert raw.get("description"), "a spec says what it is"
    tok = load_tokenizer(spec)
    assert tok.modality == spec.modality
    if spec.artifact is not None:
        art = spec.artifact_path()
        assert art.parent == TOKENIZERS.resolve() and art.stat().st_size < 1_000_000
        assert spec.artifact_sha256  # learned state is pinned by hash
    assert not [v for v in _strings(raw) if Path(v).is_absolute()], "specs name no machine paths"
    # the dataset's token space: this spec's modality plus any it interleaves
    space = build_token_space([spec, *tok.companion_specs()])
    assert space.range(spec.modality).size == spec.vocab_size


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_one_space_for_all_modalities() -> None:
    specs = [
        TokenizerSpec.load(TOKENIZERS / f"{n}.json")
        for n in ("dna-base", "audio-mulaw-16k", "video-vq")
    ]
    space = build_token_space(specs)
    assert space.vocab() == {"dna": 10, "audio": 256, "video": 256}
    assert space.dtype() == np.uint16


# --------------------------------------------------------------------------- real files
SHARED = sorted(SHARED_DATA.glob("*")) if SHARED_DATA.is_dir() else []
DNA_EXT = (".fa", ".fa.gz", ".fastq", ".fastq.gz", ".gb")
AUDIO_EXT = (".wav", ".flac", ".ogg", ".mp3")
VIDEO_EXT = (".mp4", ".webm")

# Real files that must fail, and the reason they must give.
EXPECTED_FAILURES = {
    ("video", "vibe_ace_music.ogg"): "no video stream (only a cover-art picture)",
}


def _capped(name: str, **params: object):
    spec = TokenizerSpec.load(TOKENIZERS / f"{name}.json")
    return load_tokenizer(dataclasses.replace(spec, params={**spec.params, **params}))


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, object]:
    # caps keep the test fast: 3 s of audio, 4 frames of video (the decoders still open,
    # probe and check the whole file)
    return {
        "dna": load_tokenizer(TOKENIZERS / "dna-base.json"),
        "audio": _capped("audio-mulaw-16k", max_seconds=3.0),
        "video": _capped("video-vq", max_frames=4),
    }


def _jobs() -> list[tuple[str, Path]]:
    jobs = []
    for p in SHARED:
        n = p.name
        if n.endswith(DNA_EXT):
            jobs.append(("dna", p))
        if n.endswith(AUDIO_EXT + VIDEO_EXT):
            jobs.append(("audio", p))  # a clip's audio track too
        if n.endswith(VIDEO_EXT + AUDIO_EXT):
            jobs.append(("video", p))  # audio-only files must say they have no video
    return jobs


def test_real_files_are_known() -> None:
    """Every real file is routed to some tokenizer (so the test below misses none)."""
    require_fixture(bool(SHARED), f"the shared real-data folder {SHARED_DATA}")
    routed = {p for _, p in _jobs()}
    assert [p.name for p in SHARED if p not in routed] == ["MANIFEST.md"]


@pytest.mark.parametrize(("modality", "path"), _jobs(), ids=[f"{m}-{p.name}" for m, p in _jobs()])
def test_every_real_file(tokenizers: dict, modality: str, path: Path) -> None:
    tok = tokenizers[modality]
    space = TokenSpace.from_vocab({modality: tok.spec.vocab_size})
    expected_failure = EXPECTED_FAILURES.get((modality, path.name))
    is_audio_only = modality == "video" and path.name.endswith(AUDIO_EXT)
    if expected_failure or is_audio_only:
        reason = expected_failure or "no video stream (streams: audio"
        with pytest.raises(DecodeError) as e:
            list(tok.encode_file(str(path), space))
        assert str(e.value).startswith(f"{path}: {reason}"), str(e.value)
        return
    docs = list(tok.encode_file(str(path), space))
    assert docs
    r = space.range(modality)
    for d in docs:
        t = d.tokens
        assert t[0] == DOC_START and t[1] == space.boundary_token(modality) and t[-1] == DOC_END
        body = t[2:-1]
        assert ((body >= r.start) & (body < r.stop) | (body == 3)).all()
    if modality == "audio":
        assert len(docs[0].tokens) - 3 == pytest.approx(3.0 * 16000, abs=2)
        codes = np.unique(docs[0].tokens[2:-1])
        assert len(codes) > 20  # real sound, not silence or a constant
    if modality == "video":
        assert tok.decode(docs[0].tokens, space).shape == (4, 256, 256, 3)
    if modality == "dna":
        assert len({d.key for d in docs}) == len(docs)
        assert sum(len(d.tokens) - 3 for d in docs) > 1000
