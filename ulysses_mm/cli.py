"""``ulysses-mm``: a thin CLI; each subcommand maps to one function.

Configuration precedence everywhere: CLI ``section.key=value`` > the YAML file > the
schema's defaults.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ulysses_mm.config import ConfigError, RunConfig, describe, load_config


def _overrides_help() -> str:
    return "section.key=value overrides, applied after the file (CLI > file > defaults)"


def _cmd_verify(args: argparse.Namespace) -> int:
    from ulysses_mm.verify import VerifyOptions, run_verify

    cfg = load_config(RunConfig, args.config, args.overrides)
    opts = VerifyOptions(
        sp=args.sp,
        dp=args.dp,
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
        for key, tp, text in describe(RunConfig):
            print(f"{key:<40s} {tp:<24s} {text}")
        return 0
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
    p.add_argument("--sp", type=int, required=True, help="sequence-parallel size P")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size D (default 1)")
    p.add_argument("--config", default=None, help="run config YAML (default: built-in debug model)")
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
        "--keys", action="store_true", help="list every config key with its type and help"
    )
    p.set_defaults(func=_cmd_config)


def _add_tokenizer(sub: argparse._SubParsersAction) -> None:
    def run_fit(args: argparse.Namespace) -> int:
        from ulysses_mm.modalities.fit import cli_fit

        return cli_fit(args)

    p = sub.add_parser("tokenizer", help="fit learned tokenizers (video codebooks)")
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


# One entry per subcommand, in the order `--help` lists them.
_SUBCOMMANDS = [_add_verify, _add_config, _add_tokenizer]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ulysses-mm",
        description="Train one transformer on million-token streams of video, audio and DNA.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"ulysses-mm {args.command}: config error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"ulysses-mm {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
