"""Telling weights apart by the elements an update computes from one for one.

A model that repeats one shape in every layer, clipped by its global norm and donated
by jit as a bare ``buffer_donor`` (no ``input_output_alias`` to pair parameters with
outputs): a reach through every operand joins every gradient to every update (the norm)
and every weight to every new weight (backpropagation). Only the optimizer's elementwise
path keeps each apart, so ``--explain`` names each gradient's weight and ``--params
sharded`` pairs each weight with its own next value.
"""

from __future__ import annotations

import pytest

from jax_train_helpers import jax, needs_devices

from hlo_shard import optimize, parse, runtime
from hlo_shard.analysis.element_flow import ElementOperands
from hlo_shard.analysis.names import user_names
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.passes.weight_update import ShardingOptions

WIDTH = 32
LAYERS = 3


def _same_width_step(fsdp: bool = False) -> str:
    """jax's per-device module of a 3-layer MLP, every layer WIDTH x WIDTH,
    clip_by_global_norm + AdamW, donated state, data-parallel over 8 CPU devices (``fsdp``:
    a (data=2, fsdp=4) mesh, each matrix's rows sharded over ``fsdp``, MaxText's form)."""
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    # (jit's own text, donors bare: per_device_hlo would alias them to their next values)
    from hlo_shard.jax._capture import capture

    jnp = jax.numpy
    mesh = Mesh(np.array(jax.devices()[:8]).reshape((2, 4) if fsdp else (8,)),
                ("data", "fsdp") if fsdp else ("data",))
    keys = jax.random.split(jax.random.PRNGKey(0), LAYERS)
    params = {f"l{i}": {"w": jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH ** 0.5,
                        "b": jnp.zeros((WIDTH,))} for i, k in enumerate(keys)}
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def loss(p, batch):
        h = batch["x"]
        for i in range(LAYERS):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((h - batch["y"]) ** 2)

    def step(p, state, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value

    params = jax.tree.map(lambda leaf: jax.device_put(leaf, NamedSharding(
        mesh, P("fsdp") if fsdp and leaf.ndim == 2 else P())), params)
    state = jax.jit(optimizer.init)(params)
    batch = {k: jax.device_put(jax.random.normal(jax.random.PRNGKey(j), (16, WIDTH)),
                               NamedSharding(mesh, P(mesh.axis_names)))
             for j, k in enumerate("xy")}
    return capture(jax.jit(step, donate_argnums=(0, 1)), (params, state, batch), {}).text


def test_each_gradient_names_its_own_weight(request):
    if not needs_devices(request):
        return
    module = parse(_same_width_step())
    # The form this file is about: donated, but no parameter paired with an output.
    assert module.header.get("buffer_donor") is not None and not module.output_aliases()
    names = user_names(module)
    params = {p.parameter_number: p for p in module.entry.parameters()}
    named = {}
    for inst in module.entry.instructions:
        if inst.opcode == "all-reduce" and inst.shape.num_elements > 1:
            weight = names.gradients[(module.entry.name, inst.name, None)]
            assert params[weight].shape.dims == inst.shape.dims
            named[inst.name] = names.parameters[weight]
    assert sorted(named.values()) == sorted(f"p['l{i}']['{leaf}']" for i in range(LAYERS)
                                            for leaf in "bw")


def test_an_fsdp_gradient_already_sharded_names_its_weight(request):
    """The partitioner all-reduces a matrix's whole gradient and slices this device's
    rows: of other dimensions than the weight's shard it updates, yet its elements flow
    one for one into that shard's update, so its row names the weight."""
    if not needs_devices(request):
        return
    module = parse(_same_width_step(fsdp=True))
    names = user_names(module)
    result = optimize(parse(_same_width_step(fsdp=True)), ShardingOptions())
    already = [row for row in result.report.explanations if row.already_sharded
               and row.shape.startswith(f"f32[{WIDTH},{WIDTH}]")]
    assert sorted(names.gradient_of(row.computation, row.all_reduce, row.index) or ""
                  for row in already) \
        == [f"p['l{i}']['w']" for i in range(LAYERS)]


def test_params_sharded_pairs_every_weight_and_computes_the_same(request):
    """Paired by the parameters' element flow, every weight is kept as a shard (it was
    none of them: each new weight read every weight through backpropagation), and
    the module verifies MATCH over three fed-back steps."""
    if not needs_devices(request):
        return
    text = _same_width_step()
    result = optimize(parse(text), ShardingOptions(state="sharded", params="sharded"),
                      force=True)
    weights = result.report.weights
    assert len(weights) == 2 * LAYERS and all(row.sharded for row in weights), \
        [(row.name, row.reason) for row in weights]
    worker = runtime.get_worker("cpu", 8)
    try:
        outcome = runtime.verify(parse(text), parse(result.text), runtime.VerifyOptions(
            steps=3, manifest=build_manifest(result.report, parse(text))))
    finally:
        runtime.shutdown_workers()
    assert worker is not None and outcome.ok, \
        [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in outcome.final()]


FLOWS = """\
HloModule flows

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%scaled (p0: f32[4,8], p1: f32[]) -> f32[4,8] {
  %p0 = f32[4,8] parameter(0)
  %p1 = f32[] parameter(1)
  %bc = f32[4,8] broadcast(%p1), dimensions={}
  ROOT %m = f32[4,8] multiply(%p0, %bc)
}

%summed (q0: f32[4,8]) -> f32[4] {
  %q0 = f32[4,8] parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[4] reduce(%q0, %z), dimensions={1}, to_apply=%add
}

ENTRY %main (g: f32[4,8], s: f32[], one: f32[1,8]) -> (f32[4,8], f32[4], f32[8], f32[4,8]) {
  %g = f32[4,8] parameter(0)
  %s = f32[] parameter(1)
  %one = f32[1,8] parameter(2)
  %zero = f32[] constant(0)
  %kernel = f32[4,8] fusion(%g, %s), kind=kLoop, calls=%scaled
  %rows = f32[4] fusion(%g), kind=kInput, calls=%summed
  %flat = f32[8] reduce(%one, %zero), dimensions={0}, to_apply=%add
  %bs = f32[4,8] broadcast(%s), dimensions={}
  %times = f32[4,8] multiply(%g, %bs)
  ROOT %out = (f32[4,8], f32[4], f32[8], f32[4,8]) tuple(%kernel, %rows, %flat, %times)
}
"""


@pytest.mark.parametrize("name,operands", [
    ("kernel", ["g"]),  # an elementwise kernel: the same-shaped operand, not the scalar
    ("rows", []),  # a kernel that reduces mixes elements
    ("flat", ["one"]),  # a reduction over a size-1 dimension only is a reshape
    ("times", ["g", "bs"]),  # an elementwise op: its same-shaped operands
    ("bs", []),  # a broadcast repeats one element over many
    ("out", ["kernel", "rows", "flat", "times"]),
])
def test_which_operands_an_instruction_computes_its_elements_from(name, operands):
    module = parse(FLOWS)
    flows = ElementOperands(module)
    assert flows(module.entry, module.entry[name]) == operands
