"""Rewrite ``entry_computation_layout`` when the entry's signature no longer matches it.

The weight-update pass with sharded optimizer state gives entry parameters and outputs
``[L]`` shard shapes; the header must then declare them. Whether it does is read from
the module (the declared shapes, layouts aside, against the entry's), so a signature
left as it was keeps its header text exactly (XLA's ``/*index=5*/`` comments included).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from hlo_shard.graph import ModuleRewriter
from hlo_shard.ir import Module, Raw
from hlo_shard.passes.base import ModulePass
from hlo_shard.printer import format_shape

#: Layouts (``{1,0}``), comments and spaces: what two layouts of one signature may differ in.
_NOT_SHAPES = re.compile(r"\{[^{}]*\}|/\*.*?\*/|\s")


@dataclass(frozen=True)
class EntryLayoutReport:
    """The layout written (None: the header already matched, or has none)."""

    layout: str | None


@dataclass(frozen=True)
class EntryLayoutUpdate(ModulePass[EntryLayoutReport]):
    """Declare the entry's parameter and result shapes in ``entry_computation_layout``."""

    name: ClassVar[str] = "entry-layout-update"
    #: The check this pass makes pass: a pipeline does not fail the passes before it on it.
    repairs: ClassVar[frozenset[str]] = frozenset({"entry-layout"})

    def apply(self, module: Module, rewriter: ModuleRewriter) -> EntryLayoutReport:
        declared = module.header.get("entry_computation_layout")
        if not isinstance(declared, Raw):
            return EntryLayoutReport(None)
        entry = module.entry
        params = ", ".join(format_shape(p.shape) for p in entry.parameters())
        signature = f"({params})->{format_shape(entry.root.shape)}"
        if _shapes(signature) == _shapes(declared.text.strip().removeprefix("{")
                                         .removesuffix("}")):
            return EntryLayoutReport(None)
        layout = f"{{{signature}}}"
        rewriter.set_header("entry_computation_layout", Raw(layout))
        return EntryLayoutReport(layout)


def _shapes(signature: str) -> str:
    """``(f32[6]{0}, /*index=1*/s32[])->f32[6]{0}`` → ``(f32[6],s32[])->f32[6]``."""
    return _NOT_SHAPES.sub("", signature)


__all__ = ["EntryLayoutReport", "EntryLayoutUpdate"]
