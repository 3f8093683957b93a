"""``hlo-shard fmt``: output places, and bad input as one located error, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hlo_shard.cli import main

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
CASE = GOLDEN / "control_flow.hlo"


def fmt(*args: str):
    return CliRunner().invoke(main, ["fmt", *args])


def test_writes_to_stdout_by_default_and_with_dash():
    expected = CASE.with_suffix(".expected").read_text()
    for args in ([str(CASE)], [str(CASE), "-o", "-"]):
        result = fmt(*args)
        assert result.exit_code == 0, result.output
        assert result.stdout == expected


def test_writes_the_output_file(tmp_path):
    out = tmp_path / "out.hlo"
    result = fmt(str(CASE), "-o", str(out))
    assert result.exit_code == 0 and result.stdout == ""
    assert out.read_text() == CASE.with_suffix(".expected").read_text()


def test_refuses_to_overwrite_its_input(tmp_path):
    copy = tmp_path / "in.hlo"
    copy.write_text(CASE.read_text())
    result = fmt(str(copy), "-o", str(copy))
    assert result.exit_code == 2 and "is an input; name another file" in result.stderr
    assert copy.read_text() == CASE.read_text()  # (fmt has no --in-place to suggest)


BAD_INPUTS = {
    "empty": (b"", 1, 1, "empty input"),
    "binary": (b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4, 1, 1, "not UTF-8"),
    "truncated": (CASE.read_bytes()[:300], None, None, "unexpected end of input"),
    "unknown_opcode": (b"HloModule m\nENTRY e {\n  p = f32[4] parameter(0)\n"
                       b"  ROOT n = f32[4] frobnicate(p)\n}\n", 4, 19, "unknown opcode"),
    "use_before_def": (b"HloModule m\nENTRY e {\n  p = f32[4] parameter(0)\n"
                       b"  ROOT n = f32[4] add(p, q)\n  q = f32[4] negate(p)\n}\n", 4, 26,
                       "used before its definition"),
    "duplicate_name": (b"HloModule m\nENTRY e {\n  p = f32[4] parameter(0)\n"
                       b"  p = f32[4] negate(p)\n}\n", 4, 3, "duplicate instruction name"),
    "two_entries": (b"HloModule m\nENTRY a {\n ROOT p = f32[] parameter(0)\n}\n"
                    b"ENTRY b {\n ROOT p = f32[] parameter(0)\n}\n", 5, 1, "second ENTRY"),
    "two_roots": (b"HloModule m\nENTRY e {\n ROOT p = f32[] parameter(0)\n"
                  b" ROOT q = f32[] negate(p)\n}\n", 4, 2, "second ROOT"),
    "no_computation": (b"HloModule m, replica_count=2\n", 1, 29, "unexpected end of input"),
    "byte_flip": (CASE.read_bytes().replace(b"while(init)", b"while(in\x01t)"), 39, 31,
                  "unexpected character"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_one_located_error(tmp_path, name):
    data, line, column, words = BAD_INPUTS[name]
    source = tmp_path / "IN.hlo"
    source.write_bytes(data)
    out = tmp_path / "OUT.hlo"
    result = fmt(str(source), "-o", str(out))
    assert result.exit_code == 2
    first, *rest = result.stderr.splitlines()
    where = f"{source}:{line}:{column}: error: " if line else f"{source}:"
    assert first.startswith(where), result.stderr
    assert words in first
    assert rest == [], "one line: path:line:col: error: message"
    assert not out.exists() and list(tmp_path.iterdir()) == [source]


def test_missing_input_file(tmp_path):
    result = fmt(str(tmp_path / "nope.hlo"))
    assert result.exit_code == 2 and "nope.hlo" in result.stderr


def test_real_process_exit_status_and_no_traceback(tmp_path):
    source = tmp_path / "bad.hlo"
    source.write_text("HloModule m\nENTRY e {\n  ROOT p = f32[4] parameter(0), x=\n}\n")
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "fmt", str(source)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith(f"{source}:4:1: error: ") and "Traceback" not in run.stderr


@pytest.mark.parametrize("args,words", [
    (["fmt", "{dir}"], "Invalid value for 'IN.hlo': File '{dir}' is a directory."),
    (["optimize", "{dir}/x.hlo", "--state", "bogus"], "Invalid value for '--state'"),
    (["verify"], "Missing argument 'ORIGINAL.hlo|DUMP_DIR'."),
    (["bogus"], "No such command 'bogus'."),
])
def test_usage_errors_are_one_line_too(tmp_path, args, words):
    """A usage error reads as every other error: one line, naming the command's --help
    (click's own is the usage, a hint and the error over four), exit 2."""
    fill = [arg.format(dir=tmp_path) for arg in args]
    result = CliRunner().invoke(main, fill)
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: " + words.format(dir=tmp_path)), line
    assert line.endswith("--help')"), line
