"""XLA dump folders: which file of one holds the per-device module of a training step.

Read by ``hlo-shard optimize DIR`` and by :mod:`hlo_shard.jax`'s capture (which dumps
the step's compile into a folder of its own), so it sits below both.
"""

from __future__ import annotations

from pathlib import Path

from hlo_shard.errors import HloShardError

#: Partitioner stages of an XLA dump holding the per-device module, best first:
#: shard_map bodies inlined, else right after partitioning.
SPMD_STAGES = (".spmd-partitioner.after_call-inliner.before_pipeline-end.txt",
               ".spmd-partitioner.after_spmd-partitioning.before_control-dep-rewriter.txt")
#: The XLA flags that write those stages.
DUMP_FLAGS = ("--xla_dump_to=DIR --xla_dump_hlo_pass_re=spmd-partitioning|call-inliner "
              "--xla_dump_large_constants")


def pick_dump_file(folder: Path) -> Path:
    """The per-device module of the training step in an XLA dump folder: the best
    partitioner stage present, the module of it with the most all-reduces (a training
    step sums its gradients; a jitted ``init``, with the model's initial values, can be
    the larger file), the largest of those; or an error listing what is there and how
    to dump it."""
    for stage in SPMD_STAGES:
        found = [p for p in folder.glob(f"module_*{stage}") if p.is_file()]
        if found:
            return max(found, key=lambda p: (_all_reduces(p), p.stat().st_size, p.name))
    modules = sorted({p.name.split(".")[1] for p in folder.glob("module_*.*.txt")
                      if p.name.count(".") >= 2})
    listed = f" (it has modules {', '.join(modules[:5])}{' …' if len(modules) > 5 else ''}" \
             f" but no partitioner stage)" if modules else " (no XLA dump files in it)"
    raise HloShardError(f"{folder}: no per-device module *{SPMD_STAGES[0]}{listed}; dump "
                        f"the step with XLA_FLAGS=\"{DUMP_FLAGS}\" or "
                        "hlo_shard.jax.per_device_hlo(step, *args)")


def _all_reduces(path: Path) -> int:
    """How many all-reduces (synchronous or started) the module text at ``path`` holds."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return text.count(" all-reduce(") + text.count(" all-reduce-start(")
