"""The last step of the pass: emitting the shard format's pieces and the collectives into
one computation (:class:`ShardEmitter`), and grouping gradients into those collectives
(:class:`Bucketing`). Nothing here decides *what* is sharded: :mod:`.analysis` did, and
:mod:`.lowering` calls in here for each piece.

XLA's own index pattern for shard offsets (reference §13.4): the participant id
(``replica-id``, ``partition-id`` or the flattened id) → a u32 table lookup when the groups
are not ``{0..N-1}`` → ``multiply`` by the shard length. Formatting a full value:
transpose to the format's order (only when it is not the identity), reshape to ``[E]``,
zero-pad to ``[N·L]``, ``dynamic-slice`` at the offset. Gathering: ``all-gather`` of the
``[L]`` shards (several concatenated into one bucket), un-pad, reshape, inverse transpose
back to the value's shape and layout.

Grouping gradients into collectives: one reduce-scatter/all-gather pair per tensor,
combined buckets, or — ``auto`` — chosen on the α-β model of the *target* hardware profile.

A tensor that shares a bucket saves its own pair's latency (α × steps of a reduce-scatter
and an all-gather on the target's interconnect) and pays the bucketing copies XLA keeps:
the gradient concatenated into the bucket before the reduce-scatter (a copy: it does not
fuse into the dot or reduce producing the gradient) and its piece sliced out of the
gathered bucket (a copy), each reading and writing the tensor once. The concatenation of
the updated shards before the all-gather is free up to 8 shards: XLA:CPU fuses it into the
update's loop (``add_concatenate_fusion`` in the optimized module of the 1024² Adam MLP at
N = 8), which writes its shard into the bucket instead of a buffer of its own (the step's
cost model prices the copy of a wider bucket); the reshapes around the bucket are bitcasts
after layout assignment. ``auto`` combines exactly the tensors whose
latency saved exceeds their copies, so under this model it is never worse than either
fixed strategy. The crossover moves with the hardware (profiles as shipped): ≈ 250 KB on
``cpu-generic`` at any N (one 10 µs rendezvous per collective); on ``tpu-v3`` (1 µs per
torus hop) ≈ 0.9 MB at N = 8 and ≈ 14 MB at N = 1024.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from hlo_shard.analysis.collectives import DeviceGroups, participant_id_source
from hlo_shard.costmodel.network import CollectivePricing
from hlo_shard.graph import (ModuleRewriter, Rewriter, add_transposed_product,
                             is_transposable_product)
from hlo_shard.ir import (ArrayShape, Computation, ComputationRef, Ident, Instruction, Layout,
                          Module, Raw, Shape, SliceRanges, TupleShape)
from hlo_shard.opinfo import MATMULS
from hlo_shard.passes.weight_update.analysis import (VIEW_OPCODES, blocks_through_collectives,
                                                     is_laid_out, major_dimension)
from hlo_shard.shard_format import ShardFormat, natural_perm



class ChannelIds:
    """Fresh channel ids for a module that uses them (``max + 1``, as XLA does)."""

    def __init__(self, module: Module) -> None:
        self.module = module
        # (the attribute's presence first: a module's instructions are mostly without it)
        ids = [channel for c in module.computations for i in c.instructions
               if "channel_id" in i.attributes and
               (channel := i.int_attr("channel_id")) is not None]
        self.next = max(ids, default=0) + 1

    def fresh(self) -> int:
        value, self.next = self.next, self.next + 1
        return value


@dataclass(frozen=True)
class Gathered:
    """One value to all-gather: its shard, format and full shape (with layout)."""

    shard: str
    format: ShardFormat
    shape: ArrayShape
    label: str


@dataclass
class ShardEmitter:
    """Emits shard-format pieces into ``comp`` through ``rw`` (one per computation)."""

    module: Module
    comp: Computation
    rw: Rewriter
    groups: DeviceGroups
    #: A collective over the data-parallel group whose attributes new collectives copy.
    template: Instruction
    channels: ChannelIds
    #: The pass's edits of the module (the loop fusions' bodies of :meth:`fused`).
    edits: ModuleRewriter
    cache: dict[tuple, str] = field(default_factory=dict)
    #: Where :meth:`fused` looks for a free body name next.
    next_body: int = 1

    def __post_init__(self) -> None:
        shape = self.template.shape
        self.n = self.groups.size
        self.with_layouts = isinstance(shape, TupleShape) or (
            isinstance(shape, ArrayShape) and shape.layout is not None)
        self.laid_out = is_laid_out(self.module)
        body = [i.name for i in self.comp.instructions if i.opcode != "parameter"]
        self.first = body[0] if body else self.comp.root.name

    # Shapes and small pieces -----------------------------------------------------------
    def shape(self, element_type: str, dims: tuple[int, ...]) -> ArrayShape:
        layout = Layout(tuple(range(len(dims) - 1, -1, -1))) \
            if self.with_layouts and dims else None
        return ArrayShape(element_type, tuple(dims), (), layout)

    def add(self, opcode: str, shape: Shape, operands: list[str], name: str | None = None,
            **attributes: Any) -> str:
        if opcode == "reshape" and self.laid_out and _row_major(shape) and \
                _row_major(self.comp[operands[0]].shape):
            # No layout pass runs after the rewrite of a laid-out module, and XLA:CPU
            # runs a top-level reshape as a copy kernel: say bitcast, which it is (the
            # jit-captured 1024² Adam MLP at N = 8: 0.52-0.67x of plain jit with its 28
            # flattening reshapes as bitcasts, 0.79-0.85x as reshapes, same losses).
            opcode = "bitcast"
        if opcode in _FUSED_WHEN_LAID_OUT and self.laid_out:
            return self.fused(opcode, shape, operands, name, attributes)
        return self.rw.add(opcode, shape, operands, name=name, **attributes).name

    def fused(self, opcode: str, shape: Shape, operands: list[str], name: str | None,
              attributes: dict[str, Any]) -> str:
        """``opcode`` as the one op of a new loop fusion: a laid-out module is past XLA's
        fusion passes, which would have fused it (:data:`_FUSED_WHEN_LAID_OUT`)."""
        distinct = list(dict.fromkeys(operands))
        params = [Instruction(f"param_{k}", "parameter", self.comp[o].shape, [], {}, k)
                  for k, o in enumerate(distinct)]
        root = Instruction(opcode, opcode, shape,
                           [params[distinct.index(o)].name for o in operands], dict(attributes))
        return self.loop_fusion(f"fused_{opcode}", [*params, root], distinct,
                                name or f"{opcode}_fusion")

    def loop_fusion(self, body_base: str, body: list[Instruction], operands: list[str],
                    name: str) -> str:
        """A new loop fusion of ``operands`` running ``body`` (its last instruction the
        root), the body named ``body_base.K`` with the first free ``K``."""
        body_name = next(candidate for k in itertools.count(self.next_body) if not
                         self.module.has_computation(candidate := f"{body_base}.{k}"))
        self.next_body = int(body_name.rsplit(".", 1)[1]) + 1
        root = body[-1]
        self.edits.insert_computation(Computation(body_name, body, root.name),
                                      after=self.callee_slot())
        return self.rw.add("fusion", root.shape, operands, name=name, kind=Ident("kLoop"),
                           calls=ComputationRef(body_name)).name

    def callee_slot(self) -> str:
        """The computation new fusion bodies go after: the one before ``comp``, as XLA
        prints callees before their callers (there is one: the reducer of the
        data-parallel collective)."""
        def find() -> str:
            position = next(k for k, c in enumerate(self.module.computations) if c is self.comp)
            return self.module.computations[position - 1].name
        return self.prologue(("callee slot",), find)

    def add_top(self, opcode: str, shape: Shape, operands: list[str], name: str | None = None,
                literal: str | None = None, **attributes: Any) -> str:
        """Add at the top of the computation (in sequence), whatever the insertion point."""
        inst = Instruction(self.rw.fresh_name(name or opcode), opcode, shape, list(operands),
                           dict(attributes), literal=literal)
        return self.rw.insert_before(self.first, inst).name

    def prologue(self, key: tuple, build: Callable[[], str]) -> str:
        """A value computed once at the top of the computation (constants, ids, offsets);
        ``build`` emits it with :meth:`add_top`."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def constant(self, element_type: str, literal: str, dims: tuple[int, ...] = (),
                 name: str = "constant") -> str:
        return self.prologue(("constant", element_type, dims, literal),
                             lambda: self.add_top("constant", self.shape(element_type, dims), [],
                                                  name=name, literal=literal))

    def piece_starts(self, starts: Iterable[int]) -> dict[int, str] | None:
        """Where the pieces of a bucket (:meth:`piece`) read their ``starts`` from: nowhere
        (None) but in a laid-out module, where one small loop fusion writes them all into
        a tuple. XLA:CPU compiles each distinct kernel once, and a slice's starts (or a
        constant operand's value) are part of its kernel, so each piece would be one more
        kernel to compile; read from a buffer, the starts leave one kernel per piece
        shape. Past fusion no simplifier folds them back into slices (before it, XLA's
        algebraic simplifier would: there the slices stay static)."""
        if not self.laid_out:
            return None
        values = list(dict.fromkeys(starts))
        u32 = self.shape("u32", ())
        constants = [Instruction(f"start.{k}", "constant", u32, [], {}, literal=str(value))
                     for k, value in enumerate(values)]
        table_shape = TupleShape(tuple(u32 for _ in values))
        root = Instruction("starts", "tuple", table_shape, [c.name for c in constants], {})
        table = self.loop_fusion("piece_starts", [*constants, root], [], "piece_starts")
        return {value: self.add("get-tuple-element", u32, [table], name="piece_start", index=k)
                for k, value in enumerate(values)}

    def piece(self, operand: str, shape: ArrayShape, starts: tuple[int, ...], name: str,
              read_from: dict[int, str] | None) -> str:
        """The part of ``operand`` of ``shape`` at ``starts`` (a value's piece of a
        bucket): a static slice, or a dynamic-slice at the starts ``read_from`` holds
        (:meth:`piece_starts`)."""
        if read_from is None:
            return self.add("slice", shape, [operand], name=name, slice=SliceRanges(
                tuple((start, start + size, 1) for start, size in zip(starts, shape.dims))))
        return self.fused("dynamic-slice", shape, [operand, *(read_from[s] for s in starts)],
                          name, {"dynamic_slice_sizes": shape.dims})

    def converted(self, value: str, element_type: str) -> str:
        """``value`` as ``element_type`` (itself where it has that type already)."""
        shape = self.comp[value].array_shape
        if shape.element_type == element_type:
            return value
        return self.add("convert", replace(shape, element_type=element_type), [value],
                        name=f"{value}.{element_type}")

    def summing(self, element_type: str) -> ComputationRef:
        """A reducer adding two ``element_type`` scalars (one per computation rewritten
        and type), for a collective summing in another type than the gradient's own
        reducer."""
        key = ("summing", element_type)
        if key not in self.cache:
            scalar = ArrayShape(element_type, ())
            body = [Instruction("lhs", "parameter", scalar, [], {}, 0),
                    Instruction("rhs", "parameter", scalar, [], {}, 1),
                    Instruction("sum", "add", scalar, ["lhs", "rhs"], {})]
            name = next(candidate for k in itertools.count(1) if not
                        self.module.has_computation(candidate := f"sum_{element_type}.{k}"))
            self.edits.insert_computation(Computation(name, body, "sum"),
                                          after=self.callee_slot())
            self.cache[key] = name
        return ComputationRef(self.cache[key])

    def position(self) -> str:
        """u32[] position of this device within its group."""
        def build() -> str:
            u32 = self.shape("u32", ())
            source = participant_id_source(self.module, self.groups.mode)
            if source == "flattened":
                replica = self.add_top("replica-id", u32, [])
                partition = self.add_top("partition-id", u32, [])
                count = self.constant("u32", str(self.module.num_partitions))
                scaled = self.add_top("multiply", u32, [replica, count])
                pid = self.add_top("add", u32, [scaled, partition])
            else:
                pid = self.add_top(source, u32, [])
            if self.groups.is_trivial and self.groups.num_ids == self.n:
                return pid
            table = self.groups.position_table()
            literal = "{" + ", ".join(map(str, table)) + "}"
            positions = self.constant("u32", literal, (len(table),), name="shard_positions")
            entry = self.add_top("dynamic-slice", self.shape("u32", (1,)), [positions, pid],
                                 dynamic_slice_sizes=(1,))
            return self.add_top("reshape", u32, [entry], name="shard_position")
        return self.prologue(("position",), build)

    def offset(self, shard_len: int) -> str:
        def build() -> str:
            length = self.constant("u32", str(shard_len))
            return self.add_top("multiply", self.shape("u32", ()), [self.position(), length],
                                name="shard_offset")
        return self.prologue(("offset", shard_len), build)

    def collective_attrs(self, **extra: Any) -> dict:
        """Attributes of a new collective over the data-parallel group, in XLA's order."""
        attrs: dict = {}
        if self.template.attr("channel_id") is not None:
            attrs["channel_id"] = self.channels.fresh()
        for key in ("replica_groups", "use_global_device_ids"):
            if self.template.attr(key) is not None:
                attrs[key] = self.template.attr(key)
        if "dimensions" in extra:
            attrs["dimensions"] = extra.pop("dimensions")
        attrs.update(extra)
        return attrs

    def collective_blocks(self, fmt: ShardFormat, shape: ArrayShape) -> bool:
        """A collective on blocks of the value (:func:`uses_blocks`), where XLA can move
        them (:func:`~.analysis.blocks_through_collectives`)."""
        return uses_blocks(fmt, shape) and blocks_through_collectives(fmt, shape, self.laid_out)

    def scatters_blocks(self, value: str, fmt: ShardFormat) -> bool:
        """Reduce-scatter ``value`` in blocks (:meth:`collective_blocks`) — unless it is a
        dot or convolution result whose block dimension is not its major one: XLA:CPU
        then computes the product into the transposed layout without its library kernel
        (a plain ``dot`` where the flat path gets a ``ynn_fusion``: the jit-captured 1024²
        Adam MLP at N = 8 ran 0.90x of its step sharded per tensor in blocks, 0.16x with
        the flat transpose, which XLA absorbs by computing the dot with swapped operands)."""
        inst, shape = self.comp[value], self.comp[value].array_shape
        if not self.collective_blocks(fmt, shape):
            return False
        return inst.opcode not in MATMULS or \
            major_dimension(shape.dims, shape.minor_to_major()) == fmt.known_block[0]

    # Formatting -------------------------------------------------------------------------
    def flat_padded(self, value: str, fmt: ShardFormat) -> str:
        """``value`` (full) in ``fmt``'s order, flat and zero-padded: ``[N·L]``."""
        shape = self.comp[value].array_shape
        element_type = shape.element_type
        current = value
        if not fmt.keeps_dimension_order:
            current = self.swapped_dot(value, fmt) or self.add(
                "transpose", self.shape(element_type, fmt.transposed_dims), [current],
                name=f"{value}.formatted", dimensions=fmt.perm)
        if shape.dims != (fmt.elements,) or current != value:
            current = self.add("reshape", self.shape(element_type, (fmt.elements,)), [current],
                               name=f"{value}.flat")
        if fmt.padding:
            zero = self.constant(element_type, "false" if element_type == "pred" else "0")
            current = self.add("pad", self.shape(element_type, (fmt.padded,)), [current, zero],
                               name=f"{value}.padded", padding=Raw(f"0_{fmt.padding}"))
        return current

    def swapped_dot(self, value: str, fmt: ShardFormat) -> str | None:
        """``value``, a matrix product ``a·b`` in a laid-out module, in the transposed order
        ``fmt`` asks for, computed as ``b·a`` (:func:`~hlo_shard.graph.add_transposed_product`):
        what XLA's algebraic simplifier makes of a dot followed by a transpose before fusion,
        where the pass's transpose would be a copy of the whole gradient. None where that
        is not such a product, or where it has other users than its all-reduce (it would
        be computed twice)."""
        inst = self.comp[value]
        if not self.laid_out or fmt.perm != (1, 0) or \
                not is_transposable_product(self.comp, inst, self.rw.users(value)):
            return None
        return add_transposed_product(
            self.rw, inst, self.shape(inst.array_shape.element_type, fmt.transposed_dims),
            f"{value}.formatted")

    def local_slice(self, value: str, fmt: ShardFormat) -> str:
        """This device's ``[L]`` shard of a full value it holds (no communication). A
        transposed order whose shards are blocks slices the block first, so only the
        shard is transposed."""
        shape = self.comp[value].array_shape
        element_type = shape.element_type
        if uses_blocks(fmt, shape):
            major, rows = fmt.known_block
            starts = [self.constant("u32", "0")] * len(fmt.dims)
            starts[major] = self.offset(rows)
            block = self.add("dynamic-slice", self.shape(element_type, block_dims(fmt)),
                             [value, *starts], name=f"{value}.block",
                             dynamic_slice_sizes=block_dims(fmt))
            return self.block_to_shard(block, fmt, element_type)
        flat = self.flat_padded(value, fmt)
        return self.add("dynamic-slice", self.shape(element_type, (fmt.shard_len,)),
                        [flat, self.offset(fmt.shard_len)], name=f"{value}.shard",
                        dynamic_slice_sizes=(fmt.shard_len,))

    def block_to_shard(self, block: str, fmt: ShardFormat, element_type: str) -> str:
        """A block of the value (dims of :func:`block_dims`) → its ``[L]`` shard."""
        dims = block_dims(fmt)
        ordered = self.add("transpose", self.shape(element_type, tuple(dims[p] for p in fmt.perm)),
                           [block], dimensions=fmt.perm)
        return self.add("reshape", self.shape(element_type, (fmt.shard_len,)), [ordered],
                        name=f"{block}.shard")

    def shard_to_block(self, shard: str, fmt: ShardFormat, element_type: str) -> str:
        dims = block_dims(fmt)
        ordered = self.add("reshape", self.shape(element_type, tuple(dims[p] for p in fmt.perm)),
                           [shard])
        inverse = tuple(sorted(range(len(fmt.perm)), key=lambda d: fmt.perm[d]))
        return self.add("transpose", self.shape(element_type, dims), [ordered],
                        name=f"{shard}.block", dimensions=inverse)

    def block_of(self, shard: str, fmt: ShardFormat, element_type: str) -> str:
        """The block ``shard`` holds, for ops on blocks (Adafactor's statistics): once per
        shard, a plain reshape where the format's order is the block's own."""
        key = ("block", shard, fmt)
        if len(fmt.dims) == 1:
            return shard
        if key not in self.cache:
            self.cache[key] = self.shard_to_block(shard, fmt, element_type) \
                if not fmt.keeps_dimension_order else self.add(
                    "reshape", self.shape(element_type, block_dims(fmt)), [shard],
                    name=f"{shard}.block")
        return self.cache[key]

    def shard_of_block(self, block: str, fmt: ShardFormat, element_type: str) -> str:
        """:meth:`block_to_shard` without the identity transpose and no-op reshape."""
        if not fmt.keeps_dimension_order:
            return self.block_to_shard(block, fmt, element_type)
        if len(fmt.dims) == 1:
            return block
        return self.add("reshape", self.shape(element_type, (fmt.shard_len,)), [block],
                        name=f"{block}.shard")

    # All-gather ---------------------------------------------------------------------------
    def gathered_shape(self, shape: ArrayShape, fmt: ShardFormat, users: list[str]) -> ArrayShape:
        """The full shape a gathered value takes: laid out in the format's order, so that
        un-formatting it is free (a bitcast) and XLA's layout assignment copies only where
        a user really needs another layout — unless the module is laid out already
        (:func:`is_laid_out`) or a user is a layout-sensitive ``bitcast``."""
        if shape.layout is None or self.laid_out or any(
                user and self.comp[user].opcode == "bitcast" for user in users):
            return shape
        return ArrayShape(shape.element_type, shape.dims, shape.dynamic,
                          Layout(fmt.minor_to_major(), shape.layout.tail))


    def gather(self, items: list[Gathered]) -> list[str]:
        """All-gather ``items`` (one element type) at the insertion point — one collective
        for all of them — and bring each back to its full shape and layout."""
        element_type = items[0].shape.element_type
        if len(items) == 1 and self.collective_blocks(items[0].format, items[0].shape):
            item = items[0]
            block = self.shard_to_block(item.shard, item.format, element_type)
            return [self.add("all-gather", item.shape, [block], name=f"{item.label}.gathered",
                             **self.collective_attrs(dimensions=(item.format.known_block[0],)))]
        total = sum(item.format.shard_len for item in items)
        operand = items[0].shard if len(items) == 1 else self.add(
            "concatenate", self.shape(element_type, (total,)), [i.shard for i in items],
            name="update_bucket", dimensions=(0,))
        gathered = self.add("all-gather", self.shape(element_type, (self.n * total,)),
                            [operand], name="all-gather", **self.collective_attrs(dimensions=(0,)))
        if len(items) == 1:
            return [self.unformat(items[0], gathered)]
        rows = self.add("reshape", self.shape(element_type, (self.n, total)), [gathered],
                        name="all-gather.rows")
        starts = list(itertools.accumulate((item.format.shard_len for item in items),
                                           initial=0))
        read_from = self.piece_starts(starts[:-1])
        out = []
        for item, start in zip(items, starts):
            mine = self.piece(rows, self.shape(element_type, (self.n, item.format.shard_len)),
                              (0, start), f"{item.label}.rows", read_from)
            flat = self.add("reshape", self.shape(element_type, (item.format.padded,)), [mine])
            out.append(self.unformat(item, flat))
        return out

    def unformat(self, item: Gathered, flat: str) -> str:
        """``[N·L]`` gathered vector → the full value in the item's shape and layout."""
        fmt, shape = item.format, item.shape
        element_type = shape.element_type
        if fmt.padding:
            flat = self.add("slice", self.shape(element_type, (fmt.elements,)), [flat],
                            slice=SliceRanges(((0, fmt.elements, 1),)))
        if fmt.keeps_dimension_order:
            if shape.dims == (fmt.elements,):
                return flat
            return self.add("reshape", shape, [flat], name=f"{item.label}.gathered")
        ordered = self.add("reshape", self.shape(element_type, fmt.transposed_dims), [flat])
        inverse = tuple(sorted(range(len(fmt.perm)), key=lambda d: fmt.perm[d]))
        return self.add("transpose", shape, [ordered], name=f"{item.label}.gathered",
                        dimensions=inverse)


#: Ops the emitter wraps in a loop fusion of their own in a laid-out module
#: (:meth:`ShardEmitter.fused`): XLA:CPU runs a top-level transpose through its slow
#: generic kernel, and compiles a kernel for every top-level slice where it compiles
#: each distinct fusion once (an un-padding slice per value of one padded size).
_FUSED_WHEN_LAID_OUT = frozenset({"transpose", "slice"})


def _row_major(shape: Shape) -> bool:
    """A dense, untiled array laid out row-major: a reshape between two of them keeps the
    bytes."""
    return (isinstance(shape, ArrayShape) and shape.layout is not None and not shape.layout.tail
            and not any(shape.dynamic) and shape.is_row_major)


def shard_body(body: Computation, name: str,
               shard_shape: Callable[[str], ArrayShape]) -> Computation:
    """A fusion body on ``[L]`` shards: every array value becomes ``shard_shape(type)``,
    scalars stay, views of arrays vanish (their users read the viewed value)."""
    alias: dict[str, str] = {}
    out: list[Instruction] = []
    for inst in body.instructions:
        operands = [alias.get(o, o) for o in inst.operands]
        # On shards in one element order a view is the identity (the body analysis
        # proved the order of its result is its operand's).
        full = inst.array_shape
        if inst.opcode in VIEW_OPCODES and not full.is_scalar:
            alias[inst.name] = operands[0]
            continue
        shape = full if full.is_scalar else shard_shape(full.element_type)
        out.append(Instruction(inst.name, inst.opcode, shape, operands, dict(inst.attributes),
                               inst.parameter_number, inst.literal))
    root = body.root.name
    return Computation(name, out, alias.get(root, root))


def block_body(body: Computation, name: str, operand_dims: tuple[int, ...],
               result_dims: tuple[int, ...]) -> Computation:
    """A fusion body on blocks: its root's array becomes ``result_dims``, every other
    array value ``operand_dims`` (the body is elementwise up to its root: the analysis
    proved it), layouts and scalars as they are."""
    def on_block(inst: Instruction) -> Shape:
        full = inst.array_shape
        if full.is_scalar:
            return full
        dims = result_dims if inst.name == body.root_name else operand_dims
        return ArrayShape(full.element_type, dims, (), full.layout)
    return Computation(name, [Instruction(i.name, i.opcode, on_block(i), list(i.operands),
                                          dict(i.attributes), i.parameter_number, i.literal)
                              for i in body.instructions], body.root_name)


def uses_blocks(fmt: ShardFormat, shape: ArrayShape) -> bool:
    """Work on blocks of the value: its stored order is not the format's (a flat copy
    would transpose the whole tensor) and every shard is a block."""
    return fmt.block is not None and natural_perm(shape) != fmt.perm


def block_dims(fmt: ShardFormat) -> tuple[int, ...]:
    major, rows = fmt.known_block
    return tuple(rows if d == major else size for d, size in enumerate(fmt.dims))


# ------------------------------------------------------------------- bucketing

Item = TypeVar("Item")

STRATEGIES = ("auto", "per-tensor", "combined")
#: Estimates within this share of each other are a tie (:meth:`Bucketing.chosen`).
TIE = 1e-9


@dataclass(frozen=True)
class GradientSize:
    """What a strategy's price reads of one sharded gradient."""

    nbytes: int
    element_type: str
    #: Its shards are padded (its elements do not divide among the group).
    padded: bool


@dataclass(frozen=True)
class StrategyEstimate:
    strategy: str
    #: Reduce-scatter/all-gather pairs the gradients take.
    collectives: int
    seconds: float


@dataclass(frozen=True)
class Bucketing:
    """How collectives are grouped: ``per-tensor``, ``combined`` or ``auto`` (a tensor
    alone where :meth:`CollectivePricing.alone` says so, or from ``per_tensor_bytes`` on
    when that is set), buckets of one element type up to ``bucket_bytes``. ``auto``
    lowers whichever of the three its estimates price lowest (:meth:`chosen`)."""

    strategy: str
    bucket_bytes: int
    pricing: CollectivePricing
    per_tensor_bytes: int | None = None

    def alone(self, nbytes: int) -> bool:
        if self.strategy != "auto":
            return self.strategy == "per-tensor"
        if self.per_tensor_bytes is not None:
            return nbytes >= self.per_tensor_bytes
        return self.pricing.alone(nbytes)

    def buckets(self, items: Sequence[Item], size: Callable[[Item], int],
                element_type: Callable[[Item], str]) -> list[list[Item]]:
        out: list[list[Item]] = []
        open_buckets: dict[str, tuple[list[Item], list[int]]] = {}
        for item in items:
            nbytes, etype = size(item), element_type(item)
            if self.alone(nbytes):
                out.append([item])
                continue
            bucket = open_buckets.get(etype)
            if bucket is None or bucket[1][0] + nbytes > self.bucket_bytes:
                bucket = open_buckets[etype] = ([], [0])
                out.append(bucket[0])
            bucket[0].append(item)
            bucket[1][0] += nbytes
        return out

    def estimate(self, sizes: Sequence[GradientSize]) -> StrategyEstimate:
        """Collectives and seconds of these gradients under this strategy: the pairs as
        XLA's combiners run them, and the copies of each bucket (a gradient alone copies
        too where its shards are padded: into the padded vector and out of the gathered
        one; in a bucket the padding is the concatenation's)."""
        buckets = self.buckets(sizes, lambda s: s.nbytes, lambda s: s.element_type)
        seconds = self.pricing.buckets_s([(sum(s.nbytes for s in bucket),
                                           len(bucket) > 1 or bucket[0].padded)
                                          for bucket in buckets])
        return StrategyEstimate(self.strategy, len(buckets), seconds)

    def estimates(self, sizes: Sequence[GradientSize]) -> list[StrategyEstimate]:
        """The estimate of every strategy, for ``--explain``."""
        return [replace(self, strategy=s).estimate(sizes) for s in STRATEGIES]

    def chosen(self, estimates: Sequence[StrategyEstimate]) -> Bucketing:
        """The bucketing to lower: ``auto`` takes the strategy ``estimates`` (of every
        strategy, :meth:`estimates`) price lowest; on a tie (within :data:`TIE`: the
        same sums added in another order differ in their last bits) the first of its own
        per-tensor test, per-tensor and combined (fewest bucketing copies and temporary
        buffers first). An explicit strategy or ``per_tensor_bytes`` is kept as asked."""
        if self.strategy != "auto" or self.per_tensor_bytes is not None:
            return self
        lowest = min(e.seconds for e in estimates)
        best = next(e for e in sorted(estimates, key=lambda e: STRATEGIES.index(e.strategy))
                    if e.seconds <= lowest * (1 + TIE))
        return replace(self, strategy=best.strategy)


__all__ = ["ChannelIds", "Gathered", "ShardEmitter", "block_body", "block_dims", "shard_body",
           "uses_blocks",
           "Bucketing", "GradientSize", "STRATEGIES", "StrategyEstimate"]
