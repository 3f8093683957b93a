"""``shard_weight_update`` on steps written with the ecosystem's own jit wrappers: flax's
``nnx.jit`` and equinox's ``filter_jit`` (which crashed with ``'Lowered' object has no
attribute '_lowering'``). Their wrappers keep their own argument handling (nnx's graph
state, equinox's array/static partition) and call the optimized step where they called
their ``jax.jit``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from jax_train_helpers import AXIS, jax, needs_devices, optax

import hlo_shard.jax as hsj
from hlo_shard.analysis.names import instruction_names
from hlo_shard.parser import parse
from hlo_shard.printer import to_text

eqx = pytest.importorskip("equinox")
nnx = pytest.importorskip("flax.nnx")
jnp = jax.numpy
P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding


def _mesh(n: int = 4):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,))
    return NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))


def _batches(by_data, steps: int):
    key = jax.random.PRNGKey(7)
    return [jax.device_put((jax.random.normal(jax.random.fold_in(key, i), (8, 32)),
                            jax.random.normal(jax.random.fold_in(key, 100 + i), (8, 8))),
                           by_data) for i in range(steps)]


def _no_fallback(fast, caught) -> None:
    fallbacks = [str(c.message) for c in caught if issubclass(c.category, hsj.FallbackWarning)]
    assert not fallbacks, fallbacks
    assert fast.report["fallback"] is None and fast.report["sharded"] >= 1


def _run_without_fallback(fast, run):
    """``run(fast)``, asserting that ``fast`` ran its optimized step (no FallbackWarning,
    something sharded)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(fast)
    _no_fallback(fast, caught)
    return out


# Model and step in the style of flax's NNX data-parallel guide (an nnx.Module, an
# nnx.Optimizer over its Params, state replicated with jax.device_put + nnx.update, the
# step mutating both in place under @nnx.jit), small sizes.
class _MLP(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


@nnx.jit
def _nnx_train_step(model, optimizer, x, y):
    def loss_fn(model):
        return ((model(x) - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_a_flax_nnx_jit_step(request, state):
    if not needs_devices(request):
        return
    replicated, by_data = _mesh()
    batches = _batches(by_data, 3)

    def run(step):
        model = _MLP(32, 64, 8, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        nnx.update((model, optimizer),
                   jax.device_put(nnx.state((model, optimizer)), replicated))
        return [float(step(model, optimizer, x, y)) for x, y in batches], model

    fast = hsj.shard_weight_update(_nnx_train_step, state=state, force=True)
    losses, model = _run_without_fallback(fast, run)
    reference, model_jit = run(_nnx_train_step)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model.linear1.kernel[...]),
                               np.asarray(model_jit.linear1.kernel[...]), rtol=1e-5, atol=1e-6)
    assert fast.report["gradients"] >= 4  # both layers' kernel and bias


@nnx.jit
def _nnx_classifier_step(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def test_a_batch_leaf_shaped_as_a_state_shard_stays_the_batch(request):
    """As flax's nnx MNIST tutorial writes it: model and optimizer made where jax puts
    them (not placed on the mesh), the batch a dict with integer labels. The second call
    is a new signature (the state is placed now), so its leaves are matched against the
    state's shard form; the labels, int32[16] split over 8 devices, have the shape and
    placement of the 10-wide bias's shards (padded to 16) and were gathered as if they
    were (a trace error raised into the loop)."""
    if not needs_devices(request):
        return
    _, by_data = _mesh(8)
    key = jax.random.PRNGKey(3)
    batches = [jax.device_put({"image": jax.random.normal(jax.random.fold_in(key, i), (16, 32)),
                               "label": jax.random.randint(jax.random.fold_in(key, 50 + i),
                                                           (16,), 0, 10)}, by_data)
               for i in range(3)]

    def run(step):
        model = _MLP(32, 64, 10, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        return [float(step(model, optimizer, batch)) for batch in batches], model

    fast = hsj.shard_weight_update(_nnx_classifier_step, state="sharded", force=True)
    losses, model = _run_without_fallback(fast, run)
    reference, model_jit = run(_nnx_classifier_step)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model.linear2.bias[...]),
                               np.asarray(model_jit.linear2.bias[...]), rtol=1e-5, atol=1e-6)


# Model and step in the style of equinox's parallelism example (examples/parallelism:
# eqx.nn.MLP, optax state over the inexact arrays, @eqx.filter_jit(donate="all") with
# eqx.filter_shard of model, state and batch), small sizes.
def _eqx_step(optim):
    @eqx.filter_jit(donate="all")
    def train_step(model, opt_state, x, y, sharding):
        replicated = NamedSharding(sharding.mesh, P())  # the example: sharding.replicate()
        model, opt_state = eqx.filter_shard((model, opt_state), replicated)
        x, y = eqx.filter_shard((x, y), sharding)

        @eqx.filter_value_and_grad
        def compute_loss(model, x, y):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss, grads = compute_loss(model, x, y)
        updates, opt_state = optim.update(grads, opt_state,
                                          eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        model, opt_state = eqx.filter_shard((model, opt_state), replicated)
        return model, opt_state, loss
    return train_step


def _eqx_run(fn, optim, batches, replicated, by_data):
    """``fn`` (the step or its sharded form) from equinox's MLP as the example starts
    it, over ``batches``: the losses and the final model."""
    model = eqx.nn.MLP(32, 8, 64, 2, key=jax.random.PRNGKey(0))
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    model, opt_state = eqx.filter_shard((model, opt_state), replicated)
    losses = []
    for x, y in batches:
        model, opt_state, loss = fn(model, opt_state, x, y, by_data)
        losses.append(float(loss))
    return losses, model


@pytest.mark.parametrize("state, force", [("gathered", False), ("sharded", False),
                                          ("sharded", True)])
def test_an_equinox_filter_jit_step(request, state, force):
    """Through the optimized path without a crash (was ``'Lowered' object has no
    attribute '_lowering'``), with jit's numbers; forced, the sharded step runs and
    still gives them (docs/jax.md once listed this step's sharded module as computing
    something else)."""
    if not needs_devices(request):
        return
    replicated, by_data = _mesh()
    batches = _batches(by_data, 3)
    optim = optax.adam(1e-2)
    step = _eqx_step(optim)

    def run(fn):
        return _eqx_run(fn, optim, batches, replicated, by_data)

    fast = hsj.shard_weight_update(step, state=state, force=force)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _ = run(fast)
    assert fast.report is not None and fast.report["speed"] is not None  # captured, priced
    if force:
        assert fast.report["fallback"] is None and fast.report["sharded"] >= 1, fast.report
    elif fast.report["fallback"] is not None:
        assert fast.report["fallback"] == "not_faster"
        assert len([c for c in caught if issubclass(c.category, hsj.FallbackWarning)]) == 1
    reference, _ = run(step)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["lion", "sgd_momentum"])
def test_an_equinox_step_with_one_moment_per_weight_keeps_its_model_whole(request, optimizer):
    """``eqx.filter_jit``'s arguments carry none of the user's paths, so the pass pairs
    state with outputs from the graph alone: lion's and momentum's new weight depends on
    its moment alone of the state, as the moment's next value does, and was taken for
    it — the model came back as shards and the second step failed in the model's own
    code (``dot_general requires contracting dimensions to have the same shape``)."""
    if not needs_devices(request):
        return
    replicated, by_data = _mesh()
    batches = _batches(by_data, 3)
    optim = optax.lion(1e-3) if optimizer == "lion" else optax.sgd(1e-2, momentum=0.9)
    step = _eqx_step(optim)

    def run(fn):
        return _eqx_run(fn, optim, batches, replicated, by_data)

    fast = hsj.shard_weight_update(step, state="sharded", force=True)
    losses, model = _run_without_fallback(fast, run)
    assert any(p["kind"] == "sharded" for p in fast.report["parameters"])
    # named as the user's arguments name them (equinox's jit: dynamic_donate['first'][0])
    assert [row["gradient_of"] for row in fast.report["explanations"]][:2] == \
        ["model.layers[0].weight", "model.layers[0].bias"]
    reference, model_jit = run(step)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    for ours, theirs in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)),
                            jax.tree.leaves(eqx.filter(model_jit, eqx.is_array)), strict=True):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-6)


def test_an_equinox_step_gathers_its_sharded_state_back_to_leaves(request):
    """``eqx.filter_jit`` hands the step its arguments under its own names
    (``dynamic_donate[...]``), so the user's paths name no state leaf: ``gather_args``
    and ``gather_outputs`` still return full leaves (by the shard form's shape and
    placement), never the flat shards as if they were the leaves (a checkpoint of
    them would be lost), and the round trip resumes jit's run."""
    if not needs_devices(request):
        return
    replicated, by_data = _mesh()
    (x, y), = _batches(by_data, 1)
    optim = optax.adam(1e-2)
    step = _eqx_step(optim)

    def start():
        model = eqx.nn.MLP(32, 8, 64, 2, key=jax.random.PRNGKey(0))
        opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
        return eqx.filter_shard((model, opt_state), replicated)

    fast = hsj.shard_weight_update(step, state="sharded", force=True)
    model, opt_state, _ = fast(*start(), x, y, by_data)
    assert fast.report["fallback"] is None and fast.report["sharded"] > 0
    model_jit, opt_state_jit, _ = step(*start(), x, y, by_data)
    for gathered in (fast.gather_args(model, opt_state, x, y, by_data)[1],
                     fast.gather_outputs((model, opt_state, 0.0))[1]):
        mu, mu_jit = gathered[0].mu, opt_state_jit[0].mu
        assert mu.layers[0].weight.shape == mu_jit.layers[0].weight.shape == (64, 32)
        for leaf, leaf_jit in zip(jax.tree.leaves(gathered), jax.tree.leaves(opt_state_jit)):
            np.testing.assert_allclose(np.asarray(leaf), np.asarray(leaf_jit), rtol=1e-5,
                                       atol=1e-6)


# Model and step in the style of equinox's stateful example (examples/stateful:
# eqx.nn.BatchNorm with eqx.nn.make_with_state, the model vmapped over the batch with
# axis_name="batch", @eqx.filter_jit step of (model, state, opt_state, x, y)), small sizes.
class _BatchNormNet(eqx.Module):
    linear1: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    linear2: eqx.nn.Linear

    def __init__(self, key):
        key1, key2 = jax.random.split(key)
        self.linear1 = eqx.nn.Linear(32, 64, use_bias=False, key=key1)
        self.norm = eqx.nn.BatchNorm(64, axis_name="batch", mode="batch")
        self.linear2 = eqx.nn.Linear(64, 8, key=key2)

    def __call__(self, x, state):
        x = self.linear1(x)
        x, state = self.norm(x, state)
        return self.linear2(jax.nn.relu(x)), state


def test_an_equinox_stateful_step_gathers_its_third_argument(request):
    """``eqx.filter_jit``'s own jit has ``static_argnums=2``: that is its argument, not
    the user's. ``gather_args(model, state, opt_state)`` passed the user's third
    argument, the optimizer state, over as static and returned its flat shards as if
    they were the leaves (a checkpoint of them would be lost); it gathers them now.
    ``shard_args`` before any step, which captured the step from the user's arguments
    with the wrapper's jit (``TypeError: unhashable type``), is refused with the way
    out."""
    if not needs_devices(request):
        return
    replicated, by_data = _mesh()
    (x, y), = _batches(by_data, 1)
    optim = optax.adam(1e-2)

    @eqx.filter_jit
    def make_step(model, state, opt_state, x, y):
        def compute_loss(model, state, x, y):
            batch_model = jax.vmap(model, axis_name="batch", in_axes=(0, None),
                                   out_axes=(0, None))
            pred, state = batch_model(x, state)
            return jnp.mean((pred - y) ** 2), state

        (loss, state), grads = eqx.filter_value_and_grad(compute_loss, has_aux=True)(
            model, state, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, opt_state, loss

    def start():
        model, state = eqx.nn.make_with_state(_BatchNormNet)(jax.random.PRNGKey(0))
        opt_state = optim.init(eqx.filter(model, eqx.is_array))
        return eqx.filter_shard((model, state, opt_state), replicated)

    fast = hsj.shard_weight_update(make_step, state="sharded", force=True)
    with pytest.raises(ValueError, match="call the step with the full leaves first"):
        fast.shard_args(*start(), x, y)
    model, state, opt_state, _ = fast(*start(), x, y)
    assert fast.report["fallback"] is None and fast.report["sharded"] > 0
    assert opt_state[0].mu.linear1.weight.shape != (64, 32)  # kept as shards
    _, _, opt_state_jit, _ = make_step(*start(), x, y)
    gathered = fast.gather_args(model, state, opt_state)[2]
    assert gathered[0].mu.linear1.weight.shape == (64, 32)
    for leaf, leaf_jit in zip(jax.tree.leaves(gathered), jax.tree.leaves(opt_state_jit)):
        assert leaf.shape == leaf_jit.shape
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(leaf_jit), rtol=1e-5,
                                   atol=1e-6)
    # the full leaves go back into the step as they are (no user path names a state leaf)
    model, state, opt_state, loss = fast(*fast.shard_args(model, state, gathered), x, y)
    assert np.isfinite(float(loss))


def _pmean_step(opt):
    """A shard_map body: the device's gradients averaged over the data axis by the
    user's own ``pmean``, then ``opt``'s update."""
    def local(params, opt_state, x, y):
        def loss(p):
            return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        grads = jax.lax.pmean(grads, AXIS)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(value, AXIS)

    return local


def test_a_shard_map_manual_over_the_data_axis_only(request):
    """``jax.shard_map(..., axis_names={"data"})`` on a (data, model) mesh, the model axis
    left to the partitioner (partial auto): jax writes each psum's reducer as
    ``ROOT copy(add(x, y))``, which was read as no sum at all, so the step fell back with
    "the step has no gradient all-reduce". A view of the sum in its own shape is the
    sum: the gradients are sharded over the data groups, numbers jit's."""
    if not needs_devices(request):
        return
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), (AXIS, "model"))
    replicated, by_data = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    opt = optax.adam(1e-2)
    key = jax.random.PRNGKey(0)
    params = jax.device_put({"w": jax.random.normal(key, (32, 256)) * 0.1,
                             "v": jax.random.normal(key, (256, 8)) * 0.1}, replicated)

    local = _pmean_step(opt)
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                                 out_specs=(P(), P(), P()), axis_names={AXIS},
                                 check_vma=False))
    batches = [jax.device_put(batch, by_data) for batch in _batches(replicated, 3)]

    def run(fn):
        p, s = params, jax.device_put(opt.init(params), replicated)
        losses = []
        for x, y in batches:
            p, s, loss = fn(p, s, x, y)
            losses.append(float(loss))
        return losses, p

    fast = hsj.shard_weight_update(step, force=True)
    losses, final = _run_without_fallback(fast, run)
    reference, final_jit = run(step)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    for leaf, leaf_jit in zip(jax.tree.leaves(final), jax.tree.leaves(final_jit)):
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(leaf_jit), rtol=1e-5,
                                   atol=1e-6)


def test_a_jax_jit_of_a_shard_map_step(request):
    if not needs_devices(request):
        return
    replicated, by_data = _mesh()
    mesh = replicated.mesh
    opt = optax.sgd(1e-2, momentum=0.9)
    key = jax.random.PRNGKey(0)
    params = jax.device_put({"w": jax.random.normal(key, (32, 64)) * 0.1,
                             "v": jax.random.normal(key, (64, 8)) * 0.1}, replicated)
    opt_state = jax.device_put(opt.init(params), replicated)

    local = _pmean_step(opt)
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                                 out_specs=(P(), P(), P())))
    fast = hsj.shard_weight_update(step, state="sharded", force=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p, s = params, opt_state
        for x, y in _batches(by_data, 3):
            p, s, loss = fast(p, s, x, y)
    _no_fallback(fast, caught)
    pj, sj = params, opt_state
    for x, y in _batches(by_data, 3):
        pj, sj, loss_jit = step(pj, sj, x, y)
    np.testing.assert_allclose(float(loss), float(loss_jit), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(fast.gather_args(p, s)), jax.tree.leaves((pj, sj))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_gather_outputs_keeps_a_per_example_output_shaped_as_a_state_shard(request):
    """An ``eqx.filter_jit`` step returning its per-example losses, float32[16] split over
    8 devices: the shape and placement of the 10-wide bias's state shards (padded to
    16). ``gather_outputs`` (how a user checkpoints such a step's outputs) gathered them
    as if they were the bias's shards, returning 10 numbers; it now knows the state
    outputs of the latest run by identity."""
    if not needs_devices(request):
        return
    replicated, by_data = _mesh(8)
    optim = optax.adamw(1e-2)
    model = eqx.nn.MLP(32, 10, 64, 2, key=jax.random.PRNGKey(0))

    @eqx.filter_jit(donate="all-except-first")
    def train_step(batch, model, opt_state):
        def loss(m):
            per_example = optax.softmax_cross_entropy_with_integer_labels(
                jax.vmap(m)(batch["x"]), batch["y"])
            return per_example.mean(), per_example

        (_, per_example), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, per_example

    key = jax.random.PRNGKey(4)
    batches = [jax.device_put({"x": jax.random.normal(jax.random.fold_in(key, i), (16, 32)),
                               "y": jax.random.randint(jax.random.fold_in(key, 9 + i), (16,),
                                                       0, 10)}, by_data) for i in range(2)]

    def run(step):
        m = eqx.filter_shard(jax.tree.map(lambda x: jnp.array(x) if eqx.is_array(x) else x,
                                          model), replicated)
        state = (m, eqx.filter_shard(optim.init(eqx.filter(m, eqx.is_array)), replicated))
        for batch in batches:
            out = step(batch, *state)
            state = out[:2]
        return out

    fast = hsj.shard_weight_update(train_step, state="sharded", force=True)
    out = _run_without_fallback(fast, run)
    full = fast.gather_outputs(out)
    reference = run(train_step)
    np.testing.assert_allclose(np.asarray(full[2]), np.asarray(reference[2]), rtol=1e-5)
    arrays = [jax.tree.leaves(eqx.filter(tree, eqx.is_array)) for tree in (full[:2], reference[:2])]
    for ours, theirs in zip(*arrays, strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-6)


def test_per_device_hlo_takes_the_library_jit_wrappers(request):
    """``per_device_hlo`` on an ``nnx.jit`` and an ``eqx.filter_jit`` step (it called the
    wrapper's ``lower``, equinox's own: ``'Lowered' object has no attribute
    '_lowering'``): the module ``shard_weight_update`` captures from the same call, and
    the step not run (nnx's model, updated in place by a step, unchanged)."""
    if not needs_devices(request):
        return
    replicated, by_data = _mesh()
    (x, y), = _batches(by_data, 1)

    model = _MLP(32, 64, 8, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    nnx.update((model, optimizer), jax.device_put(nnx.state((model, optimizer)), replicated))
    kernel = np.asarray(model.linear1.kernel[...])
    text = hsj.per_device_hlo(_nnx_train_step, model, optimizer, x, y)
    np.testing.assert_array_equal(np.asarray(model.linear1.kernel[...]), kernel)
    fast = hsj.shard_weight_update(_nnx_train_step, force=True)
    fast(model, optimizer, x, y)
    assert _unnamed(text) == _unnamed(fast.original_hlo_text)
    # nnx.jit names its jit's arguments by its own flattening (model.states[0][3]): the
    # text names each parameter by the user's path, as fast.report does
    names = instruction_names(parse(text))
    assert names == {p["hlo_name"]: p["name"] for p in fast.report["parameters"]
                     if p["name"]}
    assert "model.linear1.kernel.value" in names.values(), names

    optim = optax.adam(1e-2)
    step = _eqx_step(optim)
    mlp = eqx.nn.MLP(32, 8, 64, 2, key=jax.random.PRNGKey(0))
    opt_state = optim.init(eqx.filter(mlp, eqx.is_inexact_array))
    mlp, opt_state = eqx.filter_shard((mlp, opt_state), replicated)
    text = hsj.per_device_hlo(step, mlp, opt_state, x, y, by_data)
    assert "all-reduce" in text
    fast = hsj.shard_weight_update(step, force=True)
    fast(mlp, opt_state, x, y, by_data)
    assert _unnamed(text) == _unnamed(fast.original_hlo_text)
    names = instruction_names(parse(text))
    assert names == {p["hlo_name"]: p["name"] for p in fast.report["parameters"]
                     if p["name"]}


def _unnamed(text: str) -> list[str]:
    """The lines of ``text`` printed without its entry parameters' metadata (their
    names), blank lines left out."""
    module = parse(text)
    for param in module.entry.parameters():
        param.attributes.pop("metadata", None)
    return [line for line in to_text(module).splitlines() if line.strip()]


class _TwoBiases(nnx.Module):
    """A (64,) bias and a (4, 16) one: at N = 8 both have [8] shards, so a shard names
    neither by its shape and placement."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.a = nnx.Linear(32, 64, rngs=rngs)
        self.b = nnx.LinearGeneral(64, (4, 16), rngs=rngs)
        self.c = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        h = self.b(nnx.relu(self.a(x)))
        return self.c(h.reshape(x.shape[0], 64))


def test_nnx_state_kept_as_shards_gathers_back_for_a_checkpoint(request):
    """After a step the nnx.Optimizer holds shards; ``gather_args`` gives its full leaves
    (jit's values). It refused them ("in the shard form of state leaves of different
    shapes"): nnx.jit names its arguments otherwise, and the two biases' moments share
    one shard form; the latest run's own outputs are now known by identity."""
    if not needs_devices(request):
        return
    replicated, by_data = _mesh(8)
    batches = [x for x, _ in _batches(by_data, 2)]

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def run(fn):
        model = _TwoBiases(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        nnx.update((model, optimizer),
                   jax.device_put(nnx.state((model, optimizer)), replicated))
        for x in batches:
            fn(model, optimizer, x)
        return model, optimizer

    fast = hsj.shard_weight_update(step, state="sharded", force=True)
    model, optimizer = _run_without_fallback(fast, run)
    assert {p["name"].split(".")[0] for p in fast.report["parameters"]} >= {"model",
                                                                            "optimizer"}
    held = {leaf.shape for leaf in jax.tree.leaves(nnx.state(optimizer))}
    assert (64,) in held and (4, 16) not in held  # the moments are held as shards
    _, full, _ = fast.gather_args(model, optimizer, batches[0])
    _, reference = run(step)
    ours, theirs = jax.tree.leaves(nnx.state(full)), jax.tree.leaves(nnx.state(reference))
    assert [a.shape for a in ours] == [b.shape for b in theirs]
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
