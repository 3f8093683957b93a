"""Gradient accumulation: the all-reduce of each microbatch's gradient leaves the loop
(``accumulation-motion``), and the weight-update sharding then reduce-scatters the
accumulated gradient once per step, after the loop.

Structure on small hand-written loops (fast), numbers through real XLA on 8 CPU devices
(the original against the pass's output, and a mutant the check must call DIFFER), and
real jax steps: a ``lax.scan`` over 4 microbatches and ``optax.MultiSteps`` (slow).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from hlo_shard import runtime
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.graph import Rewriter, is_zero
from hlo_shard.ir import Module
from hlo_shard.parser import parse
from hlo_shard.passes.accumulation_motion import AccumulationMotion, AccumulationReport
import hlo_shard
from hlo_shard.passes.pipeline import Pipeline, validate_printed
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.printer import to_text

from wus_helpers import ADD, MAX, find, optimize, row

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")

#: A data-parallel step accumulating 4 microbatches: per-device data %x, gradients
#: %gw (through a transpose) and %gb summed into slots 1 and 2, one SGD update after.
LOOP = f"""HloModule accumulate, replica_count=8
{ADD}
cond {{ p = (s32[], f32[16,32], f32[32], f32[32,16], f32[4,2,32]) parameter(0)
 i = s32[] get-tuple-element(p), index=0 n = s32[] constant(4)
 ROOT lt = pred[] compare(i, n), direction=LT }}
body {{ p = (s32[], f32[16,32], f32[32], f32[32,16], f32[4,2,32]) parameter(0)
 i = s32[] get-tuple-element(p), index=0
 accw = f32[16,32] get-tuple-element(p), index=1 accb = f32[32] get-tuple-element(p), index=2
 w = f32[32,16] get-tuple-element(p), index=3 xs = f32[4,2,32] get-tuple-element(p), index=4
 z = s32[] constant(0) xi = f32[1,2,32] dynamic-slice(xs, i, z, z), dynamic_slice_sizes={{1,2,32}}
 x = f32[2,32] reshape(xi)
 y = f32[2,16] dot(x, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
 t = f32[2,16] tanh(y)
 gw = f32[16,32] dot(t, x), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
 arw = f32[16,32] all-reduce(gw), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=add
 tw = f32[16,32] copy(arw) naccw = f32[16,32] add(accw, tw)
 f0 = f32[] constant(0)
 gb = f32[32] reduce(x, f0), dimensions={{0}}, to_apply=add
 arb = f32[32] all-reduce(gb), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=add
 naccb = f32[32] add(arb, accb)
 one = s32[] constant(1) ni = s32[] add(i, one)
 ROOT r = (s32[], f32[16,32], f32[32], f32[32,16], f32[4,2,32]) tuple(ni, naccw, naccb, w, xs) }}
ENTRY e {{ w = f32[32,16] parameter(0) b = f32[32] parameter(1)
 xs = f32[4,2,32] parameter(2), parameter_replication={{false}}
 z = s32[] constant(0) f0 = f32[] constant(0)
 zw = f32[16,32] broadcast(f0), dimensions={{}}
 init = (s32[], f32[16,32], f32[32], f32[32,16], f32[4,2,32]) tuple(z, zw, b, w, xs)
 loop = (s32[], f32[16,32], f32[32], f32[32,16], f32[4,2,32]) while(init), condition=cond, body=body
 gw = f32[16,32] get-tuple-element(loop), index=1 gb = f32[32] get-tuple-element(loop), index=2
 gwt = f32[32,16] transpose(gw), dimensions={{1,0}}
 lr = f32[] constant(0.01) lrw = f32[32,16] broadcast(lr), dimensions={{}}
 lrb = f32[32] broadcast(lr), dimensions={{}}
 uw = f32[32,16] multiply(gwt, lrw) nw = f32[32,16] subtract(w, uw)
 ub = f32[32] multiply(gb, lrb) nb = f32[32] subtract(b, ub)
 ROOT out = (f32[32,16], f32[32]) tuple(nw, nb) }}
"""


#: LOOP with the bias gradient as the partitioner writes an FSDP one: each device's rows
#: of the sum (rows that differ per device, so a wrong row shows) cut out by
#: replica-id before they are accumulated into slot 2.
SLICED = LOOP.replace(
    "arb = f32[32] all-reduce(gb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add\n "
    "naccb = f32[32] add(arb, accb)",
    "g8 = f32[8,32] broadcast(gb), dimensions={1} rows = f32[8,32] iota(), iota_dimension=0 "
    "gbb = f32[8,32] multiply(g8, rows) "
    "arb = f32[8,32] all-reduce(gbb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add "
    "rid = u32[] replica-id() row = s32[] convert(rid) "
    "ds = f32[1,32] dynamic-slice(arb, row, z), dynamic_slice_sizes={1,32} "
    "mine = f32[32] reshape(ds) naccb = f32[32] add(mine, accb)")


def motion(text: str, sliced: bool = False, memory_bytes: int = 0, upcast: bool = False
           ) -> tuple[Module, AccumulationReport]:
    module = parse(text)
    result = Pipeline((AccumulationMotion(sliced=sliced, memory_bytes=memory_bytes,
                                          upcast=upcast),),
                      check=validate_printed).run(module)
    report = result.report(AccumulationReport)
    return module, report


def body_collectives(module: Module) -> list[str]:
    return [i.name for i in module.computation("body").instructions if i.opcode in COLLECTIVES]


# ------------------------------------------------------------------- structure (fast)


def test_accumulated_all_reduces_leave_the_loop():
    module, report = motion(LOOP)
    assert body_collectives(module) == []
    after = find(module, "all-reduce")
    assert [module.entry[a.operands[0]].int_attr("index") for a in after] == [1, 2]
    assert {m.all_reduce for m in report.moved} == {"arw", "arb"} and not report.kept
    # slot 2 started at %b: the loop now starts it at zero and adds %b after the sum
    init = module.entry["init"]
    assert module.entry[init.operands[2]].opcode == "broadcast"
    (added,) = [i for i in find(module, "add") if "b" in i.operands]
    assert module.entry[added.operands[1]].opcode == "all-reduce"
    assert "one collective per step instead of one per iteration" in report.notes[0]


def test_a_module_that_calls_back_into_the_host_keeps_its_sums_in_the_loop():
    """A collective moved beside a host callback can deadlock XLA:CPU (the callback needs
    a worker thread the devices waiting in the collective hold): the sums stay."""
    text = LOOP.replace(" ROOT out = (f32[32,16], f32[32]) tuple(nw, nb) }",
                        ' cb = () custom-call(nw), custom_call_target="xla_python_cpu_callback",'
                        " custom_call_has_side_effect=true"
                        " ROOT out = (f32[32,16], f32[32]) tuple(nw, nb) }")
    module, report = motion(text)
    assert sorted(body_collectives(module)) == ["arb", "arw"]
    assert not report.moved


def test_the_sharding_pipeline_reduce_scatters_once_after_the_loop():
    """The optimizer's pipeline (motion first): no collective left in the loop body, one
    reduce-scatter after it (the two gradients in one bucket) and a sharded update."""
    module, report = optimize(LOOP)
    assert body_collectives(module) == []
    assert [r for r in report.explanations if r.sharded]
    assert len(find(module, "reduce-scatter")) == 1 and not find(module, "all-reduce")
    assert any("moved after the loop" in note for note in report.notes)


def test_an_accumulator_read_in_the_body_stays():
    # the microbatch's gradient depends on the partial sum: each iteration must see
    # the all-reduced partial sums
    text = LOOP.replace("gb = f32[32] reduce(x, f0), dimensions={0}, to_apply=add",
                        "gx = f32[32] reduce(x, f0), dimensions={0}, to_apply=add "
                        "gb = f32[32] multiply(gx, accb)")
    assert text != LOOP
    module, report = motion(text)
    assert body_collectives(module) == ["arb"]
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("arb", "accumulator-read")]
    assert [m.all_reduce for m in report.moved] == ["arw"]


#: jax's mean over microbatches: each gradient divided by their count, then accumulated.
MEAN = LOOP.replace("tw = f32[16,32] copy(arw) naccw = f32[16,32] add(accw, tw)",
                    "four = f32[] constant(4) fw = f32[16,32] broadcast(four), dimensions={} "
                    "tw = f32[16,32] divide(arw, fw) naccw = f32[16,32] add(accw, tw)").replace(
    "naccb = f32[32] add(arb, accb)",
    "q = f32[] constant(0.25) qb = f32[32] broadcast(q), dimensions={} "
    "sb = f32[32] multiply(qb, arb) naccb = f32[32] add(sb, accb)")


def test_a_mean_over_microbatches_moves_too():
    assert MEAN.count("divide(arw, fw)") == 1 and MEAN.count("multiply(qb, arb)") == 1
    module, report = motion(MEAN)
    assert body_collectives(module) == [] and len(report.moved) == 2


@pytest.mark.parametrize("edit", [
    ("divide(arw, fw)", "divide(fw, arw)"),  # not linear in the sum
    ("four = f32[] constant(4)", "four = f32[] constant(0)"),  # a zero divisor
    ("fw = f32[16,32] broadcast(four), dimensions={}",
     "fw = f32[16,32] transpose(w), dimensions={1,0}"),  # not a constant
])
def test_a_scale_that_is_not_a_constant_factor_stays(edit):
    module, report = motion(MEAN.replace(*edit))
    assert body_collectives(module) == ["arw"]
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("arw", "not-accumulated")]


@pytest.mark.parametrize("edit, reason", [
    # the condition reads the accumulator: the trip count would see partial sums
    (("ROOT lt = pred[] compare(i, n), direction=LT",
      "ab = f32[32] get-tuple-element(p), index=2 a0 = f32[1] slice(ab), slice={[0:1]} "
      "a = f32[] reshape(a0) big = f32[] constant(1e30) "
      "small = pred[] compare(a, big), direction=LT c = pred[] compare(i, n), direction=LT "
      "ROOT lt = pred[] and(c, small)"), "accumulator-read"),
    # a convert between the sum and the accumulation rounds the sum in another type
    (("naccb = f32[32] add(arb, accb)",
      "h = f16[32] convert(arb) hf = f32[32] convert(h) naccb = f32[32] add(hf, accb)"),
     "converted"),
    # the accumulation is also used in the body
    (("one = s32[] constant(1)", "dead = f32[32] negate(naccb) one = s32[] constant(1)"),
     "slot-not-carried"),
    # accumulated into another slot than the one it reads
    (("tuple(ni, naccw, naccb, w, xs)", "tuple(ni, naccw, accb, w, xs)"),
     "slot-not-carried"),
    # each device accumulates its slice of the sum (the partitioner's FSDP form): moved,
    # the loop would carry the whole gradient
    (("arb = f32[32] all-reduce(gb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add\n "
      "naccb = f32[32] add(arb, accb)",
      "gbb = f32[8,32] broadcast(gb), dimensions={1} "
      "arb = f32[8,32] all-reduce(gbb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add "
      "rid = u32[] replica-id() row = s32[] convert(rid) "
      "ds = f32[1,32] dynamic-slice(arb, row, z), dynamic_slice_sizes={1,32} "
      "mine = f32[32] reshape(ds) naccb = f32[32] add(mine, accb)"), "sliced"),
    # not a sum
    (("arb = f32[32] all-reduce(gb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add",
      "arb = f32[32] all-reduce(gb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=mx"),
     "not-summing"),
])
def test_what_cannot_be_proven_stays(edit, reason):
    text = LOOP.replace(f"{ADD}\n", f"{ADD}\n{MAX}\n").replace(*edit)
    assert edit[1] in text
    module, report = motion(text)
    assert "arb" in body_collectives(module)
    assert ("arb", reason) in [(k.all_reduce, k.reason) for k in report.kept]
    assert any("%arb stays in the loop" in note for note in report.notes)


@pytest.mark.parametrize("edit, reason", [
    (("ROOT out = (f32[32,16], f32[32]) tuple(nw, nb)",
      "ROOT out = ((s32[], f32[16,32], f32[32], f32[32,16], f32[4,2,32]), f32[32,16]) "
      "tuple(loop, nw)"), "result-whole"),
    (("ROOT out = (f32[32,16], f32[32]) tuple(nw, nb)",
      "ROOT out = ((s32[], f32[16,32], f32[32], f32[32,16], f32[4,2,32]), f32[32,16]) "
      "tuple(init, nw)"), "shared-init"),
])
def test_a_loop_that_cannot_be_rewired_is_left_alone(edit, reason):
    text = LOOP.replace(*edit)
    module, report = motion(text)
    assert to_text(module) == to_text(parse(text))
    assert {(k.all_reduce, k.reason) for k in report.kept} == {("arw", reason), ("arb", reason)}


#: LOOP in XLA's fused form (what the hook sees on CPU): the bias gradient's add into
#: its accumulator is a fusion's, the sum scaled by a constant inside it.
FUSED_ADD = LOOP.replace(
    "cond {", "fadd { a = f32[32] parameter(0) b = f32[32] parameter(1)\n"
    " q = f32[] constant(0.25) qb = f32[32] broadcast(q), dimensions={}\n"
    " m = f32[32] multiply(b, qb) ROOT s = f32[32] add(a, m) }\ncond {").replace(
    "naccb = f32[32] add(arb, accb)", "naccb = f32[32] fusion(accb, arb), kind=kLoop, "
    "calls=fadd")

#: LOOP with XLA's combined all-reduce: both gradients and a scalar that is not
#: accumulated (it shifts the weight every iteration) in one tuple all-reduce.
COMBINED = LOOP.replace(
    "arw = f32[16,32] all-reduce(gw), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add\n "
    "tw = f32[16,32] copy(arw) naccw = f32[16,32] add(accw, tw)\n", "").replace(
    "arb = f32[32] all-reduce(gb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add\n "
    "naccb = f32[32] add(arb, accb)",
    "sg = f32[] reduce(gb, f0), dimensions={0}, to_apply=add\n "
    "ar = (f32[16,32], f32[32], f32[]) all-reduce(gw, gb, sg), "
    "replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add\n "
    "arw = f32[16,32] get-tuple-element(ar), index=0 arb = f32[32] get-tuple-element(ar), "
    "index=1 ars = f32[] get-tuple-element(ar), index=2\n "
    "tw = f32[16,32] copy(arw) naccw = f32[16,32] add(accw, tw) "
    "naccb = f32[32] add(arb, accb)\n "
    "k = f32[] constant(0.001) sk = f32[] multiply(ars, k) "
    "bs = f32[32,16] broadcast(sk), dimensions={} nw = f32[32,16] add(w, bs)").replace(
    "tuple(ni, naccw, naccb, w, xs)", "tuple(ni, naccw, naccb, nw, xs)")


def test_a_sum_a_fusion_adds_into_the_accumulator_moves():
    """XLA's fused form: a fusion that only adds the sum (through ops that commute with
    it, a constant factor here) into the accumulator is the accumulation; the body's
    fusion then adds the local value, unchanged."""
    assert "calls=fadd" in FUSED_ADD and "fadd {" in FUSED_ADD
    module, report = motion(FUSED_ADD)
    assert body_collectives(module) == [] and not report.kept
    assert module.computation("body")["naccb"].operands == ["accb", "gb"]


@pytest.mark.parametrize("fused", [
    "ROOT s = f32[32] add(a, t) t = f32[32] tanh(b)",  # (reordered below) not linear
    "ROOT s = f32[32] add(m, m)",  # the accumulator not read
    "ROOT s = f32[32] multiply(a, m)",  # not an add
], ids=["tanh", "no-accumulator", "multiply"])
def test_a_sum_read_by_another_fusion_stays_and_says_so(fused):
    """A fusion that does more than add the sum into the accumulator: the motion does not
    look into it (``fused``)."""
    if fused.startswith("ROOT s = f32[32] add(a, t)"):
        fused = "t = f32[32] tanh(b) ROOT s = f32[32] add(a, t)"
    text = FUSED_ADD.replace("ROOT s = f32[32] add(a, m)", fused)
    assert text != FUSED_ADD
    module, report = motion(text)
    assert body_collectives(module) == ["arb"]
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("arb", "fused")]
    assert any("read by a fusion" in note for note in report.notes)


def test_a_combined_all_reduce_leaves_its_unaccumulated_elements_in_the_loop():
    """XLA's combiner puts the gradients and other sums in one tuple all-reduce: the
    accumulated elements leave the loop (one tuple all-reduce after it, a fresh
    channel), the others stay as an all-reduce of their own, which the report names
    with the reason and the all-reduce it came from."""
    assert "nw = f32[32,16] add(w, bs)" in COMBINED
    module, report = motion(COMBINED)
    (kept,) = find(module, "all-reduce", "body")
    # one element: an array all-reduce (XLA:CPU refused a tuple of one under the hook)
    assert kept.operands == ["sg"] and kept.shape == parse(COMBINED).computation(
        "body")["sg"].shape
    assert [u.name for u in module.computation("body").instructions
            if kept.name in u.operands] == ["sk"]
    assert [(k.all_reduce, k.reason, k.part_of) for k in report.kept] == \
        [(kept.name, "not-accumulated", "ar")]
    assert "the elements of %ar that did not move" in report.notes[-1]
    (move,) = report.moved
    assert move.all_reduce == "ar" and move.slots == (1, 2)
    (after,) = find(module, "all-reduce")
    assert len(after.operands) == 2


#: A scan over 4 layers (the backward of ``nn.scan``): iteration ``i`` computes the
#: gradient of layer ``3 - i`` from per-device data, all-reduces it and writes it into
#: that row of the stacked gradient, which starts at zero; one SGD update after.
STACKED = f"""HloModule stacked, replica_count=8
{ADD}
cond {{ p = (s32[], f32[4,32], f32[4,32], f32[2,32]) parameter(0)
 i = s32[] get-tuple-element(p), index=0 n = s32[] constant(4)
 ROOT lt = pred[] compare(i, n), direction=LT }}
body {{ p = (s32[], f32[4,32], f32[4,32], f32[2,32]) parameter(0)
 i = s32[] get-tuple-element(p), index=0
 gs = f32[4,32] get-tuple-element(p), index=1 w = f32[4,32] get-tuple-element(p), index=2
 x = f32[2,32] get-tuple-element(p), index=3
 z = s32[] constant(0) three = s32[] constant(3) j = s32[] subtract(three, i)
 wj = f32[1,32] dynamic-slice(w, j, z), dynamic_slice_sizes={{1,32}}
 wr = f32[32] reshape(wj) wb = f32[2,32] broadcast(wr), dimensions={{1}}
 h = f32[2,32] multiply(x, wb) t = f32[2,32] tanh(h)
 f0 = f32[] constant(0) g = f32[32] reduce(t, f0), dimensions={{0}}, to_apply=add
 ar = f32[32] all-reduce(g), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=add
 row = f32[1,32] reshape(ar)
 ngs = f32[4,32] dynamic-update-slice(gs, row, j, z)
 one = s32[] constant(1) ni = s32[] add(i, one)
 ROOT r = (s32[], f32[4,32], f32[4,32], f32[2,32]) tuple(ni, ngs, w, x) }}
ENTRY e {{ w = f32[4,32] parameter(0)
 x = f32[2,32] parameter(1), parameter_replication={{false}}
 z = s32[] constant(0) f0 = f32[] constant(0)
 zs = f32[4,32] broadcast(f0), dimensions={{}}
 init = (s32[], f32[4,32], f32[4,32], f32[2,32]) tuple(z, zs, w, x)
 loop = (s32[], f32[4,32], f32[4,32], f32[2,32]) while(init), condition=cond, body=body
 gs = f32[4,32] get-tuple-element(loop), index=1
 lr = f32[] constant(0.01) lrs = f32[4,32] broadcast(lr), dimensions={{}}
 u = f32[4,32] multiply(gs, lrs)
 ROOT nw = f32[4,32] subtract(w, u) }}
"""
#: XLA:CPU's fused form of the write: a fusion of the stacked slot, the sum and the row
#: index, whose fused computation relabels the sum and writes it (XLA does not compile
#: such a fusion written by hand: its numbers are checked on flax's ``nn.scan`` under
#: the hook, :func:`test_the_hook_moves_a_flax_scan_s_layer_gradients_out_of_the_loop`).
FUSED_STACKED = STACKED.replace(
    "cond {", "fdus { b = f32[4,32]{1,0} parameter(0) v = f32[32]{0} parameter(1)\n"
    " k = s32[] parameter(2) vr = f32[1,32]{1,0} bitcast(v) zz = s32[] constant(0)\n"
    " ROOT u = f32[4,32]{1,0} dynamic-update-slice(b, vr, k, zz) }\ncond {").replace(
    " row = f32[1,32] reshape(ar)\n ngs = f32[4,32] dynamic-update-slice(gs, row, j, z)",
    " ngs = f32[4,32] fusion(gs, ar, j), kind=kLoop, calls=fdus")
#: XLA:CPU's fused write of a 16-bit gradient it sums in f32 (bf16 compute from f32
#: weights): the fused computation rounds the sum to bf16 and back before writing it.
ROUNDED_STACKED = FUSED_STACKED.replace(
    "vr = f32[1,32]{1,0} bitcast(v)",
    "c1 = bf16[32]{0} convert(v) c2 = f32[32]{0} convert(c1) vr = f32[1,32]{1,0} bitcast(c2)")
#: Three iterations, the stacked slot starting at ones: row 0 is never written.
PARTLY_WRITTEN = STACKED.replace("n = s32[] constant(4)", "n = s32[] constant(3)")
ONES_START = PARTLY_WRITTEN.replace(
    "zs = f32[4,32] broadcast(f0)", "f1 = f32[] constant(1) zs = f32[4,32] broadcast(f1)")


#: LOOP returning each microbatch's loss too, summed over the devices and written into
#: its row of a slot that starts at zero (``lax.scan``'s stacked outputs).
TUPLE = "(s32[], f32[16,32], f32[32], f32[32,16], f32[4,2,32])"
WITH_LOSSES = LOOP.replace(TUPLE, TUPLE[:-1] + ", f32[4])").replace(
    " one = s32[] constant(1) ni = s32[] add(i, one)",
    " sl = f32[] reduce(gb, f0), dimensions={0}, to_apply=add\n"
    " arl = f32[] all-reduce(sl), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add\n"
    " lr1 = f32[1] reshape(arl) ls = f32[4] get-tuple-element(p), index=5\n"
    " nls = f32[4] dynamic-update-slice(ls, lr1, i)\n"
    " one = s32[] constant(1) ni = s32[] add(i, one)").replace(
    "tuple(ni, naccw, naccb, w, xs)", "tuple(ni, naccw, naccb, w, xs, nls)").replace(
    " init = ", " zl = f32[4] broadcast(f0), dimensions={}\n init = ").replace(
    "tuple(z, zw, b, w, xs)", "tuple(z, zw, b, w, xs, zl)")


def test_a_loop_that_accumulates_keeps_the_sums_it_writes():
    """Microbatches accumulating gradients and writing their losses: the gradients'
    sums leave the loop, the losses' stays (what is reduced after the loop is
    accumulators only, which the sharded accumulator may carry as shards), in the
    sweep that moves the gradients and in the next."""
    assert WITH_LOSSES.count("f32[4])") == 5
    module, report = motion(WITH_LOSSES)
    assert body_collectives(module) == ["arl"]
    assert {m.all_reduce for m in report.moved} == {"arw", "arb"}
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("arl", "written-beside-added")]


@pytest.mark.parametrize("text", [STACKED, FUSED_STACKED], ids=["write", "fused-write"])
def test_a_sum_written_into_the_stacked_slot_moves(text):
    """A scan over layers writes each layer's sum into its row of a slot that starts at
    zero: the loop writes the local gradients, one all-reduce of the stacked slot after
    it (the rows it did not write stay zero, summed or not)."""
    assert text.count("dynamic-update-slice") == 1
    module, report = motion(text)
    assert body_collectives(module) == [] and not report.kept
    (move,) = report.moved
    assert move.all_reduce == "ar" and move.slots == (1,)
    (after,) = find(module, "all-reduce")
    assert module.entry[after.operands[0]].int_attr("index") == 1
    assert [i for i in module.entry.instructions if i.opcode == "add"] == []


def test_a_fused_write_that_rounds_the_sum_moves_with_its_rounding_after_the_loop():
    """The write rounds each layer's sum (f32 to bf16 and back): the loop writes the
    local gradient unrounded, through a copy of the fused computation without the
    converts (the original left for the dead-computation pass), and the stacked sums
    are rounded after the all-reduce, in the same order: the same numbers, a row never
    written rounding zero to zero."""
    module, report = motion(ROUNDED_STACKED)
    assert body_collectives(module) == [] and not report.kept
    (fusion,) = find(module, "fusion", "body")
    copy = module.computation(fusion.called("calls"))
    assert copy.name == "fdus.unrounded" and \
        not [i for i in copy.instructions if i.opcode == "convert"]
    assert [i.opcode for i in module.computation("fdus").instructions].count("convert") == 2
    (after,) = find(module, "all-reduce")
    converts = [i for i in module.entry.instructions if i.opcode == "convert"]
    assert [c.shape.element_type for c in converts] == ["bf16", "f32"]
    assert converts[0].operands == [after.name] and converts[1].operands == [converts[0].name]
    assert module.entry["u"].operands[0] == converts[1].name


def test_a_fused_write_scaling_its_rounded_sum_stays():
    """A scaling after the rounding would not commute with the rounding moved after the
    loop: the sum stays (``converted``)."""
    text = ROUNDED_STACKED.replace(
        "vr = f32[1,32]{1,0} bitcast(c2)",
        "h = f32[] constant(0.5) hb = f32[32]{0} broadcast(h), dimensions={} "
        "sc = f32[32]{0} multiply(c2, hb) vr = f32[1,32]{1,0} bitcast(sc)")
    assert text != ROUNDED_STACKED
    module, report = motion(text)
    assert body_collectives(module) == ["ar"]
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("ar", "converted")]


#: LOOP and STACKED in bf16: gradients summed and accumulated in bf16.
NARROW_LOOP = LOOP.replace("f32[", "bf16[")
NARROW_STACKED = STACKED.replace("f32[", "bf16[")
#: XLA:CPU's fused write of a bf16 slot: the fusion widens the slot to f32, writes the
#: f32 sum into it and narrows it back.
_SLOT = "(s32[], f32[4,32], f32[4,32], f32[2,32])"
WIDENED_STACKED = FUSED_STACKED.replace(_SLOT, _SLOT.replace("f32[4,32],", "bf16[4,32],", 1)
                                        ).replace(
    "gs = f32[4,32] get-tuple-element(p), index=1", "gs = bf16[4,32] get-tuple-element(p), index=1"
).replace("ngs = f32[4,32] fusion(", "ngs = bf16[4,32] fusion(").replace(
    "fdus { b = f32[4,32]{1,0} parameter(0)",
    "fdus { b = bf16[4,32]{1,0} parameter(0) bw = f32[4,32]{1,0} convert(b)").replace(
    "ROOT u = f32[4,32]{1,0} dynamic-update-slice(b, vr, k, zz) }",
    "u = f32[4,32]{1,0} dynamic-update-slice(bw, vr, k, zz) "
    "ROOT n = bf16[4,32]{1,0} convert(u) }").replace(
    "zs = f32[4,32] broadcast(f0)", "fb0 = bf16[] constant(0) zs = bf16[4,32] broadcast(fb0)"
).replace("gs = f32[4,32] get-tuple-element(loop), index=1",
          "gsb = bf16[4,32] get-tuple-element(loop), index=1 gs = f32[4,32] convert(gsb)")


def test_a_sum_accumulated_in_bf16_stays_and_a_written_one_moves():
    """A bf16 add rounds after every microbatch: moved, each device would round its own
    local values as it accumulates them, before the sum over the devices (other numbers
    at bf16's grain, which ``verify`` calls DIFFERENT; ``narrow-sum``). A sum written into
    its row is not added into: it moves as it is, bf16 or not."""
    module, report = motion(NARROW_LOOP)
    assert sorted(body_collectives(module)) == ["arb", "arw"] and not report.moved
    assert sorted((k.all_reduce, k.reason) for k in report.kept) == \
        [("arb", "narrow-sum"), ("arw", "narrow-sum")]
    module, report = motion(NARROW_STACKED)
    assert body_collectives(module) == [] and [m.all_reduce for m in report.moved] == ["ar"]


def test_a_bf16_sum_written_into_its_slot_stays_where_the_backend_sums_bf16_in_f32():
    """XLA:CPU sums a bf16 all-reduce in f32, from each device's value as its producer
    computed it (unrounded, excess precision allowed): moved, the slot would round each
    device's value before the sum (probe W F2: one bf16 ulp in a third of a scanned
    weight's gradient). On such a profile the sum stays (``narrow-write``); an f32 one
    still moves."""
    module, report = motion(NARROW_STACKED, upcast=True)
    assert body_collectives(module) == ["ar"] and not report.moved
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("ar", "narrow-write")]
    module, report = motion(STACKED, upcast=True)
    assert body_collectives(module) == [] and [m.all_reduce for m in report.moved] == ["ar"]


def test_a_write_that_widens_its_bf16_slot_stays_and_says_so():
    """The sum moved, the loop would write the local f32 value into the bf16 slot:
    ``widened-write``, not the catch-all ``fused``."""
    assert WIDENED_STACKED.count("bf16[4,32]") == 11
    module, report = motion(WIDENED_STACKED)
    assert body_collectives(module) == ["ar"]
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("ar", "widened-write")]


def test_a_written_slot_that_does_not_start_at_zero_stays():
    """Row 0 keeps its start, ones: moved, the sum after the loop would add it up over
    the devices."""
    module, report = motion(ONES_START)
    assert body_collectives(module) == ["ar"]
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("ar", "written-start")]
    assert any("does not start the loop at zero" in note for note in report.notes)


def test_a_sliced_sum_moves_only_where_the_loop_may_carry_the_whole_gradient():
    """FSDP's form: the loop carries this device's rows of the sum. Without ``sliced``
    (the accumulator mode ``sharded``) the all-reduce stays (moved, the loop would carry
    the whole gradient: ``sliced``); with it the body accumulates the whole local
    gradient, and the all-reduce, the device's slice of it (offsets computed again after
    the loop) and the reshape after it run once, after the loop."""
    assert SLICED != LOOP
    module, report = motion(SLICED)
    assert body_collectives(module) == ["arb"]
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("arb", "sliced")]

    module, report = motion(SLICED, sliced=True)
    assert body_collectives(module) == [] and not report.kept
    (move,) = [m for m in report.moved if m.all_reduce == "arb"]
    assert move.widened == ((2, 32 * 4, 8 * 32 * 4),)
    assert "slot(s) 2 now carry the whole gradient" in report.notes[0]
    body = module.computation("body")
    assert not [i for i in body.instructions if i.opcode in ("replica-id", "dynamic-slice")
                and i.name != "xi"]  # the slice and its offset left the body
    (block,) = find(module, "dynamic-slice")  # (the entry's)
    assert module.entry[block.operands[0]].opcode == "all-reduce"
    assert module.entry["loop"].shape.elements[2].dims == (8, 32)


def test_a_sliced_sum_stays_where_the_whole_gradient_would_not_fit_the_device():
    """``memory_bytes`` (the profile's device memory, the accumulator mode ``auto``): the
    move may not take the module's modelled peak past it. The widened slot adds 7 rows
    of 32 floats: a bound one byte short of the peak plus those keeps the sum in the
    loop (``sliced-memory``), one that holds them moves it."""
    from hlo_shard.costmodel.memory import memory_profile

    peak = memory_profile(parse(SLICED)).peak_bytes
    needed = peak + 7 * 32 * 4
    module, report = motion(SLICED, sliced=True, memory_bytes=needed - 1)
    assert body_collectives(module) == ["arb"]
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("arb", "sliced-memory")]
    assert any("exceed the device's memory" in note for note in report.notes)
    module, report = motion(SLICED, sliced=True, memory_bytes=needed)
    assert body_collectives(module) == [] and not report.kept


def test_the_accumulator_mode_decides_what_the_sliced_sums_may_cost():
    """``whole`` moves them whatever the memory, ``auto`` within the profile's device
    memory (unknown on the CPU profile: no bound), ``sharded`` keeps them in the loop.
    XLA:CPU sums 16-bit floats in f32 (``upcast``), a GPU does not."""
    from hlo_shard.passes.sharding_pipeline import accumulation_motion
    from hlo_shard.passes.weight_update import WeightUpdateSharding
    from hlo_shard.profiles import resolve_profile

    def mode(accumulator: str, profile: str) -> AccumulationMotion:
        return accumulation_motion(WeightUpdateSharding(
            ShardingOptions(accumulator=accumulator, profile=profile)))

    h100 = resolve_profile("h100").device_memory_bytes
    assert h100 > 0
    assert mode("auto", "h100") == AccumulationMotion(sliced=True, memory_bytes=h100)
    assert mode("auto", "cpu-local") == AccumulationMotion(sliced=True, memory_bytes=0,
                                                           upcast=True)
    assert mode("whole", "h100") == AccumulationMotion(sliced=True, memory_bytes=0)
    assert mode("sharded", "h100") == AccumulationMotion(sliced=False, memory_bytes=0)


def test_a_slice_that_moves_with_the_iteration_stays():
    """A slice at an offset read from the loop's counter is not the same in every
    iteration: taken once after the loop it would not be the sum of the slices."""
    text = SLICED.replace("ds = f32[1,32] dynamic-slice(arb, row, z)",
                          "ds = f32[1,32] dynamic-slice(arb, i, z)")
    assert text != SLICED
    module, report = motion(text, sliced=True)
    assert body_collectives(module) == ["arb"]
    assert [(k.all_reduce, k.reason) for k in report.kept] == [("arb", "sliced-form")]


def test_a_moved_all_reduce_gets_a_fresh_channel_id():
    text = LOOP.replace("replica_count=8", "replica_count=1, num_partitions=8").replace(
        "replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add",
        "channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, "
        "to_apply=add", 1)
    module, _ = motion(text)
    ids = [i.int_attr("channel_id") for c in module.computations for i in c.instructions
           if i.opcode == "all-reduce"]
    assert 5 not in ids and 6 in ids and ids.count(None) == 1
    # the original's other attributes, in their order
    (moved,) = [i for i in find(module, "all-reduce") if i.int_attr("channel_id") == 6]
    assert list(moved.attributes) == ["channel_id", "replica_groups", "use_global_device_ids",
                                      "to_apply"]
    assert moved.attr("use_global_device_ids") is True


@pytest.mark.parametrize("kind, literal, zero", [
    ("f32", "0", True), ("f32", "-0", True), ("f32", "0.0", True), ("s32", "0", True),
    ("f32", "1e-30", False), ("pred", "false", False), ("f32", "nan", False)])
def test_only_a_numeric_zero_is_a_zero_start(kind, literal, zero):
    comp = parse(f"HloModule z\nENTRY e {{ c = {kind}[] constant({literal}) "
                 f"ROOT b = {kind}[4] broadcast(c), dimensions={{}} }}").entry
    assert is_zero(comp, comp.root) is zero


def test_nested_loops_sink_through_both():
    """An accumulation loop inside an outer loop that accumulates its result: the
    all-reduce leaves both loops (a second sweep moves it out of the outer body)."""
    inner_entry = LOOP.split("ENTRY e {")[1]
    outer = LOOP.split("ENTRY e {")[0].replace("cond {", "cond_in {").replace(
        "body {", "body_in {") + """
cond { q = (s32[], f32[32], f32[32,16], f32[4,2,32]) parameter(0)
 j = s32[] get-tuple-element(q), index=0 m = s32[] constant(2)
 ROOT lt = pred[] compare(j, m), direction=LT }
body { q = (s32[], f32[32], f32[32,16], f32[4,2,32]) parameter(0)
 j = s32[] get-tuple-element(q), index=0 acc = f32[32] get-tuple-element(q), index=1
 w = f32[32,16] get-tuple-element(q), index=2 xs = f32[4,2,32] get-tuple-element(q), index=3
 z = s32[] constant(0) f0 = f32[] constant(0)
 zw = f32[16,32] broadcast(f0), dimensions={} zb = f32[32] broadcast(f0), dimensions={}
 init = (s32[], f32[16,32], f32[32], f32[32,16], f32[4,2,32]) tuple(z, zw, zb, w, xs)
 loop = (s32[], f32[16,32], f32[32], f32[32,16], f32[4,2,32]) while(init), condition=cond_in, body=body_in
 gb = f32[32] get-tuple-element(loop), index=2 nacc = f32[32] add(acc, gb)
 one = s32[] constant(1) nj = s32[] add(j, one)
 ROOT r = (s32[], f32[32], f32[32,16], f32[4,2,32]) tuple(nj, nacc, w, xs) }
ENTRY e { w = f32[32,16] parameter(0) b = f32[32] parameter(1)
 xs = f32[4,2,32] parameter(2), parameter_replication={false}
 z = s32[] constant(0)
 init = (s32[], f32[32], f32[32,16], f32[4,2,32]) tuple(z, b, w, xs)
 loop = (s32[], f32[32], f32[32,16], f32[4,2,32]) while(init), condition=cond, body=body
 ROOT g = f32[32] get-tuple-element(loop), index=1 }
"""
    assert inner_entry  # the inner loop's body and condition are LOOP's
    module, report = motion(outer)
    assert [i.opcode for i in module.computation("body_in").instructions
            if i.opcode in COLLECTIVES] == []
    assert [i.opcode for i in module.computation("body").instructions
            if i.opcode in COLLECTIVES] == []
    assert len(find(module, "all-reduce")) == 1
    assert len(report.moved) == 3, report.notes  # arw, arb out of body_in; arb's sum out of body


#: big_vision's ``accumulate_gradient``: the first microbatch's gradient (from this
#: device's rows %x0) summed over the devices before the loop and carried in as the
#: accumulator's start; the loop adds the others' (from the whole microbatches, the
#: same on every device, as the partitioner all-gathers them: no all-reduce in the
#: body), one SGD update after.
STARTED = f"""HloModule started, replica_count=8
{ADD}
cond {{ p = (s32[], f32[16,32], f32[32,16], f32[4,2,32]) parameter(0)
 i = s32[] get-tuple-element(p), index=0 n = s32[] constant(4)
 ROOT lt = pred[] compare(i, n), direction=LT }}
body {{ p = (s32[], f32[16,32], f32[32,16], f32[4,2,32]) parameter(0)
 i = s32[] get-tuple-element(p), index=0 acc = f32[16,32] get-tuple-element(p), index=1
 w = f32[32,16] get-tuple-element(p), index=2 xs = f32[4,2,32] get-tuple-element(p), index=3
 z = s32[] constant(0) xi = f32[1,2,32] dynamic-slice(xs, i, z, z), dynamic_slice_sizes={{1,2,32}}
 x = f32[2,32] reshape(xi)
 y = f32[2,16] dot(x, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
 t = f32[2,16] tanh(y)
 g = f32[16,32] dot(t, x), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
 nacc = f32[16,32] add(acc, g)
 one = s32[] constant(1) ni = s32[] add(i, one)
 ROOT r = (s32[], f32[16,32], f32[32,16], f32[4,2,32]) tuple(ni, nacc, w, xs) }}
ENTRY e {{ w = f32[32,16] parameter(0) xs = f32[4,2,32] parameter(1)
 x0 = f32[2,32] parameter(2), parameter_replication={{false}}
 y0 = f32[2,16] dot(x0, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
 t0 = f32[2,16] tanh(y0)
 g0 = f32[16,32] dot(t0, x0), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
 s0 = f32[16,32] all-reduce(g0), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=add
 one = s32[] constant(1)
 init = (s32[], f32[16,32], f32[32,16], f32[4,2,32]) tuple(one, s0, w, xs)
 loop = (s32[], f32[16,32], f32[32,16], f32[4,2,32]) while(init), condition=cond, body=body
 acc = f32[16,32] get-tuple-element(loop), index=1
 gt = f32[32,16] transpose(acc), dimensions={{1,0}}
 lr = f32[] constant(0.01) lrw = f32[32,16] broadcast(lr), dimensions={{}}
 u = f32[32,16] multiply(gt, lrw) nw = f32[32,16] subtract(w, u)
 ROOT out = (f32[32,16]) tuple(nw) }}
"""


def test_a_sum_that_starts_an_accumulator_is_added_after_the_loop():
    module, report = motion(STARTED)
    assert [(s.all_reduce, s.slot) for s in report.lifted] == [("s0", 1)]
    assert not report.moved and not report.kept
    init = module.entry["init"]
    assert module.entry[init.operands[1]].opcode == "broadcast"  # the loop starts at zero
    (after,) = [u for u in find(module, "add") if "s0" in u.operands]
    assert module.entry[next(o for o in after.operands if o != "s0")].opcode == \
        "get-tuple-element"
    assert module.entry["gt"].operands == [after.name]
    assert "start at zero and the sum is added after the loop" in report.notes[0]


def test_the_sharding_reduce_scatters_the_sum_that_started_an_accumulator():
    """Before, the update read the sum only through the loop ('all users need the full
    gradient'): now it is reduce-scattered and the update runs on the shard."""
    module, report = optimize(STARTED)
    assert row(report, "s0").sharded, row(report, "s0").reason
    assert len(find(module, "reduce-scatter")) == 1 and not find(module, "all-reduce")


@pytest.mark.parametrize("edit", [
    ("nacc = f32[16,32] add(acc, g)",
     "ga = f32[16,32] multiply(g, acc) nacc = f32[16,32] add(acc, ga)"),
    ("ROOT lt = pred[] compare(i, n), direction=LT",
     "a = f32[16,32] get-tuple-element(p), index=1 f0 = f32[] constant(0) "
     "sa = f32[] reduce(a, f0), dimensions={0,1}, to_apply=add "
     "ok = pred[] compare(sa, sa), direction=EQ "
     "more = pred[] compare(i, n), direction=LT ROOT lt = pred[] and(more, ok)"),
    ("nacc = f32[16,32] add(acc, g)", "nacc = f32[16,32] multiply(acc, g)"),
    ("acc = f32[16,32] get-tuple-element(loop), index=1",
     "acc = f32[16,32] get-tuple-element(loop), index=1 "
     "again = f32[16,32] add(s0, acc)"),
], ids=["read-in-body", "read-in-condition", "not-added", "start-read-after"])
def test_a_start_the_loop_does_not_only_add_to_stays(edit):
    text = STARTED.replace(*edit)
    assert text != STARTED
    module, report = motion(text)
    assert not report.lifted
    assert module.entry["init"].operands[1] == "s0"


# ---------------------------------------------------------- numbers through real XLA


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


def verify(original: str, candidate: Module, manifest=None) -> runtime.VerifyReport:
    return runtime.verify(parse(original), parse(to_text(candidate)),
                          runtime.VerifyOptions(steps=3, manifest=manifest))


@pytest.mark.parametrize("text, moves", [(LOOP, 2), (MEAN, 2), (FUSED_ADD, 2), (COMBINED, 1),
                                         (STACKED, 1), (PARTLY_WRITTEN, 1), (WITH_LOSSES, 2)],
                         ids=["sum", "mean", "fused-add", "combined", "stacked",
                              "partly-written", "with-losses"])
def test_the_moved_loop_computes_the_same(worker, text, moves):
    module, report = motion(text)
    assert len(report.moved) == moves
    result = verify(text, module)
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


def test_the_widened_loop_computes_the_same(worker):
    """The sliced sum moved out (the loop carrying the whole gradient) against the
    original; a mutant taking row 0 after the loop instead of the device's own must
    DIFFER."""
    module, _ = motion(SLICED, sliced=True)
    result = verify(SLICED, module)
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]
    (block,) = find(module, "dynamic-slice")
    zero = next(o for o in block.operands[1:] if module.entry[o].opcode == "constant")
    Rewriter(module.entry).set_operand(block, 1, zero)
    assert not verify(SLICED, module).ok


def test_a_split_that_loses_the_staying_sum_is_caught(worker):
    """A mutant of the combined all-reduce's split: the element that stays reads the
    device's own value instead of its sum over devices (what forgetting to keep it
    all-reduced computes) must DIFFER."""
    module, _ = motion(COMBINED)
    body = module.computation("body")
    (kept,) = find(module, "all-reduce", "body")
    Rewriter(body).replace_all_uses_with(kept.name, kept.operands[0])
    assert not verify(COMBINED, module).ok


def test_dropping_the_initial_value_is_caught(worker):
    """A mutant: the post-loop sum without the accumulator's initial value (what moving
    the all-reduce without adding %b back computes) must DIFFER."""
    module, _ = motion(LOOP)
    (added,) = [i for i in find(module, "add") if "b" in i.operands]
    Rewriter(module.entry).replace_all_uses_with(added.name, added.operands[1])
    result = runtime.verify(parse(LOOP), parse(to_text(module)),
                            runtime.VerifyOptions(steps=1))
    assert not result.ok


def test_moving_a_write_into_a_slot_that_keeps_part_of_its_start_is_caught(worker):
    """A mutant: the partly written loop moved as if its slot started at zero, run from
    the ones it starts at (what a motion without the zero-start check computes: row 0
    summed over the devices) must DIFFER."""
    module, _ = motion(PARTLY_WRITTEN)
    ones = parse(ONES_START).entry
    rw = Rewriter(module.entry)
    with rw.inserting_before("init"):
        one = rw.add_instruction(ones["f1"].clone())
        start = rw.add("broadcast", ones["zs"].shape, [one.name], dimensions=())
    rw.set_operand(module.entry["init"], 1, start.name)
    assert not verify(ONES_START, module).ok


def test_the_lifted_start_computes_the_same(worker):
    """The accumulator started at zero, the first microbatch's sum added after the loop,
    against the original; a mutant that forgets to add it must DIFFER; and the step
    optimized with its state sharded."""
    module, report = motion(STARTED)
    assert report.lifted
    result = verify(STARTED, module)
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]
    (after,) = [u for u in find(module, "add") if "s0" in u.operands]
    Rewriter(module.entry).replace_all_uses_with(
        after.name, next(o for o in after.operands if o != "s0"))
    assert not verify(STARTED, module).ok
    optimized = hlo_shard.optimize(parse(STARTED), ShardingOptions(state="sharded"),
                                   force=True)
    assert row(optimized.report, "s0").sharded
    result = runtime.verify(parse(STARTED), parse(optimized.text), runtime.VerifyOptions(
        steps=3, manifest=build_manifest(optimized.report, parse(STARTED))))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


def test_the_optimized_loop_computes_the_same(worker):
    module = parse(LOOP)
    result = hlo_shard.optimize(module, ShardingOptions(state="sharded"), force=True)
    report, text = result.report, result.text
    assert any(r.sharded for r in report.explanations)
    assert "reduce-scatter" in text and body_collectives(parse(text)) == []
    result = runtime.verify(parse(LOOP), parse(text), runtime.VerifyOptions(
        steps=3, manifest=build_manifest(report, module)))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


# ------------------------------------------------------------------- real jax steps

MICRO = 4


def hooked_scan_decision(words: str, **install_options):
    """:func:`_scan_program`'s step run under plain jit and compiled under
    ``install(**install_options)``: the one decision of a module whose notes say
    ``words``, the hooked run's state and jit's."""
    from jax_train_helpers import run_steps

    import hlo_shard.jax as hsj

    step, params, opt_state, batch = _scan_program()
    state_jit, _ = run_steps(step, (params, opt_state), batch)
    hsj.decisions(clear=True)
    with hsj.install(**install_options):
        step, params, opt_state, batch = _scan_program()  # compiled under the hook
        state_hooked, _ = run_steps(step, (params, opt_state), batch)
    made = [d for d in hsj.decisions(clear=True) if not d.reused and d.report and any(
        words in n for n in d.report.notes)]
    assert len(made) == 1, [(d.module, d.reused, d.changed) for d in made]
    return made[0], state_hooked, state_jit


def _scan_program(form: str = "scan-sum", mesh_shape: tuple[int, ...] = (8,)):
    """An MLP + adam step accumulating the gradients of 4 microbatches (each device holds
    2 rows of each), one update after the loop: ``scan-sum`` sums them in a ``lax.scan``
    (and returns the mean loss), ``fori-mean`` averages them in a ``fori_loop``. On a
    ``(data, fsdp)`` ``mesh_shape`` the matrices' rows are sharded over ``fsdp``."""
    from jax_train_helpers import (AXIS, NamedSharding, P, jax, jnp, mlp_batch, mlp_loss,
                                   mlp_params, np, optax)

    axes = (AXIS, "fsdp")[:len(mesh_shape)]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), axes)
    opt = optax.adam(1e-2)

    def scan_sum(params, microbatches):
        def accumulate(total, batch):
            loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
            return jax.tree.map(jnp.add, total, grads), loss

        grads, losses = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params),
                                     microbatches)
        return grads, losses.mean()

    def fori_mean(params, microbatches, loss=mlp_loss):
        def accumulate(i, total):
            grads = jax.grad(loss)(params, jax.tree.map(lambda a: a[i], microbatches))
            return jax.tree.map(lambda t, g: t + g / MICRO, total, grads)

        zeros = jax.tree.map(jnp.zeros_like, params)
        return jax.lax.fori_loop(0, MICRO, accumulate, zeros), jnp.float32(0)

    def bf16_loss(params, batch):
        def bf16(tree):
            return jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)

        return mlp_loss(bf16(params), bf16(batch)).astype(jnp.float32)

    gradients = {"scan-sum": scan_sum, "fori-mean": fori_mean,
                 "fori-mean-bf16": lambda p, m: fori_mean(p, m, bf16_loss)}[form]

    def step(params, opt_state, microbatches):
        grads, loss = gradients(params, microbatches)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def placed(leaf):
        rows = "fsdp" if "fsdp" in axes and leaf.ndim == 2 else None
        return NamedSharding(mesh, P(rows) if rows else P())

    params = jax.tree.map(lambda a: jax.device_put(a, placed(a)),
                          mlp_params(jax.random.PRNGKey(0)))
    opt_state = jax.jit(opt.init)(params)

    def batch(i):
        rows = mlp_batch(jax.random.PRNGKey(100 + i), MICRO * 16)
        split = jax.tree.map(lambda a: a.reshape(MICRO, 16, *a.shape[1:]), rows)
        return jax.device_put(split, NamedSharding(mesh, P(None, axes)))

    return jax.jit(step), params, opt_state, batch


def _loop_body(module: Module) -> str:
    (loop,) = [i for i in module.entry.instructions if i.opcode == "while"]
    return loop.attr("body").name  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.parametrize("form, staying", [("scan-sum", 1), ("fori-mean", 0)])
def test_accumulation_is_reduce_scattered_once_after_the_loop(request, worker, form, staying):
    """A real jax step (captured on 8 CPU devices, collectives inside the loop written
    with mesh replica groups): optimized by default, no gradient collective inside the
    loop body, one reduce-scatter of the gradient bucket after it, MATCH."""
    from jax_train_helpers import needs_devices

    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    step, params, opt_state, batch = _scan_program(form)
    text = hsj.per_device_hlo(step, params, opt_state, batch(0))
    original = parse(text)
    body = _loop_body(original)
    assert sum(i.opcode == "all-reduce" for i in original.computation(body).instructions) \
        == 6 + staying
    result = hlo_shard.optimize(parse(text), ShardingOptions())
    report, optimized = result.report, result.text
    module = parse(optimized)
    left = [i for i in module.computation(body).instructions if i.opcode in COLLECTIVES]
    # only the loss's scalar sum (divided and written into the losses) stays
    assert [i.shape.dims for i in left] == [()] * staying  # type: ignore[union-attr]
    scattered = [i for i in module.entry.instructions if i.opcode == "reduce-scatter"]
    assert scattered and sum(r.sharded for r in report.explanations) == 6
    assert len(scattered) <= 6
    result = runtime.verify(parse(text), module, runtime.VerifyOptions(
        steps=3, manifest=build_manifest(report, parse(text))))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


@pytest.mark.slow
def test_a_bf16_gradient_converted_before_accumulation_stays_in_the_loop(request, worker):
    """bf16 compute: the gradient is all-reduced in bf16 and converted to f32 before it is
    accumulated. Moving it would round the sum in another type, so it stays (and says
    why); the weight-update pass reduce-scatters it inside the loop into a sharded
    accumulator instead, and the result computes the same."""
    from jax_train_helpers import needs_devices

    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    step, params, opt_state, batch = _scan_program("fori-mean-bf16")
    text = hsj.per_device_hlo(step, params, opt_state, batch(0))
    body = _loop_body(parse(text))
    result = hlo_shard.optimize(parse(text), ShardingOptions(), force=True)
    report, optimized = result.report, result.text
    assert sum("(its result is converted" in note for note in report.notes) == 6
    module = parse(optimized)
    assert [i.opcode for i in module.computation(body).instructions
            if i.opcode in COLLECTIVES] == ["reduce-scatter"]
    result = runtime.verify(parse(text), module, runtime.VerifyOptions(
        steps=3, manifest=build_manifest(report, parse(text))))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


@pytest.mark.slow
def test_scan_accumulation_trains_sharded_like_jit(request):
    """Through ``shard_weight_update(state="sharded")``: no fallback, the gradients
    sharded, the same parameters and state as ``jax.jit`` after 5 steps."""
    from jax_train_helpers import assert_close, needs_devices

    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    step, params, opt_state, batch = _scan_program()
    fast = hsj.shard_weight_update(step, state="sharded")
    state_fast, state_jit = (params, opt_state), (params, opt_state)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hsj.FallbackWarning)
        for i in range(5):
            *state_fast, _ = fast(*state_fast, batch(i))
    assert fast.report is not None and fast.report["sharded"] == 6
    for i in range(5):
        *state_jit, _ = step(*state_jit, batch(i))
    assert_close(tuple(fast.gather_args(*state_fast)), tuple(state_jit))


@pytest.mark.slow
def test_multisteps_accumulation_is_sharded_in_the_optimizer_state(request, worker):
    """``optax.MultiSteps`` accumulates across calls, in the optimizer state: there is no
    loop (the all-reduce of each call's gradient is needed for the state each call
    returns), so the motion moves nothing; the weight-update sharding reduce-scatters
    the gradient and, with the state sharded, keeps the accumulator as a shard too."""
    from jax_train_helpers import make_program, needs_devices, optax

    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 8, donate=False)
    program.optimizer = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4)
    opt = program.optimizer
    from jax_train_helpers import jax

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(program.model.loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), opt_state, loss

    params, opt_state = program.init()
    text = hsj.per_device_hlo(jax.jit(train_step), params, opt_state, program.batch(0))
    module = parse(text)
    assert not [i for i in module.entry.instructions if i.opcode == "while"]
    result = hlo_shard.optimize(module, ShardingOptions(state="sharded"), force=True)
    report, optimized = result.report, result.text
    assert not any("moved after the loop" in note for note in report.notes)
    assert sum(r.sharded for r in report.explanations) == 6
    # mu, nu and MultiSteps' accumulated gradients of the 6 leaves are kept as shards
    assert sum(p.kind == "sharded" for p in report.parameters) == 18
    result = runtime.verify(parse(text), parse(optimized), runtime.VerifyOptions(
        steps=5, manifest=build_manifest(report, parse(text))))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


def test_the_speed_gate_prices_the_moved_loop():
    """The cost model prices one collective per step below one per microbatch; where
    sharding after the loop is not predicted cheaper than that, the module written is
    the moved one, kept whole, and the decision says what it costs."""
    module = parse(LOOP)
    result = hlo_shard.optimize(module, ShardingOptions())
    report, text, decision = result.report, result.text, result.decision
    assert decision.kept_whole and not any(r.sharded for r in report.explanations)
    assert decision.unsharded_s is not None and decision.unsharded_s < decision.before_s
    assert decision.after_s == decision.unsharded_s
    assert body_collectives(parse(text)) == [] and "all-reduce" in text
    assert decision.to_json()["unsharded_seconds"] == decision.unsharded_s


def test_a_front_end_runs_the_moved_loop_where_it_pays_though_nothing_is_sharded():
    """The hook and ``shard_weight_update`` run their own program where nothing is
    sharded; where the loop with its all-reduces moved out pays by the profile's margin
    though sharding after it does not (``moves_only``), that module is theirs to run:
    written (one all-reduce per step, after the loop), not left as it was."""
    from hlo_shard.passes.speed_gate import not_faster

    module = parse(LOOP)
    result = hlo_shard.optimize(module, ShardingOptions(), write_kept_whole=False)
    decision = result.decision
    assert decision.kept_whole and decision.moves_only and result.sharded == 0
    assert decision.to_json()["moves_only"]  # (what tells a report reader it changed)
    assert result.rewritten and not_faster(decision) == ""
    assert body_collectives(parse(result.xla_text)) == []
    # the same decision on a profile demanding more than the moved loop gains: the
    # front end runs its own program, saying why
    strict = replace(decision, min_gain=1 - decision.unsharded_s / decision.before_s + 0.01)
    assert not strict.moves_only
    assert not_faster(strict).startswith("sharding is not predicted at least")


def test_the_command_s_summary_says_a_module_it_changed_without_sharding_is_changed(tmp_path):
    """Its one line said "kept whole: sharding is predicted slower" of a module whose
    all-reduces it moved out of the loop (a probe believed the written module the
    input, then saw verify's wide-range note on it)."""
    from click.testing import CliRunner

    from hlo_shard.cli import main

    source = tmp_path / "loop.hlo"
    source.write_text(LOOP)
    result = CliRunner().invoke(main, ["optimize", str(source), "-o", str(tmp_path / "o.hlo")])
    assert result.exit_code == 0, result.output
    assert "nothing sharded, but the module is changed: its gradient all-reduces moved out " \
        "of accumulation loops" in result.stderr and "kept whole" not in result.stderr
    assert body_collectives(parse((tmp_path / "o.hlo").read_text())) == []


def test_a_forced_step_with_nothing_to_shard_still_runs_its_moved_loop():
    """``force`` with every gradient below the cut-off: nothing is sharded, but the
    accumulated all-reduces leave the loop, and that module is the one a front end runs
    (forcing never runs less of the pipeline than the gate would)."""
    result = hlo_shard.optimize(parse(LOOP), ShardingOptions(min_shard_bytes=1 << 30),
                                force=True)
    assert result.sharded == 0 and result.decision is not None and result.decision.forced
    assert body_collectives(result.module) == []
    assert result.rewritten


@pytest.mark.slow
@pytest.mark.parametrize("accumulator", ["auto", "sharded"])
def test_fsdp_with_scan_accumulation_runs_the_moved_loop(request, accumulator):
    """A (data=2, fsdp=4) mesh, gradients of 4 microbatches summed in a ``lax.scan``:
    the fsdp gradients are already sharded, and sharding the rest does not pay, but the
    data-axis all-reduces leave the loop: ``shard_weight_update`` runs that module (no
    fallback, nothing sharded, fewer all-reduces per microbatch) with jit's numbers.
    The fsdp gradients' all-reduces, each cut to the device's rows before it is
    accumulated, leave it too (the CPU profile knows no memory bound), and no gradient
    is all-reduced in the loop; with the accumulator ``sharded`` they stay
    (``sliced``), reduce-scattered in the loop, and the slices' updates are sharded
    where the gate prices that faster."""
    from jax_train_helpers import assert_close, needs_devices, run_steps

    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    step, params, opt_state, batch = _scan_program(mesh_shape=(2, 4))
    fast = hsj.shard_weight_update(step, accumulator=accumulator)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hsj.FallbackWarning)
        state_fast, _ = run_steps(fast, (params, opt_state), batch)
    assert fast.report is not None and fast.report["fallback"] is None
    if accumulator == "auto":
        assert fast.report["sharded"] == 0
    assert any("moved after the loop" in note for note in fast.report["notes"])
    sliced = [note for note in fast.report["notes"] if "cut to a slice" in note]
    assert bool(sliced) == (accumulator == "sharded")
    staying = [note for note in fast.report["notes"] if "stays in the loop" in note]
    if accumulator == "auto":  # what stays is the loss's sum, not a gradient's
        assert len(staying) == 1 and "a per-iteration output" in staying[0]

    def in_loops(text: str) -> int:
        module = parse(text)
        return sum(i.opcode == "all-reduce" for c in module.computations
                   for loop in c.instructions if loop.opcode == "while"
                   for i in module.computation(loop.called("body")).instructions)

    assert 0 < in_loops(fast.hlo_text) < in_loops(fast.original_hlo_text)
    # (the sliced sums that stay become reduce-scatters in the loop)
    assert in_loops(fast.hlo_text) == len([note for note in staying
                                           if "cut to a slice" not in note])
    state_jit, _ = run_steps(step, (params, opt_state), batch)
    assert_close(state_fast, state_jit)


@pytest.mark.slow
def test_the_hook_moves_xla_fused_accumulation_out_of_the_loop(request):
    """Under ``install()`` the pass sees XLA:CPU's fused module: the gradients and the
    loss's sum in one combined all-reduce, each gradient added into its accumulator by
    a fusion. The gradients leave the loop (one all-reduce after it), the loss's sum
    stays as an all-reduce of its own, and the step computes jit's numbers."""
    from jax_train_helpers import assert_close, needs_devices

    if not needs_devices(request):
        return
    decision, state_hooked, state_jit = hooked_scan_decision(
        "accumulated all-reduce(s) moved after the loop")
    notes = decision.report.notes
    assert decision.changed, decision.reason
    (staying,) = [note for note in notes if "stays in the loop" in note]
    assert "the elements of" in staying and "a per-iteration output" in staying
    assert_close(state_hooked, state_jit)


@pytest.mark.slow
def test_a_step_run_as_it_was_still_says_why_its_sums_stay_in_the_loop(request):
    """bf16 compute on the (data=2, fsdp=4) mesh, a ``fori_loop`` over microbatches: each
    bf16 sum is converted to f32 before it is accumulated, so it stays in the loop; the
    gate keeps the step as it was, and ``fast.report`` still carries the passes' notes
    (what ``--explain`` prints), not only the verdict."""
    from jax_train_helpers import needs_devices, run_steps

    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    step, params, opt_state, batch = _scan_program("fori-mean-bf16", mesh_shape=(2, 4))
    fast = hsj.shard_weight_update(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hsj.FallbackWarning)
        run_steps(fast, (params, opt_state), batch, 1)
    report = fast.report
    assert report is not None and report["fallback"] in (None, "not_faster")
    assert any("converted to another type before it is accumulated" in note
               for note in report["notes"]), report["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_the_hook_moves_a_flax_scan_s_layer_gradients_out_of_the_loop(request, compute):
    """flax linen's ``nn.scan`` over layers (its lm1b/gemma form), seen by ``install()``
    in XLA:CPU's fused module: each layer's gradient is all-reduced in the backward loop
    and written into the stacked gradient by a fusion. The all-reduce leaves the loop
    (the stacked gradients start at zero), so, forced, every stacked gradient's update
    is sharded, computing jit's numbers. In bf16 compute from f32 weights (MaxText's
    default) XLA:CPU sums each bf16 gradient in f32 and the fusion rounds the sum back
    before writing it: the rounding moves after the loop with the sum."""
    from jax_train_helpers import jax, needs_devices, optax

    import hlo_shard.jax as hsj

    nn = pytest.importorskip("flax.linen")
    if not needs_devices(request):
        return
    import numpy as np

    jnp = jax.numpy

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            y = nn.gelu(nn.Dense(64, dtype=compute)(nn.LayerNorm(dtype=compute)(x)))
            return x + nn.Dense(32, dtype=compute)(y), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=4)()(x, None)
            return nn.Dense(8, dtype=compute)(x)

    model, opt = Net(), optax.adamw(1e-2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((model.apply({"params": p}, x).astype(jnp.float32) - y) ** 2)
        )(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    params = jax.device_put(model.init(jax.random.PRNGKey(0), jnp.zeros((8, 32)))["params"],
                            whole)
    opt_state = jax.device_put(opt.init(params), whole)
    key = jax.random.PRNGKey(1)
    batches = [tuple(jax.device_put(jax.random.normal(jax.random.fold_in(key, 10 * j + i),
                                                      shape), split)
                     for j, shape in enumerate(((16, 32), (16, 8)))) for i in range(2)]
    jitted = jax.jit(step)
    hsj.decisions(clear=True)
    with hsj.install(force=True):
        hooked = jax.jit(step)
        state, state_jit = (params, opt_state), (params, opt_state)
        for x, y in batches:
            *state, loss = hooked(*state, x, y)
            *state_jit, loss_jit = jitted(*state_jit, x, y)
    (decision,) = [d for d in hsj.decisions(clear=True) if not d.reused and d.report]
    assert decision.changed, decision.reason
    stacked = [row for row in decision.report.explanations if row.shape.startswith("f32[4,")]
    assert len(stacked) == 6 and all(row.sharded for row in stacked)
    assert any("moved after the loop" in note for note in decision.report.notes)
    assert float(loss) == float(loss_jit)
    for leaf, leaf_jit in zip(jax.tree.leaves(state), jax.tree.leaves(state_jit)):
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(leaf_jit), rtol=1e-6, atol=1e-7)


def _first_microbatch_program():
    """big_vision's ``accumulate_gradient`` (big_vision/utils.py, the code unchanged, its
    image slices 2-D here): the first microbatch's loss and gradient computed before a
    ``fori_loop`` over the others, which carries them in; an MLP + adam step on a batch
    sharded over 8 devices (the loop's ``dynamic_slice`` of the sharded batch makes the
    partitioner all-gather it: the body's gradients are summed nowhere, the first one
    before the loop)."""
    from jax_train_helpers import (AXIS, NamedSharding, P, jax, mlp_batch, mlp_loss,
                                   mlp_params, np, optax)

    def accumulate_gradient(loss_and_grad_fn, params, images, labels, accum_steps):
        """Accumulate gradient over multiple steps to save on memory."""
        if accum_steps and accum_steps > 1:
            assert images.shape[0] % accum_steps == 0, (
                f"Bad accum_steps {accum_steps} for batch size {images.shape[0]}")
            step_size = images.shape[0] // accum_steps
            l, g = loss_and_grad_fn(params, images[:step_size], labels[:step_size])  # noqa: E741 (big_vision's names)

            def acc_grad_and_loss(i, l_and_g):
                imgs = jax.lax.dynamic_slice(images, (i * step_size, 0),
                                             (step_size,) + images.shape[1:])
                lbls = jax.lax.dynamic_slice(labels, (i * step_size, 0),
                                             (step_size, labels.shape[1]))
                li, gi = loss_and_grad_fn(params, imgs, lbls)
                l, g = l_and_g  # noqa: E741
                return (l + li, jax.tree.map(lambda x, y: x + y, g, gi))
            l, g = jax.lax.fori_loop(1, accum_steps, acc_grad_and_loss, (l, g))  # noqa: E741
            return jax.tree.map(lambda x: x / accum_steps, (l, g))
        else:
            return loss_and_grad_fn(params, images, labels)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), (AXIS,))
    opt = optax.adam(1e-2)

    def loss_and_grad(params, x, y):
        return jax.value_and_grad(mlp_loss)(params, {"x": x, "y": y})

    def step(params, opt_state, batch):
        loss, grads = accumulate_gradient(loss_and_grad, params, batch["x"], batch["y"],
                                          MICRO)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def init():
        params = mlp_params(jax.random.PRNGKey(0))
        return params, jax.jit(opt.init)(params)

    def batch(i):
        return jax.device_put(mlp_batch(jax.random.PRNGKey(100 + i), MICRO * 16),
                              NamedSharding(mesh, P(AXIS)))

    return jax.jit(step), init, batch


def test_big_vision_s_first_microbatch_gradient_is_sharded(request, worker):
    """Each gradient summed before the loop and carried in (6 leaves) was kept whole
    ('all users need the full gradient: the tuple read by the while') and unnamed: the
    loop now starts at zero and the sum feeds the update after it, sharded, named by its
    weight; the step trains like jit with its state sharded."""
    from jax_train_helpers import assert_close, needs_devices, run_forced, run_steps

    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    step, init, batch = _first_microbatch_program()
    text = hsj.per_device_hlo(step, *init(), batch(0))
    result = hlo_shard.optimize(parse(text), ShardingOptions(state="sharded"), force=True)
    assert sum(r.sharded for r in result.report.explanations) == 6, \
        [r.reason for r in result.report.explanations]
    # every start, the biases' through jax's reshape and sum over a dimension of size 1
    # too, and each update moves with it (not just the ops before the loop)
    assert any("6 accumulator(s) started from a sum" in note for note in result.report.notes)
    assert all(r.ops_moved > 10 for r in result.report.explanations if r.sharded)
    fast, final, _ = run_forced(step, "sharded", init, batch)
    assert fast.report is not None and fast.report["sharded"] == 6
    # each named by its weight, read through the loop the sum starts
    assert sorted(e["gradient_of"] for e in fast.report["explanations"] if e["sharded"]) == \
        sorted(f"params['{layer}']['{leaf}']" for layer in ("l0", "l1", "l2") for leaf in "bw")
    assert_close(final, run_steps(step, init(), batch)[0])


def test_bf16_layers_in_a_scan_keep_jit_s_numbers(request):
    """Weights stored in bf16, scanned over layers (probe W F2): XLA:CPU all-reduces each
    layer's bf16 gradient in the backward loop as an f32 sum of each device's unrounded
    product; moved after the loop, the stacked bf16 slot would round each device's
    product first (a ulp in a third of the elements after one step). On the CPU profile
    the sums stay in the loop (``narrow-write``) and the step is jit's, bit for bit."""
    from jax_train_helpers import jax, needs_devices, optax

    import hlo_shard.jax as hsj
    from hlo_shard.passes.accumulation_motion import REASONS

    if not needs_devices(request):
        return
    import numpy as np

    jnp = jax.numpy
    layers, width = 4, 64
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(keys[0], (layers, width, 2 * width), jnp.bfloat16) / 8,
              "w2": jax.random.normal(keys[1], (layers, 2 * width, width), jnp.bfloat16) / 11,
              "head": jax.random.normal(keys[2], (width, 1), jnp.bfloat16) / 8}
    opt = optax.adam(1e-3)

    def loss(p, x, y):
        def layer(h, w):
            return h + jax.nn.gelu(h @ w["w1"]) @ w["w2"], None
        h, _ = jax.lax.scan(layer, x.astype(jnp.bfloat16), {k: p[k] for k in ("w1", "w2")})
        return jnp.mean(((h @ p["head"])[:, 0].astype(jnp.float32) - y) ** 2)

    def step(p, s, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    state = jax.device_put((params, opt.init(params)), whole)
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (16, width)), split)
    y = jax.device_put(jax.random.normal(jax.random.PRNGKey(2), (16,)), split)
    jitted = jax.jit(step)
    fast = hsj.shard_weight_update(jitted)
    state_fast, state_jit = state, state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hsj.FallbackWarning)  # (nothing else to shard)
        for _ in range(2):
            *state_fast, _ = fast(*state_fast, x, y)
            *state_jit, _ = jitted(*state_jit, x, y)
    assert any(REASONS["narrow-write"] in note for note in fast.report["notes"]), \
        fast.report["notes"]
    for got, want in zip(jax.tree.leaves(state_fast), jax.tree.leaves(state_jit)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
