"""Commands on a model: train it, look at what it learned, hand it on (demo, train,
export, generate, evaluate, report)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from ulysses_mm.cli.common import overrides_help
from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.core.checks import (
    INT64_SAFE,
    MAX_PROCESSES,
    MAX_TOKENS,
    count_arg,
    in_dir_arg,
    in_file_arg,
    in_path_arg,
    int_list_arg,
    integer_arg,
    number_arg,
    out_dir_arg,
    out_file_arg,
    seed_arg,
)
from ulysses_mm.tools.estimate.stages import check_stages_fit
from ulysses_mm.train.stop import EXIT_STOPPED, StopRecord, young_interval_s

_VERBOSE_HELP = (
    "also show DeepSpeed's log on the terminal (it always goes to the run's "
    "logs/deepspeed-rank-N.log)"
)


def _verbose(args: argparse.Namespace) -> None:
    """DeepSpeed's log to the run's logs/ (``-v``: and the terminal), in every rank: they
    inherit the environment."""
    from ulysses_mm.parallel.mesh import DEEPSPEED_LOG_ENV

    os.environ[DEEPSPEED_LOG_ENV] = "run+terminal" if args.verbose else "run"


def _cmd_demo(args: argparse.Namespace) -> int:
    from ulysses_mm.tools.demo import run_demo

    _verbose(args)
    return run_demo(args.out, args.steps)


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the default job: prepare the sample data, train the debug model at SP=2, plot",
        description=(
            "Prepare the repository's sample files (DNA, speech, video) with pipelines/mixed.yaml, "
            "train configs/debug-tiny.yaml at SP=2 on 2 CPU processes with W&B offline, and "
            "write the loss curves and one packed sample as PNGs."
        ),
    )
    p.add_argument(
        "--out",
        type=out_dir_arg(),
        default="build/demo",
        help="output directory (default build/demo)",
    )
    p.add_argument(
        "--steps", type=count_arg(10**6), default=40, help="training steps, 1..10^6 (default 40)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    p.set_defaults(func=_cmd_demo)


def _cmd_train(args: argparse.Namespace) -> int:
    from ulysses_mm.train.loop import run_train

    started = time.time()
    _verbose(args)
    overrides = list(args.overrides)
    if args.resume:
        overrides.append("train.resume=always")
    if args.max_minutes is not None:
        overrides.append(f"train.max_minutes={args.max_minutes}")
    cfg = load_config(RunConfig, args.config, overrides)
    # the pre-flight checks every stage against train.gpu_mem_gib, before any process starts
    result = run_train(cfg, args.nproc, started, memory=check_stages_fit)
    if os.environ.get("RANK", "0") != "0":
        return 75 if result.get("stopped") else 0
    if result.get("complete"):
        print(
            f"the run in {result['run_dir']} is complete: step {result['steps']} of "
            f"{cfg.train.steps} ({result['checkpoint']}); raise train.steps to train on"
        )
        return 0
    if result.get("stopped"):
        record = StopRecord(**result["stopped"])
        print(f"ulysses-mm train: {record.line(_same_command())}", file=sys.stderr)
        return EXIT_STOPPED
    print(
        f"trained {result['steps']} steps; final loss {result['final_loss']:.4f}\n"
        f"  run dir:    {result['run_dir']}\n"
        f"  metrics:    {result['run_dir']}/metrics.jsonl\n"
        f"  checkpoint: {result['checkpoint']}\n"
        + (f"  wandb:      {result['wandb_dir']}\n" if result["wandb_dir"] else "")
        + _save_line(result, cfg.train.checkpoint_every)
    )
    return 0


def _same_command() -> str:
    """The command that continues a stopped run: this one, less what starts afresh."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "train":
        return "the same command (train.resume=auto)"
    fresh = ("train.resume=never", "train.resume=restart")
    return "ulysses-mm " + shlex.join(a for a in argv if a not in fresh)


def _save_line(result: dict, every: int) -> str:
    """The measured save time and Young's checkpoint interval for a failure a day."""
    save_s, step_s = result.get("save_s", 0.0), result.get("step_s", 0.0)
    if not save_s or not step_s:
        return ""
    cost = max(result.get("blocked_s", 0.0), 1e-3)  # what a save costs the run: its blocking part
    interval = young_interval_s(cost, 24 * 3600.0)
    return (
        f"  saves:      {cost:.2f} s blocking, {save_s:.2f} s to complete; Young's interval "
        f"for a failure a day: {interval / 60:.1f} min ≈ {interval / step_s:,.0f} steps "
        f"(train.checkpoint_every={every})\n"
    )


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train from shards with DeepSpeed + Ulysses",
        description=(
            "Train the model of CONFIG on the shards its data.train manifest names. With "
            "--nproc N it starts N local processes itself; under torchrun or the DeepSpeed "
            "launcher it joins the world it is given."
        ),
    )
    p.add_argument("config", type=in_file_arg(), help="run config YAML (see configs/)")
    p.add_argument("overrides", nargs="*", help=overrides_help())
    p.add_argument(
        "--nproc",
        type=count_arg(MAX_PROCESSES),
        default=None,
        help="start N local processes (torch elastic launcher)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="require a checkpoint to continue from (train.resume=always; the default, auto, "
        "continues when the run directory has one)",
    )
    p.add_argument(
        "--max-minutes",
        type=number_arg(ge=0, le=10**7),
        default=None,
        metavar="M",
        help="time budget (train.max_minutes): stop with a checkpoint, exit 75, before M "
        "minutes from now run out",
    )
    p.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    p.set_defaults(func=_cmd_train)


def _cmd_export(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ulysses_mm.train.export import export

    out = export(args.checkpoint, args.out)
    arch = json.loads((Path(out) / "config.json").read_text())["architectures"][0]
    print(f"wrote a transformers {arch} checkpoint to {out} (AutoModelForCausalLM.from_pretrained)")
    return 0


def add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a transformers (safetensors) model")
    p.add_argument(
        "checkpoint",
        type=in_dir_arg(),
        help="a run dir, its checkpoints/ dir, or one checkpoint (step_*) dir",
    )
    p.add_argument(
        "out", type=out_dir_arg(), help="output directory (config.json + model.safetensors)"
    )
    p.set_defaults(func=_cmd_export)


def _cmd_generate(args: argparse.Namespace) -> int:
    from ulysses_mm.tools.generate import GenerateOptions, run_generate

    opts = GenerateOptions(
        modality=args.modality,
        new_tokens=args.new_tokens,
        out=args.out,
        prompt=args.prompt,
        prompt_tokens=args.prompt_tokens,
        prompt_seconds=args.prompt_seconds,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        with_prompt=args.with_prompt,
        ignore_doc_end=args.ignore_doc_end,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        nproc=args.nproc,
    )
    r = run_generate(args.checkpoint, opts)
    if r["out"]:
        print(
            f"wrote {r['out']}: {r['what']} ({r['kind']}); {r['new_ids']:,} new ids "
            f"({r['sampled']:,} sampled{', ended by </doc>' if r['ended'] else ''}) after a "
            f"{r['prompt_ids']:,}-id prompt; {r['tokens_per_s']:,.1f} ids/s with the prefill, "
            f"on {r['device']} × {r['processes']}"
        )
    return 0


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a prompt in one modality; write FASTA / WAV / MP4 / text",
        description=(
            "Tokenize PROMPT with the tokenizer the model's training data used, sample "
            "--new-tokens ids with a KV cache within the modality's head (and the "
            "tokenizer's layout: whole video frames, interleaved audio), and decode them to "
            "--out: FASTA for DNA, WAV for audio, MP4 for video (with the clip's audio when "
            "the spec interleaves it), UTF-8 text. The same seed gives the same output. "
            "--nproc N prefills a long prompt with N sequence-parallel processes."
        ),
    )
    p.add_argument(
        "checkpoint",
        type=in_dir_arg(),
        help="a run dir, a checkpoint (step_*) dir or an export dir",
    )
    p.add_argument(
        "--modality", required=True, help="the modality to write (dna, audio, video, text, …)"
    )
    p.add_argument(
        "--prompt",
        type=in_file_arg(),
        default=None,
        metavar="FILE",
        help="a file of that modality (FASTA, audio, video, .txt); none: start a document",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--prompt-tokens",
        type=count_arg(MAX_TOKENS),
        default=None,
        metavar="N",
        help="keep the first N ids",
    )
    g.add_argument(
        "--prompt-seconds",
        type=number_arg(gt=0, le=10**6),
        default=None,
        metavar="S",
        help="keep the first S seconds (audio, video)",
    )
    p.add_argument(
        "--new-tokens",
        type=count_arg(MAX_TOKENS),
        required=True,
        metavar="N",
        help=f"ids to generate, 1..{MAX_TOKENS:,}",
    )
    p.add_argument(
        "--out", type=out_file_arg(), required=True, metavar="FILE", help="the file to write"
    )
    p.add_argument(
        "--temperature",
        type=number_arg(ge=0),
        default=1.0,
        help="softmax temperature, >= 0 (0: greedy; default 1)",
    )
    p.add_argument(
        "--top-k",
        type=integer_arg(ge=0, le=INT64_SAFE),
        default=0,
        help="sample among the k likeliest (0: all)",
    )
    p.add_argument(
        "--top-p",
        type=number_arg(gt=0, le=1),
        default=1.0,
        help="nucleus: the likeliest ids of mass p, in (0, 1] (1: all)",
    )
    p.add_argument("--seed", type=seed_arg(), default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--with-prompt",
        action="store_true",
        help="write the prompt's part too (default: only what was generated)",
    )
    p.add_argument(
        "--ignore-doc-end",
        action="store_true",
        help="never sample </doc>: write all --new-tokens ids (default: </doc> ends early)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        type=in_file_arg(),
        metavar="SPEC",
        help="tokenizer spec to use instead of the one recorded with the model",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "fp32", "bf16", "fp16"],
        default="auto",
        help="weights' dtype (auto: the training precision)",
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: a GPU if any"
    )
    p.add_argument(
        "--nproc",
        type=count_arg(MAX_PROCESSES),
        default=None,
        help="prefill with N local sequence-parallel processes (a prompt too long for one)",
    )
    p.set_defaults(func=_cmd_generate)


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from ulysses_mm.tools.evaluate import EvaluateOptions, cli

    opts = EvaluateOptions(
        args.nproc, args.batches, args.micro_batch, args.edges, seq_len=args.seq_len, sp=args.sp
    )
    return cli(args.checkpoint, args.manifest, opts, args.json, args.png)


def add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="held-out loss per modality (bits per base / sample / byte) and by position",
        description=(
            "Run MANIFEST's samples, in order, at full length or as windows of --seq-len "
            "tokens cut out of them, through the training step's forward under the run's "
            "sequence-parallel layout (or --sp): cross-entropy per "
            "modality in nats per token and in the units people quote (DNA bits per base, "
            "audio bits per sample, text bits per byte, video bits per frame), and against "
            "the target's position inside its document in log-spaced bins. The figures "
            "match the periodic eval of `ulysses-mm train` on the same batches."
        ),
    )
    p.add_argument(
        "checkpoint", type=in_dir_arg(), help="a run dir, its checkpoints/ dir or a step_* dir"
    )
    p.add_argument(
        "manifest",
        type=in_path_arg(),
        help="manifest.json of held-out shards (path or fsspec URL)",
    )
    p.add_argument(
        "--nproc",
        type=count_arg(MAX_PROCESSES),
        default=None,
        help="local processes (default: the run's parallel.sp; dp = nproc / sp)",
    )
    p.add_argument(
        "--batches",
        type=integer_arg(ge=0, le=INT64_SAFE),
        default=0,
        help="micro-batches per DP rank (default 0: every sample once)",
    )
    p.add_argument(
        "--micro-batch",
        type=integer_arg(ge=0, le=1 << 20),
        default=0,
        help="samples per DP rank (default 0: the run's)",
    )
    p.add_argument(
        "--seq-len",
        type=integer_arg(ge=0, le=1 << 40),
        default=0,
        metavar="L",
        help="evaluate on windows of L tokens cut out of the samples, each keeping its "
        "documents' positions (default 0: the samples' length)",
    )
    p.add_argument(
        "--sp",
        type=integer_arg(ge=0, le=MAX_PROCESSES),
        default=0,
        metavar="N",
        help="N Ulysses ranks instead of the run's layout (default 0: the run's parallel.sp; "
        "--nproc defaults to it)",
    )
    p.add_argument(
        "--edges",
        type=int_list_arg(ge=0, lt=INT64_SAFE, increasing=True, min_items=2),
        default=None,
        metavar="P0,P1,...",
        help="position bin edges instead of log-spaced ones, e.g. 2,1026,2050",
    )
    p.add_argument("--json", action="store_true", help="print every figure as JSON")
    p.add_argument(
        "--png",
        type=out_file_arg(),
        default=None,
        metavar="FILE",
        help="plot loss against position",
    )
    p.set_defaults(func=_cmd_evaluate)


def _cmd_report(args: argparse.Namespace) -> int:
    from ulysses_mm.tools.report import plot

    print(f"wrote {plot(args.run_dir, args.png)}")
    return 0


def add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="plot a run's loss curves per modality")
    p.add_argument("run_dir", type=in_dir_arg(), help="the run directory (train.out_dir)")
    p.add_argument("--png", type=out_file_arg(), required=True, help="where to write the plot")
    p.set_defaults(func=_cmd_report)
