"""The speed gate prices its trial, an edited copy of the input, with the input's cost
totals wherever the rewrite left a computation as it was (costmodel/flops.py
``EarlierCosts``): the prices must be exactly those of a fresh analysis."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlo_shard.costmodel.flops import CostAnalysis, EarlierCosts
from hlo_shard.graph import ModuleRewriter
from hlo_shard.ir import ArrayShape, Module
from hlo_shard.parser import parse, parse_file
from hlo_shard.passes.pipeline import edited_computations
from hlo_shard.passes.sharding_pipeline import run_sharding
from hlo_shard.passes.speed_gate import predicted_step
from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding
from hlo_shard.profiles import HardwareProfile, load_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CASES = sorted(str(p.relative_to(FIXTURES)) for p in (FIXTURES / "optimized").glob("*.hlo")) \
    + ["spmd/loop_adam.n4.hlo", "replica/transformer.n8.hlo"]


def _input_and_trial(fixture: str) -> tuple[Module, HardwareProfile, Module, set[str]]:
    """The fixture, the profile, a copy the sharding pipeline rewrote, and the
    computations the pipeline edited in it."""
    module = parse_file(FIXTURES / fixture)
    hardware = load_profile("cpu-local")
    candidate = module.clone()
    edited: set[str] = set()
    run_sharding(candidate, WeightUpdateSharding(ShardingOptions(profile=hardware)),
                 lambda step, result: edited.update(edited_computations(result.changes)))
    return module, hardware, candidate, edited


@pytest.mark.parametrize("fixture", CASES)
def test_the_trial_priced_with_the_inputs_totals_is_priced_as_afresh(fixture: str) -> None:
    module, hardware, candidate, edited = _input_and_trial(fixture)
    whole = predicted_step(module, hardware)
    fresh = predicted_step(candidate, hardware)
    reused = predicted_step(candidate, hardware,
                            earlier=EarlierCosts(whole.model, frozenset(edited)))
    assert reused.seconds == fresh.seconds
    assert [(i.computation, i.name, i.seconds, i.cost) for i in reused.instructions] == \
        [(i.computation, i.name, i.seconds, i.cost) for i in fresh.instructions]
    if fixture.startswith("optimized/"):  # fusions whose bodies the rewrite left alone
        assert any(reused.model._fusions[name] is price
                   for name, price in whole.model._fusions.items()
                   if name in reused.model._fusions)


LOOP = """HloModule loop
%body_fused (p: f32[8]) -> f32[8] {
  %p = f32[8] parameter(0)
  ROOT %m = f32[8] multiply(%p, %p)
}
%other_fused (q: f32[8]) -> f32[8] {
  %q = f32[8] parameter(0)
  ROOT %n = f32[8] negate(%q)
}
%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8] get-tuple-element(%t), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %y = f32[8] fusion(%x), kind=kLoop, calls=%body_fused
  ROOT %r = (s32[], f32[8]) tuple(%j, %y)
}
%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]) parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  %ten = s32[] constant(10)
  ROOT %lt = pred[] compare(%k, %ten), direction=LT
}
ENTRY %e (x: f32[8]) -> f32[8] {
  %x = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]) tuple(%zero, %x)
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  %out = f32[8] get-tuple-element(%w), index=1
  ROOT %z = f32[8] fusion(%out), kind=kLoop, calls=%other_fused
}
"""


def test_a_total_that_read_an_edited_computation_is_summed_again() -> None:
    """The loop's body calls a fusion body the edit changed (a multiply made an
    exponential): neither total is reused, the untouched fusion's is; told nothing was
    edited, the stale totals would be (what the rewrite's log guards against)."""
    module = parse(LOOP)
    earlier = CostAnalysis(module, count_loop_iterations=True)
    before = earlier.module_cost()
    edited = module.clone()
    rewriter = ModuleRewriter(edited)
    fused = edited.computation("body_fused")
    rewriter.rewriter(fused).set_opcode(fused.root, "exponential")
    fresh = CostAnalysis(edited, count_loop_iterations=True)
    reused = CostAnalysis(edited, count_loop_iterations=True,
                          earlier=EarlierCosts(earlier, edited_computations(rewriter.changes)))
    assert reused.module_cost() == fresh.module_cost() != before
    assert fresh.module_cost().transcendentals == 8 * 10
    assert reused._totals["other_fused"] is earlier._totals["other_fused"]
    assert reused._totals["body"] is not earlier._totals["body"]
    stale = CostAnalysis(edited, count_loop_iterations=True,
                         earlier=EarlierCosts(earlier, frozenset()))
    assert stale.module_cost() == before != fresh.module_cost()


def test_totals_summed_under_other_options_are_not_reused() -> None:
    module = parse(LOOP)
    with pytest.raises(ValueError, match="other options"):
        CostAnalysis(module, earlier=EarlierCosts(CostAnalysis(module, count_loop_iterations=True),
                                                  frozenset()))


@pytest.mark.parametrize("path, accumulator", [
    (Path(__file__).parent / "golden_pass" / "reduce_scatter_creation.hlo", "auto"),
    (Path(__file__).parent / "data" / "grad_accum_scan_2x4.n8.hlo", "auto"),  # in a scan
    # each device's rows of a sum accumulated (FSDP's form), moved with "whole"
    ("SLICED", "whole"),
])
def test_the_module_kept_whole_is_priced_with_the_inputs_totals_as_afresh(
        path: Path | str, accumulator: str) -> None:
    """Where the pipeline changes the module without sharding anything (all-reduces moved
    out of an accumulation loop, the partitioner's pairs made reduce-scatters), the gate
    prices that module too, reusing the input's totals: exactly a fresh price."""
    from hlo_shard.passes.reduce_scatter_creation import ReduceScatterCreation
    from hlo_shard.passes.sharding_pipeline import accumulation_motion
    from hlo_shard.passes.speed_gate import _unsharded_estimate
    from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding

    from test_accumulation import SLICED

    module = parse(SLICED) if path == "SLICED" else parse_file(path)
    hardware = load_profile("cpu-local")
    sharding = WeightUpdateSharding(ShardingOptions(profile=hardware, accumulator=accumulator))
    whole = predicted_step(module, hardware)
    reused = _unsharded_estimate(module, sharding, whole)
    assert reused is not None
    fresh_module = module.clone()
    motion = accumulation_motion(sharding).run(fresh_module)
    assert any(move.widened for move in motion.report.moved) == (accumulator == "whole")
    ReduceScatterCreation(hardware).run(fresh_module)
    fresh = predicted_step(fresh_module, hardware)
    assert reused.seconds == fresh.seconds != whole.seconds
    assert [(i.computation, i.name, i.seconds) for i in reused.instructions] == \
        [(i.computation, i.name, i.seconds) for i in fresh.instructions]


def _nested_calls(depth: int) -> str:
    """``depth`` computations, each calling the next; the entry calls the first."""
    parts = ["HloModule nested"]
    for k in reversed(range(depth)):
        inner = (f"  ROOT %r.{k} = f32[8] call(%p.{k}), to_apply=%c.{k + 1}"
                 if k + 1 < depth else f"  ROOT %r.{k} = f32[8] exponential(%p.{k})")
        parts.append(f"%c.{k} (p.{k}: f32[8]) -> f32[8] {{\n  %p.{k} = f32[8] parameter(0)\n"
                     f"{inner}\n}}")
    parts.append("ENTRY %e (x: f32[8]) -> f32[8] {\n  %x = f32[8] parameter(0)\n"
                 "  ROOT %y = f32[8] call(%x), to_apply=%c.0\n}")
    return "\n".join(parts) + "\n"


def test_what_each_total_read_is_kept_once_whatever_the_nesting() -> None:
    """Each total keeps the computations it read directly (one entry per call edge, not
    every computation below it: quadratic in the nesting), and one walk up those reads
    finds every total an edit makes stale."""
    depth = 200
    module = parse(_nested_calls(depth))
    earlier = CostAnalysis(module)
    cost = earlier.module_cost()
    assert sum(len(reads) for reads in earlier._reads.values()) == depth  # the call edges
    edited = module.clone()
    rewriter = ModuleRewriter(edited)
    middle = edited.computation("c.100")
    rewriter.rewriter(middle).add("negate", ArrayShape("f32", (8,)), ["p.100"])  # one more op
    reuse = EarlierCosts(earlier, edited_computations(rewriter.changes))
    assert reuse.stale == {f"c.{k}" for k in range(101)} | {"e"}
    again = CostAnalysis(edited, earlier=reuse)
    assert again.module_cost() == CostAnalysis(edited).module_cost() != cost
    # the first total below the edit is reused whole: nothing under it is visited again
    assert again._totals["c.101"] is earlier._totals["c.101"] and "c.150" not in again._totals


def test_calls_nested_deeper_than_the_recursion_limit_are_priced() -> None:
    """Each total is summed after those it calls, in one iterative walk: a chain of calls
    nested far deeper than Python's recursion limit prices like a shallow one (the cost
    analysis recursed a few frames per level: ``hlo-shard report`` said "input nests too
    deeply to process" at 300 levels)."""
    import sys

    depth = 3 * sys.getrecursionlimit()
    cost = CostAnalysis(parse(_nested_calls(depth))).module_cost()
    assert cost == CostAnalysis(parse(_nested_calls(2))).module_cost()
    assert cost.transcendentals == 8


REDUCING_FUSION = """HloModule reducing
%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
%fused (p: f32[64]) -> f32[] {
  %p = f32[64] parameter(0)
  %zero = f32[] constant(0)
  ROOT %r = f32[] reduce(%p, %zero), dimensions={0}, to_apply=%sum
}
ENTRY %e (x: f32[64]) -> f32[] {
  %x = f32[64] parameter(0)
  ROOT %f = f32[] fusion(%x), kind=kLoop, calls=%fused
}
"""


def test_a_fusion_whose_body_reads_an_edited_computation_is_priced_again() -> None:
    """A fusion's price is reused from the earlier analysis (each fusion calls a body of
    its own), also through a chain of analyses, but not where what its body reads (the
    reduce's ``to_apply``) was edited."""
    module = parse(REDUCING_FUSION)
    first = CostAnalysis(module)
    first.module_cost()
    # the entry re-summed (as if edited), the fusion's price taken from the first
    second = CostAnalysis(module.clone(), earlier=EarlierCosts(first, frozenset({"e"})))
    assert second.module_cost() == first.module_cost()
    assert second._fusions["fused"] is first._fusions["fused"]
    edited = module.clone()
    rewriter = ModuleRewriter(edited)
    reducer = edited.computation("sum")
    rewriter.rewriter(reducer).add("exponential", ArrayShape("f32", ()), ["s"])
    rewriter.rewriter(reducer).set_root("exponential")
    third = CostAnalysis(edited, earlier=EarlierCosts(second, edited_computations(rewriter.changes)))
    assert third.module_cost() == CostAnalysis(edited).module_cost() != first.module_cost()


@pytest.mark.parametrize("fixture", CASES)
def test_fusions_alike_share_one_price_as_priced_apart(fixture: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A fusion whose structure matches one priced already (``fused_structure``) takes
    that price: the input's and the trial's prices are those of pricing each apart."""
    from hlo_shard.costmodel import flops

    module, hardware, candidate, edited = _input_and_trial(fixture)

    def priced() -> list[tuple]:
        whole = predicted_step(module, hardware)
        trial = predicted_step(candidate, hardware,
                               earlier=EarlierCosts(whole.model, frozenset(edited)))
        return [(e.seconds, [(i.computation, i.name, i.seconds, i.cost)
                             for i in e.instructions], e.model._totals, e.model._reads)
                for e in (whole, trial)]

    shared = priced()
    monkeypatch.setattr(flops, "fused_structure", lambda fusion, fused: None)
    assert shared == priced()


def test_fusions_alike_are_priced_once() -> None:
    module = parse("""HloModule alike
%f1 (p: f32[8]) -> f32[8] {
  %p = f32[8] parameter(0)
  ROOT %e = f32[8] exponential(%p), metadata={op_name="a"}
}
%f2 (q: f32[8]) -> f32[8] {
  %q = f32[8] parameter(0)
  ROOT %x = f32[8] exponential(%q), metadata={op_name="a"}
}
%f3 (r: f32[4]) -> f32[4] {
  %r = f32[4] parameter(0)
  ROOT %y = f32[4] exponential(%r), metadata={op_name="a"}
}
ENTRY %main (a: f32[8], b: f32[4]) -> (f32[8], f32[8], f32[4]) {
  %a = f32[8] parameter(0)
  %b = f32[4] parameter(1)
  %u = f32[8] fusion(%a), kind=kLoop, calls=%f1
  %v = f32[8] fusion(%a), kind=kLoop, calls=%f2
  %w = f32[4] fusion(%b), kind=kLoop, calls=%f3
  ROOT %t = (f32[8], f32[8], f32[4]) tuple(%u, %v, %w)
}
""")
    analysis = CostAnalysis(module)
    costs = analysis.per_instruction()
    assert costs["u"] == costs["v"] and costs["w"] != costs["u"]
    assert len(analysis._alike) == 2
    assert set(analysis._totals) >= {"f1", "f2", "f3"}
