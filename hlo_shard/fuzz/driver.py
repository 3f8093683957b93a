"""Differential fuzzing: optimize random training steps, run both, compare.

Each case renders a :class:`~hlo_shard.fuzz.steps.StepSpec`, runs ``hlo-shard optimize``
on it in every ``--state`` × ``--strategy`` variant (through the real command, in
process, so flags, validation and the manifest are what users get), and verifies each
distinct candidate against the original for two steps with :func:`hlo_shard.runtime.verify`
(one pooled 8-device worker serves every case). A variant fails when the command
crashes or refuses the module, or when any output differs; a failing case is shrunk
(tensors and features dropped while the same variant still fails the same way) and the
reproducer is written out.

Until ``optimize`` exists the transformation is the identity (``hlo-shard fmt``), so the
harness itself stays tested.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
import json
import multiprocessing
import os
from pathlib import Path
import re
import signal
import tempfile
import time
import traceback
from typing import Any, NoReturn

from hlo_shard.errors import HloShardError
from hlo_shard.fuzz.steps import FULL, Size, StepSpec, random_step, reductions, render

STATES = ("gathered", "sharded")
STRATEGIES = ("auto", "per-tensor", "combined")
VARIANTS = tuple((state, strategy) for state in STATES for strategy in STRATEGIES)
STEPS = 5  # one per input regime (runtime.inputs.REGIMES)
#: Seconds one optimize call may take before it counts as hung.
TRANSFORM_TIMEOUT = 120
#: XLA flags of the fuzzing workers (each unless the user's XLA_FLAGS set it). LLVM
#: optimisation off: compiles about a third faster, and both modules of a pair are
#: compiled alike, so equivalence is judged the same. No excess precision: XLA may
#: otherwise skip a 16-bit rounding the HLO asks for (a convert pair inside a fusion)
#: in one module and not in the other, where fusions differ, and a 16-bit step of
#: difference in a gradient becomes a false mismatch in f32 state (found by the fuzzer).
WORKER_FLAGS = {"--xla_backend_optimization_level": "0",
                "--xla_allow_excess_precision": "false"}
_REDUCE_SCATTER = re.compile(r"\breduce-scatter(?:-start)?\(")

#: Outcome kinds; every one but "match" is a failure.
MATCH, MISMATCH, CRASH, REFUSED, VERIFY_ERROR = "match", "mismatch", "crash", "refused", \
    "verify-error"


@dataclass
class Candidate:
    """What a transformation produced for one variant (or why it produced nothing)."""

    text: str | None = None
    manifest: str | None = None
    error: str | None = None
    crashed: bool = False


@dataclass
class Outcome:
    kind: str
    detail: str = ""
    sharded: bool = False

    @property
    def ok(self) -> bool:
        return self.kind == MATCH


@dataclass
class CaseResult:
    spec: StepSpec
    #: "state/strategy" → outcome.
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    #: The original itself does not run: a generator bug, not a finding about the pass.
    invalid: str | None = None
    verified: int = 0
    seconds: float = 0.0

    @property
    def failures(self) -> dict[str, Outcome]:
        return {k: o for k, o in self.outcomes.items() if not o.ok}

    @property
    def sharded(self) -> bool:
        return any(o.sharded for o in self.outcomes.values())


# -------------------------------------------------------------------- transformations


class Transformation:
    """``optimize`` through the CLI, in process (click's runner catches everything)."""

    name = "optimize"

    def __call__(self, original: Path, workdir: Path, state: str, strategy: str) -> Candidate:
        out = workdir / f"candidate-{state}-{strategy}.hlo"
        manifest = workdir / f"manifest-{state}-{strategy}.json"
        args = self.arguments(original, out, manifest, state, strategy)
        result = _invoke(args)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            trace = "".join(traceback.format_exception(*result.exc_info))
            return Candidate(error=trace.strip(), crashed=True)
        if result.exit_code != 0:
            return Candidate(error=(result.stderr or result.output).strip() or
                             f"exit status {result.exit_code}")
        return Candidate(out.read_text(encoding="utf-8"),
                         manifest.read_text(encoding="utf-8") if manifest.exists() else None)

    def arguments(self, original: Path, out: Path, manifest: Path, state: str,
                  strategy: str) -> list[str]:
        return ["optimize", "--force", str(original), "-o", str(out), "--manifest", str(manifest),
                "--state", state, "--strategy", strategy]


class Identity(Transformation):
    """``fmt``: what the harness checks until the pass lands (every variant the same)."""

    name = "identity"

    def arguments(self, original: Path, out: Path, manifest: Path, state: str,
                  strategy: str) -> list[str]:
        return ["fmt", str(original), "-o", str(out)]


def default_transformation() -> Transformation:
    from hlo_shard.cli import main

    return Transformation() if "optimize" in main.commands else Identity()


def _invoke(args: list[str]) -> Any:
    from click.testing import CliRunner

    from hlo_shard.cli import main

    with _time_limit(TRANSFORM_TIMEOUT):
        return CliRunner().invoke(main, args, catch_exceptions=True)


class _Timeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt a hung in-process call (main thread only; elsewhere no limit)."""
    def expire(signum: int, frame: Any) -> NoReturn:
        raise _Timeout(f"no result after {seconds:g} s")

    try:
        previous = signal.signal(signal.SIGALRM, expire)
    except ValueError:  # not the main thread
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def worker_flags() -> Iterator[None]:
    """Workers started inside get :data:`WORKER_FLAGS`; the environment is restored
    afterwards."""
    previous = os.environ.get("XLA_FLAGS")
    added = [f"{flag}={value}" for flag, value in WORKER_FLAGS.items()
             if flag not in (previous or "")]
    os.environ["XLA_FLAGS"] = " ".join([previous or "", *added]).strip()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = previous


def start_worker() -> Any:
    """The one pooled 8-device CPU worker every case of this process uses (N ≤ 8)."""
    from hlo_shard import runtime

    with worker_flags():
        return runtime.get_worker("cpu", 8)


# ------------------------------------------------------------------------ one case


def _verify(original: Path, candidate: Path, manifest: Path | None, devices: int) -> Any:
    from hlo_shard import runtime

    options = runtime.VerifyOptions(
        devices=devices, steps=STEPS, timeout=120,
        manifest=runtime.load_manifest(str(manifest)) if manifest else None)
    return runtime.verify(str(original), str(candidate), options)


def _original_runs(original: Path, devices: int) -> str | None:
    """None when the original compiles and runs, else why not."""
    from hlo_shard import runtime

    try:
        runtime.verify(str(original), None, runtime.VerifyOptions(devices=devices, timeout=120))
    except HloShardError as err:
        return str(err)
    return None


def _difference(report: Any) -> str:
    if not report.differing:  # the numbers agree: the candidate does not loop on itself
        output, parameter = report.unlooped[0]
        return f"output {output} fed back to shard parameter {parameter} in another form"
    step, leaf = report.differing[0]
    return (f"output {leaf.index} {leaf.shape.element_type}[{','.join(map(str, leaf.shape.dims))}]"
            f" {leaf.verdict} at step {step}: max abs {leaf.max_abs:.3g}, max rel "
            f"{leaf.max_rel:.3g}, device {leaf.worst_device}"
            + (f" ({leaf.detail})" if leaf.detail else ""))


def run_variant(spec: StepSpec, transform: Transformation, workdir: Path, state: str,
                strategy: str, original: Path | None = None,
                cache: dict | None = None) -> Outcome:
    """Optimize ``spec`` in one variant and verify the candidate."""
    if original is None:
        original = workdir / "original.hlo"
        original.write_text(render(spec), encoding="utf-8")
    candidate = transform(original, workdir, state, strategy)
    if candidate.error is not None:
        return Outcome(CRASH if candidate.crashed else REFUSED, candidate.error)
    assert candidate.text is not None, "a candidate without an error has its text"
    key = (candidate.text, candidate.manifest)
    if cache is not None and key in cache:
        return cache[key]
    cand_path = workdir / f"candidate-{state}-{strategy}.hlo"
    manifest = workdir / f"manifest-{state}-{strategy}.json" if candidate.manifest else None
    sharded = bool(_REDUCE_SCATTER.search(candidate.text))
    try:
        report = _verify(original, cand_path, manifest, spec.devices)
        outcome = Outcome(MATCH if report.ok else MISMATCH,
                          "" if report.ok else _difference(report), sharded)
    except HloShardError as err:
        outcome = Outcome(VERIFY_ERROR, str(err), sharded)
    if cache is not None:
        cache[key] = outcome
    return outcome


def run_case(spec: StepSpec, transform: Transformation, workdir: Path,
             variants: tuple[tuple[str, str], ...] = VARIANTS) -> CaseResult:
    started = time.perf_counter()
    result = CaseResult(spec)
    original = workdir / "original.hlo"
    original.write_text(render(spec), encoding="utf-8")
    cache: dict = {}
    for state, strategy in variants:
        result.outcomes[f"{state}/{strategy}"] = run_variant(
            spec, transform, workdir, state, strategy, original, cache)
    result.verified = len(cache)
    if any(o.kind == VERIFY_ERROR for o in result.outcomes.values()):
        result.invalid = _original_runs(original, spec.devices)
        if result.invalid:
            result.outcomes.clear()
    result.seconds = time.perf_counter() - started
    return result


# -------------------------------------------------------------------------- shrinking


def shrink(spec: StepSpec, transform: Transformation, state: str, strategy: str, kind: str,
           workdir: Path, budget: int = 60) -> tuple[StepSpec, Outcome | None]:
    """The smallest variant of ``spec`` found (greedily, at most ``budget`` tries) that
    still fails the same way in the same variant, with its outcome."""
    best, best_outcome, tries = spec, None, 0
    progress = True
    while progress and tries < budget:
        progress = False
        for smaller in reductions(best):
            if tries >= budget:
                break
            tries += 1
            try:
                outcome = run_variant(smaller, transform, workdir, state, strategy)
            except HloShardError:
                continue
            if outcome.kind == kind:
                best, best_outcome, progress = smaller, outcome, True
                break
    return best, best_outcome


def write_reproducer(out_dir: Path, spec: StepSpec, transform: Transformation, state: str,
                     strategy: str, outcome: Outcome) -> Path:
    """``out_dir/seed-<seed>-<state>-<strategy>/``: the minimal module, its spec, the
    candidate and manifest (when one was written) and how to replay it."""
    folder = out_dir / f"seed-{spec.seed}-{state}-{strategy}"
    folder.mkdir(parents=True, exist_ok=True)
    original = folder / "original.hlo"
    original.write_text(render(spec), encoding="utf-8")
    (folder / "spec.json").write_text(json.dumps(spec.to_json(), indent=1) + "\n",
                                      encoding="utf-8")
    transform(original, folder, state, strategy)
    candidate = folder / f"candidate-{state}-{strategy}.hlo"
    manifest = folder / f"manifest-{state}-{strategy}.json"
    command = transform.arguments(original, candidate, manifest, state, strategy)
    first_line = outcome.detail.splitlines()[0] if outcome.detail else ""
    replay = [f"# {outcome.kind}: {spec.describe()}", f"# {first_line}",
              f"python -m hlo_shard {' '.join(command)}",
              f"python -m hlo_shard verify {original} {candidate} --steps {STEPS}"
              + (f" --manifest {manifest}" if manifest.exists() else "")]
    (folder / "REPRODUCE.txt").write_text("\n".join(replay) + "\n\n" + outcome.detail + "\n",
                                          encoding="utf-8")
    return folder


# ----------------------------------------------------------------------------- a run


@dataclass
class Summary:
    transform: str = ""
    cases: int = 0
    variants: int = 0
    verified: int = 0
    sharded: int = 0
    invalid: list[tuple[int, str]] = field(default_factory=list)
    #: (seed, variant, outcome, reproducer folder or None)
    failures: list[tuple[int, str, Outcome, Path | None]] = field(default_factory=list)
    seconds: float = 0.0

    def merge(self, other: Summary) -> None:
        for name in ("cases", "variants", "verified", "sharded"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.invalid += other.invalid
        self.failures += other.failures

    @property
    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, _, outcome, _ in self.failures:
            counts[outcome.kind] = counts.get(outcome.kind, 0) + 1
        return counts

    @property
    def sharded_fraction(self) -> float:
        valid = self.cases - len(self.invalid)
        return self.sharded / valid if valid else 0.0

    def lines(self) -> list[str]:
        counts = self.counts
        return [
            f"transformation: {self.transform}",
            f"cases: {self.cases} ({self.variants} optimize runs, {self.verified} distinct "
            f"candidates verified over {STEPS} steps) in {self.seconds:.1f} s",
            f"mismatches: {counts.get(MISMATCH, 0)}, crashes: {counts.get(CRASH, 0)}, "
            f"refusals: {counts.get(REFUSED, 0)}, verify errors: {counts.get(VERIFY_ERROR, 0)}",
            f"sharded something: {self.sharded}/{self.cases - len(self.invalid)} cases "
            f"({100 * self.sharded_fraction:.0f}%)",
            f"invalid generated cases (generator bugs): {len(self.invalid)}",
        ]


def variants_of(case_seed: int, per_case: int | None) -> tuple[tuple[str, str], ...]:
    """All variants, or ``per_case`` of them rotating with the seed (so that a run of
    many cases still covers every state × strategy)."""
    if per_case is None or per_case >= len(VARIANTS):
        return VARIANTS
    start = case_seed * per_case
    return tuple(VARIANTS[(start + k) % len(VARIANTS)] for k in range(per_case))


@dataclass(frozen=True)
class Plan:
    """What one fuzzing process does (picklable, for ``--jobs``)."""

    seeds: tuple[int, ...]
    out_dir: Path | None = None
    transform: str = "auto"
    size: Size = FULL
    variants_per_case: int | None = None
    shrink_budget: int = 60
    verbose: bool = True


def _transformation(name: str) -> Transformation:
    return {"auto": default_transformation, "optimize": Transformation,
            "identity": Identity}[name]()


def run_plan(plan: Plan, log: Callable[[str], None] | None = None) -> Summary:
    """Fuzz ``plan.seeds`` in this process; reproducers go to ``plan.out_dir``."""
    log = log or ((lambda line: print(line, flush=True)) if plan.verbose else (lambda line: None))
    transform = _transformation(plan.transform)
    summary = Summary(transform=transform.name)
    started = time.perf_counter()
    start_worker()
    with tempfile.TemporaryDirectory(prefix="hlo-shard-fuzz-") as scratch:
        for done, case_seed in enumerate(plan.seeds, 1):
            spec = random_step(case_seed, plan.size)
            workdir = Path(scratch) / str(case_seed)
            workdir.mkdir()
            variants = variants_of(case_seed, plan.variants_per_case)
            result = run_case(spec, transform, workdir, variants)
            summary.cases += 1
            summary.variants += len(variants)
            summary.verified += result.verified
            if result.invalid:
                summary.invalid.append((case_seed, result.invalid))
                log(f"seed {case_seed}: INVALID CASE (generator bug): {result.invalid}")
                continue
            summary.sharded += result.sharded
            folder = None
            for variant, outcome in result.failures.items():
                if plan.out_dir is not None and folder is None:  # one reproducer per case
                    state, strategy = variant.split("/")
                    small, small_outcome = shrink(spec, transform, state, strategy,
                                                  outcome.kind, workdir, plan.shrink_budget)
                    folder = write_reproducer(plan.out_dir, small, transform, state, strategy,
                                              small_outcome or outcome)
                summary.failures.append((case_seed, variant, outcome, folder))
                first = outcome.detail.strip().splitlines()[-1] if outcome.detail else ""
                log(f"seed {case_seed} {variant}: {outcome.kind.upper()}: {first}"
                    + (f" -> {folder}" if folder else ""))
            if done % 50 == 0:
                log(f"... {done}/{len(plan.seeds)} cases, {len(summary.failures)} failures, "
                    f"{summary.sharded} sharded, {time.perf_counter() - started:.0f} s")
    summary.seconds = time.perf_counter() - started
    return summary


def run(cases: int, seed: int = 0, jobs: int = 1, **options: Any) -> Summary:
    """Fuzz seeds ``seed … seed+cases-1`` in ``jobs`` processes (each with its own
    worker); ``options`` are the other :class:`Plan` fields."""
    seeds = tuple(range(seed, seed + cases))
    if jobs <= 1:
        return run_plan(Plan(seeds, **options))
    started = time.perf_counter()
    plans = [Plan(seeds[k::jobs], **options) for k in range(jobs)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        parts = pool.map(run_plan, plans)
    total = Summary(transform=parts[0].transform)
    for part in parts:
        total.merge(part)
    total.seconds = time.perf_counter() - started
    return total
