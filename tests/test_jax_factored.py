"""Adafactor through ``hlo_shard.jax`` with factored weights (both dimensions ≥ 128):
with ``state="sharded"`` one factored statistic per weight (the one along the dimension
its shards keep whole) is held as a 1/N shard, and training matches plain ``jax.jit``
over a few steps (after ``gather_args``)."""

from __future__ import annotations

import numpy as np

from jax_train_helpers import (MODELS, Model, assert_close, make_program, mlp_batch, mlp_loss,
                               mlp_params, needs_devices, train)

import hlo_shard.jax as hsj

N = 4


def factored_mlp_params(key):
    return mlp_params(key, sizes=(32, 128, 256, 8))  # l1.w [128, 256] is factored


def test_adafactor_factored_statistics_are_sharded_and_match_jit(request, monkeypatch):
    if not needs_devices(request):
        return
    monkeypatch.setitem(MODELS, "factored_mlp", Model(factored_mlp_params, mlp_loss, mlp_batch))
    program = make_program("factored_mlp", "adafactor", N)
    fast = hsj.shard_weight_update(program.step, state="sharded", force=True)
    (p_fast, s_fast), l_fast = train(fast, program, 4)
    sharded = {p["name"] for p in fast.report["parameters"] if p["kind"] == "sharded"}
    assert "opt_state[0].v_row['l1']['w']" in sharded  # l1.w's shards are blocks of rows
    v_row = s_fast[0].v_row["l1"]["w"]
    assert {shard.data.shape for shard in v_row.addressable_shards} == {(128 // N,)}
    (note,) = [n for n in fast.report["notes"] if "v_col['l1']['w']" in n]
    assert "the dimension whose blocks the devices hold" in note
    p_fast, s_fast = fast.gather_args(p_fast, s_fast)
    (p_jit, s_jit), l_jit = train(program.step, program, 4)
    np.testing.assert_allclose(l_fast, l_jit, rtol=1e-5, atol=1e-7)
    assert_close((p_fast, s_fast), (p_jit, s_jit))
