"""Behaviour unchanged: every fixture's ``optimize`` output (both ``--state`` modes),
replica form, ``report --json`` and retargeted module hash to the committed table
(``scripts/check_optimize_identical.py``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_optimize_identical.py"


def _script():
    spec = importlib.util.spec_from_file_location("check_optimize_identical", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_fixture_output_matches_the_committed_hashes():
    check = _script()
    expected = json.loads(check.TABLE.read_text())
    assert check.differences(check.compute(), expected) == []


def test_the_check_can_fail():
    """A changed, a missing and an extra hash are each reported."""
    check = _script()
    actual = {"a": "1", "b": "2", "c": "3"}
    assert check.differences(actual, {"a": "1", "b": "x", "d": "4"}) == [
        "b: output changed", "c: not in the table (run with --update if the fixture is new)",
        "d: in the table but no such fixture"]


def test_one_fixture_matches_its_hash():
    """The quick version of the slow sweep (one small fixture, all variants)."""
    check = _script()
    actual = check.compute("spmd/sgd.n2.hlo")
    expected = json.loads(check.TABLE.read_text())
    assert len(actual) == 5
    assert check.differences(actual, {k: expected[k] for k in actual}) == []
