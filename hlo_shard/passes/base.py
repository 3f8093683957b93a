"""The pass contract: a pass is a small frozen dataclass and one ``apply``.

As in xDSL (``ModulePass``) and torch.fx (``PassBase``): the pass's ``name`` is a class
constant, its options are typed fields resolved before it runs (a ``HardwareProfile``,
not a profile name: an option error is raised building the pass, never half way through
a module), and ``apply(module)`` edits the module in place and says what it did in a
:class:`PassResult` with a typed report. :class:`hlo_shard.passes.pipeline.Pipeline`
runs passes in order and checks the module after each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Protocol, TypeVar

from hlo_shard.graph import Change
from hlo_shard.ir import Module

ReportT = TypeVar("ReportT")


@dataclass
class PassResult(Generic[ReportT]):
    """The (edited in place) module, whether anything changed, the Rewriter's log of the
    edits, and the pass's report (what ``--explain`` and tests read)."""

    module: Module
    changed: bool
    changes: list[Change] = field(default_factory=list)
    report: ReportT | None = None


class Pass(Protocol[ReportT]):
    """What a pipeline needs of a pass (anything with a name and ``apply``)."""

    name: ClassVar[str]
    #: Validator checks (:class:`hlo_shard.validate.Problem` ``check`` names) this pass
    #: makes pass: a pipeline defers them for the passes before it (XLA's layout
    #: assignment after the passes that change shapes).
    repairs: ClassVar[frozenset[str]]

    def apply(self, module: Module) -> PassResult[ReportT]: ...


class ModulePass(ABC, Generic[ReportT]):
    """Base of the project's passes. Subclass as ``@dataclass(frozen=True)`` with the
    options as fields; resolve and check them in ``__post_init__`` (raising
    ``HloShardError`` worded for the library, not for one command line)."""

    name: ClassVar[str]
    repairs: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def apply(self, module: Module) -> PassResult[ReportT]:
        """Edit ``module`` in place; ``changed`` is True iff its text changed."""


__all__ = ["ModulePass", "Pass", "PassResult", "ReportT"]
