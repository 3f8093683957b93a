"""The committed fixtures are what the manifest says they are, and XLA itself reads them.

Parse-only (XLA's own parser), plus one compile + run of one replica fixture in a child
process (N forced CPU devices must be configured before jax starts).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
FORMS = ("spmd", "optimized", "replica")
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
FILES = sorted(str(p.relative_to(FIXTURES)) for form in FORMS
               for p in (FIXTURES / form).glob("*.hlo"))


def header(text: str) -> str:
    return text.split("\n", 1)[0]


def lines_with(text: str, opcode: str) -> list[str]:
    return [line for line in text.split("\n") if re.search(rf"\s{opcode}\(", line)]


def all_devices_group(line: str, n: int) -> bool:
    """The collective's replica groups are one group of all n devices (any spelling)."""
    explicit = "replica_groups={{" + ",".join(map(str, range(n))) + "}}"
    return (explicit in line or "replica_groups={}" in line
            or f"replica_groups=[1,{n}]<=[{n}]" in line
            or re.search(rf"replica_groups=mesh\['(\w+)'={n}(,'\w+'=1)*\] {{'\1'}}", line)
            is not None)


def test_manifest_lists_exactly_the_files():
    assert FILES, "no fixtures committed"
    assert sorted(MANIFEST) == FILES


def test_required_coverage():
    """Issue 2/4: every model at N = 2, 4, 8 in SPMD form and at N = 4 optimized."""
    models = {e["model"] for e in MANIFEST.values() if e["form"] == "optimized"}
    assert {"sgd", "momentum", "adam", "adamw", "lamb", "clip_adam", "bf16_mixed",
            "loop_adam", "ncf", "transformer"} <= models
    for model in models:
        for n in (2, 4, 8):
            assert f"spmd/{model}.n{n}.hlo" in MANIFEST
    assert {e["form"] for e in MANIFEST.values()} == set(FORMS)
    assert any("parameter_replication" in (FIXTURES / f).read_text()
               for f in FILES if f.startswith("replica/"))


@pytest.mark.parametrize("name", FILES)
def test_xla_parses_fixture_and_signature_matches_manifest(name):
    from jax._src.lib import xla_client as xc

    entry = MANIFEST[name]
    text = (FIXTURES / name).read_text()
    assert "{...}" not in text, "elided constant"
    module = xc.hlo.hlo_module_from_text(text)
    shape = xc.XlaComputation(module.as_serialized_hlo_module_proto()).program_shape()
    params = [list(s.dimensions()) for s in shape.parameter_shapes()]
    assert params == [p["shape"] for p in entry["parameters"]]
    roles = {p["role"] for p in entry["parameters"]}
    assert {"weight", "batch"} <= roles
    assert len(shape.result_shape().tuple_shapes()) == len(entry["outputs"])


@pytest.mark.parametrize("name", [f for f in FILES if not f.startswith("replica/")])
def test_spmd_fixture_all_reduces_over_all_devices(name):
    n = MANIFEST[name]["num_devices"]
    text = (FIXTURES / name).read_text()
    assert f"num_partitions={n}" in header(text) and "replica_count" not in header(text)
    reduces = lines_with(text, "all-reduce")
    assert reduces and any(all_devices_group(line, n) for line in reduces)


@pytest.mark.parametrize("name", [f for f in FILES if f.startswith("replica/")])
def test_replica_fixture_is_classic_form(name):
    entry = MANIFEST[name]
    n = entry["num_devices"]
    text = (FIXTURES / name).read_text()
    assert f"replica_count={n}" in header(text) and "num_partitions" not in header(text)
    assert "partition-id" not in text and "sharding={" not in text
    reduces = lines_with(text, "all-reduce")
    assert reduces and all(all_devices_group(line, n) for line in reduces)
    assert not any("channel_id" in line or "use_global_device_ids" in line for line in reduces)
    assert (FIXTURES / entry["derived_from"]).is_file()


def test_one_replica_fixture_compiles_and_runs():
    """replica/sgd.n4 against its SPMD source, both run on 4 CPU devices in a child."""
    scripts = REPO / "scripts"
    name = "replica/sgd.n4.hlo"
    entry = MANIFEST[name]
    signature = {"parameters": entry["parameters"], "outputs": entry["outputs"]}
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from replica_form import verify; "
            "problems = verify(open(sys.argv[2]).read(), open(sys.argv[3]).read(), "
            "json.loads(sys.argv[4]), 4); print(problems); sys.exit(bool(problems))")
    proc = subprocess.run([sys.executable, "-c", code, str(scripts), str(FIXTURES / name),
                           str(FIXTURES / entry["derived_from"]), json.dumps(signature)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
