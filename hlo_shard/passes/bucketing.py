"""Grouping gradients into collectives: one reduce-scatter/all-gather pair per tensor,
combined buckets, or — ``auto`` — chosen on the α-β model of the *target* hardware profile.

A tensor that shares a bucket saves its own pair's latency (α × steps of a reduce-scatter
and an all-gather on the target's interconnect) and pays the bucketing copies XLA keeps:
the gradient concatenated into the bucket before the reduce-scatter (a copy: it does not
fuse into the dot or reduce producing the gradient) and its piece sliced out of the
gathered bucket (a copy), each reading and writing the tensor once. The concatenation of
the updated shards before the all-gather is free up to 8 shards: XLA:CPU fuses it into the
update's loop (``add_concatenate_fusion`` in the optimized module of the 1024² Adam MLP at
N = 8), which writes its shard into the bucket instead of a buffer of its own (the step's
cost model prices the copy of a wider bucket); the reshapes around the bucket are bitcasts
after layout assignment. ``auto`` combines exactly the tensors whose
latency saved exceeds their copies, so under this model it is never worse than either
fixed strategy. The crossover moves with the hardware (profiles as shipped): ≈ 250 KB on
``cpu-generic`` at any N (one 10 µs rendezvous per collective); on ``tpu-v3`` (1 µs per
torus hop) ≈ 0.9 MB at N = 8 and ≈ 14 MB at N = 1024.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar
from collections.abc import Callable, Sequence

from hlo_shard.costmodel.network import collective_cost
from hlo_shard.profiles import HardwareProfile

Item = TypeVar("Item")

STRATEGIES = ("auto", "per-tensor", "combined")


@dataclass(frozen=True)
class CollectivePricing:
    """What one gradient's collectives and its bucketing copies cost on ``hardware``
    over a group of ``n``."""

    hardware: HardwareProfile
    n: int

    def pair_s(self, nbytes: int) -> float:
        """A reduce-scatter of ``nbytes`` and the all-gather bringing them back."""
        return sum(collective_cost(kind, self.n, nbytes, self.hardware).seconds
                   for kind in ("reduce-scatter", "all-gather"))

    def pair_latency_s(self) -> float:
        return sum(collective_cost(kind, self.n, 0, self.hardware).latency_s
                   for kind in ("reduce-scatter", "all-gather"))

    def bucketing_s(self, nbytes: int) -> float:
        """Copying ``nbytes`` into the gradient bucket and out of the gathered one (each
        copy reads and writes them once; the update's shards fuse into their bucket)."""
        return 2 * self.hardware.memory_seconds(nbytes, nbytes)

    def alone(self, nbytes: int) -> bool:
        """A tensor this large gains nothing from sharing a collective."""
        return self.n <= 1 or self.pair_latency_s() <= self.bucketing_s(nbytes)


@dataclass(frozen=True)
class StrategyEstimate:
    strategy: str
    #: Reduce-scatter/all-gather pairs the gradients take.
    collectives: int
    seconds: float


@dataclass(frozen=True)
class Bucketing:
    """How collectives are grouped: ``per-tensor``, ``combined`` or ``auto`` (a tensor
    alone where :meth:`CollectivePricing.alone` says so, or from ``per_tensor_bytes`` on
    when that is set), buckets of one element type up to ``bucket_bytes``."""

    strategy: str
    bucket_bytes: int
    pricing: CollectivePricing
    per_tensor_bytes: int | None = None

    def alone(self, nbytes: int) -> bool:
        if self.strategy != "auto":
            return self.strategy == "per-tensor"
        if self.per_tensor_bytes is not None:
            return nbytes >= self.per_tensor_bytes
        return self.pricing.alone(nbytes)

    def buckets(self, items: Sequence[Item], size: Callable[[Item], int],
                element_type: Callable[[Item], str]) -> list[list[Item]]:
        out: list[list[Item]] = []
        open_buckets: dict[str, tuple[list[Item], list[int]]] = {}
        for item in items:
            nbytes, etype = size(item), element_type(item)
            if self.alone(nbytes):
                out.append([item])
                continue
            bucket = open_buckets.get(etype)
            if bucket is None or bucket[1][0] + nbytes > self.bucket_bytes:
                bucket = open_buckets[etype] = ([], [0])
                out.append(bucket[0])
            bucket[0].append(item)
            bucket[1][0] += nbytes
        return out

    def estimate(self, sizes: Sequence[tuple[int, str]]) -> StrategyEstimate:
        """Gradients of (bytes, element type): collectives and seconds, this strategy."""
        buckets = self.buckets(sizes, lambda s: s[0], lambda s: s[1])
        seconds = 0.0
        for bucket in buckets:
            nbytes = sum(s[0] for s in bucket)
            seconds += self.pricing.pair_s(nbytes)
            if len(bucket) > 1:
                seconds += self.pricing.bucketing_s(nbytes)
        return StrategyEstimate(self.strategy, len(buckets), seconds)

    def estimates(self, sizes: Sequence[tuple[int, str]]) -> list[StrategyEstimate]:
        """The estimate of every strategy, for ``--explain``."""
        return [replace(self, strategy=s).estimate(sizes) for s in STRATEGIES]


__all__ = ["Bucketing", "CollectivePricing", "STRATEGIES", "StrategyEstimate"]
