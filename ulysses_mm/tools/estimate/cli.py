"""``ulysses-mm estimate``: one estimate (or the longest sequence that fits) printed as the
breakdown or as JSON; the arguments are :func:`ulysses_mm.cli._add_estimate`'s."""

from __future__ import annotations

from typing import Any

from ulysses_mm.config import RunConfig
from ulysses_mm.core.errors import UserError
from ulysses_mm.tools.estimate.render import render
from ulysses_mm.tools.estimate.result import NCCL_GIB_PER_COMMUNICATOR, estimate
from ulysses_mm.tools.estimate.search import MAX_GRANULARITY, max_seq_len
from ulysses_mm.tools.estimate.shape import token_space
from ulysses_mm.tools.estimate.units import GiB


def run_cli(args: Any) -> int:
    """``ulysses-mm estimate`` (arguments from :func:`ulysses_mm.cli._add_estimate`)."""
    import json

    from ulysses_mm.config import load_config

    cfg = load_config(RunConfig, args.config, args.overrides)
    space, space_from = token_space(cfg, args.manifest)
    kw: dict[str, Any] = dict(
        gpus=args.gpus,
        sp=args.sp,
        space=space,
        space_from=space_from,
        device=args.device,
        headroom=args.headroom,
        reserve_gib=args.reserve,
        nccl_gib=getattr(args, "nccl_reserve", NCCL_GIB_PER_COMMUNICATOR),
        config_name=str(args.config),
    )
    longest = None
    if args.max:
        if args.gpu_mem is None:
            raise UserError("--max needs --gpu-mem GB (the memory of one GPU)")
        longest, est = max_seq_len(cfg, args.gpu_mem, **kw)
    else:
        seq_len = args.seq_len or cfg.data.seq_len
        if not seq_len:
            raise UserError(
                "give --seq-len N or --max (data.seq_len is 0 in this config: the manifest's)"
            )
        est = estimate(cfg, seq_len, gpu_mem_gib=args.gpu_mem, **kw)
    if args.json:
        out = est.to_dict()
        if args.max:
            out["max_seq_len"] = longest
        print(json.dumps(out, indent=1))
        return 0
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
