"""An update under a ``lax.cond`` (``optax.apply_if_finite``): every branch runs and a
select keeps the taken one's results (``conditional-speculation``), so the weight-update
sharding can shard the update; what may not run untaken stays a conditional.

Structure on the golden case's module (fast), numbers through real XLA on 4 CPU devices
with mutants the verifier must catch, and a real optax step through
``shard_weight_update`` that skips a non-finite step as jit does."""

from __future__ import annotations

from pathlib import Path

import pytest

import hlo_shard
from hlo_shard import runtime
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.graph import Rewriter
from hlo_shard.parser import parse
from hlo_shard.passes.conditional_speculation import ConditionalSpeculation, SpeculationReport
from hlo_shard.passes.pipeline import Pipeline, validate_printed
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.printer import to_text

from wus_helpers import find, optimize, row

#: The golden case: apply_if_finite's conditional of a momentum-SGD update.
FINITE = "\n".join(line for line in (Path(__file__).parent / "golden_pass" /
                                     "conditional_speculation.hlo").read_text().splitlines()
                   if not line.startswith("//"))
#: The same as a predicate conditional (true: apply).
PREDICATE = FINITE.replace(
    "idx = s32[] convert(all)\n", "").replace(
    "conditional(idx, ops, ops), branch_computations={skip, apply}",
    "conditional(all, ops, ops), true_computation=apply, false_computation=skip")


def speculate(text: str, min_shard_bytes: int = 0):
    module = parse(text)
    result = Pipeline((ConditionalSpeculation(min_shard_bytes),),
                      check=validate_printed).run(module)
    return module, result.report(SpeculationReport)


@pytest.mark.parametrize("text", [FINITE, PREDICATE], ids=["index", "predicate"])
def test_the_branches_run_and_a_select_keeps_the_taken_one(text):
    assert text.count("conditional(") == 1
    module, report = speculate(text)
    assert [(s.conditional, s.branches) for s in report.speculated] == [("c", 2)]
    assert not find(module, "conditional") and len(find(module, "select")) == 2
    assert "its 2 branches all run" in report.notes[0]


def test_the_sharding_then_shards_the_update_under_the_cond():
    """Before: 'its update runs in a conditional's branches' (kept whole)."""
    module, report = optimize(FINITE)
    assert row(report, "g").sharded, row(report, "g").reason
    assert find(module, "reduce-scatter") and not find(module, "conditional")


@pytest.mark.parametrize("edit", [
    ("nm = f32[8] add(mb, g)\n",
     "nm0 = f32[8] add(mb, g)\n  nm = f32[8] custom-call(nm0), custom_call_target=\"f\"\n"),
    ("nm = f32[8] add(mb, g)\n",
     "nm0 = f32[8] add(mb, g)\n  nm = f32[8] all-reduce(nm0), replica_groups={{0,1,2,3}}, "
     "to_apply=add\n"),
    ("zs = f32[8] broadcast(z), dimensions={}\n",
     "zs = f32[8] rng(z, z), distribution=rng_uniform\n"),
], ids=["custom-call", "collective", "rng"])
def test_a_branch_that_may_not_run_untaken_stays(edit):
    text = FINITE.replace(*edit)
    assert text != FINITE
    module, report = speculate(text)
    assert not report.speculated and find(module, "conditional")


def test_a_conditional_reading_no_gradient_of_the_cut_off_stays():
    assert not speculate(FINITE, min_shard_bytes=33)[1].speculated  # %g is 32 bytes
    assert speculate(FINITE, min_shard_bytes=32)[1].speculated
    no_gradient = FINITE.replace("ops = (f32[8], f32[8]) tuple(g, m)",
                                 "ops = (f32[8], f32[8]) tuple(w, m)")
    assert not speculate(no_gradient)[1].speculated


def test_the_module_the_gate_keeps_whole_keeps_its_conditional():
    """Running the untaken branch pays only with the update sharded: on this tiny step
    the gate keeps the module whole, and what it writes is a conditional still."""
    result = hlo_shard.optimize(parse(FINITE), ShardingOptions())
    assert result.decision is not None and result.decision.kept_whole
    assert " conditional(" in result.text


# ---------------------------------------------------------- numbers through real XLA


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 4)
    runtime.shutdown_workers()


def _verify(original: str, candidate: str, manifest=None) -> runtime.VerifyReport:
    return runtime.verify(parse(original), parse(candidate),
                          runtime.VerifyOptions(steps=3, manifest=manifest))


@pytest.mark.parametrize("text", [FINITE, PREDICATE], ids=["index", "predicate"])
def test_the_speculated_module_computes_the_same(worker, text):
    """Speculated against the conditional; a mutant whose selects keep the other branch
    must DIFFER; and the step optimized with its state sharded."""
    module, _ = speculate(text)
    result = _verify(text, to_text(module))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]
    rw = Rewriter(module.entry)
    for select in find(module, "select"):
        rw.set_operands(select, [select.operands[0], select.operands[2], select.operands[1]])
    assert not _verify(text, to_text(module)).ok
    optimized = hlo_shard.optimize(parse(text), ShardingOptions(state="sharded"), force=True)
    assert row(optimized.report, "g").sharded
    result = _verify(text, optimized.text, build_manifest(optimized.report, parse(text)))
    assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]


# ------------------------------------------------------------------- a real optax step


def _apply_if_finite_program():
    """An MLP + ``optax.apply_if_finite(adam)`` data-parallel step (jax lowers its
    ``lax.cond`` of the update to a conditional), batch sharded over 8 devices; batch
    ``i`` of ``bad`` has an infinite input, whose gradient is not finite: the step is
    skipped (weights and adam state as they were)."""
    from jax_train_helpers import (AXIS, NamedSharding, P, jax, jnp, mlp_batch, mlp_loss,
                                   mlp_params, np, optax)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), (AXIS,))
    opt = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def init():
        params = mlp_params(jax.random.PRNGKey(0))
        return params, jax.jit(opt.init)(params)

    def batch(i, bad=(1,)):
        rows = mlp_batch(jax.random.PRNGKey(100 + i), 64)
        if i in bad:
            rows["x"] = rows["x"].at[3, 0].set(jnp.inf)
        return jax.device_put(rows, NamedSharding(mesh, P(AXIS)))

    return jax.jit(step), init, batch


def test_apply_if_finite_is_sharded_and_skips_a_non_finite_step_as_jit_does(request):
    from jax_train_helpers import assert_close, needs_devices, run_forced, run_steps

    if not needs_devices(request):
        return
    step, init, batch = _apply_if_finite_program()
    for state in ("gathered", "sharded"):
        fast, final, _ = run_forced(step, state, init, batch)
        assert fast.report is not None and fast.report["sharded"] == 6, fast.report
        assert any("branches all run" in note for note in fast.report["notes"])
        # adam's update moved with each (before, only the isfinite test before the cond)
        assert all(e["ops_moved"] > 10 for e in fast.report["explanations"] if e["sharded"])
        # (the three steps cross batch 1's skip: the state matches jit's through it)
        assert_close(final, run_steps(step, init(), batch)[0])


@pytest.mark.slow  # (in this process: XLA's compile thread stays in threading's registry)
def test_install_speculates_xla_s_fused_conditional(request):
    """Under ``install()`` the hook reads XLA:CPU's fused module: the branches hold
    fusions (called once each, inlined with them) and the header has lost its device
    counts (recovered from the collectives' groups, as the sharding reads them)."""
    from jax_train_helpers import assert_close, needs_devices, run_steps

    import hlo_shard.jax as hsj

    if not needs_devices(request):
        return
    step, init, batch = _apply_if_finite_program()
    expected = run_steps(step, init(), batch)[0]
    hsj.decisions(clear=True)
    with hsj.install(force=True):
        step, init, batch = _apply_if_finite_program()  # compiled under the hook
        hooked = run_steps(step, init(), batch)[0]
    (decision,) = [d for d in hsj.decisions(clear=True) if d.module == "jit_step"
                   and not d.reused]
    assert decision.changed and decision.report is not None
    assert any("branches all run" in note for note in decision.report.notes)
    assert_close(hooked, expected)
