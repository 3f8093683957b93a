"""The weight-update sharding as the optimizer runs it: eleven passes in order.

0. :class:`~hlo_shard.passes.conditional_motion.ConditionalMotion` (gradients every
   branch of a conditional all-reduces are all-reduced once, after it: a model with a
   ``lax.cond`` differentiates into one, and the sharding reads the sums of the
   computation the update runs in; first, so that a sum it moves out of a loop's body
   can then leave the loop);
1. :class:`~hlo_shard.passes.accumulation_motion.AccumulationMotion` (gradients summed
   over microbatches in a loop are all-reduced once, after it: the sharding then sees
   one all-reduce per gradient feeding the update, and a microbatch's gradient bytes
   cross the network once per step instead of once per microbatch; unless the
   accumulator mode is ``sharded``, also the sums the loop cuts to this device's slice,
   by default where the device's memory allows);
2. :class:`~hlo_shard.passes.conditional_speculation.ConditionalSpeculation` (a
   conditional that reads a gradient of at least the trial's cut-off, its branches pure
   arithmetic — ``optax.apply_if_finite``'s ``lax.cond`` of the update — runs every
   branch and selects the taken one's results, so that the update it holds is in the
   computation the sharding edits; not in the module the speed gate keeps whole);
3. :class:`~hlo_shard.passes.tuple_forwarding.TupleForwarding` on the computations the
   sharding may edit (so the region flows through jax's shard_map tuples);
4. :class:`~hlo_shard.passes.weight_update.WeightUpdateSharding`;
5. :class:`~hlo_shard.passes.reduce_scatter_creation.ReduceScatterCreation` (the
   gradients it found already sharded in the partitioner's all-reduce + dynamic-slice
   form become reduce-scatters where the profile predicts that faster; after the
   sharding, so their rows keep the all-reduce's name and gain the words of the rewrite);
6. :class:`~hlo_shard.passes.sharded_accumulator.ShardedAccumulator` (a reduce-scatter
   of accumulated gradients after their loop moves into it, the accumulator carried as
   a shard, where ``accumulator`` says so: by default where predicted faster);
7. :class:`~hlo_shard.passes.channel_dedupe.ChannelIdDedupe` (after the pass's fresh ids);
8. :class:`~hlo_shard.passes.entry_layout.EntryLayoutUpdate` (a sharded signature);
9. :class:`~hlo_shard.passes.copy_free_donation.CopyFreeDonation` (the aliases that
   would make XLA copy a donated weight every step, on the sharding's profile);
10. :class:`~hlo_shard.passes.dead_computations.DeadComputationRemoval` (the fusion
   bodies the sharded copies replaced).

The pipeline validates the module after every pass that changed it
(:func:`hlo_shard.validate.validate` of the computations the pass's log edited, less
what a later pass repairs and the kinds of problem the input has already: a slip is
named where it happened); the front ends also
check the final module's printed text before writing or compiling it
(:func:`hlo_shard.passes.optimize.check_output`). Validation is linear and a few percent
of ``optimize``, also in the never-slower gate, which runs the pipeline once per cut-off
it prices.
"""

from __future__ import annotations

from dataclasses import replace

from hlo_shard.ir import Module
from hlo_shard.passes.accumulation_motion import AccumulationMotion, AccumulationReport
from hlo_shard.passes.channel_dedupe import ChannelIdDedupe
from hlo_shard.passes.conditional_motion import ConditionalMotion
from hlo_shard.passes.conditional_speculation import ConditionalSpeculation
from hlo_shard.passes.copy_free_donation import CopyFreeDonation
from hlo_shard.passes.dead_computations import DeadComputationRemoval
from hlo_shard.passes.entry_layout import EntryLayoutUpdate
from hlo_shard.passes.pipeline import AfterPass, InputProblems, Pipeline
from hlo_shard.passes.reduce_scatter_creation import ReduceScatterCreation, ReduceScatterReport
from hlo_shard.passes.sharded_accumulator import ShardedAccumulator
from hlo_shard.passes.tuple_forwarding import TupleForwarding
from hlo_shard.passes.weight_update import ShardingReport, WeightUpdateSharding


def sharding_pipeline(sharding: WeightUpdateSharding, after_pass: AfterPass | None = None,
                      *, speculate: bool = True) -> Pipeline:
    """The passes around ``sharding``, each checked by ``validate``; ``after_pass`` sees
    each pass's result (``optimize --explain --verbose`` collects their changes).
    ``speculate`` False: conditionals stay (the module the gate keeps whole: running a
    branch not taken pays only where the update it holds is sharded)."""
    speculation = (ConditionalSpeculation(sharding.options.min_shard_bytes),) if speculate \
        else ()
    return Pipeline((ConditionalMotion(), accumulation_motion(sharding), *speculation,
                     TupleForwarding(), sharding,
                     ReduceScatterCreation(sharding.profile),
                     ShardedAccumulator(sharding.profile, sharding.options.accumulator),
                     ChannelIdDedupe(),
                     EntryLayoutUpdate(), CopyFreeDonation(sharding.profile),
                     DeadComputationRemoval()),
                    after_pass=after_pass)


def unsharded_pipeline(sharding: WeightUpdateSharding, *, branches: bool = True,
                       loops: bool = True, scatters: bool = True) -> Pipeline:
    """The passes of :func:`sharding_pipeline` that change a module whether or not
    anything is sharded (what it writes when nothing is: the speed gate prices that
    module): the motions out of conditionals (``branches``) and accumulation loops
    (``loops``) and the partitioner's pairs made reduce-scatters (``scatters``); a flag
    False leaves out a pass the caller knows has nothing to do. Unchecked: a priced
    copy, never written (the pipeline that writes runs them checked)."""
    chosen = ((ConditionalMotion(), branches), (accumulation_motion(sharding), loops),
              (ReduceScatterCreation(sharding.profile), scatters))
    return Pipeline(tuple(step for step, wanted in chosen if wanted), check=None)


def accumulation_motion(sharding: WeightUpdateSharding) -> AccumulationMotion:
    """The motion as the sharding's accumulator mode asks about the sums the body cuts to
    this device's slice (moved, the loop carries whole gradients): ``whole`` moves them,
    ``auto`` where the modelled peak still fits the profile's device memory, ``sharded``
    keeps them in the loop (its accumulators stay slices)."""
    mode = sharding.options.accumulator
    return AccumulationMotion(sliced=mode != "sharded",
                              memory_bytes=sharding.profile.device_memory_bytes
                              if mode == "auto" else 0,
                              upcast=sharding.profile.upcasts_16bit_floats)


def run_sharding(module: Module, sharding: WeightUpdateSharding,
                 after_pass: AfterPass | None = None,
                 known_problems: InputProblems | None = None, *,
                 speculate: bool = True) -> ShardingReport:
    """:func:`sharding_pipeline` on ``module`` (in place); the sharding's report with
    every pass's notes (what ``--explain`` and ``--json`` show), in pass order.
    ``input_regions`` are ``module``'s, or None. ``known_problems``: the pipeline's
    :meth:`~hlo_shard.passes.pipeline.Pipeline.problems_before` of ``module`` (or of
    the module it is a copy of), where the caller has them. ``speculate``: as for
    :func:`sharding_pipeline`."""
    result = sharding_pipeline(sharding, after_pass, speculate=speculate).run(
        module, known_problems)
    sharded = result.report(ShardingReport)
    # The regions the pass planned are ``module``'s only if no pass before it changed it.
    position = next(k for k, r in enumerate(result.results) if r.report is sharded)
    report = replace(sharded, notes=result.notes,
                     input_regions=None if any(r.changed for r in result.results[:position])
                     else sharded.input_regions)
    result.report(ReduceScatterReport).annotate(report)
    result.report(AccumulationReport).annotate(report)
    # (a sum moved out of nested loops moves loop by loop, inner first: each move's
    # origin is the input's all-reduce the move before it stood for)
    for move in result.report(AccumulationReport).moved:
        if (origin := move.origin) is not None:
            report.moved_from[move.computation, move.after] = \
                report.moved_from.get(origin, origin)
    return report


__all__ = ["accumulation_motion", "run_sharding", "sharding_pipeline", "unsharded_pipeline"]
