"""``hlo-shard optimize``: shard the weight update across the data-parallel replicas.

Reads per-device HLO of a training step, runs the weight-update sharding pass where the
cost model predicts it faster on ``--profile`` (default: the calibrated CPU profile;
:mod:`hlo_shard.passes.speed_gate`) — never writing a module predicted slower than its
input unless ``--force`` — checks
the result (parsed back and validated: def-before-use, unique names, shapes of every op
the pass emits, unique channel ids, replica groups, entry layout) and only then writes
it atomically. A module the validator rejects is never written.

Output streams: the module goes to ``-o`` (``-`` for stdout); a one-line summary and,
with ``--explain``, one row per gradient all-reduce go to **stderr**; ``--json`` prints
the machine-readable report to **stdout** (so it cannot be combined with ``-o -``).
``--verbose`` adds every pass's recorded edits (the Rewriter's change log) to both.

Exit status: 0 when the module was written (whether or not anything was sharded —
``--explain`` says why), 2 on bad input or flags.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from hlo_shard.analysis.collectives import ReasonCode
from hlo_shard.analysis.names import UserNames, labelled, user_names
from hlo_shard.analysis.replication import ParamOverrides
from hlo_shard.cli.app import (check_distinct_outputs, check_output_path, main, read_text,
                               step_input, user_errors, write_outputs)
from hlo_shard.errors import HloShardError
from hlo_shard.ir import Module
from hlo_shard.parser import parse
from hlo_shard.passes.optimize import PassChanges
from hlo_shard.passes.optimize import optimize as run_optimizer
from hlo_shard.passes.speed_gate import SpeedDecision, ratio_words
from hlo_shard.passes.sharded_accumulator import ACCUMULATOR_MODES
from hlo_shard.passes.weight_update import (PARAM_MODES, STATE_MODES, STRATEGIES,
                                             Explanation,
                                             ShardingOptionError, ShardingOptions,
                                             ShardingReport, StrategyChoice)
from hlo_shard.printer import format_change, to_text
from hlo_shard.profiles import DEFAULT_PROFILE, available_profiles, load_profile
from hlo_shard.profiles.detect import profile_for_module
from hlo_shard.units import fmt_seconds
from hlo_shard.validate import check_input

if TYPE_CHECKING:
    from hlo_shard.runtime.manifest import Manifest


def _numbers(text: str | None, flag: str) -> frozenset[int]:
    """Parameter numbers like ``0,3`` or ranges like ``0-24,30`` (inclusive)."""
    if not text:
        return frozenset()
    numbers: set[int] = set()
    try:
        for part in filter(None, text.replace(" ", "").split(",")):
            low, _, high = part.partition("-")
            first, last = int(low), int(high or low)
            if last < first:
                raise ValueError
            numbers.update(range(first, last + 1))
    except ValueError:
        raise HloShardError(f"{flag} expects parameter numbers or ranges like 0,3 or 0-24, "
                            f"not {text!r}") from None
    return frozenset(numbers)


def build_manifest(report: ShardingReport, module: Module, names: UserNames | None = None
                   ) -> Manifest:
    """The runtime's manifest record for the rewritten signature; ``names``: the user's
    names of the original (an output is named by the parameter it is the next value of)."""
    from hlo_shard.runtime.manifest import ArrayRecord, Manifest, Shard

    by_param = names.parameters if names is not None else {}
    by_output = {k: by_param[p] for k, p in report.feedback or () if p in by_param}

    def record(entry: Any, user_name: str) -> ArrayRecord:
        shard = None
        if entry.kind == "sharded":
            shard = Shard(entry.format, entry.groups)
        if not hasattr(entry.shape, "dims"):
            raise HloShardError(f"cannot describe tuple-shaped entry value {entry.name!r} "
                                "in a manifest")
        return ArrayRecord(entry.index, entry.index, entry.kind, entry.shape, entry.name, shard,
                           user_name)

    form = "spmd" if module.num_partitions > 1 else "replica"
    feedback = tuple(report.feedback) if report.feedback else None
    return Manifest(report.devices,
                    tuple(record(p, by_param.get(p.index, "")) for p in report.parameters),
                    tuple(record(o, by_output.get(o.index, "")) for o in report.outputs),
                    feedback, form=form)


def _explain_lines(rows: list[Explanation], names: UserNames) -> list[str]:
    header = ("all-reduce", "shape", "bytes", "sharded", "ops moved", "copies", "saved flops",
              "collective / reason")
    table = [header]
    for row in rows:
        where = row.all_reduce if row.index is None else f"{row.all_reduce}[{row.index}]"
        if row.computation:
            where = f"{row.computation}/{where}"
        weight = names.gradient_of(row.computation, row.all_reduce, row.index, row.reason_code)
        origin = names.moved_from(row.computation, row.all_reduce)
        where = labelled(where, ", ".join(
            words for words in (weight and f"gradient of {weight}",
                                origin and f"moved from {origin}") if words) or None)
        table.append((where, row.shape, str(row.bytes), "yes" if row.sharded else "no",
                      str(row.ops_moved), str(row.formatting_copies), f"{row.saved_flops:.3g}",
                      row.collective if row.sharded else row.reason))
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in table]


def _strategy_lines(choices: list[StrategyChoice]) -> list[str]:
    """Which profile priced the strategies, and each strategy's estimated gradient
    collectives (reduce-scatter + all-gather pairs, bucketing copies included)."""
    lines = []
    for choice in choices:
        figures = "; ".join(
            f"{e.strategy} {e.collectives} pair{'s' if e.collectives != 1 else ''} "
            f"{e.seconds * 1e6:.1f} us{' <- chosen' if e.strategy == choice.chosen else ''}"
            for e in choice.estimates)
        lines.append(f"strategy {choice.strategy} on profile {choice.profile} "
                     f"({choice.devices} devices), {choice.computation}: {figures}")
    return lines


def _speed_lines(decision: SpeedDecision, gradients: int) -> list[str]:
    """``--explain``: the predicted step of the input and of every cut-off tried
    (``gradients``: the report's rows)."""
    lines = [f"predicted step on profile {decision.profile}: input "
             f"{fmt_seconds(decision.before_s)}"]
    if decision.unsharded_s is not None:
        lines.append(f"  nothing sharded, as the pipeline writes it (all-reduces moved out of "
                     f"loops and conditionals, all-reduce + slice pairs made reduce-scatters): "
                     f"{fmt_seconds(decision.unsharded_s)} "
                     f"({_ratio(decision.unsharded_s, decision)})")
    for trial in decision.trials:
        chosen = " <- written" if trial == decision.chosen or decision.forced else ""
        estimated = " (estimated from the cut-offs priced, not rewritten)" \
            if trial.estimated else ""
        lines.append(f"  shard gradients >= {trial.min_bytes} B ({trial.sharded} leaves): "
                     f"{'~' if trial.estimated else ''}{fmt_seconds(trial.seconds)} "
                     f"({_ratio(trial.seconds, decision)}){chosen}{estimated}")
    if decision.moves_only:
        lines.append("  no cut-off predicted faster than that: nothing sharded, the module "
                     "written as the pipeline writes it (--force shards anyway)")
    elif decision.nothing_to_shard:
        lines.append("  nothing to shard: every gradient stays whole for its own reason "
                     "(its row says which)" if gradients else
                     "  nothing to shard: no gradient all-reduce")
    elif decision.kept_whole:
        lines.append(f"  none predicted faster by {decision.min_gain:.0%} or more: module kept whole "
                     "(--force shards anyway)")
    return lines


def _ratio(seconds: float, decision: SpeedDecision) -> str:
    return ratio_words(seconds / decision.before_s, decision) if decision.before_s else "-"


def _speed_summary(decision: SpeedDecision) -> str:
    before, after = decision.before_s, decision.after_s
    figures = (f"{fmt_seconds(before)} -> {fmt_seconds(after)} per step, "
               f"{_ratio(after, decision)}")
    if decision.nothing_to_shard and not decision.moves_written:
        return "nothing to shard (each gradient's row says why)"
    if decision.moves_only:
        return (f"nothing sharded, but the module is changed: its gradient all-reduces "
                f"moved out of accumulation loops or conditionals, or made reduce-scatters "
                f"(--explain's notes say which), predicted {figures} on profile "
                f"{decision.profile}; sharding is not predicted faster still "
                f"(--force shards anyway)")
    if decision.kept_whole:
        best = min(t.seconds for t in decision.priced)
        verdict = "slower" if best >= after else \
            f"less than {decision.min_gain:.0%} faster than the input"
        return (f"kept whole: sharding is predicted {verdict} on profile {decision.profile} "
                f"(best {fmt_seconds(best)} per step against {fmt_seconds(after)} as "
                f"written; --force shards anyway)")
    if decision.forced:
        slower = "; predicted SLOWER, written because of --force" if after > before else ""
        return f"predicted {figures} on profile {decision.profile}{slower}"
    return f"predicted faster on profile {decision.profile} ({figures})"


def _summary(report: ShardingReport, options: ShardingOptions, output: str,
             decision: SpeedDecision) -> str:
    rows = report.explanations
    done = [r for r in rows if r.sharded]
    moved = sum(r.ops_moved for r in done)
    state = sum(1 for p in report.parameters if p.kind == "sharded")
    where = "stdout" if output in (None, "-") else output
    if not rows:
        return f"no gradient all-reduce found; module written unchanged to {where}"
    already = sum(1 for r in rows if r.already_sharded)
    partial = sum(1 for r in rows if r.reason_code == ReasonCode.PARTIAL_SUM.value)
    activations = sum(1 for r in rows if r.reason_code == ReasonCode.ACTIVATION_SUM.value)
    integers = sum(1 for r in rows if r.reason_code == ReasonCode.INTEGER_SUM.value)
    # Gradients the program already reduce-scatters are counted apart from those kept
    # whole: they are not a missed opportunity; nor are the partial sums of their slices,
    # the activations' sums the partitioner reduce-scatters alike, or integer sums.
    scattered = bool(already or activations)  # (partial sums are of their slices)
    parts = [f"{already} already sharded (reduce-scatter form)"] if scattered else []
    parts += [f"{partial} partial sum{'s' if partial > 1 else ''} of their slices (not "
              f"gradients)"] if partial and scattered else []
    parts += [f"{activations} activation sum{'s' if activations > 1 else ''} in the same "
              f"form (not gradients)"] if activations else []
    parts += [f"{integers} integer sum{'s' if integers > 1 else ''} (counts, not "
              f"gradients)"] if integers else []
    kept = len(rows) - len(done) - already - activations - integers - \
        (partial if scattered else 0)
    apart = f"; {', '.join(parts)}, {kept} kept whole" if parts else ""
    text = (f"sharded {len(done)} of {len(rows)} gradient all-reduce leaves "
            f"({sum(r.bytes for r in done)} of {sum(r.bytes for r in rows)} bytes) across "
            f"{report.devices} devices{_groups_words(report)}{apart}; {moved} update ops "
            f"moved; state {options.state}"
            f"{f' ({state} parameters sharded)' if options.state == 'sharded' else ''}; "
            f"strategy {options.strategy}; {_speed_summary(decision)}; wrote {where}")
    return text


def _groups_words(report: ShardingReport) -> str:
    """" (data-parallel groups of 4)" where the gradients are summed over fewer devices
    than the module runs on (a mesh with a model or fsdp axis); "" elsewhere."""
    size = report.group_size
    return f" (data-parallel groups of {size})" if size and size < report.devices else ""


def _change_lines(passes: tuple[PassChanges, ...]) -> list[str]:
    """``--explain --verbose``: each pass of the pipeline and the edits it recorded."""
    lines = []
    for step in passes:
        lines.append(f"changes of pass {step.name}: {len(step.result.changes) or 'none'}")
        lines += [f"  {format_change(change)}" for change in step.result.changes]
    return lines


def _input_lines(picked: str, module: Module) -> list[str]:
    """What optimize says about its input once it has written (an error before is its one
    line): the file of a dump folder it read, and that XLA cannot run an XLA-optimized
    module again (verify refuses it)."""
    lines = [picked] if picked else []
    if module.is_scheduled:
        lines.append("note: this is an XLA-optimized module (is_scheduled=true, an "
                     "*after_optimizations dump): XLA:CPU cannot compile it again, so verify "
                     "cannot run what is written; optimize the per-device module "
                     "(hlo_shard.jax.per_device_hlo, or the *.spmd-partitioner.after_call-"
                     "inliner… dump) to verify it")
    return lines


def global_program_note(module: Module) -> str | None:
    """What to say about a global program (before SPMD partitioning), else None: the
    pass rewrites per-device modules only."""
    from hlo_shard.runtime.forms import global_program_mark

    mark = global_program_mark(module)
    if not mark:
        return None
    return (f"NOTHING TO DO: this is the global program before SPMD partitioning ({mark}); "
            "optimize the per-device module, the *.spmd-partitioner.after_call-inliner… or "
            "*.after_spmd-partitioning dump (hlo_shard.jax.per_device_hlo gives it)")


@main.command()
@click.argument("input_path", metavar="IN.hlo|DUMP_DIR", type=click.Path())
@click.option("-o", "--output", required=True, metavar="OUT.hlo",
              help="Where to write the optimized module ('-' for stdout).")
@click.option("--num-replicas", "-n", type=click.IntRange(min=1), default=None,
              help="Confirm the data-parallel group size (an error if the module disagrees).")
@click.option("--state", type=click.Choice(STATE_MODES), default="gathered", show_default=True,
              help="gathered: same signature; sharded: optimizer state stays in [L] shards.")
@click.option("--params", "params_mode", type=click.Choice(list(PARAM_MODES)), default="gathered",
              show_default=True,
              help="gathered: weights whole; sharded (with --state sharded): weights stay in "
                   "[L] shards too, all-gathered at the top of the step (bf16 where only "
                   "read as bf16).")
@click.option("--accumulator", type=click.Choice(ACCUMULATOR_MODES), default="auto",
              show_default=True,
              help="Gradient accumulation loops: whole (one reduce-scatter after the loop; "
                   "also the sums the program slices per device before accumulating, FSDP's, "
                   "whose loop then carries whole gradients), sharded (one per microbatch "
                   "into an accumulator carried as a shard: 1/N of its memory; FSDP's "
                   "sliced sums stay in the loop), auto (whichever the cost model predicts "
                   "faster, within the profile's device memory).")
@click.option("--strategy", type=click.Choice(STRATEGIES), default="auto", show_default=True,
              help="One collective per gradient, combined buckets, or chosen by cost.")
@click.option("--min-shard-bytes", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leave gradients smaller than this all-reduced.")
@click.option("--profile", default=None, metavar="NAME|FILE",
              help=f"Target hardware auto decides on: {', '.join(available_profiles())}, "
                   f"or a JSON file (as for report). Default: the accelerator's profile where "
                   f"the module's custom-calls name one, else {DEFAULT_PROFILE}.")
@click.option("--bucket-bytes", type=click.IntRange(min=1), default=None,
              help="Largest combined reduce-scatter/all-gather (default: the profile's "
                   "combine threshold, what XLA's combiners use).")
@click.option("--replicated-params", default=None, metavar="LIST",
              help="Entry parameters to treat as replicated (e.g. 0,1,2).")
@click.option("--per-device-params", default=None, metavar="LIST",
              help="Entry parameters to treat as per-device batch data (e.g. 3,4).")
@click.option("--manifest", "manifest_path", default=None, metavar="OUT.json",
              type=click.Path(dir_okay=False),
              help="Write the signature manifest (for verify --manifest).")
@click.option("--explain", is_flag=True, help="One row per gradient all-reduce (stderr).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report on stdout.")
@click.option("--verbose", is_flag=True,
              help="With --explain or --json: every pass's recorded edits, one per line.")
@click.option("--in-place", is_flag=True, help="Allow -o to be the input file.")
@click.option("--force", is_flag=True,
              help="Shard every eligible gradient, even where the cost model predicts the "
                   "step slower on --profile.")
@user_errors
def optimize(input_path: str, output: str, num_replicas: int | None, state: str,
             params_mode: str, accumulator: str, strategy: str,
             min_shard_bytes: int, profile: str | None, bucket_bytes: int | None, replicated_params: str | None,
             per_device_params: str | None, manifest_path: str | None, explain: bool,
             as_json: bool, verbose: bool, in_place: bool, force: bool) -> None:
    """Shard the weight update of IN.hlo across its data-parallel replicas.

    Given an XLA dump folder instead, reads the per-device module of its training step
    (the ``*.spmd-partitioner.after_call-inliner.before_pipeline-end.txt`` stage)."""
    # (said once something is written: an error stays its one line)
    input_path, picked = step_input(input_path)
    if as_json and output == "-":
        raise HloShardError("--json prints to stdout; write the module to a file with -o")
    if verbose and not (explain or as_json):
        raise HloShardError("--verbose adds the passes' edits to --explain or --json; "
                            "give one of them")
    check_output_path(output, [input_path], in_place)
    check_output_path(manifest_path, [input_path])
    check_distinct_outputs({"-o": output, "--manifest": manifest_path})
    overrides = ParamOverrides(_numbers(replicated_params, "--replicated-params"),
                               _numbers(per_device_params, "--per-device-params"))
    if overrides.replicated & overrides.per_device:
        raise HloShardError("a parameter cannot be both --replicated-params and "
                            "--per-device-params")
    requested = None if profile is None else load_profile(profile)  # a bad name: before parsing
    module = parse(read_text(input_path), path=input_path)
    check_input(module, input_path)
    hardware, platform_note = profile_for_module(requested, module)
    if platform_note is not None:
        click.echo(f"note: {platform_note}", err=True)
    params = {p.parameter_number for p in module.entry.parameters()}
    unknown = (overrides.replicated | overrides.per_device) - params
    if unknown:
        raise HloShardError(f"the module has no parameter {', '.join(map(str, sorted(unknown)))}")
    options = ShardingOptions(num_replicas=num_replicas, state=state, params=params_mode,
                              accumulator=accumulator, strategy=strategy,
                              min_shard_bytes=min_shard_bytes, profile=hardware,
                              overrides=overrides)
    if bucket_bytes is not None:  # else the pass's own default: the bucket size is stated once
        options = replace(options, bucket_bytes=bucket_bytes)
    if (note := global_program_note(module)) is not None:
        if manifest_path is not None:
            raise HloShardError(f"{note} (no manifest for a global program)")
        # (not checked: the input as jax lowered it, which our validator may not accept —
        # shard_map's manual bodies repeat a channel id — is not ours to refuse)
        write_outputs([(output, to_text(module, for_xla=True))])
        for line in _input_lines(picked, module):
            click.echo(line, err=True)
        click.echo(f"{note}; module written unchanged to "
                   f"{'stdout' if output == '-' else output}", err=True)
        return
    names = user_names(module) if explain or as_json or manifest_path else UserNames()
    try:
        result = run_optimizer(module, options, force=force, record=verbose)
    except ShardingOptionError as err:  # the library's words → this command's flag
        raise HloShardError(f"--{err.option.replace('_', '-')} {err.value} {err.problem}"
                            ) from None
    report, decision = result.report, result.decision
    assert decision is not None  # the gate ran
    names = replace(names, moved=report.moved_from)  # (read on the input)
    manifest_json = None
    if manifest_path is not None:
        from hlo_shard.runtime.manifest import manifest_to_json

        manifest_json = json.dumps(manifest_to_json(build_manifest(report, module, names)),
                                   indent=2)
    # The report on stdout is one of the outputs: where printing it fails (a full disk,
    # a closed pipe), the files written are put back as they were.
    report_json = result.json_text(names, input=input_path, output=output, state=state,
                                   params=params_mode, accumulator=accumulator,
                                   strategy=strategy, profile=hardware.name,
                                   manifest=manifest_path) + "\n" if as_json else None
    write_outputs([(output, result.text),
                   (manifest_path, None if manifest_json is None else manifest_json + "\n"),
                   ("-", report_json)])
    for line in _input_lines(picked, module):
        click.echo(line, err=True)
    if explain:
        click.echo("\n".join(_explain_lines(report.explanations, names)), err=True)
        for line in _strategy_lines(report.strategies):
            click.echo(line, err=True)
        for line in _speed_lines(decision, len(report.explanations)):
            click.echo(line, err=True)
        for note in report.notes:
            click.echo(f"note: {names.note(note)}", err=True)
        for line in _change_lines(result.changes):
            click.echo(line, err=True)
    click.echo(_summary(report, options, output, decision), err=True)


__all__ = ["build_manifest", "optimize"]
