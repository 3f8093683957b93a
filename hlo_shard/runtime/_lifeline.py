"""Dying with the parent: what every process hlo-shard starts for a multi-process run
does first. Standard library only, so that scripts run from this folder (the
``_distributed_child`` and ``_launched`` entry points) can import it before jax."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading

#: ``prctl`` option: the signal this process gets when its parent thread exits.
_PR_SET_PDEATHSIG = 1


def die_with_parent(watched_fd: int, parent_pid: int) -> None:
    """Never outlive the process that started this one, even in the middle of an
    hour-long computation: ``PR_SET_PDEATHSIG`` (Linux; ``parent_pid`` 0 skips it, for
    a parent that started us from a thread other than its main one, since the kernel
    fires it when that *thread* exits), and a watchdog thread that exits when
    ``watched_fd`` (the read end of a pipe only the parent writes to) has no writer
    left — whatever killed the parent. A process blocked in XLA or in a collective
    whose peer died reads no pipe, so only such a separate watch sees its parent go."""
    if parent_pid:
        if sys.platform.startswith("linux"):
            try:
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL,
                                                        0, 0, 0)
            except (OSError, AttributeError):
                pass  # the watchdog below still covers it
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    threading.Thread(target=_watch, args=(watched_fd,), name="lifeline", daemon=True).start()


def _watch(fd: int) -> None:
    poller = select.poll()
    poller.register(fd, 0)  # no events asked for: POLLHUP/POLLERR/POLLNVAL only
    while True:
        if any(events & (select.POLLHUP | select.POLLERR | select.POLLNVAL)
               for _, events in poller.poll()):
            os._exit(1)
