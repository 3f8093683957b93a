"""``make bench`` section: ``hlo_shard.jax.shard_weight_update`` on the bench's bundled
models, one row per model × optimizer × mode, next to plain ``jax.jit`` measured in
the same process.

The models are the ones the rest of the bench runs, from one definition each: the model
zoo's conv net, transformer block and LayerNorm MLP (``scripts/zoo_models.py``, the
sizes ``bench/zoo.py`` times as modules) and the update-heavy MLP of the step-time rows
(``scripts/fixture_models.py``, narrowed here to keep the table short; its width is
printed), each with the zoo's six optimizers. The jit step is the one the fixtures and
the zoo are dumped from (``scripts/hlo_dump.train_step``: shard_map with a ``pmean`` of
the gradients, params and state donated), with random data.

Per row: jit's and ``fast``'s step time (interleaved step by step in ``rounds`` rounds;
medians), their ratio, what the pass did (gradients sharded, or why ``fast`` runs the
step as it is: the ``FallbackWarning`` — the never-slower gate's two estimates or the
pass's reason), the first call (capture + pass + compile + one step) against jit's
(compile + one step), and XLA's compiled memory per device (argument + output + temp −
alias) fast / jit. A geometric mean per mode closes the table. Never asserted.

``python bench/run.py --only jax-models`` (or ``python bench/jax_models_bench.py``)
runs just this table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from zoo import geomean  # bench/ is on sys.path (this file's folder, or run.py's)

from child_table import drawn_order_rounds, run_table  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"  # the model definitions (fixture_models, zoo_models, hlo_dump)
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
MODES = ("gathered", "sharded")
#: The update-heavy MLP's width here (the step-time rows use 1024: 4x1024² with six
#: optimizers would take most of the table's few minutes on two cores).
MLP_WIDTH = 512


def bench_models(mlp_width: int = MLP_WIDTH) -> dict:
    """Model name → the ModelSpec of its body (the optimizer is set per row)."""
    from fixture_models import LARGE_MODELS, UPDATE_HEAVY_MLP, _mlp_spec
    from zoo_models import ZOO_MODELS

    heavy = LARGE_MODELS["mlp_adam"]
    mlp = _mlp_spec("mlp", (heavy.optimizer, heavy.make_optimizer),
                    sizes=[mlp_width] * len(UPDATE_HEAVY_MLP), per_device=2)
    return {"mlp": mlp, "conv": ZOO_MODELS["zoo_conv_adam"],
            "block": ZOO_MODELS["zoo_block_adam"], "ln_mlp": ZOO_MODELS["zoo_ln_mlp_adam"]}


def with_optimizer(spec, optimizer: str):
    from zoo_models import OPTIMIZERS

    description, factory = OPTIMIZERS[optimizer]
    return dataclasses.replace(spec, name=f"{spec.name}_{optimizer}", optimizer=description,
                               make_optimizer=factory)


def describe(spec) -> str:
    """Parameter count and leaf shapes, for the table's header."""
    shapes = [shape for shape, _ in spec.params().values()]
    count = sum(math.prod(s) for s in shapes)
    batch = ", ".join(f"{k} {list(s)}" for k, (s, _) in spec.batch().items())
    return f"{count / 1e3:.0f}k params in {len(shapes)} leaves, per device {batch}"


# ------------------------------------------------------------------ the child


@dataclasses.dataclass
class Variant:
    """One way to run a row's step, with its own (donated) arguments."""

    step: Any  # the jit step or a ShardedStep (jax is imported in the child only)
    args: tuple
    first_call_s: float = 0.0
    per_round: list[float] = dataclasses.field(default_factory=list)
    warning: str = ""


def concrete(spec, abstract: tuple, seed: int) -> tuple:
    """Random arguments of the abstract ones: weights scaled by fan-in, LayerNorm scales
    one, biases zero, the optimizer's own initial state, a random batch."""
    import jax
    import jax.numpy as jnp

    params_a, _, batch_a, rng_a = abstract
    key = jax.random.PRNGKey(seed)

    def weight(index, name, a):
        if len(a.shape) >= 2:
            value = jax.random.normal(jax.random.fold_in(key, index), a.shape,
                                      a.dtype) / math.sqrt(math.prod(a.shape[:-1]))
        else:
            value = (jnp.ones if "scale" in name else jnp.zeros)(a.shape, a.dtype)
        return jax.device_put(value, a.sharding)

    params = {name: weight(i, name, a) for i, (name, a) in enumerate(params_a.items())}
    replicated = next(iter(params_a.values())).sharding
    # jitted: eager ops on arrays of an explicit-axes mesh need a mesh context (Adafactor)
    state = jax.jit(spec.make_optimizer().init, out_shardings=replicated)(params)
    return params, state, batches(spec, batch_a, seed)[0], \
        jax.tree.map(lambda a: jax.device_put(jnp.zeros(a.shape, a.dtype), a.sharding), rng_a)


def batches(spec, batch_a: dict, seed: int, count: int = 2) -> list[dict]:
    import jax

    out = []
    for i in range(count):
        key = jax.random.PRNGKey(10_000 + seed + i)
        batch = {}
        for name, a in batch_a.items():
            key, sub = jax.random.split(key)
            high = spec.batch_int_high.get(name)
            value = (jax.random.randint(sub, a.shape, 0, high, a.dtype) if high is not None
                     else jax.random.normal(sub, a.shape, a.dtype))
            batch[name] = jax.device_put(value, a.sharding)
        out.append(batch)
    return out


def compiled_bytes(stats: dict) -> int:
    return (stats["argument_size_in_bytes"] + stats["output_size_in_bytes"]
            + stats["temp_size_in_bytes"] - stats["alias_size_in_bytes"])


def measure_row(spec, devices: int, runs: int, rounds: int) -> dict:
    """One model × optimizer: jit and ``fast`` in both modes, interleaved."""
    import jax

    import hlo_shard.jax as hsj
    from hlo_dump import train_step

    jitted, abstract = train_step(spec, devices)
    started = time.perf_counter()
    compiled = jitted.lower(*abstract).compile()
    jit_compile_s = time.perf_counter() - started
    jit_bytes = compiled_bytes({k: int(getattr(compiled.memory_analysis(), k)) for k in (
        "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
        "alias_size_in_bytes")})
    variants = {"jit": Variant(jitted, concrete(spec, abstract, 0))}
    for mode in MODES:
        variants[mode] = Variant(hsj.shard_weight_update(jitted, state=mode),
                                 concrete(spec, abstract, 0))
    data = batches(spec, abstract[2], 0)
    for v in variants.values():
        params, state, batch, rng = v.args
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", hsj.FallbackWarning)
            started = time.perf_counter()
            params, state, loss = v.step(params, state, batch, rng)
            jax.block_until_ready((params, state, loss))
            v.first_call_s = time.perf_counter() - started
        v.warning = "; ".join(str(w.message).removeprefix("hlo_shard.jax: running the "
                                                          "original step: ")
                              for w in caught if issubclass(w.category, hsj.FallbackWarning))
        v.args = (params, state, batch, rng)
    # Timed in an order drawn for every step after an untimed round (the step run after
    # fast's ran slower in a fixed order).
    def step(name: str, i: int) -> float:
        v = variants[name]
        params, state, _, rng = v.args
        started = time.perf_counter()
        params, state, loss = v.step(params, state, data[i % len(data)], rng)
        jax.block_until_ready((params, state, loss))
        seconds = time.perf_counter() - started
        v.args = (params, state, None, rng)
        return seconds

    for name, medians in drawn_order_rounds(list(variants), runs, rounds, step).items():
        variants[name].per_round.extend(medians)
    jit = variants["jit"]
    row: dict[str, Any] = {"jit_ms": statistics.median(jit.per_round) * 1e3,
                           "jit_first_s": jit.first_call_s, "jit_compile_s": jit_compile_s,
                           "modes": {}}
    for mode in MODES:
        v, fast = variants[mode], variants[mode].step
        report = fast.report
        if v.warning or report is None:
            did = "kept whole: " + (v.warning or "no program")
            memory = 1.0
        else:
            did = f"sharded {report['sharded']}/{report['gradients']} gradients"
            memory = compiled_bytes(fast.memory_stats) / jit_bytes
        ratios = [a / b for a, b in zip(v.per_round, jit.per_round)]
        row["modes"][mode] = {"ms": statistics.median(v.per_round) * 1e3,
                              "ratio": statistics.median(ratios),
                              "spread": (min(ratios), max(ratios)),
                              "first_s": v.first_call_s, "memory": memory, "did": did}
    return row


#: The table's columns: width and alignment (the last, free text, unpadded).
COLUMNS = ((7, "<"), (11, "<"), (8, "<"), (7, ">"), (7, ">"), (8, ">"), (9, ">"), (11, ">"),
           (8, ">"), (0, "<"))


def _cells(*values: str) -> str:
    return " ".join(f"{value:{align}{width}}" if width else value
                    for value, (width, align) in zip(values, COLUMNS)).rstrip()


def _child(args: argparse.Namespace) -> None:
    """Measure and print the table (this process has the N devices); the last line is
    the JSON summary for ``bench/run.py``."""
    models = bench_models(args.mlp_width)
    for name in args.models:
        print(f"{name:7s} {describe(models[name])}")
    print(_cells("model", "optimizer", "mode", "jit ms", "fast ms", "fast/jit", "rounds",
                 "1st call s", "mem/dev", "what the pass did"))
    print(_cells("", "", "", "", "", "", "min-max", "fast / jit", "fast/jit", ""), flush=True)
    ratios: dict[str, list[float]] = {mode: [] for mode in MODES}
    failed = []
    for model in args.models:
        for optimizer in args.optimizers:
            spec = with_optimizer(models[model], optimizer)
            try:
                row = measure_row(spec, args.devices, args.runs, args.rounds)
            except Exception as err:  # reported on its row and in the summary, never hidden
                print(f"{model:7s} {optimizer:11s} FAILED: {type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}", flush=True)
                failed.append(f"{model} x {optimizer}")
                continue
            jit_first = row["jit_compile_s"] + row["jit_first_s"]
            for mode in MODES:
                cell = row["modes"][mode]
                ratios[mode].append(cell["ratio"])
                low, high = cell["spread"]
                print(_cells(model, optimizer, mode, f"{row['jit_ms']:.2f}", f"{cell['ms']:.2f}",
                             f"{cell['ratio']:.2f}", f"{low:.2f}-{high:.2f}",
                             f"{cell['first_s']:.1f} / {jit_first:.1f}", f"{cell['memory']:.2f}",
                             cell["did"]), flush=True)
    summary = {f"jax models geomean, {mode}": geomean(ratios[mode]) for mode in MODES}
    for mode in MODES:
        print(f"geometric mean fast/jit step time, state={mode}: "
              f"{summary[f'jax models geomean, {mode}']:.2f}x over {len(ratios[mode])} rows")
    if failed:
        print(f"FAILED rows: {', '.join(failed)}")
    print(json.dumps(summary))


def parse_args(argv: list[str]) -> argparse.Namespace:
    from zoo_models import OPTIMIZERS

    models = bench_models()
    parser = argparse.ArgumentParser(description="hlo_shard.jax against plain jax.jit per "
                                     "bench model x optimizer x state mode")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices (N)")
    parser.add_argument("--runs", type=int, default=8, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(models),
                        help=f"comma-separated, of {','.join(models)}")
    parser.add_argument("--optimizers", type=lambda s: s.split(","), default=list(OPTIMIZERS),
                        help=f"comma-separated, of {','.join(OPTIMIZERS)}")
    parser.add_argument("--mlp-width", type=int, default=MLP_WIDTH,
                        help="width of the update-heavy MLP's 4 layers")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag, chosen, known in (("--models", args.models, models),
                                ("--optimizers", args.optimizers, OPTIMIZERS)):
        unknown = [name for name in chosen if name not in known]
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return args


def jax_models(argv: Sequence[str] = ()) -> dict:
    """Run the table in a child process with N CPU devices (XLA reads the device count
    when its CPU backend starts), print it, return its geometric means."""
    args = parse_args(list(argv))
    print(f"\n== hlo_shard.jax on the bench's models: fast / plain jax.jit, N={args.devices} "
          f"CPU devices, donated, median of {args.rounds} interleaved rounds of {args.runs} "
          "steps", flush=True)
    return run_table(Path(__file__), list(argv), args.devices)


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        _child(parse_args(sys.argv[1:]))
    else:
        for key, value in jax_models(sys.argv[1:]).items():
            print(f"{key:30s} {value:.2f}x")
