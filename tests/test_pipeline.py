"""The pass contract and the pipeline: frozen passes with resolved options, typed
reports, truthful ``changed``, a check after each pass that names the pass."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest

from hlo_shard.errors import HloShardError
from hlo_shard.graph import ModuleRewriter
from hlo_shard.ir import ArrayShape, Module
from hlo_shard.parser import parse
from hlo_shard.passes.base import ModulePass
from hlo_shard.passes.pipeline import InputProblems, PassCheckError, Pipeline
from hlo_shard.passes.replica_form import ReplicaForm, ReplicaFormReport
from hlo_shard.passes.weight_update import (ShardingOptionError, ShardingOptions,
                                             ShardingReport, WeightUpdateSharding)
from hlo_shard.printer import to_text
from hlo_shard.profiles import HardwareProfile

from wus_helpers import ADD

SGD = f"""HloModule sgd, replica_count=2
{ADD}
ENTRY e {{ w = f32[8] parameter(0) g = f32[8] parameter(1)
 ar = f32[8] all-reduce(g), replica_groups={{{{0,1}}}}, to_apply=add
 ROOT nw = f32[8] subtract(w, ar) }}
"""


@dataclasses.dataclass(frozen=True)
class Retype(ModulePass[int]):
    """A toy pass: ``opcode`` → ``to`` in the entry; the report is how many."""

    name: ClassVar[str] = "retype"
    opcode: str
    to: str

    def apply(self, module: Module, rewriter: ModuleRewriter) -> int:
        rw = rewriter.rewriter(module.entry)
        for inst in list(module.entry.instructions):
            if inst.opcode == self.opcode:
                rw.set_opcode(inst, self.to)
        return len(rw.changes)


@dataclasses.dataclass(frozen=True)
class Reshape(ModulePass[None]):
    """A broken pass: gives the root a shape its operands do not have."""

    name: ClassVar[str] = "broken-reshape"

    def apply(self, module: Module, rewriter: ModuleRewriter) -> None:
        rewriter.rewriter(module.entry).set_shape(module.entry.root, ArrayShape("f32", (3,)))


def test_passes_run_in_order_with_typed_reports_and_a_callback():
    seen = []
    pipeline = Pipeline([Retype("subtract", "add"), Retype("add", "multiply")],
                        after_pass=lambda step, result: seen.append((step.name, result.report)))
    result = pipeline.run(parse(SGD))
    # the second pass sees the first one's edit (the reducer's add is not in the entry)
    assert seen == [("retype", 1), ("retype", 1)]
    assert result.module.entry.root.opcode == "multiply"
    assert result.changed and result.report(int) == 1
    with pytest.raises(KeyError):
        result.report(str)


def test_changed_is_false_when_nothing_changed():
    result = Pipeline([Retype("sine", "cosine")]).run(parse(SGD))
    assert not result.changed and result.results[0].changes == []


@dataclasses.dataclass(frozen=True)
class Tally(ModulePass[None]):
    """A toy pass that keeps the rewriter it is handed, and a slip: it says nothing of
    whether it changed the module (the rewriter's log does)."""

    name: ClassVar[str] = "tally"
    seen: list = dataclasses.field(default_factory=list, compare=False)

    def apply(self, module: Module, rewriter: ModuleRewriter) -> None:
        self.seen.append(rewriter)
        assert rewriter.module is module
        assert rewriter.rewriter(module.entry) is rewriter.rewriter(module.entry)
        rewriter.set_header("replica_count", 2)


def test_each_pass_run_gets_one_rewriter_and_its_log_is_what_changed():
    step = Tally()
    module = parse(SGD.replace(", replica_count=2", ""))
    result = Pipeline([step, Retype("subtract", "add"), step]).run(module)
    first, again = step.seen
    assert first is not again  # one per pass run
    assert result.results[0].changes is first.changes and result.results[0].changed
    assert [c.kind for c in first.changes] == ["set-header"]
    assert not result.results[2].changed and again.changes == []  # already 2
    alone = step.run(parse(SGD.replace(", replica_count=2", "")))  # one pass, no pipeline
    assert alone.changed and alone.changes is step.seen[-1].changes


def test_a_check_failure_names_the_pass():
    with pytest.raises(PassCheckError, match=r"pass broken-reshape left an invalid module: "
                                             r"shape: %nw in %e: operand dims"):
        Pipeline([Retype("sine", "cosine"), Reshape()]).run(parse(SGD))
    # without the check the slip goes unseen
    Pipeline([Reshape()], check=None).run(parse(SGD))


def test_a_problem_of_the_input_is_no_passs_slip_but_a_new_one_is():
    """The input may carry what a later pass recovers (a header without its device
    counts: group ids out of range); the check holds each pass to adding nothing."""
    from hlo_shard.validate import validate

    unheaded = SGD.replace(", replica_count=2", "")
    assert validate(parse(unheaded))  # the input's own problem
    assert Pipeline([Retype("sine", "cosine")]).run(parse(unheaded)).results
    with pytest.raises(PassCheckError, match="pass broken-reshape"):
        Pipeline([Retype("sine", "cosine"), Reshape()]).run(parse(unheaded))


def test_the_input_is_checked_at_most_once_for_every_run_of_the_gate(monkeypatch):
    """The gate runs the pipeline on copies of one module: they share one check of it,
    made only when a pass's check finds something (never, on a valid input); a run
    handed the input's problems does not check the input again."""
    from hlo_shard.passes.speed_gate import shard_where_faster
    from hlo_shard.validate import validate

    checked: list[Module] = []

    def check(module: Module) -> list[object]:
        checked.append(module)
        return list(validate(module))

    unheaded = parse(SGD.replace(", replica_count=2", ""))
    known = InputProblems(Pipeline([], check=check), unheaded)
    Pipeline([Retype("sine", "cosine")], check=check).run(unheaded.clone(), known)
    assert checked == []  # nothing changed, nothing found: the input is not read
    copy = unheaded.clone()
    with pytest.raises(PassCheckError, match="pass broken-reshape"):
        Pipeline([Reshape()], check=check).run(copy, known)
    assert checked == [copy, unheaded]  # the copy after the pass, then the input
    with pytest.raises(PassCheckError, match="pass broken-reshape"):
        Pipeline([Reshape()], check=check).run(unheaded.clone(), known)
    assert len(checked) == 3 and checked[-1] is not unheaded  # the input's kinds kept
    # A run on the module itself checks it before its passes edit it.
    checked.clear()
    with pytest.raises(PassCheckError, match="pass broken-reshape"):
        Pipeline([Reshape()], check=check).run(unheaded, known := InputProblems(
            Pipeline([], check=check), unheaded))
    assert len(checked) == 2 and known.kinds()

    before = Pipeline.problems_before
    inputs: list[Module] = []

    def counted(self: Pipeline, module: Module) -> frozenset[str]:
        inputs.append(module)
        return before(self, module)

    monkeypatch.setattr(Pipeline, "problems_before", counted)
    # kept whole and left as it is (the hook): only copies were edited, nothing found
    report, decision = shard_where_faster(parse(SGD), WeightUpdateSharding(),
                                          write_kept_whole=False)
    assert decision.kept_whole and len(decision.trials) == 1 and inputs == []
    # kept whole and written: the passes then run on the input itself, checked first
    shard_where_faster(parse(SGD), WeightUpdateSharding())
    assert len(inputs) == 1


#: Two computations: the reducer ``add`` and the entry.
TWO = SGD


@dataclasses.dataclass(frozen=True)
class BreakReducer(ModulePass[None]):
    """A broken pass that edits only the reducer: its root gets a shape its operands do
    not have (the entry is untouched)."""

    name: ClassVar[str] = "broken-reducer"

    def apply(self, module: Module, rewriter: ModuleRewriter) -> None:
        add = module.computation("add")
        rewriter.rewriter(add).set_shape(add.root, ArrayShape("f32", (3,)))


@dataclasses.dataclass(frozen=True)
class ShrinkReplicas(ModulePass[None]):
    """A broken pass that edits only the header: one replica, so the entry's groups name a
    device out of range."""

    name: ClassVar[str] = "shrink-replicas"

    def apply(self, module: Module, rewriter: ModuleRewriter) -> None:
        rewriter.set_header("replica_count", 1)


def test_the_check_after_a_pass_reads_what_its_log_edited(monkeypatch):
    """After a pass the default check reads the computations the pass's log edited (and
    the module-wide checks): a slip in an edited computation is found wherever it is, a
    header edit checks every computation again, and a computation no pass edited is not
    read again after the input's check."""
    import hlo_shard.validate as validate_module

    with pytest.raises(PassCheckError, match=r"pass broken-reducer left an invalid module: "
                                             r"shape: %\S+ in %add"):
        Pipeline([Retype("sine", "cosine"), BreakReducer()]).run(parse(TWO))
    with pytest.raises(PassCheckError, match=r"pass shrink-replicas .*replica-groups: %ar in "
                                             r"%e: device id out of range 0..0"):
        Pipeline([ShrinkReplicas()]).run(parse(TWO))
    read: list[str] = []
    computation = validate_module._Checker.computation

    def reading(self, comp):
        read.append(comp.name)
        return computation(self, comp)

    monkeypatch.setattr(validate_module._Checker, "computation", reading)
    Pipeline([Retype("subtract", "add")]).run(parse(TWO), InputProblems(Pipeline([]),
                                                                        parse(TWO)))
    assert read == ["e"]  # the entry, which the pass edited; not the reducer
    read.clear()
    Pipeline([Retype("subtract", "add")], check=validate_module.validate).run(parse(TWO))
    assert read == ["add", "e", "e"]  # the input whole, then the edited entry


def test_the_optimizer_pipeline_checks_after_every_pass():
    from hlo_shard.passes.sharding_pipeline import sharding_pipeline
    from hlo_shard.validate import validate

    assert sharding_pipeline(WeightUpdateSharding()).check is validate


def test_passes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Retype("a", "b").to = "c"


def test_the_weight_update_pass_runs_in_a_pipeline_unchanged():
    direct = parse(SGD)
    alone = WeightUpdateSharding().run(direct)
    result = Pipeline([WeightUpdateSharding()]).run(parse(SGD))
    assert to_text(result.module) == to_text(direct)
    report = result.report(ShardingReport)
    assert result.changed and alone.changed and report.explanations[0].sharded
    assert alone.report == report


def test_the_weight_update_pass_resolves_its_options_when_built():
    step = WeightUpdateSharding(ShardingOptions(profile="h100"))
    assert isinstance(step.profile, HardwareProfile) and step.profile.name == "h100"
    with pytest.raises(HloShardError, match="^state must be one of gathered, sharded, not "
                                            "'everywhere'$"):
        WeightUpdateSharding(ShardingOptions(state="everywhere"))
    with pytest.raises(HloShardError, match="^strategy must be one of"):
        WeightUpdateSharding(ShardingOptions(strategy="some"))
    with pytest.raises(HloShardError, match="unknown profile"):
        WeightUpdateSharding(ShardingOptions(profile="no-such-chip"))


def test_a_contradicted_option_is_named_as_the_library_names_it():
    with pytest.raises(ShardingOptionError, match="^num_replicas=4 does not match the "
                                                  "module's data-parallel group size 2$"):
        WeightUpdateSharding(ShardingOptions(num_replicas=4)).run(parse(SGD))


SPMD = f"""HloModule spmd, num_partitions=2, input_output_alias={{ {{}}: (0, {{}}, may-alias) }}
{ADD}
ENTRY e {{ w = f32[8] parameter(0), sharding={{replicated}}
 g = f32[2,4] parameter(1)
 ar = (f32[8], f32[2,4]) all-reduce(w, g), channel_id=7, replica_groups={{{{0,1}}}},
   use_global_device_ids=true, to_apply=add
 a = f32[8] get-tuple-element(ar), index=0
 id = u32[] partition-id()
 ROOT t = (f32[8], u32[]) tuple(a, id) }}
"""


def test_replica_form_reports_what_it_did():
    result = Pipeline([ReplicaForm()]).run(parse(SPMD))
    report = result.report(ReplicaFormReport)
    assert report == ReplicaFormReport(devices=2, from_spmd=True, split_all_reduces=("ar",),
                                       renumbered_channels=2)
    text = to_text(result.module)
    assert "replica_count=2" in text and "num_partitions" not in text
    assert "input_output_alias" not in text and "sharding" not in text
    assert "replica-id()" in text and "partition-id" not in text
    kinds = {change.kind for change in result.results[0].changes}
    assert kinds >= {"pop-header", "set-header", "pop-attr", "set-opcode", "insert",
                     "set-operands", "set-attr"}


def test_replica_form_of_a_replica_form_module_changes_nothing():
    once = Pipeline([ReplicaForm()]).run(parse(SPMD)).module
    again = Pipeline([ReplicaForm()]).run(parse(to_text(once)))
    assert not again.changed and to_text(again.module) == to_text(once)


def test_replica_form_refuses_replicas_and_partitions_together():
    module = parse(SGD.replace("replica_count=2", "replica_count=2, num_partitions=2"))
    with pytest.raises(HloShardError, match="replica_count or num_partitions"):
        ReplicaForm().run(module)


def test_replica_form_runs_a_one_device_module_as_replicas_through_its_rewriter():
    """The runtime's ``load(module, devices=4)`` of a module written for one device: the
    replica count is the pass's edit, in its log (it was set behind the pass's back)."""
    one = SGD.replace("replica_count=2", "replica_count=1")
    result = ReplicaForm(replicas=4).run(parse(one))
    assert result.module.replica_count == 4 and result.report.devices == 4
    assert ("set-header", "replica_count", 1, 4) in [
        (c.kind, c.name, c.before, c.after) for c in result.changes]
    assert not ReplicaForm(replicas=2).run(parse(SGD)).changed  # written for 2 already
    with pytest.raises(HloShardError, match="written for 2 devices, not 4"):
        ReplicaForm(replicas=4).run(parse(SGD))
    with pytest.raises(HloShardError, match="at least one replica"):
        ReplicaForm(replicas=0)


def test_pipelines_are_read_from_a_spec():
    from hlo_shard.passes.registry import parse_pipeline

    first, second = parse_pipeline(
        "weight-update-sharding{state=sharded bucket-bytes=1024}, replica-form")
    assert first.options.state == "sharded" and first.options.bucket_bytes == 1024
    assert isinstance(second, ReplicaForm)
    with pytest.raises(HloShardError, match="unknown pass 'nope'"):
        parse_pipeline("nope")
    with pytest.raises(HloShardError, match="not key=value"):
        parse_pipeline("weight-update-sharding{sharded}")
    with pytest.raises(HloShardError, match="pass replica-form: .*unexpected keyword"):
        parse_pipeline("replica-form{x=1}")
    with pytest.raises(HloShardError, match="bad pass pipeline at column 14"):
        parse_pipeline("replica-form,{")


def test_retarget_reports_the_group_sizes():
    from hlo_shard.passes.retarget import Retarget, RetargetReport

    result = Pipeline([Retarget(8)]).run(parse(SGD))
    assert result.report(RetargetReport) == RetargetReport(from_devices=2, to_devices=8)
    assert result.module.replica_count == 8 and "{0,1,2,3,4,5,6,7}" in to_text(result.module)
    with pytest.raises(HloShardError, match="at least one replica"):
        Retarget(0)


def test_the_docs_list_the_optimizer_passes_as_the_pipeline_runs_them():
    """README, CONTRIBUTING and docs/optimize.md name the optimizer's passes in order; a
    pass added to ``sharding_pipeline`` (accumulation motion was) must reach them."""
    from pathlib import Path

    from hlo_shard.passes.sharding_pipeline import sharding_pipeline
    from hlo_shard.passes.weight_update import WeightUpdateSharding

    def words(text: str) -> str:
        return " ".join(text.lower().replace("-", " ").split())

    names = [words(p.name) for p in sharding_pipeline(WeightUpdateSharding()).passes]
    root = Path(__file__).resolve().parents[1]
    listings = {"README.md": " → ", "CONTRIBUTING.md": " → ", "docs/optimize.md": ", "}
    for doc, separator in listings.items():
        text = words((root / doc).read_text())
        assert words(separator.join(names)) in text, f"{doc} does not list {names}"
    count = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
             "nine", "ten", "eleven")[len(names)]
    assert f"the optimizer is {count} passes" in words((root / "README.md").read_text())
