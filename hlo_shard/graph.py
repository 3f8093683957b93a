"""The dataflow view of a module and the editing helpers passes use.

Analyses read :func:`dataflow_graph` (a :class:`DataflowGraph` per computation, operand →
user edges keyed by operand index, so ``multiply(x, x)`` has two edges) and
:func:`call_graph`. Passes edit through a :class:`Rewriter`, which keeps the
computation's ordered instruction list (the source of truth), its users index and a
log of every edit in step; a :class:`ModuleRewriter` adds the module's header and
computation list and shares one log between the computations a pass edits. The log is
what a pass's ``PassResult.changed`` and ``changes`` come from, what tests read and what
``optimize --explain --verbose`` prints, pass by pass.
"""

from __future__ import annotations

from collections.abc import (Callable, Collection, Generator, Iterable, Iterator, Mapping,
                             Sequence)
import bisect
import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field
import heapq
import itertools
import json
import re
from typing import TypeVar, cast

import networkx as nx

from hlo_shard.ir import (ELEMENT_BITS, ArrayShape, AttrValue, Computation, ComputationList,
                          ComputationRef, Instruction, Module, Shape)
from hlo_shard.opinfo import is_impure as opcode_is_impure

# ------------------------------------------------------------------------ read views


#: Views computed in a :func:`reading_only` block: (view, id of the computation) →
#: (the computation, the view); None outside one.
_READ_ONLY: ContextVar[dict[tuple[str, int], tuple[Computation, object]] | None] = \
    ContextVar("_READ_ONLY", default=None)

_View = TypeVar("_View")


@contextlib.contextmanager
def reading_only() -> Iterator[None]:
    """A block in which no computation is edited: :func:`users_map`,
    :func:`topological_order` and :func:`dataflow_graph` are computed once per
    computation there and shared (pricing a module reads them in every analysis it
    runs). Their results are read-only anyway; within the block they are also shared."""
    if _READ_ONLY.get() is not None:  # within another: share its views
        yield
        return
    token = _READ_ONLY.set({})
    try:
        yield
    finally:
        _READ_ONLY.reset(token)


def read_once(kind: str, comp: Computation, make: Callable[[Computation], _View]) -> _View:
    """``make(comp)``, once per computation and ``kind`` within a :func:`reading_only`
    block (every time outside one): for a fact of a computation that analyses of the
    same module each ask for."""
    views = _READ_ONLY.get()
    if views is None:
        return make(comp)
    key = (kind, id(comp))
    found = views.get(key)
    if found is None or found[0] is not comp:
        found = views[key] = (comp, make(comp))
    return cast(_View, found[1])


@dataclass(frozen=True)
class DataflowGraph:
    """Operand → user edges of one computation, read from its instructions and users
    index (no copy of the graph: building a general graph object of every computation
    cost more than the analyses that walk it)."""

    comp: Computation
    #: Name → its users, each once, in program order (:func:`users_map`).
    users: dict[str, list[str]]

    def successors(self, name: str) -> list[str]:
        """The users of ``name``, each once, in program order."""
        return self.users[name]

    def predecessors(self, name: str) -> Iterable[str]:
        """The operands of ``name``, each once, in operand order."""
        return dict.fromkeys(self.comp[name].operands)

    def descendants(self, name: str) -> set[str]:
        """Every value that depends on ``name`` (not itself)."""
        return reachable((name,), self.successors)

    def edges(self) -> Iterator[tuple[str, str, int]]:
        """(operand, user, operand index) per operand slot: ``multiply(x, x)`` has two."""
        return ((operand, inst.name, index) for inst in self.comp.instructions
                for index, operand in enumerate(inst.operands))


def dataflow_graph(comp: Computation) -> DataflowGraph:
    """Operand → user edges of ``comp`` (read it, do not edit ``comp`` while walking it:
    see :func:`reading_only`)."""
    return DataflowGraph(comp, users_map(comp))


def call_graph(module: Module) -> nx.DiGraph[str]:
    """Computation name → called computation's, edge attribute ``via`` (the calling
    instruction names). Names only: networkx's graph holds reference cycles, and a
    computation in it would wait for the cycle collector with its whole module."""
    graph: nx.DiGraph[str] = nx.DiGraph(name=module.name)
    graph.add_nodes_from(comp.name for comp in module.computations)
    for comp in module.computations:
        for inst in comp.instructions:
            for callee in inst.called_computations():
                if graph.has_edge(comp.name, callee):
                    graph.edges[comp.name, callee]["via"].append(inst.name)
                else:
                    graph.add_edge(comp.name, callee, via=[inst.name])
    return graph


def call_counts(module: Module) -> dict[str, int]:
    """Computation → how many instructions call it (0 for one nothing calls)."""
    counts = dict.fromkeys((comp.name for comp in module.computations), 0)
    for comp in module.computations:
        for inst in comp.instructions:
            for callee in inst.called_computations():
                counts[callee] = counts.get(callee, 0) + 1
    return counts


def reachable(starts: Iterable[str], step: Callable[[str], Iterable[str]]) -> set[str]:
    """Every node one or more ``step``s from any of ``starts`` (``graph.predecessors``:
    their ancestors), in one traversal for all of them."""
    seen: set[str] = set()
    stack = [node for start in starts for node in step(start)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


_Request = TypeVar("_Request")
_Result = TypeVar("_Result")
#: A walk that yields the sub-walks it needs (a callee to analyse) and is sent each one's
#: result: :func:`run_nested`.
NestedWalk = Generator[_Request, _Result, _Result]


def run_nested(first: NestedWalk[_Request, _Result],
               start: Callable[[_Request], NestedWalk[_Request, _Result]]) -> _Result:
    """The result of ``first``, each walk it yields for started with ``start`` and run to
    its end on an explicit stack before the one that asked resumes: an analysis that
    follows calls, loops and branches into their computations this way handles nesting
    deeper than Python's recursion limit as it handles one level."""
    walks = [first]
    sent: _Result | None = None
    while True:
        try:
            request = walks[-1].send(sent)  # type: ignore[arg-type]  # None starts a walk
        except StopIteration as done:
            walks.pop()
            if not walks:
                return cast(_Result, done.value)
            sent = done.value
        else:
            walks.append(start(request))
            sent = None


def upstream_bits(comp: Computation, bits: Mapping[str, int],
                  computed_from: Callable[[Instruction], Iterable[str]] | None = None
                  ) -> dict[str, int]:
    """Per instruction of ``comp``: the union of the ``bits`` of every instruction it
    depends on (not its own), in one pass in def-before-use order — "which of these
    does each value read, directly or not" for all values at once, instead of a walk
    over the ancestors of each. ``computed_from``: the earlier instructions each one
    reads (default: its operands)."""
    below: dict[str, int] = {}
    for inst in topological_order(comp):
        found = 0
        for operand in inst.operands if computed_from is None else computed_from(inst):
            found |= below[operand] | bits.get(operand, 0)
        below[inst.name] = found
    return below


def element_read(comp: Computation, inst: Instruction) -> str | None:
    """The value a ``get-tuple-element`` of a tuple made in ``comp`` reads (that tuple's
    element), or None: a value read back out of a tuple (a ``shard_map``'s outputs) is
    that element, not all of the tuple's."""
    if inst.opcode != "get-tuple-element" or comp[inst.operands[0]].opcode != "tuple":
        return None
    return comp[inst.operands[0]].operands[inst.required_attr("index", int)]


def users_map(comp: Computation) -> dict[str, list[str]]:
    """Name → names of its users, each user once, in program order (read it, do not
    edit it: see :func:`reading_only`)."""
    return read_once("users", comp, _users_map)


def _users_map(comp: Computation) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {inst.name: [] for inst in comp.instructions}
    for inst in comp.instructions:
        operands = inst.operands
        if len(operands) == 1:  # most instructions: no repeats to drop
            users[operands[0]].append(inst.name)
        else:
            for operand in dict.fromkeys(operands):
                users[operand].append(inst.name)
    return users


def control_predecessors(inst: Instruction) -> list[str]:
    """Names in ``control-predecessors={%a, %b}`` (kept as raw text in the IR)."""
    raw = inst.attributes.get("control-predecessors")
    if raw is None:
        return []
    return re.findall(r"%?([A-Za-z_][\w.\-]*)", getattr(raw, "text", str(raw)))


def dependencies(inst: Instruction) -> list[str]:
    """What ``inst`` must come after: its operands, and its control predecessors where it
    has any (for the many without, the operand list itself: read it, do not edit it)."""
    if "control-predecessors" in inst.attributes:
        return [*inst.operands, *control_predecessors(inst)]
    return inst.operands


def topological_order(comp: Computation) -> list[Instruction]:
    """A def-before-use order that keeps the list order wherever it is valid (read it,
    do not edit it: see :func:`reading_only`).

    Kahn's algorithm with a priority on the original position: when the list is
    already valid (the common case) this returns it unchanged.
    """
    return read_once("order", comp, _topological_order)


def _topological_order(comp: Computation) -> list[Instruction]:
    instructions = comp.instructions
    needs_of = [dependencies(inst) for inst in instructions]
    if _in_order(instructions, needs_of):
        return list(instructions)
    placed = _earliest_ready_first([inst.name for inst in instructions], needs_of)
    if len(placed) != len(instructions):
        stuck = set(range(len(instructions))).difference(placed)
        raise DependencyCycle(comp.name, [instructions[i].name for i in sorted(stuck)])
    return [instructions[i] for i in placed]


def _in_order(instructions: list[Instruction], needs_of: list[list[str]]) -> bool:
    """Every instruction's needs come before it in the list (one scan)."""
    seen: set[str] = set()
    for inst, needs in zip(instructions, needs_of):
        if not seen.issuperset(needs):
            return False
        seen.add(inst.name)
    return True


class DependencyCycle(ValueError):
    """A computation whose instructions depend on each other in a cycle (a rewrite's
    bug: a parsed module has none). ``stuck``: the instructions on a cycle or after one,
    in list order."""

    def __init__(self, computation: str, stuck: list[str]) -> None:
        super().__init__(f"computation {computation} has a dependency cycle")
        self.computation, self.stuck = computation, stuck


def stable_topological_sort(order: list[str], deps: dict[str, set[str]]) -> list[str]:
    """Kahn's algorithm that always takes the ready node earliest in ``order``, so an
    order that already respects ``deps`` comes back unchanged. Nodes on a cycle are left
    out (callers compare lengths)."""
    needs_of = [deps.get(name, set()) for name in order]
    return [order[i] for i in _earliest_ready_first(order, needs_of)]


def _earliest_ready_first(names: Sequence[str], needs_of: Sequence[Collection[str]]
                          ) -> list[int]:
    """Positions in ``names`` in Kahn's order taking the earliest ready node first
    (``needs_of[i]``: the names node ``i`` needs placed before it, repeats allowed; a
    name not in ``names`` is a KeyError); nodes on a cycle or after one are left out.

    One scan in list order: a node whose needs are placed when the scan reaches it is
    placed there, unless one waiting before it became ready first (those wait on a heap
    and always come first, being earlier); only the nodes that wait pay for the heap,
    so a list that is valid, or nearly, costs one pass."""
    placed: set[str] = set()
    #: Name not placed yet → the waiting nodes that need it (once per need).
    waiting: dict[str, list[int]] = {}
    remaining: dict[int, int] = {}
    ready: list[int] = []
    result: list[int] = []

    def place(i: int) -> None:
        result.append(i)
        placed.add(names[i])
        for user in waiting.pop(names[i], ()):
            remaining[user] -= 1
            if remaining[user] == 0:
                heapq.heappush(ready, user)

    for i, needs in enumerate(needs_of):
        while ready:
            place(heapq.heappop(ready))
        if placed.issuperset(needs):
            place(i)
            continue
        missing = [need for need in needs if need not in placed]
        for need in missing:
            waiting.setdefault(need, []).append(i)
        remaining[i] = len(missing)
    while ready:
        place(heapq.heappop(ready))
    if len(result) < len(names):
        known = set(names)
        unknown = next((need for need in waiting if need not in known), None)
        if unknown is not None:
            raise KeyError(unknown)
    return result


def callees_first(module: Module) -> list[Computation]:
    """Computations ordered so that every callee precedes its callers, keeping the
    module's order where it already is: the earliest ready computation first (one scan,
    without building a call graph, when every name is unique and every callee defined)."""
    comps = module.computations
    names = [comp.name for comp in comps]
    needs_of = [[callee for inst in comp.instructions for callee in inst.called_computations()]
                for comp in comps]
    known = set(names)
    if len(known) == len(names) and all(known.issuperset(needs) for needs in needs_of):
        placed = _earliest_ready_first(names, needs_of)
        if len(placed) == len(names):
            return [comps[i] for i in placed]
    # A call cycle, an undefined callee or a repeated name: networkx's order or error.
    graph = call_graph(module)
    position = {comp.name: i for i, comp in enumerate(module.computations)}
    order = nx.lexicographical_topological_sort(graph.reverse(copy=False), key=position.get)
    by_name = {comp.name: comp for comp in comps}
    return [by_name[name] for name in order]


# ------------------------------------------------------------------------- rewriting

#: Identifiers XLA's lexer reserves: an instruction may not be named like these.
_RESERVED_NAMES = frozenset(ELEMENT_BITS) | {
    "opaque_type", "true", "false", "inf", "nan", "ENTRY", "ROOT", "HloModule",
    "maximal", "replicated", "manual",
}


@dataclass(frozen=True, slots=True)
class Change:
    """One edit of a :class:`Rewriter` or :class:`ModuleRewriter`: ``kind`` is the name
    of the method that made it (``insert``, ``erase``, ``replace-uses``, ``set-root``,
    ``set-operand``, ``set-operands``, ``set-opcode``, ``set-shape``, ``set-attr``,
    ``pop-attr``, ``reorder``; ``set-header``, ``pop-header``, ``insert-computation``,
    ``remove-computation``), ``name`` the instruction (the computation for ``reorder``
    and the computation-list edits, the key for a header edit), ``computation`` where it
    happened ("" for the module's header and computation list). ``before``/``after``
    keep the values a ``set-*``/``pop-*`` edit replaced and wrote, for a reader to
    print (``hlo_shard.printer`` formats them; this layer does not print)."""

    kind: str
    name: str
    detail: str = ""
    computation: str = ""
    before: Shape | AttrValue | None = None
    after: Shape | AttrValue | None = None


def is_impure(inst: Instruction) -> bool:
    """The default of :meth:`Rewriter.remove_dead`: parameters (the signature) and ops
    the opcode table marks impure (:data:`hlo_shard.opinfo.IMPURE`: sends, receives,
    feeds, custom calls, rng state, async halves, ordering tokens, opt-barrier)."""
    return inst.opcode == "parameter" or opcode_is_impure(inst.opcode)


def _index_uses(users: dict[str, dict[str, list[int]]], inst: Instruction) -> None:
    """Add ``inst``'s uses of its operands to a users index (:attr:`Rewriter._users_index`)."""
    for index, operand in enumerate(inst.operands):
        users[operand].setdefault(inst.name, []).append(index)


@dataclass
class Rewriter:
    """Edits one computation, keeping the instruction list, the users index and the
    change log consistent (the torch.fx editing vocabulary on HLO records). Every edit
    of an instruction a pass makes goes through one of its methods, so that
    :attr:`changes` is the whole story: whether anything changed, and what (an edit
    that leaves a value as it was is not recorded)."""

    comp: Computation
    changes: list[Change] = field(default_factory=list)
    #: Name → its users, in program order, each with where it reads the name in its
    #: operand list (MLIR's use lists: a user leaves, and a use moves, without a scan of
    #: its operands, so pointing the S slots of a root tuple elsewhere one by one is
    #: linear in S), and the names in use: read from the computation at the first
    #: query or edit (:meth:`_indexed`), so a pass that looks at a computation and finds
    #: nothing to do there pays nothing for them.
    _users_index: dict[str, dict[str, list[int]]] | None = field(init=False, default=None)
    _taken_names: set[str] | None = field(init=False, default=None)
    #: Where the last position lookup found its instruction (see :meth:`_position`).
    _hint: int = field(init=False, default=0)
    _cursor: int | None = field(init=False, default=None)
    #: Cursors of the enclosing ``inserting_*`` blocks, kept in step with every edit.
    _saved: list[int | None] = field(init=False, default_factory=list)
    #: Stem → the first ``N`` :meth:`fresh_name` has not found taken yet: names are only
    #: ever added to :attr:`_taken`, so the numbers below it stay taken, and a pass adding
    #: thousands of ``reshape.N`` does not test every earlier number each time.
    _next_number: dict[str, int] = field(init=False, default_factory=dict)

    def _indexed(self) -> tuple[dict[str, dict[str, list[int]]], set[str]]:
        """The users index and the names in use, read from the computation the first
        time (every edit asks before it changes anything: they describe the
        computation as this rewriter found it, then each edit)."""
        if self._users_index is None or self._taken_names is None:
            instructions = self.comp.instructions
            users: dict[str, dict[str, list[int]]] = {inst.name: {} for inst in instructions}
            for inst in instructions:
                _index_uses(users, inst)
            self._users_index, self._taken_names = users, set(users)
        return self._users_index, self._taken_names

    @property
    def _users(self) -> dict[str, dict[str, list[int]]]:
        return self._indexed()[0]

    @property
    def _taken(self) -> set[str]:
        return self._indexed()[1]

    def _record(self, kind: str, name: str, detail: str = "", *,
                before: Shape | AttrValue | None = None,
                after: Shape | AttrValue | None = None) -> None:
        self.changes.append(Change(kind, name, detail, self.comp.name, before, after))

    # Queries -------------------------------------------------------------------------
    def users(self, name: str) -> list[Instruction]:
        return [self.comp[u] for u in self._users[name]]

    def is_used(self, name: str) -> bool:
        """Whether an instruction reads ``name`` (without listing them: a tuple taken
        apart element by element asks after each element)."""
        return bool(self._users[name])

    def operands(self, inst: Instruction) -> list[Instruction]:
        return self.comp.operands_of(inst)

    def _position(self, name: str) -> int:
        """Where ``name`` is in the instruction list, searched from where the last
        lookup found its instruction, then before it: a pass edits mostly in program
        order, so its lookups together scan the list about once, not once each."""
        inst = self.comp[name]
        instructions = self.comp.instructions
        if instructions and instructions[-1] is inst:  # the root, usually
            return len(instructions) - 1
        try:
            found = instructions.index(inst, self._hint)
        except ValueError:
            try:
                found = instructions.index(inst, 0, self._hint)
            except ValueError:
                return self.comp.position(name)  # a list edited without reindex()
        self._hint = found
        return found

    def fresh_name(self, base: str) -> str:
        """A name unused in this computation, derived from ``base`` (``base.N``)."""
        stem = re.sub(r"[^\w.\-]", "_", base.lstrip("%")) or "v"
        if not re.match(r"[A-Za-z_]", stem):
            stem = f"v{stem}"
        stem = re.sub(r"\.\d+$", "", stem)
        for n in itertools.count(self._next_number.get(stem, 1)):
            candidate = f"{stem}.{n}"
            if candidate not in self._taken and candidate not in _RESERVED_NAMES:
                self._taken.add(candidate)
                self._next_number[stem] = n + 1
                return candidate
        raise AssertionError("unreachable")

    # Insertion -----------------------------------------------------------------------
    def insert_before(self, anchor: str, inst: Instruction) -> Instruction:
        return self._insert(self._position(anchor), inst)

    def inserting_after(self, anchor: str) -> contextlib.AbstractContextManager[None]:
        """Within the block, :meth:`add` inserts in sequence right after ``anchor``."""
        return self._inserting_at(self._position(anchor) + 1)

    def inserting_before(self, anchor: str) -> contextlib.AbstractContextManager[None]:
        return self._inserting_at(self._position(anchor))

    @contextlib.contextmanager
    def _inserting_at(self, position: int) -> Iterator[None]:
        self._saved.append(self._cursor)
        self._cursor = position
        try:
            yield
        finally:
            self._cursor = self._saved.pop()

    def add(self, opcode: str, shape: Shape, operands: Iterable[str] = (), *, name: str | None = None,
            **attributes: AttrValue) -> Instruction:
        """Create an instruction (fresh name from ``name`` or the opcode) at the current
        insertion point (end of the computation, before the root, when none is set)."""
        inst = Instruction(
            name=self.fresh_name(name or opcode), opcode=opcode, shape=shape,
            operands=list(operands), attributes=dict(attributes),
        )
        return self.add_instruction(inst)

    def add_instruction(self, inst: Instruction) -> Instruction:
        self._taken.add(inst.name)
        if self._cursor is None:
            return self._insert(self._position(self.comp.root.name), inst)
        inserted = self._insert(self._cursor, inst)
        self._cursor += 1
        return inserted

    def _insert(self, position: int, inst: Instruction) -> Instruction:
        self._indexed()
        self.comp.insert(position, inst)
        self._taken.add(inst.name)
        self._users[inst.name] = {}
        _index_uses(self._users, inst)
        if self._cursor is not None and position < self._cursor:
            self._cursor += 1
        # An enclosing block continues after whatever was inserted at or before it.
        self._saved = [c + 1 if c is not None and position <= c else c for c in self._saved]
        self._record("insert", inst.name, inst.opcode)
        return inst

    # Use replacement ----------------------------------------------------------------
    def set_operand(self, user: Instruction, index: int, new: str) -> None:
        """Point operand ``index`` of ``user`` at ``new``."""
        users = self._users
        old = user.operands[index]
        positions = users[old][user.name]
        positions.remove(index)
        if not positions:
            del users[old][user.name]
        user.operands[index] = new
        bisect.insort(users[new].setdefault(user.name, []), index)
        self._record("set-operand", user.name, f"{index}: %{old} -> %{new}")

    def set_operands(self, user: Instruction, names: Iterable[str]) -> None:
        """Replace the whole operand list of ``user`` (any length)."""
        self._indexed()
        names = list(names)
        for operand in dict.fromkeys(user.operands):
            del self._users[operand][user.name]
        user.operands = names
        _index_uses(self._users, user)
        self._record("set-operands", user.name, ", ".join(f"%{n}" for n in names))

    def replace_all_uses_with(self, old: str, new: str, *, exclude: Iterable[str] = ()) -> None:
        """Point every user of ``old`` (except ``exclude``) at ``new``; moves the root
        too when ``old`` was the root."""
        skip = set(exclude) | {new}
        users = self._users
        for user_name in [u for u in users[old] if u not in skip]:
            positions = users[old].pop(user_name)
            operands = self.comp[user_name].operands
            for index in positions:
                operands[index] = new
            moved = users[new].setdefault(user_name, [])
            moved.extend(positions)
            moved.sort()
        if self.comp.root_name == old and self.comp.root_name not in set(exclude):
            self.set_root(new)
        self._record("replace-uses", old, new)

    def set_root(self, name: str) -> None:
        self.comp.root_name = name
        self._record("set-root", name)

    # Instruction edits ---------------------------------------------------------------
    def set_opcode(self, inst: Instruction, opcode: str) -> None:
        """Turn ``inst`` into another op under the same name (its users are unchanged)."""
        if opcode != inst.opcode:
            self._record("set-opcode", inst.name, f"{inst.opcode} -> {opcode}")
            inst.opcode = opcode

    def set_shape(self, inst: Instruction, shape: Shape) -> None:
        if shape != inst.shape:
            self._record("set-shape", inst.name, before=inst.shape, after=shape)
            inst.shape = shape

    def set_attr(self, inst: Instruction, key: str, value: AttrValue) -> None:
        """Set attribute ``key`` (a new key prints last, as XLA's printer adds it);
        recorded only when the value changes."""
        old = inst.attributes.get(key)
        if key in inst.attributes and type(old) is type(value) and old == value:
            return
        inst.attributes[key] = value
        self._record("set-attr", inst.name, key, before=old, after=value)

    def pop_attr(self, inst: Instruction, key: str,
                 default: AttrValue | None = None) -> AttrValue | None:
        """Remove attribute ``key``; recorded only when it was there."""
        if key not in inst.attributes:
            return default
        value = inst.attributes.pop(key)
        self._record("pop-attr", inst.name, key, before=value)
        return value

    def reorder(self, order: Iterable[Instruction]) -> None:
        """Put the instructions in ``order`` (the same instructions, e.g. a topological
        order); recorded when the order differs. Not inside an ``inserting_*`` block,
        whose position would lose its meaning."""
        self._put_in_order(list(order), checked=False)

    def _put_in_order(self, order: list[Instruction], *, checked: bool = True) -> None:
        """:meth:`reorder`; ``checked``: ``order`` is known to hold the same
        instructions (a topological order of them)."""
        if self._cursor is not None or self._saved:
            raise ValueError("cannot reorder inside an inserting_* block")
        if not checked and (len(order) != len(self.comp.instructions) or
                            {id(i) for i in order} != {id(i) for i in self.comp.instructions}):
            raise ValueError(f"reorder of {self.comp.name} must keep the same instructions")
        self._indexed()
        if all(a is b for a, b in zip(order, self.comp.instructions)):
            return
        self.comp.instructions[:] = order
        self._record("reorder", self.comp.name)

    def sort_topologically(self) -> None:
        """Restore def-before-use after edits that broke it (see
        :func:`topological_order`: a valid order is kept)."""
        self._put_in_order(topological_order(self.comp))

    # Removal --------------------------------------------------------------------------
    def erase(self, name: str) -> None:
        """Remove an instruction that has no users and is not the root (torch.fx's
        ``erase_node``: erasing a used value is a bug in the pass, not a request)."""
        if self._users[name]:
            raise ValueError(f"cannot erase {name}: still used by {list(self._users[name])}")
        if name == self.comp.root_name:
            raise ValueError(f"cannot erase the root {name}")
        position = self._position(name)
        self._unlink(name)
        self.comp.remove(name, position)
        self._shift_cursors([position])

    def _unlink(self, name: str) -> None:
        """Erase ``name`` from the users index and record it; the caller takes it out of
        the instruction list."""
        inst = self.comp[name]
        for operand in dict.fromkeys(inst.operands):
            del self._users[operand][name]
        del self._users[name]
        self._record("erase", name, inst.opcode)

    def _shift_cursors(self, erased: list[int]) -> None:
        """Move the insertion points past the erased positions (of the list before)."""
        def shifted(cursor: int | None) -> int | None:
            return None if cursor is None else cursor - sum(1 for p in erased if p < cursor)
        self._cursor = shifted(self._cursor)
        self._saved = [shifted(c) for c in self._saved]

    def remove_dead(self, keep: Iterable[str] = (), *,
                    is_impure: Callable[[Instruction], bool] = is_impure,
                    among: Iterable[str] | None = None) -> int:
        """Erase every instruction whose value is never used, users first, except the
        root, control predecessors, ``keep`` and what ``is_impure`` says must stay (by
        default :func:`is_impure`). ``among``: only these and the operands their erasure
        leaves unused (a rewrite clearing what it replaced, not what the input left
        dead). Sweeps until nothing more goes, so an order that is not yet def-before-use
        loses its dead values too. Returns how many were erased."""
        users = self._indexed()[0]
        instructions = self.comp.instructions
        protected = set(keep) | {self.comp.root_name}
        for inst in instructions:
            if "control-predecessors" in inst.attributes:
                protected.update(control_predecessors(inst))
        #: Where each instruction stands: a sweep takes its names latest first.
        rank = {inst.name: i for i, inst in enumerate(instructions)}
        pending = set(rank) if among is None else set(among)
        erased: set[str] = set()
        while pending:
            sweep = sorted((name for name in pending if name in rank and name not in erased),
                           key=rank.__getitem__, reverse=True)
            pending = set()
            erased_before = len(erased)
            for name in sweep:
                inst = self.comp[name]
                if name in protected or users[name] or is_impure(inst):
                    continue
                self._unlink(name)
                erased.add(name)
                pending.update(inst.operands)
            if len(erased) == erased_before:
                break
        if erased:  # they leave the list at once (one pass, not one each)
            self._shift_cursors([i for i, inst in enumerate(instructions) if inst.name in erased]
                                if self._cursor is not None or self._saved else [])
            instructions[:] = [inst for inst in instructions if inst.name not in erased]
            self.comp.reindex()
        return len(erased)


@dataclass
class ModuleRewriter:
    """Edits one module: its header and computation list here, each computation
    through the one :class:`Rewriter` :meth:`rewriter` makes for it, all recorded in
    the one log :attr:`changes` in edit order. A pass run is handed one (xDSL's
    ``PatternRewriter``; ``passes.base.run_pass``) and its log becomes the run's
    ``PassResult.changes``."""

    module: Module
    changes: list[Change] = field(default_factory=list)
    _rewriters: dict[str, Rewriter] = field(init=False, default_factory=dict)
    #: Where :meth:`insert_computation` finds its anchors (:class:`_ListPositions`), made
    #: at its first insert.
    _positions: _ListPositions | None = field(init=False, default=None)

    def rewriter(self, comp: Computation) -> Rewriter:
        """The Rewriter of ``comp`` (one per computation, so users indexes agree),
        logging into :attr:`changes`."""
        rw = self._rewriters.get(comp.name)
        if rw is None or rw.comp is not comp:
            rw = self._rewriters[comp.name] = Rewriter(comp, self.changes)
        return rw

    def forget(self, comp: Computation, since: int) -> None:
        """After the caller put ``comp`` (and the computation list) back as they were
        when the log was ``since`` entries long — an attempt undone from its snapshot:
        the log's entries since go, and so does ``comp``'s Rewriter, whose users index
        and names in use describe the attempt (the next :meth:`rewriter` reads ``comp``
        afresh)."""
        del self.changes[since:]
        self._rewriters.pop(comp.name, None)

    def set_header(self, key: str, value: AttrValue, *, replacing: str | None = None) -> None:
        """Set header attribute ``key``, recorded when its value changes. A new key
        prints last; with ``replacing`` (a key that is there) it takes that key's place
        in print order instead, and that key goes."""
        header = self.module.header
        if replacing is not None and replacing != key and replacing in header:
            self.pop_header(key)
            replaced = header[replacing]
            items = [(key, value) if k == replacing else (k, v) for k, v in header.items()]
            header.clear()
            header.update(items)
            self.changes.append(Change("pop-header", replacing, before=replaced))
            self.changes.append(Change("set-header", key, after=value))
            return
        old = header.get(key)
        if key in header and type(old) is type(value) and old == value:
            return
        header[key] = value
        self.changes.append(Change("set-header", key, before=old, after=value))

    def pop_header(self, key: str) -> AttrValue | None:
        """Remove header attribute ``key`` (None when absent); recorded when it was there."""
        if key not in self.module.header:
            return None
        value = self.module.header.pop(key)
        self.changes.append(Change("pop-header", key, before=value))
        return value

    def remove_computations(self, names: list[str]) -> None:
        """Remove the computations ``names`` (nothing may call them: the caller knows)."""
        gone = set(names)
        self.module.set_computations([c for c in self.module.computations if c.name not in gone])
        for name in names:
            self._rewriters.pop(name, None)
            self.changes.append(Change("remove-computation", name))

    def insert_computation(self, comp: Computation, *, after: str) -> None:
        """Add ``comp`` (a new computation, e.g. a fusion body's sharded copy) right
        after the computation named ``after``."""
        if self.module.has_computation(comp.name):
            raise ValueError(f"duplicate computation name {comp.name!r}")
        anchor = self.module.computation(after)
        if self._positions is None or not self._positions.tracks(self.module.computations):
            self._positions = _ListPositions(self.module.computations)
        position = self._positions.index(anchor) + 1
        self.module.insert_computation(position, comp)
        self._positions.inserted(comp, anchor)
        self.changes.append(Change("insert-computation", comp.name, f"after {after}"))


class _ListPositions:
    """Positions in a list of computations that grows by inserts right after a member
    (:meth:`ModuleRewriter.insert_computation`), without scanning the list for each: a
    member of the list as it was at the start is at its first index plus the inserts
    made after members before it (a Fenwick tree of inserts per first index: O(log n)
    per insert and lookup); an inserted one is searched for from its group's start, past
    the inserts made after the same member. Every position is checked against the list
    (one identity test) and searched for from the start where it is wrong: the list was
    edited otherwise (put back, cut down), and the caller starts afresh (:meth:`tracks`)."""

    def __init__(self, items: list[Computation]) -> None:
        self._items = items
        self._length = len(items)
        #: Computation (by identity) → the first index of the member it was inserted
        #: after (its own, for a member of the list at the start).
        self._slot = {id(item): k for k, item in enumerate(items)}
        self._first = set(self._slot)
        self._tree = [0] * (len(items) + 1)
        self._inserts = 0
        self._lost = False

    def tracks(self, items: list[Computation]) -> bool:
        """``items`` is the list followed, only grown by :meth:`inserted` since."""
        return not self._lost and items is self._items and \
            len(items) == self._length + self._inserts

    def index(self, item: Computation) -> int:
        slot = self._slot.get(id(item))
        if slot is not None:
            start = slot + self._before(slot)
            if id(item) in self._first:
                if start < len(self._items) and self._items[start] is item:
                    return start
            else:  # after its member, among the inserts made after that member
                try:
                    return self._items.index(item, start)
                except ValueError:
                    pass
        return self._items.index(item)

    def inserted(self, item: Computation, after: Computation) -> None:
        """``item`` was inserted right after ``after``."""
        slot = self._slot.get(id(after))
        if slot is None:  # after a computation not followed: start afresh
            self._lost = True
            return
        self._slot[id(item)] = slot
        self._inserts += 1
        k = slot + 2  # (kept at slot + 1: it counts for the members past ``slot``)
        while k < len(self._tree):
            self._tree[k] += 1
            k += k & -k

    def _before(self, slot: int) -> int:
        """Inserts made after members at first indexes below ``slot`` (the tree's sum
        through ``slot + 1``, where an insert after member ``s`` is kept at ``s + 2``)."""
        total, k = 0, slot + 1
        while k > 0:
            total += self._tree[k]
            k -= k & -k
        return total


def scalar_literal(comp: Computation, inst: Instruction) -> int | float | None:
    """The value of a numeric scalar constant, or of a broadcast of one (None: anything
    else, a non-finite value included)."""
    if inst.opcode == "broadcast" and len(inst.operands) == 1:
        inst = comp[inst.operands[0]]
    if inst.opcode != "constant" or not isinstance(inst.shape, ArrayShape) \
            or not inst.shape.is_scalar or inst.literal is None:
        return None
    try:
        value = json.loads(inst.literal)
    except ValueError:
        return None
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def is_zero(comp: Computation, inst: Instruction) -> bool:
    """A scalar constant zero, or a broadcast of one."""
    value = scalar_literal(comp, inst)
    return value is not None and value == 0


def starts_at_zero(module: Module, comp: Computation, start: Instruction) -> bool:
    """``start`` (in ``comp``) is zeros: :func:`is_zero`, through copies, or XLA's fused
    form of that broadcast (a fusion of the scalar whose fused computation broadcasts its
    parameter, as XLA leaves an accumulator's zero start after fusion): what every pass
    and the cost model read as a loop's accumulator starting at zero, in a module before
    XLA's fusion and in one after it alike."""
    while start.opcode == "copy":
        start = comp[start.operands[0]]
    if start.opcode == "fusion" and len(start.operands) == 1:
        fused = module.computation(start.called("calls"))
        root = fused.root
        if root.opcode == "broadcast" and fused[root.operands[0]].opcode == "parameter":
            start = comp[start.operands[0]]
    return is_zero(comp, start)


def zero_started_slots(module: Module, comp: Computation, loop: Instruction) -> set[int]:
    """The carried slots of ``while`` ``loop`` (in ``comp``) that start at zero
    (:func:`starts_at_zero`): where a scan or ``fori_loop`` accumulates."""
    init = comp[loop.operands[0]] if loop.operands else None
    if init is None or init.opcode != "tuple":
        return set()
    return {k for k, start in enumerate(init.operands)
            if starts_at_zero(module, comp, comp[start])}


#: The attributes of a dot :func:`add_transposed_product` computes the other way round:
#: one contracting dimension per operand and nothing else that names an operand.
_PLAIN_DOT_ATTRIBUTES = frozenset({"lhs_contracting_dims", "rhs_contracting_dims", "metadata"})


def is_transposable_product(comp: Computation, inst: Instruction, users: Sequence[object]
                            ) -> bool:
    """``inst`` is a product ``a·b`` of two matrices into a dense row-major matrix, read
    by its one user (``users``) and ordered by no control edge: computed as ``b·a`` it is
    its own transpose, each element the same products summed over the same contraction,
    where a transpose of the result would be one more pass over its bytes."""
    shape = inst.shape
    return inst.opcode == "dot" and len(users) == 1 and \
        not set(inst.attributes) - _PLAIN_DOT_ATTRIBUTES and \
        {"lhs_contracting_dims", "rhs_contracting_dims"} <= set(inst.attributes) and \
        not control_predecessors(inst) and isinstance(shape, ArrayShape) and \
        shape.rank == 2 and shape.is_row_major and not any(shape.dynamic) and \
        (shape.layout is None or not shape.layout.tail) and \
        all(comp[o].array_shape.rank == 2 for o in inst.operands)


def add_transposed_product(rw: Rewriter, inst: Instruction, shape: ArrayShape, name: str
                           ) -> str:
    """The transpose of ``inst`` (:func:`is_transposable_product`), of ``shape``,
    computed as the product of its operands the other way round; its name."""
    lhs, rhs = inst.operands
    attributes = {"lhs_contracting_dims": inst.attributes["rhs_contracting_dims"],
                  "rhs_contracting_dims": inst.attributes["lhs_contracting_dims"],
                  **{k: v for k, v in inst.attributes.items() if k == "metadata"}}
    return rw.add("dot", shape, [rhs, lhs], name=name, **attributes).name


@dataclass(frozen=True, slots=True, eq=False)
class FusedStructure:
    """:func:`fused_structure`'s key, its hash computed once (a dict looks it up often,
    and a tuple's hash is not kept)."""

    parts: tuple
    digest: int

    def __hash__(self) -> int:
        return self.digest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FusedStructure) and self.digest == other.digest and \
            self.parts == other.parts


def fused_structure(fusion: Instruction, fused: Computation) -> FusedStructure | None:
    """All an analysis of ``fusion`` can read of it, for fusions alike to share one
    result (the cost model's price, the weight-update analysis's element orders): its
    shape and kind, and per instruction of ``fused`` its opcode, shape, operands (by
    position), parameter number, literal and attributes (typed: ``true`` is not ``1``).
    None where that is not all: ``fused`` calls a computation (an analysis reads that
    one's too), repeats a name or uses a value before defining it, or a value cannot be
    hashed."""
    position: dict[str, int] = {}
    parts = []
    for index, inst in enumerate(fused.instructions):
        if inst.name in position:
            return None
        try:
            operands = tuple(map(position.__getitem__, inst.operands))
        except KeyError:
            return None
        position[inst.name] = index
        attributes = inst.attributes
        values = tuple(attributes.values())
        kinds = tuple(map(type, values))  # (read once: whether it calls, and the key's)
        if ComputationRef in kinds or ComputationList in kinds:
            return None
        parts.append((inst.opcode, inst.shape, operands, inst.parameter_number, inst.literal,
                      tuple(attributes), kinds, values))
    root = position.get(fused.root_name) if fused.root_name is not None else None
    if root is None:
        return None
    kind = fusion.attributes.get("kind")
    key = (fusion.shape, type(kind), kind, root, tuple(parts))
    try:
        return FusedStructure(key, hash(key))
    except TypeError:
        return None
