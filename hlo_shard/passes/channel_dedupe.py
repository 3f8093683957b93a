"""Give every collective that shares its channel id with an earlier one a fresh id.

XLA requires unique channel ids; jax's output can repeat them (the module kept whole is
then still valid to write). Run after the passes that emit collectives: the fresh ids
continue after the largest id in use, as XLA numbers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hlo_shard.graph import ModuleRewriter
from hlo_shard.ir import Module
from hlo_shard.opinfo import CHANNEL_UNIQUE
from hlo_shard.passes.base import ModulePass
from hlo_shard.passes.weight_update import ChannelIds


@dataclass(frozen=True)
class RenumberedChannels:
    """How many collectives got a fresh channel id."""

    renumbered: int

    @property
    def notes(self) -> list[str]:
        """What ``--explain`` and ``--json`` say."""
        if not self.renumbered:
            return []
        return [f"renumbered {self.renumbered} duplicate collective channel id(s)"]


@dataclass(frozen=True)
class ChannelIdDedupe(ModulePass[RenumberedChannels]):
    """Renumber duplicate collective channel ids (the first user of an id keeps it)."""

    name: ClassVar[str] = "channel-id-dedupe"
    #: The check this pass makes pass: a pipeline does not fail the passes before it on it.
    repairs: ClassVar[frozenset[str]] = frozenset({"unique-channel-ids"})

    def apply(self, module: Module, rewriter: ModuleRewriter) -> RenumberedChannels:
        channels = ChannelIds(module)
        seen: set[int] = set()
        renumbered = 0
        for comp in module.computations:
            for inst in comp.instructions:
                if inst.opcode not in CHANNEL_UNIQUE:
                    continue
                channel = inst.int_attr("channel_id")
                if channel is None:
                    continue
                if channel in seen:
                    rewriter.rewriter(comp).set_attr(inst, "channel_id", channels.fresh())
                    renumbered += 1
                else:
                    seen.add(channel)
        return RenumberedChannels(renumbered)


__all__ = ["ChannelIdDedupe", "RenumberedChannels"]
