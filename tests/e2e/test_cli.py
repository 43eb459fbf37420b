"""The command line: ``section.key=value`` overrides are taken wherever they stand."""

from __future__ import annotations

import pytest
from conftest import REPO

from ulysses_mm.cli import build_parser, main, parse_args

TINY = str(REPO / "configs" / "debug-tiny.yaml")


def _parse(*argv: str):
    return parse_args(build_parser(), argv)


@pytest.mark.parametrize(
    "argv,field,value",
    [
        (["train", TINY, "--nproc", "2", "train.steps=1"], "config", TINY),
        (["train", TINY, "train.steps=1", "--nproc", "2"], "config", TINY),
        (["prepare", "pipelines/dna.yaml", "--print-config", "train.steps=1"], "pipeline", None),
        (["verify", "--sp", "2", "train.steps=1", "--dp", "1"], "sp", 2),
        (["estimate", TINY, "--gpus", "2", "train.steps=1", "--max"], "gpus", 2),
        (["config", TINY, "--keys", "train.steps=1"], "keys", True),
    ],
)
def test_overrides_after_options(argv, field, value):
    args = _parse(*argv)
    assert "train.steps=1" in args.overrides
    if value is not None:
        assert getattr(args, field) == value


def test_overrides_keep_their_order_around_options_and_local_rank():
    args = _parse(
        "train", TINY, "a.b=1", "--local_rank=0", "--nproc", "2", "a.b=2", "--resume", "c=x=y"
    )
    assert args.config == TINY and args.nproc == 2 and args.resume
    assert args.overrides == ["a.b=1", "a.b=2", "c=x=y"]


def test_words_that_are_not_overrides_are_still_rejected(capsys):
    for argv in (
        ["train", TINY, "--nproc", "2", "extra.yaml"],
        ["train", TINY, "--nproc", "2", "--bogus"],
        ["export", "ckpt", "out", "train.steps=1"],  # export takes no overrides
    ):
        with pytest.raises(SystemExit) as e:
            _parse(*argv)
        assert e.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_prepare_print_config_takes_overrides_after_the_flag(capsys):
    pipeline = str(REPO / "pipelines" / "dna.yaml")
    assert main(["prepare", pipeline, "--print-config", "pack.seq_len=64", "workers=3"]) == 0
    out = capsys.readouterr().out
    assert "seq_len: 64" in out and "workers: 3" in out


@pytest.mark.parametrize(
    "argv,says",
    [
        ([], "ulysses-mm: the following arguments are required: COMMAND"),
        (["bogus"], "ulysses-mm: COMMAND: invalid choice: 'bogus'"),
        (["train"], "ulysses-mm train: the following arguments are required: config"),
        (
            ["tokenizer", "fit", "video"],
            "ulysses-mm tokenizer fit video-vq: the following arguments are required: --out",
        ),
        (["train", TINY, "--bogus"], "ulysses-mm train: unrecognized arguments: --bogus"),
        (["estimate", TINY, "--headroom", "nan"], "ulysses-mm estimate: --headroom must be a"),
    ],
)
def test_a_parse_error_is_one_line_without_the_usage(argv, says, capsys):
    assert main(argv) == 2  # main returns the parsers' exit code
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "kind,says",
    [
        ("dna-base", "dna-base has nothing to fit; the kinds that can be fitted: video-vq (video)"),
        ("dna", "dna is no tokenizer kind; the kinds that can be fitted: video-vq (video)"),
    ],
)
def test_tokenizer_fit_goes_by_the_registry(kind, says, capsys):
    assert main(["tokenizer", "fit", kind, "x.mp4", "--out", "x.json"]) == 2
    assert capsys.readouterr().err == f"ulysses-mm tokenizer fit: {says}\n"
    # the video VQ kind's options are its own, and its modality names it too
    for name in ("video-vq", "video"):
        args = _parse("tokenizer", "fit", name, "a.mp4", "--out", "x.json", "--patch", "8")
        assert (args.kind, args.sources, args.patch, args.size) == (name, ["a.mp4"], 8, 256)


def test_the_old_head_chunks_flag_still_works_and_says_the_new_name(capsys):
    args = _parse("estimate", TINY, "--head-chunks", "2")
    assert args.head_groups == 2
    assert capsys.readouterr().err == "ulysses-mm estimate: --head-chunks is now --head-groups\n"
    assert _parse("estimate", TINY, "--head-groups", "auto").head_groups == "auto"


def test_the_top_line_names_every_modality(capsys):
    assert main(["--help"]) == 0
    assert "video, audio, DNA and text" in capsys.readouterr().out
