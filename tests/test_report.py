"""``hlo-shard report``, ``diff`` and ``scale``: formats, keys, deltas, errors."""

from __future__ import annotations

import base64
from html import escape as html_escape
import json
import re
import sys
from importlib import resources

import pytest
from click.testing import CliRunner

from hlo_shard.cli import main
from hlo_shard.parser import parse
from hlo_shard.report import (
    PLOT_HINT, diff_report, fmt_bytes, fmt_delta, fmt_seconds, render_html, report_document,
)
from hlo_shard.scaling import data_parallel_size, retarget

from test_cost import ADAM

REQUIRED_KEYS = {"flops", "transcendentals", "bytes_accessed", "collective_bytes",
                 "peak_memory_bytes", "estimated_step_seconds"}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """The Adam step and its sharded form (written by the pass, --state sharded)."""
    from hlo_shard.passes.weight_update_sharding import ShardingOptions, WeightUpdateSharding
    from hlo_shard.printer import to_text

    folder = tmp_path_factory.mktemp("modules")
    before = folder / "adam.hlo"
    before.write_text(ADAM)
    sharded = WeightUpdateSharding(ShardingOptions(state="sharded")).apply(parse(ADAM)).module
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
    from hlo_shard.analysis.estimate import estimate_step
    from hlo_shard.profiles import load_profile

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    module = parse(ADAM)
    html = render_html(report_document(estimate_step(module, load_profile("tpu-v3")), module))
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

    from hlo_shard.analysis.estimate import estimate_step, per_weight_rows
    from hlo_shard.passes.weight_update_sharding import ShardingOptions, WeightUpdateSharding
    from hlo_shard.profiles import load_profile

    original = parse(Path("fixtures/spmd/adam.n8.hlo").read_text())
    combined = WeightUpdateSharding(ShardingOptions(strategy="combined")).apply(
        parse(Path("fixtures/spmd/adam.n8.hlo").read_text())).module
    profile = load_profile("cpu-generic")
    before = per_weight_rows(estimate_step(original, profile), original)
    after = per_weight_rows(estimate_step(combined, profile), combined)
    for name, row in before.items():
        elements = row["bytes"] / 4
        shard = -(-elements // 8)  # padded to a multiple of 8 devices
        assert after[name]["update_flops"] == pytest.approx(
            row["update_flops"] * shard / elements, rel=0.1), name
        assert after[name]["collective_bytes"] > 0


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
    row = next(l for l in result.output.splitlines() if l.strip().startswith("w: update flops"))
    assert "−" in row and "%" in row
    assert "reduce-scatter: count" in result.output


def test_diff_report_for_optimize(modules):
    before, after = (parse(open(p).read()) for p in modules)
    text = diff_report(before, after, "tpu-v3")
    assert text.startswith("hlo-shard diff") and "weight update" in text


# ---------------------------------------------------------------------------- scale


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


# ---------------------------------------------------------------------------- units


def test_units():
    assert fmt_seconds(0.0123) == "12.3 ms" and fmt_seconds(4.5e-6) == "4.5 µs"
    assert fmt_bytes(3 * 2 ** 20) == "3 MiB" and fmt_bytes(12) == "12 B"
    assert fmt_delta(100.0, 50.0, fmt_bytes) == ("−50 B", "−50.0%")
    assert fmt_delta(0.0, 8.0, fmt_bytes) == ("+8 B", "new")
    assert fmt_delta(1.0, 1.0 + 1e-12, fmt_seconds) == ("0", "0.0%")
