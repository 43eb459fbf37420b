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
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from ulysses_mm.config.parse import option, positional
from ulysses_mm.core.checks import MAX_PROCESSES, MAX_SEED, MAX_TOKENS
from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.core.format import PackedSample
from ulysses_mm.core.resources import resource
from ulysses_mm.core.storage import atomic_local_file, atomic_write_local
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare
from ulysses_mm.tools import recall
from ulysses_mm.tools.evaluate import EvaluateOptions, evaluate_checkpoint
from ulysses_mm.train.metrics import LN2

PIPELINE = resource("pipelines/dna.yaml")
TEXT_TOKENIZER = resource("tokenizers/text-bytes.json")  # recall in text: a token a byte
HEADER = 2  # <doc> <|dna|>: the first base is at position 2


TASKS = ("copy", "recall")


@dataclass
class ProbeData:
    train: Path  # manifest.json
    eval: Path  # held out, at ``length``
    length: int
    evals: dict[int, Path] = field(default_factory=dict)  # held out, by length (``length``'s too)
    pack: int = 1  # documents per sample
    task: str = "copy"

    @property
    def seq_len(self) -> int:
        return self.pack * document_length(self.task, self.length)


def document_length(task: str, length: int) -> int:
    """Tokens of one document: a copy document of halves of L bases is 2L + 4 tokens, a
    recall document L."""
    return document_tokens(length) if task == "copy" else length


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
    task: str = "copy",
    pairs: int = recall.DEFAULT_PAIRS,
    modality: str = "dna",
) -> ProbeData:
    """The training set at ``length`` and a held-out set at ``length`` and at each of
    ``eval_lengths``, ``pack`` documents to a sample, of ``task``'s documents (copy: L
    bases twice; recall: L tokens of ``modality`` with ``pairs`` keys asked for again,
    :mod:`ulysses_mm.tools.recall`). A run that fails removes what it made (files are
    written under temporary names and renamed when whole)."""
    lengths = sorted({length, *(eval_lengths or [])})
    if task not in TASKS:
        raise ConfigError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if lengths[0] < 1:
        raise ConfigError(f"--length and --eval-lengths must be >= 1, got {lengths[0]}")
    if modality not in recall.MODALITIES:
        raise ConfigError(
            f"--modality must be one of {', '.join(recall.MODALITIES)}, got {modality!r}"
        )
    if task == "copy" and modality != "dna":
        raise ConfigError(f"--modality {modality}: the copy probe is DNA; use --task recall")
    if task == "recall":
        recall.check_recall(lengths[0], pairs)
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
    suffix = ".jsonl" if modality == "text" else ".fa"
    made += [p for name, *_ in sets if not (p := out / "src" / f"{name}{suffix}").exists()]
    try:
        manifests = {
            name: _write_set(out, name, n, count, s, pack, task, pairs, modality)
            for name, n, count, s in sets
        }
    except BaseException:  # a failed run leaves nothing of its own: what it made goes
        for p in reversed(made):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        raise
    evals = {n: manifests["eval" if n == length else f"eval-L{n}"] for n in lengths}
    return ProbeData(manifests["train"], manifests["eval"], length, evals, pack, task)


def _write_set(
    out: Path,
    name: str,
    n: int,
    count: int,
    seed: int,
    pack: int,
    task: str,
    pairs: int,
    modality: str = "dna",
) -> Path:
    """One probe dataset, ``out/name/manifest.json``, from its source ``out/src/name.fa``
    (text: ``name.jsonl``) and, for recall, its answers read back from the shards
    (``answers.npz``)."""

    if task == "copy":
        source = write_fasta(out / "src" / f"{name}.fa", n, count, seed)
    else:
        suffix = ".jsonl" if modality == "text" else ".fa"
        source = recall.write_recall_source(
            out / "src" / f"{name}{suffix}", n, count, pairs, seed, modality
        )
    overrides = [f"tokenizers=[{TEXT_TOKENIZER}]"] if modality == "text" else []
    cfg = load_pipeline_config(
        PIPELINE,
        [
            f"name={'probe' if task == 'copy' else 'recall'}-{name}-L{n}",
            f"sources=[{source}]",
            f"output={out / name}",
            f"pack.seq_len={pack * document_length(task, n)}",
            "progress=false",
            *overrides,
        ],
    )
    prepare(cfg, out=io.StringIO())
    m = Manifest.load(str(out / name / "manifest.json"))
    if m.num_samples != -(-count // pack) or m.num_documents != count:
        raise DataError(f"{m.location}: expected {pack} documents per sample")
    if task == "recall":
        found = recall.collect_answers(_all_samples(m), recall.key_ids(m))
        atomic_write_local(out / name / recall.ANSWERS_FILE, found.to_bytes())
    return out / name / "manifest.json"


def _all_samples(m: Manifest) -> list[PackedSample]:
    """Every sample of ``m`` in its stored order."""
    stream = ShardStream(m, 0, 1, 1, StreamOptions().in_order())
    try:
        return [s for _ in range(m.num_samples) for s in stream.next_batch()]
    finally:
        stream.close()


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


def recall_length(manifest: Manifest) -> int:
    """L of a recall dataset's documents (each L tokens, a whole number to a sample)."""
    docs, tokens = manifest.num_documents, sum(manifest.tokens.values())
    per = tokens // docs if docs else 0
    named = re.fullmatch(r"recall-.+-L(\d+)", manifest.name or "")
    if (
        not per
        or per * docs != tokens
        or manifest.seq_len % per
        or named is None
        or (int(named.group(1)) != per)
    ):
        raise DataError(
            f"{manifest.location}: not a recall probe dataset ({docs} documents of {tokens} "
            f"tokens in samples of {manifest.seq_len}, named {manifest.name or 'nothing'!r}; "
            "`ulysses-mm probe write --task recall` names its datasets recall-<set>-L<n>)"
        )
    return per


def score_recall(
    checkpoint: str,
    manifest: str,
    nproc: int | None = None,
    length: int = 0,
    sp: int = 0,
    rope: str = "",
) -> dict[str, Any]:
    """Exact-answer accuracy and bits per answer by distance bucket on a recall dataset
    (:func:`ulysses_mm.tools.recall.recall_figures`), scored on windows of one document
    each; ``rope``: ``KEY=VALUE,...`` over the checkpoint's RoPE."""
    held = recall_length(Manifest.load(manifest))
    if length and length != held:
        raise DataError(
            f"{manifest} holds recall documents of {held} tokens, not {length}: write held-out "
            f"documents of that length with `ulysses-mm probe write OUT --task recall "
            f"--length L --eval-lengths {length}`"
        )
    opts = EvaluateOptions(nproc=nproc, seq_len=held, sp=sp, rope=rope)
    r = evaluate_checkpoint(checkpoint, manifest, opts)
    modality = recall.modality_of(Manifest.load(manifest))
    rows, hits = r.bins.get(modality, []), r.hits.get(modality, [])
    if not rows:
        raise DataError(f"{manifest}: no answers in its documents")
    return {
        "length": held,
        "modality": modality,
        "rope": rope,
        **recall.recall_figures(rows, hits),
    }


def plot_recall(figures: dict[str, Any], png: str | Path, title: str) -> Path:
    """Exact-answer accuracy against distance (log x), one point per bucket."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: heavy (matplotlib)
    from matplotlib.figure import Figure  # lazy: heavy (matplotlib)

    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    b = figures["buckets"]
    ax.plot([x["hi"] - 1 for x in b], [x["accuracy"] for x in b], "o-", ms=4)
    ax.axhline(0.25, color="0.6", ls=":", label="a guess (one of 4 bases)")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("distance from the key to its question (tokens, bucket's top)")
    ax.set_ylabel("exact-answer accuracy")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_local(Path(png), buf.getvalue())
    return Path(png)


def score(
    checkpoint: str,
    manifest: str,
    nproc: int | None = None,
    length: int = 0,
    sp: int = 0,
    rope: str = "",
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
    opts = EvaluateOptions(
        nproc=nproc, edges=halves(held), seq_len=document_tokens(held), sp=sp, rope=rope
    )
    r = evaluate_checkpoint(checkpoint, manifest, opts)
    rows = r.bins.get("dna", [])
    if len(rows) != 2:
        raise DataError(f"{manifest}: no targets in one of the halves")
    return rows[0][2] / LN2, rows[1][2] / LN2


@dataclass
class ProbeWrite:
    """``ulysses-mm probe write``: probe documents prepared into a training and a held-out
    dataset (and one held-out dataset per --eval-lengths). --task copy: L random bases
    followed by the same L bases (and one N), 2L+4 tokens; --task recall: documents of L
    tokens (DNA, or text with --modality text) in which --pairs keys are planted with a
    value and asked for again at distances spread from 4 tokens to L. One document (or
    --pack K) per packed sample."""

    out: str = positional("output directory (train/, eval/, src/)", "out_dir")
    length: int = option(
        "copy: bases per half; recall: tokens per document", ge=1, le=MAX_TOKENS, metavar="L"
    )
    task: str = option(
        "copy (the second half repeats the first) or recall (keys asked for again at every "
        "distance)", "copy", choices=TASKS,
    )  # fmt: skip
    pairs: int = option(
        "recall: keys planted and asked for in each document", recall.DEFAULT_PAIRS,
        ge=1, le=recall.MAX_PAIRS,
    )  # fmt: skip
    modality: str = option(
        "recall: dna (filler N, keys a c g t n, values A C G T) or text (bytes: filler '.', "
        "keys # $ % & @, values 0-9)", "dna", choices=recall.MODALITIES,
    )  # fmt: skip
    documents: int = option("training documents", 2048, ge=1, le=10**7)
    eval_documents: int = option("held-out documents", 64, ge=1, le=10**7)
    seed: int = option("seed of the documents (held out: seed+1)", 0, ge=0, le=MAX_SEED)
    eval_lengths: list[int] | None = option(
        "also write held-out documents of these lengths, one dataset each (eval-L<n>/)", None,
        ge=1, le=MAX_TOKENS, metavar="L1,L2,...",
    )  # fmt: skip
    pack: int = option(
        "documents per packed sample (K documents' tokens), in every dataset", 1, ge=1,
        le=10**6, metavar="K",
    )  # fmt: skip

    def main(self) -> int:
        d = write_probe(
            self.out, self.length, self.documents, self.eval_documents, self.seed,
            self.eval_lengths, self.pack, self.task, self.pairs, self.modality,
        )  # fmt: skip
        each = "one document" if d.pack == 1 else f"{d.pack} documents"
        held = "".join(f"\n  held out, L={n:,}: {p}" for n, p in d.evals.items() if n != d.length)
        if d.task == "copy":
            edges = ",".join(str(e) for e in halves(d.length))
            also = (
                f"(or ulysses-mm evaluate RUN_DIR {d.eval} --seq-len {2 * d.length + 4} "
                f"--edges {edges})"
            )
        else:
            also = f"(or ulysses-mm evaluate RUN_DIR {d.eval} --seq-len {d.length})"
        print(
            f"wrote the {d.task} probe of L={d.length:,} ({d.seq_len:,}-token samples, {each} "
            f"each):\n  train: {d.train}\n  held out: {d.eval}{held}\n"
            f"train on it: ulysses-mm train CONFIG data.train={d.train} parallel.sp=P\n"
            f"then: ulysses-mm probe score RUN_DIR {d.eval}   {also}"
        )
        return 0


@dataclass
class ProbeScore:
    """``ulysses-mm probe score``: on a held-out probe dataset, scored on windows of one
    document. Copy: bits per base of each half (the first stays at 2, the second falls to
    0 once the model copies from L back). Recall: exact-answer accuracy and bits per answer
    by distance bucket."""

    checkpoint: str = positional("a run dir, its checkpoints/ dir or a step_* dir", "in_dir")
    manifest: str = positional("the probe's held-out manifest.json", "in_path")
    nproc: int | None = option("processes (default: the sp)", None, ge=1, le=MAX_PROCESSES)
    length: int = option(
        "the L of the documents to score (0: the manifest's; refused if its documents have "
        "another)", 0, ge=0, le=MAX_TOKENS, metavar="L",
    )  # fmt: skip
    sp: int = option(
        "N Ulysses ranks instead of the run's layout (0: the run's parallel.sp)", 0,
        ge=0, le=MAX_PROCESSES, metavar="N",
    )  # fmt: skip
    rope: str = option(
        "score with this RoPE instead of the checkpoint's, as model.rope keys, e.g. "
        "kind=linear,factor=4", "", metavar="KEY=VALUE,...",
    )  # fmt: skip
    json: str | None = option("recall: also write every figure here", None, path="out_file")
    png: str | None = option(
        "recall: draw accuracy against distance here", None, path="out_file"
    )  # fmt: skip

    def main(self) -> int:
        if recall.has_answers(Manifest.load(self.manifest)):
            return self._recall()
        if self.json or self.png:
            raise ConfigError(
                f"--json and --png are the recall probe's; {self.manifest} is a copy probe "
                "(its halves: `ulysses-mm evaluate ... --json/--png`)"
            )
        first, second = score(
            self.checkpoint, self.manifest, self.nproc, self.length, self.sp, self.rope
        )
        print(
            f"first half: {first:.4f} bits/base (unpredictable: 2 at best)\n"
            f"second half: {second:.4f} bits/base (a copy from L bases back: 0 once the "
            "model uses its context)"
        )
        return 0

    def _recall(self) -> int:
        f = score_recall(
            self.checkpoint, self.manifest, self.nproc, self.length, self.sp, self.rope
        )
        lines = [
            f"recall at L={f['length']:,}{' with RoPE ' + self.rope if self.rope else ''}: "
            f"{f['accuracy']:.3f} of {f['answers']:,} answers right, {f['bits']:.3f} bits/answer"
        ]
        lines += [f"{'distance':>16s} {'answers':>8s} {'accuracy':>8s} {'bits':>6s}"]
        lines += [
            f"{'[' + str(b['lo']) + ', ' + str(b['hi']) + ')':>16s} {b['answers']:>8,} "
            f"{b['accuracy']:>8.3f} {b['bits']:>6.3f}"
            for b in f["buckets"]
        ]
        if self.json:
            atomic_write_local(Path(self.json), (json.dumps(f, indent=1) + "\n").encode())
            lines.append(f"wrote {self.json}")
        if self.png:
            plot_recall(
                f, self.png, f"{Path(self.checkpoint).name} on {Path(self.manifest).parent.name}"
            )
            lines.append(f"wrote {self.png}")
        print("\n".join(lines))
        return 0
