"""How faithful a tokenizer is on given files: ``ulysses-mm tokenizer eval SPEC FILES…``.

The driver: each file goes through the tokenizer's own measure
(:meth:`Tokenizer.fidelity <ulysses_mm.tokenize.base.Tokenizer.fidelity>`: its reading
path and back through its decoder), one entry per file, one line each
(:meth:`~ulysses_mm.tokenize.base.Tokenizer.fidelity_line`), then a summary. The measures
live with their modality: DNA's exactness (:mod:`ulysses_mm.tokenize.dna.fidelity`), audio's
SNR (:mod:`ulysses_mm.tokenize.audio.fidelity`), video's PSNR
(:mod:`ulysses_mm.tokenize.video.fidelity`).

With ``--damage RATE`` (a kind whose measure takes it: ``Tokenizer.damages``), the file's
ids are also decoded after a fraction RATE of them was replaced by other ids of the
modality, chosen uniformly at random (:func:`flip_ids`: ``round(RATE·n)`` of the n ids, at
least one, each within its block of the kind's
:meth:`~ulysses_mm.tokenize.base.Tokenizer.damage_alphabet`, e.g. a codec id within its
quantizer's codebook, so the ids still decode; a video frame's end stays where it is),
once per seed 0, 1, …, ``--seeds`` − 1: the measure of what comes out, the mean over the
seeds and the worst seed (:func:`damaged`). That is what a model writing one wrong id in
1/RATE costs, and how a tokenizer's decode degrades.

A file that cannot be read is an entry with ``error`` (the one-line reason); the command
then exits 1 after reporting the others.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ulysses_mm.config.parse import option
from ulysses_mm.core.errors import ConfigError
from ulysses_mm.tokenize.base import DecodeError, Entry, Tokenizer
from ulysses_mm.tokenize.registry import load_tokenizer


def flip_ids(
    ids: np.ndarray, rate: float, rng: np.random.Generator, vocab: int, codebook: int = 0
) -> np.ndarray:
    """A copy of ``ids`` with ``round(rate·n)`` (at least one) of its n non-negative ids
    replaced, at distinct random positions, by a different id drawn uniformly from
    ``0..vocab-1`` -- or, with ``codebook``, from the id's own codebook of that many
    consecutive ids (a codec's quantizer). Negative ids (a ragged kind's frame ends) are
    left alone."""
    out = np.array(ids, dtype=np.int64, copy=True)
    flat = out.reshape(-1)
    where = np.flatnonzero(flat >= 0)
    if not where.size or rate <= 0:
        return out
    k = min(where.size, max(1, round(rate * where.size)))
    at = rng.choice(where, k, replace=False)
    old = flat[at]
    low = old // codebook * codebook if codebook else np.zeros_like(old)
    choices = codebook or vocab
    new = rng.integers(0, choices - 1, k)  # one of the choices - 1 other ids
    new += new >= old - low
    flat[at] = low + new
    return out


def damaged(
    tok: Tokenizer, ids: np.ndarray, rates: Sequence[float], seeds: int, key: str, measure: Any
) -> list[Entry]:
    """Per rate: ``measure(decoded ids)`` after :func:`flip_ids` with seeds 0..seeds-1,
    the mean over the seeds as ``key`` and the worst seed as ``worst_<key>``."""
    vocab, codebook = tok.damage_alphabet()
    out = []
    for rate in rates:
        vals = [
            measure(flip_ids(ids, rate, np.random.default_rng(seed), vocab, codebook))
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


def evaluate_file(tok: Tokenizer, path: str, damage: Sequence[float] = (), seeds: int = 5) -> Entry:
    """One file's fidelity entry (the kind's measure and details), and with ``damage`` rates
    the measure under that fraction of wrong ids (a kind that ``damages``)."""
    _check_damage(tok, damage)
    return tok.fidelity(path, damage, seeds)


def _check_damage(tok: Tokenizer, damage: Sequence[float]) -> None:
    if damage and not tok.damages:
        raise ConfigError(
            f"--damage measures video and audio specs; {tok.spec.name} is kind {tok.spec.kind!r}"
        )


def damage_text(entry: Entry, key: str) -> str:
    """The damaged figures of an entry, as the tail of its line."""
    return "".join(
        f"; {100 * d['rate']:g} % ids wrong: {d[key]} dB (worst of {d['seeds']} seeds "
        f"{d['worst_' + key]})"
        for d in entry.get("damaged", [])
    )


def _line(tok: Tokenizer, path: str, entry: Entry) -> str:
    if "error" in entry:
        return f"{path}: error: {entry['error']}"
    return f"{path}: {tok.fidelity_line(entry)}"


def summarise(entries: list[Entry], measure: str) -> Entry:
    """Files and errors, then the kind's ``measure`` over the files read: all of them for
    a yes/no measure (``exact``), else the mean and the minimum of its finite values (and
    the same of the damaged figures, per rate)."""
    ok = [e for e in entries if "error" not in e]
    out: Entry = {"files": len(entries), "errors": len(entries) - len(ok)}
    got = [e[measure] for e in ok if measure in e]
    if got and all(isinstance(v, bool) for v in got):
        out[measure] = all(got)
    elif got:
        vals = [v for v in got if math.isfinite(v)]
        if vals:
            out[f"mean_{measure}"] = round(float(np.mean(vals)), 2)
            out[f"min_{measure}"] = round(float(np.min(vals)), 2)
    rows = [e["damaged"] for e in ok if "damaged" in e]
    if rows:
        out["damaged"] = [
            {
                "rate": per[0]["rate"],
                f"mean_{measure}": round(float(np.mean([d[measure] for d in per])), 2),
                f"min_{measure}": round(float(np.min([d[f"worst_{measure}"] for d in per])), 2),
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


@dataclass
class TokenizerEval:
    """``ulysses-mm tokenizer eval``: tokenize each file as prepare would and decode the
    tokens back: DNA records must come back exactly; audio is the SNR (dB) of the decoded
    waveform against the one the tokenizer read (resampled, mono); video the PSNR (dB) of
    the decoded frames against the sampled, cropped frames. Exit 1 if a file cannot be
    read."""

    spec: str = option(
        "tokenizer spec JSON, or a shipped spec's name (e.g. video-vq)",
        path="tokenizer_spec",
        positional=True,
    )
    files: list[str] = option("files to measure", path="in_file", positional=True, nargs="+")
    json: bool = option(
        "print one JSON document (per-file exact / snr_db / psnr_db, and a summary)", False
    )
    damage: list[float] | None = option(
        "also decode after a fraction RATE of the ids was replaced by random ids of the "
        "modality (video, audio; repeatable, e.g. --damage 0.001 --damage 0.01)", None,
        gt=0, le=1, repeat=True, metavar="RATE",
    )  # fmt: skip
    seeds: int = option(
        "random draws per --damage rate, seeds 0..N-1: mean and worst", 5, ge=1, le=10**4
    )

    def main(self) -> int:
        return cli_eval(self)


def cli_eval(args: TokenizerEval) -> int:
    """The ``tokenizer eval`` subcommand."""

    damage = list(args.damage or [])
    for rate in damage:
        if not 0.0 < rate <= 1.0:
            raise ConfigError(f"--damage {rate}: a fraction of the ids, 0 < RATE <= 1")
    if args.seeds < 1:
        raise ConfigError(f"--seeds {args.seeds}: at least 1")
    tok = load_tokenizer(args.spec)
    _check_damage(tok, damage)
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
            print(_line(tok, path, entry), flush=True)
    summary = summarise(entries, tok.fidelity_measure)
    if args.json:
        doc = {
            "spec": tok.spec.name,
            "kind": tok.spec.kind,
            "modality": tok.modality,
            "measure": tok.fidelity_measure,
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
