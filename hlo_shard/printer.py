""":class:`hlo_shard.ir.Module` → HLO text that XLA's parser reads back as the same module.

Always the long form: ``%`` names, computation signatures, ``ENTRY``/``ROOT``, result
shapes, no operand shapes. Callees come before callers; instructions keep their
order where it is a valid def-before-use order (and always in scheduled modules).
Typed attribute values are printed canonically, :class:`~hlo_shard.ir.Raw` ones
verbatim, so printing a parsed module twice gives the same text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar, cast

from hlo_shard.graph import Change, callees_first, topological_order
from hlo_shard.ir import (
    Alias, ArrayShape, AttrValue, BufferDonor, Computation, ComputationList, ComputationRef,
    Ident, InputOutputAlias, Instruction, Module, Raw, ReplicaGroups, Shape, ShapeIndex,
    SliceRanges, Str, TupleShape,
)
from hlo_shard.values import c_quote, read_mesh_axes

__all__ = ["format_change", "format_shape", "format_value", "mesh_forms_compile", "to_text"]


def format_shape(shape: Shape) -> str:
    """``f32[8,4]{1,0}``, ``(f32[], (s32[2]{0}, pred[]))``, ``f32[<=8,?]``, ``b(f32[4]{0})``."""
    if not isinstance(shape, ArrayShape):
        return "(" + ", ".join(format_shape(s) for s in shape.elements) + ")"
    if shape.buffer:
        return f"b({format_shape(dataclasses.replace(shape, buffer=False))})"
    if shape.dynamic:
        dims = ",".join("?" if kind == "?" else f"{kind}{d}"
                        for d, kind in zip(shape.dims, shape.dynamic))
    else:
        dims = ",".join(map(str, shape.dims))
    layout = shape.layout
    if layout is None or (not layout.minor_to_major and not layout.tail):
        return f"{shape.element_type}[{dims}]"
    order = ",".join(map(str, layout.minor_to_major))
    tail = f":{layout.tail}" if layout.tail else ""
    return f"{shape.element_type}[{dims}]{{{order}{tail}}}"


def _format_int_list(values: tuple) -> str:
    return "{" + ",".join(
        _format_int_list(v) if isinstance(v, tuple) else str(v) for v in values) + "}"


def _format_float(value: float) -> str:
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


_V = TypeVar("_V")
ValuePrinter = Callable[[AttrValue], str]


def _printer(kind: type[_V], print_value: Callable[[_V], str]) -> tuple[type, ValuePrinter]:
    """A table entry: the checker sees that ``print_value`` takes a ``kind``.

    The table forgets that pairing (no mypy type maps each key to its own value type);
    the lookup by the value's exact type restores it, so the cast cannot lie."""
    return kind, cast(ValuePrinter, print_value)


#: Value type → printer. bool is listed before int (bool is an int subclass) and the
#: lookup goes by exact type.
def _shape_index(index: ShapeIndex) -> str:
    return "{" + ",".join(map(str, index)) + "}"


def _alias(alias: Alias) -> str:
    """As XLA's ``HloInputOutputAliasConfig::ToShortString`` writes one entry."""
    kind = f", {alias.kind}" if alias.kind is not None else ""
    return (f"{_shape_index(alias.output)}: ({alias.parameter}, "
            f"{_shape_index(alias.parameter_index)}{kind})")


def _braced_entries(entries: list[str]) -> str:
    """``{ a, b }`` as XLA's module printer writes a donation config; ``{}`` when empty."""
    return "{ " + ", ".join(entries) + " }" if entries else "{}"


_VALUE_FORMATS: dict[type, ValuePrinter] = dict([
    _printer(bool, lambda v: "true" if v else "false"),
    _printer(int, str),
    _printer(float, _format_float),
    _printer(tuple, _format_int_list),
    _printer(Raw, lambda v: v.text),
    _printer(Ident, lambda v: v.name),
    _printer(Str, lambda v: c_quote(v.value)),
    _printer(ComputationRef, lambda v: f"%{v.name}"),
    _printer(ComputationList, lambda v: "{" + ", ".join(f"%{n}" for n in v.names) + "}"),
    _printer(SliceRanges, lambda v: "{" + ", ".join(
        f"[{a}:{b}]" if c == 1 else f"[{a}:{b}:{c}]" for a, b, c in v.ranges) + "}"),
    _printer(ReplicaGroups,
             lambda v: v.text if v.text is not None else _format_int_list(v.groups)),
    _printer(InputOutputAlias, lambda v: _braced_entries([_alias(a) for a in v.entries])),
    _printer(BufferDonor, lambda v: _braced_entries(
        [f"({number}, {_shape_index(index)})" for number, index in v.donors])),
])


def format_value(value: AttrValue) -> str:
    """An attribute value as it appears after ``name=``."""
    return _VALUE_FORMATS[type(value)](value)


class _Printer:
    """Formats one module; caches shape texts (most shapes repeat many times).
    ``explicit_mesh_groups`` prints mesh replica groups as their explicit groups."""

    def __init__(self, explicit_mesh_groups: bool = False) -> None:
        self._shapes: dict[int, str] = {}
        self._formats = _VALUE_FORMATS if not explicit_mesh_groups else {
            **_VALUE_FORMATS, ReplicaGroups: _explicit_if_mesh}

    def shape(self, shape: Shape) -> str:
        text = self._shapes.get(id(shape))
        if text is None:
            text = self._shapes[id(shape)] = format_shape(shape)
        return text

    def module(self, module: Module) -> str:
        header = "HloModule " + module.name + "".join(
            f", {key}={format_value(value)}" for key, value in module.header.items())
        parts = [header]
        if module.stack_frames:
            parts.append(module.stack_frames)
        scheduled = module.is_scheduled
        parts.extend(self.computation(comp, scheduled) for comp in callees_first(module))
        return "\n\n".join(parts) + "\n"

    def computation(self, comp: Computation, scheduled: bool) -> str:
        params = ", ".join(f"{p.name}: {self.shape(p.shape)}" for p in comp.parameters())
        head = (f"{'ENTRY ' if comp.is_entry else ''}%{comp.name} ({params}) -> "
                f"{self.shape(comp.root.shape)} {{")
        order = comp.instructions if scheduled else topological_order(comp)
        root = comp.root_name
        lines = [head]
        lines.extend(self.instruction(inst, inst.name == root) for inst in order)
        tail = "}"
        if comp.execution_thread is not None:
            tail += f", execution_thread={c_quote(comp.execution_thread)}"
        lines.append(tail)
        return "\n".join(lines)

    def instruction(self, inst: Instruction, is_root: bool) -> str:
        if inst.parameter_number is not None:
            body = f"parameter({inst.parameter_number})"
        elif inst.literal is not None:
            body = f"constant({inst.literal})"
        else:
            body = f"{inst.opcode}(" + ", ".join("%" + o for o in inst.operands) + ")"
        attrs = inst.attributes
        text = f"  {'ROOT ' if is_root else ''}%{inst.name} = {self.shape(inst.shape)} {body}"
        if attrs:
            formats = self._formats
            text += "".join(f", {key}={formats[type(value)](value)}"
                            for key, value in attrs.items())
        return text


def _is_mesh_form(groups: ReplicaGroups) -> bool:
    return groups.text is not None and groups.text.startswith("mesh")


def _explicit_if_mesh(value: AttrValue) -> str:
    groups = cast(ReplicaGroups, value)
    return _format_int_list(groups.groups) if _is_mesh_form(groups) else \
        _VALUE_FORMATS[ReplicaGroups](groups)


def _mesh_forms(module: Module) -> list[ReplicaGroups]:
    return [groups for comp in module.computations for inst in comp.instructions
            if isinstance(groups := inst.attributes.get("replica_groups"), ReplicaGroups)
            and _is_mesh_form(groups)]


def mesh_forms_compile(module: Module) -> bool:
    """Whether XLA compiles the module's mesh replica groups as they read.

    jax compiles HLO text through MLIR (``xla_computation_to_mlir_module``), whose
    import turns each mesh into a module-level ``sdy.mesh`` matched by axis names and
    sizes alone. Checked with jaxlib 0.10.2 on 8 CPU devices: with two different meshes
    in one module, collectives are bound to the wrong one (an unknown-axis error, or,
    worse, a program that compiles and reduces over the wrong groups), and a mesh's
    ``device_ids`` are dropped (the groups of the iota order run instead). One mesh in
    iota order, however many collectives and axes use it, compiles right. (Unquoted axis
    names, an older printer's, XLA's parser refuses.)"""
    meshes = set()
    for groups in _mesh_forms(module):
        mesh = read_mesh_axes(cast(str, groups.text))
        if not mesh.iota or not mesh.quoted:
            return False
        meshes.add(mesh.mesh)
    return len(meshes) <= 1


def to_text(module: Module, *, for_xla: bool = False) -> str:
    """The module as HLO text (long form). ``for_xla``: the text is for XLA to compile,
    so mesh replica groups it would misread (:func:`mesh_forms_compile`) are printed as
    their explicit groups, which mean the same devices; otherwise every value prints as
    it was read."""
    return _Printer(for_xla and not mesh_forms_compile(module)).module(module)


# ------------------------------------------------------------------ the change log

#: How each kind of :class:`~hlo_shard.graph.Change` reads, after where it happened
#: (``{name}``, ``{detail}``, ``{before}``, ``{after}``); another kind prints its
#: fields as they are.
_CHANGE_TEXTS: dict[str, str] = {
    "insert": "inserts %{name} ({detail})",
    "erase": "erases %{name} ({detail})",
    "replace-uses": "points the users of %{name} at %{detail}",
    "set-root": "makes %{name} the root",
    "set-operand": "%{name} operand {detail}",
    "set-operands": "%{name} operands ({detail})",
    "set-opcode": "%{name} opcode {detail}",
    "set-shape": "%{name} shape {before} -> {after}",
    "set-attr": "%{name} {detail}: {before} -> {after}",
    "pop-attr": "%{name} {detail}: {before} -> unset",
    "reorder": "instructions reordered (def before use)",
    "set-header": "header {name}: {before} -> {after}",
    "pop-header": "header {name}: {before} -> unset",
    "insert-computation": "adds computation %{name} ({detail})",
    "remove-computation": "removes computation %{name} (called by nothing)",
}
_CHANGE_DEFAULT = "{kind} {name} {detail}"
#: Longest value a change line shows in full (layouts and tuple shapes run long):
#: beyond it, what the old and new value share at either end is elided.
_CHANGE_VALUE_CHARS = 60


def format_change(change: Change) -> str:
    """One line for a :class:`~hlo_shard.graph.Change`: where, which instruction, what
    edit (``%main: %p shape f32[8] -> f32[2]``); what ``optimize --explain --verbose``
    prints."""
    where = f"%{change.computation}" if change.computation else "module"
    before, after = _differing(_change_value(change.before), _change_value(change.after))
    text = _CHANGE_TEXTS.get(change.kind, _CHANGE_DEFAULT).format(
        kind=change.kind, name=change.name, detail=change.detail, before=before, after=after)
    return f"{where}: {text.rstrip()}"


def _change_value(value: Shape | AttrValue | None) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (ArrayShape, TupleShape)):
        return format_shape(value)
    return format_value(value)


def _differing(before: str, after: str) -> tuple[str, str]:
    """Long ``before``/``after`` texts with the ``, ``-separated items they share at
    either end elided, so the line shows what changed."""
    if max(len(before), len(after)) <= _CHANGE_VALUE_CHARS:
        return before, after
    old, new = before.split(", "), after.split(", ")
    shortest = min(len(old), len(new))
    head = 0
    while head < shortest - 1 and old[head] == new[head]:
        head += 1
    tail = 0
    while tail < shortest - 1 - head and old[-1 - tail] == new[-1 - tail]:
        tail += 1

    def shown(items: list[str]) -> str:
        kept = items[head:len(items) - tail]
        return ", ".join(["…"] * bool(head) + kept + ["…"] * bool(tail))

    return shown(old), shown(new)
