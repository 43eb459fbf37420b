"""Offline and online data are two houses: what writes shards (core, config, tokenize,
shards: the tokenizers, prepare, packing, writer, reader, manifest, inspect) imports
neither torch nor the model; both read core/format.py. A tokenizer that computes with
torch (video VQ's nearest-codeword search, the neural codecs) imports it when it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Every module of the torch-free layers (found on disk, so a new one is checked too).
TORCH_FREE_LAYERS = ("core", "config", "tokenize", "shards")
OFFLINE = sorted(
    ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    for layer in TORCH_FREE_LAYERS
    for path in (REPO / "ulysses_mm" / layer).rglob("*.py")
)

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
    assert len(OFFLINE) > 20 and "ulysses_mm.shards.prepare.run" in OFFLINE
    assert "ulysses_mm.tokenize.video.kmeans" in OFFLINE
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
