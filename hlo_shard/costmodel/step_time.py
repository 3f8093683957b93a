"""Estimated step time and memory of one module on one hardware profile.

Every instruction gets a category and a time:

* ``communication`` — collectives, priced by :mod:`.network` (α-β);
* ``formatting`` — data movement around the gradient collectives: transposing,
  padding, reshaping and concatenating gradients before an all-reduce or
  reduce-scatter, slicing replicated weights and state at the device's shard offset
  (and the offset arithmetic from ``replica-id``/``partition-id``), un-padding after
  an all-gather. Counting the original module's gradient transposes here too keeps
  the comparison fair: the pass folds them into its shard format;
* ``weight_update`` — the optimizer's work after the gradient all-reduce (or
  reduce-scatter): :func:`update_region_fallback` (the elementwise work downstream of
  the gradient sums, which also finds the update of an already sharded module)
  together with the region the pass plans (:data:`PlannedRegions`, which the caller
  computes with :func:`hlo_shard.passes.weight_update.planned_update_regions`);
* ``forward_backward`` — everything else.

Compute time is a roofline per kernel, max(flops / peak, bytes read / read
bandwidth + bytes written / write bandwidth) — their sum where the profile says
compute and memory do not overlap (XLA CPU) — plus the profile's launch overhead, over
the kernels XLA would run (:mod:`.kernels`); a reduce runs at the profile's reduction
rate; a kernel's time is shared among its instructions by their own
roofline weight. Loop bodies count once per iteration when the trip count is known.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Generator, Iterable, Mapping
from dataclasses import dataclass, field

from hlo_shard.analysis.collectives import DEVICE_ID_OPCODES, is_sum, with_device_counts
from hlo_shard.analysis.matmul_inputs import matmul_inputs
from hlo_shard.costmodel.aliasing import DonatedCopy, donated_parameter_copies
from hlo_shard.costmodel.network import (
    COLLECTIVE_DONE_OPCODES, COLLECTIVE_KINDS, CollectiveCost, Combiner, group_size,
    instruction_collective_cost, share_latency,
)
from hlo_shard.costmodel.flops import (Cost, CostAnalysis, EarlierCosts, elements,
                                      known_trip_count, leaf_bytes)
from hlo_shard.costmodel.kernels import (
    CONTROL_FLOW_OPCODES, FUSIBLE_OPCODES, Kernel, KernelPlans, is_prefused, runs_in_a_kernel,
)
from hlo_shard.costmodel.memory import MemoryProfile, memory_profile
from hlo_shard.errors import HloShardError
from hlo_shard.graph import (NestedWalk, element_read, read_once, reading_only, run_nested,
                             topological_order, users_map, zero_started_slots)
from hlo_shard.ir import (ArrayShape, Computation, ComputationRef, Instruction, Module,
                          shape_leaves)
from hlo_shard.parser import cyclic_gc_paused
from hlo_shard.opinfo import (ALL_GATHERS, BROADCAST, FORMATTING, MATMULS, ORDER_KEEPING_VIEWS,
                              PER_ELEMENT_COST, SUMMING_COLLECTIVES, opcodes_where,
                              with_async_forms)
from hlo_shard.profiles import HardwareProfile

#: Computation name → the instructions of the weight-update region the sharding pass
#: plans there; a computation the pass does not apply to has no entry.
PlannedRegions = Mapping[str, frozenset[str]]

CATEGORIES = ("forward_backward", "weight_update", "communication", "formatting")

#: Ops the weight update is made of (besides the collectives that bound it).
UPDATE_OPCODES = (PER_ELEMENT_COST | FORMATTING | opcodes_where(lambda i: i.moves == BROADCAST)
                  | {"reduce"}  # its norms (global-norm clipping, Adafactor's statistics)
                  | {"get-tuple-element"})  # the state it reads out of loop tuples

#: Data movement the sharding rewrite adds around its collectives.
FORMAT_OPCODES = FORMATTING

#: The pseudo-instruction carrying the profile's fixed cost per step.
STEP_OVERHEAD = "(step overhead)"
#: The pseudo-instruction carrying the fixed cost of the step's output buffers.
OUTPUT_BUFFERS = "(output buffers)"
#: The pseudo-instruction carrying the page faults of a temp allocation mapped afresh
#: every step (:meth:`~hlo_shard.profiles.HardwareProfile.fresh_pages_seconds`).
FRESH_TEMP_PAGES = "(fresh temp pages)"
#: The pseudo-instruction carrying XLA's copy of a donated parameter read after its
#: aliased output may be written (:mod:`.aliasing`), followed by the parameter's name.
DONATED_COPY = "(copy of donated) "
_MATRIX_OPCODES = MATMULS
#: What un-pads an all-gather's result: formatting, through its tuple elements and its
#: async ``-done``.
_GATHERED_FORMATTING = FORMAT_OPCODES | (with_async_forms(ALL_GATHERS) & COLLECTIVE_DONE_OPCODES) \
    | {"get-tuple-element"}


@dataclass
class InstructionEstimate:
    computation: str
    name: str
    opcode: str
    category: str
    #: How many times it runs per step (loop trip counts).
    runs: int
    seconds: float
    cost: Cost
    collective: CollectiveCost | None = None

    def to_json(self) -> dict:
        data = {"computation": self.computation, "name": self.name, "opcode": self.opcode,
                "category": self.category, "runs": self.runs, "seconds": self.seconds,
                **self.cost.as_dict()}
        if self.collective is not None:
            data["collective"] = {
                "kind": self.collective.kind, "group_size": self.collective.group_size,
                "payload_bytes": self.collective.payload_bytes,
                "bytes_sent": self.collective.bytes_sent, "steps": self.collective.steps,
                "algorithm": self.collective.algorithm}
        return data


@dataclass
class CollectiveSummary:
    kind: str
    count: int = 0
    payload_bytes: float = 0.0
    bytes_sent: float = 0.0
    seconds: float = 0.0


@dataclass
class StepEstimate:
    module: str
    profile: HardwareProfile
    devices: int
    instructions: list[InstructionEstimate]
    #: The cost rules the estimate priced with (loop bodies once per iteration), kept
    #: for the module totals, which only reports read: the gate prices many modules.
    model: CostAnalysis = field(repr=False)
    memory: MemoryProfile
    parameter_kinds: dict[str, str]
    region_source: str
    notes: list[str] = field(default_factory=list)
    #: Computation → (instruction categories, region source), for reuse.
    categories: dict[str, tuple[dict[str, str], str]] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(i.seconds for i in self.instructions)

    @functools.cached_property
    def executed(self) -> Cost:
        """Module totals by XLA's rules, loop bodies once per iteration."""
        return self.model.module_cost()

    @functools.cached_property
    def xla(self) -> Cost:
        """Module totals exactly as ``hlo_module_cost_analysis`` counts them."""
        return CostAnalysis(self.model.module).module_cost()

    def seconds_by_category(self) -> dict[str, float]:
        totals = {c: 0.0 for c in CATEGORIES}
        for inst in self.instructions:
            totals[inst.category] += inst.seconds
        return totals

    def cost_by_category(self) -> dict[str, Cost]:
        totals = {c: Cost() for c in CATEGORIES}
        for inst in self.instructions:
            totals[inst.category] = totals[inst.category] + inst.cost
        return totals

    def collectives(self) -> dict[str, CollectiveSummary]:
        summary: dict[str, CollectiveSummary] = {}
        for inst in self.instructions:
            c = inst.collective
            if c is None:
                continue
            row = summary.setdefault(c.kind, CollectiveSummary(c.kind))
            row.count += inst.runs
            row.payload_bytes += c.payload_bytes * inst.runs
            row.bytes_sent += c.bytes_sent * inst.runs
            row.seconds += inst.seconds
        return summary

    @property
    def collective_bytes(self) -> float:
        return sum(s.bytes_sent for s in self.collectives().values())

    @property
    def weight_update_share(self) -> float:
        total = self.seconds
        return self.seconds_by_category()["weight_update"] / total if total else 0.0

    def top(self, count: int = 10) -> list[InstructionEstimate]:
        return sorted(self.instructions, key=lambda i: -i.seconds)[:count]


# ------------------------------------------------------------------------- regions


def device_index_values(comp: Computation) -> set[str]:
    """``replica-id``/``partition-id`` and the small arithmetic on them (shard offsets,
    table lookups): values that differ per device only through its index."""
    found: set[str] = set()
    for inst in comp.instructions:
        derived = inst.opcode in DEVICE_ID_OPCODES or (
            not found.isdisjoint(inst.operands)
            and all(o in found or comp[o].opcode == "constant" for o in inst.operands)
            and all(leaf.num_elements <= 64 for _, leaf in shape_leaves(inst.shape)))
        if derived:
            found.add(inst.name)
    return found


def formatting_ops(module: Module, comp: Computation) -> set[str]:
    """Data movement that lays gradients out for their collective (transposes and
    reshapes into a gradient sum, padding and concatenation before a reduce-scatter),
    un-pads after an all-gather, and slices a device's shard locally."""
    users = users_map(comp)
    found = device_index_values(comp)
    stack: list[str] = []
    gathers = ALL_GATHERS
    for inst in comp.instructions:
        if inst.opcode == "dynamic-slice" and any(o in found for o in inst.operands[1:]):
            found.add(inst.name)
            stack.append(inst.operands[0])
        elif inst.opcode in gathers or _is_sum_collective(module, inst):
            stack.extend(inst.operands)
        if inst.opcode in gathers:
            forward = [inst.name]
            while forward:
                for user in users[forward.pop()]:
                    if comp[user].opcode in _GATHERED_FORMATTING \
                            and user not in found:
                        found.add(user)
                        forward.append(user)
    while stack:  # producers feeding only formatting and collectives
        name = stack.pop()
        inst = comp[name]
        if name in found or inst.opcode not in FORMAT_OPCODES:
            continue
        if all(u in found or comp[u].opcode in COLLECTIVE_KINDS for u in users[name]):
            found.add(name)
            stack.extend(inst.operands)
    return found


def _is_sum_collective(module: Module, inst: Instruction) -> bool:
    """A gradient sum: an all-reduce or reduce-scatter adding over two devices or more."""
    return inst.opcode in SUMMING_COLLECTIVES and group_size(inst, module) >= 2 \
        and is_sum(module, inst)


def update_region_fallback(module: Module, comp: Computation) -> set[str]:
    """The elementwise work downstream of the gradient sums (all-reduce or
    reduce-scatter with ``add`` over N > 1 devices) that reaches the outputs, plus the
    producers whose every user is in it (Adam's ``β₁·m``), up to dots, all-gathers and
    the outputs. A fusion of such work counts as it does unfused: in a module XLA has
    fused, the update is loop fusions. Reaching the outputs is what tells the update
    from the normalisation of activations by a summed batch statistic, which only
    feeds the next layer's dot or convolution."""
    users = users_map(comp)
    is_update_op = _UpdateOps(module)
    seeds = _gradient_sums(module, comp)
    accumulated = list(_accumulated_sums(module, comp, users, is_update_op))
    downstream = _update_work(comp, users, seeds + accumulated, is_update_op)
    region = _reaching_outputs(module, comp, users, downstream)
    # A producer joins once its last user has: count the users outside the region, so
    # that each value is looked at once per user (a chain joins link by link).
    outside = {name: len(names) - len(region.intersection(names))  # each user once
               for name, names in users.items()}
    ready = [name for name, count in outside.items() if count == 0]
    joined: list[str] = []
    while joined or ready:
        if ready:
            name = ready.pop()
            if (name in region or not is_update_op(comp[name]) or not users[name]
                    or name == comp.root_name):
                continue
            region.add(name)
            joined.append(name)
            continue
        for operand in dict.fromkeys(comp[joined.pop()].operands):
            outside[operand] -= 1
            if outside[operand] == 0:
                ready.append(operand)
    return region


def _gradient_sums(module: Module, comp: Computation) -> list[str]:
    """The sums across devices of ``comp`` that may be gradients: on a mesh with a model
    axis (sums over more than one grouping of the devices), not those a matrix product
    reads (tensor parallelism's partial activations, forward and backward:
    :func:`~hlo_shard.analysis.matmul_inputs.matmul_inputs`)."""
    sums = [inst for inst in comp.instructions if _is_sum_collective(module, inst)]
    if len({str(inst.attr("replica_groups")) for inst in sums}) <= 1:
        return [inst.name for inst in sums]
    products = matmul_inputs(module)
    return [inst.name for inst in sums if not products.reads(comp.name, inst.name)]


def _update_work(comp: Computation, users: Mapping[str, list[str]], seeds: list[str],
                 is_update_op: _UpdateOps) -> set[str]:
    """The update ops downstream of ``seeds`` through update ops (``users``: ``comp``'s),
    and through a tuple to the ``get-tuple-element`` of the element it forwards (a
    ``shard_map`` returns its gradients in one, the update reads them out of it)."""
    downstream: set[str] = set()
    elements_read: dict[str, dict[str, list[str]]] = {}  # tuple → element → its reads
    stack = list(seeds)
    while stack:
        name = stack.pop()
        for user in users[name]:
            inst = comp[user]
            if inst.opcode == "tuple":
                if user not in elements_read:
                    elements_read[user] = _element_reads(comp, users, inst)
                found = elements_read[user].get(name, [])
            elif is_update_op(inst):
                found = [user]
            else:
                continue
            for read in found:
                if read not in downstream:
                    downstream.add(read)
                    stack.append(read)
    return downstream


def _element_reads(comp: Computation, users: Mapping[str, list[str]], tuple_inst: Instruction
                   ) -> dict[str, list[str]]:
    """Each element of ``tuple_inst`` → the ``get-tuple-element`` reading it."""
    reads: dict[str, list[str]] = {}
    for read in users[tuple_inst.name]:
        if comp[read].opcode == "get-tuple-element":
            element = tuple_inst.operands[comp[read].int_attr("index") or 0]
            reads.setdefault(element, []).append(read)
    return reads


def _accumulated_sums(module: Module, comp: Computation, users: Mapping[str, list[str]],
                      is_update_op: _UpdateOps) -> dict[str, list[tuple[str, str]]]:
    """The values of ``comp`` that are gradient sums a loop accumulated, each with the
    sums across devices that go into it (body, instruction): each ``get-tuple-element``
    of a ``while`` whose body computes that slot's next value from a sum across devices
    through update work (a scan or ``fori_loop`` adding each microbatch's all-reduced
    gradient into its accumulator), or writes such a value into the slot (a scan over
    layers stacking each layer's all-reduced gradient). A body's own accumulated sums
    count as its sums: a microbatch loop adding up what a layer scan inside it stacked
    accumulates the inner loop's sums (nested loops are read innermost first, each body
    once within a :func:`~hlo_shard.graph.reading_only` block: the module's memo of the
    bodies read so far is shared there)."""
    known: dict[str, dict[str, list[tuple[str, str]]]] = \
        read_once("accumulated_sums", module.entry, lambda _: {})
    for body in _nested_bodies(module, comp, known):
        known[body.name] = _slot_sums(module, body, users_map(body), is_update_op, known)
    found = known.get(comp.name)
    return found if found is not None else _slot_sums(module, comp, users, is_update_op, known)


def _nested_bodies(module: Module, comp: Computation, known: Collection[str]
                   ) -> list[Computation]:
    """The bodies of the ``while`` loops ``comp`` runs, directly or in those bodies,
    each after the bodies of the loops it runs itself (an iterative post-order), but
    the ``known`` ones and those they run."""
    order: list[str] = []
    seen = {comp.name}
    stack: list[tuple[str, bool]] = [(comp.name, False)]
    while stack:
        name, expanded = stack.pop()
        if expanded:
            order.append(name)
            continue
        stack.append((name, True))
        for loop in module.computation(name).instructions:
            body = loop.called("body") if loop.opcode == "while" else ""
            if body and body not in seen and body not in known and \
                    module.has_computation(body):
                seen.add(body)
                stack.append((body, False))
    return [module.computation(name) for name in order[:-1]]


def _slot_sums(module: Module, comp: Computation, users: Mapping[str, list[str]],
               is_update_op: _UpdateOps, inner: Mapping[str, dict[str, list[tuple[str, str]]]]
               ) -> dict[str, list[tuple[str, str]]]:
    """:func:`_accumulated_sums` of ``comp``, ``inner`` holding those of the bodies its
    loops run."""
    found: dict[str, list[tuple[str, str]]] = {}
    for loop in comp.instructions:
        body_name = loop.called("body") if loop.opcode == "while" else ""
        if not body_name or not module.has_computation(body_name):
            continue
        body = module.computation(body_name)
        nested = inner.get(body_name, {})
        sums = frozenset(i.name for i in body.instructions
                         if _is_sum_collective(module, i)) | frozenset(nested)
        if not sums or body.root.opcode != "tuple":
            continue
        summed = _update_work(body, users_map(body), list(sums), is_update_op) | sums
        # (an accumulator starts at zero, a training loop's weights at their values; a
        # summed loss is a scalar)
        zeros = zero_started_slots(module, comp, loop)
        slots = {k: value for k, value in enumerate(body.root.operands)
                 if (value in summed or _writes_into_slot(body, body[value], k, summed))
                 and elements(body[value].shape) > 1 and k in zeros}
        for user in users[loop.name]:
            slot = comp[user].int_attr("index") if comp[user].opcode == "get-tuple-element" \
                else None
            if slot in slots:
                found[user] = [pair for name in _sums_into(body, slots[slot], summed, sums)
                               for pair in nested.get(name, [(body_name, name)])]
    return found


def _sums_into(body: Computation, value: str, summed: set[str], sums: frozenset[str]
               ) -> list[str]:
    """The ``sums`` that ``value`` is computed from through ``summed`` work (and a write
    into the carried slot), by name. Scalars are not walked through: a scalar every
    gradient reads (a global norm's sum) belongs to no one gradient, and walking it from
    every slot would read every other gradient's sums from each."""
    reached: set[str] = set()
    stack = [value]
    while stack:
        name = stack.pop()
        if name in reached:
            continue
        reached.add(name)
        if name not in sums:
            stack.extend(o for o in body[name].operands
                         if o in summed and elements(body[o].shape) > 1)
    return sorted(reached & sums)


def _writes_into_slot(body: Computation, inst: Instruction, slot: int,
                      written: set[str]) -> bool:
    """``inst`` is a ``dynamic-update-slice`` of the value ``body`` carries in ``slot``
    with one of ``written``."""
    if inst.opcode != "dynamic-update-slice" or inst.operands[1] not in written:
        return False
    buffer = body[inst.operands[0]]
    return buffer.opcode == "get-tuple-element" and buffer.int_attr("index") == slot and \
        body[buffer.operands[0]].opcode == "parameter"


def _reaching_outputs(module: Module, comp: Computation, users: dict[str, list[str]],
                      downstream: set[str]) -> set[str]:
    """The members of ``downstream`` the root reads through members, tuples,
    all-gathers (a sharded update's weights) and the views and elementwise ops after
    them, and through sums of scalars across devices: a sharded update's norms (global
    clipping, a trust ratio) sum their shards' partial sums, so the squares and reduces
    on the shards are update work too. A batch statistic is a vector; it stops there."""
    reached: set[str] = set()
    seen = {comp.root.name}
    stack = [comp.root.name]
    while stack:
        for operand in comp[stack.pop()].operands:
            if operand in seen:
                continue
            seen.add(operand)
            if operand in downstream:
                reached.add(operand)
                stack.append(operand)
            elif comp[operand].opcode in _TOWARDS_OUTPUTS \
                    or _sums_scalars(module, comp, users, comp[operand]):
                stack.append(operand)
    return reached


def _sums_scalars(module: Module, comp: Computation, users: dict[str, list[str]],
                  inst: Instruction) -> bool:
    """A sum across devices of scalars: of rank-0 values, or of a bucket of them (the
    pass's one-element sums, concatenated and read back one element at a time)."""
    if not _is_sum_collective(module, inst):
        return False
    if all(not leaf.dims for _, leaf in shape_leaves(inst.shape)):
        return True
    return bool(users[inst.name]) and all(
        comp[user].opcode == "slice" and elements(comp[user].shape) == 1
        for user in users[inst.name])


#: What lies between a weight update and the outputs besides the update itself.
_TOWARDS_OUTPUTS = UPDATE_OPCODES | ALL_GATHERS | {"tuple"}


class _UpdateOps:
    """Whether an instruction is update work: an :data:`UPDATE_OPCODES` op, or a fusion
    whose fused computation holds nothing else (besides its parameters and constants).
    Each fused computation is read once."""

    _MEMBERS = UPDATE_OPCODES | {"parameter", "constant"}

    def __init__(self, module: Module) -> None:
        self.module = module
        self.fused: dict[str, bool] = {}

    def __call__(self, inst: Instruction) -> bool:
        if inst.opcode in UPDATE_OPCODES:
            return True
        calls = inst.called("calls") if inst.opcode == "fusion" else ""
        if not calls or not self.module.has_computation(calls):
            return False
        if calls not in self.fused:
            self.fused[calls] = all(member.opcode in self._MEMBERS for member in
                                    self.module.computation(calls).instructions)
        return self.fused[calls]


def categorize(module: Module, comp: Computation, regions: PlannedRegions
               ) -> tuple[dict[str, str], str]:
    """Category of every instruction of ``comp`` and where the region came from."""
    formatting = formatting_ops(module, comp)
    planned = regions.get(comp.name)
    # The fallback also finds the update of an already sharded module (downstream of
    # its reduce-scatters), which the pass's analysis does not look for.
    region = update_region_fallback(module, comp) | (planned or set())
    source = "update_region" if planned else "fallback"
    categories: dict[str, str] = {}
    for inst in comp.instructions:
        if inst.opcode in COLLECTIVE_KINDS or inst.opcode in COLLECTIVE_DONE_OPCODES:
            categories[inst.name] = "communication"
        elif inst.name in formatting:
            categories[inst.name] = "formatting"
        elif inst.name in region:
            categories[inst.name] = "weight_update"
        else:
            categories[inst.name] = "forward_backward"
    return categories, source


def classify_parameters(module: Module, categories: dict[str, str]) -> dict[str, str]:
    """Entry parameters by name: ``weights`` (read by the update and by the rest of the
    step, no integer), ``optimizer_state`` (read only by the update), ``batch``
    (per-device data: a tiled sharding, or — in replica form, where nothing says — an
    array the update never reads), else ``other_parameters`` (step counters, frozen
    tables, seeds)."""
    comp = module.entry
    users = users_map(comp)
    kinds: dict[str, str] = {}
    for param in comp.parameters():
        sharding = str(getattr(param.attr("sharding"), "text", param.attr("sharding") or ""))
        readers = _readers(comp, users, param.name)
        # (a parameter the partitioner slices at the device's offset is read where the
        # slice is: formatting, for the update's gradients; for a parameter, its users)
        readers += [later for r in readers if categories.get(r) == "formatting"
                    for later in _readers(comp, users, r)]
        in_update = any(categories.get(r) in ("weight_update", "formatting") for r in readers)
        # (a loop it is passed into reads it too: what the update reads besides is a
        # weight; one the update does not read is nothing more for it)
        elsewhere = any(categories.get(r) == "forward_backward" for r in readers) or \
            (in_update and bool(_loops_reading(comp, users, param.name)))
        if in_update and not elsewhere:  # sharded state is tiled too: the update first
            kinds[param.name] = "optimizer_state"
        elif in_update:  # (an integer is a step counter the schedule reads: no weight)
            kinds[param.name] = "other_parameters" if isinstance(param.shape, ArrayShape) \
                and param.shape.is_integer else "weights"
        elif "devices=" in sharding and "last_tile_dim_replicate" not in sharding:
            kinds[param.name] = "batch"
        elif not sharding and elements(param.shape) > 1 and readers:
            kinds[param.name] = "batch"
        else:
            kinds[param.name] = "other_parameters"
    return kinds


def _loops_reading(comp: Computation, users: dict[str, list[str]], name: str) -> list[str]:
    """The ``while`` loops that carry ``name`` from their first iteration: a scan's
    forward pass reads its stacked weights there, passed in as XLA's optimized modules
    pass them (straight into the loop's tuple, no copy between)."""
    return [loop for carry in users[name] if comp[carry].opcode == "tuple"
            for loop in users[carry] if comp[loop].opcode == "while"]


def _readers(comp: Computation, users: dict[str, list[str]], name: str) -> list[str]:
    """Users of a value, looking through tuples, get-tuple-element and reshapes."""
    found: list[str] = []
    stack = list(users[name])
    seen: set[str] = set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if comp[user].opcode in ORDER_KEEPING_VIEWS or comp[user].opcode == "get-tuple-element":
            stack.extend(users[user])
        if comp[user].opcode not in ("tuple", "get-tuple-element"):
            found.append(user)
    return found


def gradient_values(module: Module, comp: Computation) -> set[str]:
    """Gradient sums and their inputs: the buffers reported as ``gradients``. The inputs
    are followed back through the data movement that lays them out for the collective
    (a sharded module's transpose, reshape, pad and bucket concatenation before its
    reduce-scatter) to the per-device gradient itself, so that a gradient counts as one
    — memory that grows with the parameters, not the batch — whether it is all-reduced
    or reduce-scattered."""
    found: set[str] = set()
    stack: list[str] = []
    for inst in comp.instructions:
        if _is_sum_collective(module, inst):
            found.add(inst.name)
            stack.extend(inst.operands)
    while stack:
        name = stack.pop()
        if name not in found:
            found.add(name)
            if comp[name].opcode in FORMAT_OPCODES:
                stack.extend(comp[name].operands)
    return found


def fresh_writers(module: Module, comp: Computation, threshold_bytes: int = 0) -> set[str]:
    """The entry's instructions that write a new buffer each step: its outputs not
    aliased to a donated parameter (``input_output_alias``), looking through bitcasts,
    and larger than ``threshold_bytes`` when it is not 0 (the profile's
    ``fresh_temp_threshold_bytes``: a host allocator serves smaller blocks from the pages
    of those freed by earlier steps). The step's temporaries and donated outputs reuse
    pages mapped by earlier steps."""
    if comp is not module.entry:
        return set()
    aliases = module.output_aliases()
    root = comp.root
    outputs = root.operands if root.opcode == "tuple" else [root.name]
    found: set[str] = set()
    for index, name in enumerate(outputs):
        if index in aliases:
            continue
        while comp[name].opcode == "bitcast":
            name = comp[name].operands[0]
        if not threshold_bytes or leaf_bytes(comp[name].shape) > threshold_bytes:
            found.add(name)
    return found


# ---------------------------------------------------------------------------- time


@dataclass(frozen=True)
class _Priced:
    """The estimates of one computation's own kernels, then those of the computations
    its control flow runs, in order (kept apart, not concatenated at every level: a
    chain of nested calls would copy its estimates once per level above them)."""

    own: list[InstructionEstimate]
    inner: list[_Priced]
    seconds: float  #: of all of them

    def flat(self) -> list[InstructionEstimate]:
        """Every estimate, each computation's own before those it runs (one walk)."""
        out: list[InstructionEstimate] = []
        stack = [self]
        while stack:
            node = stack.pop()
            out.extend(node.own)
            stack.extend(reversed(node.inner))
        return out


#: The estimates of one computation, suspended at each computation its control flow runs
#: (with how many times), and sent that computation's estimates.
_Walk = NestedWalk[tuple[Computation, int], _Priced]


@dataclass
class _Estimator:
    module: Module
    profile: HardwareProfile
    analysis: CostAnalysis
    algorithm: str | None
    emulate: bool
    regions: PlannedRegions
    combiner: Combiner
    plans: KernelPlans
    #: Computation → (instruction categories, region source), computed on first use.
    categories: dict[str, tuple[dict[str, str], str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def computation(self, comp: Computation, runs: int) -> list[InstructionEstimate]:
        """The estimates of ``comp`` run ``runs`` times, and of the computations its
        loops, calls and branches run (followed on :func:`run_nested`'s stack)."""
        return run_nested(self._walk(comp, runs), lambda callee: self._walk(*callee)).flat()

    def _walk(self, comp: Computation, runs: int) -> _Walk:
        if comp.name not in self.categories:
            self.categories[comp.name] = categorize(self.module, comp, self.regions)
        categories = self.categories[comp.name][0]
        plan = self.plans.plan(comp, self.emulate, self.profile.multi_output_fusion,
                               self.profile.fused_concatenate_operands,
                               self.profile.row_major_reductions)
        fresh = fresh_writers(self.module, comp, self.profile.fresh_temp_threshold_bytes)
        out: list[InstructionEstimate] = []
        for kernel in plan.kernels:
            out.extend(self._kernel(comp, kernel, categories, runs,
                                    kernel.members[-1].name not in fresh))
        self._combine_collectives(comp, out)
        inner: list[_Priced] = []
        for inst in comp.instructions:
            if inst.opcode in CONTROL_FLOW_OPCODES:
                inner.extend((yield from self._control_flow(comp, inst, runs)))
        return _Priced(out, inner, sum(e.seconds for e in out)
                       + sum(run.seconds for run in inner))

    def _kernel(self, comp: Computation, kernel: Kernel, categories: dict[str, str],
                runs: int, resident: bool = False) -> list[InstructionEstimate]:
        """``resident``: the kernel writes pages mapped already (:func:`fresh_writers`)."""
        members = kernel.members
        costs = [self.analysis.instruction_cost(comp, m) for m in members]
        if len(members) == 1 and members[0].opcode in COLLECTIVE_DONE_OPCODES:
            return [InstructionEstimate(comp.name, members[0].name, members[0].opcode,
                                        categories[members[0].name], runs, 0.0, costs[0])]
        if len(members) == 1 and members[0].opcode in COLLECTIVE_KINDS:
            inst = members[0]
            shapes = [comp[o].shape for o in inst.operands]
            network = instruction_collective_cost(inst, self.module, shapes, self.profile,
                                                  algorithm=self.algorithm, resident=resident)
            return [InstructionEstimate(comp.name, inst.name, inst.opcode, "communication",
                                        runs, network.seconds * runs, costs[0], network)]
        compute = [self._compute_seconds(comp, m, c) for m, c in zip(members, costs)]
        # XLA's own bytes for a lone non-fusible op (a dot, a fusion XLA made); the
        # kernel's reads and writes for an emulated fusion.
        lone = len(members) == 1 and members[0].opcode not in FUSIBLE_OPCODES
        if lone:
            written = min(leaf_bytes(members[0].shape), max(costs[0].bytes_accessed, 0.0))
            read = max(costs[0].bytes_accessed, 0.0) - written
        else:
            read, written = kernel.read_bytes, kernel.write_bytes
            read += (self.profile.reordered_read_factor - 1) * kernel.reordered_read_bytes
        memory = self.profile.memory_seconds(read, written, resident)
        seconds = ((max(sum(compute), memory) if self.profile.overlaps_compute_and_memory
                    else sum(compute) + memory) + self._kernel_overhead)
        weights = [max(c, self.profile.memory_seconds(max(cost.bytes_accessed, 0.0), 0.0))
                   for c, cost in zip(compute, costs)]
        total_weight = sum(weights)
        shares = ([w / total_weight for w in weights] if total_weight > 0
                  else [1 / len(members)] * len(members))
        return [InstructionEstimate(comp.name, m.name, m.opcode, categories[m.name], runs,
                                    seconds * share * runs, cost.scaled(runs))
                for m, cost, share in zip(members, costs, shares)]

    @property
    def _kernel_overhead(self) -> float:
        """The fixed cost of one kernel: of the kernels the fusion emulation plans, or of
        those XLA made (a module fused already, where every kernel is explicit)."""
        return (self.profile.kernel_overhead_s if self.emulate
                else self.profile.fused_kernel_overhead_s)

    def _combine_collectives(self, comp: Computation, estimates: list[InstructionEstimate]
                             ) -> None:
        """Price collectives as XLA runs them after its combiners: one latency per bucket."""
        by_name = {e.name: e for e in estimates if e.collective is not None}
        for bucket in self.combiner.buckets(comp):
            members = [by_name[name] for name in bucket if name in by_name]
            for member, value in zip(members, share_latency(
                    [m.collective for m in members if m.collective is not None])):
                member.seconds = value * member.runs

    def _compute_seconds(self, comp: Computation, inst: Instruction, cost: Cost) -> float:
        element_type = _element_type(comp, inst)
        if inst.opcode == "reduce":
            rate = min(self.profile.reduction_elements_per_s, self.profile.vector_rate(element_type))
        else:
            rate = {"dot": self.profile.matrix_rate, "convolution": self.profile.convolution_rate
                    }.get(inst.opcode, self.profile.vector_rate)(element_type)
        return (max(cost.flops, 0.0) / rate
                + cost.transcendentals / self.profile.transcendentals_per_s)

    def _control_flow(self, comp: Computation, inst: Instruction, runs: int
                      ) -> Generator[tuple[Computation, int], _Priced, list[_Priced]]:
        """The computations ``inst`` runs, priced: a loop's body and condition, a call's
        callee, a conditional's costliest branch."""
        called = inst.called_computations()
        if inst.opcode == "while":
            loop = _LoopRuns.of(self.module, self.analysis, comp, inst, runs)
            if not loop.known:
                self.notes.append(f"{inst.name}: unknown trip count, one iteration counted")
            return [(yield loop.body, loop.body_runs),
                    (yield loop.condition, loop.condition_runs)]
        if inst.opcode == "call":
            return [(yield self.module.computation(called[0]), runs)]
        branches = []
        for name in called:
            branches.append((yield self.module.computation(name), runs))
        return [max(branches, key=lambda b: b.seconds)] if branches else []


#: The most times a computation may run per step: past it, seconds and counts scaled by
#: the runs leave the range of a float (nested loops multiply their trip counts).
_MOST_RUNS = 10 ** 30


@dataclass(frozen=True)
class _LoopRuns:
    """A while loop's body and condition, and how many times each runs per step: the
    trip count when it is evident, else once (the estimate notes it)."""

    body: Computation
    body_runs: int
    condition: Computation
    condition_runs: int
    known: bool

    @staticmethod
    def of(module: Module, analysis: CostAnalysis, comp: Computation, loop: Instruction,
           runs: int) -> _LoopRuns:
        trips = known_trip_count(analysis, comp, loop)
        counted = 1 if trips is None else trips
        if runs * (counted + 1) > _MOST_RUNS:
            raise HloShardError(f"{loop.name}: its nested loops run more than {_MOST_RUNS:.0e} "
                                f"times per step, past what can be priced")
        return _LoopRuns(module.computation(loop.required_attr("body", ComputationRef).name),
                         runs * counted,
                         module.computation(loop.required_attr("condition", ComputationRef).name),
                         runs * (counted + 1), trips is not None)


def _element_type(comp: Computation, inst: Instruction) -> str:
    source = comp[inst.operands[0]].shape if inst.opcode in _MATRIX_OPCODES else inst.shape
    if isinstance(source, ArrayShape):  # the common case: its own type
        return source.element_type
    first = next(shape_leaves(source), None)
    return first[1].element_type if first else "f32"


def estimate_step(module: Module, profile: HardwareProfile, regions: PlannedRegions, *,
                  algorithm: str | None = None,
                  categories: dict[str, tuple[dict[str, str], str]] | None = None,
                  roles: Mapping[int, str] | None = None,
                  earlier: EarlierCosts | None = None) -> StepEstimate:
    """Time and memory of one step of ``module`` per device on ``profile``, with the
    weight-update ``regions`` the pass plans in it. ``categories`` (computation → what
    :func:`categorize` returns) reuses the categories of a module with the same
    instructions (a retargeted copy); ``roles`` (entry parameter number → kind, e.g. from
    a fixtures manifest) replaces :func:`classify_parameters`; ``earlier``: the cost
    totals of the module ``module`` is an edited copy of, reused where the edits left a
    computation as it was (:class:`~hlo_shard.costmodel.flops.EarlierCosts`)."""
    # Every analysis below reads the same computations, and makes many objects but no
    # cycles.
    with reading_only(), cyclic_gc_paused():
        return _estimate_step(module, profile, regions, algorithm, categories, roles,
                              earlier)


def _estimate_step(module: Module, profile: HardwareProfile, regions: PlannedRegions,
                   algorithm: str | None,
                   categories: dict[str, tuple[dict[str, str], str]] | None,
                   roles: Mapping[int, str] | None,
                   earlier: EarlierCosts | None) -> StepEstimate:
    module, profile = _as_priced(module, profile)
    emulate = not is_prefused(module)
    model = CostAnalysis(module, count_loop_iterations=True, xla_compatible=False,
                         earlier=earlier)
    combiner = Combiner(module, profile.combine_threshold_bytes, profile.combined_collectives)
    plans = KernelPlans()
    estimator = _Estimator(module, profile, model, algorithm, emulate, regions, combiner,
                           plans, dict(categories or {}))
    instructions = estimator.computation(module.entry, 1)
    instructions.extend(_fixed_costs(module, profile))
    for copy in donated_parameter_copies(module, combiner.buckets(module.entry)):
        instructions.append(InstructionEstimate(
            module.entry.name, f"{DONATED_COPY}{copy.parameter}", "copy", "formatting", 1,
            donated_copy_seconds(copy, profile), Cost(bytes_accessed=2.0 * copy.bytes)))
    kinds = (_kinds_of_roles(module, roles or {})
             or classify_parameters(module, estimator.categories[module.entry.name][0]))
    entry_categories = estimator.categories[module.entry.name][0]
    activations = {n for n, c in entry_categories.items() if c == "forward_backward"}
    memory = memory_profile(module, kinds, gradient_values(module, module.entry), activations,
                            upcast_16bit_floats=profile.upcasts_16bit_floats,
                            combiner=combiner, plans=plans)
    fresh_pages = profile.fresh_pages_seconds(memory.temp_bytes)
    if fresh_pages:
        instructions.append(InstructionEstimate(module.entry.name, FRESH_TEMP_PAGES, "step",
                                                "forward_backward", 1, fresh_pages, Cost()))
    sources = {source for _, source in estimator.categories.values()}
    return StepEstimate(
        module=module.source_path or module.name, profile=profile,
        devices=module.device_count, instructions=instructions,
        model=model, memory=memory,
        parameter_kinds=kinds, region_source="update_region" if "update_region" in sources
        else "fallback", notes=estimator.notes, categories=estimator.categories)


def _as_priced(module: Module, profile: HardwareProfile) -> tuple[Module, HardwareProfile]:
    """``module`` with its device counts recovered, and ``profile`` at that count: what
    every price of the module reads."""
    module = with_device_counts(module)
    return module, profile.for_devices(module.device_count)


def _fixed_costs(module: Module, profile: HardwareProfile) -> list[InstructionEstimate]:
    """What a step costs even when it computes nothing, and the buffer of each output
    leaf past the first (the step overhead was measured with one output)."""
    costs: list[InstructionEstimate] = []
    if profile.step_overhead_s:
        costs.append(InstructionEstimate(module.entry.name, STEP_OVERHEAD, "step",
                                         "forward_backward", 1, profile.step_overhead_s,
                                         Cost()))
    extra_outputs = sum(1 for _ in shape_leaves(module.entry.root.shape)) - 1
    if profile.output_overhead_s and extra_outputs > 0:
        costs.append(InstructionEstimate(module.entry.name, OUTPUT_BUFFERS, "step",
                                         "forward_backward", 1,
                                         extra_outputs * profile.output_overhead_s, Cost()))
    return costs


#: How far :func:`step_seconds_floor` is lowered below the terms it adds up: far more
#: than the rounding of the estimate's own sums of the same terms, in another order.
_FLOOR_ROUNDING = 1e-9


def step_seconds_floor(module: Module, profile: HardwareProfile) -> float:
    """A lower bound of :func:`estimate_step`'s ``seconds`` for ``module`` on ``profile``
    (whatever the regions), from what needs no cost analysis: the fixed costs and, in a
    module XLA fused already, the launch overhead of each kernel that is not a
    collective, as often as it runs (every instruction that runs in a kernel is one of
    its own there; a kernel costs at least its overhead), in the entry and in the
    computations its loops and calls run (a conditional's branches are left out: only
    one of them runs). Every other term of the estimate is at least zero, so a caller
    asking only whether the step is longer than some time can often answer without the
    estimate."""
    module, profile = _as_priced(module, profile)
    seconds = sum(cost.seconds for cost in _fixed_costs(module, profile))
    if is_prefused(module):
        seconds += _kernel_launches(module) * profile.fused_kernel_overhead_s
    return seconds * (1 - _FLOOR_ROUNDING)


def _kernel_launches(module: Module) -> int:
    """The kernels a step of ``module`` (XLA fused already) launches, collectives left
    out: the entry's, and those of the loops and calls it runs, each as often as the
    estimate counts it."""
    analysis = CostAnalysis(module)  # only its computations are read (trip counts)
    launches = 0
    stack = [(module.entry, 1)]
    while stack:
        comp, runs = stack.pop()
        for inst in comp.instructions:
            if inst.opcode == "while":
                loop = _LoopRuns.of(module, analysis, comp, inst, runs)
                stack += [(loop.body, loop.body_runs), (loop.condition, loop.condition_runs)]
            elif inst.opcode == "call":
                stack.append((module.computation(inst.called_computations()[0]), runs))
            elif runs_in_a_kernel(inst) and inst.opcode not in COLLECTIVE_KINDS \
                    and inst.opcode not in COLLECTIVE_DONE_OPCODES:
                launches += runs
    return launches


def donated_copy_seconds(copy: DonatedCopy, profile: HardwareProfile) -> float:
    """One step's copy of a donated parameter: read, and written to a temporary, in one
    kernel."""
    return profile.memory_seconds(copy.bytes, copy.bytes, resident=True) + profile.kernel_overhead_s


def _kinds_of_roles(module: Module, roles: Mapping[int, str]) -> dict[str, str]:
    """Parameter kinds by name from kinds by parameter number."""
    params = module.entry.parameter_names()
    return {params[index]: kind for index, kind in roles.items() if index in params}


def per_weight_rows(estimate: StepEstimate, module: Module) -> dict[str, dict[str, float]]:
    """Per weight parameter: its bytes, and the update work and gradient traffic that
    belong to it. From the instructions that read the weight in the update, the walk
    goes forward (its update, its all-gather) and, from everything found, backward
    (its optimizer state's update, its gradient's collective and formatting), over
    update, formatting and communication instructions. Junctions — concatenations and
    tuples (combined buckets), multi-operand collectives and scalar work such as a
    learning-rate schedule — are owned by every weight that reaches them, split in
    proportion to the weights' sizes, but never walked through: a bias in a combined
    bucket owns its own slice's update and a share of the bucket's collectives, not
    its neighbours' updates. Flops count every instruction, including those the time
    model recomputes inside their consumers."""
    comp = module.entry
    users = users_map(comp)
    categories = estimate.categories[comp.name][0]
    entries = {i.name: i for i in estimate.instructions if i.computation == comp.name}
    analysis = CostAnalysis(module, count_loop_iterations=True, xla_compatible=False)
    sizes = {p: leaf_bytes(comp[p].shape) for p, k in estimate.parameter_kinds.items()
             if k == "weights"}
    # A gradient a loop accumulated was sent by the sums across devices in its body.
    looped = _accumulated_sums(module, comp, users, _UpdateOps(module))
    collectives = {(e.computation, e.name): e for e in estimate.instructions
                   if e.collective is not None}

    def in_update(name: str) -> bool:
        return (categories.get(name, "forward_backward") != "forward_backward"
                or comp[name].opcode == "get-tuple-element")

    def chain(junction: str) -> list[tuple[str, bool]]:
        """Where the walk goes on forward from a junction: a bucket's single consumer
        chain (concatenate → all-gather)."""
        return [(u, True) for u in users[junction] if len(users[junction]) == 1 and in_update(u)]

    def walk(stack: list[tuple[str, bool]], beyond: set[str] | None) -> set[str]:
        """What the walk from ``stack`` reaches; a junction reached forward goes to
        ``beyond`` without its chain walked where ``beyond`` is given."""
        seen: set[str] = set()
        while stack:
            name, forward = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            if _is_junction(comp, comp[name]):
                if forward and beyond is not None:
                    beyond.add(name)
                elif forward:
                    stack.extend(chain(name))
                continue
            element = element_read(comp, comp[name])
            stack.extend((o, False) for o in (comp[name].operands if element is None
                                              else [element]) if in_update(o))
            if forward:
                stack.extend((u, True) for u in users[name] if in_update(u))
        return seen

    # What a bucket's consumer chain reaches is the same for every weight in the bucket:
    # walked once per junction, and its work shared once among the weights reaching it,
    # not once per weight through every other weight's slice.
    owners: dict[str, set[str]] = {}
    reaching: dict[str, set[str]] = {}
    for param in sizes:
        junctions: set[str] = set()
        for name in walk([(r, True) for r in _readers(comp, users, param) if in_update(r)],
                         junctions):
            owners.setdefault(name, set()).add(param)
        for junction in junctions:
            reaching.setdefault(junction, set()).add(param)
    in_chains: dict[str, list[str]] = {}
    for junction in reaching:
        for name in walk(chain(junction), None):
            in_chains.setdefault(name, []).append(junction)
    # Instructions with the same owners share one sum, split among those owners once.
    shared: dict[tuple[frozenset[str], tuple[str, ...]], _OwnedWork] = {}
    for name in (i.name for i in comp.instructions if i.name in owners or i.name in in_chains):
        # (in program order, each key's chains sorted: the same sums on every run)
        key = (frozenset(owners.get(name, ())), tuple(sorted(in_chains.get(name, ()))))
        work = shared.get(key)
        if work is None:
            work = shared[key] = _OwnedWork(key[0].union(*(reaching[j] for j in key[1])))
        entry = entries.get(name)
        if entry is not None and entry.collective is not None:
            work.add_collective(entry)
        else:
            work.update_flops += max(analysis.instruction_cost(comp, comp[name]).flops, 0.0)
            work.update_seconds += entry.seconds if entry else 0.0
    _share_loop_sums(shared, looped, owners, collectives)
    for name, weights in _sums_leading_to_one_owner(module, comp, users, owners).items():
        if name not in in_chains and (comp.name, name) in collectives:
            work = shared.setdefault((weights, ()), _OwnedWork(weights))
            work.add_collective(collectives[comp.name, name])
    return _split_among_weights(sizes, shared.values())


def _sums_leading_to_one_owner(module: Module, comp: Computation,
                               users: Mapping[str, list[str]], owners: Mapping[str, set[str]]
                               ) -> dict[str, frozenset[str]]:
    """The sums across devices no weight's walk reached whose every path forward comes to
    the work of the same weights first (``owners``): a one-element gradient summed
    before the scalar work of its update, which the walk does not go through (equinox's
    vmapped bias), or a ``shard_map`` gradient's first sum, padded into the sum the
    update reads. One reverse walk: each value's owners are its users' where those
    agree; a value read by the work of different weights (a batch statistic, the loss)
    belongs to none."""
    several: frozenset[str] = frozenset()  # (a marker: read towards different owners)
    ahead: dict[str, frozenset[str] | None] = {}
    found: dict[str, frozenset[str]] = {}
    for inst in reversed(topological_order(comp)):
        owned = owners.get(inst.name)
        if owned:
            ahead[inst.name] = frozenset(owned)
            continue
        seen = {ahead[user] for user in users[inst.name]} - {None}
        key = seen.pop() if len(seen) == 1 else several if seen else None
        ahead[inst.name] = key
        if key and _is_sum_collective(module, inst):
            found[inst.name] = key
    return found


def _share_loop_sums(shared: dict[tuple[frozenset[str], tuple[str, ...]], _OwnedWork],
                     looped: dict[str, list[tuple[str, str]]], owners: dict[str, set[str]],
                     collectives: dict[tuple[str, str], InstructionEstimate]) -> None:
    """Each sum in a loop body (``looped``: an accumulated value → the sums going into
    it) goes to the weights ``owners`` says own the values it goes into, shared among
    them as a junction is (a combined bucket's)."""
    sent_by: dict[tuple[str, str], set[str]] = {}
    for name, sent in looped.items():
        for body_sum in sent:
            sent_by.setdefault(body_sum, set()).update(owners.get(name, ()))
    for body_sum, params in sent_by.items():
        if params and body_sum in collectives:
            weights = frozenset(params)
            work = shared.setdefault((weights, ()), _OwnedWork(weights))
            work.add_collective(collectives[body_sum])


def _split_among_weights(sizes: dict[str, int], shared: Iterable[_OwnedWork]
                         ) -> dict[str, dict[str, float]]:
    """:func:`per_weight_rows`' rows: each weight's bytes, and every shared sum split
    among the weights owning it in proportion to their sizes."""
    rows = {p: {"bytes": float(size), **{column: 0.0 for column in _OWNED_COLUMNS}}
            for p, size in sizes.items()}
    for work in shared:
        total = sum(sizes[p] for p in work.weights) or 1
        for param in sorted(work.weights):
            share, row = sizes[param] / total, rows[param]
            for column in _OWNED_COLUMNS:
                row[column] += getattr(work, column) * share
    return rows


#: The per-weight columns that :class:`_OwnedWork` sums.
_OWNED_COLUMNS = ("update_seconds", "update_flops", "collective_bytes", "gathered_bytes",
                  "collective_seconds")


@dataclass
class _OwnedWork:
    """The work of instructions owned by the same weights (split by their sizes)."""

    weights: frozenset[str]
    update_seconds: float = 0.0
    update_flops: float = 0.0
    #: What the gradient's collectives send (its sum; "gradient sent").
    collective_bytes: float = 0.0
    #: What the all-gathers of a sharded update's new weights send: the weight's traffic,
    #: not its gradient's.
    gathered_bytes: float = 0.0
    #: The seconds of both.
    collective_seconds: float = 0.0

    def add_collective(self, estimate: InstructionEstimate) -> None:
        """The bytes ``estimate``'s collective sends and its seconds, as often as it runs."""
        assert estimate.collective is not None
        sent = estimate.collective.bytes_sent * estimate.runs
        if estimate.opcode in ALL_GATHERS:
            self.gathered_bytes += sent
        else:
            self.collective_bytes += sent
        self.collective_seconds += estimate.seconds


def _is_junction(comp: Computation, inst: Instruction) -> bool:
    """Where the work of several weights meets: buckets, tuples, tuple collectives,
    and scalar work broadcast to every update (all operands scalars)."""
    if inst.opcode in ("concatenate", "tuple"):
        return True
    if inst.opcode in COLLECTIVE_KINDS and len(inst.operands) > 1:
        return True
    if inst.opcode == "get-tuple-element":  # one element read (its tuple is the junction)
        return False
    return bool(inst.operands) and all(elements(comp[o].shape) <= 1 for o in inst.operands)
