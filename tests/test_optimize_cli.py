"""``hlo-shard optimize``: outputs, explain/json streams, manifest, refusals, exit codes."""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from hlo_shard.cli import main
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update import WeightUpdateSharding
from hlo_shard.runtime.manifest import parse_manifest

from test_pass_weight_update import SGD, SPMD, crossover_bytes, two_gradients


def run(*args: str):
    """The transformation as told (these tests are about what it writes): ``--force``."""
    return CliRunner().invoke(main, ["optimize", "--force", *args])


def run_gated(*args: str):
    """As a user runs it: only what the cost model predicts faster."""
    return CliRunner().invoke(main, ["optimize", *args])


@pytest.fixture
def sgd(tmp_path):
    path = tmp_path / "sgd.hlo"
    path.write_text(SGD)
    return path


def test_writes_the_optimized_module_and_a_summary(sgd, tmp_path):
    out = tmp_path / "out.hlo"
    result = run(str(sgd), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert "sharded 1 of 1" in result.stderr
    assert "reduce-scatter" in out.read_text()
    assert sgd.read_text() == SGD  # the input is never touched


def test_explain_goes_to_stderr_with_one_row_per_gradient(sgd, tmp_path):
    result = run(str(sgd), "-o", str(tmp_path / "o.hlo"), "--explain")
    lines = result.stderr.splitlines()
    assert lines[0].startswith("all-reduce") and "e/ar" in lines[1] and "yes" in lines[1]


def test_json_report_on_stdout(sgd, tmp_path):
    result = run(str(sgd), "-o", str(tmp_path / "o.hlo"), "--json")
    data = json.loads(result.stdout)
    assert data["sharded"] == 1 and data["explanations"][0]["all_reduce"] == "ar"
    assert run(str(sgd), "-o", "-", "--json").exit_code == 2


ADAM = Path(__file__).resolve().parents[1] / "fixtures" / "spmd" / "adam.n2.hlo"
#: ``--explain --verbose``'s change log for ADAM with sharded state (regenerate with
#: HLO_SHARD_REGENERATE_GOLDEN=1 after a deliberate change to a pass, and review the diff).
VERBOSE_GOLDEN = Path(__file__).parent / "data" / "optimize_explain_verbose.adam.n2.txt"
PIPELINE = ["conditional-motion", "accumulation-motion", "conditional-speculation",
            "tuple-forwarding", "weight-update-sharding",
            "reduce-scatter-creation", "sharded-accumulator",
            "channel-id-dedupe", "entry-layout-update", "copy-free-donation",
            "dead-computation-removal"]


def test_explain_verbose_prints_each_pass_edits_after_the_explanation(tmp_path):
    out = str(tmp_path / "o.hlo")
    verbose = run(str(ADAM), "-o", out, "--state", "sharded", "--explain", "--verbose")
    assert verbose.exit_code == 0, verbose.output
    lines = verbose.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("changes of pass "))
    assert lines[0].startswith("all-reduce") and lines[-1].startswith("sharded 4 of 5")
    log = "\n".join(lines[first:-1]) + "\n"
    assert [line.split(":")[0].removeprefix("changes of pass ") for line in lines[first:-1]
            if line.startswith("changes of pass ")] == PIPELINE
    if os.environ.get("HLO_SHARD_REGENERATE_GOLDEN") == "1" or not VERBOSE_GOLDEN.exists():
        written = VERBOSE_GOLDEN.exists()
        VERBOSE_GOLDEN.write_text(log)
        if not written:
            pytest.fail(f"wrote {VERBOSE_GOLDEN.name}: review it and commit it")
    expected = VERBOSE_GOLDEN.read_text()
    assert log == expected, "\n".join(difflib.unified_diff(
        expected.splitlines(), log.splitlines(), VERBOSE_GOLDEN.name, "actual", lineterm=""))
    # Without --verbose: today's explanation and summary, no change log.
    plain = run(str(ADAM), "-o", out, "--state", "sharded", "--explain")
    assert plain.stderr.splitlines() == lines[:first] + lines[-1:]
    assert plain.stdout == verbose.stdout == ""


def test_json_carries_the_changes_only_with_verbose(tmp_path):
    out = str(tmp_path / "o.hlo")
    plain = json.loads(run(str(ADAM), "-o", out, "--json").stdout)
    assert "changes" not in plain
    data = json.loads(run(str(ADAM), "-o", out, "--json", "--verbose").stdout)
    assert [(p["pass"], p["changed"]) for p in data["changes"]] == list(zip(
        PIPELINE, [False, False, False, True, True, False, False, False, False, False, True]))
    sharding = data["changes"][PIPELINE.index("weight-update-sharding")]["edits"]
    assert {"kind", "computation", "name", "text"} <= set(sharding[0])
    assert any(e["kind"] == "insert" and e["name"].startswith("reduce-scatter")
               for e in sharding)
    assert data["changes"][PIPELINE.index("reduce-scatter-creation")]["edits"] == []


def test_verbose_needs_explain_or_json(sgd, tmp_path):
    result = run(str(sgd), "-o", str(tmp_path / "o.hlo"), "--verbose")
    assert result.exit_code == 2 and "--verbose" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.hlo").exists()


def test_module_to_stdout(sgd):
    result = run(str(sgd), "-o", "-")
    assert result.exit_code == 0 and "reduce-scatter" in result.stdout
    parse(result.stdout)


def test_manifest_describes_sharded_state(tmp_path):
    text = SPMD.replace("HloModule spmd,", "HloModule spmd, input_output_alias={ {0}: (0, {}, may-alias) },")
    # make w pure state: the forward pass does not read it
    path = tmp_path / "in.hlo"
    path.write_text(text)
    manifest = tmp_path / "m.json"
    result = run(str(path), "-o", str(tmp_path / "o.hlo"), "--state", "sharded",
                 "--manifest", str(manifest))
    assert result.exit_code == 0, result.output
    parsed = parse_manifest(json.loads(manifest.read_text()))
    assert parsed.devices == 4 and parsed.form == "spmd"
    (state,) = [r for r in parsed.parameters if r.kind == "sharded"]
    assert state.index == 0 and state.shard.format.shard_len == 4 and \
        state.shard.format.padding == 0
    assert parsed.outputs[0].kind == "sharded"
    assert parsed.parameters[1].kind == "per-device"
    assert parsed.feedback == ((0, 0),)


def test_refuses_to_overwrite_the_input_unless_in_place(sgd):
    result = run(str(sgd), "-o", str(sgd))
    assert result.exit_code == 2 and "--in-place" in result.stderr
    assert sgd.read_text() == SGD
    result = run(str(sgd), "-o", str(sgd), "--in-place")
    assert result.exit_code == 0 and "reduce-scatter" in sgd.read_text()


@pytest.mark.parametrize("args, message", [
    (["--num-replicas", "8"], "does not match"),
    (["--replicated-params", "0", "--per-device-params", "0"], "both"),
    (["--per-device-params", "7"], "no parameter 7"),
    (["--per-device-params", "x"], "expects parameter numbers"),
])
def test_bad_flags_exit_2(sgd, tmp_path, args, message):
    out = tmp_path / "o.hlo"
    result = run(str(sgd), "-o", str(out), *args)
    assert result.exit_code == 2 and message in result.stderr
    assert not out.exists()


def test_bad_input_exits_2_without_output(tmp_path):
    bad = tmp_path / "bad.hlo"
    bad.write_text("HloModule m\nENTRY e { ROOT x = f32[] bogus-op() }\n")
    out = tmp_path / "o.hlo"
    result = run(str(bad), "-o", str(out))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize("command", [("optimize",), ("report",)])
def test_a_convolution_xla_would_refuse_is_a_located_error_not_an_internal_one(
        tmp_path, command):
    """XLA's test of malformed convolution labels (and a window of the wrong rank):
    ``report`` and ``optimize`` stopped in the cost model with exit 3, "internal error"."""
    bad = tmp_path / "conv.hlo"
    bad.write_text("HloModule m\nENTRY e {\n  x = f32[1,2,1] parameter(0)\n"
                   "  k = f32[1,1,1] parameter(1)\n  ROOT c = f32[1,2,1] convolution(x, k), "
                   "window={size=1}, dim_labels=00_01->10\n}\n")
    out = tmp_path / "o.hlo"
    args = [*command, str(bad)] + (["-o", str(out)] if command == ("optimize",) else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.startswith(f"{bad}:5:8: error: %c: dim_labels=00_01->10 is not")
    assert result.stderr.count("\n") == 1 and not out.exists()


def test_refuses_to_write_a_module_that_fails_validation(sgd, tmp_path, monkeypatch):
    original = WeightUpdateSharding.apply

    def broken(self, module, rewriter):
        report = original(self, module, rewriter)
        (rs,) = [i for i in module.entry.instructions if i.opcode == "reduce-scatter"]
        rewriter.rewriter(module.entry).set_shape(rs, rs.shape.with_dims((5,)))
        return report

    monkeypatch.setattr(WeightUpdateSharding, "apply", broken)
    out = tmp_path / "o.hlo"
    result = run(str(sgd), "-o", str(out))
    assert result.exit_code == 2  # named at the pass that left it (the pipeline's check)
    assert "pass weight-update-sharding left an invalid module" in result.stderr
    assert "shape" in result.stderr and result.stderr.count("\n") == 1
    assert not out.exists()


def test_nothing_to_shard_still_writes_and_says_so(tmp_path):
    path = tmp_path / "plain.hlo"
    path.write_text("HloModule plain\nENTRY e { a = f32[4] parameter(0) ROOT n = f32[4] negate(a) }\n")
    out = tmp_path / "o.hlo"
    result = run(str(path), "-o", str(out))
    assert result.exit_code == 0 and out.exists()
    assert "no gradient all-reduce" in result.stderr
    # --explain said "every gradient stays whole for its own reason (its row says
    # which)" above an empty table
    explained = run(str(path), "-o", str(out), "--explain")
    assert "nothing to shard: no gradient all-reduce" in explained.stderr
    assert "its row says which" not in explained.stderr


@pytest.mark.parametrize("profile", ["cpu-generic", "tpu-v3"])
def test_profile_decides_auto_and_explain_names_it(tmp_path, profile):
    # Below cpu-generic's crossover: one bucket there (XLA:CPU has no reduce-scatter
    # combiner), a pair each on tpu-v3 (its combiners share their latency).
    pairs, chosen = (1, "combined") if profile == "cpu-generic" else (2, "per-tensor")
    source = tmp_path / "two.hlo"
    source.write_text(two_gradients(8, crossover_bytes("cpu-generic", 8) // 16))
    out = tmp_path / "o.hlo"
    result = run(str(source), "-o", str(out), "--profile", profile, "--explain")
    assert result.exit_code == 0, result.output
    (line,) = [text for text in result.stderr.splitlines() if text.startswith("strategy auto")]
    assert line.startswith(f"strategy auto on profile {profile} (8 devices), e: auto {pairs} pair")
    figures = dict(part.split(" ", 1) for part in line.split(": ", 1)[1].split("; "))
    assert set(figures) == {"auto", "per-tensor", "combined"}
    assert figures["auto"].endswith("<- chosen")
    assert figures["auto"].split(" <-")[0].split(" ", 2)[2] == figures[chosen].split(" ", 2)[2]
    assert out.read_text().count("reduce-scatter(") == pairs
    data = json.loads(run(str(source), "-o", str(out), "--profile", profile, "--json").stdout)
    (choice,) = data["strategies"]
    assert data["profile"] == profile and choice["strategy"] == choice["chosen"] == "auto"


def test_explain_marks_the_strategy_auto_lowers(tmp_path):
    # auto's per-tensor test prices its one bucket above a pair each: per-tensor is
    # lowered, and marked chosen.
    elements = int(crossover_bytes("cpu-generic", 8) * 0.7) // 4
    source = tmp_path / "two.hlo"
    source.write_text(two_gradients(8, elements, elements))
    out = tmp_path / "o.hlo"
    result = run(str(source), "-o", str(out), "--profile", "cpu-generic", "--explain")
    (line,) = [text for text in result.stderr.splitlines() if text.startswith("strategy auto")]
    figures = dict(part.split(" ", 1) for part in line.split(": ", 1)[1].split("; "))
    assert figures["per-tensor"].startswith("2 pairs") and figures["per-tensor"].endswith(
        "<- chosen") and line.count("<- chosen") == 1
    assert out.read_text().count("reduce-scatter(") == 2
    data = json.loads(run(str(source), "-o", str(out), "--profile", "cpu-generic",
                          "--json").stdout)
    assert data["strategies"][0]["chosen"] == "per-tensor"


def test_unknown_profile_exits_2(sgd, tmp_path):
    result = run(str(sgd), "-o", str(tmp_path / "o.hlo"), "--profile", "no-such-chip")
    assert result.exit_code == 2 and "unknown profile" in result.stderr
    assert not (tmp_path / "o.hlo").exists()


# ------------------------------------------------------------------- never slower


def test_keeps_the_module_whole_when_sharding_is_predicted_slower(sgd, tmp_path):
    out = tmp_path / "o.hlo"
    result = run_gated(str(sgd), "-o", str(out), "--explain")
    assert result.exit_code == 0, result.output
    assert "reduce-scatter" not in out.read_text() and "all-reduce" in out.read_text()
    assert "kept whole: sharding is predicted slower on profile cpu-local" in result.stderr
    (row,) = [line for line in result.stderr.splitlines() if line.startswith("e/ar")]
    # both estimates and the profile that decided
    assert "kept whole for speed: sharding it predicted" in row and "whole" in row
    assert "(profile cpu-local)" in row
    assert "predicted step on profile cpu-local: input" in result.stderr


def test_a_gain_under_the_profiles_threshold_is_named_as_such(tmp_path):
    """Kept whole although predicted faster: the row says the gain is too small to act
    on, not that sharding is slower."""
    fixture = Path(__file__).parent.parent / "fixtures" / "spmd" / "adam.n8.hlo"
    result = run_gated(str(fixture), "-o", str(tmp_path / "o.hlo"), "--explain")
    assert result.exit_code == 0, result.output
    assert "less than 10% faster than the input" in result.stderr
    rows = [line for line in result.stderr.splitlines() if "kept whole for speed" in line]
    assert rows and all("a gain under the 10% the profile acts on" in row for row in rows)


#: Two gradients: ``%ar1`` goes to the output as it is (no update work to shard, whatever
#: the cut-off), ``%ar2`` feeds an SGD update the pass can shard (kept whole for speed).
UNSHARDABLE_BESIDE_SHARDABLE = """\
HloModule kw, entry_computation_layout={(f32[64]{0}, f32[64]{0}, f32[256]{0}, f32[256]{0})->(f32[64]{0}, f32[256]{0})}, replica_count=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[64], p1: f32[64], p2: f32[256], p3: f32[256]) -> (f32[64], f32[256]) {
  %p0 = f32[64]{0} parameter(0)
  %p1 = f32[64]{0} parameter(1)
  %p2 = f32[256]{0} parameter(2)
  %p3 = f32[256]{0} parameter(3)
  %ar1 = f32[64]{0} all-reduce(%p1), replica_groups={{0,1,2,3}}, to_apply=%add
  %ar2 = f32[256]{0} all-reduce(%p3), replica_groups={{0,1,2,3}}, to_apply=%add
  %lr = f32[] constant(0.1)
  %b2 = f32[256]{0} broadcast(%lr), dimensions={}
  %m2 = f32[256]{0} multiply(%ar2, %b2)
  %n2 = f32[256]{0} subtract(%p2, %m2)
  ROOT %t = (f32[64]{0}, f32[256]{0}) tuple(%ar1, %n2)
}
"""


def test_a_gradient_no_cut_off_shards_keeps_its_own_reason(tmp_path):
    """The gate's cut-off above every size must not turn a gradient that no cut-off
    shards into one "kept whole for speed" (a price quoted for a rewrite never made)."""
    path = tmp_path / "kw.hlo"
    path.write_text(UNSHARDABLE_BESIDE_SHARDABLE)
    result = run_gated(str(path), "-o", str(tmp_path / "o.hlo"), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["speed"]["kept_whole"]
    codes = {row["all_reduce"]: row["reason_code"] for row in data["explanations"]}
    assert codes == {"ar1": "no_update_work", "ar2": "kept_for_speed"}


def test_force_writes_what_is_predicted_slower_and_says_so(sgd, tmp_path):
    out = tmp_path / "o.hlo"
    result = run_gated(str(sgd), "-o", str(out), "--force")
    assert result.exit_code == 0 and "reduce-scatter" in out.read_text()
    assert "predicted SLOWER, written because of --force" in result.stderr


def test_shards_what_is_predicted_faster(tmp_path):
    # Measured (donated, n=8): the 4 MiB gradient's step 5.35 ms whole, 5.06 ms
    # sharded; at 1 MiB both were 1.26-1.30 ms. The 64-element gradient stays whole:
    # on XLA CPU its own reduce-scatter and all-gather pay a rendezvous each.
    path = tmp_path / "two.hlo"
    path.write_text(two_gradients(8, 1 << 20))
    out = tmp_path / "o.hlo"
    result = run_gated(str(path), "-o", str(out), "--json")
    data = json.loads(result.stdout)
    assert data["sharded"] == 1 and "reduce-scatter" in out.read_text()
    speed = data["speed"]
    assert speed["profile"] == "cpu-local" and not speed["kept_whole"]
    assert speed["after_seconds"] < speed["before_seconds"]
    assert "predicted faster on profile cpu-local" in result.stderr


def test_parameter_flags_accept_ranges(sgd, tmp_path):
    out = tmp_path / "o.hlo"
    assert run(str(sgd), "-o", str(out), "--per-device-params", "1-1").exit_code == 0
    result = run(str(sgd), "-o", str(out), "--replicated-params", "0-3")
    assert result.exit_code == 2 and "no parameter 2, 3" in result.stderr
    bad = run(str(sgd), "-o", str(out), "--replicated-params", "3-1")
    assert bad.exit_code == 2 and "ranges like 0,3 or 0-24" in bad.stderr


def test_pre_partitioning_module_is_named_as_such(tmp_path):
    path = tmp_path / "global.hlo"
    path.write_text("""HloModule g, num_partitions=4
ENTRY e { w = f32[16] parameter(0), sharding={replicated}
 c = f32[16] custom-call(w), custom_call_target="Sharding", sharding={replicated}
 ROOT n = f32[16] negate(c) }
""")
    out = tmp_path / "o.hlo"
    result = run_gated(str(path), "-o", str(out))
    assert result.exit_code == 0
    assert "NOTHING TO DO: this is the global program before SPMD partitioning" in result.stderr
    assert "spmd-partitioner" in result.stderr and "written unchanged" in result.stderr
    assert "custom-call" in out.read_text()
    # even when it holds psums (shard_map inside jit): never rewritten, said so
    psum = path.read_text().replace(
        "ROOT n = f32[16] negate(c) }",
        "s = f32[16] all-reduce(c), replica_groups={{0,1,2,3}}, to_apply=add\n"
        " ROOT n = f32[16] negate(s) }").replace(
        "ENTRY e {", "add { x = f32[] parameter(0) y = f32[] parameter(1) "
        "ROOT r = f32[] add(x, y) }\nENTRY e {")
    path.write_text(psum)
    result = run_gated(str(path), "-o", str(out), "--force")
    assert result.exit_code == 0 and "NOTHING TO DO" in result.stderr
    assert "reduce-scatter" not in out.read_text()
    manifest = run_gated(str(path), "-o", str(out), "--manifest", str(tmp_path / "m.json"))
    assert manifest.exit_code == 2 and "no manifest for a global program" in manifest.stderr


def test_the_cli_states_no_bucket_size_of_its_own():
    """The bucket size is stated once (#25): without --bucket-bytes the command hands the
    pass its own default instead of a number of its own."""
    from hlo_shard.cli.optimize import optimize

    option = next(p for p in optimize.params if p.name == "bucket_bytes")
    assert option.default is None


def test_cutoff_prices_split_the_change_per_gradient_from_the_two_priced_modules() -> None:
    """The cut-offs between are priced from the whole and the fully sharded module: at the
    ends the prices are those estimates', and each gradient left whole keeps exactly its
    all-reduce's price in the whole module."""
    from hlo_shard.costmodel.plan_prices import CutoffPrices, ShardedGradient
    from hlo_shard.parser import parse_file
    from hlo_shard.passes.sharding_pipeline import run_sharding
    from hlo_shard.passes.speed_gate import predicted_step
    from hlo_shard.passes.weight_update import ShardingOptions

    module = parse_file(ADAM.parent / "transformer.n8.hlo")
    sharding = WeightUpdateSharding(ShardingOptions(profile="tpu-v3"))
    whole = predicted_step(module, sharding.profile)
    candidate = module.clone()
    rows = [r for r in run_sharding(candidate, sharding).explanations if r.sharded]
    sharded = predicted_step(candidate, sharding.profile)
    prices = CutoffPrices.from_estimates(
        whole, sharded, [ShardedGradient(r.computation, r.all_reduce, r.bytes) for r in rows])
    largest = max(r.bytes for r in rows)
    assert prices.seconds(0) == pytest.approx(sharded.seconds, rel=1e-12)
    assert prices.seconds(largest + 1) == whole.seconds
    all_reduces = {(i.computation, i.name): i.seconds for i in whole.instructions}
    assert sum(price for _, price in prices.gradients) == pytest.approx(sum(
        all_reduces[key] for key in {(r.computation, r.all_reduce) for r in rows}))
    only_largest = [price for nbytes, price in prices.gradients if nbytes == largest]
    assert prices.seconds(largest) == pytest.approx(whole.seconds + sum(
        prices.per_gradient + prices.per_byte * largest - price for price in only_largest))


def test_the_gate_rewrites_two_cutoffs_at_most_and_chooses_as_pricing_them_all(monkeypatch):
    """The transformer fixture has seven cut-offs; the gate rewrites and prices one (all
    gradients) and the one the per-gradient prices pick, and chooses what rewriting and
    pricing every one of them chooses, on every profile."""
    from dataclasses import replace

    from hlo_shard.parser import parse_file
    from hlo_shard.passes import speed_gate
    from hlo_shard.passes.sharding_pipeline import run_sharding
    from hlo_shard.passes.weight_update import ShardingOptions

    module = parse_file(ADAM.parent / "transformer.n8.hlo")
    runs = []

    def counted(candidate, sharding, after_pass=None, known_problems=None, **options):
        runs.append(sharding.options.min_shard_bytes)
        return run_sharding(candidate, sharding, after_pass, known_problems, **options)

    monkeypatch.setattr(speed_gate, "run_sharding", counted)
    for profile in ("cpu-local", "tpu-v3", "h100"):
        sharding = WeightUpdateSharding(ShardingOptions(profile=profile))
        runs.clear()
        _, decision = speed_gate.shard_where_faster(module.clone(), sharding)
        assert len(decision.trials) == 7 and len(decision.priced) <= 2
        assert len(runs) <= 3  # the priced cut-offs, and the kept-whole module's run
        exact = []
        for trial in decision.trials:
            candidate = module.clone()
            run_sharding(candidate, replace(sharding, options=replace(
                sharding.options, min_shard_bytes=trial.min_bytes)))
            exact.append((speed_gate.predicted_step_seconds(candidate, sharding.profile),
                          -trial.sharded, trial.min_bytes))
        seconds, _, best = min(exact)
        wins = seconds <= decision.before_s * (1 - decision.min_gain)
        assert (decision.chosen.min_bytes if decision.chosen else None) == \
            (best if wins else None), profile


def test_the_exhaustive_gate_rewrites_every_cutoff_and_chooses_as_the_guided_one():
    """``exhaustive=True`` (what the bench times the guided gate against): every cut-off
    rewritten and priced, none estimated."""
    from hlo_shard.parser import parse_file
    from hlo_shard.passes import speed_gate
    from hlo_shard.passes.weight_update import ShardingOptions

    module = parse_file(ADAM.parent / "transformer.n8.hlo")
    sharding = WeightUpdateSharding(ShardingOptions(profile="tpu-v3"))
    _, guided = speed_gate.shard_where_faster(module.clone(), sharding)
    _, exhaustive = speed_gate.shard_where_faster(module.clone(), sharding, exhaustive=True)
    assert len(guided.priced) <= 2 < len(exhaustive.priced) == len(exhaustive.trials) == 7
    assert exhaustive.chosen == guided.chosen
    assert {t.min_bytes for t in exhaustive.trials} == {t.min_bytes for t in guided.trials}


@pytest.mark.parametrize("lures", [2, 6])
def test_a_prediction_that_prices_slower_is_followed_by_the_next(monkeypatch, lures):
    """A predicted cut-off is a share of the trials priced, not a price: where the one
    predicted fastest prices slower on its own module (made so here: the largest
    ``lures`` cut-offs predicted nearly free, while on this module and profile no
    cut-off pays), the gate prices the next prediction that could be written too, up
    to MAX_GUESSES, instead of leaving it standing beside a module kept whole."""
    from hlo_shard.costmodel.plan_prices import CutoffPrices
    from hlo_shard.parser import parse_file
    from hlo_shard.passes import speed_gate
    from hlo_shard.passes.weight_update import ShardingOptions

    module = parse_file(ADAM.parent / "transformer.n8.hlo")
    sharding = WeightUpdateSharding(ShardingOptions(profile="tpu-v3"))
    _, honest = speed_gate.shard_where_faster(module.clone(), sharding)
    assert honest.kept_whole and len(honest.priced) == 1  # no prediction worth pricing
    estimated = sorted((t.min_bytes for t in honest.trials if t.estimated), reverse=True)
    assert len(estimated) > speed_gate.MAX_GUESSES
    free = {cutoff: 1e-9 * (k + 1) for k, cutoff in enumerate(estimated[:lures])}
    seconds = CutoffPrices.seconds
    monkeypatch.setattr(CutoffPrices, "seconds",
                        lambda self, cutoff: free.get(cutoff) or seconds(self, cutoff))
    _, decision = speed_gate.shard_where_faster(module.clone(), sharding)
    priced = [t.min_bytes for t in decision.priced if t.min_bytes]
    assert priced == sorted(estimated[:min(lures, speed_gate.MAX_GUESSES)], reverse=True)
    assert all(t.seconds > 1e-6 for t in decision.priced)  # their own prices, not the lure
    assert decision.kept_whole


def test_a_global_program_with_shardy_shardings_is_named_as_such(tmp_path):
    """jax's before_optimizations dump carries no sharding custom call, only Shardy's
    frontend attributes: optimize said "no gradient all-reduce found" and verify ran
    its global shapes on every device as if per-device."""
    path = tmp_path / "global.hlo"
    path.write_text("""HloModule g, num_partitions=4
ENTRY e { w = f32[16] parameter(0), sharding={replicated}, frontend_attributes={xla.sdy.sharding="#sdy.sharding<@mesh, [{}]>"}
 ROOT n = f32[16] negate(w) }
""")
    out = tmp_path / "o.hlo"
    result = run_gated(str(path), "-o", str(out))
    assert result.exit_code == 0
    assert "NOTHING TO DO: this is the global program before SPMD partitioning (%w carries " \
           "a Shardy sharding (xla.sdy.sharding))" in result.stderr
    checked = CliRunner().invoke(main, ["verify", str(path)])
    assert checked.exit_code == 2 and "global program before SPMD partitioning" in checked.stderr


def test_a_global_shard_map_program_is_named_as_such_not_refused(tmp_path):
    """``jax.jit(shard_map step).lower(...).as_text()``: the manual body's psums all carry
    channel id 1, which the output check refused ("refusing to write: ... unique-channel-
    ids") before the note said what the module is. The input goes out as it came."""
    path = tmp_path / "global.hlo"
    path.write_text("""HloModule g, num_partitions=4
add { a = f32[] parameter(0) b = f32[] parameter(1) ROOT s = f32[] add(a, b) }
ENTRY e { w = f32[16] parameter(0), sharding={replicated}, frontend_attributes={xla.sdy.sharding="#sdy.sharding<@mesh, [{}]>"}
 p = f32[16] all-reduce(w), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=add
 q = f32[16] all-reduce(p), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=add
 ROOT n = f32[16] negate(q) }
""")
    out = tmp_path / "o.hlo"
    result = run_gated(str(path), "-o", str(out))
    assert result.exit_code == 0, result.stderr
    assert "NOTHING TO DO: this is the global program before SPMD partitioning" in result.stderr
    assert out.read_text().count("channel_id=1") == 2


def test_a_dump_folder_gives_its_training_step_not_a_larger_init(sgd, tmp_path):
    """A jitted init holding the model's initial values can be the largest module of a
    dump: the step is the one that sums gradients (it read the init: "no gradient
    all-reduce found; module written unchanged")."""
    from hlo_shard.dumps import SPMD_STAGES

    folder = tmp_path / "dump"
    folder.mkdir()
    values = ", ".join(["0.5"] * 4096)
    (folder / f"module_0001.jit_init{SPMD_STAGES[0]}").write_text(
        "HloModule jit_init, replica_count=4\nENTRY e { ROOT c = f32[4096] constant({"
        + values + "}) }\n")
    (folder / f"module_0002.jit_train_step{SPMD_STAGES[0]}").write_text(sgd.read_text())
    result = run(str(folder), "-o", str(tmp_path / "o.hlo"))
    assert result.exit_code == 0, result.stderr
    assert "jit_train_step" in result.stderr and "sharded 1 of 1" in result.stderr
    # an error is its one line (it followed "reading <file>")
    bad = run(str(folder), "-o", str(tmp_path / "p.hlo"), "--profile", "nope")
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_a_gradient_under_the_users_cut_off_names_the_users_cut_off(tmp_path):
    """Kept whole by the gate, a gradient under ``--min-shard-bytes`` said the gate's own
    cut-off ("(52 < 625)", a size the user never gave)."""
    result = run_gated(str(ADAM), "-o", str(tmp_path / "o.hlo"), "--min-shard-bytes", "100",
                       "--explain")
    assert result.exit_code == 0, result.stderr
    rows = [line for line in result.output.splitlines() if "(gradient of p['l0_b'])" in line]
    assert len(rows) == 1 and rows[0].endswith("smaller than --min-shard-bytes (52 < 100)"), \
        result.stdout


def test_a_module_with_nothing_to_shard_says_so_rather_than_slower(tmp_path):
    """Every gradient stays whole for its own reason (here: a scalar): it said "kept
    whole: sharding is predicted slower ... --force shards anyway", and --force then
    changed nothing."""
    path = tmp_path / "scalar.hlo"
    path.write_text("""HloModule s, replica_count=2
add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }
ENTRY e { w = f32[] parameter(0) g = f32[] parameter(1), parameter_replication={false}
 a = f32[] all-reduce(g), replica_groups={{0,1}}, to_apply=add
 ROOT n = f32[] subtract(w, a) }
""")
    for flags in ([], ["--force"]):
        result = CliRunner().invoke(main, ["optimize", str(path), "-o", str(tmp_path / "o.hlo"),
                                           "--explain", *flags])
        assert result.exit_code == 0, result.output
        assert "nothing to shard (each gradient's row says why)" in result.stderr
        assert "predicted slower" not in result.stderr and "--force shards" not in result.stderr


def test_an_xla_optimized_module_is_said_to_be_unverifiable(sgd, tmp_path):
    """optimize wrote such a module without a word, and verify then refused it."""
    path = tmp_path / "scheduled.hlo"
    path.write_text(sgd.read_text().replace("HloModule sgd", "HloModule sgd, is_scheduled=true",
                                            1))
    assert "is_scheduled=true" in path.read_text()
    result = run(str(path), "-o", str(tmp_path / "o.hlo"))
    assert result.exit_code == 0, result.stderr
    assert "note: this is an XLA-optimized module (is_scheduled=true" in result.stderr
    assert "note:" not in run(str(sgd), "-o", str(tmp_path / "p.hlo")).stderr


COUNTS = """HloModule counts, replica_count=4
add { a = f32[] parameter(0) b = f32[] parameter(1) ROOT c = f32[] add(a, b) }
add_s32 { a = s32[] parameter(0) b = s32[] parameter(1) ROOT c = s32[] add(a, b) }
ENTRY e { w = f32[1024] parameter(0) g = f32[1024] parameter(1) c = s32[64] parameter(2)
 k = s32[64] parameter(3)
 ar = f32[1024] all-reduce(g), replica_groups={{0,1,2,3}}, to_apply=add
 lr = f32[] constant(0.01) b = f32[1024] broadcast(lr), dimensions={}
 u = f32[1024] multiply(ar, b) nw = f32[1024] subtract(w, u)
 counted = s32[64] all-reduce(k), replica_groups={{0,1,2,3}}, to_apply=add_s32
 nc = s32[64] add(c, counted) ROOT out = (f32[1024], s32[64]) tuple(nw, nc) }
"""


def test_an_integer_sum_is_no_gradient_and_is_counted_apart(tmp_path):
    path = tmp_path / "counts.hlo"
    path.write_text(COUNTS)
    result = run(str(path), "-o", str(tmp_path / "o.hlo"), "--state", "sharded", "--json")
    assert result.exit_code == 0, result.output
    rows = {row["all_reduce"]: row for row in json.loads(result.stdout)["explanations"]}
    assert rows["ar"]["sharded"] and not rows["counted"]["sharded"]
    assert rows["counted"]["reason_code"] == "integer_sum"
    assert ("sharded 1 of 2 gradient all-reduce leaves (4096 of 4352 bytes) across 4 devices; "
            "1 integer sum (counts, not gradients), 0 kept whole;") in result.stderr
    out = parse((tmp_path / "o.hlo").read_text())
    assert out.entry.root.shape.elements[1].dims == (64,)  # the count's total, whole
