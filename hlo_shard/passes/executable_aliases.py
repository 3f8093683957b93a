"""The donation header of a module compiled as it stands (``hlo_shard.jax``): two passes
around the optimizer's pipeline, run by :func:`hlo_shard.passes.optimize.optimize`.

jit's module says what it donates in its header (``input_output_alias`` or a bare
``buffer_donor``), but which output is each parameter's next value the pytrees say
better (``params`` out → ``params`` in). :class:`NextValueAliases` writes those pairs as
the aliases the pass reads (to pair optimizer state with its next value);
:class:`ExecutableAliases` then gives the optimized module the aliases the executable
needs: every donated parameter aliased to an output of its shape (its next value where
the pytrees say which, else the first free one, as jit pairs them). A bare
``buffer_donor`` does not make the executable consume its inputs through this compile
path; an alias does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from hlo_shard.graph import ModuleRewriter
from hlo_shard.ir import (Alias, ArrayShape, BufferDonor, InputOutputAlias, Module, Shape,
                         TupleShape)
from hlo_shard.passes.base import ModulePass
from hlo_shard.passes.replica_form import DONATION_ATTRIBUTES

def donated_parameters(module: Module) -> tuple[int, ...]:
    """The entry parameters ``module``'s header donates (aliased or bare donors), sorted."""
    aliases, donors = module.header.get("input_output_alias"), module.header.get("buffer_donor")
    numbers = {alias.parameter for alias in aliases.entries} \
        if isinstance(aliases, InputOutputAlias) else set()
    numbers |= {number for number, _ in donors.donors} if isinstance(donors, BufferDonor) \
        else set()
    return tuple(sorted(numbers))


def _aliases(module: Module, pairs: Sequence[tuple[int, int]]) -> InputOutputAlias:
    """Output leaf ``k`` aliased to parameter ``p`` for each pair (a module whose result
    is one array has one output, ``{}``)."""
    tupled = isinstance(module.entry.root.shape, TupleShape)
    return InputOutputAlias(tuple(Alias((k,) if tupled else (), p) for k, p in pairs))


@dataclass(frozen=True)
class NextValueAliases(ModulePass[None]):
    """The donation header as the pytrees' (output leaf, parameter) pairs, where there
    are any (else the header stays)."""

    name: ClassVar[str] = "next-value-aliases"
    next_values: tuple[tuple[int, int], ...] = ()

    def apply(self, module: Module, rewriter: ModuleRewriter) -> None:
        if not self.next_values:
            return
        for key in DONATION_ATTRIBUTES:
            rewriter.pop_header(key)
        rewriter.set_header("input_output_alias", _aliases(module, self.next_values))


@dataclass(frozen=True)
class ExecutableAliases(ModulePass[None]):
    """Alias each of ``donors`` to an output of its shape in the (optimized) module:
    its next value per ``next_values`` where that output fits, else the first free
    output that does; a donor no output fits is not aliased."""

    name: ClassVar[str] = "executable-aliases"
    donors: tuple[int, ...] = ()
    next_values: tuple[tuple[int, int], ...] = ()

    def apply(self, module: Module, rewriter: ModuleRewriter) -> None:
        for key in DONATION_ATTRIBUTES:
            rewriter.pop_header(key)
        taken = self._pairs(module) if self.donors else {}
        if taken:
            rewriter.set_header("input_output_alias", _aliases(
                module, sorted(((k, p) for p, k in taken.items()), key=lambda pair: pair[0])))

    def _pairs(self, module: Module) -> dict[int, int]:
        """Donor → the output it is aliased to."""
        params = {p.parameter_number: p.shape for p in module.entry.parameters()}
        outputs = _outputs(module)
        preferred = {p: k for k, p in self.next_values}
        taken: dict[int, int] = {}
        for number in self.donors:
            choices = [preferred[number]] if number in preferred else []
            choices += [k for k in range(len(outputs)) if k not in choices]
            k = next((k for k in choices if k not in taken.values()
                      and _same_array(outputs[k], params.get(number))), None)
            if k is not None:
                taken[number] = k
        return taken


@dataclass(frozen=True)
class DonatedNextValueAliases(ModulePass[None]):
    """Each bare donor (``buffer_donor``) whose next value the pytrees name aliased to
    that output, the other donors left as they are: what the step donates does not
    change, and a reader of the text (``hlo-shard optimize``) pairs those parameters
    with their next values as ``hlo_shard.jax`` does (a bare donor says only that XLA
    may reuse the buffer for some output of its shape)."""

    name: ClassVar[str] = "donated-next-value-aliases"
    next_values: tuple[tuple[int, int], ...] = ()

    def apply(self, module: Module, rewriter: ModuleRewriter) -> None:
        donors = module.header.get("buffer_donor")
        if not isinstance(donors, BufferDonor):
            return
        aliases = module.header.get("input_output_alias")
        kept = aliases.entries if isinstance(aliases, InputOutputAlias) else ()
        params = {p.parameter_number: p.shape for p in module.entry.parameters()}
        outputs = _outputs(module)
        whole = {number for number, index in donors.donors if index == ()}
        taken = {alias.output for alias in kept}
        added: list[Alias] = []
        for alias in _aliases(module, self.next_values).entries:
            k = alias.output[0] if alias.output else 0
            # (one output per donor: a buffer is one output's)
            if alias.parameter in whole and alias.output not in taken and \
                    k < len(outputs) and _same_array(outputs[k], params.get(alias.parameter)):
                whole.discard(alias.parameter)
                taken.add(alias.output)
                added.append(alias)
        if not added:
            return
        paired = {alias.parameter for alias in added}
        rewriter.pop_header("buffer_donor")  # (printed after the aliases, as XLA does)
        rewriter.set_header("input_output_alias", InputOutputAlias(kept + tuple(added)))
        left = tuple(d for d in donors.donors if d[0] not in paired)
        if left:
            rewriter.set_header("buffer_donor", BufferDonor(left))


def _outputs(module: Module) -> list[Shape]:
    """The entry's output shapes by top-level index (one for an array result)."""
    root = module.entry.root
    return list(root.shape.elements) if isinstance(root.shape, TupleShape) else [root.shape]


def _same_array(a: object, b: object) -> bool:
    return isinstance(a, ArrayShape) and isinstance(b, ArrayShape) \
        and a.dims == b.dims and a.element_type == b.element_type


__all__ = ["DonatedNextValueAliases", "ExecutableAliases", "NextValueAliases",
           "donated_parameters"]
