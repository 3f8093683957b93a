"""``make bench`` part 7's gate row (``bench/llm_bench.py: gate_line``) on a small
module: the gate timed guided and exhaustive, both counts of cut-offs rewritten, and
whether both chose the same. No timing is asserted."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from llm_bench import gate_line  # noqa: E402


def test_the_gate_row_times_both_ways_and_compares_their_choice():
    line = gate_line(ROOT / "fixtures" / "spmd" / "transformer.n8.hlo")
    counts = re.findall(r"(guided|exhaustive) [\d.]+ s \((\d+) of (\d+) cut-offs rewritten\)",
                        line)
    assert [way for way, *_ in counts] == ["guided", "exhaustive"], line
    (_, guided, total), (_, exhaustive, total_too) = counts
    assert total == total_too == exhaustive == "7" and int(guided) <= 3, line
    assert line.endswith("same cut-off"), line
