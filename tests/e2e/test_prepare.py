"""``prepare`` end to end with fake tokenizers (tests/helpers/pipeline_fakes.py): every document
lands in the shards, bad inputs are skipped with reasons, all-bad is an error, equal
inputs give equal bytes, a SIGKILLed run restarted gives the bytes of an uninterrupted
one, and outputs go to fsspec URLs (memory://, and S3 on a local moto server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
from conftest import require_fixture
from pipeline_fakes import (
    KINDS,
    VIDEO,
    expected_documents,
    files_of,
    make_inputs,
    write_pipeline,
    write_spec,
)

from ulysses_mm.config import PipelineConfig
from ulysses_mm.core import storage
from ulysses_mm.core.storage import Location
from ulysses_mm.shards.manifest import Manifest, read_verified_shard
from ulysses_mm.shards.prepare.route import route
from ulysses_mm.shards.prepare.run import PrepareError, load_pipeline_config, prepare
from ulysses_mm.shards.reader import read_samples
from ulysses_mm.tokenize import registry
from ulysses_mm.tokenize.base import TokenizerSpec, build_token_space

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SHARED_DATA = REPO.parent / "shared" / "data"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS / "helpers")])}


def config(root: Path, output: str, overrides: list[str] = (), **kw) -> PipelineConfig:  # type: ignore[assignment]
    return load_pipeline_config(write_pipeline(root, output, **kw), list(overrides))


def rebuild_documents(m: Manifest) -> dict[int, np.ndarray]:
    pieces: dict[int, list[np.ndarray]] = {}
    for i in range(len(m.shards)):
        for s in read_samples(read_verified_shard(m, i)):
            for start, length, _, doc, _ in s.segments.tolist():
                pieces.setdefault(doc, []).append(s.tokens[start : start + length])
    return {d: np.concatenate(p) for d, p in pieces.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """One uninterrupted run: (root with inputs and pipeline, output directory)."""
    root = tmp_path_factory.mktemp("reference")
    make_inputs(root)
    out = root / "out"
    prepare(config(root, str(out)))
    return root, out


def test_every_document_is_packed_and_bad_inputs_are_recorded(reference, capsys):
    root, out = reference
    m = Manifest.load(str(out / "manifest.json"))
    assert sorted(files_of(out)) == sorted([s.url for s in m.shards] + ["manifest.json"])
    assert not (root / "out.staging").exists()  # staging removed after success

    status = {Path(e.source).name: e for e in m.inputs}
    reasons = {n: e.reason for n, e in status.items() if e.status == "skipped"}
    assert reasons == {
        "corrupt.seq": "line 2: illegal character 'X'",
        "empty.seq": "empty file",
        "truncated.vid": "truncated: 37 bytes is not a whole number of 16-token frames",
        "notes.txt": "unsupported file type .txt: no tokenizer for it in this pipeline "
        "(modalities ['dna', 'audio', 'video'])",
        "buggy.seq": "unexpected RuntimeError: fake tokenizer bug",
        "*.seq": "matches no file",
    }

    # documents, rebuilt from the shards alone, are the inputs' documents in sorted order
    space = build_token_space([TokenizerSpec.load(p) for p in m.config["tokenizers"]])
    assert space == m.token_space
    vocab = {"dna": 5, "audio": 256, "video": 64}
    docs = rebuild_documents(m)
    assert sorted(docs) == list(range(m.num_documents))
    doc_id = 0
    per_mod = dict.fromkeys(space.modalities, 0)
    ok = [e for e in m.inputs if e.status == "ok"]
    assert [e.source for e in ok] == sorted(e.source for e in ok)
    for e in ok:
        want = expected_documents(Path(e.source), e.modality, space, vocab[e.modality], **VIDEO)
        assert e.first_doc_id == doc_id and e.documents == len(want)
        assert e.tokens == sum(len(w) for w in want)
        for w in want:
            np.testing.assert_array_equal(docs[doc_id], w)
            doc_id += 1
        per_mod[e.modality] += e.tokens
    assert m.tokens == per_mod
    assert m.pad_tokens == m.num_samples * m.seq_len - sum(per_mod.values()) < m.seq_len
    assert len(m.shards) > 1 and all(s.bytes <= 20480 for s in m.shards)
    # run-specific settings are not recorded; what shapes the data is
    assert "output" not in m.config and "workers" not in m.config
    assert m.config["pack"] == {"seq_len": 512} and m.config["name"] == "fake"


def test_same_inputs_give_the_same_bytes(reference, tmp_path):
    root, out = reference
    again = tmp_path / "again"
    result = prepare(config(root, str(again), [f"output={again}", "workers=1"]))
    assert result.reused == 0
    assert files_of(again) == files_of(out)


def test_all_inputs_bad_is_an_error(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.seq").write_text("")
    (d / "b.seq").write_text("NOPE\n")
    out = tmp_path / "out"
    with pytest.raises(PrepareError, match=r"every input failed \(3 inputs\).*a\.seq: empty file"):
        prepare(config(tmp_path, str(out)))
    assert not (out / "manifest.json").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "ulysses_mm", "prepare", str(tmp_path / "pipeline.yaml")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        "every input failed" in proc.stderr
        and "b.seq: line 1: illegal character 'O'" in proc.stderr
    )
    assert not (out / "manifest.json").exists()


def test_all_inputs_bad_leaves_nothing_behind(tmp_path):
    """No dataset, no trace: neither the output folder (nor its parents) this run made,
    nor the staging cache; the error is one line. A folder that was there stays."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.seq").write_text("")
    (d / "b.seq").write_text("NOPE\n")
    out = tmp_path / "new" / "out"
    with pytest.raises(PrepareError) as err:
        prepare(config(tmp_path, str(out)))
    assert "\n" not in str(err.value) and "every input failed (3 inputs)" in str(err.value)
    assert not (tmp_path / "new").exists()
    assert not (tmp_path / "new" / "out.staging").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "pipeline.yaml", "tok"]

    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(PrepareError, match="every input failed"):
        prepare(config(tmp_path, str(kept)))
    assert kept.is_dir() and not any(kept.iterdir())
    assert not (tmp_path / "kept.staging").exists()

    proc = subprocess.run(
        [sys.executable, "-m", "ulysses_mm", "prepare", str(tmp_path / "pipeline.yaml")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not kept.with_suffix(".staging").exists() and not any(kept.iterdir())


def test_bad_pipeline_is_a_clear_error(tmp_path):
    with pytest.raises(PrepareError, match="no output"):
        prepare(PipelineConfig(sources=["x"], tokenizers=["y"]))
    with pytest.raises(PrepareError, match=r"tokenizer spec .*missing\.json"):
        prepare(
            PipelineConfig(sources=["x"], tokenizers=[str(tmp_path / "missing.json")], output="o")
        )
    write_spec(tmp_path, "odd", "dna", "no-such-kind", 5)
    with pytest.raises(PrepareError, match="unknown kind 'no-such-kind'"):
        prepare(PipelineConfig(sources=["x"], tokenizers=[str(tmp_path / "odd.json")], output="o"))


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"prepare ended before it could be killed: {proc.communicate()}")
        if time.monotonic() > end:
            raise AssertionError("trigger never appeared")
        time.sleep(0.01)


@pytest.mark.parametrize("trigger", ["staged", "shard"])
def test_killed_run_restarted_gives_identical_output(reference, tmp_path, trigger):
    """SIGKILL `ulysses-mm prepare` (and its workers) mid-run, run again: same bytes, no
    duplicate or lost document, no partial shard."""
    _, ref_out = reference
    make_inputs(tmp_path)
    out = tmp_path / "out"
    # the reference's data, made slow; delay_s changes the spec hash in the manifest, so the
    # manifest is compared with an uninterrupted run of this very pipeline
    path = write_pipeline(tmp_path, str(out), delay_s=0.25, workers=1)
    staging = tmp_path / "out.staging" / "documents" / "part-00000"

    def fired() -> bool:
        if trigger == "staged":
            return staging.is_dir() and any(p.suffix == ".json" for p in staging.iterdir())
        return out.is_dir() and any(p.name.startswith("shard-") for p in out.iterdir())

    proc = subprocess.Popen(
        [sys.executable, "-m", "ulysses_mm", "prepare", str(path)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: the pool goes down with it
    )
    try:
        _wait_for(fired, proc)
        time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists(), "the run finished before the kill"

    result = prepare(load_pipeline_config(path))
    assert result.reused >= 1  # finished staged entries were kept
    expected = tmp_path / "expected"
    prepare(load_pipeline_config(path, [f"output={expected}", "workers=2"]))
    assert files_of(out) == files_of(expected)
    # and apart from the spec hash of the slowed tokenizer, it is the reference dataset
    a, b = Manifest.load(str(out)), Manifest.load(str(ref_out))
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
    assert not (tmp_path / "out.staging").exists()


def test_rerun_with_fewer_shards_removes_stale_ones(tmp_path):
    make_inputs(tmp_path, bad=False)
    out = tmp_path / "out"
    first = prepare(config(tmp_path, str(out), seq_len=256)).manifest
    second = prepare(config(tmp_path, str(out), seq_len=4096)).manifest
    assert len(second.shards) < len(first.shards)
    assert sorted(files_of(out)) == sorted([s.url for s in second.shards] + ["manifest.json"])


def test_a_crashing_worker_costs_one_input(tmp_path):
    make_inputs(tmp_path, n_dna=2, bad=False)
    (tmp_path / "data" / "crash.seq").write_text("ACGT\nCRASH\n")
    result = prepare(config(tmp_path, str(tmp_path / "out")))
    status = {Path(e.source).name: (e.status, e.reason) for e in result.manifest.inputs}
    assert status["crash.seq"] == (
        "skipped",
        "the worker process died while decoding this file (crash or out of memory)",
    )
    assert [n for n, (s, _) in status.items() if s == "ok"] == [
        "clip.vid",
        "genome00.seq",
        "genome01.seq",
        "speech.snd",
    ]


def test_output_to_an_fsspec_memory_url(reference, tmp_path):
    root, out = reference
    url = "memory://ulysses-prepare-test/ds"
    prepare(config(root, url, [f"output={url}", f"staging={tmp_path / 'stage'}"]))
    fs = fsspec.filesystem("memory")
    try:
        remote = {
            p.rsplit("/", 1)[-1]: fs.cat_file(p)
            for p in fs.ls("/ulysses-prepare-test/ds", detail=False)
        }
        assert remote == files_of(out)
        m = Manifest.load(f"{url}/manifest.json")
        assert read_verified_shard(m, 0) == (out / m.shards[0].url).read_bytes()
    finally:
        fs.rm("/ulysses-prepare-test", recursive=True)
    assert not (tmp_path / "stage").exists()


def test_s3_sources_and_output_on_a_local_moto_server(reference, tmp_path, s3_server):
    root, out = reference
    opts = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    fs = fsspec.filesystem("s3", **opts)
    fs.mkdir("ulysses-test")
    for p in sorted((root / "data").iterdir()):
        fs.put_file(str(p), f"ulysses-test/in/{p.name}")
    overrides = [
        "sources=[s3://ulysses-test/in/*, missing/*.seq]",
        "output=s3://ulysses-test/ds",
        f"staging={tmp_path / 'stage'}",
        f"storage_options={json.dumps(opts)}",
    ]
    result = prepare(config(root, "unused", overrides, workers=2))
    m = Manifest.load(Location("s3://ulysses-test/ds/manifest.json", opts))
    assert [e.source.rsplit("/", 1)[-1] for e in m.inputs] == [
        e.source.rsplit("/", 1)[-1] for e in Manifest.load(str(out)).inputs
    ]
    # same shards as the local run; no temporary object left behind
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ulysses-test/ds", detail=False))
    assert names == sorted(files_of(out))
    for s in m.shards:
        assert read_verified_shard(m, s) == (out / s.url).read_bytes()
    assert "storage_options" not in m.config  # credentials never land in the manifest
    assert result.location == "s3://ulysses-test/ds/manifest.json"


BUILTIN_KINDS = {"dna": "dna-base", "audio": "audio-mulaw", "video": "video-vq"}


def kinds(*modalities: str) -> dict[str, str]:
    """A pipeline of the shipped tokenizers for ``modalities``: modality -> kind."""
    return {m: BUILTIN_KINDS[m] for m in modalities}


def test_routing_by_suffix():
    mods = kinds("dna", "audio", "video")
    assert route("/x/y/genome.FA.GZ", mods, {}) == "dna"
    assert route("s3://b/reads.fastq", mods, {}) == "dna"
    assert route("clip.mp4", mods, {}) == "video"
    assert route("clip.mp4", kinds("dna", "audio"), {}) == "audio"  # its sound track
    assert route("song.mp3", kinds("dna", "video"), {}) is None
    assert route("notes.seq", mods, {"dna": [".seq"]}) == "dna"
    assert route("notes.txt", mods, {}) is None


def test_routing_table_is_declared_per_tokenizer_kind():
    """The suffixes come from the kind a pipeline's tokenizer is registered as: a kind
    registered without suffixes gets inputs only through the pipeline's own table."""
    registry.register_kind("test-lines", KINDS["test-lines"])  # as a pipeline registers it
    assert route("genome.fa", {"dna": "test-lines"}, {}) is None
    assert route("genome.seq", {"dna": "test-lines"}, {"dna": [".seq"]}) == "dna"
    registry.register_kind("test-suffixed", "pipeline_fakes:LinesTokenizer", [".Lines"])
    assert route("x/a.lines", {"dna": "test-suffixed"}, {}) == "dna"
    assert route("x/a.fa", {"dna": "test-suffixed"}, {}) is None
    # the order of the pipeline's tokenizers does not decide: a container's claimant wins
    assert route("clip.webm", {"audio": "audio-mulaw", "video": "video-vq"}, {}) == "video"


# ---------------------------------------------------------------- shipped pipelines


def _specs_present(pipeline: Path) -> bool:
    cfg = load_pipeline_config(pipeline)
    return all(Path(t).is_file() for t in cfg.tokenizers) and bool(
        storage.expand_sources(cfg.sources)[0]
    )


@pytest.mark.parametrize("name", ["dna", "audio", "video", "mixed"])
def test_shipped_pipeline_runs_on_the_sample_data(name, tmp_path):
    pipeline = REPO / "pipelines" / f"{name}.yaml"
    require_fixture(_specs_present(pipeline), f"the specs and sample files of {pipeline.name}")
    result = prepare(
        load_pipeline_config(
            pipeline, [f"output={tmp_path / 'out'}", "pack.seq_len=65536", "workers=2"]
        )
    )
    m = result.manifest
    assert m.num_samples >= 1 and any(e.status == "ok" for e in m.inputs)
    assert all(e.reason for e in m.skipped)


def test_dna_pipeline_on_the_shared_data(tmp_path):
    pipeline = REPO / "pipelines" / "dna.yaml"
    cfg = load_pipeline_config(pipeline)
    require_fixture(
        SHARED_DATA.is_dir() and all(Path(t).is_file() for t in cfg.tokenizers),
        f"{SHARED_DATA} or the DNA tokenizer spec",
    )
    sources = json.dumps([str(SHARED_DATA / "*.{fa,fa.gz,fastq,fastq.gz,gb}")])
    result = prepare(
        load_pipeline_config(
            pipeline, [f"sources={sources}", f"output={tmp_path / 'out'}", "workers=2"]
        )
    )
    ok = [e for e in result.manifest.inputs if e.status == "ok"]
    assert len(ok) >= 6 and result.manifest.tokens["dna"] > 8_000_000


def test_every_shared_file_goes_through_prepare(tmp_path):
    """All of ../shared/data through the mixed pipeline (video with its audio interleaved):
    each file is tokenised, or skipped with a reason that is true."""
    pipeline = REPO / "pipelines" / "mixed.yaml"
    av = REPO / "tokenizers" / "video-vq-av.json"
    require_fixture(SHARED_DATA.is_dir() and av.is_file(), f"{SHARED_DATA} or {av.name}")
    files = sorted(p for p in SHARED_DATA.iterdir() if p.is_file())
    tokenizers = json.dumps(
        [
            str(REPO / "tokenizers" / n)
            for n in ("dna-base.json", "audio-mulaw-16k.json", "video-vq-av.json")
        ]
    )
    result = prepare(
        load_pipeline_config(
            pipeline,
            [
                f"sources={json.dumps([str(p) for p in files])}",
                f"tokenizers={tokenizers}",
                f"output={tmp_path / 'out'}",
                "workers=2",
                "progress=false",
            ],
        )
    )
    entries = {Path(e.source).name: e for e in result.manifest.inputs}
    assert sorted(entries) == [p.name for p in files]  # every file is accounted for
    media = {".fa", ".gz", ".fastq", ".gb", ".wav", ".flac", ".ogg", ".mp3", ".mp4", ".webm"}
    for name, e in entries.items():
        if Path(name).suffix in media:
            assert e.status == "ok" and e.tokens > 0, (name, e.reason)
        else:  # MANIFEST.md: not a sequence or media file
            assert e.status == "skipped" and "unsupported file type .md" in e.reason, (
                name,
                e.reason,
            )
    kinds = {e.modality for e in entries.values() if e.status == "ok"}
    assert kinds == {"dna", "audio", "video"}
