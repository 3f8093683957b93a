"""Prove a refactor changed nothing: the sha256 of every fixture's output, compared with
a committed table.

For every ``fixtures/*/*.hlo`` this runs ``optimize --force`` (default options otherwise:
the pass, then the print / parse-back / validate check) in both ``--state`` modes, the
runtime's replica form (what ``verify`` executes) on the executable forms, and
``hlo-shard report --json`` (the cost model's figures) and the module retargeted to 16
replicas (what ``scale`` re-runs the pass on; a refusal's message is hashed instead), and
compares the sha256 of each output text with ``tests/data/optimize_hashes.json``.

    python scripts/check_optimize_identical.py            # compare; exit 1 on a difference
    python scripts/check_optimize_identical.py --update   # rewrite the table (say why in the commit)
    python scripts/check_optimize_identical.py FILTER     # only fixtures whose key contains FILTER

No jax is imported; the whole table takes about a minute on one core
(``optimize`` alone: ``... check_optimize_identical.py optimize``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hlo_shard import optimize  # noqa: E402
from hlo_shard.parser import parse  # noqa: E402
from hlo_shard.passes.weight_update import ShardingOptions  # noqa: E402
from hlo_shard.printer import to_text  # noqa: E402
from hlo_shard.runtime.forms import replica_form  # noqa: E402

FIXTURES = ROOT / "fixtures"
TABLE = ROOT / "tests" / "data" / "optimize_hashes.json"
#: Fixture folders the runtime executes (and so turns into replica form).
EXECUTABLE_FORMS = ("spmd", "replica")


def _optimized(state: str) -> Callable[[str, str], str]:
    """The transformation itself (``--force``): the speed gate would keep most small
    fixtures whole and leave the pass's output unhashed."""
    def run(text: str, path: str) -> str:
        return optimize(parse(text, path=path), ShardingOptions(state=state),
                        force=True).text
    return run


def _replica_form(text: str, path: str) -> str:
    return to_text(replica_form(parse(text, path=path)))


def _report_json(text: str, path: str) -> str:
    """What ``hlo-shard report IN.hlo --json --fixtures-manifest fixtures/MANIFEST.json`` prints
    (the fixtures' parameter roles from their manifest; through the command, so the cost
    model's modules may move without this script changing)."""
    from click.testing import CliRunner

    from hlo_shard.cli import main as cli

    # From the checkout's root with a relative path: the report names its input.
    previous = os.getcwd()
    os.chdir(ROOT)
    try:
        result = CliRunner().invoke(cli, ["report", os.path.relpath(path, ROOT), "--json",
                                          "--fixtures-manifest", "fixtures/MANIFEST.json"])
    finally:
        os.chdir(previous)
    if result.exit_code != 0:
        raise RuntimeError(f"report {path} failed: {result.output}")
    return result.stdout


def _retargeted(text: str, path: str) -> str:
    from hlo_shard.errors import HloShardError
    from hlo_shard.scaling import retarget

    try:
        return to_text(retarget(parse(text, path=path), 16))
    except HloShardError as err:
        return f"refused: {err}"


#: Variant name → (which fixture folders, text → output text).
VARIANTS: dict[str, tuple[tuple[str, ...] | None, Callable[[str, str], str]]] = {
    "optimize --state gathered": (None, _optimized("gathered")),
    "optimize --state sharded": (None, _optimized("sharded")),
    "replica_form": (EXECUTABLE_FORMS, _replica_form),
    "report --json": (None, _report_json),
    "retarget 16": (None, _retargeted),
}


def cases(pattern: str = "") -> Iterator[tuple[str, Path, Callable[[str, str], str]]]:
    """(table key, fixture, output function) for every fixture and variant."""
    for path in sorted(FIXTURES.glob("*/*.hlo")):
        for variant, (folders, run) in VARIANTS.items():
            key = f"{path.parent.name}/{path.name} {variant}"
            if (folders is None or path.parent.name in folders) and pattern in key:
                yield key, path, run


def digest(path: Path, run: Callable[[str, str], str]) -> str:
    return hashlib.sha256(run(path.read_text(), str(path)).encode()).hexdigest()


def compute(pattern: str = "") -> dict[str, str]:
    return {key: digest(path, run) for key, path, run in cases(pattern)}


def differences(actual: dict[str, str], expected: dict[str, str]) -> list[str]:
    """One line per key whose hash differs or that only one side has."""
    lines = []
    for key in sorted(actual.keys() | expected.keys()):
        if key not in expected:
            lines.append(f"{key}: not in the table (run with --update if the fixture is new)")
        elif key not in actual:
            lines.append(f"{key}: in the table but no such fixture")
        elif actual[key] != expected[key]:
            lines.append(f"{key}: output changed")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("filter", nargs="?", default="", help="only keys containing this")
    parser.add_argument("--update", action="store_true", help="rewrite the table")
    args = parser.parse_args(argv)
    actual = compute(args.filter)
    expected = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    if args.update:
        table = {k: v for k, v in expected.items() if args.filter not in k} | actual
        TABLE.parent.mkdir(parents=True, exist_ok=True)
        TABLE.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
        print(f"wrote {len(actual)} hashes to {TABLE.relative_to(ROOT)}")
        return 0
    if args.filter:
        expected = {k: v for k, v in expected.items() if args.filter in k}
    problems = differences(actual, expected)
    for line in problems:
        print(line)
    print(f"{len(actual) - len(problems)} of {len(actual)} outputs identical")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
