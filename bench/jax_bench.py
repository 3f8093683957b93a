"""``make bench`` section: a training loop through ``hlo_shard.jax`` against plain
``jax.jit`` and against the alternative a JAX user already has (optimizer state
sharded over the data axis by ``NamedSharding`` in jit's in/out shardings, GSPMD
doing the rest), all in one process, interleaved step by step.

Model: 4 layers of 1024×1024 (+ bias, tanh), Adam, 2 examples per device, N = 8 CPU
devices, params and state donated. Reported as ratios to plain jit measured in the
same run; never asserted. ``python bench/jax_bench.py`` runs it alone.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICES, WIDTH, LAYERS, PER_DEVICE = 8, 1024, 4, 2
TARGETS = {"jax step, gathered": 0.70, "jax step, sharded": 0.55,
           "jax memory, Adam / SGD": 1.15, "jax memory, sharded / jit": 0.5,
           "jax first call / jit": 3.0}


def jax_training(runs: int = 10, rounds: int = 3) -> dict[str, float]:
    """Run the measurement in a child with N CPU devices; print its table, return the
    ratios keyed as in :data:`TARGETS`."""
    print(f"\n== hlo_shard.jax training loop: {LAYERS}x{WIDTH}x{WIDTH} MLP + Adam, "
          f"{PER_DEVICE} examples/device, N={DEVICES}, donated, CPU", flush=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    run = subprocess.run([sys.executable, __file__, "--child", str(runs), str(rounds)],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        sys.exit(f"bench/jax_bench.py failed ({run.returncode}):\n{run.stderr[-4000:]}")
    lines = run.stdout.splitlines()
    print("\n".join(lines[:-1]))
    return json.loads(lines[-1])


# ------------------------------------------------------------------ the child


def _child(runs: int, rounds: int) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import hlo_shard.jax as hsj

    mesh = jax.make_mesh((DEVICES,), ("data",))
    replicated, by_data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def loss(params, batch):
        x = batch["x"]
        for i in range(LAYERS):
            x = jnp.tanh(x @ params[i]["w"] + params[i]["b"])
        return jnp.mean((x - batch["y"]) ** 2)

    def make_step(opt, **jit_kw):
        def train_step(params, opt_state, batch):
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value
        return jax.jit(train_step, donate_argnums=(0, 1), **jit_kw)

    def init(opt, state_sharding=None):
        keys = jax.random.split(jax.random.PRNGKey(0), LAYERS)
        params = jax.device_put([{"w": jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH ** 0.5,
                                  "b": jnp.zeros(WIDTH)} for k in keys], replicated)
        state = opt.init(params)
        return params, jax.device_put(state, state_sharding or replicated)

    rows = PER_DEVICE * DEVICES
    batches = [jax.device_put({"x": jax.random.normal(jax.random.PRNGKey(i), (rows, WIDTH)),
                               "y": jax.random.normal(jax.random.PRNGKey(-i), (rows, WIDTH))},
                              by_data) for i in range(4)]

    def over_data(leaf):
        """MaxText's shard_optimizer_over_data: the first dimension N divides."""
        dims = [i for i, d in enumerate(leaf.shape) if d % DEVICES == 0]
        spec = [None] * leaf.ndim
        if dims:
            spec[dims[0]] = "data"
        return NamedSharding(mesh, P(*spec))

    adam = optax.adam(1e-4)
    jit_step = make_step(adam)
    params0, state0 = init(adam)
    state_shardings = jax.tree.map(over_data, state0)
    alt_step = make_step(adam, in_shardings=(replicated, state_shardings, by_data),
                         out_shardings=(replicated, state_shardings, replicated))
    variants = {"jit": (jit_step, init(adam)),
                "gathered": (hsj.shard_weight_update(jit_step, state="gathered"), init(adam)),
                "sharded": (hsj.shard_weight_update(jit_step, state="sharded"), init(adam)),
                "NamedSharding": (alt_step, init(adam, state_shardings)),
                # for reference: one bucket, whatever auto's cost model would choose
                "sharded/combined": (hsj.shard_weight_update(jit_step, state="sharded",
                                                             strategy="combined"), init(adam))}
    first_call = {}
    carry = {}
    for name, (step, (params, state)) in variants.items():
        started = time.perf_counter()
        params, state, value = step(params, state, batches[0])
        jax.block_until_ready(value)
        first_call[name] = time.perf_counter() - started
        carry[name] = (params, state)
    per_round = {name: [] for name in variants}
    for _ in range(rounds):
        times = {name: [] for name in variants}
        for i in range(runs):
            for name, (step, _) in variants.items():
                params, state = carry[name]
                started = time.perf_counter()
                params, state, value = step(params, state, batches[i % len(batches)])
                jax.block_until_ready((params, state, value))
                times[name].append(time.perf_counter() - started)
                carry[name] = (params, state)
        for name in variants:
            per_round[name].append(statistics.median(times[name]))

    def live_bytes(tree) -> int:
        """Bytes of the loop's arrays on the first device."""
        device = mesh.devices.flat[0]
        return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
                   for shard in leaf.addressable_shards if shard.device == device)

    def net(stats: dict) -> int:
        return (stats["argument_size_in_bytes"] + stats["output_size_in_bytes"]
                + stats["temp_size_in_bytes"] - stats["alias_size_in_bytes"])

    def jit_memory(step, args) -> dict:
        m = step.lower(*args).compile().memory_analysis()
        return {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                "temp_size_in_bytes", "alias_size_in_bytes")}

    sgd = optax.sgd(1e-4)
    sgd_fast = hsj.shard_weight_update(make_step(sgd), state="sharded")
    sgd_carry = sgd_fast(*init(sgd), batches[0])[:2]
    memory = {"jit": (net(jit_memory(jit_step, (*init(adam), batches[0]))), carry["jit"]),
              "sharded": (net(variants["sharded"][0].memory_stats), carry["sharded"]),
              "NamedSharding": (net(jit_memory(alt_step, (*init(adam, state_shardings),
                                                          batches[0]))), carry["NamedSharding"]),
              "sharded SGD": (net(sgd_fast.memory_stats), sgd_carry)}

    base = per_round["jit"]
    for name in ("gathered", "sharded", "sharded/combined"):
        fast = variants[name][0]
        text = fast.hlo_text
        print(f"{name}: strategy {fast.options.strategy}, {fast.report['sharded']} of "
              f"{fast.report['gradients']} gradients sharded, {text.count('reduce-scatter(')} "
              f"reduce-scatter and {text.count('all-gather(')} all-gather in the module")
    print(f"{'variant':16s} {'step ms':>8s} {'/ jit':>6s} {'rounds':>11s} {'first call s':>12s}")
    ratios = {}
    for name in variants:
        r = [a / b for a, b in zip(per_round[name], base)]
        ratios[name] = statistics.median(r)
        print(f"{name:16s} {statistics.median(per_round[name]) * 1e3:8.1f} {ratios[name]:6.2f} "
              f"{min(r):5.2f}-{max(r):4.2f} {first_call[name]:12.2f}")
    print(f"\n{'memory/device':14s} {'compiled MiB':>12s} {'live MiB':>9s}  (compiled: argument "
          "+ output + temp - alias)")
    for name, (compiled, tree) in memory.items():
        print(f"{name:14s} {compiled / 2**20:12.1f} {live_bytes(tree) / 2**20:9.1f}")
    adam_c, adam_tree = memory["sharded"]
    sgd_c, sgd_tree = memory["sharded SGD"]
    jit_c, jit_tree = memory["jit"]
    alt_c, alt_tree = memory["NamedSharding"]
    print(f"sharded Adam / SGD: compiled {adam_c / sgd_c:.2f}x, live "
          f"{live_bytes(adam_tree) / live_bytes(sgd_tree):.2f}x;  sharded / jit Adam: compiled "
          f"{adam_c / jit_c:.2f}x, live {live_bytes(adam_tree) / live_bytes(jit_tree):.2f}x;  "
          f"NamedSharding / jit: compiled {alt_c / jit_c:.2f}x, live "
          f"{live_bytes(alt_tree) / live_bytes(jit_tree):.2f}x")
    print(f"first call (capture + pass + compile) / jit's first call: gathered "
          f"{first_call['gathered'] / first_call['jit']:.2f}x, sharded "
          f"{first_call['sharded'] / first_call['jit']:.2f}x")
    print(json.dumps({
        "jax step, gathered": ratios["gathered"],
        "jax step, sharded": ratios["sharded"],
        "jax memory, Adam / SGD": adam_c / sgd_c,
        "jax memory, sharded / jit": adam_c / jit_c,
        "jax first call / jit": first_call["sharded"] / first_call["jit"]}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        results = jax_training()
        for name, value in results.items():
            target = TARGETS.get(name)
            print(f"{name:40s} {value:6.2f}x" + (f"   target <= {target:.2f}x" if target else ""))
