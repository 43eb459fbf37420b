"""Imports only point down the flow (core < config < tokenize < shards < loader < model <
parallel < train < hf < tools < cli), and the checker catches one that does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ulysses_mm.tools.layers import LAYERS, cycles, layer_of, unmarked_lazy_imports, violations

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
    # the package itself passes every check, the lazy-import one included (no option)
    assert unmarked_lazy_imports(PACKAGE) == [] and cycles(PACKAGE) == []
    ok = subprocess.run([sys.executable, "-m", "ulysses_mm.tools.layers"], capture_output=True)
    assert ok.returncode == 0, ok.stdout


def test_an_import_circle_is_reported_with_each_import_of_its_loop(tmp_path):
    root = _package(
        tmp_path,
        {
            "core/__init__.py": "",
            # a -> b at module level, b -> c inside a function, c -> a: one circle of three
            "core/a.py": "from ulysses_mm.core import b\n",
            "core/b.py": "def f():\n    from ulysses_mm.core.c import x  # lazy: dodging\n",
            "core/c.py": "import ulysses_mm.core.a\nx = 1\n",
            # imports under TYPE_CHECKING never run: no circle between d and e
            "core/d.py": "from ulysses_mm.core import e\n",
            "core/e.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ulysses_mm.core.d import Y\n"
            ),
            # a module importing itself, or an outside package, is no circle
            "core/f.py": "import ulysses_mm.core.f\nimport numpy\n",
        },
    )
    found = cycles(root)
    assert len(found) == 1, found
    (line,) = found
    assert "core/a.py:1: import circle of 3 modules" in line
    assert "ulysses_mm/core/a.py:1 -> ulysses_mm.core.b" in line
    assert "ulysses_mm/core/b.py:2 -> ulysses_mm.core.c" in line
    assert "ulysses_mm/core/c.py:1 -> ulysses_mm.core.a" in line
    assert "core.d" not in line and "core.e" not in line


def test_from_a_package_importing_a_submodule_is_an_edge_to_the_submodule(tmp_path):
    root = _package(
        tmp_path,
        {
            "core/__init__.py": "from ulysses_mm.core.a import A\n",
            "core/a.py": "A = 1\n",
            # b imports the submodule a (not the package), so no circle with core/__init__
            "core/b.py": "from ulysses_mm.core import a\n",
            "shards/__init__.py": "",
            "shards/p.py": "from . import q\n",
            "shards/q.py": "from .p import thing\n",
        },
    )
    found = cycles(root)
    assert len(found) == 1 and "ulysses_mm.shards.p, ulysses_mm.shards.q" in found[0], found


def test_an_import_inside_a_function_needs_a_lazy_comment(tmp_path):
    root = _package(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/ok.py": (
                "import json\n"
                "def f():\n"
                "    import torch  # lazy: the CLI stays torch-free\n"
                "    from ulysses_mm.core import (  # lazy: pulls torch\n"
                "        ok,\n"
                "    )\n"
                "class C:\n"
                "    def m(self):\n"
                "        g = lambda: __import__('x')\n"
            ),
            "core/bad.py": (
                "def f():\n"
                "    import numpy\n"
                "    def inner():\n"
                "        from ulysses_mm.core import ok  # a plain comment is not a reason\n"
                "async def g():\n"
                "    import os, sys\n"
            ),
        },
    )
    found = unmarked_lazy_imports(root)
    assert [f.split(": ", 1)[0].rsplit("/", 1)[-1] for f in found] == [
        "bad.py:2",
        "bad.py:4",
        "bad.py:6",
    ], found
    assert all("'# lazy: <why>'" in f for f in found)


def test_the_command_exits_1_on_a_circle_or_an_unmarked_lazy_import(tmp_path):
    for files, expected in (
        (
            {
                "core/__init__.py": "",
                "core/a.py": "from ulysses_mm.core import b\n",
                "core/b.py": "import ulysses_mm.core.a\n",
            },
            "circle",
        ),
        ({"core/__init__.py": "def f():\n    import numpy\n"}, "without a '# lazy:"),
    ):
        root = _package(tmp_path / expected[:6], files)
        proc = subprocess.run(
            [sys.executable, "-m", "ulysses_mm.tools.layers", str(root)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 1 and expected in proc.stdout, proc.stdout
