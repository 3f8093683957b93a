"""Attribute value texts ↔ typed values: int lists, slices, replica groups, strings.

Pure text functions shared by the parser and the printer. Readers raise
``ValueError`` with a message for the user; the parser adds the position.
"""

from __future__ import annotations

import itertools
import math
import re

from hlo_shard.ir import ReplicaGroups, SliceRanges

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


def _transposed_iota(dims: list[int], perm: list[int]) -> list[int]:
    """``iota(prod(dims)).reshape(dims).transpose(perm).flatten()``."""
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


_MESH_AXIS_RE = re.compile(r"""['"]?([A-Za-z_][\w.\-]*)['"]?\s*=\s*(\d+)""")
_LISTED_AXIS_RE = re.compile(
    r"""['"]?([A-Za-z_][\w.\-]*)['"]?(?:\s*:\s*\(\s*(\d+)\s*\)\s*(\d+))?""")


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """``mesh[axes](, device_ids=(...))? {listed axes}``: the devices varying along the
    listed (sub-)axes, the others fixed, as XLA's MeshAxesReplicaGroupList does: each
    axis is reshaped into the factors its sub-axes ``'x':(pre)size`` need (row major),
    the listed factors are moved last in listed order, and the result is cut in groups."""
    axes = [(name, int(size)) for name, size in
            _MESH_AXIS_RE.findall(text[text.index("[") + 1: text.index("]")])]
    names = [name for name, _ in axes]
    total = math.prod(size for _, size in axes)
    ids = re.search(r"device_ids=\(([^)]*)\)", text)
    devices = [int(v) for v in _INT_RE.findall(ids.group(1))] if ids else list(range(total))
    if len(devices) != total:
        raise ValueError(f"device_ids has {len(devices)} entries for {total} devices")
    listed = []
    for match in _LISTED_AXIS_RE.finditer(text[text.rindex("{") + 1: text.rindex("}")]):
        name, pre, size = match.groups()
        if name not in names:
            raise ValueError(f"axis {name!r} is not in the mesh")
        axis = names.index(name)
        listed.append((axis, (int(pre), int(size)) if pre else (1, axes[axis][1])))
    if not listed:
        raise ValueError("no mesh axes listed")
    factors: list[int] = []
    factor_index: dict[tuple[int, tuple[int, int]], int] = {}
    for axis, (name, full) in enumerate(axes):
        product = 1
        for pre, size in sorted(sub for a, sub in listed if a == axis):
            if pre % product:
                raise ValueError(f"overlapping sub-axes of {name!r}")
            if pre != product:
                factors.append(pre // product)
            factor_index[(axis, (pre, size))] = len(factors)
            factors.append(size)
            product = pre * size
        if full % product:
            raise ValueError(f"sub-axes do not divide axis {name!r}")
        if product != full:
            factors.append(full // product)
    grouped = [factor_index[key] for key in listed]
    order = _transposed_iota(factors, [i for i in range(len(factors)) if i not in grouped]
                             + grouped)
    return _chunk([devices[i] for i in order], math.prod(factors[i] for i in grouped))


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
