"""Attribute value texts ↔ typed values: int lists, slices, replica groups, strings;
constant literals checked against their shape.

Pure text functions shared by the parser and the printer. Readers raise
``ValueError`` with a message for the user; the parser adds the position.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hlo_shard.ir import COMPLEX_TYPES, INTEGER_TYPES, ReplicaGroups, SliceRanges

if TYPE_CHECKING:  # numpy is imported where constants are read, not with the parser
    import numpy as np

_INT_RE = re.compile(r"-?\d+")
_INT_LIST_RE = re.compile(r"\{\s*(?:-?\d+(?:\s*,\s*-?\d+)*)?\s*\}\Z")
_GROUP_RE = re.compile(r"\{([^{}]*)\}")
_SLICE_RE = re.compile(r"\[\s*(-?\d+)\s*:\s*(-?\d+)\s*(?::\s*(-?\d+)\s*)?\]")
_NAME_IN_LIST_RE = re.compile(r"%?([A-Za-z_][A-Za-z0-9_.\-]*)")


def _only_separators(text: str) -> bool:
    return not text.replace(",", "").strip()


def read_int_list(text: str) -> tuple:
    """``{1,0}`` → ``(1, 0)``; ``{{0,1},{1,0}}`` → ``((0, 1), (1, 0))``."""
    if _INT_LIST_RE.match(text):
        return tuple(int(v) for v in _INT_RE.findall(text))
    inner = text[1:-1] if text.startswith("{") and text.endswith("}") else None
    if inner is not None and _only_separators(_GROUP_RE.sub("", inner)):
        groups = _GROUP_RE.findall(inner)
        if all(_INT_LIST_RE.match("{" + g + "}") for g in groups):
            return tuple(tuple(int(v) for v in _INT_RE.findall(g)) for g in groups)
    raise ValueError(f"expected a list of integers like {{1,0}}, found {show(text)}")


def read_slice_ranges(text: str) -> SliceRanges:
    """``{[0:4], [0:8:2]}`` (the stride defaults to 1)."""
    if text.startswith("{") and _only_separators(_SLICE_RE.sub("", text[1:-1])):
        return SliceRanges(tuple((int(a), int(b), int(c) if c else 1)
                                 for a, b, c in _SLICE_RE.findall(text)))
    raise ValueError(f"expected slice ranges like {{[0:4], [0:8:2]}}, found {show(text)}")


@dataclass(frozen=True, slots=True)
class WindowDim:
    """One dimension of a ``window={size=… stride=… pad=lo_hi … lhs_dilate=… rhs_dilate=…}``."""

    size: int
    stride: int = 1
    pad_low: int = 0
    pad_high: int = 0
    lhs_dilate: int = 1
    rhs_dilate: int = 1

    @property
    def tiles(self) -> bool:
        """The windows of this dimension tile it: stride = size, no padding or dilation."""
        return self.stride == self.size and not self.pad_low and not self.pad_high \
            and self.lhs_dilate == 1 and self.rhs_dilate == 1


def read_window(value: object) -> list[WindowDim]:
    """A ``window`` attribute's value (its text, or a value holding it as ``text``) → per
    dimension; no dimension where it names no size. ``ValueError`` where a field is not
    integers, one per dimension (``pad`` a ``low_high`` pair each)."""
    if value is None:
        return []
    text = getattr(value, "text", str(value)).strip().strip("{}")
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    if "size" not in fields:
        return []
    sizes = [int(x) for x in fields["size"].split("x")]
    rank = len(sizes)

    def per_dimension(key: str, default: tuple[int, ...]) -> list[tuple[int, ...]]:
        if key not in fields:
            return [default] * rank
        values = [tuple(int(v) for v in part.split("_")) for part in fields[key].split("x")]
        if len(values) != rank or any(len(v) != len(default) for v in values):
            raise ValueError(f"window {key}={fields[key]} does not give each of the "
                             f"{rank} dimensions of size={fields['size']} its value")
        return values

    pads = per_dimension("pad", (0, 0))
    strides, lhs, rhs = (per_dimension(key, (1,))
                         for key in ("stride", "lhs_dilate", "rhs_dilate"))
    return [WindowDim(sizes[i], strides[i][0], pads[i][0], pads[i][1], lhs[i][0], rhs[i][0])
            for i in range(rank)]


@dataclass(frozen=True, slots=True)
class ConvDims:
    """Dimension numbers read from ``dim_labels=b01f_01io->b01f``."""

    input_batch: int
    input_feature: int
    input_spatial: tuple[int, ...]
    kernel_spatial: tuple[int, ...]
    output_feature: int
    output_spatial: tuple[int, ...]

    @property
    def ranks(self) -> tuple[int, int, int]:
        """The ranks the labels name: input, kernel, output (the spatial dimensions and
        two more each: :func:`read_dim_labels` reads no other labels)."""
        rank = len(self.input_spatial) + 2
        return rank, rank, rank


_DIM_LABELS_RE = re.compile(r"([0-9bf]+)_([0-9io]+)->([0-9bf]+)\Z")


def read_dim_labels(value: object) -> ConvDims:
    """A convolution's ``dim_labels`` (its text, or a value holding it as ``text`` or
    ``name``) → its dimension numbers. ``ValueError`` unless it reads as XLA's: input
    and output each name b and f once, the kernel i and o once, and all three the same
    spatial dimensions 0…k-1, each once."""
    text = str(getattr(value, "text", getattr(value, "name", value)))
    match = _DIM_LABELS_RE.match(text)
    parts = match.groups() if match else ()

    def spatial(labels: str) -> tuple[int, ...]:
        digits = sorted((int(c), i) for i, c in enumerate(labels) if c.isdigit())
        return tuple(i for _, i in digits)

    def well_formed(labels: str, letters: str) -> bool:
        digits = sorted(c for c in labels if c.isdigit())
        return all(labels.count(c) == 1 for c in letters) and \
            digits == [str(k) for k in range(len(digits))] and \
            len(digits) == len(labels) - 2
    if not parts or not well_formed(parts[0], "bf") or not well_formed(parts[1], "io") or \
            not well_formed(parts[2], "bf") or not len({len(p) for p in parts}) == 1:
        raise ValueError(f"dim_labels={text} is not of the form b01f_01io->b01f (b and f, "
                         f"i and o once each, the same spatial dimensions 0..k-1 in all three)")
    lhs, rhs, out = parts
    return ConvDims(lhs.index("b"), lhs.index("f"), spatial(lhs), spatial(rhs),
                    out.index("f"), spatial(out))


def read_names(text: str) -> tuple[str, ...]:
    """``{%a, b}`` → ``("a", "b")``."""
    if text.startswith("{") and _only_separators(_NAME_IN_LIST_RE.sub("", text[1:-1])):
        return tuple(_NAME_IN_LIST_RE.findall(text[1:-1]))
    raise ValueError(f"expected a list of names like {{%a, %b}}, found {show(text)}")


# ------------------------------------------------------------------- replica groups


def read_replica_groups(text: str) -> ReplicaGroups:
    """Any of XLA's three forms, expanded to explicit groups; ``text`` kept as read."""
    try:
        if text.startswith("["):
            return ReplicaGroups(_iota_groups(text), text)
        if text.startswith("mesh"):
            return ReplicaGroups(_mesh_groups(text), text)
        inner = text[1:-1]
        if text.startswith("{") and _only_separators(_GROUP_RE.sub("", inner)):
            return ReplicaGroups(tuple(tuple(int(v) for v in _INT_RE.findall(g))
                                       for g in _GROUP_RE.findall(inner)), text)
        raise ValueError("expected {{0,1},{2,3}}, [G,S]<=[dims] or mesh[...] {axes}")
    except ValueError as err:
        raise ValueError(f"bad replica_groups {show(text)}: {err}") from None


#: The most devices an iota or mesh form may denote: each is expanded to the list of
#: all of them, so a few characters (``[1,100000000]<=[100000000]``) would otherwise
#: take seconds and gigabytes. Far above any machine's device count.
MAX_GROUP_DEVICES = 1 << 20


def _transposed_iota(dims: list[int], perm: list[int]) -> list[int]:
    """``iota(prod(dims)).reshape(dims).transpose(perm).flatten()``."""
    if math.prod(dims) > MAX_GROUP_DEVICES:
        raise ValueError(f"{math.prod(dims)} devices is more than the {MAX_GROUP_DEVICES} "
                         "a replica-group form may denote")
    if sorted(perm) != list(range(len(dims))):
        raise ValueError(f"T{tuple(perm)} is not a permutation of {len(dims)} dimensions")
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    new_strides = [strides[p] for p in perm]
    return [sum(i * s for i, s in zip(index, new_strides))
            for index in itertools.product(*(range(dims[p]) for p in perm))]


def _chunk(devices: list[int], size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(devices[i:i + size]) for i in range(0, len(devices), size))


def _iota_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """``[G,S]<=[dims]T(perm)``: iota(prod(dims)).reshape(dims).transpose(perm), G rows."""
    shape_text, _, rest = text.partition("<=")
    num_groups, group_size = (int(v) for v in _INT_RE.findall(shape_text))
    reshape_text, _, perm_text = rest.partition("T")
    dims = [int(v) for v in _INT_RE.findall(reshape_text)]
    perm = [int(v) for v in _INT_RE.findall(perm_text)] if perm_text else list(range(len(dims)))
    if math.prod(dims) != num_groups * group_size:
        raise ValueError(f"[{num_groups},{group_size}] does not hold {math.prod(dims)} devices")
    return _chunk(_transposed_iota(dims, perm), group_size)


_MESH_FORM_RE = re.compile(
    r"mesh\s*\[(?P<axes>[^\]]*)\]\s*"
    r"(?:,\s*device_ids=\((?P<ids>(?:[^()]|\([^()]*\))*)\)\s*)?"
    r"\{(?P<listed>[^{}]*)\}\Z")
_AXIS_NAME = r"""'(?P<sq>[^'\\]*)'|"(?P<dq>[^"\\]*)"|(?P<bare>[A-Za-z_][\w.\-]*)"""
_MESH_AXIS_RE = re.compile(rf"\s*(?:{_AXIS_NAME})\s*=\s*(?P<size>-?\d+)\s*(?:,|\Z)")
_LISTED_AXIS_RE = re.compile(
    rf"\s*(?:{_AXIS_NAME})\s*(?::\s*\(\s*(?P<pre>-?\d+)\s*\)\s*(?P<sub>-?\d+))?\s*(?:,|\Z)")
_IOTA_IDS_RE = re.compile(r"\s*\[(?P<dims>[\d,\s]*)\]\s*(?:T\((?P<perm>[\d,\s]*)\))?\s*\Z")


def _axis_name(match: re.Match[str]) -> str:
    return next(v for v in match.group("sq", "dq", "bare") if v is not None)


def _items(pattern: re.Pattern[str], text: str, what: str) -> list[re.Match[str]]:
    """Every comma-separated item of ``text`` as a match of ``pattern``, covering it
    (no trailing comma, as in XLA's lists)."""
    if text.rstrip().endswith(","):
        raise ValueError(f"expected {what} after the last ','")
    items, position = [], 0
    while position < len(text):
        match = pattern.match(text, position)
        if match is None or match.end() == position:
            raise ValueError(f"expected {what} at {show(text[position:], 20)}")
        items.append(match)
        position = match.end()
    return items


@dataclass(frozen=True)
class MeshAxes:
    """A ``mesh[...] {axes}`` replica-group form as XLA's ``MeshAxesReplicaGroupList``
    reads it: the mesh (axis names and sizes, the device at each mesh position in
    row-major order, ``iota`` when no ``device_ids`` reorder them) and the listed axes
    as ``(mesh axis index, (pre_size, size))``; a whole axis is ``(1, axis size)``.
    ``quoted``: every name is quoted, as XLA's parser requires."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    devices: tuple[int, ...]
    iota: bool
    listed: tuple[tuple[int, tuple[int, int]], ...]
    quoted: bool

    @property
    def mesh(self) -> tuple:
        """What identifies the mesh itself (names, sizes, device order)."""
        return self.names, self.sizes, None if self.iota else self.devices


def read_mesh_axes(text: str) -> MeshAxes:
    """Read and check a mesh form as XLA's parser and ``MeshAxesReplicaGroupList`` do
    (each refusal here is one XLA makes, most of them by aborting the process).
    Axis names are quoted in XLA's text; unquoted ones (an older printer) are read too.
    A listed axis is a name of the mesh, else an index into its axes (as XLA reads it)."""
    form = _MESH_FORM_RE.match(text.strip())
    if form is None:
        raise ValueError("expected mesh['x'=N,...](, device_ids=(...))? {'x',...}")
    axis_matches = _items(_MESH_AXIS_RE, form.group("axes"), "'name'=size")
    axes = [(_axis_name(m), int(m.group("size"))) for m in axis_matches]
    if not axes:
        raise ValueError("the mesh has no axes")
    names = tuple(name for name, _ in axes)
    sizes = tuple(size for _, size in axes)
    if len(set(names)) != len(names):
        raise ValueError("the mesh has duplicate axis names")
    if min(sizes) < 1:
        raise ValueError("mesh axis sizes must be positive")
    total = math.prod(sizes)
    if total > MAX_GROUP_DEVICES:
        raise ValueError(f"{total} devices is more than the {MAX_GROUP_DEVICES} a "
                         "replica-group form may denote")
    devices, iota = _mesh_devices(form.group("ids"), total)
    listed_matches = _items(_LISTED_AXIS_RE, form.group("listed"), "'axis'")
    listed = tuple(_listed_axis(m, names, sizes) for m in listed_matches)
    _check_listed_axes(listed, names)
    if math.prod(size for _, (_, size) in listed) < 2:
        raise ValueError("the groups must have more than one device")
    quoted = all(m.group("bare") is None for m in axis_matches + listed_matches)
    return MeshAxes(names, sizes, devices, iota, listed, quoted)


def _mesh_devices(ids: str | None, total: int) -> tuple[tuple[int, ...], bool]:
    """``device_ids=(...)``: an iota ``[dims]T(perm)`` (``[n]`` alone is plain iota) or
    an explicit permutation of the devices other than the identity."""
    if ids is None:
        return tuple(range(total)), True
    iota = _IOTA_IDS_RE.match(ids)
    if iota is not None:
        dims = [int(v) for v in _INT_RE.findall(iota.group("dims"))]
        perm_text = iota.group("perm")
        perm = [int(v) for v in _INT_RE.findall(perm_text)] if perm_text is not None else None
        if perm is None and len(dims) != 1 or perm is not None and len(dims) < 2:
            raise ValueError("device_ids=([dims]T(perm)) needs T(perm) exactly when it "
                             "has more than one dimension")
        if math.prod(dims) != total:
            raise ValueError(f"device_ids holds {math.prod(dims)} devices, the mesh {total}")
        order = _transposed_iota(dims, perm if perm is not None else [0])
        return tuple(order), order == list(range(total))
    if not _only_separators(_INT_RE.sub("", ids)):
        raise ValueError(f"bad device_ids ({show(ids)})")
    devices = tuple(int(v) for v in _INT_RE.findall(ids))
    if len(devices) != total:
        raise ValueError(f"expected {total} device_ids based on mesh axes, got {len(devices)}")
    if sorted(devices) != list(range(total)):
        raise ValueError("device_ids must be a permutation of 0..N-1")
    if devices == tuple(range(total)):
        raise ValueError("device_ids in iota order must be left out")
    return devices, False


def _listed_axis(match: re.Match[str], names: tuple[str, ...],
                 sizes: tuple[int, ...]) -> tuple[int, tuple[int, int]]:
    name = _axis_name(match)
    if name in names:
        axis = names.index(name)
    elif name.isdigit() and int(name) < len(names):
        axis = int(name)
    else:
        raise ValueError(f"axis {name!r} is not a name or index of the mesh")
    if match.group("pre") is None:
        return axis, (1, sizes[axis])
    pre, size = int(match.group("pre")), int(match.group("sub"))
    if pre < 1 or size < 2:
        raise ValueError(f"sub-axis {name!r}:({pre}){size} needs pre-size >= 1 and size > 1")
    if sizes[axis] % (pre * size) or size >= sizes[axis]:
        raise ValueError(f"sub-axis {name!r}:({pre}){size} does not fit in its axis of "
                         f"size {sizes[axis]}")
    return axis, (pre, size)


def _check_listed_axes(listed: tuple[tuple[int, tuple[int, int]], ...],
                       names: tuple[str, ...]) -> None:
    """XLA's ``ValidateSpanOfAxes``: two references to one axis must be disjoint
    sub-axes, one nested in the other's period; neighbours that XLA would merge into
    one sub-axis are refused."""
    for i, (axis, (pre, size)) in enumerate(listed):
        for other, (other_pre, other_size) in listed[i + 1:]:
            if other != axis:
                continue
            # (pre-size, next pre-size) of each; a whole axis is (1, its size)
            low, high = sorted(((pre, pre * size), (other_pre, other_pre * other_size)))
            if low[1] > high[0] or high[0] % low[1]:
                raise ValueError(f"mesh axes overlap or cannot coexist ({names[axis]!r} "
                                 "listed twice)")
    for (axis, (pre, size)), (other, (other_pre, _)) in zip(listed, listed[1:]):
        if axis == other and pre * size == other_pre:
            raise ValueError(f"adjacent sub-axes of {names[axis]!r} can be merged into one")


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """The groups of a mesh form, as XLA's ``MeshAxesReplicaGroupList`` computes them:
    each listed axis is reshaped into the factors its sub-axes ``'x':(pre)size`` need
    (row major), the listed factors are moved last in listed order, and the mesh's
    device order, so permuted, is cut in groups."""
    mesh = read_mesh_axes(text)
    factors: list[int] = []
    factor_index: dict[tuple[int, tuple[int, int]], int] = {}
    for axis, full in enumerate(mesh.sizes):
        product = 1
        for pre, size in sorted(sub for a, sub in mesh.listed if a == axis):
            if pre != product:
                factors.append(pre // product)
            factor_index[(axis, (pre, size))] = len(factors)
            factors.append(size)
            product = pre * size
        if product != full:
            factors.append(full // product)
    grouped = [factor_index[key] for key in mesh.listed]
    order = _transposed_iota(factors, [i for i in range(len(factors)) if i not in grouped]
                             + grouped)
    return _chunk([mesh.devices[i] for i in order],
                  math.prod(factors[i] for i in grouped))


# ------------------------------------------------------------------------- literals


class LiteralError(ValueError):
    """A literal XLA's parser refuses; ``offset`` is where in the literal's text."""

    def __init__(self, message: str, offset: int = 0) -> None:
        super().__init__(message)
        self.offset = offset


_SCALAR_RE = re.compile(r"-?nan\(0x[0-9a-fA-F]+\)|[^\s{},()]+")
_COMPLEX_OPEN_RE = re.compile(r"(?<!nan)\(")
_BRACE_RE = re.compile(r"[{}]")
_BLOCK_COMMENT_RE = re.compile(r"/\*[^*]*\*+(?:[^/*][^*]*\*+)*/")
_INT_TOKEN_RE = re.compile(r"-?[0-9]+")
_FLOAT_TOKEN_RE = re.compile(
    r"-?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|inf|nan(?:\(0x(?P<payload>[0-9a-fA-F]+)\))?)")
#: What XLA's lexer reads as an integer: int64 ∪ uint64, a uint64 above the int64 range
#: then cast to int64 (18446744073709551615 is -1). The 64-bit types and pred take all.
_LEXED_INTS = range(-2**63, 2**64)
_INT_RANGES = {t: _LEXED_INTS if t[1:] == "64" else
               range(-2**(int(t[1:]) - 1), 2**(int(t[1:]) - 1)) if t[0] == "s" else
               range(0, 2**int(t[1:])) for t in INTEGER_TYPES}
_INT_RANGES["pred"] = _LEXED_INTS
#: Float types by their numpy / ml_dtypes name (complex: the part type). A finite value
#: that becomes inf or NaN in the type is out of range; f4e2m1fn saturates instead.
_FLOAT_DTYPES = {
    "f16": "float16", "f32": "float32", "f64": "float64", "c64": "float32",
    "c128": "float64", "bf16": "bfloat16", "f8e5m2": "float8_e5m2", "f8e4m3": "float8_e4m3",
    "f8e4m3fn": "float8_e4m3fn", "f8e4m3b11fnuz": "float8_e4m3b11fnuz",
    "f8e3m4": "float8_e3m4", "f8e5m2fnuz": "float8_e5m2fnuz", "f8e4m3fnuz": "float8_e4m3fnuz",
    "f8e8m0fnu": "float8_e8m0fnu", "f4e2m1fn": "float4_e2m1fn",
}
#: Mantissa bits of the float types whose NaNs carry a payload; the others have one NaN.
_PAYLOAD_BITS = {"f16": 10, "bf16": 7, "f32": 23, "f64": 52, "c64": 23, "c128": 52,
                 "f8e5m2": 2, "f8e4m3": 3, "f8e3m4": 4}


def float_format(element_type: str) -> tuple[int, int] | None:
    """(exponent range, significand bits) of a float type (the component type of a
    complex one), None for other types: the terms XLA ranks float precision by."""
    name = _FLOAT_DTYPES.get(element_type)
    if name is None:
        return None
    import numpy as np

    if hasattr(np, name):
        info = np.finfo(np.dtype(name))
    else:
        import ml_dtypes

        info = ml_dtypes.finfo(getattr(ml_dtypes, name))
    return int(info.maxexp - info.minexp), int(info.nmant) + 1


def check_literal(element_type: str, dims: tuple[int, ...], literal: str) -> None:
    """A dense literal against its array shape, as XLA's ParseDenseLiteral and
    SetValueInLiteral check it: the element count, the nesting of ``{}`` against the
    rank and dimensions, and each value against the element type (integers in range,
    no fractions for integer types, finite values that stay finite, NaN payloads that
    fit). Raises :class:`LiteralError`. An elided literal (``{...}``) is not checked.
    A single unbraced value is accepted for any non-empty shape: XLA sets the first
    element to it and the others to zero (``f32[3] constant(1)`` is ``{1, 0, 0}``)."""
    if element_type in ("token", "opaque"):
        raise LiteralError(f"a constant cannot have the element type {element_type}")
    if "..." in literal:
        for elision in re.finditer(r"\.\.\.", literal):
            before = literal[:elision.start()]
            if before.count("{") - before.count("}") != 1:
                raise LiteralError("expects `...` at nest level 1, as in {...}",
                                   elision.start())
        return
    if _plainly_valid(element_type, dims, literal):
        return
    if "/*" in literal:  # XLA's printer writes /*i0=0*/ index comments from rank 4 on
        literal = _BLOCK_COMMENT_RE.sub(lambda m: " " * len(m.group(0)), literal)
    complex_type = element_type in COMPLEX_TYPES
    elements, nesting_error = _read_elements(
        dims, literal, _COMPLEX_OPEN_RE if complex_type else _SCALAR_RE)
    one_scalar = len(elements) == 1 and "{" not in literal and math.prod(dims) > 0
    if len(elements) != math.prod(dims) and not one_scalar:
        count, dims_text = len(elements), ",".join(map(str, dims))
        raise LiteralError(f"constant has {count} value{'s' * (count != 1)} but its shape "
                           f"{element_type}[{dims_text}] holds {math.prod(dims)}")
    if nesting_error is not None:
        raise nesting_error
    values = _SCALAR_RE.findall(literal) if complex_type else elements
    bad = _bad_values(element_type, set(values))
    if bad:
        first = next(token for token in values if token in bad)
        raise LiteralError(bad[first], _offset_of(first, literal))


def _read_elements(dims: tuple[int, ...], literal: str,
                   element_re: re.Pattern) -> tuple[list[str], LiteralError | None]:
    """The elements (``element_re`` matches), and the first place where the braces do
    not nest exactly ``rank`` deep with values only at the innermost level, each array
    holding its dimension's size."""
    rank = len(dims)
    if "{" not in literal and "}" not in literal:
        return element_re.findall(literal), None
    stripped = literal.strip()
    if (rank == 1 and stripped[0] == "{" and stripped[-1] == "}" and literal.count("{") == 1
            and literal.count("}") == 1):
        return element_re.findall(literal), None  # the common case, counted by the caller
    elements: list[str] = []
    errors: list[LiteralError] = []
    open_counts: list[int] = []
    position = 0
    for brace in itertools.chain(_BRACE_RE.finditer(literal), (None,)):
        end = brace.start() if brace is not None else len(literal)
        found = element_re.findall(literal, position, end)
        if found:
            elements += found
            if len(open_counts) != rank:
                first = element_re.search(literal, position, end)
                assert first is not None, "findall found elements there"
                where = first.start()
                errors.append(LiteralError(
                    f"expects nested array in rank {rank}, but sees {len(open_counts)}"
                    if brace is not None else "expects ')' after constant literal", where))
            else:
                open_counts[-1] += len(found)
        if brace is None:
            break
        position = brace.end()
        if brace.group() == "{":
            if len(open_counts) >= rank:
                errors.append(LiteralError(
                    f"expects nested array in rank {rank}, but sees larger", brace.start()))
            if open_counts:
                open_counts[-1] += 1
            open_counts.append(0)
        elif not open_counts:
            errors.append(LiteralError("'}' without a matching '{'", brace.start()))
        else:
            seen = open_counts.pop()
            if len(open_counts) < rank and seen != dims[len(open_counts)]:
                errors.append(LiteralError(
                    f"expects {dims[len(open_counts)]} elements in dimension "
                    f"{len(open_counts)}, but sees {seen}", brace.start()))
    if open_counts:
        errors.append(LiteralError("'{' without a matching '}'", len(literal)))
    return elements, errors[0] if errors else None


_INTEGER = r"-?[0-9]+"
_DECIMAL = r"-?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?"
#: Plain numbers with one comma between each two (braces blanked out): XLA's number
#: syntax, which also makes numpy's reading of the text exact.
_PLAIN_LISTS = {kind: re.compile(rf"(?:\s*{number}\s*,)*+\s*{number}\s*")
                for kind, number in (("integer", _INTEGER), ("decimal", _DECIMAL))}
_NOT_BRACE_RE = re.compile(r"[^{}]+")
_INT64_SAFE = 2**62


def _plainly_valid(element_type: str, dims: tuple[int, ...], literal: str) -> bool:
    """The common case checked in bulk: plain numbers, one comma between values,
    braces nested as the shape says, every value in range. True means the literal is
    fine; False only that :func:`check_literal` must look value by value (which also
    finds the words and the place of an error)."""
    integer = element_type in _INT_RANGES
    real = element_type in _FLOAT_DTYPES and element_type not in COMPLEX_TYPES
    if not dims or not math.prod(dims) or not (integer or real):
        return False
    skeleton = "{}"
    for size in reversed(dims[:-1]):
        skeleton = "{" + skeleton * size + "}"
    if _NOT_BRACE_RE.sub("", literal) != skeleton:
        return False
    flat = literal.replace("{", " ").replace("}", " ")
    if not _PLAIN_LISTS["integer" if integer else "decimal"].fullmatch(flat):
        return False
    import numpy as np  # the parser imports numpy only for constants

    numbers = np.fromstring(flat, dtype=np.int64 if integer else np.float64, sep=",")
    if len(numbers) != math.prod(dims) or (len(dims) > 1 and not _rows_hold(dims[-1], literal)):
        return False
    if integer:
        int_range = _INT_RANGES[element_type]
        low, high = int(numbers.min()), int(numbers.max())
        return (-_INT64_SAFE < low and high < _INT64_SAFE and int_range.start <= low
                and high < int_range.stop)
    return bool(np.isfinite(numbers).all()) and not _overflows(element_type, numbers).any()


def _rows_hold(size: int, literal: str) -> bool:
    """Each innermost ``{...}`` of a literal whose values are separated by single commas
    (none empty, none before or after the last) holds ``size`` values."""
    import numpy as np

    text = np.frombuffer(literal.encode("ascii", "replace"), dtype=np.uint8)
    opens = np.flatnonzero(text == ord("{"))
    closes = np.flatnonzero(text == ord("}"))
    commas = np.flatnonzero(text == ord(","))
    inner = np.searchsorted(closes, opens)  # the first '}' after each '{'
    innermost = np.ones(len(opens), dtype=bool)
    innermost[:-1] = opens[1:] > closes[inner[:-1]]  # no '{' before that '}'
    row_opens, row_closes = opens[innermost], closes[inner[innermost]]
    row_commas = np.searchsorted(commas, row_closes) - np.searchsorted(commas, row_opens)
    return bool((row_commas == size - 1).all())


def _bad_values(element_type: str, tokens: set[str]) -> dict[str, str]:
    """{token: message} for the distinct values the element type cannot hold."""
    int_range = _INT_RANGES.get(element_type)
    if int_range is not None:
        return {token: message for token in tokens
                if (message := _int_problem(element_type, int_range, token))}
    if element_type not in _FLOAT_DTYPES:
        return {}
    bad: dict[str, str] = {}
    finite: dict[float, str] = {}
    for token in tokens:
        match = _FLOAT_TOKEN_RE.fullmatch(token)
        if match is None:
            bad[token] = f"expects a number, found {show(token)}"
        elif match.group("payload") is not None:
            problem = _payload_problem(element_type, int(match.group("payload"), 16))
            if problem:
                bad[token] = f"NaN payload {token[token.index('(') + 1:-1]} {problem}"
        elif "n" not in token:  # neither inf nor nan
            value = float(token)
            if math.isinf(value):
                bad[token] = f"{token} is out of range for double (±1.79769e+308)"
            else:
                finite[value] = token
    for token in _out_of_range(element_type, finite):
        bad[token] = (f"value {token} is out of range for literal's primitive type "
                      f"{element_type}")
    return bad


def _int_problem(element_type: str, int_range: range, token: str) -> str:
    if element_type == "pred" and token in ("true", "false"):
        return ""
    if not _INT_TOKEN_RE.fullmatch(token):
        return f"expects integer, found {show(token)}"
    value = int(token)
    if value not in _LEXED_INTS:
        return f"{token} is out of range for a 64-bit integer"
    if (value - 2**64 if value >= 2**63 else value) not in int_range:
        return (f"value {token} is out of range for literal's primitive type {element_type} "
                f"namely [{int_range.start}, {int_range.stop - 1}]")
    return ""


def _payload_problem(element_type: str, payload: int) -> str:
    bits = _PAYLOAD_BITS.get(element_type)
    if bits is None:
        return f"is not supported: {element_type} has a single NaN"
    if not 0 < payload < 2**bits:
        return f"is out of range for {element_type} (1 to {hex(2**bits - 1)})"
    return ""


def _out_of_range(element_type: str, finite: dict[float, str]) -> list[str]:
    """The tokens of the finite values the type cannot hold."""
    if not finite:
        return []
    import numpy as np

    values = np.fromiter(finite, dtype=np.float64, count=len(finite))
    return [finite[float(value)] for value in values[_overflows(element_type, values)]]


def _overflows(element_type: str, values: np.ndarray) -> np.ndarray:
    """Which finite float64 ``values`` the type turns into inf or NaN (f8e8m0fnu has no
    zero and no sign: values ≤ 0 are out of its range too)."""
    import numpy as np

    name = _FLOAT_DTYPES[element_type]
    if name == "float64":
        return np.zeros(values.shape, dtype=bool)
    if hasattr(np, name):
        dtype = np.dtype(name)
    else:
        import ml_dtypes

        dtype = np.dtype(getattr(ml_dtypes, name))
    with np.errstate(over="ignore", invalid="ignore"):
        overflow = ~np.isfinite(values.astype(dtype))
    if element_type == "f8e8m0fnu":  # XLA reads tiny values as its smallest, 2^-127
        return (overflow & (values > 1)) | (values <= 0)
    return overflow


def _offset_of(token: str, literal: str) -> int:
    """Where ``token`` first stands as a whole value in ``literal``."""
    match = re.search(rf"(?<![^\s{{}},(]){re.escape(token)}(?![^\s{{}},)])", literal)
    return match.start() if match else 0


# -------------------------------------------------------------------------- strings

_ESCAPE_RE = re.compile(r"\\(x[0-9a-fA-F]{1,2}|[0-7]{1,3}|.)", re.S)
_UNESCAPES = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v",
              "\\": "\\", "'": "'", '"': '"', "?": "?"}
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _unescape_one(match: re.Match) -> str:
    code = match.group(1)
    if code[0] == "x":
        return chr(int(code[1:], 16))
    if code[0].isdigit():
        return chr(int(code, 8))
    return _UNESCAPES.get(code, code)


def c_unescape(quoted: str) -> str:
    """The value of a quoted string token (absl::CUnescape of the inside)."""
    inner = quoted[1:-1]
    return _ESCAPE_RE.sub(_unescape_one, inner) if "\\" in inner else inner


def c_quote(value: str) -> str:
    """A double-quoted string XLA's lexer reads back as ``value``."""
    out = []
    for ch in value:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\{ord(ch):03o}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def show(text: str, limit: int = 40) -> str:
    """A short, one-line quotation of input text for messages."""
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "…")
