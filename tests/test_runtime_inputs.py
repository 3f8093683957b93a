"""Inputs (roles, positivity, seeded values, npz), the manifest, and comparisons.
Pure Python: no worker is started here."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from hlo_shard import runtime
from hlo_shard.errors import HloShardError
from hlo_shard.ir import ArrayShape, Layout
from hlo_shard.parser import parse
from hlo_shard.shard_format import ShardFormat
from test_complexity import nested_calls

ADD = "add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }\n"

#: Weight-update-only module: local gradient g is summed; w, m, nu are state;
#: nu feeds a sqrt and must be positive; lr is a replicated hyperparameter.
ADAM_UPDATE = "HloModule adam, replica_count=2\n" + ADD + """ENTRY e {
 w = f32[8] parameter(0) m = f32[8] parameter(1) nu = f32[8] parameter(2)
 g = f32[8] parameter(3) lr = f32[] parameter(4) count = s32[] parameter(5)
 gs = f32[8] all-reduce(g), replica_groups={{0,1}}, to_apply=add
 b1 = f32[8] constant({0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9})
 mb = f32[8] multiply(b1, m) m2 = f32[8] add(mb, gs)
 g2 = f32[8] multiply(gs, gs) nb = f32[8] multiply(b1, nu) nu2 = f32[8] add(nb, g2)
 s = f32[8] sqrt(nu2) q = f32[8] divide(m2, s)
 lrb = f32[8] broadcast(lr), dimensions={} u = f32[8] multiply(q, lrb)
 w2 = f32[8] subtract(w, u)
 one = s32[] constant(1) c2 = s32[] add(count, one)
 ROOT t = (f32[8], f32[8], f32[8], s32[]) tuple(w2, m2, nu2, c2) }
"""

#: A training step: batch x reaches the all-reduce through a dot only.
TRAIN = "HloModule train, replica_count=2\n" + ADD + """ENTRY e {
 w = f32[4,3] parameter(0) x = f32[5,4] parameter(1)
 y = f32[5,3] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
 gw = f32[4,3] dot(x, y), lhs_contracting_dims={0}, rhs_contracting_dims={0}
 g = f32[4,3] all-reduce(gw), replica_groups={{0,1}}, to_apply=add
 ROOT w2 = f32[4,3] subtract(w, g) }
"""


# --------------------------------------------------------------------------- roles


def test_default_roles_of_an_optimizer_update():
    roles = runtime.parameter_roles(parse(ADAM_UPDATE))
    assert [(r.name, r.role) for r in roles] == [
        ("w", "replicated"), ("m", "replicated"), ("nu", "replicated"),
        ("g", "per-device"), ("lr", "replicated"), ("count", "replicated")]
    assert {r.source for r in roles} == {"analysis"}


def test_default_roles_of_a_training_step():
    roles = runtime.default_roles(parse(TRAIN))
    assert roles == {0: "replicated", 1: "per-device"}


LOOP = "HloModule loop, replica_count=2\n" + ADD + """cond {
 s = (f32[4], f32[2,4], s32[]) parameter(0) i = s32[] get-tuple-element(s), index=2
 three = s32[] constant(3) ROOT lt = pred[] compare(i, three), direction=LT }
body { s = (f32[4], f32[2,4], s32[]) parameter(0)
 w = f32[4] get-tuple-element(s), index=0 x = f32[2,4] get-tuple-element(s), index=1
 i = s32[] get-tuple-element(s), index=2 z = f32[] constant(0)
 r = f32[4] reduce(x, z), dimensions={0}, to_apply=add
 g = f32[4] all-reduce(r), replica_groups={{0,1}}, to_apply=add
 w2 = f32[4] subtract(w, g) one = s32[] constant(1) i2 = s32[] add(i, one)
 ROOT t = (f32[4], f32[2,4], s32[]) tuple(w2, x, i2) }
ENTRY e { w = f32[4] parameter(0) x = f32[2,4] parameter(1) z = s32[] constant(0)
 t = (f32[4], f32[2,4], s32[]) tuple(w, x, z)
 l = (f32[4], f32[2,4], s32[]) while(t), condition=cond, body=body
 ROOT o = f32[4] get-tuple-element(l), index=0 }
"""


def test_default_roles_follow_tuple_elements_through_loops():
    assert runtime.default_roles(parse(LOOP)) == {0: "replicated", 1: "per-device"}


#: Weights w and batch x go through one opt-barrier (jax.lax.optimization_barrier); w
#: reaches the output through exponential as well (HLO names, not jax's exp).
BARRIER = "HloModule barrier, replica_count=2\n" + ADD + """ENTRY e {
 w = f32[4,3] parameter(0) x = f32[5,4] parameter(1) v = f32[4,3] parameter(2)
 t = (f32[4,3], f32[5,4]) tuple(w, x)
 o = (f32[4,3], f32[5,4]) opt-barrier(t)
 wb = f32[4,3] get-tuple-element(o), index=0 xb = f32[5,4] get-tuple-element(o), index=1
 y = f32[5,3] dot(xb, wb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
 yv = f32[5,3] dot(xb, v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
 s = f32[5,3] add(y, yv)
 gw = f32[4,3] dot(xb, s), lhs_contracting_dims={0}, rhs_contracting_dims={0}
 g = f32[4,3] all-reduce(gw), replica_groups={{0,1}}, to_apply=add
 w2 = f32[4,3] subtract(wb, g) ev = f32[4,3] exponential(v) v2 = f32[4,3] subtract(ev, g)
 ROOT r = (f32[4,3], f32[4,3]) tuple(w2, v2) }
"""


def test_default_roles_keep_leaves_apart_through_opt_barrier_and_know_hlo_names():
    """Weights through an opt-barrier (and state through exponential) are state updated
    in place; the batch carried through the same barrier stays per-device. The table
    once named jax primitives (optimization-barrier, exp), which never matched, so w and
    v were per-device; merged barrier leaves would make x replicated."""
    assert runtime.default_roles(parse(BARRIER)) == {
        0: "replicated", 1: "per-device", 2: "replicated"}


def test_positive_demand_crosses_opt_barrier_and_log_plus_one():
    module = parse("HloModule m\nENTRY e {\n"
                   " a = f32[4] parameter(0) b = f32[4] parameter(1) c = f32[4] parameter(2)\n"
                   " t = (f32[4], f32[4]) tuple(a, b) o = (f32[4], f32[4]) opt-barrier(t)\n"
                   " ob = f32[4] get-tuple-element(o), index=1 s = f32[4] sqrt(ob)\n"
                   " l = f32[4] log-plus-one(c) ROOT r = f32[4] add(s, l) }")
    assert runtime.positive_parameters(module) == {1, 2}


def test_explicit_list_then_manifest_then_sharding_then_replication():
    module = parse("HloModule m, num_partitions=2\nENTRY e {\n"
                   " a = f32[2] parameter(0), sharding={replicated}\n"
                   " b = f32[2] parameter(1), sharding={devices=[2]<=[2]}\n"
                   " c = f32[2] parameter(2), sharding={devices=[1,2]<=[2] last_tile_dim_replicate}\n"
                   " d = f32[2] parameter(3), parameter_replication={false}\n"
                   " ROOT t = (f32[2], f32[2], f32[2], f32[2]) tuple(a, b, c, d) }")
    roles = runtime.parameter_roles(module)
    assert [(r.role, r.source) for r in roles] == [
        ("replicated", "sharding"), ("per-device", "sharding"), ("replicated", "sharding"),
        ("per-device", "parameter_replication")]
    explicit = runtime.parameter_roles(module, per_device=[0])
    assert [r.role for r in explicit] == ["per-device", "replicated", "replicated", "replicated"]
    manifest = runtime.parse_manifest(_manifest_json(parameters=[
        {"index": 0, "original": 1, "kind": "replicated", "shape": [2], "element_type": "f32"}]))
    assert runtime.parameter_roles(module, manifest=manifest)[1].source == "manifest"
    with pytest.raises(HloShardError, match="no parameter 9"):
        runtime.parameter_roles(module, per_device=[9])


def test_positive_parameters_follow_demands_backwards():
    assert runtime.positive_parameters(parse(ADAM_UPDATE)) == {2}, \
        "nu feeds sqrt through add/multiply; g only through a square"


def test_positive_demand_crosses_fusions():
    module = parse("HloModule m\nf { p = f32[4] parameter(0) ROOT s = f32[4] rsqrt(p) }\n"
                   "ENTRY e { a = f32[4] parameter(0) b = f32[4] parameter(1)\n"
                   " c = f32[4] convert(a) ROOT r = f32[4] fusion(c), kind=kLoop, calls=f }")
    assert runtime.positive_parameters(module) == {0}



def test_roles_and_demands_follow_calls_nested_past_the_recursion_limit():
    """Both analyses follow calls on an explicit stack: nesting three times Python's
    recursion limit reads as one level does (verify said "input nests too deeply")."""
    import sys

    deep = 3 * sys.getrecursionlimit()
    for depth in (1, deep):  # x (parameter 0) goes through the calls, the weight w not
        calls = 4 * depth  # nested_calls' instructions per level
        assert runtime.default_roles(parse(nested_calls(calls))) == {
            0: "per-device", 1: "replicated"}
        assert runtime.positive_parameters(parse(nested_calls(calls, "rsqrt"))) == {0}
        assert runtime.positive_parameters(parse(nested_calls(calls))) == set()


# ---------------------------------------------------------------------- generation


def test_inputs_are_seeded_and_follow_roles():
    module = parse(ADAM_UPDATE)
    roles = runtime.parameter_roles(module)
    first = runtime.generate_inputs(module, roles, 2, seed=5)
    again = runtime.generate_inputs(module, roles, 2, seed=5)
    other = runtime.generate_inputs(module, roles, 2, seed=6)
    for a, b in zip(first, again):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    assert not np.array_equal(first[0][0], other[0][0])
    w, nu, g, count = first[0], first[2], first[3], first[5]
    np.testing.assert_array_equal(w[0], w[1])          # replicated
    assert not np.array_equal(g[0], g[1])              # per-device
    assert np.all(nu[0] > 0) and np.any(w[0] < 0)      # positive only where needed
    assert count[0].dtype == np.int32 and 1 <= int(count[0]) <= 4
    assert np.max(np.abs(w[0])) < 1


@pytest.mark.parametrize("element_type,dtype", [
    ("bf16", ml_dtypes.bfloat16), ("f16", np.float16), ("pred", np.bool_), ("u8", np.uint8),
    ("c64", np.complex64), ("f8e4m3fn", ml_dtypes.float8_e4m3fn), ("s4", ml_dtypes.int4)])
def test_values_for_every_dtype(element_type, dtype):
    value = runtime.inputs.random_value(ArrayShape(element_type, (3, 2)),
                                        np.random.default_rng(0))
    assert value.dtype == np.dtype(dtype) and value.shape == (3, 2)


def test_npz_inputs(tmp_path):
    module = parse(TRAIN)
    path = tmp_path / "in.npz"
    w = np.ones((4, 3), np.float32)
    xs = np.arange(2 * 5 * 4, dtype=np.float64).reshape(2, 5, 4)
    np.savez(path, p0=w, x=xs)
    values = runtime.load_npz(path, module, 2)
    assert values[0][0] is values[0][1]
    assert values[1][1].dtype == np.float32 and values[1][1][0, 0] == 20
    np.savez(path, p0=np.ones(3))
    with pytest.raises(HloShardError, match=r"needs \(4, 3\)"):
        runtime.load_npz(path, module, 2)
    np.savez(path, nope=np.ones(3))
    with pytest.raises(HloShardError, match="names no entry parameter"):
        runtime.load_npz(path, module, 2)
    tupled = parse("HloModule m\nENTRY e { p = (f32[2], f32[]) parameter(0)\n"
                   " ROOT r = f32[2] get-tuple-element(p), index=0 }")
    np.savez(path, p0=np.ones(2))
    with pytest.raises(HloShardError, match="tuple-shaped entry parameters"):
        runtime.load_npz(path, tupled, 2)  # once an AttributeError on .element_type


# ------------------------------------------------------------------------ manifest


def _manifest_json(**sections) -> dict:
    return {"format": "hlo-shard-manifest", "version": 1, "devices": 2, "parameters": [],
            "outputs": [], **sections}


def test_manifest_round_trip_and_validation(tmp_path):
    data = _manifest_json(parameters=[
        {"index": 0, "original": 0, "kind": "sharded", "shape": [3, 2], "element_type": "f32",
         "layout": [0, 1], "shard": {"length": 3, "padding": 0}}],
        feedback=[{"output": 0, "parameter": 0}])
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    manifest = runtime.load_manifest(path)
    assert manifest.parameters[0].shard.format.shard_len == 3 and manifest.feedback == ((0, 0),)
    assert runtime.manifest_to_json(manifest) == data | {"parameters": [
        data["parameters"][0] | {"layout": [0, 1]}]}
    bad = json.loads(json.dumps(data))
    bad["parameters"][0]["shard"]["length"] = 2
    with pytest.raises(HloShardError, match=r"length 2 × 2 devices != 6 elements"):
        runtime.parse_manifest(bad)
    bad["parameters"][0]["shard"] |= {"length": 4, "padding": 2}  # fits, but not the format
    with pytest.raises(HloShardError, match=r"length 4 is not ⌈6 elements / 2 devices⌉ = 3"):
        runtime.parse_manifest(bad)
    with pytest.raises(HloShardError, match="not an hlo-shard-manifest"):
        runtime.parse_manifest({"version": 1})
    path.write_text("{")
    with pytest.raises(HloShardError, match="not valid JSON"):
        runtime.load_manifest(path)


def test_physical_order_flattening():
    value = np.arange(6).reshape(2, 3)
    physical = {layout: ShardFormat.of(ArrayShape("s64", (2, 3), (), Layout(layout)), 1)
                for layout in ((1, 0), (0, 1))}
    np.testing.assert_array_equal(physical[1, 0].padded_flat(value), [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(physical[0, 1].padded_flat(value), [0, 3, 1, 4, 2, 5])
    for fmt in physical.values():
        np.testing.assert_array_equal(fmt.from_padded_flat(fmt.padded_flat(value)), value)


def test_shard_and_gather_with_padding_and_groups():
    record = runtime.ArrayRecord(
        0, 0, "sharded", ArrayShape("f32", (5,), (), Layout((0,))),
        shard=runtime.Shard(ShardFormat((5,), (0,), 2), replica_groups=((0, 2), (1, 3))))
    candidate = ArrayShape("f32", (3,))
    full = np.arange(5, dtype=np.float32) + 1
    chunks = [runtime.shard_value(full, record, d, 4, candidate) for d in range(4)]
    np.testing.assert_array_equal(chunks[0], [1, 2, 3])
    np.testing.assert_array_equal(chunks[2], [4, 5, 0])      # position 1 of group (0, 2)
    np.testing.assert_array_equal(chunks[3], [4, 5, 0])
    for device in range(4):
        np.testing.assert_array_equal(runtime.gather_value(chunks, record, device, candidate), full)


def test_logical_flatten_and_top_level_groups():
    manifest = runtime.parse_manifest(_manifest_json(
        devices=4, replica_groups=[[0, 2], [1, 3]], parameters=[
            {"index": 0, "original": 0, "kind": "sharded", "shape": [2, 3],
             "element_type": "f32", "layout": [0, 1],
             "shard": {"length": 3, "flatten": "logical"}}]))
    record = manifest.parameters[0]
    assert record.shard.replica_groups == ((0, 2), (1, 3))
    full = np.arange(6, dtype=np.float32).reshape(2, 3)
    chunk = runtime.shard_value(full, record, 2, 4, ArrayShape("f32", (3,)))
    np.testing.assert_array_equal(chunk, [3, 4, 5])   # row-major despite layout {0,1}
    assert runtime.manifest_to_json(manifest)["parameters"][0]["shard"]["flatten"] == "logical"


# ---------------------------------------------------------------------- comparison


def _leaf(element_type, a, b, **kw):
    shape = ArrayShape(element_type, np.shape(a[0]))
    return runtime.compare_leaf(3, shape, a, b, **kw)


def test_float_comparison_and_worst_device():
    a = [np.array([1.0, 2.0], np.float32)] * 3
    b = [a[0], a[0] + np.float32(1e-7), a[0] + np.array([0, 1e-3], np.float32)]
    result = _leaf("f32", a, b)
    assert result.verdict == "differ" and result.worst_device == 2 and result.mismatched == 1
    assert result.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert result.max_rel == pytest.approx(5e-4, rel=1e-3)
    assert _leaf("f32", a, b, rtol=1e-2).ok


def test_nan_positions_and_infinities_must_agree():
    a = [np.array([np.nan, np.inf, 1.0], np.float32)]
    assert _leaf("f32", a, [a[0].copy()]).ok
    assert _leaf("f32", a, [np.array([1.0, np.inf, 1.0], np.float32)]).verdict == "nan-mismatch"
    assert _leaf("f32", a, [np.array([np.nan, -np.inf, 1.0], np.float32)]).verdict == "differ"


def test_integers_are_exact_and_bf16_is_looser():
    assert _leaf("s32", [np.array([1, 2])], [np.array([1, 3])]).verdict == "differ"
    assert _leaf("s32", [np.array([1, 2])], [np.array([1, 2])], rtol=1, atol=1).ok
    a = [np.array([1.0, 2.0], ml_dtypes.bfloat16)]
    b = [np.array([1.0, 2.015625], ml_dtypes.bfloat16)]  # one bf16 ulp at 2
    assert _leaf("bf16", a, b).ok and not _leaf("f32", [x.astype(np.float32) for x in a],
                                                 [x.astype(np.float32) for x in b]).ok


def test_shape_mismatch_is_reported():
    result = _leaf("f32", [np.zeros(2, np.float32)], [np.zeros(3, np.float32)])
    assert result.verdict == "shape-mismatch" and "device 0" in result.detail


#: A (data=4, model=2) mesh's tensor-parallel weight: tiled over the model axis,
#: replicated over the data axis (devices 0, 2, 4, 6 hold one tile, 1, 3, 5, 7 the other).
TENSOR_PARALLEL = """HloModule tp, num_partitions=8
ENTRY e {
  w = f32[4,3] parameter(0), sharding={devices=[1,2,4]<=[4,2]T(1,0) last_tile_dim_replicate}
  x = f32[2,4] parameter(1), sharding={devices=[4,1,2]<=[8] last_tile_dim_replicate}
  ROOT d = f32[2,3] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_tile_replicated_over_devices_gets_one_value_on_each():
    """The module may rely on the copies of a tile being equal (the pass slices such a
    weight's update over the data groups): verify's inputs hold one value per tile, in
    every regime, not one per device."""
    module = parse(TENSOR_PARALLEL)
    w, x = runtime.parameter_roles(module)
    assert (w.role, w.shares) == (runtime.PER_DEVICE, (0, 1, 0, 1, 0, 1, 0, 1))
    assert x.shares == (0, 0, 2, 2, 4, 4, 6, 6)
    values = runtime.generate_inputs(module, [w, x], 8)
    assert not np.array_equal(values[0][0], values[0][1])
    for step, regime in enumerate(runtime.REGIMES):
        regime_values, _ = runtime.regime_inputs(module, [w, x], 8, 0, step, regime)
        for inputs in (values, regime_values):
            for device in range(8):
                np.testing.assert_array_equal(inputs[0][device], inputs[0][device % 2])
