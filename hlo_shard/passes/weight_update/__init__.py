"""Cross-replica sharding of the weight update (Xu et al. 2020): one pass, one package.

A module goes through it top-down, each step consuming what the one before decided:

1. :mod:`.sharding` — the pass (:class:`WeightUpdateSharding`), its options and its
   report: reads the module's facts, runs the analysis per computation, hands each plan
   to the lowering, and says per gradient what was sharded or why not;
2. :mod:`.analysis` — the update region: a rule table classifies each user of the reduced
   gradients into a :class:`~.analysis.RegionOp` (its :class:`~.analysis.OpKind` says
   how it runs on shards); the result is an immutable
   :class:`~.analysis.RegionPlan` per computation (leaves, their shard formats, the ops,
   what is kept whole and why);
3. :mod:`.lowering` — rewrites one computation from its plan, op by op on the kind the
   analysis chose (no opcode decided twice);
4. :mod:`.emit` — the instructions themselves: shard format pieces, reduce-scatters,
   all-gathers, channel ids, and how gradients are bucketed into collectives.

What other modules may use is exported here and nowhere else: the pass, its options and
report (and its notes on a header's lost device counts, :func:`recovered_notes`), the
computations it may edit (:func:`rewritten_computations`, for the passes that
run before it), fresh channel ids (:class:`ChannelIds`, for the passes that add
collectives after it), and the region it plans (:func:`planned_update_regions`, for the
cost model's callers). The modules above are the pass's internals.
"""

from __future__ import annotations

from hlo_shard.passes.weight_update.analysis import planned_update_regions
from hlo_shard.passes.weight_update.emit import STRATEGIES, ChannelIds
from hlo_shard.passes.weight_update.sharding import (PARAM_MODES, STATE_MODES, Explanation,
                                                     ShardingOptionError, ShardingOptions,
                                                     ShardingReport, StrategyChoice,
                                                     WeightUpdateSharding, recovered_notes,
                                                     rewritten_computations)

__all__ = [
    "PARAM_MODES", "STATE_MODES", "STRATEGIES", "ChannelIds",
    "Explanation", "ShardingOptionError", "ShardingOptions", "ShardingReport",
    "StrategyChoice", "WeightUpdateSharding", "planned_update_regions",
    "recovered_notes", "rewritten_computations",
]
