"""Benchmark modules: generated on demand into a git-ignored folder, never committed.

    from bench_models import generate_bench_modules   # with scripts/ on sys.path
    paths = generate_bench_modules(Path("bench/out"))

Keys of the returned dict (all N = 8, SPMD = per-device partitioner output):

* `transformer_deep.spmd`, `transformer_deep.optimized`: a 38-layer transformer training step
  (~4 MB SPMD, ~45 MB optimized) for parser / printer throughput;
* `mlp_adam.spmd`, `mlp_sgd.spmd`: issue 4's update-heavy model (4 layers of 1024x1024,
  2 examples per device) with Adam and with SGD;
* `transformer_scale.spmd`: issue 5's transformer for the scaling projection;
* `transformer_wide.spmd`: the same with Transformer-big widths (d_model 1024, 67 M
  parameters), the README's projection to the paper's setting (`scale --parameters`);
* `<model>.signature`: JSON with the role (weight / optimizer_state / batch), name, per-device
  shape and dtype of every entry parameter and output of that model.

Files already present are reused (delete them to regenerate). The deep transformer takes
about 3 minutes and ~5 GB of memory to dump; the others a few seconds each.
"""

from __future__ import annotations

import argparse
import fcntl
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hlo_dump import SIGNATURE, dump_model  # noqa: E402

NUM_DEVICES = 8
BENCH_FORMS = {  # model -> forms kept
    "transformer_deep": ("spmd", "optimized"),
    "mlp_adam": ("spmd",),
    "mlp_sgd": ("spmd",),
    "transformer_scale": ("spmd",),
    "transformer_wide": ("spmd",),
}


def _targets(out_dir: Path, model: str) -> dict[str, Path]:
    stem = f"{model}.n{NUM_DEVICES}"
    paths = {f"{model}.{form}": out_dir / f"{stem}.{form}.hlo" for form in BENCH_FORMS[model]}
    paths[f"{model}.signature"] = out_dir / f"{stem}.signature.json"
    return paths


def generate_bench_modules(out_dir: Path, models: tuple[str, ...] = tuple(BENCH_FORMS)
                           ) -> dict[str, Path]:
    """Dump (or reuse) the benchmark modules of ``models`` under out_dir; return key -> path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Concurrent callers (two benchmark runs) wait here instead of dumping the same model
    # twice: the deep transformer alone needs ~5 GB while XLA optimizes it.
    with (out_dir / ".generate.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _generate(out_dir, models)


def _generate(out_dir: Path, models: tuple[str, ...]) -> dict[str, Path]:
    result: dict[str, Path] = {}
    for model in models:
        forms = BENCH_FORMS[model]
        targets = _targets(out_dir, model)
        if not all(p.is_file() and p.stat().st_size for p in targets.values()):
            work = Path(tempfile.mkdtemp(prefix=f"hlo-shard-bench-{model}-"))
            # Only the HLO is needed: stop before XLA's LLVM code generation.
            dump = dump_model(model, NUM_DEVICES, work, timeout_s=1800,
                              stop_after_hlo="optimized" in forms)
            sources = {"spmd": dump.spmd, "optimized": dump.optimized}
            for form in forms:
                _publish(sources[form], targets[f"{model}.{form}"])
            _publish(work / SIGNATURE, targets[f"{model}.signature"])
            shutil.rmtree(work)
        result |= targets
    return result


def _publish(source: Path, target: Path) -> None:
    """Copy then rename, so an interrupted run never leaves a truncated cached file."""
    partial = target.with_name(target.name + ".partial")
    shutil.copyfile(source, partial)
    partial.replace(target)


def main() -> None:
    parser = argparse.ArgumentParser(description="Dump (or reuse) the benchmark modules.")
    parser.add_argument("out_dir", nargs="?", type=Path, default=Path("bench/out"),
                        help="folder for the modules (default: bench/out)")
    parser.add_argument("--models", nargs="+", choices=sorted(BENCH_FORMS),
                        default=list(BENCH_FORMS), help="only these models (default: all)")
    args = parser.parse_args()
    for key, path in generate_bench_modules(args.out_dir, tuple(args.models)).items():
        print(f"{key:28s} {path.stat().st_size:>10d}  {path}")


if __name__ == "__main__":
    main()
