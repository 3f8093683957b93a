"""Peak memory per device: buffer liveness over the module's schedule.

The schedule is the entry computation's order when the module ``is_scheduled``, else a
topological order. Only values that reach memory get buffers — for an unfused module
those are the outputs of the kernels :mod:`hlo_shard.analysis.kernels` emulates —
and each buffer lives from the kernel that writes it to the last kernel that reads it.
Like XLA's buffer assignment:

* parameters are live for the whole step (the caller owns them); constants live in
  read-only data and are not counted;
* get-tuple-element, tuple, bitcast, and a reshape or copy that leaves the bytes in
  place outside a fusion, alias their operand;
* an elementwise kernel, a dynamic-update-slice and a while loop write into an operand
  buffer that dies there (in place) instead of allocating a new one;
* ``input_output_alias`` makes an output share its parameter's buffer (a donated
  argument), and an output that is an undonated parameter is a copy;
* a while, call or conditional adds what its callee allocates on top of the buffers
  it is passed (a loop body's new carry values and temporaries).

``xla_equivalent_bytes`` is what ``CompiledMemoryStats`` adds up (argument + output +
temp − alias): XLA allocates outputs and temporaries separately, so it is at least the
true high-water mark that ``peak_bytes`` reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hlo_shard.analysis.cost import ELEMENTWISE_OPCODES, POINTER_BYTES, leaf_bytes
from hlo_shard.analysis.kernels import (
    CONTROL_FLOW_OPCODES, POINTER_OPCODES, KernelPlan, is_prefused, is_relabel, plan_kernels,
)
from hlo_shard.graph import topological_order
from hlo_shard.ir import Computation, Instruction, Module, Shape, TupleShape

#: Ops that may write their result into an operand buffer that dies at them (XLA's
#: ``CanShareOperandBufferWithUser``: elementwise loops, fusions of them, in-place
#: updates, loops over their carry).
_IN_PLACE_OPCODES = ELEMENTWISE_OPCODES | frozenset({"dynamic-update-slice", "while", "fusion"})

CATEGORIES = ("weights", "optimizer_state", "batch", "other_parameters", "gradients",
              "temporaries", "outputs")


@dataclass(frozen=True, slots=True)
class Buffer:
    owner: str
    size: int
    category: str


@dataclass
class MemoryProfile:
    """Per-device memory of one step."""

    peak_bytes: int
    #: The instruction after which the peak is reached.
    peak_instruction: str
    #: Live bytes at the peak by category (see :data:`CATEGORIES`).
    peak_breakdown: dict[str, int]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    #: The largest sum of live temporaries (XLA's ``temp`` allocation, unpacked).
    temp_bytes: int
    #: (position, instruction, live bytes) after each scheduled instruction.
    curve: list[tuple[int, str, int]] = field(default_factory=list)

    @property
    def xla_equivalent_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def to_json(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes, "peak_instruction": self.peak_instruction,
            "peak_breakdown": self.peak_breakdown, "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes, "alias_bytes": self.alias_bytes,
            "temp_bytes": self.temp_bytes, "xla_equivalent_bytes": self.xla_equivalent_bytes,
        }


def schedule(module: Module, comp: Computation) -> list[Instruction]:
    """The order instructions run in: as written when the module is scheduled."""
    return list(comp.instructions) if module.is_scheduled else topological_order(comp)


def output_parameter_aliases(module: Module) -> dict[int, int]:
    """``input_output_alias``: top-level output index → parameter number."""
    raw = module.header.get("input_output_alias")
    if raw is None:
        return {}
    text = getattr(raw, "text", str(raw))
    aliases: dict[int, int] = {}
    for out_index, param in re.findall(r"\{\s*(\d*)\s*\}\s*:\s*\(\s*(\d+)", text):
        aliases[int(out_index or 0)] = int(param)
    return aliases


def memory_profile(module: Module, parameter_kinds: dict[str, str] | None = None,
                   gradients: set[str] | None = None) -> MemoryProfile:
    """Liveness of the entry computation. ``parameter_kinds`` maps entry parameter
    names to ``weights``/``optimizer_state``/``batch`` (others: ``other_parameters``);
    ``gradients`` names the values holding gradients (collective inputs and results)."""
    entry = module.entry
    kinds = parameter_kinds or {}
    emulate = not is_prefused(module)
    return _Liveness(module, entry, kinds, gradients or set(), emulate).run()


class _Liveness:
    """Liveness of one computation. Buffers are keyed by the defining instruction's
    name, with ``#i`` for element i of a tuple-shaped value (a loop carry, a tuple
    all-reduce, a multi-output fusion), so that get-tuple-element selects one."""

    def __init__(self, module: Module, comp: Computation, kinds: dict[str, str],
                 gradients: set[str], emulate: bool, nested: bool = False) -> None:
        self.module = module
        self.comp = comp
        self.kinds = kinds
        self.gradients = gradients
        self.emulate = emulate
        self.nested = nested
        self.order = schedule(module, comp)
        self.position = {inst.name: i for i, inst in enumerate(self.order)}
        self.plan: KernelPlan = plan_kernels(comp, emulate)
        #: Value name → the buffers it refers to, per top-level element of its shape.
        self.elements: dict[str, list[tuple[str, ...]]] = {}
        self.buffers: dict[str, Buffer] = {}
        #: Buffer key → name of the instruction that defines it.
        self.definer: dict[str, str] = {}

    def owners(self, name: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for element in self.elements.get(name, []) for k in element))

    # -- buffers --------------------------------------------------------------------
    def _allocate(self, inst: Instruction, category: str) -> None:
        shape = inst.shape
        parts = (list(enumerate(shape.elements)) if isinstance(shape, TupleShape)
                 else [(None, shape)])
        self.elements[inst.name] = []
        for index, part in parts:
            key = inst.name if index is None else f"{inst.name}#{index}"
            self.buffers[key] = Buffer(key, leaf_bytes(part), category)
            self.definer[key] = inst.name
            self.elements[inst.name].append((key,))

    def _define(self) -> None:
        for inst in self.order:
            if inst.opcode == "parameter":
                # A callee's parameters are its caller's buffers (a loop's carry).
                self._allocate(inst, "temporaries" if self.nested else self.kinds.get(
                    inst.name, "other_parameters"))
            elif inst.opcode == "get-tuple-element":
                source = self.elements.get(inst.operands[0], [])
                index = int(inst.attr("index"))
                self.elements[inst.name] = ([source[index]] if index < len(source)
                                            else [self.owners(inst.operands[0])])
            elif inst.opcode == "tuple":
                self.elements[inst.name] = [self.owners(o) for o in inst.operands]
            elif inst.opcode == "bitcast" or (
                    inst.name in self.plan.duplicated and is_relabel(self.comp, inst)):
                self.elements[inst.name] = list(self.elements.get(inst.operands[0], []))
            elif inst.name in self.plan.materialized or inst.opcode in CONTROL_FLOW_OPCODES:
                self._allocate(inst, "gradients" if inst.name in self.gradients
                               else "temporaries")
            else:
                self.elements[inst.name] = []  # constants, fused and recomputed values
        for key in self.owners(self.comp.root_name):
            buffer = self.buffers[key]
            if buffer.category == "temporaries" and not self._is_parameter(key):
                self.buffers[key] = Buffer(key, buffer.size, "outputs")

    def _is_parameter(self, key: str) -> bool:
        return self.comp[self.definer[key]].opcode == "parameter"

    # -- uses -----------------------------------------------------------------------
    def _reads(self, inst: Instruction) -> list[str]:
        """Values an executing unit reads (kernel inputs seen through fused producers)."""
        kernel = self.plan.kernel_of.get(inst.name)
        if kernel is None:
            return list(inst.operands)
        if kernel.members[-1] is not inst:
            return []
        members = {m.name for m in kernel.members}
        reads: list[str] = []
        stack = [o for m in kernel.members for o in m.operands]
        seen: set[str] = set()
        while stack:
            name = stack.pop()
            if name in members or name in seen:
                continue
            seen.add(name)
            if name in self.plan.duplicated and not self.elements.get(name):
                stack.extend(self.comp[name].operands)  # recomputed inside this kernel
            else:
                reads.append(name)
        return reads

    def run(self) -> MemoryProfile:
        self._define()
        end = len(self.order)
        last_use: dict[str, int] = {}
        for inst in self.order:
            if inst.opcode in POINTER_OPCODES:
                continue
            for name in self._reads(inst):
                for key in self.owners(name):
                    last_use[key] = max(last_use.get(key, -1), self.position[inst.name])
        for key in self.owners(self.comp.root_name):
            last_use[key] = end
        argument_bytes = sum(b.size for k, b in self.buffers.items() if self._is_parameter(k))
        aliases = output_parameter_aliases(self.module) if not self.nested else {}
        output_bytes, alias_bytes, copied = self._output_accounting(aliases)
        self._donate(aliases)

        live = {k: b for k, b in self.buffers.items() if self._is_parameter(k)}
        dies_at: dict[int, list[str]] = {}
        for key, pos in last_use.items():
            dies_at.setdefault(pos, []).append(key)
        for key in self.buffers:  # defined, never read: dies at once
            if key not in last_use and not self._persistent(key):
                dies_at.setdefault(self.position[self.definer[key]], []).append(key)
        peak, peak_at, peak_live = self._total(live), "(start)", dict(live)
        temp_peak = 0
        curve: list[tuple[int, str, int]] = []
        for inst in self.order:
            pos = self.position[inst.name]
            transient = self._callee_peak(inst)
            written = self._written(inst)
            dying = [live[k] for k in dies_at.get(pos, ()) if k in live
                     and not self._persistent(k)]
            shared = self._in_place_bytes(inst, written, dying)
            for buffer in written:
                live[buffer.owner] = buffer
            level = self._total(live) + transient - shared
            if level > peak:
                peak, peak_at, peak_live = level, inst.name, dict(live)
            temp_peak = max(temp_peak, self._temps(live) + transient - shared)
            for key in dies_at.get(pos, ()):
                if key in live and not self._persistent(key):
                    del live[key]
            curve.append((pos, inst.name, self._total(live)))
        if copied:
            level = self._total(live) + copied
            if level > peak:
                peak, peak_at, peak_live = level, self.comp.root_name, dict(live)
        breakdown = {c: 0 for c in CATEGORIES}
        for b in peak_live.values():
            breakdown[b.category] += b.size
        breakdown["outputs"] += copied if peak_at == self.comp.root_name else 0
        return MemoryProfile(peak, peak_at, breakdown, argument_bytes, output_bytes,
                             alias_bytes, temp_peak, curve)

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
        return [k for element in self.elements.get(name, []) for k in element
                if self.definer.get(k) == name]

    def _in_place_bytes(self, inst: Instruction, written: list[Buffer],
                        dying: list[Buffer]) -> int:
        """Bytes of new buffers that reuse an input dying here, buffer for buffer of the
        same size, when the kernel is an elementwise loop (or an in-place op)."""
        kernel = self.plan.kernel_of.get(inst.name)
        members = kernel.members if kernel else [inst]
        if not written or any(m.opcode == "reduce" for m in members) or \
                not any(m.opcode in _IN_PLACE_OPCODES for m in members):
            return 0
        free = [b.size for b in dying]
        shared = 0
        for buffer in sorted(written, key=lambda b: -b.size):
            if buffer.size in free:
                free.remove(buffer.size)
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

    def _callee_peak(self, inst: Instruction) -> int:
        if inst.opcode not in CONTROL_FLOW_OPCODES:
            return 0
        peaks = []
        for name in inst.called_computations():
            if inst.opcode == "while" and name == getattr(inst.attr("condition"), "name", None):
                continue
            callee = self.module.computation(name)
            nested = _Liveness(self.module, callee, {}, self.gradients, self.emulate, nested=True)
            profile = nested.run()
            # What the callee adds on top of the buffers it was passed.
            peaks.append(profile.peak_bytes - profile.argument_bytes)
        return max(peaks, default=0)

    @staticmethod
    def _total(live: dict[str, Buffer]) -> int:
        return sum(b.size for b in live.values())

    def _temps(self, live: dict[str, Buffer]) -> int:
        return sum(b.size for b in live.values() if b.category in ("temporaries", "gradients"))
