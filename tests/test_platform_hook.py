"""``install()`` per platform: the stage it registers at, the warning where the hook has
not been seen to run, and the module XLA GPU hands over at PRE_SCHEDULER (the
partitioner's form: plain all-reduces, loops intact, GPU custom calls of the step itself,
no header device counts after the proto) going through the pass."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from hlo_shard.jax import hook
from hlo_shard.parser import parse
from hlo_shard import optimize
from hlo_shard.passes.weight_update import ShardingOptions

ROOT = Path(__file__).resolve().parents[1]
LOOP_ADAM = ROOT / "fixtures" / "spmd" / "loop_adam.n2.hlo"
#: A custom call jax emits for the GPU itself before XLA's GEMM rewriting (its threefry
#: kernel), in the entry: the pass must leave it, and decide as without it.
GPU_CUSTOM_CALL = (
    '  %rng_key = u32[4]{0} constant({0, 1, 2, 3})\n'
    '  %cu_threefry2x32.1 = (u32[4]{0}, u32[4]{0}) custom-call(%rng_key, %rng_key, %rng_key, '
    '%rng_key), custom_call_target="cu_threefry2x32", '
    'api_version=API_VERSION_STATUS_RETURNING\n')


def gpu_pre_scheduler_form(text: str) -> str:
    """The partitioner's module as XLA GPU's hook prints it: no ``num_partitions`` in the
    header (the proto's text has none), a GPU custom call among the step's instructions."""
    text = re.sub(r", num_partitions=\d+", "", text, count=1)
    entry = text.index("\nENTRY ")
    body = text.index("{\n", entry) + 2
    return text[:body] + GPU_CUSTOM_CALL + text[body:]


def test_every_platform_runs_the_pass_at_pre_scheduler():
    assert {name: h.stage for name, h in hook.PLATFORM_HOOKS.items()} == {
        "cpu": "PRE_SCHEDULER", "gpu": "PRE_SCHEDULER", "tpu": "PRE_SCHEDULER"}
    assert hook.OTHER_PLATFORM.stage == "PRE_SCHEDULER"


def test_cpu_with_the_jaxlib_it_ran_on_gives_no_warning():
    assert hook.platform_hook("cpu", "0.10.2")[1] == ""


@pytest.mark.parametrize("jaxlib", ["0.11.2", "0.11.3", "0.12.0", "0.11.2.dev20261201"])
def test_gpu_with_the_jaxlib_it_was_seen_running_with_or_newer_gives_no_warning(jaxlib):
    assert hook.platform_hook("gpu", jaxlib)[1] == ""


def test_gpu_with_an_older_jaxlib_says_which_one_ran_it():
    warning = hook.platform_hook("gpu", "0.11.1")[1]
    assert "not been run on gpu with jaxlib 0.11.1" in warning
    assert "seen running with jaxlib 0.11.2" in warning


@pytest.mark.parametrize("platform, says", [
    ("gpu", "openxla/xla PR #43630"), ("tpu", "libtpu"), ("METAL", "no XLA backend but")])
def test_an_untested_platform_gets_one_clear_warning(platform, says):
    stage, warning = hook.platform_hook(platform, "0.10.2")
    assert stage.stage == "PRE_SCHEDULER"
    assert f"not been run on {platform} with jaxlib 0.10.2" in warning and says in warning
    assert "decisions()" in warning and "\n" not in warning


def test_install_on_cpu_registers_at_pre_scheduler_without_a_platform_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", hook.PlatformWarning)
        with hook.install(force=True):
            assert hook._HOOK.registered == "PRE_SCHEDULER"
    assert hook._HOOK.registered is None and not hook.installed()


def test_the_gpu_pre_scheduler_form_shards_as_the_partitioners_module():
    plain = LOOP_ADAM.read_text()
    gpu = gpu_pre_scheduler_form(plain)
    options = ShardingOptions(state="gathered")
    result = optimize(parse(plain), options, force=True)
    plain_report, _ = result.report, result.text
    result = optimize(parse(gpu), options, force=True)
    gpu_report, gpu_text = result.report, result.text
    sharded = [(e.all_reduce, e.index) for e in gpu_report.explanations if e.sharded]
    assert sharded and sharded == [(e.all_reduce, e.index)
                                   for e in plain_report.explanations if e.sharded]
    assert 'custom_call_target="cu_threefry2x32"' in gpu_text
    assert "num_partitions=2" in gpu_text  # recovered from the collectives' groups
    assert "reduce-scatter(" in gpu_text and "while(" in gpu_text


def test_the_hook_shards_the_gpu_form_through_xlas_own_text():
    """The hook's path: XLA parses the module (as it hands the proto over), prints it,
    and the pass's result is accepted back by XLA's parser."""
    xc = hook._xla_client()
    hlo = xc.hlo.hlo_module_from_text(gpu_pre_scheduler_form(LOOP_ADAM.read_text()))
    sharded = hook._shard(hook._module_text(hlo), hlo.name,
                          ShardingOptions(state="gathered"), force=True)
    text, report = sharded.text, sharded.report
    assert text is not None, sharded.reason
    assert report is not None and any(e.sharded for e in report.explanations)
    # (XLA's text prints no device counts: read from the groups, as the agreement needs)
    assert sharded.devices == report.devices
    assert "cu_threefry2x32" in xc.hlo.hlo_module_from_text(text).to_string()


def test_the_hook_keeps_a_bounded_record_of_its_decisions():
    """A process that compiles without end (a server, a sweep) must not grow the record
    without bound: the latest MAX_DECISIONS are kept, oldest first."""
    hook.decisions(clear=True)
    try:
        for i in range(hook.MAX_DECISIONS + 5):
            hook._HOOK.record(hook.Decision(f"m{i}", False, "kept", None, 0.0))
        kept = hook.decisions()
        assert len(kept) == hook.MAX_DECISIONS
        assert kept[0].module == "m5" and kept[-1].module == f"m{hook.MAX_DECISIONS + 4}"
    finally:
        hook.decisions(clear=True)
    assert hook.decisions() == []


def test_the_hook_passes_a_module_it_has_seen_once():
    """XLA compiles the same module again (jax's caches cleared, AOT next to jit): its
    bytes differ (a new module id), its text does not; the pass runs once per module and
    installation, the remembered outcome is bounded, and another installation's settings
    start afresh."""
    xc = hook._xla_client()
    text = LOOP_ADAM.read_text()
    first, again = (xc.hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()
                    for _ in range(2))
    assert first != again
    settings = hook._Settings(ShardingOptions(state="gathered"), None, force=True)
    passes = []
    original = hook._shard

    def counted(*args, **kwargs):
        passes.append(args[1])
        return original(*args, **kwargs)

    hook._shard = counted
    try:
        outcomes = [hook._HOOK.outcome(data, settings) for data in (first, again, first)]
        assert [reused for _, reused in outcomes] == [False, True, True]
        assert len(passes) == 1 and outcomes[0][0].result is not None
        assert all(outcome is outcomes[0][0] for outcome, _ in outcomes)
        other = hook._Settings(ShardingOptions(state="gathered"), None, force=True)
        assert hook._HOOK.outcome(again, other)[1] is False and len(passes) == 2
        for i in range(hook.MAX_REMEMBERED + 3):
            hook._HOOK.remember(bytes([i]), outcomes[0][0])
        assert len(hook._HOOK.outcomes) == hook.MAX_REMEMBERED
    finally:
        hook._shard = original
        hook._HOOK.outcomes.clear()


def test_the_hooks_outcome_splits_its_seconds_into_read_pass_and_write():
    """The hook's share of XLA's compile, by stage: XLA's proto to text and our parse,
    the optimizer with its output check, the sharded text back through XLA's parser."""
    xc = hook._xla_client()
    data = xc.hlo.hlo_module_from_text(LOOP_ADAM.read_text()).as_serialized_hlo_module_proto()
    settings = hook._Settings(ShardingOptions(state="gathered"), None, force=True)
    try:
        outcome, reused = hook._HOOK.outcome(data, settings)
    finally:
        hook._HOOK.outcomes.clear()
    assert not reused and outcome.result is not None
    split = outcome.seconds
    assert split is not None and split.read > 0 and split.pass_ > 0 and split.write > 0
    assert set(split.to_json()) == {"read", "pass", "write"}
