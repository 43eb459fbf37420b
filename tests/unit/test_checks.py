"""ulysses_mm.core.checks: one range type; every refusal names the bound; the argparse types
say the same."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from ulysses_mm.core import checks
from ulysses_mm.core.checks import CheckError
from ulysses_mm.core.errors import UserError


def test_a_refusal_is_a_user_error_and_a_value_error():
    assert issubclass(CheckError, UserError) and issubclass(CheckError, ValueError)


@pytest.mark.parametrize("value", ["0", "1.5", "1e3", " 2 "])
def test_number_takes_finite_values_in_range(value):
    assert checks.number(value, ge=0) == float(value)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "abc", ""])
def test_number_refuses_non_finite_and_out_of_range(value):
    with pytest.raises(CheckError, match=r"--t must be a finite number >= 0, got"):
        checks.number(value, "--t", ge=0)


def test_number_open_and_closed_bounds():
    assert checks.number("0.5", gt=0, lt=1) == 0.5
    for bad in ("0", "1"):
        with pytest.raises(CheckError, match=r"within \(0, 1\), got"):
            checks.number(bad, gt=0, lt=1)
    assert checks.number("1", gt=0, le=1) == 1.0


def test_integer_bounds_and_text():
    assert checks.integer("7", ge=1, le=10) == 7
    with pytest.raises(CheckError, match=r"^--n must be an integer within 1 .. 10, got 0$"):
        checks.integer("0", "--n", ge=1, le=10)
    with pytest.raises(CheckError, match=r"^--n must be an integer within 1 .. 10, got 11$"):
        checks.integer("11", "--n", ge=1, le=10)
    with pytest.raises(
        CheckError, match=r"within 0 .. 2\*\*62, got 1000000000000000000000000000000"
    ):
        checks.integer(str(10**30))
    for bad in ("1.5", "1e3", "abc", "nan"):
        with pytest.raises(CheckError, match="must be an integer"):
            checks.integer(bad)


def test_int_list():
    assert checks.int_list("2,1026,2050", increasing=True, min_items=2) == [2, 1026, 2050]
    for bad in ("a,b", "1,,2", "", f"0,{10**30}", "-1,5", "5,5", "5,2", "3"):
        with pytest.raises(CheckError, match=r"^--edges must be 2 or more integers"):
            checks.int_list(bad, "--edges", increasing=True, min_items=2)
    assert checks.int_list("5,2") == [5, 2]  # order asked for only when increasing


def test_out_file(tmp_path: Path):
    assert checks.out_file(str(tmp_path / "a.png")) == str(tmp_path / "a.png")
    assert checks.out_file(str(tmp_path / "new" / "deeper" / "a.png"))  # parents made later
    (tmp_path / "f").write_text("x")
    assert checks.out_file(str(tmp_path / "f"))  # overwritten
    with pytest.raises(CheckError, match="is a directory"):
        checks.out_file(str(tmp_path))
    with pytest.raises(CheckError, match="is a file, not a directory"):
        checks.out_file(str(tmp_path / "f" / "sub" / "a.png"))
    assert checks.out_file("s3://bucket/a.png")  # remote: the storage layer's
    with pytest.raises(CheckError):
        checks.out_file("")


def test_out_dir(tmp_path: Path):
    assert checks.out_dir(str(tmp_path))
    assert checks.out_dir(str(tmp_path / "new" / "deeper"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckError, match="is a file, expected a directory"):
        checks.out_dir(str(tmp_path / "f"))
    with pytest.raises(CheckError, match="is a file, not a directory"):
        checks.out_dir(str(tmp_path / "f" / "sub"))
    assert checks.out_dir("memory://x/y")


def test_a_read_only_parent_is_refused_even_for_root(tmp_path: Path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(CheckError, match="not writable"):
            checks.out_file(str(ro / "a.png"))
        with pytest.raises(CheckError, match="not writable"):
            checks.out_dir(str(ro / "x" / "y"))
        with pytest.raises(CheckError, match="not writable"):
            checks.out_dir(str(ro))
    finally:
        os.chmod(ro, stat.S_IRWXU)


def test_not_inside(tmp_path: Path):
    assert checks.not_inside(str(tmp_path / "out"), str(tmp_path / "in"))
    for out in (tmp_path / "in", tmp_path / "in" / "x"):
        with pytest.raises(CheckError, match="inside"):
            checks.not_inside(str(out), str(tmp_path / "in"), "OUT")
    with pytest.raises(CheckError):
        checks.not_inside("s3://b/in/x", "s3://b/in")


def test_inputs(tmp_path: Path):
    (tmp_path / "f").write_text("x")
    assert checks.in_file(str(tmp_path / "f")) and checks.in_dir(str(tmp_path))
    assert checks.in_path(str(tmp_path)) and checks.in_path(str(tmp_path / "f"))
    with pytest.raises(CheckError, match="is a directory, expected a file"):
        checks.in_file(str(tmp_path))
    with pytest.raises(CheckError, match="is a file, expected a directory"):
        checks.in_dir(str(tmp_path / "f"))
    with pytest.raises(CheckError, match="no such file"):
        checks.in_path(str(tmp_path / "missing"))
    assert checks.in_dir(str(tmp_path / "missing"), exist=False)
    assert checks.in_file("s3://b/x.yaml")


def test_argparse_types_are_marked_and_raise_argument_type_errors(tmp_path: Path):
    cases = [
        (checks.arg_type("number", lambda v: checks.number(v, ge=0), ">= 0"), "number", "nan"),
        (checks.arg_type("integer", lambda v: checks.integer(v, ge=1, le=10)), "integer", "11"),
        (checks.arg_type("int_list", lambda v: checks.int_list(v, increasing=True)), "int_list", "2,1"),
        *((checks.arg_type(k, fn), k, bad) for k, fn, bad in [
            ("out_file", checks.out_file, str(tmp_path)),
            ("out_dir", checks.out_dir, __file__),
            ("in_file", checks.in_file, str(tmp_path)),
            ("in_dir", checks.in_dir, __file__),
            ("in_path", checks.in_path, ""),
        ]),
    ]  # fmt: skip
    for parse, kind, bad in cases:
        assert getattr(parse, "check", None) == kind and kind in {
            "number",
            "integer",
            "int_list",
            *checks.PATHS,
        }
        assert isinstance(getattr(parse, "bounds", None), str)
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_a_parser_prints_the_bound_in_one_line(capsys):
    from ulysses_mm.cli.declare import Parser

    p = Parser(prog="ulysses-mm x")
    p.add_argument("--t", type=checks.arg_type("number", lambda v: checks.number(v, ge=0)))
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--t", "inf"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "ulysses-mm x: --t must be a finite number >= 0, got inf\n"


def test_one_range_type_for_the_config_and_the_command_line():
    from ulysses_mm.config import parse

    assert parse.Range is checks.Range
    r = checks.Range.of(gt=0, le=1)
    assert str(r) == "(0, 1]" and r.contains(1) and not r.contains(0)
    assert not r.contains(float("nan"))
    assert r.refusal("--top-p", 2) == "--top-p must be within (0, 1], got 2"
    with pytest.raises(parse.ConfigError, match=r"^x.y must be within \(0, 1\], got 0$"):
        r.check("x.y", 0)
    with pytest.raises(CheckError):
        r.check("--y", 0, CheckError)
    assert checks.Range.of() is None and str(checks.Range.of(ge=0)) == ">= 0"


@pytest.mark.parametrize(
    "bound,text",
    [(2**63 - 1, "2**63 - 1"), (2**32 - 1, "2**32 - 1"), (1 << 24, "2**24"), (float(1 << 20), "2**20"),
     (10**9, "10**9"), (1e6, "1e+06"), (65536, "65536"), (0.5, "0.5")],
)  # fmt: skip
def test_bounds_are_written_as_people_write_them(bound, text):
    assert str(checks.Range.of(le=bound)) == f"<= {text}"
