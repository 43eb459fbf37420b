"""Copies the shipped data (tokenizer specs and artifacts, pipelines, configs, the demo's
sample files) into the wheel as ``ulysses_mm/_data/``, keeping the repository's layout, so
the top-level folders stay where they are and a wheel is a complete install. What ships is
listed once, in ``ulysses_mm/core/resources.py``. An editable install copies nothing: it
reads the clone (see :func:`ulysses_mm.core.resources.resource`)."""

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _resources():
    spec = importlib.util.spec_from_file_location(
        "_ulysses_mm_resources", ROOT / "ulysses_mm" / "core" / "resources.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithData(build_py):
    def run(self):
        if getattr(self, "editable_mode", False):
            super().run()
            return
        # build_py copies into build/lib and never removes: a module deleted or renamed in
        # the tree would still ship from an earlier build's copy
        shutil.rmtree(Path(self.build_lib) / "ulysses_mm", ignore_errors=True)
        super().run()
        target = Path(self.build_lib) / "ulysses_mm" / "_data"
        for rel in _resources().shipped_files(ROOT):
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest)


setup(cmdclass={"build_py": BuildWithData})
