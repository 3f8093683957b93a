"""Collective groups and gradient all-reduce detection.

A data-parallel training step sums its gradients with ``all-reduce(..., to_apply=add)``
over a group of N > 1 devices. This module finds those all-reduces and describes their
device groups the way the rewrite needs them: the group mode (§8.3 of the HLO reference),
the instruction that yields a device's *participant id* in that mode, and the table from
participant id to position within its group — the position, not the raw id, is the shard a
device receives from a reduce-scatter and the slot its data occupies in an all-gather.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hlo_shard.ir import ArrayShape, Instruction, Module, ReplicaGroups, TupleShape


class GroupMode(enum.Enum):
    CROSS_REPLICA = "cross-replica"
    CROSS_PARTITION = "cross-partition"
    CROSS_REPLICA_AND_PARTITION = "cross-replica-and-partition"
    FLATTENED_ID = "flattened-id"


def group_mode(inst: Instruction) -> GroupMode:
    """How ``replica_groups`` is read, from ``channel_id`` / ``use_global_device_ids``."""
    has_channel = inst.attr("channel_id") is not None
    global_ids = inst.attr("use_global_device_ids")
    if not has_channel:
        return GroupMode.CROSS_REPLICA
    if global_ids is None:
        return GroupMode.CROSS_PARTITION
    return GroupMode.FLATTENED_ID if global_ids else GroupMode.CROSS_REPLICA_AND_PARTITION


@dataclass(frozen=True)
class DeviceGroups:
    """The groups of one collective, expanded, in the id space of its mode."""

    mode: GroupMode
    groups: tuple[tuple[int, ...], ...]
    #: Number of participant ids in this mode (replicas, partitions or both).
    num_ids: int
    #: The collective's own attribute, re-emitted verbatim on the collectives we add.
    replica_groups: ReplicaGroups | None
    use_global_device_ids: bool | None

    @property
    def size(self) -> int:
        return len(self.groups[0])

    @property
    def is_trivial(self) -> bool:
        """One group ``{0, 1, …, N-1}``: the participant id is the position."""
        return len(self.groups) == 1 and self.groups[0] == tuple(range(self.size))

    def position_table(self) -> tuple[int, ...]:
        """Participant id → position within its group (0 for ids in no group)."""
        table = [0] * self.num_ids
        for group in self.groups:
            for position, device in enumerate(group):
                table[device] = position
        return tuple(table)

    def global_sets(self, replicas: int, partitions: int) -> list[frozenset[int]]:
        """The groups as sets of global device ids (replica × partitions + partition)."""
        expand = {
            GroupMode.CROSS_REPLICA: lambda g: [{r * partitions + p for r in g}
                                                for p in range(partitions)],
            GroupMode.CROSS_PARTITION: lambda g: [{r * partitions + p for p in g}
                                                  for r in range(replicas)],
            GroupMode.FLATTENED_ID: lambda g: [set(g)],
            GroupMode.CROSS_REPLICA_AND_PARTITION: lambda g: [
                {r * partitions + p for r in g for p in range(partitions)}],
        }[self.mode]
        return [frozenset(s) for g in self.groups for s in expand(g)]

    def key(self) -> tuple:
        """Collectives with equal keys can be combined into one."""
        return self.mode, self.groups, self.use_global_device_ids


class UnsupportedGroups(ValueError):
    """The groups cannot be used for a reduce-scatter (the reason is the message)."""


class SingleDeviceGroups(UnsupportedGroups):
    """Groups of one device: the collective reduces nothing across devices."""


def device_groups(inst: Instruction, module: Module) -> DeviceGroups:
    """Expand a collective's groups; raises :class:`UnsupportedGroups` with a reason when
    they are not N > 1 uniform disjoint groups in a mode the rewrite supports."""
    mode = group_mode(inst)
    replicas, partitions = module.replica_count, module.num_partitions
    num_ids = {
        GroupMode.CROSS_REPLICA: replicas,
        GroupMode.CROSS_PARTITION: partitions,
        GroupMode.FLATTENED_ID: replicas * partitions,
        GroupMode.CROSS_REPLICA_AND_PARTITION: replicas,
    }[mode]
    if mode is GroupMode.CROSS_REPLICA_AND_PARTITION and partitions > 1:
        raise UnsupportedGroups("cross-replica-and-partition groups with several partitions")
    raw = inst.attr("replica_groups")
    groups = raw.groups if isinstance(raw, ReplicaGroups) else ()
    if not groups:
        groups = (tuple(range(num_ids)),)
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise UnsupportedGroups("replica groups of different sizes")
    seen = [d for g in groups for d in g]
    if len(seen) != len(set(seen)) or any(not 0 <= d < num_ids for d in seen):
        raise UnsupportedGroups("replica groups repeat a device or name one out of range")
    if sizes.pop() < 2:
        raise SingleDeviceGroups("groups of one device (nothing to shard across)")
    global_ids = inst.attr("use_global_device_ids")
    return DeviceGroups(mode, tuple(tuple(g) for g in groups), num_ids,
                        raw if isinstance(raw, ReplicaGroups) else None,
                        bool(global_ids) if global_ids is not None else None)


def participant_id_source(module: Module, mode: GroupMode) -> str:
    """The opcode whose value is the participant id in ``mode`` ("replica-id",
    "partition-id", or "flattened" for replica × num_partitions + partition)."""
    if mode is GroupMode.CROSS_PARTITION:
        return "partition-id"
    if mode is GroupMode.FLATTENED_ID:
        if module.replica_count == 1:
            return "partition-id"
        if module.num_partitions == 1:
            return "replica-id"
        return "flattened"
    return "replica-id"


# ----------------------------------------------------------------------- reductions

#: Scalar reducer opcode → neutral element (by element-type family), used to mask the
#: padded lanes of a sharded reduction and as the init of local partial reductions.
_NEUTRAL: dict[str, dict[str, str]] = {
    "add": {"float": "0", "int": "0", "pred": "false"},
    "multiply": {"float": "1", "int": "1", "pred": "true"},
    "maximum": {"float": "-inf", "int": "min", "pred": "false"},
    "minimum": {"float": "inf", "int": "max", "pred": "true"},
    "and": {"int": "-1", "pred": "true"},
    "or": {"int": "0", "pred": "false"},
}


def reducer_opcode(module: Module, computation_name: str) -> str | None:
    """The binary opcode of a scalar reduction computation ``(x, y) -> op(x, y)``, or None
    when the computation is anything else (a reducer we cannot reason about)."""
    try:
        comp = module.computation(computation_name)
    except KeyError:
        return None
    params = comp.parameters()
    if len(params) != 2 or any(not _is_scalar(p.shape) for p in params):
        return None
    root = comp.root
    if root.opcode not in _NEUTRAL or sorted(root.operands) != sorted(p.name for p in params):
        return None
    return root.opcode


def neutral_literal(reducer: str, element_type: str) -> str | None:
    """The literal text of ``reducer``'s neutral element for ``element_type``."""
    if element_type == "pred":
        family = "pred"
    elif element_type[0] in "su" and element_type[1:].isdigit():
        family = "int"
    elif element_type.startswith(("f", "bf")):
        family = "float"
    else:
        return None
    value = _NEUTRAL.get(reducer, {}).get(family)
    if value in ("min", "max"):
        bits = int(element_type[1:])
        signed = element_type[0] == "s"
        low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        value = str(low if value == "min" else high)
    if value == "-1" and element_type[0] == "u":
        value = str((1 << int(element_type[1:])) - 1)
    return value


def _is_scalar(shape) -> bool:
    return isinstance(shape, ArrayShape) and shape.is_scalar


# ------------------------------------------------------------------- gradient search


@dataclass(frozen=True)
class GradientAllReduce:
    """A sum all-reduce over groups of N > 1 (or why it cannot be sharded)."""

    computation: str
    name: str
    groups: DeviceGroups | None
    #: Why the rewrite must leave it alone ("" when it is a candidate).
    reason: str = ""

    @property
    def is_candidate(self) -> bool:
        return not self.reason


#: Why the rewrite leaves a gradient all-reduce XLA made asynchronous, by the opcode
#: that starts it (``{start}``: that instruction's name). Both are the form of a module
#: XLA has scheduled (GPU's POST_SCHEDULER stage, a GPU run's dump): the rewrite edits
#: the synchronous all-reduces of the stage before, where the combiners, the async
#: conversion and the scheduler still run on what it emits.
ASYNC_REASONS: dict[str, str] = {
    "all-reduce-start": "asynchronous all-reduce (all-reduce-start/all-reduce-done, XLA's "
                        "scheduled form): not rewritten; the pass shards the synchronous "
                        "all-reduces of the PRE_SCHEDULER stage (install()'s default)",
    "async-start": "asynchronous all-reduce (wrapped by async-start %{start}, XLA's scheduled "
                   "form): not rewritten; the pass shards the synchronous all-reduces of the "
                   "PRE_SCHEDULER stage (install()'s default)",
}


def find_gradient_all_reduces(module: Module) -> list[GradientAllReduce]:
    """Every sum all-reduce over groups of more than one device, in every computation
    that is not a reducer/fusion body, with the reason when it is not a candidate. The
    asynchronous forms count too, each with its :data:`ASYNC_REASONS` entry: an
    ``all-reduce-start`` (under its own name), and the all-reduce an ``async-start``
    wraps (under the all-reduce's name, in the computation the start calls)."""
    wrapped = _async_wrapped(module)
    found: list[GradientAllReduce] = []
    for comp in module.computations:
        for inst in comp.instructions:
            if inst.opcode not in ("all-reduce", "all-reduce-start"):
                continue
            to_apply = inst.attr("to_apply")
            reducer = reducer_opcode(module, getattr(to_apply, "name", ""))
            if reducer != "add":
                continue
            try:
                groups = device_groups(inst, module)
            except SingleDeviceGroups:
                continue
            except UnsupportedGroups as err:
                found.append(GradientAllReduce(comp.name, inst.name, None, str(err)))
                continue
            reason = (ASYNC_REASONS["all-reduce-start"] if inst.opcode == "all-reduce-start"
                      else ASYNC_REASONS["async-start"].format(start=wrapped[comp.name])
                      if comp.name in wrapped else _shape_reason(inst))
            found.append(GradientAllReduce(comp.name, inst.name, groups, reason))
    return found


def _async_wrapped(module: Module) -> dict[str, str]:
    """Computation an ``async-start`` runs asynchronously → that start's name."""
    return {getattr(inst.attr("calls"), "name", ""): inst.name
            for comp in module.computations for inst in comp.instructions
            if inst.opcode == "async-start"}


def _shape_reason(inst: Instruction) -> str:
    if inst.attr("constrain_layout"):
        return "constrain_layout=true"
    shapes = ([inst.shape] if isinstance(inst.shape, ArrayShape)
              else list(inst.shape.elements) if isinstance(inst.shape, TupleShape) else [])
    if any(not isinstance(s, ArrayShape) or s.dynamic for s in shapes):
        return "dynamic or nested shape"
    return ""


# ---------------------------------------------------------------- lost header facts

#: Opcodes whose ``replica_groups`` name the devices a module runs on.
_GROUPED = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                      "all-reduce-start", "all-gather-start", "collective-broadcast"})


def recovered_device_counts(module: Module) -> dict[str, int]:
    """Header facts a module lost, recovered from its collectives: a module taken from
    the serialized proto XLA's pass hook hands over prints neither ``replica_count`` nor
    ``num_partitions``. The largest device id named in the groups of each mode says how
    many replicas (cross-replica) or partitions (cross-partition, or global ids of an
    SPMD module) there are. Empty when the header has them or nothing names a device."""
    if "replica_count" in module.header or "num_partitions" in module.header:
        return {}
    largest: dict[str, int] = {}
    for comp in module.computations:
        for inst in comp.instructions:
            groups = inst.attr("replica_groups")
            if inst.opcode not in _GROUPED or not isinstance(groups, ReplicaGroups) \
                    or not groups.groups:
                continue
            key = "num_partitions" if group_mode(inst) in (
                GroupMode.CROSS_PARTITION, GroupMode.FLATTENED_ID) else "replica_count"
            top = max(d for g in groups.groups for d in g) + 1
            largest[key] = max(largest.get(key, 1), top)
    if len(largest) != 1 or max(largest.values()) < 2:
        return {}  # both kinds at once: which ids are whose is not recoverable
    return largest
