"""The partitioner's all-reduce + dynamic-slice pairs as reduce-scatters (issue 23, item 2):
the pass (:mod:`hlo_shard.passes.reduce_scatter_creation`) rewrites a pair only where the
slice each device keeps, evaluated device by device, tiles its group into blocks, and
where the collective pricing predicts the rewrite faster; what it writes computes what the
pair computed on 8 CPU devices (the golden case, ``tests/golden_pass/
reduce_scatter_creation.hlo``, shows the text)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from hlo_shard import parse, runtime, to_text
from hlo_shard.ir import Module
from hlo_shard import optimize
from hlo_shard.passes.reduce_scatter_creation import (ReduceScatterCreation,
                                                      ReduceScatterReport, IndexEvaluator)
from hlo_shard.passes.weight_update import ShardingOptions

from test_llm_steps import FSDP_STEP, PARTITIONER_FORM

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden_pass" / "reduce_scatter_creation.hlo"
TABLE = "%offsets = s32[8]{0} constant({0, 128, 256, 384, 512, 640, 768, 896})"


def fsdp_step(table: str = TABLE) -> Module:
    module = parse(FSDP_STEP.replace("{ds}", PARTITIONER_FORM.replace(TABLE, table)))
    module.header["num_partitions"] = 8
    return module


def opcodes(module: Module) -> list[str]:
    return [inst.opcode for inst in module.entry.instructions]


def run_pass(module: Module, profile: str = "cpu-local") -> ReduceScatterReport:
    result = ReduceScatterCreation(profile).run(module)
    assert result.report is not None
    return result.report


def test_the_partitioner_form_becomes_a_reduce_scatter_of_the_devices_rows():
    module = fsdp_step()
    report = run_pass(module)
    (decision,) = report.decisions
    assert decision.reduce_scatter and decision.after_s < decision.before_s
    assert "dynamic-slice" not in opcodes(module) and "partition-id" not in opcodes(module)
    scatter = module.entry[decision.reduce_scatter]
    assert to_text(module).count("reduce-scatter(%gw)") == 1
    assert scatter.shape.dims == (128, 1024) and scatter.attr("dimensions") == (0,)
    assert scatter.attr("replica_groups").groups == (tuple(range(8)),)
    assert scatter.attr("use_global_device_ids") is True and scatter.attr("channel_id") == 4
    assert module.entry["gw.t"].shape.dims == (128, 1024)  # the copy runs on the block


@pytest.mark.parametrize("table, why", [
    # Shifted by one block: device 7 clamps to block 7 again, no device keeps block 0.
    ("{128, 256, 384, 512, 640, 768, 896, 1024}", "do not hold every block"),
    # Two devices keep the same block: not a tiling of the group.
    ("{0, 128, 256, 384, 512, 640, 768, 768}", "do not hold every block"),
    # Between blocks.
    ("{0, 129, 256, 384, 512, 640, 768, 896}", "not at a block"),
], ids=["shifted", "repeated", "unaligned"])
def test_a_slice_that_is_not_a_block_per_device_is_left_alone(table, why):
    module = fsdp_step(f"%offsets = s32[8]{{0}} constant({table})")
    before = to_text(module)
    report = run_pass(module)
    (decision,) = report.decisions
    assert not decision.reduce_scatter and why in decision.kept_because
    assert to_text(module) == before


def test_a_permuted_table_scatters_over_the_groups_in_block_order():
    """Device d keeps block 7 - d: a reduce-scatter whose group lists the devices in the
    order of their blocks (XLA gives position j of a group the j-th block)."""
    module = fsdp_step("%offsets = s32[8]{0} constant({896, 768, 640, 512, 384, 256, 128, 0})")
    (decision,) = run_pass(module).decisions
    groups = module.entry[decision.reduce_scatter].attr("replica_groups")
    assert groups.groups == ((7, 6, 5, 4, 3, 2, 1, 0),) and groups.text is None


def test_a_split_that_the_profile_prices_slower_is_kept_and_says_why():
    """4 blocks among 8 devices on shared-memory CPU devices: the second collective's
    rendezvous costs more than the bytes it saves on a small gradient."""
    module = parse(GOLDEN.read_text())
    decisions = {d.all_reduce: d for d in run_pass(module, "cpu-local").decisions}
    assert decisions["ga"].reduce_scatter
    assert not decisions["gb"].reduce_scatter
    assert decisions["gb"].kept_because.startswith(
        "a reduce-scatter over 4 and an all-reduce of the block over 2 predicted")
    assert "profile cpu-local" in decisions["gb"].kept_because
    assert "gb" in {i.name for i in module.entry.instructions}


def test_blocks_strided_in_the_all_reduces_layout_pay_for_a_transpose():
    """The gradient laid out column-major (an FSDP weight's gradient computed transposed):
    each device's rows are strided, the whole gradient is transposed before the
    reduce-scatter, a pass over its bytes that prices the pair faster kept on XLA:CPU."""
    text = FSDP_STEP.replace("{ds}", PARTITIONER_FORM) \
        .replace("%gw = f32[1024,1024]{1,0} dot", "%gw = f32[1024,1024]{0,1} dot") \
        .replace("%gw.sum = f32[1024,1024]{1,0} all-reduce", "%gw.sum = f32[1024,1024]{0,1} all-reduce") \
        .replace("  %gw.t = f32[1024,1024]{0,1} copy(%gw.sum)\n", "") \
        .replace("dynamic-slice(%gw.t,", "dynamic-slice(%gw.sum,")
    module = parse(text)
    module.header["num_partitions"] = 8
    (decision,) = run_pass(module).decisions
    assert not decision.reduce_scatter
    assert decision.kept_because.startswith("a reduce-scatter over 8 predicted")
    (contiguous,) = run_pass(fsdp_step()).decisions
    assert contiguous.reduce_scatter and decision.after_s > contiguous.after_s


def test_a_split_of_a_bf16_gradient_is_kept_whatever_the_price():
    """The split sums partial sums, then theirs: in bf16 that rounds differently from the
    all-reduce at the type's precision (``verify`` says DIFFERENT), so it is not written
    even where the profile prices it faster; a plain reduce-scatter still is."""
    module = parse(GOLDEN.read_text().replace("f32[", "bf16["))
    decisions = {d.all_reduce: d for d in run_pass(module, "h100").decisions}
    assert decisions["ga"].reduce_scatter
    assert not decisions["gb"].reduce_scatter
    assert decisions["gb"].kept_because.endswith("rounded differently at the type's precision")


def test_every_edit_is_logged():
    from test_change_log import check_pass

    assert check_pass(ReduceScatterCreation("h100"), parse(GOLDEN.read_text()))


def test_offsets_are_evaluated_per_device():
    index = IndexEvaluator(parse(GOLDEN.read_text()).entry)
    assert [index.scalar("offset.b", 0, p) for p in range(8)] == [0, 0, 8, 8, 16, 16, 24, 24]
    assert [index.scalar("shift", 0, p) for p in range(8)] == [16 * (p + 1) for p in range(8)]
    assert index.scalar("ga", 0, 0) is None  # not index arithmetic


def test_explain_says_the_pair_became_a_reduce_scatter():
    result = optimize(parse(FSDP_STEP.replace("{ds}", PARTITIONER_FORM)),
                                            ShardingOptions())
    report, text, _ = result.report, result.text, result.decision
    row = {r.all_reduce: r for r in report.explanations}["gw.sum"]
    assert row.reason_code == "already_sharded" and not row.sharded
    assert "the all-reduce and its dynamic-slice became reduce-scatter %gw.sum.scatter" in \
        row.reason
    assert any("pair(s) of the partitioner's reduce-scatter form became reduce-scatters" in n
               for n in report.notes)
    assert "reduce-scatter(%gw)" in text


#: The pair as XLA:CPU fuses it (what ``install()`` sees): the slice and the lookup of the
#: device's offset inside a fusion, the partition id and the table passed in.
FUSED_SLICE = """\
%fused_slice (sum: f32[1024,1024], table: s32[8], id: u32[]) -> f32[128,1024] {
  %sum = f32[1024,1024]{1,0} parameter(0)
  %table = s32[8]{0} parameter(1)
  %id = u32[] parameter(2)
  %row.1 = s32[1]{0} dynamic-slice(%table, %id), dynamic_slice_sizes={1}
  %row = s32[] bitcast(%row.1)
  %c0 = s32[] constant(0)
  ROOT %rows = f32[128,1024]{1,0} dynamic-slice(%sum, %row, %c0), dynamic_slice_sizes={128,1024}
}

"""
FUSED_FORM = """\
  %gw.sum = f32[1024,1024]{1,0} all-reduce(%gw), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %offsets = s32[8]{0} constant({0, 128, 256, 384, 512, 640, 768, 896})
  %pid = u32[] partition-id()
  %gw.mine = f32[128,1024]{1,0} fusion(%gw.sum, %offsets, %pid), kind=kLoop, calls=%fused_slice"""
#: Both forms reading one sum: the plain slice alone would make a pair.
BOTH_FORMS = FUSED_FORM.replace("%gw.mine", "%gw.fused") + """
  %offset.1 = s32[1]{0} dynamic-slice(%offsets, %pid), dynamic_slice_sizes={1}
  %offset = s32[] reshape(%offset.1)
  %c0 = s32[] constant(0)
  %gw.slice = f32[128,1024]{1,0} dynamic-slice(%gw.sum, %offset, %c0), dynamic_slice_sizes={128,1024}
  %gw.mine = f32[128,1024]{1,0} add(%gw.fused, %gw.slice)"""


@pytest.mark.parametrize("form", [FUSED_FORM, BOTH_FORMS], ids=["fused", "fused-and-plain"])
def test_a_slice_fused_by_xla_reads_as_already_sharded_and_is_left_as_it_is(form):
    """The sum is already sharded whichever form takes the device's slice; no rewrite
    reads into a fusion, so the pair stays, and where a plain slice reads the same sum
    it stays too (a reduce-scatter would leave the fusion a block to slice)."""
    module = parse(FSDP_STEP.replace("{ds}", form).replace("ENTRY", FUSED_SLICE + "ENTRY"))
    module.header["num_partitions"] = 8
    before = to_text(module)
    report = run_pass(module)
    (decision,) = report.decisions
    assert not decision.reduce_scatter
    assert "fused kernel %gw." in decision.kept_because
    assert to_text(module) == before
    row = {r.all_reduce: r for r in optimize(module, ShardingOptions()).report.explanations}[
        "gw.sum"]
    assert row.reason_code == "already_sharded" and "fused by XLA" in row.reason


#: Gradients summed over microbatches in a loop, each microbatch's sum sliced to this
#: device's rows at an offset the loop carries unchanged from before it (a partition-id
#: lookup XLA's loop-invariant code motion hoisted out of the body).
CARRIED_OFFSET = """HloModule carried, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (state: (s32[], f32[8,4], s32[], f32[32,4])) -> (s32[], f32[8,4], s32[], f32[32,4]) {
  %state = (s32[], f32[8,4]{1,0}, s32[], f32[32,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %acc = f32[8,4]{1,0} get-tuple-element(%state), index=1
  %offset = s32[] get-tuple-element(%state), index=2
  %x = f32[32,4]{1,0} get-tuple-element(%state), index=3
  %g = f32[32,4]{1,0} multiply(%x, %x)
  %sum = f32[32,4]{1,0} all-reduce(%g), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
  %zero = s32[] constant(0)
  %mine = f32[8,4]{1,0} dynamic-slice(%sum, %offset, %zero), dynamic_slice_sizes={8,4}
  %acc.next = f32[8,4]{1,0} add(%acc, %mine)
  %one = s32[] constant(1)
  %i.next = s32[] add(%i, %one)
  ROOT %next = (s32[], f32[8,4]{1,0}, s32[], f32[32,4]{1,0}) tuple(%i.next, %acc.next, %offset, %x)
}

%cond (state: (s32[], f32[8,4], s32[], f32[32,4])) -> pred[] {
  %state = (s32[], f32[8,4]{1,0}, s32[], f32[32,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %four = s32[] constant(4)
  ROOT %more = pred[] compare(%i, %four), direction=LT
}

ENTRY %main (w: f32[8,4], x: f32[32,4]) -> f32[8,4] {
  %w = f32[8,4]{1,0} parameter(0)
  %x = f32[32,4]{1,0} parameter(1)
  %pid = u32[] partition-id()
  %pid.s = s32[] convert(%pid)
  %eight = s32[] constant(8)
  %offset = s32[] multiply(%pid.s, %eight)
  %zero = s32[] constant(0)
  %f0 = f32[] constant(0)
  %zeros = f32[8,4]{1,0} broadcast(%f0), dimensions={}
  %start = (s32[], f32[8,4]{1,0}, s32[], f32[32,4]{1,0}) tuple(%zero, %zeros, %offset, %x)
  %loop = (s32[], f32[8,4]{1,0}, s32[], f32[32,4]{1,0}) while(%start), condition=%cond, body=%body
  %grad = f32[8,4]{1,0} get-tuple-element(%loop), index=1
  %lr = f32[] constant(0.1)
  %lrs = f32[8,4]{1,0} broadcast(%lr), dimensions={}
  %step = f32[8,4]{1,0} multiply(%grad, %lrs)
  ROOT %new = f32[8,4]{1,0} subtract(%w, %step)
}
"""


@pytest.mark.parametrize("change, sharded", [
    ((), True),
    # the offset moves each iteration: not one device's part
    (("tuple(%i.next, %acc.next, %offset, %x)", "tuple(%i.next, %acc.next, %i.next, %x)"),
     False),
    # the loop starts it from a constant: the same rows on every device
    (("tuple(%zero, %zeros, %offset, %x)", "tuple(%zero, %zeros, %eight, %x)"), False),
])
def test_a_slice_at_an_offset_the_loop_carries_reads_as_already_sharded(change, sharded):
    """A microbatch's sum sliced at an offset computed from the device's id before the
    loop and carried through it unchanged takes this device's part, as if computed in
    the body; not where the loop changes the offset or starts it from a constant."""
    from hlo_shard.analysis.collectives import ReasonCode, find_gradient_all_reduces

    text = CARRIED_OFFSET.replace(*change) if change else CARRIED_OFFSET
    assert text != CARRIED_OFFSET or not change
    (found,) = [f for f in find_gradient_all_reduces(parse(text)) if f.name == "sum"]
    assert (found.code is ReasonCode.ALREADY_SHARDED) is sharded, found


# ------------------------------------------------------------- on 8 CPU devices


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


def _verify(original: str, candidate: str, **options) -> runtime.VerifyReport:
    return runtime.verify(parse(original), parse(candidate),
                          runtime.VerifyOptions(steps=1, regime="random", **options))


def test_the_golden_case_computes_what_the_pairs_computed(worker):
    original = GOLDEN.read_text()
    module = parse(original)
    run_pass(module, "h100")
    assert "dynamic-slice(%gb" not in to_text(module)  # the split is rewritten too
    result = _verify(original, to_text(module, for_xla=True))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


#: The FSDP step's collectives in each mode (§8.3 of the HLO reference): global ids
#: (as written, and with the groups in mesh form, which the reduce-scatter keeps),
#: cross-replica-and-partition (a channel, no global ids: XLA holds the all-reduce's
#: flag as false, so its groups name replicas; 8 replicas of one partition, the offset
#: by replica-id) and cross-replica (no channel). An all-reduce is never
#: cross-partition: that reading of a channel without global ids is another
#: collective's (all-to-all, collective-permute).
MODES = {
    "flattened-id": lambda text: text,
    "flattened-id-mesh": lambda text: text.replace("replica_groups={{0,1,2,3,4,5,6,7}}",
                                                   "replica_groups=mesh['data'=8] {'data'}"),
    "cross-replica-and-partition": lambda text: text
    .replace(", use_global_device_ids=true", "").replace("partition-id", "replica-id")
    .replace("HloModule fsdp_step,", "HloModule fsdp_step, replica_count=8,"),
    "cross-replica": lambda text: re.sub(r"channel_id=\d+, ", "", text)
    .replace(", use_global_device_ids=true", "").replace("partition-id", "replica-id")
    .replace("HloModule fsdp_step,", "HloModule fsdp_step, replica_count=8,"),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("table", [TABLE, "%offsets = s32[8]{0} constant("
                                          "{896, 768, 640, 512, 384, 256, 128, 0})"],
                         ids=["in-group-order", "permuted"])
def test_the_fsdp_step_computes_the_same(worker, table, mode):
    module = parse(MODES[mode](FSDP_STEP.replace("{ds}", PARTITIONER_FORM.replace(TABLE, table))))
    if not mode.startswith("cross-replica"):
        module.header["num_partitions"] = 8
    original = to_text(module)
    assert run_pass(module).created
    assert "reduce-scatter(%gw)" in to_text(module)
    if mode == "flattened-id-mesh" and table == TABLE:
        assert "reduce-scatter(%gw), channel_id=4, replica_groups=mesh['data'=8] {'data'}" \
            in to_text(module)
    result = _verify(original, to_text(module, for_xla=True))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


@pytest.mark.slow
def test_the_generated_fsdp_llm_step_computes_the_same(worker, tmp_path):
    """scripts/llm_step.py's data2_fsdp4 step: every matrix gradient is all-reduced over
    the 8 devices and sliced into the 4 blocks of the fsdp axis. On h100 prices each would
    become a reduce-scatter over 4 and an all-reduce of the block over 2, but the sums
    are in bf16, where that association rounds differently: each pair is kept and says
    so, and the module computes what it did at ``verify``'s own tolerances."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from llm_step import generate

    path = generate(tmp_path / "fsdp.hlo", "data2_fsdp4", layers=1)
    original = path.read_text()
    module = parse(original)
    report = run_pass(module, "h100")
    assert len(report.decisions) >= 8
    split = [d for d in report.decisions if "rounded differently" in d.kept_because]
    assert len(split) >= 8 and not any(d.reduce_scatter for d in split)
    result = _verify(original, to_text(module, for_xla=True))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


def test_the_gate_prices_the_module_it_writes_when_nothing_is_sharded():
    """Nothing to shard, but the pipeline still writes reduce-scatters: the gate's module
    kept whole is that one, priced (``unsharded_s``), not the input."""
    from hlo_shard.passes.speed_gate import shard_where_faster
    from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding

    module = parse(GOLDEN.read_text())
    report, decision = shard_where_faster(module, WeightUpdateSharding(ShardingOptions()))
    assert not any(row.sharded for row in report.explanations)
    assert " reduce-scatter(" in to_text(module)
    assert decision.unsharded_s is not None and decision.unsharded_s != decision.before_s


#: A (data=2, fsdp=4) mesh's weight gradient as the partitioner writes it: the product
#: computed [out, in] (transposed to the weight), all-reduced over the fsdp axis, this
#: device's columns sliced (strided in the row-major sum), all-reduced over the data axis
#: and transposed into the weight's [in, out] rows; then a momentum update.
COLUMN_SLICED_STEP = """\
HloModule column_sliced, num_partitions=8, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %step (w: f32[8,64], m: f32[8,64], x: f32[4,32], dy: f32[4,64]) -> (f32[8,64], f32[8,64]) {
  %w = f32[8,64]{1,0} parameter(0)
  %m = f32[8,64]{1,0} parameter(1)
  %x = f32[4,32]{1,0} parameter(2)
  %dy = f32[4,64]{1,0} parameter(3)
  %gT = f32[64,32]{1,0} dot(%dy, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %gT.sum = f32[64,32]{1,0} all-reduce(%gT), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %offsets = s32[8]{0} constant({0, 8, 16, 24, 0, 8, 16, 24})
  %pid = u32[] partition-id()
  %offset.1 = s32[1]{0} dynamic-slice(%offsets, %pid), dynamic_slice_sizes={1}
  %offset = s32[] reshape(%offset.1)
  %c0 = s32[] constant(0)
  %gT.mine = f32[64,8]{1,0} dynamic-slice(%gT.sum, %c0, %offset), dynamic_slice_sizes={64,8}
  %gT.data = f32[64,8]{1,0} all-reduce(%gT.mine), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %g = f32[8,64]{0,1} transpose(%gT.data), dimensions={1,0}
  %k = f32[] constant(0.9)
  %kb = f32[8,64]{1,0} broadcast(%k), dimensions={}
  %mk = f32[8,64]{1,0} multiply(%m, %kb)
  %m.new = f32[8,64]{1,0} add(%mk, %g)
  %g2 = f32[8,64]{1,0} multiply(%g, %g)
  %lr = f32[] constant(0.01)
  %lrb = f32[8,64]{1,0} broadcast(%lr), dimensions={}
  %step = f32[8,64]{1,0} multiply(%lrb, %m.new)
  %w.1 = f32[8,64]{1,0} subtract(%w, %step)
  %w.new = f32[8,64]{1,0} subtract(%w.1, %g2)
  ROOT %out = (f32[8,64]{1,0}, f32[8,64]{1,0}) tuple(%w.new, %m.new)
}
"""


def test_a_column_slice_of_a_product_scatters_the_product_computed_transposed():
    """The slice takes columns of the row-major sum: a reduce-scatter there would transpose
    the whole gradient first. The product is computed the other way round instead (its
    transpose: each block a run of rows), the block transposed back, and that transpose
    moved past the data axis's all-reduce, where it meets the one into the weight's rows
    (XLA's simplifier removes the pair)."""
    module = parse(COLUMN_SLICED_STEP)
    (decision,) = run_pass(module).decisions
    assert decision.reduce_scatter and decision.product == "gT"
    assert "%gT computed transposed so that each block is contiguous" in decision.words
    entry = module.entry
    scatter = entry[decision.reduce_scatter]
    product = entry[scatter.operands[0]]
    assert product.opcode == "dot" and product.operands == ["x", "dy"]
    assert product.shape.dims == (32, 64) and scatter.shape.dims == (8, 64)
    assert scatter.attr("dimensions") == (0,)
    data = entry["gT.data"]
    assert data.operands == [decision.reduce_scatter] and data.shape.dims == (8, 64)
    (back,) = [inst for inst in entry.instructions if inst.operands == ["gT.data"]]
    assert back.opcode == "transpose" and back.shape.dims == (64, 8)
    assert entry["g"].operands == [back.name]
    assert "gT" not in {inst.name for inst in entry.instructions}


def test_a_product_with_another_reader_keeps_its_strided_blocks():
    """The product is read beside its all-reduce: computed twice it would cost a product;
    the pair is priced with the transpose of the whole gradient, as before."""
    text = COLUMN_SLICED_STEP.replace(
        "  %w.new = f32[8,64]{1,0} subtract(%w.1, %g2)\n",
        "  %w.new = f32[8,64]{1,0} subtract(%w.1, %g2)\n"
        "  %gT.neg = f32[64,32]{1,0} negate(%gT)\n")
    (decision,) = run_pass(parse(text)).decisions
    assert not decision.product


def test_a_bf16_product_keeps_its_strided_blocks():
    """Computed the other way round, a bf16 product's kernel may sum in another order and
    round differently at the type's precision: it is left as it is."""
    (decision,) = run_pass(parse(COLUMN_SLICED_STEP.replace("f32[", "bf16["))).decisions
    assert not decision.product


def test_the_column_sliced_step_computes_the_same(worker):
    module = parse(COLUMN_SLICED_STEP)
    assert run_pass(module).created
    result = _verify(COLUMN_SLICED_STEP, to_text(module, for_xla=True))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]
