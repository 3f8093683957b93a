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
  collectives, control flow and custom calls are kernels of their own.

A module that already contains ``fusion`` instructions was fused by XLA: each
instruction is then its own kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hlo_shard.costmodel.flops import elements, leaf_bytes
from hlo_shard.graph import topological_order, users_map
from hlo_shard.ir import ArrayShape, Computation, Instruction, Module
from hlo_shard.opinfo import NO_COST, PER_ELEMENT_COST

#: Ops that XLA's loop/input fusion merges with their consumers.
FUSIBLE_OPCODES = PER_ELEMENT_COST | frozenset({
    "broadcast", "reshape", "bitcast", "transpose", "copy", "iota", "constant", "slice",
    "dynamic-slice", "pad", "concatenate", "reverse", "reduce", "dynamic-update-slice",
})


#: Fusible ops whose result never leaves a fusion (a reduce or an in-place update is
#: always the root of its kernel).
_KERNEL_ROOTS = frozenset({"reduce", "dynamic-update-slice"})

#: Ops that launch nothing: they forward pointers (constants live in read-only data).
POINTER_OPCODES = NO_COST | frozenset({"tuple"})

#: Ops whose work is that of the computations they call (priced by the estimator).
CONTROL_FLOW_OPCODES = frozenset({"while", "call", "conditional"})


@dataclass
class Kernel:
    """One launched kernel: its member instructions and the values it reads/writes."""

    index: int
    members: list[Instruction] = field(default_factory=list)
    #: Bytes read from memory (external inputs, sliced reads counted as slices).
    read_bytes: float = 0.0
    #: Bytes written (values used outside the kernel; in-place updates by their update).
    write_bytes: float = 0.0

    @property
    def traffic_bytes(self) -> float:
        return self.read_bytes + self.write_bytes


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
    #: Whether the plan emulates fusion (False for a module XLA already fused).
    emulated: bool
    #: The duplicated values that are their operand's buffer relabelled (bitcasts).
    relabels: set[str] = field(default_factory=set)


def is_prefused(module: Module) -> bool:
    return any(inst.opcode == "fusion" for comp in module.computations
               for inst in comp.instructions)


def plan_kernels(comp: Computation, emulate_fusion: bool = True,
                 multi_output: bool = True, concatenate_operands: int = 0) -> KernelPlan:
    """``multi_output``: whether the backend fuses one producer into several kernels'
    loop, or computes a value that is also needed in memory inside its reader's kernel
    (XLA GPU/TPU multi-output fusion). XLA CPU does neither: such a producer is a kernel
    of its own whose output the readers load again. ``concatenate_operands``: the most
    operands of a concatenate that takes its producers in (0: any number)."""
    users = users_map(comp)
    order = topological_order(comp)
    kernel_of: dict[str, Kernel] = {}
    duplicated: set[str] = set()
    relabels: set[str] = set()
    kernels: list[Kernel] = []

    def new_kernel(inst: Instruction) -> None:
        kernel = Kernel(len(kernels), [inst])
        kernels.append(kernel)
        kernel_of[inst.name] = kernel

    def consumers(name: str) -> list[Kernel | None]:
        """Kernels that read ``name`` (looking through duplicated producers); None for
        a reader that needs it in memory (a tuple, a control-flow op, the root)."""
        found: list[Kernel | None] = [None] if name == comp.root_name else []
        for user in users[name]:
            if user in duplicated:
                found.extend(consumers(user))
                continue
            kernel = kernel_of.get(user)
            # Only fusion kernels take producers in: a dot or a collective reads memory.
            found.append(kernel if kernel and _takes_producers(kernel.members[0],
                                                               concatenate_operands)
                         else None)
        return found

    for inst in reversed(order):
        if inst.opcode in POINTER_OPCODES or inst.opcode in CONTROL_FLOW_OPCODES:
            continue
        readers = consumers(inst.name)
        # A value also needed in memory (read by a tuple, a loop, the root) can still be
        # computed inside its kernel readers' fusion, as an extra output.
        kernel_readers = [k for k in readers if k is not None]
        fusible = emulate_fusion and inst.opcode in FUSIBLE_OPCODES and bool(kernel_readers)
        if emulate_fusion and (is_relabel(comp, inst) or _absorbed_transpose(comp, inst, users)
                               or _reshape_of_absorbed_transpose(comp, inst, users)):
            duplicated.add(inst.name)  # a bitcast of its operand's buffer: no kernel
            relabels.add(inst.name)
            continue
        if (fusible and None not in readers and inst.opcode not in _KERNEL_ROOTS
                and _is_cheap(comp, inst)):
            duplicated.add(inst.name)
            continue
        targets = list({id(k): k for k in kernel_readers}.values())
        joins = fusible and inst.opcode not in _KERNEL_ROOTS and (
            (len(targets) == 1 or all(_is_loop_kernel(k, inst) for k in targets))
            if multi_output else (len(targets) == 1 and None not in readers))
        if joins:
            kernel = targets[0]
            for other in targets[1:]:  # multi-output fusion of the readers
                kernel.members.extend(other.members)
                for member in other.members:
                    kernel_of[member.name] = kernel
                kernels.remove(other)
            kernel.members.append(inst)
            kernel_of[inst.name] = kernel
        else:
            new_kernel(inst)
    position = {inst.name: i for i, inst in enumerate(order)}
    for kernel in kernels:
        kernel.members.sort(key=lambda m: position[m.name])
    kernels.sort(key=lambda k: position[k.members[-1].name])
    for index, kernel in enumerate(kernels):
        kernel.index = index
    materialized = _account(comp, kernels, duplicated, relabels, users)
    return KernelPlan(comp, kernels, kernel_of, materialized, duplicated, emulate_fusion,
                      relabels)


def _takes_producers(root: Instruction, concatenate_operands: int) -> bool:
    """Whether the kernel ``root`` opened fuses its operands' producers into its loop. A
    concatenate of many operands does not on XLA:CPU (``cpu_instruction_fusion.cc``,
    ``kMaxConcatenateArguments`` = 8: its fused loop would select among them per
    element); it copies them from memory, each producer a kernel of its own."""
    if root.opcode not in FUSIBLE_OPCODES:
        return False
    return not (root.opcode == "concatenate" and concatenate_operands
                and len(root.operands) > concatenate_operands)


def is_relabel(comp: Computation, inst: Instruction) -> bool:
    """A reshape or copy that leaves the bytes in place (same physical order): outside a
    fusion XLA turns it into a bitcast or removes it (the SPMD partitioner's copies of
    every parameter and output are of this kind)."""
    if inst.opcode not in ("reshape", "copy"):
        return False
    operand = comp[inst.operands[0]].shape
    if not isinstance(operand, ArrayShape) or not isinstance(inst.shape, ArrayShape):
        return False
    if inst.opcode == "copy":
        return operand.minor_to_major() == inst.shape.minor_to_major()
    row_major = lambda s: s.minor_to_major() == tuple(range(s.rank - 1, -1, -1))  # noqa: E731
    return row_major(operand) and row_major(inst.shape)


def _absorbed_transpose(comp: Computation, inst: Instruction,
                        users: dict[str, list[str]]) -> bool:
    """A transpose of a dot or convolution result read only by it: XLA's layout
    assignment makes the producer write the transposed layout, and the transpose a
    bitcast (a gradient is typically computed transposed to its weight)."""
    if inst.opcode != "transpose":
        return False
    operand = inst.operands[0]
    return comp[operand].opcode in ("dot", "convolution") and users[operand] == [inst.name]


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
            and inst.shape.minor_to_major() == tuple(range(inst.shape.rank - 1, -1, -1)))


def _is_loop_kernel(kernel: Kernel, producer: Instruction) -> bool:
    """A kernel the producer can share with its other readers (XLA's multi-output
    fusion): an elementwise loop over as many elements as the producer writes."""
    root = kernel.members[0]  # the instruction that opened the kernel
    return (root.opcode in FUSIBLE_OPCODES and root.opcode not in _KERNEL_ROOTS
            and elements(root.shape) == elements(producer.shape))


def _is_cheap(comp: Computation, inst: Instruction) -> bool:
    """Producers XLA duplicates into each consumer: scalar arithmetic, iota, and
    broadcasts that read less than they write."""
    if inst.opcode == "iota" or leaf_bytes(inst.shape) <= 8:
        return True
    if inst.opcode == "broadcast":
        operand = comp[inst.operands[0]]
        return leaf_bytes(operand.shape) < leaf_bytes(inst.shape)
    return False


def _account(comp: Computation, kernels: list[Kernel], duplicated: set[str],
             relabels: set[str], users: dict[str, list[str]]) -> set[str]:
    """Fill each kernel's read and write bytes; return the materialised values."""
    materialized: set[str] = set()
    for kernel in kernels:
        member_names = {m.name for m in kernel.members}
        reads: dict[str, float] = {}
        for member in kernel.members:
            for operand in kernel_inputs(comp, member.operands, member_names, duplicated):
                value = comp[operand]
                if value.opcode == "constant" and leaf_bytes(value.shape) <= 8:
                    continue
                reads[operand] = max(reads.get(operand, 0.0),
                                     _read_size(comp, member, value, relabels))
        kernel.read_bytes = sum(reads.values())
        for member in kernel.members:
            outside = [u for u in users[member.name] if u not in member_names]
            if outside or member.name == comp.root_name:
                materialized.add(member.name)
                kernel.write_bytes += _write_size(comp, member)
    return materialized


def kernel_inputs(comp: Computation, operands: Iterable[str], members: set[str],
                  duplicated: set[str]) -> list[str]:
    """The values a kernel reads from memory for ``operands`` of its ``members``:
    outside the kernel, looking through producers it recomputes (duplicated)."""
    found: list[str] = []
    stack = list(operands)
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in members or name in seen:
            continue
        seen.add(name)
        if name in duplicated:
            stack.extend(comp[name].operands)
        else:
            found.append(name)
    return found


def _read_size(comp: Computation, reader: Instruction, value: Instruction,
               relabels: set[str]) -> float:
    """A slice reads only its window, also of a value it sees through bitcasts (a
    bucket's piece sliced out of the reshaped all-gather result); an in-place update
    does not read its target."""
    if reader.opcode in ("slice", "dynamic-slice") and \
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
