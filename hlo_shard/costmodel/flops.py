"""Flops, transcendentals and bytes accessed per instruction, by XLA's rules.

The rules are those of XLA's ``HloCostAnalysis`` (``xla/service/hlo_cost_analysis.cc``),
so that module totals can be checked against ``hlo_module_cost_analysis`` — the number
users already get from jax. Conventions worth knowing:

* bytes accessed default to size(output) + Σ size(operands); a tuple's size is its
  index table (8 bytes per element), not its leaves; parameters, constants,
  get-tuple-element and bitcasts touch nothing;
* collectives are priced as XLA does (all-reduce: one flop per output element; others:
  default bytes, no flops). The network is *not* modelled here — XLA does not model
  it either; :mod:`hlo_shard.costmodel.network` does;
* XLA prices a ``while`` as one iteration of its body plus its condition. With
  ``count_loop_iterations=True`` (the time model) the body is multiplied by the trip
  count when it is a known constant; with ``False`` the totals are XLA's.
* XLA prices a ``custom-call`` at -1 flops and -1 bytes ("unknown"); the time model
  (``xla_compatible=False``) uses default bytes and no flops instead.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from collections.abc import Callable

from hlo_shard.graph import FusedStructure, fused_structure, reachable
from hlo_shard.ir import (
    ArrayShape, Computation, ComputationRef, Instruction, Module, Shape, TupleShape,
    shape_leaves,
)
from hlo_shard.opinfo import ALL_REDUCE, NO_COST, OPINFO, PER_ELEMENT_COST, opcodes_where
from hlo_shard.values import WindowDim, read_dim_labels, read_window

#: Size of one tuple index-table entry (XLA CPU: ``sizeof(void*)``).
POINTER_BYTES = 8

# ------------------------------------------------------------------------ the record


@dataclass(frozen=True, slots=True)
class Cost:
    flops: float = 0.0
    transcendentals: float = 0.0
    bytes_accessed: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.transcendentals + other.transcendentals,
                    self.bytes_accessed + other.bytes_accessed)

    def scaled(self, factor: float) -> Cost:
        return Cost(self.flops * factor, self.transcendentals * factor,
                    self.bytes_accessed * factor)

    def maximum(self, other: Cost) -> Cost:
        return Cost(max(self.flops, other.flops),
                    max(self.transcendentals, other.transcendentals),
                    max(self.bytes_accessed, other.bytes_accessed))

    def compute_only(self) -> Cost:
        """The flops and transcendentals: what a called computation contributes to its
        caller's count (XLA never copies the callee's bytes into a reduce or map)."""
        return Cost(self.flops, self.transcendentals, 0.0)

    def as_dict(self) -> dict[str, float]:
        return {"flops": self.flops, "transcendentals": self.transcendentals,
                "bytes_accessed": self.bytes_accessed}


ZERO = Cost()


def xla_shape_size(shape: Shape) -> int:
    """XLA CPU's ``ShapeSizeBytes``: arrays by elements, tuples by index table."""
    if isinstance(shape, TupleShape):
        return POINTER_BYTES * len(shape.elements)
    return shape.byte_size


def elements(shape: Shape) -> int:
    """Elements of an array (the first leaf of a tuple, as XLA's reduce does)."""
    if isinstance(shape, TupleShape):
        return elements(shape.elements[0]) if shape.elements else 0
    return shape.num_elements


def leaf_elements(shape: Shape) -> int:
    if isinstance(shape, ArrayShape):  # the common case, asked per operand per kernel
        return shape.num_elements
    return sum(leaf.num_elements for _, leaf in shape_leaves(shape))


def leaf_bytes(shape: Shape) -> int:
    if isinstance(shape, ArrayShape):
        return shape.byte_size
    return sum(leaf.byte_size for _, leaf in shape_leaves(shape))


# -------------------------------------------------------------------------- analysis


@dataclass(frozen=True, slots=True)
class Site:
    """One instruction being priced, with what its rule may need to look at."""

    analysis: CostAnalysis
    comp: Computation
    inst: Instruction

    def operand(self, index: int) -> Instruction:
        return self.comp[self.inst.operands[index]]

    def operand_shape(self, index: int) -> Shape:
        return self.operand(index).shape

    def default_bytes(self) -> int:
        return xla_shape_size(self.inst.shape) + sum(
            xla_shape_size(self.comp[name].shape) for name in self.inst.operands)

    def default(self, flops: float = 0.0, transcendentals: float = 0.0) -> Cost:
        return Cost(flops, transcendentals, self.default_bytes())

    def called(self, attribute: str) -> Cost:
        ref = self.inst.attr(attribute)
        assert isinstance(ref, ComputationRef), f"{self.inst.name}: no {attribute}"
        return self.analysis.computation_cost(ref.name)


Rule = Callable[[Site], Cost]


class CostAnalysis:
    """XLA's cost rules over one module, memoised per computation.

    ``count_loop_iterations`` multiplies while bodies by their trip count when it is a
    known constant; ``xla_compatible=False`` also replaces XLA's "unknown" (-1)
    custom-call price by default bytes. Both are off by default: the totals are then
    those ``hlo_module_cost_analysis`` reports.
    """

    def __init__(self, module: Module, *, count_loop_iterations: bool = False,
                 xla_compatible: bool = True, earlier: EarlierCosts | None = None) -> None:
        self.module = module
        self.count_loop_iterations = count_loop_iterations
        self.xla_compatible = xla_compatible
        if earlier is not None and (earlier.analysis.count_loop_iterations,
                                    earlier.analysis.xla_compatible) != (
                count_loop_iterations, xla_compatible):
            raise ValueError("earlier totals were summed under other options")
        self.earlier = earlier
        self._computations = {comp.name: comp for comp in module.computations}
        self._totals: dict[str, Cost] = {}
        #: Computation → the computations its total read directly (their totals read
        #: theirs): where any of them was edited, the total cannot be reused
        #: (:class:`EarlierCosts`).
        self._reads: dict[str, frozenset[str]] = {}
        #: Per total being summed, the computations it has read so far (a list: a rule
        #: asking for a total its walk did not find would sum it inside).
        self._reading: list[set[str]] = []
        #: Fused computation → the price of the fusion calling it (each fusion calls a
        #: computation of its own, and its price reads nothing else), for a rewritten
        #: copy's analysis to reuse where the rewrite left that computation as it was.
        self._fusions: dict[str, Cost] = {}
        #: :func:`~hlo_shard.graph.fused_structure` of a fusion priced here (or by
        #: ``earlier``, summed under the same options) → its price and its fused
        #: computation's total (None where pricing made none): a step's module repeats a
        #: few fusions many times (per layer, per gradient), each with a computation of
        #: its own.
        self._alike: dict[FusedStructure, tuple[Cost, Cost | None]] = \
            dict(earlier.analysis._alike) if earlier is not None else {}

    def computation(self, name: str) -> Computation:
        if self._reading:
            self._reading[-1].add(name)
        return self._computations[name]

    def instruction_cost(self, comp: Computation, inst: Instruction) -> Cost:
        if inst.opcode == "fusion":
            return self._fusion_cost(comp, inst)
        return RULES.get(inst.opcode, _default_rule)(Site(self, comp, inst))

    def _fusion_cost(self, comp: Computation, inst: Instruction) -> Cost:
        """A fusion's price, memoised per fused computation (and taken from ``earlier``
        where that computation is as the earlier module had it): an edited caller
        re-prices its instructions, most of them fusions the rewrite left alone."""
        fused = inst.called_computations()[0]
        cost = self._fusions.get(fused)
        if cost is None and self.earlier is not None:
            cost = self.earlier.fusion(fused)
        if cost is None:
            cost = self._fusion_alike(comp, inst, fused)
        elif self._reading:  # what the price read, as if it had been summed here
            self._reading[-1].add(fused)
        self._fusions[fused] = cost
        return cost

    def _fusion_alike(self, comp: Computation, inst: Instruction, fused: str) -> Cost:
        """The price of a fusion priced already whose structure is the same
        (:func:`~hlo_shard.graph.fused_structure`), recorded as if priced here (its
        computation summed, reading nothing), else the fusion priced."""
        key = fused_structure(inst, self._computations[fused])
        found = self._alike.get(key) if key is not None else None
        if found is None:
            cost = _fusion(Site(self, comp, inst))
            if key is not None:
                self._alike[key] = (cost, self._totals.get(fused))
            return cost
        cost, total = found
        if self._reading:
            self._reading[-1].add(fused)
        if total is not None:
            self._totals[fused], self._reads[fused] = total, frozenset()
        return cost

    def computation_cost(self, name: str) -> Cost:
        """Sum over every instruction of a computation, dead code included (XLA's
        ``Accept`` visits instructions without users too)."""
        if name not in self._totals:
            # Callees first, so that a rule asking for a called total finds it summed:
            # no recursion however deep the calls nest.
            for below in self._unsummed_from(name):
                self._sum(below)
        if self._reading:
            self._reading[-1].add(name)
        return self._totals[name]

    def _sum(self, name: str) -> None:
        reused = self._earlier_total(name)
        if reused is not None:
            self._totals[name], self._reads[name] = reused
            return
        comp = self._computations[name]
        self._reading.append(set())
        total = ZERO
        for inst in comp.instructions:
            total = total + self.instruction_cost(comp, inst)
        self._totals[name] = total
        self._reads[name] = frozenset(self._reading.pop())

    def _unsummed_from(self, name: str) -> list[str]:
        """``name`` and the computations it calls, directly or not, that have no total
        yet, each after those it calls (one iterative walk; a total ``earlier`` gives
        is not walked into)."""
        if self._earlier_total(name) is not None:
            return [name]
        order: list[str] = []
        seen = {name}
        stack = [(name, iter(self._callees(name)))]
        while stack:
            current, callees = stack[-1]
            for callee in callees:
                if callee in seen or callee in self._totals:
                    continue
                seen.add(callee)
                if self._earlier_total(callee) is not None:
                    order.append(callee)
                    continue
                stack.append((callee, iter(self._callees(callee))))
                break
            else:
                stack.pop()
                order.append(current)
        return order

    def _earlier_total(self, name: str) -> tuple[Cost, frozenset[str]] | None:
        return self.earlier.total(name) if self.earlier is not None else None

    def _callees(self, name: str) -> list[str]:
        return [callee for inst in self._computations[name].instructions
                for callee in inst.called_computations()]

    def fusion_price(self, fused: str) -> Cost | None:
        """The price of the fusion calling ``fused`` if it was priced here with ``fused``
        summed here too (so :meth:`read_by` knows what it read: a price this analysis
        took from its own ``earlier`` is not handed on)."""
        return self._fusions.get(fused) if fused in self._totals else None

    def summed(self, name: str) -> tuple[Cost, frozenset[str]] | None:
        """The total of ``name`` if it was summed here, and the computations it read
        directly."""
        total = self._totals.get(name)
        return None if total is None else (total, self._reads[name])

    def read_by(self) -> dict[str, list[str]]:
        """Computation → the totals summed here that read it directly."""
        readers: dict[str, list[str]] = {}
        for name, reads in self._reads.items():
            for read in reads:
                readers.setdefault(read, []).append(name)
        return readers

    def module_cost(self) -> Cost:
        return self.computation_cost(self.module.entry.name)

    def per_instruction(self, comp: Computation | None = None) -> dict[str, Cost]:
        comp = comp or self.module.entry
        return {inst.name: self.instruction_cost(comp, inst) for inst in comp.instructions}


@dataclass(frozen=True)
class EarlierCosts:
    """The totals an analysis of another module summed, for a copy of it a rewrite then
    edited (the speed gate's trial, priced after the input): a computation's total is
    reused where neither it nor any computation the total read, directly or through
    others, is among ``edited`` (the rewrite's log: every edit a pass makes is recorded
    there), so that only what the rewrite touched is priced again."""

    analysis: CostAnalysis
    edited: frozenset[str]

    @functools.cached_property
    def stale(self) -> set[str]:
        """The edited computations and every total that read one: one walk up the
        analysis's reads (linear in them, whatever the nesting)."""
        readers = self.analysis.read_by()
        return reachable(self.edited, lambda name: readers.get(name, ())) | self.edited

    def fusion(self, fused: str) -> Cost | None:
        """The earlier price of the fusion calling ``fused``, or None where it must be
        priced again."""
        return None if fused in self.stale else self.analysis.fusion_price(fused)

    def total(self, name: str) -> tuple[Cost, frozenset[str]] | None:
        """The earlier total of ``name`` and what it read, or None where it must be
        summed again."""
        summed = self.analysis.summed(name)
        return None if summed is None or name in self.stale else summed


def module_cost(module: Module, *, count_loop_iterations: bool = False,
                xla_compatible: bool = True) -> Cost:
    """Module totals by XLA's rules (see :class:`CostAnalysis` for the options)."""
    return CostAnalysis(module, count_loop_iterations=count_loop_iterations,
                        xla_compatible=xla_compatible).module_cost()


# ------------------------------------------------------------------------------ rules


def _default_rule(site: Site) -> Cost:
    return site.default()


def _free(site: Site) -> Cost:
    return ZERO


def _elementwise(site: Site) -> Cost:
    count = elements(site.inst.shape)
    if OPINFO[site.inst.opcode].transcendental:
        return site.default(transcendentals=count)
    return site.default(flops=count)


def _tuple(site: Site) -> Cost:
    return Cost(bytes_accessed=xla_shape_size(site.inst.shape))


def _slice(site: Site) -> Cost:
    return Cost(bytes_accessed=2 * xla_shape_size(site.inst.shape))


def _dynamic_slice(site: Site) -> Cost:
    return Cost(bytes_accessed=2 * xla_shape_size(site.inst.shape)
                + xla_shape_size(site.operand_shape(1)))


def _dynamic_update_slice(site: Site) -> Cost:
    return Cost(bytes_accessed=2 * xla_shape_size(site.operand_shape(1))
                + xla_shape_size(site.operand_shape(2)))


def _gather(site: Site) -> Cost:
    return Cost(bytes_accessed=2 * xla_shape_size(site.inst.shape)
                + xla_shape_size(site.operand_shape(1)))


def _scatter(site: Site) -> Cost:
    operands = len(site.inst.operands) // 2  # (inputs…, indices, updates…)
    updates = [site.operand_shape(operands + 1 + i) for i in range(operands)]
    indices = site.operand_shape(operands)
    per_element = site.called("to_apply").compute_only()
    return per_element.scaled(elements(updates[0])) + Cost(
        bytes_accessed=3 * sum(xla_shape_size(u) for u in updates) + xla_shape_size(indices))


def _dot(site: Site) -> Cost:
    lhs = site.operand_shape(0)
    contracting = site.inst.attr("lhs_contracting_dims", ()) or ()
    width = math.prod(lhs.dims[d] for d in contracting)  # type: ignore[union-attr]
    return site.default(flops=2 * elements(site.inst.shape) * width)


def _convolution(site: Site) -> Cost:
    return site.default(flops=convolution_flops(site))


def _reduce(site: Site) -> Cost:
    count = elements(site.operand_shape(0)) - elements(site.inst.shape)
    return site.called("to_apply").compute_only().scaled(count) + site.default()


def _map(site: Site) -> Cost:
    return site.called("to_apply").compute_only().scaled(elements(site.inst.shape)) \
        + site.default()


def _reduce_window(site: Site) -> Cost:
    window = read_window(site.inst.attr("window"))
    window_elements = math.prod(d.size for d in window)
    out = elements(site.inst.shape)
    count = (window_elements - 1) * out
    reduced = [d for d in window if d.size != 1]
    padded = [d for d in window if d.pad_low or d.pad_high]
    if len(reduced) == 1 and len(padded) == 1 and isinstance(site.inst.shape, ArrayShape):
        # A reduce followed by a broadcast along one dimension, written as a window.
        for axis, d in enumerate(window):
            if (d.size != 1 and d.pad_low and d.pad_low == d.pad_high
                    and d.size == 2 * d.pad_low + 1
                    and d.pad_low == site.inst.shape.dims[axis] - 1):
                span = site.inst.shape.dims[axis]
                count = out // span + span - 1
                break
    return site.called("to_apply").compute_only().scaled(count) + site.default()


def _select_and_scatter(site: Site) -> Cost:
    window = read_window(site.inst.attr("window"))
    source = elements(site.operand_shape(1))
    selects = source * (math.prod(d.size for d in window) - 1)
    return (site.called("select").compute_only().scaled(selects)
            + site.called("scatter").compute_only().scaled(source) + site.default())


def _sort(site: Site) -> Cost:
    n = elements(site.operand_shape(0))
    return site.default(flops=n * math.ceil(math.log2(n)) if n > 1 else 0)


def _fft(site: Site) -> Cost:
    log_factors = math.prod(int(math.log2(n)) for n in site.inst.ints_attr("fft_length"))
    return site.default(flops=2 * 4 * log_factors * elements(site.operand_shape(0)))


def _triangular_solve(site: Site) -> Cost:
    a, b = site.operand_shape(0), site.operand_shape(1)
    bytes_ = xla_shape_size(site.inst.shape) + xla_shape_size(a) / 2 + xla_shape_size(b)
    return Cost(flops=2 * a.dims[-1] * elements(b), bytes_accessed=bytes_)  # type: ignore[union-attr]


def _cholesky(site: Site) -> Cost:
    a = site.operand_shape(0)
    return Cost(flops=(a.dims[-1] * elements(a)) // 3,  # type: ignore[union-attr]
                bytes_accessed=xla_shape_size(a))


def _all_reduce(site: Site) -> Cost:
    out = leaf_bytes(site.inst.shape)
    operands = sum(xla_shape_size(site.comp[n].shape) for n in site.inst.operands)
    return Cost(flops=leaf_elements(site.inst.shape), bytes_accessed=out + operands)


def _rng(site: Site) -> Cost:
    return site.default(transcendentals=elements(site.inst.shape))


def _rng_bit_generator(site: Site) -> Cost:
    return site.default(transcendentals=leaf_elements(site.inst.shape))


def _transpose(site: Site) -> Cost:
    return ZERO if transpose_is_bitcast(site) else site.default()


def _call(site: Site) -> Cost:
    return site.called("to_apply")


def _async_start(site: Site) -> Cost:
    called = site.inst.called_computations()
    return site.analysis.computation_cost(called[0]) if called else site.default()


def _conditional(site: Site) -> Cost:
    branches = site.inst.called_computations()
    result = ZERO
    for name in branches:
        result = result.maximum(site.analysis.computation_cost(name))
    return result


def _while(site: Site) -> Cost:
    body = site.called("body")
    condition = site.called("condition")
    if site.analysis.count_loop_iterations:
        trips = known_trip_count(site.analysis, site.comp, site.inst)
        if trips is not None:
            return body.scaled(trips) + condition.scaled(trips + 1)
    return body + condition


def _custom_call(site: Site) -> Cost:
    if site.analysis.xla_compatible:
        return Cost(flops=-1.0, bytes_accessed=-1.0)
    return site.default()


def _fusion(site: Site) -> Cost:
    fused = site.analysis.computation(site.inst.called_computations()[0])
    if site.inst.attr("kind") is not None and "kCustom" in str(site.inst.attr("kind")):
        for inner in fused.instructions:
            if inner.opcode in ("gather", "scatter"):
                return RULES[inner.opcode](Site(site.analysis, fused, inner))
    compute = site.analysis.computation_cost(fused.name).compute_only()
    return compute + Cost(bytes_accessed=fusion_bytes(site.analysis, site.comp, site.inst, fused))


#: XLA's rule per opcode; the cost class of :data:`~hlo_shard.opinfo.OPINFO` (``cost``)
#: decides the pointer-only, all-reduce-like and elementwise ones (listed last: an
#: elementwise opcode is priced per element whatever else it is).
RULES: dict[str, Rule] = {
    **{opcode: _free for opcode in NO_COST},
    **{opcode: _all_reduce for opcode in opcodes_where(lambda i: i.cost == ALL_REDUCE)},
    "tuple": _tuple,
    "slice": _slice,
    "dynamic-slice": _dynamic_slice,
    "dynamic-update-slice": _dynamic_update_slice,
    "gather": _gather,
    "scatter": _scatter,
    "dot": _dot,
    "convolution": _convolution,
    "reduce": _reduce,
    "map": _map,
    "reduce-window": _reduce_window,
    "select-and-scatter": _select_and_scatter,
    "sort": _sort,
    "fft": _fft,
    "triangular-solve": _triangular_solve,
    "cholesky": _cholesky,
    "rng": _rng,
    "rng-bit-generator": _rng_bit_generator,
    "transpose": _transpose,
    "call": _call,
    "async-start": _async_start,
    "conditional": _conditional,
    "while": _while,
    "custom-call": _custom_call,
    "fusion": _fusion,
    **{opcode: _elementwise for opcode in PER_ELEMENT_COST},
}


# ----------------------------------------------------------------------- fusion bytes


def fusion_bytes(analysis: CostAnalysis, caller: Computation, fusion: Instruction,
                 fused: Computation) -> float:
    """XLA's fusion memory traffic: outputs written (only the update of an in-place
    dynamic-update-slice root), large constants read, and each parameter read once
    unless its users (slices, broadcasts, reshapes) read it differently."""
    root = fused.root
    total = 0.0
    if isinstance(fusion.shape, TupleShape):
        for index, leaf in enumerate(fusion.shape.elements):
            producer = fused[root.operands[index]] if root.opcode == "tuple" else None
            if isinstance(leaf, TupleShape):
                total += sum(part.byte_size for _, part in leaf.leaves())
            elif producer is not None and producer.opcode == "dynamic-update-slice":
                total += xla_shape_size(fused[producer.operands[1]].shape)
            else:
                total += xla_shape_size(leaf)
    elif root.opcode == "dynamic-update-slice":
        total += xla_shape_size(fused[root.operands[1]].shape)
    else:
        total += xla_shape_size(fusion.shape)
    for inner in fused.instructions:
        if inner.opcode == "constant" and elements(inner.shape) > 1:
            total += xla_shape_size(inner.shape)
    users = _users(fused)
    for param in fused.parameters():
        if isinstance(param.shape, TupleShape):
            for leaf_index, _ in param.shape.leaves():
                total += _parameter_read_bytes(
                    analysis, fused, _follow_gtes(fused, users, param, leaf_index), users)
        else:
            total += _parameter_read_bytes(analysis, fused, param, users)
    return total


def _users(comp: Computation) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = {inst.name: [] for inst in comp.instructions}
    for inst in comp.instructions:
        for operand in dict.fromkeys(inst.operands):
            users[operand].append(inst)
    return users


def _follow_gtes(comp: Computation, users: dict[str, list[Instruction]],
                 start: Instruction, index: tuple[int, ...]) -> Instruction:
    node = start
    for part in index:
        for user in users[node.name]:
            if user.opcode == "get-tuple-element" and user.attr("index") == part:
                node = user
                break
    return node


def _parameter_read_bytes(analysis: CostAnalysis, comp: Computation, value: Instruction,
                          users: dict[str, list[Instruction]]) -> float:
    """``FusionParameterReadBytes``: bytes a fused parameter costs to read."""
    size = xla_shape_size(value.shape)
    total = 0.0
    seen_trivial = False

    def trivial() -> float:
        nonlocal seen_trivial
        if seen_trivial:
            return 0.0
        seen_trivial = True
        return size

    for user in users[value.name]:
        if user.opcode == "fusion":
            total += _nested_fusion_read_bytes(analysis, comp, value, user, users)
        elif user.opcode == "slice":
            total += xla_shape_size(user.shape)
        elif user.opcode == "dynamic-slice":
            total += xla_shape_size(user.shape) if user.operands[0] == value.name else trivial()
        elif user.opcode == "dynamic-update-slice":
            total += trivial() if user.operands[0] != value.name else 0.0
        elif user.opcode in ("broadcast", "reshape"):
            total += size
        else:
            total += trivial()
    return total


def _nested_fusion_read_bytes(analysis: CostAnalysis, comp: Computation, value: Instruction,
                              fusion: Instruction, users: dict[str, list[Instruction]]) -> float:
    """A fused parameter read by a nested fusion (rare; XLA's TODO b/332998529)."""
    inner = analysis.computation(fusion.called_computations()[0])
    inner_users = _users(inner)
    params = inner.parameters()
    total = 0.0
    for index, operand in enumerate(fusion.operands):
        if operand != value.name:
            continue
        param = params[index]
        root = inner.root
        simple = not root.operands or root.operands[0] == param.name
        seen = False
        for fusion_user in users[fusion.name]:
            if simple and fusion_user.opcode == "slice":
                total += xla_shape_size(fusion_user.shape)
            elif simple and fusion_user.opcode == "dynamic-slice":
                if fusion_user.operands[0] == fusion.name:
                    total += xla_shape_size(fusion_user.shape)
                elif not seen:
                    seen = True
                    total += xla_shape_size(fusion.shape)
            elif simple and fusion_user.opcode == "dynamic-update-slice":
                if fusion_user.operands[0] != fusion.name and not seen:
                    seen = True
                    total += xla_shape_size(fusion.shape)
            elif not seen:
                seen = True
                total += _parameter_read_bytes(analysis, inner, param, inner_users)
    return total


# ----------------------------------------------------------------- attribute helpers


def convolution_flops(site: Site) -> int:
    """``GetConvolutionFlops``: 2 × valid (input, kernel) position pairs × features."""
    inst = site.inst
    lhs, rhs, out = site.operand_shape(0), site.operand_shape(1), inst.shape
    dims = read_dim_labels(inst.attr("dim_labels"))
    window = read_window(inst.attr("window")) or [WindowDim(1)]
    if not dims.input_spatial:
        in_limits = kernel_limits = out_limits = [1]
    else:
        in_limits = [lhs.dims[d] for d in dims.input_spatial]  # type: ignore[union-attr]
        kernel_limits = [rhs.dims[d] for d in dims.kernel_spatial]  # type: ignore[union-attr]
        out_limits = [out.dims[d] for d in dims.output_spatial]  # type: ignore[union-attr]
    valid = []
    for axis, w in enumerate(window):
        n_in, n_k, n_out = in_limits[axis], kernel_limits[axis], out_limits[axis]
        if (n_in == n_out and n_k == n_out and n_in == w.lhs_dilate and w.rhs_dilate == 1
                and max(1, n_in - 1) == w.stride and w.pad_low == 0 and w.pad_high == 0):
            valid.append(n_in)
            continue
        if (n_in == 1 and n_k == n_out and w.rhs_dilate == 1 and w.lhs_dilate == 1
                and w.stride == 1 and w.pad_high == n_out - 1 and w.pad_low == n_out - 1):
            valid.append(n_out)
            continue
        count = 0
        for k in range(n_k):
            for o in range(n_out):
                undilated = o * w.stride - w.pad_low + k * w.rhs_dilate
                index = undilated // w.lhs_dilate if w.lhs_dilate > 1 else undilated
                if undilated != index * w.lhs_dilate or not 0 <= index < n_in:
                    continue
                count += 1
        valid.append(count)
    feature_groups = inst.int_attr("feature_group_count") or 1
    batch_groups = inst.int_attr("batch_group_count") or 1
    fmas = ((lhs.dims[dims.input_feature] // feature_groups)  # type: ignore[union-attr]
            * out.dims[dims.output_feature]  # type: ignore[union-attr]
            * (lhs.dims[dims.input_batch] // batch_groups)  # type: ignore[union-attr]
            * math.prod(valid))
    return 2 * fmas


def transpose_is_bitcast(site: Site) -> bool:
    """XLA's ``TransposeIsBitcast``: the permutation only relabels the layout."""
    out, operand = site.inst.shape, site.operand_shape(0)
    if not isinstance(out, ArrayShape) or not isinstance(operand, ArrayShape):
        return False
    permutation = site.inst.attr("dimensions", ()) or ()
    mapped = tuple(permutation[d] for d in out.minor_to_major())  # type: ignore[index]
    return mapped == operand.minor_to_major()


def known_trip_count(analysis: CostAnalysis, comp: Computation, loop: Instruction) -> int | None:
    """A while loop's trip count when it is evident: ``known_trip_count`` in the
    backend config, or ``i < C`` in the condition with ``i`` starting at a constant."""
    config = loop.attr("backend_config")
    if config is not None:
        text = getattr(config, "text", getattr(config, "value", str(config)))
        match = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', text)
        if match:
            return int(match.group(1))
    cond_ref = loop.attr("condition")
    if not isinstance(cond_ref, ComputationRef):
        return None
    cond = analysis.computation(cond_ref.name)
    root = cond.root
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = str(getattr(root.attr("direction"), "name", root.attr("direction")))
    counter, limit = cond[root.operands[0]], cond[root.operands[1]]
    if direction == "GT":
        counter, limit, direction = limit, counter, "LT"
    if direction != "LT" or counter.opcode != "get-tuple-element" or limit.opcode != "constant":
        return None
    start = _constant_tuple_element(comp, comp[loop.operands[0]], counter.required_attr("index", int))
    stop = _scalar_literal(limit)
    if start is None or stop is None:
        return None
    return max(0, stop - start)


def _constant_tuple_element(comp: Computation, tuple_inst: Instruction, index: int) -> int | None:
    if tuple_inst.opcode != "tuple" or index >= len(tuple_inst.operands):
        return None
    element = comp[tuple_inst.operands[index]]
    return _scalar_literal(element) if element.opcode == "constant" else None


def _scalar_literal(inst: Instruction) -> int | None:
    try:
        return int(json.loads(inst.literal or ""))
    except (ValueError, TypeError):
        return None
