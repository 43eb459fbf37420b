"""What a person sees of DNA ids: a FASTA record (Biopython) and a GC-content track."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ulysses_mm.tokenize.write import Media


def fasta_bytes(sequence: str, record_id: str, description: str = "") -> bytes:
    from Bio.Seq import Seq  # lazy: heavy (Bio)
    from Bio.SeqIO import write  # lazy: heavy (Bio)
    from Bio.SeqRecord import SeqRecord  # lazy: heavy (Bio)

    buf = io.StringIO()
    write(SeqRecord(Seq(sequence), id=record_id, description=description), buf, "fasta")
    return buf.getvalue().encode("ascii")


@dataclass
class FastaMedia(Media):
    """Bases, written as one FASTA record."""

    text: str
    suffix: ClassVar[str] = "fa"
    shown_as: ClassVar[str] = "text"

    def to_bytes(self, record_id: str = "generated", description: str = "") -> bytes:
        return fasta_bytes(self.text, record_id, description)

    def describe(self) -> str:
        return f"{len(self.text):,} bases"


def gc_track(seq: str, points: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """(window centres, GC fraction of the window's A/C/G/T/S/W bases), about ``points``
    windows (NaN where a window holds none of them)."""
    b = np.frombuffer(seq.upper().encode("ascii", "replace"), dtype=np.uint8)
    acgt = np.isin(b, np.frombuffer(b"ACGTSW", np.uint8))
    gc = np.isin(b, np.frombuffer(b"GCS", np.uint8))
    window = max(len(b) // points, min(100, max(1, len(b) // 10)))
    k = len(b) // window
    if k == 0:
        return np.zeros(0), np.zeros(0)
    gcw = gc[: k * window].reshape(k, window).sum(1)
    nw = acgt[: k * window].reshape(k, window).sum(1)
    frac = np.where(nw > 0, gcw / np.maximum(nw, 1), np.nan)
    return (np.arange(k) + 0.5) * window, frac


def draw_gc(fig: Any, cell: Any, seq: str, name: str) -> None:
    """The GC fraction along ``seq`` (a sample's bases, documents concatenated)."""
    ax = fig.add_subplot(cell)
    x, gc = gc_track(seq)
    ax.plot(x, gc, lw=1, color="tab:green")
    ax.set_ylim(0, 1)
    ax.set_xlim(0, max(1, len(seq)))
    ax.set_xlabel("base (this sample's DNA, documents concatenated)")
    ax.set_ylabel("GC fraction")
    mean = float(np.nanmean(gc)) if len(gc) and not np.isnan(gc).all() else float("nan")
    ax.set_title(f"{name}: {len(seq):,} bases, GC {mean:.3f}")
