"""Packing and shard-writing throughput (tokens/s), beside a naive per-token baseline.

Two workloads bracket real data: many short documents (sequencing reads, ~150 tokens)
and a few long ones (genomes / long clips, ~3M tokens). For each, measured in one run:

- ``pack``: :class:`ulysses_mm.shards.pack.Packer` alone (samples + segment tables);
- ``pack+write``: packing plus :class:`ulysses_mm.shards.writer.ShardWriter` writing tar
  shards to a temporary directory (``.npy`` encoding, sha256, file writes);
- ``naive``: a per-token Python loop that builds each sample and its segment table one
  token at a time, then writes the same shards — on a smaller slice, because it is slow.

The naive baseline's samples are checked equal to the packer's on that slice.

    PYTHONPATH=. python benchmarks/bench_pack.py [--tokens 33554432] [--seq-len 1048576]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from ulysses_mm.core.format import PackedSample
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, PAD, TokenSpace
from ulysses_mm.shards.pack import DocumentBlock, Packer
from ulysses_mm.shards.writer import ShardRecord, ShardWriter

SPACE = TokenSpace.from_vocab({"dna": 16, "audio": 256, "video": 1024})


def make_blocks(
    total: int, mean_len: int, seed: int = 0, docs_per_block: int = 4096
) -> list[DocumentBlock]:
    """Blocks (input files) of random documents, ``total`` tokens in all."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(3, rng.exponential(mean_len, 2 * total // mean_len + 8)).astype(np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), total)) + 1]
    lengths[-1] -= int(lengths.sum()) - total
    if lengths[-1] < 3 and len(lengths) > 1:
        lengths[-2] += lengths[-1]
        lengths = lengths[:-1]
    r = SPACE.range("dna")
    blocks = []
    for i in range(0, len(lengths), docs_per_block):
        ls = lengths[i : i + docs_per_block]
        tokens = rng.integers(r.start, r.stop, int(ls.sum())).astype(SPACE.dtype())
        ends = np.cumsum(ls)
        tokens[ends - ls] = DOC_START
        tokens[ends - 1] = DOC_END
        blocks.append(DocumentBlock(tokens, ls, np.zeros(len(ls), np.int64)))
    return blocks


def run_packer(blocks, seq_len: int, writer: ShardWriter | None) -> int:
    packer = Packer(seq_len, SPACE.dtype())
    n = 0
    for b in blocks:
        for s in packer.add(b):
            n += 1
            if writer is not None:
                writer.write(s)
    for s in packer.finish():
        n += 1
        if writer is not None:
            writer.write(s)
    if writer is not None:
        writer.close()
    return n


def naive_pack(blocks, seq_len: int) -> list[PackedSample]:
    """One token at a time: the obvious loop, no vectorisation."""
    samples: list[PackedSample] = []
    cur: list[int] = []
    rows: list[list[int]] = []
    doc_id = 0
    for b in blocks:
        offsets = np.concatenate([[0], np.cumsum(b.lengths)])
        for d in range(len(b.lengths)):
            mod = int(b.modalities[d])
            for pos, tok in enumerate(b.tokens[offsets[d] : offsets[d + 1]].tolist()):
                if not rows or rows[-1][3] != doc_id or pos == 0:
                    rows.append([len(cur), 0, mod, doc_id, pos])
                cur.append(tok)
                rows[-1][1] += 1
                if len(cur) == seq_len:
                    samples.append(
                        PackedSample(
                            len(samples), np.array(cur, SPACE.dtype()), np.array(rows, np.int64)
                        )
                    )
                    cur, rows = [], []
            doc_id += 1
    if cur:
        tokens = np.array(cur + [PAD] * (seq_len - len(cur)), SPACE.dtype())
        samples.append(PackedSample(len(samples), tokens, np.array(rows, np.int64)))
    return samples


def slice_blocks(blocks, total: int) -> list[DocumentBlock]:
    out, n = [], 0
    for b in blocks:
        if n >= total:
            break
        out.append(b)
        n += len(b.tokens)
    return out


def writer_in(directory: Path) -> ShardWriter:
    def publish(tmp: Path, record: ShardRecord) -> None:
        tmp.replace(directory / record.name)

    return ShardWriter(directory, publish, max_bytes=256 << 20)


def best_of(repeat: int, fn) -> float:
    """Fastest of ``repeat`` timed calls of ``fn()``, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_pack_and_write(blocks, seq_len: int, repeat: int) -> float:
    """Best time of packing + writing shards (directory clean-up not timed)."""
    best = float("inf")
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            run_packer(blocks, seq_len, writer_in(Path(d)))
            best = min(best, time.perf_counter() - t0)
    return best


def time_naive_pack_and_write(blocks, seq_len: int) -> tuple[float, list[PackedSample]]:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        samples = naive_pack(blocks, seq_len)
        w = writer_in(Path(d))
        for s in samples:
            w.write(s)
        w.close()
        return time.perf_counter() - t0, samples


def bench(mean_len: int, args: argparse.Namespace) -> tuple[int, float, float, float]:
    """(tokens, pack tok/s, pack+write tok/s, naive pack+write tok/s) for one workload."""
    blocks = make_blocks(args.tokens, mean_len)
    total = sum(len(b.tokens) for b in blocks)
    t_pack = best_of(args.repeat, lambda: run_packer(blocks, args.seq_len, None))
    t_write = time_pack_and_write(blocks, args.seq_len, args.repeat)
    few = slice_blocks(blocks, args.naive_tokens)
    few_total = sum(len(b.tokens) for b in few)
    t_naive, slow = time_naive_pack_and_write(few, args.seq_len)
    packer = Packer(args.seq_len, SPACE.dtype())
    fast = [s for b in few for s in packer.add(b)] + list(packer.finish())
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):  # the baseline computes the same samples
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.segments, b.segments)
    return total, total / t_pack, total / t_write, few_total / t_naive


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=32 << 20, help="tokens per workload (32Mi)")
    ap.add_argument("--seq-len", type=int, default=1 << 20, help="tokens per sample (1Mi)")
    ap.add_argument("--naive-tokens", type=int, default=1 << 20, help="tokens for the naive loop")
    ap.add_argument("--repeat", type=int, default=3, help="best of N for the fast paths")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.seq_len, args.naive_tokens, args.repeat = 1 << 18, 1 << 14, 1 << 14, 1

    print(f"seq_len {args.seq_len:,}, dtype {SPACE.dtype()}, one process")
    header = (
        f"{'workload':<24} {'tokens':>12} {'pack tok/s':>12} {'pack+write':>12} "
        f"{'naive':>12} {'x naive':>8}"
    )
    print(header)
    print("-" * len(header))
    figures = {}
    for key, name, mean_len in [
        ("short", "short docs (~150 tok)", 150),
        ("long", "long docs (~3M tok)", 3_000_000),
    ]:
        total, r_pack, r_write, r_naive = bench(mean_len, args)
        figures |= {f"{key}_pack_tok_s": r_pack, f"{key}_write_tok_s": r_write}
        figures[f"{key}_x_naive"] = r_write / r_naive
        print(
            f"{name:<24} {total:>12,} {r_pack / 1e6:>10.1f} M {r_write / 1e6:>10.1f} M "
            f"{r_naive / 1e6:>10.2f} M {r_write / r_naive:>7.0f}x"
        )
    print("tok/s in millions; 'x naive' = pack+write over the naive loop (which also writes).")
    from _results import record

    print(" ".join(f"{k}={v:.4g}" for k, v in figures.items()))
    record("bench_pack", figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
