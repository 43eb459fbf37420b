"""Shard format (tar + .npy, readable by `tar` and webdataset, reproducible, size rollover),
the manifest (round trip, validation, sha256 verification) and atomic storage."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import fsspec
import numpy as np
import pytest
import webdataset as wds
from conftest import tar_of

from ulysses_mm.core import storage
from ulysses_mm.core.format import PackedSample, ShardFormatError
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.shards.manifest import (
    InputEntry,
    Manifest,
    ManifestError,
    ShardEntry,
    ShardIntegrityError,
    read_verified_shard,
    verify_shard_bytes,
)
from ulysses_mm.shards.pack import DocumentBlock, pack
from ulysses_mm.shards.reader import iter_samples, read_samples
from ulysses_mm.shards.writer import ShardRecord, ShardWriter, encode_sample

SPACE = TokenSpace.from_vocab({"dna": 16, "audio": 256})


def make_samples(seed: int = 0, n_docs: int = 60, seq_len: int = 300) -> list[PackedSample]:
    rng = np.random.default_rng(seed)
    docs, mods = [], []
    for _ in range(n_docs):
        m = int(rng.integers(2))
        r = SPACE.ranges[m]
        body = rng.integers(r.start, r.stop, int(rng.integers(1, 200)))
        docs.append(np.concatenate([[DOC_START, SPACE.boundary_token(r.name)], body, [DOC_END]]))
        mods.append(m)
    block = DocumentBlock.from_documents(docs, mods, SPACE.dtype())
    return list(pack([block], seq_len, SPACE.dtype()))


def write_shards(directory: Path, samples, **kw) -> list[ShardRecord]:
    def publish(tmp: Path, record: ShardRecord) -> None:
        storage.Location(str(directory / record.name)).publish(tmp)

    writer = ShardWriter(directory, publish, **kw)
    for s in samples:
        writer.write(s)
    return writer.close()


def test_shards_round_trip_and_roll_over(tmp_path: Path):
    samples = make_samples()
    records = write_shards(tmp_path, samples, max_bytes=2 * 10240)
    assert len(records) > 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [r.name for r in records]  # no temps
    first = 0
    back = []
    for r in records:
        data = (tmp_path / r.name).read_bytes()
        assert len(data) == r.bytes <= 2 * 10240
        assert hashlib.sha256(data).hexdigest() == r.sha256
        assert r.first_sample == first
        first += r.samples
        back += read_samples(data, r.name)
    assert first == len(samples)
    for a, b in zip(samples, back):
        assert a.index == b.index
        assert a.tokens.dtype == b.tokens.dtype == np.uint16
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.segments, b.segments)
    # max_samples rolls over too
    other = tmp_path / "by_count"
    records = write_shards(other, samples, max_samples=3)
    assert [r.samples for r in records[:-1]] == [3] * (len(records) - 1)


def test_one_oversized_sample_still_gets_a_shard(tmp_path: Path):
    samples = make_samples(seq_len=20000)
    records = write_shards(tmp_path, samples, max_bytes=1000)
    assert [r.samples for r in records] == [1] * len(samples)


def test_plain_tar_lists_members(tmp_path: Path):
    samples = make_samples()[:2]
    (record,) = write_shards(tmp_path, samples)
    names = subprocess.run(
        ["tar", "-tf", str(tmp_path / record.name)], check=True, capture_output=True, text=True
    ).stdout.split()
    assert names == [
        "000000000.segments.npy",
        "000000000.tokens.npy",
        "000000001.segments.npy",
        "000000001.tokens.npy",
    ]
    # fixed header fields: no timestamps, no uid/gid of whoever ran it
    with tarfile.open(tmp_path / record.name) as tar:
        assert {(m.mtime, m.uid, m.gid, m.uname) for m in tar.getmembers()} == {
            (0, 0, 0, "ulysses")
        }


def test_webdataset_reads_shards_decoding_npy_only(tmp_path: Path):
    samples = make_samples()
    records = write_shards(tmp_path, samples, max_bytes=2 * 10240)
    urls = [str(tmp_path / r.name) for r in records]
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode()
    got = list(ds)
    assert [int(s["__key__"]) for s in got] == [s.index for s in samples]
    for want, s in zip(samples, got):
        assert set(k for k in s if not k.startswith("__")) == {"tokens.npy", "segments.npy"}
        np.testing.assert_array_equal(s["tokens.npy"], want.tokens)
        np.testing.assert_array_equal(s["segments.npy"], want.segments)


def test_same_samples_same_bytes(tmp_path: Path):
    a = write_shards(tmp_path / "a", make_samples(3), max_bytes=2 * 10240)
    b = write_shards(tmp_path / "b", make_samples(3), max_bytes=2 * 10240)
    assert [r.sha256 for r in a] == [r.sha256 for r in b]
    for r in a:
        assert (tmp_path / "a" / r.name).read_bytes() == (tmp_path / "b" / r.name).read_bytes()


def test_shard_bytes_are_those_of_webdataset_tarwriter(tmp_path: Path):
    """The writer uses the standard library (webdataset imports torch), byte for byte what
    webdataset's TarWriter writes with fixed header fields."""
    samples = make_samples(5)
    (record,) = write_shards(tmp_path, samples, max_bytes=1 << 30)
    buf = io.BytesIO()
    tw = wds.TarWriter(buf, encoder=False, mtime=0, user="ulysses", group="ulysses", mode=0o444)
    for sample in samples:
        tw.write(encode_sample(sample))
    tw.close()
    assert (tmp_path / record.name).read_bytes() == buf.getvalue()
    assert record.bytes == len(buf.getvalue())


def test_reader_rejects_bad_shards(tmp_path: Path):
    good = encode_sample(make_samples()[0])
    obj = io.BytesIO()
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    pickled = tar_of(
        {"000000000.tokens.npy": obj.getvalue(), "000000000.segments.npy": good["segments.npy"]}
    )
    with pytest.raises(
        ShardFormatError, match=r"s\.tar: 000000000\.tokens\.npy: not a plain \.npy"
    ):
        read_samples(pickled, "s.tar")
    missing = tar_of({"000000000.tokens.npy": good["tokens.npy"]})
    with pytest.raises(ShardFormatError, match=r"sample 000000000 lacks \['segments.npy'\]"):
        read_samples(missing, "s.tar")
    wrong = tar_of(
        {
            "000000000.tokens.npy": good["segments.npy"],
            "000000000.segments.npy": good["segments.npy"],
        }
    )
    with pytest.raises(ShardFormatError, match="expected unsigned"):
        read_samples(wrong, "s.tar")
    (record,) = write_shards(tmp_path, make_samples()[:2])
    data = (tmp_path / record.name).read_bytes()
    with pytest.raises(ShardFormatError, match=r"s\.tar"):
        list(iter_samples(io.BytesIO(data[:1500]), "s.tar"))
    with pytest.raises(ShardFormatError, match="not a tar file"):
        read_samples(b"hello", "s.tar")


# ------------------------------------------------------------------- manifest


def make_manifest(tmp_path: Path) -> Manifest:
    samples = make_samples()
    records = write_shards(tmp_path, samples, max_bytes=2 * 10240)
    real = sum(s.real_tokens for s in samples)
    per_mod = np.zeros(2, np.int64)
    for s in samples:
        np.add.at(per_mod, s.segments[:, 2], s.segments[:, 1])
    m = Manifest(
        name="t",
        token_space=SPACE,
        tokenizers={"dna": {"name": "x", "spec_sha256": "0" * 64}},
        seq_len=300,
        shards=[
            ShardEntry(
                url=r.name,
                samples=r.samples,
                first_sample=r.first_sample,
                bytes=r.bytes,
                sha256=r.sha256,
            )
            for r in records
        ],
        inputs=[
            InputEntry("a.fa", "ok", modality="dna", documents=60, tokens=real),
            InputEntry("b.fa", "skipped", reason="empty file"),
        ],
        num_documents=60,
        tokens={"dna": int(per_mod[0]), "audio": int(per_mod[1])},
        pad_tokens=len(samples) * 300 - real,
        config={"pack": {"seq_len": 300}},
    )
    m.save(str(tmp_path / "manifest.json"))
    return m


def test_manifest_round_trip_and_verified_reads(tmp_path: Path):
    m = make_manifest(tmp_path)
    back = Manifest.load(str(tmp_path))  # a directory works too
    assert back == m
    assert back.to_json() == (tmp_path / "manifest.json").read_bytes()
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["format_version"] == 1 and data["dtype"] == "uint16"
    assert data["inputs"][1] == {"source": "b.fa", "status": "skipped", "reason": "empty file"}
    total = 0
    for i, entry in enumerate(back.shards):
        total += len(read_samples(read_verified_shard(back, i), entry.url))
    assert total == back.num_samples
    assert back.shard_of_sample(back.shards[1].first_sample) == (1, 0)
    back.check_token_space(SPACE)
    with pytest.raises(ManifestError, match="differs from the model's"):
        back.check_token_space(TokenSpace.from_vocab({"dna": 16}))


def test_corrupt_or_truncated_shards_are_refused(tmp_path: Path):
    m = make_manifest(tmp_path)
    path = tmp_path / m.shards[0].url
    data = bytearray(path.read_bytes())
    data[700] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(
        ShardIntegrityError, match=r"shard-000000\.tar: sha256 .* the manifest says"
    ):
        read_verified_shard(Manifest.load(str(tmp_path / "manifest.json")), 0)
    with pytest.raises(ShardIntegrityError, match="truncated or replaced"):
        verify_shard_bytes(m.shards[0], bytes(data[:-10]))
    (tmp_path / m.shards[1].url).unlink()
    with pytest.raises(ShardIntegrityError, match="cannot read shard"):
        read_verified_shard(m, 1)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("seq_len"), "missing key 'seq_len'"),
        (lambda d: d.update(format="other"), "format is 'other'"),
        (lambda d: d.update(format_version=99), "format_version 99 is not supported"),
        (lambda d: d.update(dtype="uint8"), "dtype 'uint8' does not match"),
        (lambda d: d["shards"][0].update(sha256="xyz"), "is not 64 hex digits"),
        (lambda d: d["shards"][1].update(first_sample=99), "starts at sample 99"),
        (lambda d: d.update(pad_tokens=d["pad_tokens"] + 1), r"tokens .* \+ pad .* != num_samples"),
        (lambda d: d.update(num_documents=3), "num_documents says 3"),
        (lambda d: d["token_space"]["modalities"][0].update(start=9), "token_space"),
        (lambda d: d.update(seq_len="300"), "seq_len must be int"),
        (lambda d: d["inputs"][0].pop("source"), "malformed shard or input entry"),
    ],
)
def test_manifest_validation_names_the_file(tmp_path: Path, edit, message):
    make_manifest(tmp_path)
    path = tmp_path / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=message) as e:
        Manifest.load(str(path))
    assert str(path) in str(e.value)


def test_manifest_unreadable_or_not_json(tmp_path: Path):
    with pytest.raises(ManifestError, match=r"cannot read manifest .*nope"):
        Manifest.load(str(tmp_path / "nope"))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.load(str(tmp_path / "manifest.json"))


def test_manifest_and_shards_over_fsspec_memory(tmp_path: Path):
    local = tmp_path / "local"
    m = make_manifest(local)
    url = "memory://ulysses-test-shards/ds"
    for s in m.shards:
        storage.Location(f"{url}/{s.url}").publish(_copy(local / s.url, tmp_path))
    m.save(f"{url}/manifest.json")
    back = Manifest.load(f"{url}/manifest.json")
    assert back == m
    assert back.shard_location(0) == f"{url}/{m.shards[0].url}"
    assert read_verified_shard(back, 0) == (local / m.shards[0].url).read_bytes()
    names = storage.Location(url).list_names()
    assert names == sorted([s.url for s in m.shards] + ["manifest.json"])
    fsspec.filesystem("memory").rm("/ulysses-test-shards", recursive=True)


def _copy(path: Path, tmp_path: Path) -> Path:
    dst = tmp_path / ("copy-" + path.name)
    shutil.copy(path, dst)
    return dst


# -------------------------------------------------------------------- storage


def test_atomic_write_and_stale_temp_cleanup(tmp_path: Path):
    target = tmp_path / "d" / "x.json"
    storage.Location(str(target)).atomic_write(b"one")
    storage.Location(str(target)).atomic_write(b"two")
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.json"]
    stale = target.parent / storage.temp_name("shard-000001.tar")
    stale.write_bytes(b"partial")
    (target.parent / ".hidden-but-not-ours").write_bytes(b"keep")
    assert storage.Location(str(target.parent)).remove_stale_temps() == 1
    assert sorted(p.name for p in target.parent.iterdir()) == [".hidden-but-not-ours", "x.json"]


def test_expand_sources(tmp_path: Path):
    for name in ["a.fa", "b.fa.gz", "c.gb", "sub/d.fa", "sub/.e.fa", "f.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(">x\nACGT\n")
    files, unmatched = storage.expand_sources(
        [str(tmp_path / "*.{fa,gb}"), str(tmp_path / "**/*.fa"), str(tmp_path / "nothing/*.fa")]
    )
    assert files == sorted(str(tmp_path / n) for n in ["a.fa", "c.gb", "sub/d.fa"])
    assert unmatched == [str(tmp_path / "nothing/*.fa")]
    files, _ = storage.expand_sources([str(tmp_path / "sub")])
    assert files == [str(tmp_path / "sub/d.fa")]
    fs = fsspec.filesystem("memory")
    fs.pipe("/ulysses-test-src/x/a.fa", b">a\nAC\n")
    fs.pipe("/ulysses-test-src/x/b.wav", b"RIFF")
    files, _ = storage.expand_sources(["memory://ulysses-test-src/x/*.fa"])
    assert files == [fs.unstrip_protocol("/ulysses-test-src/x/a.fa")]
    assert storage.list_inputs(files)[0][0].identity["size"] == 6
    fs.rm("/ulysses-test-src", recursive=True)
