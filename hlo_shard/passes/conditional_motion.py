"""Gradients computed inside a conditional: sink their all-reduces after it.

A model with a ``lax.cond`` (a branch chosen by the parameters, a stochastic-depth
skip) differentiates into a conditional whose branches compute the weight gradients;
the SPMD partitioner all-reduces each gradient inside every branch, right after the
product that makes it. The weight-update sharding reads gradient all-reduces of the
computation the update runs in, so a gradient summed inside a branch stays whole and
the whole step falls back.

When every branch returns the same element of the conditional's result as a summing
all-reduce of one array, followed only by ops that relabel its elements (reshape,
bitcast, transpose, copy, a sum over dimensions of size 1:
:data:`~hlo_shard.passes.accumulation_motion.RELABELLING`), the sum
can move after the conditional: ``relabel(all-reduce(x))`` is ``all-reduce(relabel(x))``,
element for element the same sum in the same order, so the branch returns its device's
part and one all-reduce of that element after the conditional replaces the one each
branch ran. The branches must relabel the element alike (the same transposes and
bitcasts; reshapes, copies and sums over dimensions of size 1 keep every element where
it is): then the moved sum is the one each device had whichever branch it took, even
where devices of one group took different branches and a communicator that pairs
collectives by their order (NCCL) summed one branch's part with another's.

What is proven before an element's all-reduces move (anything else stays, with a reason
code): the branches are called by this conditional alone, its result is only taken
apart by ``get-tuple-element``, and in every branch the element is such a chain from a
summing all-reduce over arrays of a numeric type, without ``constrain_layout``, its
operand of its result's shape, each op of the chain used only by the next, the last
only by the root, once; the branches' all-reduces have the same groups, read the same
way (channel id and ``use_global_device_ids``) and relabelled alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from hlo_shard.analysis.collectives import group_mode, host_callback, is_sum
from hlo_shard.graph import ModuleRewriter, Rewriter, call_counts, is_impure
from hlo_shard.ir import ArrayShape, Computation, Instruction, Module, TupleShape
from hlo_shard.opinfo import COPY, OPINFO, RESHAPE
from hlo_shard.passes.accumulation_motion import RELABELLING, SUMMABLE, Refusal
from hlo_shard.passes.base import ModulePass
from hlo_shard.passes.weight_update import ChannelIds

#: Why an element's all-reduces stay in the branches (reason code → ``--explain``'s words).
REASONS: dict[str, str] = {
    "shared-branch": "a branch is called by more than one instruction",
    "result-whole": "the conditional's result is used other than by get-tuple-element",
    "not-in-every-branch": "not every branch returns it as an all-reduced sum (through ops "
                           "that only relabel its elements)",
    "not-summing": "it does not sum numeric arrays",
    "constrain-layout": "constrain_layout=true",
    "layout-change": "its operand has another shape or layout than its result",
    "unlike": "the branches' all-reduces differ in their groups or in how they read them, "
              "or the branches relabel the sum differently",
    "partly-moved": "it is summed in one all-reduce with an element that stays",
}


@dataclass(frozen=True)
class MovedElement:
    """Element ``element`` of ``conditional`` (in ``computation``): the all-reduce each
    branch ran, and the one after the conditional ("" when nothing reads the element)."""

    computation: str
    conditional: str
    element: int
    all_reduces: tuple[str, ...]
    after: str


@dataclass(frozen=True)
class KeptElement:
    """An all-reduced element left in the branches, and why (a :data:`REASONS` code)."""

    computation: str
    conditional: str
    element: int
    reason: str


@dataclass(frozen=True)
class ConditionalMotionReport:
    moved: list[MovedElement] = field(default_factory=list)
    kept: list[KeptElement] = field(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """What ``--explain`` says: per conditional, the elements whose sums moved out,
        and those kept in."""
        by_conditional: dict[tuple[str, str], list[MovedElement]] = {}
        for move in self.moved:
            by_conditional.setdefault((move.computation, move.conditional), []).append(move)
        notes = [f"{comp}/conditional %{cond}: the all-reduces of {len(moves)} element(s) "
                 f"({', '.join(str(m.element) for m in moves)}) moved after it from every "
                 f"branch" for (comp, cond), moves in by_conditional.items()]
        notes += [f"{k.computation}/conditional %{k.conditional}: element {k.element} stays "
                  f"all-reduced in its branches ({REASONS[k.reason]})" for k in self.kept]
        return notes


@dataclass(frozen=True)
class ConditionalMotion(ModulePass[ConditionalMotionReport]):
    """Move the all-reduces every branch of a conditional runs on one of its results
    after the conditional."""

    name: ClassVar[str] = "conditional-motion"

    def apply(self, module: Module, rewriter: ModuleRewriter) -> ConditionalMotionReport:
        report = ConditionalMotionReport()
        if host_callback(module):  # (its collectives stay where they are)
            return report
        channels = ChannelIds(module)
        # A moved all-reduce lands in the conditional's computation, which may be a
        # branch of an outer conditional: sweep until nothing moves (the nesting depth).
        while True:
            callers = call_counts(module)
            sites = [(comp, inst) for comp in module.computations
                     for inst in comp.instructions if inst.opcode == "conditional"]
            moved = [move for comp, cond in sites
                     for move in _sink(module, rewriter, comp, cond, callers, channels, report)]
            report.moved.extend(moved)
            if not moved:
                break
        moved_keys = {(m.computation, m.conditional, m.element) for m in report.moved}
        kept = {(k.computation, k.conditional, k.element): k for k in report.kept
                if (k.computation, k.conditional, k.element) not in moved_keys}
        return ConditionalMotionReport(report.moved, list(kept.values()))


def conditionals_all_reduce(module: Module) -> bool:
    """Whether some conditional's branch all-reduces (anything for this pass to do)."""
    branches = {name for comp in module.computations for inst in comp.instructions
                if inst.opcode == "conditional" for name in inst.called_computations()}
    return any(inst.opcode == "all-reduce" for comp in module.computations
               if comp.name in branches for inst in comp.instructions)


@dataclass(frozen=True)
class _Sum:
    """A branch's sum of one element of the conditional's result: the all-reduce (an
    array one, or a tuple one XLA's combiner made), the value the branch reads the sum
    as (the all-reduce, or its get-tuple-element) and the device's own part."""

    all_reduce: Instruction
    reduced: str
    local: str
    #: How the branch moves the summed elements on the way to its root
    #: (:func:`_relabelling`).
    relabelling: tuple = ()


def _sink(module: Module, edits: ModuleRewriter, comp: Computation, cond: Instruction,
          callers: dict[str, int], channels: ChannelIds, report: ConditionalMotionReport
          ) -> list[MovedElement]:
    """Move what can move out of ``cond``'s branches; what cannot goes to ``report``."""
    branches = [module.computation(name) for name in cond.called_computations()]
    if not isinstance(cond.shape, TupleShape) or not any(
            inst.opcode == "all-reduce" for branch in branches for inst in branch.instructions):
        return []
    outer = edits.rewriter(comp)
    inner = [edits.rewriter(branch) for branch in branches]
    count = len(cond.shape.elements)
    summed = sorted({k for rw in inner for k in _all_reduced_elements(rw, count)})

    def keep(reason: str, elements: Iterable[int]) -> list[MovedElement]:
        report.kept.extend(KeptElement(comp.name, cond.name, k, reason) for k in elements)
        return []

    if any(callers.get(branch.name, 0) != 1 for branch in branches):
        return keep("shared-branch", summed)
    if cond.name == comp.root_name or any(
            user.opcode != "get-tuple-element" for user in outer.users(cond.name)):
        return keep("result-whole", summed)
    plans: dict[int, list[_Sum]] = {}
    for k in summed:
        try:
            plans[k] = [_branch_sum(module, rw, k) for rw in inner]
            _check_alike(plans[k])
        except Refusal as why:
            plans.pop(k, None)
            keep(why.reason, [k])
    keep("partly-moved", _drop_partly_moved(plans, len(inner)))
    # Each element's readers after the conditional, in program order; elements in the
    # order of their first reader (the insertions then walk the computation once).
    position = {inst.name: i for i, inst in enumerate(comp.instructions)}
    readers: dict[int, list[str]] = {}
    for user in sorted(outer.users(cond.name), key=lambda u: position[u.name]):
        readers.setdefault(user.required_attr("index", int), []).append(user.name)
    moved = []
    gone: list[set[str]] = [set() for _ in inner]
    for k, sums in sorted(plans.items(),
                          key=lambda item: position.get(readers.get(item[0], [""])[0], -1)):
        for b, (rw, part) in enumerate(zip(inner, sums)):
            rw.replace_all_uses_with(part.reduced, part.local)
            gone[b] |= {part.reduced, part.all_reduce.name}
        after = _sum_after(outer, readers.get(k, []), sums[0].all_reduce, channels)
        moved.append(MovedElement(comp.name, cond.name, k,
                                  tuple(part.all_reduce.name for part in sums), after))
    for rw, names in zip(inner, gone):  # the sums and their get-tuple-elements, at once
        erased = rw.remove_dead(among=names, is_impure=_kept_unless(names))
        assert erased == len(names), f"{rw.comp.name}: a moved sum is still read"
    return sorted(moved, key=lambda m: m.element)


def _kept_unless(names: set[str]) -> Callable[[Instruction], bool]:
    """What stays though unread: an impure instruction (a collective), but for ``names``
    (the sums moved out, collectives that no longer run here)."""
    return lambda inst: inst.name not in names and is_impure(inst)


def _drop_partly_moved(plans: dict[int, list[_Sum]], branches: int) -> list[int]:
    """A tuple all-reduce moves whole: drop from ``plans`` the elements of one with an
    element that stays, and with each dropped element those it shares an all-reduce with
    in any branch (one worklist: each all-reduce looked at once). Returns the dropped."""
    members: list[dict[str, set[int]]] = [{} for _ in range(branches)]
    for k, sums in plans.items():
        for b, part in enumerate(sums):
            members[b].setdefault(part.all_reduce.name, set()).add(k)
    todo = [k for k, sums in plans.items()
            if any(len(members[b][part.all_reduce.name]) != len(part.all_reduce.operands)
                   for b, part in enumerate(sums))]
    dropped = []
    while todo:
        k = todo.pop()
        if k not in plans:
            continue
        sums = plans.pop(k)
        dropped.append(k)
        for b, part in enumerate(sums):
            todo.extend(members[b].pop(part.all_reduce.name, ()))
    return sorted(dropped)


def _all_reduced_elements(rw: Rewriter, count: int) -> list[int]:
    """The elements of the branch's result reached from an all-reduce through
    relabelling ops (what might move; :func:`_branch_sum` proves it)."""
    root = rw.comp.root
    if root.opcode != "tuple" or len(root.operands) != count:
        return []
    return [k for k, value in enumerate(root.operands) if _summed_by(rw, value) is not None]


def _summed_by(rw: Rewriter, value: str) -> Instruction | None:
    """The all-reduce ``value`` is read from through relabelling ops (and the
    get-tuple-element of a tuple all-reduce), or None."""
    inst = rw.comp[value]
    while inst.opcode in RELABELLING and inst.operands:
        inst = rw.comp[inst.operands[0]]
    if inst.opcode == "get-tuple-element":
        inst = rw.comp[inst.operands[0]]
    return inst if inst.opcode == "all-reduce" else None


def _branch_sum(module: Module, rw: Rewriter, k: int) -> _Sum:
    """The branch's sum of element ``k`` (proven movable), or why not (raised)."""
    root = rw.comp.root
    if root.opcode != "tuple" or k >= len(root.operands):
        raise Refusal("not-in-every-branch")
    value = root.operands[k]
    if root.operands.count(value) != 1 or [u.name for u in rw.users(value)] != [root.name]:
        raise Refusal("not-in-every-branch")
    inst = rw.comp[value]
    chain = []
    while (rule := RELABELLING.get(inst.opcode)) is not None:
        if not inst.operands or not rule(module, rw.comp, inst, 0):
            raise Refusal("not-in-every-branch")
        operand = rw.comp[inst.operands[0]]
        if [u.name for u in rw.users(operand.name)] != [inst.name]:
            raise Refusal("not-in-every-branch")
        chain.append(inst)
        inst = operand
    index = None
    if inst.opcode == "get-tuple-element":
        index = inst.required_attr("index", int)
        reduced, inst = inst.name, rw.comp[inst.operands[0]]
    else:
        reduced = inst.name
    if inst.opcode != "all-reduce":
        raise Refusal("not-in-every-branch")
    _check_sum(module, rw, inst, index)
    return _Sum(inst, reduced, inst.operands[index or 0], _relabelling(rw.comp, chain))


def _in_place(inst: Instruction) -> bool:
    """A relabelling op that keeps every element at its row-major position: a copy, a
    reshape, or a reduce (:data:`RELABELLING` lets only a sum over dimensions of size 1
    through); a transpose or a bitcast may move them. A chain of only these is the
    identity, whatever its shapes."""
    return OPINFO[inst.opcode].moves in (COPY, RESHAPE) or inst.opcode == "reduce"


def _relabelling(comp: Computation, chain: list[Instruction]) -> tuple:
    """How ``chain`` (relabelling ops, root side first) moves the elements: () where
    each op keeps them in place, else every op with its operand's shape, its own and its
    attributes (two branches' chains move the elements alike when these are equal)."""
    if all(_in_place(inst) for inst in chain):
        return ()
    return tuple((inst.opcode, str(comp[inst.operands[0]].shape), str(inst.shape),
                  sorted(((key, str(value)) for key, value in inst.attributes.items()
                          if key != "metadata")))
                 for inst in chain)


def _check_sum(module: Module, rw: Rewriter, inst: Instruction, index: int | None) -> None:
    """``inst`` sums arrays of numeric types, each of its operand's shape; a tuple one
    (``index`` is then the element) is only taken apart, each element once."""
    shapes = inst.shape.elements if isinstance(inst.shape, TupleShape) else (inst.shape,)
    if (index is None) != (not isinstance(inst.shape, TupleShape)) or not is_sum(module, inst) \
            or len(inst.operands) != len(shapes) or any(
                not isinstance(shape, ArrayShape) or shape.dynamic
                or shape.element_type not in SUMMABLE for shape in shapes):
        raise Refusal("not-summing")
    if inst.attr("constrain_layout"):
        raise Refusal("constrain-layout")
    if any(rw.comp[operand].shape != shape for operand, shape in zip(inst.operands, shapes)):
        raise Refusal("layout-change")
    if index is not None:
        readers = rw.users(inst.name)
        indices = [u.required_attr("index", int) for u in readers
                   if u.opcode == "get-tuple-element"]
        if len(indices) != len(readers) or sorted(indices) != list(range(len(shapes))):
            raise Refusal("not-in-every-branch")


def _check_alike(sums: list[_Sum]) -> None:
    """The branches' all-reduces of one element sum over the same groups, read the same
    way (a channel id makes them partition or global device ids), and the branches
    relabel the sum alike."""
    first = sums[0].all_reduce
    if any(group_mode(s.all_reduce) is not group_mode(first) or
           s.all_reduce.attr("replica_groups") != first.attr("replica_groups") or
           s.relabelling != sums[0].relabelling for s in sums[1:]):
        raise Refusal("unlike")


def _sum_after(outer: Rewriter, readers: list[str], template: Instruction,
               channels: ChannelIds) -> str:
    """One all-reduce of an element of the conditional's result, right after its first
    reader (a get-tuple-element: the device's part now) and read where every reader was;
    its name, or "" where nothing reads the element (no sum needed)."""
    if not readers:
        return ""
    first, *others = readers
    attributes = dict(template.attributes)  # (a tuple all-reduce's apply to each element)
    if "channel_id" in attributes:
        attributes["channel_id"] = channels.fresh()
    with outer.inserting_after(first):
        total = outer.add("all-reduce", outer.comp[first].shape, [first], name=template.name,
                          **attributes).name
    outer.replace_all_uses_with(first, total, exclude=[total])
    for other in others:  # later in the program than the sum: their readers are too
        outer.replace_all_uses_with(other, total)
    return total


__all__ = ["REASONS", "ConditionalMotion", "ConditionalMotionReport",
           "KeptElement", "MovedElement", "conditionals_all_reduce"]
