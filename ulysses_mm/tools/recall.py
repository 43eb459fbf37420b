"""The retrieval probe: keys planted with values, asked for again at every distance.

A recall document is exactly L tokens, framing included (``<doc> <|dna|>`` … ``</doc>``:
L − 3 tokens of body), so ``--pack K`` samples of K·L tokens cut into windows of L are
whole documents. Its body is filler (the passkey tests' repeated filler text: nothing to
learn there but to wait) with P key–value pairs: a key is a token of its own (unique in
its document), planted with its value as ``k v`` and asked for again later as ``k v``. A
model that finds the earlier ``k`` predicts ``v`` after the second; one that does not
guesses among the values. Distances (second key − first key) are drawn log-uniform from
:data:`MIN_DISTANCE` tokens to the body's length, so every octave up to the document's
length holds about as many answers.

Two alphabets (:data:`ALPHABETS`): DNA (FASTA records through ``pipelines/dna.yaml``):
filler ``N``, keys the soft-masked bases ``a c g t n``, values ``A C G T`` (a guess is a
quarter right, 2 bits); text (``.jsonl`` lines through ``tokenizers/text-bytes.json``, one
token per byte): filler ``.``, keys ``# $ % & @``, values the digits (a guess is a tenth
right, 3.3 bits).

Answers are read back from the prepared shards, not trusted from the generator: in each
document, a key token seen for the second time is a query, the token after it the answer
(``answers.npz`` beside the manifest: sample, position of the answer in the sample,
distance; read with ``allow_pickle=False``). Scoring bins each answer's target (the query
key's position, whose label is the answer) by its distance's power-of-two bucket and goes
through :func:`~ulysses_mm.train.evaluate.evaluate_batches` as ``evaluate`` does, under
any layout: exact-answer accuracy (the head's argmax) and bits per answer per bucket.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.core.format import NUM_COLUMNS, SEG_LENGTH, SEG_START, PackedSample
from ulysses_mm.core.storage import Location, atomic_local_file
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.train.metrics import LN2

ANSWERS_FILE = "answers.npz"
ANSWER_ARRAYS = ("sample", "position", "distance")
FRAMING = 3  # <doc> <|dna|> ... </doc>
MIN_DISTANCE = 4
LINE = 60  # bases per FASTA line


@dataclass(frozen=True)
class Alphabet:
    """A modality's recall tokens, as bytes of its input files: ``ids`` maps a byte to its
    local token id (its index there; empty: the byte's own value, as text-bytes)."""

    modality: str
    filler: bytes
    keys: bytes  # each at most once per document as a key
    values: bytes
    ids: bytes = b""

    def local(self, byte: int) -> int:
        return self.ids.index(byte) if self.ids else byte


ALPHABETS = {
    # tokenizers/dna-base.json: A C G T N a c g t n are the modality's ids 0..9
    "dna": Alphabet("dna", b"N", b"acgtn", b"ACGT", b"ACGTNacgtn"),
    # tokenizers/text-bytes.json: one token per byte, id = the byte
    "text": Alphabet("text", b".", b"#$%&@", b"0123456789"),
}
MODALITIES = tuple(ALPHABETS)
DEFAULT_PAIRS = 4
MAX_PAIRS = min(len(a.keys) for a in ALPHABETS.values())


def min_length(pairs: int) -> int:
    """The shortest document that holds ``pairs`` pairs at the shortest distance."""
    return FRAMING + 4 * pairs + MIN_DISTANCE


def check_recall(length: int, pairs: int) -> None:
    if not 1 <= pairs <= MAX_PAIRS:
        raise ConfigError(
            f"--pairs must be 1..{MAX_PAIRS} (a key is one of {MAX_PAIRS} tokens), got {pairs}"
        )
    if length < min_length(pairs):
        raise ConfigError(
            f"--length {length} is too short for {pairs} recall pairs: at least "
            f"{min_length(pairs)} tokens"
        )


def recall_body(
    bases: int, pairs: int, rng: np.random.Generator, alphabet: Alphabet = ALPHABETS["dna"]
) -> bytes:
    """``bases`` of filler with ``pairs`` key–value pairs planted and asked for again, each
    key once (module docstring). A pair that finds no free places in 64 draws is left out
    (only in documents barely longer than :func:`min_length`)."""
    keys_, values = alphabet.keys, alphabet.values
    body = bytearray(alphabet.filler * bases)
    used = np.zeros(bases, dtype=bool)
    keys = rng.permutation(len(keys_))[:pairs]
    lo, hi = math.log(MIN_DISTANCE), math.log(max(MIN_DISTANCE, bases - 2))
    for key in keys:
        for _ in range(64):
            d = int(math.exp(rng.uniform(lo, hi)))
            if d + 2 > bases:
                continue
            p = int(rng.integers(0, bases - d - 1))
            q = p + d
            if used[[p, p + 1, q, q + 1]].any():
                continue
            v = values[int(rng.integers(0, len(values)))]
            body[p], body[p + 1], body[q], body[q + 1] = keys_[key], v, keys_[key], v
            used[[p, p + 1, q, q + 1]] = True
            break
    return bytes(body)


def write_recall_source(
    path: Path, length: int, documents: int, pairs: int, seed: int, modality: str = "dna"
) -> Path:
    """``documents`` recall bodies of ``length`` − :data:`FRAMING` tokens, written whole or
    not at all: FASTA records for DNA, ``.jsonl`` lines (``{"text": …}``) for text."""
    alphabet = ALPHABETS[modality]
    rng = np.random.default_rng(seed)
    with atomic_local_file(path) as f:
        for i in range(documents):
            body = recall_body(length - FRAMING, pairs, rng, alphabet)
            if modality == "text":
                f.write(json.dumps({"text": body.decode("ascii")}).encode() + b"\n")
                continue
            lines = b"\n".join(body[j : j + LINE] for j in range(0, len(body), LINE))
            f.write(f">recall{i} L={length} pairs={pairs}\n".encode() + lines + b"\n")
    return path


# ---------------------------------------------------------------- answers


def find_answers(sample: PackedSample, keys: np.ndarray) -> Iterator[tuple[int, int]]:
    """(position of the answer in the sample, distance) of each query of ``sample``: a
    key token (one of ``keys``) seen for the second time in its document."""
    seg = np.asarray(sample.segments, dtype=np.int64).reshape(-1, NUM_COLUMNS)
    tokens = np.asarray(sample.tokens)
    for start, length in zip(seg[:, SEG_START], seg[:, SEG_LENGTH], strict=True):
        doc = tokens[start : start + length]
        seen: dict[int, int] = {}
        for at in np.flatnonzero(np.isin(doc, keys)):
            token = int(doc[at])
            if token in seen:
                if at + 1 < length:
                    yield int(start + at + 1), int(at - seen[token])
            else:
                seen[token] = int(at)


def modality_of(manifest: Manifest) -> str:
    """The recall modality of ``manifest``: the one its tokens are (one line if none)."""
    held = [m for m, n in manifest.tokens.items() if n]
    if len(held) != 1 or held[0] not in ALPHABETS:
        raise DataError(
            f"{manifest.location}: not a recall dataset (tokens of {held or 'nothing'}; "
            f"recall documents are all {' or all '.join(MODALITIES)})"
        )
    return held[0]


def key_ids(manifest: Manifest) -> np.ndarray:
    """The token ids of the keys in ``manifest``'s token space (its modality's)."""
    alphabet = ALPHABETS[modality_of(manifest)]
    start = manifest.token_space.range(alphabet.modality).start
    return np.array([start + alphabet.local(k) for k in alphabet.keys], dtype=np.int64)


@dataclass(frozen=True)
class Answers:
    """Every answer of a recall dataset: its sample, its position there, its distance."""

    sample: np.ndarray
    position: np.ndarray
    distance: np.ndarray

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, sample=self.sample, position=self.position, distance=self.distance)
        return buf.getvalue()

    @classmethod
    def load(cls, loc: Location) -> Answers:
        """The answers file at ``loc`` (one line if it is not one)."""
        try:
            with np.load(io.BytesIO(loc.read_bytes()), allow_pickle=False) as z:
                arrays = {k: np.asarray(z[k], dtype=np.int64) for k in ANSWER_ARRAYS}
        except (KeyError, ValueError, OSError) as e:
            raise DataError(f"{loc}: not a recall answers file ({e})") from None
        if len({a.shape for a in arrays.values()}) != 1 or arrays["distance"].min(initial=1) < 1:
            raise DataError(f"{loc}: its arrays differ in length or hold a distance < 1")
        return cls(**arrays)


def answers_location(manifest: Manifest) -> Location:
    """Where a dataset's answers file is: beside its manifest, reached the same way."""
    url = manifest.location
    head = url.rsplit("/", 1)[0] if "/" in url else "."
    return manifest.where.at(f"{head}/{ANSWERS_FILE}")


def has_answers(manifest: Manifest) -> bool:
    return answers_location(manifest).exists()


def read_answers(manifest: Manifest) -> Answers:
    return Answers.load(answers_location(manifest))


def collect_answers(samples: Sequence[PackedSample], keys: np.ndarray) -> Answers:
    rows = [(s.index, pos, d) for s in samples for pos, d in find_answers(s, keys)]
    arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return Answers(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy())


# ---------------------------------------------------------------- buckets


def bucket_edges(longest: int) -> list[int]:
    """Power-of-two distance buckets [1, 2), [2, 4), … up to past ``longest``."""
    top = max(1, int(longest)).bit_length()
    return [1 << i for i in range(top + 1)]


class AnswerBins:
    """Per window of ``length`` tokens (index: sample·k + window), the [N] bin of each
    target: the bucket of its answer's distance at the query key, −1 elsewhere."""

    def __init__(self, answers: Answers, seq_len: int, length: int, edges: Sequence[int]) -> None:
        self.length, self.k = length, seq_len // length
        target = answers.position - 1  # the query key's position: its label is the answer
        window = target // length
        whole = window == (answers.position // length)  # the answer in the same window
        bucket = np.searchsorted(np.asarray(edges), answers.distance, side="right") - 1
        self.by_window: dict[int, list[tuple[int, int]]] = {}
        for s, w, t, b, ok in zip(
            answers.sample, window, target, bucket, whole & (window < self.k), strict=True
        ):
            if ok:
                self.by_window.setdefault(int(s) * self.k + int(w), []).append(
                    (int(t - w * length), int(b))
                )

    def of(self, samples: Sequence[PackedSample]) -> torch.Tensor:
        out = torch.full((len(samples), self.length), -1, dtype=torch.long)
        for row, s in enumerate(samples):
            for t, b in self.by_window.get(s.index, ()):
                out[row, t] = b
        return out


def recall_figures(
    rows: Sequence[tuple[int, int, float, int]], hits: Sequence[int]
) -> dict[str, Any]:
    """The recall table of an evaluation's bins of the dataset's modality: per bucket the answers, the share
    answered right and the bits per answer; overall the same pooled."""
    buckets = [
        {"lo": lo, "hi": hi, "answers": n, "accuracy": h / n, "bits": v / LN2}
        for (lo, hi, v, n), h in zip(rows, hits, strict=True)
    ]
    total = sum(b["answers"] for b in buckets)
    return {
        "task": "recall",
        "buckets": buckets,
        "answers": total,
        "accuracy": sum(hits) / total if total else math.nan,
        "bits": sum(v * n for _, _, v, n in rows) / total / LN2 if total else math.nan,
    }
