from __future__ import annotations

import numpy as np
import pytest

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, EOF, PAD, TokenSpace, token_modalities


def test_layout_and_roundtrip():
    space = TokenSpace.from_vocab({"dna": 16, "audio": 256, "video": 1025})
    assert space.specials[:4] == ("<pad>", "<doc>", "</doc>", "<eof>")
    assert space.num_specials == 7
    assert [(r.name, r.start, r.stop) for r in space.ranges] == [
        ("dna", 7, 23),
        ("audio", 23, 279),
        ("video", 279, 1304),
    ]
    assert space.boundary_token("video") == 6
    assert space.dtype() == np.uint16
    assert TokenSpace.from_dict(space.to_dict()) == space
    assert TokenSpace.from_vocab({"dna": 5}).dtype() == np.uint8


def test_malformed_spaces_are_refused():
    with pytest.raises(ValueError, match="at least one modality"):
        TokenSpace.from_vocab({})
    d = TokenSpace.from_vocab({"dna": 16}).to_dict()
    d["modalities"][0]["start"] = 3
    with pytest.raises(ValueError, match="not the canonical layout"):
        TokenSpace.from_dict(d)


def test_token_modalities_routes_specials_by_context():
    space = TokenSpace.from_vocab({"dna": 4, "audio": 4, "video": 4})
    dna, audio, video = (space.range(m).start for m in ("dna", "audio", "video"))
    bd, ba, bv = (space.boundary_token(m) for m in ("dna", "audio", "video"))
    tokens = np.array(
        [
            DOC_START,
            bv,
            video,
            EOF,
            ba,
            audio,
            DOC_END,
            DOC_START,
            bd,
            dna,
            dna + 1,
            DOC_END,
            PAD,
            PAD,
        ]
    )
    docs = np.array([0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1, -1])
    mods = token_modalities(tokens, docs, space)
    #               <doc> <|v|> v  eof <|a|> a </doc> <doc> <|d|> d  d </doc> pad pad
    assert mods.tolist() == [2, 2, 2, 2, 1, 1, 1, 0, 0, 0, 0, 0, -1, -1]
    assert token_modalities(tokens[None], docs[None], space).tolist() == [mods.tolist()]
