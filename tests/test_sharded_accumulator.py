"""The sharded accumulator: an accumulation loop reduce-scatters each microbatch's gradient
inside the loop into an accumulator carried as a shard (``accumulator="sharded"``), or
once after the loop (``"whole"``), or whichever the cost model predicts faster
(``"auto"``, the default).

Structure on the hand-written loop of ``test_accumulation`` (fast), numbers through real
XLA on 8 CPU devices (the original against each form, and a mutant the check must call
DIFFER), a real jax ``lax.scan`` step (slow).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import hlo_shard
from hlo_shard import runtime
from hlo_shard.analysis.collectives import ReasonCode
from hlo_shard.cli import main
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.graph import Rewriter
from hlo_shard.ir import Module, TupleShape
from hlo_shard.parser import parse
from hlo_shard.passes.pipeline import Pipeline, validate_printed
from hlo_shard.passes.sharded_accumulator import AccumulatorReport, ShardedAccumulator
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.printer import format_shape, to_text
from hlo_shard.profiles import load_profile

from test_accumulation import (COLLECTIVES, LOOP, MEAN, _loop_body, _scan_program,
                               hooked_scan_decision)
from wus_helpers import find, optimize

#: LOOP with a 30-wide input: the bias gradient (30 elements) does not split in 8, so
#: the shard format pads it with zeros before the reduce-scatter.
PADDED = re.sub(r"(?<=[\[,{])32(?=[\],}])", "30", LOOP)


def collectives(module: Module, comp: str) -> list[str]:
    return [i.opcode for i in module.computation(comp).instructions if i.opcode in COLLECTIVES]


def carried(module: Module) -> list[str]:
    (loop,) = find(module, "while")
    assert isinstance(loop.shape, TupleShape)
    return [format_shape(s) for s in loop.shape.elements]


def accumulator_report(module: Module, mode: str) -> AccumulatorReport:
    result = Pipeline((ShardedAccumulator(load_profile("cpu-local"), mode),),
                      check=validate_printed).run(module)
    return result.report(AccumulatorReport)


# ------------------------------------------------------------------- structure (fast)


@pytest.mark.parametrize("text", [LOOP, PADDED], ids=["even", "padded"])
def test_the_sharded_accumulator_reduce_scatters_in_the_loop(text):
    """One reduce-scatter per microbatch in the body, none after the loop, the two
    accumulators leave the carry and one shard of the bucket takes their place."""
    module, report = optimize(text, state="sharded", accumulator="sharded")
    assert collectives(module, "body") == ["reduce-scatter"]
    assert [i.opcode for i in module.entry.instructions if i.opcode in COLLECTIVES] \
        == ["all-gather"]  # the weight, after its sharded update
    shard = find(module, "reduce-scatter", "body")[0].shape
    assert carried(module)[1] == format_shape(shard) and len(carried(module)) == 4
    assert not any(s in carried(module) for s in ("f32[16,32]", "f32[16,30]"))
    (note,) = [n for n in report.notes if "accumulator sharded" in n]
    assert "reduce-scatters each microbatch inside the loop; slots 1, 2" in note


#: LOOP as XLA:CPU's fusion leaves it (what ``install()`` reads): the weight gradient
#: added into its accumulator by a fusion that adds it through a layout-changing copy, the
#: accumulator's zero start a fused broadcast of the scalar, copied.
FUSED_ADD = """accumulate_w { a = f32[16,32] parameter(0) g = f32[16,32] parameter(1)
 c = f32[16,32]{0,1} copy(g) ROOT s = f32[16,32] add(a, c) }
zeros_w { v = f32[] parameter(0) ROOT b = f32[16,32] broadcast(v), dimensions={} }
body {"""
FUSED = LOOP.replace("body {", FUSED_ADD, 1).replace(
    "tw = f32[16,32] copy(arw) naccw = f32[16,32] add(accw, tw)",
    "naccw = f32[16,32] fusion(accw, arw), kind=kLoop, calls=accumulate_w").replace(
    "zw = f32[16,32] broadcast(f0), dimensions={}",
    "zf = f32[16,32] fusion(f0), kind=kLoop, calls=zeros_w zw = f32[16,32] copy(zf)")


def test_xla_s_fused_accumulation_is_carried_as_a_shard():
    """The fused add (through its copy) and the fused zero start are read as the add and
    the zero they are: the reduce-scatter moves into the loop, which adds the copy of the
    microbatch's gradient, made as an instruction of the body, into the shard."""
    assert FUSED != LOOP and "fusion(accw, arw)" in FUSED and "copy(zf)" in FUSED
    module, report = optimize(FUSED, state="sharded", accumulator="sharded")
    assert collectives(module, "body") == ["reduce-scatter"]
    assert len(carried(module)) == 4
    (note,) = [n for n in report.notes if "accumulator sharded" in n]
    assert "slots 1, 2" in note
    body = module.computation("body")
    (layout,) = [i for i in body.instructions if i.opcode == "copy"]
    assert format_shape(layout.shape) == "f32[16,32]{0,1}"
    assert not any(i.opcode == "fusion" and i.called("calls") == "accumulate_w"
                   for i in body.instructions)


@pytest.mark.parametrize("edit", [
    # the fusion adds the gradient through an op that computes (a scaling), not a copy
    ("c = f32[16,32]{0,1} copy(g)", "k = f32[] constant(0.5) "
     "kb = f32[16,32] broadcast(k), dimensions={} c = f32[16,32] multiply(g, kb)"),
    # the fusion computes something else beside the add
    ("ROOT s = f32[16,32] add(a, c) }",
     "n = f32[16,32] negate(a) ROOT s = f32[16,32] add(a, c) }"),
])
def test_a_fusion_that_does_more_than_add_stays_whole(edit):
    """What is not a copy of the addend, or not all the fusion computes, is not an
    accumulation the loop can make again: the reduce-scatter stays after the loop."""
    text = FUSED.replace(*edit)
    assert text != FUSED
    module, report = optimize(text, state="sharded", accumulator="sharded")
    assert collectives(module, "body") == []
    assert any("accumulator whole" in n and "not only added to" in n for n in report.notes), \
        report.notes


def test_whole_keeps_the_reduce_scatter_after_the_loop_and_says_so():
    module, report = optimize(LOOP, state="sharded", accumulator="whole")
    assert collectives(module, "body") == [] and len(find(module, "reduce-scatter")) == 1
    assert any("accumulator whole" in n and "(accumulator='whole')" in n for n in report.notes)


def test_auto_writes_the_form_predicted_faster():
    """On cpu-local one reduce-scatter per step is predicted faster than one per
    microbatch: auto writes exactly what ``whole`` writes, and the note gives both
    predicted step times."""
    whole, _ = optimize(LOOP, state="sharded", accumulator="whole")
    auto, report = optimize(LOOP, state="sharded")
    (note,) = [n for n in report.notes if "accumulator" in n and "while" in n
               and "moved after" not in n]
    prices = re.search(r"predicted (.+)/step sharded, (.+)/step whole", note)
    assert prices is not None, note
    assert "predicted slower" in note and to_text(auto) == to_text(whole)


def test_auto_chooses_by_the_prices():
    """The pass itself, on the whole form: ``sharded`` rewrites, ``auto`` rewrites only
    when its prices say faster, and the report carries the prices and the reason code."""
    module, _ = optimize(LOOP, state="sharded", accumulator="whole")
    report = accumulator_report(module.clone(), "auto")
    assert report.prices is not None
    faster = report.prices.sharded_s < report.prices.whole_s
    assert bool(report.sharded) is faster and bool(report.whole) is not faster
    assert all(w.code is ReasonCode.ACCUMULATOR_WHOLE and w.reason == "slower"
               for w in report.whole)


def test_a_chosen_sharded_accumulator_need_only_beat_the_input():
    """The speed gate: where sharding is predicted slower than the moved loop (whose
    accumulators stay whole) but faster than the input by the margin, ``auto`` writes
    the moved loop and ``accumulator="sharded"``, the user's choice of memory over
    collectives, the sharded accumulator (it sharded nothing, silently, before)."""
    auto = hlo_shard.optimize(parse(LOOP), ShardingOptions(state="sharded"))
    chosen = hlo_shard.optimize(parse(LOOP), ShardingOptions(state="sharded",
                                                             accumulator="sharded"))
    assert auto.sharded == 0 and auto.decision is not None and auto.decision.moves_only
    decision = chosen.decision
    assert decision is not None and decision.chosen is not None and chosen.sharded == 2
    assert decision.unsharded_s is not None
    assert decision.unsharded_s < decision.after_s <= decision.before_s * (1 - decision.min_gain)
    assert collectives(chosen.module, "body") == ["reduce-scatter"]


def test_auto_shards_the_accumulator_where_only_the_sharded_form_fits():
    """Issue #27: the sharded form trades a collective per microbatch for 1/N of the
    accumulators. ``auto`` writes it when predicted faster, or when the whole form's
    modelled peak exceeds the device's memory (the profile's ``device_memory_bytes``)
    and the sharded form's does not, and the note says so; a profile that knows no
    device memory (XLA CPU) decides by speed alone."""
    from dataclasses import replace

    from hlo_shard.passes.sharded_accumulator import AccumulatorPrices

    slower = AccumulatorPrices("gpu", 1.0, 1.2, whole_peak_bytes=90 << 30,
                               sharded_peak_bytes=60 << 30, whole_accumulator_bytes=40 << 30,
                               sharded_accumulator_bytes=5 << 30)
    assert not slower.sharded_wins  # no device memory known: speed decides
    fits = replace(slower, device_memory_bytes=80 << 30)
    assert fits.only_sharded_fits and fits.sharded_wins
    assert "only the sharded form fits the device's 80 GiB" in fits.words
    roomy, neither = replace(slower, device_memory_bytes=96 << 30), \
        replace(slower, device_memory_bytes=50 << 30)
    assert not (roomy.sharded_wins or neither.sharded_wins)  # both fit / neither fits
    assert replace(slower, sharded_s=0.9).sharded_wins
    # The pass hands the profile's device memory to the comparison.
    module, _ = optimize(LOOP, state="sharded", accumulator="whole")
    gpu_memory = replace(load_profile("cpu-local"), device_memory_bytes=80 << 30)
    result = Pipeline((ShardedAccumulator(gpu_memory, "auto"),),
                      check=validate_printed).run(module)
    prices = result.report(AccumulatorReport).prices
    assert prices is not None and prices.device_memory_bytes == 80 << 30


def _whole_text() -> str:
    module, _ = optimize(LOOP, state="sharded", accumulator="whole")
    return to_text(module)


@pytest.mark.parametrize("edit, reason", [
    # the accumulated gradient is also an output: it is needed whole after the loop
    (("ROOT %out = (f32[32,16], f32[4]) tuple(%nw.gathered.1, %nb.shard.1)",
      "ROOT %out = (f32[32,16], f32[4], f32[32]) tuple(%nw.gathered.1, %nb.shard.1, "
      "%accumulated_2.1)"), "not-only-accumulators"),
    # one gradient of the bucket passes through an op that is not a shard format
    (("%accumulated_2.1.rows.1 = f32[8,4] reshape(%accumulated_2.1)",
      "%negated = f32[32] negate(%accumulated_2.1) "
      "%accumulated_2.1.rows.1 = f32[8,4] reshape(%negated)"), "not-only-accumulators"),
    # the condition reads the accumulator
    (("ROOT %lt = pred[] compare(%i, %n), direction=LT",
      "%ab = f32[32] get-tuple-element(%p), index=2 %a0 = f32[1] slice(%ab), slice={[0:1]} "
      "%a = f32[] reshape(%a0) %big = f32[] constant(1e30) "
      "%small = pred[] compare(%a, %big), direction=LT %c = pred[] compare(%i, %n), "
      "direction=LT ROOT %lt = pred[] and(%c, %small)"), "accumulator-read"),
    # the accumulator starts the loop at something else than zero
    (("%accumulator_zeros.1 = f32[32] broadcast(%zero.1)",
      "%accumulator_zeros.1 = f32[32] broadcast(%f0)"), None),
])
def test_what_cannot_be_proven_stays_whole(edit, reason):
    text = _whole_text()
    assert edit[0] in text
    text = text.replace(*edit)
    if "tuple(%nw.gathered.1, %nb.shard.1, %accumulated_2.1)" in text:  # the signature too
        text = text.replace("-> (f32[32,16], f32[4]) {", "-> (f32[32,16], f32[4], f32[32]) {")
    if reason is None:  # a non-zero start: the constant's value
        text = text.replace("%f0 = f32[] constant(0)", "%f0 = f32[] constant(1)")
        reason = "nonzero-start"
    module = parse(text)
    report = accumulator_report(module, "sharded")
    assert to_text(module) == to_text(parse(text))
    assert [(w.reduce_scatter, w.reason) for w in report.whole] == [("reduce-scatter.1", reason)]
    assert "accumulator whole" in report.notes[0]


def test_the_cli_says_which_form(tmp_path):
    source = tmp_path / "loop.hlo"
    source.write_text(LOOP)
    out = tmp_path / "out.hlo"
    result = CliRunner().invoke(main, ["optimize", "--force", "--state", "sharded",
                                       "--accumulator", "sharded", "--explain", str(source),
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "accumulator sharded (accumulator=sharded)" in result.output
    assert collectives(parse(out.read_text()), "body") == ["reduce-scatter"]
    bad = CliRunner().invoke(main, ["optimize", "--accumulator", "half", str(source),
                                    "-o", str(out)])
    assert bad.exit_code == 2


def test_a_bad_mode_is_a_one_line_error():
    with pytest.raises(hlo_shard.HloShardError, match="accumulator must be one of"):
        hlo_shard.optimize(parse(LOOP), ShardingOptions(accumulator="half"))


# ---------------------------------------------------------- numbers through real XLA


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


def _verify(text: str, mode: str, mutate=None, strategy: str = "auto"
            ) -> runtime.VerifyReport:
    module = parse(text)
    result = hlo_shard.optimize(module, ShardingOptions(state="sharded", accumulator=mode,
                                                        strategy=strategy), force=True)
    optimized = parse(result.text)
    if mutate is not None:
        mutate(optimized)
    return runtime.verify(parse(text), optimized, runtime.VerifyOptions(
        steps=3, manifest=build_manifest(result.report, module)))


@pytest.mark.parametrize("text", [LOOP, MEAN, PADDED, FUSED],
                         ids=["sum", "mean", "padded", "fused"])
@pytest.mark.parametrize("mode", ["sharded", "whole"])
def test_both_forms_compute_the_same(worker, text, mode):
    result = _verify(text, mode)
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


def test_one_reduce_scatter_per_gradient_each_into_its_shard(worker):
    """``strategy="per-tensor"``: two reduce-scatters feed the loop's two accumulators;
    each becomes its own shard slot (the weight's split along a dimension)."""
    module, report = optimize(LOOP, state="sharded", accumulator="sharded",
                              strategy="per-tensor")
    assert collectives(module, "body") == ["reduce-scatter"] * 2
    assert carried(module)[1:3] == ["f32[16,4]", "f32[4]"]
    assert sum("accumulator sharded" in n for n in report.notes) == 2
    result = _verify(LOOP, "sharded", strategy="per-tensor")
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


def test_keeping_only_the_last_microbatch_is_caught(worker):
    """A mutant: the shard takes each microbatch's reduce-scatter instead of adding it
    (the last microbatch only) must DIFFER."""
    def last_only(module: Module) -> None:
        body = module.computation("body")
        (accumulate,) = [i for i in body.instructions if i.name.endswith("accumulate.1")]
        Rewriter(body).replace_all_uses_with(accumulate.name, accumulate.operands[1])

    assert not _verify(LOOP, "sharded", last_only).ok


# ------------------------------------------------------------------- a real jax step


@pytest.mark.slow
def test_a_scan_accumulates_into_a_shard(request, worker):
    """A ``lax.scan`` over 4 microbatches (MLP + adam, 8 CPU devices) with
    ``accumulator="sharded"``: the loop body's only collectives are the loss's scalar
    all-reduce and one reduce-scatter per gradient bucket, nothing is reduce-scattered
    after the loop, the carry holds no whole gradient, and the numbers MATCH jit's."""
    from jax_train_helpers import needs_devices

    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    step, params, opt_state, batch = _scan_program("scan-sum")
    text = hsj.per_device_hlo(step, params, opt_state, batch(0))
    body = _loop_body(parse(text))
    result = hlo_shard.optimize(parse(text), ShardingOptions(state="sharded",
                                                             accumulator="sharded"),
                                force=True)
    module = parse(result.text)
    inside = collectives(module, body)
    assert inside.count("all-reduce") == 1 and inside.count("reduce-scatter") >= 1
    assert not find(module, "reduce-scatter")
    assert any("accumulator sharded" in n for n in result.report.notes)
    outcome = runtime.verify(parse(text), module, runtime.VerifyOptions(
        steps=3, manifest=build_manifest(result.report, parse(text))))
    assert outcome.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in outcome.final()]


@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_a_captured_scan_on_a_2x4_mesh_accumulates_into_a_shard(worker, state):
    """jax's own module (``tests/data``: a ``lax.scan`` over 4 microbatches, the batch on
    the second axis of a (2, 4) mesh, so the gradients are summed over groups of 4): the
    reduce-scatter moves into the loop with the data-axis groups, and it MATCHes."""
    path = Path(__file__).parent / "data" / "grad_accum_scan_2x4.n8.hlo"
    text = path.read_text()
    result = hlo_shard.optimize(parse(text), ShardingOptions(state=state,
                                                             accumulator="sharded"),
                                force=True)
    module = parse(result.text)
    (loop,) = find(module, "while")
    body = loop.attr("body").name  # type: ignore[union-attr]
    (scatter,) = [i for i in module.computation(body).instructions
                  if i.opcode == "reduce-scatter"]
    assert len(str(scatter.attr("replica_groups")).split("},{")) == 2  # 2 groups of 4
    assert not find(module, "reduce-scatter")
    outcome = runtime.verify(parse(text), module, runtime.VerifyOptions(
        steps=3, manifest=build_manifest(result.report, parse(text))))
    assert outcome.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in outcome.final()]


@pytest.mark.parametrize("mode", ["sharded", "whole"])
def test_shard_weight_update_takes_the_accumulator_form(request, mode):
    """``shard_weight_update(accumulator=...)``, as ``optimize --accumulator``: a
    ``lax.scan`` over 4 microbatches reduce-scatters each microbatch's gradient in the
    loop into a shard (``sharded``) or once after it (``whole``); the numbers are
    jit's, run through XLA on 8 CPU devices."""
    from jax_train_helpers import jax, needs_devices, np

    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    step, params, opt_state, batch = _scan_program("scan-sum")
    fast = hsj.shard_weight_update(step, state="sharded", accumulator=mode, force=True)
    p, s, p_jit, s_jit = params, opt_state, params, opt_state
    for i in range(2):
        p, s, loss = fast(p, s, batch(i))
        p_jit, s_jit, loss_jit = step(p_jit, s_jit, batch(i))
        np.testing.assert_allclose(float(loss), float(loss_jit), rtol=1e-5)
    assert fast.report is not None and fast.report["fallback"] is None
    assert any(f"accumulator {mode}" in note for note in fast.report["notes"])
    module = parse(fast.hlo_text or "")
    body = _loop_body(module)
    scattered_inside = "reduce-scatter" in collectives(module, body)
    assert scattered_inside == (mode == "sharded")
    assert bool(find(module, "reduce-scatter")) == (mode == "whole")  # after the loop
    for leaf, leaf_jit in zip(jax.tree.leaves(fast.gather_args(p, s)),
                              jax.tree.leaves((p_jit, s_jit))):
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(leaf_jit), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.slow
def test_the_hook_carries_xla_s_fused_accumulators_as_shards(request):
    """``install(accumulator="sharded")``: the pass sees XLA:CPU's fused module, each
    gradient added into its accumulator by a fusion (the weights' through a transpose
    and a layout copy) and the accumulators started by fused zero broadcasts. The
    reduce-scatter moves into the loop (before, every such fusion read as "not only
    added to" and the accumulators stayed whole), and the step computes jit's numbers.
    (Slow: two compiles of the step, one under the hook.)"""
    from jax_train_helpers import assert_close, needs_devices

    if not needs_devices(request):
        return
    decision, state_hooked, state_jit = hooked_scan_decision(
        "accumulator", accumulator="sharded", force=True)
    assert decision.changed, decision.reason
    notes = [n for n in decision.report.notes if "accumulator" in n and "while" in n]
    assert any("accumulator sharded (accumulator=sharded)" in n for n in notes), notes
    assert not any("accumulator whole" in n for n in notes), notes
    assert_close(state_hooked, state_jit)


def test_shard_weight_update_refuses_an_unknown_accumulator_at_once():
    import hlo_shard.jax as hsj
    from hlo_shard.errors import HloShardError

    with pytest.raises(HloShardError, match="accumulator must be one of auto, whole, sharded"):
        hsj.shard_weight_update(lambda x: x, accumulator="halved")
