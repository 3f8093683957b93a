"""Mutation testing of ``verify`` (issue 16): every semantic mutant of an optimized
fixture must be caught.

Mutants come from :mod:`hlo_shard.fuzz.mutants` (constants of the update region
scaled by 1 ± 1e-4, operands of non-commutative ops swapped, slices shifted by one,
padding lanes poisoned with 7 / NaN, a collective's replica groups changed). Each is
verified against the *original* module through the manifest, with the default options
(one step per input regime). A mutant is

* **killed** — verify says DIFFERENT (with the default seed, else with one of
  :data:`SEEDS`: "killed-reseeded", listed);
* **stillborn** — XLA refuses it (a shape no longer fits): no module to verify;
* **equivalent** — it survived, and it computes bit for bit what the unmutated
  candidate computes on every regime's inputs (so no verifier could tell them apart);
* **rounding** — it survived and differs from the unmutated candidate only within the
  tolerances a correct rewrite is allowed (2 ulp of the stored value, the dtype's
  update and value tolerances): e.g. a bf16 constant moved by its one ulp, which moves
  bf16 outputs by one ulp — what a flipped rounding does; listed;
* **a survivor** — anything else: a verifier miss, and the test fails naming it.

``make test`` runs a sample (the first and last mutant of each kind on Adam with
sharded state); ``make test-all`` every mutant of several optimized fixtures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from hlo_shard import runtime
from hlo_shard import optimize
from hlo_shard.cli.optimize import build_manifest
from hlo_shard.errors import HloRuntimeError, HloShardError
from hlo_shard.fuzz.mutants import KINDS, Mutant, mutants
from hlo_shard.parser import parse
from hlo_shard.passes.weight_update import ShardingOptions

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "spmd"
#: subject → (fixture, --state).
SUBJECTS = {
    "adam-sharded": ("adam.n4.hlo", "sharded"),
    "adam-gathered": ("adam.n4.hlo", "gathered"),
    "sgd-sharded": ("sgd.n4.hlo", "sharded"),
    "momentum-sharded": ("momentum.n4.hlo", "sharded"),
    "clip_adam-sharded": ("clip_adam.n4.hlo", "sharded"),
    "lamb-sharded": ("lamb.n4.hlo", "sharded"),
    "bf16_mixed-sharded": ("bf16_mixed.n4.hlo", "sharded"),
    "bf16_params-sharded": ("bf16_params.n4.hlo", "sharded"),
}
SAMPLE_SUBJECT = "adam-sharded"
#: Seeds a mutant is verified with before it counts as surviving: the default run's,
#: then others (an edit that shows only where one tensor dominates a global norm needs
#: inputs where it does; each such kill is listed).
SEEDS = (0, 1, 2, 3)
pytestmark = pytest.mark.skipif(not (FIXTURES / "adam.n4.hlo").exists(),
                                reason="fixtures not generated")


@dataclass(frozen=True)
class Subject:
    original: object
    candidate: str
    manifest: runtime.Manifest
    devices: int


_SUBJECTS: dict[str, Subject] = {}


def subject(name: str) -> Subject:
    if name not in _SUBJECTS:
        fixture, state = SUBJECTS[name]
        path = FIXTURES / fixture
        module = parse(path.read_text(), str(path))
        result = optimize(module, ShardingOptions(state=state), force=True)
        report, text = result.report, result.text
        assert any(r.sharded for r in report.explanations), name
        _SUBJECTS[name] = Subject(parse(path.read_text(), str(path)), text,
                                  build_manifest(report, module), module.device_count)
    return _SUBJECTS[name]


def classify(s: Subject, mutant: Mutant) -> tuple[str, str]:
    """(outcome, why) for one mutant, as in the module docstring."""
    for seed in SEEDS:
        try:
            report = runtime.verify(s.original, parse(mutant.text),
                                    runtime.VerifyOptions(manifest=s.manifest, seed=seed))
        except (HloRuntimeError, HloShardError) as err:
            return "stillborn", str(err).splitlines()[0][:160]
        if not report.ok:
            step, leaf = report.differing[0]
            return "killed" if seed == SEEDS[0] else "killed-reseeded", \
                f"output {leaf.index} {leaf.verdict} at step {step} ({report.regimes[step - 1]}" \
                f", --seed {seed})"
    twin = runtime.verify(parse(s.candidate), parse(mutant.text), runtime.VerifyOptions(
        devices=s.devices, rtol=0.0, atol=0.0))
    if twin.ok:
        return "equivalent", "bit-identical to the unmutated candidate on every regime"
    if runtime.verify(parse(s.candidate), parse(mutant.text),
                      runtime.VerifyOptions(devices=s.devices)).ok:
        step, leaf = twin.differing[0]
        return "rounding", (f"differs from the candidate only within the tolerances of a "
                            f"correct rewrite (output {leaf.index} {leaf.shape.element_type}, "
                            f"max abs {leaf.max_abs:.3g} at step {step})")
    step, leaf = twin.differing[0]
    return "survived", (f"differs from the candidate (output {leaf.index} {leaf.verdict}, "
                        f"max abs {leaf.max_abs:.3g} at step {step}) yet matches the original")


@pytest.fixture(scope="module", autouse=True)
def worker():
    yield runtime.get_worker("cpu", 4)
    runtime.shutdown_workers()


def _sample(all_mutants: list[Mutant]) -> list[Mutant]:
    chosen = []
    for kind in KINDS:
        of_kind = [m for m in all_mutants if m.kind == kind]
        chosen += of_kind[:1] + of_kind[-1:] if len(of_kind) > 1 else of_kind
    return chosen


def _check(name: str, chosen: list[Mutant]) -> dict[str, int]:
    s = subject(name)
    outcomes = {m.label: classify(s, m) for m in chosen}
    survivors = [f"{label}: {why}" for label, (outcome, why) in outcomes.items()
                 if outcome == "survived"]
    assert not survivors, f"{name}: {len(survivors)} semantic mutant(s) not caught:\n" + \
        "\n".join(survivors)
    counts: dict[str, int] = {}
    for label, (outcome, why) in outcomes.items():
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome != "killed":
            print(f"{name}: {outcome}: {label} ({why})")
    print(f"{name}: {counts}")
    return counts


def test_the_generator_makes_every_kind():
    made = mutants(parse(subject(SAMPLE_SUBJECT).candidate))
    assert {m.kind for m in made} == set(KINDS)
    assert len({m.text for m in made}) == len(made), "two mutants are the same module"


def test_a_sample_of_mutants_is_all_caught():
    chosen = _sample(mutants(parse(subject(SAMPLE_SUBJECT).candidate)))
    counts = _check(SAMPLE_SUBJECT, chosen)
    assert counts.get("killed", 0) + counts.get("killed-reseeded", 0) >= len(chosen) - 2


@pytest.mark.slow
@pytest.mark.parametrize("name", SUBJECTS)
def test_every_mutant_is_caught(name):
    _check(name, mutants(parse(subject(name).candidate)))
