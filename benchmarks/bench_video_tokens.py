"""Video tokens a model can write: cost per frame, fidelity, and fidelity under wrong ids.

For each video spec (``tokenizers/video-h264.json``, variants of it that trade robustness
for fidelity, and the per-patch codebook ``video-vq.json``) on each clip, through the
same code as ``ulysses-mm tokenizer eval --damage 0.001 --damage 0.01``:

- ids per frame, mean and max (the max over the mean is the spike a model must write);
- PSNR of the decoded frames against the sampled ones (mean squared error over the clip);
- PSNR after 0.1 % and 1 % of the clip's ids were replaced by random ids of the video
  range (the mean over seeds 0..4; frame ends kept), i.e. a model that writes one wrong
  id in 1000 or in 100;
- PSNR of the frames decoded from a third of the way in (a packed sample that continues
  the clip), over those frames;
- encode frames/s per core (CPU time of the kind's encoder alone, one thread).

Clips: ``video-h264``'s params were chosen on ``pig_toy_720x480.mp4`` and three synthetic
clips (tests/helpers/media_factory.py: a zoom, a dolly through layers, noise-free smooth
shading); every other clip is held out: the rabbit clip (mp4 and webm) and three synthetic
ones, a hand-held pan over 1/f texture, a cut between two such scenes and a static talking
head; and two made to look more like camera footage, a hand-held camera over a real
photograph and a rendered room with rolling balls (both with motion blur and a sensor's
shot noise). Synthetic clips: 10 s at 24 fps, 320x240, each from a fixed seed. The
summary lines average each group of held-out clips.

    PYTHONPATH=. python benchmarks/bench_video_tokens.py [--seeds 5] [--tuned]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from ulysses_mm.tokenize.base import TokenizerSpec
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.video.fidelity import eval_video, psnr

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
HELD_OUT_FILES = ["rabbit_toy_320x240.mp4", "rabbit_toy_320x240.webm"]
TUNED_FILES = ["pig_toy_720x480.mp4"]
HELD_OUT_SCENES = ["pan", "cut", "talking_head"]
RENDERED_SCENES = ["photo", "room"]  # held out too: closer to camera footage
TUNED_SCENES = ["zoom", "dolly", "gradient"]
RATES = (0.001, 0.01)


def _media_factory() -> Any:
    from _helpers import helper_module

    return helper_module("media_factory")


def specs() -> list[tuple[str, TokenizerSpec]]:
    """(label, spec): the shipped specs and variants of video-h264.json."""
    h264 = TokenizerSpec.load(REPO / "tokenizers" / "video-h264.json")

    def variant(**params: Any) -> TokenizerSpec:
        return TokenizerSpec(
            h264.name, h264.modality, h264.kind, h264.vocab_size, {**h264.params, **params}
        )

    return [
        ("video-h264.json", h264),
        ("  slice_bytes 120 (more robust)", variant(slice_bytes=120)),
        ("  keyint 16 (sweeps back to back)", variant(keyint=16)),
        ("  keyframes instead of refresh", variant(intra_refresh=False)),
        (
            "  1 slice, keyframe/64, 16-frame buffer",
            variant(intra_refresh=False, keyint=64, slice_bytes=0, buffer_frames=16.0),
        ),
        ("video-vq.json", TokenizerSpec.load(REPO / "tokenizers" / "video-vq.json")),
    ]


HELD_OUT = "held out"
RENDERED = "held out, rendered"
TUNED = "tuned on"


def clips(root: Path, tuned: bool, smoke: bool = False) -> list[tuple[str, str, str]]:
    """(name, path, group) of every clip to measure: held out, held out rendered, tuned on
    (``smoke``: the clip this repository ships alone)."""
    if smoke:
        return [
            ("rabbit_toy_320x240.webm", str(REPO / "tests" / "data" / HELD_OUT_FILES[1]), HELD_OUT)
        ]
    mf = _media_factory()
    out = []
    for f in HELD_OUT_FILES + (TUNED_FILES if tuned else []):
        path = SHARED / f
        if not path.is_file() and f.endswith(".webm"):
            path = REPO / "tests" / "data" / f
        if path.is_file():
            out.append((f, str(path), TUNED if f in TUNED_FILES else HELD_OUT))
    names = HELD_OUT_SCENES + RENDERED_SCENES + (TUNED_SCENES if tuned else [])
    for name in names:
        path = mf.write_scene(root / f"{name}.mp4", name)
        group = TUNED if name in TUNED_SCENES else RENDERED if name in RENDERED_SCENES else HELD_OUT
        out.append((name, str(path), group))
    return out


def mid_clip_psnr(tok: Any, path: str) -> float:
    """PSNR of the frames decoded from a third of the way into the clip."""
    frames = np.concatenate(list(tok.frames(path)))
    ids = tok.encode_frames(frames)
    start = len(frames) // 3
    if ids.ndim == 2:  # a codebook kind: every frame stands alone
        return psnr(frames[start:], tok.decode_ids(ids[start:]))
    ends = np.flatnonzero(ids < 0)  # a ragged kind: frames end at a negative id
    return psnr(frames[start:], tok.decode_ids(ids[ends[start - 1] + 1 :]))


def encode_fps(tok: Any, path: str) -> float:
    frames = np.concatenate(list(tok.frames(path)))
    cpu = time.process_time()
    tok.encoder()(frames)
    return len(frames) / max(time.process_time() - cpu, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="draws per wrong-id rate (default 5)")
    ap.add_argument(
        "--tuned", action="store_true", help="also the clips video-h264's params were chosen on"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.seeds = 1
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        todo = clips(Path(tmp), args.tuned, args.smoke)
        print(
            "Video specs, 256x256 at 8 fps; PSNR in dB (wrong ids: mean of "
            f"{args.seeds} seeds); encode frames/s per core (CPU time, one thread)"
        )
        head = (
            f"{'spec':40s} {'clip':24s} {'ids/frame':>9s} {'max':>5s} {'max/mean':>8s} "
            f"{'PSNR':>6s} {'0.1 %':>6s} {'1 %':>6s} {'mid-clip':>8s} {'enc fps':>7s}"
        )
        print(head)
        chosen = specs()
        if args.smoke:  # the default spec alone
            chosen = chosen[:1]
        for label, spec in chosen:
            tok = load_tokenizer(spec)
            rows = []
            for name, path, group in todo:
                e = eval_video(tok, path, RATES, args.seeds)
                low, high = (d["psnr_db"] for d in e["damaged"])
                rows.append((e, low, high, mid_clip_psnr(tok, path), encode_fps(tok, path), group))
                mean, peak = float(e["tokens_per_frame"]), int(e["max_tokens_per_frame"])
                tag = f" ({TUNED})" if group == TUNED else ""
                print(
                    f"{label:40s} {name + tag:24s} {mean:9.1f} "
                    f"{peak:5d} {peak / mean:8.2f} {e['psnr_db']:6.2f} {low:6.2f} {high:6.2f} "
                    f"{rows[-1][3]:8.2f} {rows[-1][4]:7.0f}",
                    flush=True,
                )
            for title, groups in (
                (HELD_OUT, {HELD_OUT}),
                (RENDERED, {RENDERED}),
                ("all held out", {HELD_OUT, RENDERED}),
                (TUNED, {TUNED}),
            ):
                _summary(label, title, [r for r in rows if r[5] in groups])
            if not label.startswith(" "):  # a shipped spec, not a variant
                key = label.removesuffix(".json").replace("-", "_")
                figures[f"{key}_psnr_db"] = float(np.mean([r[0]["psnr_db"] for r in rows]))
                figures[f"{key}_ids_per_frame"] = float(
                    np.mean([float(r[0]["tokens_per_frame"]) for r in rows])
                )
    from _results import record

    print(" ".join(f"{k}={v:.2f}" for k, v in figures.items()))
    record("bench_video_tokens", figures, smoke=args.smoke)


def _summary(label: str, title: str, rows: list[tuple[Any, ...]]) -> None:
    """One line for a group of clips: the mean of each column (ids per frame: the mean, and
    the highest clip mean; max/mean: the highest), then the lowest PSNR clean and at 0.1 %."""
    if not rows:
        return
    col = np.array([[r[0]["psnr_db"], r[1], r[2], r[3]] for r in rows])
    per = np.array([float(r[0]["tokens_per_frame"]) for r in rows])
    peak = max(int(r[0]["max_tokens_per_frame"]) / float(r[0]["tokens_per_frame"]) for r in rows)
    print(
        f"{label:40s} {title + ': mean':24s} {per.mean():9.1f} {per.max():5.0f} {peak:8.2f} "
        + " ".join(f"{m:6.2f}" for m in col.mean(0)[:3])
        + f" {col.mean(0)[3]:8.2f}   PSNR min {col[:, 0].min():.2f}, "
        f"0.1 % min {col[:, 1].min():.2f} ({len(rows)} clips)"
    )


if __name__ == "__main__":
    main()
