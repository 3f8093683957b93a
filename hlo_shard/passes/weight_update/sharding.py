"""Cross-replica sharding of the weight update (Xu et al. 2020) on HLO records.

Per computation holding gradient all-reduces (the entry, or a training loop's body):

* ``all-reduce(g)`` → ``reduce-scatter`` of ``g`` in the shard format (transpose to the
  format's order if needed, reshape to ``[E]``, zero-pad to ``[N·L]``), same groups and
  mode, a fresh channel id when the module uses them; with the combined strategy several
  gradients share one reduce-scatter (``[N, L_i]`` pieces concatenated along dim 1);
* every region op (see :mod:`.analysis`) is re-emitted on ``[L]``
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

This module is the pass's top: :meth:`WeightUpdateSharding.apply` asks :mod:`.analysis`
for the module's facts and each computation's immutable :class:`~.analysis.RegionPlan`
(with the state and loop slots that stay shards), hands them to :mod:`.lowering`, and
writes the report; it decides and emits nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, cast


from hlo_shard.analysis.collectives import (DeviceGroups, GradientAllReduce, ReasonCode,
                                            find_gradient_all_reduces, find_reduce_scatters,
                                            recovered_device_counts, with_device_counts)
from hlo_shard.analysis.replication import Flags, ParamOverrides, Replication, all_true
from hlo_shard.costmodel.network import CollectivePricing
from hlo_shard.errors import HloShardError
from hlo_shard.graph import (DataflowGraph, DependencyCycle, ModuleRewriter, dataflow_graph,
                             reading_only)
from hlo_shard.ir import Computation, Instruction, Module, Shape, TupleShape, shape_leaves
from hlo_shard.passes.base import ModulePass
from hlo_shard.passes.weight_update.analysis import (LoopCarry, PlannedLeaf, RegionOptions,
                                                     RegionPlan, StatePair, Whole,
                                                     called_computation, collect_leaves,
                                                     copy_chains, data_parallel_groups,
                                                     loop_slots, pair_state,
                                                     plan_region,
                                                     proved_array, read_update_facts,
                                                     region_read_parameters, triage,
                                                     unsharded_state)
from hlo_shard.passes.weight_update.emit import (STRATEGIES, Bucketing, ChannelIds, GradientSize,
                                                 StrategyEstimate)
from hlo_shard.passes.weight_update.lowering import (RegionRewrite, RegionSnapshot,
                                                     annotate_state, bypass_copies,
                                                     narrowing_convert, shard_loop_carry)
from hlo_shard.profiles import DEFAULT_PROFILE, HardwareProfile, load_profile
from hlo_shard.shard_format import ShardFormat

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
    #: :func:`~hlo_shard.passes.weight_update.planned_update_regions` of the module the
    #: pass was handed, where the pass planned exactly those regions on it (its default
    #: plan options and at most one computation to plan, so no plan read another's
    #: edits): the speed gate prices the input with them instead of planning again.
    #: None where it did not.
    input_regions: dict[str, frozenset[str]] | None = field(default=None, repr=False)
    #: (computation, all-reduce) of a row → (loop body, all-reduce) of the input it was
    #: moved from (the accumulation motion's): the input's names of that gradient.
    moved_from: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict,
                                                              repr=False)
    #: The size of the data-parallel groups the gradients are summed over (None: the
    #: module has no gradient all-reduce); less than ``devices`` on a mesh with a model
    #: or fsdp axis.
    group_size: int | None = None

    def whole_reasons(self, limit: int = 3) -> str:
        """Why gradients stay whole, in one line: the distinct reasons, those that keep
        the most gradient bytes whole first, at most ``limit`` of them ("" where none)."""
        kept: dict[str, int] = {}
        for row in self.explanations:
            if row.reason and not row.sharded:
                kept[row.reason] = kept.get(row.reason, 0) + row.bytes
        ordered = sorted(kept, key=lambda reason: (-kept[reason], reason))
        more = f"; {len(ordered) - limit} more" if len(ordered) > limit else ""
        return "; ".join(ordered[:limit]) + more


@dataclass
class StrategyChoice:
    """The gradients of one computation priced under every strategy on the profile that
    decided (``--explain``)."""

    computation: str
    profile: str
    devices: int
    strategy: str
    estimates: list[StrategyEstimate]
    #: The strategy lowered: ``strategy``'s own, or the cheapest estimate under ``auto``.
    chosen: str

    def to_json(self) -> dict:
        return {"computation": self.computation, "profile": self.profile,
                "devices": self.devices, "strategy": self.strategy, "chosen": self.chosen,
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

    def apply(self, module: Module, rewriter: ModuleRewriter) -> ShardingReport:
        """Read the module's facts, rewrite each computation's update region, then keep the
        training loops' carried shards across iterations; the report says what and why."""
        run = self._read_facts(rewriter)
        if self._plans_as_planned_update_regions(module, run):
            run.report.input_regions = {}
        for comp_name, candidates in run.candidates.items():
            self._shard_computation(run, module.computation(comp_name), candidates)
        for carry in run.carries:
            self._shard_carry(run, carry)
        inside = sorted({row.computation for row in run.report.explanations if row.sharded})
        if self.options.state == "sharded" and inside and module.entry.name not in inside:
            run.report.notes.append(
                f"{module.entry.name}: no optimizer state parameter stays sharded between "
                f"steps: the gradients are sharded only inside loop bodies "
                f"({', '.join(inside)}), which slice what they carry before the loop and "
                f"gather it after")
        _fill_signature(module, run.report, run.replication, run.state_plan, run.groups,
                        run.output_kinds)
        run.report.feedback = list(module.output_aliases().items()) or None
        return run.report

    def _plans_as_planned_update_regions(self, module: Module, run: _Run) -> bool:
        """The regions this run plans are :func:`planned_update_regions`' of ``module``:
        the same facts (no parameter overrides), plan options at their defaults (no size
        cut-off, no state kept sharded in the entry), and one computation at most."""
        if len(run.candidates) > 1 or self.options.min_shard_bytes != 0 or \
                self.options.overrides != ParamOverrides():
            return False
        return self.options.state != "sharded" or \
            all(name != module.entry.name for name in run.candidates)

    def _read_facts(self, edits: ModuleRewriter) -> _Run:
        """What the rewrite needs, read before any edit: the device counts a header lost
        (written back: the rewritten module names devices), the gradient all-reduces and
        the data-parallel group, which values are replicated, and the all-reduces left
        alone with why."""
        module = edits.module
        recovered = recovered_device_counts(module)
        for key, count in recovered.items():
            edits.set_header(key, count)
        facts = read_update_facts(module, self.options.overrides)
        groups = facts.groups
        wanted = self.options.num_replicas
        if wanted is not None and groups is not None and wanted != groups.size:
            raise ShardingOptionError("num_replicas", wanted, f"does not match the module's "
                                      f"data-parallel group size {groups.size}")
        report = ShardingReport(module.device_count,
                                group_size=groups.size if groups is not None else None)
        report.notes += recovered_notes(recovered)
        report.explanations += [_rejected(module, ar, why, code)
                                for ar, why, code in facts.rejected]
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
        return _Run(edits, report, groups, facts.replication,
                    _output_kinds(module, facts.replication), facts.candidates, bucketing,
                    ChannelIds(module))

    def _shard_computation(self, run: _Run, comp: Computation,
                           candidates: list[GradientAllReduce]) -> None:
        """Plan the update region of ``comp`` from its gradients and rewrite it on shards;
        the entry's optimizer state (``state="sharded"``) or a loop body's carried slots
        become shards too (the carries are rewritten outside the body later)."""
        module = run.edits.module
        with reading_only():  # the leaves and the plan read one users index and order
            leaves, rejected = collect_leaves(module, comp, candidates)
            run.report.explanations += [_rejected(module, ar, why, ReasonCode.TUPLE_USED_WHOLE)
                                        for ar, why in rejected]
            if not leaves:
                return
            state_entry = comp.is_entry and self.options.state == "sharded"
            aliases = module.output_aliases() if comp.is_entry else {}
            plan = plan_region(module, comp, leaves, run.replication, RegionOptions(
                self.options.min_shard_bytes, state_entry,
                tuple((number, k) for k, number in aliases.items()) if state_entry else (),
                frozenset(aliases)))
            if run.report.input_regions is not None:
                run.report.input_regions[comp.name] = frozenset(plan.ops)
        collectives: dict[str, str] = {}
        if plan.active:
            snapshot, mark = RegionSnapshot.take(run.edits, comp, run.channels), run.mark()
            try:
                inputs, outputs = self._region_boundary(run, comp, plan, state_entry)
                sizes = [GradientSize(leaf.byte_size, leaf.shape.element_type,
                                      bool(leaf.format.padding)) for leaf in plan.active]
                estimates = run.bucketing.estimates(sizes)
                bucketing = run.bucketing.chosen(estimates)
                run.report.strategies.append(StrategyChoice(
                    comp.name, self.profile.name, plan.groups.size, self.options.strategy,
                    estimates, bucketing.strategy))
                rewrite = RegionRewrite(run.edits, comp, plan, bucketing, run.channels,
                                        inputs, outputs,
                                        gather_at_top=state_entry and self.options.params == "sharded",
                                        upcast=self.profile.upcasts_16bit_floats)
                collectives = rewrite.run()
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
        module = run.edits.module
        if state_entry:
            graph, params = dataflow_graph(comp), comp.parameters()
            read = region_read_parameters(params, graph, plan)
            state_plan, kept_whole = pair_state(module, comp, plan, run.replication, read)
            names = comp.parameter_names()
            run.report.notes += [_state_note(comp[names[number]], number, why)
                                 for number, why in kept_whole.items()]
            if plan.active and not read:
                run.report.notes.append(_reads_none(
                    comp, plan, "optimizer state", "state parameter",
                    "the optimizer's arithmetic on its state",
                    "the state is computed whole on every device"))
            run.report.notes += unsharded_state(module, comp, plan,
                                                 set(state_plan) | set(kept_whole))
            if self.options.params == "sharded":
                chains = copy_chains(comp, graph)
                ends = {name: chain[-1] for name, chain in chains.items()}
                weights, weights_whole = pair_state(
                    module, comp, plan, run.replication,
                    region_read_parameters(params, graph, plan, weights=True, through=ends))
                rows = _weight_rows(comp, names, weights, weights_whole, graph, plan, ends)
                run.report.weights += rows
                run.report.notes += [f"weight parameter {row.parameter} (%{row.name}) "
                                     f"{row.reason}" for row in rows if not row.sharded]
                if plan.active and not rows:
                    run.report.notes.append(_reads_none(
                        comp, plan, "weight", "weight", "the weights' update",
                        "the weights are updated whole on every device"))
                bypass_copies(run.edits.rewriter(comp), [names[n] for n in weights], chains)
                state_plan = {**state_plan, **weights}
            run.state_plan = state_plan
            annotate_state(module, run.edits.rewriter(comp), state_plan, plan.groups)
            return ({names[n]: p.format for n, p in state_plan.items()},
                    {p.output: p.value for p in state_plan.values()})
        carry = loop_slots(module, comp, plan, run.replication)
        if carry is None:
            return {}, {}
        run.carries.append(carry)
        return carry.inputs, carry.outputs

    def _shard_carry(self, run: _Run, carry: LoopCarry) -> None:
        """Outside a loop whose body keeps shards: slice before it, gather after it (or,
        with sharded state, let entry parameter and output be the shard), gathered in the
        buckets of the strategy the body's region lowered."""
        chosen = next(c.chosen for c in run.report.strategies if c.computation == carry.body)
        sunk = shard_loop_carry(run.edits, carry, run.channels,
                                replace(run.bucketing, strategy=chosen),
                                self.options.state == "sharded")
        run.state_plan.update(sunk)
        run.report.notes.append(
            f"while %{carry.loop}: carried slots {', '.join(map(str, sorted(carry.slots)))} "
            f"stay sharded across iterations (sliced before the loop, gathered after)")


def recovered_notes(recovered: dict[str, int]) -> list[str]:
    """The notes on the device counts a header lost (:func:`recovered_device_counts`),
    which the pass writes back."""
    return [f"{key}={value} recovered from the collectives' device groups (the header had "
            f"none)" for key, value in recovered.items()]


@dataclass
class _Run:
    """The working state of one :meth:`WeightUpdateSharding.apply`: the module's facts,
    then what the steps add (the report, the state and carries sharded; the edits are
    the pass's rewriter's)."""

    edits: ModuleRewriter
    report: ShardingReport
    groups: DeviceGroups | None
    replication: Replication
    #: Per output of the original entry: replicated or per-device.
    output_kinds: list[str]
    #: Computation → its gradient all-reduces the rewrite may shard, in module order.
    candidates: dict[str, list[GradientAllReduce]]
    bucketing: Bucketing
    channels: ChannelIds
    #: Entry parameter number → the sharded optimizer state it became.
    state_plan: dict[int, StatePair] = field(default_factory=dict)
    carries: list[LoopCarry] = field(default_factory=list)

    def mark(self) -> _Mark:
        """Where the steps stand, for :meth:`rewind` after a region refused."""
        return _Mark(len(self.report.notes), len(self.report.strategies),
                     len(self.report.weights), len(self.carries), dict(self.state_plan))

    def rewind(self, mark: _Mark) -> None:
        """Forget what the steps added since ``mark`` (its edits are undone separately,
        with their log, by the computation's :class:`RegionSnapshot`)."""
        del self.report.notes[mark.notes:]
        del self.report.strategies[mark.strategies:], self.carries[mark.carries:]
        del self.report.weights[mark.weights:]
        self.state_plan = dict(mark.state_plan)


@dataclass(frozen=True)
class _Mark:
    """How long the lists of a :class:`_Run` were, and its state plan, at one point."""

    notes: int
    strategies: int
    weights: int
    carries: int
    state_plan: dict[int, StatePair]


def rewritten_computations(module: Module) -> list[str]:
    """The computations :class:`WeightUpdateSharding` may edit: those holding candidate
    gradient all-reduces, and the callers of the training loops among them (where a
    loop's carry is sliced and gathered). Read on the module as the pass reads it (with
    the device counts a header lost); the module is not changed."""
    view = with_device_counts(module)
    found = find_gradient_all_reduces(view)
    candidates, _ = triage(view, found, data_parallel_groups(view, found))
    callers = [comp.name for comp in module.computations for inst in comp.instructions
               if inst.opcode == "while" and called_computation(inst, "body") in candidates]
    return list(candidates) + [name for name in dict.fromkeys(callers) if name not in candidates]


def _weight_rows(comp: Computation, names: dict[int, str], weights: dict[int, StatePair],
                 kept_whole: dict[int, str], graph: DataflowGraph,
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
        wide = proved_array(comp[name].shape).element_type
        rows.append(WeightChoice(number, name, True, narrow or wide) if narrow else
                    WeightChoice(number, name, True, wide,
                                 f"all-gathered in {wide}: used outside the update "
                                 f"other than by one convert to a narrower float type "
                                 f"(by {', '.join(sorted(set(users))[:3]) or 'the root'})",
                                 ReasonCode.WIDE_GATHER.value))
    return sorted(rows, key=lambda row: row.parameter)


def _reads_none(comp: Computation, plan: RegionPlan, kept: str, read: str, before: str,
                so: str) -> str:
    """The note on a sharded update that reads none of what was to stay sharded."""
    return (f"{comp.name}: no {kept} stays sharded: the sharded update reads no {read} (it "
            f"ends before {before}, {_region_ends(comp, plan)}), so {so}")


def _region_ends(comp: Computation, plan: RegionPlan) -> str:
    """Where the sharded update ends, in words: the first instruction (in program order)
    but the root reading a shard whole, and how many more do ("at %tuple.13 (tuple),
    which reads its values whole, and 6 more")."""
    readers = {user for users in plan.boundary.values() for user in users
               if user and user != comp.root_name}
    if not readers:
        return "at the step's outputs"
    order = {inst.name: k for k, inst in enumerate(comp.instructions)}
    first = min(readers, key=order.__getitem__)
    more = f", and {len(readers) - 1} more" if len(readers) > 1 else ""
    return f"at %{first} ({comp[first].opcode}), which reads its values whole{more}"


def _state_note(param: Instruction, number: int, why: str) -> str:
    from hlo_shard.printer import format_shape

    return f"optimizer state parameter {number} (%{param.name} {format_shape(param.shape)}) " \
           f"stays whole (sliced and all-gathered every step): {why}"


def _fill_signature(module: Module, report: ShardingReport, replication: Replication,
                    state: dict[int, StatePair], groups: DeviceGroups | None,
                    output_kinds: list[str]) -> None:
    """The rewritten entry's signature for the manifest: each parameter and output leaf
    replicated, per-device, or a shard (with its format and groups)."""
    entry = module.entry
    sharded_outputs = {pair.output: pair for pair in state.values()}
    explicit_groups = () if groups is None or groups.is_trivial else groups.groups
    #: Parameter number → its flags (the first listed, as a search of the list finds).
    flags_of: dict[int, Flags] = {}
    for known in replication.params:
        flags_of.setdefault(known.number, known.flags)
    for param in entry.parameters():
        number = cast(int, param.parameter_number)
        if number in state:
            pair = state[number]
            report.parameters.append(SignatureEntry(number, "sharded", pair.shape, param.name,
                                                    pair.format, explicit_groups))
            continue
        kind = "replicated" if all_true(flags_of.get(number, False)) else "per-device"
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


__all__ = ["Explanation", "ShardingOptionError", "ShardingOptions", "ShardingReport",
           "SignatureEntry", "StrategyChoice", "WeightChoice", "WeightUpdateSharding",
           "PARAM_MODES", "STATE_MODES", "recovered_notes", "rewritten_computations"]
