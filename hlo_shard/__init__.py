"""hlo-shard: automatic cross-replica sharding of the weight update for XLA HLO text."""

from hlo_shard.errors import HloParseError, HloRuntimeError, HloShardError
from hlo_shard.ir import Computation, Instruction, Module
from hlo_shard.parser import parse, parse_file
from hlo_shard.passes.optimize import ForExecutable, OptimizeResult, optimize
from hlo_shard.passes.weight_update import ShardingOptions, ShardingReport
from hlo_shard.printer import to_text

__all__ = [
    "Computation", "ForExecutable", "HloParseError", "HloRuntimeError", "HloShardError",
    "Instruction", "Module", "OptimizeResult", "ShardingOptions", "ShardingReport", "optimize",
    "parse", "parse_file", "to_text",
]
__version__ = "0.1.0"
