"""Peak memory per device: buffer liveness over the module's schedule.

The schedule is the entry computation's order when the module ``is_scheduled``, else a
topological order in which the collectives XLA would combine run as one (reading all
their operands and writing all their results at once). Only values that reach memory
get buffers — for an unfused module those are the outputs of the kernels
:mod:`hlo_shard.costmodel.kernels` emulates — and each buffer lives from the kernel that
writes it to the last kernel that reads it.
Like XLA's buffer assignment:

* parameters are live for the whole step (the caller owns them); constants live in
  read-only data and are not counted;
* get-tuple-element, tuple, bitcast, and what XLA turns into bitcasts (a reshape or
  copy that leaves the bytes in place, a transpose absorbed by its dot's layout)
  alias their operand; a tuple-shaped result (a combined all-reduce, a multi-output
  fusion, a loop) also has a table of its elements' addresses;
* an elementwise kernel, a dynamic-update-slice and a while loop write into an operand
  buffer that dies there (in place) when both have the same shape and layout
  (``CanShareOperandBufferWithUser``: a transposing loop cannot);
* ``input_output_alias`` makes an output share its parameter's buffer (a donated
  argument), and an output that is an undonated parameter is a copy;
* a while, call or conditional adds what its callee allocates on top of the buffers
  it is passed (a loop body's new carry values and temporaries); carry elements the
  body returns unchanged stay where they were (no copy, even of a parameter).

``peak_bytes`` is what ``CompiledMemoryStats`` adds up (argument + output + temp −
alias): XLA gives every output its own allocation and fits temporaries into them,
largest first, where their live ranges do not interfere (``BufferAssigner``); the rest
share the temp allocation, packed by liveness with 64-byte alignment (XLA CPU's heap).
``high_water_bytes`` is the most that is ever live at once (a perfectly packed heap),
and the curve plotted over the schedule.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Generator, Mapping
from dataclasses import dataclass, field
import itertools
import math

from hlo_shard.costmodel.network import Combiner
from hlo_shard.costmodel.flops import POINTER_BYTES, leaf_bytes
from hlo_shard.costmodel.kernels import (
    CONTROL_FLOW_OPCODES, POINTER_OPCODES, KernelPlan, KernelPlans, is_prefused,
)
from hlo_shard.graph import NestedWalk, run_nested, stable_topological_sort, topological_order
from hlo_shard.ir import (
    ELEMENT_BITS, HALF_FLOAT_TYPES, ArrayShape, Computation, Instruction, Module, Shape,
    TupleShape, shape_leaves,
)
from hlo_shard.opinfo import IN_PLACE
from hlo_shard.profiles import DEFAULT_COMBINE_THRESHOLD_BYTES

#: Ops that may write their result into an operand buffer that dies at them (XLA's
#: ``CanShareOperandBufferWithUser``: elementwise loops, fusions of them, in-place
#: updates, loops over their carry).
_IN_PLACE_OPCODES = IN_PLACE


#: Alignment of each buffer in XLA's temp allocation (the CPU backend's heap).
HEAP_ALIGNMENT = 64

CATEGORIES = ("weights", "optimizer_state", "batch", "other_parameters", "gradients",
              "activations", "temporaries", "outputs")

#: Buffer categories of the temporary allocation.
_TEMPORARY = ("gradients", "activations", "temporaries")


@dataclass(frozen=True, slots=True)
class Buffer:
    owner: str
    size: int
    category: str
    #: What in-place reuse compares (dimensions and layout).
    shape: Shape | None = None


@dataclass
class MemoryProfile:
    """Per-device memory of one step, in XLA's accounting: arguments + outputs + the
    temporary allocation − outputs aliased to (donated) arguments."""

    peak_bytes: int
    #: The instruction at which the temporary allocation is at its largest.
    peak_instruction: str
    #: ``peak_bytes`` by category: arguments by kind, outputs not aliased to an
    #: argument, and the temporaries (gradients apart) live at ``peak_instruction``.
    peak_breakdown: dict[str, int]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    #: XLA's ``temp`` allocation, modelled: the peak of live temporaries that cannot
    #: borrow a not-yet-written output buffer of their size.
    temp_bytes: int
    #: The largest sum of live buffers at any point (a perfectly packed heap) and where.
    high_water_bytes: int
    high_water_instruction: str
    #: (position, instruction, live bytes) after each scheduled instruction.
    curve: list[tuple[int, str, int]] = field(default_factory=list)
    #: The temp allocation's bytes by category (gradients, activations, temporaries —
    #: a callee's transient peak among the temporaries) at each scheduled instruction:
    #: what a projection that scales one category more than another takes the peak of
    #: (the step at which the allocation peaks moves with the factors).
    temp_levels: dict[str, list[int]] = field(default_factory=dict)

    def temp_peak_scaled(self, factors: Mapping[str, float]) -> float:
        """The temp allocation's peak with each category's bytes times its factor (1
        where none is given), over every step."""
        steps = len(next(iter(self.temp_levels.values()), []))
        return max((sum(factors.get(c, 1.0) * levels[i]
                        for c, levels in self.temp_levels.items())
                    for i in range(steps)), default=0.0)

    def to_json(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes, "peak_instruction": self.peak_instruction,
            "peak_breakdown": self.peak_breakdown, "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes, "alias_bytes": self.alias_bytes,
            "temp_bytes": self.temp_bytes, "high_water_bytes": self.high_water_bytes,
            "high_water_instruction": self.high_water_instruction,
        }


def schedule(module: Module, comp: Computation, combiner: Combiner
             ) -> tuple[list[Instruction], list[list[str]]]:
    """The order instructions run in: as written when the module is scheduled, else a
    topological order in which the collectives XLA would combine run together
    (``combiner``'s buckets; none with a threshold of 0); and those buckets of
    collectives (each runs as one combined op)."""
    if module.is_scheduled:
        return list(comp.instructions), []
    if not combiner.threshold_bytes:
        return topological_order(comp), []
    buckets = combiner.buckets(comp)
    bucket_of: dict[str, list[str]] = {}
    for bucket in buckets:
        for name in bucket:
            bucket_of[name] = bucket
    topo = [inst.name for inst in topological_order(comp)]
    # A bucket runs as one node: ready when all of its members' operands are.
    node = {name: bucket_of.get(name, [name])[0] for name in topo}
    deps: dict[str, set[str]] = {}
    for inst in comp.instructions:
        deps.setdefault(node[inst.name], set()).update(
            node[o] for o in inst.operands if node[o] != node[inst.name])
    heads = [name for name in topo if node[name] == name]
    order = [comp[name] for head in stable_topological_sort(heads, deps)
             for name in bucket_of.get(head, [head])]
    return order, [bucket for bucket in buckets if len(bucket) > 1]


def memory_profile(module: Module, parameter_kinds: dict[str, str] | None = None,
                   gradients: set[str] | None = None, activations: set[str] | None = None,
                   *, upcast_16bit_floats: bool = False,
                   combine_threshold_bytes: int = DEFAULT_COMBINE_THRESHOLD_BYTES,
                   combined_collectives: Collection[str] | None = None,
                   combiner: Combiner | None = None,
                   plans: KernelPlans | None = None) -> MemoryProfile:
    """Liveness of the entry computation. ``parameter_kinds`` maps entry parameter
    names to ``weights``/``optimizer_state``/``batch`` (others: ``other_parameters``);
    ``gradients`` names the values holding gradients (collective inputs and results),
    ``activations`` the forward/backward values (their size follows the batch).
    ``upcast_16bit_floats``: the backend computes bf16/f16 in f32 (XLA CPU's float
    normalization), so temporaries of those types take 4 bytes per element;
    ``combine_threshold_bytes``: the collective combiner's bucket size (0: none);
    ``combined_collectives``: the kinds it combines (all when None); ``combiner``: those
    buckets found already (the two settings then go unused); ``plans``: the kernel plans
    made already of this module."""
    entry = module.entry
    kinds = parameter_kinds or {}
    emulate = not is_prefused(module)
    combiner = combiner or Combiner(module, combine_threshold_bytes, combined_collectives)
    return _Liveness(module, entry, kinds, gradients or set(), emulate, combiner,
                     plans or KernelPlans(), upcast=upcast_16bit_floats,
                     activations=activations or set()).run()


def _same_array(a: Buffer, b: Buffer) -> bool:
    """Same dimensions and layout: XLA shares an operand buffer only then (a loop
    that transposes cannot write over what it reads)."""
    return (isinstance(a.shape, ArrayShape) and isinstance(b.shape, ArrayShape)
            and a.shape.dims == b.shape.dims and a.size == b.size
            and a.shape.minor_to_major() == b.shape.minor_to_major())


def temporary_bytes(shape: Shape, upcast: bool) -> int:
    """Bytes of a temporary of ``shape``; 16-bit floats as f32 when ``upcast``."""
    if not upcast:
        return leaf_bytes(shape)
    return sum(leaf.num_elements * (4 if leaf.element_type in HALF_FLOAT_TYPES else
                                    ELEMENT_BITS[leaf.element_type] // 8)
               for _, leaf in shape_leaves(shape))


class _Liveness:
    """Liveness of one computation. Buffers are keyed by the defining instruction's
    name, with ``#i`` for element i of a tuple-shaped value (a loop carry, a tuple
    all-reduce, a multi-output fusion), so that get-tuple-element selects one."""

    def __init__(self, module: Module, comp: Computation, kinds: dict[str, str],
                 gradients: set[str], emulate: bool, combiner: Combiner,
                 plans: KernelPlans, nested: bool = False,
                 upcast: bool = False, activations: frozenset[str] | set[str] = frozenset()
                 ) -> None:
        self.module = module
        self.upcast = upcast
        self.activations = activations
        self.combiner = combiner
        self.plans = plans
        self.comp = comp
        self.kinds = kinds
        self.gradients = gradients
        self.emulate = emulate
        self.nested = nested
        self.order, buckets = schedule(module, comp, combiner)
        self.position = {inst.name: i for i, inst in enumerate(self.order)}
        #: A combined collective reads all its members' operands and writes all their
        #: results at once: reads count at its last member, writes at its first.
        self.read_at: dict[str, int] = {}
        self.write_at: dict[str, int] = {}
        for bucket in buckets:
            positions = [self.position[name] for name in bucket]
            for name in bucket:
                self.read_at[name], self.write_at[name] = max(positions), min(positions)
        self.plan: KernelPlan = plans.plan(comp, emulate)
        #: Value name → the buffers it refers to, per top-level element of its shape.
        self.elements: dict[str, list[tuple[str, ...]]] = {}
        self.buffers: dict[str, Buffer] = {}
        #: Buffer key → name of the instruction that defines it.
        self.definer: dict[str, str] = {}
        #: Buffer written in place → the dying operand buffer it reuses.
        self.reuses: dict[str, str] = {}
        #: Tuple-shaped value → the buffer of its element-address table.
        self.tables: dict[str, str] = {}

    def owners(self, name: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for element in self.elements.get(name, []) for k in element))

    # -- buffers --------------------------------------------------------------------
    def _allocate(self, inst: Instruction, category: str) -> None:
        shape = inst.shape
        parts = (list(enumerate(shape.elements)) if isinstance(shape, TupleShape)
                 else [(None, shape)])
        self.elements[inst.name] = []
        upcast = self.upcast and category in _TEMPORARY
        for index, part in parts:
            key = inst.name if index is None else f"{inst.name}#{index}"
            self.buffers[key] = Buffer(key, temporary_bytes(part, upcast), category, part)
            self.definer[key] = inst.name
            self.elements[inst.name].append((key,))
        if isinstance(shape, TupleShape) and inst.opcode != "parameter" and \
                inst.name != self.comp.root_name:
            # XLA's tuple buffer: the table of its elements' addresses.
            key = f"{inst.name}#table"
            self.buffers[key] = Buffer(key, POINTER_BYTES * len(parts), "temporaries")
            self.definer[key] = inst.name
            self.tables[inst.name] = key

    def _define(self) -> None:
        for inst in self.order:
            if inst.opcode == "parameter":
                # A callee's parameters are its caller's buffers (a loop's carry).
                self._allocate(inst, "temporaries" if self.nested else self.kinds.get(
                    inst.name, "other_parameters"))
            elif inst.opcode == "get-tuple-element":
                source = self.elements.get(inst.operands[0], [])
                index = inst.required_attr("index", int)
                self.elements[inst.name] = ([source[index]] if index < len(source)
                                            else [self.owners(inst.operands[0])])
            elif inst.opcode == "tuple":
                self.elements[inst.name] = [self.owners(o) for o in inst.operands]
            elif inst.opcode == "bitcast" or inst.name in self.plan.relabels:
                self.elements[inst.name] = list(self.elements.get(inst.operands[0], []))
            elif inst.name in self.plan.materialized or inst.opcode in CONTROL_FLOW_OPCODES:
                self._allocate(inst, "gradients" if inst.name in self.gradients
                               else "activations" if inst.name in self.activations
                               else "temporaries")
                if inst.opcode == "while":
                    self._pass_through_carry(inst)
            else:
                self.elements[inst.name] = []  # constants, fused and recomputed values
        if self.nested:
            return  # a callee's results are its caller's buffers (a loop's carry)
        for key in self.owners(self.comp.root.name):
            buffer = self.buffers[key]
            if buffer.category in ("activations", "temporaries") and not self._is_parameter(key):
                shape = self._shape_of(key)
                self.buffers[key] = Buffer(key, leaf_bytes(shape), "outputs", shape)

    def _pass_through_carry(self, loop: Instruction) -> None:
        """Carry elements the body returns unchanged stay in their initial buffer
        (XLA copies only what the loop writes), even a caller's parameter."""
        body = self.module.computation(loop.called("body"))
        init = self.elements.get(loop.operands[0], [])
        carry = body.parameters()[0].name if body.parameters() else None
        if body.root.opcode != "tuple":
            return
        for index, name in enumerate(body.root.operands):
            value = body[name]
            if (index < len(init) and value.opcode == "get-tuple-element"
                    and value.operands[0] == carry
                    and value.required_attr("index", int) == index):
                for key in self.elements[loop.name][index]:
                    del self.buffers[key], self.definer[key]
                self.elements[loop.name][index] = init[index]

    def _shape_of(self, key: str) -> Shape:
        shape = self.comp[self.definer[key]].shape
        if "#" in key and isinstance(shape, TupleShape):
            return shape.elements[int(key.rsplit("#", 1)[1])]
        return shape

    def _is_parameter(self, key: str) -> bool:
        return self.comp[self.definer[key]].opcode == "parameter"

    # -- uses -----------------------------------------------------------------------
    def _reads(self, inst: Instruction) -> tuple[list[str], tuple[str, ...]]:
        """Values an executing unit reads (kernel inputs seen through fused producers),
        and the sources of a recomputed producer that other kernels read as well
        (:meth:`~hlo_shard.costmodel.kernels.KernelPlan.kernel_inputs`)."""
        kernel = self.plan.kernel_of.get(inst.name)
        if kernel is None:
            return list(inst.operands), ()
        if kernel.members[-1] is not inst:
            return [], ()
        found = self.plan.kernel_inputs(kernel)
        return [name for _, name in found.named], found.shared

    def _last_uses(self) -> dict[str, int]:
        """Buffer key → the position of its last reader (the root's: the end)."""
        last_use: dict[str, int] = {}
        #: id of a shared sources tuple → (the tuple, its last reader's position).
        read_last: dict[int, tuple[tuple[str, ...], int]] = {}
        for inst in self.order:
            for table in (self.tables[o] for o in inst.operands if o in self.tables):
                last_use[table] = self.position[inst.name]  # get-tuple-element reads it
            if inst.opcode in POINTER_OPCODES:
                continue
            at = self.read_at.get(inst.name, self.position[inst.name])
            names, shared = self._reads(inst)
            for name in names:
                for key in self.owners(name):
                    last_use[key] = max(last_use.get(key, -1), at)
            if shared:  # its names' last use is that of its last reader: set once below
                latest = read_last.get(id(shared), (shared, -1))[1]
                read_last[id(shared)] = (shared, max(latest, at))
        for shared, at in read_last.values():
            for name in shared:
                for key in self.owners(name):
                    last_use[key] = max(last_use.get(key, -1), at)
        for key in self.owners(self.comp.root.name):
            last_use[key] = len(self.order)
        return last_use

    def run(self) -> MemoryProfile:
        """The profile of the computation, those its control flow runs followed on
        :func:`run_nested`'s stack."""
        return run_nested(self._walk(), lambda nested: nested._walk())

    def _walk(self) -> NestedWalk[_Liveness, MemoryProfile]:
        self._define()
        last_use = self._last_uses()
        argument_bytes = sum(b.size for k, b in self.buffers.items() if self._is_parameter(k))
        aliases = self.module.output_aliases() if not self.nested else {}
        output_bytes, alias_bytes, copied = self._output_accounting(aliases)
        self._donate(aliases)

        live = {k: b for k, b in self.buffers.items() if self._is_parameter(k)}
        dies_at: dict[int, list[str]] = {}
        for key, pos in last_use.items():
            dies_at.setdefault(pos, []).append(key)
        for key in self.buffers:  # defined, never read: dies at once
            if key not in last_use and not self._persistent(key):
                dies_at.setdefault(self.position[self.definer[key]], []).append(key)
        live_bytes = sum(b.size for b in live.values())  # kept up to date below
        peak, peak_at = live_bytes, "(start)"
        born: dict[str, int] = {}
        transients: list[int] = []
        curve: list[tuple[int, str, int]] = [(0, peak_at, peak)]
        for inst in self.order:
            pos = self.position[inst.name]
            transient = (yield from self._callee_peak(inst)) \
                if inst.opcode in CONTROL_FLOW_OPCODES else 0
            written = self._written(inst)
            dying = [live[k] for k in dies_at.get(pos, ()) if k in live
                     and not self._persistent(k)]
            shared = self._in_place_bytes(inst, written, dying)
            for buffer in written:
                replaced = live.get(buffer.owner)
                live_bytes += buffer.size - (replaced.size if replaced is not None else 0)
                live[buffer.owner] = buffer
                born[buffer.owner] = self.write_at.get(inst.name, pos)
            level = live_bytes + transient - shared
            if level > peak:
                peak, peak_at = level, inst.name
            transients.append(transient)
            for key in dies_at.get(pos, ()):
                if key in live and not self._persistent(key):
                    live_bytes -= live.pop(key).size
            # What is live while the instruction runs: the same figure the peak is the
            # maximum of, so the plot and the table ("live at once") agree.
            curve.append((pos, inst.name, level))
        if copied:
            level = live_bytes + copied
            if level > peak:
                peak, peak_at = level, self.comp.root.name
            curve.append((len(self.order), self.comp.root.name, level))
        temp_peak, temp_at, temp_split, temp_levels = self._temp_allocation(
            born, last_use, transients)
        breakdown = {c: 0 for c in CATEGORIES}
        for key, buffer in self.buffers.items():
            if self._is_parameter(key):
                breakdown[buffer.category] += buffer.size
        breakdown["outputs"] = output_bytes - alias_bytes
        breakdown.update(temp_split)
        return MemoryProfile(
            argument_bytes + output_bytes + temp_peak - alias_bytes,
            self.order[temp_at].name if self.order else "", breakdown, argument_bytes,
            output_bytes, alias_bytes, temp_peak, peak, peak_at, curve, temp_levels)

    def _temp_allocation(self, born: dict[str, int], last_use: dict[str, int],
                         transients: list[int]
                         ) -> tuple[int, int, dict[str, int], dict[str, list[int]]]:
        """XLA's temp allocation (``BufferAssigner``): every output has an allocation
        of its own, and temporaries, largest first, move into the smallest one that
        fits whose values do not interfere with theirs (one ends before the other is
        written, or as it is written in place); the rest are packed by liveness into
        the temp allocation, each aligned. Returns (bytes, position, by category, by
        category at each position)."""
        def interval(key: str) -> tuple[int, int]:
            return born[key], last_use.get(key, born[key])

        def disjoint(a: str, b: str) -> bool:
            (a_start, a_end), (b_start, b_end) = interval(a), interval(b)
            return (a_end < b_start or b_end < a_start
                    or (a_end == b_start and self.reuses.get(b) == a)
                    or (b_end == a_start and self.reuses.get(a) == b))

        outputs = sorted((k for k, b in self.buffers.items()
                          if k in born and b.category == "outputs" and b.size),
                         key=lambda k: (self.buffers[k].size, -born[k]))
        # A temporary an output is written over in place has that output's allocation.
        written_over = {self.reuses[k]: k for k in outputs if k in self.reuses}
        # (Values a loop body writes over its carry live in the caller's buffers.)
        temps = sorted((k for k, b in self.buffers.items()
                        if k in born and b.category in _TEMPORARY
                        and not (k in self.reuses and self._is_parameter(self.reuses[k]))),
                       key=lambda k: (k not in written_over, -self.buffers[k].size, born[k]))
        packing = _Packing(outputs, interval, disjoint, self.reuses,
                           1 + max((interval(k)[1] for k in [*outputs, *temps]), default=0))
        sizes = [self.buffers[k].size for k in outputs]
        heap = []
        tables = set(self.tables.values())  # tuples share no array's allocation
        for key in temps:
            size = self.buffers[key].size
            over = written_over.get(key)
            # (the outputs too small for it, first in size order, are not looked at)
            home = None if key in tables else \
                over if over is not None and self.buffers[over].size >= size and \
                packing.free(over, key) else \
                packing.first_free(key, bisect.bisect_left(sizes, size))
            if home is None:
                heap.append(key)
            else:
                packing.place(home, key)
        steps = len(self.order)
        # Each buffer adds its size where it is live: changes at its ends, summed up
        # once (a long-lived buffer costs two entries, not one per step it spans).
        change = {c: [0] * (steps + 1) for c in _TEMPORARY}
        in_heap = set(heap)
        for key in heap:
            buffer = self.buffers[key]
            size = -(-buffer.size // HEAP_ALIGNMENT) * HEAP_ALIGNMENT
            start, end = interval(key)
            if self.reuses.get(key) in in_heap:
                start += 1  # written into the operand buffer that dies there
            end = min(end, steps - 1)
            if start <= end:
                change[buffer.category][start] += size
                change[buffer.category][end + 1] -= size
        if not steps:
            return 0, 0, {}, {}
        level = {c: list(itertools.accumulate(change[c][:steps])) for c in _TEMPORARY}
        # (a callee's transient peak counts among the temporaries)
        level["temporaries"] = [t + extra for t, extra in zip(level["temporaries"], transients)]
        totals = [sum(level[c][i] for c in _TEMPORARY) for i in range(steps)]
        at = max(range(steps), key=totals.__getitem__)
        return totals[at], at, {c: level[c][at] for c in _TEMPORARY}, level

    def _output_leaves(self) -> list[tuple[str | None, tuple[str, ...], Shape]]:
        """(value name when known, buffers, shape) of each top-level output element."""
        root = self.comp.root
        if not isinstance(root.shape, TupleShape):
            return [(root.name, self.owners(root.name), root.shape)]
        names = root.operands if root.opcode == "tuple" else [None] * len(root.shape.elements)
        return [(name, element, shape) for name, element, shape in
                zip(names, self.elements.get(root.name, []), root.shape.elements)]

    def _output_accounting(self, aliases: dict[int, int]) -> tuple[int, int, int]:
        """(output bytes, aliased bytes, bytes of outputs that copy an undonated parameter)."""
        params = {p.parameter_number for p in self.comp.parameters()}
        leaves = self._output_leaves()
        output = sum(leaf_bytes(shape) for _, _, shape in leaves)
        if isinstance(self.comp.root.shape, TupleShape):
            output += POINTER_BYTES * len(leaves)
        alias = sum(leaf_bytes(leaves[i][2]) for i, p in aliases.items()
                    if i < len(leaves) and p in params)
        copied = sum(leaf_bytes(shape) for i, (name, keys, shape) in enumerate(leaves)
                     if i not in aliases and self._needs_copy(name, keys))
        return output, alias, copied

    def _written(self, inst: Instruction) -> list[Buffer]:
        """Buffers allocated when ``inst`` runs: all of its kernel's outputs when it
        ends a kernel (a fusion writes its outputs as it reads its inputs)."""
        if inst.opcode == "parameter":
            return []
        kernel = self.plan.kernel_of.get(inst.name)
        if kernel is not None and kernel.members[-1] is not inst:
            return []
        members = kernel.members if kernel is not None else [inst]
        return [self.buffers[k] for m in members for k in self._defined_by(m.name)]

    def _defined_by(self, name: str) -> list[str]:
        table = [self.tables[name]] if name in self.tables else []
        return [k for element in self.elements.get(name, []) for k in element
                if self.definer.get(k) == name] + table

    def _in_place_bytes(self, inst: Instruction, written: list[Buffer],
                        dying: list[Buffer]) -> int:
        """Bytes of new buffers that reuse an input dying here (recorded in
        ``reuses``), buffer for buffer of the same shape and layout, when the kernel
        is an elementwise loop (or an in-place op)."""
        kernel = self.plan.kernel_of.get(inst.name)
        members = kernel.members if kernel else [inst]
        if not written or any(m.opcode == "reduce" for m in members) or \
                not any(m.opcode in _IN_PLACE_OPCODES for m in members):
            return 0
        free = list(dying)
        shared = 0
        for buffer in sorted(written, key=lambda b: -b.size):
            match = next((b for b in free if _same_array(b, buffer)), None)
            if match is not None and buffer.size:
                free.remove(match)
                self.reuses[buffer.owner] = match.owner
                shared += buffer.size
        return shared

    def _persistent(self, key: str) -> bool:
        """The caller's arguments outlive the step; a loop body's carry does not (the
        body may overwrite it after its last read, as XLA does)."""
        return not self.nested and self._is_parameter(key)

    def _donate(self, aliases: dict[int, int]) -> None:
        """An output aliased to a donated parameter is written into that parameter's
        buffer: it allocates nothing of its own."""
        leaves = self._output_leaves()
        for index in aliases:
            if index < len(leaves):
                for key in leaves[index][1]:
                    if not self._is_parameter(key):
                        self.buffers[key] = Buffer(key, 0, "outputs")

    def _needs_copy(self, name: str | None, keys: tuple[str, ...]) -> bool:
        """An output that is a parameter's buffer (or a constant) gets its own copy."""
        if not keys:
            return name is not None and self.comp[name].opcode == "constant"
        return all(self._is_parameter(k) for k in keys)

    def _callee_peak(self, inst: Instruction) -> Generator[_Liveness, MemoryProfile, int]:
        """What the computations the control flow ``inst`` runs add at most on top of
        the buffers they are passed."""
        peaks = []
        for name in inst.called_computations():
            if inst.opcode == "while" and name == getattr(inst.attr("condition"), "name", None):
                continue
            callee = self.module.computation(name)
            nested = _Liveness(self.module, callee, {}, self.gradients, self.emulate,
                               self.combiner, self.plans, nested=True, upcast=self.upcast)
            peaks.append((yield nested).temp_bytes)
        return max(peaks, default=0)


class _Packing:
    """The outputs' allocations as :meth:`MemoryModel._temp_allocation` fills them, in
    size order: which values each holds, and which hold one at some step of a range,
    so that a temporary finds the first allocation free over its steps in time
    logarithmic in the steps (a check of every allocation is quadratic in the module).

    A segment tree over the steps keeps, per node, the allocations (bits, in size
    order) holding a value over all of its steps (``full``) and at any of them
    (``part``). Values that only touch, one written in place over the other as it dies
    (``reuses``), do not interfere: the allocations holding such a partner of a
    temporary are checked value by value instead (:meth:`free`); so are those holding a
    value whose last use the schedule puts before its birth (a value of a kernel that
    ends after one of its readers), which interferes by :func:`disjoint`'s comparisons,
    not by overlapping steps."""

    def __init__(self, outputs: list[str], interval: Callable[[str], tuple[int, int]],
                 disjoint: Callable[[str, str], bool], reuses: Mapping[str, str],
                 steps: int) -> None:
        self.outputs, self.interval, self.disjoint = outputs, interval, disjoint
        self.reuses = reuses
        self.reused_by: dict[str, list[str]] = {}
        for value, operand in reuses.items():
            self.reused_by.setdefault(operand, []).append(value)
        self.index = {out: k for k, out in enumerate(outputs)}
        #: Each allocation's values as (start, end, name), sorted: pairwise disjoint,
        #: so their ends rise with their starts.
        self.held: dict[str, list[tuple[int, int, str]]] = {}
        self.home: dict[str, str] = {}
        #: The values with an inverted interval each allocation holds (not in ``held``
        #: nor in the tree).
        self.inverted: dict[str, list[str]] = {}
        self.size = 1 << max(steps - 1, 1).bit_length()  # a leaf per step
        self.full = [0] * (2 * self.size)
        self.part = [0] * (2 * self.size)
        for out in outputs:
            self.held[out] = []
            self.place(out, out)

    def _nodes(self, start: int, end: int) -> tuple[list[int], list[int]]:
        """The nodes covering steps ``start``..``end`` exactly, and their ancestors."""
        low, high = start + self.size, end + self.size + 1
        ends = (low, high - 1)
        covering = []
        while low < high:
            if low & 1:
                covering.append(low)
                low += 1
            if high & 1:
                high -= 1
                covering.append(high)
            low, high = low >> 1, high >> 1
        above = []
        for leaf in ends:
            leaf >>= 1
            while leaf:
                above.append(leaf)
                leaf >>= 1
        return covering, above

    def place(self, out: str, key: str) -> None:
        start, end = self.interval(key)
        self.home[key] = out
        if end < start:
            self.inverted.setdefault(out, []).append(key)
            return
        bisect.insort(self.held[out], (start, end, key))
        bit = 1 << self.index[out]
        covering, above = self._nodes(start, end)
        for node in covering:
            self.full[node] |= bit
            self.part[node] |= bit
        for node in above:
            self.part[node] |= bit

    def free(self, out: str, key: str) -> bool:
        """No value ``out`` holds interferes with ``key``: only those starting by its
        end and ending from its start on can (a run, as the ends rise)."""
        start, end = self.interval(key)
        values = self.held[out]
        if not all(self.disjoint(key, value) for value in self.inverted.get(out, ())):
            return False
        if end < start:
            return all(self.disjoint(key, value) for _, _, value in values)
        at = bisect.bisect_right(values, (end, math.inf))
        while at:
            at -= 1
            if values[at][1] < start:
                return True
            if not self.disjoint(key, values[at][2]):
                return False
        return True

    def first_free(self, key: str, lowest: int) -> str | None:
        """The first allocation from ``lowest`` on (in size order) free for ``key``."""
        start, end = self.interval(key)
        if end < start:
            return next((out for out in self.outputs[lowest:] if self.free(out, key)), None)
        covering, above = self._nodes(start, end)
        busy = 0
        for node in covering:
            busy |= self.part[node]
        for node in above:
            busy |= self.full[node]
        free = ~busy & ~((1 << lowest) - 1) & ((1 << len(self.outputs)) - 1)
        partners = [self.reuses.get(key), *self.reused_by.get(key, ())]
        for out in {self.home[p] for p in partners if p in self.home}:
            if self.index[out] >= lowest and self.free(out, key):
                free |= 1 << self.index[out]
        for out, values in self.inverted.items():
            bit = 1 << self.index[out]
            if free & bit and not all(self.disjoint(key, value) for value in values):
                free &= ~bit
        return self.outputs[(free & -free).bit_length() - 1] if free else None
