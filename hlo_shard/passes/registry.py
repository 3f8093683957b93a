"""Passes by name, and pipelines from a one-line spec (xDSL's pass-pipeline syntax):
``weight-update-sharding{state=sharded strategy=per-tensor},replica-form``.

What the golden pass tests' ``// RUN:`` lines and, later, a command-line
``--passes`` read. Option values are ints when they are digits, strings otherwise;
each pass checks its own options when built.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from hlo_shard.errors import HloShardError
from hlo_shard.passes.accumulation_motion import AccumulationMotion
from hlo_shard.passes.base import Pass
from hlo_shard.passes.channel_dedupe import ChannelIdDedupe
from hlo_shard.passes.conditional_motion import ConditionalMotion
from hlo_shard.passes.conditional_speculation import ConditionalSpeculation
from hlo_shard.passes.copy_free_donation import CopyFreeDonation
from hlo_shard.passes.dead_computations import DeadComputationRemoval
from hlo_shard.passes.entry_layout import EntryLayoutUpdate
from hlo_shard.passes.executable_aliases import ExecutableAliases, NextValueAliases
from hlo_shard.passes.reduce_scatter_creation import ReduceScatterCreation
from hlo_shard.passes.replica_form import ReplicaForm
from hlo_shard.passes.retarget import Retarget
from hlo_shard.passes.sharded_accumulator import ShardedAccumulator
from hlo_shard.passes.tuple_forwarding import TupleForwarding
from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding

#: Option name → value (an int when the text is digits, else the text).
Options = dict[str, Any]

#: Pass name → how to build it from its options.
PASSES: dict[str, Callable[[Options], Pass]] = {
    ConditionalMotion.name: lambda o: ConditionalMotion(**o),
    AccumulationMotion.name: lambda o: AccumulationMotion(**o),
    ConditionalSpeculation.name: lambda o: ConditionalSpeculation(**o),
    TupleForwarding.name: lambda o: _tuple_forwarding(**o),
    WeightUpdateSharding.name: lambda o: WeightUpdateSharding(ShardingOptions(**o)),
    ChannelIdDedupe.name: lambda o: ChannelIdDedupe(**o),
    EntryLayoutUpdate.name: lambda o: EntryLayoutUpdate(**o),
    CopyFreeDonation.name: lambda o: CopyFreeDonation(**o),
    DeadComputationRemoval.name: lambda o: DeadComputationRemoval(**o),
    ReplicaForm.name: lambda o: ReplicaForm(**o),
    ReduceScatterCreation.name: lambda o: ReduceScatterCreation(**o),
    ShardedAccumulator.name: lambda o: ShardedAccumulator(**o),
    Retarget.name: lambda o: Retarget(**o),
    NextValueAliases.name: lambda o: NextValueAliases(_pairs(o.pop("next_values", "")), **o),
    ExecutableAliases.name: lambda o: ExecutableAliases(
        _numbers(o.pop("donors", "")), _pairs(o.pop("next_values", "")), **o),
}


def _numbers(value: str | int) -> tuple[int, ...]:
    """``donors=0,2,3``: the numbers, comma-separated."""
    return tuple(int(n) for n in str(value).split(",") if n)


def _pairs(value: str | int) -> tuple[tuple[int, int], ...]:
    """``next_values=1:0,0:1``: (output leaf, parameter) pairs as ``output:parameter``."""
    try:
        return tuple((int(k), int(p)) for k, _, p in
                     (pair.partition(":") for pair in str(value).split(",") if pair))
    except ValueError:
        raise HloShardError(f"expects output:parameter pairs like 1:0,0:1, not {value!r}"
                            ) from None


def _tuple_forwarding(computations: str | None = None, **options: Any) -> TupleForwarding:
    """``tuple-forwarding{computations=body,e}``: the names, comma-separated."""
    names = None if computations is None else tuple(str(computations).split(","))
    return TupleForwarding(names, **options)


_STEP = re.compile(r"\s*([\w-]+)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


def parse_pipeline(spec: str) -> list[Pass]:
    """The passes of ``spec``, built (so option errors surface here)."""
    passes: list[Pass] = []
    position = 0
    while position < len(spec):
        match = _STEP.match(spec, position)
        if match is None or match.end() == position:
            raise HloShardError(f"bad pass pipeline at column {position + 1}: {spec!r}")
        name, options = match.group(1), match.group(2) or ""
        if name not in PASSES:
            raise HloShardError(f"unknown pass {name!r} (one of {', '.join(sorted(PASSES))})")
        try:
            passes.append(PASSES[name](_options(options)))
        except TypeError as err:
            raise HloShardError(f"pass {name}: {err}") from None
        position = match.end()
    return passes


def _options(text: str) -> Options:
    options: Options = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep:
            raise HloShardError(f"pass option {item!r} is not key=value")
        options[key.replace("-", "_")] = int(value) if value.isdigit() else value
    return options


__all__ = ["PASSES", "parse_pipeline"]
