"""The cost model against XLA itself, on every fixture, through the runtime.

* flops, transcendentals and bytes accessed within ±10% of ``hlo_module_cost_analysis``
  (the runtime reports it with each compile) — in practice they are equal: the rules
  are XLA's;
* per-device memory (``peak_bytes``: arguments + outputs + temporaries − donated
  outputs) within ±25% of XLA's ``CompiledMemoryStats`` on the CPU backend.

The runtime compiles without donation (it strips ``input_output_alias`` so inputs can
be reused), so the estimate is taken on the module without it too. XLA's cost analysis
needs no compile and covers every fixture; XLA will not compile its own optimized dumps
again, so their memory is checked against the figures recorded when XLA made them
(``test_memory_optimized.py``).

XLA's figures here price collectives by its own convention (an all-reduce costs one
flop per element and its operand and result bytes; reduce-scatter and all-gather only
their bytes) — network traffic is not part of them and is not compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlo_shard.costmodel.flops import CostAnalysis
from hlo_shard.costmodel.memory import memory_profile
from hlo_shard.errors import HloRuntimeError
from hlo_shard.parser import parse

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FORMS = ("spmd", "replica", "optimized")
FILES = sorted(str(p.relative_to(FIXTURES)) for form in FORMS
               for p in (FIXTURES / form).glob("*.hlo")) if FIXTURES.is_dir() else []

COST_TOLERANCE = 0.10
MEMORY_TOLERANCE = 0.25

pytestmark = [pytest.mark.skipif(not FILES, reason="no fixtures/ (make fixtures)"),
              pytest.mark.slow]  # one XLA compile per fixture: minutes on two cores


def _relative(ours: float, xla: float) -> float:
    return abs(ours - xla) / xla if xla else abs(ours)


@pytest.fixture(scope="module")
def xla_runtime():
    """The runtime, its worker processes shut down after this file's tests."""
    from hlo_shard import runtime

    yield runtime
    runtime.shutdown_workers()


@pytest.fixture(scope="module")
def compiled(xla_runtime):
    """Fixture path → (module without donation, XLA executable), compiled lazily."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            module = parse((FIXTURES / name).read_text(), path=str(FIXTURES / name))
            for attribute in ("input_output_alias", "buffer_donor"):
                module.header.pop(attribute, None)
            try:
                cache[name] = (module, xla_runtime.load(module))
            except HloRuntimeError as err:
                cache[name] = (module, err)
        return cache[name]

    return get


@pytest.mark.parametrize("name", FILES)
def test_flops_and_bytes_match_xla(xla_runtime, name):
    module = parse((FIXTURES / name).read_text(), path=str(FIXTURES / name))
    ours = CostAnalysis(module).module_cost()
    xla = xla_runtime.module_cost(module)  # hlo_module_cost_analysis, as written: no compile
    assert _relative(ours.flops, xla.get("flops", 0.0)) <= COST_TOLERANCE
    assert _relative(ours.transcendentals, xla.get("transcendentals", 0.0)) <= COST_TOLERANCE
    assert _relative(ours.bytes_accessed, xla.get("bytes accessed", 0.0)) <= COST_TOLERANCE


@pytest.mark.parametrize("name", FILES)
def test_memory_matches_xla(compiled, name):
    if name.startswith("optimized/"):
        pytest.skip("XLA cannot compile its optimized dumps again (executing-hlo-with-jax.md "
                    "7.7): test_memory_optimized.py checks the figures recorded at dump time")
    module, executable = compiled(name)
    if isinstance(executable, HloRuntimeError):
        raise executable
    stats = executable.memory
    xla = stats.argument + stats.output + stats.temp - stats.alias
    ours = memory_profile(module, upcast_16bit_floats=True)  # XLA CPU computes bf16 in f32
    assert ours.argument_bytes == stats.argument
    assert _relative(ours.peak_bytes, xla) <= MEMORY_TOLERANCE, (
        f"ours {ours.peak_bytes} (temp {ours.temp_bytes}) vs XLA {xla} (temp {stats.temp})")


def test_manifest_roles_become_parameter_kinds():
    from hlo_shard.passes.weight_update import planned_update_regions
    from hlo_shard.cli.report import manifest_roles
    from hlo_shard.costmodel.step_time import estimate_step
    from hlo_shard.profiles import load_profile

    manifest = json.loads((FIXTURES / "MANIFEST.json").read_text())
    name = next(n for n, entry in manifest.items() if entry.get("optimizer_state_params"))
    module = parse((FIXTURES / name).read_text(), path=str(FIXTURES / name))
    (roles,) = manifest_roles(str(FIXTURES / "MANIFEST.json"), [str(FIXTURES / name)])
    kinds = estimate_step(module, load_profile("cpu-generic"), planned_update_regions(module),
                          roles=roles).parameter_kinds
    params = {p.parameter_number: p.name for p in module.entry.parameters()}
    for index in manifest[name]["optimizer_state_params"]:
        assert kinds[params[index]] == "optimizer_state"
    for index in manifest[name]["weight_params"]:
        assert kinds[params[index]] == "weights"
