"""Every fault one line: what the implementation of prepare, probe, hf-tokenizer and
generate must refuse in one stderr line, exit 2, in bounded time, leaving nothing
behind; and outputs that appear whole or not at all."""

from __future__ import annotations

import http.server
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO
from train_data import prepare_dna

from ulysses_mm.cli import main
from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.tools import probe

PIPELINE = str(REPO / "pipelines" / "dna.yaml")


def _one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    return err


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # not on the test's stderr
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    """A plain HTTP/1 server on 127.0.0.1 (what a Ray dashboard's port is), stopped after."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _prepare(out: Path, *args: str) -> int:
    return main(["prepare", PIPELINE, f"output={out}", "progress=false", *args])


def test_a_ray_address_that_is_not_a_ray_head_is_one_line_before_any_folder(
    tmp_path, capsys, http_port
):
    pytest.importorskip("ray")
    out = tmp_path / "out"
    t0 = time.monotonic()
    code = _prepare(out, "--engine", "ray", "--address", f"127.0.0.1:{http_port}")
    err = _one_line(capsys, code)
    assert f"at 127.0.0.1:{http_port}: what listens there is not a Ray head" in err, err
    assert time.monotonic() - t0 < 10
    assert not out.exists() and not out.with_suffix(".staging").exists()


def test_a_malformed_or_absent_ray_address_is_one_line_before_any_folder(
    tmp_path, capsys, monkeypatch
):
    pytest.importorskip("ray")
    from ray._private import services

    out = tmp_path / "out"
    err = _one_line(capsys, _prepare(out, "--engine", "ray", "--address", "localhost:abc"))
    assert "--address must be auto, HOST:PORT or ray://HOST:PORT, got 'localhost:abc'" in err
    # no cluster on this node, whatever else runs here
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset())
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    err = _one_line(capsys, _prepare(out, "--engine", "ray", "--address", "auto"))
    assert "cannot join a Ray cluster at auto" in err
    assert sorted(tmp_path.iterdir()) == []


def test_prepare_user_errors_exit_2_and_an_unreachable_source_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    err = _one_line(capsys, _prepare(out, f"sources=[{tmp_path}/none*.fa]"))
    assert "matches no file" in err
    spec = tmp_path / "spec.json"
    spec.write_text("not json {")
    err = _one_line(capsys, _prepare(out, f"tokenizers=[{spec}]"))
    assert "not valid JSON" in err
    err = _one_line(capsys, _prepare(out, "sources=[http://127.0.0.1:1/x.fa]"))
    assert "cannot list http://127.0.0.1:1/x.fa: ClientConnectorError" in err
    assert not out.exists() and not out.with_suffix(".staging").exists()


def test_probe_fasta_is_streamed_in_chunks_with_the_same_bytes(tmp_path, monkeypatch):
    """Drawn, translated and written a chunk at a time, the copy drawn again from the
    generator's state: the bytes of the whole-document version (60 bases a line)."""
    length, docs, seed = 130, 3, 7
    rng = np.random.default_rng(seed)
    want = ""
    for i in range(docs):
        half = "".join("ACGT"[k] for k in rng.integers(0, 4, length))
        seq = half + half + "N"
        want += f">probe{i} L={length}\n" + "".join(
            seq[j : j + 60] + "\n" for j in range(0, len(seq), 60)
        )
    for chunk in (1 << 20, 7, 60):
        monkeypatch.setattr(probe, "CHUNK_BASES", chunk)
        got = probe.write_fasta(tmp_path / f"{chunk}.fa", length, docs, seed).read_text()
        assert got == want
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["60.fa", "7.fa", f"{1 << 20}.fa"])


def test_a_failed_probe_write_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def fail_second(out, name, *args):
        calls.append(name)
        if len(calls) == 2:
            raise MemoryError("no room")
        return real(out, name, *args)

    real = probe._write_set
    monkeypatch.setattr(probe, "_write_set", fail_second)
    with pytest.raises(MemoryError):
        probe.write_probe(tmp_path / "p", 8, documents=2, eval_documents=1)
    assert not (tmp_path / "p").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("x")
    calls.clear()
    with pytest.raises(MemoryError):
        probe.write_probe(kept, 8, documents=2, eval_documents=1)
    assert sorted(p.name for p in kept.iterdir()) == ["mine.txt"]


def test_probe_score_refuses_a_dataset_that_is_not_a_probe(tmp_path):
    """Documents all of one even length fit the token arithmetic of a probe: the name and
    the modality tell them apart, before any model is opened."""
    from ulysses_mm.shards.manifest import Manifest

    src = tmp_path / "src"
    src.mkdir()
    (src / "x.fa").write_text("".join(f">r{i}\n{'ACGT' * 15}A\n" for i in range(4)))
    from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare

    cfg = load_pipeline_config(
        PIPELINE, [f"sources=[{src}/x.fa]", f"output={tmp_path / 'ds'}", "pack.seq_len=128",
                   "progress=false"],
    )  # fmt: skip
    prepare(cfg, out=io.StringIO())
    m = Manifest.load(str(tmp_path / "ds"))
    with pytest.raises(DataError, match="not a probe dataset"):
        probe.copy_length(m)
    with pytest.raises(DataError, match="not a probe dataset"):
        probe.score("no-such-run", str(tmp_path / "ds" / "manifest.json"))


def test_hf_tokenizer_with_an_unreadable_text_tokenizer_is_one_line(tmp_path, capsys):
    manifest = prepare_dna(tmp_path, "d", records=4, seq_len=128, length=60)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "tokenizer.json").write_text("{not json")
    (garbage / "tokenizer_config.json").write_text("{not json")
    out = tmp_path / "tok"
    code = main(["hf-tokenizer", str(manifest), str(out), "--text-tokenizer", str(garbage)])
    err = _one_line(capsys, code)
    assert f"--text-tokenizer {garbage}: not a transformers tokenizer directory" in err
    assert not out.exists() and [p.name for p in tmp_path.glob(".tok*")] == []


def test_a_kv_cache_larger_than_memory_is_refused_naming_both_figures(monkeypatch):
    from ulysses_mm.tools import generate

    model = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, head_dim=64)
    trained = SimpleNamespace(
        cfg=SimpleNamespace(model=model), dtype=lambda name="auto": torch.float32
    )
    opts = generate.GenerateOptions("dna", new_tokens=10**9, out="x.fa", device="cpu")
    monkeypatch.setattr(generate, "available_ram", lambda: 8 << 30)
    with pytest.raises(ConfigError) as err:
        generate.check_cache_fits(trained, opts, prompt=1000, world=1)
    line = str(err.value)  # 4 × 2 × 2 × 64 × 4 bytes = 4 KiB a token
    assert "needs 3,814.7 GiB, more than the 8.0 GiB of RAM available" in line, line
    assert "at most about 2,096,152 new tokens fit" in line and "\n" not in line
    opts.new_tokens = 1000
    generate.check_cache_fits(trained, opts, prompt=1000, world=1)  # fits: nothing raised


def test_a_truncated_weights_file_is_one_line_naming_it(tmp_path):
    from safetensors.torch import save_file

    from ulysses_mm.train.inference import check_weights

    f = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(256)}, str(f))
    check_weights(f)
    f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(DataError) as err:
        check_weights(f)
    assert str(err.value).startswith(f"{f}: not a whole safetensors file (SafetensorError")
