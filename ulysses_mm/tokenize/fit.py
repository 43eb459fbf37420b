"""Fitting learned tokenizers: ``ulysses-mm tokenizer fit video SOURCES… --out tokenizers/X.json``.

A video codebook is k-means on patches of frames sampled exactly as the tokenizer will
sample them (same fps, resize, crop, patch), so the codewords match what they quantise.
The output is two files written atomically: the codebook ``X.npy`` (float16
``[codebook_size, patch·patch·3]``, pixel values 0..255; float16 keeps the artifact small
and its rounding, < 0.125, is far below the quantisation error) and the spec ``X.json``
naming it with its sha256. Sources are recorded by file name only (specs are
repository data, never machine paths).

``--codebook EXISTING.npy`` skips fitting and writes a new spec around an existing
codebook (e.g. the audio-interleaving variant of a fitted spec, sharing one artifact).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ulysses_mm.core.storage import atomic_write_local
from ulysses_mm.tokenize.base import DecodeError, TokenizerSpec
from ulysses_mm.tokenize.kmeans import kmeans
from ulysses_mm.tokenize.video.frames import sample_frames
from ulysses_mm.tokenize.video.vq import patchify


@dataclass
class VideoFitOptions:
    fps: float = 8.0
    size: int = 256
    patch: int = 16
    codebook_size: int = 256
    max_frames: int | None = None  # per source
    seed: int = 0
    iters: int = 20
    max_patches: int = 200_000
    backend: str = "auto"


def synthetic_clips(n: int, frames: int, size: int, seed: int) -> list[np.ndarray]:
    """``n`` varied synthetic clips [frames, size, size, 3] uint8 to fit on beside real
    footage: smooth gradients, soft blobs, hard-edged shapes and oriented sinusoidal
    textures at random colours and contrasts, the whole scene panning at a random velocity
    with one shape moving on its own (so frame-to-frame changes are realistic too)."""
    rng = np.random.default_rng(seed)
    big = size + 64
    yy, xx = np.mgrid[0:big, 0:big].astype(np.float32)
    out: list[np.ndarray] = []
    for _ in range(n):
        img = np.empty((big, big, 3), np.float32)
        a, b = rng.uniform(0, 255, (2, 3))
        ang = rng.uniform(0, 2 * np.pi)
        ramp = (np.cos(ang) * xx + np.sin(ang) * yy) / big
        img[:] = a + (b - a) * ramp[..., None] * rng.uniform(0.2, 1.0)
        for _ in range(int(rng.integers(2, 7))):  # soft blobs
            cy, cx, r = rng.uniform(0, big), rng.uniform(0, big), rng.uniform(6, 60)
            w = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))[..., None]
            img = img * (1 - w) + rng.uniform(0, 255, 3) * w
        for _ in range(int(rng.integers(1, 6))):  # hard-edged rectangles and discs
            cy, cx, r = rng.uniform(0, big), rng.uniform(0, big), rng.uniform(5, 50)
            if rng.random() < 0.5:
                m = (np.abs(yy - cy) < r) & (np.abs(xx - cx) < r * rng.uniform(0.3, 2))
            else:
                m = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
            img[m] = rng.uniform(0, 255, 3)
        for _ in range(int(rng.integers(0, 3))):  # oriented textures, in a soft region
            f, th = rng.uniform(0.05, 0.6), rng.uniform(0, np.pi)
            wave = np.sin(f * (np.cos(th) * xx + np.sin(th) * yy) + rng.uniform(0, 6.3))
            cy, cx, r = rng.uniform(0, big), rng.uniform(0, big), rng.uniform(20, 90)
            w = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))[..., None]
            img += w * wave[..., None] * rng.uniform(5, 50) * rng.uniform(0.5, 1.0, 3)
        img += rng.normal(0, rng.uniform(0, 4), img.shape).astype(np.float32)  # sensor noise
        vy, vx = rng.uniform(-4, 4, 2)
        clip = np.empty((frames, size, size, 3), np.uint8)
        for t in range(frames):
            oy = int(np.clip(32 + vy * t, 0, 64))
            ox = int(np.clip(32 + vx * t, 0, 64))
            clip[t] = np.clip(img[oy : oy + size, ox : ox + size], 0, 255)
        out.append(clip)
    return out


@dataclass
class VideoFit:
    codebook: np.ndarray  # [k, d] float32
    info: dict[str, Any]  # provenance for the spec's params["fit"]


def collect_patches(sources: Sequence[str], opts: VideoFitOptions) -> np.ndarray:
    """uint8 patches [n, p·p·3] of every source, subsampled (seeded) to ``max_patches``."""
    chunks: list[np.ndarray] = []
    for src in tqdm(sources, desc="decode", unit="file", disable=len(sources) < 2):
        for frames in sample_frames(src, opts.fps, opts.size, opts.max_frames, opts.backend):
            chunks.append(patchify(frames, opts.patch))
    if not chunks:
        raise ValueError("no frames decoded from the sources")
    patches = np.concatenate(chunks)
    if patches.shape[0] > opts.max_patches:
        rng = np.random.default_rng(opts.seed)
        patches = patches[np.sort(rng.choice(patches.shape[0], opts.max_patches, replace=False))]
    return patches


def fit_video_codebook(sources: Sequence[str], opts: VideoFitOptions) -> VideoFit:
    if opts.size % opts.patch:
        raise ValueError(f"--size {opts.size} must be a multiple of --patch {opts.patch}")
    patches = collect_patches(sources, opts)
    if patches.shape[0] < opts.codebook_size:
        raise ValueError(
            f"{patches.shape[0]} patches are too few for a codebook of {opts.codebook_size}; "
            "add sources, raise --fps / --max-frames or lower --codebook-size"
        )
    res = kmeans(patches, opts.codebook_size, iters=opts.iters, seed=opts.seed)
    mse = res.mse[-1]
    info = {
        "sources": [Path(s).name for s in sources],
        "patches": int(patches.shape[0]),
        "seed": opts.seed,
        "iterations": res.iterations,
        "mse": round(mse, 3),
        "psnr_db": round(10 * math.log10(255.0**2 / max(mse, 1e-12)), 2),
    }
    return VideoFit(res.centroids, info)


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_spec(out: Path, spec: dict[str, Any]) -> None:
    atomic_write_local(out, (json.dumps(spec, indent=2) + "\n").encode())


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def _check_flag_combinations(args: argparse.Namespace, opts: VideoFitOptions) -> None:
    """No flag may silently do nothing."""
    if args.chunk_frames is not None and not args.audio_spec:
        raise ValueError("--chunk-frames only applies with --audio-spec")
    if args.codebook:
        if args.sources:
            raise ValueError("--codebook reuses a fitted codebook: give no SOURCES with it")
        defaults = VideoFitOptions()
        fit_only = ["max_frames", "seed", "iters", "max_patches", "codebook_size"]
        given = [f for f in fit_only if getattr(opts, f) != getattr(defaults, f)]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise ValueError(f"{flags} only apply when fitting, not with --codebook")


def fit_gainshape_cli(args: argparse.Namespace, out: Path, params: dict[str, Any]) -> int:
    """``tokenizer fit video --kind video-gsvq``: the predictive gain-shape model."""
    from ulysses_mm.tokenize.registry import load_tokenizer
    from ulysses_mm.tokenize.video.gainshape import (
        MotionLayout,
        fit_gainshape,
        npz_bytes,
        residual_vectors,
    )

    if args.codebook or args.audio_spec:
        raise ValueError("--codebook and --audio-spec apply to --kind video-vq only")
    if args.motion < 0 or args.local < 0:
        raise ValueError("--motion and --local must be >= 0")
    if not args.sources and not args.synthetic:
        raise ValueError("give SOURCES and/or --synthetic N to fit on")
    clips: list[np.ndarray] = []
    try:
        for src in args.sources:
            frames = list(sample_frames(src, args.fps, args.size, args.max_frames, args.backend))
            if frames:
                clips.append(np.concatenate(frames))
    except DecodeError as e:
        raise ValueError(f"cannot fit on the sources: {e}") from e
    clips += synthetic_clips(args.synthetic, 16, args.size, args.seed)
    rng = np.random.default_rng(args.seed)
    fit = fit_gainshape(
        residual_vectors(clips, args.patch, rng),
        dims=args.dims,
        shapes=args.shapes,
        levels=args.levels,
        seed=args.seed,
        iters=args.iters,
        max_vectors=args.max_patches,
    )
    artifact = out.with_suffix(".npz")
    data = npz_bytes(fit.model)
    atomic_write_local(artifact, data)
    if args.motion or args.local:  # the plain layout's specs keep their params as they were
        params["motion"], params["local"] = args.motion, args.local
    layout = MotionLayout(fit.model.per_mode, args.motion, args.local)
    params["fit"] = {
        "sources": [Path(s).name for s in args.sources],
        "synthetic_clips": args.synthetic,
        "dims": args.dims,
        "shapes": args.shapes,
        "levels": args.levels,
        **fit.info,
    }
    tokens = (args.size // args.patch) ** 2
    spec = {
        "name": args.name or out.stem,
        "description": args.description
        or (
            f"Video as {args.size}x{args.size} crops at {args.fps:g} fps, one id per "
            f"{args.patch}x{args.patch} patch ({tokens} per frame, then <eof>): predictive "
            f"gain-shape VQ ({args.shapes} shapes in a {args.dims}-dim basis, {args.levels} "
            "signed gain levels, from the previous frame or from grey"
            + (
                f"; the previous frame moved by a global displacement up to ±{args.motion} px "
                f"and ±{args.local} px per patch"
                if args.motion or args.local
                else ""
            )
            + ")."
        ),
        "modality": "video",
        "kind": "video-gsvq",
        "vocab_size": layout.vocab_size,
        "params": params,
        "artifact": _rel(artifact, out.parent),
        "artifact_sha256": hashlib.sha256(data).hexdigest(),
    }
    write_spec(out, spec)
    tok = load_tokenizer(out)
    print(
        f"wrote {out} (vocab {tok.spec.vocab_size}, {tokens} tokens/frame, "
        f"artifact {spec['artifact']}, {len(data) / 1e6:.2f} MB)"
    )
    return 0


def cli_fit(args: argparse.Namespace) -> int:
    """The ``tokenizer fit`` subcommand (see cli._add_tokenizer for its flags)."""
    from ulysses_mm.tokenize.registry import load_tokenizer

    if args.modality != "video":
        raise ValueError(f"no fitted tokenizer for modality {args.modality!r}")
    out = Path(args.out)
    if out.suffix != ".json":
        raise ValueError(f"--out must name the spec .json, got {out}")
    name = args.name or out.stem
    opts = VideoFitOptions(
        fps=args.fps,
        size=args.size,
        patch=args.patch,
        codebook_size=args.codebook_size,
        max_frames=args.max_frames,
        seed=args.seed,
        iters=args.iters,
        max_patches=args.max_patches,
        backend=args.backend,
    )
    _check_flag_combinations(args, opts)
    params: dict[str, Any] = {
        "fps": opts.fps,
        "size": opts.size,
        "patch": opts.patch,
        "max_frames": None,
        "backend": opts.backend,
    }
    if args.kind == "video-gsvq":
        return fit_gainshape_cli(args, out, params)
    if args.synthetic:
        raise ValueError("--synthetic applies to --kind video-gsvq only")
    if args.motion or args.local:
        raise ValueError("--motion and --local apply to --kind video-gsvq only")
    if args.audio_spec:
        audio = Path(args.audio_spec)
        TokenizerSpec.load(audio)  # fail now if it is not a spec
        params["audio"] = {"spec": _rel(audio, out.parent)}
        params["chunk_frames"] = args.chunk_frames or 8
    if args.codebook:
        artifact = Path(args.codebook)
        codebook = np.load(artifact, allow_pickle=False)
        data = artifact.read_bytes()
        params["fit"] = {"reused": artifact.name}
    else:
        if not args.sources:
            raise ValueError("give SOURCES to fit on, or --codebook to reuse a fitted one")
        try:
            fit = fit_video_codebook(args.sources, opts)
        except DecodeError as e:
            raise ValueError(f"cannot fit on the sources: {e}") from e
        codebook = fit.codebook
        params["fit"] = fit.info
        artifact = out.with_suffix(".npy")
        data = npy_bytes(codebook.astype(np.float16))
        atomic_write_local(artifact, data)
    spec = {
        "name": name,
        "description": args.description
        or (
            f"Video as {opts.size}x{opts.size} crops at {opts.fps:g} fps, {opts.patch}x"
            f"{opts.patch} patches vector-quantised to a {codebook.shape[0]}-word k-means "
            "codebook; <eof> after each frame"
            + (", audio interleaved per chunk" if args.audio_spec else "")
            + "."
        ),
        "modality": "video",
        "kind": "video-vq",
        "vocab_size": int(codebook.shape[0]),
        "params": params,
        "artifact": _rel(artifact, out.parent),
        "artifact_sha256": hashlib.sha256(data).hexdigest(),
    }
    write_spec(out, spec)
    tok = load_tokenizer(out)  # the written spec must load (shape, sha256, params)
    fit_info = params["fit"]
    print(
        f"wrote {out} ({tok.spec.vocab_size} codewords of {opts.patch}x{opts.patch}x3, "
        f"artifact {spec['artifact']})"
        + (
            f"; fit PSNR {fit_info['psnr_db']} dB on {fit_info['patches']} patches"
            if "psnr_db" in fit_info
            else ""
        )
    )
    return 0
