"""Issue 16's adversarial table, re-run: hand edits of an optimized Adam step that the
old verifier (tolerance relative to the weights, candidate re-padded with zeros every
step, inputs far from edge regimes) called MATCH. Each must be DIFFERENT now, with the
default options (one step per input regime), and the unedited module still MATCH.

The module is ``optimize --state sharded`` of fixtures/spmd/adam.n4.hlo (optax
``adam(1e-3)``): its update region holds lr ``-0.001``, 1 − β2 ``0.001``, eps ``1e-08``,
the step count's saturation ``2147483647``, the gradients' averaging divisor ``4``, and
the zero that pads the gradients to whole shards (``%constant.1``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hlo_shard import runtime
from hlo_shard import optimize
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update import ShardingOptions

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ADAM = FIXTURES / "spmd" / "adam.n4.hlo"
pytestmark = pytest.mark.skipif(not ADAM.exists(), reason=f"{ADAM} not generated")

#: (row of the table, literal edit of the optimized module: (pattern, replacement)).
TABLE = {
    "learning rate x 1.001": (r"constant\(-0\.001\)", "constant(-0.001001)"),
    "1 - beta2 changed by 1%": (r"constant\(0\.001\)", "constant(0.00101)"),
    "eps x 100": (r"constant\(1e-08\)", "constant(1e-06)"),
    "eps removed": (r"constant\(1e-08\)", "constant(0)"),
    "step-count saturation 2147483647 -> 100": (r"constant\(2147483647\)", "constant(100)"),
    "7 in the padding lanes of sharded state": (r"(%constant\.1 = f32\[\] )constant\(0\)",
                                                r"\1constant(7)"),
    "NaN in the padding lanes of sharded state": (r"(%constant\.1 = f32\[\] )constant\(0\)",
                                                  r"\1constant(nan)"),
    "averaging divisor 4 -> 4.0001": (r"(f32\[\] )constant\(4\)", r"\1constant(4.0001)"),
}


@pytest.fixture(scope="module")
def optimized():
    worker = runtime.get_worker("cpu", 4)
    module = parse(ADAM.read_text(), str(ADAM))
    result = optimize(module, ShardingOptions(state="sharded"), force=True)
    report, text = result.report, result.text
    yield parse(ADAM.read_text(), str(ADAM)), text, build_manifest(report, module)
    del worker
    runtime.shutdown_workers()


def _verify(optimized, text: str) -> runtime.VerifyReport:
    original, _, manifest = optimized
    return runtime.verify(original, parse(text), runtime.VerifyOptions(manifest=manifest))


def test_the_unedited_module_matches(optimized):
    report = _verify(optimized, optimized[1])
    assert report.ok and report.steps_run == len(runtime.REGIMES)
    assert not report.resharded, "the candidate must be fed its own shards"
    assert sum(leaf.padding_checked for leaf in report.final()) > 0


@pytest.mark.parametrize("row", TABLE)
def test_every_row_of_the_table_differs(optimized, row):
    pattern, replacement = TABLE[row]
    text, count = re.subn(pattern, replacement, optimized[1])
    assert count >= 1, f"{row}: the edit found nothing to change"
    report = _verify(optimized, text)
    assert not report.ok, f"{row}: still MATCH"
