"""``python -m hlo_shard.fuzz --cases N --seed S --out DIR``: differential fuzzing of
``hlo-shard optimize`` (what ``make fuzz`` runs). Exit status 0 when every case
matched, 1 when any failed (reproducers in DIR), 2 on bad arguments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hlo_shard.fuzz.driver import VARIANTS, Identity, Transformation, default_transformation, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlo_shard.fuzz", description=__doc__)
    parser.add_argument("--cases", type=int, default=200, help="number of cases (seeds)")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--out", type=Path, default=Path("fuzz-out"),
                        help="folder for minimal reproducers of failures")
    parser.add_argument("--transform", choices=("auto", "optimize", "identity"), default="auto",
                        help="auto: optimize when the command exists, else the identity (fmt)")
    parser.add_argument("--shrink-budget", type=int, default=60,
                        help="most optimize+verify runs spent shrinking one failure")
    parser.add_argument("--quiet", action="store_true", help="only the summary")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error("--cases must be at least 1")
    transform = {"auto": default_transformation, "optimize": Transformation,
                 "identity": Identity}[args.transform]()
    log = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))
    print(f"fuzzing {args.cases} cases from seed {args.seed} with {transform.name} "
          f"({len(VARIANTS)} variants each)", flush=True)
    summary = run(args.cases, args.seed, args.out, transform, shrink_budget=args.shrink_budget,
                  log=log)
    print("\n".join(summary.lines(transform)))
    for seed, variant, outcome, folder in summary.failures:
        print(f"FAILED seed {seed} {variant}: {outcome.kind}" + (f" -> {folder}" if folder else ""))
    return 1 if summary.failures or summary.invalid else 0


if __name__ == "__main__":
    sys.exit(main())
