"""The pass on XLA-optimized (fused, laid-out) modules: what ``optimize`` does with
``after_optimizations`` dumps and what the ``install()`` hook hands it.

XLA will not compile its own optimized text again, so these tests are structural (the
result validates, the shard bodies are elementwise on ``[L]``, the explain rows name what
stops a fusion); the numeric checks of fused rewrites run through the hook
(tests/test_jax_hook.py: real jax steps compiled with the pass inside XLA).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from hlo_shard.analysis.collectives import recovered_device_counts
from hlo_shard import optimize
from hlo_shard.ir import ArrayShape
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.validate import validate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
OPTIMIZED = sorted((FIXTURES / "optimized").glob("*.hlo"))

#: A gradient computed transposed (JAX's weight gradients) and an update fusion whose body
#: transposes it back into the weight's order (what XLA's fusion makes of m' = m + 0.1 g^T).
FUSED = """HloModule fused_step, entry_computation_layout={(f32[4,6]{1,0}, f32[6,4]{1,0})->f32[6,4]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%update (p0: f32[6,4], p1: f32[4,6]) -> f32[6,4] {
  %p1 = f32[4,6]{1,0} parameter(1)
  %c = f32[] constant(0.1)
  %b = f32[4,6]{1,0} broadcast(%c), dimensions={}
  %scaled = f32[4,6]{1,0} multiply(%p1, %b)
  %t = f32[6,4]{0,1} transpose(%scaled), dimensions={1,0}
  %copy = f32[6,4]{1,0} copy(%t)
  %p0 = f32[6,4]{1,0} parameter(0)
  ROOT %sum = f32[6,4]{1,0} add(%p0, %copy)
}

ENTRY %main (g: f32[4,6], m: f32[6,4]) -> f32[6,4] {
  %g = f32[4,6]{1,0} parameter(0)
  %m = f32[6,4]{1,0} parameter(1), sharding={replicated}
  %ar = f32[4,6]{1,0} all-reduce(%g), channel_id=1, replica_groups=[1,4]<=[4], use_global_device_ids=true, to_apply=%add
  ROOT %f = f32[6,4]{1,0} fusion(%m, %ar), kind=kLoop, calls=%update
}
"""


def _optimize(text: str, **options):
    """The rewrite as told (``force``): these modules are too small to be predicted faster."""
    module = parse(text)
    result = optimize(module, ShardingOptions(**options), force=True)
    report, out = result.report, result.text
    return report, parse(out)


def test_the_body_a_sharded_copy_replaces_is_removed():
    """``update`` is called by nothing once ``update.shard`` replaced it: it goes (XLA
    would carry it through every pass after the hook), and every computation left but
    the entry is called."""
    _, out = _optimize(FUSED)
    names = [comp.name for comp in out.computations]
    assert "update.shard" in names and "update" not in names
    called = {name for comp in out.computations for inst in comp.instructions
              for name in inst.called_computations()}
    assert set(names) - called == {out.entry.name}


def test_a_fusion_transposing_the_gradient_runs_on_shards():
    report, out = _optimize(FUSED)
    (row,) = report.explanations
    assert row.sharded and row.ops_moved == 1
    # the gradient is formatted (one transpose, in a loop fusion of its own: XLA's fusion
    # has run) before the reduce-scatter; m is sliced in its own order — inside the
    # update's fusion, which takes it whole and flat (nothing would fuse a slice of its
    # own any more) — and the result gathered without a transpose
    assert row.formatting_copies == 1
    body = out.computation("update.shard")
    assert {i.opcode for i in body.instructions} == {"parameter", "constant", "broadcast",
                                                     "multiply", "copy", "add",
                                                     "dynamic-slice"}
    (sliced,) = [i for i in body.instructions if i.opcode == "dynamic-slice"]
    assert body[sliced.operands[0]].shape.dims == (24,) and sliced.shape.dims == (6,)
    assert all(i.shape.dims in ((), (6,), (24,)) for i in body.instructions)
    entry = [i.opcode for i in out.entry.instructions]
    assert "all-reduce" not in entry and "transpose" not in entry
    assert "dynamic-slice" not in entry
    fused = [out.computation(i.attributes["calls"].name) for i in out.entry.instructions
             if i.opcode == "fusion"]
    assert [b.root.opcode for b in fused].count("transpose") == 1
    assert not validate(out)


def test_lost_device_counts_are_recovered_from_the_groups():
    report, out = _optimize(FUSED)
    assert out.num_partitions == 4 and any("num_partitions=4 recovered" in n
                                           for n in report.notes)
    # a header that has them is left alone; cross-replica groups name replicas
    assert recovered_device_counts(parse(FUSED.replace(
        "entry_computation_layout", "num_partitions=4, entry_computation_layout"))) == {}
    replicas = FUSED.replace("channel_id=1, replica_groups=[1,4]<=[4], "
                             "use_global_device_ids=true", "replica_groups={{0,1,2,3}}")
    assert recovered_device_counts(parse(replicas)) == {"replica_count": 4}


@pytest.mark.parametrize("body, stop", [
    # a reversal is no element order: the op is named
    ("%copy = f32[6,4]{1,0} reverse(%t), dimensions={0}", "%copy (reverse) is not elementwise"),
    # a non-scalar constant cannot be sliced inside the body
    ("%copy = f32[6,4]{1,0} constant({...})", "%copy (constant) is not elementwise"),
])
def test_explain_names_the_op_that_stops_a_fusion(body, stop):
    text = FUSED.replace("%copy = f32[6,4]{1,0} copy(%t)", body)
    if "constant" in body:
        text = text.replace("constant({...})", "constant({ {1,2,3,4}, {1,2,3,4}, {1,2,3,4}, "
                                                 "{1,2,3,4}, {1,2,3,4}, {1,2,3,4} })")
    report, _ = _optimize(text)
    (row,) = report.explanations
    assert not row.sharded
    assert f"fusion %f: {stop}" in row.reason, row.reason


def test_a_body_reading_one_value_in_two_orders_stays_whole():
    """m + g + g^T has no element order in which both reads of g are the shard's own."""
    square = FUSED.replace("f32[4,6]", "f32[4,4]").replace("f32[6,4]", "f32[4,4]")
    square = square[:square.index("%update (")] + """%update (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  %t = f32[4,4]{1,0} transpose(%p1), dimensions={1,0}
  %sum = f32[4,4]{1,0} add(%p0, %p1)
  ROOT %both = f32[4,4]{1,0} add(%sum, %t)
}
""" + square[square.index("ENTRY"):]
    report, _ = _optimize(square)
    (row,) = report.explanations
    assert not row.sharded and "in two element orders" in row.reason, row.reason


def test_a_fusion_reading_the_same_gradient_twice():
    twice = FUSED.replace("%p0 = f32[6,4]{1,0} parameter(0)",
                          "%p0 = f32[4,6]{1,0} parameter(0)\n  %p0t = f32[6,4]{0,1} "
                          "transpose(%p0), dimensions={1,0}") \
        .replace("add(%p0, %copy)", "add(%p0t, %copy)") \
        .replace("%update (p0: f32[6,4]", "%update (p0: f32[4,6]") \
        .replace("fusion(%m, %ar)", "fusion(%ar, %ar)")
    report, out = _optimize(twice)
    (row,) = report.explanations
    assert row.sharded and row.ops_moved == 1 and not validate(out)
    (fusion,) = [i for i in out.entry.instructions if i.opcode == "fusion" and
                 out.computation(i.attributes["calls"].name).root.opcode != "transpose"]
    assert fusion.operands[0] == fusion.operands[1]


def _sharded_gradients(path: Path) -> Counter:
    report, out = _optimize(path.read_text())
    assert not validate(out)
    # dims, not types: XLA:CPU all-reduces the bf16 gradients of the bf16 steps in f32
    return Counter((row.shape[row.shape.index("["):].split("{")[0], row.sharded)
                   for row in report.explanations)


@pytest.mark.parametrize("path", OPTIMIZED, ids=lambda p: p.stem)
def test_optimized_fixture_shards_what_its_spmd_form_shards(path):
    """The fused form of a step shards the same gradients as its SPMD form (the same
    shapes, sharded or not), and the result of the scheduled module validates: every
    instruction after its operands, in the printed (schedule) order."""
    _, out = _optimize(path.read_text())
    assert out.is_scheduled and not validate(out)
    assert _sharded_gradients(path) == _sharded_gradients(FIXTURES / "spmd" / path.name)


def test_the_combined_tuple_all_reduce_is_split():
    """XLA's combiner made one tuple all-reduce of every gradient and the loss: the
    gradients go to reduce-scatters, the loss keeps an all-reduce of its own."""
    _, out = _optimize((FIXTURES / "optimized" / "momentum.n4.hlo").read_text(),
                       strategy="per-tensor")
    opcodes = Counter(i.opcode for i in out.entry.instructions)
    assert opcodes["reduce-scatter"] == 4
    (loss,) = [i for i in out.entry.instructions if i.opcode == "all-reduce"]
    assert isinstance(loss.shape, ArrayShape) and loss.shape.is_scalar


def test_the_pieces_of_a_combined_bucket_share_their_kernels():
    """XLA:CPU compiles each distinct kernel once, and a slice's starts are part of its
    kernel: in a fused module each value's piece of a combined bucket is a loop fusion of a
    dynamic-slice reading its starts from the tuple one small fusion per bucket writes,
    so pieces of one shape are one kernel to compile."""
    _, out = _optimize((FIXTURES / "optimized" / "momentum.n4.hlo").read_text(),
                       strategy="combined")
    entry = out.entry

    def body(inst):
        return out.computation(inst.called("calls")) if inst.opcode == "fusion" else None

    pieces = [i for i in entry.instructions if body(i) and body(i).root.opcode == "dynamic-slice"]
    tables = {i.name for i in entry.instructions if body(i) and body(i).root.opcode == "tuple"
              and all(b.opcode in ("constant", "tuple") for b in body(i).instructions)}
    buckets = [i for i in entry.instructions if i.opcode in ("reduce-scatter", "all-gather")]
    assert len(pieces) >= 2 * len(buckets) and len(tables) == len(buckets) == 2
    assert not [i for i in entry.instructions if i.opcode == "slice"]
    for piece in pieces:
        starts = [entry[o] for o in piece.operands[1:]]
        assert all(s.opcode == "get-tuple-element" and s.operands[0] in tables for s in starts)
    assert not validate(out)


def test_a_laid_out_module_flattens_with_bitcasts():
    # No layout pass runs after the rewrite of a fused module and XLA:CPU runs a
    # top-level reshape as a copy kernel: a row-major → row-major flattening is a bitcast.
    _, out = _optimize(FUSED)
    entry = out.entry
    flattening = [i for i in entry.instructions if i.opcode in ("reshape", "bitcast")
                  and entry[i.operands[0]].shape.minor_to_major() == tuple(
                      range(entry[i.operands[0]].shape.rank - 1, -1, -1))]
    assert flattening and all(i.opcode == "bitcast" for i in flattening)


#: A global norm as XLA:CPU fuses it: the gradient's squares summed in tiles of 2×4 (a
#: reduce-window fusion), the tiles then reduced to the norm; next to a loop-fused update.
TILED_NORM = """HloModule tiled_norm, entry_computation_layout={(f32[8,4]{1,0}, f32[8,4]{1,0})->(f32[8,4]{1,0}, f32[])}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%squares (p0: f32[8,4], zero: f32[]) -> f32[4,1] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %sq = f32[8,4]{1,0} multiply(%p0, %p0)
  %zero = f32[] parameter(1)
  ROOT %tiles = f32[4,1]{1,0} reduce-window(%sq, %zero), window={size=2x4 stride=2x4}, to_apply=%add
}

%total (t: f32[4,1]) -> f32[] {
  %t = f32[4,1]{1,0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %sum = f32[] reduce(%t, %zero), dimensions={0,1}, to_apply=%add
}

%update (p0: f32[8,4], p1: f32[8,4]) -> f32[8,4] {
  %p1 = f32[8,4]{1,0} parameter(1)
  %c = f32[] constant(0.1)
  %b = f32[8,4]{1,0} broadcast(%c), dimensions={}
  %scaled = f32[8,4]{1,0} multiply(%p1, %b)
  %p0 = f32[8,4]{1,0} parameter(0)
  ROOT %sum = f32[8,4]{1,0} add(%p0, %scaled)
}

ENTRY %main (g: f32[8,4], m: f32[8,4]) -> (f32[8,4], f32[]) {
  %g = f32[8,4]{1,0} parameter(0)
  %m = f32[8,4]{1,0} parameter(1), sharding={replicated}
  %ar = f32[8,4]{1,0} all-reduce(%g), channel_id=1, replica_groups=[1,4]<=[4], use_global_device_ids=true, to_apply=%add
  %zero = f32[] constant(0)
  %tiles = f32[4,1]{1,0} fusion(%ar, %zero), kind=kLoop, calls=%squares
  %norm = f32[] fusion(%tiles), kind=kLoop, calls=%total
  %f = f32[8,4]{1,0} fusion(%m, %ar), kind=kLoop, calls=%update
  ROOT %out = (f32[8,4]{1,0}, f32[]) tuple(%f, %norm)
}
"""


def _called(module, opcode="fusion") -> list[str]:
    return [i.attributes["calls"].name for i in module.entry.instructions if i.opcode == opcode]


def test_a_tiled_sum_of_squares_runs_on_the_gradients_blocks():
    """Each device sums the tiles of its own rows (2 of 8: one tile); only the 4 tile sums
    are gathered for the norm, not the gradient."""
    report, out = _optimize(TILED_NORM)
    (row,) = report.explanations
    assert row.sharded and not validate(out)
    assert "squares.block" in _called(out) and "squares" not in _called(out)
    body = out.computation("squares.block")
    assert body.root.shape.dims == (1, 1) and body["sq"].shape.dims == (2, 4)
    gathered = [i.shape.dims for i in out.entry.instructions if i.opcode == "all-gather"]
    # One bucket: the 4 tile sums and the new momentum (8 x 4), not the gradient too.
    assert gathered == [(4 + 8 * 4,)], gathered
    # Each in its own all-gather, likewise.
    _, out = _optimize(TILED_NORM, strategy="per-tensor")
    gathered = [i.shape.dims for i in out.entry.instructions if i.opcode == "all-gather"]
    assert sorted(gathered) == [(4,), (8 * 4,)], gathered


@pytest.mark.parametrize("window", [
    "size=4x4 stride=4x4",  # a tile across two devices' rows
    "size=2x4 stride=1x4",  # overlapping windows
    "size=2x4 stride=2x4 pad=0_1x0_0",  # padded
])
def test_windows_that_do_not_tile_the_blocks_need_the_whole_gradient(window):
    rows = 2 if "size=4x4" in window else 4
    text = TILED_NORM.replace("window={size=2x4 stride=2x4}", "window={%s}" % window)
    if "size=4x4" in window:
        text = text.replace("f32[4,1]", f"f32[{rows},1]")
    if "stride=1x4" in window:
        text = text.replace("f32[4,1]", "f32[7,1]")
    if "pad=" in window:
        text = text.replace("f32[4,1]", "f32[5,1]")
    report, out = _optimize(text)
    assert not validate(out)
    assert "squares" in _called(out) and "squares.block" not in _called(out)


def _dot_gradient() -> str:
    """:data:`FUSED` with its gradient the product ``x^T·dy`` (jax's weight gradient)."""
    return FUSED.replace(
        "ENTRY %main (g: f32[4,6], m: f32[6,4]) -> f32[6,4] {\n  %g = f32[4,6]{1,0} parameter(0)",
        "ENTRY %main (x: f32[2,4], m: f32[6,4], dy: f32[2,6]) -> f32[6,4] {\n"
        "  %x = f32[2,4]{1,0} parameter(0)\n  %dy = f32[2,6]{1,0} parameter(2)\n"
        "  %g = f32[4,6]{1,0} dot(%x, %dy), lhs_contracting_dims={0}, rhs_contracting_dims={0}"
    ).replace(
        "entry_computation_layout={(f32[4,6]{1,0}, f32[6,4]{1,0})",
        "entry_computation_layout={(f32[2,4]{1,0}, f32[6,4]{1,0}, f32[2,6]{1,0})")


def test_a_transposed_dot_gradient_is_computed_the_other_way_round():
    """The weight gradient as XLA:CPU fuses jax's: ``x^T·dy`` in the transposed order of
    the update. The pass formats it by computing ``dy^T·x`` instead of transposing the
    whole product (as XLA's simplifier would have, before fusion)."""
    report, out = _optimize(_dot_gradient())
    (row,) = report.explanations
    assert row.sharded and not validate(out)
    (dot,) = [i for i in out.entry.instructions if i.opcode == "dot"]
    assert dot.operands == ["dy", "x"] and dot.shape.dims == (6, 4)
    assert [out.computation(c).root.opcode for c in _called(out)].count("transpose") == 0


def test_a_dot_read_elsewhere_too_is_transposed_not_computed_twice():
    text = _dot_gradient().replace(
        "ROOT %f = f32[6,4]{1,0} fusion(%m, %ar), kind=kLoop, calls=%update",
        "%f = f32[6,4]{1,0} fusion(%m, %ar), kind=kLoop, calls=%update\n"
        "  ROOT %out = (f32[6,4]{1,0}, f32[4,6]{1,0}) tuple(%f, %g)").replace(
        "->f32[6,4]{1,0}}", "->(f32[6,4]{1,0}, f32[4,6]{1,0})}").replace(
        "-> f32[6,4] {\n  %x", "-> (f32[6,4], f32[4,6]) {\n  %x")
    report, out = _optimize(text)
    assert report.explanations[0].sharded and not validate(out)
    assert [i.opcode for i in out.entry.instructions].count("dot") == 1
    assert [out.computation(c).root.opcode for c in _called(out)].count("transpose") == 1


@pytest.mark.parametrize("path", OPTIMIZED, ids=lambda p: p.name)
def test_fusions_alike_share_their_element_orders_as_found_apart(path, monkeypatch):
    """The analysis finds a loop fusion's element orders once per structure
    (:func:`~hlo_shard.graph.fused_structure`) and sharded operands: the module and
    report are those of finding each fusion's apart."""
    from hlo_shard.passes.weight_update import analysis

    def optimized() -> tuple[str, list]:
        result = optimize(parse(path.read_text()), ShardingOptions(), force=True)
        return result.text, [(r.all_reduce, r.sharded, r.reason_code, r.reason)
                             for r in result.report.explanations]

    shared = optimized()
    found = Counter[str]()
    body_access = analysis.body_access

    def counted(body, seeds):
        found[body.name] += 1
        return body_access(body, seeds)

    monkeypatch.setattr(analysis, "body_access", counted)
    assert optimized() == shared
    repeated = sum(found.values())
    monkeypatch.setattr(analysis, "fused_structure", lambda fusion, fused: None)
    found.clear()
    assert optimized() == shared
    # (these two repeat an update fusion's structure: found once there)
    if path.name in ("momentum.n4.hlo", "transformer.n4.hlo"):
        assert sum(found.values()) > repeated
    else:
        assert sum(found.values()) >= repeated
