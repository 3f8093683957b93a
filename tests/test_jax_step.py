"""``hlo_shard.jax.ShardedStep`` behaviours beyond matching jit's numbers: checkpoints,
device order, donation, jit's argument handling, the fallback and user errors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from jax_train_helpers import (AXIS, assert_close, jax, make_program, needs_devices,
                               optax, train)

import hlo_shard.jax as hsj
from hlo_shard.parser import parse

jnp = jax.numpy
P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding


def test_checkpoint_round_trip_continues_the_same_trajectory(request, tmp_path):
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 4)
    fast = hsj.shard_weight_update(program.step, state="sharded", force=True)
    (p_ref, s_ref), l_ref = train(fast, program, 6)
    (p, s), l_first = train(fast, program, 3)
    full = fast.gather_args(p, s)
    leaves, treedef = jax.tree.flatten(full)
    np.savez(tmp_path / "ckpt.npz", *[np.asarray(x) for x in leaves])
    with np.load(tmp_path / "ckpt.npz") as saved:
        loaded = [saved[f"arr_{i}"] for i in range(len(leaves))]
    restored = jax.device_put(jax.tree.unflatten(treedef, loaded), program.replicated)
    p, s = fast.shard_args(*restored)
    assert s[0].mu["l0"]["w"].shape == (32 * 64,)  # shard form
    (p, s), l_second = train(fast, program, 3, state=(p, s), first=3)
    np.testing.assert_array_equal(np.concatenate([l_first, l_second]), l_ref)
    for a, b in zip(jax.tree.leaves(fast.gather_args(p, s)), jax.tree.leaves(
            fast.gather_args(p_ref, s_ref))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_mesh_order_decides_the_shard_indices(request):
    if not needs_devices(request):
        return
    devices = [jax.devices()[i] for i in (2, 0, 3, 1)]
    program = make_program("mlp", "adam", 4, devices=devices)
    fast = hsj.shard_weight_update(program.step, state="sharded", force=True)
    (p, s), losses = train(fast, program, 5)
    mu = s[0].mu["l0"]["w"]
    assert [shard.device for shard in sorted(mu.addressable_shards,
                                             key=lambda x: x.index[0].start)] == devices
    (p_jit, s_jit), l_jit = train(program.step, program, 5)
    np.testing.assert_allclose(losses, l_jit, rtol=1e-5)
    assert_close(fast.gather_args(p, s), (p_jit, s_jit))
    # chunk k of the flattened full leaf lives on the mesh's k-th device
    full = np.asarray(fast.gather_args(p, s)[1][0].mu["l0"]["w"]).ravel()
    chunk = len(full) // 4
    for k, device in enumerate(devices):
        piece = next(x for x in mu.addressable_shards if x.device == device)
        np.testing.assert_array_equal(np.asarray(piece.data), full[k * chunk:(k + 1) * chunk])


@pytest.mark.parametrize("donate", [True, False])
def test_donated_arguments_are_consumed_as_by_jit(request, donate):
    if not needs_devices(request):
        return
    program = make_program("mlp", "sgd_momentum", 2, donate=donate)
    fast = hsj.shard_weight_update(program.step, state="gathered", force=True)
    params, opt_state = program.init()
    batch = program.batch(0)
    fast(params, opt_state, batch)
    assert all(x.is_deleted() == donate for x in jax.tree.leaves((params, opt_state)))
    assert not any(x.is_deleted() for x in jax.tree.leaves(batch))


def test_static_arguments_pruned_arguments_and_deep_pytrees(request):
    if not needs_devices(request):
        return
    mesh = jax.make_mesh((4,), (AXIS,), devices=jax.devices()[:4])
    replicated, by_data = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    opt = optax.adam(1e-2)

    def loss(params, x, power):
        (w1, (w2,)) = params["a"]["b"]["c"]
        return jnp.mean((jnp.tanh(x @ w1) @ w2) ** power)

    def step(params, unused, opt_state, x, power, *, scale):
        grads = jax.grad(loss)(params, x, power)
        updates, opt_state = opt.update(jax.tree.map(lambda g: g * scale, grads), opt_state)
        return optax.apply_updates(params, updates), opt_state

    jitted = jax.jit(step, static_argnums=(4,), static_argnames=("scale",),
                     donate_argnums=(0, 2))
    key = jax.random.PRNGKey(0)

    def run(fn, steps=3):
        p = jax.device_put({"a": {"b": {"c": [jax.random.normal(key, (16, 32)) * 0.3,
                                              (jax.random.normal(key, (32, 4)) * 0.3,)]}}},
                           replicated)
        s = jax.device_put(opt.init(p), replicated)
        for i in range(steps):
            x = jax.device_put(jax.random.normal(jax.random.PRNGKey(i), (8, 16)), by_data)
            p, s = fn(p, {"junk": jnp.ones(3)}, s, x, 2, scale=0.5)
        return p, s

    fast = hsj.shard_weight_update(jitted, force=True)
    result = run(fast)
    assert fast.report["sharded"] >= 2
    assert_close(result, run(jitted))
    names = [entry["name"] for entry in fast.report["parameters"]]
    assert "params['a']['b']['c'][1][0]" in names and "unused['junk']" not in names


def test_report_names_leaves_by_their_paths(request):
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2)
    fast = hsj.shard_weight_update(program.step, state="sharded", force=True)
    train(fast, program, 1)
    kinds = {entry["name"]: entry["kind"] for entry in fast.report["parameters"]}
    assert kinds["params['l0']['w']"] == "replicated"
    assert kinds["opt_state[0].mu['l0']['w']"] == "sharded"
    assert kinds["batch['x']"] == "per-device"
    gradients = {row["gradient_of"] for row in fast.report["explanations"] if row["sharded"]}
    assert {"params['l0']['w']", "params['l2']['b']"} <= gradients
    assert "reduce-scatter" in fast.hlo_text and "reduce-scatter" not in fast.original_hlo_text
    parse(fast.hlo_text)


def test_what_it_cannot_shard_runs_fn_with_one_warning(request):
    if not needs_devices(request):
        return
    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2])
    step = jax.jit(lambda w, x: (w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)))
    w = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((2, 4)), NamedSharding(mesh, P()))  # no data axis
    fast = hsj.shard_weight_update(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [fast(w, x) for _ in range(3)]
    fallbacks = [c for c in caught if issubclass(c.category, hsj.FallbackWarning)]
    assert len(fallbacks) == 1 and "nothing to shard" in str(fallbacks[0].message)
    np.testing.assert_array_equal(np.asarray(outs[-1]), np.asarray(step(w, x)))


def test_a_step_predicted_slower_runs_fn_with_both_estimates(request):
    """The never-slower gate of ``optimize``: a small model (sharding predicted slower
    on cpu-local) runs ``fn``, one warning naming both estimates; ``force`` shards it."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2, donate=False)
    fast = hsj.shard_weight_update(program.step)
    params, opt_state = program.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [fast(params, opt_state, program.batch(k)) for k in range(2)]
    fallbacks = [str(c.message) for c in caught if issubclass(c.category, hsj.FallbackWarning)]
    assert len(fallbacks) == 1 and "not predicted at least 10% faster on profile cpu-local" in fallbacks[0]
    assert "per step sharded" in fallbacks[0] and "as it is" in fallbacks[0]
    assert fast.report is None
    assert_close(outs[-1], program.step(params, opt_state, program.batch(1)))
    forced = hsj.shard_weight_update(program.step, force=True)
    forced(params, opt_state, program.batch(0))
    assert forced.report["sharded"] >= 1


def test_a_gradient_from_a_dot_is_scattered_flat_not_in_minor_blocks(request):
    """jit's per-device module all-reduces ``dot`` results laid out {1,0} whose shard
    blocks run along dimension 1: a block reduce-scatter there made XLA:CPU compute the
    dot transposed without its library kernel (the bench MLP: 0.90x of jit's step per
    tensor, 0.13x flat), so each is flattened (transpose + reshape, absorbed by XLA)."""
    if not needs_devices(request):
        return
    from hlo_shard.passes.sharding_pipeline import run_sharding
    from hlo_shard.passes.weight_update_sharding import ShardingOptions, WeightUpdateSharding

    program = make_program("mlp", "adam", 2, donate=False)
    params, opt_state = program.init()
    module = parse(hsj.per_device_hlo(program.step, params, opt_state, program.batch(0)))
    run_sharding(module, WeightUpdateSharding(ShardingOptions(state="sharded",
                                                              strategy="per-tensor")))
    scattered = [module.entry[inst.operands[0]] for inst in module.entry.instructions
                 if inst.opcode == "reduce-scatter"]
    assert len(scattered) >= 4 and not [o.name for o in scattered if o.opcode == "dot"]
    assert any(o.opcode == "reshape" and module.entry[o.operands[0]].opcode == "transpose"
               for o in scattered)


def test_a_wrong_argument_is_named_in_the_error(request):
    if not needs_devices(request):
        return
    program = make_program("mlp", "sgd_momentum", 2, donate=False)
    fast = hsj.shard_weight_update(program.step, force=True)
    params, opt_state = program.init()
    fast(params, opt_state, program.batch(0))
    bad = jax.tree.map(lambda x: x, params)
    bad["l1"]["w"] = bad["l1"]["w"][:, :3]
    with pytest.raises(Exception) as raised:
        fast(bad, opt_state, program.batch(1))
    assert "params['l1']['w'] is float32[64, 3], was float32[64, 64]" in \
        "\n".join(getattr(raised.value, "__notes__", []))


def test_per_device_hlo_is_the_partitioned_module(request):
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2)
    params, opt_state = program.init()
    text = hsj.per_device_hlo(program.step, params, opt_state, program.batch(0))
    module = parse(text)
    assert module.num_partitions == 2
    assert any(inst.opcode == "all-reduce" for inst in module.entry.instructions)
