"""Bounds on what one command may consume, each with a way to raise it.

Without them a hostile or mistaken input eats the machine: ``fmt /dev/zero`` reads
forever, ``verify --devices 100000`` spends minutes and gigabytes starting devices,
``scale --replicas 100000000`` is killed by the OOM killer. Each limit has a default
sized for real training steps, an environment variable, and (where a command takes
it) a flag; the error names both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
import os
import re
from dataclasses import dataclass

from hlo_shard.errors import HloShardError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: What disables a size limit.
UNLIMITED = ("0", "none", "unlimited")


def parse_size(text: str, what: str) -> int | None:
    """``"16G"`` → 17179869184 bytes (K, M, G, T are powers of 1024); ``0`` /
    ``unlimited`` → None (no limit)."""
    if text.strip().lower() in UNLIMITED:
        return None
    match = _SIZE.match(text)
    if not match:
        raise HloShardError(f"{what} expects a size like 512M or 16G (or 'unlimited'), "
                            f"not {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_count(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise HloShardError(f"{what} expects a positive whole number, not {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class Limit:
    """One bound: ``what`` it counts, its default, the variable and flag that raise it."""

    what: str
    env: str
    default: int
    flag: str = ""
    size: bool = False

    def value(self, given: str | int | None = None) -> int | None:
        """The limit in force: ``given`` (a flag's value), else the one of the
        enclosing :func:`given_limits`, else the environment's, else the default;
        None when disabled (sizes only)."""
        given = given if given is not None else _given.get(self.env)
        raw = given if given is not None else os.environ.get(self.env)
        if raw is None:
            return self.default
        if isinstance(raw, int):
            return raw
        where = self.flag if given is not None else self.env
        return parse_size(raw, where) if self.size else parse_count(raw, where)

    def how_to_raise(self) -> str:
        return f"{self.flag} or {self.env}" if self.flag else self.env

    def check(self, amount: int, subject: str, given: str | int | None = None) -> None:
        limit = self.value(given)
        if limit is not None and amount > limit:
            raise HloShardError(f"{subject}: {amount} {self.what}, more than the limit of "
                                f"{limit}; raise it with {self.how_to_raise()}")


INPUT_BYTES = Limit("bytes", "HLO_SHARD_MAX_INPUT_BYTES", 2 << 30, size=True)
DEVICES = Limit("devices", "HLO_SHARD_MAX_DEVICES", 1024, "--max-devices")
REPLICAS = Limit("replicas", "HLO_SHARD_MAX_REPLICAS", 65536, "--max-replicas")
#: The execution worker's address space; the default depends on the machine (see
#: :func:`hlo_shard.runtime.worker.default_memory_limit`), hence 0 here.
WORKER_MEMORY = Limit("bytes", "HLO_SHARD_WORKER_MEMORY", 0, "--worker-memory", size=True)

#: Limits a command's flags set for the duration of the command, by variable name.
_given: dict[str, str | int] = {}


@contextlib.contextmanager
def given_limits(values: dict[Limit, str | int | None]) -> Iterator[None]:
    """Within the block, ``values`` (a command's flags; None: not given) take the
    place of the environment's limits."""
    saved = dict(_given)
    _given.update({limit.env: value for limit, value in values.items() if value is not None})
    try:
        yield
    finally:
        _given.clear()
        _given.update(saved)
