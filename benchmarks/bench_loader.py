"""The loader for real runs, measured: fetch amplification, fetch time hidden behind steps,
mixing error, and the tokens/s the loader sustains alone.

Three datasets are prepared with the real mixed pipeline (one token space): two of DNA,
and one of the sample files in tests/data (DNA, speech and a video clip packed together,
some samples straddling two modalities). They are mixed 0.5 / 0.2 / 0.3, the mixed one with
per-modality weights video 0.5, audio 0.3, dna 0.2 (shares of its tokens). One node of
``--ranks`` ranks (threads: dp 2 × sp ranks/2, each with its own loader, all sharing one
node cache directory) trains ``--steps`` steps of ``--step-ms`` each against:

- a local HTTP server that delays every response by ``--latency-ms`` and counts the
  bytes it sends;
- a moto S3 server on loopback behind a byte-counting TCP proxy (tests/helpers/byte_proxy.py):
  every byte the server sent, HTTP headers included.

Figures, per server:

- ``fetch_amplification`` = bytes sent to the node ÷ bytes of the distinct shards it
  fetched (1 = each shard once per node, whatever the number of ranks); the shards
  prefetched for steps after the last are fetched too, and printed apart;
- ``hidden_fraction`` = 1 − (time the ranks waited for shards ÷ time their prefetch threads
  spent fetching them), after the first batch (which has no step before it to hide its
  fetch behind; its wait is printed apart);
- ``mix_error`` = the largest |share − weight| / weight over the manifests (their shares of
  the samples) and over the modalities of the mixed one (their shares of its tokens);
- ``loader tokens/s``: one rank reading local shards through the same code with no step.

The last line is ``fetch_amplification=A hidden_fraction=H mix_error=E`` (the worse of
the two servers for A and H). Goals: A ≤ 1.05, H ≥ 0.8, E ≤ 0.02.

    PYTHONPATH=. python benchmarks/bench_loader.py [--ranks 4] [--steps 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import io
import logging
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar

import numpy as np

from ulysses_mm.core.storage import Location
from ulysses_mm.loader.mixing import mix_error
from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = (0.5, 0.2, 0.3)  # a, b, mixed
MODALITIES = {"video": 0.5, "audio": 0.3, "dna": 0.2}  # inside mixed, shares of its tokens


def _proxy_class():
    """tests/helpers/byte_proxy.py's ByteCountingProxy (standard library only)."""
    from _helpers import helper_module

    return helper_module("byte_proxy").ByteCountingProxy


def _prepare(root: Path, name: str, sources: list[str], seq_len: int) -> Manifest:
    cfg = load_pipeline_config(
        REPO / "pipelines" / "mixed.yaml",
        [
            f"sources=[{', '.join(sources)}]",
            f"output={root / name}",
            f"pack.seq_len={seq_len}",
            "shards.max_samples=16",
            "workers=0",
            "progress=false",
        ],
    )
    prepare(cfg, out=io.StringIO())
    return Manifest.load(str(root / name / "manifest.json"))


def make_dataset(root: Path, name: str, records: int, seq_len: int, seed: int) -> Manifest:
    rng = np.random.default_rng(seed)
    src = root / f"{name}-src"
    src.mkdir(parents=True)
    with (src / f"{name}.fa").open("w") as f:
        for i in range(records):
            seq = "".join(rng.choice(list("ACGT"), int(rng.integers(seq_len // 2, 2 * seq_len))))
            f.write(f">r{i}\n{seq}\n")
    return _prepare(root, name, [f"{src}/*.fa"], seq_len)


def make_mixed(root: Path, seq_len: int) -> Manifest:
    """The sample files of tests/data through the mixed pipeline, in name order."""
    files = sorted(str(p) for p in (REPO / "tests" / "data").iterdir() if p.suffix != ".md")
    return _prepare(root, "mixed", files, seq_len)


class _Slow(http.server.SimpleHTTPRequestHandler):
    delay_s: ClassVar[float] = 0.0
    sent: ClassVar[list[int]] = [0]
    lock = threading.Lock()

    def do_GET(self):
        time.sleep(self.delay_s)
        path = Path(self.translate_path(self.path))
        with self.lock:
            self.sent[0] += path.stat().st_size if path.is_file() else 0
        super().do_GET()

    def log_message(self, *args):
        pass


def run_node(
    sources: list, ranks: int, steps: int, step_s: float, cache_dir: Path
) -> dict[str, float]:
    """``ranks`` loaders (dp 2 × sp ranks/2) sharing one cache, ``steps`` steps each."""
    dp = 2 if ranks % 2 == 0 else 1
    options = StreamOptions(seed=3, shuffle_buffer=8, timeouts=(5.0, 30.0), prefetch_bytes=8 << 20)
    streams = [
        ShardStream(sources, r % dp, dp, 1, options, NodeCache(cache_dir, 1 << 30))
        for r in range(ranks)
    ]
    errors: list[BaseException] = []
    first: dict[int, tuple[float, float]] = {}  # rank: (waited, loaded) after the first batch

    def rank(st: ShardStream) -> None:
        try:
            for step in range(steps):
                st.next_batch()
                if step == 0 and st._prefetch is not None:
                    first[id(st)] = (st.waited_s, st._prefetch.loaded_s)
                time.sleep(step_s)
        except BaseException as e:  # surfaced after the join
            errors.append(e)
        finally:
            st.close()

    threads = [threading.Thread(target=rank, args=(st,)) for st in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    # the shards the node read: those of every position the loaders went through, and
    # those prefetched for the steps after the last (in the cache, by content)
    read = set()
    for st in streams:
        src, idx, _ = st.order.span(st.order.start(), st.cursor.position)
        for s, source in enumerate(st.order.sources):
            read |= {(source.m, int(sh)) for sh in source.shards_of(idx[src == s])}
    size = {e.sha256: e.bytes for m, *_ in sources for e in m.shards}
    read_bytes = sum(size[sources[m][0].shards[sh].sha256] for m, sh in read)
    cached = {p.name.removesuffix(".tar") for p in cache_dir.glob("*.tar")}
    distinct = cached | {sources[m][0].shards[sh].sha256 for m, sh in read}
    # the first batch has no step before it to hide its fetch behind: counted apart
    cold = sum(first[id(st)][0] for st in streams) / len(streams)
    waited = sum(st.waited_s - first[id(st)][0] for st in streams)
    loaded = sum(
        st._prefetch.loaded_s - first[id(st)][1] for st in streams if st._prefetch is not None
    )
    first_rank = streams[0]
    return {
        "shard_bytes": sum(size[h] for h in distinct),
        "read_bytes": read_bytes,
        "downloaded": sum(st.cache.fetched_bytes for st in streams if st.cache is not None),
        "hidden": 1.0 - waited / loaded if loaded else 1.0,
        "cold_s": cold,
        "mix_error": mix_error(first_rank.tally.manifest_counts(first_rank.cursor.counts), WEIGHTS),
        "modality_error": first_rank.tally.modality_mix_error(),
        "samples": int(first_rank.cursor.counts.sum()),
    }


def bench_http(sources, args, root: Path) -> dict[str, float]:
    _Slow.delay_s = args.latency_ms / 1000
    handler = lambda *a, **k: _Slow(*a, directory=str(root), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        remote = [
            (
                dataclasses.replace(
                    m, where=m.where.at(f"{base}/{Path(m.location).parent.name}/manifest.json")
                ),
                *rest,
            )
            for m, *rest in sources
        ]
        out = run_node(remote, args.ranks, args.steps, args.step_ms / 1000, root / "cache-http")
    finally:
        server.shutdown()
        server.server_close()
    out["sent"] = _Slow.sent[0]
    return out


def bench_s3(sources, args, root: Path) -> dict[str, float] | None:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    proxy = _proxy_class()(("127.0.0.1", port)).start()  # s3fs talks to moto through it
    try:
        opts = {"client_kwargs": {"endpoint_url": proxy.url}}
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir("bench")
        remote = []
        for m, *rest in sources:
            name = Path(m.location).parent.name
            fs.put(str(Path(m.location).parent), f"bench/{name}", recursive=True)
            where = Location(f"s3://bench/{name}/manifest.json", opts)
            remote.append((Manifest.load(where), *rest))
        proxy.reset()  # from here on: what the training node reads
        out = run_node(remote, args.ranks, args.steps, args.step_ms / 1000, root / "cache-s3")
        out["sent"] = proxy.sent
    finally:
        proxy.stop()
        server.stop()
    return out


def loader_alone(sources, seq_len: int, samples: int) -> float:
    st = ShardStream(
        sources, 0, 1, 8, StreamOptions(seed=3, shuffle_buffer=8, prefetch_bytes=8 << 20)
    )
    st.next_batch()  # warm
    t0 = time.perf_counter()
    for _ in range(samples // 8):
        st.next_batch()
    dt = time.perf_counter() - t0
    st.close()
    return (samples // 8) * 8 * seq_len / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="ranks on the node (threads)")
    ap.add_argument("--steps", type=int, default=300, help="steps each rank trains")
    ap.add_argument("--step-ms", type=float, default=20.0, help="time of one training step")
    ap.add_argument("--latency-ms", type=float, default=50.0, help="HTTP delay per response")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--records", type=int, default=100, help="FASTA records per dataset")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:  # HTTP only, a few steps
        args.ranks, args.steps, args.step_ms, args.latency_ms, args.records = 2, 10, 5.0, 5.0, 8
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a = make_dataset(root, "a", args.records, args.seq_len, 1)
        b = make_dataset(root, "b", args.records // 2, args.seq_len, 2)
        mixed = make_mixed(root, args.seq_len)
        sources = [(a, WEIGHTS[0]), (b, WEIGHTS[1]), (mixed, WEIGHTS[2], MODALITIES)]
        held = ", ".join(f"{m} {t}" for m, t in mixed.tokens.items())
        print(
            f"datasets: a {a.num_samples} samples in {len(a.shards)} shards, "
            f"b {b.num_samples} samples in {len(b.shards)} shards, mixed {mixed.num_samples} "
            f"samples in {len(mixed.shards)} shards (tokens: {held}); weights {WEIGHTS}, "
            f"mixed's modalities {MODALITIES}; {args.ranks} ranks, {args.steps} steps of "
            f"{args.step_ms} ms"
        )
        results = {"http": bench_http(sources, args, root)}
        s3 = None if args.smoke else bench_s3(sources, args, root)
        if s3 is not None:
            results["s3"] = s3
        for name, r in results.items():
            amp = r["sent"] / r["shard_bytes"]
            r["amp"] = amp
            print(
                f"{name:5s} sent {int(r['sent'])} B (the node's cache took {int(r['downloaded'])} "
                f"B) for {int(r['shard_bytes'])} B of distinct shards ({int(r['read_bytes'])} B "
                f"read by the steps, the rest prefetched for the next): amplification "
                f"{amp:.3f}; first batch {r['cold_s']:.2f} s, then "
                f"hidden {r['hidden']:.3f}; "
                f"mix error {r['mix_error']:.4f} (manifests), {r['modality_error']:.4f} "
                f"(modalities of mixed) over {r['samples']} samples"
            )
        tps = loader_alone(sources, args.seq_len, 40 if args.smoke else 800)
        print(f"loader alone: {tps:,.0f} tokens/s")
        amp = max(r["amp"] for r in results.values())
        hidden = min(r["hidden"] for r in results.values())
        err = max(max(r["mix_error"], r["modality_error"]) for r in results.values())
        line = f"fetch_amplification={amp:.3f} hidden_fraction={hidden:.3f} mix_error={err:.4f}"
        print(line)
    from _results import key_values, record

    record("bench_loader", {**key_values(line), "loader_tokens_s": tps}, smoke=args.smoke)


if __name__ == "__main__":
    main()
