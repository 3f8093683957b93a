"""Step time with ``hlo_shard.jax.install()`` against plain ``jax.jit``, in one process.

Two programs, each as a user writes it: ``jax.jit`` over an 8-device mesh, batch
``P("d")``, params and state replicated, ``donate_argnums=(0, 1)``:

* ``adam-mlp``: the update-heavy model of ``make bench`` (4 layers of 1024×1024 + biases,
  ``optax.adam``, 2 examples per device);
* ``layernorm-mlp``: issue #26's unseen model, the 3-layer LayerNorm MLP of
  ``bench/large_model_bench.py`` 1024 wide, global norm clipping + AdamW, 4 examples per
  device (on XLA:CPU the hook sees it fused: its update, the clipping's norm and the
  gradients' transposes are loop and library fusions by then).

The baseline is compiled before ``install()``, a fresh jit of the same function after it
(the default install, and ``install(force=True)``); the compiled executables are then
timed interleaved (each step's outputs fed back, as a training loop does) in rounds, and
the median round's ratio is the figure. Target: ≤ 0.75, with the fraction of gradient
bytes the hook sharded (goal: all but the scalar loss) and the reduce-scatters in the
hooked executable.

``python bench/hook_bench.py [--program P] [--runs R] [--rounds K]`` prints the JSON
result; :func:`hook_step_time` runs it in a child process (the device count must be set
before jax starts) and prints the human-readable lines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 8
WIDTH, LAYERS, PER_DEVICE = 1024, 4, 2
#: Examples per device of ``layernorm-mlp``.
LAYERNORM_PER_DEVICE = 4
TARGET = 0.75
#: Program → what :func:`hook_step_time` prints it as.
PROGRAMS = {"adam-mlp": f"{LAYERS}x{WIDTH}x{WIDTH} MLP + Adam",
            "layernorm-mlp": f"3x{WIDTH} LayerNorm MLP + clip + AdamW"}


def hook_step_time(runs: int, rounds: int, program: str = "adam-mlp") -> float:
    """Run the measurement in a child; print it; return the median ratio."""
    print(f"\n== step time: hlo_shard.jax.install() vs plain jax.jit, {PROGRAMS[program]}, "
          f"N={DEVICES}, donated, same process", flush=True)
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, __file__, "--program", program, "--runs", str(runs),
                          "--rounds", str(rounds)],
                         env=env, capture_output=True, text=True, check=False, cwd=ROOT)
    if run.returncode != 0:
        sys.exit(f"hook bench failed ({run.returncode}):\n{run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"plain jit {result['plain_ms']:8.1f} ms   hooked {result['hooked_ms']:8.1f} ms   "
          f"measured {result['ratio']:.2f}x (rounds {min(result['rounds']):.2f}-"
          f"{max(result['rounds']):.2f})   gradient bytes sharded "
          f"{result['sharded_bytes']}/{result['gradient_bytes']} (all but "
          f"{result['gradient_bytes'] - result['sharded_bytes']} bytes)   "
          f"losses equal over {result['checked_steps']} steps: {result['same_losses']}   "
          f"reduce-scatters {result['reduce_scatters']}   "
          f"compile {result['plain_compile_s']:.1f} s -> {result['hooked_compile_s']:.1f} s "
          f"(hook {result['hook_s']:.1f} s = read {result['hook_split']['read']:.1f} + pass "
          f"{result['hook_split']['pass']:.1f} + write {result['hook_split']['write']:.1f})")
    print(f"install(force=True) {result['forced_ms']:8.1f} ms   measured "
          f"{result['forced_ratio']:.2f}x   losses equal: {result['forced_same_losses']}")
    return result["ratio"]


def _adam_mlp():
    """(params, optimizer, loss, batch on the host) of ``adam-mlp``."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    rng = np.random.default_rng(0)
    host = {}
    for i in range(LAYERS):
        host[f"w{i}"] = (rng.standard_normal((WIDTH, WIDTH)) * 0.02).astype(np.float32)
        host[f"b{i}"] = np.zeros((WIDTH,), np.float32)
    batch = {name: rng.standard_normal((PER_DEVICE * DEVICES, WIDTH)).astype(np.float32)
             for name in ("x", "y")}

    def loss_fn(p, b):
        h = b["x"]
        for i in range(LAYERS):
            h = h @ p[f"w{i}"] + p[f"b{i}"]
            if i < LAYERS - 1:
                h = jnp.tanh(h)
        return jnp.mean((h - b["y"]) ** 2)

    return host, optax.adam(1e-3), loss_fn, batch


def _layernorm_mlp():
    """(params, optimizer, loss, batch on the host) of ``layernorm-mlp``."""
    import jax
    import numpy as np

    from large_model_bench import _model  # bench/ is on sys.path

    init, loss, optimizer = _model(WIDTH)
    host = jax.tree.map(np.asarray, init(jax.random.PRNGKey(0)))
    rng = np.random.default_rng(0)
    batch = {name: rng.standard_normal((LAYERNORM_PER_DEVICE * DEVICES, WIDTH))
             .astype(np.float32) for name in ("x", "y")}
    return host, optimizer, loss, batch


_BUILDERS = {"adam-mlp": _adam_mlp, "layernorm-mlp": _layernorm_mlp}


def _measure(program: str, runs: int, rounds: int) -> dict:
    import time
    from statistics import median

    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import hlo_shard.jax as hook

    mesh = jax.make_mesh((DEVICES,), ("d",))
    host, opt, loss_fn, host_batch = _BUILDERS[program]()
    host_state = jax.tree.map(np.asarray, opt.init(host))

    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    replicated, batched = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    batch = jax.device_put(host_batch, batched)

    def fresh():
        return [jax.device_put(host, replicated), jax.device_put(host_state, replicated)]

    def compile_step():
        start = time.perf_counter()
        p, s = fresh()
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, batch).compile()
        return compiled, time.perf_counter() - start

    plain, plain_compile = compile_step()
    hook.decisions(clear=True)
    with hook.install():
        hooked, hooked_compile = compile_step()
    made = [d for d in hook.decisions() if d.module.startswith("jit_step")]
    with hook.install(force=True):
        forced, _ = compile_step()

    # The same losses over a few steps (bitwise where XLA compiles the same arithmetic).
    checked = 5
    executables = {"plain": plain, "hooked": hooked, "forced": forced}
    losses = {}
    for name, compiled in executables.items():
        p, s = fresh()
        losses[name] = []
        for _ in range(checked):
            p, s, loss = compiled(p, s, batch)
            losses[name].append(float(loss))

    states = {name: fresh() for name in executables}

    def timed(name: str) -> float:
        p, s = states[name]
        jax.block_until_ready((p, s))
        start = time.perf_counter()
        p, s, loss = executables[name](p, s, batch)
        jax.block_until_ready((p, s, loss))
        states[name] = [p, s]
        return time.perf_counter() - start

    for name in executables:  # warm up
        timed(name)
    per_round: dict[str, list[float]] = {name: [] for name in executables}
    for _ in range(rounds):
        samples: dict[str, list[float]] = {name: [] for name in executables}
        for _ in range(runs):
            for name in executables:  # interleaved
                samples[name].append(timed(name))
        for name in executables:
            per_round[name].append(median(samples[name]))

    def ratios(name: str) -> list[float]:
        return [h / b for h, b in zip(per_round[name], per_round["plain"])]

    return {"program": program, "ratio": median(ratios("hooked")), "rounds": ratios("hooked"),
            "plain_ms": median(per_round["plain"]) * 1e3,
            "hooked_ms": median(per_round["hooked"]) * 1e3,
            "forced_ms": median(per_round["forced"]) * 1e3,
            "forced_ratio": median(ratios("forced")),
            "sharded_bytes": sum(d.sharded_bytes for d in made),
            "gradient_bytes": sum(d.gradient_bytes for d in made),
            "changed": [d.changed for d in made],
            "reduce_scatters": hooked.as_text().count(" reduce-scatter("),
            "same_losses": losses["plain"] == losses["hooked"],
            "forced_same_losses": losses["plain"] == losses["forced"], "checked_steps": checked,
            "plain_compile_s": plain_compile, "hooked_compile_s": hooked_compile,
            "hook_s": sum(d.seconds for d in made),
            "hook_split": {stage: sum(d.split.to_json()[stage] for d in made if d.split)
                           for stage in ("read", "pass", "write")}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", choices=sorted(PROGRAMS), default="adam-mlp")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        sys.exit(f"{TARGET} target measured on {DEVICES} CPU devices: run through "
                 f"hook_step_time() (bench/run.py) or set XLA_FLAGS")
    print(json.dumps(_measure(args.program, args.runs, args.rounds)))
