"""Typed records for an HLO module.

The ordered instruction list of each computation is the source of truth; the
networkx view in :mod:`hlo_shard.graph` is derived from it. Operands refer to
instructions *by name* within the same computation, which keeps the records
small, printable without a symbol table and trivially copyable.

Attribute values are typed only where a pass interprets them (see
:data:`AttrValue`); everything else is kept as :class:`Raw` text and printed back
verbatim, so nothing XLA adds in a new release is ever dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar, cast

# --------------------------------------------------------------------------- shapes

#: Size in bits of each element type (sub-byte types are packed by XLA only with an
#: explicit ``E(n)`` layout; for memory accounting we use XLA's CPU convention of
#: one byte for sub-byte integer types and pred).
ELEMENT_BITS: dict[str, int] = {
    "pred": 8,
    "s1": 8, "s2": 8, "s4": 8, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
    "u1": 8, "u2": 8, "u4": 8, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e3m4": 8,
    "f8e5m2fnuz": 8, "f8e4m3fnuz": 8, "f8e8m0fnu": 8, "f4e2m1fn": 8,
    "c64": 64, "c128": 128,
    "token": 0, "opaque": 0,
}

FLOAT_TYPES = frozenset(
    t for t in ELEMENT_BITS if t.startswith(("f", "bf"))
)
#: The 16-bit floats, which XLA:CPU computes with in f32 (a profile's
#: ``upcasts_16bit_floats``): its temporaries are f32.
HALF_FLOAT_TYPES = frozenset({"bf16", "f16"})
#: Of those, the ones whose collective sums such a backend makes in f32, from each
#: device's value as its producer computed it (excess precision allowed, unrounded),
#: rounding the sum once: bf16 on XLA:CPU, whose f16 sums are f16 adds in device order.
F32_SUMMED_TYPES = frozenset({"bf16"})


def summed_type(element_type: str, upcast: bool) -> str:
    """The type a collective sums ``element_type`` in where the backend ``upcast``s
    16-bit floats (:data:`F32_SUMMED_TYPES`), else the type itself."""
    return "f32" if upcast and element_type in F32_SUMMED_TYPES else element_type


INTEGER_TYPES = frozenset(t for t in ELEMENT_BITS if t[0] in "su" and t[1:].isdigit())
COMPLEX_TYPES = frozenset({"c64", "c128"})


@dataclass(frozen=True, slots=True)
class Layout:
    """``{minor_to_major[:tail]}``. ``tail`` keeps tiles, memory space, element bits
    etc. verbatim (e.g. ``"T(8,128)(2,1)S(1)"``); passes only reason about order."""

    minor_to_major: tuple[int, ...]
    tail: str = ""


@dataclass(frozen=True, slots=True)
class ArrayShape:
    element_type: str
    dims: tuple[int, ...]
    #: Per dimension: "" static, "<=" bounded dynamic, "?" unbounded (size -1).
    #: Empty when every dimension is static (the common case).
    dynamic: tuple[str, ...] = ()
    layout: Layout | None = None
    #: ``b(f32[4])``: a buffer holding such an array (custom-call operands and results).
    buffer: bool = False

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def byte_size(self) -> int:
        return self.num_elements * ELEMENT_BITS[self.element_type] // 8

    @property
    def is_scalar(self) -> bool:
        return not self.dims

    @property
    def is_integer(self) -> bool:
        """Its elements are signed or unsigned integers (no gradient is: jax
        differentiates floats only)."""
        return self.element_type in INTEGER_TYPES

    def minor_to_major(self) -> tuple[int, ...]:
        """The layout's order, or XLA's default ``{rank-1, …, 0}`` when absent."""
        if self.layout is not None and self.layout.minor_to_major:
            return self.layout.minor_to_major
        return tuple(range(self.rank - 1, -1, -1))

    @property
    def is_row_major(self) -> bool:
        """Its elements lie in row-major order: XLA's default layout, also when the
        layout is absent (tiling and dynamic dimensions are the caller's to check)."""
        return self.minor_to_major() == tuple(range(self.rank - 1, -1, -1))

    def with_dims(self, dims: tuple[int, ...], layout: Layout | None = None) -> ArrayShape:
        return ArrayShape(self.element_type, tuple(dims), (), layout)


@dataclass(frozen=True, slots=True)
class TupleShape:
    elements: tuple[Shape, ...]

    @property
    def byte_size(self) -> int:
        return sum(e.byte_size for e in self.elements)

    def leaves(self) -> Iterator[tuple[tuple[int, ...], ArrayShape]]:
        """(shape index, array shape) for every array leaf, depth first."""
        for i, element in enumerate(self.elements):
            if isinstance(element, TupleShape):
                for index, leaf in element.leaves():
                    yield (i, *index), leaf
            else:
                yield (i,), element


Shape = ArrayShape | TupleShape


def shape_leaves(shape: Shape) -> Iterator[tuple[tuple[int, ...], ArrayShape]]:
    if isinstance(shape, TupleShape):
        yield from shape.leaves()
    else:
        yield (), shape


# ----------------------------------------------------------------------- attributes


@dataclass(frozen=True, slots=True)
class Raw:
    """An attribute value kept verbatim (metadata, sharding, backend_config, …)."""

    text: str


@dataclass(frozen=True, slots=True)
class Ident:
    """A bare identifier value: ``direction=LT``, ``kind=kLoop``, ``fft_type=FFT``."""

    name: str


@dataclass(frozen=True, slots=True)
class Str:
    """A quoted string value, unescaped (``custom_call_target="foo"``)."""

    value: str


@dataclass(frozen=True, slots=True)
class ComputationRef:
    """``to_apply=%add`` and friends: the name of a computation in the module."""

    name: str


@dataclass(frozen=True, slots=True)
class ComputationList:
    """``branch_computations={%a, %b}``, custom-call ``called_computations``."""

    names: tuple[str, ...]


#: The attribute values that name called computations.
_CALLING = (ComputationRef, ComputationList)


@dataclass(frozen=True, slots=True)
class SliceRanges:
    """``slice={[start:limit:stride], …}``."""

    ranges: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class ReplicaGroups:
    """``replica_groups=`` in any of XLA's three forms.

    ``groups`` is the explicit expansion used by analyses (empty tuple for ``{}``,
    "all participants"); ``text`` is the form that was read, printed back as is so a
    round trip never changes the module. A group list built by a pass has
    ``text=None`` and prints in the explicit form.
    """

    groups: tuple[tuple[int, ...], ...]
    text: str | None = None

    @property
    def group_size(self) -> int | None:
        """Common size of the groups, or None when empty or non-uniform."""
        sizes = {len(g) for g in self.groups}
        return sizes.pop() if len(sizes) == 1 else None


#: An XLA ShapeIndex: the path to a leaf of a (tuple) shape, ``()`` the whole shape.
ShapeIndex = tuple[int, ...]
#: The alias kinds XLA writes (``may-alias``: XLA may copy instead; ``must-alias``: the
#: producer demands the buffer be shared).
ALIAS_KINDS = ("may-alias", "must-alias")


@dataclass(frozen=True, slots=True)
class Alias:
    """One entry of ``input_output_alias``: output leaf ``output`` shares the buffer of
    leaf ``parameter_index`` of entry parameter ``parameter`` (XLA's
    ``HloInputOutputAliasConfig::Alias``)."""

    output: ShapeIndex
    parameter: int
    parameter_index: ShapeIndex = ()
    #: One of :data:`ALIAS_KINDS`; None: written without (XLA reads ``may-alias``).
    kind: str | None = "may-alias"

    @property
    def may_alias(self) -> bool:
        return self.kind != "must-alias"


@dataclass(frozen=True, slots=True)
class InputOutputAlias:
    """The ``input_output_alias`` header attribute (XLA's ``HloInputOutputAliasConfig``),
    its entries in the order written: read once by the parser, printed by the printer;
    passes edit it as a value, never as text."""

    entries: tuple[Alias, ...] = ()

    def array_aliases(self) -> dict[int, int]:
        """{top-level output index: parameter number} for aliases of whole (array)
        parameters to top-level outputs, in order; output ``{}`` (a module whose result
        is one array) is read as 0."""
        return {(alias.output[0] if alias.output else 0): alias.parameter
                for alias in self.entries
                if len(alias.output) <= 1 and not alias.parameter_index}


@dataclass(frozen=True, slots=True)
class BufferDonor:
    """The ``buffer_donor`` header attribute (XLA's ``HloBufferDonorConfig``): (entry
    parameter, leaf index) pairs whose buffers the executable may reuse for any output."""

    donors: tuple[tuple[int, ShapeIndex], ...] = ()


#: int: channel_id, index, iota_dimension, feature_index …
#: bool: use_global_device_ids, constrain_layout, is_stable, indices_are_sorted …
#: tuple[int, ...]: braced int lists (dimensions, dynamic_slice_sizes, *_dims …)
#: float: epsilon
AttrValue = (int | bool | float | tuple | Raw | Ident | Str | ComputationRef | ComputationList
             | SliceRanges | ReplicaGroups | InputOutputAlias | BufferDonor)

_A = TypeVar("_A")


# --------------------------------------------------------------------- instructions


@dataclass(frozen=True, slots=True)
class SourceLoc:
    """1-based line and column of a definition in the text it was parsed from."""

    line: int
    column: int


@dataclass(slots=True, eq=False)
class Instruction:
    name: str
    opcode: str
    shape: Shape
    #: Names of operand instructions in the same computation, in operand order
    #: (repeats allowed: ``multiply(x, x)``).
    operands: list[str] = field(default_factory=list)
    #: Attributes in print order.
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    #: ``parameter(N)``.
    parameter_number: int | None = None
    #: ``constant(...)``: the literal text verbatim (``{1, 2}``, ``nan``, ``{...}``).
    literal: str | None = None
    loc: SourceLoc | None = None

    @property
    def is_elided_constant(self) -> bool:
        """A constant printed as ``{...}`` by XLA: its values are unknown."""
        return self.literal is not None and "..." in self.literal

    def attr(self, name: str, default: AttrValue | None = None) -> AttrValue | None:
        return self.attributes.get(name, default)

    @property
    def array_shape(self) -> ArrayShape:
        """The shape, where the caller has established that it is an array (an operand of
        an elementwise op, a value of a fusion body): a tuple there is a bug, raised."""
        if not isinstance(self.shape, ArrayShape):
            raise TypeError(f"%{self.name} is a tuple, not an array")
        return self.shape

    def attr_as(self, name: str, kind: type[_A]) -> _A | None:
        """The attribute ``name`` as a ``kind``, or None when it is not set.

        The parser reads each attribute name into one type (``attributes.py``), so a value
        of another type is a bug in whoever built the instruction: raised, not guessed."""
        value = self.attributes.get(name)
        if value is None:
            return None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"%{self.name}: {name}= holds a {type(value).__name__}, "
                            f"not a {kind.__name__}")
        return value

    def required_attr(self, name: str, kind: type[_A]) -> _A:
        """An attribute XLA requires of this opcode (``body=`` of a while, ``index=`` of a
        get-tuple-element: ``attributes.REQUIRED_ATTRIBUTES``, which the parser enforces),
        as a ``kind``; its absence is a bug in whoever built the instruction: raised."""
        value = self.attr_as(name, kind)
        if value is None:
            raise KeyError(f"%{self.name}: a {self.opcode} needs {name}=")
        return value

    @property
    def param_number(self) -> int:
        """N of ``parameter(N)``, for an instruction known to be a parameter (the parser
        numbers every one); any other instruction raises."""
        if self.parameter_number is None:
            raise TypeError(f"%{self.name}: a {self.opcode} is not a parameter")
        return self.parameter_number

    def int_attr(self, name: str) -> int | None:
        """An integer attribute (``channel_id``, ``dimension``, ``index``), or None."""
        return self.attr_as(name, int)

    def ints_attr(self, name: str) -> tuple[int, ...]:
        """A list-of-integers attribute (``dimensions``, ``slice_sizes``), () when unset."""
        value = self.attr_as(name, tuple)
        if value is None:
            return ()
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise TypeError(f"%{self.name}: {name}= is not a list of integers")
        return cast(tuple[int, ...], value)

    def called(self, role: str) -> str:
        """The name of the computation this instruction calls as ``role`` (``body``,
        ``condition``, ``to_apply``, …); "" where it names none."""
        ref = self.attr_as(role, ComputationRef)
        return "" if ref is None else ref.name

    def called_computations(self) -> list[str]:
        """Names of the computations this instruction calls, in attribute order."""
        names: list[str] = []
        for value in self.attributes.values():
            if isinstance(value, _CALLING):  # (one test for the common value that is not)
                if isinstance(value, ComputationRef):
                    names.append(value.name)
                else:
                    names.extend(value.names)
        return names

    def clone(self) -> Instruction:
        """A copy to edit apart from this one (its shape and attribute values are
        immutable, so they are shared)."""
        return Instruction(self.name, self.opcode, self.shape, list(self.operands),
                           dict(self.attributes), self.parameter_number, self.literal, self.loc)

    def __repr__(self) -> str:  # short: full dumps belong to the printer
        return f"<{self.name} = {self.opcode}({', '.join(self.operands)})>"


@dataclass(slots=True, eq=False)
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)
    root_name: str | None = None
    is_entry: bool = False
    execution_thread: str | None = None
    loc: SourceLoc | None = None
    _index: dict[str, Instruction] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index = {inst.name: inst for inst in self.instructions}
        if self.root_name is None and self.instructions:
            self.root_name = self.instructions[-1].name

    def clone(self) -> Computation:
        """A copy whose instructions can be edited apart from this one's."""
        return Computation(self.name, [inst.clone() for inst in self.instructions],
                           self.root_name, self.is_entry, self.execution_thread, self.loc)

    # Lookups -------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._index

    def __getitem__(self, name: str) -> Instruction:
        return self._index[name]

    def get(self, name: str) -> Instruction | None:
        return self._index.get(name)

    def has_all(self, names: Iterable[str]) -> bool:
        """Every one of ``names`` is an instruction here (one C loop: validation asks
        it of every instruction's operands)."""
        return all(map(self._index.__contains__, names))

    @property
    def root(self) -> Instruction:
        assert self.root_name is not None, f"computation {self.name} is empty"
        return self._index[self.root_name]

    def parameters(self) -> list[Instruction]:
        """Parameter instructions ordered by parameter number."""
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: cast(int, i.parameter_number))

    def parameter_names(self) -> dict[int, str]:
        """Parameter number → the parameter's name (a caller's operand ``k`` is read
        by the parameter numbered ``k``)."""
        return {cast(int, i.parameter_number): i.name for i in self.instructions
                if i.opcode == "parameter"}

    def operands_of(self, inst: Instruction) -> list[Instruction]:
        return [self._index[name] for name in inst.operands]

    # Structural edits (keep the name index in step) ----------------------------------
    def insert(self, position: int, inst: Instruction) -> Instruction:
        if inst.name in self._index:
            raise ValueError(f"duplicate instruction name {inst.name!r} in {self.name}")
        self.instructions.insert(position, inst)
        self._index[inst.name] = inst
        return inst

    def append(self, inst: Instruction) -> Instruction:
        return self.insert(len(self.instructions), inst)

    def position(self, name: str) -> int:
        # An identity search (instructions compare by identity) runs at C speed; the
        # name scan covers a list edited without reindex().
        inst = self._index.get(name)
        if inst is not None:
            try:
                return self.instructions.index(inst)
            except ValueError:
                pass
        for i, other in enumerate(self.instructions):
            if other.name == name:
                return i
        raise KeyError(name)

    def remove(self, name: str, position: int | None = None) -> None:
        """Remove ``name`` (at ``position`` in the list, when the caller knows it)."""
        inst = self._index.pop(name)
        if position is not None and self.instructions[position] is inst:
            del self.instructions[position]
        else:
            self.instructions.remove(inst)

    def reindex(self) -> None:
        """Rebuild the name index after editing ``instructions`` directly."""
        self._index = {inst.name: inst for inst in self.instructions}


@dataclass(slots=True, eq=False)
class Module:
    name: str
    computations: list[Computation] = field(default_factory=list)
    #: Header attributes in print order (``replica_count`` and ``num_partitions`` are
    #: ints, ``is_scheduled`` a bool, the rest mostly :class:`Raw`).
    header: dict[str, AttrValue] = field(default_factory=dict)
    #: The ``FileNames … StackFrames`` section verbatim, or None.
    stack_frames: str | None = None
    #: Path the module was read from, for messages.
    source_path: str | None = None
    #: Computation name → the computation (the first of that name), and how many
    #: computations the list had when it was built: kept up to date by
    #: :meth:`insert_computation` and :meth:`set_computations`, checked on every lookup
    #: and rebuilt when the list changed otherwise. A pass adding thousands of fusion
    #: bodies would otherwise rebuild it once per body.
    _by_name: dict[str, Computation] = field(default_factory=dict, repr=False)
    _indexed: int = field(default=-1, repr=False)

    def clone(self) -> Module:
        """A copy to edit apart from this one (the speed gate's trials, a retargeted
        module): new computations and instructions; shapes, layouts and attribute values
        are immutable and shared. ``copy.deepcopy``'s result without its per-object
        bookkeeping, which costs more than the pass on a large module."""
        return Module(self.name, [comp.clone() for comp in self.computations],
                      dict(self.header), self.stack_frames, self.source_path)

    def take_contents(self, other: Module) -> None:
        """Become ``other`` (whose computations then belong to this module alone): the
        speed gate keeps the trial it chose instead of rewriting the input again."""
        self.name, self.computations, self.header = other.name, other.computations, other.header
        self.stack_frames = other.stack_frames
        self._forget_names()

    @property
    def entry(self) -> Computation:
        """The ENTRY computation (a module has one), else the last. Looked for last
        first, where callees-first text puts it: analyses ask once per computation, and
        a scan from the front made that quadratic in the number of computations."""
        last = self.computations[-1]
        if last.is_entry:
            return last
        for comp in self.computations:
            if comp.is_entry:
                return comp
        return last

    def computation(self, name: str) -> Computation:
        found = self._lookup(name)
        if found is None:
            raise KeyError(name)
        return found

    def has_computation(self, name: str) -> bool:
        return self._lookup(name) is not None

    def _lookup(self, name: str) -> Computation | None:
        found = self._by_name.get(name)
        if found is not None and found.name == name:
            return found
        if found is None and self._indexed == len(self.computations):
            return None  # the index is whole: no such computation
        self._by_name = {comp.name: comp for comp in reversed(self.computations)}
        self._indexed = len(self.computations)
        return self._by_name.get(name)

    def insert_computation(self, position: int, comp: Computation) -> None:
        """Put ``comp`` at ``position`` of ``computations`` (a name not used yet)."""
        whole = self._indexed == len(self.computations)
        self.computations.insert(position, comp)
        if whole:
            self._by_name[comp.name] = comp
            self._indexed += 1

    def set_computations(self, computations: list[Computation]) -> None:
        """Replace the list of computations (a snapshot put back, dead ones removed)."""
        self.computations[:] = computations
        self._forget_names()

    def _forget_names(self) -> None:
        """Drop the name index: the list now holds other computations, which may bear
        the names of those indexed (a lookup would find the old one)."""
        self._by_name, self._indexed = {}, -1

    def output_aliases(self) -> dict[int, int]:
        """``input_output_alias`` as {top-level output index: parameter number}, for
        aliases of whole (array) parameters, in the header's order
        (:meth:`InputOutputAlias.array_aliases`)."""
        aliases = self.header.get("input_output_alias")
        return aliases.array_aliases() if isinstance(aliases, InputOutputAlias) else {}

    @property
    def replica_count(self) -> int:
        return int(cast(int, self.header.get("replica_count", 1)))

    @property
    def num_partitions(self) -> int:
        return int(cast(int, self.header.get("num_partitions", 1)))

    @property
    def device_count(self) -> int:
        """The devices one run of the module takes: replicas × partitions."""
        return self.replica_count * self.num_partitions

    def declared_signature(self) -> tuple[str, str] | None:
        """The entry's parameters (a tuple: ``(f32[4]{0}, s32[])``) and result the
        header's ``entry_computation_layout`` declares, as written; None where it
        declares none."""
        raw = self.header.get("entry_computation_layout")
        if not isinstance(raw, Raw):
            return None
        text = raw.text.strip()
        arrow = text.rfind(")->")
        if arrow < 0:
            return None
        parameters, result = text[:arrow + 1], text[arrow + 3:]
        return parameters.removeprefix("{"), result[:-1] if result.endswith("}") else result

    def declared_result(self) -> str | None:
        """The result the header's ``entry_computation_layout`` declares, as written
        (``(f32[4,6]{1,0}, s32[])``); None where it declares none."""
        signature = self.declared_signature()
        return None if signature is None else signature[1]

    @property
    def is_scheduled(self) -> bool:
        return bool(self.header.get("is_scheduled", False))
