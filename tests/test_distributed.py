"""``verify --processes``: modules run on 2 real jax.distributed processes × 2 CPU
devices each (gloo collectives, coordinator on 127.0.0.1), compared as in one
process; a process that dies or hangs ends the run with exit 2 naming it, and no
process outlives the run or its parent. A few seconds per test (each run starts
two jax processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from hlo_shard import runtime
from hlo_shard.cli import main
from hlo_shard.errors import HloRuntimeError, HloShardError
from hlo_shard.runtime.distributed import DistributedWorker

ROOT = Path(__file__).resolve().parent.parent
ADAM = ROOT / "fixtures" / "spmd" / "adam.n4.hlo"
pytestmark = pytest.mark.skipif(not ADAM.exists(), reason=f"{ADAM} not generated")
TWO_BY_TWO = ("--processes", "2", "--devices", "4")

#: Each device's id, and the all-reduce of a per-device value: shows which device
#: ran which replica and that values reached the right process.
WHO = """HloModule who, replica_count=4
add { x = f32[] parameter(0) y = f32[] parameter(1) ROOT r = f32[] add(x, y) }
ENTRY e { g = f32[3] parameter(0) s = f32[3] all-reduce(g), replica_groups={}, to_apply=add
 id = u32[] replica-id() ROOT t = (u32[], f32[3], f32[3]) tuple(id, s, g) }
"""


@pytest.fixture(scope="module")
def optimized(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("distributed")
    out, manifest = folder / "adam.opt.hlo", folder / "adam.opt.json"
    made = CliRunner().invoke(main, ["optimize", str(ADAM), "-o", str(out), "--state",
                                     "sharded", "--manifest", str(manifest)])
    assert made.exit_code == 0, made.output
    return out, manifest


def verify_cli(*args: str):
    return CliRunner().invoke(main, ["verify", *args])


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], seconds: float = 10) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


# ----------------------------------------------------------------------- verdicts


def test_optimized_fixture_matches_on_two_processes(optimized):
    out, manifest = optimized
    result = verify_cli(str(ADAM), str(out), "--manifest", str(manifest), "--steps", "2",
                        "--processes", "2")  # 4 devices: the module's count
    assert result.exit_code == 0, result.output
    assert "MATCH: all 14 outputs agree on 4 cpu devices over 2 steps" in result.stdout
    assert "ran in 2 processes x 2 devices through jax.distributed" in result.stdout


def test_mutated_candidate_differs_on_two_processes(optimized, tmp_path):
    out, manifest = optimized
    mutant = tmp_path / "mutant.hlo"
    text = out.read_text()
    assert text.count("constant(-0.001)") == 1  # Adam's learning rate
    mutant.write_text(text.replace("constant(-0.001)", "constant(-0.002)"))
    result = verify_cli(str(ADAM), str(mutant), "--manifest", str(manifest), "-q",
                        *TWO_BY_TWO)
    assert result.exit_code == 1, result.output
    assert "DIFFERENT:" in result.stdout and "on 4 cpu devices" in result.stdout


def test_values_reach_the_devices_of_their_process():
    grads = [np.full(3, 10.0 ** d, np.float32) for d in range(4)]
    with DistributedWorker(2, 4) as worker:
        exe = runtime.load(WHO, worker=worker)
        ids, sums, echoed = exe([g for g in grads])
        assert worker.info["local_device_ids"][1] != worker.info["local_device_ids"][0]
    assert [int(i) for i in ids] == [0, 1, 2, 3]
    for device in range(4):
        np.testing.assert_array_equal(sums[device], np.full(3, 1111.0, np.float32))
        np.testing.assert_array_equal(echoed[device], grads[device])


def test_devices_must_split_evenly():
    result = verify_cli(str(ADAM), "--processes", "3", "--devices", "4")
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: 4 devices cannot be split evenly over 3 "
                                     "processes; choose --devices as a multiple of --processes")
    result = verify_cli(str(ADAM), "--processes", "2", "--backend", "gpu")
    assert result.exit_code == 2 and result.stderr.startswith(
        "error: --processes starts local CPU processes; for gpu across hosts")
    with pytest.raises(HloShardError, match="for 2 devices cannot run on the 4 devices"), \
            DistributedWorker(2, 4) as worker:
        runtime.load(WHO.replace("replica_count=4", "replica_count=2"), worker=worker)


def test_local_device_count_needs_the_device_count():
    """Before the first compile says the count: the user error, once a TypeError."""
    with DistributedWorker(2) as worker, pytest.raises(HloShardError, match="pass --devices"):
        worker.local_device_count  # noqa: B018 - the property raises
    assert DistributedWorker(2, 4).local_device_count == 2


# ----------------------------------------------------------------------- failures


def _start_long_run(tmp_path, timeout: str = "60"):
    """A CLI run timing forever; returns (process, stderr path, its two children)."""
    module = tmp_path / "who.hlo"
    module.write_text(WHO)
    log = tmp_path / "stderr.txt"
    process = subprocess.Popen(
        [sys.executable, "-m", "hlo_shard", "verify", str(module), str(module),
         "--time", "100000000", "--timeout", timeout, *TWO_BY_TWO],
        stdout=subprocess.PIPE, stderr=log.open("wb"),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        # Python keeps SIGINT ignored if it starts ignored (as under a background shell).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while "timing:" not in log.read_text() and process.poll() is None:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    children = children_of(process.pid)
    assert len(children) == 2, log.read_text()
    return process, log, sorted(children)


def test_killed_process_ends_the_run_with_its_last_line(tmp_path):
    process, log, children = _start_long_run(tmp_path)
    os.kill(children[1], signal.SIGKILL)
    assert process.wait(timeout=60) == 2
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("error: timing: process 1 of 2 killed by SIGKILL; "
                           "last stderr line: process 1: time "), last
    assert last.endswith("(all 2 processes were stopped)")
    assert wait_gone(children) == []


def test_hung_process_is_bounded_by_the_timeout(tmp_path):
    process, log, children = _start_long_run(tmp_path, timeout="3")
    os.kill(children[1], signal.SIGSTOP)
    try:
        assert process.wait(timeout=60) == 2
    finally:
        for child in children:
            if running(child):
                os.kill(child, signal.SIGKILL)
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("error: timing: timed out after 3 s: "), last
    assert "process 1 of 2 stopped answering; last stderr line: process 1: time" in last
    assert wait_gone(children) == []


def test_processes_die_with_their_parent(tmp_path):
    process, _, children = _start_long_run(tmp_path)
    process.kill()  # no cleanup code runs in the parent
    process.wait()
    assert wait_gone(children) == []


def test_interrupted_run_stops_its_processes_at_once(tmp_path):
    process, _, children = _start_long_run(tmp_path)
    os.kill(process.pid, signal.SIGINT)  # Ctrl-C: the processes ignore it, the parent not
    assert process.wait(timeout=30) != 0
    assert wait_gone(children, seconds=3) == []


def test_a_dead_process_is_reported_to_the_api():
    with DistributedWorker(2, 4) as worker:
        exe = runtime.load(WHO, worker=worker)
        os.kill(worker.pids[0], signal.SIGKILL)
        pids = worker.pids
        with pytest.raises(HloRuntimeError, match=r"process 0 of 2 killed by SIGKILL"):
            exe([np.zeros(3, np.float32)] * 4)
        assert wait_gone(pids) == [] and not worker.alive
        # The next call starts a fresh pair of processes and compiles again.
        ids, _, _ = exe([np.zeros(3, np.float32)] * 4)
        assert [int(i) for i in ids] == [0, 1, 2, 3] and worker.generation == 2


# ------------------------------------------------ hlo_shard.jax across processes

DEMO = ROOT / "scripts" / "demo_distributed.py"
#: The demo's training loop, small: 10 steps of an MLP + Adam, 2 rows per device.
LOOP = ["--steps", "10", "--width", "32", "--layers", "3"]


def _training(processes: int, devices_per_process: int, *args: str) -> list[dict]:
    from hlo_shard.runtime.distributed import launch

    sys.path.insert(0, str(DEMO.parent))
    import demo_distributed

    return demo_distributed.results_of(launch(DEMO, [*LOOP, *args], processes,
                                              devices_per_process, timeout=300))


def test_training_in_two_processes_equals_one_process():
    """The same 10 steps through shard_weight_update, both state modes, on 2 processes
    x 2 devices (sharded: with a checkpoint round trip before step 6) and on 1 process
    x 4 (without): the same losses, parameters and optimizer state (after gather_args)
    within f32 rounding of sums taken in another order (gloo's across processes, XLA's
    in one), and every process holding the same full values."""
    modes = ("--modes", "gathered,sharded")
    one = {r["mode"]: r for r in _training(1, 4, *modes)}
    two = _training(2, 2, *modes, "--resume-at", "5")
    assert sorted((r["mode"], r["process"]) for r in two) == [
        ("gathered", 0), ("gathered", 1), ("sharded", 0), ("sharded", 1)]
    for mode, reference in one.items():
        first, second = (r for r in two if r["mode"] == mode)
        assert reference["sharded"] and first["sharded"] == reference["sharded"]
        assert first["leaves"] == second["leaves"] and first["losses"] == second["losses"]
        np.testing.assert_allclose(first["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        for ours, theirs in zip(first["leaves"], reference["leaves"]):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_processes_compare_programs_without_their_debug_info():
    """Two processes started from copies of a script in other folders (or calling the
    step from another line) build modules whose source paths and call sites differ: the
    same program. They compared the whole text, and every such run kept the step whole
    (install) or raised into the loop (shard_weight_update)."""
    from hlo_shard.fuzz.frontend import STACK_FRAMES
    from hlo_shard.jax._distributed import program_digest

    def module(path: str, line: int, opcode: str = "add") -> str:
        frames = STACK_FRAMES.replace('"train.py"', f'"{path}"').replace("line=14", f"line={line}")
        return (f"HloModule jit_step, entry_computation_layout={{(f32[8]{{0}})->f32[8]{{0}}}}"
                f"{frames}\n\nENTRY %main (p: f32[8]) -> f32[8] {{\n"
                f"  %p = f32[8]{{0}} parameter(0)\n"
                f"  ROOT %a = f32[8]{{0}} {opcode}(f32[8]{{0}} %p, f32[8]{{0}} %p), "
                f'metadata={{op_name="jit(step)/{{x}}" source_file="{path}" source_line={line} '
                f"stack_frame_id=2}}\n}}\n")

    first = module("/home/a/run/train.py", 14)
    assert program_digest(first) == program_digest(module("/scratch/b/train.py", 31))
    assert program_digest(first) != program_digest(module("/home/a/run/train.py", 14,
                                                          "multiply"))


def test_processes_that_build_different_programs_all_run_fn(tmp_path):
    """Process 1 optimizes with another strategy: the two programs differ, so every
    process runs ``fn`` (one ``FallbackWarning``, ``processes_disagree``) and trains as
    plain jit does. It raised ``HloShardError`` into both loops."""
    script = tmp_path / "disagree.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(DEMO.parent)!r})
import demo_distributed
args = demo_distributed.parse_args()
args.strategy = "per-tensor" if args.process_id else "combined"
for result in demo_distributed.train(args):
    print("RESULT " + demo_distributed.json.dumps(result))
""")
    plain, ran = _modes(script, "jit,gathered")
    assert len(ran) == 2 and all(r["fallback"] == "processes_disagree" for r in ran), ran
    assert all(r["losses"] == p["losses"] for r, p in zip(ran, plain))


def test_a_process_whose_capture_fails_tells_the_others_at_once(tmp_path):
    """Process 1 cannot capture the step (its dump folder cannot be made): it runs ``fn``
    and says so under the step's name, which it has from jit's lowering. It published
    nothing (the processes named the step by the module only a capture gives), so
    process 0 waited for it until the timeout before running ``fn`` too."""
    script = tmp_path / "capture_fails.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(DEMO.parent)!r})
import demo_distributed
from hlo_shard.jax import _capture, _distributed
args = demo_distributed.parse_args()
_distributed.AGREE_TIMEOUT_S = 45
if args.process_id == 1:
    def no_folder():
        raise OSError("no space left on device")
    _capture._capture_folder = no_folder
for result in demo_distributed.train(args):
    print("RESULT " + demo_distributed.json.dumps(result))
""")
    plain, ran = _modes(script, "jit,gathered")
    assert [r["fallback"] for r in ran] == ["processes_disagree", "capture_failed"], ran
    assert "process 1: original" in ran[0]["reason"], ran[0]["reason"]
    assert all(r["losses"] == p["losses"] for r, p in zip(ran, plain))


def test_each_process_training_on_its_own_devices_needs_no_agreement(tmp_path):
    """Each process trains its own copy on a mesh of its own devices (a sweep, one run per
    host): no other process builds its step, so there is nothing to agree on (as the hook
    already knew). shard_weight_update asked the other process anyway, found another
    program or none, and raised into both loops."""
    script = tmp_path / "own_devices.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(DEMO.parent)!r})
import demo_distributed, jax
initialize = jax.distributed.initialize

def initialize_then_keep_to_my_devices(**kwargs):
    initialize(**kwargs)
    jax.devices = jax.local_devices  # the demo's mesh: this process's devices

jax.distributed.initialize = initialize_then_keep_to_my_devices
args = demo_distributed.parse_args()
args.width = 32 if args.process_id == 0 else 48  # a sweep: each its own model
for result in demo_distributed.train(args):
    print("RESULT " + demo_distributed.json.dumps(result))
""")
    plain, ran = _modes(script, "jit,sharded")
    assert len(ran) == 2 and all(r["fallback"] is None and r["sharded"] for r in ran), ran
    assert [r["devices"] for r in ran] == [2, 2]
    for r, p in zip(ran, plain):
        np.testing.assert_allclose(r["losses"], p["losses"], rtol=1e-5, atol=1e-6)


def test_a_step_one_process_compiles_ahead_is_agreed_on_when_the_others_build_it(tmp_path):
    """Process 0 compiles the step ahead (``lower(...).compile()``, for its memory
    figures) and then runs it; process 1 only runs it. The processes agree per module
    handed to the hook, not per build counted: numbered builds put process 0 one build
    ahead, so it waited 600 s inside XLA's compile for a build process 1 never made,
    and kept every later step whole."""
    script = tmp_path / "ahead.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(DEMO.parent)!r})
import demo_distributed, jax
jit = jax.jit

def jit_compiling_ahead(fn, **kwargs):
    step = jit(fn, **kwargs)
    if jax.process_index() != 0 or fn.__name__ != "train_step":
        return step
    first = []
    def run(*args):
        if not first:
            first.append(step.lower(*args).compile().memory_analysis())
        return step(*args)
    return run

jax.jit = jit_compiling_ahead
for result in demo_distributed.train(demo_distributed.parse_args()):
    print("RESULT " + demo_distributed.json.dumps(result))
""")
    _both_sharded_as_jit_trains(*_modes(script, "jit,hook"))


def test_a_process_that_builds_the_step_late_runs_the_original_with_the_others(tmp_path):
    """Process 1 reaches the step after process 0 stopped waiting for it (the wait cut to
    3 s here): process 0 runs the original and says so in its answer, so process 1, which
    finds that answer, runs the original too. Process 1 ran the sharded module beside
    process 0's original, and XLA aborted both (a collective mismatch)."""
    script = tmp_path / "late.py"
    script.write_text(f"""import sys, time
sys.path.insert(0, {str(DEMO.parent)!r})
import demo_distributed
import hlo_shard.jax as hsj
from hlo_shard.jax import _distributed
_distributed.AGREE_TIMEOUT_S = 3
install = hsj.install

def install_late(*args, **kwargs):
    installation = install(*args, **kwargs)
    import jax
    if jax.process_index() == 1:
        time.sleep(8)
    return installation

hsj.install = install_late
for result in demo_distributed.train(demo_distributed.parse_args()):
    print("RESULT " + demo_distributed.json.dumps(result))
""")
    plain, hooked = _modes(script, "jit,hook")
    assert len(hooked) == 2 and all(r["sharded"] == 0 for r in hooked), \
        [r["hook_reasons"] for r in hooked]
    reasons = {r["process"]: r["hook_reasons"] for r in hooked}
    assert any("process 1 did not build this step within 3 s" in why for why in reasons[0])
    assert any("processes built different programs" in why for why in reasons[1])
    assert all(h["losses"] == p["losses"] for h, p in zip(hooked, plain))


def test_the_hook_in_two_processes_equals_one_process():
    """install() under jax.distributed: every process compiles the same step, agrees on
    the same sharded module by hash, and the 10 steps give one process x 4's losses and
    values (within the reordered sums of gloo), every process holding the same."""
    one = _training(1, 4, "--modes", "jit,hook")
    two = _training(2, 2, "--modes", "hook")
    reference = next(r for r in one if r["mode"] == "hook")
    plain = next(r for r in one if r["mode"] == "jit")
    assert reference["sharded"] >= 1 and all(r["sharded"] == reference["sharded"] for r in two)
    np.testing.assert_allclose(reference["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
    first, second = two
    assert first["leaves"] == second["leaves"] and first["losses"] == second["losses"]
    np.testing.assert_allclose(first["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(first["leaves"], reference["leaves"]):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-6)


def _both_sharded_as_jit_trains(plain: list[dict], hooked: list[dict]) -> None:
    """Both processes' hooks sharded the step, the processes hold the same values, and
    the losses are jit's (within gloo's reordered sums)."""
    assert len(hooked) == 2 and all(r["sharded"] >= 1 for r in hooked), \
        [r["hook_reasons"] for r in hooked]
    assert hooked[0]["leaves"] == hooked[1]["leaves"]
    for h, p in zip(hooked, plain):
        np.testing.assert_allclose(h["losses"], p["losses"], rtol=1e-5, atol=1e-6)


def _modes(script: Path, modes: str) -> tuple[list[dict], list[dict]]:
    """The demo loop's results of ``script`` on 2 processes x 2 devices in ``modes``
    ("jit,MODE"): plain jit's and MODE's, one per process each, in process order."""
    from hlo_shard.runtime.distributed import launch

    sys.path.insert(0, str(DEMO.parent))
    import demo_distributed

    results = sorted(demo_distributed.results_of(
        launch(script, [*LOOP, "--modes", modes], 2, 2, timeout=300)),
        key=lambda r: r["process"])
    other = modes.split(",")[1]
    return ([r for r in results if r["mode"] == "jit"],
            [r for r in results if r["mode"] == other])


def test_processes_whose_hooks_disagree_all_compile_the_original(tmp_path):
    """install() with another strategy in process 1: the two sharded modules differ, so
    both callbacks return the original (none waits in the other's collectives) and the
    loop trains as plain jit does."""
    script = tmp_path / "disagree_hook.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(DEMO.parent)!r})
import demo_distributed
args = demo_distributed.parse_args()
args.strategy = "per-tensor" if args.process_id else "combined"
for result in demo_distributed.train(args):
    print("RESULT " + demo_distributed.json.dumps(result))
""")
    plain, hooked = _modes(script, "jit,hook")
    assert len(hooked) == 2 and all(r["sharded"] == 0 for r in hooked)
    assert all(any("processes built different programs" in why for why in r["hook_reasons"])
               for r in hooked)
    assert all(h["losses"] == p["losses"] for h, p in zip(hooked, plain))


def test_a_process_compiling_on_its_own_devices_leaves_the_hooks_in_step(tmp_path):
    """Process 0 computes a metric on its own devices (an all-reduce over them) between
    install() and the training step: no other process compiles that module, so the
    hook agrees on nothing for it. Counted as a build, it put the train step's
    agreement out of step: process 0 waited 600 s inside XLA's compile for a build
    process 1 never made, and both then kept the step whole, blaming it."""
    script = tmp_path / "local_metric.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(DEMO.parent)!r})
import demo_distributed
import hlo_shard.jax as hsj
install = hsj.install

def install_then_a_local_metric(*args, **kwargs):
    installation = install(*args, **kwargs)
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    if jax.process_index() == 0:
        mesh = Mesh(np.array(jax.local_devices()), ("d",))
        x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("d")))
        float(jax.jit(lambda v: (v ** 2).mean())(x))
    return installation

hsj.install = install_then_a_local_metric
for result in demo_distributed.train(demo_distributed.parse_args()):
    print("RESULT " + demo_distributed.json.dumps(result))
""")
    plain, hooked = _modes(script, "jit,hook")
    _both_sharded_as_jit_trains(plain, hooked)
    # (the metric went through the hook: one decision more in process 0)
    assert [len(r["hook_reasons"]) for r in sorted(hooked, key=lambda r: r["process"])] == \
        [2, 1], [r["hook_reasons"] for r in hooked]


#: One process of a (data=4, model=2) run on 2 processes x 4 devices: tensor-parallel
#: weights on ``model``, ``state="sharded"`` with a checkpoint round trip before step 2,
#: against plain jit in the same processes.
DATA_BY_MODEL = '''import argparse, json, sys
import numpy as np
sys.path.insert(0, {root!r})
parser = argparse.ArgumentParser()
for flag in ("--coordinator", "--num-processes", "--process-id"):
    parser.add_argument(flag)
args = parser.parse_args()
import jax
jax.distributed.initialize(coordinator_address=args.coordinator,
                           num_processes=int(args.num_processes),
                           process_id=int(args.process_id))
import jax.numpy as jnp
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import hlo_shard.jax as hsj

OPT = optax.adam(1e-2)
def loss_fn(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"]) ** 2)
def step(p, s, x):
    updates, s = OPT.update(jax.grad(loss_fn)(p, x), s, p)
    return optax.apply_updates(p, updates), s, loss_fn(p, x)
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
def put(tree, specs):
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(
        x.shape, NamedSharding(mesh, s), lambda index: x[index]), tree, specs)
rng = np.random.default_rng(0)
start = {{"w1": rng.normal(size=(64, 128)).astype(np.float32) * 0.1,
         "w2": rng.normal(size=(128, 64)).astype(np.float32) * 0.1,
         "b": np.full((64,), 0.5, np.float32)}}
specs = {{"w1": P(None, "model"), "w2": P("model", None), "b": P()}}
state = jax.tree.map(np.asarray, OPT.init(start))
state_specs = jax.tree.map(lambda leaf: P(), state)
state_specs = (state_specs[0]._replace(mu=specs, nu=specs), *state_specs[1:])
p = p_jit = put(start, specs)
s = s_jit = put(state, state_specs)
fast = hsj.shard_weight_update(jax.jit(step), state="sharded", force=True)
jitted = jax.jit(step)
losses = []
for number in range(4):
    x = put(rng.normal(size=(32, 64)).astype(np.float32), P("data", None))
    if number == 2:
        p, s = fast.shard_args(*fast.gather_args(p, s))
    p, s, loss = fast(p, s, x)
    p_jit, s_jit, loss_jit = jitted(p_jit, s_jit, x)
    losses.append([float(loss.addressable_data(0)), float(loss_jit.addressable_data(0))])
full = jax.tree.leaves(fast.gather_args(p, s))
leaves = [np.abs(multihost_utils.process_allgather(a, tiled=True)
                 - multihost_utils.process_allgather(b, tiled=True)).max()
          for a, b in zip(full, jax.tree.leaves((p_jit, s_jit)))]
print("RESULT " + json.dumps({{"fallback": fast.report["fallback"], "losses": losses,
                              "sharded": fast.report["sharded"],
                              "largest_difference": float(max(leaves)),
                              "shapes_match": [a.shape for a in full]
                              == [b.shape for b in jax.tree.leaves((p_jit, s_jit))]}}))
jax.distributed.shutdown()
'''


def test_a_data_by_model_mesh_trains_on_two_processes(tmp_path):
    """A (data=4, model=2) mesh spanning 2 processes x 4 devices, state="sharded": each
    process cuts its own devices' chunks of the tensor-parallel state and gathers them
    back (the checkpoint round trip before step 2); losses and the final leaves are
    jit's within f32 rounding of sums taken across processes in another order."""
    from hlo_shard.runtime.distributed import launch

    sys.path.insert(0, str(DEMO.parent))
    import demo_distributed

    script = tmp_path / "data_by_model.py"
    script.write_text(DATA_BY_MODEL.format(root=str(ROOT)))
    results = demo_distributed.results_of(launch(script, [], 2, 4, timeout=300))
    assert len(results) == 2 and results[0] == results[1]
    result = results[0]
    assert result["fallback"] is None and result["sharded"] >= 2 and result["shapes_match"]
    for ours, theirs in result["losses"]:
        np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert result["largest_difference"] <= 1e-5
