"""A wheel is a complete install: built from this checkout, it carries the tokenizer specs
and artifacts, the pipelines, the run configs and the demo's sample files (with their
ATTRIBUTION.md), never a ``tokenizers/__init__.py``; installed into a bare directory and
run from an empty one, the CLI finds them (a prepare of the shipped DNA pipeline, a
tokenizer spec by name, the demo's inputs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

from ulysses_mm.core.resources import shipped_files

pytestmark = pytest.mark.slow


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
    target = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        + [str(wheel)],
        check=True,
        timeout=300,
    )
    return target


def _cli(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_installed_wheel_runs_from_an_empty_directory(installed, tmp_path):
    data = installed / "ulysses_mm" / "_data"
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

    # the shipped DNA pipeline, its tokenizer named rather than a path
    run = _cli(
        installed,
        tmp_path,
        "-m",
        "ulysses_mm",
        "prepare",
        str(data / "pipelines" / "dna.yaml"),
        "output=out/dna",
        "tokenizers=[dna-base]",
        "pack.seq_len=4096",
        "progress=false",
    )
    assert run.returncode == 0, run.stderr
    manifest = json.loads((tmp_path / "out" / "dna" / "manifest.json").read_text())
    assert manifest["num_samples"] > 0
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing else written

    run = _cli(
        installed, tmp_path, "-m", "ulysses_mm", "config", str(data / "configs" / "debug-tiny.yaml")
    )
    assert run.returncode == 0, run.stderr

    # a name nothing ships: one line that lists what does
    run = _cli(
        installed,
        tmp_path,
        "-m",
        "ulysses_mm",
        "prepare",
        str(data / "pipelines" / "dna.yaml"),
        "output=out/bad",
        "tokenizers=[dna-bse]",
    )
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "dna-base" in lines[0] and "dna-lossless" in lines[0], run.stderr
