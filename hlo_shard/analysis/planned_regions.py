"""The weight-update region the sharding pass plans, per computation, for the cost model.

:func:`~hlo_shard.costmodel.step_time.estimate_step` counts these instructions as the
weight update but never runs the pass's analysis itself: its caller does, here, and
hands the result in. So an error of the analysis surfaces where it happens instead of
silently turning the report to its fallback, and the cost model does not depend on the
pass.
"""

from __future__ import annotations

from hlo_shard.analysis.collectives import GradientAllReduce, find_gradient_all_reduces
from hlo_shard.analysis.replication import analyze_replication
from hlo_shard.analysis.update_region import collect_leaves, plan_region
from hlo_shard.graph import reading_only
from hlo_shard.ir import Module


def planned_update_regions(module: Module) -> dict[str, frozenset[str]]:
    """Computation name → the instructions of the update region the pass plans there.

    A computation the pass does not apply to — no candidate gradient all-reduce, or
    none whose gradient it could follow (no leaves) — has no entry: the cost model
    then finds the update by its own fallback rule."""
    with reading_only():  # the analyses below read the same computations
        return _planned_update_regions(module)


def _planned_update_regions(module: Module) -> dict[str, frozenset[str]]:
    candidates: dict[str, list[GradientAllReduce]] = {}
    for found in find_gradient_all_reduces(module):
        if found.is_candidate:
            candidates.setdefault(found.computation, []).append(found)
    regions: dict[str, frozenset[str]] = {}
    for name, all_reduces in candidates.items():
        comp = module.computation(name)
        leaves, _ = collect_leaves(module, comp, all_reduces)
        if not leaves:
            continue
        facts = analyze_replication(module, leaves[0].groups)
        regions[name] = frozenset(plan_region(module, comp, leaves, facts).ops)
    return regions
