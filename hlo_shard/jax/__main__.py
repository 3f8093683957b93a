"""``python -m hlo_shard.jax train.py [args]``: run a training script unchanged with the
weight-update sharding hook installed (``HLO_SHARD=0`` runs it without; ``HLO_SHARD_ONLY``
is the ``only=`` module-name regex; ``HLO_SHARD_PMAP_REPLICATED=1`` is
``pmap_replicated=True``). One line per sharded module goes to stderr."""

from __future__ import annotations

import logging
import os
import runpy
import sys
import traceback

USAGE = "usage: python -m hlo_shard.jax SCRIPT.py [ARGS...]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"{script}: error: no such script", file=sys.stderr)
        return 2
    if os.environ.get("HLO_SHARD", "1") != "0":
        from hlo_shard.errors import HloShardError
        from hlo_shard.jax.hook import install

        logger = logging.getLogger("hlo_shard")
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False  # (a script's logging.basicConfig: not twice)
        try:
            install(only=os.environ.get("HLO_SHARD_ONLY"),
                    pmap_replicated=os.environ.get("HLO_SHARD_PMAP_REPLICATED") == "1")
        except HloShardError as err:
            print(f"hlo_shard.jax: error: {err}", file=sys.stderr)
            return 2
    sys.argv = list(argv)
    path = os.path.abspath(script)  # python's own __file__ for a script (3.9+)
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except Exception as err:  # noqa: BLE001 - the script's own, shown as python shows it
        _print_script_traceback(err, path)
        return 1
    return 0


def _print_script_traceback(err: BaseException, path: str) -> None:
    """``err``'s traceback from the script's own frame on (this runner's and runpy's
    frames left out), as ``python SCRIPT.py`` prints it; exit status 1 follows."""
    tb = err.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    traceback.print_exception(type(err), err, tb if tb is not None else err.__traceback__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
