"""Balanced data-parallel steps (``ulysses_mm.loader.balance``): a step's samples placed on
DP ranks and micro-steps by their attention work, against the order they come in.

With attention isolated inside documents a packed sample costs Σ l(l+1)/2 causal pairs
over its documents plus the same linear work for every sample of N tokens, so a sample
holding one N-token document costs far more than one of many short documents; every
micro-step ends in a collective, so it lasts as long as its slowest DP rank.

Measured (dp = 2, gloo, one thread per rank): a synthetic packed corpus (document lengths
from a stated mixture, packed in order into samples of N tokens, a document cut at a
sample's end); per rank and micro-step, document-isolated causal attention
(``scaled_dot_product_attention`` per document, ``--heads`` × ``--head-dim``) and an MLP
over all N tokens (``--hidden`` → ``--ffn`` → ``--hidden``), forward only, then an
all-reduce. The same steps run in order (``in_order``) and balanced (``assign``),
interleaved step by step (AB, BA, …) after a warm-up of each. The work of a sample given
to ``sample_work`` is in pairs of this kernel: the MLP's FLOPs per token over the
attention's FLOPs per pair, ``hidden·ffn / (heads·head_dim)``. A step's time is the
slowest rank's; "predicted" is ``StepWork``'s critical path, balanced over in-order.
Beside the wall clock, each rank's thread CPU time per micro-step gives the step as the
ranks' own compute makes it (Σ over micro-steps of the slowest rank's CPU seconds): on a
machine shared with other work, the wall clock also counts the time the ranks wait for a
core, and that waiting is larger when both ranks compute at once (balanced) than when one
idles in the collective (in order). A fit of the CPU seconds to pairs and tokens gives the
kernel's own linear weight, beside the FLOP ratio.

Simulated (dp = 8 … 1024): ``loader.balance.simulate`` (steps of dp·micro_batch·gas
samples drawn at random from each corpus's per-sample pairs, ``StepWork`` of both plans;
max/mean and the speedup over all the steps' work) with the linear weight of Llama-3-8B
(``configs/llama3-8b.yaml`` through ``train.flops.pairs_per_token``: 26,625 pairs per
token). Corpora: one prepared by
``ulysses-mm prepare`` from ``--data`` (default ``shared/data`` beside the repository when
present, else ``tests/data``; pipelines/mixed.yaml's tokenizers, N = 32K;
``sample_pairs`` from the manifest, or from its shards' segment tables when the manifest
predates them), any ``--manifest`` given, and synthetic corpora whose document-length
mixtures the output states (N = 32K and the 1M-token DNA case).

    python benchmarks/bench_dp_balance.py [--quick] [--data DIR] [--manifest PATH ...]
        [--gas 4] [--micro-batch 1] [--steps 8]

The line before the last: ``balanced/in-order step time ratio: R (predicted P; from the
ranks' CPU time C), N=…`` at the largest N; the last: ``balanced_over_in_order=R
cpu_critical=C predicted=P``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"  # sample files beside the repository, when present
LLAMA3_8B = "configs/llama3-8b.yaml"


@dataclass(frozen=True)
class Mixture:
    """Document lengths: each document picks a part with probability ``p`` and its length
    log-uniform on [lo, hi] tokens."""

    name: str
    parts: tuple[tuple[float, int, int, str], ...]  # (p, lo, hi, what)

    def draw(self, tokens: int, rng: np.random.Generator) -> np.ndarray:
        """Document lengths summing to at least ``tokens``."""
        p = np.array([part[0] for part in self.parts])
        lo = np.log([part[1] for part in self.parts])
        hi = np.log([part[2] for part in self.parts])
        mean = sum(q * (b - a) / (np.log(b) - np.log(a)) for q, a, b, _ in self.parts)
        out: list[np.ndarray] = []
        while sum(len(o) and o.sum() for o in out) < tokens:
            n = int(tokens / mean * 1.1) + 16
            which = rng.choice(len(p), size=n, p=p / p.sum())
            out.append(np.rint(np.exp(rng.uniform(lo[which], hi[which]))).astype(np.int64))
        return np.concatenate(out)

    def describe(self) -> str:
        return (
            ", ".join(f"{q:.0%} {what} {_tok(a)}–{_tok(b)}" for q, a, b, what in self.parts)
            + " (log-uniform lengths)"
        )


def _tok(n: int) -> str:
    """16384 -> 16K, 2**20 -> 1M."""
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    return f"{n // 1024}K" if n >= 1024 else str(n)


def mixed(N: int) -> Mixture:
    """Many short documents and a few as long as a whole sample."""
    return Mixture("mixed", ((0.95, 256, 2048, "short"), (0.05, N // 8, N, "long")))


DNA_1M = Mixture(
    "dna",
    ((0.9, 1024, 65536, "contigs/genes"), (0.1, 262144, 4 * 2**20, "chromosome-scale")),
)


def pieces_of(lengths: np.ndarray, N: int, samples: int) -> list[list[int]]:
    """Each sample's document pieces: the stream cut at documents' ends and every N tokens."""
    from ulysses_mm.tools.estimate.documents import window_pieces

    length, sample = window_pieces(lengths, N, samples)
    out: list[list[int]] = [[] for _ in range(samples)]
    for n, s in zip(length.tolist(), sample.tolist()):
        out[s].append(n)
    return out


def pairs_of(lengths: np.ndarray, N: int, samples: int) -> np.ndarray:
    """Causal pairs per sample (documents isolated, pieces in one sample counted apart)."""
    from ulysses_mm.tools.estimate.documents import window_pairs

    return window_pairs(lengths, N, samples)


# ---------------------------------------------------------------------------------------
# measured, dp = 2


def measure_worker(cfg: dict) -> dict:
    """One DP rank: every (step, mode) of ``cfg["schedule"]``; per step its wall time and
    the compute time of each micro-step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ulysses_mm.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    rank, _ = init_distributed("gloo")
    N, H, d, D, Fd = cfg["N"], cfg["heads"], cfg["head_dim"], cfg["hidden"], cfg["ffn"]
    g = torch.Generator().manual_seed(rank)
    q, k, v = torch.randn(3, 1, H, N, d, generator=g).unbind(0)
    x = torch.randn(N, D, generator=g)
    w1 = torch.randn(D, Fd, generator=g) / D**0.5
    w2 = torch.randn(Fd, D, generator=g) / Fd**0.5
    sync = torch.zeros(1)
    pieces: list[list[int]] = cfg["pieces"]

    def compute(sample: int) -> float:
        acc = 0.0
        s = 0
        for n in pieces[sample]:  # attention inside each document
            o = F.scaled_dot_product_attention(
                q[:, :, s : s + n], k[:, :, s : s + n], v[:, :, s : s + n], is_causal=True
            )
            acc += float(o[0, 0, -1, 0])
            s += n
        y = torch.relu(x @ w1) @ w2  # the linear part over all N tokens
        return acc + float(y[-1, 0])

    out = []
    for step, mode, plan, samples in cfg["schedule"]:
        plan = np.asarray(plan)
        dist.barrier()
        t0 = time.perf_counter()
        micro, cpu = [], []
        for kk in range(plan.shape[0]):
            tc, cc = time.perf_counter(), time.thread_time()
            loss = sum(compute(samples[i]) for i in plan[kk, rank])
            micro.append(time.perf_counter() - tc)
            cpu.append(time.thread_time() - cc)
            sync.fill_(loss)
            dist.all_reduce(sync)  # the micro-step's collective
        wall = time.perf_counter() - t0
        out.append({"step": step, "mode": mode, "wall": wall, "micro": micro, "cpu": cpu})
    return {"rank": rank, "steps": out}


def measured(args: argparse.Namespace, N: int, seed: int) -> dict:
    from ulysses_mm.loader.balance import StepWork, assign, in_order, sample_work
    from ulysses_mm.parallel.launch import launch_local

    dp, mb, gas = 2, args.micro_batch, args.gas
    S = dp * mb * gas
    steps = args.steps + 1  # step 0 warms up
    rng = np.random.default_rng(seed)
    corpus = 4 * steps * S  # the steps draw from a corpus larger than themselves
    lengths = mixed(N).draw(corpus * N, rng)
    pieces = pieces_of(lengths, N, corpus)
    pairs = pairs_of(lengths, N, corpus)
    linear = args.hidden * args.ffn / (args.heads * args.head_dim)
    schedule = []
    predicted: dict[str, list[StepWork]] = {"in-order": [], "balanced": []}
    for step in range(steps):
        take = rng.choice(corpus, size=S, replace=False)  # the step's samples, in random order
        work = sample_work(pairs[take], N, linear)
        plans = {"in-order": in_order(gas, dp, mb), "balanced": assign(work, dp, mb, gas)}
        for mode in ("in-order", "balanced") if step % 2 == 0 else ("balanced", "in-order"):
            schedule.append((step, mode, plans[mode].tolist(), take.tolist()))
            if step:
                predicted[mode].append(StepWork.of(work, plans[mode]))
    cfg = {
        "N": N,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "hidden": args.hidden,
        "ffn": args.ffn,
        "pieces": pieces,
        "schedule": schedule,
    }
    res = launch_local(measure_worker, dp, cfg)
    ranks = [res[r]["steps"] for r in sorted(res)]
    out: dict = {"N": N, "linear": linear, "dp": dp, "micro_batch": mb, "gas": gas}
    for mode in ("in-order", "balanced"):
        rows = [
            [ranks[r][i] for r in range(dp)]
            for i in range(len(schedule))
            if schedule[i][1] == mode and schedule[i][0] > 0
        ]
        wall = [max(x["wall"] for x in row) for row in rows]
        per_rank = [np.mean([sum(x["micro"]) for x in row]) for row in rows]
        per_rank_cpu = [np.mean([sum(x["cpu"]) for x in row]) for row in rows]
        critical = [float(np.max([x["cpu"] for x in row], axis=0).sum()) for row in rows]
        sw = predicted[mode]
        out[mode] = {
            "step_s": float(np.mean(wall)),
            "rank_compute_s": float(np.mean(per_rank)),
            "rank_cpu_s": float(np.mean(per_rank_cpu)),
            "cpu_critical_s": float(np.mean(critical)),
            "predicted_max_over_mean": sum(w.critical for w in sw) / sum(w.mean for w in sw),
            "critical_work": sum(w.critical for w in sw),
        }
    out["ratio"] = out["balanced"]["step_s"] / out["in-order"]["step_s"]
    out["ratio_cpu_critical"] = (
        out["balanced"]["cpu_critical_s"] / out["in-order"]["cpu_critical_s"]
    )
    out["predicted"] = out["balanced"]["critical_work"] / out["in-order"]["critical_work"]
    # the kernel's own exchange rate: CPU seconds of a rank's micro-step fitted as
    # a·pairs + b·tokens over every measured micro-step; b/a against `linear`
    A, y = [], []
    for i, (step, _, plan, take) in enumerate(schedule):
        if step:
            for kk, row in enumerate(np.asarray(plan)):
                for r in range(dp):
                    A.append([pairs[np.asarray(take)[row[r]]].sum(), N * len(row[r])])
                    y.append(ranks[r][i]["cpu"][kk])
    (a, b), *_ = np.linalg.lstsq(np.asarray(A), np.asarray(y), rcond=None)
    out["fitted_linear"] = float(b / a) if a > 0 else float("nan")
    out["ns_per_pair"] = float(a * 1e9)
    taken = np.concatenate([np.asarray(t) for (s, m, _, t) in schedule if s and m == "in-order"])
    att = pairs[taken].sum()
    out["attention_share"] = float(att / (att + linear * N * len(taken)))
    return out


# ---------------------------------------------------------------------------------------
# simulated, dp = 8 … 1024


def prepared_pairs(where: str) -> tuple[np.ndarray, int, str]:
    """A manifest's per-sample pairs (recorded, or from its shards' segment tables), its
    seq_len, and a line on what it holds."""
    from ulysses_mm.core.format import sample_pairs
    from ulysses_mm.loader.stream import shard_samples
    from ulysses_mm.shards.manifest import Manifest, read_verified_shard

    m = Manifest.load(where)
    if m.sample_pairs is not None:
        pairs, how = np.asarray(m.sample_pairs, np.float64), "sample_pairs of the manifest"
    else:
        got = []
        for i in range(len(m.shards)):
            data = read_verified_shard(m, i)
            got += [sample_pairs(s.segments) for s in shard_samples(data, m.shard_location(i))]
        pairs, how = np.asarray(got, np.float64), "pairs from the shards' segment tables"
    tokens = ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in m.tokens.items() if v)
    line = (
        f"{m.num_samples} samples × {m.seq_len:,}, {m.num_documents:,} documents ({tokens}); {how}"
    )
    return pairs, m.seq_len, line


def prepare(data: Path, N: int, out: Path) -> Path:
    """``ulysses-mm prepare mixed`` over ``data``'s DNA, audio and video files."""
    globs = [
        "*.{fa,fasta,fa.gz,fastq,fq,fastq.gz,gb,gbk}",
        "*.{wav,flac,ogg,mp3}",
        "*.{mp4,webm,mkv,mov}",
    ]
    sources = "[" + ", ".join(f'"{data.resolve() / g}"' for g in globs) + "]"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "ulysses_mm", "prepare", "mixed", f"sources={sources}",
         f"pack.seq_len={N}", f"output={out}"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if res.returncode:
        raise SystemExit(f"prepare failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return out / "manifest.json"


def simulate(
    pairs: np.ndarray, N: int, linear: float, dp: int, mb: int, gas: int, steps: int, seed: int
) -> dict:
    """``balance.simulate`` over a corpus's samples of N tokens, and attention's share of
    their work."""
    from ulysses_mm.loader.balance import sample_work
    from ulysses_mm.loader.balance import simulate as imbalance

    work = sample_work(pairs, N, linear)
    got = imbalance(work, dp, mb, gas, steps=steps, seed=seed)
    return {
        "before": got.in_order,
        "after": got.balanced,
        "speedup": got.speedup,
        "attention_share": float(pairs.sum() / work.sum()),
    }


def llama_linear() -> float:
    from ulysses_mm.config import RunConfig, load_config
    from ulysses_mm.train.flops import pairs_per_token

    return pairs_per_token(load_config(RunConfig, str(REPO / LLAMA3_8B), []).model)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-len", type=int, nargs="+", default=[16384, 32768], help="measured N")
    ap.add_argument("--gas", type=int, default=4, help="micro-steps per step (both parts)")
    ap.add_argument("--micro-batch", type=int, default=1, help="samples per rank per micro-step")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per mode (+1 warm-up)")
    ap.add_argument("--heads", type=int, default=2, help="measured attention heads")
    ap.add_argument("--head-dim", type=int, default=64, help="measured head dimension")
    ap.add_argument("--hidden", type=int, default=256, help="measured MLP width")
    ap.add_argument("--ffn", type=int, default=512, help="measured MLP inner width")
    ap.add_argument(
        "--dp", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024],
        help="simulated DP sizes",
    )  # fmt: skip
    ap.add_argument(
        "--sim-steps", type=int, default=64, help="simulated steps per dp (fewer past dp 256)"
    )
    ap.add_argument(
        "--data", type=Path, default=None,
        help="files to prepare into the simulated mixed corpus (default: shared/data beside "
        "the repository when present, else the repository's tests/data)",
    )  # fmt: skip
    ap.add_argument(
        "--manifest",
        action="append",
        default=[],
        help="also simulate this prepared dataset (repeatable)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of corpora and steps")
    ap.add_argument(
        "--quick", action="store_true", help="N = 16K only, 4 steps, fewer simulated steps (~1 min)"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="the quick sizes, figures to results/smoke/"
    )
    args = ap.parse_args()
    if args.quick or args.smoke:
        args.seq_len, args.steps, args.sim_steps = [16384], 4, 8

    # --- measured
    print(
        f"measured: dp=2 (gloo, 1 thread per rank), micro_batch {args.micro_batch}, gas "
        f"{args.gas}; corpus: documents 95% short 256–2K, 5% long N/8–N (log-uniform lengths), "
        f"packed in order into samples of N; per sample SDPA per document ({args.heads} heads × {args.head_dim}) "
        f"+ MLP {args.hidden}→{args.ffn}→{args.hidden}, forward; linear = "
        f"{args.hidden * args.ffn / (args.heads * args.head_dim):.0f} pairs/token; "
        f"{args.steps} steps per mode, interleaved, after a warm-up; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'N':>7} {'mode':>9} {'step s':>8} {'rank compute s':>15} {'rank CPU s':>11} {'Σ max CPU s':>12} "
        f"{'pred. max/mean':>15}"
    )
    meas = {}
    for N in args.seq_len:
        m = measured(args, N, args.seed)
        meas[N] = m
        for mode in ("in-order", "balanced"):
            r = m[mode]
            print(
                f"{N:>7} {mode:>9} {r['step_s']:>8.3f} {r['rank_compute_s']:>15.3f} "
                f"{r['rank_cpu_s']:>11.3f} {r['cpu_critical_s']:>12.3f} "
                f"{r['predicted_max_over_mean']:>15.3f}"
            )
        print(
            f"{N:>7} balanced/in-order: step {m['ratio']:.3f}, Σ max CPU "
            f"{m['ratio_cpu_critical']:.3f}, predicted {m['predicted']:.3f} (attention "
            f"{m['attention_share']:.0%} of the work); the kernel's fitted linear weight "
            f"{m['fitted_linear']:.0f} pairs/token (FLOPs say {m['linear']:.0f})"
        )

    # --- simulated
    linear = llama_linear()
    dps = [d for d in args.dp if d <= 64] if args.smoke else args.dp
    corpora: list[tuple[str, np.ndarray, int, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.data is not None:
            data, name = args.data, args.data.name
        else:
            data = SHARED if SHARED.is_dir() else REPO / "tests" / "data"
            name = f"{data.parent.name}/{data.name}"
        where = prepare(data, 32768, Path(tmp) / "mixed")
        pairs, N, line = prepared_pairs(str(where))
        corpora.append((f"prepared {name}", pairs, N, line))
    for path in args.manifest:
        pairs, N, line = prepared_pairs(path)
        corpora.append((f"manifest {Path(path).parent.name}", pairs, N, line))
    rng = np.random.default_rng(args.seed)
    n_syn = 512 if args.smoke or args.quick else 4096
    for mix, N in ((mixed(32768), 32768), (DNA_1M, 2**20)):
        lengths = mix.draw(n_syn * N, rng)
        corpora.append(
            (f"synthetic {mix.name} {_tok(N)}", pairs_of(lengths, N, n_syn), N,
             f"{n_syn} samples × {N:,}; documents {mix.describe()}, packed in order, cut at sample ends"),
        )  # fmt: skip
    print(
        f"\nsimulated: StepWork of steps of dp × {args.micro_batch} × {args.gas} samples drawn "
        f"at random (loader.balance.simulate); linear = {linear:,.0f} pairs/token (Llama-3-8B, "
        f"{LLAMA3_8B}); max/mean = Σ critical path / Σ even split over the steps; speedup = "
        f"their ratio"
    )
    rows = []
    for name, pairs, N, line in corpora:
        print(f"{name}: {line}")
        print(f"  {'dp':>5} {'in-order':>9} {'balanced':>9} {'speedup':>8} {'attention':>10}")
        for dp in dps:
            steps = max(8, args.sim_steps * 256 // max(dp, 256))
            s = simulate(pairs, N, linear, dp, args.micro_batch, args.gas, steps, args.seed + dp)
            print(
                f"  {dp:>5} {s['before']:>9.3f} {s['after']:>9.3f} {s['speedup']:>8.3f} "
                f"{s['attention_share']:>10.1%}"
            )
            rows.append([name, N, dp, round(s["before"], 3), round(s["after"], 3),
                         round(s["speedup"], 3), round(100 * s["attention_share"], 1)])  # fmt: skip

    top = max(meas)
    m = meas[top]
    figures = {
        f"N{N}": {
            "step_s_in_order": r["in-order"]["step_s"],
            "step_s_balanced": r["balanced"]["step_s"],
            "ratio": r["ratio"],
            "ratio_cpu_critical": r["ratio_cpu_critical"],
            "predicted": r["predicted"],
            "attention_share": r["attention_share"],
        }
        for N, r in meas.items()
    }
    from _results import record

    record(
        "bench_dp_balance",
        figures,
        smoke=args.smoke,
        extra={
            "tables": {
                "measured": {
                    "columns": ["N", "mode", "step s", "rank compute s", "Σ max CPU s",
                                "predicted max/mean"],
                    "rows": [[N, mode, round(r[mode]["step_s"], 3),
                              round(r[mode]["rank_compute_s"], 3),
                              round(r[mode]["cpu_critical_s"], 3),
                              round(r[mode]["predicted_max_over_mean"], 3)]
                             for N, r in meas.items() for mode in ("in-order", "balanced")],
                    "notes": "dp=2 on CPU (gloo), one thread per rank; mean per step",
                },
                "simulation": {
                    "columns": ["corpus", "N", "dp", "max/mean in order", "max/mean balanced",
                                "speedup", "attention %"],
                    "rows": rows,
                    "notes": f"StepWork, micro_batch {args.micro_batch}, gas {args.gas}, "
                    f"Llama-3-8B linear weight {linear:,.0f} pairs/token",
                },
            },
            "corpora": {name: line for name, _, _, line in corpora},
        },
    )  # fmt: skip
    print(
        f"balanced/in-order step time ratio: {m['ratio']:.2f} (predicted {m['predicted']:.2f}; "
        f"from the ranks' CPU time {m['ratio_cpu_critical']:.2f}), N={top}"
    )
    print(
        f"balanced_over_in_order={m['ratio']:.3f} cpu_critical={m['ratio_cpu_critical']:.3f} "
        f"predicted={m['predicted']:.3f}"
    )


if __name__ == "__main__":
    main()
