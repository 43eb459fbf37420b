"""``ulysses-mm hf-tokenizer``: a transformers tokenizer whose vocabulary is a manifest's
token space. Round trip over every sample the real DNA pipeline packed; AutoTokenizer
loads it; a transformers model resized to it generates ids that decode to readable names
and encode back; every modality kind gets unique whitespace-free names."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from conftest import REPO
from train_data import prepare_dna

from ulysses_mm.cli import main
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.hf.dataset import ShardDataset
from ulysses_mm.hf.tokenizer import token_names


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hftok")
    manifest = prepare_dna(root, "dna", records=12, seq_len=128, seed=5, length=150)
    out = root / "tokenizer"
    assert main(["hf-tokenizer", str(manifest), str(out)]) == 0
    return manifest, out


def test_round_trip_over_every_packed_sample(written):
    from transformers import AutoTokenizer

    manifest, out = written
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ds = ShardDataset(str(manifest))
    assert len(tok) == ds.space.vocab_size
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<doc>", "</doc>")
    n = ds.stream.order.manifests[0].num_samples
    try:
        for item in itertools.islice(ds, n):
            ids = item["input_ids"].tolist()
            text = tok.decode(ids)
            assert tok.encode(text, add_special_tokens=False) == ids
    finally:
        ds.close()  # its prefetch thread
    assert "<doc> <|dna|> dna:" in text
    assert set(tok.decode(ids, skip_special_tokens=True).split()) <= {
        f"dna:{c}" for c in "ACGTNacgtn"
    }


def test_an_existing_directory_is_refused_in_one_line(written, capsys):
    manifest, out = written
    assert main(["hf-tokenizer", str(manifest), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an empty directory" in err


def test_the_directory_takes_the_umask_not_mkdtemps_0700(written, tmp_path):
    import os

    manifest, _ = written
    old = os.umask(0o027)
    try:
        assert main(["hf-tokenizer", str(manifest), str(tmp_path / "tok")]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "tok").stat().st_mode & 0o777 == 0o750
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "tok").iterdir()} == {0o640}


def test_resize_token_embeddings_and_generate(written):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _, out = written
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    model.resize_token_embeddings(len(tok))
    assert model.get_input_embeddings().num_embeddings == len(tok)
    prompt = tok("<doc> <|dna|> dna:A dna:C dna:G", return_tensors="pt", add_special_tokens=False)
    assert prompt.input_ids.tolist() == [[1, 4, 5, 6, 7]]
    gen = model.generate(
        **prompt, max_new_tokens=12, do_sample=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    ids = gen[0].tolist()
    assert len(ids) > 5 and max(ids) < len(tok)
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert all(" " not in name for name in tok.convert_ids_to_tokens(ids))


def test_every_kind_gets_unique_readable_names():
    vocab = {"dna": 30, "audio": 256, "video": 65792, "text": 256, "codec": 64}
    space = TokenSpace.from_vocab(vocab)
    entries = {
        "dna": {"kind": "dna-base", "params": {"case": "keep", "iupac": "keep"}},
        "audio": {"kind": "audio-mulaw", "params": {"bits": 8}},
        "video": {"kind": "video-h264", "params": {}},
        "text": {"kind": "text", "name": "text-bytes", "params": {}},
        "codec": {"kind": "audio-codec", "params": {"num_quantizers": 4}},
    }
    names = token_names(space, entries)
    assert len(names) == len(set(names)) == space.vocab_size
    assert not any(c.isspace() for n in names for c in n)
    at = {n: i for i, n in enumerate(names)}
    assert at["dna:R"] == space.range("dna").start + "ACGTNRYSWKMBDHV".index("R")
    assert at["audio:+0"] == space.range("audio").start + 128
    assert at["video:1a2b"] == space.range("video").start + 0x1A2B
    assert at["video:1a"] == space.range("video").start + (1 << 16) + 0x1A
    assert at["text:A"] == space.range("text").start + 65
    assert at["text:<0x0A>"] == space.range("text").start + 10
    assert at["codec:q1:3"] == space.range("codec").start + 16 + 3
    # a text tokenizer directory names text ids by its own tokens
    byte_level = token_names(
        TokenSpace.from_vocab({"text": 256}),
        {"text": {"kind": "text"}},
        REPO / "tokenizers" / "text-bytes",
    )
    assert "text:Ġ" in byte_level  # the byte-level space
