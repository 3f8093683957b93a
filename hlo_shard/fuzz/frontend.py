"""Random HLO modules that exercise the text format, for front-end property tests.

:func:`random_module` draws, from a seed, a module that XLA's own parser accepts and
that uses the forms the front end must keep: every element type; nested and empty
tuple shapes; layouts with tiles, memory spaces and element sizes; dynamic dimensions;
literals with nested arrays, NaN payloads, infinities, booleans, complex numbers,
tuples and elided ``{...}`` values; replica groups in all three forms; shardings,
metadata, backend configs, frontend attributes, slices, paddings, windows, dimension
labels, dot/gather/scatter numbers, control predecessors; and the spellings printers
differ in: ``%`` or not, operand shapes or not, signatures or not, comments between
tokens, one instruction per line or everything on one line.

The property checked by the tests: XLA reads ``to_text(parse(T))`` as the same module
as ``T``, and printing is idempotent.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any, TypeVar

from hlo_shard.fuzz.emit import Names

INT_RANGES = {
    "s1": (-1, 0), "s2": (-2, 1), "s4": (-8, 7), "s8": (-128, 127), "s16": (-32768, 32767),
    "s32": (-2**31, 2**31 - 1), "s64": (-2**63, 2**63 - 1),
    "u1": (0, 1), "u2": (0, 3), "u4": (0, 15), "u8": (0, 255), "u16": (0, 65535),
    "u32": (0, 2**32 - 1), "u64": (0, 2**64 - 1),
}
#: Float types with infinities and NaN payloads that every XLA release prints back.
WIDE_FLOATS = ("f16", "bf16", "f32", "f64")
#: Narrow floats: only values every one of them represents exactly.
NARROW_FLOATS = ("f8e5m2", "f8e4m3", "f8e4m3fn", "f8e4m3b11fnuz", "f8e3m4", "f8e5m2fnuz",
                 "f8e4m3fnuz", "f4e2m1fn")
COMPLEX = ("c64", "c128")
ARRAY_TYPES = ("pred", *INT_RANGES, *WIDE_FLOATS, *NARROW_FLOATS, "f8e8m0fnu", *COMPLEX)

_FLOAT_VALUES = ("0", "1", "-2.5", "0.125", "1e-05", "-1.5e+30", "3.25", "inf", "-inf", "nan",
                 "-nan", "nan(0x1)", "-nan(0x7f)")
_NARROW_VALUES = ("0", "1", "-1.5", "0.5", "2", "-3")
_POSITIVE_POWERS = ("1", "0.5", "2", "4")
_LAYOUT_TAILS = ("T(8,128)", "T(8,128)(2,1)", "S(1)", "T(2,128)S(5)", "T(4)")
#: Metadata op names, one with the \' escapes old JAX wrote inside double quotes.
_OP_NAMES = ("jit(f)/add", "pmap(step)/psum[axes=(\\'dp\\',)]", "a b/c")
_OPS_UNARY = ("negate", "abs", "exponential", "tanh", "sqrt", "cosine", "sine", "floor",
              "log", "rsqrt", "sign", "logistic", "copy")
_OPS_BINARY = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power",
               "atan2", "remainder")


@dataclass
class Style:
    """How a module is spelled; none of it changes the module's meaning."""

    percent: float = 1.0          # chance that a name carries %
    operand_shapes: bool = False   # old printers: add(f32[4] %a, f32[4] %b)
    signatures: bool = True        # long form: %c (p: f32[]) -> f32[] {
    header: bool = True
    entry_keyword: bool = True
    comments: float = 0.0          # chance of a comment at each place one may go
    one_line: bool = False
    root_keyword: bool = True


@dataclass
class Value:
    name: str
    shape: str
    #: Array element type and dims (None for tuples, tokens, dynamic shapes).
    dtype: str | None = None
    dims: tuple[int, ...] | None = None


@dataclass
class ArrayValue(Value):
    """A value of array type: its element type and dims are known."""

    dtype: str
    dims: tuple[int, ...]


_V = TypeVar("_V", bound=Value)


@dataclass
class Inst:
    name: str
    shape: str
    opcode: str
    operands: list = field(default_factory=list)  # Value or nested Inst
    attrs: list[tuple[str, str]] = field(default_factory=list)
    payload: str | None = None  # parameter number or constant literal


class ModuleGenerator(Names):
    """One random module; :meth:`text` spells it in a random :class:`Style`."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.seed = seed
        self.style = self._random_style()
        #: (name, signature parameters, body, root shape) of each called computation.
        self.callees: list[tuple[str, str, list[Inst], str]] = []
        self._helpers: dict[str, str] = {}
        self.insts: list[Inst] = []
        self.values: list[Value] = []
        self.params = 0
        self.channel = 0
        self.devices = self.rng.choice((2, 4, 8))
        self.spmd = self.rng.random() < 0.5
        self.stack_frames = self.style.header and self.rng.random() < 0.2
        #: Callee name → execution_thread of the computation.
        self.threads: dict[str, str] = {}

    # ------------------------------------------------------------------ plumbing
    def _random_style(self) -> Style:
        r = self.rng
        header = r.random() < 0.9
        return Style(percent=r.choice((1.0, 1.0, 0.0, 0.5)), operand_shapes=r.random() < 0.3,
                     # XLA reads a module without header only if it starts with `name {`
                     signatures=header and r.random() < 0.7, header=header,
                     entry_keyword=not header or r.random() < 0.9,
                     comments=r.choice((0.0, 0.0, 0.1, 0.3)), one_line=r.random() < 0.1,
                     root_keyword=r.random() < 0.9)

    def add(self, inst: Inst, dtype: str | None = None, dims: tuple[int, ...] | None = None
            ) -> Value:
        if dtype is not None and dims is not None:
            return self.add_array(inst, dtype, dims)
        return self._keep(inst, Value(inst.name, inst.shape, dtype, dims))

    def add_array(self, inst: Inst, dtype: str, dims: tuple[int, ...]) -> ArrayValue:
        return self._keep(inst, ArrayValue(inst.name, inst.shape, dtype, dims))

    def _keep(self, inst: Inst, value: _V) -> _V:
        self.insts.append(inst)
        self.values.append(value)
        return value

    def op(self, opcode: str, dtype: str, dims: tuple[int, ...], operands: Iterable[Any] = (),
           attrs: Iterable[tuple[str, str]] = (),
           shape: str | None = None) -> ArrayValue:
        """A new instruction ``opcode`` of array type ``dtype[dims]`` (or ``shape``)."""
        inst = Inst(self.fresh(opcode), shape or _shape(dtype, dims), opcode, list(operands),
                    list(attrs))
        return self.add_array(inst, dtype, dims)

    def constant(self, dtype: str, literal: str, base: str = "constant") -> ArrayValue:
        inst = Inst(self.fresh(base), f"{dtype}[]", "constant", payload=literal)
        return self.add_array(inst, dtype, ())

    def _parameter(self, shape: str, attrs: list[tuple[str, str]] | None = None) -> Inst:
        inst = Inst(self.fresh(self.rng.choice(("p", "arg", "Arg_0", "x", "param"))), shape,
                    "parameter", payload=str(self.params), attrs=attrs or [])
        self.params += 1
        return inst

    def param(self, shape: str, attrs: list[tuple[str, str]] | None = None) -> Value:
        return self.add(self._parameter(shape, attrs))

    def array(self, dtype: str, dims: tuple[int, ...]) -> ArrayValue:
        """An existing value of exactly this type and dims, or a new parameter."""
        matches = [v for v in self.values
                   if isinstance(v, ArrayValue) and v.dtype == dtype and v.dims == dims]
        if matches and self.rng.random() < 0.7:
            return self.rng.choice(matches)
        return self.add_array(self._parameter(_shape(dtype, dims)), dtype, dims)

    def helper(self, kind: str, dtype: str = "f32") -> str:
        """A called computation, emitted once (callees precede callers)."""
        key = f"{kind}_{dtype}"
        if key in self._helpers:
            return self._helpers[key]
        name = self.fresh(key if self.rng.random() < 0.7 else f"region_{len(self._helpers)}.1")
        scalar = f"{dtype}[]"
        body = [Inst("a", scalar, "parameter", payload="0"),
                Inst("b", scalar, "parameter", payload="1")]
        if kind in ("add", "max", "mul"):
            opcode = {"add": "add", "max": "maximum", "mul": "multiply"}[kind]
            body.append(Inst("r", scalar, opcode, [Value("a", scalar), Value("b", scalar)]))
            self.callees.append((name, f"a: {scalar}, b: {scalar}", body, scalar))
        elif kind in ("lt", "ge"):
            direction = "LT" if kind == "lt" else "GE"
            body.append(Inst("r", "pred[]", "compare", [Value("a", scalar), Value("b", scalar)],
                             [("direction", direction)]))
            self.callees.append((name, f"a: {scalar}, b: {scalar}", body, "pred[]"))
        self._helpers[key] = name
        return name

    def attr_common(self, inst: Inst, rank: int | None) -> None:
        """Random attributes any instruction may carry."""
        r = self.rng
        if r.random() < 0.25:
            inst.attrs.append(("metadata", self.metadata()))
        if r.random() < 0.15 and rank is not None:
            inst.attrs.append(("sharding", self.sharding(rank)))
        if r.random() < 0.1:
            inst.attrs.append(("frontend_attributes", r.choice((
                '{_xla_compute_type="host"}', '{_scheduling_group_id="1", key-2.x="v"}',
                '{xla.sdy.sharding="#sdy.sharding<@mesh, [{\\"x\\"}]>"}')))
                              )
        if r.random() < 0.08:
            inst.attrs.append(("backend_config", r.choice((
                '{"operation_queue_id":"0","wait_on_operation_queues":[],'
                '"force_earliest_schedule":false}',
                '"opaque string with \\"quotes\\""', '{}',
                '{"outer":{"inner":[1,2,{"x":"}"}]}}'))))
        if r.random() < 0.08 and len(self.insts) > 1:
            earlier = r.sample([i.name for i in self.insts], k=min(2, len(self.insts)))
            inst.attrs.append(("control-predecessors", "{" + ", ".join(
                self.spell(n) for n in earlier) + "}"))
        if r.random() < 0.04:
            inst.attrs.append(("statistics", "{visualizing_index=1,stat-0=0.5}"))
        first: dict[str, str] = {}
        for key, value in inst.attrs:  # one of each: XLA refuses a repeated attribute
            first.setdefault(key, value)
        inst.attrs[:] = first.items()

    def metadata(self) -> str:
        r = self.rng
        op_name = r.choice(_OP_NAMES)
        parts = [f'op_type="{r.choice(("add", "dot_general", "psum"))}"', f'op_name="{op_name}"']
        if r.random() < 0.6:
            parts += [f'source_file="{r.choice(("/x/train.py", "t.py"))}"',
                      f"source_line={r.randint(1, 900)}"]
        if r.random() < 0.3:
            parts += [f"source_end_line={r.randint(1, 900)}", f"source_column={r.randint(1, 80)}",
                      f"source_end_column={r.randint(1, 80)}"]
        if r.random() < 0.2:
            parts.append('deduplicated_name="fusion.1"')
        if r.random() < 0.3:  # without the FileNames table XLA drops it, on both reads
            parts.append(f"stack_frame_id={r.randint(1, 2)}")
        r.shuffle(parts)
        return "{" + r.choice((" ", ", ")).join(parts) + "}"

    def sharding(self, rank: int) -> str:
        r = self.rng
        options = ["{replicated}", "{maximal device=0}", "{manual}", "{unknown shard_as 1}",
                   "{replicated metadata={op_name=\"s\"}}"]
        if rank >= 1:
            tiles = [2] + [1] * (rank - 1)
            tiled, replicated = ",".join(map(str, tiles)), ",".join(map(str, tiles + [2]))
            options += [f"{{devices=[{tiled}]0,1}}",
                        f"{{devices=[{replicated}]<=[4] last_tile_dim_replicate}}",
                        f"{{devices=[{replicated}]0,1,2,3 last_tile_dims={{manual}}}}"]
        if rank >= 2:
            options.append("{devices=[2,2" + ",1" * (rank - 2) + "]<=[2,2]T(1,0)}")
        return r.choice(options)

    def replica_groups(self) -> str:
        n, r = self.devices, self.rng
        half = n // 2
        forms = ["{" + ",".join("{" + f"{i},{i + 1}" + "}" for i in range(0, n, 2)) + "}",
                 f"[{half},2]<=[{n}]", f"[2,{half}]<=[{half},2]T(1,0)", f"mesh['x'={n}] {{'x'}}",
                 "{" + "{" + ",".join(map(str, range(n))) + "}" + "}"]
        if n >= 4:  # mesh axes of size 1 would make groups of one device, which XLA refuses
            forms += [f"mesh['x'={half},'y'=2] {{'x'}}", f"mesh['a'=2,'b'={half}] {{'b'}}",
                      f"mesh['x'={n}] {{'x':(2){half}}}"]
            reversed_ids = ",".join(map(str, reversed(range(n))))
            forms.append(f"mesh['x'=2,'y'={half}], device_ids=({reversed_ids}) {{'y'}}")
        if not self.spmd:
            forms.append("{}")
        return r.choice(forms)

    def collective_attrs(self, groups: str | None = None) -> list[tuple[str, str]]:
        attrs = []
        if self.spmd:
            self.channel += 1
            attrs.append(("channel_id", str(self.channel)))
        attrs.append(("replica_groups", groups or self.replica_groups()))
        if self.spmd:
            attrs.append(("use_global_device_ids", "true"))
        return attrs

    # ---------------------------------------------------------------- random parts
    def random_dims(self, max_rank: int = 3, allow_zero: bool = True) -> tuple[int, ...]:
        r = self.rng
        sizes = (0, 1, 2, 3, 4, 5) if allow_zero else (1, 2, 3, 4, 5)
        return tuple(r.choice(sizes) for _ in range(r.randint(0, max_rank)))

    def random_layout(self, dtype: str, dims: tuple[int, ...]) -> str:
        r = self.rng
        if not dims or r.random() < 0.6:
            return ""
        order = list(range(len(dims)))[::-1]
        if r.random() < 0.5:
            r.shuffle(order)
        tail = ""
        if dtype in ("s4", "u4") and r.random() < 0.5:
            tail = "E(4)"
        elif r.random() < 0.4:
            tail = r.choice(_LAYOUT_TAILS)
        return "{" + ",".join(map(str, order)) + (f":{tail}" if tail else "") + "}"

    def random_shape(self, depth: int = 0) -> tuple[str, int | None]:
        """Shape text and its rank (None for tuples, tokens and opaque values)."""
        r = self.rng
        roll = r.random()
        if roll < 0.12 and depth < 3:
            parts = [self.random_shape(depth + 1)[0] for _ in range(r.randint(0, 3))]
            return "(" + ", ".join(parts) + ")", None
        if roll < 0.16:
            return r.choice(("token[]", "opaque[]")), None
        dtype = r.choice(ARRAY_TYPES)
        dims = self.random_dims()
        if r.random() < 0.1 and dims:
            text = ",".join(r.choice((f"<={d}", "?", str(d))) for d in dims)
            return f"{dtype}[{text}]", len(dims)
        return _shape(dtype, dims) + self.random_layout(dtype, dims), len(dims)

    def scalar_literal(self, dtype: str) -> str:
        r = self.rng
        if dtype == "pred":
            return r.choice(("true", "false", "1", "0"))
        if dtype in INT_RANGES:
            low, high = INT_RANGES[dtype]
            return str(r.choice((low, high, 0, r.randint(low, high))))
        if dtype in WIDE_FLOATS:
            value = r.choice(_FLOAT_VALUES)
            return "1.5" if dtype in ("f16", "bf16") and "e+30" in value else value
        if dtype in COMPLEX:
            return f"({r.choice(('0', '1', '-2.5', 'inf'))}, {r.choice(('0', '-1', '0.5', 'nan'))})"
        if dtype == "f8e8m0fnu":
            return r.choice(_POSITIVE_POWERS)
        return r.choice(_NARROW_VALUES)

    def literal(self, dtype: str, dims: tuple[int, ...]) -> str:
        if not dims:
            return self.scalar_literal(dtype)
        if math.prod(dims) > 10 or (math.prod(dims) > 1 and self.rng.random() < 0.1):
            if self.rng.random() < 0.5:
                return "{...}"
        return self._nested(dtype, dims)

    def _nested(self, dtype: str, dims: tuple[int, ...]) -> str:
        if len(dims) == 1:
            return "{" + ", ".join(self.scalar_literal(dtype) for _ in range(dims[0])) + "}"
        return "{ " + ", ".join(self._nested(dtype, dims[1:]) for _ in range(dims[0])) + " }"

    # ------------------------------------------------------------------- templates
    def t_parameter(self) -> None:
        r = self.rng
        shape, rank = self.random_shape()
        attrs = []
        if r.random() < 0.2 and not shape.startswith("("):
            attrs.append(("parameter_replication", r.choice(("{true}", "{false}"))))
        if r.random() < 0.2 and rank is not None:
            attrs.append(("sharding", self.sharding(rank)))
        self.param(shape, attrs=attrs)

    def t_constant(self) -> None:
        r = self.rng
        if r.random() < 0.15:
            parts = [(r.choice(("f32", "s32", "pred")), self.random_dims(2, False))
                     for _ in range(r.randint(1, 3))]
            shape = "(" + ", ".join(_shape(d, s) for d, s in parts) + ")"
            literal = "(" + ", ".join(self._nested(d, s) if s else self.scalar_literal(d)
                                      for d, s in parts) + ")"
            self.add(Inst(self.fresh("constant"), shape, "constant", payload=literal))
            return
        dtype = r.choice(ARRAY_TYPES)
        dims = self.random_dims()
        if math.prod(dims) > 24:
            dims = dims[:1]
        layout = self.random_layout(dtype, dims) if r.random() < 0.3 else ""
        literal = self.literal(dtype, dims)
        # XLA renames instructions whose name another computation uses; an elided constant
        # keeps a distinctive name so the tests can find it in XLA's print.
        base = "elided" if literal == "{...}" else r.choice(("constant", "c", "cst"))
        self.add(Inst(self.fresh(base), _shape(dtype, dims) + layout, "constant",
                      payload=literal), dtype, dims)

    def _float_array(self) -> ArrayValue:
        dtype = self.rng.choice(WIDE_FLOATS)
        return self.array(dtype, self.random_dims(3, False))

    def t_elementwise(self) -> None:
        r = self.rng
        a = self._float_array()
        if r.random() < 0.5:
            opcode = r.choice(_OPS_UNARY)
            inst = Inst(self.fresh(opcode), a.shape, opcode, [a])
        else:
            b = self.array(a.dtype, a.dims)
            opcode = r.choice(_OPS_BINARY)
            operand: Value | Inst = b
            if r.random() < 0.15:  # a nested anonymous operand: add(p, f32[4] negate(p))
                operand = Inst("", a.shape, "negate", [b])
            inst = Inst(self.fresh(opcode), a.shape, opcode, [a, operand])
        self.attr_common(inst, len(a.dims))
        self.add(inst, a.dtype, a.dims)

    def t_compare_select(self) -> None:
        a = self._float_array()
        b = self.array(a.dtype, a.dims)
        pred_shape = _shape("pred", a.dims)
        attrs = [("direction", self.rng.choice(("EQ", "NE", "LT", "LE", "GT", "GE")))]
        if self.rng.random() < 0.3:
            attrs.append(("type", "TOTALORDER" if self.rng.random() < 0.5 else "FLOAT"))
        p = self.op("compare", "pred", a.dims, [a, b], attrs, shape=pred_shape)
        self.op("select", a.dtype, a.dims, [p, a, b], shape=a.shape)

    def t_collective(self) -> None:
        r = self.rng
        n = self.devices
        dtype = r.choice(("f32", "bf16", "s32"))
        dims = (r.choice((2, 4, 8)) * n, r.choice((1, 3)))
        a = self.array(dtype, dims)
        kind = r.choice(("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                         "all-to-all", "all-reduce-start", "tuple-all-reduce"))
        to_apply = ("to_apply", "%" + self.helper("add", dtype))
        if kind == "all-reduce":
            constrain = [("constrain_layout", "true")] if r.random() < 0.1 else []
            self.op(kind, dtype, dims, [a], self.collective_attrs() + constrain + [to_apply])
        elif kind == "tuple-all-reduce":
            b = self.array(dtype, dims)
            shape = f"({a.shape}, {b.shape})"
            self.add(Inst(self.fresh("all-reduce"), shape, "all-reduce", [a, b],
                          self.collective_attrs() + [to_apply]))
        elif kind == "all-reduce-start":
            start = self.add(Inst(self.fresh("all-reduce-start"), a.shape, kind, [a],
                                  self.collective_attrs() + [to_apply]))
            self.add(Inst(self.fresh("all-reduce-done"), a.shape, "all-reduce-done", [start]),
                     dtype, dims)
        elif kind == "all-gather":
            out = (dims[0] * 2, dims[1])
            groups = "{" + ",".join("{" + f"{i},{i + 1}" + "}" for i in range(0, n, 2)) + "}"
            attrs = self.collective_attrs(groups) + [("dimensions", "{0}")]
            self.op(kind, dtype, out, [a], attrs)
        elif kind == "reduce-scatter":
            out = (dims[0] // 2, dims[1])
            groups = f"[{n // 2},2]<=[{n}]"
            attrs = self.collective_attrs(groups) + [("dimensions", "{0}"), to_apply]
            self.op(kind, dtype, out, [a], attrs)
        elif kind == "collective-permute":
            pairs = "{" + ",".join("{" + f"{i},{(i + 1) % n}" + "}" for i in range(n)) + "}"
            attrs = ([("channel_id", str(self._next_channel()))] if self.spmd else []) + \
                [("source_target_pairs", pairs)]
            self.op(kind, dtype, dims, [a], attrs)
        else:
            attrs = [("replica_groups", "{" + "{" + ",".join(map(str, range(n))) + "}}"),
                     ("dimensions", "{0}")]
            if self.spmd:
                attrs.insert(0, ("channel_id", str(self._next_channel())))
            self.op("all-to-all", dtype, dims, [a], attrs)

    def _next_channel(self) -> int:
        self.channel += 1
        return self.channel

    def t_data_movement(self) -> None:
        r = self.rng
        dtype = r.choice(("f32", "s32", "bf16", "pred"))
        dims = tuple(r.choice((2, 3, 4, 6)) for _ in range(r.randint(1, 3)))
        a = self.array(dtype, dims)
        kind = r.choice(("slice", "pad", "transpose", "reshape", "broadcast", "reverse",
                         "concatenate", "dynamic-slice", "iota", "bitcast", "gte", "dus"))
        rank = len(dims)
        if kind == "slice":
            ranges = [(0, d, 1) if r.random() < 0.5 else (1, d, 2) for d in dims]
            out = tuple(len(range(lo, hi, st)) for lo, hi, st in ranges)
            text = "{" + ", ".join(f"[{lo}:{hi}]" if st == 1 and r.random() < 0.5 else
                                   f"[{lo}:{hi}:{st}]" for lo, hi, st in ranges) + "}"
            self.op(kind, dtype, out, [a], [("slice", text)])
        elif kind == "pad":
            cfg = [(r.randint(-1, 2), r.randint(0, 2), r.choice((0, 0, 1))) for _ in dims]
            out = tuple(lo + hi + d + max(d - 1, 0) * it for (lo, hi, it), d in zip(cfg, dims))
            interior = any(it for _, _, it in cfg)
            text = "x".join(f"{lo}_{hi}_{it}" if interior else f"{lo}_{hi}" for lo, hi, it in cfg)
            zero = self.constant(dtype, self.scalar_literal(dtype), "zero")
            self.op(kind, dtype, out, [a, zero], [("padding", text)])
        elif kind == "transpose":
            perm = list(range(rank))
            r.shuffle(perm)
            out = tuple(dims[p] for p in perm)
            self.op(kind, dtype, out, [a], [("dimensions", "{" + ",".join(map(str, perm)) + "}")])
        elif kind in ("reshape", "bitcast"):
            out = (math.prod(dims),)
            self.op(kind, dtype, out, [a])
        elif kind == "broadcast":
            out = (2,) + dims
            mapped = "{" + ",".join(str(i + 1) for i in range(rank)) + "}"
            self.op(kind, dtype, out, [a], [("dimensions", mapped)])
        elif kind == "reverse":
            self.op(kind, dtype, dims, [a], [("dimensions", "{0}")])
        elif kind == "concatenate":
            b = self.array(dtype, dims)
            out = (dims[0] * 2,) + dims[1:]
            self.op(kind, dtype, out, [a, b], [("dimensions", "{0}")])
        elif kind in ("dynamic-slice", "dus"):
            index_type = r.choice(("s32", "u32"))
            idx = [self.constant(index_type, "1", "idx") for _ in dims]
            ones = tuple(1 for _ in dims)
            if kind == "dus":
                update = self.array(dtype, ones)
                self.op("dynamic-update-slice", dtype, dims, [a, update, *idx])
            else:
                sizes = "{" + ",".join(map(str, ones)) + "}"
                self.op(kind, dtype, ones, [a, *idx], [("dynamic_slice_sizes", sizes)])
        elif kind == "iota":
            self.op("iota", "s32" if dtype == "pred" else dtype, dims, [],
                    [("iota_dimension", str(r.randrange(rank)))])
        else:
            tup = self.param(f"({a.shape}, (s32[], pred[2]))")
            self.op("get-tuple-element", dtype, dims, [tup], [("index", "0")], shape=a.shape)

    def t_reduce_like(self) -> None:
        r = self.rng
        kind = r.choice(("reduce", "reduce-window", "sort", "map", "select-and-scatter",
                         "convolution", "dot", "gather", "scatter"))
        f32 = "f32"
        if kind == "reduce":
            a = self.array(f32, (4, 6))
            init = self.add(Inst(self.fresh("init"), "f32[]", "constant", payload="0"), f32, ())
            to_apply = "%" + self.helper("add") if r.random() < 0.8 else \
                "{ x = f32[] parameter(0) y = f32[] parameter(1) ROOT z = f32[] add(x, y) }"
            self.add(Inst(self.fresh("reduce"), "f32[4]", kind, [a, init],
                          [("dimensions", "{1}"), ("to_apply", to_apply)]), f32, (4,))
        elif kind == "reduce-window":
            a = self.array(f32, (4, 6))
            init = self.add(Inst(self.fresh("init"), "f32[]", "constant", payload="-inf"), f32, ())
            window = r.choice(("{size=2x3 stride=2x3}", "{size=3x3 pad=1_1x1_1}",
                               "{size=2x2 stride=1x1 pad=0_1x0_1 lhs_dilate=1x1 rhs_dilate=1x1}"))
            out: tuple[int, ...] = (2, 2) if window == "{size=2x3 stride=2x3}" else (4, 6)
            self.op(kind, f32, out, [a, init],
                    [("window", window), ("to_apply", "%" + self.helper("max"))])
        elif kind == "sort":
            a = self.array(f32, (8,))
            self.op(kind, f32, (8,), [a], [("dimensions", "{0}"), ("is_stable", "true"),
                                           ("to_apply", "%" + self.helper("lt"))])
        elif kind == "map":
            a = self.array(f32, (3,))
            b = self.array(f32, (3,))
            self.op(kind, f32, (3,), [a, b],
                    [("dimensions", "{0}"), ("to_apply", "%" + self.helper("add"))])
        elif kind == "select-and-scatter":
            a = self.array(f32, (4, 6))
            source = self.array(f32, (2, 3))
            init = self.constant(f32, "0", "init")
            self.op(kind, f32, (4, 6), [a, source, init],
                    [("window", "{size=2x2 stride=2x2}"), ("select", "%" + self.helper("ge")),
                     ("scatter", "%" + self.helper("add"))])
        elif kind == "convolution":
            lhs = self.array(f32, (1, 5, 5, 2))
            rhs = self.array(f32, (3, 3, 2, 4))
            attrs = [("window", r.choice(("{size=3x3}", "{size=3x3 pad=1_1x1_1}",
                                         "{size=3x3 stride=2x2 pad=1_1x1_1 rhs_reversal=0x1}"))),
                     ("dim_labels", "b01f_01io->b01f")]
            out = (1, 5, 5, 4) if attrs[0][1] == "{size=3x3 pad=1_1x1_1}" else (1, 3, 3, 4)
            if r.random() < 0.3:
                attrs.append(("feature_group_count", "1"))
            if r.random() < 0.3:
                attrs.append(("operand_precision", "{highest,default}"))
            self.op(kind, f32, out, [lhs, rhs], attrs)
        elif kind == "dot":
            lhs = self.array(f32, (2, 3, 4))
            rhs = self.array(f32, (2, 4, 5))
            attrs = [("lhs_batch_dims", "{0}"), ("lhs_contracting_dims", "{2}"),
                     ("rhs_batch_dims", "{0}"), ("rhs_contracting_dims", "{1}")]
            r.shuffle(attrs)
            if r.random() < 0.3:
                attrs.append(("operand_precision", "{high,highest}"))
            self.op(kind, f32, (2, 3, 5), [lhs, rhs], attrs)
        elif kind == "gather":
            operand = self.array(f32, (5, 4))
            indices = self.array("s32", (3, 1))
            attrs = [("offset_dims", "{1}"), ("collapsed_slice_dims", "{0}"),
                     ("start_index_map", "{0}"), ("index_vector_dim", "1"),
                     ("slice_sizes", "{1,4}")]
            if r.random() < 0.3:
                attrs.append(("indices_are_sorted", "true"))
            self.op(kind, f32, (3, 4), [operand, indices], attrs)
        else:
            operand = self.array(f32, (5, 4))
            indices = self.array("s32", (3, 1))
            updates = self.array(f32, (3, 4))
            attrs = [("update_window_dims", "{1}"), ("inserted_window_dims", "{0}"),
                     ("scatter_dims_to_operand_dims", "{0}"), ("index_vector_dim", "1"),
                     ("to_apply", "%" + self.helper("add"))]
            if r.random() < 0.3:
                attrs.append(("unique_indices", "true"))
            self.op(kind, f32, (5, 4), [operand, indices, updates], attrs)

    def t_misc(self) -> None:
        r = self.rng
        kind = r.choice(("custom-call", "convert", "bitcast-convert", "reduce-precision",
                         "rng-bit-generator", "replica-id", "partition-id", "opt-barrier", "tuple",
                         "after-all", "clamp"))
        if kind == "custom-call":
            a = self._float_array()
            attrs = [("custom_call_target", r.choice(('"my_target"', '"Sharding"', '"x\\"y"')))]
            if r.random() < 0.4:
                attrs.append(("api_version", r.choice(("API_VERSION_TYPED_FFI",
                                                       "API_VERSION_STATUS_RETURNING"))))
            if r.random() < 0.3:
                attrs.append(("custom_call_has_side_effect", "true"))
            if r.random() < 0.4:
                attrs.append(("backend_config", r.choice(('"cfg"', '{"k":[1,{"n":"}"}]}'))))
            self.op(kind, a.dtype, a.dims, [a], attrs, shape=a.shape)
        elif kind in ("convert", "bitcast-convert"):
            a = self.array("f32", (3,))
            target = r.choice(("bf16", "s32", "f16") if kind == "convert" else ("s32", "u32"))
            self.op(kind, target, (3,), [a])
        elif kind == "reduce-precision":
            a = self.array("f32", (3,))
            self.op(kind, "f32", (3,), [a], [("exponent_bits", "5"), ("mantissa_bits", "10")])
        elif kind == "rng-bit-generator":
            state = self.array("u64", (2,))
            self.add(Inst(self.fresh("rng"), "(u64[2], u32[4])", kind, [state],
                          [("algorithm", r.choice(("rng_three_fry", "rng_philox",
                                                   "rng_default")))]))
        elif kind in ("replica-id", "partition-id"):
            self.op(kind, "u32", ())
        elif kind == "opt-barrier":
            a = self._float_array()
            self.add(Inst(self.fresh("opt-barrier"), f"({a.shape})", kind,
                          [Inst("", f"({a.shape})", "tuple", [a])] if r.random() < 0.3 else
                          [self.add(Inst(self.fresh("tuple"), f"({a.shape})", "tuple", [a]))]))
        elif kind == "tuple":
            picks = r.sample(self.values, k=min(len(self.values), r.randint(0, 3)))
            self.add(Inst(self.fresh("tuple"), _tuple(picks), kind, picks))
        elif kind == "after-all":
            token = self.add(Inst(self.fresh("after-all"), "token[]", kind))
            self.add(Inst(self.fresh("after-all"), "token[]", kind, [token, token]))
        else:
            a = self.array("f32", (4,))
            low, high = self.constant("f32", "-1", "lo"), self.constant("f32", "1", "hi")
            self.op(kind, "f32", (4,), [low, a, high])

    def t_control_flow(self) -> None:
        r = self.rng
        kind = r.choice(("while", "conditional", "call", "fusion"))
        a = self.array("f32", (4,))
        if kind in ("call", "fusion"):
            name = self.fresh("fused_computation" if kind == "fusion" else "callee")
            body = [Inst("param_0", "f32[4]", "parameter", payload="0"),
                    Inst("neg", "f32[4]", "negate", [Value("param_0", "f32[4]")])]
            self.callees.append((name, "param_0: f32[4]", body, "f32[4]"))
            if kind == "call" and r.random() < 0.3:
                self.threads[name] = "main"
            attrs = [("calls", "%" + name), ("kind", r.choice(("kLoop", "kInput", "kOutput")))] \
                if kind == "fusion" else [("to_apply", "%" + name)]
            self.add(Inst(self.fresh(kind), "f32[4]", kind, [a], attrs), "f32", (4,))
        elif kind == "conditional":
            branches = []
            for i in range(r.choice((2, 3))):
                name = self.fresh(f"branch_{i}")
                body = [Inst("bp", "f32[4]", "parameter", payload="0"),
                        Inst("out", "f32[4]", r.choice(("negate", "abs", "copy")),
                             [Value("bp", "f32[4]")])]
                self.callees.append((name, "bp: f32[4]", body, "f32[4]"))
                branches.append(name)
            if len(branches) == 2 and r.random() < 0.5:
                index = self.constant("pred", "true", "flag")
                attrs = [("true_computation", "%" + branches[0]),
                         ("false_computation", "%" + branches[1])]
            else:
                index = self.constant("s32", "1", "index")
                attrs = [("branch_computations", "{" + ", ".join("%" + b for b in branches) + "}")]
            self.op(kind, "f32", (4,), [index] + [a] * len(branches), attrs)
        else:
            carry = "(s32[], f32[4])"
            cond = self.fresh("cond")
            body_name = self.fresh("body")
            cv = Value("c", carry)
            self.callees.append((cond, f"c: {carry}", [
                Inst("c", carry, "parameter", payload="0"),
                Inst("i", "s32[]", "get-tuple-element", [cv], [("index", "0")]),
                Inst("n", "s32[]", "constant", payload="3"),
                Inst("lt", "pred[]", "compare", [Value("i", "s32[]"), Value("n", "s32[]")],
                     [("direction", "LT")])],
                "pred[]"))
            self.callees.append((body_name, f"c: {carry}", [
                Inst("c", carry, "parameter", payload="0"),
                Inst("i", "s32[]", "get-tuple-element", [cv], [("index", "0")]),
                Inst("v", "f32[4]", "get-tuple-element", [cv], [("index", "1")]),
                Inst("one", "s32[]", "constant", payload="1"),
                Inst("j", "s32[]", "add", [Value("i", "s32[]"), Value("one", "s32[]")]),
                Inst("w", "f32[4]", "negate", [Value("v", "f32[4]")]),
                Inst("next", carry, "tuple", [Value("j", "s32[]"), Value("w", "f32[4]")])], carry))
            zero = self.add(Inst(self.fresh("zero"), "s32[]", "constant", payload="0"), "s32", ())
            init = self.add(Inst(self.fresh("init"), carry, "tuple", [zero, a]))
            self.add(Inst(self.fresh("while"), carry, kind, [init],
                          [("condition", "%" + cond), ("body", "%" + body_name)]))

    TEMPLATES = ("t_parameter", "t_constant", "t_elementwise", "t_compare_select", "t_collective",
                 "t_data_movement", "t_reduce_like", "t_misc", "t_control_flow")
    WEIGHTS = (3, 4, 4, 1, 3, 4, 3, 2, 1)

    def build(self) -> ModuleGenerator:
        r = self.rng
        for _ in range(r.randint(2, 10)):
            getattr(self, r.choices(self.TEMPLATES, self.WEIGHTS)[0])()
        every = self.insts
        for position, inst in enumerate(every):
            if inst.opcode != "parameter" and not any(k == "metadata" for k, _ in inst.attrs) \
                    and r.random() < 0.05:
                self.insts = every[:position]  # control predecessors come from earlier lines
                self.attr_common(inst, None)
        self.insts = every
        return self

    # ------------------------------------------------------------------- spelling
    def spell(self, name: str) -> str:
        return ("%" if self.rng.random() < self.style.percent else "") + name

    def gap(self) -> str:
        """Whitespace, sometimes with a comment, where XLA's lexer skips both."""
        r = self.rng
        if r.random() >= self.style.comments:
            return " "
        return r.choice((" /* note */ ", " /*index=5*/ ", "\n // line comment\n ", " /**/ "))

    def operand_text(self, operand: Any, index: int) -> str:
        if isinstance(operand, Inst):  # nested anonymous instruction
            inner = ", ".join(self.operand_text(o, i) for i, o in enumerate(operand.operands))
            return f"{operand.shape} {operand.opcode}({inner})"
        text = self.spell(operand.name)
        if self.style.operand_shapes:
            text = f"{operand.shape} {text}"
        if index and index % 5 == 0 and self.rng.random() < 0.5:
            text = f"/*index={index}*/{text}"
        return text

    def inst_text(self, inst: Inst, root: bool) -> str:
        head = ("ROOT " if root and self.style.root_keyword else "") + self.spell(inst.name) + " = "
        shape = inst.shape if not (self.style.comments and "(" in inst.shape) else \
            inst.shape.replace(", ", "," + self.gap(), 1)
        if inst.payload is not None:
            body = f"{inst.opcode}({inst.payload})"
        else:
            sep = "," + self.gap()
            operands = sep.join(self.operand_text(o, i) for i, o in enumerate(inst.operands))
            body = f"{inst.opcode}({operands})"
        attrs = "".join(f",{self.gap()}{k}={v}" for k, v in inst.attrs)
        return f"{head}{shape} {body}{attrs}"

    def computation_text(self, name: str, params: str, body: list[Inst], root_shape: str,
                         entry: bool = False) -> str:
        newline = " " if self.style.one_line else "\n  "
        head = ("ENTRY " if entry and self.style.entry_keyword else "") + self.spell(name)
        if self.style.signatures:
            head += f" ({params}) -> {root_shape}"
        lines = [self.inst_text(inst, i == len(body) - 1) for i, inst in enumerate(body)]
        closing = "" if self.style.one_line else "\n"
        thread = f', execution_thread="{self.threads[name]}"' if name in self.threads else ""
        return head + " {" + newline + newline.join(lines) + closing + "}" + thread

    def text(self) -> str:
        if not self.insts:
            self.t_parameter()
        used: set[str] = set()
        for inst in self.insts:
            used.update(o.name for o in inst.operands if isinstance(o, Value))
        leaves = [v for v in self.values if v.name not in used]
        root = Inst(self.fresh("tuple"), _tuple(leaves), "tuple", leaves)
        self.insts.append(root)
        params = sorted((i for i in self.insts if i.opcode == "parameter"),
                        key=_parameter_number)
        header = ""
        if self.style.header:
            attrs = []
            size = ("num_partitions" if self.spmd else "replica_count", str(self.devices))
            attrs.append(size)
            if self.rng.random() < 0.2:
                attrs.insert(0, ("is_scheduled", "false"))
            if self.rng.random() < 0.15:
                attrs.append(("frontend_attributes",
                              '{xla.sdy.meshes={mesh = #sdy.mesh<["dp"=4]>}}'))
            layout = _entry_layout([p.shape for p in params], [v.shape for v in leaves])
            if layout and self.rng.random() < 0.3:
                attrs.insert(0, ("entry_computation_layout", layout))
            header = f"HloModule fe_{self.seed}" + "".join(f", {k}={v}" for k, v in attrs)
            if self.stack_frames:
                header += STACK_FRAMES
        signature = ", ".join(f"{p.name}: {p.shape}" for p in params)
        blocks = [self.computation_text(name, sig, body, root_shape)
                  for name, sig, body, root_shape in self.callees]
        blocks.append(self.computation_text(self.fresh("main"), signature, self.insts, root.shape,
                                            entry=True))
        separator = " " if self.style.one_line else "\n\n"
        return separator.join(([header] if header else []) + blocks) + "\n"


#: A FileNames … StackFrames section as jax 0.10 writes it after the header.
STACK_FRAMES = """

FileNames
1 "train.py"

FunctionNames
1 "<module>"
2 "step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=25 end_line=25 column=6 end_column=6}
2 {file_name_id=1 function_name_id=2 line=14 end_line=14 column=10 end_column=10}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}"""

_PLAIN_ARRAY = re.compile(r"^([a-z0-9]+)\[([\d,]*)\](\{[^}]*\})?$")


def _entry_layout(params: list[str], results: list[str]) -> str | None:
    """``{(p0, p1)->(r0, …)}`` with every layout spelled out, or None when a shape is
    not a plain array (tuples, tokens, dynamic dimensions)."""
    def with_layout(shape: str) -> str | None:
        match = _PLAIN_ARRAY.match(shape)
        if match is None or match.group(1) in ("token", "opaque"):
            return None
        rank = len(match.group(2).split(",")) if match.group(2) else 0
        if match.group(3) or not rank:
            return shape
        return shape + "{" + ",".join(map(str, range(rank - 1, -1, -1))) + "}"

    texts = [text for text in map(with_layout, params + results) if text is not None]
    if len(texts) != len(params) + len(results):
        return None
    ins, outs = texts[:len(params)], texts[len(params):]
    return "{(" + ", ".join(ins) + ")->(" + ", ".join(outs) + ")}"


def _parameter_number(inst: Inst) -> int:
    assert inst.payload is not None, "a parameter's payload is its number"
    return int(inst.payload)


def _tuple(values: list[Value]) -> str:
    return "(" + ", ".join(v.shape for v in values) + ")"


def _shape(dtype: str, dims: tuple[int, ...]) -> str:
    return f"{dtype}[{','.join(map(str, dims))}]"


def random_module(seed: int) -> str:
    """The module text of ``seed`` (always the same for the same seed)."""
    return ModuleGenerator(seed).build().text()
