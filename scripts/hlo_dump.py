"""Dump the per-device HLO of one training step from `fixture_models`, in a fresh process.

XLA reads `--xla_force_host_platform_device_count` and the dump flags once, when the CPU
backend starts, so every (model, N) gets its own child process:

    python3 scripts/hlo_dump.py MODEL N DUMP_DIR

The child lowers and compiles the step from abstract shapes (no computation runs, so the dump
holds exactly one module) and writes `DUMP_DIR/signature.json`: the role, name, per-device
shape and dtype of every entry parameter and output leaf, in entry order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import hashlib
import json
import os
from pathlib import Path
import re
import subprocess
import sys
import time

REPO = Path(__file__).resolve().parent.parent
SPMD_SUFFIX = ".spmd-partitioner.after_call-inliner.before_pipeline-end.txt"
OPTIMIZED_SUFFIX = ".cpu_after_optimizations.txt"
SIGNATURE = "signature.json"


def source_digest(*scripts: str) -> str:
    """Eight hex digits of the sha256 of these ``scripts/`` files' sources: part of a
    cached dump's name, so that a dump written by older generator code is not reused."""
    digest = hashlib.sha256()
    for script in scripts:
        digest.update((REPO / "scripts" / script).read_bytes())
    return digest.hexdigest()[:8]


def xla_flags(num_devices: int, dump_dir: Path) -> str:
    return (f"--xla_force_host_platform_device_count={num_devices} --xla_dump_to={dump_dir} "
            "--xla_dump_hlo_pass_re=spmd-partitioning|call-inliner --xla_dump_large_constants")


@dataclass(frozen=True)
class Dump:
    spmd: Path
    optimized: Path
    signature: dict


def dump_model(name: str, num_devices: int, dump_dir: Path, timeout_s: int = 900,
               stop_after_hlo: bool = False) -> Dump:
    """Run the child for (name, num_devices) and return the two module files it dumped.

    `stop_after_hlo` ends the child (which this function started) as soon as XLA begins
    LLVM code generation (its first `.ll` dump): by then the optimized HLO is written, and
    for very large modules code generation takes most of the time and memory.
    """
    dump_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, XLA_FLAGS=xla_flags(num_devices, dump_dir), JAX_PLATFORMS="cpu")
    log = dump_dir / "child.log"
    with log.open("w") as sink:
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), name,
                                  str(num_devices), str(dump_dir)],
                                 env=env, stdout=sink, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while child.poll() is None:
            if stop_after_hlo and any(p.suffix == ".ll" for p in dump_dir.iterdir()):
                child.kill()
                child.wait()
                break
            if time.monotonic() > deadline:
                child.kill()
                child.wait()
                raise RuntimeError(f"dumping {name} at N={num_devices} timed out")
            time.sleep(0.5)
        else:
            if child.returncode != 0:
                raise RuntimeError(f"dumping {name} at N={num_devices} failed (status "
                                   f"{child.returncode}):\n{log.read_text()[-4000:]}")

    def one(suffix: str) -> Path:
        found = [p for p in dump_dir.iterdir() if p.name.endswith(suffix)]
        if len(found) != 1:
            raise RuntimeError(f"expected one *{suffix} in {dump_dir}, found {len(found)}")
        return found[0]

    signature = json.loads((dump_dir / SIGNATURE).read_text())
    return Dump(spmd=one(SPMD_SUFFIX), optimized=one(OPTIMIZED_SUFFIX), signature=signature)


# ----------------------------------------------------------------------------- child side

def _leaves(tree, role: str, prefix: str, shapes_of) -> list[dict]:
    """One record per pytree leaf, in jit's flattening order (= entry parameter order)."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [{"role": role, "name": prefix + jax.tree_util.keystr(path), **shapes_of(path, leaf)}
            for path, leaf in leaves]


def _describe(leaf, per_device_shape=None) -> dict:
    shape = leaf.shape if per_device_shape is None else per_device_shape
    return {"shape": list(shape), "dtype": str(leaf.dtype)}


def train_step(spec, num_devices: int) -> tuple[Callable, tuple]:
    """``spec``'s data-parallel step on a 1-D mesh of ``num_devices`` (the first ones):
    the ``jax.jit`` function (params, opt_state, batch, rng) -> (params, opt_state,
    loss), and those four arguments as abstract arrays with their shardings (params and
    state replicated, the batch split on the mesh axis). Shared by the dumps and the
    ``hlo_shard.jax`` bench (``bench/jax_models_bench.py``), so both run one program."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from fixture_models import AXIS

    mesh = jax.make_mesh((num_devices,), (AXIS,))
    replicated = NamedSharding(mesh, P())
    loop = spec.loop_steps > 1
    batch_spec = P(None, AXIS) if loop else P(AXIS)
    batch_sharding = NamedSharding(mesh, batch_spec)

    def abstract(shape, dtype, sharding):
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)

    params = {k: abstract(s, d, replicated) for k, (s, d) in spec.params().items()}
    opt = spec.make_optimizer()
    state = jax.tree.map(lambda a: abstract(a.shape, a.dtype, replicated),
                         jax.eval_shape(opt.init, params))

    def global_batch_shape(shape):
        lead = (shape[0] * num_devices,) + tuple(shape[1:])
        return (spec.loop_steps,) + lead if loop else lead

    batch = {k: abstract(global_batch_shape(s), d, batch_sharding)
             for k, (s, d) in spec.batch().items()}

    rng = {"dropout": abstract((2,), "uint32", replicated)} if spec.dropout else {}

    def train_update(p, s, b, r, step_index=None):
        """One optimizer step; inside shard_map the loss is per-device and grads are pmean'd."""
        p_compute = (jax.tree.map(lambda a: a.astype(spec.compute_dtype), p)
                     if spec.compute_dtype else p)
        extra = ()
        if r:  # a different dropout mask on every device (and every loop step)
            key = jax.random.fold_in(r["dropout"], jax.lax.axis_index(AXIS))
            extra = (key if step_index is None else jax.random.fold_in(key, step_index),)
        loss, grads = jax.value_and_grad(spec.loss)(p_compute, b, *extra)
        if spec.style == "shard_map":
            grads, loss = jax.lax.pmean((grads, loss), AXIS)
        grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss.astype(jnp.float32)

    def train_loop(p, s, b, r):
        def body(i, carry):
            p, s, total = carry
            step_batch = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), b)
            p, s, loss = train_update(p, s, step_batch, r, i)
            return p, s, total + loss

        p, s, total = jax.lax.fori_loop(0, spec.loop_steps, body, (p, s, jnp.float32(0)))
        return p, s, total / spec.loop_steps

    step = train_loop if loop else train_update
    step.__name__ = step.__qualname__ = f"{spec.name}_step"
    donate = (0, 1) if spec.donate else ()
    if spec.style == "shard_map":
        step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), batch_spec, P()),
                             out_specs=(P(), P(), P()), check_vma=False)
        jitted = jax.jit(step, donate_argnums=donate, keep_unused=True)
    else:
        jitted = jax.jit(step, out_shardings=replicated, donate_argnums=donate, keep_unused=True)
    return jitted, (params, state, batch, rng)


def build(spec, num_devices: int) -> tuple[Callable[[], object], dict]:
    """(a thunk that lowers + compiles the step, dumping it; the step's signature)."""
    import jax
    import optax

    jax.config.update("jax_hlo_source_file_canonicalization_regex",
                      "^" + re.escape(str(REPO)) + "/")
    jitted, (params, state, batch, rng) = train_step(spec, num_devices)
    loop = spec.loop_steps > 1

    per_device_batch = dict(spec.batch())

    def batch_leaf(path, leaf):
        name = jax.tree_util.keystr(path)[2:-2]
        shape = per_device_batch[name][0]
        out = _describe(leaf, ((spec.loop_steps,) if loop else ()) + tuple(shape))
        if name in spec.batch_int_high:
            out["int_high"] = spec.batch_int_high[name]
        return out

    def replicated_leaf(path, leaf):
        return _describe(leaf)

    loss_leaf = {"role": "loss", "name": "loss", "shape": [], "dtype": "float32"}
    signature = {
        "model": spec.name, "optimizer": spec.optimizer, "num_devices": num_devices,
        "style": spec.style, "donated": spec.donate, "loop_steps": spec.loop_steps,
        "compute_dtype": spec.compute_dtype, "notes": spec.notes,
        "jax_version": jax.__version__, "optax_version": optax.__version__,
        "parameters": (_leaves(params, "weight", "params", replicated_leaf)
                       + _leaves(state, "optimizer_state", "opt_state", replicated_leaf)
                       + _leaves(batch, "batch", "batch", batch_leaf)
                       + _leaves(rng, "rng", "rng", replicated_leaf)),
        "outputs": (_leaves(params, "weight", "params", replicated_leaf)
                    + _leaves(state, "optimizer_state", "opt_state", replicated_leaf)
                    + [loss_leaf]),
    }
    return (lambda: jitted.lower(params, state, batch, rng).compile()), signature


def main(argv: list[str]) -> None:
    name, num_devices, dump_dir = argv[0], int(argv[1]), Path(argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fixture_models import ALL_MODELS
    from zoo_models import ZOO_MODELS

    compile_step, signature = build((ALL_MODELS | ZOO_MODELS)[name], num_devices)
    (dump_dir / SIGNATURE).write_text(json.dumps(signature, indent=1))
    compile_step()


if __name__ == "__main__":
    main(sys.argv[1:])
