"""The scanned FSDP form as reduce-scatters (issue 23, item 2): MaxText's ``scan_layers``
all-reduces each layer's gradient in the backward loop, writes it into the stacked
gradient the loop carries, and each device slices its own block after the loop. The pass
(:func:`~hlo_shard.passes.reduce_scatter_creation.match_scanned_reduce_scatter`) makes the
all-reduce a reduce-scatter and carries the block, where priced faster; what it writes
computes what the step computed on 8 CPU devices, and anything outside the exact form is
left as it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hlo_shard import optimize, parse, runtime, to_text
from hlo_shard.ir import Module
from hlo_shard.passes.reduce_scatter_creation import ReduceScatterCreation, ReduceScatterReport
from hlo_shard.passes.weight_update import ShardingOptions

from test_llm_steps import SCANNED_FSDP_STEP

ROOT = Path(__file__).resolve().parents[1]
TABLE = "%offsets = s32[8]{0} constant({0, 8, 16, 24, 32, 40, 48, 56})"
SLICE = ("%mine = f32[4,8,32]{2,1,0} dynamic-slice(%stacked, %c0, %offset, %c0), "
         "dynamic_slice_sizes={4,8,32}")


def run_pass(module: Module, profile: str = "cpu-local") -> ReduceScatterReport:
    result = ReduceScatterCreation(profile).run(module)
    assert result.report is not None
    return result.report


def _instructions(module: Module, computation: str) -> dict[str, str]:
    return {inst.name: inst.opcode for inst in module.computation(computation).instructions}


def test_the_scanned_all_reduce_becomes_a_reduce_scatter_and_the_loop_carries_the_block():
    module = parse(SCANNED_FSDP_STEP)
    (decision,) = run_pass(module).decisions
    assert decision.reduce_scatter and decision.loops == ("loop",)
    assert decision.after_s < decision.before_s
    body = _instructions(module, "body")
    assert "all-reduce" not in body.values() and body[decision.reduce_scatter] == "reduce-scatter"
    text = to_text(module)
    assert "f32[8,32]{1,0} reduce-scatter(%g), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, " \
        "use_global_device_ids=true, dimensions={0}, to_apply=%add" in text
    carried = "(s32[], f32[4,8,32]{2,1,0}, f32[64,32]{1,0})"
    assert f"%c = {carried} parameter(0)" in text and f"%b = {carried} parameter(0)" in text
    assert f"ROOT %next = {carried} tuple(" in text
    assert f"%loop = {carried} while(%start)" in text
    assert "%stack.new = f32[4,8,32]{2,1,0} dynamic-update-slice(" in text
    assert "f32[4,8,32]{2,1,0} broadcast(%zero), dimensions={}" in text  # the start's block
    entry = _instructions(module, "step")
    assert "dynamic-slice" not in entry.values() and "partition-id" not in entry.values()
    assert "multiply(%lrb, %stacked)" in text  # the update reads the carried block
    assert "f32[4,64,32]" not in text


def test_explain_says_the_scanned_gradient_became_a_reduce_scatter():
    result = optimize(parse(SCANNED_FSDP_STEP), ShardingOptions(), force=True)
    (row,) = result.report.explanations
    assert row.reason_code == "already_sharded" and not row.sharded
    assert "the all-reduce became reduce-scatter %g.sum.scatter" in row.reason
    assert "%loop carries this device's block of the slot (no dynamic-slice after the loop" \
        in row.reason
    assert any("1 scanned layer gradient(s) all-reduced in a loop and sliced after it became "
               "reduce-scatters" in note for note in result.report.notes)
    assert " reduce-scatter(%g)" in result.text


def test_every_edit_is_logged():
    from test_change_log import check_pass

    assert check_pass(ReduceScatterCreation("cpu-local"), parse(SCANNED_FSDP_STEP))


#: Mutants the analysis reports already sharded but the rewrite cannot prove: each
#: is left as it is, and the report says why.
REFUSED = {
    # Device 7 clamps to block 7 again: nobody keeps block 0.
    "shifted-table": ((TABLE, TABLE.replace("{0, 8, 16, 24, 32, 40, 48, 56}",
                                            "{8, 16, 24, 32, 40, 48, 56, 64}")),
                      "do not hold every block"),
    # A second read of the slot after the loop takes another device's block.
    "reads-differ": (("  %lr = f32[] constant(0.01)\n",
                      "  %pid2 = u32[] constant(7)\n  %other = u32[] subtract(%pid2, %pid)\n"
                      "  %offset.2 = s32[1]{0} dynamic-slice(%offsets, %other), "
                      "dynamic_slice_sizes={1}\n"
                      "  %offset2 = s32[] reshape(%offset.2)\n"
                      "  %stacked2 = f32[4,64,32]{2,1,0} get-tuple-element(%loop), index=1\n"
                      "  %theirs = f32[4,8,32]{2,1,0} dynamic-slice(%stacked2, %c0, %offset2, "
                      "%c0), dynamic_slice_sizes={4,8,32}\n"
                      "  %lr = f32[] constant(0.01)\n"),
                     "take different blocks"),
    # The loop's initial tuple is read elsewhere too (its shape cannot change).
    "initial-tuple-shared": (("  %lr = f32[] constant(0.01)\n",
                              "  %peek = f32[64,32]{1,0} get-tuple-element(%start), index=2\n"
                              "  %lr = f32[] constant(0.01)\n"),
                             "the loop's initial tuple is not its own"),
    # A bitcast (layout-only, but not a blockwise op the rewrite moves onto the block)
    # between the layer's sum and the slot.
    "bitcast-in-body": (("%g.layer = f32[1,64,32]{2,1,0} reshape(%g.sum)",
                         "%g.layer = f32[1,64,32]{2,1,0} bitcast(%g.sum)"),
                        "a bitcast between the all-reduce and the carried slot"),
    # The slot's read after the loop is sliced twice (the same block each time).
    "sliced-twice": (("  %lr = f32[] constant(0.01)\n",
                      "  %again = f32[4,8,32]{2,1,0} dynamic-slice(%stacked, %c0, %offset, %c0), "
                      "dynamic_slice_sizes={4,8,32}\n"
                      "  %lr = f32[] constant(0.01)\n"),
                     "other uses than one slice"),
    # A second loop runs another body under the same condition.
    "condition-shared": (
        ("ENTRY %step", "%body2 (b: (s32[], f32[4,64,32], f32[64,32])) -> "
                        "(s32[], f32[4,64,32], f32[64,32]) {\n"
                        "  ROOT %b = (s32[], f32[4,64,32]{2,1,0}, f32[64,32]{1,0}) parameter(0)\n"
                        "}\n\nENTRY %step"),
        ("  %lr = f32[] constant(0.01)\n",
         "  %start2 = (s32[], f32[4,64,32]{2,1,0}, f32[64,32]{1,0}) tuple(%i0, %init, %x)\n"
         "  %loop2 = (s32[], f32[4,64,32]{2,1,0}, f32[64,32]{1,0}) "
         "while(%start2), condition=%cond, body=%body2\n"
         "  %lr = f32[] constant(0.01)\n"),
        "the loop's condition is also called elsewhere"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_scanned_form_the_rewrite_cannot_prove_is_left_alone_and_says_why(name):
    *changes, why = REFUSED[name]
    text = SCANNED_FSDP_STEP
    for old, new in changes:
        assert old in text
        text = text.replace(old, new)
    assert text != SCANNED_FSDP_STEP
    module = parse(text)
    (decision,) = run_pass(module).decisions
    assert not decision.reduce_scatter and why in decision.kept_because
    assert to_text(module) == to_text(parse(text))


@pytest.mark.parametrize("change", [
    # The body also reads the stacked gradient whole.
    ("  %one = s32[] constant(1)\n",
     "  %one = s32[] constant(1)\n  %peek = f32[4,64,32]{2,1,0} negate(%stack)\n"),
    # The slot leaves the loop as rows chosen by data, not by the device's id.
    ("%pid = u32[] partition-id()", "%pid = u32[] constant(3)"),
    # The loop's condition reads the slot.
    ("  %n = s32[] constant(4)\n",
     "  %n = s32[] constant(4)\n"
     "  %peek = f32[4,64,32]{2,1,0} get-tuple-element(%c), index=1\n"),
], ids=["read-in-body", "offset-not-by-device", "read-by-condition"])
def test_a_carried_gradient_read_otherwise_is_not_rewritten(change):
    text = SCANNED_FSDP_STEP.replace(*change)
    assert text != SCANNED_FSDP_STEP
    module = parse(text)
    assert not run_pass(module).created
    assert to_text(module) == to_text(parse(text))


# ------------------------------------------------------------- on 8 CPU devices


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


#: Variants of the scanned step, each rewritten and run against the original.
VARIANTS = {
    "as-written": [],
    # Device d keeps block 7 - d: scatter groups in block order.
    "permuted": [(TABLE, TABLE.replace("{0, 8, 16, 24, 32, 40, 48, 56}",
                                       "{56, 48, 40, 32, 24, 16, 8, 0}"))],
    # 4 blocks among 8 devices: a reduce-scatter over 4, an all-reduce of the block over 2.
    "split": [(TABLE, TABLE.replace("{0, 8, 16, 24, 32, 40, 48, 56}",
                                    "{0, 0, 16, 16, 32, 32, 48, 48}")),
              ("f32[4,8,32]", "f32[4,16,32]"), ("{4,8,32}", "{4,16,32}")],
    # The stacked gradient starts as an argument and the loop writes layers 2 and 3 only:
    # the other layers leave the loop as this device's block of the start.
    "started-by-argument": [
        ("(w: f32[4,8,32], x: f32[64,32])", "(w: f32[4,8,32], x: f32[64,32], s: f32[4,64,32])"),
        ("%init = f32[4,64,32]{2,1,0} broadcast(%zero), dimensions={}",
         "%init = f32[4,64,32]{2,1,0} parameter(2)"),
        ("%i0 = s32[] constant(0)", "%i0 = s32[] constant(2)")],
    # Cross-replica (no channel: 8 replicas, the offset by replica-id).
    "cross-replica": [("channel_id=1, ", ""), (", use_global_device_ids=true", ""),
                      ("partition-id", "replica-id"), ("num_partitions=8", "replica_count=8")],
    # MaxText's form: the layer's sum transposed into the stack, and a copy (a sharding
    # constraint) between the loop and the slice.
    "transposed-and-copied": [
        ("%g.layer = f32[1,64,32]{2,1,0} reshape(%g.sum)",
         "%g.t = f32[32,64]{0,1} transpose(%g.sum), dimensions={1,0}\n"
         "  %g.layer = f32[1,32,64]{2,1,0} reshape(%g.t)"),
        ("f32[4,64,32]", "f32[4,32,64]"),
        ("%stacked = f32[4,32,64]{2,1,0} get-tuple-element(%loop), index=1",
         "%stacked.0 = f32[4,32,64]{2,1,0} get-tuple-element(%loop), index=1\n"
         "  %stacked = f32[4,32,64]{2,1,0} copy(%stacked.0)"),
        (SLICE, "%mine.t = f32[4,32,8]{2,1,0} dynamic-slice(%stacked, %c0, %c0, %offset), "
                "dynamic_slice_sizes={4,32,8}\n"
                "  %mine = f32[4,8,32]{2,1,0} transpose(%mine.t), dimensions={0,2,1}")],
}


def _variant(name: str) -> str:
    text = SCANNED_FSDP_STEP
    for old, new in VARIANTS[name]:
        assert old in text, (name, old)
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_scanned_step_computes_the_same(worker, name):
    original = _variant(name)
    module = parse(original)
    (decision,) = run_pass(module, "h100").decisions
    assert decision.reduce_scatter, decision.kept_because
    assert "all-reduce(%g)" not in to_text(module)
    result = runtime.verify(parse(original), parse(to_text(module, for_xla=True)),
                            runtime.VerifyOptions(steps=1, regime="random"))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


# ------------------------------------------------------------- generated steps


@pytest.mark.slow
@pytest.mark.parametrize("mesh, rewritten", [("fsdp8", True), ("data2_fsdp4", False)])
def test_a_generated_scan_step_is_rewritten_where_it_can_be_and_verifies(tmp_path, mesh,
                                                                         rewritten):
    """scripts/llm_step.py's scanned steps (bf16 gradients): over ``fsdp8`` each layer's
    gradient is one block per device and becomes a plain reduce-scatter in the backward
    loop; over ``data2_fsdp4`` it would be a reduce-scatter over 4 and an all-reduce over
    2, which sums bf16 partial sums in another order, so each is kept and says so. Forced,
    what ``optimize`` writes computes what the step computes on 8 devices."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from llm_step import generate

    path = generate(tmp_path / "scan.hlo", mesh, layers=2, scan_layers=1)
    out = tmp_path / "out.hlo"
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "optimize", str(path), "-o",
                          str(out), "--json", "--force", "--profile", "h100"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    scanned = [row for row in json.loads(run.stdout)["explanations"]
               if "leaves %while" in row["reason"]]
    assert scanned
    if rewritten:
        assert all("carries this device's block of the slot" in row["reason"]
                   for row in scanned)
    else:
        assert all("bf16 partial sums" in row["reason"] for row in scanned)
    check = subprocess.run([sys.executable, "-m", "hlo_shard", "verify", str(path), str(out)],
                           capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 0 and "MATCH" in check.stdout, check.stdout + check.stderr
