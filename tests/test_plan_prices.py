"""The cut-off prices the speed gate predicts without rewriting (costmodel/plan_prices.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlo_shard.costmodel.plan_prices import CutoffPrices, ShardedGradient
from hlo_shard.parser import parse_file
from hlo_shard.passes.sharding_pipeline import run_sharding
from hlo_shard.passes.speed_gate import predicted_step
from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding
from hlo_shard.profiles import load_profile

FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize("fixture", ["optimized/transformer.n4.hlo", "optimized/adam.n4.hlo"])
def test_a_gradient_kept_whole_keeps_the_rendezvous_it_pays_alone(fixture: str) -> None:
    """On shared memory every array of a tuple all-reduce meets the others at a
    rendezvous of its own, so keeping a small gradient whole costs at least that: its
    share of the all-reduce is never less than one element's latency (split by bytes
    alone, a 256-byte bias looked free to keep, and the gate priced a cut-off it could
    not have chosen). At the cut-off sharding every gradient the prices are the
    rewritten module's."""
    module = parse_file(FIXTURES / fixture)
    hardware = load_profile("cpu-local")
    whole = predicted_step(module, hardware)
    candidate = module.clone()
    report = run_sharding(candidate, WeightUpdateSharding(ShardingOptions(profile=hardware)))
    sharded = predicted_step(candidate, hardware)
    gradients = [ShardedGradient(row.computation, row.all_reduce, row.bytes)
                 for row in report.explanations if row.sharded]
    alone = {(inst.computation, inst.name): inst.collective.latency_s / inst.collective.steps
             for inst in whole.instructions if inst.collective is not None
             and inst.collective.algorithm == "shared-memory" and inst.collective.steps > 1}
    assert any((g.computation, g.all_reduce) in alone for g in gradients)  # a tuple one
    prices = CutoffPrices.from_estimates(whole, sharded, gradients)
    for g, (nbytes, all_reduce) in zip(gradients, prices.gradients):
        assert nbytes == g.bytes
        assert all_reduce >= alone.get((g.computation, g.all_reduce), 0.0) * (1 - 1e-9)
    assert prices.seconds(0) == pytest.approx(sharded.seconds)
