"""The capture of a step's per-device module: on XLA:CPU its compile stops once the step
is partitioned (no executable that the pass would throw away), and the shardings it
names are jit's own."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from jax_train_helpers import AXIS, jax, make_program, needs_devices

from hlo_shard.jax import _xla
from hlo_shard.jax._capture import capture

jnp = jax.numpy
P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding


def _same(ours, jits) -> bool:
    return len(ours) == len(jits) and all(
        (a is None and b is None) or (a == b and type(a) is type(b)) for a, b in zip(ours, jits))


def _jits_shardings(jitted, args) -> tuple[tuple, tuple]:
    lowered = jitted.lower(*args)
    compiled = lowered.compile()
    return (tuple(lowered.in_tree.flatten_up_to(compiled.input_shardings)),
            tuple(jax.tree.leaves(compiled.output_shardings)))


def _shard_map_step():
    """A step as flax's examples write it: jit of a shard_map, a typed PRNG key and an
    argument jit prunes (unused), outputs whose shardings XLA decides."""
    mesh = jax.make_mesh((8,), (AXIS,))

    def body(w, key, x, unused):
        noise = jax.random.normal(key, w.shape) * 0.0
        grad = jax.lax.pmean(jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w), AXIS)
        return w - 0.1 * grad + noise, jnp.sum(x, axis=1)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXIS), P()),
                                 out_specs=(P(), P(AXIS))), donate_argnums=0)
    replicated = NamedSharding(mesh, P())
    args = (jax.device_put(jnp.ones((16, 16)), replicated),
            jax.device_put(jax.random.key(0), replicated),
            jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P(AXIS))),
            jax.device_put(jnp.ones(3), replicated))
    return step, args


@pytest.mark.parametrize("program", ["shard_map", "mlp adam"])
def test_the_capture_compiles_no_executable_and_names_jits_shardings(request, program):
    if not needs_devices(request):
        return
    if program == "shard_map":
        jitted, args = _shard_map_step()
    else:
        made = make_program("mlp", "adam", 8)
        jitted, args = made.step, (*made.init(), made.batch(0))
    cap = capture(jitted, args, {})
    assert cap.jit.compiled is None  # stopped once partitioned: no code generated
    assert "all-reduce" in cap.text
    ins, outs = _jits_shardings(jitted, args)
    assert _same(cap.in_shardings, ins) and _same(cap.out_shardings, outs)
    assert cap.jit.executable() is cap.jit.executable()  # compiled once, when needed


def test_the_stop_leaves_other_compiles_alone(request):
    """A compile on another thread while a capture is armed runs to the end; once no
    capture is armed the stop is no longer registered."""
    if not needs_devices(request):
        return
    from jax.extend import xla as jax_xla

    jitted, args = _shard_map_step()
    done = []

    def other() -> None:
        done.append(jax.jit(lambda w: jax.lax.psum(w, ()) * 2.0).lower(args[0]).compile())

    with _xla.PARTITION_STOP.arming(Path("/nonexistent")):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert done and float(done[0](args[0])[0, 0]) == 2.0
    assert not jax_xla.clear_hlo_module_transformation(
        _xla.STOP_NAME, jax_xla.PipelineStage.PRE_SCHEDULER, platforms="cpu")
    cap = capture(jitted, args, {})
    assert cap.jit.compiled is None


def test_a_killed_capture_s_dump_folder_is_swept_by_the_next(tmp_path):
    """A capture killed mid-compile (SIGKILL skips its ``finally``) left its dump folder
    in the shared temp folder; the next capture on the host removes such leftovers of
    gone processes, and nothing else: a live process's, another host's, a file."""
    from hlo_shard.jax._capture import _alive, _sweep_leftovers

    limit = Path("/proc/sys/kernel/pid_max")
    gone = (int(limit.read_text()) if limit.exists() else 2 ** 22) + 1  # never a pid
    assert not _alive(gone)
    own = "hlo-shard-capture-thishost-"
    left = tmp_path / f"{own}{gone}-a1"
    left.mkdir()
    (left / "module.txt").write_text("HloModule m")
    kept = [tmp_path / f"{own}{os.getpid()}-b2",
            tmp_path / f"hlo-shard-capture-otherhost-{gone}-c3"]
    for folder in kept:
        folder.mkdir()
    a_file = tmp_path / f"{own}{gone}-d4"
    a_file.write_text("")
    _sweep_leftovers(tmp_path, own)
    assert not left.exists()
    assert all(folder.is_dir() for folder in kept) and a_file.is_file()
