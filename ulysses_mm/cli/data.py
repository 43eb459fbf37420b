"""Offline commands: raw files to shards and back (prepare, inspect, tokenizer, probe,
hf-tokenizer). Nothing here imports torch until a command runs."""

from __future__ import annotations

import argparse

from ulysses_mm.cli.common import Parser, overrides_help
from ulysses_mm.config.pipeline import ENGINES
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


def add_prepare(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument(
        "pipeline", type=in_file_arg(), help="pipeline spec YAML (e.g. pipelines/dna.yaml)"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help=overrides_help() + ", e.g. output=out/dna 'sources=[data/*.fa.gz]' pack.seq_len=65536",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
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


def _mapping(text: str) -> dict:
    """``--storage-options``: a JSON (or YAML) mapping."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON mapping, got {text!r}")
    return value


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ulysses_mm.core.storage import Location
    from ulysses_mm.shards.inspect import run_inspect

    where = Location(args.target, args.storage_options or {})
    return run_inspect(where, sample=args.sample, png=args.png)


def add_inspect(sub: argparse._SubParsersAction) -> None:
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
        type=in_path_arg(),
        help="manifest.json, a dataset directory, or one shard .tar (path or fsspec URL)",
    )
    p.add_argument(
        "--sample",
        type=integer_arg(ge=0, le=INT64_SAFE),
        default=0,
        help="sample to show: global index for a manifest/directory, position inside the "
        "shard for a .tar (default 0)",
    )
    p.add_argument(
        "--png",
        type=out_file_arg(),
        default=None,
        metavar="FILE",
        help="also render the sample to FILE",
    )
    p.add_argument(
        "--storage-options",
        type=_mapping,
        default=None,
        metavar="JSON",
        help='fsspec options for a remote target, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )
    p.set_defaults(func=_cmd_inspect)


def add_tokenizer(sub: argparse._SubParsersAction) -> None:
    def run_fit(args: argparse.Namespace) -> int:
        from ulysses_mm.tokenize.video.fit import cli_fit

        return cli_fit(args)

    def run_eval(args: argparse.Namespace) -> int:
        from ulysses_mm.tokenize.evaluate import cli_eval

        return cli_eval(args)

    p = sub.add_parser(
        "tokenizer", help="fit learned tokenizers (video codebooks); measure any tokenizer"
    )
    tsub = p.add_subparsers(
        dest="tokenizer_command", required=True, metavar="ACTION", parser_class=Parser
    )
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
    f.add_argument("sources", nargs="*", type=in_file_arg(), help="media files to fit on")
    f.add_argument(
        "--out",
        type=out_file_arg(),
        required=True,
        help="spec to write, e.g. tokenizers/video-vq.json",
    )
    f.add_argument("--name", default=None, help="spec name (default: OUT's file stem)")
    f.add_argument("--description", default=None, help="spec description (default: generated)")
    f.add_argument(
        "--fps",
        type=number_arg(gt=0, le=1000),
        default=8.0,
        help="frames sampled per second, in (0, 1000] (default 8)",
    )
    f.add_argument(
        "--size",
        type=count_arg(1 << 16),
        default=256,
        help="square crop side in pixels, 1..65536 (default 256)",
    )
    f.add_argument(
        "--patch",
        type=count_arg(1 << 16),
        default=16,
        help="patch side in pixels, 1..65536 (default 16)",
    )
    f.add_argument(
        "--codebook-size",
        type=count_arg(1 << 24),
        default=256,
        help="codewords = vocab_size, 1..2^24 (default 256)",
    )
    f.add_argument(
        "--max-frames",
        type=count_arg(1 << 31),
        default=None,
        help="frames per source to fit on (default all)",
    )
    f.add_argument(
        "--seed", type=seed_arg(), default=0, help="seed of sampling and k-means (default 0)"
    )
    f.add_argument(
        "--iters",
        type=count_arg(10**6),
        default=20,
        help="k-means iterations at most, 1..10^6 (default 20)",
    )
    f.add_argument(
        "--max-patches",
        type=count_arg(10**9),
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
        type=in_file_arg(),
        default=None,
        help="audio spec JSON to interleave with the frames (makes a video+audio spec)",
    )
    f.add_argument(
        "--chunk-frames",
        type=count_arg(10**6),
        default=None,
        help="frames per interleaving chunk, with --audio-spec (default 8)",
    )
    f.add_argument(
        "--codebook",
        type=in_file_arg(),
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
    e.add_argument(
        "spec", type=in_file_arg(), help="tokenizer spec JSON, e.g. tokenizers/video-vq.json"
    )
    e.add_argument("files", nargs="+", type=in_file_arg(), help="files to measure")
    e.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (per-file exact / snr_db / psnr_db, and a summary)",
    )
    e.add_argument(
        "--damage",
        type=number_arg(gt=0, le=1, says="0 < RATE <= 1"),
        action="append",
        metavar="RATE",
        help="also decode after a fraction RATE of the ids was replaced by random ids of "
        "the modality (video, audio; repeatable, e.g. --damage 0.001 --damage 0.01)",
    )
    e.add_argument(
        "--seeds",
        type=count_arg(10**4),
        default=5,
        help="random draws per --damage rate, seeds 0..N-1 (default 5): mean and worst",
    )
    e.set_defaults(func=run_eval)


def add_probe(sub: argparse._SubParsersAction) -> None:
    def run_write(args: argparse.Namespace) -> int:
        from ulysses_mm.tools.probe import halves, write_probe

        lengths = args.eval_lengths or []
        d = write_probe(
            args.out,
            args.length,
            args.documents,
            args.eval_documents,
            args.seed,
            eval_lengths=lengths,
            pack=args.pack,
        )
        edges = ",".join(str(e) for e in halves(d.length))
        each = "one document" if d.pack == 1 else f"{d.pack} documents"
        held = "".join(f"\n  held out, L={n:,}: {p}" for n, p in d.evals.items() if n != d.length)
        print(
            f"wrote the probe of L={d.length:,} ({d.seq_len:,}-token samples, {each} "
            f"each):\n  train: {d.train}\n  held out: {d.eval}{held}\n"
            f"train on it: ulysses-mm train CONFIG data.train={d.train} parallel.sp=P\n"
            f"then: ulysses-mm probe score RUN_DIR {d.eval}   (or ulysses-mm evaluate "
            f"RUN_DIR {d.eval} --seq-len {2 * d.length + 4} --edges {edges})"
        )
        return 0

    def run_score(args: argparse.Namespace) -> int:
        from ulysses_mm.tools.probe import score

        first, second = score(args.checkpoint, args.manifest, args.nproc, args.length, args.sp)
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
            "N), 2L+4 tokens, one (or --pack K) per packed sample, prepared into a training "
            "and a held-out dataset (and one held-out dataset per --eval-lengths). score: "
            "bits per base of each half on a held-out one, on windows of one document (the "
            "first stays at 2, the second falls to 0 once the model copies from L back)."
        ),
    )
    psub = p.add_subparsers(
        dest="probe_command", required=True, metavar="ACTION", parser_class=Parser
    )
    w = psub.add_parser("write", help="write the probe's train and held-out datasets")
    w.add_argument("out", type=out_dir_arg(), help="output directory (train/, eval/, src/)")
    w.add_argument(
        "--length",
        type=count_arg(MAX_TOKENS),
        required=True,
        metavar="L",
        help=f"bases per half, 1..{MAX_TOKENS:,}",
    )
    w.add_argument(
        "--documents",
        type=count_arg(10**7),
        default=2048,
        help="training documents, 1..10^7 (2048)",
    )
    w.add_argument(
        "--eval-documents",
        type=count_arg(10**7),
        default=64,
        help="held-out documents, 1..10^7 (64)",
    )
    w.add_argument(
        "--seed", type=seed_arg(), default=0, help="seed of the bases (held out: seed+1)"
    )
    w.add_argument(
        "--eval-lengths",
        type=int_list_arg(ge=1, lt=MAX_TOKENS + 1),
        default=None,
        metavar="L1,L2,...",
        help="also write held-out documents of these lengths, one dataset each (eval-L<n>/)",
    )
    w.add_argument(
        "--pack",
        type=count_arg(10**6),
        default=1,
        metavar="K",
        help="documents per packed sample, K·(2L+4) tokens, in every dataset (default 1)",
    )
    w.set_defaults(func=run_write)
    s = psub.add_parser("score", help="bits per base of each half on a probe dataset")
    s.add_argument(
        "checkpoint", type=in_dir_arg(), help="a run dir, its checkpoints/ dir or a step_* dir"
    )
    s.add_argument("manifest", type=in_path_arg(), help="the probe's held-out manifest.json")
    s.add_argument(
        "--nproc",
        type=count_arg(MAX_PROCESSES),
        default=None,
        help="processes (default: the sp)",
    )
    s.add_argument(
        "--length",
        type=integer_arg(ge=0, le=MAX_TOKENS),
        default=0,
        metavar="L",
        help="the L of the documents to score, on windows of 2L+4 tokens, one document each "
        "(default 0: the manifest's; refused if its documents have another)",
    )
    s.add_argument(
        "--sp",
        type=integer_arg(ge=0, le=MAX_PROCESSES),
        default=0,
        metavar="N",
        help="N Ulysses ranks instead of the run's layout (default 0: the run's parallel.sp)",
    )
    s.set_defaults(func=run_score)


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


def add_hf_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "hf-tokenizer",
        help="write a transformers tokenizer whose vocabulary is a manifest's token space",
    )
    p.add_argument(
        "manifest",
        type=in_path_arg(),
        help="manifest.json (path or URL) or its dataset directory",
    )
    p.add_argument(
        "out",
        type=out_dir_arg(),
        help="new output directory (tokenizer.json + tokenizer_config.json)",
    )
    p.add_argument(
        "--text-tokenizer",
        type=in_dir_arg(exist=True),
        default=None,
        help="the text modality's transformers tokenizer directory, to name text ids by its "
        "tokens (default: bytes for the shipped text-bytes spec, else the local id)",
    )
    p.set_defaults(func=_cmd_hf_tokenizer)
