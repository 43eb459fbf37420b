"""``ulysses-mm``: a thin CLI; each command is one row of :data:`_COMMANDS`.

A command declares its arguments as dataclasses (:mod:`~ulysses_mm.cli.declare`): those
only the CLI has live by what they act on (:mod:`~ulysses_mm.cli.data` raw files and
shards, :mod:`~ulysses_mm.cli.model` a model, :mod:`~ulysses_mm.cli.setup` checks before a
run), the others beside the code they configure. Configuration precedence everywhere:
CLI ``section.key=value`` > the YAML file > the schema's defaults.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from ulysses_mm.cli import data, model, setup, shipped
from ulysses_mm.cli.declare import Parser, command
from ulysses_mm.core.errors import UserError
from ulysses_mm.core.launch_env import LAUNCH_ENV, in_launched_world

# One row per command, in the order `--help` lists them: name, help, its options
# dataclasses ("module:Class" is imported when the command is chosen); or a function that
# adds a command with actions of its own.
_COMMANDS: list[Any] = [
    ("demo", "the default job: prepare the sample data, train the debug model at SP=2, plot", [model.Demo]),
    ("prepare", "tokenize raw files, pack them and write WebDataset shards + manifest.json", [data.Prepare]),
    ("inspect", "print a dataset's manifest summary and one sample's segment table; --png draws it", ["ulysses_mm.shards.inspect:Inspect"]),
    data.add_tokenizer,
    ("train", "train from shards with DeepSpeed + Ulysses", [model.Train]),
    ("export", "write a checkpoint as a transformers (safetensors) model", [model.Export]),
    ("hf-tokenizer", "write a transformers tokenizer whose vocabulary is a manifest's token space", ["ulysses_mm.hf.tokenizer:HfTokenizer"]),
    ("generate", "continue a prompt in one modality; write FASTA / WAV / MP4 / text", [model.Generate, "ulysses_mm.tools.generate:GenerateOptions"]),
    ("evaluate", "held-out loss per modality (bits per base / sample / byte) and by position", [model.Evaluate, "ulysses_mm.tools.evaluate:EvaluateOptions"]),
    data.add_probe,
    ("report", "plot a run's loss curves per modality", [model.Report]),
    ("verify", "check that dp × sp gives the loss and gradients of one process", [setup.Verify, "ulysses_mm.tools.verify:VerifyOptions"]),
    ("estimate", "per-GPU memory of a run, broken down; --max finds the longest sequence that fits", ["ulysses_mm.tools.estimate.options:EstimateArgs"]),
    ("config", "print a resolved run config, or every key with --keys", [setup.Config]),
    shipped.add,  # pipelines, configs
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ulysses-mm",
        description="Train one transformer on million-token streams of video, audio, DNA and text.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=Parser
    )
    for row in _COMMANDS:
        row(sub) if callable(row) else command(sub, *row)
    return parser


def _strip_local_rank(argv: Sequence[str]) -> list[str]:
    """The DeepSpeed launcher appends ``--local_rank=N`` to every command (LOCAL_RANK is in
    the environment too, which is what we read); drop it before parsing."""
    out, skip = [], False
    for arg in argv:
        flag = not skip and arg in ("--local_rank", "--local-rank")  # its value follows
        if not (skip or flag or arg.startswith(("--local_rank=", "--local-rank="))):
            out.append(arg)
        skip = flag
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
            _chosen(parser, args).error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *extras]
    return args


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command ``args`` ran, so its errors name the command."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None:
            return parser
        parser = subs[0].choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    try:  # a refused argument is one line (the parsers' error); --help is exit 0
        args = parse_args(build_parser(), sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    # a launched rank leaves its world when the command is done; a group the caller made is
    # the caller's to end, and a lone process keeps its one-rank group (DeepSpeed holds it)
    launched = in_launched_world() and not _in_world()
    # a lone process's one-rank world in its environment (for DeepSpeed) is undone after
    # the command: a process the caller starts later is not a launched rank
    env = {k: os.environ.get(k) for k in (*LAUNCH_ENV, "LOCAL_RANK")}
    try:
        code = int(args.func(args))
    except UserError as e:  # what the user can fix: one line; anything else keeps its traceback
        print(f"ulysses-mm {args.command}: {e.prefix}{e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # the reader left (| head): stop quietly with SIGPIPE's status
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        if not launched:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    if launched and _in_world():
        from ulysses_mm.parallel.mesh import close_world  # lazy: torch

        close_world()
    return code


def _in_world() -> bool:
    if "torch.distributed" not in sys.modules:  # not imported: no group (and no import cost)
        return False
    import torch.distributed as dist  # lazy: imported already, checked above

    return dist.is_available() and dist.is_initialized()
