"""``scripts/device_check.sh``, the prepared accelerator check: the fixtures it verifies
on a machine's devices, the report it writes from whatever its steps left, and (slow) the
whole script on this machine's CPU (``--backend cpu --quick``), as a GPU run goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import device_check  # noqa: E402

from hlo_shard.profiles import profile_json  # noqa: E402
from hlo_shard.runtime import calibrate  # noqa: E402


def test_one_gpu_fits_no_fixture_and_n_devices_fit_those_of_n_replicas_or_fewer():
    assert device_check.fitting_fixtures(1, quick=False) == []
    eight = device_check.fitting_fixtures(8, quick=False)
    counts = {int(device_check.FIXTURE.search(p.name).group(1)) for p in eight}
    assert counts == {2, 4, 8}
    assert {int(device_check.FIXTURE.search(p.name).group(1))
            for p in device_check.fitting_fixtures(4, quick=False)} == {2, 4}
    assert [p.name for p in device_check.fitting_fixtures(2, quick=True)] == [
        "adam.n2.hlo", "sgd.n2.hlo"]


def test_the_report_says_what_each_step_left_on_one_gpu(tmp_path):
    """One H200: no fixture fits, a jax row failed, the hook ignored, a GPU profile
    measured: each is a line of the report, the profile next to the published one."""
    (tmp_path / "verify").mkdir()
    (tmp_path / "verify" / "NOTE").write_text("No fixture fits 1 gpu device(s): ...")
    (tmp_path / "notes.txt").write_text("1 gpu device(s), 40 s in\n")
    (tmp_path / "environment.json").write_text(json.dumps(
        {"jax": "0.10.2", "jaxlib": "0.10.2", "gpus": ["GPU 0: NVIDIA H200 (UUID: x)"]}))
    (tmp_path / "jax.json").write_text(json.dumps({
        "platform": "gpu", "devices": 1, "device_kind": "NVIDIA H200", "jax": "0.10.2",
        "jaxlib": "0.10.2",
        "hook_probe": {"platform": "gpu", "stages": {"PRE_SCHEDULER": 0, "POST_SCHEDULER": 0},
                       "runs": False},
        "rows": [{"model": "mlp", "optimizer": "adam",
                  "train": {"error": "XlaRuntimeError: out of memory"}}]}))
    sizes = calibrate.GPU_SIZES
    times = {"overhead": 1e-5, "stream": 1e-4 + 3 * 4 * sizes.stream / 4e12,
             "stream_large": 1e-4 + 3 * 4 * sizes.stream_large / 4e12,
             "write": 1e-4 + 4 * sizes.stream / 3e12,
             "write_large": 1e-4 + 4 * sizes.stream_large / 3e12,
             "matrix_f32": 1e-5 + 2 * calibrate.GPU_SIZES.dot ** 3 / 400e12,
             "matrix_bf16": 1e-5 + 2 * calibrate.GPU_SIZES.dot ** 3 / 800e12}
    base, _ = profile_json("h200")
    (tmp_path / "profile.json").write_text(json.dumps(
        calibrate.gpu_profile_from_measurements(1, times, base)))
    text = device_check.report("gpu", tmp_path).read_text()
    assert "1 x NVIDIA H200" in text and "GPU 0: NVIDIA H200" in text
    assert "**is ignored** here" in text
    assert "No fixture fits 1 gpu device(s)" in text
    assert "| mlp + adam | train API | failed: XlaRuntimeError: out of memory |" in text
    assert "| rate | measured | h200 profile | measured / profile |" in text
    assert "| memory read bandwidth | 4000 GB/s | 4800 GB/s | 0.83 |" in text
    assert "| bf16 dot | 800 TFLOP/s | 989 TFLOP/s | 0.81 |" in text


def test_the_script_refuses_an_unknown_backend_in_one_line(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--backend",
                             "tpu", "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "--backend cpu or gpu" in result.stderr


@pytest.mark.slow
def test_the_whole_check_runs_on_cpu(tmp_path):
    """What a GPU run does, on 2 XLA CPU devices: two fixtures verified, the hook probed,
    both models through the train API and install() against jit, calibrate, the report."""
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    result = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--backend",
                             "cpu", "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (tmp_path / "report.md").read_text()
    assert "| adam.n2 | exit 0 | MATCH" in text and "| sgd.n2 | exit 0 | MATCH" in text
    assert "the hook **runs** here" in text
    for model in ("mlp + adam", "ln_mlp + adamw_clip"):
        assert f"| {model} | shard_weight_update, gathered |" in text
        assert f"| {model} | shard_weight_update, sharded |" in text
        assert f"| {model} | install() |" in text
    assert "| memory read bandwidth |" in text and "cpu-local profile" in text
    assert "failed" not in text and "exit 124" not in text
