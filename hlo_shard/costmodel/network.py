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

``shared-memory`` is the algorithm of XLA's CPU devices, which share one host's
memory: a collective is one rendezvous of all devices per operand buffer (one α
each: a tuple all-reduce of k arrays, which is what XLA's combiner makes of k
all-reduces, measured k times the latency of one — 2.0 ms for 11 arrays of 1 KiB at
N = 8, 0.28 ms for one array of their 11 KiB), after which each device copies or
reduces its part with plain loads and stores
(``xla/backends/cpu/collectives/in_process_communicator.cc``): all-reduce reads its
chunk of every input (S) and writes it into every output (S); reduce-scatter reads S
and writes S/n; all-gather reads every input (S) and writes its output (S);
all-to-all and collective-permute read and write their buffer. Those bytes are
priced like a kernel's, at the profile's read and write bandwidths (the outputs are
buffers of the step like any other). A reduction also pays its accumulator: each
device fills its chunk of S/n with the identity, then adds every participant's share
into it one participant at a time, reading and writing the whole chunk n times: S read
and S + S/n written per device, at the cache rate while the chunk fits the device's
cache share, at the memory rates otherwise (:func:`accumulator_seconds`). The wire
bytes reported stay those of the nccl accounting above, so reports compare across
profiles.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from hlo_shard.analysis.collectives import GroupMode, group_mode
from hlo_shard.graph import topological_order
from hlo_shard import opinfo
from hlo_shard.ir import (ELEMENT_BITS, Computation, Instruction, Module, ReplicaGroups,
                          shape_leaves, summed_type)
from hlo_shard.profiles import HardwareProfile

#: Opcode → collective kind as reported (async starts priced, their -done free), and the
#: halves of an async collective that carry no traffic of their own: from the opcode table.
COLLECTIVE_KINDS = opinfo.COLLECTIVE_KINDS
COLLECTIVE_DONE_OPCODES = opinfo.COLLECTIVE_DONE

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
    steps: int
    seconds: float
    algorithm: str
    #: The α part of ``seconds`` (paid once per combined bucket where the algorithm
    #: lets a bucket share one rendezvous, see :func:`share_latency`).
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


def payload_bytes(inst: Instruction, operand_shapes: list, upcast: bool = False) -> int:
    """S: the full buffer — the output of an all-gather, the input otherwise; a sum of
    16-bit floats as f32 where the backend ``upcast``s them (XLA:CPU promotes the
    collective: :func:`~hlo_shard.ir.summed_type`)."""
    kind = COLLECTIVE_KINDS[inst.opcode]
    shapes = [inst.shape] if kind == "all-gather" else operand_shapes
    if inst.opcode == "all-gather-start":
        shapes = [inst.shape.elements[-1]] if hasattr(inst.shape, "elements") else [inst.shape]
    upcast = upcast and inst.opcode in opinfo.SUMMING_COLLECTIVES
    return sum(leaf.num_elements * ELEMENT_BITS[summed_type(leaf.element_type, upcast)] // 8
               if upcast else leaf.byte_size
               for shape in shapes for _, leaf in shape_leaves(shape))


def algorithm_steps(kind: str, n: int, algorithm: str, operands: int = 1) -> int:
    """Latency-bearing steps of one collective of ``kind`` over ``n`` devices moving
    ``operands`` buffers (a tuple collective: one rendezvous each on shared memory)."""
    if n <= 1:
        return 0
    if algorithm == "shared-memory":
        return operands
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


#: Per kind: (bytes a device reads, bytes it writes) in units of S, for the
#: shared-memory algorithm; a reduce-scatter writes only its shard, S/n.
_MEMORY_TRAFFIC: dict[str, tuple[float, float]] = {
    "all-reduce": (1.0, 1.0), "reduce-scatter": (1.0, 0.0), "all-gather": (1.0, 1.0),
    "all-to-all": (1.0, 1.0), "collective-broadcast": (1.0, 1.0),
    "collective-permute": (1.0, 1.0),
}


def memory_traffic(kind: str, n: int, payload: int) -> tuple[float, float]:
    """(bytes read, bytes written) by one device for a shared-memory collective."""
    if n <= 1:
        return 0.0, 0.0
    read, written = _MEMORY_TRAFFIC[kind]
    shard = payload / n if kind == "reduce-scatter" else 0.0
    return read * payload, written * payload + shard


#: The kinds whose shared-memory algorithm reduces into an accumulator chunk.
_REDUCING_KINDS = frozenset(opinfo.COLLECTIVE_KINDS[op] for op in opinfo.SUMMING_COLLECTIVES)


def accumulator_seconds(kind: str, n: int, payload: int, profile: HardwareProfile,
                        resident: bool = False) -> float:
    """The accumulator traffic of a shared-memory reduction: the device's chunk (S/n)
    written once with the identity, then read and written once per participant
    (``in_process_communicator.cc``: ``ReduceScatter``/``ReduceHelper``)."""
    if kind not in _REDUCING_KINDS or n <= 1:
        return 0.0
    chunk = payload / n
    read, written = n * chunk, (n + 1) * chunk
    if chunk <= profile.cache_bytes:
        return (read + written) / profile.cache_bandwidth_bytes_per_s
    return profile.memory_seconds(read, written, resident)


def collective_cost(kind: str, n: int, payload: int, profile: HardwareProfile,
                    algorithm: str | None = None, resident: bool = False,
                    operands: int = 1) -> CollectiveCost:
    """``resident``: the output is a donated parameter's buffer (see
    :meth:`~hlo_shard.profiles.HardwareProfile.memory_seconds`); ``operands``: the
    arrays of a tuple collective, ``payload`` their total."""
    algorithm = algorithm or profile.interconnect.algorithm
    link = profile.interconnect.link_for(n)
    steps = algorithm_steps(kind, n, algorithm, operands)
    sent = wire_bytes(kind, n, payload)
    latency = steps * link.alpha_s
    transfer = (profile.memory_seconds(*memory_traffic(kind, n, payload), resident)
                + accumulator_seconds(kind, n, payload, profile, resident)
                if algorithm == "shared-memory" else sent / link.beta_bytes_per_s)
    return CollectiveCost(kind, n, payload, sent, steps, latency + transfer, algorithm,
                          latency)


def share_latency(costs: list[CollectiveCost]) -> list[float]:
    """Seconds of each collective of one combined bucket: the bucket pays the latency of
    one collective, shared among its members by payload; bandwidth time is unchanged.
    On shared memory the combined collective still meets once per member's buffer, so
    each keeps its own latency."""
    if any(c.algorithm == "shared-memory" for c in costs):
        return [c.seconds for c in costs]
    payload = sum(c.payload_bytes for c in costs)
    latency = max((c.latency_s for c in costs), default=0.0)
    return [c.seconds - c.latency_s
            + latency * (c.payload_bytes / payload if payload else 1 / len(costs))
            for c in costs]


def collective_depth(comp: Computation) -> dict[str, int]:
    """How many collectives precede each instruction on its longest dependency path:
    collectives at the same depth cannot depend on one another."""
    depth: dict[str, int] = {}
    #: What an instruction's users start from: its depth, one more for a collective.
    above: dict[str, int] = {}
    for inst in topological_order(comp):
        deepest = 0
        for operand in inst.operands:
            if above[operand] > deepest:
                deepest = above[operand]
        depth[inst.name] = deepest
        above[inst.name] = deepest + (inst.opcode in COLLECTIVE_KINDS)
    return depth


def combiner_buckets(module: Module, comp: Computation, threshold_bytes: int,
                     combined_kinds: Collection[str] | None = None) -> list[list[str]]:
    """The collectives XLA's combiners merge into one: of one kind and group size, not
    depending on each other (same collective depth), in program order, up to
    ``threshold_bytes`` per bucket. Single collectives are buckets of one, and so is
    every collective of a kind outside ``combined_kinds`` (the kinds the backend has a
    combiner for; all when None)."""
    depth = collective_depth(comp)
    groups: dict[tuple, list[Instruction]] = {}
    for inst in topological_order(comp):
        if inst.opcode in COLLECTIVE_KINDS:
            key = (COLLECTIVE_KINDS[inst.opcode], group_size(inst, module), depth[inst.name])
            groups.setdefault(key, []).append(inst)
    buckets: list[list[str]] = []
    for (kind, size, _), members in groups.items():
        alone = size < 2 or (combined_kinds is not None and kind not in combined_kinds)
        payloads = [payload_bytes(inst, [comp[o].shape for o in inst.operands])
                    for inst in members]
        buckets += [[members[i].name for i in bucket]
                    for bucket in fill_buckets(payloads, 0 if alone else threshold_bytes)]
    return buckets


def fill_buckets(payloads: Sequence[int], threshold_bytes: int) -> list[list[int]]:
    """Indices of ``payloads`` in order, cut into buckets as XLA's combiners fill them: a
    bucket takes the next payload while its total stays within ``threshold_bytes`` (each
    alone when that is 0); a payload above the threshold is a bucket of its own."""
    buckets: list[list[int]] = []
    bucket: list[int] = []
    total = 0
    for i, payload in enumerate(payloads):
        if bucket and (threshold_bytes == 0 or total + payload > threshold_bytes):
            buckets.append(bucket)
            bucket, total = [], 0
        bucket.append(i)
        total += payload
    if bucket:
        buckets.append(bucket)
    return buckets


@dataclass
class Combiner:
    """XLA's collective combiners on one module that is not edited while this is used:
    each computation's :func:`combiner_buckets`, found once however many of the cost
    model's parts ask (the collectives' prices, the memory schedule, the donated
    copies)."""

    module: Module
    threshold_bytes: int
    combined_kinds: Collection[str] | None = None
    _buckets: dict[str, list[list[str]]] = field(default_factory=dict, repr=False)

    def buckets(self, comp: Computation) -> list[list[str]]:
        """:func:`combiner_buckets` of ``comp`` (read them, do not edit them)."""
        found = self._buckets.get(comp.name)
        if found is None:
            found = self._buckets[comp.name] = combiner_buckets(
                self.module, comp, self.threshold_bytes, self.combined_kinds)
        return found


def instruction_collective_cost(inst: Instruction, module: Module, operand_shapes: list,
                                profile: HardwareProfile, *, algorithm: str | None = None,
                                resident: bool = False) -> CollectiveCost:
    """The network cost of one collective instruction."""
    kind = COLLECTIVE_KINDS[inst.opcode]
    n = group_size(inst, module)
    operands = sum(1 for shape in operand_shapes for _ in shape_leaves(shape)) or 1
    return collective_cost(kind, n, payload_bytes(inst, operand_shapes,
                                                  profile.upcasts_16bit_floats),
                           profile, algorithm, resident, operands)


@dataclass(frozen=True)
class CollectivePricing:
    """What one gradient's collectives and its bucketing copies cost on ``hardware``
    over a group of ``n`` (the weight-update pass's choice between a collective per
    gradient and combined buckets)."""

    hardware: HardwareProfile
    n: int

    def pairs_s(self, payloads: Sequence[int]) -> float:
        """Reduce-scatter/all-gather pairs of ``payloads`` as XLA runs them, as the step
        estimate prices them: into buffers the step has mapped already (a temporary's
        pages are reused step after step), and where the backend has a combiner for a
        kind (the profile's ``combined_collectives``), the independent collectives of
        that kind share one latency per bucket of its ``combine_threshold_bytes``
        (:func:`share_latency`); elsewhere each pays its own."""
        pairs = [self._pair(nbytes) for nbytes in payloads]
        seconds = 0.0
        for half in range(2):  # the reduce-scatters, then the all-gathers
            costs = [pair[half] for pair in pairs]
            combined = self.n > 1 and bool(costs) and \
                costs[0].kind in self.hardware.combined_collectives
            threshold = self.hardware.combine_threshold_bytes if combined else 0
            for bucket in fill_buckets(payloads, threshold):
                seconds += sum(share_latency([costs[i] for i in bucket]))
        return seconds

    def buckets_s(self, buckets: Sequence[tuple[int, bool]]) -> float:
        """Gradient buckets of (bytes, copied): their pairs (:meth:`pairs_s`) and the
        bucketing copies of those copied (:meth:`bucketing_s`)."""
        return self.pairs_s([nbytes for nbytes, _ in buckets]) + sum(
            self.bucketing_s(nbytes) for nbytes, copied in buckets if copied)

    def pair_latency_s(self) -> float:
        return sum(cost.latency_s for cost in self._pair(0))

    def _pair(self, nbytes: int) -> tuple[CollectiveCost, CollectiveCost]:
        """A reduce-scatter of ``nbytes`` and the all-gather bringing them back, into
        buffers the step has mapped already (a temporary's pages are reused)."""
        return (collective_cost("reduce-scatter", self.n, nbytes, self.hardware, resident=True),
                collective_cost("all-gather", self.n, nbytes, self.hardware, resident=True))

    def bucketing_s(self, nbytes: int) -> float:
        """Copying ``nbytes`` into the gradient bucket and out of the gathered one: two
        kernels, each reading and writing them once into temporaries the step has mapped
        already (the update's shards fuse into their bucket)."""
        return 2 * (self.hardware.memory_seconds(nbytes, nbytes, resident=True)
                    + self.hardware.kernel_overhead_s)

    def alone(self, nbytes: int) -> bool:
        """A tensor this large gains nothing from sharing a collective: its pair's
        latency costs no more than its bucketing copies, or XLA combines both kinds of
        the pair anyway (the backend's combiners share one latency without the copies)."""
        return (self.n <= 1 or all(cost.kind in self.hardware.combined_collectives
                                   for cost in self._pair(0))
                or self.pair_latency_s() <= self.bucketing_s(nbytes))


def split_all_reduce_seconds(group: int, payload: int, blocks: int, hardware: HardwareProfile,
                             *, strided: bool = False, holders: int = 1,
                             transposed_block: bool = False) -> tuple[float, float]:
    """Seconds of an all-reduce over ``group`` devices of ``payload`` bytes, and of the
    reduce-scatter into ``blocks`` blocks (and the all-reduce of each block among its
    ``holders``, where more than one device holds it) it becomes; buffers priced as
    mapped already, which is what makes a second collective's latency weigh most against
    the bytes it saves. Blocks ``strided`` in the all-reduce's layout (the split
    dimension is not its outermost one longer than 1: an FSDP weight's gradient computed
    transposed) are not contiguous buffers: the operand is transposed whole first, one
    more pass over the gradient's bytes into a fresh buffer (on XLA:CPU such a
    reduce-scatter measured slower than the all-reduce and slice it replaces). In a loop
    body both run once per iteration, so the comparison is the same whatever the trip
    count. ``transposed_block``: the blocks were made contiguous by computing the
    gradient transposed instead, and each block is transposed back after the collective
    (one pass over the block's bytes)."""
    before = collective_cost("all-reduce", group, payload, hardware, resident=True).seconds
    after = collective_cost("reduce-scatter", blocks, payload, hardware, resident=True).seconds
    if strided:
        after += hardware.memory_seconds(payload, payload)
    if transposed_block:
        after += hardware.memory_seconds(payload // blocks, payload // blocks)
    if holders > 1:
        after += collective_cost("all-reduce", holders, payload // blocks, hardware,
                                 resident=True).seconds
    return before, after

