"""The Hugging Face examples, launched as a user would (torchrun, CPU processes, gloo) on
shards the real DNA pipeline prepared:

- ``examples/hf_trainer.py``: Transformers Trainer + Accelerate ParallelismConfig sp=2
  (DeepSpeed Ulysses, ZeRO-2) on 2 processes;
- ``examples/hf_accelerate_loop.py``: a plain Accelerate loop with our backend and a ring
  (sp=2 = ring 2) on 2 processes; Ulysses × ring at sp=4 is checked against one process in
  tests/distributed/test_hf_attention.py.

Each: the loss of step 1 is the one-process loss of transformers' own model (SDPA, which
isolates the packed documents from the position ids) on the first sample, within 1e-5;
the loss falls over 20 steps; resumed from the step-10 checkpoint, steps 11-20 repeat
the uninterrupted run's losses and data state (the same samples in the same order).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import REPO
from train_data import prepare_dna

from ulysses_mm.hf import ShardDataset

TOL = 1e-5


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hfex")
    return prepare_dna(root, "dna", records=40, seq_len=128, seed=1, length=150)


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(nproc: int, script: str, *args: str) -> None:
    """Run an example under torchrun; its terminal holds no library warning and it
    compiles no DeepSpeed op (a fresh, empty extensions directory stays empty)."""
    with tempfile.TemporaryDirectory() as ext:
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node", str(nproc), str(REPO / "examples" / script), *args],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                 "TORCH_EXTENSIONS_DIR": ext},
            capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
        assert not any(Path(ext).iterdir()), f"{script} compiled {sorted(os.listdir(ext))}"
    noise = [line for line in out.stderr.splitlines() if "Warning" in line or "warn(" in line]
    assert not noise, "\n".join(noise[:5])


def _one_process_loss(module, manifest: Path) -> float:
    """transformers' own model (SDPA) on the stream's first sample, one process."""
    ds = ShardDataset(str(manifest))
    first = next(iter(ds))
    ds.close()
    model = module.build_model(ds.space.vocab_size, 0)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model(
            input_ids=first["input_ids"][None],
            position_ids=first["position_ids"][None],
            labels=first["labels"][None],
            use_cache=False,  # with a cache transformers ignores the packed positions
        )
    return float(out.loss)


def _losses(out: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


def _check_run(losses: dict[int, float], reference: float) -> None:
    assert sorted(losses) == list(range(1, 21))
    assert abs(losses[1] - reference) < TOL, (losses[1], reference)
    first, last = sum(losses[s] for s in range(1, 6)), sum(losses[s] for s in range(16, 21))
    assert last < 0.75 * first, losses


def test_trainer_with_accelerate_sequence_parallelism(manifest, tmp_path):
    module = _example("hf_trainer")
    out = tmp_path / "trainer"
    _launch(2, "hf_trainer.py", str(manifest), str(out), "--sp", "2", "--steps", "20")
    losses = _losses(out)
    _check_run(losses, _one_process_loss(module, manifest))
    # resume from checkpoint-10: the same samples in the same order, the same losses
    again = tmp_path / "resumed"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("checkpoint-20", "losses.json"))
    _launch(2, "hf_trainer.py", str(manifest), str(again), "--sp", "2", "--resume")
    resumed = _losses(again)
    for step in range(11, 21):
        assert abs(resumed[step] - losses[step]) < TOL, (step, resumed[step], losses[step])
    state = "checkpoint-20/ulysses_mm_data.json"
    assert json.loads((again / state).read_text()) == json.loads((out / state).read_text())


def test_accelerate_loop_with_our_backend_and_a_ring(manifest, tmp_path):
    module = _example("hf_accelerate_loop")
    out = tmp_path / "loop"
    args = ("--sp", "2", "--ring", "2", "--steps", "20")
    _launch(2, "hf_accelerate_loop.py", str(manifest), str(out), *args)
    losses = _losses(out)
    _check_run(losses, _one_process_loss(module, manifest))
    again = tmp_path / "resumed"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("step-20", "losses.json"))
    (again / "latest").write_text("step-10\n")
    _launch(2, "hf_accelerate_loop.py", str(manifest), str(again), *args, "--resume")
    resumed = _losses(again)
    for step in range(11, 21):
        assert abs(resumed[step] - losses[step]) < TOL, (step, resumed[step], losses[step])
    state = "step-20/state.json"
    assert json.loads((again / state).read_text()) == json.loads((out / state).read_text())
