"""The Rewriter's change log is the whole story of a pass: every instruction, header key
and computation whose text a pass changes is named by one of its recorded changes,
``changed`` is true exactly when the module's text changed, and a pass that edits
nothing records nothing. Checked pass by pass on fixtures that reach every edit site:
sharded optimizer state (shapes, shardings, the entry layout), a training loop's
carried shards, a gradient accumulation loop's all-reduces moved after it, a fused update (a sharded copy of its body) and a header without device
counts, replica form and retargeting."""

from __future__ import annotations

import copy
from typing import cast
from pathlib import Path

import pytest

from hlo_shard.graph import Change
from hlo_shard.ir import Module, Raw
from hlo_shard.parser import parse
from hlo_shard.passes.base import ModulePass
from hlo_shard.passes.replica_form import ReplicaForm
from hlo_shard.passes.retarget import Retarget
from hlo_shard.passes.sharding_pipeline import sharding_pipeline
from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding
from hlo_shard.printer import format_shape, format_value, to_text

from test_accumulation import LOOP as ACCUMULATION
from test_factored_state import ADAFACTOR, COLUMNS
from test_fused_modules import FUSED

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

#: (module text, sharding options) the sharding pipeline's passes are checked on.
SHARDING_CASES = {
    "adam-gathered": ("spmd/adam.n2.hlo", {}),
    "adam-sharded-state": ("spmd/adam.n2.hlo", {"state": "sharded"}),
    "loop-carry": ("spmd/loop_adam.n2.hlo", {"state": "sharded"}),
    "replica-loop": ("replica/loop_adam.n2.hlo", {}),
    "fused-no-device-counts": (FUSED, {}),
    "factored-sharded-state": (ADAFACTOR, {"state": "sharded"}),
    "factored-columns": (COLUMNS, {}),
    "gradient-accumulation": (ACCUMULATION, {"state": "sharded"}),
}

NOTHING_TO_SHARD = """HloModule nothing, replica_count=2
ENTRY e { w = f32[8] parameter(0) g = f32[8] parameter(1)
 ROOT nw = f32[8] subtract(w, g) }
"""


def _text(source: str) -> str:
    return source if source.startswith("HloModule") else (FIXTURES / source).read_text()


def _instructions(module: Module) -> dict[str, dict[str, dict[str, object]]]:
    """Computation → instruction → each part its printed line is made of (an attribute
    key ``attr:KEY``)."""
    return {comp.name: {inst.name: {
        "opcode": inst.opcode, "shape": format_shape(inst.shape),
        "operands": tuple(inst.operands), "literal": inst.literal,
        **{f"attr:{k}": format_value(v) for k, v in inst.attributes.items()}}
        for inst in comp.instructions}
        for comp in module.computations}


def _explains(change: Change, part: str, old_operands: tuple) -> bool:
    """Whether ``change`` (of the instruction, or of one of its operands) accounts for
    a change of ``part`` of the instruction."""
    if change.kind == "replace-uses":
        return part == "operands" and change.name in old_operands
    return {"set-opcode": part == "opcode", "set-shape": part == "shape",
            "set-operand": part == "operands", "set-operands": part == "operands",
            "set-attr": part == f"attr:{change.detail}",
            "pop-attr": part == f"attr:{change.detail}"}.get(change.kind, False)


def unlogged_edits(before: Module, after: Module, changes: list[Change]) -> list[str]:
    """What differs between ``before`` and ``after`` with no change naming it."""
    named = {(c.computation, c.name, c.kind) for c in changes}
    missing = []
    old, new = _instructions(before), _instructions(after)
    for comp_name, insts in new.items():
        if comp_name not in old:
            if ("", comp_name, "insert-computation") not in named:
                missing.append(f"new computation {comp_name}")
            continue
        for name, parts in insts.items():
            was = old[comp_name].get(name)
            if was is None:
                if (comp_name, name, "insert") not in named:
                    missing.append(f"{comp_name}/{name} inserted")
                continue
            mine = [c for c in changes if c.computation == comp_name and
                    (c.name == name or c.kind == "replace-uses")]
            for part in sorted(was.keys() | parts.keys()):
                if was.get(part) != parts.get(part) and not any(
                        _explains(c, part, cast(tuple, was["operands"])) for c in mine):
                    missing.append(f"{comp_name}/{name} {part}")
        for name in old[comp_name].keys() - insts.keys():
            if (comp_name, name, "erase") not in named:
                missing.append(f"{comp_name}/{name} erased")
        common = [n for n in old[comp_name] if n in insts]
        if common != [n for n in insts if n in old[comp_name]] and \
                (comp_name, comp_name, "reorder") not in named:
            missing.append(f"{comp_name} reordered")
        if before.computation(comp_name).root_name != after.computation(comp_name).root_name \
                and not any(c.kind == "set-root" and c.computation == comp_name for c in changes):
            missing.append(f"{comp_name} root moved")
    for key in before.header.keys() | after.header.keys():
        was, now = before.header.get(key), after.header.get(key)
        if (was is None) != (now is None) or (was is not None and now is not None
                                              and format_value(was) != format_value(now)):
            if not named & {("", key, "set-header"), ("", key, "pop-header")}:
                missing.append(f"header {key}")
    if list(before.header) != [k for k in after.header if k in before.header] and \
            not any(c.kind == "pop-header" for c in changes):
        missing.append("header order")
    return missing


def check_pass(step: ModulePass, module: Module) -> bool:
    """Run ``step`` on ``module``; assert its log is complete and ``changed`` is true."""
    before = copy.deepcopy(module)
    result = step.run(module)
    assert unlogged_edits(before, module, result.changes) == [], step.name
    assert result.changed == bool(result.changes), step.name
    assert result.changed == (to_text(before) != to_text(module)), step.name
    return result.changed


@pytest.mark.parametrize("case", SHARDING_CASES)
def test_every_pass_of_the_sharding_pipeline_logs_every_edit(case):
    source, options = SHARDING_CASES[case]
    module = parse(_text(source))
    pipeline = sharding_pipeline(WeightUpdateSharding(ShardingOptions(**options)))
    changed = [step.name for step in pipeline.passes if check_pass(step, module)]
    assert "weight-update-sharding" in changed


@pytest.mark.parametrize("step", [ReplicaForm(), ReplicaForm(keep_donation=True), Retarget(4)],
                         ids=["replica-form", "replica-form-keeping-donation", "retarget"])
def test_replica_form_and_retarget_log_every_edit(step):
    assert check_pass(step, parse(_text("spmd/adam.n2.hlo")))


def test_a_pass_that_edits_nothing_records_nothing():
    module = parse(NOTHING_TO_SHARD)
    pipeline = sharding_pipeline(WeightUpdateSharding(ShardingOptions()))
    for step in pipeline.passes:
        result = step.run(module)
        assert (step.name, result.changed, result.changes) == (step.name, False, [])
    again = parse(to_text(ReplicaForm().run(parse(_text("spmd/adam.n2.hlo"))).module))
    result = ReplicaForm().run(again)
    assert not result.changed and result.changes == []


def test_the_checker_sees_an_unlogged_edit():
    """The completeness check can fail: an edit made behind the Rewriter's back."""
    module = parse(_text("spmd/sgd.n2.hlo"))
    before = copy.deepcopy(module)
    module.entry.root.attributes["frontend_attributes"] = Raw('{x="1"}')
    module.header["replica_count"] = 8
    assert unlogged_edits(before, module, []) == [
        f"{module.entry.name}/{module.entry.root_name} attr:frontend_attributes",
        "header replica_count"]
