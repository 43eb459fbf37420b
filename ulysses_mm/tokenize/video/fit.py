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

from ulysses_mm.config.parse import option
from ulysses_mm.core.checks import MAX_SEED
from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.core.storage import atomic_write_local
from ulysses_mm.tokenize.base import DecodeError, TokenizerSpec
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.video.frames import decord_or_none, sample_frames
from ulysses_mm.tokenize.video.kmeans import kmeans
from ulysses_mm.tokenize.video.vq import patchify


@dataclass
class VideoFitOptions:
    """How frames are sampled and the codebook is fitted (``tokenizer fit video-vq``'s
    flags, with :class:`VideoVqFit`'s)."""

    fps: float = option("frames sampled per second", 8.0, gt=0, le=1000)
    size: int = option("square crop side in pixels", 256, ge=1, le=1 << 16)
    patch: int = option("patch side in pixels", 16, ge=1, le=1 << 16)
    codebook_size: int = option("codewords = vocab_size", 256, ge=1, le=1 << 24)
    max_frames: int | None = option(
        "frames per source to fit on (default all)", None, ge=1, le=1 << 31
    )
    seed: int = option("seed of sampling and k-means", 0, ge=0, le=MAX_SEED)
    iters: int = option("k-means iterations at most", 20, ge=1, le=10**6)
    max_patches: int = option(
        "patches k-means sees at most, a seeded subsample", 200_000, ge=1, le=10**9
    )
    backend: str = option(
        "frame decoder (auto: decord, PyAV where decord cannot)", "auto",
        choices=("auto", "decord", "pyav"),
    )  # fmt: skip


@dataclass(kw_only=True)
class VideoVqFit(VideoFitOptions):
    """``ulysses-mm tokenizer fit video-vq``: sample frames from ``sources`` exactly as the
    tokenizer will (fps, resize, centre crop, patches), fit a k-means codebook, and write
    ``out`` (the spec) and ``out`` with .npy (the codebook), atomically."""

    sources: list[str] = option(
        "media files to fit on", factory=list, path="in_file", positional=True
    )
    out: str = option("spec to write, e.g. tokenizers/video-vq.json", path="out_file")
    name: str | None = option("spec name (default: OUT's file stem)", None)
    description: str | None = option("spec description (default: generated)", None)
    audio_spec: str | None = option(
        "audio spec JSON to interleave with the frames (makes a video+audio spec)", None,
        path="in_file",
    )  # fmt: skip
    chunk_frames: int | None = option(
        "frames per interleaving chunk, with --audio-spec (default 8)", None, ge=1, le=10**6
    )
    codebook: str | None = option(
        "reuse this fitted codebook .npy instead of fitting (SOURCES not needed)", None,
        path="in_file",
    )  # fmt: skip

    def main(self) -> int:
        return cli_fit(self)


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
        raise DataError("no frames decoded from the sources")
    patches = np.concatenate(chunks)
    if patches.shape[0] > opts.max_patches:
        rng = np.random.default_rng(opts.seed)
        patches = patches[np.sort(rng.choice(patches.shape[0], opts.max_patches, replace=False))]
    return patches


def fit_video_codebook(sources: Sequence[str], opts: VideoFitOptions) -> VideoFit:
    if opts.size % opts.patch:
        raise ConfigError(f"--size {opts.size} must be a multiple of --patch {opts.patch}")
    patches = collect_patches(sources, opts)
    if patches.shape[0] < opts.codebook_size:
        raise DataError(
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


def _check_flag_combinations(opts: VideoVqFit) -> None:
    """No flag may silently do nothing, and none may ask for what is not installed."""
    if opts.backend == "decord" and decord_or_none() is None:
        raise ConfigError("--backend decord: decord is not installed here")
    if opts.chunk_frames is not None and not opts.audio_spec:
        raise ConfigError("--chunk-frames only applies with --audio-spec")
    if opts.codebook:
        if opts.sources:
            raise ConfigError("--codebook reuses a fitted codebook: give no SOURCES with it")
        defaults = VideoFitOptions()
        fit_only = ["max_frames", "seed", "iters", "max_patches", "codebook_size"]
        given = [f for f in fit_only if getattr(opts, f) != getattr(defaults, f)]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise ConfigError(f"{flags} only apply when fitting, not with --codebook")


def cli_fit(opts: VideoVqFit) -> int:
    """Fit (or reuse) a codebook and write its spec; the fitted spec must load."""
    out = Path(opts.out)
    if out.suffix != ".json":
        raise ConfigError(f"--out must name the spec .json, got {out}")
    name = opts.name or out.stem
    _check_flag_combinations(opts)
    params: dict[str, Any] = {
        "fps": opts.fps,
        "size": opts.size,
        "patch": opts.patch,
        "max_frames": None,
        "backend": opts.backend,
    }
    if opts.audio_spec:
        audio = Path(opts.audio_spec)
        TokenizerSpec.load(audio)  # fail before fitting if it is not a spec
        params["audio"] = {"spec": _rel(audio, out.parent)}
        params["chunk_frames"] = opts.chunk_frames or 8
    if opts.codebook:
        artifact = Path(opts.codebook)
        try:
            codebook = np.load(artifact, allow_pickle=False)
            data = artifact.read_bytes()
        except (OSError, ValueError) as e:
            raise DataError(f"--codebook {artifact}: cannot load it: {e}") from e
        params["fit"] = {"reused": artifact.name}
    else:
        if not opts.sources:
            raise ConfigError("give SOURCES to fit on, or --codebook to reuse a fitted one")
        try:
            fit = fit_video_codebook(opts.sources, opts)
        except DecodeError as e:
            raise DataError(f"cannot fit on the sources: {e}") from e
        codebook = fit.codebook
        params["fit"] = fit.info
        artifact = out.with_suffix(".npy")
        data = npy_bytes(codebook.astype(np.float16))
        atomic_write_local(artifact, data)
    spec = {
        "name": name,
        "description": opts.description
        or (
            f"Video as {opts.size}x{opts.size} crops at {opts.fps:g} fps, {opts.patch}x"
            f"{opts.patch} patches vector-quantised to a {codebook.shape[0]}-word k-means "
            "codebook; <eof> after each frame"
            + (", audio interleaved per chunk" if opts.audio_spec else "")
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
