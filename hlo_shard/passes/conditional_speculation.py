"""An update under a ``lax.cond``: run every branch and keep the taken one's results.

``optax.apply_if_finite`` (and ``MultiSteps`` with ``skip_not_finite``) wraps the
optimizer's update in a ``lax.cond`` on whether the gradients are finite: jax writes a
conditional whose first branch returns zeros and the state as it was, the second the
update. The weight-update sharding reads the gradients' users in the computation they
are summed in, so an update inside a branch stays whole ("its update runs in a
conditional's branches").

Where a conditional reads a gradient the sharding may shard (a candidate all-reduce of
at least ``min_shard_bytes``, through any ops), and each branch is pure arithmetic on
its operand, this pass inlines every branch in the conditional's place and selects,
element by element of the result, the one the conditional would have returned:
``select(index == k, branch_k, …)``, the last branch for any other index (XLA runs the
last branch for an index out of range), ``select(pred, true, false)`` for the
predicate form. The taken branch's results are the very values it computed; the
others are computed and dropped. The update then reads the gradient in the
computation it is summed in, where the sharding can shard it, and each branch's work
is divided by the devices with it.

Running the branches not taken is work the conditional skipped, so this pass runs
only in the speed gate's trials that shard such a gradient (``min_shard_bytes``, the
trial's cut-off) and is priced with them: a module kept whole keeps its conditional.

A branch is speculated only where nothing in it, or in what it calls, has effects or
depends on being run once: no op the opcode table marks impure (custom calls, rng
state, feeds, sends), no collective, no loop (the predicate may be what makes one
end), no nested conditional or call, no control dependence (XLA's fusions are inlined as
they are: the branch is called by the conditional alone, so are they); its result is an
array or a flat tuple of arrays, and it takes one operand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hlo_shard.analysis.collectives import find_gradient_all_reduces, with_device_counts
from hlo_shard.graph import (ModuleRewriter, Rewriter, call_counts, control_predecessors,
                             reachable, topological_order, users_map)
from hlo_shard.ir import (ArrayShape, Computation, Ident, Instruction, Module, TupleShape,
                          shape_leaves)
from hlo_shard.opinfo import COLLECTIVE_KINDS, CONTROL_FLOW, IMPURE
from hlo_shard.passes.base import ModulePass

@dataclass(frozen=True)
class SpeculatedConditional:
    computation: str
    conditional: str
    branches: int


@dataclass(frozen=True)
class SpeculationReport:
    speculated: list[SpeculatedConditional] = field(default_factory=list)

    @property
    def notes(self) -> list[str]:
        return [f"{s.computation}/conditional %{s.conditional}: its {s.branches} branches "
                f"all run and a select keeps the taken one's results (it reads a gradient "
                f"the update can shard)" for s in self.speculated]


@dataclass(frozen=True)
class ConditionalSpeculation(ModulePass[SpeculationReport]):
    """Inline the branches of the conditionals that read a gradient of at least
    ``min_shard_bytes`` and select their results (module docstring)."""

    name: ClassVar[str] = "conditional-speculation"
    min_shard_bytes: int = 0

    def apply(self, module: Module, rewriter: ModuleRewriter) -> SpeculationReport:
        report = SpeculationReport()
        if not any(inst.opcode == "conditional" for comp in module.computations
                   for inst in comp.instructions):
            return report  # (the usual step: nothing to read the gradients for)
        gradients: dict[str, list[str]] = {}
        # (read with the device counts a hooked module's header lost, as the sharding does)
        for found in find_gradient_all_reduces(with_device_counts(module)):
            inst = module.computation(found.computation)[found.name]
            if found.is_candidate and max(
                    (s.byte_size for _, s in shape_leaves(inst.shape)), default=0) >= \
                    self.min_shard_bytes:
                gradients.setdefault(found.computation, []).append(found.name)
        if not gradients:
            return report
        callers = call_counts(module)
        for name, sums in gradients.items():
            comp = module.computation(name)
            # (the values computed from the sums: one walk down)
            reached = reachable(sums, users_map(comp).__getitem__) | set(sums)
            for inst in [i for i in comp.instructions if i.opcode == "conditional"]:
                branches = [module.computation(b) for b in inst.called_computations()]
                if any(o in reached for o in inst.operands[1:]) and \
                        _speculable(module, inst, branches, callers):
                    _speculate(rewriter.rewriter(comp), inst, branches)
                    report.speculated.append(
                        SpeculatedConditional(name, inst.name, len(branches)))
        return report


def _speculable(module: Module, conditional: Instruction, branches: list[Computation],
                callers: dict[str, int]) -> bool:
    """Every branch may run whether or not it is taken (module docstring), is called by
    this conditional alone, takes one operand, and returns what the conditional does."""
    if len(conditional.operands) != len(branches) + 1 or len(branches) < 2 or \
            not _flat_arrays(conditional.shape):
        return False
    pending = [b.name for b in branches]
    seen: set[str] = set()
    # Not in a branch: effects, collectives, and control flow (a loop the predicate may be
    # what ends; a fusion's computation holds none of them: XLA fuses arithmetic).
    while pending:  # the branches and every computation they call (reducers, fusions)
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for inst in module.computation(name).instructions:
            if inst.opcode in IMPURE or inst.opcode in COLLECTIVE_KINDS or \
                    inst.opcode in CONTROL_FLOW or control_predecessors(inst):
                return False
            pending.extend(inst.called_computations())
    return all(callers.get(b.name, 0) == 1 and len(b.parameters()) == 1
               and b.root.shape == conditional.shape for b in branches)


def _flat_arrays(shape: object) -> bool:
    return isinstance(shape, ArrayShape) or isinstance(shape, TupleShape) and all(
        isinstance(e, ArrayShape) for e in shape.elements)


def _speculate(rw: Rewriter, conditional: Instruction, branches: list[Computation]) -> None:
    """Inline each branch before ``conditional``, select the results, and replace it."""
    selector = conditional.operands[0]
    with rw.inserting_before(conditional.name):
        results = [_inline(rw, branch, operand)
                   for branch, operand in zip(branches, conditional.operands[1:])]
        # (the predicate form: true is branch 0; the index form: k is branch k)
        index = rw.comp[selector].shape
        assert isinstance(index, ArrayShape)
        takes = [selector] if index.element_type == "pred" else [
            rw.add("compare", ArrayShape("pred", ()), [selector, rw.add_instruction(
                Instruction(rw.fresh_name("branch_index"), "constant", index,
                            literal=str(k))).name], direction=Ident("EQ")).name
            for k in range(len(branches) - 1)]
        leaves = list(conditional.shape.elements) if isinstance(conditional.shape, TupleShape) \
            else [conditional.shape]
        selected = []
        masks: dict[tuple[str, tuple[int, ...]], str] = {}  # (take, dims) → its broadcast
        for i, leaf in enumerate(leaves):
            assert isinstance(leaf, ArrayShape)
            values = results if isinstance(conditional.shape, ArrayShape) else [
                rw.add("get-tuple-element", leaf, [result], index=i).name for result in results]
            value = values[-1]
            for take, taken in reversed(list(zip(takes, values))):
                if leaf.dims and (take, leaf.dims) not in masks:
                    masks[take, leaf.dims] = rw.add("broadcast", ArrayShape("pred", leaf.dims),
                                                    [take], dimensions=()).name
                mask = masks[take, leaf.dims] if leaf.dims else take
                value = rw.add("select", leaf, [mask, taken, value]).name
            selected.append(value)
        replacement = selected[0] if isinstance(conditional.shape, ArrayShape) else \
            rw.add("tuple", conditional.shape, selected).name
    rw.replace_all_uses_with(conditional.name, replacement)
    rw.erase(conditional.name)


def _inline(rw: Rewriter, branch: Computation, operand: str) -> str:
    """``branch``'s instructions at ``rw``'s point, its parameter read as ``operand``:
    the name of its result."""
    (param,) = branch.parameters()
    copies = {param.name: operand}
    for inst in topological_order(branch):
        if inst is param:
            continue
        copy = inst.clone()
        copy.name = rw.fresh_name(inst.name)
        copy.operands = [copies[o] for o in inst.operands]
        copies[inst.name] = rw.add_instruction(copy).name
    return copies[branch.root.name]


__all__ = ["ConditionalSpeculation", "SpeculatedConditional", "SpeculationReport"]
