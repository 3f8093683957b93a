"""Structural checks of a module, run after every pass and before ``optimize`` writes.

A rewrite that slips produces text XLA may accept and then compute garbage with
(collective shapes, for one, are not checked by XLA's parser — reference §13.2). These
checks catch that class of slip: def-before-use, unique names, result shapes that agree
with the operands for the opcodes the sharding pass emits (a rule per opcode; opcodes
without a rule are not checked), called computations that fit their callers (calls,
loops, conditionals, fusions, a reduce's reducer), unique collective channel ids,
well-formed replica groups, and a root that matches the entry layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from hlo_shard.errors import HloParseError
from hlo_shard.graph import dependencies
from hlo_shard.ir import (Alias, ArrayShape, Computation, ComputationList, InputOutputAlias,
                          Instruction, Module, Raw, ReplicaGroups, Shape, SliceRanges,
                          TupleShape)
from hlo_shard.opinfo import ALL_REDUCES, CHANNEL_UNIQUE, ELEMENTWISE, SCALAR_OPERANDS
from hlo_shard.printer import format_shape
from hlo_shard.values import read_dim_labels, read_window


@dataclass(frozen=True)
class Problem:
    check: str  # short name of the failed check
    computation: str
    instruction: str
    message: str

    def __str__(self) -> str:
        where = f"%{self.instruction} in %{self.computation}" if self.instruction \
            else f"%{self.computation}"
        return f"{self.check}: {where}: {self.message}"


class _Checker:
    def __init__(self, module: Module, computations: Collection[str] | None = None) -> None:
        self.module = module
        #: The computations whose own checks run (None: all).
        self.computations = computations
        self.problems: list[Problem] = []
        self.comp: Computation | None = None

    def fail(self, check: str, inst: Instruction | None, message: str) -> None:
        self.problems.append(Problem(check, self.comp.name if self.comp else "",
                                     inst.name if inst else "", message))

    def run(self) -> list[Problem]:
        self.channels()
        for comp in self.module.computations:
            self.comp = comp
            if self.computations is None or comp.name in self.computations:
                self.computation(comp)
            else:
                self.header_readers(comp)
        self.comp = None
        self.entry_layout()
        self.aliases()
        return self.problems

    # Per computation ---------------------------------------------------------------
    def computation(self, comp: Computation) -> None:
        seen: set[str] = set()
        for inst in comp.instructions:
            if inst.name in seen:
                self.fail("unique-names", inst, "defined twice")
            needs = dependencies(inst)
            if not seen.issuperset(needs):  # else nothing to say, found in one C loop
                for operand in needs:
                    if operand not in seen:
                        what = "undefined" if operand not in comp else "defined after its use"
                        self.fail("def-before-use", inst, f"operand %{operand} is {what}")
            seen.add(inst.name)
        if comp.root_name is None or comp.root_name not in comp:
            self.fail("root", None, f"root %{comp.root_name} is not an instruction")
        for inst in comp.instructions:
            self.instruction(comp, inst)

    def header_readers(self, comp: Computation) -> None:
        """The checks of ``comp`` that read the module's header (a collective's group
        size, a device id's range): what a computation no pass edited can newly fail."""
        for inst in comp.instructions:
            if _SHAPE_RULES.get(inst.opcode) in _HEADER_READING_RULES \
                    or "replica_groups" in inst.attributes:
                self.instruction(comp, inst)

    def instruction(self, comp: Computation, inst: Instruction) -> None:
        """``inst``'s shape rule and replica groups."""
        if comp.has_all(inst.operands):
            operands = [comp[o].shape for o in inst.operands]
            try:
                message = _SHAPE_RULES.get(inst.opcode, _unchecked)(self, inst, operands)
            except _Unfit as unfit:
                message = str(unfit)
            if message:
                self.fail("shape", inst, message)
        groups = inst.attr("replica_groups")
        if isinstance(groups, ReplicaGroups):
            self.replica_groups(inst, groups)

    def replica_groups(self, inst: Instruction, groups: ReplicaGroups) -> None:
        """XLA's ``CheckReplicaGroups``: no empty group, no device twice, devices
        0..n-1 for the n named, groups of one size (an all-reduce's may differ); and
        devices the header has (a header may have lost its counts: not an input check)."""
        devices = [d for g in groups.groups for d in g]
        named = set(devices)
        if any(not group for group in groups.groups):
            self.fail("group-ids", inst, "an empty group")
        elif len(devices) != len(named):
            self.fail("group-ids", inst, "a device appears in more than one group")
        elif named != set(range(len(named))):
            absent = min(set(range(len(named))) - named)
            self.fail("group-ids", inst,
                      f"the groups name {len(named)} devices but not device {absent}")
        if groups.groups and groups.group_size is None and inst.opcode not in ALL_REDUCES:
            self.fail("group-ids", inst, "groups have different sizes")
        limit = self.module.device_count
        if any(d < 0 or d >= limit for d in devices):
            self.fail("replica-groups", inst, f"device id out of range 0..{limit - 1}")

    # Module-wide -------------------------------------------------------------------------
    def channels(self) -> None:
        seen: dict[int, str] = {}
        for comp in self.module.computations:
            for inst in comp.instructions:
                if inst.opcode not in CHANNEL_UNIQUE:
                    continue
                channel = inst.attr("channel_id")
                if not isinstance(channel, int):
                    continue
                if channel in seen:
                    self.comp = comp
                    self.fail("unique-channel-ids", inst,
                              f"channel_id={channel} is also used by %{seen[channel]}")
                    self.comp = None
                seen[channel] = inst.name

    def entry_layout(self) -> None:
        result = self.module.declared_result()
        if result is None or not self.module.computations:
            return
        entry = self.module.entry
        declared = _strip_layouts(result)
        actual = _strip_layouts(format_shape(entry.root.shape))
        if declared.replace(" ", "") != actual.replace(" ", ""):
            self.problems.append(Problem(
                "entry-layout", entry.name, entry.root.name,
                f"root shape {actual} differs from entry_computation_layout result {declared}"))

    def aliases(self) -> None:
        """``input_output_alias`` as XLA's ``HloInputOutputAliasConfig::Verify`` holds
        it: each entry pairs an array leaf of the entry's result with one of an entry
        parameter, of the same size, and no leaf of either is paired twice."""
        config = self.module.header.get("input_output_alias")
        if not isinstance(config, InputOutputAlias) or not self.module.computations:
            return
        entry = self.module.entry
        parameters = {p.parameter_number: p.shape for p in entry.parameters()}
        outputs: set[tuple[int, ...]] = set()
        inputs: set[tuple[int, tuple[int, ...]]] = set()
        for alias in config.entries:
            message = _alias_problem(alias, entry.root.shape, parameters, outputs, inputs)
            outputs.add(alias.output)
            inputs.add((alias.parameter, alias.parameter_index))
            if message:
                self.problems.append(Problem(
                    "aliases", entry.name, "",
                    f"output {{{','.join(map(str, alias.output))}}} and parameter "
                    f"({alias.parameter}, {{{','.join(map(str, alias.parameter_index))}}}): "
                    f"{message}"))


def _alias_problem(alias: Alias, result: Shape, parameters: dict[int | None, Shape],
                   outputs: set[tuple[int, ...]],
                   inputs: set[tuple[int, tuple[int, ...]]]) -> str:
    """What is wrong with ``alias`` of an entry returning ``result`` and taking
    ``parameters`` (by number), the leaves already paired being ``outputs`` and
    ``inputs`` ("" where nothing is)."""
    output = _array_leaf(result, alias.output)
    if output is None:
        return "the entry's result has no array leaf there"
    parameter = parameters.get(alias.parameter)
    if parameter is None:
        return f"the entry has no parameter {alias.parameter}"
    source = _array_leaf(parameter, alias.parameter_index)
    if source is None:
        return "the parameter has no array leaf there"
    if output.byte_size != source.byte_size:
        return f"{output.byte_size} and {source.byte_size} bytes"
    if alias.output in outputs:
        return "the output is aliased twice"
    if (alias.parameter, alias.parameter_index) in inputs:
        return "the parameter is aliased twice"
    return ""


def _array_leaf(shape: Shape, index: tuple[int, ...]) -> ArrayShape | None:
    """The array at ``index`` of ``shape`` (None where there is none)."""
    for position in index:
        if not isinstance(shape, TupleShape) or not 0 <= position < len(shape.elements):
            return None
        shape = shape.elements[position]
    return shape if isinstance(shape, ArrayShape) else None


def _strip_layouts(text: str) -> str:
    return re.sub(r"\{[^{}]*\}|/\*.*?\*/", "", text)


# ------------------------------------------------------------------------ shape rules

ShapeRule = Callable[[_Checker, Instruction, list[Shape]], "str | None"]


def _unchecked(checker: _Checker, inst: Instruction, operands: list[Shape]) -> None:
    return None


class _Unfit(Exception):
    """A rule met a tuple where it needs an array, or an attribute of the wrong kind;
    reported as a shape problem (the message), never raised out of :func:`validate`."""


def _array(shape: Shape) -> ArrayShape | None:
    return shape if isinstance(shape, ArrayShape) else None


def _dims(shape: Shape) -> tuple[int, ...]:
    if not isinstance(shape, ArrayShape):
        raise _Unfit("a tuple where an array is expected")
    return shape.dims


def _ints(inst: Instruction, name: str, default: tuple[int, ...] = ()) -> tuple[int, ...]:
    value = inst.attributes.get(name, default)
    if not isinstance(value, tuple) or not all(isinstance(v, int) for v in value):
        raise _Unfit(f"{name}= is not a list of integers")
    return value


def _int(inst: Instruction, name: str, default: int | None = None) -> int:
    value = inst.attributes.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Unfit(f"{name}= is missing or not an integer")
    return value


def _one_dimension(inst: Instruction) -> int:
    dims = _ints(inst, "dimensions", (0,))
    if len(dims) != 1:
        raise _Unfit(f"dimensions={list(dims)} must name one dimension")
    return dims[0]


def _elementwise(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    result = _dims(inst.shape)
    for shape in operands:
        if not isinstance(shape, ArrayShape):
            return "operand is a tuple"
        dims = shape.dims
        if dims != result and not (dims == () and inst.opcode in SCALAR_OPERANDS):
            return f"operand dims {list(dims)} differ from result dims {list(result)}"
    if inst.opcode == "compare" and isinstance(inst.shape, ArrayShape) \
            and inst.shape.element_type != "pred":
        return "compare must yield pred"
    return None


def _broadcast(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    dims = _ints(inst, "dimensions")
    source, result = _dims(operands[0]), _dims(inst.shape)
    if len(dims) != len(source):
        return f"dimensions={list(dims)} has {len(dims)} entries for a rank-{len(source)} operand"
    if any(d >= len(result) or result[d] != s for d, s in zip(dims, source)):
        return "operand dims do not match the broadcast dimensions"
    return None


def _same_count(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    source, result = _array(operands[0]), _array(inst.shape)
    if source and result and source.num_elements != result.num_elements:
        return f"{source.num_elements} elements reshaped to {result.num_elements}"
    return None


def _bitcast(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    """XLA's layout-sensitive verifier: a bitcast reinterprets the same bytes."""
    source, result = _array(operands[0]), _array(inst.shape)
    if source and result and source.byte_size != result.byte_size:
        return f"{source.byte_size} bytes bitcast to {result.byte_size}"
    return None


def _transpose(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    perm = _ints(inst, "dimensions")
    source = _dims(operands[0])
    if sorted(perm) != list(range(len(source))):
        return f"dimensions={list(perm)} is not a permutation"
    if tuple(source[p] for p in perm) != _dims(inst.shape):
        return "result dims are not the permuted operand dims"
    return None


def _slice(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    ranges = inst.attr("slice")
    source = _dims(operands[0])
    if not isinstance(ranges, SliceRanges) or len(ranges.ranges) != len(source):
        return "slice ranges do not match the operand rank"
    expected = []
    for (start, limit, stride), size in zip(ranges.ranges, source):
        if not 0 <= start <= limit <= size:
            return f"slice [{start}:{limit}] outside 0..{size}"
        if stride < 1:
            return f"slice [{start}:{limit}:{stride}] has a stride below 1"
        expected.append(-(-(limit - start) // stride))
    if tuple(expected) != _dims(inst.shape):
        return f"result dims should be {expected}"
    return None


def _dot(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    """XLA's ``InferDotOpShape``: contracting and batch dimensions in range, once each,
    of equal sizes on both sides; the result the batch dimensions, then the left's and
    the right's others (a sparse dot's metadata operands: not checked)."""
    if len(operands) != 2:
        return None
    sides = [(_dims(shape), _ints(inst, f"{side}_contracting_dims"),
              _ints(inst, f"{side}_batch_dims")) for shape, side in zip(operands, ("lhs", "rhs"))]
    for (dims, contracting, batch), side in zip(sides, ("lhs", "rhs")):
        named = contracting + batch
        if any(not 0 <= d < len(dims) for d in named) or len(set(named)) != len(named):
            return (f"{side} contracting {list(contracting)} and batch {list(batch)} "
                    f"dimensions must each name one of the {len(dims)} dimensions once")
    (lhs, lhs_contracting, lhs_batch), (rhs, rhs_contracting, rhs_batch) = sides
    for kind, left, right in (("contracting", lhs_contracting, rhs_contracting),
                              ("batch", lhs_batch, rhs_batch)):
        if [lhs[d] for d in left] != [rhs[d] for d in right]:
            return (f"{kind} dimensions of sizes {[lhs[d] for d in left]} and "
                    f"{[rhs[d] for d in right]} differ")
    free = [[size for d, size in enumerate(dims) if d not in contracting + batch]
            for dims, contracting, batch in sides]
    expected = [lhs[d] for d in lhs_batch] + free[0] + free[1]
    if tuple(expected) != _dims(inst.shape):
        return f"result dims should be {expected}"
    return None


def _convolution(checker: _Checker, inst: Instruction, operands: list[Shape]
                 ) -> str | None:
    """``dim_labels`` as XLA reads them, naming the operands' and the result's ranks, and
    a window of one dimension per spatial one (the result's sizes are not checked)."""
    if len(operands) != 2:
        return "a convolution takes two operands"
    try:
        labels = read_dim_labels(inst.attr("dim_labels"))
        window = read_window(inst.attr("window"))
    except ValueError as err:
        return str(err)
    ranks = (len(_dims(operands[0])), len(_dims(operands[1])), len(_dims(inst.shape)))
    if labels.ranks != ranks:
        return (f"dim_labels name {list(labels.ranks)} dimensions where the input, kernel "
                f"and result have {list(ranks)}")
    if window and len(window) != len(labels.input_spatial):
        return (f"the window has {len(window)} dimensions where the convolution has "
                f"{len(labels.input_spatial)} spatial ones")
    return None


def _dynamic_slice(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    sizes = _ints(inst, "dynamic_slice_sizes")
    source = _dims(operands[0])
    indices = operands[1:]
    if len(indices) == len(source):
        types = {s.element_type for s in indices if isinstance(s, ArrayShape)}
        if len(types) > 1:
            return "start indices of different types"
    if sizes != _dims(inst.shape) or len(sizes) != len(source) or any(
            s > d for s, d in zip(sizes, source)):
        return f"dynamic_slice_sizes={list(sizes)} do not fit operand {list(source)}"
    return None


def _pad(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    config = inst.attr("padding")
    source = _dims(operands[0])
    text = config.text if isinstance(config, Raw) else str(config)
    parts = [list(map(int, re.findall(r"-?\d+", p))) for p in text.split("x")] if text else []
    if len(parts) != len(source):
        return "padding config does not match the operand rank"
    expected = []
    for size, config_of_dim in zip(source, parts):
        low, high = config_of_dim[0], config_of_dim[1]
        interior = config_of_dim[2] if len(config_of_dim) > 2 else 0
        expected.append(low + high + size + max(0, size - 1) * interior)
    return None if tuple(expected) == _dims(inst.shape) else f"result dims should be {expected}"


def _concatenate(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    axis = _one_dimension(inst)
    dims = [_dims(s) for s in operands]
    result = _dims(inst.shape)
    if any(len(d) != len(result) for d in dims):
        return "operands of different rank"
    if any(d[:axis] + d[axis + 1:] != result[:axis] + result[axis + 1:] for d in dims) or \
            sum(d[axis] for d in dims) != result[axis]:
        return "result dims are not the concatenation of the operands"
    return None


def _reduce(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    half = len(operands) // 2
    reduced = set(_ints(inst, "dimensions"))
    results = list(inst.shape.elements) if isinstance(inst.shape, TupleShape) else [inst.shape]
    for source, result in zip(operands[:half], results):
        keep = tuple(d for i, d in enumerate(_dims(source)) if i not in reduced)
        if keep != _dims(result):
            return f"reducing {sorted(reduced)} of {list(_dims(source))} gives {list(keep)}"
    return _reducer(checker, inst, operands[half:])


def _iota(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    dim = _int(inst, "iota_dimension", 0)
    return None if 0 <= dim < len(_dims(inst.shape)) else "iota_dimension out of range"


def _gte(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    source = operands[0]
    index = _int(inst, "index")
    if not isinstance(source, TupleShape) or not 0 <= index < len(source.elements):
        return "get-tuple-element index outside the operand tuple"
    if _strip(source.elements[index]) != _strip(inst.shape):
        return "result shape differs from the tuple element"
    return None


def _tuple(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    if not isinstance(inst.shape, TupleShape) or len(inst.shape.elements) != len(operands) \
            or any(_strip(a) != _strip(b) for a, b in zip(inst.shape.elements, operands)):
        return "tuple shape differs from its operands"
    return None


def _callee(checker: _Checker, name: str) -> Computation | None:
    """The computation ``name`` where the module has it with a root (the parser and the
    root check report the others)."""
    if not name or not checker.module.has_computation(name):
        return None
    callee = checker.module.computation(name)
    return callee if callee.root_name is not None and callee.root_name in callee else None


def _takes(checker: _Checker, name: str, operands: list[Shape],
           result: Shape | None) -> str | None:
    """The computation ``name`` takes ``operands`` as its parameters and returns
    ``result`` (None: whatever it returns), layouts aside (XLA's verifier on a call, a
    while's body and condition, a conditional's branches, a fusion)."""
    callee = _callee(checker, name)
    if callee is None:
        return None
    parameters = [p.shape for p in callee.parameters()]
    if len(parameters) != len(operands):
        return f"%{name} takes {len(parameters)} parameters, given {len(operands)}"
    for number, (parameter, operand) in enumerate(zip(parameters, operands)):
        if _strip(parameter) != _strip(operand):
            return (f"parameter {number} of %{name} is {format_shape(parameter)}, given "
                    f"{format_shape(operand)}")
    if result is not None and _strip(callee.root.shape) != _strip(result):
        return f"%{name} returns {format_shape(callee.root.shape)}, not {format_shape(result)}"
    return None


def _call(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    return _takes(checker, inst.called("to_apply"), operands, inst.shape)


def _fusion(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    """The fused parameters are the operands (XLA's verifier does not compare the fused
    root with the fusion's shape, so neither does this)."""
    return _takes(checker, inst.called("calls"), operands, None)


def _while(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    """The loop's state: the operand, the result, the body's parameter and root, and the
    condition's parameter; the condition returns ``pred[]``."""
    if len(operands) != 1:
        return "a while takes one operand"
    if _strip(operands[0]) != _strip(inst.shape):
        return f"the loop state {format_shape(operands[0])} differs from the result"
    message = _takes(checker, inst.called("body"), operands, inst.shape) or \
        _takes(checker, inst.called("condition"), operands, None)
    condition = _callee(checker, inst.called("condition"))
    if message is None and condition is not None:
        root = condition.root.shape
        if _strip(root) != ("pred", ()):
            return f"%{condition.name} returns {format_shape(root)}, not pred[]"
    return message


def _conditional(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    """Branch ``k`` takes operand ``k + 1`` and returns the result; the index is a
    ``pred[]`` or an ``s32[]`` (the parser pairs a ``pred`` with two branches)."""
    listed = inst.attr("branch_computations")
    branches = list(listed.names) if isinstance(listed, ComputationList) else \
        [inst.called(role) for role in ("true_computation", "false_computation")
         if inst.called(role)]
    if len(operands) != len(branches) + 1:
        return f"{len(branches)} branches but {len(operands) - 1} branch operands"
    if _strip(operands[0]) not in (("pred", ()), ("s32", ())):
        return f"the branch index is {format_shape(operands[0])}, not pred[] or s32[]"
    for name, operand in zip(branches, operands[1:]):
        message = _takes(checker, name, [operand], inst.shape)
        if message:
            return message
    return None


def _reducer(checker: _Checker, inst: Instruction, accumulators: list[Shape]) -> str | None:
    """A reduce's ``to_apply`` returns scalars of its initial values' element types
    (XLA's ``InferReduceShape``; its verifier leaves an all-reduce's reducer alone: XLA's
    own tests sum f32 with a bf16 one)."""
    name = inst.called("to_apply")
    reducer = _callee(checker, name)
    if reducer is None:
        return None
    root = reducer.root.shape
    returned = list(root.elements) if isinstance(root, TupleShape) else [root]
    wanted = _element_types(accumulators)
    if _element_types(returned) != wanted:
        return f"%{name} returns {format_shape(root)} for {', '.join(map(str, wanted))} values"
    return None


def _element_types(shapes: Sequence[Shape]) -> list[str | None]:
    """Each array's element type (None for a tuple)."""
    return [shape.element_type if isinstance(shape, ArrayShape) else None for shape in shapes]


def _strip(shape: Shape) -> tuple:
    if isinstance(shape, TupleShape):
        return tuple(_strip(e) for e in shape.elements)
    return shape.element_type, shape.dims


def _group_size(checker: _Checker, inst: Instruction) -> int | None:
    """The devices ``inst``'s groups hold; None where nothing says: no explicit groups
    (every device) in a module whose header lost its device counts (XLA's pass hook
    prints neither; the passes write those they recover into what they emit), where
    the defaults' one device would turn every such all-gather of an input into a
    problem the input does not have."""
    groups = inst.attr("replica_groups")
    if isinstance(groups, ReplicaGroups) and groups.groups and groups.group_size:
        return groups.group_size
    module = checker.module
    if "replica_count" not in module.header and "num_partitions" not in module.header:
        return None
    # (a reduce-scatter's or all-gather's channel without global ids: every replica
    # with every partition, as with them; without a channel, every replica)
    return module.replica_count if inst.attr("channel_id") is None else \
        module.device_count


def _collective_dims(checker: _Checker, inst: Instruction, operands: list[Shape],
                     scale: Callable[[int, int], int | None]) -> str | None:
    axis = _one_dimension(inst)
    n = _group_size(checker, inst)
    if n is None:
        return None
    results = list(inst.shape.elements) if isinstance(inst.shape, TupleShape) else [inst.shape]
    for source, result in zip(operands, results):
        src, res = _dims(source), _dims(result)
        if len(src) != len(res) or not 0 <= axis < len(src):
            return "operand and result ranks differ or dimension out of range"
        expected = scale(src[axis], n)
        if expected is None or src[:axis] + (expected,) + src[axis + 1:] != res:
            return (f"dimension {axis} of {list(src)} over groups of {n} "
                    f"cannot give {list(res)}")
    return None


def _reduce_scatter(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    return _collective_dims(checker, inst, operands,
                            lambda size, n: size // n if size % n == 0 else None)


def _all_gather(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    return _collective_dims(checker, inst, operands, lambda size, n: size * n)


def _all_reduce(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    results = list(inst.shape.elements) if isinstance(inst.shape, TupleShape) else [inst.shape]
    if len(results) != len(operands) or any(_strip(a) != _strip(b)
                                            for a, b in zip(results, operands)):
        return "all-reduce result differs from its operands"
    return None


def _select(checker: _Checker, inst: Instruction, operands: list[Shape]) -> str | None:
    message = _elementwise(checker, inst, operands)
    if message is None and isinstance(operands[0], ArrayShape) and \
            operands[0].element_type != "pred":
        return "select predicate must be pred"
    return message


_SHAPE_RULES: dict[str, ShapeRule] = {
    **{opcode: _elementwise for opcode in ELEMENTWISE},
    "select": _select,
    "broadcast": _broadcast,
    "reshape": _same_count,
    "bitcast": _bitcast,
    "transpose": _transpose,
    "slice": _slice,
    "dynamic-slice": _dynamic_slice,
    "dot": _dot,
    "convolution": _convolution,
    "pad": _pad,
    "concatenate": _concatenate,
    "reduce": _reduce,
    "iota": _iota,
    "get-tuple-element": _gte,
    "tuple": _tuple,
    "reduce-scatter": _reduce_scatter,
    "all-gather": _all_gather,
    "all-reduce": _all_reduce,
    "call": _call,
    "fusion": _fusion,
    "while": _while,
    "conditional": _conditional,
}
#: The shape rules that read the module's device counts (:func:`_group_size`).
_HEADER_READING_RULES: frozenset[ShapeRule] = frozenset({_reduce_scatter, _all_gather})


def validate(module: Module, computations: Collection[str] | None = None) -> list[Problem]:
    """Every structural problem found (empty when the module passes). ``computations``:
    every check of those computations, of the others only what reads the header
    (collectives' group sizes, replica groups), beside the module-wide checks (channel
    ids, the entry layout) — after a pass, the computations its log says it edited or
    added: every other check reads one computation, which nothing else changes."""
    return _Checker(module, computations).run()


#: The checks whose failure makes a text no HLO module XLA would compile, whatever its
#: header says: the groups' device ids follow device counts a header may have lost
#: (which the passes recover), duplicate channel ids the passes renumber. (A collective's
#: result size is checked where its groups or the header say how many devices it spans:
#: :func:`_group_size`.)
_INPUT_CHECKS = frozenset({"unique-names", "def-before-use", "root", "shape", "aliases",
                           "group-ids"})


def check_input(module: Module, path: str | None = None) -> None:
    """Refuse a module read from ``path`` that fails a check of :data:`_INPUT_CHECKS`
    (an instruction whose result shape disagrees with its operands, ...): its first such
    problem, at the instruction's line and column. What a pass would make of it is
    meaningless, and a rewrite could even hide the slip (a transposed gradient's shards
    come out right)."""
    for problem in validate(module):
        comp = module.computation(problem.computation) if problem.computation else None
        inst = comp[problem.instruction] if comp is not None and problem.instruction \
            and problem.instruction in comp else None
        if problem.check not in _INPUT_CHECKS:
            continue
        loc = inst.loc if inst is not None else comp.loc if comp is not None else None
        where = f"%{problem.instruction}" if problem.instruction else f"%{problem.computation}"
        raise HloParseError(f"{where}: {problem.message} ({problem.check})",
                            loc.line if loc else 1, loc.column if loc else 1, path=path)


__all__ = ["Problem", "check_input", "validate"]
