"""``hlo_shard.jax.ShardedStep`` behaviours beyond matching jit's numbers: checkpoints,
device order, donation, jit's argument handling, the fallback and user errors."""

from __future__ import annotations

import re
import sys
import warnings
from functools import partial

import numpy as np
import pytest

from jax_train_helpers import (AXIS, assert_close, jax, make_program, mlp_loss, needs_devices,
                               optax, run_steps, through_checkpoint, train)

import hlo_shard.jax as hsj
from hlo_shard import optimize
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update import ShardingOptions

jnp = jax.numpy
P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding


def test_checkpoint_round_trip_continues_the_same_trajectory(request, tmp_path):
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 4)
    fast = hsj.shard_weight_update(program.step, state="sharded", force=True)
    (p_ref, s_ref), l_ref = train(fast, program, 6)
    (p, s), l_first = train(fast, program, 3)
    full = fast.gather_args(p, s)
    p, s = through_checkpoint(fast, program, full, tmp_path)
    assert s[0].mu["l0"]["w"].shape == (32 * 64,)  # shard form
    (p, s), l_second = train(fast, program, 3, state=(p, s), first=3)
    np.testing.assert_array_equal(np.concatenate([l_first, l_second]), l_ref)
    for a, b in zip(jax.tree.leaves(fast.gather_args(p, s)), jax.tree.leaves(
            fast.gather_args(p_ref, s_ref))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_mesh_order_decides_the_shard_indices(request):
    if not needs_devices(request):
        return
    devices = [jax.devices()[i] for i in (2, 0, 3, 1)]
    program = make_program("mlp", "adam", 4, devices=devices)
    fast = hsj.shard_weight_update(program.step, state="sharded", force=True)
    (p, s), losses = train(fast, program, 5)
    mu = s[0].mu["l0"]["w"]
    assert [shard.device for shard in sorted(mu.addressable_shards,
                                             key=lambda x: x.index[0].start)] == devices
    (p_jit, s_jit), l_jit = train(program.step, program, 5)
    np.testing.assert_allclose(losses, l_jit, rtol=1e-5)
    assert_close(fast.gather_args(p, s), (p_jit, s_jit))
    # chunk k of the flattened full leaf lives on the mesh's k-th device
    full = np.asarray(fast.gather_args(p, s)[1][0].mu["l0"]["w"]).ravel()
    chunk = len(full) // 4
    for k, device in enumerate(devices):
        piece = next(x for x in mu.addressable_shards if x.device == device)
        np.testing.assert_array_equal(np.asarray(piece.data), full[k * chunk:(k + 1) * chunk])


@pytest.mark.parametrize("donate", [True, False])
def test_donated_arguments_are_consumed_as_by_jit(request, donate):
    if not needs_devices(request):
        return
    program = make_program("mlp", "sgd_momentum", 2, donate=donate)
    fast = hsj.shard_weight_update(program.step, state="gathered", force=True)
    params, opt_state = program.init()
    batch = program.batch(0)
    fast(params, opt_state, batch)
    assert all(x.is_deleted() == donate for x in jax.tree.leaves((params, opt_state)))
    assert not any(x.is_deleted() for x in jax.tree.leaves(batch))


@pytest.mark.parametrize("state, donate", [("gathered", False), ("sharded", False),
                                           ("sharded", True)])
def test_the_wrapper_keeps_no_array_of_the_loop_alive(request, state, donate):
    """Once the loop drops its params, optimizer state and batches, nothing holds them:
    the wrapper kept the first call's arguments (for its report's names) and the latest
    state outputs, so an undonated loop held a second copy of its state, and
    ``state="sharded"`` the whole initial optimizer state, for good (a probe's loop)."""
    if not needs_devices(request):
        return
    import gc
    import weakref

    program = make_program("mlp", "adam", 4, donate=donate)
    fast = hsj.shard_weight_update(program.step, state=state, force=True)
    params, opt_state = program.init()
    arrays = [weakref.ref(x) for x in jax.tree.leaves((params, opt_state))]
    for i in range(3):
        batch = program.batch(i)
        arrays += [weakref.ref(x) for x in jax.tree.leaves(batch)]
        params, opt_state, loss = fast(params, opt_state, batch)
        arrays += [weakref.ref(x) for x in jax.tree.leaves((params, opt_state, loss))]
    assert fast.report is not None and fast.report["sharded"]
    del params, opt_state, loss, batch
    gc.collect()
    assert [ref() for ref in arrays if ref() is not None] == []


def test_static_arguments_pruned_arguments_and_deep_pytrees(request):
    if not needs_devices(request):
        return
    mesh = jax.make_mesh((4,), (AXIS,), devices=jax.devices()[:4])
    replicated, by_data = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    opt = optax.adam(1e-2)

    def loss(params, x, power):
        (w1, (w2,)) = params["a"]["b"]["c"]
        return jnp.mean((jnp.tanh(x @ w1) @ w2) ** power)

    def step(params, unused, opt_state, x, power, *, scale):
        grads = jax.grad(loss)(params, x, power)
        updates, opt_state = opt.update(jax.tree.map(lambda g: g * scale, grads), opt_state)
        return optax.apply_updates(params, updates), opt_state

    jitted = jax.jit(step, static_argnums=(4,), static_argnames=("scale",),
                     donate_argnums=(0, 2))
    key = jax.random.PRNGKey(0)

    def run(fn, steps=3):
        p = jax.device_put({"a": {"b": {"c": [jax.random.normal(key, (16, 32)) * 0.3,
                                              (jax.random.normal(key, (32, 4)) * 0.3,)]}}},
                           replicated)
        s = jax.device_put(opt.init(p), replicated)
        for i in range(steps):
            x = jax.device_put(jax.random.normal(jax.random.PRNGKey(i), (8, 16)), by_data)
            p, s = fn(p, {"junk": jnp.ones(3)}, s, x, 2, scale=0.5)
        return p, s

    fast = hsj.shard_weight_update(jitted, force=True)
    result = run(fast)
    assert fast.report["sharded"] >= 2
    assert_close(result, run(jitted))
    names = [entry["name"] for entry in fast.report["parameters"]]
    assert "params['a']['b']['c'][1][0]" in names and "unused['junk']" not in names


def test_report_names_leaves_by_their_paths(request):
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2)
    fast = hsj.shard_weight_update(program.step, state="sharded", force=True)
    train(fast, program, 1)
    kinds = {entry["name"]: entry["kind"] for entry in fast.report["parameters"]}
    assert kinds["params['l0']['w']"] == "replicated"
    assert kinds["opt_state[0].mu['l0']['w']"] == "sharded"
    assert kinds["batch['x']"] == "per-device"
    gradients = {row["gradient_of"] for row in fast.report["explanations"] if row["sharded"]}
    assert {"params['l0']['w']", "params['l2']['b']"} <= gradients
    assert "reduce-scatter" in fast.hlo_text and "reduce-scatter" not in fast.original_hlo_text
    parse(fast.hlo_text)


def test_what_it_cannot_shard_runs_fn_with_one_warning(request):
    if not needs_devices(request):
        return
    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2])
    step = jax.jit(lambda w, x: (w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)))
    w = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((2, 4)), NamedSharding(mesh, P()))  # no data axis
    fast = hsj.shard_weight_update(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [fast(w, x) for _ in range(3)]
    fallbacks = _fallbacks(caught)
    assert len(fallbacks) == 1 and "nothing to shard" in str(fallbacks[0])
    assert fallbacks[0].code == fast.report["fallback"] == "nothing_to_shard"
    np.testing.assert_array_equal(np.asarray(outs[-1]), np.asarray(step(w, x)))


def _backend_compiles(run) -> list[float]:
    """The seconds of every XLA compile jax records while ``run()`` runs."""
    import jax.monitoring

    compiles = []

    def count(event: str, duration_secs: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        run()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    return compiles


def test_a_fallback_compiles_jits_executable_once_from_the_captures_lowering(request):
    """Where ``fast`` runs ``fn``, it runs jit's executable of its capture's lowering:
    the capture's compile stopped once the step was partitioned (XLA:CPU), the fallback
    compiles the step once to the end, and jit does not lower or compile it again
    (static and keyword arguments handed as jit hands them); the report splits the
    first call's seconds by stage, that compile in ``compile``."""
    if not needs_devices(request):
        return
    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2])

    def step(w, scale, x, *, shift):
        return w - scale * jax.grad(lambda w: jnp.sum((x @ w + shift) ** 2))(w)

    jitted = jax.jit(step, static_argnums=1, donate_argnums=0)
    w, x = (jax.device_put(jnp.ones(shape), NamedSharding(mesh, P())) for shape in
            ((4, 4), (2, 4)))  # no data axis: nothing to shard
    shift = jax.device_put(jnp.float32(0.5), NamedSharding(mesh, P()))
    fast = hsj.shard_weight_update(jitted)
    copies = [jnp.array(w) for _ in range(3)]
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiles = _backend_compiles(
            lambda: outs.extend(fast(copy, 0.1, x, shift=shift) for copy in copies))
    assert [f.code for f in _fallbacks(caught)] == ["nothing_to_shard"]
    assert len(compiles) == 2  # the capture's, stopped, and the fallback's: not jit's again
    assert all(copy.is_deleted() for copy in copies)  # donated, as jit donates them
    np.testing.assert_array_equal(np.asarray(outs[0]),
                                  np.asarray(jitted(jnp.array(w), 0.1, x, shift=shift)))
    seconds = fast.report["seconds"]
    assert seconds["capture"] > 0 and seconds["pass"] > 0 and seconds["compile"] > 0


@pytest.mark.parametrize("case", ["one device", "host callback"])
def test_a_step_it_cannot_capture_is_compiled_once(request, case):
    """One device (XLA partitions nothing: no module to read) runs the executable the
    capture compiled; a host callback is refused from the lowering, before compiling,
    and jit compiles the step once."""
    if not needs_devices(request):
        return
    devices = jax.devices()[:1 if case == "one device" else 2]
    placed = NamedSharding(jax.make_mesh((len(devices),), (AXIS,), devices=devices), P())

    def step(w, x):
        if case == "host callback":
            jax.debug.callback(lambda value: None, x[0, 0])
        return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    jitted = jax.jit(step)
    w, x = (jax.device_put(jnp.ones(shape), placed) for shape in ((4, 4), (2, 4)))
    fast = hsj.shard_weight_update(jitted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiles = _backend_compiles(lambda: [fast(w, x) for _ in range(2)])
    assert [f.code for f in _fallbacks(caught)] == ["unsupported_step"]
    if case == "host callback":  # what it is, and what to do
        assert "jax.debug.print" in str(_fallbacks(caught)[0])
        assert "install()" in str(_fallbacks(caught)[0])
    assert len(compiles) == 1
    np.testing.assert_array_equal(np.asarray(fast(w, x)), np.asarray(jitted(w, x)))


def test_a_step_predicted_slower_runs_fn_with_both_estimates(request):
    """The never-slower gate of ``optimize``: a small model (sharding predicted slower
    on cpu-local) runs ``fn``, one warning naming both estimates; ``force`` shards it."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2, donate=False)
    fast = hsj.shard_weight_update(program.step)
    params, opt_state = program.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [fast(params, opt_state, program.batch(k)) for k in range(2)]
    fallbacks = _fallbacks(caught)
    assert len(fallbacks) == 1 and fallbacks[0].code == "not_faster"
    assert "not predicted at least 10% faster on profile cpu-local" in str(fallbacks[0])
    # the gate's estimates are predictions: the warning gives their ratio, not times
    assert re.search(r"predicted \d+\.\d{2,4}x the step as it is", str(fallbacks[0]))
    assert " ms" not in str(fallbacks[0])
    report = fast.report  # exists after a fallback: the code and the gate's estimates
    assert report["fallback"] == "not_faster" and report["sharded"] == 0
    gate = report["speed"]
    assert gate["kept_whole"] and gate["before_seconds"] > 0 and gate["predicted_ratio"] > 0.9
    assert report["gradients"] >= 1
    # each row still says whose gradient it is (the weight's path), kept whole for speed
    named = {row["gradient_of"] for row in report["explanations"]
             if row["reason_code"] == "kept_for_speed"}
    assert named == {f"params['l{i}']['{leaf}']" for i in range(3) for leaf in "wb"}, named
    assert_close(outs[-1], program.step(params, opt_state, program.batch(1)))
    forced = hsj.shard_weight_update(program.step, force=True)
    forced(params, opt_state, program.batch(0))
    assert forced.report["sharded"] >= 1 and forced.report["fallback"] is None
    assert forced.report["speed"]["forced"]
    assert all(forced.report["seconds"][stage] > 0 for stage in ("capture", "pass", "compile"))


def test_the_warning_points_at_the_users_line(request):
    """The fallback's warning is attributed to the line that called the step (not to a
    frame of hlo_shard's), as a user's ``-W error`` filter by module expects."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2, donate=False)
    fast = hsj.shard_weight_update(program.step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast(*program.init(), program.batch(0))
    assert [(w.filename, w.lineno) for w in caught
            if issubclass(w.category, hsj.FallbackWarning)] == \
        [(__file__, sys._getframe().f_lineno - 3)]


@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_a_jitted_method_of_a_trainer_class(request, state):
    """The Trainer-class pattern, ``@partial(jax.jit, static_argnums=0)`` on a method:
    jit counts the instance as argument 0, the user's calls (the step's, shard_args',
    gather_args') do not; the step's outputs feed its arguments after the instance."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2)

    class Trainer:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
        def train_step(self, params, opt_state, batch):
            loss, grads = jax.value_and_grad(program.model.loss)(params, batch)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    trainer = Trainer(program.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hsj.FallbackWarning)
        fast = hsj.shard_weight_update(trainer.train_step, state=state, force=True)
        (params, opt_state), losses = train(fast, program, 3)
    assert fast.report["sharded"] >= 2
    (p_jit, s_jit), l_jit = train(program.step, program, 3)
    np.testing.assert_allclose(losses, l_jit, rtol=1e-5)
    assert_close(fast.gather_args(params, opt_state), (p_jit, s_jit))
    if state == "sharded":
        assert opt_state[0].mu["l0"]["w"].shape == (32 * 64,)  # carried as shards
        full = program.init()
        assert_close(fast.gather_args(*fast.shard_args(*full)), full)


def test_a_step_called_inside_a_transformation_is_traced_as_jits(request):
    """``fast`` inside an outer ``jax.jit``, a ``lax.scan`` of steps or ``eval_shape``
    (tracers, no arrays to run an executable on) traces the original step, with one
    warning at the user's line; it raised jax's "Cannot apply JAX transformations to a
    function lowered and compiled" before."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2, donate=False)
    fast = hsj.shard_weight_update(program.step, force=True)
    params, opt_state = program.init()
    fast(params, opt_state, program.batch(0))  # sharded from Python
    assert fast.report["sharded"] >= 2
    batches = jax.tree.map(lambda *b: jnp.stack(b), program.batch(1), program.batch(2))

    def steps(step):
        def body(state, batch):
            p, s, loss = step(*state, batch)
            return (p, s), loss
        return jax.jit(lambda p, s, b: jax.lax.scan(body, (p, s), b))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (p, s), losses = steps(fast)(params, opt_state, batches)
        shapes = jax.eval_shape(fast, params, opt_state, program.batch(1))
    (p_jit, s_jit), l_jit = steps(program.step)(params, opt_state, batches)
    np.testing.assert_array_equal(np.asarray(losses), np.asarray(l_jit))
    assert_close((p, s), (p_jit, s_jit))
    assert shapes[0]["l0"]["w"].shape == params["l0"]["w"].shape
    (warning,) = _fallbacks(caught)
    assert "inside a jax transformation" in str(warning) and warning.code == "unsupported_step"
    assert [w.filename for w in caught if w.category is hsj.FallbackWarning] == [__file__]


def test_shard_args_before_any_step_says_to_pass_the_batch(request):
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2)
    fast = hsj.shard_weight_update(program.step, state="sharded", force=True)
    with pytest.raises(TypeError, match="batch") as info:
        fast.shard_args(*program.init())
    assert any("pass all of them, the batch too" in note
               for note in getattr(info.value, "__notes__", ["pass all of them, the batch too"]))
    params, opt_state = fast.shard_args(*program.init(), program.batch(0))[:2]
    assert opt_state[0].mu["l0"]["w"].shape == (32 * 64,)


def test_an_unhashable_static_argument_is_jits_error():
    f = jax.jit(lambda w, config: w * config["scale"], static_argnums=1)
    with pytest.raises(ValueError, match="Non-hashable static arguments"):
        hsj.shard_weight_update(f)(jnp.ones(3), {"scale": 2.0})


def test_a_gradient_from_a_dot_is_scattered_flat_not_in_minor_blocks(request):
    """jit's per-device module all-reduces ``dot`` results laid out {1,0} whose shard
    blocks run along dimension 1: a block reduce-scatter there made XLA:CPU compute the
    dot transposed without its library kernel (the bench MLP: 0.90x of jit's step per
    tensor, 0.13x flat), so each is flattened (transpose + reshape, absorbed by XLA)."""
    if not needs_devices(request):
        return
    from hlo_shard.passes.sharding_pipeline import run_sharding
    from hlo_shard.passes.weight_update import ShardingOptions, WeightUpdateSharding

    program = make_program("mlp", "adam", 2, donate=False)
    params, opt_state = program.init()
    module = parse(hsj.per_device_hlo(program.step, params, opt_state, program.batch(0)))
    run_sharding(module, WeightUpdateSharding(ShardingOptions(state="sharded",
                                                              strategy="per-tensor")))
    scattered = [module.entry[inst.operands[0]] for inst in module.entry.instructions
                 if inst.opcode == "reduce-scatter"]
    assert len(scattered) >= 4 and not [o.name for o in scattered if o.opcode == "dot"]
    assert any(o.opcode == "reshape" and module.entry[o.operands[0]].opcode == "transpose"
               for o in scattered)


def test_a_wrong_argument_is_named_in_the_error(request):
    if not needs_devices(request):
        return
    program = make_program("mlp", "sgd_momentum", 2, donate=False)
    fast = hsj.shard_weight_update(program.step, force=True)
    params, opt_state = program.init()
    fast(params, opt_state, program.batch(0))
    bad = jax.tree.map(lambda x: x, params)
    bad["l1"]["w"] = bad["l1"]["w"][:, :3]
    with pytest.raises(Exception) as raised:
        fast(bad, opt_state, program.batch(1))
    assert "params['l1']['w'] is float32[64, 3], was float32[64, 64]" in \
        "\n".join(getattr(raised.value, "__notes__", []))


def test_shards_given_to_a_step_that_has_not_run_say_to_gather_them(request):
    """Another wrapper's weight and state shards (a restored checkpoint of them, a
    fine-tuning step after a pretraining one) met the user's function as they were: a
    bare shape error from inside it (a probe)."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2, donate=False)
    pretrain = hsj.shard_weight_update(program.step, state="sharded", params="sharded",
                                       force=True)
    params, opt_state, _ = pretrain(*program.init(), program.batch(0))
    finetune = hsj.shard_weight_update(program.step, state="sharded", params="sharded",
                                       force=True)
    with pytest.raises(Exception) as raised:
        finetune(params, opt_state, program.batch(1))
    assert "go through that wrapper's gather_args first" in \
        "\n".join(getattr(raised.value, "__notes__", []))
    finetune(*pretrain.gather_args(params, opt_state), program.batch(1))


def test_per_device_hlo_is_the_partitioned_module(request):
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2)
    params, opt_state = program.init()
    text = hsj.per_device_hlo(program.step, params, opt_state, program.batch(0))
    module = parse(text)
    assert module.num_partitions == 2
    assert any(inst.opcode == "all-reduce" for inst in module.entry.instructions)


def test_state_jit_donates_without_an_output_sharding_is_paired_by_dependence(request):
    """``jax.jit(step, donate_argnums=(0, 1), out_shardings=(rep, None, rep))``: jit
    aliases the weights (their output sharding is given) and writes a bare
    ``buffer_donor`` for the optimizer state. The state's next values are read from the
    dependences as where nothing is aliased, the weights' pairs taken from the header:
    ``state="sharded"`` keeps Adam's moments as shards (it kept none). ``per_device_hlo``
    writes the pytrees' pairs instead: every donated leaf aliased to its next value."""
    from hlo_shard.jax._capture import capture

    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 4)
    params, opt_state = program.init()
    replicated = NamedSharding(program.mesh, P())
    step = jax.jit(program.step.__wrapped__, donate_argnums=(0, 1),
                   out_shardings=(replicated, None, replicated))
    module = parse(capture(step, (params, opt_state, program.batch(0)), {}).text)
    assert module.output_aliases() and "buffer_donor" in module.header
    result = optimize(module, ShardingOptions(state="sharded"), force=True)
    moments = 2 * len(jax.tree.leaves(params))
    assert sum(p.kind == "sharded" for p in result.report.parameters) == moments, \
        result.report.notes

    paired = parse(hsj.per_device_hlo(step, params, opt_state, program.batch(0)))
    assert "buffer_donor" not in paired.header
    donated = len(jax.tree.leaves((params, opt_state)))
    assert len(paired.output_aliases()) == donated
    assert paired.output_aliases().items() >= module.output_aliases().items()


# ---------------------------------------------------------------- forms of steps people write


def _fallbacks(caught) -> list:
    return [c.message for c in caught if issubclass(c.category, hsj.FallbackWarning)]


def _adam_step(extra=None):
    """A data-parallel Adam step on the test MLP; ``extra(x, *rest)`` perturbs the batch
    from further arguments (a PRNG key, a keyword...)."""
    from jax_train_helpers import mlp_loss

    opt = optax.adam(1e-2)

    def step(params, opt_state, batch, *rest, **kw):
        if extra is not None:
            batch = dict(batch, x=extra(batch["x"], *rest, **kw))
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_a_typed_prng_key_is_passed_as_the_array_it_is(request, state):
    """``jax.random.key(0)`` among the arguments (and outputs): the executable takes the
    key's base array; sharded mode raised ``execute_sharded(): incompatible function
    arguments``, gathered fell back quoting it."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 4)

    def noisy(x, key):
        return x + 0.01 * jax.random.normal(key, x.shape)

    inner = _adam_step(noisy)

    def step(params, opt_state, batch, key):
        key, used = jax.random.split(key)
        return (*inner(params, opt_state, batch, used), key)

    jitted = jax.jit(step, donate_argnums=(0, 1))
    fast = hsj.shard_weight_update(jitted, state=state, force=True)

    def run(fn):
        (params, opt_state), key = program.init(), jax.device_put(jax.random.key(0),
                                                                   program.replicated)
        losses = []
        for i in range(3):
            params, opt_state, loss, key = fn(params, opt_state, program.batch(i), key)
            losses.append(float(loss))
        return (params, opt_state), losses, key

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state_fast, losses, key = run(fast)
    assert not _fallbacks(caught) and fast.report["fallback"] is None
    assert fast.report["sharded"] >= 1
    state_jit, losses_jit, key_jit = run(jitted)
    np.testing.assert_allclose(losses, losses_jit, rtol=1e-5)
    assert_close(fast.gather_args(*state_fast), state_jit)
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(key_jit))


@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_keyword_arguments_are_normalised_like_positional_ones(request, state):
    """``fast(p, opt_state=s, batch=b, scale=…)`` with the outputs fed back, then a new
    batch size and a new static keyword: a keyword argument is the parameter it names
    (``opt_state=`` is argument 1, its next value output [1]: sharded as given by
    position), and shard-form state given by keyword is gathered for the new signature
    (was ``Incompatible shapes for broadcasting: (32, 64), (2048,)``)."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 4)

    def scaled(x, *, scale):
        return x * scale

    jitted = jax.jit(_adam_step(scaled), static_argnames=("scale",), donate_argnums=(0, 1))
    fast = hsj.shard_weight_update(jitted, state=state, force=True)

    def run(fn):
        params, opt_state = program.init()
        losses = []
        for i, (rows, scale) in enumerate([(8, 1.0), (8, 1.0), (16, 1.0), (16, 2.0),
                                           (8, 1.0)]):
            batch = jax.device_put(program.model.batch(jax.random.PRNGKey(i), rows),
                                   NamedSharding(program.mesh, P(AXIS)))
            params, opt_state, loss = fn(params, opt_state=opt_state, batch=batch,
                                         scale=scale)
            losses.append(float(loss))
            if fn is fast and state == "sharded":
                assert opt_state[0].mu["l0"]["w"].shape == (32 * 64,)
        return (params, opt_state), losses

    (params, opt_state), losses = run(fast)
    reference, losses_jit = run(jitted)
    np.testing.assert_allclose(losses, losses_jit, rtol=1e-5)
    assert_close(fast.gather_args(params, opt_state), reference)


def test_steps_on_permuted_devices_keep_their_own_shards(request):
    """Two signatures on the same mesh shape, devices in another order: each program's
    shard-form leaves are found by their own placement (``gather_outputs`` raised
    "incompatible devices"; ``gather_args`` after switching back returned the flat
    shards, (2048,) for a (32, 64) leaf); shards placed as no program places them are
    refused, not returned as the leaf."""
    if not needs_devices(request):
        return
    first = make_program("mlp", "adam", 4)
    second = make_program("mlp", "adam", 4, devices=[jax.devices()[i] for i in (1, 0, 3, 2)])
    fast = hsj.shard_weight_update(first.step, state="sharded", force=True)
    (pa, sa), _ = train(fast, first, 2)
    (pb, sb), _ = train(fast, second, 2)
    (pa, sa), _ = train(fast, first, 1, state=(pa, sa), first=2)  # back to the first
    (ja, _), _ = train(first.step, first, 3)
    (jb, _), _ = train(second.step, second, 2)
    moved = jax.tree.map(lambda x: x, sa)
    mesh = jax.sharding.Mesh(np.array([jax.devices()[i] for i in (3, 2, 1, 0)]), (AXIS,))
    moved[0].mu["l0"]["w"] = jax.device_put(sa[0].mu["l0"]["w"], NamedSharding(mesh, P(AXIS)))
    with pytest.raises(ValueError, match=r"opt_state\[0\].mu\['l0'\]\['w'\] \[2048\] has the "
                                         r"shape of a state leaf's shards"):
        fast.gather_args(pa, moved)
    for program, (p, s), reference in ((first, (pa, sa), ja), (second, (pb, sb), jb)):
        assert s[0].mu["l0"]["w"].shape == (32 * 64,)
        params, state = fast.gather_args(p, s)
        assert state[0].mu["l0"]["w"].shape == (32, 64)
        assert state[0].mu["l0"]["w"].sharding.is_equivalent_to(program.replicated, 2)
        assert_close(params, reference)
        outs = fast(p, s, program.batch(5))
        state = fast.gather_outputs(outs)[1]
        assert state[0].mu["l0"]["w"].shape == (32, 64)
        assert state[0].mu["l0"]["w"].sharding.is_equivalent_to(program.replicated, 2)


@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_a_failure_inside_the_pass_runs_fn_with_one_warning(request, state):
    """A step whose module the pass fails on (BatchNorm statistics kept as state: the
    region rewrite found a dependency cycle and raised ``ValueError`` into the loop):
    one FallbackWarning with the reason code, ``fn``'s results. (Once the pass handles
    the module it must shard it correctly instead: no warning, the same results.)"""
    if not needs_devices(request):
        return
    mesh = jax.make_mesh((4,), (AXIS,), devices=jax.devices()[:4])
    replicated, by_data = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    opt = optax.adam(1e-2)

    def loss(params, stats, x):
        h = x @ params["w"]
        mean, var = h.mean(0), h.var(0)
        y = (h - mean) * jax.lax.rsqrt(var + 1e-5) * params["scale"]
        running = {"mean": 0.9 * stats["mean"] + 0.1 * mean,
                   "var": 0.9 * stats["var"] + 0.1 * var}
        return jnp.mean((y @ params["out"]) ** 2), running

    def step(params, stats, opt_state, x):
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params, stats, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, value

    key = jax.random.PRNGKey(0)
    params = jax.device_put({"w": jax.random.normal(key, (32, 64)) * 0.1,
                             "scale": jnp.ones(64),
                             "out": jax.random.normal(key, (64, 8)) * 0.1}, replicated)
    stats = jax.device_put({"mean": jnp.zeros(64), "var": jnp.ones(64)}, replicated)
    opt_state = jax.device_put(opt.init(params), replicated)
    x = jax.device_put(jax.random.normal(key, (8, 32)), by_data)
    jitted = jax.jit(step)
    fast = hsj.shard_weight_update(jitted, state=state, force=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [fast(params, stats, opt_state, x) for _ in range(2)]
    fallbacks = _fallbacks(caught)
    assert len(fallbacks) <= 1
    if fallbacks:
        assert fallbacks[0].code == fast.report["fallback"] == "pass_failed"
        assert "the pass refused the step" in str(fallbacks[0])
    assert_close(fast.gather_outputs(outs[-1]), jitted(params, stats, opt_state, x))


def test_the_users_own_errors_still_propagate_as_jit_raises_them(request):
    """A shape error in the user's function is jax's, raised from tracing: not a
    fallback."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2, donate=False)
    params, opt_state = program.init()

    def step(params, x):
        return params["l0"]["w"] @ x  # (32, 64) @ (rows, 32)

    fast = hsj.shard_weight_update(jax.jit(step))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
            fast(params, program.batch(0)["x"])
    assert not _fallbacks(caught)


@jax.tree_util.register_pytree_node_class
class _CheckedScale:
    """A pytree that checks its leaf when rebuilt, as jmp's ``DynamicLossScale`` does
    (``jax.eval_shape`` of it): jax's lowering API rebuilds the arguments from
    ``ArgInfo`` placeholders, which no such check accepts; jit's own call never does."""

    def __init__(self, scale):
        jax.eval_shape(lambda: scale)
        self.scale = scale

    def tree_flatten(self):
        return (self.scale,), None

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(*leaves)


def test_a_step_jax_cannot_lower_but_jit_runs_falls_back_with_one_warning(request):
    """The user's function traces, but jax's ``lower()`` fails on its arguments: not
    the user's error (jit runs the step), so ``fast`` runs jit's call after one
    warning instead of raising into the loop."""
    if not needs_devices(request):
        return

    def step(w, scale, x):
        grad = jax.grad(lambda w: jnp.sum((x @ w) ** 2) * scale.scale)(w)
        return w - 0.1 * grad / scale.scale, scale

    w, x, scale = jnp.ones((4, 4)), jnp.ones((8, 4)), _CheckedScale(jnp.float32(2.0 ** 15))
    fast = hsj.shard_weight_update(jax.jit(step))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got, _ = fast(w, scale, x)
    (why,) = _fallbacks(caught)
    assert "jax could not lower the step for capture" in str(why)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(step)(w, scale, x)[0]))


@pytest.mark.slow
def test_a_recursion_error_in_the_pass_runs_fn(request):
    """A 1,500-op chain of scalar learning-rate arithmetic: the pass's recursive walks
    raised RecursionError into the loop; now one warning (or, once the walks are
    iterative, the step sharded) and jit's results."""
    if not needs_devices(request):
        return
    from jax_train_helpers import mlp_loss

    program = make_program("mlp", "sgd_momentum", 4, donate=False)

    def step(params, lr, batch):
        grads = jax.grad(mlp_loss)(params, batch)
        rate = lr
        for _ in range(1500):
            rate = rate * 0.999 + 1e-6
        return jax.tree.map(lambda w, g: w - rate * g, params, grads), lr

    params, _ = program.init()
    lr = jax.device_put(jnp.float32(0.1), program.replicated)
    jitted = jax.jit(step)
    fast = hsj.shard_weight_update(jitted, force=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fast(params, lr, program.batch(0))
    fallbacks = _fallbacks(caught)
    assert len(fallbacks) <= 1
    if fallbacks:
        assert fast.report["fallback"] == "pass_failed" and "RecursionError" in str(fallbacks[0])
    assert_close(out, jitted(params, lr, program.batch(0)))


def test_min_shard_bytes_is_checked_as_the_cli_checks_it():
    from hlo_shard.passes.weight_update import ShardingOptionError

    with pytest.raises(ShardingOptionError, match="min_shard_bytes=-1 must be at least 0"):
        hsj.shard_weight_update(lambda x: x, min_shard_bytes=-1)


def test_a_jit_wrapper_it_cannot_read_is_refused_up_front():
    class Lowerable:  # has a lower(), but is no jax.jit of a known library's wrapper
        def lower(self, *args):
            return None

        def __call__(self, *args):
            return args

    from hlo_shard.errors import HloShardError

    with pytest.raises(HloShardError, match="needs a jax.jit-wrapped function"):
        hsj.shard_weight_update(Lowerable())


def test_a_compiled_executable_is_refused_up_front():
    from hlo_shard.errors import HloShardError

    compiled = jax.jit(lambda w: w * 2).lower(jnp.ones(3)).compile()
    with pytest.raises(HloShardError, match="not its compiled executable"):
        hsj.shard_weight_update(compiled)


def test_a_pmap_step_is_refused_up_front_by_name():
    import jax

    from hlo_shard.errors import HloShardError

    with pytest.raises(HloShardError, match="got a jax.pmap'ed function .*jax.jit over a Mesh"):
        hsj.shard_weight_update(jax.pmap(lambda x: x, axis_name="batch"))
    # per_device_hlo refuses in its own name, and says where a pmap step's module is
    with pytest.raises(HloShardError, match="^per_device_hlo needs .*pmap_replicated=True"
                                            ".*--xla_dump_to"):
        hsj.per_device_hlo(jax.pmap(lambda x: x, axis_name="batch"), jnp.ones((1, 3)))


# ------------------------------------------------------------- a jaxlib it is not tested with


def _untested_jaxlib(monkeypatch) -> None:
    """Make the installed jaxlib one hlo-shard is not tested with (pip no longer keeps a
    newer one out: it would downgrade the user's jax to do so)."""
    from hlo_shard.runtime import _child

    monkeypatch.setattr(_child, "SUPPORTED_JAXLIB", ((0, 98), (0, 99)))
    monkeypatch.delenv(_child.ALLOW_UNSUPPORTED_ENV, raising=False)


def test_an_untested_jaxlib_runs_the_step_unchanged_after_one_warning(request, monkeypatch):
    """``shard_weight_update`` on a jaxlib outside the tested range: no exception into the
    loop, one FallbackWarning coded ``unsupported_jax`` that names the range and the
    override, and jit's numbers; with the override the pass runs."""
    if not needs_devices(request):
        return
    _untested_jaxlib(monkeypatch)
    program = make_program("mlp", "adam", 4)
    fast = hsj.shard_weight_update(program.step, force=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (params, _), losses = train(fast, program, 2)
    warned = _fallbacks(caught)
    assert [w.code for w in warned] == ["unsupported_jax"]
    assert "jax>=0.10,<0.11" in str(warned[0]) and "HLO_SHARD_ALLOW_UNSUPPORTED_JAX" in str(
        warned[0])
    assert fast.report["fallback"] == "unsupported_jax"
    (jit_params, _), jit_losses = train(make_program("mlp", "adam", 4).step, program, 2)
    np.testing.assert_array_equal(losses, jit_losses)
    assert_close(params, jit_params)

    monkeypatch.setenv("HLO_SHARD_ALLOW_UNSUPPORTED_JAX", "1")
    allowed = hsj.shard_weight_update(program.step, force=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(allowed, program, 1)
    assert not _fallbacks(caught) and allowed.report["sharded"] > 0


def test_install_on_an_untested_jaxlib_installs_nothing_after_one_warning(monkeypatch):
    """``install()`` there: one FallbackWarning, no pass registered, jax compiles as it
    did (never an exception in a training script)."""
    _untested_jaxlib(monkeypatch)
    hsj.uninstall()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hsj.install():
            assert not hsj.installed()
    warned = _fallbacks(caught)
    assert len(warned) == 1 and "installed nothing" in str(warned[0])
    assert "jax>=0.10,<0.11" in str(warned[0])


def test_a_signature_is_jits_key_in_kind_whatever_form_a_placement_is_written_in():
    """Each call's signature numbers every leaf by its aval and sharding (cheap to look
    up on every step): equivalent placements (``P()`` and ``P(None, None)``) and a weak
    type are the same signature, another dtype, shape or placement is another."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from hlo_shard.jax import _xla

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    x = np.ones((4, 6), np.float32)
    replicated = jax.device_put(x, NamedSharding(mesh, P()))
    also_replicated = jax.device_put(x, NamedSharding(mesh, P(None, None)))
    split = jax.device_put(x, NamedSharding(mesh, P("d")))
    sig = _xla.signature
    assert sig([replicated]) == sig([also_replicated]) == sig([replicated + 1])
    assert sig([replicated]) != sig([split])
    assert sig([replicated]) != sig([replicated.astype(np.float16)])
    assert sig([replicated]) != sig([replicated[:2]])
    assert sig([jax.numpy.float32(2.0)]) == sig([jax.numpy.float32(3.0)])
    assert sig([1.5]) == sig([2.5]) != sig([1])


def test_a_step_given_no_profile_is_priced_on_the_devices_it_is_compiled_for(request,
                                                                               monkeypatch):
    """No ``profile``: the first call prices on the published profile of the step's
    devices (``profiles.detect.DEVICE_PROFILES``; cpu-local on CPU), and the report names
    it; so does ``install()``. A profile the user names stays. (The CPU's entry is made
    to name h200 here, so that the device's profile is seen to be the one used.)"""
    if not needs_devices(request):
        return
    from hlo_shard.jax import hook
    from hlo_shard.profiles import detect

    program = make_program("mlp", "adam", 2)
    default = hsj.shard_weight_update(program.step, force=True)
    train(default, program, 1)
    assert default.options.profile.name == "cpu-local" == default.report["profile"]
    monkeypatch.setitem(detect.DEVICE_PROFILES, "cpu", (("cpu", "h200"),))
    chosen = hsj.shard_weight_update(program.step, force=True)
    named = hsj.shard_weight_update(program.step, force=True, profile="h100")
    for fast in (chosen, named):
        train(fast, program, 1)
    assert chosen.options.profile.name == "h200" == chosen.report["profile"]
    assert named.options.profile.name == "h100" == named.report["profile"]
    # a step the capture cannot take (one device: no partitioned module) reports it too
    single = hsj.shard_weight_update(jax.jit(lambda x: x * 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hsj.FallbackWarning)
        single(np.ones(3, np.float32))
    assert single.report["fallback"] and single.report["profile"] == "h200"
    with hsj.install():
        assert hook._HOOK.settings.options.profile.name == "h200"
    with hsj.install(profile="a100"):
        assert hook._HOOK.settings.options.profile.name == "a100"


def test_shard_args_after_a_step_that_keeps_its_state_whole_is_the_identity(request):
    """The README's restore, ``fast.shard_args(params, opt_state)``, after a step that
    keeps every state leaf whole (here: none reaches the size cut-off) hands the leaves
    back as they are; it re-captured the step from the prefix and raised jax's
    "missing 1 required positional argument" before."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2, donate=False)
    fast = hsj.shard_weight_update(program.step, state="sharded", min_shard_bytes=1 << 40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hsj.FallbackWarning)
        params, opt_state, _ = fast(*program.init(), program.batch(0))
    assert fast.report["sharded"] == 0
    restored = fast.shard_args(*fast.gather_args(params, opt_state))
    assert_close(restored, (params, opt_state))
    assert restored[1][0].mu["l0"]["w"].shape == params["l0"]["w"].shape


@pytest.mark.parametrize("params_mode", ["gathered", "sharded"])
def test_an_explicit_mesh_converts_leaves_the_devices_do_not_divide(request, params_mode):
    """On ``jax.make_mesh``'s mesh (explicit axis types) jax types the shard form of a
    10-wide bias ``f32[16@data]`` and refused the slice back to 10 with a
    ``ShardingTypeError``, out of ``fast(...)`` (a signature falling back), of
    ``gather_args`` and of ``gather_outputs``: now jit's numbers, every leaf its shape."""
    if not needs_devices(request):
        return
    mesh = jax.make_mesh((4,), (AXIS,), devices=jax.devices()[:4])
    replicated, by_data = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    opt = optax.adam(1e-2)
    key = jax.random.PRNGKey(3)
    params = jax.device_put({"w": jax.random.normal(key, (32, 64)) * 0.1, "b": jnp.zeros(10),
                             "out": jax.random.normal(key, (64, 10)) * 0.1}, replicated)
    opt_state = jax.device_put(opt.init(params), replicated)
    x = jax.device_put(jax.random.normal(key, (8, 32)), by_data)

    def step(params, opt_state, x):
        def loss(p):
            return jnp.mean((jnp.tanh(x @ p["w"]) @ p["out"] + p["b"]) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    jitted = jax.jit(step)
    fast = hsj.shard_weight_update(jitted, state="sharded", params=params_mode, force=True)
    p, s, _ = fast(params, opt_state, x)
    outs = fast(p, s, x)
    assert fast.report["sharded"] == 3
    p_jit, s_jit, _ = jitted(*jitted(params, opt_state, x)[:2], x)
    full = fast.gather_outputs(outs)
    assert_close(full[:2], (p_jit, s_jit))
    assert_close(fast.gather_args(*outs[:2]), (p_jit, s_jit))
    assert full[0]["b"].shape == (10,) and full[1][0].mu["b"].shape == (10,)


def test_per_device_hlo_pairs_a_scalar_parameter_with_its_own_next_value(request):
    """OpenCLIP's contrastive loss (its ``ClipLoss`` over the global batch) with a learned
    scalar ``logit_scale``, donated: jit writes bare donors, from which ``hlo-shard
    optimize`` guessed which output is each parameter's next value; the scalar loss
    passed for ``logit_scale``'s, the loss's sum was named its gradient and a loss term
    (``f32[32,1]``) was sharded as if an update read it. ``per_device_hlo`` now writes
    the pytrees' pairs: the report is the one ``shard_weight_update`` gives."""
    if not needs_devices(request):
        return
    jnp = jax.numpy
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), (AXIS,))
    whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    tx = optax.adam(1e-3)

    def loss_fn(p, batch):
        image, text = batch["image"] @ p["wi"], batch["text"] @ p["wt"]
        image = image / jnp.linalg.norm(image, axis=-1, keepdims=True)
        text = text / jnp.linalg.norm(text, axis=-1, keepdims=True)
        logits = jnp.exp(p["logit_scale"]) * image @ text.T
        labels = jnp.arange(image.shape[0])
        return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
                + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2

    def step(p, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    key = jax.random.PRNGKey(0)
    params = {"wi": jax.random.normal(key, (64, 32)) / 8,
              "wt": jax.random.normal(jax.random.fold_in(key, 1), (48, 32)) / 7,
              "logit_scale": jnp.asarray(2.659, jnp.float32)}
    batch = jax.device_put({"image": jax.random.normal(jax.random.fold_in(key, 2), (32, 64)),
                            "text": jax.random.normal(jax.random.fold_in(key, 3), (32, 48))},
                           split)
    params, state = jax.device_put((params, tx.init(params)), whole)
    module = parse(hsj.per_device_hlo(jax.jit(step, donate_argnums=(0, 1)), params, state,
                                      batch))
    assert "buffer_donor" not in module.header
    rows = optimize(module, ShardingOptions(), force=True).report.explanations
    assert sorted(row.shape.split("{")[0] for row in rows if row.sharded) == \
        ["f32[32,48]", "f32[32,64]"], [(r.shape, r.reason_code) for r in rows]


def test_a_reduction_from_a_non_neutral_value_gives_jits_numbers(request):
    """``lax.reduce(g * g, 1.0, add)`` in the update: XLA:CPU's jit adds the 1 once per
    partial sum of its choosing; the forced rewrite summed the gathered squares once and
    differed from jit's step. That gradient now stays as it is: jit's numbers exactly."""
    if not needs_devices(request):
        return
    mesh = jax.make_mesh((8,), (AXIS,), devices=jax.devices()[:8])

    def step(w, x):
        g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        n = jax.lax.reduce(g * g, np.float32(1.0), jax.lax.add, (0, 1))
        return w - 0.1 * g / jnp.sqrt(n), n

    w = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (64, 64)) * 0.1,
                       NamedSharding(mesh, P()))
    x = jax.device_put(np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32),
                       NamedSharding(mesh, P(AXIS)))
    expected = jax.jit(step)(w, x)
    fast = hsj.shard_weight_update(jax.jit(step), force=True)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = fast(w, x)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (row,) = [r for r in fast.report["explanations"] if r["shape"].startswith("f32[64,64]")]
    assert row["reason_code"] == "non_neutral_init"


def test_an_integer_metric_carried_beside_the_weights_comes_back_whole(request):
    """A confusion matrix summed over the global batch and carried in the step's state
    is an integer all-reduce added to a leaf only the update reads: the form of a
    gradient and its state, but no gradient (jax differentiates floats only). Sharded
    state must not turn it into a shard the user's metric code cannot read."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 4)
    opt = optax.adam(1e-3)

    def train_step(params, opt_state, conf, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        predicted, actual = batch["x"][:, :8].argmax(-1), batch["y"].argmax(-1)
        conf = conf + jnp.zeros((8, 8), jnp.int32).at[actual, predicted].add(1)
        return optax.apply_updates(params, updates), opt_state, conf, loss

    step = jax.jit(train_step, donate_argnums=(0, 1, 2))
    replicated = NamedSharding(program.mesh, P())

    def start():
        params, opt_state = program.init()
        return params, opt_state, jax.device_put(jnp.zeros((8, 8), jnp.int32), replicated)

    fast = hsj.shard_weight_update(step, state="sharded", force=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hsj.FallbackWarning)
        state, _ = run_steps(fast, start(), program.batch)
    assert state[1][0].mu["l0"]["w"].shape == (32 * 64,)  # the optimizer state: shards
    conf = state[2]
    assert conf.shape == (8, 8) and conf.dtype == jnp.int32
    jit_state, _ = run_steps(step, start(), program.batch)
    np.testing.assert_array_equal(np.asarray(conf), np.asarray(jit_state[2]))
    assert int(conf.sum()) == 3 * program.batch(0)["x"].shape[0]
    rows = {row["reason_code"] for row in fast.report["explanations"]
            if row["shape"].startswith("s32")}
    assert rows == {"integer_sum"}


def test_shard_args_names_a_leaf_restored_onto_other_devices(request):
    """A checkpoint restored onto one device is refused in the user's words (the leaf,
    both device sets, what to do), not with the error of hlo-shard's own conversion;
    host arrays of the same checkpoint are placed as the step's."""
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 4)
    fast = hsj.shard_weight_update(program.step, state="sharded", force=True)
    (p, s), _ = train(fast, program, 1)
    saved = jax.device_get(fast.gather_args(p, s))
    on_one = jax.device_put(saved, jax.devices()[0])
    with pytest.raises(ValueError, match=r"hlo_shard\.jax: opt_state\[0\]\.mu\['l0'\]\['[bw]'\] "
                       r"is on devices \[0\], the step's on \[0, 1, 2, 3\]: .*host arrays"):
        fast.shard_args(*on_one)
    _, opt_state = fast.shard_args(*saved)
    assert opt_state[0].mu["l0"]["w"].shape == (32 * 64,)
