"""The ``make bench`` table of ``hlo_shard.jax`` per model × optimizer × mode
(``bench/jax_models_bench.py``) runs: one small model × one optimizer × both modes at
N = 2, two steps, through the same child process ``make bench`` starts. No timing is
asserted; the figures are whatever this run measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parents[1]


def test_table_runs_one_model_both_modes():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "jax_models_bench.py"),
                          "--devices", "2", "--models", "mlp", "--optimizers", "adam",
                          "--mlp-width", "256", "--runs", "2", "--rounds", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("mlp ") and "params in 8 leaves" in line for line in lines)
    rows = [line.split() for line in lines if line.startswith("mlp     adam")]
    assert [row[2] for row in rows] == ["gathered", "sharded"], run.stdout
    for row in rows:
        jit_ms, fast_ms, ratio = map(float, row[3:6])
        # one round: the ratio of the medians (up to the printed digits)
        assert jit_ms > 0 and ratio == pytest.approx(fast_ms / jit_ms, rel=0.05, abs=0.01)
        assert float(row[10]) > 0 and " ".join(row[11:]).startswith(("sharded ", "kept whole: ")), row
    assert "FAILED" not in run.stdout
    ratios = {row[2]: float(row[5]) for row in rows}
    for mode in ("gathered", "sharded"):  # one row per mode: its geometric mean is its ratio
        assert f"state={mode}: {ratios[mode]:.2f}x over 1 rows" in run.stdout, run.stdout
        assert any(line.startswith(f"jax models geomean, {mode}") for line in lines)
