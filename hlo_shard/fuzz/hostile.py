"""Hostile inputs and an isolated way to run the CLI on them.

The inputs (generated, not stored: some are tens of megabytes): 100 000-deep nested tuple
shapes, nested operands, literal braces and parentheses; 50 MB single lines; truncations
and byte flips of a real module.

:func:`run_cli` runs ``hlo-shard ARGS`` in a child process forked from a server that
imported the CLI once (multiprocessing's ``forkserver``): a real process with its own
exit status, stdout and stderr, address-space limit and timeout, without paying the
interpreter start and imports per run. ``python -m hlo_shard`` is the same entry point.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import resource
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

DEPTH = 100_000
HUGE_BYTES = 50 * 1024 * 1024


def _module(name: str, params: str, result: str, body: str) -> str:
    return f"HloModule {name}\n\nENTRY %e ({params}) -> {result} {{\n{body}\n}}\n"


def deep_tuple_shape(depth: int = DEPTH) -> str:
    shape = "(" * depth + "f32[]" + ")" * depth
    return _module("deep_tuple", f"p: {shape}", "f32[]",
                   f"  %p = {shape} parameter(0)\n  ROOT %c = f32[] constant(0)")


def deep_operands(depth: int = DEPTH) -> str:
    nested = "negate(" * depth + "%p" + ")" * depth
    return _module("deep_operands", "p: f32[]", "f32[]",
                   f"  %p = f32[] parameter(0)\n  ROOT %r = f32[] add(%p, {nested})")


def deep_literal(depth: int = DEPTH, open_close: str = "{}", shape: str = "f32[1]") -> str:
    literal = open_close[0] * depth + "1" + open_close[1] * depth
    return _module("deep_literal", "", shape, f"  ROOT %c = {shape} constant({literal})")


def deep_literal_parentheses(depth: int = DEPTH) -> str:
    return deep_literal(depth, "()", "f32[]")


def huge_string_line(size: int = HUGE_BYTES) -> str:
    """A module on one line of ``size`` bytes, almost all of it one metadata string,
    with an unknown opcode at the very end: everything before the error is read."""
    name = "a" * size
    return (f"HloModule huge_string, replica_count=2 ENTRY %e () -> f32[] {{ %c = f32[] "
            f"constant(0), metadata={{op_name=\"{name}\"}} ROOT %r = f32[] frobnicate(%c) }}\n")


def huge_constant_line(size: int = HUGE_BYTES) -> str:
    """One line of ``size`` bytes: a constant with one value more than its shape holds,
    so the error is at the very end (25 million literal values are read first)."""
    count = size // 2
    values = "1," * count + "1"
    return (f"HloModule huge_constant, replica_count=2 ENTRY %e () -> f32[{count}] {{ ROOT %c = "
            f"f32[{count}] constant({{{values}}}) }}\n")


def truncations(text: str, count: int = 24, seed: int = 7) -> list[str]:
    """Prefixes of ``text`` cut at ``count`` points spread over it, each before the
    closing brace of the last computation (the entry), so none is a whole module."""
    end = text.rstrip().rfind("}")
    rng = random.Random(seed)
    cuts = {0, 1, end - 1}
    while len(cuts) < min(count, end):
        cuts.add(rng.randrange(1, end))
    return [text[:cut] for cut in sorted(cuts)]


def byte_flips(data: bytes, count: int = 24, seed: int = 11) -> list[bytes]:
    """``data`` with one byte replaced, at seeded positions, by a seeded byte: half
    random bytes, half characters that matter to the grammar."""
    rng = random.Random(seed)
    flipped = []
    for _ in range(count):
        position = rng.randrange(len(data))
        value = rng.randrange(256) if rng.random() < 0.5 else ord(rng.choice("{}()[],=%:\"' x0-"))
        flipped.append(data[:position] + bytes([value]) + data[position + 1:])
    return flipped


# ------------------------------------------------------------------------ isolation


@dataclass
class CliRun:
    args: list[str]
    #: Exit status; negative: killed by that signal; None: still running at the timeout.
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


_CONTEXT = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["hlo_shard.fuzz._preload", "hlo_shard.fuzz.hostile"])
    return _CONTEXT


def _child(args: list[str], out_path: str, err_path: str, status_path: str,
           memory_limit: int | None) -> None:
    """The CLI as ``python -m hlo_shard`` runs it, with stdout/stderr in files and its
    exit status written to ``status_path`` as it exits."""
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
    if memory_limit:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    code = 1
    try:
        from hlo_shard.cli import main

        main.main(args=args, prog_name="hlo-shard")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # what the interpreter would do with an uncaught exception
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    status = os.open(status_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(status, str(code).encode())
    os.close(status)
    os._exit(code)


#: Fresh tries of a run whose child the forkserver lost before it started.
LOST_CHILD_RETRIES = 2


def _run_child(args: list[str], out_path: str, err_path: str, status_path: str,
               timeout: float, memory_limit: int | None) -> int | None:
    """One forkserver child running the CLI: its exit status (None: killed at timeout)."""
    process = _context().Process(target=_child,
                                 args=(args, out_path, err_path, status_path, memory_limit))
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        return None
    return process.exitcode


def run_cli(args: list[str], timeout: float = 60, memory_limit: int | None = None) -> CliRun:
    """``hlo-shard ARGS`` in an isolated child process (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="hlo-shard-cli-") as scratch:
        out_path, err_path = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        status_path = os.path.join(scratch, "status")
        read = lambda path: open(path, encoding="utf-8", errors="replace").read() \
            if os.path.exists(path) else ""  # noqa: E731
        started = time.monotonic()
        for _ in range(LOST_CHILD_RETRIES + 1):
            returncode = _run_child(args, out_path, err_path, status_path, timeout,
                                    memory_limit)
            # 255: multiprocessing could not read the forkserver's report of the child
            # (the CLI itself never exits 255; under load, once in some thousand runs).
            # A child that ran wrote its own status; one that never ran our code (which
            # opens the stderr file first) runs afresh.
            if returncode == 255 and os.path.exists(status_path):
                returncode = int(read(status_path))
            if returncode != 255 or os.path.exists(err_path):
                break
        elapsed = time.monotonic() - started
        return CliRun(list(args), returncode, read(out_path), read(err_path), elapsed)
