"""``prepare`` at corpus scale: partitions packed on their own, the same bytes on the local
executor and on Ray with any number of workers, a Ray worker killed mid-partition, a driver
killed and rerun, a partition failing for a reason that is not an input, and inputs
streamed from S3 (a moto server on loopback). One local Ray for the module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from pipeline_fakes import VIDEO, expected_documents, files_of, make_inputs, write_pipeline

from ulysses_mm.core import storage
from ulysses_mm.core.format import SEG_LENGTH, SEG_MODALITY
from ulysses_mm.core.storage import Location
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.shards.manifest import Manifest, read_verified_shard
from ulysses_mm.shards.prepare.run import PrepareError, load_pipeline_config, prepare
from ulysses_mm.shards.reader import read_samples

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
PYTHONPATH = os.pathsep.join([str(REPO), str(TESTS / "helpers")])
ENV = {**os.environ, "PYTHONPATH": PYTHONPATH}
PARTS = ["shards.partitions=3", "progress=false"]


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray (2 CPUs) for the module; its workers import the fake tokenizers."""
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": PYTHONPATH}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(root with the inputs and a pipeline, its 3-partition dataset by the local executor,
    the same pipeline slowed down with the processes that read each input recorded)."""
    root = tmp_path_factory.mktemp("corpus")
    make_inputs(root)
    pipeline = write_pipeline(root, str(root / "local"))
    prepare(load_pipeline_config(pipeline, PARTS))
    slow = root / "slow"
    slow.mkdir()
    (slow / "pids").mkdir()
    write_pipeline(slow, str(slow / "expected"), delay_s=0.3, pid_dir=str(slow / "pids"))
    (slow / "data").symlink_to(root / "data")
    prepare(load_pipeline_config(slow / "pipeline.yaml", [*PARTS, "workers=2"]))
    return pipeline, root / "local", slow


def test_partitions_are_packed_on_their_own_and_read_back_whole(corpus):
    _, local, _ = corpus
    m = Manifest.load(str(local))
    parts = m.partitions
    assert parts is not None and len(parts) == 3
    assert sorted(files_of(local)) == sorted([s.url for s in m.shards] + ["manifest.json"])
    assert all(s.url.startswith(f"part-{s.partition:05d}/shard-") for s in m.shards)
    assert m.config["shards"]["partitions"] == 3  # recorded, since it shaped the data
    assert [p.inputs for p in parts] == [6, 5, 2] and sum(p.inputs for p in parts) == 13
    assert not (local.parent / "local.staging").exists() and not (local / "_partitions").exists()

    # every document, rebuilt from the shards with each partition's offsets, in input order
    space = m.token_space
    vocab = {"dna": 5, "audio": 256, "video": 64}
    docs: dict[int, list[np.ndarray]] = {}
    real = np.zeros((m.num_samples, len(space.modalities)), np.int64)
    for shard in m.shards:
        part = parts[shard.partition]
        samples = read_samples(read_verified_shard(m, shard))
        for k, s in enumerate(samples):
            assert s.index == shard.first_sample + k - part.first_sample  # keys count per partition
            np.add.at(
                real[shard.first_sample + k], s.segments[:, SEG_MODALITY], s.segments[:, SEG_LENGTH]
            )
            for start, length, _, doc, _ in s.segments.tolist():
                docs.setdefault(part.first_doc_id + doc, []).append(
                    s.tokens[start : start + length]
                )
    want = [
        w
        for e in m.inputs
        if e.status == "ok"
        for w in expected_documents(Path(e.source), e.modality, space, vocab[e.modality], **VIDEO)
    ]
    assert sorted(docs) == list(range(len(want))) == list(range(m.num_documents))
    for d, w in enumerate(want):
        np.testing.assert_array_equal(np.concatenate(docs[d]), w)
    ok = [e for e in m.inputs if e.status == "ok"]
    assert [e.first_doc_id for e in ok] == list(np.cumsum([0] + [e.documents for e in ok])[:-1])
    # each partition's last sample is padded: the per-sample counts still come from the manifest
    np.testing.assert_array_equal(m.sample_tokens(), real)
    assert m.pad_tokens == m.num_samples * m.seq_len - int(real.sum())

    # the loader reads every sample under its dataset-wide index
    stream = ShardStream(m, 0, 1, 1, StreamOptions(shuffle=False))
    seen = [stream.next_batch()[0] for _ in range(m.num_samples)]
    assert [s.index for s in seen] == list(range(m.num_samples))
    np.testing.assert_array_equal(
        np.stack([s.tokens for s in seen]).reshape(-1)[: m.seq_len * 2],
        np.concatenate([s.tokens for s in read_samples(read_verified_shard(m, 0))])[
            : m.seq_len * 2
        ],
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_ray_writes_the_local_executors_bytes_with_any_number_of_workers(
    ray_local, corpus, tmp_path, workers
):
    pipeline, local, _ = corpus
    out = tmp_path / "ray"
    result = prepare(
        load_pipeline_config(
            pipeline, [*PARTS, f"output={out}", "engine=ray", f"workers={workers}"]
        )
    )
    assert (result.executor, result.partitions) == ("ray", 3)
    assert files_of(out) == files_of(local)


def test_a_ray_worker_killed_mid_partition_is_retried_and_the_bytes_do_not_change(
    ray_local, corpus, tmp_path
):
    _, _, slow = corpus
    pids = slow / "pids"
    for p in pids.iterdir():
        p.unlink()
    out = tmp_path / "out"
    cfg = load_pipeline_config(slow / "pipeline.yaml", [*PARTS, f"output={out}", "engine=ray"])
    outcome: dict[str, object] = {}
    run = threading.Thread(target=lambda: outcome.update(result=prepare(cfg)), daemon=True)
    run.start()
    end = time.monotonic() + 120
    while not any(pids.iterdir()):
        assert run.is_alive() and time.monotonic() < end, "no partition started"
        time.sleep(0.02)
    victim = next(pids.iterdir()).name.split("-", 1)
    os.kill(int(victim[0]), signal.SIGKILL)  # the Ray worker, while it reads victim[1]
    assert run.is_alive()
    run.join(timeout=180)
    assert not run.is_alive() and "result" in outcome
    readers = [p.name.split("-", 1) for p in pids.iterdir()]
    assert len({pid for pid, name in readers if name == victim[1]}) == 2  # read again, elsewhere
    assert files_of(out) == files_of(slow / "expected")
    assert not outcome["result"].crashed  # type: ignore[attr-defined]


def test_an_input_that_kills_its_ray_worker_twice_is_skipped_as_on_the_local_executor(
    ray_local, tmp_path
):
    make_inputs(tmp_path, n_dna=2, bad=False)
    (tmp_path / "data" / "crash.seq").write_text("ACGT\nCRASH\n")
    pipeline = write_pipeline(tmp_path, str(tmp_path / "out"))
    entries = {}
    for executor in ("local", "ray"):
        cfg = load_pipeline_config(
            pipeline, ["progress=false", f"output={tmp_path / executor}", f"engine={executor}"]
        )
        result = prepare(cfg)
        assert [Path(c).name for c in result.crashed] == ["crash.seq"]
        entries[executor] = [e.to_dict() for e in result.manifest.inputs]
    assert entries["ray"] == entries["local"]
    assert files_of(tmp_path / "ray") == files_of(tmp_path / "local")


def test_an_input_a_ray_task_died_on_twice_is_skipped_even_as_its_first(tmp_path):
    """The partition function a Ray task runs, in this process: the first input it would
    tokenize has the attempts of two dead workers behind it, so it is recorded as crashed
    and the partition is packed from the rest."""
    from ulysses_mm.shards.prepare.executor import CRASHES_TO_SKIP, plan_partition, run_partition
    from ulysses_mm.shards.prepare.partition import Job, PartitionTask
    from ulysses_mm.shards.prepare.pool import WorkerConfig, loaded
    from ulysses_mm.shards.prepare.route import load_specs, staging_dir

    make_inputs(tmp_path, n_dna=2, bad=False)
    cfg = load_pipeline_config(write_pipeline(tmp_path, str(tmp_path / "out")))
    specs, space = load_specs(cfg)
    inputs, _ = storage.list_inputs(cfg.sources)
    worker = WorkerConfig(
        [s.path for s in specs],
        dict(cfg.tokenizer_kinds),
        space.to_dict(),
        cfg.output_location,
        os.getpid(),
    )
    job = Job(
        worker=worker,
        suffixes={m: list(v) for m, v in cfg.suffixes.items()},
        output=cfg.output_location,
        staging=str(staging_dir(cfg)),
        seq_len=512,
        max_bytes=1 << 20,
        max_samples=0,
        multi=False,
        keep_staging=False,
        data_key="",
    )
    task = PartitionTask(0, 0, inputs)
    first = plan_partition(job, task, loaded(worker)).tasks[0]
    Path(first.staged + ".attempts").write_text(str(CRASHES_TO_SKIP))
    result = run_partition(job, task)
    assert result.crashed == [first.source]
    assert [e.status for e in result.entries].count("ok") == len(inputs) - 1


def test_a_killed_driver_rerun_skips_the_partitions_it_finished(corpus, tmp_path):
    """SIGKILL `ulysses-mm prepare` once a partition is finished; the rerun takes it (and
    checks its shards), redoes the rest, and a partition whose shard was damaged is redone."""
    _, _, slow = corpus
    out = tmp_path / "out"
    overrides = [*PARTS, f"output={out}", "workers=1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ulysses_mm", "prepare", str(slow / "pipeline.yaml"), *overrides],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    fragments = out / "_partitions"
    try:
        end = time.monotonic() + 120
        while not (fragments.is_dir() and any(fragments.glob("*.json"))):
            assert proc.poll() is None and time.monotonic() < end, "no partition finished"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert not (out / "manifest.json").exists(), "the run finished before the kill"
    finished = len(list(fragments.glob("*.json")))
    assert 1 <= finished < 3

    result = prepare(load_pipeline_config(slow / "pipeline.yaml", overrides))
    assert result.resumed == finished
    assert files_of(out) == files_of(slow / "expected")

    # a finished partition whose shard no longer matches its fragment is done again
    (fragments.parent / "part-00002").mkdir(exist_ok=True)
    result = prepare(
        load_pipeline_config(slow / "pipeline.yaml", [*overrides, "keep_staging=true"])
    )
    assert result.resumed == 0  # the manifest was written: the fragments went with the run
    shard = out / "part-00000" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\1")
    storage.atomic_write_local(out / "_partitions" / "part-00000.json", b"{}")  # and a bad one
    result = prepare(load_pipeline_config(slow / "pipeline.yaml", overrides))
    assert result.resumed == 0 and files_of(out) == files_of(slow / "expected")


def test_a_partition_failing_for_a_reason_other_than_an_input_fails_the_run_in_one_line(
    ray_local, corpus, tmp_path
):
    pipeline, _, _ = corpus
    for executor in ("local", "ray"):
        out = tmp_path / executor
        out.mkdir()
        (out / "part-00001").write_text("a file where partition 1's folder goes")
        with pytest.raises(PrepareError) as err:
            prepare(load_pipeline_config(pipeline, [*PARTS, f"output={out}", f"engine={executor}"]))
        line = str(err.value)
        assert "\n" not in line and line.startswith(
            "partition 1 (5 inputs: genome02.seq … notes.txt) failed"
        ), line
        assert "failed: FileExistsError" in line or "failed: NotADirectoryError" in line, line
        log = Path(line.rsplit("traceback in ", 1)[1].rstrip(")"))
        assert 'File "' in log.read_text() and "FileExistsError" in log.read_text()
        assert not (out / "manifest.json").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "ulysses_mm", "prepare", str(pipeline), *PARTS, f"output={out}"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "ulysses-mm prepare: partition 1 (" in proc.stderr


def test_a_ray_address_nothing_answers_is_one_line_and_writes_nothing(corpus, tmp_path, capsys):
    """Ray's client retries an unreachable head for minutes; the run checks it first."""
    import socket

    from ulysses_mm.cli import main

    with socket.socket() as s:  # a port nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipeline, _, _ = corpus
    out = tmp_path / "out"
    t0 = time.monotonic()
    code = main(["prepare", str(pipeline), f"output={out}", "--engine", "ray"]
                + ["--address", f"127.0.0.1:{port}", "progress=false"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"cannot join a Ray cluster at 127.0.0.1:{port}: nothing accepts connections" in err
    assert time.monotonic() - t0 < 15 and not out.exists()


def _fasta(rng: np.random.Generator, records: int, bases: int) -> str:
    out = []
    for i in range(records):
        seq = "".join(rng.choice(list("ACGTNacgt"), bases))
        out.append(f">r{i} record {i}\n" + "\n".join(seq[j : j + 60] for j in range(0, bases, 60)))
    return "\n".join(out) + "\n"


def test_s3_sources_by_glob_stream_into_the_same_bytes(ray_local, tmp_path, s3_server):
    """FASTA inputs in a bucket, listed by a ``**`` glob and read as streams (never copied
    to the worker), give the shards the same files give on local disk, on both executors."""
    rng = np.random.default_rng(3)
    data = tmp_path / "genomes"
    for rel, n in [("a/x.fa", 2), ("a/b/y.fa", 3), ("z.fa", 1)]:
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_text(_fasta(rng, n, 700))
    (data / "a" / "bad.fa").write_text(">bad\nACGU\n")
    opts = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    import fsspec

    fs = fsspec.filesystem("s3", **opts)
    fs.mkdir("corpus")
    for p in sorted(data.rglob("*.fa")):
        fs.put_file(str(p), f"corpus/genomes/{p.relative_to(data)}")
    base = [
        f"tokenizers=[{REPO / 'tokenizers' / 'dna-base.json'}]",
        "pack.seq_len=512",
        "shards.max_bytes=20000",
        "shards.partitions=2",
        "progress=false",
    ]
    local = prepare(
        load_pipeline_config(
            None, [*base, f"sources=[{data}/**/*.fa]", f"output={tmp_path / 'local'}"]
        )
    ).manifest
    for executor in ("local", "ray"):
        url = f"s3://corpus/out-{executor}"
        result = prepare(
            load_pipeline_config(
                None,
                [
                    *base,
                    "sources=[s3://corpus/genomes/**/*.fa]",
                    f"output={url}",
                    f"storage_options={json.dumps(opts)}",
                    f"engine={executor}",
                    f"staging={tmp_path / ('stage-' + executor)}",
                ],
            )
        )
        m = Manifest.load(Location(f"{url}/manifest.json", opts))
        assert [e.source.split("genomes/")[1] for e in m.inputs] == [
            e.source.split("genomes/")[1] for e in local.inputs
        ]
        assert [e.reason.split("genomes/")[-1] for e in m.inputs] == [
            e.reason.split("genomes/")[-1] for e in local.inputs
        ]
        # read where it is: the error names the object, not a local copy
        assert m.inputs[1].reason.startswith("s3://corpus/genomes/a/bad.fa#bad: character 'U'")
        assert [(s.url, s.sha256) for s in m.shards] == [(s.url, s.sha256) for s in local.shards]
        assert result.partitions == 2
        assert not (tmp_path / f"stage-{executor}").exists()


def test_a_streaming_tokenizer_reads_a_bucket_object_without_a_local_copy(
    tmp_path, s3_server, monkeypatch
):
    from ulysses_mm.core.tokenspace import TokenSpace
    from ulysses_mm.shards.prepare import pool
    from ulysses_mm.shards.prepare.route import Task
    from ulysses_mm.tokenize.registry import load_tokenizer

    opts = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    import fsspec

    fs = fsspec.filesystem("s3", **opts)
    fs.mkdir("one")
    fs.pipe_file("one/g.fa", _fasta(np.random.default_rng(0), 2, 300).encode())

    def no_copy(*args, **kw):
        raise AssertionError("a streaming input was copied")

    monkeypatch.setattr(storage.Location, "fetch", no_copy)
    tok = load_tokenizer(REPO / "tokenizers" / "dna-base.json")
    space = TokenSpace.from_vocab({"dna": tok.spec.vocab_size})
    task = Task(0, "s3://one/g.fa", "dna", str(tmp_path / "entry"), str(tmp_path / "fetch"))
    outcome = pool.tokenize_input(task, tok, space, Location("s3://one", opts))
    assert outcome.ok and outcome.documents == 2 and outcome.tokens == 2 * 303


def test_the_local_executor_never_imports_ray(tmp_path):
    """Ray is an optional extra: a local prepare and the CLI import it only for engine=ray."""
    make_inputs(tmp_path, n_dna=1, bad=False)
    pipeline = write_pipeline(tmp_path, str(tmp_path / "out"), workers=1)
    probe = (
        "import sys\n"
        "from ulysses_mm import cli\n"
        "from ulysses_mm.shards.prepare import ray_executor\n"
        "from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare\n"
        f"prepare(load_pipeline_config({str(pipeline)!r}))\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
