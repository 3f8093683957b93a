"""The region planner is a function: it returns a plan and changes none of its inputs
(the module, the candidate leaves), and planning again gives the same plan."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest

from hlo_shard.analysis.collectives import find_gradient_all_reduces
from hlo_shard.analysis.replication import analyze_replication
from hlo_shard.analysis.update_region import Leaf, RegionOptions, collect_leaves, plan_region
from hlo_shard.parser import parse
from hlo_shard.printer import to_text

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
