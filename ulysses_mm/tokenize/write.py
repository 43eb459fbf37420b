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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ulysses_mm.core.storage import atomic_write_local
from ulysses_mm.core.tokenspace import TokenSpace

if TYPE_CHECKING:
    from ulysses_mm.tokenize.base import Tokenizer


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


def continuation(
    tokenizer: Tokenizer,
    space: TokenSpace,
    prompt: Sequence[int],
    new: Sequence[int],
    with_prompt: bool = False,
) -> Any:
    """What ``new`` ids after ``prompt`` decode to: the whole document is decoded at once
    (a decoder may need what came before), then the prompt's share is cut off unless
    ``with_prompt``. A str loses the prompt's decoded text (or, where the whole does not
    begin with it, is the new ids decoded alone); anything else loses as many items as
    the prompt alone decodes to."""
    p = np.asarray(list(prompt), dtype=np.int64)
    allids = np.asarray(list(prompt) + list(new), dtype=np.int64)
    data = tokenizer.decode(allids, space)
    if with_prompt:
        return data
    head = tokenizer.decode(p, space)
    if isinstance(data, str):
        return (
            data[len(head) :]
            if data.startswith(head)
            else tokenizer.decode(allids[len(p) :], space)
        )
    return data[len(head) :]


def write_file(path: str | Path, data: bytes) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_local(p, data)
    return p
