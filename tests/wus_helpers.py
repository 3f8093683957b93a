"""Shared helpers for the weight-update sharding tests: run the pass on HLO text and
look at what came out."""

from __future__ import annotations

from collections import Counter

from hlo_shard.ir import Module
from hlo_shard.parser import parse
from hlo_shard.passes.sharding_pipeline import run_sharding
from hlo_shard.passes.weight_update import (ShardingOptions, ShardingReport,
                                             WeightUpdateSharding)
from hlo_shard.printer import to_text
from hlo_shard.validate import validate

ADD = "add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }"
MAX = "mx { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] maximum(x, y) }"


def optimize(text: str, **options) -> tuple[Module, ShardingReport]:
    """Parse, run the sharding pipeline (no speed gate), check it validates (printed and
    parsed back), return both."""
    module = parse(text)
    report = run_sharding(module, WeightUpdateSharding(ShardingOptions(**options)))
    problems = validate(module)
    assert not problems, problems
    reparsed = parse(to_text(module))
    assert not validate(reparsed)
    return module, report


def opcodes(module: Module, comp: str | None = None) -> Counter:
    target = module.entry if comp is None else module.computation(comp)
    return Counter(inst.opcode for inst in target.instructions)


def find(module: Module, opcode: str, comp: str | None = None) -> list:
    target = module.entry if comp is None else module.computation(comp)
    return [inst for inst in target.instructions if inst.opcode == opcode]


def row(report: ShardingReport, all_reduce: str, index: int | None = None):
    return next(r for r in report.explanations
                if r.all_reduce == all_reduce and r.index == index)
