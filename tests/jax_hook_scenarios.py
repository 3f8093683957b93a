"""Scenarios for tests/test_jax_hook.py, run in a child process (jax's CPU device count
must be set before jax starts): ``python tests/jax_hook_scenarios.py N STEPS SCENARIO...``
prints one JSON object, scenario → outcome (scenarios: ``jit:<optimizer>`` (the MLP), ``block:<optimizer>``,
``conv:<optimizer>``, ``layernorm:<optimizer>``, ``scan_bf16:<optimizer>``, ``callback:adam``,
``shard_map:adam``, ``pmap:adam``, ``loop:adam``, ``only_other``, ``idempotence``, ``reuse``, ``failure``, ``interrupt``,
``no_gradients``, ``mutant``,
``per_tensor``).

Each training scenario is an unmodified ``jax.jit`` (NamedSharding, donated),
``shard_map`` or ``jax.pmap`` step run STEPS times without the hook and then, on fresh copies of the same
inputs, with ``hlo_shard.jax.install(force=True)`` (these models are too small for sharding
to be predicted faster; the gate itself is tested in test_jax_step); the result records the largest difference of
losses and parameters relative to each tensor's largest magnitude (0.0: bitwise) and what
the hook did with the step's module.
"""

from __future__ import annotations

import json
import os
import re
import sys

N = int(sys.argv[1])
STEPS = int(sys.argv[2])
#: Training scenarios also run the plain step from weights one ulp away
#: (:func:`training`'s ``envelope``): what rounding alone makes of STEPS steps.
ENVELOPE = os.environ.get("SCENARIOS_ENVELOPE") == "1"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import hlo_shard.jax as hook  # noqa: E402
from hlo_shard.jax import hook as hook_module  # noqa: E402

SIZES = (24, 64, 48, 16)
OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_clip": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                      optax.adamw(1e-2, weight_decay=1e-2)),
    "lion": lambda: optax.lion(1e-3),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
}


def init_params() -> dict:
    rng = np.random.default_rng(0)
    params = {}
    for i in range(len(SIZES) - 1):
        params[f"w{i}"] = (rng.standard_normal((SIZES[i], SIZES[i + 1])) * 0.3).astype(np.float32)
        params[f"b{i}"] = np.full((SIZES[i + 1],), 0.01 * (i + 1), np.float32)
    return params


def loss_fn(p, x, y):
    h = x
    for i in range(len(SIZES) - 1):
        h = h @ p[f"w{i}"] + p[f"b{i}"]
        if i < len(SIZES) - 2:
            h = jnp.tanh(h)
    return jnp.mean((h - y) ** 2)


def batch():
    rng = np.random.default_rng(1)
    return (rng.standard_normal((4 * N, SIZES[0])).astype(np.float32),
            rng.standard_normal((4 * N, SIZES[-1])).astype(np.float32))


def host_state(opt, params) -> dict:
    """The optimizer's initial state on the host, made before any install (so installs
    and the caches they clear do not recompile optax's init)."""
    return jax.tree.map(np.asarray, opt.init(params()))


def block_params() -> dict:
    """A transformer block (one head, layer norms, MLP) on 4 tokens of width 6 per row."""
    rng = np.random.default_rng(2)
    d, hidden = 6, 32
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "ln1": (d,), "ln2": (d,),
              "up": (d, hidden), "up_b": (hidden,), "down": (hidden, d)}
    return {k: (rng.standard_normal(v) * (0.2 if len(v) == 2 else 1.0)).astype(np.float32)
            for k, v in shapes.items()}


def _norm(x, scale):
    mean = jnp.mean(x, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5) * scale


def block_loss(p, x, y):
    x = x.reshape(x.shape[0], 4, 6)
    h = _norm(x, p["ln1"])
    scores = jnp.einsum("btd,bsd->bts", h @ p["q"], h @ p["k"]) / 2.0
    x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, axis=-1), h @ p["v"]) @ p["o"]
    x = x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["up"] + p["up_b"]) @ p["down"]
    return jnp.mean((x.reshape(x.shape[0], -1)[:, :y.shape[1]] - y) ** 2)


def conv_params() -> dict:
    rng = np.random.default_rng(3)
    return {"c1": (rng.standard_normal((3, 3, 1, 8)) * 0.3).astype(np.float32),
            "c1_b": np.zeros((8,), np.float32),
            "c2": (rng.standard_normal((3, 3, 8, 4)) * 0.3).astype(np.float32),
            "dense": (rng.standard_normal((4 * 4 * 4, SIZES[-1])) * 0.1).astype(np.float32)}


def conv_loss(p, x, y):
    image = x[:, :16].reshape(-1, 4, 4, 1)
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(image, p["c1"], (1, 1), "SAME", dimension_numbers=dims)
    h = jnp.tanh(h + p["c1_b"])
    h = jax.lax.conv_general_dilated(h, p["c2"], (1, 1), "SAME", dimension_numbers=dims)
    return jnp.mean((h.reshape(h.shape[0], -1) @ p["dense"] - y) ** 2)


#: The LayerNorm MLP's width: wide enough that XLA:CPU sums the clipping's squares in
#: 32×32 tiles (a reduce-window fusion) that the pass runs on the gradients' blocks.
WIDE = 256


def layernorm_params() -> dict:
    rng = np.random.default_rng(4)
    dims = (SIZES[0], WIDE, WIDE, SIZES[-1])
    return {name: value for i in range(3) for name, value in (
        (f"w{i}", (rng.standard_normal(dims[i:i + 2]) / dims[i] ** 0.5).astype(np.float32)),
        (f"b{i}", np.zeros((dims[i + 1],), np.float32)),
        (f"scale{i}", np.ones((dims[i],), np.float32)))}


def layernorm_loss(p, x, y):
    """Issue #26's LayerNorm MLP (layer norm, dense, gelu; three layers)."""
    h = x
    for i in range(3):
        h = jax.nn.gelu(_norm(h, p[f"scale{i}"]) @ p[f"w{i}"] + p[f"b{i}"])
    return jnp.mean((h - y) ** 2)


def scan_params() -> dict:
    """Three stacked layers of width 24 (``scan_layers``' stacked weights, f32)."""
    rng = np.random.default_rng(5)
    width = SIZES[0]
    return {"w": (rng.standard_normal((3, width, width)) / width ** 0.5).astype(np.float32),
            "b": np.zeros((3, width), np.float32),
            "out": (rng.standard_normal((width, SIZES[-1])) * 0.2).astype(np.float32)}


def scan_loss(p, x, y):
    """MaxText's ``scan_layers`` in bf16 compute from f32 weights: a ``lax.scan`` over
    the stacked layers, each weight cast to bf16 where it is used. XLA:CPU sums each
    layer's bf16 gradient in f32 inside the backward loop and rounds it back as it
    writes it into the stacked gradient."""
    def layer(h, wb):
        w, b = wb
        return jnp.tanh(h @ w.astype(jnp.bfloat16) + b.astype(jnp.bfloat16)), None

    h, _ = jax.lax.scan(layer, x.astype(jnp.bfloat16), (p["w"], p["b"]))
    return jnp.mean((h.astype(jnp.float32) @ p["out"] - y) ** 2)


MODELS = {"mlp": (init_params, loss_fn), "block": (block_params, block_loss),
          "conv": (conv_params, conv_loss), "layernorm": (layernorm_params, layernorm_loss),
          "scan_bf16": (scan_params, scan_loss)}


def jit_step(opt, loss_fn=loss_fn):
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss
    return step


def loop_step(opt, loss_fn=loss_fn):
    """Three training steps in one ``fori_loop`` (a ``while`` in one module): the pass
    keeps the state sharded in the loop carry."""
    one = jit_step(opt, loss_fn)

    def step(p, s, x, y):
        def body(_, carry):
            p, s, _ = carry
            return one(p, s, x, y)
        return jax.lax.fori_loop(0, 3, body, (p, s, jnp.float32(0)))
    return step


def shard_map_step(opt, mesh, loss_fn=loss_fn):
    def local(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        g = jax.lax.pmean(g, "d")
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, jax.lax.pmean(loss, "d")
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")),
                         out_specs=(P(), P(), P()), check_vma=False)


def run(step, state0, mesh, params=init_params) -> tuple[list[float], dict]:
    """STEPS steps of a fresh jit of ``step`` from fresh device copies of the inputs."""
    replicated, batched = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    params = jax.device_put(params(), replicated)
    state = jax.device_put(state0, replicated)
    x, y = (jax.device_put(v, batched) for v in batch())
    jitted = jax.jit(step, donate_argnums=(0, 1))
    losses = []
    for _ in range(STEPS):
        params, state, loss = jitted(params, state, x, y)
        losses.append(float(loss))
    return losses, jax.tree.map(np.asarray, params)


def relative_difference(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.max(np.abs(a))), 1e-30)
    return float(np.max(np.abs(a - b))) / scale


def envelope(step, state0, mesh, params0, plain_losses, plain_params) -> dict:
    """How far the plain step's own STEPS steps go from weights each one ulp away: the
    differences rounding alone grows to (an optimizer that normalizes its updates, as
    adafactor does, grows an ulp apart into far more over many steps). A rewrite that
    only sums in another order is held to this, whatever the host's vector width."""
    def nudged():
        return jax.tree.map(lambda a: np.nextafter(a, np.inf, dtype=a.dtype),
                            jax.tree.map(np.asarray, params0()))

    losses, params = run(step, state0, mesh, nudged)
    return {"envelope_loss": relative_difference(plain_losses, losses),
            "envelope_params": max(relative_difference(plain_params[k], params[k])
                                   for k in params)}


def training(name: str, make_step, mesh, model="mlp", **install) -> dict:
    opt = OPTIMIZERS[name]()
    params0, model_loss = MODELS[model]
    step, state0 = make_step(opt, model_loss), host_state(opt, params0)
    plain_losses, plain_params = run(step, state0, mesh, params0)
    hook.decisions(clear=True)
    with hook.install(**{"force": True, **install}):
        losses, params = run(step, state0, mesh, params0)
        texts = [o.sharded.text for o in hook_module._HOOK.outcomes.values() if o.sharded.text]
    steps = [d for d in hook.decisions(clear=True) if d.module.startswith(("jit_step",
                                                                              "jit_local"))]
    return {
        "loss": relative_difference(plain_losses, losses),
        "params": max(relative_difference(plain_params[k], params[k]) for k in params),
        **(envelope(step, state0, mesh, params0, plain_losses, plain_params) if ENVELOPE
           else {}),
        "changed": [d.changed for d in steps],
        "reasons": [d.reason for d in steps],
        "notes": [n for d in steps if d.report for n in d.report.notes],
        "sharded_bytes": sum(d.sharded_bytes for d in steps),
        "gradient_bytes": sum(d.gradient_bytes for d in steps),
        "donation_dropped": [d.donation_dropped for d in steps],
        "losses": losses,
        #: Fusion bodies the pass copied onto blocks (the tiled sums of squares).
        "block_bodies": sum(len(re.findall(r"^%\S+\.block ", text, re.M)) for text in texts),
    }


def callback_training(mesh) -> dict:
    """A step that hands its new weights to ``jax.debug.callback``: forced, the hook
    sharded it and XLA:CPU's devices, waiting in the new all-gathers beside the
    callback, could hold the worker threads it needed (a deadlock, then XLA's abort);
    the module is kept as it is and the callback runs every step."""
    calls: list[float] = []

    def make(opt, model_loss):
        plain = jit_step(opt, model_loss)

        def step(p, s, x, y):
            p, s, loss = plain(p, s, x, y)
            jax.debug.callback(lambda w: calls.append(float(np.asarray(w).sum())), p["w0"])
            return p, s, loss
        return step
    result = training("adam", make, mesh)
    return {**result, "calls": len(calls)}


def pmap_training(mesh) -> dict:
    """flax's ImageNet example's form: a ``jax.pmap`` step with ``lax.pmean`` of the
    gradients, replicated state stacked along a leading device axis, donated. The hook
    sees pmap's module (replicas, no partitions) as XLA compiles it."""
    del mesh
    opt = OPTIMIZERS["adam"]()

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = opt.update(jax.lax.pmean(g, "d"), s, p)
        return optax.apply_updates(p, updates), s, jax.lax.pmean(loss, "d")

    def pmap_run() -> tuple[list[float], dict]:
        stacked = jax.tree.map(lambda a: np.broadcast_to(a, (N, *np.shape(a))),
                               (init_params(), host_state(opt, init_params)))
        params, state = jax.device_put(stacked)
        x, y = (v.reshape(N, -1, v.shape[-1]) for v in batch())
        stepped = jax.pmap(step, axis_name="d", donate_argnums=(0, 1))
        losses = []
        for _ in range(STEPS):
            params, state, loss = stepped(params, state, x, y)
            losses.append(float(loss[0]))
        return losses, jax.tree.map(lambda a: np.asarray(a[0]), params)

    plain_losses, plain_params = pmap_run()
    hook.decisions(clear=True)
    with hook.install(force=True):  # the copies' equality is not in the module
        pmap_run()
    kept = [d for d in hook.decisions(clear=True) if d.gradient_bytes]
    with hook.install(force=True, pmap_replicated=True):
        losses, params = pmap_run()
    # (jax 0.10 compiles a pmap as a jit of a shard_map named after its own wrapper: the
    # step is the module whose gradients are the parameters and the loss)
    step_bytes = sum(a.nbytes for a in init_params().values()) + 4
    steps = [d for d in hook.decisions(clear=True) if d.gradient_bytes == step_bytes]
    return {"loss": relative_difference(plain_losses, losses),
            "params": max(relative_difference(plain_params[k], params[k]) for k in params),
            "changed": [d.changed for d in steps], "reasons": [d.reason for d in steps],
            "sharded_bytes": sum(d.sharded_bytes for d in steps),
            "gradient_bytes": sum(d.gradient_bytes for d in steps),
            "unasked": [(d.changed, d.reason) for d in kept]}


def checked_scan(mesh) -> dict:
    """big_vision's microbatch accumulation under ``shard_map`` with jax's default
    ``check_vma``: the loss and the gradients ``pmean``ed inside a ``lax.scan``. The
    pmeans sum an already summed value again, and XLA's combiner puts each such second
    sum in a tuple with another gradient: moving the first out of the loop took the sum
    the second was planned on (a KeyError inside the pass; the hook kept the step)."""
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def local(w, x):
        def body(acc, microbatch):
            value, g = jax.value_and_grad(loss)(w, microbatch)
            return (acc[0] + jax.lax.pmean(value, "d"), acc[1] + jax.lax.pmean(g, "d")), None
        (value, g), _ = jax.lax.scan(body, (jnp.zeros(()), jnp.zeros_like(w)),
                                     x.reshape(2, -1, x.shape[-1]))
        return w - 0.1 * g, value

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")),
                                 out_specs=(P(), P())), donate_argnums=(0,))
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (32, 64)))
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (8 * N, 32)),
                       NamedSharding(mesh, P("d")))

    def run_once() -> np.ndarray:
        return np.asarray(step(jax.device_put(w, NamedSharding(mesh, P())), x)[0])

    plain = run_once()
    hook.decisions(clear=True)
    with hook.install(force=True):
        hooked = run_once()
    steps = [d for d in hook.decisions(clear=True) if d.gradient_bytes]
    return {"params": relative_difference(plain, hooked),
            "changed": [d.changed for d in steps], "reasons": [d.reason for d in steps]}


def idempotence(mesh) -> dict:
    """install twice / uninstall twice; one registration, one application per module."""
    opt = OPTIMIZERS["adam"]()
    step, state0 = jit_step(opt), host_state(opt, init_params)
    plain, _ = run(step, state0, mesh)
    hook.decisions(clear=True)
    hook.install(force=True)
    hook.install(force=True)
    registered_once = hook_module._HOOK.registered
    losses, _ = run(step, state0, mesh)
    applied = [d for d in hook.decisions(clear=True) if d.module.startswith("jit_step")]
    hook.uninstall()
    hook.uninstall()
    after, _ = run(step, state0, mesh)
    untouched_after = not hook.decisions(clear=True)
    return {"registered_once": registered_once, "applications": len(applied),
            "changed": [d.changed for d in applied],
            "same_losses": losses == plain, "installed_after": hook.installed(),
            "untouched_after_uninstall": untouched_after, "after_losses_equal": after == plain}


def reuse(mesh) -> dict:
    """The same step compiled again in one installation (jax's caches cleared): the hook
    hands XLA the remembered outcome, no second pass; a new installation passes it again."""
    opt = OPTIMIZERS["adam"]()
    step, state0 = jit_step(opt), host_state(opt, init_params)
    plain, _ = run(step, state0, mesh)
    hook.decisions(clear=True)
    losses = []
    for installation in range(2):
        with hook.install(force=True):
            for _ in range(2 - installation):  # (one call site: the same source locations)
                jax.clear_caches()
                losses.append(run(step, state0, mesh)[0])
    steps = [d for d in hook.decisions(clear=True) if d.module.startswith("jit_step")]
    return {"reused": [d.reused for d in steps], "changed": [d.changed for d in steps],
            "same_losses": all(run_losses == plain for run_losses in losses)}


def failure(mesh) -> dict:
    """The pass raising, or producing a module that fails validation: jax compiles the
    original module, the step runs, one log line says why."""
    import logging

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("hlo_shard").addHandler(Collect())
    logging.getLogger("hlo_shard").setLevel(logging.INFO)
    opt = OPTIMIZERS["adam"]()
    step, state0 = jit_step(opt), host_state(opt, init_params)
    plain, _ = run(step, state0, mesh)
    out = {}
    original_shard = hook_module._shard
    import hlo_shard.passes.optimize as optimize_cli
    original_validate = optimize_cli.validate

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    for case, patch in (("exception", lambda: setattr(hook_module, "_shard", broken)),
                        ("invalid", lambda: setattr(optimize_cli, "validate",
                                                    lambda module: ["injected problem"]))):
        records.clear()
        patch()
        try:
            hook.decisions(clear=True)
            with hook.install(force=True):
                losses, _ = run(step, state0, mesh)
        finally:
            hook_module._shard = original_shard
            optimize_cli.validate = original_validate
        steps = [d for d in hook.decisions(clear=True) if d.module.startswith("jit_step")]
        out[case] = {"same_losses": losses == plain, "changed": [d.changed for d in steps],
                     "reasons": [d.reason for d in steps],
                     "log": [r for r in records if "jit_step" in r]}
    return out


#: More Ctrl-Cs a user would press when the first was lost (:func:`interrupt`).
SIGNAL_RETRIES = 4


def interrupt(mesh) -> dict:
    """Ctrl-C while the pass runs inside XLA's compile: a KeyboardInterrupt raised in the
    callback (``raise``: as Python's SIGINT handler raises it there; ``signal``: a real
    SIGINT) comes out of the jit call as KeyboardInterrupt, not XLA's INTERNAL error, and
    the next compile runs the hook as before."""
    import signal

    opt = OPTIMIZERS["adam"]()
    step, state0 = jit_step(opt), host_state(opt, init_params)
    plain, _ = run(step, state0, mesh)
    original_shard = hook_module._shard

    def by_raise(*args, **kwargs):
        raise KeyboardInterrupt

    def by_signal(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return original_shard(*args, **kwargs)

    def interrupted_run(interrupted) -> str:
        raised = ""
        hook_module._shard = interrupted
        try:
            with hook.install(force=True):
                try:
                    run(step, state0, mesh)
                except BaseException as err:  # noqa: BLE001 - what came out is the result
                    raised = type(err).__name__
        finally:
            hook_module._shard = original_shard
        return raised

    out = {}
    for case, interrupted in (("raise", by_raise), ("signal", by_signal)):
        raised = interrupted_run(interrupted)
        for _ in range(SIGNAL_RETRIES if case == "signal" else 0):
            if raised:
                break
            # XLA runs the callback on a thread of its own: Python runs the SIGINT handler
            # in the main thread at its next bytecode once the compile returns, which on a
            # loaded machine can be a finalizer, whose exceptions Python only prints. A
            # user presses Ctrl-C again: one of a few real signals must come out.
            raised = interrupted_run(interrupted)
        hook.decisions(clear=True)
        with hook.install(force=True):
            losses, _ = run(step, state0, mesh)
        changed = [d.changed for d in hook.decisions(clear=True)
                   if d.module.startswith("jit_step")]
        out[case] = {"raised": raised, "pending": hook_module._HOOK.pending is not None,
                     "after_changed": changed, "after_same_losses": losses == plain}
    return out


def no_gradients(mesh) -> dict:
    """An evaluation function and optax init: nothing changed, init never parsed."""
    hook.decisions(clear=True)
    replicated, batched = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    params = jax.device_put(init_params(), replicated)
    x, y = (jax.device_put(v, batched) for v in batch())
    with hook.install(force=True):
        evaluated = float(jax.jit(loss_fn)(params, x, y))
        jax.jit(optax.adam(1e-3).init)(init_params())
    made = hook.decisions(clear=True)
    return {"modules": [d.module for d in made], "changed": [d.changed for d in made],
            "loss": evaluated,
            "direct": hook_module._HOOK.transform(b"\x0a\x03abc") is None}


def mutant(mesh) -> dict:
    """The checker can fail: collectives on blocks along a minor dimension in a laid-out
    module (the bug XLA:CPU turned into a transposed update) must show in the comparison."""
    from hlo_shard.passes.weight_update import emit

    emitter = emit.ShardEmitter
    original = emitter.collective_blocks, emitter.scatters_blocks
    emitter.collective_blocks = lambda self, fmt, shape: emit.uses_blocks(fmt, shape)
    emitter.scatters_blocks = lambda self, value, fmt: \
        emit.uses_blocks(fmt, self.comp[value].shape)
    try:
        return training("adam", jit_step, mesh, strategy="per-tensor")  # one leaf each
    finally:
        emitter.collective_blocks, emitter.scatters_blocks = original


def donation(mesh) -> dict:
    """The aliased bytes of the jitted step's executable, compiled plainly and under the
    hook (which changes it): what ``Decision.donation_dropped`` says of XLA's hook."""
    opt = OPTIMIZERS["adam"]()
    replicated, batched = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    params = jax.device_put(init_params(), replicated)
    state = jax.device_put(host_state(opt, init_params), replicated)
    x, y = (jax.device_put(v, batched) for v in batch())

    def aliased() -> int:
        jitted = jax.jit(jit_step(opt), donate_argnums=(0, 1))
        return jitted.lower(params, state, x, y).compile().memory_analysis().alias_size_in_bytes

    plain = aliased()
    hook.decisions(clear=True)
    with hook.install(force=True):
        hooked = aliased()
    steps = [d for d in hook.decisions(clear=True) if d.module.startswith("jit_step")]
    return {"plain": plain, "hooked": hooked, "changed": [d.changed for d in steps],
            "dropped": [d.donation_dropped for d in steps]}


def main(names: list[str]) -> None:
    mesh = jax.make_mesh((N,), ("d",))
    scenarios = {"idempotence": idempotence, "failure": failure, "no_gradients": no_gradients,
                 "reuse": reuse, "donation": donation,
                 "interrupt": interrupt,
                 "mutant": mutant,
                 "per_tensor": lambda m: training("adam", jit_step, m, strategy="per-tensor"),
                 "shard_map:adam": lambda m: training("adam",
                                                      lambda o, f: shard_map_step(o, m, f), m),
                 "loop:adam": lambda m: training("adam", loop_step, m),
                 "pmap:adam": pmap_training,
                 "callback:adam": callback_training,
                 "checked_scan": checked_scan,
                 "only_other": lambda m: training("adam", jit_step, m, only="^jit_eval"),
                 **{f"jit:{name}": (lambda m, name=name: training(name, jit_step, m))
                    for name in OPTIMIZERS},
                 **{f"{model}:{name}": (lambda m, name=name, model=model:
                                        training(name, jit_step, m, model))
                    for model in ("block", "conv", "layernorm", "scan_bf16")
                    for name in OPTIMIZERS}}
    print(json.dumps({name: scenarios[name](mesh) for name in names}))


if __name__ == "__main__":
    main(sys.argv[3:])
