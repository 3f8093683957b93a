"""Run modules on the devices of several local processes joined by ``jax.distributed``.

A :class:`DistributedWorker` starts P processes (:mod:`._distributed_child`), each
owning N/P devices: CPU devices on this machine, the coordinator of
``jax.distributed`` on 127.0.0.1 at a free port, gloo collectives across processes.
Every module is compiled by every process for the *global* device set (replica k
on global device k, process p owning replicas p·N/P … (p+1)·N/P − 1) and every
execution is collective: each process gets the values of its own devices, and the
outputs come back in global device order.

It answers the requests of :class:`~hlo_shard.runtime.worker.Worker` (``compile``,
``execute``, ``time``, ``release``, ``cost``) with the same replies, so an
:class:`~hlo_shard.runtime.executable.Executable` and ``verify`` run on it unchanged
(``load(..., worker=DistributedWorker(2, 4))``, ``VerifyOptions(worker=…)``).

Failure is all-or-nothing. A process that exits (an XLA CHECK, a kill), answers
with an error while its peers wait in a collective, or does not answer within the
timeout stops *all* processes, and the error names the process and its last
stderr line. The processes die with this one (``PR_SET_PDEATHSIG`` and a lifeline
pipe), so none is ever left behind.

:func:`launch` runs a Python script the same way (P processes, N/P CPU devices
each, the same failure rules), passing it ``--coordinator ADDRESS --num-processes P
--process-id I``: the three values a script hands to ``jax.distributed.initialize``
on a real cluster too (docs/distributed.md).
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from collections.abc import Callable, Sequence

from hlo_shard.errors import HloRuntimeError, HloShardError
from hlo_shard.runtime import _child
from hlo_shard.runtime.worker import (
    DEFAULT_TIMEOUT, _crash_detail, _exit_cause, _first_lines, child_environment,
)

#: Seconds allowed for all processes to start jax, meet at the coordinator and report
#: their devices.
STARTUP_TIMEOUT = 120.0
#: Seconds the other processes get, after one fails, to show whether they failed too
#: (so that the process that died first is blamed, not a peer it took down).
FAILURE_GRACE_S = 0.5
#: Seconds each process gets to leave ``jax.distributed`` cleanly at close.
CLOSE_TIMEOUT_S = 15.0
_STDERR_LINES_KEPT = 200
#: Run as scripts (not imported here: they import ``_child``/``_lifeline`` from their
#: own folder, as the single-process child does).
_CHILD_SCRIPT = Path(__file__).with_name("_distributed_child.py")
_LAUNCHED_SCRIPT = Path(__file__).with_name("_launched.py")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def split_devices(device_count: int, processes: int) -> int:
    """Devices per process; refuses counts that do not divide evenly."""
    if processes < 1:
        raise HloShardError(f"--processes must be at least 1, not {processes}")
    if device_count < processes or device_count % processes:
        raise HloShardError(f"{device_count} device{'s' if device_count > 1 else ''} cannot "
                            f"be split evenly over {processes} processes; choose --devices "
                            f"as a multiple of --processes")
    return device_count // processes


@dataclass(eq=False)
class _Process:
    """One child: its lifeline, its stderr tail and, for a worker's child, its request
    and reply pipes and the reply being read."""

    index: int
    popen: subprocess.Popen
    lifeline_fd: int
    requests: Any = None
    replies_fd: int = -1
    stderr: collections.deque = field(default_factory=lambda: collections.deque(
        maxlen=_STDERR_LINES_KEPT))
    buffer: bytearray = field(default_factory=bytearray)

    def take_message(self) -> tuple[bool, Any]:
        """(True, message) once a whole framed message is buffered."""
        size = _child._HEADER.size
        if len(self.buffer) < size:
            return False, None
        (length,) = _child._HEADER.unpack(self.buffer[:size])
        if len(self.buffer) < size + length:
            return False, None
        message = pickle.loads(bytes(self.buffer[size:size + length]))
        del self.buffer[:size + length]
        return True, message

    def describe_failure(self, status: int | None) -> str:
        """Why it failed (``status``: its exit status when it was blamed, None if it
        was still running) and its last meaningful stderr line."""
        cause = "stopped answering" if status is None else _exit_cause(status).replace(
            "process ", "")
        detail = _crash_detail(list(self.stderr))
        return f"{cause}" + (f"; last stderr line: {detail}" if detail else "")


def _spawn(index: int, arguments: list[str], env: dict[str, str], pass_fds: tuple = (),
           stdout: int = subprocess.DEVNULL) -> _Process:
    """Start ``python -u ARGUMENTS…`` with a lifeline pipe: ``arguments[0]`` is a script
    taking the lifeline's fd and this process's pid as its first two arguments."""
    lifeline_read, lifeline_write = os.pipe()
    command = [sys.executable, "-u", arguments[0], str(lifeline_read), str(os.getpid()),
               *arguments[1:]]
    try:
        popen = subprocess.Popen(command, env=env, pass_fds=(lifeline_read, *pass_fds),
                                 stdin=subprocess.DEVNULL, stdout=stdout,
                                 stderr=subprocess.PIPE, close_fds=True)
    finally:
        os.close(lifeline_read)
    child = _Process(index, popen, lifeline_write)
    threading.Thread(target=_drain, args=(child,), daemon=True).start()
    return child


def _drain(child: _Process) -> None:
    stream = child.popen.stderr
    assert stream is not None, "_spawn pipes every child's stderr"
    for raw in iter(stream.readline, b""):
        child.stderr.append(raw.decode("utf-8", "replace").rstrip("\n"))
    stream.close()


def _blame(children: list[_Process], suspects: list[int], errors: dict[int, str]) -> str:
    """Stop every process and say why the run failed: a process that exited (within
    a short grace; failed ones first) if any did, else the suspects, with their errors
    or last lines."""
    time.sleep(FAILURE_GRACE_S)
    status = {c: c.popen.poll() for c in children}
    exited = [c for c, code in status.items() if code not in (None, 0)] or \
        [c for c, code in status.items() if code is not None]
    blamed = exited or [c for c in children if c.index in suspects]
    _kill_all(children)
    time.sleep(0.05)  # let the drain threads collect the last lines
    return "; ".join(f"process {c.index} of {len(children)} "
                     + (errors[c.index] if c not in exited and c.index in errors
                        else c.describe_failure(status[c])) for c in blamed) \
        + f" (all {len(children)} processes were stopped)"


# --------------------------------------------------------- splitting and combining


def _split_arguments(arguments: list, process: int, local: int) -> list:
    """``arguments[parameter][global device]`` → this process's devices' values."""
    return [list(values[process * local:(process + 1) * local]) for values in arguments]


def _split_timed(arguments: list, process: int, local: int) -> list:
    return [_split_arguments(per_executable, process, local) for per_executable in arguments]


#: How each request's fields are cut per process; other requests go to all as they are.
_SPLIT_FIELD: dict[str, tuple[str, Callable[[list, int, int], list]]] = {
    "execute": ("arguments", _split_arguments),
    "time": ("arguments", _split_timed),
}


def _concatenate_devices(replies: list) -> list:
    """``outputs[leaf][local device]`` of each process → ``outputs[leaf][global device]``."""
    return [[value for reply in replies for value in reply[leaf]]
            for leaf in range(len(replies[0]))]


def _slowest_process(replies: list) -> list:
    """Seconds per run of each executable: the slowest process's (a collective step
    ends when its last process is done)."""
    return [[max(runs) for runs in zip(*(reply[slot] for reply in replies))]
            for slot in range(len(replies[0]))]


#: How each request's replies become one; others take process 0's.
_COMBINE: dict[str, Callable[[list], Any]] = {
    "execute": _concatenate_devices,
    "time": _slowest_process,
}


# ------------------------------------------------------------------------ the worker


class DistributedWorker:
    """P local processes joined by ``jax.distributed``, used like a :class:`Worker`.

    ``device_count`` may be left None: the first ``compile`` request sets it to the
    module's replica count. Close it (or use it as a context manager) to stop the
    processes; interpreter exit closes it too.
    """

    def __init__(self, processes: int, device_count: int | None = None, backend: str = "cpu",
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        if backend != "cpu":
            raise HloShardError(
                f"--processes starts local CPU processes; for {backend} across hosts start "
                "one process per host with jax.distributed (see docs/distributed.md)")
        split_devices(device_count or processes, processes)
        self.processes = processes
        self.device_count = device_count
        self.backend = backend
        self.timeout = timeout
        self.generation = 0
        self.coordinator = ""
        self.info: dict[str, Any] = {}
        self._children: list[_Process] = []
        #: A request is in flight: the processes may be inside a collective.
        self._busy = False
        self._lock = threading.RLock()
        atexit.register(self.close)

    def __enter__(self) -> DistributedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def local_device_count(self) -> int:
        return split_devices(self._known_device_count(), self.processes)

    def _known_device_count(self) -> int:
        if self.device_count is None:
            raise HloShardError("the device count of a multi-process run is not known "
                                "yet; pass --devices")
        return self.device_count

    @property
    def alive(self) -> bool:
        return bool(self._children) and all(c.popen.poll() is None for c in self._children)

    @property
    def pids(self) -> list[int]:
        return [c.popen.pid for c in self._children]

    # Lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Start every process (if needed) and wait until all report their devices."""
        with self._lock:
            if self.alive:
                return
            self._known_device_count()
            self._stop()
            self.info = {}
            self.coordinator = f"127.0.0.1:{free_port()}"
            self._children = []
            for index in range(self.processes):
                self._children.append(self._spawn(index))
            self.generation += 1
            described = self._gather([True] * self.processes, STARTUP_TIMEOUT,
                                     f"starting {self.processes} jax.distributed processes")
            self.info = {**described[0], "coordinator": self.coordinator,
                         "local_device_ids": [d["local_device_ids"] for d in described]}

    def _spawn(self, index: int) -> _Process:
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        try:
            child = _spawn(index, [str(_CHILD_SCRIPT), str(request_read), str(reply_write),
                                   self.backend, self.coordinator, str(self.processes),
                                   str(index), str(self.device_count),
                                   str(int(STARTUP_TIMEOUT))],
                           child_environment(self.backend, self.local_device_count),
                           pass_fds=(request_read, reply_write))
        finally:
            os.close(request_read)
            os.close(reply_write)
        child.requests, child.replies_fd = os.fdopen(request_write, "wb"), reply_read
        return child

    def close(self) -> None:
        """Stop all processes: end of input (they leave jax.distributed together),
        then a kill for any that lingers; at once if a request was interrupted (they
        may be inside a collective and read no input)."""
        with self._lock:
            if self._busy:
                self._stop()
            children, self._children = self._children, []
            for child in children:
                _close_quietly(child.requests.close)
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            for child in children:
                try:
                    child.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
            _kill_all(children)

    def _stop(self) -> None:
        """Kill every process at once (after a failure: their state is unknown)."""
        children, self._children, self._busy = self._children, [], False
        _kill_all(children)

    # Requests --------------------------------------------------------------------
    def request(self, op: str, timeout: float | None = None, what: str = "", **fields: Any) -> Any:
        """Send one request to every process and return the combined result."""
        with self._lock:
            if self._busy:  # the previous request was interrupted: state unknown
                self._stop()
            if op == "release" and not self.alive:
                return None  # the executables went with their processes
            if op == "compile":
                self._check_replicas(fields["replicas"])
            self.start()
            self._busy = True
            split = _SPLIT_FIELD.get(op)
            local = self.local_device_count
            for child in self._children:
                message = {"op": op, **fields}
                if split is not None:
                    key, cut = split
                    message[key] = cut(fields[key], child.index, local)
                try:
                    _child.write_message(child.requests, message)
                except (BrokenPipeError, OSError):
                    self._fail(what or op, [c.index for c in self._children])
            replies = self._gather([True] * self.processes, timeout or self.timeout,
                                   what or op)
            self._busy = False
            return _COMBINE.get(op, lambda all_replies: all_replies[0])(replies)

    def _check_replicas(self, replicas: int) -> None:
        if self.device_count is None:
            split_devices(replicas, self.processes)
            self.device_count = replicas
        elif replicas != self.device_count:
            raise HloShardError(f"a module for {replicas} devices cannot run on the "
                                f"{self.device_count} devices of this {self.processes}-process "
                                "run; every module must use all of them")

    def _gather(self, waiting: list[bool], timeout: float, what: str) -> list[Any]:
        """Each process's reply, raising if any process fails, errs or is late."""
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.processes
        errors: dict[int, str] = {}
        while any(waiting):
            fds = {self._children[i].replies_fd: self._children[i]
                   for i, wait in enumerate(waiting) if wait}
            left = deadline - time.monotonic()
            ready = select.select(list(fds), [], [], left)[0] if left > 0 else []
            if not ready:
                late = [i for i, wait in enumerate(waiting) if wait]
                self._fail(f"{what}: timed out after {timeout:g} s", late)
            for fd in ready:
                child = fds[fd]
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    self._fail(what, [child.index])
                child.buffer += chunk
                complete, reply = child.take_message()
                if not complete:
                    continue
                waiting[child.index] = False
                if reply["ok"]:
                    results[child.index] = reply["result"]
                else:
                    errors[child.index] = _first_lines(reply["error"])
                    if any(waiting):  # its peers may now wait for it in a collective
                        self._fail(what, [child.index], errors)
        if errors:
            self._raise_errors(what, errors)
        return results

    def _raise_errors(self, what: str, errors: dict[int, str]) -> None:
        """Every process answered; some with an error (the processes stay usable)."""
        self._busy = False
        messages = set(errors.values())
        if len(messages) == 1 and len(errors) == self.processes:
            message = messages.pop()
        else:
            message = "; ".join(f"process {i}: {m}" for i, m in sorted(errors.items()))
        if not self.info:
            self._stop()
        raise HloRuntimeError(f"{what}: {message}" if what else message)

    def _fail(self, what: str, suspects: list[int], errors: dict[int, str] | None = None
              ) -> NoReturn:
        """Stop every process and raise (see :func:`_blame`)."""
        children, self._children, self._busy = self._children, [], False
        raise HloRuntimeError(f"{what}: " + _blame(children, suspects, errors or {}))

    def __repr__(self) -> str:
        state = "alive" if self.alive else "stopped"
        return (f"<DistributedWorker {self.processes} processes x "
                f"{self.device_count and self.local_device_count} {self.backend} devices "
                f"{state} gen={self.generation}>")


def _close_quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except OSError:
        pass


def _kill_all(children: list[_Process]) -> None:
    for child in children:
        if child.popen.poll() is None:
            child.popen.kill()
    for child in children:
        child.popen.wait()
        if child.requests is not None:
            _close_quietly(child.requests.close)
        for fd in (child.replies_fd, child.lifeline_fd):
            if fd >= 0:
                _close_quietly(functools.partial(os.close, fd))


# ------------------------------------------------------------------- scripts


def launch(script: str | Path, args: Sequence[str] = (), processes: int = 2,
           devices_per_process: int = 1, timeout: float = DEFAULT_TIMEOUT,
           env: dict[str, str] | None = None) -> list[str]:
    """Run the Python ``script`` as ``processes`` local processes with
    ``devices_per_process`` CPU devices each and return each one's stdout.

    Process ``i`` gets ``ARGS --coordinator 127.0.0.1:PORT --num-processes P
    --process-id i`` (a free port; process 0 hosts the coordinator). If any process
    fails or the run outlasts ``timeout`` seconds, all are stopped and
    :class:`HloRuntimeError` names the process and its last stderr line."""
    split_devices(processes * devices_per_process, processes)
    coordinator = f"127.0.0.1:{free_port()}"
    base = {**child_environment("cpu", devices_per_process), **(env or {})}
    children: list[_Process] = []
    outputs: list[bytes] = [b""] * processes
    readers: list[threading.Thread] = []

    def read_stdout(child: _Process) -> None:
        assert child.popen.stdout is not None, "spawned with stdout=PIPE"
        with child.popen.stdout as stream:
            outputs[child.index] = stream.read()

    try:
        for index in range(processes):
            child = _spawn(index, [str(_LAUNCHED_SCRIPT), str(script), *args,
                                   "--coordinator", coordinator, "--num-processes",
                                   str(processes), "--process-id", str(index)],
                           base, stdout=subprocess.PIPE)
            children.append(child)
            readers.append(threading.Thread(target=read_stdout, args=(child,), daemon=True))
            readers[-1].start()
        deadline = time.monotonic() + timeout
        while any(c.popen.poll() is None for c in children):
            failed = [c.index for c in children if c.popen.poll() not in (None, 0)]
            if failed:
                raise HloRuntimeError(f"{Path(script).name}: " + _blame(children, failed, {}))
            if time.monotonic() > deadline:
                late = [c.index for c in children if c.popen.poll() is None]
                raise HloRuntimeError(f"{Path(script).name}: timed out after {timeout:g} s: "
                                      + _blame(children, late, {}))
            time.sleep(0.05)
        failed = [c.index for c in children if c.popen.returncode != 0]
        if failed:
            raise HloRuntimeError(f"{Path(script).name}: " + _blame(children, failed, {}))
    finally:
        _kill_all(children)
    for reader in readers:
        reader.join(timeout=5)
    return [out.decode("utf-8", "replace") for out in outputs]
