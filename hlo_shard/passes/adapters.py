"""Passes written before the contract of :mod:`hlo_shard.passes.base`, in its form, so
that they run in a :class:`~hlo_shard.passes.pipeline.Pipeline` unchanged.

Each adapter goes once its pass is a frozen dataclass itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from hlo_shard.ir import Module
from hlo_shard.passes.base import ModulePass, PassResult
from hlo_shard.passes.weight_update_sharding import (ShardingOptions, ShardingReport,
                                                     WeightUpdateSharding)
from hlo_shard.profiles import resolve_profile


@dataclass(frozen=True)
class WeightUpdateShardingPass(ModulePass[ShardingReport]):
    """:class:`WeightUpdateSharding` with its options resolved when the pass is built:
    the profile loaded (a name or file becomes a :class:`HardwareProfile`), the state
    and strategy checked."""

    name: ClassVar[str] = WeightUpdateSharding.name
    options: ShardingOptions = ShardingOptions()

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", replace(
            self.options, profile=resolve_profile(self.options.profile)))
        WeightUpdateSharding(self.options)  # raises on a bad state or strategy

    def apply(self, module: Module) -> PassResult[ShardingReport]:
        result = WeightUpdateSharding(self.options).apply(module)
        return PassResult(module, result.changed, result.changes, report=result.report)


__all__ = ["WeightUpdateShardingPass"]
