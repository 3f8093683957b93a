"""HLO text → :class:`hlo_shard.ir.Module`.

One LALR pass with lark's contextual lexer and an inline transformer: the records
are built while the text is read, with no intermediate parse tree. The grammar
(``grammar/hlo.lark``) reads the common forms as a few coarse tokens (a run of whole
instructions is usually one ``LINE`` token), which this module cuts into parts; the
attribute values the passes interpret are typed (see :data:`hlo_shard.ir.AttrValue`),
everything else is kept verbatim as :class:`~hlo_shard.ir.Raw`.

The semantic checks XLA's parser makes and that are cheap here are made here too,
at the position of the offending text: use before definition, duplicate names,
unknown or not-yet-defined computations, operand counts, several ROOT/ENTRY marks,
each opcode's allowed and required attributes (:mod:`hlo_shard.attributes`), metadata
fields, literal values and nesting against the constant's shape, operand and signature
shapes. Every failure is an :class:`HloParseError` in the user's words; no lark
exception escapes.

Optimized modules repeat a few hundred fused computations thousands of times, names
aside: a run of instructions of a shape read before in the same text is made from the
first one's records (see "repeated bodies" below), with the same result and positions.

Positions are resolved lazily: a location is a lark token or ``(token, offset)``
into a coarse token, turned into line and column only for a message.

State is per call: each thread has its own lark parser and builder, which holds one
parse's records from the start of the call to its end (no lock, nothing kept between
calls); only immutable things are shared (compiled regexes, a bounded cache of shapes).
See ``docs/frontend.md``.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import hashlib
import itertools
import re
import threading
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, cast
from collections.abc import Callable, Container, Iterable, Iterator

from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from hlo_shard.attributes import (
    ASYNC_SUGAR_ATTRIBUTES, COMMON_ATTRIBUTES, CONDITIONAL_FORMS, HEADER_ATTRIBUTES,
    METADATA_FIELDS, METADATA_INT_FIELDS, METADATA_STRING_FIELDS, OPCODE_ATTRIBUTES,
    REQUIRED_ATTRIBUTES,
)
from hlo_shard.errors import HloParseError
from hlo_shard.opinfo import OPCODES, OPERAND, OPINFO, PRED, SECOND
from hlo_shard.source import read_text
from hlo_shard.ir import (
    ALIAS_KINDS, COMPLEX_TYPES, ELEMENT_BITS, INTEGER_TYPES, Alias, ArrayShape, AttrValue,
    BufferDonor, Computation, ComputationList, ComputationRef, Ident, InputOutputAlias,
    Instruction, Layout, Module, Raw, ReplicaGroups, Shape, ShapeIndex, SliceRanges, SourceLoc,
    Str, TupleShape,
)
from hlo_shard.values import (
    LiteralError, c_unescape, check_literal, float_format, read_int_list, read_names,
    read_replica_groups, read_slice_ranges, show,
)

__all__ = ["OPCODES", "compatible", "cyclic_gc_paused", "grammar_path", "is_known_opcode",
           "parse", "parse_file", "read_shape"]

# ----------------------------------------------------------------------------- tables

#: Historical opcode names read as their current ones.
_RENAMED_OPCODES = {"cross-replica-sum": "all-reduce"}
_ASYNC_SUFFIXES = ("-start", "-update", "-done")


def is_known_opcode(opcode: str) -> bool:
    """A table opcode, or XLA's async sugar ``<op>-start/-update/-done``."""
    return opcode in OPCODES or any(
        opcode.endswith(suffix) and opcode[: -len(suffix)] in OPCODES
        for suffix in _ASYNC_SUFFIXES)


#: (min, max) operand counts; max None = unbounded. Opcodes without one are unchecked.
_OPERAND_COUNTS: dict[str, tuple[int, int | None]] = {
    name: info.arity for name, info in OPINFO.items() if info.arity is not None}

#: Every attribute name each opcode takes (XLA's async sugar ``<op>-start`` etc. included);
#: an opcode missing here is not XLA's and is reported as such.
_ALLOWED_ATTRIBUTES: dict[str, frozenset[str]] = {
    **{op + suffix: COMMON_ATTRIBUTES.union(
        OPCODE_ATTRIBUTES.get(op, ()) if suffix == "-start" else (), added)
       for op in OPCODES for suffix, added in ASYNC_SUGAR_ATTRIBUTES.items()},
    **{op: COMMON_ATTRIBUTES.union(OPCODE_ATTRIBUTES.get(op, ())) for op in OPCODES},
}
_ALLOWED_ATTRIBUTES.update(
    {old: _ALLOWED_ATTRIBUTES[new] for old, new in _RENAMED_OPCODES.items()})

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

_INT64_MAX = 2**63 - 1


def _count(text: str) -> int | None:
    return int(text) if text.lstrip("-").isdigit() and 1 <= int(text) <= _INT64_MAX else None


def _boolean(text: str) -> bool | None:
    return {"true": True, "false": False}.get(text)


def _booleans(text: str) -> Raw | None:
    return Raw(text) if text in ("true", "false") or re.fullmatch(
        r"\{\s*(?:(?:true|false)\s*(?:,\s*(?:true|false)\s*)*)?\}", text) else None


def _braced(text: str) -> Raw | None:
    return Raw(text) if text.startswith("{") else None


#: A ShapeIndex as XLA writes it: ``{}``, ``{0}``, ``{1,0}``.
_SHAPE_INDEX = r"\{\s*(?:\d+\s*(?:,\s*\d+\s*)*)?\}"
#: One ``{output}: (parameter, {index}[, kind])`` entry of ``input_output_alias``.
_ALIAS_ENTRY = re.compile(rf"\s*({_SHAPE_INDEX})\s*:\s*\(\s*(\d+)\s*,\s*({_SHAPE_INDEX})"
                          rf"\s*(?:,\s*([\w-]+)\s*)?\)\s*")
#: One ``(parameter, {index})`` entry of ``buffer_donor``.
_DONOR_ENTRY = re.compile(rf"\s*\(\s*(\d+)\s*,\s*({_SHAPE_INDEX})\s*\)\s*")


def _shape_index(text: str) -> ShapeIndex:
    return tuple(int(n) for n in text.strip("{} ").split(",") if n.strip())


def _entries(text: str, entry: re.Pattern[str]) -> list[re.Match[str]] | None:
    """The matches of ``entry`` that make up ``{ e, e, … }`` (None: it is not that)."""
    if not (text.startswith("{") and text.endswith("}")):
        return None
    inner, position = text[1:-1], 0
    found: list[re.Match[str]] = []
    if not inner.strip():
        return found
    while True:
        match = entry.match(inner, position)
        if match is None:
            return None
        found.append(match)
        position = match.end()
        if position == len(inner):
            return found
        if inner[position] != ",":
            return None
        position += 1


def _input_output_alias(text: str) -> InputOutputAlias | None:
    matches = _entries(text, _ALIAS_ENTRY)
    if matches is None or any(m.group(4) not in (None, *ALIAS_KINDS) for m in matches):
        return None
    return InputOutputAlias(tuple(
        Alias(_shape_index(m.group(1)), int(m.group(2)), _shape_index(m.group(3)), m.group(4))
        for m in matches))


def _buffer_donor(text: str) -> BufferDonor | None:
    matches = _entries(text, _DONOR_ENTRY)
    return None if matches is None else BufferDonor(tuple(
        (int(m.group(1)), _shape_index(m.group(2))) for m in matches))


#: Header attribute → (reader of its value text, None when it is not of the kind; the
#: kind in words); the typed ones are ints, bools and the donation configs, the others
#: kept verbatim.
_HEADER_VALUES: dict[str, tuple[Callable[[str], AttrValue | None], str]] = {
    "replica_count": (_count, "a positive integer (at most 2^63-1)"),
    "num_partitions": (_count, "a positive integer (at most 2^63-1)"),
    "is_scheduled": (_boolean, "true or false"),
    "alias_passthrough_params": (_boolean, "true or false"),
    "allow_spmd_sharding_propagation_to_output": (_booleans, "true, false or {true,false,...}"),
    "allow_spmd_sharding_propagation_to_parameters": (
        _booleans, "true, false or {true,false,...}"),
    "input_output_alias": (_input_output_alias,
                           "'{ {output}: (parameter, {index}, may-alias|must-alias), ... }'"),
    "buffer_donor": (_buffer_donor, "'{ (parameter, {index}), ... }'"),
}

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


# ------------------------------------------------------------------------ locations

#: A lark token, or ``(token, offset)`` into the text of a coarse token.
Loc = Token | tuple


def _position(loc: Loc) -> tuple[int, int]:
    if not isinstance(loc, tuple):  # lexed tokens have positions (1-based)
        return loc.line or 1, loc.column or 1
    token, offset = loc
    text = token.value
    newline = text.rfind("\n", 0, offset)
    line, column = _position(token)
    if newline < 0:
        return line, column + offset
    return line + text.count("\n", 0, offset), offset - newline


def _offset_in(loc: Loc, block: Token) -> int:
    """Where ``loc``, in ``block`` or in a token cut from it, is in ``block``'s text."""
    token, offset = loc if isinstance(loc, tuple) else (loc, 0)
    return token.start_pos - block.start_pos + offset


class _Located(Exception):
    """A semantic error found while building, at a location in the text."""

    def __init__(self, message: str, loc: Loc) -> None:
        super().__init__(message)
        self.message = message
        self.line, self.column = _position(loc)


def _fail(message: str, loc: Loc) -> NoReturn:
    raise _Located(message, loc)


def _matched(match: re.Match[str] | None) -> re.Match[str]:
    """A match the text is known to have: the lexer matched it already, or every part of
    the pattern is optional."""
    if match is None:
        raise RuntimeError("a pattern that always matches here did not")
    return match


def _bare(name: str) -> str:
    return name[1:] if name[0] == "%" else name


# ------------------------------------------------------------------------- shapes

#: Shape texts → shapes, shared by all parses: few distinct shapes, many uses, and the
#: shapes are immutable. Bounded: emptied when full (one module seldom has 10,000).
_SHAPE_CACHE: dict[str, ArrayShape] = {}
_SHAPE_CACHE_LIMIT = 10_000


def _array_shape(text: str, loc: Loc) -> ArrayShape:
    """An array shape token's text (cached)."""
    shape = _SHAPE_CACHE.get(text)
    if shape is None:
        try:
            shape = _read_array_shape(text.strip())
        except ValueError as err:
            _fail(f"bad shape {show(text)}: {err}", loc)
        if len(_SHAPE_CACHE) >= _SHAPE_CACHE_LIMIT:
            _SHAPE_CACHE.clear()
        _SHAPE_CACHE[text] = shape
    return shape


def _read_array_shape(text: str) -> ArrayShape:
    if text.startswith("b("):  # a buffer: b(f32[4]{0})
        return dataclasses.replace(_read_array_shape(text[2:-1].strip()), buffer=True)
    element_type, _, rest = text.partition("[")
    if element_type == "opaque_type":
        element_type = "opaque"
    if element_type not in ELEMENT_BITS:
        raise ValueError(f"unknown element type {element_type!r}")
    dims_text, _, layout_text = rest.partition("]")
    dims: list[int] = []
    dynamic: list[str] = []
    for item in filter(None, (d.strip() for d in dims_text.split(","))):
        kind = "?" if item == "?" else "<=" if item.startswith("<=") else ""
        digits = item[len(kind):]
        if kind != "?" and not (digits.isascii() and digits.isdigit()):
            raise ValueError(f"dimension {show(item)} is not a size")
        size = -1 if kind == "?" else int(digits)
        if size > _INT64_MAX:
            raise ValueError(f"dimension {digits} is beyond int64")
        dims.append(size)
        dynamic.append(kind)
    _check_byte_size(element_type, dims)
    layout = None
    layout_text = layout_text.strip()
    if layout_text:
        order_text, _, tail = layout_text[1:-1].partition(":")
        order = tuple(int(v) for v in order_text.split(",") if v.strip())
        if order and sorted(order) != list(range(len(dims))):
            raise ValueError(f"layout {{{order_text.strip()}}} is not a permutation of "
                             f"{len(dims)} dimensions")
        layout = Layout(order, tail.strip())
    return ArrayShape(element_type, tuple(dims), tuple(dynamic) if any(dynamic) else (),
                      layout)


def _check_byte_size(element_type: str, dims: list[int]) -> None:
    """Refuse what XLA's ``ValidateShapeSize`` refuses at compile time: an element count
    (bounded dimensions at their bound, unbounded ``?`` left out), multiplied dimension by
    dimension in order, or its size in bytes, beyond int64. (A zero dimension first keeps
    the running product at 0; XLA's product is order-dependent in the same way.)"""
    product = 1
    for size in dims:
        if size >= 0:
            product *= size
            if product > _INT64_MAX:
                raise ValueError("its element count overflows int64")
    if product * max(1, ELEMENT_BITS[element_type] // 8) > _INT64_MAX:
        raise ValueError("its size in bytes overflows int64")


_ARRAY_SHAPE_PATTERN = r"[a-z][a-z0-9_]*\[[^\]]*\](?:\s*\{(?=\s*[0-9:])[^{}]*\})?"
_SHAPE_PART_RE = re.compile(
    rf"\s+|/\*[^*]*\*+(?:[^/*][^*]*\*+)*/|b\(\s*{_ARRAY_SHAPE_PATTERN}\s*\)"
    rf"|{_ARRAY_SHAPE_PATTERN}|[(),]")


_PARAMETER_NAME = r"%?[A-Za-z_][A-Za-z0-9_.\-]*"
#: A signature whose parameters are all arrays of plain dimensions and layouts, the
#: common form: one match, no shape read (the parameters' own instructions say their
#: shapes); any other is read shape by shape.
_PLAIN_ARRAY = r"[a-z][a-z0-9_]*\[[0-9,\s<=?]*\](?:\s*\{[0-9,\s]*\})?"
_ARRAY_PARAMETERS_RE = re.compile(
    rf"\(\s*(?:{_PARAMETER_NAME}\s*:\s*{_PLAIN_ARRAY}"
    rf"(?:\s*,\s*{_PARAMETER_NAME}\s*:\s*{_PLAIN_ARRAY})*)?\s*\)\s*->")
#: A parameter's ``name:`` at the start of the list or after a comma (comments kept).
_PARAMETER_NAME_RE = re.compile(
    rf"(?<=[(,])(\s*(?:/\*[^*]*\*+(?:[^/*][^*]*\*+)*/\s*)*){_PARAMETER_NAME}\s*:")


def _check_parameter_list(token: Token, arrow: int) -> None:
    """A coarse signature's parameter list (before ``arrow``) is names with shapes, as
    XLA's parser reads it: ``(x: f32[4 ]]]]])`` was taken, the header rewritten."""
    text = token.value
    if _ARRAY_PARAMETERS_RE.match(text):
        return
    _read_shape(_PARAMETER_NAME_RE.sub(r"\1", text[:arrow].rstrip()), (token, 0))


def _read_shape(text: str, loc: Loc) -> Shape:
    """Any shape, tuples included, from text (the result of a coarse signature)."""
    stack: list[list[Shape]] = [[]]
    covered = 0
    for match in _SHAPE_PART_RE.finditer(text):
        if match.start() != covered:
            break  # text that is no part of a shape
        covered = match.end()
        part = match.group(0)
        if part == "(":
            stack.append([])
        elif part == ")" and len(stack) > 1:
            elements = stack.pop()
            stack[-1].append(TupleShape(tuple(elements)))
        elif part[0].isalpha():
            stack[-1].append(_array_shape(part, loc))
    if len(stack) != 1 or len(stack[0]) != 1 or covered != len(text):
        _fail(f"bad shape {show(text)}", loc)
    return stack[0][0]


def read_shape(text: str) -> Shape:
    """A shape written as HLO text writes it (``(f32[4,6]{1,0}, s32[])``); a
    :class:`HloParseError` where it is none."""
    try:
        return _read_shape(text.strip(), Token("SHAPE", text, 0, 1, 1))
    except _Located as err:
        raise _error(text, None, err.message, err.line, err.column) from None


def _shape(child: Token | TupleShape) -> Shape:
    """A grammar ``shape`` child: a SHAPE token or an already built tuple shape."""
    return _array_shape(child.value, child) if isinstance(child, Token) else child


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
    text = f"{shape.element_type}[{','.join(map(str, shape.dims))}]"
    return f"b({text})" if shape.buffer else text


# ---------------------------------------------------------------- attribute values


def _computation_ref(kind: str, text: str) -> AttrValue:
    return ComputationRef(_bare(text)) if kind == "NAME" else ComputationList(read_names(text))


def _computation_list(kind: str, text: str) -> AttrValue:
    return ComputationList((_bare(text),) if kind == "NAME" else read_names(text))


def _blob_reader(read: Callable[[str], Any]) -> Callable[[str, str], Any]:
    """A reader for a braced value; other value kinds fall back to the default."""
    return lambda kind, text: read(text) if kind == "BLOB" else _by_kind(kind, text)


def _name_value(text: str) -> AttrValue:
    if text == "true" or text == "false":
        return text == "true"
    return Raw(text) if text[0] == "%" else Ident(text)


#: Value readers by the kind of the value's token (the default).
_KIND_READERS: dict[str, Callable[[str], AttrValue]] = {
    "INT": int,
    "NAME": _name_value,
    "STRING": lambda text: Str(c_unescape(text)),
    "FLOAT": lambda text: Raw(text) if "(" in text else float(text),
}


def _by_kind(kind: str, text: str) -> AttrValue:
    reader = _KIND_READERS.get(kind)
    return reader(text) if reader is not None else Raw(text)


#: Value readers by attribute name, for the attributes the passes interpret.
_ATTRIBUTE_READERS = {
    "backend_config": lambda kind, text: Raw(text),
    "replica_groups": lambda kind, text: read_replica_groups(text),
    "slice": _blob_reader(read_slice_ranges),
    **{key: _computation_ref for key in _COMPUTATION_ATTRS},
    **{key: _computation_list for key in _COMPUTATION_LIST_ATTRS},
    **{key: _blob_reader(read_int_list) for key in _INT_LIST_ATTRS},
}


def _attribute_value(key: str, kind: str, text: str, loc: Loc) -> AttrValue:
    """Type an instruction attribute by its name, else by the kind of its token."""
    reader = _ATTRIBUTE_READERS.get(key)
    try:
        if reader is not None:
            return reader(kind, text)
        if kind == "BLOB":
            return Raw(text)
        return _by_kind(kind, text)
    except ValueError as err:
        _fail(str(err), loc)


def _unexpected_attribute(key: str, allowed: Iterable[str]) -> str:
    """XLA's words for an attribute name the opcode (or the metadata) does not take."""
    return f'unexpected attribute "{key}". Allowed attributes: {", ".join(sorted(allowed))}'


def _within(loc: Loc, offset: int) -> Loc:
    """The location ``offset`` characters into the value found at ``loc``."""
    return (loc[0], loc[1] + offset) if isinstance(loc, tuple) else (loc, offset)


_SPACE = r"(?:\s|/\*[^*]*\*+(?:[^/*][^*]*\*+)*/|//[^\n]*)*"
_QUOTED = r"""(?:"[^"\\]*(?:\\[\s\S][^"\\]*)*"|'[^'\\]*(?:\\[\s\S][^'\\]*)*')"""
_BRACED_INTS = rf"\{{{_SPACE}(?:-?[0-9]+{_SPACE}(?:,{_SPACE}-?[0-9]+{_SPACE})*)?\}}"
#: One ``[,] key=value`` of a metadata value; a key without ``=`` leaves ``key`` empty.
_METADATA_FIELD_RE = re.compile(
    rf"{_SPACE}(?P<comma>,{_SPACE})?(?:(?P<key>[A-Za-z_][A-Za-z0-9_.\-]*)={_SPACE}"
    rf"(?P<value>{_QUOTED}|-?[0-9]+|{_BRACED_INTS})?)?")
#: The value syntax of each metadata field's kind.
_METADATA_VALUE_SYNTAX = {"string": _QUOTED, "integer": r"-?[0-9]{1,9}(?![0-9])",
                          "list of integers": _BRACED_INTS}
#: Metadata as printers write it: each field at most once, in one order (XLA's, give or
#: take), separated by spaces. One match reads the common case; the rest goes field by field.
_PRINTED_METADATA_RE = re.compile(r"\{\s*" + "".join(
    rf"(?:{key}={_METADATA_VALUE_SYNTAX[kind]}\s*)?" for key, kind in (
        ("op_type", "string"), ("op_name", "string"), ("source_file", "string"),
        ("source_line", "integer"), ("source_end_line", "integer"),
        ("source_column", "integer"), ("source_end_column", "integer"),
        ("profile_type", "list of integers"), ("deduplicated_name", "string"),
        ("scheduling_name", "string"), ("stack_frame_id", "integer"),
        ("metadata_payload", "string"))) + r"\}")
#: The kind of a metadata value by its first character.
_METADATA_VALUE_KINDS = {'"': "string", "'": "string", "{": "list of integers"}
_METADATA_KINDS = {
    **{key: "string" for key in METADATA_STRING_FIELDS},
    **{key: "integer" for key in METADATA_INT_FIELDS},
    "profile_type": "list of integers",
}
_INT32 = range(-2**31, 2**31)


def _check_metadata(text: str, loc: Loc) -> None:
    """``{op_name="..." source_line=3}``: OpMetadata's fields, each once, with values of
    their kind, separated by spaces or commas (XLA's ParseMetadata)."""
    if _PRINTED_METADATA_RE.fullmatch(text):
        return
    if text[0] != "{":
        _fail("expects '{' to start sub attributes", loc)
    seen: set[str] = set()
    position, end = 1, len(text) - 1
    while True:
        field = _matched(_METADATA_FIELD_RE.match(text, position))
        key = field.group("key")
        if key is None:
            if field.end() == end and field.group("comma") is None:
                return
            _fail("expects attribute name", _within(loc, field.end()))
        if key not in METADATA_FIELDS:
            _fail(_unexpected_attribute(key, METADATA_FIELDS), _within(loc, field.start("key")))
        if key in seen:
            _fail(f"attribute {key} already exists", _within(loc, field.start("key")))
        seen.add(key)
        kind, value = _METADATA_KINDS[key], field.group("value")
        value_loc = _within(loc, field.start("value") if value is not None else field.end())
        if value is None or _METADATA_VALUE_KINDS.get(value[0], "integer") != kind:
            _fail(f"expects {kind}", value_loc)
        if kind == "integer" and int(value) not in _INT32:
            _fail("value out of range for int32", value_loc)
        position = field.end()


# --------------------------------------------------------------- literal checking

def _check_shaped_literal(text: str, loc: Loc) -> None:
    """``literal=s32[2]{0} {1, 2}`` (custom-call): the literal against its shape."""
    shape_end = _matched(_patterns()["shape"].match(text)).end()
    _check_literal(_array_shape(text[:shape_end], loc), text[shape_end:],
                   _within(loc, shape_end))


def _check_tuple_literal(text: str, loc: Loc) -> None:
    """``literal=( s32[] 1, ( f32[2]{0} {1, 2} ), )``: each element a shape and its
    literal, or a tuple of them; a trailing comma is allowed (as XLA)."""
    items = _top_level_items(text, 1, len(text) - 1)
    if items and not text[items[-1][0]:items[-1][1]].strip():
        items.pop()  # `(a, )` and `()`
    for start, end in items:
        item = text[start:end]
        offset = start + len(item) - len(item.lstrip())
        item = item.strip()
        if item.startswith("("):
            _check_tuple_literal(item, _within(loc, offset))
        elif _patterns()["shape"].match(item):
            _check_shaped_literal(item, _within(loc, offset))
        else:
            _fail("expects a shape and its literal, or a tuple of them", _within(loc, offset))


def _top_level_items(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """(start, end) of the comma-separated items of ``text[start:end]`` outside any
    braces or parentheses."""
    items, depth, item_start = [], 0, start
    for position in range(start, end):
        char = text[position]
        if char in "({":
            depth += 1
        elif char in ")}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append((item_start, position))
            item_start = position + 1
    items.append((item_start, end))
    return items


#: Checks of attribute values by (attribute, value kind) that XLA parses as it reads them.
_VALUE_CHECKS = {
    ("literal", "SHAPED_LITERAL"): _check_shaped_literal,
    ("literal", "PARENS"): _check_tuple_literal,
    ("outfeed_shape", "PARENS"): _read_shape,
}


def _check_literal(shape: Shape, literal: str, loc: Loc) -> None:
    """A constant's literal against its shape (XLA checks it exactly); positions of the
    failures are within the literal."""
    if not isinstance(shape, ArrayShape) or -1 in shape.dims:
        return
    try:
        check_literal(shape.element_type, shape.dims, literal)
    except LiteralError as err:
        _fail(str(err), _within(loc, err.offset))


# ------------------------------------------------------------------ shape inference


_TOKEN = ArrayShape("token", ())

#: A shape rule: (operands, attributes, computations defined so far) → the result shape,
#: or None where the operands do not give one.
ShapeRule = Callable[[list[Instruction], dict[str, AttrValue], dict[str, Computation]],
                     Shape | None]


def _first_array(operands: list[Instruction], attrs: dict[str, AttrValue],
                 computations: dict[str, Computation]) -> ArrayShape | None:
    first = operands[0].shape if operands else None
    return first if isinstance(first, ArrayShape) else None


def _predicate_shape(operands: list[Instruction], attrs: dict[str, AttrValue],
                     computations: dict[str, Computation]) -> Shape | None:
    first = _first_array(operands, attrs, computations)
    return ArrayShape("pred", first.dims, first.dynamic) if first is not None else None


def _second_operand_shape(operands: list[Instruction], attrs: dict[str, AttrValue],
                          computations: dict[str, Computation]) -> Shape | None:
    return operands[1].shape if len(operands) > 1 else None


def _tuple_element_shape(operands: list[Instruction], attrs: dict[str, AttrValue],
                         computations: dict[str, Computation]) -> Shape | None:
    first, index = operands[0].shape if operands else None, attrs.get("index")
    if isinstance(first, TupleShape) and isinstance(index, int) and 0 <= index < len(
            first.elements):
        return first.elements[index]
    return None


def _dot_shape(operands: list[Instruction], attrs: dict[str, Any],
               computations: dict[str, Computation]) -> Shape | None:
    """Batch dimensions, then the lhs's free ones, then the rhs's, in the operands' more
    precise element type (XLA's InferDotOpShape); static operands only."""
    if len(operands) != 2:
        return None
    lhs, rhs = operands[0].shape, operands[1].shape
    if not (isinstance(lhs, ArrayShape) and isinstance(rhs, ArrayShape)
            and not lhs.dynamic and not rhs.dynamic):
        return None
    dims = {key: attrs.get(key, ()) for key in (
        "lhs_batch_dims", "rhs_batch_dims", "lhs_contracting_dims", "rhs_contracting_dims")}
    if not all(isinstance(v, tuple) and all(isinstance(d, int) for d in v)
               for v in dims.values()):
        return None
    lhs_used = set(dims["lhs_batch_dims"]) | set(dims["lhs_contracting_dims"])
    rhs_used = set(dims["rhs_batch_dims"]) | set(dims["rhs_contracting_dims"])
    if not (lhs_used <= set(range(lhs.rank)) and rhs_used <= set(range(rhs.rank))):
        return None
    result = ([lhs.dims[d] for d in dims["lhs_batch_dims"]]
              + [n for d, n in enumerate(lhs.dims) if d not in lhs_used]
              + [n for d, n in enumerate(rhs.dims) if d not in rhs_used])
    element_type = max(lhs.element_type, rhs.element_type, key=_precision_rank)
    return ArrayShape(element_type, tuple(result))


def _precision_rank(element_type: str) -> tuple:
    """XLA's order of element types by precision (``HigherPrecisionType``): complex
    first, then float range, float precision, bit width, signed over unsigned."""
    component = {"c64": "f32", "c128": "f64"}.get(element_type, element_type)
    exponent_range, significand = float_format(component) or (-1, -1)
    width = int(component[1:]) if component in INTEGER_TYPES else ELEMENT_BITS.get(component, 0)
    return (element_type in COMPLEX_TYPES, exponent_range, significand, width,
            component[0] == "s")


def _conditional_shape(operands: list[Instruction], attrs: dict[str, AttrValue],
                       computations: dict[str, Computation]) -> Shape | None:
    """The root shape of the first branch (every branch has the same one)."""
    branch = attrs.get("true_computation", attrs.get("branch_computations"))
    name = branch.name if isinstance(branch, ComputationRef) else (
        branch.names[0] if isinstance(branch, ComputationList) and branch.names else None)
    callee = computations.get(name) if name is not None else None
    return callee.root.shape if callee is not None else None


#: The inference rule of each :attr:`~hlo_shard.opinfo.OpInfo.shape_from`.
_SHAPE_FROM: dict[str, ShapeRule] = {
    OPERAND: _first_array, SECOND: _second_operand_shape, PRED: _predicate_shape}

#: Result shapes for the opcodes whose shape the text may leave out (a subset of
#: XLA's ``CanInferShape``); an opcode not listed needs its shape written.
_SHAPE_RULES: dict[str, ShapeRule] = {
    **{name: _SHAPE_FROM[info.shape_from] for name, info in OPINFO.items() if info.shape_from},
    "replica-id": lambda operands, attrs, computations: ArrayShape("u32", ()),
    "partition-id": lambda operands, attrs, computations: ArrayShape("u32", ()),
    "after-all": lambda operands, attrs, computations: _TOKEN,
    "tuple": lambda operands, attrs, computations: TupleShape(
        tuple(o.shape for o in operands)),
    "get-tuple-element": _tuple_element_shape,
    "dot": _dot_shape,
    "conditional": _conditional_shape,
}


def _infer_shape(opcode: str, loc: Loc, operands: list[Instruction],
                 attrs: dict[str, AttrValue], computations: dict[str, Computation]) -> Shape:
    """Result shape for the opcodes whose shape XLA lets the text leave out."""
    rule = _SHAPE_RULES.get(opcode)
    shape = rule(operands, attrs, computations) if rule is not None else None
    if shape is None:
        _fail(f"the result shape of '{opcode}' cannot be inferred; write it before the "
              "opcode", loc)
    return shape


def _send_shape(operands: list[Instruction]) -> Shape | None:
    return TupleShape((operands[0].shape, ArrayShape("u32", ()), _TOKEN)) if operands else None


def _recv_done_shape(operands: list[Instruction]) -> Shape | None:
    recv = operands[0] if operands else None
    if recv is None or recv.opcode != "recv" or not isinstance(recv.shape, TupleShape) \
            or not recv.shape.elements:
        return None
    return TupleShape((recv.shape.elements[0], _TOKEN))


#: Opcodes whose result shape XLA derives from the operands whatever the text declares
#: (its ``CreateSend``, ``CreateSendDone``, ``CreateRecvDone`` take no shape).
_DERIVED_SHAPES: dict[str, Callable[[list[Instruction]], Shape | None]] = {
    "send": _send_shape,
    "send-done": lambda operands: _TOKEN,
    "recv-done": _recv_done_shape,
}


def _check_conditional_form(selector: Instruction, attributes: list[tuple], loc: Loc) -> None:
    """A ``pred`` selector takes true/false_computation, an index branch_computations;
    XLA refuses the other spelling and a missing one."""
    shape = selector.shape
    form = CONDITIONAL_FORMS[isinstance(shape, ArrayShape) and shape.element_type == "pred"]
    allowed = COMMON_ATTRIBUTES.union(form)
    for key, key_loc, *_ in attributes:
        if key not in allowed:
            _fail(_unexpected_attribute(key, allowed), key_loc)
    given = {key for key, *_ in attributes}
    for required in form:
        if required not in given:
            _fail(f"attribute {required} is expected but not seen", loc)


# --------------------------------------------------------------- coarse-token parts

_NAME_RE = re.compile(r"%?[A-Za-z_][A-Za-z0-9_.\-]*(?:#[0-9]+)*")
_BARE_NAME_RE = re.compile(r"%?([A-Za-z_][A-Za-z0-9_.\-]*(?:#[0-9]+)*)")
_BLOCK_COMMENT_RE = re.compile(r"/\*[^*]*\*+(?:[^/*][^*]*\*+)*/")
_INT_RE = re.compile(r"[0-9]+")
_PATTERNS: dict[str, re.Pattern] | None = None


def _patterns() -> dict[str, re.Pattern]:
    """Regexes that cut coarse tokens into parts, built from the grammar's own terminal
    patterns so that the two never disagree (once; published whole, for threads)."""
    global _PATTERNS
    if _PATTERNS is None:
        lark = _parser()

        def part(name: str) -> str:
            return lark.get_terminal(name).pattern.to_regexp()

        values = "|".join(f"(?P<{kind}>{part(kind)})" for kind in _ATTRS_VALUE_KINDS)
        head = (rf"(?:(?P<root>ROOT)\s+)?(?P<name>%[A-Za-z_][A-Za-z0-9_.\-]*(?=\s*=)|"
                rf"[A-Za-z_][A-Za-z0-9_.\-]*(?=\s+=))\s*=\s*(?P<shape>{part('SHAPE')})?")
        _PATTERNS = {
            "pair": re.compile(
                rf"\s*,\s*(?P<key>{part('ATTR')})(?:{values})(?=\s|,|\}}|/[*/]|$)"),
            "head": re.compile(head),
            "shape": re.compile(part("SHAPE")),
            "line": re.compile(
                rf"{head}(?:(?P<parameter>{part('PARAMETER_CALL')})|"
                rf"(?P<constant>{part('CONSTANT_CALL')})|(?P<call>{part('CALL')}))"
                rf"(?P<attrs>{part('ATTRS')})?"),
        }
    return _PATTERNS


#: The value kinds an ATTRS token takes (see ``_SIMPLE_VALUE`` in the grammar).
_ATTRS_VALUE_KINDS = ("BLOB", "STRING", "IOTA_GROUPS", "MESH_GROUPS", "FLOAT", "INT", "NAME")


def _split_attributes(token: Token, start: int, end: int) -> list[tuple]:
    """``, k=v, k=v`` → [(key, key loc, value kind, value text, value loc)]."""
    items = []
    for match in _patterns()["pair"].finditer(token.value, start, end):
        kind = match.lastgroup
        key_start = match.start("key")
        items.append((match.group("key")[:-1], (token, key_start), kind, match.group(kind),
                      (token, match.start(kind))))
    return items


def _call(token: Token, start: int, end: int) -> tuple:
    """``opcode(%a, b, /*index=2*/%c)`` → an rhs whose operands are found on demand."""
    paren = token.value.index("(", start)
    return ("names", token.value[start:paren], (token, start), (token, paren, end))


def _constant_call(token: Token, start: int, end: int) -> tuple:
    text = token.value
    open_paren = text.index("(", start)
    close_paren = text.rindex(")", start, end)
    return ("constant", "constant", (token, start),
            (text[open_paren + 1:close_paren], (token, open_paren + 1)))


def _parameter_call(token: Token, start: int, end: int) -> tuple:
    digits = _matched(_INT_RE.search(token.value, start, end))
    return ("parameter", "parameter", (token, start),
            (int(digits.group(0)), (token, digits.start())))


#: LINE parts → rhs readers, by the name of the group that matched.
_RHS_READERS = {"call": _call, "constant": _constant_call, "parameter": _parameter_call}


def _operand_names(token: Token, paren: int, end: int) -> list[str]:
    text = token.value[paren:end]
    if "/*" in text:
        text = _BLOCK_COMMENT_RE.sub("", text)
    return _BARE_NAME_RE.findall(text)


def _operand_locations(token: Token, paren: int, end: int) -> list[Loc]:
    text = token.value[:end]
    if "/*" in text:  # blank the comments out, keeping offsets
        text = _BLOCK_COMMENT_RE.sub(lambda m: " " * len(m.group(0)), text)
    return [(token, m.start()) for m in _NAME_RE.finditer(text, paren)]


def _unique(base: str, taken: Container[str], start: int = 1) -> str:
    """``base``, else ``base.<n>`` for the first free n ≥ ``start`` (XLA's uniquer)."""
    if base not in taken:
        return base
    return next(f"{base}.{n}" for n in itertools.count(start) if f"{base}.{n}" not in taken)


# ------------------------------------------------------------------ repeated bodies
# XLA's optimized modules repeat a few hundred distinct fused computations and reducers
# thousands of times, each differing from another only in its names. A run of
# instructions that starts a computation is read once per shape (its text with the
# ``%names`` cut out); a later run of that shape is made from the first's records with
# its own names and positions, without reading its parts again. What a record holds is
# all the first run's reading produced; a run whose reading depended on anything but
# its own text, or whose values hold names other than as operands and callees, is not
# recorded (it is read each time).

#: A ``%name`` in a run: the instruction names, operands and callees there are.
_RUN_NAME_RE = re.compile(r"(%[A-Za-z_][A-Za-z0-9_.\-]*)")

#: Where something sits in a recorded run: (its offset there, how many ``%names`` start
#: before it), so that a run of the same shape finds it past its own names' lengths.
_At = tuple[int, int]


class _Run(NamedTuple):
    """A run's text cut at its ``%names``."""

    #: The text between its ``%names``, and per name the index of its first occurrence.
    shape: tuple
    #: Its ``%names`` in text order.
    occurrences: list[str]
    #: Its distinct names, bare, in the order of their first occurrence.
    names: list[str]


def _run_of(text: str) -> _Run:
    pieces = _RUN_NAME_RE.split(text)
    occurrences = pieces[1::2]
    first: dict[str, int] = {}
    indices = tuple([first.setdefault(name, len(first)) for name in occurrences])
    return _Run((tuple(pieces[0::2]), indices), occurrences, [name[1:] for name in first])


@dataclasses.dataclass(frozen=True, slots=True)
class _Made:
    """One instruction of a recorded run; names are indices into the run's distinct
    names."""

    name: int
    opcode: str
    shape: Shape
    operands: tuple[int, ...]
    #: The recorded run's own (copied per instruction made; the callees replaced).
    attributes: dict[str, AttrValue]
    callees: tuple[tuple[str, int | tuple[int, ...]], ...]
    parameter_number: int | None
    literal: str | None
    name_at: _At
    #: The newline before its name (None: on the run's first line) and lines into the run.
    line_start: _At | None
    line: int
    number_at: _At | None


@dataclasses.dataclass(frozen=True, slots=True)
class _Recipe:
    """What reading one run produced, to make another of its shape from."""

    occurrences: tuple[str, ...]
    made: tuple[_Made, ...]
    #: Name indices of the callees (checked defined), the root's and where its ``ROOT``
    #: is.
    callees: tuple[int, ...]
    root: tuple[int, _At] | None


def _name_free(value: AttrValue, names: Container[str]) -> bool:
    """An attribute value (not a callee reference) that holds no name a run of the same
    shape could have another of: numbers, replica groups, slices, and text without a
    ``%name`` or one of ``names``."""
    if isinstance(value, (bool, int, float, SliceRanges, ReplicaGroups)):
        return True
    if isinstance(value, tuple):
        return all(_name_free(item, names) for item in value)
    if isinstance(value, Raw):
        return "%" not in value.text
    if isinstance(value, Str):
        return "%" not in value.value
    if isinstance(value, Ident):
        return "%" not in value.name and value.name not in names
    return False


# ------------------------------------------------------------------ the transformer

_PLACEHOLDER = "\0nested"


class _NoSuchElement(Exception):
    """A compact operand ``t#i`` whose ``t`` has no element ``i`` (its message)."""


class _Scope:
    """What is being collected for the computation currently read."""

    __slots__ = ("names", "instructions", "root_loc", "root_name", "parameter_numbers",
                 "first_unknown_use", "first_missing_attribute", "nested_count", "tuple_depth",
                 "hoisted_bases", "tuple_elements")

    def __init__(self) -> None:
        self.names: dict[str, Instruction] = {}
        self.instructions: list[Instruction] = []
        self.root_loc: Loc | None = None
        self.root_name: str | None = None
        self.parameter_numbers: dict[int, Loc] = {}
        self.first_unknown_use: tuple[str, Loc] | None = None
        #: Checked when the computation closes, so a truncated file says so instead.
        self.first_missing_attribute: tuple[str, Loc] | None = None
        self.nested_count = 0
        self.tuple_depth: dict[int, int] = {}
        #: Placeholder → the name XLA gives that hoisted instruction (default
        #: ``<opcode>.anon``), made unique when the computation closes.
        self.hoisted_bases: dict[str, str] = {}
        #: ``t#1#0`` → the placeholder of the get-tuple-element made for it (one each).
        self.tuple_elements: dict[str, str] = {}


class _Builder(Transformer):
    """Grammar callbacks. Reductions arrive in text order, so each computation's
    instructions are checked and collected as they are read.

    An rhs is ``(kind, opcode, opcode loc, payload)``: kind ``"op"`` with a list of
    ``(name, loc, declared shape)``, ``"names"`` with ``(token, start, end)`` of a plain
    operand list, ``"constant"`` with ``(literal, loc)``, ``"parameter"`` with
    ``(number, loc)``. An attribute is ``(key, key loc, value kind, text, value loc)``.
    """

    def __init__(self) -> None:
        super().__init__(visit_tokens=False)
        self.lark: Lark | None = None  # the parser this builder is bound to
        self.reset()

    def reset(self) -> None:
        self.computations: dict[str, Computation] = {}
        self.computation_order: list[Computation] = []
        self.entry_loc: Loc | None = None
        self.entry_name: str | None = None
        self.unresolved: list[tuple[str, Loc]] = []
        self.scope = _Scope()
        #: Metadata texts and (shape, literal) pairs of this parse that passed their
        #: check: a step's module repeats a few of each many times, and the check of a
        #: text depends on the text alone.
        self.checked_metadata: set[str] = set()
        self.checked_literals: set[tuple[Shape, str]] = set()
        #: Runs read so far, by shape (see "repeated bodies").
        self.recipes: dict[tuple, _Recipe | None] = {}

    # Module --------------------------------------------------------------------------
    def start(self, children: list) -> Module:
        header, stack_frames = children[0], children[1]
        name, attributes = header if header is not None else (None, {})
        comps = self.computation_order
        if not any(c.is_entry for c in comps):
            comps[-1].is_entry = True
        for callee, loc in self.unresolved:
            if callee in self.computations:
                _fail(f"computation '{callee}' is used before it is defined (define "
                      "callees first)", loc)
            _fail(f"unknown computation '{callee}'", loc)
        return Module(name or f"module_{self.entry_name or comps[-1].name}", list(comps),
                      attributes, stack_frames.value if stack_frames is not None else None)

    def header(self, children: list) -> tuple[str, dict[str, AttrValue]]:
        name, *attributes = children
        if name.type == "NAME_COLON" and name.value[0] == "%":
            _fail("expects name", name)  # XLA takes `HloModule m:`, not `%m:`
        header: dict[str, AttrValue] = {}
        for key, key_loc, _kind, text, loc in attributes:
            if key not in HEADER_ATTRIBUTES:
                _fail(_unexpected_attribute(key, HEADER_ATTRIBUTES), key_loc)
            if key in header:
                _fail(f"attribute {key} already exists", key_loc)
            read, words = _HEADER_VALUES.get(key, (_braced, "a '{...}' value"))
            value = read(text)
            if value is None:
                _fail(f"'{key}' expects {words}, found {show(text)}", loc)
            header[key] = value
        return _bare(name.value.rstrip(":")), header

    # Computations -------------------------------------------------------------------
    def computation(self, children: list) -> Computation:
        entry, name_token, signature, *rest = children
        name = _bare(name_token.value.rstrip(":"))
        if name in self.computations:
            _fail(f"duplicate computation name '{name}'", name_token)
        scope = self._close_scope(name)
        if entry is not None:
            if self.entry_loc is not None:
                _fail(f"second ENTRY computation (the first is at line "
                      f"{_position(self.entry_loc)[0]})", entry)
            self.entry_loc, self.entry_name = entry, name
        comp = self._add_computation(name, scope, entry is not None, name_token)
        for item in rest:
            if isinstance(item, tuple):
                key, key_loc, kind, text, _ = item
                if key != "execution_thread" or kind != "STRING":
                    _fail("a computation takes only execution_thread=\"...\" after its body",
                          key_loc)
                comp.execution_thread = c_unescape(text)
        if signature is not None and not compatible(signature, comp.root.shape):
            _fail(f"the root of '{name}' has shape {_format_shape(comp.root.shape)}, not "
                  f"the {_format_shape(signature)} its signature declares", name_token)
        return comp

    def signature(self, children: list) -> Shape:
        token = children[0]
        arrow = token.value.rindex("->")
        _check_parameter_list(token, arrow)
        return _read_shape(token.value[arrow + 2:], (token, arrow + 2))

    def long_signature(self, children: list) -> Shape:
        return _shape(children[-1])

    def parameter_decl(self, children: list) -> None:
        return None

    def inline_body(self, children: list) -> _Scope:
        return self._close_scope("inline computation")

    def _add_computation(self, name: str, scope: _Scope, is_entry: bool,
                         loc: Loc) -> Computation:
        line, column = _position(loc)
        comp = Computation(name, scope.instructions, scope.root_name, is_entry=is_entry,
                           loc=SourceLoc(line, column))
        self.computations[name] = comp
        self.computation_order.append(comp)
        return comp

    def _close_scope(self, computation: str) -> _Scope:
        """End-of-computation checks and names for nested operands; starts a new scope."""
        scope, self.scope = self.scope, _Scope()
        if scope.first_unknown_use is not None:
            name, loc = scope.first_unknown_use
            defined = scope.names.get(name)
            if defined is not None and defined.loc is not None:
                _fail(f"'{name}' is used before its definition at line {defined.loc.line}",
                      loc)
            _fail(f"use of undefined instruction '{name}' in '{computation}'", loc)
        count = len(scope.parameter_numbers)
        for number, loc in scope.parameter_numbers.items():
            if number >= count:
                _fail(f"invalid parameter number: '{computation}' has {count} parameter"
                      f"{'s' * (count != 1)}, numbered [0, {count}), got {number}", loc)
        if scope.first_missing_attribute is not None:
            _fail(*scope.first_missing_attribute)
        if scope.nested_count:
            _name_nested(scope)
        return scope

    def _inline_computation(self, text: str, loc: Loc) -> ComputationRef:
        """``to_apply={ a = ... ROOT r = ... }``: parse the body as a computation of its
        own, named as XLA names it (``_``), placed before its caller."""
        line, column = _position(loc)
        padding = "\n" * (line - 1) + " " * column  # keeps positions exact
        if self.lark is None:
            raise RuntimeError("the builder is not bound to a parser")
        outer, self.scope = self.scope, _Scope()
        try:
            # The transformer turns the tree into the body's scope.
            scope = cast(_Scope, self.lark.parse(padding + text[1:-1], start="inline_body"))
        finally:
            self.scope = outer
        name = _unique("_", self.computations)
        self._add_computation(name, scope, False, loc)
        return ComputationRef(name)

    # Shapes -------------------------------------------------------------------------
    def tuple_shape(self, children: list) -> TupleShape:
        open_paren, *elements = children
        shapes = tuple(_shape(e) for e in elements if e is not None)
        depths = self.scope.tuple_depth
        depth = 1 + max((depths.get(id(s), 0) for s in shapes), default=0)
        if depth > _MAX_TUPLE_DEPTH:
            _fail(f"tuple shape nests deeper than {_MAX_TUPLE_DEPTH} levels", open_paren)
        shape = TupleShape(shapes)
        depths[id(shape)] = depth
        return shape

    # Instructions -------------------------------------------------------------------
    def line(self, children: list) -> Instruction:
        """``LINE``: a run of whole instructions in the common form (one token, so the
        LALR machinery is paid once per run), each cut into its parts on a token of its
        own (positions count from its line); attributes in the fine-grained form after
        the run belong to its last instruction. A run that starts a computation and has
        the shape of one read before is made from that one's records."""
        block, *attributes = children
        run = None
        if not attributes and not self.scope.names:
            run = _run_of(block.value)
            recipe = self.recipes.get(run.shape)
            if recipe is not None:
                made = self._remake(recipe, block, run)
                if made is not None:
                    return made
        before = len(self.unresolved), len(self.computation_order)
        text, pattern = block.value, _patterns()["line"]
        start, line, column = 0, block.line, block.column
        name_offsets: list[int] = []
        shaped = True
        while True:
            match = _matched(pattern.match(text, start))
            end = match.end()
            last = end >= len(text)
            token = block if start == 0 and last else \
                Token("LINE", text[start:end], block.start_pos + start, line, column)
            inst = self._line(token, match, start, attributes if last else [])
            name_offsets.append(match.start("name"))
            shaped = shaped and match.start("shape") >= 0
            if last:
                break
            newlines = text.count("\n", start, end)
            line, column = (line + newlines, end - text.rfind("\n", start, end)) if newlines \
                else (line, column + end - start)
            start = end
        if run is not None and run.shape not in self.recipes:
            self.recipes[run.shape] = self._recipe(block, run, name_offsets) \
                if shaped and before == (len(self.unresolved), len(self.computation_order)) \
                else None
        return inst

    def _recipe(self, block: Token, run: _Run, name_offsets: list[int]) -> _Recipe | None:
        """The records of the run ``block`` just read (the scope holds its instructions
        alone; ``name_offsets``: where each one's name is), or None where a run of its
        shape could read differently: a name held in a value other than as an operand
        or callee, a use the computation's end is to report, a hoisted operand."""
        scope = self.scope
        if scope.nested_count or scope.first_unknown_use is not None or \
                scope.first_missing_attribute is not None:
            return None
        text = block.value
        index = {name: k for k, name in enumerate(run.names)}
        starts = [match.start() for match in _RUN_NAME_RE.finditer(text)]

        def at(offset: int) -> _At:
            return offset, bisect.bisect_left(starts, offset)

        first_line = _position(block)[0]
        made: list[_Made] = []
        callees: set[int] = set()
        for inst, name_at in zip(scope.instructions, name_offsets, strict=True):
            references: list[tuple[str, int | tuple[int, ...]]] = []
            for key, value in inst.attributes.items():
                called = (value.name,) if isinstance(value, ComputationRef) else \
                    value.names if isinstance(value, ComputationList) else None
                if called is None:
                    if not _name_free(value, index):
                        return None
                    continue
                if any(name not in index for name in called):
                    return None
                numbers = tuple(index[name] for name in called)
                callees.update(numbers)
                references.append((key, numbers[0] if isinstance(value, ComputationRef)
                                   else numbers))
            if inst.name not in index or any(o not in index for o in inst.operands) or \
                    inst.loc is None or "%" in (inst.literal or ""):
                return None
            number = None if inst.parameter_number is None else \
                scope.parameter_numbers[inst.parameter_number]
            newline = text.rfind("\n", 0, name_at)
            made.append(_Made(
                index[inst.name], inst.opcode, inst.shape,
                tuple(index[o] for o in inst.operands), inst.attributes, tuple(references),
                inst.parameter_number, inst.literal, at(name_at),
                None if newline < 0 else at(newline), inst.loc.line - first_line,
                None if number is None else at(_offset_in(number, block))))
        root = None if scope.root_name is None or scope.root_loc is None else \
            (index[scope.root_name], at(_offset_in(scope.root_loc, block)))
        return _Recipe(tuple(run.occurrences), tuple(made), tuple(sorted(callees)), root)

    def _remake(self, recipe: _Recipe, block: Token, run: _Run) -> Instruction | None:
        """The run ``block``, of ``recipe``'s shape, made from it with its own names
        and positions (its last instruction); None where it must be read instead (a
        callee not defined yet, a type name naming an instruction: reading says so)."""
        distinct = run.names
        if any(distinct[k] not in self.computations for k in recipe.callees) or \
                any(distinct[made.name] in _TYPE_KEYWORDS for made in recipe.made):
            return None
        shift = [0]
        for mine, theirs in zip(run.occurrences, recipe.occurrences, strict=True):
            shift.append(shift[-1] + len(mine) - len(theirs))

        def at(where: _At) -> int:
            return where[0] + shift[where[1]]

        line, column = _position(block)
        scope = self.scope
        names, instructions, numbers = scope.names, scope.instructions, scope.parameter_numbers
        for made in recipe.made:
            attributes = dict(made.attributes)
            for key, callee in made.callees:
                attributes[key] = ComputationRef(distinct[callee]) if isinstance(callee, int) \
                    else ComputationList(tuple(distinct[k] for k in callee))
            offset = at(made.name_at)
            inst = Instruction(
                distinct[made.name], made.opcode, made.shape,
                [distinct[k] for k in made.operands], attributes, made.parameter_number,
                made.literal, SourceLoc(line + made.line, column + offset
                                        if made.line_start is None
                                        else offset - at(made.line_start)))
            names[inst.name] = inst
            instructions.append(inst)
            if made.number_at is not None:
                numbers[cast(int, made.parameter_number)] = (block, at(made.number_at))
        if recipe.root is not None:
            root, root_at = recipe.root
            scope.root_loc, scope.root_name = (block, at(root_at)), distinct[root]
        return inst

    def _line(self, token: Token, match: re.Match[str], start: int,
              attributes: list) -> Instruction:
        """One instruction of a ``LINE`` run: ``match`` of the run's text, from ``start``
        (where ``token``, this instruction's text, begins)."""
        root, name, shape_text, parameter, constant, call, attrs = match.group(
            "root", "name", "shape", "parameter", "constant", "call", "attrs")
        kind = "call" if call is not None else "parameter" if parameter is not None else "constant"
        rhs = _RHS_READERS[kind](token, match.start(kind) - start, match.end(kind) - start)
        if attrs is not None:
            attributes = _split_attributes(token, match.start("attrs") - start,
                                           match.end("attrs") - start) + attributes
        shape = None
        if shape_text is not None:
            shape = _SHAPE_CACHE.get(shape_text) or _array_shape(
                shape_text, (token, match.start("shape") - start))
        return self._build(_bare(name), (token, match.start("name") - start),
                           (token, 0) if root is not None else None, shape, rhs, attributes)

    def headed(self, children: list) -> Instruction:
        """``HEAD`` (``[ROOT] name = [array shape]``), then the rest in finer tokens."""
        head, shape, rhs, attrs, *attributes = children
        match = _matched(_patterns()["head"].match(head.value))
        if match.group("shape") is not None:
            shape = _array_shape(match.group("shape"), (head, match.start("shape")))
        if attrs is not None:
            attributes = _split_attributes(attrs, 0, len(attrs.value)) + attributes
        root = head if match.start("root") >= 0 else None
        return self._build(_bare(match.group("name")), (head, match.start("name")), root,
                           _shape(shape) if shape is not None else None, rhs, attributes)

    def instruction(self, children: list) -> Instruction:
        root, name, shape, rhs, attrs, *attributes = children  # name: NAME or NAME_EQ
        if attrs is not None:
            attributes = _split_attributes(attrs, 0, len(attrs.value)) + attributes
        return self._build(_bare(name.value.rstrip("=")), name, root,
                           _shape(shape) if shape is not None else None, rhs, attributes)

    def op(self, children: list) -> tuple:
        opcode, *operands = children  # None for an absent list or trailing comma
        return ("op", opcode.value, opcode, [o for o in operands if o is not None])

    def simple_op(self, children: list) -> tuple:
        return _call(children[0], 0, len(children[0].value))

    def constant_call(self, children: list) -> tuple:
        return _constant_call(children[0], 0, len(children[0].value))

    def constant(self, children: list) -> tuple:
        keyword, literal = children
        return ("constant", "constant", keyword, (literal.value, literal))

    def parameter(self, children: list) -> tuple:
        if len(children) == 1:
            return _parameter_call(children[0], 0, len(children[0].value))
        keyword, number = children
        return ("parameter", "parameter", keyword, (int(number.value), number))

    def operand(self, children: list) -> tuple:
        shape, name, indices = children
        bare = _bare(name.value) + (indices.value if indices is not None else "")
        return (bare, name, _shape(shape) if shape is not None else None)

    def nested_operand(self, children: list) -> tuple:
        """``f32[4] negate(p)`` inside an operand list: hoisted before its user."""
        shape, rhs = children
        scope = self.scope
        scope.nested_count += 1
        name = f"{_PLACEHOLDER}{scope.nested_count}"
        self._build(name, rhs[2], None, _shape(shape) if shape is not None else None, rhs, [])
        return (name, rhs[2], None)

    def _tuple_element(self, ref: str) -> str:
        """``t#1#0``, XLA's compact get-tuple-element: the name of the get-tuple-elements
        it stands for (``t#1``, then element 0 of that), each made once per computation
        before its first user, as XLA's parser makes them, and named ``t_1``, ``t_1_0``
        when the computation closes. An undefined ``t`` is returned for the caller to
        report; an element ``t`` does not have raises :class:`_NoSuchElement`."""
        scope = self.scope
        base, *indices = ref.split("#")
        operand, prefix = base, base
        for text in indices:
            tuple_name, prefix = prefix, f"{prefix}#{text}"
            made = scope.tuple_elements.get(prefix)
            if made is None:
                definition = scope.names.get(operand)
                if definition is None:
                    return operand
                shape, index = definition.shape, int(text)
                if not isinstance(shape, TupleShape):
                    raise _NoSuchElement(f"'{prefix}' takes an element of '{tuple_name}', "
                                         f"which is not a tuple ({_format_shape(shape)})")
                if index >= len(shape.elements):
                    raise _NoSuchElement(f"'{prefix}': index {index} is out of range for "
                                         f"{_format_shape(shape)}")
                scope.nested_count += 1
                made = f"{_PLACEHOLDER}{scope.nested_count}"
                element = Instruction(made, "get-tuple-element", shape.elements[index],
                                      [operand], {"index": index})
                scope.hoisted_bases[made] = prefix.replace("#", "_")
                scope.tuple_elements[prefix] = made
                scope.names[made] = element
                scope.instructions.append(element)
            operand = made
        return operand

    def attribute(self, children: list) -> tuple:
        key, value = children
        return (key.value[:-1], key, value.type, value.value, value)

    def _build(self, name: str, name_loc: Loc, root: Loc | None, shape: Shape | None,
               rhs: tuple, attributes: list[tuple]) -> Instruction:
        scope = self.scope
        names = scope.names
        if name in names:
            first = names[name].loc
            _fail(f"duplicate instruction name '{name}'"
                  + (f" (first defined at line {first.line})" if first else ""), name_loc)
        if name in _TYPE_KEYWORDS:
            _fail(f"'{name}' is a type name and cannot name an instruction", name_loc)
        kind, opcode, opcode_loc, payload = rhs
        attrs: dict[str, AttrValue] = {}
        allowed = _ALLOWED_ATTRIBUTES.get(opcode)  # None: not an opcode, reported below
        for key, key_loc, value_kind, text, loc in attributes:
            if allowed is not None and key not in allowed:
                _fail(_unexpected_attribute(key, allowed), key_loc)
            if key in attrs:
                _fail(f"duplicate attribute '{key}'", key_loc)
            attrs[key] = self._attribute(key, value_kind, text, loc)
        line, column = _position(name_loc)
        # An omitted shape (None) is derived or inferred below, once operands are known.
        inst = Instruction(name, opcode, cast(Shape, shape), [], attrs,
                           loc=SourceLoc(line, column))
        if kind == "constant":
            if shape is None:
                _fail("a constant needs its shape before the opcode", opcode_loc)
            literal, literal_loc = payload
            if (shape, literal) not in self.checked_literals:
                _check_literal(shape, literal, literal_loc)
                self.checked_literals.add((shape, literal))
            inst.literal = literal.strip()
        elif kind == "parameter":
            if shape is None:
                _fail("a parameter needs its shape before the opcode", opcode_loc)
            number, number_loc = payload
            if number in scope.parameter_numbers:
                _fail(f"parameter({number}) is already defined at line "
                      f"{_position(scope.parameter_numbers[number])[0]}", number_loc)
            scope.parameter_numbers[number] = number_loc
            inst.parameter_number = number
        else:
            self._set_operands(inst, opcode_loc, kind, payload)
            for required in REQUIRED_ATTRIBUTES.get(inst.opcode, ()):
                if required not in attrs and scope.first_missing_attribute is None:
                    scope.first_missing_attribute = (
                        f"'{inst.opcode}' needs the attribute {required}=", opcode_loc)
            derive = _DERIVED_SHAPES.get(inst.opcode)
            if shape is None or derive is not None:
                operands = [names[o] for o in inst.operands if o in names]
                derived = derive(operands) if derive is not None else None
                inst.shape = derived or shape or _infer_shape(
                    inst.opcode, opcode_loc, operands, attrs, self.computations)
            if inst.opcode == "conditional" and inst.operands and inst.operands[0] in names:
                _check_conditional_form(names[inst.operands[0]], attributes, opcode_loc)
        if root is not None:
            if scope.root_loc is not None:
                _fail(f"second ROOT in this computation (the first is at line "
                      f"{_position(scope.root_loc)[0]})", root)
            scope.root_loc, scope.root_name = root, name
        names[name] = inst
        scope.instructions.append(inst)
        return inst

    def _attribute(self, key: str, kind: str, text: str, loc: Loc) -> AttrValue:
        if key == "metadata" and text not in self.checked_metadata:
            _check_metadata(text, loc)
            self.checked_metadata.add(text)
        if kind == "BLOB" and key not in _ATTRIBUTE_READERS and key != "control-predecessors":
            return Raw(text)  # metadata, sharding, frontend_attributes, ...: the common case
        check = _VALUE_CHECKS.get((key, kind))
        if check is not None:
            check(text, loc)
        if key in _COMPUTATION_ATTRS and kind == "BLOB" and "=" in text:
            return self._inline_computation(text, loc)
        value = _attribute_value(key, kind, text, loc)
        if isinstance(value, (ComputationRef, ComputationList)):
            for callee in (value.name,) if isinstance(value, ComputationRef) else value.names:
                if callee not in self.computations:
                    self.unresolved.append((callee, loc))
        elif key == "control-predecessors":
            try:
                predecessors = read_names(text)
            except ValueError as err:
                _fail(str(err), loc)
            for predecessor in predecessors:
                if predecessor not in self.scope.names:
                    _fail(f"control predecessor '{predecessor}' is not defined before "
                          "this instruction", loc)
        return value

    def _set_operands(self, inst: Instruction, opcode_loc: Loc, kind: str, payload: Any) -> None:
        opcode = inst.opcode
        if opcode not in OPCODES and not is_known_opcode(opcode):
            if opcode not in _RENAMED_OPCODES:
                _fail(f"unknown opcode '{opcode}'", opcode_loc)
            inst.opcode = opcode = _RENAMED_OPCODES[opcode]
        scope = self.scope
        defined = scope.names
        if kind == "names":
            names = inst.operands = _operand_names(*payload)
            for index, name in enumerate(names):
                if "#" in name:
                    try:
                        name = names[index] = self._tuple_element(name)
                    except _NoSuchElement as why:
                        _fail(str(why), _operand_locations(*payload)[index])
                if name not in defined:
                    if scope.first_unknown_use is None:
                        scope.first_unknown_use = (name, _operand_locations(*payload)[index])
                    break
        else:
            names = inst.operands
            for ref, loc, declared in payload:
                try:
                    name = self._tuple_element(ref) if "#" in ref else ref
                except _NoSuchElement as why:
                    _fail(str(why), loc)
                names.append(name)
                definition = defined.get(name)
                if definition is None:
                    if scope.first_unknown_use is None:
                        scope.first_unknown_use = (name, loc)
                elif declared is not None and not compatible(declared, definition.shape):
                    _fail(f"operand '{ref}' is declared {_format_shape(declared)} but "
                          f"defined as {_format_shape(definition.shape)}", loc)
        counts = _OPERAND_COUNTS.get(opcode)
        if counts is not None:
            low, high = counts
            if len(names) < low or (high is not None and len(names) > high):
                expected = str(low) if low == high else (
                    f"at least {low}" if high is None else f"{low} to {high}")
                _fail(f"'{opcode}' takes {expected} operand{'s' * (expected != '1')}, "
                      f"got {len(names)}", opcode_loc)


def _name_nested(scope: _Scope) -> None:
    """Give hoisted instructions XLA's names: nested operands ``negate.anon``,
    ``negate.anon.1``; compact tuple elements ``t#1#0`` ``t_1_0``."""
    taken = {name for name in scope.names if not name.startswith(_PLACEHOLDER)}
    renames: dict[str, str] = {}
    next_suffix: dict[str, int] = {}  # keeps many same-opcode operands linear
    for inst in scope.instructions:
        if inst.name.startswith(_PLACEHOLDER):
            base = scope.hoisted_bases.get(inst.name) or f"{inst.opcode}.anon"
            fresh = _unique(base, taken, next_suffix.get(base, 1))
            if fresh != base:
                next_suffix[base] = int(fresh.rsplit(".", 1)[1]) + 1
            taken.add(fresh)
            renames[inst.name] = inst.name = fresh
    for inst in scope.instructions:
        inst.operands = [renames.get(o, o) for o in inst.operands]
    scope.names = {inst.name: inst for inst in scope.instructions}
    if scope.root_name in renames:
        scope.root_name = renames[scope.root_name]


# --------------------------------------------------------------------- entry points

#: Each thread's parser: lark's LALR tables bound to a builder of its own, so that
#: parses in different threads share no mutable state and take no lock. A parse's
#: state lives in the builder from its ``reset`` to the next one.
_PER_THREAD = threading.local()


#: lark's options for the grammar (the builder is bound per parser, as ``transformer``).
_LARK_OPTIONS = {"parser": "lalr", "lexer": "contextual", "start": ["start", "inline_body"],
                 "maybe_placeholders": True}


def _make_parser(**options: Any) -> Lark:
    """A lark parser built from the grammar text, with a builder of its own (``options``
    go to lark, for tests). Building takes lark's grammar analysis (a large part of a
    second); :func:`_parser` loads the tables instead."""
    builder = _Builder()
    lark = Lark(grammar_path().read_text(encoding="utf-8"), transformer=builder,
                **_LARK_OPTIONS, **options)
    builder.lark = lark
    return lark


def serialized_tables(lark: Lark) -> dict:
    """A parser's LALR and lexer tables as plain data (dicts, lists, strings, numbers),
    without its builder: what :func:`_parser` loads, and what
    ``scripts/grammar_tables.py`` writes to :mod:`hlo_shard._grammar_tables`."""
    from lark.grammar import Rule
    from lark.lexer import TerminalDef

    data, memo = lark.memo_serialize([TerminalDef, Rule])
    data["options"] = {k: v for k, v in data["options"].items() if k != "transformer"}
    return {"data": data, "memo": memo}


def grammar_digest() -> str:
    """The SHA-256 of the grammar text, which the shipped tables were made from."""
    return hashlib.sha256(grammar_path().read_bytes()).hexdigest()


_TABLES: dict | None = None
_TABLES_LOCK = threading.Lock()


def _grammar_tables() -> dict:
    """The grammar's tables, once per process: the ones shipped in
    :mod:`hlo_shard._grammar_tables` (Python source of this package, so loading them runs
    nothing but our own code) when they were made from this grammar with this lark
    version (its serialized form may change between versions), else built here from
    the grammar text. Nothing is read from or written to
    any cache file: lark's own cache (``cache=True``) unpickles a predictable file in the
    shared temp folder, which any local user could plant."""
    global _TABLES
    with _TABLES_LOCK:
        if _TABLES is None:
            from hlo_shard import _grammar_tables as shipped

            import lark

            if (shipped.DIGEST, shipped.LARK_VERSION) == (grammar_digest(), lark.__version__):
                _TABLES = shipped.TABLES
            else:
                _TABLES = serialized_tables(_make_parser())
        return _TABLES


def _parser() -> Lark:
    lark = getattr(_PER_THREAD, "lark", None)
    if lark is None:
        tables = _grammar_tables()
        builder = _Builder()
        lark = _PER_THREAD.lark = Lark._load_from_dict(tables["data"], tables["memo"],
                                                        transformer=builder)
        builder.lark = lark
    return lark


def parse(text: str, path: str | None = None, *, entry_signature: bool = True) -> Module:
    """Parse HLO text into a :class:`Module`; ``path`` is only used in messages.
    ``entry_signature``: the entry must take and return what the header's
    ``entry_computation_layout`` declares, as XLA's parser requires (False: a pass's
    output the pipeline reads back before the pass that updates the header runs)."""
    lark = _parser()
    builder = cast(_Builder, lark.options.transformer)
    with cyclic_gc_paused():
        builder.reset()
        try:
            module = cast(Module, lark.parse(text, start="start"))
        except _Located as err:
            raise _error(text, path, err.message, err.line, err.column) from None
        except UnexpectedInput as err:
            raise _syntax_error(text, path, err) from None
        except RecursionError:
            raise _error(text, path, "input nests too deeply to parse", 1, 1) from None
        finally:
            builder.reset()
    if entry_signature:
        _check_entry_signature(module, text, path)
    module.source_path = path
    return module


def _check_entry_signature(module: Module, text: str, path: str | None) -> None:
    """As XLA's parser: the entry takes and returns what the header's
    ``entry_computation_layout`` declares (a module cut off before its ``ENTRY`` reads
    its last computation as the entry, which this tells apart)."""
    problem = _entry_signature_problem(module)
    if problem is None:
        return
    line, column = _position((Token("TEXT", text, 0, 1, 1),
                              max(text.find("entry_computation_layout="), 0)))
    cut = "" if _ENTRY_RE.search(text) else " (a module cut off before its ENTRY?)"
    raise _error(text, path, f"{problem}{cut}", line, column)


#: A computation marked as the entry.
_ENTRY_RE = re.compile(r"^\s*ENTRY\b", re.MULTILINE)


def _entry_signature_problem(module: Module) -> str | None:
    """How the entry's parameters or result differ from what the header's
    ``entry_computation_layout`` declares, layouts aside (None: they agree, or nothing
    is declared)."""
    declared = module.declared_signature()
    if declared is None or not module.computations:
        return None
    from hlo_shard.printer import format_shape

    entry = module.entry
    taken = [p.shape for p in sorted(entry.parameters(), key=lambda p: p.parameter_number or 0)]
    try:
        wanted, result = read_shape(declared[0]), read_shape(declared[1])
    except HloParseError as err:
        return f"entry_computation_layout is not a signature ({err.message})"
    wanted_list = list(wanted.elements) if isinstance(wanted, TupleShape) else [wanted]
    where = f"the entry computation %{entry.name}"
    if len(wanted_list) != len(taken):
        return f"entry_computation_layout declares {len(wanted_list)} parameters, " \
               f"{where} takes {len(taken)}"
    differs = next((k for k, (a, b) in enumerate(zip(wanted_list, taken))
                    if not compatible(a, b)), None)
    if differs is not None:
        return f"entry_computation_layout declares parameter {differs} " \
               f"{_short(format_shape(wanted_list[differs]))}, {where} takes " \
               f"{_short(format_shape(taken[differs]))}"
    if not compatible(result, entry.root.shape):
        return f"entry_computation_layout declares the result {_short(format_shape(result))}, " \
               f"{where} returns {_short(format_shape(entry.root.shape))}"
    return None


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


@contextlib.contextmanager
def cyclic_gc_paused(*, caller_waits: bool = False) -> Iterator[None]:
    """Pause the cycle collector while this thread is the only one: reading a module,
    rewriting one (:class:`~hlo_shard.passes.pipeline.Pipeline`) and the cost model's
    analyses of one create a great many objects and no cycles, and the collector's
    passes over them cost a fifth to a quarter of the time on large modules. With another
    thread running that Python started, the collector is left alone (it is process-wide,
    and that thread may need it), and the caller's setting is always restored as it was.

    ``caller_waits``: this thread is one a library started to call back into Python
    (XLA's compile calling the jax hook) while the one Python thread there is, which
    asked for the compile, waits for it: that thread is not counted."""
    if not gc.isenabled() or _other_threads(caller_waits):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _other_threads(caller_waits: bool) -> bool:
    """Another thread may run Python while this one does (:func:`cyclic_gc_paused`).
    Threads started outside Python (XLA's) are not counted: they run Python only to call
    back, as the hook does, and ``threading`` keeps one it saw for good, running or not."""
    foreign = isinstance(threading.current_thread(), _FOREIGN_THREAD)
    started_by_python = sum(not isinstance(t, _FOREIGN_THREAD) for t in threading.enumerate())
    # this thread, or the one waiting for it
    expected = 1 if not foreign or caller_waits else 0
    return started_by_python > expected


#: How ``threading`` names a thread it did not start (one that called into Python from
#: C, as XLA's compile threads do).
_FOREIGN_THREAD: type = getattr(threading, "_DummyThread", type(None))


def parse_file(path: str | Path) -> Module:
    """Read and parse an HLO text file (UTF-8)."""
    return parse(read_text(str(path)), str(path))


# -------------------------------------------------------------- syntax error words

#: How the grammar's regex terminals are named in messages.
_TERMINAL_WORDS = {
    "NAME": "a name", "NAME_EQ": "a name", "ATTR": "an attribute 'name=value'",
    "NAME_COLON": "'name:'",
    "SHAPE": "a shape like f32[4]", "INT": "an integer", "FLOAT": "a number",
    "STRING": "a quoted string", "BLOB": "a '{...}' value", "LITERAL": "a literal",
    "DIM_LABELS": "dimension labels", "PADDING": "a padding like 0_0x1_1",
    "DXD": "a size like 3x3", "IOTA_GROUPS": "iota replica groups",
    "MESH_GROUPS": "mesh replica groups", "STACK_FRAMES": "the FileNames table",
    "CONSTANT": "'constant'", "PARAMETER": "'parameter'", "$END": "end of input",
    "LINE": "an instruction", "HEAD": "an instruction", "CALL": "an opcode and its operands",
    "ATTRS": "','", "SIGNATURE": "a signature", "PARAMETER_CALL": "'parameter'",
    "CONSTANT_CALL": "'constant'", "TUPLE_OPEN": "'('", "ENTRY": "'ENTRY'", "ROOT": "'ROOT'",
    "TUPLE_INDICES": "tuple indices like #0", "SHAPED_LITERAL": "a literal",
    "PARENS": "a parenthesised value",
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
    if (mlir := _MLIR_MODULE_RE.match(text)) is not None:
        line, column = _position((Token("TEXT", text, 0, 1, 1), mlir.start(1)))
        return _error(text, path, "this is MLIR (StableHLO, as jax's lowered.as_text() "
                      "prints), not HLO text: dump the per-device HLO module with "
                      "hlo_shard.jax.per_device_hlo(step, *args)", line, column)
    if isinstance(err, UnexpectedToken):
        token, expected = err.token, err.expected
        if token.type == "$END":
            line, column = _end_position(text)
            return _error(text, path, f"unexpected end of input; expected "
                          f"{_expected_words(expected)}", line, column)
        if token.value.startswith("/*"):
            return _error(text, path, "unterminated /* comment", token.line, token.column)
        if token.value.startswith("{") and "BLOB" in expected:
            return _error(text, path, "'{' has no matching '}' (unbalanced braces, an "
                          "unterminated string, or nesting deeper than 12 levels)",
                          token.line, token.column)
        if token.type == "LITERAL":  # the catch-all token: report one character
            return _unexpected_character(text, path, token.line, token.column, expected)
        message = f"expected {_expected_words(expected)}, found {show(token.value, 30)}"
        if token.type == "ATTR" and "NAME" in expected:
            message += (" (a name directly followed by '=' reads as an attribute name; "
                        "put a space before '=')")
        elif token.type in ("NAME", "HEAD") and "ATTR" in expected:
            message += " (write attributes as name=value with no space before '=')"
        return _error(text, path, message, token.line, token.column)
    if isinstance(err, UnexpectedCharacters):
        return _unexpected_character(text, path, err.line, err.column, err.allowed or ())
    if isinstance(err, UnexpectedEOF):
        line, column = _end_position(text)
        return _error(text, path, f"unexpected end of input; expected "
                      f"{_expected_words(err.expected)}", line, column)
    return _error(text, path, str(err).splitlines()[0], getattr(err, "line", 1) or 1,
                  getattr(err, "column", 1) or 1)


_WORD_BEFORE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_COMMENTS_ONLY_RE = re.compile(r"(?:\s+|//[^\n]*|/\*[\s\S]*?\*/)*")
_UNCLOSED = {"{": "'{' without a matching '}'", "(": "'(' without a matching ')'",
             '"': "unterminated string", "'": "unterminated string"}


def _unexpected_character(text: str, path: str | None, line: int, column: int,
                          expected: Iterable[str]) -> HloParseError:
    """(Found by line and column: inside an inline computation lark's offsets are
    relative to the computation's text.)"""
    source_line = _source_line(text, line)
    char = source_line[column - 1: column]
    if char == "[" and (word := _WORD_BEFORE_RE.search(source_line, 0, column - 1)):
        if word.group(0) in ELEMENT_BITS:  # a known type: its dimensions are the matter
            close = source_line.find("]", column)
            dims = source_line[column:close if close >= 0 else None]
            return _error(text, path, f"bad dimensions '{dims}' in a {word.group(0)}[...] "
                          f"shape: expected sizes separated by ','", line, column + 1)
        return _error(text, path, f"unknown element type '{word.group(0)}'", line,
                      column - len(word.group(0)))
    if char in _UNCLOSED:
        message = f"{_UNCLOSED[char]} (or not allowed here; expected {_expected_words(expected)})"
    else:
        message = f"unexpected character {char!r}; expected {_expected_words(expected)}"
    return _error(text, path, message, line, column)


#: MLIR's module header (``module @jit_step attributes {...} {``) opening the text.
_MLIR_MODULE_RE = re.compile(r"\s*(?:#[^\n]*\n\s*)*(module)\s+(?:@|attributes\b|\{)")


def _end_position(text: str) -> tuple[int, int]:
    stripped = text.rstrip()
    return stripped.count("\n") + 1, len(stripped) - (stripped.rfind("\n") + 1) + 1


def _error(text: str, path: str | None, message: str, line: int, column: int) -> HloParseError:
    return HloParseError(message, line, column, path)


def _source_line(text: str, line: int) -> str:
    start = 0
    for _ in range(line - 1):
        start = text.find("\n", start) + 1
        if start == 0:
            return ""
    end = text.find("\n", start)
    return text[start:end if end >= 0 else len(text)].rstrip("\r")
