"""Text as a modality: a local transformers tokenizer (built and saved by the test, never
downloaded), .txt and .jsonl inputs, exact round trips, and DNA headers / GenBank features
as text next to their sequence, through a whole ``prepare`` run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ulysses_mm.config import PipelineConfig
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.shards.manifest import Manifest, read_verified_shard
from ulysses_mm.shards.prepare.route import route
from ulysses_mm.shards.prepare.run import prepare
from ulysses_mm.shards.reader import read_samples
from ulysses_mm.tokenize.base import DecodeError, TokenizerSpec, build_token_space
from ulysses_mm.tokenize.registry import load_tokenizer

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Captions, transcripts and GenBank annotations are text.",
    "Ulysses splits a million-token sequence over the heads.",
]
HARD = "Zwölf Boxkämpfer jagen Viktor 🧬 quer über den Sylter Deich.\r\n\ttabs  and  spaces\n"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A byte-level BPE trained on a few sentences, wrapped and saved as transformers does."""
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(SENTENCES, trainer)
    path = tmp_path_factory.mktemp("tok") / "bpe"
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def _spec(root: Path, tokenizer: str, vocab_size: int = 300, **params) -> Path:
    p = root / "text.json"
    p.write_text(
        json.dumps(
            {
                "name": "text",
                "modality": "text",
                "kind": "text",
                "vocab_size": vocab_size,
                "params": {"tokenizer": tokenizer, **params},
            }
        )
    )
    return p


def test_text_round_trips_exactly(tok_dir, tmp_path):
    tok = load_tokenizer(_spec(tmp_path, str(tok_dir)))
    space = TokenSpace.from_vocab({"dna": 10, "text": 300})
    src = tmp_path / "a.txt"
    src.write_bytes(HARD.encode("utf-8"))
    (doc,) = tok.encode_file(str(src), space)
    r = space.range("text")
    assert doc.modality == "text" and doc.key == str(src)
    assert doc.tokens[0] == DOC_START and doc.tokens[1] == space.boundary_token("text")
    assert doc.tokens[-1] == DOC_END
    assert ((doc.tokens[2:-1] >= r.start) & (doc.tokens[2:-1] < r.stop)).all()
    assert tok.decode(doc.tokens, space) == HARD
    # trained merges are used: fewer tokens than bytes on the training text
    assert len(tok.encode_text(SENTENCES[0])) < len(SENTENCES[0].encode())


def test_jsonl_takes_the_named_field(tok_dir, tmp_path):
    lines = [{"caption": s, "id": i} for i, s in enumerate(SENTENCES)]
    src = tmp_path / "caps.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    space = TokenSpace.from_vocab({"text": 300})
    tok = load_tokenizer(_spec(tmp_path, str(tok_dir), field="caption"))
    docs = list(tok.encode_file(str(src), space))
    assert [d.key for d in docs] == [f"{src}#{n}" for n in (1, 2, 3)]
    assert [tok.decode(d.tokens, space) for d in docs] == SENTENCES

    # a line without the field is skipped on its own and counted; its neighbours stay
    src.write_text(
        "\n".join(json.dumps(x) for x in ({"caption": "a"}, {"text": "b"}, {"caption": "c"}))
    )
    assert [tok.decode(d.tokens, space) for d in tok.encode_file(str(src), space)] == ["a", "c"]
    assert tok.skipped_records == 1
    assert tok.first_skip_reason == f"{src}:2: no string field 'caption'"
    # a file where no line has it (a misspelt field) fails, naming the first line
    src.write_text(json.dumps({"text": "b"}) + "\n" + json.dumps({"text": "d"}) + "\n")
    with pytest.raises(DecodeError, match=r"caps\.jsonl:1: no string field 'caption'"):
        list(tok.encode_file(str(src), space))
    # skip_missing: false makes a missing field fail its file
    strict = load_tokenizer(_spec(tmp_path, str(tok_dir), field="caption", skip_missing=False))
    src.write_text(json.dumps({"caption": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    with pytest.raises(DecodeError, match=r"caps\.jsonl:2: no string field 'caption'"):
        list(strict.encode_file(str(src), space))
    src.write_text("{not json\n")
    with pytest.raises(DecodeError, match=r"caps\.jsonl:1: not a JSON line"):
        list(tok.encode_file(str(src), space))


def test_a_missing_or_too_large_tokenizer_is_one_line_naming_it(tok_dir, tmp_path):
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(ValueError, match=r"tokenizer directory .*no-such-tokenizer not found") as e:
        load_tokenizer(_spec(tmp_path, str(missing)))
    assert "\n" not in str(e.value) and "nothing is downloaded" in str(e.value)
    with pytest.raises(ValueError, match=r"has 300 ids, more than vocab_size 100"):
        load_tokenizer(_spec(tmp_path, str(tok_dir), vocab_size=100))
    # relative to the spec file
    (tmp_path / "sub").mkdir()
    rel = load_tokenizer(_spec(tmp_path, "../" + tok_dir.parent.name + "/bpe"))
    assert rel.directory.resolve() == tok_dir.resolve()


def test_text_inputs_route_to_the_text_tokenizer():
    kinds = {"dna": "dna-base", "text": "text"}
    assert route("notes/a.TXT", kinds, {}) == "text"
    assert route("s3://b/caps.jsonl", kinds, {}) == "text"
    assert route("a.txt", {"dna": "dna-base"}, {}) is None


def test_shipped_byte_tokenizer_is_the_bytes():
    tok = load_tokenizer(REPO / "tokenizers" / "text-bytes.json")
    assert tok.encode_text(HARD).tolist() == list(HARD.encode("utf-8"))
    assert tok.decode_local(tok.encode_text(HARD)) == HARD


def _annotated_dna(root: Path, place: str) -> Path:
    p = root / f"dna-{place}.json"
    p.write_text(
        json.dumps(
            {
                "name": "dna-annotated",
                "modality": "dna",
                "kind": "dna-base",
                "vocab_size": 10,
                "params": {"annotations": {"spec": "text.json", "place": place}},
            }
        )
    )
    return p


@pytest.mark.parametrize("place", ["document", "prefix"])
def test_headers_and_features_become_text_next_to_their_sequence(tok_dir, tmp_path, place):
    _spec(tmp_path, str(tok_dir))
    dna = load_tokenizer(_annotated_dna(tmp_path, place))
    assert [s.modality for s in dna.companion_specs()] == ["text"]
    space = build_token_space(
        [TokenizerSpec.load(_annotated_dna(tmp_path, place)), *dna.companion_specs()]
    )
    text = dna.text
    gb = str(TESTS / "data" / "yersinia_pestis_pPCP1.gb")
    docs = list(dna.encode_file(gb, space))
    r = space.range("text")
    if place == "document":
        header, seq = docs
        assert (header.modality, seq.modality) == ("text", "dna")
        assert header.key == seq.key + "#header"
        words = text.decode(header.tokens, space)
    else:
        (seq,) = docs
        t = seq.tokens
        cut = int(np.flatnonzero(t == space.boundary_token("dna"))[0])
        assert t[1] == space.boundary_token("text") and (t[2:cut] >= r.start).all()
        words = text.decode(t[:cut], space)
    lines = words.split("\n")
    assert lines[0].startswith("NC_005816.1 Yersinia pestis biovar Microtus str. 91001 plasmid")
    assert "gene [86:1109](+) /locus_tag=YP_pPCP01 /db_xref=GeneID:2767718" in lines
    assert len(lines) == 1 + 41  # one line per feature
    bases = seq.tokens[np.flatnonzero(seq.tokens == space.boundary_token("dna"))[0] :]
    assert dna.decode(bases, space) == dna.decode(
        next(load_tokenizer(REPO / "tokenizers" / "dna-base.json").encode_file(gb, space)).tokens,
        space,
    )
    fq = str(TESTS / "data" / "roche454_reads_wrapped.fastq")
    first = next(dna.encode_file(fq, space))
    if place == "document":
        assert text.decode(first.tokens, space).startswith("FSRRS4401BE7HA [length=395] [gc=36.46]")


def test_prepare_mixes_text_inputs_and_annotated_dna(tok_dir, tmp_path):
    _spec(tmp_path, str(tok_dir), field="caption")
    dna_spec = _annotated_dna(tmp_path, "document")
    (tmp_path / "notes.txt").write_text(HARD)
    (tmp_path / "caps.jsonl").write_text(
        "\n".join(json.dumps({"caption": s}) for s in SENTENCES) + "\n"
    )
    fasta = TESTS / "data" / "human_mt.fa"
    cfg = PipelineConfig(
        name="text-mix",
        sources=[str(tmp_path / "notes.txt"), str(tmp_path / "caps.jsonl"), str(fasta)],
        tokenizers=[str(dna_spec), str(tmp_path / "text.json")],
        output=str(tmp_path / "out"),
        workers=1,
        progress=False,
    )
    cfg.pack.seq_len = 4096
    prepare(cfg)
    m = Manifest.load(str(tmp_path / "out" / "manifest.json"))
    assert list(m.token_space.modalities) == ["dna", "text"]
    assert {Path(e.source).name: (e.status, e.documents) for e in m.inputs} == {
        "notes.txt": ("ok", 1),
        "caps.jsonl": ("ok", 3),
        "human_mt.fa": ("ok", 2),  # the header's text document, then the sequence
    }
    pieces: dict[int, list[np.ndarray]] = {}
    for i in range(len(m.shards)):
        for s in read_samples(read_verified_shard(m, i)):
            for start, length, _, doc, _ in s.segments.tolist():
                pieces.setdefault(doc, []).append(s.tokens[start : start + length])
    docs = [np.concatenate(pieces[d]) for d in sorted(pieces)]
    text = load_tokenizer(tmp_path / "text.json")
    decoded = [
        text.decode(d, m.token_space) for d in docs if d[1] == m.token_space.boundary_token("text")
    ]
    assert sorted(decoded) == sorted([HARD, *SENTENCES, "MT_human"])
