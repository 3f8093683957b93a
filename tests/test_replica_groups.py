"""Replica groups in XLA's three forms, against XLA itself.

* Every form of ``tests/golden/replica_groups_mesh.hlo`` (mesh axes with sub-axes and
  ``device_ids``, the two-level iota groups of data x model meshes) expands to the groups
  XLA's own parser gives it (printed with ``HloPrintOptions.fingerprint()``, which lists
  the groups in full); the golden case itself checks that it prints back as read and
  that XLA reads our print as the same module (``test_printer``, ``test_roundtrip``).
* Mesh forms XLA refuses (most by aborting the process) are refused at parse.
* Text for XLA to compile (``to_text(..., for_xla=True)``) prints mesh groups as explicit
  groups where jax's compile path would misread them, and XLA then runs the groups we read.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hlo_shard import HloParseError, parse, to_text
from hlo_shard.ir import ReplicaGroups
from hlo_shard.printer import mesh_forms_compile

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "replica_groups_mesh.hlo"

ADD = "add {\n  x = f32[] parameter(0)\n  y = f32[] parameter(1)\n  ROOT r = f32[] add(x, y)\n}\n"


def chain(groups: list[str], devices: int = 8) -> str:
    """A module of all-reduces, one after another, over each of ``groups``."""
    lines, previous = [], "p"
    for i, form in enumerate(groups):
        root = "ROOT " if i == len(groups) - 1 else ""
        lines.append(f"  {root}x{i} = f32[16]{{0}} all-reduce({previous}), channel_id={i + 1}, "
                     f"replica_groups={form}, use_global_device_ids=true, to_apply=add")
        previous = f"x{i}"
    return (f"HloModule m, num_partitions={devices}\n\n{ADD}\nENTRY e {{\n"
            "  p = f32[16]{0} parameter(0)\n" + "\n".join(lines) + "\n}\n")


def golden_forms() -> list[str]:
    return re.findall(r"replica_groups=(.*?), use_global_device_ids", GOLDEN.read_text())


def groups_of(text: str) -> list[tuple[tuple[int, ...], ...]]:
    module = parse(text)
    return [inst.attributes["replica_groups"].groups for inst in module.entry.instructions
            if isinstance(inst.attributes.get("replica_groups"), ReplicaGroups)]


_XLA_GROUPS = r"""
import json, re, sys
from jax._src.lib import xla_client as xc
text = sys.stdin.read()
printed = xc.hlo.hlo_module_from_text(text).to_string(xc.hlo.HloPrintOptions.fingerprint())
print(json.dumps([[[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", groups)]
                  for groups in re.findall(r"replica_groups=(\{[\d,{}]*\})", printed)]))
"""


def test_every_golden_form_expands_to_xla_own_groups():
    """XLA parses our print of the golden case and gives each collective our groups."""
    text = to_text(parse(GOLDEN.read_text()))
    run = subprocess.run([sys.executable, "-c", _XLA_GROUPS], input=text, text=True,
                         capture_output=True, timeout=300, check=True)
    xla = [tuple(map(tuple, groups)) for groups in json.loads(run.stdout)]
    ours = groups_of(GOLDEN.read_text())
    assert len(ours) == len(golden_forms()) == len(xla)
    assert ours == xla


@pytest.mark.parametrize("form, groups", [
    ("[2,64]<=[128]", (tuple(range(64)), tuple(range(64, 128)))),
    ("[64,2]<=[2,64]T(1,0)", tuple((i, i + 64) for i in range(64))),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("mesh['axis_0'=1,'axis_1'=8,'axis_2'=1] {'axis_1'}", (tuple(range(8)),)),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
     ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=(0,2,4,6,1,3,5,7) {'axis_1'}",
     ((0, 2), (4, 6), (1, 3), (5, 7))),
    ("mesh['a'=2,'b'=4] {'1'}", ((0, 1, 2, 3), (4, 5, 6, 7))),  # an axis by its index
    ("mesh['x'=8] {'x':(2)4}", ((0, 1, 2, 3), (4, 5, 6, 7))),
])
def test_groups_and_text_as_read(form, groups):
    """Two-level iota groups of a 128-device data x model mesh and mesh forms (values
    as XLA's parser expands them, checked above and with jaxlib 0.10.2)."""
    (read,) = groups_of(chain([form], 128))
    assert read == groups
    assert f"replica_groups={form}," in to_text(parse(chain([form], 128)))


#: Mesh forms XLA refuses: (form, our words). XLA's verdict on each is in
#: test_xla_refuses_the_same_mesh_forms (aborting the process, for most).
MESH_REFUSALS = [
    ("mesh['a'=1,'b'=8] {'a'}", "more than one device"),
    ("mesh['a'=2,'b'=4] {}", "more than one device"),
    ("mesh['a'=2,'b'=4], device_ids=(0,1,2,3,4,5,6,7) {'a'}", "iota order must be left out"),
    ("mesh['a'=2,'b'=4], device_ids=(0,1,2,3,4,5,6,6) {'a'}", "a permutation"),
    ("mesh['a'=2,'b'=4], device_ids=(0,-1,2,3,4,5,6,7) {'a'}", "a permutation"),
    ("mesh['a'=2,'b'=4], device_ids=(0,1,2) {'a'}", "expected 8 device_ids"),
    ("mesh['a'=2,'b'=4], device_ids=([8]T(0)) {'a'}", "T(perm)"),
    ("mesh['a'=2,'b'=4], device_ids=([2,4]) {'a'}", "T(perm)"),
    ("mesh['a'=2,'a'=4] {'a'}", "duplicate axis names"),
    ("mesh['a'=-2,'b'=-4] {'b'}", "must be positive"),
    ("mesh['a'=2,'b'=4] {'c'}", "not a name or index"),
    ("mesh['a'=2,'b'=4] {'5'}", "not a name or index"),
    ("mesh['a'=2,'b'=4] {'a','a'}", "overlap"),
    ("mesh['a'=2,'b'=4] {'b':(2)2,'b'}", "overlap"),
    ("mesh['x'=16] {'x':(1)4,'x':(2)2}", "overlap"),
    ("mesh['a'=2,'b'=4] {'b':(1)3}", "does not fit"),
    ("mesh['a'=2,'b'=4] {'b':(1)4}", "does not fit"),
    ("mesh['a'=2,'b'=4] {'b':(1)1}", "size > 1"),
    ("mesh['x'=8] {'x':(1)2,'x':(2)2}", "can be merged"),
    ("mesh['a'=2,'b'=4,] {'a'}", "after the last ','"),
    ("mesh['a'=2,'b'=4] {'a',}", "after the last ','"),
]


@pytest.mark.parametrize("form, words", MESH_REFUSALS)
def test_mesh_forms_xla_refuses_are_refused_at_their_place(form, words):
    text = chain([form])
    with pytest.raises(HloParseError) as caught:
        parse(text)
    assert words in caught.value.message
    assert (caught.value.line, caught.value.column) == (
        text[:text.index(form)].count("\n") + 1,
        text.index(form) - text.rindex("\n", 0, text.index(form)))


@pytest.mark.slow
def test_xla_refuses_the_same_mesh_forms():
    from test_fuzz_xla import xla_parse

    verdicts = [verdict for form, _ in MESH_REFUSALS for verdict in xla_parse([chain([form])])]
    assert [v.status for v in verdicts if v.status not in ("error", "abort")] == []


# ------------------------------------------------------- mesh forms in text for XLA

MIXED = ["mesh['axis_0'=1,'axis_1'=8,'axis_2'=1] {'axis_1'}", "mesh['axis_0'=8] {'axis_0'}"]
ONE_MESH = ["mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", "mesh['axis_0'=4,'axis_1'=2] {'axis_1'}",
            "{{0,1,2,3},{4,5,6,7}}", "[4,2]<=[2,4]T(1,0)"]
PERMUTED = ["mesh['axis_0'=4,'axis_1'=2], device_ids=(0,2,4,6,1,3,5,7) {'axis_1'}"]
SAME_SHAPE_OTHER_SIZES = ["mesh['axis_0'=4,'axis_1'=2] {'axis_0'}",
                          "mesh['axis_0'=2,'axis_1'=4] {'axis_1'}"]


def test_for_xla_prints_explicit_groups_where_the_mesh_form_would_be_misread():
    for forms in (MIXED, PERMUTED, SAME_SHAPE_OTHER_SIZES):
        module = parse(chain(forms))
        assert not mesh_forms_compile(module)
        assert to_text(module) == to_text(parse(chain(forms)))  # as read by default
        assert all(f"replica_groups={form}," in to_text(module) for form in forms)
        text = to_text(module, for_xla=True)
        assert "mesh[" not in text
        assert groups_of(text) == groups_of(chain(forms))
    assert "replica_groups={{0,1,2,3,4,5,6,7}}," in to_text(parse(chain(MIXED)), for_xla=True)


def test_for_xla_prints_unquoted_mesh_axes_explicitly():
    """An older printer's form, which XLA's parser refuses ("expects string")."""
    module = parse(chain(["mesh[x=4,y=2] {x}"]))
    assert "mesh[x=4,y=2] {x}" in to_text(module)
    assert "replica_groups={{0,2,4,6},{1,3,5,7}}," in to_text(module, for_xla=True)


def test_for_xla_keeps_one_mesh_in_iota_order():
    module = parse(chain(ONE_MESH))
    assert mesh_forms_compile(module)
    assert to_text(module, for_xla=True) == to_text(module)


_RUN_ON_8 = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hlo_shard.jax._xla import compile_replica_text
devices = jax.devices()
values = np.array([[10.0 ** d if d < 4 else 3.0 ** d] * 16 for d in range(8)], np.float32)
results = []
for text in json.load(sys.stdin):
    executable = compile_replica_text(text, devices)
    x = jax.device_put(values.reshape(-1), NamedSharding(Mesh(np.array(devices), ("d",)), P("d")))
    out = executable.execute_sharded([x]).disassemble_into_single_device_arrays()[0]
    results.append([float(np.asarray(o)[0]) for o in out])
print(json.dumps(results))
"""


def _expected(text: str) -> list[float]:
    """Each device's first output element, from the groups we read."""
    values = [10.0 ** d if d < 4 else 3.0 ** d for d in range(8)]
    for groups in groups_of(text):
        values = [sum(values[e] for e in next(g for g in groups if d in g)) for d in range(8)]
    return values


def test_xla_runs_the_groups_we_read_from_text_for_xla():
    """On 8 CPU devices: mixed meshes (XLA's MLIR import says "Unknown axis axis_1" for
    the first, or silently binds the wrong mesh), a permuted mesh (its device_ids are
    dropped) and one mesh kept as is, each compiled from ``to_text(..., for_xla=True)``."""
    cases = [MIXED, list(reversed(MIXED)), SAME_SHAPE_OTHER_SIZES, PERMUTED, ONE_MESH]
    texts = [to_text(parse(chain(forms)), for_xla=True) for forms in cases]
    run = subprocess.run([sys.executable, "-c", _RUN_ON_8], input=json.dumps(texts), text=True,
                         capture_output=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == [pytest.approx(_expected(chain(forms)), rel=1e-6) for forms in cases]


def test_verify_runs_a_module_with_two_meshes(tmp_path):
    """The runtime compiles the text for XLA: before, "Unknown axis axis_1" (exit 2)."""
    path = tmp_path / "mixed.hlo"
    path.write_text(chain(MIXED))
    run = subprocess.run([sys.executable, "-m", "hlo_shard", "verify", str(path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "compiled and executed on 8 cpu devices" in run.stdout


@pytest.mark.parametrize("form", [
    "[1,100000000]<=[100000000]", "mesh['a'=100000,'b'=100000] {'a'}",
    "mesh['a'=2,'b'=2], device_ids=([100000,100000]T(1,0)) {'a'}",
])
def test_forms_of_more_devices_than_any_machine_are_refused_at_once(form):
    """Each is expanded to a list of all its devices: 25 characters took minutes and
    gigabytes (a hostile or mistaken module)."""
    with pytest.raises(HloParseError) as caught:
        parse(chain([form]))
    assert "devices" in caught.value.message
