"""A small HLO text emitter for the generators: typed values, unique names, reducers.

The generators build modules as *text* (what users feed hlo-shard), not as IR records,
so that the front end is exercised on every case. Values carry their shape so that
helpers (broadcast, convert, reduce …) can write correct result shapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from hlo_shard.opinfo import OPINFO



@dataclass(frozen=True, slots=True)
class Sh:
    """An array shape: element type, dims, optional minor-to-major layout."""

    dtype: str
    dims: tuple[int, ...] = ()
    layout: tuple[int, ...] | None = None

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def rank(self) -> int:
        return len(self.dims)

    def text(self) -> str:
        dims = ",".join(map(str, self.dims))
        if self.layout is None or not self.dims:
            return f"{self.dtype}[{dims}]"
        return f"{self.dtype}[{dims}]{{{','.join(map(str, self.layout))}}}"

    def of(self, dtype: str) -> Sh:
        return Sh(dtype, self.dims, self.layout)


@dataclass(frozen=True, slots=True)
class Val:
    name: str
    shape: Sh


def neutral(kind: str, dtype: str) -> str:
    """The reducer's float identity (``and``/``or``: its pred one), as the generators
    write it for every element type."""
    identity = dict(OPINFO[kind].neutral)
    value = identity["float"] if "float" in identity else identity["pred"]
    if dtype[0] in "su" and value in ("-inf", "inf"):
        raise ValueError(f"no infinite neutral value for {dtype}")
    return value


@dataclass
class Reducers:
    """The scalar reduction computations a module needs, emitted before its users."""

    needed: dict[tuple[str, str], str] = field(default_factory=dict)

    def get(self, kind: str, dtype: str) -> str:
        key = (kind, dtype)
        if key not in self.needed:
            self.needed[key] = f"{kind}_{dtype}"
        return self.needed[key]

    def text(self) -> str:
        blocks = []
        for (kind, dtype), name in self.needed.items():
            blocks.append(f"%{name} (a: {dtype}[], b: {dtype}[]) -> {dtype}[] {{\n"
                          f"  %a = {dtype}[] parameter(0)\n  %b = {dtype}[] parameter(1)\n"
                          f"  ROOT %r = {dtype}[] {kind}(%a, %b)\n}}")
        return "\n\n".join(blocks)


class Names:
    """Unique names in XLA's style: ``base``, then ``base.1``, ``base.2`` …"""

    def __init__(self) -> None:
        self._taken: set[str] = set()

    def fresh(self, base: str) -> str:
        name, n = base, 0
        while name in self._taken:
            n += 1
            name = f"{base}.{n}"
        self._taken.add(name)
        return name


class Emitter(Names):
    """Instructions of one computation, in definition order."""

    def __init__(self, reducers: Reducers) -> None:
        super().__init__()
        self.reducers = reducers
        self.lines: list[str] = []
        self._scalars: dict[tuple[str, str], Val] = {}

    # Raw instructions ------------------------------------------------------------

    def emit(self, base: str, shape: Sh | str, opcode: str, operands: Iterable[Val | str] = (),
             attrs: str = "") -> Val:
        name = self.fresh(base)
        shape_text = shape if isinstance(shape, str) else shape.text()
        args = ", ".join(f"%{v.name}" if isinstance(v, Val) else v for v in operands)
        self.lines.append(f"  %{name} = {shape_text} {opcode}({args}){attrs}")
        return Val(name, shape if isinstance(shape, Sh) else Sh("tuple"))

    def param(self, base: str, shape: Sh | str, number: int, attrs: str = "") -> Val:
        return self.emit(base, shape, "parameter", [str(number)], attrs)

    def body(self, root: Val) -> str:
        lines = list(self.lines)
        for i, line in enumerate(lines):
            if line.startswith(f"  %{root.name} = "):
                lines[i] = "  ROOT " + line[2:]
        return "\n".join(lines)

    # Scalars -------------------------------------------------------------------
    def constant(self, value: float | int | str, dtype: str = "f32") -> Val:
        text = value if isinstance(value, str) else _number(value, dtype)
        key = (text, dtype)
        if key not in self._scalars:
            self._scalars[key] = self.emit("c", Sh(dtype), "constant", [text])
        return self._scalars[key]

    # Shape-preserving ops --------------------------------------------------------
    def unary(self, opcode: str, a: Val) -> Val:
        return self.emit(_base(opcode), a.shape, opcode, [a])

    def binary(self, opcode: str, a: Val, b: Val) -> Val:
        return self.emit(_base(opcode), a.shape, opcode, [a, b])

    def is_finite(self, a: Val) -> Val:
        return self.emit("finite", a.shape.of("pred"), "is-finite", [a])

    def compare(self, a: Val, b: Val, direction: str) -> Val:
        return self.emit("cmp", a.shape.of("pred"), "compare", [a, b],
                         f", direction={direction}")

    def select(self, pred: Val, a: Val, b: Val) -> Val:
        return self.emit("sel", a.shape, "select", [pred, a, b])

    def clamp(self, low: Val, a: Val, high: Val) -> Val:
        return self.emit("clamp", a.shape, "clamp", [low, a, high])

    def convert(self, a: Val, dtype: str) -> Val:
        if a.shape.dtype == dtype:
            return a
        return self.emit("cvt", a.shape.of(dtype), "convert", [a])

    def broadcast(self, scalar: Val, shape: Sh) -> Val:
        """A scalar (or a value along ``dims``) broadcast to ``shape``."""
        if scalar.shape == shape:
            return scalar
        return self.emit("bc", shape.of(scalar.shape.dtype), "broadcast", [scalar],
                         ", dimensions={}")

    def broadcast_dims(self, a: Val, shape: Sh, dims: tuple[int, ...]) -> Val:
        return self.emit("bc", shape.of(a.shape.dtype), "broadcast", [a],
                         f", dimensions={{{','.join(map(str, dims))}}}")

    def scale(self, a: Val, factor: float) -> Val:
        return self.binary("multiply", a, self.broadcast(self.constant(factor, a.shape.dtype),
                                                         a.shape))

    def offset(self, a: Val, amount: float) -> Val:
        return self.binary("add", a, self.broadcast(self.constant(amount, a.shape.dtype),
                                                    a.shape))

    # Shape-changing ops ----------------------------------------------------------
    def reshape(self, a: Val, dims: tuple[int, ...]) -> Val:
        return self.emit("reshape", Sh(a.shape.dtype, dims), "reshape", [a])

    def transpose(self, a: Val, perm: tuple[int, ...]) -> Val:
        dims = tuple(a.shape.dims[p] for p in perm)
        return self.emit("transpose", Sh(a.shape.dtype, dims), "transpose", [a],
                         f", dimensions={{{','.join(map(str, perm))}}}")

    def reduce(self, a: Val, kind: str, dims: tuple[int, ...] | None = None) -> Val:
        """``reduce`` with ``kind`` over ``dims`` (all dims when None)."""
        dims = tuple(range(a.shape.rank)) if dims is None else dims
        if not dims:
            return a
        dtype = a.shape.dtype
        init = self.constant(neutral(kind, dtype), dtype)
        kept = tuple(d for i, d in enumerate(a.shape.dims) if i not in dims)
        return self.emit(f"reduce_{kind}", Sh(dtype, kept), "reduce", [a, init],
                         f", dimensions={{{','.join(map(str, dims))}}}, "
                         f"to_apply=%{self.reducers.get(kind, dtype)}")

    def iota(self, shape: Sh, dimension: int) -> Val:
        return self.emit("iota", shape, "iota", [], f", iota_dimension={dimension}")


def _base(opcode: str) -> str:
    return opcode.replace("-", "_")


def _number(value: float | int, dtype: str) -> str:
    if dtype == "pred":
        return "true" if value else "false"
    if dtype[0] in "su":
        return str(int(value))
    if value == math.inf:
        return "inf"
    if value == -math.inf:
        return "-inf"
    text = repr(float(f"{value:.9g}"))  # 0.1 - 1 prints as 0.9, not 0.8999999999999999
    return text[:-2] if text.endswith(".0") else text
