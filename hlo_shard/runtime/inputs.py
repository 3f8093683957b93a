"""Inputs for executing a module on N devices: roles, seeded values, ``.npz`` files.

Data parallelism has a precondition: weights and optimizer state are the same on
every replica, the batch differs. So each entry parameter is either *replicated*
(one value on all devices) or *per-device* (its own value on each device). The role
comes from the first source that has an opinion (:func:`parameter_roles`):

1. an explicit list of per-device parameters (``--per-device-params 9,10``; every
   other parameter is then replicated);
2. the manifest (:mod:`hlo_shard.runtime.manifest`) records of the original's parameters;
3. the parameter's ``sharding`` in an SPMD-form module: ``{replicated}`` → replicated,
   a tiled sharding → per-device;
4. its ``parameter_replication`` attribute;
5. :func:`default_roles`, a dataflow analysis: a parameter that reaches an output
   through elementwise and data-movement ops only (no reduction, dot or summing
   collective on the way) is state updated in place → replicated; else one that
   reaches a summing collective (all-reduce, reduce-scatter) is batch data or a local
   gradient → per-device; anything else → replicated.

Values are seeded by (seed, step, parameter, device) so both modules of a comparison
get the same inputs and a rerun reproduces them. Floats are ``0.1·N(0,1)``, small
enough that a few optimizer steps stay finite; parameters that flow into ``sqrt``,
``rsqrt``, ``log``, ``power`` or a divisor (Adam's second moment ``nu``) are made
positive instead (``0.01 + |0.1·N(0,1)|``, :func:`positive_parameters`). Integers are
drawn from 1…4 (valid as step counts and divisors, small as exponents and indices),
pred uniformly.
"""

from __future__ import annotations

import re
from typing import Any
from dataclasses import dataclass
from functools import reduce
from operator import or_
from pathlib import Path
from collections.abc import Callable, Generator, Iterable, Sequence

import numpy as np

from hlo_shard.analysis.replication import replicated_tile_sets
from hlo_shard.errors import HloParseError, HloShardError
from hlo_shard.graph import NestedWalk, callees_first, run_nested, topological_order
from hlo_shard.ir import (
    COMPLEX_TYPES, FLOAT_TYPES, ArrayShape, Computation, ComputationRef, Instruction, Module,
    Raw, Shape, TupleShape, shape_leaves,
)
from hlo_shard.opinfo import (ALL_GATHERS, CALL, DATA_MOVEMENT, KERNEL, OPINFO, PER_ELEMENT,
                              SUMMING_COLLECTIVES, with_async_forms)
from hlo_shard.parser import compatible, read_shape
from hlo_shard.runtime.manifest import Manifest

REPLICATED = "replicated"
PER_DEVICE = "per-device"

#: Per-device values of one parameter or output leaf: ``values[device]``.
DeviceValues = list[np.ndarray]

# ---------------------------------------------------------------------------- dtypes

_NUMPY_NAMES = {
    "pred": "bool", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
    "f16": "float16", "f32": "float32", "f64": "float64",
    "c64": "complex64", "c128": "complex128",
}
#: Types numpy lacks, provided by ml_dtypes (a jax dependency).
_ML_DTYPES_NAMES = {
    "bf16": "bfloat16", "s1": "int1", "s2": "int2", "s4": "int4",
    "u1": "uint1", "u2": "uint2", "u4": "uint4",
    "f8e5m2": "float8_e5m2", "f8e4m3": "float8_e4m3", "f8e4m3fn": "float8_e4m3fn",
    "f8e4m3b11fnuz": "float8_e4m3b11fnuz", "f8e3m4": "float8_e3m4",
    "f8e5m2fnuz": "float8_e5m2fnuz", "f8e4m3fnuz": "float8_e4m3fnuz",
    "f8e8m0fnu": "float8_e8m0fnu", "f4e2m1fn": "float4_e2m1fn",
}


def numpy_dtype(element_type: str) -> np.dtype:
    if element_type in _NUMPY_NAMES:
        return np.dtype(_NUMPY_NAMES[element_type])
    if element_type in _ML_DTYPES_NAMES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, _ML_DTYPES_NAMES[element_type]))
    raise HloShardError(f"element type {element_type} cannot be passed as an input")


# --------------------------------------------------------------------------- roles


@dataclass(frozen=True, slots=True)
class ParameterRole:
    number: int
    name: str
    role: str  # REPLICATED | PER_DEVICE
    #: Which rule decided: "--per-device-params", "manifest", "sharding",
    #: "parameter_replication" or "analysis".
    source: str
    #: A per-device parameter whose sharding replicates each tile over several devices (a
    #: tensor-parallel weight on a data × model mesh): per device, the device whose
    #: value it holds (empty: each its own). The module may rely on those copies being
    #: equal, as the program that wrote it guarantees.
    shares: tuple[int, ...] = ()


def parameter_roles(module: Module, per_device: Iterable[int] | None = None,
                    manifest: Manifest | None = None) -> list[ParameterRole]:
    """The role of every entry parameter of ``module`` (the *original* of a pair)."""
    params = module.entry.parameters()
    if per_device is not None:
        chosen = set(per_device)
        unknown = chosen - {p.param_number for p in params}
        if unknown:
            raise HloShardError(f"--per-device-params: module has no parameter "
                                f"{', '.join(map(str, sorted(unknown)))}")
        return [ParameterRole(p.param_number, p.name,
                              PER_DEVICE if p.param_number in chosen else REPLICATED,
                              "--per-device-params") for p in params]
    from_manifest: dict[int, str] = {}
    if manifest is not None:
        from_manifest = {r.original: PER_DEVICE if r.kind == PER_DEVICE else REPLICATED
                         for r in manifest.parameters if r.original is not None}
    analysis = default_roles(module)
    roles = []
    for p in params:
        for source, role in (("manifest", from_manifest.get(p.param_number)),
                             ("sharding", _sharding_role(module, p)),
                             ("parameter_replication", _replication_role(p)),
                             ("analysis", analysis[p.param_number])):
            if role is not None:
                shares = _tile_copies(module, p) if role == PER_DEVICE else ()
                roles.append(ParameterRole(p.param_number, p.name, role, source, shares))
                break
    return roles


def _tile_copies(module: Module, param: Instruction) -> tuple[int, ...]:
    """Per device, the first device holding the same tile of ``param`` by its SPMD
    sharding (empty: no tile is held by more than one device, or the sharding says not)."""
    sharding = param.attributes.get("sharding")
    if module.num_partitions <= 1 or not isinstance(sharding, Raw):
        return ()
    body = sharding.text.strip().strip("{}").strip()
    sets = replicated_tile_sets(body) if body.startswith("devices=") else None
    devices = module.num_partitions
    if not sets or all(len(s) == 1 for s in sets) or \
            sorted(d for s in sets for d in s) != list(range(devices)):
        return ()
    first = {d: min(s) for s in sets for d in s}
    return tuple(first[d] for d in range(devices))


_TILE_DIMS = re.compile(r"devices=\[([\d,]+)\]")


def _sharding_role(module: Module, param: Instruction) -> str | None:
    """Role from an SPMD module's ``sharding={…}`` on the parameter, if it says."""
    sharding = param.attributes.get("sharding")
    if module.num_partitions <= 1 or sharding is None:
        return None
    text = sharding.text if isinstance(sharding, Raw) else str(sharding)
    if text.strip("{} ") == "replicated":
        return REPLICATED
    match = _TILE_DIMS.search(text)
    if not match:
        return None  # manual, maximal, unknown: not a statement about replication
    tiles = [int(d) for d in match.group(1).split(",")]
    if "last_tile_dim_replicate" in text or "last_tile_dims" in text:
        tiles = tiles[:-1]
    return PER_DEVICE if np.prod(tiles) > 1 else REPLICATED


def _replication_role(param: Instruction) -> str | None:
    value = param.attributes.get("parameter_replication")
    if value is None:
        return None
    flags = value if isinstance(value, tuple) else re.findall(
        r"true|false", value.text if isinstance(value, Raw) else str(value))
    flags = [flag in (True, "true") for flag in flags]
    if not flags:
        return None
    return REPLICATED if all(flags) else PER_DEVICE


# ----------------------------------------------------------------- default analysis

#: Ops through which a value keeps its identity (elementwise and data movement):
#: a parameter reaching an output through these only is state updated in place.
#: (``tuple``, ``get-tuple-element`` and ``opt-barrier`` keep their leaves apart: they
#: have handlers of their own in :class:`_ParameterFlow`.)
#: An all-gather brings the shards of replicated state back: still the same state.
#: Their async forms (``copy-start`` …) pass it through too.
PASS_THROUGH = with_async_forms(PER_ELEMENT | DATA_MOVEMENT | ALL_GATHERS)


@dataclass(frozen=True, slots=True)
class _Bits:
    """Parameters (bitsets) a value depends on at all, and unchanged (pass-through)."""

    reach: int
    through: int

    def __or__(self, other: _Bits) -> _Bits:
        return _Bits(self.reach | other.reach, self.through | other.through)


#: One _Bits per array leaf of a value, depth first.
_Leaves = tuple[_Bits, ...]
#: How one opcode's result leaves follow from its operands' (comp, inst, operands).
_Transfer = Callable[[Computation, Instruction, list[_Leaves]], _Leaves]
#: The flow through one computation, suspended at each computation it runs (with its
#: parameters' leaves), and sent that computation's root leaves.
_Flow = NestedWalk[tuple[Computation, Sequence[_Leaves]], _Leaves]
#: The same for an op that runs computations (a call, a loop, branches).
_CallingTransfer = Callable[[Instruction, list[_Leaves]], _Flow]


def _leaf_count(shape: Shape) -> int:
    return sum(1 for _ in shape_leaves(shape))


class _ParameterFlow:
    """Tuple-aware forward dataflow of entry parameters through the module, following
    calls, fusions, conditionals and while loops (to a fixpoint) into their bodies, so
    that state carried through a loop stays apart from the batch it is carried with.
    The computations an op runs are followed on :func:`run_nested`'s stack, not by
    recursion."""

    def __init__(self, module: Module) -> None:
        self.comps = {c.name: c for c in module.computations}
        self.summed = 0  # parameters that reach a summing collective
        #: The computations that sum across devices, themselves or in one they call.
        self._summing: set[str] = set()
        for comp in callees_first(module):
            if any(inst.opcode in SUMMING_COLLECTIVES or not self._summing.isdisjoint(
                    inst.called_computations()) for inst in comp.instructions):
                self._summing.add(comp.name)
        # opt-barrier returns its operand as it is: leaf for leaf, like a tuple of one.
        self.handlers: dict[str, _Transfer] = {
            "tuple": self._tuple, "opt-barrier": self._tuple,
            "get-tuple-element": self._get_tuple_element}
        self.calling: dict[str, _CallingTransfer] = {
            "while": self._while, "call": self._call, "fusion": self._call,
            "conditional": self._conditional}

    def run(self, comp: Computation, params: Sequence[_Leaves]) -> _Leaves:
        """The leaves of ``comp``'s root, its parameters' being ``params``."""
        return run_nested(self._walk(comp, params), lambda callee: self._walk(*callee))

    def _walk(self, comp: Computation, params: Sequence[_Leaves]) -> _Flow:
        values: dict[str, _Leaves] = {}
        for inst in topological_order(comp):
            if inst.opcode == "parameter":
                values[inst.name] = params[inst.param_number]
                continue
            operands = [values[name] for name in inst.operands]
            calling = self.calling.get(inst.opcode)
            values[inst.name] = (yield from calling(inst, operands)) if calling is not None \
                else self.handlers.get(inst.opcode, self._default)(comp, inst, operands)
        return values[comp.root.name]

    def _tuple(self, comp: Computation, inst: Instruction, operands: list[_Leaves]) -> _Leaves:
        return tuple(bits for leaves in operands for bits in leaves)

    def _get_tuple_element(self, comp: Computation, inst: Instruction,
                           operands: list[_Leaves]) -> _Leaves:
        source = comp[inst.operands[0]].shape
        assert isinstance(source, TupleShape), f"%{inst.name} reads a non-tuple"
        elements = source.elements
        index = inst.required_attr("index", int)
        start = sum(_leaf_count(e) for e in elements[:index])
        return operands[0][start:start + _leaf_count(elements[index])]

    def _call(self, inst: Instruction, operands: list[_Leaves]) -> _Flow:
        return (yield self.comps[inst.called_computations()[0]], operands)

    def _while(self, inst: Instruction, operands: list[_Leaves]) -> _Flow:
        body = self.comps[inst.required_attr("body", ComputationRef).name]
        condition = self.comps[inst.required_attr("condition", ComputationRef).name]
        state = operands[0]
        while True:
            yield condition, [state]
            grown = tuple(a | b for a, b in zip(state, (yield body, [state])))
            if grown == state:
                return state
            state = grown

    def _conditional(self, inst: Instruction, operands: list[_Leaves]) -> _Flow:
        predicate = _Bits(0, 0)
        for bits in operands[0]:
            predicate |= _Bits(bits.reach, 0)
        branches = []
        for k, branch in enumerate(inst.called_computations()):
            branches.append((yield self.comps[branch], [operands[k + 1]]))
        return tuple(reduce(or_, leaf, predicate) for leaf in zip(*branches))

    def _default(self, comp: Computation, inst: Instruction, operands: list[_Leaves]
                 ) -> _Leaves:
        flat = [bits for leaves in operands for bits in leaves]
        reach = 0
        for bits in flat:
            reach |= bits.reach
        if inst.opcode in SUMMING_COLLECTIVES or not self._summing.isdisjoint(
                inst.called_computations()):
            self.summed |= reach
            if len(flat) == _leaf_count(inst.shape):  # variadic: leaf k from operand k
                return tuple(_Bits(bits.reach, 0) for bits in flat)
        through = 0
        if inst.opcode in PASS_THROUGH:
            for bits in flat:
                through |= bits.through
        return (_Bits(reach, through),) * _leaf_count(inst.shape)


def default_roles(module: Module) -> dict[int, str]:
    """Parameter number → role by the dataflow rule in the module docstring."""
    flow = _ParameterFlow(module)
    params = module.entry.parameters()
    outputs = flow.run(module.entry, [
        (_Bits(1 << p.param_number, 1 << p.param_number),) * _leaf_count(p.shape)
        for p in params])
    to_output = 0
    for bits in outputs:
        to_output |= bits.through
    roles = {}
    for param in params:
        bit = 1 << param.param_number
        per_device = not (to_output & bit) and bool(flow.summed & bit)
        roles[param.param_number] = PER_DEVICE if per_device else REPLICATED
    return roles


# ---------------------------------------------------------------- positive domains

#: Operands that must be positive for finite results: opcode → operand indices.
POSITIVE_OPERANDS: dict[str, tuple[int, ...]] = {
    "sqrt": (0,), "rsqrt": (0,), "log": (0,), "log-plus-one": (0,), "power": (0,),
    "divide": (1,),
}
#: How a demand for a positive result passes to operands: opcode → operand indices
#: (None: all operands). Ops not listed stop the demand (exp, abs, subtract …).
POSITIVE_IF: dict[str, tuple[int, ...] | None] = {
    "add": None, "multiply": None, "maximum": None, "minimum": None, "divide": (0,),
    "sqrt": (0,), "convert": None, "copy": None, "broadcast": None, "reshape": None,
    "bitcast": None, "transpose": None, "slice": None, "reverse": None,
    "concatenate": None, "pad": None, "dynamic-slice": (0,), "dynamic-update-slice": (0, 1),
    "all-reduce": None, "all-gather": None, "reduce-scatter": None, "reduce": (0,),
    "select": (1, 2), "clamp": (1,), "tuple": None, "opt-barrier": None,
}


def positive_parameters(module: Module) -> set[int]:
    """Entry parameters whose values should be positive (see the module docstring)."""
    comps = {c.name: c for c in module.computations}
    #: (computation, its root's value demanded positive) → its parameters demanded so.
    found: dict[tuple[str, bool], frozenset[int]] = {}

    def demanded(request: tuple[str, bool]) -> _Demands:
        if request not in found:
            name, root_demanded = request
            found[request] = frozenset((yield from _demanded_parameters(
                comps[name], root_demanded, comps)))
        return found[request]

    entry: frozenset[int] = run_nested(demanded((module.entry.name, False)), demanded)
    return set(entry)


#: The parameters of a computation demanded positive, found while it yields each callee
#: (and whether its root is demanded) and is sent the callee's.
_Demands = NestedWalk[tuple[str, bool], frozenset[int]]


def _demanded_parameters(comp: Computation, root_demanded: bool,
                         comps: dict[str, Computation]
                         ) -> Generator[tuple[str, bool], frozenset[int], set[int]]:
    demanded: set[str] = {comp.root.name} if root_demanded else set()
    for inst in reversed(topological_order(comp)):
        wanted = inst.name in demanded
        if inst.opcode == "multiply" and len(set(inst.operands)) == 1:
            continue  # a square is positive whatever its operand
        indices: set[int] = set(POSITIVE_OPERANDS.get(inst.opcode, ()))
        if wanted and inst.opcode in POSITIVE_IF:
            chosen = POSITIVE_IF[inst.opcode]
            indices |= set(range(len(inst.operands)) if chosen is None else chosen)
        if wanted and inst.opcode == "get-tuple-element":
            producer = comp.get(inst.operands[0])
            while producer is not None and producer.opcode == "opt-barrier":
                producer = comp.get(producer.operands[0])  # its operand, as it is
            if producer is not None and producer.opcode in ("tuple", "all-reduce"):
                demanded.add(producer.operands[inst.required_attr("index", int)])
        if inst.opcode in OPINFO and OPINFO[inst.opcode].calls in (CALL, KERNEL):
            for callee in inst.called_computations():
                if callee in comps:
                    indices |= set((yield callee, wanted))
        demanded.update(inst.operands[i] for i in indices if i < len(inst.operands))
    return {p.param_number for p in comp.parameters() if p.name in demanded}


# ----------------------------------------------------------------------- generation


def random_value(shape: ArrayShape, rng: np.random.Generator, positive: bool = False
                 ) -> np.ndarray:
    """One seeded value for ``shape`` (see the module docstring for the ranges)."""
    dtype = numpy_dtype(shape.element_type)
    dims = shape.dims
    if shape.element_type == "pred":
        return rng.random(dims) < 0.5
    if shape.element_type in COMPLEX_TYPES:
        return (0.1 * (rng.standard_normal(dims) + 1j * rng.standard_normal(dims))).astype(dtype)
    if shape.element_type in FLOAT_TYPES:
        value = 0.1 * rng.standard_normal(dims)
        if positive:
            value = 0.01 + np.abs(value)
        return np.asarray(value, dtype=np.float32).astype(dtype)
    return rng.integers(1, 5, size=dims).astype(dtype)


def _array_parameter(param: Instruction) -> ArrayShape:
    if isinstance(param.shape, TupleShape):
        raise HloShardError(f"entry parameter %{param.name} is a tuple; tuple-shaped "
                            "entry parameters are not supported")
    return param.shape


def parameter_shapes(module: Module) -> list[ArrayShape]:
    return [_array_parameter(param) for param in module.entry.parameters()]


def output_shapes(module: Module) -> list[ArrayShape]:
    """The entry's output leaves, depth first (the order XLA returns them in), in the
    layouts the executable returns them in: the header's ``entry_computation_layout``
    where it declares them (jax writes some ROOT elements ``{0,1}`` beside a declared
    ``{1,0}``; XLA copies them into the declared one), the root's otherwise."""
    shape = module.entry.root.shape
    written = module.declared_result()
    try:
        declared = read_shape(written) if written is not None else None
    except HloParseError:
        declared = None
    if declared is not None and compatible(declared, shape):
        shape = declared
    return [leaf for _, leaf in shape_leaves(shape)]


def generate_parameter(shape: ArrayShape, number: int, role: str, devices: int, seed: int,
                       step: int = 0, positive: bool = False,
                       shares: Sequence[int] = ()) -> DeviceValues:
    """Seeded per-device values of one parameter; replicated ones share one array, and
    a per-device one's devices that ``shares`` the value of another hold its array."""
    if role == REPLICATED:
        value = random_value(shape, np.random.default_rng([seed, step, number]), positive)
        return [value] * devices
    sources = shares or range(devices)
    own = {d: random_value(shape, np.random.default_rng([seed, step, number, 1 + d]), positive)
           for d in sorted(set(sources))}
    return [own[source] for source in sources]


def generate_inputs(module: Module, roles: Sequence[ParameterRole], devices: int,
                    seed: int = 0, step: int = 0) -> list[DeviceValues]:
    """Seeded values for every entry parameter: ``inputs[parameter][device]``."""
    positive = positive_parameters(module)
    return [generate_parameter(shape, role.number, role.role, devices, seed, step,
                               role.number in positive,
                               role.shares if len(role.shares) == devices else ())
            for shape, role in zip(parameter_shapes(module), roles)]


# --------------------------------------------------------------------- input regimes


@dataclass(frozen=True, slots=True)
class Regime:
    """Edge inputs of one kind: which parameters a regime sets, and to what. The
    parameters it sets that hold state (replicated) replace the fed-back state at that
    step, in both modules alike; everything else is random or fed back as usual."""

    name: str
    #: (role, element type) → whether the regime sets this parameter.
    sets: Callable[[str, str], bool]
    #: (shape, rng, positive) → the value.
    value: Callable[[ArrayShape, np.random.Generator, bool], np.ndarray]
    doc: str


def _is_float(element_type: str) -> bool:
    return element_type in FLOAT_TYPES


def _is_integer(element_type: str) -> bool:
    return element_type not in FLOAT_TYPES | COMPLEX_TYPES and element_type != "pred"


def _zeros(shape: ArrayShape, rng: np.random.Generator, positive: bool) -> np.ndarray:
    return np.zeros(shape.dims, numpy_dtype(shape.element_type))


def _late_count(shape: ArrayShape, rng: np.random.Generator, positive: bool) -> np.ndarray:
    """Step counts at their saturation: the type's maximum minus 0…3."""
    dtype = numpy_dtype(shape.element_type)
    top = int(np.iinfo(dtype).max) if dtype.kind in "iu" else int(2 ** 31 - 1)
    return (top - rng.integers(0, 4, size=shape.dims)).astype(dtype)


#: Decades of magnitude of wide-range floats: (low, high) exponents of ten; positive
#: values (second moments) go twice as low, to reach an optimizer's eps.
_WIDE_DECADES = {"f64": (-8, 2), "f32": (-8, 2), "f16": (-3, 0), "bf16": (-6, 2)}
_WIDE_DEFAULT = (-1, 0)
#: Decades the elements of one wide-range value spread around its own decade: values
#: of one scale per tensor, so that each tensor in turn dominates a global norm, and
#: elements spread enough that some reach eps.
_WIDE_SPREAD = 2.0


def _wide(shape: ArrayShape, rng: np.random.Generator, positive: bool) -> np.ndarray:
    low, high = _WIDE_DECADES.get(shape.element_type, _WIDE_DEFAULT)
    if positive:
        low = 2 * low
    exponent = rng.uniform(low, high) + rng.uniform(-_WIDE_SPREAD, _WIDE_SPREAD, size=shape.dims)
    magnitude = 10.0 ** np.clip(exponent, low, high)
    sign = 1.0 if positive else np.where(rng.random(shape.dims) < 0.5, -1.0, 1.0)
    return np.asarray(sign * magnitude, dtype=np.float32).astype(numpy_dtype(shape.element_type))


REGIMES: tuple[Regime, ...] = (
    Regime("random", lambda role, t: False, _zeros, "seeded values as described above"),
    Regime("zero-grad", lambda role, t: role == PER_DEVICE and _is_float(t), _zeros,
           "per-device floats (batch, local gradients) zero"),
    Regime("zero-state", lambda role, t: role == REPLICATED, _zeros,
           "replicated parameters (weights, state, step counts) zero, as at step 0"),
    Regime("late-step", lambda role, t: role == REPLICATED and _is_integer(t), _late_count,
           "replicated integers (step counts) at their type's maximum minus 0…3"),
    Regime("wide-range", lambda role, t: _is_float(t), _wide,
           "floats ±10^(d ± 2), one decade d ~ U(-8, 2) per value (f32; 16-bit narrower), "
           "positive ones down to 10^-16"),
)
REGIME_NAMES = tuple(r.name for r in REGIMES)
#: ``--inputs-regime all``: one regime per step, in this order, cycling.
ALL = "all"


def regime_of(name: str, step: int) -> Regime:
    """The regime of 0-based ``step`` for ``--inputs-regime name``."""
    if name == ALL:
        return REGIMES[step % len(REGIMES)]
    for regime in REGIMES:
        if regime.name == name:
            return regime
    raise HloShardError(f"unknown input regime {name!r} (one of {', '.join(REGIME_NAMES)}, "
                        f"{ALL})")


def regime_inputs(module: Module, roles: Sequence[ParameterRole], devices: int, seed: int,
                  step: int, regime: Regime) -> tuple[list[DeviceValues], set[int]]:
    """Inputs of ``step`` under ``regime`` and the replicated parameters it set (they
    replace fed-back state). Regime values are seeded apart from the random ones."""
    values = generate_inputs(module, roles, devices, seed, step)
    positive = positive_parameters(module)
    reset = set()
    for shape, role in zip(parameter_shapes(module), roles):
        if not regime.sets(role.role, shape.element_type):
            continue
        keys = [[seed, step, role.number, 1 + d, 0x5E61] for d in range(devices)]
        if role.role == REPLICATED:
            value = regime.value(shape, np.random.default_rng(keys[0]), role.number in positive)
            values[role.number] = [value] * devices
            reset.add(role.number)
        else:
            own = [regime.value(shape, np.random.default_rng(key), role.number in positive)
                   for key in keys]
            shares = role.shares if len(role.shares) == devices else range(devices)
            values[role.number] = [own[source] for source in shares]
    return values, reset


# ---------------------------------------------------------------------- npz inputs


def load_npz(path: str | Path, module: Module, devices: int) -> dict[int, DeviceValues]:
    """User-supplied values from an ``.npz``, by parameter number.

    Keys are ``p<N>`` (parameter number) or the parameter's name. A value shaped like
    the parameter is replicated; one with a leading axis of size N (devices) holds a
    value per device. Parameters absent from the file are generated.
    """
    params = module.entry.parameters()
    by_key = {f"p{p.param_number}": p for p in params} | {p.name: p for p in params}
    values: dict[int, DeviceValues] = {}
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise HloShardError(f"{path}: cannot read inputs ({err})") from None
    with archive:
        for key in archive.files:
            param = by_key.get(key)
            if param is None:
                raise HloShardError(f"{path}: {key!r} names no entry parameter "
                                    "(use p<number> or the parameter's name)")
            shape = _array_parameter(param)
            array = archive[key]
            dtype = numpy_dtype(shape.element_type)
            if tuple(array.shape) == shape.dims:
                values[param.param_number] = [array.astype(dtype)] * devices
            elif tuple(array.shape) == (devices, *shape.dims):
                values[param.param_number] = [array[d].astype(dtype) for d in range(devices)]
            else:
                raise HloShardError(
                    f"{path}: {key!r} has shape {tuple(array.shape)}; parameter "
                    f"%{param.name} needs {shape.dims} (replicated) or "
                    f"{(devices, *shape.dims)} (one per device)")
    return values


def coerce_argument(value: Any, shape: ArrayShape, devices: int, number: int) -> DeviceValues:
    """A Python-API argument as per-device values: a list or tuple holds one value
    per device; anything else (numpy or jax array, scalar) is replicated."""
    dtype = numpy_dtype(shape.element_type)
    items = list(value) if isinstance(value, (list, tuple)) else [value] * devices
    if len(items) != devices:
        raise HloShardError(f"parameter {number}: {len(items)} per-device values for "
                            f"{devices} devices")
    out = []
    for item in items:
        array = np.asarray(item).astype(dtype, copy=False)
        if array.shape != shape.dims:
            raise HloShardError(f"parameter {number}: value of shape {array.shape}, "
                                f"expected {shape.dims}")
        out.append(array)
    return out
