"""hlo-shard inside JAX programs (with :mod:`hlo_shard.runtime`, the only code that uses
jax's private APIs, behind the version check ``jax>=0.10,<0.11``: outside it both ways
in run the program unchanged with one warning; importing this package does not import
jax). Two ways in (see docs/jax.md):

* ``shard_weight_update(step)``: a ``jax.jit`` step run through its optimized per-device
  module on the user's own jax Arrays, state gathered or kept in shards::

      fast = hsj.shard_weight_update(jax.jit(train_step, donate_argnums=(0, 1)))
      for batch in data:
          params, opt_state, loss = fast(params, opt_state, batch)

* ``install()``: the pass inside XLA's compilation of every ``jax.jit`` step, zero code
  change.
"""

from __future__ import annotations

from hlo_shard.jax._api import per_device_hlo, shard_weight_update
from hlo_shard.jax._capture import Reason
from hlo_shard.jax._step import FallbackWarning, ShardedStep
from hlo_shard.jax.hook import Decision, decisions, install, installed, uninstall

__all__ = ["Decision", "FallbackWarning", "Reason", "ShardedStep",
           "decisions", "install", "installed", "per_device_hlo", "shard_weight_update",
           "uninstall"]
