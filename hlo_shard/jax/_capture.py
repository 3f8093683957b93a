"""Capturing the per-device module of a ``jax.jit`` step after SPMD partitioning.

``jitted.lower(*args).as_text()`` is the *global* program: its gradient all-reduces
only appear during partitioning. So the step is compiled once with per-compile dump
options (``compiler_options``; process-wide ``XLA_FLAGS`` stay untouched) into a
private temporary folder, removed right after, and the partitioner's output is read
back: the ``*.spmd-partitioner.after_call-inliner.before_pipeline-end.txt`` stage
(shard_map bodies inlined), else ``after_spmd-partitioning``. On XLA:CPU that compile
stops once the step is partitioned (:class:`~._xla.PartitionStop`): the backend's code
generation, most of a compile, would be thrown away where the pass shards the step, so
jit's own executable (:class:`JitStep`) is compiled only where ``fast`` falls back to
it. Elsewhere the compile runs to the end (the dump options change no code) and
its executable is the one a fallback runs, rather than jit compiling the step again.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import stat
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from collections.abc import Iterator
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
    #: jax could not lower the step for capture (its own call runs it), or compiling the
    #: lowered step for its per-device module failed.
    CAPTURE_FAILED = "capture_failed"
    #: hlo-shard could not read the captured module.
    PARSE_FAILED = "parse_failed"
    #: The pass, its never-slower gate or its output checks failed.
    PASS_FAILED = "pass_failed"
    #: XLA did not compile the optimized module.
    COMPILE_FAILED = "compile_failed"
    #: The optimized step's first run failed.
    RUN_FAILED = "run_failed"
    #: Under ``jax.distributed`` the processes did not all build the same optimized step
    #: (other options or another release in one, one running ``fn``, one that did not
    #: build it in time): every process runs ``fn``.
    PROCESSES_DISAGREE = "processes_disagree"
    #: The installed jaxlib is outside the range hlo-shard is tested with (the private
    #: APIs it uses may differ); ``HLO_SHARD_ALLOW_UNSUPPORTED_JAX=1`` tries it.
    UNSUPPORTED_JAX = "unsupported_jax"


class Unsupported(Exception):
    """Why the optimized path cannot run this step (``fast`` then runs ``fn`` itself):
    a :class:`Reason` and the words; ``report``/``decision``/``names``: what the pass and
    its gate said, and the user's names of the module, when they ran."""

    def __init__(self, message: str, code: Reason = Reason.UNSUPPORTED_STEP,
                 report: Any = None, decision: Any = None, names: Any = None) -> None:
        super().__init__(message)
        self.code, self.report, self.decision = code, report, decision
        #: The user's names of the captured module (each row's ``gradient_of``), where
        #: the pass ran.
        self.names = names
        #: What the first call spent before it fell back (set by ``ShardedStep``).
        self.seconds: FirstCallSeconds | None = None
        #: jit's step, where the capture compiled (or started compiling) it: ``fast``
        #: runs its executable.
        self.jit: JitStep | None = None
        #: jit's lowering of the step, where the capture failed after it (under
        #: ``jax.distributed`` the other processes learn from it that this one runs
        #: ``fn``).
        self.lowered: Any = None


@dataclass
class JitStep:
    """jit's own executable of one signature: the capture's where its compile ran to the
    end, else compiled from the capture's lowering the first time a fallback needs it
    (no second lowering)."""

    lowered: Any
    compiled: Any = None

    def executable(self) -> Any:
        if self.compiled is None:
            self.compiled = self.lowered.compile()
        return self.compiled


class StageSeconds:
    """Seconds per stage (a dataclass's float fields), filled as the stages run, so a
    run cut short says how far it got."""

    @contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        """Add the block's seconds to ``stage`` (a field's name), even if it raises."""
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, stage, getattr(self, stage) + time.perf_counter() - started)


@dataclass
class FirstCallSeconds(StageSeconds):
    """Where a signature's first call spends its time, beyond jit's own work: the
    ``capture`` (jit's lowering and its compile with the dump options up to the
    partitioned module, reading it), the ``pass`` (parse, the optimizer with its gate
    and output checks) and the ``compile`` of the optimized module, or where the step
    falls back after a stopped capture, of jit's own."""

    capture: float = 0.0
    pass_: float = 0.0
    compile: float = 0.0

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
    #: jit's lowering and executable of the step (what ``fast`` runs where it falls back).
    jit: JitStep
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
    jit = None
    try:
        _check_supported(lowered)  # before compiling: jit compiles what fn runs then
        jit = JitStep(lowered)
        text, in_shardings, out_shardings = _compile_with_dumps(jit)
        return _capture_of(jit, text, in_shardings, out_shardings)
    except Unsupported as why:
        why.jit, why.lowered = jit, lowered
        raise
    except Exception as err:  # noqa: BLE001 - our capture never breaks the loop
        failed = Unsupported(f"capturing the per-device module failed: {describe(err)}",
                             Reason.CAPTURE_FAILED)
        failed.jit, failed.lowered = jit, lowered
        raise failed from err


def _check_supported(lowered: Any) -> None:
    facts = _xla.lowering_facts(lowered)
    for fact, reason in (("ordered_effects", "it has ordered side effects"),
                         ("host_callbacks", "it calls back into Python (jax.debug.print, "
                          "jax.debug.callback, io_callback, pure_callback: a module compiled "
                          "from its text cannot reach them; install() shards such a step "
                          "inside jit's own compile, or return the values to log from the "
                          "step instead)"),
                         ("tuple_args", "jit passes its arguments as one tuple"),
                         ("const_args", "jit hoisted constants into extra arguments")):
        if facts[fact]:
            raise Unsupported(f"the step is not supported: {reason}",
                              Reason.UNSUPPORTED_STEP)


#: The dump folder's name: this host and process in it, so that a later capture can
#: remove one a killed process left behind (SIGKILL skips the ``finally``).
_FOLDER_PREFIX = "hlo-shard-capture-"


def _capture_folder() -> Path:
    """A fresh folder for XLA's dump of one capture, after removing this host's
    leftovers (:func:`_sweep_leftovers`)."""
    own = f"{_FOLDER_PREFIX}{socket.gethostname()}-"
    _sweep_leftovers(Path(tempfile.gettempdir()), own)
    return Path(tempfile.mkdtemp(prefix=f"{own}{os.getpid()}-"))


def _sweep_leftovers(root: Path, own: str) -> None:
    """Remove the capture folders under ``root`` named ``own`` + pid that this user's
    processes on this host left and that are gone (a pid alive, reused or not, keeps
    its folder; another host's or user's is never touched)."""
    for folder in root.glob(glob.escape(own) + "*-*"):
        pid = folder.name[len(own):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            info = folder.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's, or not ours to ask: alive
        return True
    return True


def _compile_with_dumps(jit: JitStep) -> tuple[str, tuple, tuple]:
    """The partitioned module jit's compile dumped, and jit's flat input and output
    shardings (the partitioner's choices); ``jit.compiled`` set where the compile ran to
    the end."""
    import jax

    folder = _capture_folder()
    try:
        jit.compiled, partitioned = _xla.compile_or_stop(
            jit.lowered, {**DUMP_OPTIONS, "xla_dump_to": str(folder)}, folder)
        text = _read_stage(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if partitioned is not None:
        try:
            return (text, *_xla.partitioned_shardings(jit.lowered, partitioned))
        except Exception:  # noqa: BLE001 - jax's naming moved: its executable names them
            pass
    compiled = jit.executable()
    # flatten_up_to: a pruned argument's sharding is None, not a subtree
    return (text, tuple(jit.lowered.in_tree.flatten_up_to(compiled.input_shardings)),
            tuple(jax.tree.leaves(compiled.output_shardings)))


def _capture_of(jit: JitStep, text: str, in_shardings: tuple, out_shardings: tuple
                ) -> Capture:
    import jax

    lowered = jit.lowered
    arg_infos = jax.tree.leaves(lowered.args_info)
    kept = _xla.kept_argument_indices(lowered)
    kept = tuple(range(len(arg_infos))) if kept is None else kept
    out_avals, out_tree = jax.tree.flatten(lowered.out_info)
    return Capture(text, jit, kept, in_shardings,
                   tuple(tuple(info.shape) for info in arg_infos),
                   tuple(info.donated for info in arg_infos),
                   tuple(jax.dtypes.issubdtype(info.dtype, jax.dtypes.extended)
                         for info in arg_infos), tuple(out_avals),
                   tuple(out_shardings), out_tree, _xla.device_assignment(lowered))


def _read_stage(folder: Path) -> str:
    """The partitioned module in ``folder`` (only this compile dumps there)."""
    try:
        return pick_dump_file(folder).read_text()
    except HloShardError:
        raise Unsupported("XLA wrote no SPMD-partitioned module for the step (is it "
                          "compiled for more than one device?)", Reason.UNSUPPORTED_STEP) from None
