"""``ulysses-mm inspect``: what is in a dataset, and what one packed sample looks like.

Given a manifest (or a dataset directory, or one shard), prints the manifest summary and
one sample's segment table; with ``--png`` renders the sample: a modality ribbon along
the sequence (per document and per token), then for each modality present the data
decoded back through the tokenizers the manifest names, each drawn by its kind
(:meth:`Tokenizer.picture <ulysses_mm.tokenize.base.Tokenizer.picture>`): a strip of
video frames, the audio waveform, a GC-content track for DNA, an excerpt of a text. A tokenizer that cannot be found or loaded
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
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from ulysses_mm.config.parse import option, positional
from ulysses_mm.core import storage
from ulysses_mm.core.checks import INT64_SAFE
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
    shard: storage.Location | None  # a shard location when a shard was given


def open_target(where: storage.Location | str) -> Target:
    """A manifest, a dataset directory, or a shard (whose sibling manifest is used if any)."""
    where = storage.as_location(where)
    location = where.url
    if location.endswith(".tar"):
        base = location.rsplit("/", 1)[0] if "/" in location else "."
        sibling = where.at(storage.join(base, MANIFEST_NAME))
        probe = sibling.with_timeouts(READ_TIMEOUTS)
        manifest = Manifest.load(sibling) if probe.exists() else None
        return Target(manifest, where)
    return Target(Manifest.load(where), None)


def load_sample(target: Target, k: int) -> tuple[PackedSample, str]:
    """(sample, where) — ``k`` is the global sample index for a manifest, the position
    inside the shard when a shard was given."""
    m = target.manifest
    if target.shard is None:
        assert m is not None
        shard, pos = m.shard_of_sample(k)
        data = read_verified_shard(m, shard)
        where = f"{m.shards[shard].url} #{pos}"
    else:
        name = target.shard.name
        given = target.shard.url
        shards = m.shards if m is not None else []
        entry = next((s for s in shards if given == s.url or given.endswith("/" + s.url)), None)
        if m is not None and entry is not None:
            data = read_verified_shard(m, entry)
        else:
            data = read_shard(target.shard)
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
    tokenizer: Tokenizer | None = None  # what decoded it (and draws it)


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
            ids = t[md == mi]
            eofs = np.flatnonzero(ids == EOF)
            if len(eofs):
                lo = int(eofs[0]) + 1 if pos > 0 else 0
                ids = ids[lo : int(eofs[-1]) + 1]
            if len(ids):
                out.setdefault(space.modalities[mi], []).append(ids)
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
        d.tokenizer = tok
        try:
            d.data = tok.decode(toks, space)
        except Exception as e:
            d.error = f"{modality}: cannot decode this sample's tokens: {type(e).__name__}: {e}"
        out.append(d)
    return out


# -------------------------------------------------------------------- figure


def _spans(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, lengths, values) of the spans of equal values."""
    if not len(values):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), values
    edges = np.flatnonzero(np.diff(values)) + 1
    starts = np.concatenate([[0], edges])
    lengths = np.diff(np.concatenate([starts, [len(values)]]))
    return starts, lengths, values[starts]


def render_png(
    path: storage.Location | str,
    sample: PackedSample,
    space: TokenSpace | None,
    decoded: list[Decoded],
    title: str = "",
) -> None:
    """Draw the sample (matplotlib, Agg, no global pyplot state) and write ``path``
    atomically."""
    from matplotlib.backends.backend_agg import (
        FigureCanvasAgg,  # lazy: matplotlib; the shards layer imports none
    )
    from matplotlib.figure import Figure  # lazy: matplotlib; the shards layer imports none
    from matplotlib.patches import Patch  # lazy: matplotlib; the shards layer imports none

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
        starts, lengths, vals = _spans(mods)
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
    storage.as_location(path).atomic_write(buf.getvalue())


def _draw_decoded(fig: Any, cell: Any, d: Decoded) -> None:
    """One modality's panel: what its tokenizer draws of the decoded data, or why not."""
    if d.error or d.data is None or d.tokenizer is None:
        why = "no tokenizer to draw it" if d.data is not None else "decoder returned nothing"
        ax = fig.add_subplot(cell)
        ax.axis("off")
        ax.text(
            0.5,
            0.5,
            d.error or f"{d.modality}: {why}",
            ha="center",
            va="center",
            wrap=True,
            color="darkred",
        )
        ax.set_title(f"{d.modality} ({d.tokens:,} tokens)")
        return
    d.tokenizer.picture(fig, cell, d.data, d.modality)


# ------------------------------------------------------------------------ entry


def inspect_dataset(
    where: storage.Location | str,
    sample: int = 0,
    png: str | None = None,
    out: TextIO | None = None,
) -> int:
    out = out or sys.stdout
    where = storage.as_location(where)
    location = where.url
    target = open_target(where)
    m = target.manifest
    if m is not None:
        print(summary_text(m), file=out)
    else:
        print(
            f"shard {location}: no {MANIFEST_NAME} beside it; modalities shown as indices", file=out
        )
    s, at = load_sample(target, sample)
    space = m.token_space if m else None
    print(segment_table_text(s, space, at), file=out)
    if png:
        decoded = decode_sample(m, s) if m else []
        for d in decoded:
            if d.error:
                print(f"  note: {d.error}", file=out)
        render_png(where.at(png), s, space, decoded)
        print(f"wrote {png}", file=out)
    return 0


__all__ = [
    "Decoded",
    "Target",
    "decode_sample",
    "find_tokenizer",
    "inspect_dataset",
    "load_sample",
    "modality_tokens",
    "open_target",
    "render_png",
    "segment_table_text",
    "summary_text",
]


@dataclass
class Inspect:
    """``ulysses-mm inspect``: print the manifest summary (token space, tokenizers, counts,
    skipped inputs, shards) and the segment table of one packed sample. With --png, render
    the sample: a modality ribbon, then video frames, audio waveform and DNA GC content
    decoded through the tokenizers the manifest names."""

    target: str = positional(
        "manifest.json, a dataset directory, or one shard .tar (path or fsspec URL)", "in_path"
    )
    sample: int = option(
        "sample to show: global index for a manifest/directory, position inside the shard "
        "for a .tar", 0, ge=0, le=INT64_SAFE,
    )  # fmt: skip
    png: str | None = option(
        "also render the sample to FILE", None, path="out_file", metavar="FILE"
    )
    storage_options: dict | None = option(
        'fsspec options for a remote target, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
        None, metavar="JSON",
    )  # fmt: skip

    def main(self) -> int:
        where = storage.Location(self.target, self.storage_options or {})
        return inspect_dataset(where, sample=self.sample, png=self.png)
