"""Small real training programs for the ``hlo_shard.jax`` tests: models (MLP, a
transformer block with LayerNorm and attention, a conv net), real optax optimizers,
and a data-parallel ``jax.jit`` step over a one-axis mesh of N CPU devices.

Importing this module asks jax for 8 CPU devices (``jax_num_cpu_devices``, honoured
before the CPU backend starts; no process-wide ``XLA_FLAGS`` change). Where jax was
already started with fewer, :func:`needs_devices` re-runs the test in a fresh
interpreter instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

DEVICES = 8
AXIS = "data"
ROOT = Path(__file__).resolve().parents[1]

try:
    jax.config.update("jax_num_cpu_devices", DEVICES)
except Exception:  # the backend already started: needs_devices re-runs in a child
    pass


def needs_devices(request) -> bool:
    """True when this process has the devices; else the test ran in a child process
    with them (its failure fails this test) and the caller should return."""
    if len(jax.devices()) >= DEVICES:
        return True
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                      f" --xla_force_host_platform_device_count={DEVICES}"),
               PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          request.node.nodeid], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return False


# ------------------------------------------------------------------------- models


def _dense(key, fan_in, fan_out, dtype=jnp.float32):
    w = jax.random.normal(key, (fan_in, fan_out), dtype) / np.sqrt(fan_in)
    return {"w": w, "b": jnp.zeros((fan_out,), dtype)}


def mlp_params(key, sizes=(32, 64, 64, 8)):
    keys = jax.random.split(key, len(sizes) - 1)
    return {f"l{i}": _dense(k, a, b) for i, (k, a, b) in enumerate(zip(keys, sizes, sizes[1:]))}


def mlp_loss(p, batch):
    x = batch["x"]
    layers = len(p)
    for i in range(layers):
        x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
        if i < layers - 1:
            x = jax.nn.gelu(x)
    return jnp.mean((x - batch["y"]) ** 2)


def mlp_batch(key, rows):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (rows, 32)), "y": jax.random.normal(ky, (rows, 8))}


D_MODEL, HEADS, SEQ = 32, 4, 8


def transformer_params(key):
    k = jax.random.split(key, 5)
    return {"ln1": {"scale": jnp.ones(D_MODEL), "bias": jnp.zeros(D_MODEL)},
            # No qkv bias: the key bias's gradient is exactly zero (softmax is shift
            # invariant), i.e. pure rounding noise that Adam-style updates amplify.
            "qkv": {"w": _dense(k[0], D_MODEL, 3 * D_MODEL)["w"]}, "out": _dense(k[1], D_MODEL, D_MODEL),
            "ln2": {"scale": jnp.ones(D_MODEL), "bias": jnp.zeros(D_MODEL)},
            "ff1": _dense(k[2], D_MODEL, 4 * D_MODEL), "ff2": _dense(k[3], 4 * D_MODEL, D_MODEL),
            "head": _dense(k[4], D_MODEL, 1)}


def _layer_norm(x, p):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def transformer_loss(p, batch):
    x = batch["x"]  # [B, SEQ, D]
    h = _layer_norm(x, p["ln1"])
    q, k, v = jnp.split(h @ p["qkv"]["w"], 3, axis=-1)
    split = lambda t: t.reshape(t.shape[0], SEQ, HEADS, D_MODEL // HEADS)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D_MODEL // HEADS))
    a = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape)
    x = x + a @ p["out"]["w"] + p["out"]["b"]
    h = _layer_norm(x, p["ln2"])
    x = x + jax.nn.gelu(h @ p["ff1"]["w"] + p["ff1"]["b"]) @ p["ff2"]["w"] + p["ff2"]["b"]
    pred = (x.mean(1) @ p["head"]["w"] + p["head"]["b"])[:, 0]
    return jnp.mean((pred - batch["y"]) ** 2)


def transformer_batch(key, rows):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (rows, SEQ, D_MODEL)), "y": jax.random.normal(ky, (rows,))}


def conv_params(key):
    k = jax.random.split(key, 3)
    return {"c1": {"w": jax.random.normal(k[0], (3, 3, 3, 8)) * 0.2, "b": jnp.zeros(8)},
            "c2": {"w": jax.random.normal(k[1], (3, 3, 8, 8)) * 0.1, "b": jnp.zeros(8)},
            "fc": _dense(k[2], 8, 4)}


def conv_loss(p, batch):
    dims = ("NHWC", "HWIO", "NHWC")
    x = batch["x"]
    for name in ("c1", "c2"):
        x = jax.lax.conv_general_dilated(x, p[name]["w"], (1, 1), "SAME",
                                         dimension_numbers=dims) + p[name]["b"]
        x = jax.nn.relu(x)
    logits = x.mean((1, 2)) @ p["fc"]["w"] + p["fc"]["b"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * batch["y"], -1))


def conv_batch(key, rows):
    kx, ky = jax.random.split(key)
    labels = jax.random.randint(ky, (rows,), 0, 4)
    return {"x": jax.random.normal(kx, (rows, 8, 8, 3)), "y": jax.nn.one_hot(labels, 4)}


@dataclass(frozen=True)
class Model:
    params: Callable
    loss: Callable
    batch: Callable


MODELS = {"mlp": Model(mlp_params, mlp_loss, mlp_batch),
          "transformer": Model(transformer_params, transformer_loss, transformer_batch),
          "conv": Model(conv_params, conv_loss, conv_batch)}

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_clip": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "lion": lambda: optax.lion(1e-3),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}


# ------------------------------------------------------------------ the program


@dataclass
class Program:
    """A data-parallel training program on ``n`` devices: params and optimizer state
    replicated, each device 2 examples of the batch."""

    mesh: object
    model: Model
    optimizer: object
    step: Callable  # the jitted step (params, opt_state, batch) -> (params, opt_state, loss)

    @property
    def replicated(self):
        return NamedSharding(self.mesh, P())

    def init(self, seed: int = 0):
        params = jax.device_put(self.model.params(jax.random.PRNGKey(seed)), self.replicated)
        return params, jax.device_put(self.optimizer.init(params), self.replicated)

    def batch(self, i: int):
        rows = 2 * self.mesh.devices.size
        return jax.device_put(self.model.batch(jax.random.PRNGKey(1000 + i), rows),
                              NamedSharding(self.mesh, P(AXIS)))


def make_program(model: str, optimizer: str, n: int, devices=None, donate=True) -> Program:
    devices = list(jax.devices()[:n]) if devices is None else list(devices)
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    spec, opt = MODELS[model], OPTIMIZERS[optimizer]()

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(spec.loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(train_step, donate_argnums=(0, 1) if donate else ())
    return Program(mesh, spec, opt, step)


def train(step, program: Program, steps: int, state=None, first: int = 0):
    """``steps`` steps of ``step`` from ``state`` (default: a fresh init); the final
    (params, opt_state) and the losses as floats."""
    params, opt_state = program.init() if state is None else state
    losses = []
    for i in range(first, first + steps):
        params, opt_state, loss = step(params, opt_state, program.batch(i))
        losses.append(float(loss))
    return (params, opt_state), np.array(losses)


def run_steps(step, state: tuple, batch: Callable, steps: int = 3):
    """``steps`` calls ``step(*state, batch(i))`` whose last output is the loss: the final
    state and the losses (as the step returned them)."""
    losses = []
    for i in range(steps):
        *state, loss = step(*state, batch(i))
        losses.append(loss)
    return tuple(state), losses


def run_forced(step, state: str, init: Callable, batch: Callable, steps: int = 3):
    """:func:`run_steps` of ``shard_weight_update(step, state=state, force=True)`` from a
    fresh ``init()``, a ``FallbackWarning`` raised as an error: the sharded step, the
    final state gathered back to full leaves, and the losses."""
    import warnings

    import hlo_shard.jax as hsj

    fast = hsj.shard_weight_update(step, state=state, force=True)
    start = init()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hsj.FallbackWarning)
        final, losses = run_steps(fast, fast.shard_args(*start, batch(0))[:2], batch, steps)
    if state == "sharded":
        final = fast.gather_args(*final)
    return fast, final, losses


#: Worst relative difference allowed per leaf dtype, |fast - jit| / max|jit| (see
#: docs/jax.md: f32 rounding of a reordered sum, grown over the steps of a run).
BOUNDS = {np.dtype("float32"): 1e-4, np.dtype("int32"): 0.0}


def worst_relative(a, b) -> dict[str, float]:
    """Per leaf (named by its path): max |a - b| / max |b|, in float64 on the host."""
    out = {}
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape, (jax.tree_util.keystr(path), x.shape, y.shape)
        scale = max(np.max(np.abs(y), initial=0.0), 1e-30)
        out[jax.tree_util.keystr(path)] = float(np.max(np.abs(x - y), initial=0.0) / scale)
    return out


def assert_close(fast_tree, jit_tree) -> dict[str, float]:
    worst = worst_relative(fast_tree, jit_tree)
    for (path, leaf) in jax.tree_util.tree_flatten_with_path(jit_tree)[0]:
        name = jax.tree_util.keystr(path)
        bound = BOUNDS.get(np.dtype(leaf.dtype), 1e-4)
        assert worst[name] <= bound, f"{name}: relative difference {worst[name]:.3g} > {bound}"
    return worst


def through_checkpoint(fast, program: Program, full, folder):
    """``full`` (what ``gather_args`` returns) saved with numpy, loaded back, placed as
    the program places its arguments and turned into ``fast``'s shards again: the
    checkpoint round trip a user writes."""
    leaves, treedef = jax.tree.flatten(full)
    np.savez(folder / "ckpt.npz", *[np.asarray(x) for x in leaves])
    with np.load(folder / "ckpt.npz") as saved:
        loaded = [saved[f"arr_{i}"] for i in range(len(leaves))]
    return fast.shard_args(*jax.device_put(jax.tree.unflatten(treedef, loaded),
                                           program.replicated))

