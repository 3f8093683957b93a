"""Programs written by others (``bench/ecosystem``: flax nnx's MNIST CNN, flax's ImageNet
ResNet with cross-device BatchNorm, optax's nanoLM) through ``hlo_shard.jax.shard_weight_update`` in both
state modes, forced and gated, against plain ``jax.jit``: no exception into the loop,
the same numbers; and their per-device modules optimized as the command line does,
verified on XLA.

Their BatchNorm statistics are all-reduces the forward and backward pass are computed
from: sharded with the gradients they raised a dependency cycle into the loop; they stay
all-reduced (reason code ``feeds_gradients``), the rest is sharded.

Every test here is ``@slow``: each costs a model init, jit's compile, the capture and
the optimized compile, well above the default suite's seconds even for models.py's
one-block ``_ResNet1``. The default suite's BatchNorm checks are the golden case
``batch_statistic_kept_whole`` and ``tests/test_batch_statistics.py``.

Compared as ``tests/test_jax_train.py`` compares (docs/jax.md: relative 1e-4 for f32,
integers exact), except leaves whose gradient is mathematically zero — nanoLM's
attention key biases, under softmax's shift invariance: pure rounding noise that AdamW
blows up to full-size steps in either program (docs/jax.md).
"""

from __future__ import annotations

import functools
import sys
import warnings

import jax
import pytest

from jax_train_helpers import ROOT, assert_close, needs_devices

import hlo_shard.jax as hsj
from hlo_shard import runtime
from hlo_shard.cli.optimize import build_manifest, optimize_module
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update_sharding import ShardingOptions

sys.path.insert(0, str(ROOT))
from bench.ecosystem import Program, mnist_nnx, nanolm, resnet_linen  # noqa: E402

STEPS = 2
BUILDERS = {
    "resnet1": lambda: resnet_linen.build(8),
    "resnet18": lambda: resnet_linen.build(8, "ResNet18"),
    "mnist": lambda: mnist_nnx.build(8),
    "nanolm": lambda: nanolm.build(8),
}
#: Leaves whose gradient is rounding noise (their path contains one of these).
NOISE = ("['key']['bias']",)
MODES = [(name, state, force) for name in BUILDERS for state in ("gathered", "sharded")
         for force in (True, False)]


@functools.cache
def program(name: str) -> Program:
    return BUILDERS[name]()


@functools.cache
def jit_run(name: str):
    """Plain jit's final state and metrics (once per program)."""
    prog = program(name)
    return comparable(prog.run(prog.step, STEPS))


def comparable(tree):
    """Typed PRNG keys as their key data (the comparison reads numbers), the noise
    leaves (:data:`NOISE`) zeroed."""
    def leaf(path, a):
        if any(noise in jax.tree_util.keystr(path) for noise in NOISE):
            return jax.numpy.zeros_like(a)
        return jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) \
            else a
    return jax.tree_util.tree_map_with_path(leaf, tree)


def run_against_jit(name: str, state: str, force: bool) -> dict:
    prog = program(name)
    fast = hsj.shard_weight_update(prog.step, state=state, force=force)
    with warnings.catch_warnings():
        # the gate may keep a small step whole (one FallbackWarning): numbers still jit's
        warnings.simplefilter("ignore", hsj.FallbackWarning)
        final, metrics = prog.run(fast, STEPS)
    if state == "sharded" and fast.report is not None:
        final = fast.gather_args(*final)
    assert_close(comparable((final, metrics)), jit_run(name))
    return fast.report or {}


def statistics_kept_whole(report: dict, name: str) -> None:
    """Forced, a BatchNorm program keeps its statistics whole and shards the rest."""
    rows = report["explanations"]
    assert any(r["sharded"] for r in rows)
    if name != "nanolm":
        whole = [r for r in rows if r["reason_code"] == "feeds_gradients"]
        assert whole and not any(r["sharded"] for r in whole)


@pytest.mark.slow
@pytest.mark.parametrize("name,state,force", MODES)
def test_every_program_and_mode_matches_jit(request, name, state, force):
    if needs_devices(request):
        report = run_against_jit(name, state, force)
        if force:
            statistics_kept_whole(report, name)


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


def verify_optimized(name: str, state: str) -> runtime.VerifyReport:
    """The program's per-device module optimized as ``hlo-shard optimize --force`` does,
    run against the original on XLA over 3 steps."""
    prog = program(name)
    text = hsj.per_device_hlo(prog.step, *prog.init(), prog.batch(0))
    module = parse(text)
    report, optimized = optimize_module(module, ShardingOptions(state=state), force=True)
    rows = {row.all_reduce: row for row in report.explanations}
    assert any(row.reason_code == "feeds_gradients" for row in rows.values())
    return runtime.verify(parse(text), parse(optimized), runtime.VerifyOptions(
        steps=3, manifest=build_manifest(report, module)))


@pytest.mark.slow
@pytest.mark.parametrize("name,state", [("resnet1", "gathered"), ("resnet1", "sharded"),
                                        ("mnist", "gathered"), ("mnist", "sharded"),
                                        ("resnet18", "sharded")])
def test_every_optimized_batchnorm_module_verifies(request, worker, name, state):
    if needs_devices(request):
        result = verify_optimized(name, state)
        assert result.ok, [(leaf.index, leaf.verdict, leaf.max_abs) for leaf in result.final()]
