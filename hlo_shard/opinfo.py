"""One table of opcode facts: what every HLO opcode is, as the analyses, the rewrites,
the validator and the parser need to know it.

Each opcode of XLA's ``HLO_OPCODE_LIST`` (``xla/hlo/ir/hlo_opcode.h``) has one
:class:`OpInfo` record in :data:`OPINFO`; the opcode sets modules use are derived from
it (:func:`opcodes_where`), so two modules cannot disagree on what ``copy`` is. A fact
that XLA's own rules decide differently on purpose has its own field: XLA's cost analysis
prices ``copy`` as memory traffic only though it is elementwise, so :attr:`OpInfo.cost`
is not derived from :attr:`OpInfo.elementwise`. A field whose value most opcodes take
from another says so in its default rule (:attr:`OpInfo.fusion`, :attr:`OpInfo.in_place`:
the ops priced per element), and a row states only the exceptions.

Facts about one *instruction* rather than its opcode (a custom call's target, a
``bitcast-convert`` that changes the bit width) stay with the code that reads them.
``tests/test_opinfo.py`` checks each set that replaced a module's list against that
list, and that no literal list of opcodes is left in the package beyond its documented
exceptions.
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

#: How an op that only moves data places its operand's elements in its result (``""``:
#: it computes values, or moves them in a way none of these says: gather, reverse …).
Moves = Literal["", "copy", "reshape", "bitcast", "transpose", "window", "assemble",
                "broadcast", "update", "reverse"]
#: The same dims and values; only the physical layout may change.
COPY: Moves = "copy"
#: The same elements in row-major order under new dims.
RESHAPE: Moves = "reshape"
#: The same bytes under a new shape: the element order follows the two layouts.
BITCAST: Moves = "bitcast"
#: The elements permuted by ``dimensions=``.
TRANSPOSE: Moves = "transpose"
#: A part of the operand (``slice``, ``dynamic-slice``).
WINDOW: Moves = "window"
#: The operands placed in a larger result (``concatenate``, ``pad``).
ASSEMBLE: Moves = "assemble"
#: Each operand element repeated along new dims.
BROADCAST: Moves = "broadcast"
#: The first operand with a window replaced by the second (``dynamic-update-slice``).
UPDATE: Moves = "update"
#: The elements in reverse order along ``dimensions=``.
REVERSE: Moves = "reverse"

#: How XLA's instruction fusion treats the op: merged into its consumers' loop, fused
#: but always the root of its kernel (its result never stays inside a fusion), or a
#: kernel (or nothing) of its own (``""``).
Fusion = Literal["", "loop", "root"]
LOOP: Fusion = "loop"
ROOT: Fusion = "root"

#: What the computations an op names stand for: called once on its operands in place of
#: the op (``call``), a kernel XLA fused (``fusion``), run asynchronously
#: (``async-start``), a loop's condition and body (``while``), branches (``conditional``).
#: ``""``: none, or a per-element reducer/comparator (``to_apply`` of ``reduce`` …).
Calls = Literal["", "call", "kernel", "async", "loop", "branches"]
CALL: Calls = "call"
KERNEL: Calls = "kernel"
ASYNC: Calls = "async"
LOOP_BODY: Calls = "loop"
BRANCHES: Calls = "branches"

#: How an op talks to the host: always (``infeed``/``outfeed``), or where its
#: ``is_host_transfer=true`` says so (``send``/``recv``: TPU's host callbacks); ``""``:
#: never.
HostIO = Literal["", "always", "flagged"]
ALWAYS: HostIO = "always"
FLAGGED: HostIO = "flagged"


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
    #: How it moves its operand's elements, when that is all it does (:data:`Moves`).
    moves: Moves = ""
    #: f(0, …, 0) = 0 for every element type: computed on zero padding lanes it leaves
    #: them zero (the sharded update needs no mask after it). False where not known so:
    #: the lanes are masked then, which is always safe.
    zero_preserving: bool = False
    #: Reads the device's own id: a value computed from it differs per device.
    device_id: bool = False
    #: Its ``replica_groups`` name the devices it runs over (a collective-permute's pairs
    #: do not): what recovers a module's device count.
    replica_groups: bool = False
    #: A matrix product (XLA's ``dot`` and ``convolution`` emitters): the operands, not
    #: the result, size its work, and its result's layout is the emitter's choice.
    matmul: bool = False
    #: XLA's instruction fusion (:data:`Fusion`); default: ``loop`` for the ops priced per
    #: element (every elementwise loop fuses), ``""`` otherwise.
    fusion: Fusion | None = None
    #: May write its result into an operand buffer that dies at it (XLA's
    #: ``CanShareOperandBufferWithUser``); default: the ops priced per element.
    in_place: bool | None = None
    #: What the computations it names stand for (:data:`Calls`).
    calls: Calls = ""
    #: Its value is its first operand's, as it is: it only orders execution.
    forwards: bool = False
    #: A binary op whose operands may be swapped (f(a, b) = f(b, a)).
    commutative: bool = False
    #: Its identity as a reducer, per element-type family (``float``, ``int``, ``pred``;
    #: ``min``/``max``: the type's smallest/largest): what a reduction by it starts from
    #: and pads with. Empty: not a reducer the passes know.
    neutral: tuple[tuple[str, str], ...] = ()
    #: Talks to the host (:data:`HostIO`).
    host: HostIO = ""
    #: Draws other random numbers on every run (XLA's stateful generator): two runs of
    #: the same module do not compare.
    draws: bool = False

    def __post_init__(self) -> None:
        per_element = self.cost in (FLOP, TRANSCENDENTAL)
        if self.fusion is None:
            object.__setattr__(self, "fusion", LOOP if per_element else "")
        if self.in_place is None:
            object.__setattr__(self, "in_place", per_element)

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
    _op("abs", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        zero_preserving=True),
    _op("acos", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("acosh", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("add", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        zero_preserving=True, commutative=True,
        neutral=(("float", "0"), ("int", "0"), ("pred", "false"))),
    _op("add-dependency", 2, cost=FREE, impure=True, forwards=True),
    _op("after-all", None, cost=FREE, impure=True),
    _op("all-gather", (1, None), collective="all-gather", channel=UNIQUE, replica_groups=True),
    _op("all-gather-done", 1, impure=True, collective="all-gather",
        async_start="all-gather-start"),
    _op("all-gather-start", (1, None), impure=True, collective="all-gather", channel=UNIQUE,
        async_done="all-gather-done", replica_groups=True),
    _op("all-reduce", (1, None), cost=ALL_REDUCE, collective="all-reduce", channel=UNIQUE,
        replica_groups=True),
    _op("all-reduce-done", 1, impure=True, collective="all-reduce",
        async_start="all-reduce-start"),
    _op("all-reduce-start", (1, None), cost=ALL_REDUCE, impure=True, collective="all-reduce",
        channel=UNIQUE, async_done="all-reduce-done", replica_groups=True),
    _op("all-to-all", None, values=PER_DEVICE, collective="all-to-all", channel=UNIQUE,
        replica_groups=True),
    _op("and", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        zero_preserving=True, commutative=True,
        neutral=(("int", "-1"), ("pred", "true"))),
    _op("asin", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("asinh", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("async-done", None, impure=True, async_start="async-start"),
    _op("async-start", None, impure=True, async_done="async-done", calls=ASYNC),
    _op("async-update", None, impure=True, async_start="async-start", async_done="async-done"),
    _op("atan", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("atan2", 2, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("atanh", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("batch-norm-grad", 5, values=DETERMINISTIC),
    _op("batch-norm-inference", 5, values=DETERMINISTIC),
    _op("batch-norm-training", 3, values=DETERMINISTIC),
    _op("bitcast", 1, cost=FREE, values=DETERMINISTIC, moves=BITCAST, fusion=LOOP),
    _op("bitcast-convert", 1, cost=FLOP, values=DETERMINISTIC, zero_preserving=True),
    _op("broadcast", 1, values=DETERMINISTIC, fusion=LOOP, moves=BROADCAST),
    _op("call", None, calls=CALL),
    _op("cbrt", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("ceil", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("cholesky", 1, values=DETERMINISTIC),
    _op("clamp", 3, elementwise=True, shape_from=SECOND, cost=FLOP, values=DETERMINISTIC),
    _op("collective-broadcast", None, values=PER_DEVICE, collective="collective-broadcast",
        channel=UNIQUE, replica_groups=True),
    _op("collective-permute", (1, None), values=PER_DEVICE, collective="collective-permute",
        channel=UNIQUE),
    _op("collective-permute-done", 1, impure=True, values=PER_DEVICE,
        collective="collective-permute", async_start="collective-permute-start"),
    _op("collective-permute-start", None, impure=True, values=PER_DEVICE,
        collective="collective-permute", channel=UNIQUE, async_done="collective-permute-done"),
    _op("collective-reduce", None),
    _op("compare", 2, elementwise=True, shape_from=PRED, cost=FLOP, values=DETERMINISTIC),
    _op("complex", 2, elementwise=True, cost=FLOP, values=DETERMINISTIC),
    _op("concatenate", (1, None), values=DETERMINISTIC, moves=ASSEMBLE, fusion=LOOP),
    _op("conditional", (1, None), calls=BRANCHES),
    _op("constant", None, cost=FREE, values=DETERMINISTIC, fusion=LOOP),
    _op("convert", 1, elementwise=True, cost=FLOP, values=DETERMINISTIC, zero_preserving=True),
    _op("convolution", None, values=DETERMINISTIC, matmul=True),
    _op("copy", 1, elementwise=True, shape_from=OPERAND, values=DETERMINISTIC,
        moves=COPY, fusion=LOOP),
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
    _op("dot", 2, values=DETERMINISTIC, matmul=True),
    _op("dynamic-reshape", None, values=DETERMINISTIC),
    _op("dynamic-slice", (2, None), values=DETERMINISTIC, moves=WINDOW, fusion=LOOP),
    _op("dynamic-update-slice", (3, None), values=DETERMINISTIC, fusion=ROOT, in_place=True,
        moves=UPDATE),
    _op("erf", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("exponential", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("exponential-minus-one", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("fft", None, values=DETERMINISTIC),
    _op("floor", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("fusion", None, in_place=True, calls=KERNEL),
    _op("gather", 2, values=DETERMINISTIC),
    _op("get-dimension-size", 1, values=DETERMINISTIC),
    _op("get-tuple-element", 1, cost=FREE),
    _op("imag", 1, elementwise=True, cost=FLOP, values=DETERMINISTIC),
    _op("infeed", None, impure=True, values=PER_DEVICE, host=ALWAYS),
    _op("iota", 0, values=DETERMINISTIC, fusion=LOOP),
    _op("is-finite", 1, elementwise=True, shape_from=PRED, cost=FLOP, values=DETERMINISTIC),
    _op("log", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("log-plus-one", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("logistic", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("map", (1, None), elementwise=True, values=DETERMINISTIC),
    _op("maximum", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        zero_preserving=True, commutative=True,
        neutral=(("float", "-inf"), ("int", "min"), ("pred", "false"))),
    _op("minimum", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        zero_preserving=True, commutative=True,
        neutral=(("float", "inf"), ("int", "max"), ("pred", "true"))),
    _op("mulhi", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        commutative=True),
    _op("multiply", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        commutative=True,
        neutral=(("float", "1"), ("int", "1"), ("pred", "true"))),
    _op("negate", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        zero_preserving=True),
    _op("not", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("opt-barrier", None, impure=True, forwards=True),
    _op("or", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        zero_preserving=True, commutative=True,
        neutral=(("int", "0"), ("pred", "false"))),
    _op("outfeed", None, impure=True, host=ALWAYS),
    _op("pad", 2, values=DETERMINISTIC, moves=ASSEMBLE, fusion=LOOP),
    _op("parameter", None, cost=FREE),
    _op("partition-id", 0, values=PER_DEVICE, device_id=True),
    _op("popcnt", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("power", 2, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL,
        values=DETERMINISTIC),
    _op("ragged-all-to-all", None, values=PER_DEVICE, collective="all-to-all", channel=UNIQUE,
        replica_groups=True),
    _op("ragged-dot", 3, values=DETERMINISTIC),
    _op("real", 1, elementwise=True, cost=FLOP, values=DETERMINISTIC),
    _op("recv", None, impure=True, values=PER_DEVICE, channel=PAIRED, async_done="recv-done",
        host=FLAGGED),
    _op("recv-done", 1, impure=True, values=PER_DEVICE, channel=PAIRED, async_start="recv",
        host=FLAGGED),
    _op("reduce", (2, None), values=DETERMINISTIC, fusion=ROOT),
    _op("reduce-precision", 1, elementwise=True, shape_from=OPERAND, cost=FLOP,
        values=DETERMINISTIC),
    _op("reduce-scatter", (1, None), values=PER_DEVICE, collective="reduce-scatter",
        channel=UNIQUE, replica_groups=True),
    _op("reduce-window", (2, None), values=DETERMINISTIC),
    _op("remainder", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("replica-id", 0, values=PER_DEVICE, device_id=True),
    _op("reshape", 1, values=DETERMINISTIC, moves=RESHAPE, fusion=LOOP),
    _op("reverse", 1, values=DETERMINISTIC, fusion=LOOP, moves=REVERSE),
    _op("rng", None, impure=True, values=PER_DEVICE, draws=True),
    _op("rng-bit-generator", None, values=PER_DEVICE),
    _op("rng-get-and-update-state", None, impure=True, values=PER_DEVICE, draws=True),
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
    _op("send", None, impure=True, channel=PAIRED, async_done="send-done", host=FLAGGED),
    _op("send-done", 1, impure=True, channel=PAIRED, async_start="send", host=FLAGGED),
    _op("set-dimension-size", 2, values=DETERMINISTIC),
    _op("shift-left", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("shift-right-arithmetic", 2, elementwise=True, shape_from=OPERAND, cost=FLOP,
        values=DETERMINISTIC),
    _op("shift-right-logical", 2, elementwise=True, shape_from=OPERAND, cost=FLOP,
        values=DETERMINISTIC),
    _op("shuffle", None),
    _op("sign", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        zero_preserving=True),
    _op("sine", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC,
        zero_preserving=True),
    _op("sinh", 1, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC),
    _op("slice", 1, values=DETERMINISTIC, moves=WINDOW, fusion=LOOP),
    _op("sort", (1, None), values=DETERMINISTIC),
    _op("sqrt", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC,
        zero_preserving=True),
    _op("stochastic-convert", 2, elementwise=True, cost=FLOP, values=DETERMINISTIC),
    _op("subtract", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        zero_preserving=True),
    _op("tan", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC),
    _op("tanh", 1, elementwise=True, shape_from=OPERAND, cost=TRANSCENDENTAL, values=DETERMINISTIC,
        zero_preserving=True),
    _op("topk", None, values=DETERMINISTIC),
    _op("transpose", 1, values=DETERMINISTIC, moves=TRANSPOSE, fusion=LOOP),
    _op("triangular-solve", 2, values=DETERMINISTIC),
    _op("tuple", None),
    _op("while", 1, in_place=True, calls=LOOP_BODY),
    _op("xor", 2, elementwise=True, shape_from=OPERAND, cost=FLOP, values=DETERMINISTIC,
        commutative=True),
)}


def opcodes_where(predicate: Callable[[OpInfo], bool]) -> frozenset[str]:
    """The opcodes whose record satisfies ``predicate``."""
    return frozenset(name for name, info in OPINFO.items() if predicate(info))


def is_impure(opcode: str) -> bool:
    """Whether an instruction of ``opcode`` must stay even when its value is unused;
    an opcode outside the table (async sugar ``<op>-start``, a newer XLA's) does."""
    info = OPINFO.get(opcode)
    return info is None or info.impure


def moves(opcode: str) -> Moves:
    """How ``opcode`` moves its operand's elements (:attr:`OpInfo.moves`; ``""`` for an
    opcode outside the table)."""
    info = OPINFO.get(opcode)
    return "" if info is None else info.moves


def with_async_forms(names: frozenset[str]) -> frozenset[str]:
    """``names`` and the halves of their async forms (XLA names them ``<op>-start`` and
    ``<op>-done``)."""
    return names | frozenset(f"{name}{half}" for name in names for half in ("-start", "-done")
                             if f"{name}{half}" in OPINFO)


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
#: Collectives by the kind they launch (their ``-start`` form included).
ALL_REDUCES = frozenset(name for name, kind in COLLECTIVE_KINDS.items() if kind == "all-reduce")
ALL_GATHERS = frozenset(name for name, kind in COLLECTIVE_KINDS.items() if kind == "all-gather")
#: Collectives that leave every device of a group the same value (a sum, a gather).
REPLICATING_COLLECTIVES = ALL_REDUCES | ALL_GATHERS
#: Collectives whose ``use_global_device_ids`` XLA holds as a flag (absent: false), not
#: as an option: with a ``channel_id`` and without it, their groups name replicas (each
#: with every partition), not partitions (XLA's ``GetCollectiveOpGroupMode``).
GLOBAL_IDS_FLAGGED = SUMMING_COLLECTIVES | ALL_GATHERS
#: Ops that draw other random numbers on every run.
RANDOM_DRAWS = opcodes_where(lambda i: i.draws)
#: Ops whose value is their first operand's (they order execution).
FORWARDING = opcodes_where(lambda i: i.forwards)
#: Ops whose ``replica_groups`` name the devices they run over.
GROUPED = opcodes_where(lambda i: i.replica_groups)
#: Ops that read the device's own id.
DEVICE_IDS = opcodes_where(lambda i: i.device_id)
#: Matrix products.
MATMULS = opcodes_where(lambda i: i.matmul)
#: Ops computed on zero lanes that leave them zero.
ZERO_PRESERVING = opcodes_where(lambda i: i.zero_preserving)
#: Ops that re-lay their operand's elements out one to one, values as they are.
VIEWS = opcodes_where(lambda i: i.moves in (COPY, RESHAPE, BITCAST, TRANSPOSE))
#: Views that keep the row-major element order (a bitcast: where the layouts agree).
ORDER_KEEPING_VIEWS = opcodes_where(lambda i: i.moves in (COPY, RESHAPE, BITCAST))
#: Views that change the dims (a copy keeps them).
SHAPE_VIEWS = opcodes_where(lambda i: i.moves in (RESHAPE, BITCAST, TRANSPOSE))
#: Views whose element order the shapes alone define (a bitcast's follows the layouts).
LOGICAL_VIEWS = opcodes_where(lambda i: i.moves in (RESHAPE, TRANSPOSE))
#: Elementwise ops that take scalar operands next to arrays (``clamp``'s bounds,
#: ``select``'s predicate): why their result's shape is the second operand's.
SCALAR_OPERANDS = opcodes_where(lambda i: i.shape_from == SECOND)
#: Ops that lay values out anew without repeating or overwriting any: views, windows,
#: assembly.
FORMATTING = opcodes_where(
    lambda i: i.moves in (COPY, RESHAPE, BITCAST, TRANSPOSE, WINDOW, ASSEMBLE))
#: Ops that only move data (:data:`Moves`).
DATA_MOVEMENT = opcodes_where(lambda i: i.moves != "")
#: Binary elementwise ops whose operands may not be swapped.
NON_COMMUTATIVE = opcodes_where(
    lambda i: i.elementwise and i.arity == (2, 2) and not i.commutative)
#: Ops whose result is a function of their operands' values alone: identical operands on
#: every device give identical results (without operands: the same everywhere).
DETERMINISTIC_OPS = opcodes_where(lambda i: i.values == DETERMINISTIC)
#: Ops computed element by element: XLA's elementwise ones, and ``bitcast-convert``, which
#: it prices per element (elementwise where the bit widths agree).
PER_ELEMENT = ELEMENTWISE | PER_ELEMENT_COST

#: Ops XLA's loop/input fusion merges with their consumers (``fusion`` set).
FUSIBLE = opcodes_where(lambda i: i.fusion != "")
#: Fusible ops that are always the root of their kernel.
KERNEL_ROOTS = opcodes_where(lambda i: i.fusion == ROOT)
#: Ops that may write their result into a dying operand's buffer.
IN_PLACE = opcodes_where(lambda i: bool(i.in_place))
#: Ops whose work is that of the computations they call (a fusion is a kernel instead).
CONTROL_FLOW = opcodes_where(lambda i: i.calls in (CALL, LOOP_BODY, BRANCHES))
#: Ops that always talk to the host.
HOST_IO = opcodes_where(lambda i: i.host == ALWAYS)
#: Ops that talk to the host where their ``is_host_transfer=true`` says so.
HOST_TRANSFERS = opcodes_where(lambda i: i.host == FLAGGED)
#: Ops whose result is their callee's, run once on their operands.
CALLS_ONCE = opcodes_where(lambda i: i.calls in (CALL, KERNEL, ASYNC))

__all__ = [
    "ALL_GATHERS", "ALL_REDUCE", "ALL_REDUCES", "ALWAYS", "ASSEMBLE", "ASYNC", "BITCAST",
    "BRANCHES", "BROADCAST", "CALL", "CALLS_ONCE", "CHANNEL_PAIRED", "CHANNEL_UNIQUE",
    "COLLECTIVE_DONE", "COLLECTIVE_KINDS", "CONTROL_FLOW", "COPY", "DATA_MOVEMENT",
    "DETERMINISTIC", "DETERMINISTIC_OPS", "DEVICE_IDS", "ELEMENTWISE", "FLAGGED", "FLOP",
    "FORMATTING", "FORWARDING", "FREE", "FUSIBLE", "GLOBAL_IDS_FLAGGED", "GROUPED",
    "HOST_IO", "HOST_TRANSFERS",
    "IMPURE", "IN_PLACE", "KERNEL", "KERNEL_ROOTS", "LOGICAL_VIEWS", "LOOP", "LOOP_BODY",
    "MATMULS", "NON_COMMUTATIVE", "NO_COST", "OPCODES", "OPERAND", "OPINFO",
    "ORDER_KEEPING_VIEWS", "PAIRED", "PER_DEVICE", "PER_ELEMENT", "PER_ELEMENT_COST", "PRED",
    "RANDOM_DRAWS", "REPLICATING_COLLECTIVES", "RESHAPE", "REVERSE", "ROOT", "SCALAR_OPERANDS",
    "SECOND",
    "SHAPE_VIEWS", "STRUCTURAL", "SUMMING_COLLECTIVES", "TRANSCENDENTAL", "TRANSPOSE",
    "UNIQUE", "UPDATE", "VIEWS", "WINDOW", "ZERO_PRESERVING", "OpInfo", "is_impure", "moves",
    "opcodes_where", "with_async_forms",
]
