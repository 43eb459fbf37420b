"""Shipped pipelines, run configs and tokenizer specs by name (ulysses_mm.core.shipped): a
bare name is the shipped file, a local file of that name wins, an unknown name is one line
listing what ships, and a pipeline run by name writes under the working directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO

from ulysses_mm.cli import main
from ulysses_mm.core import shipped
from ulysses_mm.core.checks import CheckError
from ulysses_mm.shards.prepare.run import load_pipeline_config


def test_names_are_the_shipped_files():
    assert shipped.names("pipelines") == ["audio", "dna", "mixed", "video"]
    assert "debug-stages" in shipped.names("configs")
    assert shipped.find("configs", "debug-stages") == REPO / "configs" / "debug-stages.yaml"
    assert shipped.run_config("debug-tiny") == str(REPO / "configs" / "debug-tiny.yaml")
    assert shipped.tokenizer_spec("dna-base.json") == str(REPO / "tokenizers" / "dna-base.json")


def test_a_path_is_a_path_and_a_local_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("debug-tiny").write_text("model: {hidden_size: 32}\n")
    assert shipped.find("configs", "debug-tiny") == Path("debug-tiny")
    # written as a path (a separator, a YAML suffix): never looked up by name
    for value in ("configs/dna.yaml", "dna.yaml", "./dna"):
        assert shipped.find("pipelines", value) == Path(value)
        with pytest.raises(CheckError, match="no such file or directory"):
            shipped.pipeline(value)


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(CheckError) as e:
        shipped.run_config("debug-stagez", "config")
    text = str(e.value)
    assert text.startswith("config debug-stagez: no such file, nor a shipped run config")
    assert "debug-stages, debug-tiny" in text and "\n" not in text
    with pytest.raises(CheckError, match="shipped: audio-mulaw-16k, dna-annotated"):
        shipped.tokenizer_spec("dna-bse")


def test_every_shipped_file_has_a_one_line_description():
    for folder in shipped.FOLDERS:
        rows = shipped.describe(folder)
        assert [n for n, _ in rows] == shipped.names(folder)
        for name, text in rows:
            assert text and "\n" not in text and len(text) <= shipped.DESCRIPTION_WIDTH, name
    assert dict(shipped.describe("configs"))["debug-tiny"] == (
        "A tiny model that trains in seconds on CPU (gloo): the demo, smoke runs, tests, `verify`."
    )


def test_a_pipeline_by_name_reads_the_package_and_writes_here(tmp_path):
    by_name = load_pipeline_config("dna", cwd=tmp_path)
    by_path = load_pipeline_config(REPO / "pipelines" / "dna.yaml", cwd=tmp_path)
    assert (
        by_name.sources
        == by_path.sources
        == [str(REPO / "tests" / "data" / "*.{fa,fasta,fna,fa.gz,fastq,fq,fastq.gz,gb,gbk}")]
    )
    assert by_name.tokenizers == [str(REPO / "tokenizers" / "dna-base.json")]
    assert by_name.output == str(tmp_path / "build" / "shards" / "dna")
    assert by_path.output == str(REPO / "build" / "shards" / "dna")  # the file's own place
    # an override still resolves against the working directory
    assert load_pipeline_config("dna", ["output=x"], cwd=tmp_path).output == str(tmp_path / "x")


def test_the_listing_commands(capsys):
    assert main(["pipelines"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[0] for r in rows[:-1]] == ["audio", "dna", "mixed", "video"]
    assert rows[1].startswith("dna    DNA: FASTA / FASTQ / GenBank")
    assert "`ulysses-mm prepare NAME` runs it" in rows[-1]
    assert main(["configs", "debug-stages"]) == 0
    assert capsys.readouterr().out == (REPO / "configs" / "debug-stages.yaml").read_text()
    assert main(["configs", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "debug-stages" in err[0]
