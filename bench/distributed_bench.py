"""What CPU collectives across processes cost: the same step on 8 CPU devices in one
process and in 2 ``jax.distributed`` processes × 4 (gloo over loopback TCP between
the processes, XLA:CPU's in-process rendezvous within one), as a ratio.

1. Modules: the update-heavy MLP + Adam (4 × 1024², 2 examples per device, N = 8)
   as jax wrote it (one gradient all-reduce) and optimized with ``--state sharded``
   (reduce-scatter + all-gather), each timed in one process (``runtime.load``) and on
   a :class:`~hlo_shard.runtime.distributed.DistributedWorker` (the slowest process's
   time per step: a collective step ends when its last process does).
2. Training loop: ``scripts/demo_distributed.py``'s MLP through ``jax.jit`` and
   ``hlo_shard.jax`` (``state="sharded"``), median step time in each layout.

Run by ``bench/run.py``; alone: ``python bench/distributed_bench.py [--runs R]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

MODULE = ROOT / "fixtures/spmd/mlp_adam.n8.hlo"
DEVICES, PROCESSES = 8, 2
#: The training loop's model: big enough that a step is not only dispatch.
LOOP_ARGS = ["--modes", "jit,sharded", "--steps", "12", "--width", "512", "--layers", "4"]


def _modules(work: Path) -> dict[str, Path]:
    optimized = work / "mlp_adam.sharded.hlo"
    subprocess.run([sys.executable, "-m", "hlo_shard", "optimize", str(MODULE), "-o",
                    str(optimized), "--state", "sharded"], cwd=ROOT, check=True,
                   capture_output=True)
    return {"original (all-reduce)": MODULE, "sharded (reduce-scatter + all-gather)": optimized}


def module_times(runs: int) -> dict[str, tuple[float, float]]:
    """Per module: (median step seconds in 1 process, in PROCESSES processes)."""
    from hlo_shard import runtime
    from hlo_shard.runtime.distributed import DistributedWorker
    from hlo_shard.runtime.inputs import generate_inputs, parameter_roles

    with tempfile.TemporaryDirectory(prefix="hlo-shard-bench-distributed-") as folder:
        modules = _modules(Path(folder))
        layouts = {}
        single = [runtime.load(path, DEVICES) for path in modules.values()]
        inputs = [generate_inputs(e.module, parameter_roles(e.module), e.devices)
                  for e in single]
        layouts["one"] = runtime.time_interleaved(single, inputs, runs)
        for executable in single:
            executable.close()
        with DistributedWorker(PROCESSES, DEVICES) as worker:
            multi = [runtime.load(path, worker=worker) for path in modules.values()]
            layouts["many"] = runtime.time_interleaved(multi, inputs, runs)
    return {name: (one.median, many.median)
            for name, one, many in zip(modules, layouts["one"], layouts["many"])}


def loop_times() -> dict[str, tuple[float, float]]:
    """Per training mode: (median step seconds in 1 process, in PROCESSES processes)."""
    import demo_distributed as demo
    from hlo_shard.runtime.distributed import launch

    layouts = []
    for processes in (1, PROCESSES):
        runs = demo.results_of(launch(demo.__file__, LOOP_ARGS, processes,
                                      DEVICES // processes, timeout=600))
        layouts.append({r["mode"]: r["step_s"] for r in runs if r["process"] == 0})
    return {mode: (layouts[0][mode], layouts[1][mode]) for mode in layouts[0]}


def report(runs: int = 10) -> None:
    print(f"\n== step time across processes: {PROCESSES} jax.distributed processes x "
          f"{DEVICES // PROCESSES} CPU devices vs 1 process x {DEVICES} (gloo over loopback "
          "vs in-process collectives)", flush=True)
    rows = []
    if MODULE.exists():
        rows += [(f"module {name}", times) for name, times in module_times(runs).items()]
    if importlib.util.find_spec("hlo_shard.jax") is not None:
        rows += [(f"training loop, {mode}", times) for mode, times in loop_times().items()]
    width = max(len(name) for name, _ in rows) if rows else 0
    for name, (one, many) in rows:
        print(f"{name:{width}s}  1 process {one * 1e3:8.1f} ms   {PROCESSES} processes "
              f"{many * 1e3:8.1f} ms   {many / one:5.2f}x", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="timed steps per module")
    report(parser.parse_args().runs)
