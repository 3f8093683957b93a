"""The region planner is a function: it returns a plan and changes none of its inputs
(the module, the candidate leaves), and planning again gives the same plan."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest

from hlo_shard.analysis.collectives import find_gradient_all_reduces
from hlo_shard.analysis.replication import analyze_replication
from hlo_shard.passes.weight_update.analysis import (Leaf, OpKind, RegionOptions, collect_leaves,
                                                     plan_region)
from hlo_shard.parser import parse
from hlo_shard.printer import to_text

from wus_helpers import ADD, find, optimize, row

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures").glob("*/*.hlo"))


def _regions(module):
    """(computation, its candidate leaves, the replication facts) per computation."""
    by_comp = defaultdict(list)
    for ar in find_gradient_all_reduces(module):
        if ar.is_candidate:
            by_comp[ar.computation].append(ar)
    for name, ars in by_comp.items():
        comp = module.computation(name)
        leaves, _ = collect_leaves(module, comp, ars)
        if leaves:
            yield comp, leaves, analyze_replication(module, leaves[0].groups)


@pytest.mark.parametrize("path", FIXTURES, ids=[f"{p.parent.name}/{p.name}" for p in FIXTURES])
@pytest.mark.parametrize("options", [RegionOptions(), RegionOptions(4096, True)],
                         ids=["default", "min4096-state"])
def test_planning_changes_none_of_its_inputs(path, options):
    module = parse(path.read_text())
    text = to_text(module)
    planned = 0
    for comp, leaves, replication in _regions(module):
        before = [dataclasses.replace(leaf) for leaf in leaves]
        plan = plan_region(module, comp, leaves, replication, options)
        assert leaves == before
        assert to_text(module) == text
        # The plan answers for every leaf, in order, and is the same when planned again.
        assert [(p.all_reduce, p.index, p.values) for p in plan.leaves] == \
            [(leaf.all_reduce, leaf.index, leaf.values) for leaf in leaves]
        assert plan_region(module, comp, leaves, replication, options) == plan
        for leaf in plan.leaves:
            assert (leaf.sharded and leaf.ops_moved > 0 and not leaf.reason) or \
                (not leaf.sharded and leaf.reason), leaf
        planned += 1
    if path.parent.name == "spmd":
        assert planned, "every SPMD fixture has a gradient all-reduce to plan"


def test_leaves_and_plans_are_frozen():
    module = parse(FIXTURES[0].read_text())
    comp, leaves, replication = next(_regions(module))
    plan = plan_region(module, comp, leaves, replication)
    with pytest.raises(dataclasses.FrozenInstanceError):
        leaves[0].values = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.leaves[0].sharded = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.ops = {}  # type: ignore[misc]
    assert isinstance(plan.leaves[0], Leaf)


def _update(user: str) -> str:
    """An SGD step whose update goes through ``user`` (an op of ``ar``, the gradient)."""
    return f"""HloModule m, replica_count=4
{ADD}
sq {{ x = f32[] parameter(0) ROOT y = f32[] multiply(x, x) }}
ENTRY e {{ w = f32[1024] parameter(0) g = f32[1024] parameter(1) bits = u32[1024] parameter(2)
 ar = f32[1024] all-reduce(g), replica_groups={{{{0,1,2,3}}}}, to_apply=add
 {user}
 ROOT nw = f32[1024] subtract(w, v) }}
"""


#: XLA:CPU converts stochastically from floats to integers only.
STOCHASTIC = _update("h = s32[1024] stochastic-convert(ar, bits) v = f32[1024] convert(h)")


#: An update through each kind of region op: a view (reshape and back), an elementwise op,
#: a reduction over size-1 dimensions only (a view too), a norm (reduced to one element).
KINDS = f"""HloModule m, replica_count=4
{ADD}
ENTRY e {{ w = f32[8,128] parameter(0) g = f32[8,128] parameter(1)
 ar = f32[8,128] all-reduce(g), replica_groups={{{{0,1,2,3}}}}, to_apply=add
 flat = f32[1024] reshape(ar) back = f32[8,128] reshape(flat)
 sq = f32[8,128] multiply(back, back) zero = f32[] constant(0)
 wide = f32[1,8,128] reshape(sq) narrow = f32[8,128] reduce(wide, zero), dimensions={{0}}, to_apply=add
 norm = f32[] reduce(sq, zero), dimensions={{0,1}}, to_apply=add
 scale = f32[8,128] broadcast(norm), dimensions={{}} upd = f32[8,128] multiply(narrow, scale)
 ROOT nw = f32[8,128] subtract(w, upd) }}
"""


def test_the_analysis_decides_each_op_s_kind():
    """The kind is an enum the rules choose and the lowering follows: a reduction over
    size-1 dimensions is a view like a reshape (the lowering used to tell them apart by
    opcode again), a reduction to one element is a reduction."""
    module = parse(KINDS)
    (comp, leaves, replication), = _regions(module)
    ops = plan_region(module, comp, leaves, replication).ops
    assert {name: op.kind for name, op in ops.items()} == {
        "flat": OpKind.VIEW, "back": OpKind.VIEW, "sq": OpKind.ELEMENTWISE,
        "wide": OpKind.VIEW, "narrow": OpKind.VIEW, "norm": OpKind.REDUCE,
        "upd": OpKind.ELEMENTWISE, "nw": OpKind.ELEMENTWISE}
    optimized, report = optimize(KINDS)
    assert row(report, "ar").sharded
    assert [i.shape.dims for i in find(optimized, "reshape") + find(optimized, "reduce")
            if i.name.startswith(("flat", "back", "wide", "narrow"))] == []


def test_the_table_s_elementwise_ops_run_on_shards_but_map():
    """stochastic-convert is elementwise in the table (the region analysis' own list
    lacked it); map is too, but its dimensions= name the full value's, so it ends the
    region and its operand is gathered."""
    module, report = optimize(STOCHASTIC)
    assert row(report, "ar").sharded and row(report, "ar").ops_moved == 3
    (sc,) = find(module, "stochastic-convert")
    assert sc.shape.dims == (256,)
    module, report = optimize(_update(
        "v = f32[1024] map(ar), dimensions={0}, to_apply=sq"))
    assert not row(report, "ar").sharded
    assert find(module, "map")[0].shape.dims == (1024,)


def test_a_stochastic_convert_on_shards_computes_what_it_did_whole(tmp_path):
    """Through real XLA on 4 CPU devices (random bits per step: the same on both sides)."""
    from click.testing import CliRunner

    from hlo_shard.cli.app import main

    original, optimized = tmp_path / "sc.hlo", tmp_path / "sc.opt.hlo"
    original.write_text(STOCHASTIC)
    runner = CliRunner()
    result = runner.invoke(main, ["optimize", str(original), "-o", str(optimized), "--force"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["verify", str(original), str(optimized), "-q"])
    assert result.exit_code == 0 and "MATCH" in result.output, result.output
