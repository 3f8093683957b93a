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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from hlo_shard.analysis.collectives import ReasonCode, started_slots
from hlo_shard.analysis.element_flow import ElementOperands
from hlo_shard.graph import topological_order, upstream_bits, users_map, zero_started_slots
from hlo_shard.ir import (ArrayShape, Computation, Instruction, Module, Raw, Shape,
                          TupleShape)
from hlo_shard.values import c_quote, c_unescape

#: Longer ``op_name`` are not taken for names (they would swamp every table).
MAX_NAME = 200
#: Reason codes of sums the analysis found to be values of the forward/backward pass,
#: named after no weight even where one is computed from them.
_NOT_GRADIENTS = (ReasonCode.FEEDS_GRADIENTS.value, ReasonCode.ACTIVATION_SUM.value)

_QUOTED = r""""(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'"""
#: One ``key=value`` of a metadata value, or a quoted string skipped whole (so that an
#: ``op_name=`` inside another field's string is never read as the field).
_METADATA_FIELD_RE = re.compile(rf"(?P<key>[A-Za-z_][\w.\-]*)=(?P<value>{_QUOTED})|{_QUOTED}",
                                re.S)
#: A pytree path as ``jax.tree_util.keystr`` writes it: an identifier, then ``[0]``,
#: ``['key']`` or ``.attr`` steps.
_PATH_RE = re.compile(r"""[^\W\d]\w*(?:\[(?:\d+|'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\]"""
                      r"""|\.[^\W\d]\w*)*""")

#: A gradient all-reduce leaf of one computation: (all-reduce name, tuple index or None).
GradientKey = tuple[str, int | None]
#: A gradient all-reduce leaf of the module: (computation, all-reduce name, index or None).
WeightKey = tuple[str, str, int | None]


def op_name(inst: Instruction) -> str | None:
    """The unescaped ``op_name`` of ``inst``'s metadata, if it has one."""
    metadata = inst.attr_as("metadata", Raw)
    if metadata is None or "op_name" not in metadata.text:
        return None
    for match in _METADATA_FIELD_RE.finditer(metadata.text):
        if match.group("key") == "op_name":
            return _utf8(c_unescape(match.group("value")))
    return None


def with_op_name(inst: Instruction, name: str) -> Raw:
    """``inst``'s metadata with its ``op_name`` ``name`` (added where it has none), its
    other fields as they were."""
    metadata = inst.attr_as("metadata", Raw)
    quoted = c_quote(name)
    if metadata is None or not metadata.text.strip("{} \n"):
        return Raw(f"{{op_name={quoted}}}")
    for match in _METADATA_FIELD_RE.finditer(metadata.text):
        if match.group("key") == "op_name":
            start, end = match.span("value")
            return Raw(metadata.text[:start] + quoted + metadata.text[end:])
    inside = metadata.text.strip()[1:]
    return Raw(f"{{op_name={quoted} {inside}")


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


#: Output leaves and the parameters any of them may be the next value of.
NextValues = tuple[Sequence[int], Sequence[int]]


def gradient_weights(comp: Computation, next_values: Sequence[NextValues],
                     values: Mapping[int, set[str]] | None = None, *,
                     flows: ElementOperands | None = None,
                     leaf_names: Sequence[str] | None = None) -> dict[GradientKey, int]:
    """Gradient all-reduce → the weight it updates: the one ``p`` for which some output
    leaf ``k`` of a group of ``next_values`` (``k`` may be the next value of ``p``) has
    the all-reduce's shape and is reached from it, and ``p`` is what the gradient was
    computed from (which tells the weight from its optimizer state) — where all such
    name one ``p``. ``values``: the instructions that stand for each ``p`` (default: the
    entry parameter numbered ``p``; in a loop body, the ``get-tuple-element``
    instructions of carried slot ``p``), no instruction standing for two.

    ``flows`` (:class:`~hlo_shard.analysis.element_flow.ElementOperands`): first reach
    only through the operands each element is computed from one for one, which keeps a
    clipped gradient from reaching every update through the global norm, and splits a
    group of several weights into each output's own (the weights its elements are
    computed from); a gradient that names no one weight so is then tried as before.
    ``leaf_names``: the array values to name instead of the all-reduces (a loop's
    accumulated sums)."""
    root = comp.root
    outputs = list(root.operands) if root.opcode == "tuple" else [root.name]
    shapes = list(root.shape.elements) if isinstance(root.shape, TupleShape) else [root.shape]
    if values is None:
        values = {p.parameter_number: {p.name} for p in comp.parameters()
                  if p.parameter_number is not None}
    groups = [(leaves, weights) for group_leaves, group_weights in next_values
              if (leaves := [k for k in group_leaves if k < len(outputs)])
              and (weights := [p for p in group_weights if values.get(p)])]
    if not groups:
        return {}
    fit = _Fit(comp, outputs, shapes, values)
    found: dict[GradientKey, int] = {}
    if flows is not None:
        found = fit.named(fit.own_groups(groups, flows), _ElementFlow(comp, flows),
                          any_dims=True, leaf_names=leaf_names)
    return {**fit.named(groups, _ElementFlow(comp), skip=found, leaf_names=leaf_names),
            **found}


@dataclass
class _Fit:
    """The outputs and weight values of one computation, as bits, for
    :func:`gradient_weights`."""

    comp: Computation
    outputs: list[str]
    shapes: Sequence[Shape]
    values: Mapping[int, set[str]]

    def _weight_bits(self, groups: Sequence[NextValues]) -> tuple[dict[str, int],
                                                                  dict[int, int]]:
        """A bit for each value standing for a weight of ``groups``, and each bit's
        weight."""
        bits = _bits(name for _, weights in groups for p in weights for name in self.values[p])
        return bits, {bits[name]: p for _, weights in groups for p in weights
                      for name in self.values[p]}

    def own_groups(self, groups: Sequence[NextValues], flows: ElementOperands
                   ) -> list[NextValues]:
        """``groups`` with each group of several weights split into one per output
        leaf, holding the weights of the group its elements are computed from one for
        one (an output none of them is left out)."""
        split: list[NextValues] = []
        bits, weight_of_bit = self._weight_bits(groups)
        reads = upstream_bits(self.comp, bits, flows.previous(self.comp))
        for leaves, weights in groups:
            if len(weights) == 1:
                split.append((leaves, weights))
                continue
            mask = _mask(bits, (name for p in weights for name in self.values[p]))
            for k in leaves:
                read = (reads[self.outputs[k]] | bits.get(self.outputs[k], 0)) & mask
                own = sorted({weight_of_bit[bit] for bit in _bits_of(read)})
                if own:
                    split.append(((k,), own))
        return split

    def named(self, groups: Sequence[NextValues], flow: _ElementFlow,
              skip: Mapping[GradientKey, int] | None = None, *, any_dims: bool = False,
              leaf_names: Sequence[str] | None = None) -> dict[GradientKey, int]:
        """The gradient leaves (but ``skip``'s) that ``groups`` name one weight of: of
        the gradient's dimensions, or (``any_dims``: where ``flow`` follows elements one
        for one, which a gradient sliced to the weight's rows or padded to its table's
        length still does) of any."""
        if not groups:
            return {}
        dims_of = (lambda shape: None) if any_dims else sorted_dims
        values, outputs, shapes = self.values, self.outputs, self.shapes
        output_bits = _bits(outputs[k] for leaves, _ in groups for k in leaves)
        value_bits, weight_of_bit = self._weight_bits(groups)
        by_dims: dict[tuple[int, ...] | None, _Groups] = {}
        for leaves, weights in groups:
            value_mask = _mask(value_bits, (name for p in weights for name in values[p]))
            same_dims: dict[tuple[int, ...] | None, list[str]] = {}
            for k in leaves:
                same_dims.setdefault(dims_of(shapes[k]), []).append(outputs[k])
            for dims, names in same_dims.items():
                by_dims.setdefault(dims, _Groups()).add(_mask(output_bits, names), value_mask)
        found: dict[GradientKey, int] = {}
        for key, reached, sources, shape in flow.gradient_leaves(output_bits, value_bits,
                                                                 leaf_names):
            if skip and key in skip:
                continue
            same = by_dims.get(dims_of(shape))
            fits = same.fitting(reached, sources, weight_of_bit) if same is not None else set()
            if len(fits) == 1:
                found[key] = fits.pop()
        return found


@dataclass
class _Groups:
    """The groups of next values whose outputs share dimensions: each group's output and
    value masks, and the groups each output bit and each value bit belongs to."""

    masks: list[tuple[int, int]] = field(default_factory=list)
    by_output: dict[int, list[int]] = field(default_factory=dict)
    by_value: dict[int, list[int]] = field(default_factory=dict)
    outputs: int = 0
    values: int = 0

    def add(self, output_mask: int, value_mask: int) -> None:
        group = len(self.masks)
        self.masks.append((output_mask, value_mask))
        for mask, index in ((output_mask, self.by_output), (value_mask, self.by_value)):
            for bit in _bits_of(mask):
                index.setdefault(bit, []).append(group)
        self.outputs |= output_mask
        self.values |= value_mask

    def fitting(self, reached: int, sources: int, weight_of_bit: Mapping[int, int]
                ) -> set[int]:
        """The weights of the value bits of ``sources`` in a group one of whose outputs
        is ``reached``: all of them, or two where there are more (enough to tell it is
        not one weight).
        Found from the sparser side, the reached outputs or the source values, so a
        gradient that reaches every output (a global norm) or is computed from every
        weight does not scan every group."""
        outputs, values = reached & self.outputs, sources & self.values
        if not (outputs and values):
            return set()
        bits, index = (outputs, self.by_output) if outputs.bit_count() <= values.bit_count() \
            else (values, self.by_value)
        seen: set[int] = set()
        fits: set[int] = set()
        for bit in _bits_of(bits):
            for group in index[bit]:
                if group in seen:
                    continue
                seen.add(group)
                output_mask, value_mask = self.masks[group]
                if reached & output_mask:
                    for hit in _bits_of(sources & value_mask):
                        fits.add(weight_of_bit[hit])
                        if len(fits) == 2:
                            return fits
        return fits


def _bits_of(mask: int) -> Iterator[int]:
    """Each set bit of ``mask``, lowest first."""
    while mask:
        lowest = mask & -mask
        yield lowest
        mask ^= lowest


def pairs(next_values: Iterable[tuple[int, int]]) -> list[NextValues]:
    """(output leaf, parameter) pairs, each its own group."""
    return [((k,), (p,)) for k, p in next_values]


def _bits(names: Iterable[str]) -> dict[str, int]:
    """A bit of its own for each distinct name."""
    return {name: 1 << index for index, name in enumerate(dict.fromkeys(names))}


def _mask(bits: Mapping[str, int], names: Iterable[str]) -> int:
    mask = 0
    for name in names:
        mask |= bits[name]
    return mask


def loop_gradient_weights(module: Module, flows: ElementOperands) -> dict[WeightKey, int]:
    """The gradients of the entry's training loops (``while`` bodies carrying the
    weights, as a ``lax.fori_loop`` over steps does) → entry parameter: the body's
    output ``i`` is carried slot ``i``'s next value, and a slot stands for the entry
    parameter the loop starts it from (through copies), where it starts no other."""
    entry = module.entry
    params = {p.name: p.parameter_number for p in entry.parameters()}
    found: dict[WeightKey, int] = {}
    for loop in entry.instructions:
        body_name = loop.called("body")
        init = entry[loop.operands[0]] if loop.opcode == "while" and loop.operands else None
        if not body_name or init is None or init.opcode != "tuple":
            continue
        start = {i: params.get(_through_copies(entry, operand))
                 for i, operand in enumerate(init.operands)}
        body = module.computation(body_name)
        carried = body.parameters()
        if len(carried) != 1:
            continue
        slots: dict[int, set[str]] = {}
        for inst in body.instructions:
            index = inst.int_attr("index") if inst.opcode == "get-tuple-element" else None
            if index is not None and inst.operands[0] == carried[0].name:
                slots.setdefault(index, set()).add(inst.name)
        starts = Counter(start.values())
        weights = gradient_weights(body, pairs((i, i) for i in slots), slots, flows=flows)
        found.update({(body.name, name, index): p for (name, index), i in weights.items()
                      if (p := start.get(i)) is not None and starts[p] == 1})
    return found


def accumulated_gradient_weights(module: Module, groups: Sequence[NextValues],
                                 flows: ElementOperands) -> dict[WeightKey, int]:
    """The gradients an accumulation loop of the entry sums (a ``scan`` or
    ``fori_loop`` over microbatches: the body all-reduces each microbatch's gradient and
    adds it into a slot that starts at zero) → the weight: the one the slot's sum after
    the loop updates (read as an all-reduce's would be, ``groups`` the entry's next
    values, every loop's sums at once), where the body's all-reduce flows one for one
    into that slot alone. Loops nest (a scan over layers, writing each layer's sum into
    a stacked slot, inside the scan over microbatches): an inner loop's zero-started
    slot whose sum flows one for one into one slot of the loop around it is that slot's
    weight's, and so on inwards. A sum over devices that starts a slot (big_vision's
    first microbatch's gradient, computed before the loop) is that slot's weight's."""
    entry = module.entry
    loops = _accumulation_loops(module, entry)
    starts = _started_slots(module, entry)
    if not loops and not starts:
        return {}
    named = gradient_weights(entry, groups, flows=flows,
                             leaf_names=[name for _, sums in loops for name in sums.values()]
                             + [after for _, after in starts])
    found: dict[WeightKey, int] = {
        (entry.name, all_reduce, index): weight for (all_reduce, index), after in starts
        if (weight := named.get((after, None))) is not None}
    work = [(body, {slot: weight for slot, name in sums.items()
                    if (weight := named.get((name, None))) is not None})
            for body, sums in loops]
    seen: set[str] = set()
    while work:
        body, slot_weight = work.pop()
        if not slot_weight or body.name in seen:
            continue
        seen.add(body.name)
        slot_bits = {body.root.operands[slot]: 1 << slot for slot in slot_weight}
        inner = _accumulation_loops(module, body)
        # The body's all-reduces and the sums its own loops return, in one walk down.
        values = {name for _, sums in inner for name in sums.values()}
        leaves = [inst.name for inst in body.instructions if inst.opcode == "all-reduce"]
        reaches: dict[str, int] = {}
        for (name, index), reached, _, _ in _ElementFlow(body, flows).gradient_leaves(
                slot_bits, {}, leaves + sorted(values)):
            if name in values:
                reaches[name] = reached
            elif reached and reached & (reached - 1) == 0:  # one slot
                found[(body.name, name, index)] = slot_weight[reached.bit_length() - 1]
        work += [(inner_body, {slot: slot_weight[reached.bit_length() - 1]
                               for slot, name in sums.items()
                               if (reached := reaches.get(name, 0))
                               and reached & (reached - 1) == 0})
                 for inner_body, sums in inner]
    return found


def _accumulation_loops(module: Module, comp: Computation
                        ) -> list[tuple[Computation, dict[int, str]]]:
    """The ``while`` loops of ``comp`` with slots that start at zero, each with its body
    and, per such slot that ``comp`` reads after the loop, the value read."""
    users = users_map(comp)
    loops: list[tuple[Computation, dict[int, str]]] = []
    for loop in comp.instructions:
        zeros = zero_started_slots(module, comp, loop) if loop.opcode == "while" else set()
        if not zeros:
            continue
        body = module.computation(loop.called("body"))
        sums = {inst.required_attr("index", int): inst.name
                for inst in map(comp.__getitem__, users[loop.name])
                if inst.opcode == "get-tuple-element" and isinstance(inst.shape, ArrayShape)
                and inst.required_attr("index", int) in zeros}
        if sums and body.root.opcode == "tuple":
            loops.append((body, sums))
    return loops


def _started_slots(module: Module, comp: Computation
                   ) -> list[tuple[tuple[str, int | None], str]]:
    """The slots of ``comp``'s loops that a sum over devices starts
    (:func:`~hlo_shard.analysis.collectives.started_slots`): (the all-reduce, its element
    index) and the one value ``comp`` reads of the slot after the loop."""
    users = users_map(comp)
    found = []
    for loop in comp.instructions:
        for slot, summed in started_slots(module, comp, loop, users.__getitem__).items():
            after = [name for name in users[loop.name] if comp[name].opcode ==
                     "get-tuple-element" and comp[name].int_attr("index") == slot]
            if len(after) == 1:
                found.append((summed, after[0]))
    return found


def _through_copies(comp: Computation, name: str) -> str:
    while comp[name].opcode == "copy":
        name = comp[name].operands[0]
    return name


class _ElementFlow:
    """Reachability that follows each element of a tuple through its
    ``get-tuple-element``: a shard_map body returns all its results in one tuple, which
    would otherwise join every gradient to every output. What each instruction reaches,
    and what it was computed from, are found for all instructions at once, in one pass
    each way over a def-before-use order, as masks of the bits asked about."""

    def __init__(self, comp: Computation, flows: ElementOperands | None = None) -> None:
        self.comp = comp
        self.users = users_map(comp)
        #: Reach only through the operands each element is computed from (None: all).
        self.flows = flows
        #: Per instruction, read once: the operands its elements flow from; a tuple's
        #: readers of each operand (:meth:`_tuple_reads`).
        self._flowing: dict[str, frozenset[str]] = {}
        self._tuple_readers: dict[str, dict[str, list[str]] | None] = {}

    def _element(self, name: str) -> int | None:
        inst = self.comp[name]
        return inst.int_attr("index") if inst.opcode == "get-tuple-element" else None

    def _flows_from(self, inst: Instruction) -> frozenset[str]:
        assert self.flows is not None
        found = self._flowing.get(inst.name)
        if found is None:
            found = self._flowing[inst.name] = frozenset(self.flows(self.comp, inst))
        return found

    def _tuple_reads(self, inst: Instruction) -> dict[str, list[str]] | None:
        """Per operand of the tuple ``inst``: the get-tuple-elements that read a position
        it holds; None where something else reads the tuple (or nothing does). Read
        once per tuple."""
        if inst.name not in self._tuple_readers:
            readers = self.users[inst.name]
            elements = [(reader, element) for reader in readers
                        if (element := self._element(reader)) is not None]
            found: dict[str, list[str]] | None = None
            if readers and len(elements) == len(readers):
                at: dict[int, list[str]] = {}
                for reader, element in elements:
                    at.setdefault(element, []).append(reader)
                found = {}
                for position, operand in enumerate(inst.operands):
                    found.setdefault(operand, []).extend(at.get(position, ()))
            self._tuple_readers[inst.name] = found
        return self._tuple_readers[inst.name]

    def _next(self, name: str) -> list[str]:
        out = []
        for user in self.users[name]:
            inst = self.comp[user]
            if self.flows is not None and name not in self._flows_from(inst):
                continue
            reads = self._tuple_reads(inst) if inst.opcode == "tuple" else None
            if reads is not None:
                out += reads[name]
            else:
                out.append(user)
        return out

    def _previous(self, inst: Instruction) -> list[str]:
        index = self._element(inst.name)
        if index is not None and self.comp[inst.operands[0]].opcode == "tuple":
            return [self.comp[inst.operands[0]].operands[index]]
        return inst.operands

    def _downstream(self, bits: Mapping[str, int]) -> dict[str, int]:
        """Per instruction: the ``bits`` of everything it reaches (not its own)."""
        below: dict[str, int] = {}
        for inst in reversed(topological_order(self.comp)):
            found = 0
            for after in self._next(inst.name):
                found |= below[after] | bits.get(after, 0)
            below[inst.name] = found
        return below

    def gradient_leaves(self, reach_bits: Mapping[str, int], source_bits: Mapping[str, int],
                        names: Sequence[str] | None = None
                        ) -> Iterator[tuple[GradientKey, int, int, ArrayShape | TupleShape]]:
        """Each all-reduce leaf (an array one, or each element of a tuple one, as XLA's
        combiner leaves them; ``names``: those values instead): its key, the
        ``reach_bits`` of what it reaches, the ``source_bits`` of what it was computed
        from, and its shape."""
        leaves = [inst for inst in self.comp.instructions if inst.opcode == "all-reduce"] \
            if names is None else [self.comp[name] for name in names]
        if not leaves:
            return
        below = self._downstream(reach_bits)
        above = upstream_bits(self.comp, source_bits, self._previous)
        for inst in leaves:
            if isinstance(inst.shape, ArrayShape):
                yield (inst.name, None), below[inst.name], above[inst.name], inst.shape
                continue
            if len(inst.operands) != len(inst.shape.elements):
                continue
            for index, (operand, shape) in enumerate(zip(inst.operands, inst.shape.elements)):
                reached = 0
                for getter in self.users[inst.name]:
                    if self._element(getter) == index:
                        reached |= reach_bits.get(getter, 0) | below[getter]
                yield ((inst.name, index), reached,
                       source_bits.get(operand, 0) | above[operand], shape)


def sorted_dims(shape: Shape) -> tuple[int, ...] | None:
    """An array's dimensions in any order (a gradient the partitioner computed
    transposed has its weight's); None for a tuple."""
    return tuple(sorted(shape.dims)) if isinstance(shape, ArrayShape) else None


@dataclass(frozen=True)
class UserNames:
    """The user's names of one module: its entry parameters, and the weight each
    gradient all-reduce leaf is the gradient of."""

    parameters: dict[int, str] = field(default_factory=dict)
    gradients: dict[WeightKey, int] = field(default_factory=dict)
    #: A row's (computation, all-reduce) → the input's it was moved from (the
    #: pipeline's report says: :attr:`~hlo_shard.passes.weight_update.ShardingReport
    #: .moved_from`), where the names were read on the input.
    moved: Mapping[tuple[str, str], tuple[str, str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.parameters)

    def gradient_of(self, computation: str, all_reduce: str, index: int | None,
                    reason_code: str | None = None) -> str | None:
        """The weight the leaf is the gradient of; none for a sum the analysis found to
        be a value of the forward/backward pass (``feeds_gradients``: a batch statistic
        reaches the weights' updates too, yet is no weight's gradient; an
        ``activation_sum``)."""
        computation, all_reduce = self.moved.get((computation, all_reduce),
                                                 (computation, all_reduce))
        weight = self.gradients.get((computation, all_reduce, index))
        if weight is None or reason_code in _NOT_GRADIENTS:
            return None
        return self.parameters.get(weight)

    def moved_from(self, computation: str, all_reduce: str) -> str | None:
        """``computation/all-reduce`` of the input's sum a row's was moved out of a loop
        or conditional from (the row names the one the motion wrote, which the input
        lacks); None for a row of the input's own."""
        origin = self.moved.get((computation, all_reduce))
        return None if origin is None else "/".join(origin)

    def explained(self, row: dict) -> dict:
        """An ``--explain`` row's JSON with the weight it is the gradient of
        (``gradient_of``, null where unknown) and the input's sum it was moved from
        (``moved_from``, :meth:`moved_from`)."""
        return {**row, "gradient_of": self.gradient_of(row["computation"], row["all_reduce"],
                                                       row["index"], row.get("reason_code")),
                "moved_from": self.moved_from(row["computation"], row["all_reduce"])}

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
    parameter of its array type (the one-fit rule of :func:`gradient_weights` then names
    only what the graph tells apart); ``hlo_shard.jax`` passes the pairs its pytrees
    say."""
    parameters = parameter_names(module, override)
    if not parameters:
        return UserNames(parameters)
    if next_values is None:
        next_values = list(module.output_aliases().items())
    groups = pairs(next_values) if next_values else same_types(module)
    flows = ElementOperands(module)
    entry = module.entry
    found = {(entry.name, name, index): weight for (name, index), weight
             in gradient_weights(entry, groups, flows=flows).items()}
    found.update(loop_gradient_weights(module, flows))
    found.update(accumulated_gradient_weights(module, groups, flows))
    return UserNames(parameters, found)


def same_types(module: Module) -> list[NextValues]:
    """The entry's output leaves and parameters grouped by array type (element type and
    dims): any output may be the next value of any parameter of its group."""
    root = module.entry.root
    outputs = list(root.shape.elements) if isinstance(root.shape, TupleShape) else [root.shape]
    groups: dict[tuple, tuple[list[int], list[int]]] = {}
    for k, out in enumerate(outputs):
        if isinstance(out, ArrayShape):
            groups.setdefault((out.element_type, out.dims), ([], []))[0].append(k)
    for param in module.entry.parameters():
        group = groups.get((param.shape.element_type, param.shape.dims)) \
            if isinstance(param.shape, ArrayShape) else None
        if group is not None and param.parameter_number is not None:
            group[1].append(param.parameter_number)
    return list(groups.values())


def labelled(hlo_name: str, name: str | None) -> str:
    """``param.16 (p['l0_w'])``, or the HLO name alone where the user's is unknown."""
    return f"{hlo_name} ({name})" if name else hlo_name


__all__ = ["MAX_NAME", "NextValues", "UserNames", "WeightKey", "accumulated_gradient_weights",
           "as_path", "gradient_weights",
           "instruction_names", "labelled", "op_name", "pairs", "parameter_names",
           "same_types", "sorted_dims", "user_names", "with_op_name"]
