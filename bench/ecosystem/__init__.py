"""The ecosystem test bed: training programs written by others, run through
``hlo_shard.jax`` as their users would run them.

Each module holds one program whose model code, loss and optimizer set-up are copied
unchanged from a public source (named, with the commit, at the top of the module); only
sizes and data are cut for the CPU (synthetic data). Each exposes ``build(n, ...)``
returning a :class:`Program`: the data-parallel step (``jax.jit`` over a one-axis mesh of
``n`` devices, state donated), its state arguments and a batch maker — what
``tests/test_ecosystem.py`` puts through ``shard_weight_update`` next to plain jit.

* :mod:`bench.ecosystem.mnist_nnx` — flax nnx's MNIST CNN tutorial (BatchNorm over the
  global batch: the SPMD partitioner all-reduces its statistics);
* :mod:`bench.ecosystem.resnet_linen` — flax's ImageNet ResNet (linen, BatchNorm with
  cross-device ``axis_name`` statistics, ``pmean`` of the gradients), its ``pmap`` step
  run as ``jax.jit`` of a ``shard_map``;
* :mod:`bench.ecosystem.lm1b_linen` — flax's lm1b decoder-only transformer (linen,
  bfloat16 compute over float32 parameters, AdamW on a warmup + rsqrt schedule), its
  ``TrainState`` one donated argument;
* :mod:`bench.ecosystem.nanolm` — optax's nanoLM example (a flax linen character
  transformer, AdamW), its batch an argument sharded over the data axis;
* :mod:`bench.ecosystem.vit_equinox` — equinox's Vision Transformer example (AdamW),
  stepped as equinox's parallelism example steps (``eqx.filter_jit(donate="all")``,
  ``eqx.filter_shard``): its vmapped ``Linear`` gradients are all-reduced over mixed
  mesh forms;
* :mod:`bench.ecosystem.haiku_lm` — haiku's transformer language model example
  (global-norm clipping + Adam, its ``TrainingState`` one donated argument).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclass
class Program:
    """A data-parallel training program: ``step(*state, batch)`` returns the next state
    (as many values as ``state``) followed by its metrics."""

    name: str
    mesh: Mesh
    step: Callable
    #: Builds a fresh copy of the state arguments (the step donates them).
    init: Callable[[], tuple[Any, ...]]
    #: The i-th batch, sharded over the mesh's data axis.
    batch: Callable[[int], Any]
    #: The optimizer state's leaves: the prefix of their paths in the state tuple
    #: (``jax.tree_util.keystr``), for the bench's reference that shards them by
    #: ``NamedSharding``; "" where that is not straightforward (a ``shard_map`` step
    #: takes its state replicated).
    opt_state_prefix: str = ""

    def run(self, step: Callable, steps: int, state: tuple[Any, ...] | None = None
            ) -> tuple[tuple[Any, ...], list[Any]]:
        """``steps`` steps of ``step`` (this program's or one wrapping it) from ``state``
        (default: a fresh init); the final state and each step's metrics."""
        state = self.init() if state is None else state
        metrics = []
        for i in range(steps):
            out = step(*state, self.batch(i))
            state, metrics = tuple(out[:len(state)]), metrics + [out[len(state):]]
        return state, metrics


def data_mesh(n: int, axis: str) -> Mesh:
    """A one-axis mesh of the first ``n`` devices."""
    devices = jax.devices()
    if len(devices) < n:
        raise RuntimeError(f"{n} devices needed, jax has {len(devices)} (set "
                           f"jax_num_cpu_devices before jax starts)")
    return Mesh(np.array(devices[:n]), (axis,))


def replicated(mesh: Mesh, tree: Any) -> Any:
    return jax.device_put(tree, NamedSharding(mesh, P()))


def sharded_batch(mesh: Mesh, tree: Any) -> Any:
    """``tree``'s leading dimension split over the mesh's axis."""
    return jax.device_put(tree, NamedSharding(mesh, P(mesh.axis_names[0])))
