"""Every fixture (real JAX + optax training steps): the pass shards every gradient
all-reduce over the data-parallel group or says why, no update op runs on a full-size
weight, and — for the SPMD and replica forms, which the runtime executes — the optimized
module computes what the original computes over 3 steps in both state modes.

Large models and N=8 modules take minutes to compile on CPU; they are marked ``slow``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hlo_shard import runtime
from hlo_shard.analysis.collectives import find_gradient_all_reduces
from hlo_shard.opinfo import ELEMENTWISE
from hlo_shard import optimize
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.graph import dataflow_graph
from hlo_shard.ir import ArrayShape, TupleShape
from hlo_shard.parser import parse
from hlo_shard.passes.accumulation_motion import AccumulationMotion
from hlo_shard.passes.weight_update import ShardingOptions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ALL = sorted(FIXTURES.glob("*/*.hlo"))
EXECUTABLE = [p for p in ALL if p.parent.name in ("spmd", "replica")]
#: Why a fixture's gradient may stay all-reduced: the loss and one-element gradients.
ACCEPTED_REASONS = ("nothing to shard",)


def _slow(path: Path) -> bool:
    return ".n8." in path.name or path.name.startswith(("transformer", "mlp_"))


def _params(paths):
    return [pytest.param(p, id=f"{p.parent.name}/{p.stem}",
                         marks=[pytest.mark.slow] if _slow(p) else []) for p in paths]


if not ALL:
    pytest.skip("no fixtures checked out", allow_module_level=True)


def _has_state(path: Path) -> bool:
    """The fixture carries optimizer state beyond scalars (SGD has none)."""
    info = json.loads((FIXTURES / "MANIFEST.json").read_text())[f"{path.parent.name}/{path.name}"]
    return any(p["role"] == "optimizer_state" and p["shape"] for p in info["parameters"])


def _gradient_dims(module) -> set[tuple[int, ...]]:
    dims = set()
    for ar in find_gradient_all_reduces(module):
        shape = module.computation(ar.computation)[ar.name].shape
        leaves = shape.elements if isinstance(shape, TupleShape) else (shape,)
        dims |= {leaf.dims for leaf in leaves if leaf.num_elements > 1}
    return dims


@pytest.mark.parametrize("path", _params(ALL))
def test_every_gradient_is_sharded_or_explained(path):
    original = parse(path.read_text(), str(path))
    # the rows name the all-reduces the sharding sees: accumulated ones after their loop
    moved = parse(path.read_text(), str(path))
    AccumulationMotion().run(moved)
    expected = {(ar.computation, ar.name) for ar in find_gradient_all_reduces(moved)}
    full_dims = _gradient_dims(original)
    module = parse(path.read_text(), str(path))
    result = optimize(module, ShardingOptions(), force=True)
    report, _ = result.report, result.text
    rows = report.explanations
    assert {(r.computation, r.all_reduce) for r in rows} == expected
    assert any(r.sharded for r in rows)
    for r in rows:
        if not r.sharded and path.parent.name != "optimized":
            assert r.reason.endswith(ACCEPTED_REASONS), (r.all_reduce, r.reason)
    # no elementwise update op downstream of a reduce-scatter works on a full-size tensor
    n = next(ar.groups.size for ar in find_gradient_all_reduces(original) if ar.groups)
    full_dims -= {(-(-math.prod(d) // n),) for d in full_dims}  # shard lengths
    for comp in module.computations:
        graph = dataflow_graph(comp)
        scatters = [i.name for i in comp.instructions if i.opcode == "reduce-scatter"]
        downstream = set().union(*(graph.descendants(s) for s in scatters)) if scatters \
            else set()
        full = [n for n in downstream if comp[n].opcode in ELEMENTWISE - {"copy"}
                and isinstance(comp[n].shape, ArrayShape) and comp[n].shape.dims in full_dims
                and path.parent.name != "optimized"]
        assert not full, full


@pytest.fixture(scope="module")
def worker():
    yield runtime.get_worker("cpu", 8)
    runtime.shutdown_workers()


@pytest.mark.parametrize("state", ["gathered", "sharded"])
@pytest.mark.parametrize("path", _params(EXECUTABLE))
def test_optimized_fixture_computes_the_same(worker, path, state):
    text = path.read_text()
    module = parse(text, str(path))
    result = optimize(module, ShardingOptions(state=state), force=True)
    report, optimized = result.report, result.text
    manifest = build_manifest(report, module)
    if state == "sharded" and _has_state(path):
        assert any(p.kind == "sharded" for p in report.parameters)
    result = runtime.verify(parse(text, str(path)), parse(optimized),
                            runtime.VerifyOptions(steps=5, manifest=manifest))
    # (ok: each state shard is fed its own output too; momentum's, without
    # input_output_alias, was paired with the new weight and looped only re-sharded)
    assert result.ok, ([(leaf.index, leaf.verdict, leaf.max_abs, leaf.max_rel)
                        for leaf in result.final() if not leaf.ok], result.unlooped)
