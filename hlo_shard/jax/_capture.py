"""Capturing the per-device module of a ``jax.jit`` step after SPMD partitioning.

``jitted.lower(*args).as_text()`` is the *global* program: its gradient all-reduces
only appear during partitioning. So the step is compiled once with per-compile dump
options (``compiler_options``; process-wide ``XLA_FLAGS`` stay untouched) into a
private temporary folder, removed right after, and the partitioner's output is read
back: the ``*.spmd-partitioner.after_call-inliner.before_pipeline-end.txt`` stage
(shard_map bodies inlined), else ``after_spmd-partitioning``. That compile is jit's own
(the dump options change no code): where ``fast`` runs ``fn`` for the signature, it runs
this executable rather than having jit compile the step a second time.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

from hlo_shard.dumps import pick_dump_file
from hlo_shard.errors import HloShardError
from hlo_shard.jax import _xla

#: The dump options one capture compiles with (into the capture's own folder).
DUMP_OPTIONS = {"xla_dump_hlo_pass_re": "spmd-partitioning|call-inliner",
                "xla_dump_large_constants": True}


class Reason(str, Enum):
    """Why ``fast`` runs the original step: the code ``fast.report["fallback"]`` names
    (the warning's text says the details)."""

    #: The never-slower gate kept the step whole (the report has both estimates).
    NOT_FASTER = "not_faster"
    #: No data-parallel gradient all-reduce, or the pass refused every one.
    NOTHING_TO_SHARD = "nothing_to_shard"
    #: The step has a feature the path cannot run (effects, host callbacks, for
    #: ``state="sharded"`` a state leaf whose blocks do not follow its gradient's groups...).
    UNSUPPORTED_STEP = "unsupported_step"
    #: Capturing the per-device module failed (jax's lowering itself succeeded).
    CAPTURE_FAILED = "capture_failed"
    #: hlo-shard could not read the captured module.
    PARSE_FAILED = "parse_failed"
    #: The pass, its never-slower gate or its output checks failed.
    PASS_FAILED = "pass_failed"
    #: XLA did not compile the optimized module.
    COMPILE_FAILED = "compile_failed"
    #: The optimized step's first run failed.
    RUN_FAILED = "run_failed"


class Unsupported(Exception):
    """Why the optimized path cannot run this step (``fast`` then runs ``fn`` itself):
    a :class:`Reason` and the words; ``report``/``decision``: what the pass and its gate
    said, when they ran."""

    def __init__(self, message: str, code: Reason = Reason.UNSUPPORTED_STEP,
                 report: Any = None, decision: Any = None) -> None:
        super().__init__(message)
        self.code, self.report, self.decision = code, report, decision
        #: What the first call spent before it fell back (set by ``ShardedStep``).
        self.seconds: FirstCallSeconds | None = None
        #: jit's executable of the step, where the capture compiled it (``fast`` runs it).
        self.compiled: Any = None


@dataclass
class FirstCallSeconds:
    """Where a signature's first call spends its time, beyond jit's own work: the
    ``capture`` (jit's lowering and compile with the dump options, reading the
    partitioned module), the ``pass`` (parse, the optimizer with its gate and output
    checks) and the ``compile`` of the optimized module. Filled as the stages run, so
    a fallback says how far it got."""

    capture: float = 0.0
    pass_: float = 0.0
    compile: float = 0.0

    @contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        """Add the block's seconds to ``stage`` (a field's name), even if it raises."""
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, stage, getattr(self, stage) + time.perf_counter() - started)

    def to_json(self) -> dict[str, float]:
        return {"capture": self.capture, "pass": self.pass_, "compile": self.compile}


def describe(err: BaseException) -> str:
    """One line for a warning: the exception's type and its message's first line."""
    lines = str(err).splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


@dataclass(frozen=True)
class Capture:
    """One argument signature of the step, as jit compiled it."""

    #: The per-device module after SPMD partitioning.
    text: str
    lowered: Any
    #: jit's executable of the step (what ``fast`` runs where it falls back).
    compiled: Any
    #: Flat dynamic-argument indices the module takes, in parameter order.
    kept: tuple[int, ...]
    #: Per flat dynamic argument: jit's input sharding, whether donated, whether an
    #: extended dtype (a typed PRNG key: the executable takes its base array).
    in_shardings: tuple
    #: Per flat dynamic argument: its global shape, as ``fn`` takes it.
    in_shapes: tuple[tuple[int, ...], ...]
    donated: tuple[bool, ...]
    opaque: tuple[bool, ...]
    #: Per flat output: aval (shape, dtype) and sharding; the outputs' tree.
    out_avals: tuple
    out_shardings: tuple
    out_tree: Any
    #: jit's device assignment: partition k runs on devices[k].
    devices: tuple


def capture(jitted: Any, args: tuple, kwargs: dict) -> Capture:
    """Lower and compile ``jitted`` for these arguments, reading the partitioned module.
    jax's errors in lowering (the user's function traced) propagate as jit raises them;
    anything failing after that is :class:`Unsupported` (``fast`` runs ``fn``), with
    jit's executable where the compile succeeded."""
    lowered = jitted.lower(*args, **kwargs)
    compiled = None
    try:
        _check_supported(lowered)  # before compiling: jit compiles what fn runs then
        compiled, text = _compile_with_dumps(lowered)
        return _capture_of(lowered, compiled, text)
    except Unsupported as why:
        if compiled is not None:  # (a module not read keeps the executable it came with)
            why.compiled = compiled
        raise
    except Exception as err:  # noqa: BLE001 - our capture never breaks the loop
        failed = Unsupported(f"capturing the per-device module failed: {describe(err)}",
                             Reason.CAPTURE_FAILED)
        failed.compiled = compiled
        raise failed from err


def _check_supported(lowered: Any) -> None:
    facts = _xla.lowering_facts(lowered)
    for fact, reason in (("ordered_effects", "it has ordered side effects"),
                         ("host_callbacks", "it calls back into Python"),
                         ("tuple_args", "jit passes its arguments as one tuple"),
                         ("const_args", "jit hoisted constants into extra arguments")):
        if facts[fact]:
            raise Unsupported(f"the step is not supported: {reason}",
                              Reason.UNSUPPORTED_STEP)


def _compile_with_dumps(lowered: Any) -> tuple[Any, str]:
    """jit's executable, and the partitioned module its compile dumped."""
    folder = tempfile.mkdtemp(prefix="hlo-shard-capture-")
    try:
        compiled = lowered.compile(compiler_options={**DUMP_OPTIONS, "xla_dump_to": folder})
        try:
            return compiled, _read_stage(Path(folder))
        except Unsupported as why:
            why.compiled = compiled
            raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _capture_of(lowered: Any, compiled: Any, text: str) -> Capture:
    import jax

    arg_infos = jax.tree.leaves(lowered.args_info)
    kept = _xla.kept_argument_indices(lowered)
    kept = tuple(range(len(arg_infos))) if kept is None else kept
    out_shardings = jax.tree.leaves(compiled.output_shardings)
    out_avals, out_tree = jax.tree.flatten(lowered.out_info)
    return Capture(text, lowered, compiled, kept,
                   # flatten_up_to: a pruned argument's sharding is None, not a subtree
                   tuple(lowered.in_tree.flatten_up_to(compiled.input_shardings)),
                   tuple(tuple(info.shape) for info in arg_infos),
                   tuple(info.donated for info in arg_infos),
                   tuple(jax.dtypes.issubdtype(info.dtype, jax.dtypes.extended)
                         for info in arg_infos), tuple(out_avals),
                   tuple(out_shardings), out_tree, _xla.device_assignment(lowered))


def per_device_hlo(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """The per-device module of ``fn`` (jitted, or jitted here) for these arguments, as
    ``hlo-shard optimize`` reads it. Compiles ``fn`` once (no computation runs)."""
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        return capture(jitted, args, kwargs).text
    except Unsupported as why:
        raise HloShardError(str(why)) from None


def _read_stage(folder: Path) -> str:
    """The partitioned module in ``folder`` (only this compile dumps there)."""
    try:
        return pick_dump_file(folder).read_text()
    except HloShardError:
        raise Unsupported("XLA wrote no SPMD-partitioned module for the step (is it "
                          "compiled for more than one device?)", Reason.UNSUPPORTED_STEP) from None
