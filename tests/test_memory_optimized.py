"""Peak memory of XLA's optimized fixtures against XLA's own buffer assignment.

XLA will not compile its optimized CPU dumps again, so `fixtures/optimized/*.hlo` cannot
be measured through the runtime like the other forms (`test_cost_xla.py`). Each one is
XLA's output for a jitted step of `scripts/fixture_models.py`, and
`scripts/fixture_memory.py` records `compiled.memory_analysis()` of that step in
`MANIFEST.json` (checking that the recompiled module is the fixture, metadata aside).
The check against those committed figures needs no compile and runs in `make test`;
re-measuring them is slow.

Compared: ``argument + output + temp − alias`` (what ``peak_bytes`` models), on the
module as dumped: scheduled, fused, donated (``input_output_alias``), partition form.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hlo_shard.costmodel.memory import memory_profile
from hlo_shard.ir import shape_leaves
from hlo_shard.parser import parse

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text()) if FIXTURES.is_dir() else {}
OPTIMIZED = sorted(name for name, entry in MANIFEST.items() if entry["form"] == "optimized")

MEMORY_TOLERANCE = 0.25

pytestmark = pytest.mark.skipif(not OPTIMIZED, reason="no fixtures/ (make fixtures)")


def _module(name: str):
    return parse((FIXTURES / name).read_text(), path=str(FIXTURES / name))


def _xla_peak(memory: dict) -> int:
    return memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]


def _entry_signature(name: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(leaf.element_type, leaf.dims) for p in _module(name).entry.parameters()
            for _, leaf in shape_leaves(p.shape)]


@pytest.mark.parametrize("name", OPTIMIZED)
def test_optimized_fixture_is_the_compiled_spmd_step(name):
    """The dump compiles the same per-device step as `spmd/<model>.n4.hlo`: same entry
    signature (the manifest's), same partition count, donation as the model declares."""
    entry = MANIFEST[name]
    source = name.replace("optimized/", "spmd/")
    assert MANIFEST[source]["model"] == entry["model"]
    signature = _entry_signature(name)
    assert signature == _entry_signature(source)
    assert [dims for _, dims in signature] == [tuple(p["shape"]) for p in entry["parameters"]]
    module = _module(name)
    assert module.is_scheduled
    assert ("input_output_alias" in module.header) == entry["donated"]
    assert set(entry["memory"]) >= {"argument", "output", "alias", "temp"}


@pytest.mark.parametrize("name", OPTIMIZED)
def test_peak_memory_matches_xla_buffer_assignment(name):
    xla = MANIFEST[name]["memory"]
    ours = memory_profile(_module(name), upcast_16bit_floats=True)
    assert (ours.argument_bytes, ours.output_bytes, ours.alias_bytes) == (
        xla["argument"], xla["output"], xla["alias"])
    error = ours.peak_bytes / _xla_peak(xla) - 1
    assert abs(error) <= MEMORY_TOLERANCE, (
        f"ours {ours.peak_bytes} (temp {ours.temp_bytes}) vs XLA {_xla_peak(xla)} "
        f"(temp {xla['temp']}): {error:+.1%}")


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZED)
def test_recorded_figures_are_xlas(name):
    """Recompiling the step reproduces the fixture and the recorded figures."""
    sys.path.insert(0, str(REPO / "scripts"))
    from fixture_memory import measure, program_text

    entry = MANIFEST[name]
    memory, optimized = measure(entry["model"], entry["num_devices"])
    assert program_text(optimized) == program_text((FIXTURES / name).read_text())
    assert memory == entry["memory"]
