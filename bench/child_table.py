"""A bench table measured in a child process: jax fixes its device count when it
starts, so the table runs where ``XLA_FLAGS`` gives it ``devices`` CPU devices. The
child prints one row per line as it measures (echoed here as they come) and the whole
table as JSON on its last line. The child times a row's modes step by step in an order
drawn for every step (:func:`drawn_order_rounds`)."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def drawn_order_rounds(names: list[str], runs: int, rounds: int,
                       step: Callable[[str, int], float]) -> dict[str, list[float]]:
    """One untimed round, then ``rounds`` rounds of ``runs`` steps of every one of
    ``names``, interleaved step by step in an order drawn afresh for every step (seeded:
    the same in every run); ``step(name, i)`` runs step ``i`` of ``name`` and returns its
    seconds. Name → the median step of each timed round. In a fixed order the step run
    right after ``shard_weight_update``'s ran up to a third slower (MNIST's kept-whole
    hook, jit's own program, read 1.2-1.4x jit's): a drawn order spreads what one
    program leaves to the next over every row instead of one."""
    order = random.Random(0)
    medians: dict[str, list[float]] = {name: [] for name in names}
    for timed in [False] + [True] * rounds:
        samples: dict[str, list[float]] = {name: [] for name in names}
        for i in range(runs):
            for name in order.sample(names, len(names)):
                samples[name].append(step(name, i))
        if timed:
            for name in names:
                medians[name].append(statistics.median(samples[name]))
    return medians


def run_table(script: Path, argv: list[str], devices: int) -> Any:
    """``script --child *argv`` on ``devices`` CPU devices; its rows echoed, its last line
    parsed. A failing child exits this process with its last error output."""
    started = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    with tempfile.TemporaryFile("w+") as errors:
        child = subprocess.Popen([sys.executable, str(script), "--child", *argv], env=env,
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=errors, text=True)
        last = ""
        assert child.stdout is not None
        for line in child.stdout:  # the rows as they are measured
            if last:
                print(last, end="", flush=True)
            last = line
        if child.wait() != 0:
            errors.seek(0)
            sys.exit(f"bench/{script.name} failed ({child.returncode}):\n"
                     f"{errors.read()[-4000:]}")
    print(f"(table measured in {time.perf_counter() - started:.0f} s)")
    return json.loads(last)


#: A table's columns: (width, alignment) each; width 0 (the last, free text) unpadded.
Columns = tuple[tuple[int, str], ...]


def cells(columns: Columns, *values: str) -> str:
    """One row of a table printed in ``columns``."""
    return " ".join(f"{value:{align}{width}}" if width else value
                    for value, (width, align) in zip(values, columns)).rstrip()

