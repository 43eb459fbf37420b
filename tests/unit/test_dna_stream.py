"""DNA read as a stream in blocks gives exactly what ``encode_file`` gives (Biopython's
parsers): the same tokens and documents, the same error line, for plain and odd files
(wrapped, CRLF, lone CR, tabs, trailing blanks, empty records, bad characters, truncated
gzip), whatever the block size, and a record longer than a block is never held whole."""

from __future__ import annotations

import gzip
import io

import numpy as np
import pytest

from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.shards.prepare.staged import StagedWriter
from ulysses_mm.tokenize.base import DecodeError, TokenizerSpec
from ulysses_mm.tokenize.dna import stream as dna_stream
from ulysses_mm.tokenize.dna.tokenizer import DnaTokenizer, alphabet


def make(case="keep", iupac="to_n", invalid="error", **extra) -> DnaTokenizer:
    spec = TokenizerSpec(
        name="t",
        modality="dna",
        kind="dna-base",
        vocab_size=len(alphabet(case, iupac)),
        params={"case": case, "iupac": iupac, "invalid": invalid, **extra},
    )
    return DnaTokenizer(spec)


def _seq(rng, n: int, letters: str = "ACGTNacgtnRYK") -> str:
    return "".join(rng.choice(list(letters), n))


def _fasta(rng, widths=(60, 60, 0, 7, 1000), eol="\n") -> str:
    out = ["\n", "  \n"]  # blank lines before the first record are skipped
    for i, n in enumerate([130, 0, 61, 5, 2500]):
        seq = _seq(rng, n)
        w = widths[i] or max(n, 1)
        out.append(f">r{i} some description {i}{eol}")
        out += [seq[j : j + w] + eol for j in range(0, n, w)]
        if i == 2:
            out.append(eol)  # a blank line inside a record
    return "".join(out)


def _fastq(rng, n: int = 40, wrap: int = 0) -> str:
    out = []
    for i in range(n):
        seq = _seq(rng, int(rng.integers(1, 120)), "ACGTN")
        qual = "".join(rng.choice(list("IH@+#!"), len(seq)))
        if wrap and i % 7 == 3:
            seq_lines = "\n".join(seq[j : j + wrap] for j in range(0, len(seq), wrap))
            qual_lines = "\n".join(qual[j : j + wrap] for j in range(0, len(qual), wrap))
            out.append(f"@q{i} x\n{seq_lines}\n+\n{qual_lines}\n")
        else:
            plus = f"+q{i} x" if i % 5 == 1 else "+"
            out.append(f"@q{i} x\n{seq}\n{plus}\n{qual}\n")
    return "".join(out)


RNG = np.random.default_rng(5)
FASTA = _fasta(RNG)
FASTQ = _fastq(RNG)
CASES = {
    "fasta": FASTA,
    "fasta_crlf": _fasta(RNG, eol="\r\n"),
    "fasta_lone_cr": FASTA.replace("\n>r3", "\r>r3").replace("\n", "\r", 3),
    "fasta_trailing_ws": FASTA.replace("\n", " \t \n", 40).replace("\n", "\x0c\n", 2),
    "fasta_spaces": FASTA.replace("A", "A ", 50),
    "fasta_no_final_newline": FASTA.rstrip("\n"),
    "fasta_header_only": ">only\n",
    "fasta_unwrapped_long": ">long\n" + _seq(RNG, 30000) + "   \n>next\nAC\n",
    "fastq": FASTQ,
    "fastq_wrapped": _fastq(RNG, wrap=13),
    "fastq_crlf": FASTQ.replace("\n", "\r\n"),
    "fastq_trailing_blank": FASTQ + "\n\n",
    "fastq_no_final_newline": FASTQ.rstrip("\n"),
    "fastq_qual_at": "@a\nACGT\n+\n@III\n@b\nGG\n+\nII\n",
}
BAD = {
    "fasta_bad_char": FASTA.replace("ACG", "AXG", 1),
    "fasta_tab_inside": FASTA.replace("AC", "A\tC", 1),
    "fastq_bad_char": FASTQ.replace("\nAC", "\nAU", 1),
    "fastq_space_in_seq": FASTQ.replace("\nAC", "\nA C", 1),
    "fastq_title_mismatch": FASTQ.replace("+q1 x", "+q1 y", 1),
    "fastq_short_qual": FASTQ[: FASTQ.rfind("\n", 0, -2)] + "\n",
    "fastq_no_at": "q0\nACGT\n+\nIIII\n",
    "empty": "",
    "blank": "\n \n",
    "not_dna": "hello\n",
}


def stream_docs(
    tok: DnaTokenizer, data: bytes, space: TokenSpace, tmp_path=None
) -> list[np.ndarray]:
    """The documents of encode_stream's blocks, put back together."""
    docs: list[list[np.ndarray]] = []
    for b in tok.encode_stream(io.BytesIO(data), "src", space):
        offsets = np.concatenate([[0], np.cumsum(b.lengths)])
        for i in range(len(b.lengths)):
            piece = np.asarray(b.tokens[offsets[i] : offsets[i + 1]])
            if i == 0 and b.continues:
                docs[-1].append(piece)
            else:
                docs.append([piece])
    return [np.concatenate(d) for d in docs]


def file_docs(tok: DnaTokenizer, path, space: TokenSpace) -> list[np.ndarray]:
    return [d.tokens for d in tok.encode_file(str(path), space)]


@pytest.fixture(params=[97, 1 << 20], ids=["tiny-blocks", "big-blocks"])
def block(request, monkeypatch):
    monkeypatch.setattr(dna_stream, "BLOCK", request.param)
    return request.param


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("policy", [("keep", "to_n", "error"), ("fold", "keep", "to_n")])
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_stream_gives_the_tokens_of_encode_file(tmp_path, block, name, policy, gz):
    tok = make(*policy)
    space = TokenSpace.from_vocab({"audio": 256, "dna": tok.spec.vocab_size})  # shifted, uint16
    raw = CASES[name].encode("latin-1")
    data = gzip.compress(raw) if gz else raw
    path = tmp_path / "src"
    path.write_bytes(data)
    want = file_docs(tok, path, space)
    got = stream_docs(tok, data, space)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype


@pytest.mark.parametrize("name", sorted(BAD))
def test_stream_fails_with_the_error_of_encode_file(tmp_path, block, name):
    tok = make()
    space = TokenSpace.from_vocab({"dna": tok.spec.vocab_size})
    path = tmp_path / "src"
    path.write_bytes(BAD[name].encode("latin-1"))
    with pytest.raises(DecodeError) as want:
        file_docs(tok, path, space)
    with pytest.raises(DecodeError) as got:
        stream_docs(tok, path.read_bytes(), space)
    assert str(got.value).replace("src", str(path)) == str(want.value)


def test_a_truncated_gzip_fails_as_encode_file_does(tmp_path):
    tok = make()
    space = TokenSpace.from_vocab({"dna": tok.spec.vocab_size})
    path = tmp_path / "src"
    path.write_bytes(gzip.compress(FASTA.encode() * 50)[:-40])
    with pytest.raises(DecodeError) as want:
        file_docs(tok, path, space)
    with pytest.raises(DecodeError) as got:
        stream_docs(tok, path.read_bytes(), space)
    assert str(got.value).replace("src", str(path)) == str(want.value)
    assert "cannot read as fasta" in str(got.value)


def test_genbank_and_annotations_stream_record_by_record(tmp_path):
    from media_factory import TEST_DATA, TOKENIZERS

    tok = DnaTokenizer(TokenizerSpec.load(TOKENIZERS / "dna-annotated.json"))
    space = TokenSpace.from_vocab({"dna": tok.spec.vocab_size, "text": tok.text.spec.vocab_size})
    for name in ("yersinia_pestis_pPCP1.gb", "human_mt.fa", "roche454_reads_wrapped.fastq"):
        path = TEST_DATA / name
        with open(path, "rb") as f:
            got = list(tok.encode_stream(f, str(path), space))
        want = file_docs(tok, path, space)
        np.testing.assert_array_equal(np.concatenate([b.tokens for b in got]), np.concatenate(want))
        assert sum(len(b.lengths) for b in got) == len(want)


def test_a_record_longer_than_a_block_streams_in_pieces(tmp_path, monkeypatch):
    """A 2 Mbp record on one line read in 64 KiB blocks: no block holds more than a block
    of bases, and the pieces make the one document the staging writer takes whole."""
    monkeypatch.setattr(dna_stream, "BLOCK", 1 << 16)
    tok = make()
    space = TokenSpace.from_vocab({"dna": tok.spec.vocab_size})
    seq = _seq(np.random.default_rng(1), 2_000_000, "ACGT")
    data = f">chr1\n{seq}\n>chr2\nACGT\n".encode()
    blocks = list(tok.encode_stream(io.BytesIO(data), "src", space))
    assert len(blocks) > 25 and max(len(b.tokens) for b in blocks) <= 3 * (1 << 16)
    w = StagedWriter(str(tmp_path / "e"), space)
    for b in blocks:
        w.add(b)
    w.commit()
    assert (w.documents, w.tokens) == (2, 2_000_000 + 3 + 4 + 3)
