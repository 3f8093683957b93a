"""``hlo_shard.jax.install()``: the pass inside XLA's compilation of unmodified jax steps.

The jax programs run in a child process (tests/jax_hook_scenarios.py: the CPU device
count must be set before jax starts), one per test module or slow test; each training
scenario compares an unmodified ``jax.jit`` (or ``shard_map``) loop with and without the
hook — bitwise where XLA vectorizes the sharded program as the whole one, within
:data:`HOST_ROUNDING` elsewhere. Numeric checks of
fused rewrites can only go through this path: XLA will not compile its own optimized
dumps again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "tests" / "jax_hook_scenarios.py"


def run_scenarios(devices: int, steps: int, *names: str, envelope: bool = False) -> dict:
    """``envelope``: each training scenario also measures its rounding envelope
    (``jax_hook_scenarios.envelope``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), SCENARIOS_ENVELOPE="1" if envelope else "0")
    run = subprocess.run([sys.executable, str(SCENARIOS), str(devices), str(steps), *names],
                         env=env, capture_output=True, text=True, check=False, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def quick():
    return run_scenarios(4, 3, "idempotence", "failure", "no_gradients", "jit:adam", "mutant",
                         "per_tensor", "loop:adam", "only_other", "interrupt", "reuse",
                         "layernorm:adamw_clip", "pmap:adam", "donation", "checked_scan",
                         "scan_bf16:adam", "callback:adam")


def test_install_and_uninstall_are_idempotent(quick):
    result = quick["idempotence"]
    assert result["registered_once"] and not result["installed_after"]
    # two installs: the module is sharded once (one decision, not two applications)
    assert result["applications"] == 1 and result["changed"] == [True]
    assert result["same_losses"]
    # after uninstall (twice), steps compile without the pass
    assert result["untouched_after_uninstall"] and result["after_losses_equal"]


def test_a_module_compiled_again_is_not_passed_again(quick):
    """jax's caches cleared inside one installation: XLA compiles the step again and the
    hook hands back what it made of it the first time; the next installation passes it
    afresh. The losses are the same every time."""
    result = quick["reuse"]
    assert result["reused"] == [False, True, False] and result["changed"] == [True] * 3
    assert result["same_losses"]


@pytest.mark.parametrize("case", ["exception", "invalid"])
def test_a_failing_pass_never_reaches_jax(quick, case):
    """The pass raising, or a result the validator rejects: jax compiles the original,
    the step runs, one log line on the ``hlo_shard`` logger says why."""
    result = quick["failure"][case]
    assert result["same_losses"] and result["changed"] == [False]
    expected = "injected failure" if case == "exception" else "fails validation"
    assert expected in result["reasons"][0]
    assert len(result["log"]) == 1 and expected in result["log"][0]


@pytest.mark.parametrize("case", ["raise", "signal"])
def test_ctrl_c_in_the_callback_stops_the_program_as_a_keyboard_interrupt(quick, case):
    """The callback keeps the KeyboardInterrupt (XLA would report it as INTERNAL) and
    raises it again once XLA's compile returned; nothing is left pending, and the next
    compile goes through the hook as before."""
    result = quick["interrupt"][case]
    assert result["raised"] == "KeyboardInterrupt" and not result["pending"]
    assert result["after_changed"] and all(result["after_changed"])
    assert result["after_same_losses"]


def test_the_interpreter_s_exit_waits_for_a_pass_running_on_xla_s_thread():
    """XLA runs the hook on its own compile thread; a Ctrl-C ends the program in jax's
    thread meanwhile, and an interpreter finalized under a thread still running the pass
    aborted the process (SIGSEGV or SIGABRT, a probe's loop). The exit handler returns
    only once no call of the hook is in progress, and leaves none to come."""
    import threading

    from hlo_shard.jax.hook import _Hook

    hook = _Hook()
    hook.running = 1
    finished = threading.Event()

    def pass_in_progress() -> None:
        finished.wait(timeout=30)
        with hook.idle:
            hook.running -= 1
            hook.idle.notify_all()

    thread = threading.Thread(target=pass_in_progress)
    thread.start()
    threading.Timer(0.2, finished.set).start()
    hook.wait_until_idle()
    assert finished.is_set() and hook.running == 0 and hook.settings is None
    thread.join()
    assert hook.transform(b"all-reduce") is None  # (a later call returns at once)


#: One data-parallel SGD step through jax's persistent compilation cache in ``argv[1]``,
#: compiled under ``install(**json.loads(argv[2]))`` (``null``: without the hook); prints
#: whether the executable reduce-scatters and how many modules the hook saw.
CACHED_STEP = """import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import hlo_shard.jax as hsj
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
settings = json.loads(sys.argv[2])
if settings is not None:
    hsj.install(**settings)
mesh = Mesh(np.array(jax.devices()), ("d",))
def step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
w = jax.device_put(np.ones((64, 64), np.float32), NamedSharding(mesh, P()))
x = jax.device_put(np.ones((8, 64), np.float32), NamedSharding(mesh, P("d")))
text = jax.jit(step).lower(w, x).compile().as_text()
print(json.dumps(["reduce-scatter" in text, len(hsj.decisions())]))
"""


def test_install_keys_jax_s_persistent_compilation_cache(tmp_path):
    """A step is cached under the hook's build and settings: one cached without the hook
    is compiled again under install() (a probe: it ran unsharded from the cache, the hook
    never called, decisions() empty), one cached under it is not run by a process without
    it, nor under other settings; under the same settings the cache serves it."""
    def run(settings: dict | None) -> list:
        done = subprocess.run([sys.executable, "-c", CACHED_STEP, str(tmp_path / "cache"),
                               json.dumps(settings)], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                              capture_output=True, text=True, check=False, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert run(None) == [False, 0]  # cached without the hook
    assert run({"force": True}) == [True, 1]  # compiled again, through the hook
    assert run(None) == [False, 0]  # the cache's entry without the hook
    assert run({"force": True, "min_shard_bytes": 1 << 40}) == [False, 1]  # other settings
    assert run({"force": True}) == [True, 0]  # from the cache, sharded


def test_modules_without_gradients_are_untouched(quick):
    result = quick["no_gradients"]
    # optax init has no all-reduce: skipped by the quick check, never parsed
    assert result["modules"] == ["jit_loss_fn"] and result["changed"] == [False]
    assert result["direct"]  # bytes that are no module: None, no exception


def test_only_filters_modules_by_name(quick):
    result = quick["only_other"]  # only="^jit_eval": the step is compiled as it was
    assert result["changed"] == [] and result["loss"] == 0.0 and result["params"] == 0.0


#: How far a hooked step's numbers may be from plain jit's (relative to each tensor's
#: largest value). Bitwise where XLA:CPU vectorizes the shards' loops as it does the whole
#: arrays' (the hosts these tests were written on); on a host of another vector width
#: some sums round in another order (an AMD EPYC without AVX-512: up to 9e-7 after 3
#: steps, the code before and after this bound alike). A wrong rewrite is off by far more
#: (test_the_comparison_catches_a_wrong_rewrite: 0.67).
HOST_ROUNDING = 1e-5


def jits_numbers(result: dict) -> bool:
    """The hooked loop's losses and parameters are plain jit's, to :data:`HOST_ROUNDING`."""
    return result["loss"] <= HOST_ROUNDING and result["params"] <= HOST_ROUNDING


def test_jit_adam_loop_gives_jits_numbers(quick):
    result = quick["jit:adam"]
    assert result["changed"] == [True]
    assert jits_numbers(result)
    assert result["sharded_bytes"] == result["gradient_bytes"] - 4  # all but the loss


def test_a_changed_module_says_xla_dropped_its_donation(quick):
    """XLA's hook keeps no input-output alias of a module it is handed back (jaxlib
    0.10.2 on CPU): the decision says so where the step donated. Should a jaxlib keep
    them, this fails, and ``Decision.donation_dropped`` must learn to tell."""
    result = quick["donation"]
    assert result["plain"] > 0 and result["changed"] == [True]
    assert result["hooked"] == 0 and result["dropped"] == [True]
    assert quick["jit:adam"]["donation_dropped"] == [True]


def test_the_log_line_says_what_changed_a_module_with_nothing_sharded():
    """A module the hook changed without sharding a gradient (its all-reduces moved out
    of an accumulation loop: the gate's ``moves_only``) said "sharded 0 of N gradient
    bytes" and nothing else, as if nothing had been done."""
    from hlo_shard.jax.hook import Decision
    from hlo_shard.passes.weight_update import Explanation, ShardingReport

    def decision(sharded: bool, changed: bool = True, reason: str = "") -> Decision:
        row = Explanation("main", "all-reduce.1", None, "f32[256]", 1024, sharded,
                          reason="" if sharded else "left out by the speed gate's size cut-off")
        return Decision("jit_step", changed, reason, ShardingReport(8, [row]), 0.1)

    moved = decision(sharded=False).summary()
    assert moved.startswith("jit_step: sharded 0 of 1024 gradient bytes (changed by moving")
    assert "accumulation loops" in moved
    assert decision(sharded=True).summary() == "jit_step: sharded 1024 of 1024 gradient bytes"
    kept = decision(sharded=False, changed=False, reason="nothing sharded (why)\nmore")
    assert kept.summary() == "jit_step left unchanged: nothing sharded (why)"


def test_the_clipping_norm_sums_its_tiles_on_the_gradients_blocks(quick):
    """The LayerNorm MLP with global norm clipping: XLA:CPU sums each weight gradient's
    squares in 32×32 tiles (a reduce-window fusion) before the norm; the pass runs those
    fusions on each device's block of rows instead of all-gathering the gradient for
    them, and the step keeps jit's numbers."""
    result = quick["layernorm:adamw_clip"]
    assert result["changed"] == [True], result["reasons"]
    assert result["block_bodies"] >= 1
    assert jits_numbers(result)
    assert result["sharded_bytes"] == result["gradient_bytes"] - 4  # all but the loss


def test_a_pmap_step_is_sharded_as_it_is(quick):
    """flax's ImageNet example steps with ``jax.pmap`` and ``lax.pmean``: that step, not
    rewritten for ``jax.jit``, is sharded inside XLA's compile and trains with jit's
    numbers (``shard_weight_update`` refuses it up front: test_jax_step) — once the caller
    says every device holds the same copy of the weights (``pmap_replicated=True``, as
    ``flax.jax_utils.replicate`` makes them). The module cannot say so: a probe's copies
    that differed per device trained differently, sharded unasked. Unasked, the step
    compiles as it is, and the reason says what to pass."""
    result = quick["pmap:adam"]
    assert result["unasked"] and not any(changed for changed, _ in result["unasked"])
    assert any("install(pmap_replicated=True)" in reason for _, reason in result["unasked"])
    assert result["changed"] and all(result["changed"]), result["reasons"]
    assert jits_numbers(result)
    assert result["sharded_bytes"] == result["gradient_bytes"] - 4 * len(result["changed"])


def test_sums_summed_again_in_a_scan_are_moved_one_sweep_at_a_time(quick):
    """shard_map's default check_vma under a microbatch scan: the pass raised (a
    KeyError: a move planned on a sum an earlier move of the same sweep had taken) and
    the hook kept the step; now it is sharded and trains like it."""
    result = quick["checked_scan"]
    assert result["changed"] == [True], result["reasons"]
    assert result["params"] < 1e-6


def test_scanned_layers_in_bf16_compute_are_sharded_after_their_loop(quick):
    """MaxText's ``scan_layers`` in bf16 compute from f32 weights: XLA:CPU all-reduces
    each layer's gradient in the backward loop and rounds the f32 sum back to bf16 as it
    writes it into the stacked gradient. The sum leaves the loop with its rounding (the
    hook kept every such gradient whole, "no update work downstream"); every gradient
    but the loss's sum is sharded and the step trains with jit's numbers."""
    result = quick["scan_bf16:adam"]
    assert result["changed"] == [True], result["reasons"]
    assert result["sharded_bytes"] == result["gradient_bytes"] - 4
    assert any("moved after the loop" in note for note in result["notes"])
    assert jits_numbers(result)


def test_a_step_that_calls_back_into_the_host_is_kept_as_it_is(quick):
    """``jax.debug.callback`` in the step (a probe's LAMB step: 8 of 9 hooked runs hung
    in an all-gather, then XLA aborted the process): every collective stays where it is,
    the rows say why, and the callback runs on each step as under jit."""
    result = quick["callback:adam"]
    assert result["changed"] == [False] and "calls back into the host" in result["reasons"][0]
    assert result["loss"] == 0.0 and result["params"] == 0.0
    assert result["calls"] == 2 * 3  # plain and hooked, STEPS each


def test_per_tensor_collectives_give_jits_numbers(quick):
    """One reduce-scatter per gradient: the transposed weight gradients go through the
    flat path (a laid-out module's collectives split the major dimension only)."""
    result = quick["per_tensor"]
    assert result["changed"] == [True] and jits_numbers(result)


def test_a_training_loop_keeps_its_state_sharded_in_the_carry(quick):
    """fori_loop over three steps, compiled as one module: the signature cannot change,
    but inside the loop the optimizer state stays sharded across iterations."""
    result = quick["loop:adam"]
    assert result["changed"] == [True] and jits_numbers(result)
    assert any("stay sharded across iterations" in note for note in result["notes"])


def test_the_comparison_catches_a_wrong_rewrite(quick):
    """Mutant: blocks through collectives along a minor dimension of a laid-out module."""
    result = quick["mutant"]
    assert result["changed"] == [True] and result["params"] > 1e-3


#: The relative difference below which any two runs count as equal: a few ulps of a
#: float32 loss (rounding quantizes it), far below what a wrong rewrite makes.
ULPS = 1e-6


@pytest.mark.slow
def test_models_optimizers_and_shard_map_over_50_steps():
    """The MLP, a transformer block and a conv net × adam, adamw + clipping, lion, lamb,
    adafactor, and a shard_map step: 50 steps with the hook = 50 without, up to rounding.
    Not bitwise on every host: XLA vectorizes a shard's arithmetic as its vector width
    allows, so sums may round in another order; the hooked run must stay within what the
    plain run makes of weights one ulp away over the same 50 steps (its envelope)."""
    names = [f"{model}:{opt}" for model in ("jit", "block", "conv")
             for opt in ("adam", "adamw_clip", "lion", "lamb", "adafactor")] + \
        ["shard_map:adam", "loop:adam"]
    results = run_scenarios(4, 50, *names, envelope=True)
    for name in names:
        result = results[name]
        assert result["changed"] == [True], (name, result["reasons"])
        assert result["sharded_bytes"] == result["gradient_bytes"] - 4, name  # all but loss
        for measure in ("loss", "params"):
            bound = max(result[f"envelope_{measure}"], ULPS)
            assert result[measure] <= bound, (name, measure, result[measure], bound)


def test_install_rejects_what_the_hook_cannot_do():
    from hlo_shard.errors import HloShardError
    from hlo_shard.jax import install, installed

    with pytest.raises(HloShardError, match="gathered"):
        install(state="sharded")
    with pytest.raises(HloShardError, match="strategy"):
        install(strategy="fastest")
    with pytest.raises(HloShardError):
        install(profile="no-such-profile")
    with pytest.raises(HloShardError, match="regular expression"):
        install(only="(")
    with pytest.raises(HloShardError, match="min_shard_bytes=-1 must be at least 0"):
        install(min_shard_bytes=-1)  # as the CLI refuses --min-shard-bytes -1
    with pytest.raises(HloShardError, match="accumulator"):
        install(accumulator="always")
    assert not installed()


def test_main_runs_a_script_with_the_hook(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys, hlo_shard.jax as h\nprint(h.installed(), sys.argv[1:])\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for switch, expected in (("1", "True ['--lr', '3']"), ("0", "False ['--lr', '3']")):
        run = subprocess.run([sys.executable, "-m", "hlo_shard.jax", str(script), "--lr", "3"],
                             env=dict(env, HLO_SHARD=switch), capture_output=True, text=True, check=False)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == expected
    run = subprocess.run([sys.executable, "-m", "hlo_shard.jax", str(tmp_path / "none.py")],
                         env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "no such script" in run.stderr
    said = tmp_path / "said.py"
    said.write_text("from hlo_shard.jax import hook\n"
                    "print(hook._HOOK.settings.options.overrides.pmap_replicated)\n")
    for switch, expected in (("1", "True"), (None, "False")):
        run = subprocess.run([sys.executable, "-m", "hlo_shard.jax", str(said)],
                             env={**env, **({"HLO_SHARD_PMAP_REPLICATED": switch} if switch else {})},
                             capture_output=True, text=True, check=False)
        assert run.returncode == 0 and run.stdout.strip() == expected, run.stderr


def test_the_runner_runs_a_script_as_python_does(tmp_path):
    """``__file__`` absolute (a script that changes directory still finds itself), the
    script's exception shown from its own frame with exit status 1, and the hook's lines
    once though the script configures logging itself."""
    script = tmp_path / "train.py"
    script.write_text("import logging, os\n"
                      "logging.basicConfig(level=logging.INFO)\n"
                      "os.chdir('/')\n"
                      "print(open(__file__).readline().strip())\n"
                      "logging.getLogger('hlo_shard').info('hlo_shard: probe')\n"
                      "raise ValueError('boom')\n")
    run = subprocess.run([sys.executable, "-m", "hlo_shard.jax", script.name], cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True, check=False, timeout=300)
    assert run.returncode == 1 and run.stdout.strip() == "import logging, os"
    assert run.stderr.count("probe") == 1, run.stderr
    frames = [line for line in run.stderr.splitlines() if line.startswith("  File ")]
    assert frames == [f'  File "{script}", line 6, in <module>'], run.stderr
    assert run.stderr.rstrip().endswith("ValueError: boom")


DISTRIBUTED_SCRIPT = '''
import socket, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax._src import xla_bridge
import hlo_shard.jax as hsj
from hlo_shard.jax import hook
started_before = xla_bridge.backends_are_initialized()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=1,
                           process_id=0)
mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
w = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P()))
x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("d")))
step = jax.jit(lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w))
step(w, x).block_until_ready()
made = [d for d in hsj.decisions() if d.module.startswith("jit_")]
print(started_before, bool(made), hook._HOOK.settings.platform_pending,
      hook._HOOK.settings.options.profile.name)
'''


def test_the_runner_installs_before_the_script_initializes_jax_distributed(tmp_path):
    """``python -m hlo_shard.jax train.py`` installs the hook before the script runs, and
    a multi-process script calls ``jax.distributed.initialize()`` first thing, which jax
    refuses once its backend has started: install() must not start it (the platform and
    the devices' profile are read at the first module the hook sees)."""
    script = tmp_path / "train.py"
    script.write_text(DISTRIBUTED_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    run = subprocess.run([sys.executable, "-m", "hlo_shard.jax", str(script)], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1].split() == ["False", "True", "False", "cpu-local"], \
        run.stdout
