"""Packing invariants, property-style over random document lengths, block splits and seq_lens:
every token of every document appears exactly once and in order, segment tables agree
with the tokens, every sample has exactly seq_len tokens, positions continue across
samples, and only the tail of the last sample is padding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from pipeline_fakes import cut_blocks

from ulysses_mm.core.format import SEGMENT_COLUMNS, PackedSample, segments_to_ids
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, PAD, TokenSpace
from ulysses_mm.loader.batch import make_batch
from ulysses_mm.shards.pack import DocumentBlock, Packer, check_sample, pack

SPACE = TokenSpace.from_vocab({"dna": 16, "audio": 256, "video": 512})


def random_docs(rng: np.random.Generator, n_docs: int, max_len: int):
    docs, mods = [], []
    for _ in range(n_docs):
        m = int(rng.integers(len(SPACE.modalities)))
        r = SPACE.ranges[m]
        body = rng.integers(r.start, r.stop, size=int(rng.integers(0, max_len)))
        docs.append(np.concatenate([[DOC_START, SPACE.boundary_token(r.name)], body, [DOC_END]]))
        mods.append(m)
    return docs, mods


def split_blocks(rng, docs, mods):
    """The same documents cut into blocks at random places (as input files would)."""
    cuts = sorted(rng.choice(np.arange(1, len(docs)), size=min(3, len(docs) - 1), replace=False))
    bounds = [0, *[int(c) for c in cuts], len(docs)]
    return [
        DocumentBlock.from_documents(docs[a:b], mods[a:b], SPACE.dtype())
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]


def unpack(samples: list[PackedSample]) -> dict[int, tuple[int, np.ndarray]]:
    """doc_id -> (modality, tokens) rebuilt from segment tables alone."""
    pieces: dict[int, list[tuple[int, int, np.ndarray]]] = {}
    for s in samples:
        for start, length, mod, doc, pos in s.segments.tolist():
            pieces.setdefault(doc, []).append((pos, mod, s.tokens[start : start + length]))
    out = {}
    for doc, parts in pieces.items():
        expected_pos = 0
        for pos, _, t in parts:  # in sample order, positions continue
            assert pos == expected_pos, f"doc {doc}: piece at {pos}, expected {expected_pos}"
            expected_pos += len(t)
        assert len({m for _, m, _ in parts}) == 1
        out[doc] = (parts[0][1], np.concatenate([t for _, _, t in parts]))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_packing_properties(seed: int):
    rng = np.random.default_rng(seed)
    seq_len = int(rng.choice([1, 2, 3, 7, 16, 64, 257, 1000, 4096]))
    max_len = int(rng.choice([3, 50] if seq_len < 64 else [3, 50, 700, 5000]))  # <= ~3k samples
    docs, mods = random_docs(rng, int(rng.integers(2, 40)), max_len)
    blocks = split_blocks(rng, docs, mods)
    samples = list(pack(blocks, seq_len, SPACE.dtype()))
    total = sum(len(d) for d in docs)

    assert len(samples) == -(-total // seq_len)
    assert [s.index for s in samples] == list(range(len(samples)))
    for i, s in enumerate(samples):
        assert s.tokens.shape == (seq_len,) and s.tokens.dtype == SPACE.dtype()
        assert s.segments.dtype == np.int64 and s.segments.shape[1] == len(SEGMENT_COLUMNS)
        check_sample(s, seq_len, len(SPACE.modalities))
        if i < len(samples) - 1:
            assert s.real_tokens == seq_len  # only the last sample is padded
    last = samples[-1]
    assert last.real_tokens == total - (len(samples) - 1) * seq_len
    assert (last.tokens[last.real_tokens :] == PAD).all()

    # every token of every document, exactly once, in order
    stream = np.concatenate([s.tokens[: s.real_tokens] for s in samples])
    np.testing.assert_array_equal(stream, np.concatenate(docs))
    rebuilt = unpack(samples)
    assert sorted(rebuilt) == list(range(len(docs)))
    for i, (d, m) in enumerate(zip(docs, mods)):
        assert rebuilt[i][0] == m
        np.testing.assert_array_equal(rebuilt[i][1], d)

    # segment tables agree with the tokens: a segment of a document that starts here begins
    # with <doc>, and one that ends here ends with </doc>
    for s in samples:
        for start, length, _, doc, pos in s.segments.tolist():
            piece = s.tokens[start : start + length]
            assert (piece[0] == DOC_START) == (pos == 0)
            assert (piece[-1] == DOC_END) == (pos + length == len(docs[doc]))

    # position ids continue across samples: position = pos_offset + offset in the piece
    for s in samples:
        doc_idx, positions = segments_to_ids(s.segments, seq_len)
        for row, (start, length, _, _, pos) in enumerate(s.segments.tolist()):
            assert (doc_idx[start : start + length] == row).all()
            np.testing.assert_array_equal(
                positions[start : start + length], pos + np.arange(length)
            )


def test_exact_fill_has_no_padded_sample():
    docs = [np.array([DOC_START, 4, 20, DOC_END]), np.array([DOC_START, 4, 21, 22, 23, DOC_END])]
    block = DocumentBlock.from_documents(docs, [0, 0], np.uint16)
    samples = list(pack([block], 5, np.uint16))
    assert len(samples) == 2 and all(s.real_tokens == 5 for s in samples)
    # the second document starts at token 4 of sample 0 and continues at 0 of sample 1
    np.testing.assert_array_equal(samples[0].segments, [[0, 4, 0, 0, 0], [4, 1, 0, 1, 0]])
    np.testing.assert_array_equal(samples[1].segments, [[0, 5, 0, 1, 1]])


def test_packer_continues_ids_and_counts_empty_documents():
    """Document ids are dataset-global and continue across blocks; an empty document keeps
    its id but has no segment."""
    p = Packer(4, np.uint8, first_doc_id=10, first_sample=3)
    b1 = DocumentBlock(np.array([1, 5, 2], np.uint8), [3, 0], [0, 1])
    b2 = DocumentBlock(np.array([1, 6, 6, 2], np.uint8), [4], [1])
    out = list(p.add(b1)) + list(p.add(b2)) + list(p.finish())
    assert [s.index for s in out] == [3, 4]
    np.testing.assert_array_equal(out[0].segments, [[0, 3, 0, 10, 0], [3, 1, 1, 12, 0]])
    np.testing.assert_array_equal(out[1].segments, [[0, 3, 1, 12, 1]])
    np.testing.assert_array_equal(out[1].tokens, [6, 6, 2, PAD])
    assert p.next_doc == 13


def test_document_block_rejects_inconsistent_input():
    with pytest.raises(ValueError, match="sum to 5"):
        DocumentBlock(np.zeros(4, np.uint8), [2, 3], [0, 0])
    with pytest.raises(ValueError, match="2 document lengths but 1 modalities"):
        DocumentBlock(np.zeros(4, np.uint8), [2, 2], [0])
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        Packer(0, np.uint8)


def test_check_sample_catches_broken_tables():
    good = PackedSample(0, np.array([1, 5, 2, 0], np.uint8), np.array([[0, 3, 0, 0, 0]], np.int64))
    check_sample(good, 4, 1)
    gap = PackedSample(0, good.tokens, np.array([[0, 1, 0, 0, 0], [2, 1, 0, 1, 0]], np.int64))
    with pytest.raises(ValueError, match="not contiguous"):
        check_sample(gap, 4, 1)
    tail = PackedSample(0, np.array([1, 5, 2, 9], np.uint8), good.segments)
    with pytest.raises(ValueError, match="non-pad tokens after the last segment"):
        check_sample(tail, 4, 1)


def test_packed_samples_feed_the_model_batch():
    """Packing output is what data.batch expects: positions restart per document and no
    label crosses a document boundary."""
    rng = np.random.default_rng(0)
    docs, mods = random_docs(rng, 12, 30)
    samples = list(
        pack([DocumentBlock.from_documents(docs, mods, SPACE.dtype())], 64, SPACE.dtype())
    )
    batch = make_batch(np.stack([s.tokens for s in samples]), [s.segments for s in samples], SPACE)
    for b, s in enumerate(samples):
        for start, length, _, _, pos in s.segments.tolist():
            assert batch.position_ids[b, start].item() == pos
            if start + length < 64 and start + length < s.real_tokens:
                # the last token of a piece does not predict the next document's <doc>
                assert batch.labels[b, start + length - 1].item() < 0


def cut_anywhere(rng, docs, mods) -> list[DocumentBlock]:
    """The same documents as blocks cut at random token positions, a document split
    across blocks carried on by ``continues`` (as staged entries are read back)."""
    docs = [d.astype(SPACE.dtype()) for d in docs]
    cuts = sorted({int(c) for c in rng.integers(1, sum(map(len, docs)), size=6)})
    return [
        DocumentBlock(b.tokens, b.lengths, b.modalities, b.continues)
        for b in cut_blocks(docs, mods, cuts)
    ]


@pytest.mark.parametrize("seed", range(20))
def test_blocks_cut_inside_documents_pack_to_the_same_samples(seed):
    rng = np.random.default_rng(seed)
    docs, mods = random_docs(rng, int(rng.integers(2, 30)), 300)
    seq_len = int(rng.integers(8, 200))
    whole = list(
        pack([DocumentBlock.from_documents(docs, mods, SPACE.dtype())], seq_len, SPACE.dtype())
    )
    cut = list(pack(cut_anywhere(rng, docs, mods), seq_len, SPACE.dtype()))
    assert len(cut) == len(whole)
    for a, b in zip(whole, cut):
        assert a.index == b.index
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.segments, b.segments)
