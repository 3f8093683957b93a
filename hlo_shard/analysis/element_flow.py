"""Which operands a value's elements are computed from one for one.

A reachability through every operand joins too much to tell weights apart: a gradient
clipped by its global norm reaches every weight's update (through the norm, a sum of all
of them), and every gradient is computed from every weight (backpropagation reads them
all). An optimizer's update keeps the elements apart: ``w - lr * m / (sqrt(v) + eps)``
computes element ``i`` of the new weight from element ``i`` of the weight, its moments
and its gradient only. Following only such operands (elementwise ops on same-shaped
operands, copies, reshapes, transposes, slices and windows, fused kernels made of
those) pairs a gradient with its weight's next value, and a weight with its own next
value, where a model repeats one shape in every layer. Reductions, matrix products and
broadcasts mix or repeat elements and are not followed (a reduction over dimensions of
size one only, jit's form of a bias gradient's reshape, is).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hlo_shard.graph import element_read
from hlo_shard.ir import ArrayShape, Computation, Instruction, Module, shape_leaves
from hlo_shard.opinfo import FREE, OPINFO, Moves

#: Ways of moving elements that keep each result element one operand element's value
#: (placed elsewhere, or beside others'): followed from the moved operands.
_ONE_FOR_ONE: frozenset[Moves] = frozenset({"copy", "reshape", "bitcast", "transpose",
                                            "reverse", "window", "update", "assemble"})
#: Of those, the ones whose first operand alone is moved (the others are indices or a
#: padding value); ``update`` moves its first two, ``assemble`` all its arrays.
_FIRST_ONLY: frozenset[Moves] = frozenset({"copy", "reshape", "bitcast", "transpose",
                                           "reverse", "window"})


def reduces_unit_dimensions_only(inst: Instruction, source_dims: Sequence[int]) -> bool:
    """The ``reduce`` ``inst`` of an operand of ``source_dims`` sums over dimensions of
    size one only: each result element is one operand element (jit's reshape of a bias
    gradient, ``reduce(f32[1,16]) -> f32[16]``)."""
    return all(source_dims[d] == 1 for d in inst.ints_attr("dimensions"))


def _array_dims(comp: Computation, name: str) -> tuple[int, ...] | None:
    """The dimensions of value ``name`` where it is an array (None for a tuple or token)."""
    shape = comp[name].shape
    return shape.dims if isinstance(shape, ArrayShape) else None


def _forwards(inst: Instruction) -> bool:
    """A tuple, or an op that only hands a value on (``get-tuple-element``, ordering
    ops): its operands' elements are its own."""
    info = OPINFO.get(inst.opcode)
    return inst.opcode == "tuple" or (info is not None and info.cost == FREE)


class ElementOperands:
    """``flows(comp, inst)``: the operands of ``inst`` each element of its result is
    computed from one for one. A fused kernel is read once per fused computation."""

    def __init__(self, module: Module) -> None:
        self._module = module
        self._kernels: dict[str, bool] = {}

    def __call__(self, comp: Computation, inst: Instruction) -> list[str]:
        info = OPINFO.get(inst.opcode)
        if info is None or not inst.operands:
            return []
        element = element_read(comp, inst)
        if element is not None:  # each of a tuple's n reads would read all n otherwise
            return [element]
        if _forwards(inst):
            return list(inst.operands)
        if info.moves in _FIRST_ONLY:
            return inst.operands[:1]
        if info.moves == "update":
            return inst.operands[:2]
        if info.moves == "assemble":
            return [name for name in inst.operands if _array_dims(comp, name)]
        if inst.opcode == "reduce":  # over size-1 dimensions only: a reshape
            inputs = inst.operands[:len(inst.operands) // 2]
            source = comp[inputs[0]].shape
            degenerate = isinstance(source, ArrayShape) and \
                reduces_unit_dimensions_only(inst, source.dims)
            return inputs if degenerate else []
        kernel = inst.opcode == "fusion" and self._keeps_elements(inst.called("calls"))
        # (an all-reduce sums each element over the devices: element i from element i)
        if not (info.elementwise or kernel or info.collective == "all-reduce"):
            return []
        result = {leaf.dims for _, leaf in shape_leaves(inst.shape)}
        return [name for name in inst.operands if _array_dims(comp, name) in result]

    def _keeps_elements(self, name: str) -> bool:
        """Every instruction of fused computation ``name`` computes its elements from
        its operands' one for one, or is a parameter, a constant or a broadcast (of the
        kernel's scalars: only same-shaped operands are followed into it)."""
        found = self._kernels.get(name)
        if found is None:
            found = all(
                not inst.operands or _forwards(inst)
                or (info := OPINFO.get(inst.opcode)) is not None
                and (info.elementwise or info.moves in _ONE_FOR_ONE or info.moves == "broadcast")
                for inst in self._module.computation(name).instructions)
            self._kernels[name] = found
        return found

    def previous(self, comp: Computation) -> Callable[[Instruction], list[str]]:
        """``computed_from`` for :func:`~hlo_shard.graph.upstream_bits` in ``comp``."""
        return lambda inst: self(comp, inst)


__all__ = ["ElementOperands", "reduces_unit_dimensions_only"]
