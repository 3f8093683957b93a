"""``hlo_shard.jax`` across processes: every process must run the same program.

Under ``jax.distributed`` (``jax.process_count() > 1``) nothing in a step's path is
specific to one process: each process captures the step (or XLA hands its hook the
module) for the global devices, runs the pass and compiles the result, and the
executable's collectives join all processes. What must hold is that all processes run
the *same* program: a process that optimized differently (another hlo-shard release,
other options) or runs the original while the others run the optimized step would wait
forever in a collective the others never run.

So each process publishes what it runs for a build in the distributed client's
key-value store, and a process that runs an optimized module runs it only once every
other process has published the same one. Anything else — another program, the
original, no answer within :data:`AGREE_TIMEOUT_S` — and the process runs the original,
first writing "original" over its own answer, so that a process arriving later runs the
original too: all processes then run the program every one of them has, which needs no
agreement.

Answers are keyed by the digest of the module the process was handed and by the
answer's place among the distinct answers this process gave for that module (the same
step built in another mode is the next one), not by a count of builds: a step a process
builds once more (compiled ahead for its memory figures) reuses what came of the same
answer, and a step only one process builds puts no other step out of step (that
process waits for the others' answer to it, up to :data:`AGREE_TIMEOUT_S`, then runs
it as it was). Digests leave out the debug info (each instruction's metadata, the module's
stack frames), which names each process's own source paths and call sites.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from typing import Any, cast

from hlo_shard.errors import HloShardError

logger = logging.getLogger("hlo_shard.jax")

#: Seconds a process that runs an optimized module waits for the others' answers.
AGREE_TIMEOUT_S = 600
#: Seconds one wait on the store lasts: Python runs its signal handlers between waits
#: (Ctrl-C stops a process waiting for its peers), and the wait says so once it lasts.
_POLL_S = 1.0
_SAY_WAITING_AFTER_S = 30.0
_KEY_PREFIX = "hlo_shard.jax/program"
_ORIGINAL = "original"
#: Per module handed over (its digest): the answers this process gave for it, in order,
#: and what came of each ("" or why every process runs the original; None: not yet).
_ANSWERS: dict[str, list[tuple[str, str | None]]] = {}
_ANSWERS_LOCK = threading.Lock()
#: An instruction's ``metadata={...}`` attribute (its strings may hold braces).
_METADATA = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
#: The module's ``FileNames … StackFrames`` section after its header.
_STACK_FRAMES = re.compile(r'^FileNames(?:\s+\d+\s+"(?:[^"\\]|\\.)*")*'
                           r'(?:\s+FunctionNames(?:\s+\d+\s+"(?:[^"\\]|\\.)*")*)?'
                           r'(?:\s+FileLocations(?:\s+\d+\s*\{[^{}]*\})*)?'
                           r'(?:\s+StackFrames(?:\s+\d+\s*\{[^{}]*\})*)?', re.MULTILINE)


def multi_process() -> bool:
    """Whether jax runs several processes. A first run that fails then raises instead
    of falling back to ``fn``: the other processes may already wait in the optimized
    step's collectives, and ``fn``'s would never meet them."""
    import jax

    return jax.process_count() > 1


def program_digest(text: str) -> str:
    """The program of a module's ``text`` as processes compare it: the sha256 of the text
    without its debug info (each instruction's metadata, the module's stack frames)."""
    text = _METADATA.sub("", _STACK_FRAMES.sub("", text, count=1))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def agree_on_program(build: str, program: str | None) -> str:
    """Whether this process may run ``program`` (a :func:`program_digest`; None: it runs
    the original module) for ``build`` (the digest of the module it was handed): "" when
    it may, else why every process runs the original instead. The original needs no
    agreement: it is published and run at once. No-op in one process."""
    import jax

    processes = jax.process_count()
    if processes == 1:
        return ""
    answer = _ORIGINAL if program is None else f"optimized module sha256 {program}"
    with _ANSWERS_LOCK:
        given = _ANSWERS.setdefault(build, [])
        place = next((k for k, (said, _) in enumerate(given) if said == answer), None)
        if place is not None and given[place][1] is not None:
            return cast(str, given[place][1])  # (given before: what came of it)
        if place is None:
            place = len(given)
            given.append((answer, None))
    client = _client()
    me = jax.process_index()
    round_key = f"{_KEY_PREFIX}/{build}/{place}"
    client.key_value_set(f"{round_key}/{me}", answer, allow_overwrite=True)
    why = "" if program is None else _wait_for_the_others(client, round_key, me, answer,
                                                          processes)
    with _ANSWERS_LOCK:
        given[place] = (answer, why)
    return why


def _wait_for_the_others(client: Any, round_key: str, me: int, answer: str,
                         processes: int) -> str:
    """"" where every process answered ``answer`` under ``round_key``, else why not (this
    process's answer then overwritten with "original")."""
    seen: dict[int, str | None] = {me: answer}
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    for process in range(processes):
        if process not in seen:
            seen[process] = _answer(client, f"{round_key}/{process}", process, deadline)
    why = _disagreement(seen, processes)
    if why:
        client.key_value_set(f"{round_key}/{me}", _ORIGINAL, allow_overwrite=True)
    return why


def _answer(client: Any, key: str, process: int, deadline: float) -> str | None:
    """Process ``process``'s answer under ``key``, None where none came by ``deadline``."""
    said = False
    started = time.monotonic()
    while (left := deadline - time.monotonic()) > 0:
        asked = time.monotonic()
        try:
            return str(client.blocking_key_value_get(key, int(min(left, _POLL_S) * 1000) + 1))
        except Exception:  # noqa: BLE001 - jaxlib's timeout error type is not stable API
            # (an error that is no timeout comes back at once: no busy loop on it)
            time.sleep(max(0.0, min(_POLL_S - (time.monotonic() - asked), left)))
        if not said and time.monotonic() - started > _SAY_WAITING_AFTER_S:
            said = True
            logger.warning("hlo_shard: waiting for process %d to build the same step "
                           "(at most %d s; then every process runs the original)",
                           process, AGREE_TIMEOUT_S)
    return None


def _disagreement(seen: dict[int, str | None], processes: int) -> str:
    """Why the answers ``seen`` do not let an optimized module run ("" where all are the
    same optimized module)."""
    late = [process for process, answer in seen.items() if answer is None]
    if late:
        return (f"hlo_shard.jax: process {late[0]} did not build this step within "
                f"{AGREE_TIMEOUT_S} s (it compiles it later, or never: it ran it from a "
                f"persistent compilation cache only some processes hold, or did not "
                f"install hlo-shard); every process runs the original")
    if len(set(seen.values())) == 1:
        return ""
    by_answer: dict[str | None, list[int]] = {}
    for process in sorted(seen):
        by_answer.setdefault(seen[process], []).append(process)
    groups = "; ".join(f"process{'es' if len(p) > 1 else ''} {', '.join(map(str, p))}: "
                       f"{answer}" for answer, p in by_answer.items())
    return (f"hlo_shard.jax: the {processes} processes built different programs for this "
            f"step ({groups}); every process runs the original (the same options and "
            f"hlo-shard release in every process shard it)")


def _client() -> Any:
    from jax._src import distributed  # private API: the coordination service's client

    client = distributed.global_state.client
    if client is None:
        raise HloShardError("hlo_shard.jax: jax runs several processes but "
                            "jax.distributed.initialize was not called in this one")
    return client
