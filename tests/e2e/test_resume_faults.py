"""A broken checkpoint under ``--resume`` and an unreadable ``model.init_from`` end in one
line naming the file, exit 2, before any process starts; a sound one passes the
pre-flight and reaches the process launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save as save_safetensors
from train_data import prepare_dna, refused, run_config

from ulysses_mm.cli import main
from ulysses_mm.shards.manifest import Manifest

SEQ = 256
TAG = "step_00000004"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    return prepare_dna(tmp_path_factory.mktemp("resume-faults"), "dna", records=6, seq_len=SEQ)


@pytest.fixture
def no_processes(monkeypatch):
    """Starting a process is where the pre-flight has passed: the test sees it as this
    error (a refusal must come before it)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr("ulysses_mm.parallel.launch.run_world", refuse)


def _checkpoint(tmp: Path, manifest: Path, zero_stage: int = 0) -> Path:
    """A checkpoint directory as ``checkpoint.save`` leaves it (DeepSpeed's model states
    a real torch archive), ``latest`` naming it."""
    ckpt = tmp / "run" / "checkpoints"
    tag = ckpt / TAG
    tag.mkdir(parents=True)
    torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")
    (tag / "model.safetensors").write_bytes(save_safetensors({"w": torch.zeros(2)}))
    space = Manifest.load(str(manifest)).token_space
    (tag / "token_space.json").write_text(json.dumps(space.to_dict()))
    (tag / "run_config.yaml").write_text(yaml.safe_dump({"deepspeed": {"zero_stage": zero_stage}}))
    (ckpt / "latest").write_text(TAG + "\n")
    return ckpt


def _resume(capsys, tmp: Path, manifest: Path, *overrides: str) -> str:
    return refused(capsys, str(run_config(tmp, manifest)), *overrides, "--resume")


def test_a_sound_checkpoint_passes_the_preflight(tmp_path, manifest, no_processes):
    _checkpoint(tmp_path, manifest)
    with pytest.raises(AssertionError, match="a process was started"):
        main(["train", str(run_config(tmp_path, manifest)), "--resume"])


@pytest.mark.parametrize(
    ("pointer", "expect"),
    [
        ("", "is empty"),
        ("\n", "is empty"),
        ("step_00000099\n", "names step_00000099, which does not exist"),
        ("../../../\n", "names '../../../', which is not a checkpoint directory beside it"),
        ("..\n", "names '..', which is not a checkpoint directory beside it"),
        (f"{TAG}/../{TAG}\n", "which is not a checkpoint directory beside it"),
        ("ABSOLUTE", "which is not a checkpoint directory beside it"),
    ],
)
def test_a_bad_latest_pointer_is_one_line(
    tmp_path, manifest, no_processes, capsys, pointer, expect
):
    ckpt = _checkpoint(tmp_path, manifest)
    if pointer == "ABSOLUTE":
        pointer = str(ckpt / TAG) + "\n"
    (ckpt / "latest").write_text(pointer)
    err = _resume(capsys, tmp_path, manifest)
    assert expect in err and str(ckpt / "latest") in err, err


def test_a_pointer_that_is_not_text_is_one_line(tmp_path, manifest, no_processes, capsys):
    ckpt = _checkpoint(tmp_path, manifest)
    (ckpt / "latest").write_bytes(b"\xff\xfe\x00step")
    err = _resume(capsys, tmp_path, manifest)
    assert f"cannot read the checkpoint pointer {ckpt / 'latest'}" in err, err


def test_a_tag_without_model_states_is_one_line(tmp_path, manifest, no_processes, capsys):
    ckpt = _checkpoint(tmp_path, manifest)
    (ckpt / "empty").mkdir()
    (ckpt / "latest").write_text("empty\n")
    err = _resume(capsys, tmp_path, manifest)
    assert f"checkpoint {ckpt / 'empty'} has no mp_rank_00_model_states.pt" in err, err


def test_truncated_model_states_are_one_line(tmp_path, manifest, no_processes, capsys):
    ckpt = _checkpoint(tmp_path, manifest)
    states = ckpt / TAG / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:40])
    err = _resume(capsys, tmp_path, manifest)
    assert f"{states} is not a torch checkpoint" in err, err


def test_a_checkpoint_without_its_weights_is_one_line(tmp_path, manifest, no_processes, capsys):
    ckpt = _checkpoint(tmp_path, manifest)
    (ckpt / TAG / "model.safetensors").unlink()
    err = _resume(capsys, tmp_path, manifest)
    assert f"checkpoint {ckpt / TAG} has no model.safetensors" in err, err


def test_another_zero_stage_is_one_line(tmp_path, manifest, no_processes, capsys):
    ckpt = _checkpoint(tmp_path, manifest, zero_stage=3)
    err = _resume(capsys, tmp_path, manifest)
    assert f"checkpoint {ckpt / TAG} was saved with deepspeed.zero_stage=3" in err, err


def test_zero_without_optimizer_partitions_is_one_line(tmp_path, manifest, no_processes, capsys):
    ckpt = _checkpoint(tmp_path, manifest, zero_stage=1)
    err = _resume(capsys, tmp_path, manifest, "deepspeed.zero_stage=1")
    assert f"checkpoint {ckpt / TAG} has no zero_pp_rank_*_optim_states.pt" in err, err


def test_zero3_without_its_model_states_is_one_line(tmp_path, manifest, no_processes, capsys):
    ckpt = _checkpoint(tmp_path, manifest)
    (ckpt / TAG / "run_config.yaml").unlink()  # no stage recorded: the files decide
    err = _resume(capsys, tmp_path, manifest, "deepspeed.zero_stage=3")
    assert "has no zero_pp_rank_*_mp_rank_00_model_states.pt" in err, err
    assert "written under another deepspeed.zero_stage" in err, err


# -- model.init_from ------------------------------------------------------------------


def _hf_checkpoint(tmp: Path, manifest: Path) -> Path:
    """A transformers Llama directory matching the test's model section (its vocabulary
    the dna modality's), with a sound safetensors file."""
    space = Manifest.load(str(manifest)).token_space
    hf = tmp / "hf"
    hf.mkdir()
    config = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "vocab_size": space.range("dna").size,
    }
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "model.safetensors").write_bytes(save_safetensors({"lm_head.weight": torch.zeros(2)}))
    return hf


def _init_from(capsys, tmp: Path, manifest: Path, hf: Path) -> str:
    cfg = run_config(tmp, manifest, init_from=str(hf), text_modality="dna")
    return refused(capsys, str(cfg))


def test_a_readable_init_from_passes_the_preflight(tmp_path, manifest, no_processes):
    hf = _hf_checkpoint(tmp_path, manifest)
    cfg = run_config(tmp_path, manifest, init_from=str(hf), text_modality="dna")
    with pytest.raises(AssertionError, match="a process was started"):
        main(["train", str(cfg)])


@pytest.mark.parametrize(
    "damage",
    ["truncated", "empty", "not safetensors", "header garbage", "huge header"],
)
def test_an_unreadable_safetensors_file_is_one_line(
    tmp_path, manifest, no_processes, capsys, damage
):
    hf = _hf_checkpoint(tmp_path, manifest)
    f = hf / "model.safetensors"
    body = {
        "truncated": f.read_bytes()[:-3],
        "empty": b"",
        "not safetensors": b"PK\x03\x04 this is a zip, not safetensors" * 4,
        "header garbage": (24).to_bytes(8, "little") + b"{not json at all, really}",
        "huge header": (10**15).to_bytes(8, "little") + b"{}",
    }[damage]
    f.write_bytes(body)
    err = _init_from(capsys, tmp_path, manifest, hf)
    assert f"{f} is not a readable safetensors file" in err, err


def test_an_unreadable_shard_of_an_index_is_one_line(tmp_path, manifest, no_processes, capsys):
    hf = _hf_checkpoint(tmp_path, manifest)
    (hf / "model.safetensors").rename(hf / "model-00001-of-00002.safetensors")
    (hf / "model-00002-of-00002.safetensors").write_bytes(b"\x00" * 5)
    weight_map = {
        "lm_head.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors",
    }
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    err = _init_from(capsys, tmp_path, manifest, hf)
    assert f"{hf / 'model-00002-of-00002.safetensors'} is not a readable" in err, err


@pytest.mark.parametrize(
    ("index", "expect"),
    [
        ("{not json", "is not a safetensors index"),
        ("{}", "is not a safetensors index: no weight_map"),
        ('{"weight_map": {"lm_head.weight": "gone.safetensors"}}', "names gone.safetensors"),
    ],
)
def test_a_bad_index_is_one_line(tmp_path, manifest, no_processes, capsys, index, expect):
    hf = _hf_checkpoint(tmp_path, manifest)
    (hf / "model.safetensors.index.json").write_text(index)
    err = _init_from(capsys, tmp_path, manifest, hf)
    assert expect in err and str(hf / "model.safetensors.index.json") in err, err


@pytest.mark.parametrize(
    ("body", "expect"),
    [
        (b'{"model_type": "llama",', "is not valid JSON"),
        (b"", "is not valid JSON"),
        (b"\xff\xfe\x00\x01", "is not valid JSON"),
        (b"[1, 2]", "is not a JSON object"),
        (b'{"model_type": "llama"}', "has no 'num_attention_heads'"),
        (b'{"model_type": "llama", "num_attention_heads": [4]}', "has a bad value"),
        (
            b'{"model_type": "llama", "num_attention_heads": "4"}',
            "num_attention_heads is the string '4', not a number; write it without quotes",
        ),
    ],
)
def test_a_bad_config_json_is_one_line(tmp_path, manifest, no_processes, capsys, body, expect):
    hf = _hf_checkpoint(tmp_path, manifest)
    (hf / "config.json").write_bytes(body)
    err = _init_from(capsys, tmp_path, manifest, hf)
    assert expect in err and str(hf / "config.json") in err, err


def test_a_bad_token_space_json_is_one_line(tmp_path, manifest, no_processes, capsys):
    hf = _hf_checkpoint(tmp_path, manifest)
    (hf / "token_space.json").write_text("{broken")
    err = _init_from(capsys, tmp_path, manifest, hf)
    assert f"{hf / 'token_space.json'} is not a token space" in err, err


def _partitions(ckpt: Path, ranks: int) -> None:
    for r in range(ranks):
        torch.save({}, ckpt / TAG / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def test_zero_partitions_of_another_world_are_one_line(tmp_path, manifest, no_processes, capsys):
    """DeepSpeed refuses, inside every rank, optimizer partitions saved by another number
    of ranks; the pre-flight says so first, with what would work."""
    ckpt = _checkpoint(tmp_path, manifest, zero_stage=1)
    _partitions(ckpt, 2)
    err = _resume(capsys, tmp_path, manifest, "deepspeed.zero_stage=1", "parallel.sp=1")
    assert f"checkpoint {ckpt / TAG} holds the ZeRO partitions of 2 ranks" in err, err
    assert "this run has dp × sp = 1" in err and "resume on 2 ranks" in err, err
    with pytest.raises(AssertionError, match="a process was started"):  # as many ranks: passes
        main(
            ["train", str(run_config(tmp_path, manifest)), "--resume"]
            + ["deepspeed.zero_stage=1", "parallel.sp=2", "--nproc", "2"]
        )


def test_truncated_optimizer_partitions_are_one_line(tmp_path, manifest, no_processes, capsys):
    ckpt = _checkpoint(tmp_path, manifest, zero_stage=1)
    _partitions(ckpt, 1)
    part = ckpt / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    part.write_bytes(part.read_bytes()[:30])
    err = _resume(capsys, tmp_path, manifest, "deepspeed.zero_stage=1", "parallel.sp=1")
    assert f"{part} is not a torch checkpoint" in err, err


# -- where checkpoints go ---------------------------------------------------------------


def test_a_checkpoint_dir_that_is_a_file_is_one_line(tmp_path, manifest, no_processes, capsys):
    (tmp_path / "a-file").write_text("")
    cfg = str(run_config(tmp_path, manifest))
    err = refused(capsys, cfg, f"train.checkpoint_dir={tmp_path / 'a-file'}")
    assert f"train.checkpoint_dir {tmp_path / 'a-file'} is a file" in err, err
    err = refused(capsys, cfg, f"train.out_dir={tmp_path / 'a-file'}")
    assert f"train.out_dir {tmp_path / 'a-file'} is a file" in err, err


def test_an_unreachable_remote_checkpoint_dir_is_one_line(tmp_path, manifest, no_processes, capsys):
    pytest.importorskip("s3fs")
    options = (
        "data.storage_options={endpoint_url: 'http://127.0.0.1:9', key: a, secret: b, "
        "config_kwargs: {retries: {max_attempts: 1}, connect_timeout: 2}}"
    )
    err = refused(
        capsys, str(run_config(tmp_path, manifest)), "train.checkpoint_dir=s3://none/ckpt", options
    )
    assert "s3://none/ckpt/latest: EndpointConnectionError" in err, err
