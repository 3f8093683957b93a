"""Run an original and a candidate module on the same inputs and compare them.

Both modules are driven in the *original's* terms: inputs are generated (or read)
per original parameter, the candidate receives them through the manifest (a shard
of the value for a sharded parameter) and its outputs are gathered back to the
original's output leaves before comparing. With ``steps > 1`` each module carries
its own state as a training loop would, where an output feeds a parameter (the
manifest's ``feedback``, else :func:`default_feedback`): the original its outputs,
the candidate its own output arrays — shards with their padding lanes — whenever the
manifest gives the output and the parameter the same format (else the gathered value
is re-sharded, and the report says so). Other parameters (batch data, gradients) get
fresh seeded values every step, drawn by the step's input regime
(:data:`~hlo_shard.runtime.inputs.REGIMES`), which may also reset state (zero state,
saturated step counts, wide magnitudes) in both modules alike.

Every step compares each output leaf's values, the update ``Δ = out − in`` of every
fed-back leaf (:func:`~hlo_shard.runtime.compare.compare_update`), and that the
padding lanes of every sharded candidate output are zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast
from collections.abc import Callable, Sequence

import numpy as np

from hlo_shard.errors import HloShardError
from hlo_shard.ir import ArrayShape, Module
from hlo_shard.opinfo import RANDOM_DRAWS
from hlo_shard.runtime.compare import (
    LeafComparison, check_padding, compare_leaf, compare_update, missing_leaf, shape_text,
    nudged as nudged_values,
)
from hlo_shard.runtime.executable import Executable, MemoryStats, Timing, load, read_module, time_interleaved
from hlo_shard.parser import compatible
from hlo_shard.runtime.forms import check_executable
from hlo_shard.runtime.inputs import (
    ALL, REGIMES, REPLICATED, DeviceValues, ParameterRole, generate_parameter, load_npz,
    output_shapes, parameter_roles, parameter_shapes, regime_inputs, regime_of,
)
from hlo_shard.runtime.manifest import (
    ArrayRecord, Manifest, Shard, gather_value, shard_value,
)
from hlo_shard.runtime.worker import DEFAULT_TIMEOUT
from hlo_shard.shard_format import ShardFormat

Progress = Callable[[str], None]
#: Seed offset for candidate-only parameters, so they never repeat an original's values.
_CANDIDATE_ONLY_SEED = 1_000_003


@dataclass
class VerifyOptions:
    devices: int | None = None
    #: None: one step per input regime (a cycle) when comparing two modules with
    #: ``regime`` "all", else 1.
    steps: int | None = None
    seed: int = 0
    rtol: float | None = None
    atol: float | None = None
    #: Tolerance of updates relative to the leaf's largest update (default by dtype).
    update_rtol: float | None = None
    #: An input regime's name or "all" (cycle through them, one per step).
    regime: str = ALL
    backend: str = "cpu"
    manifest: Manifest | None = None
    per_device_params: Sequence[int] | None = None
    inputs_npz: str | Path | None = None
    #: Timed runs per module (0: no timing) after ``warmup`` untimed ones.
    time_runs: int = 0
    warmup: int = 2
    timeout: float = DEFAULT_TIMEOUT
    #: Where to run (default: the pooled single-process worker), e.g. a
    #: :class:`~hlo_shard.runtime.distributed.DistributedWorker`.
    worker: Any = None


@dataclass
class ModuleReport:
    name: str
    parameters: list[ArrayShape]
    outputs: list[ArrayShape]
    memory: MemoryStats
    cost: dict[str, float]
    compile_seconds: float
    timing: Timing | None = None
    #: Output leaves (index) holding NaN or inf after the last step: a warning only.
    nonfinite_outputs: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, exe: Executable) -> ModuleReport:
        return cls(exe.name, exe.parameters, exe.outputs, exe.memory, exe.cost,
                   exe.compile_seconds)

    def to_json(self) -> dict:
        return {"name": self.name, "outputs": [shape_text(s) for s in self.outputs],
                "memory_per_device": self.memory.to_json(),
                "cost": {k: self.cost[k] for k in ("flops", "transcendentals", "bytes accessed")
                         if k in self.cost},
                "compile_s": self.compile_seconds,
                "timing": self.timing.to_json() if self.timing else None,
                "nonfinite_outputs": self.nonfinite_outputs}


@dataclass
class VerifyReport:
    devices: int
    backend: str
    roles: list[ParameterRole]
    original: ModuleReport
    candidate: ModuleReport | None
    #: Comparisons per step (empty for a single module).
    steps: list[list[LeafComparison]] = field(default_factory=list)
    #: (original output leaf, original parameter) pairs fed back between steps.
    feedback: list[tuple[int, int]] = field(default_factory=list)
    #: Of those, the pairs the candidate could not be fed its own arrays for (the
    #: manifest gives output and parameter different formats): re-sharded instead.
    resharded: list[tuple[int, int]] = field(default_factory=list)
    #: Of those, the pairs whose candidate parameter is a shard: the candidate does not
    #: run on its own outputs (a loop feeding them back would hand a shard parameter a
    #: value of another form) — a failure whatever the numbers.
    unlooped: list[tuple[int, int]] = field(default_factory=list)
    #: The input regime of each step run.
    regimes: list[str] = field(default_factory=list)
    steps_run: int = 0
    #: ``feedback`` is :func:`default_feedback`'s guess (the manifest gives none): the
    #: pairs in order by shape, which a step returning its values in another order than
    #: it takes them does not follow.
    feedback_guessed: bool = False

    @property
    def differing(self) -> list[tuple[int, LeafComparison]]:
        """(step, comparison) for every leaf that did not match, first step first."""
        return [(step, leaf) for step, leaves in enumerate(self.steps, 1)
                for leaf in leaves if not leaf.ok]

    @property
    def ok(self) -> bool:
        return not self.differing and not self.unlooped

    @property
    def excused(self) -> int:
        """Update elements excused as ill-conditioned, over every step and leaf
        (:func:`~hlo_shard.runtime.compare.compare_update`)."""
        return sum(leaf.excused for leaves in self.steps for leaf in leaves)

    def final(self) -> list[LeafComparison]:
        """Per leaf: its first failing step's comparison, else the last step's."""
        if not self.steps:
            return []
        first_bad: dict[int, LeafComparison] = {}
        for _, leaf in self.differing:
            first_bad.setdefault(leaf.index, leaf)
        return [first_bad.get(leaf.index, leaf) for leaf in self.steps[-1]]

    def to_json(self) -> dict:
        data = {"devices": self.devices, "backend": self.backend, "steps": self.steps_run,
                "regimes": self.regimes,
                "resharded": [{"output": o, "parameter": p} for o, p in self.resharded],
                "unlooped": [{"output": o, "parameter": p} for o, p in self.unlooped],
                "inputs": [{"parameter": r.number, "name": r.name, "role": r.role,
                            "source": r.source} for r in self.roles],
                "feedback": [{"output": o, "parameter": p} for o, p in self.feedback],
                "feedback_guessed": self.feedback_guessed,
                "original": self.original.to_json()}
        if self.candidate is not None:
            data["candidate"] = self.candidate.to_json()
            data["match"] = self.ok
            data["outputs"] = [leaf.to_json() for leaf in self.final()]
            data["first_difference_step"] = self.differing[0][0] if self.differing else None
            data["excused"] = self.excused
        return data


# ------------------------------------------------------------------- correspondences


def default_feedback(module: Module, roles: Sequence[ParameterRole]) -> list[tuple[int, int]]:
    """(output leaf, parameter) pairs: each replicated parameter, in order, takes the
    next output leaf of its shape and type after the previous match. Per-device
    parameters (batch data, gradients) never take an output: they are fresh each step."""
    outputs = output_shapes(module)
    pairs = []
    start = 0
    for role, shape in zip(roles, parameter_shapes(module)):
        if role.role != REPLICATED:
            continue
        match = next((j for j in range(start, len(outputs)) if compatible(outputs[j], shape)),
                     None)
        if match is not None:
            pairs.append((match, role.number))
            start = match + 1
    return pairs


def _identity_records(original: Module, candidate: Module) -> tuple[list[ArrayRecord], list[ArrayRecord]]:
    """Records for a candidate with the original's exact signature (no manifest)."""
    problems = []
    sections = []
    for what, ours, theirs in (("parameter", parameter_shapes(original), parameter_shapes(candidate)),
                               ("output", output_shapes(original), output_shapes(candidate))):
        if len(ours) != len(theirs):
            problems.append(f"{len(ours)} {what}s vs {len(theirs)}")
        problems += [f"{what} {i}: {shape_text(a)} vs {shape_text(b)}"
                     for i, (a, b) in enumerate(zip(ours, theirs)) if not compatible(a, b)]
        sections.append([ArrayRecord(i, i, "replicated", s) for i, s in enumerate(ours)])
    if problems:
        raise HloShardError("signature mismatch between original and candidate ("
                            + "; ".join(problems[:4]) + "); pass --manifest to explain it")
    return sections[0], sections[1]


def _check_manifest(manifest: Manifest, original: Module, candidate: Module, devices: int
                    ) -> tuple[list[ArrayRecord], list[ArrayRecord]]:
    where = f"manifest {manifest.path or ''}".rstrip()
    if manifest.devices != devices:
        raise HloShardError(f"{where} is for {manifest.devices} devices, not {devices}")
    sections = []
    for what, ours, theirs, records in (
            ("parameter", parameter_shapes(original), parameter_shapes(candidate),
             manifest.parameters),
            ("output", output_shapes(original), output_shapes(candidate), manifest.outputs)):
        by_index = {r.index: r for r in records}
        ordered = []
        for index, shape in enumerate(theirs):
            record = by_index.get(index)
            if record is None:
                raise HloShardError(f"{where} has no record for candidate {what} {index}")
            if record.original is not None:
                if record.original >= len(ours):
                    raise HloShardError(f"{where}: candidate {what} {index} maps to original "
                                        f"{what} {record.original}, which does not exist")
                if not compatible(record.shape, ours[record.original]):
                    raise HloShardError(
                        f"{where}: candidate {what} {index} records original shape "
                        f"{shape_text(record.shape)}, but original {what} {record.original} "
                        f"is {shape_text(ours[record.original])}")
            if record.shard is not None:  # a "sharded" record
                if shape.num_elements != record.shard.format.shard_len or \
                        shape.element_type != record.shape.element_type:
                    raise HloShardError(
                        f"{where}: candidate {what} {index} is {shape_text(shape)}, not a "
                        f"shard of {record.shard.format.shard_len} {record.shape.element_type}")
            elif not compatible(shape, record.shape):
                raise HloShardError(f"{where}: candidate {what} {index} is {shape_text(shape)}"
                                    f", the manifest says {shape_text(record.shape)}")
            ordered.append(record)
        sections.append(ordered)
    return sections[0], sections[1]


# ------------------------------------------------------------------------ the driver


@dataclass
class _Pair:
    """Two modules compared, and how the candidate's arrays stand for the original's."""

    original: Executable
    candidate: Executable
    param_records: list[ArrayRecord]
    output_records: list[ArrayRecord]


def _candidate_inputs(pair: _Pair, values: list[DeviceValues], options: VerifyOptions,
                      devices: int, step: int) -> list[DeviceValues]:
    """The candidate's arguments from values in original terms."""
    out = []
    for record, shape in zip(pair.param_records, pair.candidate.parameters):
        if record.original is None:
            out.append(generate_parameter(shape, _CANDIDATE_ONLY_SEED + record.index, REPLICATED,
                                          devices, options.seed, step))
        elif record.kind == "sharded":
            full = values[record.original]
            out.append([shard_value(full[d], record, d, devices, shape) for d in range(devices)])
        else:
            out.append(values[record.original])
    return out


def _gathered(records: Sequence[ArrayRecord], shapes: Sequence[ArrayShape],
              arrays: Sequence[DeviceValues], devices: int) -> dict[int, DeviceValues]:
    """Candidate arrays keyed by the original array they stand for, shards gathered."""
    gathered: dict[int, DeviceValues] = {}
    for record, shape, values in zip(records, shapes, arrays):
        if record.original is None or record.original in gathered:
            continue
        if record.kind == "sharded":
            values = [gather_value(values, record, d, shape) for d in range(devices)]
        gathered[record.original] = values
    return gathered


def _in_original_terms(pair: _Pair, outputs: list[DeviceValues], devices: int
                       ) -> dict[int, DeviceValues]:
    """Candidate outputs keyed by the original output leaf they stand for."""
    return _gathered(pair.output_records, pair.candidate.outputs, outputs, devices)


def _params_in_original_terms(pair: _Pair, inputs: list[DeviceValues], devices: int
                              ) -> dict[int, DeviceValues]:
    """The candidate's arguments keyed by the original parameter they stand for."""
    return _gathered(pair.param_records, pair.candidate.parameters, inputs, devices)


def _nonfinite_leaves(outputs: dict[int, DeviceValues], shapes: list[ArrayShape]) -> set[int]:
    return set(_nonfinite([outputs[i] for i in range(len(shapes))], shapes))


def _nonfinite(outputs: list[DeviceValues], shapes: list[ArrayShape]) -> list[int]:
    bad = []
    for index, (values, shape) in enumerate(zip(outputs, shapes)):
        if shape.element_type.startswith(("f", "bf", "c")) and not all(
                np.all(np.isfinite(np.asarray(v, dtype=np.complex128 if np.iscomplexobj(v)
                                              else np.float64))) for v in values):
            bad.append(index)
    return bad


def _refuse_random_draws(module: Module) -> None:
    """A module that draws random numbers from XLA's stateful generator (``rng``) gets
    other numbers on every run: compared, it would differ from itself."""
    for comp in module.computations:
        for inst in comp.instructions:
            if inst.opcode in RANDOM_DRAWS:
                raise HloShardError(
                    f"{module.source_path or module.name}: %{inst.name} in %{comp.name} is "
                    f"an {inst.opcode}, which draws other random numbers on every run, so "
                    f"no two runs of the module compare (verify compares deterministic "
                    f"modules; jax's random keys are)")


def verify(original: str | Path | Module, candidate: str | Path | Module | None = None,
           options: VerifyOptions | None = None, progress: Progress | None = None
           ) -> VerifyReport:
    """Run ``original`` (and ``candidate``) for ``options.steps`` steps on the same
    seeded inputs and compare every output leaf on every device."""
    options = options or VerifyOptions()
    say = progress or (lambda message: None)
    regime_of(options.regime, 0)  # an unknown name fails before anything compiles
    steps = options.steps
    if steps is None:
        cycle = candidate is not None and options.regime == ALL
        steps = len(REGIMES) if cycle else 1
        options = replace(options, steps=steps)
    if steps < 1:
        raise HloShardError("--steps must be at least 1")
    modules = [read_module(original)] + ([read_module(candidate)] if candidate is not None else [])
    for module in modules:
        check_executable(module)
        if candidate is not None:
            _refuse_random_draws(module)
    counts = {m.device_count for m in modules} - {1}
    if len(counts) > 1:
        raise HloShardError(f"original and candidate are written for different device counts "
                            f"({' and '.join(map(str, sorted(counts)))})")
    devices = options.devices or (counts.pop() if counts else 1)
    first = modules[0]
    records: tuple[list[ArrayRecord], list[ArrayRecord]] = ([], [])
    if len(modules) == 2:
        records = _check_manifest(options.manifest, first, modules[1], devices) \
            if options.manifest is not None else _identity_records(first, modules[1])
    roles = parameter_roles(first, options.per_device_params, options.manifest)
    guessed = options.manifest is None or options.manifest.feedback is None
    feedback = default_feedback(first, roles) if guessed \
        else list(cast(Manifest, options.manifest).feedback or ())
    _check_feedback(first, feedback)
    supplied = load_npz(options.inputs_npz, first, devices) if options.inputs_npz else {}

    executables: list[Executable] = []
    try:
        for module in modules:
            say(f"compiling {module.source_path or module.name} for {devices} "
                f"{options.backend} device{'s' if devices > 1 else ''}")
            executables.append(load(module, devices, options.backend, worker=options.worker,
                                    timeout=options.timeout))
        original_exe = executables[0]
        pair = _Pair(original_exe, executables[1], *records) if len(executables) == 2 else None
        report = VerifyReport(devices, options.backend, roles, ModuleReport.of(original_exe),
                              ModuleReport.of(pair.candidate) if pair else None,
                              feedback=feedback, feedback_guessed=guessed)
        _Run(original_exe, pair, report, options, steps, supplied, devices, say).steps()
    finally:
        for exe in executables:
            exe.close()
    return report


@dataclass(frozen=True, slots=True)
class _Feed:
    """One fed-back state leaf of the candidate: its output ``output`` becomes its
    parameter ``parameter`` as is (padding lanes included)."""

    output: int
    parameter: int
    original_parameter: int


def _same_format(out: ArrayRecord, out_shape: ArrayShape, param: ArrayRecord,
                 param_shape: ArrayShape, devices: int) -> bool:
    """Whether the manifest gives a candidate output and parameter one meaning, so the
    output's arrays can be the parameter's next value as they are."""
    if not compatible(out_shape, param_shape) or \
            out_shape.minor_to_major() != param_shape.minor_to_major():
        return False
    if out.shard is None or param.shard is None:  # not both "sharded"
        return out.shard is None and param.shard is None
    return (out.shard.format, out.shard.groups(devices)) == \
        (param.shard.format, param.shard.groups(devices))


def _candidate_feeds(pair: _Pair, feedback: Sequence[tuple[int, int]], devices: int
                     ) -> tuple[list[_Feed], list[tuple[int, int]]]:
    """The candidate's own feedback (output → parameter, in its terms), and the
    original pairs that must be re-sharded instead."""
    feeds: list[_Feed] = []
    resharded: list[tuple[int, int]] = []
    for output, parameter in feedback:
        outs = [i for i, r in enumerate(pair.output_records) if r.original == output]
        params = [j for j, r in enumerate(pair.param_records) if r.original == parameter]
        for j in params:
            i = next((i for i in outs if _same_format(
                pair.output_records[i], pair.candidate.outputs[i], pair.param_records[j],
                pair.candidate.parameters[j], devices)), None)
            if i is None:
                resharded.append((output, parameter))
            else:
                feeds.append(_Feed(i, j, parameter))
    return feeds, resharded


def _padding_lanes(values: DeviceValues, shard: Shard, original: ArrayShape,
                   shape: ArrayShape, devices: int) -> list[np.ndarray]:
    """The padding lanes of an output sharded as ``shard``: per replica group, the
    elements past the ``original``'s in the group's chunks concatenated in order."""
    lanes = []
    for group in shard.groups(devices):
        own = ShardFormat.of(shape, 1)
        flat = np.concatenate([own.padded_flat(values[d]) for d in group])
        lanes.append(flat[original.num_elements:])
    return lanes


@dataclass
class _Run:
    """The step loop: each module carries its own state between steps."""

    original: Executable
    #: None: the original runs alone.
    pair: _Pair | None
    report: VerifyReport
    options: VerifyOptions
    #: ``options.steps`` resolved.
    step_count: int
    supplied: dict[int, DeviceValues]
    devices: int
    say: Progress

    def fresh(self, step: int) -> tuple[list[DeviceValues], set[int]]:
        """Inputs of 0-based ``step`` in original terms under its regime, with the
        user's values, and the state parameters the regime resets."""
        regime = regime_of(self.options.regime, step)
        values, reset = regime_inputs(self.original.source, self.report.roles,
                                      self.devices, self.options.seed, step, regime)
        for number, given in self.supplied.items():
            values[number] = given
        self.report.regimes.append(regime.name)
        return values, reset

    def steps(self) -> None:
        pair, original, options, feedback = self.pair, self.original, self.options, \
            self.report.feedback
        feeds: list[_Feed] = []
        if pair is not None:
            feeds, self.report.resharded = _candidate_feeds(pair, feedback, self.devices)
            shards = {r.original for r in pair.param_records if r.shard is not None}
            self.report.unlooped = [(o, p) for o, p in self.report.resharded if p in shards]
        state_a, _ = self.fresh(0)
        inputs_b = _candidate_inputs(pair, state_a, options, self.devices, 0) \
            if pair is not None else []
        timed_inputs = [state_a] + ([inputs_b] if pair is not None else [])
        for step in range(1, self.step_count + 1):
            self.say(f"step {step}/{self.step_count} ({self.report.regimes[-1]}): running")
            outputs_a = dict(enumerate(original.run(state_a)))
            if pair is None:
                self.report.original.nonfinite_outputs = _nonfinite(
                    list(outputs_a.values()), original.outputs)
            else:
                raw_b = pair.candidate.run(inputs_b)
                outputs_b = self.compare(pair, step, state_a, outputs_a, inputs_b, raw_b)
            self.report.steps_run = step
            if step == self.step_count:
                break
            upcoming, reset = self.fresh(step)
            # State the original left NaN/inf would make every later step vacuous:
            # both modules start it afresh (the step that produced it was compared).
            broken = _nonfinite_leaves(outputs_a, original.outputs)
            reset |= {p for o, p in feedback if o in broken}
            fed = [(o, p) for o, p in feedback if p not in reset]
            state_a = _fed(upcoming, outputs_a, fed)
            if pair is not None:
                inputs_b = _candidate_inputs(pair, _fed(upcoming, outputs_b, fed), options,
                                             self.devices, step)
                for feed in feeds:
                    if feed.original_parameter not in reset:
                        inputs_b[feed.parameter] = raw_b[feed.output]
        if options.time_runs:
            self.time(timed_inputs)

    def compare(self, pair: _Pair, step: int, inputs_a: list[DeviceValues],
                outputs_a: dict[int, DeviceValues], inputs_b: list[DeviceValues],
                raw_b: list[DeviceValues]) -> dict[int, DeviceValues]:
        """Compare one step (values, updates, padding); the candidate's outputs in
        original terms."""
        devices = self.devices
        outputs_b = _in_original_terms(pair, raw_b, devices)
        before_b = _params_in_original_terms(pair, inputs_b, devices)
        fed_from = {o: p for o, p in self.report.feedback}
        broken = _nonfinite_leaves(outputs_a, pair.original.outputs)
        leaves = []
        nudged: tuple[list[DeviceValues], list[DeviceValues]] | None = None
        for index, shape in enumerate(pair.original.outputs):
            if index not in outputs_b:
                leaves.append(missing_leaf(index, shape, "no candidate output stands for it"))
                continue
            compared = compare_leaf(index, shape, outputs_a[index], outputs_b[index],
                                    self.options.rtol, self.options.atol)
            leaf = compared
            parameter = fed_from.get(index)
            if parameter is not None and parameter in before_b:
                leaf = compare_update(compared, inputs_a[parameter], outputs_a[index],
                                      before_b[parameter], outputs_b[index],
                                      self.options.update_rtol)
                if leaf.verdict in ("differ", "update-differ"):
                    # Out of the bound: ill-conditioned, or a slip? The original run
                    # again on inputs an ulp away says which elements it cannot itself
                    # compute to within the bound (run once per step, where needed).
                    if nudged is None:
                        inputs = [[nudged_values(v) for v in value] for value in inputs_a]
                        nudged = inputs, pair.original.run(inputs)
                    leaf = compare_update(compared, inputs_a[parameter], outputs_a[index],
                                          before_b[parameter], outputs_b[index],
                                          self.options.update_rtol,
                                          (nudged[0][parameter], nudged[1][index]))
            # Where the original's math breaks down (NaN/inf in the leaf), the padding
            # lanes compute the same expressions on zeros: checked on finite steps only.
            finite = index not in broken
            for record, cshape, values in zip(pair.output_records, pair.candidate.outputs,
                                              raw_b):
                if finite and record.original == index and record.shard is not None and \
                        record.shard.format.padding:
                    leaf = check_padding(leaf, _padding_lanes(values, record.shard, record.shape,
                                                              cshape, devices))
            leaves.append(leaf)
        self.report.steps.append(leaves)
        bad = sum(not leaf.ok for leaf in leaves)
        self.say(f"step {step}/{self.step_count}: "
                 + (f"{bad} output(s) differ" if bad else "all outputs match"))
        return outputs_b

    def time(self, inputs: list[list[DeviceValues]]) -> None:
        """From step-0 inputs, both modules interleaved A/B/A/B, each as a training loop
        with its donation (the compared executables run without it, so their inputs
        stay valid; a module that donates is compiled again for timing)."""
        self.say(f"timing: {self.options.time_runs} runs per module after "
                 f"{self.options.warmup} warm-up, interleaved")
        compared = [self.original] + ([self.pair.candidate] if self.pair is not None else [])
        reports = [self.report.original] + ([self.report.candidate]
                                            if self.report.candidate is not None else [])
        donating = [exe.source.output_aliases() != {} for exe in compared]
        timed = [load(exe.source, exe.devices, worker=exe.worker, timeout=exe.timeout,
                      donate=True) if donates else exe
                 for exe, donates in zip(compared, donating)]
        try:
            timings = time_interleaved(timed, inputs, self.options.time_runs,
                                       self.options.warmup)
        finally:
            for exe, donates in zip(timed, donating):
                if donates:
                    exe.close()
        for module_report, timing in zip(reports, timings):
            module_report.timing = timing


def _check_feedback(module: Module, feedback: Sequence[tuple[int, int]]) -> None:
    outputs, params = output_shapes(module), parameter_shapes(module)
    for output, parameter in feedback:
        if output >= len(outputs) or parameter >= len(params):
            raise HloShardError(f"feedback output {output} -> parameter {parameter}: "
                                "no such output or parameter in the original")
        if not compatible(outputs[output], params[parameter]):
            raise HloShardError(f"feedback output {output} ({shape_text(outputs[output])}) "
                                f"cannot feed parameter {parameter} "
                                f"({shape_text(params[parameter])})")


def _fed(fresh_values: list[DeviceValues], outputs: dict[int, DeviceValues],
         feedback: Sequence[tuple[int, int]]) -> list[DeviceValues]:
    """Next step's inputs: fresh values, with fed-back outputs in their parameters."""
    values = list(fresh_values)
    for output, parameter in feedback:
        if output in outputs:
            values[parameter] = outputs[output]
    return values
