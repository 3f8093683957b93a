"""Remove the computations nothing calls any more (XLA's ``HloDCE`` does the same).

The weight-update pass re-emits an update fusion with a sharded copy of its body; the
body it replaced is then called by nothing. Left in, it is printed, parsed back and
carried by XLA through every pass that runs before its own dead-code elimination —
inside ``install()`` all of XLA's passes after the hook, over a module that can hold
hundreds of such bodies. Which computations are reachable is one walk over the calls
from the entry (iterative: no recursion depth tied to the nesting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hlo_shard.graph import ModuleRewriter, reachable
from hlo_shard.ir import Module
from hlo_shard.passes.base import ModulePass


@dataclass(frozen=True)
class RemovedComputations:
    """How many computations went (nothing ``--explain`` shows: they computed nothing)."""

    removed: int


@dataclass(frozen=True)
class DeadComputationRemoval(ModulePass[RemovedComputations]):
    """Remove every computation the entry does not reach through calls."""

    name: ClassVar[str] = "dead-computation-removal"

    def apply(self, module: Module, rewriter: ModuleRewriter) -> RemovedComputations:
        def callees(name: str) -> list[str]:
            return [callee for inst in module.computation(name).instructions
                    for callee in inst.called_computations() if module.has_computation(callee)]

        entry = module.entry.name
        reached = reachable((entry,), callees) | {entry}
        dead = [comp.name for comp in module.computations if comp.name not in reached]
        if dead:
            rewriter.remove_computations(dead)
        return RemovedComputations(len(dead))


__all__ = ["DeadComputationRemoval", "RemovedComputations"]
