"""The Rewriter keeps the instruction list, users and insertion points consistent."""

from hlo_shard.graph import Rewriter, dataflow_graph, topological_order
from hlo_shard.ir import ArrayShape, Computation, Instruction

F4 = ArrayShape("f32", (4,))


def _comp() -> Computation:
    return Computation("e", [
        Instruction("p", "parameter", F4, parameter_number=0),
        Instruction("n", "negate", F4, ["p"]),
        Instruction("r", "add", F4, ["n", "n"]),
    ], is_entry=True)


def test_dataflow_graph_keeps_repeated_operands():
    assert sorted(dataflow_graph(_comp()).edges(keys=True)) == [
        ("n", "r", 0), ("n", "r", 1), ("p", "n", 0)]


def test_replace_all_uses_then_remove_dead():
    comp = _comp()
    rw = Rewriter(comp)
    with rw.inserting_after("p"):
        absolute = rw.add("abs", F4, ["p"])
    rw.replace_all_uses_with("n", absolute.name)
    assert rw.remove_dead() == 1
    assert [i.name for i in comp.instructions] == ["p", "abs.1", "r"]
    assert comp["r"].operands == ["abs.1", "abs.1"]
    assert [u.name for u in rw.users("abs.1")] == ["r"]


def test_nested_insertion_points_stay_in_sequence():
    comp = _comp()
    rw = Rewriter(comp)
    with rw.inserting_after("p"):
        first = rw.add("abs", F4, ["p"])
        with rw.inserting_after(first.name):
            inner = rw.add("exponential", F4, [first.name])
        second = rw.add("sqrt", F4, [inner.name])
    assert [i.name for i in comp.instructions] == [
        "p", first.name, inner.name, second.name, "n", "r"]
    assert topological_order(comp) == comp.instructions
