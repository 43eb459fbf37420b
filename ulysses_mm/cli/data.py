"""Offline commands: raw files to shards and back (prepare; tokenizer fit and eval; probe
write and score). Nothing here imports torch until a command runs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ulysses_mm.cli.declare import Parser, command
from ulysses_mm.config import to_dict
from ulysses_mm.config.parse import option, overrides, positional
from ulysses_mm.config.pipeline import ENGINES


@dataclass
class Prepare:
    """Run a pipeline spec (pipelines/*.yaml): expand the sources, cut them into partitions
    (shards.partition_bytes), tokenize each file, pack the documents into samples of
    pack.seq_len tokens and write shards and manifest.json to the output (a directory or
    fsspec URL), on this machine's worker processes or on a Ray cluster (--engine ray),
    with the same bytes. Undecodable inputs are skipped and recorded; the run fails only if
    every input fails or a partition fails for another reason. A killed run, started again,
    skips the partitions it finished, reuses staged work and ends with the same bytes.
    Relative paths in the file resolve against the file's directory, those given here
    against the current directory."""

    pipeline: str = positional(
        "pipeline spec YAML, or a shipped pipeline's name (ulysses-mm pipelines)", "pipeline"
    )
    overrides: list[str] = overrides(
        ", e.g. output=out/dna 'sources=[data/*.fa.gz]' pack.seq_len=65536"
    )
    executor: str | None = option(
        "what runs the partitions: this machine's process pool (local, the default) or a "
        "Ray cluster (ray; pip install 'ulysses-mm[ray]'); the same bytes either way",
        None, choices=ENGINES, flags=("--engine",), metavar="{local,ray}",
    )  # fmt: skip
    address: str | None = option(
        "with --engine ray: the cluster to join ('auto' for the one `ray start` began "
        "here, HOST:PORT); none: start a local Ray", None,
    )  # fmt: skip
    print_config: bool = option("print the resolved pipeline config and exit", False)

    def main(self) -> int:
        from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare  # lazy: numpy

        extra = [f"engine={self.executor}"] if self.executor else []  # the pipeline's key
        extra += [f"ray_address={self.address}"] if self.address is not None else []
        cfg = load_pipeline_config(self.pipeline, [*self.overrides, *extra])
        if self.print_config:
            import yaml  # lazy: only this branch prints YAML

            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
            return 0
        prepare(cfg)
        return 0


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
        command(fsub, name, f"fit a {name} tokenizer", [target], aliases=aliases)


def add_tokenizer(sub: argparse._SubParsersAction) -> None:
    text = "fit learned tokenizers (video codebooks); measure any tokenizer"
    tsub = sub.add_parser("tokenizer", help=text).add_subparsers(
        dest="tokenizer_command", required=True, metavar="ACTION", parser_class=Parser
    )
    text = "fit a tokenizer kind on data; write its spec JSON and artifact"
    tsub.add_parser("fit", help=text, declare=_fit_kinds)
    text = "fidelity of a tokenizer on files: DNA exact, audio SNR dB, video PSNR dB"
    command(tsub, "eval", text, ["ulysses_mm.tokenize.evaluate:TokenizerEval"])


def add_probe(sub: argparse._SubParsersAction) -> None:
    text = "a long-context probe: L random bases, then the same L again; its score"
    psub = sub.add_parser("probe", help=text).add_subparsers(
        dest="probe_command", required=True, metavar="ACTION", parser_class=Parser
    )
    text = "write the probe's train and held-out datasets"
    command(psub, "write", text, ["ulysses_mm.tools.probe:ProbeWrite"])
    text = "bits per base of each half on a probe dataset"
    command(psub, "score", text, ["ulysses_mm.tools.probe:ProbeScore"])
