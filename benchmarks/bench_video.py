"""Video tokenizer speed per core at 256x256 with VQ, vs a per-patch Python loop; PSNR too.

For each shared clip the shipped spec (``tokenizers/video-vq.json``: 8 fps, 256x256 centre
crop, 16x16 patches, 256-word codebook) is timed end to end (probe + decode at the spec's
fps + resize/crop + patchify + nearest codeword), with the split between decoding and VQ.
The naive baseline runs the same decode, then finds each patch's nearest codeword with a
Python loop over patches (numpy per patch); its VQ is timed on a few frames (it is slow)
and must pick the same ids. Frames/s counts frames produced at the spec's fps, per CPU
second (decoders and torch are single-threaded). PSNR compares the decoded tokens with the
sampled frames. A sweep of codebook sizes shows what the nearest-codeword search costs.

    PYTHONPATH=. python benchmarks/bench_video.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.video.fidelity import psnr
from ulysses_mm.tokenize.video.frames import probe_video
from ulysses_mm.tokenize.video.kmeans import Codebook
from ulysses_mm.tokenize.video.vq import VqVideoTokenizer, patchify

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
CLIPS = ["rabbit_toy_320x240.mp4", "rabbit_toy_320x240.webm", "pig_toy_720x480.mp4"]


def cpu_time(fn) -> tuple[float, object]:
    c = time.process_time()
    out = fn()
    return time.process_time() - c, out


def best(fn, repeats: int) -> tuple[float, object]:
    return min((cpu_time(fn) for _ in range(repeats)), key=lambda r: r[0])


def naive_vq(patches: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    out = np.empty(len(patches), dtype=np.int64)
    for i, x in enumerate(patches.astype(np.float32)):
        out[i] = int(np.argmin(((codebook - x) ** 2).sum(axis=1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per method; the best is kept")
    ap.add_argument("--naive-frames", type=int, default=4, help="frames the naive VQ is timed on")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.repeats, args.naive_frames = 1, 1
    torch.set_num_threads(1)
    tok = load_tokenizer(REPO / "tokenizers" / "video-vq.json")
    assert isinstance(tok, VqVideoTokenizer)
    space = TokenSpace.from_vocab({"video": tok.spec.vocab_size})
    clips = [SHARED / c for c in CLIPS if (SHARED / c).is_file()]
    if args.smoke or not clips:
        clips = [REPO / "tests" / "data" / "rabbit_toy_320x240.webm"]
    p = tok.params
    print(
        f"Video tokenizer (video-vq: {p['fps']:g} fps, {p['size']}x{p['size']}, {p['patch']}x"
        f"{p['patch']} patches, {tok.codebook.size} codewords), 1 core, best of {args.repeats}"
    )
    print(
        f"{'clip':26s} {'frames':>6s} {'fps/core':>8s} {'decode':>9s} {'VQ':>9s} "
        f"{'naive VQ':>9s} {'naive fps':>9s} {'PSNR':>7s}"
    )
    total_frames = total_cpu = 0.0
    for clip in clips:
        path = str(clip)
        cpu, docs = best(lambda path=path: list(tok.encode_file(path, space)), args.repeats)
        tokens = docs[0].tokens  # type: ignore[index]
        n = (len(tokens) - 3) // (tok.tokens_per_frame + 1)
        dec_cpu, frames = best(
            lambda path=path: np.concatenate(list(tok.frames(path, probe_video(path)))),
            args.repeats,
        )
        vq_cpu, ids = best(lambda frames=frames: tok.encode_frames(frames), args.repeats)
        k = min(args.naive_frames, n)
        sub = patchify(frames[:k], tok.patch)
        naive_cpu, naive_ids = cpu_time(lambda sub=sub: naive_vq(sub, tok.codebook.vectors))
        assert np.array_equal(naive_ids, ids[:k].ravel()), "naive and fast VQ disagree"
        naive_per_frame = dec_cpu / n + naive_cpu / k
        db = psnr(tok.decode(tokens, space), frames)
        total_frames += n
        total_cpu += cpu
        print(
            f"{clip.name:26s} {n:6d} {n / cpu:8.0f} {dec_cpu / n * 1e3:6.2f} ms {vq_cpu / n * 1e3:6.2f} ms "
            f"{naive_cpu / k * 1e3:6.0f} ms {1 / naive_per_frame:9.1f} {db:5.2f} dB"
        )
    print(f"all clips: {total_frames / total_cpu:.0f} frames/s per core (goal >= 100)")
    figures = {"frames_s_per_core": total_frames / total_cpu, "psnr_db_last_clip": db}

    print("\nnearest-codeword search alone at 256x256 (random codebooks, ms per frame):")
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (16, 256, 256, 3), dtype=np.uint8)
    print(f"{'patch':>5s} " + " ".join(f"{f'K={k}':>8s}" for k in (128, 256, 512, 1024)))
    for patch in (8, 16):
        x = patchify(frames, patch)
        row = []
        for k in (128,) if args.smoke else (128, 256, 512, 1024):
            book = Codebook(rng.uniform(0, 255, (k, x.shape[1])).astype(np.float32))
            secs, _ = best(lambda x=x, book=book: book.encode(x), 2)
            row.append(f"{secs / len(frames) * 1e3:8.2f}")
        print(f"{patch:5d} " + " ".join(row))
    from _results import record

    print(" ".join(f"{k}={v:.2f}" for k, v in figures.items()))
    record("bench_video", figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
