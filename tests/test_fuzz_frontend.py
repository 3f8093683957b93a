"""Front-end property tests on generated modules (:mod:`hlo_shard.fuzz.frontend`).

For every seed the generator writes a module that uses the text format's shape, literal
and attribute forms in one of the spellings printers differ in. Properties:

* XLA's parser accepts it (a module it refuses is a generator bug);
* fidelity: ``xla(to_text(parse(T))).to_string() == xla(T).to_string()``;
* printing is idempotent: ``to_text(parse(to_text(parse(T)))) == to_text(parse(T))``.
"""

from __future__ import annotations

import re

import pytest

from hlo_shard.fuzz.frontend import ARRAY_TYPES, random_module
from hlo_shard.parser import parse
from hlo_shard.printer import to_text
from test_fuzz_xla import xla_parse

SEEDS = range(160)


class Case:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.text = random_module(seed)
        try:
            self.printed = to_text(parse(self.text))
            self.error = None
        except Exception as err:  # reported by the tests below, with the seed
            self.printed, self.error = None, f"{type(err).__name__}: {err}"


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    cases = [Case(seed) for seed in SEEDS]
    texts = [c.text for c in cases] + [c.printed or "" for c in cases]
    verdicts = xla_parse(texts)
    for case, original, printed in zip(cases, verdicts, verdicts[len(cases):]):
        case.xla, case.xla_printed = original, printed
    return cases


def test_xla_accepts_every_generated_module(cases):
    refused = [f"seed {c.seed}: {c.xla.status}: {c.xla.text[:300]}" for c in cases
               if c.xla.status != "ok"]
    assert not refused, "generator bug, XLA refuses:\n" + "\n".join(refused)


def test_front_end_reads_every_generated_module(cases):
    failed = [f"seed {c.seed}: {c.error}" for c in cases if c.error]
    assert not failed, "\n".join(failed)


def _without_elided_values(xla_text: str, elided: set[str]) -> str:
    """XLA fills a constant read as ``{...}`` with arbitrary values (not the same on each
    read): put the elision back for the constants the generated text elided."""
    lines = xla_text.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*? constant\(", line)
        if match and match.group(1) in elided:
            depth, end = 1, match.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(line[end], 0)
                end += 1
            lines[i] = line[:match.end()] + "{...})" + line[end:]
    return "\n".join(lines)


def test_round_trip_keeps_the_module_xla_reads(cases):
    """xla(to_text(parse(T))) prints exactly as xla(T) does."""
    different = []
    for c in cases:
        if c.error or c.xla.status != "ok":
            continue
        elided = {i.name for comp in parse(c.text).computations for i in comp.instructions
                  if i.is_elided_constant}
        expected = _without_elided_values(c.xla.text, elided)
        if c.xla_printed.status != "ok":
            different.append(f"seed {c.seed}: XLA refuses hlo-shard's output: "
                             f"{c.xla_printed.text[:300]}")
        elif _without_elided_values(c.xla_printed.text, elided) != expected:
            lines = [f"  {a!r}\n  {b!r}" for a, b in zip(
                expected.splitlines(), _without_elided_values(c.xla_printed.text, elided).splitlines())
                if a != b]
            different.append(f"seed {c.seed}: first difference:\n" + (lines[0] if lines else
                                                                     "  (line count differs)"))
    assert not different, "\n".join(different)


def test_printing_is_idempotent(cases):
    changed = [c.seed for c in cases if c.printed and to_text(parse(c.printed)) != c.printed]
    assert not changed, f"printing parse(printed) changes the text for seeds {changed}"


#: Forms the generated modules must exercise between them (name → pattern).
FORMS = {
    **{f"element type {t}": re.escape(f"{t}[") for t in ARRAY_TYPES},
    "token": r"token\[\]", "opaque": r"opaque\[\]",
    "nested tuple shape": r"\(\([a-z]", "empty tuple shape": r"\(\)[,) ]",
    "tiled layout": r":T\(", "memory space": r"S\(\d\)", "element size": r"E\(4\)",
    "bounded dynamic dim": r"\[<=\d", "unbounded dynamic dim": r"[\[,]\?[\],]",
    "nested array literal": r"constant\(\{ \{", "NaN payload": r"nan\(0x",
    "negative NaN": r"-nan", "infinity": r"[(, ]-?inf[,)} ]", "bool literal": r"constant\(true\)",
    "complex literal": r"c(64|128)\[[\d,]*\] constant\(\{?\(", "tuple literal": r"constant\(\(",
    "elided literal": r"constant\(\{\.\.\.\}\)",
    "explicit replica groups": r"replica_groups=\{\{", "iota replica groups": r"replica_groups=\[\d+,\d+\]<=",
    "transposed iota groups": r"<=\[\d+,\d+\]T\(1,0\)", "mesh replica groups": r"replica_groups=mesh\[",
    "mesh device_ids": r"device_ids=\(", "mesh sub-axis": r"':\(2\)", "empty replica groups": r"replica_groups=\{\}",
    "replicated sharding": r"sharding=\{replicated", "maximal sharding": r"maximal device=",
    "tiled sharding": r"sharding=\{devices=\[", "iota tile assignment": r"devices=\[[\d,]+\]<=\[",
    "last tile replicated": r"last_tile_dim", "manual sharding": r"\{manual\}",
    "metadata": r"metadata=\{op_", "metadata escapes": r"\\'dp\\'", "source line": r"source_line=\d",
    "backend_config blob": r"backend_config=\{\"", "backend_config string": r"backend_config=\"",
    "frontend_attributes": r"frontend_attributes=\{", "statistics": r"statistics=\{",
    "control-predecessors": r"control-predecessors=\{", "slice with stride": r"slice=\{\[\d+:\d+:\d+\]",
    "padding with interior": r"padding=-?\d+_-?\d+_\d", "window": r"window=\{size=",
    "dim labels": r"dim_labels=b01f_01io->b01f", "dot dims": r"lhs_batch_dims=\{0\}",
    "gather dims": r"offset_dims=", "scatter dims": r"update_window_dims=",
    "async collective": r"all-reduce-start\(", "collective-permute": r"source_target_pairs=",
    "while": r" while\(", "conditional": r"branch_computations=|true_computation=",
    "fusion": r"kind=k(Loop|Input|Output)", "custom-call": r"custom_call_target=",
    "block comment": r"/\*", "line comment": r"// ", "index comment": r"/\*index=5\*/",
    "names without %": r"\n  [A-Za-z_][\w.\-]* = ", "operand shapes": r"\([a-z0-9]+\[[\d,]*\] %?[A-Za-z_]",
    "short form": r"\nENTRY [%\w.]+ \{", "no header": r"^ENTRY |^[a-z_]\w* \{",
    "one line": r"\} ENTRY ", "nested operand": r", [a-z0-9]+\[[\d,]*\] negate\(",
    "implicit ROOT": r"\n  [%\w.\-]+ = [^\n]*\n\}",
}


def test_generator_covers_every_form():
    texts = [random_module(seed) for seed in SEEDS]
    missing = [name for name, pattern in FORMS.items()
               if not any(re.search(pattern, text) for text in texts)]
    assert not missing, f"no generated module has: {missing}"


def test_generator_is_deterministic():
    assert random_module(12345) == random_module(12345)
    assert random_module(1) != random_module(2)
