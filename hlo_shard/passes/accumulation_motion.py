"""Gradient accumulation: sink the all-reduce of each microbatch's gradient out of the loop.

A step that accumulates gradients over microbatches (a ``lax.scan``, ``fori_loop`` or
while over the microbatches) all-reduces every microbatch's gradient inside the loop body
and only adds it into a carried accumulator; the optimizer reads the accumulator once,
after the loop. The sum is linear, so ``init + Σᵢ all-reduce(gᵢ)`` equals
``init + all-reduce(Σᵢ gᵢ)``: the body can accumulate the local gradient and one
all-reduce after the loop replaces one per microbatch (XLA's
``WhileLoopAllReduceCodeMotion``). The weight-update sharding that runs next then turns
that post-loop all-reduce into a reduce-scatter and a sharded update, which it cannot do
while the gradient is reduced inside the loop.

The accumulator starts the loop at zero and its initial value is added after the
all-reduce, on each device: no replication of the initial value is needed, and a zero
initial value (the usual ``zeros_like``) is not added at all.

What is proven before an all-reduce moves (anything else stays, with a reason code):

* it sums (``to_apply`` an add), over array elements of a numeric type, without
  ``constrain_layout``, and its operand has its result's shape and layout;
* its result (each element's, for the tuple form) reaches an ``add`` with a
  ``get-tuple-element`` of the body's parameter only through ops that commute with a sum
  over devices (:data:`COMMUTING`), each used once; in XLA's fused form the add may be a
  fusion of the two whose fused computation is that add, the sum reaching it through
  such ops too;
* or, a scan over layers, it reaches a ``dynamic-update-slice`` of such a slot (the
  layer's gradient written into the stacked one; fused, a fusion of the two whose fused
  computation is that write) whose start before the loop is zeros: after the loop the
  sum over devices of what the loop wrote is what it wrote of the sums, the rest zeros;
  a fused write may round the sum first (XLA:CPU sums a bf16 gradient in f32 and
  converts it back as it writes it), the rounding then applied to the stacked sums
  after the loop (an elementwise map of each sum, zero to zero);
* that add (or write) is used only by the body's root tuple, at the same slot it reads,
  once;
* the slot is read by nothing else in the body or the condition (the parameter is only
  taken apart by ``get-tuple-element``), so no iteration sees the partial sums;
* the body belongs to this one loop, the loop's initial tuple to this loop, and the loop's
  result is only taken apart by ``get-tuple-element`` (whose users are rewired).

Of a tuple all-reduce (XLA's combiner joins a loss's sum to the gradients' in one), the
elements proven so move and the others stay in the loop as an all-reduce of their own.

This pass always moves what it can prove: the gradient's bytes then cross the network
once per step rather than once per microbatch, and the update after the loop can be
sharded, which an all-reduce left in the loop leaves whole. The alternative that trades
collectives for memory, a reduce-scatter per microbatch into an accumulator carried as
a shard, is chosen after the sharding, on the reduce-scatter it puts after the loop
(:mod:`~hlo_shard.passes.sharded_accumulator`). The speed gate prices the moved module
as the one kept whole.

A sum over devices that starts an accumulator (big_vision's ``accumulate_gradient``
computes the first microbatch's gradient before its loop and carries it in) is added
after the loop instead, the slot starting at zero (:meth:`_Sinking.lift_starts`): the
update after the loop then reads the sum, and the sharding can reduce-scatter it.

A sum the body cuts to this device's block before accumulating it (the partitioner's
FSDP form: the loop carries the block) moves with ``sliced``: the loop then carries the
whole local gradient, so the move is bounded by the device's memory where the profile
knows it. After the loop the pair is the partitioner's reduce-scatter form again, which
:mod:`~hlo_shard.passes.reduce_scatter_creation` and then the sharded accumulator may
turn into a reduce-scatter per microbatch into the block, where priced faster.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar, cast

from hlo_shard.analysis.collectives import (ReasonCode, device_index_values, host_callback,
                                            find_gradient_all_reduces, is_degenerate_sum,
                                            is_sum, started_slots)
from hlo_shard.costmodel.memory import memory_profile
from hlo_shard.graph import (ModuleRewriter, Rewriter, call_counts, scalar_literal,
                             starts_at_zero, users_map)
from hlo_shard.ir import (HALF_FLOAT_TYPES, ArrayShape, Computation, ComputationRef, Instruction,
                          Module, TupleShape, summed_type)
from hlo_shard.opinfo import VIEWS
from hlo_shard.passes.base import ModulePass
from hlo_shard.passes.weight_update import ChannelIds, ShardingReport
from hlo_shard.units import fmt_bytes

#: Element types a summing all-reduce is moved for (numeric: the sum is exact in
#: integers and a reordering of the same sum in floats).
SUMMABLE = frozenset({"bf16", "f16", "f32", "f64", "s8", "s16", "s32", "s64",
                      "u8", "u16", "u32", "u64"})


#: Where the followed value is among an op's operands (its index), and the op.
Rule = Callable[[Module, Computation, Instruction, int], bool]


def _relabel(module: Module, comp: Computation, inst: Instruction, position: int) -> bool:
    return position == 0


def _is_degenerate_sum(module: Module, comp: Computation, inst: Instruction,
                       position: int) -> bool:
    return position == 0 and is_degenerate_sum(module, comp, inst)


def _scaled_by_constant(module: Module, comp: Computation, inst: Instruction,
                        position: int) -> bool:
    """``x * c`` or ``c * x`` with ``c`` a finite non-zero scalar constant (or its
    broadcast): the same factor on every device and every iteration."""
    other = inst.operands[1 - position] if len(inst.operands) == 2 else None
    return other is not None and other != inst.operands[position] \
        and bool(scalar_literal(comp, comp[other]))


def _divided_by_constant(module: Module, comp: Computation, inst: Instruction,
                         position: int) -> bool:
    """``x / c`` in a floating type (an integer quotient truncates: not linear), ``c`` as
    for :func:`_scaled_by_constant` (jax's mean over microbatches)."""
    shape = inst.shape
    return position == 0 and isinstance(shape, ArrayShape) \
        and shape.element_type.startswith(("f", "bf")) \
        and _scaled_by_constant(module, comp, inst, position)


#: Ops that only relabel an all-reduced value's elements (:data:`~hlo_shard.opinfo.VIEWS`,
#: and a sum over dimensions of size 1): applied before or after the sum over devices,
#: the same sum of the same numbers in the same order.
RELABELLING: dict[str, Rule] = {
    **{op: _relabel for op in VIEWS},
    "reduce": _is_degenerate_sum,
}

#: Ops an all-reduced value may pass through on its way to the accumulation: each is
#: linear and the same map on every device and every iteration, so applying it before
#: or after the sum over devices and iterations gives the same value (up to the order
#: of the sum: a scaling rounds the terms, not the total). A ``convert`` is not one: the
#: sum would be rounded in another type.
COMMUTING: dict[str, Rule] = {
    **RELABELLING,
    "multiply": _scaled_by_constant,
    "divide": _divided_by_constant,
}


#: Ops a fused write may round its sum with on the way to the slot (XLA's CPU backend
#: sums a 16-bit gradient in f32 and converts it back: see :func:`_writes_into_operand`),
#: and the floating types they may round through.
ROUNDING = frozenset({"convert"})
ROUNDED_TYPES = frozenset({"bf16", "f16", "f32", "f64"})


#: Why an all-reduce in a loop body stays there (reason code → what ``--explain`` says).
REASONS: dict[str, str] = {
    "not-summing": "it does not sum numeric arrays",
    "constrain-layout": "constrain_layout=true",
    "layout-change": "its operand has another shape or layout than its result",
    "not-accumulated": "its result is not only added into a carried slot",
    "converted": "its result is converted to another type before it is accumulated (moved, "
                 "the sum would be rounded in another type)",
    "narrow-sum": "it is added into an accumulator of a 16-bit type, which rounds after "
                  "every add (moved, each device's local values would be rounded as they are "
                  "accumulated, before the sum over the devices: other numbers at that "
                  "type's grain, not a reordering of the same sum)",
    "narrow-write": "it is written into a bf16 slot, and the backend sums bf16 in f32 "
                    "(XLA:CPU: the sum in the loop reads each device's value unrounded; "
                    "moved, the slot would round it before the sum, other numbers at bf16's "
                    "grain)",
    "widened-write": "it is written into a 16-bit slot that its fusion widens to write it and "
                     "narrows back (moved, the loop would carry the local value in the "
                     "slot's narrower type)",
    "sliced": "its sum is cut to a slice by a dynamic-slice before it is accumulated (the "
              "partitioner's FSDP/ZeRO form) and the accumulator mode 'sharded' keeps the "
              "loop carrying the slice (moved out, it would carry the whole gradient)",
    "sliced-memory": "its sum is cut to a slice by a dynamic-slice before it is accumulated "
                     "(the partitioner's FSDP/ZeRO form); moved out, the loop would carry "
                     "the whole gradient and the modelled peak would exceed the device's "
                     "memory (the profile's device_memory_bytes; the accumulator mode "
                     "'whole' moves it anyway)",
    "sliced-form": "its sum is cut to a slice other than by one dynamic-slice at the "
                   "device's own offsets read only by the accumulation (or it is an element "
                   "of a tuple all-reduce)",
    "fused": "its result is read by a fusion (XLA's fused form) other than one that only "
             "adds it into the accumulator or writes it into a carried slot, which the "
             "motion does not look into",
    "written-beside-added": "it is written into a carried slot (a per-iteration output: a "
                            "loss, a metric) by a loop that adds other sums into "
                            "accumulators: it stays, so that what is reduced after the "
                            "loop is accumulators only",
    "written-sliced": "it is written into a carried slot the loop's users read only as "
                      "this device's slice (the partitioner's reduce-scatter form across a "
                      "scan): it stays, for the reduce-scatter creation to make it a "
                      "reduce-scatter in the loop, the loop carrying the device's block",
    "written-start": "it is written into a carried slot (a scan's stacked gradient) that "
                     "does not start the loop at zero (moved, what the loop leaves of the "
                     "start would be summed over the devices)",
    "accumulator-read": "the accumulator is read elsewhere in the loop",
    "slot-not-carried": "the accumulation does not flow to its own slot of the body's result",
    "shared-body": "the body is called by more than one instruction",
    "shared-init": "the loop's initial tuple is not a tuple used by this loop alone",
    "result-whole": "the loop's result is used other than by get-tuple-element",
}


@dataclass(frozen=True)
class MovedAllReduce:
    """An all-reduce sunk out of ``loop`` (a while in ``computation``): its slots."""

    computation: str
    loop: str
    all_reduce: str
    slots: tuple[int, ...]
    #: The all-reduce now after the loop ("" when nothing reads the sums after it).
    after: str
    #: The last instruction added after the loop (the next move's insertion point).
    last: str
    #: The slots that carry the whole gradient now instead of its slice (the sum was cut
    #: to this device's block before it was accumulated), with their bytes before and
    #: after.
    widened: tuple[tuple[int, int, int], ...] = ()
    #: The loop's body, where ``all_reduce`` was, for an array all-reduce ("" for a
    #: tuple one: the elements moved are indexed otherwise after the loop).
    body: str = ""

    @property
    def origin(self) -> tuple[str, str] | None:
        """(body, all-reduce) that ``after`` stands for, where an array all-reduce moved
        (None: a tuple one, or nothing reads the sum after the loop)."""
        return (self.body, self.all_reduce) if self.body and self.after else None


@dataclass(frozen=True)
class KeptAllReduce:
    """An all-reduce left in the body of ``loop`` (a while in ``computation``), and why
    (a :data:`REASONS` code)."""

    computation: str
    loop: str
    all_reduce: str
    reason: str
    #: The tuple all-reduce this one was split from, whose other elements moved ("":
    #: none was).
    part_of: str = ""
    #: The loop's body, where ``all_reduce`` is.
    body: str = ""


@dataclass(frozen=True)
class LiftedStart:
    """A sum over devices that started accumulator ``slot`` of ``loop`` (a while in
    ``computation``): the loop starts the slot at zero now, and the sum is added to what
    the loop leaves (``after``)."""

    computation: str
    loop: str
    all_reduce: str
    slot: int
    after: str


@dataclass(frozen=True)
class AccumulationReport:
    moved: list[MovedAllReduce] = field(default_factory=list)
    kept: list[KeptAllReduce] = field(default_factory=list)
    lifted: list[LiftedStart] = field(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """What ``--explain`` says: each loop's moved all-reduces, and the kept ones."""
        by_loop: dict[tuple[str, str], list[MovedAllReduce]] = defaultdict(list)
        for move in self.moved:
            by_loop[move.computation, move.loop].append(move)
        notes = [f"{comp}/while %{loop}: {len(moves)} accumulated all-reduce(s) moved after "
                 f"the loop ({', '.join('%' + m.all_reduce for m in moves)}; slots "
                 f"{', '.join(str(s) for m in moves for s in m.slots)}): one collective "
                 f"per step instead of one per iteration{_widened_words(moves)}"
                 for (comp, loop), moves in by_loop.items()]
        notes += [f"{k.computation}/while %{k.loop}: all-reduce %{k.all_reduce} stays in "
                  f"the loop{_split_words(k)} ({REASONS[k.reason]})" for k in self.kept]
        starts: dict[tuple[str, str], list[LiftedStart]] = defaultdict(list)
        for lift in self.lifted:
            starts[lift.computation, lift.loop].append(lift)
        notes += [f"{comp}/while %{loop}: {len(lifts)} accumulator(s) started from a sum "
                  f"over devices ({', '.join(f'%{s.all_reduce} in slot {s.slot}' for s in lifts)})"
                  f" start at zero and the sum is added after the loop instead: the update "
                  f"reads it there" for (comp, loop), lifts in starts.items()]
        return notes

    def annotate(self, report: ShardingReport) -> None:
        """Say why on the rows of ``report`` whose all-reduce stayed in its loop: the
        planner, which finds no update in the body, would call it ``no_update_work``,
        where the update after the loop reads the sum this pass could not move there."""
        kept = {(k.body, k.all_reduce): k for k in self.kept}
        for row in report.explanations:
            found = kept.get((row.computation, row.all_reduce))
            if found is not None and row.reason_code == ReasonCode.NO_UPDATE_WORK.value:
                row.reason_code = ReasonCode.KEPT_IN_LOOP.value
                row.reason = (f"summed in every iteration of while %{found.loop}, where the "
                              f"accumulation motion keeps it: {REASONS[found.reason]}")


def _split_words(kept: KeptAllReduce) -> str:
    return f", the elements of %{kept.part_of} that did not move" if kept.part_of else ""


def _widened_words(moves: list[MovedAllReduce]) -> str:
    widened = [w for move in moves for w in move.widened]
    if not widened:
        return ""
    before = sum(b for _, b, _ in widened)
    after = sum(a for _, _, a in widened)
    return (f"; slot(s) {', '.join(str(slot) for slot, _, _ in widened)} now carry the whole "
            f"gradient, not this device's slice of it ({fmt_bytes(after)} instead of "
            f"{fmt_bytes(before)})")


@dataclass(frozen=True)
class _Rounding:
    """The converts a fusion writing a sum into its slot applies to it first (XLA's CPU
    backend sums a 16-bit gradient in f32 and rounds it back: ``convert`` to bf16 and
    to f32 again), by name in the fused computation, and their element types."""

    fusion: str
    converts: tuple[str, ...]
    element_types: tuple[str, ...]


@dataclass(frozen=True)
class _Element:
    """One array of an all-reduce (the whole of an array all-reduce, one element of the
    tuple form): the local value, the body's name for its reduced value, its slot, and
    the dynamic-slice that cuts the sum to this device's block before it is accumulated
    with the relabels after it (none where the whole sum is)."""

    local: str
    reduced: str
    slot: int
    cut: tuple[str, ...] = ()
    #: Written into the slot (``dynamic-update-slice``, a scan's stacked gradient) rather
    #: than added: the slot starts at zero, nothing to add after the loop.
    written: bool = False
    #: A fused write that rounds the sum before writing it (:func:`_writes_into_operand`):
    #: the writing fusion and the element types of its converts, in order; they are
    #: applied to the sums after the loop instead.
    rounded: _Rounding | None = None


class Refusal(Exception):
    """Why a loop or an all-reduce is left alone: a :data:`REASONS` code."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class AccumulationMotion(ModulePass[AccumulationReport]):
    """Move the all-reduces of accumulated gradients out of while loops. ``sliced``: also
    those whose sum is cut to this device's block before it is accumulated (the
    partitioner's FSDP form): the loop then carries the whole local gradient instead of
    the block, N times its bytes, and the all-reduce and the slice run once, after the
    loop (otherwise they stay, reason ``sliced``). ``memory_bytes``: the device's
    memory, which such a move may not make the modelled peak exceed (reason
    ``sliced-memory``); 0: not known, no bound. ``upcast``: the backend sums 16-bit floats
    in f32 (the profile's ``upcasts_16bit_floats``), so a bf16 sum written into a slot
    stays (reason ``narrow-write``: :func:`~hlo_shard.ir.summed_type`)."""

    name: ClassVar[str] = "accumulation-motion"
    sliced: bool = False
    memory_bytes: int = 0
    upcast: bool = False

    def apply(self, module: Module, rewriter: ModuleRewriter) -> AccumulationReport:
        if host_callback(module):  # (its collectives stay where they are)
            return AccumulationReport()
        sinking = _Sinking(module, rewriter, ChannelIds(module),
                           _MemoryBudget(module, self.memory_bytes), self.sliced,
                           self.upcast)
        # A moved all-reduce lands in the loop's computation, which may itself be an
        # outer loop's body: sweep again until nothing moves (at most the nesting depth).
        while sinking.sweep():
            pass
        sinking.lift_starts()
        # a later sweep sees the loops it left alone again: one entry per all-reduce,
        # the latest (what the moves left it), still naming the tuple it was split from
        kept: dict[tuple[str, str, str], KeptAllReduce] = {}
        for k in sinking.kept:
            key = k.computation, k.loop, k.all_reduce
            split_from = kept[key].part_of if key in kept else ""
            kept[key] = replace(k, part_of=k.part_of or split_from)
        for move in sinking.moved:
            kept.pop((move.computation, move.loop, move.all_reduce), None)
        return AccumulationReport(sinking.moved, list(kept.values()), sinking.lifted)


@dataclass
class _Sinking:
    module: Module
    edits: ModuleRewriter
    channels: ChannelIds
    budget: _MemoryBudget
    sliced: bool = False
    upcast: bool = False
    moved: list[MovedAllReduce] = field(default_factory=list)
    kept: list[KeptAllReduce] = field(default_factory=list)
    lifted: list[LiftedStart] = field(default_factory=list)
    #: The bodies of loops a sum added into an accumulator moved out of (in any sweep).
    adding_bodies: set[str] = field(default_factory=set)
    #: (computation, all-reduce) of the sums already sharded where they are (read only
    #: as this device's slice, across a loop too), found at the first write asked about.
    _scattered: set[tuple[str, str]] | None = None

    def scatters(self, body: Computation, all_reduce: Instruction) -> bool:
        """``all_reduce`` (in the loop ``body``) is the partitioner's reduce-scatter form
        across a scan (its sum written into a slot the loop's users read only as this
        device's slice): the reduce-scatter creation makes it a reduce-scatter in the
        loop, the loop carrying the device's block, where moving it out would sum the
        whole stacked gradient after the loop."""
        if self._scattered is None:
            self._scattered = {(found.computation, found.name)
                               for found in find_gradient_all_reduces(self.module)
                               if found.code is ReasonCode.ALREADY_SHARDED}
        return (body.name, all_reduce.name) in self._scattered

    def sweep(self) -> bool:
        """One pass over every loop of the module; whether anything moved."""
        computations = {c.name: c for c in self.module.computations}
        loops = [(comp, inst) for comp in computations.values() for inst in comp.instructions
                 if inst.opcode == "while"]
        if not loops:
            return False
        callers = call_counts(self.module)
        moved = False
        for comp, loop in loops:
            body = computations[loop.required_attr("body", ComputationRef).name]
            condition = computations[loop.required_attr("condition", ComputationRef).name]
            moved |= self.sink(comp, loop, body, condition, callers[body.name])
        return moved

    def lift_starts(self) -> None:
        """Start at zero the accumulators a loop starts from a sum over devices (big_vision's
        ``accumulate_gradient`` computes the first microbatch's gradient before its
        ``fori_loop`` and carries it in), and add the sum to what the loop leaves:
        ``s + Σᵢ xᵢ`` is ``(Σᵢ xᵢ) + s`` whatever the ``xᵢ``, provided nothing but the
        accumulation reads the slot. The sum then feeds the update after the loop, which
        the sharding can reduce-scatter; the loop itself is as it was."""
        callers = call_counts(self.module)
        for comp in self.module.computations:
            for loop in [i for i in comp.instructions if i.opcode == "while"]:
                body = self.module.computation(loop.called("body"))
                condition = self.module.computation(loop.called("condition"))
                outer = self.edits.rewriter(comp)
                starts = _summed_starts(self.module, outer, loop)
                if not starts:
                    continue
                try:
                    check_loop(outer, loop, callers[body.name])
                except Refusal:
                    continue
                inner = self.edits.rewriter(body)
                reads = slots_read(inner), slots_read(self.edits.rewriter(condition))
                anchor = loop.name
                for slot, summed in starts.items():
                    if _accumulates(self.module, inner, reads, slot):
                        lift = _lift(outer, loop, slot, summed, anchor)
                        if lift is not None:
                            self.lifted.append(lift)
                            anchor = lift.after

    def sink(self, comp: Computation, loop: Instruction, body: Computation,
             condition: Computation, body_callers: int) -> bool:
        candidates = [i for i in body.instructions if i.opcode == "all-reduce"]
        if not candidates:
            return False
        outer, inner = self.edits.rewriter(comp), self.edits.rewriter(body)
        try:
            check_loop(outer, loop, body_callers)
        except Refusal as why:
            self.kept.extend(KeptAllReduce(comp.name, loop.name, c.name, why.reason,
                                           body=body.name) for c in candidates)
            return False
        reads = slots_read(inner), slots_read(self.edits.rewriter(condition))

        @functools.cache
        def from_device() -> frozenset[str]:  # one walk of the body, where a slice is met
            return frozenset().union(*device_index_values(body))

        init = comp[loop.operands[0]]

        def zero_start(slot: int) -> bool:
            return starts_at_zero(self.module, comp, comp[init.operands[slot]])

        def accumulation(candidate: Instruction, writes: bool
                         ) -> tuple[list[_Element], dict[int, str]]:
            elements, staying = _accumulation(self.module, inner, reads, candidate,
                                              from_device, zero_start, writes, self.sliced,
                                              self.upcast)
            if any(e.written for e in elements) and self.scatters(body, candidate):
                raise Refusal("written-sliced")
            return elements, staying

        # A loop that adds sums into accumulators (microbatches) and writes others into
        # slots (its per-iteration losses, metrics) keeps the written ones, in this sweep
        # and the next: what is reduced after the loop is then accumulators only, which
        # the sharded accumulator may carry as shards. A loop that only writes (a scan
        # over layers' backward, each layer's gradient into the stacked one) moves them.
        kinds: set[bool] = set()
        for candidate in candidates:
            try:
                kinds.update(e.written for e in accumulation(candidate, True)[0])
            except Refusal:
                continue
        writes = kinds != {True, False} and body.name not in self.adding_bodies

        claimed: set[int] = set()
        plans: list[tuple[Instruction, list[_Element], dict[int, str]]] = []
        for candidate in candidates:
            try:
                elements, staying = accumulation(candidate, writes)
                slots = {e.slot for e in elements}
                if len(slots) < len(elements) or slots & claimed:
                    raise Refusal("slot-not-carried")
                self.budget.spend(sum(_widening_bytes(inner.comp, e) for e in elements))
            except Refusal as why:
                self.kept.append(KeptAllReduce(comp.name, loop.name, candidate.name,
                                               why.reason, body=body.name))
                continue
            claimed |= slots
            plans.append((candidate, elements, staying))
            if not all(e.written for e in elements):
                self.adding_bodies.add(body.name)
        anchor = loop.name
        loop_edits = _LoopEdits(outer, inner, self.edits.rewriter(condition), loop, self.edits)
        for candidate, elements, staying in plans:
            if candidate.name not in inner.comp or \
                    any(e.local not in inner.comp for e in elements):
                # An earlier move or split of this sweep took what it reads (a sum of a
                # sum, XLA's combiner having put both in tuples): planned again next sweep.
                continue
            if staying:
                kept = _split(inner, candidate, staying)
                self.kept.append(KeptAllReduce(comp.name, loop.name, kept,
                                               next(iter(staying.values())), candidate.name,
                                               body.name))
            move = _move(self.module, loop_edits, anchor, candidate, elements,
                         self.channels)
            self.moved.append(move)
            anchor = move.last
        loop_edits.remove_dead()
        return bool(plans)


@dataclass
class _MemoryBudget:
    """The bytes the moves of sliced sums may add to the module's modelled peak (its
    :func:`~hlo_shard.costmodel.memory.memory_profile`, priced once, at the first such
    move) before it exceeds ``limit``; 0: no limit."""

    module: Module
    limit: int
    added: int = 0
    peak: int | None = None

    def spend(self, extra: int) -> None:
        """Count ``extra`` bytes carried, or refuse them (``sliced-memory``)."""
        if not extra or not self.limit:
            return
        if self.peak is None:
            self.peak = memory_profile(self.module).peak_bytes
        if self.peak + self.added + extra > self.limit:
            raise Refusal("sliced-memory")
        self.added += extra


def _widening_bytes(body: Computation, element: _Element) -> int:
    """What moving ``element`` adds to its loop's carry: its whole gradient less the
    slice carried now (0 for a sum accumulated whole)."""
    if not element.cut:
        return 0
    whole = body[body[element.cut[0]].operands[0]].shape
    carried = body[element.cut[-1]].shape
    assert isinstance(whole, ArrayShape) and isinstance(carried, ArrayShape)
    return whole.byte_size - carried.byte_size


def loops_all_reduce(module: Module) -> bool:
    """Whether some while body all-reduces, or some loop starts a slot from a sum over
    devices (anything for this pass to look at)."""
    bodies = {ref.name for comp in module.computations for inst in comp.instructions
              if inst.opcode == "while"
              and isinstance(ref := inst.attr("body"), ComputationRef)}
    if any(inst.opcode == "all-reduce" for comp in module.computations
           if comp.name in bodies for inst in comp.instructions):
        return True
    for comp in module.computations:
        loops = [inst for inst in comp.instructions if inst.opcode == "while"]
        if loops:
            read = users_map(comp).__getitem__
            if any(started_slots(module, comp, loop, read) for loop in loops):
                return True
    return False


def _summed_starts(module: Module, outer: Rewriter, loop: Instruction) -> dict[int, str]:
    """The slots of ``loop``'s initial tuple a sum over devices starts
    (:func:`~hlo_shard.analysis.collectives.started_slots`), of a numeric type and free
    to move: slot → the all-reduce."""
    comp = outer.comp
    init = comp[loop.operands[0]]

    def read(name: str) -> list[str]:
        return [u.name for u in outer.users(name)]

    def movable(slot: int, all_reduce: str) -> bool:
        shape = comp[init.operands[slot]].shape
        return isinstance(shape, ArrayShape) and not shape.dynamic and \
            shape.element_type in SUMMABLE and not comp[all_reduce].attr("constrain_layout")

    return {slot: all_reduce
            for slot, (all_reduce, _) in started_slots(module, comp, loop, read).items()
            if movable(slot, all_reduce)}


def _accumulates(module: Module, body: Rewriter, reads: tuple[SlotReads, SlotReads],
                 slot: int) -> bool:
    """The body's result at ``slot`` is its read of the slot plus something else (an
    ``add``, or a fusion of the two whose fused computation is that add), and nothing
    else reads the slot, in the body or the condition."""
    in_body, in_condition = reads
    if in_body is None or in_condition is None or in_body.get(slot, 0) != 1 or \
            in_condition.get(slot, 0):
        return False
    comp = body.comp
    root = comp.root
    if root.opcode != "tuple" or slot >= len(root.operands):
        return False
    total = comp[root.operands[slot]]
    if [u.name for u in body.users(total.name)] != [root.name] or \
            root.operands.count(total.name) != 1 or len(total.operands) != 2:
        return False
    buffers = [o for o in total.operands if comp[o].opcode == "get-tuple-element"
               and comp[comp[o].operands[0]].opcode == "parameter"
               and comp[o].int_attr("index") == slot]
    if len(buffers) != 1 or total.operands.count(buffers[0]) != 1 or \
            total.shape != comp[buffers[0]].shape:
        return False
    if total.opcode == "add":
        return True
    return total.opcode == "fusion" and _adds_into_operand(
        module, total, total.operands[1 - total.operands.index(buffers[0])])


def _lift(outer: Rewriter, loop: Instruction, slot: int, summed: str, anchor: str
          ) -> LiftedStart | None:
    """Start ``slot`` of ``loop`` at zero and add its start to what the loop leaves there,
    after ``anchor`` (None where nothing reads the slot after the loop: left as it is)."""
    comp = outer.comp
    readers = [u.name for u in outer.users(loop.name) if u.int_attr("index") == slot]
    if not readers:
        return None
    init = comp[loop.operands[0]]
    start = init.operands[slot]
    shape = _slot_shape(loop, slot)
    with outer.inserting_before(init.name):
        outer.set_operand(init, slot, _zeros(outer, shape))
    with outer.inserting_after(anchor):
        accumulated = outer.add("get-tuple-element", shape, [loop.name], index=slot,
                                name=f"accumulated_{slot}").name
        total = outer.add("add", shape, [start, accumulated]).name
    for old in readers:
        outer.replace_all_uses_with(old, total)
        outer.erase(old)
    return LiftedStart(comp.name, loop.name, summed, slot, total)


def check_loop(outer: Rewriter, loop: Instruction, body_callers: int) -> None:
    """What must hold of the loop itself for any of its all-reduces to move."""
    if body_callers != 1:
        raise Refusal("shared-body")
    init = outer.comp[loop.operands[0]]
    if init.opcode != "tuple" or [u.name for u in outer.users(init.name)] != [loop.name]:
        raise Refusal("shared-init")
    if loop.name == outer.comp.root_name or any(
            u.opcode != "get-tuple-element" for u in outer.users(loop.name)):
        raise Refusal("result-whole")


#: Slot of a computation's tuple parameter → how many uses read it; None: the parameter
#: is used whole (every slot is read).
SlotReads = dict[int, int] | None


def slots_read(rw: Rewriter) -> SlotReads:
    reads: dict[int, int] = defaultdict(int)
    for param in rw.comp.parameters():
        for user in rw.users(param.name):
            if user.opcode != "get-tuple-element":
                return None
            reads[user.required_attr("index", int)] += len(rw.users(user.name))
    return reads


def _accumulation(module: Module, body: Rewriter, reads: tuple[SlotReads, SlotReads],
                  all_reduce: Instruction, from_device: Callable[[], frozenset[str]],
                  zero_start: Callable[[int], bool], writes: bool, sliced: bool = False,
                  upcast: bool = False) -> tuple[list[_Element], dict[int, str]]:
    """The elements of ``all_reduce`` that move and the slot each accumulates into, and
    those of a tuple all-reduce that stay (element index → reason code; XLA's combiner
    puts a loss's sum in the same tuple as the gradients), or the reason none can move
    (raised). ``reads``: the body's and the condition's slot reads; ``from_device``: the
    body's values computed from the device's id and constants
    (:func:`~hlo_shard.analysis.collectives.device_index_values`); ``zero_start``:
    whether a slot starts the loop at zero; ``writes``: a sum written into a slot moves
    too; ``sliced``: a sum cut to this device's block before it is accumulated moves
    too."""
    shapes = all_reduce.shape.elements if isinstance(all_reduce.shape, TupleShape) \
        else (all_reduce.shape,)
    if not is_sum(module, all_reduce) or any(
            not isinstance(s, ArrayShape) or s.dynamic or s.element_type not in SUMMABLE
            for s in shapes):
        raise Refusal("not-summing")
    if all_reduce.attr("constrain_layout"):
        raise Refusal("constrain-layout")
    if len(all_reduce.operands) != len(shapes) or any(
            body.comp[o].shape != s for o, s in zip(all_reduce.operands, shapes)):
        raise Refusal("layout-change")
    reduced = _tuple_elements(body, all_reduce) if isinstance(all_reduce.shape, TupleShape) \
        else [all_reduce.name]
    in_body, in_condition = reads
    elements = []
    staying: dict[int, str] = {}
    for index, (operand, value) in enumerate(zip(all_reduce.operands, reduced)):
        try:
            slot, cut, written, rounded = _accumulated_slot(module, body, value, from_device,
                                                            sliced)
            if cut and isinstance(all_reduce.shape, TupleShape):
                raise Refusal("sliced-form")
            if written and not writes:
                raise Refusal("written-beside-added")
            if written and not zero_start(slot):
                raise Refusal("written-start")
            # A 16-bit accumulator is added into locally, per device, once its sum leaves
            # the loop: rounded at every add, at a grain the other order shows. A written
            # slot is not added into, but where the backend sums the type in f32 (XLA:CPU's
            # bf16), the sum in the loop reads each device's value unrounded, which the
            # slot would round first.
            element_type = cast(ArrayShape, shapes[index]).element_type
            if element_type in HALF_FLOAT_TYPES and not written:
                raise Refusal("narrow-sum")
            if written and summed_type(element_type, upcast) != element_type:
                raise Refusal("narrow-write")
            # the add's own read, and nothing else (in the condition: nothing at all)
            if in_body is None or in_condition is None or in_body.get(slot, 0) != 1 \
                    or in_condition.get(slot, 0):
                raise Refusal("accumulator-read")
        except Refusal as why:
            if not isinstance(all_reduce.shape, TupleShape):
                raise
            staying[index] = why.reason
            continue
        elements.append(_Element(operand, value, slot, cut, written, rounded))
    if not elements:
        raise Refusal(next(iter(staying.values())))
    return elements, staying


def _split(body: Rewriter, all_reduce: Instruction, staying: dict[int, str]) -> str:
    """The elements ``staying`` of a tuple all-reduce taken by an all-reduce of their
    own, before it (the same groups and channel: the rest leaves the loop with a fresh
    one); its name. Their get-tuple-elements read it instead."""
    shapes = cast(TupleShape, all_reduce.shape).elements
    indices = sorted(staying)
    # (one element: an array all-reduce, as XLA's shape inference has it)
    shape = shapes[indices[0]] if len(indices) == 1 else \
        TupleShape(tuple(shapes[i] for i in indices))
    with body.inserting_before(all_reduce.name):
        kept = body.add("all-reduce", shape, [all_reduce.operands[i] for i in indices],
                        name=all_reduce.name, **dict(all_reduce.attributes))
    for user in list(body.users(all_reduce.name)):
        index = user.required_attr("index", int)
        if index not in staying:
            continue
        if len(indices) == 1:
            body.replace_all_uses_with(user.name, kept.name)
            body.erase(user.name)
        else:
            body.set_operand(user, 0, kept.name)
            body.set_attr(user, "index", indices.index(index))
    return kept.name


def _tuple_elements(body: Rewriter, all_reduce: Instruction) -> list[str]:
    """The one get-tuple-element of each element of a tuple all-reduce."""
    by_index: dict[int, list[str]] = defaultdict(list)
    for user in body.users(all_reduce.name):
        if user.opcode != "get-tuple-element":
            raise Refusal("not-accumulated")
        by_index[user.required_attr("index", int)].append(user.name)
    count = len(all_reduce.operands)
    if sorted(by_index) != list(range(count)) or any(len(v) != 1 for v in by_index.values()):
        raise Refusal("not-accumulated")
    return [by_index[i][0] for i in range(count)]


def _accumulated_slot(module: Module, body: Rewriter, value: str,
                      from_device: Callable[[], frozenset[str]], sliced: bool = False
                      ) -> tuple[int, tuple[str, ...], bool, _Rounding | None]:
    """Follow ``value`` through :data:`COMMUTING` ops to ``add(gte(param, k), ·)`` — or
    to ``dynamic-update-slice(gte(param, k), ·, offsets)``, a scan writing its
    iteration's sum into the stacked slot — whose only use is slot ``k`` of the body's
    root tuple: ``k``, (``sliced``) the dynamic-slice between, at offsets computed from
    the device's id alone, with the relabels after it (none: the whole sum is
    accumulated), whether the slot is written rather than added into, and the rounding
    a fused write applies first (:func:`_writes_into_operand`)."""
    comp = body.comp
    while True:
        following = body.users(value)
        if len(following) != 1:
            raise Refusal("not-accumulated")
        user = following[0]
        rule = COMMUTING.get(user.opcode)
        if rule is None or not rule(module, comp, user, user.operands.index(value)):
            break
        value = user.name
    if user.opcode == "convert":
        raise Refusal("converted")
    cut: tuple[str, ...] = ()
    if user.opcode == "dynamic-slice" and user.operands[0] == value:
        offsets = user.operands[1:]
        if value in offsets or not from_device().issuperset(offsets):
            raise Refusal("sliced-form")
        steps = [user.name]
        while True:  # relabels of the slice (the partitioner's transpose back) go along
            readers = body.users(steps[-1])
            if len(readers) != 1:
                raise Refusal("sliced-form")
            user = readers[0]
            if user.opcode not in RELABELLING or len(user.operands) != 1:
                break
            steps.append(user.name)
        value = steps[-1]
        cut = tuple(steps)
    # (a fused add or write is taken as the add or write where it takes the whole sum: a
    # widened slot would need its fused computation widened too)
    written = False
    rounded = None
    if user.opcode == "fusion":
        if cut:
            raise Refusal("fused")
        buffer_name, written, rounded = _fused_accumulation(module, user, value)
    elif user.operands.count(value) != 1:
        raise Refusal("not-accumulated")
    elif user.opcode == "add":
        buffer_name = user.operands[1 - user.operands.index(value)]
    elif user.opcode == "dynamic-update-slice" and user.operands[1] == value and not cut:
        buffer_name, written = user.operands[0], True
    else:
        raise Refusal("not-accumulated")
    buffer = comp[buffer_name]
    if buffer.opcode != "get-tuple-element" or comp[buffer.operands[0]].opcode != "parameter":
        raise Refusal("not-accumulated")
    slot = buffer.required_attr("index", int)
    root = comp.root
    if [u.name for u in body.users(user.name)] != [root.name] or root.opcode != "tuple" \
            or root.operands.count(user.name) != 1 or root.operands.index(user.name) != slot \
            or user.shape != buffer.shape:
        raise Refusal("slot-not-carried")
    if cut and not sliced:
        raise Refusal("sliced")
    return slot, cut, written, rounded


def _fused_accumulation(module: Module, fusion: Instruction, value: str
                        ) -> tuple[str, bool, _Rounding | None]:
    """The operand ``fusion`` adds ``value`` into or writes it into (XLA's fused form of
    the accumulation), whether it writes, and the rounding of a write
    (:func:`_writes_into_operand`); why not (raised) otherwise."""
    if _adds_into_operand(module, fusion, value):
        return fusion.operands[1 - fusion.operands.index(value)], False, None
    if (write := _writes_into_operand(module, fusion, value)) is not None:
        position, rounded = write
        return fusion.operands[position], True, rounded
    raise Refusal("widened-write" if _widens_to_write(module, fusion) else "fused")


def _adds_into_operand(module: Module, fusion: Instruction, value: str) -> bool:
    """``fusion`` (XLA's fused form of the accumulation) is ``other + f(value)`` of its
    two operands, ``f`` a chain of :data:`COMMUTING` ops each read once: moving the sum
    after the loop leaves it as it is, adding the local value instead."""
    if len(fusion.operands) != 2:
        return False
    found = _to_fused_root(module, fusion, value)
    if found is None:
        return False
    fused, params, followed, _, _ = found
    if sorted(params) != [0, 1]:
        return False
    other = params[1 - fusion.operands.index(value)]
    return fused.root.opcode == "add" and \
        sorted(fused.root.operands) == sorted([followed, other])


def _writes_into_operand(module: Module, fusion: Instruction, value: str
                         ) -> tuple[int, _Rounding | None] | None:
    """Where ``fusion`` (XLA's fused form of a scan's write) is
    ``dynamic-update-slice(buffer, f(value), offsets)`` of its operands, ``f`` as for
    :func:`_adds_into_operand` and ``buffer`` a parameter read by nothing else: the
    operand position of ``buffer`` (moving the sum after the loop leaves the fusion as
    it is, writing the local value instead), and None; None otherwise.

    ``f`` may also round the sum on the way (:data:`ROUNDING`: XLA's CPU backend sums a
    16-bit gradient in f32 and converts the sum to bf16 and back), provided it leaves
    the value in its own type and every other op of ``f`` is a relabel
    (:data:`RELABELLING`, which commutes with a rounding) of that type:
    the write of sum ``s`` then holds ``round(s)``, and the moved form, which writes the
    local value unrounded and rounds the stacked sums after the loop, holds the same
    numbers, a slot no iteration writes ``round(0) = 0`` as before. The position and
    that rounding then (its converts are taken out of the fusion when the sum moves);
    a write that converts otherwise is refused (``converted``)."""
    found = _to_fused_root(module, fusion, value, rounds=True)
    if found is None:
        return None
    fused, params, followed, readers, chain = found
    converts = tuple(name for name in chain if fused[name].opcode in ROUNDING)
    root = fused.root
    if root.opcode != "dynamic-update-slice" or root.operands[1] != followed or \
            root.operands.count(followed) != 1:
        return None
    buffer = fused[root.operands[0]]
    if buffer.opcode != "parameter" or readers[buffer.name] != [root.name] or \
            root.operands.count(buffer.name) != 1:
        return None
    position = buffer.param_number
    if position >= len(fusion.operands) or fusion.operands[position] == value:
        return None
    if not converts:
        return position, None
    start = fused[params[fusion.operands.index(value)]]
    element_type = _array_type(start)
    # (a scaling would not commute with the rounding moved after it: relabels only)
    if element_type not in ROUNDED_TYPES or _array_type(fused[followed]) != element_type or any(
            (_array_type(fused[name]) not in ROUNDED_TYPES) if name in converts
            else fused[name].opcode not in RELABELLING or
            _array_type(fused[name]) != element_type
            for name in chain):
        raise Refusal("converted")
    return position, _Rounding(fusion.name, converts,
                               tuple(_array_type(fused[name]) for name in converts))


def _to_fused_root(module: Module, fusion: Instruction, value: str, *, rounds: bool = False
                   ) -> tuple[Computation, dict[int, str], str, dict[str, list[str]],
                              tuple[str, ...]] | None:
    """``value`` (one operand of ``fusion``) followed in the fused computation through a
    chain of :data:`COMMUTING` ops (``rounds``: and :data:`ROUNDING` ones), each read
    once, to the root: the fused computation, its parameters by number, the value the
    root reads, the users of each value and the ops passed, in order (None where the
    chain stops before the root)."""
    if fusion.operands.count(value) != 1:
        return None
    fused = module.computation(fusion.called("calls"))
    params = fused.parameter_names()
    followed = params.get(fusion.operands.index(value))
    if followed is None:
        return None
    readers = users_map(fused)
    chain: list[str] = []
    while True:
        following = readers[followed]
        if len(following) != 1:
            return None
        user = fused[following[0]]
        if user is fused.root:
            return fused, params, followed, readers, tuple(chain)
        if not (rounds and user.opcode in ROUNDING):
            rule = COMMUTING.get(user.opcode)
            if rule is None or not rule(module, fused, user, user.operands.index(followed)):
                return None
        followed = user.name
        chain.append(followed)


def _widens_to_write(module: Module, fusion: Instruction) -> bool:
    """``fusion`` writes into a parameter it widens first and narrows back after (XLA:CPU's
    fused write of a 16-bit slot: ``convert(dynamic-update-slice(convert(slot), …))``)."""
    fused = module.computation(fusion.called("calls"))
    root = fused.root
    if root.opcode != "convert":
        return False
    write = fused[root.operands[0]]
    if write.opcode != "dynamic-update-slice":
        return False
    buffer = fused[write.operands[0]]
    return buffer.opcode == "convert" and fused[buffer.operands[0]].opcode == "parameter"


def _array_type(inst: Instruction) -> str:
    return inst.shape.element_type if isinstance(inst.shape, ArrayShape) else ""


def _unrounded(edits: ModuleRewriter, body: Rewriter, rounding: _Rounding) -> None:
    """The writing fusion of ``rounding`` (in ``body``) made to write what it reads,
    unrounded: it calls a copy of its fused computation without the converts (the
    computation may be another fusion's too; left unread, the dead-computation pass
    removes it)."""
    fusion = body.comp[rounding.fusion]
    fused = edits.module.computation(fusion.called("calls"))
    copy = fused.clone()
    copy.name = _fresh_computation_name(edits.module, f"{fused.name}.unrounded")
    edits.insert_computation(copy, after=fused.name)
    rw = edits.rewriter(copy)
    for convert in rounding.converts:
        rw.replace_all_uses_with(convert, copy[convert].operands[0])
        rw.erase(convert)
    body.set_attr(fusion, "calls", ComputationRef(copy.name))


def _rounded_after(outer: Rewriter, value: str, rounding: _Rounding) -> str:
    """``value`` (the stacked sums after the loop) through ``rounding``'s converts."""
    for element_type in rounding.element_types:
        shape = cast(ArrayShape, outer.comp[value].shape)
        value = outer.add("convert", replace(shape, element_type=element_type), [value]).name
    return value


def _fresh_computation_name(module: Module, base: str) -> str:
    name, suffix = base, 0
    while module.has_computation(name):
        suffix += 1
        name = f"{base}.{suffix}"
    return name


@dataclass(frozen=True)
class _LoopEdits:
    """The rewriters of a loop's computation (``outer``), body and condition, and what
    the moves left unread in the body and in ``outer``, cleared once after them."""

    outer: Rewriter
    inner: Rewriter
    condition: Rewriter
    loop: Instruction
    #: The module's (a fused write's rounding moved out edits its fused computation).
    module: ModuleRewriter
    unread_inner: list[str] = field(default_factory=list)
    unread_outer: list[str] = field(default_factory=list)

    def remove_dead(self) -> None:
        """Erase what the moves left unread (a slice taken after the loop now, its
        offsets, a zero start the widened slot no longer reads) and what only it read."""
        self.inner.remove_dead(among=self.unread_inner)
        self.outer.remove_dead(among=self.unread_outer)

    def widen(self, slot: int, shape: ArrayShape) -> None:
        """Slot ``slot`` of the carry becomes ``shape`` (the whole gradient instead of
        its slice): the loop, its initial tuple, the body's parameter and root, the
        condition's parameter, and the body's accumulation (its read of the slot and the
        add into it: the only uses of the slot there)."""
        elements = list(cast(TupleShape, self.loop.shape).elements)
        elements[slot] = shape
        carried = TupleShape(tuple(elements))
        body, condition = self.inner.comp, self.condition.comp
        param = body.parameters()[0]
        accumulation = body[body.root.operands[slot]]
        read = next(body[o] for o in accumulation.operands
                    if body[o].opcode == "get-tuple-element"
                    and body[o].operands == [param.name] and body[o].int_attr("index") == slot)
        init = self.outer.comp[self.loop.operands[0]]
        for rw, inst in ((self.outer, self.loop), (self.outer, init), (self.inner, param),
                         (self.inner, body.root), (self.condition, condition.parameters()[0])):
            rw.set_shape(inst, carried)
        self.inner.set_shape(read, shape)
        self.inner.set_shape(accumulation, shape)


def _move(module: Module, edits: _LoopEdits, anchor: str, all_reduce: Instruction,
          elements: list[_Element], channels: ChannelIds) -> MovedAllReduce:
    """Accumulate the local values in the body, start the slots at zero, and all-reduce
    (then cut each sum to this device's block where the body did, and add the initial
    values) after the loop, after ``anchor`` (the loop or what an earlier move added
    after it)."""
    outer, inner, loop = edits.outer, edits.inner, edits.loop
    for element in elements:
        if element.rounded is not None:
            _unrounded(edits.module, inner, element.rounded)
        inner.replace_all_uses_with(element.reduced, element.local)
        if element.reduced != all_reduce.name:
            inner.erase(element.reduced)
    inner.erase(all_reduce.name)

    comp = outer.comp
    init = comp[loop.operands[0]]
    starts = [init.operands[e.slot] for e in elements]
    cuts = {e.slot: _Cut.of(inner.comp, e.cut) for e in elements if e.cut}
    widened = []
    for element in elements:
        if not element.cut:
            continue
        # the body adds the whole local value; the slice is taken after the loop
        slot = element.slot
        whole = inner.comp[inner.comp[element.cut[0]].operands[0]]
        inner.replace_all_uses_with(element.cut[-1], whole.name)
        edits.unread_inner.append(element.cut[-1])
        before = _slot_shape(loop, slot).byte_size
        edits.widen(slot, cast(ArrayShape, whole.shape))
        widened.append((slot, before, _slot_shape(loop, slot).byte_size))
    shapes = [_slot_shape(loop, e.slot) for e in elements]
    added = [not e.written and not starts_at_zero(module, comp, comp[start])
             for e, start in zip(elements, starts)]
    with outer.inserting_before(init.name):
        for element, shape, add in zip(elements, shapes, added):
            if add or element.slot in cuts:
                outer.set_operand(init, element.slot, _zeros(outer, shape))
    # a widened slot's zero start is unread now (it starts at zeros of its shape)
    edits.unread_outer.extend(start for start, add in zip(starts, added) if not add)
    readers = [[u.name for u in outer.users(loop.name) if u.int_attr("index") == e.slot]
               for e in elements]
    if not any(readers):  # nothing reads the sums after the loop: no all-reduce needed
        return MovedAllReduce(comp.name, loop.name, all_reduce.name,
                              tuple(e.slot for e in elements), after="", last=anchor,
                              widened=tuple(widened))
    attributes = dict(all_reduce.attributes)
    if "channel_id" in attributes:
        attributes["channel_id"] = channels.fresh()
    with outer.inserting_after(anchor):
        accumulated = [outer.add("get-tuple-element", shape, [loop.name], index=e.slot,
                                 name=f"accumulated_{e.slot}").name
                       for e, shape in zip(elements, shapes)]
        if len(elements) > 1:  # (one: an array all-reduce, as XLA's shape inference has it)
            after = outer.add("all-reduce", TupleShape(tuple(shapes)), accumulated,
                              name=all_reduce.name, **attributes).name
            reduced = [outer.add("get-tuple-element", shape, [after], index=i).name
                       for i, shape in enumerate(shapes)]
        else:
            after = outer.add("all-reduce", shapes[0], accumulated, name=all_reduce.name,
                              **attributes).name
            reduced = [after]
        reduced = [_rounded_after(outer, value, e.rounded) if e.rounded else value
                   for e, value in zip(elements, reduced)]
        blocks = [cuts[e.slot].after(outer, value) if e.slot in cuts else value
                  for e, value in zip(elements, reduced)]
        totals = [outer.add("add", comp[value].shape, [start, value]).name if add else value
                  for value, start, add in zip(blocks, starts, added)]
    for olds, total in zip(readers, totals):
        for old in olds:
            outer.replace_all_uses_with(old, total)
            outer.erase(old)
    return MovedAllReduce(comp.name, loop.name, all_reduce.name,
                          tuple(e.slot for e in elements), after, last=totals[-1],
                          widened=tuple(widened),
                          body=loop.called("body") if isinstance(all_reduce.shape, ArrayShape)
                          else "")


@dataclass(frozen=True)
class _Cut:
    """A sum's slice taken in a loop body, as copies to take it after the loop: the
    instructions computing its offsets (from constants and the device's id, operands
    first), the dynamic-slice, then the relabels after it."""

    offsets: tuple[Instruction, ...]
    steps: tuple[Instruction, ...]

    @classmethod
    def of(cls, body: Computation, steps: tuple[str, ...]) -> _Cut:
        order: list[Instruction] = []
        seen: set[str] = set()
        pending = [(o, False) for o in reversed(body[steps[0]].operands[1:])]
        while pending:  # operands before their users, each once
            name, ready = pending.pop()
            if ready:
                order.append(body[name].clone())
            elif name not in seen:
                seen.add(name)
                pending.append((name, True))
                pending.extend((o, False) for o in body[name].operands if o not in seen)
        return cls(tuple(order), tuple(body[name].clone() for name in steps))

    def after(self, rw: Rewriter, value: str) -> str:
        """The slice of ``value``, inserted at ``rw``'s point: its name."""
        copies = {self.steps[0].operands[0]: value}
        for inst in (*self.offsets, *self.steps):
            copy = inst.clone()
            copy.name = rw.fresh_name(inst.name)
            copy.operands = [copies[o] for o in inst.operands]
            copies[inst.name] = rw.add_instruction(copy).name
        return copies[self.steps[-1].name]


def _slot_shape(loop: Instruction, slot: int) -> ArrayShape:
    shape = loop.shape
    assert isinstance(shape, TupleShape)
    element = shape.elements[slot]
    assert isinstance(element, ArrayShape)
    return element


def _zeros(rw: Rewriter, shape: ArrayShape) -> str:
    zero = rw.add_instruction(Instruction(rw.fresh_name("zero"), "constant",
                                          ArrayShape(shape.element_type, ()), literal="0"))
    return rw.add("broadcast", shape, [zero.name], name="accumulator_zeros",
                  dimensions=()).name


__all__ = ["COMMUTING", "REASONS", "RELABELLING", "SUMMABLE", "AccumulationMotion", "AccumulationReport",
           "KeptAllReduce", "LiftedStart", "MovedAllReduce", "Refusal", "Rule", "SlotReads", "check_loop",
           "loops_all_reduce", "slots_read"]
