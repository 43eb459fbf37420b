from __future__ import annotations

import numpy as np
import pytest
import torch

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.loader.batch import make_batch, segments_to_ids
from ulysses_mm.model import IGNORE
from ulysses_mm.parallel.slice import sp_slice

SPACE = TokenSpace.from_vocab({"dna": 8})


def _sample():
    d = SPACE.range("dna").start
    bd = SPACE.boundary_token("dna")
    # a document continuing from an earlier sample (position offset 100), then a fresh one
    tokens = np.array([[d, d + 1, d + 2, DOC_END, DOC_START, bd, d + 3, d + 4, 0, 0]])
    segments = [np.array([[0, 4, 0, 17, 100], [4, 4, 0, 18, 0]])]
    return tokens, segments


def test_positions_restart_and_labels_stay_inside_documents():
    tokens, segments = _sample()
    batch = make_batch(tokens, segments, SPACE)
    assert batch.position_ids[0].tolist() == [100, 101, 102, 103, 0, 1, 2, 3, 0, 0]
    assert batch.doc_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, -1, -1]
    labels = batch.labels[0].tolist()
    assert labels[:3] == tokens[0, 1:4].tolist()  # shifted inside the first document
    assert labels[3] == IGNORE  # </doc> cannot predict the next document's <doc>
    assert labels[4:7] == tokens[0, 5:8].tolist()
    assert labels[7:] == [IGNORE] * 3  # nothing after the last real token, pad is no target
    assert (batch.label_modality[0][batch.labels[0] != IGNORE] == 0).all()


def test_sp_slice_keeps_full_doc_ids_and_boundary_labels():
    tokens, segments = _sample()
    batch = make_batch(tokens, segments, SPACE)
    halves = [sp_slice(batch, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([h.labels for h in halves], 1), batch.labels)
    assert halves[0].labels[0, -1] == tokens[0, 5]  # token 4's label is token 5, across the cut
    assert all(torch.equal(h.doc_ids, batch.doc_ids) for h in halves)
    with pytest.raises(
        ValueError,
        match=r"sp=3 does not divide the sequence of 10 tokens; sp sizes that do: \[1, 2, 5, 10\]",
    ):
        sp_slice(batch, 0, 3)


def test_segments_must_fit():
    with pytest.raises(ValueError, match="does not fit a sample of 8 tokens"):
        segments_to_ids(np.array([[4, 6, 0, 0, 0]]), 8)
