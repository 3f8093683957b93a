"""The Rewriter keeps the instruction list, users and insertion points consistent."""

from collections.abc import Callable
import sys

from hypothesis import given, settings, strategies as st
import pytest
from test_complexity import lines_run

from hlo_shard.graph import (Change, DependencyCycle, ModuleRewriter, Rewriter, dataflow_graph,
                             topological_order)
from hlo_shard.ir import ArrayShape, Computation, Instruction, Module, Raw
from hlo_shard.printer import format_change

F4 = ArrayShape("f32", (4,))


def _comp() -> Computation:
    return Computation("e", [
        Instruction("p", "parameter", F4, parameter_number=0),
        Instruction("n", "negate", F4, ["p"]),
        Instruction("r", "add", F4, ["n", "n"]),
    ], is_entry=True)


def test_dataflow_graph_keeps_repeated_operands():
    assert sorted(dataflow_graph(_comp()).edges()) == [
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


# ------------------------------------------------------------ the edit vocabulary


def test_every_edit_is_in_the_change_log():
    comp = _comp()
    rw = Rewriter(comp)
    rw.set_operand(comp["r"], 1, "p")
    rw.set_opcode(comp["n"], "abs")
    rw.set_shape(comp["n"], ArrayShape("f16", (4,)))
    rw.set_shape(comp["n"], ArrayShape("f16", (4,)))  # unchanged: not recorded
    rw.set_attr(comp["n"], "sharding", Raw("{replicated}"))
    assert rw.pop_attr(comp["n"], "sharding") == Raw("{replicated}")
    assert rw.pop_attr(comp["n"], "sharding", "absent") == "absent"  # not recorded
    rw.set_operands(comp["r"], ["n"])
    assert [(c.kind, c.name) for c in rw.changes] == [
        ("set-operand", "r"), ("set-opcode", "n"), ("set-shape", "n"), ("set-attr", "n"),
        ("pop-attr", "n"), ("set-operands", "r")]
    assert comp["r"].operands == ["n"] and comp["n"].opcode == "abs"
    assert [u.name for u in rw.users("p")] == ["n"]
    assert [u.name for u in rw.users("n")] == ["r"]


def test_a_change_reads_as_where_which_instruction_what_edit():
    comp = _comp()
    rw = Rewriter(comp)
    rw.set_shape(comp["n"], ArrayShape("f32", (2,)))
    rw.set_attr(comp["n"], "sharding", Raw("{replicated}"))
    rw.set_operand(comp["r"], 1, "p")
    assert [format_change(c) for c in rw.changes] == [
        "%e: %n shape f32[4] -> f32[2]", "%e: %n sharding: unset -> {replicated}",
        "%e: %r operand 1: %n -> %p"]
    assert rw.changes[0] == Change("set-shape", "n", "", "e", F4, ArrayShape("f32", (2,)))


def test_module_rewriter_records_header_edits_and_shares_one_log():
    module = Module("m", [_comp()], {"num_partitions": 2, "is_scheduled": True,
                                     "buffer_donor": Raw("{ (0, {}) }")})
    edits = ModuleRewriter(module)
    edits.set_header("is_scheduled", True)  # unchanged: not recorded
    assert edits.pop_header("input_output_alias") is None and edits.changes == []
    edits.set_header("replica_count", 2, replacing="num_partitions")
    edits.pop_header("buffer_donor")
    rw = edits.rewriter(module.entry)
    assert edits.rewriter(module.entry) is rw
    rw.set_opcode(module.entry["n"], "abs")
    edits.insert_computation(Computation("c", [Instruction("x", "parameter", F4,
                                                           parameter_number=0)]), after="e")
    assert module.header == {"replica_count": 2, "is_scheduled": True}
    assert list(module.header) == ["replica_count", "is_scheduled"]  # in num_partitions' place
    assert [(c.kind, c.computation, c.name) for c in edits.changes] == [
        ("pop-header", "", "num_partitions"), ("set-header", "", "replica_count"),
        ("pop-header", "", "buffer_donor"), ("set-opcode", "e", "n"),
        ("insert-computation", "", "c")]
    assert [c.name for c in module.computations] == ["e", "c"]
    with pytest.raises(ValueError, match="duplicate computation"):
        edits.insert_computation(Computation("c"), after="e")


def test_set_operand_keeps_the_users_index():
    comp = _comp()
    rw = Rewriter(comp)
    rw.set_operand(comp["r"], 0, "p")
    assert [u.name for u in rw.users("n")] == ["r"]  # still operand 1
    rw.set_operand(comp["r"], 1, "p")
    assert rw.users("n") == []
    assert rw.remove_dead() == 1 and "n" not in comp


def test_reorder_is_recorded_only_when_the_order_changes():
    comp = _comp()
    rw = Rewriter(comp)
    rw.sort_topologically()
    assert rw.changes == []
    p, n, r = comp.instructions
    rw.reorder([n, p, r])
    assert comp.instructions == [n, p, r] and rw.changes[-1].kind == "reorder"
    rw.sort_topologically()
    assert [i.name for i in comp.instructions] == ["p", "n", "r"]
    with pytest.raises(ValueError, match="same instructions"):
        rw.reorder([p, r])
    with rw.inserting_after("p"), pytest.raises(ValueError, match="inserting"):
        rw.reorder([p, n, r])


def test_erase_refuses_a_used_value_and_the_root():
    rw = Rewriter(_comp())
    with pytest.raises(ValueError, match="still used by"):
        rw.erase("n")
    with pytest.raises(ValueError, match="root"):
        rw.erase("r")
    assert rw.changes == []


def _with_dead(*opcodes: str) -> Computation:
    return Computation("e", [
        Instruction("p", "parameter", F4, parameter_number=0),
        *[Instruction(f"d{i}", opcode, F4, ["p"]) for i, opcode in enumerate(opcodes)],
        Instruction("r", "negate", F4, ["p"]),
    ], is_entry=True)


@pytest.mark.parametrize("opcode", [
    "all-reduce-start", "all-reduce-done", "collective-permute-start", "async-start",
    "async-done", "copy-start", "copy-done", "opt-barrier", "add-dependency", "send",
    "recv-done", "outfeed", "custom-call", "rng", "reduce-scatter-start"])
def test_remove_dead_keeps_what_the_opcode_table_calls_impure(opcode):
    comp = _with_dead(opcode, "exponential")
    assert Rewriter(comp).remove_dead() == 1
    assert [i.name for i in comp.instructions] == ["p", "d0", "r"]


def test_remove_dead_takes_a_predicate_and_keeps_control_predecessors():
    comp = _with_dead("custom-call", "exponential", "sine")
    comp["r"].attributes["control-predecessors"] = Raw("{%d2}")
    assert Rewriter(comp).remove_dead(is_impure=lambda inst: False) == 2
    assert [i.name for i in comp.instructions] == ["p", "d2", "r"]
    comp = _with_dead("exponential", "sine")
    assert Rewriter(comp).remove_dead(keep=["d0"]) == 1
    assert "d0" in comp and "d1" not in comp


ASYNC_COPY = """HloModule m
ENTRY e {
  p = f32[4] parameter(0)
  cs = (f32[4], f32[4], u32[]) copy-start(p)
  cd = f32[4] copy-done(cs)
  n = f32[4] negate(cd)
  t = (f32[4]) tuple(n)
  ob = (f32[4]) opt-barrier(t)
  g = f32[4] get-tuple-element(ob), index=0
  after = token[] after-all()
  dep = f32[4] add-dependency(g, after)
  m = f32[4] multiply(dep, n)
  unused = f32[4] exponential(p)
  ROOT r = f32[4] add(p, p)
}
"""


def test_remove_dead_among_erases_what_a_rewrite_replaced_and_keeps_async_halves():
    """The region rewrite's clean-up (``among``: what it replaced): operands left unused
    go too, a copy-done, opt-barrier or add-dependency stays (erasing a -done leaves its
    -start unmatched), and values the input already left dead are not its business."""
    from hlo_shard.parser import parse
    from hlo_shard.printer import to_text
    from hlo_shard.validate import validate

    module = parse(ASYNC_COPY)
    comp = module.entry
    assert Rewriter(comp).remove_dead(among=["m"]) == 1
    assert [i.name for i in comp.instructions] == [
        "p", "cs", "cd", "n", "t", "ob", "g", "after", "dep", "unused", "r"]
    assert not validate(parse(to_text(module)))
    # The rewrite's own list before opinfo (RegionRewrite._KEEP) erased all of them.
    old_keep = {"parameter", "custom-call", "infeed", "outfeed", "send", "recv", "rng",
                "send-done", "recv-done", "after-all", "rng-get-and-update-state"}
    comp = parse(ASYNC_COPY).entry
    Rewriter(comp).remove_dead(among=["m"], is_impure=lambda inst: inst.opcode in old_keep)
    assert [i.name for i in comp.instructions] == ["p", "after", "unused", "r"]


def test_a_clone_prints_the_same_and_edits_apart():
    """``Module.clone`` (the speed gate's trials) is a deep copy in effect: the same text,
    and no edit of the clone — operands, attributes, instructions, header — reaches the
    original."""
    from hlo_shard.parser import parse
    from hlo_shard.printer import to_text

    text = ("HloModule m, replica_count=2\n\nENTRY main {\n"
            "  p = f32[4]{0} parameter(0)\n"
            "  n = f32[4]{0} negate(p), metadata={op_name=\"x\"}\n"
            "  ROOT a = f32[4]{0} add(n, p)\n}\n")
    module = parse(text)
    clone = module.clone()
    assert to_text(clone) == to_text(module)
    entry = clone.entry
    entry["a"].operands[0] = "p"
    entry["n"].attributes.clear()
    entry.append(Instruction("extra", "negate", ArrayShape("f32", (4,)), ["p"]))
    clone.header["replica_count"] = 4
    assert to_text(module) == to_text(parse(text))
    assert "extra" not in module.entry and module.entry["a"] is not entry["a"]


def test_views_are_read_once_per_computation_only_while_reading_only() -> None:
    """Pricing a module (the gate's estimates, ``report``) runs several analyses over the
    same computations: inside ``reading_only`` they share one users map, order and
    dataflow graph per computation; outside, each call sees the computation as it is."""
    from hlo_shard.graph import reading_only, users_map

    comp = _comp()
    with reading_only():
        assert users_map(comp) is users_map(comp)
        assert topological_order(comp) is topological_order(comp)
        with reading_only():  # nested: the same views
            assert dataflow_graph(comp).users is dataflow_graph(comp).users
    assert users_map(comp) is not users_map(comp)
    assert users_map(comp) == users_map(comp)
    graph = dataflow_graph(comp)
    assert set(graph.edges()) == {
        (operand, inst.name, index) for inst in comp.instructions
        for index, operand in enumerate(inst.operands)}


def test_forget_drops_the_log_since_and_the_computations_rewriter():
    """An attempt undone from a snapshot (the weight-update pass's refused region): its
    edits leave the log, and the next Rewriter reads the computation as it is again."""
    module = Module("m", [_comp()], {})
    edits = ModuleRewriter(module)
    edits.set_header("replica_count", 2)
    rw = edits.rewriter(module.entry)
    since = len(edits.changes)
    added = rw.add("abs", F4, ["p"])
    module.entry.remove(added.name, module.entry.position(added.name))  # the snapshot's undo
    edits.forget(module.entry, since)
    assert [c.kind for c in edits.changes] == ["set-header"]
    again = edits.rewriter(module.entry)
    assert again is not rw and [u.name for u in again.users("p")] == ["n"]
    assert again.fresh_name("abs") == added.name  # the undone name is free again


class _CountingList(list):
    """A module's computation list that counts the elements its searches pass."""

    scanned = 0

    def index(self, value, start=0, stop=sys.maxsize):
        try:
            found = super().index(value, start, stop)
        except ValueError:
            self.scanned += max(len(self) - start, 0)
            raise
        self.scanned += found - start + 1
        return found


def _inserted_copies(count: int) -> tuple[Module, list[str]]:
    """``count`` computations; after every other one (in list order, as the weight-update
    pass inserts each fusion body's sharded copy), a copy, a second copy right after the
    first, and a third right after the original again; the list's names as inserting
    each right after its anchor in a plain list makes them."""
    def body(name: str) -> Computation:
        return Computation(name, [Instruction("p", "parameter", F4, parameter_number=0)])

    module = Module("m", _CountingList(body(f"c{k}") for k in range(count)), {})
    expected = [c.name for c in module.computations]
    edits = ModuleRewriter(module)
    for k in range(0, count, 2):
        for name, after in ((f"c{k}.a", f"c{k}"), (f"c{k}.b", f"c{k}.a"), (f"c{k}.c", f"c{k}")):
            edits.insert_computation(body(name), after=after)
            expected.insert(expected.index(after) + 1, name)
    return module, expected


def test_inserted_computations_find_their_anchor_without_scanning_the_list():
    """Each insert finds its anchor where the inserts before it moved it (not by a search
    of the list from its start, which made a pass inserting thousands of fusion bodies
    quadratic), and the list is the one inserting in a plain list makes."""
    small, expected = _inserted_copies(1_000)
    assert [c.name for c in small.computations] == expected
    large, _ = _inserted_copies(2_000)
    assert large.computations.scanned <= 2.2 * small.computations.scanned
    # A list edited otherwise in between (cut down) is followed afresh.
    module, expected = _inserted_copies(10)
    edits = ModuleRewriter(module)
    edits.insert_computation(Computation("x", []), after="c4.c")
    edits.remove_computations(["c0.a", "c0.b"])
    edits.insert_computation(Computation("y", []), after="c4")
    expected.insert(expected.index("c4.c") + 1, "x")
    expected = [n for n in expected if n not in ("c0.a", "c0.b")]
    expected.insert(expected.index("c4") + 1, "y")
    assert [c.name for c in module.computations] == expected


def test_fresh_names_of_one_stem_cost_the_same_each():
    """A pass adding thousands of ``reshape.N`` pays the same for each new name, not a
    try of every earlier number again (quadratic in the names of one stem)."""
    def names(count: int) -> Callable[[], object]:
        rw = Rewriter(_comp())
        return lambda: [rw.fresh_name("reshape") for _ in range(count)]

    assert lines_run(names(2_000)) <= 2.2 * lines_run(names(1_000))
    rw = Rewriter(_comp())
    rw.add_instruction(Instruction("n.2", "negate", F4, ["p"]))
    assert [rw.fresh_name("n"), rw.fresh_name("n"), rw.fresh_name("n.7")] == \
        ["n.1", "n.3", "n.4"]


def _wide_root(slots: int) -> Computation:
    """``slots`` parameters, each read twice by the root tuple."""
    params = [Instruction(f"p{k}", "parameter", F4, parameter_number=k) for k in range(slots)]
    names = [p.name for p in params]
    return Computation("e", [*params, Instruction("t", "tuple", F4, names + names)],
                       is_entry=True)


def test_moving_the_uses_of_every_slot_of_a_wide_tuple_is_linear():
    """A pass pointing each slot of a root tuple elsewhere, one use at a time (a loop
    body's carried slots): each move finds the use in the users index, where it read
    the user's whole operand list before (quadratic in the slots)."""
    def moves(slots: int) -> Callable[[], object]:
        comp = _wide_root(slots)
        rw = Rewriter(comp)

        def run() -> None:
            for k in range(slots):
                negated = rw.add("negate", F4, [f"p{k}"])
                if k % 2:
                    rw.replace_all_uses_with(f"p{k}", negated.name)
                else:
                    rw.set_operand(comp.root, k, negated.name)
                    rw.set_operand(comp.root, slots + k, negated.name)
        return run

    assert lines_run(moves(2_000)) <= 2.2 * lines_run(moves(1_000))


def test_the_users_index_follows_repeated_uses():
    """A user reading a value several times stays its user until the last use moves;
    moving every use at once leaves the value unused."""
    comp = _wide_root(3)
    rw = Rewriter(comp)
    root = comp.root
    rw.set_operand(root, 3, "p1")  # p0's second use
    assert [u.name for u in rw.users("p0")] == ["t"]
    rw.set_operand(root, 0, "p2")
    assert rw.users("p0") == [] and root.operands == ["p2", "p1", "p2", "p1", "p1", "p2"]
    rw.replace_all_uses_with("p1", "p0")
    assert root.operands == ["p2", "p0", "p2", "p0", "p0", "p2"] and rw.users("p1") == []
    rw.set_operand(root, 1, "p1")
    rw.replace_all_uses_with("p0", "p1", exclude=["t"])  # excluded: nothing moves
    assert root.operands == ["p2", "p1", "p2", "p0", "p0", "p2"]
    rw.replace_all_uses_with("p0", "p1")
    assert root.operands == ["p2", "p1", "p2", "p1", "p1", "p2"]
    rw.set_operands(root, ["p0", "p0"])
    assert [[u.name for u in rw.users(p)] for p in ("p0", "p1", "p2")] == [["t"], [], []]
    for name in ("p1", "p2"):
        rw.erase(name)
    rw.set_operand(root, 1, "p0")
    assert [u.name for u in rw.users("p0")] == ["t"] and root.operands == ["p0", "p0"]


def test_a_rewriter_keeps_its_names_and_users_as_it_found_them_before_its_edits():
    """The users index and names in use are read at the first query or edit: a name
    erased before the first new name stays taken, users keep program order."""
    comp = _comp()
    rw = Rewriter(comp)
    rw.replace_all_uses_with("n", "p")
    rw.erase("n")
    assert rw.fresh_name("n") == "n.1" and "n" not in comp
    assert [u.name for u in rw.users("p")] == ["r"]


def test_topological_order_takes_the_earliest_ready_instruction_and_names_a_cycle():
    comp = Computation("e", [
        Instruction("b", "negate", F4, ["a"]),
        Instruction("c", "parameter", F4, parameter_number=1),
        Instruction("a", "parameter", F4, parameter_number=0),
        Instruction("d", "add", F4, ["b", "c"]),
    ])
    assert [i.name for i in topological_order(comp)] == ["c", "a", "b", "d"]
    comp.instructions[1].operands = ["d"]  # c needs d, which needs c
    with pytest.raises(DependencyCycle) as cycle:
        topological_order(comp)
    assert cycle.value.stuck == ["c", "d"]


_NAMES = st.integers(min_value=0, max_value=7)
_EDITS = st.lists(st.one_of(
    st.tuples(st.just("set_operand"), _NAMES, st.integers(0, 5), _NAMES),
    st.tuples(st.just("replace"), _NAMES, _NAMES, st.booleans()),
    st.tuples(st.just("set_operands"), _NAMES, st.lists(_NAMES, max_size=4)),
    st.tuples(st.just("add"), st.lists(_NAMES, min_size=1, max_size=3))), max_size=25)


@settings(max_examples=150, deadline=None)
@given(_EDITS)
def test_the_users_index_stays_the_computations_own_under_any_edits(edits):
    """After any sequence of use edits, each value's users and where each reads it are
    what the operand lists say (the index is read from them only once)."""
    comp = Computation("e", [
        *(Instruction(f"p{k}", "parameter", F4, parameter_number=k) for k in range(3)),
        Instruction("a", "add", F4, ["p0", "p0"]),
        Instruction("m", "multiply", F4, ["a", "p1"]),
        Instruction("t", "tuple", F4, ["a", "m", "p2", "a"]),
    ], is_entry=True)
    rw = Rewriter(comp)

    def pick(k: int) -> str:
        return comp.instructions[k % len(comp.instructions)].name

    for edit in edits:
        users = [inst for inst in comp.instructions if inst.operands]
        if edit[0] in ("set_operand", "set_operands") and not users:
            continue
        if edit[0] == "set_operand":
            user = users[edit[1] % len(users)]
            rw.set_operand(user, edit[2] % len(user.operands), pick(edit[3]))
        elif edit[0] == "replace":
            rw.replace_all_uses_with(pick(edit[1]), pick(edit[2]),
                                     exclude=["t"] if edit[3] else ())
        elif edit[0] == "set_operands":
            rw.set_operands(users[edit[1] % len(users)], [pick(k) for k in edit[2]])
        else:
            rw.add("add", F4, [pick(k) for k in edit[1]])
        for name in [inst.name for inst in comp.instructions]:
            expected = {inst.name: [i for i, o in enumerate(inst.operands) if o == name]
                        for inst in comp.instructions if name in inst.operands}
            assert {u.name for u in rw.users(name)} == set(expected)
            assert rw._users[name] == expected
