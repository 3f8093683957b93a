"""hlo_shard.runtime: the worker, module forms, executables, XLA's figures, failures.

One CPU worker with 8 virtual devices serves the whole module (the pool hands it to
every ``load``); tests that must kill a worker use their own small one.
"""

from __future__ import annotations

import numpy as np
import pytest

from hlo_shard import runtime
from hlo_shard.errors import HloRuntimeError, HloShardError
from hlo_shard.parser import parse
from hlo_shard.printer import to_text
from hlo_shard.runtime import _child

SGD = """HloModule sgd, replica_count=4
add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }
ENTRY e { w = f32[1024] parameter(0) g = f32[1024] parameter(1)
 ar = f32[1024] all-reduce(g), replica_groups={{0,1,2,3}}, to_apply=add
 lr = f32[] constant(0.01) b = f32[1024] broadcast(lr), dimensions={}
 u = f32[1024] multiply(ar, b) ROOT nw = f32[1024] subtract(w, u) }
"""

#: Per-device SPMD form as jax 0.10 writes it: num_partitions, shardings, partition-id,
#: flattened-id collectives sharing one channel id, donation.
SPMD = """HloModule spmd, input_output_alias={ {0}: (0, {}, may-alias) }, num_partitions=4
add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }
ENTRY e { w = f32[8] parameter(0), sharding={replicated}
 x = f32[2,3] parameter(1), sharding={devices=[4,1]<=[4]}
 z = f32[] constant(0)
 s = f32[3] reduce(x, z), dimensions={0}, to_apply=add
 ar = f32[3] all-reduce(s), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=add
 wb = f32[8,2] broadcast(w), dimensions={0}
 ar2 = f32[8,2] all-reduce(wb), channel_id=1, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=add
 pid = u32[] partition-id()
 ROOT t = (f32[8,2], f32[3], u32[]) tuple(ar2, ar, pid), sharding={{replicated}, {replicated}, {manual}} }
"""

CRASH = """HloModule crash, replica_count=2
fused { p = f32[8,16]{1,0} parameter(0) t = f32[16,8]{0,1} transpose(p), dimensions={1,0} ROOT c = f32[16,8]{1,0} copy(t) }
ENTRY e { x = f32[8,16]{1,0} parameter(0) ROOT f = f32[16,8]{1,0} fusion(x), kind=kLoop, calls=fused }
"""

LOOP_FOREVER = """HloModule loop
cond { p = s32[] parameter(0) ROOT t = pred[] constant(true) }
body { p = s32[] parameter(0) one = s32[] constant(1) ROOT a = s32[] add(p, one) }
ENTRY e { z = s32[] constant(0) ROOT w = s32[] while(z), condition=cond, body=body }
"""


@pytest.fixture(scope="module")
def worker():
    # A clean pool: a smaller worker left by an earlier test module would serve the
    # 4-device loads below instead of this one.
    runtime.shutdown_workers()
    shared = runtime.get_worker("cpu", 8)
    yield shared
    runtime.shutdown_workers()


# ----------------------------------------------------------------- executing modules


def test_replica_module_runs_with_replicated_and_per_device_arguments(worker):
    exe = runtime.load(SGD)
    assert exe.devices == 4 and exe.worker is worker
    w = np.linspace(-1, 1, 1024, dtype=np.float32)
    grads = [np.full(1024, d + 1, np.float32) for d in range(4)]
    outputs = exe(w, grads)
    assert len(outputs) == 1 and len(outputs[0]) == 4
    for device in range(4):
        np.testing.assert_allclose(outputs[0][device], w - 0.01 * 10, atol=1e-7)


def test_spmd_module_runs_in_replica_form(worker):
    module = parse(SPMD)
    form = runtime.replica_form(module)
    text = to_text(form)
    assert "num_partitions" not in text and "replica_count=4" in text
    assert "sharding=" not in text and "input_output_alias" not in text
    assert "partition-id" not in text and "replica-id" in text
    channels = [i.attributes["channel_id"] for c in form.computations for i in c.instructions
                if "channel_id" in i.attributes]
    assert channels == [1, 2]
    assert "partition-id" in to_text(module), "the original module is left untouched"

    exe = runtime.load(module)
    w = np.arange(8, dtype=np.float32)
    xs = [np.full((2, 3), d, np.float32) for d in range(4)]
    broadcast_sum, batch_sum, ids = exe(w, xs)
    for device in range(4):
        assert ids[device] == device
        np.testing.assert_array_equal(batch_sum[device], np.full(3, 2 * (0 + 1 + 2 + 3)))
        np.testing.assert_array_equal(broadcast_sum[device], 2 * np.repeat(w[:, None], 2, 1))


#: The partitioner's cross-partition collectives (a ``channel_id``, no
#: ``use_global_device_ids``: groups of partition ids), as jax writes an all-to-all and a
#: collective-permute on a mesh with more than one axis.
CROSS_PARTITION = """HloModule cross, num_partitions=4
ENTRY e { x = f32[4,2] parameter(0), sharding={devices=[4,1]<=[4]}
 a2a = f32[4,2] all-to-all(x), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}
 cp = f32[4,2] collective-permute(x), channel_id=2, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
 ROOT t = (f32[4,2], f32[4,2]) tuple(a2a, cp) }
"""


def test_cross_partition_collectives_run_in_replica_form(worker):
    """One partition cannot hold partition ids 1..N-1 (XLA's RET_CHECK ``partition_id <
    partition_count``): the collectives read the same ids as replicas, channel-less."""
    form = runtime.replica_form(parse(CROSS_PARTITION))
    assert all("channel_id" not in i.attributes for i in form.entry.instructions)
    exe = runtime.load(parse(CROSS_PARTITION))
    xs = [np.full((4, 2), d, np.float32) + np.arange(4, dtype=np.float32)[:, None] * 10
          for d in range(4)]
    swapped, permuted = exe(xs)
    for device in range(4):
        partner = device ^ 1
        np.testing.assert_array_equal(permuted[device], xs[partner])
        blocks = [xs[member][2 * (device % 2):2 * (device % 2) + 2]
                  for member in (device & ~1, device | 1)]
        np.testing.assert_array_equal(swapped[device], np.concatenate(blocks))


#: An all-reduce and an all-gather with a ``channel_id`` and no ``use_global_device_ids``
#: in an SPMD module: XLA's cross-replica-and-partition mode, whose group of the one
#: replica spans every partition.
REPLICA_AND_PARTITION = """HloModule crp, num_partitions=4
add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }
ENTRY e { x = f32[2] parameter(0)
 ar = f32[2] all-reduce(x), channel_id=1, replica_groups={{0}}, to_apply=add
 everyone = f32[2] all-reduce(x), channel_id=2, replica_groups={}, to_apply=add
 ag = f32[8] all-gather(x), channel_id=3, replica_groups={{0}}, dimensions={0}
 flagged = f32[2] all-reduce(x), channel_id=4, replica_groups={{0}}, use_global_device_ids=false, to_apply=add
 ROOT t = (f32[2], f32[2], f32[8], f32[2]) tuple(ar, everyone, ag, flagged) }
"""


def test_cross_replica_and_partition_collectives_span_every_partition(worker):
    """The replica form's group is every device, not the one replica id it names (the
    channel dropped and the groups kept read ``{{0}}`` as one device)."""
    exe = runtime.load(parse(REPLICA_AND_PARTITION))
    xs = [np.array([d, 10 * d], np.float32) for d in range(4)]
    total, everyone, gathered, flagged = exe(xs)
    for device in range(4):
        np.testing.assert_array_equal(total[device], [6, 60])
        np.testing.assert_array_equal(everyone[device], [6, 60])
        np.testing.assert_array_equal(flagged[device], [6, 60])
        np.testing.assert_array_equal(gathered[device], np.concatenate(xs))


#: A QR decomposition as jax lowers it on CPU: LAPACK's geqrf and orgqr as FFI custom
#: calls (a step that orthogonalizes its update, optax.contrib.galore's SVD alike).
QR = """HloModule qr, replica_count=2
ENTRY e { a = f32[4,4]{1,0} parameter(0)
 t = f32[4,4]{0,1} copy(a)
 geqrf = (f32[4,4]{0,1}, f32[4]{0}) custom-call(t), custom_call_target="lapack_sgeqrf_ffi", operand_layout_constraints={f32[4,4]{0,1}}, output_to_operand_aliasing={{0}: (0, {})}, api_version=API_VERSION_TYPED_FFI, frontend_attributes={num_batch_dims="0"}, backend_config={}
 r = f32[4,4]{0,1} get-tuple-element(geqrf), index=0
 taus = f32[4]{0} get-tuple-element(geqrf), index=1
 q = f32[4,4]{0,1} custom-call(r, taus), custom_call_target="lapack_sorgqr_ffi", operand_layout_constraints={f32[4,4]{0,1}, f32[4]{0}}, output_to_operand_aliasing={{}: (0, {})}, api_version=API_VERSION_TYPED_FFI, frontend_attributes={num_batch_dims="0"}, backend_config={}
 ROOT out = f32[4,4]{1,0} copy(q) }
"""


def test_a_module_calling_lapack_runs(worker):
    """The worker points XLA:CPU's LAPACK custom calls at their routines, as jax does
    when it lowers such an op: the worker crashed (SIGSEGV) on the first one, so
    ``verify`` refused every step with a QR or an SVD in it (a probe's GaLore step)."""
    a = np.arange(16, dtype=np.float32).reshape(4, 4) + 4 * np.eye(4, dtype=np.float32)
    (q,) = runtime.load(parse(QR))([a, a])
    expected = np.linalg.qr(a)[0]
    for device in range(2):
        np.testing.assert_allclose(np.abs(q[device]), np.abs(expected), atol=1e-5)


def test_memory_cost_and_timing_are_reported(worker):
    exe = runtime.load(SGD)
    assert exe.memory.argument == 2 * 1024 * 4
    assert exe.memory.output == 1024 * 4
    assert exe.memory.peak is None or exe.memory.peak >= exe.memory.argument
    assert exe.cost["flops"] == 3 * 1024
    assert exe.compiled_cost["flops"] > 0
    timing = exe.time(np.zeros(1024, np.float32), np.ones(1024, np.float32), runs=3, warmup=1)
    assert len(timing.seconds) == 3 and 0 < timing.median < 5


def test_a_donating_module_is_timed_as_a_training_loop(worker):
    """With ``donate``, every run consumes ``w``: timing must feed the output back as the
    next run's ``w`` (run twice on the first inputs, XLA refuses the deleted buffer)."""
    donating = SGD.replace("HloModule sgd,", "HloModule sgd, input_output_alias={ {}: (0, {}, may-alias) },")
    exe = runtime.load(donating, donate=True)
    assert exe.module.output_aliases() == {0: 0}
    timing = exe.time(np.zeros(1024, np.float32), np.ones(1024, np.float32), runs=4, warmup=1)
    assert len(timing.seconds) == 4
    kept = runtime.load(donating)  # without donate: the aliasing is dropped, inputs reused
    assert kept.module.output_aliases() == {}
    assert len(kept.time(np.zeros(1024, np.float32), np.ones(1024, np.float32), runs=2,
                         warmup=1).seconds) == 2
    # launched back to back (a GPU probe's loop): each step still consumes the output of
    # the one before, and a run is the mean of its steps
    pipelined = exe.time(np.zeros(1024, np.float32), np.ones(1024, np.float32), runs=3,
                         warmup=1, pipelined=5)
    assert len(pipelined.seconds) == 3 and 0 < pipelined.median < 5


def test_module_cost_without_compiling(worker):
    assert runtime.module_cost(SGD)["flops"] == 3 * 1024
    # XLA would abort compiling this one; its cost analysis still works.
    assert runtime.module_cost(CRASH)["bytes accessed"] > 0
    assert worker.alive


def test_interleaved_timing_of_two_executables(worker):
    a, b = runtime.load(SGD), runtime.load(SGD.replace("0.01", "0.02"))
    args = a.arguments([np.zeros(1024, np.float32), np.ones(1024, np.float32)])
    timings = runtime.time_interleaved([a, b], [args, args], runs=2, warmup=0)
    assert [len(t.seconds) for t in timings] == [2, 2]


def test_identical_modules_compile_once_and_survive_a_release(worker):
    a, b = runtime.load(SGD), runtime.load(parse(SGD))
    assert a._handle == b._handle
    a.close()
    w = np.zeros(1024, np.float32)
    np.testing.assert_allclose(b(w, np.ones(1024, np.float32))[0][0], -0.04)
    b.close()
    assert runtime.load(SGD)._handle == a._handle, "kept idle for reuse"


def test_arguments_are_checked(worker):
    exe = runtime.load(SGD)
    with pytest.raises(HloShardError, match="takes 2 parameters"):
        exe(np.zeros(1024, np.float32))
    with pytest.raises(HloShardError, match="3 per-device values for 4 devices"):
        exe(np.zeros(1024, np.float32), [np.zeros(1024, np.float32)] * 3)
    with pytest.raises(HloShardError, match=r"expected \(1024,\)"):
        exe(np.zeros(1024, np.float32), np.zeros(5, np.float32))


def test_device_count_must_match_the_module(worker):
    with pytest.raises(HloShardError, match="written for 4 devices, not 2"):
        runtime.load(SGD, devices=2)
    single = runtime.load("HloModule one\nENTRY e { p = f32[2] parameter(0) "
                          "ROOT r = u32[] replica-id() }", devices=3)
    assert [int(v) for v in single(np.zeros(2, np.float32))[0]] == [0, 1, 2]


# ----------------------------------------------------------------------- refusals


def test_elided_constants_are_refused():
    module = parse("HloModule m\nENTRY e { ROOT c = f32[12] constant({...}) }")
    with pytest.raises(HloShardError, match="--xla_dump_large_constants"):
        runtime.replica_form(module)


def test_replicas_and_partitions_together_are_refused():
    module = parse("HloModule m, replica_count=2, num_partitions=2\n"
                   "ENTRY e { ROOT p = f32[2] parameter(0) }")
    with pytest.raises(HloShardError, match="not supported yet"):
        runtime.replica_form(module)


def test_global_programs_are_refused():
    module = parse('HloModule m, num_partitions=2\nENTRY e { p = f32[4] parameter(0)\n'
                   ' ROOT c = f32[4] custom-call(p), custom_call_target="Sharding", '
                   'sharding={devices=[2]<=[2]} }')
    with pytest.raises(HloShardError, match="before SPMD partitioning"):
        runtime.replica_form(module)


SEND_RECV = """HloModule m
add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }
ENTRY e { t = token[] after-all() p = f32[2] parameter(0)
 s = (f32[2], u32[], token[]) send(p, t), channel_id=7
 sd = token[] send-done(s), channel_id=7
 r = (f32[2], u32[], token[]) recv(t), channel_id=7
 rd = (f32[2], token[]) recv-done(r), channel_id=7
 ROOT ar = f32[2] all-reduce(p), channel_id=7, replica_groups={}, to_apply=add }
"""


def test_send_recv_pairs_keep_a_shared_channel():
    module = parse(SEND_RECV)
    runtime.forms.renumber_channels(module)
    ids = {i.name: i.attributes["channel_id"] for i in module.entry.instructions
           if "channel_id" in i.attributes}
    assert ids["s"] == ids["sd"] == ids["r"] == ids["rd"] == 1 and ids["ar"] == 2



VARIADIC_ALL_REDUCES = """HloModule m, replica_count=2
add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }
ENTRY e { p = f32[2] parameter(0) q = f32[3,2]{0,1} parameter(1)
 kept = (f32[2], f32[2]) all-reduce(p, p), replica_groups={}, to_apply=add
 chan = (f32[2], f32[2]) all-reduce(p, p), channel_id=5, replica_groups={}, to_apply=add
 laid = (f32[2], f32[3,2]{0,1}) all-reduce(p, q), replica_groups={}, to_apply=add
 g = f32[2] get-tuple-element(chan), index=1
 ROOT t = f32[3,2]{0,1} get-tuple-element(laid), index=1 }
"""


def test_variadic_all_reduces_xla_cpu_refuses_are_split_per_element():
    out = runtime.replica_form(parse(VARIADIC_ALL_REDUCES)).entry
    assert out["kept"].opcode == "all-reduce"
    for name, count in (("chan", 2), ("laid", 2)):
        assert out[name].opcode == "tuple" and not out[name].attributes
        parts = [out[operand] for operand in out[name].operands]
        assert len(parts) == count and all(p.opcode == "all-reduce" for p in parts)
        assert [p.shape for p in parts] == list(out[name].shape.elements)
    channels = [i.attributes["channel_id"] for i in out.instructions if "channel_id" in i.attributes]
    assert sorted(channels) == [1, 2]
    assert out["g"].operands == ["chan"]


# ------------------------------------------------------------------------ failures


def test_xla_check_failure_is_a_clean_error_and_the_worker_recovers(worker):
    survivor = runtime.load(SGD)
    with pytest.raises(HloRuntimeError, match=r"aborted \(SIGABRT\).*Check failed"):
        runtime.load(CRASH)
    assert not worker.alive
    # Executables of the dead worker recompile in the restarted one.
    w = np.zeros(1024, np.float32)
    np.testing.assert_allclose(survivor(w, np.ones(1024, np.float32))[0][0], -0.04)
    assert worker.alive


def test_xla_errors_are_clean(worker):
    bad = SGD.replace("ar = f32[1024] all-reduce(g), replica_groups={{0,1,2,3}}, to_apply=add",
                      "ar = f32[1024] all-reduce(g), replica_groups={{0,1,2}}, to_apply=add")
    with pytest.raises(HloRuntimeError, match="compiling .*replica groups"):
        runtime.load(bad)
    assert worker.alive, "an ordinary XLA error leaves the worker running"


def test_a_rejected_fused_module_is_told_where_to_verify_instead(worker):
    """A module holding fusions (XLA's own fused form, which XLA may not compile again):
    the rejection says so and where to verify instead; an unfused module's does not."""
    from test_fused_modules import FUSED

    with pytest.raises(HloRuntimeError, match=r"Check failed.*holds fusions.*before XLA's "
                                              r"optimization.*under install\(\)") as raised:
        runtime.load(parse(FUSED))
    assert "\n" not in str(raised.value)
    bad = SGD.replace("replica_groups={{0,1,2,3}}", "replica_groups={{0,1,2}}")
    with pytest.raises(HloRuntimeError) as plain:
        runtime.load(bad)
    assert "holds fusions" not in str(plain.value)


def test_a_hang_times_out_without_killing_the_caller():
    own = runtime.Worker("cpu", 1)  # its start has the default time: only the run is short
    try:
        exe = runtime.load(LOOP_FOREVER, worker=own, timeout=2)
        with pytest.raises(HloRuntimeError, match="timed out after 2 s"):
            exe()
        assert not own.alive
    finally:
        own.close()


def test_a_missing_backend_is_a_clear_error(worker):
    import importlib.util

    if importlib.util.find_spec("jax_plugins") is not None:
        pytest.skip("an accelerator plugin is installed")
    with pytest.raises(HloRuntimeError, match="backend 'tpu' is not available"):
        runtime.Worker("tpu", 1).start()


def test_too_few_devices_is_a_clear_error():
    own = runtime.Worker("cpu", 2)
    try:
        with pytest.raises(HloRuntimeError, match="needs 4 devices; this worker has 2"):
            runtime.load(SGD, worker=own)
    finally:
        own.close()


def test_unsupported_jaxlib_versions_are_named():
    assert _child.unsupported_version_message("0.10.2") is None
    message = _child.unsupported_version_message("0.4.30")
    assert "jaxlib 0.4.30 is not supported" in message and "jax>=0.10,<0.11" in message
    assert _child.unsupported_version_message("0.11.0") is not None


def test_worker_environment_sets_the_device_count(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_foo=1")
    env = runtime.worker.child_environment("cpu", 8)
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=8",
                                        "--xla_allow_excess_precision=false"]
    assert env["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=true")  # the user's wins
    assert "--xla_allow_excess_precision=false" not in \
        runtime.worker.child_environment("cpu", 8)["XLA_FLAGS"]


def test_memory_hint_reads_an_allocation_failure_under_the_limit():
    # Two of XLA's threads failing their allocations together: the second one's
    # std::terminate aborts the process before the first names bad_alloc (seen once
    # under --worker-memory 1500M on a loaded 2-core machine).
    hint = runtime.worker.memory_hint
    limit = 1500 << 20
    sure = hint("terminate called after throwing an instance of 'std::bad_alloc'", limit)
    assert sure.startswith(" (out of memory under the worker's limit of 1500 MiB; raise it")
    likely = hint("terminate called recursively\n", limit)
    assert likely.startswith(" (likely out of memory under the worker's limit of 1500 MiB")
    assert hint("terminate called recursively", None) == ""
    assert hint("Segmentation fault", limit) == ""


def test_a_backend_without_cost_analysis_gives_no_costs_and_other_errors_still_raise():
    """XLA GPU's plugin client answers UNIMPLEMENTED to hlo_module_cost_analysis (seen
    on an H200, jaxlib 0.11.2): the module still compiles and runs, with no costs."""
    def unimplemented() -> dict:
        raise RuntimeError("UNIMPLEMENTED: PJRT C API does not support GetHloCostAnalysis.")

    def broken() -> dict:
        raise RuntimeError("INTERNAL: something else")

    assert _child._cost_if_implemented(unimplemented) == {}
    assert _child._cost_if_implemented(lambda: [{"flops": 3}]) == {"flops": 3.0}
    with pytest.raises(RuntimeError, match="INTERNAL"):
        _child._cost_if_implemented(broken)
