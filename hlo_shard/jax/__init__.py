"""Train with it: a ``jax.jit`` step whose weight update is sharded across the
data-parallel devices, run on the user's own jax Arrays (see docs/jax.md)::

    import hlo_shard.jax as hsj

    step = jax.jit(train_step, donate_argnums=(0, 1))
    fast = hsj.shard_weight_update(step, state="gathered")   # or "sharded"
    for batch in data:
        params, opt_state, loss = fast(params, opt_state, batch)

With :mod:`hlo_shard.runtime`, the only code that uses jax's private APIs
(``jax>=0.10,<0.11``); importing this package does not import jax.
"""

from __future__ import annotations

from hlo_shard.jax._api import per_device_hlo, shard_weight_update
from hlo_shard.jax._step import FallbackWarning, ShardedStep

__all__ = ["FallbackWarning", "ShardedStep", "per_device_hlo", "shard_weight_update"]
