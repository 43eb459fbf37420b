"""``examples/hf_trl_sft.py``: TRL's SFTTrainer on our shards with Accelerate's sequence
parallelism (DeepSpeed Ulysses sp=2, ZeRO-2) on 2 CPU processes, launched both ways a
user would: torchrun with ``SFTConfig(parallelism_config=...)``, and ``accelerate launch
--config_file`` with the SP layout in the YAML (``args.parallelism_config`` is None there).

On each: the loss of step 1 is the one-process loss of transformers' own model with the
documents isolated, within 1e-5; the loss falls over 20 steps; resumed from the step-10
checkpoint, steps 11-20 repeat the losses and the data state. Both routes save the same
data state (the SP size read from where Accelerate has it). The SFTConfig settings under
which TRL would silently train on something else are refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO
from test_hf_examples import TOL, _check_run, _example, _launch, _losses, _one_process_loss
from test_hf_examples import manifest as manifest  # the module's shards (a fixture)

from ulysses_mm.core.errors import ConfigError
from ulysses_mm.hf import trainer as hf_trainer
from ulysses_mm.hf.trl import check_sft_config, seq_lengths

SCRIPT = str(REPO / "examples" / "hf_trl_sft.py")
STATE = "checkpoint-{}/ulysses_mm_data.json"


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _train(route: list[str] | None, manifest: Path, out: Path, *args: str) -> None:
    """Run the example on 2 processes: torchrun (``route`` None) or ``route``."""
    if route is None:
        _launch(2, "hf_trl_sft.py", str(manifest), str(out), *args)
        return
    done = _run([*route, SCRIPT, str(manifest), str(out), *args])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _accelerate(tmp: Path, seq_len: int) -> list[str]:
    """``accelerate launch`` with the SP layout in its config file only."""
    config = tmp / "sp2.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
        "deepspeed_config: {}\nnum_machines: 1\nnum_processes: 2\nparallelism_config:\n"
        "  parallelism_config_sp_size: 2\n  parallelism_config_sp_backend: deepspeed\n"
        f"  parallelism_config_sp_seq_length: {seq_len}\n"
        "  parallelism_config_sp_seq_length_is_variable: false\n"
        "  parallelism_config_sp_attn_implementation: sdpa\n"
    )
    with socket.socket() as s:  # a free port for the rendezvous, as --standalone picks
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    return [*launch, "--main_process_port", str(port)]


def _train_and_resume(route: list[str] | None, manifest: Path, out: Path, *args: str) -> dict:
    _train(route, manifest, out, *args)
    losses = _losses(out)
    _check_run(losses, _one_process_loss(_example("hf_trainer"), manifest))
    again = out.with_name(out.name + "-resumed")
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("checkpoint-20", "losses.json"))
    _train(route, manifest, again, *args, "--resume")
    resumed = _losses(again)
    for step in range(11, 21):
        assert abs(resumed[step] - losses[step]) < TOL, (step, resumed[step], losses[step])
    state = json.loads((out / STATE.format(20)).read_text())
    assert json.loads((again / STATE.format(20)).read_text()) == state
    return state


def test_sft_trainer_on_both_launch_routes(manifest, tmp_path):
    by_args = _train_and_resume(None, manifest, tmp_path / "args", "--sp", "2")
    seq_len = json.loads(manifest.read_text())["seq_len"]
    by_yaml = _train_and_resume(_accelerate(tmp_path, seq_len), manifest, tmp_path / "yaml")
    assert by_yaml == by_args
    # one sample per step (sp=2 over 2 processes, dp=1): 20 steps = 20 samples
    assert by_args["loader"]["position"] == 20, by_args
    assert _losses(tmp_path / "yaml") == _losses(tmp_path / "args")


def test_sp_size_from_accelerate_state(monkeypatch):
    """On the YAML route ``args.parallelism_config`` is None; Accelerate's state has it."""
    from accelerate.state import AcceleratorState

    args = SimpleNamespace(parallelism_config=None)
    monkeypatch.setattr(AcceleratorState, "_shared_state", {})
    assert hf_trainer.sp_size(args) == 1
    state = {"parallelism_config": SimpleNamespace(sp_size=2)}
    monkeypatch.setattr(AcceleratorState, "_shared_state", state)
    assert hf_trainer.sp_size(args) == 2
    assert hf_trainer.sp_size(SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=4))) == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"packing": True}, "packing=True"),
        ({"padding_free": True}, "padding_free=True"),
        ({"shuffle_dataset": True}, "shuffle_dataset=True"),
        ({"completion_only_loss": True}, "completion_only_loss=True"),
        ({"max_length": 1024}, "max_length=1024"),
        ({"parallelism_config": SimpleNamespace(sp_size=1)}, "sequence parallelism"),
        ({}, "isolate_documents"),  # transformers' sdpa as DeepSpeed's core
    ],
)
def test_sft_config_refused(change, message):
    sp2 = SimpleNamespace(sp_size=2, sp_handler=SimpleNamespace(sp_attn_implementation="sdpa"))
    args = SimpleNamespace(
        **{"packing": False, "padding_free": False, "max_length": None, "parallelism_config": sp2}
        | change
    )
    with pytest.raises(ConfigError, match=message):
        check_sft_config(args, seq_len=2048)


def test_sft_trainer_refuses_before_training(manifest, tmp_path):
    """A max_length shorter than our samples (TRL's default 1,024 against 8,192-token
    samples; 64 against these 128) stops the trainer at its construction, in one line."""
    code = (
        "import sys; sys.path.insert(0, 'examples')\n"
        "from hf_trainer import build_model\n"
        "from trl import SFTConfig, SFTTrainer\n"
        "from ulysses_mm.hf.tokenizer import build_tokenizer\n"
        "from ulysses_mm.hf.trl import shard_dataset, sft_callbacks, trl_dataset\n"
        "from ulysses_mm.config import DataConfig\n"
        f"ds = trl_dataset({str(manifest)!r}, data=DataConfig())\n"
        "m = shard_dataset(ds).stream.order.manifests[0]\n"
        "SFTTrainer(build_model(m.token_space.vocab_size), train_dataset=ds,\n"
        "    processing_class=build_tokenizer(m.token_space, m.tokenizers),\n"
        f"    args=SFTConfig({str(tmp_path)!r}, max_length=64, max_steps=2, use_cpu=True,\n"
        "    report_to=[]),\n"
        "    callbacks=sft_callbacks(ds))\n"
    )
    done = _run([sys.executable, "-c", code])
    assert done.returncode != 0
    assert "ConfigError: SFTConfig(max_length=64) would cut every 128-token" in done.stderr, (
        done.stderr[-3000:]
    )


def test_seq_lengths_are_the_documents():
    assert seq_lengths([0, 1, 2, 0, 1, 5, 6, 0]) == [3, 2, 2, 1]
