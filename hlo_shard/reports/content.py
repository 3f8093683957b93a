"""What each cost report says: one module (``report``), two side by side (``diff``), a
projection over replica counts (``scale``), each as a
:class:`~hlo_shard.reports.document.Document` (rendered by :mod:`hlo_shard.reports.render`)
and as JSON data. All figures are per device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hlo_shard.analysis.names import instruction_names, labelled
from hlo_shard.costmodel.memory import CATEGORIES as MEMORY_CATEGORIES
from hlo_shard.costmodel.step_time import CATEGORIES, StepEstimate, per_weight_rows
from hlo_shard.ir import Module, shape_leaves
from hlo_shard.profiles import HardwareProfile
from hlo_shard.reports.document import Document, Figure, Table
from hlo_shard.units import fmt_bytes, fmt_count, fmt_delta, fmt_seconds, fmt_share

CATEGORY_LABELS = {
    "forward_backward": "forward/backward", "weight_update": "weight update",
    "communication": "communication", "formatting": "formatting overhead",
}

MEMORY_LABELS = {
    "weights": "weights", "optimizer_state": "optimizer state", "batch": "batch",
    "other_parameters": "other parameters", "gradients": "gradients",
    "activations": "activations", "temporaries": "other temporaries", "outputs": "outputs",
}


# ---------------------------------------------------------------- single report


def report_json(est: StepEstimate, module: Module, top: int = 10) -> dict:
    """The machine-readable report (all figures per device)."""
    memory = est.memory
    by_category = est.seconds_by_category()
    names = instruction_names(module)
    return {
        "module": est.module,
        "profile": est.profile.name,
        "devices": est.devices,
        "flops": est.executed.flops,
        "transcendentals": est.executed.transcendentals,
        "bytes_accessed": est.executed.bytes_accessed,
        "collective_bytes": est.collective_bytes,
        "peak_memory_bytes": memory.peak_bytes,
        "estimated_step_seconds": est.seconds,
        "seconds_by_category": by_category,
        "weight_update_share": est.weight_update_share,
        "xla_cost_analysis": {"flops": est.xla.flops, "transcendentals": est.xla.transcendentals,
                              "bytes_accessed": est.xla.bytes_accessed},
        "collectives": {kind: {"count": s.count, "payload_bytes": s.payload_bytes,
                               "bytes_sent": s.bytes_sent, "seconds": s.seconds}
                        for kind, s in sorted(est.collectives().items())},
        "memory": memory.to_json(),
        "parameters": est.parameter_kinds,
        **({"parameter_names": names} if names else {}),
        "weights": _named_weights(per_weight_rows(est, module), names),
        "top_instructions": [i.to_json() for i in est.top(top)],
        "region_source": est.region_source,
        "notes": est.notes,
    }


def _summary_rows(est: StepEstimate) -> list[tuple[str, float, Callable[[float], str]]]:
    """(label, value, formatter) rows shared by report and diff."""
    rows: list[tuple[str, float, Callable[[float], str]]] = [
        ("step time (estimated)", est.seconds, fmt_seconds)]
    for category, seconds in est.seconds_by_category().items():
        rows.append((f"  {CATEGORY_LABELS[category]}", seconds, fmt_seconds))
    rows += [
        ("flops", est.executed.flops, fmt_count),
        ("  weight-update flops", est.cost_by_category()["weight_update"].flops, fmt_count),
        ("transcendentals", est.executed.transcendentals, fmt_count),
        ("bytes accessed (XLA convention)", est.executed.bytes_accessed, fmt_bytes),
        ("collective bytes sent", est.collective_bytes, fmt_bytes),
        ("peak memory", est.memory.peak_bytes, fmt_bytes),
    ]
    return rows


def _memory_rows(est: StepEstimate) -> list[tuple[str, float]]:
    return [(MEMORY_LABELS[c], est.memory.peak_breakdown.get(c, 0)) for c in MEMORY_CATEGORIES]


def report_document(est: StepEstimate, module: Module, top: int = 10,
                    weights: dict[str, dict] | None = None) -> Document:
    """``weights``: :func:`per_weight_rows` of ``est``, where the caller has them already
    (the JSON of the same report: they walk the whole update once more)."""
    total = est.seconds
    doc = Document(
        f"hlo-shard report: {est.module}",
        f"profile {est.profile.name} ({est.profile.description}); {est.devices} devices; "
        f"all figures per device")
    summary = Table("Summary", ["", "value", "share of step"], [])
    for label, value, fmt in _summary_rows(est):
        share = fmt_share(value, total) if fmt is fmt_seconds and label != "step time (estimated)" else ""
        summary.rows.append([label, fmt(value), share])
    summary.rows.append(["weight-update share of the step", f"{100 * est.weight_update_share:.1f}%", ""])
    doc.tables.append(summary)
    collectives = Table("Collectives", ["kind", "count", "payload", "sent per device", "time"], [
        [kind, str(s.count), fmt_bytes(s.payload_bytes), fmt_bytes(s.bytes_sent),
         fmt_seconds(s.seconds)] for kind, s in sorted(est.collectives().items())],
        note=f"{est.profile.interconnect.algorithm} algorithm; XLA's cost analysis does not "
             "count network bytes (these are hlo-shard's α-β model)")
    doc.tables.append(collectives)
    peak = est.memory.peak_bytes
    doc.tables.append(Table(
        f"Peak memory: {fmt_bytes(peak)} at {est.memory.peak_instruction}",
        ["category", "bytes", "share"],
        [[label, fmt_bytes(value), fmt_share(value, peak)] for label, value in _memory_rows(est)],
        note="XLA's accounting: arguments + outputs + temporaries − donated outputs; at "
             f"most {fmt_bytes(est.memory.high_water_bytes)} is live at once "
             f"(at {est.memory.high_water_instruction})"))
    doc.tables.append(Table(
        f"Top {top} instructions by estimated time",
        ["instruction", "opcode", "category", "runs", "time", "flops", "bytes"],
        [[i.name, i.opcode, CATEGORY_LABELS[i.category], str(i.runs), fmt_seconds(i.seconds),
          fmt_count(i.cost.flops), fmt_bytes(i.cost.bytes_accessed)] for i in est.top(top)]))
    weights = per_weight_rows(est, module) if weights is None else weights
    names = instruction_names(module)
    if weights:
        # (a sharded update gathers its new weights: their own traffic, apart from the
        # gradient's; a column only where some weight is gathered)
        gathered = any(r["gathered_bytes"] for r in weights.values())
        doc.tables.append(Table("Per weight tensor", [
            "weight", "bytes", "update time", "update flops", "gradient sent",
            *(["weight gathered"] if gathered else [])],
            [[labelled(name, names.get(name)), fmt_bytes(r["bytes"]),
              fmt_seconds(r["update_seconds"]), fmt_count(r["update_flops"]),
              fmt_bytes(r["collective_bytes"]),
              *([fmt_bytes(r["gathered_bytes"])] if gathered else [])]
             for name, r in weights.items()]))
    doc.figures += [memory_figure([est]), step_figure([est])]
    doc.notes += _notes(est)
    return doc


def _named_weights(rows: dict[str, dict], names: dict[str, str]) -> dict[str, dict]:
    """``per_weight_rows`` with the user's ``name`` of each weight where the module has it."""
    return {hlo: {**row, "name": names[hlo]} if hlo in names else row
            for hlo, row in rows.items()}


def _notes(est: StepEstimate) -> list[str]:
    notes = list(est.notes)
    if est.region_source == "fallback":
        notes.append("weight update counted as the elementwise work downstream of the "
                     "gradient sums: the module has no gradient all-reduce the pass would "
                     "shard (already sharded, or nothing eligible), so its own region "
                     "analysis has nothing to plan")
    if est.executed != est.xla:
        notes.append("counts include every loop iteration; XLA's cost analysis counts one "
                     f"(flops {fmt_count(est.xla.flops)})")
    return notes


# ------------------------------------------------------------------------- diff


def diff_json(before: StepEstimate, after: StepEstimate, before_module: Module,
              after_module: Module) -> dict:
    a, b = report_json(before, before_module), report_json(after, after_module)
    keys = ("flops", "transcendentals", "bytes_accessed", "collective_bytes",
            "peak_memory_bytes", "estimated_step_seconds")
    delta = {k: b[k] - a[k] for k in keys}
    delta["seconds_by_category"] = {c: b["seconds_by_category"][c] - a["seconds_by_category"][c]
                                    for c in CATEGORIES}
    return {"before": a, "after": b, "delta": delta, "verdict": step_verdict(before, after),
            "programs_differ": programs_differ(before_module, after_module) or None,
            "ratio": {"estimated_step_seconds": (b["estimated_step_seconds"]
                                                 / a["estimated_step_seconds"])
                      if a["estimated_step_seconds"] else None}}


def _diff_table(title: str, rows: Sequence[tuple[str, float, float, Callable[[float], str]]],
                note: str = "") -> Table:
    table = Table(title, ["", "before", "after", "Δ", "Δ%"], [], note)
    for label, a, b, fmt in rows:
        table.rows.append([label, fmt(a), fmt(b), *fmt_delta(a, b, fmt)])
    return table


def diff_document(before: StepEstimate, after: StepEstimate, before_module: Module,
                  after_module: Module,
                  weights: tuple[dict[str, dict], dict[str, dict]] | None = None) -> Document:
    """``weights``: :func:`per_weight_rows` of ``before`` and ``after``, where the caller
    has them already (see :func:`report_document`)."""
    differ = programs_differ(before_module, after_module)
    doc = Document(f"hlo-shard diff: {before.module} → {after.module}",
                   f"profile {before.profile.name}; {before.devices} → {after.devices} devices; "
                   f"all figures per device\n{step_verdict(before, after)}"
                   + (f"\nnote: {differ}" if differ else ""))
    rows = [(label, a, b, fmt) for (label, a, fmt), (_, b, _) in
            zip(_summary_rows(before), _summary_rows(after))]
    rows.append(("weight-update share", before.weight_update_share, after.weight_update_share,
                 lambda v: f"{100 * v:.1f}%"))
    doc.tables.append(_diff_table("Summary", rows))
    kinds = sorted(set(before.collectives()) | set(after.collectives()))
    coll_rows = []
    for kind in kinds:
        was, now = before.collectives().get(kind), after.collectives().get(kind)
        coll_rows += [
            (f"{kind}: count", was.count if was else 0, now.count if now else 0,
             lambda v: f"{v:.0f}"),
            (f"{kind}: sent per device", was.bytes_sent if was else 0,
             now.bytes_sent if now else 0, fmt_bytes),
            (f"{kind}: time", was.seconds if was else 0, now.seconds if now else 0, fmt_seconds)]
    sent = [sum(c.bytes_sent for c in est.collectives().values()) for est in (before, after)]
    more = "; the bytes added here gather other values too (the optimizer state a " \
           "gathered module keeps whole, weights read whole)" if sent[1] > 1.01 * sent[0] else ""
    doc.tables.append(_diff_table("Collectives", coll_rows,
                                  "an all-reduce moves the bytes of a reduce-scatter plus an "
                                  "all-gather: sharding a gradient changes latency, not wire "
                                  f"bytes{more}"))
    doc.tables.append(_diff_table(
        f"Peak memory ({before.memory.peak_instruction} → {after.memory.peak_instruction})",
        [(label, a, b, fmt_bytes) for (label, a), (_, b) in
         zip(_memory_rows(before), _memory_rows(after))]))
    weights_a, weights_b = weights if weights is not None else (
        per_weight_rows(before, before_module), per_weight_rows(after, after_module))
    names = instruction_names(before_module)
    weight_rows = []
    for name in weights_a:
        a, b = weights_a[name], weights_b.get(name)
        if b is None:
            continue
        label = labelled(name, names.get(name))
        weight_rows += [
            (f"{label}: update time", a["update_seconds"], b["update_seconds"], fmt_seconds),
            (f"{label}: update flops", a["update_flops"], b["update_flops"], fmt_count),
            (f"{label}: gradient sent", a["collective_bytes"], b["collective_bytes"], fmt_bytes)]
        if a["gathered_bytes"] or b["gathered_bytes"]:
            weight_rows.append((f"{label}: weight gathered", a["gathered_bytes"],
                                b["gathered_bytes"], fmt_bytes))
    if weight_rows:
        doc.tables.append(_diff_table("Per weight tensor", weight_rows))
    doc.figures += [step_figure([before, after]), memory_figure([before, after])]
    doc.notes += [f"before: {n}" for n in _notes(before)] + [f"after: {n}" for n in _notes(after)]
    return doc


def programs_differ(before: Module, after: Module) -> str:
    """Why ``after`` is not ``before`` optimized ("" where it may be): the optimizer keeps
    the entry's parameter arrays, their number and element types (a sharded state
    changes their shapes only), so two steps whose parameters differ there are two
    programs, and the verdict compares their steps, not a rewrite."""
    types = [[leaf.element_type for param in module.entry.parameters()
              for _, leaf in shape_leaves(param.shape)] for module in (before, after)]
    if types[0] == types[1]:
        return ""
    what = (f"{len(types[0])} and {len(types[1])} parameter arrays"
            if len(types[0]) != len(types[1]) else "parameters of other element types")
    return (f"before and after take {what}: two programs, not a module and its optimized "
            f"form (the verdict compares their steps)")


def step_verdict(before: StepEstimate, after: StepEstimate) -> str:
    """One line saying which module is predicted faster, by how much, on which profile."""
    a, b = before.seconds, after.seconds
    if not a or abs(b - a) <= 1e-4 * a:
        return f"verdict: the same predicted step time on profile {before.profile.name}"
    word = "faster" if b < a else "SLOWER"
    return (f"verdict: after is predicted {abs(b - a) / a:.1%} {word} per step than before "
            f"on profile {before.profile.name} ({b / a:.2f}x)")


# ---------------------------------------------------------------------- figures


def _label(est: StepEstimate, index: int, count: int) -> str:
    return ("before", "after")[index] if count == 2 else est.module


def memory_figure(estimates: Sequence[StepEstimate]) -> Figure:
    def draw(ax: Any) -> None:
        for index, est in enumerate(estimates):
            xs = [p for p, _, _ in est.memory.curve]
            ys = [v / (1 << 20) for _, _, v in est.memory.curve]
            length = max(len(xs) - 1, 1)
            ax.plot([x / length for x in xs], ys, label=_label(est, index, len(estimates)))
        ax.set_xlabel("program order (fraction of the schedule)")
        ax.set_ylabel("live MiB per device")
        ax.legend()

    return Figure("Memory over the program", draw)


def step_figure(estimates: Sequence[StepEstimate]) -> Figure:
    def draw(ax: Any) -> None:
        labels = [_label(e, i, len(estimates)) for i, e in enumerate(estimates)]
        bottoms = [0.0] * len(estimates)
        for category in CATEGORIES:
            values = [e.seconds_by_category()[category] * 1e3 for e in estimates]
            ax.bar(labels, values, bottom=bottoms, label=CATEGORY_LABELS[category])
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.set_ylabel("estimated ms per step")
        # Beside the axes: inside, the legend of a tall stacked bar covers the bar.
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)

    return Figure("Step time by category", draw)


# ------------------------------------------------------------------------- scale


def _scale_method(parameters: int | None) -> str:
    method = "the pass is re-run at each replica count"
    if parameters is not None:
        method += f"; the model scaled analytically to {fmt_count(parameters)} weights"
    return method


def scale_json(module: str, profile: HardwareProfile, points: Sequence, batch_mode: str,
               state: str, parameters: int | None = None) -> dict:
    return {"module": module, "profile": profile.name, "batch_per_replica": batch_mode,
            "state": state, "parameters": parameters,
            "method": f"{_scale_method(parameters)}; estimated on the profile",
            "points": [p.to_json() for p in points]}


def scale_document(module: str, profile: HardwareProfile, points: Sequence, batch_mode: str,
                   state: str, parameters: int | None = None) -> Document:
    doc = Document(
        f"hlo-shard scale: {module}",
        f"profile {profile.name}; batch per replica {batch_mode}; sharded module with "
        f"--state {state}; {_scale_method(parameters)}; per device")
    table = Table(f"Projected step time and peak memory (profile {profile.name})", [
        "replicas", "original", "update share", "sharded", "update share", "saving",
        "peak original", "peak sharded"], [])
    for p in points:
        s = p.sharded
        table.rows.append([
            str(p.replicas), fmt_seconds(p.original.step_seconds),
            f"{100 * p.original.weight_update_share:.1f}%",
            fmt_seconds(s.step_seconds) if s else "–",
            f"{100 * s.weight_update_share:.1f}%" if s else "–",
            f"{100 * p.saving:.1f}%" if p.saving is not None else p.error,
            fmt_bytes(p.original.peak_memory_bytes),
            fmt_bytes(s.peak_memory_bytes) if s else "–"])
    doc.tables.append(table)
    doc.figures.append(scale_figure(points))
    return doc


def scale_figure(points: Sequence) -> Figure:
    def draw(ax: Any) -> None:
        xs = [p.replicas for p in points]
        ax.plot(xs, [p.original.step_seconds * 1e3 for p in points], "o-", label="original")
        shown = [p for p in points if p.sharded]
        ax.plot([p.replicas for p in shown], [p.sharded.step_seconds * 1e3 for p in shown],
                "o-", label="sharded weight update")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel("estimated ms per step")
        for p in shown:
            ax.annotate(f"−{100 * p.saving:.0f}%", (p.replicas, p.sharded.step_seconds * 1e3),
                        textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
        ax.legend()

    return Figure("Step time across replica counts", draw)
