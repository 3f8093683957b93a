"""A run of instructions of a shape read before (a fused computation or reducer XLA
repeats, its names aside) is made from the first one's records: the module, every
position and every error must be what reading each run would give."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import hlo_shard.parser as parser_module
from hlo_shard.errors import HloParseError
from hlo_shard.ir import Module
from hlo_shard.parser import parse
from hlo_shard.printer import to_text

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(module: Module) -> list[tuple]:
    """Everything reading gives, positions included."""
    rows: list[tuple] = [(module.name, tuple(module.header.items()))]
    for comp in module.computations:
        rows.append((comp.name, comp.root_name, comp.is_entry, comp.loc))
        rows += [(inst.name, inst.opcode, inst.shape, tuple(inst.operands),
                  tuple(inst.attributes.items()), inst.parameter_number, inst.literal,
                  inst.loc) for inst in comp.instructions]
    return rows


def _read_each(monkeypatch, text: str) -> Module | str:
    """``text`` read run by run, nothing made from records (or the error's words)."""
    with monkeypatch.context() as patched:
        patched.setattr(parser_module._Builder, "_remake", lambda *args: None)
        return _parsed(text)


def _parsed(text: str) -> Module | str:
    try:
        return parse(text, path="m.hlo")
    except HloParseError as err:
        return str(err)


def _assert_same(monkeypatch, text: str) -> Module | str:
    made, read = _parsed(text), _read_each(monkeypatch, text)
    if isinstance(made, str) or isinstance(read, str):
        assert made == read
        return made
    assert _snapshot(made) == _snapshot(read)
    assert to_text(made) == to_text(read)
    return made


def _count_remade(monkeypatch) -> list[int]:
    """A list that grows by one per run made from records."""
    made: list[int] = []
    remake = parser_module._Builder._remake

    def counted(self, *args):
        result = remake(self, *args)
        if result is not None:
            made.append(1)
        return result

    monkeypatch.setattr(parser_module._Builder, "_remake", counted)
    return made


def _fused(name: str, params: list[str], square: str, window: str, reducer: str,
           padding: str = "") -> str:
    """One of XLA:CPU's fused sums of squares, named as told (``padding``: spaces
    before ROOT, which moves no name)."""
    p0, p1, p2 = params
    return f"""
%{name} ({p0}: f32[], {p1}: f32[64,64], {p2}: f32[64,64]) -> f32[2,2] {{
  %{p1} = f32[64,64]{{1,0}} parameter(1)
  %{p2} = f32[64,64]{{1,0}} parameter(2)
  %{square} = f32[64,64]{{1,0}} multiply(%{p1}, /*index=1*/%{p2}), metadata={{op_name="jit(step)/square" stack_frame_id=24}}
  %{p0} = f32[] parameter(0)
  {padding}ROOT %{window} = f32[2,2]{{1,0}} reduce-window(%{square}, %{p0}), window={{size=32x32 stride=32x32}}, to_apply=%{reducer}
}}
"""


def _reducer(name: str, a: str, b: str, total: str) -> str:
    return f"""
%{name} ({a}: f32[], {b}: f32[]) -> f32[] {{
  %{a} = f32[] parameter(0), metadata={{op_name="jit(step)/reduce_sum"}}
  %{b} = f32[] parameter(1)
  ROOT %{total} = f32[] add(%{a}, %{b})
}}
"""


def _module(pieces: list[str], calls: list[str]) -> str:
    uses = "\n".join(
        f"  %f{k} = f32[2,2]{{1,0}} fusion(%zero, %p, %p), kind=kLoop, calls=%{name}"
        for k, name in enumerate(calls))
    last = f"f{len(calls) - 1}"
    return ("HloModule m\n" + "".join(pieces) + f"""
ENTRY %main (p: f32[64,64]) -> f32[2,2] {{
  %p = f32[64,64]{{1,0}} parameter(0)
  %zero = f32[] constant(0)
{uses}
  ROOT %out = f32[2,2]{{1,0}} copy(%{last})
}}
""")


def _repeats(names: list[tuple[str, ...]]) -> str:
    pieces, calls = [], []
    for reducer, a, b, total, fused, p0, p1, p2, square, window in names:
        pieces += [_reducer(reducer, a, b, total),
                   _fused(fused, [p0, p1, p2], square, window, reducer)]
        calls.append(fused)
    return _module(pieces, calls)


NAMES = [
    ("region_0.1", "x.1", "y.2", "add.3", "fused_computation", "param_0.1", "param_1.1",
     "param_2", "square.333", "reduce-window.160"),
    # every name another length, one name reused as another's (a reducer's parameter
    # named as the fused computation's square)
    ("region_289.290", "reduce_sum.1914", "y", "s", "fused_computation.2", "param_0.4",
     "param_1.4", "param_2.1", "reduce_sum.1914", "reduce-window.161"),
    ("r", "a", "b", "c", "fused_computation.1000", "p0", "p1.22", "p2.333",
     "sq", "rw-1.2.3"),
]


def test_runs_of_one_shape_are_made_as_read(monkeypatch):
    made = _count_remade(monkeypatch)
    module = _assert_same(monkeypatch, _repeats(NAMES))
    assert isinstance(module, Module)
    assert len(made) == 4  # the second and third reducer and fused computation
    fused = module.computation("fused_computation.1000")
    assert [i.name for i in fused.instructions] == ["p1.22", "p2.333", "sq", "p0", "rw-1.2.3"]
    assert fused.root.attributes["to_apply"].name == "r"
    assert fused["sq"].operands == ["p1.22", "p2.333"]
    assert fused["rw-1.2.3"].loc is not None and fused["rw-1.2.3"].loc.column == 8


def test_positions_follow_each_run_own_names_and_indentation(monkeypatch):
    """A ROOT further right, names longer or shorter before it on its line."""
    text = _module([_reducer("r.1", "a", "b", "c"),
                    _fused("f.1", ["p0", "p1", "p2"], "sq", "rw", "r.1"),
                    _fused("f.22222", ["p0.333", "p1.4444", "p2.5"], "sq.6", "rw.7", "r.1"),
                    _fused("f.3", ["q", "r1", "r2"], "s", "w", "r.1", padding="    ")],
                   ["f.1", "f.22222", "f.3"])
    module = _assert_same(monkeypatch, text)
    assert isinstance(module, Module)
    lines = text.splitlines()
    for comp in module.computations:
        for inst in comp.instructions:
            assert inst.loc is not None
            line = lines[inst.loc.line - 1]
            assert line[inst.loc.column - 1:].startswith(f"%{inst.name} ="), (inst.name, line)


@pytest.mark.parametrize("seed", range(6))
def test_generated_names_read_the_same(monkeypatch, seed):
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz_"

    def name() -> str:
        return rng.choice(alphabet) + "".join(
            rng.choice(alphabet + "0123456789.-") for _ in range(rng.randrange(0, 12)))

    rows = []
    for _ in range(rng.randrange(2, 8)):
        chosen: list[str] = []
        while len(chosen) < 10:
            candidate = name()
            if candidate not in chosen and candidate not in {"p", "zero", "out", "main"} and \
                    not candidate.startswith("f") and candidate not in parser_module._TYPE_KEYWORDS:
                chosen.append(candidate)
        # fused and reducer names unique across the module
        chosen[0], chosen[4] = f"red{len(rows)}_{chosen[0]}", f"fus{len(rows)}_{chosen[4]}"
        rows.append(tuple(chosen))
    _assert_same(monkeypatch, _repeats(rows))


def test_a_callee_not_defined_yet_is_reported_where_it_is_used(monkeypatch):
    """The second fused computation calls a reducer defined after it: an error at that
    use, as reading it says."""
    text = "HloModule m\n" + "".join([
        _reducer("r.1", "a", "b", "c"),
        _fused("f.1", ["p0", "p1", "p2"], "sq", "rw", "r.1"),
        _fused("f.2", ["p0", "p1", "p2"], "sq", "rw", "r.2"),
        _reducer("r.2", "a", "b", "c")]) + """
ENTRY %main (p: f32[]) -> f32[] {
  ROOT %p = f32[] parameter(0)
}
"""
    error = _assert_same(monkeypatch, text)
    assert isinstance(error, str) and "'r.2' is used before it is defined" in error
    assert f"m.hlo:{text.splitlines().index('%f.2 (p0: f32[], p1: f32[64,64], p2: f32[64,64]) -> f32[2,2] {') + 6}:" in error


def test_a_type_name_naming_an_instruction_is_refused_in_a_repeat(monkeypatch):
    text = _repeats([NAMES[0], ("r", "a", "f32", "c", "fused", "p0", "p1", "p2", "sq", "rw")])
    error = _assert_same(monkeypatch, text)
    assert isinstance(error, str) and "'f32' is a type name" in error


def test_a_name_inside_a_value_is_read_each_time(monkeypatch):
    """A ``%name`` inside metadata: not a run that can be made from another's records
    (its text would be the first one's)."""
    made = _count_remade(monkeypatch)
    text = _repeats(NAMES).replace('op_name="jit(step)/reduce_sum"',
                                   'op_name="jit(step)/%x.1"')
    module = _assert_same(monkeypatch, text)
    assert isinstance(module, Module)
    assert len(made) == 2  # the fused computations only


@pytest.mark.parametrize("path", sorted(
    str(p.relative_to(ROOT)) for pattern in ("fixtures/*/*.hlo", "tests/data/*.hlo")
    for p in ROOT.glob(pattern)))
def test_fixtures_read_the_same(monkeypatch, path):
    _assert_same(monkeypatch, (ROOT / path).read_text(encoding="utf-8"))


def test_an_error_in_a_repeat_is_reported_at_its_own_position(monkeypatch):
    """The second computation's run has the first's shape, but what follows it leaves
    its ``parameter(2)`` out of range: the error points at that 2, past names of other
    lengths than the first's."""
    text = """HloModule m

%c.1 (a: f32[], b: f32[], c: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %ccccc.1 = f32[] parameter(2)
  /* read apart */ %b.1 = f32[] parameter(1)
  ROOT %s.1 = f32[] add(%a.1, %ccccc.1)
}

%c.2 (a: f32[], c: f32[]) -> f32[] {
  %a.22 = f32[] parameter(0)
  %c.3 = f32[] parameter(2)
  /* read apart */ ROOT %s.2 = f32[] add(%a.22, %c.3)
}

ENTRY %main (p: f32[]) -> f32[] {
  ROOT %p = f32[] parameter(0)
}
"""
    made = _count_remade(monkeypatch)
    error = _assert_same(monkeypatch, text)
    assert made == [1]
    assert isinstance(error, str) and "invalid parameter number" in error
    line = text.splitlines().index("  %c.3 = f32[] parameter(2)") + 1
    assert f"m.hlo:{line}:{len('  %c.3 = f32[] parameter(') + 1}:" in error, error
