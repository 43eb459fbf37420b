"""The panels of ``inspect --png``, by the shape of what a tokenizer decoded: a text
excerpt (a str), a strip of frames (uint8 [t, h, w, 3]), a waveform (float [n]), else a
note naming what it is. :meth:`Tokenizer.picture
<ulysses_mm.tokenize.base.Tokenizer.picture>` draws with :func:`draw_data` by default; a
kind draws its own picture where it knows better (DNA's GC track, audio at its rate).
Each function draws into one cell of a gridspec of a matplotlib figure it is given, so
nothing here imports matplotlib or touches global pyplot state."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np

EXCERPT_COLUMNS = 140  # characters a line of a text's excerpt
EXCERPT_LINES = 12  # lines of it shown


def draw_note(fig: Any, cell: Any, text: str, title: str = "", color: str = "black") -> None:
    ax = fig.add_subplot(cell)
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, color=color, parse_math=False)
    if title:
        ax.set_title(title)


def draw_text(fig: Any, cell: Any, text: str, name: str) -> None:
    """The beginning of ``text`` (control characters shown as �), wrapped to the panel,
    and its length."""
    ax = fig.add_subplot(cell)
    ax.axis("off")
    clean = "".join(
        c if c.isprintable() or c == "\n" else "\ufffd" for c in text[: EXCERPT_COLUMNS * 64]
    )
    lines = [
        row
        for para in clean.split("\n")
        for row in (textwrap.wrap(para, EXCERPT_COLUMNS, drop_whitespace=False) or [""])
    ]
    shown = lines[:EXCERPT_LINES]
    if len(lines) > EXCERPT_LINES or len(text) > EXCERPT_COLUMNS * 64:
        shown.append("…")
    t = ax.text(
        0.0,
        1.0,
        "\n".join(shown),
        ha="left",
        va="top",
        family="monospace",
        fontsize=7,
        parse_math=False,
        clip_on=True,
        transform=ax.transAxes,
    )
    t.set_in_layout(False)  # a long excerpt is clipped, never shrinks the other panels
    ax.set_title(f"{name}: {len(text):,} characters of text")


def draw_frames(fig: Any, cell: Any, arr: np.ndarray, name: str, show: int = 8) -> None:
    """Up to ``show`` frames of uint8 ``arr`` [t, h, w, 3], evenly spaced."""
    frames = arr.shape[0] if arr.ndim == 4 else 0
    shown = min(frames, show)
    sub = cell.subgridspec(1, max(1, shown))
    idx: list[int] = (
        np.linspace(0, frames - 1, shown).round().astype(int).tolist() if frames else []
    )
    for j, f in enumerate(idx):
        ax = fig.add_subplot(sub[0, j])
        ax.imshow(arr[f].astype(np.uint8))
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"frame {f}", fontsize=8)
    if not frames:
        ax = fig.add_subplot(sub[0, 0])
        ax.axis("off")
        ax.text(0.5, 0.5, f"{name}: no whole frame in this sample", ha="center")


def draw_waveform(fig: Any, cell: Any, arr: np.ndarray, rate: float | None, name: str) -> None:
    """A waveform (the first channel of a multi-channel one) against seconds at ``rate``
    (against the sample index without one)."""
    wave = arr.reshape(arr.shape[0], -1)[:, 0] if arr.ndim > 1 else arr
    ax = fig.add_subplot(cell)
    x = np.arange(len(wave)) / rate if rate else np.arange(len(wave))
    step = max(1, len(wave) // 20000)
    ax.plot(x[::step], wave[::step], lw=0.5, color="tab:orange")
    ax.set_xlabel("seconds" if rate else "sample")
    ax.set_title(f"{name}: waveform, {len(wave):,} samples")


def draw_data(fig: Any, cell: Any, data: Any, name: str, rate: float | None = None) -> None:
    """``data`` drawn by its shape (see the module docstring)."""
    if isinstance(data, str):
        draw_text(fig, cell, data, name)
        return
    arr = np.asarray(data)
    if arr.ndim == 4 and arr.shape[-1] == 3:
        draw_frames(fig, cell, arr, name)
    elif arr.ndim >= 1 and arr.dtype.kind == "f":
        draw_waveform(fig, cell, arr, rate, name)
    else:
        what = f"{type(data).__name__} {getattr(arr, 'shape', '')}"
        draw_note(fig, cell, f"{name}: decoded to {what}, no plot for it")
