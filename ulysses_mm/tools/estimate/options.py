"""``ulysses-mm estimate``'s arguments, one dataclass: its fields are the command's flags
(:mod:`ulysses_mm.cli.declare`), its docstring the command's description, and
:func:`~ulysses_mm.tools.estimate.cli.run_cli` reads them."""

from __future__ import annotations

from dataclasses import dataclass

from ulysses_mm.config.parse import option, overrides, positional
from ulysses_mm.core.checks import MAX_PROCESSES
from ulysses_mm.tools.estimate.cli import run_cli
from ulysses_mm.tools.estimate.devices import GPU_KINDS
from ulysses_mm.tools.estimate.documents import SPEC_HELP

# sizes here are arithmetic, not processes: bounds where a figure stops meaning a machine
# (2^20 GPUs, 2^20 GiB per GPU, 2^30 GiB per node, 2^40 tokens)
_MAX_GPUS = 1 << 20
_MAX_GIB = float(1 << 20)


@dataclass
class EstimateArgs:
    """Estimate the per-GPU memory of one training step of CONFIG from the config alone:
    parameters, gradients and optimizer states under its ZeRO stage and offload,
    activations per layer at N/sp tokens with and without activation checkpointing (and
    with checkpoints offloaded), the attention working set after the all-to-all, MLP and
    loss tiles, communication buffers, allocator headroom. With --max, the longest
    sequence that fits --gpu-mem. A config with train.stages is estimated stage by stage on
    one world (each stage's length, micro-batch, sp, ring and head groups; dp = gpus / its
    sp): one line per stage, then the breakdown of the peak stage; with --gpu-mem, a stage
    that does not fit is refused (exit 2). With --time, the step time on --gpu-kind GPUs
    (and with train.stages each stage's and the whole run's); with --best, the fastest
    layouts that fit."""

    config: str = positional(
        "run config YAML, or a shipped config's name (ulysses-mm configs)", "run_config"
    )
    overrides: list[str] = overrides()
    gpus: int | None = option(
        "GPUs in all (world size; default parallel.sp × parallel.dp; with train.stages and "
        "parallel.dp 0, the largest stage sp)", None, ge=1, le=_MAX_GPUS,
    )  # fmt: skip
    sp: int | None = option(
        "sequence-parallel size (default: --gpus when given, else parallel.sp); dp = gpus/sp. "
        "Refused with train.stages: each stage sets its own", None, ge=1, le=_MAX_GPUS,
    )  # fmt: skip
    gpu_mem: float | None = option(
        "memory of one GPU in GiB as nvidia-smi reports it (24, 40, 80, 141)", None,
        gt=0, le=_MAX_GIB, metavar="GB",
    )  # fmt: skip
    seq_len: int | None = option(
        "tokens per sample N (default data.seq_len); with train.stages, the length of the "
        "stages whose data.seq_len is 0 (default: --manifest's seq_len)", None,
        ge=1, le=1 << 40, exclusive="length",
    )  # fmt: skip
    max: bool = option(
        "find the longest N that fits --gpu-mem (refused with train.stages: one length per "
        "stage)", False, exclusive="length",
    )  # fmt: skip
    manifest: str | None = option(
        "take the token space from this manifest when model.modalities is empty (default: "
        "the shipped tokenizer specs' space)", None, path="in_path",
    )  # fmt: skip
    headroom: float = option(
        "allocator headroom as a fraction of the tensor peak", 0.10, ge=0, lt=1
    )
    reserve: float | None = option(
        "flat runtime reserve per GPU in GiB, replacing the computed one (default: 1.0 for the "
        "CUDA context and cuBLAS + --nccl-reserve per NCCL communicator)", None,
        ge=0, le=_MAX_GIB, metavar="GB",
    )  # fmt: skip
    nccl_reserve: float = option(
        "NCCL memory per communicator in GiB (world, SP and DP groups of more than one rank; "
        "0.5-1.6 on NVLink nodes, more with NVLS)", 0.5, ge=0, le=_MAX_GIB, metavar="GB",
    )  # fmt: skip
    device: str = option(
        "cuda, or cpu: the tensor memory of CPU processes (gloo), as "
        "ulysses_mm.tools.measure measures it", "cuda", choices=("cuda", "cpu"),
    )  # fmt: skip
    head_groups: int | str | None = option(
        "attention in C head groups (default parallel.head_groups); auto: every C the layout "
        "allows, keeping the longest sequence (--max) or the lowest total (with train.stages: "
        "for every stage, each its own under auto)", None, ge=1, le=MAX_PROCESSES, word="auto",
        metavar="C|auto", aliases={"--head-chunks": "--head-chunks is now --head-groups"},
    )  # fmt: skip
    host_mem: float = option(
        "host memory of one node in GiB, shared by its GPUs' offloaded states and checkpoints "
        "(2048 = 2 TiB); a plan that needs more is refused, --max keeps within it", 2048.0,
        gt=0, le=float(1 << 30), metavar="GB",
    )  # fmt: skip
    gpus_per_node: int = option("GPUs of one node, sharing --host-mem", 8, ge=1, le=MAX_PROCESSES)
    phases: bool = option("also list every phase's figure", False)
    time: bool = option(
        "also predict the step time on --gpus GPUs of --gpu-kind: FLOPs counted from the "
        "documents' attention pairs and the memory policy's recomputation, the all-to-all, "
        "ring, DP/ZeRO and offload traffic over NVLink, network and PCIe, one set of "
        "efficiency factors (docs/throughput.md); prints step time, tokens/s, MFU and the time "
        "to --tokens", False,
    )  # fmt: skip
    best: bool = option(
        "try every layout the world allows (sp, ring, head groups) at the length and print "
        "the fastest few that fit --gpu-mem (default: --gpu-kind's memory)", False,
    )  # fmt: skip
    gpu_kind: str = option(
        "the GPU the time is predicted for (datasheet figures: docs/throughput.md)", "h100",
        choices=tuple(GPU_KINDS),
    )  # fmt: skip
    tokens: float = option(
        "the token budget --time gives the time to (1e9 = one billion)", 1e9, gt=0,
        le=1e18, metavar="N",
    )  # fmt: skip
    doc_lengths: str | None = option(
        f"the documents of a sample, for the attention pairs: {SPEC_HELP} (default: manifest "
        "when --manifest is given, else full)", None, metavar="SPEC",
    )  # fmt: skip
    json: bool = option("print the estimate as JSON", False)

    def main(self) -> int:
        return run_cli(self)
