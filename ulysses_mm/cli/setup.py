"""Commands that check a setup before it runs (verify, estimate, config)."""

from __future__ import annotations

import argparse

from ulysses_mm.cli.common import overrides_help
from ulysses_mm.config import RunConfig, describe, load_config
from ulysses_mm.core.checks import (
    MAX_PROCESSES,
    count_arg,
    count_or_arg,
    in_dir_arg,
    in_file_arg,
    in_path_arg,
    integer_arg,
    number_arg,
    seed_arg,
)

# estimate's sizes are arithmetic, not processes: bounds where a figure stops meaning a
# machine (2^20 GPUs, 2^20 GiB per GPU, 2^30 GiB per node, 2^40 tokens)
_MAX_GPUS = 1 << 20
_MAX_GIB = float(1 << 20)
_MAX_HOST_GIB = float(1 << 30)
_MAX_EST_TOKENS = 1 << 40


def _cmd_verify(args: argparse.Namespace) -> int:
    from ulysses_mm.tools.verify import VerifyOptions, run_verify

    shortcuts = [
        f"parallel.{k}={v}" for k in ("sp", "dp", "ring") if (v := getattr(args, k)) is not None
    ]
    cfg = load_config(RunConfig, args.config, [*shortcuts, *args.overrides])
    opts = VerifyOptions(
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        seed=args.seed,
        atol=args.atol,
        rtol=args.rtol,
    )
    return run_verify(cfg, opts)


def add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check that dp × sp gives the loss and gradients of one process",
        description=(
            "Run forward+backward of a small model on random packed multimodal data once with "
            "dp × sp processes (Ulysses) and once as a single process; print the loss and "
            "every gradient's max difference and the all-to-all bytes per layer. Starts its own "
            "processes, or joins the world of torchrun / the DeepSpeed launcher."
        ),
    )
    p.add_argument(
        "--sp",
        type=count_arg(MAX_PROCESSES),
        default=None,
        help="sequence-parallel size P (parallel.sp=P)",
    )
    p.add_argument(
        "--dp",
        type=integer_arg(ge=0, le=MAX_PROCESSES),
        default=None,
        help="data-parallel size D (parallel.dp=D; default: 1, or the launched world / P)",
    )
    p.add_argument(
        "--ring",
        type=count_arg(MAX_PROCESSES),
        default=None,
        help="ring size R inside sp (parallel.ring=R): Ulysses over sp/R ranks × a ring of R",
    )
    p.add_argument(
        "--config",
        type=in_file_arg(),
        default=None,
        help="run config YAML (default: the schema's defaults)",
    )
    p.add_argument(
        "--seq-len",
        type=count_arg(1 << 24),
        default=1024,
        help="tokens per sample N, 1..2^24 (default 1024)",
    )
    p.add_argument(
        "--micro-batch",
        type=count_arg(1 << 10),
        default=1,
        help="samples per DP rank, 1..1024 (default 1)",
    )
    p.add_argument(
        "--seed", type=seed_arg(), default=0, help="seed of the random batch (default 0)"
    )
    p.add_argument(
        "--atol",
        type=number_arg(ge=0),
        default=1e-5,
        help="absolute tolerance, >= 0 (default 1e-5)",
    )
    p.add_argument(
        "--rtol",
        type=number_arg(ge=0),
        default=1e-4,
        help="tolerance relative to max |ref|, >= 0 (default 1e-4)",
    )
    p.add_argument("overrides", nargs="*", help=overrides_help())
    p.set_defaults(func=_cmd_verify)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from ulysses_mm.tools.estimate import run_cli

    return run_cli(args)


def add_estimate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="per-GPU memory of a run, broken down; --max finds the longest sequence that fits",
        description=(
            "Estimate the per-GPU memory of one training step of CONFIG from the config alone: "
            "parameters, gradients and optimizer states under its ZeRO stage and offload, "
            "activations per layer at N/sp tokens with and without activation checkpointing "
            "(and with checkpoints offloaded), the attention working set after the all-to-all, "
            "MLP and loss tiles, communication buffers, allocator headroom. With --max, the "
            "longest sequence that fits --gpu-mem. A config with train.stages is estimated "
            "stage by stage on one world (each stage's length, micro-batch, sp, ring and head "
            "chunks; dp = gpus / its sp): one line per stage, then the breakdown of the peak "
            "stage; with --gpu-mem, a stage that does not fit is refused (exit 2)."
        ),
    )
    p.add_argument("config", type=in_file_arg(), help="run config YAML (see configs/)")
    p.add_argument("overrides", nargs="*", help=overrides_help())
    p.add_argument(
        "--gpus",
        type=count_arg(_MAX_GPUS),
        default=None,
        help="GPUs in all (world size; default parallel.sp × parallel.dp; with train.stages "
        "and parallel.dp 0, the largest stage sp)",
    )
    p.add_argument(
        "--sp",
        type=count_arg(_MAX_GPUS),
        default=None,
        help="sequence-parallel size (default: --gpus when given, else parallel.sp); dp = "
        "gpus/sp. Refused with train.stages: each stage sets its own",
    )
    p.add_argument(
        "--gpu-mem",
        type=number_arg(gt=0, le=_MAX_GIB),
        default=None,
        metavar="GB",
        help="memory of one GPU in GiB as nvidia-smi reports it (24, 40, 80, 141)",
    )
    n = p.add_mutually_exclusive_group()
    n.add_argument(
        "--seq-len",
        type=count_arg(_MAX_EST_TOKENS),
        default=None,
        help="tokens per sample N (default data.seq_len); with train.stages, the length of "
        "the stages whose data.seq_len is 0 (default: --manifest's seq_len)",
    )
    n.add_argument(
        "--max",
        action="store_true",
        help="find the longest N that fits --gpu-mem (refused with train.stages: one length "
        "per stage)",
    )
    p.add_argument(
        "--manifest",
        type=in_path_arg(),
        default=None,
        help="take the token space from this manifest when model.modalities is empty "
        "(default: the shipped tokenizer specs' space)",
    )
    p.add_argument(
        "--headroom",
        type=number_arg(ge=0, lt=1),
        default=0.10,
        help="allocator headroom as a fraction of the tensor peak, in [0, 1) (default 0.10)",
    )
    p.add_argument(
        "--reserve",
        type=number_arg(ge=0, le=_MAX_GIB),
        default=None,
        metavar="GB",
        help="flat runtime reserve per GPU in GiB, replacing the computed one (default: 1.0 "
        "for the CUDA context and cuBLAS + --nccl-reserve per NCCL communicator)",
    )
    p.add_argument(
        "--nccl-reserve",
        type=number_arg(ge=0, le=_MAX_GIB),
        default=0.5,
        metavar="GB",
        help="NCCL memory per communicator in GiB (world, SP and DP groups of more than one "
        "rank; 0.5-1.6 on NVLink nodes, more with NVLS; default 0.5)",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (default), or cpu: the tensor memory of CPU processes (gloo), as "
        "ulysses_mm.tools.measure measures it",
    )
    p.add_argument(
        "--head-chunks",
        type=count_or_arg("auto", MAX_PROCESSES),
        default=None,
        metavar="C|auto",
        help="attention in C groups of heads (default parallel.head_chunks); auto: every C the "
        "layout allows, keeping the longest sequence (--max) or the lowest total (with "
        "train.stages: for every stage, each its own under auto)",
    )
    p.add_argument(
        "--host-mem",
        type=number_arg(gt=0, le=_MAX_HOST_GIB),
        default=2048.0,
        metavar="GB",
        help="host memory of one node in GiB, shared by its GPUs' offloaded states and "
        "checkpoints (default 2048 = 2 TiB); a plan that needs more is refused, --max keeps "
        "within it",
    )
    p.add_argument(
        "--gpus-per-node",
        type=count_arg(MAX_PROCESSES),
        default=8,
        help="GPUs of one node, sharing --host-mem (default 8)",
    )
    p.add_argument("--phases", action="store_true", help="also list every phase's figure")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=_cmd_estimate)


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from ulysses_mm.config import to_dict

    if args.keys:
        for key, tp, valid, text in describe(RunConfig):
            print(f"{key:<40s} {tp:<24s} {valid or '-':<16s} {text}")
        return 0
    if args.from_hf:
        from ulysses_mm.config import deep_merge, from_dict, parse_overrides, read_yaml
        from ulysses_mm.model.hf_import import model_section

        # defaults < file < the checkpoint's model section < overrides
        data = read_yaml(args.config) if args.config else {}
        data["model"] = model_section(args.from_hf, data.get("model"))
        cfg = from_dict(RunConfig, deep_merge(data, parse_overrides(args.overrides)))
    else:
        cfg = load_config(RunConfig, args.config, args.overrides)
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


def add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print a resolved run config, or every key with --keys")
    p.add_argument("config", nargs="?", type=in_file_arg(), default=None, help="run config YAML")
    p.add_argument("overrides", nargs="*", help=overrides_help())
    p.add_argument(
        "--keys",
        action="store_true",
        help="list every config key with its type, valid range and help",
    )
    p.add_argument(
        "--from-hf",
        type=in_dir_arg(),
        default=None,
        metavar="DIR",
        help="fill the model section from a transformers Llama/Qwen2/Qwen3 checkpoint "
        "(architecture, init_from=DIR, the text modality sized to its vocabulary); "
        "overrides still win",
    )
    p.set_defaults(func=_cmd_config)
