"""``ulysses-mm``: a thin CLI; each subcommand maps to one function.

Configuration precedence everywhere: CLI ``section.key=value`` > the YAML file > the
schema's defaults.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from ulysses_mm.config import RunConfig, describe, load_config
from ulysses_mm.core.errors import UserError


def _overrides_help() -> str:
    return "section.key=value overrides, applied after the file (CLI > file > defaults)"


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
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _add_verify(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel size P (parallel.sp=P)")
    p.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel size D (parallel.dp=D; default: 1, or the launched world / P)",
    )
    p.add_argument(
        "--ring",
        type=int,
        default=None,
        help="ring size R inside sp (parallel.ring=R): Ulysses over sp/R ranks × a ring of R",
    )
    p.add_argument(
        "--config", default=None, help="run config YAML (default: the schema's defaults)"
    )
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sample N (default 1024)")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per DP rank (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random batch (default 0)")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    p.add_argument(
        "--rtol", type=float, default=1e-4, help="tolerance relative to max |ref| (default 1e-4)"
    )
    p.add_argument("overrides", nargs="*", help=_overrides_help())
    p.set_defaults(func=_cmd_verify)


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print a resolved run config, or every key with --keys")
    p.add_argument("config", nargs="?", default=None, help="run config YAML")
    p.add_argument("overrides", nargs="*", help=_overrides_help())
    p.add_argument(
        "--keys",
        action="store_true",
        help="list every config key with its type, valid range and help",
    )
    p.add_argument(
        "--from-hf",
        default=None,
        metavar="DIR",
        help="fill the model section from a transformers Llama/Qwen2/Qwen3 checkpoint "
        "(architecture, init_from=DIR, the text modality sized to its vocabulary); "
        "overrides still win",
    )
    p.set_defaults(func=_cmd_config)


def _cmd_demo(args: argparse.Namespace) -> int:
    from ulysses_mm.tools.demo import run_demo

    return run_demo(args.out, args.steps)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the default job: prepare the sample data, train the debug model at SP=2, plot",
        description=(
            "Prepare the repository's sample files (DNA, speech, video) with pipelines/mixed.yaml, "
            "train configs/debug-tiny.yaml at SP=2 on 2 CPU processes with W&B offline, and "
            "write the loss curves and one packed sample as PNGs."
        ),
    )
    p.add_argument("--out", default="build/demo", help="output directory (default build/demo)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.set_defaults(func=_cmd_demo)


def _cmd_train(args: argparse.Namespace) -> int:
    from ulysses_mm.train.loop import run_train

    cfg = load_config(RunConfig, args.config, args.overrides)
    result = run_train(cfg, args.nproc, args.resume)
    print(
        f"trained {result['steps']} steps; final loss {result['final_loss']:.4f}\n"
        f"  run dir:    {result['run_dir']}\n"
        f"  metrics:    {result['run_dir']}/metrics.jsonl\n"
        f"  checkpoint: {result['checkpoint']}\n"
        + (f"  wandb:      {result['wandb_dir']}\n" if result["wandb_dir"] else "")
    )
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train from shards with DeepSpeed + Ulysses",
        description=(
            "Train the model of CONFIG on the shards its data.train manifest names. With "
            "--nproc N it starts N local processes itself; under torchrun or the DeepSpeed "
            "launcher it joins the world it is given."
        ),
    )
    p.add_argument("config", help="run config YAML (see configs/)")
    p.add_argument("overrides", nargs="*", help=_overrides_help())
    p.add_argument(
        "--nproc", type=int, default=None, help="start N local processes (torch elastic launcher)"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint of train.out_dir"
    )
    p.set_defaults(func=_cmd_train)


def _cmd_export(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ulysses_mm.train.export import export

    out = export(args.checkpoint, args.out)
    arch = json.loads((Path(out) / "config.json").read_text())["architectures"][0]
    print(f"wrote a transformers {arch} checkpoint to {out} (AutoModelForCausalLM.from_pretrained)")
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a transformers (safetensors) model")
    p.add_argument(
        "checkpoint", help="a run dir, its checkpoints/ dir, or one checkpoint (step_*) dir"
    )
    p.add_argument("out", help="output directory (config.json + model.safetensors)")
    p.set_defaults(func=_cmd_export)


def _cmd_hf_tokenizer(args: argparse.Namespace) -> int:
    from ulysses_mm.hf.tokenizer import write_tokenizer
    from ulysses_mm.shards.manifest import Manifest

    manifest = Manifest.load(args.manifest)
    out = write_tokenizer(manifest, args.out, args.text_tokenizer)
    print(
        f"wrote a transformers tokenizer of the {manifest.token_space.describe()} to {out} "
        "(AutoTokenizer.from_pretrained)"
    )
    return 0


def _add_hf_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "hf-tokenizer",
        help="write a transformers tokenizer whose vocabulary is a manifest's token space",
    )
    p.add_argument("manifest", help="manifest.json (path or URL) or its dataset directory")
    p.add_argument("out", help="new output directory (tokenizer.json + tokenizer_config.json)")
    p.add_argument(
        "--text-tokenizer",
        default=None,
        help="the text modality's transformers tokenizer directory, to name text ids by its "
        "tokens (default: bytes for the shipped text-bytes spec, else the local id)",
    )
    p.set_defaults(func=_cmd_hf_tokenizer)


def _cmd_report(args: argparse.Namespace) -> int:
    from ulysses_mm.tools.report import plot

    print(f"wrote {plot(args.run_dir, args.png)}")
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="plot a run's loss curves per modality")
    p.add_argument("run_dir", help="the run directory (train.out_dir)")
    p.add_argument("--png", required=True, help="where to write the plot")
    p.set_defaults(func=_cmd_report)


def _cmd_prepare(args: argparse.Namespace) -> int:
    from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare

    overrides = list(args.overrides)
    if args.engine:
        overrides.append(f"engine={args.engine}")
    if args.address is not None:
        overrides.append(f"ray_address={args.address}")
    cfg = load_pipeline_config(args.pipeline, overrides)
    if args.print_config:
        import yaml

        from ulysses_mm.config import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    prepare(cfg)
    return 0


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize raw files, pack them and write WebDataset shards + manifest.json",
        description=(
            "Run a pipeline spec (pipelines/*.yaml): expand the sources, cut them into "
            "partitions (shards.partition_bytes), tokenize each file, pack the documents into "
            "samples of pack.seq_len tokens and write shards and manifest.json to the output "
            "(a directory or fsspec URL), on this machine's worker processes or on a Ray "
            "cluster (--engine ray), with the same bytes. Undecodable inputs are skipped and "
            "recorded; the run fails only if every input fails or a partition fails for "
            "another reason. A killed run, started again, skips the partitions it finished, "
            "reuses staged work and ends with the same bytes. Relative paths in the file "
            "resolve against the file's directory, those given here against the current "
            "directory."
        ),
    )
    p.add_argument("pipeline", help="pipeline spec YAML (e.g. pipelines/dna.yaml)")
    p.add_argument(
        "overrides",
        nargs="*",
        help=_overrides_help()
        + ", e.g. output=out/dna 'sources=[data/*.fa.gz]' pack.seq_len=65536",
    )
    p.add_argument(
        "--engine",
        choices=["local", "ray"],
        help="what runs the partitions: this machine's process pool (local, the default) or "
        "a Ray cluster (ray; pip install 'ulysses-mm[ray]'); the same bytes either way",
    )
    p.add_argument(
        "--address",
        help="with --engine ray: the cluster to join ('auto' for the one `ray start` began "
        "here, HOST:PORT); none: start a local Ray",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the resolved pipeline config and exit"
    )
    p.set_defaults(func=_cmd_prepare)


def _cmd_inspect(args: argparse.Namespace) -> int:
    import yaml

    from ulysses_mm.shards.inspect import run_inspect

    options = yaml.safe_load(args.storage_options) if args.storage_options else {}
    if not isinstance(options, dict):
        print("ulysses-mm inspect: --storage-options must be a mapping", file=sys.stderr)
        return 2
    return run_inspect(args.target, sample=args.sample, png=args.png, storage_options=options)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="print a dataset's manifest summary and one sample's segment table; --png draws it",
        description=(
            "Print the manifest summary (token space, tokenizers, counts, skipped inputs, "
            "shards) and the segment table of one packed sample. With --png, render the "
            "sample: a modality ribbon, then video frames, audio waveform and DNA GC content "
            "decoded through the tokenizers the manifest names."
        ),
    )
    p.add_argument(
        "target",
        help="manifest.json, a dataset directory, or one shard .tar (path or fsspec URL)",
    )
    p.add_argument(
        "--sample",
        type=int,
        default=0,
        help="sample to show: global index for a manifest/directory, position inside the "
        "shard for a .tar (default 0)",
    )
    p.add_argument("--png", default=None, metavar="FILE", help="also render the sample to FILE")
    p.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help='fsspec options for a remote target, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )
    p.set_defaults(func=_cmd_inspect)


def _add_tokenizer(sub: argparse._SubParsersAction) -> None:
    def run_fit(args: argparse.Namespace) -> int:
        from ulysses_mm.tokenize.fit import cli_fit

        return cli_fit(args)

    def run_eval(args: argparse.Namespace) -> int:
        from ulysses_mm.tokenize.evaluate import cli_eval

        return cli_eval(args)

    p = sub.add_parser(
        "tokenizer", help="fit learned tokenizers (video codebooks); measure any tokenizer"
    )
    tsub = p.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    f = tsub.add_parser(
        "fit",
        help="fit a tokenizer on data; write its spec JSON and artifact",
        description=(
            "Sample frames from SOURCES exactly as the tokenizer will (fps, resize, centre "
            "crop, patches), fit a k-means codebook, and write OUT (the spec) and OUT with "
            ".npy (the codebook), atomically. The spec records the artifact's sha256."
        ),
    )
    f.add_argument("modality", choices=["video"], help="what to fit (only video has one)")
    f.add_argument("sources", nargs="*", help="media files to fit on")
    f.add_argument("--out", required=True, help="spec to write, e.g. tokenizers/video-vq.json")
    f.add_argument("--name", default=None, help="spec name (default: OUT's file stem)")
    f.add_argument("--description", default=None, help="spec description (default: generated)")
    f.add_argument("--fps", type=float, default=8.0, help="frames sampled per second (default 8)")
    f.add_argument("--size", type=int, default=256, help="square crop side in pixels (default 256)")
    f.add_argument("--patch", type=int, default=16, help="patch side in pixels (default 16)")
    f.add_argument(
        "--codebook-size", type=int, default=256, help="codewords = vocab_size (default 256)"
    )
    f.add_argument(
        "--max-frames", type=int, default=None, help="frames per source to fit on (default all)"
    )
    f.add_argument("--seed", type=int, default=0, help="seed of sampling and k-means (default 0)")
    f.add_argument("--iters", type=int, default=20, help="k-means iterations at most (default 20)")
    f.add_argument(
        "--max-patches",
        type=int,
        default=200_000,
        help="patches k-means sees at most, a seeded subsample (default 200000)",
    )
    f.add_argument(
        "--backend",
        choices=["auto", "decord", "pyav"],
        default="auto",
        help="frame decoder (default auto: decord, PyAV where decord cannot)",
    )
    f.add_argument(
        "--audio-spec",
        default=None,
        help="audio spec JSON to interleave with the frames (makes a video+audio spec)",
    )
    f.add_argument(
        "--chunk-frames",
        type=int,
        default=None,
        help="frames per interleaving chunk, with --audio-spec (default 8)",
    )
    f.add_argument(
        "--codebook",
        default=None,
        help="reuse this fitted codebook .npy instead of fitting (SOURCES not needed)",
    )
    f.set_defaults(func=run_fit)
    e = tsub.add_parser(
        "eval",
        help="fidelity of a tokenizer on files: DNA exact, audio SNR dB, video PSNR dB",
        description=(
            "Tokenize each file as prepare would and decode the tokens back: DNA records must "
            "come back exactly; audio is the SNR (dB) of the decoded waveform against the one "
            "the tokenizer read (resampled, mono); video the PSNR (dB) of the decoded frames "
            "against the sampled, cropped frames. Exit 1 if a file cannot be read."
        ),
    )
    e.add_argument("spec", help="tokenizer spec JSON, e.g. tokenizers/video-vq.json")
    e.add_argument("files", nargs="+", help="files to measure")
    e.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (per-file exact / snr_db / psnr_db, and a summary)",
    )
    e.add_argument(
        "--damage",
        type=float,
        action="append",
        metavar="RATE",
        help="also decode after a fraction RATE of the ids was replaced by random ids of "
        "the modality (video, audio; repeatable, e.g. --damage 0.001 --damage 0.01)",
    )
    e.add_argument(
        "--seeds",
        type=int,
        default=5,
        help="random draws per --damage rate, seeds 0..N-1 (default 5): mean and worst",
    )
    e.set_defaults(func=run_eval)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from ulysses_mm.tools.estimate import run_cli

    return run_cli(args)


def _add_estimate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="per-GPU memory of a run, broken down; --max finds the longest sequence that fits",
        description=(
            "Estimate the per-GPU memory of one training step of CONFIG from the config alone: "
            "parameters, gradients and optimizer states under its ZeRO stage and offload, "
            "activations per layer at N/sp tokens with and without activation checkpointing "
            "(and with checkpoints offloaded), the attention working set after the all-to-all, "
            "MLP and loss tiles, communication buffers, allocator headroom. With --max, the "
            "longest sequence that fits --gpu-mem."
        ),
    )
    p.add_argument("config", help="run config YAML (see configs/)")
    p.add_argument("overrides", nargs="*", help=_overrides_help())
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs in all (world size; default parallel.sp × parallel.dp)",
    )
    p.add_argument(
        "--sp",
        type=int,
        default=None,
        help="sequence-parallel size (default: --gpus when given, else parallel.sp); dp = gpus/sp",
    )
    p.add_argument(
        "--gpu-mem",
        type=float,
        default=None,
        metavar="GB",
        help="memory of one GPU in GiB as nvidia-smi reports it (24, 40, 80, 141)",
    )
    n = p.add_mutually_exclusive_group()
    n.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sample N (default data.seq_len)"
    )
    n.add_argument("--max", action="store_true", help="find the longest N that fits --gpu-mem")
    p.add_argument(
        "--manifest",
        default=None,
        help="take the token space from this manifest when model.modalities is empty "
        "(default: the shipped tokenizer specs' space)",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=0.10,
        help="allocator headroom as a fraction of the tensor peak (default 0.10)",
    )
    p.add_argument(
        "--reserve",
        type=float,
        default=None,
        metavar="GB",
        help="flat runtime reserve per GPU in GiB, replacing the computed one (default: 1.0 "
        "for the CUDA context and cuBLAS + --nccl-reserve per NCCL communicator)",
    )
    p.add_argument(
        "--nccl-reserve",
        type=float,
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
        default=None,
        metavar="C|auto",
        help="attention in C groups of heads (default parallel.head_chunks); auto: every C the "
        "layout allows, keeping the longest sequence (--max) or the lowest total",
    )
    p.add_argument(
        "--host-mem",
        type=float,
        default=2048.0,
        metavar="GB",
        help="host memory of one node in GiB, shared by its GPUs' offloaded states and "
        "checkpoints (default 2048 = 2 TiB); a plan that needs more is refused, --max keeps "
        "within it",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs of one node, sharing --host-mem (default 8)",
    )
    p.add_argument("--phases", action="store_true", help="also list every phase's figure")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=_cmd_estimate)


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


def _add_generate(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("checkpoint", help="a run dir, a checkpoint (step_*) dir or an export dir")
    p.add_argument(
        "--modality", required=True, help="the modality to write (dna, audio, video, text, …)"
    )
    p.add_argument(
        "--prompt",
        default=None,
        metavar="FILE",
        help="a file of that modality (FASTA, audio, video, .txt); none: start a document",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--prompt-tokens", type=int, default=None, metavar="N", help="keep the first N ids"
    )
    g.add_argument(
        "--prompt-seconds",
        type=float,
        default=None,
        metavar="S",
        help="keep the first S seconds (audio, video)",
    )
    p.add_argument("--new-tokens", type=int, required=True, metavar="N", help="ids to generate")
    p.add_argument("--out", required=True, metavar="FILE", help="the file to write")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="softmax temperature (0: greedy; default 1)"
    )
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus: the likeliest ids of mass p (1: all)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
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
        type=int,
        default=None,
        help="prefill with N local sequence-parallel processes (a prompt too long for one)",
    )
    p.set_defaults(func=_cmd_generate)


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from ulysses_mm.tools.evaluate import EvaluateOptions, cli

    edges = [int(x) for x in args.edges.split(",")] if args.edges else None
    opts = EvaluateOptions(args.nproc, args.batches, args.micro_batch, edges)
    return cli(args.checkpoint, args.manifest, opts, args.json, args.png)


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="held-out loss per modality (bits per base / sample / byte) and by position",
        description=(
            "Run MANIFEST's samples, in order and at full length, through the training "
            "step's forward under the run's sequence-parallel layout: cross-entropy per "
            "modality in nats per token and in the units people quote (DNA bits per base, "
            "audio bits per sample, text bits per byte, video bits per frame), and against "
            "the target's position inside its document in log-spaced bins. The figures "
            "match the periodic eval of `ulysses-mm train` on the same batches."
        ),
    )
    p.add_argument("checkpoint", help="a run dir, its checkpoints/ dir or a step_* dir")
    p.add_argument("manifest", help="manifest.json of held-out shards (path or fsspec URL)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local processes (default: the run's parallel.sp; dp = nproc / sp)",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=0,
        help="micro-batches per DP rank (default 0: every sample once)",
    )
    p.add_argument(
        "--micro-batch", type=int, default=0, help="samples per DP rank (default: the run's)"
    )
    p.add_argument(
        "--edges",
        default=None,
        metavar="P0,P1,...",
        help="position bin edges instead of log-spaced ones, e.g. 2,1026,2050",
    )
    p.add_argument("--json", action="store_true", help="print every figure as JSON")
    p.add_argument("--png", default=None, metavar="FILE", help="plot loss against position")
    p.set_defaults(func=_cmd_evaluate)


def _add_probe(sub: argparse._SubParsersAction) -> None:
    def run_write(args: argparse.Namespace) -> int:
        from ulysses_mm.tools.probe import halves, write_probe

        d = write_probe(args.out, args.length, args.documents, args.eval_documents, args.seed)
        edges = ",".join(str(e) for e in halves(d.length))
        print(
            f"wrote the probe of L={d.length:,} ({d.seq_len:,}-token samples, one document "
            f"each):\n  train: {d.train}\n  held out: {d.eval}\n"
            f"train on it: ulysses-mm train CONFIG data.train={d.train} parallel.sp=P\n"
            f"then: ulysses-mm probe score RUN_DIR {d.eval}   (or ulysses-mm evaluate "
            f"RUN_DIR {d.eval} --edges {edges})"
        )
        return 0

    def run_score(args: argparse.Namespace) -> int:
        from ulysses_mm.tools.probe import score

        first, second = score(args.checkpoint, args.manifest, args.nproc)
        print(
            f"first half: {first:.4f} bits/base (unpredictable: 2 at best)\n"
            f"second half: {second:.4f} bits/base (a copy from L bases back: 0 once the "
            "model uses its context)"
        )
        return 0

    p = sub.add_parser(
        "probe",
        help="a long-context probe: L random bases, then the same L again; its score",
        description=(
            "write: DNA documents of L random bases followed by the same L bases (and one "
            "N), one per packed sample of 2L+4 tokens, prepared into a training and a "
            "held-out dataset. score: bits per base of each half on the held-out one (the "
            "first stays at 2, the second falls to 0 once the model copies from L back)."
        ),
    )
    psub = p.add_subparsers(dest="probe_command", required=True, metavar="ACTION")
    w = psub.add_parser("write", help="write the probe's train and held-out datasets")
    w.add_argument("out", help="output directory (train/, eval/, src/)")
    w.add_argument("--length", type=int, required=True, metavar="L", help="bases per half")
    w.add_argument("--documents", type=int, default=2048, help="training documents (2048)")
    w.add_argument("--eval-documents", type=int, default=64, help="held-out documents (64)")
    w.add_argument("--seed", type=int, default=0, help="seed of the bases (held out: seed+1)")
    w.set_defaults(func=run_write)
    s = psub.add_parser("score", help="bits per base of each half on a probe dataset")
    s.add_argument("checkpoint", help="a run dir, its checkpoints/ dir or a step_* dir")
    s.add_argument("manifest", help="the probe's held-out manifest.json")
    s.add_argument("--nproc", type=int, default=None, help="processes (default: the run's sp)")
    s.set_defaults(func=run_score)


# One entry per subcommand, in the order `--help` lists them.
_SUBCOMMANDS = [
    _add_demo,
    _add_prepare,
    _add_inspect,
    _add_tokenizer,
    _add_train,
    _add_export,
    _add_hf_tokenizer,
    _add_generate,
    _add_evaluate,
    _add_probe,
    _add_report,
    _add_verify,
    _add_estimate,
    _add_config,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ulysses-mm",
        description="Train one transformer on million-token streams of video, audio and DNA.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def _strip_local_rank(argv: Sequence[str]) -> list[str]:
    """The DeepSpeed launcher appends ``--local_rank=N`` to every command (LOCAL_RANK is in
    the environment too, which is what we read); drop it before parsing."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif not arg.startswith(("--local_rank=", "--local-rank=")):
            out.append(arg)
    return out


# ``section.key=value``: a dotted key of letters, digits, '_' and '-', then '='.
_OVERRIDE = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*=")


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args``, with ``key=value`` overrides accepted after options too.

    argparse gives a ``nargs="*"`` positional only the words before the first option
    (``train CONFIG --nproc 2 train.steps=1`` would leave ``train.steps=1`` unrecognized);
    the words it could not place that are overrides join ``overrides``, in order."""
    args, extras = parser.parse_known_args(_strip_local_rank(argv))
    if extras:
        takes = isinstance(getattr(args, "overrides", None), list)
        rest = [a for a in extras if not (takes and _OVERRIDE.match(a))]
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *extras]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args))
    except UserError as e:  # what the user can fix: one line; anything else keeps its traceback
        print(f"ulysses-mm {args.command}: {e.prefix}{e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
