"""Imported once by the fork server of :func:`hlo_shard.fuzz.hostile.run_cli`: every
hlo-shard module a command may import lazily, and a built grammar, so that each forked
run starts warm."""

from __future__ import annotations

import importlib
import pkgutil

import hlo_shard
from hlo_shard.parser import parse

_SKIPPED = ("hlo_shard.fuzz", "hlo_shard.runtime._child", "hlo_shard.__main__")

for _info in pkgutil.walk_packages(hlo_shard.__path__, "hlo_shard."):
    if not _info.name.startswith(_SKIPPED):
        importlib.import_module(_info.name)

parse("HloModule warm\nENTRY e { ROOT c = f32[] constant(0) }\n")
