"""The parent side of the execution child: spawn, talk, time out, survive crashes.

One :class:`Worker` is a long-lived child process for one (backend, device count)
that compiles many modules and runs them many times. Every failure of the child —
an XLA error, an ``abort()`` from a CHECK, a hang past the timeout — becomes an
:class:`~hlo_shard.errors.HloRuntimeError` with the useful lines of the child's
stderr; the parent never dies with it. A dead worker restarts on the next request
and bumps :attr:`Worker.generation`, so executables know to compile again.

The child never outlives its parent: it asks the kernel for SIGKILL when the parent
dies (``PR_SET_PDEATHSIG``) and a watchdog thread in it exits when the request pipe
loses its writer, so a ``verify`` killed by SIGKILL, SIGTERM or SIGHUP leaves no XLA
computation running. Ctrl-C kills the child at once (:func:`kill_workers`). Its
address space is limited (:func:`memory_limit`) so that a runaway compile fails with
a message instead of waking the OOM killer, and the device count is bounded
(:data:`hlo_shard.limits.DEVICES`).

:func:`get_worker` keeps a pool so that a test module or a CLI process starts jax
once: a live worker of the same backend with at least as many devices is reused
(a CPU worker with 8 virtual devices serves 2- and 4-device modules too).
"""

from __future__ import annotations

import atexit
import collections
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from hlo_shard import limits
from hlo_shard.errors import HloRuntimeError, HloShardError
from hlo_shard.runtime import _child

BACKENDS = ("cpu", "gpu", "tpu")
#: Default seconds for one request (a compile, an execution, a timing batch) and for
#: jax to start in the child and report its devices.
DEFAULT_TIMEOUT = 300.0
#: The default address-space limit: this share of the machine's memory …
MEMORY_SHARE = 0.75
#: … plus this much per device: XLA reserves (does not use) thread stacks per device.
MEMORY_PER_DEVICE = 40 << 20
#: What an allocation failure looks like in the child's error or stderr.
_OUT_OF_MEMORY = re.compile(r"bad_alloc|MemoryError|Cannot allocate memory|out of memory|pthread_create|"
                            r"RESOURCE_EXHAUSTED|Resource exhausted|Failed to allocate",
                            re.IGNORECASE)
#: A C++ exception escaping a second thread while the first one's aborts the process: the
#: second aborts it at once, before the first says which exception. Under a memory limit
#: that is XLA's threads failing their allocations together.
_TERMINATED_TWICE = re.compile(r"terminate called recursively")


def memory_hint(text: str, limit: int | None) -> str:
    """Why the worker failed, where ``text`` (its error or the end of its stderr) says an
    allocation failed under its address-space ``limit``, or likely did."""
    if limit is None:
        return ""
    if _OUT_OF_MEMORY.search(text):
        how = ""
    elif _TERMINATED_TWICE.search(text):
        how = "likely "
    else:
        return ""
    return (f" ({how}out of memory under the worker's limit of {limit >> 20} MiB; "
            f"raise it with {limits.WORKER_MEMORY.how_to_raise()})")


def memory_limit(backend: str, device_count: int) -> int | None:
    """Bytes of address space a worker of ``device_count`` devices may map: the
    ``--worker-memory`` flag, else ``HLO_SHARD_WORKER_MEMORY``, else (CPU only: GPU
    drivers reserve far more address space than memory) 3/4 of the machine's memory
    plus a reserve per device; None: unlimited."""
    chosen = limits.WORKER_MEMORY.value()
    if chosen != limits.WORKER_MEMORY.default:
        return chosen
    if backend != "cpu":
        return None
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(physical * MEMORY_SHARE) + MEMORY_PER_DEVICE * device_count
_STDERR_LINES_KEPT = 400
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def child_environment(backend: str, device_count: int) -> dict[str, str]:
    """The environment for a child: the user's, plus what must precede jax's start."""
    env = dict(os.environ)
    flags = [flag for flag in env.get("XLA_FLAGS", "").split()
             if not flag.startswith(_DEVICE_COUNT_FLAG)]
    if backend == "cpu":
        flags.append(f"{_DEVICE_COUNT_FLAG}={device_count}")
        env["JAX_PLATFORMS"] = "cpu"  # never probe (and grab) accelerators for CPU runs
    else:
        env.pop("JAX_PLATFORMS", None)
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    flags += [] if "--xla_allow_excess_precision" in env.get("XLA_FLAGS", "") else ["--xla_allow_excess_precision=false"]  # 16-bit modules compare as written (issue #16)
    env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Worker:
    """A child process holding jax with ``device_count`` devices of ``backend``."""

    def __init__(self, backend: str = "cpu", device_count: int = 1,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        if backend not in BACKENDS:
            raise HloShardError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if device_count < 1:
            raise HloShardError(f"device count must be at least 1, not {device_count}")
        limits.DEVICES.check(device_count, f"starting {backend} devices")
        self.backend = backend
        self.device_count = device_count
        self.timeout = timeout
        self.memory_limit = memory_limit(backend, device_count)
        self.generation = 0
        self.info: dict[str, Any] = {}
        self._process: subprocess.Popen | None = None
        self._requests: BinaryIO | None = None
        self._replies_fd = -1
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES_KEPT)
        self._lock = threading.RLock()

    # Lifecycle -------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the child (if needed) and wait until jax reports its devices."""
        with self._lock:
            if self.alive:
                return
            self._spawn()
            self.generation += 1
            self.info = self._receive(self.timeout, "starting jax")

    def _spawn(self) -> None:
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        self._stderr.clear()
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits: only the main
        # thread's children may ask for it (the watchdog covers the others).
        parent = os.getpid() if threading.current_thread() is threading.main_thread() else 0
        self._process = subprocess.Popen(
            [sys.executable, "-u", str(Path(_child.__file__)), str(request_read),
             str(reply_write), self.backend, str(self.device_count), str(parent),
             str(self.memory_limit or 0)],
            env=child_environment(self.backend, self.device_count),
            pass_fds=(request_read, reply_write), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True)
        os.close(request_read)
        os.close(reply_write)
        self._requests = os.fdopen(request_write, "wb")
        self._replies_fd = reply_read
        threading.Thread(target=self._drain_stderr, args=(self._process.stderr,),
                         daemon=True).start()

    def _drain_stderr(self, stream: BinaryIO) -> None:
        for raw in iter(stream.readline, b""):
            self._stderr.append(raw.decode("utf-8", "replace").rstrip("\n"))
        stream.close()

    def close(self) -> None:
        """Stop the child: end of input first, then a kill if it lingers."""
        with self._lock:
            process, self._process = self._process, None
            if process is None:
                return
            self._close_pipes()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _close_pipes(self) -> None:
        if self._requests is not None:
            try:
                self._requests.close()
            except OSError:
                pass
            self._requests = None
        if self._replies_fd >= 0:
            os.close(self._replies_fd)
            self._replies_fd = -1

    # Requests --------------------------------------------------------------------
    def request(self, op: str, timeout: float | None = None, what: str = "", **fields: Any) -> Any:
        """Send one request and return its result; ``what`` names it in errors."""
        with self._lock:
            self.start()
            assert self._requests is not None, "start() opened the request pipe"
            try:
                _child.write_message(self._requests, {"op": op, **fields})
            except (BrokenPipeError, OSError):
                raise self._died(what or op) from None
            return self._receive(timeout or self.timeout, what or op)

    def _receive(self, timeout: float, what: str) -> Any:
        """The reply; on Ctrl-C (or any other interruption) the child is killed at
        once: it may be busy for as long as the timeout, and nobody waits for it."""
        try:
            return self._receive_reply(timeout, what)
        except (KeyboardInterrupt, SystemExit):
            self._kill()
            raise

    def _receive_reply(self, timeout: float, what: str) -> Any:
        header = self._read_exactly(_child._HEADER.size, timeout, what)
        (length,) = _child._HEADER.unpack(header)
        reply = _child.pickle.loads(self._read_exactly(length, timeout, what))
        if reply["ok"]:
            return reply["result"]
        if reply.get("kind") == "usage" and not self.info:
            self.close()  # the child refused to start; it exits by itself
        message = _first_lines(reply["error"]) + memory_hint(reply["error"], self.memory_limit)
        raise HloRuntimeError(f"{what}: {message}" if what else message)

    def _read_exactly(self, size: int, timeout: float, what: str) -> bytes:
        deadline = time.monotonic() + timeout
        chunks: list[bytes] = []
        remaining = size
        while remaining:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._replies_fd], [], [], max(left, 0))
            if not ready:
                self._kill()
                raise HloRuntimeError(f"{what}: timed out after {timeout:g} s "
                                      f"(the {self.backend} worker was stopped)")
            chunk = os.read(self._replies_fd, min(remaining, 1 << 20))
            if not chunk:
                raise self._died(what)
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def _kill(self) -> None:
        process, self._process = self._process, None
        self._close_pipes()
        if process is not None:
            process.kill()
            process.wait()

    def _died(self, what: str) -> HloRuntimeError:
        """The error for a child that exited mid-request (an XLA CHECK, OOM kill …)."""
        process = self._process
        self._process = None
        self._close_pipes()
        status = process.wait() if process is not None else None
        if process is not None and process.stderr is not None:
            time.sleep(0.05)  # let the drain thread collect the last lines
        cause = _exit_cause(status)
        lines = list(self._stderr)
        detail = _crash_detail(lines)
        message = f"{what}: XLA {cause}" + (f": {detail}" if detail else "")
        return HloRuntimeError(message + memory_hint("\n".join(lines[-50:]), self.memory_limit))

    def __repr__(self) -> str:
        state = "alive" if self.alive else "stopped"
        return f"<Worker {self.backend}×{self.device_count} {state} gen={self.generation}>"


def _exit_cause(status: int | None) -> str:
    if status is None:
        return "process ended"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return "aborted (" + name + ")" if name == "SIGABRT" else f"process killed by {name}"
    return f"process exited with status {status}"


_CHECK_LINE = re.compile(r"^[FE]\d{4} .*?\] (.*)$")


def _crash_detail(lines: list[str]) -> str:
    """The fatal log lines (``F…] Check failed: …``) or else the last error line."""
    fatal = [m.group(1) for line in lines if (m := _CHECK_LINE.match(line))
             and line.startswith("F")]
    if fatal:
        return "; ".join(fatal[-2:])
    meaningful = [line.strip() for line in lines
                  if line.strip() and not line.startswith(("    @", "***"))]
    return meaningful[-1] if meaningful else ""


def _first_lines(message: str, limit: int = 6) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    shown = "; ".join(line.strip() for line in lines[:limit])
    return shown + (" …" if len(lines) > limit else "")


# ------------------------------------------------------------------------------ pool

_pool: list[Worker] = []
_pool_lock = threading.Lock()


def get_worker(backend: str = "cpu", device_count: int = 1,
               timeout: float = DEFAULT_TIMEOUT) -> Worker:
    """A started worker for ``backend`` with at least ``device_count`` devices and the
    memory limit in force, reused from the pool when one exists (its timeout is
    updated to ``timeout``)."""
    with _pool_lock:
        for worker in _pool:
            if worker.backend == backend and worker.device_count >= device_count \
                    and worker.memory_limit == memory_limit(backend, worker.device_count):
                worker.timeout = timeout
                break
        else:
            worker = Worker(backend, device_count, timeout)
            _pool.append(worker)
    try:
        worker.start()
    except HloShardError:
        with _pool_lock:
            if worker in _pool:
                _pool.remove(worker)
        raise
    return worker


def _empty_pool() -> list[Worker]:
    with _pool_lock:
        workers = list(_pool)
        _pool.clear()
    return workers


def shutdown_workers() -> None:
    """Stop every pooled worker (also run at interpreter exit)."""
    for worker in _empty_pool():
        worker.close()


def kill_workers() -> None:
    """Kill every pooled worker now, busy or not (Ctrl-C: nobody waits for a result)."""
    for worker in _empty_pool():
        worker._kill()


atexit.register(shutdown_workers)
