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
import functools
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from hlo_shard.graph import is_zero, reachable, topological_order, users_map
from hlo_shard.ir import (ArrayShape, Computation, Instruction, Module, ReplicaGroups, Shape,
                          TupleShape)
from hlo_shard.opinfo import (ALL_REDUCES, DATA_MOVEMENT, DETERMINISTIC_OPS, DEVICE_IDS,
                              GLOBAL_IDS_FLAGGED, GROUPED,
                              HOST_IO, HOST_TRANSFERS, OPINFO, VIEWS)


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
    if global_ids is None and inst.opcode not in GLOBAL_IDS_FLAGGED:
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
        """Collectives with equal keys can be combined into one: the same groups, each
        in its own order (a device's position in its group is its shard), in any order
        of the groups (``{{0,1},{4,5},{2,3},{6,7}}`` is ``[4,2]<=[8]``)."""
        return self.mode, tuple(sorted(self.groups)), self.use_global_device_ids


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
    name: dict(info.neutral) for name, info in OPINFO.items() if info.neutral}


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
    # A view of the result in its own shape is the result (jax's reducer of a psum in a
    # shard_map with axis_names, partial-auto, ends in ``ROOT copy(add)``).
    while root.opcode in VIEWS and len(root.operands) == 1 and \
            comp[root.operands[0]].shape == root.shape:
        root = comp[root.operands[0]]
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


def _is_scalar(shape: Shape) -> bool:
    return isinstance(shape, ArrayShape) and shape.is_scalar


def _one_element(shape: Shape) -> bool:
    return isinstance(shape, ArrayShape) and shape.num_elements == 1


def _scalars(shape: Shape) -> bool:
    """A scalar, or a tuple of scalars (several summed by one combined all-reduce)."""
    return _is_scalar(shape) or isinstance(shape, TupleShape) and \
        all(_is_scalar(element) for element in shape.elements)


# ------------------------------------------------------------------- gradient search


class ReasonCode(str, enum.Enum):
    """Why a gradient collective is left as it is (or, ``params="sharded"``, a weight
    whole or gathered wide), for machines (``--json``'s ``reason_code``): the one table
    of such reasons, from the collective's form, the planner and the speed gate; the
    words for people are the reason text next to it."""

    #: Reduced and then sliced by the device's id (the SPMD partitioner's form of a
    #: reduce-scatter), or a reduce-scatter: the update already runs on the 1/N slice.
    ALREADY_SHARDED = "already_sharded"
    #: An asynchronous all-reduce (XLA's scheduled form, :data:`ASYNC_REASONS`).
    ASYNCHRONOUS = "asynchronous"
    #: Groups the rewrite cannot use (uneven, repeated devices, unsupported mode).
    UNSUPPORTED_GROUPS = "unsupported_groups"
    #: A shape the rewrite does not handle (dynamic, nested, constrained layout).
    UNSUPPORTED_SHAPE = "unsupported_shape"
    #: Inside a fusion/call/conditional body the rewrite does not reach.
    CALLED_COMPUTATION = "called_computation"
    #: Over other groups than the data-parallel ones (tensor/model-parallel sums).
    OTHER_GROUPS = "other_groups"
    #: A ``reduce-scatter`` every use of which all-gathers it back whole: the program's
    #: all-reduce in two collectives, the update on the whole sum.
    GATHERED_BACK = "gathered_back"
    #: A ``jax.pmap`` step whose devices' copies of the weights are not said to be equal
    #: (:attr:`~hlo_shard.analysis.replication.ParamOverrides.pmap_replicated`).
    PMAP_COPIES = "pmap_copies"
    #: The tuple result is used whole.
    TUPLE_USED_WHOLE = "tuple_used_whole"
    #: The planner's: not a static array (token, opaque, dynamic shape).
    NOT_STATIC = "not_static"
    #: The planner's: at most one element.
    NOTHING_TO_SHARD = "nothing_to_shard"
    #: The planner's: smaller than the minimum the caller set (``min_shard_bytes``).
    BELOW_MIN_SHARD_BYTES = "below_min_shard_bytes"
    #: The planner's: the all-reduced value is never used.
    UNUSED = "unused"
    #: The planner's: no update op runs on it, every user needs the full value.
    NO_UPDATE_WORK = "no_update_work"
    #: The planner's: other all-reduced values are computed from it, a batch statistic
    #: of the forward or backward pass (BatchNorm's mean and variance), not an update.
    FEEDS_GRADIENTS = "feeds_gradients"
    #: The partitioner's reduce-scatter form of a value of the forward/backward pass (an
    #: activation's sum under FSDP, another sum computed from its slice): not a gradient.
    ACTIVATION_SUM = "activation_sum"
    #: The planner's: an integer sum (a count, a metric's accumulator): no gradient is
    #: an integer, and the sum's carried total must come back whole (``state="sharded"``
    #: keeps what only the update reads in shards between steps).
    INTEGER_SUM = "integer_sum"
    #: A scalar summed from this device's slices of already-sharded gradients (the
    #: global norm's partial sums over the devices holding the other slices): not a
    #: gradient.
    PARTIAL_SUM = "partial_sum"
    #: The module calls back into the host (``jax.debug.print``, ``jax.debug.callback``,
    #: ``io_callback``, ``pure_callback``): its collectives are left where they are.
    HOST_CALLBACK = "host_callback"
    #: The planner's: a reduction whose initial value is not its reducer's neutral
    #: element reads it (XLA applies such a value once per partial result of its own
    #: choosing, so the result depends on how its operand is computed): kept as it is.
    NON_NEUTRAL_INIT = "non_neutral_init"
    #: The rewrite of its region made a dependency cycle: undone, the region refused.
    REGION_CYCLE = "region_cycle"
    #: Summed inside a loop body every iteration, the accumulation motion having kept it
    #: there (its reason says why): the update after the loop reads no sum it could
    #: shard.
    KEPT_IN_LOOP = "kept_in_loop"
    #: The speed gate kept it whole: sharding it is predicted slower.
    KEPT_FOR_SPEED = "kept_for_speed"
    #: ``params="sharded"``, a weight (not a gradient): kept whole on every device, its
    #: shard not paired with a next value the sharded update computes (the reason says
    #: which part fails).
    WEIGHT_KEPT_WHOLE = "weight_kept_whole"
    #: ``params="sharded"``, a sharded weight all-gathered in its own element type: a
    #: use outside the update is not a convert to one narrower float type.
    WIDE_GATHER = "wide_gather"
    #: An accumulation loop's gradient reduce-scattered once after the loop, its
    #: accumulator carried whole (not as a shard reduce-scattered per microbatch):
    #: predicted faster, asked for (``accumulator="whole"``), or the in-loop form not
    #: proven (the note says which).
    ACCUMULATOR_WHOLE = "accumulator_whole"


@dataclass(frozen=True)
class GradientAllReduce:
    """A sum all-reduce over groups of N > 1 (or why it cannot be sharded)."""

    computation: str
    name: str
    groups: DeviceGroups | None
    #: Why the rewrite must leave it alone ("" when it is a candidate).
    reason: str = ""
    code: ReasonCode | None = None
    #: ``already_sharded`` by the partitioner: how the sum reaches this device's slice.
    sliced: DeviceSliced | None = None
    #: ``already_sharded``: another sum computed from its slice (not through data
    #: movement alone), which makes it a value of the forward/backward pass, not a
    #: weight's gradient ("": none). Reported so, handled as every already-sharded sum.
    feeds: str = ""

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
    forms = _ScatterForms(module)
    callback = host_callback(module)
    for comp in module.computations:
        scattered = forms.of(comp)
        first = len(found)
        for inst in comp.instructions:
            if inst.opcode not in ALL_REDUCES or not is_sum(module, inst):
                continue
            try:
                groups = device_groups(inst, module)
            except SingleDeviceGroups:
                continue
            except UnsupportedGroups as err:
                found.append(GradientAllReduce(comp.name, inst.name, None, str(err),
                                               ReasonCode.UNSUPPORTED_GROUPS))
                continue
            if callback:
                found.append(GradientAllReduce(comp.name, inst.name, groups,
                                               HOST_CALLBACK_REASON.format(callback=callback),
                                               ReasonCode.HOST_CALLBACK))
                continue
            asynchronous = (ASYNC_REASONS["all-reduce-start"] if inst.opcode == "all-reduce-start"
                            else ASYNC_REASONS["async-start"].format(start=wrapped[comp.name])
                            if comp.name in wrapped else "")
            reason = _shape_reason(inst)
            if asynchronous:
                found.append(GradientAllReduce(comp.name, inst.name, groups, asynchronous,
                                               ReasonCode.ASYNCHRONOUS))
            elif reason:
                found.append(GradientAllReduce(comp.name, inst.name, groups, reason,
                                               ReasonCode.UNSUPPORTED_SHAPE))
            elif (sliced := scattered.sliced_by_device(inst)) is not None:
                found.append(GradientAllReduce(comp.name, inst.name, groups, sliced.words(),
                                               ReasonCode.ALREADY_SHARDED, sliced))
            else:
                found.append(GradientAllReduce(comp.name, inst.name, groups))
        found[first:] = _partial_sums(comp, _forward_backward_sums(comp, found[first:]))
    return found


#: Why a module that calls back into the host is left as it is (:data:`ReasonCode`
#: ``host_callback``).
HOST_CALLBACK_REASON = (
    "the module calls back into the host (%{callback}: jax.debug.print, jax.debug.callback, "
    "io_callback, pure_callback): a collective added or moved may run beside the callback, "
    "and XLA:CPU's devices waiting in it can hold the worker threads the callback needs (a "
    "deadlock, then XLA's abort); its collectives stay where they are")


def host_callback(module: Module) -> str:
    """The first instruction of ``module`` that calls back into the host — a custom call
    of jax's Python callbacks, a host transfer (``send``/``recv`` with
    ``is_host_transfer=true``: TPU's callbacks), an ``infeed``/``outfeed`` — or ""."""
    for comp in module.computations:
        for inst in comp.instructions:
            if inst.opcode in HOST_IO or \
                    inst.opcode in HOST_TRANSFERS and inst.attr("is_host_transfer") is True:
                return inst.name
            if inst.opcode == "custom-call":
                target = getattr(inst.attr("custom_call_target"), "value", "")
                if "python" in target and "callback" in target:
                    return inst.name
    return ""


#: Why a scalar summed from already-sharded slices is left alone (:data:`ReasonCode`
#: ``partial_sum``).
PARTIAL_SUM_REASON = ("a partial sum of this device's slices of already-sharded gradients "
                      "(a global norm's, over the devices holding the other slices): not a "
                      "gradient")


def _partial_sums(comp: Computation, found: list[GradientAllReduce]
                  ) -> list[GradientAllReduce]:
    """``found`` (the all-reduces of ``comp``, their activation sums marked: see
    :func:`_forward_backward_sums`) with each candidate that sums scalars computed from
    the slices of its already-sharded gradients marked ``partial_sum``: clipping by
    global norm squares and sums each slice, then all-reduces those sums over the
    devices holding the other slices. An activation's slice is no gradient's: what is
    computed from it (a global-batch loss, the gradient of a scalar weight through it)
    is not such a sum. One walk from the slices to what reads them."""
    slices = [name for ar in found if ar.sliced is not None and not ar.feeds
              for name in ar.sliced.reads]
    if not slices or all(not ar.is_candidate for ar in found):
        return found
    users = users_map(comp)
    derived = reachable(slices, lambda name: users.get(name, ()))
    return [replace(ar, reason=PARTIAL_SUM_REASON, code=ReasonCode.PARTIAL_SUM)
            if ar.is_candidate and _scalars(comp[ar.name].shape) and
            all(operand in derived for operand in comp[ar.name].operands) else ar
            for ar in found]


#: Ops through which a sum read by another sum is that same value (two-level sums: the
#: fsdp axis's slice summed over the data axis, a narrowing convert between).
_SAME_VALUE = DATA_MOVEMENT | {"convert"}


def _forward_backward_sums(comp: Computation, found: list[GradientAllReduce]
                           ) -> list[GradientAllReduce]:
    """``found`` (the all-reduces of ``comp``) with each already-sharded one from whose
    slice another array sum is computed marked with that sum (``feeds``): under FSDP the
    partitioner also reduce-scatters activations (a product contracting a sharded
    dimension, summed, then sliced by batch), which the weights' gradients are computed
    from. A slice summed again through data movement alone (the data axis's sum of the
    fsdp axis's slice) is the same gradient. One walk up from every array sum's operand:
    through data movement it is that sum's value, above anything else it is a value that
    sum is computed from (labelled with the first sum that reached it)."""
    if not any(ar.sliced is not None for ar in found):
        return found
    same: set[str] = set()
    computed_from: dict[str, str] = {}
    value_stack = [(operand, ar.name) for ar in found if not _scalars(comp[ar.name].shape)
                   for operand in _array_pieces(comp, comp[ar.name])]
    above: list[tuple[str, str]] = []
    while value_stack:
        name, summed_by = value_stack.pop()
        if name in same:
            continue
        same.add(name)
        inst = comp[name]
        (value_stack if inst.opcode in _SAME_VALUE else above).extend(
            (operand, summed_by) for operand in inst.operands)
    while above:
        name, summed_by = above.pop()
        if name in computed_from:
            continue
        computed_from[name] = summed_by
        above.extend((operand, summed_by) for operand in comp[name].operands
                     if operand not in computed_from)
    return [replace(ar, feeds=next((computed_from[read] for read in ar.sliced.reads
                                    if read in computed_from), ""))
            if ar.sliced is not None else ar for ar in found]


def _array_pieces(comp: Computation, all_reduce: Instruction) -> list[str]:
    """What ``all_reduce`` sums as arrays: its operands, but of a concatenation of
    pieces (the weight-update lowering joins small sums into one: a global norm's
    partial sums, one element each) only the pieces of more than one element; a
    one-element piece is a scalar's sum, as a scalar all-reduce is."""
    pieces = []
    for operand in all_reduce.operands:
        inst = comp[operand]
        if inst.opcode != "concatenate":
            pieces.append(operand)
            continue
        pieces.extend(piece for piece in inst.operands if not _one_element(comp[piece].shape))
    return pieces


def _async_wrapped(module: Module) -> dict[str, str]:
    """Computation an ``async-start`` runs asynchronously → that start's name."""
    return {getattr(inst.attr("calls"), "name", ""): inst.name
            for comp in module.computations for inst in comp.instructions
            if inst.opcode == "async-start"}


def find_reduce_scatters(module: Module) -> list[GradientAllReduce]:
    """Sum reduce-scatters over groups of more than one device: gradients already
    reduce-scattered (by the program or a previous pass), the update on the slice — or,
    where every use all-gathers the slice back (``psum_scatter`` then ``all_gather`` by
    hand), an all-reduce in two collectives, the update on the whole sum."""
    found: list[GradientAllReduce] = []
    for comp in module.computations:
        users: dict[str, list[str]] | None = None
        for inst in comp.instructions:
            if inst.opcode != "reduce-scatter" or not is_sum(module, inst):
                continue
            try:
                groups: DeviceGroups | None = device_groups(inst, module)
            except SingleDeviceGroups:
                continue
            except UnsupportedGroups:
                groups = None
            users = users_map(comp) if users is None else users
            if _gathered_back(comp, users, inst.name):
                found.append(GradientAllReduce(
                    comp.name, inst.name, groups, "reduce-scattered, then all-gathered back "
                    "whole (an all-reduce written as two collectives): the update runs on "
                    "the whole sum on every device; left as the program wrote it",
                    ReasonCode.GATHERED_BACK))
                continue
            found.append(GradientAllReduce(
                comp.name, inst.name, groups, "already sharded: reduce-scattered, the "
                "update runs on the slice", ReasonCode.ALREADY_SHARDED))
    return found


def _gathered_back(comp: Computation, users: dict[str, list[str]], name: str) -> bool:
    """Every use of ``name``, through layout-only ops, is an ``all-gather`` (and there is
    one)."""
    stack, gathered = [name], False
    while stack:
        for user in users.get(stack.pop(), ()):
            opcode = comp[user].opcode
            if opcode == "all-gather":
                gathered = True
            elif opcode in VIEWS:
                stack.append(user)
            else:
                return False
    return gathered


def is_sum(module: Module, inst: Instruction) -> bool:
    """The reducer ``inst`` applies (its ``to_apply``) is a scalar add: the one fact
    every pass that moves or splits a reduction checks first."""
    to_apply = inst.attr("to_apply")
    return reducer_opcode(module, getattr(to_apply, "name", "")) == "add"


def is_degenerate_sum(module: Module, comp: Computation, inst: Instruction) -> bool:
    """``inst`` is ``reduce(x, 0)`` adding over dimensions of size 1 only: a reshape (jax
    emits it to sum a bias gradient's broadcast dimension of size 1)."""
    if inst.opcode != "reduce" or len(inst.operands) != 2:
        return False
    source, init = comp[inst.operands[0]], comp[inst.operands[1]]
    return (isinstance(source.shape, ArrayShape)
            and is_sum(module, inst)
            and is_zero(comp, init)
            and all(source.shape.dims[d] == 1 for d in inst.ints_attr("dimensions")))


def started_slots(module: Module, comp: Computation, loop: Instruction,
                  read: Callable[[str], list[str]]) -> dict[int, tuple[str, int | None]]:
    """The slots of ``loop``'s initial tuple (a while in ``comp``) that a sum over devices
    starts (:func:`summed_start`), each start read by the tuple alone, once: slot → (the
    all-reduce, its element index). ``read`` names a value's readers. Such an accumulator
    (big_vision's first microbatch's gradient) holds that sum plus what the loop adds."""
    init = comp[loop.operands[0]] if loop.opcode == "while" and loop.operands else None
    if init is None or init.opcode != "tuple":
        return {}
    found = {}
    for slot, start in enumerate(init.operands):
        if read(start) == [init.name] and init.operands.count(start) == 1:
            summed = summed_start(module, comp, read, comp[start])
            if summed is not None:
                found[slot] = summed
    return found


def summed_start(module: Module, comp: Computation, read: Callable[[str], list[str]],
                 start: Instruction) -> tuple[str, int | None] | None:
    """The summing all-reduce ``start`` is — itself, or an element of a tuple one, either
    through views (:data:`~hlo_shard.opinfo.VIEWS`) and sums over dimensions of size 1
    (:func:`is_degenerate_sum`), each the only reader of what it reads (``read`` names a
    value's readers) — and the element's index (None for an array all-reduce); None
    where it is not one."""
    value = start
    while (value.opcode in VIEWS and len(value.operands) == 1
           or is_degenerate_sum(module, comp, value)) and \
            read(value.operands[0]) == [value.name]:
        value = comp[value.operands[0]]
    index = None
    if value.opcode == "get-tuple-element" and comp[value.operands[0]].opcode == "all-reduce":
        index = value.int_attr("index")
        value = comp[value.operands[0]]
    if value.opcode != "all-reduce" or not is_sum(module, value):
        return None
    return value.name, index


def device_index_values(comp: Computation, by_id_parameters: frozenset[int] = frozenset(),
                        constant_parameters: frozenset[int] = frozenset(), *,
                        module: Module | None = None,
                        carried: tuple[frozenset[int], frozenset[int]] | None = None
                        ) -> tuple[set[str], set[str]]:
    """The values of ``comp`` computed from the device's id and constants only, through
    index arithmetic (the partitioner's slice offsets: the same in every iteration of a
    loop whose body ``comp`` is, and the same computed anywhere else), and the constant
    ones among them. One forward walk. ``by_id_parameters`` / ``constant_parameters``:
    the parameter numbers of a fused computation whose fusion passes it such values.
    ``module``: a fusion of such values whose fused computation is index arithmetic
    (XLA's fused offsets) is one too (its fused computation walked once, not further).
    ``carried``: the slots of a loop body's tuple parameter that carry such values
    unchanged (:meth:`_ScatterForms.carried_index_slots`), from the id and constant."""
    by_id: set[str] = set()
    constant: set[str] = set()
    slots_by_id, constant_slots = carried or (frozenset(), frozenset())
    for inst in topological_order(comp):
        if module is not None and inst.opcode == "fusion" and inst.operands and \
                all(o in constant or o in by_id for o in inst.operands):
            body = module.computation(inst.called("calls"))
            inner_by_id, inner_constant = _fused_index_values(body, inst, (by_id, constant))
            if body.root_name in inner_by_id:
                by_id.add(inst.name)
            elif body.root_name in inner_constant:
                constant.add(inst.name)
            continue
        if inst.opcode == "parameter" and (by_id_parameters or constant_parameters):
            number = inst.param_number
            if number in by_id_parameters:
                by_id.add(inst.name)
            elif number in constant_parameters:
                constant.add(inst.name)
        elif inst.opcode == "get-tuple-element" and (slots_by_id or constant_slots) and \
                comp[inst.operands[0]].opcode == "parameter":
            slot = inst.int_attr("index")
            if slot in slots_by_id:
                by_id.add(inst.name)
            elif slot in constant_slots:
                constant.add(inst.name)
        elif inst.opcode in DEVICE_ID_OPCODES:
            by_id.add(inst.name)
        elif not inst.operands and inst.opcode in DETERMINISTIC_OPS:
            constant.add(inst.name)
        elif inst.opcode in _INDEX_ARITHMETIC and inst.operands:
            if all(o in constant for o in inst.operands):
                constant.add(inst.name)
            elif all(o in constant or o in by_id for o in inst.operands):
                by_id.add(inst.name)
    return by_id, constant


def _fused_index_values(body: Computation, fusion: Instruction,
                       outer: tuple[set[str], set[str]]) -> tuple[set[str], set[str]]:
    """:func:`device_index_values` of ``fusion``'s fused computation ``body``, its
    parameters seeded from ``outer`` (the fusion's computation's values from the id,
    and the constant ones)."""
    by_id, constant = outer
    return device_index_values(
        body, frozenset(k for k, o in enumerate(fusion.operands) if o in by_id),
        frozenset(k for k, o in enumerate(fusion.operands) if o in constant))


#: Ops that only re-lay a gradient out on its way to the slice (XLA writes the
#: partitioner's transposes and copies between the all-reduce and its dynamic-slice).
_LAYOUT_ONLY = VIEWS | frozenset({"convert", "get-tuple-element"})
#: Index arithmetic: what the partitioner computes a device's slice offset with (a
#: table lookup of the partition id, a multiply, a reshape to a scalar).
_INDEX_ARITHMETIC = frozenset({"dynamic-slice", "reshape", "bitcast", "convert", "copy",
                               "multiply", "add", "subtract", "divide", "remainder",
                               "clamp", "select", "compare", "minimum", "maximum", "slice",
                               "broadcast"})
#: What the walk reads the users of: layout-only ops, a loop's result tuple (read
#: through its get-tuple-elements) and a carried slot's update.
_WALKED = _LAYOUT_ONLY | frozenset({"while", "parameter", "dynamic-update-slice"})
#: What a device reads its own id from (an index computed from these differs per device).
DEVICE_ID_OPCODES = DEVICE_IDS


@dataclass(frozen=True)
class SlotReads:
    """A while loop running a scanned body, and every read of a carried slot after it: each
    get-tuple-element of the slot, with how it reaches this device's slice."""

    computation: str
    loop: str
    reads: tuple[tuple[str, DeviceSliced], ...]


@dataclass(frozen=True)
class CarriedWrite:
    """A sum written by the ``dynamic-update-slice`` ``update`` into ``slot`` of the tuple
    its loop body carries, which leaves every loop running the body only as this device's
    slice (``loops``)."""

    update: str
    slot: int
    loops: tuple[SlotReads, ...]


@dataclass(frozen=True)
class DeviceSliced:
    """How an all-reduce's sum reaches only this device's slice, each way it is read:
    ``slices``, the dynamic-slices it reaches through layout-only ops
    (:func:`layout_chain`), and ``carried``, the loop slots it is written into (a scanned
    layer's gradient, stacked in the carry). The matcher the reduce-scatter rewrite runs
    reads exactly this form."""

    slices: tuple[str, ...] = ()
    carried: tuple[CarriedWrite, ...] = ()
    #: Fusions whose fused computation reads it only as such a slice (the pair as XLA
    #: fused it: the form the hook sees on CPU), which no rewrite reads into.
    fused: tuple[str, ...] = ()

    @property
    def loops(self) -> tuple[str, ...]:
        return tuple(sorted({reads.loop for write in self.carried for reads in write.loops}))

    @property
    def reads(self) -> tuple[str, ...]:
        """Every instruction that takes the slice: the dynamic-slices and the fusions."""
        return self.slices + self.fused

    def words(self) -> str:
        if not self.carried:
            fused = " (fused by XLA into the kernels that read it)" if self.fused else ""
            return ("already sharded: every user takes this device's slice (dynamic-slice by "
                    f"partition/replica id, the SPMD partitioner's reduce-scatter form{fused}), "
                    "the update runs on the slice")
        loops = ", ".join(f"%{name}" for name in self.loops)
        return ("already sharded: written into a slot the loop carries, which leaves "
                f"{loops} only as this device's slice (dynamic-slice by partition/replica "
                "id after the loop: the SPMD partitioner's reduce-scatter form across a "
                "scan), the update runs on the slice")


def layout_chain(comp: Computation, value: str, end: str) -> list[Instruction]:
    """The layout-only ops :class:`DeviceSliced` found between ``value`` and ``end`` (the
    operand of the slice or write they lead to), in order: each reads the one before
    as its only operand, so the chain is walked back from its end."""
    chain: list[Instruction] = []
    while end != value:
        chain.append(comp[end])
        end = comp[end].operands[0]
    return chain[::-1]


class _ScatterForms:
    """Each computation's :class:`_ScatterForm`, made once, and which while loops run
    each body (read once, when a carried slot is first asked about)."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self._forms: dict[str, _ScatterForm] = {}
        self._loops: dict[str, list[tuple[Computation, Instruction]]] | None = None
        self._fused_users: dict[str, dict[str, list[str]]] = {}
        self._sliced_slots: dict[tuple[str, str],
                                 dict[int, tuple[tuple[str, DeviceSliced], ...]]] = {}

    def of(self, comp: Computation) -> _ScatterForm:
        form = self._forms.get(comp.name)
        if form is None:
            form = self._forms[comp.name] = _ScatterForm(comp, self)
        return form

    def fused_users(self, body: Computation) -> dict[str, list[str]]:
        """The users of each value of the fused computation ``body``, read once."""
        found = self._fused_users.get(body.name)
        if found is None:
            found = self._fused_users[body.name] = users_map(body)
        return found

    def loops_running(self, body: Computation) -> list[tuple[Computation, Instruction]]:
        """(computation, while) of every loop whose body is ``body``; none where anything
        else calls it too (its result would go elsewhere as well)."""
        if self._loops is None:
            self._loops = {}
            elsewhere: set[str] = set()
            for comp in self.module.computations:
                for inst in comp.instructions:
                    body_name = inst.called("body") if inst.opcode == "while" else None
                    if body_name is not None:
                        self._loops.setdefault(body_name, []).append((comp, inst))
                    elsewhere.update(name for name in inst.called_computations()
                                     if name != body_name)
            for name in elsewhere:
                self._loops.pop(name, None)
        return self._loops.get(body.name, [])

    def carried_index_slots(self, body: Computation) -> tuple[frozenset[int], frozenset[int]]:
        """The slots of the loop body ``body``'s tuple parameter that carry a value computed
        from the device's id and constants unchanged through every iteration of every
        loop running it (a slice offset XLA hoisted out of the loop): (those from the id,
        the constant ones). Empty where something else calls ``body`` or a loop's start
        is not a tuple made there; the loops' computations' values must be read first
        (:meth:`_ScatterForm._device_ids` does, outermost first)."""
        loops = self.loops_running(body)
        params = body.parameters()
        if not loops or len(params) != 1 or body.root_name is None or \
                body.root.opcode != "tuple":
            return frozenset(), frozenset()
        param = params[0].name
        unchanged = {slot for slot, name in enumerate(body.root.operands)
                     if body[name].opcode == "get-tuple-element" and
                     body[name].operands[0] == param and body[name].int_attr("index") == slot}
        by_id, constant = set(unchanged), set(unchanged)
        for outer, loop in loops:
            ids = self.of(outer).known_device_ids
            start = outer.get(loop.operands[0]) if loop.operands else None
            if ids is None or start is None or start.opcode != "tuple":
                return frozenset(), frozenset()
            outer_by_id, outer_constant = ids
            for slot in unchanged:
                value = start.operands[slot] if slot < len(start.operands) else None
                if value not in outer_constant:
                    constant.discard(slot)
                    if value not in outer_by_id:
                        by_id.discard(slot)
        return frozenset(by_id - constant), frozenset(constant)

    def sliced_slots(self, comp: Computation, loop: Instruction
                     ) -> dict[int, tuple[tuple[str, DeviceSliced], ...]]:
        """The slots of ``loop``'s result read only as this device's slice, each with its
        get-tuple-elements and how they reach it (:meth:`_ScatterForm.sliced_by_device`,
        not through a further loop): its condition does not read the slot; none where
        the loop's tuple is also used whole."""
        key = (comp.name, loop.name)
        if key not in self._sliced_slots:
            self._sliced_slots[key] = self._read_sliced_slots(comp, loop)
        return self._sliced_slots[key]

    def _read_sliced_slots(self, comp: Computation, loop: Instruction
                           ) -> dict[int, tuple[tuple[str, DeviceSliced], ...]]:
        form = self.of(comp)
        reads = form.slot_reads(loop.name)
        if reads is None:
            return {}
        condition = self.module.computation(loop.called("condition"))
        read_by_condition = set(self.of(condition).parameter_slot_reads())
        sliced: dict[int, tuple[tuple[str, DeviceSliced], ...]] = {}
        for slot, names in reads.items():
            if slot in read_by_condition:
                continue
            found = []
            for name in names:
                how = form.sliced_by_device(comp[name], through_loops=False)
                if how is None:
                    break
                found.append((name, how))
            else:
                sliced[slot] = tuple(found)
        return sliced


class _ScatterForm:
    """Recognises the SPMD partitioner's reduce-scatter form in one computation: an
    all-reduce whose users all ``dynamic-slice`` a strict part of it at offsets computed
    from the device's id — here, or, in a loop body, after the loop: the sum written
    into a carried slot the loop's users read only as such slices. The users of what
    the walk can visit are read once, on the first all-reduce asked about, and the
    id-derived values on the first dynamic-slice."""

    def __init__(self, comp: Computation, forms: _ScatterForms) -> None:
        self.comp = comp
        # Weak: the forms hold this one, and a cycle would keep the whole module alive
        # until the cycle collector ran (inside XLA's compile, under install()).
        self.forms: _ScatterForms = weakref.proxy(forms)
        self._users: dict[str, list[str]] | None = None
        self._ids: tuple[set[str], set[str]] | None = None
        self._parameter_reads: dict[int, list[str]] | None = None
        #: Per fusion read: the operands it takes only this device's slice of.
        self._fused: dict[str, frozenset[str]] = {}

    def _read(self) -> dict[str, list[str]]:
        """The users of the values the walk can visit (all-reduces, layout-only ops, a
        loop's tuple and a carried slot's update): a users index of those only, in one
        scan."""
        if self._users is None:
            instructions = self.comp.instructions
            self._users = {inst.name: [] for inst in instructions
                           if inst.opcode in _WALKED or inst.opcode in ALL_REDUCES}
            users = self._users
            for inst in instructions:
                for operand in dict.fromkeys(inst.operands):
                    found = users.get(operand)
                    if found is not None:
                        found.append(inst.name)
        return self._users

    def slot_reads(self, tuple_name: str) -> dict[int, list[str]] | None:
        """:func:`slot_reads` of the tuple ``tuple_name`` (a loop or this body's
        parameter) here."""
        return slot_reads(self.comp, self._read(), tuple_name)

    def parameter_slot_reads(self) -> dict[int, list[str]]:
        """:meth:`slot_reads` of this computation's tuple parameter (every slot, where it
        is used whole), read once."""
        if self._parameter_reads is None:
            params = [inst for inst in self.comp.instructions if inst.opcode == "parameter"]
            self._parameter_reads = {}
            if len(params) == 1 and isinstance(params[0].shape, TupleShape):
                reads = self.slot_reads(params[0].name)
                self._parameter_reads = reads if reads is not None else \
                    {slot: [] for slot in range(len(params[0].shape.elements))}
        return self._parameter_reads

    @property
    def known_device_ids(self) -> tuple[set[str], set[str]] | None:
        """:meth:`_device_ids` if read already."""
        return self._ids

    def _device_ids(self) -> tuple[set[str], set[str]]:
        """:func:`device_index_values`, read once, when the first dynamic-slice is asked
        about; in a loop body, with the offsets its loops carry in unchanged
        (:meth:`_ScatterForms.carried_index_slots`), the loops' computations read first,
        outermost first (a stack, not recursion: loops nest as deep as the input)."""
        pending, stacked = [self], {id(self)}
        while pending:
            form = pending[-1]
            if form._ids is not None:
                pending.pop()
                continue
            waiting = [outer for outer in (self.forms.of(comp) for comp, _ in
                                           self.forms.loops_running(form.comp))
                       if outer._ids is None and id(outer) not in stacked]
            if waiting:
                pending.extend(waiting)
                stacked.update(map(id, waiting))
                continue
            pending.pop()
            form._ids = device_index_values(
                form.comp, module=self.forms.module,
                carried=self.forms.carried_index_slots(form.comp))
        assert self._ids is not None
        return self._ids

    def sliced_by_device(self, value: Instruction, through_loops: bool = True
                         ) -> DeviceSliced | None:
        """How every use of ``value`` (through layout-only ops) reaches only a dynamic-slice
        of a strict part of it at offsets that depend on the device's id and nothing
        else; None where one does not. ``through_loops``: a use may also write it into a
        slot this loop body carries, which every loop running the body reads only as
        such slices (not followed further out)."""
        users = self._read()
        pending = [value.name]
        slices: list[str] = []
        carried: list[CarriedWrite] = []
        fused: list[str] = []
        while pending:
            name = pending.pop()
            if name == self.comp.root_name or not users[name]:
                return None
            for user_name in users[name]:
                user = self.comp[user_name]
                if user.opcode in _LAYOUT_ONLY:
                    pending.append(user_name)
                elif self._device_slice(user, name):
                    slices.append(user_name)
                elif self._fused_device_slice(user, name):
                    fused.append(user_name)
                elif through_loops and (write := self._carried_write(user, name)) is not None:
                    carried.append(write)
                else:
                    return None
        return DeviceSliced(tuple(slices), tuple(carried), tuple(fused)) \
            if slices or carried or fused else None

    def _device_slice(self, user: Instruction, value: str) -> bool:
        if user.opcode != "dynamic-slice" or user.operands[0] != value or value in \
                user.operands[1:]:
            return False
        return _takes_device_part(self.comp, user, self._device_ids)

    def _fused_device_slice(self, user: Instruction, value: str) -> bool:
        """``user`` is a fusion whose fused computation reads ``value`` (one operand) only
        as :meth:`_device_slice` would take it (:meth:`_fused_slices`)."""
        if user.opcode != "fusion":
            return False
        found = self._fused.get(user.name)
        if found is None:
            found = self._fused[user.name] = self._fused_slices(user)
        return value in found

    def _fused_slices(self, user: Instruction) -> frozenset[str]:
        """The operands of the fusion ``user``, each passed once, that its fused
        computation reads only through layout-only ops, each read once, as one
        dynamic-slice of a strict part at offsets computed from the device's id (passed
        in, or read inside) and constants. One walk of the fused computation."""
        body = self.forms.module.computation(user.called("calls"))
        users = self.forms.fused_users(body)
        passed = Counter(user.operands)

        @functools.cache
        def fused_ids() -> tuple[set[str], set[str]]:  # read where a slice is met
            return _fused_index_values(body, user, self._device_ids())

        found = set()
        for parameter in body.parameters():
            number = parameter.param_number
            if number >= len(user.operands) or passed[user.operands[number]] != 1:
                continue
            end = parameter
            while len(users[end.name]) == 1 and end.name != body.root_name:
                end = body[users[end.name][0]]
                if end.opcode not in _LAYOUT_ONLY or len(end.operands) != 1:
                    break
            if end.opcode == "dynamic-slice" and end.operands.count(end.operands[0]) == 1 \
                    and _takes_device_part(body, end, fused_ids):
                found.add(user.operands[number])
        return frozenset(found)

    def _carried_write(self, user: Instruction, value: str) -> CarriedWrite | None:
        """Where ``user`` writes ``value`` into a carried slot read nowhere else in the
        body, sliced by device after every loop that runs the body
        (:meth:`_ScatterForms.sliced_slots`): that write; None where it does not."""
        comp = self.comp
        if user.opcode != "dynamic-update-slice" or user.operands[1] != value or \
                value in (user.operands[0], *user.operands[2:]):
            return None
        root = comp.root
        slot_reads = self.parameter_slot_reads()
        slot = comp[user.operands[0]].int_attr("index") \
            if comp[user.operands[0]].opcode == "get-tuple-element" else None
        if slot is None or slot_reads.get(slot) != [user.operands[0]] or \
                self._read()[user.operands[0]] != [user.name] or \
                self._read()[user.name] != [root.name] or root.opcode != "tuple" or \
                slot >= len(root.operands) or root.operands[slot] != user.name or \
                root.operands.count(user.name) != 1:
            return None
        loops = []
        for outer, loop in self.forms.loops_running(comp):
            reads = self.forms.sliced_slots(outer, loop).get(slot)
            if reads is None:
                return None
            loops.append(SlotReads(outer.name, loop.name, reads))
        return CarriedWrite(user.name, slot, tuple(loops)) if loops else None


def _takes_device_part(comp: Computation, ds: Instruction,
                       ids: Callable[[], tuple[set[str], set[str]]]) -> bool:
    """The dynamic-slice ``ds`` of ``comp`` takes a strict part of its operand at offsets
    computed from the device's id and constants, one at least from the id (``ids``:
    :func:`device_index_values` of ``comp``, read only where the shapes allow it)."""
    whole, part = comp[ds.operands[0]].shape, ds.shape
    if not isinstance(whole, ArrayShape) or not isinstance(part, ArrayShape) or \
            part.num_elements >= whole.num_elements:
        return False
    offsets = ds.operands[1:]
    by_id, constant = ids()
    return all(o in by_id or o in constant for o in offsets) and \
        any(o in by_id for o in offsets)


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
_GROUPED = GROUPED


def slot_reads(comp: Computation, users: dict[str, list[str]], tuple_name: str
               ) -> dict[int, list[str]] | None:
    """Slot → the get-tuple-elements reading it, of the tuple ``tuple_name`` in ``comp``
    (a loop's result or a computation's tuple parameter; ``users``: its users); None
    where the tuple is also used whole (or is the root)."""
    if tuple_name == comp.root_name:
        return None
    reads: dict[int, list[str]] = {}
    for user_name in users[tuple_name]:
        user = comp[user_name]
        slot = user.int_attr("index")
        if user.opcode != "get-tuple-element" or slot is None:
            return None
        reads.setdefault(slot, []).append(user_name)
    return reads


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
            if inst.opcode not in _GROUPED:
                continue
            groups = inst.attr("replica_groups")
            if not isinstance(groups, ReplicaGroups) or not groups.groups:
                continue
            key = "num_partitions" if group_mode(inst) in (
                GroupMode.CROSS_PARTITION, GroupMode.FLATTENED_ID) else "replica_count"
            top = max(d for g in groups.groups for d in g) + 1
            largest[key] = max(largest.get(key, 1), top)
    if len(largest) != 1 or max(largest.values()) < 2:
        return {}  # both kinds at once: which ids are whose is not recoverable
    return largest


def with_device_counts(module: Module) -> Module:
    """``module`` with the device counts its header lost (a module taken from XLA's
    pass hook, or dumped before the header was filled in) recovered from its
    collectives' groups, as the sharding pass writes them into its output's header:
    the module as the pass, the cost model and the planners read it (the module itself
    is not changed).

    Every rate of a profile measured at several device counts depends on the count
    (N devices share one host's cores), and so do the group sizes of collectives
    without explicit groups: an original priced at the header's count of one device
    and its rewrite at the recovered eight would differ by the whole step, whatever
    the rewrite changed."""
    recovered = recovered_device_counts(module)
    return replace(module, header={**module.header, **recovered}) if recovered else module
