"""flax's ImageNet ResNet (linen), its training step data parallel as ``jax.jit`` of a
``shard_map``.

The model (:mod:`bench.ecosystem.flax_imagenet_models`) and the step
(:mod:`bench.ecosystem.flax_imagenet_train`: ``train_step``, ``create_train_state``,
the learning-rate schedule, SGD with Nesterov momentum, weight decay in the loss) are
flax's ``examples/imagenet`` files, unchanged. The example maps the step with
``jax.pmap(..., axis_name='batch')``; here the same function runs under
``jax.shard_map`` over a mesh axis named ``'batch'`` inside ``jax.jit``, the state
donated — pmap's successor, the same collectives: ``lax.pmean`` of the gradients, of
the running BatchNorm statistics and of the metrics, and BatchNorm's own cross-device
mean and variance (``axis_name='batch'``) in the forward pass.

Cut for the CPU: 10 classes, ``num_filters`` 64 -> 8, 32x32 synthetic images, two per
device; ``_ResNet1`` (models.py's one-block ResNet "used for testing only") for the
fast tests, ``ResNet18`` for the slow ones.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from bench.ecosystem import Program, data_mesh, replicated, sharded_batch
from bench.ecosystem import flax_imagenet_models as models
from bench.ecosystem import flax_imagenet_train as train

AXIS = "batch"  # the example's axis_name
IMAGE_SIZE = 32


def build(n: int, model: str = "_ResNet1", num_filters: int = 8, per_device: int = 2
          ) -> Program:
    """flax's ImageNet step for ``models.<model>`` on ``n`` devices."""
    mesh = data_mesh(n, AXIS)
    config = SimpleNamespace(half_precision=False, momentum=0.9, warmup_epochs=5.0,
                             num_epochs=100.0)
    resnet = train.create_model(model_cls=getattr(models, model), half_precision=False,
                                num_filters=num_filters)
    learning_rate_fn = train.create_learning_rate_fn(config, 0.1, steps_per_epoch=100)
    p_train_step = jax.shard_map(
        functools.partial(train.train_step, learning_rate_fn=learning_rate_fn),
        mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P()))
    step = jax.jit(p_train_step, donate_argnums=0)

    def init():
        state = train.create_train_state(jax.random.key(0), config, resnet, IMAGE_SIZE,
                                         learning_rate_fn)
        return (replicated(mesh, state),)

    def batch(i: int):
        key = jax.random.key(2000 + i)
        rows = n * per_device
        images = jax.random.normal(key, (rows, IMAGE_SIZE, IMAGE_SIZE, 3), jnp.float32)
        labels = jax.random.randint(jax.random.fold_in(key, 1), (rows,), 0,
                                    train.NUM_CLASSES)
        return sharded_batch(mesh, {'image': images, 'label': labels})

    return Program(f"flax linen {model.lstrip('_')} (ImageNet example)", mesh, step, init,
                   batch)
