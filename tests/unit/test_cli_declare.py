"""Commands declared from dataclasses (ulysses_mm.cli.declare), tested as they are used:
through the real parser. Every numeric bound of every command is refused one step outside
it with one line naming the flag and the range, and taken at the bound; the help shows each
range; a command's options read back into its dataclass; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import pytest
from conftest import REPO

from ulysses_mm.cli import build_parser, main, parse_args
from ulysses_mm.cli.declare import leaves
from ulysses_mm.core.checks import Range

TINY = str(REPO / "configs" / "debug-tiny.yaml")
DOCS = REPO / "docs" / "cli.md"


def _commands() -> list[tuple[str, argparse.ArgumentParser]]:
    return [(" ".join(words), parser) for words, parser in leaves(build_parser())]


def _valid(action: argparse.Action, tmp: Path) -> str:
    """A value the action's type takes."""
    check = getattr(action.type, "check", None)
    r: Range | None = getattr(action.type, "range", None)
    if r is not None:
        low = r.low if r.low is not None else 0
        return str(int(low) + 1 if r.low_open else math.ceil(low))
    return {
        "out_file": str(tmp / "out.file"),
        "out_dir": str(tmp / "out_dir"),
        "run_config": TINY,
        "pipeline": str(REPO / "pipelines" / "dna.yaml"),
        "tokenizer_spec": str(REPO / "tokenizers" / "dna-base.json"),
    }.get(check or "", action.choices[0] if action.choices else "x")  # type: ignore[index]


def _base(cmd: str, parser: argparse.ArgumentParser, tmp: Path) -> list[str]:
    """The command with a valid value for each required argument."""
    argv = cmd.split()
    for a in parser._actions:
        if not a.option_strings and a.nargs not in ("*", "?"):
            argv.append(_valid(a, tmp))
        elif a.option_strings and a.required:
            argv += [a.option_strings[0], _valid(a, tmp)]
    return argv


def _outside(r: Range, integer: bool) -> list[float]:
    """A value just below and just above the range (where it has those bounds)."""
    out = []
    for bound, is_open, step in ((r.low, r.low_open, -1), (r.high, r.high_open, 1)):
        if bound is not None:
            out.append(
                bound if is_open else bound + step * (1 if integer else abs(bound) * 1e-6 + 1e-9)
            )
    return out


def _numeric() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    return [
        (cmd, p, a)
        for cmd, p in _commands()
        for a in p._actions
        if getattr(a.type, "range", None) is not None and a.help != argparse.SUPPRESS
    ]


def test_the_commands_declare_their_numbers_with_ranges():
    numeric = _numeric()
    assert len(numeric) >= 50
    for cmd, _, a in numeric:  # the help shows the bound the type enforces
        assert str(a.type.range) in a.help, (cmd, a.dest, a.help)  # type: ignore[union-attr]


@pytest.mark.parametrize("cmd,action", [(c, a.dest) for c, _, a in _numeric()])
def test_every_bound_is_enforced_in_one_line(cmd, action, tmp_path, capsys):
    parser = dict(_commands())[cmd]
    a = next(x for x in parser._actions if x.dest == action and x.help != argparse.SUPPRESS)
    r: Range = a.type.range  # type: ignore[union-attr]
    integer = a.type.check in ("integer", "int_list")  # type: ignore[union-attr]
    base = _base(cmd, parser, tmp_path)
    flag = a.option_strings[0] if a.option_strings else None

    def with_value(v: str) -> list[str]:
        if flag is None:
            return [*base[: len(cmd.split())], v, *base[len(cmd.split()) + 1 :]]
        argv = list(base)
        if flag in argv:  # a required flag: given once, here
            del argv[argv.index(flag) : argv.index(flag) + 2]
        return [*argv, f"{flag}={v}"]  # '=': "-1e-09" is a value, not a flag

    for bad in _outside(r, integer):
        text = str(int(bad)) if integer else repr(bad)
        with pytest.raises(SystemExit) as e:
            parse_args(build_parser(), with_value(text))
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, (cmd, text, err)
        assert err.startswith(f"ulysses-mm {cmd}: {flag or action} must be"), err
        assert str(r) in err and text in err, err
    listed = a.type.check == "int_list"  # type: ignore[union-attr]
    for bound, is_open, at in ((r.low, r.low_open, 0), (r.high, r.high_open, -1)):
        if bound is None or is_open or abs(bound) >= 2**62:  # a closed bound is taken as it is
            continue
        text = str(int(bound)) if integer else repr(float(bound))
        if listed:  # two items, increasing, the bound first or last
            text = f"{int(bound)},{int(bound) + 1}" if at == 0 else f"{int(bound) - 1},{int(bound)}"
        got = getattr(parse_args(build_parser(), with_value(text)), a.dest)
        assert (got[at] if isinstance(got, list) else got) == bound, (cmd, text, got)


def test_options_read_back_into_the_dataclass(tmp_path):
    from ulysses_mm.cli.declare import read
    from ulysses_mm.tools.generate import GenerateOptions

    out = str(tmp_path / "x.fa")
    args = parse_args(
        build_parser(),
        ["generate", "run", "--modality", "dna", "--new-tokens", "7", "--out", out,
         "--top-p", "0.5", "--prompt-seconds", "2", "--with-prompt", "--dtype", "bf16"],
    )  # fmt: skip
    expected = GenerateOptions(
        "dna", 7, out, top_p=0.5, prompt_seconds=2.0, with_prompt=True, dtype="bf16"
    )
    assert read(GenerateOptions, args) == expected


def test_prompt_tokens_and_seconds_exclude_each_other(capsys):
    argv = ["generate", "run", "--modality", "dna", "--new-tokens", "4", "--out", "x.fa"]
    assert main([*argv, "--prompt-tokens", "2", "--prompt-seconds", "1"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


BEGIN = "<!-- options: written from the parsers by tests/unit/test_cli_declare.py -->"
END = "<!-- options: end -->"


def _name(a: argparse.Action) -> str:
    value = "/".join(map(str, a.choices)) if a.choices else a.metavar or a.dest.upper()
    if not a.option_strings:
        return f"{value} ..." if a.nargs in ("*", "+") else value
    return ", ".join(a.option_strings) + ("" if a.nargs == 0 else f" {value}")


def options_reference() -> str:
    """Every command's arguments as Markdown tables, from the parsers: what docs/cli.md
    holds between BEGIN and END."""
    out = [BEGIN]
    for cmd, p in _commands():
        out += ["", f"### `ulysses-mm {cmd}`", "", "| argument | |", "|---|---|"]
        for a in p._actions:
            if a.help == argparse.SUPPRESS or "--help" in a.option_strings:
                continue
            required = " (required)" if a.option_strings and a.required else ""
            text = (a.help or "").replace("%%", "%").replace("|", "\\|").replace("*", "\\*")
            text = text.replace("<", "&lt;")  # </doc> is text, 2**62 no emphasis
            out.append(f"| `{_name(a)}`{required} | {text} |")
    return "\n".join([*out, "", END])


def test_the_docs_list_every_argument_as_the_parsers_declare_it():
    """docs/cli.md's option tables are the parsers' (UPDATE_DOCS=1 rewrites them)."""
    docs = DOCS.read_text()
    start, end = docs.index(BEGIN), docs.index(END) + len(END)
    want = options_reference()
    if docs[start:end] != want and os.environ.get("UPDATE_DOCS") == "1":
        DOCS.write_text(docs[:start] + want + docs[end:])
        docs = DOCS.read_text()
    assert docs[start : start + len(want)] == want, "run UPDATE_DOCS=1 pytest -k docs_list"
    for flag in ("--seq-len", "--sp", "--edges", "--head-groups", "--codebook-size"):
        assert f"`{flag} " in want
