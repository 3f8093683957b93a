"""What a collective costs on the network: bytes per device and α-β time.

XLA's cost analysis does not model the network (it prices all-gather and
reduce-scatter at zero flops and default memory bytes), so this is our own model:

* **bytes** each device sends (and receives) for payload S and group size n follow
  nccl-tests' bus-bandwidth accounting, which every algorithm below attains:
  all-reduce 2(n−1)/n·S, reduce-scatter (n−1)/n·S_in, all-gather (n−1)/n·S_out,
  all-to-all (n−1)/n·S, collective-permute S;
* **steps** (each paying the latency α) depend on the algorithm: a ring takes n−1
  steps per reduce-scatter or all-gather phase; a tree (recursive halving/doubling)
  ⌈log₂ n⌉; a k-dimensional torus runs one ring per dimension, Σ(dᵢ−1) steps for
  dimensions dᵢ with Πdᵢ = n. An all-reduce is a reduce-scatter phase plus an
  all-gather phase, which is why weight-update sharding never changes the wire bytes
  and only adds latency (two collectives instead of one);
* **time** = α·steps + bytes/β, with (α, β) of the interconnect level the group
  spans (inside a node or across nodes) from the hardware profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hlo_shard.analysis.collectives import GroupMode, group_mode
from hlo_shard.ir import Instruction, Module, ReplicaGroups, shape_leaves
from hlo_shard.profiles import HardwareProfile

#: Opcode → collective kind as reported (async starts priced, their -done free).
COLLECTIVE_KINDS: dict[str, str] = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
    "collective-broadcast": "collective-broadcast",
}

#: The halves of an async collective that carry no traffic of their own.
COLLECTIVE_DONE_OPCODES = frozenset({
    "all-reduce-done", "all-gather-done", "collective-permute-done",
})

#: Per kind: (number of reduce-scatter/all-gather phases, wire-bytes factor of (n−1)/n·S).
_PHASES: dict[str, int] = {
    "all-reduce": 2, "reduce-scatter": 1, "all-gather": 1, "all-to-all": 1,
    "collective-broadcast": 1,
}


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    kind: str
    group_size: int
    #: The payload S: the full (unsharded) buffer a device contributes or receives.
    payload_bytes: int
    bytes_sent: float
    bytes_received: float
    steps: int
    seconds: float
    algorithm: str
    #: The α part of ``seconds`` (paid once per combined bucket, see :func:`combine`).
    latency_s: float = 0.0


def group_size(inst: Instruction, module: Module) -> int:
    """Devices in each of the collective's groups (the largest group when uneven)."""
    mode = group_mode(inst)
    replicas, partitions = module.replica_count, module.num_partitions
    raw = inst.attr("replica_groups")
    groups = raw.groups if isinstance(raw, ReplicaGroups) else ()
    if inst.opcode.startswith("collective-permute"):
        return 2
    if groups:
        size = max(len(g) for g in groups)
        return size * partitions if mode is GroupMode.CROSS_REPLICA_AND_PARTITION else size
    return {
        GroupMode.CROSS_REPLICA: replicas,
        GroupMode.CROSS_PARTITION: partitions,
        GroupMode.FLATTENED_ID: replicas * partitions,
        GroupMode.CROSS_REPLICA_AND_PARTITION: replicas * partitions,
    }[mode]


def payload_bytes(inst: Instruction, operand_shapes: list) -> int:
    """S: the full buffer — the output of an all-gather, the input otherwise."""
    shapes = [inst.shape] if COLLECTIVE_KINDS[inst.opcode] == "all-gather" else operand_shapes
    if inst.opcode == "all-gather-start":
        shapes = [inst.shape.elements[-1]] if hasattr(inst.shape, "elements") else [inst.shape]
    return sum(leaf.byte_size for shape in shapes for _, leaf in shape_leaves(shape))


def algorithm_steps(kind: str, n: int, algorithm: str) -> int:
    """Latency-bearing steps of one collective of ``kind`` over ``n`` devices."""
    if n <= 1:
        return 0
    if kind == "collective-permute":
        return 1
    phases = _PHASES[kind]
    if algorithm == "tree":
        return phases * math.ceil(math.log2(n))
    if algorithm.startswith("torus"):
        return phases * sum(d - 1 for d in torus_dims(n, int(algorithm[5])))
    return phases * (n - 1)


def torus_dims(n: int, k: int) -> list[int]:
    """A near-cubic factorisation of n into k dimensions (largest first)."""
    dims = []
    remaining = n
    for left in range(k, 0, -1):
        target = round(remaining ** (1 / left))
        d = next((c for c in range(max(target, 1), remaining + 1) if remaining % c == 0), remaining)
        dims.append(d)
        remaining //= d
    return sorted(dims, reverse=True)


def wire_bytes(kind: str, n: int, payload: int) -> float:
    """Bytes each device sends (= receives) for one collective."""
    if n <= 1:
        return 0.0
    if kind == "collective-permute":
        return float(payload)
    return _PHASES[kind] * (n - 1) / n * payload


def collective_cost(kind: str, n: int, payload: int, profile: HardwareProfile,
                    algorithm: str | None = None) -> CollectiveCost:
    algorithm = algorithm or profile.interconnect.algorithm
    link = profile.interconnect.link_for(n)
    steps = algorithm_steps(kind, n, algorithm)
    sent = wire_bytes(kind, n, payload)
    latency = steps * link.alpha_s
    return CollectiveCost(kind, n, payload, sent, sent, steps,
                          latency + sent / link.beta_bytes_per_s, algorithm, latency)


def combine(costs: list[CollectiveCost], threshold_bytes: int) -> list[float]:
    """Seconds of each of ``costs`` — independent collectives of one kind and group, in
    program order — once XLA's collective combiner has packed them into buckets of up
    to ``threshold_bytes``: a bucket pays the latency of one collective, shared among
    its members by payload; bandwidth time is unchanged."""
    seconds = [c.seconds - c.latency_s for c in costs]
    bucket: list[int] = []
    size = 0

    def close() -> None:
        payload = sum(costs[i].payload_bytes for i in bucket) or 1
        latency = max(costs[i].latency_s for i in bucket)
        for i in bucket:
            seconds[i] += latency * (costs[i].payload_bytes or 1 / len(bucket)) / payload

    for index, cost in enumerate(costs):
        if bucket and size + cost.payload_bytes > threshold_bytes:
            close()
            bucket, size = [], 0
        bucket.append(index)
        size += cost.payload_bytes
    if bucket:
        close()
    return seconds


def instruction_collective_cost(inst: Instruction, module: Module, operand_shapes: list,
                                profile: HardwareProfile, *,
                                algorithm: str | None = None) -> CollectiveCost:
    """The network cost of one collective instruction."""
    kind = COLLECTIVE_KINDS[inst.opcode]
    n = group_size(inst, module)
    return collective_cost(kind, n, payload_bytes(inst, operand_shapes), profile, algorithm)
