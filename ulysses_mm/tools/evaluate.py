"""``ulysses-mm evaluate CHECKPOINT MANIFEST``: held-out loss of a trained model, per
modality in the units people quote, and against position inside documents.

The samples of MANIFEST are read in their stored order, at their full length or, with
``--seq-len L``, as windows of L tokens cut out of them (:mod:`ulysses_mm.loader.window`:
documents keep their positions, so loss by position reaches as far as the documents do),
and go through the training step's forward under a sequence-parallel layout (``--nproc``
processes; sp = ``--sp`` or the run's ``parallel.sp``, dp = nproc / sp): the same code as
the periodic eval of ``ulysses-mm train`` (:mod:`ulysses_mm.train.evaluate`), so on the
same batches both give the same figures. At L = the samples' length the windows are the
samples, and the figures are the whole samples'. ``--png`` draws loss against position
per modality; ``--json`` prints every figure.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from torch import Tensor
from tqdm import tqdm

from ulysses_mm.config import RopeConfig, RunConfig
from ulysses_mm.config.parse import (
    check_flags,
    deep_merge,
    from_dict,
    option,
    parse_overrides,
    to_dict,
)
from ulysses_mm.core.checks import INT64_SAFE, MAX_PROCESSES
from ulysses_mm.core.errors import ConfigError, UserError
from ulysses_mm.core.format import PackedSample
from ulysses_mm.core.layout import Layout
from ulysses_mm.core.storage import atomic_write_local
from ulysses_mm.loader.batch import Batch, samples_batch
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.loader.window import InOrderWindows, check_enough_windows, check_window_length
from ulysses_mm.parallel import launch
from ulysses_mm.parallel.mesh import in_launched_world, open_world
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.tools.recall import AnswerBins, bucket_edges, has_answers, read_answers
from ulysses_mm.train.evaluate import EvalResult, evaluate_batches, units_for
from ulysses_mm.train.inference import open_trained
from ulysses_mm.train.metrics import LN2
from ulysses_mm.train.plan import world_size
from ulysses_mm.train.step import build_inference_setup


@dataclass
class EvaluateOptions:
    """``ulysses-mm evaluate``'s options (its flags, by :mod:`ulysses_mm.cli.declare`)."""

    nproc: int | None = option(
        "local processes (default: the run's parallel.sp; dp = nproc / sp)", None,
        ge=1, le=MAX_PROCESSES,
    )  # fmt: skip
    batches: int = option(
        "micro-batches per DP rank (0: every sample once)", 0, ge=0, le=INT64_SAFE
    )
    micro_batch: int = option("samples per DP rank (0: the run's)", 0, ge=0, le=1 << 20)
    edges: list[int] | None = option(
        "position bin edges instead of log-spaced ones, e.g. 2,1026,2050", None,
        ge=0, lt=INT64_SAFE, increasing=True, min_items=2, metavar="P0,P1,...",
    )  # fmt: skip
    seq_len: int = option(
        "evaluate on windows of L tokens cut out of the samples, each keeping its documents' "
        "positions (0: the samples' length)", 0, ge=0, le=1 << 40, metavar="L",
    )  # fmt: skip
    sp: int = option(
        "N Ulysses ranks instead of the run's layout (0: the run's parallel.sp; --nproc "
        "defaults to it)", 0, ge=0, le=MAX_PROCESSES, metavar="N",
    )  # fmt: skip
    rope: str = option(
        "score with this RoPE instead of the checkpoint's, as model.rope keys (another kind "
        "starts from its defaults, θ kept), e.g. kind=yarn,factor=4,"
        "original_max_position_embeddings=128", "", metavar="KEY=VALUE,...",
    )  # fmt: skip

    def check(self) -> None:
        check_flags(self)  # the ranges the fields declare, as the command line checks them
        e = self.edges
        if e is not None and (len(e) < 2 or any(b <= a for a, b in itertools.pairwise(e))):
            raise ConfigError(f"--edges must be 2 or more increasing positions, got {e}")


def _plan(checkpoint: str, manifest: str, opts: EvaluateOptions, world: int) -> Any:
    """What the parent checks before any process starts (one line each)."""

    trained = open_trained(checkpoint)
    cfg = with_rope(trained.cfg, opts.rope)
    if opts.micro_batch:
        cfg = replace(cfg, data=replace(cfg.data, micro_batch_size=opts.micro_batch))
    d = cfg.data
    m = Manifest.load(d.location(manifest), d.max_manifest_bytes)
    m.check_token_space(trained.space)
    length = opts.seq_len or m.seq_len
    check_window_length(m, length)
    p = cfg.parallel
    if opts.sp:  # a plain Ulysses layout of its own (ring and head groups change no figure)
        p = replace(p, sp=opts.sp, ring=1, head_groups=1)
    mc = cfg.model
    dp = Layout.from_config(
        replace(p, dp=0),  # dp follows the world
        world,
        num_heads=mc.num_attention_heads,
        num_kv_heads=mc.num_key_value_heads,
        seq_len=length,
    ).dp
    check_enough_windows(m, length, dp, d.micro_batch_size)
    cfg = replace(cfg, parallel=replace(p, dp=dp), data=replace(d, seq_len=length))
    return trained, cfg, m


def with_rope(cfg: RunConfig, rope: str) -> RunConfig:
    """``cfg`` with ``rope`` (``KEY=VALUE,...`` of ``model.rope``) over its RoPE, as a stage
    sets one: another kind starts from its own defaults, θ kept (one line if it is not a
    RoPE the model can run)."""
    if not rope:
        return cfg
    pairs = [p.strip() for p in rope.split(",") if p.strip()]
    if any("=" not in p for p in pairs):
        raise ConfigError(f"--rope: give KEY=VALUE pairs separated by commas, got {rope!r}")
    given = parse_overrides(f"model.rope.{p}" for p in pairs)["model"]["rope"]
    base = to_dict(cfg.model.rope)
    if "kind" in given and given["kind"] != base["kind"]:
        base = {"theta": base["theta"]}
    try:
        new = from_dict(RopeConfig, deep_merge(base, given), "model.rope")
    except ConfigError as e:
        raise ConfigError(f"--rope: {e}") from None
    return replace(cfg, model=replace(cfg.model, rope=new))


def _worker(payload: dict[str, Any], plan: Any = None) -> EvalResult:
    """One rank's evaluation; ``plan``: what the parent's :func:`_plan` gave, when it
    runs in the parent's process."""

    opts = EvaluateOptions(**payload["options"])
    trained, cfg, manifest = plan or _plan(
        payload["checkpoint"], payload["manifest"], opts, payload["world"]
    )
    place = open_world(cfg, deepspeed_comm=False)
    setup = build_inference_setup(cfg, trained.space, place, trained.load_into)
    mesh = place.mesh
    options = StreamOptions.from_config(cfg.data).in_order()
    d = cfg.data
    edges = opts.edges
    answers = None
    if has_answers(manifest):  # a recall probe: bins by answer distance
        edges = edges or bucket_edges(d.seq_len)
        answers = AnswerBins(read_answers(manifest), manifest.seq_len, d.seq_len, edges)
    stream: ShardStream | InOrderWindows
    if d.seq_len == manifest.seq_len:  # whole samples: the batches the training eval reads
        stream = ShardStream(manifest, mesh.dp_rank, mesh.dp, d.micro_batch_size, options)
    else:
        stream = InOrderWindows(
            manifest,
            mesh.dp_rank,
            mesh.dp,
            d.micro_batch_size,
            d.seq_len,
            options,
            d.window_positions,
        )
    bar = None
    try:
        per_epoch = (
            stream.batches_per_epoch
            if isinstance(stream, InOrderWindows)
            else stream.order.batches_per_epoch
        )
        count = min(opts.batches, per_epoch) if opts.batches else per_epoch

        def batch(samples: list[PackedSample]) -> Batch | tuple[Batch, Tensor]:
            b = samples_batch(samples, trained.space)
            return b if answers is None else (b, answers.of(samples))

        batches = (batch(stream.next_batch()) for _ in range(count))
        if mesh.rank == 0:  # one bar: a long evaluation shows where it is
            tqdm.set_lock(threading.RLock())  # not a multiprocessing lock (see train/loop.py)
            # on a terminal only (disable=None), and cleared however the loop ends, so an
            # error line stands alone
            bar = tqdm(
                batches, total=count, desc="evaluate", unit="batch", leave=False, disable=None
            )
            batches = bar
        result = evaluate_batches(
            setup, batches, units_for(trained.space, trained.tokenizers), edges
        )
    finally:
        if bar is not None:
            bar.close()
        stream.close()
    return result if answers is None else replace(result, binned_by="distance")


def evaluate_checkpoint(checkpoint: str, manifest: str, opts: EvaluateOptions) -> EvalResult:
    opts.check()
    if opts.nproc and in_launched_world():
        raise UserError("--nproc starts local processes; under torchrun leave it out")
    if not in_launched_world() and opts.nproc is None:
        opts = replace(opts, nproc=opts.sp or open_trained(checkpoint).cfg.parallel.sp)
    world = world_size(opts.nproc)
    plan = _plan(checkpoint, manifest, opts, world)  # what the user can fix: here, one line
    payload = {
        "checkpoint": str(checkpoint),
        "manifest": str(manifest),
        "options": asdict(opts),
        "world": world,
    }
    if world > 1 and not in_launched_world():
        out = launch.run_world(_worker, opts.nproc, payload)[0]
    else:
        out = _worker(payload, plan)  # this process (one of a launched world's ranks)
    return replace(
        out,
        bins={m: [tuple(r) for r in rows] for m, rows in out.bins.items()},
        units={m: tuple(u) for m, u in out.units.items()},
    )


def summary_text(r: EvalResult, seq_len: int = 0) -> str:
    """The figures as lines; ``seq_len`` > 0: they are of windows of that many tokens."""
    what = f"windows of {seq_len:,} tokens" if seq_len else "samples"
    lines = [f"evaluated {r.samples:,} {what} ({r.batches} micro-batches per DP rank)"]
    lines.append(f"  loss (weighted mean of the modalities): {r.loss:.4f} nats/token")
    bpu = r.bits_per_unit()
    for m in r.modalities:
        if m not in r.nats:
            continue
        unit = f", {bpu[m][1]:.4f} bits/{bpu[m][0]}" if m in bpu else ""
        lines.append(
            f"  {m}: {r.nats[m]:.4f} nats/token ({r.nats[m] / LN2:.4f} bits/token{unit}) over "
            f"{r.targets[m]:,} targets"
        )
    return "\n".join(lines)


def plot_positions(r: EvalResult, png: str | Path, title: str = "") -> Path:
    """Loss (bits per token) against the target's position in its document, log x."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: heavy (matplotlib)
    from matplotlib.figure import Figure  # lazy: heavy (matplotlib)

    fig = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bpu = r.bits_per_unit()
    for i, m in enumerate(r.modalities):
        rows = r.bins.get(m)
        if not rows:
            continue
        x = [math.sqrt(max(lo, 1) * max(hi - 1, 1)) for lo, hi, _, _ in rows]
        y = [v / LN2 for _, _, v, _ in rows]
        overall = f"{r.nats[m] / LN2:.3f} bits/token"
        if m in bpu:
            overall += f", {bpu[m][1]:.3f} bits/{bpu[m][0]}"
        ax.plot(x, y, "o-", ms=3, color=f"C{i}", label=f"{m} ({overall})")
    ax.set_xscale("log")
    ax.set_xlabel("position of the target in its document (tokens)")
    ax.set_ylabel("cross-entropy (bits per token)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title or f"loss by position ({r.samples:,} samples)")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    p = Path(png)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_local(p, buf.getvalue())
    return p


def cli(
    checkpoint: str, manifest: str, opts: EvaluateOptions, as_json: bool, png: str | None
) -> int:
    r = evaluate_checkpoint(checkpoint, manifest, opts)
    if int(os.environ.get("RANK", "0")) != 0:  # one of a launched world's ranks: rank 0 writes
        return 0
    if png:
        plot_positions(r, png, f"{Path(checkpoint).name} on {Path(manifest).parent.name}")
    if as_json:
        print(json.dumps(r.to_json(), indent=1))
    else:
        print(summary_text(r, opts.seq_len))
        if png:
            print(f"wrote {png}")
    return 0
