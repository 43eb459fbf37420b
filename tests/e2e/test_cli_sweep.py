"""Every command given hostile values ends with exit 0, or one stderr line and exit 2.

The table is read from the parsers (every leaf command's, its declared options added):
every option or positional whose ``type`` is a check of :mod:`ulysses_mm.core.checks` (or
a bare ``int`` / ``float``, which the sweep also refuses to find) gets hostile values — numbers: 0, -1, nan, inf, 10**30, ``abc``; paths:
a file where a directory is expected, a directory where a file is, a path under a file, a
read-only parent — and runs through the real CLI in-process with valid values for the
rest, built once per module (a tiny DNA dataset and a checkpoint trained one step). A new
option joins the table by construction.

Commands whose accepted values would start processes or need data that is slow to make
(verify, probe score, tokenizer fit video-vq, train, demo) are checked at parse time only
(``parse_args(build_parser(), argv)``): a value the parser accepts is not run there.
"""

from __future__ import annotations

import argparse
import itertools
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, require_fixture

from ulysses_mm.cli import build_parser, main, parse_args
from ulysses_mm.cli.declare import leaves

TINY = str(REPO / "configs" / "debug-tiny.yaml")
FASTA = REPO / "tests" / "data" / "human_mt.fa"
DNA_SPEC = str(REPO / "tokenizers" / "dna-base.json")

NUMBERS = ["0", "-1", "nan", "inf", str(10**30), "abc"]
LISTS = ["a,b", f"0,{10**30}", "-1,5", "5,2"]
NUMERIC = {"number", "integer", "int_list"}
PATHS = {"out_file", "out_dir", "in_file", "in_dir", "in_path"}
SHIPPED = {"run_config", "pipeline", "tokenizer_spec"}  # a file, or the name of one that ships
PARSE_ONLY = {"verify", "probe score", "tokenizer fit video-vq", "train", "demo"}
# (command, dest, value) whose documented answer is another: `tokenizer eval` reports an
# unreadable file among the others and exits 1
EXCEPTED = {("tokenizer eval", "files", "missing")}


def _kind(action: argparse.Action) -> str | None:
    if action.type in (int, float):
        return "bare"
    return getattr(action.type, "check", None)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Any]:
    """A tiny DNA dataset, a run trained one step on it, and hostile places."""
    require_fixture(FASTA.is_file(), "tests/data sample files")
    root = tmp_path_factory.mktemp("sweep")
    shards = root / "shards"
    prepare = [
        f"sources=[{FASTA}]", f"output={shards}", "pack.seq_len=256", "workers=1",
        "progress=false",
    ]  # fmt: skip
    assert main(["prepare", str(REPO / "pipelines" / "dna.yaml"), *prepare]) == 0
    run = root / "run"
    overrides = [
        f"data.train={shards / 'manifest.json'}", f"train.out_dir={run}", "train.steps=1",
        "train.checkpoint_every=1", "parallel.sp=1", "logging.wandb=disabled",
    ]  # fmt: skip
    assert main(["train", TINY, *overrides]) == 0
    a_file = root / "a_file"
    a_file.write_text("x")
    read_only = root / "read_only"
    read_only.mkdir()
    os.chmod(read_only, stat.S_IRUSR | stat.S_IXUSR)
    yield {"root": root, "shards": shards, "run": run, "file": a_file, "ro": read_only}
    os.chmod(read_only, stat.S_IRWXU)


_fresh = itertools.count()


def _base(cmd: str, w: dict[str, Any]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Valid positionals (dest -> words) and options of ``cmd``; outputs are fresh names."""
    out = w["root"] / "out" / f"{next(_fresh)}"
    run, manifest = str(w["run"]), str(w["shards"] / "manifest.json")
    step = str(w["run"] / "checkpoints" / "step_00000001")
    table: dict[str, tuple[dict[str, list[str]], dict[str, str]]] = {
        "demo": ({}, {"--out": str(out)}),
        "prepare": (
            {
                "pipeline": [str(REPO / "pipelines" / "dna.yaml")],
                "overrides": [f"sources=[{FASTA}]", f"output={out}", "pack.seq_len=256"],
            },
            {},
        ),
        "inspect": ({"target": [manifest]}, {}),
        "tokenizer fit video-vq": ({"sources": [str(FASTA)]}, {"--out": f"{out}.json"}),
        "tokenizer eval": ({"spec": [DNA_SPEC], "files": [str(FASTA)]}, {}),
        "train": ({"config": [TINY]}, {}),
        "export": ({"checkpoint": [step], "out": [str(out)]}, {}),
        "hf-tokenizer": ({"manifest": [manifest], "out": [str(out)]}, {}),
        "generate": (
            {"checkpoint": [run]},
            {"--modality": "dna", "--new-tokens": "4", "--out": f"{out}.fa"},
        ),
        "evaluate": ({"checkpoint": [run], "manifest": [manifest]}, {"--batches": "1"}),
        "probe write": (
            {"out": [str(out)]},
            {"--length": "8", "--documents": "4", "--eval-documents": "2"},
        ),
        "probe score": ({"checkpoint": [run], "manifest": [manifest]}, {}),
        "report": ({"run_dir": [run]}, {"--png": f"{out}.png"}),
        "verify": ({}, {"--sp": "1", "--seq-len": "64"}),
        "estimate": ({"config": [TINY]}, {"--seq-len": "256"}),
        "config": ({"config": [TINY]}, {}),
    }
    pos, opts = table[cmd]
    return dict(pos), dict(opts)


def _hostile(kind: str, w: dict[str, Any]) -> list[tuple[str, Path | None]]:
    """(value, a path that must not exist after a refusal, or None)."""
    f, ro = w["file"], w["ro"]
    if kind in ("number", "integer", "bare"):
        return [(v, None) for v in NUMBERS]
    if kind == "int_list":
        return [(v, None) for v in [*NUMBERS, *LISTS]]
    if kind == "out_file":
        return [(str(w["root"]), None), (str(f / "sub" / "x.png"), None), (str(ro / "x.png"), ro / "x.png")]  # fmt: skip
    if kind == "out_dir":
        return [(str(f), None), (str(f / "sub"), None), (str(ro / "new"), ro / "new")]
    missing = (str(w["root"] / "missing"), None)  # left to the command unless the type says
    if kind == "in_file":
        return [(str(w["root"]), None), missing]
    if kind in SHIPPED:
        return [(str(w["root"]), None), missing, ("no-such-name", None)]
    if kind == "in_dir":
        return [(str(f), None), missing]
    if kind == "in_path":
        return [("", None), missing]
    raise AssertionError(kind)


def _argv(cmd: str, parser: argparse.ArgumentParser, pos, opts) -> list[str]:
    argv = cmd.split()
    for action in parser._actions:
        if not action.option_strings and action.dest in pos:
            argv += pos[action.dest]
    for option, value in opts.items():
        argv += [option, value]
    return argv


def _run(cmd: str, argv: list[str], capsys) -> tuple[int, str]:
    try:
        if cmd in PARSE_ONLY:
            parse_args(build_parser(), argv)
            code = 0
        else:
            code = main(argv)  # a refused argument returns 2, as a UserError does
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    return code, capsys.readouterr().err


def _outputs(w: dict[str, Any]) -> set[str]:
    out = w["root"] / "out"
    return {str(p) for p in out.rglob("*")} if out.is_dir() else set()


def _assert_contract(argv: list[str], code: int, err: str) -> None:
    assert "Traceback" not in err, (argv, err)
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ulysses-mm"), (argv, err)


def test_every_checked_option_refuses_hostile_values_in_one_line(world, capsys):
    start = time.monotonic()
    cases = refused = 0
    options = 0
    for words, parser in leaves(build_parser()):
        cmd = " ".join(words)
        for action in parser._actions:
            kind = _kind(action)
            if kind is None:
                continue
            assert kind != "bare", f"{cmd} {action.dest}: a bare {action.type} type, use checks"
            options += 1
            for value, absent in _hostile(kind, world):
                if (cmd, action.dest, Path(value).name) in EXCEPTED:
                    continue
                pos, opts = _base(cmd, world)
                if action.option_strings:
                    opts[action.option_strings[0]] = value
                else:
                    pos[action.dest] = [value]
                argv = _argv(cmd, parser, pos, opts)
                before = _outputs(world)
                code, err = _run(cmd, argv, capsys)
                _assert_contract(argv, code, err)
                if code == 2:  # refused: nothing written, at the option's path or the base's
                    assert _outputs(world) == before, (argv, "wrote output though refused")
                    assert absent is None or not absent.exists(), (argv, "created what it refused")
                cases += 1
                refused += code == 2
    took = time.monotonic() - start
    print(
        f"\n{cases} cases (command × option × value) over {options} options: {refused} refused, {took:.1f} s"
    )
    assert options >= 80 and cases >= 350


def test_the_known_bad_cases_are_one_line(world, capsys):
    """The cases the issue named, each refused before any work (exit 2, one line)."""
    f, ro, root = str(world["file"]), str(world["ro"]), str(world["root"])
    run, manifest = str(world["run"]), str(world["shards"] / "manifest.json")
    gen = ["generate", run, "--modality", "dna"]
    gen_ok = [*gen, "--new-tokens", "4", "--out", f"{root}/g.fa"]
    est = ["estimate", TINY, "--seq-len", "256"]
    est_max = ["estimate", TINY, "--max"]
    ev = ["evaluate", run, manifest]
    probe = ["probe", "write", f"{root}/probe", "--documents", "4", "--eval-documents", "2"]
    dna = str(REPO / "pipelines" / "dna.yaml")
    inspect = ["inspect", manifest, "--storage-options"]
    cases = [
        *([*gen_ok, "--temperature", v] for v in ("nan", "inf", "-1")),
        [*gen_ok, "--top-k", "-1"],
        *([*gen, "--out", f"{root}/g.fa", "--new-tokens", v] for v in ("0", "-5", str(10**30))),
        *([*est, "--host-mem", v] for v in ("0", "nan", "inf", "-1")),
        *([*est, "--gpu-mem", v] for v in ("nan", "-5")),
        *([*est_max, "--gpu-mem", v] for v in ("nan", "-5")),
        [*est, "--headroom", "-2"],
        [*est, "--gpus-per-node", "0"],
        [*ev, "--edges", "a,b"],
        [*ev, "--edges", f"0,{10**30}"],
        *([*ev, "--png", p] for p in (root, f"{ro}/x.png", f"{f}/x.png")),
        *([*gen, "--new-tokens", "4", "--out", p] for p in (root, f"{ro}/x.fa", f"{f}/x.fa")),
        ["probe", "write", f, "--length", "8"],
        ["hf-tokenizer", manifest, f"{f}/tok"],
        *([*probe, "--length", v] for v in ("0", "-1", str(10**12))),
        *(["prepare", dna, f"sources=[{FASTA}]", f"output={p}"] for p in (f, f"{f}/x", f"{ro}/x")),
        *([*inspect, v] for v in ("{", "[1]", "abc")),
    ]
    for argv in cases:
        code, err = _run(argv[0], argv, capsys)
        _assert_contract(argv, code, err)
        assert code == 2, (argv, err)
    assert not (world["ro"] / "x").exists() and not (world["root"] / "probe").exists()


def test_help_still_prints_the_help(capsys):
    assert main(["generate", "--help"]) == 0
    assert "--temperature" in capsys.readouterr().out
