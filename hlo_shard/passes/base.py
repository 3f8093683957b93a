"""The pass contract: a pass is a small frozen dataclass and one ``apply``.

As in xDSL (``ModulePass``) and torch.fx (``PassBase``): the pass's ``name`` is a class
constant, its options are typed fields resolved before it runs (a ``HardwareProfile``,
not a profile name: an option error is raised building the pass, never half way through
a module), and ``apply(module, rewriter)`` edits the module in place, every edit through
the one :class:`~hlo_shard.graph.ModuleRewriter` it is handed (xDSL's
``PatternRewriter``: header and computation list there, each computation through
``rewriter.rewriter(comp)``), and returns its typed report. Whoever runs the pass makes
that rewriter — :func:`run_pass`, which :class:`hlo_shard.passes.pipeline.Pipeline` and
:meth:`ModulePass.run` use — so what a pass did (:class:`PassResult` ``changed`` and
``changes``) is the rewriter's log, never the pass's own account.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Protocol, TypeVar

from hlo_shard.graph import Change, ModuleRewriter
from hlo_shard.ir import Module

ReportT = TypeVar("ReportT")
#: A pass only produces its report (what a ``Pass[Report]`` may stand for).
ReportT_co = TypeVar("ReportT_co", covariant=True)


@dataclass
class PassResult(Generic[ReportT]):
    """The (edited in place) module, whether anything changed, the Rewriter's log of the
    edits, and the pass's report (what ``--explain`` and tests read)."""

    module: Module
    changed: bool
    changes: list[Change] = field(default_factory=list)
    report: ReportT | None = None


class Pass(Protocol[ReportT_co]):
    """What a pipeline needs of a pass (anything with a name and ``apply``)."""

    name: ClassVar[str]
    #: Validator checks (:class:`hlo_shard.validate.Problem` ``check`` names) this pass
    #: makes pass: a pipeline defers them for the passes before it (XLA's layout
    #: assignment after the passes that change shapes).
    repairs: ClassVar[frozenset[str]]

    def apply(self, module: Module, rewriter: ModuleRewriter) -> ReportT_co: ...


def run_pass(step: Pass[ReportT], module: Module) -> PassResult[ReportT]:
    """``step`` on ``module`` (in place) through one new rewriter; what changed is its log."""
    rewriter = ModuleRewriter(module)
    report = step.apply(module, rewriter)
    return PassResult(module, bool(rewriter.changes), rewriter.changes, report=report)


class ModulePass(ABC, Generic[ReportT]):
    """Base of the project's passes. Subclass as ``@dataclass(frozen=True)`` with the
    options as fields; resolve and check them in ``__post_init__`` (raising
    ``HloShardError`` worded for the library, not for one command line)."""

    name: ClassVar[str]
    repairs: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def apply(self, module: Module, rewriter: ModuleRewriter) -> ReportT:
        """Edit ``module`` in place, every edit through ``rewriter`` (whose log then
        says whether its text changed, and how); return the report."""

    def run(self, module: Module) -> PassResult[ReportT]:
        """This pass alone on ``module`` (in place), unchecked: :func:`run_pass`."""
        return run_pass(self, module)


__all__ = ["ModulePass", "Pass", "PassResult", "ReportT", "run_pass"]
