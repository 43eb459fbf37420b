"""A neural video tokenizer (kind ``video-codec``) beside ``video-h264`` and ``video-vq`` on
the same clip, through the code of ``ulysses-mm tokenizer eval --damage 0.01``: PSNR of
the decoded frames against the sampled ones, ids per frame, PSNR with 1 % of the ids
wrong (mean of 3 seeds), encode frames/s.

Every spec samples the clip alike (``--size``, ``--fps``, ``--max-frames``). With no
weights given the codecs are the tests' tiny stand-ins (a random ``Emu3VQVAE``; a
TorchScript causal FSQ with Cosmos DV's interface): their PSNR says only that the
plumbing holds. Give a real codec's directory (see docs/video-codec.md) for figures that
mean something:

    PYTHONPATH=. python benchmarks/bench_video_codec.py [--emu3 DIR] [--cosmos DIR]
        [--clip FILE] [--size 128] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]


def _helpers() -> Any:
    from _helpers import helper_module

    return helper_module("video_codecs")


def _shipped(name: str, out: Path, frames: dict[str, Any]) -> Path:
    """A shipped spec with the common sampling (its artifact path made absolute)."""
    spec = json.loads((REPO / "tokenizers" / name).read_text())
    spec["params"] = {**spec.get("params", {}), **frames}
    spec["params"].pop("audio", None)
    if "artifact" in spec:
        spec["artifact"] = str(REPO / "tokenizers" / spec["artifact"])
    path = out / name
    path.write_text(json.dumps(spec))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clip", default=str(REPO / "tests" / "data" / "rabbit_toy_320x240.webm"))
    ap.add_argument("--emu3", default=None, help="an Emu3VQVAE directory (default: tiny random)")
    ap.add_argument("--cosmos", default=None, help="encoder.jit + decoder.jit (default: stand-in)")
    ap.add_argument("--vocab", type=int, default=64000, help="the Cosmos codec's codes")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--fps", type=float, default=8.0)
    ap.add_argument("--max-frames", type=int, default=16)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.size, args.max_frames = 64, 4

    from ulysses_mm.tokenize.registry import load_tokenizer

    helpers = _helpers()
    frames = {"size": args.size, "fps": args.fps, "max_frames": args.max_frames}
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        specs = {
            "video-h264": _shipped("video-h264.json", out, frames),
            "video-vq": _shipped("video-vq.json", out, frames),
        }
        emu3 = Path(args.emu3) if args.emu3 else helpers.write_emu3(out / "emu3")
        vocab = json.loads((emu3 / "config.json").read_text()).get("codebook_size", 32768)
        specs["video-codec emu3" + ("" if args.emu3 else " (tiny random)")] = helpers.write_spec(
            out / "emu3.json", emu3.resolve(), vocab, device="cpu", **frames
        )
        if args.cosmos:
            cosmos, cvocab, factors = Path(args.cosmos), args.vocab, {}
        else:
            cosmos = helpers.write_cosmos(out / "cosmos", temporal=4, spatial=8, levels=8)
            cvocab, factors = 512, {"temporal": 4, "spatial": 8}
        specs["video-codec cosmos" + ("" if args.cosmos else " (stand-in)")] = helpers.write_spec(
            out / "cosmos.json", cosmos.resolve(), cvocab, format="cosmos", device="cpu",
            **factors, **frames,
        )  # fmt: skip
        for name, path in specs.items():
            tok = load_tokenizer(path)
            entry = tok.fidelity(args.clip, damage=(0.01,), seeds=3)
            rows[name] = {
                "psnr_db": entry["psnr_db"],
                "tokens_per_frame": entry["tokens_per_frame"],
                "psnr_db_1pct_wrong": entry["damaged"][0]["psnr_db"],
                "encode_fps": entry["encode_fps"],
                "frames": entry["frames"],
            }
    print(
        f"clip {Path(args.clip).name}, {args.size}² at {args.fps:g} fps, {args.max_frames} frames"
    )
    print(f"{'spec':34s} {'PSNR dB':>8s} {'ids/frame':>10s} {'1% wrong':>9s} {'enc fps':>8s}")
    for name, r in rows.items():
        print(
            f"{name:34s} {r['psnr_db']:8.2f} {r['tokens_per_frame']:10} "
            f"{r['psnr_db_1pct_wrong']:9.2f} {r['encode_fps']:8.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    codec = next(k for k in rows if k.startswith("video-codec emu3"))
    print(
        f"psnr_codec_emu3={rows[codec]['psnr_db']} psnr_h264={rows['video-h264']['psnr_db']} "
        f"ids_per_frame_codec_emu3={rows[codec]['tokens_per_frame']} "
        f"ids_per_frame_h264={rows['video-h264']['tokens_per_frame']}"
    )
    from _results import record

    record("bench_video_codec", rows, smoke=args.smoke)


if __name__ == "__main__":
    main()
