"""Measure what real training steps hold in memory and how fast they run, per rank: the
check of :mod:`ulysses_mm.estimate` and the engine of ``benchmarks/gpu/bench_gpu.py``.

A step here is exactly the training path of ``ulysses-mm train``: the model built from the
run config, :func:`~ulysses_mm.parallel.apply_ulysses`, the DeepSpeed engine of
:func:`~ulysses_mm.train.engine.build_engine` (ZeRO stage, precision and offload as
configured), the sequence-parallel slice of a packed batch, the global loss, backward and
the optimizer step. Only the data is synthetic.

The batch is the estimate's worst case: every document belongs to the modality with the
widest output head, so every loss tile runs through that head. A first step on a short
sequence creates the optimizer states and DeepSpeed's buffers (the steady state of
training from its second step on); measured steps then run at any length on the same
engine.

Peak memory: on CUDA the caching allocator's ``max_memory_allocated``; on CPU
:class:`~ulysses_mm.memory.TensorMemoryTracker`, entered before the model is built so that
every tensor storage the process creates is counted (parameters, DeepSpeed's flat buffers
and optimizer states, activations, gradients, collective buffers). Kernel-internal scratch
is not a tensor on CPU and is not counted there.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ulysses_mm.config import RunConfig, from_dict
from ulysses_mm.data.batch import Batch, make_batch, sp_slice
from ulysses_mm.tokenspace import DOC_END, DOC_START, TokenSpace


def run_space(cfg: RunConfig) -> TokenSpace:
    """The model's token space: ``model.modalities``, else the shipped specs' space."""
    from ulysses_mm.tokenspace import DEFAULT_MODALITIES

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
    (default: the one with the widest head)."""
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
    """One rank's figures for training steps of ``seq_len`` tokens per sample."""

    rank: int
    sp: int
    dp: int
    seq_len: int
    peak: int  # most bytes live at once during the measured steps
    base: int  # bytes live just before them: parameters, optimizer states, buffers, batch
    step_s: float  # mean seconds per step
    tokens: int  # tokens per step over the whole world (b · N · dp)
    flops: float  # model FLOPs per step over the whole world (train.metrics.train_flops)
    device: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


class _CudaCounter:
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


class StepRunner:
    """The run's model and DeepSpeed engine on this rank (inside an initialised world
    when ``mesh.world_size > 1``), warmed up, ready to measure steps at any length.

    On CPU every tensor storage is counted from construction to :meth:`close`."""

    def __init__(self, cfg: RunConfig, mesh: Any, device: str = "cpu") -> None:
        from ulysses_mm.memory import TensorMemoryTracker
        from ulysses_mm.model import build_model
        from ulysses_mm.model.attention import resolve_kernel
        from ulysses_mm.parallel import apply_ulysses, loss_weights
        from ulysses_mm.train.engine import build_engine

        self.cfg, self.mesh = cfg, mesh
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.space = run_space(cfg)
        self.tracker: TensorMemoryTracker | None = None
        self.counter: Any
        if dev.type == "cuda":
            self.counter = _CudaCounter(dev)
        else:
            self.tracker = self.counter = TensorMemoryTracker()
            self.tracker.__enter__()
        try:
            self.kernel = resolve_kernel(cfg.parallel.attention, dev.type, cfg.deepspeed.precision)
            self.model = build_model(cfg.model, self.space, self.kernel, seed=cfg.train.seed)
            apply_ulysses(self.model, mesh)
            self.engine, _, _ = build_engine(self.model.to(dev), cfg, mesh)
            self.weights = loss_weights(self.space.modalities, cfg.model.loss_weights, dev)
            warm = 16 * mesh.sp
            self._step(self._batch(warm, min(warm, 64), seed=1))
        except BaseException:
            self.close()
            raise

    def _batch(self, seq_len: int, doc_len: int, seed: int = 0) -> Batch:
        b = self.cfg.data.micro_batch_size
        return single_modality_batch(self.space, b, seq_len, doc_len, seed=seed)

    def _step(self, batch: Batch) -> None:
        from ulysses_mm.parallel import global_loss
        from ulysses_mm.train.engine import loss_scale

        local = sp_slice(batch, self.mesh.sp_rank, self.mesh.sp).to(self.device)
        sums, counts = self.engine(
            local.input_ids, local.position_ids, local.doc_ids, local.labels, local.label_modality
        )
        share, _ = global_loss(sums, counts, self.weights, self.mesh, self.space.modalities)
        self.engine.backward(share * loss_scale(self.mesh))
        self.engine.step()

    def measure(self, seq_len: int, doc_len: int | None = None, steps: int = 1) -> MeasuredStep:
        """``steps`` training steps of ``seq_len`` tokens (documents of ``doc_len``,
        default min(seq_len, 4096)); their mean time and the peak memory among them."""
        from ulysses_mm.parallel.ulysses import check_sp_shapes
        from ulysses_mm.train.metrics import causal_pairs, train_flops

        check_sp_shapes(seq_len, self.cfg.model.num_attention_heads, self.mesh.sp)
        batch = self._batch(seq_len, doc_len or min(seq_len, 4096))
        gc.collect()
        if isinstance(self.counter, _CudaCounter):
            self.counter.reset_peak()
        else:
            self.counter.peak = self.counter.live
        base = self.counter.live
        t0 = time.perf_counter()
        for _ in range(steps):
            self._step(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = (time.perf_counter() - t0) / steps
        dp = self.mesh.dp
        targets = batch.label_modality[batch.labels != -100]
        heads = {m: int((targets == i).sum()) * dp for i, m in enumerate(self.space.modalities)}
        tokens = batch.input_ids.numel() * dp
        flops = train_flops(self.model, tokens, causal_pairs(batch.doc_ids) * dp, heads)
        return MeasuredStep(
            rank=self.mesh.rank,
            sp=self.mesh.sp,
            dp=dp,
            seq_len=seq_len,
            peak=int(self.counter.peak),
            base=int(base),
            step_s=dt,
            tokens=tokens,
            flops=flops,
            device=self.device.type,
        )

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.tracker = None


def measure_step(
    cfg: RunConfig, seq_len: int, mesh: Any, device: str = "cpu", doc_len: int | None = None
) -> MeasuredStep:
    """Build the run's engine on this rank, warm it up, measure one step of ``seq_len``."""
    runner = StepRunner(cfg, mesh, device)
    try:
        return runner.measure(seq_len, doc_len)
    finally:
        runner.close()


def _launcher_env(rank: int, world: int) -> None:
    # what a launcher would have set; DeepSpeed checks LOCAL_RANK before anything
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))


def measure_worker(
    rank: int, world: int, cfg_dict: dict[str, Any], seq_len: int, doc_len: int | None = None
) -> dict[str, Any]:
    """:func:`measure_step` on one rank of an initialised gloo world (the signature of
    tests/distributed.py's ``run_distributed``); sp = the config's parallel.sp."""
    import deepspeed

    from ulysses_mm.parallel import Mesh

    cfg = from_dict(RunConfig, cfg_dict)
    _launcher_env(rank, world)
    deepspeed.init_distributed("gloo", verbose=False)
    mesh = Mesh.build(cfg.parallel.sp, cfg.parallel.dp)
    return measure_step(cfg, seq_len, mesh, "cpu", doc_len).to_dict()


def measure_launched(
    cfg_dict: dict[str, Any], seq_len: int, doc_len: int | None = None
) -> dict[str, Any]:
    """:func:`measure_step` on this rank of a world a launcher started (torchrun, the
    DeepSpeed launcher, :func:`ulysses_mm.parallel.launch.launch_local`): NCCL on GPUs,
    else gloo."""
    import deepspeed

    from ulysses_mm.parallel import Mesh
    from ulysses_mm.parallel.mesh import default_backend, init_distributed

    cfg = from_dict(RunConfig, cfg_dict)
    backend = default_backend(cfg.parallel.backend)
    init_distributed(backend, cfg.parallel.timeout_s)
    deepspeed.init_distributed(backend, verbose=False)
    mesh = Mesh.build(cfg.parallel.sp, cfg.parallel.dp)
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if backend == "nccl" else "cpu"
    return measure_step(cfg, seq_len, mesh, device, doc_len).to_dict()
