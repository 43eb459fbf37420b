"""Measure what real training steps hold in memory and how fast they run, per rank: the
check of :mod:`ulysses_mm.tools.estimate` and the engine of ``benchmarks/gpu/bench_gpu.py``.

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
:class:`~ulysses_mm.tools.memory.TensorMemoryTracker`, entered before the model is built so that
every tensor storage the process creates is counted (parameters, DeepSpeed's flat buffers
and optimizer states, activations, gradients, collective buffers). Kernel-internal scratch
is not a tensor on CPU and is not counted there. What offloaded checkpoints hold in host
memory is not in the peak: ``host`` reports it apart (the setup's
:class:`~ulysses_mm.model.offload.Offload`).
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ulysses_mm.config import RunConfig, from_dict
from ulysses_mm.core.tokenspace import DEFAULT_MODALITIES, TokenSpace
from ulysses_mm.loader.batch import Batch
from ulysses_mm.loader.synthetic import single_modality_batch
from ulysses_mm.model.offload import HostCounter
from ulysses_mm.parallel.mesh import Place, open_world
from ulysses_mm.tools.memory import TensorMemoryTracker
from ulysses_mm.train.flops import causal_pairs, train_flops
from ulysses_mm.train.step import build_setup, train_step


def run_space(cfg: RunConfig) -> TokenSpace:
    """The model's token space: ``model.modalities``, else the shipped specs' space."""

    return TokenSpace.from_vocab(cfg.model.modalities or DEFAULT_MODALITIES)


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
    flops: float  # model FLOPs per step over the whole world (train.flops.train_flops)
    device: str
    host: int = 0  # most bytes the offloaded checkpoints held in host memory (apart)

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

    def __init__(self, cfg: RunConfig, place: Place) -> None:
        self.cfg, self.place = cfg, place
        self.mesh, self.device = place.mesh, place.device
        self.space = run_space(cfg)
        self.tracker: TensorMemoryTracker | None = None
        self.counter: Any
        if self.device.type == "cuda":
            self.counter = _CudaCounter(self.device)
        else:
            self.tracker = self.counter = TensorMemoryTracker()
            self.tracker.__enter__()
        try:
            self.setup = build_setup(cfg, self.space, place)
            self.model, self.kernel = self.setup.model, self.setup.kernel
            warm = 16 * self.mesh.sp
            self.step(self.batch(warm, min(warm, 64), seed=1))
        except BaseException:
            self.close()
            raise

    def batch(self, seq_len: int, doc_len: int, seed: int = 0) -> Batch:
        """The measured batch: ``micro_batch_size`` samples of ``seq_len`` tokens in
        documents of ``doc_len``, all of the modality with the widest head."""
        b = self.cfg.data.micro_batch_size
        return single_modality_batch(self.space, b, seq_len, doc_len, seed=seed)

    def step(self, batch: Batch) -> None:
        """One training step on ``batch`` (untimed, unmeasured)."""
        train_step(self.setup, [batch], grad_norm=False)

    def measure(self, seq_len: int, doc_len: int | None = None, steps: int = 1) -> MeasuredStep:
        """``steps`` training steps of ``seq_len`` tokens (documents of ``doc_len``,
        default min(seq_len, 4096)); their mean time and the peak memory among them."""

        m = self.cfg.model
        self.mesh.layout.check(m.num_attention_heads, m.num_key_value_heads, seq_len)
        batch = self.batch(seq_len, doc_len or min(seq_len, 4096))
        gc.collect()
        if isinstance(self.counter, _CudaCounter):
            self.counter.reset_peak()
        else:
            self.counter.peak = self.counter.live
        base = self.counter.live
        host = self.setup.offload.host if self.setup.offload is not None else HostCounter()
        host.reset_peak()
        host0 = host.live
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(batch)
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
            host=host.peak - host0,
        )

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.tracker = None


def measure_step(
    cfg: RunConfig, seq_len: int, place: Place, doc_len: int | None = None
) -> MeasuredStep:
    """Build the run's engine on this rank, warm it up, measure one step of ``seq_len``."""
    runner = StepRunner(cfg, place)
    try:
        return runner.measure(seq_len, doc_len)
    finally:
        runner.close()


def measure_worker(
    rank: int, world: int, cfg_dict: dict[str, Any], seq_len: int, doc_len: int | None = None
) -> dict[str, Any]:
    """:func:`measure_step` on one rank of an initialised gloo world (the signature of
    tests/helpers/gloo.py's ``run_distributed``); sp = the config's parallel.sp."""
    cfg = from_dict(RunConfig, cfg_dict)
    return measure_step(cfg, seq_len, open_world(cfg, device="cpu"), doc_len).to_dict()


def measure_launched(
    cfg_dict: dict[str, Any], seq_len: int, doc_len: int | None = None
) -> dict[str, Any]:
    """:func:`measure_step` on this rank of a world a launcher started (torchrun, the
    DeepSpeed launcher, :func:`ulysses_mm.parallel.launch.launch_local`): NCCL on GPUs,
    else gloo."""
    cfg = from_dict(RunConfig, cfg_dict)
    return measure_step(cfg, seq_len, open_world(cfg), doc_len).to_dict()
