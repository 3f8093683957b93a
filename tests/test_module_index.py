"""The module's computation-name index after its computations are replaced whole."""

from __future__ import annotations

from hlo_shard import optimize
from hlo_shard.parser import parse
from hlo_shard.passes.speed_gate import predicted_step
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.profiles import load_profile
from test_complexity import clipped

SMALL = """HloModule m

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}
"""


def test_a_module_that_takes_anothers_contents_finds_the_new_computations():
    module, other = parse(SMALL), parse(SMALL)
    assert module.computation("main") is module.entry  # the index is built
    module.take_contents(other)
    assert module.computation("main") is other.entry


def test_a_snapshot_put_back_is_what_lookups_find():
    module = parse(SMALL)
    assert module.computation("main") is module.entry
    snapshot = parse(SMALL).computations
    module.set_computations(snapshot)
    assert module.computation("main") is snapshot[0]


def test_the_module_the_gate_wrote_prices_as_its_text_does():
    """The gate keeps the trial it chose (take_contents): looking its computations up
    by name must find the rewritten ones, not the input's of the same name."""
    module = parse(clipped(200))
    result = optimize(module, ShardingOptions(), force=True)
    assert result.sharded
    profile = load_profile("cpu-local")
    reparsed = parse(result.xla_text)
    assert predicted_step(result.module, profile).seconds == \
        predicted_step(reparsed, profile).seconds
