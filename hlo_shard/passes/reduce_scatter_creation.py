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
* The pair is rewritten only where :func:`~hlo_shard.costmodel.network.collective_cost`
  on the pass's profile predicts the collectives it becomes faster than the all-reduce
  (a split pays a second collective's latency for the bytes it saves, which loses for
  small gradients on shared-memory CPU devices); the report says why each pair was kept.
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
from typing import ClassVar

from hlo_shard.analysis.collectives import (DeviceGroups, GroupMode, ReasonCode,
                                            find_gradient_all_reduces, with_device_counts)
from hlo_shard.costmodel.network import collective_cost
from hlo_shard.graph import ModuleRewriter, Rewriter, control_predecessors, users_map
from hlo_shard.ir import (ELEMENT_BITS, ArrayShape, AttrValue, Computation, Ident, Instruction, Module, ReplicaGroups,
                          SliceRanges)
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

    def _ancestry(self, name: str) -> list[str] | None:
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
        order = self._ancestry(name)
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
class ReduceScatterSpec:
    """An all-reduce and the slice of it each device keeps, as a reduce-scatter."""

    computation: str
    all_reduce: str
    #: The blockwise ops from the all-reduce to the slice, in order, each with the
    #: dimension of its result the blocks are cut along.
    chain: tuple[tuple[str, int], ...]
    dynamic_slice: str
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


def _participant(mode: GroupMode, replica: int, partition: int, partitions: int) -> int:
    return {GroupMode.CROSS_REPLICA: replica, GroupMode.CROSS_REPLICA_AND_PARTITION: replica,
            GroupMode.CROSS_PARTITION: partition,
            GroupMode.FLATTENED_ID: replica * partitions + partition}[mode]


def match_reduce_scatter(module: Module, comp: Computation, all_reduce: Instruction,
                         groups: DeviceGroups, users: dict[str, list[str]],
                         index: IndexEvaluator) -> ReduceScatterSpec | str:
    """The spec of ``all_reduce`` as a reduce-scatter, or why not (words for ``--explain``).
    ``module``'s header must name its devices (the pass reads it with those a header
    lost recovered)."""
    shape = all_reduce.shape
    operand = comp[all_reduce.operands[0]] if len(all_reduce.operands) == 1 else None
    if operand is None or not isinstance(shape, ArrayShape) or operand.shape != shape:
        return "not one array operand of the all-reduce's own shape and layout"
    if control_predecessors(all_reduce) or "control-successors" in all_reduce.attributes:
        return "the all-reduce is ordered by control edges"
    chain, value = [], all_reduce.name
    while True:
        following = users[value]
        if len(following) != 1 or value == comp.root_name:
            return "the reduced value has other uses than one slice"
        user = comp[following[0]]
        if user.opcode not in _BLOCKWISE or not isinstance(user.shape, ArrayShape):
            break
        if control_predecessors(user):
            return "an op before the slice is ordered by control edges"
        chain.append(user)
        value = user.name
    if user.opcode != "dynamic-slice" or user.operands[0] != value:
        return f"a {user.opcode} between the all-reduce and its slice"
    whole, part = comp[value].array_shape, user.array_shape
    cut = [d for d, (a, b) in enumerate(zip(whole.dims, part.dims)) if a != b]
    if len(cut) != 1:
        return "the slice cuts several dimensions"
    (split,) = cut
    chunk = part.dims[split]
    if chunk == 0 or whole.dims[split] % chunk:
        return "the slice is not a whole number of blocks of its dimension"
    blocks = whole.dims[split] // chunk
    dims, dim = [], split
    for op in reversed(chain):
        dims.append((op.name, dim))
        source = _BLOCKWISE[op.opcode](op, dim, comp[op.operands[0]].array_shape.dims)
        if source is None:
            return f"the {op.opcode} %{op.name} before the slice splits or merges its dimension"
        dim = source
    block_of = _block_table(module, groups, user.operands[split + 1], whole.dims[split],
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
    return ReduceScatterSpec(
        comp.name, all_reduce.name, tuple(reversed(dims)), user.name, dim, groups,
        tuple(scatter_groups), tuple(block_groups),
        tuple(scatter_groups) == groups.groups, shape.byte_size,
        _strided(shape, dim) and not any(op.opcode == "copy" for op in chain))


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
    #: The all-reduce's predicted seconds and those of what it becomes (0: not priced).
    before_s: float = 0.0
    after_s: float = 0.0
    blocks: int = 0
    #: Devices holding each block (an all-reduce of the block among them after the
    #: reduce-scatter when more than one).
    holders: int = 1
    kept_because: str = ""

    @property
    def words(self) -> str:
        """What ``--explain`` adds to the gradient's row."""
        if self.reduce_scatter:
            then = f", then an all-reduce of the block over {self.holders}" \
                if self.holders > 1 else ""
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
        created = self.created
        if not created:
            return []
        return [f"{len(created)} all-reduce + dynamic-slice pair(s) of the partitioner's "
                f"reduce-scatter form became reduce-scatters (predicted "
                f"{sum(d.before_s for d in created) * 1e3:.4g} -> "
                f"{sum(d.after_s for d in created) * 1e3:.4g} ms of collectives)"]

    def annotate(self, report: ShardingReport) -> None:
        """Add each decision's words to the row of its gradient in ``report``."""
        said = {(d.computation, d.all_reduce): d.words for d in self.decisions}
        for row in report.explanations:
            words = said.get((row.computation, row.all_reduce))
            if words and row.reason_code == ReasonCode.ALREADY_SHARDED.value:
                row.reason = f"{row.reason}; {words}"


@dataclass(frozen=True)
class ReduceScatterCreation(ModulePass[ReduceScatterReport]):
    """Turn the partitioner's all-reduce + dynamic-slice pairs into reduce-scatters where
    ``profile`` predicts it faster."""

    name: ClassVar[str] = "reduce-scatter-creation"
    profile: HardwareProfile | str = DEFAULT_PROFILE

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", resolve_profile(self.profile))

    def apply(self, module: Module, rewriter: ModuleRewriter) -> ReduceScatterReport:
        view = with_device_counts(module)
        hardware = resolve_profile(self.profile).for_devices(view.device_count)
        formed: dict[str, list[tuple[str, DeviceGroups]]] = {}
        for found in find_gradient_all_reduces(view):
            if found.code is ReasonCode.ALREADY_SHARDED and found.groups is not None:
                formed.setdefault(found.computation, []).append((found.name, found.groups))
        channels = ChannelIds(module)
        decisions: list[ScatterDecision] = []
        for comp_name, gradients in formed.items():
            comp = module.computation(comp_name)
            users, index = users_map(comp), IndexEvaluator(comp)
            specs = []
            for name, groups in gradients:
                if comp[name].opcode != "all-reduce":
                    continue
                spec = match_reduce_scatter(view, comp, comp[name], groups, users, index)
                if isinstance(spec, str):
                    decisions.append(ScatterDecision(comp_name, name, kept_because=spec))
                    continue
                narrow = _narrow_float(comp[name].array_shape.element_type)
                if spec.block_groups and narrow:
                    decisions.append(ScatterDecision(
                        comp_name, name, kept_because=f"{_collectives(spec)} would sum "
                        f"{narrow} partial sums in another order than the all-reduce: "
                        "rounded differently at the type's precision"))
                    continue
                before, after = _price(spec, hardware)
                if after >= before:
                    decisions.append(ScatterDecision(
                        comp_name, name, before_s=before, after_s=after,
                        blocks=spec.blocks, holders=_holders(spec),
                        kept_because=f"{_collectives(spec)} predicted {after * 1e6:.4g} us "
                        f"against the all-reduce's {before * 1e6:.4g} us (profile "
                        f"{hardware.name})"))
                    continue
                specs.append((spec, before, after))
            for spec, before, after in specs:
                created = _rewrite(rewriter.rewriter(comp), spec, channels)
                decisions.append(ScatterDecision(comp_name, spec.all_reduce, created, before,
                                                 after, spec.blocks, _holders(spec)))
        return ReduceScatterReport(tuple(decisions))


def _narrow_float(element_type: str) -> str:
    """``element_type`` when it is a floating type of fewer than 32 bits, else ``""``."""
    floating = element_type.startswith(("f", "bf"))
    return element_type if floating and ELEMENT_BITS.get(element_type, 32) < 32 else ""


def _collectives(spec: ReduceScatterSpec) -> str:
    then = f" and an all-reduce of the block over {_holders(spec)}" if spec.block_groups else ""
    return f"a reduce-scatter over {spec.blocks}{then}"


def _holders(spec: ReduceScatterSpec) -> int:
    return len(spec.block_groups[0]) if spec.block_groups else 1


def _price(spec: ReduceScatterSpec, hardware: HardwareProfile) -> tuple[float, float]:
    """Seconds of the all-reduce, and of the reduce-scatter (and the all-reduce of the
    block among its holders) it becomes; buffers priced as mapped already, which is what
    makes a second collective's latency weigh most against the bytes it saves. Blocks
    strided in the all-reduce's layout (the split dimension is not its outermost one
    longer than 1: an FSDP weight's gradient computed transposed) are not contiguous
    buffers: the operand is transposed whole first, one more pass over the gradient's
    bytes into a fresh buffer (on XLA:CPU such a reduce-scatter measured slower than the
    all-reduce and slice it replaces)."""
    n, size = spec.groups.size, spec.payload_bytes
    before = collective_cost("all-reduce", n, size, hardware, resident=True).seconds
    after = collective_cost("reduce-scatter", spec.blocks, size, hardware,
                            resident=True).seconds
    if spec.strided:
        after += hardware.memory_seconds(size, size)
    if spec.block_groups:
        after += collective_cost("all-reduce", _holders(spec), size // spec.blocks, hardware,
                                 resident=True).seconds
    return before, after


def _rewrite(rw: Rewriter, spec: ReduceScatterSpec, channels: ChannelIds) -> str:
    """Edit one pair: the reduce-scatter (and block all-reduce) take the all-reduce's
    place, the blockwise ops after it shrink to the block, the slice goes. Returns the
    reduce-scatter's name."""
    comp = rw.comp
    all_reduce, ds = comp[spec.all_reduce], comp[spec.dynamic_slice]

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

    def block(shape: ArrayShape, dim: int) -> ArrayShape:
        dims = list(shape.dims)
        dims[dim] //= spec.blocks
        return replace(shape, dims=tuple(dims))

    own = spec.groups.replica_groups if spec.in_group_order else \
        ReplicaGroups(spec.scatter_groups)
    shape = block(all_reduce.array_shape, spec.split_dim)
    with rw.inserting_before(all_reduce.name):
        result = rw.add("reduce-scatter", shape, all_reduce.operands,
                        name=f"{spec.all_reduce}.scatter",
                        **attrs(own, dimensions=(spec.split_dim,)))
        created = result.name
        if spec.block_groups:
            result = rw.add("all-reduce", shape, [created], name=f"{spec.all_reduce}.block",
                            **attrs(ReplicaGroups(spec.block_groups)))
    rw.replace_all_uses_with(all_reduce.name, result.name)
    rw.erase(all_reduce.name)
    for name, dim in spec.chain:
        rw.set_shape(comp[name], block(comp[name].array_shape, dim))
    end = spec.chain[-1][0] if spec.chain else result.name
    if comp[end].shape != ds.shape:  # the slice's own layout
        end = rw.insert_before(ds.name, Instruction(
            rw.fresh_name(f"{ds.name}.relaid"), "copy", ds.shape, [end], {})).name
    offsets = ds.operands[1:]
    rw.replace_all_uses_with(ds.name, end)
    rw.erase(ds.name)
    rw.remove_dead(among=offsets)  # the index arithmetic only the slice read
    return created


__all__ = ["IndexEvaluator", "ReduceScatterCreation", "ReduceScatterReport",
           "ReduceScatterSpec", "ScatterDecision", "match_reduce_scatter"]
