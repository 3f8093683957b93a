"""The asynchronous forms of a gradient all-reduce (XLA's scheduled modules: GPU's
POST_SCHEDULER stage, a GPU run's dump): ``all-reduce-start``/``all-reduce-done`` and an
all-reduce wrapped by ``async-start``/``async-done`` are recognised as gradient
all-reduces and left with their reason, while the synchronous ones beside them shard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hlo_shard.analysis.collectives import ASYNC_REASONS, find_gradient_all_reduces
from hlo_shard.parser import parse
from hlo_shard.printer import to_text
from wus_helpers import find, optimize, row

ROOT = Path(__file__).resolve().parents[1]
GPU_POST_SCHEDULER = ROOT / "tests" / "golden" / "gpu_async_all_reduce.hlo"
MIXED = ROOT / "tests" / "golden_pass" / "async_all_reduce_forms.hlo"


def test_both_async_forms_are_gradient_all_reduces_left_with_their_reason():
    module = parse(GPU_POST_SCHEDULER.read_text())
    found = {(ar.computation, ar.name): ar for ar in find_gradient_all_reduces(module)}
    assert set(found) == {("wrapped_all_reduce_computation", "all-reduce.3"),
                          ("main.20", "all-reduce-start.1")}
    wrapped = found["wrapped_all_reduce_computation", "all-reduce.3"]
    started = found["main.20", "all-reduce-start.1"]
    assert wrapped.reason == ASYNC_REASONS["async-start"].format(start="all-reduce-start")
    assert started.reason == ASYNC_REASONS["all-reduce-start"]
    assert wrapped.groups is not None and wrapped.groups.size == 2
    assert started.groups is not None and started.groups.size == 2
    assert not wrapped.is_candidate and not started.is_candidate


def test_a_scheduled_gpu_module_goes_through_the_pass_unchanged_and_explained():
    text = GPU_POST_SCHEDULER.read_text()
    module, report = optimize(text, state="gathered")
    assert to_text(module) == to_text(parse(text))
    assert row(report, "all-reduce-start.1").reason == ASYNC_REASONS["all-reduce-start"]
    assert "async-start %all-reduce-start" in row(report, "all-reduce.3").reason
    assert not any(e.sharded for e in report.explanations)


def test_the_synchronous_all_reduce_beside_async_ones_still_shards():
    module, report = optimize(MIXED.read_text(), state="gathered")
    assert row(report, "s0").sharded
    assert not row(report, "start1").sharded and not row(report, "ar").sharded
    assert [i.name for i in find(module, "all-reduce-start")] == ["start1"]
    assert [i.name for i in find(module, "async-start")] == ["start2"]
    assert len(find(module, "reduce-scatter")) == 1


@pytest.mark.slow
def test_the_mixed_module_computes_the_same_on_xla_cpu(tmp_path):
    """XLA CPU compiles and runs both async forms: original and result agree."""
    out = tmp_path / "out.hlo"
    cli = [sys.executable, "-m", "hlo_shard"]
    optimized = subprocess.run([*cli, "optimize", str(MIXED), "--force", "-o", str(out)],
                               capture_output=True, text=True, timeout=300)
    assert optimized.returncode == 0, optimized.stderr
    verified = subprocess.run([*cli, "verify", str(MIXED), str(out), "--per-device-params", "3"],
                              capture_output=True, text=True, timeout=600)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "MATCH" in verified.stdout
