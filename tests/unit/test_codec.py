"""``audio-codec``: a transformers codec (a tiny random EnCodec the test saves) as an audio
tokenizer: never downloads, shapes and id layout, determinism, packing, a training step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from media_factory import tone, write_audio

from ulysses_mm.core.tokenspace import DOC_END, DOC_START
from ulysses_mm.tokenize.base import TokenizerSpec, build_token_space
from ulysses_mm.tokenize.registry import load_tokenizer

RATE, HOP, CODEBOOK = 8000, 16, 16  # 500 frames/s


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import EncodecConfig, EncodecModel

    cfg = EncodecConfig(
        sampling_rate=RATE,
        audio_channels=1,
        num_filters=4,
        hidden_size=8,
        codebook_size=CODEBOOK,
        codebook_dim=8,
        upsampling_ratios=[4, 4],
        num_residual_layers=1,
        num_lstm_layers=1,
        target_bandwidths=[2.0, 4.0, 10.0],  # 2 kbps per quantizer: 1, 2 quantizers
        normalize=False,
        chunk_length_s=None,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("codec") / "tiny-encodec"
    EncodecModel(cfg).eval().save_pretrained(out)
    return out


def _spec(tmp: Path, model: str, n_q: int = 2, tps: float = 1000.0, vocab: int = 32) -> Path:
    path = tmp / "codec.json"
    spec = {
        "name": "tiny-codec",
        "modality": "audio",
        "kind": "audio-codec",
        "vocab_size": vocab,
        "params": {"model": model, "num_quantizers": n_q, "tokens_per_second": tps},
    }
    path.write_text(json.dumps(spec))
    return path


def test_round_trip_shapes_layout_and_determinism(model_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(_spec(tmp_path, str(model_dir)))
    assert tok.tokens_per_second == 1000.0  # type: ignore[attr-defined]
    x = tone(0.5, RATE, 440.0, 0.5)
    ids = tok.encode_waveform(x)  # type: ignore[attr-defined]
    assert ids.shape == (2 * 0.5 * RATE // HOP,)  # 250 frames × 2 quantizers
    assert (ids[0::2] < CODEBOOK).all() and (ids[1::2] >= CODEBOOK).all() and ids.max() < 32
    assert np.array_equal(ids, tok.encode_waveform(x))  # type: ignore[attr-defined]
    wav = tok.decode_waveform(ids)  # type: ignore[attr-defined]
    assert wav.shape == x.shape and np.isfinite(wav).all()
    assert np.array_equal(wav, tok.decode_waveform(ids))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="whole frames"):
        tok.decode_waveform(ids[:-1])  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="out of order"):
        tok.decode_waveform(ids[1:-1])  # type: ignore[attr-defined]


def test_relative_model_dir_file_packing_and_a_training_step(
    model_dir: Path, tmp_path: Path
) -> None:
    from ulysses_mm.config import RunConfig, load_config
    from ulysses_mm.loader.batch import make_batch
    from ulysses_mm.model import apply_memory_policy, build_model
    from ulysses_mm.parallel import Mesh, loss_weights
    from ulysses_mm.shards.pack import DocumentBlock, pack
    from ulysses_mm.train.step import forward_backward

    (tmp_path / "models").symlink_to(model_dir.parent)
    spec_path = _spec(tmp_path, f"models/{model_dir.name}")  # relative to the spec
    tok = load_tokenizer(spec_path)
    space = build_token_space([TokenizerSpec.load(spec_path)])
    wav = write_audio(tmp_path / "a.wav", tone(0.3, 22050, 300.0, 0.5), 22050)  # resampled
    (doc,) = tok.encode_file(str(wav), space)
    t = doc.tokens
    assert t[0] == DOC_START and t[-1] == DOC_END and (len(t) - 3) % 2 == 0
    assert abs((len(t) - 3) / 2 - 0.3 * RATE / HOP) <= 1
    assert tok.decode(t, space).shape[0] == (len(t) - 3) // 2 * HOP
    seq = 256
    block = DocumentBlock.from_documents([t, t], [space.index(doc.modality)] * 2, space.dtype())
    samples = list(pack([block], seq, space.dtype()))
    batch = make_batch(np.stack([s.tokens for s in samples]), [s.segments for s in samples], space)
    cfg = load_config(
        RunConfig,
        None,
        [
            "model.modalities={audio: 32}",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.num_hidden_layers=1",
            "model.loss_tile_tokens=64",
        ],
    )
    model = build_model(cfg.model, space, seed=0)
    apply_memory_policy(model, cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    w = loss_weights(space.modalities, {})
    losses = []
    for _ in range(3):
        opt.zero_grad()
        _, report = forward_backward(model, batch, w, Mesh.single())
        opt.step()
        losses.append(report.total)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_never_downloads_and_checks_the_spec(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not found: no directory .*never downloaded"):
        load_tokenizer(_spec(tmp_path, "nobody/no-such-codec-xyz"))
    with pytest.raises(ValueError, match="tokens_per_second is 150"):
        load_tokenizer(_spec(tmp_path, str(model_dir), tps=150))
    with pytest.raises(ValueError, match="vocab_size 64"):
        load_tokenizer(_spec(tmp_path, str(model_dir), vocab=64))
    with pytest.raises(ValueError, match="no bandwidth giving 3 quantizers"):
        load_tokenizer(_spec(tmp_path, str(model_dir), n_q=3, tps=1500, vocab=48))


def test_tokenizer_eval_measures_a_codec(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ulysses_mm.cli import main

    wav = write_audio(tmp_path / "a.wav", tone(0.25, RATE, 300.0, 0.5), RATE)
    spec = str(_spec(tmp_path, str(model_dir)))
    # --damage: wrong codes stay within their quantizer, so the ids still decode
    assert main(["tokenizer", "eval", spec, str(wav), "--json", "--damage", "0.1"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["files"]
    assert entry["tokens_per_second"] == 1000.0 and isinstance(entry["snr_db"], float)
    (damaged,) = entry["damaged"]
    assert damaged["rate"] == 0.1 and isinstance(damaged["snr_db"], float)
