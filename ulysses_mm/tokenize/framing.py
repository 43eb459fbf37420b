"""Between a modality's 0-based local ids and the unified token space, both ways.

Every tokenizer emits ``<doc> <|modality|> ids… </doc>`` with its ids shifted into its
modality's range (:class:`DocumentFramer`), and every decoder first takes that range's
ids back out (:func:`local_ids`). The video kinds build their documents from rows of
frames instead (:mod:`ulysses_mm.tokenize.video.base`).
"""

from __future__ import annotations

import numpy as np

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace


class DocumentFramer:
    """Frames 0-based local ids of one modality as ``<doc> <|modality|> ids… </doc>``.

    Built once per file (the space lookups are then out of the per-document path, which
    matters for FASTQ files of many short reads)."""

    def __init__(self, space: TokenSpace, modality: str) -> None:
        r = space.range(modality)
        self.dtype = space.dtype()
        self.start = r.start
        self.size = r.size
        self.boundary = space.boundary_token(modality)

    def __call__(self, local: np.ndarray) -> np.ndarray:
        out = np.empty(local.shape[0] + 3, dtype=self.dtype)
        out[0] = DOC_START
        out[1] = self.boundary
        np.add(local, self.start, out=out[2:-1], dtype=self.dtype, casting="unsafe")
        out[-1] = DOC_END
        return out


def local_ids(tokens: np.ndarray, space: TokenSpace, modality: str) -> np.ndarray:
    """The ids of ``modality`` in ``tokens`` as 0-based local ids (int64), specials dropped.

    Raises ValueError if an id belongs to another modality or lies outside the space:
    decoding tokens of the wrong modality is a caller's bug, not bad data.
    """
    t = np.asarray(tokens).astype(np.int64, copy=False).ravel()
    r = space.range(modality)
    special = t < space.num_specials
    inside = (t >= r.start) & (t < r.stop)
    bad = ~(special | inside)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"token {int(t[i])} at position {i} is not a special or a {modality} id "
            f"({r.start}..{r.stop - 1}) in {space.describe()}"
        )
    return t[inside] - r.start
