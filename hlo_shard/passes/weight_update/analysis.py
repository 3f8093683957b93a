"""The weight-update region: what can run on 1/N shards after the gradient all-reduce.

Starting from the all-reduced gradients, every user is classified by a rule table
(:data:`RULES`, default: *ends the region*):

* elementwise ops → run on the shard (their non-sharded operands must be proved replicated
  — they are sliced locally — or be scalars);
* reshape / bitcast / transpose / copy → free when the element order of the shard format is
  preserved (transpose always is; reshape when the order stays row-major or only size-1
  dimensions move; bitcast when the shard is in physical order), else the region ends;
* reductions to one element (norms, global-norm clipping, is-finite checks, max/min) → a
  masked local reduction plus a small all-reduce of the same reducer over the group;
* on shards that are blocks of the value (:attr:`ShardFormat.block`), ops on the block
  (:attr:`OpKind.BLOCK`): a reduction keeping the block dimension (its result sharded in
  blocks: Adafactor's statistic along the other dimension), a broadcast; and a sum along
  the block dimension as the block's partial sums all-reduced (a replicated result);
  every reduction from its reducer's neutral value only (XLA applies an initial value
  once per partial result of its choosing);
* anything else (dot, gather, other partial reductions, tuple, custom-call, …) ends the
  region: the sharded operand is all-gathered right before that user.

Two extensions pull replicated work into the region so that no update op runs on a
full-size weight: producers whose every user is in the region (AdamW's ``w * wd``), and
one-element reductions of replicated values whose result feeds the region (LAMB's weight
norm). A *sharded value* is described by a :class:`ShardFormat`; the formats of the leaves
are chosen to minimise formatting copies (transposes) over the region.

Besides the region, the facts the pass reads before any edit: which gradient all-reduces
it can reach (:func:`triage`), the data-parallel group, the optimizer state (and, with
sharded parameters, the weights) that can stay shards (:func:`pair_state`), the loop
slots carried as shards (:func:`loop_slots`). Nothing here edits the module: the
lowering consumes what these return.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import cast

from hlo_shard.analysis.collectives import (DeviceGroups, GradientAllReduce, ReasonCode,
                                            find_gradient_all_reduces, neutral_literal,
                                            reducer_opcode, with_device_counts)
from hlo_shard.analysis.element_flow import ElementOperands, reduces_unit_dimensions_only
from hlo_shard.analysis.matmul_inputs import matmul_inputs
from hlo_shard.analysis.names import sorted_dims
from hlo_shard.analysis.replication import (ParamOverrides, Replication, analyze_replication,
                                            is_pmap_form)
from hlo_shard.errors import HloShardError
from hlo_shard.graph import (DataflowGraph, FusedStructure, call_graph, control_predecessors, dataflow_graph,
                             fused_structure, reachable, reading_only, topological_order,
                             upstream_bits, users_map)
from hlo_shard.ir import (ELEMENT_BITS, ArrayShape, Computation, Ident, Instruction,
                          Module, Shape, TupleShape, shape_leaves)
from hlo_shard.parser import cyclic_gc_paused
from hlo_shard.opinfo import (ELEMENTWISE, LOGICAL_VIEWS, PER_ELEMENT_COST, SCALAR_OPERANDS,
                              SHAPE_VIEWS)
from hlo_shard.shard_format import ShardFormat, canonical_perm, natural_perm
from hlo_shard.values import read_window

# ------------------------------------------------------------------------ the format


def is_laid_out(module: Module) -> bool:
    """XLA has optimized the module (scheduled, or fused: jax never emits fusions), so no
    layout assignment runs after the pass."""
    return module.is_scheduled or any(inst.opcode == "fusion" for comp in module.computations
                                      for inst in comp.instructions)


def blocks_through_collectives(fmt: ShardFormat, shape: ArrayShape, laid_out: bool) -> bool:
    """A reduce-scatter / all-gather can move ``fmt``'s blocks of a ``shape`` value. In a
    laid-out module no layout pass runs after the rewrite, and XLA:CPU splits a
    collective's buffer along the physically most-major dimension whatever ``dimensions``
    says (measured: a reduce-scatter along dimension 1 of a ``{1,0}`` array gave each
    device rows — a transposed Adam update); there the block dimension must be the major
    one of both the value's layout and the (row-major) block's."""
    if fmt.block is None:
        return False
    if not laid_out:
        return True
    major, rows = fmt.block
    block = tuple(rows if d == major else size for d, size in enumerate(fmt.dims))
    return major_dimension(shape.dims, shape.minor_to_major()) == major == \
        major_dimension(block, tuple(range(len(block) - 1, -1, -1)))


def major_dimension(dims: tuple[int, ...], minor_to_major: tuple[int, ...]) -> int | None:
    """The physically most-major dimension of size > 1."""
    return next((d for d in reversed(minor_to_major) if dims[d] != 1), None)


def transpose_result(fmt: ShardFormat, permutation: tuple[int, ...]) -> ShardFormat:
    """Format of ``transpose(x, permutation)`` keeping x's shard order (always exists)."""
    inverse = [0] * len(permutation)
    for k, d in enumerate(permutation):
        inverse[d] = k
    dims = tuple(fmt.dims[d] for d in permutation)
    return ShardFormat(dims, canonical_perm(tuple(inverse[p] for p in fmt.perm), dims), fmt.n)


def transpose_operand(fmt: ShardFormat, permutation: tuple[int, ...],
                      operand_dims: tuple[int, ...]) -> ShardFormat:
    """Format x must have so that ``transpose(x, permutation)`` has ``fmt``."""
    perm = tuple(permutation[p] for p in fmt.perm)
    return ShardFormat(operand_dims, canonical_perm(perm, operand_dims), fmt.n)


def reshape_format(fmt: ShardFormat, dims: tuple[int, ...]) -> ShardFormat | None:
    """Format of a reshape to ``dims`` with the same flat order, when one exists: the
    order is row-major (any reshape keeps it), or only size-1 dimensions change."""
    if fmt.is_row_major:
        return ShardFormat(dims, canonical_perm(tuple(range(len(dims))), dims), fmt.n)
    big_in = [d for d in range(len(fmt.dims)) if fmt.dims[d] != 1]
    big_out = [d for d in range(len(dims)) if dims[d] != 1]
    if [fmt.dims[d] for d in big_in] != [dims[d] for d in big_out]:
        return None
    to_out = dict(zip(big_in, big_out))
    # The result's size-1 dimensions (new ones included) lead the order, as canonical.
    ones = tuple(d for d in range(len(dims)) if dims[d] == 1)
    perm = ones + tuple(to_out[p] for p in fmt.perm if fmt.dims[p] != 1)
    return ShardFormat(dims, canonical_perm(perm, dims), fmt.n)


# ------------------------------------------------------------------------ the rules


class OpKind(enum.Enum):
    """How a region op runs on shards: decided once, by its rule, and the lowering emits
    by it (it does not look at the opcode again to choose)."""

    #: Re-emitted on the flat ``[L]`` shard with its operands' shards (elementwise ops,
    #: loop fusions, pulled-in replicated producers).
    ELEMENTWISE = "elementwise"
    #: The shard itself, unchanged: the op only relabels the element order the format
    #: already accounts for (reshape, bitcast, transpose, a reduction over size-1
    #: dimensions only).
    VIEW = "view"
    #: On the shard's block of the value (a reduction along other dimensions, a
    #: broadcast), the result in blocks too.
    BLOCK = "block"
    #: To one element (or along the block dimension): masked, reduced locally and
    #: all-reduced; the result is replicated.
    REDUCE = "reduce"


@dataclass(frozen=True)
class RegionOp:
    """A region instruction: how it consumes its sharded/replicated array operands
    (``operand_format``) and what it yields (``result_format``; None for a reduction,
    whose result is a replicated value)."""

    kind: OpKind
    operand_format: ShardFormat
    result_format: ShardFormat | None
    #: For reductions: the reducer opcode (add, maximum, …) and its neutral literal.
    reducer: str = ""
    neutral: str = ""
    pulled: bool = False
    #: Per operand, the format it is read in, where operands differ (a loop fusion whose
    #: body transposes, reshapes or bitcasts one; None for scalars); empty: all
    #: in ``operand_format``.
    operand_formats: tuple[ShardFormat | None, ...] = ()

    @property
    def result_shard(self) -> ShardFormat:
        """The result's format, for an op that is not :attr:`OpKind.REDUCE` (a reduction's
        result is replicated)."""
        if self.result_format is None:
            raise ValueError("a reduction's result is not sharded")
        return self.result_format

    def format_of(self, index: int) -> ShardFormat:
        """The format operand ``index`` is read in."""
        fmt = self.operand_formats[index] if self.operand_formats else None
        return fmt or self.operand_format

    def formats_reading(self, inst: Instruction, name: str) -> set[ShardFormat]:
        """The formats ``inst`` (this op's instruction) reads its operand ``name`` in."""
        return {self.format_of(i) for i, o in enumerate(inst.operands) if o == name}


@dataclass
class _Context:
    module: Module
    comp: Computation
    replication: Replication
    n: int
    sharded: dict[str, ShardFormat]
    #: :func:`is_laid_out` of the module (a scan of it: looked at once per planner).
    laid_out: bool
    #: What the planner's contexts share of the fusions they look at.
    fusions: FusionMemo

    def replicated(self, name: str) -> bool:
        return self.replication.is_replicated(self.comp.name, name)

    def inst(self, name: str) -> Instruction:
        return self.comp[name]


def _leaf_dims(shape: Shape) -> set[tuple[int, ...]]:
    """The dimensions of each array of ``shape`` (a tuple's: of every element)."""
    return {leaf.dims for _, leaf in shape_leaves(shape)}


def _array(shape: Shape) -> ArrayShape | None:
    return shape if isinstance(shape, ArrayShape) and not shape.dynamic else None


def _operands_fit(ctx: _Context, inst: Instruction, fmt: ShardFormat) -> bool:
    """Every operand of ``inst`` is sharded in ``fmt`` or replicated (full dims or scalar)."""
    for name in inst.operands:
        if name in ctx.sharded:
            if ctx.sharded[name] != fmt:
                return False
            continue
        shape = _array(ctx.inst(name).shape)
        if shape is None or not ctx.replicated(name):
            return False
        if shape.dims != fmt.dims and not (shape.is_scalar and inst.opcode in _SCALAR_OK):
            return False
    return True


#: The elementwise ops that run unchanged on a 1-D shard: all but ``map``, whose
#: ``dimensions=`` name the full value's dimensions (the rewrite re-emits an op on shards
#: with its attributes as they are).
_SHARDABLE = ELEMENTWISE - {"map"}

#: Opcodes that accept scalar operands next to arrays (fusions: :func:`fusion_access`).
_SCALAR_OK = SCALAR_OPERANDS


def _elementwise(ctx: _Context, inst: Instruction) -> RegionOp | None:
    fmt: ShardFormat | None = None
    for operand in inst.operands:  # the sharded operands' one format
        found = ctx.sharded.get(operand)
        if found is None:
            continue
        if fmt is None:
            fmt = found
        elif found is not fmt and found != fmt:
            return None
    if fmt is None:
        return None
    shape = _array(inst.shape)
    if shape is None or shape.dims != fmt.dims or not _operands_fit(ctx, inst, fmt):
        return None
    return RegionOp(OpKind.ELEMENTWISE, fmt, fmt)


def _bitcast_convert(ctx: _Context, inst: Instruction) -> RegionOp | None:
    source = _array(ctx.inst(inst.operands[0]).shape)
    shape = _array(inst.shape)
    if source is None or shape is None or source.dims != shape.dims or \
            ELEMENT_BITS[source.element_type] != ELEMENT_BITS[shape.element_type]:
        return None
    return _elementwise(ctx, inst)


def _reshape(ctx: _Context, inst: Instruction) -> RegionOp | None:
    fmt = ctx.sharded[inst.operands[0]]
    shape = _array(inst.shape)
    result = reshape_format(fmt, shape.dims) if shape is not None else None
    return RegionOp(OpKind.VIEW, fmt, result) if result is not None else None


def _bitcast(ctx: _Context, inst: Instruction) -> RegionOp | None:
    """A bitcast keeps the physical order: free when the shard is in physical order."""
    fmt = ctx.sharded[inst.operands[0]]
    source = _array(ctx.inst(inst.operands[0]).shape)
    shape = _array(inst.shape)
    if source is None or shape is None or source.element_type != shape.element_type:
        return None
    if fmt.perm != natural_perm(source):
        return None
    return RegionOp(OpKind.VIEW, fmt, ShardFormat.of(shape, fmt.n))


def _transpose(ctx: _Context, inst: Instruction) -> RegionOp | None:
    fmt = ctx.sharded[inst.operands[0]]
    return RegionOp(OpKind.VIEW, fmt, transpose_result(fmt, inst.ints_attr("dimensions")))


def _reduce(ctx: _Context, inst: Instruction) -> RegionOp | None:
    """A reduction to one element of a sharded (or, when pulled, replicated) value."""
    if len(inst.operands) != 2:
        return None
    source = inst.operands[0]
    source_shape = _array(ctx.inst(source).shape)
    shape = _array(inst.shape)
    if source_shape is None or shape is None:
        return None
    if shape.num_elements != 1:
        return _degenerate_reduce(ctx, inst, source_shape, shape) or \
            _block_reduce(ctx, inst, shape) or _partial_reduce(ctx, inst)
    if source in ctx.sharded:
        fmt = ctx.sharded[source]
    elif ctx.replicated(source):
        fmt = ShardFormat.of(source_shape, ctx.n)
    else:
        return None
    reducer = _reducer(ctx, inst)
    neutral = _neutral_init(ctx, inst, reducer)
    if reducer is None or neutral is None:
        return None
    return RegionOp(OpKind.REDUCE, fmt, None, reducer, neutral)


def _neutral_init(ctx: _Context, inst: Instruction, reducer: str | None) -> str | None:
    """The neutral literal of ``reducer`` where ``inst`` (a reduction) starts from it,
    else None. XLA applies a reduction's initial value once per partial result of its
    own choosing (XLA:CPU: 9 times over 256 zeros, once over 4096), so a reduction
    from any other value computes what XLA's emitter makes of it: its shards would not."""
    return _neutral_start(reducer, inst, ctx.inst(inst.operands[1]))


def _neutral_start(reducer: str | None, inst: Instruction, init: Instruction) -> str | None:
    """The neutral literal of ``reducer`` for ``inst``'s element type where ``init`` is
    that constant, else None."""
    shape = _array(inst.shape)
    neutral = neutral_literal(reducer, shape.element_type) if reducer and shape else None
    if neutral is None or init.opcode != "constant" or not _same_number(init.literal, neutral):
        return None
    return neutral


def _reduces_from_non_neutral(module: Module, comp: Computation, inst: Instruction) -> bool:
    """``inst`` is a reduction, or a fusion holding one, that starts from anything but
    its reducer's neutral constant (a reducer of several values counts as such: its
    neutral element is not known)."""
    if inst.opcode == "reduce":
        return not _starts_neutral(module, comp, inst)
    calls = inst.called("calls") if inst.opcode == "fusion" else None
    if not calls or not module.has_computation(calls):
        return False
    body = module.computation(calls)
    return any(item.opcode == "reduce" and not _starts_neutral(module, body, item, (comp, inst))
               for item in body.instructions)


def _starts_neutral(module: Module, comp: Computation, inst: Instruction,
                    caller: tuple[Computation, Instruction] | None = None) -> bool:
    """The reduction ``inst`` of ``comp`` starts from its reducer's neutral constant
    (``caller``: the computation and fusion ``comp`` is the body of, whose operand a
    parameter of ``comp`` reads)."""
    reducer = reducer_opcode(module, inst.called("to_apply")) \
        if len(inst.operands) == 2 else None
    init = comp[inst.operands[-1]]
    if caller is not None and init.opcode == "parameter":
        outer, fusion = caller
        init = outer[fusion.operands[cast(int, init.parameter_number)]]
    return _neutral_start(reducer, inst, init) is not None


def _reducer(ctx: _Context, inst: Instruction) -> str | None:
    """The opcode of the reduction's ``to_apply`` (add, maximum, …), or None."""
    return reducer_opcode(ctx.module, inst.called("to_apply"))


def _fusion(ctx: _Context, inst: Instruction) -> RegionOp | None:
    """A loop fusion whose body is elementwise up to views of its operands (what XLA makes
    of an optimizer update: transposes, reshapes and bitcasts of the gradient fused in)
    runs on shards like one elementwise op, each operand read in the element order the
    body maps onto the result's."""
    access = fusion_access(ctx, inst)
    if isinstance(access, str):
        return _tiled_window_fusion(ctx, inst)
    return RegionOp(OpKind.ELEMENTWISE, access.result, access.result,
                    operand_formats=access.operands)


def _tiled_window_fusion(ctx: _Context, inst: Instruction) -> RegionOp | None:
    """A fusion (loop or library) reducing non-overlapping windows of an elementwise
    function of shards in row-major blocks: XLA:CPU's first stage of a sum of squares (the
    global norm's ``square`` + ``reduce-window`` of 32×32 tiles, then a small reduce of
    the tiles). Where the windows tile the block, each result element is reduced from one
    device's block alone, from the same elements in the same order, so the result is
    sharded in blocks of the tiles — and the norm no longer needs the whole gradient."""
    calls, shape = inst.called("calls"), _array(inst.shape)
    formats = {ctx.sharded[o] for o in inst.operands if o in ctx.sharded}
    if not calls or shape is None or not _is_row_major(shape) or len(formats) != 1:
        return None
    fmt = formats.pop()
    if fmt.block is None or not fmt.is_row_major or any(
            o not in ctx.sharded and (not ctx.replicated(o) or not _at_most_one_element(
                ctx.inst(o).shape)) for o in inst.operands):
        return None
    body = ctx.module.computation(calls)
    root = body.root
    tiles = _window_tiles(root, fmt.dims) if root.opcode == "reduce-window" else None
    major, rows = fmt.block
    if tiles is None or rows % tiles[major] or not _elementwise_on(body, inst, ctx, fmt):
        return None
    result = _block_format(shape.dims, fmt.perm, major, rows // tiles[major], fmt.n)
    if result is None:
        return None
    return RegionOp(OpKind.BLOCK, fmt, result, operand_formats=tuple(
        fmt if o in ctx.sharded else None for o in inst.operands))


def _is_row_major(shape: ArrayShape) -> bool:
    return shape.layout is None or (not shape.layout.tail and shape.is_row_major)


def _window_tiles(window: Instruction, dims: tuple[int, ...]) -> tuple[int, ...] | None:
    """The window sizes of a single-operand ``reduce-window`` over ``dims`` whose windows
    tile it (stride = size, no padding, no dilation, sizes dividing the dimensions)."""
    per_dim = read_window(window.attr("window"))
    if len(window.operands) != 2 or len(per_dim) != len(dims) or \
            not all(w.tiles and d % w.size == 0 for w, d in zip(per_dim, dims)):
        return None
    return tuple(w.size for w in per_dim)


def _elementwise_on(body: Computation, inst: Instruction, ctx: _Context,
                    fmt: ShardFormat) -> bool:
    """Every array value of ``body`` but its root (a reduce-window) is an elementwise
    function of the fusion's sharded operands, in ``fmt``'s dims and row-major; the
    reduce-window's initial value is a scalar."""
    root = body.root
    for item in body.instructions:
        shape = _array(item.shape)
        if shape is None:
            return False
        if item is root:
            continue
        if shape.is_scalar:
            if item.opcode not in _SCALAR_BODY or any(
                    not body[o].array_shape.is_scalar for o in item.operands):
                return False
            continue
        if shape.dims != fmt.dims or not _is_row_major(shape):
            return False
        if item.opcode == "parameter":
            if inst.operands[cast(int, item.parameter_number)] not in ctx.sharded:
                return False
        elif not (is_scalar_broadcast(body, item.name) or item.opcode in _SHARDABLE):
            return False
    return body[root.operands[0]].array_shape.dims == fmt.dims and \
        body[root.operands[1]].array_shape.is_scalar


@dataclass(frozen=True)
class FusionAccess:
    """The element orders of a loop fusion on shards: its result's, and per operand the
    one its body reads it in (None for scalars)."""

    result: ShardFormat
    operands: tuple[ShardFormat | None, ...]


@dataclass
class FusionMemo:
    """What the contexts of one planner share of the fusions of its computation, which
    stays as it is while the planner lives: each fusion's
    :func:`~hlo_shard.graph.fused_structure` (a plan's growth looks at a fusion again
    for each trial and leaf), and the :func:`body_access` of fusions alike with the same
    sharded operands."""

    structures: dict[tuple[str, str], FusedStructure | None] = field(default_factory=dict)
    accesses: dict[tuple, FusionAccess] = field(default_factory=dict)

    def structure(self, inst: Instruction, body: Computation) -> FusedStructure | None:
        key = (inst.name, body.name)
        if key not in self.structures:
            self.structures[key] = fused_structure(inst, body)
        return self.structures[key]


def fusion_access(ctx: _Context, inst: Instruction) -> FusionAccess | str:
    """How ``inst`` (a fusion with sharded operands) runs on shards, or why it cannot:
    the op of its body that stops it."""
    calls, kind = inst.called("calls"), inst.attr_as("kind", Ident)
    shape = _array(inst.shape)
    if kind is None or kind.name != "kLoop" or not calls:
        return f"a {kind.name if kind else '?'} fusion (only loop fusions run on shards)"
    if shape is None:
        return "a multi-output fusion"
    body = ctx.module.computation(calls)
    seeds = {k: ctx.sharded[o] for k, o in enumerate(inst.operands) if o in ctx.sharded}
    structure = ctx.fusions.structure(inst, body)
    key = None if structure is None else (structure, tuple(sorted(seeds.items())))
    access = ctx.fusions.accesses.get(key) if key is not None else None
    if access is None:
        found = body_access(body, seeds)
        if isinstance(found, str):
            return found  # (it names the body's own instruction: not shared)
        access = found
        if key is not None:
            ctx.fusions.accesses[key] = access
    for name in inst.operands:
        if name not in ctx.sharded and not ctx.replicated(name):
            return f"operand %{name} is neither sharded nor replicated"
    return access


def _free(body: Computation, inst: Instruction) -> bool:
    """A scalar, or a broadcast of one: any element order."""
    return inst.array_shape.is_scalar or is_scalar_broadcast(body, inst.name)


#: Body ops that move elements without changing them: the result's format from the
#: operand's (forward) and the operand's from the result's (back); None: no such order.
def _view_forward(body: Computation, inst: Instruction, fmt: ShardFormat) -> ShardFormat | None:
    source, shape = body[inst.operands[0]].array_shape, inst.array_shape
    if inst.opcode == "transpose":
        return transpose_result(fmt, inst.ints_attr("dimensions"))
    if inst.opcode == "reshape":
        return reshape_format(fmt, shape.dims)
    if source.element_type != shape.element_type or fmt.perm != natural_perm(source):
        return None  # a bitcast keeps the physical order
    return ShardFormat.of(shape, fmt.n)


def _view_back(body: Computation, inst: Instruction, fmt: ShardFormat) -> ShardFormat | None:
    source, shape = body[inst.operands[0]].array_shape, inst.array_shape
    if inst.opcode in LOGICAL_VIEWS:
        return _operand_format_for(inst, body, fmt)
    if source.element_type != shape.element_type or fmt != ShardFormat.of(shape, fmt.n):
        return None
    return ShardFormat.of(source, fmt.n)


#: Fusion-body ops that only move elements (their element order is the body analysis's
#: concern; on shards the rewrite drops them).
VIEW_OPCODES = SHAPE_VIEWS
#: Scalar body ops that may compute the broadcast scalars (bias corrections, steps).
_SCALAR_BODY = _SHARDABLE | PER_ELEMENT_COST | frozenset({"parameter", "constant"})


def body_access(body: Computation, seeds: dict[int, ShardFormat]) -> FusionAccess | str:
    """The element orders of a fusion body whose parameters ``seeds`` are shards: forward
    from them through elementwise ops and views, then back from the root to the other
    parameters. Everything else (reductions, non-scalar broadcasts and constants, slices,
    iota, …) stops it, and so does a value needed in two orders."""
    order = topological_order(body)
    formats = _orders_forward(body, order, seeds)
    if isinstance(formats, str):
        return formats
    if body.root_name not in formats:
        return "its result does not depend on the sharded operands"
    refused = _orders_back(body, order, formats)
    if refused:
        return refused
    operands: list[ShardFormat | None] = []
    for param in sorted(body.parameters(), key=lambda p: p.param_number):
        if not _free(body, param) and param.name not in formats:
            return f"parameter %{param.name} is unused"
        operands.append(None if _free(body, param) else formats[param.name])
    return FusionAccess(formats[body.root_name], tuple(operands))


def _orders_forward(body: Computation, order: list[Instruction],
                    seeds: dict[int, ShardFormat]) -> dict[str, ShardFormat] | str:
    """:func:`body_access`'s forward half: value → its element order, from the sharded
    parameters through elementwise ops and views (or why the body stops it)."""
    formats: dict[str, ShardFormat] = {}
    for inst in order:
        shape = _array(inst.shape)
        if shape is None:
            return f"%{inst.name} ({inst.opcode}) is not an array"
        if inst.opcode == "parameter":
            seed = seeds.get(inst.param_number)
            if seed is not None:
                formats[inst.name] = seed
            continue
        if shape.is_scalar:
            if inst.opcode not in _SCALAR_BODY or any(
                    not body[o].array_shape.is_scalar for o in inst.operands):
                return f"%{inst.name} ({inst.opcode}) computes a scalar from the body"
            continue
        if is_scalar_broadcast(body, inst.name):
            continue
        known = {formats[o] for o in inst.operands if o in formats}
        if inst.opcode in VIEW_OPCODES:
            if known:
                result = _view_forward(body, inst, known.pop())
                if result is None:
                    return f"%{inst.name} ({inst.opcode}) changes the element order"
                formats[inst.name] = result
        elif inst.opcode in _SHARDABLE or (inst.opcode == "bitcast-convert" and ELEMENT_BITS[
                body[inst.operands[0]].array_shape.element_type] ==
                ELEMENT_BITS[shape.element_type]):
            if len(known) > 1:
                return f"%{inst.name} ({inst.opcode}) reads its operands in two element orders"
            if known:
                formats[inst.name] = known.pop()
        else:
            return f"%{inst.name} ({inst.opcode}) is not elementwise"
    return formats


def _orders_back(body: Computation, order: list[Instruction],
                 formats: dict[str, ShardFormat]) -> str:
    """:func:`body_access`'s backward half: from the root, the order each operand not
    reached forward must be read in, into ``formats``; why not ("" where every value
    has one)."""
    for inst in reversed(order):
        fmt = formats.get(inst.name)
        if fmt is None:
            if not _free(body, inst) and inst.opcode != "parameter":
                return f"%{inst.name} ({inst.opcode}) has no element order"
            continue
        for name in inst.operands:
            if _free(body, body[name]):
                continue
            have = formats.get(name)
            if inst.opcode in VIEW_OPCODES:
                fits = have is not None and _view_forward(body, inst, have) == fmt
                want = None if have is not None else _view_back(body, inst, fmt)
            else:
                fits, want = have == fmt, fmt
            if have is None and want is not None:
                formats[name] = want
            elif not fits:
                return f"%{inst.name} ({inst.opcode}) reads %{name} in another element order"
    return ""


def _degenerate_reduce(ctx: _Context, inst: Instruction, source: ArrayShape,
                       shape: ArrayShape) -> RegionOp | None:
    """A reduction over size-1 dimensions only, from the reducer's neutral value, is a
    reshape (jit's bias gradients: ``reduce(f32[1,16]) -> f32[16]``)."""
    source_name = inst.operands[0]
    if source_name not in ctx.sharded or not reduces_unit_dimensions_only(inst, source.dims):
        return None
    if _neutral_init(ctx, inst, _reducer(ctx, inst)) is None:
        return None
    fmt = ctx.sharded[source_name]
    result = reshape_format(fmt, shape.dims)
    return RegionOp(OpKind.VIEW, fmt, result) if result is not None else None


def _block_format(dims: tuple[int, ...], perm: tuple[int, ...], major: int, rows: int,
                  n: int) -> ShardFormat | None:
    """The format of ``dims`` in order ``perm`` when its shards are the blocks ``rows`` of
    dimension ``major`` (what a block op's result must be), else None."""
    fmt = ShardFormat(dims, canonical_perm(perm, dims), n)
    return fmt if fmt.block == (major, rows) else None


def _block_reduce(ctx: _Context, inst: Instruction, shape: ArrayShape) -> RegionOp | None:
    """A reduction along dimensions the shard's block does not cut (Adafactor's statistic
    along the other dimension of a gradient sharded in blocks): each result element is
    reduced from one device's block alone, from the same elements and initial value, so
    the result is sharded in blocks of the kept dimension — the factored state's 1/N."""
    fmt = ctx.sharded.get(inst.operands[0])
    if fmt is None or fmt.block is None or _neutral_init(ctx, inst, _reducer(ctx, inst)) is None:
        return None
    major, rows = fmt.block
    reduced = set(inst.ints_attr("dimensions"))
    if major in reduced:
        return None
    kept = [d for d in range(len(fmt.dims)) if d not in reduced]
    result = _block_format(shape.dims, tuple(kept.index(d) for d in fmt.perm if d in kept),
                           kept.index(major), rows, fmt.n)
    return RegionOp(OpKind.BLOCK, fmt, result) if result is not None else None


def _partial_reduce(ctx: _Context, inst: Instruction) -> RegionOp | None:
    """A sum along the shard's block dimension (Adafactor's statistic along the dimension
    the gradient is cut in): each device sums its block from zero and an all-reduce of
    the partial sums — as small as the result — adds them up; the result is replicated.
    Sums only: XLA:CPU's all-reduce drops NaN for max/min, which the one-element path's
    is-NaN flag repairs for one value, not per element."""
    fmt = ctx.sharded.get(inst.operands[0])
    if fmt is None or fmt.block is None or fmt.block[0] not in inst.ints_attr("dimensions") \
            or _reducer(ctx, inst) != "add":
        return None
    neutral = _neutral_init(ctx, inst, "add")
    return RegionOp(OpKind.REDUCE, fmt, None, "add", neutral) if neutral is not None else None


def _broadcast(ctx: _Context, inst: Instruction) -> RegionOp | None:
    """A broadcast of a shard in blocks (Adafactor's factor spread back over the weight)
    is the broadcast of the block into the result's block along the same dimension."""
    fmt = ctx.sharded[inst.operands[0]]
    shape = _array(inst.shape)
    if fmt.block is None or shape is None:
        return None
    major, rows = fmt.block
    target = inst.ints_attr("dimensions")[major]
    rest = tuple(d for d in natural_perm(shape) if d != target)
    result = _block_format(shape.dims, (target, *rest), target, rows, fmt.n)
    return RegionOp(OpKind.BLOCK, fmt, result) if result is not None else None


def _same_number(literal: str | None, value: str) -> bool:
    if literal is None:
        return False
    try:
        return float(literal) == float(value)
    except ValueError:
        return literal.strip() == value


Rule = Callable[[_Context, Instruction], "RegionOp | None"]

#: Opcode → rule deciding whether (and how) a user of a sharded value joins the region.
RULES: dict[str, Rule] = {
    **{opcode: _elementwise for opcode in _SHARDABLE},
    "bitcast-convert": _bitcast_convert,
    "reshape": _reshape,
    "bitcast": _bitcast,
    "transpose": _transpose,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "fusion": _fusion,
}


def _ends_region(ctx: _Context, inst: Instruction) -> None:
    return None


def classify(ctx: _Context, inst: Instruction) -> RegionOp | None:
    return RULES.get(inst.opcode, _ends_region)(ctx, inst)


#: Producers that may be pulled into the region when all their users are in it
#: (``bitcast-convert``, priced per element: element by element where it keeps the dims,
#: as a pulled producer must).
_PULLABLE = _SHARDABLE | PER_ELEMENT_COST | LOGICAL_VIEWS


def _operand_format_for(inst: Instruction, comp: Computation,
                        result: ShardFormat) -> ShardFormat | None:
    """For pulling: the format ``inst``'s operand must have for its result to be in
    ``result``."""
    if inst.opcode == "transpose":
        operand_dims = comp[inst.operands[0]].array_shape.dims
        return transpose_operand(result, inst.ints_attr("dimensions"), operand_dims)
    if inst.opcode == "reshape":
        operand = _array(comp[inst.operands[0]].shape)
        if operand is None:
            return None
        candidate = ShardFormat(operand.dims, canonical_perm(tuple(range(operand.rank)),
                                                             operand.dims), result.n)
        return candidate if reshape_format(candidate, result.dims) == result else None
    return result


# ------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Leaf:
    """One gradient: an array all-reduce or one element of a tuple all-reduce. What the
    planner is given; what it decides is a :class:`PlannedLeaf`."""

    all_reduce: str
    index: int | None
    #: Names whose value is the reduced gradient (the all-reduce or its GTEs).
    values: tuple[str, ...]
    #: The per-device gradient (the all-reduce's operand).
    operand: str
    shape: ArrayShape
    groups: DeviceGroups

    @property
    def byte_size(self) -> int:
        return self.shape.byte_size

    @property
    def label(self) -> str:
        return self.all_reduce if self.index is None else f"{self.all_reduce}[{self.index}]"


@dataclass(frozen=True)
class Whole:
    """Why a gradient stays all-reduced: ``code`` for programs, ``text`` for people."""

    code: ReasonCode
    text: str


@dataclass(frozen=True)
class PlannedLeaf(Leaf):
    """A leaf and the planner's decision: sharded in ``format``, or kept all-reduced for
    ``reason`` (``code``); and what its region moves."""

    #: The element order of its shard (for a leaf kept whole: the last one planned).
    format: ShardFormat
    sharded: bool
    reason: str = ""
    ops_moved: int = 0
    formatting_copies: int = 0
    saved_flops: float = 0.0
    code: ReasonCode | None = None

    @staticmethod
    def of(leaf: Leaf, fmt: ShardFormat, whole: Whole | None) -> PlannedLeaf:
        """``leaf`` sharded in ``fmt`` (``whole`` None) or kept whole, before accounting."""
        return PlannedLeaf(leaf.all_reduce, leaf.index, leaf.values, leaf.operand, leaf.shape,
                           leaf.groups, fmt, whole is None, whole.text if whole else "",
                           code=whole.code if whole else None)


@dataclass(frozen=True)
class RegionPlan:
    """Everything the rewrite of one computation needs."""

    comp: str
    groups: DeviceGroups
    #: An all-reduce whose collective attributes the new collectives copy.
    template: str
    leaves: tuple[PlannedLeaf, ...]
    #: Region value → format of its shard (leaf values included).
    sharded: Mapping[str, ShardFormat]
    #: Region instructions (leaves excluded) in program order.
    ops: Mapping[str, RegionOp]
    #: Sharded value → its users that need the full value (``""`` for the root).
    boundary: Mapping[str, tuple[str, ...]]
    formatting_copies: int = 0
    #: Elements the formatting transposes move (what the element-order choice minimises).
    formatting_cost: float = 0.0

    @property
    def active(self) -> list[PlannedLeaf]:
        return [leaf for leaf in self.leaves if leaf.sharded]

    def refused(self, whole: Whole) -> RegionPlan:
        """This plan with every sharded leaf kept whole for ``whole`` (a region the
        rewrite could not carry out): nothing is sharded, each gradient says why."""
        kept = tuple(leaf if not leaf.sharded else replace(
            leaf, sharded=False, reason=whole.text, code=whole.code, ops_moved=0,
            formatting_copies=0, saved_flops=0.0) for leaf in self.leaves)
        return replace(self, leaves=kept, sharded={}, ops={}, boundary={},
                       formatting_copies=0, formatting_cost=0.0)


@dataclass(frozen=True)
class RegionOptions:
    #: Gradients smaller than this stay all-reduced (0: no minimum).
    min_shard_bytes: int = 0
    #: ``--state sharded`` on the entry: element orders that let optimizer state stay
    #: sharded win over orders that need fewer transposes (a state tensor kept whole
    #: costs a slice and an all-gather of the full tensor every step, and its memory).
    keep_state_orders: bool = False
    #: Parameter number → the output that is its next value (``input_output_alias``).
    state_outputs: tuple[tuple[int, int], ...] = ()
    #: The root positions that are a parameter's next value (``input_output_alias``, the
    #: entry's): a gradient whose updated weight the step reads again (a GAN's
    #: discriminator, updated before the generator's loss runs through it) is an update's.
    next_value_outputs: frozenset[int] = frozenset()


def flattenable(fmt: ShardFormat, shape: ArrayShape) -> bool:
    """A signature value (sharded optimizer state) can be kept in ``fmt``: the manifest
    flattens it in its physical or its row-major order, no other."""
    return fmt.dims == shape.dims and (fmt.perm == natural_perm(shape) or fmt.is_row_major)


def region_read_parameters(params: list[Instruction], graph: DataflowGraph,
                           plan: RegionPlan, weights: bool = False,
                           through: dict[str, str] | None = None) -> dict[int, set[ShardFormat]]:
    """Array parameters the region reads → the formats its ops read them in: those read
    by region ops only (optimizer state, once paired with the output that is its next
    value), or with ``weights`` those the region reads and other instructions use too
    (the weights: the forward/backward pass reads them, the update computes their next
    value from them). ``through``: parameter → the value whose users stand for its own
    (the last of the copies it flows through alone: shard_map's form)."""
    read: dict[int, set[ShardFormat]] = {}
    for param in params:
        value = (through or {}).get(param.name, param.name)
        users = set(graph.successors(value))
        inside = users & plan.ops.keys()
        if isinstance(param.shape, ArrayShape) and inside and (inside != users) == weights:
            read[param.param_number] = set().union(*(
                plan.ops[u].formats_reading(graph.comp[u], value)
                for u in inside))
    return read


def collect_leaves(module: Module, comp: Computation, candidates: list[GradientAllReduce]
                   ) -> tuple[list[Leaf], list[tuple[GradientAllReduce, str]]]:
    """Leaves of the candidate all-reduces in ``comp``, and the all-reduces rejected as a
    whole (with the reason)."""
    users = users_map(comp)
    leaves: list[Leaf] = []
    rejected: list[tuple[GradientAllReduce, str]] = []
    for ar in candidates:
        inst, groups = comp[ar.name], ar.groups
        if groups is None:
            raise ValueError(f"%{ar.name} is not a candidate: {ar.reason}")
        if isinstance(inst.shape, ArrayShape):
            leaves.append(Leaf(ar.name, None, (ar.name,), inst.operands[0], inst.shape, groups))
            continue
        user_insts = [comp[u] for u in users[ar.name]]
        if any(u.opcode != "get-tuple-element" for u in user_insts) or \
                comp.root_name == ar.name:
            rejected.append((ar, "the tuple result is used whole (not through "
                                 "get-tuple-element)"))
            continue
        for index, (operand, shape) in enumerate(zip(inst.operands, shape_elements(inst))):
            values = tuple(u.name for u in user_insts if u.int_attr("index") == index)
            leaves.append(Leaf(ar.name, index, values, operand, shape, groups))
    return leaves, rejected


def shape_elements(inst: Instruction) -> tuple[ArrayShape, ...]:
    """The array elements of a tuple-shaped ``inst`` (a candidate all-reduce, a root
    tuple of arrays: a nested tuple there is a bug, raised)."""
    shape = inst.shape
    if not isinstance(shape, TupleShape) or \
            not all(isinstance(e, ArrayShape) for e in shape.elements):
        raise TypeError(f"%{inst.name} is not a tuple of arrays")
    return cast(tuple[ArrayShape, ...], shape.elements)


def is_integer_sum(leaf: Leaf) -> bool:
    """A sum of integers: a count or a metric's total (a confusion matrix carried beside
    the weights), never a gradient (jax differentiates floats only)."""
    return leaf.shape.is_integer


def _leaf_filter(leaf: Leaf, options: RegionOptions) -> Whole | None:
    shape = leaf.shape
    if shape.element_type in ("token", "opaque") or shape.dynamic:
        return Whole(ReasonCode.NOT_STATIC, "not a static array")
    if shape.num_elements <= 1:
        count = f"{shape.num_elements} element{'s' if shape.num_elements != 1 else ''}"
        return Whole(ReasonCode.NOTHING_TO_SHARD,
                     f"{'scalar' if shape.is_scalar else count}: nothing to shard")
    if is_integer_sum(leaf):
        return Whole(ReasonCode.INTEGER_SUM, f"an integer sum ({shape.element_type}: a count "
                     f"or a metric's total): not a gradient")
    if shape.byte_size < options.min_shard_bytes:
        return Whole(ReasonCode.BELOW_MIN_SHARD_BYTES, f"smaller than --min-shard-bytes "
                     f"({shape.byte_size} < {options.min_shard_bytes})")
    if not leaf.values:
        return Whole(ReasonCode.UNUSED, "result unused")
    return None


def summing_levels(comp: Computation, leaves: Sequence[Leaf]) -> dict[str, int]:
    """Leaf label → how many of ``leaves``' sums its per-device value is computed from,
    one after the other at most (0: none, the usual step): leaves of one level are
    computed from none of each other's sums, so a bucket of them closes no dependency
    cycle (one walk down the computation)."""
    summed = {leaf.all_reduce for leaf in leaves}
    level: dict[str, int] = {}
    for inst in topological_order(comp):
        above = max((level.get(o, 0) for o in inst.operands), default=0)
        level[inst.name] = above + (inst.name in summed)
    return {leaf.label: level.get(leaf.operand, 0) for leaf in leaves}


def plan_region(module: Module, comp: Computation, leaves: Sequence[Leaf],
                replication: Replication, options: RegionOptions = RegionOptions()
                ) -> RegionPlan:
    """Grow the region from the eligible ``leaves`` (same groups), drop leaves that move
    no work, and choose leaf formats that minimise formatting copies. The inputs are not
    changed: the plan's :class:`PlannedLeaf` records hold the decisions.

    Element orders are tried per leaf on its *component* only (the leaves whose region
    can meet its own), so choosing the orders costs the size of the region, not
    leaves × computation."""
    groups = leaves[0].groups
    # The trial state, leaf index → its element order and why it stays whole (None: sharded).
    reasons = {i: _leaf_filter(leaf, options) for i, leaf in enumerate(leaves)}
    formats = {i: ShardFormat.of(leaf.shape, groups.size) for i, leaf in enumerate(leaves)}
    planner = _Planner(module, comp, replication, groups, leaves, options)
    for i, why in planner.statistics().items():
        reasons[i] = reasons[i] or why
    for i, why in planner.read_by_no_update().items():
        reasons[i] = reasons[i] or why
    for i, why in planner.read_by_non_neutral_reductions().items():
        reasons[i] = reasons[i] or why
    planner.stop_at([leaf for i, leaf in enumerate(leaves) if not reasons[i]])
    plan = planner.grow(formats, reasons)
    # A leaf whose region is empty in its stored order may have one in another order
    # (a reshape that keeps only the row-major order).
    idle = [i for i, leaf in enumerate(plan.leaves) if leaf.sharded and leaf.ops_moved == 0]
    scopes = planner.components(_sharded(reasons)) if idle else {}
    for i in idle:
        stored = formats[i]
        for perm in _candidate_orders(leaves[i].shape):
            formats[i] = ShardFormat.of(leaves[i].shape, groups.size, perm)
            if scopes[i].planned(planner.grow(formats, reasons, scopes[i]), i).ops_moved > 0:
                break
        else:
            formats[i] = stored
    if idle:
        plan = planner.grow(formats, reasons)
    # Leaves whose region is still empty gain nothing (reduce-scatter + all-gather is the
    # all-reduce again).
    while any(leaf.sharded and leaf.ops_moved == 0 for leaf in plan.leaves):
        for i, leaf in enumerate(plan.leaves):
            if leaf.sharded and leaf.ops_moved == 0:
                reasons[i] = _idle_reason(planner, plan, leaf)
        plan = planner.grow(formats, reasons)
    # Leaves whose region needs transposes: try the other element orders, keep the best.
    # A leaf's copies are those of its latest plan: the whole computation's, then (once a
    # leaf of its component chose) the component's in the orders chosen so far.
    scopes = planner.components(_sharded(reasons))
    copies = {i: leaf.formatting_copies for i, leaf in enumerate(plan.leaves)}
    changed = False
    for i, candidate in enumerate(leaves):
        if reasons[i] or copies[i] == 0:
            continue
        scope = scopes[i]
        stored = best = formats[i]
        best_plan = planner.grow(formats, reasons, scope)
        best_cost = planner.cost(best_plan)
        for perm in _candidate_orders(candidate.shape):
            formats[i] = ShardFormat.of(candidate.shape, groups.size, perm)
            if formats[i] == stored:
                continue
            other = planner.grow(formats, reasons, scope)
            other_cost = planner.cost(other)
            if other_cost < best_cost and \
                    all(active.ops_moved > 0 for active in other.active):
                best, best_cost, best_plan = formats[i], other_cost, other
        formats[i] = best
        copies.update(zip(scope.members, (p.formatting_copies for p in best_plan.leaves)))
        changed |= best != stored
    return planner.grow(formats, reasons) if changed else plan


def _sharded(reasons: dict[int, Whole | None]) -> list[int]:
    return [i for i, reason in reasons.items() if not reason]


def _idle_reason(planner: _Planner, plan: RegionPlan, leaf: PlannedLeaf) -> Whole:
    """Why a gradient moves no work: the fusions reading it say which op of their body
    stops them (XLA's optimized modules fuse the whole update)."""
    ctx = _Context(planner.module, planner.comp, planner.replication, planner.groups.size,
                   dict(plan.sharded), planner.laid_out, planner.fusions)
    stops = [f"fusion %{user}: {why}" for value in leaf.values
             for user in dict.fromkeys(planner.graph.successors(value))
             if planner.comp[user].opcode == "fusion"
             and isinstance(why := fusion_access(ctx, planner.comp[user]), str)]
    why = "all users need the full gradient"
    if stops:
        why = "; ".join(stops[:2]) + (f"; {len(stops) - 2} more" if len(stops) > 2 else "")
    else:  # which users: a tuple by what reads it (a conditional's operands, in XLA's
        # fused modules, where a lax.cond of the update takes the gradients)
        users = [user for value in leaf.values
                 for user in dict.fromkeys(planner.graph.successors(value))
                 if user not in leaf.values]
        if users:
            why += ": " + ", ".join(_user_words(planner, user) for user in users[:2]) + \
                (f", {len(users) - 2} more" if len(users) > 2 else "")
        if any(_conditional_reader(planner, user) for user in users):
            return Whole(ReasonCode.NO_UPDATE_WORK,
                         f"its update runs in a conditional's branches (a lax.cond of the "
                         f"update) that may not all run whichever is taken (an effect, a "
                         f"collective, a loop: conditional-speculation), which the pass "
                         f"does not shard into ({why})")
    return Whole(ReasonCode.NO_UPDATE_WORK, f"no update work downstream ({why})")


def _conditional_reader(planner: _Planner, user: str) -> bool:
    """``user`` is a conditional, or a tuple a conditional reads (its operands): found
    once per tuple, which each of its n elements asks about."""
    inst = planner.comp[user]
    if inst.opcode != "tuple":
        return inst.opcode == "conditional"
    if user not in planner.conditional_tuples:
        planner.conditional_tuples[user] = any(
            planner.comp[r].opcode == "conditional" for r in planner.graph.successors(user))
    return planner.conditional_tuples[user]


def _user_words(planner: _Planner, user: str) -> str:
    """``%user (opcode)``; a tuple with (the first) instruction that reads it."""
    opcode = planner.comp[user].opcode
    reader = next(iter(planner.graph.successors(user)), None) if opcode == "tuple" else None
    return f"%{user} ({opcode}" + \
        (f" read by %{reader} ({planner.comp[reader].opcode})" if reader else "") + ")"


def _candidate_orders(shape: ArrayShape) -> list[tuple[int, ...]]:
    """Element orders worth trying for a gradient: every order up to rank 3, else
    row-major and the stored order."""
    if shape.rank <= 3:
        return list(itertools.permutations(range(shape.rank)))
    return [tuple(range(shape.rank)), tuple(reversed(shape.minor_to_major()))]


@dataclass(frozen=True)
class _Scope:
    """Where a trial of one leaf's element order is grown: the sharded leaves whose
    regions can meet its own (indices into the planner's leaves), and the instructions
    those regions can reach, in order."""

    members: tuple[int, ...]
    order: tuple[Instruction, ...]
    #: Value → the component whose sharded leaves it is computed from
    #: (:data:`_SEVERAL`: more than one), shared by every scope of one
    #: :meth:`_Planner.components` call; this scope's component is ``component``.
    computed_from: Mapping[str, int]
    component: int

    def planned(self, plan: RegionPlan, index: int) -> PlannedLeaf:
        """Leaf ``index`` in ``plan``, a plan grown over this scope."""
        return plan.leaves[self.members.index(index)]

    def foreign(self, name: str) -> bool:
        """``name`` is computed from sharded leaves of another scope (a global norm's
        other terms): a trial of this scope, where those leaves are not sharded, does
        not search behind it for replicated reductions to pull in — what it would find
        is the same in every trial of this scope, and searching it costs leaves ×
        region."""
        return self.computed_from.get(name, self.component) != self.component


#: A value computed from the sharded leaves of more than one scope.
_SEVERAL = -1


class _Planner:
    """Grows region plans over one computation. What does not change between trials —
    the dataflow graph, the topological order, the ancestors of the gradients — is
    computed once."""

    def __init__(self, module: Module, comp: Computation, replication: Replication,
                 groups: DeviceGroups, leaves: Sequence[Leaf], options: RegionOptions) -> None:
        self.module, self.comp, self.replication, self.groups = module, comp, replication, groups
        self.leaves, self.options = leaves, options
        self.params = comp.parameters() if options.keep_state_orders else []
        self.param_named = {param.name: param for param in self.params}
        self.param_numbered = {param.param_number: param for param in self.params}
        self.graph = dataflow_graph(comp)
        self.laid_out = is_laid_out(module)
        self.fusions = FusionMemo()
        self.order = topological_order(comp)
        self.index = {inst.name: i for i, inst in enumerate(self.order)}
        self._ancestors: dict[tuple[str, ...], set[str]] = {}
        #: Trials (a component's leaves) stop at the ancestors of every candidate
        #: gradient (:meth:`stop_at`: those the filters let through); full plans at those
        #: of exactly their sharded leaves.
        self.all_ancestors: set[str] = set()
        #: Tuple → whether a conditional reads it (:func:`_conditional_reader`).
        self.conditional_tuples: dict[str, bool] = {}

    def stop_at(self, candidates: Sequence[Leaf]) -> None:
        """Let trials stop at the ancestors of ``candidates``."""
        self.all_ancestors = self.ancestors_of_gradients(candidates)

    def statistics(self) -> dict[int, Whole]:
        """Leaf index → why it stays whole, for the leaves another leaf's per-device value
        is computed from: batch statistics (BatchNorm's mean and variance over the data
        axis, their gradients' sums in the backward pass), not weight updates. Sharding
        one would put its all-gather — and so everything downstream of it, the forward
        and backward pass — after its reduce-scatter, which a bucket shares with the
        gradients computed from it: a dependency cycle. The update region ends there.
        Not through a weight's next value (:attr:`RegionOptions.next_value_outputs`):
        a gradient whose updated weight the step reads again is an update's; the
        lowering's buckets keep it apart from the gradients computed from it
        (:func:`summing_levels`). Nor through a weight's earlier versions
        (:attr:`weight_versions`): flax's PPO updates the weights once per minibatch
        in one step, each minibatch's gradient computed from the weights the previous
        one updated.

        One walk up from every leaf's operand, each node labelled with the first
        all-reduce that reached it (linear in the computation)."""
        updated = self.weight_versions
        fed = self._first_above(((leaf.operand, leaf.label) for leaf in self.leaves),
                                lambda name: name not in updated)
        return {i: Whole(ReasonCode.FEEDS_GRADIENTS, f"%{label} is computed from it: a "
                         f"value of the forward/backward pass (a batch statistic, a sum "
                         f"summed again, a gradient the step takes another gradient at, "
                         f"as SAM's ascent step), not an update's; kept all-reduced, the "
                         f"update region ends here")
                for i, label in fed.items()}

    def _first_above(self, starts: Iterable[tuple[str, str]],
                     through: Callable[[str], bool] = lambda _: True) -> dict[int, str]:
        """Leaf index → the label of the first of ``starts`` (value, label) found at or
        above one of the leaf's values: one walk up from them all, each value labelled
        by the first start that reaches it (a value ``through`` refuses is labelled but
        not walked past). Linear in the computation."""
        label: dict[str, str] = {}
        stack = list(starts)
        while stack:
            name, mark = stack.pop()
            if name in label:
                continue
            label[name] = mark
            if through(name):
                stack.extend((p, mark) for p in self.graph.predecessors(name)
                             if p not in label)
        found = {i: next((label[v] for v in leaf.values if v in label), None)
                 for i, leaf in enumerate(self.leaves)}
        return {i: mark for i, mark in found.items() if mark is not None}

    @functools.cached_property
    def weight_versions(self) -> frozenset[str]:
        """The next values (:attr:`next_values`) and a weight's or state's earlier
        versions, where the step updates it more than once: each value computed in the
        leaf's shape from a parameter the aliases pair with a next value, from which a
        next value is computed in that shape, neither through a gradient's sum. A value
        of the forward pass is not one (it reaches a next value only through a
        gradient's sum, or in another shape), nor is a batch statistic (computed from
        the sum, not from the running average's parameter). Two walks, one down from
        those parameters and one up from the next values (linear in the computation)."""
        next_values = self.next_values
        if not next_values:
            return frozenset()
        sums = {value for leaf in self.leaves for value in leaf.values}
        aliases = self.module.output_aliases()
        numbers = {aliases[k] for k in self.options.next_value_outputs if k in aliases}
        starts = [p.name for p in self.comp.parameters() if p.parameter_number in numbers]
        below = self._same_shape_walk(starts, self.graph.successors, sums)
        above = self._same_shape_walk(next_values, self.graph.predecessors, sums)
        return frozenset(below & above) | frozenset(next_values)

    def _same_shape_walk(self, starts: Sequence[str], step: Callable[[str], Iterable[str]],
                         sums: AbstractSet[str]) -> set[str]:
        """What ``step`` (users or operands) reaches from ``starts`` through values of
        each start's own array shape (or tuples holding one: a fusion's outputs), not
        through ``sums``. Each value's shapes are read once (a root tuple is reached
        from every weight)."""
        comp = self.comp
        shapes: dict[str, set[tuple[int, ...]]] = {}

        def dims_of(name: str) -> set[tuple[int, ...]]:
            found = shapes.get(name)
            if found is None:
                found = shapes[name] = _leaf_dims(comp[name].shape)
            return found

        seen: set[tuple[str, tuple[int, ...]]] = set()
        stack = [(name, dims) for name in starts for dims in dims_of(name)]
        while stack:
            name, dims = stack.pop()
            if (name, dims) in seen:
                continue
            seen.add((name, dims))
            stack.extend((other, dims) for other in step(name)
                         if other not in sums and dims in dims_of(other))
        return {name for name, _ in seen}

    @functools.cached_property
    def next_values(self) -> tuple[str, ...]:
        """The root's values at :attr:`RegionOptions.next_value_outputs`."""
        root = self.comp.root
        return tuple(root.operands[k] for k in sorted(self.options.next_value_outputs)
                     if root.opcode == "tuple" and k < len(root.operands))

    def read_by_no_update(self) -> dict[int, Whole]:
        """Leaf index → why it stays whole, for the leaves from which no weight's or
        state's next value is computed (:attr:`RegionOptions.next_value_outputs`, where
        the module names them): a value of the forward pass the partitioner summed (a
        gather of a sharded operand: CLIP's label logits) that only a loss or a metric
        the step returns reads, not a gradient (one walk up from those outputs)."""
        targets = self.next_values
        if not targets:
            return {}
        updated = upstream(self.graph, targets) | set(targets)
        return {i: Whole(ReasonCode.NO_UPDATE_WORK,
                         "no weight's or state's next value is computed from it (a loss or a "
                         "metric the step returns reads it): a value of the forward pass, "
                         "not a gradient")
                for i, leaf in enumerate(self.leaves)
                if not any(value in updated for value in leaf.values)}

    def read_by_non_neutral_reductions(self) -> dict[int, Whole]:
        """Leaf index → why it stays whole, for the leaves a reduction reads (through
        anything) whose initial value is not its reducer's neutral element
        (``lax.reduce(g * g, 1.0, add)``): XLA applies such a value once per partial
        result of its emitter's choosing, so the result depends on how the reduction's
        operand is computed and laid out, and any rewrite upstream of it may change it.
        One walk up from those reductions (none in the usual step)."""
        reductions = [inst.name for inst in self.order
                      if _reduces_from_non_neutral(self.module, self.comp, inst)]
        read = self._first_above((operand, name) for name in reductions
                                 for operand in self.comp[name].operands)
        return {i: Whole(ReasonCode.NON_NEUTRAL_INIT,
                         f"%{reader} reduces it from an initial value that is not its "
                         f"reducer's neutral element: XLA applies that value once per "
                         f"partial result of its own choosing, so the result depends on "
                         f"how its operand is computed; kept all-reduced, the update as it "
                         f"is")
                for i, reader in read.items()}

    def ancestors_of_gradients(self, active: Sequence[Leaf]) -> set[str]:
        """The per-device gradients of ``active`` and everything they are computed from."""
        key = tuple(leaf.operand for leaf in active)
        if key not in self._ancestors:
            self._ancestors[key] = upstream(self.graph, key) | set(key)
        return self._ancestors[key]

    def cost(self, plan: RegionPlan) -> tuple[int, float]:
        """What the choice of element orders minimises: first the optimizer state the
        plan keeps from staying sharded (with ``keep_state_orders``), then the elements
        its formatting transposes move."""
        return self.state_orders_lost(plan), plan.formatting_cost

    def state_orders_lost(self, plan: RegionPlan) -> int:
        """Parameters read only by the region in no single flattenable order, and the
        outputs aliased to region-only parameters whose format is not flattenable: state
        ``--state sharded`` would have to keep whole."""
        if not self.options.keep_state_orders:
            return 0
        read = region_read_parameters(self._params_read_by(plan), self.graph, plan)
        root = self.comp.root
        lost = 0
        for number, formats in read.items():
            fmt = next(iter(formats))
            param_shape = self.param_numbered[number].shape
            lost += len(formats) != 1 or not (isinstance(param_shape, ArrayShape)
                                              and flattenable(fmt, param_shape))
        outputs = root.shape.elements if root.opcode == "tuple" and \
            isinstance(root.shape, TupleShape) else ()
        for number, k in self.options.state_outputs:
            value = root.operands[k] if number in read and k < len(outputs) else None
            if value is not None and value in plan.sharded:
                out_shape = outputs[k]
                lost += not (isinstance(out_shape, ArrayShape)
                             and flattenable(plan.sharded[value], out_shape))
        return lost

    def _params_read_by(self, plan: RegionPlan) -> list[Instruction]:
        """The parameters that ops of ``plan`` read: no other can be read by the region
        alone, and a trial's plan (one scope's) reads few of the computation's."""
        return [self.param_named[pred] for pred in dict.fromkeys(
            pred for name in plan.ops for pred in self.graph.predecessors(name))
            if pred in self.param_named]

    def grow(self, formats: dict[int, ShardFormat], reasons: dict[int, Whole | None],
             scope: _Scope | None = None) -> RegionPlan:
        """The plan for the leaves in ``formats`` / ``reasons`` (index → element order,
        why it stays whole or None), over ``scope`` (default: the whole computation)."""
        indices = range(len(self.leaves)) if scope is None else scope.members
        leaves = [PlannedLeaf.of(self.leaves[i], formats[i], reasons[i]) for i in indices]
        if scope is None:
            return _grow(self, leaves, self.order, self.ancestors_of_gradients(
                [leaf for leaf in leaves if leaf.sharded]))
        return _grow(self, leaves, scope.order, self.all_ancestors, scope.foreign)

    def components(self, sharded: list[int]) -> dict[int, _Scope]:
        """Leaf index → its scope, for the ``sharded`` leaves. Reach follows users whose
        opcode has a region rule, so what ends the region (the root tuple, a dot) couples
        nothing; nor does a value of at most one element (a global norm's partial sums,
        a loss scale), which no element order can change: it joins the scope of every
        leaf that reaches it and reach stops there. Otherwise one clip-by-global-norm
        would make every gradient one scope, and choosing each leaf's order would cost
        leaves × region."""
        parent = list(range(len(sharded)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[str, int] = {}
        scalars: dict[str, list[int]] = {}
        for i, index in enumerate(sharded):
            stack = list(self.leaves[index].values)
            while stack:
                name = stack.pop()
                if name in owner:
                    parent[find(owner[name])] = find(i)
                    continue
                owner[name] = i
                for user in self.graph.successors(name):
                    inst = self.comp[user]
                    if inst.opcode not in RULES:
                        continue
                    if _at_most_one_element(inst.shape):
                        scalars.setdefault(user, []).append(i)
                    else:
                        stack.append(user)
        orders: dict[int, list[Instruction]] = {}
        members: dict[int, list[int]] = {}
        for i, index in enumerate(sharded):
            members.setdefault(find(i), []).append(index)
        for inst in self.order:
            if inst.name in owner:
                orders.setdefault(find(owner[inst.name]), []).append(inst)
            elif inst.name in scalars:
                for root in dict.fromkeys(find(i) for i in scalars[inst.name]):
                    orders.setdefault(root, []).append(inst)
        computed_from = self._computed_from(
            {value: find(i) for i, index in enumerate(sharded)
             for value in self.leaves[index].values})
        return {index: _Scope(tuple(members[find(i)]), tuple(orders[find(i)]), computed_from,
                              find(i))
                for i, index in enumerate(sharded)}

    def _computed_from(self, seeds: dict[str, int]) -> dict[str, int]:
        """Value → the one component among ``seeds`` (leaf value → component) it is
        computed from, or :data:`_SEVERAL`; values computed from none are absent. One
        walk in program order."""
        label: dict[str, int] = {}
        for inst in self.order:
            own = seeds.get(inst.name)
            if own is None:
                found = {label[o] for o in inst.operands if o in label}
                own = found.pop() if len(found) == 1 else (_SEVERAL if found else None)
            if own is not None:
                label[inst.name] = own
        return label


def _at_most_one_element(shape: Shape) -> bool:
    return isinstance(shape, ArrayShape) and shape.num_elements <= 1


def _grow(planner: _Planner, leaves: list[PlannedLeaf], order: Sequence[Instruction],
          upstream_of_gradients: set[str],
          foreign: Callable[[str], bool] | None = None) -> RegionPlan:
    comp, graph = planner.comp, planner.graph
    active = [leaf for leaf in leaves if leaf.sharded]
    sharded: dict[str, ShardFormat] = {}
    ops: dict[str, RegionOp] = {}
    ctx = _Context(planner.module, comp, planner.replication, planner.groups.size, sharded,
                   planner.laid_out, planner.fusions)
    for leaf in active:
        for value in leaf.values:
            sharded[value] = leaf.format
    leaf_values = set(sharded)
    reading = sharded.keys()
    for inst in order:
        if inst.name in leaf_values or reading.isdisjoint(inst.operands):
            continue
        op = classify(ctx, inst)
        if op is not None:
            ops[inst.name] = op
            if op.result_format is not None:
                sharded[inst.name] = op.result_format
    if active:
        _pull_reductions(ctx, ops, graph, upstream_of_gradients, planner.index, foreign)
        _pull_producers(ctx, ops, graph)
        ops = {name: ops[name] for name in sorted(ops, key=planner.index.__getitem__)}
    plan = RegionPlan(comp.name, planner.groups,
                      active[0].all_reduce if active else leaves[0].all_reduce, tuple(leaves),
                      sharded, ops, _boundaries(comp, graph, sharded, ops))
    return _account(comp, graph, plan, ctx)


def _pull_reductions(ctx: _Context, ops: dict[str, RegionOp], graph: DataflowGraph,
                     upstream_of_gradients: set[str], index: dict[str, int],
                     foreign: Callable[[str], bool] | None = None) -> None:
    """One-element reductions of replicated values whose result feeds the region (LAMB's
    weight norm) become masked local reductions of a slice. The search for what feeds
    the region stops at the gradients' ancestors: a reduction behind one of them is one
    too, and never pulled; in a scope's trial also at what ``foreign`` says is computed
    from other scopes' gradients (what lies behind it is the same in every trial of the
    scope)."""
    feeds = upstream(graph, ops, upstream_of_gradients, foreign)
    reductions = [name for name in feeds if ctx.comp[name].opcode == "reduce" and name not in ops]
    for name in sorted(reductions, key=index.__getitem__):
        inst = ctx.comp[name]
        if not ctx.replicated(name):
            continue
        source = _array(ctx.inst(inst.operands[0]).shape)
        if source is None or source.num_elements < ctx.n:
            continue
        op = classify(ctx, inst)
        if op is not None:
            ops[name] = replace(op, pulled=True)


def upstream(graph: DataflowGraph, starts: Iterable[str],
             stop: AbstractSet[str] = frozenset(),
             stops: Callable[[str], bool] | None = None) -> set[str]:
    """Every strict ancestor of any of ``starts`` (one traversal for all of them), not
    searching past (nor including) the names in ``stop`` or those ``stops`` says."""
    comp = graph.comp
    found: set[str] = set()
    stack = [operand for start in starts for operand in comp[start].operands]
    while stack:
        name = stack.pop()
        if name not in found and name not in stop and not (stops and stops(name)):
            found.add(name)
            stack.extend(comp[name].operands)
    return found


def _pull_producers(ctx: _Context, ops: dict[str, RegionOp], graph: DataflowGraph) -> None:
    """Replicated producers whose every user consumes them in the region, in one format,
    run on shards too (AdamW's ``w * weight_decay``). A worklist: a producer is looked at
    again only when one of its users joins the region."""
    comp, sharded = ctx.comp, ctx.sharded
    work = list(ops)
    while work:
        name = work.pop()
        op = ops[name]
        for index, operand in enumerate(comp[name].operands):
            if operand in sharded or operand in ops:
                continue
            producer = comp[operand]
            shape = _array(producer.shape)
            read_as = op.format_of(index)
            if producer.opcode not in _PULLABLE or shape is None or shape.is_scalar \
                    or shape.dims != read_as.dims or operand == comp.root_name \
                    or not ctx.replicated(operand):
                continue
            if any(u not in ops or ops[u].formats_reading(comp[u], operand) != {read_as}
                   for u in graph.successors(operand)):
                continue
            operand_format = _operand_format_for(producer, comp, read_as)
            if operand_format is None or not _operands_fit(ctx, producer, operand_format):
                continue
            kind = OpKind.VIEW if producer.opcode in VIEW_OPCODES else OpKind.ELEMENTWISE
            ops[operand] = RegionOp(kind, operand_format, read_as, pulled=True)
            sharded[operand] = read_as
            work.append(operand)


def _boundaries(comp: Computation, graph: DataflowGraph, sharded: Mapping[str, ShardFormat],
                ops: Mapping[str, RegionOp]) -> dict[str, tuple[str, ...]]:
    boundary: dict[str, tuple[str, ...]] = {}
    for name in sharded:
        outside = tuple(u for u in dict.fromkeys(graph.successors(name)) if u not in ops)
        if comp.root_name == name:
            outside += ("",)
        if outside:
            boundary[name] = outside
    return boundary


def _account(comp: Computation, graph: DataflowGraph, plan: RegionPlan,
             ctx: _Context) -> RegionPlan:
    """``plan`` with, per sharded leaf, the region ops it reaches (plus pulled producers
    feeding them), its formatting copies, and the elementwise work saved on the other
    N-1 shards' behalf."""
    region = set(plan.ops)
    copies_of = _formatting_copies(comp, plan, ctx)
    leaves: list[PlannedLeaf] = []
    for leaf in plan.leaves:
        if not leaf.sharded:
            leaves.append(leaf)
            continue
        reached: set[str] = set()
        stack = list(leaf.values)
        while stack:
            for user in graph.successors(stack.pop()):
                if user in region and user not in reached:
                    reached.add(user)
                    stack.append(user)
        frontier = list(reached)
        while frontier:
            for producer in graph.predecessors(frontier.pop()):
                if producer in region and producer not in reached and plan.ops[producer].pulled:
                    reached.add(producer)
                    frontier.append(producer)
        leaves.append(replace(
            leaf, ops_moved=len(reached),
            formatting_copies=sum(copies_of.get(n, (0, 0.0))[0]
                                  for n in reached | set(leaf.values)),
            saved_flops=sum(plan.ops[n].operand_format.elements for n in reached) *
            (1 - 1 / ctx.n)))
    return replace(plan, leaves=tuple(leaves),
                   formatting_copies=sum(count for count, _ in copies_of.values()),
                   formatting_cost=sum(moved for _, moved in copies_of.values()))


def _formatting_copies(comp: Computation, plan: RegionPlan,
                       ctx: _Context) -> dict[str, tuple[int, float]]:
    """Transposes the rewrite must add: region value → (count, elements moved): gradients
    formatted before the reduce-scatter, replicated operands sliced in another order,
    gathered values moved back. Each moves the whole tensor — XLA:CPU materialises the
    transpose before a dynamic-slice too (measured: slicing three transposed 1024² Adam
    tensors per step made the N=8 step 2.5× slower than one transposed gradient)."""
    copies: dict[str, tuple[int, float]] = {}
    laid_out = ctx.laid_out

    def add(name: str, shape: Shape, fmt: ShardFormat, collective: bool) -> None:
        if isinstance(shape, ArrayShape) and not shape.is_scalar and natural_perm(shape) != fmt.perm:
            count, moved = copies.get(name, (0, 0.0))
            # else only the shard-sized block is transposed
            whole = not blocks_through_collectives(fmt, shape, laid_out) if collective \
                else fmt.block is None
            copies[name] = (count + 1, moved + (fmt.elements if whole else fmt.shard_len))

    for leaf in plan.active:
        add(leaf.values[0], comp[leaf.operand].shape, leaf.format, True)
    for name, op in plan.ops.items():
        for index, operand in enumerate(comp[name].operands):
            if operand not in plan.sharded and not is_scalar_broadcast(comp, operand):
                add(name, comp[operand].shape, op.format_of(index), False)
    for name in plan.boundary:
        add(name, comp[name].shape, plan.sharded[name], True)
    return copies


def is_scalar_broadcast(comp: Computation, name: str) -> bool:
    """``broadcast`` of a scalar: formatted as a ``[shard_len]`` broadcast, no slicing."""
    inst = comp[name]
    operand = comp[inst.operands[0]].shape if inst.opcode == "broadcast" else None
    return isinstance(operand, ArrayShape) and operand.is_scalar


# ------------------------------------------- the pass's facts: gradients, state, loops


def triage(module: Module, found: list[GradientAllReduce], groups: DeviceGroups | None
            ) -> tuple[dict[str, list[GradientAllReduce]],
                       list[tuple[GradientAllReduce, str, ReasonCode | None]]]:
    """The candidate all-reduces per computation the rewrite can reach (the entry and
    training-loop bodies, over the data-parallel group), and the others with why not."""
    regions = _region_computations(module)
    candidates: dict[str, list[GradientAllReduce]] = defaultdict(list)
    rejected: list[tuple[GradientAllReduce, str, ReasonCode | None]] = []
    callers: dict[str, Instruction] | None = None
    for ar in found:
        reason, code = ar.reason, ar.code
        if not reason and ar.computation not in regions:
            callers = _first_callers(module) if callers is None else callers
            caller = callers.get(ar.computation)
            where = f"a computation %{caller.name} ({caller.opcode}) calls" \
                if caller is not None else "a called computation"
            reason = f"inside {where}, which the pass does not shard into (only the " \
                     f"entry and the bodies of its while loops)"
            code = ReasonCode.CALLED_COMPUTATION
        if not reason and (ar.groups is None or groups is None
                           or ar.groups.key() != groups.key()):
            reason = "its groups differ from the data-parallel group of the module" \
                if ar.groups is None or groups is None else \
                (f"its groups, {_in_words(ar.groups)}, differ from the data-parallel "
                 f"group of the module, {_in_words(groups)}")
            code = ReasonCode.OTHER_GROUPS
        if ar.feeds:
            reason = (f"%{ar.feeds} is computed from its slice: a value of the "
                      f"forward/backward pass (an activation's sum the partitioner "
                      f"reduce-scatters), not a weight's gradient; left as it is")
            code = ReasonCode.ACTIVATION_SUM
        if reason:
            rejected.append((ar, reason, code))
        else:
            candidates[ar.computation].append(ar)
    return dict(candidates), rejected


def _first_callers(module: Module) -> dict[str, Instruction]:
    """Computation name → the first instruction (in module order) that calls it: the
    call graph's edges."""
    graph = call_graph(module)
    callers: dict[str, Instruction] = {}
    for caller, callee in graph.edges:
        via: list[str] = graph.edges[caller, callee]["via"]
        callers.setdefault(callee, module.computation(caller)[via[0]])
    return callers


def _in_words(groups: DeviceGroups) -> str:
    """``2 groups of 4 ({0,1,2,3}, …)``: how many, of how many devices, the first (which
    axis of the mesh a collective runs over, where the module names none)."""
    count = len(groups.groups)
    first = "{" + ",".join(map(str, groups.groups[0])) + "}" + (", …" if count > 1 else "")
    return f"{count} group{'s' if count > 1 else ''} of {groups.size} ({first})"


def tuple_index(inst: Instruction) -> int:
    """The element a ``get-tuple-element`` reads."""
    index = inst.int_attr("index")
    if index is None:
        raise HloShardError(f"%{inst.name}: get-tuple-element without index=")
    return index


def proved_array(shape: Shape) -> ArrayShape:
    """``shape``, which the analysis has proved an array (a leaf of the update)."""
    return cast(ArrayShape, shape)


def proved_element(shape: Shape, index: int) -> ArrayShape:
    """Element ``index`` of ``shape``, which the analysis has proved a tuple of arrays
    there (a root or loop carry holding update values)."""
    return proved_array(cast(TupleShape, shape).elements[index])


def called_computation(inst: Instruction, role: str) -> str:
    """The name of the computation ``inst`` calls as ``role`` (``body``, ``condition``)."""
    name = inst.called(role)
    if not name:
        raise HloShardError(f"%{inst.name}: {inst.opcode} without {role}=")
    return name


def data_parallel_groups(module: Module, found: list[GradientAllReduce]) -> DeviceGroups | None:
    """The groups carrying the most bytes of shardable gradients: the data-parallel
    axis. All-reduces the rewrite leaves as they are do not count: on a data × fsdp
    mesh the fsdp-axis all-reduce of a weight's gradient, sliced to the device's rows
    (already sharded), carries more bytes than the data-axis all-reduce of that slice,
    which is the one whose update can be sharded further. Nor do sums a matrix product
    reads (:mod:`~hlo_shard.analysis.matmul_inputs`): on a data × model mesh the model
    axis's sums of activations, which in a scan over layers can outweigh the gradients'
    (where a product reads every sum, all count, as before). Of those, the sums of a
    parameter's dimensions (in any order: the partitioner may sum a gradient computed
    transposed) count first: a gradient has its weight's, while the model
    axes' sums of activations (a tensor-parallel layer's input gradient, which a residual
    add reads rather than a product) have the batch's, and on a data × fsdp × tensor
    mesh they can outweigh the gradients too."""
    candidates = [ar for ar in found if ar.groups is not None and ar.is_candidate]
    if not candidates:
        return None
    several = len({cast(DeviceGroups, ar.groups).key() for ar in candidates}) > 1
    products = matmul_inputs(module) if several else None
    weights = {sorted_dims(leaf) for param in module.entry.parameters()
               for _, leaf in shape_leaves(param.shape)} if several else set()
    gradients: dict[tuple, int] = defaultdict(int)
    unread: dict[tuple, int] = defaultdict(int)
    every: dict[tuple, int] = defaultdict(int)
    first: dict[tuple, DeviceGroups] = {}
    for ar in candidates:
        key = cast(DeviceGroups, ar.groups).key()
        shape = module.computation(ar.computation)[ar.name].shape
        parts = list(enumerate(shape.elements)) if isinstance(shape, TupleShape) \
            else [(None, shape)]
        for index, part in parts:
            every[key] += part.byte_size
            if products is None or not products.reads(ar.computation, ar.name, index):
                unread[key] += part.byte_size
                if sorted_dims(part) in weights:
                    gradients[key] += part.byte_size
        first.setdefault(key, cast(DeviceGroups, ar.groups))
    counted = gradients or unread or every
    return first[max(counted, key=lambda key: counted[key])]


def _region_computations(module: Module) -> set[str]:
    """The entry and every while body reachable from it through while loops only."""
    names = {module.entry.name}
    stack = [module.entry]
    while stack:
        comp = stack.pop()
        for inst in comp.instructions:
            if inst.opcode == "while":
                body = called_computation(inst, "body")
                if body not in names:
                    names.add(body)
                    stack.append(module.computation(body))
    return names


def gradient_sources(module: Module, found: list[GradientAllReduce]) -> dict[str, set[str]]:
    """Per computation: the instructions producing all-reduced gradients — the
    all-reduces themselves, or the loops/calls whose computations contain them."""
    graph = call_graph(module)
    holders = {ar.computation for ar in found}
    # The computations that hold one or call one that does, in one walk up the calls.
    holding = holders | reachable(holders, graph.predecessors)
    sources: dict[str, set[str]] = defaultdict(set)
    for ar in found:
        sources[ar.computation].add(ar.name)
    for callee in holding:  # the calls are the call graph's edges: no second scan
        for caller in graph.predecessors(callee):
            sources[caller].update(graph.edges[caller, callee]["via"])
    return sources


@dataclass(frozen=True)
class StatePair:
    """Optimizer state kept sharded: its parameter's next value is output ``output``."""

    output: int
    value: str
    format: ShardFormat
    #: The parameter's and the output's original (full) shapes.
    shape: ArrayShape
    output_shape: ArrayShape


def pair_state(module: Module, comp: Computation, plan: RegionPlan, replication: Replication,
                read: dict[int, set[ShardFormat]]
                ) -> tuple[dict[int, StatePair], dict[int, str]]:
    """Parameter number → (output index, region value) for the parameters of ``read``
    (optimizer state, or weights: see :func:`region_read_parameters`) that can stay
    sharded: the region reads the parameter in the format of the output that is its
    next value, and both are in an order the manifest flattens (physical or row-major);
    and, for the other parameters of ``read``, why not. The next value is the output
    the module's input_output_alias names, else the one read from the dependences."""
    root = comp.root
    if root.opcode != "tuple":
        return {}, {}
    params = {p.parameter_number: p for p in comp.parameters()}
    candidates: dict[int, ShardFormat] = {}
    kept_whole: dict[int, str] = {}
    for number, formats in read.items():
        if not replication.is_replicated(comp.name, params[number].name):
            continue
        fmt = next(iter(formats))
        if len(formats) != 1:
            kept_whole[number] = f"the update reads it in {len(formats)} element orders"
        elif not flattenable(fmt, proved_array(params[number].shape)):
            kept_whole[number] = f"the update runs in element order {_order(fmt)}, " \
                                 f"{_not_flattenable(proved_array(params[number].shape))}"
        else:
            candidates[number] = fmt
    outputs: dict[int, str] = {}
    for k, value in enumerate(root.operands):
        out = plan.sharded.get(value)
        if out is not None and flattenable(out, proved_element(root.shape, k)):
            outputs[k] = value
    pairs: dict[int, StatePair] = {}

    def pair(number: int, k: int) -> None:
        pairs[number] = StatePair(k, outputs[k], candidates[number],
                                  proved_array(params[number].shape), proved_element(root.shape, k))

    def fits(number: int, k: int) -> bool:
        param = params[number]
        return plan.sharded[outputs[k]] == candidates[number] and \
            proved_element(root.shape, k).element_type == proved_array(param.shape).element_type

    aliases = module.output_aliases()
    for k, number in aliases.items():
        if number in candidates and k in outputs and fits(number, k):
            pair(number, k)
        elif number in candidates:
            kept_whole[number] = _unpaired_output(plan, root, k, candidates[number])
    # The parameters no alias names (jit writes a bare buffer_donor for the arguments
    # whose output shardings it was not given, next to the others' aliases): read from
    # what each output depends on, the aliased pairs taken already.
    named = set(aliases.values())
    unnamed = [number for number in candidates if number not in named]
    found = _next_values_by_dependence(module, comp, unnamed, outputs, fits, replication,
                                       aliases) if unnamed else {}
    for number, k in found.items():
        pair(number, k)
    kept_whole.update({number: "no output in its element order is its next value alone "
                               "(no input_output_alias to say which)"
                       for number in candidates if number not in pairs and
                       number not in kept_whole})
    return pairs, kept_whole


def _next_values_by_dependence(module: Module, comp: Computation, candidates: Iterable[int],
                               outputs: Mapping[int, str], fits: Callable[[int, int], bool],
                               replication: Replication, aliases: Mapping[int, int]
                               ) -> dict[int, int]:
    """Where no input_output_alias says: parameter number → the output (of ``outputs``,
    where ``fits``) that is its next value, read from what each output depends on
    (``aliases``, output → parameter: the pairs the header names, taken already).

    First through the operands each element is computed from one for one, among every
    replicated entry parameter of a candidate's shape and type (the weights and the
    state alike): an output depending so on one such parameter alone of those not
    assigned yet takes it, and the others then read without it — momentum's new moment
    depends on the moment alone and takes it, then the new weight (``w - lr * m``) is
    left depending on its weight alone. Then through all operands, among the candidates
    left (there every value depends on every weight through the gradients). Either way
    a parameter two outputs claim goes to neither: lion's or momentum's update returned
    as such (``-lr * m``) depends on the moment alone, as the moment's next value does,
    and which of the two is the next value cannot be read from the graph (the moment
    stays whole). Bitsets: one pass over ``comp`` per stage, each output a few mask
    operations per round."""
    root = comp.root
    params = {p.param_number: p for p in comp.parameters()}

    def type_of(shape: Shape) -> tuple | None:
        return (shape.element_type, shape.dims) if isinstance(shape, ArrayShape) else None

    wanted = {number: type_of(params[number].shape) for number in candidates}
    wanted_types = set(wanted.values())
    others = [number for number, param in params.items()
              if number not in wanted and type_of(param.shape) in wanted_types
              and replication.is_replicated(comp.name, param.name)]
    numbers = [*wanted, *others]
    bit = {number: 1 << index for index, number in enumerate(numbers)}
    of_type: dict[tuple | None, int] = defaultdict(int)
    for number in numbers:
        of_type[type_of(params[number].shape)] |= bit[number]
    elements = root.shape.elements if isinstance(root.shape, TupleShape) else ()
    alike = [of_type.get(type_of(element), 0) for element in elements]
    candidate_bits = sum(bit[number] for number in wanted)
    live = (candidate_bits | sum(bit[number] for number in others)) & \
        ~sum(bit.get(number, 0) for number in set(aliases.values()))
    unpaired = {k for k in range(len(root.operands)) if alike[k] and k not in aliases}
    found: dict[int, int] = {}
    for computed_from, scope in ((ElementOperands(module).previous(comp), ~0),
                                 (None, candidate_bits)):
        reads = upstream_bits(comp, {params[number].name: b for number, b in bit.items()},
                              computed_from)
        depends = {k: reads[root.operands[k]] & alike[k] & scope for k in unpaired}
        readers: dict[int, list[int]] = defaultdict(list)  # parameter bit → outputs
        for k, bits in depends.items():
            while bits:
                low = bits & -bits
                readers[low].append(k)
                bits ^= low
        claims: dict[int, set[int]] = defaultdict(set)  # stand until their output pairs
        examine = sorted(unpaired)
        while examine:  # rounds: only outputs reading what the last round assigned
            claimed = set()
            for k in examine:
                matches = depends[k] & live
                if k in unpaired and matches and not matches & (matches - 1):  # one
                    claims[matches].add(k)
                    claimed.add(matches)
            assigned = 0
            for match in claimed:
                if len(claims[match]) != 1:
                    continue
                (k,) = claims[match]
                number = numbers[match.bit_length() - 1]
                if match & candidate_bits:
                    if k not in outputs or not fits(number, k):
                        continue
                    found[number] = k
                live &= ~match
                unpaired.discard(k)
                assigned |= match
            following: set[int] = set()
            while assigned:
                low = assigned & -assigned
                following.update(readers.get(low, ()))
                assigned ^= low
            examine = sorted(following)
    return found


def unsharded_state(module: Module, comp: Computation, plan: RegionPlan,
                     explained: set[int]) -> list[str]:
    """Optimizer state the sharded update does not compute at all, and why: a parameter
    aliased to an output, not read by the forward/backward pass, whose next value needs
    the summed gradients outside the region — a factored statistic such as Adafactor's
    ``v_row``/``v_col`` (the squared gradient reduced along one dimension)."""
    root = comp.root
    gradients = {leaf.all_reduce for leaf in plan.leaves if not is_integer_sum(leaf)}
    forward = reachable(gradients, lambda name: comp[name].operands)
    params = {p.parameter_number: p for p in comp.parameters()}
    from hlo_shard.printer import format_shape

    sharded = {leaf.all_reduce for leaf in plan.active}
    found: list[str] = []
    #: Per value: whether it reads a gradient, a sharded one, the first factored statistic
    #: (found once for the whole computation, when a state first asks).
    reach: _GradientReach | None = None
    for k, number in module.output_aliases().items():
        param = params.get(number)
        if param is None or number in explained or param.name in forward \
                or not isinstance(param.shape, ArrayShape) or param.shape.num_elements <= 1 \
                or root.opcode != "tuple" or k >= len(root.operands):
            continue
        value = root.operands[k]
        if value in plan.sharded:
            continue
        reach = reach or _GradientReach.of(comp, plan, gradients, sharded)
        if not reach.reads_gradient(value):
            continue
        why = "its gradient stays all-reduced (see its row)" \
            if not reach.reads_sharded(value) \
            else _factored_reason(comp, plan, reach.first.get(value), reach.stop.get(value))
        found.append(f"optimizer state parameter {number} (%{param.name} "
                     f"{format_shape(param.shape)}) stays whole, computed in full on every "
                     f"device: {why}")
    return found


#: :class:`_GradientReach` bits: a value reads a gradient / a sharded gradient.
_READS_GRADIENT, _READS_SHARDED = 1, 2


@dataclass(frozen=True)
class _GradientReach:
    """What each value of a computation reads upstream, found in one pass over it: a
    gradient of the plan, a sharded one, and the first (in program order) reduction of
    a sharded value that is no scalar (the factored statistic a state may come from)."""

    bits: dict[str, int]
    #: Value → the first such reduction upstream of it (absent: none).
    first: dict[str, str]
    #: Value → the first instruction upstream of it (or itself) outside the region that
    #: reads a value of the region: where the sharded update stops on the way to it.
    stop: dict[str, str]

    @classmethod
    def of(cls, comp: Computation, plan: RegionPlan, gradients: set[str],
           sharded: set[str]) -> _GradientReach:
        with reading_only():  # both passes below walk the same order
            bits = upstream_bits(comp, {
                name: _READS_GRADIENT | (_READS_SHARDED * (name in sharded))
                for name in gradients})
            order = topological_order(comp)
        position = {inst.name: index for index, inst in enumerate(order)}
        first: dict[str, str] = {}
        stop: dict[str, str] = {}
        for inst in order:
            found = [first[o] for o in inst.operands if o in first]
            found += [o for o in inst.operands if _is_statistic(plan, comp[o])]
            if found:
                first[inst.name] = min(found, key=position.__getitem__)
            stops = [stop[o] for o in inst.operands if o in stop]
            if inst.name not in plan.ops and any(o in plan.sharded for o in inst.operands):
                stops.append(inst.name)
            if stops:
                stop[inst.name] = min(stops, key=position.__getitem__)
        return cls(bits, first, stop)

    def reads_gradient(self, value: str) -> bool:
        return bool(self.bits[value] & _READS_GRADIENT)

    def reads_sharded(self, value: str) -> bool:
        return bool(self.bits[value] & _READS_SHARDED)


def _is_statistic(plan: RegionPlan, inst: Instruction) -> bool:
    """A reduction of a sharded value to more than one element, over a dimension of
    more than one (over size-1 dimensions only it is jit's reshape of a bias gradient)."""
    if inst.opcode != "reduce" or inst.operands[0] not in plan.sharded or \
            not isinstance(inst.shape, ArrayShape) or inst.shape.num_elements == 1:
        return False
    return not reduces_unit_dimensions_only(inst, plan.sharded[inst.operands[0]].dims)


def _factored_reason(comp: Computation, plan: RegionPlan, name: str | None,
                     stop: str | None = None) -> str:
    """Why a state computed from a reduction of a sharded gradient along some dimensions
    (a factored statistic, like Adafactor's v_row/v_col) is not itself a shard: its
    reduction ``name`` (the first upstream of the state) cuts the shard's block (summed
    from partial sums, whole on every device), or the shard is no block of the gradient,
    or the reduction is not one the region runs; without such a reduction, where the
    update stops on the way to it (``stop``)."""
    if name is not None:
        inst = comp[name]
        fmt = plan.sharded[inst.operands[0]]
        dims = ",".join(map(str, inst.ints_attr("dimensions")))
        what = f"its next value reduces the gradient along dimension {dims} (%{name}, as " \
               f"Adafactor's factored statistics v_row/v_col do)"
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
    where = f", at %{stop} ({comp[stop].opcode}), which reads its values whole" if stop \
        else " (the gradients' rows say where it stops)"
    return f"its next value is computed after the sharded update ends{where}"


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
    shape = proved_element(root.shape, k) if k < len(root.operands) else None
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


def copy_chains(comp: Computation, graph: DataflowGraph) -> dict[str, list[str]]:
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


@dataclass(frozen=True)
class LoopCarry:
    """Carried slots of one training loop that stay shards across iterations (what
    :func:`~.lowering.shard_loop_carry` rewrites outside the body)."""

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


def loop_slots(module: Module, body: Computation, plan: RegionPlan,
                replication: Replication) -> LoopCarry | None:
    """Slots of the loop running ``body`` whose next value is a region value, whose
    region uses agree on the format, that the condition does not read and whose initial
    value is replicated."""
    callers = [(c, i) for c in module.computations for i in c.instructions
               if body.name in i.called_computations()]
    if len(callers) != 1 or callers[0][1].opcode != "while" or \
            called_computation(callers[0][1], "body") != body.name:
        return None
    parent, loop = callers[0]
    cond = module.computation(called_computation(loop, "condition"))
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
        slot_readers[tuple_index(body[user])].append(user)
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
    return LoopCarry(parent.name, loop.name, body.name, cond.name, slots, inputs, outputs,
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
            used.add(tuple_index(inst))
    return used


# ------------------------------------------------------------- for the cost model


@dataclass(frozen=True)
class UpdateFacts:
    """What the pass reads of a module before editing it: the gradient all-reduces, the
    data-parallel group, which values are replicated, and the all-reduces it may shard
    per computation (those it may not, with why)."""

    found: list[GradientAllReduce]
    groups: DeviceGroups | None
    replication: Replication
    candidates: dict[str, list[GradientAllReduce]]
    rejected: list[tuple[GradientAllReduce, str, ReasonCode | None]]


@dataclass(frozen=True)
class GradientTriage:
    """The gradient all-reduces of a module, its data-parallel groups, and which of the
    all-reduces the pass may shard per computation (the others with why not): what
    :func:`read_update_facts` reads before the replication analysis, and all a caller
    needs to tell there is nothing to analyse."""

    found: list[GradientAllReduce]
    groups: DeviceGroups | None
    candidates: dict[str, list[GradientAllReduce]]
    rejected: list[tuple[GradientAllReduce, str, ReasonCode | None]]


def triage_gradients(module: Module) -> GradientTriage:
    """:class:`GradientTriage` of ``module`` as it is."""
    found = find_gradient_all_reduces(module)
    groups = data_parallel_groups(module, found)
    candidates, rejected = triage(module, found, groups)
    return GradientTriage(found, groups, candidates, rejected)


def read_update_facts(module: Module, overrides: ParamOverrides | None = None,
                      triaged: GradientTriage | None = None) -> UpdateFacts:
    """:class:`UpdateFacts` of ``module`` as it is (its header's device counts included:
    the pass writes back those a header lost before reading); ``triaged``: its
    :func:`triage_gradients`, where the caller has it."""
    triaged = triage_gradients(module) if triaged is None else triaged
    overrides = overrides or ParamOverrides()
    replication = analyze_replication(module, triaged.groups, overrides,
                                      gradient_sources(module, triaged.found))
    candidates, rejected = triaged.candidates, triaged.rejected
    if candidates and not (overrides.pmap_replicated or overrides.replicated) and \
            is_pmap_form(module):
        rejected = rejected + [(gradient, _PMAP_COPIES, ReasonCode.PMAP_COPIES)
                               for found in candidates.values() for gradient in found]
        candidates = {}
    return UpdateFacts(triaged.found, triaged.groups, replication, candidates, rejected)


#: Why a ``jax.pmap`` step's gradients stay all-reduced unless the caller says otherwise.
_PMAP_COPIES = ("a jax.pmap step: every device holds its own copy of the weights and "
                "optimizer state, and the module cannot say the copies are equal (sharding "
                "the update of copies that differ would mix them); install(pmap_replicated="
                "True), or optimize --replicated-params, says they are, as "
                "flax.jax_utils.replicate makes them")


def planned_update_regions(module: Module) -> dict[str, frozenset[str]]:
    """Computation name → the instructions of the update region the pass plans there
    (with its default options, on the module as it is: the facts of
    :func:`read_update_facts`, each computation's leaves and :func:`plan_region`).

    A computation the pass does not apply to — no candidate gradient all-reduce, or
    none whose gradient it could follow (no leaves) — has no entry: the cost model
    then finds the update by its own fallback rule.

    :func:`~hlo_shard.costmodel.step_time.estimate_step` counts these instructions as the
    weight update but never runs this analysis itself: its callers do and hand the result
    in, so an error of the analysis surfaces where it happens instead of silently turning
    the report to its fallback, and the cost model does not depend on the pass."""
    # The analyses below read the same computations, and make many objects but no cycles.
    # They read the module as the pass does: with the device counts a header lost (XLA's
    # pass hook hands modules over without them) recovered, not its groups out of range.
    with reading_only(), cyclic_gc_paused():
        view = with_device_counts(module)
        triaged = triage_gradients(view)
        if not triaged.candidates:
            return {}  # no candidate (a trial sharding every gradient): no analysis to run
        facts = read_update_facts(view, triaged=triaged)
        regions: dict[str, frozenset[str]] = {}
        for name, all_reduces in facts.candidates.items():
            comp = view.computation(name)
            leaves, _ = collect_leaves(view, comp, all_reduces)
            if leaves:
                # (as the pass plans it: an output that is a parameter's next value is an
                # update's, whatever of the step reads it again)
                options = RegionOptions(next_value_outputs=frozenset(
                    view.output_aliases() if comp.is_entry else ()))
                regions[name] = frozenset(
                    plan_region(view, comp, leaves, facts.replication, options).ops)
        return regions


__all__ = [
    "GradientTriage", "Leaf", "LoopCarry", "OpKind", "PlannedLeaf", "RegionOp",
    "RegionOptions", "RegionPlan", "ShardFormat", "StatePair", "UpdateFacts", "VIEW_OPCODES",
    "Whole",
    "blocks_through_collectives", "called_computation", "canonical_perm", "classify",
    "collect_leaves", "copy_chains", "data_parallel_groups", "flattenable",
    "gradient_sources", "is_laid_out", "is_scalar_broadcast", "loop_slots",
    "major_dimension", "natural_perm", "pair_state", "plan_region",
    "planned_update_regions", "proved_array", "proved_element", "read_update_facts",
    "region_read_parameters", "reshape_format", "transpose_operand", "transpose_result",
    "triage", "triage_gradients", "tuple_index", "unsharded_state",
]
