"""The parser's records: typed attribute values, shapes, literals, positions."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlo_shard import HloParseError, parse
from hlo_shard.ir import (
    Alias, ArrayShape, ComputationList, ComputationRef, Ident, InputOutputAlias, Layout, Raw,
    ReplicaGroups, SliceRanges, SourceLoc, Str, TupleShape,
)


def entry_of(body: str, header: str = "HloModule m", callees: str = ""):
    module = parse(f"{header}\n{callees}\nENTRY e {{\n{body}\n}}\n")
    return module, module.entry


ADD = "add {\n x = f32[] parameter(0)\n y = f32[] parameter(1)\n ROOT r = f32[] add(x, y)\n}"


def collective(groups: str, extra: str = "") -> ReplicaGroups:
    _, comp = entry_of(f"p = f32[8] parameter(0)\nROOT ar = f32[8] all-reduce(p), "
                       f"channel_id=1, replica_groups={groups}, use_global_device_ids=true, "
                       f"to_apply=add{extra}", "HloModule m, num_partitions=8", ADD)
    return comp["ar"].attributes["replica_groups"]


@pytest.mark.parametrize("text, groups", [
    ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("{}", ()),
    ("{ {0, 2}, {1, 3} }", ((0, 2), (1, 3))),
    # Iota forms: the reference's numerically verified table.
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
    # Mesh forms: devices varying along the listed axes.
    ("mesh['x'=2,'y'=4] {'x'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['x'=2,'y'=4] {'y'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['x'=2,'y'=4] {'y','x'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ("mesh[x=2,y=4] {x}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['x'=2,'y'=4], device_ids=(7,6,5,4,3,2,1,0) {'y'}", ((7, 6, 5, 4), (3, 2, 1, 0))),
    # Sub-axis 'x':(pre)size of an axis of 8: reshape [8] -> [pre, size, rest] (row
    # major, as XLA's MeshAxesReplicaGroupList) and group over the middle factor.
    ("mesh['x'=8] {'x':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("mesh['x'=8] {'x':(1)2}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['x'=8] {'x':(1)2,'x':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("mesh['x'=8] {'x':(4)2,'x':(1)2}", ((0, 4, 1, 5), (2, 6, 3, 7))),
])
def test_replica_groups_are_expanded_and_keep_their_text(text, groups):
    value = collective(text)
    assert value == ReplicaGroups(groups, text)


def test_int_lists_slices_and_computation_refs_are_typed():
    module, comp = entry_of(
        "p = f32[8,8] parameter(0)\n"
        "t = f32[8,8] transpose(p), dimensions={1,0}\n"
        "s = f32[4,2] slice(t), slice={[0:4], [0:8:4]}\n"
        "d = f32[4,8] dot(s, t), lhs_contracting_dims={1}, rhs_contracting_dims={}\n"
        "z = f32[] constant(0)\n"
        "ROOT r = f32[4] reduce(d, z), dimensions={1}, to_apply=add",
        callees=ADD)
    assert comp["t"].attributes == {"dimensions": (1, 0)}
    assert comp["s"].attributes["slice"] == SliceRanges(((0, 4, 1), (0, 8, 4)))
    assert comp["d"].attributes["rhs_contracting_dims"] == ()
    assert comp["r"].attributes["to_apply"] == ComputationRef("add")
    assert comp["r"].called_computations() == ["add"]


def test_value_kinds_ints_bools_idents_strings_raw():
    _, comp = entry_of(
        'p = f32[4] parameter(0), sharding={devices=[2,2]<=[4] last_tile_dim_replicate}, '
        'metadata={op_name="a/b" source_line=3}\n'
        'c = pred[4] compare(p, p), direction=LT\n'
        'g = f32[4] custom-call(p), custom_call_target="x\\"y", '
        'custom_call_has_side_effect=true, backend_config={"a":{"b":1}}\n'
        'ROOT s = f32[4] custom-call(g), custom_call_target="z", backend_config="raw \\"s\\""')
    assert comp["p"].attributes["sharding"] == Raw("{devices=[2,2]<=[4] last_tile_dim_replicate}")
    assert comp["p"].attributes["metadata"] == Raw('{op_name="a/b" source_line=3}')
    assert comp["c"].attributes["direction"] == Ident("LT")
    assert comp["g"].attributes["custom_call_target"] == Str('x"y')
    assert comp["g"].attributes["custom_call_has_side_effect"] is True
    assert comp["g"].attributes["backend_config"] == Raw('{"a":{"b":1}}')
    assert comp["s"].attributes["backend_config"] == Raw('"raw \\"s\\""')


def test_conditional_branches_are_a_computation_list():
    callees = "b0 {\n a = f32[] parameter(0)\n ROOT n = f32[] negate(a)\n}\n" \
              "b1 {\n a = f32[] parameter(0)\n ROOT n = f32[] abs(a)\n}"
    _, comp = entry_of("i = s32[] parameter(0)\nx = f32[] parameter(1)\n"
                       "ROOT c = f32[] conditional(i, x, x), branch_computations={b0, %b1}",
                       callees=callees)
    assert comp["c"].attributes["branch_computations"] == ComputationList(("b0", "b1"))


def test_shapes_layouts_and_dynamic_dimensions():
    _, comp = entry_of(
        "a = f32[8,128]{1,0:T(8,128)(2,1)S(1)} parameter(0)\n"
        "b = f32[<=8,?,3] parameter(1)\n"
        "c = (f32[], (s32[2]{0}, pred[])) parameter(2)\n"
        "d = () parameter(3)\n"
        "ROOT e = token[] after-all()")
    assert comp["a"].shape == ArrayShape("f32", (8, 128), (), Layout((1, 0), "T(8,128)(2,1)S(1)"))
    assert comp["b"].shape == ArrayShape("f32", (8, -1, 3), ("<=", "?", ""))
    assert comp["c"].shape == TupleShape((
        ArrayShape("f32", ()),
        TupleShape((ArrayShape("s32", (2,), (), Layout((0,))), ArrayShape("pred", ())))))
    assert comp["d"].shape == TupleShape(())


def test_constants_keep_their_literal_and_parameters_their_number():
    _, comp = entry_of("p = f32[2] parameter(0)\n"
                       "c = f32[2,2] constant({ { 1, nan }, { -inf, -nan(0x7f) } })\n"
                       "e = f32[40] constant({...})\n"
                       "ROOT t = (f32[2], f32[2,2], f32[40]) tuple(p, c, e)")
    assert comp["p"].parameter_number == 0 and comp["p"].opcode == "parameter"
    assert comp["c"].literal == "{ { 1, nan }, { -inf, -nan(0x7f) } }"
    assert comp["c"].opcode == "constant" and not comp["c"].is_elided_constant
    assert comp["e"].is_elided_constant


def test_header_attributes_are_kept_in_order_with_types():
    module = parse(
        "HloModule m, is_scheduled=true, input_output_alias={ {0}: (0, {}, may-alias) }, "
        "entry_computation_layout={(f32[4]{0})->f32[4]{0}}, replica_count=2, "
        "num_partitions=4, frontend_attributes={k=\"v\"}\n"
        "ENTRY e {\n ROOT p = f32[4] parameter(0)\n}\n")
    assert list(module.header) == ["is_scheduled", "input_output_alias",
                                   "entry_computation_layout", "replica_count",
                                   "num_partitions", "frontend_attributes"]
    assert module.is_scheduled is True
    assert module.replica_count == 2 and module.num_partitions == 4
    assert module.header["input_output_alias"] == InputOutputAlias((Alias((0,), 0),))


def test_stack_frames_are_kept_verbatim():
    frames = ('FileNames\n1 "a.py"\n\nFunctionNames\n1 "f"\n\nFileLocations\n'
              '1 {file_name_id=1 function_name_id=1 line=2 end_line=2 column=1 end_column=3}\n'
              '\nStackFrames\n1 {file_location_id=1 parent_frame_id=1}')
    module = parse(f"HloModule m\n\n{frames}\n\nENTRY e {{\n ROOT p = f32[] parameter(0)\n}}\n")
    assert module.stack_frames == frames


def test_source_locations_point_at_each_definition():
    module = parse("HloModule m\nENTRY e {\n  p = f32[] parameter(0)\n"
                   "  ROOT %n = f32[] negate(%p)\n}\n", path="x.hlo")
    comp = module.entry
    assert comp.loc == SourceLoc(2, 7)
    assert comp["p"].loc == SourceLoc(3, 3)
    assert comp["n"].loc == SourceLoc(4, 8)
    assert comp.root_name == "n"


def test_names_without_percent_and_old_operand_shapes_read_alike():
    old = parse("HloModule m\nENTRY %e (p: f32[4]) -> f32[4] {\n"
                "  %p = f32[4]{0} parameter(0)\n"
                "  ROOT %n = f32[4]{0} negate(f32[4]{0} %p)\n}\n")
    new = parse("HloModule m\nENTRY e {\n  p = f32[4]{0} parameter(0)\n"
                "  ROOT n = f32[4]{0} negate(p)\n}\n")
    assert old.entry["n"].operands == new.entry["n"].operands == ["p"]


def test_nested_operands_are_hoisted_with_fresh_names():
    _, comp = entry_of("p = f32[4] parameter(0)\nnegate.anon = f32[4] abs(p)\n"
                       "ROOT r = f32[4] add(f32[4] negate(p), negate(p))")
    assert [i.name for i in comp.instructions] == [
        "p", "negate.anon", "negate.anon.1", "negate.anon.2", "r"]
    assert comp["r"].operands == ["negate.anon.1", "negate.anon.2"]


def test_inline_computation_becomes_a_computation_before_its_caller():
    module, comp = entry_of("p = f32[4] parameter(0)\nz = f32[] constant(0)\n"
                            "ROOT s = f32[] reduce(p, z), dimensions={0}, "
                            "to_apply={ a = f32[] parameter(0) b = f32[] parameter(1) "
                            "ROOT m = f32[] maximum(a, b) }")
    assert [c.name for c in module.computations] == ["_", "e"]
    assert comp["s"].attributes["to_apply"] == ComputationRef("_")
    assert module.computation("_").root.opcode == "maximum"


def test_module_without_header_or_entry_mark():
    module = parse(ADD + "\nmain {\n p = f32[4] parameter(0)\n z = f32[] constant(0)\n"
                   " ROOT s = f32[] reduce(p, z), dimensions={0}, to_apply=add\n}\n")
    assert module.name == "module_main"
    assert module.entry.name == "main" and module.entry.is_entry


def test_omitted_result_shapes_are_inferred_where_xla_allows():
    _, comp = entry_of("p = f32[4] parameter(0)\nq = f32[4] parameter(1)\n"
                       "s = add(p, q)\nc = compare(p, q), direction=LT\nid = replica-id()\n"
                       "ROOT t = tuple(s, c, id)")
    assert comp["s"].shape == ArrayShape("f32", (4,))
    assert comp["c"].shape == ArrayShape("pred", (4,))
    assert comp["t"].shape == TupleShape((ArrayShape("f32", (4,)), ArrayShape("pred", (4,)),
                                          ArrayShape("u32", ())))


def test_inferred_shapes_follow_the_opcode_table():
    """is-finite gives ``pred`` and clamp its middle operand's shape (scalar bounds), as
    in XLA: the parser read them as the first operand's before it used ``OpInfo``."""
    _, comp = entry_of("p = f32[4] parameter(0)\nlo = f32[] constant(0)\n"
                       "f = is-finite(p)\nk = clamp(lo, p, lo)\nn = negate(p)\n"
                       "ROOT t = tuple(f, k, n)")
    assert comp["f"].shape == ArrayShape("pred", (4,))
    assert comp["k"].shape == ArrayShape("f32", (4,)) == comp["n"].shape


def test_async_sugar_and_historical_opcode():
    _, comp = entry_of("p = f32[8] parameter(0)\n"
                       "s = ((f32[8]), f32[4]) reduce-scatter-start(p), replica_groups={{0,1}}, "
                       "dimensions={0}, to_apply=add\n"
                       "d = f32[4] reduce-scatter-done(s)\n"
                       "ROOT a = f32[4] cross-replica-sum(d), to_apply=add", callees=ADD)
    assert comp["s"].opcode == "reduce-scatter-start"
    assert comp["a"].opcode == "all-reduce"


def test_what_xla_accepts_at_the_edges_is_read():
    """Attributes and literal values XLA's parser accepts just inside its limits."""
    _, comp = entry_of(
        "p = f32[4] parameter(0)\n"
        "s = ((f32[4]), f32[4], u32[]) all-to-all-start(p), dimensions={0}, "
        "async_execution_thread=\"t\", metadata={,op_name='a', source_line=-2147483648 "
        "profile_type={1, 2} stack_frame_id=1}\n"
        "d = f32[4] all-to-all-done(s), async_execution_thread=\"t\"\n"
        "e = f32[4] exponential(p), result_accuracy={tolerance={atol=0,rtol=0,ulps=1}}\n"
        "a = s8[2] constant({-128, 127})\nb = u64[2] constant({-1, 18446744073709551615})\n"
        "c = f16[3] constant({65504, -65519, nan(0x3ff)})\nf = pred[3] constant({true, 0, 2})\n"
        "g = f8e8m0fnu[2] constant({1e-50, 2e38})\nh = f4e2m1fn[] constant(100)\n"
        "i = f32[2,0] constant({ {}, {} })\nj = f32[2,2] constant({{1, 2},{3,4},})\n"
        "k = c64[2] constant({(1, nan(0x1)), (-inf, 3.4e38)})\nl = f32[3] constant({1, ...})\n"
        "ROOT t = () tuple()")
    assert comp["s"].attributes["async_execution_thread"] == Str("t")
    assert comp["b"].literal == "{-1, 18446744073709551615}"


def test_execution_thread_and_comments_anywhere():
    module = parse("/* c */ HloModule /* c */ m // c\n"
                   "%t /* c */ (a: f32[]) -> f32[] {\n ROOT %a = f32[] /* c */ parameter(0)\n"
                   "}, execution_thread=\"host\"\n"
                   "ENTRY e {\n ROOT p = f32[] parameter(0) // c\n}\n")
    assert module.computation("t").execution_thread == "host"


# The coarse tokens (LINE, HEAD, CALL, ATTRS, ...) are a speed-up only: with them
# switched off the fine-grained rules must read every file to the very same module.
COARSE_TOKENS = {"LINE", "HEAD", "CALL", "ATTRS", "SIGNATURE", "PARAMETER_CALL",
                 "CONSTANT_CALL"}
ROOT_DIR = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT_DIR / "tests" / "golden").glob("**/*.hlo")) + sorted(
    (ROOT_DIR / "fixtures").glob("*/*.n4.hlo"))


@pytest.fixture(scope="module")
def fine_grained_parser():
    from lark.lexer import PatternRE

    from hlo_shard import parser

    def switch_off(terminal):
        if terminal.name in COARSE_TOKENS:
            terminal.pattern = PatternRE("\x00never\x00")

    parser._patterns()  # the cutting regexes come from the real grammar
    return parser._make_parser(edit_terminals=switch_off)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT_DIR)))
def test_coarse_tokens_do_not_change_the_module(path, fine_grained_parser, monkeypatch):
    from hlo_shard import parser, to_text

    text = path.read_text()
    coarse = parse(text)
    monkeypatch.setattr(parser._PER_THREAD, "lark", fine_grained_parser)
    fine = parse(text)
    assert to_text(fine) == to_text(coarse)
    assert [(i.name, i.loc) for c in fine.computations for i in c.instructions] == [
        (i.name, i.loc) for c in coarse.computations for i in c.instructions]


# Parser state is per call: threads parse at once, and nothing leaks between calls.

def test_threads_parse_concurrently_each_its_own_module():
    import threading

    texts = {n: f"HloModule m{n}\nENTRY e{n} {{\n  ROOT p{n} = f32[{n}] parameter(0)\n}}\n"
             for n in range(1, 9)}
    results: dict[int, object] = {}
    start = threading.Barrier(len(texts))

    def read(n: int) -> None:
        start.wait()
        for _ in range(20):
            results[n] = parse(texts[n])

    threads = [threading.Thread(target=read, args=(n,)) for n in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {n: (m.name, m.entry.root.shape.dims) for n, m in results.items()} == {
        n: (f"m{n}", (n,)) for n in texts}


def test_a_failed_parse_leaves_nothing_for_the_next():
    with pytest.raises(HloParseError):
        parse("HloModule a\nc {\n  ROOT x = f32[] parameter(0)\n}\nENTRY e {\n  ROOT y = f32[]"
              " call(f32[] parameter(0)), to_apply=c\n  bad\n")
    module = parse("HloModule b\nc {\n  ROOT z = f32[] parameter(0)\n}\n")
    assert [c.name for c in module.computations] == ["c"]


def _in_a_fresh_process(check: str) -> None:
    """Run this file's ``check`` in a new interpreter: the collector's pause depends on
    the threads of the process, and a test runner may have started some of its own."""
    import subprocess
    import sys

    code = (f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}]; "
            f"import {Path(__file__).stem} as tests; tests.{check}()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_cycle_collector_is_left_as_the_caller_had_it():
    """Paused during a parse only while no other thread runs; restored as it was."""
    _in_a_fresh_process("_collector_left_as_it_was")


def _collector_left_as_it_was() -> None:
    import gc
    import threading

    from hlo_shard.parser import cyclic_gc_paused

    text = "HloModule m\nENTRY e {\n  ROOT p = f32[] parameter(0)\n}\n"
    assert threading.active_count() == 1
    gc.disable()
    try:
        parse(text)
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    hold = threading.Event()
    other = threading.Thread(target=hold.wait)
    other.start()
    try:
        with cyclic_gc_paused():
            assert gc.isenabled()
        parse(text)
    finally:
        hold.set()
        other.join()
    assert gc.isenabled()


def test_a_callback_thread_pauses_the_collector_while_its_caller_waits():
    """XLA calls the jax hook on a thread Python did not start while the Python thread
    that asked for the compile waits: with ``caller_waits`` that one thread is not
    counted, any other Python thread is (and without it, every thread is)."""
    _in_a_fresh_process("_callback_thread_pauses")


def _callback_thread_pauses() -> None:
    import _thread
    import gc
    import threading

    from hlo_shard.parser import cyclic_gc_paused

    def from_a_foreign_thread(check) -> list:
        seen: list = []
        done = threading.Event()

        def run() -> None:  # not a threading.Thread: current_thread() is a dummy
            try:
                seen.append(check())
            finally:
                done.set()

        _thread.start_new_thread(run, ())
        assert done.wait(30)
        return seen

    def paused(caller_waits: bool):
        def check() -> bool:
            with cyclic_gc_paused(caller_waits=caller_waits):
                return not gc.isenabled()
        return check

    assert threading.active_count() == 1
    assert from_a_foreign_thread(paused(True)) == [True]
    assert from_a_foreign_thread(paused(False)) == [False]
    assert gc.isenabled()
    hold = threading.Event()
    other = threading.Thread(target=hold.wait)
    other.start()
    try:
        assert from_a_foreign_thread(paused(True)) == [False]
    finally:
        hold.set()
        other.join()
    with cyclic_gc_paused(caller_waits=True):  # from the main thread: as without it
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_shape_cache_is_bounded(monkeypatch):
    from hlo_shard import parser

    monkeypatch.setattr(parser, "_SHAPE_CACHE_LIMIT", 4)
    monkeypatch.setattr(parser, "_SHAPE_CACHE", {})
    body = "\n".join(f"  p{n} = f32[{n + 1}] parameter({n})" for n in range(10))
    module = parse(f"HloModule m\nENTRY e {{\n{body}\n  ROOT t = () tuple()\n}}\n")
    assert len(parser._SHAPE_CACHE) <= 4
    assert [i.shape.dims for i in module.entry.instructions[:10]] == [(n + 1,) for n in range(10)]
