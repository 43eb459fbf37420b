"""``ulysses-mm estimate``: one estimate (or the longest sequence that fits) printed as the
breakdown or as JSON; a config with train.stages goes to :mod:`.stages` (one line per
stage, then the peak stage's breakdown). The arguments are
:func:`ulysses_mm.cli.setup.add_estimate`'s."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ulysses_mm.config import RunConfig
from ulysses_mm.core.errors import UserError
from ulysses_mm.tools.estimate.render import render
from ulysses_mm.tools.estimate.result import (
    GPUS_PER_NODE,
    HOST_GIB_PER_NODE,
    NCCL_GIB_PER_COMMUNICATOR,
    Estimate,
    EstimateOptions,
    estimate,
)
from ulysses_mm.tools.estimate.search import (
    MAX_GRANULARITY,
    best_head_chunks,
    head_chunk_choices,
    max_seq_len,
)
from ulysses_mm.tools.estimate.shape import token_space
from ulysses_mm.tools.estimate.units import GiB


def head_chunks_arg(value: str | None) -> int | str | None:
    """``--head-chunks``: a count, ``auto``, or None (the config's)."""
    if value is None or value == "auto":
        return value
    try:
        chunks = int(value)
    except ValueError:
        chunks = 0
    if chunks < 1:
        raise UserError(f"--head-chunks must be a positive integer or auto, got {value!r}")
    return chunks


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


def run_cli(args: Any) -> int:
    """``ulysses-mm estimate`` (arguments from :func:`ulysses_mm.cli.setup.add_estimate`)."""
    import json

    from ulysses_mm.config import load_config

    cfg = load_config(RunConfig, args.config, args.overrides)
    space, space_from = token_space(cfg, args.manifest)
    opts = EstimateOptions(
        gpus=args.gpus,
        sp=args.sp,
        space=space,
        space_from=space_from,
        device=args.device,
        headroom=args.headroom,
        reserve_gib=args.reserve,
        nccl_gib=getattr(args, "nccl_reserve", NCCL_GIB_PER_COMMUNICATOR),
        gpu_mem_gib=args.gpu_mem,
        config_name=str(args.config),
        host_mem_gib=getattr(args, "host_mem", HOST_GIB_PER_NODE),
        gpus_per_node=getattr(args, "gpus_per_node", GPUS_PER_NODE),
    )
    chunks = head_chunks_arg(getattr(args, "head_chunks", None))
    if cfg.train.stages:  # a length and layout per stage: the per-stage table
        from ulysses_mm.tools.estimate.stages import run_staged_cli

        return run_staged_cli(args, cfg, opts)
    if isinstance(chunks, int):
        opts = replace(opts, head_chunks=chunks)
    longest, per_chunks = None, None
    if args.max:
        if args.gpu_mem is None:
            raise UserError("--max needs --gpu-mem GB (the memory of one GPU)")
        if chunks == "auto":
            longest, est, per_chunks = best_head_chunks(cfg, opts)
        else:
            longest, est = max_seq_len(cfg, opts)
        if not longest and est.host_fits is False:
            raise UserError(host_refusal(est))
    else:
        seq_len = args.seq_len or cfg.data.seq_len
        if not seq_len:
            raise UserError(
                "give --seq-len N or --max (data.seq_len is 0 in this config: the manifest's)"
            )
        if chunks == "auto":  # the fewest chunks among the lowest totals
            tried = [
                estimate(cfg, seq_len, replace(opts, head_chunks=c))
                for c in head_chunk_choices(cfg, args.gpus, args.sp)
            ]
            est = min(tried, key=lambda e: (e.total, e.step.head_chunks))
            per_chunks = {e.step.head_chunks: e.total for e in tried}
        else:
            est = estimate(cfg, seq_len, opts)
        if est.host_fits is False:
            raise UserError(host_refusal(est))
    if args.json:
        out = est.to_dict()
        if args.max:
            out["max_seq_len"] = longest
        if per_chunks is not None:
            out["head_chunks_tried"] = per_chunks
        print(json.dumps(out, indent=1))
        return 0
    if per_chunks is not None:
        what = "longest sequence" if args.max else "total per GPU"
        shown = (
            {c: f"{v:,}" for c, v in per_chunks.items()}
            if args.max
            else {c: f"{v / GiB:.2f} GiB" for c, v in per_chunks.items()}
        )
        print(
            f"head chunks auto: {est.step.head_chunks} ({what} by head chunks: "
            + ", ".join(f"{c}: {v}" for c, v in shown.items())
            + ")"
        )
    if args.max:
        step = est.step
        if not longest:
            print(
                f"nothing fits: even {step.seq_len:,} tokens need {est.total / GiB:.2f} GiB per "
                f"GPU, more than {args.gpu_mem:g} GiB\n"
            )
        else:
            print(
                f"longest sequence that fits: {longest:,} tokens ({longest // step.sp:,} per GPU) "
                f"on {step.gpus} GPU{'s' if step.gpus > 1 else ''} of {args.gpu_mem:g} GiB "
                f"(sp {step.sp}, dp {step.dp}; a multiple of sp × {MAX_GRANULARITY})\n"
            )
    print(render(est, args.phases))
    return 0
