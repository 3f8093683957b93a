"""Front-end throughput: hlo-shard parse / graph build / print next to XLA's C++ parser
and printer on the same files, with peak memory.

    python bench/parse_bench.py FILE.hlo [FILE.hlo ...]

Each side runs in its own child process, so the peak RSS of one is not the other's and
an XLA abort cannot take the benchmark down. Times are CPU seconds of the process
(``time.process_time``), best of a few runs: on a shared machine wall-clock times swing
by 2x from one run to the next, CPU times much less. ``run_parse_bench`` returns the rows
(one dict per file) for other scripts (``make bench``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


#: Parsed once before timing, so one-time set-up (grammar load, XLA init) is excluded.
_WARM_UP = "HloModule w\nENTRY e {\n  ROOT p = f32[] parameter(0)\n}\n"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _best(step, repeat: int) -> tuple[float, object]:
    """(least CPU seconds over ``repeat`` runs of ``step()``, its last result)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.process_time()
        result = step()
        best = min(best, time.process_time() - start)
    return best, result


def _repeats(path: str) -> int:
    return 3 if Path(path).stat().st_size < 20e6 else 1


def _measure_ours(path: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from hlo_shard import parse, to_text

    try:
        from hlo_shard.graph import dataflow_graph
    except ImportError:  # the graph module is optional for this benchmark
        dataflow_graph = None
    parse(_WARM_UP)
    text = Path(path).read_text(encoding="utf-8")
    repeat = _repeats(path)
    parse_s, module = _best(lambda: parse(text, path), repeat)
    graph_s = None
    if dataflow_graph is not None:
        graph_s, _ = _best(lambda: [dataflow_graph(c) for c in module.computations], repeat)
    print_s, _ = _best(lambda: to_text(module), repeat)
    return {"parse_s": parse_s, "graph_s": graph_s, "print_s": print_s,
            "peak_rss_mb": _peak_rss_mb()}


def _measure_xla(path: str) -> dict:
    from jax._src.lib import xla_client as xc

    xc.hlo.hlo_module_from_text(_WARM_UP)
    text = Path(path).read_text(encoding="utf-8")
    repeat = _repeats(path)
    parse_s, module = _best(lambda: xc.hlo.hlo_module_from_text(text), repeat)
    print_s, _ = _best(module.to_string, repeat)
    return {"parse_s": parse_s, "print_s": print_s, "peak_rss_mb": _peak_rss_mb()}


def _child(which: str, path: str) -> dict:
    run = subprocess.run([sys.executable, __file__, "--child", which, path],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{which} failed on {path}: {run.stderr[-2000:]}")
    return json.loads(run.stdout.splitlines()[-1])


def run_parse_bench(paths: list[str | Path]) -> list[dict]:
    """One row per file: size, MB/s of each step on both sides, ratio, peak RSS."""
    rows = []
    for path in map(str, paths):
        size_mb = Path(path).stat().st_size / 1e6
        ours, xla = _child("ours", path), _child("xla", path)
        ours_total = ours["parse_s"] + ours["print_s"]
        xla_total = xla["parse_s"] + xla["print_s"]
        rows.append({
            "file": path, "size_mb": size_mb,
            "parse_mb_s": size_mb / ours["parse_s"],
            "graph_mb_s": size_mb / ours["graph_s"] if ours["graph_s"] else None,
            "print_mb_s": size_mb / ours["print_s"],
            "xla_parse_mb_s": size_mb / xla["parse_s"],
            "xla_print_mb_s": size_mb / xla["print_s"],
            "parse_print_s": ours_total, "xla_parse_print_s": xla_total,
            "ratio": ours_total / xla_total,
            "peak_rss_mb": ours["peak_rss_mb"], "xla_peak_rss_mb": xla["peak_rss_mb"],
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    header = (f"{'file':40} {'MB':>7} {'parse':>8} {'graph':>8} {'print':>8} "
              f"{'xla parse':>10} {'xla print':>10} {'ratio':>6} {'RSS MB':>8} {'xla RSS':>8}")
    lines = [header, "(MB/s of CPU time, best of 3 below 20 MB; ratio = hlo-shard parse+print "
                     "time / XLA's)"]
    for r in rows:
        graph = f"{r['graph_mb_s']:8.2f}" if r["graph_mb_s"] else f"{'-':>8}"
        lines.append(f"{Path(r['file']).name[-40:]:40} {r['size_mb']:7.2f} {r['parse_mb_s']:8.2f} "
                     f"{graph} {r['print_mb_s']:8.2f} {r['xla_parse_mb_s']:10.2f} "
                     f"{r['xla_print_mb_s']:10.2f} {r['ratio']:5.1f}x "
                     f"{r['peak_rss_mb']:8.0f} {r['xla_peak_rss_mb']:8.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--child", choices=("ours", "xla"), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if args.child:
        measure = _measure_ours if args.child == "ours" else _measure_xla
        print(json.dumps(measure(args.paths[0])))
        return
    rows = run_parse_bench(args.paths)
    print(json.dumps(rows, indent=1) if args.json else format_rows(rows))


if __name__ == "__main__":
    main()
