"""Which values are identical on every device of the data-parallel group.

The rewrite slices a value locally (``dynamic-slice`` at the device's shard offset) only
when every device of the group holds the same value; slicing a per-device value would mix
different devices' data. This analysis proves it, conservatively:

* entry parameters: SPMD form — the parameter's ``sharding`` (``{replicated}`` or a tiling
  whose replicated sub-groups contain each data-parallel group → replicated; any other tiling,
  ``maximal``, ``manual`` → per-device); replica form — ``parameter_replication`` when present,
  else :func:`default_parameter_replication`; user flags override both;
* constants and iota; all-reduce / all-gather results over groups covering the target group;
* deterministic ops over replicated operands (rule tables in :mod:`.opcodes`);
* never anything depending on ``replica-id``/``partition-id``, RNG, infeed, custom-call or a
  collective whose result differs per device; unknown opcodes count as per-device.

While loops are solved by a fixpoint over the carry, calls and fusions by analysing the
callee with the caller's operand facts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field


from hlo_shard.analysis.collectives import DeviceGroups, GroupMode, device_groups, UnsupportedGroups
from hlo_shard.graph import (DataflowGraph, NestedWalk, dataflow_graph, reachable, run_nested,
                             topological_order)
from hlo_shard.ir import (ArrayShape, Computation, ComputationRef, Instruction, Module, Raw,
                          Shape, TupleShape)
from hlo_shard.opinfo import (CALLS_ONCE, CONTROL_FLOW, DATA_MOVEMENT, DETERMINISTIC_OPS,
                              ELEMENTWISE, FORWARDING, OPINFO, PER_DEVICE, PER_ELEMENT,
                              REPLICATING_COLLECTIVES, VIEWS, opcodes_where, with_async_forms)

#: Replication of a value: one bool for an array, a tuple (per element) for a tuple.
Flags = bool | tuple


def uniform(shape: Shape, flag: bool) -> Flags:
    if isinstance(shape, TupleShape):
        return tuple(uniform(e, flag) for e in shape.elements)
    return flag


def all_true(flags: Flags) -> bool:
    if isinstance(flags, tuple):
        return all(all_true(f) for f in flags)
    return flags


def meet(a: Flags, b: Flags) -> Flags:
    """Elementwise AND of two flag trees of the same structure."""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(meet(x, y) for x, y in zip(a, b))
    return all_true(a) and all_true(b)


@dataclass(frozen=True)
class ParamOverrides:
    """``--replicated-params`` / ``--per-device-params`` (entry parameter numbers), and
    ``pmap_replicated`` (``install(pmap_replicated=True)``): a ``jax.pmap`` step's
    stacked weights and optimizer state hold the same copy on every device (as
    ``flax.jax_utils.replicate`` makes them), so the dataflow default may tell them from
    the batch (:func:`is_pmap_form`). Without it a pmap step's parameters are per-device:
    its module cannot say whether the copies are equal, and sharding the update of
    copies that differ would mix them."""

    replicated: frozenset[int] = frozenset()
    per_device: frozenset[int] = frozenset()
    pmap_replicated: bool = False


@dataclass(frozen=True)
class ParamReplication:
    number: int
    flags: Flags
    #: Where the fact came from: "flag", "sharding", "parameter_replication", "pmap",
    #: "analysis".
    source: str


@dataclass
class Replication:
    """Per computation, per instruction: its replication flags."""

    values: dict[str, dict[str, Flags]] = field(default_factory=dict)
    params: list[ParamReplication] = field(default_factory=list)

    def flags(self, comp: str, name: str) -> Flags:
        return self.values.get(comp, {}).get(name, False)

    def is_replicated(self, comp: str, name: str) -> bool:
        return all_true(self.flags(comp, name))


# ------------------------------------------------------------------ entry parameters


def _sharding_flags(text: str, shape: Shape, target: list[frozenset[int]] | None) -> Flags | None:
    """Flags from an SPMD ``sharding={...}`` text, or None when it says nothing usable."""
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1].strip()
    if body.startswith("{"):  # tuple sharding {{a}, {b}}
        parts = _split_top_level(body)
        if isinstance(shape, TupleShape) and len(parts) == len(shape.elements):
            leaves = [_sharding_flags(p, e, target) for p, e in zip(parts, shape.elements)]
            return tuple(False if f is None else f for f in leaves)
        return None
    if body.startswith("replicated"):
        return uniform(shape, True)
    if body.startswith(("maximal", "manual", "unknown", "unreduced")):
        return uniform(shape, False)
    if body.startswith("devices="):
        sets = replicated_tile_sets(body)
        if sets is None or target is None:
            return uniform(shape, False)
        return uniform(shape, all(any(g <= s for s in sets) for g in target))
    return None


def _split_top_level(body: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(body):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    return parts


def replicated_tile_sets(body: str) -> list[frozenset[int]] | None:
    """Device sets that hold the same tile, from ``devices=[d…]ids [last_tile_dim_replicate]``."""
    import numpy as np

    match = re.match(r"devices=\[([\d,]+)\]\s*(<=\[([\d,]+)\](?:T\(([\d,]+)\))?|[\d,\s]+)", body)
    if not match:
        return None
    tile = [int(d) for d in match.group(1).split(",")]
    if match.group(3):
        dims = [int(d) for d in match.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if match.group(4):
            ids = ids.transpose([int(p) for p in match.group(4).split(",")])
        ids = ids.reshape(tile)
    else:
        ids = np.array([int(d) for d in match.group(2).replace(" ", "").split(",") if d])
        if ids.size != int(np.prod(tile)):
            return None
        ids = ids.reshape(tile)
    replicated_dims = 0
    if "last_tile_dim_replicate" in body:
        replicated_dims = 1
    elif (subgroups := re.search(r"last_tile_dims=\{([^}]*)\}", body)):
        kinds = [k.strip() for k in subgroups.group(1).split(",")]
        if any(k != "replicated" for k in kinds):
            return None
        replicated_dims = len(kinds)
    data_tiles = int(np.prod(tile[:len(tile) - replicated_dims]))
    return [frozenset(int(d) for d in row) for row in ids.reshape(data_tiles, -1)]


def _parameter_replication_attr(inst: Instruction) -> Flags | None:
    value = inst.attr("parameter_replication")
    if value is None:
        return None
    if isinstance(value, Raw):
        bools = [w == "true" for w in re.findall(r"true|false", value.text)]
    elif isinstance(value, tuple):
        bools = [bool(v) for v in value]
    else:
        bools = [bool(value)]
    leaves = list(_leaf_count_iter(inst.shape))
    if len(bools) == 1:
        return uniform(inst.shape, bools[0])
    if len(bools) != len(leaves):
        return None
    it = iter(bools)
    return _rebuild(inst.shape, it)


def _leaf_count_iter(shape: Shape) -> Iterator[Shape]:
    if isinstance(shape, TupleShape):
        for e in shape.elements:
            yield from _leaf_count_iter(e)
    else:
        yield shape


def _rebuild(shape: Shape, it: Iterator[Flags]) -> Flags:
    if isinstance(shape, TupleShape):
        return tuple(_rebuild(e, it) for e in shape.elements)
    return next(it)


#: Ops whose value differs per device or is not a function of the operands.
DEVICE_DEPENDENT = opcodes_where(lambda info: info.values == PER_DEVICE)

#: The ``-done`` halves whose value is what their start computed: a replicating
#: collective's, or an async copy's.
_DONE_AS_STARTED = frozenset(name for name in with_async_forms(REPLICATING_COLLECTIVES | VIEWS)
                             if OPINFO[name].is_async_done)
#: Ops whose flags are their callees' (:meth:`_Analyzer._calling`).
_CALLING = CALLS_ONCE | CONTROL_FLOW

#: Ops a parameter's value flows through "elementwise" in the default analysis.
_FLOW_THROUGH = PER_ELEMENT | DATA_MOVEMENT


def default_parameter_replication(module: Module, sources: dict[str, set[str]]
                                  ) -> dict[int, bool]:
    """Replica-form default (no ``parameter_replication``): which entry parameters are
    per-device batch data.

    ``sources`` maps a computation to its instructions producing all-reduced gradients
    (the all-reduces, or loops/calls containing them). A parameter is *per-device* when
    it is an ancestor of one of them and none of its elementwise/data-movement successors
    (followed into training-loop bodies through the carry) is combined with an
    all-reduced value — batch data reaches the gradient only through dot/convolution/
    gather work. Everything else (weights and optimizer state, which meet the reduced
    gradient elementwise in the update; step counters; unused inputs) is replicated.
    """
    entry = module.entry
    meeting = _GradientMeeting(module, sources)
    graph, _ = meeting.view(entry)
    upstream = reachable(sources.get(entry.name, ()), graph.predecessors)
    meets = meeting.meets(entry)
    return {p.param_number: p.name not in upstream or meets[p.name]
            for p in entry.parameters()}


@dataclass
class _GradientMeeting:
    """Whether values flowing elementwise from a value meet an all-reduced gradient
    (``sources``), in a computation or, through a while loop's carry, in its body. Each
    computation's graph and the values downstream of its gradients are found once, and
    whether each value meets one is found for all values at once (one pass up the
    graph), not by a walk per parameter asked about: a residual stream, elementwise
    through every layer, made those walks quadratic."""

    module: Module
    sources: dict[str, set[str]]
    _views: dict[str, tuple[DataflowGraph, set[str]]] = field(default_factory=dict)
    _meets: dict[tuple[str, int], dict[str, bool]] = field(default_factory=dict)
    _slots: dict[tuple[str, int, int], bool] = field(default_factory=dict)
    #: Body → its reads of each carried slot (get-tuple-elements of its parameter).
    _reads: dict[str, dict[int, list[str]]] = field(default_factory=dict)
    #: Instruction → whether values flow through it elementwise (a fusion's body read once).
    _flows: dict[tuple[str, str], bool] = field(default_factory=dict)
    #: Tuple → the while loops it starts, with its slots by value (:meth:`_loops_started`).
    _started: dict[tuple[str, str], list[tuple[Instruction, dict[str, list[int]]]]] = \
        field(default_factory=dict)

    def view(self, comp: Computation) -> tuple[DataflowGraph, set[str]]:
        """``comp``'s dataflow graph, and its gradient sources with all they reach."""
        if comp.name not in self._views:
            graph = dataflow_graph(comp)
            starts = self.sources.get(comp.name, set())
            self._views[comp.name] = (graph, set(starts) | reachable(starts, graph.successors))
        return self._views[comp.name]

    def meets(self, comp: Computation, depth: int = 0) -> dict[str, bool]:
        """Value → whether it, or a value it flows into elementwise (through data
        movement, elementwise ops and fusions, a tuple starting a while loop into the
        body's reads of its slot), is combined with a value downstream of a gradient.
        Users before values: each value's answer is its users'."""
        key = (comp.name, depth)
        if key in self._meets:
            return self._meets[key]
        graph, downstream = self.view(comp)
        meets: dict[str, bool] = {}
        for inst in reversed(topological_order(comp)):
            meets[inst.name] = any(p in downstream for p in graph.predecessors(inst.name)) \
                or any(self._meets_through(graph, user, inst.name, meets, depth)
                       for user in graph.successors(inst.name))
        self._meets[key] = meets
        return meets

    def _meets_through(self, graph: DataflowGraph, user: str, value: str,
                       meets: dict[str, bool], depth: int) -> bool:
        inst = graph.comp[user]
        key = (graph.comp.name, user)
        if inst.opcode == "tuple":  # carried only, never combined: followed into loops
            return depth < 8 and any(self._slot_meets(loop, slot, depth)
                                     for loop, slots in self._loops_started(graph, key)
                                     for slot in slots.get(value, ()))
        if key not in self._flows:
            self._flows[key] = _flows_through(self.module, inst)
        return self._flows[key] and meets[user]

    def _loops_started(self, graph: DataflowGraph, key: tuple[str, str]
                       ) -> list[tuple[Instruction, dict[str, list[int]]]]:
        """The while loops the tuple ``key`` starts, each with the tuple's slots by the
        value in them (found once per tuple: a tuple of n values asked about n times)."""
        if key not in self._started:
            slots: dict[str, list[int]] = {}
            for slot, operand in enumerate(graph.comp[key[1]].operands):
                slots.setdefault(operand, []).append(slot)
            self._started[key] = [(graph.comp[loop], slots) for loop in graph.successors(key[1])
                                  if graph.comp[loop].opcode == "while"]
        return self._started[key]

    def _slot_meets(self, loop: Instruction, slot: int, depth: int) -> bool:
        """Whether the body of ``loop`` reads carried slot ``slot`` into a value that
        meets a gradient."""
        body = self.module.computation(loop.required_attr("body", ComputationRef).name)
        key = (body.name, slot, depth)
        if key not in self._slots:
            if body.name not in self._reads:
                reads: dict[int, list[str]] = {}
                for inst in body.instructions:
                    index = inst.int_attr("index")
                    if inst.opcode == "get-tuple-element" and index is not None and \
                            body[inst.operands[0]].opcode == "parameter":
                        reads.setdefault(index, []).append(inst.name)
                self._reads[body.name] = reads
            inside = self._reads[body.name].get(slot, [])
            meets = self.meets(body, depth + 1) if inside else {}
            self._slots[key] = any(meets[name] for name in inside)
        return self._slots[key]


#: Inside an elementwise fusion body: opcodes allowed besides the elementwise ones.
_BODY_EXTRA = frozenset({"parameter", "constant", "broadcast"})


def is_elementwise_body(comp: Computation, dims: tuple[int, ...]) -> bool:
    """Every value is ``dims``-shaped or a scalar, every array op elementwise; constants
    are scalars and broadcasts spread scalars — so the body computes element i of its
    result from element i of its operands."""
    for inst in comp.instructions:
        shape = inst.shape
        if not isinstance(shape, ArrayShape) or shape.dynamic or (
                shape.dims != dims and not shape.is_scalar):
            return False
        if inst.opcode not in ELEMENTWISE and inst.opcode not in _BODY_EXTRA:
            return False
        if inst.opcode == "constant" and not shape.is_scalar:
            return False
        operand = comp[inst.operands[0]].shape if inst.opcode == "broadcast" else None
        if operand is not None and not (isinstance(operand, ArrayShape) and operand.is_scalar):
            return False
    return isinstance(comp.root.shape, ArrayShape) and comp.root.shape.dims == dims


def _flows_through(module: Module, inst: Instruction) -> bool:
    if inst.opcode == "fusion":
        return isinstance(inst.shape, ArrayShape) and is_elementwise_body(
            module.computation(inst.required_attr("calls", ComputationRef).name), inst.shape.dims)
    return inst.opcode in _FLOW_THROUGH


# ----------------------------------------------------------------------- the analysis


#: The analysis of one computation, suspended at each callee it analyses (with its
#: parameter flags), and sent the callee's root flags.
_Walk = NestedWalk[tuple[Computation, list[Flags]], Flags]


@dataclass
class _Analyzer:
    """Each computation is analysed once per distinct parameter flags; its callees on
    :func:`~hlo_shard.graph.run_nested`'s stack, not by recursion."""

    module: Module
    target: list[frozenset[int]] | None
    result: Replication
    _memo: dict[tuple[str, tuple], tuple[dict[str, Flags], Flags]] = field(default_factory=dict)

    def computation(self, comp: Computation, params: list[Flags]) -> Flags:
        """Analyse ``comp`` with the given parameter flags; returns the root's flags."""
        return run_nested(self._walk(comp, params), lambda call: self._walk(*call))

    def _walk(self, comp: Computation, params: list[Flags]) -> _Walk:
        key = (comp.name, tuple(params))
        memo = self._memo.get(key)
        if memo is not None:
            values, root = memo
        else:
            values = {}
            for inst in comp.instructions:
                values[inst.name] = (yield from self._calling(inst, values)) \
                    if inst.opcode in _CALLING else self.instruction(inst, values, params)
            root = values[comp.root.name]
            self._memo[key] = (values, root)
        merged = self.result.values.setdefault(comp.name, {})
        for name, flags in values.items():
            merged[name] = meet(merged[name], flags) if name in merged else flags
        return root

    def instruction(self, inst: Instruction, values: dict[str, Flags],
                    params: list[Flags]) -> Flags:
        """The flags of ``inst``, which calls no computation (:meth:`_calling`)."""
        ops = [values[o] for o in inst.operands]
        opcode = inst.opcode
        if opcode == "parameter":
            n = inst.param_number
            return params[n] if n < len(params) else uniform(inst.shape, False)
        if (opcode in DETERMINISTIC_OPS and not inst.operands) or opcode == "after-all":
            return uniform(inst.shape, True)
        if opcode in DEVICE_DEPENDENT:
            return uniform(inst.shape, False)
        if opcode in REPLICATING_COLLECTIVES:
            return uniform(inst.shape, self._covers(inst) or (
                all(all_true(f) for f in ops) and self._same_inputs_per_target(inst)))
        if opcode in _DONE_AS_STARTED:
            return uniform(inst.shape, all_true(ops[0]))
        if opcode in FORWARDING:
            return ops[0]
        if opcode == "tuple":
            return tuple(ops)
        if opcode == "get-tuple-element":
            source = ops[0]
            return source[inst.required_attr("index", int)] if isinstance(source, tuple) \
                else source
        if opcode in DETERMINISTIC_OPS:
            return uniform(inst.shape, all(all_true(f) for f in ops))
        return uniform(inst.shape, False)

    def _calling(self, inst: Instruction, values: dict[str, Flags]) -> _Walk:
        """The flags of ``inst``, which calls computations (a while loop, a conditional,
        a call or fusion): each callee's root yielded for."""
        ops = [values[o] for o in inst.operands]
        if inst.opcode == "while":
            return (yield from self._while(inst, ops[0]))
        if inst.opcode == "conditional":
            return (yield from self._conditional(inst, ops))
        callee = inst.called_computations()
        if len(callee) != 1:
            return uniform(inst.shape, False)
        root = yield self.module.computation(callee[0]), ops
        return root if isinstance(inst.shape, TupleShape) == isinstance(root, tuple) \
            else uniform(inst.shape, all_true(root))

    def _covers(self, inst: Instruction) -> bool:
        try:
            groups = device_groups(inst, self.module)
        except UnsupportedGroups:
            return False
        sets = groups.global_sets(self.module.replica_count, self.module.num_partitions)
        if self.target is None:
            return len(sets) == 1
        return all(any(g <= s for s in sets) for g in self.target)

    def _same_inputs_per_target(self, inst: Instruction) -> bool:
        """A collective over other groups than the data-parallel ones (a model or fsdp
        axis of a 2-D mesh) of values replicated over the data-parallel groups: every
        device of a data-parallel group reads, position by position in its own
        collective group, devices of the same data-parallel groups, so it reads the
        same values in the same order and computes the same result (a global norm's
        partial sums all-reduced over the model axis)."""
        if self.target is None:
            return False
        try:
            groups = device_groups(inst, self.module)
        except UnsupportedGroups:
            return False
        ordered = _ordered_global_groups(groups, self.module.replica_count,
                                         self.module.num_partitions)
        if ordered is None:
            return False
        target_of = {device: k for k, members in enumerate(self.target) for device in members}
        #: Device → the data-parallel groups of its collective group, in group order.
        reads: dict[int, tuple[int, ...]] = {}
        for group in ordered:
            if any(device not in target_of or device in reads for device in group):
                return False
            signature = tuple(target_of[device] for device in group)
            reads.update((device, signature) for device in group)
        return all(members <= reads.keys() and len({reads[device] for device in members}) == 1
                   for members in self.target)

    def _while(self, inst: Instruction, init: Flags) -> _Walk:
        body = self.module.computation(inst.required_attr("body", ComputationRef).name)
        cond = self.module.computation(inst.required_attr("condition", ComputationRef).name)
        carry = init
        while True:
            out = yield body, [carry]
            new = meet(carry, out)
            if new == carry:
                break
            carry = new
        if not all_true((yield cond, [carry])):
            return uniform(inst.shape, False)  # trip count may differ per device
        return carry

    def _conditional(self, inst: Instruction, ops: list[Flags]) -> _Walk:
        if not all_true(ops[0]):
            return uniform(inst.shape, False)
        result: Flags | None = None
        for name, operand in zip(inst.called_computations(), ops[1:]):
            root = yield self.module.computation(name), [operand]
            result = root if result is None else meet(result, root)
        return result if result is not None else uniform(inst.shape, False)


def _ordered_global_groups(groups: DeviceGroups, replicas: int, partitions: int
                           ) -> list[tuple[int, ...]] | None:
    """The groups as global device ids in group order (None: a mode whose order over
    both replicas and partitions is not one list)."""
    expand = {
        GroupMode.CROSS_REPLICA: lambda g: [tuple(r * partitions + p for r in g)
                                            for p in range(partitions)],
        GroupMode.CROSS_PARTITION: lambda g: [tuple(r * partitions + p for p in g)
                                              for r in range(replicas)],
        GroupMode.FLATTENED_ID: lambda g: [tuple(g)],
    }.get(groups.mode)
    return None if expand is None else [s for g in groups.groups for s in expand(g)]


def target_sets(module: Module, groups: DeviceGroups | None) -> list[frozenset[int]] | None:
    if groups is None:
        return None
    return groups.global_sets(module.replica_count, module.num_partitions)


def is_pmap_form(module: Module) -> bool:
    """A ``jax.pmap`` step (jax 0.10 lowers pmap as SPMD over a stacked leading axis):
    every entry parameter is tiled over all partitions along a leading dimension of size
    1 per device, weights included — the sharding says nothing about which are
    replicated: per-device unless :attr:`ParamOverrides.pmap_replicated` lets the
    structure decide (:func:`default_parameter_replication`)."""
    n = module.num_partitions
    params = module.entry.parameters()
    if n <= 1 or not params:
        return False
    tiled = re.compile(r"\{?devices=\[%d(,1)*\]<=\[%d\]\}?$" % (n, n))
    for param in params:
        sharding = param.attr("sharding")
        text = sharding.text.strip() if isinstance(sharding, Raw) else ""
        if not isinstance(param.shape, ArrayShape) or not param.shape.dims \
                or param.shape.dims[0] != 1 or not tiled.match(text):
            return False
    return True


def entry_parameter_replication(module: Module, target: list[frozenset[int]] | None,
                                overrides: ParamOverrides,
                                gradient_sources: dict[str, set[str]]
                                ) -> list[ParamReplication]:
    """Per entry parameter: its flags and where they came from (flags > annotation >
    default analysis)."""
    entry = module.entry
    default: dict[int, bool] | None = None
    out: list[ParamReplication] = []
    pmap = is_pmap_form(module)
    for param in entry.parameters():
        n = param.param_number
        if n in overrides.replicated or n in overrides.per_device:
            out.append(ParamReplication(n, uniform(param.shape, n in overrides.replicated), "flag"))
            continue
        sharding = param.attr("sharding")
        flags = _sharding_flags(sharding.text, param.shape, target) \
            if isinstance(sharding, Raw) and not pmap else None
        if flags is not None:
            out.append(ParamReplication(n, flags, "sharding"))
            continue
        flags = _parameter_replication_attr(param)
        if flags is not None:
            out.append(ParamReplication(n, flags, "parameter_replication"))
            continue
        if pmap and not overrides.pmap_replicated:
            out.append(ParamReplication(n, uniform(param.shape, False), "pmap"))
            continue
        if isinstance(param.shape, TupleShape):
            # one tuple may mix weights and batch data: per-device unless annotated
            out.append(ParamReplication(n, uniform(param.shape, False), "analysis"))
            continue
        if default is None:
            default = default_parameter_replication(module, gradient_sources)
        out.append(ParamReplication(n, uniform(param.shape, default[n]), "analysis"))
    return out


def analyze_replication(module: Module, groups: DeviceGroups | None = None,
                        overrides: ParamOverrides = ParamOverrides(),
                        gradient_sources: dict[str, set[str]] | None = None) -> Replication:
    """Replication facts for every computation reachable from the entry, relative to the
    data-parallel ``groups`` (None: identical on all devices)."""
    target = target_sets(module, groups)
    result = Replication()
    result.params = entry_parameter_replication(module, target, overrides,
                                                gradient_sources or {})
    analyzer = _Analyzer(module, target, result)
    analyzer.computation(module.entry, [p.flags for p in result.params])
    return result


__all__ = [
    "Flags", "GroupMode", "ParamOverrides", "ParamReplication", "Replication", "all_true",
    "analyze_replication", "default_parameter_replication", "is_pmap_form", "meet",
    "replicated_tile_sets", "uniform",
]
