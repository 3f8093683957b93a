"""XLA's compact get-tuple-element operands, ``%t#1#0``: the form XLA's dumps take since
``xla_dump_compact_gte`` (jaxlib 0.11's default), where a get-tuple-element prints as a
suffix of its tuple at each use instead of a line of its own. hlo-shard reads it as XLA's
parser does (one get-tuple-element per element and computation, made before its first
user) and prints the long form, which every XLA parses."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from hlo_shard import HloParseError, parse, runtime
from hlo_shard.ir import Module
from hlo_shard.printer import to_text
from test_fuzz_xla import xla_parse

ROOT = Path(__file__).resolve().parents[1]

COMPACT = """HloModule compact

ENTRY %main (a: f32[4], b: f32[2]) -> (f32[4], f32[2], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[2]{0} parameter(1)
  %t = (f32[4]{0}, (f32[2]{0}, f32[4]{0})) tuple(%a, (f32[2]{0}, f32[4]{0}) tuple(%b, %a))
  %t_0 = f32[4]{0} abs(%a)
  %n = f32[4]{0} negate(%t#1#1), metadata={op_name="x"}
  %s = f32[4]{0} add(%n, f32[4]{0} %t#0)
  %m = f32[2]{0} multiply(%t#1#0, %t#1#0)
  ROOT %r = (f32[4]{0}, f32[2]{0}, f32[4]{0}) tuple(%s, %m, %t_0)
}
"""

LONG = """HloModule compact

ENTRY %main (a: f32[4]{0}, b: f32[2]{0}) -> (f32[4]{0}, f32[2]{0}, f32[4]{0}) {
  %a = f32[4]{0} parameter(0)
  %b = f32[2]{0} parameter(1)
  %tuple.anon = (f32[2]{0}, f32[4]{0}) tuple(%b, %a)
  %t = (f32[4]{0}, (f32[2]{0}, f32[4]{0})) tuple(%a, %tuple.anon)
  %t_0 = f32[4]{0} abs(%a)
  %t_1 = (f32[2]{0}, f32[4]{0}) get-tuple-element(%t), index=1
  %t_1_1 = f32[4]{0} get-tuple-element(%t_1), index=1
  %n = f32[4]{0} negate(%t_1_1), metadata={op_name="x"}
  %t_0.1 = f32[4]{0} get-tuple-element(%t), index=0
  %s = f32[4]{0} add(%n, %t_0.1)
  %t_1_0 = f32[2]{0} get-tuple-element(%t_1), index=0
  %m = f32[2]{0} multiply(%t_1_0, %t_1_0)
  ROOT %r = (f32[4]{0}, f32[2]{0}, f32[4]{0}) tuple(%s, %m, %t_0)
}
"""


def test_compact_operands_read_as_xla_makes_them_and_print_in_the_long_form():
    """One get-tuple-element per element (``%t#1#0`` used twice is one), before its first
    user, named ``t_1_0`` and made unique against every name in the computation, also
    one defined after it (``t_0`` here is an instruction of the text)."""
    text = to_text(parse(COMPACT))
    assert text.split("\n", 2)[2] == LONG.split("\n", 2)[2]


def test_the_long_form_computes_what_the_compact_one_means():
    """Run on XLA (whose jaxlib here cannot read the compact form itself): r = (-a + a,
    b * b, |a|)."""
    runtime.shutdown_workers()
    a = np.array([1.5, -2.0, 3.0, -4.25], np.float32)
    b = np.array([3.0, -0.5], np.float32)
    s, m, t0 = (per_device[0] for per_device in runtime.load(to_text(parse(COMPACT)))(a, b))
    np.testing.assert_array_equal(s, -a + a)
    np.testing.assert_array_equal(m, b * b)
    np.testing.assert_array_equal(t0, np.abs(a))
    runtime.shutdown_workers()


@pytest.mark.parametrize("operand, column, words", [
    ("%a#0", 29, "'a#0' takes an element of 'a', which is not a tuple (f32[4])"),
    ("%t#2", 29, "'t#2': index 2 is out of range for (f32[4], f32[4])"),
    ("%t#0#0", 29, "'t#0#0' takes an element of 't#0', which is not a tuple (f32[4])"),
    ("%u#0", 29, "undefined instruction 'u'"),
    ("f32[2] %t#0", 36, "operand 't#0' is declared f32[2] but defined as f32[4]"),
])
def test_a_compact_operand_that_names_no_element_is_refused_at_its_place(operand, column,
                                                                        words):
    text = ("HloModule m\nENTRY e {\n  a = f32[4]{0} parameter(0)\n"
            "  t = (f32[4]{0}, f32[4]{0}) tuple(a, a)\n"
            f"  ROOT n = f32[4]{{0}} negate({operand})\n}}\n")
    with pytest.raises(HloParseError) as err:
        parse(text)
    assert (err.value.line, err.value.column) == (5, column)
    assert words in str(err.value)


# ------------------------------------------------------- the fixtures, compacted

_LINE = re.compile(r"^\s*%(?P<name>[^ ]+) = .* get-tuple-element\(%(?P<tuple>[^ ,)]+)\), "
                   r"index=(?P<index>\d+)")
_REF = re.compile(r"%([A-Za-z_][A-Za-z0-9_.\-]*)(?![A-Za-z0-9_.\-])")


def compacted(text: str) -> str:
    """``text`` as XLA's compact printer writes it: no get-tuple-element line but a
    computation's root, each use of one written as its tuple's name and indices."""
    lines, refs = [], {}
    for line in text.splitlines():
        if line.endswith("{") and "=" not in line.split("(")[0]:  # a computation opens
            refs = {}
        match = _LINE.match(line)
        if match and not line.lstrip().startswith("ROOT"):
            name, tuple_ = match.group("name", "tuple")
            refs[name] = f"{refs.get(tuple_, '%' + tuple_)}#{match.group('index')}"
            continue
        head, sep, rest = line.partition(" = ")
        lines.append(head + sep + _REF.sub(lambda m, refs=refs: refs.get(m.group(1), m.group(0)), rest))
    return "\n".join(lines) + "\n"


def _element_paths(module: Module) -> dict[tuple[str, str], list[tuple]]:
    """Each instruction but a get-tuple-element → its operands as (instruction, indices),
    the get-tuple-elements between them walked through."""
    paths = {}
    for comp in module.computations:
        by_name = {inst.name: inst for inst in comp.instructions}

        def path(name: str, by_name: dict = by_name) -> tuple:
            indices: list[int] = []
            while by_name[name].opcode == "get-tuple-element":
                indices.append(by_name[name].attributes["index"])
                name = by_name[name].operands[0]
            return (name, *reversed(indices))

        for inst in comp.instructions:
            if inst.opcode != "get-tuple-element" or inst.name == comp.root.name:
                paths[comp.name, inst.name] = [path(o) for o in inst.operands]
    return paths


FIXTURES = ["fixtures/spmd/loop_adam.n2.hlo", "fixtures/replica/transformer.n8.hlo",
            "fixtures/optimized/clip_adam.n4.hlo", "tests/data/grad_accum_scan_2x4.n8.hlo"]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_compacted_fixtures_read_as_the_same_program(fixture):
    """Every instruction of a fixture with its get-tuple-elements written compact reads
    with the same operands, element by element, and XLA parses what is printed."""
    original = parse((ROOT / fixture).read_text())
    compact_text = compacted(to_text(original))
    assert "#" in compact_text and compact_text.count("get-tuple-element") < to_text(
        original).count("get-tuple-element")
    read = parse(compact_text)
    assert _element_paths(read) == _element_paths(original)
    verdict, = xla_parse([to_text(read)])
    assert verdict.accepted, verdict.text
