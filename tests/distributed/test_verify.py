"""``ulysses-mm verify`` as users run it: its own processes, or inside torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.tools.verify import VerifyOptions, verify_against_one_process


def _run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_verify_spawns_its_own_world_and_passes():
    out = _run(
        "-m",
        "ulysses_mm",
        "verify",
        "--sp",
        "2",
        "--config",
        "configs/debug-tiny.yaml",
        "--seq-len",
        "512",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS: dp × sp matches one process" in out.stdout
    assert "model.layers.1.mlp.down_proj.weight" in out.stdout  # every parameter is listed
    assert "ratio 1.0000" in out.stdout  # all-to-all bytes as theory says


def test_verify_joins_a_torchrun_world():
    out = _run(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "ulysses_mm",
        "verify",
        "--sp",
        "2",
        "--seq-len",
        "256",
        "model.num_key_value_heads=1",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("PASS") == 1  # rank 0 reports


def test_verify_refuses_impossible_shapes_before_starting():
    out = _run("-m", "ulysses_mm", "verify", "--sp", "3", "--seq-len", "512", timeout=60)
    assert out.returncode == 2
    assert "sp=3 does not divide the 4 query heads and the sequence of 512 tokens" in out.stderr
    assert "[1, 2, 4]" in out.stderr


def test_verify_exit_status_follows_the_comparison(monkeypatch, capsys):
    def fake_world(fn, nproc, cfg, opts):
        return [
            {
                "rank": 0,
                "ok": False,
                "mesh": "",
                "sp": 2,
                "dp": 1,
                "kernel": "sdpa_varlen",
                "backend": "gloo",
                "loss_single": 1.0,
                "loss_parallel": 1.5,
                "per_modality_single": {},
                "per_modality_parallel": {},
                "counts": {},
                "grads": [("w", 0.5, 1.0, False)],
                "bytes_per_layer": 10.0,
                "theory_mha": 10,
                "theory_real": 10,
                "documents": 1,
            }
        ]

    monkeypatch.setattr("ulysses_mm.parallel.launch.run_world", fake_world)
    cfg = load_config(RunConfig, None, ["parallel.sp=2"])
    assert verify_against_one_process(cfg, VerifyOptions(seq_len=64)) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("sp,dp", [(2, 2)])
def test_verify_dp_times_sp_in_process_api(sp, dp):
    cfg = load_config(RunConfig, None, [f"parallel.sp={sp}", f"parallel.dp={dp}"])
    cfg.model.modalities = {"dna": 16, "audio": 32}
    assert verify_against_one_process(cfg, VerifyOptions(seq_len=128)) == 0


def test_verify_reads_the_run_config_and_its_overrides(monkeypatch, tmp_path, capsys):
    """verify takes --config and key=value like every command; --sp/--dp are shortcuts
    for parallel.sp/dp (before, `verify parallel.sp=4` was silently ignored)."""
    from ulysses_mm.cli import main

    seen = {}

    def fake_world(fn, nproc, cfg, opts):
        seen.update(
            nproc=nproc, sp=cfg["parallel"]["sp"], heads=cfg["model"]["num_attention_heads"]
        )
        return []

    monkeypatch.setattr("ulysses_mm.parallel.launch.run_world", fake_world)
    monkeypatch.setattr("ulysses_mm.tools.verify.format_report", lambda *a: "")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  num_attention_heads: 8\n  hidden_size: 64\n")
    assert main(["verify", "--config", str(cfg), "parallel.sp=4", "--seq-len", "64"]) == 0
    assert seen == {"nproc": 4, "sp": 4, "heads": 8}
    assert main(["verify", "--config", str(cfg), "--sp", "2", "--dp", "2", "--seq-len", "64"]) == 0
    assert seen == {"nproc": 4, "sp": 2, "heads": 8}
    assert main(["verify", "--config", str(cfg), "parallel.sp=3", "--seq-len", "64"]) == 2
    assert "sp=3 does not divide the 8 query heads" in capsys.readouterr().err
