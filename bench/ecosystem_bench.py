"""``make bench`` part 8: the ecosystem table. Training programs written by others
(``bench/ecosystem``: flax nnx's MNIST CNN, flax's ImageNet ResNet-18, flax's lm1b
transformer with bf16 compute, optax's nanoLM, equinox's ViT, haiku's transformer LM;
model code unchanged, sizes cut, synthetic data) run every way a user can run them with
hlo-shard, next to plain ``jax.jit`` in the same process, one row per program × mode:

* ``jit``: the program's own step (ahead-of-time lowered and compiled, so its first call
  splits into lowering and compile; the same executable is timed);
* ``gathered`` / ``sharded``: ``hlo_shard.jax.shard_weight_update(step, state=...)``
  with its never-slower gate (``--force`` adds the forced rows, the hook's too);
* ``install()``: the step compiled while the XLA hook is installed;
* ``NamedSharding``: the reference users have without hlo-shard: jit's step with every
  optimizer-state leaf placed ``P(axis)`` on its first dimension divisible by N (as
  MaxText's ``shard_optimizer_over_data``), where the program takes its optimizer state
  as it is given (not for a ``shard_map`` step or one that pins its state replicated).

Columns: the median step (interleaved with every other mode of the program, step by
step, in ``rounds`` rounds of ``runs`` steps; each step gets a fresh batch, as the
programs donate theirs) and its ratio to jit's (median of the rounds' ratios, their
min-max); the live bytes per device of the state the step carries (parameters,
optimizer state, the rest of the loop's state) over jit's; the first call (capture,
pass with its gate, compile and one step) over jit's (lowering, compile and one step),
with its split (``fast.report["seconds"]``: capture, pass, compile; the hook: XLA's
compile, the hook's seconds in it as read + pass + write (``Decision.split``: XLA's
proto to text and our parse, the optimizer, the text back through XLA's parser) and
what they add to XLA's own, the better of two compiles under fresh installations: the
hook's seconds move with the machine's load); the first step's metrics against jit's (max relative difference); the
decision (gradients sharded of all, or the fallback's reason code; the hook: gradient
bytes sharded, or its gradients' reason codes). Never asserted:
``tests/test_ecosystem.py`` checks the numbers.

``python bench/run.py --only ecosystem``, or ``python bench/ecosystem_bench.py
[--programs a,b] [--runs R] [--rounds K] [--force]``; ``HLO_SHARD_ECOSYSTEM_RUNS`` and
``HLO_SHARD_ECOSYSTEM_ROUNDS`` set the defaults (more runs for steadier ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from child_table import (  # bench/ is on sys.path
    cells as table_cells, drawn_order_rounds, run_table)

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 8
#: Program name → (module of bench/ecosystem, build's keyword arguments).
PROGRAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "mnist": ("mnist_nnx", {}),
    "resnet18": ("resnet_linen", {"model": "ResNet18"}),
    "lm1b": ("lm1b_linen", {}),
    "nanolm": ("nanolm", {}),
    "vit": ("vit_equinox", {}),
    "haiku": ("haiku_lm", {}),
}
RUNS_ENV, ROUNDS_ENV = "HLO_SHARD_ECOSYSTEM_RUNS", "HLO_SHARD_ECOSYSTEM_ROUNDS"
#: Relative difference of the first step's metrics that counts as jit's numbers.
SAME_METRICS = 1e-5


# ------------------------------------------------------------------ the child


@dataclass
class Variant:
    """One way to run a program's step, with its own (donated) state."""

    mode: str
    call: Callable
    state: tuple
    first_s: float
    split: str
    decision: str
    first_metrics: Any
    per_round: list[float] = field(default_factory=list)


def block(tree: Any) -> Any:
    import jax

    return jax.block_until_ready(tree)


def first_call(call: Callable, state: tuple, batch: Any) -> tuple[tuple, Any, float, str]:
    """One step from ``state``: the next state, the metrics, the seconds, and the
    FallbackWarnings' text."""
    import hlo_shard.jax as hsj

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", hsj.FallbackWarning)
        started = time.perf_counter()
        out = block(call(*state, batch))
        seconds = time.perf_counter() - started
    said = "; ".join(str(w.message) for w in caught if issubclass(w.category, hsj.FallbackWarning))
    return tuple(out[:len(state)]), out[len(state):], seconds, said


def jit_variant(prog) -> Variant:
    """The program's own step, lowered and compiled ahead of time (its split)."""
    state, batch = prog.init(), prog.batch(0)
    started = time.perf_counter()
    lowered = prog.step.lower(*state, batch)
    lowered_s = time.perf_counter() - started
    compiled = lowered.compile()
    compile_s = time.perf_counter() - started - lowered_s
    state, metrics, run_s, _ = first_call(compiled, state, batch)
    return Variant("jit", compiled, state, lowered_s + compile_s + run_s,
                   f"lower {lowered_s:.1f} + compile {compile_s:.1f}", "", metrics)


def split(report: dict) -> str:
    """``fast.report``'s first-call seconds as "capture + pass + compile"."""
    seconds = report.get("seconds") or {}
    return " + ".join(f"{seconds.get(stage, 0.0):.1f}" for stage in ("capture", "pass", "compile"))


def fast_variant(prog, mode: str, force: bool, params: str = "gathered",
                 accumulator: str = "auto") -> Variant:
    import hlo_shard.jax as hsj

    fast = hsj.shard_weight_update(prog.step, state=mode, params=params, force=force,
                                   accumulator=accumulator)
    state, metrics, seconds, _ = first_call(fast, prog.init(), prog.batch(0))
    report = fast.report or {}
    if report.get("fallback") is None:
        decision = f"sharded {report.get('sharded')} of {report.get('gradients')}"
    else:
        gate = report.get("speed") or {}
        predicted = gate.get("predicted_ratio")
        decision = f"fell back: {report['fallback']}" + \
            (f" (predicted {predicted:.2f}x)" if predicted is not None else "")
    return Variant(mode + (", params sharded" if params == "sharded" else "")
                   + (f", accumulator {accumulator}" if accumulator != "auto" else "")
                   + (", forced" if force else ""), fast, state, seconds,
                   split(report), decision, metrics)


def hook_variant(prog, force: bool = False, accumulator: str = "auto") -> Variant:
    """The step compiled under ``install(accumulator=...)`` (the gate on, unless
    ``force``), run after uninstalling."""
    import jax

    import hlo_shard.jax as hsj

    state, batch = prog.init(), prog.batch(0)
    hsj.decisions(clear=True)

    def hooked() -> tuple[float, Any, list]:
        """One compile under a fresh installation (the pass runs again): its seconds,
        the executable and the hook's decisions."""
        with hsj.install(force=force, accumulator=accumulator):
            started = time.perf_counter()
            compiled = prog.step.lower(*state, batch).compile()
            seconds = time.perf_counter() - started
        return seconds, compiled, [d for d in hsj.decisions(clear=True)
                                   if d.report is not None or d.reason]

    # The hook's seconds vary with the machine's load from one compile to the next: the
    # better of two compiles, each a fresh installation (as the LLM bench's hook line).
    first = hooked()
    jax.clear_caches()
    second = hooked()
    compile_s, compiled, made = min((first, second),
                                    key=lambda run: sum(d.seconds for d in run[2]))
    state, metrics, run_s, _ = first_call(compiled, state, batch)
    first_call_s = first[0] + run_s  # a user's first call compiles once
    changed = [d for d in made if d.changed]
    if changed:
        sharded = sum(d.sharded_bytes for d in changed)
        total = sum(d.gradient_bytes for d in changed)
        decision = f"sharded {sharded / max(total, 1):.0%} of gradient bytes"
    else:
        codes = Counter(row.reason_code or "?" for d in made if d.report is not None
                        for row in d.report.explanations if not row.sharded)
        failures = sorted({d.reason.splitlines()[0][:60] for d in made if d.report is None})
        decision = "kept whole: " + (", ".join(f"{count} {code}" for code, count
                                               in codes.most_common())
                                     or "; ".join(failures) or "no module with an all-reduce")
    hook_s = sum(d.seconds for d in made)
    added = hook_s / max(compile_s - hook_s, 1e-9)  # over XLA's own share of the compile
    parts = [sum(d.split.to_json()[stage] for d in made if d.split is not None)
             for stage in ("read", "pass", "write")]
    return Variant("install()" + (f", accumulator {accumulator}" if accumulator != "auto" else "")
                   + (", forced" if force else ""), compiled, state,
                   first_call_s,
                   f"compile {compile_s:.1f} (hook {hook_s:.1f} = "
                   f"{' + '.join(f'{part:.1f}' for part in parts)}, +{added:.0%})", decision,
                   metrics)


def named_sharding_variant(prog) -> Variant | None:
    """jit's step with the optimizer state sharded by NamedSharding (None where the
    program has no such form)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    if not prog.opt_state_prefix:
        return None
    axis = prog.mesh.axis_names[0]
    n = prog.mesh.shape[axis]
    placed = [0, 0]

    def place(path, leaf):
        if not jax.tree_util.keystr(path).startswith(prog.opt_state_prefix) \
                or not isinstance(leaf, jax.Array):
            return leaf
        placed[1] += 1
        dims = [d for d in range(leaf.ndim) if leaf.shape[d] % n == 0]
        if not dims:
            return leaf
        placed[0] += 1
        spec = [None] * leaf.ndim
        spec[max(dims, key=lambda d: leaf.shape[d])] = axis
        return jax.device_put(leaf, NamedSharding(prog.mesh, P(*spec)))

    state = jax.tree_util.tree_map_with_path(place, prog.init())
    state, metrics, seconds, _ = first_call(prog.step, state, prog.batch(0))
    return Variant("NamedSharding", prog.step, state, seconds, "",
                   f"{placed[0]} of {placed[1]} opt-state leaves P({axis!r})", metrics)


def live_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays on the first device."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            total += getattr(leaf.addressable_shards[0].data, "nbytes", 0)
    return total


def worst_relative(a: Any, b: Any) -> float:
    import jax
    import numpy as np

    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(float(np.max(np.abs(y), initial=0.0)), 1e-30)
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)) / scale)
    return worst


def time_interleaved(prog, variants: list[Variant], runs: int, rounds: int) -> None:
    """``variants`` timed by :func:`~child_table.drawn_order_rounds`, a fresh batch each
    step (the programs donate theirs), made outside the timed call."""
    by_mode = {v.mode: v for v in variants}

    def step(mode: str, i: int) -> float:
        v = by_mode[mode]
        batch = block(prog.batch(1 + i))
        started = time.perf_counter()
        out = block(v.call(*v.state, batch))
        seconds = time.perf_counter() - started
        v.state = tuple(out[:len(v.state)])
        return seconds

    for mode, medians in drawn_order_rounds(list(by_mode), runs, rounds, step).items():
        by_mode[mode].per_round.extend(medians)


def build(name: str):
    import importlib

    module_name, kwargs = PROGRAMS[name]
    module = importlib.import_module(f"bench.ecosystem.{module_name}")
    return module.build(DEVICES, **kwargs)


def measure(name: str, runs: int, rounds: int, force: bool) -> list[Variant]:
    prog = build(name)
    variants = [jit_variant(prog)]
    for mode in ("gathered", "sharded"):
        for forced in (False, True) if force else (False,):
            variants.append(fast_variant(prog, mode, forced))
    for forced in (False, True) if force else (False,):
        variants.append(hook_variant(prog, forced))
    return timed_with_named(prog, variants, runs, rounds)


def timed_with_named(prog, variants: list[Variant], runs: int, rounds: int) -> list[Variant]:
    """``variants`` and the ``NamedSharding`` alternative where it runs, timed
    interleaved."""
    named = named_sharding_variant(prog)
    if named is not None:
        variants.append(named)
    time_interleaved(prog, variants, runs, rounds)
    return variants


#: The table's columns: width and alignment (the last, free text, unpadded).
COLUMNS = ((8, "<"), (17, "<"), (7, ">"), (5, ">"), (9, ">"), (7, ">"), (11, ">"),
           (29, "<"), (8, ">"), (0, "<"))


def cells(*values: str) -> str:
    return table_cells(COLUMNS, *values)


def rows(name: str, variants: list[Variant]) -> list[str]:
    jit = variants[0]
    jit_bytes = live_bytes(jit.state)
    out = []
    for v in variants:
        ratios = [a / b for a, b in zip(v.per_round, jit.per_round)]
        first = f"{v.first_s:.1f}" + ("" if v is jit else f" ({v.first_s / jit.first_s:.1f}x)")
        memory = f"{jit_bytes / 2**20:.1f}M" if v is jit else \
            f"{live_bytes(v.state) / jit_bytes:.2f}"
        same = "" if v is jit else worst_relative(v.first_metrics, jit.first_metrics)
        out.append(cells(name, v.mode, f"{statistics.median(v.per_round) * 1e3:.1f}",
                         f"{statistics.median(ratios):.2f}",
                         f"{min(ratios):.2f}-{max(ratios):.2f}", memory, first, v.split,
                         same if isinstance(same, str) else
                         ("same" if same <= SAME_METRICS else f"{same:.1e}"), v.decision))
    return out


def child(args: argparse.Namespace) -> None:
    """Measure and print the table (this process has the devices); the last line is
    the JSON summary for ``bench/run.py``."""
    print(cells("program", "mode", "step ms", "/jit", "rounds", "mem/dev", "1st call s",
                "capture + pass + comp", "metrics", "decision"))
    print(cells("", "", "", "", "min-max", "/jit", "(/jit)", "s (jit: its own split)",
                "vs jit", ""), flush=True)
    summary: dict[str, dict[str, float]] = {}
    failed = []
    for name in args.programs:
        try:
            variants = measure(name, args.runs, args.rounds, args.force)
        except Exception as err:  # reported on its row and in the summary, never hidden
            print(f"{name:8s} FAILED: {type(err).__name__}: "
                  f"{str(err).splitlines()[0] if str(err) else ''}", flush=True)
            failed.append(name)
            continue
        print("\n".join(rows(name, variants)), flush=True)
        summary[name] = {v.mode: statistics.median(
            a / b for a, b in zip(v.per_round, variants[0].per_round)) for v in variants[1:]}
    if failed:
        print(f"FAILED programs: {', '.join(failed)}")
    print(json.dumps(summary))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="programs written by others: every "
                                     "hlo-shard mode against plain jax.jit")
    parser.add_argument("--programs", type=lambda s: s.split(","), default=list(PROGRAMS),
                        help=f"comma-separated, of {','.join(PROGRAMS)}")
    parser.add_argument("--runs", type=int, default=int(os.environ.get(RUNS_ENV, 4)),
                        help=f"timed steps per mode per round (default ${RUNS_ENV} or 4)")
    parser.add_argument("--rounds", type=int, default=int(os.environ.get(ROUNDS_ENV, 3)),
                        help=f"interleaved rounds (default ${ROUNDS_ENV} or 3)")
    parser.add_argument("--force", action="store_true",
                        help="also shard_weight_update(force=True) in both modes and "
                             "install(force=True)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [name for name in args.programs if name not in PROGRAMS]
    if unknown:
        parser.error(f"--programs: unknown {', '.join(unknown)} (known: {', '.join(PROGRAMS)})")
    return args


def ecosystem(argv: Sequence[str] = ()) -> dict:
    """Run the table in a child process with 8 CPU devices (XLA reads the device count
    when its CPU backend starts), print it, return its ratios per program and mode."""
    args = parse_args(list(argv))
    print(f"\n== programs written by others (bench/ecosystem): each mode / plain jax.jit, "
          f"N={DEVICES} CPU devices, median of {args.rounds} interleaved rounds of "
          f"{args.runs} steps after an untimed one, in an order drawn per step", flush=True)
    return run_table(Path(__file__), list(argv), DEVICES)


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        sys.path.insert(0, str(ROOT))
        child(parse_args(sys.argv[1:]))
    else:
        ecosystem(sys.argv[1:])
