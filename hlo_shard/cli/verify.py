"""``hlo-shard verify``: run modules on N devices and compare what they compute.

Exit status: 0 every output matches (or a single module ran), 1 some output
differs (and nothing else), 2 usage or input errors, including XLA rejecting or
crashing on a module, 3 an internal error (a bug in hlo-shard), 130 interrupted
(Ctrl-C), 143/129 terminated (SIGTERM/SIGHUP).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from hlo_shard import limits
from hlo_shard.cli.app import main, step_input, user_errors
from hlo_shard.errors import HloShardError

if TYPE_CHECKING:
    from hlo_shard.runtime.verification import VerifyReport

EXIT_DIFFERENT = 1
#: The longest --timeout: a week (select() overflows on 1e300, and inf never ends).
MAX_TIMEOUT = 7 * 24 * 3600.0


def _index_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise HloShardError(f"--per-device-params expects numbers like 9,10, not {text!r}") from None


def _number(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}"


def _roles_lines(report: VerifyReport) -> list[str]:
    lines = []
    for role in ("replicated", "per-device"):
        chosen = [r for r in report.roles if r.role == role]
        if chosen:
            sources = sorted({r.source for r in chosen})
            names = ", ".join(f"{r.number} ({r.name})" for r in chosen)
            lines.append(f"  {role}: {names}  [{', '.join(sources)}]")
    return ["inputs:"] + lines


def _table(report: VerifyReport) -> list[str]:
    rows = [("output", "shape", "max abs", "max rel", "Δ rel", "worst dev", "verdict")]
    for leaf in report.final():
        shape = f"{leaf.shape.element_type}[{','.join(map(str, leaf.shape.dims))}]"
        verdict = leaf.verdict
        if not leaf.ok and leaf.mismatched:
            verdict += f" ({leaf.mismatched}/{leaf.compared} elements)"
        if leaf.detail:
            verdict += f": {leaf.detail}"
        rows.append((str(leaf.index), shape, _number(leaf.max_abs), _number(leaf.max_rel),
                     "-" if leaf.update_rtol is None else _number(leaf.update_max_rel),
                     "-" if leaf.worst_device is None else str(leaf.worst_device), verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[6]
            for row in rows]


def _tolerance_line(report: VerifyReport) -> str:
    """Value tolerances per dtype, and those of updates (Δ rel: of the leaf's max|Δ|)."""
    final = report.final()
    values = {leaf.shape.element_type: leaf.tolerance for leaf in final}
    updates = {leaf.shape.element_type: leaf.update_rtol for leaf in final
               if leaf.update_rtol is not None}
    text = "tolerances: " + ", ".join(
        f"{t} rtol {tol.rtol:g} atol {tol.atol:g}" if tol.rtol or tol.atol else f"{t} exact"
        for t, tol in sorted(values.items()))
    if updates:
        from hlo_shard.runtime.compare import UPDATE_ULPS

        text += "; updates Δ: " + ", ".join(f"{t} {rtol:g}·max|Δ| + {UPDATE_ULPS:g} ulp"
                                             for t, rtol in sorted(updates.items()))
    padded = sum(leaf.padding_checked for leaf in final)
    if padded:
        text += f"; padding lanes must be 0 ({padded} checked at the last step)"
    return text


def _measure_lines(report: Any) -> list[str]:
    modules = [("original", report.original)] + (
        [("candidate", report.candidate)] if report.candidate else [])
    lines = []
    if report.original.timing:
        runs = len(report.original.timing.seconds)
        parts = [f"{label} {m.timing.median * 1e3:.3f} ms" for label, m in modules]
        ratio = ""
        if report.candidate:
            ratio = f" (candidate/original {report.candidate.timing.median / report.original.timing.median:.2f}x)"
        lines.append(f"time per step (median of {runs}, interleaved): {', '.join(parts)}{ratio}")
    header = ("memory per device (bytes)", "argument", "output", "alias", "temp", "peak")
    rows = [header] + [(label, str(m.memory.argument), str(m.memory.output), str(m.memory.alias),
                        str(m.memory.temp), "-" if m.memory.peak is None else str(m.memory.peak))
                       for label, m in modules]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in rows]
    return lines


#: Where the pairs fed back were guessed: the step may return its values in another
#: order than it takes them (``step(opt_state, params)`` returning ``params`` first).
_GUESSED = ("; those pairs are a guess: the manifest names no next values (optimize "
            "writes them from its input's input_output_alias, which this one lacks), so "
            "each replicated parameter took the next output of its shape, in order; if the "
            "step returns its values in another order than it takes them, list the right "
            "pairs as the manifest's \"feedback\"")


def _text_report(report: VerifyReport, timed: bool) -> list[str]:
    devices = f"{report.devices} {report.backend} device{'s' if report.devices > 1 else ''}"
    steps = f"{report.steps_run} step{'s' if report.steps_run > 1 else ''}"
    lines = _roles_lines(report)
    if report.feedback and report.steps_run > 1:
        lines.append("fed back between steps: " + ", ".join(
            f"output {o} -> parameter {p}" for o, p in report.feedback))
        if report.resharded:
            lines.append("re-sharded (candidate output and parameter formats differ): "
                         + ", ".join(f"output {o} -> parameter {p}" for o, p in report.resharded))
    if report.regimes:
        lines.append("input regimes by step: " + ", ".join(report.regimes))
    if report.candidate is None:
        lines.append(f"{report.original.name}: compiled and executed on {devices} ({steps})")
        lines.append("outputs:")
        for index, shape in enumerate(report.original.outputs):
            warn = "  (contains NaN/inf)" if index in report.original.nonfinite_outputs else ""
            dims = ",".join(map(str, shape.dims))
            lines.append(f"  {index}  {shape.element_type}[{dims}]{warn}")
    else:
        lines += _table(report)
        lines.append(_tolerance_line(report))
        bad = [leaf for leaf in report.final() if not leaf.ok]
        if report.unlooped:
            lines.append("NOT A LOOP: the candidate's shard parameters are fed outputs of "
                         "another form (" + ", ".join(f"output {o} -> parameter {p}"
                                                       for o, p in report.unlooped)
                         + "): it does not run on its own outputs"
                         + (_GUESSED if report.feedback_guessed else ""))
        if bad:
            step = report.differing[0][0]
            lines.append(f"DIFFERENT: {len(bad)} of {len(report.final())} outputs differ "
                         f"(output {', '.join(str(leaf.index) for leaf in bad)}; first at step {step} "
                         f"of {report.steps_run}) on {devices}")
            if {report.regimes[s - 1] for s, _ in report.differing} == {"wide-range"} and \
                    len(set(report.regimes)) > 1:
                lines.append("note: only the wide-range regime's steps differ. A candidate "
                             "that sums in another order (optimize --explain: sums moved "
                             "out of an accumulation loop) rounds otherwise where such terms "
                             "cancel, beyond what the original's own ill-conditioned "
                             "elements excuse (docs/verify.md, 'Ill-conditioned "
                             "elements'). The other regimes matched.")
        elif not report.unlooped:
            lines.append(f"MATCH: all {len(report.final())} outputs agree on {devices} "
                         f"over {steps}")
        if report.excused:
            lines.append(f"note: {report.excused} update elements excused over the steps: "
                         f"the original itself moves each out of the bound when its inputs "
                         f"move by an ulp (a sum whose terms cancel, divided by a norm of "
                         f"its own size): the order of a sum decides it beyond the bound "
                         f"(docs/verify.md, 'Ill-conditioned elements')")
    if timed or report.candidate is not None:
        lines += _measure_lines(report)
    return lines


def _check_limits(timeout: float, devices: int | None, max_devices: str | None,
                  worker_memory: str | None) -> None:
    """Refuse out-of-range limits before any work; the limits given by flags hold
    for the rest of the command (the workers read them)."""
    if not 1 <= timeout <= MAX_TIMEOUT:  # also refuses nan
        raise HloShardError(f"--timeout must be between 1 and {MAX_TIMEOUT:.0f} seconds, "
                            f"not {timeout}")
    flags: dict[limits.Limit, str | int | None] = {
        limits.DEVICES: max_devices, limits.WORKER_MEMORY: worker_memory}
    for limit, value in flags.items():
        limit.value(value)
    click.get_current_context().with_resource(limits.given_limits(flags))
    if devices is not None:
        limits.DEVICES.check(devices, "--devices")


@main.command()
@click.argument("original", metavar="ORIGINAL.hlo|DUMP_DIR", type=click.Path())
@click.argument("candidate", metavar="[CANDIDATE.hlo]", required=False,
                type=click.Path(dir_okay=False))
@click.option("--devices", "-n", type=click.IntRange(min=1), default=None,
              help="Devices to run on (default: the module's replica_count/num_partitions).")
@click.option("--processes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Local processes joined by jax.distributed, each with devices/processes "
                   "CPU devices (docs/distributed.md).")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Training steps; outputs that correspond to parameters are fed back "
                   "(default: one per input regime with a candidate and --inputs-regime "
                   "all, else 1).")
@click.option("--inputs-regime", "regime", default="all", show_default=True,
              type=click.Choice(["random", "zero-grad", "zero-state", "late-step",
                                 "wide-range", "all"]),
              help="Edge inputs: zero gradients, zero state, saturated step counts, wide "
                   "magnitudes; 'all' takes one per step, in that order, cycling.")
@click.option("--update-rtol", type=click.FloatRange(min=0), default=None,
              help="Tolerance of each fed-back leaf's update Δ = out − in, relative to its "
                   "largest |Δ| (default by dtype).")
@click.option("--rtol", type=click.FloatRange(min=0), default=None,
              help="Relative tolerance for float outputs (default by dtype).")
@click.option("--atol", type=click.FloatRange(min=0), default=None,
              help="Absolute tolerance for float outputs (default by dtype).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the inputs.")
@click.option("--backend", type=click.Choice(["cpu", "gpu", "tpu"]), default="cpu",
              show_default=True, help="Where to run (CPU uses N virtual devices).")
@click.option("--manifest", "manifest_path", metavar="M.json", default=None,
              type=click.Path(dir_okay=False),
              help="How the candidate's arrays map to the original's (written by optimize).")
@click.option("--per-device-params", metavar="I,J", default=None,
              help="Parameters with a different value on each device; all others replicated.")
@click.option("--inputs", "inputs_npz", metavar="X.npz", default=None,
              type=click.Path(dir_okay=False),
              help="Input values: key p<N> or a parameter name; a leading device axis "
                   "gives one value per device.")
@click.option("--time", "time_runs", type=click.IntRange(min=0), default=0, metavar="R",
              help="Also time R runs per module after warm-up, interleaved A/B.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Untimed runs before timing.")
@click.option("--timeout", type=float, default=300, show_default=True,
              help="Seconds allowed for the worker to start and for each compile or run "
                   "before giving up (1 to 604800).")
@click.option("--max-devices", metavar="N", default=None,
              help=f"Refuse to start more devices than this (default "
                   f"{limits.DEVICES.default}, or {limits.DEVICES.env}).")
@click.option("--worker-memory", metavar="SIZE", default=None,
              help="Address-space limit of the execution worker, e.g. 32G or unlimited "
                   f"(default: 3/4 of the machine's memory, or {limits.WORKER_MEMORY.env}).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
@user_errors
def verify(original: str, candidate: str | None, devices: int | None, processes: int,
           steps: int | None, regime: str, update_rtol: float | None,
           rtol: float | None, atol: float | None, seed: int, backend: str,
           manifest_path: str | None, per_device_params: str | None, inputs_npz: str | None,
           time_runs: int, warmup: int, timeout: float, max_devices: str | None,
           worker_memory: str | None, as_json: bool, quiet: bool) -> None:
    """Run ORIGINAL (and CANDIDATE) on the same inputs and compare every output.

    Each output leaf is compared on every device with dtype-aware tolerances, each
    fed-back leaf also by its update Δ = out − in, and the padding lanes of sharded
    outputs must stay zero; the verdict is exit status 0 (match), 1 (differ) or 2
    (error). With one module,
    report that it compiles and runs, and its output shapes.
    """
    from hlo_shard import runtime
    from hlo_shard.runtime.distributed import DistributedWorker

    _check_limits(timeout, devices, max_devices, worker_memory)
    original, picked = step_input(original)
    worker = DistributedWorker(processes, devices, backend, timeout) if processes > 1 else None
    options = runtime.VerifyOptions(
        devices=devices, steps=steps, seed=seed, rtol=rtol, atol=atol, backend=backend,
        update_rtol=update_rtol, regime=regime,
        manifest=runtime.load_manifest(manifest_path) if manifest_path else None,
        per_device_params=_index_list(per_device_params), inputs_npz=inputs_npz,
        time_runs=time_runs, warmup=warmup, timeout=timeout, worker=worker)
    progress = None if quiet else (lambda message: click.echo(message, err=True))
    try:
        report = runtime.verify(original, candidate, options, progress)
    finally:
        if worker is not None:
            worker.close()
    where = {} if worker is None else {"processes": processes,
                                       "coordinator": worker.coordinator}
    if as_json:
        click.echo(json.dumps({**report.to_json(), **where}, indent=2))
    else:
        click.echo("\n".join(_text_report(report, bool(time_runs))))
        if worker is not None:
            click.echo(f"ran in {processes} processes x {report.devices // processes} devices "
                       f"through jax.distributed (coordinator {worker.coordinator})")
    if picked:
        click.echo(picked, err=True)
    if not report.ok:
        sys.exit(EXIT_DIFFERENT)
