"""How faithful a tokenizer is on given files: ``ulysses-mm tokenizer eval SPEC FILES…``.

Each file goes through the tokenizer's own reading path and back through its decoder:

- DNA: every record's bases are tokenized and decoded; ``exact`` is whether all of them
  come back character for character (``mismatches`` counts the bases that do not, e.g.
  IUPAC codes folded to N by ``dna-base``).
- audio: the waveform the tokenizer reads (decoded, resampled, mono) against the waveform
  its tokens decode to: ``snr_db`` = 10·log10(Σ ref² / Σ (ref − dec)²).
- video: the sampled, cropped frames against the frames the tokens decode to: ``psnr_db``
  over the whole file (mean squared error of every pixel, peak 255), the worst frame's,
  tokens per frame and encode frames/s (the kind's encoder only, decoding the file not
  counted).

A file that cannot be read is an entry with ``error`` (the one-line reason); the command
then exits 1 after reporting the others.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import numpy as np

from ulysses_mm.core.errors import ConfigError
from ulysses_mm.tokenize.base import DecodeError, Tokenizer

Entry = dict[str, Any]


def snr_db(ref: np.ndarray, dec: np.ndarray) -> float:
    """10·log10(Σ ref² / Σ (ref − dec)²) over the common length; inf if identical."""
    n = min(ref.shape[0], dec.shape[0])
    r = ref[:n].astype(np.float64)
    err = float(np.sum((r - dec[:n].astype(np.float64)) ** 2))
    sig = float(np.sum(r * r))
    if err == 0.0:
        return math.inf
    return -math.inf if sig == 0.0 else 10.0 * math.log10(sig / err)


def _psnr_from_mse(mse: float) -> float:
    return math.inf if mse == 0.0 else 10.0 * math.log10(255.0**2 / mse)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images/videos (peak 255)."""
    return _psnr_from_mse(float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


def eval_dna(tok: Any, path: str) -> Entry:
    from ulysses_mm.tokenize.dna import iter_records

    records = bases = mismatches = 0
    for _rid, seq in iter_records(path, tok.params["format"]):
        back = tok.decode_local(tok.encode_sequence(seq, where=path))
        records += 1
        bases += len(seq)
        if back != seq:
            a = np.frombuffer(seq.encode("latin-1"), dtype=np.uint8)
            b = np.frombuffer(back.encode("latin-1"), dtype=np.uint8)
            mismatches += int(np.count_nonzero(a != b))
    if records == 0:
        raise DecodeError(f"{path}: no sequence records")
    return {"exact": mismatches == 0, "records": records, "bases": bases, "mismatches": mismatches}


def eval_audio(tok: Any, path: str) -> Entry:
    wave = tok.load(path)
    t0 = time.perf_counter()
    ids = tok.encode_waveform(wave.samples)
    seconds = time.perf_counter() - t0
    dec = tok.decode_waveform(ids)
    duration = wave.samples.shape[0] / wave.rate
    return {
        "snr_db": round(snr_db(wave.samples, dec), 2),
        "seconds": round(duration, 3),
        "tokens": int(np.asarray(ids).size),
        "tokens_per_second": round(np.asarray(ids).size / max(duration, 1e-9), 1),
        "encode_x_realtime": round(duration / max(seconds, 1e-9), 1),
    }


def eval_video(tok: Any, path: str) -> Entry:
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
    per = [flat.shape[1]] * flat.shape[0] if flat.ndim == 2 else _ragged_lengths(flat)
    per_frame = np.empty(ref.shape[0])
    for i in range(ref.shape[0]):
        per_frame[i] = np.mean((ref[i].astype(np.float64) - dec[i].astype(np.float64)) ** 2)
    return {
        "psnr_db": round(_psnr_from_mse(float(per_frame.mean())), 2),
        "worst_frame_psnr_db": round(_psnr_from_mse(float(per_frame.max())), 2),
        "frames": int(ref.shape[0]),
        "tokens_per_frame": round(float(np.mean(per)), 1) if len(set(per)) > 1 else int(per[0]),
        "max_tokens_per_frame": int(max(per)),
        "encode_fps": round(ref.shape[0] / max(seconds, 1e-9), 1),
    }


def _ragged_lengths(ids: np.ndarray) -> list[int]:
    """Ids of each frame of ragged local ids (frames ended by a negative id)."""
    ends = np.flatnonzero(ids < 0)
    return (np.diff(np.concatenate([[-1], ends])) - 1).astype(int).tolist()


def evaluate_file(tok: Tokenizer, path: str) -> Entry:
    """One file's fidelity entry (``exact`` / ``snr_db`` / ``psnr_db`` and details)."""
    from ulysses_mm.tokenize.dna import DnaTokenizer

    if isinstance(tok, DnaTokenizer):
        return eval_dna(tok, path)
    if hasattr(tok, "encode_frames") and hasattr(tok, "decode_ids"):
        return eval_video(tok, path)
    if hasattr(tok, "encode_waveform") and hasattr(tok, "decode_waveform"):
        return eval_audio(tok, path)
    raise ConfigError(f"tokenizer kind {tok.spec.kind!r} has no fidelity measure")


_KEY = {"dna": "exact", "audio": "snr_db", "video": "psnr_db"}


def _line(path: str, entry: Entry) -> str:
    if "error" in entry:
        return f"{path}: error: {entry['error']}"
    if "exact" in entry:
        verdict = "exact" if entry["exact"] else f"NOT exact ({entry['mismatches']} bases differ)"
        return f"{path}: {verdict}; {entry['records']} records, {entry['bases']} bases"
    if "snr_db" in entry:
        return (
            f"{path}: SNR {entry['snr_db']} dB over {entry['seconds']} s, "
            f"{entry['tokens_per_second']} tokens/s"
        )
    return (
        f"{path}: PSNR {entry['psnr_db']} dB (worst frame {entry['worst_frame_psnr_db']} dB) "
        f"over {entry['frames']} frames, {entry['tokens_per_frame']} tokens/frame"
        f"{f' (max {m})' if (m := entry['max_tokens_per_frame']) != entry['tokens_per_frame'] else ''}, "
        f"encode {entry['encode_fps']} frames/s"
    )


def summarise(entries: list[Entry]) -> Entry:
    ok = [e for e in entries if "error" not in e]
    out: Entry = {"files": len(entries), "errors": len(entries) - len(ok)}
    if ok and "exact" in ok[0]:
        out["exact"] = all(e["exact"] for e in ok)
    for key in ("snr_db", "psnr_db"):
        vals = [e[key] for e in ok if key in e and math.isfinite(e[key])]
        if vals:
            out[f"mean_{key}"] = round(float(np.mean(vals)), 2)
            out[f"min_{key}"] = round(float(np.min(vals)), 2)
    return out


def _finite(x: Any) -> Any:
    """JSON has no infinity: a lossless measure (inf dB) is written as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def cli_eval(args: argparse.Namespace) -> int:
    """The ``tokenizer eval`` subcommand (see cli._add_tokenizer for its flags)."""
    from ulysses_mm.tokenize.registry import load_tokenizer

    tok = load_tokenizer(args.spec)
    entries: list[Entry] = []
    for path in args.files:
        try:
            entry = evaluate_file(tok, path)
        except DecodeError as e:
            entry = {"error": str(e)}
        except OSError as e:
            entry = {"error": f"{path}: {e.strerror or e}"}
        entries.append({"file": path, **entry})
        if not args.json:
            print(_line(path, entry), flush=True)
    summary = summarise(entries)
    if args.json:
        doc = {
            "spec": tok.spec.name,
            "kind": tok.spec.kind,
            "modality": tok.modality,
            "measure": _KEY.get(tok.modality, ""),
            "files": entries,
            "summary": summary,
        }
        json.dump(_finite(doc), sys.stdout, indent=2, allow_nan=False)
        print()
    else:
        extra = ", ".join(f"{k} {v}" for k, v in summary.items() if k not in ("files", "errors"))
        print(f"{tok.spec.name}: {summary['files']} files, {summary['errors']} errors; {extra}")
    return 1 if summary["errors"] else 0
