"""Random packed multimodal samples, for ``ulysses-mm verify``, tests and benchmarks.

Documents of random length and modality are laid end to end as the packer would lay them:
``<doc> <|m|> tokens… </doc>``, a document sometimes switching modality mid-way (as an
interleaved clip does), a video span holding ``<eof>`` tokens, and the tail of the last
sample padded. The layout depends only on the seed.
"""

from __future__ import annotations

import numpy as np
import torch

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, EOF, PAD, TokenSpace
from ulysses_mm.loader.batch import Batch, make_batch


def random_document(rng: np.random.Generator, space: TokenSpace, length: int) -> list[int]:
    mods = list(space.modalities)
    doc = [DOC_START]
    while len(doc) < length - 1:
        m = mods[rng.integers(len(mods))]
        r = space.range(m)
        span_len = int(rng.integers(1, max(2, length // 2)))
        doc.append(space.boundary_token(m))
        body = rng.integers(r.start, r.stop, size=span_len).tolist()
        if m == "video" and span_len > 4:
            body[span_len // 2] = EOF
        doc.extend(body)
    doc = doc[: length - 1] + [DOC_END]
    return doc


def random_packed(
    space: TokenSpace,
    batch: int,
    seq_len: int,
    seed: int = 0,
    min_doc: int = 4,
    max_doc: int | None = None,
    pad_tail: bool = True,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """(tokens [batch, seq_len], segment tables) of random packed documents."""
    rng = np.random.default_rng(seed)
    max_doc = max_doc or max(min_doc + 1, seq_len // 8)
    tokens = np.full((batch, seq_len), PAD, dtype=np.int64)
    tables = []
    doc_id = 0
    for b in range(batch):
        rows, pos = [], 0
        end = seq_len - (int(rng.integers(0, max(1, seq_len // 16))) if pad_tail else 0)
        while pos < end:
            length = min(int(rng.integers(min_doc, max_doc + 1)), end - pos)
            doc = random_document(rng, space, max(length, 2))[:length]
            tokens[b, pos : pos + length] = doc
            first = next((t for t in doc if t >= space.num_specials), None)
            modality = space.index(_modality_of(space, first)) if first is not None else -1
            offset = int(rng.integers(0, 3)) * 7  # some pieces continue an earlier document
            rows.append([pos, length, modality, doc_id, offset])
            doc_id += 1
            pos += length
        tables.append(np.array(rows, dtype=np.int64).reshape(-1, 5))
    return tokens, tables


def _modality_of(space: TokenSpace, token: int) -> str:
    for r in space.ranges:
        if r.start <= token < r.stop:
            return r.name
    raise ValueError(token)


def random_batch(space: TokenSpace, batch: int, seq_len: int, seed: int = 0, **kw) -> Batch:
    tokens, tables = random_packed(space, batch, seq_len, seed, **kw)
    return make_batch(tokens, tables, space)


def largest_head(space: TokenSpace) -> str:
    """The modality whose head is widest (its logits tile is the largest)."""
    return max(space.ranges, key=lambda r: r.size).name


def single_modality_batch(
    space: TokenSpace,
    batch: int,
    seq_len: int,
    doc_len: int,
    modality: str | None = None,
    seed: int = 0,
) -> Batch:
    """``batch`` packed samples of ``seq_len`` tokens: documents of ``doc_len`` tokens
    (``<doc> <|m|> ... </doc>``, the last one cut at the sample end), all of one modality
    (default: the one with the widest head)."""
    if seq_len < 4 or doc_len < 4:
        raise ValueError(f"need seq_len and doc_len >= 4, got {seq_len} and {doc_len}")
    name = modality or largest_head(space)
    r = space.range(name)
    m = space.index(name)
    rng = np.random.default_rng(seed)
    tokens = np.empty((batch, seq_len), dtype=np.int64)
    tables = []
    doc_id = 0
    for row in range(batch):
        rows = []
        for start in range(0, seq_len, doc_len):
            length = min(doc_len, seq_len - start)
            doc = rng.integers(r.start, r.stop, size=length)
            doc[0] = DOC_START
            if length > 1:
                doc[1] = space.boundary_token(name)
            if length > 2:
                doc[-1] = DOC_END
            tokens[row, start : start + length] = doc
            rows.append([start, length, m, doc_id, 0])
            doc_id += 1
        tables.append(np.array(rows, dtype=np.int64))
    return make_batch(tokens, tables, space)


def packed_doc_ids(rows: int, seq_len: int, mean: int, seed: int = 0) -> torch.Tensor:
    """[rows, seq_len] document ids of random packings: lengths uniform in [1, 2·mean),
    the last cut to fit (a workload for layouts and load balance)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        lens: list[int] = []
        while sum(lens) < seq_len:
            lens.append(int(torch.randint(1, 2 * mean, (1,), generator=g)))
        lens[-1] -= sum(lens) - seq_len
        out.append(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)))
    return torch.stack(out)
