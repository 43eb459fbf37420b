"""What a stream drew so far, against its weights: each manifest's share of the samples
and each weighted modality's share of its manifest's tokens (what training logs as
``mix/<label>``).

The tokens are counted from each manifest's per-sample record, not from the shards, and
for every rank's draws together, so every rank holds the same tally; a resumed stream
replays the order up to its cursor to rebuild it.
"""

from __future__ import annotations

import numpy as np

from ulysses_mm.loader.mixing import mix_error
from ulysses_mm.loader.order import Cursor, GlobalOrder


class MixTally:
    def __init__(self, order: GlobalOrder) -> None:
        self.order = order
        # per manifest with modality weights: the tokens drawn from it so far
        self._drawn = {
            j: np.zeros(t.shape[1], dtype=np.int64) for j, t in order.sample_tokens.items()
        }

    def _tokens_of(self, src: np.ndarray, idx: np.ndarray) -> dict[int, np.ndarray]:
        """Per weighted manifest: real tokens per modality of the drawn samples given."""
        return {
            j: table[idx[np.isin(src, self.order.pools_of[j])]].sum(axis=0)
            for j, table in self.order.sample_tokens.items()
        }

    def add(self, src: np.ndarray, idx: np.ndarray) -> None:
        """Count the draws ``(source, sample index)`` of a span of the order."""
        for j, tokens in self._tokens_of(src, idx).items():
            self._drawn[j] += tokens

    def replay(self, cursor: Cursor) -> None:
        """The tally of a stream that has drawn every position before ``cursor``."""
        if self.order.sample_tokens:
            src, idx, _ = self.order.span(self.order.start(), cursor.position)
            self._drawn = self._tokens_of(src, idx)

    def drawn_tokens(self) -> dict[int, np.ndarray]:
        """For each manifest with modality weights (by its number): the real tokens of each
        modality (token-space order) in the samples drawn from it so far."""
        return {j: t.copy() for j, t in self._drawn.items()}

    def _manifest_labels(self) -> list[str]:
        manifests = self.order.manifests
        labels = [
            m.location.rstrip("/").rsplit("/", 2)[-2] if "/" in m.location else m.name
            for m in manifests
        ]
        if len(set(labels)) < len(labels):
            labels = [f"{i}.{label}" for i, label in enumerate(labels)]
        return labels

    @property
    def source_labels(self) -> list[str]:
        """A short distinct name per source: the directory of its manifest (else numbered),
        and ``/modality`` for a modality's share of a manifest."""
        labels = self._manifest_labels()
        return [
            labels[src.m] + (f"/{src.modality}" if src.modality else "")
            for src in self.order.sources
        ]

    def manifest_counts(self, counts: np.ndarray) -> np.ndarray:
        """Samples drawn from each manifest (its modality sources together), from the
        draws per source ``counts``."""
        per = np.zeros(len(self.order.manifests), dtype=np.int64)
        for source, c in zip(self.order.sources, counts):
            per[source.m] += c
        return per

    def mix_shares(self, counts: np.ndarray) -> dict[str, float]:
        """Each manifest's share of the samples (``label``; with several manifests) and each
        weighted modality's share of its manifest's tokens (``label/modality``)."""
        labels = self._manifest_labels()
        manifests = self.order.manifests
        out: dict[str, float] = {}
        if len(manifests) > 1:
            per = self.manifest_counts(counts).astype(np.float64)
            for j, share in enumerate(per / max(1.0, per.sum())):
                out[labels[j]] = float(share)
        for j, tokens in self._drawn.items():
            names = manifests[j].token_space.modalities
            listed = [k for k, n in enumerate(names) if n in self.order.modality_weights[j]]
            total = max(1, int(tokens[listed].sum()))
            for k in listed:
                out[f"{labels[j]}/{names[k]}"] = float(tokens[k] / total)
        return out

    def modality_mix_error(self) -> float:
        """The largest |token share − weight| / weight over the weighted modalities of every
        manifest (0 when no manifest weights its modalities)."""
        err = 0.0
        for j, tokens in self._drawn.items():
            names = self.order.manifests[j].token_space.modalities
            mw = self.order.modality_weights[j]
            listed = [k for k, n in enumerate(names) if n in mw]
            err = max(err, mix_error(tokens[listed].tolist(), [mw[names[k]] for k in listed]))
        return err
