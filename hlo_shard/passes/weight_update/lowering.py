"""Rewriting one computation according to its :class:`~.analysis.RegionPlan`.

* gradients: ``reduce-scatter`` of the formatted per-device gradient (one per tensor, or
  one per bucket: ``[N, L_i]`` pieces concatenated along dimension 1, then sliced);
* region ops re-emitted on ``[L]`` shards; replicated operands sliced locally (an
  update fusion's inside it: in a module XLA fused already a slice of its own would be a
  kernel nothing fuses any more), scalar broadcasts rebuilt as ``[L]`` broadcasts;
  one-element reductions masked, reduced locally and all-reduced (max/min with an is-NaN flag: XLA:CPU's all-reduce drops NaN);
  ops on blocks (factored statistics) applied to the shard reshaped into its block, sums
  along the block dimension all-reduced from the blocks' partial sums;
* sharded values needed whole: all-gathered before the first user of any of them, sharing
  buckets as the strategy combines (one whose shard is computed from such a user: right
  before its own first user);
* *input shards* (optimizer state parameters, loop-carried slots): the instruction's value
  becomes the ``[L]`` shard itself; its users outside the region get an all-gather placed
  right before the first of them; *output shards*: root tuple positions that keep the shard,
  their padding lanes masked to zero unless :class:`PaddingZeros` proves them zero.
"""

from __future__ import annotations

import itertools

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from hlo_shard.analysis.collectives import DeviceGroups, reducer_opcode
from hlo_shard.graph import ModuleRewriter, Rewriter, dependencies, topological_order
from hlo_shard.ir import (ELEMENT_BITS, FLOAT_TYPES, ArrayShape, AttrValue, Computation,
                          ComputationRef, Ident, Instruction, Module, Raw, Shape,
                          SliceRanges, TupleShape, summed_type)
from hlo_shard.opinfo import VIEWS, ZERO_PRESERVING
from hlo_shard.passes.weight_update.analysis import (LoopCarry, OpKind, PlannedLeaf, RegionOp,
                                                     RegionPlan, StatePair,
                                                     flattenable, is_scalar_broadcast,
                                                     proved_array,
                                                     proved_element, summing_levels,
                                                     tuple_index)
from hlo_shard.passes.weight_update.emit import (Bucketing, ChannelIds, Gathered, ShardEmitter,
                                                 block_body, block_dims, shard_body,
                                                 uses_blocks)
from hlo_shard.shard_format import ShardFormat


@dataclass
class RegionSnapshot:
    """What rewriting one computation's region may change — its instructions (list,
    operands, shapes, attributes, opcodes), its root, the module's computation list (a
    fusion body's sharded copy) and the next fresh channel id — kept so that a rewrite
    found wrong after the fact (a dependency cycle) is undone as if never tried, in the
    pass's rewriter too (its log and ``comp``'s users index). Taking it copies the
    computation's records once (linear in its size)."""

    edits: ModuleRewriter
    #: How long the rewriter's log was.
    logged: int
    comp: Computation
    channels: ChannelIds
    instructions: list[Instruction]
    records: list[tuple[str, Shape, list[str], dict]]
    root_name: str | None
    computations: list[Computation]
    next_channel: int

    @staticmethod
    def take(edits: ModuleRewriter, comp: Computation, channels: ChannelIds) -> RegionSnapshot:
        return RegionSnapshot(edits, len(edits.changes), comp, channels,
                              list(comp.instructions),
                              [(i.opcode, i.shape, list(i.operands), dict(i.attributes))
                               for i in comp.instructions],
                              comp.root_name, list(edits.module.computations), channels.next)

    def restore(self) -> None:
        for inst, (opcode, shape, operands, attributes) in zip(self.instructions,
                                                                self.records):
            inst.opcode, inst.shape, inst.operands, inst.attributes = \
                opcode, shape, operands, attributes
        self.comp.instructions[:] = self.instructions
        self.comp.root_name = self.root_name
        self.comp.reindex()
        self.edits.module.set_computations(self.computations)
        self.channels.next = self.next_channel
        self.edits.forget(self.comp, self.logged)


@dataclass
class RootUses:
    """Where the root reads each value: operand name → its positions, in step with the
    edits :meth:`RegionRewrite._rewire` makes of the root (entries a later edit made
    stale are dropped when read)."""

    root: Instruction
    at: dict[str, list[int]]

    @staticmethod
    def of(root: Instruction) -> RootUses:
        at: dict[str, list[int]] = defaultdict(list)
        for i, operand in enumerate(root.operands):
            at[operand].append(i)
        return RootUses(root, at)

    def positions(self, value: str) -> list[int]:
        """The positions that read ``value`` now, in operand order."""
        return sorted({i for i in self.at.get(value, ()) if self.root.operands[i] == value})

    def take(self, value: str) -> list[int]:
        """:meth:`positions`, forgotten here: the caller points them elsewhere."""
        found = self.positions(value)
        self.at.pop(value, None)
        return found

    def add(self, value: str, position: int) -> None:
        self.at.setdefault(value, []).append(position)


class RegionRewrite:
    """Rewrites ``comp`` by ``plan``. ``inputs``: instruction → format of the shard its
    value becomes (state parameters, carried loop slots); ``outputs``: root tuple position
    → region value whose shard stays there."""

    def __init__(self, edits: ModuleRewriter, comp: Computation, plan: RegionPlan,
                 bucketing: Bucketing, channels: ChannelIds,
                 inputs: dict[str, ShardFormat] | None = None,
                 outputs: dict[int, str] | None = None, gather_at_top: bool = False,
                 upcast: bool = False) -> None:
        module = edits.module
        self.module, self.comp, self.plan, self.bucketing = module, comp, plan, bucketing
        self.channels = channels
        self.inputs = inputs or {}
        self.outputs = outputs or {}
        #: Gather the input shards used outside the region together, before the first
        #: such use (see :func:`gather_before_use`).
        self.gather_at_top = gather_at_top
        #: The backend sums 16-bit floats in f32 (:meth:`scatter`).
        self.upcast = upcast
        #: The pass's edits of the module (a fusion body's sharded copy) and of ``comp``.
        self.edits = edits
        self.rw = edits.rewriter(comp)
        self.emit = ShardEmitter(module, comp, self.rw, plan.groups, comp[plan.template],
                                 channels, edits)
        self.n = plan.groups.size
        self.shard_of: dict[str, str] = {}
        self.collective_of: dict[str, str] = {}
        self._erase: list[str] = []
        #: The all-reduces of the sharded reductions' partial results (combined at the end).
        self._small_sums: list[str] = []

    # Operands ---------------------------------------------------------------------------
    def replicated_shard(self, value: str, fmt: ShardFormat) -> str:
        """This device's shard of a replicated full value (no communication)."""
        key = ("shard", value, fmt)
        cache = self.emit.cache
        if key not in cache:
            inst = self.comp[value]
            if is_scalar_broadcast(self.comp, value):
                cache[key] = self.emit.add(
                    "broadcast", self.emit.shape(inst.array_shape.element_type, (fmt.shard_len,)),
                    [inst.operands[0]], name=f"{value}.shard", dimensions=())
            else:
                cache[key] = self.emit.local_slice(value, fmt)
        return cache[key]

    def operand_shard(self, operand: str, fmt: ShardFormat) -> str:
        if operand in self.shard_of:
            return self.shard_of[operand]
        shape = self.comp[operand].shape
        if isinstance(shape, ArrayShape) and shape.is_scalar:
            return operand
        return self.replicated_shard(operand, fmt)

    # Reduce-scatter side ------------------------------------------------------------------
    def scatter(self, leaves: list[PlannedLeaf], order: dict[str, int]) -> None:
        """One reduce-scatter for ``leaves`` (one element type), placed before the last of
        their all-reduces (``order``: where each all-reduce stands among them); records
        each leaf's ``[L]`` shard. Where the backend sums the type in f32
        (:func:`~hlo_shard.ir.summed_type`: XLA:CPU's 16-bit floats), the gradients are
        converted to f32 first, summed in f32 and each shard converted back: the sum the
        all-reduce made, from each device's unrounded value (XLA skips a convert pair
        with excess precision allowed), where a 16-bit bucket would round every
        device's value before the sum."""
        emit = self.emit
        anchor = max((leaf.all_reduce for leaf in leaves), key=order.__getitem__)
        to_apply = self.comp[leaves[0].all_reduce].attr("to_apply")
        own_type = leaves[0].shape.element_type
        element_type = summed_type(own_type, self.upcast)
        if element_type != own_type:
            to_apply = emit.summing(element_type)
        with self.rw.inserting_before(anchor):
            if len(leaves) == 1 and emit.scatters_blocks(leaves[0].operand, leaves[0].format):
                self.scatter_block(leaves[0], to_apply, element_type)
                return
            flats = [emit.flat_padded(emit.converted(leaf.operand, element_type), leaf.format)
                     for leaf in leaves]
            total = sum(leaf.format.shard_len for leaf in leaves)
            if len(leaves) == 1:
                operand = flats[0]
            else:
                pieces = [emit.add("reshape", emit.shape(element_type, (self.n, leaf.format.shard_len)),
                                   [flat], name=f"{leaf.operand}.rows")
                          for leaf, flat in zip(leaves, flats)]
                rows = emit.add("concatenate", emit.shape(element_type, (self.n, total)), pieces,
                                name="gradient_bucket", dimensions=(1,))
                operand = emit.add("reshape", emit.shape(element_type, (self.n * total,)),
                                   [rows], name="gradient_bucket.flat")
            scattered = emit.add("reduce-scatter", emit.shape(element_type, (total,)), [operand],
                                 name="reduce-scatter",
                                 **emit.collective_attrs(dimensions=(0,), to_apply=to_apply))
            starts = list(itertools.accumulate((leaf.format.shard_len for leaf in leaves),
                                               initial=0))
            read_from = emit.piece_starts(starts[:-1]) if len(leaves) > 1 else None
            for leaf, start in zip(leaves, starts):
                shard = emit.converted(scattered if len(leaves) == 1 else emit.piece(
                    scattered, emit.shape(element_type, (leaf.format.shard_len,)), (start,),
                    f"{leaf.values[0]}.shard", read_from), own_type)
                for value in leaf.values:
                    self.shard_of[value] = shard
                self.collective_of[leaf.label] = scattered

    def scatter_block(self, leaf: PlannedLeaf, to_apply: AttrValue | None,
                      element_type: str) -> None:
        """Reduce-scatter the gradient along its format's major dimension (each device
        gets its block) and transpose only that block into the shard order; summed in
        ``element_type`` (:meth:`scatter`)."""
        emit = self.emit
        scattered = emit.add("reduce-scatter", emit.shape(element_type, block_dims(leaf.format)),
                             [emit.converted(leaf.operand, element_type)], name="reduce-scatter",
                             **emit.collective_attrs(dimensions=(leaf.format.known_block[0],),
                                                     to_apply=to_apply))
        shard = emit.converted(emit.block_to_shard(scattered, leaf.format, element_type),
                               leaf.shape.element_type)
        for value in leaf.values:
            self.shard_of[value] = shard
        self.collective_of[leaf.label] = scattered

    # Region ops ---------------------------------------------------------------------------
    def shard_op(self, name: str, op: RegionOp) -> None:
        inst = self.comp[name]
        calls = inst.called("calls") if inst.opcode == "fusion" else None
        with self.rw.inserting_before(name):
            inside = self.sliced_inside(inst, op) if calls and op.kind is OpKind.ELEMENTWISE \
                else {}
            operands = [inside[i] if i in inside else self.operand_shard(o, op.format_of(i))
                        for i, o in enumerate(inst.operands)]
            if op.kind is OpKind.BLOCK:
                self.shard_of[name] = self.block_op(inst, op, operands)
                return
            if op.kind is OpKind.VIEW:
                self.shard_of[name] = operands[0]
                return
            attributes = {k: v for k, v in inst.attributes.items() if k != "sharding"}
            if calls and inside:
                length = op.result_shard.shard_len
                attributes["calls"] = ComputationRef(self.sliced_body(
                    calls, length, {i: op.format_of(i).elements for i in inside}))
                operands.append(self.emit.offset(length))
            elif calls:
                attributes["calls"] = ComputationRef(self.sharded_body(calls, op.result_shard))
            new = Instruction(self.rw.fresh_name(f"{name}.shard"), inst.opcode,
                              self.emit.shape(inst.array_shape.element_type,
                                              (op.result_shard.shard_len,)),
                              operands, attributes)
            self.shard_of[name] = self.rw.add_instruction(new).name

    def block_op(self, inst: Instruction, op: RegionOp, operands: list[str]) -> str:
        """``inst`` on this device's blocks of its sharded operands (unflattened from the
        shards; scalars as they are), its result block flattened into the result's shard;
        a fusion calls a copy of its body on the blocks (:func:`block_body`)."""
        emit = self.emit
        element_type = inst.array_shape.element_type
        blocks = [shard if self.comp[o].array_shape.is_scalar else emit.block_of(
            shard, op.format_of(i), self.comp[o].array_shape.element_type)
            for i, (o, shard) in enumerate(zip(inst.operands, operands))]
        attributes = {k: v for k, v in inst.attributes.items() if k != "sharding"}
        result_dims = block_dims(op.result_shard)
        calls = inst.called("calls")
        if inst.opcode == "fusion" and calls:
            attributes["calls"] = ComputationRef(self.blocked_body(calls, op))
        result = emit.add(inst.opcode, emit.shape(element_type, result_dims),
                          blocks, name=f"{inst.name}.block", **attributes)
        return emit.shard_of_block(result, op.result_shard, element_type)

    def sharded_body(self, name: str, fmt: ShardFormat) -> str:
        """A copy of a fusion body computing ``[L]`` shards (see :func:`shard_body`)."""
        return self.body_copy(("body", name, fmt.shard_len), name, "shard",
                              lambda body, new_name: shard_body(
                                  body, new_name,
                                  lambda t: self.emit.shape(t, (fmt.shard_len,))))

    def sliced_inside(self, inst: Instruction, op: RegionOp) -> dict[int, str]:
        """The operands of the fusion ``inst`` whose shard the fusion slices itself, each
        handed in whole (flat, ``[E]``), by position: replicated full values (a weight,
        a state leaf) in their stored order, unpadded, of the result's shard length, whose
        shard does not exist already (an input shard, one another op sliced). In a
        module XLA fused already nothing fuses what the pass writes after it, so a
        ``dynamic-slice`` of its own would be a kernel (and a buffer) per operand: as a
        producer fused into the update's loop, it reads only the shard, as XLA fuses
        one."""
        comp, length = self.comp, op.result_shard.shard_len
        inside: dict[int, str] = {}
        for i, operand in enumerate(inst.operands):
            fmt = op.format_of(i)
            shape = comp[operand].shape
            if operand in self.shard_of or ("shard", operand, fmt) in self.emit.cache or \
                    not isinstance(shape, ArrayShape) or \
                    shape.is_scalar or is_scalar_broadcast(comp, operand) or fmt.padding or \
                    fmt.shard_len != length or not fmt.keeps_dimension_order or \
                    uses_blocks(fmt, shape):
                continue
            key = ("flat", operand, fmt)
            if key not in self.emit.cache:
                self.emit.cache[key] = self.emit.flat_padded(operand, fmt)
            inside[i] = self.emit.cache[key]
        return inside

    def sliced_body(self, name: str, length: int, elements: dict[int, int]) -> str:
        """A copy of a fusion body on ``[L]`` shards (:func:`shard_body`) whose
        parameters ``elements`` (number → element count) come whole and flat, sliced
        inside at the offset a last parameter brings (:func:`slice_inside`)."""
        key = ("sliced body", name, length, tuple(sorted(elements.items())))
        return self.body_copy(key, name, "shard", lambda body, new_name: slice_inside(
            shard_body(body, new_name, lambda t: self.emit.shape(t, (length,))), elements,
            length, self.emit.shape))

    def blocked_body(self, name: str, op: RegionOp) -> str:
        """A copy of a fusion body computing on blocks (see :func:`block_body`)."""
        operand, result = block_dims(op.operand_format), block_dims(op.result_shard)
        return self.body_copy(("block body", name, operand, result), name, "block",
                              lambda body, new_name: block_body(body, new_name, operand,
                                                                result))

    def body_copy(self, key: tuple, name: str, suffix: str,
                  build: Callable[[Computation, str], Computation]) -> str:
        """The copy ``build`` makes of body ``name`` (once per ``key``), inserted right
        after it under a fresh ``name.suffix`` name."""
        if key not in self.emit.cache:
            new_name = unused_name(f"{name}.{suffix}", self.module.has_computation)
            self.edits.insert_computation(build(self.module.computation(name), new_name),
                                          after=name)
            self.emit.cache[key] = new_name
        return self.emit.cache[key]

    def reduce_op(self, name: str, op: RegionOp) -> None:
        """Masked local reduction + all-reduce over the group: to one element, or (a
        reduction along the shard's block dimension) of this device's block, the
        all-reduce then as small as the result."""
        emit = self.emit
        inst = self.comp[name]
        fmt = op.operand_format
        source = inst.operands[0]  # (its initial value is the reducer's neutral one)
        element_type = self.comp[source].array_shape.element_type
        out_type = inst.array_shape.element_type
        to_apply = inst.attr("to_apply")
        partial = inst.array_shape.num_elements != 1
        with self.rw.inserting_before(name):
            shard = self.operand_shard(source, fmt)
            if fmt.padding:
                shard = self.mask_padding(shard, fmt, element_type, op.neutral, f"{name}.masked")
            neutral = emit.constant(out_type, op.neutral)
            if partial:  # along the block dimension: this device's block, reduced
                block = emit.block_of(shard, fmt, element_type)
                local = emit.add("reduce", inst.shape, [block, neutral], name=f"{name}.local",
                                 dimensions=inst.ints_attr("dimensions"), to_apply=to_apply)
            else:
                local = emit.add("reduce", emit.shape(out_type, ()), [shard, neutral],
                                 name=f"{name}.local", dimensions=(0,), to_apply=to_apply)
            result = emit.add("all-reduce", self.comp[local].shape, [local],
                              name=f"{name}.sum", **emit.collective_attrs(to_apply=to_apply))
            self._small_sums.append(result)
            if op.reducer in _NAN_FLAGS and out_type.startswith(("f", "bf")):
                result = self.keep_nan(local, result, op.reducer, out_type, to_apply, name)
            if not partial and not inst.array_shape.is_scalar:
                result = emit.add("reshape", inst.shape, [result])
        self.rw.replace_all_uses_with(name, result)
        self._erase.append(name)

    def mask_padding(self, shard: str, fmt: ShardFormat, element_type: str, literal: str,
                     name: str) -> str:
        """``shard`` with its padding lanes set to ``literal`` (a reducer's neutral value
        before a reduction; zero where a shard leaves the computation)."""
        emit = self.emit
        fill = emit.add("broadcast", emit.shape(element_type, (fmt.shard_len,)),
                        [emit.constant(element_type, literal)], dimensions=())
        return emit.add("select", emit.shape(element_type, (fmt.shard_len,)),
                        [self.valid_lanes(fmt), shard, fill], name=name)

    def keep_nan(self, local: str, reduced: str, reducer: str, element_type: str, to_apply: AttrValue | None,
                 name: str) -> str:
        """A cross-device min/max that propagates NaN as the whole-tensor reduce does
        (XLA:CPU's all-reduce(min/max) drops it): each device also all-reduces, with the
        same reducer, a flag saying its local result is NaN (a one-element sum combined
        with the others); where any flag is set the result is NaN."""
        emit = self.emit
        scalar, pred = emit.shape(element_type, ()), emit.shape("pred", ())
        flagged, zero = _NAN_FLAGS[reducer], emit.constant(element_type, "0")
        is_nan = emit.add("compare", pred, [local, local], name=f"{name}.is_nan",
                          direction=Ident("NE"))
        flag = emit.add("select", scalar, [is_nan, emit.constant(element_type, flagged), zero],
                        name=f"{name}.nan_flag")
        any_flag = emit.add("all-reduce", scalar, [flag], name=f"{name}.any_nan",
                            **emit.collective_attrs(to_apply=to_apply))
        self._small_sums.append(any_flag)
        seen = emit.add("compare", pred, [any_flag, zero], direction=Ident("NE"))
        return emit.add("select", scalar, [seen, emit.constant(element_type, "nan"), reduced],
                        name=f"{name}.nan_kept")

    def valid_lanes(self, fmt: ShardFormat) -> str:
        """pred[L]: which lanes of this device's shard hold real (not padding) elements."""
        emit = self.emit
        key = ("valid", fmt.shard_len, fmt.elements)
        if key not in emit.cache:
            length = fmt.shard_len
            lanes = emit.add("iota", emit.shape("u32", (length,)), [], iota_dimension=0)
            start = emit.add("broadcast", emit.shape("u32", (length,)),
                             [emit.offset(length)], dimensions=())
            index = emit.add("add", emit.shape("u32", (length,)), [lanes, start])
            limit = emit.add("broadcast", emit.shape("u32", (length,)),
                             [emit.constant("u32", str(fmt.elements))], dimensions=())
            emit.cache[key] = emit.add("compare", emit.shape("pred", (length,)), [index, limit],
                                       name="valid_lanes", direction=Ident("LT"))
        return emit.cache[key]

    # Driver -------------------------------------------------------------------------------
    def run(self) -> dict[str, str]:
        """Rewrite; returns leaf label → the collective that now carries it. A rewrite
        whose result has a dependency cycle raises :class:`~hlo_shard.graph.DependencyCycle`
        with the computation half-edited: the caller restores its
        :class:`RegionSnapshot` and keeps the region whole."""
        plan = self.plan
        self._seed_inputs()
        # Inserting and erasing other instructions keeps the all-reduces' order: one scan.
        all_reduces = {leaf.all_reduce for leaf in plan.active}
        order = {inst.name: i for i, inst in enumerate(self.comp.instructions)
                 if inst.name in all_reduces}
        # (a gradient computed from another's updated weight: a bucket of its own level)
        levels = summing_levels(self.comp, plan.active)
        for level in sorted(set(levels.values())):
            for bucket in self.bucketing.buckets(
                    [leaf for leaf in plan.active if levels[leaf.label] == level],
                    lambda leaf: leaf.byte_size, lambda leaf: leaf.shape.element_type):
                self.scatter(bucket, order)
        for name, op in plan.ops.items():
            if op.kind is OpKind.REDUCE:
                self.reduce_op(name, op)
            else:
                self.shard_op(name, op)
        self._gather_boundaries()
        self._rebuild_all_reduces()
        self._erase.extend(reversed(list(plan.ops)))
        # The replaced instructions, then operands of theirs left unused.
        self.rw.remove_dead(among=self._erase)
        combine_small_sums(self.rw, self.emit, self._small_sums)
        self.rw.sort_topologically()
        shared: defaultdict[str, int] = defaultdict(int)
        for name in self.collective_of.values():
            shared[name] += 1
        return {label: f"{name} (combined, {shared[name]} tensors)" if shared[name] > 1 else name
                for label, name in self.collective_of.items()}

    def _seed_inputs(self) -> None:
        """Input shards: the instruction's value becomes its ``[L]`` shard; users outside
        the region get the all-gathered full value (one collective per bucket). Where
        every such user converts it to one narrower float type (bf16 compute from f32
        master weights), the shard is converted and the narrow value gathered: the
        converts' users read it, fewer bytes cross the network."""
        comp = self.comp
        outside: dict[str, list[str]] = {}
        items: list[Gathered] = []
        #: Converted shard → the converts it replaces.
        narrowed: dict[str, list[str]] = {}
        for name, fmt in self.inputs.items():
            inst = comp[name]
            full_shape = inst.array_shape
            users = [u.name for u in self.rw.users(name) if u.name not in self.plan.ops]
            users += [""] if name == comp.root_name else []
            narrow = narrowing_convert(comp, name, users)
            self.rw.set_shape(inst, self.emit.shape(full_shape.element_type, (fmt.shard_len,)))
            if narrow is not None:
                with self.rw.inserting_before(min(users, key=comp.position)
                                              if not self.gather_at_top else self.emit.first):
                    source = self.emit.converted(name, narrow)
                narrowed[source] = users
                readers = [u.name for c in users for u in self.rw.users(c)]
                readers += [""] if comp.root_name in users else []
                outside[source] = readers
                items.append(Gathered(source, fmt, self.emit.gathered_shape(
                    comp[users[0]].array_shape, fmt, readers), name))
            elif users:
                outside[name] = users
                items.append(Gathered(name, fmt,
                                      self.emit.gathered_shape(full_shape, fmt, users), name))
            self.emit.cache[("shard", name, fmt)] = name
        for item, full in gather_before_use(self.rw, self.emit, self.bucketing, items,
                                            outside, self.gather_at_top).items():
            if item.shard not in narrowed:
                self._rewire(item.shard, full, outside[item.shard])
                continue
            for convert in narrowed[item.shard]:
                self.rw.replace_all_uses_with(convert, full)  # the root too
                self.rw.erase(convert)

    def _rewire(self, value: str, replacement: str, users: list[str],
                keep: dict[int, str] | None = None, at_root: RootUses | None = None) -> None:
        """Point ``users`` (``""``: the root) of ``value`` at ``replacement``; root tuple
        positions in ``keep`` get that name instead. ``at_root``: where the root reads
        each value, kept in step here (a root tuple of thousands of outputs is not
        searched once per value)."""
        for user in users:
            if not user:
                self.rw.set_root(replacement)
                continue
            inst = self.comp[user]
            indexed = at_root if at_root is not None and inst is at_root.root else None
            positions = indexed.take(value) if indexed is not None else \
                [i for i, operand in enumerate(inst.operands) if operand == value]
            for i in positions:
                kept = keep.get(i) if keep and user == self.comp.root_name else None
                self.rw.set_operand(inst, i, kept or replacement)
                if indexed is not None:
                    indexed.add(kept or replacement, i)

    def _gather_boundaries(self) -> None:
        comp = self.comp
        root = comp.root
        kept_shards = {k: self.shard_of[v] for k, v in self.outputs.items()}
        position = {inst.name: i for i, inst in enumerate(comp.instructions)}
        at_root = RootUses.of(root)
        needs: dict[str, list[str]] = {}
        for value, boundary in self.plan.boundary.items():
            users = list(boundary)
            if root.name in users and root.opcode == "tuple" and all(
                    self.outputs.get(k) == value for k in at_root.positions(value)):
                users.remove(root.name)  # only shard-keeping outputs use it: no gather
            if users:
                needs[value] = users
        anchors = self._gather_anchors(needs, position)
        gathered: dict[str, str] = {}
        for anchor, values in anchors.items():
            values.sort(key=lambda v: position[v])
            for bucket in self.bucketing.buckets(values, lambda v: comp[v].shape.byte_size,
                                                 lambda v: comp[v].array_shape.element_type):
                items = [Gathered(self.shard_of[v], self.plan.sharded[v],
                                  self.emit.gathered_shape(comp[v].array_shape,
                                                           self.plan.sharded[v],
                                                           needs[v]), v)
                         for v in bucket]
                with self.rw.inserting_before(anchor):
                    gathered.update(zip(bucket, self.emit.gather(items)))
        for value, users in needs.items():
            self._rewire(value, gathered[value], users, kept_shards, at_root)
        if root.opcode == "tuple" and isinstance(root.shape, TupleShape) and self.outputs:
            zero_padded = PaddingZeros(self.module, comp, self.plan, set(self.inputs))
            for k, value in self.outputs.items():
                if root.operands[k] == value:
                    self.rw.set_operand(root, k, self.output_shard(value, zero_padded))
            elements = list(root.shape.elements)
            for k in self.outputs:
                elements[k] = comp[root.operands[k]].shape
            self.rw.set_shape(root, TupleShape(tuple(elements)))

    def _gather_anchors(self, needs: dict[str, list[str]], position: dict[str, int]
                        ) -> dict[str, list[str]]:
        """Where the sharded values ``needs`` lists (value → its users outside the
        region, ``""``: the root) are all-gathered: each right before its first user,
        except that every value whose shard is computed from none of those users (the
        common case: nothing the update's results feed flows back into it) goes before
        the first user of any of them, so that they share buckets as the strategy
        priced them — at their own first users, values used apart (each weight reshaped
        on its way to the output) would pay a collective each. Only those: the combined
        all-gather then reads nothing computed from what it feeds, so it closes no
        dependency cycle."""
        comp = self.comp
        root = comp.root.name

        def first_user(value: str) -> str:
            return min(needs[value], key=lambda u: position[u] if u else len(position)) or root

        users = {user or root for values in needs.values() for user in values}
        downstream: set[str] = set()
        for inst in topological_order(comp):
            if inst.name in users or any(d in downstream for d in dependencies(inst)):
                downstream.add(inst.name)
        free = {value for value in needs if self.shard_of[value] not in downstream}
        top = min(map(first_user, free), key=position.__getitem__, default=root)
        anchors: dict[str, list[str]] = defaultdict(list)
        for value in needs:
            anchors[top if value in free else first_user(value)].append(value)
        return anchors

    def output_shard(self, value: str, zero_padded: PaddingZeros) -> str:
        """The shard of ``value`` a root position keeps, its padding lanes zero (the
        manifest's contract): masked unless the update provably keeps them zero."""
        shard, fmt = self.shard_of[value], self.plan.sharded[value]
        if not fmt.padding or zero_padded.state(value) == _ZERO:
            return shard
        element_type = self.comp[value].array_shape.element_type
        with self.rw.inserting_before(self.comp.root.name):
            return self.mask_padding(shard, fmt, element_type,
                                     "false" if element_type == "pred" else "0",
                                     f"{value}.zero_padded")

    def _rebuild_all_reduces(self) -> None:
        """Keep the unsharded elements of partly sharded tuple all-reduces."""
        by_ar: dict[str, list[PlannedLeaf]] = defaultdict(list)
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
                            self.rw.set_attr(self.comp[value], "index", position)
                            self.rw.set_operand(self.comp[value], 0, new.name)


def unused_name(base: str, used: Callable[[str], bool]) -> str:
    """``base``, else the first of ``base.1``, ``base.2``, … that is not ``used``."""
    return next(candidate for k in itertools.count()
                if not used(candidate := base if k == 0 else f"{base}.{k}"))


def slice_inside(body: Computation, elements: dict[int, int], length: int,
                 shape: Callable[[str, tuple[int, ...]], ArrayShape]) -> Computation:
    """``body`` (on ``[L]`` shards) with its parameters ``elements`` (number → element
    count ``E``) taken whole: each becomes an ``[E]`` parameter sliced to the ``[L]``
    shard at the offset of a new last parameter (``u32``), under the name the shard had,
    so its users read it as before."""
    taken = {inst.name for inst in body.instructions}

    def fresh(base: str) -> str:
        name = unused_name(base, taken.__contains__)
        taken.add(name)
        return name

    parameters = [inst for inst in body.instructions if inst.opcode == "parameter"]
    offset = Instruction(fresh("shard_offset"), "parameter", shape("u32", ()), [], {},
                         len(parameters))
    head: list[Instruction] = []
    slices: list[Instruction] = []
    for param in parameters:
        number = param.parameter_number
        if number not in elements:
            head.append(param)
            continue
        whole = Instruction(fresh(f"{param.name}.whole"), "parameter",
                            shape(param.array_shape.element_type, (elements[number],)), [], {},
                            number)
        head.append(whole)
        slices.append(Instruction(param.name, "dynamic-slice", param.shape,
                                  [whole.name, offset.name],
                                  {"dynamic_slice_sizes": (length,)}))
    rest = [inst for inst in body.instructions if inst.opcode != "parameter"]
    return Computation(body.name, [*head, offset, *slices, *rest], body.root_name)


def narrowing_convert(comp: Computation, value: str, users: list[str]) -> str | None:
    """The float type narrower than ``value``'s that all of ``users`` (``""``: the root)
    convert it to, in one shape and layout — its uses need only that narrow copy — or
    None."""
    shapes = {comp[u].shape for u in users if u and comp[u].opcode == "convert"}
    if not users or "" in users or len(shapes) != 1 or \
            any(comp[u].opcode != "convert" for u in users):
        return None
    (shape,) = shapes
    source = comp[value].shape
    if not isinstance(shape, ArrayShape) or not isinstance(source, ArrayShape):
        return None
    narrow, wide = shape.element_type, source.element_type
    if narrow in FLOAT_TYPES and wide in FLOAT_TYPES and \
            ELEMENT_BITS[narrow] < ELEMENT_BITS[wide]:
        return narrow
    return None


def gather_before_use(rw: Rewriter, emit: ShardEmitter, bucketing: Bucketing,
                      items: list[Gathered], users: dict[str, list[str]],
                      at_top: bool = False) -> dict[Gathered, str]:
    """All-gather shards that already exist (parameters, loop slots) right before the
    first of their ``users`` (``""``: the root) — never earlier, so the full copy is
    live no longer than needed; shards whose first user is the same share a bucket.
    ``at_top``: all of them before the first user of any (weights the backward pass
    reads again are live through the step anyway: gathered together, they share
    buckets — the paper's all-gather at the top of the step)."""
    comp = rw.comp
    position = {inst.name: i for i, inst in enumerate(comp.instructions)}
    anchors: dict[tuple[str, bool], list[Gathered]] = defaultdict(list)
    first_readers: dict[Gathered, str | None] = {}
    for item in items:
        readers = [u or comp.root.name for u in users.get(item.shard, [])]
        readers = [u for u in readers if u != item.shard]
        first_readers[item] = min(readers, key=position.__getitem__) if readers else None
    top = min((r for r in first_readers.values() if r is not None), key=position.__getitem__,
              default=None)
    for item in sorted(items, key=lambda i: position[i.shard]):
        first = top if at_top and first_readers[item] is not None else first_readers[item]
        # (anchor, before it?): with no other reader (the shard is the root), right after.
        key = (first, True) if first is not None else (item.shard, False)
        anchors[key].append(item)
    out: dict[Gathered, str] = {}
    for (anchor, before), group in anchors.items():
        for bucket in bucketing.buckets(group, lambda i: i.shape.byte_size,
                                        lambda i: i.shape.element_type):
            place = rw.inserting_before if before else rw.inserting_after
            with place(anchor):
                out.update(zip(bucket, emit.gather(bucket)))
    return out


def combine_small_sums(rw: Rewriter, emit: ShardEmitter, names: list[str]) -> int:
    """One all-reduce per dependency level for the all-reduces of partial results
    ``names`` (per-tensor squared norms of global-norm clipping, LAMB's trust-ratio
    norms, Adafactor's statistics, is-finite checks): those with the same reducer,
    element type and groups, none depending on another, become one ``[k]`` all-reduce of
    their flattened, concatenated values — one collective's latency instead of k.
    Returns how many collectives were saved."""
    comp = rw.comp
    present = [n for n in names if n in comp]
    if len(present) < 2:
        return 0
    # Level: how many of these all-reduces lie upstream (same level: independent).
    members = set(present)
    level: dict[str, int] = {}
    for inst in topological_order(comp):
        level[inst.name] = max((level[o] + (o in members) for o in inst.operands), default=0)
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name in present:
        inst = comp[name]
        reducer = reducer_opcode(emit.module, getattr(inst.attr("to_apply"), "name", ""))
        if reducer is None:
            continue
        groups[(level[name], inst.array_shape.element_type, reducer,
                str(inst.attr("replica_groups")), inst.attr("use_global_device_ids"))
               ].append(name)
    saved = 0
    #: Where each instruction stands: inserting and erasing others keeps the order of
    #: those it holds, so it is read again only for an operand it lacks.
    position: dict[str, int] = {}
    for key, group in groups.items():
        if len(group) < 2:
            continue
        element_type, first = key[1], comp[group[0]]
        sizes = [comp[n].array_shape.num_elements for n in group]
        label = "one_element_sums" if set(sizes) == {1} else "small_sums"
        operands = [comp[n].operands[0] for n in group]
        if not position.keys() >= set(operands):  # one made by an earlier group: read again
            position = {inst.name: i for i, inst in enumerate(comp.instructions)}
        anchor = max(operands, key=position.__getitem__)
        with rw.inserting_after(anchor):
            pieces = [o if comp[o].array_shape.dims == (size,) != (1,) else
                      emit.add("reshape", emit.shape(element_type, (size,)), [o],
                               name=f"{o}.element" if size == 1 else f"{o}.flat")
                      for o, size in zip(operands, sizes)]
            values = emit.add("concatenate", emit.shape(element_type, (sum(sizes),)), pieces,
                              name=label, dimensions=(0,))
            attributes = {k: v for k, v in first.attributes.items()}
            if "channel_id" in attributes:
                attributes["channel_id"] = emit.channels.fresh()
            summed = rw.add_instruction(Instruction(
                rw.fresh_name(f"{label}.sum"), "all-reduce",
                emit.shape(element_type, (sum(sizes),)), [values], attributes)).name
            start = 0
            for name, size in zip(group, sizes):
                piece = emit.add("slice", emit.shape(element_type, (size,)), [summed],
                                 name=f"{name}.element" if size == 1 else f"{name}.piece",
                                 slice=SliceRanges(((start, start + size, 1),)))
                start += size
                scalar = emit.add("reshape", comp[name].shape, [piece], name=name)
                rw.replace_all_uses_with(name, scalar)
                rw.erase(name)
        saved += len(group) - 1
    return saved


#: min/max reducers → the value of the is-NaN flag all-reduced with the same reducer
#: (max of {0, 1}, min of {0, -1}: set where any device saw NaN).
_NAN_FLAGS = {"maximum": "1", "minimum": "-1"}

#: What a value holds in the padding lanes of its shard: zero, a finite nonzero
#: constant (a broadcast literal), or anything (the default).
_ZERO, _FINITE, _ANY = "zero", "finite", "any"
#: Literals that stay finite and nonzero in f16/bf16 too (0·c = 0 and 0/c = 0 hold).
_NORMAL_IN_EVERY_FLOAT = (1e-4, 6e4)


def _all_zero(states: list[str]) -> str:
    return _ZERO if states and all(s == _ZERO for s in states) else _ANY


def _product(states: list[str]) -> str:
    return _ZERO if _ZERO in states and all(s in (_ZERO, _FINITE) for s in states) else _ANY


def _quotient(states: list[str]) -> str:
    return _ZERO if states[0] == _ZERO and states[1] == _FINITE else _ANY


def _selected(states: list[str]) -> str:
    return _all_zero(states[1:])


def _same(states: list[str]) -> str:
    return states[0]


#: opcode → the padding state of its result from its operands' (default: _ANY).
_PADDING_RULES = {
    **{op: _all_zero for op in ZERO_PRESERVING},
    **{op: _same for op in VIEWS},
    "multiply": _product, "divide": _quotient, "select": _selected,
}


class PaddingZeros:
    """Which region values keep zeros in their shards' padding lanes: gradients (the
    reduce-scatter of a zero-padded vector), state and carried shards (zero by contract),
    slices of replicated values (zero-padded), and what the rules of
    :data:`_PADDING_RULES` derive from those (fusion bodies included)."""

    def __init__(self, module: Module, comp: Computation, plan: RegionPlan,
                 input_shards: set[str]) -> None:
        self.module, self.comp, self.plan = module, comp, plan
        self.zero = input_shards | {v for leaf in plan.active for v in leaf.values}
        self._memo: dict[tuple[str, tuple[str, ...]], str] = {}
        self._states: dict[str, str] = {}

    def state(self, value: str) -> str:
        """``value``'s padding state. Operands first, from an explicit stack, each value
        once: a long update does not recurse, and a value the update reaches along many
        paths is not derived once per path."""
        stack = [value]
        expanded: set[str] = set()
        while stack:
            name = stack[-1]
            if name in self._states:
                stack.pop()
                continue
            known = self._given_state(name)
            missing = [] if known is not None else \
                [o for o in self.comp[name].operands if o not in self._states]
            if missing:
                if name in expanded:
                    raise ValueError(f"{self.comp.name}: {name} depends on itself")
                expanded.add(name)
                stack.extend(missing)
                continue
            stack.pop()
            self._states[name] = known if known is not None else self._derived_state(name)
        return self._states[value]

    def _given_state(self, value: str) -> str | None:
        """The state of a value that does not follow from its operands', or None."""
        comp = self.comp
        if value in self.zero:
            return _ZERO
        inst, op = comp[value], self.plan.ops.get(value)
        if op is None or op.kind is OpKind.REDUCE:  # replicated: a broadcast, a scalar, a slice
            if is_scalar_broadcast(comp, value):
                return _constant_state(comp[inst.operands[0]])
            return _constant_state(inst) if inst.array_shape.is_scalar else _ZERO
        return None

    def _derived_state(self, value: str) -> str:
        inst = self.comp[value]
        operands = [self._states[o] for o in inst.operands]
        if self.plan.ops[value].kind is OpKind.VIEW:
            return operands[0]  # the operand's shard itself
        calls = inst.called("calls")
        if inst.opcode == "fusion" and calls:
            return self._body(calls, tuple(operands))
        return _rule(inst.opcode)(operands)

    def _body(self, name: str, params: tuple[str, ...]) -> str:
        key = (name, params)
        if key not in self._memo:
            body = self.module.computation(name)
            states: dict[str, str] = {}
            for inst in body.instructions:
                if inst.opcode == "parameter":
                    states[inst.name] = params[inst.param_number]
                elif inst.opcode == "constant":
                    states[inst.name] = _constant_state(inst)
                elif inst.opcode == "broadcast" and body[inst.operands[0]].array_shape.is_scalar:
                    states[inst.name] = states[inst.operands[0]]
                else:
                    states[inst.name] = _rule(inst.opcode)([states[o] for o in inst.operands])
            self._memo[key] = states[body.root.name]
        return self._memo[key]


def _rule(opcode: str) -> Callable[[list[str]], str]:
    return _PADDING_RULES.get(opcode, lambda _: _ANY)


def _constant_state(inst: Instruction) -> str:
    """A scalar constant's padding state as a broadcast operand."""
    if inst.opcode != "constant" or inst.literal is None:
        return _ANY
    try:
        number = float(inst.literal)
    except ValueError:
        return _ZERO if inst.literal.strip() == "false" else _ANY
    if number == 0:
        return _ZERO
    return _FINITE if _NORMAL_IN_EVERY_FLOAT[0] <= abs(number) <= _NORMAL_IN_EVERY_FLOAT[1] \
        else _ANY


# ---------------------------------------------- outside the region: state and loop carries


def bypass_copies(rw: Rewriter, params: list[str], chains: dict[str, list[str]]) -> None:
    """The users of each sharded weight's copies read the parameter itself (a copy of a
    value in its own layout is that value): the parameter becomes the shard they read."""
    for name in params:
        chain = chains.get(name, [])
        if chain:
            rw.replace_all_uses_with(chain[-1], name)
            for copy in reversed(chain):
                rw.erase(copy)


def annotate_state(module: Module, rw: Rewriter, state: dict[int, StatePair],
                    groups: DeviceGroups) -> None:
    """SPMD form: a sharded state parameter's global value is the padded flat vector."""
    comp = rw.comp
    names = comp.parameter_names()
    for number in state:
        param = comp[names[number]]
        if "sharding" in param.attributes or module.num_partitions > 1:
            rw.set_attr(param, "sharding", Raw(_shard_sharding(groups)))


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


def shard_loop_carry(edits: ModuleRewriter, carry: LoopCarry, channels: ChannelIds,
                      bucketing: Bucketing, sink_state: bool) -> dict[int, StatePair]:
    """Outside the body: slice the initial values of the carried slots before the loop,
    gather them after it, and give the loop, body and condition the new carry shape.

    With ``sink_state`` (``--state sharded``, loop in the entry), a slot whose initial
    value is an entry parameter (through copies) and whose final value is an entry output
    (through copies) is not sliced nor gathered: parameter and output become the shard.
    Returns the entry's state pairs so sunk."""
    module = edits.module
    parent = module.computation(carry.parent)
    body = module.computation(carry.body)
    loop = parent[carry.loop]
    rw = edits.rewriter(parent)
    emit = ShardEmitter(module, parent, rw, carry.groups, carry.template, channels, edits)
    old = parent[loop.operands[0]]
    elements: list[Shape] = list(cast(TupleShape, loop.shape).elements)
    for index, fmt in carry.slots.items():
        elements[index] = emit.shape(proved_element(loop.shape, index).element_type, (fmt.shard_len,))
    carried = TupleShape(tuple(elements))
    sunk = _sinkable_slots(parent, rw, carry, old) if sink_state and parent.is_entry else {}
    state: dict[int, StatePair] = {}
    root = parent.root
    for index, (upward, downward, k) in sunk.items():
        fmt, param = carry.slots[index], parent[upward[0]]
        state[cast(int, param.parameter_number)] = StatePair(
            k, downward[-1], fmt, proved_array(param.shape), proved_element(root.shape, k))
        for name in upward + downward:
            rw.set_shape(parent[name], elements[index])
        rw.set_shape(root, TupleShape(tuple(elements[index] if i == k else e
                                            for i, e in enumerate(cast(TupleShape,
                                                                       root.shape).elements))))
    annotate_state(module, rw, state, carry.groups)
    operands = list(old.operands)
    with rw.inserting_before(loop.name):
        for index, fmt in carry.slots.items():
            if index not in sunk:
                operands[index] = emit.local_slice(old.operands[index], fmt)
        init = rw.add("tuple", carried, operands, name=old.name)
    rw.set_operand(loop, 0, init.name)
    if not rw.is_used(old.name) and parent.root_name != old.name:
        rw.erase(old.name)
    rw.set_shape(loop, carried)
    for comp in (body, module.computation(carry.condition)):
        edits.rewriter(comp).set_shape(comp.parameters()[0], carried)
    readers = [r for r in rw.users(loop.name) if tuple_index(r) in carry.slots]
    users = {r.name: [u.name for u in rw.users(r.name)] for r in readers}
    items = [Gathered(r.name, carry.slots[tuple_index(r)],
                      emit.gathered_shape(proved_array(r.shape), carry.slots[tuple_index(r)],
                                          users[r.name]),
                      r.name)
             for r in readers if tuple_index(r) not in sunk]
    for reader in readers:
        rw.set_shape(reader, elements[tuple_index(reader)])
    for item, gathered in gather_before_use(rw, emit, bucketing, items, users).items():
        for user in users[item.shard]:
            inst = parent[user]
            for i, operand in enumerate(inst.operands):
                if operand == item.shard:
                    rw.set_operand(inst, i, gathered)
        if parent.root_name == item.shard:
            rw.set_root(gathered)
    return state


def _sinkable_slots(parent: Computation, rw: Rewriter, carry: LoopCarry,
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
        readers[tuple_index(reader)].append(reader)
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
        if flattenable(fmt, proved_array(parent[upward[0]].shape)) and \
                flattenable(fmt, proved_element(root.shape, k)):
            out[index] = (upward, downward, k)
    return out


__all__ = ["RegionRewrite", "RegionSnapshot", "annotate_state", "bypass_copies",
           "combine_small_sums", "gather_before_use", "narrowing_convert", "shard_loop_carry"]
