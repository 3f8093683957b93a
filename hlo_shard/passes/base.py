"""What every pass is: a name and one ``apply(module) -> PassResult``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from hlo_shard.graph import Change
from hlo_shard.ir import Module


@dataclass
class PassResult:
    """The (edited in place) module, whether anything changed, the edit log, and
    pass-specific notes (for the weight-update pass: one explanation per gradient)."""

    module: Module
    changed: bool
    changes: list[Change] = field(default_factory=list)
    notes: list[Any] = field(default_factory=list)


class Pass(Protocol):
    name: str

    def apply(self, module: Module) -> PassResult: ...
