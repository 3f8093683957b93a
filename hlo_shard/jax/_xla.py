"""Every call into jax's private XLA client API that :mod:`hlo_shard.jax` makes.

Supported: ``jax>=0.10,<0.11`` (the range :mod:`hlo_shard.runtime` is tested against;
``HLO_SHARD_ALLOW_UNSUPPORTED_JAX=1`` tries another release anyway). Unlike the
runtime, this compiles and executes in the caller's process: the point is to run on
the user's own jax Arrays, with no copy to numpy or to a child.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hlo_shard.profiles import HardwareProfile, load_profile
from hlo_shard.profiles.detect import profile_for_device


def _client() -> Any:
    from jax._src.lib import xla_client as xc  # private API (see the module docstring)

    return xc


def compile_replica_text(text: str, devices: Sequence) -> object:
    """A LoadedExecutable of replica-form ``text``: replica ``k`` runs on ``devices[k]``."""
    xc = _client()
    module = xc.hlo.hlo_module_from_text(text)
    computation = xc.XlaComputation(module.as_serialized_hlo_module_proto())
    mlir = xc._xla.mlir.xla_computation_to_mlir_module(computation)
    options = xc.CompileOptions()
    build = options.executable_build_options
    build.num_replicas = len(devices)
    build.num_partitions = 1
    build.device_assignment = xc.DeviceAssignment.create(
        np.array([[device.id] for device in devices]))
    client = devices[0].client
    return client.compile_and_load(mlir, xc.DeviceList(tuple(devices)), options)


def execute(executable: Any, arrays: list, handlers: list) -> list:
    """Run on jax Arrays (one buffer per device each); the outputs as global Arrays,
    built by ``handlers`` (:func:`result_handlers`)."""
    return executable.execute_sharded(arrays).consume_with_handlers(handlers)


def result_handlers(outputs: Sequence[tuple[tuple[int, ...], Any, Any]]) -> list:
    """Per output (global shape, dtype, sharding), jax's own handler for it — the one
    its dispatch uses, which makes the global Array of the executable's per-device
    buffers in C++. Splitting them into single-device arrays and building each Array
    in Python cost some 24 µs an output on every step (0.76 ms of a 4.4 ms LayerNorm
    MLP step with 32 outputs at N = 8: the path measured 1.06-1.20x jit's step where
    the module itself ran at 0.90x of the original's)."""
    from jax._src import core
    from jax._src.interpreters import pxla  # private API (see the module docstring)

    return [pxla.global_aval_to_result_handler(core.ShapedArray(tuple(shape), dtype),
                                               sharding, True)
            for shape, dtype, sharding in outputs]


def is_jax_jit(fn: Any) -> bool:
    """Whether ``fn`` is what ``jax.jit`` returns (its lowering is jax's ``Lowered``)."""
    return hasattr(fn, "_jit_info") and hasattr(fn, "lower")


def base_array(x: Any) -> Any:
    """A typed PRNG key array's underlying integer array (what the executable takes for
    an extended-dtype argument), without a dispatch."""
    return x._base_array


def memory_stats(executable: Any) -> dict[str, int]:
    stats = executable.get_compiled_memory_stats()
    names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
             "temp_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes")
    return {name: int(getattr(stats, name, 0) or 0) for name in names}


def kept_argument_indices(lowered: Any) -> tuple[int, ...] | None:
    """Which flat arguments jit kept in the module (it prunes unused ones unless
    ``keep_unused``), or None when the lowering does not say."""
    kept = getattr(lowered, "_lowering", None)
    kept = getattr(kept, "compile_args", {}).get("kept_var_idx")
    return None if kept is None else tuple(sorted(kept))


def lowering_facts(lowered: Any) -> dict:
    """Facts of jit's lowering that decide whether the module is runnable as is."""
    args = getattr(getattr(lowered, "_lowering", None), "compile_args", {})
    const_args = getattr(lowered._lowering, "const_args", None) or ()
    return {"ordered_effects": tuple(args.get("ordered_effects", ())),
            "host_callbacks": tuple(args.get("host_callbacks", ())),
            "tuple_args": bool(args.get("tuple_args", False)),
            "const_args": len(const_args)}


def backends_started() -> bool:
    """Whether jax has started its backends (any call of ``jax.devices()``, a compile);
    asking does not start them."""
    from jax._src import xla_bridge  # private API (see the module docstring)

    return bool(xla_bridge.backends_are_initialized())


def add_to_cache_key(addition: Callable[[], str]) -> None:
    """Make ``addition()`` part of the key of every entry of jax's persistent compilation
    cache from now on (after what another library added through the same hook)."""
    from jax._src import cache_key  # private API (see the module docstring)

    previous = cache_key.custom_hook

    def custom_hook() -> str:
        return previous() + addition()

    cache_key.custom_hook = custom_hook


def device_profile(device: Any) -> HardwareProfile:
    """The published profile of ``device`` (jax's ``platform`` and ``device_kind``;
    ``cpu-local`` on CPU): what a front end given no profile prices a step on, so that a
    step compiled for GPUs is not decided on the CPU's rates. A device with no profile of
    its own is priced on its platform's nearest, with one logged warning."""
    name, note = profile_for_device(device.platform, device.device_kind)
    if note is not None:
        logging.getLogger("hlo_shard").warning("hlo_shard: %s", note)
    return load_profile(name)


def device_assignment(lowered: Any) -> tuple:
    """The devices of jit's executable in partition order (the mesh's order)."""
    return tuple(lowered._lowering._device_list)


_PLACEMENTS: dict = {}


def placement(sharding: Any, ndim: int) -> Any:
    """A canonical, hashable form of where ``sharding`` puts an ``ndim`` array: equal
    for equivalent shardings (``P()`` and ``P(None, None)`` alike), device order kept."""
    key = (sharding, ndim)
    found = _PLACEMENTS.get(key)
    if found is None:
        found = (tuple(sharding._device_assignment), sharding._to_xla_hlo_sharding(ndim),
                 sharding.memory_kind)
        _PLACEMENTS[key] = found
    return found


def leaf_key(x: Any) -> tuple:
    """What one argument leaf contributes to the signature (jit's cache key, in kind):
    its shape, dtype and canonical placement."""
    sharding = getattr(x, "sharding", None)
    shape = tuple(getattr(x, "shape", ()))
    where = None if sharding is None else placement(sharding, len(shape))
    return (shape, dtype_key(x), where)


#: Every leaf key seen, numbered: a signature is a tuple of small numbers, cheap to hash
#: on every call where a tuple of leaf keys (placements, device lists) is not.
_LEAF_NUMBERS: dict[tuple, int] = {}
#: A jax Array's ``(aval, sharding)`` → its leaf key's number: the two attributes a
#: training step's leaves are looked up by, without building the canonical key again.
_ARRAY_NUMBERS: dict[tuple, int] = {}


def leaf_number(key: tuple) -> int:
    """The number of the leaf key ``key`` (:func:`leaf_key`'s form)."""
    return _LEAF_NUMBERS.setdefault(key, len(_LEAF_NUMBERS))


def signature(leaves: Sequence[Any]) -> tuple[int, ...]:
    """The numbers of the leaves' keys: equal for leaves jit would run alike. Computed on
    every step, so a jax Array (every leaf of a training step, after the first) is found
    by its aval and sharding, and the canonical key is built once per new pair."""
    from jax._src.array import ArrayImpl

    numbers = []
    for x in leaves:
        if type(x) is ArrayImpl:
            attributes = (x.aval, x.sharding)
            number = _ARRAY_NUMBERS.get(attributes)
            if number is None:
                number = _ARRAY_NUMBERS[attributes] = leaf_number(leaf_key(x))
        else:
            number = leaf_number(leaf_key(x))
        numbers.append(number)
    return tuple(numbers)


def dtype_key(x: Any) -> object:
    """``x``'s dtype (hashable), or its type's name for a leaf without one."""
    dtype = getattr(x, "dtype", None)
    return type(x).__name__ if dtype is None else dtype


def same_placement(x: Any, sharding: Any) -> bool:
    """Whether ``x`` can be handed to the executable as is (else it is device_put)."""
    own = getattr(x, "sharding", None)
    if own is None:
        return False
    return own is sharding or placement(own, x.ndim) == placement(sharding, x.ndim)


# ------------------------------------------------- a capture's compile, stopped early
#: What the stop hands back to XLA instead of the module: not a module, so the compile
#: ends with an error right there, before the backend's code generation.
_NOT_A_MODULE = b"\xff"
#: The name the stop is registered under while a capture compiles.
STOP_NAME = "hlo_shard.capture_stop"
#: ``HloModuleProto.id``: the field number of the module's unique id.
_MODULE_ID_FIELD = 5


@dataclass(eq=False)
class _Armed:
    """One capture's compile waiting to be stopped: its dump folder, and the module
    (serialized, as XLA handed it over) once stopped."""

    folder: Path
    module: bytes | None = None


class PartitionStop:
    """Ends a capture's compile on XLA:CPU once the step is partitioned. The capture
    only needs the partitioner's module (dumped into its folder) and the shardings the
    partitioner chose; the backend's code generation after that is most of the compile,
    and where the pass shards the step it would be thrown away. Registered at
    ``PRE_SCHEDULER`` (the one stage jax offers after partitioning) only while a
    capture compiles, it recognises that compile's module by its unique id (the id the
    capture's own dump files carry), takes it, and hands XLA back bytes that are not a
    module; any other module (another thread's compile) passes untouched. A stopped
    compile has no executable: jit's is compiled when the step falls back."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed: list[_Armed] = []

    @contextmanager
    def arming(self, folder: Path) -> Iterator[_Armed]:
        """Stop the compile that dumps into ``folder`` while inside."""
        from jax.extend import xla as jax_xla

        armed = _Armed(folder)
        with self.lock:
            if not self.armed:
                jax_xla.register_hlo_module_transformation(
                    self.transform, name=STOP_NAME, stage=jax_xla.PipelineStage.PRE_SCHEDULER,
                    platforms="cpu")
            self.armed.append(armed)
        try:
            yield armed
        finally:
            with self.lock:
                self.armed.remove(armed)
                if not self.armed:
                    jax_xla.clear_hlo_module_transformation(
                        STOP_NAME, jax_xla.PipelineStage.PRE_SCHEDULER, platforms="cpu")

    def transform(self, data: bytes) -> bytes | None:
        """XLA's callback: never raises; stops only an armed capture's module."""
        try:
            module_id = _module_id(data)
            with self.lock:
                for armed in self.armed:
                    if armed.module is None and module_id in _dumped_module_ids(armed.folder):
                        armed.module = bytes(data)
                        return _NOT_A_MODULE
        except Exception:  # noqa: BLE001 - nothing may propagate into XLA
            pass
        return None


PARTITION_STOP = PartitionStop()


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def _module_id(data: bytes) -> int | None:
    """The unique id of a serialized ``HloModuleProto``, read from its top-level fields
    (its computations skipped, not decoded)."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
            if field == _MODULE_ID_FIELD:
                return value
        elif wire == 2:
            length, at = _varint(data, at)
            at += length
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            return None
    return None


def _dumped_module_ids(folder: Path) -> set[int]:
    """The unique ids of the modules dumped into ``folder`` (``module_0060.jit_step...``)."""
    ids = set()
    for path in folder.glob("module_*.*"):
        number = path.name.split(".", 1)[0].removeprefix("module_")
        if number.isdigit():
            ids.add(int(number))
    return ids


def compile_or_stop(lowered: Any, options: dict[str, Any], folder: Path
                    ) -> tuple[Any, bytes | None]:
    """Compile ``lowered`` with ``options`` (dumping into ``folder``): (jit's executable,
    None), or on CPU (None, the partitioned module) where :class:`PartitionStop` ended
    the compile before the backend ran. XLA's own errors propagate. A step on one
    device runs to the end: XLA partitions nothing there, so the capture finds no
    module and the fallback runs this executable."""
    devices = device_assignment(lowered)
    if devices[0].platform != "cpu" or len(devices) < 2:
        return lowered.compile(compiler_options=options), None
    with PARTITION_STOP.arming(folder) as armed:
        try:
            return lowered.compile(compiler_options=options), None
        except Exception:
            if armed.module is None:
                raise
    return None, armed.module


class _PartitionerChoices:
    """The part of an executable jax reads to name its shardings
    (``get_parameter_shardings``, ``get_output_shardings``), from the partitioned
    module of a stopped compile."""

    def __init__(self, module: bytes) -> None:
        hlo = _client().hlo.HloModule.from_serialized_hlo_module_proto(module)
        self.parameters = hlo.spmd_parameters_shardings
        self.output = hlo.spmd_output_sharding

    def get_parameter_shardings(self) -> list | None:
        return None if self.parameters is None else list(self.parameters)

    def get_output_shardings(self) -> list | None:
        output = self.output
        if output is None:
            return None
        return list(output.tuple_shardings) if output.type == _client().OpSharding.Type.TUPLE \
            else [output]

    def get_output_memory_kinds(self) -> list:
        raise NotImplementedError  # jax then takes the default memory kind


def partitioned_shardings(lowered: Any, module: bytes) -> tuple[tuple, tuple]:
    """jit's flat input and output shardings (``Compiled.input_shardings`` and
    ``output_shardings``, flattened: None for an argument jit pruned) of a compile
    stopped after partitioning: the partitioner's choices named as jax names them when
    it loads the executable."""
    from jax._src.interpreters import pxla

    args = lowered._lowering.compile_args
    devices = lowered._lowering._device_list
    choices = _PartitionerChoices(module)
    effects = len(args["ordered_effects"])
    ins = tuple(pxla.maybe_concretize_mesh(s, devices) for s in args["in_shardings"])
    outs = tuple(pxla.maybe_concretize_mesh(s, devices) for s in args["out_shardings"])
    ins = pxla._maybe_get_and_check_in_shardings(choices, ins, devices,
                                                 args["global_in_avals"], effects)
    outs = pxla._maybe_get_and_check_out_shardings(choices, outs, devices,
                                                   args["global_out_avals"], effects)
    outs = pxla.maybe_recover_user_shardings(ins, outs, args["global_in_avals"],
                                             args["global_out_avals"],
                                             args["intermediate_shardings"],
                                             args["context_mesh"])
    kept = iter(pxla.finalize_shardings(ins, devices))
    leaves = lowered.in_tree.num_leaves
    flat_ins = tuple(next(kept) if i in args["kept_var_idx"] else None for i in range(leaves))
    return flat_ins, tuple(pxla.finalize_shardings(outs, devices))
