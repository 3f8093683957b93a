"""A model with a ``lax.cond``: the gradients its branches all-reduce move after the
conditional (``conditional-motion``), and the weight-update sharding then
reduce-scatters them there instead of leaving the whole step to fall back.

Structure on a small hand-written conditional (fast), numbers through real XLA on 8 CPU
devices (the original against the pass's output and the sharded module, and a mutant
the check must call DIFFER), and a real jax step with a ``lax.cond`` in its model.
"""

from __future__ import annotations


import pytest

import hlo_shard
from hlo_shard import runtime
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.graph import Rewriter
from hlo_shard.ir import Module
from hlo_shard.parser import parse
from hlo_shard.passes.conditional_motion import ConditionalMotion, ConditionalMotionReport
from hlo_shard.passes.pipeline import Pipeline, validate_printed
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.printer import to_text

from wus_helpers import ADD, MAX, find, optimize

GROUPS = "replica_groups={{0,1,2,3,4,5,6,7}}"

def _branch(name: str, activation: str, bias: str) -> str:
    """A branch of :data:`COND`: its activation of ``y``, the weight gradient all-reduced
    then transposed, and the bias gradient all-reduced, then ``bias`` (lines ending in
    the value it returns, ``arb`` when empty)."""
    tail = bias or " ROOT r = (f32[32,16], f32[16]) tuple(tw, arb) }"
    return f"""{name} {{ p = (f32[2,32], f32[32,16]) parameter(0)
 x = f32[2,32] get-tuple-element(p), index=0 w = f32[32,16] get-tuple-element(p), index=1
 y = f32[2,16] dot(x, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
 t = f32[2,16] {activation}
 gw = f32[16,32] dot(t, x), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
 arw = f32[16,32] all-reduce(gw), {GROUPS}, to_apply=add
 tw = f32[32,16] transpose(arw), dimensions={{1,0}}
 f0 = f32[] constant(0)
 gb = f32[16] reduce(t, f0), dimensions={{0}}, to_apply=add
 arb = f32[16] all-reduce(gb), {GROUPS}, to_apply=add
{tail}
"""


#: A data-parallel SGD step whose model picks one of two branches by the sign of a
#: weight's sum; each branch all-reduces the weight gradient (then transposes it) and
#: the bias gradient (branch a also sums a dimension of size 1 after it).
COND = f"""HloModule branches, replica_count=8
{ADD}
{MAX}
""" + _branch("br_a", "tanh(y)", """ rb = f32[1,16] reshape(arb)
 sb = f32[16] reduce(rb, f0), dimensions={0}, to_apply=add
 ROOT r = (f32[32,16], f32[16]) tuple(tw, sb) }""") + _branch("br_b", "multiply(y, y)", "") + """\
ENTRY e { w = f32[32,16] parameter(0) b = f32[16] parameter(1)
 x = f32[2,32] parameter(2), parameter_replication={false}
 f0 = f32[] constant(0)
 s = f32[] reduce(b, f0), dimensions={0}, to_apply=add
 pr = pred[] compare(s, f0), direction=GE
 args = (f32[2,32], f32[32,16]) tuple(x, w)
 c = (f32[32,16], f32[16]) conditional(pr, args, args), true_computation=br_a, false_computation=br_b
 gw = f32[32,16] get-tuple-element(c), index=0 gb = f32[16] get-tuple-element(c), index=1
 lr = f32[] constant(0.01) lrw = f32[32,16] broadcast(lr), dimensions={}
 lrb = f32[16] broadcast(lr), dimensions={}
 uw = f32[32,16] multiply(gw, lrw) nw = f32[32,16] subtract(w, uw)
 ub = f32[16] multiply(gb, lrb) nb = f32[16] subtract(b, ub)
 ROOT out = (f32[32,16], f32[16]) tuple(nw, nb) }
"""


def _combined_branch(name: str, activation: str) -> str:
    """A branch as XLA's combiner leaves it (what ``install()``'s hook sees): one tuple
    all-reduce of both gradients, taken apart, the weight's transposed into the layout
    the conditional returns (a bitcast once XLA assigned layouts)."""
    return f"""{name} {{ p = (f32[2,32], f32[32,16]) parameter(0)
 x = f32[2,32] get-tuple-element(p), index=0 w = f32[32,16] get-tuple-element(p), index=1
 y = f32[2,16] dot(x, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
 t = f32[2,16] {activation}
 gw = f32[16,32] dot(t, x), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
 f0 = f32[] constant(0)
 gb = f32[16] reduce(t, f0), dimensions={{0}}, to_apply=add
 ar = (f32[16,32], f32[16]) all-reduce(gw, gb), {GROUPS}, to_apply=add
 arw = f32[16,32] get-tuple-element(ar), index=0
 tw = f32[32,16]{{0,1}} transpose(arw), dimensions={{1,0}}
 arb = f32[16] get-tuple-element(ar), index=1
 ROOT r = (f32[32,16]{{0,1}}, f32[16]) tuple(tw, arb) }}
"""


#: :data:`COND` with each branch's sums combined into one tuple all-reduce.
COMBINED = COND.split("br_a {")[0] + _combined_branch("br_a", "tanh(y)") + \
    _combined_branch("br_b", "multiply(y, y)") + "ENTRY e {" + COND.split("ENTRY e {")[1] \
    .replace("c = (f32[32,16], f32[16]) conditional", "c = (f32[32,16]{0,1}, f32[16]) conditional") \
    .replace("gw = f32[32,16] get-tuple-element(c)", "gw = f32[32,16]{0,1} get-tuple-element(c)")


def motion(text: str) -> tuple[Module, ConditionalMotionReport]:
    module = parse(text)
    result = Pipeline((ConditionalMotion(),), check=validate_printed).run(module)
    return module, result.report(ConditionalMotionReport)


def branch_sums(module: Module) -> list[str]:
    return [f"{branch}/{i.name}" for branch in ("br_a", "br_b")
            for i in module.computation(branch).instructions if i.opcode == "all-reduce"]


# ------------------------------------------------------------------- structure (fast)


def test_the_branches_sums_move_after_the_conditional():
    module, report = motion(COND)
    assert branch_sums(module) == []
    after = find(module, "all-reduce")
    assert [module.entry[a.operands[0]].int_attr("index") for a in after] == [0, 1]
    assert [(m.element, m.all_reduces) for m in report.moved] == [
        (0, ("arw", "arw")), (1, ("arb", "arb"))] and not report.kept
    # the update reads the sums, not the conditional's local values
    read = [module.entry[operand] for update in ("uw", "ub")
            for operand in module.entry[update].operands]
    assert {inst.opcode for inst in read if inst.opcode != "broadcast"} == {"all-reduce"}
    # each branch relabels its device's part as it relabelled the sum
    assert module.computation("br_a")["tw"].operands == ["gw"]
    assert module.computation("br_a")["rb"].operands == ["gb"]
    assert "moved after it from every branch" in report.notes[0]


def test_the_sharding_pipeline_reduce_scatters_after_the_conditional():
    """The optimizer's pipeline (this pass first): no collective left in the branches, a
    reduce-scatter after the conditional and a sharded update, where without the move
    the sums inside the branches left nothing to shard."""
    module, report = optimize(COND)
    assert branch_sums(module) == []
    assert sum(r.sharded for r in report.explanations) == 2
    assert find(module, "reduce-scatter") and not find(module, "all-reduce")
    assert any("moved after it from every branch" in note for note in report.notes)


@pytest.mark.parametrize("edit, reason", [
    # branch b returns its local bias gradient: the branches disagree on the sum
    (("ROOT r = (f32[32,16], f32[16]) tuple(tw, arb) }", "ROOT r = (f32[32,16], f32[16]) "
      "tuple(tw, gb) }"), "not-in-every-branch"),
    # a scaled sum: moved, the scaling would round the sum differently
    (("ROOT r = (f32[32,16], f32[16]) tuple(tw, arb) }",
      "h = f32[] constant(0.5) hb = f32[16] broadcast(h), dimensions={} "
      "sc = f32[16] multiply(arb, hb) ROOT r = (f32[32,16], f32[16]) tuple(tw, sc) }"),
     "not-in-every-branch"),
    # the sum is also read inside the branch
    (("ROOT r = (f32[32,16], f32[16]) tuple(tw, arb) }",
      "n = f32[16] negate(arb) ROOT r = (f32[32,16], f32[16]) tuple(tw, n) }"),
     "not-in-every-branch"),
    # another reduction
    (("arb = f32[16] all-reduce(gb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add\n"
      " ROOT r = (f32[32,16], f32[16]) tuple(tw, arb) }",
      "arb = f32[16] all-reduce(gb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=mx\n"
      " ROOT r = (f32[32,16], f32[16]) tuple(tw, arb) }"), "not-summing"),
    # other groups in one branch
    (("arb = f32[16] all-reduce(gb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add\n"
      " ROOT r = (f32[32,16], f32[16]) tuple(tw, arb) }",
      "arb = f32[16] all-reduce(gb), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=add\n"
      " ROOT r = (f32[32,16], f32[16]) tuple(tw, arb) }"), "unlike"),
    # the same groups read as partition ids in one branch
    (("arb = f32[16] all-reduce(gb), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add\n"
      " ROOT r = (f32[32,16], f32[16]) tuple(tw, arb) }",
      "arb = f32[16] all-reduce(gb), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, "
      "to_apply=add\n ROOT r = (f32[32,16], f32[16]) tuple(tw, arb) }"), "unlike"),
])
def test_what_cannot_be_proven_stays(edit, reason):
    text = COND.replace(*edit)
    assert edit[1] in text
    module, report = motion(text)
    assert [(k.element, k.reason) for k in report.kept] == [(1, reason)]
    assert [m.element for m in report.moved] == [0]  # the weight gradient still moves
    assert "br_a/arb" in branch_sums(module)
    assert any("element 1 stays all-reduced in its branches" in n for n in report.notes)


def test_branches_that_relabel_a_sum_differently_keep_it():
    """Branch a transposes its weight gradient's sum into the result, branch b computes
    it in the result's order and copies it: the same value, but a device's part would
    be relabelled per branch, so where devices took different branches one sum after
    the conditional would add parts in different orders. The element stays."""
    first, second = COND.split("br_b {")
    second = second.replace(
        " gw = f32[16,32] dot(t, x), lhs_contracting_dims={0}, rhs_contracting_dims={0}\n"
        f" arw = f32[16,32] all-reduce(gw), {GROUPS}, to_apply=add\n"
        " tw = f32[32,16] transpose(arw), dimensions={1,0}",
        " gw = f32[32,16] dot(x, t), lhs_contracting_dims={0}, rhs_contracting_dims={0}\n"
        f" arw = f32[32,16] all-reduce(gw), {GROUPS}, to_apply=add\n"
        " tw = f32[32,16] copy(arw)", 1)
    assert "tw = f32[32,16] copy(arw)" in second
    module, report = motion(first + "br_b {" + second)
    assert [(k.element, k.reason) for k in report.kept] == [(0, "unlike")]
    assert [m.element for m in report.moved] == [1]  # reshaped and summed over a size-1
    assert {"br_a/arw", "br_b/arw"} <= set(branch_sums(module))  # dim, or not: alike


@pytest.mark.parametrize("edit, reason", [
    (("false_computation=br_b", "false_computation=br_a"), "shared-branch"),
    (("ROOT out = (f32[32,16], f32[16]) tuple(nw, nb)",
      "ROOT out = ((f32[32,16], f32[16]), f32[32,16]) tuple(c, nw)"), "result-whole"),
])
def test_a_conditional_that_cannot_be_rewired_is_left_alone(edit, reason):
    text = COND.replace(*edit)
    module, report = motion(text)
    assert to_text(module) == to_text(parse(text))
    assert {(k.element, k.reason) for k in report.kept} == {(0, reason), (1, reason)}


def test_a_moved_sum_gets_a_fresh_channel_id():
    text = COND.replace("replica_count=8", "replica_count=1, num_partitions=8").replace(
        f"{GROUPS}, to_apply=add", f"channel_id=7, {GROUPS}, use_global_device_ids=true, "
        "to_apply=add")
    module, _ = motion(text)
    ids = [i.int_attr("channel_id") for c in module.computations for i in c.instructions
           if i.opcode == "all-reduce"]
    assert sorted(ids) == [8, 9]
    assert all(i.attr("use_global_device_ids") is True for i in find(module, "all-reduce"))


def test_a_combined_all_reduce_moves_whole():
    module, report = motion(COMBINED)
    assert branch_sums(module) == []
    assert [(m.element, m.all_reduces) for m in report.moved] == [(0, ("ar", "ar")),
                                                                   (1, ("ar", "ar"))]
    assert module.computation("br_a")["tw"].operands == ["gw"]


def test_a_combined_all_reduce_with_an_element_that_stays_stays_whole():
    """Branch b also reads its bias gradient's sum: that element cannot move, and the
    tuple all-reduce it shares with the weight gradient stays whole with it."""
    text = COMBINED.replace(" arb = f32[16] get-tuple-element(ar), index=1\n ROOT r = (f32[32,16]{0,1}, "
                        "f32[16]) tuple(tw, arb) }\nENTRY",
                        " arb = f32[16] get-tuple-element(ar), index=1\n n = f32[16] negate(arb)\n "
                        "ROOT r = (f32[32,16]{0,1}, f32[16]) tuple(tw, n) }\nENTRY")
    assert "negate(arb)" in text
    module, report = motion(text)
    assert not report.moved
    assert sorted((k.element, k.reason) for k in report.kept) == [
        (0, "partly-moved"), (1, "not-in-every-branch")]
    assert to_text(module) == to_text(parse(text))


# ---------------------------------------------------------- numbers through real XLA


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


@pytest.mark.parametrize("sign", ["GE", "LT"], ids=["branch_a", "branch_b"])
def test_the_moved_conditional_computes_the_same(worker, sign):
    text = COND.replace("direction=GE", f"direction={sign}")
    module, report = motion(text)
    assert len(report.moved) == 2
    result = runtime.verify(parse(text), parse(to_text(module)), runtime.VerifyOptions(steps=3))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


def test_the_moved_combined_all_reduce_computes_the_same(worker):
    module, report = motion(COMBINED)
    assert len(report.moved) == 2
    result = runtime.verify(parse(COMBINED), parse(to_text(module)),
                            runtime.VerifyOptions(steps=3))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


def test_a_sum_left_out_is_caught(worker):
    """A mutant: the update reads the conditional's local weight gradient (the moved sum
    dropped): it must DIFFER."""
    module, _ = motion(COND)
    total = next(a for a in find(module, "all-reduce")
                 if module.entry[a.operands[0]].int_attr("index") == 0)
    Rewriter(module.entry).replace_all_uses_with(total.name, total.operands[0])
    result = runtime.verify(parse(COND), parse(to_text(module)), runtime.VerifyOptions(steps=1))
    assert not result.ok


def test_the_sharded_conditional_step_computes_the_same(worker):
    module = parse(COND)
    result = hlo_shard.optimize(module, ShardingOptions(state="sharded"), force=True)
    report, text = result.report, result.text
    assert sum(r.sharded for r in report.explanations) == 2 and "reduce-scatter" in text
    verified = runtime.verify(parse(COND), parse(text), runtime.VerifyOptions(
        steps=3, manifest=build_manifest(report, module)))
    assert verified.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in verified.final()]


# ------------------------------------------------------------------- a real jax step


def _lax_cond_program():
    """An MLP whose activation is chosen by ``lax.cond`` on a weight's sum, each branch
    the whole forward pass (the backward pass is a conditional whose branches all-reduce
    every gradient): the jitted step, a fresh initial state, the i-th batch."""
    from jax_train_helpers import jax, jnp, optax

    def forward(p, x, activation):
        for i in range(3):
            x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            x = activation(x) if i < 2 else x
        return x

    def loss(p, batch):
        prediction = jax.lax.cond(p["l0"]["b"].sum() >= 0,
                                  lambda: forward(p, batch["x"], jax.nn.gelu),
                                  lambda: forward(p, batch["x"], jnp.tanh))
        return jnp.mean((prediction - batch["y"]) ** 2)

    return _mlp_program(optax.adam(1e-2), loss)


def _mlp_program(opt, loss):
    """The step of ``opt`` on ``loss`` of the helpers' MLP, data-parallel over the
    devices: the step, a fresh initial state, the i-th batch."""
    from jax_train_helpers import (AXIS, DEVICES, NamedSharding, P, jax, jnp, mlp_batch,
                                   mlp_params, np, optax)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:DEVICES]), (AXIS,))

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = mlp_params(jax.random.PRNGKey(0))

    def init():
        fresh = jax.tree.map(jnp.copy, params)
        return jax.device_put((fresh, opt.init(fresh)), NamedSharding(mesh, P()))

    def batch(i):
        return jax.device_put(mlp_batch(jax.random.PRNGKey(1000 + i), 2 * DEVICES),
                              NamedSharding(mesh, P(AXIS)))

    return step, init, batch


def test_a_jax_model_with_lax_cond_runs_sharded(request):
    """Forced, both modes run the ``lax.cond`` MLP sharded with jit's numbers; before
    this pass the step fell back ("inside a called computation")."""
    from jax_train_helpers import assert_close, jax, needs_devices, run_forced, run_steps

    if not needs_devices(request):
        return
    step, init, batch = _lax_cond_program()
    jitted = jax.jit(step, donate_argnums=(0, 1))
    expected = run_steps(jitted, init(), batch)
    for state in ("gathered", "sharded"):
        fast, final, losses = run_forced(jitted, state, init, batch)
        assert fast.report["sharded"] >= 3, fast.report
        assert_close((final, losses), expected)


@pytest.mark.slow
def test_install_shards_a_jax_model_with_lax_cond(request):
    """``install()``'s hook sees the branches' sums combined into one tuple all-reduce:
    forced, it moves them and shards the step, jit's numbers. (Slow: XLA calls the hook
    from a compile thread, which stays registered with Python's threading afterwards, so
    the default suite keeps it out of the process its thread checks run in.)"""
    from jax_train_helpers import assert_close, jax, needs_devices, run_steps
    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    step, init, batch = _lax_cond_program()
    expected = run_steps(jax.jit(step, donate_argnums=(0, 1)), init(), batch)
    hsj.decisions(clear=True)
    with hsj.install(force=True):
        hooked = run_steps(jax.jit(step, donate_argnums=(0, 1)), init(), batch)
    assert [d.changed for d in hsj.decisions(clear=True) if "step" in d.module] == [True]
    assert_close(hooked, expected)


@pytest.mark.slow
def test_install_names_the_conditional_an_update_in_a_lax_cond_reads_its_gradients_by(request):
    """``optax.novograd`` runs its update in a ``lax.cond`` (the first step or a later
    one): in XLA's fused module the hook sees, the vector gradients go straight into the
    conditional's operand tuple, and the pass keeps them whole (``no_update_work``). The
    reason named no user ("all users need the full gradient"); it names the tuple and
    the conditional reading it now, and says the update runs in the conditional's
    branches (it said "no update work downstream"). Numbers jit's."""
    from jax_train_helpers import assert_close, jax, mlp_loss, needs_devices, optax, run_steps
    import hlo_shard.jax as hsj
    from hlo_shard.analysis.collectives import ReasonCode

    if not needs_devices(request):
        return
    step, init, batch = _mlp_program(optax.novograd(1e-3), mlp_loss)
    expected = run_steps(jax.jit(step, donate_argnums=(0, 1)), init(), batch)
    hsj.decisions(clear=True)
    with hsj.install(force=True):
        hooked = run_steps(jax.jit(step, donate_argnums=(0, 1)), init(), batch)
    decision, = [d for d in hsj.decisions(clear=True) if "step" in d.module]
    idle = [e for e in decision.report.explanations
            if e.reason_code == ReasonCode.NO_UPDATE_WORK]
    assert idle, [(e.reason_code, e.reason) for e in decision.report.explanations]
    for row in idle:
        assert "(conditional)" in row.reason, row.reason
        assert row.reason.startswith("its update runs in a conditional's branches"), row.reason
    assert_close(hooked, expected)


def test_a_sum_left_in_a_branch_names_the_conditional_that_calls_it():
    """It said "inside a called computation (fusion/call/conditional): not supported"."""
    text = COND.replace("false_computation=br_b", "false_computation=br_a")
    _, report = optimize(text)
    reasons = {row.reason for row in report.explanations if row.computation == "br_a"}
    assert reasons == {"inside a computation %c (conditional) calls, which the pass does not "
                       "shard into (only the entry and the bodies of its while loops)"}
