"""Mutants of an optimized module: the small wrong edits a verifier must catch.

A verifier is only as good as the errors it can see (issue 16: a learning rate off by
0.1% verified as MATCH). Each mutant is the candidate module with one edit of the kind
a buggy rewrite makes, from a rule table (:data:`KINDS`):

* ``constant`` — each constant of the update region (the instructions downstream of a
  gradient collective, and the constants they read) scaled by 1 + 1e-4 and by
  1 − 1e-4 (integers ± 1); a 16-bit constant, whose neighbours are 0.4% away, has no
  such mutant (one ulp of bf16 moves bf16 results by what a flipped rounding does);
* ``swap`` — the operands of a non-commutative binary op of the region exchanged;
* ``slice`` — a slice's window shifted by one element along its first cut dimension;
* ``padding`` — the value a ``pad`` fills in set to 7 and to NaN (poisoned lanes);
* ``group`` — a collective's replica groups changed: the first two devices of each
  group exchanged (reduce-scatter, all-gather: a shard lands on the wrong device), or
  the group split in halves (all-reduce: a partial sum).

Mutants are texts, so a failing one can be written out and rerun with ``verify``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from hlo_shard.graph import Rewriter, users_map
from hlo_shard.ir import (
    ELEMENT_BITS, ArrayShape, Computation, Instruction, Module, ReplicaGroups, SliceRanges,
)
from hlo_shard.opinfo import NON_COMMUTATIVE, SUMMING_COLLECTIVES
from hlo_shard.printer import to_text

#: Relative size of a constant mutation: the issue's 0.01% update error.
SCALE = 1e-4
#: Collectives whose results start the update region.
GRADIENT_COLLECTIVES = SUMMING_COLLECTIVES
POISONS = ("7", "nan")


@dataclass(frozen=True, slots=True)
class Mutant:
    kind: str
    #: What was edited, e.g. "%constant.26 -0.001 -> -0.0010001".
    description: str
    text: str

    @property
    def label(self) -> str:
        return f"{self.kind}: {self.description}"


#: One edit: (description, function editing a copy of the module in place).
Edit = tuple[str, Callable[[Module], None]]


def update_region(comp: Computation) -> set[str]:
    """Instructions downstream of a gradient collective, and what they read that the
    gradients do not depend on (constants, step counts, bias corrections, schedules)."""
    users = users_map(comp)
    collectives = [i.name for i in comp.instructions if i.opcode in GRADIENT_COLLECTIVES]
    gradient_side = _closure(collectives, lambda name: comp[name].operands)
    region = _closure(collectives, lambda name: users.get(name, ())) - set(collectives)
    feeding = _closure(region, lambda name: [o for o in comp[name].operands
                                             if o not in gradient_side])
    return region | feeding


def _closure(starts: Iterable[str], step: Callable[[str], Iterable[str]]) -> set[str]:
    """``starts`` and everything reachable from them by ``step``."""
    seen = set(starts)
    work = list(seen)
    while work:
        for following in step(work.pop()):
            if following not in seen:
                seen.add(following)
                work.append(following)
    return seen


def _scaled_literal(inst: Instruction, sign: int) -> str | None:
    """The literal of a scalar constant moved by 1 ± :data:`SCALE` (floats) or ± 1
    (integers) in its element type; None when nothing meaningful changes (zero, pred)."""
    from hlo_shard.runtime.inputs import numpy_dtype

    shape = inst.shape
    if not isinstance(shape, ArrayShape) or not shape.is_scalar or shape.element_type == "pred" \
            or inst.literal is None:
        return None
    try:
        value = float(inst.literal)
    except (TypeError, ValueError):
        return None
    dtype = numpy_dtype(shape.element_type)
    if dtype.kind in "iu":
        moved = int(value) + sign
        info = np.iinfo(dtype)
        return str(moved) if info.min <= moved <= info.max else None
    if value == 0 or not math.isfinite(value):
        return None
    old = np.asarray(value, dtype)
    new = np.asarray(value * (1 + sign * SCALE), dtype)
    if new == old:  # a 16-bit constant has no neighbour that close: not mutated
        return None
    return repr(float(new)) if dtype.itemsize >= 4 else f"{float(new):.6g}"


def _constants(comp: Computation, region: set[str]) -> Iterator[Edit]:
    for inst in comp.instructions:
        if inst.opcode != "constant" or inst.name not in region:
            continue
        for sign in (1, -1):
            literal = _scaled_literal(inst, sign)
            if literal is not None:
                yield (f"%{inst.name} {inst.literal} -> {literal}",
                       _set_literal(comp.name, inst.name, literal))


def _set_literal(comp_name: str, name: str, literal: str) -> Callable[[Module], None]:
    def edit(module: Module) -> None:
        module.computation(comp_name)[name].literal = literal
    return edit


#: compare directions that do not care about operand order.
SYMMETRIC_DIRECTIONS = frozenset({"EQ", "NE"})


def _swaps(comp: Computation, region: set[str]) -> Iterator[Edit]:
    for inst in comp.instructions:
        direction = str(getattr(inst.attributes.get("direction"), "name",
                                inst.attributes.get("direction")))
        if inst.opcode == "compare" and direction in SYMMETRIC_DIRECTIONS:
            continue
        if inst.opcode in NON_COMMUTATIVE and inst.name in region and \
                len(inst.operands) == 2 and inst.operands[0] != inst.operands[1] and \
                comp[inst.operands[0]].shape == comp[inst.operands[1]].shape:
            yield (f"%{inst.name} {inst.opcode}({', '.join(inst.operands)}) operands swapped",
                   _swap(comp.name, inst.name))


def _swap(comp_name: str, name: str) -> Callable[[Module], None]:
    def edit(module: Module) -> None:
        module.computation(comp_name)[name].operands.reverse()
    return edit


def _slices(comp: Computation, region: set[str]) -> Iterator[Edit]:
    for inst in comp.instructions:
        ranges = inst.attributes.get("slice")
        if inst.opcode != "slice" or not isinstance(ranges, SliceRanges):
            continue
        operand = comp[inst.operands[0]].shape
        if not isinstance(operand, ArrayShape):
            continue  # not valid HLO: no slice to move
        dims = operand.dims
        for axis, (start, limit, stride) in enumerate(ranges.ranges):
            if (start, limit) == (0, dims[axis]):
                continue
            step = 1 if limit + 1 <= dims[axis] else -1
            moved = list(ranges.ranges)
            moved[axis] = (start + step, limit + step, stride)
            yield (f"%{inst.name} slice dimension {axis} [{start}:{limit}] -> "
                   f"[{start + step}:{limit + step}]",
                   _set_attribute(comp.name, inst.name, "slice", SliceRanges(tuple(moved))))
            break


def _set_attribute(comp_name: str, name: str, key: str, value: Any) -> Callable[[Module], None]:
    # A mutant edits its copy of the module directly, not through a Rewriter: it is no
    # pass (no PassResult whose change log must be complete), and it must be able to
    # make the edits a Rewriter refuses or lacks (literals, operands swapped).
    def edit(module: Module) -> None:
        module.computation(comp_name)[name].attributes[key] = value
    return edit


def _paddings(comp: Computation, region: set[str]) -> Iterator[Edit]:
    for inst in comp.instructions:
        shape = inst.shape
        if inst.opcode == "pad" and isinstance(shape, ArrayShape) and shape.element_type in _FLOATS:
            for poison in POISONS:
                yield (f"%{inst.name} pads with {poison}",
                       _poison(comp.name, inst.name, poison, shape.element_type))


_FLOATS = frozenset(t for t in ELEMENT_BITS if t.startswith(("f", "bf")))


def _poison(comp_name: str, name: str, poison: str, element_type: str
            ) -> Callable[[Module], None]:
    def edit(module: Module) -> None:
        comp = module.computation(comp_name)
        pad = comp[name]
        rewriter = Rewriter(comp)
        with rewriter.inserting_before(name):
            value = rewriter.add("constant", ArrayShape(element_type, ()), name="poison")
        value.literal = poison
        rewriter.set_operand(pad, 1, value.name)
    return edit


def _groups(comp: Computation, region: set[str]) -> Iterator[Edit]:
    for inst in comp.instructions:
        groups = inst.attributes.get("replica_groups")
        if not isinstance(groups, ReplicaGroups) or not groups.groups or \
                min(len(g) for g in groups.groups) < 2:
            continue
        if inst.opcode.startswith("all-reduce"):
            if any(len(g) % 2 for g in groups.groups):
                continue
            changed = tuple(half for g in groups.groups
                            for half in (g[:len(g) // 2], g[len(g) // 2:]))
            how = "split in halves"
        elif inst.opcode.startswith(("reduce-scatter", "all-gather")):
            changed = tuple((g[1], g[0], *g[2:]) for g in groups.groups)
            how = "first two devices exchanged"
        else:
            continue
        yield (f"%{inst.name} {inst.opcode} replica groups {how}",
               _set_attribute(comp.name, inst.name, "replica_groups", ReplicaGroups(changed)))


#: kind → edits of the entry computation (given its update region).
KINDS: dict[str, Callable[[Computation, set[str]], Iterator[Edit]]] = {
    "constant": _constants, "swap": _swaps, "slice": _slices, "padding": _paddings,
    "group": _groups,
}


def mutants(module: Module, kinds: tuple[str, ...] = tuple(KINDS)) -> list[Mutant]:
    """Every mutant of ``module`` (an optimized candidate) of the given kinds, in
    program order within each kind."""
    comp = module.entry
    region = update_region(comp)
    out = []
    for kind in kinds:
        for description, edit in KINDS[kind](comp, region):
            mutated = module.clone()
            edit(mutated)
            out.append(Mutant(kind, description, to_text(mutated)))
    return out
