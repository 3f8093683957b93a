"""The same per-device data-parallel program for another replica count, as a pass.

The per-device program of data parallelism is the same for every replica count except
the size of the data-parallel group, so ``scale`` projects N devices by retargeting the
module's one group to N (every collective over it, the header's device count, tiled
parameter shardings) and re-running the weight-update pass on that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from hlo_shard.costmodel.network import COLLECTIVE_KINDS, group_size
from hlo_shard.analysis.collectives import find_gradient_all_reduces
from hlo_shard.errors import HloShardError
from hlo_shard.graph import ModuleRewriter
from hlo_shard.ir import Module, Raw, ReplicaGroups
from hlo_shard.passes.base import ModulePass


@dataclass(frozen=True)
class RetargetReport:
    #: The data-parallel group size before and after.
    from_devices: int
    to_devices: int


@dataclass(frozen=True)
class Retarget(ModulePass[RetargetReport]):
    """Retarget a data-parallel module (one group covering every device) to ``replicas``."""

    name: ClassVar[str] = "retarget"
    replicas: int

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise HloShardError(f"retarget needs at least one replica, not {self.replicas}")

    def apply(self, module: Module, rewriter: ModuleRewriter) -> RetargetReport:
        n0 = data_parallel_size(module)
        counts = {"replica_count": module.replica_count, "num_partitions": module.num_partitions}
        for key, count in counts.items():
            if count == n0:
                rewriter.set_header(key, self.replicas)
        for comp in module.computations:
            rw = rewriter.rewriter(comp)
            for inst in comp.instructions:
                if inst.opcode in COLLECTIVE_KINDS:
                    groups = inst.attr("replica_groups")
                    if isinstance(groups, ReplicaGroups) and groups.groups:
                        if len(groups.groups) != 1 or len(groups.groups[0]) != n0:
                            raise HloShardError(_other_groups(inst.name, inst.opcode,
                                                              groups, n0))
                        rw.set_attr(inst, "replica_groups",
                                    ReplicaGroups((tuple(range(self.replicas)),)))
                sharding = inst.attr("sharding")
                if isinstance(sharding, Raw) and "devices=" in sharding.text:
                    rw.set_attr(inst, "sharding",
                                Raw(_retarget_sharding(sharding.text, n0, self.replicas)))
        return RetargetReport(n0, self.replicas)


def _other_groups(name: str, opcode: str, groups: ReplicaGroups, n0: int) -> str:
    """Why ``scale`` stops at a collective over other groups than the data-parallel one:
    what it runs over, and what the command can still do with the module."""
    sizes = sorted({len(group) for group in groups.groups})
    over = f"{len(groups.groups)} group{'s' * (len(groups.groups) != 1)} of " \
        f"{'/'.join(map(str, sizes))} device{'s' * (sizes != [1])}"
    return (f"{name}: scale projects steps whose every collective runs over the one "
            f"data-parallel group of all {n0} devices, and this {opcode} runs over {over} "
            "(a reshard of the batch, a model axis): what it becomes at another device "
            "count depends on the mesh; report, optimize and verify take the module at its "
            "own size")


def data_parallel_size(module: Module) -> int:
    """N of the module: the group size of its gradient all-reduces."""
    sizes = {group_size(module.computation(ar.computation)[ar.name], module)
             for ar in find_gradient_all_reduces(module)}
    sizes.discard(1)
    if not sizes:
        raise HloShardError("scale needs a data-parallel module: it has no all-reduce over "
                            "more than one device")
    if len(sizes) != 1:
        raise HloShardError(
            "scale projects data-parallel steps only (every all-reduce over the same devices); "
            f"this one's run over groups of {' and '.join(map(str, sorted(sizes)))} devices "
            "(a mesh of several axes): optimize and verify it at its own size instead")
    return sizes.pop()


def _retarget_sharding(text: str, n0: int, n: int) -> str:
    """``{devices=[8,1]<=[8]}`` or ``{devices=[8,1]0,1,…,7}`` → the same tiling over n."""
    match = re.search(r"devices=\[([\d,]+)\]\s*(<=\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)", text)
    if not match:
        return text
    tiles = [int(t) for t in match.group(1).split(",")]
    if n0 not in tiles:
        return text
    tiles[tiles.index(n0)] = n
    total = 1
    for t in tiles:
        total *= t
    replacement = f"devices=[{','.join(map(str, tiles))}]<=[{total}]"
    return text[:match.start()] + replacement + text[match.end():]


__all__ = ["Retarget", "RetargetReport", "data_parallel_size"]
