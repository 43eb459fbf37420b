"""DNA sequence files read as records: FASTA, FASTQ and GenBank, plain or gzip.

The format is sniffed from the content (``>``, ``@``, ``LOCUS``) and gzip from its magic
bytes, never from the file name; Biopython parses (``SimpleFastaParser``,
``FastqGeneralIterator``, ``SeqIO.parse(..., "genbank")``), and its failures and gzip's
become one :class:`~ulysses_mm.tokenize.base.DecodeError` line. The tokenizer
(:mod:`ulysses_mm.tokenize.dna.tokenizer`), the block reader
(:mod:`ulysses_mm.tokenize.dna.stream`) and the fidelity measure
(:mod:`ulysses_mm.tokenize.dna.fidelity`) all read through it.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from typing import IO, Any

from ulysses_mm.tokenize.base import DecodeError


def sniff_format(path: str, head: str, fmt: str | None = None) -> str:
    """fasta / fastq / genbank from the first non-blank line of ``head``, the file's start
    (the content decides, not the name); ``fmt`` (the spec's ``format``) must agree."""
    if not head.strip():
        raise DecodeError(f"{path}: empty file (no sequence records)")
    first = next((ln for ln in head.splitlines() if ln.strip()), "")
    if first.startswith(">"):
        sniffed = "fasta"
    elif first.startswith("@"):
        sniffed = "fastq"
    elif first.startswith("LOCUS"):
        sniffed = "genbank"
    else:
        what = "binary data" if "\x00" in head else f"text starting {first[:40]!r}"
        raise DecodeError(f"{path}: not FASTA ('>'), FASTQ ('@') or GenBank ('LOCUS'): {what}")
    if fmt is not None and fmt != sniffed:
        raise DecodeError(f"{path}: the spec says {fmt}, the file looks like {sniffed}")
    return sniffed


def open_text(path: str) -> IO[str]:
    """Plain or gzip (by magic bytes, not by name), as latin-1 text: every byte is one
    character, so a stray byte reaches the base table and is reported, not mis-decoded."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="latin-1", newline=None)
    return open(path, encoding="latin-1", newline=None)


def iter_records(path: str, fmt: str | None = None) -> Iterator[tuple[str, str]]:
    """(record id, sequence) for every record of a FASTA/FASTQ/GenBank file (plain or gz).

    The format is sniffed from the content; ``fmt`` (the spec's ``format``) must agree.
    Parser and gzip failures become DecodeError with the parser's own reason."""
    for rec_id, seq, _ in iter_annotated_records(path, fmt):
        yield rec_id, seq


def iter_annotated_records(path: str, fmt: str | None = None) -> Iterator[tuple[str, str, str]]:
    """(record id, sequence, header text) for every record: see :func:`iter_records`."""
    try:
        with open_text(path) as handle:
            fmt = sniff_format(path, handle.read(4096), fmt)
            handle.seek(0)
            yield from parse_records(path, handle, fmt)
    except READ_ERRORS as e:
        raise read_error(path, fmt, e) from None


# Biopython parse errors are ValueError/AssertionError; gzip gives EOFError (truncated) or
# BadGzipFile / zlib.error (OSError-like) for corrupt data.
READ_ERRORS = (ValueError, EOFError, OSError, UnicodeError, AssertionError, zlib.error)


def read_error(path: str, fmt: str | None, e: BaseException) -> DecodeError:
    """A parser's or gzip's failure on ``path`` as one DecodeError line."""
    text = str(e).strip()
    reason = text.splitlines()[0] if text else type(e).__name__
    return DecodeError(f"{path}: cannot read as {fmt or 'a sequence file'}: {reason}")


def genbank_text(rec: Any) -> str:
    """A GenBank record's annotation as text: id and description, then one line per feature
    (type, 1-based location, qualifiers)."""
    lines = [f"{rec.id} {rec.description}".strip()]
    for f in rec.features:
        quals = " ".join(f"/{k}={v}" for k, vals in f.qualifiers.items() for v in vals)
        lines.append(f"{f.type} {f.location} {quals}".rstrip())
    return "\n".join(lines)


def parse_records(path: str, handle: IO[str], fmt: str) -> Iterator[tuple[str, str, str]]:
    from Bio import SeqIO  # lazy: Biopython takes ~0.2 s to import; only a read needs it
    from Bio.Seq import UndefinedSequenceError  # lazy: Biopython, as above
    from Bio.SeqIO.FastaIO import SimpleFastaParser  # lazy: Biopython, as above
    from Bio.SeqIO.QualityIO import FastqGeneralIterator  # lazy: Biopython, as above

    if fmt == "fasta":
        for title, seq in SimpleFastaParser(handle):
            yield title.split(None, 1)[0] if title.strip() else "", seq, title
    elif fmt == "fastq":
        for title, seq, _qual in FastqGeneralIterator(handle):
            yield title.split(None, 1)[0] if title.strip() else "", seq, title
    else:
        for rec in SeqIO.parse(handle, "genbank"):
            try:
                seq = str(rec.seq)
            except UndefinedSequenceError:
                raise DecodeError(
                    f"{path}#{rec.id}: GenBank record has no sequence data (empty or absent "
                    "ORIGIN, e.g. a CONTIG-only record)"
                ) from None
            yield rec.id, seq, genbank_text(rec)
