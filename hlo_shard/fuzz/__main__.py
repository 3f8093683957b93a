"""``python -m hlo_shard.fuzz --cases N --seed S --out DIR``: differential fuzzing of
``hlo-shard optimize`` (what ``make fuzz`` runs). Exit status 0 when every case
matched, 1 when any failed (minimal reproducers in DIR), 2 on bad arguments."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hlo_shard.fuzz.driver import VARIANTS, run
from hlo_shard.fuzz.steps import FULL, SMALL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlo_shard.fuzz", description=__doc__)
    parser.add_argument("--cases", type=int, default=200, help="number of cases (seeds)")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--out", type=Path, default=Path("fuzz-out"),
                        help="folder for the minimal reproducers of failures")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes, each with its own execution worker")
    parser.add_argument("--transform", choices=("auto", "optimize", "identity"), default="auto",
                        help="auto: optimize when the command exists, else the identity (fmt)")
    parser.add_argument("--small", action="store_true",
                        help="the small cases of the make-test subset")
    parser.add_argument("--variants-per-case", type=int, default=None, metavar="K",
                        help=f"K of the {len(VARIANTS)} state x strategy variants per case, "
                             "rotating (default: all)")
    parser.add_argument("--shrink-budget", type=int, default=60,
                        help="most optimize+verify runs spent shrinking one failure")
    parser.add_argument("--quiet", action="store_true", help="only the summary")
    args = parser.parse_args(argv)
    if args.cases < 1 or args.jobs < 1:
        parser.error("--cases and --jobs must be at least 1")
    print(f"fuzzing {args.cases} cases from seed {args.seed} in {args.jobs} process(es)",
          flush=True)
    summary = run(args.cases, args.seed, args.jobs, out_dir=args.out, transform=args.transform,
                  size=SMALL if args.small else FULL, variants_per_case=args.variants_per_case,
                  shrink_budget=args.shrink_budget, verbose=not args.quiet)
    print("\n".join(summary.lines()))
    for seed, variant, outcome, folder in summary.failures:
        print(f"FAILED seed {seed} {variant}: {outcome.kind}" + (f" -> {folder}" if folder else ""))
    return 1 if summary.failures or summary.invalid else 0


if __name__ == "__main__":
    sys.exit(main())
