"""FFmpeg (through PyAV) plumbing shared by the audio and video tokenizers.

Opening a file turns FFmpeg's failures into :class:`DecodeError` (missing, empty, not a
media file), and :func:`ffmpeg_log` collects what FFmpeg logs while decoding: a decoder
that conceals corrupt packets says so only in its log, so errors logged there are treated
as the file's errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ulysses_mm.tokenize.base import DecodeError


@contextlib.contextmanager
def ffmpeg_log() -> Iterator[list[tuple[int, str, str]]]:
    """Collect FFmpeg's warnings and errors raised in this thread (level, name, message)."""
    import av.logging  # lazy: heavy (av)

    previous = av.logging.get_level()
    av.logging.set_level(av.logging.WARNING)
    try:
        with av.logging.Capture(local=True) as logs:
            yield logs
    finally:
        av.logging.set_level(previous)


def first_error(logs: list[tuple[int, str, str]]) -> str | None:
    import av.logging  # lazy: heavy (av)

    for level, name, message in logs:
        if level <= av.logging.ERROR:
            return f"{name}: {message.strip()}"
    return None


def check_file(path: str) -> None:
    """DecodeError unless ``path`` is an existing, non-empty file."""
    p = Path(path)
    if not p.is_file():
        raise DecodeError(f"{path}: no such file")
    if p.stat().st_size == 0:
        raise DecodeError(f"{path}: empty file")


def stream_summary(container: Any) -> str:
    parts = [f"{s.type} {s.codec_context.name}" for s in container.streams]
    return ", ".join(parts) if parts else "none"


def open_media(path: str) -> Any:
    """av.open with the failures turned into DecodeError (empty, missing, not media)."""
    import av  # lazy: heavy (av)

    p = Path(path)
    check_file(path)
    try:
        return av.open(str(p))
    except av.error.FFmpegError as e:
        raise DecodeError(f"{path}: not a media file FFmpeg can open: {e.strerror}") from None
