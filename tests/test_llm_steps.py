"""LLM-sized training steps (issue 23): the already-sharded verdict, prices at scale,
and the generator of Llama-style steps (``scripts/llm_step.py``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hlo_shard import parse
from hlo_shard.analysis.collectives import ReasonCode, find_gradient_all_reduces
from hlo_shard.passes.weight_update import planned_update_regions
from hlo_shard.costmodel.step_time import estimate_step
from hlo_shard import optimize
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.profiles import load_profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

#: A data-parallel step over 8 partitions whose header lost its device counts (as XLA's
#: pass hook hands modules over): one large matrix whose gradient the SPMD partitioner
#: already reduce-scatters (all-reduce, then this device's rows by partition id) and
#: updates on the slice, and one tiny vector (a norm scale) with a replicated update.
#: ``{ds}`` is the large gradient's use: the partitioner's dynamic-slice, or a
#: reduce-scatter written out.
FSDP_STEP = """\
HloModule fsdp_step, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias), {2}: (2, {}, may-alias), {3}: (3, {}, may-alias) }

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %step (w: f32[128,1024], mw: f32[128,1024], s: f32[1024], ms: f32[1024], x: f32[64,1024]) -> (f32[128,1024], f32[128,1024], f32[1024], f32[1024]) {
  %w = f32[128,1024]{1,0} parameter(0)
  %mw = f32[128,1024]{1,0} parameter(1)
  %s = f32[1024]{0} parameter(2)
  %ms = f32[1024]{0} parameter(3)
  %x = f32[64,1024]{1,0} parameter(4)
  %w.all = f32[1024,1024]{1,0} all-gather(%w), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %sb = f32[64,1024]{1,0} broadcast(%s), dimensions={1}
  %xs = f32[64,1024]{1,0} multiply(%x, %sb)
  %h = f32[64,1024]{1,0} dot(%xs, %w.all), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %gw = f32[1024,1024]{1,0} dot(%xs, %h), lhs_contracting_dims={0}, rhs_contracting_dims={0}
{ds}
  %lr = f32[] constant(0.01)
  %lrw = f32[128,1024]{1,0} broadcast(%lr), dimensions={}
  %mw.new = f32[128,1024]{1,0} add(%mw, %gw.mine)
  %stepw = f32[128,1024]{1,0} multiply(%lrw, %mw.new)
  %w.new = f32[128,1024]{1,0} subtract(%w, %stepw)
  %xh = f32[64,1024]{1,0} multiply(%x, %h)
  %zero = f32[] constant(0)
  %gs = f32[1024]{0} reduce(%xh, %zero), dimensions={0}, to_apply=%add
  %gs.sum = f32[1024]{0} all-reduce(%gs), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %lrs = f32[1024]{0} broadcast(%lr), dimensions={}
  %ms.new = f32[1024]{0} add(%ms, %gs.sum)
  %steps = f32[1024]{0} multiply(%lrs, %ms.new)
  %s.new = f32[1024]{0} subtract(%s, %steps)
  ROOT %out = (f32[128,1024]{1,0}, f32[128,1024]{1,0}, f32[1024]{0}, f32[1024]{0}) tuple(%w.new, %mw.new, %s.new, %ms.new)
}
"""
PARTITIONER_FORM = """\
  %gw.sum = f32[1024,1024]{1,0} all-reduce(%gw), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %offsets = s32[8]{0} constant({0, 128, 256, 384, 512, 640, 768, 896})
  %pid = u32[] partition-id()
  %offset.1 = s32[1]{0} dynamic-slice(%offsets, %pid), dynamic_slice_sizes={1}
  %offset = s32[] reshape(%offset.1)
  %c0 = s32[] constant(0)
  %gw.t = f32[1024,1024]{0,1} copy(%gw.sum)
  %gw.slice = f32[128,1024]{0,1} dynamic-slice(%gw.t, %offset, %c0), dynamic_slice_sizes={128,1024}
  %gw.mine = f32[128,1024]{1,0} copy(%gw.slice)"""
REDUCE_SCATTER_FORM = """\
  %gw.mine = f32[128,1024]{1,0} reduce-scatter(%gw), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add"""


def _module(form: str):
    return parse(FSDP_STEP.replace("{ds}", form), path="fsdp_step.hlo")


@pytest.mark.parametrize("form", [PARTITIONER_FORM, REDUCE_SCATTER_FORM],
                         ids=["partitioner-dynamic-slice", "reduce-scatter"])
def test_an_already_reduce_scattered_gradient_is_reported_already_sharded(form):
    result = optimize(_module(form), ShardingOptions(), force=True)
    report, _, _ = result.report, result.text, result.decision
    rows = {row.all_reduce: row for row in report.explanations}
    big = rows["gw.sum" if "all-reduce(%gw)" in form else "gw.mine"]
    assert not big.sharded
    assert big.to_json()["reason_code"] == "already_sharded"
    assert big.reason.startswith("already sharded")
    assert big.bytes == 1024 * 1024 * 4  # the gradient it reduces, not the slice
    assert rows["gs.sum"].sharded and rows["gs.sum"].reason_code == ""


def test_a_reduce_scatter_gathered_back_whole_is_no_sharded_update():
    """``psum_scatter`` then ``all_gather`` by hand (a probe's step, the update after it
    on the whole gradient): said "already sharded: ... the update runs on the slice",
    which was untrue."""
    gathered = REDUCE_SCATTER_FORM.replace("%gw.mine", "%gw.part") + """
  %gw.back = f32[1024,1024]{1,0} all-gather(%gw.part), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %gw.mine = f32[128,1024]{1,0} slice(%gw.back), slice={[0:128], [0:1024]}"""
    result = optimize(_module(gathered), ShardingOptions(), force=True)
    row = next(row for row in result.report.explanations if row.all_reduce == "gw.part")
    assert not row.sharded and row.reason_code == "gathered_back"
    assert "all-gathered back whole" in row.reason and "the update runs on the whole sum" in \
        row.reason


@pytest.mark.parametrize("change", [
    # The offset is data, not the device's id: a gather of rows, not a shard.
    ("%pid = u32[] partition-id()", "%pid = u32[] constant(3)"),
    # The whole gradient is needed too (here: summed), beside the slice.
    ("%gw.mine = f32[128,1024]{1,0} copy(%gw.slice)",
     "%gw.mine = f32[128,1024]{1,0} copy(%gw.slice)\n"
     "  %gw.whole = f32[1024,1024]{1,0} negate(%gw.sum)"),
], ids=["offset-not-by-device", "whole-gradient-used"])
def test_a_slice_that_is_not_this_devices_shard_is_not_already_sharded(change):
    from hlo_shard.analysis.collectives import find_gradient_all_reduces

    module = _module(PARTITIONER_FORM.replace(*change))
    module.header["num_partitions"] = 8  # as the pass recovers it
    (big,) = [ar for ar in find_gradient_all_reduces(module) if ar.name == "gw.sum"]
    assert big.code is None and not big.reason


#: A scanned FSDP step (MaxText's ``scan_layers``): the backward loop all-reduces each
#: layer's whole gradient and writes it into the stacked gradient it carries; after the
#: loop each device takes its own rows of every layer (dynamic-slice by partition id)
#: and updates its shard of the stacked weight.
SCANNED_FSDP_STEP = """\
HloModule scanned_fsdp_step, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%cond (c: (s32[], f32[4,64,32], f32[64,32])) -> pred[] {
  %c = (s32[], f32[4,64,32]{2,1,0}, f32[64,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %more = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], f32[4,64,32], f32[64,32])) -> (s32[], f32[4,64,32], f32[64,32]) {
  %b = (s32[], f32[4,64,32]{2,1,0}, f32[64,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %stack = f32[4,64,32]{2,1,0} get-tuple-element(%b), index=1
  %x = f32[64,32]{1,0} get-tuple-element(%b), index=2
  %fi = f32[] convert(%i)
  %fb = f32[64,32]{1,0} broadcast(%fi), dimensions={}
  %g = f32[64,32]{1,0} multiply(%x, %fb)
  %g.sum = f32[64,32]{1,0} all-reduce(%g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %g.layer = f32[1,64,32]{2,1,0} reshape(%g.sum)
  %c0 = s32[] constant(0)
  %stack.new = f32[4,64,32]{2,1,0} dynamic-update-slice(%stack, %g.layer, %i, %c0, %c0)
  %one = s32[] constant(1)
  %i.next = s32[] add(%i, %one)
  ROOT %next = (s32[], f32[4,64,32]{2,1,0}, f32[64,32]{1,0}) tuple(%i.next, %stack.new, %x)
}

ENTRY %step (w: f32[4,8,32], x: f32[64,32]) -> f32[4,8,32] {
  %w = f32[4,8,32]{2,1,0} parameter(0)
  %x = f32[64,32]{1,0} parameter(1)
  %zero = f32[] constant(0)
  %init = f32[4,64,32]{2,1,0} broadcast(%zero), dimensions={}
  %i0 = s32[] constant(0)
  %start = (s32[], f32[4,64,32]{2,1,0}, f32[64,32]{1,0}) tuple(%i0, %init, %x)
  %loop = (s32[], f32[4,64,32]{2,1,0}, f32[64,32]{1,0}) while(%start), condition=%cond, body=%body
  %stacked = f32[4,64,32]{2,1,0} get-tuple-element(%loop), index=1
  %offsets = s32[8]{0} constant({0, 8, 16, 24, 32, 40, 48, 56})
  %pid = u32[] partition-id()
  %offset.1 = s32[1]{0} dynamic-slice(%offsets, %pid), dynamic_slice_sizes={1}
  %offset = s32[] reshape(%offset.1)
  %c0 = s32[] constant(0)
  %mine = f32[4,8,32]{2,1,0} dynamic-slice(%stacked, %c0, %offset, %c0), dynamic_slice_sizes={4,8,32}
  %lr = f32[] constant(0.01)
  %lrb = f32[4,8,32]{2,1,0} broadcast(%lr), dimensions={}
  %update = f32[4,8,32]{2,1,0} multiply(%lrb, %mine)
  ROOT %w.new = f32[4,8,32]{2,1,0} subtract(%w, %update)
}
"""


def test_a_scanned_layers_gradient_sliced_after_the_loop_is_already_sharded(tmp_path):
    """The all-reduce inside the scan is the partitioner's reduce-scatter form across the
    loop carry: reported already sharded (not a candidate kept whole for speed)."""
    source = tmp_path / "scanned.hlo"
    source.write_text(SCANNED_FSDP_STEP)
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "optimize", str(source), "-o",
                          str(tmp_path / "out.hlo"), "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "1 already sharded (reduce-scatter form), 0 kept whole" in run.stderr
    (row,) = json.loads(run.stdout)["explanations"]
    assert (row["computation"], row["all_reduce"], row["reason_code"]) == \
        ("body", "g.sum", "already_sharded")
    assert "leaves %loop only as this device's slice" in row["reason"]


@pytest.mark.parametrize("change", [
    # The body also reads the stacked gradient whole.
    ("  %one = s32[] constant(1)\n",
     "  %one = s32[] constant(1)\n  %peek = f32[4,64,32]{2,1,0} negate(%stack)\n"),
    # The stacked gradient is also used whole after the loop.
    ("  %lr = f32[] constant(0.01)\n",
     "  %lr = f32[] constant(0.01)\n  %whole = f32[4,64,32]{2,1,0} negate(%stacked)\n"),
    # The loop's condition reads the slot.
    ("  %n = s32[] constant(4)\n",
     "  %n = s32[] constant(4)\n"
     "  %peek = f32[4,64,32]{2,1,0} get-tuple-element(%c), index=1\n"),
    # The slot leaves the loop as rows chosen by data, not by the device's id.
    ("%pid = u32[] partition-id()", "%pid = u32[] constant(3)"),
    # The layer's sum is also used whole in the body.
    ("  %c0 = s32[] constant(0)\n  %stack.new",
     "  %c0 = s32[] constant(0)\n  %again = f32[64,32]{1,0} negate(%g.sum)\n  %stack.new"),
    # The body is also called outside the loop: its stacked result goes elsewhere too.
    ("  ROOT %w.new",
     "  %once = (s32[], f32[4,64,32]{2,1,0}, f32[64,32]{1,0}) call(%start), to_apply=%body\n"
     "  ROOT %w.new"),
], ids=["read-in-body", "read-whole-after", "read-by-condition", "offset-not-by-device",
        "sum-used-whole", "body-called-elsewhere"])
def test_a_carried_gradient_read_otherwise_is_not_already_sharded(change):
    from hlo_shard.analysis.collectives import find_gradient_all_reduces

    text = SCANNED_FSDP_STEP.replace(*change)
    assert text != SCANNED_FSDP_STEP
    found = [ar for ar in find_gradient_all_reduces(parse(text, path="scanned.hlo"))
             if ar.computation == "body"]
    assert [(ar.name, ar.code, ar.reason) for ar in found] == [("g.sum", None, "")]


def test_the_summary_counts_already_sharded_apart_from_kept_whole(tmp_path):
    source = tmp_path / "fsdp_step.hlo"
    source.write_text(FSDP_STEP.replace("{ds}", PARTITIONER_FORM))
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "optimize", str(source), "-o",
                          str(tmp_path / "out.hlo"), "--force", "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "1 already sharded (reduce-scatter form), 0 kept whole" in run.stderr
    report = json.loads(run.stdout)
    assert (report["sharded"], report["already_sharded"], report["gradients"]) == (1, 1, 2)
    codes = {row["all_reduce"]: row["reason_code"] for row in report["explanations"]}
    assert codes == {"gw.sum": "already_sharded", "gs.sum": ""}


#: :data:`PARTITIONER_FORM` clipped by its global norm: each device squares and sums its
#: slice, and the partial sums are all-reduced (as the partitioner writes
#: ``optax.clip_by_global_norm`` of FSDP gradients).
NORM_OF_SLICES = PARTITIONER_FORM + """
  %sq = f32[128,1024]{1,0} multiply(%gw.mine, %gw.mine)
  %z0 = f32[] constant(0)
  %part = f32[] reduce(%sq, %z0), dimensions={0,1}, to_apply=%add
  %norm2 = f32[] all-reduce(%part), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add"""


def test_the_partial_sums_of_already_sharded_slices_are_not_gradients(tmp_path):
    """The sums of squares of each device's slice, all-reduced for a global norm, are
    reported ``partial_sum`` (not gradients kept whole) and counted apart."""
    source = tmp_path / "fsdp_norm.hlo"
    text = FSDP_STEP.replace("{ds}", NORM_OF_SLICES).replace(
        "%lrw = f32[128,1024]{1,0} broadcast(%lr), dimensions={}",
        "%lrn = f32[] multiply(%lr, %norm2)\n"
        "  %lrw = f32[128,1024]{1,0} broadcast(%lrn), dimensions={}")
    assert "%lrn" in text
    source.write_text(text)
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "optimize", str(source), "-o",
                          str(tmp_path / "out.hlo"), "--force", "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert ("1 already sharded (reduce-scatter form), 1 partial sum of their slices (not "
            "gradients), 0 kept whole") in run.stderr
    codes = {row["all_reduce"]: row["reason_code"]
             for row in json.loads(run.stdout)["explanations"]}
    assert codes == {"gw.sum": "already_sharded", "norm2": "partial_sum", "gs.sum": ""}


def test_a_scalar_computed_from_an_activation_s_slice_is_no_partial_sum():
    """The slice :data:`NORM_OF_SLICES` squares and sums is an activation's here (a
    column sum of it is all-reduced again: the sum it feeds makes it ``activation_sum``),
    as OpenCLIP's global-batch logits are under jit: a scalar computed from it (the
    gradient of ``logit_scale``, the loss) is no global norm's partial sum over the
    devices holding a gradient's other slices; it was reported ``partial_sum``, "not a
    gradient", beside its own weight's name."""
    text = FSDP_STEP.replace("{ds}", NORM_OF_SLICES + """
  %cols = f32[1024]{0} reduce(%gw.mine, %z0), dimensions={0}, to_apply=%add
  %cols.sum = f32[1024]{0} all-reduce(%cols), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add""")

    def found(text: str) -> dict:
        module = parse(text, path="clip.hlo")
        module.header["num_partitions"] = 8  # as the pass recovers it
        return {ar.name: ar for ar in find_gradient_all_reduces(module)}

    clip = found(text)
    assert clip["gw.sum"].feeds == "cols.sum"
    assert clip["norm2"].code is None
    plain = found(FSDP_STEP.replace("{ds}", NORM_OF_SLICES))
    assert not plain["gw.sum"].feeds and plain["norm2"].code is ReasonCode.PARTIAL_SUM


def test_a_norm_s_partial_sums_joined_in_one_all_reduce_are_still_no_activation_s():
    """The weight-update lowering joins small sums into one all-reduce of their
    concatenation (``one_element_sums``): the global norm's partial sums over this
    device's slices, one element each, among them. Read after that pass (the
    reduce-scatter creation reads the rewritten module), the joined f32[2] was an
    array sum computed from the gradient's slice, which made the gradient an activation
    sum: kept as all-reduce + dynamic-slice "an activation's sum in bf16" (a probe's
    MaxText-style Llama on data × fsdp). Its one-element pieces are scalars' sums."""
    joined = NORM_OF_SLICES.replace(
        "  %norm2 = f32[] all-reduce(%part)",
        "  %part.element = f32[1]{0} reshape(%part)\n"
        "  %other.element = f32[1]{0} reshape(%z0)\n"
        "  %one_element_sums = f32[2]{0} concatenate(%part.element, %other.element), "
        "dimensions={0}\n"
        "  %one_element_sums.sum = f32[2]{0} all-reduce(%one_element_sums)") + """
  %norm2.piece = f32[1]{0} slice(%one_element_sums.sum), slice={[0:1]}
  %norm2 = f32[] reshape(%norm2.piece)"""
    assert "%one_element_sums.sum = f32[2]{0} all-reduce(%one_element_sums), channel_id=5" in joined
    module = parse(FSDP_STEP.replace("{ds}", joined), path="joined.hlo")
    module.header["num_partitions"] = 8  # as the pass recovers it
    found = {ar.name: ar for ar in find_gradient_all_reduces(module)}
    assert found["gw.sum"].code is ReasonCode.ALREADY_SHARDED and not found["gw.sum"].feeds


def test_sharding_a_tiny_vector_changes_the_step_by_no_more_than_the_work_it_changes():
    """A plan changing < 1 % of the gradient bytes: the predicted step moves by at most
    the price of the instructions the rewrite added or removed. (The header of such a
    module names no devices: the rewrite writes the recovered 8 into its output's, and
    both must be priced at 8 devices, not the original at 1.)"""
    module = _module(REDUCE_SCATTER_FORM)  # the big gradient is left as it is
    assert "num_partitions" not in module.header
    profile = load_profile("cpu-local")
    before = estimate_step(module, profile, planned_update_regions(module))
    result = optimize(module, ShardingOptions(), force=True)
    report, text, _ = result.report, result.text, result.decision
    sharded = [row for row in report.explanations if row.sharded]
    assert sum(r.bytes for r in sharded) < 0.01 * sum(r.bytes for r in report.explanations)
    rewritten = parse(text)
    after = estimate_step(rewritten, profile, planned_update_regions(rewritten))
    seconds_before = {(i.computation, i.name): i.seconds for i in before.instructions}
    seconds_after = {(i.computation, i.name): i.seconds for i in after.instructions}
    changed = sum(s for key, s in seconds_before.items() if key not in seconds_after) + \
        sum(s for key, s in seconds_after.items() if key not in seconds_before)
    assert abs(after.seconds - before.seconds) <= changed
    assert before.devices == after.devices == 8


GPU_STEP = """\
HloModule gpu_step

ENTRY %step (a: bf16[64,64], b: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %b = bf16[64,64]{1,0} parameter(1)
  ROOT %gemm = bf16[64,64]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm"
}
"""


def _groups_step(devices: int) -> str:
    group = ",".join(map(str, range(devices)))
    return f"""\
HloModule pod_step, num_partitions={devices}

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}}

ENTRY %step (g: f32[1024]) -> f32[1024] {{
  %g = f32[1024]{{0}} parameter(0)
  ROOT %r = f32[1024]{{0}} all-reduce(%g), channel_id=1, replica_groups={{{{{group}}}}}, use_global_device_ids=true, to_apply=%add
}}
"""


def test_the_default_profile_of_an_accelerator_program_is_not_the_cpu_one():
    from hlo_shard.profiles import DEFAULT_PROFILE
    from hlo_shard.profiles.detect import profile_for_module

    gpu, note = profile_for_module(None, parse(GPU_STEP))
    assert gpu.name == "h100" and "GPU program (custom-call __cublas$gemm)" in note
    pod, note = profile_for_module(None, parse(_groups_step(128)))
    assert pod.name == DEFAULT_PROFILE
    assert note.startswith(f"{DEFAULT_PROFILE} prices are being applied to a GPU/TPU program "
                           "(collective groups of 128 devices)")
    host, note = profile_for_module(None, parse(_groups_step(8)))
    assert host.name == DEFAULT_PROFILE and note is None
    asked, note = profile_for_module("a100", parse(GPU_STEP))
    assert asked.name == "a100" and note is None


def test_report_says_which_profile_an_accelerator_program_is_priced_on(tmp_path):
    source = tmp_path / "gpu_step.hlo"
    source.write_text(GPU_STEP)
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "report", str(source), "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("note: profile h100")
    assert json.loads(run.stdout)["profile"] == "h100"


@pytest.mark.slow
def test_generated_fsdp_step_marks_the_fsdp_gradients_already_sharded(tmp_path):
    """scripts/llm_step.py's MaxText-style FSDP step: every matrix gradient is the
    partitioner's reduce-scatter form; the replicated norm scales are candidates."""
    from llm_step import generate, param_shapes, LlamaShape

    path = generate(tmp_path / "fsdp.hlo", "data2_fsdp4", layers=1)
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "optimize", str(path), "-o",
                          str(tmp_path / "out.hlo"), "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)["explanations"]
    already = [row for row in rows if row["reason_code"] == "already_sharded"]
    matrices = [n for n, shape in param_shapes(LlamaShape(layers=1)).items() if len(shape) == 2]
    assert len(already) == len(matrices)
    assert all(row["bytes"] >= 64 * 64 * 2 for row in already)  # bf16 whole gradients


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data8", "data2_fsdp4"])
def test_a_scan_layers_step_is_read_priced_and_sharded_as_it_computes(tmp_path, mesh):
    """MaxText's ``scan_layers``: the layers' weights stacked and the decoder one
    ``lax.scan``, so each layer's gradient is all-reduced in the backward loop and
    written into the stacked gradient through a reshape that adds the layer axis.
    ``optimize`` exits 0 with a verdict; forced, what it writes computes what the step
    computes on 8 devices."""
    from llm_step import generate

    path = generate(tmp_path / "scan.hlo", mesh, layers=2, scan_layers=1)
    for args in ([], ["--force"]):
        run = subprocess.run([sys.executable, "-m", "hlo_shard", "optimize", str(path), "-o",
                              str(tmp_path / f"out{len(args)}.hlo"), "--json", *args],
                             capture_output=True, text=True, cwd=ROOT)
        assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["sharded"] > 0
    check = subprocess.run([sys.executable, "-m", "hlo_shard", "verify", str(path),
                            str(tmp_path / "out1.hlo")], capture_output=True, text=True,
                           cwd=ROOT)
    assert check.returncode == 0 and "MATCH" in check.stdout, check.stdout + check.stderr


#: An expert weight's gradient in the MoE step: [experts, d, f], bf16 (bf16 compute).
EXPERT_GRADIENT = re.compile(r"bf16\[4,\d+,\d+\]")


def _moe_report(tmp_path: Path, mesh: str, *args: str) -> list[dict]:
    """``optimize --json`` of scripts/llm_step.py's Mixtral-style step (2 layers of 4
    experts, top-2 routing) on ``mesh``: its explanations (the output in out.hlo)."""
    from llm_step import generate

    path = generate(tmp_path / f"moe_{mesh}.hlo", mesh, "moe", layers=2)
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "optimize", str(path), "-o",
                          str(tmp_path / "out.hlo"), "--json", *args],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["explanations"]


def test_a_mixtral_style_step_shards_its_experts_and_keeps_the_routing_statistic(tmp_path):
    """Data-parallel MoE (top_k routing, a load-balancing loss): every weight's gradient,
    the experts' [E, d, f] ones and the router's included, is sharded when forced; the
    fraction of tokens routed to each expert is a batch statistic summed over devices,
    kept all-reduced (the loss reads it), not an update."""
    rows = _moe_report(tmp_path, "data8", "--force")
    kept = [row for row in rows if not row["sharded"]]
    assert [row["reason_code"] for row in kept] == ["feeds_gradients"] * 2, kept
    assert all(row["shape"].startswith("f32[4]") for row in kept)  # [experts]
    # bf16 gradients (bf16 compute): gate, up and down [E, d, f] per layer
    experts = [row for row in rows if row["sharded"] and EXPERT_GRADIENT.match(row["shape"])]
    assert len(experts) == 2 * 3, rows


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data8", "data2_fsdp4", "data4_model2"])
def test_a_mixtral_style_step_forced_computes_what_it_computes(tmp_path, mesh):
    """The MoE step on each mesh, forced: what ``optimize`` writes computes what the
    step computes on 8 devices; on the FSDP mesh each expert weight's gradient (its
    embed axis over fsdp) is reported already sharded."""
    rows = _moe_report(tmp_path, mesh, "--force")
    if mesh == "data2_fsdp4":
        already = [row["shape"] for row in rows if row["reason_code"] == "already_sharded"]
        assert sum(bool(EXPERT_GRADIENT.match(shape)) for shape in already) == 2 * 3, already
    check = subprocess.run([sys.executable, "-m", "hlo_shard", "verify",
                            str(tmp_path / f"moe_{mesh}.hlo"), str(tmp_path / "out.hlo")],
                           capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 0 and "MATCH" in check.stdout, check.stdout + check.stderr
