"""Model inputs from packed samples.

A packed sample is ``tokens [N]`` plus a segment table (one row per document piece:
start, length, modality, document id, position of the piece inside its document).
:func:`make_batch` turns samples into model inputs: position ids that restart at each
document, document ids for the attention mask, and labels shifted by one BEFORE any
slicing, so the label at an SP slice boundary (token r·N/P predicts r·N/P + 1) is kept.
A label is ignored where the next token starts another document (attention cannot see
across, so it is unpredictable) and at the end of the sample.
Each SP rank then keeps its slice (:func:`ulysses_mm.parallel.slice.sp_slice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from ulysses_mm.core.format import IGNORE, PackedSample, segments_to_ids
from ulysses_mm.core.tokenspace import PAD, TokenSpace, token_modalities


@dataclass
class Batch:
    """Model inputs. Per-token fields are [b, n] (n = N/P under SP); doc_ids is [b, N]."""

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    label_modality: Tensor
    doc_ids: Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            **{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)}
        )

    def rows(self, start: int, stop: int) -> Batch:
        """Samples ``start`` .. ``stop`` - 1 (a DP rank's share of a global batch)."""
        return Batch(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE).sum())


def make_labels(
    tokens: np.ndarray, doc_ids: np.ndarray, space: TokenSpace
) -> tuple[np.ndarray, np.ndarray]:
    """(labels, label_modality) for [b, N] arrays, shifted by one inside each document."""
    tokens = np.asarray(tokens, dtype=np.int64)
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    mods = token_modalities(tokens, doc_ids, space)
    labels = np.full_like(tokens, IGNORE)
    label_mod = np.full_like(tokens, -1)
    same_doc = (
        (doc_ids[..., 1:] == doc_ids[..., :-1]) & (tokens[..., 1:] != PAD) & (mods[..., 1:] >= 0)
    )
    labels[..., :-1] = np.where(same_doc, tokens[..., 1:], IGNORE)
    label_mod[..., :-1] = np.where(same_doc, mods[..., 1:], -1)
    return labels, label_mod


def make_batch(tokens: np.ndarray, segments: list[np.ndarray], space: TokenSpace) -> Batch:
    """A batch from b packed samples: tokens [b, N] and one segment table per sample."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 2 or len(segments) != tokens.shape[0]:
        raise ValueError(
            f"need tokens [b, N] and b segment tables; got {tokens.shape} and {len(segments)}"
        )
    n = tokens.shape[1]
    doc, pos = zip(*(segments_to_ids(s, n) for s in segments))
    doc_ids, position_ids = np.stack(doc), np.stack(pos)
    labels, label_mod = make_labels(tokens, doc_ids, space)
    return Batch(
        input_ids=torch.from_numpy(tokens),
        position_ids=torch.from_numpy(position_ids),
        labels=torch.from_numpy(labels),
        label_modality=torch.from_numpy(label_mod),
        doc_ids=torch.from_numpy(doc_ids),
    )


def samples_batch(samples: Sequence[PackedSample], space: TokenSpace) -> Batch:
    """A batch of the packed samples a stream yields."""
    tokens = np.stack([s.tokens.astype("int64") for s in samples])
    return make_batch(tokens, [s.segments for s in samples], space)
