"""The documents a step's samples hold, as the attention pairs they cost.

Causal attention inside documents computes Σ l·(l+1)/2 (query, key) pairs per packed
sample (what ``train.flops.causal_pairs`` counts on a batch, and counts here). A time prediction needs that sum at the step's length N, so the
documents are a stream of lengths cut into windows of N tokens (a document that crosses a
window's end goes on in the next, as a window cut from longer packed samples does):

- ``full``: every sample one document of N tokens (N·(N+1)/2 pairs);
- ``N`` (an integer): documents of N tokens;
- ``lognormal:MEDIAN[:SIGMA]``: lengths drawn from a log-normal with that median (σ of
  the log, default 1), a fixed seed, so one spec always gives one figure;
- ``manifest``: the document lengths of a data manifest's packed samples, read from their
  segment tables with the shard reader (at most :data:`MAX_SAMPLES` samples, from shards
  spread over the dataset).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ulysses_mm.core.errors import UserError
from ulysses_mm.core.format import document_lengths
from ulysses_mm.core.storage import Location
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.reader import read_samples

MAX_SAMPLES = 2048  # packed samples read from a manifest's shards
MAX_WINDOWS = 256  # windows of N averaged over ...
MAX_TOKENS = 1 << 24  # ... of at most this many tokens in all
_SEED = 0
SPEC_HELP = "full, N (documents of N tokens), lognormal:MEDIAN[:SIGMA] or manifest"


@dataclass(frozen=True)
class DocLengths:
    """Where a step's document lengths come from: ``kind`` full, fixed, lognormal or
    manifest; ``lengths`` the stream (fixed, lognormal, manifest)."""

    kind: str
    spec: str
    lengths: tuple[int, ...] = ()
    median: float = 0.0
    sigma: float = 0.0
    source: str = ""
    _pairs: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def pairs_per_sample(self, seq_len: int) -> float:
        """The mean causal pairs of one sample of ``seq_len`` tokens."""
        return float(self.window_pairs(seq_len).mean())

    def window_pairs(self, seq_len: int) -> np.ndarray:
        """The causal pairs of each sample of ``seq_len`` tokens the documents make (one
        figure for ``full``): how unequal the samples' attention work is. Cached by
        length (``--best`` asks once per layout)."""
        if seq_len not in self._pairs:
            self._pairs[seq_len] = (
                np.array([seq_len * (seq_len + 1) / 2])
                if self.kind == "full"
                else window_pairs(self._stream(seq_len), seq_len)
            )
        return self._pairs[seq_len]

    def _stream(self, seq_len: int) -> np.ndarray:
        if self.kind == "lognormal":
            rng = np.random.default_rng(_SEED)
            # enough documents for MAX_WINDOWS windows at this median (at least 4096)
            count = max(4096, int(4 * MAX_WINDOWS * seq_len / max(self.median, 1.0)))
            count = min(count, 1 << 22)
            draws = rng.lognormal(np.log(self.median), self.sigma, size=count)
            return np.maximum(1, np.rint(draws)).astype(np.int64)
        lengths = np.asarray(self.lengths, dtype=np.int64)
        if self.kind == "fixed":
            # one window's worth is the whole stream: every window looks the same
            reps = -(-seq_len // int(lengths[0])) + 1
            return np.repeat(lengths, reps)
        return lengths

    def describe(self) -> str:
        if self.kind == "full":
            return "every sample one document"
        if self.kind == "fixed":
            return f"documents of {self.lengths[0]:,} tokens"
        if self.kind == "lognormal":
            return f"log-normal document lengths, median {self.median:,.0f}, σ {self.sigma:g}"
        return f"document lengths of {len(self.lengths):,} documents from {self.source}"


def window_pairs(lengths: np.ndarray, seq_len: int, windows: int = 0) -> np.ndarray:
    """The causal pairs of each window of ``seq_len`` tokens cut from the document stream
    ``lengths`` (:func:`window_pieces`): whole windows only, ``windows`` of them, by
    default as many as the stream holds up to :data:`MAX_WINDOWS` and :data:`MAX_TOKENS`
    tokens; a stream shorter than one window is repeated to fill it."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total <= 0:
        raise UserError("the document lengths hold no tokens")
    if total < seq_len:
        lengths = np.tile(lengths, -(-seq_len // total))
        total = int(lengths.sum())
    if windows <= 0:
        windows = max(1, min(total // seq_len, MAX_WINDOWS, MAX_TOKENS // seq_len))
    pieces, which = window_pieces(lengths, seq_len, windows)
    n = pieces.astype(np.float64)
    return np.bincount(which, weights=n * (n + 1) / 2, minlength=windows)


def window_pieces(lengths: np.ndarray, seq_len: int, windows: int) -> tuple[np.ndarray, np.ndarray]:
    """The document stream ``lengths`` cut at every document's end and every ``seq_len``
    tokens, over its first ``windows`` windows: (each piece's tokens, its window). A
    document that crosses a window's end is two pieces, one in each window."""
    span = windows * seq_len
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    if ends[-1] < span:
        raise UserError(
            f"the document lengths hold {ends[-1]:,} tokens, not {windows} windows of {seq_len:,}"
        )
    cuts = np.union1d(ends[ends < span], np.arange(1, windows, dtype=np.int64) * seq_len)
    bounds = np.concatenate([[0], cuts, [span]])
    return np.diff(bounds), bounds[:-1] // seq_len


def manifest_doc_lengths(manifest: str, storage_options: dict | None = None) -> DocLengths:
    """The document lengths of up to :data:`MAX_SAMPLES` packed samples of ``manifest``,
    read with the shard reader from shards spread evenly over the dataset."""
    m = Manifest.load(Location(manifest, storage_options or {}))
    if not m.shards:
        raise UserError(f"{manifest}: the manifest lists no shards")
    per = max(1, m.num_samples // max(1, len(m.shards)))
    count = min(len(m.shards), max(1, -(-MAX_SAMPLES // per)))
    picks = np.unique(np.linspace(0, len(m.shards) - 1, count).round().astype(int))
    lengths: list[int] = []
    read = 0
    for i in picks:
        where = m.shard_where(int(i))
        for sample in read_samples(where.read_bytes(), str(m.shard_location(int(i)))):
            lengths += document_lengths(sample.segments).tolist()
            read += 1
            if read >= MAX_SAMPLES:
                break
        if read >= MAX_SAMPLES:
            break
    if not lengths:
        raise UserError(f"{manifest}: its shards hold no documents")
    return DocLengths(
        "manifest", "manifest", tuple(lengths), source=f"{read:,} samples of {manifest}"
    )


def doc_lengths(spec: str | None, manifest: str | None = None, storage_options=None) -> DocLengths:
    """``--doc-lengths``: ``spec`` (:data:`SPEC_HELP`); None = the manifest's when one is
    given, else full. A bad spec is refused in one line."""
    if spec is None:
        spec = "manifest" if manifest else "full"
    text = spec.strip().lower()
    if text == "full":
        return DocLengths("full", spec)
    if text == "manifest":
        if not manifest:
            raise UserError("--doc-lengths manifest needs --manifest PATH")
        return manifest_doc_lengths(manifest, storage_options)
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise UserError(f"--doc-lengths {spec}: a document length must be >= 1")
        return DocLengths("fixed", spec, (n,))
    if text.startswith("lognormal:"):
        parts = text.split(":")[1:]
        try:
            median = float(parts[0])
            sigma = float(parts[1]) if len(parts) > 1 else 1.0
        except (ValueError, IndexError):
            median = sigma = -1.0
        if len(parts) > 2 or not median >= 1 or not 0 < sigma <= 4:
            raise UserError(
                f"--doc-lengths {spec}: lognormal:MEDIAN[:SIGMA] needs MEDIAN >= 1 and "
                "0 < SIGMA <= 4 (e.g. lognormal:4096:1)"
            )
        return DocLengths("lognormal", spec, median=median, sigma=sigma)
    raise UserError(f"--doc-lengths {spec!r}: give {SPEC_HELP}")
