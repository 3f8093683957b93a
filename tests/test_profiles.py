"""Hardware profiles: the shipped accelerator profiles say where each figure comes from,
and ``calibrate`` measures a profile on CPU and (the same probes, through jax's GPU
backend) on GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hlo_shard.profiles import available_profiles, load_profile, profile_from_dict, profile_json
from hlo_shard.runtime import calibrate

ACCELERATORS = ("a100", "h100", "h200", "tpu-v3", "tpu-v4", "tpu-v5e")
#: The fields of an accelerator profile a vendor publishes: each is named by a source.
PUBLISHED = ("matrix_flops_per_s", "memory_bandwidth_bytes_per_s", "interconnect")


def test_the_gpu_and_tpu_profiles_users_train_on_are_shipped():
    assert {"h100", "h200", "tpu-v4", "tpu-v5e"} <= set(available_profiles())


@pytest.mark.parametrize("name", ["h100", "h200", "tpu-v4", "tpu-v5e"])
def test_every_published_figure_names_its_source_and_assumptions_say_so(name):
    sources = load_profile(name).sources
    for field in PUBLISHED:
        assert any(field in line for line in sources), f"{name}: no source names {field}"
    assert any(line.startswith("assumed") for line in sources), f"{name}: assumptions unmarked"


@pytest.mark.parametrize("name", available_profiles())
def test_every_shipped_profile_loads(name):
    assert load_profile(name).name == name


def test_tpu_v5e_is_the_cloud_tpu_figures_per_chip():
    v5e = load_profile("tpu-v5e")
    assert v5e.matrix_rate("bf16") == 197e12 and v5e.memory_bandwidth_bytes_per_s == 819e9
    assert v5e.interconnect.algorithm == "torus2d" and v5e.interconnect.devices_per_node == 256
    # 51.2 TB/s all-reduce bandwidth over a 256-chip pod
    assert v5e.interconnect.intra_node.beta_bytes_per_s == 51.2e12 / 256


def test_memory_capacity_is_neither_needed_nor_refused():
    """Nothing prices a device's memory capacity, so a profile need not state it; one
    written before it was dropped (it names the field) still loads."""
    data, origin = profile_json("cpu-generic")
    assert "memory_capacity_bytes" not in data
    assert profile_from_dict(data, origin) == load_profile("cpu-generic")
    assert profile_from_dict({**data, "memory_capacity_bytes": 1 << 36}, origin) == \
        load_profile("cpu-generic")


# ------------------------------------------------------------------------- calibrate

def _measured(n: int) -> dict[str, float]:
    """Probe times as a GPU at ``n`` devices might measure them (seconds)."""
    sizes = calibrate.GPU_SIZES
    # a large step's fixed cost (0.1 ms) is ten times the tiny step's: the slope between
    # the two sizes still reads the bandwidths
    times = {"overhead": 10e-6, "stream": 100e-6 + 3 * 4 * sizes.stream / 4e12,
             "stream_large": 100e-6 + 3 * 4 * sizes.stream_large / 4e12,
             "write": 100e-6 + 4 * sizes.stream / 3e12,
             "write_large": 100e-6 + 4 * sizes.stream_large / 3e12,
             "matrix_f32": 10e-6 + 2 * calibrate.GPU_SIZES.dot ** 3 / 400e12,
             "matrix_bf16": 10e-6 + 2 * calibrate.GPU_SIZES.dot ** 3 / 800e12}
    if n > 1:
        times |= {"small_all_reduce": 30e-6,
                  "all_reduce_chain": 30e-6 + (calibrate.ALL_REDUCE_CHAIN - 1) * 5e-6,
                  "large_all_reduce": 30e-6 + 2 * (n - 1) / n * 4 * calibrate.COLLECTIVE / 300e9}
    return times


@pytest.mark.parametrize("n", [1, 8])
def test_a_gpu_profile_is_measured_where_a_probe_separates_the_rate(n):
    base, _ = profile_json("h200")
    data = calibrate.gpu_profile_from_measurements(n, _measured(n), base)
    profile = profile_from_dict(json.loads(json.dumps(data)), "gpu-local")
    published = load_profile("h200")
    assert profile.memory_bandwidth_bytes_per_s == pytest.approx(4e12)
    assert profile.memory_write_bandwidth_bytes_per_s == pytest.approx(3e12)
    assert profile.matrix_rate("bf16") == pytest.approx(800e12)
    assert profile.matrix_rate("f32") == pytest.approx(400e12)
    assert profile.step_overhead_s == pytest.approx(10e-6)
    # what a GPU kernel hides behind its memory traffic stays the published figure
    assert profile.vector_flops_per_s == published.vector_flops_per_s
    assert profile.kernel_overhead_s == published.kernel_overhead_s
    assert profile.multi_output_fusion and profile.overlaps_compute_and_memory
    link = profile.interconnect.intra_node
    if n == 1:  # nothing to measure between devices: the published link, and said so
        assert link == published.interconnect.intra_node
        assert "one GPU has no interconnect to measure" in profile.sources[2]
    else:
        assert link.alpha_s == pytest.approx(5e-6) and link.beta_bytes_per_s == pytest.approx(300e9)
    assert profile.sources[3:] == published.sources


def test_the_gpu_base_is_the_profile_of_the_gpu_nvidia_smi_names():
    assert calibrate.gpu_base(["NVIDIA H200", "NVIDIA H200"]) == "h200"
    assert calibrate.gpu_base(["NVIDIA H100 80GB HBM3"]) == "h100"
    assert calibrate.gpu_base(["NVIDIA A100-SXM4-80GB"]) == "a100"
    assert calibrate.gpu_base([]) == "h100"


def _calibrate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hlo_shard.runtime.calibrate", *args],
                          capture_output=True, text=True, timeout=600)


def test_calibrate_backend_gpu_without_a_gpu_is_one_line_and_exit_2():
    result = _calibrate("--backend", "gpu", "--runs", "1", "--rounds", "1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "gpu" in result.stderr
    assert "Traceback" not in result.stderr and not result.stdout


@pytest.mark.parametrize("args, message", [
    (["--backend", "tpu"], "invalid choice"),
    (["--backend", "cpu", "--base", "h100"], "--base: only with --backend gpu"),
    (["--backend", "gpu", "--base", "no-such-gpu"], "unknown profile"),
    (["--devices", "0"], "at least 1"),
    (["--runs", "0"], "at least 1"),
])
def test_calibrate_refuses_bad_arguments(args, message):
    result = _calibrate(*args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_calibrate_cpu_still_measures_a_cpu_profile(tmp_path):
    out = tmp_path / "cpu.json"
    result = _calibrate("--backend", "cpu", "--devices", "2", "--runs", "1", "--rounds", "1",
                        "--output", str(out))
    assert result.returncode == 0, result.stderr
    profile = profile_from_dict(json.loads(out.read_text()), "cpu-local")
    assert profile.calibrated_devices == 2 and not profile.multi_output_fusion
    assert profile.interconnect.algorithm == "shared-memory"


@pytest.mark.slow
def test_the_gpu_probes_run_on_real_xla():
    """The GPU path end to end, on the CPU backend with a small dot: every probe it
    builds compiles and runs (bf16 inputs included), and the result is a valid profile."""
    data = calibrate.gpu_profile(2, "h100", runs=1, rounds=1, backend="cpu",
                                 sizes=calibrate.GpuSizes(dot=256, stream=1 << 16,
                                                         stream_large=1 << 18))
    profile = profile_from_dict(data, "gpu-local")
    assert profile.interconnect.intra_node.alpha_s >= 0
    assert set(calibrate._gpu_probes(2)) <= set(data["sources"][0].replace(",", "").split())


def test_one_combine_threshold_where_a_profile_does_not_say():
    from hlo_shard.profiles import DEFAULT_COMBINE_THRESHOLD_BYTES

    data, origin = profile_json("cpu-generic")
    assert isinstance(data, dict)
    del data["combine_threshold_bytes"]
    assert profile_from_dict(data, origin).combine_threshold_bytes == \
        DEFAULT_COMBINE_THRESHOLD_BYTES


@pytest.mark.parametrize("platform, kind, expected, noted", [
    ("gpu", "NVIDIA H200", "h200", False), ("gpu", "NVIDIA H100 80GB HBM3", "h100", False),
    ("gpu", "NVIDIA A100-SXM4-80GB", "a100", False), ("gpu", "NVIDIA L4", "h100", True),
    ("tpu", "TPU v4", "tpu-v4", False), ("tpu", "TPU v5 lite", "tpu-v5e", False),
    ("tpu", "TPU v3", "tpu-v3", False), ("tpu", "TPU v6 lite", "tpu-v4", True),
    ("cpu", "cpu", "cpu-local", False), ("METAL", "Apple M2", "cpu-local", False)])
def test_a_device_is_priced_on_its_own_published_profile(platform, kind, expected, noted):
    from hlo_shard.profiles.detect import profile_for_device

    name, note = profile_for_device(platform, kind)
    assert name == expected and (note is not None) == noted
    if noted:
        assert repr(kind) in note and expected in note and "\n" not in note


def test_every_device_profile_is_shipped():
    from hlo_shard.profiles import available_profiles
    from hlo_shard.profiles.detect import DEVICE_PROFILES, NEAREST_DEVICE_PROFILE

    named = {name for table in DEVICE_PROFILES.values() for _, name in table}
    assert named | set(NEAREST_DEVICE_PROFILE.values()) <= set(available_profiles())
