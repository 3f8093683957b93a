"""Entry point of one process started by :func:`hlo_shard.runtime.distributed.launch`:
``python _launched.py LIFELINE_FD PARENT_PID SCRIPT [ARGS…]`` ties this process to
its parent (:mod:`._lifeline`), then runs SCRIPT as ``__main__`` with ARGS."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import _lifeline  # the script's folder (hlo_shard/runtime) is sys.path[0]


def main(argv: list[str]) -> None:
    lifeline_fd, parent_pid, script, *args = argv
    _lifeline.die_with_parent(int(lifeline_fd), int(parent_pid))
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python SCRIPT` would
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
