"""HLO text → :class:`hlo_shard.ir.Module`.

One LALR pass with lark's contextual lexer and an inline transformer: the records
are built while the text is read, with no intermediate parse tree. The grammar
(``grammar/hlo.lark``) keeps long opaque values as single tokens; this module types
the attribute values the passes interpret (see :data:`hlo_shard.ir.AttrValue`) and
keeps everything else verbatim as :class:`~hlo_shard.ir.Raw`.

The semantic checks XLA's parser makes and that are cheap here are made here too,
with the position of the offending token: use before definition, duplicate names,
unknown or not-yet-defined computations, operand counts, several ROOT/ENTRY marks,
literal element counts. Every failure is an :class:`HloParseError` in the user's
words; no lark exception escapes.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
from pathlib import Path
from typing import Callable, Iterable

from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from hlo_shard.errors import HloParseError
from hlo_shard.ir import (
    ELEMENT_BITS, ArrayShape, AttrValue, Computation, ComputationList, ComputationRef, Ident,
    Instruction, Layout, Module, Raw, ReplicaGroups, Shape, SliceRanges, SourceLoc, Str,
    TupleShape,
)

__all__ = ["OPCODES", "parse", "parse_file", "grammar_path", "is_known_opcode"]

# ----------------------------------------------------------------------------- tables

#: ``HLO_OPCODE_LIST`` of xla/hlo/ir/hlo_opcode.h (plus the historical ``trace``).
OPCODES = frozenset("""
abs acos acosh add add-dependency after-all all-gather all-gather-done all-gather-start
all-reduce all-reduce-done all-reduce-start all-to-all and asin asinh async-done async-start
async-update atan atan2 atanh batch-norm-grad batch-norm-inference batch-norm-training
bitcast bitcast-convert broadcast call cbrt ceil cholesky clamp count-leading-zeros
collective-broadcast collective-permute collective-permute-done collective-permute-start
collective-reduce compare complex concatenate conditional constant convert convolution copy
copy-done copy-start cosine cosh custom-call divide domain dot dynamic-reshape dynamic-slice
dynamic-update-slice erf exponential exponential-minus-one fft floor fusion gather
get-dimension-size get-tuple-element imag infeed iota is-finite log log-plus-one logistic map
maximum minimum mulhi multiply negate not opt-barrier or outfeed pad parameter partition-id
popcnt power ragged-all-to-all ragged-dot real recv recv-done reduce reduce-precision
reduce-scatter reduce-window remainder replica-id reshape reverse rng rng-bit-generator
rng-get-and-update-state round-nearest-afz round-nearest-even rsqrt scaled-dot scan scatter
select select-and-scatter send send-done set-dimension-size shift-left shift-right-arithmetic
shift-right-logical shuffle sign sine sinh slice sort sqrt stochastic-convert subtract tan
tanh topk transpose triangular-solve tuple while xor
""".split())

_ASYNC_SUFFIXES = ("-start", "-update", "-done")


def is_known_opcode(opcode: str) -> bool:
    """A table opcode, or XLA's async sugar ``<op>-start/-update/-done``."""
    if opcode in OPCODES:
        return True
    for suffix in _ASYNC_SUFFIXES:
        if opcode.endswith(suffix) and opcode[: -len(suffix)] in OPCODES:
            return True
    return False


_UNARY = """abs acos acosh asin asinh atan atanh bitcast bitcast-convert broadcast cbrt ceil
copy convert cosh cosine count-leading-zeros erf exponential exponential-minus-one floor
get-tuple-element imag is-finite log log-plus-one logistic negate not popcnt real
reduce-precision reshape reverse round-nearest-afz round-nearest-even rsqrt sign sine sinh
slice sqrt tan tanh transpose all-reduce-done all-gather-done collective-permute-done
copy-done copy-start recv-done send-done cholesky""".split()
_BINARY = """add and atan2 complex divide maximum minimum mulhi multiply or power remainder
shift-left shift-right-arithmetic shift-right-logical subtract xor compare dot pad
triangular-solve add-dependency stochastic-convert""".split()

#: (min, max) operand counts; max None = unbounded. Opcodes not listed are unchecked.
_OPERAND_COUNTS: dict[str, tuple[int, int | None]] = {
    **{op: (1, 1) for op in _UNARY},
    **{op: (2, 2) for op in _BINARY},
    "select": (3, 3), "clamp": (3, 3), "scaled-dot": (4, 4), "ragged-dot": (3, 3),
    "iota": (0, 0), "replica-id": (0, 0), "partition-id": (0, 0),
    "dynamic-slice": (2, None), "dynamic-update-slice": (3, None),
    "concatenate": (1, None), "all-reduce": (1, None), "all-gather": (1, None),
    "reduce-scatter": (1, None), "all-reduce-start": (1, None),
    "all-gather-start": (1, None), "collective-permute": (1, None), "reduce": (2, None),
    "reduce-window": (2, None), "while": (1, 1), "conditional": (1, None),
    "gather": (2, 2), "scatter": (3, None), "sort": (1, None), "map": (1, None),
    "select-and-scatter": (3, 3), "batch-norm-training": (3, 3),
    "batch-norm-inference": (5, 5), "batch-norm-grad": (5, 5),
    "get-dimension-size": (1, 1), "set-dimension-size": (2, 2),
}

#: Attributes naming one computation / a list of computations.
_COMPUTATION_ATTRS = frozenset({
    "to_apply", "calls", "condition", "body", "select", "scatter", "true_computation",
    "false_computation",
})
_COMPUTATION_LIST_ATTRS = frozenset({"branch_computations", "called_computations"})

#: Braced int lists (``{1,0}``) and lists of them (``{{0,1},{1,0}}``).
_INT_LIST_ATTRS = frozenset({
    "dimensions", "dynamic_slice_sizes", "slice_sizes", "fft_length",
    "lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims", "rhs_batch_dims",
    "lhs_ragged_dims", "rhs_group_dims", "offset_dims", "collapsed_slice_dims",
    "start_index_map", "operand_batching_dims", "start_indices_batching_dims",
    "update_window_dims", "inserted_window_dims", "scatter_dims_to_operand_dims",
    "input_batching_dims", "scatter_indices_batching_dims", "source_target_pairs",
})

#: Kept verbatim whatever their token (a quoted backend_config stays quoted).
_RAW_ATTRS = frozenset({"backend_config"})

#: Header attributes with a typed value; the others are kept verbatim.
_HEADER_TYPES: dict[str, type] = {"replica_count": int, "num_partitions": int,
                                   "is_scheduled": bool}

_TYPE_KEYWORDS = frozenset(ELEMENT_BITS) | {"opaque_type"}
_MAX_TUPLE_DEPTH = 64

# ---------------------------------------------------------------------- the grammar


def grammar_path() -> Path:
    """``hlo_shard/grammar/hlo.lark`` in an installed wheel, ``<repo>/grammar/hlo.lark``
    in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "grammar" / "hlo.lark", here.parent / "grammar" / "hlo.lark"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("hlo.lark grammar not found next to the hlo_shard package")


# ------------------------------------------------------------------ error plumbing


class _Located(Exception):
    """A semantic error found while building, at a token's position."""

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(message)
        self.message, self.line, self.column = message, line, column


def _fail(message: str, token: Token) -> "NoReturn":  # noqa: F821 - typing only
    raise _Located(message, token.line, token.column)


def _bare(name: str) -> str:
    return name[1:] if name.startswith("%") else name


# ---------------------------------------------------------------- value converters

_INT_LIST_RE = re.compile(r"\{\s*(-?\d+(?:\s*,\s*-?\d+)*)?\s*\}\Z")
_INT_RE = re.compile(r"-?\d+")
_GROUP_RE = re.compile(r"\{([^{}]*)\}")
_SLICE_RE = re.compile(r"\[\s*(-?\d+)\s*:\s*(-?\d+)\s*(?::\s*(-?\d+)\s*)?\]")
_NAME_IN_LIST_RE = re.compile(r"%?([A-Za-z_][A-Za-z0-9_.\-]*)")


def _int_list(token: Token) -> tuple:
    text = token.value
    match = _INT_LIST_RE.match(text)
    if match:
        return tuple(int(v) for v in _INT_RE.findall(text))
    if text.startswith("{") and all(
            _INT_LIST_RE.match(g.group(0)) for g in _GROUP_RE.finditer(text[1:-1])):
        if _GROUP_RE.sub("", text[1:-1]).replace(",", "").strip() == "":
            return tuple(tuple(int(v) for v in _INT_RE.findall(g.group(1)))
                         for g in _GROUP_RE.finditer(text[1:-1]))
    _fail(f"expected a list of integers like {{1,0}}, found {_show(text)}", token)


def _slice_ranges(token: Token) -> SliceRanges:
    text = token.value
    ranges = tuple((int(a), int(b), int(c) if c else 1)
                   for a, b, c in _SLICE_RE.findall(text))
    if _SLICE_RE.sub("", text[1:-1]).replace(",", "").strip():
        _fail(f"expected slice ranges like {{[0:4], [0:8:2]}}, found {_show(text)}", token)
    return SliceRanges(ranges)


def _replica_groups(token: Token) -> ReplicaGroups:
    text = token.value
    try:
        if token.type == "IOTA_GROUPS":
            return ReplicaGroups(_iota_groups(text), text)
        if token.type == "MESH_GROUPS":
            return ReplicaGroups(_mesh_groups(text), text)
        if token.type == "BLOB":
            inner = text[1:-1]
            groups = tuple(tuple(int(v) for v in _INT_RE.findall(g))
                           for g in _GROUP_RE.findall(inner))
            if _GROUP_RE.sub("", inner).replace(",", "").strip():
                raise ValueError("expected {{0,1},{2,3}}")
            return ReplicaGroups(groups, text)
    except ValueError as err:
        _fail(f"bad replica_groups {_show(text)}: {err}", token)
    _fail(f"bad replica_groups {_show(text)}", token)


def _transposed_iota(dims: list[int], perm: list[int]) -> list[int]:
    """``iota(prod(dims)).reshape(dims).transpose(perm).flatten()``."""
    if sorted(perm) != list(range(len(dims))):
        raise ValueError(f"T{tuple(perm)} is not a permutation of {len(dims)} dimensions")
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    new_dims = [dims[p] for p in perm]
    new_strides = [strides[p] for p in perm]
    return [sum(i * s for i, s in zip(index, new_strides))
            for index in itertools.product(*(range(d) for d in new_dims))]


def _chunk(devices: list[int], group_size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(devices[i:i + group_size]) for i in range(0, len(devices), group_size))


def _iota_groups(text: str) -> tuple[tuple[int, ...], ...]:
    shape_text, _, rest = text.partition("<=")
    num_groups, group_size = (int(v) for v in _INT_RE.findall(shape_text))
    reshape_text, _, perm_text = rest.partition("T")
    dims = [int(v) for v in _INT_RE.findall(reshape_text)]
    perm = [int(v) for v in _INT_RE.findall(perm_text)] if perm_text else list(range(len(dims)))
    if math.prod(dims) != num_groups * group_size:
        raise ValueError(f"[{num_groups},{group_size}] does not hold {math.prod(dims)} devices")
    return _chunk(_transposed_iota(dims, perm), group_size)


_MESH_AXIS_RE = re.compile(r"""['"]?([A-Za-z_][\w.\-]*)['"]?\s*=\s*(\d+)""")
_GROUP_AXIS_RE = re.compile(r"""['"]?([A-Za-z_][\w.\-]*)['"]?(?:\s*:\s*\(\s*(\d+)\s*\)\s*(\d+))?""")


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Groups of ``mesh[axes](, device_ids=(...))? {listed axes}``: the devices that
    vary along the listed (sub-)axes, the others fixed (MeshAxesReplicaGroupList)."""
    mesh_text = text[text.index("[") + 1: text.index("]")]
    axes = [(name, int(size)) for name, size in _MESH_AXIS_RE.findall(mesh_text)]
    names = [name for name, _ in axes]
    total = math.prod(size for _, size in axes)
    ids_match = re.search(r"device_ids=\(([^)]*)\)", text)
    devices = ([int(v) for v in _INT_RE.findall(ids_match.group(1))] if ids_match
               else list(range(total)))
    if len(devices) != total:
        raise ValueError(f"device_ids has {len(devices)} entries for {total} devices")
    listed_text = text[text.rindex("{") + 1: text.rindex("}")]
    listed = [(m.group(1), m.group(2), m.group(3))
              for m in _GROUP_AXIS_RE.finditer(listed_text) if m.group(1)]
    if not listed:
        raise ValueError("no mesh axes listed")
    # Split every mesh axis into the factors its listed sub-axes need.
    by_axis: dict[int, list[tuple[int, int]]] = {}
    for name, pre, size in listed:
        if name not in names:
            raise ValueError(f"axis {name!r} is not in the mesh")
        axis = names.index(name)
        full = axes[axis][1]
        by_axis.setdefault(axis, []).append((int(pre), int(size)) if pre else (1, full))
    factors: list[int] = []
    factor_of: dict[tuple[int, tuple[int, int]], int] = {}
    for axis, (_, full) in enumerate(axes):
        product = 1
        for pre, size in sorted(by_axis.get(axis, [])):
            if pre != product:
                if pre % product:
                    raise ValueError("overlapping sub-axes")
                factors.append(pre // product)
                product = pre
            factor_of[(axis, (pre, size))] = len(factors)
            factors.append(size)
            product *= size
        if full % product:
            raise ValueError(f"sub-axes do not divide axis {axes[axis][0]!r}")
        if product != full:
            factors.append(full // product)
    grouped = []
    for name, pre, size in listed:
        axis = names.index(name)
        grouped.append(factor_of[(axis, (int(pre), int(size)) if pre else (1, axes[axis][1]))])
    perm = [i for i in range(len(factors)) if i not in grouped] + grouped
    order = _transposed_iota(factors, perm)
    group_size = math.prod(factors[i] for i in grouped)
    return _chunk([devices[i] for i in order], group_size)


def _computation_names(token: Token) -> list[str]:
    text = token.value
    if token.type in ("NAME",):
        return [_bare(text)]
    if token.type == "BLOB":
        inner = text[1:-1]
        names = _NAME_IN_LIST_RE.findall(inner)
        if _NAME_IN_LIST_RE.sub("", inner).replace(",", "").strip() == "":
            return names
    _fail(f"expected a computation name, found {_show(text)}", token)


def _c_unescape(text: str) -> str:
    """The value of a quoted string token (absl::CUnescape on the inside)."""
    inner = text[1:-1]
    if "\\" not in inner:
        return inner
    return _ESCAPE_RE.sub(_unescape_one, inner)


_ESCAPE_RE = re.compile(r"\\(x[0-9a-fA-F]{1,2}|[0-7]{1,3}|.)", re.S)
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f",
                   "v": "\v", "\\": "\\", "'": "'", '"': '"', "?": "?"}


def _unescape_one(match: re.Match) -> str:
    code = match.group(1)
    if code[0] == "x":
        return chr(int(code[1:], 16))
    if code[0].isdigit():
        return chr(int(code, 8))
    return _SIMPLE_ESCAPES.get(code, code)


def _show(text: str, limit: int = 40) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _default_value(token: Token) -> AttrValue:
    kind = token.type
    if kind == "INT":
        return int(token.value)
    if kind == "NAME":
        if token.value in ("true", "false"):
            return token.value == "true"
        return Ident(token.value) if not token.value.startswith("%") else Raw(token.value)
    if kind == "STRING":
        return Str(_c_unescape(token.value))
    if kind == "FLOAT" and "(" not in token.value:
        return float(token.value)
    return Raw(token.value)


def _attribute_value(name: str, token: Token) -> AttrValue:
    """Type an instruction attribute by its name, then by its token."""
    if name in _RAW_ATTRS:
        return Raw(token.value)
    if name in _COMPUTATION_ATTRS:
        if token.type == "NAME":
            return ComputationRef(_bare(token.value))
        names = _computation_names(token)
        return ComputationList(tuple(names))
    if name in _COMPUTATION_LIST_ATTRS:
        return ComputationList(tuple(_computation_names(token)))
    if name == "replica_groups":
        return _replica_groups(token)
    if name in _INT_LIST_ATTRS and token.type == "BLOB":
        return _int_list(token)
    if name == "slice" and token.type == "BLOB":
        return _slice_ranges(token)
    return _default_value(token)


# ------------------------------------------------------------------------- shapes

_SHAPE_CACHE: dict[str, ArrayShape] = {}


def _array_shape(token: Token) -> ArrayShape:
    text = token.value
    shape = _SHAPE_CACHE.get(text)
    if shape is None:
        try:
            shape = _SHAPE_CACHE[text] = _read_array_shape(text)
        except ValueError as err:
            _fail(f"bad shape {_show(text)}: {err}", token)
    return shape


def _read_array_shape(text: str) -> ArrayShape:
    element_type, _, rest = text.rstrip().partition("[")
    if element_type == "opaque_type":
        element_type = "opaque"
    if element_type not in ELEMENT_BITS:
        raise ValueError(f"unknown element type {element_type!r}")
    dims_text, _, layout_text = rest.partition("]")
    dims: list[int] = []
    dynamic: list[str] = []
    if dims_text.strip():
        for item in dims_text.split(","):
            item = item.strip()
            if item == "?":
                dims.append(-1)
                dynamic.append("?")
            elif item.startswith("<="):
                dims.append(int(item[2:]))
                dynamic.append("<=")
            else:
                dims.append(int(item))
                dynamic.append("")
    layout = None
    layout_text = layout_text.strip()
    if layout_text:
        order_text, _, tail = layout_text[1:-1].partition(":")
        order = tuple(int(v) for v in order_text.split(",") if v.strip())
        if order and sorted(order) != list(range(len(dims))):
            raise ValueError(f"layout {{{order_text.strip()}}} is not a permutation of "
                             f"{len(dims)} dimensions")
        layout = Layout(order, tail.strip())
    return ArrayShape(element_type, tuple(dims),
                      tuple(dynamic) if any(dynamic) else (), layout)


_SHAPE_PART_RE = re.compile(
    r"\s+|/\*[^*]*\*+(?:[^/*][^*]*\*+)*/|[(),]|[a-z][a-z0-9_]*\[[^\]]*\]"
    r"(?:\s*\{(?=\s*[0-9:])[^{}]*\})?")


def _read_shape(text: str, where) -> Shape:
    """Any shape, tuples included, from text (used for coarse signature tokens)."""
    stack: list[list[Shape]] = [[]]
    for match in _SHAPE_PART_RE.finditer(text):
        part = match.group(0)
        if part == "(":
            stack.append([])
        elif part == ")":
            if len(stack) == 1:
                _fail(f"unbalanced ')' in shape {_show(text)}", where)
            elements = stack.pop()
            stack[-1].append(TupleShape(tuple(elements)))
        elif part[0].isalpha():
            stack[-1].append(_array_shape(_Val("SHAPE", part, where.line, where.column)))
    if len(stack) != 1 or len(stack[0]) != 1:
        _fail(f"bad shape {_show(text)}", where)
    return stack[0][0]


def _shape(value) -> Shape:
    """A grammar ``shape`` child: a SHAPE token or an already built shape."""
    return _array_shape(value) if isinstance(value, (Token, _Val)) else value


def compatible(a: Shape, b: Shape) -> bool:
    """Same structure, element types and dimensions; layouts ignored (as XLA)."""
    if isinstance(a, ArrayShape) and isinstance(b, ArrayShape):
        return a.element_type == b.element_type and a.dims == b.dims
    if isinstance(a, TupleShape) and isinstance(b, TupleShape):
        return len(a.elements) == len(b.elements) and all(
            compatible(x, y) for x, y in zip(a.elements, b.elements))
    return False


def _format_shape(shape: Shape) -> str:
    if isinstance(shape, TupleShape):
        return "(" + ", ".join(_format_shape(s) for s in shape.elements) + ")"
    return f"{shape.element_type}[{','.join(map(str, shape.dims))}]"


# --------------------------------------------------------------- literal checking

_SCALAR_RE = re.compile(r"-?nan\(0x[0-9a-fA-F]+\)|[^\s{},()]+")


def _check_literal(shape: Shape, literal: Token) -> None:
    """Element count of a constant against its shape (XLA checks it exactly)."""
    text = literal.value
    if not isinstance(shape, ArrayShape) or "..." in text or -1 in shape.dims:
        return
    if shape.element_type in ("c64", "c128"):
        count = text.count("(")
    else:
        count = sum(1 for _ in _SCALAR_RE.finditer(text))
    if count != shape.num_elements:
        _fail(f"constant has {count} value{'s' * (count != 1)} but its shape "
              f"{_format_shape(shape)} holds {shape.num_elements}", literal)


# ------------------------------------------------------------------ shape inference


def _infer_shape(opcode: Token, operands: list[Instruction],
                 attrs: dict[str, AttrValue]) -> Shape:
    """Result shape for the few opcodes whose shape may be left out of the text."""
    op = opcode.value
    if op in ("replica-id", "partition-id"):
        return ArrayShape("u32", ())
    if op == "tuple":
        return TupleShape(tuple(o.shape for o in operands))
    if operands and op == "get-tuple-element" and isinstance(operands[0].shape, TupleShape):
        index = attrs.get("index")
        if isinstance(index, int) and 0 <= index < len(operands[0].shape.elements):
            return operands[0].shape.elements[index]
    if operands and isinstance(operands[0].shape, ArrayShape):
        first = operands[0].shape
        if op == "compare":
            return ArrayShape("pred", first.dims, first.dynamic)
        if op in _UNARY_ELEMENTWISE or op in _BINARY_ELEMENTWISE or op in ("select", "clamp"):
            source = operands[1].shape if op == "select" and len(operands) > 1 else first
            return source
    _fail(f"the result shape of '{op}' cannot be inferred; write it before the opcode",
          opcode)


_UNARY_ELEMENTWISE = frozenset(_UNARY) - {
    "broadcast", "bitcast", "bitcast-convert", "convert", "get-tuple-element", "reshape",
    "reverse", "slice", "transpose", "all-reduce-done", "all-gather-done",
    "collective-permute-done", "copy-done", "copy-start", "recv-done", "send-done",
    "cholesky", "imag", "real",
}
_BINARY_ELEMENTWISE = frozenset(_BINARY) - {"compare", "dot", "pad", "triangular-solve",
                                            "add-dependency", "complex",
                                            "stochastic-convert"}

# ------------------------------------------------------------------ the transformer

_PLACEHOLDER = "\0nested"


class _Scope:
    """What is being collected for the computation currently read."""

    __slots__ = ("names", "instructions", "root_token", "root_name", "parameter_numbers",
                 "first_unknown_use", "nested_count", "tuple_depth")

    def __init__(self) -> None:
        self.names: dict[str, Instruction] = {}
        self.instructions: list[Instruction] = []
        self.root_token: Token | None = None
        self.root_name: str | None = None
        self.parameter_numbers: dict[int, Token] = {}
        self.first_unknown_use: Token | None = None
        self.nested_count = 0
        self.tuple_depth: dict[int, int] = {}


class _Builder(Transformer):
    """Grammar callbacks. Reductions arrive in text order, so each computation's
    instructions are checked and collected as they are read."""

    def __init__(self) -> None:
        super().__init__(visit_tokens=False)
        self.reset()

    def reset(self) -> None:
        self.computations: dict[str, Computation] = {}
        self.computation_order: list[Computation] = []
        self.entry_token: Token | None = None
        self.entry_name: str | None = None
        self.unresolved: list[tuple[str, Token]] = []
        self.scope = _Scope()

    # Module --------------------------------------------------------------------------
    def start(self, children: list) -> Module:
        header, stack_frames = children[0], children[1]
        name, attributes = header if header is not None else (None, {})
        comps = self.computation_order
        if not any(c.is_entry for c in comps):
            comps[-1].is_entry = True
        if name is None:
            name = f"module_{self.entry_name or comps[-1].name}"
        return Module(name, list(comps), attributes,
                      stack_frames.value if stack_frames is not None else None)

    def header(self, children: list) -> tuple[str, dict[str, AttrValue]]:
        name, *attributes = children
        header: dict[str, AttrValue] = {}
        for attr_token, value in attributes:
            key = attr_token.value[:-1]
            if key in header:
                _fail(f"duplicate module attribute '{key}'", attr_token)
            kind = _HEADER_TYPES.get(key)
            if kind is int and value.type == "INT":
                header[key] = int(value.value)
            elif kind is bool and value.value in ("true", "false"):
                header[key] = value.value == "true"
            elif kind is not None:
                _fail(f"'{key}' expects {'an integer' if kind is int else 'true or false'}, "
                      f"found {_show(value.value)}", value)
            else:
                header[key] = Raw(value.value)
        return _bare(name.value), header

    # Computations -------------------------------------------------------------------
    def computation(self, children: list) -> Computation:
        entry, name_token, signature, *rest = children
        name = _bare(name_token.value)
        if name in self.computations:
            _fail(f"duplicate computation name '{name}'", name_token)
        scope = self._close_scope(name)
        if entry is not None:
            if self.entry_token is not None:
                _fail(f"second ENTRY computation (the first is at line "
                      f"{self.entry_token.line})", entry)
            self.entry_token, self.entry_name = entry, name
        thread = None
        for item in rest:
            if not isinstance(item, tuple):
                continue
            attr_token, value = item
            if attr_token.value != "execution_thread=" or value.type != "STRING":
                _fail("a computation takes only execution_thread=\"...\" after its body",
                      attr_token)
            thread = _c_unescape(value.value)
        comp = self._add_computation(name, scope, entry is not None, name_token)
        comp.execution_thread = thread
        if signature is not None and not compatible(signature, comp.root.shape):
            _fail(f"the root of '{name}' has shape {_format_shape(comp.root.shape)}, not "
                  f"the {_format_shape(signature)} its signature declares", name_token)
        return comp

    def signature(self, children: list) -> Shape:
        token = children[0]
        arrow = token.value.rindex("->")
        return _read_shape(token.value[arrow + 2:], _piece(token, "SHAPE", arrow + 2,
                                                              len(token.value)))

    def long_signature(self, children: list) -> Shape:
        return _shape(children[-1])

    def parameter_decl(self, children: list) -> None:
        return None

    def inline_body(self, children: list) -> _Scope:
        return self._close_scope("inline computation")

    def _add_computation(self, name: str, scope: _Scope, is_entry: bool,
                         token: Token) -> Computation:
        comp = Computation(name, scope.instructions, scope.root_name, is_entry=is_entry,
                           loc=SourceLoc(token.line, token.column))
        self.computations[name] = comp
        self.computation_order.append(comp)
        return comp

    def _close_scope(self, computation: str) -> _Scope:
        """End-of-computation checks and names for nested operands; starts a new scope."""
        scope, self.scope = self.scope, _Scope()
        if scope.first_unknown_use is not None:
            token = scope.first_unknown_use
            name = _bare(token.value)
            defined = scope.names.get(name)
            if defined is not None and defined.loc is not None:
                _fail(f"'{name}' is used before its definition at line {defined.loc.line}",
                      token)
            _fail(f"use of undefined instruction '{name}' in '{computation}'", token)
        if scope.nested_count:
            _name_nested(scope)
        return scope

    def _inline_computation(self, token: Token) -> ComputationRef:
        """``to_apply={ a = ... ROOT r = ... }``: parse the body as a computation of its
        own, named like XLA names it (``_``), placed before its caller."""
        padding = "\n" * (token.line - 1) + " " * token.column  # keeps positions exact
        outer, self.scope = self.scope, _Scope()
        try:
            scope = _parser().parse(padding + token.value[1:-1], start="inline_body")
        finally:
            self.scope = outer
        name = _unique("_", self.computations)
        self._add_computation(name, scope, False, token)
        return ComputationRef(name)

    # Shapes -------------------------------------------------------------------------
    def tuple_shape(self, children: list) -> TupleShape:
        open_paren, *elements = children
        if elements == [None]:
            elements = []
        shapes = tuple(_shape(e) for e in elements)
        depths = self.scope.tuple_depth
        depth = 1 + max((depths.get(id(s), 0) for s in shapes), default=0)
        if depth > _MAX_TUPLE_DEPTH:
            _fail(f"tuple shape nests deeper than {_MAX_TUPLE_DEPTH} levels", open_paren)
        shape = TupleShape(shapes)
        depths[id(shape)] = depth
        return shape

    # Instructions -------------------------------------------------------------------
    def headed(self, children: list) -> Instruction:
        """``HEAD`` is ``[ROOT] name = [array shape]`` in one token."""
        head, shape, rhs, attrs_token, *attributes = children
        text = head.value
        root = None
        start = 0
        if text.startswith("ROOT") and text[4:5].isspace():
            root = head
            start = len(text) - len(text[4:].lstrip())
        name = _piece(head, "NAME", start, _NAME_RE.match(text, start).end())
        after_equals = text.index("=", start) + 1
        shape_start = len(text) - len(text[after_equals:].lstrip())
        if shape_start < len(text):
            shape = _array_shape(_piece(head, "SHAPE", shape_start, len(text)))
        return self.instruction([root, name, shape, rhs, attrs_token, *attributes])

    def instruction(self, children: list) -> Instruction:
        root, name_token, shape, rhs, attrs_token, *attributes = children
        if attrs_token is not None:
            attributes = _split_attributes(attrs_token) + attributes
        inst = self._build(name_token, shape, rhs, attributes)
        if root is not None:
            scope = self.scope
            if scope.root_token is not None:
                _fail(f"second ROOT in this computation (the first is at line "
                      f"{scope.root_token.line})", root)
            scope.root_token, scope.root_name = root, inst.name
        return inst

    def op(self, children: list) -> tuple:
        opcode, *operands = children
        if operands == [None]:
            operands = []
        return ("op", opcode, operands)

    def simple_op(self, children: list) -> tuple:
        call = children[0]
        paren = call.value.index("(")
        return ("simple", _piece(call, "NAME", 0, paren), (call, paren))

    def constant(self, children: list) -> tuple:
        return ("constant", children[0], children[1])

    def parameter(self, children: list) -> tuple:
        if len(children) == 2:
            return ("parameter", children[0], children[1])
        call = children[0]
        digits = _INT_RE.search(call.value)
        return ("parameter", call, _piece(call, "INT", *digits.span()))

    def operand(self, children: list) -> tuple:
        return (children[1], children[0])

    def nested_operand(self, children: list) -> tuple:
        shape, rhs = children
        scope = self.scope
        scope.nested_count += 1
        opcode = rhs[1]
        placeholder = _Val("NAME", f"{_PLACEHOLDER}{scope.nested_count}", opcode.line,
                           opcode.column)
        self._build(placeholder, shape, rhs, [])
        return (placeholder, None)

    def attribute(self, children: list) -> tuple[Token, Token]:
        return (children[0], children[1])

    def _build(self, name_token: Token, shape_child, rhs: tuple,
               attributes: list[tuple[Token, Token]]) -> Instruction:
        name = _bare(name_token.value)
        scope = self.scope
        names = scope.names
        if name in names:
            first = names[name].loc
            _fail(f"duplicate instruction name '{name}'" + (
                f" (first defined at line {first.line})" if first else ""), name_token)
        if name in _TYPE_KEYWORDS:
            _fail(f"'{name}' is a type name and cannot name an instruction", name_token)
        kind, opcode, payload = rhs
        attrs: dict[str, AttrValue] = {}
        for attr_token, value_token in attributes:
            key = attr_token.value[:-1]
            if key in attrs:
                _fail(f"duplicate attribute '{key}'", attr_token)
            attrs[key] = self._attribute(key, value_token)
        shape = _shape(shape_child) if shape_child is not None else None
        is_op = kind == "op" or kind == "simple"
        inst = Instruction(name, opcode.value if is_op else kind, shape, [], attrs,
                           loc=SourceLoc(name_token.line, name_token.column))
        if is_op:
            self._set_operands(inst, opcode, payload)
            if shape is None:
                inst.shape = _infer_shape(opcode, [names[o] for o in inst.operands
                                                   if o in names], attrs)
        elif shape is None:
            _fail(f"a {kind} needs its shape before the opcode", opcode)
        elif kind == "constant":
            _check_literal(shape, payload)
            inst.literal = payload.value.strip()
        else:
            number = int(payload.value)
            if number in scope.parameter_numbers:
                _fail(f"parameter({number}) is already defined at line "
                      f"{scope.parameter_numbers[number].line}", payload)
            scope.parameter_numbers[number] = payload
            inst.parameter_number = number
        names[name] = inst
        scope.instructions.append(inst)
        return inst

    def _attribute(self, key: str, token: Token) -> AttrValue:
        if key in _COMPUTATION_ATTRS and token.type == "BLOB" and "=" in token.value:
            return self._inline_computation(token)
        value = _attribute_value(key, token)
        if isinstance(value, (ComputationRef, ComputationList)):
            for callee in (value.name,) if isinstance(value, ComputationRef) else value.names:
                if callee not in self.computations:
                    self.unresolved.append((callee, token))
        elif key == "control-predecessors":
            for predecessor in _NAME_IN_LIST_RE.findall(token.value[1:-1]):
                if predecessor not in self.scope.names:
                    _fail(f"control predecessor '{predecessor}' is not defined before "
                          "this instruction", token)
        return value

    def _set_operands(self, inst: Instruction, opcode: Token, operands: list) -> None:
        op = opcode.value
        if op not in OPCODES and not is_known_opcode(op):
            if op != "cross-replica-sum":
                _fail(f"unknown opcode '{op}'", opcode)
            inst.opcode = op = "all-reduce"  # its name before 2018
        scope = self.scope
        defined_names = scope.names
        if isinstance(operands, tuple):  # a CALL token: positions only if needed
            call, paren = operands
            names = inst.operands = _operand_names(call, paren)
            for index, name in enumerate(names):
                if name not in defined_names:
                    if scope.first_unknown_use is None:
                        scope.first_unknown_use = _simple_operands(call, paren)[index][0]
                    break
            operands = ()
        names = inst.operands
        for name_token, declared in operands:
            name = _bare(name_token.value)
            names.append(name)
            defined = defined_names.get(name)
            if defined is None:
                if scope.first_unknown_use is None:
                    scope.first_unknown_use = name_token
            elif declared is not None and not compatible(_shape(declared), defined.shape):
                _fail(f"operand '{name}' is declared {_format_shape(_shape(declared))} but "
                      f"defined as {_format_shape(defined.shape)}", name_token)
        counts = _OPERAND_COUNTS.get(op)
        if counts is not None:
            low, high = counts
            n = len(names)
            if n < low or (high is not None and n > high):
                expected = str(low) if low == high else (
                    f"at least {low}" if high is None else f"{low} to {high}")
                _fail(f"'{op}' takes {expected} operand{'s' * (expected != '1')}, got {n}",
                      opcode)


class _Val:
    """A token cut out of a coarse token: what the converters and messages need."""

    __slots__ = ("type", "value", "line", "column")

    def __init__(self, kind: str, value: str, line: int, column: int) -> None:
        self.type, self.value, self.line, self.column = kind, value, line, column


def _piece(token: Token, kind: str, start: int, end: int) -> _Val:
    """The part ``token.value[start:end]`` with its own position."""
    text = token.value
    newline = text.rfind("\n", 0, start)
    if newline < 0:
        return _Val(kind, text[start:end], token.line, token.column + start)
    return _Val(kind, text[start:end], token.line + text.count("\n", 0, start),
                start - newline)


_PAIR_RE: re.Pattern | None = None
_NAME_RE = re.compile(r"%?[A-Za-z_][A-Za-z0-9_.\-]*")
_BARE_NAME_RE = re.compile(r"%?([A-Za-z_][A-Za-z0-9_.\-]*)")
_BLOCK_COMMENT_RE = re.compile(r"/\*[^*]*\*+(?:[^/*][^*]*\*+)*/")


def _pair_re() -> re.Pattern:
    """``, name=value`` with one named group per value kind, from the grammar's own
    terminal patterns so the two never disagree."""
    global _PAIR_RE
    if _PAIR_RE is None:
        lark = _parser()
        kinds = ("BLOB", "STRING", "IOTA_GROUPS", "MESH_GROUPS", "FLOAT", "INT", "NAME")
        values = "|".join(f"(?P<{k}>{lark.get_terminal(k).pattern.to_regexp()})"
                          for k in kinds)
        _PAIR_RE = re.compile(rf"\s*,\s*(?P<key>{lark.get_terminal('ATTR').pattern.to_regexp()})"
                              rf"(?:{values})(?=\s|,|\}}|/[*/]|$)")
    return _PAIR_RE


def _split_attributes(token: Token) -> list[tuple[_Val, _Val]]:
    pairs = []
    for match in _pair_re().finditer(token.value):
        kind = match.lastgroup
        pairs.append((_piece(token, "ATTR", *match.span("key")),
                      _piece(token, kind, *match.span(kind))))
    return pairs


def _operand_names(token: Token, paren: int) -> list[str]:
    """The names in ``opcode(%a, b, /*index=2*/%c)`` (``paren``: index of '(')."""
    text = token.value
    if "/*" in text:
        text = _BLOCK_COMMENT_RE.sub("", text)
    return _BARE_NAME_RE.findall(text, paren)


def _simple_operands(token: Token, paren: int) -> list[tuple]:
    """The same names with their positions, for messages."""
    text = token.value
    if "/*" in text:
        text = _BLOCK_COMMENT_RE.sub(lambda m: " " * len(m.group(0)), text)
    return [(_piece(token, "NAME", *m.span()), None)
            for m in _NAME_RE.finditer(text, paren)]


def _unique(base: str, taken) -> str:
    """``base``, else ``base.1``, ``base.2``, … (XLA's name uniquer)."""
    if base not in taken:
        return base
    for n in itertools.count(1):
        candidate = f"{base}.{n}"
        if candidate not in taken:
            return candidate


def _name_nested(scope: _Scope) -> None:
    """Give hoisted nested operands XLA's names (``negate.anon``, ``negate.anon.1``)."""
    taken = {name for name in scope.names if not name.startswith(_PLACEHOLDER)}
    renames: dict[str, str] = {}
    for inst in scope.instructions:
        if inst.name.startswith(_PLACEHOLDER):
            fresh = _unique(f"{inst.opcode}.anon", taken)
            taken.add(fresh)
            renames[inst.name] = fresh
            inst.name = fresh
    for inst in scope.instructions:
        inst.operands = [renames.get(o, o) for o in inst.operands]
    scope.names = {inst.name: inst for inst in scope.instructions}


# --------------------------------------------------------------------- entry points

_BUILDER = _Builder()
_LOCK = threading.RLock()
_PARSER: Lark | None = None


def _parser() -> Lark:
    global _PARSER
    if _PARSER is None:
        _PARSER = Lark(grammar_path().read_text(encoding="utf-8"), parser="lalr",
                       lexer="contextual", transformer=_BUILDER,
                       start=["start", "inline_body"], maybe_placeholders=True,
                       cache=True)
    return _PARSER


def parse(text: str, path: str | None = None) -> Module:
    """Parse HLO text into a :class:`Module`; ``path`` is only used in messages."""
    with _LOCK:
        _BUILDER.reset()
        try:
            module = _parser().parse(text, start="start")
            _check_unresolved(_BUILDER)
        except _Located as err:
            raise _error(text, path, err.message, err.line, err.column) from None
        except UnexpectedInput as err:
            raise _syntax_error(text, path, err) from None
        except RecursionError:
            raise _error(text, path, "input nests too deeply to parse", 1, 1) from None
        finally:
            _BUILDER.reset()
    module.source_path = path
    return module


def parse_file(path: str | Path) -> Module:
    """Read and parse an HLO text file (UTF-8)."""
    from hlo_shard.cli.app import read_text  # the shared, located UTF-8 decoding

    return parse(read_text(str(path)), str(path))


def _check_unresolved(builder: _Builder) -> None:
    for name, token in builder.unresolved:
        if name in builder.computations:
            _fail(f"computation '{name}' is used before it is defined (define callees "
                  "first)", token)
        _fail(f"unknown computation '{name}'", token)


# -------------------------------------------------------------- syntax error words

#: How the grammar's regex terminals are named in messages.
_TERMINAL_WORDS = {
    "NAME": "a name", "ATTR": "an attribute 'name=value'", "NAME_COLON": "'name:'",
    "SHAPE": "a shape like f32[4]", "INT": "an integer", "FLOAT": "a number",
    "STRING": "a quoted string", "BLOB": "a '{...}' value", "LITERAL": "a literal",
    "DIM_LABELS": "dimension labels", "PADDING": "a padding like 0_0x1_1",
    "DXD": "a size like 3x3", "IOTA_GROUPS": "iota replica groups",
    "MESH_GROUPS": "mesh replica groups", "STACK_FRAMES": "the FileNames table",
    "CONSTANT": "'constant'", "PARAMETER": "'parameter'", "$END": "end of input",
    "HEAD": "an instruction", "CALL": "an opcode and its operands", "ATTRS": "','",
    "SIGNATURE": "a signature", "PARAMETER_CALL": "'parameter'",
    "TUPLE_OPEN": "'('", "ENTRY": "'ENTRY'", "ROOT": "'ROOT'",
}


def _describe(terminal: str) -> str:
    word = _TERMINAL_WORDS.get(terminal)
    if word is not None:
        return word
    try:
        pattern = _parser().get_terminal(terminal).pattern
    except KeyError:
        return terminal.lower()
    return f"'{pattern.value}'" if pattern.type == "str" else terminal.lower()


def _expected_words(expected: Iterable[str]) -> str:
    words = sorted({_describe(t) for t in expected if not t.startswith("__")})
    if not words:
        return "something else"
    if len(words) > 6:
        words = words[:6] + ["…"]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _syntax_error(text: str, path: str | None, err: UnexpectedInput) -> HloParseError:
    if not text.strip() or _COMMENTS_ONLY_RE.fullmatch(text):
        return _error(text, path, "empty input: expected 'HloModule' or a computation", 1, 1)
    if isinstance(err, UnexpectedToken):
        token = err.token
        expected = err.expected
        if token.value.startswith("/*"):
            return _error(text, path, "unterminated /* comment", token.line, token.column)
        if token.value.startswith("{") and "BLOB" in expected:
            return _error(text, path, "'{' has no matching '}' (unbalanced braces, an "
                          "unterminated string, or nesting deeper than 12 levels)",
                          token.line, token.column)
        if token.type == "LITERAL":  # the catch-all token: report one character
            return _unexpected_character(text, path, token.start_pos, token.line,
                                         token.column, expected)
        if token.type == "$END":
            line, column = _end_position(text)
            return _error(text, path, f"unexpected end of input; expected "
                          f"{_expected_words(expected)}", line, column)
        message = f"expected {_expected_words(expected)}, found {_show(token.value, 30)}"
        if token.type == "ATTR" and "NAME" in expected:
            message += " (a name directly followed by '=' reads as an attribute name; " \
                       "put a space before '=')"
        elif token.type in ("NAME", "HEAD") and "ATTR" in expected:
            message += " (write attributes as name=value with no space before '=')"
        return _error(text, path, message, token.line, token.column)
    if isinstance(err, UnexpectedCharacters):
        return _unexpected_character(text, path, err.pos_in_stream, err.line, err.column,
                                     err.allowed or ())
    if isinstance(err, UnexpectedEOF):
        line, column = _end_position(text)
        return _error(text, path, f"unexpected end of input; expected "
                      f"{_expected_words(err.expected)}", line, column)
    return _error(text, path, str(err).splitlines()[0], getattr(err, "line", 1) or 1,
                  getattr(err, "column", 1) or 1)


_WORD_BEFORE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_COMMENTS_ONLY_RE = re.compile(r"(?:\s+|//[^\n]*|/\*[\s\S]*?\*/)*")


def _unexpected_character(text: str, path: str | None, pos: int, line: int, column: int,
                          expected: Iterable[str]) -> HloParseError:
    char = text[pos] if pos < len(text) else ""
    if char == "[" and (word := _WORD_BEFORE_RE.search(text, 0, pos)):
        return _error(text, path, f"unknown element type '{word.group(0)}'", line,
                      column - len(word.group(0)))
    unclosed = {"{": "'{' without a matching '}'", "(": "'(' without a matching ')'",
                '"': "unterminated string", "'": "unterminated string"}.get(char)
    if unclosed:
        message = f"{unclosed} (or not allowed here; expected {_expected_words(expected)})"
    else:
        message = f"unexpected character {char!r}; expected {_expected_words(expected)}"
    return _error(text, path, message, line, column)


def _end_position(text: str) -> tuple[int, int]:
    stripped = text.rstrip()
    line = stripped.count("\n") + 1
    column = len(stripped) - (stripped.rfind("\n") + 1) + 1
    return line, column


def _error(text: str, path: str | None, message: str, line: int, column: int) -> HloParseError:
    return HloParseError(message, line, column, _source_line(text, line), path)


def _source_line(text: str, line: int) -> str:
    start = 0
    for _ in range(line - 1):
        start = text.find("\n", start) + 1
        if start == 0:
            return ""
    end = text.find("\n", start)
    return text[start:end if end >= 0 else len(text)].rstrip("\r")
