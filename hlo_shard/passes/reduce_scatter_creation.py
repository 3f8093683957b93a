"""``all-reduce`` + ``dynamic-slice`` of this device's block → ``reduce-scatter``.

The SPMD partitioner writes a gradient of an FSDP/ZeRO weight as a sum all-reduce whose
one use (through copies and transposes) is a ``dynamic-slice`` at an offset computed from
``partition-id``/``replica-id`` (:class:`~hlo_shard.analysis.collectives.ReasonCode`
``already_sharded``). Every device then receives the whole sum and keeps a block of it.
A reduce-scatter delivers only the block: half the bytes of an all-reduce on the wire
(one reduce-scatter phase instead of reduce-scatter plus all-gather), before XLA's
combiner sees it. This is XLA's ReduceScatterCreator (``MatchReduceScatter`` in
``xla/service/collective_opt_utils.cc``), run where we can price it:

* :func:`match_reduce_scatter` returns a :class:`ReduceScatterSpec` (the all-reduce, the
  ops between it and the slice, the slice, the split dimension and the groups) or the
  reason it refuses. The offset is *evaluated* on every device (:class:`IndexEvaluator`:
  the index arithmetic of constants, iotas and device ids, clamped as XLA clamps), and
  the blocks must tile each group: every block held by the same number of devices.
  A block per device in the group's order keeps the all-reduce's ``replica_groups`` as
  written; any other tiling is written with explicit groups listing the devices in block
  order (a reduce-scatter gives position j of a group the j-th block); fewer blocks than
  devices (FSDP over a sub-axis of the all-reduce's group: 4 blocks among 8 devices)
  becomes a reduce-scatter over one device per block, then an all-reduce of the block
  among the devices holding it (XLA's ``BuildDSSplitReplicaGroups``). The mode
  (``channel_id``, ``use_global_device_ids``), the reducer and the metadata stay the
  all-reduce's; channel ids are fresh, as XLA gives them.
* The ops between the all-reduce and the slice (copies, transposes, converts, reshapes
  that keep the block dimension: they commute with taking a block) stay after the
  collective and run on the block; the reduce-scatter splits the dimension of the
  all-reduce's shape the slice's dimension comes from.
* Across a scan (MaxText's ``scan_layers``): the layer's all-reduce in a loop body is
  written (``dynamic-update-slice``) into a slot of the stacked gradient the loop
  carries, which leaves the loop only as this device's block.
  :func:`match_scanned_reduce_scatter` reads the form the analysis reports already
  sharded across a loop (:class:`~hlo_shard.analysis.collectives.CarriedWrite`: found
  once, there) and returns a :class:`ScannedScatterSpec` for it (else why not); the
  rewrite makes the all-reduce a reduce-scatter in the body, carries the block instead
  of the whole slot (so the loop carries 1/N of the stacked gradient, and the slice
  after the loop goes), and gives the slot's starting value as its block. The blocks of
  the slice after the loop decide the groups, as a pair's slice does.
* A pair (or a scanned gradient, per iteration) is rewritten only where
  :func:`~hlo_shard.costmodel.network.split_all_reduce_seconds` on the pass's profile predicts
  the collectives it becomes faster than the all-reduce (a split pays a second
  collective's latency for the bytes it saves, which loses for small gradients on
  shared-memory CPU devices); the report says why each pair was kept.
  A split sums in another association (partial sums, then theirs): it rounds
  differently, as the all-reduce's own order is XLA's to choose. In a floating type
  narrower than 32 bits (bf16 gradients) that difference is as large as the type's
  precision and ``verify`` sees it, so a split is written only for wider types.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar, cast

from hlo_shard.analysis.collectives import (CarriedWrite, DeviceGroups, DeviceSliced, GroupMode,
                                            ReasonCode, SlotReads, find_gradient_all_reduces,
                                            layout_chain, with_device_counts)
from hlo_shard.costmodel.network import split_all_reduce_seconds
from hlo_shard.graph import (ModuleRewriter, Rewriter, add_transposed_product, call_graph,
                             control_predecessors, is_transposable_product, users_map)
from hlo_shard.ir import (ELEMENT_BITS, ArrayShape, AttrValue, Computation, Ident, Instruction, Module, ReplicaGroups,
                          Shape, SliceRanges, TupleShape)
from hlo_shard.opinfo import ORDER_KEEPING_VIEWS
from hlo_shard.passes.base import ModulePass
from hlo_shard.passes.weight_update import ChannelIds
from hlo_shard.passes.weight_update import ShardingReport
from hlo_shard.profiles import DEFAULT_PROFILE, HardwareProfile, resolve_profile

# ------------------------------------------------------------------ index evaluation

#: Element types index arithmetic is evaluated in (bits, signed); pred is 0/1.
_INTEGER_BITS = {f"{sign}{bits}": (bits, sign == "s") for sign in "su" for bits in (8, 16, 32, 64)}
#: Larger index values (tables of offsets) are not evaluated: not the partitioner's form.
MAX_INDEX_ELEMENTS = 1 << 14
#: The rows of the partitioner's all-reduce + slice pairs: gradients, and activations'
#: sums (:attr:`~hlo_shard.analysis.collectives.GradientAllReduce.feeds`).
_SLICED_ROWS = (ReasonCode.ALREADY_SHARDED.value, ReasonCode.ACTIVATION_SUM.value)


@dataclass(frozen=True, slots=True)
class IndexValue:
    """An integer array of the index arithmetic, row-major (HLO's logical order)."""

    dims: tuple[int, ...]
    values: tuple[int, ...]


def _coords(flat: int, dims: Sequence[int]) -> list[int]:
    out = []
    for size in reversed(dims):
        flat, rest = divmod(flat, size)
        out.append(rest)
    return out[::-1]


def _flat(coords: Sequence[int], dims: Sequence[int]) -> int:
    flat = 0
    for coord, size in zip(coords, dims):
        flat = flat * size + coord
    return flat


def _wrap(value: int, element_type: str) -> int:
    """``value`` as the element type holds it (two's complement wrap; pred: 0 or 1)."""
    if element_type == "pred":
        return int(value != 0)
    bits, signed = _INTEGER_BITS[element_type]
    value &= (1 << bits) - 1
    return value - (1 << bits) if signed and value >> (bits - 1) else value


def _divide(a: int, b: int) -> int:
    quotient = abs(a) // abs(b)
    return quotient if (a < 0) == (b < 0) else -quotient


_BINARY: dict[str, Callable[[int, int], int]] = {
    "add": operator.add, "subtract": operator.sub, "multiply": operator.mul,
    "minimum": min, "maximum": max, "divide": _divide,
    "remainder": lambda a, b: a - _divide(a, b) * b,
}
_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "EQ": operator.eq, "NE": operator.ne, "LT": operator.lt, "LE": operator.le,
    "GT": operator.gt, "GE": operator.ge,
}
#: Device ids, by opcode: (replica, partition) → the id.
_IDS: dict[str, Callable[[int, int], int]] = {
    "replica-id": lambda replica, partition: replica,
    "partition-id": lambda replica, partition: partition,
}


def _elementwise(inst: Instruction, args: list[IndexValue],
                 fn: Callable[..., int]) -> IndexValue | None:
    """``fn`` on corresponding elements (scalar operands broadcast, as clamp's and
    select's may be)."""
    dims = max((a.dims for a in args), key=len)
    size = len(max((a.values for a in args), key=len))
    if any(a.dims != dims and a.dims for a in args):
        return None
    columns = [a.values if a.dims else a.values * size for a in args]
    return IndexValue(dims, tuple(fn(*row) for row in zip(*columns)))


def _literal(inst: Instruction) -> IndexValue | None:
    text = inst.literal or ""
    tokens = text.replace("{", " ").replace("}", " ").replace(",", " ").split()
    named = {"true": 1, "false": 0}
    if any(t not in named and not t.lstrip("-").isdigit() for t in tokens):
        return None  # elided ("{...}") or not an integer literal
    values = tuple(named[t] if t in named else int(t) for t in tokens)
    shape = inst.array_shape
    return IndexValue(shape.dims, values) if len(values) == shape.num_elements else None


def _broadcast(inst: Instruction, arg: IndexValue) -> IndexValue:
    dims, mapped = inst.array_shape.dims, inst.attr_as("dimensions", tuple) or ()
    count = inst.array_shape.num_elements
    return IndexValue(dims, tuple(
        arg.values[_flat([_coords(i, dims)[d] for d in mapped], arg.dims)] for i in range(count)))


def _iota(inst: Instruction) -> IndexValue:
    dims, axis = inst.array_shape.dims, inst.int_attr("iota_dimension") or 0
    return IndexValue(dims, tuple(_coords(i, dims)[axis]
                                  for i in range(inst.array_shape.num_elements)))


def _slice(inst: Instruction, arg: IndexValue, starts: Sequence[int]) -> IndexValue:
    dims = inst.array_shape.dims
    strides = (1,) * len(dims)
    ranges = inst.attr("slice")
    if isinstance(ranges, SliceRanges):
        strides = tuple(r[2] for r in ranges.ranges)
    return IndexValue(dims, tuple(
        arg.values[_flat([s + c * k for s, c, k in zip(starts, _coords(i, dims), strides)],
                         arg.dims)]
        for i in range(inst.array_shape.num_elements)))


def _dynamic_slice(inst: Instruction, args: list[IndexValue]) -> IndexValue:
    """XLA clamps each start into ``[0, dim - size]``."""
    whole, dims = args[0], inst.array_shape.dims
    starts = [min(max(a.values[0], 0), full - size)
              for a, full, size in zip(args[1:], whole.dims, dims)]
    return _slice(inst, whole, starts)


def _static_slice(inst: Instruction, arg: IndexValue) -> IndexValue | None:
    ranges = inst.attr("slice")
    if not isinstance(ranges, SliceRanges):
        return None
    return _slice(inst, arg, [r[0] for r in ranges.ranges])


def _compare(inst: Instruction, args: list[IndexValue]) -> IndexValue | None:
    direction = inst.attr("direction")
    fn = _COMPARE.get(direction.name if isinstance(direction, Ident) else "")
    return None if fn is None else _elementwise(inst, args, lambda a, b: int(fn(a, b)))


#: Opcode → its value from the instruction and its operands' values (None: refused).
_INDEX_RULES: dict[str, Callable[[Instruction, list[IndexValue]], IndexValue | None]] = {
    "constant": lambda inst, args: _literal(inst),
    "iota": lambda inst, args: _iota(inst),
    "broadcast": lambda inst, args: _broadcast(inst, args[0]),
    "slice": lambda inst, args: _static_slice(inst, args[0]),
    "dynamic-slice": _dynamic_slice,
    "compare": _compare,
    "select": lambda inst, args: _elementwise(inst, args, lambda p, a, b: a if p else b),
    "clamp": lambda inst, args: _elementwise(inst, args, lambda lo, x, hi: min(max(x, lo), hi)),
    **{op: partial(_elementwise, fn=fn) for op, fn in _BINARY.items()},
    # Row-major values as they are (a bitcast only where no layout reorders them).
    **{op: lambda inst, args: IndexValue(inst.array_shape.dims, args[0].values)
       for op in ORDER_KEEPING_VIEWS | {"convert"}},
}


def _apply(inst: Instruction, args: list[IndexValue]) -> IndexValue | None:
    """The rule of ``inst``'s opcode; None where its attributes do not fit its operands
    (an index past an end, a missing attribute) or it divides by zero (XLA's value for
    that is no offset table's): refused, not guessed."""
    try:
        return _INDEX_RULES[inst.opcode](inst, args)
    except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


class IndexEvaluator:
    """Evaluates index arithmetic (constants, iotas, device ids and the ops of
    :data:`_INDEX_RULES` on integers) of one computation for a given device, each value
    once per device however many offsets read it."""

    def __init__(self, comp: Computation) -> None:
        self.comp = comp
        self._position = {inst.name: i for i, inst in enumerate(comp.instructions)}
        self._values: dict[tuple[int, int], dict[str, IndexValue | None]] = {}
        self._inputs: dict[str, list[str] | None] = {}

    def ancestry(self, name: str) -> list[str] | None:
        """The index values ``name`` is computed from, in program order (None: it reads
        something that is not index arithmetic)."""
        if name not in self._inputs:
            seen, stack = {name}, [name]
            while stack:
                inst = self.comp[stack.pop()]
                if not self._evaluable(inst):
                    self._inputs[name] = None
                    break
                for operand in inst.operands:
                    if operand not in seen:
                        seen.add(operand)
                        stack.append(operand)
            else:
                self._inputs[name] = sorted(seen, key=self._position.__getitem__)
        return self._inputs[name]

    def _evaluable(self, inst: Instruction) -> bool:
        """An op of the index arithmetic on a small integer array (a bitcast only where
        no layout reorders the elements)."""
        shapes = [s for s in (inst.shape, *(o.shape for o in self.comp.operands_of(inst)))
                  if isinstance(s, ArrayShape)]
        if inst.opcode not in _INDEX_RULES and inst.opcode not in _IDS or \
                len(shapes) != 1 + len(inst.operands):
            return False
        shape = inst.array_shape
        return (shape.element_type in _INTEGER_BITS or shape.element_type == "pred") and \
            shape.num_elements <= MAX_INDEX_ELEMENTS and \
            (inst.opcode != "bitcast" or all(s.is_row_major for s in shapes))

    def scalar(self, name: str, replica: int, partition: int) -> int | None:
        """The value of scalar ``name`` on device (``replica``, ``partition``)."""
        order = self.ancestry(name)
        if order is None:
            return None
        values = self._values.setdefault((replica, partition), {})
        for step in order:
            if step in values:
                continue
            inst = self.comp[step]
            if inst.opcode in _IDS:
                values[step] = IndexValue((), (_IDS[inst.opcode](replica, partition),))
                continue
            args = [a for o in inst.operands if (a := values[o]) is not None]
            result = None if len(args) != len(inst.operands) else _apply(inst, args)
            element_type = inst.array_shape.element_type
            values[step] = None if result is None else \
                IndexValue(result.dims, tuple(_wrap(v, element_type) for v in result.values))
        value = values[name]
        return value.values[0] if value is not None and len(value.values) == 1 else None


# ---------------------------------------------------------------------------- matching

def _transposed_dim(inst: Instruction, dim: int, in_dims: tuple[int, ...]) -> int | None:
    perm = inst.attr_as("dimensions", tuple) or ()
    return perm[dim] if dim < len(perm) else None


def _reshaped_dim(inst: Instruction, dim: int, in_dims: tuple[int, ...]) -> int | None:
    """The operand dimension a reshape keeps as ``dim`` (same size, same elements before
    it in row-major order), or None when the reshape splits or merges it."""
    out_dims = inst.array_shape.dims
    before = 1
    for d in range(dim):
        before *= out_dims[d]
    seen = 1
    for i, size in enumerate(in_dims):
        if seen == before and size == out_dims[dim]:
            return i
        seen *= size
    return None


#: Ops between the all-reduce and its slice that commute with taking a block (they move
#: or convert elements one by one), by opcode: the operand dimension that the block
#: dimension of the result comes from (None: no single one). They run on the block
#: after the rewrite, 1/blocks of their work.
_BLOCKWISE: dict[str, Callable[[Instruction, int, tuple[int, ...]], int | None]] = {
    "copy": lambda inst, dim, in_dims: dim,
    "convert": lambda inst, dim, in_dims: dim,
    "transpose": _transposed_dim,
    "reshape": _reshaped_dim,
}


@dataclass(frozen=True)
class ScatterCollectives:
    """An all-reduce as the reduce-scatter (and all-reduce of the block among the devices
    holding it) that delivers each device only the block it keeps."""

    computation: str
    all_reduce: str
    #: The blockwise ops after the all-reduce, in order, each with the dimension of its
    #: result the blocks are cut along: they run on the block after the rewrite.
    chain: tuple[tuple[str, int], ...]
    #: The dimension of the all-reduce's shape the reduce-scatter splits.
    split_dim: int
    groups: DeviceGroups
    #: The reduce-scatter's groups (participant ids; position = block index), and the
    #: all-reduce's groups after it: devices holding the same block (empty: none).
    scatter_groups: tuple[tuple[int, ...], ...]
    block_groups: tuple[tuple[int, ...], ...]
    #: The scatter groups are the all-reduce's own (its attribute is kept as written).
    in_group_order: bool
    payload_bytes: int
    #: The blocks are strided in the all-reduce's layout (not one contiguous run each)
    #: and no copy between the all-reduce and the slice relays the whole gradient out
    #: already (that copy moves onto the block: the transpose before the scatter takes
    #: its place).
    strided: bool

    @property
    def blocks(self) -> int:
        return len(self.scatter_groups[0])


@dataclass(frozen=True)
class ReduceScatterSpec(ScatterCollectives):
    """An all-reduce and the slice of it each device keeps, as a reduce-scatter."""

    dynamic_slice: str
    #: The matrix product the all-reduce sums, where its blocks are strided (columns:
    #: an FSDP weight's gradient computed transposed), its type 32 bits or wider and the
    #: product can be computed the other way round
    #: (:func:`~hlo_shard.graph.is_transposable_product`): then it is, so each block is
    #: one contiguous run, and a transpose of the block after the collective restores
    #: the order ("": no such product).
    product: str = ""


@dataclass(frozen=True)
class SlotRead:
    """One read of a carried slot after its loop: the get-tuple-element, the blockwise
    ops after it (each with the dimension of its result the blocks are cut along), and
    the dynamic-slice of this device's block they end in."""

    get_tuple_element: str
    chain: tuple[tuple[str, int], ...]
    dynamic_slice: str
    #: The slice's offset along the dimension it cuts.
    offset: str


@dataclass(frozen=True)
class CarriedLoop:
    """A while loop running the scanned body, and every read of the slot after it."""

    computation: str
    loop: str
    reads: tuple[SlotRead, ...]


@dataclass(frozen=True)
class ScannedScatterSpec(ScatterCollectives):
    """A scanned layer's all-reduce in a loop body, written into a slot the loop carries
    that leaves every loop running the body only as this device's block: the all-reduce
    as a reduce-scatter, the slot carried as the block (:func:`match_scanned_reduce_scatter`)."""

    #: The dynamic-update-slice writing the layer into the slot, the slot, and the
    #: dimension of the slot's shape the blocks are cut along.
    update: str
    slot: int
    slot_dim: int
    loops: tuple[CarriedLoop, ...]


@dataclass(frozen=True)
class _Blocks:
    """Where a value's blockwise ops end in this device's dynamic-slice: the ops, the
    dimension of the value the blocks are cut along, and how they tile the groups."""

    chain: tuple[tuple[str, int], ...]
    split_dim: int
    scatter_groups: tuple[tuple[int, ...], ...]
    block_groups: tuple[tuple[int, ...], ...]
    #: The slice's offset along the dimension it cuts.
    offset: str


class ModuleReads:
    """Users maps, index evaluators and callers of a module's computations, each read
    once, when first asked about: the matchers look at a loop body's computation and at
    those of the loops running it, however many gradients they are asked about."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self._users: dict[str, dict[str, list[str]]] = {}
        self._index: dict[str, IndexEvaluator] = {}
        self._callers: dict[str, list[tuple[Computation, Instruction]]] | None = None

    def users(self, comp: Computation) -> dict[str, list[str]]:
        if comp.name not in self._users:
            self._users[comp.name] = users_map(comp)
        return self._users[comp.name]

    def index(self, comp: Computation) -> IndexEvaluator:
        if comp.name not in self._index:
            self._index[comp.name] = IndexEvaluator(comp)
        return self._index[comp.name]

    def callers(self, name: str) -> list[tuple[Computation, Instruction]]:
        """(computation, instruction) of every call of computation ``name``, each calling
        instruction once: the edges of the module's :func:`~hlo_shard.graph.call_graph`."""
        if self._callers is None:
            self._callers = {}
            graph = call_graph(self.module)
            for caller, callee in graph.edges:
                comp = self.module.computation(caller)
                via: list[str] = graph.edges[caller, callee]["via"]
                self._callers.setdefault(callee, []).extend(
                    (comp, comp[inst]) for inst in dict.fromkeys(via))
        return self._callers.get(name, [])


def _only_parameter(comp: Computation) -> str:
    params = comp.parameters()
    return params[0].name if len(params) == 1 else ""


def _participant(mode: GroupMode, replica: int, partition: int, partitions: int) -> int:
    return {GroupMode.CROSS_REPLICA: replica, GroupMode.CROSS_REPLICA_AND_PARTITION: replica,
            GroupMode.CROSS_PARTITION: partition,
            GroupMode.FLATTENED_ID: replica * partitions + partition}[mode]


def _reducible(comp: Computation, all_reduce: Instruction) -> str:
    """Why ``all_reduce`` cannot become a reduce-scatter whatever follows it ("": it can)."""
    operand = comp[all_reduce.operands[0]] if len(all_reduce.operands) == 1 else None
    if operand is None or not isinstance(all_reduce.shape, ArrayShape) or \
            operand.shape != all_reduce.shape:
        return "not one array operand of the all-reduce's own shape and layout"
    if control_predecessors(all_reduce) or "control-successors" in all_reduce.attributes:
        return "the all-reduce is ordered by control edges"
    return ""


def _blockwise_chain(comp: Computation, value: str, end: str, between: str
                     ) -> list[Instruction] | str:
    """The ops the analysis found between ``value`` and ``end``
    (:func:`~hlo_shard.analysis.collectives.layout_chain`), each blockwise
    (:data:`_BLOCKWISE`) and unordered by control edges; or why not (``between``: the two
    ends, in words)."""
    chain = layout_chain(comp, value, end)
    for op in chain:
        if op.opcode not in _BLOCKWISE or not isinstance(op.shape, ArrayShape):
            return f"a {op.opcode} between {between}"
        if control_predecessors(op):
            return "an op before the slice is ordered by control edges"
    return chain


def _source_dim(comp: Computation, chain: Sequence[Instruction], dim: int
                ) -> tuple[tuple[tuple[str, int], ...], int] | str:
    """Each op of ``chain`` with the dimension of its result the blocks are cut along,
    given the cut ``dim`` of the last one's result, and the dimension of the first one's
    operand it comes from; or why not."""
    dims = []
    for op in reversed(chain):
        dims.append((op.name, dim))
        source = _BLOCKWISE[op.opcode](op, dim, comp[op.operands[0]].array_shape.dims)
        if source is None:
            return f"the {op.opcode} %{op.name} before the slice splits or merges its dimension"
        dim = source
    return tuple(reversed(dims)), dim


def _device_blocks(module: Module, comp: Computation, chain: Sequence[Instruction],
                   ds: Instruction, groups: DeviceGroups, index: IndexEvaluator
                   ) -> _Blocks | str:
    """How the dynamic-slice ``ds`` at the end of ``chain`` cuts this device's block,
    evaluated on every device: the blocks must tile each group, every block held by the
    same number of devices; or why not."""
    whole, part = comp[ds.operands[0]].array_shape, ds.array_shape
    cut = [d for d, (a, b) in enumerate(zip(whole.dims, part.dims)) if a != b]
    if len(cut) != 1:
        return "the slice cuts several dimensions"
    (split,) = cut
    chunk = part.dims[split]
    if chunk == 0 or whole.dims[split] % chunk:
        return "the slice is not a whole number of blocks of its dimension"
    blocks = whole.dims[split] // chunk
    mapped = _source_dim(comp, chain, split)
    if isinstance(mapped, str):
        return mapped
    block_of = _block_table(module, groups, ds.operands[split + 1], whole.dims[split],
                            chunk, index)
    if isinstance(block_of, str):
        return block_of
    scatter_groups, block_groups = [], []
    for group in groups.groups:
        held: list[list[int]] = [[] for _ in range(blocks)]
        for participant in group:
            held[block_of[participant]].append(participant)
        if len({len(h) for h in held}) != 1:
            return "the devices of a group do not hold every block equally often"
        scatter_groups += [tuple(h[i] for h in held) for i in range(len(held[0]))]
        block_groups += [tuple(h) for h in held if len(h) > 1]
    return _Blocks(mapped[0], mapped[1], tuple(scatter_groups), tuple(block_groups),
                   ds.operands[split + 1])


def _collectives_fields(all_reduce: Instruction, chain: Sequence[Instruction],
                        chain_dims: tuple[tuple[str, int], ...], split_dim: int,
                        groups: DeviceGroups, blocks: _Blocks) -> dict:
    """The :class:`ScatterCollectives` fields of ``all_reduce`` cut along ``split_dim``
    into ``blocks``, ``chain`` the ops after it (with their cut dimensions)."""
    shape = all_reduce.array_shape
    return dict(all_reduce=all_reduce.name, chain=chain_dims, split_dim=split_dim,
                groups=groups, scatter_groups=blocks.scatter_groups,
                block_groups=blocks.block_groups,
                in_group_order=blocks.scatter_groups == groups.groups,
                payload_bytes=shape.byte_size,
                strided=_strided(shape, split_dim) and
                not any(op.opcode == "copy" for op in chain))


def match_reduce_scatter(module: Module, comp: Computation, all_reduce: Instruction,
                         groups: DeviceGroups, ds: Instruction, index: IndexEvaluator
                         ) -> ReduceScatterSpec | str:
    """The spec of ``all_reduce``, read only as this device's dynamic-slice ``ds``
    (through layout-only ops), as a reduce-scatter, or why not (words for ``--explain``).
    ``module``'s header must name its devices (the pass reads it with those a header
    lost recovered)."""
    chain = _blockwise_chain(comp, all_reduce.name, ds.operands[0],
                             "the all-reduce and its slice")
    if isinstance(chain, str):
        return chain
    blocks = _device_blocks(module, comp, chain, ds, groups, index)
    if isinstance(blocks, str):
        return blocks
    return ReduceScatterSpec(
        computation=comp.name, dynamic_slice=ds.name,
        **_collectives_fields(all_reduce, chain, blocks.chain, blocks.split_dim, groups,
                              blocks))


def match_scanned_reduce_scatter(reads: ModuleReads, body: Computation,
                                 all_reduce: Instruction, groups: DeviceGroups,
                                 write: CarriedWrite) -> ScannedScatterSpec | str:
    """The spec of ``all_reduce`` in a loop body (MaxText's ``scan_layers``: the layer's
    sum written into a slot of the stacked gradient the loop carries) as a reduce-scatter
    whose block the slot carries, or why not. ``write`` is the form the analysis reports
    already sharded across a loop (:class:`~hlo_shard.analysis.collectives.CarriedWrite`:
    the sum, through layout-only ops, updates one slot of the body's tuple parameter,
    read nowhere else in the body and written only into the same slot of the root, by
    while loops only, whose conditions do not read the slot and whose results are taken
    apart, the slot only by dynamic-slices by device id). Here: the ops on the way
    are blockwise and no edit is ordered by control edges; each loop's condition is its
    own and its initial tuple too; every slice of the slot, evaluated on every device,
    takes the same block, the blocks tiling each group as a pair's must (fewer blocks
    than devices: a reduce-scatter, then an all-reduce of the block among its holders, in
    the body). The blocks cut a dimension the update spans whole (not the stacked one),
    so the update of a block is the block of the update, whatever layer it writes, and
    the slot's value before the loop only matters through its block."""
    update = body[write.update]
    chain = _blockwise_chain(body, all_reduce.name, update.operands[1],
                             "the all-reduce and the carried slot")
    if isinstance(chain, str):
        return chain
    if control_predecessors(update):
        return "the carried slot is read or written elsewhere in the loop body"
    loops, found = [], None
    for slot_reads in write.loops:
        carried = _carried_loop(reads, slot_reads, write.slot, groups)
        if isinstance(carried, str):
            return carried
        if found is not None and found != carried[1]:
            return "the slot's reads after the loops take different blocks"
        loops.append(carried[0])
        found = carried[1]
    assert found is not None  # the analysis finds a loop for every carried write
    stack_dims, update_dims = body[update.operands[0]].array_shape.dims, update.array_shape.dims
    if stack_dims[found.split_dim] != update_dims[found.split_dim]:
        return "the slice after the loop cuts the stacked dimension"
    mapped = _source_dim(body, chain, found.split_dim)
    if isinstance(mapped, str):
        return mapped
    return ScannedScatterSpec(
        computation=body.name, update=update.name, slot=write.slot, slot_dim=found.split_dim,
        loops=tuple(loops),
        **_collectives_fields(all_reduce, chain, mapped[0], mapped[1], groups, found))


def _carried_loop(reads: ModuleReads, slot_reads: SlotReads, slot: int, groups: DeviceGroups
                  ) -> tuple[CarriedLoop, _Blocks] | str:
    """The loop of ``slot_reads``, its slot ``slot`` read after it only as this device's
    block (the same on every read), or why not."""
    outer = reads.module.computation(slot_reads.computation)
    loop = outer[slot_reads.loop]
    condition = reads.module.computation(loop.called("condition"))
    if any(inst.opcode != "while" or inst.called("body") != loop.called("body") or
           inst.called("condition") != condition.name
           for _, inst in reads.callers(condition.name)):
        return "the loop's condition is also called elsewhere"
    users = reads.users(outer)
    init = outer[loop.operands[0]]
    if init.opcode != "tuple" or users[init.name] != [loop.name] or \
            init.name == outer.root_name or slot >= len(init.operands):
        return "the loop's initial tuple is not its own"
    if control_predecessors(loop) or "control-successors" in loop.attributes:
        return "the loop's result is used whole or ordered by control edges"
    read_blocks, found = [], None
    index = reads.index(outer)
    for gte, sliced in slot_reads.reads:
        if len(sliced.slices) != 1 or sliced.fused:
            return "the reduced value has other uses than one slice"
        ds = outer[sliced.slices[0]]
        chain = _blockwise_chain(outer, gte, ds.operands[0],
                                 "the loop and the slice of the slot")
        if isinstance(chain, str):
            return chain
        if control_predecessors(ds) or "control-successors" in ds.attributes:
            return "a dynamic-slice between the loop and the slice of the slot"
        blocks = _device_blocks(reads.module, outer, chain, ds, groups, index)
        if isinstance(blocks, str):
            return blocks
        if found is not None and (found.split_dim, found.scatter_groups) != \
                (blocks.split_dim, blocks.scatter_groups):
            return "the slot's reads after the loop take different blocks"
        found = blocks
        read_blocks.append(SlotRead(gte, blocks.chain, ds.name, blocks.offset))
    assert found is not None  # the analysis finds a read for every sliced slot
    return CarriedLoop(outer.name, loop.name, tuple(read_blocks)), \
        replace(found, chain=(), offset="")


def _strided(shape: ArrayShape, dim: int) -> bool:
    """Whether blocks of ``dim`` are strided in ``shape``'s layout: a dimension longer
    than 1 lies outside it."""
    order = shape.minor_to_major()
    return any(shape.dims[outer] > 1 for outer in order[order.index(dim) + 1:])


def _block_table(module: Module, groups: DeviceGroups, offset: str, size: int, chunk: int,
                 index: IndexEvaluator) -> dict[int, int] | str:
    """Participant id → the block of the dimension (of ``size``, in blocks of ``chunk``)
    its devices slice at ``offset``, evaluated on every device (clamped as XLA does)."""
    partitions = module.num_partitions
    block_of: dict[int, int] = {}
    for replica in range(module.replica_count):
        for partition in range(partitions):
            start = index.scalar(offset, replica, partition)
            if start is None:
                return "the slice's offset is not index arithmetic of constants and device ids"
            start = min(max(start, 0), size - chunk)
            if start % chunk:
                return f"the slice starts at {start}, not at a block of {chunk}"
            participant = _participant(groups.mode, replica, partition, partitions)
            if block_of.setdefault(participant, start // chunk) != start // chunk:
                return "the slice differs between devices of one participant id"
    return block_of


# ------------------------------------------------------------------------------- pass


@dataclass(frozen=True)
class ScatterDecision:
    """One gradient in the partitioner's reduce-scatter form: rewritten or kept, why."""

    computation: str
    all_reduce: str
    #: The reduce-scatter it became ("" when kept).
    reduce_scatter: str = ""
    #: The all-reduce's predicted seconds and those of what it becomes (0: not priced;
    #: in a loop body: per iteration).
    before_s: float = 0.0
    after_s: float = 0.0
    blocks: int = 0
    #: Devices holding each block (an all-reduce of the block among them after the
    #: reduce-scatter when more than one).
    holders: int = 1
    kept_because: str = ""
    #: The loops whose carried slot became the block (a scanned layer's gradient).
    loops: tuple[str, ...] = ()
    #: The product computed transposed for contiguous blocks
    #: (:attr:`ReduceScatterSpec.product`; "": none).
    product: str = ""

    @property
    def words(self) -> str:
        """What ``--explain`` adds to the gradient's row."""
        if self.reduce_scatter and self.loops:
            loops = ", ".join(f"%{name}" for name in self.loops)
            return (f"the all-reduce became reduce-scatter %{self.reduce_scatter} over "
                    f"{self.blocks} and {loops} carries this device's block of the slot "
                    f"(no dynamic-slice after the loop; predicted {self.before_s * 1e6:.4g} "
                    f"-> {self.after_s * 1e6:.4g} us per iteration)")
        if self.reduce_scatter:
            then = f", then an all-reduce of the block over {self.holders}" \
                if self.holders > 1 else ""
            if self.product:
                then += (f", %{self.product} computed transposed so that each block is "
                         f"contiguous")
            return (f"the all-reduce and its dynamic-slice became reduce-scatter "
                    f"%{self.reduce_scatter} over {self.blocks}{then} (predicted "
                    f"{self.before_s * 1e6:.4g} -> {self.after_s * 1e6:.4g} us)")
        return f"kept as all-reduce + dynamic-slice: {self.kept_because}"


@dataclass(frozen=True)
class ReduceScatterReport:
    decisions: tuple[ScatterDecision, ...] = ()

    @property
    def created(self) -> list[ScatterDecision]:
        return [d for d in self.decisions if d.reduce_scatter]

    @property
    def notes(self) -> list[str]:
        """What ``--explain`` and ``--json`` say."""
        created = [d for d in self.created if not d.loops]
        scanned = [d for d in self.created if d.loops]
        notes = []
        if created:
            notes.append(
                f"{len(created)} all-reduce + dynamic-slice pair(s) of the partitioner's "
                f"reduce-scatter form became reduce-scatters (predicted "
                f"{sum(d.before_s for d in created) * 1e3:.4g} -> "
                f"{sum(d.after_s for d in created) * 1e3:.4g} ms of collectives)")
        if scanned:
            notes.append(
                f"{len(scanned)} scanned layer gradient(s) all-reduced in a loop and sliced "
                f"after it became reduce-scatters, the loop carrying each device's block "
                f"(predicted {sum(d.before_s for d in scanned) * 1e3:.4g} -> "
                f"{sum(d.after_s for d in scanned) * 1e3:.4g} ms of collectives per "
                f"iteration)")
        return notes

    def annotate(self, report: ShardingReport) -> None:
        """Add each decision's words to the row of its gradient in ``report``."""
        said = {(d.computation, d.all_reduce): d.words for d in self.decisions}
        for row in report.explanations:
            words = said.get((row.computation, row.all_reduce))
            if words and row.reason_code in _SLICED_ROWS:
                row.reason = f"{row.reason}; {words}"


@dataclass(frozen=True)
class ReduceScatterCreation(ModulePass[ReduceScatterReport]):
    """Turn the partitioner's all-reduce + dynamic-slice pairs (also across a scan's loop
    carry) into reduce-scatters where ``profile`` predicts it faster."""

    name: ClassVar[str] = "reduce-scatter-creation"
    profile: HardwareProfile | str = DEFAULT_PROFILE

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", resolve_profile(self.profile))

    def apply(self, module: Module, rewriter: ModuleRewriter) -> ReduceScatterReport:
        view = with_device_counts(module)
        hardware = resolve_profile(self.profile).for_devices(view.device_count)
        reads = ModuleReads(view)
        decisions: list[ScatterDecision] = []
        specs: list[tuple[ScatterCollectives, float, float]] = []
        # Everything is matched before anything is edited: a scanned gradient's rewrite
        # edits the computations of its loops, where other pairs may be matched.
        for found in find_gradient_all_reduces(view):
            if found.sliced is None or found.groups is None:
                continue
            comp = module.computation(found.computation)
            if comp[found.name].opcode != "all-reduce":
                continue
            spec = _match(reads, comp, comp[found.name], found.groups, found.sliced)
            if isinstance(spec, str):
                decisions.append(ScatterDecision(comp.name, found.name, kept_because=spec))
                continue
            narrow = _narrow_float(comp[found.name].array_shape.element_type)
            if spec.block_groups and narrow:
                decisions.append(ScatterDecision(
                    comp.name, found.name, kept_because=f"{_collectives(spec)} would sum "
                    f"{narrow} partial sums in another order than the all-reduce: "
                    "rounded differently at the type's precision"))
                continue
            if found.feeds and narrow:
                # (XLA:CPU's reduce-scatter sums in another order than its all-reduce)
                decisions.append(ScatterDecision(
                    comp.name, found.name, kept_because=f"an activation's sum in {narrow}: "
                    f"{_collectives(spec)} would sum it in another order than the "
                    "all-reduce, and the forward pass computed from it, the loss and every "
                    "gradient with it, would round differently"))
                continue
            before, after = _price(spec, hardware)
            if after >= before:
                decisions.append(ScatterDecision(
                    comp.name, found.name, before_s=before, after_s=after,
                    blocks=spec.blocks, holders=_holders(spec),
                    kept_because=f"{_collectives(spec)} predicted {after * 1e6:.4g} us "
                    f"against the all-reduce's {before * 1e6:.4g} us (profile "
                    f"{hardware.name})"))
                continue
            specs.append((spec, before, after))
        channels = ChannelIds(module)
        created: dict[tuple[str, str], str] = {}
        scanned: dict[str, list[ScannedScatterSpec]] = {}
        for spec, _, _ in specs:
            if isinstance(spec, ScannedScatterSpec):
                scanned.setdefault(spec.computation, []).append(spec)
            else:
                assert isinstance(spec, ReduceScatterSpec)
                created[spec.computation, spec.all_reduce] = _rewrite(
                    rewriter.rewriter(module.computation(spec.computation)), spec, channels)
        for body_specs in scanned.values():
            names = _rewrite_scanned(rewriter, module, body_specs, channels)
            created.update(zip(((s.computation, s.all_reduce) for s in body_specs), names))
        for spec, before, after in specs:
            loops = tuple(loop.loop for loop in spec.loops) \
                if isinstance(spec, ScannedScatterSpec) else ()
            decisions.append(ScatterDecision(
                spec.computation, spec.all_reduce, created[spec.computation, spec.all_reduce],
                before, after, spec.blocks, _holders(spec), loops=loops,
                product=spec.product if isinstance(spec, ReduceScatterSpec) else ""))
        return ReduceScatterReport(tuple(decisions))


def _match(reads: ModuleReads, comp: Computation, all_reduce: Instruction,
           groups: DeviceGroups, sliced: DeviceSliced) -> ScatterCollectives | str:
    """The spec of ``all_reduce``, read as the analysis found (``sliced``): the scanned
    form's where its sum is written into a carried slot, else the pair's; or why not."""
    refused = _reducible(comp, all_reduce)
    if refused:
        return refused
    if sliced.fused:
        return (f"its slice is taken inside the fused kernel %{sliced.fused[0]} (XLA's fused "
                "module): left as it is")
    if len(sliced.slices) + len(sliced.carried) != 1:
        return "the reduced value has other uses than one slice"
    if sliced.carried:
        return match_scanned_reduce_scatter(reads, comp, all_reduce, groups, sliced.carried[0])
    spec = match_reduce_scatter(reads.module, comp, all_reduce, groups,
                                comp[sliced.slices[0]], reads.index(comp))
    if isinstance(spec, str) or not spec.strided or spec.split_dim != 1 or \
            _narrow_float(all_reduce.array_shape.element_type):
        return spec  # (a narrow product's rounding is its kernel's: left as it is)
    product = comp[all_reduce.operands[0]]
    if not is_transposable_product(comp, product, reads.users(comp)[product.name]):
        return spec
    return replace(spec, product=product.name, strided=False)


def _narrow_float(element_type: str) -> str:
    """``element_type`` when it is a floating type of fewer than 32 bits, else ``""``."""
    floating = element_type.startswith(("f", "bf"))
    return element_type if floating and ELEMENT_BITS.get(element_type, 32) < 32 else ""


def _collectives(spec: ScatterCollectives) -> str:
    then = f" and an all-reduce of the block over {_holders(spec)}" if spec.block_groups else ""
    return f"a reduce-scatter over {spec.blocks}{then}"


def _holders(spec: ScatterCollectives) -> int:
    return len(spec.block_groups[0]) if spec.block_groups else 1


def _price(spec: ScatterCollectives, hardware: HardwareProfile) -> tuple[float, float]:
    """The all-reduce's seconds and those of what it becomes
    (:func:`~hlo_shard.costmodel.network.split_all_reduce_seconds`)."""
    return split_all_reduce_seconds(
        spec.groups.size, spec.payload_bytes, spec.blocks, hardware, strided=spec.strided,
        holders=_holders(spec),
        transposed_block=isinstance(spec, ReduceScatterSpec) and bool(spec.product))


def _block(shape: ArrayShape, dim: int, blocks: int) -> ArrayShape:
    dims = list(shape.dims)
    dims[dim] //= blocks
    return replace(shape, dims=tuple(dims))


def _scatter(rw: Rewriter, spec: ScatterCollectives, channels: ChannelIds,
             product: str = "") -> tuple[str, str]:
    """The reduce-scatter (and block all-reduce) take the all-reduce's place and the
    blockwise ops after it shrink to the block; ``product`` (a
    :attr:`ReduceScatterSpec.product`) is computed transposed and each block transposed
    back. Returns the reduce-scatter's name and the value the block reaches the slice
    (or the carried slot) as."""
    comp = rw.comp
    all_reduce = comp[spec.all_reduce]

    def attrs(groups: ReplicaGroups | None, **extra: AttrValue) -> dict:
        out: dict = {}
        if all_reduce.attr("channel_id") is not None:
            out["channel_id"] = channels.fresh()
        if groups is not None:
            out["replica_groups"] = groups
        if all_reduce.attr("use_global_device_ids") is not None:
            out["use_global_device_ids"] = all_reduce.attr("use_global_device_ids")
        out.update(extra)
        out["to_apply"] = all_reduce.attr("to_apply")
        if all_reduce.attr("metadata") is not None:
            out["metadata"] = all_reduce.attr("metadata")
        return out

    own = spec.groups.replica_groups if spec.in_group_order else \
        ReplicaGroups(spec.scatter_groups)
    block = _block(all_reduce.array_shape, spec.split_dim, spec.blocks)
    operands, shape, split_dim = all_reduce.operands, block, spec.split_dim
    with rw.inserting_before(all_reduce.name):
        if product:
            rows, columns = all_reduce.array_shape.dims
            operands = [add_transposed_product(
                rw, comp[product], replace(all_reduce.array_shape, dims=(columns, rows)),
                rw.fresh_name(f"{product}.transposed"))]
            shape, split_dim = replace(block, dims=block.dims[::-1]), 0
        result = rw.add("reduce-scatter", shape, operands, name=f"{spec.all_reduce}.scatter",
                        **attrs(own, dimensions=(split_dim,)))
        created = result.name
        if spec.block_groups:
            result = rw.add("all-reduce", shape, [created], name=f"{spec.all_reduce}.block",
                            **attrs(ReplicaGroups(spec.block_groups)))
        if product:
            result = rw.add("transpose", block, [result.name],
                            name=f"{spec.all_reduce}.block.transposed", dimensions=(1, 0))
    rw.replace_all_uses_with(all_reduce.name, result.name)
    rw.erase(all_reduce.name)
    if product:
        rw.erase(product)
    _shrink(rw, spec.chain, spec.blocks)
    return created, spec.chain[-1][0] if spec.chain else result.name


def _shrink(rw: Rewriter, chain: tuple[tuple[str, int], ...], blocks: int) -> None:
    """Blockwise ops now run on the block: each result cut along its dimension."""
    for name, dim in chain:
        rw.set_shape(rw.comp[name], _block(rw.comp[name].array_shape, dim, blocks))


def _take_block(rw: Rewriter, slice_name: str, block: str) -> list[str]:
    """The dynamic-slice ``slice_name`` of this device's block gives way to ``block``,
    which holds it (in the slice's own layout). Returns the slice's offsets, for the
    caller to clear where nothing else reads them."""
    ds = rw.comp[slice_name]
    if rw.comp[block].shape != ds.shape:  # the slice's own layout
        block = rw.insert_before(ds.name, Instruction(
            rw.fresh_name(f"{ds.name}.relaid"), "copy", ds.shape, [block], {})).name
    offsets = ds.operands[1:]
    rw.replace_all_uses_with(ds.name, block)
    rw.erase(ds.name)
    return offsets


def _rewrite(rw: Rewriter, spec: ReduceScatterSpec, channels: ChannelIds) -> str:
    """Edit one pair: the reduce-scatter (and block all-reduce) take the all-reduce's
    place, the blockwise ops after it shrink to the block, the slice goes, and so does
    the index arithmetic only the slice read. Returns the reduce-scatter's name."""
    created, end = _scatter(rw, spec, channels, spec.product)
    rw.remove_dead(among=_take_block(rw, spec.dynamic_slice, end))
    if spec.product and not spec.chain:
        _sink_transpose(rw, end)
    return created


def _sink_transpose(rw: Rewriter, name: str) -> None:
    """Move the transpose ``name`` after each all-reduce that is its one user, one after
    another (a sum of transposed blocks is the transposed sum, whatever the reducer): the
    partitioner's FSDP gradient goes on to an all-reduce over the data axis and then to
    a transpose into the weight's order, and XLA's simplifier cancels two transposes
    only where nothing stands between them."""
    while True:
        transpose = rw.comp[name]
        users = rw.users(name)
        if len(users) != 1:
            return
        (user,) = users
        if user.opcode != "all-reduce" or user.operands != [name] or \
                not isinstance(user.shape, ArrayShape) or control_predecessors(user) or \
                "control-successors" in user.attributes:
            return
        summed = user.array_shape
        rw.set_operand(user, 0, transpose.operands[0])
        rw.set_shape(user, rw.comp[transpose.operands[0]].array_shape)
        with rw.inserting_after(user.name):
            moved = rw.add("transpose", summed, [user.name],
                           name=rw.fresh_name(f"{user.name}.transposed"),
                           dimensions=transpose.attr_as("dimensions", tuple) or ())
        rw.replace_all_uses_with(user.name, moved.name, exclude=[moved.name])
        rw.erase(name)
        name = moved.name


def _with_slots(shape: Shape, slots: dict[int, ArrayShape]) -> TupleShape:
    elements = list(cast(TupleShape, shape).elements)
    for slot, element in slots.items():
        elements[slot] = element
    return TupleShape(tuple(elements))


def _rewrite_scanned(edits: ModuleRewriter, module: Module,
                     specs: Sequence[ScannedScatterSpec], channels: ChannelIds) -> list[str]:
    """Edit the scanned gradients of one body (each loop running it is the same for all
    of them): the reduce-scatters in the body, their slots carried as blocks (the body's
    and conditions' parameters, the body's root, each loop, its initial tuple and the
    slots' values in it), each slice of a slot after a loop replaced by the slot. Each
    tuple is reshaped once and each computation cleared of what the edits left unused
    once, however many slots change. Returns the reduce-scatters' names, in order."""
    body = module.computation(specs[0].computation)
    inner = edits.rewriter(body)
    created, shards = [], {}
    for spec in specs:
        created.append(_scatter(inner, spec, channels)[0])
        update = body[spec.update]
        stack = body[update.operands[0]]
        shards[spec.slot] = _block(stack.array_shape, spec.slot_dim, spec.blocks)
        inner.set_shape(stack, shards[spec.slot])
        inner.set_shape(update, shards[spec.slot])
    for inst in (body[_only_parameter(body)], body.root):
        inner.set_shape(inst, _with_slots(inst.shape, shards))
    unused: dict[str, list[str]] = {}
    for position, first in enumerate(specs[0].loops):
        outer = module.computation(first.computation)
        rw = edits.rewriter(outer)
        loop = outer[first.loop]
        condition = module.computation(loop.called("condition"))
        param = condition[_only_parameter(condition)]
        edits.rewriter(condition).set_shape(param, _with_slots(param.shape, shards))
        rw.set_shape(loop, _with_slots(loop.shape, shards))
        init = outer[loop.operands[0]]
        clear = unused.setdefault(outer.name, [])
        index = IndexEvaluator(outer)
        for spec in specs:
            carried = spec.loops[position]
            start = init.operands[spec.slot]
            with rw.inserting_before(init.name):
                block = _block_of_start(rw, outer[start], shards[spec.slot], spec.slot_dim,
                                        carried.reads[0].offset, index)
            rw.set_operand(init, spec.slot, block)
            clear.append(start)
            for read in carried.reads:
                rw.set_shape(outer[read.get_tuple_element], shards[spec.slot])
                _shrink(rw, read.chain, spec.blocks)
                clear += _take_block(rw, read.dynamic_slice, read.chain[-1][0] if read.chain
                                     else read.get_tuple_element)
        rw.set_shape(init, _with_slots(init.shape, shards))
    for name, values in unused.items():
        edits.rewriter(module.computation(name)).remove_dead(among=values)
    return created


def _block_of_start(rw: Rewriter, start: Instruction, shard: ArrayShape, dim: int,
                    offset: str, index: IndexEvaluator) -> str:
    """This device's block of the slot's value before the loop: a broadcast scalar is
    broadcast to the block; anything else is sliced at ``offset`` (where the slice after
    the loop takes its block along ``dim``), its index arithmetic (``index``: an
    evaluator of the computation, whose order of the original instructions the edits
    keep) copied before the loop."""
    if start.opcode == "broadcast" and len(start.operands) == 1 and \
            rw.comp[start.operands[0]].array_shape.dims == ():
        return rw.add("broadcast", shard, start.operands, name=f"{start.name}.block",
                      dimensions=()).name
    copies: dict[str, str] = {}
    for name in index.ancestry(offset) or ():
        inst = rw.comp[name].clone()
        inst.name = rw.fresh_name(name)
        inst.operands = [copies[o] for o in inst.operands]
        copies[name] = rw.add_instruction(inst).name
    zero = rw.add_instruction(Instruction(
        rw.fresh_name("zero"), "constant",
        ArrayShape(rw.comp[offset].array_shape.element_type, ()), literal="0")).name
    starts = [copies[offset] if d == dim else zero for d in range(len(shard.dims))]
    return rw.add("dynamic-slice", shard, [start.name, *starts], name=f"{start.name}.block",
                  dynamic_slice_sizes=shard.dims).name


__all__ = ["CarriedLoop", "IndexEvaluator", "ModuleReads", "ReduceScatterCreation",
           "ReduceScatterReport", "ReduceScatterSpec", "ScannedScatterSpec",
           "ScatterCollectives", "ScatterDecision", "SlotRead", "match_reduce_scatter",
           "match_scanned_reduce_scatter"]
