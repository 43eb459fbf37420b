"""How faithful an audio spec is: the waveform it reads (decoded, resampled, mono) against
the waveform its ids decode to, ``snr_db`` = 10·log10(Σ ref² / Σ (ref − dec)²); with
damage rates, the same after that fraction of ids was replaced."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ulysses_mm.tokenize.base import Entry
from ulysses_mm.tokenize.evaluate import damage_text, damaged


def snr_db(ref: np.ndarray, dec: np.ndarray) -> float:
    """10·log10(Σ ref² / Σ (ref − dec)²) over the common length; inf if identical."""
    n = min(ref.shape[0], dec.shape[0])
    r = ref[:n].astype(np.float64)
    err = float(np.sum((r - dec[:n].astype(np.float64)) ** 2))
    sig = float(np.sum(r * r))
    if err == 0.0:
        return math.inf
    return -math.inf if sig == 0.0 else 10.0 * math.log10(sig / err)


def eval_audio(tok: Any, path: str, damage: Sequence[float] = (), seeds: int = 5) -> Entry:
    wave = tok.load(path)
    t0 = time.perf_counter()
    ids = tok.encode_waveform(wave.samples)
    seconds = time.perf_counter() - t0
    dec = tok.decode_waveform(ids)
    duration = wave.samples.shape[0] / wave.rate
    entry: Entry = {
        "snr_db": round(snr_db(wave.samples, dec), 2),
        "seconds": round(duration, 3),
        "tokens": int(np.asarray(ids).size),
        "tokens_per_second": round(np.asarray(ids).size / max(duration, 1e-9), 1),
        "encode_x_realtime": round(duration / max(seconds, 1e-9), 1),
    }
    if damage:
        entry["damaged"] = damaged(
            tok,
            ids,
            damage,
            seeds,
            "snr_db",
            lambda bad: snr_db(wave.samples, tok.decode_waveform(bad)),
        )
    return entry


def audio_line(entry: Entry) -> str:
    return (
        f"SNR {entry['snr_db']} dB over {entry['seconds']} s, "
        f"{entry['tokens_per_second']} tokens/s" + damage_text(entry, "snr_db")
    )
