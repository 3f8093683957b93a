"""The optimizer's one entry point, ``hlo_shard.optimize``: what it returns, its options
(the gate, the passes' edits, a module compiled as it stands), and that every front end
goes through it and assembles no passes of its own."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import hlo_shard
from hlo_shard import ForExecutable, OptimizeResult, ShardingOptions, optimize
from hlo_shard.cli import main
from hlo_shard.parser import parse
from hlo_shard.passes.executable_aliases import (DonatedNextValueAliases, ExecutableAliases,
                                                 NextValueAliases, donated_parameters)
from hlo_shard.passes.speed_gate import SpeedDecision, not_faster, ratio_words
from hlo_shard.passes.weight_update import Explanation, ShardingReport
from hlo_shard.printer import to_text

from test_pass_weight_update import SGD

PACKAGE = Path(hlo_shard.__file__).parent
#: The front ends: each runs the optimizer through ``optimize`` only.
FRONT_ENDS = ("cli/optimize.py", "jax/hook.py", "jax/_program.py", "jax/_api.py",
              "scaling.py")
#: What assembling or running passes by hand takes.
PASS_MACHINERY = {"WeightUpdateSharding", "Pipeline", "shard_where_faster", "run_sharding",
                  "sharding_pipeline", "CopyFreeDonation", "ReplicaForm", "replica_form"}


def test_optimize_returns_the_module_its_checked_text_report_and_decision():
    module = parse(SGD)
    result = optimize(module, ShardingOptions(), force=True)
    assert isinstance(result, OptimizeResult) and result.module is module
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.text = ""  # type: ignore[misc]
    assert result.text == to_text(module, for_xla=True) and "reduce-scatter" in result.text
    assert result.sharded == 1 and result.report.explanations[0].sharded
    assert result.decision is not None and result.decision.forced
    assert result.changes == ()  # not asked for


def test_the_passes_edits_are_recorded_when_asked():
    seen = []
    result = optimize(parse(SGD), ShardingOptions(), force=True, record=True,
                      after_pass=lambda step, _: seen.append(step.name))
    names = [c.name for c in result.changes]
    assert names == seen and "weight-update-sharding" in names
    assert any(c.result.changes for c in result.changes)


def test_without_the_gate_every_eligible_gradient_is_sharded_unpriced():
    """What ``scale`` projects: no decision, the pipeline as told."""
    result = optimize(parse(SGD), ShardingOptions(), gate=False)
    assert result.decision is None and result.sharded == 1
    assert result.to_json()["speed"] is None


def test_the_cli_json_is_the_results_to_json(tmp_path):
    """One report builder: ``optimize --json`` prints ``OptimizeResult.to_json``."""
    path = tmp_path / "sgd.hlo"
    path.write_text(SGD)
    out = CliRunner().invoke(main, ["optimize", "--force", str(path), "-o",
                                    str(tmp_path / "o.hlo"), "--json"])
    assert out.exit_code == 0, out.output
    printed = json.loads(out.stdout)
    built = optimize(parse(SGD), ShardingOptions(), force=True).to_json(
        input=str(path), output=str(tmp_path / "o.hlo"), state="gathered",
        params="gathered", accumulator="auto", strategy="auto", profile=printed["profile"],
        manifest=None)
    assert printed == json.loads(json.dumps(built))
    assert printed["speed"]["predicted_ratio"] > 0


def _names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              for alias in node.names}
    return names


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_no_front_end_assembles_passes(front_end):
    used = _names_used(PACKAGE / front_end)
    assert not used & PASS_MACHINERY, f"{front_end} uses {sorted(used & PASS_MACHINERY)}"
    assert "optimize" in used or "checked_options" in used


# ------------------------------------------------------------ a compiled program's aliases

DONATING = """HloModule step, input_output_alias={ {0}: (0, {}, may-alias) }, buffer_donor={ (1, {}), (2, {}) }
ENTRY e { w = f32[8] parameter(0) s = f32[8] parameter(1) b = f32[3] parameter(2)
 n = f32[8] negate(w) m = f32[8] negate(s) ROOT t = (f32[8], f32[8], f32[3]) tuple(m, n, b) }
"""


def test_donated_parameters_are_read_from_both_donation_attributes():
    assert donated_parameters(parse(DONATING)) == (0, 1, 2)


def test_next_values_replace_the_donation_header():
    module = parse(DONATING)
    result = NextValueAliases(((1, 0), (0, 1))).run(module)
    assert result.changed and "buffer_donor" not in module.header
    assert to_text(module).splitlines()[0] == (
        "HloModule step, input_output_alias={ {1}: (0, {}, may-alias), "
        "{0}: (1, {}, may-alias) }")
    assert not NextValueAliases(()).run(parse(DONATING)).changed


def test_a_bare_donor_is_aliased_to_its_next_value_and_the_rest_stays():
    """``per_device_hlo``'s header: each bare donor paired with the output the pytrees
    name, an output already aliased (output 0 is ``w``'s) not taken again, a donor named
    for two outputs (a step returning it twice) aliased to the first only (one buffer is
    one output's), a parameter donating nothing never aliased, the other donors left
    bare."""
    module = parse(DONATING)
    assert DonatedNextValueAliases(((0, 1), (1, 1), (2, 2))).run(module).changed
    assert module.output_aliases() == {0: 0, 1: 1, 2: 2}
    assert "buffer_donor" not in module.header
    bare = DONATING.replace("input_output_alias={ {0}: (0, {}, may-alias) }, ", "")
    module = parse(bare)
    DonatedNextValueAliases(((0, 1), (1, 1), (1, 0))).run(module)
    assert module.output_aliases() == {0: 1}  # w (0) donates nothing here
    assert to_text(module).splitlines()[0] == (
        "HloModule step, input_output_alias={ {0}: (1, {}, may-alias) }, "
        "buffer_donor={ (2, {}) }")


def test_every_donor_is_aliased_to_an_output_of_its_shape_its_next_value_first():
    module = parse(DONATING)
    ExecutableAliases((0, 1, 2), ((1, 0),)).run(module)
    # w → its next value {1}; s → the first free f32[8], {0}; b → {2}
    assert module.output_aliases() == {0: 1, 1: 0, 2: 2}
    assert "buffer_donor" not in module.header
    lone = parse(DONATING)
    ExecutableAliases((), ()).run(lone)
    assert "input_output_alias" not in lone.header


def test_a_module_for_an_executable_is_in_replica_form_with_its_aliases():
    spmd = SGD.replace("replica_count=4", "num_partitions=4, buffer_donor={ (0, {}) }")
    result = optimize(parse(spmd), ShardingOptions(), force=True,
                      executable=ForExecutable())
    header = result.text.splitlines()[0]
    assert "replica_count=4" in header and "num_partitions" not in header
    assert "input_output_alias={ {}: (0, {}, may-alias) }" in header
    assert parse(result.text).output_aliases() == {0: 0}


def _calls(path: Path, name: str) -> int:
    return sum(1 for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name)


@pytest.mark.parametrize("front_end", ["jax/hook.py", "jax/_program.py"])
def test_the_jax_front_ends_parse_once_and_leave_printing_to_optimize(front_end):
    """The captured module is parsed once (the report's names are read before the
    rewrite, not from a second parse) and printed once, by ``optimize``'s check."""
    assert _calls(PACKAGE / front_end, "parse") == 1
    assert _calls(PACKAGE / front_end, "to_text") == 0


def test_the_text_for_xla_is_validated_and_printed_once_not_parsed_back(monkeypatch):
    """The hook and the JAX path hand the text straight to XLA's parser (the read-back):
    ``xla_text`` validates the module itself and prints it, with no parse of its own;
    the file ``optimize`` writes (``text``) is still parsed back."""
    import hlo_shard.passes.optimize as entry

    parsed: list[str] = []
    monkeypatch.setattr(entry, "parse", lambda text, **kw: parsed.append(text) or parse(text, **kw))
    result = optimize(parse(SGD), ShardingOptions(), force=True)
    assert result.xla_text == to_text(result.module, for_xla=True) and parsed == []
    assert result.text == result.xla_text and len(parsed) == 1


def test_the_text_for_xla_refuses_a_module_that_fails_validation():
    result = optimize(parse(SGD), ShardingOptions(), force=True)
    root = result.module.entry.root
    root.name = result.module.entry.parameters()[0].name  # defined twice
    with pytest.raises(hlo_shard.HloShardError, match="fails validation"):
        _ = result.xla_text


@pytest.mark.parametrize("fixture", ["adam.n8.hlo", "loop_adam.n8.hlo", "lamb.n4.hlo"])
def test_a_module_kept_whole_for_a_front_end_is_left_as_it_was_with_the_same_verdicts(fixture):
    """``write_kept_whole=False`` (the hook, ``shard_weight_update``): the gate does not
    run the pipeline once more to write a module nobody compiles; the module stays as it
    was, and the report has the verdicts and the gate's estimates of the written run,
    without the notes of the passes that ready a module to write."""
    text = (PACKAGE.parent / "fixtures" / "spmd" / fixture).read_text()
    written = optimize(parse(text), ShardingOptions())
    module = parse(text)
    left = optimize(module, ShardingOptions(), write_kept_whole=False)
    assert written.decision is not None and written.decision.kept_whole
    assert left.decision == written.decision and left.sharded == 0
    assert to_text(module) == to_text(parse(text))
    assert [row.to_json() for row in left.report.explanations] == \
        [row.to_json() for row in written.report.explanations]
    assert {row.reason_code for row in left.report.explanations} >= {"kept_for_speed"}
    assert set(left.report.notes) <= set(written.report.notes)
    assert not any(note.startswith("renumbered") for note in left.report.notes)


def test_a_module_kept_whole_says_why_in_one_line():
    """The hook's decision and ``shard_weight_update``'s fallback say why in one line:
    the gate's verdict where it kept whole a module it could shard; otherwise the
    reasons that keep the most gradient bytes whole, first."""
    text = (PACKAGE.parent / "fixtures" / "spmd" / "adam.n8.hlo").read_text()
    kept = optimize(parse(text), ShardingOptions(), write_kept_whole=False)
    verdict = not_faster(kept.decision)
    assert verdict.startswith("sharding is not predicted at least 10% faster on profile "
                              "cpu-local (predicted ") and verdict.endswith("x the step as it is)")
    assert not_faster(optimize(parse(text), ShardingOptions(), force=True).decision) == ""
    assert not_faster(None) == ""

    def row(nbytes: int, reason: str, sharded: bool = False) -> Explanation:
        return Explanation("e", "ar", None, "f32[1]", nbytes, sharded, reason)

    report = ShardingReport(8, [row(4, "unused"), row(100, "scalar"), row(60, "groups"),
                                row(60, "groups"), row(500, "", sharded=True), row(8, "other")])
    assert report.whole_reasons() == "groups; scalar; other; 1 more"
    assert report.whole_reasons(limit=4) == "groups; scalar; other; unused"
    assert ShardingReport(8, [row(500, "", sharded=True)]).whole_reasons() == ""


@pytest.mark.parametrize("ratio, shown", [
    (0.9312, "0.93x"), (0.9004, "0.9004x"), (0.8996, "0.8996x"), (0.90004, "0.9000x"),
    (0.9, "0.90x"), (1.25, "1.25x")])
def test_a_ratio_near_the_gates_bar_does_not_read_as_on_it(ratio, shown):
    """A step predicted 0.9004x is kept whole at a 10% bar: "0.90x" would read as on it."""
    decision = SpeedDecision("cpu-local", 1.0, 1.0, (), None, min_gain=0.1)
    assert ratio_words(ratio, decision) == shown


@pytest.mark.parametrize("path", ["fixtures/spmd/adam.n8.hlo", "fixtures/spmd/loop_adam.n4.hlo",
                                  "tests/data/tp_clip_adam_4x2.n8.hlo",
                                  "tests/data/grad_accum_scan_2x4.n8.hlo"])
def test_the_optimizer_leaves_no_reference_cycle(path):
    """What the optimizer makes is freed as soon as the caller lets go of it: a cycle
    would leave every module it read to the cycle collector, whose pass over them ran
    inside XLA's compile under ``install()`` (the partitioner-form analysis's back
    reference did)."""
    import gc

    text = (PACKAGE.parent / path).read_text()
    gc.collect()
    debug = gc.get_debug()
    gc.set_debug(debug | gc.DEBUG_SAVEALL)
    try:
        for force in (False, True):
            result = optimize(parse(text, path=path), ShardingOptions(), force=force)
            assert result.text
            del result
        gc.collect()
        ours = [type(x).__qualname__ for x in gc.garbage
                if type(x).__module__.startswith("hlo_shard")]
    finally:
        gc.set_debug(debug)
        gc.garbage.clear()
    assert ours == []
