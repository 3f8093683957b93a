"""Turning a module as read into the form the runtime executes: replica form.

What replica form is, and why, is the pass :class:`hlo_shard.passes.replica_form.ReplicaForm`;
here :func:`replica_form` first refuses what cannot be executed faithfully
(:func:`check_executable`) and runs the pass on a copy.
"""

from __future__ import annotations


from hlo_shard.errors import HloShardError
from hlo_shard.ir import Module, Raw, Str, TupleShape
from hlo_shard.passes.replica_form import (  # noqa: F401 (runtime.forms API)
    DONATION_ATTRIBUTES, ReplicaForm, renumber_channels, split_variadic_all_reduces)

#: Custom calls that only exist before SPMD partitioning (global programs).
GLOBAL_PROGRAM_TARGETS = ("xla.sdy.", "Sharding", "SPMDFullToShardShape",
                          "SPMDShardToFullShape")


def global_program_mark(module: Module) -> str:
    """What shows ``module`` is the global program before SPMD partitioning ("%c is a
    'Sharding' custom call", "%p carries a Shardy sharding"); "" where nothing does. A
    per-device module keeps ``sharding={devices=...}`` on its parameters, not Shardy's
    ``xla.sdy.sharding`` frontend attributes (jax's before_optimizations dump)."""
    for comp in module.computations:
        for inst in comp.instructions:
            target = inst.attributes.get("custom_call_target")
            if isinstance(target, Str) and target.value.startswith(GLOBAL_PROGRAM_TARGETS):
                return f"%{inst.name} is a {target.value!r} custom call"
            frontend = inst.attributes.get("frontend_attributes")
            if isinstance(frontend, Raw) and "xla.sdy.sharding" in frontend.text:
                return f"%{inst.name} carries a Shardy sharding (xla.sdy.sharding)"
    return ""


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
    mark = global_program_mark(module)
    if mark:
        raise HloShardError(
            f"{where}: {mark}, so this is a global program before SPMD partitioning; verify "
            "runs per-device modules (the *.spmd-partitioner.after_call-inliner… dump)")
    for param in module.entry.parameters():
        if isinstance(param.shape, TupleShape):
            raise HloShardError(f"{where}: entry parameter %{param.name} is a tuple; "
                                "tuple-shaped entry parameters are not supported")


def replica_form(module: Module, *, keep_donation: bool = False,
                 replicas: int | None = None) -> Module:
    """An executable copy of ``module`` in replica form (see :mod:`hlo_shard.passes.replica_form`);
    ``keep_donation`` puts its input/output aliasing back, so the executable consumes
    its donated inputs (:mod:`hlo_shard.jax` donates as the user's jit step does);
    ``replicas``: a module written for one device runs as that many replicas."""
    check_executable(module)
    out = module.clone()
    ReplicaForm(keep_donation=keep_donation, replicas=replicas).run(out)
    return out
