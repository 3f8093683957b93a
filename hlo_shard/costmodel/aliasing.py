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

from collections.abc import Sequence
from dataclasses import dataclass

from hlo_shard.costmodel.flops import leaf_bytes
from hlo_shard.costmodel.kernels import is_relabel
from hlo_shard.graph import stable_topological_sort, users_map
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
    donated = [(parameters[number], _buffer_source(comp, outputs[output]))
               for output, number in aliases.items()
               if number in parameters and output < len(outputs)]
    # A parameter passed through unchanged is not written.
    donated = [(parameter, writer) for parameter, writer in donated if writer != parameter.name]
    if not donated:
        return []
    users = users_map(comp)
    readers = {parameter.name: _readers(comp, users, parameter.name)
               for parameter, _ in donated}
    order = _DataOrder(comp, [writer for _, writer in donated], combined,
                       {r for found in readers.values() for r in found})
    copies: list[DonatedCopy] = []
    for parameter, writer in donated:
        late = [r for r in readers[parameter.name]
                if r != writer and not order.precedes(r, writer)]
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


class _DataOrder:
    """Which of the ``writers`` each instruction of ``asked`` precedes through data. An
    element taken out of an optimization barrier depends on that element only (XLA
    expands the barrier before copy insertion), a combined collective on all its
    bucket's operands, and control predecessors do not count (StableHLO, through which
    jax and the runtime compile HLO, has none).

    One pass over the dependencies from the last instruction to the first: each hands
    the writers that follow it (a bitset, one bit per writer) on to what it depends on,
    instead of a walk over the ancestors of every writer."""

    def __init__(self, comp: Computation, writers: Sequence[str],
                 combined: Sequence[Sequence[str]], asked: set[str]) -> None:
        self.bit = {writer: 1 << index for index, writer in enumerate(dict.fromkeys(writers))}
        deps: dict[str, list[str]] = {
            inst.name: _data_operands(comp, inst) if inst.opcode == "get-tuple-element"
            else inst.operands for inst in comp.instructions}  # read, never edited
        for index, bucket in enumerate(combined):
            # A bucket waits for all its members' operands: one node between them and it.
            joint = f"\0bucket {index}"  # no instruction is named so
            deps[joint] = [o for member in bucket for o in comp[member].operands]
            for member in bucket:
                deps[member] = [*deps[member], joint]
        order = stable_topological_sort(list(deps), {name: set(d) for name, d in deps.items()})
        if len(order) != len(deps):
            raise ValueError(f"computation {comp.name}: combined collectives depend on "
                             f"each other")
        pending: dict[str, int] = {}
        self.followers: dict[str, int] = {}
        for name in reversed(order):
            bits = pending.pop(name, 0) | self.bit.get(name, 0)
            if name in asked:
                self.followers[name] = bits
            if bits:
                for dep in deps[name]:
                    pending[dep] = pending.get(dep, 0) | bits

    def precedes(self, name: str, writer: str) -> bool:
        """Whether ``writer`` depends on ``name`` (``name`` one of ``asked``)."""
        return name != writer and bool(self.followers[name] & self.bit[writer])


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
