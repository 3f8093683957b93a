"""``shard_weight_update`` on a mesh with more axes than the data axis: a (data=4,
model=2) mesh with tensor-parallel weights on ``model`` (Megatron's column/row split of
an MLP) and a bias replicated over both axes. The gradients are all-reduced over the
data-axis groups; ``state="sharded"`` keeps each optimizer-state leaf as the chunk of
its data-axis group, of the device's own model-axis block (a ``[D·L]`` shard form),
and ``gather_args``/``shard_args`` turn it back into the leaves jit takes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from jax_train_helpers import jax, needs_devices, optax

import hlo_shard.jax as hsj

jnp = jax.numpy
P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding
OPT = optax.adam(1e-2)


def _loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"] + p["b"]) ** 2)


def _step(p, s, x):
    grads = jax.grad(_loss)(p, x)
    updates, s = OPT.update(grads, s, p)
    return optax.apply_updates(p, updates), s, _loss(p, x)


def _start():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    key = jax.random.PRNGKey(0)
    params = {"w1": jax.device_put(jax.random.normal(key, (64, 128)) * 0.1,
                                   NamedSharding(mesh, P(None, "model"))),
              "w2": jax.device_put(jax.random.normal(key, (128, 64)) * 0.1,
                                   NamedSharding(mesh, P("model", None))),
              "b": jax.device_put(jnp.full((64,), 0.5), NamedSharding(mesh, P()))}
    batches = [jax.device_put(jax.random.normal(jax.random.fold_in(key, i), (32, 64)),
                              NamedSharding(mesh, P("data", None))) for i in range(4)]
    return params, OPT.init(params), batches


@pytest.mark.parametrize("state, params", [("gathered", "gathered"), ("sharded", "gathered"),
                                           ("sharded", "sharded")])
def test_a_data_by_model_mesh_shards_over_the_data_groups(request, state, params):
    """``params="sharded"``: the tensor-parallel weights too cross the step as chunks of
    their data-axis group, of the device's model-axis block."""
    if not needs_devices(request):
        return
    weights = params
    params, opt_state, batches = _start()
    fast = hsj.shard_weight_update(jax.jit(_step), state=state, params=weights, force=True)
    jitted = jax.jit(_step)
    p, s = params, opt_state
    p_jit, s_jit = params, opt_state
    for x in batches[:3]:
        p, s, loss = fast(p, s, x)
        p_jit, s_jit, loss_jit = jitted(p_jit, s_jit, x)
        assert float(loss) == float(loss_jit)
    report = fast.report
    assert report["fallback"] is None and report["sharded"] >= 2
    if state == "sharded":  # w1's state: 4 chunks of its device's [64, 64] block, x 8 devices
        assert s[0].mu["w1"].shape == (8 * 64 * 64 // 4,)
    assert p["w1"].shape == ((8 * 64 * 64 // 4,) if weights == "sharded" else (64, 128))
    codes = {row["reason_code"] for row in report["explanations"] if not row["sharded"]}
    assert codes <= {"other_groups", "nothing_to_shard", "below_min_shard_bytes"}
    p_full, s_full = fast.gather_args(p, s)
    for leaf, leaf_jit in zip(jax.tree.leaves((p_full, s_full)), jax.tree.leaves((p_jit, s_jit))):
        assert leaf.shape == leaf_jit.shape and leaf.sharding.is_equivalent_to(
            leaf_jit.sharding, leaf.ndim)
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(leaf_jit))
    # The checkpoint round trip resumes jit's run.
    p, s = fast.shard_args(p_full, s_full)
    p, s, loss = fast(p, s, batches[3])
    p_jit, s_jit, loss_jit = jitted(p_jit, s_jit, batches[3])
    assert float(loss) == float(loss_jit)
    np.testing.assert_array_equal(np.asarray(fast.gather_args(p, s)[1][0].mu["w1"]),
                                  np.asarray(s_jit[0].mu["w1"]))



def test_mesh_axis_conversions_cut_as_the_global_one(request):
    """Where the replica groups run along mesh axes (two of three here: groups of 4
    along (pod, data), the leaf split over model), each device cuts its own chunk
    (a shard_map, no collective) and gathering is one all-gather over those axes: the
    same arrays as the global program that slices every device's block, both ways."""
    if not needs_devices(request):
        return
    from hlo_shard.jax._program import StateLayout, _converter, _group_axes, convert
    from hlo_shard.shard_format import ShardFormat

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2),
                             ("pod", "data", "model"))
    full = NamedSharding(mesh, P(None, "model"))
    chunks = NamedSharding(mesh, P(("pod", "data", "model")))
    groups = ((0, 2, 4, 6), (1, 3, 5, 7))  # device k = (pod, data, model) row-major
    assert _group_axes(groups, full, mesh) == ("pod", "data")
    assert _group_axes(((0, 4, 2, 6), (1, 5, 3, 7)), full, mesh) is None  # not row-major
    assert _group_axes(groups, NamedSharding(
        jax.sharding.Mesh(mesh.devices.reshape(8), ("all",)), P()), mesh) is None
    # [6, 10] split over model: each device holds a [6, 5] block, read column-major,
    # cut in 4 chunks of 8 (two padding lanes).
    fmt = ShardFormat((6, 5), (1, 0), 4)
    blocks = tuple(((0, 6), (5 * (k % 2), 5 * (k % 2) + 5)) for k in range(8))
    ranks = tuple((k // 2) for k in range(8))
    generic = StateLayout(fmt, ranks, (6, 10), blocks)
    on_mesh = StateLayout(fmt, ranks, (6, 10), blocks, ("pod", "data"), full.spec)
    value = jax.device_put(jnp.arange(60, dtype=jnp.float32).reshape(6, 10), full)
    [expected] = convert([value], [generic], [chunks], to_shards=True)
    [cut] = convert([value], [on_mesh], [chunks], to_shards=True)
    assert cut.sharding.is_equivalent_to(chunks, 1)
    np.testing.assert_array_equal(np.asarray(cut), np.asarray(expected))
    assert np.asarray(cut)[:8].tolist() == [0, 10, 20, 30, 40, 50, 1, 11]  # device 0
    [back] = convert([cut], [on_mesh], [full], to_shards=False)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(value))
    assert back.sharding.is_equivalent_to(full, 2)
    text = _converter(True, (on_mesh,), (chunks,)).lower((value,)).compile().as_text()
    assert not any(op in text for op in ("all-gather", "all-to-all", "collective-permute",
                                         "all-reduce")), "cutting shards moved data"


def test_a_pod_by_data_by_model_mesh_shards_over_two_axes(request):
    """Gradients all-reduced over (pod, data) groups of 4 on a (2, 2, 2) mesh, weights
    split over model: state="sharded" trains as jit and gathers back to jit's leaves."""
    if not needs_devices(request):
        return
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2),
                             ("pod", "data", "model"))
    params, _, _ = _start()
    params = {name: jax.device_put(np.asarray(leaf), NamedSharding(mesh, leaf.sharding.spec))
              for name, leaf in params.items()}
    batches = [jax.device_put(jax.random.normal(jax.random.PRNGKey(i), (32, 64)),
                              NamedSharding(mesh, P(("pod", "data"), None))) for i in range(3)]
    fast = hsj.shard_weight_update(jax.jit(_step), state="sharded", force=True)
    jitted = jax.jit(_step)
    p, s = params, OPT.init(params)
    p_jit, s_jit = p, s
    for x in batches:
        p, s, loss = fast(p, s, x)
        p_jit, s_jit, loss_jit = jitted(p_jit, s_jit, x)
        assert float(loss) == float(loss_jit)
    assert fast.report["fallback"] is None
    assert s[0].mu["w1"].shape == (8 * 64 * 64 // 4,)
    _, s_full = fast.gather_args(p, s)
    for leaf, leaf_jit in zip(jax.tree.leaves(s_full), jax.tree.leaves(s_jit)):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(leaf_jit))

# ------------------------------------------------- a (data=2, fsdp=4) mesh, FSDP weights

ADAMW = optax.adamw(1e-2)


def _fsdp_loss(p, batch):
    """Two LayerNorm + dense layers: the LayerNorm's backward on rows sharded over
    ``fsdp`` makes the partitioner write all-to-alls over partition ids."""
    h = batch["x"]
    for layer in ("l0", "l1"):
        centred = h - h.mean(-1, keepdims=True)
        normed = centred * jax.lax.rsqrt((centred ** 2).mean(-1, keepdims=True) + 1e-6)
        h = jnp.tanh(normed * p[layer]["scale"] @ p[layer]["w"] + p[layer]["b"])
    return jnp.mean((h - batch["y"]) ** 2)


def _fsdp_step(p, s, batch):
    loss, grads = jax.value_and_grad(_fsdp_loss)(p, batch)
    updates, s = ADAMW.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss


def _fsdp_start(width: int = 64):
    """Every matrix's rows sharded over ``fsdp`` (jit all-gathers them), vectors
    replicated, the batch over both axes."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    key = jax.random.PRNGKey(1)
    params = {}
    for i, layer in enumerate(("l0", "l1")):
        w = jax.random.normal(jax.random.fold_in(key, i), (width, width)) / width ** 0.5
        params[layer] = {
            "w": jax.device_put(w, NamedSharding(mesh, P("fsdp"))),
            "b": jax.device_put(jnp.full((width,), 0.1), NamedSharding(mesh, P())),
            "scale": jax.device_put(jnp.ones((width,)), NamedSharding(mesh, P()))}
    batches = [{k: jax.device_put(jax.random.normal(jax.random.fold_in(key, 10 * b + j),
                                                    (32, width)),
                                  NamedSharding(mesh, P(("data", "fsdp"))))
                for j, k in enumerate("xy")} for b in range(3)]
    return params, ADAMW.init(params), batches


@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_a_data_by_fsdp_mesh_shards_the_fsdp_shards_update_over_the_data_groups(request, state):
    """The gradient of an fsdp-sharded weight is reduce-scattered over ``fsdp`` (the
    partitioner's all-reduce + slice: already sharded) and its slice all-reduced over
    ``data``: that data-axis all-reduce and the update of the slice are what the pass
    shards, over the data-axis groups of 2, the weight's fsdp rows staying as the user
    sharded them. Numbers: jit's."""
    if not needs_devices(request):
        return
    params, opt_state, batches = _fsdp_start()
    fast = hsj.shard_weight_update(jax.jit(_fsdp_step), state=state, force=True)
    jitted = jax.jit(_fsdp_step)
    p, s = params, opt_state
    p_jit, s_jit = params, opt_state
    for batch in batches:
        p, s, loss = fast(p, s, batch)
        p_jit, s_jit, loss_jit = jitted(p_jit, s_jit, batch)
        np.testing.assert_allclose(float(loss), float(loss_jit), rtol=1e-5)
    report = fast.report
    assert report["fallback"] is None
    rows = {row["all_reduce"]: row for row in report["explanations"]}
    sharded = [row for row in rows.values() if row["sharded"]]
    assert len(sharded) == 2  # the two matrices' data-axis all-reduces
    assert all(row["shape"].startswith("f32[64,16]") for row in sharded)
    assert sum(row["reason_code"] == "already_sharded" for row in rows.values()) >= 2
    assert {strategy["devices"] for strategy in report["strategies"]} == {2}  # data groups
    p_full, s_full = fast.gather_args(p, s) if state == "sharded" else (p, s)
    for leaf, leaf_jit in zip(jax.tree.leaves((p_full, s_full)), jax.tree.leaves((p_jit, s_jit))):
        assert leaf.shape == leaf_jit.shape
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(leaf_jit), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_the_hook_reads_xla_cpus_fused_fsdp_slices_as_already_sharded(request):
    """Under ``install()`` the pass sees XLA:CPU's fused module, where the partitioner's
    slice of each fsdp gradient is a fusion (a ``dynamic-slice`` at an offset read from
    a partition-id table, itself a fusion) and the all-reduces are combined. Those sums
    read as already sharded, so the data-parallel group is the data axis's (groups of
    2), and, forced, the update of the slices is sharded over it, computing jit's
    numbers; the fused slices themselves are left as they are. (Slow: XLA calls the hook
    from a compile thread, which stays registered with Python's threading afterwards;
    the default suite keeps it out of the process its thread checks run in.)"""
    if not needs_devices(request):
        return
    params, opt_state, batches = _fsdp_start()
    rows = _forced_hook_rows(_fsdp_step, params, opt_state, batches)
    scattered = [row for row in rows if row.reason_code == "already_sharded"]
    assert scattered and all("fused by XLA" in row.reason for row in scattered)
    assert all(row.shape.startswith("(f32[64,64]") for row in scattered)
    sharded = [row for row in rows if row.sharded]
    assert len(sharded) == 2 and all(row.shape.startswith("f32[64,16]") for row in sharded)


def _forced_hook_rows(step, params, opt_state, batches) -> list:
    """``step`` run on ``batches`` under ``install(force=True)`` and under plain jit:
    the one module the hook changed, sharding over the data axis's groups of 2, with
    jit's numbers; its report's rows."""
    jitted = jax.jit(step)
    hsj.decisions(clear=True)
    with hsj.install(force=True):
        hooked = jax.jit(step)
        p, s, p_jit, s_jit = params, opt_state, params, opt_state
        for batch in batches:
            p, s, loss = hooked(p, s, batch)
            p_jit, s_jit, loss_jit = jitted(p_jit, s_jit, batch)
    (decision,) = [d for d in hsj.decisions(clear=True) if not d.reused and d.report]
    assert decision.changed, decision.reason
    assert decision.report.group_size == 2
    np.testing.assert_allclose(float(loss), float(loss_jit), rtol=1e-5)
    for leaf, leaf_jit in zip(jax.tree.leaves((p, s)), jax.tree.leaves((p_jit, s_jit))):
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(leaf_jit), rtol=1e-5, atol=1e-7)
    return decision.report.explanations


def _fsdp_accumulated_step(p, s, batches):
    """:func:`_fsdp_step` over microbatches summed in a ``lax.scan``."""
    def microbatch(total, batch):
        loss, grads = jax.value_and_grad(_fsdp_loss)(p, batch)
        return jax.tree.map(jnp.add, total, grads), loss

    grads, losses = jax.lax.scan(microbatch, jax.tree.map(jnp.zeros_like, p), batches)
    updates, s = ADAMW.update(grads, s, p)
    return optax.apply_updates(p, updates), s, losses.mean()


@pytest.mark.slow
def test_the_hook_reads_fsdp_slices_whose_offsets_the_loop_carries_as_already_sharded(
        request):
    """Accumulated in a ``lax.scan``, XLA hoists the partitioner's slice offsets (a
    partition-id lookup) out of the loop and carries them through it unchanged: the
    body's fused slices still take this device's part, so its fsdp sums read as already
    sharded and the data-parallel group is the data axis's (before, the fsdp axis's,
    and every slice a ``no_update_work``). Forced, the data-axis sums' updates are
    sharded over it, with jit's numbers. (Slow, as the test above.)"""
    if not needs_devices(request):
        return
    params, opt_state, batches = _fsdp_start()
    mesh = batches[0]["x"].sharding.mesh
    stacked = [jax.tree.map(lambda *xs: jax.device_put(
        jnp.stack(xs), NamedSharding(mesh, P(None, ("data", "fsdp")))), *batches)] * 2
    rows = _forced_hook_rows(_fsdp_accumulated_step, params, opt_state, stacked)
    assert not [row for row in rows if row.reason_code == "no_update_work"], rows
    assert [row for row in rows if row.reason_code == "already_sharded"]
    sharded = [row for row in rows if row.sharded]
    assert len(sharded) == 2 and all(row.bytes == 16 * 64 * 4 for row in sharded)


def _embedded_step(mesh):
    """A train step whose token embedding's table has its columns sharded over ``fsdp``:
    the partitioner contracts the sharded columns with the up projection's fsdp rows,
    sums the activations over ``fsdp`` and slices them by batch (the constraint): the
    reduce-scatter form of an activation, which the weights' gradients are computed
    from."""
    def loss_of(p, batch):
        x = jnp.take(p["embed"], batch["t"], axis=0)
        h = jax.lax.with_sharding_constraint(jnp.einsum("bsd,df->bsf", x, p["up"]),
                                             NamedSharding(mesh, P(("data", "fsdp"))))
        return jnp.mean((jnp.tanh(h) @ p["down"] - x) ** 2)

    def step(p, s, batch):
        loss, grads = jax.value_and_grad(loss_of)(p, batch)
        updates, s = ADAMW.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    return step


def _embedded_inputs():
    """:func:`_embedded_step`'s (data=2, fsdp=4) mesh, its weights (the table's columns
    and the projections' fsdp rows sharded) and its batch ``b``."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    key = jax.random.PRNGKey(3)
    params = {name: jax.device_put(jax.random.normal(jax.random.fold_in(key, i), shape) / 8,
                                   NamedSharding(mesh, spec))
              for i, (name, shape, spec) in enumerate([
                  ("embed", (64, 64), P(None, "fsdp")), ("up", (64, 128), P("fsdp", None)),
                  ("down", (128, 64), P(None, "fsdp"))])}

    def batch(b: int):
        return {"t": jax.device_put(jax.random.randint(jax.random.fold_in(key, 10 + b),
                                                       (16, 8), 0, 64),
                                    NamedSharding(mesh, P(("data", "fsdp"))))}

    return mesh, params, batch


def test_fsdp_activation_sums_in_reduce_scatter_form_are_not_gradients(request, tmp_path):
    """Under FSDP the partitioner reduce-scatters activations as it does gradients: an
    all-reduce sliced by the device's id. One from whose slice another sum is computed
    is ``activation_sum``, named after no weight and counted apart; the weights'
    fsdp-axis sums, whose slices are summed again over the data axis through data
    movement only, stay ``already_sharded`` with their weights' names. Numbers: jit's."""
    if not needs_devices(request):
        return
    mesh, params, batch = _embedded_inputs()
    batches = [batch(b) for b in range(2)]
    step = _embedded_step(mesh)
    fast = hsj.shard_weight_update(jax.jit(step))
    jitted = jax.jit(step)
    p, s, p_jit, s_jit = params, ADAMW.init(params), params, ADAMW.init(params)
    for batch in batches:
        p, s, loss = fast(p, s, batch)
        p_jit, s_jit, loss_jit = jitted(p_jit, s_jit, batch)
        np.testing.assert_allclose(float(loss), float(loss_jit), rtol=1e-6)
    rows = fast.report["explanations"]
    activations = [row for row in rows if row["reason_code"] == "activation_sum"]
    assert activations and all(row["gradient_of"] is None and
                               "is computed from its slice" in row["reason"]
                               for row in activations)
    scattered = {row["gradient_of"] for row in rows if row["reason_code"] == "already_sharded"}
    assert {"p['embed']", "p['down']"} <= scattered, rows
    source = tmp_path / "step.hlo"
    source.write_text(hsj.per_device_hlo(jax.jit(step), params,
                                         ADAMW.init(params), batches[0]))
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "optimize", str(source), "-o",
                          str(tmp_path / "out.hlo")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"{len(activations)} activation sum" in run.stderr


def test_a_bf16_activation_sum_is_left_as_it_is_and_the_output_verifies(request, tmp_path):
    """The same step computing its activations in bf16: made a reduce-scatter, XLA:CPU
    sums an activation in another order than the all-reduce, and the forward pass, the
    loss and every gradient round differently: ``verify`` said DIFFERENT on what
    ``optimize`` wrote although it sharded nothing (a probe's bf16 Llama on (2, 4)). The
    bf16 activation sums stay all-reduces, as the words say; the output MATCHes."""
    if not needs_devices(request):
        return
    mesh, params, batches = _embedded_inputs()
    batch = batches(0)

    def loss_of(p, batch):
        x = jnp.take(p["embed"], batch["t"], axis=0).astype(jnp.bfloat16)
        h = jax.lax.with_sharding_constraint(
            jnp.einsum("bsd,df->bsf", x, p["up"].astype(jnp.bfloat16)),
            NamedSharding(mesh, P(("data", "fsdp"))))
        y = jnp.tanh(h) @ p["down"].astype(jnp.bfloat16)
        return jnp.mean((y.astype(jnp.float32) - x.astype(jnp.float32)) ** 2)

    def step(p, s, batch):
        loss, grads = jax.value_and_grad(loss_of)(p, batch)
        updates, s = ADAMW.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    source, out = tmp_path / "step.hlo", tmp_path / "out.hlo"
    source.write_text(hsj.per_device_hlo(jax.jit(step), params, ADAMW.init(params), batch))
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "optimize", str(source), "-o",
                          str(out), "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)["explanations"]
    bf16 = [row for row in rows if row["reason_code"] == "activation_sum"
            and row["shape"].startswith("bf16")]
    assert bf16 and all("an activation's sum in bf16" in row["reason"] for row in bf16), rows
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "verify", str(source), str(out),
                          "--steps", "3"], capture_output=True, text=True)
    assert run.returncode == 0 and "MATCH" in run.stdout, run.stdout + run.stderr
