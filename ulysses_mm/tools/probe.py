"""``ulysses-mm probe``: a dataset whose answer needs distant context, and its score.

Each document is L random bases followed by the same L bases again (and one ``N``, so a
document is ``<doc> <|dna|>`` + 2L + 1 bases + ``</doc>`` = 2L + 4 tokens: exactly one
packed sample). The first half cannot be predicted: 2 bits per base is the best any
model does. The second half is a copy of bases L positions back: a model that uses its
context predicts it at ~0 bits per base. Trained with sequence parallelism over P ranks,
each sample is split into P pieces, so at P = 2 every base of the second half is on the
other rank from its source: the loss falling there shows the model learning across ranks.
L is a parameter: a cluster run probes 1M tokens of context with ``--length 524286``.

``probe write`` writes the FASTA inputs (biopython) and prepares them with
``pipelines/dna.yaml`` (``tokenizers/dna-base.json``) into a training and a held-out
dataset (other random bases), ``--pack K`` documents to a sample (``pack.seq_len`` =
K·(2L + 4); 1 by default), so a staged run can cut windows of any multiple of 2L + 4 out
of them. ``--eval-lengths L1,L2,…`` writes one more held-out dataset per other length,
``eval-L<Li>/``, packed the same way: copies from further back (or nearer) than the model
was trained on.

``probe score RUN MANIFEST`` evaluates a checkpoint on a held-out dataset
(:mod:`ulysses_mm.tools.evaluate`, bins that are the two halves) and prints bits per base
of each. A held-out dataset is scored at the length of its documents, read from its
manifest (every document 2L + 4 tokens, the samples a multiple of that); ``--length L``
says which length is meant and is refused in one line on documents of another. It is
evaluated on windows of 2L + 4 tokens, one document each (``evaluate --seq-len``), so the
layout (the run's, or ``--sp N``) only has to divide 2L + 4, however long the samples: to
see a model trained at L score at 2L, write ``--eval-lengths 2L`` and score
``eval-L<2L>/``. Attention never crosses documents, so a document scores the same alone in
a sample as packed with others.
"""

from __future__ import annotations

import io
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from ulysses_mm.config.parse import option, positional
from ulysses_mm.core.checks import MAX_PROCESSES, MAX_SEED, MAX_TOKENS
from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.core.resources import resource
from ulysses_mm.core.storage import atomic_local_file
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare
from ulysses_mm.tools.evaluate import EvaluateOptions, evaluate_checkpoint
from ulysses_mm.train.metrics import LN2

PIPELINE = resource("pipelines/dna.yaml")
HEADER = 2  # <doc> <|dna|>: the first base is at position 2


@dataclass
class ProbeData:
    train: Path  # manifest.json
    eval: Path  # held out, at ``length``
    length: int
    evals: dict[int, Path] = field(default_factory=dict)  # held out, by length (``length``'s too)
    pack: int = 1  # documents per sample

    @property
    def seq_len(self) -> int:
        return self.pack * document_tokens(self.length)


def document_tokens(length: int) -> int:
    """Tokens of a copy document of halves of ``length`` bases: 2L + 4."""
    return 2 * length + 4


def halves(length: int) -> list[int]:
    """Position bin edges of the two halves: [2, L + 2) and [L + 2, 2L + 2)."""
    return [HEADER, HEADER + length, HEADER + 2 * length]


# Bases drawn, translated and written at a time: a few MiB whatever L is.
CHUNK_BASES = 1 << 20
LINE = 60  # bases per FASTA line


def write_fasta(path: Path, length: int, documents: int, seed: int) -> Path:
    """``documents`` records of ``length`` random bases, the same bases again and an ``N``,
    in lines of :data:`LINE`, written through a temporary sibling renamed at the end (a
    failed run leaves no file). Streamed in chunks of :data:`CHUNK_BASES`: the copy is
    drawn again from the generator's saved state, never held, so memory does not grow
    with L."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"ACGT", dtype=np.uint8)

    with atomic_local_file(path) as f:
        out = _Lines(f)
        for i in range(documents):
            f.write(f">probe{i} L={length}\n".encode())
            state = rng.bit_generator.state
            for copy in (False, True):
                if copy:
                    rng.bit_generator.state = state  # the same draws: the same bases
                for start in range(0, length, CHUNK_BASES):
                    n = min(CHUNK_BASES, length - start)
                    out.write(letters[rng.integers(0, 4, n)])
            out.write(np.frombuffer(b"N", dtype=np.uint8))
            out.end()
    return path


class _Lines:
    """Bases written to ``f`` in lines of :data:`LINE`, across the chunks they come in."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.carry = np.empty(0, dtype=np.uint8)

    def write(self, bases: np.ndarray) -> None:
        data = np.concatenate([self.carry, bases]) if self.carry.size else bases
        full = data.size // LINE * LINE
        if full:
            rows = data[:full].reshape(-1, LINE)
            newline = np.full((rows.shape[0], 1), ord("\n"), dtype=np.uint8)
            self.f.write(np.hstack([rows, newline]).tobytes())
        self.carry = data[full:].copy()

    def end(self) -> None:
        if self.carry.size:
            self.f.write(self.carry.tobytes() + b"\n")
        self.carry = np.empty(0, dtype=np.uint8)


def write_probe(
    out: str | Path,
    length: int,
    documents: int,
    eval_documents: int,
    seed: int = 0,
    eval_lengths: list[int] | None = None,
    pack: int = 1,
) -> ProbeData:
    """The training set at ``length`` and a held-out set at ``length`` and at each of
    ``eval_lengths``, ``pack`` documents to a sample. A run that fails removes what it
    made (files are written under temporary names and renamed when whole)."""
    lengths = sorted({length, *(eval_lengths or [])})
    if lengths[0] < 1:
        raise ConfigError(f"--length and --eval-lengths must be >= 1, got {lengths[0]}")
    if documents < 1 or eval_documents < 1:
        raise ConfigError("--documents and --eval-documents must be >= 1")
    if pack < 1:
        raise ConfigError(f"--pack must be >= 1, got {pack}")
    out = Path(out)
    sets = [("train", length, documents, seed)]
    sets += [
        ("eval" if n == length else f"eval-L{n}", n, eval_documents, seed + 1) for n in lengths
    ]
    made = [p for p in (out, out / "src", *(out / name for name, *_ in sets)) if not p.exists()]
    made += [
        out / "src" / f"{name}.fa" for name, *_ in sets if not (out / "src" / f"{name}.fa").exists()
    ]
    try:
        manifests = {name: _write_set(out, name, n, count, s, pack) for name, n, count, s in sets}
    except BaseException:  # a failed run leaves nothing of its own: what it made goes
        for p in reversed(made):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        raise
    evals = {n: manifests["eval" if n == length else f"eval-L{n}"] for n in lengths}
    return ProbeData(manifests["train"], manifests["eval"], length, evals, pack)


def _write_set(out: Path, name: str, n: int, count: int, seed: int, pack: int) -> Path:
    """One probe dataset, ``out/name/manifest.json``, from its FASTA ``out/src/name.fa``."""

    fasta = write_fasta(out / "src" / f"{name}.fa", n, count, seed)
    cfg = load_pipeline_config(
        PIPELINE,
        [
            f"name=probe-{name}-L{n}",
            f"sources=[{fasta}]",
            f"output={out / name}",
            f"pack.seq_len={pack * document_tokens(n)}",
            "progress=false",
        ],
    )
    prepare(cfg, out=io.StringIO())
    m = Manifest.load(str(out / name / "manifest.json"))
    if m.num_samples != -(-count // pack) or m.num_documents != count:
        raise DataError(f"{m.location}: expected {pack} documents per sample")
    return out / name / "manifest.json"


def copy_length(manifest: Manifest) -> int:
    """L of a probe dataset's documents (each 2L + 4 tokens, a whole number of them to a
    sample), from its manifest."""
    docs, tokens = manifest.num_documents, sum(manifest.tokens.values())
    per = tokens // docs if docs else 0
    if per < 6 or per % 2 or per * docs != tokens or manifest.seq_len % per:
        raise DataError(
            f"{manifest.location}: not a probe dataset ({docs} documents of {tokens} tokens "
            f"in samples of {manifest.seq_len}; a probe's are 2L + 4 tokens each, a whole "
            "number of them to a sample)"
        )
    length = (per - 4) // 2
    named = re.fullmatch(r"probe-.+-L(\d+)", manifest.name or "")
    other = sorted(m for m, n in manifest.tokens.items() if n and m != "dna")
    if named is None or int(named.group(1)) != length or other:
        raise DataError(
            f"{manifest.location}: not a probe dataset (named {manifest.name or 'nothing'!r}, "
            f"{', '.join(other) or 'dna'} tokens; `ulysses-mm probe write` names its "
            "datasets probe-<set>-L<n> and writes DNA copy documents of 2L + 4 tokens)"
        )
    return length


def score(
    checkpoint: str, manifest: str, nproc: int | None = None, length: int = 0, sp: int = 0
) -> tuple[float, float]:
    """(bits per base of the first half, of the second) on a probe dataset, scored on
    windows of one document each; ``length`` > 0: the documents' L it expects; ``sp`` > 0:
    that many Ulysses ranks instead of the run's layout."""

    held = copy_length(Manifest.load(manifest))
    if length and length != held:
        raise DataError(
            f"{manifest} holds copy documents of L={held}, not L={length}: write held-out "
            f"documents of that length with `ulysses-mm probe write OUT --length L "
            f"--eval-lengths {length}`"
        )
    opts = EvaluateOptions(nproc=nproc, edges=halves(held), seq_len=document_tokens(held), sp=sp)
    r = evaluate_checkpoint(checkpoint, manifest, opts)
    rows = r.bins.get("dna", [])
    if len(rows) != 2:
        raise DataError(f"{manifest}: no targets in one of the halves")
    return rows[0][2] / LN2, rows[1][2] / LN2


@dataclass
class ProbeWrite:
    """``ulysses-mm probe write``: DNA documents of L random bases followed by the same L
    bases (and one N), 2L+4 tokens, one (or --pack K) per packed sample, prepared into a
    training and a held-out dataset (and one held-out dataset per --eval-lengths)."""

    out: str = positional("output directory (train/, eval/, src/)", "out_dir")
    length: int = option("bases per half", ge=1, le=MAX_TOKENS, metavar="L")
    documents: int = option("training documents", 2048, ge=1, le=10**7)
    eval_documents: int = option("held-out documents", 64, ge=1, le=10**7)
    seed: int = option("seed of the bases (held out: seed+1)", 0, ge=0, le=MAX_SEED)
    eval_lengths: list[int] | None = option(
        "also write held-out documents of these lengths, one dataset each (eval-L<n>/)", None,
        ge=1, le=MAX_TOKENS, metavar="L1,L2,...",
    )  # fmt: skip
    pack: int = option(
        "documents per packed sample, K·(2L+4) tokens, in every dataset", 1, ge=1, le=10**6,
        metavar="K",
    )  # fmt: skip

    def main(self) -> int:
        d = write_probe(
            self.out, self.length, self.documents, self.eval_documents, self.seed,
            self.eval_lengths, self.pack,
        )  # fmt: skip
        edges = ",".join(str(e) for e in halves(d.length))
        each = "one document" if d.pack == 1 else f"{d.pack} documents"
        held = "".join(f"\n  held out, L={n:,}: {p}" for n, p in d.evals.items() if n != d.length)
        print(
            f"wrote the probe of L={d.length:,} ({d.seq_len:,}-token samples, {each} each):\n"
            f"  train: {d.train}\n  held out: {d.eval}{held}\n"
            f"train on it: ulysses-mm train CONFIG data.train={d.train} parallel.sp=P\n"
            f"then: ulysses-mm probe score RUN_DIR {d.eval}   (or ulysses-mm evaluate "
            f"RUN_DIR {d.eval} --seq-len {2 * d.length + 4} --edges {edges})"
        )
        return 0


@dataclass
class ProbeScore:
    """``ulysses-mm probe score``: bits per base of each half on a held-out probe dataset,
    on windows of one document (the first stays at 2, the second falls to 0 once the model
    copies from L back)."""

    checkpoint: str = positional("a run dir, its checkpoints/ dir or a step_* dir", "in_dir")
    manifest: str = positional("the probe's held-out manifest.json", "in_path")
    nproc: int | None = option("processes (default: the sp)", None, ge=1, le=MAX_PROCESSES)
    length: int = option(
        "the L of the documents to score, on windows of 2L+4 tokens, one document each (0: "
        "the manifest's; refused if its documents have another)", 0, ge=0, le=MAX_TOKENS,
        metavar="L",
    )  # fmt: skip
    sp: int = option(
        "N Ulysses ranks instead of the run's layout (0: the run's parallel.sp)", 0,
        ge=0, le=MAX_PROCESSES, metavar="N",
    )  # fmt: skip

    def main(self) -> int:
        first, second = score(self.checkpoint, self.manifest, self.nproc, self.length, self.sp)
        print(
            f"first half: {first:.4f} bits/base (unpredictable: 2 at best)\n"
            f"second half: {second:.4f} bits/base (a copy from L bases back: 0 once the "
            "model uses its context)"
        )
        return 0
