"""Imports only point down the flow (core < config < tokenize < shards < loader < model <
parallel < train < hf < tools < cli), and the checker catches one that does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ulysses_mm.tools.layers import LAYERS, layer_of, violations

PACKAGE = Path(__file__).resolve().parents[2] / "ulysses_mm"


def test_the_package_has_no_upward_import():
    assert violations(PACKAGE) == []


def test_every_folder_of_the_package_is_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(LAYERS), folders - set(LAYERS)
    assert layer_of("ulysses_mm.cli") == "cli" and layer_of("numpy") is None


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "ulysses_mm"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_an_upward_import_is_reported_with_its_line(tmp_path):
    root = _package(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/ok.py": "import numpy\nfrom ulysses_mm.core import errors\n",
            # a lazy import inside a function counts, and so does a relative one
            "core/bad.py": "def f():\n    from ulysses_mm.train import loop\n",
            "shards/__init__.py": "",
            "shards/rel.py": "from ..loader.stream import x\n",
            "model/__init__.py": "",
            "model/up.py": "from ulysses_mm import parallel\n",
        },
    )
    found = violations(root)
    assert len(found) == 3, found
    assert any("core/bad.py:2:" in f and "ulysses_mm.train" in f for f in found)
    assert any("shards/rel.py:1:" in f and "ulysses_mm.loader.stream" in f for f in found)
    assert any("model/up.py:1:" in f and "ulysses_mm.parallel" in f for f in found)


def test_the_command_exits_1_on_an_upward_import(tmp_path):
    root = _package(tmp_path, {"loader/__init__.py": "import ulysses_mm.tools.demo\n"})
    proc = subprocess.run(
        [sys.executable, "-m", "ulysses_mm.tools.layers", str(root)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "loader/__init__.py:1:" in proc.stdout
    ok = subprocess.run([sys.executable, "-m", "ulysses_mm.tools.layers"], capture_output=True)
    assert ok.returncode == 0, ok.stdout
