"""Kind ``video-codec`` (a neural video tokenizer from a local directory) through every
command, with nothing outside its folder and its registry line knowing it: a tiny random
transformers ``Emu3VQVAE`` and a TorchScript stand-in with Cosmos DV's interface go
through prepare -> train -> generate (an MP4 PyAV reads) -> ``tokenizer eval`` (PSNR,
``--damage``) -> ``inspect --png`` -> ``hf-tokenizer``; the ids in the shards are the
codec's own for the frames every video kind samples."""

from __future__ import annotations

import json

import av
import numpy as np
import pytest
from conftest import REPO, require_fixture
from video_codecs import write_cosmos, write_emu3, write_spec

from ulysses_mm.cli import main
from ulysses_mm.core.tokenspace import EOF
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.reader import read_samples
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.table import TokenizerTable
from ulysses_mm.train.evaluate import units_for

CLIP = REPO / "tests" / "data" / "rabbit_toy_320x240.webm"
SIZE = 32  # 4 × 4 ids per latent step at 8× spatial
IDS = (SIZE // 8) ** 2
FRAMES = dict(size=SIZE, fps=8.0, max_frames=24, device="cpu")


@pytest.fixture(scope="module", params=["emu3", "cosmos"])
def run(request, tmp_path_factory):
    """A spec of the codec, its shards, and a checkpoint trained 2 steps on them."""
    require_fixture(CLIP.is_file(), "tests/data sample files")
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "emu3":
        spec = write_spec(root / "emu3.json", write_emu3(root / "emu3-vq"), 256, **FRAMES)
    else:
        model = write_cosmos(root / "cosmos-dv", temporal=4, spatial=8, levels=8)
        spec = write_spec(
            root / "cosmos.json", model, 512, format="cosmos", temporal=4, spatial=8, **FRAMES
        )
    shards = root / "shards"
    pipeline = str(REPO / "pipelines" / "video.yaml")
    args = [f"sources=[{CLIP}]", f"tokenizers=[{spec}]", f"output={shards}", "pack.seq_len=64"]
    assert main(["prepare", pipeline, *args]) == 0
    out = root / "train"
    overrides = [
        f"data.train={shards / 'manifest.json'}", f"train.out_dir={out}", "train.steps=2",
        "train.checkpoint_every=2", "parallel.sp=1", "logging.wandb=disabled",
    ]  # fmt: skip
    assert main(["train", str(REPO / "configs" / "debug-tiny.yaml"), *overrides]) == 0
    (ckpt,) = (out / "checkpoints").glob("step_00000002")
    return {"name": request.param, "spec": spec, "shards": shards, "ckpt": ckpt}


def test_the_shards_hold_the_codecs_own_ids(run):
    tok = load_tokenizer(run["spec"])
    manifest = Manifest.load(str(run["shards"] / "manifest.json"))
    space = manifest.token_space
    windows = list(tok.frames(str(CLIP)))
    want = np.concatenate([tok.codec.encode(w[i : i + tok.window])
                           for w in windows for i in range(0, len(w), tok.window)])  # fmt: skip
    samples = [
        s for shard in sorted(run["shards"].glob("*.tar"))
        for s in read_samples(shard.read_bytes(), shard.name)
    ]  # fmt: skip
    ids = np.concatenate([s.tokens[: s.real_tokens] for s in samples]).astype(np.int64)
    video = space.range("video")
    body = ids[(ids >= video.start) & (ids < video.stop)] - video.start
    np.testing.assert_array_equal(body, want.reshape(-1))
    assert (ids == EOF).sum() == len(want)  # one <eof> per latent step
    assert tok.codec.frames(tok.rows_per_window) == tok.window


def test_generate_writes_an_mp4_of_whole_latent_steps(run, tmp_path, capsys):
    out = tmp_path / "gen.mp4"
    rows = 2
    rc = main(
        ["generate", str(run["ckpt"]), "--modality", "video", "--new-tokens",
         str(rows * (IDS + 1) + 1), "--seed", "3", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    tok = load_tokenizer(run["spec"])
    with av.open(str(out)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == tok.codec.frames(rows) and frames[0].shape == (SIZE, SIZE, 3)


def test_tokenizer_eval_quotes_psnr_and_damage(run, capsys):
    args = ["tokenizer", "eval", str(run["spec"]), str(CLIP), "--damage", "0.05", "--json"]
    assert main(args) == 0, capsys.readouterr().err
    (entry,) = json.loads(capsys.readouterr().out)["files"]
    assert np.isfinite(entry["psnr_db"]) and entry["psnr_db"] > 5
    (hurt,) = entry["damaged"]
    assert hurt["rate"] == 0.05 and hurt["worst_psnr_db"] <= hurt["psnr_db"]
    # a row of 16 ids holds 4 frames (Emu3), 9 frames make 3 rows (the causal stand-in)
    per_row = {"emu3": 4.0, "cosmos": 3.0}[run["name"]]
    assert load_tokenizer(run["spec"]).frames_per_row == per_row
    assert entry["tokens_per_frame"] == round(IDS / per_row, 1)
    if run["name"] == "cosmos":  # a real quantizer (the random Emu3's codes mean nothing)
        assert entry["psnr_db"] > 15 and hurt["psnr_db"] < entry["psnr_db"]


def test_inspect_draws_frames_and_hf_tokenizer_names_the_ids(run, tmp_path, capsys):
    png = tmp_path / "sample.png"
    assert main(["inspect", str(run["shards"]), "--sample", "0", "--png", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert "bases" not in capsys.readouterr().out
    tok_dir = tmp_path / "hf"
    assert main(["hf-tokenizer", str(run["shards"] / "manifest.json"), str(tok_dir)]) == 0
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    space = Manifest.load(str(run["shards"] / "manifest.json")).token_space
    assert len(hf) == space.vocab_size
    assert hf.convert_ids_to_tokens(EOF) == "<eof>"


def test_a_bad_spec_is_one_line(tmp_path, capsys):
    model = write_cosmos(tmp_path / "dv", temporal=4, spatial=8, levels=8)
    bad = [
        (dict(format="cosmos", temporal=4, spatial=8, window_frames=8), "1 + k·4"),
        (dict(format="cosmos", temporal=4, spatial=8, size=36), "multiple of"),
        (dict(format="emu3", size=32), "config.json"),
        (dict(format="cosmos", temporal=4, spatial=8, audio={"spec": "a.json"}), "audio"),
    ]
    for params, words in bad:
        spec = write_spec(tmp_path / "bad.json", model, 512, **{"size": 32, **params})
        assert main(["tokenizer", "eval", str(spec), str(CLIP)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err


def test_evaluate_quotes_bits_per_frame_a_row_weighing_its_frames(run, capsys):
    manifest = Manifest.load(str(run["shards"] / "manifest.json"))
    table = TokenizerTable.from_manifest(manifest.tokenizers, manifest.config)
    unit = units_for(manifest.token_space, table)["video"]
    frames_per_row = {"emu3": 4.0, "cosmos": 3.0}[run["name"]]  # only <eof> counts frames
    assert unit.name == "frame" and unit.table[EOF] == unit.table.sum() == frames_per_row
    path = str(run["shards"] / "manifest.json")
    assert main(["evaluate", str(run["ckpt"]), path, "--json"]) == 0, capsys.readouterr().err
    video = json.loads(capsys.readouterr().out)["modalities"]["video"]
    assert video["bits_per_frame"] > 0 and np.isfinite(video["bits_per_frame"])


def _hostile_codecs(root):
    """(name, spec, the words its one line must hold): a codec directory each, damaged as a
    user's download or a wrong setting damages it."""
    emu3 = write_emu3(root / "emu3-vq")
    cosmos = write_cosmos(root / "dv", temporal=4, spatial=8, levels=8)
    cases = []

    def spec(name, model, **params):
        base = dict(FRAMES) | ({"format": "cosmos", "temporal": 4, "spatial": 8}
                              if model.name.startswith("dv") else {})  # fmt: skip
        return write_spec(root / f"{name}.json", model, 512 if "format" in base else 256,
                          **{**base, **params})  # fmt: skip

    config = root / "emu3-config"
    config.mkdir()
    (config / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    cases.append(("config", spec("config", config), f"{config / 'config.json'} is not JSON"))
    weights = root / "emu3-weights"
    weights.mkdir()
    (weights / "config.json").write_text((emu3 / "config.json").read_text())
    (weights / "model.safetensors").write_bytes(b"garbage" * 100)
    bad = weights / "model.safetensors"
    cases.append(("weights", spec("weights", weights), f"{bad} is not a readable safetensors"))
    jit = root / "dv-jit"
    jit.mkdir()
    (jit / "encoder.jit").write_bytes((cosmos / "encoder.jit").read_bytes())
    (jit / "decoder.jit").write_bytes(b"garbage")
    cases.append(("jit", spec("jit", jit), f"{jit / 'decoder.jit'} is not a TorchScript"))
    cases.append(("window", spec("window", emu3, window_frames=0), "window_frames (0)"))
    cases.append(("gpu", spec("gpu", emu3, device="cuda:4096"), "params.device is 'cuda:4096'"))
    cases.append(("device", spec("device", emu3, device="gpu"), "params.device 'gpu'"))
    return cases


def test_a_damaged_codec_is_one_line_at_load_naming_its_file(tmp_path, capsys):
    """Garbage in config.json or the weights, a window of 0 frames, a GPU that is not there:
    ``tokenizer eval`` and ``prepare`` each say so in one line naming the file, once, before
    any clip is decoded, and prepare writes nothing."""
    require_fixture(CLIP.is_file(), "tests/data sample files")
    cases = _hostile_codecs(tmp_path)
    capsys.readouterr()  # save_pretrained's bar
    for name, spec, words in cases:
        assert main(["tokenizer", "eval", str(spec), str(CLIP)]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and str(spec) in err, (name, err)
        out = tmp_path / f"shards-{name}"
        args = [f"sources=[{CLIP}]", f"tokenizers=[{spec}]", f"output={out}", "progress=false"]
        assert main(["prepare", str(REPO / "pipelines" / "video.yaml"), *args]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and str(spec) in err, (name, err)
        assert "DataError" not in err and CLIP.name not in err, (name, err)
        assert not out.exists(), name


def test_weights_that_do_not_load_are_one_line_naming_the_codec(tmp_path, capsys):
    """A safetensors file that reads but does not fit the Emu3VQVAE (a tensor of another
    shape, a tensor missing: transformers would start it from random values) fails when the
    weights load, on the first clip: one line naming the directory, nothing else printed."""
    require_fixture(CLIP.is_file(), "tests/data sample files")
    from safetensors.torch import load_file, save_file

    model = write_emu3(tmp_path / "emu3-vq")
    whole = load_file(str(model / "model.safetensors"))
    name = sorted(whole)[0]
    spec = write_spec(tmp_path / "emu3.json", model, 256, **FRAMES)
    wider = whole | {name: whole[name].new_zeros([*whole[name].shape, 2])}
    fewer = {k: v for k, v in whole.items() if k != name}
    for weights, words in (
        (wider, f"{spec}: cannot load the Emu3Codec in {model} ("),
        (fewer, f"{spec}: the weights in {model} lack 1 tensor(s) of its config.json's "
                f"Emu3VQVAE ({name}, …)"),
    ):  # fmt: skip
        save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
        capsys.readouterr()
        assert main(["tokenizer", "eval", str(spec), str(CLIP)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ulysses-mm tokenizer: {words}") and err.count("\n") == 1, err
