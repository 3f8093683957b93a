"""Execute HLO modules on N devices through jax's XLA client, and compare them.

The only part of hlo-shard that touches jax/jaxlib private APIs — and it does so in
a child process (:mod:`._child`), so importing this package never imports jax and a
crash inside XLA never kills the caller. Supported: ``jax>=0.10,<0.11``.

Python API (what ``verify``, the benchmarks and the cost report call)::

    from hlo_shard import runtime

    exe = runtime.load("before.hlo", devices=4)       # text, path or Module; backend="cpu"
    outs = exe(w, [g0, g1, g2, g3])                   # replicated w, per-device g
    outs[0][3]                                        # output leaf 0 on device 3 (numpy)
    exe.memory.temp, exe.memory.peak                  # XLA CompiledMemoryStats, per device
    exe.cost["flops"], exe.cost["bytes accessed"]     # hlo_module_cost_analysis (as written)
    exe.compiled_cost                                 # cost_analysis() of the optimized module
    runtime.module_cost("any.hlo")                    # hlo_module_cost_analysis, no compile
    exe.time(w, gs, runs=20).median                   # seconds per step after warm-up
    runtime.time_interleaved([a, b], [args_a, args_b], runs=20)   # A/B/A/B timing

    report = runtime.verify("before.hlo", "after.hlo",
                            runtime.VerifyOptions(steps=3, manifest=runtime.load_manifest(p)))
    report.ok, report.final()                         # per output leaf: LeafComparison

Inputs (:mod:`.inputs`): :func:`parameter_roles`, :func:`generate_inputs`,
:func:`load_npz`. Module forms (:mod:`.forms`): :func:`replica_form`. The manifest
schema written by ``optimize --manifest`` is documented in :mod:`.manifest`.
"""

from hlo_shard.runtime.compare import DEFAULT_TOLERANCES, LeafComparison, Tolerance, compare_leaf
from hlo_shard.runtime.executable import (
    Executable, MemoryStats, Timing, load, module_cost, read_module, time_interleaved,
)
from hlo_shard.runtime.forms import check_executable, replica_form
from hlo_shard.runtime.inputs import (
    PER_DEVICE, REGIMES, REPLICATED, ParameterRole, Regime, default_roles, generate_inputs,
    load_npz, numpy_dtype, parameter_roles, positive_parameters, regime_inputs,
)
from hlo_shard.runtime.manifest import (
    ArrayRecord, Manifest, Shard, gather_value, load_manifest, manifest_to_json,
    parse_manifest, shard_value,
)
from hlo_shard.runtime.verification import (
    ModuleReport, VerifyOptions, VerifyReport, default_feedback, verify,
)
from hlo_shard.runtime.worker import (
    Worker, get_worker, kill_workers, shutdown_workers,
)

__all__ = [
    "ArrayRecord", "DEFAULT_TOLERANCES", "Executable", "LeafComparison", "Manifest",
    "MemoryStats", "ModuleReport", "PER_DEVICE", "ParameterRole", "REGIMES", "REPLICATED",
    "Regime", "Shard",
    "Timing", "Tolerance", "VerifyOptions", "VerifyReport", "Worker", "check_executable",
    "compare_leaf", "default_feedback", "default_roles", "gather_value",
    "generate_inputs", "get_worker", "load", "load_manifest", "load_npz", "manifest_to_json", "module_cost",
    "numpy_dtype", "parameter_roles", "parse_manifest", "positive_parameters", "read_module",
    "regime_inputs", "replica_form", "shard_value", "shutdown_workers", "time_interleaved", "verify",
    "kill_workers",
]
