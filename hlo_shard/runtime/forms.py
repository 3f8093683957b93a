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
All edits are on the IR, on a copy.
"""

from __future__ import annotations

import copy

from hlo_shard.errors import HloShardError
from hlo_shard.ir import Module, Str, TupleShape

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
