"""``get-tuple-element(tuple(a, b, …), i)`` → the ``i``-th operand.

A pure simplification that lets the weight-update region flow through the tuples jax
wraps around shard_map outputs. It runs before the weight-update pass, on the
computations that pass may edit (by default; the ``computations`` option names others):
forwarding elsewhere would change the text of computations the optimizer leaves alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hlo_shard.graph import Change, Rewriter
from hlo_shard.ir import Computation, Module
from hlo_shard.passes.base import ModulePass, PassResult
from hlo_shard.passes.weight_update import rewritten_computations


@dataclass(frozen=True)
class ForwardedTuples:
    """Per computation edited: how many tuple elements were forwarded."""

    forwarded: dict[str, int]


@dataclass(frozen=True)
class TupleForwarding(ModulePass[ForwardedTuples]):
    """Forward tuple elements in ``computations`` (None: the computations
    :func:`~hlo_shard.passes.weight_update.rewritten_computations` names)."""

    name: ClassVar[str] = "tuple-forwarding"
    computations: tuple[str, ...] | None = None

    def apply(self, module: Module) -> PassResult[ForwardedTuples]:
        names = rewritten_computations(module) if self.computations is None \
            else self.computations
        changes: list[Change] = []
        forwarded: dict[str, int] = {}
        for name in names:
            count, edits = forward_tuple_elements(module.computation(name))
            if count:
                forwarded[name] = count
                changes += edits
        return PassResult(module, bool(changes), changes, report=ForwardedTuples(forwarded))


def forward_tuple_elements(comp: Computation) -> tuple[int, list[Change]]:
    """Forward every non-root ``get-tuple-element`` of a ``tuple`` in ``comp`` (erasing
    the tuples left unused): how many, and the edits."""
    rw = Rewriter(comp)
    forwarded = 0
    for inst in list(comp.instructions):
        if inst.opcode != "get-tuple-element" or inst.name == comp.root_name:
            continue
        source = comp[inst.operands[0]]
        index = inst.int_attr("index")
        if source.opcode != "tuple" or index is None:
            continue
        rw.replace_all_uses_with(inst.name, source.operands[index])
        rw.erase(inst.name)
        forwarded += 1
        if not rw.users(source.name) and source.name != comp.root_name:
            rw.erase(source.name)
    return forwarded, rw.changes if forwarded else []


__all__ = ["ForwardedTuples", "TupleForwarding", "forward_tuple_elements"]
