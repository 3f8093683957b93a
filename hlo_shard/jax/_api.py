"""The entry points of :mod:`hlo_shard.jax`."""

from __future__ import annotations

from collections.abc import Callable
from hlo_shard.jax._step import ShardedStep, per_device_hlo
from hlo_shard.passes.optimize import checked_options
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.profiles import HardwareProfile, resolve_profile


def shard_weight_update(fn: Callable, *, state: str = "gathered", params: str = "gathered",
                        accumulator: str = "auto", strategy: str = "auto",
                        profile: HardwareProfile | str | None = None, min_shard_bytes: int = 0,
                        num_replicas: int | None = None, force: bool = False) -> ShardedStep:
    """``fn`` (a ``jax.jit`` step of a data-parallel program) with its gradient
    all-reduce replaced by reduce-scatter, a 1/N weight update per device and an
    all-gather of the weights; ``state="sharded"`` also keeps the optimizer state in
    per-device shards between steps, and ``params="sharded"`` (with sharded state) the
    weights too: all-gathered at the top of the step for the forward/backward pass (in
    bf16 where that pass only reads the f32 weights converted to bf16), updated in
    shards. ``accumulator``: a loop that sums microbatch gradients (``lax.scan``,
    ``fori_loop``) reduce-scatters them once after it (``"whole"``), or each microbatch's
    into an accumulator carried as a shard, 1/N of its memory (``"sharded"``), or
    whichever the cost model predicts faster (``"auto"``; ``optimize --accumulator``).
    Where the program itself slices each microbatch's sum to the device's block before
    accumulating it (FSDP), moving that all-reduce out of the loop makes the loop carry
    the whole gradient, N times the block: ``"whole"`` does, ``"auto"`` where the
    profile's device memory holds it, ``"sharded"`` keeps the all-reduce in the loop.
    ``profile``: the hardware the step is priced on (a profile name or file, as for
    ``hlo-shard optimize``; by default the published profile of the devices the step is
    compiled for, read at its first call: ``cpu-local`` on CPU). A step
    the cost model does not predict faster sharded runs as ``fn`` (one warning naming both
    estimates) unless ``force`` (``optimize --force``: shard every eligible gradient)."""
    options = ShardingOptions(num_replicas=num_replicas, state=state, params=params,
                              accumulator=accumulator, strategy=strategy,
                              min_shard_bytes=min_shard_bytes,
                              profile=resolve_profile(profile))
    # A bad option is an error now, not at a step.
    return ShardedStep(fn, checked_options(options), force, device_profile=profile is None)


__all__ = ["per_device_hlo", "shard_weight_update"]
