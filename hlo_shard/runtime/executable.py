"""A compiled module on N devices: call it, time it, read XLA's figures.

:func:`load` parses (if needed), converts to replica form (:mod:`.forms`) and compiles
in a pooled worker (:mod:`.worker`). The handle recompiles by itself if its worker
died (a crash in another module) and was restarted.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlo_shard.costmodel.kernels import is_prefused
from hlo_shard.errors import HloRuntimeError, HloShardError
from hlo_shard.ir import ArrayShape, Module
from hlo_shard.runtime.forms import replica_form
from hlo_shard.runtime.inputs import DeviceValues, coerce_argument, output_shapes, parameter_shapes
from hlo_shard.runtime.worker import DEFAULT_TIMEOUT, Worker, get_worker

#: What a rejected module holding fusion instructions is told: XLA's fused modules (what
#: ``install()`` hands the pass, XLA's optimized dumps) are generally not compiled again.
FUSED_MODULE_HINT = (
    "the module holds fusions, as XLA's own fused modules do (what install() hands the pass, "
    "XLA's optimized dumps), which XLA may not compile again: verify the module from "
    "before XLA's optimization (the *.spmd-partitioner.after_call-inliner... dump), or check "
    "a hook's rewrite by running the step under install() against plain jit")


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """XLA's ``CompiledMemoryStats``, per device, in bytes."""

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int
    #: ``peak_memory_in_bytes`` (None where jaxlib does not report it).
    peak: int | None

    @classmethod
    def from_worker(cls, raw: dict[str, int]) -> MemoryStats:
        return cls(raw.get("argument_size_in_bytes", 0), raw.get("output_size_in_bytes", 0),
                   raw.get("alias_size_in_bytes", 0), raw.get("temp_size_in_bytes", 0),
                   raw.get("generated_code_size_in_bytes", 0), raw.get("peak_memory_in_bytes"))

    def to_json(self) -> dict:
        return {"argument_bytes": self.argument, "output_bytes": self.output,
                "alias_bytes": self.alias, "temp_bytes": self.temp,
                "generated_code_bytes": self.generated_code, "peak_bytes": self.peak}


@dataclass(frozen=True, slots=True)
class Timing:
    """Wall seconds of each timed step (after warm-up) of one executable."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def minimum(self) -> float:
        return min(self.seconds)

    def to_json(self) -> dict:
        return {"median_s": self.median, "min_s": self.minimum, "runs": len(self.seconds)}


def read_module(source: str | Path | Module) -> Module:
    """A Module from a Module, a path, or HLO text (a string with a newline or an
    ``HloModule`` header is text; any other string is a path)."""
    from hlo_shard.parser import parse, parse_file

    if isinstance(source, Module):
        return source
    if isinstance(source, Path) or ("\n" not in source and not source.lstrip().startswith(
            ("HloModule", "ENTRY"))):
        return parse_file(source)
    return parse(source)


@dataclass(eq=False)
class Executable:
    """A module compiled for ``devices`` devices of ``backend``.

    ``exe(*args)`` runs one step: each argument is one value for all devices
    (replicated: numpy, jax array or scalar) or a list/tuple of one value per device.
    It returns ``outputs[leaf][device]`` as numpy arrays.
    """

    source: Module
    #: The replica-form module actually compiled.
    module: Module
    devices: int
    worker: Worker
    timeout: float = DEFAULT_TIMEOUT
    memory: MemoryStats = field(init=False)
    #: ``hlo_module_cost_analysis`` of the module as written (before XLA's passes);
    #: empty where the backend has none (a PJRT plugin: XLA GPU through the C API).
    cost: dict[str, float] = field(init=False)
    #: ``LoadedExecutable.cost_analysis()`` of the optimized module (empty likewise).
    compiled_cost: dict[str, float] = field(init=False)
    compile_seconds: float = field(init=False)
    _handle: int = field(init=False, default=0)
    _generation: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        self.parameters: list[ArrayShape] = parameter_shapes(self.module)
        self.outputs: list[ArrayShape] = output_shapes(self.module)
        self._compile()

    @property
    def name(self) -> str:
        return self.source.source_path or self.source.name

    @property
    def backend(self) -> str:
        return self.worker.backend

    def _compile(self) -> None:
        from hlo_shard.printer import to_text

        try:
            reply = self.worker.request("compile", self.timeout, f"compiling {self.name}",
                                        text=to_text(self.module, for_xla=True),
                                        replicas=self.devices)
        except HloRuntimeError as err:
            if not is_prefused(self.module):
                raise
            raise HloRuntimeError(f"{err} ({FUSED_MODULE_HINT})") from None
        self._handle = reply["handle"]
        self._generation = self.worker.generation
        self.memory = MemoryStats.from_worker(reply["memory"])
        self.cost = reply["cost"]
        self.compiled_cost = reply["compiled_cost"]
        self.compile_seconds = reply["compile_seconds"]

    def _ensure_compiled(self) -> int:
        if self._generation != self.worker.generation or not self.worker.alive:
            self.worker.start()
            self._compile()
        return self._handle

    def arguments(self, args: Sequence) -> list[DeviceValues]:
        """Normalise call arguments to ``values[parameter][device]``."""
        if len(args) != len(self.parameters):
            raise HloShardError(f"{self.name} takes {len(self.parameters)} parameters, "
                                f"{len(args)} given")
        return [coerce_argument(value, shape, self.devices, number)
                for number, (value, shape) in enumerate(zip(args, self.parameters))]

    def run(self, inputs: Sequence[DeviceValues]) -> list[DeviceValues]:
        """Execute once on ``inputs[parameter][device]``; ``outputs[leaf][device]``."""
        handle = self._ensure_compiled()
        return self.worker.request("execute", self.timeout, f"running {self.name}",
                                   handle=handle, arguments=[list(v) for v in inputs])

    def __call__(self, *args: Any) -> list[DeviceValues]:
        return self.run(self.arguments(args))

    def time(self, *args: Any, runs: int = 10, warmup: int = 2, pipelined: int = 1) -> Timing:
        return time_interleaved([self], [self.arguments(args)], runs, warmup, pipelined)[0]

    def close(self) -> None:
        """Free the compiled executable in the worker (the worker keeps running)."""
        if self._generation == self.worker.generation and self.worker.alive:
            self.worker.request("release", self.timeout, handle=self._handle)
        self._generation = -1


def load(source: str | Path | Module, devices: int | None = None, backend: str | None = None, *,
         worker: Worker | None = None, timeout: float = DEFAULT_TIMEOUT,
         donate: bool = False) -> Executable:
    """Parse, convert to replica form and compile ``source`` for ``devices`` devices
    (default: the module's ``replica_count``/``num_partitions``) on ``backend``
    (default: ``worker``'s, else CPU). A module written for one device may run on
    several (as replicas); one written for N runs on exactly N.

    ``donate`` keeps the module's ``input_output_alias``: each run then consumes its
    donated inputs, as a training step does, and :func:`time_interleaved` feeds every
    aliased output back as the next run's parameter (a training loop). Without it,
    inputs stay valid and every run computes the same step."""
    module = read_module(source)
    devices = devices or module.device_count
    written_for = module.device_count
    if written_for > 1 and devices != written_for:
        raise HloShardError(f"{module.source_path or module.name} is written for "
                            f"{written_for} devices, not {devices}")
    executable_form = replica_form(module, keep_donation=donate, replicas=devices)
    if worker is None:
        worker = get_worker(backend or "cpu", devices, timeout)
    elif backend not in (None, worker.backend):
        raise HloShardError(f"the worker given runs {worker.backend}, not {backend}")
    return Executable(module, executable_form, devices, worker, timeout)


def module_cost(source: str | Path | Module, backend: str = "cpu", *,
                worker: Worker | None = None, timeout: float = DEFAULT_TIMEOUT
                ) -> dict[str, float]:
    """XLA's ``hlo_module_cost_analysis`` of ``source`` as written (flops,
    transcendentals, bytes accessed …), without compiling: cheaper than :func:`load`
    and it also works on modules XLA refuses to compile again."""
    from hlo_shard.printer import to_text

    module = read_module(source)
    worker = worker or get_worker(backend, 1, timeout)
    return worker.request("cost", timeout, f"cost analysis of {module.source_path or module.name}",
                          text=to_text(module, for_xla=True))


def time_interleaved(executables: Sequence[Executable], inputs: Sequence[Sequence[DeviceValues]],
                     runs: int = 10, warmup: int = 2, pipelined: int = 1) -> list[Timing]:
    """Median-ready step times of several executables sharing one worker, run
    interleaved A, B, A, B … after ``warmup`` untimed rounds; an executable loaded with
    ``donate=True`` runs as a training loop (its aliased outputs fed back).
    ``pipelined``: each run the mean of that many steps launched back to back and
    waited for once (an asynchronously dispatched loop)."""
    if runs < 1:
        raise HloShardError("timing needs at least one run")
    worker = executables[0].worker
    if any(e.worker is not worker for e in executables):
        raise HloShardError("interleaved timing needs executables of one worker")
    handles = [e._ensure_compiled() for e in executables]
    reply = worker.request("time", max(e.timeout for e in executables), "timing",
                           handles=handles, arguments=[[list(v) for v in i] for i in inputs],
                           runs=runs, warmup=warmup, pipelined=pipelined,
                           feedback=[list(e.module.output_aliases().items())
                                     for e in executables])
    return [Timing(tuple(seconds)) for seconds in reply]


