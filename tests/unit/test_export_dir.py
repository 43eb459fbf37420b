"""``ulysses-mm export`` writes its directory whole: into a new or empty directory, or over
an earlier export; a directory of other files (a folder of one's own, the run itself) is
refused in one line with those files untouched and nothing written beside them."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.torch import save_file

from ulysses_mm.cli import main
from ulysses_mm.config import ModelConfig, RunConfig, to_dict
from ulysses_mm.model import build_model
from ulysses_mm.train.export import EXPORT_FILES


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint directory as a run writes one: weights, run config, token space."""
    path = tmp_path_factory.mktemp("run") / "checkpoints" / "step_00000001"
    path.mkdir(parents=True)
    model = build_model(ModelConfig(modalities={"dna": 8}), seed=0)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors")
    )
    (path / "run_config.yaml").write_text(yaml.safe_dump(to_dict(RunConfig(model=model.config))))
    (path / "token_space.json").write_text(json.dumps(model.space.to_dict()))
    return path


def _listing(d):
    return {p.name: p.read_bytes() for p in d.iterdir()}


def test_export_refuses_a_directory_of_other_files_and_replaces_an_earlier_export(
    ckpt, tmp_path, capsys
):
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0, capsys.readouterr().err
    first = _listing(out)
    assert {"config.json", "model.safetensors", "token_space.json"} <= set(first)
    assert set(first) <= set(EXPORT_FILES)
    assert main(["export", str(ckpt), str(out)]) == 0  # over an earlier export
    assert _listing(out) == first
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(ckpt), str(empty)]) == 0
    assert set(_listing(empty)) == set(first)
    capsys.readouterr()

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    (mine / "config.json").write_text("{}")  # a name export writes, among others
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")  # only export's names, but no model
    for d, shown in (
        (mine, "(notes.txt)"),
        (partial, "(config.json)"),
        (ckpt, "(run_config.yaml)"),  # the checkpoint itself
    ):
        before = _listing(d)
        assert main(["export", str(ckpt), str(d)]) == 2, d
        err = capsys.readouterr().err
        assert err == (
            f"ulysses-mm export: {d} holds files that are not an earlier export's "
            f"{shown}; export replaces its directory whole: give a new or empty directory\n"
        )
        assert _listing(d) == before  # untouched, nothing beside them
    assert not list(tmp_path.glob(".*"))  # no temporary sibling left
