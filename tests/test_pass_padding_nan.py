"""Two contracts of the sharded update that the issue-16 verifier checks, through real
XLA on 2 CPU devices: padding lanes of the shards a step writes out stay exactly 0
(an update with ``f(0) != 0``, such as ``sqrt(v + eps)``, is masked), and a global
min/max over shards propagates NaN as the whole-tensor reduce does (XLA:CPU's
``all-reduce(maximum)`` drops NaN, so an is-NaN flag travels with it)."""

from __future__ import annotations

import pytest

from hlo_shard import runtime

from test_optimize_verify import verify_optimized
from wus_helpers import ADD, MAX, find, optimize

ALIAS = "input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }"

#: An update through sqrt(v' + eps) on f32[5] over 2 devices (shards of 3, one padding
#: lane): where v' is 0 the step is lr·√eps, not 0, so the new weight's padding lane
#: turns nonzero unless masked; v' = 0.9·v + g² keeps its zeros.
RMSPROP = f"HloModule rms, replica_count=2, {ALIAS}\n" + ADD + """ENTRY e {
 w = f32[5] parameter(0) v = f32[5] parameter(1)
 g = f32[5] parameter(2), parameter_replication={false}
 gs = f32[5] all-reduce(g), replica_groups={{0,1}}, to_apply=add
 beta = f32[] constant(0.9) bb = f32[5] broadcast(beta), dimensions={}
 gg = f32[5] multiply(gs, gs) vb = f32[5] multiply(bb, v) v2 = f32[5] add(vb, gg)
 eps = f32[] constant(0.01) eb = f32[5] broadcast(eps), dimensions={}
 ve = f32[5] add(v2, eb) r = f32[5] sqrt(ve)
 lr = f32[] constant(0.1) lb = f32[5] broadcast(lr), dimensions={}
 u = f32[5] multiply(lb, r) w2 = f32[5] subtract(w, u)
 ROOT t = (f32[5], f32[5]) tuple(w2, v2) }
"""

#: Scale by the largest |update| with a NaN on device 0's shard only (lane 0 of a
#: replicated constant): the whole-tensor max is NaN, so every new weight is NaN.
NAN_MAX = f"HloModule nanmax, replica_count=2, {ALIAS}\n" + ADD + MAX + """ENTRY e {
 w = f32[4] parameter(0) m = f32[4] parameter(1)
 g = f32[4] parameter(2), parameter_replication={false}
 gs = f32[4] all-reduce(g), replica_groups={{0,1}}, to_apply=add
 c = f32[4] constant({-1, 1, 4, 9}) root = f32[4] sqrt(c)
 s = f32[4] multiply(gs, root) a = f32[4] abs(s)
 ninf = f32[] constant(-inf) mx = f32[] reduce(a, ninf), dimensions={0}, to_apply=mx
 mb = f32[4] broadcast(mx), dimensions={}
 m2 = f32[4] add(m, gs) u = f32[4] divide(m2, mb) w2 = f32[4] subtract(w, u)
 ROOT t = (f32[4], f32[4]) tuple(w2, m2) }
"""


@pytest.fixture(scope="module", autouse=True)
def worker():
    yield runtime.get_worker("cpu", 2)
    runtime.shutdown_workers()


def failures(report: runtime.VerifyReport) -> list:
    return [(leaf.index, leaf.verdict) for leaf in report.final() if leaf.verdict != "match"]


@pytest.mark.parametrize("strategy", ["per-tensor", "combined"])
def test_padding_lanes_of_written_shards_stay_zero(strategy):
    assert failures(verify_optimized(RMSPROP, state="sharded", strategy=strategy)) == []


def test_only_shards_whose_padding_can_turn_nonzero_are_masked():
    module, _ = optimize(RMSPROP, state="sharded")
    masked = [i.name for i in find(module, "select") if ".zero_padded" in i.name]
    assert [name.split(".")[0] for name in masked] == ["w2"]


@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_nan_in_one_shard_reaches_the_global_max(state):
    assert failures(verify_optimized(NAN_MAX, state=state, strategy="combined")) == []


def test_the_nan_flag_shares_the_one_element_all_reduce():
    module, _ = optimize(NAN_MAX, strategy="combined")
    scalars = [i for i in find(module, "all-reduce") if i.shape.dims == (2,)]
    assert len(scalars) == 1
