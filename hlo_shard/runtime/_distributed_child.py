"""One process of a multi-process run: jax.distributed, then the child protocol.

Run as a script by :class:`hlo_shard.runtime.distributed.DistributedWorker`, once per
process. Like :mod:`._child` (whose framing and :class:`Runtime` it reuses: the
script's folder is first on ``sys.path``) it imports only the standard library,
numpy and jax, so a CHECK failure inside XLA kills this process only.

What differs from a single-process child:

* ``jax.distributed.initialize`` (process 0 hosts the coordinator) before jax's CPU
  backend starts, with gloo as the CPU collectives across processes;
* ``jax.devices()`` is then the *global* device list; each process holds, and is
  sent, the values of its own (addressable) devices only, and returns its own
  devices' outputs;
* the process dies with its parent (:func:`_lifeline.die_with_parent`).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import _child  # the script's folder (hlo_shard/runtime) is sys.path[0]
import _lifeline

#: How long a process waits for its peers at ``jax.distributed.shutdown``.
SHUTDOWN_TIMEOUT_S = 10


class DistributedRuntime(_child.Runtime):
    """:class:`_child.Runtime` over the global device list, fed local values."""

    def __init__(self, backend: str, device_count: int) -> None:
        super().__init__(backend, device_count)
        self.process_index = self.jax.process_index()

    def describe(self) -> dict:
        return {**super().describe(), "process_index": self.process_index,
                "process_count": self.jax.process_count(),
                "local_device_ids": [d.id for d in self.devices
                                     if d.process_index == self.process_index]}

    def _arrays(self, devices: list, per_parameter: list[list]) -> list:
        """One global jax.Array per parameter from this process's devices' values
        (``per_parameter[i]`` holds one value per addressable device, in order)."""
        jax, np = self.jax, self.np
        mesh = jax.sharding.Mesh(np.array(devices), ("d",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        local = [d for d in devices if d.process_index == self.process_index]
        arrays = []
        for values in per_parameter:
            if len(values) != len(local):
                raise _child.UsageError(f"{len(values)} values given for the {len(local)} "
                                        f"devices of process {self.process_index}")
            buffers = [jax.device_put(v, d) for v, d in zip(values, local)]
            arrays.append(jax.make_array_from_single_device_arrays(
                np.shape(values[0]), replicated, buffers))
        return arrays


def _start(backend: str, coordinator: str, processes: int, process_id: int,
           device_count: int, init_timeout: int) -> DistributedRuntime:
    import jax

    if backend == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=processes, process_id=process_id,
        coordinator_bind_address=coordinator, initialization_timeout=init_timeout,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    return DistributedRuntime(backend, device_count)


def serve(requests: Any, replies: Any, runtime: DistributedRuntime) -> None:
    """The request loop of :func:`_child.serve`, logging each request on stderr (the
    line a parent reports when this process dies in the middle of it)."""
    handlers = {"compile": runtime.compile, "execute": runtime.execute, "cost": runtime.cost,
                "time": runtime.time, "release": runtime.release, "ping": lambda: "pong"}
    while (request := _child.read_message(requests)) is not None:
        op = request.pop("op")
        print(f"process {runtime.process_index}: {op} "
              + " ".join(f"{k}={v}" for k, v in request.items() if isinstance(v, int)),
              file=sys.stderr, flush=True)
        try:
            reply = {"ok": True, "result": handlers[op](**request)}
        except Exception as err:  # noqa: BLE001 - reported, the process lives on
            reply = _child._error_reply(err)
        _child.write_message(replies, reply)


def main(argv: list[str]) -> None:
    (lifeline_fd, parent_pid, request_fd, reply_fd, backend, coordinator, processes,
     process_id, device_count, init_timeout) = argv
    _lifeline.die_with_parent(int(lifeline_fd), int(parent_pid))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns interruption
    with os.fdopen(int(request_fd), "rb") as requests, \
            os.fdopen(int(reply_fd), "wb") as replies:
        try:
            runtime = _start(backend, coordinator, int(processes), int(process_id),
                             int(device_count), int(init_timeout))
        except Exception as err:  # noqa: BLE001 - every failure goes back to the parent
            _child.write_message(replies, _child._error_reply(err))
            return
        _child.write_message(replies, {"ok": True, "result": runtime.describe()})
        serve(requests, replies, runtime)
    runtime.jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
