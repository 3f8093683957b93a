"""Projected step time and memory across replica counts (``hlo-shard scale``).

How: **the pass is re-run at each N.** The per-device program of data parallelism is
the same for every replica count except the size of the data-parallel group (and,
with a fixed global batch, the per-replica batch), so :func:`retarget` rewrites the
module's group to N devices, :class:`~hlo_shard.passes.weight_update.WeightUpdateSharding`
shards that module for N (its shard lengths, padding, bucket
choices; the optimizer without its gate, :func:`~hlo_shard.passes.optimize.optimize`
``gate=False``), and both modules are estimated on the profile. Nothing is compiled or run.

Weak scaling (``batch_per_replica="fixed"``, the default) needs nothing else. With a
fixed *global* batch the per-replica batch shrinks as 1/N; the module's shapes cannot
follow, so the forward/backward time and the memory of the batch and of the
activations (forward/backward temporaries) are scaled analytically by per-replica
batch / the module's per-replica batch — that work is linear in the examples (a dot
that reads a weight is not quite: the projection is optimistic at small batches);
the weight update, its formatting, communication and state are not.

A larger model of the same shape (``parameters=P``, ``scale --parameters``) is also
projected analytically, from the module's own weights W₀ (the elements of its weight
parameters), with k = P/W₀: the weight update, its formatting, the bytes of every
collective and the weights, optimizer state, gradients, update temporaries and
undonated outputs grow by k (all are per-parameter work); forward/backward time and
activations by k times the batch factor (≈ 6·P flops per token for a Transformer); a
collective's latency is paid once per combiner bucket, so a bucket of k times the
bytes pays it ⌈k·bytes/threshold⌉ times. Committing a fixture of hundreds of millions
of parameters is not an option (its HLO text is the same program with bigger shapes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hlo_shard.passes.weight_update import planned_update_regions
from hlo_shard.costmodel.step_time import StepEstimate, estimate_step
from hlo_shard.errors import HloShardError
from hlo_shard.ir import ArrayShape, Module
from hlo_shard.passes.optimize import optimize
from hlo_shard.passes.retarget import Retarget, data_parallel_size
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.profiles import HardwareProfile


@dataclass
class Projection:
    """One module at one replica count."""

    step_seconds: float
    seconds_by_category: dict[str, float]
    peak_memory_bytes: float

    @property
    def weight_update_share(self) -> float:
        return (self.seconds_by_category["weight_update"] / self.step_seconds
                if self.step_seconds else 0.0)

    def to_json(self) -> dict:
        return {"step_seconds": self.step_seconds, "seconds_by_category": self.seconds_by_category,
                "peak_memory_bytes": self.peak_memory_bytes,
                "weight_update_share": self.weight_update_share}


@dataclass
class ScalePoint:
    replicas: int
    original: Projection
    sharded: Projection | None
    #: Why the sharded module is missing at this N (the pass refused).
    error: str = ""

    @property
    def saving(self) -> float | None:
        if self.sharded is None or not self.original.step_seconds:
            return None
        return 1 - self.sharded.step_seconds / self.original.step_seconds

    def to_json(self) -> dict:
        return {"replicas": self.replicas, "original": self.original.to_json(),
                "sharded": self.sharded.to_json() if self.sharded else None,
                "saving": self.saving, "error": self.error}


def retarget(module: Module, replicas: int) -> Module:
    """A copy of the per-device data-parallel ``module`` for ``replicas`` devices (see
    :class:`~hlo_shard.passes.retarget.Retarget`)."""
    result = module.clone()
    Retarget(replicas).run(result)
    return result


def per_replica_batch(estimate: StepEstimate, module: Module) -> int:
    """The leading dimension of the module's batch parameters."""
    for name, kind in estimate.parameter_kinds.items():
        shape = module.entry[name].shape
        if kind == "batch" and isinstance(shape, ArrayShape) and shape.dims:
            return shape.dims[0]
    raise HloShardError("cannot tell the per-replica batch (no batch parameter found); "
                        "use --batch-per-replica fixed")


def weight_parameters(estimate: StepEstimate, module: Module) -> int:
    """W₀: the elements of the module's weight parameters (replicated, per device)."""
    return sum(shape.num_elements for name, kind in estimate.parameter_kinds.items()
               if kind == "weights" and isinstance(shape := module.entry[name].shape, ArrayShape))


def _communication_seconds(est: StepEstimate, weight_factor: float) -> float:
    """Collective time with k times the bytes: bandwidth × k, latency once per bucket of
    the combiner's threshold (a bucket's latency is shared among its members by payload)."""
    threshold = est.profile.combine_threshold_bytes
    total = 0.0
    for inst in est.instructions:
        c = inst.collective
        if c is None:
            total += inst.seconds if inst.category == "communication" else 0.0
            continue
        bandwidth = (c.seconds - c.latency_s) * inst.runs
        latency_share = inst.seconds - bandwidth
        bucket_payload = (c.latency_s * inst.runs * c.payload_bytes / latency_share
                          if latency_share > 0 else c.payload_bytes)
        buckets = (max(1, math.ceil(weight_factor * bucket_payload / threshold))
                   / max(1, math.ceil(bucket_payload / threshold)))
        total += latency_share * buckets + bandwidth * weight_factor
    return total


#: Memory categories that grow with the parameters (the rest: batch and activations):
#: liveness's categories (:data:`~hlo_shard.costmodel.memory.CATEGORIES`) — temporaries
#: are the update's and formatting's, outputs not donated are new weights and state.
_PARAMETER_MEMORY = ("weights", "optimizer_state", "gradients", "temporaries", "outputs")


def _projection(est: StepEstimate, batch_factor: float, weight_factor: float = 1.0
                ) -> Projection:
    seconds = est.seconds_by_category()
    seconds["forward_backward"] *= batch_factor * weight_factor
    seconds["weight_update"] *= weight_factor
    seconds["formatting"] *= weight_factor
    seconds["communication"] = _communication_seconds(est, weight_factor)
    memory = est.memory
    factors = {"batch": batch_factor, "activations": batch_factor * weight_factor,
               **{category: weight_factor for category in _PARAMETER_MEMORY}}
    # Arguments and outputs scale where they are; the temp allocation's peak is taken
    # again over the whole step, its categories scaled (a larger batch can make the
    # backward pass's activations the peak where the update's buffers were).
    fixed = {c: b for c, b in memory.peak_breakdown.items() if c not in memory.temp_levels}
    peak = (memory.peak_bytes - memory.temp_bytes
            + sum((factors.get(c, 1.0) - 1) * b for c, b in fixed.items())
            + memory.temp_peak_scaled(factors))
    return Projection(sum(seconds.values()), seconds, peak)


def project(module: Module, replicas: list[int], profile: HardwareProfile, *,
            global_batch: int | None = None, state: str = "sharded", strategy: str = "auto",
            algorithm: str | None = None, parameters: int | None = None,
            roles: Mapping[int, str] | None = None) -> list[ScalePoint]:
    """Step time and peak memory of ``module`` and of its sharded form at each N;
    ``parameters``: of a model of that many weights, scaled analytically; ``roles``: the
    kinds of the entry parameters by number (see :func:`~hlo_shard.costmodel.step_time.
    estimate_step`), for every module projected."""
    n0 = data_parallel_size(module)
    regions = planned_update_regions(module)
    base = estimate_step(module, profile, regions, algorithm=algorithm, roles=roles)
    b0 = per_replica_batch(base, module) if global_batch is not None else None
    weight_factor = 1.0
    if parameters is not None:
        w0 = weight_parameters(base, module)
        if not w0:
            raise HloShardError("--parameters needs a module with weight parameters")
        weight_factor = parameters / w0
    hardware = profile.with_algorithm(algorithm) if algorithm else profile  # what auto buckets for
    points: list[ScalePoint] = []
    for n in replicas:
        if n < 2:
            raise HloShardError(f"--replicas must be at least 2 (got {n})")
        factor = 1.0 if global_batch is None or b0 is None else (global_batch / n) / b0
        target = retarget(module, n) if n != n0 else module.clone()
        # The retargeted copy has the module's instructions: its regions and categories.
        original = _projection(estimate_step(target, profile, regions, algorithm=algorithm,
                                             categories=base.categories, roles=roles),
                               factor, weight_factor)
        try:
            # Every eligible gradient, unpriced: the projection is of the sharded step.
            sharded_module = optimize(target.clone(), ShardingOptions(
                state=state, strategy=strategy, profile=hardware), gate=False).module
        except HloShardError as err:
            points.append(ScalePoint(n, original, None, str(err)))
            continue
        sharded = _projection(estimate_step(sharded_module, profile,
                                            planned_update_regions(sharded_module),
                                            algorithm=algorithm, roles=roles),
                              factor, weight_factor)
        points.append(ScalePoint(n, original, sharded))
    return points

