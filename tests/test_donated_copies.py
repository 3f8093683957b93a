"""XLA's copies of donated parameters (hlo_shard.costmodel.aliasing).

Each case was compiled by XLA:CPU (jaxlib 0.10.2, donated, 8 devices) and its optimized
module read: ``late_reader`` compiles with ``copy(p)`` at the top of the step; the
ordered and data-dependent forms without; the optimization barrier does not help.
"""

from __future__ import annotations

import pytest

from pathlib import Path

from hlo_shard.passes.weight_update import planned_update_regions
from hlo_shard.costmodel.aliasing import donated_parameter_copies
from hlo_shard.costmodel.network import combiner_buckets
from hlo_shard.costmodel.step_time import DONATED_COPY, estimate_step, step_seconds_floor
from hlo_shard.parser import parse, parse_file
from hlo_shard.passes.tuple_forwarding import TupleForwarding
from hlo_shard.profiles import load_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "spmd"

_HEAD = """HloModule e, replica_count=8, input_output_alias={ {0}: (0, {}, may-alias) }

sum { a = f32[] parameter(0) b = f32[] parameter(1) ROOT c = f32[] add(a, b) }

ENTRY main {
  p = f32[256,128]{1,0} parameter(0)
  x = f32[4,256]{1,0} parameter(1)
  y = f32[4,128]{1,0} dot(x, p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  g = f32[256,128]{1,0} dot(x, y), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  pf = f32[32768]{0} reshape(p)
  gf = f32[32768]{0} reshape(g)
  pid = u32[] partition-id()
  k = u32[] constant(4096)
  off = u32[] multiply(pid, k)
  s = f32[4096]{0} dynamic-slice(pf, off), dynamic_slice_sizes={4096}
  gs = f32[4096]{0} dynamic-slice(gf, off), dynamic_slice_sizes={4096}
  u = f32[4096]{0} subtract(s, gs)
"""
_GATHER = """  ag = f32[32768]{0} all-gather(%s), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  w = f32[256,128]{1,0} reshape(ag)
"""
_TAIL = """  ROOT t = (f32[256,128]{1,0}, f32[4,256]{1,0}) tuple(w, delta)
}
"""
#: The backward product reading the old weight: the gradient of the layer below.
_DELTA = "  delta = f32[4,256]{1,0} dot(y, p), lhs_contracting_dims={1}, rhs_contracting_dims={1}\n"

CASES = {
    # The all-gather writing p's buffer does not wait for delta, which reads p.
    "late_reader": _HEAD + _GATHER % "u" + _DELTA + _TAIL,
    # delta reads the gradient, not p: every reader of p precedes the all-gather.
    "ordered": _HEAD + _GATHER % "u"
    + "  delta = f32[4,256]{1,0} dot(y, g), lhs_contracting_dims={1}, rhs_contracting_dims={1}\n"
    + _TAIL,
    # The gathered value depends on delta through data: ordered.
    "data_dependency": _HEAD + _DELTA + """  z = f32[] constant(0)
  rd = f32[] reduce(delta, z), dimensions={0,1}, to_apply=sum
  rb = f32[4096]{0} broadcast(rd), dimensions={}
  ub = f32[4096]{0} add(u, rb)
""" + _GATHER % "ub" + _TAIL,
    # An optimization barrier orders nothing for XLA's copy insertion.
    "barrier": _HEAD + _DELTA + """  packed = (f32[4096]{0}, f32[4,256]{1,0}) tuple(u, delta)
  held = (f32[4096]{0}, f32[4,256]{1,0}) opt-barrier(packed)
  ub = f32[4096]{0} get-tuple-element(held), index=0
""" + _GATHER % "ub" + _TAIL,
}
COPIED = {"late_reader": True, "ordered": False, "data_dependency": False, "barrier": True}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_donated_parameter_read_after_its_overwrite_may_start_is_copied(case):
    copies = donated_parameter_copies(parse(CASES[case]))
    if not COPIED[case]:
        assert copies == []
        return
    (copy,) = copies
    assert (copy.parameter, copy.bytes, copy.reader, copy.writer) == ("p", 131072, "delta", "ag")


def test_the_copy_is_priced_as_formatting():
    profile = load_profile("cpu-local")
    module = parse(CASES["late_reader"])
    estimate = estimate_step(module, profile, planned_update_regions(module))
    (row,) = [e for e in estimate.instructions if e.name.startswith(DONATED_COPY)]
    assert row.name == DONATED_COPY + "p" and row.category == "formatting"
    assert row.seconds == pytest.approx(profile.memory_seconds(131072, 131072, True)
                                        + profile.kernel_overhead_s)
    ordered = parse(CASES["ordered"])
    assert not [e for e in estimate_step(ordered, profile, {}).instructions
                if e.name.startswith(DONATED_COPY)]


@pytest.mark.parametrize("name", ["adam.n4.hlo", "mlp_adam.n8.hlo"])
def test_jax_steps_need_no_copy_once_xla_combines_their_all_reduces(name):
    # jax all-reduces each gradient on its own, and XLA's combiner makes them the one
    # all-reduce that every update follows (its compiled steps have no copy). With the
    # shard_map tuples forwarded (as the pipeline does, also for a module it keeps
    # whole), only that bucket orders the backward products before the updates.
    profile = load_profile("cpu-local")
    module = parse_file(FIXTURES / name)
    assert donated_parameter_copies(module) == []
    TupleForwarding().run(module)
    assert donated_parameter_copies(module) != []
    buckets = combiner_buckets(module, module.entry, profile.combine_threshold_bytes,
                               profile.combined_collectives)
    assert donated_parameter_copies(module, buckets) == []


def test_undonated_modules_need_no_copy():
    assert donated_parameter_copies(parse(CASES["late_reader"].replace(
        ", input_output_alias={ {0}: (0, {}, may-alias) }", ""))) == []


def test_dropping_the_alias_keeps_every_output_on_real_xla():
    from hlo_shard import runtime
    from hlo_shard.passes.copy_free_donation import CopyFreeDonation

    original = parse(CASES["late_reader"])
    result = CopyFreeDonation("cpu-local").run(parse(CASES["late_reader"]))
    assert result.changed and "input_output_alias" not in result.module.header
    assert [c.parameter for c in result.report.dropped] == ["p"]
    assert "XLA would copy it" in result.report.notes[0]
    report = runtime.verify(original, result.module, runtime.VerifyOptions(steps=3))
    assert report.ok, report
    # Nothing to drop: the module is left as it is.
    again = CopyFreeDonation("cpu-local").run(parse(CASES["ordered"]))
    assert not again.changed and again.changes == []


def test_aliases_stay_where_the_copy_is_cheap_or_the_new_buffer_faults_in():
    from dataclasses import replace

    from hlo_shard.passes.copy_free_donation import CopyFreeDonation

    cpu = load_profile("cpu-local")
    assert CopyFreeDonation(cpu).run(parse(CASES["late_reader"])).changed
    # A large output would be mapped afresh every step: the copy is cheaper.
    faulting = replace(cpu, fresh_temp_threshold_bytes=1024)
    assert not CopyFreeDonation(faulting).run(parse(CASES["late_reader"])).changed
    # Where a copy is a sliver of the step (HBM-like bandwidth), memory is not traded.
    fast = replace(cpu, memory_bandwidth_bytes_per_s=1e15, cache_bandwidth_bytes_per_s=1e15,
                   kernel_overhead_s=0.0)
    assert not CopyFreeDonation(fast).run(parse(CASES["late_reader"])).changed


def _with_kernels(text: str, count: int) -> str:
    """``text`` as a module XLA fused already, with ``count`` more kernels in its entry
    (fusions of ``x``'s negation that nothing reads)."""
    body = "neg { a = f32[4,256]{1,0} parameter(0) ROOT n = f32[4,256]{1,0} negate(a) }\n\n"
    head, entry = text.split("ENTRY main {\n")
    kernels = "".join(f"  k{i} = f32[4,256]{{1,0}} fusion(x), kind=kLoop, calls=neg\n"
                      for i in range(count))
    return head + body + "ENTRY main {\n" + entry.replace(_TAIL, kernels + _TAIL)


@pytest.mark.parametrize("name", ["optimized/adam.n4.hlo", "optimized/loop_adam.n4.hlo",
                                  "optimized/transformer.n4.hlo", "spmd/adam.n4.hlo"])
def test_the_step_floor_is_below_the_estimate(name):
    profile = load_profile("cpu-local")
    module = parse_file(FIXTURES.parent / name)
    floor = step_seconds_floor(module, profile)
    assert 0 < floor <= estimate_step(module, profile, {}).seconds
    many = parse(_with_kernels(CASES["late_reader"], 50))
    assert step_seconds_floor(many, profile) <= estimate_step(many, profile, {}).seconds


def test_a_few_copies_in_a_step_of_many_kernels_keep_their_alias_without_an_estimate(
        monkeypatch):
    from hlo_shard.passes import copy_free_donation
    from hlo_shard.passes.copy_free_donation import CopyFreeDonation

    def no_estimate(*args, **kwargs):
        raise AssertionError("the floor of the step decides")

    module = parse(_with_kernels(CASES["late_reader"], 400))
    assert donated_parameter_copies(module) != []
    monkeypatch.setattr(copy_free_donation, "estimate_step", no_estimate)
    assert not CopyFreeDonation("cpu-local").run(module).changed
    # A step of few kernels is estimated (and its copy found worth dropping).
    monkeypatch.undo()
    assert CopyFreeDonation("cpu-local").run(parse(_with_kernels(CASES["late_reader"], 2))
                                             ).changed


_LOOP = """HloModule loop, replica_count=8

neg { a = f32[64]{0} parameter(0) ROOT n = f32[64]{0} negate(a) }

body {
  p = (s32[], f32[64]{0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  x = f32[64]{0} get-tuple-element(p), index=1
  one = s32[] constant(1)
  j = s32[] add(i, one)
  y = f32[64]{0} fusion(x), kind=kLoop, calls=neg
  ROOT t = (s32[], f32[64]{0}) tuple(j, y)
}

cond {
  p = (s32[], f32[64]{0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(1000)
  ROOT lt = pred[] compare(i, n), direction=LT
}

ENTRY main {
  x = f32[64]{0} parameter(0)
  z = s32[] constant(0)
  t = (s32[], f32[64]{0}) tuple(z, x)
  w = (s32[], f32[64]{0}) while(t), condition=cond, body=body
  ROOT r = f32[64]{0} get-tuple-element(w), index=1
}
"""


def test_the_step_floor_counts_the_kernels_of_a_loop_as_often_as_they_run():
    profile = load_profile("cpu-local")
    module = parse(_LOOP)
    # Two kernels in the body a thousand times, the condition's compare once more.
    launches = 2 * 1000 + 1001
    floor = step_seconds_floor(module, profile)
    assert floor >= launches * profile.for_devices(8).fused_kernel_overhead_s * (1 - 1e-6)
    assert floor <= estimate_step(module, profile, {}).seconds
