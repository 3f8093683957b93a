"""Issue 16's verifier: updates compared as Δ = out − in, the candidate fed its own
shards with their padding, padding lanes checked zero, input regimes.

Hand-written modules on 2 devices (one pooled worker); the table of hand edits of a
real optimized Adam step is in test_verify_adversarial.py, mutants in test_mutants.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hlo_shard import runtime
from hlo_shard.errors import HloShardError
from hlo_shard.ir import ArrayShape
from hlo_shard.parser import parse
from hlo_shard.runtime.compare import (check_padding, compare_leaf, compare_update, nudged,
                                       ulp)
from hlo_shard.runtime.inputs import REGIMES, regime_inputs, regime_of

from test_verify import ADD, MOMENTUM, verify, write

#: MOMENTUM on f32[5] with the momentum sharded over 2 devices: 3 per device, the last
#: lane of device 1 padding. ``POISON`` is what the gradient is padded with (0: correct).
PADDED_ORIGINAL = "HloModule mom5, replica_count=2\n" + ADD + """ENTRY e {
 w = f32[5] parameter(0) m = f32[5] parameter(1) g = f32[5] parameter(2)
 gs = f32[5] all-reduce(g), replica_groups={{0,1}}, to_apply=add
 beta = f32[] constant(0.9) bb = f32[5] broadcast(beta), dimensions={}
 mb = f32[5] multiply(bb, m) m2 = f32[5] add(mb, gs)
 lr = f32[] constant(0.1) lb = f32[5] broadcast(lr), dimensions={}
 u = f32[5] multiply(lb, m2) w2 = f32[5] subtract(w, u)
 ROOT t = (f32[5], f32[5]) tuple(w2, m2) }
"""
PADDED_CANDIDATE = "HloModule mom5_rs, replica_count=2\n" + ADD + """ENTRY e {
 w = f32[5] parameter(0) m = f32[3] parameter(1) g = f32[5] parameter(2)
 zero = f32[] constant(0) poison = f32[] constant(POISON)
 gp = f32[6] pad(g, poison), padding=0_1
 rs = f32[3] reduce-scatter(gp), replica_groups={{0,1}}, dimensions={0}, to_apply=add
 beta = f32[] constant(0.9) bb = f32[3] broadcast(beta), dimensions={}
 mb = f32[3] multiply(bb, m) m2 = f32[3] add(mb, rs)
 wp = f32[6] pad(w, zero), padding=0_1
 rid = u32[] replica-id() k = u32[] constant(3) off = u32[] multiply(rid, k)
 ws = f32[3] dynamic-slice(wp, off), dynamic_slice_sizes={3}
 lr = f32[] constant(0.1) lb = f32[3] broadcast(lr), dimensions={}
 u = f32[3] multiply(lb, m2) w2s = f32[3] subtract(ws, u)
 w2p = f32[6] all-gather(w2s), replica_groups={{0,1}}, dimensions={0}
 w2 = f32[5] slice(w2p), slice={[0:5]}
 ROOT t = (f32[5], f32[3]) tuple(w2, m2) }
"""


def _padded_manifest() -> dict:
    full = {"shape": [5], "element_type": "f32", "layout": [0]}
    shard = {"length": 3, "padding": 1}
    return {
        "format": "hlo-shard-manifest", "version": 1, "devices": 2,
        "parameters": [{"index": 0, "original": 0, "kind": "replicated", **full},
                       {"index": 1, "original": 1, "kind": "sharded", **full, "shard": shard},
                       {"index": 2, "original": 2, "kind": "per-device", **full}],
        "outputs": [{"index": 0, "original": 0, "kind": "replicated", **full},
                    {"index": 1, "original": 1, "kind": "sharded", **full, "shard": shard}],
    }


@pytest.fixture(scope="module", autouse=True)
def worker():
    yield runtime.get_worker("cpu", 2)
    runtime.shutdown_workers()


def _padded(tmp_path, pad: str, *args: str):
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(_padded_manifest()))
    return verify(write(tmp_path, "a.hlo", PADDED_ORIGINAL),
                  write(tmp_path, "b.hlo", PADDED_CANDIDATE.replace("POISON", pad)),
                  "--manifest", str(manifest), "-q", *args)


# ----------------------------------------------------------------- the comparisons


def test_ulp_follows_the_element_type():
    assert ulp(np.array([1.0]), "f32")[0] == 2.0 ** -23
    assert ulp(np.array([1.0]), "bf16")[0] == 2.0 ** -7
    assert ulp(np.array([0.0]), "f32")[0] == float(np.float32(1e-45))


def _leaf(a, b):
    shape = ArrayShape("f32", (4,))
    return compare_leaf(0, shape, [a], [b])


def test_an_update_error_hidden_by_the_weight_is_reported():
    """w ≈ 1, Δ ≈ 1e-3: an update off by 1e-3 of itself is 1e-6 of the weight, inside
    the value tolerance; the update comparison sees it."""
    w = np.full(4, 1.0, np.float32)
    delta = np.array([1e-3, -1e-3, 5e-4, 2e-4], np.float32)
    out_a, out_b = w + delta, w + np.float32(1.001) * delta
    value = _leaf(out_a, out_b)
    assert value.ok
    update = compare_update(value, [w], [out_a], [w], [out_b])
    assert update.verdict == "update-differ" and update.update_max_rel > 5e-4
    assert "update" in update.detail


def test_a_reduction_order_error_passes_the_update_check():
    """A few ulps of the update (what summing in another order gives) are allowed."""
    w = np.linspace(0.1, 1.0, 4).astype(np.float32)
    delta = np.array([1e-3, -1e-3, 5e-4, 2e-4], np.float32)
    out_a = w + delta
    out_b = np.nextafter(out_a, np.float32(np.inf))
    leaf = compare_update(_leaf(out_a, out_b), [w], [out_a], [w], [out_b])
    assert leaf.ok and leaf.update_rtol == pytest.approx(256 * 2.0 ** -24)


def test_an_output_near_zero_by_cancellation_is_judged_by_its_update():
    """w ≈ −Δ: the result is tiny, so a reduction-order ulp of Δ is a large relative
    error of the value; the update bound allows it. An inf on one side never passes."""
    w = np.array([100.0, 200.0, -100.0, 50.0], np.float32)
    delta = np.array([-100.0, -200.0, 100.0, -50.0], np.float32) * np.float32(1 + 2 ** -20)
    out_a = w + delta
    out_b = w + delta * np.float32(1 + 2 ** -22)
    value = _leaf(out_a, out_b)
    assert value.verdict == "differ"
    assert compare_update(value, [w], [out_a], [w], [out_b]).ok
    out_inf = out_b.copy()
    out_inf[0] = np.inf
    assert not compare_update(_leaf(out_a, out_inf), [w], [out_a], [w], [out_inf]).ok


def _updates(count: int, unstable: list[int], off: dict[int, float]):
    """An update of ``count`` elements Δ ≈ 1e-3 on w = 1 whose original, nudged, moves
    the ``unstable`` elements by a tenth of their size, and a candidate off by the
    relative amounts ``off`` at those elements."""
    w = np.ones(count, np.float32)
    delta = np.full(count, 1e-3, np.float32)
    out_a = w + delta
    out_b, out_nudged = out_a.copy(), out_a.copy()
    for i in unstable:
        out_nudged[i] = w[i] + delta[i] * np.float32(1.1)
    for i, rel in off.items():
        out_b[i] = w[i] + delta[i] * np.float32(1 + rel)
    return w, out_a, out_b, out_nudged


def _excused_leaf(count, unstable, off, nudge=True):
    w, out_a, out_b, out_n = _updates(count, unstable, off)
    shape = ArrayShape("f32", (count,))
    value = compare_leaf(0, shape, [out_a], [out_b])
    return compare_update(value, [w], [out_a], [w], [out_b],
                          nudged=([w], [out_n]) if nudge else None)


def test_an_ill_conditioned_element_the_original_cannot_fix_is_excused():
    # An element of the accumulated sum moved out of its loop: the candidate rounds it
    # otherwise by 1e-2 of Δ; the original itself moves it by 1e-1 under an ulp of its
    # inputs (it verified DIFFERENT in the wide-range regime alone).
    leaf = _excused_leaf(1000, [7], {7: 1e-2})
    assert leaf.ok and leaf.excused == 1
    assert not _excused_leaf(1000, [7], {7: 1e-2}, nudge=False).ok  # (before: DIFFERENT)


def test_a_slip_on_stable_elements_is_never_excused():
    # The same error on an element the nudge leaves where it was, or on many elements
    # besides the unstable one: caught.
    stable = _excused_leaf(1000, [7], {8: 1e-2})
    assert stable.verdict == "update-differ" and stable.mismatched == 1 and stable.excused == 0
    wide = _excused_leaf(1000, [7], {i: 1e-2 for i in range(0, 1000, 10)} | {7: 1e-2})
    assert wide.verdict == "update-differ" and wide.mismatched == 100


def test_more_unstable_elements_than_a_hundredth_are_not_excused():
    # A leaf whose own update is unstable on 2 % of its elements: nothing excused (a
    # slip there would hide), the candidate's differences all count.
    unstable = list(range(0, 1000, 50))
    leaf = _excused_leaf(1000, unstable, {i: 1e-2 for i in unstable})
    assert leaf.verdict == "update-differ" and leaf.mismatched == 20 and leaf.excused == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, "bfloat16"])
def test_nudged_moves_floats_an_ulp_from_zero(dtype):
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    values = np.array([1.0, -2.0, 0.0, np.inf, np.nan, 3.5], dtype)
    moved = nudged(values).astype(np.float64)
    finite = [0, 1, 5]
    spacing = np.abs(moved[finite] - values.astype(np.float64)[finite])
    assert moved[0] > 1.0 and moved[1] < -2.0 and moved[5] > 3.5
    assert list(spacing) == [float(ml_dtypes.finfo(dtype).eps) * m for m in (1.0, 2.0, 2.0)]
    assert moved[2] == 0.0 and moved[3] == np.inf and np.isnan(moved[4])
    ints = np.array([1, 2], np.int32)
    assert nudged(ints) is ints


def test_nonzero_padding_is_reported():
    leaf = _leaf(np.zeros(4, np.float32), np.zeros(4, np.float32))
    assert check_padding(leaf, [np.zeros(2, np.float32)]).ok
    bad = check_padding(leaf, [np.array([0.0, np.nan], np.float32)])
    assert bad.verdict == "padding-nonzero" and bad.padding_nonzero == 1


# -------------------------------------------------------------------------- regimes


def test_all_cycles_the_regimes_in_order():
    names = [regime_of("all", step).name for step in range(len(REGIMES) + 1)]
    assert names == ["random", "zero-grad", "zero-state", "late-step", "wide-range", "random"]
    with pytest.raises(HloShardError, match="unknown input regime"):
        regime_of("sideways", 0)


def test_each_regime_sets_what_it_says():
    module = parse(PADDED_ORIGINAL.replace("g = f32[5] parameter(2)",
                                           "g = f32[5] parameter(2) c = s32[] parameter(3)"))
    roles = runtime.parameter_roles(module, per_device=[2])
    values = {r.name: regime_inputs(module, roles, 2, 0, 1, r) for r in REGIMES}
    (w, m, g, c), reset = values["zero-grad"]
    assert not np.any(g[0]) and not np.any(g[1]) and np.any(w[0]) and not reset
    (w, m, g, c), reset = values["zero-state"]
    assert not np.any(w[0]) and not np.any(m[0]) and c[0] == 0 and np.any(g[0])
    assert reset == {0, 1, 3}
    (w, m, g, c), reset = values["late-step"]
    assert int(c[0]) >= 2 ** 31 - 4 and reset == {3}
    (w, m, g, c), reset = values["wide-range"]
    assert all(np.all(np.isfinite(v[0])) for v in (w, m, g)) and reset == {0, 1}
    assert np.max(np.abs(g[0])) <= 100


# ------------------------------------------------------------ end to end, padding


def test_a_padded_candidate_fed_its_own_shards_matches(tmp_path):
    result = _padded(tmp_path, "0", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["steps"] == len(REGIMES) and report["regimes"][3] == "late-step"
    assert report["resharded"] == []
    momentum = report["outputs"][1]
    assert momentum["padding"] == {"nonzero": 0, "checked": 1}
    assert momentum["update"]["rtol"] > 0


@pytest.mark.parametrize("pad", ["7", "nan"])
def test_poisoned_padding_lanes_are_caught(tmp_path, pad):
    result = _padded(tmp_path, pad)
    assert result.exit_code == 1, result.output
    assert "padding-nonzero" in result.stdout and "padding lanes" in result.stdout


def test_a_learning_rate_off_by_1e4_is_caught_by_the_update_only(tmp_path):
    """Weights of 10: the error (1e-4 of an update of ~0.03) is 3e-7 of the weight."""
    npz = tmp_path / "w.npz"
    np.savez(npz, w=np.full((3, 4), 10.0, np.float32))
    original = write(tmp_path, "a.hlo", MOMENTUM)
    candidate = write(tmp_path, "b.hlo", MOMENTUM.replace("constant(0.1)", "constant(0.10001)"))
    common = ("--inputs", str(npz), "--inputs-regime", "random", "--steps", "1", "-q")
    loose = verify(original, candidate, "--update-rtol", "1", *common)
    assert loose.exit_code == 0, loose.output
    strict = verify(original, candidate, *common)
    assert strict.exit_code == 1, strict.output
    assert "update-differ" in strict.stdout and "updates Δ: f32" in strict.stdout


#: A data-parallel Adam step accumulating 4 microbatches in a ``lax.scan`` (the form
#: optax users write by hand), dumped per device on 8 CPU devices to ``argv[1]``.
ACCUMULATING_STEP = """import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import hlo_shard.jax as hsj
mesh = Mesh(np.array(jax.devices()), ("data",))
key, d = jax.random.PRNGKey(0), 256
params = {"w1": jax.random.normal(key, (d, d)) * 0.05, "b1": jnp.zeros(d),
          "w2": jax.random.normal(key, (d, d)) * 0.05}
tx = optax.adam(1e-3)
def step(params, opt, xs, ys):
    def loss(p, x, y):
        return ((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2).mean()
    def body(carry, batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        return (carry[0] + value, jax.tree.map(jnp.add, carry[1], grads)), None
    (total, grads), _ = jax.lax.scan(body, (0.0, jax.tree.map(jnp.zeros_like, params)), (xs, ys))
    updates, opt = tx.update(jax.tree.map(lambda g: g / 4, grads), opt, params)
    return optax.apply_updates(params, updates), opt, total / 4
put = lambda tree, s: jax.tree.map(lambda x: jax.device_put(x, s), tree)
replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "data"))
text = hsj.per_device_hlo(jax.jit(step, donate_argnums=(0, 1)), put(params, replicated),
                          put(tx.init(params), replicated),
                          jax.device_put(jnp.ones((4, 16, d)), rows),
                          jax.device_put(jnp.zeros((4, 16, d)), rows))
open(sys.argv[1], "w").write(text)
"""


def test_sums_moved_out_of_an_accumulation_loop_verify_in_the_wide_range_regime(tmp_path):
    """The step optimize writes by default moves the accumulated all-reduces out of the
    loop: the same sums in another order. With wide-range inputs a few elements of the
    Adam update are sums whose terms cancel, divided by a norm of their own size, and
    they verified DIFFERENT (probe S: 64 of 524,288 elements, the other regimes
    matching); the original itself moves them out of the bound under an ulp of its
    inputs, so verify excuses them and says how many."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    source, optimized = tmp_path / "accumulating.hlo", tmp_path / "optimized.hlo"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                              check=False, timeout=600)

    assert run("-c", ACCUMULATING_STEP, str(source)).returncode == 0
    written = run("-m", "hlo_shard", "optimize", str(source), "-o", str(optimized))
    assert written.returncode == 0 and "moved out of accumulation loops" in written.stderr
    checked = run("-m", "hlo_shard", "verify", str(source), str(optimized), "--inputs-regime",
                  "wide-range", "--steps", "3", "--json", "-q")
    report = json.loads(checked.stdout)
    assert checked.returncode == 0 and report["match"], checked.stdout[-2000:]
    assert 0 < report["excused"] <= 0.01 * 3 * 2 * 256 * 256 * 8
