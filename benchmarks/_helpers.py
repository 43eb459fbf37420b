"""The test helpers a benchmark reuses (``tests/helpers/*.py``: media makers, tiny codecs,
a byte-counting proxy), loaded by path: the benchmarks are scripts, not a package."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

HELPERS = Path(__file__).resolve().parents[1] / "tests" / "helpers"


def helper_module(name: str) -> ModuleType:
    """``tests/helpers/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, HELPERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
