"""The shard format, described once for both houses: what writes shards (prepare, packing,
shards, manifest, inspect) and what reads them for training (stream, batch).

numpy only, never torch: offline code imports this module and nothing of the model.

A packed sample is ``tokens [N]`` (the token space's unsigned dtype) and a segment table,
one row per piece of a document inside the sample, in the columns of
:data:`SEGMENT_COLUMNS`::

    segments  int64 [rows, 5]: start, length, modality, doc_id, pos_offset
      start       first token of the piece inside the sample
      length      tokens in the piece (>= 1); rows are sorted by start and contiguous
      modality    index into the token space's modalities (the document's primary one)
      doc_id      document index (0, 1, … in packing order) within the sample's partition;
                  dataset-wide = the partition's first_doc_id (manifest) + doc_id
      pos_offset  position of the piece's first token inside its document (0 at <doc>)

Index the columns by name (``seg[:, SEG_MODALITY]``), never by number. In a shard a sample
is two ``.npy`` members, ``KEY.tokens.npy`` and ``KEY.segments.npy``, read without pickle.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from ulysses_mm.core.errors import DataError

SEGMENT_COLUMNS = ("start", "length", "modality", "doc_id", "pos_offset")
SEG_START, SEG_LENGTH, SEG_MODALITY, SEG_DOC, SEG_POS = range(len(SEGMENT_COLUMNS))
NUM_COLUMNS = len(SEGMENT_COLUMNS)

# A label no loss counts (the next token is in another document, or there is none).
IGNORE = -100

# Tar members of one sample: f"{KEY}.{TOKENS_KEY}" and f"{KEY}.{SEGMENTS_KEY}".
TOKENS_KEY = "tokens.npy"
SEGMENTS_KEY = "segments.npy"


class ShardFormatError(DataError):
    """A shard is not in this format; the message names the shard and the problem."""


@dataclass
class PackedSample:
    """One training sample: ``tokens [seq_len]`` (token-space dtype) and its segment table."""

    index: int  # sample index: the shard __key__ (within its partition, see the manifest)
    tokens: np.ndarray  # [seq_len], unsigned
    segments: np.ndarray  # int64 [rows, NUM_COLUMNS], SEGMENT_COLUMNS

    @property
    def real_tokens(self) -> int:
        """Tokens covered by a segment (the rest is tail padding)."""
        return int(self.segments[:, SEG_LENGTH].sum()) if len(self.segments) else 0


def document_lengths(segments: np.ndarray) -> np.ndarray:
    """int64: the tokens of each document of one packed sample, in order; a document's
    pieces (one per modality span) counted together, tail padding none."""
    if len(segments) == 0:
        return np.zeros(0, dtype=np.int64)
    docs, first, inverse = np.unique(segments[:, SEG_DOC], return_index=True, return_inverse=True)
    lengths = np.bincount(inverse, weights=segments[:, SEG_LENGTH], minlength=len(docs))
    return np.rint(lengths[np.argsort(first)]).astype(np.int64)


def sample_pairs(segments: np.ndarray) -> int:
    """The (query, key) pairs causal attention inside documents computes for one packed
    sample: Σ over its documents (:func:`document_lengths`) of l·(l+1)/2."""
    lengths = document_lengths(segments)
    return int((lengths * (lengths + 1) // 2).sum())


def load_npy(data: bytes, where: str) -> np.ndarray:
    """A ``.npy`` member's array, never unpickled; ``where`` names it in the error."""
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as e:  # includes "Object arrays cannot be loaded when allow_pickle=False"
        raise ShardFormatError(f"{where}: not a plain .npy array: {e}") from e


def segments_to_ids(segments: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(doc_ids [N], position_ids [N]) from a segment table. Tokens no segment covers
    (tail padding) get doc id -1 and position 0."""
    doc = np.full(seq_len, -1, dtype=np.int64)
    pos = np.zeros(seq_len, dtype=np.int64)
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, NUM_COLUMNS)
    for i, row in enumerate(seg):
        s, n = int(row[SEG_START]), int(row[SEG_LENGTH])
        if s < 0 or n < 0 or s + n > seq_len:
            raise ShardFormatError(
                f"segment {i} {row.tolist()} does not fit a sample of {seq_len} tokens"
            )
        doc[s : s + n] = i
        pos[s : s + n] = row[SEG_POS] + np.arange(n)
    return doc, pos
