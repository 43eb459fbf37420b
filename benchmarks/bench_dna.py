"""DNA per core: Mbp/s of FASTA(.gz) and FASTQ(.gz) to tokens, and prepare's peak memory.

Throughput (one core, CPU seconds, the best of ``--repeats``), on a FASTA.gz and a FASTQ.gz
(``shared/data``'s E. coli genome and Illumina reads when present, else generated ones):

- ``parse only``: gzip + Biopython's ``SimpleFastaParser`` / ``FastqGeneralIterator``, the
  floor of any reader built on them;
- ``naive loop``: that parse, then each base to its id by a Python dict lookup;
- ``encode_file``: the tokenizer's documents API (Biopython, one record at a time);
- ``encode_stream``: the byte-stream reader ``prepare`` runs (blocks of a few MiB);
- ``prepare step``: what a worker does per input, the stream read plus the checks and the
  staged write (``tokenize_input``).

``identical`` says the stream's tokens equal ``encode_file``'s, document by document.
Goals: FASTA >= 80 Mbp/s, FASTQ >= 40 Mbp/s per core, identical tokens.

Memory (``--memory``): peak RSS of ``prepare`` (its tokenizing worker and the process that
packs) on generated FASTA files of one 250 Mbp record, three 250 Mbp records and one
1 Gbp record: flat in the number of records, and the last one's peak (goal <= 1.5 GB).

    PYTHONPATH=. python benchmarks/bench_dna.py [--repeats 3] [--fasta F] [--fastq F] [--memory]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tokenize.dna.records import open_text
from ulysses_mm.tokenize.registry import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
FASTA = SHARED / "ecoli_k12_mg1655.fa.gz"
FASTQ = SHARED / "ecoli_illumina_reads_1.fastq.gz"


def _bases(rng: np.random.Generator, n: int) -> bytes:
    return np.frombuffer(b"ACGT", dtype=np.uint8)[rng.integers(0, 4, n)].tobytes()


def write_fasta(path: Path, records: list[int], width: int = 80, seed: int = 0) -> Path:
    """Records of random bases, ``width`` a line, written 8 Mbp at a time."""
    rng = np.random.default_rng(seed)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        for i, n in enumerate(records):
            f.write(f">rec{i} generated {n} bp\n".encode())
            step = width * (1 << 17)
            for at in range(0, n, step):
                chunk = _bases(rng, min(step, n - at))
                full = len(chunk) // width * width
                rows = np.frombuffer(chunk[:full], np.uint8).reshape(-1, width)
                lines = np.hstack([rows, np.full((len(rows), 1), ord("\n"), np.uint8)])
                f.write(lines.tobytes())
                if full < len(chunk):
                    f.write(chunk[full:] + b"\n")
    return path


def write_fastq(path: Path, reads: int = 200_000, length: int = 150, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with gzip.open(path, "wb") as f:
        for i in range(reads):
            seq = _bases(rng, length)
            f.write(b"@read%d/1\n%s\n+\n%s\n" % (i, seq, b"I" * length))
    return path


def best(fn, repeats: int) -> float:
    """CPU seconds of the fastest of ``repeats`` runs: the per-core figure, which does not
    count time the process waited for a core on a shared host."""
    runs = []
    for _ in range(repeats):
        c = time.process_time()
        fn()
        runs.append(time.process_time() - c)
    return min(runs)


def throughput(path: Path, fmt: str, repeats: int, goal: float) -> dict[str, float]:
    from Bio.SeqIO.FastaIO import SimpleFastaParser
    from Bio.SeqIO.QualityIO import FastqGeneralIterator

    from ulysses_mm.core.storage import Location
    from ulysses_mm.shards.prepare.pool import tokenize_input
    from ulysses_mm.shards.prepare.route import Task

    tok = load_tokenizer(REPO / "tokenizers" / "dna-base.json")
    space = TokenSpace.from_vocab({"dna": tok.spec.vocab_size})
    parser = SimpleFastaParser if fmt == "fasta" else FastqGeneralIterator
    file_docs = [d.tokens for d in tok.encode_file(str(path), space)]
    bases = sum(len(d) - 3 for d in file_docs)
    lut = {c: i for i, c in enumerate(tok.letters)}
    start = space.range("dna").start

    def parse_only() -> None:
        with open_text(str(path)) as h:
            for _ in parser(h):
                pass

    def naive() -> None:
        with open_text(str(path)) as h:
            for rec in parser(h):
                np.array([lut.get(c, 4) + start for c in rec[1]], dtype=space.dtype())

    def stream() -> list:
        with open(path, "rb") as f:
            return list(tok.encode_stream(f, str(path), space))

    tmp = tempfile.TemporaryDirectory()

    def prepare_step() -> None:
        task = Task(0, str(path), "dna", f"{tmp.name}/entry", f"{tmp.name}/fetch")
        assert tokenize_input(task, tok, space, Location(str(path))).ok

    rows = [
        ("parse only (gzip + Biopython)", best(parse_only, repeats)),
        ("naive: per-base Python loop", best(naive, 1)),
        ("encode_file (documents)", best(lambda: list(tok.encode_file(str(path), space)), repeats)),
        ("encode_stream (prepare's reader)", best(stream, repeats)),
        ("prepare step (read+check+stage)", best(prepare_step, repeats)),
    ]
    tmp.cleanup()
    blocks = stream()
    tokens = np.concatenate([b.tokens for b in blocks])
    # document lengths, a document's pieces in consecutive blocks added up
    lengths: list[int] = []
    for b in blocks:
        pieces = b.lengths.tolist()
        if b.continues:
            lengths[-1] += pieces.pop(0)
        lengths += pieces
    identical = bool(np.array_equal(tokens, np.concatenate(file_docs))) and lengths == [
        len(d) for d in file_docs
    ]
    mbp = bases / 1e6
    print(f"{fmt.upper()} {path.name}: {mbp:.1f} Mbp in {len(file_docs):,} records, 1 core")
    print(f"  {'method':34s} {'cpu s':>7s} {'Mbp/s':>7s}")
    for name, cpu in rows:
        print(f"  {name:34s} {cpu:7.3f} {mbp / cpu:7.1f}")
    stream_rate, step_rate = mbp / rows[3][1], mbp / rows[4][1]
    print(
        f"{fmt}: {stream_rate:.1f} Mbp/s per core read (goal >= {goal:.0f}), {step_rate:.1f} "
        f"with prepare's checks and staging; {stream_rate / (mbp / rows[1][1]):.0f}x the naive "
        f"loop; identical={'true' if identical else 'false'}"
    )
    return {
        f"{fmt}_mbp_s": stream_rate,
        f"{fmt}_prepare_mbp_s": step_rate,
        f"{fmt}_identical": identical,
    }


_MEASURE = """
import json, resource, sys
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare
prepare(load_pipeline_config(None, sys.argv[1:]))
kb = lambda who: resource.getrusage(who).ru_maxrss
print(json.dumps({"driver": kb(resource.RUSAGE_SELF), "worker": kb(resource.RUSAGE_CHILDREN)}))
"""


def peak_rss_mb(fasta: Path, out: Path) -> dict[str, float]:
    """Peak RSS (MB) of a prepare run on ``fasta``: its one tokenizing worker and itself."""
    args = [
        f"sources=[{fasta}]",
        f"tokenizers=[{REPO / 'tokenizers' / 'dna-base.json'}]",
        f"output={out}",
        "workers=1",
        "progress=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, *args], env=env, cwd=REPO, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(proc.stderr)
    peaks = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: v / 1024 for k, v in peaks.items()}  # ru_maxrss is in KiB on Linux


def memory(scratch: Path) -> None:
    mbp = 1_000_000
    cases = [
        ("1 x 250 Mbp", [250 * mbp]),
        ("3 x 250 Mbp", [250 * mbp] * 3),
        ("1 x 1 Gbp", [1000 * mbp]),
    ]
    print("prepare's peak RSS (MB), one FASTA file, pack.seq_len 1M, workers=1")
    print(f"  {'file':14s} {'worker':>8s} {'packer':>8s}")
    peaks = []
    for name, records in cases:
        fasta = write_fasta(scratch / "genome.fa", records)
        p = peak_rss_mb(fasta, scratch / "out")
        fasta.unlink()
        peaks.append(p)
        print(f"  {name:14s} {p['worker']:8.0f} {p['driver']:8.0f}")
    one, three, giga = (max(p.values()) for p in peaks)
    print(
        f"memory: 3 records / 1 record = {three / one:.2f} (flat: ~1.0); 1 Gbp record peak "
        f"{giga:.0f} MB (goal <= 1500)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per method; the best is kept")
    ap.add_argument("--fasta", default=None, help="FASTA(.gz) to read (default: E. coli)")
    ap.add_argument("--fastq", default=None, help="FASTQ(.gz) to read (default: Illumina reads)")
    ap.add_argument("--memory", action="store_true", help="also measure prepare's peak RSS")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:  # small generated files, once each
        args.repeats, args.memory = 1, False
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        fasta = Path(args.fasta) if args.fasta else FASTA
        if args.smoke or not fasta.is_file():
            fasta = write_fasta(scratch / "generated.fa.gz", [200_000 if args.smoke else 4_641_652])
        fastq = Path(args.fastq) if args.fastq else FASTQ
        if args.smoke or not fastq.is_file():
            fastq = write_fastq(scratch / "generated.fastq.gz", 2_000 if args.smoke else 200_000)
        figures = throughput(fasta, "fasta", args.repeats, 80)
        figures |= throughput(fastq, "fastq", args.repeats, 40)
        if args.memory:
            memory(scratch)
    from _results import record

    print(
        " ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={str(v).lower()}"
            for k, v in figures.items()
        )
    )
    record("bench_dna", figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
