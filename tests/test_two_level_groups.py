"""Two-level replica groups of a data x model mesh (issue 23, item 4): the gradient
all-reduce over the data-axis groups (``[2,4]<=[8]``, ``[4,2]<=[2,4]T(1,0)``) beside a
tensor-parallel sum over the model-axis groups is recognised, its update sharded over the
data groups in both state modes, and the result computes what the original computes on
8 CPU devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlo_shard import parse, runtime
from hlo_shard import optimize
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.passes.weight_update import ShardingOptions

from wus_helpers import ADD

#: (data groups, model groups): each the other's complement on the 2 x 4 device grid.
MESHES = {
    "data4-iota": ("[2,4]<=[8]", "[4,2]<=[2,4]T(1,0)"),
    "data2-transposed": ("[4,2]<=[2,4]T(1,0)", "[2,4]<=[8]"),
}

#: One Megatron-style layer on a device's model shard of the weight: the activation is
#: summed over the model axis, the weight gradient over the data axis (then Adam).
STEP = f"""HloModule data_model, num_partitions=8, input_output_alias={{ {{0}}: (0, {{}}, may-alias), {{1}}: (1, {{}}, may-alias), {{2}}: (2, {{}}, may-alias) }}
{ADD}
ENTRY e {{
  w = f32[24,6]{{1,0}} parameter(0)
  m = f32[24,6]{{1,0}} parameter(1)
  v = f32[24,6]{{1,0}} parameter(2)
  x = f32[3,24]{{1,0}} parameter(3), parameter_replication={{false}}
  h = f32[3,6]{{1,0}} dot(x, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  hs = f32[3,6]{{1,0}} all-reduce(h), channel_id=1, replica_groups=MODEL, use_global_device_ids=true, to_apply=add
  g = f32[24,6]{{1,0}} dot(x, hs), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
  ar = f32[24,6]{{1,0}} all-reduce(g), channel_id=2, replica_groups=DATA, use_global_device_ids=true, to_apply=add
  b1 = f32[] constant(0.9)
  b1b = f32[24,6]{{1,0}} broadcast(b1), dimensions={{}}
  c1 = f32[] constant(0.1)
  c1b = f32[24,6]{{1,0}} broadcast(c1), dimensions={{}}
  m1 = f32[24,6]{{1,0}} multiply(m, b1b)
  m2 = f32[24,6]{{1,0}} multiply(ar, c1b)
  nm = f32[24,6]{{1,0}} add(m1, m2)
  gg = f32[24,6]{{1,0}} multiply(ar, ar)
  v1 = f32[24,6]{{1,0}} multiply(v, b1b)
  v2 = f32[24,6]{{1,0}} multiply(gg, c1b)
  nv = f32[24,6]{{1,0}} add(v1, v2)
  eps = f32[] constant(1e-3)
  epsb = f32[24,6]{{1,0}} broadcast(eps), dimensions={{}}
  nve = f32[24,6]{{1,0}} add(nv, epsb)
  r = f32[24,6]{{1,0}} rsqrt(nve)
  u = f32[24,6]{{1,0}} multiply(nm, r)
  lr = f32[] constant(0.01)
  lrb = f32[24,6]{{1,0}} broadcast(lr), dimensions={{}}
  s = f32[24,6]{{1,0}} multiply(u, lrb)
  nw = f32[24,6]{{1,0}} subtract(w, s)
  ROOT t = (f32[24,6]{{1,0}}, f32[24,6]{{1,0}}, f32[24,6]{{1,0}}) tuple(nw, nm, nv)
}}
"""

#: Why the tensor-parallel sum stays, per mesh.
GROUPS_IN_WORDS = {
    "data4-iota": "its groups, 4 groups of 2 ({0,4}, …), differ from the data-parallel group "
                  "of the module, 2 groups of 4 ({0,1,2,3}, …)",
    "data2-transposed": "its groups, 2 groups of 4 ({0,1,2,3}, …), differ from the "
                        "data-parallel group of the module, 4 groups of 2 ({0,4}, …)",
}


def step(mesh: str) -> str:
    data, model = MESHES[mesh]
    return STEP.replace("DATA", data).replace("MODEL", model)


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_the_data_axis_gradient_is_sharded_over_the_data_groups(mesh):
    module = parse(step(mesh))
    result = optimize(module, ShardingOptions(), force=True)
    report, text = result.report, result.text
    rows = {row.all_reduce: row for row in report.explanations}
    assert rows["ar"].sharded, rows["ar"].reason
    assert rows["hs"].reason_code == "other_groups"  # the tensor-parallel sum stays
    # ... saying which groups it sums over, and which the data-parallel ones are
    assert rows["hs"].reason == GROUPS_IN_WORDS[mesh], rows["hs"].reason
    data = parse(step(mesh)).entry["ar"].attr("replica_groups").groups
    scatters = [i for i in parse(text).entry.instructions if i.opcode == "reduce-scatter"]
    assert scatters and all(i.attr("replica_groups").groups == data for i in scatters)


def wide_batch(mesh: str) -> str:
    """:func:`step` with 16 times the examples: the model axis's sum of activations
    (f32[48,6]) then carries more bytes than the data axis's of the gradient."""
    return step(mesh).replace("f32[3,24]", "f32[48,24]").replace("f32[3,6]", "f32[48,6]")


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_a_sum_a_product_reads_is_no_gradient_however_large(mesh):
    """The data-parallel groups are the gradient's though the activations' sum weighs
    more: ``g`` (a product) reads ``hs``; nothing but the update reads ``ar``."""
    module = parse(wide_batch(mesh))
    assert module.entry["hs"].shape.byte_size > module.entry["ar"].shape.byte_size
    rows = {row.all_reduce: row
            for row in optimize(module, ShardingOptions(), force=True).report.explanations}
    assert rows["ar"].sharded and rows["hs"].reason == GROUPS_IN_WORDS[mesh]


def summed_loss(mesh: str) -> str:
    """:func:`wide_batch` with the model axis's sum read by no product, only by the
    loss (as a tensor-parallel layer's input gradient is read by a residual add and a
    norm's reductions): it outweighs the gradient, and has no parameter's dimensions."""
    return wide_batch(mesh).replace(
        "g = f32[24,6]{1,0} dot(x, hs)", "g = f32[24,6]{1,0} dot(x, h)").replace(
        "ROOT t = (f32[24,6]{1,0}, f32[24,6]{1,0}, f32[24,6]{1,0}) tuple(nw, nm, nv)",
        "z = f32[] constant(0)\n  loss = f32[] reduce(hs, z), dimensions={0,1}, to_apply=add\n"
        "  ROOT t = (f32[24,6]{1,0}, f32[24,6]{1,0}, f32[24,6]{1,0}, f32[]) "
        "tuple(nw, nm, nv, loss)")


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_the_groups_of_a_parameters_dimensions_outweigh_an_activations_sum(mesh):
    """A probe's (data=2, fsdp=2, tensor=2) Llama step: the tensor axis's sums of the
    projections' input gradients weighed more than the data axis's weight gradients, so
    the pass took the tensor axis for the data-parallel one, sharded those sums and
    kept every weight whole (the old code here: ``hs`` sharded, ``ar`` whole)."""
    module = parse(summed_loss(mesh))
    assert module.entry["hs"].shape.byte_size > module.entry["ar"].shape.byte_size
    rows = {row.all_reduce: row
            for row in optimize(module, ShardingOptions(), force=True).report.explanations}
    assert rows["ar"].sharded and rows["hs"].reason == GROUPS_IN_WORDS[mesh]


#: A scan over two layers on a (data=2, model=2) mesh: the model axis's sum of each
#: layer's activations leaves the body only through the loop's carry (the next
#: iteration's product reads it), the data axis's sum of the gradient is accumulated.
SCAN = f"""HloModule scan, num_partitions=4, input_output_alias={{ {{0}}: (0, {{}}, may-alias) }}
{ADD}
body {{
  p = (s32[], f32[16,4]{{1,0}}, f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  h = f32[16,4]{{1,0}} get-tuple-element(p), index=1
  w = f32[4,4]{{1,0}} get-tuple-element(p), index=2
  acc = f32[4,4]{{1,0}} get-tuple-element(p), index=3
  y = f32[16,4]{{1,0}} dot(h, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ys = f32[16,4]{{1,0}} all-reduce(y), channel_id=1, replica_groups={{{{0,1}},{{2,3}}}}, use_global_device_ids=true, to_apply=add
  g = f32[4,4]{{1,0}} dot(h, ys), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
  gs = f32[4,4]{{1,0}} all-reduce(g), channel_id=2, replica_groups={{{{0,2}},{{1,3}}}}, use_global_device_ids=true, to_apply=add
  acc1 = f32[4,4]{{1,0}} add(acc, gs)
  one = s32[] constant(1)
  i1 = s32[] add(i, one)
  ROOT t = (s32[], f32[16,4]{{1,0}}, f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) tuple(i1, ys, w, acc1)
}}
cond {{
  p = (s32[], f32[16,4]{{1,0}}, f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  two = s32[] constant(2)
  ROOT lt = pred[] compare(i, two), direction=LT
}}
ENTRY e {{
  w = f32[4,4]{{1,0}} parameter(0)
  x = f32[16,4]{{1,0}} parameter(1), parameter_replication={{false}}
  zero = s32[] constant(0)
  z = f32[] constant(0)
  zeros = f32[4,4]{{1,0}} broadcast(z), dimensions={{}}
  init = (s32[], f32[16,4]{{1,0}}, f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) tuple(zero, x, w, zeros)
  loop = (s32[], f32[16,4]{{1,0}}, f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) while(init), condition=cond, body=body
  grad = f32[4,4]{{1,0}} get-tuple-element(loop), index=3
  lr = f32[] constant(0.1)
  lrb = f32[4,4]{{1,0}} broadcast(lr), dimensions={{}}
  step = f32[4,4]{{1,0}} multiply(grad, lrb)
  ROOT nw = f32[4,4]{{1,0}} subtract(w, step)
}}
"""


def test_a_sum_read_by_the_next_iterations_product_through_the_carry():
    from hlo_shard.analysis.collectives import find_gradient_all_reduces
    from hlo_shard.analysis.matmul_inputs import matmul_inputs
    from hlo_shard.passes.weight_update.analysis import data_parallel_groups

    module = parse(SCAN)
    inputs = matmul_inputs(module)
    assert inputs.reads("body", "ys") and inputs.reads("body", "h")
    assert inputs.reads("e", "init", 1) and not inputs.reads("e", "init", 3)
    assert not inputs.reads("e", "loop")  # nothing after the loop multiplies
    assert not inputs.reads("body", "gs") and not inputs.reads("body", "acc1")
    groups = data_parallel_groups(module, find_gradient_all_reduces(module))
    assert groups is not None and groups.groups == ((0, 2), (1, 3))


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


@pytest.mark.parametrize("state", ["gathered", "sharded"])
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_sharded_over_the_data_groups_it_computes_the_same(worker, mesh, state):
    module = parse(step(mesh))
    result = optimize(module, ShardingOptions(state=state), force=True)
    report, optimized = result.report, result.text
    assert {r.all_reduce: r for r in report.explanations}["ar"].sharded
    result = runtime.verify(parse(step(mesh)), parse(optimized),
                            runtime.VerifyOptions(steps=3, manifest=build_manifest(report,
                                                                                   module)))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


#: jax's own per-device module of a (data=4, model=2) step: Megatron's column/row split
#: of a 2-layer MLP on ``model``, a replicated bias, clip_by_global_norm + Adam
#: (``tests/test_jax_meshes.py``'s model, captured with ``hlo_shard.jax.per_device_hlo``).
TP_CLIP_ADAM = Path(__file__).parent / "data" / "tp_clip_adam_4x2.n8.hlo"


def test_a_tensor_parallel_steps_clipped_update_is_sharded_whole_and_verifies(worker):
    """The global norm sums the tensor-parallel halves' partial norms over the model
    pairs: still the same on every device of a data group, so the whole update (not
    only the gradients' squared sums) runs on shards; ``verify`` feeds each tile's
    copies one value (as the mesh holds them) and MATCHes."""
    text = TP_CLIP_ADAM.read_text()
    result = optimize(parse(text), ShardingOptions(), force=True)
    sharded = [row for row in result.report.explanations if row.sharded]
    assert len(sharded) == 3 and all(row.ops_moved >= 15 for row in sharded)
    outcome = runtime.verify(parse(text), parse(result.text), runtime.VerifyOptions(
        steps=2, manifest=build_manifest(result.report, parse(text))))
    assert outcome.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in outcome.final()]


def _column_split_step() -> str:
    """jax's per-device module of a 2-layer MLP on a (data=4, model=2) mesh, its first
    matrix split by columns over ``model`` (the bias it adds to replicated: the
    partitioner slices it at the device's offset), Adam, donated state."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from hlo_shard.jax import per_device_hlo

    jnp = jax.numpy
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    shardings = {"w1": NamedSharding(mesh, P(None, "model")), "b1": replicated,
                 "w2": replicated, "b2": replicated}
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {"w1": jax.random.normal(keys[0], (16, 32)) * 0.1, "b1": jnp.zeros(32),
              "w2": jax.random.normal(keys[1], (32, 8)) * 0.1, "b2": jnp.zeros(8)}
    params = {name: jax.device_put(value, shardings[name]) for name, value in params.items()}
    optimizer = optax.adam(1e-3)
    state = jax.jit(optimizer.init)(params)
    # (the step count comes back on one device: replicated like the rest)
    state_shardings = jax.tree.map(lambda leaf: leaf.sharding if len(leaf.sharding.device_set)
                                   == 8 else replicated, state)
    state = jax.tree.map(jax.device_put, state, state_shardings)

    def step(p, s, x, y):
        def loss(p):
            return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)
        value, grads = jax.value_and_grad(loss)(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    jitted = jax.jit(step, donate_argnums=(0, 1),
                     in_shardings=(shardings, state_shardings, batch, batch),
                     out_shardings=(shardings, state_shardings, replicated))
    x = jax.device_put(jnp.ones((16, 16)), batch)
    y = jax.device_put(jnp.ones((16, 8)), batch)
    return per_device_hlo(jitted, params, state, x, y)


def test_report_reads_each_parameter_of_a_model_axis_mesh_as_what_it_is(request, tmp_path):
    """The model axis's sums of partial activations are no gradients (their elementwise
    successors are not the update), and a parameter the partitioner slices at the
    device's offset is read where its slice is read: every weight is a weight, the
    moments optimizer state (the model-axis sums made ``y`` and two weights optimizer
    state, the offset slices two weights more)."""
    from jax_train_helpers import needs_devices

    if not needs_devices(request):
        return
    from click.testing import CliRunner

    from hlo_shard.cli import main

    source = tmp_path / "step.hlo"
    source.write_text(_column_split_step())
    run = CliRunner().invoke(main, ["report", str(source), "--json"])
    assert run.exit_code == 0, run.output
    report = json.loads(run.stdout)
    kinds = {report["parameter_names"][hlo]: kind
             for hlo, kind in report["parameters"].items()}
    assert {name: kind for name, kind in kinds.items() if name.startswith("p[")} == \
        dict.fromkeys(["p['b1']", "p['b2']", "p['w1']", "p['w2']"], "weights"), kinds
    assert all(kind == "optimizer_state" for name, kind in kinds.items()
               if ".mu[" in name or ".nu[" in name), kinds
    assert "optimizer_state" not in {kinds["x"], kinds["y"]}, kinds


def test_the_summary_says_the_data_parallel_group_where_it_is_not_every_device(tmp_path):
    """On a (data=4, model=2) mesh the gradients are summed over groups of 4 of the 8
    devices: the summary line says so beside the device count (it read as if N were 8)."""
    from click.testing import CliRunner

    from hlo_shard.cli import main

    run = CliRunner().invoke(main, ["optimize", str(TP_CLIP_ADAM), "-o",
                                    str(tmp_path / "out.hlo")])
    assert run.exit_code == 0, run.output
    assert "across 8 devices (data-parallel groups of 4);" in run.stderr, run.stderr
    single = CliRunner().invoke(main, ["optimize", str(Path(__file__).parent.parent /
                                                       "fixtures" / "spmd" / "adam.n2.hlo"),
                                       "-o", str(tmp_path / "adam.hlo")])
    assert "across 2 devices;" in single.stderr, single.stderr


#: Two gradients summed over the same pairs of devices, the pairs listed in two orders.
LISTED_TWICE = f"""HloModule listed_twice, num_partitions=8
{ADD}
ENTRY e {{
  w = f32[8,4]{{1,0}} parameter(0)
  v = f32[8,4]{{1,0}} parameter(1)
  g = f32[8,4]{{1,0}} parameter(2), parameter_replication={{false}}
  h = f32[8,4]{{1,0}} parameter(3), parameter_replication={{false}}
  gs = f32[8,4]{{1,0}} all-reduce(g), channel_id=1, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=add
  hs = f32[8,4]{{1,0}} all-reduce(h), channel_id=2, replica_groups={{{{0,1}},{{4,5}},{{2,3}},{{6,7}}}}, use_global_device_ids=true, to_apply=add
  lr = f32[] constant(0.1)
  lrb = f32[8,4]{{1,0}} broadcast(lr), dimensions={{}}
  gu = f32[8,4]{{1,0}} multiply(gs, lrb)
  hu = f32[8,4]{{1,0}} multiply(hs, lrb)
  nw = f32[8,4]{{1,0}} subtract(w, gu)
  nv = f32[8,4]{{1,0}} subtract(v, hu)
  ROOT t = (f32[8,4]{{1,0}}, f32[8,4]{{1,0}}) tuple(nw, nv)
}}
"""


def test_the_same_groups_listed_in_another_order_are_the_same_groups(worker):
    """``{{0,1},{4,5},{2,3},{6,7}}`` is ``[4,2]<=[8]``: both gradients are sharded over
    those pairs (one was rejected as "its groups, 4 groups of 2 ({0,1}, …), differ from
    the data-parallel group of the module, 4 groups of 2 ({0,1}, …)"), and verify."""
    module = parse(LISTED_TWICE)
    result = optimize(module, ShardingOptions(), force=True)
    assert all(row.sharded for row in result.report.explanations), \
        [row.reason for row in result.report.explanations]
    verified = runtime.verify(parse(LISTED_TWICE), parse(result.text), runtime.VerifyOptions(
        steps=3, manifest=build_manifest(result.report, module)))
    assert verified.ok, [(leaf.index, leaf.verdict) for leaf in verified.final()]
