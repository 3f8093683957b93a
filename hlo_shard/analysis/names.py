"""The user's names for a module's entry parameters and gradients.

jax writes each argument's pytree path into its entry parameter's ``op_name`` metadata
(``p['l0_w']``, ``s[0].mu['l0_w']``, ``b['x']``); ``--explain``, ``report``, ``diff``
and the manifest print it next to the HLO name, so that a user recognises their own
arrays. Instructions' ``op_name`` are jax call stacks (``jit(step)/…/dot_general``),
never names, and an ``op_name`` that does not read as a path is ignored: a module
without such metadata prints as it always did. ``hlo_shard.jax`` passes the names of
its own signature instead (``override``), which survive jit's argument pruning.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from hlo_shard.graph import reachable, users_map
from hlo_shard.ir import (ArrayShape, Computation, ComputationRef, Instruction, Module, Raw,
                          TupleShape)
from hlo_shard.values import c_unescape

#: Longer ``op_name`` are not taken for names (they would swamp every table).
MAX_NAME = 200

_QUOTED = r""""(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'"""
#: One ``key=value`` of a metadata value, or a quoted string skipped whole (so that an
#: ``op_name=`` inside another field's string is never read as the field).
_METADATA_FIELD_RE = re.compile(rf"(?P<key>[A-Za-z_][\w.\-]*)=(?P<value>{_QUOTED})|{_QUOTED}",
                                re.S)
#: A pytree path as ``jax.tree_util.keystr`` writes it: an identifier, then ``[0]``,
#: ``['key']`` or ``.attr`` steps.
_PATH_RE = re.compile(r"""[^\W\d]\w*(?:\[(?:\d+|'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\]"""
                      r"""|\.[^\W\d]\w*)*""")

#: A gradient all-reduce leaf: (all-reduce name, tuple index or None).
GradientKey = tuple[str, int | None]


def op_name(inst: Instruction) -> str | None:
    """The unescaped ``op_name`` of ``inst``'s metadata, if it has one."""
    metadata = inst.attr_as("metadata", Raw)
    if metadata is None or "op_name" not in metadata.text:
        return None
    for match in _METADATA_FIELD_RE.finditer(metadata.text):
        if match.group("key") == "op_name":
            return _utf8(c_unescape(match.group("value")))
    return None


def _utf8(text: str) -> str:
    """``text`` with octal-escaped UTF-8 bytes (absl::CEscape's ``\\303\\251``) decoded."""
    try:
        return text.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return text


def as_path(text: str | None) -> str | None:
    """``text`` when it reads as a pytree path short and printable enough to show."""
    if text is None or len(text) > MAX_NAME or not text.isprintable():
        return None
    return text if _PATH_RE.fullmatch(text) else None


def parameter_names(module: Module, override: Mapping[int, str] | None = None
                    ) -> dict[int, str]:
    """Entry parameter number → the user's name for it: ``override``'s where given,
    else the parameter's ``op_name`` where it reads as a path."""
    found = {}
    for param in module.entry.parameters():
        number = param.parameter_number
        assert number is not None
        name = override.get(number) if override is not None else None
        name = name or as_path(op_name(param))
        if name:
            found[number] = name
    return found


def instruction_names(module: Module) -> dict[str, str]:
    """Entry parameter instruction name (``param.16``) → the user's name for it."""
    names = parameter_names(module)
    return {p.name: names[p.parameter_number] for p in module.entry.parameters()
            if p.parameter_number in names}


def gradient_weights(comp: Computation, next_values: Sequence[tuple[int, int]],
                     values: Mapping[int, set[str]] | None = None
                     ) -> dict[GradientKey, int]:
    """Gradient all-reduce → the weight it updates: the ``p`` of the one pair of
    ``next_values`` (output leaf ``k`` is the next value of ``p``) whose output has the
    all-reduce's shape and is reached from it, and whose ``p`` the gradient was computed
    from (which tells the weight from its optimizer state) — where all such pairs name
    one ``p``. ``values``: the
    instructions that stand for each ``p`` (default: the entry parameter numbered
    ``p``; in a loop body, the ``get-tuple-element`` instructions of carried slot ``p``)."""
    flow = _ElementFlow(comp)
    root = comp.root
    outputs = list(root.operands) if root.opcode == "tuple" else [root.name]
    shapes = list(root.shape.elements) if isinstance(root.shape, TupleShape) else [root.shape]
    if values is None:
        values = {p.parameter_number: {p.name} for p in comp.parameters()
                  if p.parameter_number is not None}
    pairs = [(k, p) for k, p in next_values if k < len(outputs) and values.get(p)]
    found: dict[GradientKey, int] = {}
    for key, reached, sources, shape in flow.gradient_leaves():
        dims = _sorted_dims(shape)
        fits = [p for k, p in pairs if outputs[k] in reached and values[p] & sources
                and _sorted_dims(shapes[k]) == dims]
        if len(set(fits)) == 1:
            found[key] = fits[0]
    return found


def loop_gradient_weights(module: Module) -> dict[GradientKey, int]:
    """The gradients of the entry's training loops (``while`` bodies carrying the
    weights, as a ``lax.fori_loop`` over steps does) → entry parameter: the body's
    output ``i`` is carried slot ``i``'s next value, and a slot stands for the entry
    parameter the loop starts it from (through copies), where it starts no other."""
    entry = module.entry
    params = {p.name: p.parameter_number for p in entry.parameters()}
    found: dict[GradientKey, int] = {}
    for loop in entry.instructions:
        body_ref = loop.attr_as("body", ComputationRef)
        init = entry[loop.operands[0]] if loop.opcode == "while" and loop.operands else None
        if body_ref is None or init is None or init.opcode != "tuple":
            continue
        start = {i: params.get(_through_copies(entry, operand))
                 for i, operand in enumerate(init.operands)}
        body = module.computation(body_ref.name)
        carried = body.parameters()
        if len(carried) != 1:
            continue
        slots: dict[int, set[str]] = {}
        for inst in body.instructions:
            index = inst.int_attr("index") if inst.opcode == "get-tuple-element" else None
            if index is not None and inst.operands[0] == carried[0].name:
                slots.setdefault(index, set()).add(inst.name)
        starts = Counter(start.values())
        weights = gradient_weights(body, [(i, i) for i in slots], slots)
        found.update({key: p for key, i in weights.items()
                      if (p := start.get(i)) is not None and starts[p] == 1})
    return found


def _through_copies(comp: Computation, name: str) -> str:
    while comp[name].opcode == "copy":
        name = comp[name].operands[0]
    return name


class _ElementFlow:
    """Reachability that follows each element of a tuple through its
    ``get-tuple-element``: a shard_map body returns all its results in one tuple, which
    would otherwise join every gradient to every output."""

    def __init__(self, comp: Computation) -> None:
        self.comp = comp
        self.users = users_map(comp)

    def _element(self, name: str) -> int | None:
        inst = self.comp[name]
        return inst.int_attr("index") if inst.opcode == "get-tuple-element" else None

    def _next(self, name: str) -> list[str]:
        out = []
        for user in self.users[name]:
            inst = self.comp[user]
            readers = self.users[user]
            if inst.opcode == "tuple" and readers and all(
                    self._element(r) is not None for r in readers):
                positions = {i for i, o in enumerate(inst.operands) if o == name}
                out += [r for r in readers if self._element(r) in positions]
            else:
                out.append(user)
        return out

    def _previous(self, name: str) -> list[str]:
        inst = self.comp[name]
        index = self._element(name)
        if index is not None and self.comp[inst.operands[0]].opcode == "tuple":
            return [self.comp[inst.operands[0]].operands[index]]
        return list(inst.operands)

    def reached(self, name: str) -> set[str]:
        return reachable([name], self._next)

    def sources(self, name: str) -> set[str]:
        return reachable([name], self._previous)

    def gradient_leaves(self) -> Iterator[tuple[GradientKey, set[str], set[str],
                                                ArrayShape | TupleShape]]:
        """Each all-reduce leaf (an array one, or each element of a tuple one, as XLA's
        combiner leaves them): its key, what it reaches, what it was computed from, and
        its shape."""
        for inst in self.comp.instructions:
            if inst.opcode != "all-reduce":
                continue
            if isinstance(inst.shape, ArrayShape):
                yield (inst.name, None), self.reached(inst.name), self.sources(inst.name), \
                    inst.shape
                continue
            if len(inst.operands) != len(inst.shape.elements):
                continue
            for index, (operand, shape) in enumerate(zip(inst.operands, inst.shape.elements)):
                getters = [r for r in self.users[inst.name] if self._element(r) == index]
                reached = set(getters).union(*(self.reached(g) for g in getters))
                yield (inst.name, index), reached, {operand} | self.sources(operand), shape


def _sorted_dims(shape: ArrayShape | TupleShape) -> list[int] | None:
    return sorted(shape.dims) if isinstance(shape, ArrayShape) else None


@dataclass(frozen=True)
class UserNames:
    """The user's names of one module: its entry parameters, and the weight each
    gradient all-reduce leaf is the gradient of."""

    parameters: dict[int, str] = field(default_factory=dict)
    gradients: dict[GradientKey, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.parameters)

    def gradient_of(self, all_reduce: str, index: int | None) -> str | None:
        weight = self.gradients.get((all_reduce, index))
        return None if weight is None else self.parameters.get(weight)

    def explained(self, row: dict) -> dict:
        """An ``--explain`` row's JSON with the weight it is the gradient of
        (``gradient_of``, null where unknown)."""
        return {**row, "gradient_of": self.gradient_of(row["all_reduce"], row["index"])}

    def note(self, text: str) -> str:
        """A pass note naming an optimizer state parameter (``optimizer state parameter
        5 (%param.3 f32[13]{0})``) with the user's name added in its parentheses."""
        match = _STATE_NOTE_RE.match(text)
        name = self.parameters.get(int(match.group("number"))) if match else None
        if match is None or name is None:
            return text
        return f"{text[:match.end('inside')]}, {name}{text[match.end('inside'):]}"


_STATE_NOTE_RE = re.compile(r"optimizer state parameter (?P<number>\d+) \((?P<inside>%[^)]*)\)")


def user_names(module: Module, next_values: Sequence[tuple[int, int]] | None = None,
               override: Mapping[int, str] | None = None) -> UserNames:
    """The user's names of ``module``, read before the pass rewrites it. ``next_values``:
    its (output leaf, parameter) pairs, by default its ``input_output_alias`` (jit's
    donation pairs each parameter with its next value), else every output with every
    parameter of its shape (the one-fit rule of :func:`gradient_weights` then names
    only what the graph tells apart); ``hlo_shard.jax`` passes the pairs its pytrees
    say."""
    parameters = parameter_names(module, override)
    if not parameters:
        return UserNames(parameters)
    if next_values is None:
        next_values = list(module.output_aliases().items()) or _same_shapes(module)
    return UserNames(parameters, {**gradient_weights(module.entry, next_values),
                                  **loop_gradient_weights(module)})


def _same_shapes(module: Module) -> list[tuple[int, int]]:
    """(output leaf, parameter) of every output and entry parameter of one array type."""
    root = module.entry.root
    outputs = list(root.shape.elements) if isinstance(root.shape, TupleShape) else [root.shape]

    def kind(shape: ArrayShape | TupleShape) -> tuple | None:
        return (shape.element_type, shape.dims) if isinstance(shape, ArrayShape) else None

    return [(k, p.parameter_number) for k, out in enumerate(outputs)
            for p in module.entry.parameters()
            if p.parameter_number is not None and kind(out) is not None
            and kind(out) == kind(p.shape)]


def labelled(hlo_name: str, name: str | None) -> str:
    """``param.16 (p['l0_w'])``, or the HLO name alone where the user's is unknown."""
    return f"{hlo_name} ({name})" if name else hlo_name


__all__ = ["MAX_NAME", "UserNames", "as_path", "gradient_weights", "instruction_names",
           "labelled", "op_name", "parameter_names", "user_names"]
