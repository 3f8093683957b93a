"""Cross-replica sharding of the weight update (Xu et al. 2020) on HLO records.

Per computation holding gradient all-reduces (the entry, or a training loop's body):

* ``all-reduce(g)`` → ``reduce-scatter`` of ``g`` in the shard format (transpose to the
  format's order if needed, reshape to ``[E]``, zero-pad to ``[N·L]``), same groups and
  mode, a fresh channel id when the module uses them; with the combined strategy several
  gradients share one reduce-scatter (``[N, L_i]`` pieces concatenated along dim 1);
* every region op (see :mod:`hlo_shard.analysis.update_region`) is re-emitted on ``[L]``
  shards; replicated operands are sliced locally at ``position × L`` (XLA's own index
  pattern: ``replica-id``/``partition-id`` → optional u32 table lookup → ``multiply``);
  broadcasts of scalars become ``[L]`` broadcasts; reductions mask the padded lanes with
  the reducer's neutral value, reduce locally and all-reduce one element;
* a sharded value needed whole is all-gathered (then un-padded, reshaped, transposed back
  to its shape and layout) right before its first such user;
* ``--state sharded``: optimizer-state parameters (used only by the region, paired with the
  output that is their next value) and those outputs become ``[L]`` shards.

Whatever the analysis cannot prove safe is left as it was, and explained.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx

from hlo_shard.analysis.collectives import (DeviceGroups, GradientAllReduce, GroupMode,
                                            find_gradient_all_reduces, participant_id_source)
from hlo_shard.analysis.replication import (ParamOverrides, Replication, all_true,
                                            analyze_replication)
from hlo_shard.analysis.update_region import (Leaf, RegionOp, RegionOptions, RegionPlan,
                                              ShardFormat, collect_leaves, is_scalar_broadcast,
                                              natural_perm, plan_region)
from hlo_shard.errors import HloShardError
from hlo_shard.graph import Rewriter, call_graph, dataflow_graph, topological_order
from hlo_shard.ir import (ArrayShape, ComputationRef, Computation, Ident, Instruction, Layout,
                          Module, Raw, SliceRanges, TupleShape)
from hlo_shard.passes.base import PassResult

STATE_MODES = ("gathered", "sharded")
STRATEGIES = ("auto", "per-tensor", "combined")

#: Opcodes whose ``channel_id`` must be unique (send/recv pairs share theirs on purpose).
_COLLECTIVES = frozenset({
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
    "collective-permute", "collective-broadcast", "all-reduce-start", "all-gather-start",
    "collective-permute-start",
})


@dataclass(frozen=True)
class ShardingOptions:
    num_replicas: int | None = None
    state: str = "gathered"
    strategy: str = "auto"
    min_shard_bytes: int = 0
    #: Largest combined reduce-scatter / all-gather (XLA's combiners default to ~30 MiB).
    bucket_bytes: int = 32 << 20
    #: ``auto``: gradients at least this large get their own collectives (None: from the
    #: α-β crossover of the CPU profile, ≈ 10 × α × β).
    per_tensor_bytes: int | None = None
    overrides: ParamOverrides = ParamOverrides()


@dataclass
class Explanation:
    """One ``--explain`` row: a gradient all-reduce (or one element of a tuple one)."""

    computation: str
    all_reduce: str
    index: int | None
    shape: str
    bytes: int
    sharded: bool
    reason: str = ""
    ops_moved: int = 0
    formatting_copies: int = 0
    saved_flops: float = 0.0
    collective: str = ""

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class SignatureEntry:
    """A parameter or output leaf of the rewritten entry, for the manifest."""

    index: int
    kind: str  # "replicated" | "per-device" | "sharded"
    shape: ArrayShape  # original
    name: str = ""
    format: ShardFormat | None = None
    groups: tuple[tuple[int, ...], ...] = ()


@dataclass
class ShardingReport:
    #: Devices the module runs on (replicas × partitions), not the group size.
    devices: int
    explanations: list[Explanation] = field(default_factory=list)
    parameters: list[SignatureEntry] = field(default_factory=list)
    outputs: list[SignatureEntry] = field(default_factory=list)
    #: (output leaf, parameter) pairs of the original signature (input_output_alias).
    feedback: list[tuple[int, int]] | None = None
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------ the pass


class WeightUpdateSharding:
    name = "weight-update-sharding"

    def __init__(self, options: ShardingOptions = ShardingOptions()) -> None:
        if options.state not in STATE_MODES:
            raise HloShardError(f"--state must be one of {', '.join(STATE_MODES)}")
        if options.strategy not in STRATEGIES:
            raise HloShardError(f"--strategy must be one of {', '.join(STRATEGIES)}")
        self.options = options

    def apply(self, module: Module) -> PassResult:
        found = find_gradient_all_reduces(module)
        groups = _data_parallel_groups(module, found)
        if self.options.num_replicas is not None and groups is not None \
                and self.options.num_replicas != groups.size:
            raise HloShardError(f"--num-replicas {self.options.num_replicas} does not match "
                                f"the module's data-parallel group size {groups.size}")
        report = ShardingReport(module.replica_count * module.num_partitions)
        regions = _region_computations(module)
        sources = _gradient_sources(module, found)
        replication = analyze_replication(module, groups, self.options.overrides, sources)
        channels = ChannelIds(module)
        changes = []
        state_plan: dict[int, StatePair] = {}
        by_comp: dict[str, list[GradientAllReduce]] = defaultdict(list)
        for ar in found:
            reason = ar.reason
            if not reason and ar.computation not in regions:
                reason = "inside a called computation (fusion/call/conditional): not supported"
            if not reason and ar.groups.key() != groups.key():
                reason = "its groups differ from the data-parallel group of the module"
            if reason:
                report.explanations.append(_rejected(module, ar, reason))
            else:
                by_comp[ar.computation].append(ar)
        output_kinds = _output_kinds(module, replication)
        for comp_name, ars in by_comp.items():
            comp = module.computation(comp_name)
            changes += _forward_tuple_elements(comp)
            leaves, rejected = collect_leaves(module, comp, ars)
            report.explanations += [_rejected(module, ar, why) for ar, why in rejected]
            if not leaves:
                continue
            plan = plan_region(module, comp, leaves, replication,
                               RegionOptions(self.options.min_shard_bytes))
            state = {}
            if comp.is_entry and self.options.state == "sharded" and plan.active:
                state = _pair_state(module, comp, plan, replication)
                state_plan = state
            rewrite = _ComputationRewrite(module, comp, plan, self.options, channels, state)
            collectives = rewrite.run() if plan.active else {}
            changes += rewrite.rw.changes if plan.active else []
            for leaf in leaves:
                report.explanations.append(_explain(comp_name, leaf, collectives))
        renumbered = channels.dedupe()
        if renumbered:
            report.notes.append(f"renumbered {renumbered} duplicate collective channel id(s)")
        if state_plan:
            _update_entry_layout(module)
        _fill_signature(module, report, replication, state_plan, groups, output_kinds)
        report.feedback = _alias_pairs(module) or None
        changed = bool(changes) or bool(renumbered)
        return PassResult(module, changed, changes, [report])


# ----------------------------------------------------------------- module-level facts


def _data_parallel_groups(module: Module, found: list[GradientAllReduce]) -> DeviceGroups | None:
    """The groups carrying the most gradient bytes: the data-parallel axis."""
    weight: dict[tuple, int] = defaultdict(int)
    first: dict[tuple, DeviceGroups] = {}
    for ar in found:
        if ar.groups is None:
            continue
        inst = module.computation(ar.computation)[ar.name]
        size = inst.shape.byte_size
        weight[ar.groups.key()] += size
        first.setdefault(ar.groups.key(), ar.groups)
    if not weight:
        return None
    return first[max(weight, key=weight.get)]


def _region_computations(module: Module) -> set[str]:
    """The entry and every while body reachable from it through while loops only."""
    names = {module.entry.name}
    stack = [module.entry]
    while stack:
        comp = stack.pop()
        for inst in comp.instructions:
            if inst.opcode == "while":
                body = inst.attr("body").name
                if body not in names:
                    names.add(body)
                    stack.append(module.computation(body))
    return names


def _gradient_sources(module: Module, found: list[GradientAllReduce]) -> dict[str, set[str]]:
    """Per computation: the instructions producing all-reduced gradients — the
    all-reduces themselves, or the loops/calls whose computations contain them."""
    graph = call_graph(module)
    holders = {ar.computation for ar in found}
    sources: dict[str, set[str]] = defaultdict(set)
    for ar in found:
        sources[ar.computation].add(ar.name)
    for comp in module.computations:
        for inst in comp.instructions:
            for callee in inst.called_computations():
                if (nx.descendants(graph, callee) | {callee}) & holders:
                    sources[comp.name].add(inst.name)
    return sources


def _forward_tuple_elements(comp: Computation) -> list:
    """``get-tuple-element(tuple(a, b, …), i)`` → the ``i``-th operand, so that the region
    flows through the tuples jax wraps around shard_map outputs. Pure simplification."""
    rw = Rewriter(comp)
    forwarded = False
    for inst in list(comp.instructions):
        if inst.opcode != "get-tuple-element" or inst.name == comp.root_name:
            continue
        source = comp[inst.operands[0]]
        if source.opcode != "tuple":
            continue
        rw.replace_all_uses_with(inst.name, source.operands[inst.attr("index")])
        rw.erase(inst.name)
        forwarded = True
        if not rw.users(source.name) and source.name != comp.root_name:
            rw.erase(source.name)
    return rw.changes if forwarded else []


class ChannelIds:
    """Fresh channel ids for a module that uses them (``max + 1``, as XLA does)."""

    def __init__(self, module: Module) -> None:
        self.module = module
        ids = [i.attr("channel_id") for c in module.computations for i in c.instructions
               if i.attr("channel_id") is not None]
        self.uses_channels = bool(ids)
        self.next = max(ids, default=0) + 1

    def fresh(self) -> int:
        value, self.next = self.next, self.next + 1
        return value

    def dedupe(self) -> int:
        """Give every collective after the first with a shared id a fresh one."""
        seen: set[int] = set()
        renumbered = 0
        for comp in self.module.computations:
            for inst in comp.instructions:
                channel = inst.attr("channel_id")
                if channel is None or inst.opcode not in _COLLECTIVES:
                    continue
                if channel in seen:
                    inst.attributes["channel_id"] = self.fresh()
                    renumbered += 1
                else:
                    seen.add(channel)
        return renumbered


# --------------------------------------------------------------------- optimizer state


def _alias_pairs(module: Module) -> list[tuple[int, int]]:
    """(output index, parameter number) from ``input_output_alias`` (top-level arrays)."""
    raw = module.header.get("input_output_alias")
    text = raw.text if isinstance(raw, Raw) else ""
    return [(int(o), int(p)) for o, p in
            re.findall(r"\{\s*(\d+)\s*\}\s*:\s*\(\s*(\d+)\s*,\s*\{\s*\}", text)]


@dataclass(frozen=True)
class StatePair:
    """Optimizer state kept sharded: its parameter's next value is output ``output``."""

    output: int
    value: str
    format: ShardFormat
    #: The parameter's and the output's original (full) shapes.
    shape: ArrayShape
    output_shape: ArrayShape


def _flattenable(fmt: ShardFormat, shape: ArrayShape) -> bool:
    """The manifest can describe ``fmt`` for ``shape``: physical or row-major order."""
    return fmt.dims == shape.dims and (fmt.perm == natural_perm(shape) or fmt.is_row_major)


def _pair_state(module: Module, comp: Computation, plan: RegionPlan,
                replication: Replication) -> dict[int, StatePair]:
    """Parameter number → (output index, region value) for optimizer state that can stay
    sharded: the parameter is used only by region ops, in the format of the output that
    is its next value, and both are in physical order (the manifest's flatten order)."""
    root = comp.root
    if root.opcode != "tuple":
        return {}
    graph = dataflow_graph(comp)
    params = {p.parameter_number: p for p in comp.parameters()}
    candidates: dict[int, ShardFormat] = {}
    for number, param in params.items():
        users = set(graph.successors(param.name))
        if not isinstance(param.shape, ArrayShape) or not users or not users <= set(plan.ops) \
                or not replication.is_replicated(comp.name, param.name):
            continue
        formats = {plan.ops[u].operand_format for u in users}
        if len(formats) == 1 and _flattenable(fmt := formats.pop(), param.shape):
            candidates[number] = fmt
    outputs: dict[int, str] = {}
    for k, value in enumerate(root.operands):
        fmt = plan.sharded.get(value)
        if fmt is not None and _flattenable(fmt, root.shape.elements[k]):
            outputs[k] = value
    pairs: dict[int, StatePair] = {}

    def pair(number: int, k: int) -> None:
        pairs[number] = StatePair(k, outputs[k], candidates[number], params[number].shape,
                                  root.shape.elements[k])

    def fits(number: int, k: int) -> bool:
        param = params[number]
        return plan.sharded[outputs[k]] == candidates[number] and \
            root.shape.elements[k].element_type == param.shape.element_type

    aliases = _alias_pairs(module)
    if aliases:
        for k, number in aliases:
            if number in candidates and k in outputs and fits(number, k):
                pair(number, k)
        return pairs
    # No aliasing: an output depending on exactly one remaining candidate of its kind.
    remaining = dict(candidates)
    open_outputs = dict(outputs)
    progress = True
    while progress:
        progress = False
        for k, value in list(open_outputs.items()):
            ancestors = nx.ancestors(graph, value)
            matches = [n for n in remaining if params[n].name in ancestors and fits(n, k)]
            if len(matches) == 1:
                pair(matches[0], k)
                del remaining[matches[0]]
                del open_outputs[k]
                progress = True
    return pairs


def _update_entry_layout(module: Module) -> None:
    from hlo_shard.printer import format_shape

    entry = module.entry
    if "entry_computation_layout" not in module.header:
        return
    params = ", ".join(format_shape(p.shape) for p in entry.parameters())
    module.header["entry_computation_layout"] = Raw(
        f"{{({params})->{format_shape(entry.root.shape)}}}")


def _fill_signature(module: Module, report: ShardingReport, replication: Replication,
                    state: dict[int, StatePair], groups: DeviceGroups | None,
                    output_kinds: list[str]) -> None:
    entry = module.entry
    sharded_outputs = {pair.output: pair for pair in state.values()}
    explicit_groups = () if groups is None or groups.is_trivial else groups.groups
    for param in entry.parameters():
        number = param.parameter_number
        if number in state:
            pair = state[number]
            report.parameters.append(SignatureEntry(number, "sharded", pair.shape, param.name,
                                                    pair.format, explicit_groups))
            continue
        flags = next((p.flags for p in replication.params if p.number == number), False)
        kind = "replicated" if all_true(flags) else "per-device"
        for _, leaf in _leaves(param.shape):
            report.parameters.append(SignatureEntry(number, kind, leaf, param.name))
    root = entry.root
    outputs = list(root.operands) if root.opcode == "tuple" else [root.name]
    shapes = list(root.shape.elements) if isinstance(root.shape, TupleShape) else [root.shape]
    for k, (value, shape) in enumerate(zip(outputs, shapes)):
        if k in sharded_outputs:
            pair = sharded_outputs[k]
            report.outputs.append(SignatureEntry(k, "sharded", pair.output_shape, value,
                                                 pair.format, explicit_groups))
            continue
        report.outputs.append(SignatureEntry(k, output_kinds[k], shape, value))


def _output_kinds(module: Module, replication: Replication) -> list[str]:
    """Per output of the original entry: replicated or per-device."""
    entry = module.entry
    root = entry.root
    flags = replication.flags(entry.name, root.name)
    if isinstance(root.shape, TupleShape):
        leaf_flags = flags if isinstance(flags, tuple) else (flags,) * len(root.shape.elements)
        return ["replicated" if all_true(f) else "per-device" for f in leaf_flags]
    return ["replicated" if all_true(flags) else "per-device"]


def _leaves(shape):
    if isinstance(shape, TupleShape):
        return list(shape.leaves())
    return [((), shape)]


# --------------------------------------------------------------------- explanations


def _rejected(module: Module, ar: GradientAllReduce, reason: str) -> Explanation:
    from hlo_shard.printer import format_shape

    inst = module.computation(ar.computation)[ar.name]
    return Explanation(ar.computation, ar.name, None, format_shape(inst.shape),
                       inst.shape.byte_size, False, reason)


def _explain(comp_name: str, leaf: Leaf, collectives: dict[str, str]) -> Explanation:
    from hlo_shard.printer import format_shape

    if not leaf.sharded:
        return Explanation(comp_name, leaf.all_reduce, leaf.index, format_shape(leaf.shape),
                           leaf.byte_size, False, leaf.reason)
    return Explanation(comp_name, leaf.all_reduce, leaf.index, format_shape(leaf.shape),
                       leaf.byte_size, True, "", leaf.ops_moved, leaf.formatting_copies,
                       leaf.saved_flops, collectives.get(leaf.label, ""))


# ------------------------------------------------------------------------ the rewrite


def _default_layout(rank: int) -> Layout:
    return Layout(tuple(range(rank - 1, -1, -1)))


@dataclass
class _Bucket:
    element_type: str
    items: list  # leaves (reduce-scatter side) or value names (all-gather side)
    nbytes: int = 0


class _ComputationRewrite:
    """Rewrites one computation according to its :class:`RegionPlan`."""

    def __init__(self, module: Module, comp: Computation, plan: RegionPlan,
                 options: ShardingOptions, channels: ChannelIds,
                 state: dict[int, StatePair]) -> None:
        self.module, self.comp, self.plan, self.options = module, comp, plan, options
        self.channels = channels
        self.state = state
        self.rw = Rewriter(comp)
        self.groups = plan.groups
        self.n = plan.groups.size
        self.template = comp[plan.template]
        self.with_layouts = isinstance(self.template.shape, ArrayShape) and \
            self.template.shape.layout is not None or isinstance(self.template.shape, TupleShape)
        self.first = next(i.name for i in comp.instructions if i.opcode != "parameter") \
            if any(i.opcode != "parameter" for i in comp.instructions) else comp.root_name
        self.shard_of: dict[str, str] = {}
        self._cache: dict[tuple, str] = {}
        self._erase: list[str] = []
        self.collective_of: dict[str, str] = {}

    # Shapes and small pieces -----------------------------------------------------------
    def shape(self, element_type: str, dims: tuple[int, ...]) -> ArrayShape:
        layout = _default_layout(len(dims)) if self.with_layouts and dims else None
        return ArrayShape(element_type, tuple(dims), (), layout)

    def add(self, opcode: str, shape, operands, name: str | None = None, **attributes) -> str:
        return self.rw.add(opcode, shape, operands, name=name, **attributes).name

    def prologue(self, key: tuple, build) -> str:
        """A value computed once at the top of the computation (constants, ids, offsets)."""
        if key not in self._cache:
            with self.rw.inserting_before(self.first):
                self._cache[key] = build()
        return self._cache[key]

    def constant(self, element_type: str, literal: str) -> str:
        def build() -> str:
            inst = Instruction(self.rw.fresh_name("constant"), "constant",
                               self.shape(element_type, ()), literal=literal)
            return self.rw.add_instruction(inst).name
        return self.prologue(("constant", element_type, literal), build)

    def position(self) -> str:
        """u32[] position of this device within its group (§13.4 of the reference)."""
        def build() -> str:
            u32 = self.shape("u32", ())
            source = participant_id_source(self.module, self.groups.mode)
            if source == "flattened":
                replica = self.add("replica-id", u32, [])
                partition = self.add("partition-id", u32, [])
                count = self.constant("u32", str(self.module.num_partitions))
                scaled = self.add("multiply", u32, [replica, count])
                pid = self.add("add", u32, [scaled, partition])
            else:
                pid = self.add(source, u32, [])
            if self.groups.is_trivial and self.groups.num_ids == self.n:
                return pid
            table = self.groups.position_table()
            literal = "{" + ", ".join(map(str, table)) + "}"
            inst = Instruction(self.rw.fresh_name("shard_positions"), "constant",
                               self.shape("u32", (len(table),)), literal=literal)
            table_name = self.rw.add_instruction(inst).name
            entry = self.add("dynamic-slice", self.shape("u32", (1,)), [table_name, pid],
                             dynamic_slice_sizes=(1,))
            return self.add("reshape", u32, [entry], name="shard_position")
        return self.prologue(("position",), build)

    def offset(self, shard_len: int) -> str:
        def build() -> str:
            index = self.position()
            length = self.constant("u32", str(shard_len))
            return self.add("multiply", self.shape("u32", ()), [index, length],
                            name="shard_offset")
        return self.prologue(("offset", shard_len), build)

    def collective_attrs(self, **extra) -> dict:
        """Attributes of a new collective over the data-parallel group, in XLA's order."""
        attrs: dict = {}
        if self.template.attr("channel_id") is not None:
            attrs["channel_id"] = self.channels.fresh()
        groups = self.template.attr("replica_groups")
        if groups is not None:
            attrs["replica_groups"] = groups
        if self.template.attr("use_global_device_ids") is not None:
            attrs["use_global_device_ids"] = self.template.attr("use_global_device_ids")
        dims = extra.pop("dimensions", None)
        if dims is not None:
            attrs["dimensions"] = dims
        attrs.update(extra)
        return attrs

    # Formatting -------------------------------------------------------------------------
    def flat_padded(self, value: str, fmt: ShardFormat) -> str:
        """``value`` (full) in ``fmt``'s order, flat and zero-padded: ``[N·L]``."""
        inst = self.comp[value]
        element_type = inst.shape.element_type
        current = value
        if fmt.perm != tuple(range(len(fmt.dims))):
            current = self.add("transpose", self.shape(element_type, fmt.transposed_dims),
                               [current], name=f"{value}.formatted", dimensions=fmt.perm)
        if inst.shape.dims != (fmt.elements,) or current != value:
            current = self.add("reshape", self.shape(element_type, (fmt.elements,)), [current],
                               name=f"{value}.flat")
        if fmt.padding:
            zero = self.constant(element_type, "false" if element_type == "pred" else "0")
            current = self.add("pad", self.shape(element_type, (fmt.padded,)), [current, zero],
                               name=f"{value}.padded", padding=Raw(f"0_{fmt.padding}"))
        return current

    def local_slice(self, value: str, fmt: ShardFormat) -> str:
        flat = self.flat_padded(value, fmt)
        element_type = self.comp[value].shape.element_type
        return self.add("dynamic-slice", self.shape(element_type, (fmt.shard_len,)),
                        [flat, self.offset(fmt.shard_len)], name=f"{value}.shard",
                        dynamic_slice_sizes=(fmt.shard_len,))

    def replicated_shard(self, value: str, fmt: ShardFormat) -> str:
        """This device's shard of a replicated full value (no communication)."""
        key = ("shard", value, fmt)
        if key not in self._cache:
            inst = self.comp[value]
            if is_scalar_broadcast(self.comp, value):
                self._cache[key] = self.add(
                    "broadcast", self.shape(inst.shape.element_type, (fmt.shard_len,)),
                    [inst.operands[0]], name=f"{value}.shard", dimensions=())
            else:
                self._cache[key] = self.local_slice(value, fmt)
        return self._cache[key]

    # Reduce-scatter side ------------------------------------------------------------------
    def scatter(self, leaves: list[Leaf]) -> None:
        """One reduce-scatter for ``leaves`` (all of one element type), placed before the
        last of their all-reduces; records each leaf's ``[L]`` shard."""
        anchor = max((leaf.all_reduce for leaf in leaves), key=self.comp.position)
        ar = self.comp[leaves[0].all_reduce]
        element_type = leaves[0].shape.element_type
        with self.rw.inserting_before(anchor):
            flats = [self.flat_padded(leaf.operand, leaf.format) for leaf in leaves]
            if len(leaves) == 1:
                total, operand = leaves[0].format.shard_len, flats[0]
            else:
                pieces = [self.add("reshape", self.shape(element_type, (self.n, leaf.format.shard_len)),
                                   [flat], name=f"{leaf.operand}.rows")
                          for leaf, flat in zip(leaves, flats)]
                total = sum(leaf.format.shard_len for leaf in leaves)
                rows = self.add("concatenate", self.shape(element_type, (self.n, total)), pieces,
                                name="gradient_bucket", dimensions=(1,))
                operand = self.add("reshape", self.shape(element_type, (self.n * total,)), [rows],
                                   name="gradient_bucket.flat")
            scattered = self.add("reduce-scatter", self.shape(element_type, (total,)), [operand],
                                 name="reduce-scatter",
                                 **self.collective_attrs(dimensions=(0,),
                                                         to_apply=ar.attr("to_apply")))
            start = 0
            for leaf in leaves:
                length = leaf.format.shard_len
                shard = scattered if len(leaves) == 1 else self.add(
                    "slice", self.shape(element_type, (length,)), [scattered],
                    name=f"{leaf.values[0]}.shard", slice=SliceRanges(((start, start + length, 1),)))
                start += length
                for value in leaf.values:
                    self.shard_of[value] = shard
                self.collective_of[leaf.label] = scattered

    # Region ops ---------------------------------------------------------------------------
    def operand_shard(self, operand: str, fmt: ShardFormat) -> str:
        if operand in self.shard_of:
            return self.shard_of[operand]
        shape = self.comp[operand].shape
        if isinstance(shape, ArrayShape) and shape.is_scalar:
            return operand
        return self.replicated_shard(operand, fmt)

    def shard_op(self, name: str, op: RegionOp) -> None:
        inst = self.comp[name]
        with self.rw.inserting_before(name):
            operands = [self.operand_shard(o, op.operand_format) for o in inst.operands]
            if inst.opcode in ("reshape", "bitcast", "transpose"):
                self.shard_of[name] = operands[0]  # same flat order: the shard is unchanged
                return
            attributes = {k: v for k, v in inst.attributes.items() if k != "sharding"}
            new = Instruction(self.rw.fresh_name(f"{name}.shard"), inst.opcode,
                              self.shape(inst.shape.element_type, (op.result_format.shard_len,)),
                              operands, attributes)
            self.shard_of[name] = self.rw.add_instruction(new).name

    def reduce_op(self, name: str, op: RegionOp) -> None:
        """Masked local reduction + one-element all-reduce over the group."""
        inst = self.comp[name]
        fmt = op.operand_format
        source, init = inst.operands
        element_type = self.comp[source].shape.element_type
        out_type = inst.shape.element_type
        with self.rw.inserting_before(name):
            shard = self.operand_shard(source, fmt)
            neutral = self.constant(element_type, op.neutral)
            if fmt.padding:
                neutral_lanes = self.add("broadcast", self.shape(element_type, (fmt.shard_len,)),
                                         [neutral], dimensions=())
                shard = self.add("select", self.shape(element_type, (fmt.shard_len,)),
                                 [self.valid_lanes(fmt), shard, neutral_lanes],
                                 name=f"{name}.masked")
            local = self.add("reduce", self.shape(out_type, ()),
                             [shard, self.constant(out_type, op.neutral)],
                             name=f"{name}.local", dimensions=(0,),
                             to_apply=inst.attr("to_apply"))
            result = self.add("all-reduce", self.shape(out_type, ()), [local],
                              name=f"{name}.sum",
                              **self.collective_attrs(to_apply=inst.attr("to_apply")))
            if not _is_constant(self.comp[init], op.neutral):
                result = self.add(op.reducer, self.shape(out_type, ()), [result, init])
            if not inst.shape.is_scalar:
                result = self.add("reshape", inst.shape, [result])
        self.rw.replace_all_uses_with(name, result)
        self._erase.append(name)

    def valid_lanes(self, fmt: ShardFormat) -> str:
        """pred[L]: which lanes of this device's shard hold real (not padding) elements."""
        key = ("valid", fmt.shard_len, fmt.elements)
        if key not in self._cache:
            length = fmt.shard_len
            lanes = self.add("iota", self.shape("u32", (length,)), [], iota_dimension=0)
            start = self.add("broadcast", self.shape("u32", (length,)),
                             [self.offset(length)], dimensions=())
            index = self.add("add", self.shape("u32", (length,)), [lanes, start])
            limit = self.add("broadcast", self.shape("u32", (length,)),
                             [self.constant("u32", str(fmt.elements))], dimensions=())
            self._cache[key] = self.add("compare", self.shape("pred", (length,)),
                                        [index, limit], name="valid_lanes",
                                        direction=Ident("LT"))
        return self._cache[key]

    # All-gather side ---------------------------------------------------------------------
    def gather(self, values: list[str], anchor: str) -> dict[str, str]:
        """All-gather the shards of ``values`` (one element type) before ``anchor`` and
        bring each back to its full shape and layout."""
        out: dict[str, str] = {}
        element_type = self.comp[values[0]].shape.element_type
        with self.rw.inserting_before(anchor):
            formats = [self.plan.sharded[v] for v in values]
            shards = [self.shard_of[v] for v in values]
            if len(values) == 1:
                total = formats[0].shard_len
                operand = shards[0]
            else:
                total = sum(f.shard_len for f in formats)
                operand = self.add("concatenate", self.shape(element_type, (total,)), shards,
                                   name="update_bucket", dimensions=(0,))
            gathered = self.add("all-gather", self.shape(element_type, (self.n * total,)),
                                [operand], name="all-gather",
                                **self.collective_attrs(dimensions=(0,)))
            if len(values) > 1:
                gathered_rows = self.add("reshape", self.shape(element_type, (self.n, total)),
                                         [gathered], name="all-gather.rows")
            start = 0
            for value, fmt in zip(values, formats):
                flat = gathered
                if len(values) > 1:
                    rows = self.add("slice", self.shape(element_type, (self.n, fmt.shard_len)),
                                    [gathered_rows], name=f"{value}.rows",
                                    slice=SliceRanges(((0, self.n, 1),
                                                       (start, start + fmt.shard_len, 1))))
                    flat = self.add("reshape", self.shape(element_type, (fmt.padded,)), [rows])
                start += fmt.shard_len
                out[value] = self.unformat(value, flat, fmt)
        return out

    def unformat(self, value: str, flat: str, fmt: ShardFormat) -> str:
        """``[N·L]`` gathered vector → the full value in ``value``'s shape and layout."""
        shape = self.comp[value].shape
        element_type = shape.element_type
        if fmt.padding:
            flat = self.add("slice", self.shape(element_type, (fmt.elements,)), [flat],
                            slice=SliceRanges(((0, fmt.elements, 1),)))
        if fmt.perm == tuple(range(len(fmt.dims))):
            if shape.dims == (fmt.elements,):
                return flat
            return self.add("reshape", shape, [flat], name=f"{value}.gathered")
        ordered = self.add("reshape", self.shape(element_type, fmt.transposed_dims), [flat])
        inverse = tuple(sorted(range(len(fmt.perm)), key=lambda d: fmt.perm[d]))
        return self.add("transpose", shape, [ordered], name=f"{value}.gathered",
                        dimensions=inverse)

    # Driver -------------------------------------------------------------------------------
    def run(self) -> dict[str, str]:
        """Rewrite; returns leaf label → the collective that now carries it."""
        plan = self.plan
        self._seed_state()
        for bucket in self._buckets(plan.active, lambda leaf: leaf.byte_size,
                                    lambda leaf: leaf.shape.element_type):
            self.scatter(bucket.items)
        for name, op in plan.ops.items():
            if op.kind == "reduce":
                self.reduce_op(name, op)
            else:
                self.shard_op(name, op)
        self._gather_boundaries()
        self._rebuild_all_reduces()
        self._erase.extend(reversed(list(plan.ops)))
        self._erase_dead()
        order = topological_order(self.comp)
        if [i.name for i in order] != [i.name for i in self.comp.instructions]:
            self.comp.instructions[:] = order
            self.comp.reindex()
        return {label: self._collective_label(name) for label, name in self.collective_of.items()}

    def _collective_label(self, name: str) -> str:
        shared = sum(1 for n in self.collective_of.values() if n == name)
        return f"{name} (combined, {shared} tensors)" if shared > 1 else name

    def _buckets(self, items: list, size, element_type) -> list[_Bucket]:
        """Group items by element type under the strategy: one per item (per-tensor),
        greedy buckets up to ``bucket_bytes`` (combined), or per-tensor for large items and
        buckets for the rest (auto)."""
        strategy = self.options.strategy
        large = self.options.per_tensor_bytes if self.options.per_tensor_bytes is not None \
            else _crossover_bytes(self.n)
        buckets: list[_Bucket] = []
        open_buckets: dict[str, _Bucket] = {}
        for item in items:
            nbytes, etype = size(item), element_type(item)
            if strategy == "per-tensor" or (strategy == "auto" and nbytes >= large):
                buckets.append(_Bucket(etype, [item], nbytes))
                continue
            bucket = open_buckets.get(etype)
            if bucket is None or bucket.nbytes + nbytes > self.options.bucket_bytes:
                bucket = open_buckets[etype] = _Bucket(etype, [], 0)
                buckets.append(bucket)
            bucket.items.append(item)
            bucket.nbytes += nbytes
        return buckets

    def _seed_state(self) -> None:
        """Sharded optimizer state: the parameter *is* its shard."""
        params = {p.parameter_number: p for p in self.comp.parameters()}
        for number, pair in self.state.items():
            param, fmt = params[number], pair.format
            param.shape = self.shape(param.shape.element_type, (fmt.shard_len,))
            if "sharding" in param.attributes or self.module.num_partitions > 1:
                param.attributes["sharding"] = Raw(_shard_sharding(self.groups))
            self._cache[("shard", param.name, fmt)] = param.name

    def _gather_boundaries(self) -> None:
        comp = self.comp
        root = comp.root
        state_outputs = {pair.output: pair.value for pair in self.state.values()}
        position = {inst.name: i for i, inst in enumerate(comp.instructions)}
        anchors: dict[str, list[str]] = defaultdict(list)
        needs: dict[str, list[str]] = {}
        for value, users in self.plan.boundary.items():
            users = list(users)
            if root.name in users and root.opcode == "tuple" and all(
                    state_outputs.get(k) == value for k, o in enumerate(root.operands)
                    if o == value):
                users.remove(root.name)  # only sharded-state outputs use it: no gather
            if not users:
                continue
            needs[value] = users
            first = min(users, key=lambda u: position[u] if u else len(position))
            anchors[first or root.name].append(value)
        gathered: dict[str, str] = {}
        for anchor, values in anchors.items():
            values.sort(key=lambda v: position[v])
            for bucket in self._buckets(values, lambda v: comp[v].shape.byte_size,
                                        lambda v: comp[v].shape.element_type):
                gathered.update(self.gather(bucket.items, anchor))
        for value, users in needs.items():
            for user in users:
                if not user:
                    self.rw.set_root(gathered[value])
                    continue
                inst = comp[user]
                for i, operand in enumerate(inst.operands):
                    if operand != value:
                        continue
                    sharded_state = user == root.name and state_outputs.get(i) == value
                    self.rw.set_operand(inst, i, self.shard_of[value] if sharded_state
                                        else gathered[value])
        if root.opcode == "tuple" and state_outputs:
            for k, value in state_outputs.items():
                if root.operands[k] == value:
                    self.rw.set_operand(root, k, self.shard_of[value])
            elements = list(root.shape.elements)
            for k in state_outputs:
                elements[k] = comp[root.operands[k]].shape
            root.shape = TupleShape(tuple(elements))

    def _rebuild_all_reduces(self) -> None:
        """Keep the unsharded elements of partly sharded tuple all-reduces."""
        by_ar: dict[str, list[Leaf]] = defaultdict(list)
        for leaf in self.plan.leaves:
            by_ar[leaf.all_reduce].append(leaf)
        for name, leaves in by_ar.items():
            sharded = [leaf for leaf in leaves if leaf.sharded]
            if not sharded:
                continue
            self._erase.extend(v for leaf in sharded for v in leaf.values if v != name)
            self._erase.append(name)
            kept = [leaf for leaf in leaves if not leaf.sharded]
            if not kept:
                continue
            ar = self.comp[name]
            shapes = tuple(leaf.shape for leaf in kept)
            shape = shapes[0] if len(kept) == 1 else TupleShape(shapes)
            attributes = dict(ar.attributes)
            if "channel_id" in attributes:
                attributes["channel_id"] = self.channels.fresh()
            with self.rw.inserting_before(name):
                new = self.rw.add_instruction(Instruction(
                    self.rw.fresh_name(name), "all-reduce", shape,
                    [leaf.operand for leaf in kept], attributes))
                for position, leaf in enumerate(kept):
                    for value in leaf.values:
                        if len(kept) == 1:
                            self.rw.replace_all_uses_with(value, new.name)
                            self._erase.append(value)
                        else:
                            self.comp[value].attributes["index"] = position
                            self.rw.set_operand(self.comp[value], 0, new.name)

    def _erase_dead(self) -> None:
        """Erase the replaced instructions, then operands of theirs left unused (users
        before producers, until nothing more goes)."""
        pending = set(self._erase)
        progress = True
        while progress:
            progress = False
            position = {inst.name: i for i, inst in enumerate(self.comp.instructions)}
            for name in sorted((n for n in pending if n in position), key=position.get,
                               reverse=True):
                inst = self.comp[name]
                if name == self.comp.root_name or self.rw.users(name) or inst.opcode in _KEEP:
                    continue
                self.rw.erase(name)
                pending.discard(name)
                pending.update(inst.operands)
                progress = True


#: Never erased as a side effect of the rewrite.
_KEEP = frozenset({"parameter", "custom-call", "infeed", "outfeed", "send", "recv", "rng",
                   "send-done", "recv-done", "after-all", "rng-get-and-update-state"})


def _is_constant(inst: Instruction, literal: str) -> bool:
    if inst.opcode != "constant" or inst.literal is None:
        return False
    try:
        return float(inst.literal) == float(literal)
    except ValueError:
        return inst.literal.strip() == literal


def _shard_sharding(groups: DeviceGroups) -> str:
    """SPMD annotation of an ``[L]`` shard whose global value is the padded flat vector:
    tiled over group positions, replicated across groups."""
    n = groups.size
    if len(groups.groups) == 1:
        return f"{{devices=[{n}]<=[{n}]}}" if groups.is_trivial else \
            "{devices=[%d]%s}" % (n, ",".join(map(str, groups.groups[0])))
    order = [groups.groups[k][j] for j in range(n) for k in range(len(groups.groups))]
    return "{devices=[%d,%d]%s last_tile_dim_replicate}" % (
        n, len(groups.groups), ",".join(map(str, order)))


def _crossover_bytes(n: int) -> int:
    """Size above which a gradient's own collective is bandwidth-bound (10 × α·β of the
    CPU profile, ≈ 1 MB): larger ones go per tensor under ``auto``."""
    try:
        from hlo_shard.profiles import load_profile

        link = load_profile("cpu-generic").interconnect.link_for(n)
        return int(10 * link.alpha_s * link.beta_bytes_per_s)
    except Exception:  # noqa: BLE001 - the estimate has a safe fallback
        return 1 << 20


__all__ = ["ChannelIds", "Explanation", "ShardingOptions", "ShardingReport", "SignatureEntry",
           "WeightUpdateSharding", "STATE_MODES", "STRATEGIES"]
