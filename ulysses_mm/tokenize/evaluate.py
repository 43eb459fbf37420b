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

With ``--damage RATE`` (video and audio specs), the file's ids are also decoded after a
fraction RATE of them was replaced by other ids of the modality, chosen uniformly at
random (``round(RATE·n)`` of the n ids, at least one; an ``audio-codec`` id stays within
its quantizer's codebook, so the ids still decode; a video frame's end stays where it is),
once per seed 0, 1, …, ``--seeds`` − 1: ``psnr_db`` / ``snr_db`` of what comes out, the
mean over the seeds and the worst seed. That is what a model writing one wrong id in
1/RATE costs, and how a tokenizer's decode degrades.

A file that cannot be read is an entry with ``error`` (the one-line reason); the command
then exits 1 after reporting the others.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
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


def flip_ids(
    ids: np.ndarray, rate: float, rng: np.random.Generator, vocab: int, group: int = 0
) -> np.ndarray:
    """A copy of ``ids`` with ``round(rate·n)`` (at least one) of its n non-negative ids
    replaced, at distinct random positions, by a different id drawn uniformly from
    ``0..vocab-1`` -- or, with ``group``, from the id's own block of ``group`` consecutive
    ids (a codec's quantizer). Negative ids (a ragged kind's frame ends) are left alone."""
    out = np.array(ids, dtype=np.int64, copy=True)
    flat = out.reshape(-1)
    where = np.flatnonzero(flat >= 0)
    if not where.size or rate <= 0:
        return out
    k = min(where.size, max(1, round(rate * where.size)))
    at = rng.choice(where, k, replace=False)
    old = flat[at]
    low = old // group * group if group else np.zeros_like(old)
    span = group or vocab
    new = rng.integers(0, span - 1, k)  # one of the span - 1 other ids
    new += new >= old - low
    flat[at] = low + new
    return out


def _alphabet(tok: Any) -> tuple[int, int]:
    """(vocab, group) of :func:`flip_ids` for this tokenizer's local ids."""
    from ulysses_mm.tokenize.codec import CodecAudioTokenizer

    if isinstance(tok, CodecAudioTokenizer):
        return tok.spec.vocab_size, tok.codebook_size
    return tok.spec.vocab_size, 0


def _damaged(
    tok: Any, ids: np.ndarray, rates: Sequence[float], seeds: int, key: str, measure: Any
) -> list[Entry]:
    """Per rate: ``measure(decoded ids)`` after :func:`flip_ids` with seeds 0..seeds-1,
    the mean over the seeds as ``key`` and the worst seed as ``worst_<key>``."""
    vocab, group = _alphabet(tok)
    out = []
    for rate in rates:
        vals = [
            measure(flip_ids(ids, rate, np.random.default_rng(seed), vocab, group))
            for seed in range(seeds)
        ]
        out.append(
            {
                "rate": rate,
                key: round(float(np.mean(vals)), 2),
                f"worst_{key}": round(float(np.min(vals)), 2),
                "seeds": seeds,
            }
        )
    return out


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
        entry["damaged"] = _damaged(
            tok,
            ids,
            damage,
            seeds,
            "snr_db",
            lambda bad: snr_db(wave.samples, tok.decode_waveform(bad)),
        )
    return entry


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
    per = [flat.shape[1]] * flat.shape[0] if flat.ndim == 2 else _ragged_lengths(flat)
    per_frame = _frame_mse(ref, dec)
    entry: Entry = {
        "psnr_db": round(_psnr_from_mse(float(per_frame.mean())), 2),
        "worst_frame_psnr_db": round(_psnr_from_mse(float(per_frame.max())), 2),
        "frames": int(ref.shape[0]),
        "tokens_per_frame": round(float(np.mean(per)), 1) if len(set(per)) > 1 else int(per[0]),
        "max_tokens_per_frame": int(max(per)),
        "encode_fps": round(ref.shape[0] / max(seconds, 1e-9), 1),
    }
    if damage:
        entry["damaged"] = _damaged(
            tok,
            flat,
            damage,
            seeds,
            "psnr_db",
            lambda bad: _psnr_from_mse(float(_frame_mse(ref, tok.decode_ids(bad)).mean())),
        )
    return entry


def _frame_mse(ref: np.ndarray, dec: np.ndarray) -> np.ndarray:
    """Mean squared error of each frame (float64, one frame at a time: bounded memory)."""
    out = np.empty(ref.shape[0])
    for i in range(ref.shape[0]):
        out[i] = np.mean((ref[i].astype(np.float64) - dec[i].astype(np.float64)) ** 2)
    return out


def _ragged_lengths(ids: np.ndarray) -> list[int]:
    """Ids of each frame of ragged local ids (frames ended by a negative id)."""
    ends = np.flatnonzero(ids < 0)
    return (np.diff(np.concatenate([[-1], ends])) - 1).astype(int).tolist()


def evaluate_file(tok: Tokenizer, path: str, damage: Sequence[float] = (), seeds: int = 5) -> Entry:
    """One file's fidelity entry (``exact`` / ``snr_db`` / ``psnr_db`` and details), and
    with ``damage`` rates the measure under that fraction of wrong ids (video, audio)."""
    from ulysses_mm.tokenize.dna import DnaTokenizer

    kind = _kind(tok)
    if damage and kind not in ("video", "audio"):
        raise ConfigError(
            f"--damage measures video and audio specs; {tok.spec.name} is kind {tok.spec.kind!r}"
        )
    if isinstance(tok, DnaTokenizer):
        return eval_dna(tok, path)
    if kind == "video":
        return eval_video(tok, path, damage, seeds)
    if kind == "audio":
        return eval_audio(tok, path, damage, seeds)
    raise ConfigError(f"tokenizer kind {tok.spec.kind!r} has no fidelity measure")


def _kind(tok: Tokenizer) -> str:
    if hasattr(tok, "encode_frames") and hasattr(tok, "decode_ids"):
        return "video"
    if hasattr(tok, "encode_waveform") and hasattr(tok, "decode_waveform"):
        return "audio"
    return ""


_KEY = {"dna": "exact", "audio": "snr_db", "video": "psnr_db"}


def _damage_text(entry: Entry, key: str) -> str:
    return "".join(
        f"; {100 * d['rate']:g} % ids wrong: {d[key]} dB (worst of {d['seeds']} seeds "
        f"{d['worst_' + key]})"
        for d in entry.get("damaged", [])
    )


def _line(path: str, entry: Entry) -> str:
    if "error" in entry:
        return f"{path}: error: {entry['error']}"
    if "exact" in entry:
        verdict = "exact" if entry["exact"] else f"NOT exact ({entry['mismatches']} bases differ)"
        return f"{path}: {verdict}; {entry['records']} records, {entry['bases']} bases"
    if "snr_db" in entry:
        return (
            f"{path}: SNR {entry['snr_db']} dB over {entry['seconds']} s, "
            f"{entry['tokens_per_second']} tokens/s" + _damage_text(entry, "snr_db")
        )
    return (
        f"{path}: PSNR {entry['psnr_db']} dB (worst frame {entry['worst_frame_psnr_db']} dB) "
        f"over {entry['frames']} frames, {entry['tokens_per_frame']} tokens/frame"
        f"{f' (max {m})' if (m := entry['max_tokens_per_frame']) != entry['tokens_per_frame'] else ''}, "
        f"encode {entry['encode_fps']} frames/s" + _damage_text(entry, "psnr_db")
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
    rows = [e["damaged"] for e in ok if "damaged" in e]
    if rows:
        key = next(k for k in ("psnr_db", "snr_db") if k in rows[0][0])
        out["damaged"] = [
            {
                "rate": per[0]["rate"],
                f"mean_{key}": round(float(np.mean([d[key] for d in per])), 2),
                f"min_{key}": round(float(np.min([d[f"worst_{key}"] for d in per])), 2),
            }
            for per in zip(*rows)
        ]
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
    """The ``tokenizer eval`` subcommand (see ulysses_mm.cli.data.add_tokenizer for its flags)."""
    from ulysses_mm.tokenize.registry import load_tokenizer

    damage = list(args.damage or [])
    for rate in damage:
        if not 0.0 < rate <= 1.0:
            raise ConfigError(f"--damage {rate}: a fraction of the ids, 0 < RATE <= 1")
    if args.seeds < 1:
        raise ConfigError(f"--seeds {args.seeds}: at least 1")
    tok = load_tokenizer(args.spec)
    if damage and _kind(tok) not in ("video", "audio"):
        raise ConfigError(
            f"--damage measures video and audio specs; {tok.spec.name} is kind {tok.spec.kind!r}"
        )
    entries: list[Entry] = []
    for path in args.files:
        try:
            entry = evaluate_file(tok, path, damage, args.seeds)
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
        extra = ", ".join(
            f"{k} {v}" for k, v in summary.items() if k not in ("files", "errors", "damaged")
        )
        for d in summary.get("damaged", []):
            rest = ", ".join(f"{k} {v}" for k, v in d.items() if k != "rate")
            extra += f"; {100 * d['rate']:g} % ids wrong: {rest}"
        print(f"{tok.spec.name}: {summary['files']} files, {summary['errors']} errors; {extra}")
    return 1 if summary["errors"] else 0
