"""hlo-shard across processes: a worked example on this machine (``make demo-distributed``).

Run without arguments, it plays a two-host cluster on localhost: it starts itself as
2 processes × 4 CPU devices joined by ``jax.distributed`` (coordinator on 127.0.0.1,
gloo collectives between the processes), trains a small MLP with optax Adam for 10
steps through plain ``jax.jit`` and through ``hlo_shard.jax.shard_weight_update``
in each process, prints both loss curves, how far apart they end and the step
times; then it optimizes a fixture with ``hlo-shard optimize`` and verifies it on
the same 2 × 4 devices with ``hlo-shard verify --processes 2``.

Run with ``--coordinator HOST:PORT --num-processes P --process-id I``, it is one
process of such a run: what every host of a real cluster runs, with that cluster's
three values (docs/distributed.md); each process prints its results as one
``RESULT {...}`` line (the tests and ``bench/distributed_bench.py`` read them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "spmd" / "adam.n8.hlo"
MODES = ("jit", "gathered", "sharded", "hook")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cluster = parser.add_argument_group("one process of a run (else: launch a localhost run)")
    cluster.add_argument("--coordinator", help="HOST:PORT of process 0's coordinator")
    cluster.add_argument("--num-processes", type=int, default=1)
    cluster.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--processes", type=int, default=2, help="localhost run: processes")
    parser.add_argument("--devices-per-process", type=int, default=4,
                        help="localhost run: CPU devices per process")
    parser.add_argument("--modes", default="jit,sharded",
                        help=f"training loops to run, from {', '.join(MODES)}")
    parser.add_argument("--strategy", default="auto", help="shard_weight_update's strategy")
    parser.add_argument("--force", action=argparse.BooleanOptionalAction, default=True,
                        help="shard_weight_update(force=...): the demo's MLP is far too small "
                             "for sharding to pay on CPU, so the never-slower gate would run "
                             "plain jit; --no-force shows that fallback")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--resume-at", type=int, default=None, metavar="K",
                        help="sharded mode: before step K, checkpoint round trip (gather_args"
                             " to numpy, back to jax Arrays, shard_args)")
    parser.add_argument("--width", type=int, default=64, help="MLP hidden width")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--rows-per-device", type=int, default=2, help="batch rows per device")
    parser.add_argument("--no-verify", action="store_true",
                        help="localhost run: skip the hlo-shard verify part")
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {', '.join(sorted(unknown))}")
    return args


# ----------------------------------------------------------- one process of the run


def train(args: argparse.Namespace) -> list[dict]:
    """Each mode's 10-step loop from the same start; results as seen by this process."""
    import jax

    if args.num_processes > 1:  # the only line that differs from a one-process program
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes,
                                   process_id=args.process_id)
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import hlo_shard.jax as hsj

    mesh = Mesh(np.array(jax.devices()), ("data",))  # every device of every process
    replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    sizes = [16] + [args.width] * (args.layers - 1) + [4]
    init = np.random.default_rng(0)
    start = {f"l{i}": {"w": (init.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
                       "b": np.zeros(b, np.float32)}
             for i, (a, b) in enumerate(zip(sizes, sizes[1:]))}
    optimizer = optax.adam(1e-2)

    def loss_fn(params, batch):
        x = batch["x"]
        for i in range(len(params)):
            x = x @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"]
            x = jax.nn.gelu(x) if i < len(params) - 1 else x
        return jnp.mean((x - batch["y"]) ** 2)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def place(tree, sharding):
        """Global arrays from this process's part (all of it when replicated)."""
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x),
                            tree)

    rows = args.rows_per_device * len(jax.devices())
    mine = slice(jax.process_index() * rows // jax.process_count(),
                 (jax.process_index() + 1) * rows // jax.process_count())
    results = []
    for mode in args.modes.split(","):
        if mode == "hook":  # no code change: the pass inside XLA's compilation of jit
            hsj.decisions(clear=True)
            hsj.install(strategy=args.strategy, force=args.force)
        step = jax.jit(train_step, donate_argnums=(0, 1))
        if mode in ("gathered", "sharded"):
            step = hsj.shard_weight_update(step, state=mode, strategy=args.strategy,
                                            force=args.force)
        params = place(start, replicated)
        opt_state = place(jax.tree.map(np.asarray, optimizer.init(start)), replicated)
        losses, seconds = [], []
        for number in range(args.steps):
            if mode == "sharded" and number == args.resume_at:
                params, opt_state = checkpoint_round_trip(step, params, opt_state, place,
                                                          replicated)
            data = np.random.default_rng(100 + number)  # the global batch of this step
            batch = {"x": data.normal(size=(rows, 16)).astype(np.float32)[mine],
                     "y": data.normal(size=(rows, 4)).astype(np.float32)[mine]}
            began = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, place(batch, by_rows))
            loss = float(jax.block_until_ready(loss).addressable_data(0))
            seconds.append(time.perf_counter() - began)
            losses.append(loss)
        if mode == "sharded":
            params, opt_state = step.gather_args(params, opt_state)  # full leaves again
        # Replicated leaves: every process holds the full value on its own devices.
        local = [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves((params, opt_state))]
        results.append({"mode": mode, "process": jax.process_index(),
                        "processes": jax.process_count(), "devices": len(jax.devices()),
                        "losses": losses, "first_step_s": seconds[0],
                        "step_s": statistics.median(seconds[1:]) if args.steps > 1 else None,
                        "leaves": [leaf.tolist() for leaf in local],
                        "sharded": (getattr(step, "report", None) or {}).get("sharded")
                        if mode != "hook" else sum(d.changed for d in hsj.decisions()),
                        "hook_reasons": [d.reason for d in hsj.decisions()]
                        if mode == "hook" else [],
                        "fallback": (getattr(step, "report", None) or {}).get("fallback"),
                        "reason": (getattr(step, "report", None) or {}).get("reason")})
        if mode == "hook":
            hsj.uninstall()
    if args.num_processes > 1:
        jax.distributed.shutdown()
    return results


def checkpoint_round_trip(step, params, opt_state, place, replicated):
    """What saving and restoring a checkpoint does in every process: full leaves to
    numpy (replicated, so complete in each process), then back to shards."""
    import jax

    full = step.gather_args(params, opt_state)
    saved = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), full)
    return step.shard_args(*place(saved, replicated))


# --------------------------------------------------------------- the localhost run


def results_of(outputs: list[str]) -> list[dict]:
    """The RESULT lines of every process's stdout."""
    return [json.loads(line[len("RESULT "):]) for out in outputs for line in out.splitlines()
            if line.startswith("RESULT ")]


def max_difference(a: dict, b: dict) -> float:
    """Largest absolute difference between two runs' final parameters and state."""
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)), initial=0.0))
               for x, y in zip(a["leaves"], b["leaves"]))


def demo(args: argparse.Namespace) -> None:
    from hlo_shard.runtime.distributed import launch

    processes, local = args.processes, args.devices_per_process
    print(f"starting {processes} processes x {local} CPU devices (jax.distributed on "
          "127.0.0.1, gloo collectives between processes) ...", flush=True)
    forwarded = ["--modes", args.modes, "--steps", str(args.steps), "--width",
                 str(args.width), "--layers", str(args.layers), "--rows-per-device",
                 str(args.rows_per_device), "--strategy", args.strategy]
    runs = results_of(launch(__file__, forwarded, processes, local, timeout=600))
    by_mode = {r["mode"]: r for r in runs if r["process"] == 0}
    modes = list(by_mode)
    print("step  " + "  ".join(f"loss {m:>9}" for m in modes))
    for number in range(args.steps):
        print(f"{number + 1:>4}  " + "  ".join(f"{by_mode[m]['losses'][number]:14.7f}"
                                            for m in modes))
    reference = by_mode[modes[0]]
    for mode in modes[1:]:
        print(f"{mode} vs {modes[0]}: final parameters and optimizer state differ by at most "
              f"{max_difference(by_mode[mode], reference):.2g}; "
              f"{by_mode[mode]['sharded']} gradient leaves sharded")
    agree = all(max_difference(r, by_mode[r["mode"]]) == 0 for r in runs)
    print(f"all {processes} processes hold the same final values: {agree}")
    if args.steps > 1:
        print("step time (median after the first step): " + ", ".join(
            f"{m} {by_mode[m]['step_s'] * 1e3:.2f} ms" for m in modes))
    if not args.no_verify and FIXTURE.exists():
        verify_fixture(processes, processes * local)


def verify_fixture(processes: int, devices: int) -> None:
    with tempfile.TemporaryDirectory(prefix="hlo-shard-demo-") as folder:
        optimized, manifest = Path(folder) / "adam.opt.hlo", Path(folder) / "adam.opt.json"
        cli = [sys.executable, "-m", "hlo_shard"]
        subprocess.run(cli + ["optimize", str(FIXTURE), "-o", str(optimized), "--state",
                              "sharded", "--manifest", str(manifest)], check=True,
                       capture_output=True)
        command = ["verify", str(FIXTURE.relative_to(ROOT)), str(optimized), "--manifest",
                   str(manifest), "--steps", "3", "--processes", str(processes),
                   "--devices", str(devices), "-q"]
        print("$ hlo-shard " + " ".join(command), flush=True)
        done = subprocess.run(cli + command, cwd=ROOT, capture_output=True, text=True)
        print("\n".join(line for line in done.stdout.splitlines()
                        if line.startswith(("MATCH", "DIFFERENT", "ran in"))) or done.stderr)
        if done.returncode:
            sys.exit(done.returncode)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.coordinator is None:
        demo(args)
        return
    for result in train(args):
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
