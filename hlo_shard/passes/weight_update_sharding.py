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
  output that is their next value) and those outputs become ``[L]`` shards;
* training loops (the region in a ``while`` body): every carried slot whose next value is a
  region value stays an ``[L]`` shard across iterations — sliced once before the loop,
  gathered once after it; optimizer state needs no collective in the loop at all, and the
  weights' all-gather moves to the top of the body, right before the forward pass.

Whatever the analysis cannot prove safe is left as it was, and explained.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import ClassVar, cast

import networkx as nx

from hlo_shard.analysis.collectives import (DeviceGroups, GradientAllReduce, ReasonCode,
                                            find_gradient_all_reduces, find_reduce_scatters,
                                            recovered_device_counts)
from hlo_shard.analysis.replication import (ParamOverrides, Replication, all_true,
                                            analyze_replication)
from hlo_shard.analysis.update_region import (PlannedLeaf, RegionOptions, RegionPlan, ShardFormat,
                                              Whole, collect_leaves, flattenable,
                                              plan_region, region_read_parameters)
from hlo_shard.errors import HloShardError
from hlo_shard.graph import (Change, DependencyCycle, ModuleRewriter, Rewriter, call_graph,
                             control_predecessors, dataflow_graph)
from hlo_shard.ir import (ArrayShape, Computation, ComputationRef, Instruction, Module, Raw,
                          Shape, TupleShape, shape_leaves)
from hlo_shard.passes.base import ModulePass, PassResult
from hlo_shard.passes.bucketing import (STRATEGIES, Bucketing, CollectivePricing,
                                        StrategyEstimate)
from hlo_shard.passes.region_rewrite import (RegionRewrite, RegionSnapshot, gather_before_use,
                                            narrowing_convert)
from hlo_shard.passes.shard_emitter import ChannelIds, Gathered, ShardEmitter
from hlo_shard.profiles import DEFAULT_PROFILE, HardwareProfile, load_profile

STATE_MODES = ("gathered", "sharded")
#: How the weights (parameters the update reads and the forward/backward pass uses, paired
#: with the output that is their next value) cross steps → the state mode it needs:
#: ``gathered`` whole on every device; ``sharded`` as ``[L]`` shards like the optimizer
#: state (all-gathered at the top of the step, for their forward/backward uses only).
PARAM_MODES = {"gathered": None, "sharded": "sharded"}
#: The smallest value of each integer option (None allowed where it has no default);
#: every front end (the CLI, ``shard_weight_update``, ``install()``) gets the same check.
OPTION_MINIMUMS = {"num_replicas": 1, "min_shard_bytes": 0, "bucket_bytes": 1}


@dataclass(frozen=True)
class ShardingOptions:
    """What the user asks of the pass (a front end's record: ``profile`` may still be a
    name or file); :class:`WeightUpdateSharding` checks and resolves it."""

    num_replicas: int | None = None
    state: str = "gathered"
    #: One of :data:`PARAM_MODES`.
    params: str = "gathered"
    strategy: str = "auto"
    min_shard_bytes: int = 0
    #: Largest combined reduce-scatter / all-gather (None: the profile's
    #: ``combine_threshold_bytes``, what XLA's combiners use on it).
    bucket_bytes: int | None = None
    #: The hardware the module will run on (a profile or its name/file): ``auto`` weighs
    #: collective latency against bucketing copies on it.
    profile: HardwareProfile | str = DEFAULT_PROFILE
    #: ``auto``: gradients at least this large get their own collectives (None: decided
    #: on ``profile``).
    per_tensor_bytes: int | None = None
    overrides: ParamOverrides = ParamOverrides()
    #: An accumulation loop's accumulator: ``auto``, ``whole`` or ``sharded``
    #: (:mod:`hlo_shard.passes.sharded_accumulator`).
    accumulator: str = "auto"


class ShardingOptionError(HloShardError):
    """An option the module contradicts, worded for the library (``num_replicas=8``);
    the command line rewords it for its flag (``--num-replicas 8``)."""

    def __init__(self, option: str, value: object, problem: str) -> None:
        super().__init__(f"{option}={value} {problem}")
        self.option, self.value, self.problem = option, value, problem


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
    #: Why it is not sharded, for machines (``""`` when sharded): a
    #: :class:`~hlo_shard.analysis.collectives.ReasonCode` value; ``reason`` in words.
    reason_code: str = ""

    @property
    def already_sharded(self) -> bool:
        return self.reason_code == ReasonCode.ALREADY_SHARDED.value

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class WeightChoice:
    """``params="sharded"``: one weight parameter, kept as a shard (and the element type
    its all-gather moves) or whole (why)."""

    parameter: int
    name: str
    sharded: bool
    #: The element type of its all-gather ("" when whole).
    gathered_type: str = ""
    reason: str = ""
    #: A :class:`~hlo_shard.analysis.collectives.ReasonCode` value: why whole, or why
    #: gathered in its own type; "" for a shard gathered narrow.
    reason_code: str = ""

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class SignatureEntry:
    """A parameter or output leaf of the rewritten entry, for the manifest."""

    index: int
    kind: str  # "replicated" | "per-device" | "sharded"
    #: The original shape (a tuple only for an output that is a nested tuple, which no
    #: manifest describes).
    shape: Shape
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
    #: Per computation with sharded gradients: how it was bucketed.
    strategies: list[StrategyChoice] = field(default_factory=list)
    #: ``params="sharded"``: each weight of the entry, sharded or why not.
    weights: list[WeightChoice] = field(default_factory=list)


@dataclass
class StrategyChoice:
    """The gradients of one computation priced under every strategy on the profile that
    decided (``--explain``)."""

    computation: str
    profile: str
    devices: int
    strategy: str
    estimates: list[StrategyEstimate]

    def to_json(self) -> dict:
        return {"computation": self.computation, "profile": self.profile,
                "devices": self.devices, "strategy": self.strategy,
                "estimates": [{"strategy": e.strategy, "collectives": e.collectives,
                               "seconds": e.seconds} for e in self.estimates]}


# ------------------------------------------------------------------------ the pass


@dataclass(frozen=True)
class WeightUpdateSharding(ModulePass[ShardingReport]):
    """Shard the weight update of every computation holding gradient all-reduces it can
    prove safe to rewrite, and explain every gradient all-reduce (sharded or why not).

    It runs after :class:`~hlo_shard.passes.tuple_forwarding.TupleForwarding` (the
    region flows through the tuples jax wraps around shard_map outputs only once they are
    forwarded) and before the passes that make its output valid to write: duplicate
    channel ids renumbered, the entry layout updated to a sharded signature
    (:func:`~hlo_shard.passes.sharding_pipeline.sharding_pipeline` runs all seven)."""

    name: ClassVar[str] = "weight-update-sharding"
    options: ShardingOptions = ShardingOptions()
    #: ``options.profile`` loaded (a name or file becomes the profile it names).
    profile: HardwareProfile = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.options.state not in STATE_MODES:
            raise HloShardError(f"state must be one of {', '.join(STATE_MODES)}, not "
                                f"{self.options.state!r}")
        if self.options.params not in PARAM_MODES:
            raise HloShardError(f"params must be one of {', '.join(PARAM_MODES)}, not "
                                f"{self.options.params!r}")
        needed = PARAM_MODES[self.options.params]
        if needed is not None and self.options.state != needed:
            raise ShardingOptionError("params", self.options.params,
                                      f"needs state {needed} (the weights' shards are "
                                      f"updated from the optimizer state's)")
        if self.options.strategy not in STRATEGIES:
            raise HloShardError(f"strategy must be one of {', '.join(STRATEGIES)}, not "
                                f"{self.options.strategy!r}")
        for option, least in OPTION_MINIMUMS.items():
            value = getattr(self.options, option)
            if value is not None and value < least:
                raise ShardingOptionError(option, value, f"must be at least {least}")
        profile = self.options.profile
        object.__setattr__(self, "profile", profile if isinstance(profile, HardwareProfile)
                           else load_profile(profile))

    def apply(self, module: Module) -> PassResult[ShardingReport]:
        """Read the module's facts, rewrite each computation's update region, then keep the
        training loops' carried shards across iterations; the report says what and why."""
        run = self._read_facts(module)
        for comp_name, candidates in run.candidates.items():
            self._shard_computation(run, module.computation(comp_name), candidates)
        for carry in run.carries:
            self._shard_carry(run, carry)
        _fill_signature(module, run.report, run.replication, run.state_plan, run.groups,
                        run.output_kinds)
        run.report.feedback = list(module.output_aliases().items()) or None
        return PassResult(module, bool(run.changes), run.changes, report=run.report)

    def _read_facts(self, module: Module) -> _Run:
        """What the rewrite needs, read before any edit: the device counts a header lost
        (written back: the rewritten module names devices), the gradient all-reduces and
        the data-parallel group, which values are replicated, and the all-reduces left
        alone with why."""
        recovered = recovered_device_counts(module)
        header = ModuleRewriter(module)
        for key, count in recovered.items():
            header.set_header(key, count)
        found = find_gradient_all_reduces(module)
        groups = _data_parallel_groups(module, found)
        wanted = self.options.num_replicas
        if wanted is not None and groups is not None and wanted != groups.size:
            raise ShardingOptionError("num_replicas", wanted, f"does not match the module's "
                                      f"data-parallel group size {groups.size}")
        report = ShardingReport(module.replica_count * module.num_partitions)
        report.notes += [f"{key}={value} recovered from the collectives' device groups "
                         f"(the header had none)" for key, value in recovered.items()]
        replication = analyze_replication(module, groups, self.options.overrides,
                                          _gradient_sources(module, found))
        candidates, rejected = _triage(module, found, groups)
        report.explanations += [_rejected(module, ar, why, code) for ar, why, code in rejected]
        report.explanations += [_rejected(module, rs, rs.reason, rs.code)
                                for rs in find_reduce_scatters(module)]
        group_size = groups.size if groups is not None else 1
        bucket_bytes = self.options.bucket_bytes
        bucketing = Bucketing(self.options.strategy,
                              self.profile.combine_threshold_bytes if bucket_bytes is None
                              else bucket_bytes,
                              CollectivePricing(self.profile.for_devices(module.device_count),
                                                group_size),
                              self.options.per_tensor_bytes)
        return _Run(module, report, groups, replication, _output_kinds(module, replication),
                    candidates, bucketing, ChannelIds(module), header.changes)

    def _shard_computation(self, run: _Run, comp: Computation,
                           candidates: list[GradientAllReduce]) -> None:
        """Plan the update region of ``comp`` from its gradients and rewrite it on shards;
        the entry's optimizer state (``state="sharded"``) or a loop body's carried slots
        become shards too (the carries are rewritten outside the body later)."""
        module = run.module
        leaves, rejected = collect_leaves(module, comp, candidates)
        run.report.explanations += [_rejected(module, ar, why, ReasonCode.TUPLE_USED_WHOLE)
                                    for ar, why in rejected]
        if not leaves:
            return
        state_entry = comp.is_entry and self.options.state == "sharded"
        plan = plan_region(module, comp, leaves, run.replication, RegionOptions(
            self.options.min_shard_bytes, state_entry,
            tuple((number, k) for k, number in module.output_aliases().items()) if state_entry else ()))
        collectives: dict[str, str] = {}
        if plan.active:
            snapshot, mark = RegionSnapshot.take(module, comp, run.channels), run.mark()
            try:
                inputs, outputs = self._region_boundary(run, comp, plan, state_entry)
                sizes = [(leaf.byte_size, leaf.shape.element_type) for leaf in plan.active]
                run.report.strategies.append(StrategyChoice(
                    comp.name, self.profile.name, plan.groups.size, self.options.strategy,
                    run.bucketing.estimates(sizes)))
                rewrite = RegionRewrite(module, comp, plan, run.bucketing, run.channels,
                                        inputs, outputs,
                                        gather_at_top=state_entry and self.options.params == "sharded")
                collectives = rewrite.run()
                run.changes += rewrite.rw.changes
            except DependencyCycle as cycle:  # a planning bug: refused, never raised
                snapshot.restore()
                run.rewind(mark)
                stuck = ", ".join(f"%{name}" for name in cycle.stuck[:3])
                plan = plan.refused(Whole(ReasonCode.REGION_CYCLE,
                                          f"the rewrite of this region made a dependency "
                                          f"cycle (through {stuck}…): left as it was"))
        run.report.explanations += [_explain(comp.name, leaf, collectives)
                                     for leaf in plan.leaves]

    def _region_boundary(self, run: _Run, comp: Computation, plan: RegionPlan,
                         state_entry: bool) -> tuple[dict[str, ShardFormat], dict[int, str]]:
        """Values entering and leaving the region as shards rather than whole: sharded
        optimizer state of the entry (paired with its next value, annotated; the state
        kept whole is noted), or the slots a training loop carries as shards."""
        module = run.module
        if state_entry:
            graph, params = dataflow_graph(comp), comp.parameters()
            state_plan, kept_whole = _pair_state(module, comp, plan, run.replication,
                                                 region_read_parameters(params, graph, plan))
            names = _parameter_names(comp)
            run.report.notes += [_state_note(comp[names[number]], number, why)
                                 for number, why in kept_whole.items()]
            run.report.notes += _unsharded_state(module, comp, plan,
                                                 set(state_plan) | set(kept_whole))
            if self.options.params == "sharded":
                chains = _copy_chains(comp, graph)
                ends = {name: chain[-1] for name, chain in chains.items()}
                weights, weights_whole = _pair_state(
                    module, comp, plan, run.replication,
                    region_read_parameters(params, graph, plan, weights=True, through=ends),
                    unaliased="no input_output_alias names its next value")
                rows = _weight_rows(comp, names, weights, weights_whole, graph, plan, ends)
                run.report.weights += rows
                run.report.notes += [f"weight parameter {row.parameter} (%{row.name}) "
                                     f"{row.reason}" for row in rows if not row.sharded]
                run.changes += _bypass_copies(comp, [names[n] for n in weights], chains)
                state_plan = {**state_plan, **weights}
            run.state_plan = state_plan
            run.changes += _annotate_state(module, Rewriter(comp), state_plan, plan.groups)
            return ({names[n]: p.format for n, p in state_plan.items()},
                    {p.output: p.value for p in state_plan.values()})
        carry = _loop_slots(module, comp, plan, run.replication)
        if carry is None:
            return {}, {}
        run.carries.append(carry)
        return carry.inputs, carry.outputs

    def _shard_carry(self, run: _Run, carry: _LoopCarry) -> None:
        """Outside a loop whose body keeps shards: slice before it, gather after it (or,
        with sharded state, let entry parameter and output be the shard)."""
        edits, sunk = _shard_loop_carry(run.module, carry, run.channels, run.bucketing,
                                        self.options.state == "sharded")
        run.changes += edits
        run.state_plan.update(sunk)
        run.report.notes.append(
            f"while %{carry.loop}: carried slots {', '.join(map(str, sorted(carry.slots)))} "
            f"stay sharded across iterations (sliced before the loop, gathered after)")


@dataclass
class _Run:
    """The working state of one :meth:`WeightUpdateSharding.apply`: the module's facts,
    then what the steps add (the report, the edits, the state and carries sharded)."""

    module: Module
    report: ShardingReport
    groups: DeviceGroups | None
    replication: Replication
    #: Per output of the original entry: replicated or per-device.
    output_kinds: list[str]
    #: Computation → its gradient all-reduces the rewrite may shard, in module order.
    candidates: dict[str, list[GradientAllReduce]]
    bucketing: Bucketing
    channels: ChannelIds
    changes: list[Change] = field(default_factory=list)
    #: Entry parameter number → the sharded optimizer state it became.
    state_plan: dict[int, StatePair] = field(default_factory=dict)
    carries: list[_LoopCarry] = field(default_factory=list)

    def mark(self) -> _Mark:
        """Where the steps stand, for :meth:`rewind` after a region refused."""
        return _Mark(len(self.changes), len(self.report.notes), len(self.report.strategies),
                     len(self.report.weights), len(self.carries), dict(self.state_plan))

    def rewind(self, mark: _Mark) -> None:
        """Forget what the steps added since ``mark`` (its edits are undone separately,
        by the computation's :class:`RegionSnapshot`)."""
        del self.changes[mark.changes:], self.report.notes[mark.notes:]
        del self.report.strategies[mark.strategies:], self.carries[mark.carries:]
        del self.report.weights[mark.weights:]
        self.state_plan = dict(mark.state_plan)


@dataclass(frozen=True)
class _Mark:
    """How long the lists of a :class:`_Run` were, and its state plan, at one point."""

    changes: int
    notes: int
    strategies: int
    weights: int
    carries: int
    state_plan: dict[int, StatePair]


# ----------------------------------------------------------------- module-level facts


def _triage(module: Module, found: list[GradientAllReduce], groups: DeviceGroups | None
            ) -> tuple[dict[str, list[GradientAllReduce]],
                       list[tuple[GradientAllReduce, str, ReasonCode | None]]]:
    """The candidate all-reduces per computation the rewrite can reach (the entry and
    training-loop bodies, over the data-parallel group), and the others with why not."""
    regions = _region_computations(module)
    candidates: dict[str, list[GradientAllReduce]] = defaultdict(list)
    rejected: list[tuple[GradientAllReduce, str, ReasonCode | None]] = []
    for ar in found:
        reason, code = ar.reason, ar.code
        if not reason and ar.computation not in regions:
            reason = "inside a called computation (fusion/call/conditional): not supported"
            code = ReasonCode.CALLED_COMPUTATION
        if not reason and (ar.groups is None or groups is None
                           or ar.groups.key() != groups.key()):
            reason = "its groups differ from the data-parallel group of the module"
            code = ReasonCode.OTHER_GROUPS
        if reason:
            rejected.append((ar, reason, code))
        else:
            candidates[ar.computation].append(ar)
    return dict(candidates), rejected


def rewritten_computations(module: Module) -> list[str]:
    """The computations :class:`WeightUpdateSharding` may edit: those holding candidate
    gradient all-reduces, and the callers of the training loops among them (where a
    loop's carry is sliced and gathered). Read on the module as the pass reads it (with
    the device counts a header lost); the module is not changed."""
    view = replace(module, header={**module.header, **recovered_device_counts(module)})
    found = find_gradient_all_reduces(view)
    candidates, _ = _triage(view, found, _data_parallel_groups(view, found))
    callers = [comp.name for comp in module.computations for inst in comp.instructions
               if inst.opcode == "while" and _called(inst, "body") in candidates]
    return list(candidates) + [name for name in dict.fromkeys(callers) if name not in candidates]


def _tuple_index(inst: Instruction) -> int:
    """The element a ``get-tuple-element`` reads."""
    index = inst.int_attr("index")
    if index is None:
        raise HloShardError(f"%{inst.name}: get-tuple-element without index=")
    return index


def _array(shape: Shape) -> ArrayShape:
    """``shape``, which the analysis has proved an array (a leaf of the update)."""
    return cast(ArrayShape, shape)


def _element(shape: Shape, index: int) -> ArrayShape:
    """Element ``index`` of ``shape``, which the analysis has proved a tuple of arrays
    there (a root or loop carry holding update values)."""
    return _array(cast(TupleShape, shape).elements[index])


def _called(inst: Instruction, role: str) -> str:
    """The name of the computation ``inst`` calls as ``role`` (``body``, ``condition``)."""
    ref = inst.attr_as(role, ComputationRef)
    if ref is None:
        raise HloShardError(f"%{inst.name}: {inst.opcode} without {role}=")
    return ref.name


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
    return first[max(weight, key=lambda key: weight[key])]


def _region_computations(module: Module) -> set[str]:
    """The entry and every while body reachable from it through while loops only."""
    names = {module.entry.name}
    stack = [module.entry]
    while stack:
        comp = stack.pop()
        for inst in comp.instructions:
            if inst.opcode == "while":
                body = _called(inst, "body")
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


# --------------------------------------------------------------------- optimizer state


@dataclass(frozen=True)
class StatePair:
    """Optimizer state kept sharded: its parameter's next value is output ``output``."""

    output: int
    value: str
    format: ShardFormat
    #: The parameter's and the output's original (full) shapes.
    shape: ArrayShape
    output_shape: ArrayShape


def _pair_state(module: Module, comp: Computation, plan: RegionPlan, replication: Replication,
                read: dict[int, set[ShardFormat]], unaliased: str = ""
                ) -> tuple[dict[int, StatePair], dict[int, str]]:
    """Parameter number → (output index, region value) for the parameters of ``read``
    (optimizer state, or weights: see :func:`region_read_parameters`) that can stay
    sharded: the region reads the parameter in the format of the output that is its
    next value, and both are in an order the manifest flattens (physical or row-major);
    and, for the other parameters of ``read``, why not (with ``unaliased``, also those
    the module's input_output_alias leaves out: a weight is a parameter to report)."""
    root = comp.root
    if root.opcode != "tuple":
        return {}, {}
    graph = dataflow_graph(comp)
    params = {p.parameter_number: p for p in comp.parameters()}
    candidates: dict[int, ShardFormat] = {}
    kept_whole: dict[int, str] = {}
    for number, formats in read.items():
        if not replication.is_replicated(comp.name, params[number].name):
            continue
        fmt = next(iter(formats))
        if len(formats) != 1:
            kept_whole[number] = f"the update reads it in {len(formats)} element orders"
        elif not flattenable(fmt, _array(params[number].shape)):
            kept_whole[number] = f"the update runs in element order {_order(fmt)}, " \
                                 f"{_not_flattenable(_array(params[number].shape))}"
        else:
            candidates[number] = fmt
    outputs: dict[int, str] = {}
    for k, value in enumerate(root.operands):
        out = plan.sharded.get(value)
        if out is not None and flattenable(out, _element(root.shape, k)):
            outputs[k] = value
    pairs: dict[int, StatePair] = {}

    def pair(number: int, k: int) -> None:
        pairs[number] = StatePair(k, outputs[k], candidates[number],
                                  _array(params[number].shape), _element(root.shape, k))

    def fits(number: int, k: int) -> bool:
        param = params[number]
        return plan.sharded[outputs[k]] == candidates[number] and \
            _element(root.shape, k).element_type == _array(param.shape).element_type

    aliases = list(module.output_aliases().items())
    if aliases:
        for k, number in aliases:
            if number in candidates and k in outputs and fits(number, k):
                pair(number, k)
            elif number in candidates:
                kept_whole[number] = _unpaired_output(plan, root, k, candidates[number])
        if unaliased:
            kept_whole.update({number: unaliased for number in candidates
                               if number not in pairs and number not in kept_whole})
        return pairs, kept_whole
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
    kept_whole.update({number: "no output in its element order is its next value alone "
                               "(no input_output_alias to say which)" for number in remaining})
    return pairs, kept_whole


def _unsharded_state(module: Module, comp: Computation, plan: RegionPlan,
                     explained: set[int]) -> list[str]:
    """Optimizer state the sharded update does not compute at all, and why: a parameter
    aliased to an output, not read by the forward/backward pass, whose next value needs
    the summed gradients outside the region — a factored statistic such as Adafactor's
    ``v_row``/``v_col`` (the squared gradient reduced along one dimension)."""
    graph = dataflow_graph(comp)
    root = comp.root
    gradients = {leaf.all_reduce for leaf in plan.leaves}
    forward: set[str] = set()
    for name in gradients:
        forward |= nx.ancestors(graph, name)
    params = {p.parameter_number: p for p in comp.parameters()}
    from hlo_shard.printer import format_shape

    sharded = {leaf.all_reduce for leaf in plan.active}
    found: list[str] = []
    for k, number in module.output_aliases().items():
        param = params.get(number)
        if param is None or number in explained or param.name in forward \
                or not isinstance(param.shape, ArrayShape) or param.shape.num_elements <= 1 \
                or root.opcode != "tuple" or k >= len(root.operands):
            continue
        value = root.operands[k]
        upstream = nx.ancestors(graph, value)
        if value in plan.sharded or not gradients & upstream:
            continue
        why = "its gradient stays all-reduced (see its row)" if not sharded & upstream else \
            _factored_reason(comp, plan, upstream)
        found.append(f"optimizer state parameter {number} (%{param.name} "
                     f"{format_shape(param.shape)}) stays whole, computed in full on every "
                     f"device: {why}")
    return found


def _factored_reason(comp: Computation, plan: RegionPlan, upstream: set[str]) -> str:
    """Why a state computed from a reduction of a sharded gradient along some dimensions
    (a factored statistic, like Adafactor's v_row/v_col) is not itself a shard: its
    reduction cuts the shard's block (summed from partial sums, whole on every device),
    or the shard is no block of the gradient, or the reduction is not one the region
    runs."""
    for name in sorted(upstream, key=comp.position):
        inst = comp[name]
        fmt = plan.sharded.get(inst.operands[0]) if inst.opcode == "reduce" else None
        if fmt is None or inst.array_shape.num_elements == 1:
            continue
        dims = ",".join(map(str, inst.ints_attr("dimensions")))
        what = f"its next value reduces the gradient along dimension {dims} (%{name}, a " \
               f"factored statistic, like Adafactor's v_row/v_col)"
        if fmt.block is None:
            return f"{what}, and the gradient's shards are not blocks along one dimension " \
                   f"({fmt.elements} elements in {_order(fmt)} order over {fmt.n} devices" \
                   f"{f', {fmt.padding} padding' if fmt.padding else ''})"
        major = fmt.known_block[0]
        if name in plan.ops:
            return f"{what}, the dimension whose blocks the devices hold: each sums its " \
                   f"block and an all-reduce of the partial sums gives the whole statistic"
        return f"{what}: the devices hold blocks along dimension {major}, and a reduction " \
               f"cutting them runs on shards only as a sum"
    return "its next value reduces the gradient along a dimension (a factored statistic, " \
           "like Adafactor's v_row/v_col), outside the element-wise update the pass shards"


def _order(fmt: ShardFormat) -> str:
    """A format's element order as the layout that stores it (minor_to_major)."""
    return "{" + ",".join(map(str, fmt.minor_to_major())) + "}"


def _not_flattenable(shape: ArrayShape) -> str:
    row_major = tuple(range(shape.rank - 1, -1, -1))
    return (f"neither its physical order {{{','.join(map(str, shape.minor_to_major()))}}} "
            f"nor row-major {{{','.join(map(str, row_major))}}} (the orders a sharded "
            f"signature value is flattened in)")


def _unpaired_output(plan: RegionPlan, root: Instruction, k: int, fmt: ShardFormat) -> str:
    """Why the output aliased to a state parameter cannot be its sharded next value."""
    shape = _element(root.shape, k) if k < len(root.operands) else None
    out = plan.sharded.get(root.operands[k]) if shape is not None else None
    if out is None or shape is None:
        return f"its next value (output {k}) is not computed by the sharded update"
    if not flattenable(out, shape):
        return f"its next value (output {k}) is in element order {_order(out)}, " \
               f"{_not_flattenable(shape)}"
    if out != fmt:
        return f"its next value (output {k}) is in element order {_order(out)}, " \
               f"the parameter in {_order(fmt)}"
    return f"its next value (output {k}) has another element type"


def _copy_chains(comp: Computation, graph: nx.MultiDiGraph) -> dict[str, list[str]]:
    """Parameter → the copies it flows through alone before its other uses (each copy
    the only user of the value before it, in the parameter's shape and layout: the
    form shard_map gives a replicated argument), for the parameters that have any."""
    chains: dict[str, list[str]] = {}
    #: Instructions another one is ordered after (control edges): they stay.
    ordered = {name for inst in comp.instructions for name in control_predecessors(inst)}
    for param in comp.parameters():
        chain, value = [], param.name
        while len(users := list(graph.successors(value))) == 1 and \
                comp[users[0]].opcode == "copy" and comp[users[0]].shape == param.shape \
                and users[0] != comp.root_name and users[0] not in ordered \
                and not control_predecessors(comp[users[0]]):
            chain.append(users[0])
            value = users[0]
        if chain:
            chains[param.name] = chain
    return chains


def _bypass_copies(comp: Computation, params: list[str],
                   chains: dict[str, list[str]]) -> list[Change]:
    """The users of each sharded weight's copies read the parameter itself (a copy of a
    value in its own layout is that value): the parameter becomes the shard they read."""
    rw = Rewriter(comp)
    for name in params:
        chain = chains.get(name, [])
        if chain:
            rw.replace_all_uses_with(chain[-1], name)
            for copy in reversed(chain):
                rw.erase(copy)
    return rw.changes


def _weight_rows(comp: Computation, names: dict[int, str], weights: dict[int, StatePair],
                 kept_whole: dict[int, str], graph: nx.MultiDiGraph,
                 plan: RegionPlan, ends: dict[str, str]) -> list[WeightChoice]:
    """The ``params="sharded"`` rows: each weight sharded (gathered narrow where its
    uses outside the update are converts to one narrower float) or kept whole."""
    rows = [WeightChoice(number, names[number], False,
                         reason=f"stays whole on every device: {why}",
                         reason_code=ReasonCode.WEIGHT_KEPT_WHOLE.value)
            for number, why in kept_whole.items()]
    for number in weights:
        name = names[number]
        value = ends.get(name, name)
        users = [u for u in graph.successors(value) if u not in plan.ops]
        narrow = narrowing_convert(comp, value, list(dict.fromkeys(users)))
        wide = _array(comp[name].shape).element_type
        rows.append(WeightChoice(number, name, True, narrow or wide) if narrow else
                    WeightChoice(number, name, True, wide,
                                 f"all-gathered in {wide}: used outside the update "
                                 f"other than by one convert to a narrower float type "
                                 f"(by {', '.join(sorted(set(users))[:3]) or 'the root'})",
                                 ReasonCode.WIDE_GATHER.value))
    return sorted(rows, key=lambda row: row.parameter)


def _state_note(param: Instruction, number: int, why: str) -> str:
    from hlo_shard.printer import format_shape

    return f"optimizer state parameter {number} (%{param.name} {format_shape(param.shape)}) " \
           f"stays whole (sliced and all-gathered every step): {why}"


def _parameter_names(comp: Computation) -> dict[int, str]:
    """Parameter number → name (one scan, for callers that look up many)."""
    return {p.parameter_number: p.name for p in comp.parameters()
            if p.parameter_number is not None}


def _annotate_state(module: Module, rw: Rewriter, state: dict[int, StatePair],
                    groups: DeviceGroups) -> list[Change]:
    """SPMD form: a sharded state parameter's global value is the padded flat vector."""
    comp = rw.comp
    names = _parameter_names(comp)
    for number in state:
        param = comp[names[number]]
        if "sharding" in param.attributes or module.num_partitions > 1:
            rw.set_attr(param, "sharding", Raw(_shard_sharding(groups)))
    return rw.changes


# ------------------------------------------------------------------------ training loops


@dataclass
class _LoopCarry:
    """Carried slots of one training loop that stay shards across iterations."""

    parent: str
    loop: str
    body: str
    condition: str
    #: Slot → shard format.
    slots: dict[int, ShardFormat]
    #: Body GTEs of those slots → format (they become the shards), and root positions
    #: that keep the shard.
    inputs: dict[str, ShardFormat]
    outputs: dict[int, str]
    groups: DeviceGroups
    #: A collective over the group whose attributes the outer collectives copy.
    template: Instruction


def _loop_slots(module: Module, body: Computation, plan: RegionPlan,
                replication: Replication) -> _LoopCarry | None:
    """Slots of the loop running ``body`` whose next value is a region value, whose
    region uses agree on the format, that the condition does not read and whose initial
    value is replicated."""
    callers = [(c, i) for c in module.computations for i in c.instructions
               if body.name in i.called_computations()]
    if len(callers) != 1 or callers[0][1].opcode != "while" or \
            _called(callers[0][1], "body") != body.name:
        return None
    parent, loop = callers[0]
    cond = module.computation(_called(loop, "condition"))
    init = parent[loop.operands[0]]
    params, root = body.parameters(), body.root
    if len(params) != 1 or not isinstance(params[0].shape, TupleShape) or \
            root.opcode != "tuple" or init.opcode != "tuple" or parent.root_name == loop.name:
        return None
    graph, parent_graph = dataflow_graph(body), dataflow_graph(parent)
    slot_readers: dict[int, list[str]] = defaultdict(list)
    for user in graph.successors(params[0].name):
        if body[user].opcode != "get-tuple-element":
            return None
        slot_readers[_tuple_index(body[user])].append(user)
    if any(parent[u].opcode != "get-tuple-element" for u in parent_graph.successors(loop.name)):
        return None
    read_by_condition = _condition_slots(cond)
    if read_by_condition is None:
        return None
    slots: dict[int, ShardFormat] = {}
    for index, value in enumerate(root.operands):
        fmt = plan.sharded.get(value)
        shape = params[0].shape.elements[index]
        if fmt is None or index in read_by_condition or not isinstance(shape, ArrayShape) \
                or fmt.dims != shape.dims \
                or not replication.is_replicated(parent.name, init.operands[index]):
            continue
        readers = slot_readers.get(index, [])
        if any(plan.ops[u].formats_reading(body[u], g) != {fmt} for g in readers
               for u in graph.successors(g) if u in plan.ops):
            continue
        slots[index] = fmt
    if not slots:
        return None
    inputs = {g: slots[i] for i, readers in slot_readers.items() if i in slots for g in readers}
    outputs = {i: root.operands[i] for i in slots}
    return _LoopCarry(parent.name, loop.name, body.name, cond.name, slots, inputs, outputs,
                      plan.groups, body[plan.template])


def _condition_slots(cond: Computation) -> set[int] | None:
    """Slots the loop condition reads (None: it uses the carry whole)."""
    params = cond.parameters()
    if not params:
        return set()
    (param,) = params
    used: set[int] = set()
    for inst in cond.instructions:
        if param.name in inst.operands:
            if inst.opcode != "get-tuple-element":
                return None
            used.add(_tuple_index(inst))
    return used


def _shard_loop_carry(module: Module, carry: _LoopCarry, channels: ChannelIds,
                      bucketing: Bucketing, sink_state: bool) -> tuple[list, dict[int, StatePair]]:
    """Outside the body: slice the initial values of the carried slots before the loop,
    gather them after it, and give the loop, body and condition the new carry shape.

    With ``sink_state`` (``--state sharded``, loop in the entry), a slot whose initial
    value is an entry parameter (through copies) and whose final value is an entry output
    (through copies) is not sliced nor gathered: parameter and output become the shard."""
    parent = module.computation(carry.parent)
    body = module.computation(carry.body)
    loop = parent[carry.loop]
    edits = ModuleRewriter(module)
    rw = edits.rewriter(parent)
    emit = ShardEmitter(module, parent, rw, carry.groups, carry.template, channels)
    old = parent[loop.operands[0]]
    elements: list[Shape] = list(cast(TupleShape, loop.shape).elements)
    for index, fmt in carry.slots.items():
        elements[index] = emit.shape(_element(loop.shape, index).element_type, (fmt.shard_len,))
    carried = TupleShape(tuple(elements))
    sunk = _sinkable_slots(parent, rw, carry, old) if sink_state and parent.is_entry else {}
    state: dict[int, StatePair] = {}
    root = parent.root
    for index, (upward, downward, k) in sunk.items():
        fmt, param = carry.slots[index], parent[upward[0]]
        state[cast(int, param.parameter_number)] = StatePair(
            k, downward[-1], fmt, _array(param.shape), _element(root.shape, k))
        for name in upward + downward:
            rw.set_shape(parent[name], elements[index])
        rw.set_shape(root, TupleShape(tuple(elements[index] if i == k else e
                                            for i, e in enumerate(cast(TupleShape,
                                                                       root.shape).elements))))
    _annotate_state(module, rw, state, carry.groups)
    operands = list(old.operands)
    with rw.inserting_before(loop.name):
        for index, fmt in carry.slots.items():
            if index not in sunk:
                operands[index] = emit.local_slice(old.operands[index], fmt)
        init = rw.add("tuple", carried, operands, name=old.name)
    rw.set_operand(loop, 0, init.name)
    if not rw.users(old.name) and parent.root_name != old.name:
        rw.erase(old.name)
    rw.set_shape(loop, carried)
    for comp in (body, module.computation(carry.condition)):
        edits.rewriter(comp).set_shape(comp.parameters()[0], carried)
    readers = [r for r in rw.users(loop.name) if _tuple_index(r) in carry.slots]
    users = {r.name: [u.name for u in rw.users(r.name)] for r in readers}
    items = [Gathered(r.name, carry.slots[_tuple_index(r)],
                      emit.gathered_shape(_array(r.shape), carry.slots[_tuple_index(r)],
                                          users[r.name]),
                      r.name)
             for r in readers if _tuple_index(r) not in sunk]
    for reader in readers:
        rw.set_shape(reader, elements[_tuple_index(reader)])
    for item, gathered in gather_before_use(rw, emit, bucketing, items, users).items():
        for user in users[item.shard]:
            inst = parent[user]
            for i, operand in enumerate(inst.operands):
                if operand == item.shard:
                    rw.set_operand(inst, i, gathered)
        if parent.root_name == item.shard:
            rw.set_root(gathered)
    return edits.changes, state


def _sinkable_slots(parent: Computation, rw: Rewriter, carry: _LoopCarry,
                    init: Instruction) -> dict[int, tuple[list[str], list[str], int]]:
    """Slot → (parameter … initial value, reader … final value, output position) for the
    slots that run parameter → copies → loop → copies → one entry output and nothing else."""
    root = parent.root
    if root.opcode != "tuple":
        return {}

    def only_user(name: str) -> Instruction | None:
        users = rw.users(name)
        return users[0] if len(users) == 1 else None

    out: dict[int, tuple[list[str], list[str], int]] = {}
    readers: dict[int, list[Instruction]] = defaultdict(list)
    for reader in rw.users(carry.loop):
        readers[_tuple_index(reader)].append(reader)
    for index, fmt in carry.slots.items():
        upward = [init.operands[index]]
        while parent[upward[0]].opcode == "copy" and only_user(parent[upward[0]].operands[0]):
            upward.insert(0, parent[upward[0]].operands[0])
        if parent[upward[0]].opcode != "parameter" or init.operands.count(upward[-1]) != 1 \
                or any(only_user(n) is None for n in upward) or len(readers[index]) != 1:
            continue
        downward = [readers[index][0].name]
        while (user := only_user(downward[-1])) is not None and user.opcode == "copy":
            downward.append(user.name)
        if only_user(downward[-1]) is not root or root.operands.count(downward[-1]) != 1:
            continue
        k = root.operands.index(downward[-1])
        if flattenable(fmt, _array(parent[upward[0]].shape)) and \
                flattenable(fmt, _element(root.shape, k)):
            out[index] = (upward, downward, k)
    return out


def _fill_signature(module: Module, report: ShardingReport, replication: Replication,
                    state: dict[int, StatePair], groups: DeviceGroups | None,
                    output_kinds: list[str]) -> None:
    """The rewritten entry's signature for the manifest: each parameter and output leaf
    replicated, per-device, or a shard (with its format and groups)."""
    entry = module.entry
    sharded_outputs = {pair.output: pair for pair in state.values()}
    explicit_groups = () if groups is None or groups.is_trivial else groups.groups
    for param in entry.parameters():
        number = cast(int, param.parameter_number)
        if number in state:
            pair = state[number]
            report.parameters.append(SignatureEntry(number, "sharded", pair.shape, param.name,
                                                    pair.format, explicit_groups))
            continue
        flags = next((p.flags for p in replication.params if p.number == number), False)
        kind = "replicated" if all_true(flags) else "per-device"
        for _, leaf in shape_leaves(param.shape):
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


# --------------------------------------------------------------------- explanations


def _rejected(module: Module, ar: GradientAllReduce, reason: str,
              code: ReasonCode | None) -> Explanation:
    """The row of a collective left alone as a whole; a reduce-scatter's row describes
    the gradient it reduces (its operand), like an all-reduce's."""
    from hlo_shard.printer import format_shape

    inst = module.computation(ar.computation)[ar.name]
    shape = module.computation(ar.computation)[inst.operands[0]].shape \
        if inst.opcode == "reduce-scatter" and len(inst.operands) == 1 else inst.shape
    return Explanation(ar.computation, ar.name, None, format_shape(shape), shape.byte_size,
                       False, reason, reason_code=code.value if code else "")


def _explain(comp_name: str, leaf: PlannedLeaf, collectives: dict[str, str]) -> Explanation:
    from hlo_shard.printer import format_shape

    if not leaf.sharded:
        return Explanation(comp_name, leaf.all_reduce, leaf.index, format_shape(leaf.shape),
                           leaf.byte_size, False, leaf.reason,
                           reason_code=leaf.code.value if leaf.code else "")
    return Explanation(comp_name, leaf.all_reduce, leaf.index, format_shape(leaf.shape),
                       leaf.byte_size, True, "", leaf.ops_moved, leaf.formatting_copies,
                       leaf.saved_flops, collectives.get(leaf.label, ""))


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


__all__ = ["ChannelIds", "DEFAULT_PROFILE", "Explanation", "ShardingOptionError",
           "ShardingOptions", "ShardingReport", "SignatureEntry", "StrategyChoice",
           "WeightChoice", "WeightUpdateSharding", "PARAM_MODES", "STATE_MODES", "STRATEGIES", "rewritten_computations"]
