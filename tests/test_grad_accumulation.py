"""A gradient-accumulation training step (``lax.scan`` over 4 microbatches, gradients
summed, one optax update) as ``hlo_shard.jax.per_device_hlo`` captures it on 8 CPU
devices goes through ``fmt``, ``optimize`` and ``verify``.

With the batch over the second axis of a (2, 4) mesh, jax 0.10.2 writes the gradient
all-reduces as ``mesh[...], device_ids=([2,4]T(1,0)) {'axis_0'}`` (a mesh whose device
order is an iota transposed): the front end refused that form (exit 2). The captured
module is kept in ``tests/data`` (regenerate: ``python tests/test_grad_accumulation.py``);
the slow test captures it afresh, on a one-axis mesh too, and verifies the optimized step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CAPTURED = ROOT / "tests" / "data" / "grad_accum_scan_2x4.n8.hlo"

#: Prints the per-device module of the step for a mesh shape and the mesh axis the
#: batch is split over (argv: "2,4" "1").
_CAPTURE = r"""
import sys
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hlo_shard.jax import per_device_hlo

shape = tuple(int(v) for v in sys.argv[1].split(","))
names = tuple(f"m{i}" for i in range(len(shape)))
mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
optimizer = optax.adam(1e-3)

def loss(params, x):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"]) ** 2)

def step(params, opt_state, microbatches):
    def accumulate(grads, x):
        return jax.tree.map(jnp.add, grads, jax.grad(loss)(params, x)), None
    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, _ = jax.lax.scan(accumulate, zeros, microbatches)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

replicated = NamedSharding(mesh, P())
params = jax.device_put({"w1": jnp.ones((16, 32)) / 4, "b1": jnp.zeros(32),
                         "w2": jnp.ones((32, 4)) / 8}, replicated)
opt_state = jax.device_put(optimizer.init(params), replicated)
batch_axis = names[int(sys.argv[2])]
microbatches = jax.device_put(jnp.ones((4, 64, 16)), NamedSharding(mesh, P(None, batch_axis)))
sys.stdout.write(per_device_hlo(jax.jit(step, donate_argnums=(0, 1)), params, opt_state,
                                microbatches))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def capture(mesh_shape: str, batch_axis: int) -> str:
    run = subprocess.run([sys.executable, "-c", _CAPTURE, mesh_shape, str(batch_axis)],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hlo_shard", *args], capture_output=True,
                          text=True, env=_env(), cwd=ROOT, timeout=600)


def test_captured_step_goes_through_fmt_and_optimize(tmp_path):
    text = CAPTURED.read_text()
    assert "device_ids=([2,4]T(1,0)) {'axis_0'}" in text
    formatted = cli("fmt", str(CAPTURED))
    assert formatted.returncode == 0, formatted.stderr
    assert formatted.stdout.count("device_ids=([2,4]T(1,0)) {'axis_0'}") == \
        text.count("device_ids=([2,4]T(1,0)) {'axis_0'}")
    out = tmp_path / "optimized.hlo"
    optimized = cli("optimize", str(CAPTURED), "-o", str(out))
    assert optimized.returncode == 0, optimized.stderr
    # For XLA the mesh prints as its groups: jax's compile drops device_ids.
    assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in out.read_text()


def test_each_accumulated_gradient_is_named_by_its_weight(tmp_path):
    """The gradients' all-reduces sit in the scan's body, and the rows name the ones
    moved after the loop: each row still says whose gradient it is (the body's sum
    flows into one accumulator, whose sum after the loop updates one weight), not
    null."""
    run = cli("optimize", str(CAPTURED), "-o", str(tmp_path / "out.hlo"), "--json")
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)["explanations"]
    assert sorted(row["gradient_of"] for row in rows) == \
        ["params['b1']", "params['w1']", "params['w2']"], rows


#: A scan over two stacked layers inside the scan over microbatches (MaxText's
#: scan_layers with gradient accumulation), on 8 devices.
_NESTED_CAPTURE = r"""
import sys
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hlo_shard.jax import per_device_hlo

mesh = Mesh(np.array(jax.devices()), ("data",))
optimizer = optax.adam(1e-3)

def loss(params, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None
    h, _ = jax.lax.scan(layer, x @ params["embed"], params["layers"])
    return jnp.mean(h ** 2)

def step(params, opt_state, microbatches):
    def accumulate(grads, x):
        return jax.tree.map(jnp.add, grads, jax.grad(loss)(params, x)), None
    grads, _ = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), microbatches)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

replicated = NamedSharding(mesh, P())
params = jax.device_put({"embed": jnp.ones((16, 32)) / 4,
                         "layers": jnp.ones((2, 32, 32)) / 8}, replicated)
opt_state = jax.device_put(optimizer.init(params), replicated)
microbatches = jax.device_put(jnp.ones((4, 64, 16)), NamedSharding(mesh, P(None, "data")))
sys.stdout.write(per_device_hlo(jax.jit(step, donate_argnums=(0, 1)), params, opt_state,
                                microbatches))
"""


@pytest.fixture(scope="module")
def nested_capture(tmp_path_factory) -> Path:
    """:data:`_NESTED_CAPTURE`'s module, captured once for the tests reading it."""
    run = subprocess.run([sys.executable, "-c", _NESTED_CAPTURE], capture_output=True,
                         text=True, env=_env(), cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    source = tmp_path_factory.mktemp("nested") / "nested.hlo"
    source.write_text(run.stdout)
    return source


def test_gradients_summed_in_a_scan_over_layers_inside_the_accumulation_are_named(
        tmp_path, nested_capture):
    """The stacked layers' gradient is all-reduced in the inner scan's body, written
    into a zero-started stacked slot, added into the accumulation's slot: named through
    both loops, also once moved out of both (it was null, as a probe found on a
    MaxText-style scan_layers step with accumulation)."""
    run = cli("optimize", str(nested_capture), "-o", str(tmp_path / "out.hlo"), "--json",
              "--force")
    assert run.returncode == 0, run.stderr
    rows = [row for row in json.loads(run.stdout)["explanations"] if row["shape"] != "f32[]"]
    assert sorted(str(row["gradient_of"]) for row in rows) == \
        ["params['embed']", "params['layers']"], rows
    assert all(row["sharded"] for row in rows), rows
    # Each row names the sum the motion wrote after both loops, and the input's sum it
    # came from, in the inner scan's body (the input has no instruction of the row's).
    text = nested_capture.read_text()
    for row in rows:
        computation, all_reduce = row["moved_from"].split("/")
        body = text[text.index(f"%{computation} "):]
        assert f"%{all_reduce} = " in body[:body.index("\n}")], row
        assert computation != row["computation"], row
    explained = cli("optimize", str(nested_capture), "-o", str(tmp_path / "out.hlo"),
                    "--explain", "--force").stderr
    assert f"moved from {rows[0]['moved_from']})" in explained, explained


def test_report_reads_the_weights_of_gradients_accumulated_through_two_loops(nested_capture):
    """The update after the accumulation reads what the microbatch loop added up from
    the layer scan's stacked sums: ``report`` counts the stacked layers as weights (with
    Adam's two moments as optimizer state) and charges each weight the sums sent inside
    both loops: 4 microbatches x 2 layers x 2(N-1)/N of a layer's slice, 4 x 2(N-1)/N of
    the embedding (it called the stacked layers and their moments "other parameters",
    with no row, as a probe found on a MaxText-style step)."""
    report = json.loads(cli("report", str(nested_capture), "--json").stdout)
    weights = (16 * 32 + 2 * 32 * 32) * 4  # embed, layers in f32
    assert report["memory"]["peak_breakdown"]["weights"] == weights
    assert report["memory"]["peak_breakdown"]["optimizer_state"] == 2 * weights
    sent = {row["name"]: row["collective_bytes"] for row in report["weights"].values()}
    ring = 2 * 7 / 8
    assert sent == pytest.approx({"params['embed']": 4 * ring * 16 * 32 * 4,
                                  "params['layers']": 4 * 2 * ring * 32 * 32 * 4}), sent


def test_report_and_scale_read_the_update_of_the_accumulated_gradients(tmp_path):
    """The gradients are summed inside the loop; the update after it reads the loop's
    accumulators: ``report`` counts its weights and optimizer state as such (they read
    0 B, all "other parameters", before), and ``scale --parameters`` projects the model
    (it refused: no weight parameters)."""
    report = json.loads(cli("report", str(CAPTURED), "--json").stdout)["memory"]
    weights = (16 * 32 + 32 + 32 * 4) * 4  # w1, b1, w2 in f32
    assert report["peak_breakdown"]["weights"] == weights
    assert report["peak_breakdown"]["optimizer_state"] == 2 * weights  # Adam's mu, nu
    original = tmp_path / "step.hlo"
    original.write_text(capture("8", 0))
    run = cli("scale", str(original), "--parameters", "10M", "--replicas", "8,64")
    assert run.returncode == 0, run.stderr
    assert re.search(r"^\s+64\s+\S+ ms", run.stdout, re.M), run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, batch_axis", [("8", 0), ("2,4", 1)])
def test_fresh_capture_optimizes_and_verifies(tmp_path, mesh_shape, batch_axis):
    original, optimized = tmp_path / "step.hlo", tmp_path / "optimized.hlo"
    original.write_text(capture(mesh_shape, batch_axis))
    assert re.search(r"replica_groups=mesh\[", original.read_text())
    assert cli("fmt", str(original)).returncode == 0
    run = cli("optimize", str(original), "-o", str(optimized))
    assert run.returncode == 0, run.stderr
    run = cli("verify", str(original), str(optimized))
    assert run.returncode == 0 and "MATCH" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


#: The step through ``shard_weight_update`` (forced) for 3 steps against plain jit: the
#: executable's text prints the mesh as explicit groups, or XLA would run the iota
#: order's groups ({0,2,4,6},{1,3,5,7}) instead of the mesh's ({0,1,2,3},{4,5,6,7}).
_JAX_PATH = _CAPTURE.split("sys.stdout.write(")[0] + r"""
import warnings
import hlo_shard.jax as hsj
key = jax.random.PRNGKey(0)
start = {"w1": jax.random.normal(key, (16, 32)) / 4, "b1": jnp.zeros(32),
         "w2": jax.random.normal(key, (32, 4)) / 8}
microbatches = jax.device_put(jax.random.normal(key, (4, 64, 16)),
                              NamedSharding(mesh, P(None, batch_axis)))
def run(step_fn):
    params = jax.device_put(start, replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    for _ in range(3):
        params, opt_state = step_fn(params, opt_state, microbatches)
    return params
expected = run(jax.jit(step))
with warnings.catch_warnings():
    warnings.simplefilter("error")
    fast = hsj.shard_weight_update(jax.jit(step), state=sys.argv[3], force=True)
    got = run(fast)
assert fast.report["sharded"] == fast.report["gradients"] == 3, fast.report
for name in start:
    np.testing.assert_allclose(np.asarray(got[name]), np.asarray(expected[name]), rtol=1e-5,
                               atol=1e-6)
print("OK")
"""


@pytest.mark.slow
@pytest.mark.parametrize("state", ["gathered", "sharded"])
def test_jax_path_shards_the_step_on_a_permuted_mesh(state):
    run = subprocess.run([sys.executable, "-c", _JAX_PATH, "2,4", "1", state],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]


if __name__ == "__main__":
    CAPTURED.write_text(capture("2,4", 1))
