"""Turn a per-device SPMD dump into the classic replica form, and check the two agree.

jax 0.10.x only emits the SPMD form (`num_partitions=N`, flattened-id collectives with
`channel_id`, `partition-id`). Older JAX (pmap) and TensorFlow emit the replica form that
hlo-shard must also read: `replica_count=N`, cross-replica collectives without `channel_id`,
`replica-id`, optionally `parameter_replication`. With one partition a flattened device id
*is* the replica id, so the conversion below is exact:

1. header: `num_partitions=N` -> `replica_count=N`; drop the
   `allow_spmd_sharding_propagation_*` lists (SPMD-only);
2. drop every `sharding={...}` attribute (brace-balanced scan);
3. `partition-id()` -> `replica-id()`;
4. collectives with `use_global_device_ids=true`: drop `channel_id` and the flag (their groups
   already list replica ids); a V3 mesh group over a 1-D mesh becomes `replica_groups={}`
   ("all replicas", TensorFlow's spelling) or the explicit list, as asked;
5. entry parameters get `parameter_replication={true}` / `{false}` when asked.

These are text edits, fine for a generator that only sees jax's own dumps; anything
unexpected (a cross-partition collective, a mesh over several axes) raises instead of
guessing. `spmd_to_runnable` is executing-hlo-with-jax.md §5.2 (keep flattened ids, renumber
channel ids), used as the reference the replica form must match bit for bit.

    python3 scripts/replica_form.py verify REPLICA.hlo REFERENCE_SPMD.hlo SIGNATURE.json N
runs both in this (child) process on N CPU devices and exits 1 on any difference.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

COLLECTIVE_WITH_GLOBAL_IDS = re.compile(r"use_global_device_ids=true")
CHANNEL_ID = re.compile(r"channel_id=\d+, ")
PARTITION_ID = re.compile(r"(=\s*u32\[\]\s+)partition-id\(")
MESH_1D_GROUP = re.compile(r"replica_groups=mesh\['(\w+)'=(\d+)(?:,'\w+'=1)*\] \{'\1'\}")


def strip_attr(text: str, name: str) -> str:
    """Remove every `, name={...}` (nested braces and quoted strings skipped)."""
    out, i, key = [], 0, ", " + name + "={"
    while (j := text.find(key, i)) >= 0:
        out.append(text[i:j])
        k, depth = j + len(key), 1
        while depth:
            c = text[k]
            if c == '"':
                k = text.index('"', k + 1)
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            k += 1
        i = k
    out.append(text[i:])
    return "".join(out)


def _replica_header(text: str) -> str:
    header, rest = text.split("\n", 1)
    if "replica_count=" in header or "num_partitions=" not in header:
        raise ValueError("expected an SPMD module with num_partitions and no replica_count")
    header = re.sub(r"num_partitions=(\d+)", r"replica_count=\1", header)
    for attr in ("allow_spmd_sharding_propagation_to_parameters",
                 "allow_spmd_sharding_propagation_to_output"):
        header = strip_attr(header, attr)
    return header + "\n" + rest


def _common(text: str) -> str:
    """Steps shared by both conversions: header, shardings, partition-id."""
    text = _replica_header(text)
    text = strip_attr(text, "sharding")
    return PARTITION_ID.sub(r"\1replica-id(", text)


def spmd_to_runnable(text: str) -> str:
    """executing-hlo-with-jax.md §5.2: flattened-id collectives kept, channel ids unique."""
    counter = iter(range(1, 1 << 30))
    return re.sub(r"channel_id=\d+", lambda m: f"channel_id={next(counter)}", _common(text))


def _cross_replica(line: str, num_devices: int, all_replicas_as_empty: bool) -> str:
    line = CHANNEL_ID.sub("", line, count=1)
    line = line.replace(", use_global_device_ids=true", "")
    explicit = "{{" + ",".join(map(str, range(num_devices))) + "}}"

    def mesh_group(m: re.Match) -> str:
        if int(m.group(2)) != num_devices:
            raise ValueError(f"mesh group over {m.group(2)} devices, module has {num_devices}")
        return "replica_groups=" + ("{}" if all_replicas_as_empty else explicit)

    line = MESH_1D_GROUP.sub(mesh_group, line)
    if "mesh[" in line:
        raise ValueError(f"unsupported mesh replica group: {line.strip()[:160]}")
    return line


def _mark_entry_parameters(text: str, replicated: list[bool]) -> str:
    lines = text.split("\n")
    entry = next(i for i, line in enumerate(lines) if line.startswith("ENTRY "))
    end = lines.index("}", entry)
    for i in range(entry + 1, end):
        m = re.search(r" parameter\((\d+)\)", lines[i])
        if m:
            flag = "true" if replicated[int(m.group(1))] else "false"
            lines[i] = lines[i][:m.end()] + f", parameter_replication={{{flag}}}" + lines[i][m.end():]
    return "\n".join(lines)


def spmd_to_replica(text: str, num_devices: int, replicated: list[bool] | None = None,
                    all_replicas_as_empty: bool = False) -> str:
    """The classic replica form of a per-device SPMD module (steps 1-5 of the docstring)."""
    lines = _common(text).split("\n")
    for i, line in enumerate(lines):
        if COLLECTIVE_WITH_GLOBAL_IDS.search(line):
            lines[i] = _cross_replica(line, num_devices, all_replicas_as_empty)
        elif "channel_id=" in line:
            raise ValueError(f"cross-partition collective has no replica form: {line[:160]}")
    text = "\n".join(lines)
    return _mark_entry_parameters(text, replicated) if replicated is not None else text


# ----------------------------------------------------------------------------- verification

def _inputs(signature: dict, num_devices: int, seed: int = 0) -> list[list]:
    """Per entry parameter, one value per device: weights/state equal, batch different.

    Optimizer state is drawn positive (Adam's second moment, Adagrad's accumulator are)."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(seed)
    values = []
    for leaf in signature["parameters"]:
        dtype = np.dtype(ml_dtypes.bfloat16 if leaf["dtype"] == "bfloat16" else leaf["dtype"])
        if leaf["role"] == "batch":
            values.append([_draw(rng, leaf, dtype) for _ in range(num_devices)])
        else:
            values.append([_draw(rng, leaf, dtype)] * num_devices)
    return values


def _draw(rng, leaf: dict, dtype):
    import numpy as np

    shape = tuple(leaf["shape"])
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, leaf.get("int_high", 5), shape).astype(dtype)
    value = rng.standard_normal(shape) * 0.5
    return (np.abs(value) if leaf["role"] == "optimizer_state" else value).astype(dtype)


def run_replica_module(text: str, num_devices: int, per_device_inputs: list[list]) -> list:
    """Compile with num_replicas=N and run (executing-hlo-with-jax.md §3); [output][device]."""
    import jax
    import numpy as np
    from jax._src.lib import xla_client as xc

    module = xc.hlo.hlo_module_from_text(text)
    mlir = xc._xla.mlir.xla_computation_to_mlir_module(
        xc.XlaComputation(module.as_serialized_hlo_module_proto()))
    options = xc.CompileOptions()
    build = options.executable_build_options
    build.num_replicas, build.num_partitions = num_devices, 1
    devices = jax.devices()[:num_devices]
    build.device_assignment = xc.DeviceAssignment.create(
        np.array([[d.id] for d in devices]))
    exe = devices[0].client.compile_and_load(mlir, xc.DeviceList(tuple(devices)), options)
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    arrays = [jax.make_array_from_single_device_arrays(
        np.shape(vals[0]), spec, [jax.device_put(v, d) for v, d in zip(vals, devices)])
        for vals in per_device_inputs]
    result = exe.execute_sharded(arrays)
    return [[np.asarray(x) for x in out] for out in result.disassemble_into_single_device_arrays()]


def verify(replica_text: str, spmd_text: str, signature: dict, num_devices: int) -> list[str]:
    """Differences between the replica form and the §5.2 reference; empty when identical."""
    import numpy as np

    inputs = _inputs(signature, num_devices)
    got = run_replica_module(replica_text, num_devices, inputs)
    want = run_replica_module(spmd_to_runnable(spmd_text), num_devices, inputs)
    problems = [] if len(got) == len(want) == len(signature["outputs"]) else [
        f"output counts differ: {len(got)} vs {len(want)}"]
    for k, (g, w) in enumerate(zip(got, want)):
        for d in range(num_devices):
            if not np.array_equal(g[d], w[d], equal_nan=True):
                problems.append(f"output {k} ({signature['outputs'][k]['name']}) differs "
                                f"on device {d}")
        if not all(np.all(np.isfinite(g[d].astype(np.float32))) for d in range(num_devices)):
            problems.append(f"output {k} is not finite")
    return problems


def main(argv: list[str]) -> int:
    if argv[0] != "verify" or len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    replica, spmd, signature = (Path(a) for a in argv[1:4])
    problems = verify(replica.read_text(), spmd.read_text(),
                      json.loads(signature.read_text()), int(argv[4]))
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
