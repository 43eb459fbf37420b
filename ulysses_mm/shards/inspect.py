"""``ulysses-mm inspect``: what is in a dataset, and what one packed sample looks like.

Given a manifest (or a dataset directory, or one shard), prints the manifest summary and
one sample's segment table; with ``--png`` renders the sample: a modality ribbon along
the sequence (per document and per token), then for each modality present the data
decoded back through the tokenizers the manifest names — a grid of video frames, the
audio waveform, a GC-content track for DNA. A tokenizer that cannot be found or loaded
(a missing codebook, an unregistered kind) is named in the figure instead of failing.

Tokenizers are found from the manifest (:class:`~ulysses_mm.tokenize.table.TokenizerTable`):
the spec file recorded in its config if it is still there and its sha256 matches, else
any ``tokenizers/*.json`` (working directory or this repository) with that sha256, else —
for a spec without a learned artifact — the manifest entry itself, which holds every
parameter.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from ulysses_mm.core import storage
from ulysses_mm.core.errors import RangeError
from ulysses_mm.core.format import (
    SEG_LENGTH,
    SEG_MODALITY,
    SEG_START,
    PackedSample,
    segments_to_ids,
)
from ulysses_mm.core.tokenspace import EOF, TokenSpace, token_modalities
from ulysses_mm.shards.manifest import (
    MANIFEST_NAME,
    READ_TIMEOUTS,
    Manifest,
    read_shard,
    read_verified_shard,
)
from ulysses_mm.shards.reader import read_samples
from ulysses_mm.tokenize.base import Tokenizer
from ulysses_mm.tokenize.table import TokenizerTable

_COLORS = ["tab:green", "tab:orange", "tab:blue", "tab:purple", "tab:red", "tab:brown"]


@dataclass
class Target:
    """What ``inspect`` was pointed at."""

    manifest: Manifest | None
    shard: str | None  # a shard location when a shard was given


def open_target(location: str, storage_options: Mapping[str, Any] | None = None) -> Target:
    """A manifest, a dataset directory, or a shard (whose sibling manifest is used if any)."""
    if location.endswith(".tar"):
        base = location.rsplit("/", 1)[0] if "/" in location else "."
        sibling = storage.join(base, MANIFEST_NAME)
        probe = storage.with_timeouts(sibling, storage_options, *READ_TIMEOUTS)
        manifest = (
            Manifest.load(sibling, storage_options) if storage.exists(sibling, probe) else None
        )
        return Target(manifest, location)
    return Target(Manifest.load(location, storage_options), None)


def load_sample(
    target: Target, k: int, storage_options: Mapping[str, Any] | None = None
) -> tuple[PackedSample, str]:
    """(sample, where) — ``k`` is the global sample index for a manifest, the position
    inside the shard when a shard was given."""
    m = target.manifest
    if target.shard is None:
        assert m is not None
        shard, pos = m.shard_of_sample(k)
        data = read_verified_shard(m, shard)
        where = f"{m.shards[shard].url} #{pos}"
    else:
        name = target.shard.rsplit("/", 1)[-1]
        entry = next((s for s in m.shards if s.url == name), None) if m else None
        if m is not None and entry is not None:
            data = read_verified_shard(m, entry)
        else:
            data = read_shard(target.shard, storage_options)
        pos = k
        where = f"{name} #{pos}"
    samples = read_samples(data, where)
    if not 0 <= pos < len(samples):
        raise RangeError(f"{where}: the shard holds {len(samples)} samples")
    return samples[pos], where


# ------------------------------------------------------------------------- text


def summary_text(m: Manifest) -> str:
    lines = [f"dataset {m.name or '(unnamed)'}: manifest {m.location} (format {m.format_version})"]
    lines.append(f"  {m.token_space.describe()}")
    for mod, e in m.tokenizers.items():
        lines.append(
            f"  tokenizer {mod}: {e.get('name')} (kind {e.get('kind')}, vocab {e.get('vocab_size')}, "
            f"spec sha256 {str(e.get('spec_sha256'))[:12]}…)"
        )
    size = sum(s.bytes for s in m.shards)
    lines.append(
        f"  seq_len {m.seq_len:,} ({m.dtype}); {m.num_samples:,} samples in {len(m.shards)} shards "
        f"({size / 2**20:.2f} MiB); {m.num_documents:,} documents"
    )
    total = max(1, m.num_samples * m.seq_len)
    per = ", ".join(f"{k} {v:,} ({100 * v / total:.1f}%)" for k, v in m.tokens.items())
    lines.append(f"  tokens: {per}; pad {m.pad_tokens:,} ({100 * m.pad_tokens / total:.1f}%)")
    ok = [i for i in m.inputs if i.status == "ok"]
    lines.append(f"  inputs: {len(ok)} ok, {len(m.skipped)} skipped")
    for i in m.skipped:
        lines.append(f"    skipped {i.source}: {i.reason}")
    for s in m.shards[:8]:
        lines.append(
            f"  {s.url}: samples {s.first_sample}..{s.first_sample + s.samples - 1}, "
            f"{s.bytes:,} bytes, sha256 {s.sha256[:16]}…"
        )
    if len(m.shards) > 8:
        lines.append(f"  … and {len(m.shards) - 8} more shards")
    return "\n".join(lines)


def segment_table_text(
    sample: PackedSample, space: TokenSpace | None, where: str = "", max_rows: int = 40
) -> str:
    seg = sample.segments
    n = len(sample.tokens)
    real = sample.real_tokens
    head = (
        f"sample {sample.index} ({where}): {len(seg)} segments, {real:,} tokens, "
        f"{n - real:,} pad, dtype {sample.tokens.dtype}"
    )
    rows = [
        f"{'row':>5} {'start':>9} {'length':>9} {'modality':>9} {'doc_id':>9} {'pos_offset':>11}"
    ]
    shown: list[int] = list(range(len(seg)))
    if len(seg) > max_rows:
        shown = [*range(max_rows // 2), -1, *range(len(seg) - max_rows // 4, len(seg))]
    for i in shown:
        if i < 0:
            rows.append(f"{'…':>5} ({len(seg) - max_rows // 2 - max_rows // 4} rows)")
            continue
        start, length, mod, doc, pos = (int(x) for x in seg[i])
        name = space.modalities[mod] if space and 0 <= mod < len(space.modalities) else str(mod)
        rows.append(f"{i:>5} {start:>9} {length:>9} {name:>9} {doc:>9} {pos:>11}")
    return "\n".join([head, *rows])


# ----------------------------------------------------------------- tokenizers


def find_tokenizer(manifest: Manifest, modality: str) -> Tokenizer:
    """The tokenizer the manifest names for ``modality``; LookupError says why not."""
    table = TokenizerTable.from_manifest(manifest.tokenizers, manifest.config)
    if modality not in table.entries:
        raise LookupError(f"the manifest names no tokenizer for {modality!r}")
    return table.tokenizer(modality)


@dataclass
class Decoded:
    modality: str
    data: Any = None  # str (dna), float waveform (audio), uint8 [t, h, w, 3] (video)
    error: str = ""  # why there is no data
    tokens: int = 0  # tokens handed to the decoder
    rate: float | None = None  # audio samples per second, if the spec says


def modality_tokens(sample: PackedSample, space: TokenSpace) -> dict[str, np.ndarray]:
    """Per modality, the sample's tokens of that modality (specials included) in order.

    Where a stream uses ``<eof>`` (frames), only whole frames are kept: a piece that
    continues a document from the previous sample starts mid-frame and the sample may
    end mid-frame, so tokens before the first and after the last ``<eof>`` of such a
    piece are dropped."""
    n = len(sample.tokens)
    tokens = sample.tokens.astype(np.int64)
    doc, _ = segments_to_ids(sample.segments, n)
    mods = token_modalities(tokens, doc, space)
    out: dict[str, list[np.ndarray]] = {}
    for start, length, _m, _d, pos in sample.segments.tolist():
        t = tokens[start : start + length]
        md = mods[start : start + length]
        for mi in np.unique(md[md >= 0]).tolist():
            run = t[md == mi]
            eofs = np.flatnonzero(run == EOF)
            if len(eofs):
                lo = int(eofs[0]) + 1 if pos > 0 else 0
                run = run[lo : int(eofs[-1]) + 1]
            if len(run):
                out.setdefault(space.modalities[mi], []).append(run)
    return {m: np.concatenate(parts) for m, parts in out.items()}


def decode_sample(manifest: Manifest, sample: PackedSample) -> list[Decoded]:
    """Each modality present in the sample, decoded through its tokenizer (or why not)."""
    space = manifest.token_space
    out = []
    per_modality = modality_tokens(sample, space)
    for modality in [m for m in space.modalities if m in per_modality]:
        toks = per_modality[modality]
        d = Decoded(modality, tokens=len(toks))
        try:
            tok = find_tokenizer(manifest, modality)
        except Exception as e:
            d.error = f"{modality} tokenizer not available: {e}"
            out.append(d)
            continue
        params = tok.spec.params
        rate = params.get("sample_rate", params.get("rate"))
        d.rate = float(rate) if isinstance(rate, (int, float)) else None
        try:
            d.data = tok.decode(toks, space)
        except Exception as e:
            d.error = f"{modality}: cannot decode this sample's tokens: {type(e).__name__}: {e}"
        out.append(d)
    return out


# -------------------------------------------------------------------- figure


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, lengths, values) of runs of equal values."""
    if not len(values):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), values
    edges = np.flatnonzero(np.diff(values)) + 1
    starts = np.concatenate([[0], edges])
    lengths = np.diff(np.concatenate([starts, [len(values)]]))
    return starts, lengths, values[starts]


def _gc_track(seq: str, points: int = 400) -> tuple[np.ndarray, np.ndarray]:
    b = np.frombuffer(seq.upper().encode("ascii", "replace"), dtype=np.uint8)
    acgt = np.isin(b, np.frombuffer(b"ACGTSW", np.uint8))
    gc = np.isin(b, np.frombuffer(b"GCS", np.uint8))
    window = max(len(b) // points, min(100, max(1, len(b) // 10)))
    k = len(b) // window
    if k == 0:
        return np.zeros(0), np.zeros(0)
    gcw = gc[: k * window].reshape(k, window).sum(1)
    nw = acgt[: k * window].reshape(k, window).sum(1)
    frac = np.where(nw > 0, gcw / np.maximum(nw, 1), np.nan)
    return (np.arange(k) + 0.5) * window, frac


def render_png(
    path: str,
    sample: PackedSample,
    space: TokenSpace | None,
    decoded: list[Decoded],
    title: str = "",
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Draw the sample (matplotlib, Agg, no global pyplot state) and write ``path``
    atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    names = (
        list(space.modalities)
        if space
        else sorted({str(m) for m in sample.segments[:, SEG_MODALITY]})
    )
    color = {i: _COLORS[i % len(_COLORS)] for i in range(len(names))}
    n = len(sample.tokens)
    panels = max(1, len(decoded))
    fig = Figure(figsize=(12, 2.2 + 2.6 * panels), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1 + panels, 1, height_ratios=[0.8] + [2.0] * panels)

    ax = fig.add_subplot(grid[0])
    seg = sample.segments
    for i in range(len(names)):
        rows = seg[seg[:, SEG_MODALITY] == i]
        if len(rows):
            ax.broken_barh(
                list(zip(rows[:, SEG_START].tolist(), rows[:, SEG_LENGTH].tolist())),
                (1.05, 0.8),
                color=color[i],
            )
    if len(seg) <= 300:
        for s in seg[1:, SEG_START]:
            ax.axvline(int(s), ymin=0.5, ymax=1.0, color="k", lw=0.6)
    if space is not None:
        doc, _ = segments_to_ids(seg, n)
        mods = token_modalities(sample.tokens.astype(np.int64), doc, space)
        starts, lengths, vals = _runs(mods)
        for i in range(len(names)):
            sel = vals == i
            if sel.any():
                ax.broken_barh(
                    list(zip(starts[sel].tolist(), lengths[sel].tolist())),
                    (0.05, 0.8),
                    color=color[i],
                )
    real = sample.real_tokens
    if real < n:
        ax.broken_barh([(real, n - real)], (0.05, 1.8), color="lightgrey", hatch="//")
    ax.set_xlim(0, n)
    ax.set_ylim(0, 1.9)
    ax.set_yticks([0.45, 1.45], ["tokens", "documents"])
    ax.set_xlabel("token position in the sample")
    handles = [Patch(color=color[i], label=name) for i, name in enumerate(names)]
    handles.append(Patch(facecolor="lightgrey", hatch="//", label="<pad>"))
    ax.legend(handles=handles, loc="upper right", ncols=len(handles), fontsize=8)
    ax.set_title(title or f"sample {sample.index}: {len(seg)} segments, {real:,}/{n:,} tokens")

    if not decoded:
        ax2 = fig.add_subplot(grid[1])
        ax2.axis("off")
        ax2.text(0.5, 0.5, "no manifest / nothing to decode", ha="center", va="center")
    for p, d in enumerate(decoded, start=1):
        _draw_decoded(fig, grid[p], d)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    storage.atomic_write(path, buf.getvalue(), storage_options)


def _draw_decoded(fig: Any, cell: Any, d: Decoded) -> None:
    if d.error or d.data is None:
        ax = fig.add_subplot(cell)
        ax.axis("off")
        ax.text(
            0.5,
            0.5,
            d.error or f"{d.modality}: decoder returned nothing",
            ha="center",
            va="center",
            wrap=True,
            color="darkred",
        )
        ax.set_title(f"{d.modality} ({d.tokens:,} tokens)")
        return
    data = d.data
    if isinstance(data, str):
        ax = fig.add_subplot(cell)
        x, gc = _gc_track(data)
        ax.plot(x, gc, lw=1, color="tab:green")
        ax.set_ylim(0, 1)
        ax.set_xlim(0, max(1, len(data)))
        ax.set_xlabel("base (this sample's DNA, documents concatenated)")
        ax.set_ylabel("GC fraction")
        ax.set_title(
            f"{d.modality}: {len(data):,} bases, GC {np.nanmean(gc) if len(gc) else float('nan'):.3f}"
        )
        return
    arr = np.asarray(data)
    if arr.ndim == 4 and arr.shape[-1] == 3:
        frames = arr.shape[0]
        show = min(frames, 8)
        sub = cell.subgridspec(1, max(1, show))
        idx: list[int] = (
            np.linspace(0, frames - 1, show).round().astype(int).tolist() if frames else []
        )
        for j, f in enumerate(idx):
            ax = fig.add_subplot(sub[0, j])
            ax.imshow(arr[f].astype(np.uint8))
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"frame {f}", fontsize=8)
        if not frames:
            ax = fig.add_subplot(sub[0, 0])
            ax.axis("off")
            ax.text(0.5, 0.5, f"{d.modality}: no whole frame in this sample", ha="center")
        return
    if arr.ndim >= 1 and arr.dtype.kind == "f":
        wave = arr.reshape(arr.shape[0], -1)[:, 0] if arr.ndim > 1 else arr
        ax = fig.add_subplot(cell)
        x = np.arange(len(wave)) / d.rate if d.rate else np.arange(len(wave))
        step = max(1, len(wave) // 20000)
        ax.plot(x[::step], wave[::step], lw=0.5, color="tab:orange")
        ax.set_xlabel("seconds" if d.rate else "sample")
        ax.set_title(f"{d.modality}: waveform, {len(wave):,} samples")
        return
    ax = fig.add_subplot(cell)
    ax.axis("off")
    ax.text(
        0.5,
        0.5,
        f"{d.modality}: decoded to {type(data).__name__} {getattr(arr, 'shape', '')}, no plot for it",
        ha="center",
    )


# ------------------------------------------------------------------------ entry


def run_inspect(
    location: str,
    sample: int = 0,
    png: str | None = None,
    out: TextIO | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> int:
    out = out or sys.stdout
    target = open_target(location, storage_options)
    m = target.manifest
    if m is not None:
        print(summary_text(m), file=out)
    else:
        print(
            f"shard {location}: no {MANIFEST_NAME} beside it; modalities shown as indices", file=out
        )
    s, where = load_sample(target, sample, storage_options)
    space = m.token_space if m else None
    print(segment_table_text(s, space, where), file=out)
    if png:
        decoded = decode_sample(m, s) if m else []
        for d in decoded:
            if d.error:
                print(f"  note: {d.error}", file=out)
        render_png(png, s, space, decoded, storage_options=storage_options)
        print(f"wrote {png}", file=out)
    return 0


__all__ = [
    "Decoded",
    "Target",
    "decode_sample",
    "find_tokenizer",
    "load_sample",
    "modality_tokens",
    "open_target",
    "render_png",
    "run_inspect",
    "segment_table_text",
    "summary_text",
]
