"""The front end on the forms XLA's own test modules use, and on what XLA refuses.

The accepted forms are golden cases (``tests/golden/xla_*.hlo``: parse → print checked
by ``test_printer``, and against XLA's parser by ``test_roundtrip``). Here: each form
XLA refuses (or aborts on) is refused at its place, with XLA's verdict checked in a
child process; the few refusals of ours XLA's parser lets through are listed as such.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hlo_shard import HloParseError, parse
from test_fuzz_xla import xla_parse

ROOT = Path(__file__).resolve().parents[1]


def _module(body: str, header: str = "HloModule m") -> str:
    return f"{header}\nENTRY e {{\n{body}\n}}\n"


_COND_HEAD = ("HloModule m\nt {\n  ROOT x = f32[] parameter(0)\n}\nENTRY e {\n"
              "  s = f32[] parameter(1)\n")

#: (text, line, column, words in our message, XLA's verdict: "error", "abort" or "ok").
REFUSALS = [
    pytest.param(_module("  ROOT p = f32[99999999999999999999] parameter(0)"), 3, 12,
                 "dimension 99999999999999999999 is beyond int64", "error", id="dim-int64"),
    pytest.param(_module("  ROOT p = f32[2,<=9223372036854775808] parameter(0)"), 3, 12,
                 "beyond int64", "ok", id="bounded-dim-int64"),
    pytest.param(_module("  ROOT p = f32[] parameter(7)"), 3, 28,
                 "invalid parameter number: 'e' has 1 parameter, numbered [0, 1), got 7",
                 "abort", id="parameter-number"),
    pytest.param(_module("  p = f32[] parameter(2)\n  ROOT q = f32[] parameter(0)"), 3, 23,
                 "has 2 parameters, numbered [0, 2), got 2", "abort", id="parameter-gap"),
    pytest.param(_module("  ROOT p = f32[] parameter(0)", "HloModule m, replica_count=-3"),
                 1, 28, "'replica_count' expects a positive integer", "ok",
                 id="replica-count-negative"),
    pytest.param(_module("  ROOT p = f32[] parameter(0)",
                         "HloModule m, num_partitions=99999999999999999999"), 1, 29,
                 "'num_partitions' expects a positive integer (at most 2^63-1)", "error",
                 id="num-partitions-int64"),
    pytest.param(_module("  ROOT p = f32[] parameter(0)", "HloModule m, foo=3"), 1, 14,
                 'unexpected attribute "foo". Allowed attributes: alias_passthrough_params',
                 "error", id="unknown-header-attribute"),
    pytest.param(_module("  ROOT p = f32[] parameter(0)",
                         "HloModule m, replica_count=1, replica_count=2"), 1, 31,
                 "attribute replica_count already exists", "error", id="header-duplicate"),
    pytest.param(_module("  ROOT p = f32[] parameter(0)", "HloModule %m:"), 1, 11,
                 "expects name", "error", id="header-percent-colon"),
    pytest.param(_COND_HEAD + "  pr = pred[] parameter(0)\n  ROOT c = f32[] conditional(pr, s),"
                 " true_computation=t, false_computation=t, branch_computations={t}\n}\n",
                 8, 79, 'unexpected attribute "branch_computations"', "error",
                 id="conditional-pred-with-branches"),
    pytest.param(_COND_HEAD + "  i = s32[] parameter(0)\n  ROOT c = f32[] conditional(i, s),"
                 " true_computation=t, false_computation=t\n}\n",
                 8, 37, 'unexpected attribute "true_computation"', "error",
                 id="conditional-index-with-true"),
    pytest.param(_COND_HEAD + "  pr = pred[] parameter(0)\n  ROOT c = f32[] conditional(pr, s),"
                 " true_computation=t\n}\n", 8, 18,
                 "attribute false_computation is expected but not seen", "error",
                 id="conditional-missing-false"),
    pytest.param(_module("  ROOT c = f32[0]{0} constant(1)"), 3, 31,
                 "constant has 1 value but its shape f32[0] holds 0", "error",
                 id="scalar-for-empty-array"),
    pytest.param(_module('  ROOT c = s32[2]{0} custom-call(), custom_call_target="f", '
                         "literal=s32[2]{0} {1, 2, 3}"), 3, 79,
                 "constant has 3 values but its shape s32[2] holds 2", "error",
                 id="custom-call-literal-count"),
    pytest.param(_module('  ROOT c = s32[2]{0} custom-call(), custom_call_target="f", '
                         "literal=s32[2] {1, 2}"), 3, 69, "not a permutation", "error",
                 id="custom-call-literal-as-layout"),
    pytest.param(_module('  ROOT c = (s32[]) custom-call(), custom_call_target="f", '
                         "literal=( s32[] 1.5 )"), 3, 75, "expects integer, found '1.5'",
                 "error", id="custom-call-tuple-literal-value"),
    pytest.param(_module('  ROOT c = (s32[]) custom-call(), custom_call_target="f", '
                         "literal=(s32[] 1, (7))"), 3, 78, "expects a shape and its literal",
                 "error", id="custom-call-tuple-literal-no-shape"),
    pytest.param(_module("  p = f32[3]{0} parameter(0)\n  ROOT o = token[] outfeed(p, "
                         "after-all()), outfeed_shape=(f32[3]{0}, x)"), 4, 59, "bad shape",
                 "error", id="outfeed-shape-tuple"),
    pytest.param(_module("  ROOT q= f32[2] parameter(0)"), 3, 8, "put a space before '='",
                 "error", id="bare-name-equals"),
]


@pytest.mark.parametrize("text, line, column, words, xla", REFUSALS)
def test_refused_at_its_place(text, line, column, words, xla):
    with pytest.raises(HloParseError) as caught:
        parse(text)
    err = caught.value
    assert words in err.message
    assert (err.line, err.column) == (line, column), err.message
    assert "\n" not in err.message


def test_xla_verdicts_on_the_refusals():
    """XLA's parser refuses or aborts on each, but for the ones listed as accepted: a
    negative replica count (XLA's parser takes it, no XLA runtime does) and a bound
    of 2^63 (XLA's lexer reads it as a uint64, wraps it to a negative int64 and makes
    the dimension unbounded, ``?``)."""
    cases = [(case.id, case.values[0], case.values[4]) for case in REFUSALS]
    parsed = [c for c in cases if c[2] != "abort"]  # in one child process
    aborting = [c for c in cases if c[2] == "abort"]  # a child each: an abort ends it
    verdicts = xla_parse([text for _, text, _ in parsed]) + [
        verdict for _, text, _ in aborting for verdict in xla_parse([text])]
    got = {name: verdict.status for (name, _, _), verdict in zip(parsed + aborting, verdicts)}
    assert got == {name: status for name, _, status in cases}


# ---------------------------------------------------------------------- peer round trip

SCRIPT = ROOT / "scripts" / "peer_roundtrip.py"


def test_peer_roundtrip_counts_a_folder(tmp_path):
    """Identical, refused by us, and refused by XLA, each counted; a subfolder is read."""
    golden = ROOT / "tests" / "golden"
    (tmp_path / "sub").mkdir()
    for name in ("xla_inferred_shapes.hlo", "xla_name_equals.hlo"):
        (tmp_path / "sub" / name).write_text((golden / name).read_text())
    (tmp_path / "ours_refuses.hlo").write_text(
        _module("  ROOT p = f32[] parameter(0)", "HloModule m, replica_count=-3"))
    (tmp_path / "xla_refuses.hlo").write_text(_module("  ROOT p = f32[] frobnicate()"))
    (tmp_path / "xla_aborts.hlo").write_text(_module("  ROOT p = f32[] parameter(7)"))
    (tmp_path / "notes.txt").write_text("not HLO")
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--jobs", "2",
                          "--timeout", "120", "--verbose"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 1, run.stderr
    last = run.stdout.strip().splitlines()[-1]
    assert last == "2/3 identical (1 errors, 0 differ, 2 not accepted by XLA)", run.stdout
    assert "ours_refuses.hlo: error:" in run.stdout


def test_peer_roundtrip_refuses_a_missing_folder(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nothere")],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr


@pytest.mark.parametrize("attribute, words", [
    ("alias_passthrough_params=3", "expects true or false"),
    ("allow_spmd_sharding_propagation_to_output=3", "expects true, false or {true,false,...}"),
    ("entry_computation_layout=3", "expects a '{...}' value"),
    ("input_output_alias=3", "expects '{ {output}: (parameter, {index}, may-alias|must-alias)"),
    ("buffer_donor=3", "expects '{ (parameter, {index}), ... }'"),
    ("frontend_attributes=3", "expects a '{...}' value"),
    ("origin_recovery_table=3", "expects a '{...}' value"),
    ("is_scheduled=1", "expects true or false"),
    ("replica_count=true", "expects a positive integer"),
])
def test_header_values_of_the_wrong_kind_are_refused(attribute, words):
    """XLA refuses each of these too (checked by hand with jaxlib 0.10.2: 'expects true or
    false', "Expects '{' at the start of aliasing description", ...)."""
    with pytest.raises(HloParseError) as caught:
        parse(_module("  ROOT p = f32[] parameter(0)", f"HloModule m, {attribute}"))
    assert words in caught.value.message and caught.value.column == 15 + attribute.index("=")


def test_header_values_of_the_right_kind_are_kept():
    header = parse(_module(
        "  ROOT p = f32[] parameter(0)",
        "HloModule m, alias_passthrough_params=true, is_scheduled=false, replica_count=2, "
        "allow_spmd_sharding_propagation_to_output={true,false}, input_output_alias={}")).header
    assert header["alias_passthrough_params"] is True and header["is_scheduled"] is False
    assert header["replica_count"] == 2
    assert str(header["allow_spmd_sharding_propagation_to_output"].text) == "{true,false}"
