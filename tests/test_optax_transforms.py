"""The optax gradient transformations users reach for beyond the six optimizers of the
model × optimizer tests (``test_jax_train.py``), each in a data-parallel MLP step through
``shard_weight_update`` (forced, both state modes) against plain ``jax.jit``: the step
runs sharded (no ``FallbackWarning``, every weight's gradient sharded) with jit's
numbers.

They are the updates a weight-update pass can get wrong: norms over a whole weight
(LAMB-like trust ratios in LARS and Fromage, NovoGrad's per-layer second moment,
adaptive gradient clipping's per-unit norms, Muon's Newton-Schulz iteration on each
matrix, GaLore's projections through its state), step sizes from sums over the whole
model (Prodigy, D-Adaptation, Mechanic, COCOB), reductions along one axis (SM3's per-row and per-column accumulators),
randomness drawn inside the update (``noisy_sgd``: the same bits on a shard as on the
whole), a conditional on the step (``apply_if_finite``, ``MultiSteps``, RAdam's
rectification, a piecewise schedule, which once hung the pass), per-leaf routing
(``masked`` weight decay, ``multi_transform`` with frozen leaves) and hyperparameters
kept in the state (``inject_hyperparams``). Forced, the pass shards whatever it can
prove safe; what it cannot stays whole, and the numbers say whether that line was
drawn right.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_train_helpers import (AXIS, DEVICES, assert_close, mlp_batch, mlp_loss, mlp_params,
                               needs_devices, run_forced, run_steps)


STEPS = 3
#: The MLP's widths: its biases (60, 36) do not split evenly over the devices, so their
#: shards are padded and a norm or sum over a shard must leave the padding out.
SIZES = (32, 60, 36, 8)
#: The MLP's weight (matrix) leaves: every transformation must shard at least these.
MATRICES = 3


def _every_matrix(params):
    return jax.tree.map(lambda leaf: leaf.ndim > 1, params)


def _frozen_first_layer(params):
    return {name: jax.tree.map(lambda _, label="frozen" if name == "l0" else "train": label,
                               layer)
            for name, layer in params.items()}


#: name → the optimizer, built from the initial params where it needs their structure.
TRANSFORMS = {
    "lars": lambda params: optax.lars(1e-2),
    "fromage": lambda params: optax.fromage(1e-3),
    "novograd": lambda params: optax.novograd(1e-3),
    "adaptive_grad_clip": lambda params: optax.chain(optax.adaptive_grad_clip(0.1),
                                                     optax.adam(1e-3)),
    "muon": lambda params: optax.contrib.muon(1e-3),
    "sm3": lambda params: optax.sm3(1e-2),
    "noisy_sgd": lambda params: optax.noisy_sgd(1e-2, key=3),
    "apply_if_finite": lambda params: optax.apply_if_finite(optax.adam(1e-3), 2),
    "multi_steps": lambda params: optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
    "radam": lambda params: optax.radam(1e-3),
    "piecewise_schedule_nesterov": lambda params: optax.sgd(
        optax.piecewise_constant_schedule(0.1, {1: 0.5, 2: 0.1}), momentum=0.9, nesterov=True),
    "masked_weight_decay": lambda params: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-3, 1, 10), weight_decay=1e-2,
        mask=_every_matrix),
    "multi_transform_frozen": lambda params: optax.multi_transform(
        {"train": optax.adabelief(1e-3), "frozen": optax.set_to_zero()},
        _frozen_first_layer(params)),
    "inject_hyperparams": lambda params: optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-3, weight_decay=1e-2),
    "schedule_free": lambda params: optax.contrib.schedule_free_adamw(1e-3, warmup_steps=2),
    "adan": lambda params: optax.adan(1e-3),
    "clip_adamax": lambda params: optax.chain(optax.clip(0.01), optax.adamax(1e-3)),
    "zero_nans_yogi": lambda params: optax.chain(optax.zero_nans(), optax.yogi(1e-3)),
    "centered_rmsprop": lambda params: optax.rmsprop(1e-3, centered=True),
    # GaLore's state holds a projector per matrix (its SVD, recomputed every 2 steps) and
    # moments of another shape than the weight: the update is dots on the state.
    "galore": lambda params: optax.contrib.galore(1e-3, rank=4, update_proj_gap=2),
    # step sizes from dot products over every leaf (the whole model's sums)
    "prodigy": lambda params: optax.contrib.prodigy(1.0),
    "dadapt_adamw": lambda params: optax.contrib.dadapt_adamw(1.0),
    "mechanize": lambda params: optax.contrib.mechanize(optax.adam(1e-3)),
    "cocob": lambda params: optax.contrib.cocob(),
}


def _program(name: str):
    """The jitted step (params and state donated), its mesh and initial state."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:DEVICES]), (AXIS,))
    params = mlp_params(jax.random.PRNGKey(0), SIZES)
    optimizer = TRANSFORMS[name](params)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def init():
        # The step donates what it is given, and some states hold the initial weights
        # themselves (Prodigy, Mechanic, COCOB): every leaf its own buffer.
        fresh = jax.tree.map(jnp.copy, params)
        state = jax.tree.map(jnp.copy, optimizer.init(fresh))
        return jax.device_put((fresh, state), NamedSharding(mesh, P()))

    def batch(i: int):
        return jax.device_put(mlp_batch(jax.random.PRNGKey(1000 + i), 2 * DEVICES),
                              NamedSharding(mesh, P(AXIS)))

    return jax.jit(train_step, donate_argnums=(0, 1)), init, batch


def _comparable(tree):
    """Typed PRNG keys (``noisy_sgd``'s state) as their key bits, compared exactly (as
    int32, which the bounds hold to 0)."""
    def leaf(a):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(a).view(jnp.int32)
        return a
    return jax.tree.map(leaf, tree)


@pytest.mark.parametrize("state", ["gathered", "sharded"])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transform_runs_sharded_with_jits_numbers(request, name, state):
    if not needs_devices(request):
        return
    step, init, batch = _program(name)
    expected = run_steps(step, init(), batch, STEPS)
    fast, final, losses = run_forced(step, state, init, batch, STEPS)
    report = fast.report
    assert report["fallback"] is None
    sharded = {row["shape"] for row in report["explanations"] if row["sharded"]}
    assert sum(1 for row in report["explanations"] if row["sharded"]) >= MATRICES, report
    assert any("," in shape for shape in sharded), sharded  # the matrices among them
    assert_close(_comparable((final, losses)), _comparable(expected))
