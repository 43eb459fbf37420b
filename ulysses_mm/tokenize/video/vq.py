"""Video as VQ tokens (kind ``video-vq``): sampled frames -> patches -> codebook ids.

Per frame (sampling, document framing and audio interleaving:
:mod:`ulysses_mm.tokenize.video.base`)::

    patchify: [t, S, S, 3] -> [t, (S/p)², p·p·3], patches in raster order
    -> nearest codeword of a k-means codebook fitted on data (``tokenizers/*.npy``,
       written by ``ulysses-mm tokenizer fit video``), one id per patch
    -> a row of ``(S/p)²`` ids, then ``<eof>``

Every frame costs the same ids and each patch is coded on its own, so a wrong id spoils
one patch of one frame; the price is that the code cannot spend more ids where the
picture needs them (``video-h264`` can).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import EOF, TokenSpace
from ulysses_mm.tokenize.base import TokenizerSpec
from ulysses_mm.tokenize.params import ParamSchema
from ulysses_mm.tokenize.video.base import FRAME_PARAMS, VideoTokenizer
from ulysses_mm.tokenize.video.kmeans import Codebook

_SCHEMA: ParamSchema = {
    **FRAME_PARAMS,
    "patch": ((int,), 16),
    "fit": ((dict,), {}),  # provenance written by `tokenizer fit`; not used to tokenize
}


# --------------------------------------------------------------------------- patches
def patchify(frames: np.ndarray, patch: int) -> np.ndarray:
    """[t, S, S, 3] -> [t·(S/p)², p·p·3], patches in raster order, pixels (y, x, rgb)."""
    t, s = frames.shape[0], frames.shape[1]
    g = s // patch
    x = frames.reshape(t, g, patch, g, patch, 3).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(t * g * g, patch * patch * 3)


def unpatchify(patches: np.ndarray, size: int, patch: int) -> np.ndarray:
    """Inverse of :func:`patchify`: [t·(S/p)², p·p·3] -> [t, S, S, 3]."""
    g = size // patch
    t = patches.shape[0] // (g * g)
    x = patches.reshape(t, g, g, patch, patch, 3).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(t, size, size, 3)


def load_codebook(spec: TokenizerSpec, patch: int) -> Codebook:
    """The spec's k-means codebook, checked against its patch size and vocab_size."""
    where = spec.where
    if spec.artifact is None:
        raise DataError(f"{where}: a video-vq spec needs an 'artifact' (the codebook .npy)")
    try:
        arr = np.load(spec.artifact_path(), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: cannot load codebook {spec.artifact}: {e}") from e
    d = patch * patch * 3
    if arr.ndim != 2 or arr.shape[1] != d or not np.issubdtype(arr.dtype, np.floating):
        raise DataError(
            f"{where}: codebook {spec.artifact} must be float [vocab_size, patch·patch·3 = {d}], "
            f"got {arr.dtype} {list(arr.shape)}"
        )
    if arr.shape[0] != spec.vocab_size:
        raise DataError(
            f"{where}: codebook has {arr.shape[0]} codewords, vocab_size is {spec.vocab_size}"
        )
    if not np.isfinite(arr).all():
        raise DataError(f"{where}: codebook {spec.artifact} holds NaN or inf")
    return Codebook(arr.astype(np.float32))


# --------------------------------------------------------------------------- tokenizer
class VqVideoTokenizer(VideoTokenizer):
    """kind ``video-vq``: one document per clip, ``(size/patch)²`` ids + ``<eof>`` per frame."""

    schema: ParamSchema = _SCHEMA

    def __init__(self, spec: TokenizerSpec) -> None:
        super().__init__(spec)
        p = self.params
        if p["size"] < 1 or p["patch"] < 1 or p["size"] % p["patch"]:
            raise DataError(f"{spec.where}: 'size' ({p['size']}) must be a multiple of 'patch'")
        self.patch: int = p["patch"]
        self.tokens_per_frame = (self.size // self.patch) ** 2  # then one <eof>
        self.codebook = load_codebook(spec, self.patch)

    # ------------------------------------------------------------------ encode
    def encode_frames(self, frames: np.ndarray) -> np.ndarray:
        """[t, size, size, 3] uint8 -> local ids [t, (size/patch)²] int64."""
        ids = self.codebook.encode(patchify(frames, self.patch))
        return ids.reshape(frames.shape[0], self.tokens_per_frame)

    def encoder(self) -> Callable[[np.ndarray], np.ndarray]:
        """Frames are coded independently: the encoder is :meth:`encode_frames`."""
        return self.encode_frames

    def frame_rows(self, ids: np.ndarray, start: int) -> np.ndarray:
        """Local ids [t, N] as unified ids [t, N + 1]: each frame's patches, then ``<eof>``."""
        frames = np.empty((ids.shape[0], self.tokens_per_frame + 1), dtype=np.int64)
        frames[:, :-1] = ids + start
        frames[:, -1] = EOF
        return frames

    # ------------------------------------------------------------------ decode
    def decode_ids(self, ids: np.ndarray) -> np.ndarray:
        """local ids [t, (size/patch)²] -> uint8 frames [t, size, size, 3]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1, self.tokens_per_frame)
        if ids.size and (ids.min() < 0 or ids.max() >= self.codebook.size):
            raise ValueError(f"video local id out of range 0..{self.codebook.size - 1}")
        px = self.codebook.decode(ids.ravel())
        frames = unpatchify(px, self.size, self.patch)
        return np.clip(np.rint(frames), 0, 255).astype(np.uint8)

    def split(self, tokens: np.ndarray, space: TokenSpace) -> tuple[np.ndarray, np.ndarray]:
        """(video local ids [t, N], audio local ids [n]) of one clip's unified ids.

        Video ids must come in whole frames, each closed by ``<eof>``; other specials are
        dropped; audio ids are accepted only if this spec interleaves audio."""
        seq, audio = self.tracks(tokens, space)
        eofs = np.flatnonzero(seq == EOF)
        lengths = np.diff(np.concatenate([[-1], eofs])) - 1
        n = self.tokens_per_frame
        if (lengths != n).any() or seq.size != eofs.size * (n + 1):
            raise ValueError(f"video ids do not form whole frames of {n} ids, each then <eof>")
        video = seq[seq != EOF].reshape(-1, n) - space.range(self.modality).start
        return video, audio

    @classmethod
    def token_labels(
        cls, entry: Mapping[str, Any], size: int, vocabulary: Sequence[str] | None = None
    ) -> list[str]:
        """The codebook word of each id (``vq42``)."""
        return [f"vq{k}" for k in range(size)]
