"""The step time of sharding part of the gradients, from the modules priced already.

The never-slower gate chooses a size cut-off: every gradient of at least ``t`` bytes
sharded. Rewriting the module and pricing it for every cut-off costs the whole pipeline
and a whole estimate per cut-off; this prices the cut-offs between from what the gate
priced anyway — the module kept whole and the module with every gradient sharded —
split per gradient, by what drives each part of the change:

* the gradient's own all-reduce, which sharding removes: its exact price in the whole
  module (a tuple all-reduce's price split over its elements by bytes; on shared memory
  each element first keeps the rendezvous it pays alone, so a small gradient kept
  whole is not priced as if it rode along for free);
* the collectives that replace them, the update's work and what the forward pass gains
  or loses: in proportion to the bytes sharded (the reduce-scatter, the all-gather and
  the update on ``[L]`` shards all grow with them), less the new collectives'
  latencies;
* those latencies and the formatting (slices of replicated operands, bucket copies, the
  padding): per gradient sharded, as each adds its own collectives' rendezvous (or its
  share of a bucket's) and its own few small kernels — a gradient of a few bytes costs
  that much, whatever its size.

At no cut-off is this more than an estimate: the gate prices the cut-off it would choose
on its rewritten module before choosing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hlo_shard.costmodel.step_time import StepEstimate


@dataclass(frozen=True)
class ShardedGradient:
    """A gradient the fully sharded module shards: the all-reduce it came from (one
    element of it when a tuple) and its bytes."""

    computation: str
    all_reduce: str
    bytes: int


@dataclass(frozen=True)
class CutoffPrices:
    """Predicted step times of size cut-offs: ``whole_s`` plus, for every gradient the
    cut-off shards, ``per_gradient`` + ``per_byte`` × its bytes − its all-reduce's price
    (a tuple all-reduce's split over its elements by bytes, less the latency each element
    pays alone on shared memory, which is its own)."""

    whole_s: float
    #: (bytes, the price of its all-reduce in the whole module) per gradient.
    gradients: tuple[tuple[int, float], ...]
    per_byte: float
    per_gradient: float

    @classmethod
    def from_estimates(cls, whole: StepEstimate, sharded: StepEstimate,
                       gradients: Sequence[ShardedGradient]) -> CutoffPrices:
        """From the module kept whole, the one with every one of ``gradients`` sharded, and
        those gradients; at the cut-off that shards them all the price is ``sharded``'s."""
        price: dict[tuple[str, str], float] = {}
        #: The latency of a collective whose every array pays its own (on shared memory
        #: each array of a tuple all-reduce is a rendezvous), and its number of arrays.
        rendezvous: dict[tuple[str, str], tuple[float, int]] = {}
        for inst in whole.instructions:
            key = (inst.computation, inst.name)
            price[key] = price.get(key, 0.0) + inst.seconds
            cost = inst.collective
            if cost is not None and cost.algorithm == "shared-memory" and cost.steps:
                rendezvous[key] = (min(inst.seconds, cost.latency_s * inst.runs), cost.steps)
        tuple_bytes: dict[tuple[str, str], int] = {}
        members: dict[tuple[str, str], int] = {}
        for g in gradients:
            key = (g.computation, g.all_reduce)
            tuple_bytes[key] = tuple_bytes.get(key, 0) + g.bytes
            members[key] = members.get(key, 0) + 1
        rows = []
        for g in gradients:
            key = (g.computation, g.all_reduce)
            share = g.bytes / tuple_bytes[key] if tuple_bytes[key] else 1 / members[key]
            paid, arrays = rendezvous.get(key, (0.0, 1))
            rows.append((g.bytes, paid / arrays + (price.get(key, 0.0) - paid) * share))
        latency = sum(min(inst.seconds, inst.collective.latency_s * inst.runs)
                      for inst in sharded.instructions if inst.collective is not None
                      and (inst.computation, inst.name) not in price)
        before, after = whole.seconds_by_category(), sharded.seconds_by_category()
        change = {c: after[c] - before[c] for c in before}
        removed = sum(seconds for _, seconds in rows)
        total_bytes = sum(nbytes for nbytes, _ in rows)
        by_bytes = change["communication"] + removed - latency + change["weight_update"] \
            + change["forward_backward"]
        return cls(whole.seconds, tuple(rows),
                   by_bytes / total_bytes if total_bytes else 0.0,
                   (change["formatting"] + latency) / len(rows) if rows else 0.0)

    def seconds(self, min_bytes: int) -> float:
        """The predicted step with every gradient of at least ``min_bytes`` sharded."""
        return self.whole_s + sum(self.per_gradient + self.per_byte * nbytes - all_reduce
                                  for nbytes, all_reduce in self.gradients
                                  if nbytes >= min_bytes)


__all__ = ["CutoffPrices", "ShardedGradient"]
