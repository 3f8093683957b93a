"""Dying with the parent: what every process hlo-shard starts for a multi-process run
does first. Standard library only, so that scripts run from this folder (the
``_distributed_child`` and ``_launched`` entry points) can import it before jax."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

#: ``prctl`` option: the signal this process gets when its parent thread exits.
_PR_SET_PDEATHSIG = 1


def die_with_parent(lifeline_fd: int, parent_pid: int) -> None:
    """Never outlive the process that started this one: ``PR_SET_PDEATHSIG`` (Linux),
    and a watchdog thread that exits when the lifeline pipe, whose write end only the
    parent holds, reaches end of file. A process blocked in a collective whose peer
    died reads no request pipe, so only such a separate watch sees its parent go."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # the lifeline below still covers it
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            try:
                if not os.read(lifeline_fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os._exit(1)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
