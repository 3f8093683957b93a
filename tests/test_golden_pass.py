"""Golden before/after text of the passes, in the style of xDSL's filecheck tests.

Each ``tests/golden_pass/NAME.hlo`` opens with ``// RUN: <pipeline>`` (the syntax of
:func:`hlo_shard.passes.registry.parse_pipeline`); the module after that pipeline (each
pass validated, the output parsed back) must print exactly as ``NAME.expected``. After a
deliberate change to a pass, regenerate and review the diff:

    HLO_SHARD_REGENERATE_GOLDEN=1 python -m pytest tests/test_golden_pass.py
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path

import pytest

from hlo_shard.parser import parse
from hlo_shard.passes.pipeline import Pipeline, validate_printed
from hlo_shard.passes.registry import parse_pipeline
from hlo_shard.printer import to_text

CASES = sorted((Path(__file__).parent / "golden_pass").glob("*.hlo"))
REGENERATE = os.environ.get("HLO_SHARD_REGENERATE_GOLDEN") == "1"


def run_case(path: Path) -> str:
    text = path.read_text()
    first = text.splitlines()[0]
    assert first.startswith("// RUN: "), f"{path.name}: first line must be // RUN: <pipeline>"
    passes = parse_pipeline(first.removeprefix("// RUN: "))
    result = Pipeline(passes, check=validate_printed).run(parse(text, path=str(path)))
    return to_text(result.module)


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_pass_output_is_the_golden_text(path: Path):
    check_golden(path)


def check_golden(path: Path) -> None:
    expected_path = path.with_suffix(".expected")
    actual = run_case(path)
    if REGENERATE or not expected_path.exists():
        expected_path.write_text(actual)
        if not REGENERATE:
            pytest.fail(f"wrote {expected_path.name}: review it and commit it")
    expected = expected_path.read_text()
    if actual != expected:
        diff = "\n".join(difflib.unified_diff(expected.splitlines(), actual.splitlines(),
                                              expected_path.name, "actual", lineterm=""))
        pytest.fail(f"{path.name}: output differs from {expected_path.name} (set "
                    f"HLO_SHARD_REGENERATE_GOLDEN=1 to accept):\n{diff}")


def test_there_are_golden_cases():
    assert len(CASES) >= 4


def test_a_different_output_fails_with_a_diff(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REGENERATE", False)
    case = tmp_path / "sgd.hlo"
    case.write_text(CASES[0].read_text())
    expected = CASES[0].with_suffix(".expected").read_text()
    case.with_suffix(".expected").write_text(expected.replace("reduce-scatter", "all-reduce", 1))
    with pytest.raises(pytest.fail.Exception, match=r"(?s)differs from sgd.expected.*"
                                                    r"-.*all-reduce.*\+.*reduce-scatter"):
        check_golden(case)
