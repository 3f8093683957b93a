"""Generate hlo-shard's HLO fixtures from real JAX data-parallel training steps.

    python3 scripts/make_fixtures.py --out fixtures [--devices 2,4,8] [--only NAME[,NAME]]

For every model in `fixture_models.FIXTURE_MODELS` and every N in --devices, one child
process (`hlo_dump.py`) compiles the step on N forced CPU devices with XLA's dump flags, and
this script keeps:

* `spmd/<model>.n<N>.hlo`: the per-device module at the end of the SPMD partitioner
  (`*.spmd-partitioner.after_call-inliner.before_pipeline-end.txt`), for N = 2, 4, 8;
* `optimized/<model>.n4.hlo`: the CPU-optimized module (`*.cpu_after_optimizations.txt`),
  with XLA's `CompiledMemoryStats` of it in the manifest (`fixture_memory.record`);
* `replica/<model>.n<N>.hlo` for the models in `REPLICA_FIXTURES`: the classic replica form
  (`replica_form.spmd_to_replica`), compiled and run on N devices and checked bit-identical to
  the SPMD module run in replica form (executing-hlo-with-jax.md §5.2);
* `spmd/<model>.n8.hlo` for `fixture_models.LARGE_MODELS` (issue 4's update-heavy MLP with
  Adam and SGD, issue 5's scaling transformer) when under `LARGE_MODEL_MAX_BYTES`;
* `MANIFEST.json`: per file the model, optimizer, form, N, the role of every entry parameter
  and output (weight / optimizer_state / batch / loss), versions and the command.

Without --only and with all device counts, the fixture folders are emptied first, so the
manifest and the files always match. Dumps use --xla_dump_large_constants: no `{...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixture_memory import record as record_memory  # noqa: E402
from fixture_models import FIXTURE_MODELS, LARGE_MODELS  # noqa: E402
from hlo_dump import Dump, dump_model  # noqa: E402
from replica_form import spmd_to_replica  # noqa: E402

ALL_DEVICE_COUNTS = (2, 4, 8)
OPTIMIZED_AT = 4
LARGE_MODEL_MAX_BYTES = 1 << 20
FORMS = ("spmd", "optimized", "replica")
MANIFEST = "MANIFEST.json"
WORKERS = 2


@dataclass(frozen=True)
class ReplicaFixture:
    """Which SPMD fixture gets a replica-form twin, and in which classic spelling."""

    model: str
    num_devices: int
    parameter_replication: bool = False  # weights/state {true}, batch {false}
    all_replicas_as_empty: bool = False  # mesh groups -> `replica_groups={}`


REPLICA_FIXTURES = [
    ReplicaFixture("sgd", 4),
    ReplicaFixture("adam", 4, parameter_replication=True),
    ReplicaFixture("momentum", 4, parameter_replication=True, all_replicas_as_empty=True),
    ReplicaFixture("loop_adam", 2),
    ReplicaFixture("transformer", 8, parameter_replication=True),
]

REPLICA_STEPS = [
    "header: num_partitions=N -> replica_count=N; allow_spmd_sharding_propagation_* dropped",
    "every sharding={...} attribute dropped (brace-balanced)",
    "partition-id() -> replica-id()",
    "collectives with use_global_device_ids=true: channel_id and the flag dropped "
    "(groups already list replica ids)",
]


def command(model: str, num_devices: int) -> str:
    return f"python3 scripts/make_fixtures.py --out fixtures --only {model} --devices {num_devices}"


def check_against_xla(text: str, signature: dict, where: str) -> None:
    """XLA parses the module and its entry signature is the one the child recorded."""
    from jax._src.lib import xla_client as xc

    module = xc.hlo.hlo_module_from_text(text)
    shapes = xc.XlaComputation(module.as_serialized_hlo_module_proto()).program_shape()
    got = [list(s.dimensions()) for s in shapes.parameter_shapes()]
    want = [leaf["shape"] for leaf in signature["parameters"]]
    if got != want:
        raise RuntimeError(f"{where}: entry parameters {got} do not match the signature {want}")


def manifest_entry(signature: dict, form: str, num_devices: int, path: Path, **extra) -> dict:
    params = signature["parameters"]
    by_role = {role: [i for i, p in enumerate(params) if p["role"] == role]
               for role in ("weight", "optimizer_state", "batch", "rng")}
    keys = ("model", "optimizer", "style", "donated", "loop_steps", "compute_dtype", "notes",
            "jax_version", "optax_version")
    return {**{k: signature[k] for k in keys}, "form": form, "num_devices": num_devices,
            "bytes": path.stat().st_size,
            "weight_params": by_role["weight"], "optimizer_state_params": by_role["optimizer_state"],
            "batch_params": by_role["batch"], "rng_params": by_role["rng"],
            "parameters": [{"index": i, **p} for i, p in enumerate(params)],
            "outputs": [{"index": i, **o} for i, o in enumerate(signature["outputs"])],
            "command": command(signature["model"], num_devices), **extra}


def verify_replica(replica: Path, spmd: Path, signature_file: Path, num_devices: int) -> None:
    """Compile and run both forms in a child (XLA aborts kill processes); raise on mismatch."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("replica_form.py")),
                           "verify", str(replica), str(spmd), str(signature_file),
                           str(num_devices)], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"replica form {replica} does not match {spmd}:\n{proc.stderr[-3000:]}")


def write(out: Path, relative: str, text: str) -> Path:
    path = out / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def fixtures_for(model: str, num_devices: int, out: Path, work: Path) -> dict[str, dict]:
    """Dump one (model, N) and write its fixture files; return their manifest entries."""
    dump: Dump = dump_model(model, num_devices, work / f"{model}.n{num_devices}")
    signature = dump.signature
    name = f"{model}.n{num_devices}.hlo"
    spmd_text = dump.spmd.read_text()
    check_against_xla(spmd_text, signature, str(dump.spmd))
    if model in LARGE_MODELS and len(spmd_text) > LARGE_MODEL_MAX_BYTES:
        print(f"  {model}: SPMD form is {len(spmd_text)} bytes, kept generated-only")
        return {}
    entries = {}
    spmd = write(out, f"spmd/{name}", spmd_text)
    entries[f"spmd/{name}"] = manifest_entry(signature, "spmd", num_devices, spmd,
                                             source_dump=dump.spmd.name.split(".", 2)[2])
    if num_devices == OPTIMIZED_AT and model in FIXTURE_MODELS:
        optimized = write(out, f"optimized/{name}", dump.optimized.read_text())
        entries[f"optimized/{name}"] = manifest_entry(
            signature, "optimized", num_devices, optimized,
            source_dump=dump.optimized.name.split(".", 2)[2])
        record_memory(optimized, entries[f"optimized/{name}"])
    for spec in REPLICA_FIXTURES:
        if (spec.model, spec.num_devices) != (model, num_devices):
            continue
        replicated = ([p["role"] != "batch" for p in signature["parameters"]]
                      if spec.parameter_replication else None)
        text = spmd_to_replica(spmd_text, num_devices, replicated, spec.all_replicas_as_empty)
        check_against_xla(text, signature, f"replica/{name}")
        replica = write(out, f"replica/{name}", text)
        signature_file = dump.spmd.parent / "signature.json"
        verify_replica(replica, spmd, signature_file, num_devices)
        steps = REPLICA_STEPS + (
            ["V3 mesh replica groups -> replica_groups={} (all replicas)"]
            if spec.all_replicas_as_empty else []) + (
            ["entry parameters: parameter_replication={true} (weights, optimizer state), "
             "{false} (batch)"] if spec.parameter_replication else [])
        entries[f"replica/{name}"] = manifest_entry(
            signature, "replica", num_devices, replica, derived_from=f"spmd/{name}",
            conversion=steps,
            verified=f"compiled with num_replicas={num_devices} and run on {num_devices} CPU "
                     f"devices: outputs bit-identical to spmd/{name} run in replica form "
                     "(executing-hlo-with-jax.md §5.2)")
    return entries


def manifest_text(manifest: dict) -> str:
    """Indented JSON, but one line per parameter/output record (keeps the file small)."""
    def value(v, depth: int) -> str:
        pad = " " * depth
        if isinstance(v, dict) and depth < 2:
            items = [f'{pad} {json.dumps(k)}: {value(x, depth + 1)}' for k, x in v.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(v, list) and v and isinstance(v[0], dict):
            rows = [f"{pad}  {json.dumps(x)}" for x in v]
            return "[\n" + ",\n".join(rows) + f"\n{pad} ]"
        return json.dumps(v)

    return value(dict(sorted(manifest.items())), 0) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("fixtures"))
    parser.add_argument("--devices", default=",".join(map(str, ALL_DEVICE_COUNTS)),
                        help="comma-separated device counts (default 2,4,8)")
    parser.add_argument("--only", default="", help="comma-separated model names")
    args = parser.parse_args(argv)
    args.devices = tuple(int(n) for n in args.devices.split(","))
    known = FIXTURE_MODELS | LARGE_MODELS
    args.only = [m for m in args.only.split(",") if m] or list(known)
    unknown = [m for m in args.only if m not in known]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(known)}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out: Path = args.out
    full = set(args.only) == set(FIXTURE_MODELS | LARGE_MODELS) and \
        set(args.devices) == set(ALL_DEVICE_COUNTS)
    manifest_path = out / MANIFEST
    manifest = {} if full or not manifest_path.exists() else json.loads(manifest_path.read_text())
    if full:
        for form in FORMS:
            shutil.rmtree(out / form, ignore_errors=True)
    jobs = [(m, n) for m in args.only for n in args.devices
            if n in (FIXTURE_MODELS | LARGE_MODELS)[m].devices]
    work = Path(tempfile.mkdtemp(prefix="hlo-shard-dumps-"))
    with ThreadPoolExecutor(WORKERS) as pool:
        results = pool.map(lambda job: (job, fixtures_for(*job, out, work)), jobs)
        for (model, n), entries in results:
            print(f"{model} N={n}: " + ", ".join(f"{k} ({v['bytes']} B)"
                                                 for k, v in entries.items()))
            manifest.update(entries)
    shutil.rmtree(work)
    manifest_path.write_text(manifest_text(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
