"""Which values reach memory: the kernels XLA would run for an unfused module.

The modules users hand us are usually *before* XLA's fusion passes (the per-device
HLO of a JAX step), so pricing each instruction with its own memory traffic would
charge Adam's ~20 elementwise ops ~20 full passes over the weights, where XLA runs one
fused loop that reads w, g, m, v once and writes w, m, v once. This module groups
instructions the way XLA's loop/input fusion would, closely enough for a roofline:

* elementwise ops, broadcasts, reshapes, slices, pads, … fuse into their consumer when
  all their readers are in one fusible kernel (no duplication of real work); a value
  that is also an output is then written by that kernel as well;
* cheap producers (constants, iota, broadcasts of a smaller operand) are duplicated
  into every consumer, as XLA does, and never materialise;
* a producer read by several such kernels of its own size merges them (XLA's
  multi-output fusion), so Adam reads the gradient once for m, v and w;
* a reduce ends a kernel (input fusion: the reduce is its root); dot, convolution,
  collectives, control flow and custom calls are kernels of their own;
* without multi-output fusion (XLA CPU), a transpose that moves elements
  (:func:`reorders_elements`) read by several kernels is recomputed in each, as XLA's
  fusion duplicates it: each reads its operand in the transposed order, which the
  kernel's :attr:`Kernel.reordered_read_bytes` count for the profile to price.

A module that already contains ``fusion`` instructions was fused by XLA: each
instruction is then its own kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from hlo_shard.costmodel.flops import elements, leaf_bytes
from hlo_shard.graph import topological_order, users_map
from hlo_shard.ir import ArrayShape, Computation, Instruction, Module
from hlo_shard.opinfo import (COPY, CONTROL_FLOW, FUSIBLE, KERNEL_ROOTS, MATMULS, NO_COST,
                              RESHAPE, WINDOW, opcodes_where)

#: Ops that XLA's loop/input fusion merges with their consumers.
FUSIBLE_OPCODES = FUSIBLE


#: Fusible ops whose result never leaves a fusion (a reduce or an in-place update is
#: always the root of its kernel).
_KERNEL_ROOTS = KERNEL_ROOTS

#: Ops that launch nothing: they forward pointers (constants live in read-only data).
POINTER_OPCODES = NO_COST | frozenset({"tuple"})

#: Ops whose work is that of the computations they call (priced by the estimator).
CONTROL_FLOW_OPCODES = CONTROL_FLOW

#: Ops that may leave the bytes where they are (:func:`is_relabel`), and those that read
#: a window of their operand: asked of every instruction, so looked up in a set.
_RESHAPES_AND_COPIES = opcodes_where(lambda info: info.moves in (RESHAPE, COPY))
_WINDOW_READS = opcodes_where(lambda info: info.moves == WINDOW)


@dataclass
class Kernel:
    """One launched kernel: its member instructions and the values it reads/writes."""

    index: int
    members: list[Instruction] = field(default_factory=list)
    #: Bytes read from memory (external inputs, sliced reads counted as slices).
    read_bytes: float = 0.0
    #: Bytes written (values used outside the kernel; in-place updates by their update).
    write_bytes: float = 0.0
    #: The part of ``read_bytes`` read in another element order than the kernel's loop
    #: runs (through a transpose: :func:`reorders_elements`), element by element.
    reordered_read_bytes: float = 0.0


@dataclass
class KernelPlan:
    """How the instructions of one computation map to kernels."""

    comp: Computation
    kernels: list[Kernel]
    #: Instruction name → its kernel (absent: pointer ops and duplicated producers).
    kernel_of: dict[str, Kernel]
    #: Values that are written to memory (kernel outputs and non-fused results).
    materialized: set[str]
    #: Cheap producers recomputed inside each consumer kernel, and reshapes that are
    #: bitcasts of their operand: values with no buffer of their own.
    duplicated: set[str]
    #: The duplicated values that are their operand's buffer relabelled (bitcasts).
    relabels: set[str] = field(default_factory=set)
    #: Duplicated value → the values it is recomputed from (see :meth:`kernel_inputs`).
    sources: dict[str, Sources] = field(default_factory=dict)

    #: id of a shared sources tuple → (its names as a set, their bytes): built once per
    #: tuple, however many kernels read it.
    _shared: dict[int, tuple[frozenset[str], float]] = field(default_factory=dict)
    #: id of a :class:`_Union` → its names, listed once.
    _flattened: dict[int, tuple[str, ...]] = field(default_factory=dict)
    #: Kernel index → :meth:`kernel_inputs`, listed once (the plan's accounting and the
    #: memory model's liveness both read them).
    _inputs: dict[int, KernelInputs] = field(default_factory=dict)

    def _parts(self, operands: Iterable[str]) -> list[tuple[str, ...]]:
        """Per operand (last first): the values read from memory for it — its own name,
        or the sources of the producer the kernel recomputes; nothing for a scalar
        constant (an immediate in the kernel's code)."""
        return [self._flat(self.sources[name]) if name in self.duplicated else
                () if _is_immediate(self.comp[name]) else (name,)
                for name in reversed(list(operands))]

    def _flat(self, sources: Sources) -> tuple[str, ...]:
        """``sources`` as names, the same tuple each time it is asked for."""
        if isinstance(sources, tuple):
            return sources
        if id(sources) not in self._flattened:
            self._flattened[id(sources)] = sources.names()
        return self._flattened[id(sources)]

    def kernel_inputs(self, kernel: Kernel) -> KernelInputs:
        """The values ``kernel`` reads from memory, looking through the producers it
        recomputes (duplicated). Every member's reads are listed, each value once per
        member in the order a depth-first walk finds them, except the sources of one
        recomputed producer with many (``shared``): a global norm's per-gradient sums,
        which every update kernel of a clipped step recomputes. Those are the same
        tuple in every such kernel, so listing them per kernel would make the plan
        gradients × gradients long."""
        found = self._inputs.get(kernel.index)
        if found is None:
            found = self._inputs[kernel.index] = self._kernel_inputs(kernel)
        return found

    def _kernel_inputs(self, kernel: Kernel) -> KernelInputs:
        members = {m.name for m in kernel.members}
        if self.duplicated.isdisjoint(o for m in kernel.members for o in m.operands):
            # Nothing recomputed: each member reads its own operands (most kernels).
            return KernelInputs([(member, name) for member in kernel.members
                                 for name in dict.fromkeys(reversed(member.operands))
                                 if name not in members
                                 and not _is_immediate(self.comp[name])])
        per_member = [(member, self._parts(member.operands)) for member in kernel.members]
        shared = max((part for _, parts in per_member for part in parts), key=len,
                     default=())
        names, _ = self.shared_reads(shared) if len(shared) >= _SHARED_SOURCES else \
            (frozenset(), 0.0)
        if not names or not members.isdisjoint(names):
            shared, names = (), frozenset()
        named = [(member, name) for member, parts in per_member
                 for name in _ordered_union([p for p in parts if p is not shared])
                 if name not in members and name not in names]
        return KernelInputs(named, shared)

    def shared_reads(self, shared: tuple[str, ...]) -> tuple[frozenset[str], float]:
        """A shared sources tuple's names as a set, and the bytes reading them costs."""
        key = id(shared)
        if key not in self._shared:
            self._shared[key] = (frozenset(shared),
                                 float(sum(leaf_bytes(self.comp[n].shape) for n in shared)))
        return self._shared[key]


#: Sources of a recomputed producer from which a kernel's reads list them once for
#: all kernels (:meth:`KernelPlan.kernel_inputs`); below it they are listed per kernel.
_SHARED_SOURCES = 32


@dataclass(frozen=True)
class KernelInputs:
    """What a kernel reads: (member, value) pairs, and ``shared``, sources of a
    recomputed producer read whole that other kernels read too (none of them in the
    pairs)."""

    named: list[tuple[Instruction, str]]
    shared: tuple[str, ...] = ()


def runs_in_a_kernel(inst: Instruction) -> bool:
    """Whether ``inst``'s work is done by a kernel (one of its own, or one it is fused
    into): pointer ops launch nothing, control flow runs its callees' kernels. Where
    fusion is not emulated (a module XLA fused already) each such instruction is a
    kernel of its own."""
    return inst.opcode not in POINTER_OPCODES and inst.opcode not in CONTROL_FLOW_OPCODES


def is_prefused(module: Module) -> bool:
    return any(inst.opcode == "fusion" for comp in module.computations
               for inst in comp.instructions)


@dataclass
class KernelPlans:
    """:func:`plan_kernels` of a module's computations (not edited while this is used),
    each planned once per setting: the step's time and its memory read the same plan
    wherever the profile's fusion settings are the defaults the memory model uses, and
    in a module XLA fused already, where the settings change nothing (every instruction
    that runs in a kernel is one of its own)."""

    _plans: dict[tuple[str, bool, bool, int, bool], KernelPlan] = field(default_factory=dict)

    def plan(self, comp: Computation, emulate_fusion: bool = True, multi_output: bool = True,
             concatenate_operands: int = 0, row_major_reductions: bool = False) -> KernelPlan:
        """:func:`plan_kernels` (read it, do not edit it)."""
        key = ((comp.name, True, multi_output, concatenate_operands, row_major_reductions)
               if emulate_fusion else (comp.name, False, True, 0, False))
        found = self._plans.get(key)
        if found is None:
            found = self._plans[key] = plan_kernels(comp, *key[1:])
        return found


def plan_kernels(comp: Computation, emulate_fusion: bool = True,
                 multi_output: bool = True, concatenate_operands: int = 0,
                 row_major_reductions: bool = False) -> KernelPlan:
    """``multi_output``: whether the backend fuses one producer into several kernels'
    loop, or computes a value that is also needed in memory inside its reader's kernel
    (XLA GPU/TPU multi-output fusion). XLA CPU does neither: such a producer is a kernel
    of its own whose output the readers load again. ``concatenate_operands``: the most
    operands of a concatenate that takes its producers in (0: any number).
    ``row_major_reductions``: a reduce of an operand laid out other than row-major takes
    no producers in; its operand is a kernel of its own (XLA CPU's transposing copy)."""
    users = users_map(comp)
    order = topological_order(comp)
    kernel_of: dict[str, Kernel] = {}
    duplicated: set[str] = set()
    relabels: set[str] = set()
    kernels: list[Kernel] = []

    merged: set[int] = set()  # ids of kernels merged into another (dropped at the end)
    # Per duplicated value: whether the root reads it, and the instructions that read it
    # from a kernel of their own (each once, in first-found order), looking through the
    # duplicated values that read it. Users come first in reverse order, so each value's
    # readers are built from its users' once: no walk per path.
    reached: dict[str, _Readers] = {}

    def new_kernel(inst: Instruction) -> None:
        kernel = Kernel(len(kernels), [inst])
        kernels.append(kernel)
        kernel_of[inst.name] = kernel

    fused = _Merges(kernel_of)

    def readers_of(name: str) -> _Readers:
        if name != comp.root_name and duplicated.isdisjoint(users[name]):
            return _Readers(False, tuple(users[name]))  # each user once already
        parts = [reached[user] if user in duplicated else _Readers(False, (user,))
                 for user in users[name]]
        if name == comp.root_name:
            parts.append(_Readers(True, ()))
        return _Readers.union(parts)

    merges = 0  # multi-output merges so far: a kernel found before one may be stale
    #: id of a readers record → (the record, ``merges`` then, what it reads into): one
    #: record is shared along a chain of duplicated producers (a global norm's scalar
    #: adds, read by every update kernel), so each link finds its readers' kernels once.
    summaries: dict[int, tuple[_Readers, int, _Consumers]] = {}

    takes: dict[int, bool] = {}  # id of a kernel → whether it takes producers in

    def consumers(found: _Readers) -> _Consumers:
        """The kernels that read the value (looking through duplicated producers), each
        once, and whether a reader needs it in memory (a tuple, a control-flow op, the
        root, a kernel that does not take producers in)."""
        cached = summaries.get(id(found))
        if cached is not None and cached[0] is found and cached[1] == merges:
            return cached[2]
        in_memory = found.root
        targets: dict[int, Kernel] = {}
        for user in found.users:
            kernel = fused.kernel_at(user)
            # Only fusion kernels take producers in: a dot or a collective reads memory.
            if kernel is not None and id(kernel) not in takes:
                # What opened the kernel decides (a merge keeps the first kernel's).
                takes[id(kernel)] = _takes_producers(comp, kernel.members[0],
                                                     concatenate_operands, row_major_reductions)
            if kernel and takes[id(kernel)]:
                targets.setdefault(id(kernel), kernel)
            else:
                in_memory = True
        summary = _Consumers(in_memory, list(targets.values()))
        summaries[id(found)] = (found, merges, summary)
        return summary

    for inst in reversed(order):
        if not runs_in_a_kernel(inst):
            continue
        if not emulate_fusion:
            new_kernel(inst)
            continue
        found = readers_of(inst.name)
        readers = consumers(found)
        # A value also needed in memory (read by a tuple, a loop, the root) can still be
        # computed inside its kernel readers' fusion, as an extra output.
        fusible = inst.opcode in FUSIBLE_OPCODES and bool(readers.targets)
        if (is_relabel(comp, inst) or _absorbed_transpose(comp, inst, users)
                or _reshape_of_absorbed_transpose(comp, inst, users)
                or _cancelled_transpose(comp, inst, users)):
            duplicated.add(inst.name)  # a bitcast of its operand's buffer: no kernel
            relabels.add(inst.name)
            reached[inst.name] = found
            continue
        if (fusible and not readers.in_memory and inst.opcode not in _KERNEL_ROOTS
                and (_is_cheap(comp, inst) or not multi_output and len(readers.targets) > 1
                     and reorders_elements(comp, inst))):
            duplicated.add(inst.name)
            reached[inst.name] = found
            continue
        targets = readers.targets
        joins = fusible and inst.opcode not in _KERNEL_ROOTS and (
            (len(targets) == 1 or all(_is_loop_kernel(k, inst) for k in targets))
            if multi_output else (len(targets) == 1 and not readers.in_memory))
        if joins:
            kernel = targets[0]
            for other in targets[1:]:  # multi-output fusion of the readers
                fused.absorb(kernel, other)
                merged.add(id(other))
                merges += 1
            kernel.members.append(inst)
            kernel_of[inst.name] = kernel
        else:
            new_kernel(inst)
    kernels = [k for k in kernels if id(k) not in merged]
    kernel_of = {member.name: kernel for kernel in kernels for member in kernel.members}
    position = {inst.name: i for i, inst in enumerate(order)}
    for kernel in kernels:
        kernel.members.sort(key=lambda m: position[m.name])
    kernels.sort(key=lambda k: position[k.members[-1].name])
    for index, kernel in enumerate(kernels):
        kernel.index = index
    plan = KernelPlan(comp, kernels, kernel_of, set(), duplicated, relabels,
                      _sources(comp, order, duplicated))
    _account(plan, users)
    return plan


class _Merges:
    """Kernels merged by multi-output fusion as :func:`plan_kernels` goes: ``kernel_of``
    is not rewritten for every member of a merged kernel (quadratic where one kernel
    absorbs a chain's), its entries lead to the merged one here (and are shortened as
    they are followed)."""

    def __init__(self, kernel_of: dict[str, Kernel]) -> None:
        self.kernel_of = kernel_of
        #: id of a kernel merged into another → that one.
        self.absorbed: dict[int, Kernel] = {}

    def kernel_at(self, name: str) -> Kernel | None:
        kernel = self.kernel_of.get(name)
        if kernel is None or id(kernel) not in self.absorbed:
            return kernel
        passed = []
        while id(kernel) in self.absorbed:
            passed.append(id(kernel))
            kernel = self.absorbed[id(kernel)]
        for merged in passed:  # (each chain followed once: path compression)
            self.absorbed[merged] = kernel
        self.kernel_of[name] = kernel
        return kernel

    def absorb(self, kernel: Kernel, other: Kernel) -> None:
        """``other``'s members into ``kernel``, the longer list taking the shorter
        (``kernel``'s opener, which decides what it takes in, stays its first)."""
        if len(other.members) > len(kernel.members):
            opener, at = kernel.members[0], len(other.members)
            other.members.extend(kernel.members)
            other.members[0], other.members[at] = opener, other.members[0]
            kernel.members, other.members = other.members, []
        else:
            kernel.members.extend(other.members)
        self.absorbed[id(other)] = kernel


@dataclass(frozen=True)
class _Consumers:
    """The kernels that read a value and take it in, each once, and whether some
    reader needs it in memory instead."""

    in_memory: bool
    targets: list[Kernel]


@dataclass(frozen=True)
class _Readers:
    """Who reads a value, looking through the duplicated producers between: whether
    the root does, and the other readers (instructions that are not duplicated)."""

    root: bool
    users: tuple[str, ...]

    @staticmethod
    def union(parts: list[_Readers]) -> _Readers:
        """All of ``parts``' readers, each once, in order (a chain's links, a ladder's
        two rungs, share one record: see :func:`_ordered_union`)."""
        if parts and all(part is parts[0] for part in parts):
            return parts[0]
        return _Readers(any(part.root for part in parts),
                        _ordered_union([part.users for part in parts]))


def _ordered_union(parts: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The names of ``parts`` in order, each once. A single non-empty part (or several
    that are the same tuple) comes back as it is, not copied: along a chain of
    duplicated scalars every link shares its neighbour's tuple, so building them all
    costs the chain's length, not its length times the tuple's."""
    filled = [part for part in parts if part]
    if not filled:
        return ()
    if all(part is filled[0] for part in filled):
        return filled[0]
    return tuple(dict.fromkeys(name for part in filled for name in part))


@dataclass(frozen=True, eq=False)
class _Union:
    """The sources of a duplicated value recomputed from several others' (a link of a
    chain of scalar adds), not listed until a kernel reads it: listing every link's
    would cost the chain's length squared (a global norm's sum over gradients)."""

    parts: tuple[Sources, ...]

    def names(self) -> tuple[str, ...]:
        """The names, each once, in the order :func:`_ordered_union` of the parts'
        lists gives: a depth-first walk that skips a union it has listed already
        (everything in it was found the first time)."""
        found: dict[str, None] = {}
        seen: set[int] = set()
        stack: list[Iterator[Sources | str]] = [iter(self.parts)]
        while stack:
            item = next(stack[-1], None)
            if item is None:
                stack.pop()
            elif isinstance(item, str):
                found.setdefault(item)
            elif isinstance(item, tuple):
                found.update(dict.fromkeys(item))
            elif id(item) not in seen:
                seen.add(id(item))
                stack.append(iter(item.parts))
        return tuple(found)


#: Names, or a union of others' not yet listed.
Sources = tuple[str, ...] | _Union

#: A union of at most this many names is listed when it is made.
_LISTED_UNION = 32


def _sources(comp: Computation, order: list[Instruction], duplicated: set[str]
             ) -> dict[str, Sources]:
    """Duplicated value → the values that are not duplicated it is recomputed from, in
    the order a depth-first walk from it finds them (last operand first). Built in
    def-before-use order from the operands' own, so each value is looked at once; a
    value with a single part shares it (along a chain of duplicated scalars every link
    has its neighbour's), a large union of several is kept as its parts."""
    sources: dict[str, Sources] = {}
    alone: dict[str, tuple[str, ...]] = {}  # one tuple per value: unions see it is shared
    for inst in order:
        if inst.name not in duplicated:
            continue
        parts = [part for part in
                 (sources[name] if name in duplicated else
                  () if _is_immediate(comp[name]) else alone.setdefault(name, (name,))
                  for name in reversed(inst.operands)) if part]
        if not parts:
            sources[inst.name] = ()
        elif all(part is parts[0] for part in parts):
            sources[inst.name] = parts[0]
        elif len(listed := [p for p in parts if isinstance(p, tuple)]) == len(parts) \
                and sum(map(len, listed)) <= _LISTED_UNION:
            sources[inst.name] = _ordered_union(listed)
        else:
            sources[inst.name] = _Union(tuple(parts))
    return sources


def _is_immediate(inst: Instruction) -> bool:
    """A scalar constant: compiled into the code of the kernels that use it (a
    schedule's boundaries), never read from memory."""
    return inst.opcode == "constant" and leaf_bytes(inst.shape) <= 8


def _takes_producers(comp: Computation, root: Instruction, concatenate_operands: int,
                     row_major_reductions: bool) -> bool:
    """Whether the kernel ``root`` opened fuses its operands' producers into its loop. A
    concatenate of many operands does not on XLA:CPU (``cpu_instruction_fusion.cc``,
    ``kMaxConcatenateArguments`` = 8: its fused loop would select among them per
    element); it copies them from memory, each producer a kernel of its own. Nor, with
    ``row_major_reductions``, does a reduce of an operand in another layout: XLA:CPU
    computes the operand into a transposing copy, which the reduce then reads."""
    if root.opcode not in FUSIBLE_OPCODES:
        return False
    if row_major_reductions and root.opcode == "reduce" and not _row_major(comp[root.operands[0]]):
        return False
    return not (root.opcode == "concatenate" and concatenate_operands
                and len(root.operands) > concatenate_operands)


def _row_major(inst: Instruction) -> bool:
    """An array laid out row-major, looking past dimensions of size 1 (a layout that
    only moves those leaves the bytes in row-major order)."""
    shape = inst.shape
    if not isinstance(shape, ArrayShape):
        return True
    order = [d for d in shape.minor_to_major() if shape.dims[d] > 1]
    return order == sorted(order, reverse=True)


def is_relabel(comp: Computation, inst: Instruction) -> bool:
    """A reshape or copy that leaves the bytes in place (same physical order): outside a
    fusion XLA turns it into a bitcast or removes it (the SPMD partitioner's copies of
    every parameter and output are of this kind)."""
    if inst.opcode not in _RESHAPES_AND_COPIES:
        return False
    operand = comp[inst.operands[0]].shape
    if not isinstance(operand, ArrayShape) or not isinstance(inst.shape, ArrayShape):
        return False
    if inst.opcode == "copy":
        return operand.minor_to_major() == inst.shape.minor_to_major()
    return operand.is_row_major and inst.shape.is_row_major


def _absorbed_transpose(comp: Computation, inst: Instruction,
                        users: dict[str, list[str]]) -> bool:
    """A transpose of a dot or convolution result read only by it: XLA's layout
    assignment makes the producer write the transposed layout, and the transpose a
    bitcast (a gradient is typically computed transposed to its weight)."""
    if inst.opcode != "transpose":
        return False
    operand = inst.operands[0]
    return comp[operand].opcode in MATMULS and users[operand] == [inst.name]


def _cancelled_transpose(comp: Computation, inst: Instruction,
                         users: dict[str, list[str]]) -> bool:
    """One of two transposes in a row that undo each other, the first read only by the
    second: XLA's algebraic simplifier removes both (a reduce-scatter's block turned
    back into the gradient's order, then into the weight's)."""
    if inst.opcode != "transpose":
        return False
    operand = comp[inst.operands[0]]
    if operand.opcode == "transpose" and users[operand.name] == [inst.name]:
        return _undo(operand, inst)
    readers = users[inst.name]
    return len(readers) == 1 and comp[readers[0]].opcode == "transpose" and \
        _undo(inst, comp[readers[0]])


def _undo(first: Instruction, second: Instruction) -> bool:
    """``second`` transposes ``first``'s result back into ``first``'s operand's order."""
    inner = first.attr_as("dimensions", tuple) or ()
    outer = second.attr_as("dimensions", tuple) or ()
    return len(inner) == len(outer) and all(inner[d] == k for k, d in enumerate(outer))


def _reshape_of_absorbed_transpose(comp: Computation, inst: Instruction,
                                   users: dict[str, list[str]]) -> bool:
    """A reshape of such a transpose (a sharded module flattening a gradient that XLA
    computes transposed): the dot is computed with its operands swapped, writing the
    transposed result in row-major order, so the reshape is a bitcast too (XLA:CPU's
    optimized 1024² Adam MLP: ``bitcast(dot)`` feeds the gradient bucket)."""
    if inst.opcode != "reshape" or not isinstance(inst.shape, ArrayShape):
        return False
    operand = comp[inst.operands[0]]
    return (_absorbed_transpose(comp, operand, users) and users[operand.name] == [inst.name]
            and inst.shape.is_row_major)


def _is_loop_kernel(kernel: Kernel, producer: Instruction) -> bool:
    """A kernel the producer can share with its other readers (XLA's multi-output
    fusion): an elementwise loop over as many elements as the producer writes."""
    root = kernel.members[0]  # the instruction that opened the kernel
    return (root.opcode in FUSIBLE_OPCODES and root.opcode not in _KERNEL_ROOTS
            and elements(root.shape) == elements(producer.shape))


def reorders_elements(comp: Computation, inst: Instruction) -> bool:
    """A transpose that moves elements: its permutation reorders dimensions longer than
    1. A module before XLA's layout assignment is read by its dimensions only (XLA lays
    out the values on both sides row-major, whatever layouts the text shows), so a
    transpose the text lays out as a bitcast still moves its elements."""
    if inst.opcode != "transpose" or not isinstance(inst.shape, ArrayShape):
        return False
    operand = comp[inst.operands[0]].shape
    permutation = inst.attr_as("dimensions", tuple) or ()
    if not isinstance(operand, ArrayShape) or len(permutation) != operand.rank:
        return False
    moved = [d for d in permutation if operand.dims[d] > 1]
    return moved != sorted(moved)


def _is_cheap(comp: Computation, inst: Instruction) -> bool:
    """Producers XLA duplicates into each consumer: scalar arithmetic, iota, and
    broadcasts that read less than they write."""
    if inst.opcode == "iota" or leaf_bytes(inst.shape) <= 8:
        return True
    if inst.opcode == "broadcast":
        operand = comp[inst.operands[0]]
        return leaf_bytes(operand.shape) < leaf_bytes(inst.shape)
    return False


def _account(plan: KernelPlan, users: dict[str, list[str]]) -> None:
    """Fill each kernel's read and write bytes, and the plan's materialised values."""
    comp = plan.comp
    within = _read_within(plan, users)
    for kernel in plan.kernels:
        member_names = {m.name for m in kernel.members}
        found = plan.kernel_inputs(kernel)
        reads: dict[str, float] = {}
        for member, operand in found.named:
            reads[operand] = max(reads.get(operand, 0.0),
                                 _read_size(comp, member, comp[operand], plan.relabels))
        # A shared source is read whole, whatever else reads it (a slice or an in-place
        # update of one is never seen through a recomputed producer of many sources).
        kernel.read_bytes = sum(reads.values()) + plan.shared_reads(found.shared)[1] \
            if found.shared else sum(reads.values())
        reordered: dict[str, set[str]] = {}  # member → what it reads in transposed order
        for member, _ in found.named:
            if member.name not in reordered:
                reordered[member.name] = _reordered_reads(plan, member)
        kernel.reordered_read_bytes = sum(reads[name] for name in {
            operand for member, operand in found.named if operand in reordered[member.name]})
        for member in kernel.members:
            if member.name == comp.root_name or any(
                    user not in member_names and within.get(user) != id(kernel)
                    for user in users[member.name]):
                plan.materialized.add(member.name)
                kernel.write_bytes += _write_size(comp, member)


def _read_within(plan: KernelPlan, users: dict[str, list[str]]) -> dict[str, int | None]:
    """Per value recomputed where it is read (:attr:`KernelPlan.duplicated`: a bitcast, a
    cheap producer): the id of the one kernel all its readers are in, looking through
    such values, else None. A member read only through one (the reshape between a
    gradient and the bucket its kernel concatenates) is no value in memory: the kernel
    computes it where it reads it, as XLA fuses the bitcast in."""
    within: dict[str, int | None] = {}
    for inst in reversed(topological_order(plan.comp)):
        if inst.name not in plan.duplicated:
            continue
        kernels: set[int | None] = set()
        for user in users[inst.name]:
            kernel = plan.kernel_of.get(user)
            kernels.add(within[user] if user in plan.duplicated else
                        id(kernel) if kernel is not None else None)
            if len(kernels) > 1:
                break
        within[inst.name] = kernels.pop() if len(kernels) == 1 and \
            inst.name != plan.comp.root_name else None
    return within


def _reordered_reads(plan: KernelPlan, member: Instruction) -> set[str]:
    """The values ``member`` reads through a transpose that moves their elements (its
    own, or one recomputed in its kernel: :attr:`KernelPlan.duplicated`, not a bitcast),
    as the kernel's reads name them (through the producers it recomputes)."""
    comp = plan.comp
    transposes = [member] if reorders_elements(comp, member) else [
        comp[operand] for operand in member.operands
        if operand in plan.duplicated and operand not in plan.relabels
        and reorders_elements(comp, comp[operand])]
    return {name for transpose in transposes for part in plan._parts(transpose.operands[:1])
            for name in part}


def _read_size(comp: Computation, reader: Instruction, value: Instruction,
               relabels: set[str]) -> float:
    """A slice reads only its window, also of a value it sees through bitcasts (a
    bucket's piece sliced out of the reshaped all-gather result); an in-place update
    does not read its target."""
    if reader.opcode in _WINDOW_READS and \
            _through_relabels(comp, reader.operands[0], relabels) == value.name:
        return leaf_bytes(reader.shape)
    if reader.opcode == "dynamic-update-slice" and reader.operands[0] == value.name:
        return 0.0
    return leaf_bytes(value.shape)


def _through_relabels(comp: Computation, name: str, relabels: set[str]) -> str:
    """The value whose buffer ``name`` is (following bitcast-like reshapes and copies)."""
    while name in relabels:
        name = comp[name].operands[0]
    return name


def _write_size(comp: Computation, inst: Instruction) -> float:
    if inst.opcode == "dynamic-update-slice":
        return leaf_bytes(comp[inst.operands[1]].shape)
    return leaf_bytes(inst.shape)
