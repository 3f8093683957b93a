"""Record XLA's own memory figures for the optimized fixtures in `MANIFEST.json`.

    python3 scripts/fixture_memory.py [--fixtures fixtures] [--only NAME[,NAME]]

XLA refuses to compile its own optimized CPU dumps again (executing-hlo-with-jax.md §7.7),
so their `CompiledMemoryStats` cannot be had from the files. But each
`optimized/<model>.n4.hlo` is XLA's output for one jitted step of `fixture_models`: this
script compiles that same step again, in a child with the dump flags of `hlo_dump.py`
(same N, same SPMD partition form, same donation), checks that XLA's optimized module is
the fixture's up to metadata (same program, so the same buffer assignment), and stores
`compiled.memory_analysis()` under the fixture's manifest entry as

    "memory": {"argument": …, "output": …, "alias": …, "temp": …, "peak": …}

(bytes per device). No `.hlo` file is written. `make_fixtures.py` calls `record` for the
optimized fixtures it generates.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hlo_dump import OPTIMIZED_SUFFIX, xla_flags  # noqa: E402

#: CompiledMemoryStats attribute → manifest key.
STATS = {"argument_size_in_bytes": "argument", "output_size_in_bytes": "output",
         "alias_size_in_bytes": "alias", "temp_size_in_bytes": "temp",
         "peak_memory_in_bytes": "peak"}
_METADATA = re.compile(r", metadata=\{[^{}]*\}")
_COMPUTATION = re.compile(r"^(ENTRY )?%")


def program_text(hlo: str) -> str:
    """The module's computations without metadata: what is compared, since the stack
    frames name this script instead of `hlo_dump.py`."""
    lines = hlo.splitlines()
    start = next(i for i, line in enumerate(lines) if _COMPUTATION.match(line))
    return "\n".join(_METADATA.sub("", line) for line in lines[start:])


def measure(model: str, num_devices: int) -> tuple[dict, str]:
    """Compile the step in a child; (memory figures, XLA's optimized module text)."""
    with tempfile.TemporaryDirectory(prefix="hlo-shard-memory-") as work:
        dump = Path(work)
        env = dict(os.environ, XLA_FLAGS=xla_flags(num_devices, dump), JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                               model, str(num_devices)], env=env, capture_output=True,
                              text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {model} at N={num_devices} failed:\n"
                               f"{proc.stderr[-3000:]}")
        found = [p for p in dump.iterdir() if p.name.endswith(OPTIMIZED_SUFFIX)]
        if len(found) != 1:
            raise RuntimeError(f"expected one *{OPTIMIZED_SUFFIX}, found {len(found)}")
        return json.loads(proc.stdout.splitlines()[-1]), found[0].read_text()


def record(fixture: Path, entry: dict) -> None:
    """Add the `memory` figures to one optimized fixture's manifest entry (in place),
    after checking the recompiled program is the fixture's."""
    memory, optimized = measure(entry["model"], entry["num_devices"])
    if program_text(optimized) != program_text(fixture.read_text()):
        raise RuntimeError(f"{fixture}: recompiling {entry['model']} gives another program "
                           "than the fixture; regenerate the fixtures first")
    entry["memory"] = memory


def child(model: str, num_devices: int) -> None:
    from fixture_models import ALL_MODELS
    from hlo_dump import build

    compile_step, _ = build(ALL_MODELS[model], num_devices)
    stats = compile_step().memory_analysis()
    print(json.dumps({key: int(getattr(stats, attribute)) for attribute, key in STATS.items()}))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        child(argv[1], int(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixtures", type=Path, default=Path("fixtures"))
    parser.add_argument("--only", default="", help="comma-separated model names")
    args = parser.parse_args(argv)
    from make_fixtures import MANIFEST, manifest_text

    path = args.fixtures / MANIFEST
    manifest = json.loads(path.read_text())
    only = {m for m in args.only.split(",") if m}
    for name, entry in sorted(manifest.items()):
        if entry["form"] == "optimized" and (not only or entry["model"] in only):
            record(args.fixtures / name, entry)
            print(f"{name}: {entry['memory']}")
            path.write_text(manifest_text(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
