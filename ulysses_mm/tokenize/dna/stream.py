"""DNA read as a byte stream, in blocks: FASTA and FASTQ at the speed of gzip, in bounded memory.

:meth:`DnaTokenizer.encode_stream <ulysses_mm.tokenize.dna.tokenizer.DnaTokenizer.encode_stream>` gives
the tokens :meth:`~ulysses_mm.tokenize.dna.tokenizer.DnaTokenizer.encode_file` gives (Biopython's
``SimpleFastaParser`` / ``FastqGeneralIterator`` over latin-1 text, ``newline=None``), read
from a binary file object (a local file or an object in a bucket, plain or gzip) a few MiB
at a time:

- **FASTA**: each block of whole lines is cut at its record headers (a ``>`` that starts a
  line) and each record's lines lose their newlines and spaces in one ``bytes.translate``,
  which is what the parser's per-line ``rstrip`` and ``replace(" ", "")`` leave when a line
  holds no other whitespace; a block with other whitespace (tabs, form feeds …) is read
  line by line with the parser's own rule. A record's bases go out as they are read, so
  a record of any length (a chromosome on one line included) costs one block of memory.
- **FASTQ**: a block's lines are taken four at a time while they are plain records (``@``
  title, sequence, ``+`` with no title or the same one, quality as long as the sequence,
  the next line an ``@``, no whitespace in the sequence); all their sequences are
  translated in one call. At the first line that is anything else (wrapped records, a
  blank line, a bad character, a truncated file) the rest of the file goes to
  ``FastqGeneralIterator`` itself, so its output and its errors are Biopython's.
- **GenBank**, and any spec with ``annotations``, go record by record through the same
  parsers as ``encode_file`` (at most one record in memory).

Bases become *codes*: one byte per token, the token-space ids of the specials and of the
DNA range shifted down to follow the specials, so a whole block (bases and the
``<doc> <|dna|>`` … ``</doc>`` framing) is built as one ``bytes`` and turned into the
token space's dtype in one numpy pass.
"""

from __future__ import annotations

import gzip
import io
import re
from collections.abc import Iterator
from itertools import repeat
from typing import IO, TYPE_CHECKING, cast

import numpy as np

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.tokenize.base import DecodeError, TokenBlock
from ulysses_mm.tokenize.dna.records import READ_ERRORS, parse_records, read_error, sniff_format

if TYPE_CHECKING:
    from ulysses_mm.tokenize.dna.tokenizer import DnaTokenizer

BLOCK = 4 << 20  # bytes of (decompressed) input read at a time
WS = b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0"  # str.isspace() over latin-1
_OTHER_WS = re.compile(b"[\t\x0b\x0c\x1c-\x1f\x85\xa0]")  # besides newlines and spaces
_BAD = 255  # code of a byte the policy rejects
_SEP = 254  # code of the newline that joins FASTQ sequences


class Codes:
    """The byte codes of one tokenizer in one token space: specials as themselves, base
    ``i`` as ``num_specials + i``."""

    def __init__(self, tok: DnaTokenizer, space: TokenSpace) -> None:
        r = space.range(tok.modality)  # KeyError here if the space lacks dna
        ns = space.num_specials
        if ns + len(tok.letters) >= _SEP:
            raise ValueError(f"{ns} specials and {len(tok.letters)} bases do not fit a byte")
        self.table = bytes(_BAD if v == _BAD else ns + v for v in tok.table)
        fast = bytearray(self.table)  # whitespace is never a base on the fast paths
        for b in WS + b"+":  # a FASTQ sequence line starting '+' is the parser's '+' line
            fast[b] = _BAD
        fast[ord("\n")] = _SEP
        self.fast = bytes(fast)
        lines = bytearray(self.table)  # whitespace a FASTA line may end with: look closer
        for b in b"\t\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0":
            lines[b] = _BAD
        self.fasta = bytes(lines)
        self.head = bytes([DOC_START, space.boundary_token(tok.modality)])
        self.tail = bytes([DOC_END])
        self.ns, self.shift = ns, r.start - ns
        self.dtype = space.dtype()
        self.modality = space.index(tok.modality)

    def tokens(self, codes: bytes) -> np.ndarray:
        """Codes -> token ids in the space's dtype."""
        a = np.frombuffer(codes, dtype=np.uint8)
        if self.dtype == np.uint8 and not self.shift:
            return a
        t = a.astype(self.dtype)
        if self.shift:
            t[t >= self.ns] += self.shift
        return t


class _Out:
    """Framed pieces, as codes, gathered into :class:`TokenBlock` of about BLOCK tokens."""

    def __init__(self, codes: Codes) -> None:
        self.codes = codes
        self.parts: list[bytes] = []
        self.lens: list[int] = []
        self.many: list[np.ndarray] = []  # lengths of whole documents, after self.lens
        self.size = 0
        self.continues = False  # the next block's first piece carries on an open document
        self.open = False  # the last piece's document is not finished

    def start(self) -> None:
        self.parts.append(self.codes.head)
        self.lens.append(2)
        self.size += 2
        self.open = True

    def bases(self, codes: bytes) -> None:
        if not codes:
            return
        if not self.lens:  # the first piece of a block: the rest of an open document
            self.lens.append(0)
        self.parts.append(codes)
        self.lens[-1] += len(codes)
        self.size += len(codes)

    def end(self) -> None:
        if not self.lens:
            self.lens.append(0)
        self.parts.append(self.codes.tail)
        self.lens[-1] += 1
        self.size += 1
        self.open = False

    def documents(self, codes: bytes, lens: np.ndarray) -> None:
        """Whole framed documents (after the pieces so far, which must not leave one open)."""
        if self.lens:
            self.many.append(np.array(self.lens, dtype=np.int64))
            self.lens = []
        self.parts.append(codes)
        self.many.append(lens)
        self.size += len(codes)

    def flush(self) -> TokenBlock | None:
        if not self.lens and not self.many:
            return None
        lens = np.concatenate([*self.many, np.array(self.lens, dtype=np.int64)])
        block = TokenBlock(
            self.codes.tokens(b"".join(self.parts)),
            lens,
            np.full(len(lens), self.codes.modality, dtype=np.int64),
            continues=self.continues,
            closed=not self.open,
        )
        self.continues = self.open
        self.parts, self.lens, self.many, self.size = [], [], [], 0
        return block


class _Chain(io.RawIOBase):
    """``head`` then the rest of ``rest``: what is left of a stream, as a raw file."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self.head = memoryview(head)
        self.rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        if len(self.head):
            n = min(len(b), len(self.head))
            b[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        data = self.rest.read(len(b))
        b[: len(data)] = data
        return len(data)


def _text(head: bytes, rest: IO[bytes]) -> IO[str]:
    """What the parsers read: latin-1 text, universal newlines, as ``open_text`` gives."""
    return io.TextIOWrapper(io.BufferedReader(_Chain(head, rest)), encoding="latin-1", newline=None)


def decompressed(f: IO[bytes]) -> IO[bytes]:
    """``f``, gunzipped when it starts with gzip's magic bytes (the content decides)."""

    at = f.tell()
    magic = f.read(2)
    f.seek(at)
    if magic == b"\x1f\x8b":
        return cast(IO[bytes], gzip.GzipFile(fileobj=f, mode="rb"))
    return f


def _normalise(body: bytes) -> bytes:
    """Universal newlines, as text mode reads them: ``\\r\\n`` and ``\\r`` become ``\\n``."""
    return body.replace(b"\r\n", b"\n").replace(b"\r", b"\n") if b"\r" in body else body


def stream_blocks(
    tok: DnaTokenizer, f: IO[bytes], source: str, space: TokenSpace
) -> Iterator[TokenBlock]:
    """The blocks of ``f`` (see the module docstring); DecodeError as ``encode_file``."""
    codes = Codes(tok, space)
    fmt = tok.params["format"]
    try:
        raw = decompressed(f)
        first = raw.read(4096)  # what the format is sniffed from
        fmt = sniff_format(source, first.decode("latin-1"), fmt)
    except READ_ERRORS as e:
        raise read_error(source, fmt, e) from None
    if fmt == "genbank" or tok.text is not None:
        reader: _Reader = _Records(tok, source, space, fmt)
    elif fmt == "fasta":
        reader = _Fasta(codes, source)
    else:
        reader = _Fastq(tok, codes, source, space)
    try:
        yield from reader.blocks(first, raw)
    except DecodeError:
        raise
    except READ_ERRORS as e:  # gzip's, mid-file
        raise read_error(source, fmt, e) from None
    if reader.records == 0:
        raise DecodeError(f"{source}: no sequence records")


class _Reader:
    records = 0
    out: _Out  # the line readers' token blocks in the making

    def blocks(self, first: bytes, rest: IO[bytes]) -> Iterator[TokenBlock]:
        raise NotImplementedError

    def _flush(self) -> Iterator[TokenBlock]:
        block = self.out.flush()
        if block is not None:
            yield block


def _read_on(pending: bytes, rest: IO[bytes], eof: bool) -> tuple[bytes, bool]:
    """``pending`` and the next block of ``rest`` (unless it ended); whether it has."""
    if eof:
        return pending, True
    data = rest.read(BLOCK)
    return pending + data, not data


def _whole_lines(pending: bytes, eof: bool) -> tuple[bytes | None, bytes]:
    """(the whole lines at the start of ``pending``, the rest): None while no line is
    whole; at the file's end everything, its last line given its newline."""
    if eof:
        if pending and not pending.endswith((b"\n", b"\r")):
            pending += b"\n"
        return pending, b""
    nl = pending.rfind(b"\n")
    if nl < 0:
        return None, pending
    return pending[: nl + 1], pending[nl + 1 :]


class _Records(_Reader):
    """Record by record through the parsers ``encode_file`` uses (GenBank, annotations)."""

    def __init__(self, tok: DnaTokenizer, source: str, space: TokenSpace, fmt: str) -> None:
        self.tok, self.source, self.space, self.fmt = tok, source, space, fmt

    def blocks(self, first: bytes, rest: IO[bytes]) -> Iterator[TokenBlock]:
        yield from self.documents(_text(first, rest), 0)

    def documents(self, handle: IO[str], first: int) -> Iterator[TokenBlock]:
        """Blocks of the documents of the records in ``handle``, numbered from ``first``."""

        def records() -> Iterator[tuple[str, str, str]]:
            try:
                yield from parse_records(self.source, handle, self.fmt)
            except READ_ERRORS as e:
                raise read_error(self.source, self.fmt, e) from None

        docs: list[np.ndarray] = []
        mods: list[int] = []
        size = 0
        self.records = first
        for n, doc in self.tok.documents(self.source, records(), self.space, first):
            self.records = n
            docs.append(doc.tokens)
            mods.append(self.space.index(doc.modality))
            size += len(doc.tokens)
            if size >= BLOCK:
                yield _block(docs, mods)
                docs, mods, size = [], [], 0
        if docs:
            yield _block(docs, mods)


def _block(docs: list[np.ndarray], mods: list[int]) -> TokenBlock:
    return TokenBlock(
        np.concatenate(docs),
        np.array([len(d) for d in docs], dtype=np.int64),
        np.array(mods, dtype=np.int64),
    )


class _Fasta(_Reader):
    def __init__(self, codes: Codes, source: str) -> None:
        self.codes, self.source = codes, source
        self.out = _Out(codes)
        self.rid: str | None = None  # the record being read (None: before the first)
        self.at = 0  # its bases so far

    def blocks(self, first: bytes, rest: IO[bytes]) -> Iterator[TokenBlock]:
        pending, eof, mid_line = first, False, False
        while True:
            pending, eof = _read_on(pending, rest, eof)
            body, pending = _whole_lines(pending, eof)
            if body is None:
                if len(pending) >= BLOCK and (mid_line or not pending.startswith(b">")):
                    # one sequence line longer than a block: its bases so far, all but
                    # trailing whitespace (the line's end decides what of it is kept)
                    cut = len(pending.rstrip(WS))
                    self._read(_normalise(pending[:cut]), mid_line)
                    pending, mid_line = pending[cut:], True
                    if self.out.size >= BLOCK:
                        yield from self._flush()
                continue  # else a header line longer than a block: read on
            self._read(_normalise(body), mid_line)
            mid_line = False
            if self.out.size >= BLOCK or eof:
                yield from self._flush()
            if eof:
                break
        self._end()
        yield from self._flush()

    def _read(self, body: bytes, mid_line: bool) -> None:
        """Whole lines (the first one's start already read when ``mid_line``)."""
        i, end = 0, len(body)
        header = not mid_line and body[:1] == b">"
        while i < end:
            if header:
                e = body.find(b"\n", i)
                e = end if e < 0 else e
                self._end()
                self._start(body[i + 1 : e])
                i = e + 1
                header = body[i : i + 1] == b">"
            else:
                j = body.find(b"\n>", i)
                stop = end if j < 0 else j + 1
                self._bases(body[i:stop])
                i, header = stop, j >= 0

    def _start(self, line: bytes) -> None:
        title = line.decode("latin-1").rstrip()
        rid = title.split(None, 1)[0] if title.strip() else ""
        self.rid = rid or f"record{self.records}"
        self.at = 0
        self.out.start()

    def _end(self) -> None:
        if self.rid is not None:
            self.out.end()
            self.records += 1
            self.rid = None

    def _bases(self, lines: bytes) -> None:
        if self.rid is None:  # blank lines before the first record
            return
        seq = lines.translate(None, b"\n ")
        codes = seq.translate(self.codes.fasta)
        bad = codes.find(_BAD)
        if bad >= 0 and _OTHER_WS.search(seq) is not None:  # the parser's rule, line by line
            seq = b"".join(ln.rstrip(WS) for ln in lines.split(b"\n")).replace(b" ", b"")
            codes = seq.translate(self.codes.table)
            bad = codes.find(_BAD)
        if bad >= 0:
            raise DecodeError(
                f"{self.source}#{self.rid}: character {chr(seq[bad])!r} (byte 0x{seq[bad]:02x}) "
                f"at base offset {self.at + bad} is not a nucleotide or IUPAC code "
                f"(policy invalid=error)"
            )
        self.at += len(codes)
        self.out.bases(codes)


class _Fastq(_Reader):
    def __init__(self, tok: DnaTokenizer, codes: Codes, source: str, space: TokenSpace) -> None:
        self.tok, self.codes, self.source, self.space = tok, codes, source, space
        self.out = _Out(codes)
        self.join = codes.tail + codes.head

    def blocks(self, first: bytes, rest: IO[bytes]) -> Iterator[TokenBlock]:
        pending, eof = first, False
        while True:
            pending, eof = _read_on(pending, rest, eof)
            body, pending = _whole_lines(pending, eof)
            if body is None:
                continue
            lines = _normalise(body).split(b"\n")  # the last is b"" (after the last newline)
            done = self._plain(lines, eof)
            left = len(lines) - 1 - done  # whole lines not taken
            # up to four lines left: a record the block's end cut (or whose next line is not
            # read yet), read again with the next block; more, or at the end: not plain
            if left and (eof or left > 4):
                yield from self._flush()
                yield from self._exact(b"\n".join(lines[done:]) + pending, rest)
                return
            if left:
                pending = b"\n".join(lines[done:]) + pending
            if self.out.size >= BLOCK:
                yield from self._flush()
            if eof:
                break
        yield from self._flush()

    def _exact(self, left: bytes, rest: IO[bytes]) -> Iterator[TokenBlock]:
        """The rest of the file, from ``left`` on, through ``FastqGeneralIterator``."""
        records = _Records(self.tok, self.source, self.space, "fastq")
        yield from records.documents(_text(left, rest), self.records)
        self.records = records.records

    def _plain(self, lines: list[bytes], eof: bool) -> int:
        """Take the plain four-line records at the start of ``lines`` (whole lines, then
        b""); the index of the first line not taken."""
        m = len(lines) - 1
        # a record is plain only with the line after it seen: an '@' (or the file's end)
        k = m // 4 if eof else max(0, (m - 1) // 4)
        if k == 0:
            return 0
        stop = 4 * k
        heads, seqs, plus, quals = (lines[i:stop:4] for i in range(4))
        ok = k
        if not all(map(bytes.startswith, heads, repeat(b"@"))):
            j = next(i for i, h in enumerate(heads) if not h.startswith(b"@"))
            ok = max(j - 1, 0)  # the line after record j - 1 continues its quality
        if stop < m and not lines[stop].startswith(b"@"):
            ok = min(ok, k - 1)
        if plus.count(b"+") != k:  # a '+' line with more: it must repeat the '@' line
            ok = min(ok, next((i for i in range(k) if not _plus_ok(heads[i], plus[i])), k))
        ls = np.fromiter(map(len, seqs), dtype=np.int64, count=k)
        bad_len = (ls != np.fromiter(map(len, quals), dtype=np.int64, count=k)) | (ls == 0)
        if bad_len.any():
            ok = min(ok, int(np.argmax(bad_len)))
        if not ok:
            return 0
        codes = b"\n".join(seqs[:ok]).translate(self.codes.fast)
        bad = codes.find(_BAD)
        if bad >= 0:  # whitespace, or a character the policy rejects: the parser decides
            ok = codes.count(_SEP, 0, bad)
            if not ok:
                return 0
            codes = codes[: codes.rfind(_SEP, 0, bad)]
        self.out.documents(
            self.codes.head + codes.replace(bytes([_SEP]), self.join) + self.codes.tail,
            ls[:ok] + 3,
        )
        self.records += ok
        return 4 * ok


def _plus_ok(head: bytes, plus: bytes) -> bool:
    return plus == b"+" or (plus[:1] == b"+" and plus[1:] == head[1:])
