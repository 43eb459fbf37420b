"""``prepare`` on the local executor and on Ray, side by side: time, tokens/s, driver memory, bytes.

A generated corpus (made in a temporary directory, never shipped): ``--fasta`` FASTA files
of 50 records each and ``--audio`` short WAV files (44.1 kHz stereo, resampled to the
spec's 16 kHz mono), through one pipeline (``dna-base`` + ``audio-mulaw-16k``) cut into
``--partitions`` partitions. It is prepared by:

- the local executor with 1 worker (the reference bytes);
- Ray with 1 worker and with 2 (``workers`` = partition tasks at once, on a local Ray of
  that many CPUs).

Each executor is its own driver process, which runs ``prepare`` ``--repeats`` times (the
fastest counts: the host may be shared), timed around ``prepare`` alone (a local Ray's
start is left out and printed apart); its peak RSS is the driver's own (``ru_maxrss``),
the workers not counted. ``identical`` says every file of the dataset (shards and manifest) equals the
local executor's. The driver is then run again on ``--many`` inputs (small FASTA files) to show
that its memory does not grow with the number of inputs. The last line is::

    ray_speedup_2w=S driver_rss_mb=M identical=true|false

S = Ray 1 worker's time / Ray 2 workers' time; M = the Ray driver's peak at ``--many`` inputs.

    PYTHONPATH=. python benchmarks/bench_prepare_scale.py [--fasta 200] [--audio 40] [--many 2000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TOKENIZERS = REPO / "tokenizers"


def make_corpus(root: Path, fasta: int, audio: int, bases: int, seconds: float) -> Path:
    """``fasta`` FASTA files of 50 records (``bases`` each) and ``audio`` WAV files."""
    import soundfile

    rng = np.random.default_rng(0)
    d = root / "corpus"
    d.mkdir(parents=True)
    letters = np.frombuffer(b"ACGTacgtN", dtype=np.uint8)
    for i in range(fasta):
        with open(d / f"genome{i:05d}.fa", "wb") as f:
            for r in range(50):
                seq = letters[rng.integers(0, len(letters), bases)].tobytes()
                lines = b"\n".join(seq[j : j + 80] for j in range(0, bases, 80))
                f.write(b">g%d_r%d\n%s\n" % (i, r, lines))
    rate = 44100
    t = np.arange(int(seconds * rate)) / rate
    for i in range(audio):
        tone = 0.3 * np.sin(2 * np.pi * (220 + 20 * i) * t) + 0.05 * rng.standard_normal(len(t))
        soundfile.write(d / f"clip{i:03d}.wav", np.stack([tone, tone[::-1]], axis=1), rate)
    return d


_RUN = """
import json, os, resource, sys, time
executor, workers, repeats, output = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare
start = 0.0
if executor == "ray":
    import ray
    t = time.perf_counter()
    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    start = time.perf_counter() - t
walls = []
for r in range(repeats):  # each into an output of its own; the last one is compared
    out = output if r == repeats - 1 else f"{output}-{r}"
    extra = [f"engine={executor}", f"workers={workers}", f"output={out}"]
    cfg = load_pipeline_config(None, sys.argv[5:] + extra)
    t = time.perf_counter()
    result = prepare(cfg, out=open(os.devnull, "w"))
    walls.append(time.perf_counter() - t)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
tokens = sum(result.manifest.tokens.values())
print(json.dumps({"wall": min(walls), "start": start, "rss": rss, "tokens": tokens}))
"""


def run(
    executor: str, workers: int, output: Path, overrides: list[str], repeats: int = 1
) -> dict[str, float]:
    """One driver process: ``repeats`` runs of ``prepare``, the fastest one's wall time."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, executor, str(workers), str(repeats), str(output), *overrides],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"{executor} x{workers} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def digest(directory: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(directory)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fasta", type=int, default=200, help="FASTA files of 50 records")
    ap.add_argument("--bases", type=int, default=20000, help="bases per record")
    ap.add_argument("--audio", type=int, default=40, help="WAV files")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds per WAV file")
    ap.add_argument("--partitions", type=int, default=8, help="shards.partitions")
    ap.add_argument("--many", type=int, default=2000, help="inputs of the driver-memory run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per executor; the fastest counts")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    executors = [("local", 1), ("ray", 1), ("ray", 2)]
    if args.smoke:  # a tiny corpus, the local executor and one Ray of 2 workers, once
        args.fasta, args.bases, args.audio, args.seconds = 2, 2000, 1, 0.5
        args.partitions, args.repeats, executors = 2, 1, [("local", 1), ("ray", 2)]
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    corpus = make_corpus(root, args.fasta, args.audio, args.bases, args.seconds)
    common = [
        f"tokenizers=[{TOKENIZERS / 'dna-base.json'}, {TOKENIZERS / 'audio-mulaw-16k.json'}]",
        "pack.seq_len=65536",
        "shards.max_bytes=16777216",
        f"shards.partitions={args.partitions}",
        "progress=false",
    ]
    sources = [f"sources=[{corpus}/*]"]
    inputs = args.fasta + args.audio
    print(
        f"corpus: {args.fasta} FASTA files x 50 records x {args.bases} bp, {args.audio} WAV "
        f"files x {args.seconds:g} s; {args.partitions} partitions; {os.cpu_count()} cores"
    )
    print(
        f"{'executor':10s} {'workers':>7s} {'wall s':>7s} {'tokens/s':>10s} {'driver MB':>9s} identical"
    )
    results = {}
    reference = ""
    for executor, workers in executors:
        out = root / f"out-{executor}-{workers}"
        r = run(executor, workers, out, [*common, *sources], args.repeats)
        d = digest(out)
        reference = reference or d
        results[(executor, workers)] = (r, d == reference)
        note = f" (Ray started in {r['start']:.1f} s, not counted)" if executor == "ray" else ""
        print(
            f"{executor:10s} {workers:7d} {r['wall']:7.2f} {r['tokens'] / r['wall']:10.3g} "
            f"{r['rss']:9.0f} {str(d == reference).lower()}{note}"
        )
    # the driver's memory against the number of inputs: many small FASTA files
    r2 = results[("ray", 2)][0]
    if args.smoke:
        small = r2
    else:
        many = make_corpus(root / "many", args.many, 0, 200, 0)
        small = run("ray", 2, root / "out-many", [*common, f"sources=[{many}/*]"])
    print(
        f"driver peak RSS: {r2['rss']:.0f} MB at {inputs} inputs, {small['rss']:.0f} MB at "
        f"{args.many} inputs (Ray, 2 workers)"
    )
    speedup = results[executors[-2]][0]["wall"] / r2["wall"]  # ray x1 (local x1 in a smoke run)
    identical = all(same for _, same in results.values())
    tmp.cleanup()
    line = (
        f"ray_speedup_2w={speedup:.2f} driver_rss_mb={small['rss']:.0f} "
        f"identical={'true' if identical else 'false'}"
    )
    print(line)
    from _results import key_values, record

    record("bench_prepare_scale", key_values(line), smoke=args.smoke)


if __name__ == "__main__":
    main()
