"""The printer: golden text cases, idempotence, order rules, value formatting."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlo_shard import parse, to_text
from hlo_shard.errors import HloParseError
from hlo_shard.ir import (
    Alias, ArrayShape, BufferDonor, Computation, ComputationList, ComputationRef, Ident,
    InputOutputAlias, Instruction, Layout, Module, Raw, ReplicaGroups, SliceRanges, Str,
    TupleShape,
)
from hlo_shard.printer import format_shape, format_value

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
GOLDEN_CASES = sorted(GOLDEN.glob("**/*.hlo"))
ALL_TEXTS = GOLDEN_CASES + sorted(ROOT.glob("fixtures/**/*.hlo"))


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda p: str(p.relative_to(GOLDEN)))
def test_golden_output(case: Path):
    """Each ``.hlo`` prints exactly as its ``.expected`` neighbour."""
    expected = case.with_suffix(".expected").read_text()
    assert to_text(parse(case.read_text(), str(case))) == expected


@pytest.mark.parametrize("path", ALL_TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_printing_is_idempotent(path: Path):
    once = to_text(parse(path.read_text(), str(path)))
    assert to_text(parse(once)) == once


def _inst(name, opcode, operands=(), shape=ArrayShape("f32", (4,)), **extra):
    return Instruction(name, opcode, shape, list(operands), **extra)


def _param(name, number, shape=ArrayShape("f32", (4,))):
    return Instruction(name, "parameter", shape, parameter_number=number)


def test_an_invalid_order_is_printed_topologically_keeping_the_rest():
    comp = Computation("e", [
        _inst("b", "negate", ["a"]), _param("p", 0), _inst("a", "abs", ["p"]),
        _inst("r", "add", ["a", "b"]),
    ], root_name="r", is_entry=True)
    text = to_text(Module("m", [comp]))
    order = [line.split()[0] for line in text.splitlines() if " = " in line]
    assert order == ["%p", "%a", "%b", "ROOT"]
    assert parse(text).entry.root_name == "r"


def test_a_scheduled_module_keeps_its_order():
    comp = Computation("e", [_param("p", 0), _inst("x", "negate", ["p"]),
                             _inst("y", "abs", ["p"]), _inst("r", "add", ["x", "y"])],
                       is_entry=True)
    for scheduled in (True, False):
        module = Module("m", [comp], header={"is_scheduled": scheduled})
        names = [inst.name for inst in parse(to_text(module)).entry.instructions]
        assert names == ["p", "x", "y", "r"]


def test_callees_are_printed_before_callers():
    add = Computation("add", [_param("x", 0, ArrayShape("f32", ())),
                              _param("y", 1, ArrayShape("f32", ())),
                              _inst("s", "add", ["x", "y"], ArrayShape("f32", ()))])
    entry = Computation("e", [
        _param("p", 0), _inst("ar", "all-reduce", ["p"],
                              attributes={"to_apply": ComputationRef("add")})],
        is_entry=True)
    text = to_text(Module("m", [entry, add]))
    assert text.index("%add (") < text.index("ENTRY %e (")
    assert [c.name for c in parse(text).computations] == ["add", "e"]


def test_long_form_signature_root_and_result_shapes():
    module = parse("HloModule m\nENTRY e {\n p1 = s32[] parameter(1)\n p0 = f32[2]{0} parameter(0)\n"
                   " ROOT t = (f32[2]{0}, s32[]) tuple(p0, p1)\n}\n")
    assert to_text(module) == (
        "HloModule m\n\n"
        "ENTRY %e (p0: f32[2]{0}, p1: s32[]) -> (f32[2]{0}, s32[]) {\n"
        "  %p1 = s32[] parameter(1)\n"
        "  %p0 = f32[2]{0} parameter(0)\n"
        "  ROOT %t = (f32[2]{0}, s32[]) tuple(%p0, %p1)\n"
        "}\n")


@pytest.mark.parametrize("shape, text", [
    (ArrayShape("f32", ()), "f32[]"),
    (ArrayShape("bf16", (8, 128), (), Layout((1, 0), "T(8,128)(2,1)S(1)")),
     "bf16[8,128]{1,0:T(8,128)(2,1)S(1)}"),
    (ArrayShape("f32", (8, -1, 3), ("<=", "?", "")), "f32[<=8,?,3]"),
    (ArrayShape("s4", (8,), (), Layout((0,), "E(4)")), "s4[8]{0:E(4)}"),
    (TupleShape(()), "()"),
    (TupleShape((ArrayShape("f32", ()), TupleShape((ArrayShape("pred", ()),)))),
     "(f32[], (pred[]))"),
])
def test_shape_format(shape, text):
    assert format_shape(shape) == text


@pytest.mark.parametrize("value, text", [
    (True, "true"), (False, "false"), (3, "3"), (-1, "-1"), (0.001, "0.001"),
    (1e-05, "1e-05"), (2.0, "2"),
    ((1, 0), "{1,0}"), ((), "{}"), (((0, 1), (1, 0)), "{{0,1},{1,0}}"),
    (Raw("{op_name=\"x\"}"), "{op_name=\"x\"}"), (Ident("kLoop"), "kLoop"),
    (Str('say "hi"\n'), '"say \\"hi\\"\\n"'),
    (ComputationRef("add"), "%add"), (ComputationList(("a", "b")), "{%a, %b}"),
    (SliceRanges(((0, 4, 1), (0, 8, 2))), "{[0:4], [0:8:2]}"),
    (ReplicaGroups(((0, 1), (2, 3))), "{{0,1},{2,3}}"),
    (ReplicaGroups(((0, 1, 2, 3), (4, 5, 6, 7)), "[2,4]<=[8]"), "[2,4]<=[8]"),
])
def test_value_format(value, text):
    assert format_value(value) == text


def test_typed_values_survive_a_round_trip():
    text = ('HloModule m\nENTRY e {\n p = f32[8] parameter(0)\n'
            ' g = f32[16] all-gather(p), dimensions={0}, replica_groups={{0,1}}\n'
            ' ROOT c = f32[16] custom-call(g), custom_call_target="a\\\\b\\"c\\td"\n}\n')
    entry = parse(to_text(parse(text))).entry
    inst = entry["c"]
    assert inst.attributes["custom_call_target"] == Str('a\\b"c\td')
    assert entry["g"].attributes["dimensions"] == (0,)


# ------------------------------------------------- donation configs: typed, XLA's form

#: ``input_output_alias`` and ``buffer_donor`` values as XLA writes them, each printed back
#: as read (``HloInputOutputAliasConfig::ToShortString`` inside ``{ … }``).
DONATION_GOLDEN = [
    "input_output_alias={ {0}: (0, {}, may-alias), {1}: (2, {}, must-alias) }",
    "input_output_alias={ {0,1}: (1, {0}, may-alias) }",
    "input_output_alias={ {}: (0, {}) }",
    "input_output_alias={}",
    "buffer_donor={ (0, {}), (3, {1}) }",
]


def _header_module(attribute: str) -> str:
    return f"HloModule m, {attribute}\n\nENTRY %e (p: f32[]) -> f32[] {{\n  ROOT %p = f32[] parameter(0)\n}}\n"


@pytest.mark.parametrize("attribute", DONATION_GOLDEN)
def test_donation_configs_are_typed_and_print_back_as_xla_writes_them(attribute):
    module = parse(_header_module(attribute))
    key = attribute.split("=", 1)[0]
    assert isinstance(module.header[key], InputOutputAlias | BufferDonor)
    assert to_text(module).splitlines()[0] == f"HloModule m, {attribute}"


def test_an_alias_config_reads_as_entries():
    module = parse(_header_module(DONATION_GOLDEN[0].replace(", ", " ,  ")))
    assert module.header["input_output_alias"] == InputOutputAlias((
        Alias((0,), 0, (), "may-alias"), Alias((1,), 2, (), "must-alias")))
    assert module.output_aliases() == {0: 0, 1: 2}
    nested = parse(_header_module(DONATION_GOLDEN[1]))
    assert nested.header["input_output_alias"] == InputOutputAlias((Alias((0, 1), 1, (0,)),))
    assert nested.output_aliases() == {}  # not a whole parameter to a top-level output
    assert parse(_header_module(DONATION_GOLDEN[4])).header["buffer_donor"] == \
        BufferDonor(((0, ()), (3, (1,))))


def test_a_built_alias_config_prints_in_xlas_form():
    value = InputOutputAlias((Alias((2,), 1), Alias((), 0, (1,), "must-alias")))
    assert format_value(value) == "{ {2}: (1, {}, may-alias), {}: (0, {1}, must-alias) }"
    assert format_value(InputOutputAlias()) == "{}"


@pytest.mark.parametrize("value", ["{ {0}: (0, {}, maybe-alias) }", "{ {0}: 0 }",
                                   "{ {0}: (0, {}) {1}: (1, {}) }", "{ {a}: (0, {}) }"])
def test_a_malformed_alias_config_is_refused(value):
    with pytest.raises(HloParseError) as caught:
        parse(_header_module(f"input_output_alias={value}"))
    assert "'input_output_alias' expects" in caught.value.message
