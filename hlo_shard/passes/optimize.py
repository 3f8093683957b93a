"""The optimizer as every front end runs it: the sharding pipeline
(:mod:`~hlo_shard.passes.sharding_pipeline`) behind the never-slower gate
(:func:`~hlo_shard.passes.speed_gate.shard_where_faster`), then the output checks
(parsed back and validated). ``hlo-shard optimize``, the jax hook and
``shard_weight_update`` all call this, so none of them writes or compiles a module the
cost model predicts slower or the validator rejects.
"""

from __future__ import annotations

from hlo_shard.errors import HloShardError
from hlo_shard.ir import Module
from hlo_shard.parser import parse
from hlo_shard.passes.pipeline import AfterPass
from hlo_shard.passes.speed_gate import SpeedDecision, shard_where_faster
from hlo_shard.passes.weight_update_sharding import (ShardingOptions, ShardingReport,
                                                     WeightUpdateSharding)
from hlo_shard.printer import to_text
from hlo_shard.validate import validate


def optimize_module(module: Module, options: ShardingOptions, force: bool = False
                    ) -> tuple[ShardingReport, str]:
    """Run the pass on ``module`` (in place) where the cost model predicts it faster
    (``force``: everything eligible); the report and the validated text."""
    report, text, _ = optimize_where_faster(module, options, force)
    return report, text


def optimize_where_faster(module: Module, options: ShardingOptions, force: bool = False,
                          after_pass: AfterPass | None = None
                          ) -> tuple[ShardingReport, str, SpeedDecision]:
    """:func:`optimize_module` with the speed decision (for ``--explain``); the options
    are checked (and the profile loaded) before the module is touched. ``after_pass``
    sees each pass of the pipeline that edits ``module`` (for ``--verbose``)."""
    report, decision = shard_where_faster(module, WeightUpdateSharding(options), force,
                                          after_pass)
    return report, check_output(module), decision


def check_output(module: Module) -> str:
    """The module's text for XLA (:func:`~hlo_shard.printer.to_text` ``for_xla``), after
    checking that it parses back and validates."""
    text = to_text(module, for_xla=True)
    try:
        reparsed = parse(text, path="<optimized output>")
    except HloShardError as err:
        raise HloShardError(f"refusing to write: the optimized module does not parse back "
                            f"({err})") from None
    problems = validate(reparsed)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise HloShardError(f"refusing to write: the optimized module fails validation: "
                            f"{problems[0]}{more}")
    return text


__all__ = ["check_output", "optimize_module", "optimize_where_faster"]
