"""Offline and online data are two houses: what writes shards (prepare, packing, shards,
manifest, inspect) imports neither torch nor the model; both read data/format.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

OFFLINE = [
    "ulysses_mm.storage",
    "ulysses_mm.data.format",
    "ulysses_mm.data.packing",
    "ulysses_mm.data.shards",
    "ulysses_mm.data.manifest",
    "ulysses_mm.data.inputs",
    "ulysses_mm.data.workers",
    "ulysses_mm.data.output",
    "ulysses_mm.data.assemble",
    "ulysses_mm.data.prepare",
    "ulysses_mm.data.inspect",  # matplotlib is imported only to draw
    "ulysses_mm.modalities.registry",
]

_PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    heavy = sorted(m for m in ("torch", "webdataset", "matplotlib") if m in sys.modules)
    if heavy:
        print(f"{name} imports {heavy}")
        raise SystemExit(1)
"""


def test_offline_data_code_never_imports_torch():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *OFFLINE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_probe_sees_torch():
    """The check above can fail: the training batch module does import torch."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, "ulysses_mm.data.format", "ulysses_mm.data.batch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "ulysses_mm.data.batch imports ['torch']" in proc.stdout
