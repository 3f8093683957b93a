"""The steps of ``scripts/device_check.sh`` that need Python: which fixtures fit the
machine's devices, the ``hlo_shard.jax`` measurements (the train API and ``install()``
against plain ``jax.jit``, interleaved), whether XLA runs the pass hook on the platform
at all, and the Markdown report. Each step writes JSON into the output folder; the
report reads whatever is there, so a step that failed or timed out is a row that says so.

    python scripts/device_check.py fixtures --devices D           # one path a line
    python scripts/device_check.py jax --backend gpu --out DIR [--quick]
    python scripts/device_check.py report --backend gpu --out DIR

Run by the shell script; nothing imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT / "scripts", ROOT / "bench"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

#: The fixtures ``verify`` runs: a fixture of N replicas needs N devices (XLA runs one
#: replica on one device; CPU's N come from --xla_force_host_platform_device_count, a
#: GPU's only from N GPUs), so on one GPU none fits and the step says so.
FIXTURE = re.compile(r"\.n(\d+)\.hlo$")
#: --quick: the fixtures a CPU run checks (the script's own test).
QUICK_FIXTURES = ("sgd", "adam")
#: The models of the jax step (bench names, ``bench/jax_models_bench.py``): the bench's
#: update-heavy MLP with Adam, and the zoo's LayerNorm MLP with clip + AdamW.
JAX_MODELS = (("mlp", "adam"), ("ln_mlp", "adamw_clip"))
#: The source line of a calibrated GPU profile naming the published profile it keeps
#: the unmeasured fields of (``calibrate.gpu_profile_from_measurements``).
BASE_SOURCE = re.compile(r"every other field from the (\S+) profile")
#: The update-heavy MLP's width: the bench's own, and a small one for --quick.
MLP_WIDTH, QUICK_MLP_WIDTH = 1024, 128


def fitting_fixtures(devices: int, quick: bool) -> list[Path]:
    """The SPMD fixtures whose replica count is at most ``devices`` (and at least 2:
    a one-device step has no gradient all-reduce)."""
    out = []
    for path in sorted((ROOT / "fixtures" / "spmd").glob("*.hlo")):
        match = FIXTURE.search(path.name)
        if match is None or not 2 <= int(match.group(1)) <= devices:
            continue
        if quick and (path.name.split(".")[0] not in QUICK_FIXTURES
                      or int(match.group(1)) != min(devices, 2)):
            continue
        out.append(path)
    return out


# ------------------------------------------------------------------- the jax step


def _interleaved(steps: dict, args: dict, data: list, runs: int, rounds: int) -> dict:
    """Median seconds per round of each step, run in turn step by step (outputs fed back
    as a training loop does), after one untimed step each."""
    import jax

    per_round: dict[str, list[float]] = {name: [] for name in steps}
    for timed in [False] + [True] * rounds:
        times: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(runs if timed else 1):
            for name, step in steps.items():
                params, state, _, rng = args[name]
                started = time.perf_counter()
                params, state, loss = step(params, state, data[i % len(data)], rng)
                jax.block_until_ready((params, state, loss))
                times[name].append(time.perf_counter() - started)
                args[name] = (params, state, None, rng)
        if timed:
            for name in steps:
                per_round[name].append(statistics.median(times[name]))
    return per_round


def measure_install(spec, devices: int, runs: int, rounds: int) -> dict:
    """``install()`` against plain jit: the plain step compiled before it, the same
    function jitted afresh after it (through the hook), both timed interleaved."""
    import jax

    import hlo_shard.jax as hsj
    from hlo_dump import train_step
    from jax_models_bench import batches, concrete

    jitted, abstract = train_step(spec, devices)
    plain = jitted.lower(*abstract).compile()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hsj.decisions(clear=True)
        with hsj.install():
            started = time.perf_counter()
            hooked = train_step(spec, devices)[0].lower(*abstract).compile()
            compile_s = time.perf_counter() - started
        decisions = hsj.decisions(clear=True)
    steps = {"jit": plain, "install": hooked}
    args = {name: concrete(spec, abstract, 0) for name in steps}
    losses = {}
    for name, step in steps.items():  # the first step on the same inputs: the same loss
        params, state, batch, rng = args[name]
        params, state, loss = step(params, state, batch, rng)
        losses[name] = float(jax.device_get(loss))
        args[name] = (params, state, batch, rng)
    per_round = _interleaved(steps, args, batches(spec, abstract[2], 0), runs, rounds)
    ratios = [a / b for a, b in zip(per_round["install"], per_round["jit"])]
    return {"jit_ms": statistics.median(per_round["jit"]) * 1e3,
            "install_ms": statistics.median(per_round["install"]) * 1e3,
            "ratio": statistics.median(ratios), "spread": [min(ratios), max(ratios)],
            "hooked_compile_s": compile_s, "first_losses": losses,
            "decisions": [{"module": d.module, "changed": d.changed, "reason": d.reason,
                           "sharded_bytes": d.sharded_bytes, "gradient_bytes": d.gradient_bytes}
                          for d in decisions],
            "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught
                                if issubclass(w.category, (hsj.FallbackWarning,
                                                           hsj.hook.PlatformWarning))})}


def probe_hook() -> dict:
    """Does XLA call a registered pass on the default backend with this jaxlib? A probe
    callback registered at each stage records the modules it is handed while a tiny
    step compiles; where it records none, the platform ignores the hook (silently)."""
    import jax
    import jax.numpy as jnp
    from jax.extend import xla as jax_xla

    seen: dict[str, list[int]] = {stage.name: [] for stage in jax_xla.PipelineStage}
    for stage in jax_xla.PipelineStage:
        def record(data: bytes, name: str = stage.name) -> None:
            seen[name].append(len(data))
        jax_xla.register_hlo_module_transformation(
            record, name=f"hlo_shard.device_check.{stage.name}", stage=stage)
    try:
        jax.clear_caches()
        jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) * 2.0)(jnp.ones((8,))))
    finally:
        for stage in jax_xla.PipelineStage:
            jax_xla.clear_hlo_module_transformation(f"hlo_shard.device_check.{stage.name}",
                                                    stage)
    return {"platform": jax.default_backend(), "stages": {k: len(v) for k, v in seen.items()},
            "runs": all(seen.values())}


def jax_step(backend: str, out: Path, quick: bool) -> None:
    """Every measurement of the jax step into ``out/jax.json`` (written after each, so a
    timeout keeps the ones done)."""
    import jax
    import jaxlib.version

    from jax_models_bench import bench_models, measure_row, with_optimizer

    devices = len(jax.devices())
    runs, rounds = (2, 2) if quick else (10, 5)
    result: dict = {"platform": jax.default_backend(), "devices": devices,
                    "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "jaxlib": jaxlib.version.__version__, "runs": runs, "rounds": rounds,
                    "rows": []}
    target = out / "jax.json"

    def save() -> None:
        target.write_text(json.dumps(result, indent=1))

    result["hook_probe"] = probe_hook()
    save()
    models = bench_models(QUICK_MLP_WIDTH if quick else MLP_WIDTH)
    for model, optimizer in JAX_MODELS:
        spec = with_optimizer(models[model], optimizer)
        row: dict = {"model": model, "optimizer": optimizer}
        result["rows"].append(row)
        for name, measure in (("train", measure_row), ("install", measure_install)):
            try:
                row[name] = measure(spec, devices, runs, rounds)
            except Exception as err:  # reported in the row, never hidden
                row[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"
                             if str(err) else type(err).__name__}
            save()
    print(f"jax step: {target}")


# ------------------------------------------------------------------- the report


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _notes(out: Path) -> list[str]:
    """What the shell script noted on the way (device count, failures, time taken)."""
    try:
        return [line for line in (out / "notes.txt").read_text().splitlines() if line]
    except OSError:
        return []


def _verify_rows(out: Path) -> list[str]:
    rows = []
    for path in sorted((out / "verify").glob("*.status")):
        status = path.read_text().strip()
        log = path.with_suffix(".log")
        verdict = next((line for line in (log.read_text().splitlines() if log.is_file() else [])
                        if line.startswith(("MATCH", "DIFFER", "error"))), "")
        rows.append(f"| {path.stem} | {status} | {verdict} |")
    return rows


def _jax_rows(jax_result: dict) -> list[str]:
    rows = []
    for row in jax_result.get("rows", []):
        name = f"{row['model']} + {row['optimizer']}"
        train = row.get("train", {})
        if "error" in train:
            rows.append(f"| {name} | train API | failed: {train['error']} | | |")
        elif train:
            for mode, cell in train["modes"].items():
                rows.append(f"| {name} | shard_weight_update, {mode} | {train['jit_ms']:.2f} | "
                            f"{cell['ms']:.2f} | {cell['ratio']:.2f} "
                            f"({cell['spread'][0]:.2f}-{cell['spread'][1]:.2f}); "
                            f"{cell['did']} |")
        hooked = row.get("install", {})
        if "error" in hooked:
            rows.append(f"| {name} | install() | failed: {hooked['error']} | | |")
        elif hooked:
            did = "; ".join(f"{d['module']}: " + (f"sharded {d['sharded_bytes']}/"
                                                   f"{d['gradient_bytes']} B" if d["changed"]
                                                   else f"kept ({d['reason']})")
                            for d in hooked["decisions"]) or "no decision (the hook saw no " \
                                                             "module with an all-reduce)"
            first = hooked["first_losses"]
            rows.append(f"| {name} | install() | {hooked['jit_ms']:.2f} | "
                        f"{hooked['install_ms']:.2f} | {hooked['ratio']:.2f} "
                        f"({hooked['spread'][0]:.2f}-{hooked['spread'][1]:.2f}); {did}; "
                        f"first loss {first['install']:.6g} (jit {first['jit']:.6g}) |")
            rows += [f"| | warning | {w} | | |" for w in hooked["warnings"]]
    return rows


def _profile_rows(measured: dict, base: dict) -> list[str]:
    def rate(profile: dict, key: str, sub: str | None = None) -> float:
        value = profile.get(key, {} if sub else 0.0)
        return value.get(sub, value.get("default", 0.0)) if sub else value

    fields = (("memory read bandwidth", "memory_bandwidth_bytes_per_s", None, 1e9, "GB/s"),
              ("memory write bandwidth", "memory_write_bandwidth_bytes_per_s", None, 1e9, "GB/s"),
              ("f32 dot", "matrix_flops_per_s", "f32", 1e12, "TFLOP/s"),
              ("bf16 dot", "matrix_flops_per_s", "bf16", 1e12, "TFLOP/s"),
              ("step overhead", "step_overhead_s", None, 1e-6, "us"))
    rows = []
    for label, key, sub, unit, unit_name in fields:
        have, published = rate(measured, key, sub), rate(base, key, sub)
        rows.append(f"| {label} | {have / unit:.4g} {unit_name} | "
                    + (f"{published / unit:.4g} {unit_name} | {have / published:.2f} |"
                       if published else "| |"))
    return rows


def report(backend: str, out: Path) -> Path:
    """``out/report.md`` from what the steps left in ``out``."""
    env = _read(out / "environment.json") or {}
    jax_result = _read(out / "jax.json") or {}
    profile = _read(out / "profile.json")
    lines = [f"# hlo-shard device check ({backend})", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- machine: {platform.machine()}, {os.cpu_count()} CPUs; devices: "
             f"{jax_result.get('devices', '?')} x {jax_result.get('device_kind', '?')} "
             f"({jax_result.get('platform', backend)})",
             f"- jax {jax_result.get('jax', env.get('jax', '?'))}, jaxlib "
             f"{jax_result.get('jaxlib', env.get('jaxlib', '?'))}",
             *[f"- {gpu}" for gpu in env.get("gpus", [])],
             *[f"- {note}" for note in _notes(out)], ""]
    probe = jax_result.get("hook_probe")
    lines += ["## The pass hook on this platform", ""]
    if probe:
        lines.append(f"XLA called a registered pass {probe['stages']} times per stage while "
                     f"compiling one step on `{probe['platform']}`: the hook "
                     + ("**runs** here." if probe["runs"] else
                        "**is ignored** here (install() cannot shard on this jaxlib/plugin)."))
    else:
        lines.append("not measured (the jax step failed or timed out: see jax.log)")
    lines += ["", "## verify: fixtures on this backend", ""]
    verify = _verify_rows(out)
    note = out / "verify" / "NOTE"
    if note.is_file():
        lines.append(note.read_text().strip())
    if verify:
        lines += ["", "| fixture | exit status | verdict |", "|---|---|---|", *verify]
    lines += ["", "## hlo_shard.jax against plain jax.jit (interleaved, median of rounds)", ""]
    rows = _jax_rows(jax_result)
    if rows:
        lines += ["| model | path | jit ms | path ms | path / jit (rounds); what the pass did |",
                  "|---|---|---|---|---|", *rows]
    else:
        lines.append("no measurement (see jax.log)")
    lines += ["", "## calibrate", ""]
    if profile is None:
        lines.append("no profile (see calibrate.log)")
    else:
        # a GPU profile names the published one it keeps the rest of; a CPU one is
        # compared with the CPU profile shipped with hlo-shard
        kept = (BASE_SOURCE.match(line) for line in profile.get("sources", []))
        base_name = next((match.group(1) for match in kept if match),
                         "cpu-local" if backend == "cpu" else None)
        from hlo_shard.profiles import profile_json

        try:
            base = profile_json(base_name)[0] if base_name else {}
        except Exception:  # noqa: BLE001 - the report names what it has
            base = {}
        assert isinstance(base, dict)
        lines += [f"`{profile.get('name')}`: {profile.get('description', '')}", "",
                  f"| rate | measured | {base_name or 'no'} profile | measured / profile |", "|---|---|---|---|", *_profile_rows(profile, base)]
    target = out / "report.md"
    target.write_text("\n".join(lines) + "\n")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=("fixtures", "jax", "report"))
    parser.add_argument("--backend", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args(argv)
    if options.step == "fixtures":
        print("\n".join(str(p.relative_to(ROOT)) for p in
                        fitting_fixtures(options.devices, options.quick)))
    elif options.step == "jax":
        jax_step(options.backend, options.out, options.quick)
    else:
        print(report(options.backend, options.out))


if __name__ == "__main__":
    main()
