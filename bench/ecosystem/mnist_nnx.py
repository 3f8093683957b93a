"""flax nnx's MNIST CNN, trained data parallel with ``jax.jit``.

Sources (google/flax at 18f8f311c275d57f46d95e41b15aa97b454754c0; Apache License 2.0,
Copyright 2024 The Flax Authors):

* https://github.com/google/flax/blob/main/docs_nnx/mnist_tutorial.md — ``CNN``,
  ``loss_fn``, ``train_step`` (here without its ``@nnx.jit``), the optimizer
  (``optax.adamw(0.005, 0.9)`` on ``nnx.Param``), the metrics, the train view
  (``nnx.view(model, deterministic=False, use_running_average=False)``) and ``rngs``:
  all unchanged.
* https://github.com/google/flax/blob/main/docs_nnx/guides/performance.md, "Functional
  training loop" — the step as regular ``jax.jit``: ``nnx.split`` before the loop,
  ``nnx.merge`` at the top of the step, ``nnx.state`` at its end (here the state also
  donated, and the batch sharded over a data axis: data parallel).

Cut for the CPU: synthetic images and labels in place of the MNIST download. The
BatchNorm statistics are means over the global batch: the SPMD partitioner all-reduces
them, and the running averages are state the step updates.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bench.ecosystem import Program, data_mesh, replicated, sharded_batch

# ---------------------------------------------------------------- from mnist_tutorial.md


class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x


learning_rate = 0.005
momentum = 0.9


def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
  logits = model(batch['image'], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch['label']
  ).mean()
  return loss, logits


def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs: nnx.Rngs, batch):
  """Train for a single step."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch, rngs)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.
  optimizer.update(model, grads)  # In-place updates.

# ------------------------------------------------------------------------- the program

AXIS = "data"


def _objects():
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
      model, optax.adamw(learning_rate, momentum), wrt=nnx.Param
    )
    metrics = nnx.MultiMetric(
      accuracy=nnx.metrics.Accuracy(),
      loss=nnx.metrics.Average('loss'),
    )
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    rngs = nnx.Rngs(0)
    return train_model, optimizer, metrics, rngs


def build(n: int, per_device: int = 2) -> Program:
    """The tutorial's step on ``n`` devices, ``per_device`` images each."""
    mesh = data_mesh(n, AXIS)
    graphdef, _ = nnx.split(_objects())

    @partial(jax.jit, donate_argnums=0)
    def jax_train_step(state, batch):
        model, optimizer, metrics, rngs = nnx.merge(graphdef, state)
        train_step(model, optimizer, metrics, rngs, batch)
        return nnx.state((model, optimizer, metrics, rngs)), metrics.compute()['loss']

    def init():
        return (replicated(mesh, nnx.split(_objects())[1]),)

    def batch(i: int):
        key = jax.random.key(1000 + i)
        rows = n * per_device
        images = jax.random.uniform(key, (rows, 28, 28, 1), jnp.float32)
        labels = jax.random.randint(jax.random.fold_in(key, 1), (rows,), 0, 10)
        return sharded_batch(mesh, {'image': images, 'label': labels})

    return Program("flax nnx MNIST CNN", mesh, jax_train_step, init, batch,
                   opt_state_prefix="[0][1]['opt_state']")
