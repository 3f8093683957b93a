"""``hlo-shard report``, ``diff`` and ``scale``: formats, keys, deltas, errors."""

from __future__ import annotations

import base64
from dataclasses import replace
from html import escape as html_escape
import json
import re
import sys
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner

from hlo_shard.cli import main
from hlo_shard.parser import parse
from hlo_shard.reports.content import diff_document, report_document
from hlo_shard.reports.document import PLOT_HINT
from hlo_shard.units import fmt_bytes, fmt_delta, fmt_seconds
from hlo_shard.reports.render import render_html, render_text
from hlo_shard.scaling import data_parallel_size, retarget

from test_cost import ADAM, estimate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REQUIRED_KEYS = {"flops", "transcendentals", "bytes_accessed", "collective_bytes",
                 "peak_memory_bytes", "estimated_step_seconds"}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """The Adam step and its sharded form (written by the pass, --state sharded)."""
    from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding
    from hlo_shard.printer import to_text

    folder = tmp_path_factory.mktemp("modules")
    before = folder / "adam.hlo"
    before.write_text(ADAM)
    sharded = WeightUpdateSharding(ShardingOptions(state="sharded")).run(parse(ADAM)).module
    after = folder / "adam.sharded.hlo"
    after.write_text(to_text(sharded))
    return str(before), str(after)


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


# --------------------------------------------------------------------------- report


def test_report_text_has_every_section(modules):
    result = run("report", modules[0], "--profile", "tpu-v3")
    assert result.exit_code == 0
    for heading in ("Summary", "Collectives", "Peak memory", "Top 10 instructions",
                    "Per weight tensor", "weight-update share of the step"):
        assert heading in result.output
    assert re.search(r"all-reduce\s+1\s+4 MiB\s+6 MiB", result.output)  # 2(n−1)/n · S, n=4


def test_report_json_keys_are_per_device_numbers(modules):
    result = run("report", modules[0], "--json", "--profile", "h100")
    data = json.loads(result.output)
    assert REQUIRED_KEYS <= set(data)
    assert all(isinstance(data[k], (int, float)) for k in REQUIRED_KEYS)
    assert data["collective_bytes"] == pytest.approx(2 * 3 / 4 * 4 * 2 ** 20)
    assert data["profile"] == "h100" and data["devices"] == 4
    assert data["parameters"]["m"] == "optimizer_state"
    split = data["seconds_by_category"]
    assert sum(split.values()) == pytest.approx(data["estimated_step_seconds"])


def test_report_markdown_and_html(modules, tmp_path):
    page = tmp_path / "r.html"
    result = run("report", modules[0], "--markdown", "--html", str(page))
    assert result.output.startswith("# hlo-shard report") and "| --- |" not in result.output
    assert "|---|---:|---:|" in result.output
    html = page.read_text()
    assert "<table>" in html and "http" not in html.split("<body>")[1]  # self-contained
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html)
    assert len(images) == 2 and base64.b64decode(images[0])[:4] == b"\x89PNG"


def test_html_without_matplotlib_says_how_to_get_plots(modules, monkeypatch):
    from hlo_shard.profiles import load_profile

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    module = parse(ADAM)
    html = render_html(report_document(estimate(module, load_profile("tpu-v3")), module))
    assert html_escape(PLOT_HINT) in html and "<table>" in html


def test_user_profile_file(modules, tmp_path):
    shipped = resources.files("hlo_shard.profiles") / "tpu-v3.json"
    profile = json.loads(shipped.read_text())
    profile["name"] = "slow-tpu"
    profile["memory_bandwidth_bytes_per_s"] = 45e9
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    slow = json.loads(run("report", modules[0], "--json", "--profile", str(path)).output)
    fast = json.loads(run("report", modules[0], "--json", "--profile", "tpu-v3").output)
    assert slow["profile"] == "slow-tpu"
    assert slow["seconds_by_category"]["weight_update"] == pytest.approx(
        10 * fast["seconds_by_category"]["weight_update"], rel=0.01)


@pytest.mark.parametrize("args, message", [
    (["report", "missing.hlo"], "missing.hlo"),
    (["report", "BAD", "--profile", "tpu-v9"], "unknown profile"),
    (["report", "BAD", "--json", "--markdown"], "exclusive"),
    (["scale", "BAD", "--replicas", "8,x"], "--replicas"),
    (["scale", "BAD", "--batch-per-replica", "half"], "--batch-per-replica"),
    (["scale", "BAD", "--replicas", "8,128", "--batch-per-replica", "global=100"],
     "smaller than 128 replicas"),
    (["scale", "BAD", "--parameters", "lots"], "--parameters"),
])
def test_bad_input_is_one_line_and_exit_2(modules, args, message):
    args = [modules[0] if a == "BAD" else a for a in args]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_parse_error_is_located(tmp_path):
    bad = tmp_path / "bad.hlo"
    bad.write_text("HloModule m\n\nENTRY e {\n  x = f32[4] parameter(0\n}\n")
    result = CliRunner().invoke(main, ["report", str(bad)])
    assert result.exit_code == 2 and "bad.hlo:" in result.output


# ----------------------------------------------------------------------------- diff


def test_per_weight_rows_of_a_combined_bucket():
    # Biases share one reduce-scatter/all-gather bucket: each owns its own slice's
    # update (≈ 1/N of its update flops) and a share of the bucket, not its neighbours'.
    from pathlib import Path

    from hlo_shard.costmodel.step_time import per_weight_rows
    from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding
    from hlo_shard.profiles import load_profile

    original = parse(Path("fixtures/spmd/adam.n8.hlo").read_text())
    combined = WeightUpdateSharding(ShardingOptions(strategy="combined")).run(
        parse(Path("fixtures/spmd/adam.n8.hlo").read_text())).module
    profile = load_profile("cpu-generic")
    before = per_weight_rows(estimate(original, profile), original)
    after = per_weight_rows(estimate(combined, profile), combined)
    for name, row in before.items():
        elements = row["bytes"] / 4
        shard = -(-elements // 8)  # padded to a multiple of 8 devices
        assert after[name]["update_flops"] == pytest.approx(
            row["update_flops"] * shard / elements, rel=0.1), name
        assert after[name]["collective_bytes"] > 0


def test_a_sharded_weights_gather_is_not_counted_as_its_gradient_sent(modules):
    """Sharded, the 4 MiB weight's gradient is reduce-scattered ((N-1)/N of it sent at
    N = 4, half the all-reduce's 2(N-1)/N) and the new weight all-gathered: "gradient
    sent" is the first alone, the gather a column of its own (the two were added up as
    "gradient sent", which then read as much as the all-reduce it replaced)."""
    data = json.loads(run("diff", *modules, "--json", "--profile", "tpu-v3").output)
    before, after = data["before"]["weights"]["w"], data["after"]["weights"]["w"]
    size = 1024 * 1024 * 4
    assert before["collective_bytes"] == pytest.approx(2 * 3 / 4 * size)
    assert before["gathered_bytes"] == 0
    assert after["collective_bytes"] == pytest.approx(3 / 4 * size)
    assert after["gathered_bytes"] == pytest.approx(3 / 4 * size)
    text = run("diff", *modules, "--profile", "tpu-v3").output
    assert re.search(r"w: gradient sent\s+6 MiB\s+3 MiB", text), text
    assert re.search(r"w: weight gathered\s+0 B\s+3 MiB", text), text
    table = run("report", modules[1], "--profile", "tpu-v3").output
    assert re.search(r"gradient sent\s+weight gathered\n.*\s3 MiB\s+3 MiB\n", table), table


def test_diff_shows_the_pass_effect(modules):
    data = json.loads(run("diff", *modules, "--json", "--profile", "tpu-v3").output)
    before, after = data["before"], data["after"]
    assert set(before["collectives"]) == {"all-reduce"}
    assert set(after["collectives"]) == {"reduce-scatter", "all-gather"}
    # Same wire bytes, a quarter of the update work, sharded optimizer state.
    assert after["collective_bytes"] == pytest.approx(before["collective_bytes"])
    assert (after["weights"]["w"]["update_flops"]
            == pytest.approx(before["weights"]["w"]["update_flops"] / 4, rel=0.05))
    assert (after["memory"]["peak_breakdown"]["optimizer_state"]
            == before["memory"]["peak_breakdown"]["optimizer_state"] // 4)
    assert data["delta"]["seconds_by_category"]["weight_update"] < 0
    assert data["ratio"]["estimated_step_seconds"] < 1


def test_diff_text_rows_have_absolute_and_relative_deltas(modules):
    result = run("diff", *modules, "--profile", "tpu-v3")
    assert result.exit_code == 0
    row = next(text for text in result.output.splitlines()
               if text.strip().startswith("w: update flops"))
    assert "−" in row and "%" in row
    assert "reduce-scatter: count" in result.output


def test_diff_document_as_text(modules):
    from hlo_shard.profiles import load_profile

    before, after = (parse(open(p).read()) for p in modules)
    profile = load_profile("tpu-v3")
    text = render_text(diff_document(estimate(before, profile), estimate(after, profile),
                                     before, after))
    assert text.startswith("hlo-shard diff") and "weight update" in text


def test_diff_says_which_module_is_faster_on_which_profile(modules):
    faster = run("diff", *modules, "--profile", "tpu-v3").output
    assert "verdict: after is predicted" in faster and "faster per step" in faster
    assert "on profile tpu-v3" in faster
    slower = run("diff", modules[1], modules[0], "--profile", "tpu-v3").output
    assert "SLOWER per step" in slower
    data = json.loads(run("diff", *modules, "--json", "--profile", "tpu-v3").output)
    assert data["verdict"].startswith("verdict: after is predicted")


def test_diff_says_when_the_modules_are_two_programs(modules):
    # A module and its optimized form take the same parameter arrays (the state's
    # shapes aside): no note. Two programs taking other parameters: the verdict
    # compares two steps, and the note under it says so (it said nothing).
    pair = run("diff", *modules, "--profile", "tpu-v3")
    assert pair.exit_code == 0 and "two programs" not in pair.output
    assert json.loads(run("diff", *modules, "--json")
                      .output)["programs_differ"] is None
    other = "fixtures/spmd/adam.n8.hlo"
    apart = run("diff", modules[0], other, "--profile", "tpu-v3")
    assert apart.exit_code == 0
    (verdict,) = [i for i, line in enumerate(apart.output.splitlines())
                  if line.startswith("verdict:")]
    note = apart.output.splitlines()[verdict + 1]
    assert note.startswith("note: before and after take ") and "two programs" in note
    data = json.loads(run("diff", modules[0], other, "--json").output)
    assert "two programs" in data["programs_differ"]


def test_diff_notes_say_what_they_mean(modules):
    # Before: "the pass's own analysis did not apply" for every module, unexplained.
    text = run("diff", *modules, "--profile", "tpu-v3").output
    assert "did not apply" not in text
    assert "after: weight update counted as the elementwise work downstream" in text
    assert "already sharded" in text


def test_diff_says_where_added_wire_bytes_come_from(modules, tmp_path):
    """Sharded state: the same wire bytes, the note says so and no more. Gathered: the
    optimizer state is all-gathered too, the bytes grow, and the note says why (it said
    "not wire bytes" under a +50% row)."""
    from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding
    from hlo_shard.printer import to_text

    same = run("diff", *modules, "--profile", "tpu-v3").output
    assert "not wire bytes" in same and "bytes added here" not in same
    gathered = tmp_path / "adam.gathered.hlo"
    gathered.write_text(to_text(WeightUpdateSharding(ShardingOptions()).run(
        parse(ADAM)).module))
    data = json.loads(run("diff", modules[0], str(gathered), "--json", "--profile",
                          "tpu-v3").output)
    grew = data["after"]["collective_bytes"] > 1.01 * data["before"]["collective_bytes"]
    text = run("diff", modules[0], str(gathered), "--profile", "tpu-v3").output
    assert grew and "bytes added here gather other values too" in text


def test_commands_default_to_one_profile(modules):
    from hlo_shard.cli.optimize import optimize as optimize_command
    from hlo_shard.profiles import DEFAULT_PROFILE

    assert DEFAULT_PROFILE == "cpu-local"
    assert f"profile {DEFAULT_PROFILE}" in run("report", modules[0]).output
    assert f"profile {DEFAULT_PROFILE}" in run("diff", *modules).output
    # Resolved per module (profiles.detect): DEFAULT_PROFILE for a CPU program.
    (option,) = [p for p in optimize_command.params if p.name == "profile"]
    assert option.default is None


def test_one_profile_resolution():
    from hlo_shard.profiles import DEFAULT_PROFILE, load_profile, resolve_profile

    assert resolve_profile().name == DEFAULT_PROFILE
    assert resolve_profile("tpu-v3") == load_profile("tpu-v3")
    profile = load_profile("h100")
    assert resolve_profile(profile) is profile


def test_step_figure_legend_does_not_cover_the_bars(modules):
    from hlo_shard.profiles import load_profile
    from hlo_shard.reports.content import step_figure
    from hlo_shard.reports.render import pyplot

    plt = pyplot()
    estimates = [estimate(parse(open(p).read()), load_profile("tpu-v3")) for p in modules]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    try:
        step_figure(estimates).draw(ax)
        fig.canvas.draw()
        legend = ax.get_legend().get_window_extent()
        assert legend.x0 >= ax.get_window_extent().x1  # beside the plot, whatever the bars
        for bar in ax.patches:
            box = bar.get_window_extent()
            if box.width and box.height:
                assert not legend.overlaps(box), "the legend covers a bar"
    finally:
        plt.close(fig)


@pytest.mark.parametrize("name", ["spmd/adam.n4.hlo", "spmd/loop_adam.n2.hlo",
                                  "spmd/transformer.n4.hlo"])
def test_memory_plot_and_table_come_from_one_computation(name):
    # Before: the plot (live bytes after each instruction) peaked below the table's
    # "at most … live at once" (live while it runs, callee transients included).
    from pathlib import Path

    from hlo_shard.profiles import load_profile

    path = Path(__file__).resolve().parents[1] / "fixtures" / name
    memory = estimate(parse(path.read_text()), load_profile("tpu-v3")).memory
    assert max(v for _, _, v in memory.curve) == memory.high_water_bytes


# ------------------------------------------------------------ inputs of the estimate


def test_a_planner_error_surfaces_instead_of_the_fallback(monkeypatch):
    # Before: estimate.py swallowed AttributeError/TypeError/ValueError/KeyError from the
    # pass's planner, and a regression of the pass silently turned the report to fallback.
    from hlo_shard.passes.weight_update import analysis

    def broken(*args, **kwargs):
        raise KeyError("a regression in the planner")

    monkeypatch.setattr(analysis, "plan_region", broken)
    with pytest.raises(KeyError, match="regression"):
        analysis.planned_update_regions(parse(ADAM))


def test_the_region_plan_is_what_the_caller_hands_in():
    from hlo_shard.passes.weight_update import planned_update_regions
    from hlo_shard.costmodel.step_time import estimate_step
    from hlo_shard.profiles import load_profile

    module, profile = parse(ADAM), load_profile("tpu-v3")
    assert set(planned_update_regions(module)) == {module.entry.name}
    assert estimate_step(module, profile, planned_update_regions(module)).region_source \
        == "update_region"
    assert estimate_step(module, profile, {}).region_source == "fallback"


def test_parameter_roles_come_from_a_named_manifest_only():
    # Before: the report read fixtures/MANIFEST.json two folders above its input.
    fixture = FIXTURES / "spmd" / "adam.n4.hlo"
    inferred = json.loads(run("report", str(fixture), "--json").output)["parameters"]
    named = json.loads(run("report", str(fixture), "--json", "--fixtures-manifest",
                           str(FIXTURES / "MANIFEST.json")).output)["parameters"]
    assert inferred["param.19"] == "other_parameters"  # the step count: read by nothing else
    assert named["param.19"] == "optimizer_state"


def test_diff_takes_roles_for_the_inputs_the_manifest_describes(modules):
    fixture = FIXTURES / "spmd" / "adam.n4.hlo"
    data = json.loads(run("diff", str(fixture), modules[0], "--json", "--fixtures-manifest",
                          str(FIXTURES / "MANIFEST.json")).output)
    assert data["before"]["parameters"]["param.19"] == "optimizer_state"
    inferred = json.loads(run("report", modules[0], "--json").output)["parameters"]
    assert data["after"]["parameters"] == inferred


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"), ("{}", "no entry 'spmd/adam.n4.hlo'")])
def test_bad_manifest_is_one_line_and_exit_2(tmp_path, text, message):
    manifest = tmp_path / "MANIFEST.json"
    manifest.write_text(text)
    result = CliRunner().invoke(main, ["report", str(FIXTURES / "spmd" / "adam.n4.hlo"),
                                       "--fixtures-manifest", str(manifest)])
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output


def test_device_count_is_replicas_times_partitions():
    module = parse(ADAM)
    module.header["replica_count"], module.header["num_partitions"] = 2, 4
    assert module.device_count == 8


# ---------------------------------------------------------------------------- scale


def test_scale_refuses_an_already_sharded_module_and_names_the_profile(modules):
    # Before: "saving 0.0%" for the module optimize had written.
    result = CliRunner().invoke(main, ["scale", modules[1], "--replicas", "8"])
    assert result.exit_code == 2 and "already weight-update sharded" in result.stderr
    table = run("scale", modules[0], "--replicas", "8").output
    assert "Projected step time and peak memory (profile tpu-v3)" in table


def test_scale_says_what_a_collective_over_other_groups_runs_over(tmp_path):
    """A microbatch split resharded by an all-to-all over half the devices (GSPMD's
    reshape, as MaxText's gradient accumulation writes it): scale cannot project it and
    says over what it runs and what the other commands still do (it said only that it
    supports one group)."""
    text = ADAM.replace("  y = f32[8,1024] dot(x, w)",
                        "  xs = f32[8,1024] all-to-all(x), replica_groups={{0,1},{2,3}}, "
                        "dimensions={0}\n  y = f32[8,1024] dot(xs, w)")
    path = tmp_path / "resharded.hlo"
    path.write_text(text)
    result = CliRunner().invoke(main, ["scale", str(path), "--replicas", "8"])
    assert result.exit_code == 2
    assert "xs: scale projects steps whose every collective runs over the one data-parallel " \
        "group of all 4 devices, and this all-to-all runs over 2 groups of 2 devices" \
        in result.stderr, result.stderr
    assert "report, optimize and verify take the module at its own size" in result.stderr


def test_retarget_changes_only_the_group():
    module = parse(ADAM)
    assert data_parallel_size(module) == 4
    bigger = retarget(module, 64)
    assert bigger.replica_count == 64 and data_parallel_size(bigger) == 64
    assert len(bigger.entry.instructions) == len(module.entry.instructions)


def test_scale_table_and_json(modules, tmp_path):
    plot = tmp_path / "s.png"
    result = run("scale", modules[0], "--replicas", "4,64,1024", "--plot", str(plot))
    assert result.exit_code == 0
    assert "re-run at each replica count" in result.output
    assert plot.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(run("scale", modules[0], "--replicas", "4,1024", "--json").output)
    small, large = data["points"]
    assert small["replicas"] == 4 and large["replicas"] == 1024
    assert small["sharded"]["peak_memory_bytes"] > large["sharded"]["peak_memory_bytes"]
    assert all(p["saving"] > 0 for p in data["points"])


def test_strong_scaling_grows_the_update_share(modules):
    data = json.loads(run("scale", modules[0], "--replicas", "8,64,512", "--json",
                          "--batch-per-replica", "global=4096").output)
    shares = [p["original"]["weight_update_share"] for p in data["points"]]
    savings = [p["saving"] for p in data["points"]]
    assert shares == sorted(shares) and savings == sorted(savings)


def test_parameters_scale_the_per_parameter_work(modules):
    # k times the weights: update and collective bandwidth × k, forward/backward × k.
    args = ("scale", modules[0], "--replicas", "8", "--json", "--profile", "tpu-v3")
    base = json.loads(run(*args).output)["points"][0]
    weights = 1024 * 1024  # ADAM's one weight (test_cost)
    data = json.loads(run(*args, "--parameters", str(10 * weights)).output)
    assert data["parameters"] == 10 * weights and "analytically" in data["method"]
    big = data["points"][0]
    for module in ("original", "sharded"):
        a, b = base[module]["seconds_by_category"], big[module]["seconds_by_category"]
        assert b["weight_update"] == pytest.approx(10 * a["weight_update"], rel=1e-6)
        assert b["forward_backward"] == pytest.approx(10 * a["forward_backward"], rel=1e-6)
        assert a["communication"] < b["communication"] < 10 * a["communication"] + 1e-3
    assert big["saving"] > base["saving"]


#: A gradient finished early in the backward pass, padded (1023 over 4 devices) into its
#: reduce-scatter once sharded, and live across a later activation (the peak).
EARLY_GRADIENT = """HloModule early, replica_count=4
add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }
ENTRY e { w = f32[1023] parameter(0) x = f32[64,1023] parameter(1), parameter_replication={false}
 z = f32[] constant(0) g = f32[1023] reduce(x, z), dimensions={0}, to_apply=add
 h = f32[64,64] dot(x, x), lhs_contracting_dims={1}, rhs_contracting_dims={1}
 l = f32[] reduce(h, z), dimensions={0,1}, to_apply=add
 ar = f32[1023] all-reduce(g), replica_groups={{0,1,2,3}}, to_apply=add
 nw = f32[1023] subtract(w, ar)
 ROOT t = (f32[1023], f32[]) tuple(nw, l) }
"""


def test_a_reduce_scattered_gradient_stays_gradient_memory():
    # Padded before its reduce-scatter, the per-device gradient is still the gradient
    # (memory that grows with the weights, not with the batch), as when all-reduced.
    from hlo_shard.costmodel.step_time import gradient_values
    from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding

    sharded = WeightUpdateSharding(ShardingOptions(state="sharded")).run(
        parse(EARLY_GRADIENT)).module
    assert [i.opcode for i in sharded.entry.instructions if "g" in i.operands] == ["pad"]
    assert "g" in gradient_values(sharded, sharded.entry)


def test_sharding_does_not_raise_the_projected_peak_of_a_fixed_global_batch():
    # Activations grow with the per-replica batch; counted among them, the sharded
    # module's gradient made its projected peak exceed the original's (the README's
    # 16-replica row: 22.9 → 24.5 GiB).
    from hlo_shard.profiles import load_profile
    from hlo_shard.scaling import project

    for point in project(parse(EARLY_GRADIENT), [4, 16], load_profile("cpu-generic"),
                         global_batch=4096):
        assert point.sharded.peak_memory_bytes < point.original.peak_memory_bytes


def test_a_scaled_peak_is_taken_again_over_the_whole_step():
    """The temp allocation peaks where its scaled categories sum highest: with a larger
    per-replica batch, where the activations are live (it scaled the breakdown of the
    unscaled peak's moment, which the activations may not reach)."""
    from hlo_shard.costmodel.memory import MemoryProfile
    from hlo_shard.profiles import load_profile
    from hlo_shard.scaling import _projection

    profile = MemoryProfile(0, "", {}, 0, 0, 0, 0, 0, "",
                            temp_levels={"activations": [1, 10, 0], "gradients": [8, 0, 2]})
    assert profile.temp_peak_scaled({}) == 10
    assert profile.temp_peak_scaled({"gradients": 4}) == 33
    assert profile.temp_peak_scaled({"activations": 0.5, "gradients": 0.5}) == 5
    # A step whose unscaled peak is the update's temporaries (300 B, step 1) while the
    # activations (100 B) are live at step 0: eight times the batch, step 0 is the peak.
    est = estimate(parse(EARLY_GRADIENT), load_profile("cpu-generic"))
    fixed = est.memory.peak_bytes - est.memory.temp_bytes
    levels = {"activations": [100, 0], "gradients": [0, 0], "temporaries": [0, 300]}
    memory = replace(est.memory, temp_levels=levels, temp_bytes=300, peak_bytes=fixed + 300,
                     peak_breakdown={**est.memory.peak_breakdown, "batch": 0,
                                     "activations": 0, "gradients": 0, "temporaries": 300})
    assert _projection(replace(est, memory=memory), 1.0).peak_memory_bytes == fixed + 300
    assert _projection(replace(est, memory=memory), 8.0).peak_memory_bytes == fixed + 800


def test_scaled_memory_categories_are_liveness_categories():
    from hlo_shard.costmodel.memory import CATEGORIES
    from hlo_shard.scaling import _PARAMETER_MEMORY

    assert set(_PARAMETER_MEMORY) <= set(CATEGORIES)


# ---------------------------------------------------------------------------- units


def test_units():
    assert fmt_seconds(0.0123) == "12.3 ms" and fmt_seconds(4.5e-6) == "4.5 µs"
    assert fmt_bytes(3 * 2 ** 20) == "3 MiB" and fmt_bytes(12) == "12 B"
    # three digits that round to a thousand of one unit read in the next (a probe's
    # "gradient sent 1.01e+03 KiB")
    assert fmt_bytes(1_031_000) == "0.983 MiB" and fmt_seconds(0.99995) == "1 s"
    assert fmt_seconds(999.6e-9) == "1 µs" and fmt_seconds(2e-9) == "2 ns"
    assert fmt_delta(100.0, 50.0, fmt_bytes) == ("−50 B", "−50.0%")
    assert fmt_delta(0.0, 8.0, fmt_bytes) == ("+8 B", "new")
    assert fmt_delta(1.0, 1.0 + 1e-12, fmt_seconds) == ("0", "0.0%")


def test_scale_refuses_a_mesh_of_several_axes_in_one_line():
    path = Path(__file__).parent / "data" / "tp_clip_adam_4x2.n8.hlo"
    result = CliRunner().invoke(main, ["scale", str(path), "--replicas", "16"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: scale projects data-parallel steps only (every all-reduce over the same "
        "devices); this one's run over groups of 2 and 4 devices (a mesh of several axes): "
        "optimize and verify it at its own size instead"]


def test_scale_prints_each_replica_count_once_in_order(modules):
    data = json.loads(run("scale", modules[0], "--replicas", "64,8,64", "--json").output)
    assert [point["replicas"] for point in data["points"]] == [8, 64]


def test_report_of_a_global_program_says_its_figures_are_not_a_devices(modules, tmp_path):
    path = tmp_path / "global.hlo"
    path.write_text("""HloModule g, num_partitions=4
ENTRY e { w = f32[16] parameter(0), sharding={replicated}, frontend_attributes={xla.sdy.sharding="#sdy.sharding<@mesh, [{}]>"}
 ROOT n = f32[16] negate(w) }
""")
    result = run("report", str(path))
    assert "note: this is the global program before SPMD partitioning (%w carries a Shardy " \
           "sharding (xla.sdy.sharding)): its figures are the whole program's" in result.stderr
    assert "global program" not in run("report", modules[0]).stderr


#: A step that reads its updated weight again (an EMA model's loss over the devices, as
#: flax's and optax's EMA examples compute it) and whose learning rate is scaled by an
#: integer step counter the forward pass reads too.
READS_UPDATED = """HloModule ema, replica_count=4, input_output_alias={ {0}: (0, {}, may-alias), {2}: (2, {}, may-alias) }
add { a = f32[] parameter(0) b = f32[] parameter(1) ROOT c = f32[] add(a, b) }
ENTRY e { w = f32[1024] parameter(0) x = f32[1024] parameter(1) c = s32[] parameter(2)
 m = f32[1024] multiply(w, x)
 ar = f32[1024] all-reduce(m), replica_groups={{0,1,2,3}}, to_apply=add
 cf = f32[] convert(c) k = f32[] constant(0.01) lr = f32[] multiply(k, cf)
 b = f32[1024] broadcast(lr), dimensions={}
 u = f32[1024] multiply(ar, b) nw = f32[1024] subtract(w, u)
 one = s32[] constant(1) nc = s32[] add(c, one)
 zero = f32[] constant(0) cg = f32[] convert(c) fb = f32[1024] broadcast(cg), dimensions={}
 mx = f32[1024] multiply(x, fb) sx = f32[] reduce(mx, zero), dimensions={0}, to_apply=add
 ev = f32[1024] multiply(nw, x) se = f32[] reduce(ev, zero), dimensions={0}, to_apply=add
 ae = f32[] all-reduce(se), replica_groups={{0,1,2,3}}, to_apply=add
 ROOT out = (f32[1024], f32[], s32[], f32[]) tuple(nw, ae, nc, sx) }
"""


def test_report_plans_the_update_as_the_pass_does(tmp_path):
    """The report's update region is the pass's: a weight's next value the step reads
    again is an update's (not a batch statistic feeding the EMA loss's sum), and a step
    counter the schedule reads is no weight."""
    path = tmp_path / "ema.hlo"
    path.write_text(READS_UPDATED)
    result = CliRunner().invoke(main, ["report", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["region_source"] == "update_region"
    assert data["parameters"]["w"] == "weights" and "w" in data["weights"]
    assert data["parameters"]["c"] == "other_parameters" and "c" not in data["weights"]


#: A scan over 3 stacked layers as XLA's partitioner leaves it: each iteration
#: all-reduces one layer's gradient and writes it into the stacked gradient the loop
#: carries (slot 2, zeros to start); after the loop, SGD on the stacked weights, which
#: the loop also reads (the forward pass).
SCANNED_LAYERS = """HloModule scan, replica_count=4, input_output_alias={ {0}: (0, {}, may-alias) }
add { a = f32[] parameter(0) b = f32[] parameter(1) ROOT c = f32[] add(a, b) }
body { p = (s32[], f32[3,64], f32[3,64]) parameter(0)
 i = s32[] get-tuple-element(p), index=0 w = f32[3,64] get-tuple-element(p), index=1
 g = f32[3,64] get-tuple-element(p), index=2 z = s32[] constant(0)
 wl = f32[1,64] dynamic-slice(w, i, z), dynamic_slice_sizes={1,64}
 l = f32[64] reshape(wl) sq = f32[64] multiply(l, l)
 ar = f32[64] all-reduce(sq), replica_groups={{0,1,2,3}}, to_apply=add
 r = f32[1,64] reshape(ar) ng = f32[3,64] dynamic-update-slice(g, r, i, z)
 one = s32[] constant(1) ni = s32[] add(i, one)
 ROOT t = (s32[], f32[3,64], f32[3,64]) tuple(ni, w, ng) }
cond { p = (s32[], f32[3,64], f32[3,64]) parameter(0) i = s32[] get-tuple-element(p), index=0
 n = s32[] constant(3) ROOT lt = pred[] compare(i, n), direction=LT }
ENTRY e { w = f32[3,64] parameter(0) zero = f32[] constant(0)
 g0 = f32[3,64] broadcast(zero), dimensions={} i0 = s32[] constant(0)
 init = (s32[], f32[3,64], f32[3,64]) tuple(i0, w, g0)
 loop = (s32[], f32[3,64], f32[3,64]) while(init), condition=cond, body=body
 g = f32[3,64] get-tuple-element(loop), index=2
 lr = f32[] constant(0.01) b = f32[3,64] broadcast(lr), dimensions={}
 u = f32[3,64] multiply(g, b) nw = f32[3,64] subtract(w, u)
 ROOT out = (f32[3,64]) tuple(nw) }
"""


def test_report_counts_a_scans_stacked_weights_and_the_gradients_sent_in_its_loop(tmp_path):
    """Stacked weights whose gradients a scan over layers all-reduces one layer at a time
    (MaxText's ``scan_layers``, flax's ``nn.scan``) are weights, not "other parameters",
    and the bytes of those all-reduces, run once per layer, are each weight's gradient
    traffic, not 0 B."""
    data = _report_json(tmp_path / "scan.hlo", SCANNED_LAYERS)
    assert data["parameters"]["w"] == "weights"
    # one layer's f32[64] per iteration, 3 iterations, 2 (N-1)/N of it sent at N = 4
    assert data["weights"]["w"]["collective_bytes"] == 3 * 2 * 3 / 4 * 64 * 4
    assert data["weights"]["w"]["update_flops"] > 0


#: A gradient that comes out of a tuple before the update reads it (a ``shard_map``
#: returns its loss and gradients in one, the update takes them out).
TUPLE_WRAPPED = """HloModule wrapped, replica_count=4, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }
add { a = f32[] parameter(0) b = f32[] parameter(1) ROOT c = f32[] add(a, b) }
ENTRY e { w = f32[256] parameter(0) m = f32[256] parameter(1)
 x = f32[256] parameter(2), parameter_replication={false}
 g = f32[256] multiply(w, x) ar = f32[256] all-reduce(g), replica_groups={{0,1,2,3}}, to_apply=add
 z = f32[] constant(0) s = f32[] reduce(g, z), dimensions={0}, to_apply=add
 out = (f32[], f32[256]) tuple(s, ar)
 grad = f32[256] get-tuple-element(out), index=1 loss = f32[] get-tuple-element(out), index=0
 k = f32[] constant(0.9) kb = f32[256] broadcast(k), dimensions={}
 mm = f32[256] multiply(m, kb) nm = f32[256] add(mm, grad)
 lr = f32[] constant(0.1) lrb = f32[256] broadcast(lr), dimensions={}
 u = f32[256] multiply(nm, lrb) nw = f32[256] subtract(w, u)
 ROOT t = (f32[256], f32[256], f32[]) tuple(nw, nm, loss) }
"""


def test_report_follows_a_gradient_through_the_tuple_it_comes_out_of(tmp_path):
    """The update reads its gradient out of a tuple (``shard_map``'s outputs): the weight
    and its momentum are classified as such, and the all-reduce before the tuple is the
    weight's gradient traffic (they were "batch", with no per-weight row)."""
    data = _report_json(tmp_path / "wrapped.hlo", TUPLE_WRAPPED)
    assert data["parameters"]["w"] == "weights"
    assert data["parameters"]["m"] == "optimizer_state"
    assert data["weights"]["w"]["collective_bytes"] == 2 * 3 / 4 * 256 * 4


#: A one-element gradient summed before the scalar work of its update (equinox's vmapped
#: bias: the sum reshaped and reduced over its one-row batch).
ONE_ELEMENT = """HloModule one, replica_count=4, input_output_alias={ {0}: (0, {}, may-alias) }
add { a = f32[] parameter(0) b = f32[] parameter(1) ROOT c = f32[] add(a, b) }
ENTRY e { w = f32[1] parameter(0) x = f32[1] parameter(1), parameter_replication={false}
 g = f32[1] multiply(w, x) ar = f32[1] all-reduce(g), replica_groups={{0,1,2,3}}, to_apply=add
 r = f32[1,1] reshape(ar) z = f32[] constant(0)
 s = f32[] reduce(r, z), dimensions={0,1}, to_apply=add
 b = f32[1] reshape(s) lr = f32[] constant(0.1) lrb = f32[1] broadcast(lr), dimensions={}
 u = f32[1] multiply(b, lrb) nw = f32[1] subtract(w, u)
 ROOT t = (f32[1]) tuple(nw) }
"""

#: A ``shard_map`` gradient summed twice: jax's sum of each layer's slice (the transpose
#: of the implicit ``pvary``), padded into the stack the user's ``pmean`` sums again.
SUMMED_SLICES = """HloModule twice, replica_count=4, input_output_alias={ {0}: (0, {}, may-alias) }
add { a = f32[] parameter(0) b = f32[] parameter(1) ROOT c = f32[] add(a, b) }
ENTRY e { w = f32[2,16] parameter(0) x = f32[16] parameter(1), parameter_replication={false}
 w0 = f32[1,16] slice(w), slice={[0:1], [0:16]} w1 = f32[1,16] slice(w), slice={[1:2], [0:16]}
 f0 = f32[16] reshape(w0) f1 = f32[16] reshape(w1)
 g0 = f32[16] multiply(f0, x) g1 = f32[16] multiply(f1, x)
 sa = f32[16] all-reduce(g0), replica_groups={{0,1,2,3}}, to_apply=add
 sb = f32[16] all-reduce(g1), replica_groups={{0,1,2,3}}, to_apply=add
 r0 = f32[1,16] reshape(sa) r1 = f32[1,16] reshape(sb) z = f32[] constant(0)
 p0 = f32[2,16] pad(r0, z), padding=0_1x0_0 p1 = f32[2,16] pad(r1, z), padding=1_0x0_0
 stacked = f32[2,16] add(p0, p1)
 g = f32[2,16] all-reduce(stacked), replica_groups={{0,1,2,3}}, to_apply=add
 lr = f32[] constant(0.1) lrb = f32[2,16] broadcast(lr), dimensions={}
 u = f32[2,16] multiply(g, lrb) nw = f32[2,16] subtract(w, u)
 ROOT t = (f32[2,16]) tuple(nw) }
"""


@pytest.mark.parametrize("text, sent", [
    (ONE_ELEMENT, 2 * 3 / 4 * 4),
    (SUMMED_SLICES, 2 * (2 * 3 / 4 * 16 * 4) + 2 * 3 / 4 * 32 * 4)])
def test_a_weight_is_charged_the_sums_whose_every_path_leads_to_its_update(
        tmp_path, text, sent):
    """A one-element gradient's sum feeds its update through scalar work the per-weight
    walk does not go through; a shard_map gradient's first sums feed, through pads and
    an add, the sum the update reads. Each sum is the weight's traffic all the same
    (both read 0 B, or only the last sum's, before)."""
    data = _report_json(tmp_path / "step.hlo", text)
    assert data["parameters"]["w"] == "weights"
    assert data["weights"]["w"]["collective_bytes"] == pytest.approx(sent)


def test_a_sum_read_towards_several_weights_is_none_of_theirs(tmp_path):
    """A sum whose value reaches two weights' updates (a batch statistic, a shared
    scale) is charged to neither by that rule."""
    text = SUMMED_SLICES.replace(
        "ROOT t = (f32[2,16]) tuple(nw) }",
        "d = f32[16] multiply(sa, v) nv = f32[16] subtract(v, d)\n"
        " ROOT t = (f32[2,16], f32[16]) tuple(nw, nv) }").replace(
        "g0 = f32[16] multiply(f0, x)",
        "v = f32[16] parameter(2) xv = f32[16] multiply(x, v) g0 = f32[16] multiply(f0, xv)"
    ).replace(
        "input_output_alias={ {0}: (0, {}, may-alias) }",
        "input_output_alias={ {0}: (0, {}, may-alias), {1}: (2, {}, may-alias) }")
    data = _report_json(tmp_path / "step.hlo", text)
    assert data["parameters"]["v"] == "weights"
    assert data["weights"]["w"]["collective_bytes"] == pytest.approx(
        2 * 3 / 4 * 16 * 4 + 2 * 3 / 4 * 32 * 4)


def _report_json(path, text: str) -> dict:
    """``report --json`` of the module ``text``, written at ``path``."""
    path.write_text(text)
    result = CliRunner().invoke(main, ["report", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
