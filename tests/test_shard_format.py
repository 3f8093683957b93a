"""The shard format's two adapters (numpy for the runtime, jax.numpy for the JAX front
end) cut a value exactly as the HLO the weight-update pass emits expects it: checked
by hand on a transposed, padded case, against each other, and against the pass's own
module run on XLA."""

from __future__ import annotations

import numpy as np
import pytest

from hlo_shard import runtime
from hlo_shard.jax._program import StateLayout, _gather, _shard
from hlo_shard.shard_format import ShardFormat
from wus_helpers import ADD, optimize

#: [2,3] read column-major (perm (1, 0)) over 4 devices: 6 elements, chunks of 2, 2 padding.
COLUMNS = ShardFormat((2, 3), (1, 0), 4)
VALUE = np.arange(6, dtype=np.float32).reshape(2, 3)


def test_numpy_adapter_by_hand():
    assert (COLUMNS.shard_len, COLUMNS.padding) == (2, 2)
    shards = COLUMNS.to_shards(VALUE)
    assert [s.tolist() for s in shards] == [[0, 3], [1, 4], [2, 5], [0, 0]]
    np.testing.assert_array_equal(COLUMNS.from_shards(shards), VALUE)
    with pytest.raises(ValueError, match="takes 4 shards"):
        COLUMNS.from_shards(shards[:3])


def test_jax_adapter_cuts_as_the_numpy_one():
    expected = np.concatenate(COLUMNS.to_shards(VALUE))
    plain = StateLayout(COLUMNS)
    np.testing.assert_array_equal(np.asarray(_shard(VALUE, plain)), expected)
    np.testing.assert_array_equal(np.asarray(_gather(expected, plain)), VALUE)
    # Two groups of two (a data × model mesh): device k holds chunk ranks[k] of its group.
    pairs = ShardFormat((2, 3), (1, 0), 2)
    grouped = StateLayout(pairs, ranks=(0, 1, 0, 1))
    chunks = pairs.to_shards(VALUE)
    np.testing.assert_array_equal(np.asarray(_shard(VALUE, grouped)),
                                  np.concatenate([chunks[r] for r in grouped.ranks or ()]))
    np.testing.assert_array_equal(
        np.asarray(_gather(np.asarray(_shard(VALUE, grouped)), grouped)), VALUE)


#: Momentum SGD whose [3,5] state is stored column-major, at N = 4: 15 elements, chunks
#: of 4, one padding lane, flattened in the transposed (physical) order.
MOMENTUM = f"""HloModule mom, replica_count=4, input_output_alias={{ {{0}}: (0, {{}}, may-alias), {{1}}: (1, {{}}, may-alias) }}
{ADD}
ENTRY e {{ w = f32[3,5]{{0,1}} parameter(0) m = f32[3,5]{{0,1}} parameter(1)
 g = f32[3,5]{{0,1}} parameter(2), parameter_replication={{false}}
 ar = f32[3,5]{{0,1}} all-reduce(g), replica_groups={{{{0,1,2,3}}}}, to_apply=add
 b = f32[] constant(0.9) bb = f32[3,5]{{0,1}} broadcast(b), dimensions={{}}
 mm = f32[3,5]{{0,1}} multiply(m, bb) nm = f32[3,5]{{0,1}} add(mm, ar)
 nw = f32[3,5]{{0,1}} subtract(w, nm)
 ROOT t = (f32[3,5]{{0,1}}, f32[3,5]{{0,1}}) tuple(nw, nm) }}
"""


def test_numpy_shards_are_what_the_passs_module_reads_and_writes():
    module, report = optimize(MOMENTUM, state="sharded", params="sharded")
    kinds = [p.kind for p in report.parameters], [o.kind for o in report.outputs]
    assert kinds == (["sharded", "sharded", "per-device"], ["sharded", "sharded"])
    fmt = ShardFormat((3, 5), (1, 0), 4)  # the stored (transposed) order, one padding lane
    assert {entry.format for entry in (*report.parameters[:2], *report.outputs)} == {fmt}
    rng = np.random.default_rng(0)
    w, m = (rng.standard_normal((3, 5)).astype(np.float32) for _ in range(2))
    grads = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(4)]
    worker = runtime.get_worker("cpu", 4)
    try:
        original = runtime.load(runtime.read_module(MOMENTUM), 4, worker=worker)
        candidate = runtime.load(module, 4, worker=worker)
        want = original(w, m, grads)
        got = candidate(fmt.to_shards(w), fmt.to_shards(m), grads)
    finally:
        runtime.shutdown_workers()
    for leaf in range(2):
        expected = fmt.to_shards(want[leaf][0])  # padding lanes zero, as the pass keeps them
        for device in range(4):
            np.testing.assert_allclose(got[leaf][device], expected[device], rtol=1e-6)
        np.testing.assert_allclose(fmt.from_shards(got[leaf]), want[leaf][0], rtol=1e-6)
