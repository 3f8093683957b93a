"""``hlo-shard verify`` on hand-written modules: verdicts, mutations, manifests, steps,
timing, failures. Fixture-based checks live in test_verify_fixtures.py.

Mutations are edits on the IR (parse → edit records → print), as a rewrite would make
them. All tests share one pooled 8-device CPU worker (CliRunner runs in-process).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from hlo_shard import runtime
from hlo_shard.cli import main
from hlo_shard.ir import ReplicaGroups
from hlo_shard.parser import parse
from hlo_shard.runtime.inputs import output_shapes
from hlo_shard.printer import to_text

ADD = "add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }\n"

SGD = "HloModule sgd, replica_count=4\n" + ADD + """ENTRY e {
 w = f32[1024] parameter(0) g = f32[1024] parameter(1)
 ar = f32[1024] all-reduce(g), replica_groups={{0,1,2,3}}, to_apply=add
 lr = f32[] constant(0.01) b = f32[1024] broadcast(lr), dimensions={}
 u = f32[1024] multiply(ar, b) ROOT nw = f32[1024] subtract(w, u) }
"""

#: The reduce-scatter → sharded update → all-gather rewrite of SGD.
SGD_SHARDED = "HloModule sgd_rs, replica_count=4\n" + ADD + """ENTRY e {
 w = f32[1024] parameter(0) g = f32[1024] parameter(1)
 rs = f32[256] reduce-scatter(g), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=add
 rid = u32[] replica-id() k = u32[] constant(256) off = u32[] multiply(rid, k)
 ws = f32[256] dynamic-slice(w, off), dynamic_slice_sizes={256}
 lr = f32[] constant(0.01) b = f32[256] broadcast(lr), dimensions={}
 u = f32[256] multiply(rs, b) nws = f32[256] subtract(ws, u)
 ROOT nw = f32[1024] all-gather(nws), replica_groups={{0,1,2,3}}, dimensions={0} }
"""

#: Momentum SGD on 2 devices, with a loss-like scalar second output.
MOMENTUM = "HloModule momentum, replica_count=2\n" + ADD + """ENTRY e {
 w = f32[3,4] parameter(0) m = f32[3,4] parameter(1) g = f32[3,4] parameter(2)
 gs = f32[3,4] all-reduce(g), replica_groups={{0,1}}, to_apply=add
 beta = f32[] constant(0.9) bb = f32[3,4] broadcast(beta), dimensions={}
 mb = f32[3,4] multiply(bb, m) m2 = f32[3,4] add(mb, gs)
 lr = f32[] constant(0.1) lb = f32[3,4] broadcast(lr), dimensions={}
 u = f32[3,4] multiply(lb, m2) w2 = f32[3,4] subtract(w, u)
 z = f32[] constant(0) n = f32[] reduce(gs, z), dimensions={0,1}, to_apply=add
 ROOT t = (f32[3,4], f32[3,4], f32[]) tuple(w2, m2, n) }
"""

#: MOMENTUM with the momentum kept sharded: f32[6] per device (12 elements / 2),
#: flattened in the {1,0} physical order of f32[3,4].
MOMENTUM_SHARDED = "HloModule momentum_rs, replica_count=2\n" + ADD + """ENTRY e {
 w = f32[3,4] parameter(0) m = f32[6] parameter(1) g = f32[3,4] parameter(2)
 gf = f32[12] reshape(g)
 rs = f32[6] reduce-scatter(gf), replica_groups={{0,1}}, dimensions={0}, to_apply=add
 beta = f32[] constant(0.9) bb = f32[6] broadcast(beta), dimensions={}
 mb = f32[6] multiply(bb, m) m2 = f32[6] add(mb, rs)
 wf = f32[12] reshape(w)
 rid = u32[] replica-id() k = u32[] constant(6) off = u32[] multiply(rid, k)
 ws = f32[6] dynamic-slice(wf, off), dynamic_slice_sizes={6}
 lr = f32[] constant(0.1) lb = f32[6] broadcast(lr), dimensions={}
 u = f32[6] multiply(lb, m2) w2s = f32[6] subtract(ws, u)
 w2f = f32[12] all-gather(w2s), replica_groups={{0,1}}, dimensions={0}
 w2 = f32[3,4] reshape(w2f)
 gs = f32[3,4] all-reduce(g), replica_groups={{0,1}}, to_apply=add
 z = f32[] constant(0) n = f32[] reduce(gs, z), dimensions={0,1}, to_apply=add
 ROOT t = (f32[3,4], f32[6], f32[]) tuple(w2, m2, n) }
"""


def _manifest(momentum_groups=None) -> dict:
    full = {"shape": [3, 4], "element_type": "f32", "layout": [1, 0]}
    shard = {"length": 6, "padding": 0}
    if momentum_groups:
        shard["replica_groups"] = momentum_groups
    return {
        "format": "hlo-shard-manifest", "version": 1, "devices": 2,
        "parameters": [{"index": 0, "original": 0, "kind": "replicated", "name": "w", **full},
                       {"index": 1, "original": 1, "kind": "sharded", "name": "m", **full,
                        "shard": shard},
                       {"index": 2, "original": 2, "kind": "per-device", "name": "g", **full}],
        "outputs": [{"index": 0, "original": 0, "kind": "replicated", **full},
                    {"index": 1, "original": 1, "kind": "sharded", **full, "shard": shard},
                    {"index": 2, "original": 2, "kind": "replicated", "shape": [],
                     "element_type": "f32"}],
    }


@pytest.fixture(scope="module", autouse=True)
def worker():
    shared = runtime.get_worker("cpu", 8)
    yield shared
    runtime.shutdown_workers()


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def verify(*args: str):
    return CliRunner().invoke(main, ["verify", *args])


def rows(output: str) -> dict[str, str]:
    """Table rows of the verify report by output index."""
    return {line.split()[0]: line for line in output.splitlines()
            if line[:1].isdigit() and "[" in line}


def edited(text: str, edit) -> str:
    module = parse(text)
    edit(module)
    return to_text(module)


# ------------------------------------------------------------------------ verdicts


def test_identical_modules_match(tmp_path):
    path = write(tmp_path, "sgd.hlo", SGD)
    result = verify(path, path)
    assert result.exit_code == 0, result.output
    assert "MATCH: all 1 outputs agree on 4 cpu devices" in result.stdout
    assert "per-device: 1 (g)  [analysis]" in result.stdout
    assert "compiling" in result.stderr and "step 5/5 (wide-range)" in result.stderr


def test_reduce_scatter_rewrite_matches(tmp_path):
    result = verify(write(tmp_path, "a.hlo", SGD), write(tmp_path, "b.hlo", SGD_SHARDED))
    assert result.exit_code == 0, result.output
    assert rows(result.stdout)["0"].split()[-1] == "match"


def _set_constant(module, value: str) -> None:
    next(i for i in module.entry.instructions if i.name == "lr").literal = value


def _swap_subtract(module) -> None:
    inst = next(i for i in module.entry.instructions if i.opcode == "subtract")
    inst.operands.reverse()


def _regroup_all_reduce(module) -> None:
    inst = next(i for i in module.entry.instructions if i.opcode == "all-reduce")
    inst.attributes["replica_groups"] = ReplicaGroups(((0, 1), (2, 3)))


@pytest.mark.parametrize("mutation", [
    lambda m: _set_constant(m, "0.02"), _swap_subtract, _regroup_all_reduce],
    ids=["constant", "swapped-operands", "replica-groups"])
def test_mutations_are_reported_naming_the_output(tmp_path, mutation):
    original = write(tmp_path, "a.hlo", SGD)
    candidate = write(tmp_path, "b.hlo", edited(SGD, mutation))
    result = verify(original, candidate, "-q")
    assert result.exit_code == 1, result.output
    assert "differ" in rows(result.stdout)["0"]
    assert "DIFFERENT: 1 of 1 outputs differ (output 0; first at step 1" in result.stdout


def test_only_the_changed_output_differs(tmp_path):
    def lr(module):
        next(i for i in module.entry.instructions if i.name == "lr").literal = "0.2"

    result = verify(write(tmp_path, "a.hlo", MOMENTUM),
                    write(tmp_path, "b.hlo", edited(MOMENTUM, lr)), "-q")
    assert result.exit_code == 1
    table = rows(result.stdout)
    assert "differ" in table["0"] and table["1"].endswith("match") and table["2"].endswith("match")
    assert "(output 0;" in result.stdout


# ---------------------------------------------------------------- manifest and steps


def test_sharded_state_through_a_manifest_over_steps(tmp_path):
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(_manifest()))
    original = write(tmp_path, "a.hlo", MOMENTUM)
    candidate = write(tmp_path, "b.hlo", MOMENTUM_SHARDED)
    result = verify(original, candidate, "--manifest", str(manifest), "--steps", "3")
    assert result.exit_code == 0, result.output
    assert "fed back between steps: output 0 -> parameter 0, output 1 -> parameter 1" in result.stdout
    assert "step 3/3: all outputs match" in result.stderr
    assert "MATCH: all 3 outputs agree on 2 cpu devices over 3 steps" in result.stdout


def test_a_wrong_shard_order_is_caught(tmp_path):
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(_manifest(momentum_groups=[[1, 0]])))
    result = verify(write(tmp_path, "a.hlo", MOMENTUM), write(tmp_path, "b.hlo", MOMENTUM_SHARDED),
                    "--manifest", str(manifest), "-q")
    assert result.exit_code == 1, result.output
    assert "differ" in rows(result.stdout)["1"]


def test_a_state_bug_that_only_shows_in_later_steps(tmp_path):
    """A candidate that ignores its momentum input agrees at step 1 when the momentum
    starts at zero, and differs from step 2 on."""

    def ignore_momentum(module):
        for inst in module.entry.instructions:
            inst.operands[:] = ["gs" if name == "m2" else name for name in inst.operands]

    npz = tmp_path / "in.npz"
    np.savez(npz, m=np.zeros((3, 4), np.float32))
    original = write(tmp_path, "a.hlo", MOMENTUM)
    candidate = write(tmp_path, "b.hlo", edited(MOMENTUM, ignore_momentum))
    one = verify(original, candidate, "--inputs", str(npz), "--steps", "1", "-q")
    assert one.exit_code == 0, one.output
    three = verify(original, candidate, "--inputs", str(npz), "--steps", "3", "-q")
    assert three.exit_code == 1
    assert "first at step 2 of 3" in three.stdout


def test_signature_mismatch_without_manifest_is_a_usage_error(tmp_path):
    result = verify(write(tmp_path, "a.hlo", MOMENTUM), write(tmp_path, "b.hlo", MOMENTUM_SHARDED))
    assert result.exit_code == 2
    assert "signature mismatch" in result.stderr and "--manifest" in result.stderr


# ------------------------------------------------------------ single module, JSON


def test_single_module_reports_output_shapes(tmp_path):
    result = verify(write(tmp_path, "m.hlo", MOMENTUM), "-q")
    assert result.exit_code == 0, result.output
    assert "compiled and executed on 2 cpu devices (1 step)" in result.stdout
    assert "  0  f32[3,4]" in result.stdout and "  2  f32[]" in result.stdout


def test_steps_timing_and_memory_as_json(tmp_path):
    result = verify(write(tmp_path, "a.hlo", SGD), write(tmp_path, "b.hlo", SGD_SHARDED),
                    "--steps", "3", "--time", "3", "--warmup", "1", "--json", "-q")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["match"] and report["steps"] == 3 and report["devices"] == 4
    for side in ("original", "candidate"):
        module = report[side]
        assert 0 < module["timing"]["median_s"] < 5 and module["timing"]["runs"] == 3
        assert module["memory_per_device"]["argument_bytes"] == 8192
        assert module["memory_per_device"]["output_bytes"] == 4096
        assert module["cost"]["flops"] > 0
    assert report["candidate"]["cost"]["flops"] < report["original"]["cost"]["flops"]
    assert report["outputs"][0]["verdict"] == "match"
    assert report["inputs"][1] == {"parameter": 1, "name": "g", "role": "per-device",
                                   "source": "analysis"}


def test_timing_is_printed(tmp_path):
    result = verify(write(tmp_path, "a.hlo", SGD), "--time", "2", "--warmup", "0", "-q")
    assert result.exit_code == 0, result.output
    assert "time per step (median of 2, interleaved): original" in result.stdout
    assert "memory per device (bytes)" in result.stdout


def test_per_device_params_option(tmp_path):
    path = write(tmp_path, "a.hlo", SGD)
    result = verify(path, path, "--per-device-params", "0,1", "-q")
    assert "per-device: 0 (w), 1 (g)  [--per-device-params]" in result.stdout
    assert verify(path, "--per-device-params", "x", "-q").exit_code == 2


# ------------------------------------------------------------------------- failures

CRASH = """HloModule crash, replica_count=2
fused { p = f32[8,16]{1,0} parameter(0) t = f32[16,8]{0,1} transpose(p), dimensions={1,0} ROOT c = f32[16,8]{1,0} copy(t) }
ENTRY e { x = f32[8,16]{1,0} parameter(0) ROOT f = f32[16,8]{1,0} fusion(x), kind=kLoop, calls=fused }
"""


def test_an_xla_crash_is_exit_2_with_a_clean_message(tmp_path):
    path = write(tmp_path, "crash.hlo", CRASH)
    result = verify(path, path, "-q")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: compiling ")
    assert "XLA aborted (SIGABRT): Check failed: output_shape.has_layout()" in result.stderr
    assert "Traceback" not in result.output
    # The pool restarts the worker for the next command.
    assert verify(write(tmp_path, "ok.hlo", SGD), "-q").exit_code == 0


def test_unparsable_and_unexecutable_inputs_are_exit_2(tmp_path):
    bad = verify(write(tmp_path, "bad.hlo", "HloModule m\nENTRY e { ROOT p = f32[] parameter(0) x }"))
    assert bad.exit_code == 2 and "bad.hlo:2:" in bad.stderr
    elided = verify(write(tmp_path, "e.hlo", "HloModule m\nENTRY e { ROOT c = f32[12] constant({...}) }"))
    assert elided.exit_code == 2 and "--xla_dump_large_constants" in elided.stderr
    both = verify(write(tmp_path, "rp.hlo", "HloModule m, replica_count=2, num_partitions=2\n"
                                          "ENTRY e { ROOT p = f32[2] parameter(0) }"))
    assert both.exit_code == 2 and "not supported yet" in both.stderr


def test_a_module_drawing_from_xlas_stateful_generator_is_not_compared(tmp_path):
    """``rng`` draws other numbers on every run: compared with itself, such a module was
    DIFFERENT (exit 1), as if a rewrite had broken it. Run alone, it runs."""
    path = write(tmp_path, "rng.hlo", "HloModule m\nENTRY e { lo = f32[] constant(0) "
                 "hi = f32[] constant(1) ROOT r = f32[8] rng(lo, hi), "
                 "distribution=rng_uniform }\n")
    compared = verify(path, path, "-n", "1")
    assert compared.exit_code == 2 and compared.stderr.count("\n") == 1
    assert "%r in %e is an rng, which draws other random numbers on every run" in \
        compared.stderr
    assert verify(path, "-n", "1").exit_code == 0


def test_outputs_are_read_in_the_declared_entry_layout(tmp_path):
    # jax writes some ROOT elements {0,1} beside a declared {1,0} (XLA copies them into
    # the declared layout): the new weight is then fed back as it is, not re-sharded.
    declared = ("HloModule momentum, replica_count=2, entry_computation_layout="
                "{(f32[3,4]{1,0}, f32[3,4]{1,0}, f32[3,4]{1,0})->"
                "(f32[3,4]{1,0}, f32[3,4]{1,0}, f32[])}\n")
    text = MOMENTUM.replace("HloModule momentum, replica_count=2\n", declared).replace(
        "ROOT t = (f32[3,4], f32[3,4], f32[]) tuple(w2, m2, n)",
        "w2c = f32[3,4]{0,1} copy(w2) ROOT t = (f32[3,4]{0,1}, f32[3,4], f32[]) tuple(w2c, m2, n)")
    module = parse(text)
    assert [s.minor_to_major() for s in output_shapes(module)[:2]] == [(1, 0), (1, 0)]
    path = write(tmp_path, "m.hlo", text)
    result = verify(path, path, "--steps", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["resharded"] == []
