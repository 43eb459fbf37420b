"""Offline and online data are two houses: what writes shards (prepare, packing, shards,
manifest, inspect) imports neither torch nor the model; both read data/format.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

OFFLINE = [
    "ulysses_mm.core.storage",
    "ulysses_mm.core.format",
    "ulysses_mm.shards.pack",
    "ulysses_mm.shards.writer",
    "ulysses_mm.shards.manifest",
    "ulysses_mm.shards.prepare.route",
    "ulysses_mm.shards.prepare.pool",
    "ulysses_mm.shards.prepare.publish",
    "ulysses_mm.shards.prepare.assemble",
    "ulysses_mm.shards.prepare.run",
    "ulysses_mm.shards.inspect",  # matplotlib is imported only to draw
    "ulysses_mm.tokenize.registry",
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
        [sys.executable, "-c", _PROBE, "ulysses_mm.core.format", "ulysses_mm.loader.batch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "ulysses_mm.loader.batch imports ['torch']" in proc.stdout
