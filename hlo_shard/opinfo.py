"""One table of opcode facts: what every HLO opcode is, as the analyses, the rewrites,
the validator and the parser need to know it.

Each opcode of XLA's ``HLO_OPCODE_LIST`` (``xla/hlo/ir/hlo_opcode.h``) has one
:class:`OpInfo` record in :data:`OPINFO`; the opcode sets modules use are derived from
it (:func:`opcodes_where`), so two modules cannot disagree on what ``copy`` is. A fact
that XLA's own rules decide differently on purpose has its own field: XLA's cost analysis
prices ``copy`` as memory traffic only though it is elementwise, so :attr:`OpInfo.cost`
is not derived from :attr:`OpInfo.elementwise`.

Facts about one *instruction* rather than its opcode (a custom call's target, a
``bitcast-convert`` that changes the bit width) stay with the code that reads them.
``tests/test_opinfo.py`` lists where today's module-level sets still differ from this
table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

#: How XLA's ``HloCostAnalysis`` prices the op (``""``: by a rule of its own: dots,
#: reductions, data movement, control flow …).
CostRule = Literal["", "flop", "transcendental", "free", "all-reduce"]
FLOP: CostRule = "flop"  # one flop per output element
TRANSCENDENTAL: CostRule = "transcendental"  # one transcendental per output element
FREE: CostRule = "free"  # moves pointers or orders execution: no flops, no bytes
ALL_REDUCE: CostRule = "all-reduce"  # one flop per output element (XLA assumes 2 replicas)

#: What the result is when every device holds the same operand values.
Values = Literal["structural", "deterministic", "per-device"]
#: Identical on every device (a function of the operand values).
DETERMINISTIC: Values = "deterministic"
#: May differ per device, or is not a function of the operands (ids, rng, receives).
PER_DEVICE: Values = "per-device"
#: Decided by the analysis from the structure (parameters, tuples, calls, loops,
#: all-reduce and all-gather over groups, async wrappers).
STRUCTURAL: Values = "structural"

#: How the result shape follows from the operands where the text leaves it out (XLA's
#: shape inference): the first operand's, the second's (``select``, ``clamp``: the first
#: may be a predicate or a scalar bound), or the first's dimensions as ``pred``.
ShapeFrom = Literal["", "operand", "second", "pred"]
OPERAND: ShapeFrom = "operand"
SECOND: ShapeFrom = "second"
PRED: ShapeFrom = "pred"

#: ``channel_id`` semantics: unique per collective, or shared by a paired send/recv.
Channel = Literal["", "unique", "paired"]
UNIQUE: Channel = "unique"
PAIRED: Channel = "paired"


@dataclass(frozen=True, slots=True)
class OpInfo:
    """The facts of one opcode."""

    name: str
    #: (fewest, most) operands; most None: variadic. None: not checked.
    arity: tuple[int, int | None] | None = None
    #: result[i] depends only on operand element i (XLA's ``IsOpElementwise``): it runs
    #: unchanged on any subset of the elements.
    elementwise: bool = False
    #: The rule the parser infers an omitted result shape by (``""``: none of these;
    #: elementwise ops that change the element type, ``convert`` …, need it written).
    shape_from: ShapeFrom = ""
    cost: CostRule = ""
    #: Effects beyond its value (or completes/starts one): never removed as dead code.
    impure: bool = False
    values: Values = STRUCTURAL
    #: The collective it is or completes (``all-reduce``, ``reduce-scatter`` …).
    collective: str | None = None
    channel: Channel = ""
    #: The ``-done`` that completes this ``-start`` / the ``-start`` this ``-done`` (or
    #: ``async-update``) belongs to.
    async_done: str | None = None
    async_start: str | None = None

    @property
    def transcendental(self) -> bool:
        return self.cost == TRANSCENDENTAL

    @property
    def is_async_done(self) -> bool:
        """The half that completes an async op (``async-update`` is neither half)."""
        return self.async_start is not None and self.async_done is None


def _op(name: str, arity: int | tuple[int, int | None] | None, **facts: Any) -> OpInfo:
    counts = (arity, arity) if isinstance(arity, int) else arity
    return OpInfo(name, counts, **facts)


#: Every opcode XLA's text format accepts (async sugar ``<op>-start`` aside), by name.
OPINFO: dict[str, OpInfo] = {info.name: info for info in (
    _op("abs", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("acos", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("acosh", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("add", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("add-dependency", 2, cost=FREE, impure=True),
    _op("after-all", None, cost=FREE, impure=True),
    _op("all-gather", (1, None), collective="all-gather", channel=UNIQUE),
    _op("all-gather-done", 1, impure=True, collective="all-gather",
        async_start="all-gather-start"),
    _op("all-gather-start", (1, None), impure=True, collective="all-gather", channel=UNIQUE,
        async_done="all-gather-done"),
    _op("all-reduce", (1, None), cost=ALL_REDUCE, collective="all-reduce", channel=UNIQUE),
    _op("all-reduce-done", 1, impure=True, collective="all-reduce",
        async_start="all-reduce-start"),
    _op("all-reduce-start", (1, None), cost=ALL_REDUCE, impure=True, collective="all-reduce",
        channel=UNIQUE, async_done="all-reduce-done"),
    _op("all-to-all", None, values=PER_DEVICE, collective="all-to-all", channel=UNIQUE),
    _op("and", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("asin", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("asinh", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("async-done", None, impure=True, async_start="async-start"),
    _op("async-start", None, impure=True, async_done="async-done"),
    _op("async-update", None, impure=True, async_start="async-start", async_done="async-done"),
    _op("atan", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("atan2", 2, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("atanh", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("batch-norm-grad", 5, values=DETERMINISTIC),
    _op("batch-norm-inference", 5, values=DETERMINISTIC),
    _op("batch-norm-training", 3, values=DETERMINISTIC),
    _op("bitcast", 1, cost=FREE, values=DETERMINISTIC),
    _op("bitcast-convert", 1, cost=FLOP, values=DETERMINISTIC),
    _op("broadcast", 1, values=DETERMINISTIC),
    _op("call", None),
    _op("cbrt", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("ceil", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("cholesky", 1, values=DETERMINISTIC),
    _op("clamp", 3, elementwise=True, shape_from=SECOND, cost=FLOP, values=DETERMINISTIC),
    _op("collective-broadcast", None, values=PER_DEVICE, collective="collective-broadcast",
        channel=UNIQUE),
    _op("collective-permute", (1, None), values=PER_DEVICE, collective="collective-permute",
        channel=UNIQUE),
    _op("collective-permute-done", 1, impure=True, values=PER_DEVICE,
        collective="collective-permute", async_start="collective-permute-start"),
    _op("collective-permute-start", None, impure=True, values=PER_DEVICE,
        collective="collective-permute", channel=UNIQUE, async_done="collective-permute-done"),
    _op("collective-reduce", None),
    _op("compare", 2, elementwise=True, shape_from=PRED, cost=FLOP, values=DETERMINISTIC),
    _op("complex", 2, elementwise=True, cost=FLOP, values=DETERMINISTIC),
    _op("concatenate", (1, None), values=DETERMINISTIC),
    _op("conditional", (1, None)),
    _op("constant", None, cost=FREE, values=DETERMINISTIC),
    _op("convert", 1, elementwise=True, cost=FLOP, values=DETERMINISTIC),
    _op("convolution", None, values=DETERMINISTIC),
    _op("copy", 1, elementwise=True, shape_from=OPERAND, values=DETERMINISTIC),
    _op("copy-done", 1, impure=True, async_start="copy-start"),
    _op("copy-start", 1, impure=True, async_done="copy-done"),
    _op("cosh", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("cosine", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("count-leading-zeros", 1, elementwise=True, shape_from=OPERAND, cost=FLOP,
        values=DETERMINISTIC),
    _op("custom-call", None, impure=True, values=PER_DEVICE),
    _op("divide", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("domain", None, cost=FREE, values=DETERMINISTIC),
    _op("dot", 2, values=DETERMINISTIC),
    _op("dynamic-reshape", None, values=DETERMINISTIC),
    _op("dynamic-slice", (2, None), values=DETERMINISTIC),
    _op("dynamic-update-slice", (3, None), values=DETERMINISTIC),
    _op("erf", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("exponential", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("exponential-minus-one", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("fft", None, values=DETERMINISTIC),
    _op("floor", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("fusion", None),
    _op("gather", 2, values=DETERMINISTIC),
    _op("get-dimension-size", 1, values=DETERMINISTIC),
    _op("get-tuple-element", 1, cost=FREE),
    _op("imag", 1, elementwise=True, cost=FLOP, values=DETERMINISTIC),
    _op("infeed", None, impure=True, values=PER_DEVICE),
    _op("iota", 0, values=DETERMINISTIC),
    _op("is-finite", 1, elementwise=True, shape_from=PRED, cost=FLOP, values=DETERMINISTIC),
    _op("log", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("log-plus-one", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("logistic", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("map", (1, None), elementwise=True, values=DETERMINISTIC),
    _op("maximum", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("minimum", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("mulhi", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("multiply", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("negate", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("not", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("opt-barrier", None, impure=True),
    _op("or", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("outfeed", None, impure=True),
    _op("pad", 2, values=DETERMINISTIC),
    _op("parameter", None, cost=FREE),
    _op("partition-id", 0, values=PER_DEVICE),
    _op("popcnt", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("power", 2, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("ragged-all-to-all", None, values=PER_DEVICE, collective="all-to-all", channel=UNIQUE),
    _op("ragged-dot", 3, values=DETERMINISTIC),
    _op("real", 1, elementwise=True, cost=FLOP, values=DETERMINISTIC),
    _op("recv", None, impure=True, values=PER_DEVICE, channel=PAIRED, async_done="recv-done"),
    _op("recv-done", 1, impure=True, values=PER_DEVICE, channel=PAIRED, async_start="recv"),
    _op("reduce", (2, None), values=DETERMINISTIC),
    _op("reduce-precision", 1, elementwise=True, shape_from=OPERAND, cost=FLOP,
        values=DETERMINISTIC),
    _op("reduce-scatter", (1, None), values=PER_DEVICE, collective="reduce-scatter",
        channel=UNIQUE),
    _op("reduce-window", (2, None), values=DETERMINISTIC),
    _op("remainder", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("replica-id", 0, values=PER_DEVICE),
    _op("reshape", 1, values=DETERMINISTIC),
    _op("reverse", 1, values=DETERMINISTIC),
    _op("rng", None, impure=True, values=PER_DEVICE),
    _op("rng-bit-generator", None, values=PER_DEVICE),
    _op("rng-get-and-update-state", None, impure=True, values=PER_DEVICE),
    _op("round-nearest-afz", 1, elementwise=True, shape_from=OPERAND, cost=FLOP,
        values=DETERMINISTIC),
    _op("round-nearest-even", 1, elementwise=True, shape_from=OPERAND, cost=FLOP,
        values=DETERMINISTIC),
    _op("rsqrt", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("scaled-dot", 4, values=DETERMINISTIC),
    _op("scan", None),
    _op("scatter", (3, None), values=DETERMINISTIC),
    _op("select", 3, elementwise=True, shape_from=SECOND, cost=FLOP, values=DETERMINISTIC),
    _op("select-and-scatter", 3, values=DETERMINISTIC),
    _op("send", None, impure=True, channel=PAIRED, async_done="send-done"),
    _op("send-done", 1, impure=True, channel=PAIRED, async_start="send"),
    _op("set-dimension-size", 2, values=DETERMINISTIC),
    _op("shift-left", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("shift-right-arithmetic", 2, elementwise=True, shape_from=OPERAND, cost=FLOP,
        values=DETERMINISTIC),
    _op("shift-right-logical", 2, elementwise=True, shape_from=OPERAND, cost=FLOP,
        values=DETERMINISTIC),
    _op("shuffle", None),
    _op("sign", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("sine", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("sinh", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("slice", 1, values=DETERMINISTIC),
    _op("sort", (1, None), values=DETERMINISTIC),
    _op("sqrt", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("stochastic-convert", 2, elementwise=True, cost=FLOP, values=DETERMINISTIC),
    _op("subtract", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("tan", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("tanh", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("topk", None, values=DETERMINISTIC),
    _op("transpose", 1, values=DETERMINISTIC),
    _op("triangular-solve", 2, values=DETERMINISTIC),
    _op("tuple", None),
    _op("while", 1),
    _op("xor", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
)}


def opcodes_where(predicate: Callable[[OpInfo], bool]) -> frozenset[str]:
    """The opcodes whose record satisfies ``predicate``."""
    return frozenset(name for name, info in OPINFO.items() if predicate(info))


def is_impure(opcode: str) -> bool:
    """Whether an instruction of ``opcode`` must stay even when its value is unused;
    an opcode outside the table (async sugar ``<op>-start``, a newer XLA's) does."""
    info = OPINFO.get(opcode)
    return info is None or info.impure


OPCODES = frozenset(OPINFO)
ELEMENTWISE = opcodes_where(lambda i: i.elementwise)
IMPURE = opcodes_where(lambda i: i.impure)
#: Collectives whose ``channel_id`` must be unique in the module.
CHANNEL_UNIQUE = opcodes_where(lambda i: i.channel == UNIQUE)
#: Ops whose ``channel_id`` pairs two instructions (equal ids must stay equal).
CHANNEL_PAIRED = opcodes_where(lambda i: i.channel == PAIRED)
#: XLA prices these by their output elements (flops or transcendentals).
PER_ELEMENT_COST = opcodes_where(lambda i: i.cost in (FLOP, TRANSCENDENTAL))
#: XLA prices these at nothing: they move pointers or order execution.
NO_COST = opcodes_where(lambda i: i.cost == FREE)
#: Opcode → the collective it launches (the ``-done`` halves carry no traffic).
COLLECTIVE_KINDS: dict[str, str] = {
    name: info.collective for name, info in OPINFO.items()
    if info.collective is not None and not info.is_async_done}
#: The ``-done`` halves of async collectives.
COLLECTIVE_DONE = opcodes_where(lambda i: i.collective is not None and i.is_async_done)
#: Collectives that sum values across devices.
SUMMING_COLLECTIVES = frozenset(
    name for name, kind in COLLECTIVE_KINDS.items() if kind in ("all-reduce", "reduce-scatter"))

__all__ = [
    "ALL_REDUCE", "CHANNEL_PAIRED", "CHANNEL_UNIQUE", "COLLECTIVE_DONE", "COLLECTIVE_KINDS",
    "DETERMINISTIC", "ELEMENTWISE", "FLOP", "FREE", "IMPURE", "NO_COST", "OPCODES", "OPERAND",
    "OPINFO", "PAIRED", "PER_DEVICE", "PER_ELEMENT_COST", "PRED", "SECOND", "STRUCTURAL",
    "SUMMING_COLLECTIVES", "TRANSCENDENTAL", "UNIQUE", "OpInfo", "is_impure", "opcodes_where",
]
