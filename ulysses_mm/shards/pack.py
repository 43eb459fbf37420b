"""Packing: token documents laid end to end and cut into samples of exactly ``seq_len`` tokens.

The dataset is one stream: every document, in a fixed order, ``<doc> … </doc>`` after
``<doc> … </doc>``. Sample ``i`` is tokens ``[i·N, (i+1)·N)`` of that stream, so a long
document simply continues into the next sample, and only the last sample is padded (with
``<pad>``, which no segment covers). This is the simplest packing that wastes at most
N-1 tokens per dataset and never reorders a document's tokens; best-fit packing would
save nothing here, because documents are allowed to cross sample boundaries.

Each sample carries a segment table (:mod:`ulysses_mm.core.format`), one row per piece of
a document inside it.

Documents arrive in blocks (consecutive documents of one input file, concatenated), and a
block is cut with a few vectorised ``searchsorted`` calls per sample, so cost is per sample
and per block, not per token or per document. A block may begin with the rest of the
previous block's last document (``continues``), so an input of any size is packed from
bounded pieces; the samples are the same however the stream is cut into blocks (a
document's adjacent pieces inside one sample are one segment row).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ulysses_mm.core.format import (
    NUM_COLUMNS,
    SEG_DOC,
    SEG_LENGTH,
    SEG_MODALITY,
    SEG_POS,
    SEG_START,
    PackedSample,
)
from ulysses_mm.core.tokenspace import PAD


@dataclass
class DocumentBlock:
    """Consecutive documents, e.g. all documents of one input file, concatenated.

    ``tokens`` is 1-D; document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` with
    ``offsets = [0, cumsum(lengths)]``; ``modalities[i]`` is its modality index. With
    ``continues``, document 0 is the rest of the previous block's last document (the
    same document id, its positions counted on)."""

    tokens: np.ndarray
    lengths: np.ndarray  # int64 [docs]
    modalities: np.ndarray  # int64 [docs]
    continues: bool = False

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens).reshape(-1)
        self.lengths = np.asarray(self.lengths, dtype=np.int64).reshape(-1)
        self.modalities = np.asarray(self.modalities, dtype=np.int64).reshape(-1)
        if len(self.lengths) != len(self.modalities):
            raise ValueError(
                f"{len(self.lengths)} document lengths but {len(self.modalities)} modalities"
            )
        if (self.lengths < 0).any():
            raise ValueError("document lengths must be >= 0")
        if int(self.lengths.sum()) != len(self.tokens):
            raise ValueError(
                f"document lengths sum to {int(self.lengths.sum())}, tokens hold {len(self.tokens)}"
            )

    @classmethod
    def from_documents(
        cls, docs: Iterable[np.ndarray], modalities: Iterable[int], dtype: np.dtype | type
    ) -> DocumentBlock:
        arrays = [np.asarray(d).reshape(-1) for d in docs]
        tokens = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
        return cls(
            tokens, np.array([len(a) for a in arrays], np.int64), np.fromiter(modalities, np.int64)
        )


class Packer:
    """Cuts a stream of :class:`DocumentBlock` into :class:`PackedSample`.

    ``add`` yields every sample completed by a block; ``finish`` yields the padded last
    one. Document ids and sample indices continue from ``first_doc_id`` /
    ``first_sample``."""

    def __init__(
        self,
        seq_len: int,
        dtype: np.dtype | type,
        first_doc_id: int = 0,
        first_sample: int = 0,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = int(seq_len)
        self.dtype = np.dtype(dtype)
        self.next_doc = int(first_doc_id)
        self.next_sample = int(first_sample)
        self._buf = np.empty(self.seq_len, dtype=self.dtype)  # a fresh buffer per sample
        self._fill = 0
        self._rows: list[np.ndarray] = []
        self._open_pos = 0  # tokens placed so far of the last document (for a continuation)

    def add(self, block: DocumentBlock) -> Iterator[PackedSample]:
        n = self.seq_len
        tokens = block.tokens
        keep = block.lengths > 0  # an empty document has no tokens to place
        lengths = block.lengths[keep]
        mods = block.modalities[keep]
        first = self.next_doc - 1 if block.continues else self.next_doc
        doc_ids = first + np.flatnonzero(keep).astype(np.int64)
        self.next_doc = first + len(block.lengths)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        # each document's position at the block's start: 0, or its earlier pieces' tokens
        base = np.zeros(len(lengths), dtype=np.int64)
        if block.continues and len(block.lengths) and keep[0]:
            base[0] = self._open_pos
        if len(block.lengths):
            carried = self._open_pos if block.continues and len(block.lengths) == 1 else 0
            self._open_pos = carried + int(block.lengths[-1])
        pos = 0
        while pos < total:
            take = min(n - self._fill, total - pos)
            end = pos + take
            self._buf[self._fill : self._fill + take] = tokens[pos:end]
            # documents overlapping [pos, end): i0 holds pos, i1 is the first starting at >= end
            i0 = int(np.searchsorted(offsets, pos, side="right")) - 1
            i1 = int(np.searchsorted(offsets, end, side="left"))
            starts = np.maximum(offsets[i0:i1], pos)
            stops = np.minimum(offsets[i0 + 1 : i1 + 1], end)
            rows = np.empty((i1 - i0, NUM_COLUMNS), dtype=np.int64)
            rows[:, SEG_START] = starts - pos + self._fill
            rows[:, SEG_LENGTH] = stops - starts
            rows[:, SEG_MODALITY] = mods[i0:i1]
            rows[:, SEG_DOC] = doc_ids[i0:i1]
            rows[:, SEG_POS] = starts - offsets[i0:i1] + base[i0:i1]
            self._rows.append(rows)
            self._fill += take
            pos = end
            if self._fill == n:
                yield self._emit()

    def finish(self) -> Iterator[PackedSample]:
        """The last, padded sample (nothing if the stream ended on a sample boundary)."""
        if self._fill:
            yield self._emit()

    def _emit(self) -> PackedSample:
        segments = (
            np.concatenate(self._rows) if self._rows else np.zeros((0, NUM_COLUMNS), np.int64)
        )
        same = segments[1:, SEG_DOC] == segments[:-1, SEG_DOC]
        if same.any():  # a document's pieces from consecutive blocks: one row
            head = np.concatenate([[True], ~same])
            row = np.cumsum(head) - 1  # the merged row of each piece
            lengths = np.bincount(row, weights=segments[:, SEG_LENGTH]).astype(np.int64)
            segments = segments[head]
            segments[:, SEG_LENGTH] = lengths
        self._buf[self._fill :] = PAD
        sample = PackedSample(self.next_sample, self._buf, segments)
        self.next_sample += 1
        self._buf = np.empty(self.seq_len, dtype=self.dtype)
        self._fill = 0
        self._rows = []
        return sample


def pack(
    blocks: Iterable[DocumentBlock], seq_len: int, dtype: np.dtype | type
) -> Iterator[PackedSample]:
    """The packing stage: blocks in, every sample (the last one padded) out."""
    packer = Packer(seq_len, dtype)
    for block in blocks:
        yield from packer.add(block)
    yield from packer.finish()


def check_sample(sample: PackedSample, seq_len: int, num_modalities: int) -> None:
    """Raise ValueError unless ``sample`` is well formed: ``seq_len`` tokens, segments
    contiguous from 0, padding only after the last segment."""
    t, seg = sample.tokens, sample.segments
    if t.shape != (seq_len,):
        raise ValueError(f"sample {sample.index}: tokens shape {t.shape}, expected ({seq_len},)")
    if seg.ndim != 2 or seg.shape[1] != NUM_COLUMNS or seg.dtype != np.int64:
        raise ValueError(
            f"sample {sample.index}: segment table {seg.dtype} {seg.shape}, expected int64 [rows, {NUM_COLUMNS}]"
        )
    if not len(seg):
        raise ValueError(f"sample {sample.index}: empty segment table")
    starts, lengths = seg[:, SEG_START], seg[:, SEG_LENGTH]
    if starts[0] != 0 or (lengths < 1).any() or (starts[1:] != starts[:-1] + lengths[:-1]).any():
        raise ValueError(f"sample {sample.index}: segments are not contiguous from 0")
    end = int(starts[-1] + lengths[-1])
    if end > seq_len:
        raise ValueError(f"sample {sample.index}: segments end at {end} > {seq_len}")
    if (t[end:] != PAD).any():
        raise ValueError(f"sample {sample.index}: non-pad tokens after the last segment")
    mods = seg[:, SEG_MODALITY]
    if ((mods < 0) | (mods >= num_modalities)).any() or (seg[:, [SEG_DOC, SEG_POS]] < 0).any():
        raise ValueError(f"sample {sample.index}: modality, doc_id or pos_offset out of range")
