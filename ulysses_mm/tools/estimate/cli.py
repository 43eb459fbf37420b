"""``ulysses-mm estimate``: one estimate (or the longest sequence that fits) printed as the
breakdown or as JSON; a config with train.stages goes to :mod:`.stages` (one line per
stage, then the peak stage's breakdown). The arguments are
:func:`ulysses_mm.cli.setup.add_estimate`'s."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.core.errors import UserError
from ulysses_mm.tools.estimate.devices import EFFICIENCY, gpu_kind
from ulysses_mm.tools.estimate.documents import doc_lengths
from ulysses_mm.tools.estimate.fastest import rank_layouts
from ulysses_mm.tools.estimate.render import render
from ulysses_mm.tools.estimate.render_time import headline, render_time
from ulysses_mm.tools.estimate.result import (
    GPUS_PER_NODE,
    HOST_GIB_PER_NODE,
    NCCL_GIB_PER_COMMUNICATOR,
    EstimateOptions,
    estimate,
    host_refusal,
)
from ulysses_mm.tools.estimate.search import (
    MAX_GRANULARITY,
    best_head_groups,
    head_group_choices,
    head_groups_arg,
    max_seq_len,
)
from ulysses_mm.tools.estimate.shape import token_space
from ulysses_mm.tools.estimate.stages import run_staged_cli
from ulysses_mm.tools.estimate.step_time import TimeSetup, flop_rates, step_time
from ulysses_mm.tools.estimate.units import GiB

BEST_SHOWN = 5  # layouts --best lists


def run_cli(args: Any) -> int:
    """``ulysses-mm estimate`` (arguments from :func:`ulysses_mm.cli.setup.add_estimate`)."""
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
    groups = head_groups_arg(getattr(args, "head_groups", None))
    timing = None
    if getattr(args, "time", False) or getattr(args, "best", False):
        timing = TimeSetup(
            rates=flop_rates(cfg, space),
            docs=doc_lengths(args.doc_lengths, args.manifest, cfg.data.storage_options),
            device=gpu_kind(args.gpu_kind),
            efficiency=EFFICIENCY,
            budget=args.tokens,
        )
    if cfg.train.stages:  # a length and layout per stage: the per-stage table
        if getattr(args, "best", False):
            raise UserError(
                "--best tries the layouts of one length, and each stage of this config sets "
                "its own; use --time for the stages, or --best with train.stages=[]"
            )
        return run_staged_cli(args, cfg, opts, timing)
    if getattr(args, "best", False):
        assert timing is not None
        return _run_best(args, cfg, opts, timing)
    if isinstance(groups, int):
        opts = replace(opts, head_groups=groups)
    longest, per_groups = None, None
    if args.max:
        if args.gpu_mem is None:
            raise UserError("--max needs --gpu-mem GB (the memory of one GPU)")
        if groups == "auto":
            longest, est, per_groups = best_head_groups(cfg, opts)
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
        if groups == "auto":  # the fewest groups among the lowest totals
            tried = [
                estimate(cfg, seq_len, replace(opts, head_groups=c))
                for c in head_group_choices(cfg, args.gpus, args.sp)
            ]
            est = min(tried, key=lambda e: (e.total, e.step.head_groups))
            per_groups = {e.step.head_groups: e.total for e in tried}
        else:
            est = estimate(cfg, seq_len, opts)
        if est.host_fits is False:
            raise UserError(host_refusal(est))
    st = step_time(cfg, est, *timing.args()) if timing is not None else None
    if args.json:
        out = est.to_dict()
        if st is not None:
            out["time"] = st.to_dict()
            out["time"]["budget_tokens"] = timing.budget if timing else None
            out["time"]["budget_s"] = st.time_for(timing.budget) if timing else None
        if args.max:
            out["max_seq_len"] = longest
        if per_groups is not None:
            out["head_groups_tried"] = per_groups
        print(json.dumps(out, indent=1))
        return 0
    if per_groups is not None:
        what = "longest sequence" if args.max else "total per GPU"
        shown = (
            {c: f"{v:,}" for c, v in per_groups.items()}
            if args.max
            else {c: f"{v / GiB:.2f} GiB" for c, v in per_groups.items()}
        )
        print(
            f"head groups auto: {est.step.head_groups} ({what} by head groups: "
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
    if st is not None and timing is not None:
        print()
        print(render_time(st, est.step.gpus, timing.budget))
    return 0


def _run_best(args: Any, cfg: RunConfig, opts: EstimateOptions, timing: TimeSetup) -> int:
    """``estimate --best``: every layout of the world at the length, the fastest that fit
    first (the top :data:`BEST_SHOWN`), then the breakdown and time of the fastest."""
    if args.max or args.sp is not None or getattr(args, "head_groups", None) is not None:
        raise UserError(
            "--best tries every sp, ring and head-group count: drop --max, --sp and --head-groups"
        )
    seq_len = args.seq_len or cfg.data.seq_len
    if not seq_len:
        raise UserError("--best needs a length: give --seq-len N (data.seq_len is 0 here)")
    mem = args.gpu_mem if args.gpu_mem is not None else timing.device.memory_gib
    gpus = args.gpus or cfg.parallel.sp * (cfg.parallel.dp or 1)
    ranked = rank_layouts(
        cfg, seq_len, replace(opts, gpus=gpus, gpu_mem_gib=mem), *timing.ranking_args()
    )
    fitting = [c for c in ranked if c.fits]
    if args.json:
        print(
            json.dumps(
                {
                    "gpu_mem_gib": mem,
                    "layouts": [
                        {
                            **c.est.step.to_dict(),
                            "total": c.est.total,
                            "fits": c.fits,
                            "time": c.time.to_dict(),
                        }
                        for c in ranked
                    ],
                },
                indent=1,
            )
        )
        return 0 if fitting else 2
    print(
        f"fastest layouts of {gpus} × {timing.device.name} at {seq_len:,} tokens a sample "
        f"({len(fitting)} of {len(ranked)} layouts fit {mem:g} GiB):"
    )
    for i, c in enumerate(fitting[:BEST_SHOWN]):
        print(
            f"  {i + 1}. {c.describe():<48} {c.est.total / GiB:6.1f} GiB  {headline(c.time, timing.budget)}"
        )
    if not fitting:
        raise UserError(f"no layout of {gpus} GPUs fits {mem:g} GiB at {seq_len:,} tokens")
    best = fitting[0]
    print()
    print(render(best.est, args.phases))
    print()
    print(render_time(best.time, best.est.step.gpus, timing.budget))
    return 0
