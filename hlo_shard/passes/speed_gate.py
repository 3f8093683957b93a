"""Never slower: shard only the gradients whose sharding the cost model predicts faster.

The weight-update pass can shard every eligible gradient; whether that pays depends on
the target: each sharded bucket adds a reduce-scatter and an all-gather (two latencies
where the combined all-reduce paid one), formatting copies, and the update's loops lose
their fusion with the forward pass — against the update work divided by N. The benefit
grows with a gradient's size and the cost is mostly per collective, so the choice is a
size cut-off: every gradient of at least ``t`` bytes is sharded. The candidates are the
distinct sizes of the shardable gradients (at most ``MAX_TRIALS``). Every gradient
sharded is priced by running the pass on a copy and pricing the result with
:func:`~hlo_shard.costmodel.step_time.estimate_step` (collectives, copies and kernels as
XLA would fuse them); the cut-offs between are priced from that estimate and the input's,
split per gradient (:class:`~hlo_shard.costmodel.plan_prices.CutoffPrices`: its own
all-reduce, a share per byte, a share per gradient), without rewriting anything. Only the
one predicted fastest is rewritten and priced, and only when it could be the one written
(where it turns out not to pay, the next such one, up to :data:`MAX_GUESSES`).
Rewriting and pricing the whole module is what costs, so the gate does it once or twice
in the usual case, whatever the number of cut-offs, and prices a rewritten copy with the input's cost totals
of the computations the rewrite left as they were (its passes' logs say which).
The fastest cut-off priced is kept (that copy becomes the module), provided it is
predicted faster than the input by at least the profile's ``min_predicted_gain``;
otherwise the module stays as it is. ``force`` shards every eligible gradient as told.

Three passes of the pipeline change the module whether or not anything is sharded: the
gradients' all-reduces move out of conditionals (:mod:`~hlo_shard.passes.conditional_motion`)
and the accumulated ones out of their loops
(:mod:`~hlo_shard.passes.accumulation_motion`), and the partitioner's all-reduce + slice
pairs become reduce-scatters where priced faster
(:mod:`~hlo_shard.passes.reduce_scatter_creation`); where they change something, the
module kept whole is that one and is priced too. A
sharded trial is then kept only when it is also cheaper than that module; the margin
stays against the input, which is what the front ends run when nothing is sharded
(``hlo_shard.jax`` falls back to the caller's jit) unless that module clears the margin
itself (:attr:`SpeedDecision.moves_only`: they run it then).
"""

from __future__ import annotations

from collections.abc import Callable
from copy import copy
from dataclasses import dataclass, replace
from typing import Any

from hlo_shard.analysis.collectives import (ReasonCode, find_gradient_all_reduces,
                                            recovered_device_counts)
from hlo_shard.passes.weight_update import planned_update_regions
from hlo_shard.costmodel.flops import EarlierCosts
from hlo_shard.costmodel.plan_prices import CutoffPrices, ShardedGradient
from hlo_shard.costmodel.step_time import StepEstimate, estimate_step
from hlo_shard.graph import reading_only
from hlo_shard.ir import Module
from hlo_shard.passes.accumulation_motion import AccumulationMotion, loops_all_reduce
from hlo_shard.passes.base import Pass, PassResult
from hlo_shard.passes.conditional_motion import ConditionalMotion, conditionals_all_reduce
from hlo_shard.passes.pipeline import AfterPass, InputProblems, edited_computations
from hlo_shard.passes.reduce_scatter_creation import ReduceScatterCreation
from hlo_shard.passes.sharding_pipeline import (run_sharding, unsharded_pipeline,
                                                sharding_pipeline)
from hlo_shard.passes.tuple_forwarding import TupleForwarding
from hlo_shard.passes.weight_update import (Explanation, ShardingReport, WeightUpdateSharding,
                                            recovered_notes)
from hlo_shard.profiles import HardwareProfile

#: Cut-offs tried at most (spread over the distinct gradient sizes).
MAX_TRIALS = 8
#: Predicted cut-offs rewritten and priced at most, fastest prediction first, until one
#: pays (:func:`_guided`).
MAX_GUESSES = 3


@dataclass(frozen=True)
class Trial:
    """The pass with every gradient of at least ``min_bytes`` sharded, priced."""

    min_bytes: int
    sharded: int
    seconds: float
    #: Predicted by :class:`CutoffPrices`, not rewritten and priced: never chosen.
    estimated: bool = False


@dataclass(frozen=True)
class SpeedDecision:
    """What ``--explain`` shows: the input's and the written module's predicted step,
    on which profile, and every cut-off tried."""

    profile: str
    before_s: float
    after_s: float
    trials: tuple[Trial, ...]
    chosen: Trial | None  #: None: kept whole (nothing predicted faster) or forced
    #: The smallest predicted saving acted on: the profile's ``min_predicted_gain``.
    min_gain: float = 0.0
    forced: bool = False
    #: The module kept whole, when the pipeline changes it without sharding anything
    #: (gradient all-reduces moved out of an accumulation loop); None: the input's.
    unsharded_s: float | None = None

    @property
    def kept_whole(self) -> bool:
        return not self.forced and self.chosen is None

    @property
    def predicted_ratio(self) -> float | None:
        """The written step's predicted time over the step as it is; where the step was
        kept whole, the fastest sharded candidate's (None: nothing to divide by)."""
        sharded = [trial.seconds for trial in self.priced if trial.sharded]
        after = min(sharded) if self.kept_whole and sharded else self.after_s
        return after / self.before_s if self.before_s > 0 else None

    @property
    def moves_only(self) -> bool:
        """Kept whole, but what the pipeline writes sharding nothing (gradient
        all-reduces moved out of accumulation loops and conditionals, all-reduce + slice
        pairs made reduce-scatters) is predicted faster than the input by the smallest
        gain acted on: that module is written, also for a front end that runs its own
        program where nothing changes."""
        return self.kept_whole and self.unsharded_s is not None and \
            self.unsharded_s <= self.before_s * (1 - self.min_gain)

    @property
    def moves_written(self) -> bool:
        """What the pipeline writes sharding nothing changes the input and is to run:
        predicted faster (:attr:`moves_only`), or forced (as told, like every rewrite the
        passes prove: forcing never runs less of the pipeline than the gate would)."""
        return self.moves_only or (self.forced and self.unsharded_s is not None)

    def to_json(self) -> dict:
        return {"profile": self.profile, "before_seconds": self.before_s,
                "after_seconds": self.after_s, "min_gain": self.min_gain, "forced": self.forced,
                "kept_whole": self.kept_whole, "unsharded_seconds": self.unsharded_s,
                "moves_only": self.moves_only,
                "min_shard_bytes": None if self.chosen is None else self.chosen.min_bytes,
                "trials": [{"min_shard_bytes": t.min_bytes, "sharded": t.sharded,
                            "seconds": t.seconds, "estimated": t.estimated}
                           for t in self.trials]}

    @property
    def nothing_to_shard(self) -> bool:
        """No cut-off shards a gradient (every one stays whole for its own reason)."""
        return not any(trial.sharded for trial in self.priced)

    @property
    def priced(self) -> tuple[Trial, ...]:
        """The trials rewritten and priced (the estimated ones left out)."""
        return tuple(t for t in self.trials if not t.estimated)


def shard_where_faster(module: Module, sharding: WeightUpdateSharding, force: bool = False,
                       after_pass: AfterPass | None = None, *, exhaustive: bool = False,
                       write_kept_whole: bool = True) -> tuple[ShardingReport, SpeedDecision]:
    """Run the sharding pipeline on ``module`` (in place) with the cut-off predicted
    fastest, or sharding nothing when nothing is predicted faster than the input
    (``force``: as told). ``after_pass`` sees the passes of the run that edits
    ``module``, not the trials on copies. ``exhaustive``: rewrite and price every
    cut-off instead of predicting those between (what the bench times the guided gate
    against). ``write_kept_whole`` False: a module kept whole is left as it is, for a
    front end that then runs its own program (:func:`_kept_whole_report`)."""
    hardware = sharding.profile

    def at_cutoff(min_bytes: int) -> WeightUpdateSharding:
        return replace(sharding, options=replace(sharding.options, min_shard_bytes=min_bytes))

    # Every run of the pipeline below starts from ``module`` as it is (or a copy): one
    # check of it serves them all, made only if a pass's check finds something.
    known = InputProblems(sharding_pipeline(sharding), module)

    def shard(target: Module, options: WeightUpdateSharding,
              watching: AfterPass | None = None, speculate: bool = True) -> ShardingReport:
        return run_sharding(target, options, watching, known, speculate=speculate)

    #: The cheapest sharded trial so far, its module and report: what the gate writes
    #: when it chooses that cut-off, without running the pipeline on the input again.
    cheapest: tuple[Trial, Module, ShardingReport] | None = None

    #: The notes of the trial sharding everything that are about the input
    #: (:data:`_INPUT_NOTES`), read where a step kept whole is left as it is.
    input_notes: list[str] = []
    leaves_kept_whole = not write_kept_whole and after_pass is None

    def note_input(step: Pass[Any], result: PassResult[Any]) -> None:
        # (the weight-update pass's own notes start with the recovered device counts,
        # read here from ``module``, which the trial leaves as it was)
        notes = recovered_notes(recovered_device_counts(module)) \
            if isinstance(step, WeightUpdateSharding) else \
            getattr(result.report, "notes", None) if step.name in _INPUT_NOTES else None
        input_notes.extend(notes or ())

    def rewritten(min_bytes: int, watching: AfterPass | None = None
                  ) -> tuple[Module, ShardingReport, frozenset[str]]:
        """A copy of ``module`` sharded at the cut-off, its report, and the computations
        the pipeline edited in it (its passes' logs)."""
        candidate = module.clone()
        edited: set[str] = set()

        def collect(step: Pass[Any], result: PassResult[Any]) -> None:
            edited.update(edited_computations(result.changes))
            if watching is not None:
                watching(step, result)

        report = shard(candidate, at_cutoff(min_bytes), collect)
        return candidate, report, frozenset(edited)

    def step_of(candidate: Module, report: ShardingReport, edited: frozenset[str]
                ) -> StepEstimate | None:
        """The price of a copy ``rewritten`` made (None when nothing was sharded), the
        totals of the computations its pipeline left as they were taken from the
        input's."""
        if not any(row.sharded for row in report.explanations):
            return None
        return predicted_step(candidate, hardware, earlier=EarlierCosts(whole.model, edited))

    def priced(min_bytes: int) -> tuple[Module, ShardingReport, StepEstimate | None]:
        candidate, report, edited = rewritten(min_bytes)
        return candidate, report, step_of(candidate, report, edited)

    def ranked(min_bytes: int, candidate: Module, report: ShardingReport,
               estimate: StepEstimate | None) -> Trial:
        """The trial of a priced copy, kept if it is the cheapest sharded one so far."""
        nonlocal cheapest
        sharded = sum(1 for row in report.explanations if row.sharded)
        result = Trial(min_bytes, sharded, baseline if estimate is None else estimate.seconds)
        if sharded and (cheapest is None or _faster(result, cheapest[0])):
            cheapest = (result, candidate, report)
        return result

    def trial(min_bytes: int) -> tuple[Trial, ShardingReport, StepEstimate | None]:
        candidate, report, estimate = priced(min_bytes)
        return ranked(min_bytes, candidate, report, estimate), report, estimate

    def written(chosen: Trial) -> ShardingReport:
        """``module`` as the pipeline writes it at ``chosen``'s cut-off: the trial's own
        module, unless ``after_pass`` must watch the passes run on the input."""
        if cheapest is None or after_pass is not None or cheapest[0] is not chosen:
            return shard(module, at_cutoff(chosen.min_bytes), after_pass)
        module.take_contents(cheapest[1])
        return cheapest[2]

    user_min = sharding.options.min_shard_bytes
    candidate, full, edited = rewritten(user_min, note_input if leaves_kept_whole else None)
    # The input is priced with the regions that trial planned on it where it could tell
    # (the same as planning them again), so the analysis runs once for both; then the
    # trial, the input's totals reused where it left a computation as it was.
    whole = predicted_step(module, hardware, full.input_regions)
    sharded_estimate = step_of(candidate, full, edited)
    first = candidate, full, sharded_estimate
    before = whole.seconds
    unsharded = _unsharded_estimate(module, sharding, whole)
    baseline_estimate = whole if unsharded is None else unsharded
    baseline = baseline_estimate.seconds
    #: What a cut-off must cost at most to be written: the input's step less the
    #: profile's smallest gain acted on.
    bar = before * (1 - hardware.min_predicted_gain)
    #: What it must also undercut: the module kept whole as the pipeline writes it,
    #: except where the user chose accumulators carried as shards (memory over
    #: collectives): the moved loop carries them whole, so it is no alternative then.
    floor = before if sharding.options.accumulator == "sharded" else baseline
    everything = ranked(user_min, *first)
    if force or sharded_estimate is None:
        report = written(everything) if everything.sharded else \
            shard(module, sharding, after_pass, speculate=False)
        return report, SpeedDecision(
            hardware.name, before, everything.seconds, (everything,), None,
            hardware.min_predicted_gain, forced=force, unsharded_s=_seconds(unsharded))
    sizes = sorted({row.bytes for row in full.explanations if row.sharded})
    cutoffs = _spread(sizes[1:], MAX_TRIALS - 1) if len(sizes) > 1 else []
    trials = [everything]
    if exhaustive:
        trials += [trial(cutoff)[0] for cutoff in cutoffs]
    elif cutoffs:
        prices = CutoffPrices.from_estimates(
            baseline_estimate, sharded_estimate,
            [ShardedGradient(row.computation, row.all_reduce, row.bytes)
             for row in full.explanations if row.sharded])
        trials += _guided(cutoffs, prices, everything, bar, floor, trial)
    best = min((t for t in trials if not t.estimated), key=_rank)
    chosen = best if _pays(best, bar, floor) else None
    decision = SpeedDecision(hardware.name, before, baseline if chosen is None else chosen.seconds,
                             tuple(sorted(trials, key=lambda t: -t.min_bytes)), chosen,
                             hardware.min_predicted_gain, unsharded_s=_seconds(unsharded))
    if chosen is None and leaves_kept_whole and not decision.moves_only:
        report = _kept_whole_report(module, full, input_notes)
    elif chosen is None:
        # Kept whole: the pipeline still runs, sharding nothing (its pure simplifications —
        # fresh duplicate channel ids, forwarded tuple elements — make the module valid
        # to write; a front end runs it where its all-reduces moved out of loops or
        # conditionals pay: ``SpeedDecision.moves_only``).
        report = shard(module, at_cutoff(sizes[-1] + 1), after_pass, speculate=False)
    else:
        report = written(chosen)
    _explain_cost_rows(report, decision, user_min, full)
    return report, decision


def not_faster(decision: SpeedDecision | None) -> str:
    """Why the gate kept whole a module it could shard, in one phrase ("sharding is not
    predicted at least 10% faster on profile P (predicted 0.97x the step as it is)"); ""
    where it did not (something sharded, forced, or nothing could be)."""
    if decision is None or not decision.kept_whole or decision.moves_only or \
            decision.nothing_to_shard:
        return ""
    ratio = decision.predicted_ratio
    shown = "infx" if ratio is None else ratio_words(ratio, decision)
    return (f"sharding is not predicted at least {decision.min_gain:.0%} faster on profile "
            f"{decision.profile} (predicted {shown} the step as it is)")


def ratio_words(ratio: float, decision: SpeedDecision) -> str:
    """``ratio`` of the input's step as "0.93x": two decimals, more (up to four) where
    two would show it on the gate's bar (1 less the smallest gain acted on) while it is
    on one side of it (0.9004x is kept whole at 10%: "0.90x" would read as the bar)."""
    bar = 1 - decision.min_gain
    digits = 2
    while digits < 4 and ratio != bar and round(ratio, digits) == round(bar, digits):
        digits += 1
    return f"{ratio:.{digits}f}x"


def _guided(cutoffs: list[int], prices: CutoffPrices, everything: Trial, bar: float,
            baseline: float, trial: Callable[[int], tuple[Trial, ShardingReport,
                                                           StepEstimate | None]]
            ) -> list[Trial]:
    """The ``cutoffs`` below every gradient's, predicted by ``prices``; the one predicted
    fastest is priced on its rewritten module when it could be the one written: predicted
    faster than sharding ``everything`` and clearing the ``bar`` and the ``baseline``
    (:func:`_pays`). A prediction is a share of the trials priced, not a price: where the
    one priced does not pay after all, the next one predicted fastest that could is
    priced too, up to :data:`MAX_GUESSES` (an estimate that would clear the bar is never
    left standing beside a module kept whole for lack of one that does, but for that
    bound)."""
    trials = [Trial(cutoff, sum(1 for nbytes, _ in prices.gradients if nbytes >= cutoff),
                    prices.seconds(cutoff), True) for cutoff in cutoffs]
    for _ in range(MAX_GUESSES):
        guess = min((t for t in trials if t.estimated), key=_rank, default=None)
        if guess is None or not (_faster(guess, everything) and _pays(guess, bar, baseline)):
            break
        priced = trial(guess.min_bytes)[0]
        trials = [priced if t is guess else t for t in trials]
        if _pays(priced, bar, baseline):
            break
    return trials


#: The passes of the sharding pipeline whose notes are about the input as it is, the same
#: whatever is sharded after them (besides the weight-update pass's on the device counts
#: a header lost).
_INPUT_NOTES = frozenset({ConditionalMotion.name, AccumulationMotion.name, TupleForwarding.name,
                          ReduceScatterCreation.name})


def _kept_whole_report(module: Module, everything: ShardingReport,
                       input_notes: list[str]) -> ShardingReport:
    """The report of ``module`` kept whole, read from the trial that sharded
    ``everything`` instead of from one more run of the pipeline: each gradient that
    trial sharded left out by the cut-off (:func:`_explain_cost_rows` then says why),
    every other one with its own reason, and the notes about the input. No signature,
    strategies or notes of the passes that ready a module to write: nothing is written
    (the front end runs its own program)."""
    rows = [copy(row) if not row.sharded else
            Explanation(row.computation, row.all_reduce, row.index, row.shape, row.bytes,
                        sharded=False, reason="left out by the speed gate's size cut-off",
                        reason_code=ReasonCode.BELOW_MIN_SHARD_BYTES.value)
            for row in everything.explanations]
    return ShardingReport(everything.devices, rows, notes=list(input_notes),
                          feedback=list(module.output_aliases().items()) or None,
                          moved_from=dict(everything.moved_from),
                          group_size=everything.group_size)


def _pays(trial: Trial, bar: float, baseline: float) -> bool:
    """``trial`` is worth writing: at or under ``bar`` (the input's step less the
    profile's smallest gain acted on) and cheaper than the module kept whole."""
    return trial.seconds <= bar and trial.seconds < baseline


def _rank(trial: Trial) -> tuple[float, int]:
    """Cheapest first; between equal prices, the one that shards more."""
    return trial.seconds, -trial.sharded


def _faster(trial: Trial, other: Trial) -> bool:
    """``trial`` ranks before ``other`` (:func:`_rank`; the earlier trial wins a tie, as
    ``min`` keeps the first of equals)."""
    return _rank(trial) < _rank(other)


def predicted_step(module: Module, hardware: HardwareProfile,
                   regions: dict[str, frozenset[str]] | None = None, *,
                   earlier: EarlierCosts | None = None) -> StepEstimate:
    """The cost model's step of ``module``, its weight update being the region the pass
    plans in it (``regions``: those already planned, from the pass's report;
    ``earlier``: :func:`~hlo_shard.costmodel.step_time.estimate_step`'s)."""
    with reading_only():  # its analyses share each computation's users and order
        return estimate_step(module, hardware, planned_update_regions(module)
                             if regions is None else regions, earlier=earlier)


def predicted_step_seconds(module: Module, hardware: HardwareProfile) -> float:
    """:func:`predicted_step`'s seconds."""
    return predicted_step(module, hardware).seconds


def _unsharded_estimate(module: Module, sharding: WeightUpdateSharding,
                        whole: StepEstimate) -> StepEstimate | None:
    """The price of what the pipeline writes when it shards nothing — ``module`` with its
    gradients' all-reduces moved out of conditionals and accumulation loops and the
    partitioner's all-reduce + slice pairs made reduce-scatters where priced faster — or
    None when none of that changes it (``whole``: ``module``'s estimate, whose totals it
    reuses where those passes left a computation as it was)."""
    branches = conditionals_all_reduce(module)
    moves = branches or bool(loops_all_reduce(module))
    scatters = any(found.code is ReasonCode.ALREADY_SHARDED
                   for found in find_gradient_all_reduces(module))
    if not (moves or scatters):
        return None
    candidate = module.clone()
    result = unsharded_pipeline(sharding, branches=branches, loops=moves,
                                scatters=scatters).run(candidate)
    if not result.changed:
        return None
    edited = edited_computations([change for run in result.results for change in run.changes])
    return predicted_step(candidate, sharding.profile,
                          earlier=EarlierCosts(whole.model, edited))


def _seconds(estimate: StepEstimate | None) -> float | None:
    return None if estimate is None else estimate.seconds


def _spread(values: list[int], count: int) -> list[int]:
    """At most ``count`` of the sorted ``values``, evenly spread, the largest included."""
    if len(values) <= count:
        return values
    step = (len(values) - 1) / (count - 1)
    return sorted({values[round(k * step)] for k in range(count)})


def _explain_cost_rows(report: ShardingReport, decision: SpeedDecision, user_min: int,
                       everything: ShardingReport) -> None:
    """Gradients left out by the gate's cut-off say why in their own words: kept whole
    for speed, with both predicted step times, where sharding every gradient sharded
    them; otherwise the reason they stay whole whatever the cut-off (no update work
    downstream, unused, ...), read from ``everything`` (the pass at the user's own
    cut-off), which the cut-off's "smaller than --min-shard-bytes" would hide."""
    kept = decision.after_s
    uncut = {(row.computation, row.all_reduce, row.index): row
             for row in everything.explanations}
    for row in report.explanations:
        if row.sharded or row.reason_code != ReasonCode.BELOW_MIN_SHARD_BYTES.value:
            continue
        own = uncut.get((row.computation, row.all_reduce, row.index))
        if own is not None and not own.sharded:  # (below the user's own cut-off: its words)
            row.reason, row.reason_code = own.reason, own.reason_code
            continue
        # The cheapest way to shard this one too: the best cut-off that includes it.
        options = [t for t in decision.priced if t.min_bytes <= row.bytes]
        if not options:
            continue
        alternative = min(options, key=lambda t: t.seconds)
        # Predicted faster, but by less than the profile's error allows acting on.
        small_gain = "" if alternative.seconds >= kept else \
            f", a gain under the {decision.min_gain:.0%} the profile acts on"
        row.reason = (f"kept whole for speed: sharding it predicted "
                      f"{alternative.seconds * 1e3:.4g} ms/step, whole "
                      f"{kept * 1e3:.4g} ms/step{small_gain} (profile {decision.profile})")
        row.reason_code = ReasonCode.KEPT_FOR_SPEED.value


__all__ = ["MAX_GUESSES", "MAX_TRIALS", "SpeedDecision", "Trial", "not_faster", "predicted_step", "ratio_words",
           "predicted_step_seconds", "shard_where_faster"]
