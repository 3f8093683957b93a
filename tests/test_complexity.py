"""Every analysis is linear in the module and iterative (no recursion that grows with it).

Modules of every shape a training step takes are generated here — long chains of scalar
ops (a learning-rate schedule), ladders of scalars that reach the same value along many
paths (``optax.piecewise_constant_schedule``), wide fans of gradients (a model with many
weights) and a long elementwise update — at two sizes, ``n`` and ``2n`` instructions.
Each analysis runs on both while the number of Python function calls it makes is
counted (deterministic, unlike time), and the count may grow at most ``MAX_GROWTH``
times. A walk per candidate, per path or per parameter shows up as a ratio near 4 (or
far beyond: a path count doubles per rung). The same modules run with the default
recursion limit, so a recursion whose depth grows with the module fails as well.
"""

from __future__ import annotations

from collections.abc import Callable
import sys

import pytest

from hlo_shard.analysis.collectives import find_gradient_all_reduces
from hlo_shard.analysis.element_flow import ElementOperands
from hlo_shard.analysis.names import gradient_weights, pairs, same_types, user_names
from hlo_shard.passes.weight_update import planned_update_regions
from hlo_shard.analysis.replication import analyze_replication
from hlo_shard.costmodel.aliasing import donated_parameter_copies
from hlo_shard.costmodel.kernels import plan_kernels
from hlo_shard.costmodel.memory import memory_profile
from hlo_shard.costmodel.step_time import estimate_step, per_weight_rows
from hlo_shard.graph import topological_order
from hlo_shard.ir import Module
from hlo_shard.parser import parse
from hlo_shard import optimize
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.profiles import load_profile

#: The most an analysis's call count may grow when the module doubles (2 plus slack for
#: the log factor of sorting and hashing).
MAX_GROWTH = 2.2

_REDUCER = """%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

"""


def _step(grads: int, schedule: list[str],
          update: Callable[[int], tuple[list[str], str]] | None = None, size: int = 256) -> str:
    """A data-parallel SGD step over 4 replicas: ``grads`` weights, each updated by
    ``w - lr * g`` where ``g`` is its gradient's all-reduce ``%g.K`` (or what the lines
    ``update(K)`` add compute from it: they come after every all-reduce) and ``lr`` what
    the ``schedule`` lines compute last from the scalar ``%step``. Every new weight is
    donated (aliased to its parameter). ``size``: the elements of each weight."""
    array = f"f32[{size}]{{0}}"
    lines: list[str] = []
    for k in range(grads):
        lines.append(f"  %w.{k} = {array} parameter({2 * k})")
        lines.append(f"  %x.{k} = {array} parameter({2 * k + 1})")
    lines.append(f"  %step = f32[] parameter({2 * grads})")
    lines.append("  %one = f32[] constant(1)")
    lines += schedule
    lr = _defined(schedule[-1]) if schedule else "one"
    summed: list[str] = []
    for k in range(grads):
        lines.append(f"  %g.{k} = {array} all-reduce(%x.{k}), replica_groups={{{{0,1,2,3}}}}, "
                     f"to_apply=%sum")
        summed.append(f"g.{k}")
    for k in range(grads):
        if update is not None:
            extra, summed[k] = update(k)
            lines += extra
    for k in range(grads):
        lines.append(f"  %lr.{k} = {array} broadcast(%{lr}), dimensions={{}}")
        lines.append(f"  %d.{k} = {array} multiply(%{summed[k]}, %lr.{k})")
        lines.append(f"  %new.{k} = {array} subtract(%w.{k}, %d.{k})")
    outputs = ", ".join([array] * grads)
    lines.append(f"  ROOT %out = ({outputs}) tuple({', '.join(f'%new.{k}' for k in range(grads))})")
    params = ", ".join([array] * (2 * grads) + ["f32[]"])
    aliases = ", ".join(f"{{{k}}}: ({2 * k}, {{}}, may-alias)" for k in range(grads))
    return (f"HloModule generated_step, input_output_alias={{ {aliases} }}, "
            f"entry_computation_layout={{({params})->({outputs})}}, replica_count=4\n\n"
            + _REDUCER + "ENTRY %main {\n" + "\n".join(lines) + "\n}\n")


def _defined(line: str) -> str:
    """The name an instruction line defines."""
    return line.split("=")[0].strip().removeprefix("ROOT ").lstrip("%")


def chain(n: int) -> str:
    """A schedule of ``n`` scalar ops in a row (each reads the one before)."""
    ops = [f"  %c.{i} = f32[] {'add' if i % 2 else 'multiply'}(%{f'c.{i - 1}' if i else 'step'}, "
           f"%one)" for i in range(n)]
    return _step(4, ops)


def ladder(n: int) -> str:
    """``n / 2`` rungs, each reading both values of the rung before: 2^rungs paths."""
    ops: list[str] = []
    a, b = "step", "one"
    for i in range(n // 2):
        ops += [f"  %a.{i} = f32[] add(%{a}, %{b})", f"  %b.{i} = f32[] multiply(%{a}, %{b})"]
        a, b = f"a.{i}", f"b.{i}"
    return _step(4, ops + [f"  %lr = f32[] add(%{a}, %{b})"])


def piecewise(n: int) -> str:
    """What ``optax.piecewise_constant_schedule`` lowers to: per boundary a comparison
    with the step and a select between the rate so far and its scaled value."""
    ops: list[str] = []
    rate = "one"
    for i in range(n // 4):
        ops += [f"  %bound.{i} = f32[] constant({i + 1})",
                f"  %before.{i} = pred[] compare(%step, %bound.{i}), direction=LT",
                f"  %scaled.{i} = f32[] multiply(%{rate}, %one)",
                f"  %rate.{i} = f32[] select(%before.{i}, %{rate}, %scaled.{i})"]
        rate = f"rate.{i}"
    return _step(4, ops)


def fan(n: int) -> str:
    """``n / 5`` weights side by side, each with its own gradient and update."""
    return _step(max(1, n // 5), [])


def layers(n: int) -> str:
    """``n / 8`` layers whose gradients each depend on all the layers before (a forward
    pass through every weight), so every update has most of the step as ancestors."""
    grads = max(1, n // 8)
    forward = ["  %h.0 = f32[256]{0} multiply(%x.0, %x.0)"]
    for k in range(grads):
        forward.append(f"  %h.{k + 1} = f32[256]{{0}} multiply(%h.{k}, %w.{k})")

    def update(k: int) -> tuple[list[str], str]:
        return (forward if k == 0 else []) + [
            f"  %t.{k} = f32[] dot(%h.{k + 1}, %h.{k + 1}), lhs_contracting_dims={{0}}, "
            f"rhs_contracting_dims={{0}}",
            f"  %tb.{k} = f32[256]{{0}} broadcast(%t.{k}), dimensions={{}}",
            f"  %gh.{k} = f32[256]{{0}} multiply(%g.{k}, %tb.{k})"], f"gh.{k}"
    return _step(grads, [], update)


def clipped(n: int) -> str:
    """``n / 10`` weights whose gradients are scaled by their global norm (optax's
    ``clip_by_global_norm``): every update depends on every gradient."""
    grads = max(1, n // 10)

    def update(k: int) -> tuple[list[str], str]:
        lines = ["  %zero = f32[] constant(0)"] if k == 0 else []
        lines += [f"  %sq.{k} = f32[256]{{0}} multiply(%g.{k}, %g.{k})",
                  f"  %ss.{k} = f32[] reduce(%sq.{k}, %zero), dimensions={{0}}, to_apply=%sum",
                  f"  %acc.{k} = f32[] add(%{f'acc.{k - 1}' if k else 'one'}, %ss.{k})"]
        if k == grads - 1:
            lines += [f"  %norm = f32[] sqrt(%acc.{k})", "  %scale = f32[] divide(%one, %norm)"]
        return lines, f"g.{k}"

    def scale(k: int) -> tuple[list[str], str]:
        lines, _ = update(k)
        if k == grads - 1:
            lines += [line for j in range(grads) for line in (
                f"  %sb.{j} = f32[256]{{0}} broadcast(%scale), dimensions={{}}",
                f"  %gc.{j} = f32[256]{{0}} multiply(%g.{j}, %sb.{j})")]
        return lines, f"gc.{k}"
    return _step(grads, [], scale)


def long_update(n: int) -> str:
    """One weight whose summed gradient goes through ``n`` elementwise ops (of a size
    the replicas do not divide: its shards are padded)."""
    def update(k: int) -> tuple[list[str], str]:
        ops, prev = [], f"g.{k}"
        for i in range(n):
            ops.append(f"  %u.{k}.{i} = f32[254]{{0}} {'add' if i % 2 else 'multiply'}"
                       f"(%{prev}, %x.{k})")
            prev = f"u.{k}.{i}"
        return ops, prev
    return _step(1, [], update, size=254)


def fused(n: int) -> str:
    """``n / 10`` weights whose SGD update XLA has fused already: one loop fusion and
    its computation per weight (a module as the hook sees it on XLA:CPU), so the pass
    adds a sharded copy of each fusion body to the module."""
    grads = max(1, n // 10)
    array = "f32[256]{0}"
    bodies, lines = [], []
    for k in range(grads):
        bodies.append(f"%update.{k} (p0: f32[256], p1: f32[256]) -> f32[256] {{\n"
                      f"  %p0 = {array} parameter(0)\n  %p1 = {array} parameter(1)\n"
                      f"  %rate = f32[] constant(0.1)\n"
                      f"  %lr = {array} broadcast(%rate), dimensions={{}}\n"
                      f"  %d = {array} multiply(%p1, %lr)\n"
                      f"  ROOT %new = {array} subtract(%p0, %d)\n}}\n\n")
        lines += [f"  %w.{k} = {array} parameter({2 * k})",
                  f"  %x.{k} = {array} parameter({2 * k + 1})"]
    for k in range(grads):
        lines += [f"  %g.{k} = {array} all-reduce(%x.{k}), replica_groups={{{{0,1,2,3}}}}, "
                  f"to_apply=%sum",
                  f"  %new.{k} = {array} fusion(%w.{k}, %g.{k}), kind=kLoop, "
                  f"calls=%update.{k}"]
    outputs = ", ".join([array] * grads)
    lines.append(f"  ROOT %out = ({outputs}) tuple({', '.join(f'%new.{k}' for k in range(grads))})")
    params = ", ".join([array] * (2 * grads))
    aliases = ", ".join(f"{{{k}}}: ({2 * k}, {{}}, may-alias)" for k in range(grads))
    return (f"HloModule fused_step, input_output_alias={{ {aliases} }}, "
            f"entry_computation_layout={{({params})->({outputs})}}, replica_count=4\n\n"
            + _REDUCER + "".join(bodies) + "ENTRY %main {\n" + "\n".join(lines) + "\n}\n")


def fused_slices(n: int) -> str:
    """``n / 6`` gradients summed over 4 replicas and read by one fusion, which takes
    each device's quarter of every sum (its offset looked up from the replica id, as
    XLA:CPU fuses the partitioner's slices) and adds them up: the fused reads of a
    fan-in."""
    grads = max(1, n // 6)
    whole, part = "f32[256]{0}", "f32[64]{0}"
    body = [f"  %p.{k} = {whole} parameter({k})" for k in range(grads)]
    body += [f"  %table = s32[4]{{0}} parameter({grads})",
             f"  %id = u32[] parameter({grads + 1})",
             "  %row.1 = s32[1]{0} dynamic-slice(%table, %id), dynamic_slice_sizes={1}",
             "  %row = s32[] bitcast(%row.1)"]
    body += [f"  %q.{k} = {part} dynamic-slice(%p.{k}, %row), dynamic_slice_sizes={{64}}"
             for k in range(grads)]
    total = "q.0"
    for k in range(1, grads):
        body.append(f"  %t.{k} = {part} add(%{total}, %q.{k})")
        total = f"t.{k}"
    body.append(f"  ROOT %all = {part} copy(%{total})")
    lines = [f"  %x.{k} = {whole} parameter({k})" for k in range(grads)]
    lines += [f"  %w = {part} parameter({grads})",
              "  %table = s32[4]{0} constant({0, 64, 128, 192})",
              "  %id = u32[] replica-id()"]
    lines += [f"  %g.{k} = {whole} all-reduce(%x.{k}), replica_groups={{{{0,1,2,3}}}}, "
              f"to_apply=%sum" for k in range(grads)]
    operands = ", ".join([f"%g.{k}" for k in range(grads)] + ["%table", "%id"])
    lines += [f"  %mine = {part} fusion({operands}), kind=kLoop, calls=%slices",
              f"  ROOT %new = {part} subtract(%w, %mine)"]
    params = ", ".join([whole] * grads + [part])
    body_params = ", ".join([whole] * grads + ["s32[4]", "u32[]"])
    return (f"HloModule fused_slices_step, input_output_alias={{ {{}}: ({grads}, {{}}, "
            f"may-alias) }}, entry_computation_layout={{({params})->{part}}}, "
            "replica_count=4\n\n" + _REDUCER +
            f"%slices ({body_params}) -> {part} {{\n" + "\n".join(body) + "\n}\n\n"
            "ENTRY %main {\n" + "\n".join(lines) + "\n}\n")


def momentum(n: int, aliased: bool = True) -> str:
    """``n / 8`` weights with a momentum buffer each, one large and the rest small: the
    sharded state of the large one, while every small one's buffer stays whole and
    computed from its whole gradient (what the gate's "largest only" trial writes, and
    what ``state="sharded"`` explains state by state). ``aliased``: the module says which
    output is each parameter's next value; otherwise the pass pairs them by dataflow."""
    grads = max(2, n // 8)
    lines: list[str] = ["  %rate = f32[] constant(0.1)", "  %decay = f32[] constant(0.9)"]
    arrays = [f"f32[{4096 if k == 0 else 64}]{{0}}" for k in range(grads)]
    for k, array in enumerate(arrays):
        lines += [f"  %w.{k} = {array} parameter({3 * k})",
                  f"  %m.{k} = {array} parameter({3 * k + 1})",
                  f"  %x.{k} = {array} parameter({3 * k + 2})"]
    for k, array in enumerate(arrays):
        lines += [f"  %g.{k} = {array} all-reduce(%x.{k}), replica_groups={{{{0,1,2,3}}}}, "
                  f"to_apply=%sum",
                  f"  %b.{k} = {array} broadcast(%decay), dimensions={{}}",
                  f"  %kept.{k} = {array} multiply(%m.{k}, %b.{k})",
                  f"  %mn.{k} = {array} add(%kept.{k}, %g.{k})",
                  f"  %lr.{k} = {array} broadcast(%rate), dimensions={{}}",
                  f"  %d.{k} = {array} multiply(%mn.{k}, %lr.{k})",
                  f"  %new.{k} = {array} subtract(%w.{k}, %d.{k})"]
    outputs = ", ".join(arrays + arrays)
    values = [f"%new.{k}" for k in range(grads)] + [f"%mn.{k}" for k in range(grads)]
    lines.append(f"  ROOT %out = ({outputs}) tuple({', '.join(values)})")
    params = ", ".join(a for a in arrays for _ in range(3))
    pairs = [f"{{{k}}}: ({3 * k}, {{}}, may-alias)" for k in range(grads)] + \
        [f"{{{grads + k}}}: ({3 * k + 1}, {{}}, may-alias)" for k in range(grads)]
    alias = f"input_output_alias={{ {', '.join(pairs)} }}, " if aliased else ""
    return (f"HloModule momentum_step, {alias}"
            f"entry_computation_layout={{({params})->({outputs})}}, replica_count=4\n\n"
            + _REDUCER + "ENTRY %main {\n" + "\n".join(lines) + "\n}\n")


def chained_state(n: int) -> str:
    """``n / 8`` weights of one shape without input_output_alias, each moment's next
    value also reading the next weight's moment: the last moment's output depends on it
    alone, and each one assigned leaves the one before depending on its own alone — as
    many rounds of the dataflow pairing as weights (a pass over every output per round
    is quadratic here)."""
    grads = max(2, n // 8)
    array = "f32[64]{0}"
    lines: list[str] = ["  %rate = f32[] constant(0.1)", "  %decay = f32[] constant(0.9)"]
    for k in range(grads):
        lines += [f"  %w.{k} = {array} parameter({3 * k})",
                  f"  %m.{k} = {array} parameter({3 * k + 1})",
                  f"  %x.{k} = {array} parameter({3 * k + 2})"]
    for k in range(grads):
        nxt = f"%m.{k + 1}" if k + 1 < grads else f"%m.{k}"
        lines += [f"  %g.{k} = {array} all-reduce(%x.{k}), replica_groups={{{{0,1,2,3}}}}, "
                  f"to_apply=%sum",
                  f"  %b.{k} = {array} broadcast(%decay), dimensions={{}}",
                  f"  %kept.{k} = {array} multiply(%m.{k}, %b.{k})",
                  f"  %also.{k} = {array} add(%kept.{k}, {nxt})",
                  f"  %mn.{k} = {array} add(%also.{k}, %g.{k})",
                  f"  %lr.{k} = {array} broadcast(%rate), dimensions={{}}",
                  f"  %d.{k} = {array} multiply(%mn.{k}, %lr.{k})",
                  f"  %new.{k} = {array} subtract(%w.{k}, %d.{k})"]
    outputs = ", ".join([array] * (2 * grads))
    values = [f"%new.{k}" for k in range(grads)] + [f"%mn.{k}" for k in range(grads)]
    lines.append(f"  ROOT %out = ({outputs}) tuple({', '.join(values)})")
    params = ", ".join([array] * (3 * grads))
    return (f"HloModule chained_state, "
            f"entry_computation_layout={{({params})->({outputs})}}, replica_count=4\n\n"
            + _REDUCER + "ENTRY %main {\n" + "\n".join(lines) + "\n}\n")


def scanned(n: int) -> str:
    """``n / 12`` layers' gradients stacked as a scan writes them (MaxText's scan_layers
    with FSDP): the loop all-reduces each layer's gradient and writes it into its stacked
    slot; after the loop each device takes its own columns of every slot (the
    partitioner's reduce-scatter form across the scan, which the pass reports already
    sharded slot by slot)."""
    slots = max(1, n // 12)
    stack, row = "f32[4,16]{1,0}", "f32[16]{0}"
    carry = "(s32[], " + ", ".join([stack] * slots) + ")"
    body = [f"  %b = {carry} parameter(0)", "  %i = s32[] get-tuple-element(%b), index=0",
            "  %c0 = s32[] constant(0)", "  %fi = f32[] convert(%i)"]
    for k in range(slots):
        body += [f"  %s.{k} = {stack} get-tuple-element(%b), index={k + 1}",
                 f"  %g.{k} = {row} broadcast(%fi), dimensions={{}}",
                 f"  %ar.{k} = {row} all-reduce(%g.{k}), channel_id={k + 1}, "
                 f"replica_groups={{{{0,1,2,3,4,5,6,7}}}}, use_global_device_ids=true, "
                 f"to_apply=%sum",
                 f"  %r.{k} = f32[1,16]{{1,0}} reshape(%ar.{k})",
                 f"  %u.{k} = {stack} dynamic-update-slice(%s.{k}, %r.{k}, %i, %c0)"]
    body += ["  %one = s32[] constant(1)", "  %next = s32[] add(%i, %one)",
             f"  ROOT %t = {carry} tuple(%next, "
             + ", ".join(f"%u.{k}" for k in range(slots)) + ")"]
    entry = ["  %zero = f32[] constant(0)", f"  %init = {stack} broadcast(%zero), dimensions={{}}",
             "  %i0 = s32[] constant(0)",
             f"  %start = {carry} tuple(%i0, " + ", ".join(["%init"] * slots) + ")",
             f"  %loop = {carry} while(%start), condition=%cond, body=%body",
             "  %offsets = s32[8]{0} constant({0, 2, 4, 6, 8, 10, 12, 14})",
             "  %pid = u32[] partition-id()",
             "  %offset.1 = s32[1]{0} dynamic-slice(%offsets, %pid), dynamic_slice_sizes={1}",
             "  %offset = s32[] reshape(%offset.1)", "  %c0 = s32[] constant(0)"]
    for k in range(slots):
        entry += [f"  %st.{k} = {stack} get-tuple-element(%loop), index={k + 1}",
                  f"  %mine.{k} = f32[4,2]{{1,0}} dynamic-slice(%st.{k}, %c0, %offset), "
                  f"dynamic_slice_sizes={{4,2}}"]
    outputs = ", ".join(["f32[4,2]{1,0}"] * slots)
    entry.append(f"  ROOT %out = ({outputs}) tuple("
                 + ", ".join(f"%mine.{k}" for k in range(slots)) + ")")
    return _four_trip_loop("scanned_step, num_partitions=8", carry, body, entry)


def _four_trip_loop(header: str, carry: str, body: list[str], entry: list[str]) -> str:
    """A module of ``header`` whose ``entry`` runs the loop ``%body`` (over ``carry``,
    slot 0 the counter) four times."""
    cond = (f"%cond (c: {carry}) -> pred[] {{\n  %c = {carry} parameter(0)\n"
            "  %ci = s32[] get-tuple-element(%c), index=0\n  %n = s32[] constant(4)\n"
            "  ROOT %more = pred[] compare(%ci, %n), direction=LT\n}\n\n")
    return (f"HloModule {header}\n\n" + _REDUCER + cond
            + f"%body (b: {carry}) -> {carry} {{\n" + "\n".join(body) + "\n}\n\n"
            + "ENTRY %main {\n" + "\n".join(entry) + "\n}\n")


def _nested_step(levels: list[str], entry_value: str) -> str:
    """A step over 4 replicas whose forward pass runs in the computations ``levels``
    (each defines ``%c.K`` or ``%body.K``/``%cond.K``, the next level nested in it;
    printed innermost first, as callees precede their callers) and
    ends in ``entry_value``'s lines defining ``%f``; its gradient is all-reduced and
    applied to the donated weight in the entry."""
    entry = ("ENTRY %main (x: f32[8], w: f32[8]) -> f32[8] {\n  %x = f32[8] parameter(0)\n"
             "  %w = f32[8] parameter(1)\n" + entry_value
             + "  %g = f32[8] all-reduce(%f), replica_groups={{0,1,2,3}}, to_apply=%sum\n"
             "  %lr = f32[] constant(0.1)\n  %lrs = f32[8] broadcast(%lr), dimensions={}\n"
             "  %step = f32[8] multiply(%lrs, %g)\n  ROOT %new = f32[8] subtract(%w, %step)\n}\n")
    return ("HloModule nested_step, input_output_alias={ {}: (1, {}, may-alias) }, "
            "replica_count=4\n\n" + _REDUCER + "\n".join(reversed(levels)) + "\n" + entry)


def nested_calls(n: int, innermost: str = "exponential") -> str:
    """The forward pass in ``n / 4`` computations, each calling the next, the last
    applying ``innermost`` to its parameter: nesting as deep as the module is long (a
    recursion per level fails long before)."""
    depth = max(1, n // 4)
    levels = []
    for k in range(depth):
        inner = (f"  ROOT %r.{k} = f32[8] call(%p.{k}), to_apply=%c.{k + 1}"
                 if k + 1 < depth else f"  ROOT %r.{k} = f32[8] {innermost}(%p.{k})")
        levels.append(f"%c.{k} (p.{k}: f32[8]) -> f32[8] {{\n  %p.{k} = f32[8] parameter(0)\n"
                      f"{inner}\n}}\n")
    return _nested_step(levels, "  %f = f32[8] call(%x), to_apply=%c.0\n")


def _loop_level(k: int, carry: str, trips: int, slots: list[str], inner: str,
                results: list[str]) -> str:
    """Level ``k`` of nested loops: a condition running ``trips`` iterations and a body
    reading its carry's slots after the counter as ``%<slot>.k``, running ``inner``
    and carrying ``%<result>.k`` on."""
    gets = "".join(f"  %{name}.{k} = {element} get-tuple-element(%b.{k}), index={i + 1}\n"
                   for i, (name, element) in enumerate(zip(slots, _elements(carry)[1:])))
    carried = "".join(f", %{name}.{k}" for name in results)
    return (f"%cond.{k} (c.{k}: {carry}) -> pred[] {{\n  %c.{k} = {carry} parameter(0)\n"
            f"  %ci.{k} = s32[] get-tuple-element(%c.{k}), index=0\n"
            f"  %n.{k} = s32[] constant({trips})\n"
            f"  ROOT %lt.{k} = pred[] compare(%ci.{k}, %n.{k}), direction=LT\n}}\n\n"
            f"%body.{k} (b.{k}: {carry}) -> {carry} {{\n  %b.{k} = {carry} parameter(0)\n"
            f"  %i.{k} = s32[] get-tuple-element(%b.{k}), index=0\n{gets}{inner}"
            f"  %one.{k} = s32[] constant(1)\n  %ni.{k} = s32[] add(%i.{k}, %one.{k})\n"
            f"  ROOT %r.{k} = {carry} tuple(%ni.{k}{carried})\n}}\n")


def _inner_loop(k: int, carry: str, slots: list[str], results: dict[str, int]) -> str:
    """Level ``k``'s call of level ``k + 1``: a loop started from a zero counter and
    ``%<slot>.k``, its elements ``results`` read back as ``%<name>.k``."""
    started = "".join(f", %{name}.{k}" for name in slots)
    elements = _elements(carry)
    reads = "".join(f"  %{name}.{k} = {elements[index]} get-tuple-element(%w.{k}), "
                    f"index={index}\n" for name, index in results.items())
    return (f"  %z.{k} = s32[] constant(0)\n  %it.{k} = {carry} tuple(%z.{k}{started})\n"
            f"  %w.{k} = {carry} while(%it.{k}), condition=%cond.{k + 1}, "
            f"body=%body.{k + 1}\n{reads}")


def _elements(carry: str) -> list[str]:
    """The element shapes of a flat tuple shape's text."""
    return [part.strip() for part in carry.strip("()").split(",")]


def nested_loops(n: int, trips: int = 1) -> str:
    """The forward pass in ``n / 12`` while loops, each in the previous one's body and
    running ``trips`` times (trip counts multiply)."""
    depth, carry = max(1, n // 12), "(s32[], f32[8])"
    levels = []
    for k in range(depth):
        inner = _inner_loop(k, carry, ["v"], {"nv": 1}) if k + 1 < depth else \
            f"  %nv.{k} = f32[8] exponential(%v.{k})\n"
        levels.append(_loop_level(k, carry, trips, ["v"], inner, ["nv"]))
    return _nested_step(levels, (
        f"  %z = s32[] constant(0)\n  %t = {carry} tuple(%z, %x)\n"
        f"  %loop = {carry} while(%t), condition=%cond.0, body=%body.0\n"
        "  %f = f32[8] get-tuple-element(%loop), index=1\n"))


def branched(n: int, size: int = 256) -> str:
    """A model under a ``lax.cond``: ``n / 12`` gradients each all-reduced inside both
    branches of one conditional (one branch relabels its sums through a reshape pair),
    each updated after it (what ``conditional-motion`` moves out, element by element)."""
    grads = max(1, n // 12)
    array = f"f32[{size}]{{0}}"
    carried = "(" + ", ".join([array] * grads) + ")"
    branches = []
    for name, relabel in (("take", False), ("skip", True)):
        lines = [f"  %p = {carried} parameter(0)"]
        for k in range(grads):
            lines.append(f"  %x.{k} = {array} get-tuple-element(%p), index={k}")
            lines.append(f"  %g.{k} = {array} all-reduce(%x.{k}), replica_groups={{{{0,1,2,3}}}}, "
                         f"to_apply=%sum")
            if relabel:
                lines.append(f"  %r.{k} = f32[16,{size // 16}]{{1,0}} reshape(%g.{k})")
                lines.append(f"  %o.{k} = {array} reshape(%r.{k})")
        outs = ", ".join(f"%{'o' if relabel else 'g'}.{k}" for k in range(grads))
        lines.append(f"  ROOT %t = {carried} tuple({outs})")
        branches.append(f"%{name} (p: {carried}) -> {carried} {{\n" + "\n".join(lines) + "\n}\n")
    entry = [f"  %w.{k} = {array} parameter({2 * k})" for k in range(grads)]
    entry += [f"  %x.{k} = {array} parameter({2 * k + 1})" for k in range(grads)]
    entry += [f"  %step = f32[] parameter({2 * grads})", "  %one = f32[] constant(1)",
              "  %pr = pred[] compare(%step, %one), direction=LT",
              f"  %args = {carried} tuple({', '.join(f'%x.{k}' for k in range(grads))})",
              f"  %c = {carried} conditional(%pr, %args, %args), true_computation=%take, "
              "false_computation=%skip",
              f"  %lr = {array} broadcast(%one), dimensions={{}}"]
    for k in range(grads):
        entry += [f"  %s.{k} = {array} get-tuple-element(%c), index={k}",
                  f"  %d.{k} = {array} multiply(%s.{k}, %lr)",
                  f"  %new.{k} = {array} subtract(%w.{k}, %d.{k})"]
    entry.append(f"  ROOT %out = {carried} tuple({', '.join(f'%new.{k}' for k in range(grads))})")
    params = ", ".join([array] * (2 * grads) + ["f32[]"])
    aliases = ", ".join(f"{{{k}}}: ({2 * k}, {{}}, may-alias)" for k in range(grads))
    return (f"HloModule branched_step, input_output_alias={{ {aliases} }}, "
            f"entry_computation_layout={{({params})->{carried}}}, replica_count=4\n\n"
            + _REDUCER + "".join(branches) + "ENTRY %main {\n" + "\n".join(entry) + "\n}\n")


def carried_offsets(n: int) -> str:
    """Gradients summed in the innermost of ``n / 14`` nested loops, each sum sliced at
    this device's offset, which the entry computes from its id and every loop carries in
    unchanged (XLA's hoisted offset lookup): read outermost first, as deep as the module
    is long."""
    depth, carry = max(1, n // 14), "(s32[], f32[8], s32[], f32[2])"
    levels = []
    for k in range(depth):
        inner = _inner_loop(k, carry, ["v", "o", "a"], {"nv": 1, "na": 3}) \
            if k + 1 < depth else (
                f"  %s.{k} = f32[8] all-reduce(%v.{k}), replica_groups={{{{0,1,2,3}}}}, "
                f"to_apply=%sum\n"
                f"  %m.{k} = f32[2] dynamic-slice(%s.{k}, %o.{k}), dynamic_slice_sizes={{2}}\n"
                f"  %na.{k} = f32[2] add(%a.{k}, %m.{k})\n"
                f"  %nv.{k} = f32[8] exponential(%v.{k})\n")
        levels.append(_loop_level(k, carry, 1, ["v", "o", "a"], inner, ["nv", "o", "na"]))
    return _nested_step(levels, (
        "  %id = u32[] replica-id()\n  %id.s = s32[] convert(%id)\n"
        "  %two = s32[] constant(2)\n  %offset = s32[] multiply(%id.s, %two)\n"
        "  %f0 = f32[] constant(0)\n  %zeros = f32[2] broadcast(%f0), dimensions={}\n"
        f"  %z = s32[] constant(0)\n  %t = {carry} tuple(%z, %x, %offset, %zeros)\n"
        f"  %loop = {carry} while(%t), condition=%cond.0, body=%body.0\n"
        "  %f = f32[8] get-tuple-element(%loop), index=1\n"))


def backprop(n: int) -> str:
    """``n / 6`` layers trained by backpropagation: each layer's activation is saved in
    the forward pass and read again in the backward one, in reverse, so activations
    live nested, each across every one saved after it, and each new weight is born as
    the backward pass reaches it (a transformer's step at its real depth)."""
    layers = max(1, n // 6)
    array = "f32[256]{0}"
    lines = [f"  %w.{k} = {array} parameter({k})" for k in range(layers)]
    lines += [f"  %h.0 = {array} parameter({layers})"]
    lines += [f"  %h.{k + 1} = {array} multiply(%h.{k}, %w.{k})" for k in range(layers)]
    lines += [f"  %d.{layers} = {array} negate(%h.{layers})"]
    for k in reversed(range(layers)):
        lines += [f"  %gw.{k} = {array} multiply(%d.{k + 1}, %h.{k})",
                  f"  %d.{k} = {array} multiply(%d.{k + 1}, %w.{k})",
                  f"  %g.{k} = {array} all-reduce(%gw.{k}), replica_groups={{{{0,1,2,3}}}}, "
                  f"to_apply=%sum",
                  f"  %new.{k} = {array} subtract(%w.{k}, %g.{k})"]
    outputs = ", ".join([array] * layers)
    lines.append(f"  ROOT %out = ({outputs}) tuple({', '.join(f'%new.{k}' for k in range(layers))})")
    aliases = ", ".join(f"{{{k}}}: ({k}, {{}}, may-alias)" for k in range(layers))
    return (f"HloModule backprop_step, input_output_alias={{ {aliases} }}, "
            f"entry_computation_layout={{({', '.join([array] * (layers + 1))})->({outputs})}}, "
            f"replica_count=4\n\n" + _REDUCER + "ENTRY %main {\n" + "\n".join(lines) + "\n}\n")


def scanned_weights(n: int) -> str:
    """``n / 12`` stacked weights a scan over layers reads (passed straight into the
    loop, as XLA's optimized modules pass them) and whose gradients it all-reduces one
    layer at a time into its carried slots; SGD on each after the loop."""
    slots = max(1, n // 12)
    stack, row = "f32[4,16]{1,0}", "f32[16]{0}"
    carry = "(s32[], " + ", ".join([stack] * (2 * slots)) + ")"
    body = [f"  %b = {carry} parameter(0)", "  %i = s32[] get-tuple-element(%b), index=0",
            "  %c0 = s32[] constant(0)"]
    for k in range(slots):
        body += [f"  %w.{k} = {stack} get-tuple-element(%b), index={2 * k + 1}",
                 f"  %s.{k} = {stack} get-tuple-element(%b), index={2 * k + 2}",
                 f"  %l.{k} = f32[1,16]{{1,0}} dynamic-slice(%w.{k}, %i, %c0), "
                 "dynamic_slice_sizes={1,16}",
                 f"  %f.{k} = {row} reshape(%l.{k})",
                 f"  %g.{k} = {row} multiply(%f.{k}, %f.{k})",
                 f"  %ar.{k} = {row} all-reduce(%g.{k}), channel_id={k + 1}, "
                 f"replica_groups={{{{0,1,2,3}}}}, to_apply=%sum",
                 f"  %r.{k} = f32[1,16]{{1,0}} reshape(%ar.{k})",
                 f"  %u.{k} = {stack} dynamic-update-slice(%s.{k}, %r.{k}, %i, %c0)"]
    body += ["  %one = s32[] constant(1)", "  %next = s32[] add(%i, %one)",
             f"  ROOT %t = {carry} tuple(%next, "
             + ", ".join(f"%w.{k}, %u.{k}" for k in range(slots)) + ")"]
    entry = [f"  %p.{k} = {stack} parameter({k})" for k in range(slots)]
    entry += ["  %zero = f32[] constant(0)", f"  %init = {stack} broadcast(%zero), dimensions={{}}",
              "  %i0 = s32[] constant(0)",
              f"  %start = {carry} tuple(%i0, "
              + ", ".join(f"%p.{k}, %init" for k in range(slots)) + ")",
              f"  %loop = {carry} while(%start), condition=%cond, body=%body",
              "  %lr = f32[] constant(0.01)", f"  %rate = {stack} broadcast(%lr), dimensions={{}}"]
    for k in range(slots):
        entry += [f"  %st.{k} = {stack} get-tuple-element(%loop), index={2 * k + 2}",
                  f"  %d.{k} = {stack} multiply(%st.{k}, %rate)",
                  f"  %new.{k} = {stack} subtract(%p.{k}, %d.{k})"]
    outputs = ", ".join([stack] * slots)
    entry.append(f"  ROOT %out = ({outputs}) tuple("
                 + ", ".join(f"%new.{k}" for k in range(slots)) + ")")
    return _four_trip_loop("scanned_weights, replica_count=4", carry, body, entry)


def tupled(n: int) -> str:
    """``n / 8`` weights whose gradients come out of one tuple (a ``shard_map``'s
    outputs), each taken out by a ``get-tuple-element`` before its SGD update."""
    grads = max(1, n // 8)
    array = "f32[16]{0}"
    lines = [f"  %x = {array} parameter({grads}), parameter_replication={{false}}"]
    for k in range(grads):
        lines += [f"  %w.{k} = {array} parameter({k})",
                  f"  %g.{k} = {array} multiply(%w.{k}, %x)",
                  f"  %ar.{k} = {array} all-reduce(%g.{k}), replica_groups={{{{0,1,2,3}}}}, "
                  "to_apply=%sum"]
    kinds = ", ".join([array] * grads)
    lines.append(f"  %out = ({kinds}) tuple(" + ", ".join(f"%ar.{k}" for k in range(grads)) + ")")
    lines.append("  %lr = f32[] constant(0.01)")
    lines.append(f"  %rate = {array} broadcast(%lr), dimensions={{}}")
    for k in range(grads):
        lines += [f"  %t.{k} = {array} get-tuple-element(%out), index={k}",
                  f"  %d.{k} = {array} multiply(%t.{k}, %rate)",
                  f"  %new.{k} = {array} subtract(%w.{k}, %d.{k})"]
    lines.append(f"  ROOT %root = ({kinds}) tuple("
                 + ", ".join(f"%new.{k}" for k in range(grads)) + ")")
    return ("HloModule tupled, replica_count=4\n\n" + _REDUCER + "ENTRY %main {\n"
            + "\n".join(lines) + "\n}\n")


GENERATORS: dict[str, Callable[[int], str]] = {
    "chain": chain, "ladder": ladder, "piecewise": piecewise, "fan": fan, "layers": layers,
    "clipped": clipped,
    "long_update": long_update, "fused": fused, "fused_slices": fused_slices,
    "momentum": momentum,
    "momentum_unaliased": lambda n: momentum(n, aliased=False), "scanned": scanned,
    "nested_calls": nested_calls, "nested_loops": nested_loops, "branched": branched,
    "carried_offsets": carried_offsets, "scanned_weights": scanned_weights, "tupled": tupled,
}


ANALYSES: dict[str, Callable[[Module], object]] = {
    "topological_order": lambda m: topological_order(m.entry),
    "find_gradient_all_reduces": find_gradient_all_reduces,
    "analyze_replication": analyze_replication,
    "planned_update_regions": planned_update_regions,
    "plan_kernels": lambda m: plan_kernels(m.entry),
    "memory_profile": memory_profile,
    "donated_parameter_copies": donated_parameter_copies,
    # The weight each gradient is named after (``--json``, ``report``, the JAX path).
    "gradient_weights": lambda m: gradient_weights(
        m.entry, pairs(m.output_aliases().items()) or same_types(m),
        flows=ElementOperands(m)),
    # ... and of every training and accumulation loop's gradients too (every parameter
    # named, so that the analysis runs).
    "user_names": lambda m: user_names(m, override={
        p.parameter_number: f"p[{p.parameter_number}]" for p in m.entry.parameters()}),
    "estimate_step": lambda m: estimate_step(m, load_profile("cpu-local"), {}),
    "optimize": lambda m: optimize(m, ShardingOptions()),
    "optimize_sharded": lambda m: optimize(m, ShardingOptions(state="sharded")),
    "optimize_params_sharded": lambda m: optimize(
        m, ShardingOptions(state="sharded", params="sharded"), force=True),
    # Only the largest gradient sharded, as told: every other state explained as whole.
    "optimize_largest_sharded": lambda m: optimize(
        m, ShardingOptions(state="sharded", min_shard_bytes=4096 * 4), force=True),
}


def count_calls(analysis: Callable[[Module], object], module: Module) -> int:
    """Python and builtin function calls made while ``analysis`` runs on ``module``."""
    calls = 0

    def profile(frame, event, arg) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    try:
        analysis(module)
    finally:
        sys.setprofile(None)
    return calls


def _growth(generator: str, analysis: str, n: int) -> float:
    small, large = (parse(GENERATORS[generator](size)) for size in (n, 2 * n))
    return (count_calls(ANALYSES[analysis], large) / count_calls(ANALYSES[analysis], small))


def _cases(analyses: list[str]) -> list[tuple[str, str]]:
    """Every (generator, analysis) pair."""
    return [(generator, analysis) for generator in GENERATORS for analysis in analyses]


@pytest.mark.parametrize("generator,analysis",
                         _cases([a for a in ANALYSES if not a.startswith("optimize")]))
def test_analysis_is_linear(generator: str, analysis: str) -> None:
    assert _growth(generator, analysis, 5_000) <= MAX_GROWTH


@pytest.mark.parametrize("generator,analysis",
                         _cases(["optimize", "optimize_sharded", "optimize_params_sharded",
                                 "optimize_largest_sharded"]))
def test_optimize_is_linear(generator: str, analysis: str) -> None:
    assert _growth(generator, analysis, 1_000) <= MAX_GROWTH


@pytest.mark.slow
@pytest.mark.parametrize("generator,analysis", _cases(list(ANALYSES)))
def test_analysis_is_linear_at_scale(generator: str, analysis: str) -> None:
    assert _growth(generator, analysis, 25_000) <= MAX_GROWTH


@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_deep_modules_do_not_recurse(state: str) -> None:
    """A 1,500-op learning-rate chain, a 60-rung ladder, a 50-boundary piecewise
    schedule and a 1,500-op padded update go through the optimizer, sharded, under the
    default recursion limit."""
    for text in (chain(1_500), ladder(120), piecewise(200), long_update(1_500)):
        result = optimize(parse(text), ShardingOptions(state=state), force=True)
        report, _ = result.report, result.text
        assert all(row.sharded for row in report.explanations)


def test_piecewise_schedule_through_shard_weight_update(request, monkeypatch) -> None:
    """``optax.adam`` on a 50-boundary ``piecewise_constant_schedule``: a ladder of
    scalar selects in every step, through the JAX path (its first call did not return
    in 200 s) and the same numbers as ``jax.jit``."""
    helpers = pytest.importorskip("jax_train_helpers")
    if not helpers.needs_devices(request):
        return
    import warnings

    import optax

    import hlo_shard.jax as hsj

    schedule = optax.piecewise_constant_schedule(1e-2, {2 * (i + 1): 0.95 for i in range(50)})
    monkeypatch.setitem(helpers.OPTIMIZERS, "adam_piecewise", lambda: optax.adam(schedule))
    program = helpers.make_program("mlp", "adam_piecewise", 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hsj.FallbackWarning)
        fast = hsj.shard_weight_update(program.step, force=True)
        (p_fast, s_fast), l_fast = helpers.train(fast, program, 6)
    assert fast.report is not None and fast.report["sharded"] > 0
    (p_jit, s_jit), l_jit = helpers.train(program.step, program, 6)
    helpers.assert_close((p_fast, s_fast), (p_jit, s_jit))


def test_shared_reads_price_as_the_listed_ones(monkeypatch) -> None:
    """The global norm's per-gradient sums, read by every update kernel, are listed
    once for all kernels (and a long chain of scalar adds keeps its links' sources as
    unions): the plan's reads, writes and the memory profile are those of listing them
    per kernel."""
    from hlo_shard.costmodel import kernels

    module = parse(clipped(800))  # 80 gradients: more sources than a listed union
    profile = load_profile("cpu-local")

    def plan_and_memory() -> tuple[list[tuple[int, float, float]], object, float]:
        plan = plan_kernels(module.entry, True, False)
        shared = sum(1 for k in plan.kernels if plan.kernel_inputs(k).shared)
        rows = [(len(k.members), k.read_bytes, k.write_bytes) for k in plan.kernels]
        estimate = estimate_step(module, profile, planned_update_regions(module))
        return rows, (estimate.memory.peak_bytes, estimate.memory.temp_bytes), shared

    rows, memory, shared = plan_and_memory()
    monkeypatch.setattr(kernels, "_SHARED_SOURCES", 10**9)
    monkeypatch.setattr(kernels, "_LISTED_UNION", 10**9)
    listed_rows, listed_memory, listed_shared = plan_and_memory()
    assert shared >= 80 and listed_shared == 0
    assert [row[0] for row in rows] == [row[0] for row in listed_rows]
    assert [value for row in rows for value in row[1:]] == pytest.approx(
        [value for row in listed_rows for value in row[1:]])
    assert memory == listed_memory


@pytest.mark.parametrize("command", ["report", "optimize", "scale"])
def test_loops_nested_past_what_a_float_counts_fail_cleanly(command: str, tmp_path) -> None:
    """200 nested loops of two trips each run their innermost body 2**200 times per step:
    the commands that price it say which loop in one line and exit 2 (the seconds and
    counts scaled by the runs overflowed a float: an internal error)."""
    from click.testing import CliRunner

    from hlo_shard.cli import main

    source = tmp_path / "nested.hlo"
    source.write_text(nested_loops(12 * 200, trips=2))
    args = [command, str(source)] + (["-o", str(tmp_path / "out.hlo")]
                                     if command == "optimize" else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: w.") and result.output.count("\n") == 1
    assert "times per step, past what can be priced" in result.output
    assert not (tmp_path / "out.hlo").exists()


def lines_run(action: Callable[[], object]) -> int:
    """Python lines executed while ``action`` runs (deterministic, unlike time): also
    sees a loop that calls nothing (a scan over a list per item), which
    :func:`count_calls` misses."""
    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return trace

    sys.settrace(trace)
    try:
        action()
    finally:
        sys.settrace(None)
    return lines


def count_lines(analysis: Callable[[Module], object], module: Module) -> int:
    """:func:`lines_run` of ``analysis`` on ``module``."""
    return lines_run(lambda: analysis(module))


@pytest.mark.parametrize("generator", ["nested_calls", "nested_loops", "fan", "clipped"])
@pytest.mark.parametrize("analysis", ["estimate_step", "analyze_replication",
                                      "gradient_weights"])
def test_lines_executed_are_linear(generator: str, analysis: str) -> None:
    """Counted in lines, not calls, two loops of no calls that were quadratic:
    ``Module.entry`` scanned the computations from the front once per computation the
    estimate asked about, and ``gradient_weights`` tried every group of outputs of a
    gradient's dimensions for every gradient (a fan of same-shaped weights)."""
    small, large = (parse(GENERATORS[generator](size)) for size in (2_000, 4_000))
    growth = (count_lines(ANALYSES[analysis], large)
              / count_lines(ANALYSES[analysis], small))
    assert growth <= MAX_GROWTH


@pytest.mark.parametrize("generator", ["scanned", "fan", "layers", "backprop"])
def test_memory_model_lines_executed_are_linear(generator: str) -> None:
    """The memory model places each temporary in the first output allocation, in size
    order, that fits it and whose values do not interfere with its own (XLA's buffer
    assignment): it built the list of every output for each temporary and tried each
    one too small for it too (2.1x per doubling on the scan's carried slots); and it
    checked the temporary against every allocation, each against every value it
    held, where backpropagation's saved activations interfere with most of them."""
    small, large = (parse({**GENERATORS, "backprop": backprop}[generator](size))
                    for size in (2_000, 4_000))
    growth = (count_lines(ANALYSES["memory_profile"], large)
              / count_lines(ANALYSES["memory_profile"], small))
    assert growth <= 2.05


@pytest.mark.parametrize("analysis", ["planned_update_regions", "estimate_step"])
def test_backpropagation_lines_executed_are_linear(analysis: str) -> None:
    """A module without parameter_replication: which parameters are per-device data was
    a walk from each parameter through the values it flows into elementwise, and a
    residual stream (here every layer's activation) flows through every layer after
    it (3.9x per doubling); the multi-output fusion of the cost model's kernel plan
    rewrote every member's kernel at each merge into a chain's growing kernel."""
    small, large = (parse(backprop(size)) for size in (2_000, 4_000))
    growth = count_lines(ANALYSES[analysis], large) / count_lines(ANALYSES[analysis], small)
    assert growth <= 2.05


@pytest.mark.parametrize("generator", ["layers", "fan", "clipped", "scanned"])
def test_optimize_lines_executed_are_linear(generator: str) -> None:
    """The whole optimizer, in lines: a search of the replication analysis's parameter
    list once per entry parameter (the manifest's signature) was quadratic in the
    parameters and grew 2.1x per doubling here; so did pointing each slot of a loop
    body's root tuple elsewhere (the rewriter scanned the user's operands for every
    use it moved: the scan's carried slots)."""
    small, large = (parse(GENERATORS[generator](size)) for size in (2_000, 4_000))
    growth = count_lines(ANALYSES["optimize"], large) / count_lines(ANALYSES["optimize"], small)
    assert growth <= 2.05


@pytest.mark.parametrize("generator", ["scanned_weights", "tupled", "layers", "fan"])
def test_per_weight_rows_lines_executed_are_linear(generator: str) -> None:
    """``report``'s per-weight table, in lines (the estimate's update region with it):
    each weight's gradient traffic from the sums a scan's body runs into its accumulated
    gradient (a walk back from each carried slot), and gradients read out of one tuple
    (each element's reads found once per tuple, not by a scan of its operands)."""
    def rows(module: Module) -> int:
        return lines_run(lambda: per_weight_rows(
            estimate_step(module, load_profile("cpu-local"), {}), module))

    small, large = (parse(GENERATORS[generator](size)) for size in (2_000, 4_000))
    assert rows(small) > 0
    growth = rows(large) / rows(small)
    assert growth <= 2.05


def test_unaliased_state_pairing_lines_are_linear() -> None:
    """Pairing state with its next value from the dataflow (no input_output_alias) goes
    in rounds, one per link of :func:`chained_state`; each round reads only the outputs
    that read a parameter the round before assigned (a round over every output grew
    2.06x per doubling here)."""
    small, large = (parse(chained_state(size)) for size in (2_000, 4_000))
    analysis = ANALYSES["optimize_sharded"]
    assert count_lines(analysis, large) / count_lines(analysis, small) <= 2.05
