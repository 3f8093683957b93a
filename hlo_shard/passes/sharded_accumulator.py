"""Gradient accumulation with the accumulator kept as a shard: reduce-scatter inside the loop.

After :mod:`~hlo_shard.passes.accumulation_motion` and the weight-update sharding, an
accumulation loop adds each microbatch's local gradient into carried accumulators and
one reduce-scatter after the loop gives each device its shard of the summed bucket (the
"whole" form). The reduce-scatter sums, and the formatting the sharding puts before it
(transposes, reshapes, zero padding, concatenation into one bucket) is linear and the
same map in every iteration, so ``RS(F(Σᵢ gᵢ)) = Σᵢ RS(F(gᵢ))``: the loop can format and
reduce-scatter each microbatch's gradient instead and add it into one accumulator
carried as the device's ``[L]`` shard (the "sharded" form). The loop then carries 1/N of
the accumulators' bytes and the update after the loop reads the shard directly, with no
collective between the loop and the update; each microbatch pays a reduce-scatter (one
collective per microbatch instead of one per step). XLA makes the same trade with
``WhileLoopAllReduceCodeMotion``'s reduce-scatter variant, off by default on GPU.

Which form, by ``ShardingOptions.accumulator`` (:data:`ACCUMULATOR_MODES`):

* ``auto`` (the default): both forms are priced with the cost model
  (:func:`~hlo_shard.costmodel.step_time.estimate_step` on the sharding's profile) and
  the sharded form is written when it is predicted strictly faster, or when only it
  fits: the cost model's peak per device of the whole form exceeds the profile's
  ``device_memory_bytes`` and that of the sharded form does not (XLA would fail to
  allocate the step; the profiles of XLA CPU devices, which share the host's memory,
  give none). The note gives both predicted step times, the accumulators' bytes in each
  form and the peaks per device; a user short of memory the model does not see asks
  for ``sharded``;
* ``sharded``: every accumulator this pass can prove is carried as a shard;
* ``whole``: the reduce-scatters stay after their loops.

What is proven before a reduce-scatter moves into a loop (else it stays, with a
:data:`REASONS` code and :attr:`ReasonCode.ACCUMULATOR_WHOLE`):

* it sums (``to_apply`` an add) one array of a numeric type, without ``constrain_layout``;
* its operand is computed only from ``get-tuple-element``\\ s of one while loop's result
  through :data:`LINEAR_FORMAT` ops, each value used only on that path (and each slot
  read after the loop only there);
* each of those slots is an accumulator: it starts the loop at zero, the body reads it
  once, into ``add(slot, local)`` used only as the same slot of the body's root tuple,
  and the condition does not read it;
* the loop is as :func:`~hlo_shard.passes.accumulation_motion.check_loop` requires
  (its own body and initial tuple, its result only taken apart).

The accumulators' slots leave the carry; the first of each bucket's slots becomes the
shard, which starts at zero and whose final value replaces the reduce-scatter.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, cast

from hlo_shard.analysis.collectives import ReasonCode, host_callback, is_sum
from hlo_shard.costmodel.step_time import StepEstimate, estimate_step
from hlo_shard.errors import HloShardError
from hlo_shard.graph import ModuleRewriter, Rewriter, call_counts, is_zero, starts_at_zero
from hlo_shard.ir import ArrayShape, Computation, ComputationRef, Instruction, Module, TupleShape
from hlo_shard.opinfo import VIEWS
from hlo_shard.passes.accumulation_motion import (REASONS as MOTION_REASONS, SUMMABLE, Refusal,
                                                  SlotReads, check_loop, slots_read)
from hlo_shard.passes.base import ModulePass
from hlo_shard.passes.weight_update import ChannelIds, planned_update_regions
from hlo_shard.profiles import DEFAULT_PROFILE, HardwareProfile, resolve_profile
from hlo_shard.units import fmt_bytes, fmt_seconds

#: ``ShardingOptions.accumulator``: how an accumulation loop's gradients are summed.
ACCUMULATOR_MODES = ("auto", "whole", "sharded")


def _always(module: Module, comp: Computation, inst: Instruction) -> bool:
    return True


def _pads_with_zero(module: Module, comp: Computation, inst: Instruction) -> bool:
    value = comp[inst.operands[1]] if len(inst.operands) == 2 else None
    return value is not None and value.opcode == "constant" and is_zero(comp, value)


def _fused_relabel(module: Module, comp: Computation, inst: Instruction) -> bool:
    """XLA's fused form of the ops above: a fusion of one operand whose computation only
    places its parameter's elements anew (:func:`_relabelled`), as the sharding writes
    a bucket's transpose in a module XLA fused already."""
    fused = module.computation(inst.called("calls"))
    start, chain = _relabelled(fused, fused.root)
    return len(inst.operands) == 1 and start.opcode == "parameter" and \
        len(fused.instructions) == 1 + len(chain)


#: Ops allowed between the accumulators and the reduce-scatter (the sharding's shard
#: format): each moves or relabels elements (:data:`~hlo_shard.opinfo.VIEWS`, a
#: concatenation, XLA's fusion of views), or adds zeros, the same way in every
#: iteration, so it commutes with the sum over microbatches. The rule says whether the
#: instruction qualifies; only a ``pad``'s first operand is followed (its second is the
#: zero, copied into the loop body).
LINEAR_FORMAT: dict[str, Callable[[Module, Computation, Instruction], bool]] = {
    **{op: _always for op in VIEWS},
    "concatenate": _always,
    "pad": _pads_with_zero,
    "fusion": _fused_relabel,
}

#: Why a reduce-scatter after an accumulation loop stays there (code → words).
REASONS: dict[str, str] = {
    "asked-whole": "accumulator='whole'",
    "slower": "the sharded accumulator is predicted slower",
    "not-summing": "it does not sum one numeric array",
    "not-only-accumulators": "its operand is not only the loop's accumulators, formatted "
                             "(transposed, reshaped, padded with zeros, concatenated)",
    "nonzero-start": "an accumulator does not start the loop at zero",
    "not-accumulated": "a slot is not only added to in the loop",
    **{code: MOTION_REASONS[code] for code in ("accumulator-read", "shared-body",
                                                "shared-init", "result-whole")},
}


@dataclass(frozen=True)
class ShardedAccumulation:
    """A reduce-scatter moved into ``loop``: ``slots`` (the accumulators it summed)
    now carried as one shard of ``shard_bytes`` instead of ``whole_bytes``."""

    computation: str
    loop: str
    reduce_scatter: str
    slots: tuple[int, ...]
    whole_bytes: int
    shard_bytes: int


@dataclass(frozen=True)
class WholeAccumulation:
    """A reduce-scatter left after ``loop``, and why (a :data:`REASONS` code)."""

    computation: str
    loop: str
    reduce_scatter: str
    reason: str
    code: ClassVar[ReasonCode] = ReasonCode.ACCUMULATOR_WHOLE


@dataclass(frozen=True)
class AccumulatorPrices:
    """``auto``'s comparison: the predicted step and peak memory of each form."""

    profile: str
    whole_s: float
    sharded_s: float
    #: The cost model's peak per device (:class:`~hlo_shard.costmodel.memory.MemoryProfile`).
    whole_peak_bytes: int
    sharded_peak_bytes: int
    #: What the loops carry as accumulators per device, in each form.
    whole_accumulator_bytes: int
    sharded_accumulator_bytes: int
    #: The profile's ``device_memory_bytes`` (0: not known).
    device_memory_bytes: int = 0

    @property
    def only_sharded_fits(self) -> bool:
        """The whole form's modelled peak exceeds the device's memory, the sharded one's
        does not."""
        return 0 < self.device_memory_bytes < self.whole_peak_bytes and \
            self.sharded_peak_bytes <= self.device_memory_bytes

    @property
    def sharded_wins(self) -> bool:
        """``auto`` writes the sharded form: predicted faster, or the only one that fits."""
        return self.sharded_s < self.whole_s or self.only_sharded_fits

    @property
    def words(self) -> str:
        fits = (f"; only the sharded form fits the device's "
                f"{fmt_bytes(self.device_memory_bytes)}" if self.only_sharded_fits else "")
        return (f"predicted {fmt_seconds(self.sharded_s)}/step sharded, "
                f"{fmt_seconds(self.whole_s)}/step whole; accumulators "
                f"{fmt_bytes(self.sharded_accumulator_bytes)} sharded, "
                f"{fmt_bytes(self.whole_accumulator_bytes)} whole; modelled peak "
                f"{fmt_bytes(self.sharded_peak_bytes)} sharded, "
                f"{fmt_bytes(self.whole_peak_bytes)} whole per device (profile {self.profile})"
                f"{fits}")


@dataclass(frozen=True)
class AccumulatorReport:
    mode: str
    sharded: list[ShardedAccumulation] = field(default_factory=list)
    whole: list[WholeAccumulation] = field(default_factory=list)
    prices: AccumulatorPrices | None = None

    @property
    def notes(self) -> list[str]:
        """What ``--explain`` says: which form each accumulation loop got, and why."""
        why = f" ({self.prices.words})" if self.prices is not None else ""
        notes = [f"{s.computation}/while %{s.loop}: accumulator sharded (accumulator="
                 f"{self.mode}): %{s.reduce_scatter} reduce-scatters each microbatch "
                 f"inside the loop; slot{'s' if len(s.slots) > 1 else ''} "
                 f"{', '.join(map(str, s.slots))} carried as one {fmt_bytes(s.shard_bytes)} "
                 f"shard instead of {fmt_bytes(s.whole_bytes)}{why}"
                 for s in self.sharded]
        notes += [f"{w.computation}/while %{w.loop}: accumulator whole, %{w.reduce_scatter} "
                  f"reduce-scatters once after the loop ({REASONS[w.reason]}"
                  f"{'; ' + self.prices.words if w.reason == 'slower' and self.prices else ''})"
                  for w in self.whole]
        return notes


@dataclass(frozen=True)
class _Addend:
    """What an accumulation adds into its slot each iteration: ``value`` (of the loop
    body), through ``relabels`` (innermost first: the transposes and layout changes XLA
    fused into the add with it, which the accumulation in the loop makes again as
    instructions of the body)."""

    value: str
    relabels: tuple[Instruction, ...] = ()


@dataclass(frozen=True)
class _Plan:
    """One reduce-scatter to move into ``loop``: its formatting ops (operands first),
    the loop's result elements it reads (name → slot), and per slot the body's
    accumulating add and what it adds."""

    reduce_scatter: str
    loop: str
    chain: tuple[str, ...]
    leaves: dict[str, int]
    adds: dict[int, Instruction]
    local_values: dict[int, _Addend]

    @property
    def slots(self) -> list[int]:
        return sorted(set(self.leaves.values()))


@dataclass(frozen=True)
class ShardedAccumulator(ModulePass[AccumulatorReport]):
    """Carry accumulation loops' accumulators as shards where ``mode`` says so."""

    name: ClassVar[str] = "sharded-accumulator"
    profile: HardwareProfile | str = DEFAULT_PROFILE
    mode: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", resolve_profile(self.profile))
        if self.mode not in ACCUMULATOR_MODES:
            raise HloShardError(f"accumulator must be one of {', '.join(ACCUMULATOR_MODES)}, "
                                f"not {self.mode!r}")

    def apply(self, module: Module, rewriter: ModuleRewriter) -> AccumulatorReport:
        if host_callback(module):  # (its collectives stay where they are)
            return AccumulatorReport(self.mode)
        plans, refused = _find(module)
        if not plans or self.mode == "whole":
            whole = refused + [WholeAccumulation(c, p.loop, p.reduce_scatter, "asked-whole")
                               for c, ps in plans.items() for p in ps]
            return AccumulatorReport(self.mode, whole=whole)
        if self.mode == "sharded":
            return AccumulatorReport(self.mode, _rewrite(module, plans, rewriter), refused)
        trial = module.clone()
        sharded = _rewrite(trial, _find(trial)[0], ModuleRewriter(trial))
        before, after = self._estimate(module), self._estimate(trial)
        prices = AccumulatorPrices(before.profile.name, before.seconds, after.seconds,
                                   before.memory.peak_bytes, after.memory.peak_bytes,
                                   sum(s.whole_bytes for s in sharded),
                                   sum(s.shard_bytes for s in sharded),
                                   resolve_profile(self.profile).device_memory_bytes)
        if prices.sharded_wins:
            # The same rewrite on the module itself, through the pass's rewriter (its
            # log is what the pass did).
            return AccumulatorReport(self.mode, _rewrite(module, plans, rewriter), refused,
                                     prices)
        whole = refused + [WholeAccumulation(c, p.loop, p.reduce_scatter, "slower")
                           for c, ps in plans.items() for p in ps]
        return AccumulatorReport(self.mode, whole=whole, prices=prices)

    def _estimate(self, module: Module) -> StepEstimate:
        return estimate_step(module, resolve_profile(self.profile),
                             planned_update_regions(module))


# ------------------------------------------------------------------------------ finding


def _find(module: Module) -> tuple[dict[str, list[_Plan]], list[WholeAccumulation]]:
    """Computation → the reduce-scatters that can move into a loop there, and those fed
    by a loop's result that cannot (with why)."""
    #: Computation → how many instructions call it: read at the first loop looked into.
    callers: dict[str, int] = {}
    edits = ModuleRewriter(module)
    plans: dict[str, list[_Plan]] = defaultdict(list)
    refused: list[WholeAccumulation] = []
    for comp in module.computations:
        views: dict[str, _LoopView] = {}
        for inst in comp.instructions:
            if inst.opcode != "reduce-scatter":
                continue
            rw = edits.rewriter(comp)  # only where there is one: a users index each
            loop, chain, leaves, problem = _trace(module, rw, inst)
            try:
                if problem:
                    raise Refusal(problem)
                if not loop:
                    continue
                if loop not in views:
                    callers = callers or call_counts(module)
                    views[loop] = _LoopView.of(module, rw, comp[loop], callers)
                plan = _accumulators(module, rw, views[loop], inst.name, loop, chain, leaves)
            except Refusal as why:
                refused.append(WholeAccumulation(comp.name, loop, inst.name, why.reason))
                continue
            plans[comp.name].append(plan)
    return dict(plans), refused


def _trace(module: Module, rw: Rewriter, reduce_scatter: Instruction
           ) -> tuple[str, tuple[str, ...], dict[str, int], str]:
    """The loop whose result ``reduce_scatter`` is computed from ("": none), its
    formatting ops (operands first), the loop elements read (name → slot), and why it
    cannot move (a :data:`REASONS` code, "" when it may)."""
    comp = rw.comp
    chain: set[str] = set()
    leaves: dict[str, int] = {}
    loops: set[str] = set()
    linear = True
    stack, seen = [reduce_scatter.operands[0]] if reduce_scatter.operands else [], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        inst = comp[name]
        if inst.opcode == "get-tuple-element" and comp[inst.operands[0]].opcode == "while":
            leaves[name] = inst.required_attr("index", int)
            loops.add(inst.operands[0])
            continue
        rule = LINEAR_FORMAT.get(inst.opcode)
        if rule is None or not rule(module, comp, inst):
            linear = False
            continue
        chain.add(name)
        stack.extend(inst.operands[:1] if inst.opcode == "pad" else inst.operands)
    if not loops:
        return "", (), {}, ""
    loop = min(loops)
    inside = chain | {reduce_scatter.name}
    if not linear or len(loops) > 1 or len(set(leaves.values())) < len(leaves) or any(
            u.name not in inside for name in chain | set(leaves) for u in rw.users(name)):
        return loop, (), {}, "not-only-accumulators"
    if any(u.int_attr("index") in set(leaves.values()) and u.name not in leaves
           for u in rw.users(loop)):
        return loop, (), {}, "accumulator-read"
    if not _sums_one_array(module, reduce_scatter):
        return loop, (), {}, "not-summing"
    return loop, _operands_first(comp, chain, reduce_scatter.operands[0]), leaves, ""


def _operands_first(comp: Computation, chain: set[str], top: str) -> tuple[str, ...]:
    """The ``chain`` ops below ``top``, each after its operands (a post-order walk of
    the chain alone: linear in its size, whatever the computation's)."""
    order: list[str] = []
    done: set[str] = set()
    stack = [(top, False)]
    while stack:
        name, expanded = stack.pop()
        if name in done or name not in chain:
            continue
        if expanded:
            done.add(name)
            order.append(name)
            continue
        stack.append((name, True))
        stack.extend((operand, False) for operand in reversed(comp[name].operands))
    return tuple(order)


def _sums_one_array(module: Module, inst: Instruction) -> bool:
    shape = inst.shape
    return len(inst.operands) == 1 and isinstance(shape, ArrayShape) and not shape.dynamic \
        and shape.element_type in SUMMABLE and is_sum(module, inst) \
        and not inst.attr("constrain_layout")


@dataclass
class _LoopView:
    """What :func:`_accumulators` reads of one loop, taken once however many of its
    reduce-scatters are looked at: why the loop cannot be rewired ("" when it can), the
    body's rewriter, how often each slot is read in the body and the condition, the
    body's reader of each slot, and where each value sits in the body's root tuple."""

    refusal: str
    body: Computation
    inner: Rewriter
    reads: tuple[SlotReads, SlotReads]
    readers: dict[int, Instruction]
    root_slots: dict[str, list[int]]

    @classmethod
    def of(cls, module: Module, rw: Rewriter, loop: Instruction, callers: dict[str, int]
           ) -> _LoopView:
        body = module.computation(loop.required_attr("body", ComputationRef).name)
        condition = module.computation(loop.required_attr("condition", ComputationRef).name)
        refusal = ""
        try:
            check_loop(rw, loop, callers[body.name])
        except Refusal as why:
            refusal = why.reason
        edits = ModuleRewriter(module)
        inner = edits.rewriter(body)
        readers = {u.required_attr("index", int): u for p in body.parameters()
                   for u in inner.users(p.name)
                   if u.opcode == "get-tuple-element" and inner.users(u.name)}
        root_slots: dict[str, list[int]] = defaultdict(list)
        if body.root.opcode == "tuple":
            for slot, name in enumerate(body.root.operands):
                root_slots[name].append(slot)
        return cls(refusal, body, inner,
                   (slots_read(inner), slots_read(edits.rewriter(condition))), readers,
                   dict(root_slots))


def _accumulators(module: Module, rw: Rewriter, view: _LoopView, reduce_scatter: str,
                  loop_name: str, chain: tuple[str, ...], leaves: dict[str, int]) -> _Plan:
    """The plan for ``reduce_scatter``, once every slot it reads is an accumulator."""
    if view.refusal:
        raise Refusal(view.refusal)
    init = rw.comp[rw.comp[loop_name].operands[0]]
    in_body, in_condition = view.reads
    root = view.body.root
    adds: dict[int, Instruction] = {}
    local: dict[int, _Addend] = {}
    for slot in sorted(set(leaves.values())):
        if not starts_at_zero(module, rw.comp, rw.comp[init.operands[slot]]):
            raise Refusal("nonzero-start")
        if in_body is None or in_condition is None or in_body.get(slot, 0) != 1 \
                or in_condition.get(slot, 0):
            raise Refusal("accumulator-read")
        read = view.readers[slot]
        (add,) = view.inner.users(read.name)
        addend = _addend(module, add, read.name)
        if addend is None or [u.name for u in view.inner.users(add.name)] != [root.name] \
                or view.root_slots.get(add.name) != [slot] or add.shape != read.shape:
            raise Refusal("not-accumulated")
        adds[slot] = add
        local[slot] = addend
    return _Plan(reduce_scatter, loop_name, chain, leaves, adds, local)


# ------------------------------------------------------------------------------ rewriting


def _rewrite(module: Module, plans: dict[str, list[_Plan]], edits: ModuleRewriter
             ) -> list[ShardedAccumulation]:
    channels = ChannelIds(module)
    done: list[ShardedAccumulation] = []
    for comp_name, comp_plans in plans.items():
        by_loop: dict[str, list[_Plan]] = defaultdict(list)
        for plan in comp_plans:
            by_loop[plan.loop].append(plan)
        for loop, loop_plans in by_loop.items():
            done += _Recarry(module, edits, channels, module.computation(comp_name),
                             loop).run(loop_plans)
    return done


@dataclass
class _Recarry:
    """One loop's accumulators out of the carry, each bucket's shard in the place of its
    first slot."""

    module: Module
    edits: ModuleRewriter
    channels: ChannelIds
    comp: Computation
    loop_name: str

    def run(self, plans: list[_Plan]) -> list[ShardedAccumulation]:
        outer = self.edits.rewriter(self.comp)
        loop = self.comp[self.loop_name]
        body = self.module.computation(loop.required_attr("body", ComputationRef).name)
        condition = self.module.computation(
            loop.required_attr("condition", ComputationRef).name)
        inner, cond = self.edits.rewriter(body), self.edits.rewriter(condition)
        old = cast(TupleShape, loop.shape).elements
        shard_of = {plan.slots[0]: plan for plan in plans}
        removed = {s for plan in plans for s in plan.slots[1:]}
        accumulators = {s for plan in plans for s in plan.slots}
        new_index: dict[int, int] = {}
        for slot in range(len(old)):
            if slot not in removed:
                new_index[slot] = len(new_index)
        shapes = [self.comp[shard_of[s].reduce_scatter].shape if s in shard_of else old[s]
                  for s in range(len(old)) if s not in removed]
        carried = TupleShape(tuple(shapes))

        # slots that stay: every reader of the carry gets its new index
        stale: list[tuple[Rewriter, str]] = []
        for rw, tuple_value in ((inner, body.parameters()[0].name),
                                (cond, condition.parameters()[0].name),
                                (outer, loop.name)):
            for reader in rw.users(tuple_value):
                slot = reader.required_attr("index", int)
                if slot in accumulators:
                    stale.append((rw, reader.name))
                else:
                    rw.set_attr(reader, "index", new_index[slot])
        for rw, inst in ((inner, body.parameters()[0]), (cond, condition.parameters()[0]),
                         (outer, loop)):
            rw.set_shape(inst, carried)

        init = self.comp[loop.operands[0]]
        starts = list(init.operands)
        nexts = list(body.root.operands)
        done = []
        for slot, plan in shard_of.items():
            rs = self.comp[plan.reduce_scatter]
            shape = cast(ArrayShape, rs.shape)
            with outer.inserting_before(init.name):
                starts[slot] = _zeros(outer, shape)
            nexts[slot] = self._accumulate_in_body(inner, body, plan, rs, new_index[slot])
            with outer.inserting_after(loop.name):
                shard = outer.add("get-tuple-element", shape, [loop.name],
                                  index=new_index[slot], name=f"{rs.name}.accumulated")
            outer.replace_all_uses_with(rs.name, shard.name)
            for name in (rs.name, *reversed(plan.chain)):
                pads = [self.comp[o] for o in self.comp[name].operands[1:]] \
                    if self.comp[name].opcode == "pad" else []
                outer.erase(name)
                for pad_value in pads:
                    if not outer.users(pad_value.name):
                        outer.erase(pad_value.name)
            whole = sum(cast(ArrayShape, old[s]).byte_size for s in plan.slots)
            done.append(ShardedAccumulation(self.comp.name, loop.name, rs.name,
                                            tuple(plan.slots), whole, shape.byte_size))

        keep = [s for s in range(len(old)) if s not in removed]
        dropped = [init.operands[s] for s in sorted(accumulators)]
        outer.set_operands(init, [starts[s] for s in keep])
        outer.set_shape(init, carried)
        outer.remove_dead(among=dropped)  # the accumulators' zero starts, read no more
        inner.set_operands(body.root, [nexts[s] for s in keep])
        inner.set_shape(body.root, carried)
        for plan in plans:
            for add in plan.adds.values():
                inner.erase(add.name)
        for rw, name in stale:
            if rw.comp.get(name) is not None and not rw.is_used(name):
                rw.erase(name)
        return done

    def _accumulate_in_body(self, inner: Rewriter, body: Computation, plan: _Plan,
                            rs: Instruction, index: int) -> str:
        """The formatting and the reduce-scatter of the microbatch's local gradients, added
        to the shard carried at ``index``: the new next value of that slot."""
        with inner.inserting_before(body.root.name):
            added = {slot: self._made(inner, addend)
                     for slot, addend in plan.local_values.items()}
            copies = {leaf: added[slot] for leaf, slot in plan.leaves.items()}
            for name in plan.chain:
                inst = self.comp[name]
                operands = [copies[o] for o in inst.operands[:1]] if inst.opcode == "pad" \
                    else [copies[o] for o in inst.operands]
                if inst.opcode == "pad":
                    operands.append(self._copy(inner, self.comp[inst.operands[1]]))
                copies[name] = self._copy(inner, inst, operands)
            top = copies[rs.operands[0]]
            scattered = self._copy(inner, rs, [top])
            if scattered and rs.attr("channel_id") is not None:
                inner.set_attr(body[scattered], "channel_id", self.channels.fresh())
            shard = inner.add("get-tuple-element", rs.shape, [body.parameters()[0].name],
                              index=index, name=f"{rs.name}.shard")
            return inner.add("add", rs.shape, [shard.name, scattered],
                             name=f"{rs.name}.accumulate").name

    def _made(self, inner: Rewriter, addend: _Addend) -> str:
        """``addend``'s value in the body: its relabels made there, operands first."""
        value = addend.value
        for relabel in addend.relabels:
            value = self._copy(inner, relabel, [value])
        return value

    @staticmethod
    def _copy(rw: Rewriter, inst: Instruction, operands: list[str] | None = None) -> str:
        copy = inst.clone()
        copy.name = rw.fresh_name(inst.name)
        copy.operands = list(inst.operands if operands is None else operands)
        return rw.add_instruction(copy).name


def _addend(module: Module, add: Instruction, accumulator: str) -> _Addend | None:
    """What ``add`` adds to ``accumulator`` (one of its two operands, read once): the
    other operand of an ``add``, or of XLA's fused form of one — a fusion whose
    computation adds its two parameters, the other one through ops that only place its
    elements anew (:func:`_relabelled`: the transposes and layout changes XLA fuses into
    an accumulation) and does nothing else; None for any other instruction."""
    if len(add.operands) != 2 or add.operands.count(accumulator) != 1:
        return None
    other = add.operands[1 - add.operands.index(accumulator)]
    if add.opcode == "add":
        return _Addend(other)
    if add.opcode != "fusion":
        return None
    fused = module.computation(add.called("calls"))
    root = fused.root
    if root.opcode != "add" or len(set(root.operands)) != 2:
        return None
    kept = fused.parameter_names().get(add.operands.index(accumulator))
    if kept not in root.operands:
        return None
    value, relabels = _relabelled(fused, fused[root.operands[1 - root.operands.index(kept)]])
    if value.opcode != "parameter" or value.name == kept or \
            len(fused.instructions) != 3 + len(relabels):
        return None
    return _Addend(other, tuple(reversed(relabels)))


def _relabelled(fused: Computation, top: Instruction) -> tuple[Instruction, list[Instruction]]:
    """Down from ``top`` through the ops that only place their one operand's elements
    anew (:data:`~hlo_shard.opinfo.VIEWS`): the value they start from, and those ops,
    ``top`` first."""
    chain: list[Instruction] = []
    while top.opcode in VIEWS and len(top.operands) == 1:
        chain.append(top)
        top = fused[top.operands[0]]
    return top, chain


def _zeros(rw: Rewriter, shape: ArrayShape) -> str:
    zero = rw.add_instruction(Instruction(rw.fresh_name("zero"), "constant",
                                          ArrayShape(shape.element_type, ()), literal="0"))
    return rw.add("broadcast", shape, [zero.name], name="shard_accumulator_zeros",
                  dimensions=()).name


__all__ = ["ACCUMULATOR_MODES", "LINEAR_FORMAT", "REASONS", "AccumulatorPrices",
           "AccumulatorReport", "ShardedAccumulation", "ShardedAccumulator",
           "WholeAccumulation"]
