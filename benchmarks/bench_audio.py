"""Audio tokenizer speed per core, as x real time (decode + resample + mu-law), vs naive.

For each shared recording (mp3, ogg, flac, wav) the tokenizer (``audio-mulaw-16k``: PyAV
decode, the spec's resampler — ``sharp``: libsoxr then a 4,105-tap FIR — to 16 kHz mono in
~0.5 s batches, vectorised mu-law) is timed end to end. Two naive baselines run in the same process on the same file:

- ``per-sample mu-law``: the same decode, then mu-law by a Python loop over the samples;
- ``per-frame resample``: mu-law vectorised, but every decoded frame sent through the
  resampler on its own (PyAV's filter graph per call), the obvious way to use the API.

x real time = seconds of audio / CPU seconds (the per-core figure; wall seconds printed too,
they differ on a busy host). Goal: >= 300x real time.

    PYTHONPATH=. python benchmarks/bench_audio.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tokenize.audio.mulaw import mulaw_encode
from ulysses_mm.tokenize.audio.waveform import load_waveform
from ulysses_mm.tokenize.registry import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
FILES = [
    "outfoxing_the_fox_music.mp3",
    "vibe_ace_music.ogg",
    "librispeech_198-209-0000.ogg",
    "jfk_speech.flac",
    "ljspeech_LJ001-0001.wav",
]


def best(fn, repeats: int) -> tuple[float, float]:
    runs = []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        fn()
        runs.append((time.process_time() - c, time.perf_counter() - w))
    return min(runs)


def per_sample_mulaw(x: np.ndarray, bits: int = 8) -> list[int]:
    mu = 2**bits - 1
    out = []
    for v in x.tolist():
        v = min(1.0, max(-1.0, v))
        y = math.copysign(math.log1p(mu * abs(v)) / math.log1p(mu), v)
        out.append(math.floor((y + 1) / 2 * mu + 0.5))
    return out


def per_frame_resample(path: str, rate: int) -> np.ndarray:
    import av

    chunks = []
    with av.open(path) as c:
        s = c.streams.audio[0]
        s.codec_context.thread_count = 1
        r = av.AudioResampler(format="s16", layout="mono", rate=rate)
        for frame in c.decode(s):
            chunks += [f.to_ndarray()[0] for f in r.resample(frame)]
        chunks += [f.to_ndarray()[0] for f in r.resample(None)]
    return mulaw_encode(np.concatenate(chunks).astype(np.float32) / 32768.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per method; the best is kept")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(REPO / "tokenizers" / "audio-mulaw-16k.json")
    space = TokenSpace.from_vocab({"audio": tok.spec.vocab_size})
    rate = tok.spec.params["sample_rate"]
    paths = [SHARED / f for f in FILES if (SHARED / f).is_file()]
    if args.smoke:  # the short sample this repository ships, once
        paths, args.repeats = [REPO / "tests" / "data" / "ljspeech_LJ001-0001.wav"], 1
    if not paths:
        raise SystemExit(f"no shared audio files under {SHARED}")
    print(f"Audio tokenizer (audio-mulaw-16k), 1 core, best of {args.repeats}; x real time (CPU)")
    head = f"{'file':30s} {'audio s':>7s} {'tokenizer':>10s} {'wall':>6s} {'per-sample':>10s} {'per-frame':>10s}"
    print(head)
    tot_audio = tot_tok = 0.0
    for p in paths:
        path = str(p)
        seconds = (len(next(tok.encode_file(path, space)).tokens) - 3) / rate
        cpu, wall = best(lambda path=path: list(tok.encode_file(path, space)), args.repeats)
        wave = load_waveform(path, rate).samples
        decode_cpu, _ = best(lambda path=path: load_waveform(path, rate), 1)
        loop_cpu, _ = best(lambda wave=wave: per_sample_mulaw(wave), 1)
        frame_cpu, _ = best(lambda path=path: per_frame_resample(path, rate), 1)
        tot_audio += seconds
        tot_tok += cpu
        print(
            f"{p.name:30s} {seconds:7.1f} {seconds / cpu:9.0f}x {seconds / wall:5.0f}x "
            f"{seconds / (decode_cpu + loop_cpu):9.0f}x {seconds / frame_cpu:9.0f}x"
        )
    print(f"all files: {tot_audio / tot_tok:.0f}x real time per core (goal >= 300x)")
    from _results import key_values, record

    line = f"x_real_time={tot_audio / tot_tok:.1f} audio_s={tot_audio:.1f}"
    print(line)
    record("bench_audio", key_values(line), smoke=args.smoke)


if __name__ == "__main__":
    main()
