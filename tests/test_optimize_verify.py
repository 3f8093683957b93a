"""Numeric equivalence: every small case, optimized in both state modes and several
strategies, computes what the original computes over 5 training steps (runtime.verify
on CPU devices; one shared 8-device worker for the whole module), each state shard fed
its own output."""

from __future__ import annotations

import pytest

from hlo_shard.analysis.replication import ParamOverrides
from hlo_shard import runtime
from hlo_shard import optimize
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.cli.verify import _text_report
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update import ShardingOptions

import test_pass_weight_update as cases
from wus_helpers import ADD

ADAM_LIKE = f"""HloModule adamish, replica_count=4, input_output_alias={{ {{0}}: (0, {{}}, may-alias), {{1}}: (1, {{}}, may-alias), {{2}}: (2, {{}}, may-alias) }}
{ADD}
ENTRY e {{ w = f32[7,5]{{0,1}} parameter(0) m = f32[7,5] parameter(1) v = f32[7,5] parameter(2)
 x = f32[3,7] parameter(3), parameter_replication={{false}}
 y = f32[3,5] dot(x, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
 g = f32[7,5]{{0,1}} dot(x, y), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
 ar = f32[7,5]{{0,1}} all-reduce(g), replica_groups={{{{0,1,2,3}}}}, to_apply=add
 b1 = f32[] constant(0.9) b1b = f32[7,5] broadcast(b1), dimensions={{}}
 c1 = f32[] constant(0.1) c1b = f32[7,5] broadcast(c1), dimensions={{}}
 m1 = f32[7,5] multiply(m, b1b) m2 = f32[7,5] multiply(ar, c1b) nm = f32[7,5] add(m1, m2)
 gg = f32[7,5] multiply(ar, ar) v1 = f32[7,5] multiply(v, b1b) v2 = f32[7,5] multiply(gg, c1b)
 nv = f32[7,5] add(v1, v2) r = f32[7,5] rsqrt(nv) u = f32[7,5] multiply(nm, r)
 lr = f32[] constant(0.01) lrb = f32[7,5] broadcast(lr), dimensions={{}} s = f32[7,5] multiply(u, lrb)
 nw = f32[7,5]{{0,1}} subtract(w, s)
 loss = f32[] constant(0)
 ROOT t = (f32[7,5]{{0,1}}, f32[7,5], f32[7,5], f32[]) tuple(nw, nm, nv, loss) }}
"""

CASES = {
    "sgd": cases.SGD,
    "padded": cases.SGD.replace("1024", "1023"),
    "layout": cases.LAYOUT,
    "layout_padded": cases.LAYOUT.replace("6,4", "5,3"),
    "layout_mixed": cases.LAYOUT.replace("w = f32[6,4]{0,1}", "w = f32[6,4]{1,0}"),
    "clip": cases.CLIP,
    "levels": cases.LEVELS,
    "pmap": cases.PMAP,
    "subgroups": cases.SGD.replace("{{0,1,2,3}}", "{{0,2},{1,3}}").replace("1024", "37"),
    "tuple": cases.TUPLE,
    "spmd": cases.SPMD,
    "loop": cases.LOOP,
    "adam_like": ADAM_LIKE,
    "fused": cases.FUSED,
    "reshaped": cases.RESHAPED,
    "loop_state": cases.LOOP_STATE,
    "wide_state": cases.WIDE_STATE,
    "read_apart": cases.READ_APART,
    "read_back": cases.READ_BACK,
    "momentum_unaliased": cases.MOMENTUM_UNALIASED,
}

MATRIX = [(name, state, strategy) for name in CASES for state in ("gathered", "sharded")
          for strategy in ("per-tensor", "combined")]


@pytest.fixture(scope="module", autouse=True)
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


def verify_optimized(text: str, **options) -> runtime.VerifyReport:
    module = parse(text)
    result = optimize(module, ShardingOptions(**options), force=True)
    report, optimized = result.report, result.text
    assert any(r.sharded for r in report.explanations)
    manifest = build_manifest(report, module)
    return runtime.verify(parse(text), parse(optimized),
                          runtime.VerifyOptions(steps=5, manifest=manifest))


#: What a case needs the caller to say: a pmap step's copies of the weights are equal.
CASE_OPTIONS = {"pmap": {"overrides": ParamOverrides(pmap_replicated=True)}}


@pytest.mark.parametrize("name, state, strategy", MATRIX)
def test_optimized_case_computes_the_same(name, state, strategy):
    result = verify_optimized(CASES[name], state=state, strategy=strategy,
                              **CASE_OPTIONS.get(name, {}))
    # (ok: each state shard is fed its own output too, the module loops on itself)
    assert result.ok, ([(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()],
                       result.unlooped)


def test_max_reduction_over_padded_shards_ignores_the_padding():
    text = f"""HloModule maxpad, replica_count=4
{ADD}
mx {{ x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] maximum(x, y) }}
ENTRY e {{ w = f32[10] parameter(0) g = f32[10] parameter(1)
 a = f32[10] all-reduce(g), replica_groups={{{{0,1,2,3}}}}, to_apply=add
 n = f32[10] negate(a) e = f32[10] exponential(n) ninf = f32[] constant(-inf)
 m = f32[] reduce(n, ninf), dimensions={{0}}, to_apply=mx
 mb = f32[10] broadcast(m), dimensions={{}} u = f32[10] subtract(e, mb)
 ROOT nw = f32[10] subtract(w, u) }}
"""
    # negate makes every real value < 0 on some steps: a zero in a padded lane would win
    assert verify_optimized(text).ok


@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_a_channel_without_global_ids_sums_over_replicas(state):
    """An all-reduce with a ``channel_id`` and no ``use_global_device_ids`` (an XLA test's
    form): XLA holds the flag as false, so its groups name replicas (each with every
    partition), and with one partition it is the cross-replica sum. Read as naming
    partitions, the pass kept it whole, "replica groups repeat a device or name one out
    of range", though XLA runs it; the reduce-scatter and all-gather the pass writes in
    its place keep that form and compute the same."""
    text = f"""HloModule chan, replica_count=4
{ADD}
ENTRY e {{ w = f32[64] parameter(0) x = f32[64] parameter(1) g = f32[64] multiply(w, x)
 a = f32[64] all-reduce(g), channel_id=1, replica_groups={{{{0,1,2,3}}}}, to_apply=add
 lr = f32[] constant(0.1) b = f32[64] broadcast(lr), dimensions={{}}
 u = f32[64] multiply(a, b) ROOT nw = f32[64] subtract(w, u) }}
"""
    from hlo_shard.analysis.collectives import GroupMode, group_mode

    module = parse(text)
    assert group_mode(module.entry["a"]) is GroupMode.CROSS_REPLICA_AND_PARTITION
    assert verify_optimized(text, state=state).ok


def test_unaliased_weights_and_state_kept_as_shards_loop_on_their_outputs():
    result = verify_optimized(cases.MOMENTUM_UNALIASED, state="sharded", params="sharded")
    assert result.ok, ([(leaf.index, leaf.verdict) for leaf in result.final()],
                       result.unlooped)
    assert result.steps_run == 5 and not result.resharded


def test_a_state_shard_fed_another_output_is_not_a_loop(monkeypatch):
    """The mutant of the pairing the verifier must kill: the moment paired with the new
    weight (what the pass did without input_output_alias). Its numbers agree, since the
    verifier re-shards what it feeds back, but the module does not run on its own
    outputs."""
    from hlo_shard.passes.weight_update import analysis

    monkeypatch.setattr(analysis, "_next_values_by_dependence", lambda *args: {1: 0})
    module = parse(cases.MOMENTUM_UNALIASED)
    result = optimize(module, ShardingOptions(state="sharded"), force=True)
    assert [o.kind for o in result.report.outputs][:2] == ["sharded", "replicated"]
    verified = runtime.verify(parse(cases.MOMENTUM_UNALIASED), parse(result.text),
                              runtime.VerifyOptions(steps=3, manifest=build_manifest(
                                  result.report, module)))
    assert not verified.differing and verified.unlooped == [(1, 1)]
    assert not verified.ok and verified.to_json()["match"] is False
    # The module names no next values: the verdict says its pairs were guessed in order.
    assert verified.feedback_guessed and verified.to_json()["feedback_guessed"]
    (verdict,) = [line for line in _text_report(verified, False) if "NOT A LOOP" in line]
    assert "those pairs are a guess" in verdict


def test_pairs_the_manifest_names_are_not_a_guess():
    module = parse(ADAM_LIKE)
    result = optimize(module, ShardingOptions(state="sharded"), force=True)
    manifest = build_manifest(result.report, module)
    assert manifest.feedback == ((0, 0), (1, 1), (2, 2))  # the input's input_output_alias
    verified = runtime.verify(parse(ADAM_LIKE), parse(result.text),
                              runtime.VerifyOptions(steps=2, manifest=manifest))
    assert verified.ok and not verified.feedback_guessed


def test_a_reduction_from_another_initial_value_is_not_split_over_shards():
    # XLA applies a reduction's initial value once per partial result of its choosing
    # (XLA:CPU: 9 times over these 256 elements): sums of shards from 5 would not add
    # up to it (an older code split it: DIFFERENT), and even the whole sum of the
    # gathered value may count it another number of times than the input's (a 64x64
    # one did: 5 times in jit's step, once after the rewrite), so the gradient it reads
    # stays as it is.
    text = f"""HloModule init5, replica_count=4
{ADD}
ENTRY e {{ w = f32[256] parameter(0) g = f32[256] parameter(1)
 a = f32[256] all-reduce(g), replica_groups={{{{0,1,2,3}}}}, to_apply=add
 ab = f32[256] abs(a) five = f32[] constant(5)
 s = f32[] reduce(ab, five), dimensions={{0}}, to_apply=add
 sb = f32[256] broadcast(s), dimensions={{}} u = f32[256] divide(a, sb)
 ROOT nw = f32[256] subtract(w, u) }}
"""
    result = optimize(parse(text), ShardingOptions(), force=True)
    assert [r.reason_code for r in result.report.explanations] == ["non_neutral_init"]
    entry = parse(result.text).entry
    assert entry[entry["ab"].operands[0]].opcode == "all-reduce"
