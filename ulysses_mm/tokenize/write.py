"""Generated ids as the files people open: the generic :class:`Media` and atomic writing.

A tokenizer turns ids into a :class:`Media` (:meth:`~ulysses_mm.tokenize.base.Tokenizer.media`):
its file suffix, its bytes, a one-line description and, when the ids hold nothing whole
to write (a video with no whole frame), why. The generic kinds here are UTF-8 text and a
``.npy`` array; each modality keeps its own format in its package (FASTA in
:mod:`ulysses_mm.tokenize.dna.output`, WAV in :mod:`ulysses_mm.tokenize.audio.output`,
MP4 in :mod:`ulysses_mm.tokenize.video.output`). :func:`write_file` writes through a
temporary sibling renamed into place, so a reader never sees half of a file.
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ulysses_mm.core.storage import atomic_write_local


class Media(ABC):
    """Decoded ids, ready to write."""

    suffix: ClassVar[str]  # the file's ending, without the dot
    shown_as: ClassVar[str]  # how a run logger shows it: "text", "audio", "video", "file"

    @abstractmethod
    def to_bytes(self, record_id: str = "generated", description: str = "") -> bytes:
        """The file's bytes (``record_id`` / ``description``: for a format that names them)."""

    @abstractmethod
    def describe(self) -> str:
        """What the file holds, in a few words ("1,200 bases", "8 frames at 8 fps")."""

    def lacking(self) -> str:
        """Why there is nothing to write ("" when there is), to follow "N new ids hold"."""
        return ""


@dataclass
class TextMedia(Media):
    """A decoded str as UTF-8 text."""

    text: str
    suffix: ClassVar[str] = "txt"
    shown_as: ClassVar[str] = "text"

    def to_bytes(self, record_id: str = "generated", description: str = "") -> bytes:
        return self.text.encode("utf-8")

    def describe(self) -> str:
        return f"{len(self.text):,} characters"


@dataclass
class ArrayMedia(Media):
    """Decoded data of no file format of its own, as a ``.npy`` array."""

    array: np.ndarray
    suffix: ClassVar[str] = "npy"
    shown_as: ClassVar[str] = "file"

    def to_bytes(self, record_id: str = "generated", description: str = "") -> bytes:
        buf = io.BytesIO()
        np.save(buf, self.array, allow_pickle=False)
        return buf.getvalue()

    def describe(self) -> str:
        return f"an array {self.array.dtype} {list(self.array.shape)}"


def write_file(path: str | Path, data: bytes) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_local(p, data)
    return p
