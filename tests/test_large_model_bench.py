"""``make bench`` part 9, the forms large models train in (``bench/large_model_bench.py``),
runs: the scan-accumulation program at width 16, one round of one step, every mode (the
hook's included) next to jit and NamedSharding, through the same child process ``make
bench`` starts.
No timing is asserted; the figures are whatever this run measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parents[1]
MODES = ["jit", "gathered", "sharded", "sharded, params sharded", "install()",
         "install(), accumulator sharded, forced", "NamedSharding"]


def test_the_scan_accumulation_rows_run():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "large_model_bench.py"),
                          "--programs", "scan-accum", "--width", "16", "--runs", "1",
                          "--rounds", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("scan-accum ")]
    assert [line[14:54].strip() for line in rows] == MODES, run.stdout
    assert "FAILED" not in run.stdout
    for line in rows[1:]:  # the step's metrics are jit's, the pass's decision is said
        assert " same " in line, line
    summary = json.loads(run.stdout.splitlines()[-1])  # the figures, printed last
    figures = summary["scan-accum"]
    assert set(figures) == set(MODES[1:])
    assert figures["NamedSharding"]["ratio_vs_named"] == pytest.approx(1.0)
    # the state carried sharded is smaller than jit's (its metrics are jit's, above)
    assert figures["sharded, params sharded"]["memory"] < figures["gathered"]["memory"]


def test_an_unknown_program_is_refused():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "large_model_bench.py"),
                          "--programs", "pipeline"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "unknown pipeline" in run.stderr
