"""Peak memory per device: buffer liveness over the module's schedule.

The schedule is the entry computation's order when the module ``is_scheduled``, else a
topological order. Only values that reach memory get buffers — for an unfused module
those are the outputs of the kernels :mod:`hlo_shard.analysis.kernels` emulates —
and each buffer lives from the kernel that writes it to the last kernel that reads it.
Like XLA's buffer assignment:

* parameters are live for the whole step (the caller owns them); constants live in
  read-only data and are not counted;
* get-tuple-element, tuple, bitcast and a reshape outside a fusion alias their operand;
* an elementwise kernel, a dynamic-update-slice and a while loop write into an operand
  buffer that dies there (in place) instead of allocating a new one;
* ``input_output_alias`` makes an output share its parameter's buffer (a donated
  argument), and an output that is an undonated parameter is a copy;
* a while, call or conditional adds the peak of its callee's own temporaries.

``xla_equivalent_bytes`` is what ``CompiledMemoryStats`` adds up (argument + output +
temp − alias): XLA allocates outputs and temporaries separately, so it is at least the
true high-water mark that ``peak_bytes`` reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hlo_shard.analysis.cost import ELEMENTWISE_OPCODES, POINTER_BYTES, leaf_bytes
from hlo_shard.analysis.kernels import (
    CONTROL_FLOW_OPCODES, POINTER_OPCODES, KernelPlan, is_prefused, plan_kernels,
)
from hlo_shard.graph import topological_order
from hlo_shard.ir import Computation, Instruction, Module, TupleShape

#: Ops whose result aliases (a part of) their operand's buffers.
_ALIASING_OPCODES = frozenset({"get-tuple-element", "tuple", "bitcast", "reshape"})

#: Ops that may write their result into an operand buffer that dies at them.
_IN_PLACE_OPCODES = ELEMENTWISE_OPCODES | frozenset({"dynamic-update-slice", "while"})

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
        self.owners: dict[str, tuple[str, ...]] = {}
        self.buffers: dict[str, Buffer] = {}

    # -- buffers --------------------------------------------------------------------
    def _define(self) -> None:
        outputs = set(self._root_owners_names())
        for inst in self.order:
            if inst.opcode == "parameter":
                if self.nested:
                    self.owners[inst.name] = ()
                    continue
                kind = self.kinds.get(inst.name, "other_parameters")
                self.buffers[inst.name] = Buffer(inst.name, leaf_bytes(inst.shape), kind)
                self.owners[inst.name] = (inst.name,)
            elif inst.opcode == "constant":
                self.owners[inst.name] = ()
            elif inst.opcode in _ALIASING_OPCODES and (
                    inst.opcode != "reshape" or inst.name in self.plan.duplicated):
                self.owners[inst.name] = tuple(dict.fromkeys(
                    o for operand in inst.operands for o in self.owners.get(operand, ())))
            elif inst.name in self.plan.materialized or inst.opcode in CONTROL_FLOW_OPCODES:
                category = ("gradients" if inst.name in self.gradients
                            else "outputs" if inst.name in outputs else "temporaries")
                self.buffers[inst.name] = Buffer(inst.name, leaf_bytes(inst.shape), category)
                self.owners[inst.name] = (inst.name,)
            else:
                self.owners[inst.name] = ()

    def _root_owners_names(self) -> list[str]:
        """Names reachable from the root through tuples (the output values)."""
        names: list[str] = []
        stack = [self.comp.root_name]
        while stack:
            name = stack.pop()
            inst = self.comp[name]
            if inst.opcode in ("tuple", "bitcast", "reshape", "get-tuple-element"):
                stack.extend(inst.operands)
            names.append(name)
        return names

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
            if name in self.plan.duplicated:
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
                for owner in self.owners.get(name, ()):
                    last_use[owner] = max(last_use.get(owner, -1), self.position[inst.name])
        output_owners = self.owners.get(self.comp.root_name, ())
        for owner in output_owners:
            last_use[owner] = end
        argument_bytes = sum(b.size for b in self.buffers.values()
                             if self.comp[b.owner].opcode == "parameter")
        aliases = output_parameter_aliases(self.module) if not self.nested else {}
        output_bytes, alias_bytes, copied = self._output_accounting(aliases)

        live: dict[str, Buffer] = {b.owner: b for b in self.buffers.values()
                                   if self.comp[b.owner].opcode == "parameter"}
        dies_at: dict[int, list[str]] = {}
        for owner, pos in last_use.items():
            dies_at.setdefault(pos, []).append(owner)
        for owner, buffer in self.buffers.items():  # defined, never read: dies at once
            if owner not in last_use and self.comp[owner].opcode != "parameter":
                dies_at.setdefault(self.position[owner], []).append(owner)
        peak, peak_at, peak_live = self._total(live), "(start)", dict(live)
        temp_peak = 0
        curve: list[tuple[int, str, int]] = []
        for inst in self.order:
            pos = self.position[inst.name]
            transient = self._callee_peak(inst)
            buffer = self.buffers.get(inst.name) if inst.opcode != "parameter" else None
            dying = [live[o] for o in dies_at.get(pos, ()) if o in live
                     and self.comp[o].opcode != "parameter"]
            shared = 0
            if buffer is not None:
                if inst.opcode in _IN_PLACE_OPCODES:
                    shared = min(buffer.size, sum(b.size for b in dying))
                live[inst.name] = buffer
            level = self._total(live) + transient - shared
            if level > peak:
                peak, peak_at, peak_live = level, inst.name, dict(live)
            temp_peak = max(temp_peak, self._temps(live) + transient - shared)
            for owner in dies_at.get(pos, ()):
                if owner in live and self.comp[owner].opcode != "parameter":
                    del live[owner]
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

    def _output_accounting(self, aliases: dict[int, int]) -> tuple[int, int, int]:
        """(output bytes, aliased bytes, bytes of outputs that copy an undonated parameter)."""
        root = self.comp.root
        params = {p.parameter_number: p for p in self.comp.parameters()}
        leaves = (list(zip(root.operands, root.shape.elements))
                  if root.opcode == "tuple" and isinstance(root.shape, TupleShape)
                  else [(root.name, root.shape)])
        output = sum(leaf_bytes(shape) for _, shape in leaves)
        if isinstance(root.shape, TupleShape):
            output += POINTER_BYTES * len(root.shape.elements)
        alias = sum(leaf_bytes(leaves[i][1]) for i, p in aliases.items()
                    if i < len(leaves) and p in params)
        copied = sum(leaf_bytes(shape) for i, (name, shape) in enumerate(leaves)
                     if i not in aliases and self.comp[name].opcode in ("parameter", "constant"))
        return output, alias, copied

    def _callee_peak(self, inst: Instruction) -> int:
        if inst.opcode not in CONTROL_FLOW_OPCODES:
            return 0
        peaks = []
        for name in inst.called_computations():
            if inst.opcode == "while" and name == getattr(inst.attr("condition"), "name", None):
                continue
            callee = self.module.computation(name)
            nested = _Liveness(self.module, callee, {}, self.gradients, self.emulate, nested=True)
            peaks.append(nested.run().peak_bytes)
        peak = max(peaks, default=0)
        # A loop body writes its results into the carry buffers the while owns.
        return max(0, peak - leaf_bytes(inst.shape)) if inst.opcode == "while" else peak

    @staticmethod
    def _total(live: dict[str, Buffer]) -> int:
        return sum(b.size for b in live.values())

    def _temps(self, live: dict[str, Buffer]) -> int:
        return sum(b.size for b in live.values() if b.category in ("temporaries", "gradients"))
