"""The partition function of ``prepare`` and the staged entries each partition packs from:
partitions are a function of the sorted inputs' sizes alone; a staged entry written from
streamed pieces reads back, in blocks of any size, as the documents that went in."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from pipeline_fakes import cut_blocks

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.shards.pack import DocumentBlock, pack
from ulysses_mm.shards.prepare.partition import partition_inputs
from ulysses_mm.shards.prepare.staged import StagedWriter, staged_blocks
from ulysses_mm.tokenize.base import DecodeError, TokenBlock

SPACE = TokenSpace.from_vocab({"dna": 5, "audio": 256})


def test_partitions_by_bytes_cut_before_the_input_that_would_overflow():
    assert partition_inputs([4, 4, 4, 4, 4], 8) == [(0, 2), (2, 4), (4, 5)]
    assert partition_inputs([3, 20, 3, 3], 8) == [(0, 1), (1, 2), (2, 4)]  # a big one alone
    assert partition_inputs([5, 5], 0) == [(0, 2)]  # 0: one partition
    assert partition_inputs([], 8) == []
    assert partition_inputs([0, 0, 0], 1) == [(0, 3)]


def test_partitions_by_count_balance_the_bytes():
    sizes = [10, 10, 10, 10, 40, 10, 10]  # 100 bytes
    parts = partition_inputs(sizes, 1 << 30, partitions=4)
    assert parts == [(0, 2), (2, 4), (4, 5), (5, 7)]
    assert partition_inputs([1, 1], 0, partitions=5) == [(0, 1), (1, 2)]  # fewer inputs
    assert partition_inputs([0, 0, 0, 0], 0, partitions=2) == [(0, 2), (2, 4)]
    assert partition_inputs([7], 0, partitions=3) == [(0, 1)]


@pytest.mark.parametrize("seed", range(10))
def test_partitions_cover_the_inputs_in_order_and_depend_on_sizes_only(seed):
    rng = np.random.default_rng(seed)
    sizes = [int(s) for s in rng.integers(0, 1000, size=int(rng.integers(1, 60)))]
    for kw in (
        {"partition_bytes": int(rng.integers(1, 3000))},
        {"partitions": int(rng.integers(1, 9))},
    ):
        parts = partition_inputs(sizes, kw.get("partition_bytes", 0), kw.get("partitions", 0))
        assert parts[0][0] == 0 and parts[-1][1] == len(sizes)
        assert all(a < b for a, b in parts) and all(
            p[1] == q[0] for p, q in itertools.pairwise(parts)
        )
        assert parts == partition_inputs(
            list(sizes), kw.get("partition_bytes", 0), kw.get("partitions", 0)
        )
        if "partitions" in kw:
            assert len(parts) <= kw["partitions"]
        else:  # no partition of several inputs goes past the limit
            assert all(b - a == 1 or sum(sizes[a:b]) <= kw["partition_bytes"] for a, b in parts)


def _doc(rng, modality: str, n: int) -> np.ndarray:
    r = SPACE.range(modality)
    body = rng.integers(r.start, r.stop, size=n)
    return np.concatenate([[DOC_START, SPACE.boundary_token(modality)], body, [DOC_END]]).astype(
        SPACE.dtype()
    )


@pytest.mark.parametrize("chunk", [3, 17, 1 << 20])
def test_a_staged_entry_reads_back_as_the_documents_streamed_into_it(tmp_path, chunk):
    rng = np.random.default_rng(chunk)
    mods = [0, 1, 0, 0, 1]
    docs = [_doc(rng, SPACE.modalities[m], int(n)) for m, n in zip(mods, [40, 0, 7, 120, 3])]
    stem = str(tmp_path / "entry")
    w = StagedWriter(stem, SPACE)
    for block in cut_blocks(docs, mods, [5, 6, 50, 51, 52, 160]):
        w.add(block)
    w.commit()
    assert (w.documents, w.tokens) == (5, sum(len(d) for d in docs))
    blocks = list(staged_blocks(stem, 5, SPACE.dtype(), "entry", chunk=chunk))
    assert all(len(b.tokens) <= chunk for b in blocks)
    whole = [DocumentBlock.from_documents(docs, mods, SPACE.dtype())]
    for seq_len in (4, 64):
        for a, b in zip(pack(whole, seq_len, SPACE.dtype()), pack(blocks, seq_len, SPACE.dtype())):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.segments, b.segments)
    with pytest.raises(Exception, match="holds 5 documents, expected 6"):
        list(staged_blocks(stem, 6, SPACE.dtype(), "entry", chunk=chunk))


@pytest.mark.parametrize(
    ("block", "why"),
    [
        (TokenBlock(np.array([1, 5, 7]), np.array([3]), np.array([0])), "from <doc> to </doc>"),
        (TokenBlock(np.array([1, 5, 7, 2]), np.array([4]), np.array([3])), "modality index"),
        (
            TokenBlock(np.array([1, 5, 999, 2]), np.array([4]), np.array([0])),
            "outside the token space",
        ),
        (TokenBlock(np.array([1, 5, 2]), np.array([4]), np.array([0])), "do not add up"),
        (
            TokenBlock(np.array([7, 2]), np.array([2]), np.array([0]), continues=True),
            "nothing to continue",
        ),
        (
            TokenBlock(np.array([1, 5, 1, 2]), np.array([4]), np.array([0])),
            "no <pad>, <doc> or </doc> inside",
        ),
    ],
)
def test_a_bad_block_is_a_decode_error(tmp_path, block, why):
    w = StagedWriter(str(tmp_path / "bad"), SPACE)
    with pytest.raises(DecodeError, match=why):
        w.add(block)
    w.abort()
    assert not list(tmp_path.iterdir())


def test_a_document_left_open_is_refused(tmp_path):
    w = StagedWriter(str(tmp_path / "open"), SPACE)
    w.add(TokenBlock(np.array([1, 5, 7]), np.array([3]), np.array([0]), closed=False))
    with pytest.raises(DecodeError, match="never ends"):
        w.commit()
    w.abort()


@pytest.mark.parametrize("hold", [1 << 20, 100], ids=["in-memory", "spilled"])
def test_a_held_entry_reads_back_the_same_and_leaves_nothing(tmp_path, hold):
    rng = np.random.default_rng(2)
    mods = [0, 1, 0]
    docs = [_doc(rng, SPACE.modalities[m], int(n)) for m, n in zip(mods, [90, 4, 200])]
    w = StagedWriter(str(tmp_path / "held"), SPACE, hold=hold)
    for block in cut_blocks(docs, mods, [10, 60, 95]):
        w.add(block)
    w.commit()
    assert any(tmp_path.iterdir()) == (hold == 100)  # spilled to a local file past hold
    blocks = list(w.blocks(3, "held", chunk=64))
    whole = [DocumentBlock.from_documents(docs, mods, SPACE.dtype())]
    for a, b in zip(pack(whole, 32, SPACE.dtype()), pack(blocks, 32, SPACE.dtype()), strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.segments, b.segments)
    w.abort()
    assert not any(tmp_path.iterdir())
