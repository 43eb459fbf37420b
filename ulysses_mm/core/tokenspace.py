"""The unified token space: shared specials, then one disjoint id range per modality.

Every sample the model sees is a stream of ids from this one space. Layout::

    0 .. S-1            shared specials: <pad> <doc> </doc> <eof> then <|m|> per modality
    S .. S+V_0-1        modality 0 (for example dna)
    ...                 modality k, in the order given

The space is a pure function of the ordered modality vocabularies, so a pipeline writes
it into its manifest and training refuses shards whose space differs from the model's.

Each modality's output head predicts over (specials + its own range); see
:func:`token_modalities` for how a special token is assigned to a modality.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError

BASE_SPECIALS = ("<pad>", "<doc>", "</doc>", "<eof>")
PAD, DOC_START, DOC_END, EOF = 0, 1, 2, 3

# The modality vocabularies of the shipped specs (tokenizers/dna-base, audio-mulaw-16k,
# video-vq): the space of a run whose config names none and that has no manifest to ask.
DEFAULT_MODALITIES = {"dna": 10, "audio": 256, "video": 256}
# the file a checkpoint, an export or a tokenizer directory keeps its token space in
SPACE_FILE = "token_space.json"


@dataclass(frozen=True)
class ModalityRange:
    name: str
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class TokenSpace:
    """Specials and modality ranges. Build with :meth:`from_vocab`."""

    specials: tuple[str, ...]
    ranges: tuple[ModalityRange, ...]

    @classmethod
    def from_vocab(cls, vocab: Mapping[str, int]) -> TokenSpace:
        """``{"dna": 16, "audio": 256}`` (ordered) to a token space."""
        if not vocab:
            raise DataError("a token space needs at least one modality")
        names = list(vocab)
        for name in names:
            if not name.isidentifier():
                raise DataError(f"modality name {name!r} must be an identifier")
            if vocab[name] < 1:
                raise DataError(
                    f"modality {name!r} needs a vocabulary of at least 1, got {vocab[name]}"
                )
        specials = BASE_SPECIALS + tuple(f"<|{n}|>" for n in names)
        start = len(specials)
        ranges = []
        for name in names:
            ranges.append(ModalityRange(name, start, int(vocab[name])))
            start += int(vocab[name])
        return cls(specials, tuple(ranges))

    # ------------------------------------------------------------------ queries
    @property
    def num_specials(self) -> int:
        return len(self.specials)

    @property
    def vocab_size(self) -> int:
        return self.ranges[-1].stop

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.ranges)

    def vocab(self) -> dict[str, int]:
        return {r.name: r.size for r in self.ranges}

    def index(self, modality: str) -> int:
        for i, r in enumerate(self.ranges):
            if r.name == modality:
                return i
        raise KeyError(f"modality {modality!r} is not in the token space {list(self.modalities)}")

    def range(self, modality: str) -> ModalityRange:
        return self.ranges[self.index(modality)]

    def boundary_token(self, modality: str) -> int:
        """Id of ``<|modality|>``, the token that opens a span of that modality."""
        return len(BASE_SPECIALS) + self.index(modality)

    def dtype(self) -> np.dtype:
        """The smallest unsigned dtype that holds every id."""
        for dt in (np.uint8, np.uint16, np.uint32):
            if self.vocab_size - 1 <= np.iinfo(dt).max:
                return np.dtype(dt)
        return np.dtype(np.uint64)

    # ------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "specials": list(self.specials),
            "modalities": [{"name": r.name, "start": r.start, "size": r.size} for r in self.ranges],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenSpace:
        try:
            vocab = {m["name"]: int(m["size"]) for m in data["modalities"]}
        except (KeyError, TypeError) as e:
            raise DataError(f"malformed token space {json.dumps(data)[:200]}: {e}") from e
        space = cls.from_vocab(vocab)
        if list(data.get("specials", space.specials)) != list(space.specials) or [
            (m["name"], m["start"], m["size"]) for m in data["modalities"]
        ] != [(r.name, r.start, r.size) for r in space.ranges]:
            raise DataError(
                f"token space {json.dumps(data)[:300]} is not the canonical layout of {vocab}"
            )
        return space

    def describe(self) -> str:
        parts = [f"specials 0..{self.num_specials - 1}"]
        parts += [f"{r.name} {r.start}..{r.stop - 1}" for r in self.ranges]
        return f"TokenSpace(vocab={self.vocab_size}: " + ", ".join(parts) + ")"


def token_modalities(tokens: np.ndarray, doc_ids: np.ndarray, space: TokenSpace) -> np.ndarray:
    """Modality index of every token of a packed sample ([..., N] int arrays); -1 for pad.

    A token in a modality range belongs to that modality. ``<|m|>`` belongs to m (it opens
    a span of m). Any other special (``<doc>``, ``</doc>``, ``<eof>``) takes the modality of
    the nearest preceding non-special token of its document, or, at the start of a
    document, of the first following one. So a document that interleaves video and audio
    routes each target to the right head, and ``</doc>`` is predicted by the head of the
    modality it ends.
    """
    tokens = np.asarray(tokens)
    doc_ids = np.asarray(doc_ids)
    if tokens.shape != doc_ids.shape:
        raise ValueError(f"tokens {tokens.shape} and doc_ids {doc_ids.shape} differ in shape")
    flat_t = tokens.reshape(-1, tokens.shape[-1]) if tokens.ndim else tokens.reshape(1, 1)
    flat_d = doc_ids.reshape(flat_t.shape)
    out = np.empty(flat_t.shape, dtype=np.int64)
    nb = len(BASE_SPECIALS)
    starts = np.array([r.start for r in space.ranges])
    for row in range(flat_t.shape[0]):
        t = flat_t[row].astype(np.int64)
        d = flat_d[row]
        mod = np.searchsorted(starts, t, side="right") - 1  # range index, -1 for specials
        mod = np.where(t >= space.num_specials, mod, -1)
        boundary = (t >= nb) & (t < space.num_specials)
        mod = np.where(boundary, t - nb, mod)
        known = mod >= 0
        n = t.shape[0]
        idx = np.arange(n)
        new_doc = np.ones(n, dtype=bool)
        new_doc[1:] = d[1:] != d[:-1]
        # forward fill within a document
        last = np.where(known | new_doc, idx, 0)
        np.maximum.accumulate(last, out=last)
        fwd = np.where(known[last], mod[last], -1)
        # backward fill within a document (for specials before the first known token)
        end_doc = np.ones(n, dtype=bool)
        end_doc[:-1] = d[1:] != d[:-1]
        nxt = np.where(known | end_doc, idx, n - 1)
        nxt = np.minimum.accumulate(nxt[::-1])[::-1]
        bwd = np.where(known[nxt], mod[nxt], -1)
        res = np.where(fwd >= 0, fwd, bwd)
        res = np.where(t == PAD, -1, res)
        out[row] = res
    return out.reshape(tokens.shape)
