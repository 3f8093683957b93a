"""The analyses behind the weight-update pass: gradient all-reduces and their groups,
replication, and the shard format's element-order algebra."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hlo_shard.analysis.collectives import (GroupMode, device_groups, find_gradient_all_reduces,
                                            neutral_literal, participant_id_source)
from hlo_shard.analysis.replication import ParamOverrides, analyze_replication
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update.analysis import (reshape_format, transpose_operand,
                                                     transpose_result)
from hlo_shard.shard_format import ShardFormat

from wus_helpers import ADD


def module_with(collective: str, header: str = "replica_count=8") -> tuple:
    module = parse(f"HloModule m, {header}\n{ADD}\nENTRY e {{ g = f32[8] parameter(0)\n"
                   f" ROOT ar = f32[8] {collective} }}\n")
    return module, module.entry["ar"]


@pytest.mark.parametrize("attrs, mode, groups", [
    ("replica_groups={{0,1,2,3,4,5,6,7}}", GroupMode.CROSS_REPLICA, ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("replica_groups={}", GroupMode.CROSS_REPLICA, ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", GroupMode.CROSS_REPLICA, ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true",
     GroupMode.FLATTENED_ID, ((0, 4), (1, 5), (2, 6), (3, 7))),
])
def test_group_forms_expand_to_explicit_groups(attrs, mode, groups):
    module, inst = module_with(f"all-reduce(g), {attrs}, to_apply=add")
    found = device_groups(inst, module)
    assert found.mode is mode and found.groups == groups
    table = found.position_table()
    for group in groups:
        assert [table[d] for d in group] == list(range(len(group)))


def test_participant_id_follows_the_module_form():
    spmd, _ = module_with("all-reduce(g), channel_id=1, replica_groups={{0,1}}, "
                          "use_global_device_ids=true, to_apply=add", "num_partitions=2")
    assert participant_id_source(spmd, GroupMode.FLATTENED_ID) == "partition-id"
    replica, _ = module_with("all-reduce(g), replica_groups={{0,1}}, to_apply=add")
    assert participant_id_source(replica, GroupMode.CROSS_REPLICA) == "replica-id"


def test_only_sum_all_reduces_over_several_devices_are_gradients():
    text = f"""HloModule m, replica_count=4
{ADD}
mx {{ x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] maximum(x, y) }}
ENTRY e {{ g = f32[8] parameter(0)
 a = f32[8] all-reduce(g), replica_groups={{{{0,1,2,3}}}}, to_apply=add
 b = f32[8] all-reduce(g), replica_groups={{{{0,1,2,3}}}}, to_apply=mx
 c = f32[8] all-reduce(g), replica_groups={{{{0}},{{1}},{{2}},{{3}}}}, to_apply=add
 d = f32[8] all-reduce(g), replica_groups={{{{0,1,2}},{{3}}}}, to_apply=add
 ROOT t = (f32[8], f32[8], f32[8], f32[8]) tuple(a, b, c, d) }}
"""
    found = {ar.name: ar for ar in find_gradient_all_reduces(parse(text))}
    assert set(found) == {"a", "d"}
    assert found["a"].is_candidate and "different sizes" in found["d"].reason


@pytest.mark.parametrize("reducer, element_type, literal", [
    ("add", "f32", "0"), ("maximum", "f32", "-inf"), ("minimum", "bf16", "inf"),
    ("maximum", "s32", "-2147483648"), ("minimum", "u8", "255"), ("and", "pred", "true"),
    ("or", "pred", "false"), ("multiply", "f16", "1"),
])
def test_neutral_values_of_reducers(reducer, element_type, literal):
    assert neutral_literal(reducer, element_type) == literal


REPLICATION = f"""HloModule r, num_partitions=4
{ADD}
body {{ p = (f32[4], f32[4]) parameter(0) a = f32[4] get-tuple-element(p), index=0
 b = f32[4] get-tuple-element(p), index=1 n = f32[4] add(a, b)
 ROOT t = (f32[4], f32[4]) tuple(n, b) }}
cond {{ p = (f32[4], f32[4]) parameter(0) ROOT c = pred[] constant(false) }}
ENTRY e {{ w = f32[4] parameter(0), sharding={{replicated}}
 x = f32[4] parameter(1), sharding={{devices=[4]<=[4]}}
 h = f32[4] parameter(2), sharding={{devices=[2,2]<=[4] last_tile_dim_replicate}}
 pid = u32[] partition-id() f = f32[] convert(pid) fb = f32[4] broadcast(f), dimensions={{}}
 tainted = f32[4] add(w, fb)
 s = f32[4] all-reduce(x), channel_id=1, replica_groups={{{{0,1,2,3}}}}, use_global_device_ids=true, to_apply=add
 init = (f32[4], f32[4]) tuple(w, x) loop = (f32[4], f32[4]) while(init), condition=cond, body=body
 ROOT t = (f32[4], f32[4], f32[4], f32[4], (f32[4], f32[4])) tuple(w, h, tainted, s, loop) }}
"""


def test_replication_facts():
    module = parse(REPLICATION)
    facts = analyze_replication(module)
    entry = module.entry.name
    assert facts.is_replicated(entry, "w") and not facts.is_replicated(entry, "x")
    assert not facts.is_replicated(entry, "tainted")  # depends on partition-id
    assert facts.is_replicated(entry, "s")  # all-reduce over every device
    # replicated within pairs {0,1} {2,3} only: not across all four devices
    assert not facts.is_replicated(entry, "h")
    # loop fixpoint: slot 0 accumulates the per-device slot 1
    assert facts.flags(entry, "loop") == (False, False)
    assert facts.is_replicated("body", "b") is False


def test_replication_relative_to_subgroups_and_overrides():
    module = parse(REPLICATION)
    pairs = device_groups(parse(REPLICATION.replace(
        "replica_groups={{0,1,2,3}}", "replica_groups={{0,1},{2,3}}")).entry["s"], module)
    facts = analyze_replication(module, pairs, ParamOverrides(per_device=frozenset({0})))
    assert facts.is_replicated(module.entry.name, "h")  # replicated within each pair
    assert not facts.is_replicated(module.entry.name, "w")  # the flag wins
    assert [p.source for p in facts.params] == ["flag", "sharding", "sharding"]


def _order(fmt: ShardFormat) -> np.ndarray:
    """Flat element order of a format, as logical indices of the full value."""
    return np.arange(fmt.elements).reshape(fmt.dims).transpose(fmt.perm).ravel()


@pytest.mark.parametrize("dims", [(2, 3), (2, 3, 4), (1, 5, 3)])
def test_transposes_keep_the_shard_order(dims):
    for perm, permutation in itertools.product(itertools.permutations(range(len(dims))),
                                               itertools.permutations(range(len(dims)))):
        fmt = ShardFormat(dims, perm, 2)
        result = transpose_result(fmt, permutation)
        values = np.arange(fmt.elements).reshape(dims)
        transposed = values.transpose(permutation)
        assert (transposed.transpose(result.perm).ravel() == values.transpose(perm).ravel()).all()
        back = transpose_operand(result, permutation, dims)
        assert (_order(back) == _order(fmt)).all()


def test_reshapes_keep_the_order_only_when_it_exists():
    row_major = ShardFormat((4, 6), (0, 1), 3)
    assert reshape_format(row_major, (2, 12)).perm == (0, 1)
    column = ShardFormat((4, 6), (1, 0), 3)
    assert reshape_format(column, (2, 12)) is None
    squeezed = reshape_format(ShardFormat((1, 4, 6), (0, 2, 1), 3), (4, 6))
    assert squeezed is not None and squeezed.perm == (1, 0)


def test_a_reshape_adding_a_unit_dimension_orders_it_too():
    """A transposed gradient reshaped to ``[1, …]`` (a scan's per-layer slice, written
    into the stacked gradient): the new size-1 dimension is in the result's order, which
    then still describes every dimension."""
    column = ShardFormat((512, 256), (1, 0), 8)
    stacked = reshape_format(column, (1, 512, 256))
    assert stacked is not None and stacked.perm == (0, 2, 1)
    assert stacked.transposed_dims == (1, 256, 512)


def test_a_format_orders_every_dimension():
    with pytest.raises(ValueError, match="not an order of the dimensions"):
        ShardFormat((1, 512, 256), (2, 1), 8)


def test_shard_lengths_and_padding():
    fmt = ShardFormat.of(parse("HloModule m\nENTRY e { ROOT p = f32[10,3] parameter(0) }\n")
                         .entry.root.shape, 4)
    assert (fmt.shard_len, fmt.padded, fmt.padding) == (8, 32, 2)


def test_default_analysis_follows_the_loop_carry_slot_by_slot():
    from test_pass_weight_update import LOOP

    module = parse(LOOP.replace(", parameter_replication={false}", ""))
    found = find_gradient_all_reduces(module)
    facts = analyze_replication(module, found[0].groups,
                                gradient_sources={"body": {"ar"}, module.entry.name: {"r"}})
    # w meets the reduced gradient in the body's update; x only feeds the gradient
    assert [(p.flags, p.source) for p in facts.params] == [(True, "analysis"),
                                                          (False, "analysis")]


#: A (data=4, model=2) mesh's global norm: each device's tensor-parallel half of a
#: gradient, all-reduced over the data groups {0,2,4,6} {1,3,5,7}, squared and summed,
#: then the halves' sums all-reduced over the model pairs {0,1} {2,3} …
MODEL_AXIS_NORM = """HloModule norm, num_partitions=8

add { a = f32[] parameter(0) b = f32[] parameter(1) ROOT s = f32[] add(a, b) }

ENTRY e {
  g = f32[16] parameter(0), sharding={devices=[8]<=[8]}
  gs = f32[16] all-reduce(g), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=add
  sq = f32[16] multiply(gs, gs)
  z = f32[] constant(0)
  half = f32[] reduce(sq, z), dimensions={0}, to_apply=add
  norm = f32[] all-reduce(half), channel_id=2, replica_groups={MODEL}, use_global_device_ids=true, to_apply=add
  local = f32[] reduce(g, z), dimensions={0}, to_apply=add
  mixed = f32[] all-reduce(local), channel_id=3, replica_groups={MODEL}, use_global_device_ids=true, to_apply=add
  ROOT out = (f32[], f32[]) tuple(norm, mixed)
}
"""


@pytest.mark.parametrize("model, replicated", [
    ("{{0,1},{2,3},{4,5},{6,7}}", True),
    # Devices 0 and 2 (one data group) read their pair in opposite data-group orders.
    ("{{0,1},{3,2},{4,5},{6,7}}", False),
    # Pairs within one data group: device 0 sums two values of its group, device 1 too,
    # but devices 0 and 4 (one data group) read the same: still the same result.
    ("{{0,2},{1,3},{4,6},{5,7}}", True),
], ids=["model-pairs", "reordered-pair", "pairs-within-groups"])
def test_a_collective_over_other_groups_of_data_replicated_values_stays_replicated(
        model, replicated):
    """Every device of a data-parallel group reads, position by position, devices of the
    same data-parallel groups: the same values in the same order, so the same result
    (the partial norms of a tensor-parallel gradient summed over the model axis). A
    per-device operand stays per-device whatever the groups."""
    module = parse(MODEL_AXIS_NORM.replace("{MODEL}", model))
    facts = analyze_replication(module, device_groups(module.entry["gs"], module))
    assert facts.is_replicated(module.entry.name, "half")
    assert facts.is_replicated(module.entry.name, "norm") == replicated
    assert not facts.is_replicated(module.entry.name, "mixed")


def test_the_update_region_is_planned_on_a_module_whose_header_lost_its_device_counts():
    """XLA's pass hook hands modules over without ``num_partitions``: the region the cost
    model counts as the weight update is the one the pass plans once it recovers the
    count, not none (which left ``report`` calling the update forward/backward work)."""
    from pathlib import Path

    from hlo_shard.passes.weight_update import planned_update_regions

    text = (Path(__file__).parent.parent / "fixtures" / "spmd" / "adam.n8.hlo").read_text()
    headless = text.replace(", num_partitions=8", "", 1)
    assert headless != text
    regions = planned_update_regions(parse(headless))
    assert regions and regions == planned_update_regions(parse(text))


def test_a_module_sharded_throughout_plans_no_region_without_the_analysis(monkeypatch) -> None:
    """The gate prices its trial sharding every gradient: where no all-reduce the pass
    could shard is left, there is no region to plan, and the replication analysis (most
    of the planning) is not run for nothing; where one is left it is."""
    from hlo_shard.passes.sharding_pipeline import run_sharding
    from hlo_shard.passes.weight_update import (ShardingOptions, WeightUpdateSharding,
                                                analysis, planned_update_regions)

    module = parse("""HloModule sgd, replica_count=2
add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT s = f32[] add(x, y) }
ENTRY e { w = f32[8] parameter(0) g = f32[8] parameter(1)
 ar = f32[8] all-reduce(g), replica_groups={{0,1}}, to_apply=add
 ROOT nw = f32[8] subtract(w, ar) }
""")
    sharded = module.clone()
    report = run_sharding(sharded, WeightUpdateSharding(ShardingOptions()))
    assert [row.sharded for row in report.explanations] == [True]
    ran: list[object] = []
    replication = analysis.analyze_replication
    monkeypatch.setattr(analysis, "analyze_replication",
                        lambda *args: ran.append(args) or replication(*args))
    assert planned_update_regions(sharded) == {} and ran == []
    assert planned_update_regions(module) == {"e": frozenset({"nw"})} and ran


@pytest.mark.parametrize("fixture, shares", [
    # Nothing before the pass changes these (a module XLA optimized, as the pass hook
    # hands it over, and a pmap step): the regions it planned are the input's.
    ("optimized/adam.n4.hlo", True), ("replica/momentum.n4.hlo", True),
    # Tuple forwarding rewrites shard_map's tuples first: the pass planned on another
    # module, so the gate must plan the input's regions itself.
    ("spmd/sgd.n8.hlo", False),
])
def test_the_pass_reports_the_regions_planned_update_regions_finds(fixture: str,
                                                                    shares: bool) -> None:
    """The speed gate prices the input with the regions its first trial's pass planned
    instead of planning them again: the pass reports them only where they are exactly
    ``planned_update_regions`` of the module the pipeline was handed."""
    from pathlib import Path

    from hlo_shard.passes.sharding_pipeline import run_sharding
    from hlo_shard.passes.weight_update import (ShardingOptions, WeightUpdateSharding,
                                                planned_update_regions)

    module = parse((Path(__file__).parent.parent / "fixtures" / fixture).read_text())
    expected = planned_update_regions(module)
    report = run_sharding(module.clone(), WeightUpdateSharding(ShardingOptions()))
    assert report.input_regions == (expected if shares else None)
    if shares:
        assert expected  # a real region, not two empty answers
    # A size cut-off plans smaller regions: not the input's.
    cut = run_sharding(module.clone(),
                       WeightUpdateSharding(ShardingOptions(min_shard_bytes=1 << 30)))
    assert cut.input_regions is None


def test_the_gate_prices_the_input_as_planned_update_regions_does() -> None:
    """The input's predicted step in the gate's decision is the one planning the regions
    afresh gives, where the gate took them from its trial."""
    from pathlib import Path

    from hlo_shard.passes.speed_gate import predicted_step_seconds, shard_where_faster
    from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding

    module = parse((Path(__file__).parent.parent / "fixtures" / "optimized" / "adam.n4.hlo")
                   .read_text())
    sharding = WeightUpdateSharding(ShardingOptions())
    expected = predicted_step_seconds(module, sharding.profile)
    _, decision = shard_where_faster(module.clone(), sharding)
    assert decision.before_s == expected
