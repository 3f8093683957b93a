"""Turning a module as read into the form the runtime executes: replica form.

With ``num_partitions > 1`` XLA always runs its SPMD partitioner, which would treat a
per-device module as a global program and partition it again (executing-hlo-with-jax.md
§5.1). So a per-device SPMD module runs in replica form: shardings stripped,
``partition-id`` → ``replica-id``, ``replica_count=N`` instead of ``num_partitions=N``.
Flattened-id collectives keep their meaning since the flattened id equals the replica
id when there is one partition.

Every executed module also gets unique channel ids (XLA's CPU compiler miscompiles
shared ids, §7.3; send/recv pairs keep sharing theirs) and loses
``input_output_alias``/``buffer_donor`` (donation deletes the inputs we reuse).
Variadic all-reduces XLA:CPU cannot compile become one all-reduce per element (see
:func:`split_variadic_all_reduces`). All edits are on the IR, on a copy.
"""

from __future__ import annotations

import copy

from hlo_shard.errors import HloShardError
from hlo_shard.graph import Rewriter
from hlo_shard.ir import Computation, Instruction, Module, Str, TupleShape, shape_leaves

#: Header attributes dropped for execution: donation would delete reused inputs.
DONATION_ATTRIBUTES = ("input_output_alias", "buffer_donor")
#: Ops whose channel id pairs two instructions: equal ids must stay equal.
PAIRED_CHANNEL_OPS = frozenset({"send", "recv", "send-done", "recv-done"})
#: Custom calls that only exist before SPMD partitioning (global programs).
GLOBAL_PROGRAM_TARGETS = ("xla.sdy.", "Sharding", "SPMDFullToShardShape",
                          "SPMDShardToFullShape")


def device_count(module: Module) -> int:
    """How many devices the module is written for."""
    return max(module.replica_count, module.num_partitions)


def check_executable(module: Module) -> None:
    """Refuse what cannot be executed faithfully, with the reason and the fix."""
    where = module.source_path or module.name
    if module.is_scheduled:
        # Before: XLA aborted inside its compiler (Check failed: input_shape.has_layout()).
        raise HloShardError(
            f"{where}: this is an XLA-optimized module (is_scheduled=true, an "
            "*after_optimizations dump); XLA cannot recompile its own optimized CPU modules, "
            "so it cannot be executed — verify the per-device module optimize reads (the "
            "*.spmd-partitioner.after_call-inliner… dump)")
    if module.replica_count > 1 and module.num_partitions > 1:
        raise HloShardError(
            f"{where}: modules with both replica_count={module.replica_count} and "
            f"num_partitions={module.num_partitions} are not supported yet")
    for comp in module.computations:
        for inst in comp.instructions:
            if inst.is_elided_constant:
                raise HloShardError(
                    f"{where}: constant %{inst.name} in %{comp.name} is elided as {{...}} "
                    "(the module was dumped without --xla_dump_large_constants); its values "
                    "are unknown, so the module cannot be executed")
            target = inst.attributes.get("custom_call_target")
            if isinstance(target, Str) and target.value.startswith(GLOBAL_PROGRAM_TARGETS):
                raise HloShardError(
                    f"{where}: %{inst.name} is a {target.value!r} custom call, so this is a "
                    "global program before SPMD partitioning; verify runs per-device modules "
                    "(the *.spmd-partitioner.after_call-inliner… dump)")
    for param in module.entry.parameters():
        if isinstance(param.shape, TupleShape):
            raise HloShardError(f"{where}: entry parameter %{param.name} is a tuple; "
                                "tuple-shaped entry parameters are not supported")


def replica_form(module: Module) -> Module:
    """An executable copy of ``module`` in replica form (see the module docstring)."""
    check_executable(module)
    out = copy.deepcopy(module)
    devices = device_count(module)
    spmd = module.num_partitions > 1
    header: dict = {}
    for key, value in out.header.items():
        if key in DONATION_ATTRIBUTES or (key == "replica_count" and spmd):
            continue
        if key == "num_partitions":
            if spmd:
                header["replica_count"] = devices
            continue
        header[key] = value
    out.header = header
    for comp in out.computations:
        for inst in comp.instructions:
            inst.attributes.pop("sharding", None)
            if spmd and inst.opcode == "partition-id":
                inst.opcode = "replica-id"
        split_variadic_all_reduces(comp)
    renumber_channels(out)
    return out


def renumber_channels(module: Module) -> None:
    """Give every channel id a fresh value 1, 2, 3 … in program order; instructions
    paired by a channel (send/recv and their -done) keep sharing one."""
    paired: dict[int, int] = {}
    next_id = 1
    for comp in module.computations:
        for inst in comp.instructions:
            old = inst.attributes.get("channel_id")
            if not isinstance(old, int) or isinstance(old, bool):
                continue
            if inst.opcode in PAIRED_CHANNEL_OPS:
                if old not in paired:
                    paired[old] = next_id
                    next_id += 1
                inst.attributes["channel_id"] = paired[old]
            else:
                inst.attributes["channel_id"] = next_id
                next_id += 1


def split_variadic_all_reduces(comp: Computation) -> None:
    """Rewrite each variadic all-reduce XLA:CPU fails to compile into one all-reduce per
    element and a ``tuple`` of their results under the original name, so its
    get-tuple-element users are unchanged; the sums are the same, element by element.

    Two forms fail (jaxlib 0.10): one with a ``channel_id`` ("LogicalBuffer … does not
    have a layout"), and one with an operand in a non-default layout whose users change
    layouts ("requires all operands to be defined in the parent region", in the HLO →
    StableHLO translation). The split parts get fresh channel ids from
    :func:`renumber_channels`.
    """
    rewriter = Rewriter(comp)
    for inst in list(comp.instructions):
        if inst.opcode != "all-reduce" or not isinstance(inst.shape, TupleShape) \
                or not _fails_as_variadic(comp, inst):
            continue
        with rewriter.inserting_before(inst.name):
            parts = [rewriter.add_instruction(Instruction(
                name=rewriter.fresh_name(inst.name), opcode="all-reduce", shape=element,
                operands=[operand], attributes=dict(inst.attributes)))
                for operand, element in zip(inst.operands, inst.shape.elements)]
        inst.opcode = "tuple"
        inst.operands = [part.name for part in parts]
        inst.attributes = {}


def _fails_as_variadic(comp: Computation, inst: Instruction) -> bool:
    """Whether ``inst`` (a variadic all-reduce) is one of the forms XLA:CPU refuses."""
    return "channel_id" in inst.attributes or any(
        leaf.minor_to_major() != tuple(range(leaf.rank - 1, -1, -1))
        for operand in comp.operands_of(inst) for _, leaf in shape_leaves(operand.shape))
