"""Fidelity: XLA reads hlo-shard's output as the very module it reads from the input.

``xla(to_text(parse(T))).to_string() == xla(T).to_string()`` with jax's own parser
(``hlo_module_from_text``), for every fixture and every golden syntax case. XLA's
parser aborts the process on some inputs (CHECK failures), so the comparisons run
in one child process and each case reads its verdict from there.
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: ``tests/golden/legacy`` holds forms current XLA itself rejects (kept only as golden).
CASES = sorted(ROOT.glob("fixtures/**/*.hlo")) + sorted((ROOT / "tests" / "golden").glob("*.hlo"))


def fidelity_problem(path: Path) -> str | None:
    """None when XLA sees the same module in the input and in our output, else why."""
    from jax._src.lib import xla_client as xc

    from hlo_shard import parse, to_text

    text = path.read_text()
    expected = xc.hlo.hlo_module_from_text(text).to_string()
    ours = to_text(parse(text, str(path)))
    try:
        got = xc.hlo.hlo_module_from_text(ours).to_string()
    except Exception as err:  # noqa: BLE001 - any XLA rejection is the finding
        return f"XLA rejects our output: {str(err)[:2000]}"
    if got == expected:
        return None
    diff = difflib.unified_diff(expected.splitlines(), got.splitlines(), "xla(input)",
                                "xla(ours)", lineterm="", n=1)
    return "\n".join(list(diff)[:60])


@pytest.fixture(scope="session")
def verdicts() -> dict[str, str | None]:
    if not CASES:
        return {}
    run = subprocess.run([sys.executable, __file__, *map(str, CASES)], capture_output=True,
                         text=True, cwd=ROOT, timeout=900)
    results = dict(json.loads(line) for line in run.stdout.splitlines()
                   if line.startswith("["))
    if len(results) < len(CASES):
        results.setdefault("__crash__", f"exit {run.returncode}: {run.stderr[-3000:]}")
    return results


@pytest.mark.parametrize("path", CASES, ids=lambda p: str(p.relative_to(ROOT)))
def test_xla_reads_the_same_module(path: Path, verdicts):
    key = str(path)
    assert key in verdicts, f"XLA child process died before this case: {verdicts.get('__crash__')}"
    assert verdicts[key] is None, verdicts[key]


def main(paths: list[str]) -> None:
    """Child process: one JSON line ``[path, verdict]`` per case, flushed at once so
    that an abort keeps the verdicts so far."""
    sys.path.insert(0, str(ROOT))
    for path in paths:
        try:
            verdict = fidelity_problem(Path(path))
        except Exception as err:  # noqa: BLE001 - reported per case
            verdict = f"{type(err).__name__}: {err}"
        print(json.dumps([path, verdict]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
