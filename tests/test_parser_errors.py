"""Bad input: every failure is an HloParseError at the right line and column, in words."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from hlo_shard import HloParseError, parse

GOLDEN = Path(__file__).parent / "golden"

OK_HEAD = "HloModule m\nENTRY e {\n  p = f32[4] parameter(0)\n"


@pytest.mark.parametrize("text, line, column, words", [
    ("", 1, 1, "empty input"),
    # a known element type whose dimensions do not read: said so, not "unknown type"
    ("HloModule m\nENTRY e {\n  ROOT p = f32[4,1x16] parameter(0)\n}\n", 3, 16,
     "bad dimensions '4,1x16' in a f32[...] shape"),
    ("  \n// just a comment\n", 1, 1, "empty input"),
    ("\x00\x01\x02\xff", 1, 1, "unexpected character '\\x00'"),
    ("HloModule m\n", 1, 12, "unexpected end of input"),
    ("HloModule m\nENTRY e {\n}\n", 3, 1, "unexpected character '}'"),
    (OK_HEAD + "  ROOT n = f32[4] foo(p)\n}\n", 4, 19, "unknown opcode 'foo'"),
    (OK_HEAD + "  ROOT n = f32[4] add(p, q)\n  q = f32[4] negate(p)\n}\n", 4, 26,
     "'q' is used before its definition at line 5"),
    (OK_HEAD + "  ROOT n = f32[4] add(p, zz)\n}\n", 4, 26, "undefined instruction 'zz'"),
    # Deep in a run of common-form lines (one token): the position is its own line's.
    (OK_HEAD + "  a = f32[4] negate(p), metadata={op_name=\"x\"}\n  b = f32[4] abs(a)\n"
     "    ROOT c = f32[4] add(b, zz)\n}\n", 6, 28, "undefined instruction 'zz'"),
    (OK_HEAD + "  ROOT n = f32[4] add(f32[4] p, zz)\n}\n", 4, 33, "undefined instruction 'zz'"),
    (OK_HEAD + "  p = f32[4] negate(p)\n}\n", 4, 3, "duplicate instruction name 'p'"),
    (OK_HEAD + "  ROOT a = f32[4] negate(p)\n  ROOT b = f32[4] abs(p)\n}\n", 5, 3,
     "second ROOT"),
    ("HloModule m\nENTRY a {\n ROOT p = f32[] parameter(0)\n}\n"
     "ENTRY b {\n ROOT p = f32[] parameter(0)\n}\n", 5, 1, "second ENTRY"),
    (OK_HEAD + "  ROOT c = f32[4] call(p), to_apply=nothere\n}\n", 4, 37,
     "unknown computation 'nothere'"),
    (OK_HEAD + "  ROOT c = f32[4] call(p), to_apply=later\n}\n"
     "later {\n ROOT a = f32[4] parameter(0)\n}\n", 4, 37,
     "computation 'later' is used before it is defined"),
    (OK_HEAD + "  ROOT n = f32[4] add(p)\n}\n", 4, 19, "'add' takes 2 operands, got 1"),
    (OK_HEAD + "  ROOT n = f32[4] select(p, p)\n}\n", 4, 19, "'select' takes 3 operands"),
    (OK_HEAD + "  ROOT n = f32[4] transpose(p), dimensions = {0}\n}\n", 4, 33,
     "no space before '='"),
    ("HloModule m\nENTRY e {\n  p=f32[4] parameter(0)\n}\n", 3, 3, "put a space before '='"),
    ("HloModule m\nENTRY e {\n  ROOT c = f32[3] constant({1, 2})\n}\n", 3, 28,
     "constant has 2 values but its shape f32[3] holds 3"),
    ("HloModule m\nENTRY e {\n  ROOT c = f32[] constant({1, 2})\n}\n", 3, 27,
     "constant has 2 values"),
    ("HloModule m\nENTRY e {\n  ROOT c = f32[3,2]{0} parameter(0)\n}\n", 3, 12,
     "not a permutation of 2 dimensions"),
    ("HloModule m\nENTRY e {\n  ROOT c = f33[3] parameter(0)\n}\n", 3, 12, "unknown element type 'f33'"),
    ("HloModule m\nENTRY e {\n  ROOT c = f32[9223372036854775807,9223372036854775807] "
     "parameter(0)\n}\n", 3, 12, "its element count overflows int64"),
    ("HloModule m\nENTRY e {\n  ROOT c = f32[2305843009213693952] parameter(0)\n}\n", 3, 12,
     "its size in bytes overflows int64"),
    ("HloModule m /* open\nENTRY e {\n}\n", 1, 13, "unterminated /* comment"),
    (OK_HEAD + '  ROOT n = f32[4] negate(p), metadata={op_name="x}\n}\n', 4, 39,
     "'{' has no matching '}'"),
    (OK_HEAD + "  ROOT n = f32[4] negate(p), metadata=" + "{" * 40 + "}" * 40 + "\n}\n",
     4, 39, "nesting deeper than 12 levels"),
    ("HloModule m\nENTRY e {\n  ROOT c = " + "(" * 100 + "f32[]" + ")" * 100
     + " parameter(0)\n}\n", 3, 47, "tuple shape nests deeper than 64 levels"),
    ("HloModule m\nENTRY e {\n  %c128 = f32[] parameter(0)\n}\n", 3, 3, "type name"),
    (OK_HEAD + "  ROOT n = f32[4] negate(f32[5] p)\n}\n", 4, 33,
     "operand 'p' is declared f32[5] but defined as f32[4]"),
    ("HloModule m\nENTRY e (p: f32[4]) -> f32[9] {\n  p = f32[4] parameter(0)\n"
     "  ROOT n = f32[4] negate(p)\n}\n", 2, 7, "signature declares"),
    (OK_HEAD + "  ROOT n = f32[4] transpose(p), dimensions={a}\n}\n", 4, 44,
     "expected a list of integers"),
    (OK_HEAD + "  ROOT n = f32[4] transpose(p), dimensions={0}, dimensions={0}\n}\n", 4, 49,
     "duplicate attribute 'dimensions'"),
    (OK_HEAD + "  ROOT n = f32[4] slice(p), slice={[0:2], x}\n}\n", 4, 35,
     "expected slice ranges"),
    (OK_HEAD + "  ROOT n = f32[4] all-reduce(p), replica_groups=[3,3]<=[8], to_apply=a\n}\n",
     4, 49, "bad replica_groups"),
    ("HloModule m\nENTRY e {\n  p = f32[4] parameter(0)\n  q = f32[4] parameter(0)\n}\n",
     4, 24, "parameter(0) is already defined at line 3"),
    (OK_HEAD + "  ROOT n = f32[4] negate(p), control-predecessors={later}\n}\n", 4, 51,
     "control predecessor 'later' is not defined"),
    ("HloModule m, replica_count=two\nENTRY e {\n ROOT p = f32[] parameter(0)\n}\n", 1, 28,
     "'replica_count' expects a positive integer"),
    (OK_HEAD + "  ROOT n = f32[4] negate(p)\n}, color=\"red\"\n", 5, 4,
     "only execution_thread"),
    (OK_HEAD + "  ROOT c = f32[4] tuple(p),,\n}\n", 4, 28, "expected"),
    # Attribute names each opcode takes, and OpMetadata's fields (XLA's words).
    (OK_HEAD + "  ROOT n = f32[4] negate(p), t0_apply=x\n}\n", 4, 30,
     'unexpected attribute "t0_apply". Allowed attributes: backend_config,'),
    (OK_HEAD + "  ROOT n = f32[4] negate(p) /* c */, sharding={replicated}, zzz=1\n}\n", 4, 61,
     'unexpected attribute "zzz"'),
    (OK_HEAD + '  ROOT n = f32[4] negate(p), metadata={op_dame="x"}\n}\n', 4, 40,
     'unexpected attribute "op_dame". Allowed attributes: deduplicated_name,'),
    (OK_HEAD + '  ROOT n = f32[4] negate(p), metadata={op_na\x1ae="x"}\n}\n', 4, 40,
     "expects attribute name"),
    (OK_HEAD + '  ROOT n = f32[4] negate(p), metadata={op_name="a" op_name="b"}\n}\n', 4, 52,
     "attribute op_name already exists"),
    (OK_HEAD + '  ROOT n = f32[4] negate(p), metadata={source_line="3"}\n}\n', 4, 52,
     "expects integer"),
    (OK_HEAD + '  ROOT n = f32[4] negate(p), metadata="x"\n}\n', 4, 39,
     "expects '{' to start sub attributes"),
    # Literal values against the element type, nesting against the rank.
    ("HloModule m\nENTRY e {\n  ROOT c = s8[] constant(300)\n}\n", 3, 26,
     "value 300 is out of range for literal's primitive type s8 namely [-128, 127]"),
    ("HloModule m\nENTRY e {\n  ROOT c = f16[2] constant({1, 70000})\n}\n", 3, 32,
     "value 70000 is out of range for literal's primitive type f16"),
    ("HloModule m\nENTRY e {\n  ROOT c = f32[2] constant({1, 1e400})\n}\n", 3, 32,
     "1e400 is out of range for double"),
    ("HloModule m\nENTRY e {\n  ROOT c = s32[] constant(true)\n}\n", 3, 27,
     "expects integer, found 'true'"),
    ("HloModule m\nENTRY e {\n  ROOT c = f16[] constant(nan(0x400))\n}\n", 3, 27,
     "NaN payload 0x400 is out of range for f16"),
    ("HloModule m\nENTRY e {\n  ROOT c = f32[2,2] constant({{1, 2, 3}, {4}})\n}\n", 3, 39,
     "expects 2 elements in dimension 1, but sees 3"),
    ("HloModule m\nENTRY e {\n  ROOT c = f32[1] constant({{1}})\n}\n", 3, 29,
     "expects nested array in rank 1, but sees larger"),
    ("HloModule m\nENTRY e {\n  ROOT c = f32[2,2] constant({1, 2, 3, 4})\n}\n", 3, 31,
     "expects nested array in rank 2, but sees 1"),
    ("HloModule m\nENTRY e {\n  ROOT c = f32[] constant(...)\n}\n", 3, 27,
     "expects `...` at nest level 1"),
    # Inside an inline computation, positions are still those of the whole text.
    (OK_HEAD + "  z = f32[] constant(0)\n  ROOT s = f32[] reduce(p, z), dimensions={0}, "
     "to_apply={ a = f32[] parameter(0) ROOT m = f32[] maximum(a, c) }\n}\n", 5, 108,
     "undefined instruction 'c'"),
    (OK_HEAD + "  z = f32[] constant(0)\n  ROOT s = f32[] reduce(p, z), dimensions={0}, "
     "to_apply={ a = f32[] parameter(0) ROOT m = f32[] maximum(a, \x01) }\n}\n", 5, 108,
     "unexpected character '\\x01'"),
    # A module cut off before its ENTRY: its last computation read as the entry does
    # not take what the header declares (XLA's parser refuses it too).
    ("HloModule m, entry_computation_layout={(f32[4]{0}, f32[4]{0})->f32[4]{0}}\n"
     "add {\n  a = f32[] parameter(0)\n  b = f32[] parameter(1)\n  ROOT s = f32[] add(a, b)\n}\n",
     1, 14, "declares parameter 0 f32[4]{0}, the entry computation %add takes f32[] (a "
     "module cut off before its ENTRY?)"),
    ("HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}\n"
     "ENTRY e {\n  ROOT p = f32[4] parameter(0)\n  q = f32[4] parameter(1)\n}\n", 1, 14,
     "declares 1 parameters, the entry computation %e takes 2"),
    ("HloModule m, entry_computation_layout={(f32[4]{0})->f32[2]{0}}\n"
     "ENTRY e {\n  ROOT p = f32[4] parameter(0)\n}\n", 1, 14,
     "declares the result f32[2]{0}, the entry computation %e returns f32[4]"),
    # A computation's parameter list XLA's parser refuses (XLA test corpus probe): it
    # was taken, unread, and the header written anew.
    ("HloModule m\nENTRY %e (x: f32[4 ]]]]] ) -> f32[4] {\n  x = f32[4] parameter(0)\n"
     "  ROOT n = f32[4] negate(x)\n}\n", 2, 10, "bad shape '( f32[4 ]]]]] )'"),
    ("HloModule m\nENTRY %e (x: f32[4\x00,3]) -> f32[4] {\n  x = f32[4] parameter(0)\n"
     "  ROOT n = f32[4] negate(x)\n}\n", 2, 10,
     "bad shape 'f32[4\\x00,3]': dimension '4\\x00' is not a size"),
    ("HloModule m\nENTRY %e (x f32[4]) -> f32[4] {\n  x = f32[4] parameter(0)\n"
     "  ROOT n = f32[4] negate(x)\n}\n", 2, 10, "bad shape '(x f32[4])'"),
])
def test_error_position_and_words(text, line, column, words):
    with pytest.raises(HloParseError) as info:
        parse(text, "in.hlo")
    err = info.value
    assert (err.line, err.column) == (line, column), str(err)
    assert words in err.message, err.message
    assert str(err).startswith(f"in.hlo:{line}:{column}: error: ")
    assert "\n" not in str(err)


@pytest.mark.parametrize("name", ["control_flow", "attributes", "header_and_stack_frames"])
def test_every_truncation_is_a_located_error(name):
    text = (GOLDEN / f"{name}.hlo").read_text()
    rng = random.Random(name)
    for cut in sorted(rng.sample(range(1, len(text) - 3), 40)):
        try:
            parse(text[:cut], "cut.hlo")
        except HloParseError as err:
            assert 1 <= err.line <= text[:cut].count("\n") + 1
            assert err.column >= 1
            # in words: no grammar terminal's name (``name_eq``) among what was expected
            expected = err.message.partition("expected ")[2]
            assert not re.search(r"\b[a-z]+_[a-z_]+\b", expected), err.message


@pytest.mark.parametrize("seed", range(4))
def test_random_byte_flips_never_crash(seed):
    data = bytearray((GOLDEN / "attributes.hlo").read_bytes())
    rng = random.Random(seed)
    for _ in range(30):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        text = mutated.decode("utf-8", errors="replace")
        try:
            parse(text, "flip.hlo")
        except HloParseError as err:
            assert err.line >= 1 and err.column >= 1 and err.message


def test_deeply_nested_operands_are_fine_and_deep_braces_are_an_error():
    depth = 3000
    text = (OK_HEAD.replace("f32[4]", "f32[]") + "  ROOT c = f32[] " + "negate(" * depth
            + "p" + ")" * depth + "\n}\n")
    assert len(parse(text).entry.instructions) == depth + 1
    with pytest.raises(HloParseError):
        parse("HloModule m\nENTRY e {\n  ROOT c = f32[] parameter(0), metadata="
              + "{" * 100000 + "\n}\n")


@pytest.mark.parametrize("shape", [
    "f32[2305843009213693951]",  # 2^63 - 4 bytes
    "f32[0,9223372036854775807,9223372036854775807]",  # the product stays 0, as in XLA
    "s4[9223372036854775807]", "f32[?,2305843009213693951]",
])
def test_shapes_xla_compiles_at_the_int64_edge_parse(shape):
    """XLA's ValidateShapeSize (checked: jaxlib 0.10.2 compiles a parameter of each)."""
    parse(f"HloModule m\nENTRY e {{\n  ROOT c = {shape} parameter(0)\n}}\n")


def test_cli_refuses_a_shape_whose_byte_size_overflows(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "huge.hlo"
    path.write_text("HloModule m\nENTRY e {\n  ROOT p = f32[9223372036854775807,"
                    "9223372036854775807] parameter(0)\n}\n")
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "report", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith(f"{path}:3:12: error: ")
    assert "overflows int64" in run.stderr.splitlines()[0]


@pytest.mark.parametrize("text, line, column", [
    ("module @jit_step attributes {mhlo.num_partitions = 8 : i32} {\n  func.func public "
     "@main() {\n    return\n  }\n}\n", 1, 1),
    ("#loc = loc(unknown)\n  module {\n}\n", 2, 3),
])
def test_mlir_text_is_named_as_such(text, line, column):
    """StableHLO (jax's ``lowered.as_text()``) was "unexpected character '@'; expected
    '(', '{' or a signature"."""
    with pytest.raises(HloParseError) as info:
        parse(text, "step.mlir")
    assert (info.value.line, info.value.column) == (line, column)
    assert "this is MLIR (StableHLO" in info.value.message and "per_device_hlo" in \
        info.value.message
