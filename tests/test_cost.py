"""Cost model unit tests: XLA's HloCostAnalysis rules, kernels, liveness, collectives.

The expected totals of the op corpora below were read from XLA itself
(``hlo_module_cost_analysis``, jaxlib 0.10.2); ``tests/test_cost_xla.py`` re-checks
the fixtures against the live XLA through the runtime.
"""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources

import pytest

from hlo_shard.passes.weight_update import planned_update_regions
from hlo_shard.costmodel.network import (
    accumulator_seconds, algorithm_steps, collective_cost, combiner_buckets, group_size, share_latency, torus_dims,
    wire_bytes,
)
from hlo_shard.costmodel.flops import CostAnalysis, module_cost
from hlo_shard.values import read_window
from hlo_shard.costmodel.step_time import (
    FRESH_TEMP_PAGES, StepEstimate, classify_parameters, categorize, estimate_step,
)
from hlo_shard.costmodel.kernels import plan_kernels
from hlo_shard.costmodel.memory import memory_profile
from hlo_shard.errors import HloShardError
from hlo_shard.ir import Module
from hlo_shard.parser import parse
from hlo_shard.passes.speed_gate import predicted_step_seconds
from hlo_shard.profiles import (HardwareProfile, available_profiles, load_profile,
                                profile_from_dict, profile_json)


def estimate(module: Module, profile: HardwareProfile) -> StepEstimate:
    """The estimate ``report`` prints: the update region the pass plans handed in."""
    return estimate_step(module, profile, planned_update_regions(module))

#: Most opcodes with a rule of their own (dot, convolutions, reduce, reduce-window, sort,
#: slices, transposes that are and are not bitcasts, transcendentals, …).
OPS1 = """HloModule ops1

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
max {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] maximum(a, b)
}
ge {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = pred[] compare(a, b), direction=GE
}
ENTRY e {
  x = f32[8,16] parameter(0)
  w = f32[16,32] parameter(1)
  i = s32[] parameter(2)
  img = f32[2,8,8,3] parameter(3)
  k = f32[3,3,3,4] parameter(4)
  d = f32[8,32] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  t = f32[32,8] transpose(d), dimensions={1,0}
  tb = f32[8,1,32] reshape(d)
  t2 = f32[1,8,32] transpose(tb), dimensions={1,0,2}
  z = f32[] constant(0)
  r = f32[8] reduce(d, z), dimensions={1}, to_apply=add
  s = f32[4,16] slice(x), slice={[0:4], [0:16]}
  zi = s32[] constant(0)
  ds = f32[4,16] dynamic-slice(x, i, zi), dynamic_slice_sizes={4,16}
  dus = f32[8,16] dynamic-update-slice(x, s, i, zi)
  e1 = f32[8,16] exponential(x)
  l1 = f32[8,16] log(e1)
  tn = f32[8,16] tan(x)
  ef = f32[8,16] erf(x)
  c = f32[2,8,8,4] convolution(img, k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  c2 = f32[2,4,4,4] convolution(img, k), window={size=3x3 stride=2x2 pad=0_1x0_1}, dim_labels=b01f_01io->b01f
  rw = f32[2,4,4,3] reduce-window(img, z), window={size=1x2x2x1 stride=1x2x2x1}, to_apply=max
  so = f32[8,16] sort(x), dimensions={1}, to_apply=ge
  cc = f32[16,16] concatenate(x, x), dimensions={0}
  p = f32[10,18] pad(x, z), padding=1_1x1_1
  b = f32[8,16,4] broadcast(x), dimensions={0,1}
  io = s32[8,16] iota(), iota_dimension=0
  cv = s32[8,16] convert(x)
  bc = s32[8,16] bitcast-convert(x)
  rev = f32[8,16] reverse(x), dimensions={0}
  cp = f32[8,16] copy(x)
  so2 = pred[8,16] compare(x, e1), direction=LT
  sel = f32[8,16] select(so2, x, e1)
  cl = f32[8,16] clamp(z, x, e1)
  rs = f32[128] reshape(x)
  bi = f32[128] bitcast(x)
  pw = f32[8,16] power(x, e1)
  ROOT tu = (f32[32,8], f32[1,8,32], f32[8], f32[4,16], f32[8,16], f32[8,16], f32[8,16], f32[2,8,8,4], f32[2,4,4,4], f32[2,4,4,3], f32[8,16], f32[16,16], f32[10,18], f32[8,16,4], s32[8,16], s32[8,16], s32[8,16], f32[8,16], f32[8,16], f32[8,16], f32[8,16], f32[128], f32[128], f32[8,16], f32[8,16], f32[8,16]) tuple(t, t2, r, ds, dus, l1, tn, c, c2, rw, so, cc, p, b, io, cv, bc, rev, cp, sel, cl, rs, bi, pw, ef, ef)
}
"""

#: Fusions (DUS root, slices, broadcasts), collectives, conditional, call, custom-call.
OPS2 = """HloModule ops2, replica_count=4

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
fused1 {
  p0 = f32[64] parameter(0)
  p1 = f32[64] parameter(1)
  p2 = f32[] parameter(2)
  b = f32[64] broadcast(p2), dimensions={}
  m = f32[64] multiply(p1, b)
  s = f32[64] subtract(p0, m)
  e = f32[64] exponential(s)
  c = f32[64] broadcast(p2), dimensions={}
  ROOT a = f32[64] add(e, c)
}
fused2 {
  p0 = f32[64] parameter(0)
  p1 = f32[16] parameter(1)
  p2 = s32[] parameter(2)
  sl = f32[16] slice(p0), slice={[0:16]}
  a = f32[16] add(sl, p1)
  dus = f32[64] dynamic-update-slice(p0, a, p2)
  ROOT t = (f32[64], f32[16]) tuple(dus, a)
}
br0 {
  p = f32[64] parameter(0)
  ROOT n = f32[64] negate(p)
}
br1 {
  p = f32[64] parameter(0)
  e = f32[64] exponential(p)
  ROOT n = f32[64] add(e, p)
}
callee {
  p = f32[64] parameter(0)
  ROOT n = f32[64] multiply(p, p)
}
ENTRY e {
  w = f32[64] parameter(0)
  g = f32[64] parameter(1)
  lr = f32[] parameter(2)
  u = f32[16] parameter(3)
  i = s32[] parameter(4)
  pr = pred[] parameter(5)
  ar = f32[64] all-reduce(g), replica_groups={}, to_apply=add
  art = (f32[64], f32[16]) all-reduce(g, u), replica_groups={}, to_apply=add
  rs = f32[16] reduce-scatter(g), replica_groups={}, dimensions={0}, to_apply=add
  ag = f32[64] all-gather(u), replica_groups={}, dimensions={0}
  f1 = f32[64] fusion(w, ar, lr), kind=kLoop, calls=fused1
  f2 = (f32[64], f32[16]) fusion(f1, u, i), kind=kLoop, calls=fused2
  cd = f32[64] conditional(pr, w, g), true_computation=br0, false_computation=br1
  cl = f32[64] call(w), to_apply=callee
  rid = u32[] replica-id()
  cus = f32[64] custom-call(w), custom_call_target="foo"
  ROOT t = (f32[64], (f32[64], f32[16]), f32[16], f32[64], f32[64], f32[64], u32[], (f32[64], f32[16]), f32[64]) tuple(f1, f2, rs, ag, cd, cl, rid, art, cus)
}
"""

#: A counted loop: XLA prices one iteration; the time model all ten.
LOOP = """HloModule w

body {
  p = (s32[], f32[128]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  x = f32[128] get-tuple-element(p), index=1
  one = s32[] constant(1)
  i2 = s32[] add(i, one)
  e = f32[128] exponential(x)
  y = f32[128] add(e, x)
  ROOT t = (s32[], f32[128]) tuple(i2, y)
}
cond {
  p = (s32[], f32[128]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(10)
  ROOT c = pred[] compare(i, n), direction=LT
}
ENTRY e {
  a = f32[128] parameter(0)
  z = s32[] constant(0)
  t = (s32[], f32[128]) tuple(z, a)
  w = (s32[], f32[128]) while(t), condition=cond, body=body
  ROOT r = f32[128] get-tuple-element(w), index=1
}
"""

#: An Adam step on one 1024x1024 weight, written out unfused as JAX would emit it.
ADAM = """HloModule adam, replica_count=4

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY e {
  w = f32[1024,1024] parameter(0)
  m = f32[1024,1024] parameter(1)
  v = f32[1024,1024] parameter(2)
  x = f32[8,1024] parameter(3)
  step = s32[] parameter(4)
  y = f32[8,1024] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  g0 = f32[1024,1024] dot(x, y), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  g = f32[1024,1024] all-reduce(g0), replica_groups={}, to_apply=add
  b1 = f32[] constant(0.9)
  b2 = f32[] constant(0.999)
  omb1 = f32[] constant(0.1)
  omb2 = f32[] constant(0.001)
  lr = f32[] constant(0.001)
  eps = f32[] constant(1e-8)
  one = s32[] constant(1)
  step1 = s32[] add(step, one)
  stepf = f32[] convert(step1)
  b1t = f32[] power(b1, stepf)
  b2t = f32[] power(b2, stepf)
  onef = f32[] constant(1)
  c1 = f32[] subtract(onef, b1t)
  c2 = f32[] subtract(onef, b2t)
  lr1 = f32[] divide(lr, c1)
  bb1 = f32[1024,1024] broadcast(b1), dimensions={}
  bomb1 = f32[1024,1024] broadcast(omb1), dimensions={}
  m1a = f32[1024,1024] multiply(m, bb1)
  m1b = f32[1024,1024] multiply(g, bomb1)
  m1 = f32[1024,1024] add(m1a, m1b)
  bb2 = f32[1024,1024] broadcast(b2), dimensions={}
  bomb2 = f32[1024,1024] broadcast(omb2), dimensions={}
  gg = f32[1024,1024] multiply(g, g)
  v1a = f32[1024,1024] multiply(v, bb2)
  v1b = f32[1024,1024] multiply(gg, bomb2)
  v1 = f32[1024,1024] add(v1a, v1b)
  bc2 = f32[1024,1024] broadcast(c2), dimensions={}
  vh = f32[1024,1024] divide(v1, bc2)
  sq = f32[1024,1024] sqrt(vh)
  be = f32[1024,1024] broadcast(eps), dimensions={}
  den = f32[1024,1024] add(sq, be)
  upd = f32[1024,1024] divide(m1, den)
  blr = f32[1024,1024] broadcast(lr1), dimensions={}
  st = f32[1024,1024] multiply(upd, blr)
  w1 = f32[1024,1024] subtract(w, st)
  ROOT t = (f32[1024,1024], f32[1024,1024], f32[1024,1024], s32[]) tuple(w1, m1, v1, step1)
}
"""


#: Three independent gradient all-reduces (1 KiB each), each used by its own update,
#: then a norm that depends on one of them.
MLP_GRADIENTS = """
HloModule grads, replica_count=4

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY e {
  x = f32[256] parameter(0)
  g0 = f32[256] multiply(x, x)
  ar0 = f32[256] all-reduce(g0), replica_groups={}, to_apply=add
  g1 = f32[256] add(x, x)
  ar1 = f32[256] all-reduce(g1), replica_groups={}, to_apply=add
  g2 = f32[256] subtract(x, g1)
  ar2 = f32[256] all-reduce(g2), replica_groups={}, to_apply=add
  w0 = f32[256] subtract(x, ar0)
  w1 = f32[256] subtract(x, ar1)
  w2 = f32[256] subtract(x, ar2)
  z = f32[] constant(0)
  n = f32[] reduce(w2, z), dimensions={0}, to_apply=add
  norm = f32[] all-reduce(n), replica_groups={}, to_apply=add
  ROOT t = (f32[256], f32[256], f32[256], f32[]) tuple(w0, w1, w2, norm)
}
"""


def costs(text: str, **options) -> tuple[float, float, float]:
    cost = module_cost(parse(text), **options)
    return cost.flops, cost.transcendentals, cost.bytes_accessed


# ------------------------------------------------------------------ XLA's numbers


@pytest.mark.parametrize("text, expected", [
    (OPS1, (39304, 640, 43448)),
    (OPS2, (479, 128, 4951)),  # includes XLA's -1 flops / -1 bytes for the custom-call
    (LOOP, (130, 128, 2613)),
])
def test_totals_equal_xla_cost_analysis(text, expected):
    assert costs(text) == pytest.approx(expected, abs=0.5)


def test_loop_iterations_counted_for_the_time_model():
    flops, transcendentals, bytes_ = costs(LOOP, count_loop_iterations=True)
    assert (flops, transcendentals, bytes_) == (1301, 1280, 25995)  # 10 trips, 11 conditions


def test_custom_call_is_unknown_for_xla_and_default_bytes_for_the_model():
    module = parse(OPS2)
    entry = module.entry
    call = entry["cus"]
    assert CostAnalysis(module).instruction_cost(entry, call).flops == -1
    model = CostAnalysis(module, xla_compatible=False).instruction_cost(entry, call)
    assert (model.flops, model.bytes_accessed) == (0, 2 * 64 * 4)


def test_per_instruction_rules():
    module = parse(OPS1)
    cost = CostAnalysis(module).per_instruction()
    assert cost["d"].flops == 2 * 8 * 32 * 16                   # dot: 2 · out · contracting
    assert cost["t"].bytes_accessed == 2 * 8 * 32 * 4           # real transpose: default bytes
    assert cost["t2"].bytes_accessed == 2 * 8 * 32 * 4          # XLA ignores size-1 dims here
    assert cost["r"].flops == 8 * 32 - 8                        # reduce: reducer × (in − out)
    assert cost["s"].bytes_accessed == 2 * 4 * 16 * 4           # slice: 2 × output
    assert cost["ds"].bytes_accessed == 2 * 4 * 16 * 4 + 4      # + the first index
    assert cost["dus"].bytes_accessed == 2 * 4 * 16 * 4 + 4     # 2 × update + index
    assert cost["e1"].transcendentals == 128 and cost["e1"].flops == 0
    assert cost["tn"].transcendentals == 128                    # tan is transcendental
    assert cost["c"].flops == 2 * 3 * 4 * 2 * 22 * 22  # 22 valid (output, tap) pairs per dim
    assert cost["tu"].bytes_accessed == 8 * 26                  # tuple: its index table
    assert cost["so"].flops == 128 * 7                          # n · ⌈log2 n⌉


def test_transpose_into_the_matching_layout_is_a_bitcast():
    module = parse("""
HloModule t

ENTRY e {
  x = f32[8,32]{1,0} parameter(0)
  ROOT t = f32[32,8]{0,1} transpose(x), dimensions={1,0}
}
""")
    assert CostAnalysis(module).per_instruction()["t"].bytes_accessed == 0


def test_read_window():
    dims = read_window("{size=3x2 stride=2x1 pad=1_0x0_1 rhs_dilate=1x2}")
    assert [(d.size, d.stride, d.pad_low, d.pad_high, d.rhs_dilate) for d in dims] == [
        (3, 2, 1, 0, 1), (2, 1, 0, 1, 2)]


# ------------------------------------------------------------------------ kernels


def test_adam_update_is_one_multi_output_kernel():
    module = parse(ADAM)
    plan = plan_kernels(module.entry)
    update = plan.kernel_of["w1"]
    assert plan.kernel_of["m1"] is update and plan.kernel_of["v1"] is update
    # Reads g, w, m, v once; writes w, m, v (plus the 4-byte step counter).
    assert update.read_bytes == pytest.approx(4 * 4 * 2 ** 20, abs=16)
    assert update.write_bytes == pytest.approx(3 * 4 * 2 ** 20, abs=16)
    assert {"bb1", "blr", "lr1"} <= plan.duplicated  # broadcasts and scalars recomputed


def test_cpu_runs_the_adam_update_as_three_loops():
    # XLA CPU has no multi-output fusion: m and v are loops of their own (each reading
    # g) and the w loop reads them back, as the compiled module shows.
    module = parse(ADAM)
    plan = plan_kernels(module.entry, multi_output=False)
    m_loop, v_loop, w_loop = (plan.kernel_of[n] for n in ("m1", "v1", "w1"))
    assert len({id(m_loop), id(v_loop), id(w_loop)}) == 3
    mib = 4 * 2 ** 20
    assert m_loop.read_bytes == pytest.approx(2 * mib) and m_loop.write_bytes == mib
    assert w_loop.read_bytes == pytest.approx(3 * mib) and w_loop.write_bytes == mib


def test_a_gradient_computed_transposed_is_flattened_by_a_bitcast():
    # XLA computes the dot with its operands swapped, so the sharded module's flattening
    # reshape of the transposed gradient is a bitcast (XLA:CPU: bitcast(dot) feeds the
    # bucket); the same reshape of a parameter laid out {0,1} is a real copy.
    module = parse("""
HloModule t

ENTRY e {
  a = f32[64,32]{1,0} parameter(0)
  b = f32[64,16]{1,0} parameter(1)
  w = f32[16,32]{0,1} parameter(2)
  d = f32[32,16]{1,0} dot(a, b), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  t = f32[16,32]{0,1} transpose(d), dimensions={1,0}
  flat = f32[512]{0} reshape(t)
  wflat = f32[512]{0} reshape(w)
  ROOT s = f32[512]{0} add(flat, wflat)
}
""")
    plan = plan_kernels(module.entry)
    assert {"t", "flat"} <= plan.relabels
    assert "wflat" not in plan.relabels


_TRANSPOSED_GRADIENT = """
HloModule t

ENTRY e {
  g = f32[256,64]{1,0} parameter(0)
  m = f32[64,256]{1,0} parameter(1)
  v = f32[64,256]{1,0} parameter(2)
  t = f32[64,256]{0,1} transpose(g), dimensions={1,0}
  m1 = f32[64,256]{1,0} add(m, t)
  sq = f32[64,256]{1,0} multiply(t, t)
  v1 = f32[64,256]{1,0} add(v, sq)
  ROOT r = (f32[64,256]{1,0}, f32[64,256]{1,0}) tuple(m1, v1)
}
"""


def test_a_transpose_read_by_several_loops_is_recomputed_in_each_on_cpu():
    """XLA CPU has no multi-output fusion and duplicates a transpose into every fusion
    that reads it (the partitioner's FSDP gradient, transposed into its weight's rows
    and read by Adam's m and v loops): each loop reads the gradient in transposed order,
    whatever layout the text gives the transpose (layout assignment lays out both sides
    row-major). With multi-output fusion the loops merge and read it once."""
    module = parse(_TRANSPOSED_GRADIENT)
    plan = plan_kernels(module.entry, multi_output=False)
    assert "t" in plan.duplicated and "t" not in plan.kernel_of
    gradient = 256 * 64 * 4
    for name in ("m1", "v1"):
        assert plan.kernel_of[name].reordered_read_bytes == gradient
    merged = plan_kernels(module.entry, multi_output=True)
    assert merged.kernel_of["m1"] is merged.kernel_of["v1"]
    cpu = load_profile("cpu-local").for_devices(1)
    slower = dataclasses.replace(cpu, reordered_read_factor=cpu.reordered_read_factor + 4,
                                 at_device_counts=())
    assert estimate(module, slower).seconds > estimate(module, cpu).seconds


def test_two_transposes_that_undo_each_other_are_no_kernel():
    """A reduce-scatter's block transposed back into the gradient's order, then into the
    weight's: XLA's simplifier removes both."""
    module = parse(_TRANSPOSED_GRADIENT.replace(
        "  t = f32[64,256]{0,1} transpose(g), dimensions={1,0}\n",
        "  b = f32[64,256]{1,0} parameter(3)\n"
        "  gb = f32[256,64]{1,0} transpose(b), dimensions={1,0}\n"
        "  t = f32[64,256]{0,1} transpose(gb), dimensions={1,0}\n"))
    plan = plan_kernels(module.entry, multi_output=False)
    assert {"gb", "t"} <= plan.relabels
    assert all(kernel.reordered_read_bytes == 0 for kernel in plan.kernels)


def test_a_transpose_moving_only_dimensions_of_size_one_keeps_the_order():
    from hlo_shard.costmodel.kernels import reorders_elements

    module = parse("""
HloModule t

ENTRY e {
  x = f32[1,8,1,4]{3,2,1,0} parameter(0)
  a = f32[8,1,4,1]{3,2,1,0} transpose(x), dimensions={1,0,3,2}
  ROOT b = f32[4,1,8,1]{3,2,1,0} transpose(x), dimensions={3,2,1,0}
}
""")
    assert not reorders_elements(module.entry, module.entry["a"])
    assert reorders_elements(module.entry, module.entry["b"])


def test_prefused_module_is_not_refused():
    module = parse(OPS2)
    plan = plan_kernels(module.entry, emulate_fusion=False)
    assert all(len(k.members) == 1 for k in plan.kernels)


# ----------------------------------------------------------------------- liveness


def test_adam_peak_memory_matches_xla_figures():
    # XLA CPU (jaxlib 0.10.2) reports argument 12615684 + output 12582948 + temp 68.
    module = parse(ADAM)
    profile = memory_profile(module)
    assert profile.argument_bytes == 12615684
    assert profile.output_bytes == 12582948
    assert profile.peak_bytes == pytest.approx(12615684 + 12582948 + 68, rel=0.01)


def test_donated_outputs_share_their_parameter():
    text = ADAM.replace("HloModule adam, replica_count=4",
                        "HloModule adam, replica_count=4, input_output_alias={ {0}: (0, {}, "
                        "may-alias), {1}: (1, {}, may-alias), {2}: (2, {}, may-alias) }")
    module = parse(text)
    assert module.output_aliases() == {0: 0, 1: 1, 2: 2}
    profile = memory_profile(module)
    assert profile.alias_bytes == 3 * 4 * 2 ** 20
    assert profile.peak_bytes < memory_profile(parse(ADAM)).peak_bytes


def test_parameter_kinds():
    module = parse(ADAM)
    categories, _ = categorize(module, module.entry, planned_update_regions(module))
    kinds = classify_parameters(module, categories)
    assert kinds == {"w": "weights", "m": "optimizer_state", "v": "optimizer_state",
                     "x": "batch", "step": "other_parameters"}


# --------------------------------------------------------------------- collectives


def test_ring_bytes_and_steps():
    assert wire_bytes("all-reduce", 8, 800) == pytest.approx(2 * 7 / 8 * 800)
    assert wire_bytes("reduce-scatter", 8, 800) == pytest.approx(7 / 8 * 800)
    assert wire_bytes("all-gather", 8, 800) == pytest.approx(7 / 8 * 800)
    assert wire_bytes("all-reduce", 1, 800) == 0
    # AR ≡ RS + AG on the wire; latency: one collective of 2(n−1) steps or two of n−1.
    assert algorithm_steps("all-reduce", 8, "ring") == 14
    assert algorithm_steps("reduce-scatter", 8, "ring") == 7
    assert algorithm_steps("all-reduce", 8, "tree") == 6
    assert algorithm_steps("all-reduce", 16, "torus2d") == 2 * (3 + 3)
    assert torus_dims(1024, 2) == [32, 32] and math.prod(torus_dims(512, 3)) == 512


def test_kernels_that_fit_the_cache_share_move_at_cache_bandwidth():
    profile = load_profile("cpu-local")
    share, fast = profile.cache_bytes, profile.cache_bandwidth_bytes_per_s
    assert share == (32 << 20) // 8
    assert profile.memory_seconds(share / 2, share / 2) == pytest.approx(share / fast)
    beyond = profile.memory_seconds(share, share)
    assert beyond == pytest.approx(share / profile.memory_bandwidth_bytes_per_s
                                   + share / profile.memory_write_bandwidth_bytes_per_s)
    assert load_profile("tpu-v3").cache_bytes == 0  # HBM traffic only


def test_shared_memory_collectives_are_one_rendezvous_and_copies():
    profile = load_profile("cpu-local")
    alpha = profile.interconnect.intra_node.alpha_s
    size = 8 << 20
    copies = {"all-reduce": (size, size), "reduce-scatter": (size, size / 8),
              "all-gather": (size, size)}  # (read, written) per device
    for kind, (read, written) in copies.items():
        cost = collective_cost(kind, 8, size, profile)
        assert cost.steps == 1
        assert cost.seconds == pytest.approx(alpha + profile.memory_seconds(read, written)
                                             + accumulator_seconds(kind, 8, size, profile))
        assert cost.bytes_sent == wire_bytes(kind, 8, size)  # reported as on a network


def test_reductions_pay_their_accumulator_once_per_participant():
    """in_process_communicator fills each device's chunk (S/n) and adds the n shares
    into it one at a time: S read, S + S/n written, in cache while the chunk fits.
    Measured (two donated collectives, n=8, S per collective): reduce-scatter 1.43 ms
    at 1 MiB and 3.3-4.1 ms at 4 MiB, all-reduce 1.85 and 4.99 ms; without the
    accumulator the model gave 0.69/2.28 and 0.83/3.65 ms, with it 1.34/4.88 and
    1.48/6.25 ms."""
    profile = load_profile("cpu-local")
    fast = profile.cache_bandwidth_bytes_per_s
    size = 4 << 20
    for kind in ("all-reduce", "reduce-scatter"):
        assert accumulator_seconds(kind, 8, size, profile) == pytest.approx(
            (size + size + size / 8) / fast)
    assert accumulator_seconds("all-gather", 8, size, profile) == 0.0
    huge = 8 * 2 * profile.cache_bytes  # chunks of twice the cache share: memory rates
    assert accumulator_seconds("all-reduce", 8, huge, profile) == pytest.approx(
        profile.memory_seconds(huge, huge * 9 / 8))
    assert accumulator_seconds("all-reduce", 1, size, profile) == 0.0


def test_collective_time_uses_the_link_the_group_spans():
    profile = load_profile("a100")
    inside = collective_cost("all-reduce", 8, 1 << 30, profile)
    across = collective_cost("all-reduce", 16, 1 << 30, profile)
    link = profile.interconnect.intra_node
    assert inside.seconds == pytest.approx(14 * link.alpha_s + 2 * 7 / 8 * (1 << 30)
                                           / link.beta_bytes_per_s)
    assert across.seconds > 5 * inside.seconds


def test_combined_collectives_share_one_latency_per_bucket():
    profile = load_profile("tpu-v3")
    costs = [collective_cost("all-reduce", 64, size, profile) for size in (1000, 3000, 4000)]
    latency = costs[0].latency_s
    bandwidth = [c.seconds - c.latency_s for c in costs]
    seconds = share_latency(costs)
    assert sum(seconds) == pytest.approx(latency + sum(bandwidth))
    assert seconds[1] == pytest.approx(bandwidth[1] + latency * 3000 / 8000)


def test_combiner_buckets_independent_collectives_up_to_the_threshold():
    module = parse(MLP_GRADIENTS)
    assert combiner_buckets(module, module.entry, 1 << 20) == [["ar0", "ar1", "ar2"], ["norm"]]
    assert combiner_buckets(module, module.entry, 2048) == [["ar0", "ar1"], ["ar2"], ["norm"]]



def _summed_gradient(elements: int) -> str:
    """out = all-reduce(x) + y, out donated: the all-reduce result is the only temp."""
    return f"""HloModule summed, input_output_alias={{ {{}}: (1, {{}}, may-alias) }}, num_partitions=8
add {{
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}}
ENTRY e {{
  x = f32[{elements}] parameter(0)
  y = f32[{elements}] parameter(1)
  r = f32[{elements}] all-reduce(x), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, use_global_device_ids=true, to_apply=add
  ROOT o = f32[{elements}] add(r, y)
}}"""


def test_a_temp_allocation_over_the_mmap_threshold_pays_its_page_faults_every_step():
    """Measured on this module (XLA CPU, donated loop): 1.3 ms/MiB at a 24 MiB temp,
    3.3-4.2 ms/MiB from 33 MiB on, where glibc maps the allocation afresh each step."""
    cpu = load_profile("cpu-local")
    threshold = cpu.fresh_temp_threshold_bytes
    assert threshold == 32 << 20
    small = estimate_step(parse(_summed_gradient(24 << 18)), cpu, {})
    large = estimate_step(parse(_summed_gradient(40 << 18)), cpu, {})
    assert small.memory.temp_bytes == 24 << 20 and large.memory.temp_bytes == 40 << 20
    assert FRESH_TEMP_PAGES not in {i.name for i in small.instructions}
    faults = next(i.seconds for i in large.instructions if i.name == FRESH_TEMP_PAGES)
    assert faults == pytest.approx((40 << 20) * (1 / cpu.memory_write_bandwidth_bytes_per_s
                                                 - 1 / cpu.memory_bandwidth_bytes_per_s))
    # Accelerators' allocators keep their pages: no threshold, no charge.
    assert load_profile("h100").fresh_pages_seconds(1 << 40) == 0.0


GATHERS = """
HloModule gathers, num_partitions=8

ENTRY e {
  a = f32[1024] parameter(0)
  b = f32[1024] parameter(1)
  c = f32[1024] parameter(2)
  ga = f32[8192] all-gather(a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  gb = f32[8192] all-gather(b), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  gc = f32[8192] all-gather(c), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  ROOT t = (f32[8192], f32[8192], f32[8192]) tuple(ga, gb, gc)
}
"""


def test_only_the_backends_combined_kinds_share_a_bucket():
    module = parse(GATHERS)
    assert combiner_buckets(module, module.entry, 1 << 20) == [["ga", "gb", "gc"]]
    assert combiner_buckets(module, module.entry, 1 << 20, {"all-reduce"}) == [
        ["ga"], ["gb"], ["gc"]]
    grads = parse(MLP_GRADIENTS)
    assert combiner_buckets(grads, grads.entry, 1 << 20, {"all-reduce"}) == [
        ["ar0", "ar1", "ar2"], ["norm"]]


def test_xla_cpu_pays_one_latency_per_all_gather():
    """XLA CPU has no all-gather combiner, and combining would not help it: its
    in-process collectives meet once per buffer, so three all-gathers cost three
    latencies however they are grouped; a ring profile (GPU, TPU) pays one per bucket."""
    import dataclasses

    module = parse(GATHERS)
    cpu = load_profile("cpu-local")
    assert cpu.combined_collectives == {"all-reduce"}
    alpha = cpu.interconnect.intra_node.alpha_s
    alone = estimate_step(module, cpu, {})
    pooled = estimate_step(module, dataclasses.replace(
        cpu, combined_collectives=frozenset({"all-reduce", "all-gather"})), {})
    assert alone.seconds_by_category()["communication"] == pytest.approx(
        pooled.seconds_by_category()["communication"])
    assert sum(i.collective.latency_s for i in alone.instructions
               if i.collective) == pytest.approx(3 * alpha)
    ring = load_profile("a100")
    ring_alone = estimate_step(module, dataclasses.replace(
        ring, combined_collectives=frozenset({"all-reduce"})), {})
    ring_pooled = estimate_step(module, ring, {})
    one = collective_cost("all-gather", 8, 8192 * 4, ring).latency_s
    assert (ring_alone.seconds_by_category()["communication"]
            - ring_pooled.seconds_by_category()["communication"]) == pytest.approx(2 * one)
    assert load_profile("a100").combined_collectives == {
        "all-reduce", "all-gather", "reduce-scatter"}


def test_combined_gradients_are_live_together():
    module = parse(MLP_GRADIENTS)
    alone = memory_profile(module, combine_threshold_bytes=0)
    combined = memory_profile(module)
    assert alone.temp_bytes < 2 * 1024 <= 3 * 1024 <= combined.temp_bytes  # 1 vs 3 gradients


def test_group_size_in_every_mode():
    module = parse("""
HloModule g, replica_count=2, num_partitions=4

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY e {
  x = f32[8] parameter(0)
  r = f32[8] all-reduce(x), replica_groups={}, to_apply=add
  g = f32[8] all-reduce(x), replica_groups={{0,1}}, to_apply=add
  p = f32[8] all-reduce(x), channel_id=1, replica_groups={{0,1}}, to_apply=add
  f = f32[8] all-reduce(x), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=add
  ROOT t = (f32[8], f32[8], f32[8], f32[8]) tuple(r, g, p, f)
}
""")
    entry = module.entry
    # (p: a channel without global ids, which XLA holds as false for an all-reduce: its
    # groups name replicas, each with all 4 partitions)
    assert [group_size(entry[n], module) for n in "rgpf"] == [2, 2, 8, 8]


# ------------------------------------------------------------------------ profiles


def test_shipped_profiles_load_and_cite_sources():
    names = available_profiles()
    assert {"tpu-v3", "tpu-v4", "a100", "h100", "h200", "cpu-generic"} <= set(names)
    for name in names:
        profile = load_profile(name)
        assert profile.sources and profile.memory_bandwidth_bytes_per_s > 0


def test_bad_profiles_are_user_errors(tmp_path):
    with pytest.raises(HloShardError, match="unknown profile"):
        load_profile("tpu-v9")
    bad = tmp_path / "p.json"
    bad.write_text("{nope")
    with pytest.raises(HloShardError, match="not a JSON profile"):
        load_profile(str(bad))
    with pytest.raises(HloShardError, match="missing field"):
        profile_from_dict({"name": "x"}, "x.json")
    good = json.loads((resources.files("hlo_shard.profiles") / "cpu-local.json").read_text())
    with pytest.raises(HloShardError, match="combined_collectives"):
        profile_from_dict({**good, "combined_collectives": ["all-to-al"]}, "x.json")


def test_a_module_is_priced_on_the_profile_measured_at_its_device_count():
    """The N devices of XLA CPU share the host's cores: measured here, a device at N = 4
    runs kernels about twice as fast as at N = 8 and meets in a rendezvous in 66 µs, not
    148 µs. The 4-device zoo step of the transformer block was predicted 14.2 ms from the
    8-device rates and measured 6.1 ms; from its own, 6.7 ms."""
    cpu = load_profile("cpu-local")
    assert cpu.calibrated_devices == 8
    four = cpu.for_devices(4)
    assert four.calibrated_devices == 4
    assert four.kernel_overhead_s < cpu.kernel_overhead_s
    assert four.interconnect.intra_node.alpha_s < cpu.interconnect.intra_node.alpha_s
    assert four.combined_collectives == cpu.combined_collectives  # the host's own facts
    assert four.min_predicted_gain == cpu.min_predicted_gain
    assert [cpu.for_devices(n).calibrated_devices for n in (1, 2, 5, 7, 8, 64)] == [
        4, 4, 4, 8, 8, 8]
    a100 = load_profile("a100")
    assert a100.for_devices(4) is a100  # measured once: the same on any count
    module = parse(ADAM)  # replica_count=4
    assert estimate(module, cpu).seconds == pytest.approx(estimate(module, four).seconds)
    eight_only = dataclasses.replace(cpu, at_device_counts=())
    assert estimate(module, cpu).seconds < 0.8 * estimate(module, eight_only).seconds


def test_a_profile_section_at_a_device_count_is_checked(tmp_path):
    good = json.loads((resources.files("hlo_shard.profiles") / "cpu-local.json").read_text())
    with pytest.raises(HloShardError, match=r"at_device_counts.*expected a device count"):
        profile_from_dict({**good, "at_device_counts": {"four": {}}}, "x.json")
    with pytest.raises(HloShardError, match=r"at_device_counts.*kernel_overhead_s"):
        profile_from_dict({**good, "at_device_counts": {"4": {"kernel_overhead_s": -1}}},
                          "x.json")
    without = {k: v for k, v in good.items() if k != "calibrated_devices"}
    with pytest.raises(HloShardError, match="calibrated_devices"):
        profile_from_dict(without, "x.json")



#: Two loop kernels, as XLA writes them once fused (what XLA:CPU's pass hook sees) and
#: as the fusion emulation finds them in the module before fusion.
TWO_KERNELS_FUSED = """HloModule two_kernels, replica_count=8
half {
  p = f32[256] parameter(0)
  c = f32[] constant(0.5)
  b = f32[256] broadcast(c), dimensions={}
  ROOT m = f32[256] multiply(p, b)
}
ENTRY e {
  x = f32[256] parameter(0)
  f = f32[256] fusion(x), kind=kLoop, calls=half
  g = f32[256] fusion(f), kind=kLoop, calls=half
  ROOT t = (f32[256], f32[256]) tuple(f, g)
}
"""
TWO_KERNELS = """HloModule two_kernels, replica_count=8
ENTRY e {
  x = f32[256] parameter(0)
  c = f32[] constant(0.5)
  b = f32[256] broadcast(c), dimensions={}
  f = f32[256] multiply(x, b)
  g = f32[256] multiply(f, b)
  ROOT t = (f32[256], f32[256]) tuple(f, g)
}
"""


def test_the_kernels_of_a_fused_module_pay_their_own_overhead():
    """Issue #26: a whole step as XLA:CPU's hook sees it (optax's nanoLM, every kernel
    explicit) measures about 7.5 us a kernel at N = 8 where the probe of independent
    loops measures 16 us; priced at 16 us, the gate kept nanoLM's update whole though
    sharding it measured 0.79-0.86x. The fused module's kernels pay
    ``fused_kernel_overhead_s``; the kernels the emulation plans still pay
    ``kernel_overhead_s``."""
    cpu = load_profile("cpu-local")
    assert cpu.fused_kernel_overhead_s < 0.6 * cpu.kernel_overhead_s
    four = cpu.for_devices(4)
    assert four.fused_kernel_overhead_s < four.kernel_overhead_s
    fused, unfused = parse(TWO_KERNELS_FUSED), parse(TWO_KERNELS)
    assert len(plan_kernels(unfused.entry, multi_output=cpu.multi_output_fusion).kernels) == 2

    def seconds(module: Module, fused_overhead: float) -> float:
        profile = dataclasses.replace(cpu, fused_kernel_overhead_s=fused_overhead,
                                      at_device_counts=())
        return estimate(module, profile).seconds

    more = cpu.fused_kernel_overhead_s + 1e-6
    assert seconds(fused, more) - seconds(fused, cpu.fused_kernel_overhead_s) == \
        pytest.approx(2e-6)
    assert seconds(unfused, more) == seconds(unfused, cpu.fused_kernel_overhead_s)
    # The same two kernels: fused, their fixed cost is the smaller one.
    assert seconds(unfused, more) - seconds(fused, cpu.fused_kernel_overhead_s) == \
        pytest.approx(2 * (cpu.kernel_overhead_s - cpu.fused_kernel_overhead_s), rel=0.05)


def test_a_profile_without_a_fused_kernel_overhead_uses_its_kernel_overhead():
    good = json.loads((resources.files("hlo_shard.profiles") / "cpu-local.json").read_text())
    del good["fused_kernel_overhead_s"]
    good["at_device_counts"] = {"4": {k: v for k, v in good["at_device_counts"]["4"].items()
                                      if k != "fused_kernel_overhead_s"}}
    profile = profile_from_dict(good, "x.json")
    assert profile.fused_kernel_overhead_s == profile.kernel_overhead_s
    four = profile.for_devices(4)
    assert four.fused_kernel_overhead_s == four.kernel_overhead_s
    assert load_profile("a100").fused_kernel_overhead_s == load_profile("a100").kernel_overhead_s

CONV_STEP = """HloModule conv
ENTRY e { x = f32[2,16,16,8] parameter(0) k = f32[3,3,8,64] parameter(1)
 ROOT y = f32[2,16,16,64] convolution(x, k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f }
"""


def test_convolutions_have_their_own_rate():
    import dataclasses

    base = load_profile("cpu-local").for_devices(1)  # the one-device module's section
    assert base.convolution_rate("f32") != base.matrix_rate("f32")  # measured apart
    slow = dataclasses.replace(base, convolution_flops_per_s={"default": 1e8})
    fast = dataclasses.replace(base, convolution_flops_per_s={"default": 1e12})
    module = parse(CONV_STEP)
    assert estimate(module, slow).seconds > 10 * estimate(module, fast).seconds
    # A profile that does not say: the matrix rates.
    generic = load_profile("cpu-generic")
    assert generic.convolution_flops_per_s == generic.matrix_flops_per_s


def test_step_overhead_is_counted_once_per_step():
    import dataclasses

    base = load_profile("cpu-generic")
    assert base.step_overhead_s == 0 and load_profile("cpu-local").step_overhead_s > 0
    module = parse(ADAM)
    with_overhead = dataclasses.replace(base, step_overhead_s=1e-3)
    assert estimate(module, with_overhead).seconds == pytest.approx(
        estimate(module, base).seconds + 1e-3)


def test_each_output_leaf_after_the_first_pays_the_output_overhead():
    """XLA CPU's runtime hands back a buffer per output leaf and device: 13 us a leaf at
    N = 8 where a kernel costs 16 (measured apart by calibrate's probes). The step
    overhead was measured with one output, so a one-leaf module pays nothing more."""
    import dataclasses

    base = load_profile("cpu-generic")
    assert base.output_overhead_s == 0 and load_profile("cpu-local").output_overhead_s > 0
    module = parse(ADAM)
    leaves = len(module.entry.root.operands)
    assert leaves > 1
    with_outputs = dataclasses.replace(base, output_overhead_s=1e-3)
    assert estimate(module, with_outputs).seconds == pytest.approx(
        estimate(module, base).seconds + (leaves - 1) * 1e-3)
    one_leaf = parse("""
HloModule one
ENTRY e {
  x = f32[8] parameter(0)
  ROOT y = f32[8] add(x, x)
}
""")
    assert estimate(one_leaf, with_outputs).seconds == pytest.approx(
        estimate(one_leaf, base).seconds)


# ------------------------------------------------------------------------ estimate


def test_adam_step_split_and_update_share():
    module = parse(ADAM)
    est = estimate(module, load_profile("tpu-v3"))
    by = est.seconds_by_category()
    assert est.seconds == pytest.approx(sum(by.values()))
    assert by["weight_update"] > by["forward_backward"] > 0
    assert by["communication"] == pytest.approx(est.collectives()["all-reduce"].seconds)
    assert by["formatting"] == 0
    # The update kernel moves 28 MiB at 450 GB/s.
    assert by["weight_update"] == pytest.approx(28 * 2 ** 20 / 450e9, rel=0.05)


def test_predicted_step_of_a_module_and_its_copy_are_equal():
    module = parse(ADAM)
    profile = load_profile("cpu-generic")
    assert predicted_step_seconds(parse(ADAM), profile) == predicted_step_seconds(module, profile)


def test_calibration_prices_a_collective_as_the_slope_of_a_chain():
    """α is what each further all-reduce adds to a step (issue #12): one all-reduce less
    an empty step measured a third of it, and the gate saw gathered mode's extra
    collectives as nearly free. The chain probe is dependent all-reduces, parsed as
    HLO."""
    from hlo_shard.runtime import calibrate

    seconds = dict.fromkeys(calibrate._probes(8), 1.0) | {
        "overhead": 0.3e-3, "small_all_reduce": 0.35e-3,
        "all_reduce_chain": 0.35e-3 + (calibrate.ALL_REDUCE_CHAIN - 1) * 0.12e-3,
        "cache_base": 0.5, "large_all_reduce": 2.0}
    link = calibrate.profile_from_measurements(8, seconds)["interconnect"]["intra_node"]
    assert link["alpha_s"] == pytest.approx(0.12e-3)
    chain = parse(calibrate._module(8, calibrate._probes(8)["all_reduce_chain"]))
    opcodes = [i.opcode for i in chain.entry.instructions]
    assert opcodes.count("all-reduce") == calibrate.ALL_REDUCE_CHAIN


def test_calibration_takes_the_smallest_transposed_read_factor_over_the_sizes():
    """Each size's probe pair gives the extra time of reading its matrices transposed, in
    streaming reads of them; the profile keeps the smallest (pricing an input's
    transposed reads too high would overstate what removing them gains)."""
    from hlo_shard.runtime import calibrate

    seconds = dict.fromkeys(calibrate._probes(8), 1.0) | {
        "overhead": 0.0, "stream": 3 * 4 * calibrate.STREAM / 8e9,
        "cache_base": 0.5, "large_all_reduce": 2.0}
    factors = (6.0, 4.0, 9.0)
    for k, ((rows, columns), factor) in enumerate(zip(calibrate.REORDERED, factors)):
        read = calibrate._reordered_count(rows, columns) * 4 * rows * columns / 8e9
        seconds[f"reordered_base_{k}"] = 0.01
        seconds[f"reordered_{k}"] = 0.01 + (factor - 1) * read
    profile = calibrate.profile_from_measurements(8, seconds)
    assert profile["reordered_read_factor"] == pytest.approx(4.0)
    probe = parse(calibrate._module(8, calibrate._probes(8)["reordered_0"]))
    transposes = [i for i in probe.entry.instructions if i.opcode == "transpose"]
    assert len(transposes) == calibrate._reordered_count(*calibrate.REORDERED[0]) > 1


_DONATION = """HloModule step, input_output_alias={ {0}: (0, {}, may-alias) }

ENTRY main {
  w = f32[16777216]{0} parameter(0)
  x = f32[16777216]{0} parameter(1)
  neww = f32[16777216]{0} negate(w)
  out = f32[16777216]{0} negate(x)
  small = f32[1024]{0} slice(x), slice={[0:1024]}
  ROOT t = (f32[16777216]{0}, f32[16777216]{0}, f32[1024]{0}) tuple(neww, out, small)
}
"""


def test_only_non_donated_outputs_pay_the_fresh_buffer_write_rate():
    # cpu-local's write rate is a fresh buffer's (page faults): a donated output reuses
    # its parameter's pages, so the same loop writing it is priced at the read rate; so
    # is an output below the allocator's mmap threshold (64 MiB here, 4 KiB ``small``).
    profile = load_profile("cpu-local").for_devices(1)  # the section the module gets
    assert profile.memory_write_bandwidth_bytes_per_s < profile.memory_bandwidth_bytes_per_s
    seconds = {e.name: e.seconds for e in estimate(parse(_DONATION), profile).instructions}
    nbytes = 64 << 20
    assert nbytes > profile.fresh_temp_threshold_bytes > 4096
    # XLA CPU's loops stream and compute in turn: one negation per element adds up.
    assert not profile.overlaps_compute_and_memory
    fixed = (1 << 24) / profile.vector_rate("f32") + profile.kernel_overhead_s
    assert seconds["neww"] == pytest.approx(profile.memory_seconds(nbytes, nbytes, True) + fixed)
    assert seconds["out"] == pytest.approx(profile.memory_seconds(nbytes, nbytes) + fixed)
    assert seconds["out"] > 2 * seconds["neww"]
    assert seconds["small"] == pytest.approx(profile.memory_seconds(4096, 4096, True)
                                             + profile.kernel_overhead_s)


def test_a_slice_of_a_bitcast_reads_only_its_window():
    # The gathered bucket is reshaped (a bitcast) and sliced per tensor: each slice
    # reads its own 512 bytes, not the bucket (it was priced as reading all of it, so
    # every bucketed all-gather looked 15 times as expensive to unpack as it is).
    plan = plan_kernels(parse("""HloModule m
ENTRY e {
  b = f32[65536]{0} parameter(0)
  r = f32[8,8192]{1,0} reshape(b)
  s = f32[8,16]{1,0} slice(r), slice={[0:8], [4096:4112]}
  ROOT o = f32[128]{0} reshape(s)
}
""").entry, True, False)
    kernel = plan.kernel_of["s"]
    assert kernel.read_bytes == 512 and kernel.write_bytes == 512


_BUCKETED_PRODUCTS = """HloModule m
ENTRY e {
  x = f32[16]{0} parameter(0)
  w0 = f32[16]{0} parameter(1)
  w1 = f32[16]{0} parameter(2)
  g0 = f32[16]{0} multiply(w0, x)
  g1 = f32[16]{0} multiply(w1, x)
  r0 = f32[4,4]{1,0} reshape(g0)
  r1 = f32[4,4]{1,0} reshape(g1)
  ROOT b = f32[4,8]{1,0} concatenate(r0, r1), dimensions={1}
}
"""


def test_a_product_read_through_a_bitcast_by_its_kernel_is_not_written():
    """The pass's gradient bucket: each product is reshaped into rows (a bitcast) and
    concatenated. The products join the concatenate's kernel, which reads them through
    the bitcasts, as XLA fuses them: nothing is written but the bucket. They were
    counted as values in memory, written at the kernel's end yet read by their reshape
    before it, whose inverted lifetimes the memory model then scanned at every
    allocation (optimize grew 2.2x per doubling on such a module)."""
    module = parse(_BUCKETED_PRODUCTS)
    plan = plan_kernels(module.entry, True, False)
    kernel = plan.kernel_of["b"]
    assert {m.name for m in kernel.members} == {"g0", "g1", "b"}
    assert plan.materialized == {"b"}
    assert kernel.write_bytes == 32 * 4 and kernel.read_bytes == 3 * 16 * 4
    memory = memory_profile(module)
    assert memory.temp_bytes == 0, memory


def test_a_product_also_read_outside_its_kernel_is_written():
    """The same product read by the root besides the bucket is a value in memory."""
    text = _BUCKETED_PRODUCTS.replace("ROOT b = f32[4,8]{1,0} concatenate(r0, r1), "
                                      "dimensions={1}",
                                      "b = f32[4,8]{1,0} concatenate(r0, r1), dimensions={1}\n"
                                      "  ROOT t = (f32[4,8]{1,0}, f32[4,4]{1,0}) tuple(b, r0)")
    plan = plan_kernels(parse(text).entry, True, False)
    assert plan.materialized == {"b", "g0"}


def test_reduces_run_at_the_reduction_rate_and_cpu_loops_add_compute_to_memory():
    profile = load_profile("cpu-local").for_devices(1)  # the section the module gets
    assert profile.reduction_elements_per_s < profile.vector_rate("f32")
    assert not profile.overlaps_compute_and_memory and load_profile("h100").overlaps_compute_and_memory
    module = parse("""HloModule m
add { a = f32[] parameter(0) b = f32[] parameter(1) ROOT s = f32[] add(a, b) }
ENTRY e {
  x = f32[1048576]{0} parameter(0)
  z = f32[] constant(0)
  ROOT r = f32[] reduce(x, z), dimensions={0}, to_apply=add
}
""")
    seconds = {e.name: e.seconds for e in estimate(module, profile).instructions}
    streaming = profile.memory_seconds(4 << 20, 4)
    assert seconds["r"] == pytest.approx((1 << 20) / profile.reduction_elements_per_s
                                         + streaming + profile.kernel_overhead_s, rel=1e-4)
    overlapping = dataclasses.replace(profile, overlaps_compute_and_memory=True)
    seconds = {e.name: e.seconds for e in estimate(module, overlapping).instructions}
    assert seconds["r"] == pytest.approx(max((1 << 20) / profile.reduction_elements_per_s,
                                             streaming) + profile.kernel_overhead_s, rel=1e-4)


def test_calibration_derives_streaming_reduction_and_kernel_rates():
    from hlo_shard.runtime import calibrate

    stream_bytes = 3 * 4 * calibrate.STREAM
    seconds = dict.fromkeys(calibrate._probes(8), 1.0) | {
        "overhead": 1e-4, "stream": 1e-4 + stream_bytes / 8e9,
        "cache_base": 0.5, "large_all_reduce": 2.0,
        "kernels_base": 2e-4, "loops_base": 2e-4,
        # Each extra loop: a kernel (16 us) that streams 4 KiB in and out, copied again
        # into the concatenate; each extra returned in-place loop also an output (13 us).
        "loops": 2e-4 + (calibrate.LOOPS - calibrate.LOOPS_BASE) * (16e-6 + 4 * 4 * calibrate.SMALL / 8e9),
        "kernels": 2e-4 + (calibrate.KERNELS - 1) * (29e-6 + 2 * 4 * calibrate.SMALL / 8e9)}
    seconds["reduction"] = 1e-4 + 4 * calibrate.ELEMENTS / 8e9 + calibrate.ELEMENTS / 2e9
    profile = calibrate.profile_from_measurements(8, seconds)
    assert profile["memory_bandwidth_bytes_per_s"] == pytest.approx(8e9)
    assert profile["reduction_elements_per_s"] == pytest.approx(2e9)
    assert profile["kernel_overhead_s"] == pytest.approx(16e-6)
    assert profile["output_overhead_s"] == pytest.approx(13e-6)
    assert profile["cache_bandwidth_bytes_per_s"] >= profile["memory_bandwidth_bytes_per_s"]
    assert profile_from_dict(profile, "calibrated").overlaps_compute_and_memory is False
    probes = {name: parse(calibrate._module(8, body)) for name, body in calibrate._probes(8).items()}
    loops = [i for i in probes["kernels"].entry.instructions if i.opcode == "multiply"]
    assert len(loops) == calibrate.KERNELS
    # The loops probe's concatenate is too wide for XLA CPU to fuse its operands into.
    (concatenate,) = [i for i in probes["loops"].entry.instructions
                      if i.opcode == "concatenate"]
    assert len(concatenate.operands) == calibrate.LOOPS
    assert calibrate.LOOPS > calibrate.LOOPS_BASE > load_profile("cpu-local").fused_concatenate_operands


def test_calibrate_carries_the_fields_its_probes_cannot_measure() -> None:
    """``calibrate --write`` replaces cpu-local.json: the fused-kernel overhead (measured
    on whole fused steps, not by its probes) survives, at every device count."""
    from hlo_shard.runtime import calibrate

    previous = {"fused_kernel_overhead_s": 7.5e-6,
                "at_device_counts": {"4": {"fused_kernel_overhead_s": 4.5e-6}}}
    measured = {"kernel_overhead_s": 16e-6, "sources": ["probes"],
                "at_device_counts": {"4": {"kernel_overhead_s": 9e-6}, "2": {}}}
    profile = calibrate.carry_unmeasured(measured, previous)
    assert profile["fused_kernel_overhead_s"] == 7.5e-6
    assert profile["at_device_counts"]["4"]["fused_kernel_overhead_s"] == 4.5e-6
    assert "fused_kernel_overhead_s" not in profile["at_device_counts"]["2"]
    assert any("carried over" in line for line in profile["sources"])
    shipped = profile_json("cpu-local")[0]
    assert isinstance(shipped, dict)
    assert set(calibrate.CARRIED_FIELDS) <= set(shipped)


TUPLE_ALL_REDUCE = """
HloModule tuple_all_reduce, num_partitions=8
add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT s = f32[] add(x, y) }
ENTRY e {
  a = f32[256] parameter(0) b = f32[256] parameter(1) c = f32[256] parameter(2)
  d = f32[768] parameter(3)
  t = (f32[256], f32[256], f32[256]) all-reduce(a, b, c), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=add
  one = f32[768] all-reduce(d), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=add
  ROOT r = ((f32[256], f32[256], f32[256]), f32[768]) tuple(t, one)
}
"""


def test_a_tuple_all_reduce_meets_once_per_operand_on_shared_memory():
    """XLA CPU's tuple all-reduce (what its combiner makes of several) runs one rendezvous
    per operand buffer: measured 2.0 ms for 11 buffers of 1 KiB at N = 8, against 0.28 ms
    for the one buffer of their concatenation. A ring all-reduce pays one latency."""
    module = parse(TUPLE_ALL_REDUCE)
    cpu = load_profile("cpu-local")
    latency = {i.name: i.collective.latency_s for i in estimate_step(module, cpu, {}).instructions
               if i.collective}
    alpha = cpu.interconnect.intra_node.alpha_s
    assert latency == {"t": pytest.approx(3 * alpha), "one": pytest.approx(alpha)}
    ring = load_profile("a100")
    ring_latency = {i.name: i.collective.latency_s
                    for i in estimate_step(module, ring, {}).instructions if i.collective}
    assert ring_latency["t"] == pytest.approx(ring_latency["one"])


def _concatenate_of_updates(count: int) -> Module:
    params = "\n  ".join(f"p{i} = f32[64] parameter({i})" for i in range(count))
    updates = "\n  ".join(f"new{i} = f32[64] multiply(p{i}, p{i})" for i in range(count))
    operands = ", ".join(f"new{i}" for i in range(count))
    return parse(f"""HloModule m

ENTRY e {{
  {params}
  {updates}
  ROOT c = f32[{64 * count}] concatenate({operands}), dimensions={{0}}
}}
""")


@pytest.mark.parametrize("count, kernels", [(8, 1), (9, 10)])
def test_xla_cpu_fuses_producers_into_a_concatenate_of_at_most_8_operands(count, kernels):
    """``cpu_instruction_fusion.cc`` (kMaxConcatenateArguments = 8): a wider concatenate,
    such as the bucket of ten updated shards, copies producers that are kernels of
    their own (the optimized ten-tensor LayerNorm MLP: ten update loops, then the
    concatenate)."""
    module = _concatenate_of_updates(count)
    cpu = load_profile("cpu-local")
    assert cpu.fused_concatenate_operands == 8
    plan = plan_kernels(module.entry, multi_output=False,
                        concatenate_operands=cpu.fused_concatenate_operands)
    assert len(plan.kernels) == kernels
    assert len(plan_kernels(module.entry, multi_output=False).kernels) == 1


#: A gradient computed transposed ({0,1}: the bytes of its [768,768] transpose), squared
#: and summed for a global norm, as the SPMD partitioner writes a TP/data mesh's step.
TRANSPOSED_NORM = """HloModule m

add {{ a = f32[] parameter(0) b = f32[] parameter(1) ROOT s = f32[] add(a, b) }}

ENTRY e {{
  g = f32[768,768]{{1,0}} parameter(0)
  t = f32[768,768]{{{layout}}} {relayout}
  sq = f32[768,768]{{{layout}}} multiply(t, t)
  z = f32[] constant(0)
  ROOT r = f32[] reduce(sq, z), dimensions={{0,1}}, to_apply=add
}}
"""


@pytest.mark.parametrize("layout, relayout, kernels", [
    ("0,1", "transpose(g), dimensions={1,0}", 2), ("1,0", "copy(g)", 1)],
    ids=["transposed", "row-major"])
def test_xla_cpu_copies_a_reduces_operand_into_row_major_first(layout, relayout, kernels):
    """XLA:CPU compiles the transposed sum as ``transpose_copy_fusion`` then the reduce
    (measured on 8 devices: 2.8-3.0 ms against 0.7-0.9 ms for the row-major one): the
    reduce takes no producers in, its operand is a kernel of its own. A profile without
    ``row_major_reductions`` fuses both."""
    module = parse(TRANSPOSED_NORM.format(layout=layout, relayout=relayout))
    cpu = load_profile("cpu-local")
    assert cpu.row_major_reductions and not load_profile("h100").row_major_reductions
    plan = plan_kernels(module.entry, multi_output=False, row_major_reductions=True)
    assert len(plan.kernels) == kernels
    assert len(plan_kernels(module.entry, multi_output=False).kernels) == 1
    slower = predicted_step_seconds(module, cpu) > predicted_step_seconds(
        parse(TRANSPOSED_NORM.format(layout="1,0", relayout="copy(g)")), cpu)
    assert slower == (kernels == 2)


@pytest.mark.parametrize("profile", ["h100", "cpu-local"])
def test_one_estimate_finds_each_computations_plans_and_buckets_once(monkeypatch, profile):
    """The parts of one estimate that read a computation's combiner buckets (the
    collectives' prices, the memory schedule, the donated copies) share them, and the
    step's time and its memory share the kernel plan wherever the profile fuses as the
    memory model does (the accelerators): each found once per estimate, not once per
    part that reads it."""
    from hlo_shard.costmodel import kernels, network

    planned: dict[tuple[str, tuple], int] = {}
    bucketed: dict[str, int] = {}
    real_plan, real_buckets = kernels.plan_kernels, network.combiner_buckets

    def plan(comp, *settings):
        planned[comp.name, settings] = planned.get((comp.name, settings), 0) + 1
        return real_plan(comp, *settings)

    def buckets(module, comp, *settings):
        bucketed[comp.name] = bucketed.get(comp.name, 0) + 1
        return real_buckets(module, comp, *settings)

    hardware = load_profile(profile)
    shared = not hardware.row_major_reductions and hardware.multi_output_fusion
    for text in (ADAM, LOOP):
        module = parse(text)
        regions = planned_update_regions(module)
        planned.clear()
        bucketed.clear()
        monkeypatch.setattr(kernels, "plan_kernels", plan)
        monkeypatch.setattr(network, "combiner_buckets", buckets)
        estimate_step(module, hardware, regions)
        monkeypatch.undo()
        assert set(planned.values()) == set(bucketed.values()) == {1}
        # The entry is planned once with the accelerator's settings, twice with XLA
        # CPU's (the memory model's settings are the defaults).
        entry_plans = sum(1 for name, _ in planned if name == module.entry.name)
        assert entry_plans == (1 if shared else 2)


def test_a_module_xla_fused_already_is_planned_once_whatever_the_fusion_settings():
    # Each of its instructions is a kernel of its own: the step's time (on the profile's
    # settings) and its memory (on the defaults) share one plan per computation.
    from pathlib import Path

    from hlo_shard.costmodel.kernels import KernelPlans
    from hlo_shard.parser import parse_file

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "optimized" / "adam.n4.hlo"
    entry = parse_file(fixture).entry
    plans = KernelPlans()
    plan = plans.plan(entry, False)
    assert plans.plan(entry, False, False, 8, True) is plan
    assert [k.members for k in plan.kernels] == \
        [k.members for k in plan_kernels(entry, False, False, 8, True).kernels]
    assert all(len(kernel.members) == 1 for kernel in plan.kernels)
    assert plans.plan(entry, True, False, 8, True) is not plans.plan(entry, True)


#: A step XLA has fused, sharded: the SGD update of a weight's shard is a loop fusion
#: after the gradient's reduce-scatter, its result all-gathered into the output; a batch
#: mean summed over the devices normalises the activations (a loop fusion too) that feed
#: the next dot, whose result is the other output.
FUSED_SHARDED = """HloModule fused_sharded, replica_count=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%sgd_update (p0: f32[64], p1: f32[64]) -> f32[64] {
  %p0 = f32[64] parameter(0)
  %p1 = f32[64] parameter(1)
  %lr = f32[] constant(0.01)
  %lrs = f32[64] broadcast(%lr), dimensions={}
  %step = f32[64] multiply(%lrs, %p1)
  ROOT %new = f32[64] subtract(%p0, %step)
}

%normalise (q0: f32[8,16], q1: f32[16]) -> f32[8,16] {
  %q0 = f32[8,16] parameter(0)
  %q1 = f32[16] parameter(1)
  %mean = f32[8,16] broadcast(%q1), dimensions={1}
  ROOT %centred = f32[8,16] subtract(%q0, %mean)
}

ENTRY %step (w_shard: f32[64], g: f32[256], x: f32[8,16], v: f32[16,16]) -> (f32[256], f32[8,16]) {
  %g = f32[256] parameter(1)
  %gs = f32[64] reduce-scatter(%g), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %w_shard = f32[64] parameter(0)
  %updated = f32[64] fusion(%w_shard, %gs), kind=kLoop, calls=%sgd_update
  %w = f32[256] all-gather(%updated), replica_groups={{0,1,2,3}}, dimensions={0}
  %x = f32[8,16] parameter(2)
  %zero = f32[] constant(0)
  %column_sums = f32[16] reduce(%x, %zero), dimensions={0}, to_apply=%add
  %batch_sums = f32[16] all-reduce(%column_sums), replica_groups={{0,1,2,3}}, to_apply=%add
  %centred = f32[8,16] fusion(%x, %batch_sums), kind=kLoop, calls=%normalise
  %v = f32[16,16] parameter(3)
  %y = f32[8,16] dot(%centred, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %out = (f32[256], f32[8,16]) tuple(%w, %y)
}
"""


def test_the_update_of_a_fused_sharded_module_is_its_loop_fusions():
    # The sharded update is a fusion after the reduce-scatter; the normalisation by a
    # summed batch statistic only feeds a dot: forward/backward work, not the update.
    module = parse(FUSED_SHARDED)
    categories, source = categorize(module, module.entry, planned_update_regions(module))
    assert source == "fallback"
    assert categories["updated"] == "weight_update"
    assert categories["centred"] == "forward_backward"
    assert categories["y"] == "forward_backward"
    assert categories["gs"] == categories["w"] == "communication"


def test_a_sharded_global_norms_partial_sums_are_update_work():
    # clip_by_global_norm on shards: each shard's squares are reduced to a partial sum,
    # the partial sums are summed across devices (one bucket of one-element sums) and
    # read back one element each. That is the update's work, as the squares of the
    # whole gradients are in the original; a diff must not show it as forward/backward.
    from pathlib import Path

    from hlo_shard import optimize
    from hlo_shard.graph import users_map
    from hlo_shard.parser import parse_file
    from hlo_shard.passes.weight_update import ShardingOptions

    path = Path(__file__).resolve().parents[1] / "fixtures" / "spmd" / "clip_adam.n8.hlo"
    original = parse_file(path)
    before = estimate_step(original, load_profile("cpu-local"),
                           planned_update_regions(original)).seconds_by_category()
    module = optimize(parse_file(path), ShardingOptions(), force=True).module
    comp = module.entry
    sums = [i for i in comp.instructions if i.opcode == "all-reduce"
            and all(comp[u].opcode == "slice" for u in users_map(comp)[i.name])]
    assert sums, "the sharded norm's partial sums are one bucket"
    categories, source = categorize(module, comp, planned_update_regions(module))
    assert source == "fallback"
    squares, stack = [], list(sums[0].operands)
    while stack:  # the partial sums behind the bucket's concatenation and reshapes
        inst = comp[stack.pop()]
        if inst.opcode == "reduce":
            squares.append(inst.name)
        elif inst.opcode in ("concatenate", "reshape", "bitcast"):
            stack.extend(inst.operands)
    assert squares and all(categories[name] == "weight_update" for name in squares)
    after = estimate_step(module, load_profile("cpu-local"),
                          planned_update_regions(module)).seconds_by_category()
    assert after["forward_backward"] <= before["forward_backward"] * 1.01
