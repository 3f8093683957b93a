"""Every call into jax's private XLA client API that :mod:`hlo_shard.jax` makes.

Supported: ``jax>=0.10,<0.11`` (the range :mod:`hlo_shard.runtime` is tested against;
``HLO_SHARD_ALLOW_UNSUPPORTED_JAX=1`` tries another release anyway). Unlike the
runtime, this compiles and executes in the caller's process: the point is to run on
the user's own jax Arrays, with no copy to numpy or to a child.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from hlo_shard.errors import HloShardError
from hlo_shard.runtime._child import ALLOW_UNSUPPORTED_ENV, unsupported_version_message


def check_version() -> None:
    import jaxlib.version

    problem = unsupported_version_message(jaxlib.version.__version__)
    if problem and os.environ.get(ALLOW_UNSUPPORTED_ENV) != "1":
        raise HloShardError(problem)


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
    """What one argument leaf contributes to the signature (jit's cache key, in kind).
    Computed on every call, so it stays cheap: the dtype object, not its name
    (``str(dtype)`` was 2 of the 2.5 µs a leaf took)."""
    sharding = getattr(x, "sharding", None)
    shape = tuple(getattr(x, "shape", ()))
    where = None if sharding is None else placement(sharding, len(shape))
    return (shape, dtype_key(x), where)


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
