"""``--state sharded`` where no optimizer state can stay a shard says why in a note (it
said "0 parameters sharded" and nothing else): the sharded update ends before the
optimizer reads its state, or the gradients are sharded only inside a loop's body."""

from __future__ import annotations

from pathlib import Path

from wus_helpers import ADD, optimize

GOLDEN = Path(__file__).parent / "golden_pass"

#: The weight's update is elementwise (sharded); the state's next value reads the
#: gradient through a dot (the region ends there), so the update reads no state.
STATE_AFTER_A_DOT = f"""HloModule m, replica_count=2, input_output_alias={{ {{0}}: (0, {{}}, may-alias), {{1}}: (1, {{}}, may-alias) }}
{ADD}
ENTRY e {{
  w = f32[8] parameter(0)
  m = f32[8] parameter(1)
  x = f32[8] parameter(2), parameter_replication={{false}}
  gx = f32[8] multiply(w, x)
  ar = f32[8] all-reduce(gx), replica_groups={{{{0,1}}}}, to_apply=add
  lr = f32[] constant(0.1)
  lrb = f32[8] broadcast(lr), dimensions={{}}
  step = f32[8] multiply(ar, lrb)
  nw = f32[8] subtract(w, step)
  sq = f32[] dot(ar, ar), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
  sqb = f32[8] broadcast(sq), dimensions={{}}
  nm = f32[8] add(m, sqb)
  ROOT t = (f32[8], f32[8]) tuple(nw, nm)
}}
"""


def test_an_update_that_reads_no_state_says_so():
    _, report = optimize(STATE_AFTER_A_DOT, state="sharded")
    assert [row.sharded for row in report.explanations] == [True]
    assert not any(p.kind == "sharded" for p in report.parameters)
    (note,) = [n for n in report.notes if "no optimizer state" in n]
    assert note.startswith("e: no optimizer state stays sharded: the sharded update reads "
                           "no state parameter"), note
    # ... and where it ends (it said "each gradient's row says where", and no row does)
    assert "on its state, at %sq (dot), which reads its values whole)" in note, note


def test_gradients_sharded_only_in_a_loop_body_say_so():
    _, report = optimize((GOLDEN / "while_loop_body.hlo").read_text(), state="sharded")
    assert [row.computation for row in report.explanations if row.sharded] == ["body"]
    (note,) = [n for n in report.notes if "no optimizer state" in n]
    assert "sharded only inside loop bodies (body)" in note, note


def test_state_kept_as_shards_needs_no_such_note():
    text = STATE_AFTER_A_DOT.replace(
        "  sq = f32[] dot(ar, ar), lhs_contracting_dims={0}, rhs_contracting_dims={0}\n"
        "  sqb = f32[8] broadcast(sq), dimensions={}\n"
        "  nm = f32[8] add(m, sqb)\n", "  nm = f32[8] add(m, ar)\n")
    _, report = optimize(text, state="sharded")
    assert any(p.kind == "sharded" for p in report.parameters)
    assert not [n for n in report.notes if "no optimizer state" in n]


#: A position table longer than the sequence (``pos[:T]``): jit's bias-style gradient
#: reshape (a reduction over a dimension of size one), scaled, then padded to the
#: table's rows, where the sharded update stops; the state's next value reads the pad.
STATE_AFTER_A_PAD = f"""HloModule m, replica_count=2, input_output_alias={{ {{0}}: (0, {{}}, may-alias), {{1}}: (1, {{}}, may-alias) }}
{ADD}
ENTRY e {{
  w = f32[9] parameter(0)
  m = f32[9] parameter(1)
  x = f32[1,8] parameter(2), parameter_replication={{false}}
  ar = f32[1,8] all-reduce(x), replica_groups={{{{0,1}}}}, to_apply=add
  zero = f32[] constant(0)
  g = f32[8] reduce(ar, zero), dimensions={{0}}, to_apply=add
  lr = f32[] constant(0.1)
  lrb = f32[8] broadcast(lr), dimensions={{}}
  step = f32[8] multiply(g, lrb)
  padded = f32[9] pad(step, zero), padding=0_1
  nm = f32[9] add(m, padded)
  nw = f32[9] subtract(w, nm)
  ROOT t = (f32[9], f32[9]) tuple(nw, nm)
}}
"""


def test_a_reduction_over_a_size_one_dimension_is_no_factored_statistic():
    """The state stays whole because its next value is computed after the update's
    region ends (at the pad), not because of a "factored statistic": the reduction
    over one row is the gradient's reshape."""
    _, report = optimize(STATE_AFTER_A_PAD, state="sharded")
    assert [row.sharded for row in report.explanations] == [True]
    (note,) = [n for n in report.notes if "optimizer state parameter 1" in n]
    assert "factored statistic" not in note
    assert "computed after the sharded update ends, at %padded (pad)" in note, note


def test_sharded_params_that_the_update_never_reads_say_so():
    """``params="sharded"`` where the sharded update ends before the weights' update
    (a probe's L-BFGS: its direction is a product of the gradients): no weight row, and
    it said nothing."""
    text = STATE_AFTER_A_DOT.replace(
        "  step = f32[8] multiply(ar, lrb)\n  nw = f32[8] subtract(w, step)\n",
        "  step = f32[8] multiply(ar, lrb)\n  nm0 = f32[8] add(m, step)\n").replace(
        "  nm = f32[8] add(m, sqb)\n", "  nm = f32[8] add(nm0, ar)\n  nw = f32[8] subtract(w, sqb)\n")
    _, report = optimize(text, state="sharded", params="sharded")
    assert [row.sharded for row in report.explanations] == [True] and not report.weights
    (note,) = [n for n in report.notes if "no weight" in n]
    assert note.startswith("e: no weight stays sharded: the sharded update reads no weight "
                           "(it ends before the weights' update, at %sq (dot)"), note
