"""Batch statistics (BatchNorm's mean and variance over the data axis, and their sums in
the backward pass) are all-reduces too, but the forward and backward pass are computed
from them: they stay all-reduced (code ``feeds_gradients``) and the update region ends
there. Sharded, the mean's reduce-scatter shared a bucket with the gradients computed
from its all-gather: a dependency cycle the rewrite raised into the loop. A rewrite that
still makes one is undone and its region refused (code ``region_cycle``), never raised.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hlo_shard import runtime
from hlo_shard.passes.weight_update import analysis
from hlo_shard import optimize
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update import ShardingOptions

BATCHNORM = (Path(__file__).parent / "golden_pass" / "batch_statistic_kept_whole.hlo"
             ).read_text()
STRATEGIES = ("per-tensor", "combined", "auto")


def rows(text: str, **options):
    module = parse(text)
    result = optimize(module, ShardingOptions(**options), force=True)
    report, optimized = result.report, result.text
    return {row.all_reduce: row for row in report.explanations}, report, optimized


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("state", ("gathered", "sharded"))
def test_the_batch_mean_stays_whole_and_the_gradient_is_sharded(state, strategy):
    by_name, _, optimized = rows(BATCHNORM, state=state, strategy=strategy)
    assert not by_name["stat"].sharded and by_name["stat"].reason_code == "feeds_gradients"
    assert "%ar is computed from it" in by_name["stat"].reason
    assert by_name["ar"].sharded and by_name["ar"].reason_code == ""
    assert "reduce-scatter" in optimized


@pytest.mark.parametrize("state", ("gathered", "sharded"))
def test_a_rewrite_that_makes_a_cycle_is_refused_not_raised(monkeypatch, state):
    """With the statistics let through and every sum in one level (the planning and the
    buckets before these fixes), the combined reduce-scatter waits on its own
    all-gather: the region is left as it was, every gradient of it explained, the
    signature unchanged."""
    from hlo_shard.passes.weight_update import lowering

    monkeypatch.setattr(analysis._Planner, "statistics", lambda self: {})
    monkeypatch.setattr(lowering, "summing_levels",
                        lambda comp, leaves: {leaf.label: 0 for leaf in leaves})
    by_name, report, optimized = rows(BATCHNORM, state=state, strategy="combined")
    for name in ("stat", "ar"):
        assert not by_name[name].sharded and by_name[name].reason_code == "region_cycle", name
        assert "dependency cycle" in by_name[name].reason
    assert "reduce-scatter" not in optimized and "all-gather" not in optimized
    assert all(p.kind != "sharded" for p in report.parameters + report.outputs)
    assert not report.strategies
    assert parse(optimized).entry.root.operands == parse(BATCHNORM).entry.root.operands


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


@pytest.mark.parametrize("state", ("gathered", "sharded"))
def test_the_optimized_batchnorm_step_computes_the_same(worker, state):
    _, report, optimized = rows(BATCHNORM, state=state, strategy="combined")
    result = runtime.verify(parse(BATCHNORM), parse(optimized), runtime.VerifyOptions(
        steps=3, manifest=build_manifest(report, parse(BATCHNORM))))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]



def test_a_batch_statistic_is_no_weights_gradient_in_the_report():
    """A statistic whose reach pairs it with a weight (haiku's BatchNorm after a biased
    Linear: the mean and variance sums were reported as the bias's gradient, twice) is
    a value of the forward pass: its row names no weight; the gradient's row does."""
    from dataclasses import replace

    from hlo_shard.analysis.names import user_names

    module = parse(BATCHNORM)
    names = user_names(module, override={0: "params['w']", 1: "params['b']",
                                         2: "batch['x']"})
    entry = module.entry.name
    assert names.gradients == {(entry, "ar", None): 0}
    paired = replace(names, gradients={**names.gradients, (entry, "stat", None): 1})
    result = optimize(parse(BATCHNORM), ShardingOptions(), force=True)
    explained = {row["all_reduce"]: row for row in result.to_json(paired)["explanations"]}
    assert explained["stat"]["reason_code"] == "feeds_gradients"
    assert explained["stat"]["gradient_of"] is None
    assert explained["ar"]["gradient_of"] == "params['w']"


#: A GAN's step: the discriminator %d updated first, then the generator's loss computed
#: through the updated %nd (DCGAN's order, flax PPO's loop over minibatches): %ard feeds
#: %arg's per-device value through a weight's next value, not through the forward pass.
SEQUENTIAL = """HloModule gan, replica_count=8, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT r = f32[] add(a, b)
}
ENTRY e {
  g = f32[16,16] parameter(0)
  d = f32[16,16] parameter(1)
  x = f32[4,16] parameter(2), parameter_replication={false}
  h = f32[4,16] dot(x, g), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  t = f32[4,16] tanh(h)
  gd = f32[16,16] dot(t, t), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ard = f32[16,16] all-reduce(gd), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add
  lr = f32[] constant(0.1)
  lrs = f32[16,16] broadcast(lr), dimensions={}
  ud = f32[16,16] multiply(ard, lrs)
  nd = f32[16,16] subtract(d, ud)
  y = f32[4,16] dot(t, nd), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  s = f32[4,16] tanh(y)
  gg = f32[16,16] dot(x, s), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  arg = f32[16,16] all-reduce(gg), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add
  ug = f32[16,16] multiply(arg, lrs)
  ng = f32[16,16] subtract(g, ug)
  ROOT out = (f32[16,16], f32[16,16]) tuple(ng, nd)
}
"""


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_gradient_whose_updated_weight_is_read_again_is_sharded(strategy):
    """It was kept whole as a batch statistic ("a value of the forward/backward pass");
    each level of sums gets its own reduce-scatter (one bucket would wait on its own
    all-gather), even where the strategy combines them."""
    by_name, _, optimized = rows(SEQUENTIAL, strategy=strategy)
    assert by_name["ard"].sharded and by_name["arg"].sharded, \
        [(r.all_reduce, r.reason) for r in by_name.values()]
    assert optimized.count(" reduce-scatter(") == 2
    # without the alias saying %nd is %d's next value, it stays what it was
    unaliased = SEQUENTIAL.replace(
        ", input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }", "")
    assert rows(unaliased, strategy=strategy)[0]["ard"].reason_code == "feeds_gradients"


@pytest.mark.parametrize("state", ("gathered", "sharded"))
def test_the_sequential_updates_compute_the_same(worker, state):
    _, report, optimized = rows(SEQUENTIAL, state=state, strategy="combined")
    assert sum(r.sharded for r in report.explanations) == 2
    result = runtime.verify(parse(SEQUENTIAL), parse(optimized), runtime.VerifyOptions(
        steps=3, manifest=build_manifest(report, parse(SEQUENTIAL))))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


def _sequential_program():
    """Two MLPs updated one after the other in one step (DCGAN's order: the
    discriminator's adam step, then the generator's loss through the updated
    discriminator), batch sharded over 8 devices, both donated."""
    from jax_train_helpers import (AXIS, NamedSharding, P, jax, jnp, mlp_batch, mlp_params, np,
                                   optax)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), (AXIS,))
    opt = optax.adam(1e-2)

    def net(p, x):
        for layer in ("l0", "l1"):
            x = jnp.tanh(x @ p[layer]["w"] + p[layer]["b"])
        return x

    def step(params, opt_state, batch):
        (g, d), (g_opt, d_opt) = params, opt_state
        x = batch["x"]

        def d_loss(d):
            return jnp.mean(net(d, net(g, x)) ** 2)

        d_updates, d_opt = opt.update(jax.grad(d_loss)(d), d_opt, d)
        d = optax.apply_updates(d, d_updates)

        def g_loss(g):
            return -jnp.mean(net(d, net(g, x)) ** 2)

        loss, g_grads = jax.value_and_grad(g_loss)(g)
        g_updates, g_opt = opt.update(g_grads, g_opt, g)
        return (optax.apply_updates(g, g_updates), d), (g_opt, d_opt), loss

    def init():
        g = mlp_params(jax.random.PRNGKey(0), sizes=(32, 64, 32))
        d = mlp_params(jax.random.PRNGKey(1), sizes=(32, 64, 32))
        return (g, d), (jax.jit(opt.init)(g), jax.jit(opt.init)(d))

    def batch(i):
        return jax.device_put(mlp_batch(jax.random.PRNGKey(100 + i), 64),
                              NamedSharding(mesh, P(AXIS)))

    return jax.jit(step, donate_argnums=(0, 1)), init, batch


def test_a_gan_s_discriminator_is_sharded_and_trains_like_jit(request):
    """The discriminator's gradients were kept whole as batch statistics (a probe's
    DCGAN: 10 of them, in every front end); now both networks' are sharded."""
    from jax_train_helpers import needs_devices

    if needs_devices(request):
        _forced_shards_and_trains_like_jit(_sequential_program, 8)


def _forced_shards_and_trains_like_jit(program, sharded: int) -> None:
    """``program()``'s step through ``shard_weight_update(force=True)`` in both state
    modes: ``sharded`` gradients sharded, and the final state jit's."""
    from jax_train_helpers import assert_close, run_forced, run_steps

    step, init, batch = program()
    for state in ("gathered", "sharded"):
        fast, final, _ = run_forced(step, state, init, batch)
        assert fast.report is not None and fast.report["sharded"] == sharded, \
            [(e["reason_code"], e["reason"][:80]) for e in fast.report["explanations"]]
        assert_close(final, run_steps(step, init(), batch)[0])


def _minibatch_program():
    """flax's PPO ``train_step`` (examples/ppo/ppo_lib.py) in its own form: a Python loop
    over minibatches inside one jit, each one's gradient computed from the weights the
    previous one updated (``state.apply_gradients`` per minibatch; here optax's chain of
    a global-norm clip and adam, the trainer's), the minibatch split over 8 devices, the
    state donated."""
    from jax_train_helpers import (AXIS, NamedSharding, P, jax, jnp, mlp_batch, mlp_params, np,
                                   optax)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), (AXIS,))
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))

    def net(p, x):
        for layer in ("l0", "l1"):
            x = jnp.tanh(x @ p[layer]["w"] + p[layer]["b"])
        return x

    def loss_fn(params, x):
        return jnp.mean(net(params, x) ** 2)

    def step(params, opt_state, batches):
        total = 0.0
        for i in range(batches["x"].shape[0]):
            loss, grads = jax.value_and_grad(loss_fn)(params, batches["x"][i])
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            total += loss
        return params, opt_state, total

    def init():
        params = mlp_params(jax.random.PRNGKey(0), sizes=(32, 64, 32))
        return params, jax.jit(opt.init)(params)

    def batch(i):
        minibatches = jnp.stack([mlp_batch(jax.random.PRNGKey(10 * i + k), 64)["x"]
                                 for k in range(3)])
        return {"x": jax.device_put(minibatches, NamedSharding(mesh, P(None, AXIS)))}

    return jax.jit(step, donate_argnums=(0, 1)), init, batch


def test_every_minibatch_s_update_is_sharded_and_trains_like_jit(request):
    """The first minibatches' gradients were kept whole as batch statistics (the later
    ones' gradients are computed from the weights they update: 8 of 12 kept whole even
    forced, in flax's PPO); each minibatch's weights are a version of the weight, not a
    statistic."""
    from jax_train_helpers import needs_devices

    if needs_devices(request):
        _forced_shards_and_trains_like_jit(_minibatch_program, 12)


#: A forward value the partitioner sums (%logit: CLIP's label logits gathered from a
#: sharded operand) read only by the loss the step returns, beside the weight's gradient.
FORWARD_SUM = """HloModule clip, replica_count=8, input_output_alias={ {0}: (0, {}, may-alias) }
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT r = f32[] add(a, b)
}
ENTRY e {
  w = f32[16,16] parameter(0)
  x = f32[4,16] parameter(1), parameter_replication={false}
  y = f32[4,16] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  gw = f32[16,16] dot(x, y), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ar = f32[16,16] all-reduce(gw), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add
  lr = f32[] constant(0.1)
  lrs = f32[16,16] broadcast(lr), dimensions={}
  u = f32[16,16] multiply(ar, lrs)
  nw = f32[16,16] subtract(w, u)
  part = f32[4,16] tanh(y)
  logit = f32[4,16] all-reduce(part), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add
  sq = f32[4,16] multiply(logit, logit)
  zero = f32[] constant(0)
  loss = f32[] reduce(sq, zero), dimensions={0,1}, to_apply=add
  ROOT out = (f32[16,16], f32[]) tuple(nw, loss)
}
"""


def test_a_forward_sum_only_the_loss_reads_is_no_gradient():
    """It was sharded and counted as a gradient (its 'update' the loss's arithmetic);
    where the aliases name the weights' next values, it stays whole and says why."""
    by_name, report, _ = rows(FORWARD_SUM)
    assert by_name["ar"].sharded
    assert not by_name["logit"].sharded and by_name["logit"].reason_code == "no_update_work"
    assert "a value of the forward pass, not a gradient" in by_name["logit"].reason
