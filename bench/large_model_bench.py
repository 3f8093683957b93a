"""``make bench`` part 9: the forms large models train in (issue #27), each next to plain
``jax.jit`` and to the ``NamedSharding`` alternative, in the same process.

One model throughout, the issue's unseen 3-layer LayerNorm MLP (``--width`` wide, global
norm clipping + AdamW), trained five ways on 8 CPU devices:

* ``scan-accum``: gradients of 4 microbatches summed in a ``lax.scan``, one update;
* ``multisteps``: ``optax.MultiSteps`` accumulating 4 calls in the optimizer state;
* ``mesh-4x2-tp``: a (data=4, model=2) mesh, Megatron's column/row split of the first
  two weights on ``model``;
* ``mesh-2x4-fsdp``: a (data=2, fsdp=4) mesh, every matrix's rows sharded over ``fsdp``
  (jit all-gathers them), the batch over both axes;
* ``bf16-master``: f32 weights cast to bf16 inside the loss (bf16 compute);
* ``fsdp-accum``: the (data=2, fsdp=4) mesh of ``mesh-2x4-fsdp`` accumulating 4
  microbatches in a ``lax.scan`` as ``scan-accum`` does (by default the fsdp
  gradients' all-reduces leave the loop too, which then carries whole gradients; also
  with ``accumulator="sharded"``, which keeps them in the loop and its accumulators
  the device's rows).

Rows per program: ``jit``; ``shard_weight_update`` with ``state`` gathered and sharded,
and sharded with ``params="sharded"`` (the fp32 master weights as shards, all-gathered
in bf16 where only read as bf16); ``install()`` (jit's step compiled under the hook, which
sees XLA's fused module); and ``NamedSharding`` (jit with the optimizer state
placed over the data axis, ``bench/ecosystem_bench.py``'s reference). Columns: the median
step and its ratio to jit's and to NamedSharding's (interleaved step by step in
``rounds`` rounds of ``runs`` steps, as ``bench/ecosystem_bench.py`` times), the live
bytes per device of the state the step carries over jit's and over NamedSharding's, the
first step's metrics against jit's, and the decision. Never asserted
(``tests/test_large_model_bench.py`` runs it at a tiny size).

``python bench/run.py --only large-model``, or ``python bench/large_model_bench.py
[--programs a,b] [--width W] [--runs R] [--rounds K] [--force]`` (``--force`` adds the
rows of ``shard_weight_update(force=True)`` and ``install(force=True)``, where the
never-slower gate kept a step whole).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from child_table import cells as table_cells, run_table  # bench/ is on sys.path
from ecosystem_bench import (SAME_METRICS, Variant, fast_variant, hook_variant, jit_variant,
                             live_bytes, timed_with_named, worst_relative)

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 8
MICROBATCHES = 4
#: The MLP's width (the issue's model is 768 wide).
WIDTH = 768
#: Examples per device per microbatch (per step where nothing accumulates).
PER_DEVICE = 4


# ------------------------------------------------------------------ the programs


def _model(width: int):
    """The 3-layer LayerNorm MLP: init(key) → params, loss(params, batch), the optimizer."""
    import jax
    import jax.numpy as jnp
    import optax

    def init(key):
        keys = jax.random.split(key, 3)
        return {f"layer{i}": {"w": jax.random.normal(k, (width, width)) / width ** 0.5,
                              "b": jnp.zeros((width,)), "scale": jnp.ones((width,))}
                for i, k in enumerate(keys)}

    def loss(params, batch):
        h = batch["x"]
        for i in range(3):
            layer = params[f"layer{i}"]
            mean = h.mean(-1, keepdims=True)
            normed = (h - mean) * jax.lax.rsqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
            h = jax.nn.gelu(normed * layer["scale"].astype(h.dtype) @ layer["w"].astype(h.dtype)
                            + layer["b"].astype(h.dtype))
        return jnp.mean((h.astype(jnp.float32) - batch["y"]) ** 2)

    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return init, loss, optimizer


def _bf16(loss: Callable) -> Callable:
    import jax
    import jax.numpy as jnp

    def bf16_loss(params, batch):
        cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
        return loss(cast, {"x": batch["x"].astype(jnp.bfloat16), "y": batch["y"]})

    return bf16_loss


def build(name: str, width: int):
    """The program ``name`` (a :class:`bench.ecosystem.Program`)."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from bench.ecosystem import Program

    init, loss, optimizer = _model(width)
    devices = np.array(jax.devices()[:DEVICES])
    fsdp = name in ("mesh-2x4-fsdp", "fsdp-accum")
    accumulates = name in ACCUMULATING
    layout = ((4, 2), ("data", "model")) if name == "mesh-4x2-tp" else \
        ((2, 4), ("data", "fsdp")) if fsdp else ((DEVICES,), ("data",))
    mesh = Mesh(devices.reshape(layout[0]), layout[1])
    batch_axes = ("data", "fsdp") if fsdp else "data"
    if name == "multisteps":
        optimizer = optax.MultiSteps(optimizer, every_k_schedule=MICROBATCHES)
    if name == "bf16-master":
        loss = _bf16(loss)

    def gradients(params, batch):
        if not accumulates:
            return jax.value_and_grad(loss)(params, batch)

        def accumulate(total, microbatch):
            value, grads = jax.value_and_grad(loss)(params, microbatch)
            return jax.tree.map(jax.numpy.add, total, grads), value

        grads, values = jax.lax.scan(accumulate, jax.tree.map(jax.numpy.zeros_like, params),
                                     batch)
        return values.mean(), grads

    def step(params, opt_state, batch):
        value, grads = gradients(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    #: Megatron's split: layer0 by columns (its bias too), layer1 by rows (the scale
    #: of its input too); as the partitioner propagates them, so each step's outputs
    #: come back in the shardings its inputs had.
    tensor_parallel = {"['layer0']['w']": P(None, "model"), "['layer0']['b']": P("model"),
                       "['layer1']['scale']": P("model"), "['layer1']['w']": P("model")}

    def placement(path: str, leaf) -> NamedSharding:
        if name == "mesh-4x2-tp":
            return NamedSharding(mesh, tensor_parallel.get(path, P()))
        if fsdp and leaf.ndim == 2:
            return NamedSharding(mesh, P("fsdp"))
        return NamedSharding(mesh, P())

    def start():
        params = init(jax.random.PRNGKey(0))
        params = jax.tree_util.tree_map_with_path(
            lambda path, leaf: jax.device_put(leaf, placement(jax.tree_util.keystr(path), leaf)),
            params)
        return params, jax.jit(optimizer.init)(params)

    def batch(i: int):
        examples = PER_DEVICE * DEVICES
        shape = (MICROBATCHES, examples, width) if accumulates else (examples, width)
        spec = P(None, batch_axes) if accumulates else P(batch_axes)
        key = jax.random.PRNGKey(1000 + i)
        return {k: jax.device_put(jax.random.normal(jax.random.fold_in(key, j), shape),
                                  NamedSharding(mesh, spec)) for j, k in enumerate("xy")}

    return Program(name, mesh, jax.jit(step, donate_argnums=(0, 1)), start, batch,
                   opt_state_prefix="[1]")


#: The programs that accumulate microbatches in a ``lax.scan``.
ACCUMULATING = ("scan-accum", "fsdp-accum")
PROGRAMS = ("scan-accum", "multisteps", "mesh-4x2-tp", "mesh-2x4-fsdp", "bf16-master",
            "fsdp-accum")


# ------------------------------------------------------------------ the child


def measure(name: str, width: int, runs: int, rounds: int, force: bool) -> list[Variant]:
    prog = build(name, width)
    variants = [jit_variant(prog)]
    for forced in (False, True) if force else (False,):
        variants += [fast_variant(prog, "gathered", forced),
                     fast_variant(prog, "sharded", forced),
                     fast_variant(prog, "sharded", forced, params="sharded")]
        if name == "fsdp-accum":  # the fsdp sums stay in the loop, carried as rows
            variants += [fast_variant(prog, "gathered", forced, accumulator="sharded"),
                         fast_variant(prog, "sharded", forced, accumulator="sharded")]
    # the zero-code-change form: what the hook makes of XLA's fused module of each form
    variants += [hook_variant(prog, forced) for forced in ((False, True) if force else (False,))]
    if name in ACCUMULATING:  # the hook's accumulators carried as a shard, as priced or not
        variants.append(hook_variant(prog, True, accumulator="sharded"))
    return timed_with_named(prog, variants, runs, rounds)


#: The table's columns: width and alignment (the last, free text, unpadded).
COLUMNS = ((13, "<"), (40, "<"), (7, ">"), (5, ">"), (6, ">"), (9, ">"), (8, ">"),
           (6, ">"), (8, ">"), (0, "<"))


def cells(*values: str) -> str:
    return table_cells(COLUMNS, *values)


def _ratio(v: Variant, reference: Variant | None) -> float | None:
    if reference is None:
        return None
    return statistics.median(a / b for a, b in zip(v.per_round, reference.per_round))


def rows(name: str, variants: list[Variant]) -> tuple[list[str], dict[str, dict[str, float]]]:
    """The printed rows and, per mode, the figures of the JSON summary."""
    jit = variants[0]
    named = next((v for v in variants if v.mode == "NamedSharding"), None)
    jit_bytes = live_bytes(jit.state)
    named_bytes = None if named is None else live_bytes(named.state)
    out, summary = [], {}
    for v in variants:
        ratios = [a / b for a, b in zip(v.per_round, jit.per_round)]
        vs_named = _ratio(v, named)
        nbytes = live_bytes(v.state)
        same = worst_relative(v.first_metrics, jit.first_metrics)
        out.append(cells(
            name, v.mode, f"{statistics.median(v.per_round) * 1e3:.1f}",
            f"{statistics.median(ratios):.2f}", "–" if vs_named is None else f"{vs_named:.2f}",
            f"{min(ratios):.2f}-{max(ratios):.2f}",
            f"{jit_bytes / 2**20:.2f}M" if v is jit else f"{nbytes / jit_bytes:.2f}",
            "–" if named_bytes is None else f"{nbytes / named_bytes:.2f}",
            "" if v is jit else ("same" if same <= SAME_METRICS else f"{same:.1e}"),
            v.decision))
        if v is not jit:
            summary[v.mode] = {"ratio": statistics.median(ratios),
                               "memory": nbytes / jit_bytes,
                               **({} if vs_named is None or named_bytes is None else
                                  {"ratio_vs_named": vs_named,
                                   "memory_vs_named": nbytes / named_bytes})}
    return out, summary


def child(args: argparse.Namespace) -> None:
    """Measure and print the table (this process has the devices); the last line is
    the JSON summary for ``bench/run.py``."""
    print(f"3-layer LayerNorm MLP, width {args.width}, clip + AdamW, {PER_DEVICE} examples "
          f"per device{f' x {MICROBATCHES} microbatches where accumulated' if set(ACCUMULATING) & set(args.programs) else ''}")
    print(cells("program", "mode", "step ms", "/jit", "/named", "rounds", "mem/dev",
                "mem", "metrics", "decision"))
    print(cells("", "", "", "", "", "min-max", "/jit", "/named", "vs jit", ""), flush=True)
    summary: dict[str, dict[str, Any]] = {}
    failed = []
    for name in args.programs:
        try:
            variants = measure(name, args.width, args.runs, args.rounds, args.force)
        except Exception as err:  # reported on its row and in the summary, never hidden
            print(f"{name:13s} FAILED: {type(err).__name__}: "
                  f"{str(err).splitlines()[0] if str(err) else ''}", flush=True)
            failed.append(name)
            continue
        printed, summary[name] = rows(name, variants)
        print("\n".join(printed), flush=True)
    if failed:
        print(f"FAILED programs: {', '.join(failed)}")
    print(json.dumps(summary))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the forms large models train in (issue "
                                     "#27): hlo-shard against jit and NamedSharding")
    parser.add_argument("--programs", type=lambda s: s.split(","), default=list(PROGRAMS),
                        help=f"comma-separated, of {','.join(PROGRAMS)}")
    parser.add_argument("--width", type=int, default=WIDTH, help="the MLP's width")
    parser.add_argument("--runs", type=int, default=4, help="timed steps per mode per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--force", action="store_true",
                        help="also shard_weight_update(force=True) in every mode")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [name for name in args.programs if name not in PROGRAMS]
    if unknown:
        parser.error(f"--programs: unknown {', '.join(unknown)} (known: {', '.join(PROGRAMS)})")
    if args.width % DEVICES:
        parser.error(f"--width must be a multiple of {DEVICES}")
    return args


def large_model(argv: Sequence[str] = ()) -> dict:
    """Run the table in a child process with 8 CPU devices, print it, return its
    figures per program and mode."""
    args = parse_args(list(argv))
    print(f"\n== the forms large models train in: each mode / plain jax.jit and / "
          f"NamedSharding, N={DEVICES} CPU devices, median of {args.rounds} interleaved "
          f"rounds of {args.runs} steps after an untimed one, in an order drawn per step",
          flush=True)
    return run_table(Path(__file__), list(argv), DEVICES)


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        sys.path.insert(0, str(ROOT))
        child(parse_args(sys.argv[1:]))
    else:
        print(json.dumps(large_model(sys.argv[1:])))  # the figures, for scripts
