"""``get-tuple-element(tuple(a, b, …), i)`` → the ``i``-th operand.

A pure simplification that lets the weight-update region flow through the tuples jax
wraps around shard_map outputs. It runs before the weight-update pass, on the
computations that pass may edit (by default; the ``computations`` option names others):
forwarding elsewhere would change the text of computations the optimizer leaves alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hlo_shard.graph import ModuleRewriter, Rewriter
from hlo_shard.ir import Module
from hlo_shard.passes.base import ModulePass
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

    def apply(self, module: Module, rewriter: ModuleRewriter) -> ForwardedTuples:
        names = rewritten_computations(module) if self.computations is None \
            else self.computations
        forwarded: dict[str, int] = {}
        for name in names:
            count = forward_tuple_elements(rewriter.rewriter(module.computation(name)))
            if count:
                forwarded[name] = count
        return ForwardedTuples(forwarded)


def forward_tuple_elements(rw: Rewriter) -> int:
    """Forward every non-root ``get-tuple-element`` of a ``tuple`` in ``rw``'s
    computation (erasing the tuples left unused): how many."""
    comp = rw.comp
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
        if not rw.is_used(source.name) and source.name != comp.root_name:
            rw.erase(source.name)
    return forwarded


__all__ = ["ForwardedTuples", "TupleForwarding", "forward_tuple_elements"]
