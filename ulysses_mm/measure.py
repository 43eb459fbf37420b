"""Measure what one real training step holds in memory, per rank: the check of
:mod:`ulysses_mm.estimate`.

One step here is exactly the training path of ``ulysses-mm train``: the model built from
the run config, :func:`~ulysses_mm.parallel.apply_ulysses`, the DeepSpeed engine of
:func:`~ulysses_mm.train.engine.build_engine` (ZeRO stage, precision and offload as
configured), the sequence-parallel slice of a packed batch, the global loss, backward and
the optimizer step. Only the data is synthetic.

The batch is the estimate's worst case: every document belongs to the modality with the
largest output head, so every loss tile runs through that head. A first step on a short
sequence creates the optimizer states and DeepSpeed's buffers (steady state, as from the
second step of training); the measured step then runs at the full length.

Peak memory: on CUDA the caching allocator's ``max_memory_allocated``; on CPU
:class:`~ulysses_mm.memory.TensorMemoryTracker`, entered before the model is built so that
every tensor storage the process creates is counted (parameters, DeepSpeed's flat buffers
and optimizer states, activations, gradients, collective buffers). Kernel-internal scratch
is not a tensor on CPU and is not counted there.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ulysses_mm.config import RunConfig, from_dict
from ulysses_mm.data.batch import Batch, make_batch, sp_slice
from ulysses_mm.tokenspace import DOC_END, DOC_START, TokenSpace

# the token space of the shipped specs (tokenizers/dna-base, audio-mulaw-16k, video-vq)
DEFAULT_MODALITIES = {"dna": 10, "audio": 256, "video": 256}


def run_space(cfg: RunConfig) -> TokenSpace:
    """The model's token space: ``model.modalities``, else the shipped specs' space."""
    return TokenSpace.from_vocab(cfg.model.modalities or DEFAULT_MODALITIES)


def largest_head(space: TokenSpace) -> str:
    """The modality whose head is widest (its logits tile is the largest)."""
    return max(space.ranges, key=lambda r: r.size).name


def single_modality_batch(
    space: TokenSpace,
    batch: int,
    seq_len: int,
    doc_len: int,
    modality: str | None = None,
    seed: int = 0,
) -> Batch:
    """``batch`` packed samples of ``seq_len`` tokens: documents of ``doc_len`` tokens
    (``<doc> <|m|> ... </doc>``, the last one cut at the sample end), all of one modality
    (default: the one with the largest head)."""
    if seq_len < 4 or doc_len < 4:
        raise ValueError(f"need seq_len and doc_len >= 4, got {seq_len} and {doc_len}")
    name = modality or largest_head(space)
    r = space.range(name)
    m = space.index(name)
    rng = np.random.default_rng(seed)
    tokens = np.empty((batch, seq_len), dtype=np.int64)
    tables = []
    doc_id = 0
    for row in range(batch):
        rows = []
        for start in range(0, seq_len, doc_len):
            length = min(doc_len, seq_len - start)
            doc = rng.integers(r.start, r.stop, size=length)
            doc[0] = DOC_START
            if length > 1:
                doc[1] = space.boundary_token(name)
            if length > 2:
                doc[-1] = DOC_END
            tokens[row, start : start + length] = doc
            rows.append([start, length, m, doc_id, 0])
            doc_id += 1
        tables.append(np.array(rows, dtype=np.int64))
    return make_batch(tokens, tables, space)


@dataclass
class MeasuredStep:
    """One rank's figures for one training step (bytes)."""

    rank: int
    sp: int
    dp: int
    seq_len: int
    peak: int  # most bytes live at once during the step
    base: int  # bytes live just before it: parameters, optimizer states, buffers, the batch
    step_s: float
    device: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _CudaPeak:
    """The CUDA caching allocator's counters behind the tracker's interface."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def live(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    @property
    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


def measure_step(
    cfg: RunConfig,
    seq_len: int,
    mesh: Any,
    device: str = "cpu",
    doc_len: int | None = None,
    warmup_len: int | None = None,
) -> MeasuredStep:
    """Build the run's engine on this rank (inside an initialised world when
    ``mesh.world_size > 1``), run a short warm-up step, then measure one step of
    ``seq_len`` tokens. ``doc_len`` defaults to min(seq_len, 4096)."""
    from ulysses_mm.memory import TensorMemoryTracker
    from ulysses_mm.model import build_model
    from ulysses_mm.model.attention import resolve_kernel
    from ulysses_mm.parallel import apply_ulysses, global_loss, loss_weights
    from ulysses_mm.parallel.ulysses import check_sp_shapes
    from ulysses_mm.train.engine import build_engine, loss_scale

    check_sp_shapes(seq_len, cfg.model.num_attention_heads, mesh.sp)
    space = run_space(cfg)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    b = cfg.data.micro_batch_size
    warm = warmup_len or 16 * mesh.sp
    counter: Any
    tracker = None
    if dev.type == "cuda":
        counter = _CudaPeak(dev)
    else:
        tracker = counter = TensorMemoryTracker()
        tracker.__enter__()
    try:
        kernel = resolve_kernel(cfg.parallel.attention, dev.type)
        model = build_model(cfg.model, space, kernel, seed=cfg.train.seed)
        apply_ulysses(model, mesh)
        engine, _, _ = build_engine(model.to(dev), cfg, mesh)
        weights = loss_weights(space.modalities, cfg.model.loss_weights, dev)

        def step(batch: Batch) -> None:
            local = sp_slice(batch, mesh.sp_rank, mesh.sp).to(dev)
            sums, counts = engine(
                local.input_ids,
                local.position_ids,
                local.doc_ids,
                local.labels,
                local.label_modality,
            )
            share, _ = global_loss(sums, counts, weights, mesh, space.modalities)
            engine.backward(share * loss_scale(mesh))
            engine.step()

        step(single_modality_batch(space, b, warm, min(warm, 64), seed=1))
        batch = single_modality_batch(space, b, seq_len, doc_len or min(seq_len, 4096))
        gc.collect()
        if isinstance(counter, _CudaPeak):
            counter.reset_peak()
        else:
            counter.peak = counter.live
        base = counter.live
        t0 = time.perf_counter()
        step(batch)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        peak = counter.peak
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    return MeasuredStep(
        rank=mesh.rank,
        sp=mesh.sp,
        dp=mesh.dp,
        seq_len=seq_len,
        peak=int(peak),
        base=int(base),
        step_s=dt,
        device=dev.type,
    )


def measure_worker(
    rank: int, world: int, cfg_dict: dict[str, Any], seq_len: int, doc_len: int | None = None
) -> dict[str, Any]:
    """``measure_step`` on one rank of an initialised gloo world (tests/distributed.py's
    ``run_distributed`` signature); sp = the config's parallel.sp."""
    import os

    import deepspeed

    from ulysses_mm.parallel import Mesh

    cfg = from_dict(RunConfig, cfg_dict)
    # what a launcher would have set; DeepSpeed checks LOCAL_RANK before anything
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    deepspeed.init_distributed("gloo", verbose=False)
    mesh = Mesh.build(cfg.parallel.sp, cfg.parallel.dp)
    return measure_step(cfg, seq_len, mesh, "cpu", doc_len).to_dict()


def measure_single(cfg: RunConfig, seq_len: int, doc_len: int | None = None) -> MeasuredStep:
    """``measure_step`` in this process as a one-rank world (DeepSpeed needs a process
    group even for one process)."""
    import deepspeed

    from ulysses_mm.parallel import Mesh
    from ulysses_mm.parallel.mesh import init_distributed
    from ulysses_mm.train.loop import _single_process_env

    _single_process_env()
    init_distributed("gloo")
    deepspeed.init_distributed("gloo", verbose=False)
    return measure_step(cfg, seq_len, Mesh.build(1), "cpu", doc_len)
