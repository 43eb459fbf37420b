"""How faithful a video spec is: the sampled, cropped frames against the frames its ids
decode to, ``psnr_db`` over the whole file (mean squared error of every pixel, peak
255), the worst frame's, ids per frame and encode frames/s (the kind's encoder only,
decoding the file not counted); with damage rates, the same after that fraction of ids
was replaced (a frame's end stays where it is). Shared by every video kind."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ulysses_mm.tokenize.base import DecodeError, Entry
from ulysses_mm.tokenize.evaluate import damage_text, damaged


def psnr_from_mse(mse: float) -> float:
    return math.inf if mse == 0.0 else 10.0 * math.log10(255.0**2 / mse)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images/videos (peak 255)."""
    return psnr_from_mse(float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


def frame_mse(ref: np.ndarray, dec: np.ndarray) -> np.ndarray:
    """Mean squared error of each frame (float64, one frame at a time: bounded memory)."""
    out = np.empty(ref.shape[0])
    for i in range(ref.shape[0]):
        out[i] = np.mean((ref[i].astype(np.float64) - dec[i].astype(np.float64)) ** 2)
    return out


def ragged_lengths(ids: np.ndarray) -> list[int]:
    """Ids of each frame of ragged local ids (frames ended by a negative id)."""
    ends = np.flatnonzero(ids < 0)
    return (np.diff(np.concatenate([[-1], ends])) - 1).astype(int).tolist()


def eval_video(tok: Any, path: str, damage: Sequence[float] = (), seeds: int = 5) -> Entry:
    encode = tok.encoder()  # a clip's frames in order (the kind may keep state across them)
    frames: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    seconds = 0.0
    for batch in tok.frames(path):
        t0 = time.perf_counter()
        ids.append(encode(batch))
        seconds += time.perf_counter() - t0
        frames.append(batch)
    if not frames:
        raise DecodeError(f"{path}: no frames decoded")
    ref = np.concatenate(frames)
    flat = np.concatenate(ids)
    dec = tok.decode_ids(flat)
    # ids per frame: fixed for a codebook kind ([t, N]), a frame's packet for a ragged one
    # (1-D, frames ended by a negative id)
    per = [flat.shape[1]] * flat.shape[0] if flat.ndim == 2 else ragged_lengths(flat)
    per_frame = frame_mse(ref, dec)
    entry: Entry = {
        "psnr_db": round(psnr_from_mse(float(per_frame.mean())), 2),
        "worst_frame_psnr_db": round(psnr_from_mse(float(per_frame.max())), 2),
        "frames": int(ref.shape[0]),
        "tokens_per_frame": round(float(np.mean(per)), 1) if len(set(per)) > 1 else int(per[0]),
        "max_tokens_per_frame": int(max(per)),
        "encode_fps": round(ref.shape[0] / max(seconds, 1e-9), 1),
    }
    if damage:
        entry["damaged"] = damaged(
            tok,
            flat,
            damage,
            seeds,
            "psnr_db",
            lambda bad: psnr_from_mse(float(frame_mse(ref, tok.decode_ids(bad)).mean())),
        )
    return entry


def video_line(entry: Entry) -> str:
    m = entry["max_tokens_per_frame"]
    most = f" (max {m})" if m != entry["tokens_per_frame"] else ""
    return (
        f"PSNR {entry['psnr_db']} dB (worst frame {entry['worst_frame_psnr_db']} dB) "
        f"over {entry['frames']} frames, {entry['tokens_per_frame']} tokens/frame{most}, "
        f"encode {entry['encode_fps']} frames/s" + damage_text(entry, "psnr_db")
    )
