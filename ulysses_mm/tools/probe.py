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
``pipelines/dna.yaml`` (``tokenizers/dna-base.json``, ``pack.seq_len`` = 2L + 4) into a
training and a held-out dataset (other random bases). ``probe score`` evaluates a
checkpoint on the held-out one (:mod:`ulysses_mm.tools.evaluate`, bins that are the two
halves) and prints bits per base of each.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ulysses_mm.core import REPO
from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.train.metrics import LN2

PIPELINE = REPO / "pipelines" / "dna.yaml"
HEADER = 2  # <doc> <|dna|>: the first base is at position 2


@dataclass
class ProbeData:
    train: Path  # manifest.json
    eval: Path
    length: int

    @property
    def seq_len(self) -> int:
        return 2 * self.length + 4


def halves(length: int) -> list[int]:
    """Position bin edges of the two halves: [2, L + 2) and [L + 2, 2L + 2)."""
    return [HEADER, HEADER + length, HEADER + 2 * length]


def write_fasta(path: Path, length: int, documents: int, seed: int) -> Path:
    from Bio import SeqIO
    from Bio.Seq import Seq
    from Bio.SeqRecord import SeqRecord

    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"ACGT", dtype=np.uint8)

    def records():
        for i in range(documents):
            half = letters[rng.integers(0, 4, length)].tobytes().decode("ascii")
            yield SeqRecord(Seq(half + half + "N"), id=f"probe{i}", description=f"L={length}")

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        SeqIO.write(records(), f, "fasta")
    return path


def write_probe(
    out: str | Path, length: int, documents: int, eval_documents: int, seed: int = 0
) -> ProbeData:
    from ulysses_mm.shards.manifest import Manifest
    from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare

    if length < 1:
        raise ConfigError(f"--length must be >= 1, got {length}")
    if documents < 1 or eval_documents < 1:
        raise ConfigError("--documents and --eval-documents must be >= 1")
    out = Path(out)
    manifests = []
    for name, count, s in (("train", documents, seed), ("eval", eval_documents, seed + 1)):
        fasta = write_fasta(out / "src" / f"{name}.fa", length, count, s)
        cfg = load_pipeline_config(
            PIPELINE,
            [
                f"name=probe-{name}-L{length}",
                f"sources=[{fasta}]",
                f"output={out / name}",
                f"pack.seq_len={2 * length + 4}",
                "progress=false",
            ],
        )
        prepare(cfg, out=io.StringIO())
        m = Manifest.load(str(out / name / "manifest.json"))
        if m.num_samples != count or m.num_documents != count:
            raise DataError(f"{m.location}: expected one document per sample")
        manifests.append(out / name / "manifest.json")
    return ProbeData(manifests[0], manifests[1], length)


def probe_length(seq_len: int) -> int:
    if seq_len < 6 or seq_len % 2:
        raise DataError(f"samples of {seq_len} tokens are not a probe's (2L + 4 tokens)")
    return (seq_len - 4) // 2


def score(checkpoint: str, manifest: str, nproc: int | None = None) -> tuple[float, float]:
    """(bits per base of the first half, of the second) on a probe dataset."""
    from ulysses_mm.shards.manifest import Manifest
    from ulysses_mm.tools.evaluate import EvaluateOptions, run_evaluate

    length = probe_length(Manifest.load(manifest).seq_len)
    r = run_evaluate(checkpoint, manifest, EvaluateOptions(nproc=nproc, edges=halves(length)))
    rows = r.bins.get("dna", [])
    if len(rows) != 2:
        raise DataError(f"{manifest}: no targets in one of the halves")
    return rows[0][2] / LN2, rows[1][2] / LN2
