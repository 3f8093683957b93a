"""The values a matrix product is computed from, across loop carries.

On a mesh with a model axis the module holds two kinds of sum all-reduce: the model
axis's sums of partial activations (tensor parallelism, forward and backward) and the
data axis's sums of gradients. Only a gradient's sum is read by nothing but the update
(elementwise optimizer arithmetic, norms); an activation's sum is the input of the next
layer's matrix products, in the same loop iteration or, through the loop's carry, the
next one. :func:`matmul_inputs` tells them apart in one backward walk from every
product to what it reads (linear in the module: each value, or tuple slot, once).

Tuples are followed slot by slot through ``tuple``, ``get-tuple-element``, ``while``
(its initial value and its body's root feed the body's parameter, the body's root
the loop's result) and a loop body's parameter; anything else that reads a value reads
all of it. A fusion, call or branch whose computations hold a product (or a custom
call: XLA's library products, oneDNN's and ynnpack's on CPU, cuBLAS's on GPU) counts as
one.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlo_shard.graph import call_graph, reachable
from hlo_shard.ir import Computation, Instruction, Module
from hlo_shard.opinfo import MATMULS

#: A value: (computation, instruction, tuple slot or None for all of it).
Value = tuple[str, str, int | None]


@dataclass(frozen=True)
class MatmulInputs:
    """What :func:`matmul_inputs` found."""

    values: frozenset[Value]

    def reads(self, computation: str, name: str, index: int | None = None) -> bool:
        """Whether a product is computed from the value (slot ``index`` of it, where
        given: the value as a whole counts for every slot)."""
        return (computation, name, None) in self.values or \
            (index is not None and (computation, name, index) in self.values)


def _is_product(inst: Instruction) -> bool:
    """A matrix product, or a custom call (a library's product, as far as anyone knows)."""
    return inst.opcode in MATMULS or inst.opcode == "custom-call"


def _holding_products(module: Module) -> set[str]:
    """The computations that run a product, directly or through what they call."""
    holding = {comp.name for comp in module.computations
               if any(_is_product(inst) for inst in comp.instructions)}
    return holding | reachable(holding, call_graph(module).predecessors)


def matmul_inputs(module: Module) -> MatmulInputs:
    """Every value some matrix product of ``module`` is computed from."""
    holding = _holding_products(module)
    loops: dict[str, list[tuple[Computation, str]]] = {}
    for comp in module.computations:
        for inst in comp.instructions:
            if inst.opcode == "while":
                loops.setdefault(inst.called("body"), []).append((comp, inst.operands[0]))
    seen: set[Value] = set()
    stack: list[Value] = []

    def mark(comp: str, name: str, index: int | None = None) -> None:
        if (comp, name, index) not in seen and (comp, name, None) not in seen:
            seen.add((comp, name, index))
            stack.append((comp, name, index))

    for comp in module.computations:
        for inst in comp.instructions:
            if _is_product(inst) or (inst.opcode != "while" and any(
                    callee in holding for callee in inst.called_computations())):
                for operand in inst.operands:
                    mark(comp.name, operand)
    while stack:
        comp_name, name, index = stack.pop()
        comp = module.computation(comp_name)
        inst = comp[name]
        if inst.opcode == "get-tuple-element":
            mark(comp_name, inst.operands[0], inst.required_attr("index", int))
        elif inst.opcode == "tuple":
            for k, operand in enumerate(inst.operands):
                if index is None or k == index:
                    mark(comp_name, operand)
        elif inst.opcode == "while":
            body = inst.called("body")
            mark(body, module.computation(body).root.name, index)
            mark(comp_name, inst.operands[0], index)
        elif inst.opcode == "parameter" and comp_name in loops:  # a loop body's carry
            mark(comp_name, comp.root.name, index)
            for caller, initial in loops[comp_name]:
                mark(caller.name, initial, index)
        else:
            for operand in inst.operands:
                mark(comp_name, operand)
    return MatmulInputs(frozenset(seen))
