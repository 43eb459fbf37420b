"""Offline commands: raw files to shards and back (prepare, inspect, tokenizer, probe,
hf-tokenizer). Nothing here imports torch until a command runs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ulysses_mm.cli.declare import Parser, command, overrides, positional
from ulysses_mm.config.parse import option
from ulysses_mm.config.pipeline import ENGINES
from ulysses_mm.core.checks import INT64_SAFE, MAX_PROCESSES, MAX_SEED, MAX_TOKENS


@dataclass
class Prepare:
    pipeline: str = positional(
        "pipeline spec YAML, or a shipped pipeline's name (ulysses-mm pipelines)", "pipeline"
    )
    overrides: list[str] = overrides(
        ", e.g. output=out/dna 'sources=[data/*.fa.gz]' pack.seq_len=65536"
    )
    engine: str | None = option(
        "what runs the partitions: this machine's process pool (local, the default) or a "
        "Ray cluster (ray; pip install 'ulysses-mm[ray]'); the same bytes either way",
        None, choices=ENGINES,
    )  # fmt: skip
    address: str | None = option(
        "with --engine ray: the cluster to join ('auto' for the one `ray start` began "
        "here, HOST:PORT); none: start a local Ray", None,
    )  # fmt: skip
    print_config: bool = option("print the resolved pipeline config and exit", False)


def _prepare(a: Prepare) -> int:
    from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare  # lazy: numpy

    extra = [f"engine={a.engine}"] if a.engine else []
    extra += [f"ray_address={a.address}"] if a.address is not None else []
    cfg = load_pipeline_config(a.pipeline, [*a.overrides, *extra])
    if a.print_config:
        import yaml  # lazy: only this branch prints YAML

        from ulysses_mm.config import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    prepare(cfg)
    return 0


@dataclass
class Inspect:
    target: str = positional(
        "manifest.json, a dataset directory, or one shard .tar (path or fsspec URL)", "in_path"
    )
    sample: int = option(
        "sample to show: global index for a manifest/directory, position inside the shard "
        "for a .tar", 0, ge=0, le=INT64_SAFE,
    )  # fmt: skip
    png: str | None = option(
        "also render the sample to FILE", None, path="out_file", metavar="FILE"
    )
    storage_options: dict | None = option(
        'fsspec options for a remote target, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
        None, metavar="JSON",
    )  # fmt: skip


def _inspect(a: Inspect) -> int:
    from ulysses_mm.core.storage import Location
    from ulysses_mm.shards.inspect import run_inspect  # lazy: matplotlib, the decoders

    return run_inspect(Location(a.target, a.storage_options or {}), sample=a.sample, png=a.png)


@dataclass
class ProbeWrite:
    out: str = positional("output directory (train/, eval/, src/)", "out_dir")
    length: int = option("bases per half", ge=1, le=MAX_TOKENS, metavar="L")
    documents: int = option("training documents", 2048, ge=1, le=10**7)
    eval_documents: int = option("held-out documents", 64, ge=1, le=10**7)
    seed: int = option("seed of the bases (held out: seed+1)", 0, ge=0, le=MAX_SEED)
    eval_lengths: list[int] | None = option(
        "also write held-out documents of these lengths, one dataset each (eval-L<n>/)", None,
        ge=1, le=MAX_TOKENS, metavar="L1,L2,...",
    )  # fmt: skip
    pack: int = option(
        "documents per packed sample, K·(2L+4) tokens, in every dataset", 1, ge=1, le=10**6,
        metavar="K",
    )  # fmt: skip


def _probe_write(a: ProbeWrite) -> int:
    from ulysses_mm.tools.probe import halves, write_probe  # lazy: torch

    d = write_probe(a.out, a.length, a.documents, a.eval_documents, a.seed, a.eval_lengths, a.pack)
    edges = ",".join(str(e) for e in halves(d.length))
    each = "one document" if d.pack == 1 else f"{d.pack} documents"
    held = "".join(f"\n  held out, L={n:,}: {p}" for n, p in d.evals.items() if n != d.length)
    print(
        f"wrote the probe of L={d.length:,} ({d.seq_len:,}-token samples, {each} each):\n"
        f"  train: {d.train}\n  held out: {d.eval}{held}\n"
        f"train on it: ulysses-mm train CONFIG data.train={d.train} parallel.sp=P\n"
        f"then: ulysses-mm probe score RUN_DIR {d.eval}   (or ulysses-mm evaluate "
        f"RUN_DIR {d.eval} --seq-len {2 * d.length + 4} --edges {edges})"
    )
    return 0


@dataclass
class ProbeScore:
    checkpoint: str = positional("a run dir, its checkpoints/ dir or a step_* dir", "in_dir")
    manifest: str = positional("the probe's held-out manifest.json", "in_path")
    nproc: int | None = option("processes (default: the sp)", None, ge=1, le=MAX_PROCESSES)
    length: int = option(
        "the L of the documents to score, on windows of 2L+4 tokens, one document each (0: "
        "the manifest's; refused if its documents have another)", 0, ge=0, le=MAX_TOKENS,
        metavar="L",
    )  # fmt: skip
    sp: int = option(
        "N Ulysses ranks instead of the run's layout (0: the run's parallel.sp)", 0,
        ge=0, le=MAX_PROCESSES, metavar="N",
    )  # fmt: skip


def _probe_score(a: ProbeScore) -> int:
    from ulysses_mm.tools.probe import score  # lazy: torch

    first, second = score(a.checkpoint, a.manifest, a.nproc, a.length, a.sp)
    print(
        f"first half: {first:.4f} bits/base (unpredictable: 2 at best)\n"
        f"second half: {second:.4f} bits/base (a copy from L bases back: 0 once the "
        "model uses its context)"
    )
    return 0


@dataclass
class HfTokenizer:
    manifest: str = positional("manifest.json (path or URL) or its dataset directory", "in_path")
    out: str = positional(
        "new output directory (tokenizer.json + tokenizer_config.json)", "out_dir"
    )
    text_tokenizer: str | None = option(
        "the text modality's transformers tokenizer directory, to name text ids by its "
        "tokens (default: bytes for the shipped text-bytes spec, else the local id)", None,
        path="in_dir", exist=True,
    )  # fmt: skip


def _hf_tokenizer(a: HfTokenizer) -> int:
    from ulysses_mm.hf.tokenizer import write_tokenizer  # lazy: transformers
    from ulysses_mm.shards.manifest import Manifest

    manifest = Manifest.load(a.manifest)
    out = write_tokenizer(manifest, a.out, a.text_tokenizer)
    print(
        f"wrote a transformers tokenizer of the {manifest.token_space.describe()} to {out} "
        "(AutoTokenizer.from_pretrained)"
    )
    return 0


def add_prepare(sub: argparse._SubParsersAction) -> None:
    command(sub, "prepare", "tokenize raw files, pack them and write WebDataset shards + manifest.json", [Prepare], _prepare, (
        "Run a pipeline spec (pipelines/*.yaml): expand the sources, cut them into partitions "
        "(shards.partition_bytes), tokenize each file, pack the documents into samples of "
        "pack.seq_len tokens and write shards and manifest.json to the output (a directory "
        "or fsspec URL), on this machine's worker processes or on a Ray cluster (--engine "
        "ray), with the same bytes. Undecodable inputs are skipped and recorded; the run "
        "fails only if every input fails or a partition fails for another reason. A killed "
        "run, started again, skips the partitions it finished, reuses staged work and ends "
        "with the same bytes. Relative paths in the file resolve against the file's "
        "directory, those given here against the current directory."
    ))  # fmt: skip


def add_inspect(sub: argparse._SubParsersAction) -> None:
    command(sub, "inspect", "print a dataset's manifest summary and one sample's segment table; --png draws it", [Inspect], _inspect, (
        "Print the manifest summary (token space, tokenizers, counts, skipped inputs, "
        "shards) and the segment table of one packed sample. With --png, render the "
        "sample: a modality ribbon, then video frames, audio waveform and DNA GC content "
        "decoded through the tokenizers the manifest names."
    ))  # fmt: skip


def _fit_kinds(f: Parser) -> None:
    """``tokenizer fit KIND``: one command per kind the registry says can be fitted, its
    flags that kind's fit options; a modality with one such kind names it too."""
    from ulysses_mm.tokenize.registry import fittable, kinds  # lazy: numpy, when fit is chosen

    fits = fittable()
    prefixes = [k.partition("-")[0] for k in fits]
    can = ", ".join(f"{k} ({k.partition('-')[0]})" for k in fits)
    f.unknown = lambda name: (  # a kind or modality with nothing to fit: one line
        f"{name} {'has nothing to fit' if name in kinds() else 'is no tokenizer kind'}; "
        f"the kinds that can be fitted: {can}"
    )
    fsub = f.add_subparsers(dest="kind", required=True, metavar="KIND", parser_class=Parser)
    for name, target in fits.items():
        alias = name.partition("-")[0]
        aliases = [alias] if prefixes.count(alias) == 1 and alias not in kinds() else []
        command(fsub, name, f"fit a {name} tokenizer", [target], lambda o: o.run(), aliases=aliases)


def add_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tokenizer", help="fit learned tokenizers (video codebooks); measure any tokenizer"
    )
    tsub = p.add_subparsers(
        dest="tokenizer_command", required=True, metavar="ACTION", parser_class=Parser
    )
    tsub.add_parser(
        "fit",
        help="fit a tokenizer kind on data; write its spec JSON and artifact",
        declare=_fit_kinds,
    )
    command(tsub, "eval", "fidelity of a tokenizer on files: DNA exact, audio SNR dB, video PSNR dB", ["ulysses_mm.tokenize.evaluate:TokenizerEval"], lambda o: o.run(), (
        "Tokenize each file as prepare would and decode the tokens back: DNA records must "
        "come back exactly; audio is the SNR (dB) of the decoded waveform against the one "
        "the tokenizer read (resampled, mono); video the PSNR (dB) of the decoded frames "
        "against the sampled, cropped frames. Exit 1 if a file cannot be read."
    ))  # fmt: skip


def add_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="a long-context probe: L random bases, then the same L again; its score", description=(
        "write: DNA documents of L random bases followed by the same L bases (and one N), "
        "2L+4 tokens, one (or --pack K) per packed sample, prepared into a training and a "
        "held-out dataset (and one held-out dataset per --eval-lengths). score: bits per "
        "base of each half on a held-out one, on windows of one document (the first stays "
        "at 2, the second falls to 0 once the model copies from L back)."
    ))  # fmt: skip
    psub = p.add_subparsers(
        dest="probe_command", required=True, metavar="ACTION", parser_class=Parser
    )
    command(
        psub, "write", "write the probe's train and held-out datasets", [ProbeWrite], _probe_write
    )
    command(
        psub, "score", "bits per base of each half on a probe dataset", [ProbeScore], _probe_score
    )


def add_hf_tokenizer(sub: argparse._SubParsersAction) -> None:
    text = "write a transformers tokenizer whose vocabulary is a manifest's token space"
    command(sub, "hf-tokenizer", text, [HfTokenizer], _hf_tokenizer)
