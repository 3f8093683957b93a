"""Batch statistics (BatchNorm's mean and variance over the data axis, and their sums in
the backward pass) are all-reduces too, but the forward and backward pass are computed
from them: they stay all-reduced (code ``feeds_gradients``) and the update region ends
there. Sharded, the mean's reduce-scatter shared a bucket with the gradients computed
from its all-gather: a dependency cycle the rewrite raised into the loop. A rewrite that
still makes one is undone and its region refused (code ``region_cycle``), never raised.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hlo_shard import runtime
from hlo_shard.passes.weight_update import analysis
from hlo_shard import optimize
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update import ShardingOptions

BATCHNORM = (Path(__file__).parent / "golden_pass" / "batch_statistic_kept_whole.hlo"
             ).read_text()
STRATEGIES = ("per-tensor", "combined", "auto")


def rows(text: str, **options):
    module = parse(text)
    result = optimize(module, ShardingOptions(**options), force=True)
    report, optimized = result.report, result.text
    return {row.all_reduce: row for row in report.explanations}, report, optimized


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("state", ("gathered", "sharded"))
def test_the_batch_mean_stays_whole_and_the_gradient_is_sharded(state, strategy):
    by_name, _, optimized = rows(BATCHNORM, state=state, strategy=strategy)
    assert not by_name["stat"].sharded and by_name["stat"].reason_code == "feeds_gradients"
    assert "%ar is computed from it" in by_name["stat"].reason
    assert by_name["ar"].sharded and by_name["ar"].reason_code == ""
    assert "reduce-scatter" in optimized


@pytest.mark.parametrize("state", ("gathered", "sharded"))
def test_a_rewrite_that_makes_a_cycle_is_refused_not_raised(monkeypatch, state):
    """With the statistics let through (the planning before this fix), the combined
    reduce-scatter waits on its own all-gather: the region is left as it was, every
    gradient of it explained, the signature unchanged."""
    monkeypatch.setattr(analysis._Planner, "statistics", lambda self: {})
    by_name, report, optimized = rows(BATCHNORM, state=state, strategy="combined")
    for name in ("stat", "ar"):
        assert not by_name[name].sharded and by_name[name].reason_code == "region_cycle", name
        assert "dependency cycle" in by_name[name].reason
    assert "reduce-scatter" not in optimized and "all-gather" not in optimized
    assert all(p.kind != "sharded" for p in report.parameters + report.outputs)
    assert not report.strategies
    assert parse(optimized).entry.root.operands == parse(BATCHNORM).entry.root.operands


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


@pytest.mark.parametrize("state", ("gathered", "sharded"))
def test_the_optimized_batchnorm_step_computes_the_same(worker, state):
    _, report, optimized = rows(BATCHNORM, state=state, strategy="combined")
    result = runtime.verify(parse(BATCHNORM), parse(optimized), runtime.VerifyOptions(
        steps=3, manifest=build_manifest(report, parse(BATCHNORM))))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]



def test_a_batch_statistic_is_no_weights_gradient_in_the_report():
    """A statistic whose reach pairs it with a weight (haiku's BatchNorm after a biased
    Linear: the mean and variance sums were reported as the bias's gradient, twice) is
    a value of the forward pass: its row names no weight; the gradient's row does."""
    from dataclasses import replace

    from hlo_shard.analysis.names import user_names

    module = parse(BATCHNORM)
    names = user_names(module, override={0: "params['w']", 1: "params['b']",
                                         2: "batch['x']"})
    entry = module.entry.name
    assert names.gradients == {(entry, "ar", None): 0}
    paired = replace(names, gradients={**names.gradients, (entry, "stat", None): 1})
    result = optimize(parse(BATCHNORM), ShardingOptions(), force=True)
    explained = {row["all_reduce"]: row for row in result.to_json(paired)["explanations"]}
    assert explained["stat"]["reason_code"] == "feeds_gradients"
    assert explained["stat"]["gradient_of"] is None
    assert explained["ar"]["gradient_of"] == "params['w']"
