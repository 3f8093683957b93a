"""The replica form the runtime executes, as a pass (the module as read → replica form).

With ``num_partitions > 1`` XLA always runs its SPMD partitioner, which would treat a
per-device module as a global program and partition it again (executing-hlo-with-jax.md
§5.1). So a per-device SPMD module runs in replica form: shardings stripped,
``partition-id`` → ``replica-id``, ``replica_count=N`` instead of ``num_partitions=N``.
Flattened-id collectives keep their meaning since the flattened id equals the replica
id when there is one partition. A cross-partition collective (a ``channel_id`` and no
``use_global_device_ids``: the SPMD partitioner's all-to-all and collective-permute on
a mesh with more than one axis) names partitions, which one partition cannot hold, so
it loses its ``channel_id`` and reads the same ids as replicas (cross-replica mode). An
all-reduce, reduce-scatter or all-gather with a ``channel_id`` and no (or a false)
``use_global_device_ids`` (cross-replica-and-partition) groups its one replica with
every partition: it becomes a cross-replica collective over all devices.

Every executed module also gets unique channel ids (XLA's CPU compiler miscompiles
shared ids, §7.3; send/recv pairs keep sharing theirs) and loses
``input_output_alias``/``buffer_donor`` (donation deletes the inputs we reuse) unless
``keep_donation`` (an executable that consumes its donated inputs, as jit's does).
Variadic all-reduces XLA:CPU cannot compile become one all-reduce per element (see
:func:`split_variadic_all_reduces`). ``hlo_shard.runtime.forms.replica_form`` runs this
pass on a copy after checking the module can be executed at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hlo_shard.analysis.collectives import GroupMode, group_mode
from hlo_shard.errors import HloShardError
from hlo_shard.graph import ModuleRewriter, Rewriter
from hlo_shard.ir import (Computation, Instruction, Module, ReplicaGroups, TupleShape,
                          shape_leaves)
from hlo_shard.opinfo import CHANNEL_PAIRED, CHANNEL_UNIQUE
from hlo_shard.passes.base import ModulePass

#: Header attributes dropped for execution: donation would delete reused inputs.
DONATION_ATTRIBUTES = ("input_output_alias", "buffer_donor")


@dataclass(frozen=True)
class ReplicaFormReport:
    #: Devices the module runs on (its replicas, afterwards).
    devices: int
    #: It was an SPMD module (``num_partitions`` became ``replica_count``).
    from_spmd: bool
    #: Variadic all-reduces split into one all-reduce per element.
    split_all_reduces: tuple[str, ...]
    #: Instructions whose channel id has a new value.
    renumbered_channels: int


@dataclass(frozen=True)
class ReplicaForm(ModulePass[ReplicaFormReport]):
    """Turn a per-device module (SPMD or replica form) into replica form, in place;
    ``keep_donation`` keeps its input/output aliasing; ``replicas`` runs a module written
    for one device as that many replicas (the runtime's ``load(..., devices)``)."""

    name: ClassVar[str] = "replica-form"
    keep_donation: bool = False
    replicas: int | None = None

    def __post_init__(self) -> None:
        if self.replicas is not None and self.replicas < 1:
            raise HloShardError(f"replica form needs at least one replica, not {self.replicas}")

    def apply(self, module: Module, rewriter: ModuleRewriter) -> ReplicaFormReport:
        if module.replica_count > 1 and module.num_partitions > 1:
            raise HloShardError(f"{module.name}: replica form needs replica_count or "
                                "num_partitions to be 1")
        spmd = module.num_partitions > 1
        devices = module.device_count
        _replica_header(rewriter, spmd, devices, self.keep_donation)
        if self.replicas is not None and self.replicas != devices:
            if devices > 1:
                raise HloShardError(f"{module.name} is written for {devices} devices, "
                                    f"not {self.replicas}")
            devices = self.replicas
            rewriter.set_header("replica_count", devices)
        split: list[str] = []
        for comp in module.computations:
            rw = rewriter.rewriter(comp)
            for inst in comp.instructions:
                rw.pop_attr(inst, "sharding")
                if spmd and inst.opcode == "partition-id":
                    rw.set_opcode(inst, "replica-id")
                mode = group_mode(inst) if spmd and inst.opcode in CHANNEL_UNIQUE else None
                if mode in _NAMING_PARTITIONS:
                    rw.pop_attr(inst, "channel_id")
                    rw.pop_attr(inst, "use_global_device_ids")  # (false)
                if mode is GroupMode.CROSS_REPLICA_AND_PARTITION:
                    # (the one replica's group spans every partition: all devices)
                    rw.set_attr(inst, "replica_groups", ReplicaGroups(()))
            split += _split_variadic_all_reduces(rw)
        return ReplicaFormReport(devices, spmd, tuple(split), _renumber_channels(rewriter))


#: The modes whose groups span partitions without flattened ids (a ``channel_id``
#: without ``use_global_device_ids``, or with it false).
_NAMING_PARTITIONS = (GroupMode.CROSS_PARTITION, GroupMode.CROSS_REPLICA_AND_PARTITION)


def _replica_header(edits: ModuleRewriter, spmd: bool, devices: int,
                    keep_donation: bool) -> None:
    """Drop donation (unless kept) and ``num_partitions``; an SPMD module's
    ``num_partitions=N`` becomes ``replica_count=N`` in its place (the printer keeps
    header order)."""
    for key in () if keep_donation else DONATION_ATTRIBUTES:
        edits.pop_header(key)
    if spmd:
        edits.set_header("replica_count", devices, replacing="num_partitions")
    else:
        edits.pop_header("num_partitions")


def renumber_channels(module: Module) -> int:
    """Give every channel id a fresh value 1, 2, 3 … in program order; instructions
    paired by a channel (send/recv and their -done) keep sharing one. Returns how many
    ids changed."""
    return _renumber_channels(ModuleRewriter(module))


def _renumber_channels(edits: ModuleRewriter) -> int:
    paired: dict[int, int] = {}
    next_id = 1
    renumbered = 0
    for comp in edits.module.computations:
        rw = edits.rewriter(comp)
        for inst in comp.instructions:
            old = inst.attributes.get("channel_id")
            if not isinstance(old, int) or isinstance(old, bool):
                continue
            if inst.opcode in CHANNEL_PAIRED:
                if old not in paired:
                    paired[old] = next_id
                    next_id += 1
                new = paired[old]
            else:
                new, next_id = next_id, next_id + 1
            renumbered += new != old
            rw.set_attr(inst, "channel_id", new)
    return renumbered


def split_variadic_all_reduces(comp: Computation) -> list[str]:
    """Rewrite each variadic all-reduce XLA:CPU fails to compile into one all-reduce per
    element and a ``tuple`` of their results under the original name, so its
    get-tuple-element users are unchanged; the sums are the same, element by element.

    Two forms fail (jaxlib 0.10): one with a ``channel_id`` ("LogicalBuffer … does not
    have a layout"), and one with an operand in a non-default layout whose users change
    layouts ("requires all operands to be defined in the parent region", in the HLO →
    StableHLO translation). The split parts get fresh channel ids from
    :func:`renumber_channels`. Returns the names of the split all-reduces.
    """
    return _split_variadic_all_reduces(Rewriter(comp))


def _split_variadic_all_reduces(rw: Rewriter) -> list[str]:
    comp = rw.comp
    split = []
    for inst in list(comp.instructions):
        if inst.opcode != "all-reduce" or not isinstance(inst.shape, TupleShape) \
                or not _fails_as_variadic(rw, inst):
            continue
        with rw.inserting_before(inst.name):
            parts = [rw.add_instruction(Instruction(
                name=rw.fresh_name(inst.name), opcode="all-reduce", shape=element,
                operands=[operand], attributes=dict(inst.attributes)))
                for operand, element in zip(inst.operands, inst.shape.elements)]
        rw.set_opcode(inst, "tuple")
        rw.set_operands(inst, [part.name for part in parts])
        for key in list(inst.attributes):
            rw.pop_attr(inst, key)
        split.append(inst.name)
    return split


def _fails_as_variadic(rw: Rewriter, inst: Instruction) -> bool:
    """Whether ``inst`` (a variadic all-reduce) is one of the forms XLA:CPU refuses."""
    return "channel_id" in inst.attributes or any(
        not leaf.is_row_major
        for operand in rw.operands(inst) for _, leaf in shape_leaves(operand.shape))


__all__ = ["DONATION_ATTRIBUTES", "ReplicaForm", "ReplicaFormReport", "renumber_channels",
           "split_variadic_all_reduces"]
