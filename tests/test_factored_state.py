"""Adafactor's factored statistics on shards (issue #12): with the gradient sharded in
blocks of whole rows (or columns), the statistic along the other dimension is reduced
from each device's block alone and stays a shard (``--state sharded`` keeps it as
state, 1/N of its memory); the one along the block dimension is summed from partial sums
by a small all-reduce and stays whole, with a note saying why. Every case runs original
and result on real XLA over several steps (the sharded statistic fed back), and mutants
of the rewrite must be caught."""

from __future__ import annotations

import re

import pytest

from hlo_shard import runtime
import hlo_shard
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update import ShardingOptions

from wus_helpers import ADD, find, optimize

#: optax.adafactor's factored update for a 2-D weight, by hand: v_row = mean over
#: columns, v_col = mean over rows of g² + ε, the row factor normalised by its mean,
#: the update g · rsqrt(v_row[r] / mean(v_row) · v_col[c]).
ADAFACTOR = f"""HloModule adafactor, replica_count=4, input_output_alias={{ {{0}}: (0, {{}}, may-alias), {{1}}: (1, {{}}, may-alias), {{2}}: (2, {{}}, may-alias) }}
{ADD}
ENTRY e {{ w = f32[8,16]{{1,0}} parameter(0) vr = f32[8] parameter(1) vc = f32[16] parameter(2)
 g = f32[8,16]{{1,0}} parameter(3), parameter_replication={{false}}
 ar = f32[8,16]{{1,0}} all-reduce(g), replica_groups={{{{0,1,2,3}}}}, to_apply=add
 eps = f32[] constant(1e-30) epsb = f32[8,16] broadcast(eps), dimensions={{}}
 gg = f32[8,16] multiply(ar, ar) ge = f32[8,16] add(gg, epsb) z = f32[] constant(0)
 rs = f32[8] reduce(ge, z), dimensions={{1}}, to_apply=add
 cs = f32[16] reduce(ge, z), dimensions={{0}}, to_apply=add
 b = f32[] constant(0.8) b8 = f32[8] broadcast(b), dimensions={{}} b16 = f32[16] broadcast(b), dimensions={{}}
 k = f32[] constant(0.0125) k8 = f32[8] broadcast(k), dimensions={{}}
 k2 = f32[] constant(0.025) k16 = f32[16] broadcast(k2), dimensions={{}}
 r1 = f32[8] multiply(vr, b8) r2 = f32[8] multiply(rs, k8) nr = f32[8] add(r1, r2)
 c1 = f32[16] multiply(vc, b16) c2 = f32[16] multiply(cs, k16) nc = f32[16] add(c1, c2)
 rm = f32[] reduce(nr, z), dimensions={{0}}, to_apply=add
 rmb = f32[8] broadcast(rm), dimensions={{}} rn = f32[8] divide(nr, rmb)
 rb = f32[8,16] broadcast(rn), dimensions={{0}} cb = f32[8,16] broadcast(nc), dimensions={{1}}
 den = f32[8,16] multiply(rb, cb) inv = f32[8,16] rsqrt(den) u = f32[8,16] multiply(ar, inv)
 lr = f32[] constant(0.01) lrb = f32[8,16] broadcast(lr), dimensions={{}}
 s = f32[8,16] multiply(u, lrb) nw = f32[8,16]{{1,0}} subtract(w, s)
 ROOT t = (f32[8,16]{{1,0}}, f32[8], f32[16]) tuple(nw, nr, nc) }}
"""
#: The gradient stored column-major: its shards are blocks of columns, so v_col is the
#: sharded statistic and v_row the summed one.
COLUMNS = ADAFACTOR.replace("f32[8,16]{1,0}", "f32[8,16]{0,1}")
#: 6 rows over 4 devices: a shard of 24 elements is no block of whole rows.
PADDED = ADAFACTOR.replace("8,16", "6,16").replace("f32[8]", "f32[6]")

CASES = {"rows": ADAFACTOR, "columns": COLUMNS, "padded": PADDED}


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 4)
    runtime.shutdown_workers()


def sharded_state(report) -> set[int]:
    return {p.index for p in report.parameters if p.kind == "sharded"}


def note_of(report, number: int) -> str:
    (note,) = [n for n in report.notes if f"parameter {number} " in n]
    return note


def test_row_statistic_is_sharded_state_column_statistic_summed_whole():
    module, report = optimize(ADAFACTOR, state="sharded")
    assert sharded_state(report) == {0, 1}  # the weight and v_row
    entry = module.entry
    assert entry["vr"].array_shape.dims == (2,)  # 8 rows / 4 devices
    assert "the dimension whose blocks the devices hold" in note_of(report, 2)
    # v_col from partial sums, in one all-reduce with v_row's mean (the same level):
    # the squared gradient is never gathered (the weight is sharded state too).
    assert not find(module, "all-gather")
    (combined,) = find(module, "all-reduce")
    assert combined.array_shape.dims == (16 + 1,)


def test_column_major_gradient_shards_the_column_statistic():
    module, report = optimize(COLUMNS, state="sharded")
    assert sharded_state(report) == {0, 2}  # the weight and v_col
    assert module.entry["vc"].array_shape.dims == (4,)
    assert "dimension 1" in note_of(report, 1)


def test_padded_shards_keep_both_statistics_whole_and_say_why():
    _, report = optimize(PADDED, state="sharded")
    for number in (1, 2):
        assert "not blocks along one dimension (96 elements" in note_of(report, number)


def verify(text: str, optimized: str, manifest, steps: int = 4) -> runtime.VerifyReport:
    return runtime.verify(parse(text), parse(optimized),
                          runtime.VerifyOptions(steps=steps, manifest=manifest))


def optimized_text(text: str, state: str):
    module = parse(text)
    result = hlo_shard.optimize(module, ShardingOptions(state=state), force=True)
    report, optimized = result.report, result.text
    return optimized, build_manifest(report, module)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("state", ["sharded", "gathered"])
def test_factored_update_computes_the_same_over_steps(worker, name, state):
    optimized, manifest = optimized_text(CASES[name], state)
    result = verify(CASES[name], optimized, manifest)
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


def test_mutants_of_the_factored_rewrite_are_caught(worker):
    """The row statistic's block reduced into the wrong rows (reversed), and the column
    statistic's partial sums left unsummed: both must fail verification."""
    optimized, manifest = optimized_text(ADAFACTOR, "sharded")
    mutants = [
        re.sub(r"(\n\s*)%(rs\.block\S*) = f32\[2\]\{0\} (reduce\([^\n]*)",
               r"\1%\2.fwd = f32[2]{0} \3\1%\2 = f32[2]{0} reverse(%\2.fwd), dimensions={0}",
               optimized, count=1),
        re.sub(r"(%small_sums\.sum\S* = f32\[17\]\{0\}) all-reduce\((%[^)]*)\)[^\n]*",
               r"\1 copy(\2)", optimized, count=1),
    ]
    for mutant in mutants:
        assert mutant != optimized
        assert not verify(ADAFACTOR, mutant, manifest, steps=2).ok
