"""Hostile and broken input: every command fails cleanly, in bounded time and memory.

Every command (``fmt``, ``optimize``, ``report``, ``diff``, ``scale``, ``verify``) runs in
a child process — forked from a server that imported the CLI once
(:func:`hlo_shard.fuzz.hostile.run_cli`), or ``python -m hlo_shard`` itself — on each
input of the corpus: the small files of ``tests/hostile/`` and large ones generated once
here (100 000-deep nesting, 50 MB lines). Each run must exit with status 2; print one
error line (``file:line:col: error: …`` for bad text), at most followed by the source
excerpt and a caret, never a traceback; finish within a generous timeout, under an
address-space limit for the large inputs; leave no output or temporary file behind;
leave the input unchanged.

Truncations and byte flips of a real step are swept in process (click's runner), with
XLA's own parser as the oracle. Modules that parse but that XLA refuses to compile, or
crashes on, are reported by ``verify`` as an error (exit 2) with the parent alive.
"""

from __future__ import annotations

import hashlib
import re
import resource
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hlo_shard.cli import main
from hlo_shard.fuzz import hostile
from hlo_shard.fuzz.hostile import CliRun, run_cli
from test_fuzz_xla import xla_parse

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).resolve().parent / "hostile"
#: A real JAX data-parallel step (SPMD, 2 devices): the valid partner of two-input
#: commands, and the text that truncations and byte flips start from.
REAL = CORPUS / "real_step.hlo"

#: How each command is run on one bad input: {in} the input, {good} a valid module,
#: {out} a path in a fresh empty folder that must stay empty.
INVOCATIONS: dict[str, tuple[tuple[str, ...], ...]] = {
    "fmt": (("fmt", "{in}", "-o", "{out}"),),
    "optimize": (("optimize", "{in}", "-o", "{out}", "--manifest", "{out}.json"),),
    "report": (("report", "{in}", "-o", "{out}"),),
    "diff": (("diff", "{in}", "{good}", "-o", "{out}"),),
    "scale": (("scale", "{in}", "-o", "{out}"),),
    "verify": (("verify", "{in}"),),
}
#: The bad input in second position, for commands reading two modules.
SECOND_POSITION = (("diff", "{good}", "{in}", "-o", "{out}"), ("verify", "{good}", "{in}"))

#: Bad text: XLA's parser refuses each of these, so must every command (exit 2, located).
SYNTAX = ("empty.hlo", "comments_only.hlo", "unknown_opcode.hlo", "use_before_def.hlo",
          "missing_entry.hlo", "duplicate_names.hlo", "wrong_element_count.hlo",
          "operand_shape_mismatch.hlo", "signature_mismatch.hlo", "unterminated_comment.hlo",
          "unknown_computation.hlo", "binary.bin", "non_utf8.hlo")
#: Modules that parse (XLA's parser accepts them) but that XLA refuses to compile, or
#: aborts on: fmt keeps them (exit 0), verify must report an error (exit 2).
SEMANTIC = ("result_shape_mismatch.hlo", "collective_shape_mismatch.hlo",
            "xla_compiler_abort.hlo")

TIMEOUT_SMALL = 60
TIMEOUT_LARGE = 120
#: Address-space limit for the large inputs: a quadratic copy or a runaway recursion
#: fails fast instead of eating the machine.
MEMORY_LIMIT = 4 << 30
#: Longest acceptable stderr line: a message, never a dump of a huge input line.
MAX_LINE = 2000

_ERROR_LINE = re.compile(r"^(?:(?P<path>.+?):(?P<line>\d+):(?P<column>\d+): )?error: \S")
_CARET = re.compile(r"^ *\^$")


def _fill(template: tuple[str, ...], bad: Path, out: Path) -> list[str]:
    return [part.format(**{"in": str(bad), "good": str(REAL), "out": str(out)})
            for part in template]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(template: tuple[str, ...], bad: Path, workdir: Path, timeout: float,
         memory_limit: int | None = None) -> tuple[CliRun, list[str]]:
    """One invocation with its own empty output folder: the run and what it left there."""
    out_dir = workdir / f"out-{template[0]}-{template.index('{in}')}"
    out_dir.mkdir()
    run = run_cli(_fill(template, bad, out_dir / "out.hlo"), timeout, memory_limit)
    return run, sorted(p.name for p in out_dir.iterdir())


def _run_all(templates, bad: Path, workdir: Path, timeout: float,
             memory_limit: int | None = None) -> list[tuple[CliRun, list[str]]]:
    """Every invocation on ``bad`` (two at a time); the input must not change."""
    before = _digest(bad)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda t: _run(t, bad, workdir, timeout, memory_limit),
                                templates))
    assert _digest(bad) == before, f"{bad.name} was modified"
    return results


def _invocations(extra=()) -> list[tuple[str, ...]]:
    return [t for templates in INVOCATIONS.values() for t in templates
            if t[0] in main.commands] + [t for t in extra if t[0] in main.commands]


def check_clean_failure(result: tuple[CliRun, list[str]], bad: Path, located: bool) -> None:
    """Exit 2, one error line (located in ``bad`` when ``located``) at most followed by
    the source excerpt and a caret, no traceback, nothing left in the output folder."""
    run, leftovers = result
    what = f"`hlo-shard {' '.join(run.args)}`"
    assert not run.timed_out, f"{what} was still running after {run.seconds:.0f} s"
    assert "Traceback" not in run.stderr, f"{what} printed a traceback:\n{run.stderr}"
    assert run.returncode == 2, f"{what} exited {run.returncode}:\n{run.stderr[-2000:]}"
    lines = run.stderr.rstrip("\n").splitlines()
    errors = [i for i, line in enumerate(lines) if _ERROR_LINE.match(line)]
    assert errors, f"{what}: no error line in stderr:\n{run.stderr[-2000:]}"
    tail = lines[errors[0] + 1:]
    assert len(tail) <= 2 and (len(tail) < 2 or _CARET.match(tail[1])), \
        f"{what}: more than one error line (plus excerpt and caret):\n{run.stderr[-2000:]}"
    assert all(len(line) <= MAX_LINE for line in lines), f"{what}: an overlong stderr line"
    match = _ERROR_LINE.match(lines[errors[0]])
    if located:
        assert match.group("path") == str(bad), f"{what}: not located in {bad}: {lines[errors[0]]}"
    assert leftovers == [], f"{what} left {leftovers} behind"


# ------------------------------------------------------------------------------ corpus


def test_every_command_is_covered():
    """A command added to the CLI must be added to INVOCATIONS, and so tested here."""
    missing = set(main.commands) - set(INVOCATIONS)
    assert not missing, f"commands without a hostile-input invocation: {missing}"


#: Bad text some command does not yet refuse cleanly (strict xfail: each is reported).
_KNOWN_BAD_TEXT_BUGS: dict[str, str] = {}
#: Fixed bugs kept as regressions: a reduce whose to_apply is misspelt (t0_apply=) once
#: crashed report and diff; the parser now requires each opcode's attributes.
_REGRESSIONS = ("unknown_attribute.hlo",)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_KNOWN_BAD_TEXT_BUGS[n]))
    if n in _KNOWN_BAD_TEXT_BUGS else n for n in SYNTAX + _REGRESSIONS])
def test_bad_text_fails_cleanly_in_every_command(name, tmp_path):
    bad = CORPUS / name
    extra = SECOND_POSITION if name in ("empty.hlo", "non_utf8.hlo", "use_before_def.hlo") else ()
    for result in _run_all(_invocations(extra), bad, tmp_path, TIMEOUT_SMALL):
        check_clean_failure(result, bad, located=True)


@pytest.mark.parametrize("name", SEMANTIC)
def test_modules_xla_refuses_are_reported_by_verify(name, tmp_path):
    """The text parses, so fmt keeps it; XLA refuses (or aborts on) it, which verify
    reports as one error line and exit 2, the parent surviving its execution child."""
    bad = CORPUS / name
    for run, leftovers in _run_all(_invocations(), bad, tmp_path, 300):
        what = f"`hlo-shard {' '.join(run.args)}`"
        assert not run.timed_out and "Traceback" not in run.stderr, f"{what}:\n{run.stderr}"
        if run.args[0] == "verify":
            check_clean_failure((run, leftovers), bad, located=False)
            assert "compiling" in run.stderr, run.stderr
        elif run.args[0] == "fmt":
            assert run.returncode == 0, f"{what} exited {run.returncode}:\n{run.stderr}"
        else:
            assert run.returncode in (0, 2), f"{what} exited {run.returncode}:\n{run.stderr}"
            if run.returncode == 2:
                check_clean_failure((run, leftovers), bad, located=False)


# ------------------------------------------------------------------------ large inputs

#: Every command runs on these.
LARGE = {"deep_tuple_shape.hlo": hostile.deep_tuple_shape,
         "deep_literal_parentheses.hlo": hostile.deep_literal_parentheses,
         "huge_string_line.hlo": hostile.huge_string_line}
#: Only the front end (fmt) runs on these: slow to read, or (deep operands) read.
FRONT_END_ONLY = {"huge_constant_line.hlo": hostile.huge_constant_line,
                  "deep_operands.hlo": hostile.deep_operands,
                  "deep_literal_braces.hlo": hostile.deep_literal}


@pytest.fixture(scope="module")
def large_inputs(tmp_path_factory) -> dict[str, Path]:
    """Generated once per session (too big to commit)."""
    folder = tmp_path_factory.mktemp("large")
    paths = {}
    for name, make in {**LARGE, **FRONT_END_ONLY}.items():
        paths[name] = folder / name
        paths[name].write_text(make(), encoding="utf-8")
    for name in ("huge_string_line.hlo", "huge_constant_line.hlo"):
        assert paths[name].stat().st_size >= hostile.HUGE_BYTES
        assert paths[name].read_bytes().count(b"\n") == 1
    return paths


@pytest.mark.parametrize("name", sorted(LARGE))
def test_large_inputs_fail_cleanly_in_bounded_time_and_memory(name, large_inputs, tmp_path):
    bad = large_inputs[name]
    for result in _run_all(_invocations(), bad, tmp_path, TIMEOUT_LARGE, MEMORY_LIMIT):
        check_clean_failure(result, bad, located=True)


def _python_m_fmt(bad: Path, workdir: Path) -> tuple[CliRun, list[str]]:
    """``python -m hlo_shard fmt`` itself (not the fork server), memory-limited."""
    out_dir = workdir / "out"
    out_dir.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "hlo_shard", "fmt", str(bad), "-o", str(out_dir / "out.hlo")],
        cwd=REPO, capture_output=True, text=True, errors="replace", timeout=TIMEOUT_LARGE,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT)))
    run = CliRun(["fmt", str(bad)], proc.returncode, proc.stdout, proc.stderr, 0.0)
    return run, sorted(p.name for p in out_dir.iterdir())


#: Read, not refused: a module XLA's parser would read too if it did not recurse per level.
VALID_BUT_DEEP = "deep_operands.hlo"


@pytest.mark.parametrize("name", sorted(set(FRONT_END_ONLY) - {VALID_BUT_DEEP}))
def test_python_m_hlo_shard_on_large_inputs(name, large_inputs, tmp_path):
    bad = large_inputs[name]
    check_clean_failure(_python_m_fmt(bad, tmp_path), bad, located=True)


def test_deeply_nested_operands_are_read_flat_in_bounded_time_and_memory(large_inputs, tmp_path):
    """``add(%p, negate(negate(…(%p))))`` 100 000 levels deep is a valid module: nested
    operands are anonymous instructions. XLA's recursive parser overflows its stack on it
    (a segfault from about 3 000 levels on); hlo-shard reads it without recursion, so it
    accepts it, within the time and memory limits of the other large inputs, and prints
    it flat (``negate.anon``, ``negate.anon.1``, …), which XLA reads."""
    deep = large_inputs[VALID_BUT_DEEP]
    run, leftovers = _python_m_fmt(deep, tmp_path)
    assert not run.timed_out and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.returncode == 0, run.stderr[-2000:]
    printed = (tmp_path / "out" / "out.hlo").read_text()
    assert leftovers == ["out.hlo"]
    assert printed.count(" negate(") == hostile.DEPTH and "negate(negate(" not in printed


# ---------------------------------------------------------------- literal strictness

#: Literals XLA's parser refuses (or aborts on: bool for a float, a token constant):
#: values the element type cannot hold, nesting that is not the rank, wrong counts.
_LITERALS_XLA_REFUSES = [
    ("s8[]", "300"), ("u32[]", "-1"), ("s32[]", "1.5"), ("s32[]", "inf"), ("f16[]", "70000"),
    ("f32[]", "1e400"), ("f8e8m0fnu[]", "0"), ("f32[]", "true"), ("f32[1]", "{{1}}"),
    ("f32[2,2]", "{1, 2, 3, 4}"), ("f32[2,2]", "{ {1, 2, 3}, {4} }"), ("f32[]", "{1}"),
    ("f32[]", "(1, 2)"), ("f32[3]", "{1, 2}"), ("c64[]", "1"), ("pred[2]", "{true}"),
    ("f8e4m3fn[]", "nan(0x1)"), ("f16[]", "nan(0x400)"), ("f32[]", ".5"), ("token[]", "1"),
    ("f32[2,2]", "{{...}}"),
]


@pytest.mark.parametrize("shape,literal", _LITERALS_XLA_REFUSES)
def test_literals_xla_refuses_are_refused(shape, literal, tmp_path):
    _check_literal_refused(shape, literal, tmp_path)


def _check_literal_refused(shape: str, literal: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.hlo"
    bad.write_text(f"HloModule m\n\nENTRY %e () -> {shape} {{\n  ROOT %c = {shape} "
                   f"constant({literal})\n}}\n")
    result = _in_process(["fmt", str(bad)])
    assert result.exit_code == 2 and result.stderr.startswith(f"{bad}:4:"), result.stderr


# ------------------------------------------------------- truncations and byte flips

def _in_process(args: list[str]):
    from click.testing import CliRunner

    return CliRunner().invoke(main, args, catch_exceptions=True)


@pytest.fixture(scope="module")
def mutants(tmp_path_factory) -> list[tuple[Path, bool | None]]:
    """Truncated and byte-flipped real steps, each with XLA's verdict (None: XLA
    aborted; False for bytes that are not UTF-8, which hlo-shard always refuses)."""
    folder = tmp_path_factory.mktemp("mutants")
    real = REAL.read_bytes()
    variants = [t.encode() for t in hostile.truncations(real.decode())] + hostile.byte_flips(real)
    verdicts = [v.accepted for v in xla_parse([v.decode("utf-8", "replace") for v in variants])]
    assert len(variants) == MUTANT_COUNT
    mutants = []
    for index, (data, verdict) in enumerate(zip(variants, verdicts)):
        path = folder / f"mutant{index:02d}.hlo"
        path.write_bytes(data)
        utf8 = data.decode("utf-8", "replace").encode() == data
        mutants.append((path, verdict if utf8 else False))
    return mutants


#: Mutants (index into the ``mutants`` fixture) some command does not yet handle cleanly.
_KNOWN_MUTANT_BUGS: dict[int, str] = {}  # mutant 24 (to_apply → t0_apply) fixed: regression
MUTANT_COUNT = 48


@pytest.mark.parametrize("number", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_KNOWN_MUTANT_BUGS[n]))
    if n in _KNOWN_MUTANT_BUGS else n for n in range(MUTANT_COUNT)])
def test_mutant_fails_cleanly_in_every_command(number, mutants, tmp_path):
    """A mutant the front end refuses is refused by every command (exit 2, located, no
    output); one it accepts crashes no command (verify, which would compile it, aside)."""
    bad, _ = mutants[number]
    before = _digest(bad)
    refused = _in_process(["fmt", str(bad)]).exit_code == 2
    for template in _invocations():
        if not refused and template[0] == "verify":
            continue
        out_dir = tmp_path / template[0]
        out_dir.mkdir()
        args = _fill(template, bad, out_dir / "out.hlo")
        result = _in_process(args)
        what = f"`hlo-shard {' '.join(args)}`"
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            f"{what} raised {result.exception!r}"
        if refused:
            assert result.exit_code == 2, f"{what} exited {result.exit_code}"
            match = _ERROR_LINE.match(result.stderr.splitlines()[0])
            assert match and match.group("path") == str(bad), f"{what}: {result.stderr!r}"
            assert list(out_dir.iterdir()) == [], f"{what} left {list(out_dir.iterdir())}"
        else:
            assert result.exit_code in (0, 2), f"{what} exited {result.exit_code}"
    assert _digest(bad) == before


def test_truncations_are_refused(mutants):
    """Every truncation (XLA refuses them all) is refused by the front end."""
    count = len(hostile.truncations(REAL.read_text()))
    for bad, accepted in mutants[:count]:
        assert accepted is False
        assert _in_process(["fmt", str(bad)]).exit_code == 2, bad.name


def test_mutant_verdicts_agree_with_xla(mutants):
    """hlo-shard's front end refuses exactly the mutants XLA's parser refuses."""
    disagreements = []
    for bad, accepted in mutants:
        if accepted is None:
            continue
        result = _in_process(["fmt", str(bad)])
        if (result.exit_code == 0) != accepted:
            disagreements.append(f"{bad.name}: XLA {'accepts' if accepted else 'refuses'}, "
                                 f"hlo-shard {result.stderr.strip()[:200] or 'accepts'}")
    assert not disagreements, "\n".join(disagreements)


def test_truncation_points_are_spread_and_never_whole():
    text = REAL.read_text()
    cuts = hostile.truncations(text)
    assert len(cuts) >= 20 and "" in cuts
    assert all(len(c) < text.rstrip().rfind("}") for c in cuts)
    assert len({len(c) * 10 // len(text) for c in cuts}) >= 8  # spread over the text


def test_a_lost_exit_report_reads_the_status_the_child_wrote(monkeypatch, tmp_path):
    """multiprocessing reports 255 when it cannot read the forkserver's report of a
    child (seen once in CI: the right error printed, exit 255); the child's own status
    file gives the real one, and a child that ran is not run again."""
    real, runs = hostile._run_child, []

    def lost_report(*args, **kwargs):
        runs.append(real(*args, **kwargs))
        return 255

    monkeypatch.setattr(hostile, "_run_child", lost_report)
    run = run_cli(["optimize", str(tmp_path / "missing.hlo"), "-o", str(tmp_path / "o.hlo")])
    assert runs == [2] and run.returncode == 2
    assert "error" in run.stderr and not (tmp_path / "o.hlo").exists()


#: One-character slips in the real step that leave it parseable but no module XLA
#: compiles (line, what is replaced, by what): a broadcast of a scalar given a dimension,
#: an elementwise result one column wider than its operands. A pass must not read them
#: (a rewrite could even hide the slip: a gradient's shards come out right), and every
#: command that reads a module refuses them at the instruction, whatever the flags.
_INCONSISTENT = {"scalar_broadcast_dims": (151, "dimensions={}", "dimensions={0}"),
                 "elementwise_result_wider": (155, "f32[4,10]{1,0} multiply",
                                              "f32[4,11]{1,0} multiply")}


@pytest.mark.parametrize("name", sorted(_INCONSISTENT))
def test_shapes_that_disagree_are_refused_at_the_instruction(name, tmp_path):
    number, old, new = _INCONSISTENT[name]
    lines = REAL.read_text().splitlines(keepends=True)
    assert old in lines[number - 1]
    lines[number - 1] = lines[number - 1].replace(old, new, 1)
    bad = tmp_path / f"{name}.hlo"
    bad.write_text("".join(lines))
    forced = tmp_path / "forced"
    forced.mkdir()
    results = _run_all([t for t in _invocations() if t[0] not in ("fmt", "verify")], bad,
                       tmp_path, TIMEOUT_SMALL)
    results += _run_all([("optimize", "{in}", "-o", "{out}", "--state", "sharded",
                          "--force")], bad, forced, TIMEOUT_SMALL)
    for result in results:
        check_clean_failure(result, bad, located=True)
        assert f"{bad}:{number}:" in result[0].stderr, result[0].stderr
