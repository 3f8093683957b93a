"""``hlo_shard.jax`` across processes: every process must build the same program.

Under ``jax.distributed`` (``jax.process_count() > 1``) nothing in a step's path is
specific to one process: each process captures the step for the global devices,
runs the pass and compiles the result for them, then passes its addressable shards
to the executable, whose collectives join all processes. What must hold is that all
processes build the *same* program: a process that optimized differently (another
hlo-shard release, other options, another argument signature) or fell back to
``fn`` while the others did not would wait forever in a collective that the others
never run. So after every build each process publishes the sha256 of its optimized
module (or of its fallback reason) in the distributed client's key-value store and
compares it with every other process's; a difference raises the same
:class:`~hlo_shard.errors.HloShardError` in every process, before anything runs.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

from hlo_shard.errors import HloShardError

#: Seconds a process waits for the others to finish the same build.
AGREE_TIMEOUT_S = 600
_KEY_PREFIX = "hlo_shard.jax/program"
#: Builds so far in this process; processes building in the same order share numbers.
_builds = itertools.count()


def multi_process() -> bool:
    """Whether jax runs several processes. A first run that fails then raises instead
    of falling back to ``fn``: the other processes may already wait in the optimized
    step's collectives, and ``fn``'s would never meet them."""
    import jax

    return jax.process_count() > 1


def agree_on_program(kind: str, text: str) -> None:
    """Check that every process built the same ``kind`` ("optimized module" or "fallback
    to fn") from the same ``text`` (the module, or the reason); no-op in one process."""
    import jax

    processes = jax.process_count()
    if processes == 1:
        return
    client = _client()
    round_key = f"{_KEY_PREFIX}/{next(_builds)}"
    mine = f"{kind} sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"
    client.key_value_set(f"{round_key}/{jax.process_index()}", mine)
    seen = {}
    for process in range(processes):
        try:
            seen[process] = client.blocking_key_value_get(f"{round_key}/{process}",
                                                          AGREE_TIMEOUT_S * 1000)
        except Exception as err:  # noqa: BLE001 - jaxlib's error types are not stable API
            raise HloShardError(f"hlo_shard.jax: process {process} did not build this step "
                                f"within {AGREE_TIMEOUT_S} s ({str(err).splitlines()[0]})"
                                ) from None
    if len(set(seen.values())) > 1:
        by_value: dict[str, list[int]] = {}
        for process, value in seen.items():
            by_value.setdefault(value, []).append(process)
        groups = "; ".join(f"process{'es' if len(p) > 1 else ''} "
                           f"{', '.join(map(str, p))}: {value}" for value, p in by_value.items())
        raise HloShardError(
            f"hlo_shard.jax: the {processes} processes built different programs for this "
            f"step ({groups}); every process must call it with the same argument shapes, "
            "dtypes and shardings, the same options and the same hlo-shard release")


def _client() -> Any:
    from jax._src import distributed  # private API: the coordination service's client

    client = distributed.global_state.client
    if client is None:
        raise HloShardError("hlo_shard.jax: jax runs several processes but "
                            "jax.distributed.initialize was not called in this one")
    return client
