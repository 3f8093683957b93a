"""The model zoo (issue 12): does ``optimize`` pay off on models it had never seen?

Every model of ``scripts/zoo_models.py`` (conv net, transformer block, LayerNorm MLP ×
Adam, AdamW + clipping, Lion, LAMB, Adafactor, momentum) at N = 4 and 8, and the bench's
update-heavy MLP (Adam, SGD; N = 8, the committed fixtures), is dumped from
its real JAX + optax step (cached in ``bench/out/zoo``), optimized as a user would run
it (the default profile, both ``--state`` modes), verified (one step, every output
leaf) and timed against the original in interleaved rounds. Per module: the predicted
ratio optimized ÷ original on the profile that decided, and the measured one (median
round). A module the cost model keeps whole is the original computation: its ratios
are 1.00 by construction and it is not timed. Goals: no module above 1.00× predicted,
none above 1.05× measured, geometric mean of the measured ratios ≤ 0.85 at N = 8.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
ZOO_OUT = ROOT / "bench" / "out" / "zoo"
STATES = ("gathered", "sharded")
TARGETS = {"zoo: highest predicted": 1.00, "zoo: highest measured": 1.05,
           "zoo: geomean measured, N=8": 0.85}


@dataclass
class Row:
    model: str
    devices: int
    predicted: dict[str, float] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)
    sharded: dict[str, int] = field(default_factory=dict)
    match: dict[str, bool] = field(default_factory=dict)
    #: The original's step: predicted on the profile, measured (median round; 0: not timed).
    original_predicted_s: float = 0.0
    original_measured_s: float = 0.0


#: The bench's own update-heavy models join the zoo (committed fixtures, N = 8 only).
BENCH_MODELS = ("mlp_adam", "mlp_sgd")


def zoo_modules(out: Path = ZOO_OUT) -> list[tuple[str, int, Path]]:
    """(model, N, SPMD module) for the whole zoo, dumped once and reused. A dump is
    named after its generators' source digest too: one written by older model code is
    not reused."""
    sys.path[:0] = [str(ROOT / "scripts")]
    from hlo_dump import dump_model, source_digest
    from zoo_models import ZOO_MODELS

    out.mkdir(parents=True, exist_ok=True)
    digest = source_digest("zoo_models.py", "fixture_models.py", "hlo_dump.py")
    found = []
    for name, spec in ZOO_MODELS.items():
        for n in spec.devices:
            target = out / f"{name}.{digest}.n{n}.hlo"
            if not (target.is_file() and target.stat().st_size):
                work = Path(tempfile.mkdtemp(prefix=f"hlo-shard-zoo-{name}-"))
                try:
                    dump = dump_model(name, n, work, stop_after_hlo=True)
                    partial = target.with_name(target.name + ".partial")
                    shutil.copyfile(dump.spmd, partial)
                    partial.replace(target)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
            found.append((name, n, target))
    return found + [(name, 8, ROOT / "fixtures" / "spmd" / f"{name}.n8.hlo")
                    for name in BENCH_MODELS]


def measure(model: str, n: int, path: Path, work: Path, runs: int, rounds: int) -> Row:
    from hlo_shard import optimize, parse_file, runtime
    from hlo_shard.cli.optimize import build_manifest
    from hlo_shard.passes.weight_update import ShardingOptions
    from hlo_shard.runtime.inputs import generate_inputs, parameter_roles

    row = Row(model, n)
    candidates: dict[str, Path] = {}
    for state in STATES:
        module = parse_file(path)
        result = optimize(module, ShardingOptions(state=state))
        report, text, decision = result.report, result.text, result.decision
        row.predicted[state] = decision.after_s / decision.before_s
        row.original_predicted_s = decision.before_s
        row.sharded[state] = sum(1 for r in report.explanations if r.sharded)
        if decision.kept_whole:
            row.measured[state] = 1.0
            continue
        candidate = work / f"{path.stem}.{state}.hlo"
        candidate.write_text(text)
        result = runtime.verify(parse_file(path), parse_file(candidate), runtime.VerifyOptions(
            steps=1, manifest=build_manifest(report, module)))
        row.match[state] = result.ok
        candidates[state] = candidate
    if candidates:
        paths = [path, *candidates.values()]
        executables = [runtime.load(p, donate=True) for p in paths]  # a training loop
        inputs = [generate_inputs(e.module, parameter_roles(e.module), e.devices)
                  for e in executables]
        per_round: list[list[float]] = []
        for _ in range(rounds):
            per_round.append([t.median for t in runtime.time_interleaved(executables, inputs,
                                                                          runs=runs)])
        row.original_measured_s = median(r[0] for r in per_round)
        for k, state in enumerate(candidates, start=1):
            row.measured[state] = median(r[k] / r[0] for r in per_round)
        for executable in executables:
            executable.close()
    return row


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 1.0


def run_zoo(runs: int = 5, rounds: int = 3, devices: tuple[int, ...] = (4, 8),
            log=print) -> dict[str, float]:
    from hlo_shard import runtime
    from hlo_shard.profiles import DEFAULT_PROFILE

    log(f"\n== model zoo: optimized / original step time, predicted (profile "
        f"{DEFAULT_PROFILE}) and measured (median of {rounds} interleaved rounds of {runs})",
        flush=True)
    modules = [m for m in zoo_modules() if m[1] in devices]
    from hlo_shard.errors import HloShardError

    rows: list[Row] = []
    skipped: list[str] = []
    log(f"{'model':24s} {'N':>2s}  {'gathered: pred  meas  shards':28s}  "
        f"{'sharded: pred  meas  shards':28s}  verified")
    with tempfile.TemporaryDirectory(prefix="hlo-shard-zoo-") as tmp:
        try:
            for model, n, path in modules:
                try:
                    row = measure(model, n, path, Path(tmp), runs, rounds)
                except HloShardError as err:  # reported, never hidden
                    log(f"{model:24s} {n:2d}  SKIPPED: {str(err).splitlines()[0]}", flush=True)
                    skipped.append(f"{model}.n{n}")
                    continue
                rows.append(row)
                cells = "  ".join(
                    f"{'':9s}{row.predicted[s]:5.2f} {row.measured[s]:5.2f} {row.sharded[s]:7d}"
                    f"{'':1s}" for s in STATES)
                verdict = ("kept whole" if not row.match else
                           "MATCH" if all(row.match.values()) else "MISMATCH")
                log(f"{model:24s} {n:2d}  {cells}  {verdict}", flush=True)
        finally:
            runtime.shutdown_workers()
    predicted = [r.predicted[s] for r in rows for s in STATES]
    measured = [r.measured[s] for r in rows for s in STATES]
    summary = {"zoo: highest predicted": max(predicted), "zoo: highest measured": max(measured)}
    for n in devices:
        values = [r.measured[s] for r in rows if r.devices == n for s in STATES]
        log(f"N={n}: geometric mean measured {geomean(values):.2f}x, predicted "
            f"{geomean([r.predicted[s] for r in rows if r.devices == n for s in STATES]):.2f}x "
            f"over {len(values)} modules")
        if f"zoo: geomean measured, N={n}" in TARGETS:
            summary[f"zoo: geomean measured, N={n}"] = geomean(values)
    mismatches = [f"{r.model}.n{r.devices}" for r in rows if not all(r.match.values())]
    if mismatches:
        log(f"MISMATCH: {', '.join(mismatches)}")
    if skipped:
        log(f"skipped (could not be read): {', '.join(skipped)}")
    (ZOO_OUT / "last_run.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return summary


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT)]
    for key, value in run_zoo().items():
        print(f"{key:30s} {value:.2f}x   target <= {TARGETS[key]:.2f}x")
