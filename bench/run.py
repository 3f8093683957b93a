"""``make bench``: every speed and memory target, each next to its reference measured
in the same run, as a ratio.

1. Front end: hlo-shard parse / graph / print throughput against XLA's C++ parser and
   printer on a deep transformer step (SPMD ~4 MB, optimized ~45 MB). Target: ≤ 10×.
2. Step time: the update-heavy model (4 layers of 1024×1024, Adam, 2 examples per
   device) at N = 8 on CPU, optimized / original: both optimized modules verified
   (``hlo-shard verify``), then timed with the original interleaved A/B/C in several
   rounds, next to the cost model's prediction. Target: ≤ 0.70.
3. Memory: per-device XLA compiled memory (argument + output + temp − alias) of the
   same model with ``--state sharded``, Adam over SGD. Target: ≤ 1.3.
4. The pass inside XLA's compilation (``hlo_shard.jax.install()``): the same model as an
   unmodified ``jax.jit`` step, hooked / plain, same process (``bench/hook_bench.py``).
   Target: ≤ 0.75.
5. The model zoo (``bench/zoo.py``): predicted and measured ratios optimized ÷ original
   on models the pass had never seen. Targets: ≤ 1.00 predicted, ≤ 1.05 measured,
   geometric mean ≤ 0.85 at N = 8.
6. ``hlo_shard.jax`` on the bench's models (``bench/jax_models_bench.py``): fast / plain
   jit per model × optimizer × state mode, with a geometric mean per mode (no target;
   ``--only jax-models`` runs just this table).
7. LLM-sized steps (``bench/llm_bench.py``): ``optimize`` on a ~4 MB Llama-style step
   against its own parse + print (target ≤ 5×), and what the pass did on each mesh
   (data-parallel, FSDP, tensor-parallel): sharded, already sharded, kept whole and why;
   the never-slower gate alone on the largest step, guided (at most three cut-offs
   rewritten) against exhaustive (every one, as before) (``--only llm`` runs just this part).
8. Programs written by others (``bench/ecosystem_bench.py``: flax, optax, equinox and
   haiku examples, model code unchanged): per program × mode (``gathered``, ``sharded``,
   the ``install()`` hook, optimizer state by ``NamedSharding``) the step ratio to plain
   jit with its range, memory per device, first call with its split, the decision (no
   target; ``--only ecosystem`` runs just this table).
9. The forms large models train in (``bench/large_model_bench.py``): scan gradient
   accumulation, ``optax.MultiSteps``, (4, 2) data × model and (2, 4) data × fsdp meshes,
   bf16 compute from f32 master weights with ``params="sharded"``: each mode's step and
   state memory (``install()``'s included) against jit and the ``NamedSharding``
   alternative (no target;
   ``--only large-model`` runs just this table).

The optimizations go through the real command line (``hlo-shard optimize`` and
``verify``), as a user would run them; ``--quick`` skips the large front-end files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "bench")]

UPDATE_HEAVY = {"adam": ROOT / "fixtures/spmd/mlp_adam.n8.hlo",
                "sgd": ROOT / "fixtures/spmd/mlp_sgd.n8.hlo"}
#: The cost model's prediction, on this machine's calibrated profile and a generic one.
PREDICTION_PROFILES = ("cpu-local", "cpu-generic")
TARGETS = {"front end": 10.0, "step time, --state gathered": 0.70,
           "step time, --state sharded": 0.70, "memory": 1.3, "step time, install() hook": 0.75,
           "install() hook, LayerNorm MLP": 0.75}
import zoo  # noqa: E402  (bench/ is on sys.path)

TARGETS |= zoo.TARGETS


def hlo_shard(*args: str) -> str:
    """Run the command line; a failure stops the benchmark with its message."""
    run = subprocess.run([sys.executable, "-m", "hlo_shard", *args], cwd=ROOT,
                         capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"hlo-shard {' '.join(args)} failed ({run.returncode}):\n{run.stderr}")
    return run.stdout


def optimize(original: Path, work: Path, state: str) -> tuple[Path, Path]:
    out, manifest = work / f"{original.stem}.{state}.hlo", work / f"{original.stem}.{state}.json"
    hlo_shard("optimize", str(original), "-o", str(out), "--state", state,
              "--manifest", str(manifest))
    return out, manifest


def verify_json(original: Path, candidate: Path, manifest: Path, runs: int) -> dict:
    return json.loads(hlo_shard("verify", str(original), str(candidate), "--manifest",
                                str(manifest), "--time", str(runs), "--json"))


def net_bytes(memory: dict) -> int:
    return (memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
            - memory["alias_bytes"])


def front_end() -> float:
    from bench_models import generate_bench_modules
    from parse_bench import format_rows, run_parse_bench

    print("== front end: parse + print, hlo-shard vs XLA's C++ parser/printer", flush=True)
    # Only the model this part reads (the README's scale input is dumped on request).
    modules = generate_bench_modules(OUT, ("transformer_deep",))
    rows = run_parse_bench([modules["transformer_deep.spmd"],
                            modules["transformer_deep.optimized"]])
    print(format_rows(rows))
    return max(row["ratio"] for row in rows)


def step_time(work: Path, runs: int, rounds: int) -> dict[str, float]:
    """Original, ``--state gathered`` and ``--state sharded`` timed together, interleaved
    A/B/C, in ``rounds`` rounds of ``runs`` steps: the per-round ratios show how much
    the shared machine moved; the median round is the figure."""
    from statistics import median

    from hlo_shard import parse_file, runtime
    from hlo_shard.passes.speed_gate import predicted_step_seconds
    from hlo_shard.profiles import load_profile
    from hlo_shard.runtime.inputs import generate_inputs, parameter_roles

    print("\n== step time: 4x1024x1024 MLP + Adam, 2 examples/device, N=8, CPU", flush=True)
    original = UPDATE_HEAVY["adam"]
    modules = {"original": original}
    for state in ("gathered", "sharded"):
        candidate, manifest = optimize(original, work, state)
        report = verify_json(original, candidate, manifest, runs=0)
        print(f"--state {state:8s} outputs match: {report['match']}", flush=True)
        modules[state] = candidate
    executables = [runtime.load(path, donate=True) for path in modules.values()]  # a training loop
    inputs = [generate_inputs(e.module, parameter_roles(e.module), e.devices)
              for e in executables]
    per_round = {name: [] for name in modules}
    for _ in range(rounds):
        timings = runtime.time_interleaved(executables, inputs, runs=runs)
        for name, timing in zip(modules, timings):
            per_round[name].append(timing.median)
    measured = {}
    for state in ("gathered", "sharded"):
        ratios = [after / before for after, before in zip(per_round[state], per_round["original"])]
        predicted = {name: predicted_step_seconds(parse_file(modules[state]), load_profile(name))
                     / predicted_step_seconds(parse_file(original), load_profile(name))
                     for name in PREDICTION_PROFILES}
        print(f"--state {state:8s} original {median(per_round['original']) * 1e3:8.1f} ms   "
              f"optimized {median(per_round[state]) * 1e3:8.1f} ms   measured "
              f"{median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})   predicted "
              + ", ".join(f"{ratio:.2f}x ({name})" for name, ratio in predicted.items()))
        measured[f"step time, --state {state}"] = median(ratios)
    for executable in executables:
        executable.close()
    return measured


def memory(work: Path) -> float:
    print("\n== memory per device with --state sharded (XLA: argument + output + temp - alias)",
          flush=True)
    figures = {}
    for name, original in UPDATE_HEAVY.items():
        candidate, manifest = optimize(original, work, "sharded")
        report = verify_json(original, candidate, manifest, runs=1)
        figures[name] = (net_bytes(report["original"]["memory_per_device"]),
                         net_bytes(report["candidate"]["memory_per_device"]))
        print(f"{name:5s} original {figures[name][0] / 2**20:8.1f} MiB   sharded "
              f"{figures[name][1] / 2**20:8.1f} MiB   outputs match: {report['match']}")
    ratio = figures["adam"][1] / figures["sgd"][1]
    print(f"Adam / SGD: original {figures['adam'][0] / figures['sgd'][0]:.2f}x, "
          f"sharded {ratio:.2f}x")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the large front-end files")
    parser.add_argument("--runs", type=int, default=10, help="timed steps per module per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--only", choices=("jax-models", "llm", "ecosystem", "large-model"),
                        help="run just this part")
    args = parser.parse_args()
    from ecosystem_bench import ecosystem
    from jax_models_bench import jax_models
    from large_model_bench import large_model
    from llm_bench import TARGETS as LLM_TARGETS, llm_steps

    TARGETS.update(LLM_TARGETS)
    if args.only == "jax-models":
        jax_models()
        return
    if args.only == "llm":
        for name, value in llm_steps().items():
            print(f"{name:27s} {value:6.2f}x   target <= {TARGETS[name]:.2f}x")
        return
    if args.only == "ecosystem":
        ecosystem()
        return
    if args.only == "large-model":
        large_model()
        return
    results = {}
    if not args.quick:
        results["front end"] = front_end()
    with tempfile.TemporaryDirectory(prefix="hlo-shard-bench-") as tmp:
        results |= step_time(Path(tmp), args.runs, args.rounds)
        results["memory"] = memory(Path(tmp))
    from hook_bench import hook_step_time
    results["step time, install() hook"] = hook_step_time(args.runs, args.rounds)
    results["install() hook, LayerNorm MLP"] = hook_step_time(args.runs, args.rounds,
                                                               "layernorm-mlp")
    from distributed_bench import report as distributed_report
    from jax_bench import TARGETS as JAX_TARGETS, jax_training

    TARGETS.update(JAX_TARGETS)
    results |= jax_training(args.runs, args.rounds)
    distributed_report(args.runs)  # 2 processes x 4 devices vs 1 x 8: informative
    results |= zoo.run_zoo()  # 5. the model zoo (bench/zoo.py)
    informative = jax_models()  # 6. hlo_shard.jax per model x optimizer x mode
    results |= llm_steps()  # 7. LLM-sized steps (bench/llm_bench.py)
    ecosystem()  # 8. programs written by others (bench/ecosystem_bench.py): informative
    large_model()  # 9. the forms large models train in (bench/large_model_bench.py)
    print("\n== summary (ratio, target)")
    for name, value in results.items():
        verdict = "ok" if value <= TARGETS[name] else "MISSED"
        print(f"{name:27s} {value:6.2f}x   target <= {TARGETS[name]:.2f}x   {verdict}")
    for name, value in informative.items():
        print(f"{name:27s} {value:6.2f}x   (no target)")


if __name__ == "__main__":
    main()
