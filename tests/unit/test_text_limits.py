"""Text inputs of any size in bounded memory: a ``.jsonl`` skips its bad lines one by one
(counted, and recorded in the manifest's entry for the input), a line or a ``.txt`` over
``params.max_record_bytes`` is refused without being read whole, and a long record is
tokenized in pieces with the ids of one call. Peak RSS is measured in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ulysses_mm.config import PipelineConfig
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.prepare.run import prepare
from ulysses_mm.tokenize.base import DecodeError
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.text import tokenizer as text_mod

REPO = Path(__file__).resolve().parents[2]
BYTES_DIR = REPO / "tokenizers" / "text-bytes"
MiB = 1 << 20


def _spec(root: Path, **params) -> Path:
    p = root / "text.json"
    spec = {"name": "text", "modality": "text", "kind": "text", "vocab_size": 256}
    p.write_text(json.dumps({**spec, "params": {"tokenizer": str(BYTES_DIR), **params}}))
    return p


def _mixed_jsonl(path: Path) -> None:
    lines = [
        json.dumps({"text": "first"}),
        "{not json",
        json.dumps({"other": 1}),
        json.dumps({"text": 5}),
        json.dumps({"text": "x" * 300}),  # over a 200-byte cap
        b"\xff\xfe".decode("latin-1"),  # written as latin-1 below: not UTF-8
        "",
        json.dumps({"text": "last"}),
    ]
    path.write_bytes(b"\n".join(line.encode("latin-1") for line in lines))  # no final newline


def test_jsonl_keeps_the_good_lines_and_counts_the_bad(tmp_path):
    src = tmp_path / "mixed.jsonl"
    _mixed_jsonl(src)
    tok = load_tokenizer(_spec(tmp_path, skip_missing=True, max_record_bytes=200))
    space = TokenSpace.from_vocab({"text": 256})
    docs = list(tok.encode_file(str(src), space))
    assert [tok.decode(d.tokens, space) for d in docs] == ["first", "last"]
    assert [d.key for d in docs] == [f"{src}#1", f"{src}#8"]
    assert tok.skipped_records == 5
    assert (
        tok.first_skip_reason
        == f"{src}:2: not a JSON line: Expecting property name enclosed in double quotes"
    )
    # counts are per file
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "a"}) + "\n")
    assert len(list(tok.encode_file(str(good), space))) == 1 and tok.skipped_records == 0
    # a file of which no line gives a document: its first line's reason
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "y" * 500}) + "\n")
    with pytest.raises(
        DecodeError, match=r"bad\.jsonl:1: a line over max_record_bytes 200 \(513 bytes\)"
    ):
        list(tok.encode_file(str(bad), space))


def test_a_txt_over_the_cap_is_one_decode_error_naming_size_and_cap(tmp_path):
    src = tmp_path / "big.txt"
    src.write_bytes(b"a" * 1000)
    tok = load_tokenizer(_spec(tmp_path, max_record_bytes=999))
    with pytest.raises(DecodeError, match=r"big\.txt: 1000 bytes, over max_record_bytes 999"):
        list(tok.encode_file(str(src), TokenSpace.from_vocab({"text": 256})))
    tok = load_tokenizer(_spec(tmp_path, max_record_bytes=1000))
    (doc,) = tok.encode_file(str(src), TokenSpace.from_vocab({"text": 256}))
    assert len(doc.tokens) == 1000 + 3
    with pytest.raises(ValueError, match=r"max_record_bytes' must be >= 1"):
        load_tokenizer(_spec(tmp_path, max_record_bytes=0))


def test_pieces_end_between_words_and_give_the_ids_of_one_call(tmp_path, monkeypatch):
    text = ("Zwölf Boxkämpfer jagen Viktor 🧬 quer über den Deich.\n  tabs\tand  spaces " * 40)[:-1]
    pieces = list(text_mod.text_pieces(text, 100))
    assert "".join(pieces) == text and len(pieces) > 20
    assert all(len(p) <= 100 for p in pieces)
    assert list(text_mod.text_pieces("short", 100)) == ["short"]
    assert "".join(text_mod.text_pieces("x" * 1000, 64)) == "x" * 1000  # no place: cut at size
    # a trained byte-level BPE gives the same ids in pieces as in one call
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator([text], trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(tmp_path / "bpe")
    spec = _spec(tmp_path)
    spec.write_text(
        spec.read_text().replace(str(BYTES_DIR), str(tmp_path / "bpe")).replace("256", "400")
    )
    tok = load_tokenizer(spec)
    whole = tok.encode_text(text)
    monkeypatch.setattr(text_mod, "_PIECE_CHARS", 100)
    assert tok.encode_text(text).tolist() == whole.tolist()
    assert tok.decode_local(whole) == text


def test_prepare_records_the_skipped_lines_in_the_manifest(tmp_path):
    _mixed_jsonl(tmp_path / "mixed.jsonl")
    (tmp_path / "clean.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    cfg = PipelineConfig(
        name="text-limits",
        sources=[str(tmp_path / "mixed.jsonl"), str(tmp_path / "clean.jsonl")],
        tokenizers=[str(_spec(tmp_path, skip_missing=True, max_record_bytes=200))],
        output=str(tmp_path / "out"),
        workers=1,
        progress=False,
    )
    cfg.pack.seq_len = 64
    prepare(cfg)
    m = Manifest.load(str(tmp_path / "out"))
    by = {Path(e.source).name: e for e in m.inputs}
    assert (by["mixed.jsonl"].status, by["mixed.jsonl"].documents) == ("ok", 2)
    assert by["mixed.jsonl"].skipped_records == 5
    assert "mixed.jsonl:2: not a JSON line" in by["mixed.jsonl"].skip_reason
    assert by["clean.jsonl"].skipped_records == 0
    raw = json.loads((tmp_path / "out" / "manifest.json").read_text())["inputs"]
    assert {Path(e["source"]).name: "skipped_records" in e for e in raw} == {
        "mixed.jsonl": True,
        "clean.jsonl": False,  # an input with nothing skipped keeps the old entry
    }


_PEAK = textwrap.dedent(
    """
    import json, resource, sys
    from ulysses_mm.core.tokenspace import TokenSpace
    from ulysses_mm.tokenize.registry import load_tokenizer
    tok = load_tokenizer(sys.argv[1])
    space = TokenSpace.from_vocab({"text": 256})
    list(tok.encode_file(sys.argv[2], space))  # warm: imports, first calls
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    docs = list(tok.encode_file(sys.argv[3], space))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth": (after - before) * 1024, "docs": len(docs),
                      "tokens": sum(len(d.tokens) for d in docs),
                      "skipped": tok.skipped_records}))
    """
)


def _peak_growth(spec: Path, warm: Path, src: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(spec), str(warm), str(src)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_line_over_the_cap_is_skipped_in_bounded_memory(tmp_path):
    cap = 1 * MiB
    warm = tmp_path / "warm.jsonl"
    warm.write_text(json.dumps({"text": "warm " * 1000}) + "\n")
    src = tmp_path / "huge.jsonl"
    with open(src, "w") as f:
        f.write(json.dumps({"text": "before"}) + "\n")
        f.write(json.dumps({"text": "y" * (3 * MiB)}) + "\n")  # never read whole
        f.write(json.dumps({"text": "after"}) + "\n")
    r = _peak_growth(_spec(tmp_path, max_record_bytes=cap), warm, src)
    assert (r["docs"], r["skipped"]) == (2, 1)
    assert r["growth"] < 20 * cap, r  # reading it whole and tokenizing: ~235 x 3 MiB


def test_a_long_record_is_tokenized_in_bounded_memory(tmp_path):
    size = 4 * MiB
    warm = tmp_path / "warm.txt"
    warm.write_text("warm " * 1000)
    src = tmp_path / "long.txt"
    src.write_text("word " * (size // 5))
    size = src.stat().st_size
    r = _peak_growth(_spec(tmp_path), warm, src)
    assert (r["docs"], r["tokens"]) == (1, size + 3)
    # text, its bytes and int64 ids (~12 bytes per byte) plus one piece's working set,
    # against ~235 bytes per byte in one tokenizer call
    assert r["growth"] < 40 * size, r
