"""DNA tokenizer: exact round trips under each policy, every format, and true errors."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import numpy as np
import pytest
from media_factory import (
    TEST_DATA,
    TOKENIZERS,
    random_dna,
    soft_mask,
    write_fasta,
    write_fastq,
    write_genbank,
)

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.tokenize.base import DecodeError, TokenizerSpec
from ulysses_mm.tokenize.dna.tokenizer import DnaTokenizer, alphabet
from ulysses_mm.tokenize.registry import load_tokenizer

AMBIG = "RYSWKMBDHV"
POLICIES = list(itertools.product(["keep", "fold"], ["keep", "to_n"]))


def make(case: str = "keep", iupac: str = "to_n", invalid: str = "error", **extra) -> DnaTokenizer:
    size = len(alphabet(case, iupac))
    spec = TokenizerSpec(
        name="t",
        modality="dna",
        kind="dna-base",
        vocab_size=size,
        params={"case": case, "iupac": iupac, "invalid": invalid, **extra},
    )
    return DnaTokenizer(spec)


def expected(seq: str, case: str, iupac: str, invalid: str = "error") -> str:
    """The policy, written independently of the tokenizer's byte table."""
    out = []
    for ch in seq:
        up = ch.upper()
        if up not in "ACGTN" + AMBIG:
            assert invalid == "to_n"
            out.append("N")
            continue
        c = ch if case == "keep" else up
        if up in AMBIG and iupac == "to_n":
            c = "n" if c.islower() else "N"
        out.append(c)
    return "".join(out)


def mixed_records(seed: int = 0) -> list[tuple[str, str]]:
    """Random records with soft-masked runs and IUPAC codes, one empty, one long."""
    rng = np.random.default_rng(seed)
    recs = []
    for i, n in enumerate([0, 1, 59, 60, 61, 500, 5000]):
        s = random_dna(rng, n, "ACGTTGCAN" + AMBIG)
        recs.append((f"chr{i}", soft_mask(rng, s) if n else s))
    return recs


def space_for(tok: DnaTokenizer) -> TokenSpace:
    return TokenSpace.from_vocab({"dna": tok.spec.vocab_size})


@pytest.mark.parametrize(("case", "iupac"), POLICIES)
@pytest.mark.parametrize("fmt", ["fa", "fa.gz", "fq", "fq.gz", "fq-wrapped", "gb", "gb.gz"])
def test_round_trip_every_policy_and_format(
    tmp_path: Path, case: str, iupac: str, fmt: str
) -> None:
    recs = mixed_records()
    path = tmp_path / f"x.{fmt.replace('-wrapped', '')}"
    if fmt.startswith("fa"):
        write_fasta(path, recs)
    elif fmt.startswith("fq"):
        recs = [r for r in recs if r[1]]  # a FASTQ read is never empty
        write_fastq(path, recs, width=23 if "wrapped" in fmt else None)
    else:
        write_genbank(path, recs)
    tok = make(case, iupac)
    space = space_for(tok)
    docs = list(tok.encode_file(str(path), space))
    assert [d.key for d in docs] == [f"{path}#{rid}" for rid, _ in recs]
    for doc, (_rid, seq) in zip(docs, recs):
        if fmt.startswith("gb"):
            seq = seq.upper()  # GenBank sequences are case-insensitive; Biopython reads upper
        t = doc.tokens
        assert doc.modality == "dna" and doc.source == str(path)
        assert t.dtype == space.dtype() and t.ndim == 1
        assert t[0] == DOC_START and t[1] == space.boundary_token("dna") and t[-1] == DOC_END
        assert len(t) == len(seq) + 3  # one token per base
        r = space.range("dna")
        assert ((t[2:-1] >= r.start) & (t[2:-1] < r.stop)).all()
        assert tok.decode(t, space) == expected(seq, case, iupac)


def test_ids_are_the_documented_alphabet() -> None:
    tok = make("keep", "keep")
    space = space_for(tok)
    s = "ACGTN" + AMBIG + "acgtn" + AMBIG.lower()
    ids = tok.encode_sequence(s)
    assert ids.tolist() == list(range(30))
    assert make("fold", "to_n").encode_sequence("ACGTNacgtnRy").tolist() == [
        0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 4, 4,
    ]  # fmt: skip
    assert tok.decode(np.arange(30) + space.range("dna").start, space) == s


def test_decode_in_a_wide_multimodal_space(tmp_path: Path) -> None:
    """Ids offset past 255 (uint16 space): framing must not wrap around in uint8."""
    tok = make("keep", "keep")
    space = TokenSpace.from_vocab({"video": 400, "dna": 30})
    path = write_fasta(tmp_path / "x.fa", mixed_records(1))
    for doc, (_, seq) in zip(tok.encode_file(str(path), space), mixed_records(1)):
        assert doc.tokens.dtype == np.uint16
        assert doc.tokens[2:-1].min(initial=space.range("dna").start) >= space.range("dna").start
        assert tok.decode(doc.tokens, space) == seq
    with pytest.raises(ValueError, match="not a special or a dna id"):
        tok.decode(np.array([space.range("video").start]), space)


def test_duplicate_and_empty_record_ids_get_unique_keys(tmp_path: Path) -> None:
    path = tmp_path / "dup.fa"
    path.write_text(">a\nACGT\n>a second\nGG\n>\nTT\n")
    keys = [d.key for d in make().encode_file(str(path), TokenSpace.from_vocab({"dna": 10}))]
    assert keys == [f"{path}#a", f"{path}#a~1", f"{path}#record2"]


def test_illegal_character_strict_policy_names_record_offset_char(tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "bad.fa", [("ok", "ACGT"), ("chrX", "ACGTAC-GT")])
    tok = make(invalid="error")
    docs = tok.encode_file(str(path), space_for(tok))
    assert next(docs).key.endswith("#ok")
    with pytest.raises(DecodeError) as e:
        next(docs)
    msg = str(e.value)
    assert f"{path}#chrX" in msg and "'-'" in msg and "offset 6" in msg
    # U (RNA), '*' and digits are not nucleotides either
    for seq, ch in [("ACGU", "'U'"), ("AC*G", "'*'"), ("AC1G", "'1'")]:
        p = write_fasta(tmp_path / "b2.fa", [("r", seq)])
        with pytest.raises(DecodeError, match=ch):
            list(tok.encode_file(str(p), space_for(tok)))


def test_illegal_character_to_n_policy_maps_to_n(tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "bad.fa", [("r", "ACuG*-xRy")])
    tok = make("keep", "to_n", invalid="to_n")
    (doc,) = tok.encode_file(str(path), space_for(tok))
    assert tok.decode(doc.tokens, space_for(tok)) == "ACNGNNNNn"
    assert expected("ACuG*-xRy", "keep", "to_n", "to_n") == "ACNGNNNNn"


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("empty.fa", b"", "empty file"),
        ("blank.fa", b"\n\n  \n", "empty file"),
        ("notes.fa", b"just some notes\n>r\nACGT\n", "not FASTA"),
        ("sound.fa", b"RIFF\x00\x00\x00\x00WAVEfmt \x00\x00", "binary data"),
        ("bad.fq", b"@r1\nACGT\n+\nIII\n", "cannot read as"),
        ("genbank.gb", b"LOCUS       X 4 bp DNA\nORIGIN\n//\n", r"cannot read as|no sequence"),
    ],
)
@pytest.mark.filterwarnings("ignore::Bio.BiopythonParserWarning")
def test_bad_files_raise_decode_error(
    tmp_path: Path, name: str, content: bytes, reason: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DecodeError, match=reason) as e:
        list(make().encode_file(str(path), TokenSpace.from_vocab({"dna": 10})))
    assert str(path) in str(e.value)


def test_truncated_and_corrupt_gzip(tmp_path: Path) -> None:
    full = write_fasta(tmp_path / "x.fa.gz", mixed_records())
    data = full.read_bytes()
    cut = tmp_path / "cut.fa.gz"
    cut.write_bytes(data[: len(data) // 2])
    space = TokenSpace.from_vocab({"dna": 10})
    with pytest.raises(DecodeError, match=r"ended before|end-of-stream"):
        list(make().encode_file(str(cut), space))
    junk = tmp_path / "junk.fa.gz"
    junk.write_bytes(b"\x1f\x8b" + bytes(range(200)))
    with pytest.raises(DecodeError, match=str(junk)):
        list(make().encode_file(str(junk), space))
    flipped = bytearray(gzip.compress(b">r\n" + b"ACGT" * 100_000))
    flipped[len(flipped) // 2 : len(flipped) // 2 + 50] = bytes(50)  # corrupt the deflate body
    bad = tmp_path / "flipped.fa.gz"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(DecodeError, match=f"{bad}: cannot read as fasta"):
        list(make().encode_file(str(bad), space))
    with pytest.raises(DecodeError, match="no such file"):
        list(make().encode_file(str(tmp_path / "missing.fa"), space))


def test_gzip_is_detected_by_content_not_name(tmp_path: Path) -> None:
    path = tmp_path / "reads.fastq"  # gzip bytes under a plain name
    with gzip.open(path, "wt") as f:
        f.write("@r1\nACGTN\n+\nIIIII\n")
    (doc,) = make().encode_file(str(path), TokenSpace.from_vocab({"dna": 10}))
    assert make().decode(doc.tokens, TokenSpace.from_vocab({"dna": 10})) == "ACGTN"


def test_spec_params_are_checked() -> None:
    with pytest.raises(ValueError, match="vocab_size 10 does not match"):
        DnaTokenizer(TokenizerSpec("t", "dna", "dna-base", 10, {"iupac": "keep"}))
    with pytest.raises(ValueError, match="did you mean 'case'"):
        DnaTokenizer(TokenizerSpec("t", "dna", "dna-base", 10, {"cases": "keep"}))
    with pytest.raises(ValueError, match="must be one of"):
        DnaTokenizer(TokenizerSpec("t", "dna", "dna-base", 10, {"case": "upper"}))
    with pytest.raises(ValueError, match="must be str"):
        DnaTokenizer(TokenizerSpec("t", "dna", "dna-base", 10, {"case": 1}))


# --------------------------------------------------------------------------- real files
def _biopython_records(path: Path, fmt: str) -> list[tuple[str, str]]:
    from Bio import SeqIO

    return [(r.id, str(r.seq)) for r in SeqIO.parse(str(path), fmt)]


@pytest.mark.parametrize(
    ("name", "fmt", "count", "bases"),
    [
        ("human_mt.fa", "fasta", 1, 16569),
        ("roche454_reads_wrapped.fastq", "fastq", 10, 3665),
        ("yersinia_pestis_pPCP1.gb", "genbank", 1, 9609),
    ],
)
def test_real_files_match_biopython_exactly(name: str, fmt: str, count: int, bases: int) -> None:
    path = TEST_DATA / name
    tok = load_tokenizer(TOKENIZERS / "dna-lossless.json")
    space = TokenSpace.from_vocab({"dna": tok.spec.vocab_size})
    docs = list(tok.encode_file(str(path), space))
    ref = _biopython_records(path, fmt)
    assert len(docs) == count == len(ref)
    assert sum(len(d.tokens) - 3 for d in docs) == bases
    for d, (rid, seq) in zip(docs, ref):
        assert d.key == f"{path}#{rid}"
        assert tok.decode(d.tokens, space) == seq  # lossless: case and IUPAC kept


def test_soft_masked_base_in_human_mt() -> None:
    path = TEST_DATA / "human_mt.fa"
    keep = load_tokenizer(TOKENIZERS / "dna-base.json")  # case keep
    fold = make("fold", "to_n")
    (seq,) = [s for _, s in _biopython_records(path, "fasta")]
    assert sum(c.islower() for c in seq) == 1
    for tok in (keep, fold):
        space = TokenSpace.from_vocab({"dna": tok.spec.vocab_size})
        (doc,) = tok.encode_file(str(path), space)
        case = tok.params["case"]
        assert tok.decode(doc.tokens, space) == expected(seq, case, "to_n")
    assert sum(c.islower() for c in keep.normalise(seq)) == 1
    assert fold.normalise(seq) == seq.upper()
