"""The child process that compiles and executes HLO through jax's XLA client.

Run as a script by :class:`hlo_shard.runtime.worker.Worker`, never imported by the
parent except for its pure helpers (framing, version range). It imports only the
standard library, numpy and jax — not :mod:`hlo_shard` — so it starts fast and a
CHECK failure inside XLA (which calls ``abort()``) kills this process only.

Why a separate process at all: ``--xla_force_host_platform_device_count`` must be in
the environment before jax's CPU backend starts, and XLA's CHECKs cannot be caught.

Protocol: length-prefixed pickles over two pipes. Each request is a dict with an
``op``; each reply is ``{"ok": True, "result": …}`` or ``{"ok": False, "error": …}``.
This file holds every call into jax's private API (``jax._src.lib.xla_client``); the
shim functions cover the differences listed in executing-hlo-with-jax.md §11.
"""

from __future__ import annotations

import collections
import hashlib
import os
import pickle
import re
import resource
import signal
import struct
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO

#: jax/jaxlib releases this runtime was written and tested against ([low, high)).
SUPPORTED_JAXLIB = ((0, 10), (0, 11))
SUPPORTED_TEXT = "jax>=0.10,<0.11"
#: Set to 1 to try an unsupported jaxlib anyway (the shim may cope).
ALLOW_UNSUPPORTED_ENV = "HLO_SHARD_ALLOW_UNSUPPORTED_JAX"
#: Released executables kept for reuse: comparing a module with itself, or a test
#: suite loading one fixture many times, compiles it once.
IDLE_EXECUTABLES_KEPT = 32

_HEADER = struct.Struct("<Q")

# ------------------------------------------------------------------ framing helpers


def write_message(stream: BinaryIO, message: Any) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def read_message(stream: BinaryIO) -> Any:
    """The next message, or None at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack(header)
    payload = stream.read(length)
    if len(payload) < length:
        return None
    return pickle.loads(payload)


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def unsupported_version_message(version: str) -> str | None:
    """Why ``version`` of jaxlib cannot be used, or None when it is supported."""
    low, high = SUPPORTED_JAXLIB
    if low <= version_tuple(version)[:2] < high:
        return None
    return (f"jaxlib {version} is not supported: hlo-shard needs {SUPPORTED_TEXT} "
            f"(pip install '{SUPPORTED_TEXT}'), or set {ALLOW_UNSUPPORTED_ENV}=1 to try anyway")


def version_refusal() -> str | None:
    """Why the installed jaxlib is not used: None where it is supported or the user set
    :data:`ALLOW_UNSUPPORTED_ENV` (what the runtime, ``shard_weight_update`` and
    ``install()`` all check)."""
    import jaxlib.version

    problem = unsupported_version_message(jaxlib.version.__version__)
    return None if os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1" else problem


# ------------------------------------------------------------------------- runtime


class UsageError(Exception):
    """A request the runtime refuses (not an XLA failure)."""


class Runtime:
    """Compiled executables of one backend and device count, addressed by handle."""

    def __init__(self, backend: str, device_count: int) -> None:
        problem = version_refusal()
        if problem is not None:
            raise UsageError(problem)
        import jax
        import numpy as np
        from jax._src.lib import xla_client as xc  # private API, see module docstring

        self.jax, self.np, self.xc = jax, np, xc
        try:
            available = jax.devices(backend)
        except RuntimeError as err:
            raise UsageError(f"backend {backend!r} is not available to jax: "
                             f"{str(err).splitlines()[0]}") from None
        if len(available) < device_count:
            raise UsageError(f"{device_count} devices requested but the {backend} backend "
                             f"has only {len(available)}")
        self.devices = available[:device_count]
        if backend == "cpu":
            _initialize_lapack()
        self.executables: dict[int, tuple[Any, list]] = {}
        self.next_handle = 1
        # (text digest, replicas) → handle; the compile reply of each handle; users.
        self.by_source: dict[tuple[str, int], int] = {}
        self.replies: dict[int, dict] = {}
        self.users: collections.Counter[int] = collections.Counter()
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()

    # The shim: one function per API that moved between jaxlib releases -----------
    def _parse(self, text: str) -> Any:
        hlo = getattr(self.xc, "hlo", None)
        if hlo is not None and hasattr(hlo, "hlo_module_from_text"):
            return hlo.hlo_module_from_text(text)
        return self.xc._xla.hlo_module_from_text(text)

    def _compile(self, mlir: str, devices: list, options: Any) -> Any:
        client = devices[0].client
        if hasattr(client, "compile_and_load"):
            return client.compile_and_load(mlir, self.xc.DeviceList(tuple(devices)), options)
        return client.compile(mlir, options)

    def _module_cost(self, module: Any) -> dict[str, float]:
        analysis = getattr(self.xc._xla, "hlo_module_cost_analysis", None)
        if analysis is None:
            return {}
        return _cost_if_implemented(lambda: analysis(self.devices[0].client, module))

    def describe(self) -> dict:
        import jaxlib.version

        first = self.devices[0]
        return {"jax": self.jax.__version__, "jaxlib": jaxlib.version.__version__,
                "platform": first.platform, "device_kind": first.device_kind,
                "device_count": len(self.devices)}

    # Requests --------------------------------------------------------------------
    def compile(self, text: str, replicas: int) -> dict:
        """Compile replica-form text for ``replicas`` devices (one partition each),
        or hand out another use of an identical executable compiled before."""
        if replicas > len(self.devices):
            raise UsageError(f"module needs {replicas} devices; this worker has "
                             f"{len(self.devices)}")
        key = (hashlib.sha256(text.encode()).hexdigest(), replicas)
        handle = self.by_source.get(key)
        if handle is None:
            handle = self._compile_new(text, replicas)
            self.by_source[key] = handle
        self.idle.pop(handle, None)
        self.users[handle] += 1
        return self.replies[handle]

    def _compile_new(self, text: str, replicas: int) -> int:
        xc, np = self.xc, self.np
        module = self._parse(text)
        computation = xc.XlaComputation(module.as_serialized_hlo_module_proto())
        mlir = xc._xla.mlir.xla_computation_to_mlir_module(computation)
        options = xc.CompileOptions()
        build = options.executable_build_options
        build.num_replicas = replicas
        build.num_partitions = 1
        devices = self.devices[:replicas]
        build.device_assignment = xc.DeviceAssignment.create(
            np.array([[device.id] for device in devices]))
        started = time.perf_counter()
        executable = self._compile(mlir, devices, options)
        compile_seconds = time.perf_counter() - started
        handle = self.next_handle
        self.next_handle += 1
        self.executables[handle] = (executable, devices)
        self.replies[handle] = {
            "handle": handle, "compile_seconds": compile_seconds,
            "memory": _memory_stats(executable.get_compiled_memory_stats()),
            "cost": self._module_cost(module),
            "compiled_cost": _cost_if_implemented(executable.cost_analysis)}
        return handle

    def cost(self, text: str) -> dict[str, float]:
        """``hlo_module_cost_analysis`` of the text as written, without compiling it
        (so it works for modules XLA will not compile again, e.g. optimized dumps)."""
        return self._module_cost(self._parse(text))

    def _arrays(self, devices: list, per_parameter: list[list]) -> list:
        """One jax.Array per parameter holding each device's own value."""
        jax = self.jax
        mesh = jax.sharding.Mesh(self.np.array(devices), ("d",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        arrays = []
        for values in per_parameter:
            if len(values) != len(devices):
                raise UsageError(f"{len(values)} values given for {len(devices)} devices")
            buffers = [jax.device_put(v, d) for v, d in zip(values, devices)]
            arrays.append(jax.make_array_from_single_device_arrays(
                self.np.shape(values[0]), replicated, buffers))
        return arrays

    def _executable(self, handle: int) -> Any:
        if handle not in self.executables:
            raise UsageError(f"no executable with handle {handle}")
        return self.executables[handle]

    def execute(self, handle: int, arguments: list[list]) -> list[list]:
        executable, devices = self._executable(handle)
        result = executable.execute_sharded(self._arrays(devices, arguments))
        return [[self.np.asarray(x) for x in leaf]
                for leaf in result.disassemble_into_single_device_arrays()]

    def time(self, handles: list[int], arguments: list[list[list]], runs: int,
             warmup: int, feedback: list[list[tuple[int, int]]] | None = None,
             pipelined: int = 1) -> list[list[float]]:
        """Wall seconds per run of each executable, interleaved A, B, A, B … so that
        machine noise hits all of them alike; the first ``warmup`` rounds are dropped.
        Inputs are placed once. ``feedback[slot]``: (output, parameter) pairs of an
        executable compiled with donation; each run consumes those parameters, and the
        outputs become the next run's (a training loop, timed as a user runs it).
        ``pipelined``: each run is that many steps launched back to back and waited for
        once, its time their mean: a loop dispatched asynchronously, as jax runs one on an
        accelerator, where waiting after every step adds the host's round trip (and its
        jitter) to each."""
        feedback = feedback or [[] for _ in handles]
        prepared = []
        for handle, args in zip(handles, arguments):
            executable, devices = self._executable(handle)
            prepared.append((executable, self._arrays(devices, args)))
        #: (shape, sharding) of each parameter: a donated array is gone after its run.
        layouts = [[(a.shape, a.sharding) for a in arrays] for _, arrays in prepared]
        times: list[list[float]] = [[] for _ in handles]
        for round_number in range(warmup + runs):
            for slot, (executable, arrays) in enumerate(prepared):
                started = time.perf_counter()
                for _ in range(pipelined):
                    result = executable.execute_sharded(arrays)
                    outputs = result.disassemble_into_single_device_arrays()
                    for output, parameter in feedback[slot]:
                        shape, sharding = layouts[slot][parameter]
                        arrays[parameter] = self.jax.make_array_from_single_device_arrays(
                            shape, sharding, outputs[output])
                self.jax.block_until_ready(outputs)
                elapsed = (time.perf_counter() - started) / pipelined
                if round_number >= warmup:
                    times[slot].append(elapsed)
        return times

    def release(self, handle: int) -> None:
        """One user fewer; unused executables stay idle for reuse, oldest dropped."""
        if self.users[handle] <= 0:
            return
        self.users[handle] -= 1
        if self.users[handle]:
            return
        self.idle[handle] = None
        while len(self.idle) > IDLE_EXECUTABLES_KEPT:
            oldest, _ = self.idle.popitem(last=False)
            self.executables.pop(oldest, None)
            self.replies.pop(oldest, None)
            del self.users[oldest]
            self.by_source = {k: h for k, h in self.by_source.items() if h != oldest}


def _initialize_lapack() -> None:
    """Point XLA:CPU's LAPACK custom calls (``lapack_*geqrf``, ``*gesdd``: a QR or SVD in
    the step) at their routines. jax does so when it lowers such an op; a module read as
    text never went through that, and its first LAPACK call jumps through an unset
    pointer (SIGSEGV). jax's export path makes the same call for the same reason."""
    try:
        from jax._src.lax import linalg  # private API, see module docstring
    except ImportError:
        return
    initialize = getattr(linalg, "initialize_lapack", None)
    if initialize is not None:
        initialize()


def _cost_if_implemented(analysis: Callable[[], Any]) -> dict[str, float]:
    """XLA's cost analysis as floats, or nothing where the backend has none: a PJRT
    plugin's client (XLA GPU through the C API) answers UNIMPLEMENTED, and the costs
    are figures beside the run, never a reason to refuse the module."""
    try:
        cost = analysis()
    except Exception as err:  # noqa: BLE001 - jaxlib's runtime error, by its status
        if str(err).startswith("UNIMPLEMENTED"):
            return {}
        raise
    if isinstance(cost, list):  # one per executable in older jaxlibs
        cost = cost[0] if cost else {}
    return {key: float(value) for key, value in (cost or {}).items()}


def _memory_stats(stats: Any) -> dict[str, int]:
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes")
    return {name: int(getattr(stats, name)) for name in fields if hasattr(stats, name)}


def _error_reply(err: BaseException) -> dict:
    kind = "usage" if isinstance(err, UsageError) else "xla"
    if type(err).__name__ not in ("JaxRuntimeError", "XlaRuntimeError", "UsageError"):
        kind = "internal"
    return {"ok": False, "kind": kind, "error": str(err) or type(err).__name__,
            "type": type(err).__name__}


def serve(requests: BinaryIO, replies: BinaryIO, backend: str, device_count: int) -> None:
    try:
        runtime = Runtime(backend, device_count)
    except Exception as err:  # noqa: BLE001 - every failure goes back to the parent
        write_message(replies, _error_reply(err))
        return
    write_message(replies, {"ok": True, "result": runtime.describe()})
    #: The request's fields are the handler's keyword arguments; its result is pickled.
    handlers: dict[str, Callable[..., object]] = {"compile": runtime.compile, "execute": runtime.execute, "cost": runtime.cost,
                "time": runtime.time, "release": runtime.release,
                "ping": lambda: "pong"}
    while (request := read_message(requests)) is not None:
        op = request.pop("op")
        try:
            reply = {"ok": True, "result": handlers[op](**request)}
        except Exception as err:  # noqa: BLE001 - reported, the worker lives on
            reply = _error_reply(err)
        write_message(replies, reply)


def limit_memory(limit: int) -> None:
    """Cap the address space so that a runaway compile fails with an allocation error
    (reported with the limit) instead of waking the OOM killer."""
    if limit > 0:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main(argv: list[str]) -> None:
    # The parent owns interruption: on Ctrl-C it kills us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    request_fd, reply_fd, backend, device_count, parent, memory = argv
    from _lifeline import die_with_parent  # this script's folder is sys.path[0]

    die_with_parent(int(request_fd), int(parent))
    limit_memory(int(memory))
    with os.fdopen(int(request_fd), "rb") as requests, \
            os.fdopen(int(reply_fd), "wb") as replies:
        serve(requests, replies, backend, int(device_count))


if __name__ == "__main__":
    main(sys.argv[1:])
