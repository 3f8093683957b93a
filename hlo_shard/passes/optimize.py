"""The optimizer, one entry point: :func:`optimize`. ``hlo-shard optimize``, the jax
hook (``install()``), ``shard_weight_update`` and ``hlo-shard scale`` all call it and
assemble no passes of their own, so none of them writes or compiles a module the cost
model predicts slower (unless told) or the validator rejects.

What it runs: the sharding pipeline (:mod:`~hlo_shard.passes.sharding_pipeline`) behind
the never-slower gate (:func:`~hlo_shard.passes.speed_gate.shard_where_faster`; ``gate``
False: the pipeline alone, as ``scale`` projects it), for a module compiled as it
stands (:class:`ForExecutable`) the donation passes around it, then the output checks
(validated and printed; for a file, also parsed back).
"""

from __future__ import annotations

import functools

import json
from dataclasses import dataclass, replace
from typing import Any

from hlo_shard.analysis.names import UserNames
from hlo_shard.errors import HloShardError
from hlo_shard.ir import Module
from hlo_shard.parser import cyclic_gc_paused, parse
from hlo_shard.passes.base import Pass, PassResult
from hlo_shard.passes.copy_free_donation import CopyFreeDonation
from hlo_shard.passes.executable_aliases import (ExecutableAliases, NextValueAliases,
                                                 donated_parameters)
from hlo_shard.passes.pipeline import AfterPass, Pipeline
from hlo_shard.passes.replica_form import ReplicaForm
from hlo_shard.passes.sharded_accumulator import ShardedAccumulator
from hlo_shard.passes.sharding_pipeline import run_sharding
from hlo_shard.passes.speed_gate import SpeedDecision, shard_where_faster
from hlo_shard.passes.weight_update import (ShardingOptions, ShardingReport,
                                             WeightUpdateSharding)
from hlo_shard.printer import format_change, to_text
from hlo_shard.validate import validate


@dataclass(frozen=True)
class ForExecutable:
    """The optimized module is compiled as it stands, for a program that donates its
    buffers (``hlo_shard.jax``): its pytrees say which output is each parameter's
    next value, which the pass reads as ``input_output_alias`` (to pair optimizer state
    with its next value); the written module aliases every donated parameter to an
    output of its shape (an alias, unlike a bare ``buffer_donor``, makes the executable
    consume its input), less the aliases that would make XLA copy a weight, and is in
    replica form (what the runtime compiles)."""

    #: (output leaf, entry parameter): the output is the parameter's next value.
    next_values: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class PassChanges:
    """One pass of the run on the module and what it recorded (``--verbose``)."""

    name: str
    result: PassResult[Any]

    def to_json(self) -> dict[str, Any]:
        return {"pass": self.name, "changed": self.result.changed,
                "edits": [{"kind": c.kind, "computation": c.computation, "name": c.name,
                           "text": format_change(c)} for c in self.result.changes]}


@dataclass(frozen=True)
class OptimizeResult:
    """What :func:`optimize` made of a module."""

    #: The module, optimized (the one handed in, edited in place).
    module: Module
    #: Per gradient all-reduce what was done or why not (reason codes), the rewritten
    #: signature, every pass's notes.
    report: ShardingReport
    #: The gate's predicted step times (None: run with ``gate=False``).
    decision: SpeedDecision | None
    #: Every pass run on the module, in order, with its recorded edits (empty unless
    #: asked for: recording makes the gate run the pipeline on the module again
    #: instead of keeping its priced copy).
    changes: tuple[PassChanges, ...] = ()

    @functools.cached_property
    def text(self) -> str:
        """The module's text for a file (``optimize``'s output), validated and parsed
        back (:func:`check_output`), made when first asked for."""
        return check_output(self.module)

    @functools.cached_property
    def xla_text(self) -> str:
        """The module's text for a front end that hands it straight to XLA's parser (the
        hook, the JAX path): validated and printed once, not parsed back here — XLA's
        parse of it is the read-back, and a failure there keeps the step as it was.
        Made when first asked for: a front end that keeps the step whole never prints
        it."""
        return check_output(self.module, parse_back=False)

    @property
    def sharded(self) -> int:
        """Gradient all-reduce leaves sharded."""
        return sum(1 for row in self.report.explanations if row.sharded)

    @property
    def rewritten(self) -> bool:
        """The module is to run as optimized: something sharded, or, sharding nothing,
        its all-reduces moved where that is predicted faster or forced
        (:attr:`~hlo_shard.passes.speed_gate.SpeedDecision.moves_written`). A front end
        that runs its own program otherwise (the hook, ``shard_weight_update``) asks
        this."""
        return self.sharded > 0 or (self.decision is not None and
                                    self.decision.moves_written)

    def to_json(self, names: UserNames | None = None, **fields: Any) -> dict[str, Any]:
        """The report's JSON (``optimize --json``, ``fast.report``): the gate's
        estimates, the strategies priced, one row per gradient (``names``: with the
        user's name of the weight it is the gradient of) and the notes, after the
        caller's own ``fields`` (its input, options, ...); the passes' edits where they
        were recorded. A module without names has rows without ``gradient_of``."""
        report, decision = self.report, self.decision
        # (names read on the input: rows of all-reduces a pass moved go by their origin)
        names = replace(names, moved=report.moved_from) if names is not None else UserNames()
        rows = report.explanations
        return {
            **fields, "devices": report.devices,
            "strategies": [choice.to_json() for choice in report.strategies],
            "speed": None if decision is None else speed_json(decision),
            "sharded": self.sharded,
            "already_sharded": sum(1 for r in rows if r.already_sharded),
            "gradients": len(rows),
            "explanations": [names.explained(r.to_json()) if names else r.to_json()
                             for r in rows],
            "notes": [names.note(note) for note in report.notes],
            # params="sharded": each weight kept as a shard (gathered in which type) or
            # whole, with the user's name where it is known (``name`` is the HLO one).
            "weights": [{**row.to_json(), **({"name": names.parameters[row.parameter],
                                               "hlo_name": row.name}
                                              if row.parameter in names.parameters else {})}
                        for row in report.weights],
            **({"changes": [c.to_json() for c in self.changes]} if self.changes else {}),
        }

    def json_text(self, names: UserNames | None = None, **fields: Any) -> str:
        return json.dumps(self.to_json(names, **fields), indent=2)


def checked_options(options: ShardingOptions) -> ShardingOptions:
    """``options`` checked (an error now, not inside a compile) with the profile loaded:
    what a front end keeps to call :func:`optimize` with later."""
    profile = WeightUpdateSharding(options).profile
    ShardedAccumulator(profile, options.accumulator)  # its mode checked the same way
    return replace(options, profile=profile)


def speed_json(decision: SpeedDecision) -> dict[str, Any]:
    """The never-slower gate's estimates (``decision.to_json()``) and the predicted
    ratio they imply: the written step's over the step as it is, or, where the step was
    kept whole, the fastest sharded candidate's (:attr:`SpeedDecision.predicted_ratio`).
    Predictions, not measurements."""
    return {**decision.to_json(), "predicted_ratio": decision.predicted_ratio}


def optimize(module: Module, options: ShardingOptions, *, force: bool = False,
             after_pass: AfterPass | None = None, gate: bool = True,
             executable: ForExecutable | None = None, record: bool = False,
             write_kept_whole: bool = True) -> OptimizeResult:
    """Optimize ``module`` (in place): shard the gradients whose sharding the cost model
    predicts faster (``force``: every eligible one; ``gate`` False: every eligible one,
    unpriced), then check the result. The options are checked (and the profile loaded)
    before the module is touched. ``after_pass`` sees each pass run on ``module`` (not
    the gate's priced copies); ``record``: the result keeps their edits.
    ``write_kept_whole`` False, for a front end that runs its own program when nothing
    is sharded (the hook, ``shard_weight_update``): a module the gate keeps whole is
    left as it was, its report read from the gate's trials."""
    sharding = WeightUpdateSharding(options)
    with cyclic_gc_paused():  # the gate's copies and pricing as the pipeline's rewrites
        return _optimize(module, sharding, force, after_pass, gate, executable, record,
                         write_kept_whole)


def _optimize(module: Module, sharding: WeightUpdateSharding, force: bool,
              after_pass: AfterPass | None, gate: bool, executable: ForExecutable | None,
              record: bool, write_kept_whole: bool) -> OptimizeResult:
    seen: list[PassChanges] = []

    def watch(step: Pass[Any], result: PassResult[Any]) -> None:
        seen.append(PassChanges(step.name, result))
        if after_pass is not None:
            after_pass(step, result)

    watching = watch if record or after_pass is not None else None
    if executable is not None:
        donors = donated_parameters(module)
        Pipeline((NextValueAliases(executable.next_values),), check=None,
                 after_pass=watching).run(module)
    decision = None
    if gate:
        report, decision = shard_where_faster(module, sharding, force, watching,
                                              write_kept_whole=write_kept_whole)
    else:
        report = run_sharding(module, sharding, watching)
    # (The gate leaves a module it keeps whole as it was unless told to write it or
    # watched: nothing for the donation passes to ready either.)
    left_as_it_was = decision is not None and decision.kept_whole and \
        not decision.moves_only and not write_kept_whole and watching is None
    if executable is not None and not left_as_it_was:
        # The aliases of what the program donates, less those that would make XLA copy
        # a weight, in the form the runtime compiles.
        Pipeline((ExecutableAliases(donors, executable.next_values),
                  CopyFreeDonation(sharding.profile), ReplicaForm(keep_donation=True)),
                 check=None, after_pass=watching).run(module)
    return OptimizeResult(module, report, decision, tuple(seen) if record else ())


def check_output(module: Module, *, parse_back: bool = True) -> str:
    """The module's text for XLA (:func:`~hlo_shard.printer.to_text` ``for_xla``), after
    checking that it validates: the module parsed back from the text (``parse_back``:
    what a written file holds), else the module itself (its text goes to XLA's parser
    next, which reads it back)."""
    text = to_text(module, for_xla=True)
    checked = module
    if parse_back:
        try:
            checked = parse(text, path="<optimized output>")
        except HloShardError as err:
            raise HloShardError(f"refusing to write: the optimized module does not parse "
                                f"back ({err})") from None
    problems = validate(checked)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise HloShardError(f"refusing to write: the optimized module fails validation: "
                            f"{problems[0]}{more}")
    return text


__all__ = ["ForExecutable", "OptimizeResult", "PassChanges", "check_output", "checked_options",
           "optimize",
           "speed_json"]
