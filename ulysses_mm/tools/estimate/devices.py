"""The machines a step time is predicted for: each GPU kind's datasheet figures, and the one
set of efficiency factors that turns peaks into achieved rates.

A :class:`DeviceKind` holds what a vendor's datasheet states for one GPU of an 8-GPU
board (dense bf16 peak, memory, HBM bandwidth, the GPU-to-GPU link inside a node, the
network per GPU between nodes, PCIe to the host), each row with its source. Bandwidths are
per direction: a datasheet's bidirectional NVLink/xGMI figure is halved.

:data:`EFFICIENCY` is the fraction of each peak that a step reaches (matmuls, attention
kernels, collectives on a link, the share of compute that overlappable communication hides
behind). It is one set for every GPU prediction, chosen from public kernel and collective
figures, not fitted to any run; ``docs/throughput.md`` lists it beside the predictions. A
measured device (``benchmarks/bench_estimate_time.py`` calibrates ``cpu`` from its own
microbenchmarks) states achieved rates already, so it goes with :data:`MEASURED`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceKind:
    """One accelerator kind: peaks in FLOP/s and bytes/s, latencies in seconds."""

    name: str
    peak_flops: float  # dense bf16 matmul peak (no sparsity)
    memory_gib: float  # device memory (the estimate's default --gpu-mem)
    hbm_bytes_s: float  # device memory bandwidth (the optimizer step is bound by it)
    intra_bytes_s: float  # GPU-to-GPU inside a node (NVLink / xGMI), per direction
    inter_bytes_s: float  # network between nodes per GPU (one NIC), per direction
    pcie_bytes_s: float  # host link per GPU, per direction (offload traffic)
    source: str  # where the figures come from
    # the peak of attention kernels where it differs from the matmul peak (a measured
    # device: its attention kernel's own rate); 0 = peak_flops
    attention_flops: float = 0.0
    # the attention kernel's cost per query row beyond its pairs (seconds per token and
    # query head, forward + backward): loading q, writing the output and its statistics,
    # the per-block work; 0 on a datasheet row, where long rows make it vanish
    attention_row_s: float = 0.0
    # element-wise work (norms, RoPE, SwiGLU's gate, residual adds; forward + backward) in
    # seconds per token per layer, and the loss's softmax per target per vocabulary entry;
    # 0 on a datasheet row: derived from the bytes it moves over HBM (step_time)
    token_layer_s: float = 0.0
    target_vocab_s: float = 0.0
    intra_latency_s: float = 10e-6  # one collective call inside a node
    inter_latency_s: float = 25e-6  # one collective call across nodes
    host_adam_params_s: float = 1.0e9  # CPU Adam (offloaded optimizer), params/s per GPU

    @property
    def attention_peak(self) -> float:
        return self.attention_flops or self.peak_flops

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_TB = 1e12
_GB = 1e9

# Dense bf16 peaks (the datasheets' sparse figure halved), per-direction links. The
# inter-node figure is one 400 Gb/s NIC per GPU (200 Gb/s for A100 systems), as the
# vendors' reference 8-GPU systems have.
GPU_KINDS: dict[str, DeviceKind] = {
    "h100": DeviceKind(
        "H100 SXM 80GB",
        989 * _TB,
        80,
        3.35 * _TB,
        450 * _GB,
        50 * _GB,
        64 * _GB,
        "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): BF16 "
        "1,979 TFLOPS with sparsity, 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s; "
        "DGX H100: 400 Gb/s ConnectX-7 per GPU",
    ),
    "h200": DeviceKind(
        "H200 SXM 141GB",
        989 * _TB,
        141,
        4.8 * _TB,
        450 * _GB,
        50 * _GB,
        64 * _GB,
        "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): BF16 "
        "1,979 TFLOPS with sparsity, 141 GB, 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s",
    ),
    "a100": DeviceKind(
        "A100 SXM 80GB",
        312 * _TB,
        80,
        2.039 * _TB,
        300 * _GB,
        25 * _GB,
        32 * _GB,
        "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100): BF16 "
        "312 TFLOPS, 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s; DGX A100: 200 Gb/s "
        "HDR per GPU",
    ),
    "b200": DeviceKind(
        "B200 180GB",
        2250 * _TB,
        180,
        8.0 * _TB,
        900 * _GB,
        50 * _GB,
        64 * _GB,
        "NVIDIA HGX B200 datasheet (nvidia.com/en-us/data-center/hgx): FP16/BF16 4.5 PFLOPS "
        "with sparsity per GPU, 180 GB HBM3e, 8 TB/s, NVLink 5 1.8 TB/s, PCIe Gen5; DGX "
        "B200: 400 Gb/s ConnectX-7 per GPU",
    ),
    "mi300x": DeviceKind(
        "MI300X 192GB",
        1307 * _TB,
        192,
        5.3 * _TB,
        448 * _GB,
        50 * _GB,
        64 * _GB,
        "AMD Instinct MI300X datasheet (amd.com/en/products/accelerators/instinct/mi300/"
        "mi300x.html): BF16 1,307.4 TFLOPS dense, 192 GB HBM3, 5.3 TB/s, Infinity Fabric "
        "896 GB/s peer aggregate, PCIe Gen5 128 GB/s; 400 Gb/s NIC per GPU",
    ),
}


@dataclass(frozen=True)
class Efficiency:
    """The fractions of a device's peaks that a training step reaches."""

    matmul: float  # GEMMs (projections, MLP, output heads), of the bf16 peak
    attention: float  # causal attention forward + backward in model FLOPs, of the peak
    link: float  # the bandwidth a collective reaches, of the link's (NCCL bus bandwidth)
    memory: float  # of HBM bandwidth, for the memory-bound optimizer step
    overlap: float  # of the compute time that overlappable communication can hide behind
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"matmul {self.matmul:.0%}, attention {self.attention:.0%}, links {self.link:.0%}, "
            f"HBM {self.memory:.0%}, overlap {self.overlap:.0%}"
        )


# One set for every GPU prediction, never fitted per run: large bf16 GEMMs reach 60-75 % of
# the dense peak (torchtitan / Megatron-LM Llama-8B runs report 40-55 % MFU for the whole
# step); flash attention's forward + backward in model FLOPs reaches about 35 % of an H100
# (flash-attn 2) to 60 % (flash-attn 3); NCCL all-to-all and ring collectives reach 70-80 %
# of a link's bandwidth at the message sizes of long sequences.
EFFICIENCY = Efficiency(
    matmul=0.60,
    attention=0.40,
    link=0.70,
    memory=0.70,
    overlap=0.80,
    note="one set for every GPU prediction, from public kernel and collective figures",
)

# A measured device's figures are achieved rates already; its communication is taken as
# exposed (gloo's collectives on a few CPU cores hide behind nothing).
MEASURED = Efficiency(
    matmul=1.0,
    attention=1.0,
    link=1.0,
    memory=1.0,
    overlap=0.0,
    note="a measured device: its rates are what its microbenchmarks reached",
)


def gpu_kind(name: str) -> DeviceKind:
    """The datasheet row of ``name`` (a key of :data:`GPU_KINDS`)."""
    return GPU_KINDS[name]
