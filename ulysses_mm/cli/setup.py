"""Commands that check a setup before it runs (verify, estimate, config)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ulysses_mm.cli.declare import command, overrides, positional
from ulysses_mm.config import RunConfig, describe, load_config
from ulysses_mm.config.parse import option
from ulysses_mm.core.checks import MAX_PROCESSES

# estimate's sizes are arithmetic, not processes: bounds where a figure stops meaning a
# machine (2^20 GPUs, 2^20 GiB per GPU, 2^30 GiB per node, 2^40 tokens)
_MAX_GPUS = 1 << 20
_MAX_GIB = float(1 << 20)


@dataclass
class Verify:
    sp: int | None = option(
        "sequence-parallel size P (parallel.sp=P)", None, ge=1, le=MAX_PROCESSES
    )
    dp: int | None = option(
        "data-parallel size D (parallel.dp=D; default: 1, or the launched world / P)", None,
        ge=0, le=MAX_PROCESSES,
    )  # fmt: skip
    ring: int | None = option(
        "ring size R inside sp (parallel.ring=R): Ulysses over sp/R ranks × a ring of R", None,
        ge=1, le=MAX_PROCESSES,
    )  # fmt: skip
    config: str | None = option(
        "run config YAML or a shipped config's name (default: the schema's defaults)",
        None,
        path="run_config",
    )
    overrides: list[str] = overrides()


def _verify(a: Verify, opts: object) -> int:
    from ulysses_mm.tools.verify import run_verify  # lazy: torch

    layout = [f"parallel.{k}={v}" for k in ("sp", "dp", "ring") if (v := getattr(a, k)) is not None]
    return run_verify(load_config(RunConfig, a.config, [*layout, *a.overrides]), opts)


@dataclass
class Estimate:
    """``ulysses-mm estimate``'s arguments, read by :func:`ulysses_mm.tools.estimate.run_cli`."""

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
        ge=1, le=1 << 40, group="length",
    )  # fmt: skip
    max: bool = option(
        "find the longest N that fits --gpu-mem (refused with train.stages: one length per "
        "stage)", False, group="length",
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
    json: bool = option("print the estimate as JSON", False)


def _estimate(a: Estimate) -> int:
    from ulysses_mm.tools.estimate import run_cli  # lazy: numpy

    return run_cli(a)


@dataclass
class Config:
    config: str | None = option(
        "run config YAML or a shipped config's name", None, path="run_config", positional=True
    )
    overrides: list[str] = overrides()
    keys: bool = option("list every config key with its type, valid range and help", False)
    from_hf: str | None = option(
        "fill the model section from a transformers Llama/Qwen2/Qwen3 checkpoint "
        "(architecture, init_from=DIR, the text modality sized to its vocabulary); overrides "
        "still win", None, path="in_dir", metavar="DIR",
    )  # fmt: skip


def _config(a: Config) -> int:
    import yaml  # lazy: only this command prints YAML

    from ulysses_mm.config import deep_merge, from_dict, parse_overrides, read_yaml, to_dict

    if a.keys:
        for key, tp, valid, text in describe(RunConfig):
            print(f"{key:<40s} {tp:<24s} {valid or '-':<16s} {text}")
        return 0
    if a.from_hf:
        from ulysses_mm.model.hf_import import model_section  # lazy: torch

        # defaults < file < the checkpoint's model section < overrides
        data = read_yaml(a.config) if a.config else {}
        data["model"] = model_section(a.from_hf, data.get("model"))
        cfg = from_dict(RunConfig, deep_merge(data, parse_overrides(a.overrides)))
    else:
        cfg = load_config(RunConfig, a.config, a.overrides)
    out = to_dict(cfg)
    # the RoPE keys its kind leaves unset and the settings a stage keeps are left out
    out["model"]["rope"] = _set_only(out["model"]["rope"])
    out["train"]["stages"] = [_set_only(stage) for stage in out["train"]["stages"]]
    print(yaml.safe_dump(out, sort_keys=False), end="")
    return 0


def _set_only(section: dict) -> dict:
    """``section`` without its None values (nested sections too; an emptied one goes)."""
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            value = _set_only(value)
        if value is not None and value != {}:
            out[key] = value
    return out


def add_verify(sub: argparse._SubParsersAction) -> None:
    options = [Verify, "ulysses_mm.tools.verify:VerifyOptions"]
    command(sub, "verify", "check that dp × sp gives the loss and gradients of one process", options, _verify, (
        "Run forward+backward of a small model on random packed multimodal data once with "
        "dp × sp processes (Ulysses) and once as a single process; print the loss and every "
        "gradient's max difference and the all-to-all bytes per layer. Starts its own "
        "processes, or joins the world of torchrun / the DeepSpeed launcher."
    ))  # fmt: skip


def add_estimate(sub: argparse._SubParsersAction) -> None:
    command(sub, "estimate", "per-GPU memory of a run, broken down; --max finds the longest sequence that fits", [Estimate], _estimate, (
        "Estimate the per-GPU memory of one training step of CONFIG from the config alone: "
        "parameters, gradients and optimizer states under its ZeRO stage and offload, "
        "activations per layer at N/sp tokens with and without activation checkpointing "
        "(and with checkpoints offloaded), the attention working set after the all-to-all, "
        "MLP and loss tiles, communication buffers, allocator headroom. With --max, the "
        "longest sequence that fits --gpu-mem. A config with train.stages is estimated stage "
        "by stage on one world (each stage's length, micro-batch, sp, ring and head groups; "
        "dp = gpus / its sp): one line per stage, then the breakdown of the peak stage; with "
        "--gpu-mem, a stage that does not fit is refused (exit 2)."
    ))  # fmt: skip


def add_config(sub: argparse._SubParsersAction) -> None:
    command(
        sub, "config", "print a resolved run config, or every key with --keys", [Config], _config
    )
