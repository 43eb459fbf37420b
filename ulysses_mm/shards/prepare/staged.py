"""An input's staged documents: written as the tokenizer streams them, read back in pieces.

A staged entry is three files in the staging directory::

    STEM.tokens   the documents' tokens, end to end (raw, the token space's dtype)
    STEM.docs     int64 [documents, 2]: each document's length and modality index (raw)
    STEM.json     the input's Outcome, written after the other two: the entry's commit mark

:class:`StagedWriter` checks each block a tokenizer gives (documents framed ``<doc> …
</doc>``, ids inside the token space) and appends it, so neither side holds more than a
block; :func:`staged_blocks` reads an entry back as :class:`~ulysses_mm.shards.pack.DocumentBlock`
pieces of bounded size for the packer. The input's documents reach the packer only once it
has been read to the end without an error: a bad input is skipped whole, whatever its size.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from ulysses_mm.core.errors import UserError
from ulysses_mm.core.storage import temp_name
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.shards.pack import DocumentBlock
from ulysses_mm.tokenize.base import DecodeError, TokenBlock

CHUNK_TOKENS = 1 << 24  # tokens per block read back for packing
_DOC_ROWS = 1 << 16  # document rows buffered before they are written / read at a time


class PrepareError(UserError, RuntimeError):
    """The run cannot produce a dataset (every input failed, no inputs, bad spec, a staged
    entry that does not read back ...). Defined with the staged entries, the lowest
    module of ``prepare`` that raises it."""


def _paths(stem: str) -> tuple[Path, Path]:
    return Path(stem + ".tokens"), Path(stem + ".docs")


def exists(stem: str) -> bool:
    return all(p.exists() for p in _paths(stem))


def remove(stem: str) -> None:
    for p in (*_paths(stem), Path(stem + ".json")):
        p.unlink(missing_ok=True)


class StagedWriter:
    """Appends checked :class:`TokenBlock` pieces to a staged entry; ``commit`` makes the
    files appear under their names, ``abort`` removes them. ``documents`` and ``tokens``
    count what was written.

    With ``hold`` > 0 the entry is for this process only (tokenized and packed by the same
    one, as a Ray task does): it stays in memory up to ``hold`` bytes, then goes on in
    files that are neither synced to disk nor committed, and :meth:`blocks` reads it back.
    """

    def __init__(self, stem: str, space: TokenSpace, hold: int = 0) -> None:
        self.space = space
        self.dtype = space.dtype()
        self.final = _paths(stem)
        self.tmp = tuple(p.parent / temp_name(p.name) for p in self.final)
        self.final[0].parent.mkdir(parents=True, exist_ok=True)
        self.hold = hold
        self.durable = not hold  # committed for other processes and later runs
        self._tokens: IO[bytes]
        self._docs: IO[bytes]
        if hold:
            self._tokens, self._docs = io.BytesIO(), io.BytesIO()
        else:
            self._tokens = open(self.tmp[0], "wb")  # noqa: SIM115 (commit/abort close it)
            self._docs = open(self.tmp[1], "wb")  # noqa: SIM115
        self._rows: list[np.ndarray] = []
        self._pending_rows = 0
        self.documents = 0
        self.tokens = 0
        self._open_len = 0  # tokens so far of a document the last block left open
        self._open_mod = -1  # its modality (-1: no document is open)

    def add(self, block: TokenBlock) -> None:
        """Check ``block`` (DecodeError saying what is wrong) and append it."""
        t, lengths, mods = self._check(block)
        if self.hold and self.tokens * self.dtype.itemsize + t.nbytes > self.hold:
            self._spill()
        self._tokens.write(np.ascontiguousarray(t).data)
        self.tokens += len(t)
        n = len(lengths)
        if n == 0:
            return
        done = lengths.copy()
        if block.continues:
            done[0] += self._open_len
        closed = n if block.closed else n - 1
        if closed:
            rows = np.empty((closed, 2), dtype=np.int64)
            rows[:, 0] = done[:closed]
            rows[:, 1] = mods[:closed]
            self._rows.append(rows)
            self._pending_rows += closed
            self.documents += closed
            if self._pending_rows >= _DOC_ROWS:
                self._flush_rows()
        if block.closed:
            self._open_len, self._open_mod = 0, -1
        else:  # the last piece's document, with what came of it before
            self._open_len, self._open_mod = int(done[-1]), int(mods[-1])

    def _check(self, block: TokenBlock) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        space = self.space
        t = np.asarray(block.tokens)
        lengths = np.asarray(block.lengths, dtype=np.int64).reshape(-1)
        mods = np.asarray(block.modalities, dtype=np.int64).reshape(-1)

        def bad(why: str) -> DecodeError:
            return DecodeError(f"the tokenizer produced an invalid document: {why}")

        if t.ndim != 1 or t.dtype.kind not in "iu":
            raise bad(f"tokens must be a 1-D integer array, got {t.dtype} {t.shape}")
        if len(lengths) != len(mods) or (lengths < 1).any() or int(lengths.sum()) != len(t):
            raise bad("block piece lengths do not add up to its tokens")
        if ((mods < 0) | (mods >= len(space.modalities))).any():
            raise bad(f"a modality index outside the token space {list(space.modalities)}")
        is_open = self._open_mod >= 0
        if block.continues != is_open:
            raise bad(
                "a document left open was not continued" if is_open else "nothing to continue"
            )
        if block.continues and len(mods) and mods[0] != self._open_mod:
            raise bad("a continued document changes modality")
        if not len(t):
            return t.astype(self.dtype, copy=False), lengths, mods
        if int(t.min()) < 0 or int(t.max()) >= space.vocab_size:
            raise bad(
                f"ids {int(t.min())}..{int(t.max())} fall outside the token space "
                f"0..{space.vocab_size - 1}"
            )
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        starts = offsets[1:-1] if block.continues else offsets[:-1]
        ends = offsets[1:] - 1 if block.closed else offsets[1:-1] - 1
        specials = np.flatnonzero(t <= DOC_END)
        expected = np.sort(np.concatenate([starts, ends]))
        if (
            len(specials) != len(expected)
            or (specials != expected).any()
            or (t[starts] != DOC_START).any()
            or (t[ends] != DOC_END).any()
        ):
            raise bad(
                "documents must run from <doc> to </doc>, with no <pad>, <doc> or </doc> inside"
            )
        return t.astype(self.dtype, copy=False), lengths, mods

    def _flush_rows(self) -> None:
        if self._rows:
            self._docs.write(np.concatenate(self._rows).tobytes())
        self._rows, self._pending_rows = [], 0

    def _spill(self) -> None:
        """A held entry past ``hold``: from memory to (unsynced) files."""
        files = []
        for held, tmp in zip((self._tokens, self._docs), self.tmp):
            f = open(tmp, "w+b")  # noqa: SIM115 (blocks/abort close it)
            f.write(held.getbuffer())  # type: ignore[attr-defined]
            files.append(f)
        self._tokens, self._docs = files
        self.hold = 0

    def commit(self) -> None:
        """Every block added: the files under their final names (DecodeError if the
        tokenizer left a document open). A held entry is only closed for reading."""
        if self._open_mod >= 0:
            raise DecodeError("the tokenizer produced an invalid document: the last one never ends")
        self._flush_rows()
        if not self.durable:
            return
        for f in (self._tokens, self._docs):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for tmp, final in zip(self.tmp, self.final):
            os.replace(tmp, final)

    def blocks(self, n_docs: int, where: str, chunk: int = CHUNK_TOKENS) -> Iterator[DocumentBlock]:
        """A held entry's documents, as :func:`staged_blocks` reads a committed one."""
        for f in (self._tokens, self._docs):
            f.flush()
            f.seek(0)
        yield from _read_blocks(self._tokens, self._docs, n_docs, self.dtype, where, chunk)

    def abort(self) -> None:
        """Close and remove what was written (a held entry, once packed, too)."""
        for f in (self._tokens, self._docs):
            f.close()
        for tmp in self.tmp:
            tmp.unlink(missing_ok=True)


def staged_blocks(
    stem: str, n_docs: int, dtype: np.dtype | type, where: str, chunk: int = CHUNK_TOKENS
) -> Iterator[DocumentBlock]:
    """A committed entry's documents as blocks of at most ``chunk`` tokens (a document
    longer than that in several, each after the first ``continues``), checked against the
    ``n_docs`` its outcome records."""
    tokens_path, docs_path = _paths(stem)
    with open(tokens_path, "rb") as ft, open(docs_path, "rb") as fd:
        yield from _read_blocks(ft, fd, n_docs, np.dtype(dtype), where, chunk)


def _read_blocks(
    ft: IO[bytes], fd: IO[bytes], n_docs: int, dtype: np.dtype, where: str, chunk: int
) -> Iterator[DocumentBlock]:
    seen = 0
    lengths = mods = np.zeros(0, dtype=np.int64)
    k = 0  # next row of the buffered document table
    open_rest, open_mod = 0, 0  # tokens still to come of a document cut by the last block
    while True:
        raw = ft.read(chunk * dtype.itemsize)
        if not raw:
            break
        t = np.frombuffer(raw, dtype=dtype)
        out_len: list[np.ndarray] = []
        out_mod: list[np.ndarray] = []
        used, continues = 0, False
        if open_rest:
            take = min(open_rest, len(t))
            out_len.append(np.array([take]))
            out_mod.append(np.array([open_mod]))
            open_rest -= take
            used, continues = take, True
        while used < len(t):
            if k == len(lengths):
                rows = np.frombuffer(fd.read(_DOC_ROWS * 16), dtype=np.int64).reshape(-1, 2)
                if not len(rows):
                    raise PrepareError(f"staged entry of {where} holds fewer documents than tokens")
                lengths, mods, k = rows[:, 0], rows[:, 1], 0
                seen += len(rows)
            cum = np.cumsum(lengths[k:])
            fit = int(np.searchsorted(cum, len(t) - used, side="right"))
            if fit:
                out_len.append(lengths[k : k + fit])
                out_mod.append(mods[k : k + fit])
                used += int(cum[fit - 1])
                k += fit
            if used < len(t) and k < len(lengths):  # the next document is cut here
                take = len(t) - used
                out_len.append(np.array([take]))
                out_mod.append(mods[k : k + 1])
                open_rest, open_mod = int(lengths[k]) - take, int(mods[k])
                used, k = len(t), k + 1
        yield DocumentBlock(t, np.concatenate(out_len), np.concatenate(out_mod), continues)
    rest = len(fd.read()) // 16
    if open_rest or seen + rest != n_docs or k != len(lengths) or rest:
        raise PrepareError(
            f"staged entry of {where} holds {seen + rest} documents, expected {n_docs}"
        )
