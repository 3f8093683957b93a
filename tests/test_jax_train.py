"""Training loops through ``hlo_shard.jax`` against plain ``jax.jit``: real optax
optimizers, real XLA on N CPU devices, both state modes (after ``gather_*``).

The default suite runs a short representative set (20 steps each: a few seconds a
case on two cores, mostly the three compiles); ``@slow`` runs the whole
model × optimizer × N matrix for 50 steps (``make test-all``).
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_train_helpers import (MODELS, OPTIMIZERS, assert_close, make_program,
                               needs_devices, train)

import hlo_shard.jax as hsj

QUICK = [("mlp", "adam", 8, "gathered"), ("mlp", "adamw_clip", 4, "sharded"),
         ("transformer", "adafactor", 2, "sharded"), ("conv", "sgd_momentum", 4, "gathered")]
FULL = [(m, o, n, s) for m in MODELS for o in OPTIMIZERS for n in (2, 4, 8)
        for s in ("gathered", "sharded") if (m, o, n, s) not in QUICK]


def run_against_jit(model: str, optimizer: str, n: int, state: str, steps: int):
    program = make_program(model, optimizer, n)
    fast = hsj.shard_weight_update(program.step, state=state, force=True)
    (p_fast, s_fast), l_fast = train(fast, program, steps)
    assert fast.report is not None and fast.report["sharded"] > 0, "nothing was sharded"
    if state == "sharded":
        assert any(p["kind"] == "sharded" for p in fast.report["parameters"])
    p_fast, s_fast = fast.gather_args(p_fast, s_fast)
    (p_jit, s_jit), l_jit = train(program.step, program, steps)
    np.testing.assert_allclose(l_fast, l_jit, rtol=1e-5, atol=1e-7)
    return assert_close((p_fast, s_fast), (p_jit, s_jit))


@pytest.mark.parametrize("model,optimizer,n,state", QUICK)
def test_training_matches_jit(request, model, optimizer, n, state):
    if needs_devices(request):
        run_against_jit(model, optimizer, n, state, steps=20)


@pytest.mark.slow
@pytest.mark.parametrize("model,optimizer,n,state", FULL)
def test_training_matches_jit_all(request, model, optimizer, n, state):
    if needs_devices(request):
        worst = run_against_jit(model, optimizer, n, state, steps=50)
        print(model, optimizer, n, state, "worst relative difference",
              max(worst.values()), max(worst, key=worst.get))
