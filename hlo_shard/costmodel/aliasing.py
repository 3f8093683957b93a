"""The copies XLA's copy insertion keeps for donated parameters.

A donated entry parameter shares its buffer with the output it is aliased to
(``input_output_alias``). The instruction that writes that output may only run once
every reader of the parameter's old value has run; XLA proves this from data
dependencies (an optimization barrier does not order its elements for it: measured on
XLA:CPU, jaxlib 0.10.2) and otherwise copies the parameter at the top of the step, so
that the readers use the copy. jax's data-parallel step never needs one: XLA's
combiner makes its per-gradient all-reduces one, which every update follows and which
follows every read of every weight. A sharded step can: the all-gather that writes
layer ``k``'s new weight follows its own reduce-scatter only, not the backward product
that reads the old weight to compute the gradient of layer ``k - 1``. That copy (4 + 1
MiB, read and written every step, on the wide LayerNorm MLP) is priced here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hlo_shard.costmodel.flops import leaf_bytes
from hlo_shard.costmodel.kernels import is_relabel
from hlo_shard.graph import users_map
from hlo_shard.ir import Computation, Instruction, Module


@dataclass(frozen=True)
class DonatedCopy:
    """The copy of donated parameter ``parameter`` (``bytes`` large) that XLA keeps
    because ``reader`` does not precede ``writer``, which writes its aliased output."""

    parameter: str
    bytes: int
    reader: str
    writer: str


def donated_parameter_copies(module: Module, combined: Sequence[Sequence[str]] = ()
                             ) -> list[DonatedCopy]:
    """Every donated entry parameter that XLA must copy (see the module docstring).
    ``combined``: the entry's collectives that XLA's combiners run as one (each bucket
    waits for all its members' operands: jax's separate gradient all-reduces become the
    one all-reduce every update follows)."""
    comp = module.entry
    aliases = module.output_aliases()
    if not aliases:
        return []
    root = comp.root
    outputs = root.operands if root.opcode == "tuple" else [root.name]
    parameters = {p.parameter_number: p for p in comp.parameters()}
    users = users_map(comp)
    bucket_of = {name: bucket for bucket in combined for name in bucket}
    copies: list[DonatedCopy] = []
    for output, number in aliases.items():
        parameter = parameters.get(number)
        if parameter is None or output >= len(outputs):
            continue
        writer = _buffer_source(comp, outputs[output])
        if writer == parameter.name:
            continue  # passed through unchanged
        before = _ancestors(comp, writer, bucket_of)
        late = [r for r in _readers(comp, users, parameter.name)
                if r != writer and r not in before]
        if late:
            copies.append(DonatedCopy(parameter.name, int(leaf_bytes(parameter.shape)),
                                      late[0], writer))
    return copies


def _buffer_source(comp: Computation, name: str) -> str:
    """The instruction that writes ``name``'s buffer (looking through bitcasts)."""
    while is_relabel(comp, comp[name]) or comp[name].opcode == "bitcast":
        name = comp[name].operands[0]
    return name


def _readers(comp: Computation, users: dict[str, list[str]], name: str) -> list[str]:
    """The instructions reading ``name``'s buffer, through bitcasts of it; the root
    tuple (an output passing it on) does not read it."""
    found: list[str] = []
    stack = [name]
    while stack:
        for user in users[stack.pop()]:
            inst = comp[user]
            if inst.opcode == "bitcast" or is_relabel(comp, inst):
                stack.append(user)
            elif user != comp.root_name:
                found.append(user)
    return found


def _ancestors(comp: Computation, name: str,
               bucket_of: Mapping[str, Sequence[str]]) -> set[str]:
    """The instructions ``name`` depends on through data: an element taken out of an
    optimization barrier depends on that element only (XLA expands the barrier before
    copy insertion), a combined collective on all its bucket's operands, and control
    predecessors do not count (StableHLO, through which jax and the runtime compile
    HLO, has none)."""
    found: set[str] = set()
    stack = [name]
    while stack:
        inst = comp[stack.pop()]
        merged = [o for member in bucket_of.get(inst.name, ()) for o in comp[member].operands]
        for before in (*_data_operands(comp, inst), *merged):
            if before not in found:
                found.add(before)
                stack.append(before)
    return found


def _data_operands(comp: Computation, inst: Instruction) -> list[str]:
    if inst.opcode == "get-tuple-element":
        barrier = comp[inst.operands[0]]
        index = inst.int_attr("index")
        if barrier.opcode == "opt-barrier" and index is not None:
            packed = comp[barrier.operands[0]]
            if packed.opcode == "tuple":
                return [packed.operands[index]]
    return list(inst.operands)


__all__ = ["DonatedCopy", "donated_parameter_copies"]
