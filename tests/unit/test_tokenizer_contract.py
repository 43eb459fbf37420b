"""The Tokenizer contract: a kind is one class behind one registry line, and nothing
outside its package asks which kind it holds (hf names, units, grammar, media, inspect)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from ulysses_mm.core.errors import ConfigError
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, EOF, TokenSpace
from ulysses_mm.hf.tokenizer import token_names
from ulysses_mm.shards.inspect import Decoded, _draw_decoded
from ulysses_mm.tokenize import registry
from ulysses_mm.tokenize.base import Layout, TokenDocument, Tokenizer, TokenizerSpec
from ulysses_mm.tokenize.framing import DocumentFramer, local_ids
from ulysses_mm.tokenize.grammar import Grammar, Next
from ulysses_mm.tokenize.table import TokenizerTable
from ulysses_mm.tokenize.write import TextMedia
from ulysses_mm.train.evaluate import units_for

SPECS = REPO / "tokenizers"


class RunesTokenizer(Tokenizer):
    """A minimal kind: 26 letters, one id each; only encode_file and decode."""

    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        text = Path(path).read_text().strip().lower()
        ids = np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.int64) - ord("a")
        yield TokenDocument(path, path, self.modality, DocumentFramer(space, self.modality)(ids))

    def decode(self, tokens: np.ndarray, space: TokenSpace) -> str:
        ids = local_ids(tokens, space, self.modality)
        return bytes((np.asarray(ids) + ord("a")).astype(np.uint8)).decode("ascii")


SPACE = TokenSpace.from_vocab({"runes": 26, "dna": 5})
ENTRY = {"name": "runes", "kind": "runes", "modality": "runes", "vocab_size": 26, "params": {}}


@pytest.fixture
def runes(tmp_path):
    registry.register_kind("runes", RunesTokenizer, suffixes=[".runes"])
    try:
        yield RunesTokenizer(TokenizerSpec("runes", "runes", "runes", 26))
    finally:
        registry._KINDS.pop("runes", None)


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3))
    FigureCanvasAgg(fig)
    return fig, fig.add_gridspec(1, 1)


def _titles(fig) -> str:
    return " | ".join(ax.get_title() for ax in fig.axes)


def test_a_kind_with_only_encode_and_decode_works_everywhere(runes, tmp_path):
    assert registry.kind_class("runes") is RunesTokenizer
    # hf names: the local ids
    names = token_names(SPACE, {"runes": ENTRY})
    r = SPACE.range("runes")
    assert names[r.start] == "runes:0" and names[r.stop - 1] == "runes:25"
    # units: none (nats per token only), found from the entry without loading anything
    table = TokenizerTable(entries={"runes": ENTRY})
    assert table.kind_class("runes") is RunesTokenizer
    assert units_for(SPACE, table) == {}
    # grammar: any id of the range, or </doc>
    assert runes.layout(SPACE) == Layout()
    g = Grammar(runes, SPACE)
    assert g.next().forced == SPACE.boundary_token("runes")
    for t in (DOC_START, SPACE.boundary_token("runes")):
        g.feed(t)
    assert g.next() == Next("runes", r.start, r.stop, (DOC_END,))
    # media: the decoded str as text, the prompt's share cut off
    path = tmp_path / "a.runes"
    path.write_text("abcxyz")
    (doc,) = runes.encode_file(str(path), SPACE)
    prompt, new = doc.tokens[:4].tolist(), doc.tokens[4:-1].tolist()
    media = runes.media(SPACE, prompt, new)
    assert isinstance(media, TextMedia) and media.to_bytes() == b"cxyz"
    assert media.suffix == "txt" and not media.lacking() and media.describe() == "4 characters"
    assert runes.media(SPACE, prompt, new, with_prompt=True).to_bytes() == b"abcxyz"
    # no time, no fidelity measure: one-line errors
    with pytest.raises(ConfigError, match="--prompt-seconds applies to audio and video"):
        runes.prompt_ids_for_seconds(SPACE, new, 1.0)
    with pytest.raises(ConfigError, match="has no fidelity measure"):
        runes.fidelity(str(path))
    # inspect draws what it decoded, as text
    fig, grid = _figure()
    _draw_decoded(fig, grid[0], Decoded("runes", data="abcxyz", tokens=6, tokenizer=runes))
    assert "runes: 6 characters of text" in _titles(fig)


def test_inspect_draws_text_as_text_and_dna_as_bases():
    text = registry.load_tokenizer(SPECS / "text-bytes.json")
    dna = registry.load_tokenizer(SPECS / "dna-base.json")
    fig, grid = _figure()
    _draw_decoded(fig, grid[0], Decoded("text", data="Hello, world.\n" * 300, tokenizer=text))
    title = _titles(fig)
    assert "text: 4,200 characters of text" in title and "bases" not in title and "GC" not in title
    shown = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert "Hello, world." in shown
    fig, grid = _figure()
    _draw_decoded(fig, grid[0], Decoded("dna", data="ACGT" * 100, tokenizer=dna))
    assert "dna: 400 bases, GC 0.500" in _titles(fig)


def test_kind_facts_come_from_the_entry_alone():
    """Units and names of the shipped kinds, from manifest entries (no files, no weights)."""
    space = TokenSpace.from_vocab({"dna": 5, "audio": 256, "codec": 64, "video": 32})
    entries = {
        "dna": {"kind": "dna-base", "params": {}},
        "audio": {"kind": "audio-mulaw", "params": {"bits": 8}},
        "codec": {"kind": "audio-codec", "params": {"num_quantizers": 4, "tokens_per_second": 300}},
        "video": {"kind": "video-vq", "params": {}},
    }
    units = units_for(space, TokenizerTable(entries=entries))
    assert {m: u.name for m, u in units.items()} == {
        "dna": "base",
        "audio": "sample",
        "codec": "second",
        "video": "frame",
    }
    ns = space.num_specials
    assert float(units["codec"].table[ns]) == pytest.approx(1 / 300)
    assert float(units["video"].table[EOF]) == 1.0 and float(units["video"].table[ns:].sum()) == 0
    names = token_names(space, entries)
    assert names[space.range("video").start] == "video:vq0"
    assert names[space.range("codec").start + 16] == "codec:q1:0"
