"""One rank's memory for one training step: :func:`estimate` puts the states, the
activations and the phases together and takes the peak over the phases.

On a GPU the total adds allocator headroom (fragmentation of the caching allocator, a
fraction of the tensor peak) and a runtime reserve, device memory that is not tensors:
the CUDA context and cuBLAS workspaces plus NCCL's buffers for every communicator this
rank is in. The tensor peak is what ``torch.cuda.max_memory_allocated`` reports on a GPU
and what :class:`ulysses_mm.tools.memory.TensorMemoryTracker` counts on CPU;
``device="cpu"`` estimates the latter (CPU optimizer path, batch layout and gloo
collectives; no headroom, reserve or kernel scratch), which is how the arithmetic is
checked against measurement (:mod:`ulysses_mm.tools.measure`, ``tests/distributed/test_estimate.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ulysses_mm.config import RunConfig
from ulysses_mm.core.errors import ConfigError
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tools.estimate.activations import Activations, activations, flex_block_mask_bytes
from ulysses_mm.tools.estimate.comm import sent_per_layer
from ulysses_mm.tools.estimate.phases import Phase, phases
from ulysses_mm.tools.estimate.shape import (
    ModelShape,
    StepShape,
    model_shape,
    step_shape,
    token_space,
)
from ulysses_mm.tools.estimate.units import GiB, size_text
from ulysses_mm.tools.estimate.zero import zero_states

# The runtime reserve on a GPU: the CUDA context with its kernels and cuBLAS/cuDNN
# workspaces ...
CONTEXT_RESERVE_GIB = 1.0
# ... and NCCL's buffers per communicator (channels × peers × NCCL_BUFFSIZE, plus NVLS
# buffers on NVSwitch nodes): a low default, ``--nccl-reserve`` sets the node's.
NCCL_GIB_PER_COMMUNICATOR = 0.5
# A node's host memory and GPUs (an 8-GPU node with 2 TiB): what offloaded states and
# checkpoints may take, ``--host-mem`` and ``--gpus-per-node`` set the node's.
HOST_GIB_PER_NODE = 2048.0
GPUS_PER_NODE = 8


@dataclass
class Estimate:
    """Per-rank memory of one training step (bytes)."""

    config: str
    space: dict[str, int]
    space_from: str
    step: StepShape  # the sizes it is for (the JSON's "layout")
    precision: str
    zero_stage: int
    offload_optimizer: str
    offload_param: str
    activation_checkpointing: bool
    offload_checkpoints: bool
    kernel: str
    device: str
    params: int
    shape: ModelShape
    states: dict[str, int]  # parameters, optimizer states, DeepSpeed buffers
    state_notes: dict[str, str]
    act: Activations
    phases: list[Phase]
    peak_phase: str
    peak: int  # tensor bytes at the peak
    headroom_fraction: float  # allocator headroom as a fraction of the peak (GPU only)
    reserve: int  # runtime reserve (GPU only)
    host: int  # bytes per rank in host memory (offloaded states)
    offloaded_peak: int | None  # the peak with checkpoints offloaded (what-if)
    gpu_mem: int | None = None
    notes: list[str] = field(default_factory=list)
    host_mem: int | None = None  # host memory of one node (bytes)
    gpus_per_node: int = GPUS_PER_NODE
    # bytes one rank sends per layer: the all-to-all over U ranks and the ring of R
    # (ulysses_mm.parallel.ring.ring_theory_bytes), forward and backward
    sent_per_layer: dict[str, int] = field(default_factory=dict)

    @property
    def headroom(self) -> int:
        return int(self.headroom_fraction * self.peak)

    @property
    def total(self) -> int:
        return self.peak + self.headroom + self.reserve

    @property
    def offloaded_total(self) -> int | None:
        """The total with checkpoints offloaded to the host (what-if)."""
        if self.offloaded_peak is None:
            return None
        return int(self.offloaded_peak * (1 + self.headroom_fraction)) + self.reserve

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_mem is None else self.total <= self.gpu_mem

    @property
    def host_checkpoints(self) -> int:
        """Host bytes of the layer inputs that offloaded checkpoints keep (in :attr:`host`
        when model.offload_checkpoints is on)."""
        return checkpoints_on_host(self.shape, self.act)

    @property
    def node_gpus(self) -> int:
        """GPUs of this run on one node, sharing its host memory."""
        return min(self.step.gpus, self.gpus_per_node)

    @property
    def host_per_node(self) -> int:
        return self.host * self.node_gpus

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_mem is None else self.host_per_node <= self.host_mem

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def to_dict(self) -> dict[str, Any]:
        d = {("layout" if k == "step" else k): v for k, v in asdict(self).items()}
        d["layout"] = self.step.to_dict()
        d["activations"] = d.pop("act")
        d["activations"]["layer"] = self.act.layer
        d["phases"] = {p.name: {t.name: t.bytes for t in p.terms} for p in self.phases}
        d["headroom"] = self.headroom
        d["total"] = self.total
        d["offloaded_total"] = self.offloaded_total
        d["fits"] = self.fits
        d["host_per_node"] = self.host_per_node
        d["host_fits"] = self.host_fits
        return d


@dataclass(frozen=True)
class EstimateOptions:
    """How to estimate a config: the layout, the device and its memory, the node.

    ``device='cuda'`` estimates a GPU (foreach AdamW, flash scratch, allocator headroom,
    runtime reserve); ``device='cpu'`` the tensor memory of a CPU process, which
    :mod:`ulysses_mm.tools.measure` measures. The runtime reserve is CONTEXT_RESERVE_GIB plus
    ``nccl_gib`` per NCCL communicator of the layout, or ``reserve_gib`` flat when given.
    ``head_groups`` (default: parallel.head_groups) runs attention in that many head
    groups; ``host_mem_gib`` is the host memory of a node of ``gpus_per_node`` GPUs that
    the offloaded states and checkpoints of its GPUs share (:attr:`Estimate.host_fits`)."""

    gpus: int | None = None  # world size (default parallel.sp × parallel.dp)
    sp: int | None = None  # sequence-parallel size (default: gpus when given, else parallel.sp)
    space: TokenSpace | None = None  # default: model.modalities, else the shipped specs'
    space_from: str = ""  # where ``space`` came from (shown)
    device: str = "cuda"
    headroom: float = 0.10  # allocator headroom as a fraction of the tensor peak (GPU only)
    reserve_gib: float | None = None
    nccl_gib: float = NCCL_GIB_PER_COMMUNICATOR
    gpu_mem_gib: float | None = None  # the memory of one GPU (``fits``)
    config_name: str = ""
    head_groups: int | None = None
    host_mem_gib: float | None = None
    gpus_per_node: int = GPUS_PER_NODE


def estimate(cfg: RunConfig, seq_len: int, opts: EstimateOptions | None = None) -> Estimate:
    """Per-rank memory of one training step of ``cfg`` at ``seq_len`` tokens per sample,
    under ``opts`` (default :class:`EstimateOptions`: a GPU, the config's layout)."""
    o = opts or EstimateOptions()
    device, space, space_from = o.device, o.space, o.space_from
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device!r}")
    if space is None:
        space, space_from = token_space(cfg)
    ds = cfg.deepspeed
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer needs deepspeed.zero_stage >= 1")
    if ds.offload_param != "none" and ds.zero_stage != 3:
        raise ConfigError("deepspeed.offload_param needs deepspeed.zero_stage=3")
    step = step_shape(cfg, seq_len, o.gpus, o.sp, o.head_groups)
    sh = model_shape(cfg, space)
    cuda = device == "cuda"
    kernel = _kernel(cfg, device, step)
    a = 4 if ds.precision == "fp32" else 2
    zs = zero_states(cfg, sh, space, a, step.gpus, step.sp, cuda)
    act = activations(cfg, sh, step, a, cuda, kernel)
    every = phases(cfg, sh, zs, act, a)
    top = max(every, key=lambda p: p.bytes)
    offloaded = None
    host = zs.host
    if cfg.model.offload_checkpoints:
        host += checkpoints_on_host(sh, act)
    elif cfg.model.activation_checkpointing:
        offloaded = max(p.bytes for p in phases(cfg, sh, zs, act, a, offload_checkpoints=True))
    if cuda and o.reserve_gib is None:
        reserve = int((CONTEXT_RESERVE_GIB + o.nccl_gib * step.communicators) * GiB)
    else:
        reserve = int((o.reserve_gib or 0.0) * GiB) if cuda else 0
    return Estimate(
        config=o.config_name,
        space=space.vocab(),
        space_from=space_from,
        step=step,
        precision=ds.precision,
        zero_stage=ds.zero_stage,
        offload_optimizer=ds.offload_optimizer,
        offload_param=ds.offload_param,
        activation_checkpointing=cfg.model.activation_checkpointing,
        offload_checkpoints=cfg.model.offload_checkpoints,
        kernel=kernel,
        device=device,
        params=sh.params,
        shape=sh,
        states={
            "params": zs.params,
            "optimizer": zs.optimizer,
            "persistent": zs.persistent,
        },
        state_notes=zs.notes,
        act=act,
        phases=every,
        peak_phase=top.name,
        peak=top.bytes,
        headroom_fraction=o.headroom if cuda else 0.0,
        reserve=reserve,
        host=host,
        offloaded_peak=offloaded,
        gpu_mem=int(o.gpu_mem_gib * GiB) if o.gpu_mem_gib else None,
        notes=_notes(kernel, step, act),
        sent_per_layer=sent_per_layer(sh, step, a),
        host_mem=int(o.host_mem_gib * GiB) if o.host_mem_gib else None,
        gpus_per_node=o.gpus_per_node,
    )


def checkpoints_on_host(sh: ModelShape, act: Activations) -> int:
    """Every layer's input but the last (whose backward comes first) on the host:
    ``model.offload_checkpoints`` (:mod:`ulysses_mm.model.offload`)."""
    return (sh.layers - 1) * act.residual


def _kernel(cfg: RunConfig, device: str, step: StepShape) -> str:
    """The kernel a GPU with flash-attn (or a CPU) runs for this precision; with a ring,
    the ring's blocks in its place: flash-attn's varlen calls where it runs, the dense
    PyTorch kernel elsewhere."""
    from ulysses_mm.model.attention import choose_kernel  # lazy: the estimate stays torch-free

    ds = cfg.deepspeed
    kernel = choose_kernel(cfg.parallel.attention, device, ds.precision, flash=device == "cuda")
    if step.ring_size > 1:
        kernel = "ring_flash" if kernel == "flash_varlen" else "ring"
    return kernel


def _notes(kernel: str, step: StepShape, act: Activations) -> list[str]:
    """What the breakdown should warn about for this kernel."""
    notes = []
    if kernel == "sdpa_dense":
        notes.append("sdpa_dense keeps [b, s, s] masks: memory grows with s² whatever sp is")
    if kernel == "flex":
        notes.append(
            "flex attention is counted like the flash kernels, plus its block mask "
            f"({flex_block_mask_bytes(step.micro_batch, step.seq_len) / (1 << 20):.1f} MiB)"
        )
    if step.head_groups > 1:
        notes.append(
            f"attention in {step.head_groups} head groups: backward recomputes each group's "
            "attention forward (one more per layer) and sends its q, k, v once more"
        )
    if kernel == "ring":
        notes.append(
            "ring attention's PyTorch block kernel is dense: five [hq/U, N/R, N/R] fp32 at once "
            f"in backward ({size_text(5 * act.ring_scores)}), growing with (N/R)² whatever U is"
        )
    return notes


def host_refusal(est: Estimate) -> str:
    """The one line that refuses a plan whose host memory exceeds the node's."""
    assert est.host_mem is not None
    ckpt = est.host_checkpoints if est.offload_checkpoints else 0
    return (
        f"host memory: {est.host / GiB:.1f} GiB per GPU (offloaded states "
        f"{(est.host - ckpt) / GiB:.1f} + checkpoints {ckpt / GiB:.1f}) × {est.node_gpus} GPUs "
        f"of a node = {est.host_per_node / GiB:.1f} GiB, more than --host-mem "
        f"{est.host_mem / GiB:g} GiB; use a shorter sequence or more nodes, or raise --host-mem"
    )
