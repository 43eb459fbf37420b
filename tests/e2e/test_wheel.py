"""A wheel is a complete install: built from this checkout, it carries the tokenizer specs
and artifacts, the pipelines, the run configs and the demo's sample files (with their
ATTRIBUTION.md), never a ``tokenizers/__init__.py`` nor a module the tree no longer has;
installed into a bare directory and run from an empty one, the CLI finds them by name (a
shipped pipeline, run config or tokenizer spec, the demo's inputs), and the staged run's
own instructions (the commands in ``configs/debug-stages.yaml``'s header) train."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

from ulysses_mm.core.resources import shipped_files

pytestmark = pytest.mark.slow

# what the shipped DNA pipeline makes of the sample files (29,879 bases in 12 documents)
SAMPLES = {1048576: 1, 16384: 2, 4096: 8}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from this checkout, installed into a bare target directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + [str(REPO), "-w", str(tmp / "dist")],
        check=True,
        cwd=tmp,
        timeout=300,
    )
    (wheel,) = (tmp / "dist").glob("ulysses_mm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"ulysses_mm/_data/{p.as_posix()}" for p in shipped_files(REPO)}
    assert expected <= names, sorted(expected - names)
    for must in (
        "tokenizers/dna-base.json",
        "tokenizers/video-vq.npy",
        "tokenizers/text-bytes/tokenizer.json",
        "pipelines/mixed.yaml",
        "configs/debug-tiny.yaml",
        "tests/data/ATTRIBUTION.md",
        "tests/data/human_mt.fa",
    ):
        assert f"ulysses_mm/_data/{must}" in names
    assert not [n for n in names if n.startswith("tokenizers/") or "/tokenizers/__init__" in n]
    assert not [n for n in names if "__pycache__" in n]
    # exactly the tree's modules: none left over from an earlier build's build/lib
    tree = {p.relative_to(REPO).as_posix() for p in (REPO / "ulysses_mm").rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == tree
    target = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        + [str(wheel)],
        check=True,
        timeout=300,
    )
    return target


def _cli(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with the installed wheel first on the path (the venv gives torch)."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _um(target: Path, cwd: Path, *words: str) -> subprocess.CompletedProcess[str]:
    """``ulysses-mm WORDS``: the wheel's own console script."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run(
        [str(target / "bin" / "ulysses-mm"), *words],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _samples(manifest: Path) -> int:
    return json.loads(manifest.read_text())["num_samples"]


def _data_files(target: Path) -> list[Path]:
    return shipped_files(target / "ulysses_mm" / "_data")


def test_installed_wheel_runs_from_an_empty_directory(installed, tmp_path):
    run = _cli(
        installed,
        tmp_path,
        "-c",
        "import ulysses_mm; from ulysses_mm.tools import demo; "
        "print(ulysses_mm.__file__); "
        "print(all(p.exists() for p in (demo.PIPELINE, demo.CONFIG, demo._DATA)))",
    )
    assert run.returncode == 0, run.stderr
    where, found = run.stdout.split()
    assert Path(where).is_relative_to(installed)  # not the clone
    assert found == "True"
    shipped = _data_files(installed)

    # the shipped DNA pipeline by name: it reads the wheel's samples and writes here
    run = _um(installed, tmp_path, "prepare", "dna", "progress=false")
    assert run.returncode == 0, run.stderr
    assert _samples(tmp_path / "build" / "shards" / "dna" / "manifest.json") == SAMPLES[1048576]
    # its tokenizer named rather than a path
    run = _um(
        installed, tmp_path, "prepare", "dna", "output=out/dna", "tokenizers=[dna-base]",
        "pack.seq_len=4096", "progress=false",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert _samples(tmp_path / "out" / "dna" / "manifest.json") == SAMPLES[4096]
    # the README tour's: all modalities, a spec's artifact (video-vq.npy) read beside it
    run = _um(
        installed, tmp_path, "prepare", "mixed", "output=out/mixed", "pack.seq_len=8192",
        "progress=false",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert _samples(tmp_path / "out" / "mixed" / "manifest.json") == 25
    assert sorted(os.listdir(tmp_path)) == ["build", "out"]  # nothing else written
    assert _data_files(installed) == shipped  # nor anything into the install

    run = _um(installed, tmp_path, "config", "debug-tiny")
    assert run.returncode == 0, run.stderr
    assert "hidden_size" in run.stdout

    # names nothing ships: one line that lists what does
    for words, listed in (
        (["prepare", "dna", "output=out/bad", "tokenizers=[dna-bse]"], ("dna-base", "dna-lossless")),
        (["prepare", "dnaa"], ("audio, dna, mixed, video",)),
        (["train", "debug-stagez"], ("debug-stages", "debug-tiny")),
    ):  # fmt: skip
        run = _um(installed, tmp_path, *words)
        assert run.returncode == 2
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and all(x in lines[0] for x in listed), run.stderr
    assert not (tmp_path / "out" / "bad").exists()


def test_the_listings_name_every_shipped_file(installed, tmp_path):
    data = installed / "ulysses_mm" / "_data"
    for folder in ("pipelines", "configs"):
        run = _um(installed, tmp_path, folder)
        assert run.returncode == 0, run.stderr
        *rows, where = run.stdout.splitlines()
        assert [r.split()[0] for r in rows] == sorted(
            p.stem for p in (data / folder).glob("*.yaml")
        )
        assert all(len(r.split(maxsplit=1)) == 2 for r in rows)  # each has its description
        assert str(data / folder) in where
    run = _um(installed, tmp_path, "configs", "debug-stages")
    assert run.returncode == 0, run.stderr
    assert run.stdout == (data / "configs" / "debug-stages.yaml").read_text()
    assert os.listdir(tmp_path) == []


def test_the_staged_run_trains_from_its_own_instructions(installed, tmp_path):
    """The commands ``configs/debug-stages.yaml`` gives in its header, run as written from
    an empty directory: the shards it packs and the three stages it trains."""
    header = (installed / "ulysses_mm" / "_data" / "configs" / "debug-stages.yaml").read_text()
    commands = [shlex.split(line.split("ulysses-mm", 1)[1]) for line in header.splitlines()
                if line.startswith("#   ulysses-mm ")]  # fmt: skip
    assert [c[:2] for c in commands] == [["prepare", "dna"], ["train", "debug-stages"]]
    shipped = _data_files(installed)
    for words in commands:
        run = _um(installed, tmp_path, *words)
        assert run.returncode == 0, (words, run.stderr[-4000:])

    assert _samples(tmp_path / "build" / "stages" / "shards" / "manifest.json") == SAMPLES[16384]
    run_dir = tmp_path / "build" / "stages" / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "loss" in r}
    assert sorted(by_step) == list(range(1, 13))
    assert [(by_step[s]["stage"], by_step[s]["seq_len"]) for s in (1, 4, 5, 8, 9, 12)] == [
        (0, 1024), (0, 1024), (1, 4096), (1, 4096), (2, 16384), (2, 16384),
    ]  # fmt: skip
    assert (run_dir / "checkpoints" / "step_00000012" / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["build"]
    assert _data_files(installed) == shipped
