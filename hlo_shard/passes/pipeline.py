"""Run passes in order, checking the module after each one (torch.fx's
``run_checks_after_each_pass``, xDSL's ``PassPipeline`` callback). Each pass run gets
one new :class:`~hlo_shard.graph.ModuleRewriter` (:func:`~hlo_shard.passes.base.run_pass`):
its log is what the pass changed.

A pass that leaves a module the check rejects is named in the error, so a slip shows
where it happened rather than at the end of a long pipeline (or in XLA). The default
check reads what the pass's log says it edited (and what reads the header everywhere):
the rest is as the previous check found it. A problem a
later pass of the pipeline ``repairs`` (the entry layout after a pass changing the
signature, duplicate channel ids) is left to that pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hlo_shard.errors import HloShardError
from hlo_shard.graph import Change
from hlo_shard.ir import Module
from hlo_shard.parser import cyclic_gc_paused, parse
from hlo_shard.passes.base import Pass, PassResult, run_pass
from hlo_shard.printer import to_text
from hlo_shard.validate import validate

#: Problems with a module (empty: fine); :func:`hlo_shard.validate.validate` is one.
Check = Callable[[Module], Sequence[object]]
#: Called after each pass (and its check) with the pass and its result.
AfterPass = Callable[[Pass, PassResult], None]

T = TypeVar("T")


def validate_printed(module: Module) -> list[object]:
    """The stricter check ``optimize`` makes before writing: the printed module parses
    back, and what is read back validates (the entry's signature against the header's
    among the validator's checks: a later pass may repair that one)."""
    try:
        reparsed = parse(to_text(module), path="<pass output>", entry_signature=False)
    except HloShardError as err:
        return [f"its text does not parse back: {err}"]
    return list(validate(reparsed))


class PassCheckError(HloShardError):
    """A pass left a module that fails the pipeline's check (a bug in that pass)."""

    def __init__(self, pass_name: str, problems: Sequence[object]) -> None:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"pass {pass_name} left an invalid module: {problems[0]}{more}")
        self.pass_name = pass_name
        self.problems = list(problems)


@dataclass(frozen=True)
class PipelineResult:
    """The module after every pass and each pass's result, in order."""

    module: Module
    results: tuple[PassResult, ...]

    @property
    def changed(self) -> bool:
        return any(result.changed for result in self.results)

    @property
    def notes(self) -> list[str]:
        """Every pass's report ``notes`` (what ``--explain`` prints), in pass order."""
        return [note for result in self.results
                for note in getattr(result.report, "notes", None) or ()]

    def report(self, kind: type[T]) -> T:
        """The report of the (last) pass whose report is a ``kind``."""
        for result in reversed(self.results):
            if isinstance(result.report, kind):
                return result.report
        raise KeyError(f"no pass reported a {kind.__name__}")


@dataclass(frozen=True)
class Pipeline:
    """``passes`` run in order on a module, in place; ``check`` runs after each pass
    that changed it (None: no check) and fails on a kind of problem the input did not
    have, then ``after_pass``."""

    passes: tuple[Pass[Any], ...]
    check: Check | None = validate
    after_pass: AfterPass | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "passes", tuple(self.passes))

    def run(self, module: Module, known_problems: InputProblems | None = None
            ) -> PipelineResult:
        """``known_problems``: :meth:`problems_before` of ``module`` or of the module it
        is a copy of, where the caller has them (the speed gate runs the pipeline on
        copies of one module)."""
        with cyclic_gc_paused():
            return self._run(module, known_problems)

    def problems_before(self, module: Module) -> frozenset[str]:
        """The kinds of problem the check finds in ``module`` before any pass. What the
        input has already (a header without the device counts a later pass recovers:
        device ids out of range, wherever the passes move them) is not a pass's slip:
        each pass is held to adding no kind of problem the input lacks."""
        return frozenset(map(_kind, self.check(module))) if self.check is not None \
            else frozenset()

    def _run(self, module: Module, known_problems: InputProblems | None) -> PipelineResult:
        results = []
        if known_problems is None:
            known_problems = InputProblems(self, module)
        known_problems.before_editing(module)
        for position, step in enumerate(self.passes):
            result = run_pass(step, module)
            if self.check is not None and result.changed:  # unchanged: nothing to find
                later = frozenset().union(*(p.repairs for p in self.passes[position + 1:]))
                problems = [p for p in self._problems_after(module, result)
                            if _kind(p) not in later]
                if problems:
                    before = known_problems.kinds()
                    problems = [p for p in problems if _kind(p) not in before]
                if problems:
                    raise PassCheckError(step.name, problems)
            if self.after_pass is not None:
                self.after_pass(step, result)
            results.append(result)
        return PipelineResult(module, tuple(results))

    def _problems_after(self, module: Module, result: PassResult) -> Sequence[object]:
        """The check of ``module`` after a pass that changed it. The default check,
        :func:`~hlo_shard.validate.validate`, reads in full only the computations the
        pass's log says it edited or added: the others are as the previous check found
        them (their problems, if any, of kinds the input had) but for what reads the
        header, which it checks everywhere."""
        assert self.check is not None
        if self.check is validate:
            return validate(module, edited_computations(result.changes))
        return self.check(module)


class InputProblems:
    """:meth:`Pipeline.problems_before` of one module, found the first time a pass's
    check finds something: a run whose passes add no problem never needs them, so a
    caller running the pipeline on copies of a module (the speed gate) checks that
    module in full only then. The module must stay as it is until :meth:`kinds` has
    been called (:meth:`before_editing`)."""

    def __init__(self, pipeline: Pipeline, module: Module) -> None:
        self._pipeline = pipeline
        self._module = module
        self._kinds: frozenset[str] | None = None

    def kinds(self) -> frozenset[str]:
        if self._kinds is None:
            self._kinds = self._pipeline.problems_before(self._module)
        return self._kinds

    def before_editing(self, module: Module) -> None:
        """``module`` is about to be edited in place: if it is the one checked, check it
        now."""
        if module is self._module:
            self.kinds()


def edited_computations(changes: Sequence[Change]) -> frozenset[str]:
    """The computations a log of edits edited or added (not those it removed)."""
    return frozenset(change.name if change.kind == "insert-computation" else change.computation
                     for change in changes if change.kind != "remove-computation")


def _kind(problem: object) -> str:
    """A problem's kind: the check of a :class:`~hlo_shard.validate.Problem`, the
    words of any other."""
    return str(getattr(problem, "check", problem))


__all__ = ["AfterPass", "Check", "InputProblems", "PassCheckError", "Pipeline",
           "PipelineResult", "validate_printed"]
