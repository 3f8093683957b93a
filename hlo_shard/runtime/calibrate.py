"""Measure a CPU profile on this machine: ``python3 -m hlo_shard.runtime.calibrate``.

XLA's CPU devices of one process share the host's cores, so the rates a step sees
per device are those of N devices running at once. Each probe is a tiny HLO module
run on N devices through the runtime (median of a few runs):

* read bandwidth from a donated elementwise loop over arrays past the cache
  (``w = w * c + g`` in place, as an optimizer's update runs), write bandwidth from
  filling a fresh array (a host pays page faults on every new buffer);
* the reduction rate from a sum over an array far larger than the caches, less its
  streaming time: XLA CPU keeps the order of the additions, so it does not vectorise
  (the sum reads 4-5 GB/s against 7-11 for an elementwise loop; priced as memory
  bandwidth, it made every full-size update a third too slow and the gain of
  sharding it too large);
* the device's share of the last-level cache (its size over N devices, from sysfs)
  and the bandwidth of kernels that stay in it: a chain of elementwise loops over
  512 KiB arrays, each reading its predecessor's output and one input and writing its
  own (the shape of a sharded optimizer update), less the same module with one loop;
* vector and transcendental rates from long elementwise chains (multiply-add, sqrt);
* matrix rate from a square f32 dot, convolution rate from a 3x3 NHWC convolution;
* collective α as the slope of a chain of dependent 4-byte all-reduces (one
  rendezvous each: the ``shared-memory`` algorithm prices the copies that follow with
  the memory rates above). One all-reduce less an empty step priced α at 39-47 µs
  where a chain measures 116-140 µs, so the gate saw the extra collectives of
  ``--state gathered`` as nearly free (issue #12); β from a 16 MiB all-reduce in ring
  accounting, used only if another algorithm is chosen;
* the fixed cost of a step from a module of one scalar add (subtracted from the
  probes, and the profile's ``step_overhead_s``);
* the fixed cost of a kernel from 24 loops over 4 KiB arrays that a concatenate of
  more than 8 operands copies into the one output (XLA CPU fuses nothing into it, so
  the module runs exactly one loop per operand), less the same with 9 loops and less
  their streaming (16 µs at N = 8);
* the fixed cost of an output leaf from 16 donated 4 KiB arrays each scaled in place by
  a loop of its own and returned, less one such loop, its streaming and a kernel (on
  XLA CPU's 8 devices of 2 cores a loop and its output cost 33 µs, where 2 µs was
  assumed; the zoo's originals, counted per kernel, measured 17-48 µs above their
  estimate); an output leaf is 13 of those µs. A model that priced every kernel as a
  returned one had a kernel-heavy module such as Adafactor's 1.5x too slow and hid
  the gain of sharding it.

Every probe runs at each count of ``--devices`` (default 8 and 4): the largest is the
profile's top level, the others its ``at_device_counts`` sections, since a device's
share of the cores and a rendezvous's cost change with N (measured: at N = 4 a kernel's
fixed cost 10 µs and a rendezvous 66 µs, against 16 and 148 µs at N = 8). The result is
printed as a profile (JSON); ``--write`` stores it as ``cpu-local.json`` in
:mod:`hlo_shard.profiles`. Nothing here is imported by the cost model: it runs modules
on XLA, so it lives with the runtime, above the profiles it writes.

``--backend gpu`` measures one or more GPUs of this machine the same way (the probes
run through the runtime's worker on jax's GPU backend), but only what a probe there can
separate: read and write bandwidth (a 32 MiB loop is memory-bound on any GPU), the f32
and bf16 dot rates (large enough to leave the launch cost behind), the fixed cost of a
step and, with more than one GPU, the collective α and β. The rest — the vector,
transcendental and reduction rates that a GPU kernel hides behind its memory traffic,
the kernel launch cost (XLA GPU fuses every probe built to count kernels on CPU) and,
on one GPU, the interconnect — is taken from the published profile of that GPU
(``--base``, by default the one ``nvidia-smi`` names), and the profile's ``sources``
say which field came from where. ``--write`` stores it as ``gpu-local.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hlo_shard import profiles
from hlo_shard.errors import HloShardError
from hlo_shard.ir import Alias, InputOutputAlias
from hlo_shard.printer import format_value
from hlo_shard.profiles import DEFAULT_COMBINE_THRESHOLD_BYTES, load_profile, profile_json
from hlo_shard.profiles.detect import profile_for_device
from hlo_shard.runtime.executable import load
from hlo_shard.runtime.inputs import numpy_dtype

_ADD = """HloModule add, replica_count={n}{header}
add {{
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}}
ENTRY e {{
  {body}
}}
"""

ELEMENTS = 1 << 23          # 32 MiB per f32 array
STREAM = 1 << 21            # 8 MiB per f32 array: past the cache, a large weight's size
CHAIN = 16                  # ops per element in the compute probes
DOT = 1024
CONV = (8, 32, 64)          # batch, spatial size, channels of a 3x3 convolution
COLLECTIVE = 1 << 22        # 16 MiB all-reduce
ALL_REDUCE_CHAIN = 17       # dependent all-reduces in the α probe (one more than the slope's)
CACHED = 1 << 17            # 512 KiB per f32 array: a shard that stays in cache
CACHED_CHAIN = 9            # loops in the cache probe (one more in "cache" than "cache_base")
KERNELS = 16                # donated in-place loops in the "kernels" probe ("kernels_base": 1)
LOOPS = 24                  # loops in the "loops" probe, one concatenate's operands
LOOPS_BASE = 9              # loops in "loops_base": still more than XLA CPU fuses (8)
SMALL = 1 << 10             # 4 KiB per array: a bias or a LayerNorm scale
#: The matrices read transposed (rows, columns): 128 KiB to 8 MiB, a small layer's
#: gradient to a large one's, in the cache and past it; each probe reads at least
#: REORDERED_BYTES (as many matrices as that takes), well above a step's fixed costs.
REORDERED = ((256, 128), (768, 192), (1024, 2048))
REORDERED_BYTES = 2 << 20



@dataclass(frozen=True)
class GpuSizes:
    """The GPU probes' sizes. A dot is milliseconds past its launch. The bandwidths are
    the slope between two sizes of the loop and the fill: a step of hundreds of MiB has
    a fixed cost above a tiny step's (launching a large grid, the host's part), which a
    rate from one size with the tiny step's time subtracted counts as memory time; the
    slope leaves out every cost that does not grow with the bytes."""

    dot: int = 8192             # square dot: ~1 TFLOP
    stream: int = 1 << 26       # f32 elements per array of the loop and the fill: 256 MiB
    stream_large: int = 1 << 28  # ... and at the slope's other end: 1 GiB


GPU_SIZES = GpuSizes()
#: Steps of a GPU probe launched back to back per timed run, as jax dispatches a training
#: loop: waiting for each step alone adds the host's round trip, tens of microseconds
#: that vary from step to step, to milliseconds of work.
GPU_PIPELINED = 8

#: Probes that run as a training loop does: their first outputs overwrite as many
#: parameters in place.
DONATED_PROBES = {"stream": 1, "stream_large": 1, "kernels": KERNELS, "kernels_base": 1}


def _module(n: int, body: str, header: str = "") -> str:
    return _ADD.format(n=n, body=body, header=header)


def _cache_chain(loops: int) -> str:
    e = CACHED
    lines = [f"x = f32[{e}] parameter(0)", f"z = f32[{e}] parameter(1)",
             "k = f32[] constant(0.9)", f"c = f32[{e}] broadcast(k), dimensions={{}}"]
    for i in range(loops):
        lines += [f"m{i} = f32[{e}] multiply(c, {'x' if i == 0 else f'y{i - 1}'})",
                  f"y{i} = f32[{e}] add(m{i}, z)"]
    shapes = ", ".join([f"f32[{e}]"] * loops)
    outputs = ", ".join(f"y{i}" for i in range(loops))
    return "\n  ".join(lines + [f"ROOT t = ({shapes}) tuple({outputs})"])


def _in_place_loops(count: int) -> str:
    """``count`` donated arrays, each scaled in place by a loop of its own (XLA CPU runs
    no multi-output fusion): the kernels of a small tensor's optimizer update."""
    e = SMALL
    lines = ["k = f32[] constant(0.9)", f"c = f32[{e}] broadcast(k), dimensions={{}}"]
    for i in range(count):
        lines += [f"w{i} = f32[{e}] parameter({i})", f"y{i} = f32[{e}] multiply(w{i}, c)"]
    shapes = ", ".join([f"f32[{e}]"] * count)
    outputs = ", ".join(f"y{i}" for i in range(count))
    return "\n  ".join(lines + [f"ROOT t = ({shapes}, f32[]) tuple({outputs}, k)"])


def _concatenated_loops(count: int) -> str:
    """``count`` loops, each scaling a 4 KiB parameter into a temporary, and the
    concatenate of them all: with more than 8 operands XLA CPU fuses none of the loops
    into it, so each is a kernel of its own and only the concatenate is returned."""
    e = SMALL
    lines = ["k = f32[] constant(0.9)", f"c = f32[{e}] broadcast(k), dimensions={{}}"]
    for i in range(count):
        lines += [f"w{i} = f32[{e}] parameter({i})", f"y{i} = f32[{e}] multiply(w{i}, c)"]
    loops = ", ".join(f"y{i}" for i in range(count))
    return "\n  ".join(lines + [f"ROOT t = f32[{e * count}] concatenate({loops}), "
                                f"dimensions={{0}}"])


def _aliases(count: int) -> str:
    aliases = InputOutputAlias(tuple(Alias((i,), i) for i in range(count)))
    return f", input_output_alias={format_value(aliases)}"


def last_level_cache_bytes() -> int:
    """This host's last-level cache (sysfs), 0 when it cannot be read."""
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))
    for index in reversed(caches):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return 0


def _all_reduce_chain(length: int) -> str:
    """``length`` 4-byte all-reduces, each of its predecessor's result."""
    lines = ["x0 = f32[1] parameter(0)"] + [
        f"x{i} = f32[1] all-reduce(x{i - 1}), replica_groups={{}}, to_apply=add"
        for i in range(1, length + 1)]
    lines[-1] = "ROOT " + lines[-1]
    return "\n  ".join(lines)


def _dot(element_type: str, size: int) -> str:
    t, d = element_type, size
    return (f"x = {t}[{d},{d}] parameter(0)\n  y = {t}[{d},{d}] parameter(1)\n"
            f"  ROOT d = {t}[{d},{d}] dot(x, y), lhs_contracting_dims={{1}}, "
            f"rhs_contracting_dims={{0}}")


def _stream(e: int) -> str:
    """``w = w * c + g`` on ``e`` elements, w donated: an optimizer's in-place update."""
    return (f"w = f32[{e}] parameter(0)\n  g = f32[{e}] parameter(1)\n"
            f"  k = f32[] constant(0.999)\n  c = f32[{e}] broadcast(k), dimensions={{}}\n"
            f"  m = f32[{e}] multiply(w, c)\n  a = f32[{e}] add(m, g)\n"
            f"  z = f32[] constant(0)\n  ROOT t = (f32[{e}], f32[]) tuple(a, z)")


def _reordered_count(rows: int, columns: int) -> int:
    return max(1, REORDERED_BYTES // (4 * rows * columns))


def _reordered(rows: int, columns: int, transposed: bool) -> str:
    """``x + y`` into fresh matrices, each ``x`` read in transposed order or not: the
    loop an update runs on a gradient the partitioner transposes into its weight's order
    (:func:`_reordered_count` of them, independent)."""
    count = _reordered_count(rows, columns)
    shape = f"f32[{columns},{rows}]"
    lines = []
    for i in range(count):
        lines += [f"x{i} = {f'f32[{rows},{columns}]' if transposed else shape} parameter({2 * i})",
                  f"y{i} = {shape} parameter({2 * i + 1})"]
        if transposed:
            lines.append(f"t{i} = {shape} transpose(x{i}), dimensions={{1,0}}")
        lines.append(f"sum{i} = {shape} add({'t' if transposed else 'x'}{i}, y{i})")
    outputs = ", ".join(f"sum{i}" for i in range(count))
    return "\n  ".join(lines + [f"ROOT r = ({', '.join([shape] * count)}) tuple({outputs})"])


def _fill(e: int) -> str:
    return f"k = f32[] constant(1)\n  ROOT b = f32[{e}] broadcast(k), dimensions={{}}"


def _probes(n: int) -> dict[str, str]:
    e = ELEMENTS
    chain_fma = "\n  ".join(
        f"m{i} = f32[{e}] multiply({'x' if i == 0 else f'a{i - 1}'}, c)\n  "
        f"a{i} = f32[{e}] add(m{i}, x)" for i in range(CHAIN))
    chain_sqrt = "\n  ".join(
        f"q{i} = f32[{e}] sqrt({'x' if i == 0 else f'q{i - 1}'})" for i in range(CHAIN))
    return {
        "stream": _stream(STREAM),
        "reduction": f"x = f32[{e}] parameter(0)\n  z = f32[] constant(0)\n"
                     f"  ROOT r = f32[] reduce(x, z), dimensions={{0}}, to_apply=add",
        "write": _fill(e),
        "vector": f"x = f32[{e}] parameter(0)\n  k = f32[] constant(0.999)\n"
                  f"  c = f32[{e}] broadcast(k), dimensions={{}}\n  {chain_fma}\n"
                  f"  ROOT r = f32[{e}] copy(a{CHAIN - 1})",
        "transcendental": f"x = f32[{e}] parameter(0)\n  {chain_sqrt}\n"
                          f"  ROOT r = f32[{e}] copy(q{CHAIN - 1})",
        "matrix": _dot("f32", DOT),
        "convolution": f"x = f32[{CONV[0]},{CONV[1]},{CONV[1]},{CONV[2]}] parameter(0)\n"
                       f"  k = f32[3,3,{CONV[2]},{CONV[2]}] parameter(1)\n"
                       f"  ROOT y = f32[{CONV[0]},{CONV[1]},{CONV[1]},{CONV[2]}] "
                       f"convolution(x, k), window={{size=3x3 pad=1_1x1_1}}, "
                       f"dim_labels=b01f_01io->b01f",
        "small_all_reduce": "x = f32[1] parameter(0)\n"
                            "  ROOT r = f32[1] all-reduce(x), replica_groups={}, to_apply=add",
        "all_reduce_chain": _all_reduce_chain(ALL_REDUCE_CHAIN),
        "large_all_reduce": f"x = f32[{COLLECTIVE}] parameter(0)\n"
                            f"  ROOT r = f32[{COLLECTIVE}] all-reduce(x), replica_groups={{}}, "
                            f"to_apply=add",
        "cache": _cache_chain(CACHED_CHAIN),
        "cache_base": _cache_chain(1),
        "kernels": _in_place_loops(KERNELS),
        "kernels_base": _in_place_loops(1),
        "loops": _concatenated_loops(LOOPS),
        "loops_base": _concatenated_loops(LOOPS_BASE),
        "overhead": "x = f32[] parameter(0)\n  ROOT r = f32[] add(x, x)",
        **{f"reordered_{k}": _reordered(*size, True) for k, size in enumerate(REORDERED)},
        **{f"reordered_base_{k}": _reordered(*size, False) for k, size in enumerate(REORDERED)},
    }


#: The probes that need more than one device.
COLLECTIVE_PROBES = ("small_all_reduce", "all_reduce_chain", "large_all_reduce")


def _gpu_probes(n: int, sizes: GpuSizes = GPU_SIZES) -> dict[str, str]:
    common = _probes(n)
    probes = {"stream": _stream(sizes.stream), "stream_large": _stream(sizes.stream_large),
              "write": _fill(sizes.stream), "write_large": _fill(sizes.stream_large),
              "overhead": common["overhead"]}
    probes |= {f"matrix_{t}": _dot(t, sizes.dot) for t in ("f32", "bf16")}
    if n > 1:
        probes |= {name: common[name] for name in COLLECTIVE_PROBES}
    return probes


def measure(n: int, runs: int = 5, rounds: int = 3, backend: str = "cpu",
            probes: dict[str, str] | None = None, pipelined: int = 1) -> dict[str, float]:
    """Seconds per step of each probe (default: the CPU set) on ``n`` devices of
    ``backend``: the median over ``rounds`` rounds, each timing every probe in turn
    (median of ``runs``), so that a burst of load on a shared host moves one round of
    each probe rather than some probes. ``pipelined``: each run that many steps
    launched back to back (:func:`~hlo_shard.runtime.time_interleaved`)."""
    from statistics import median

    import numpy as np

    executables = {}
    for name, body in (_probes(n) if probes is None else probes).items():
        donated = DONATED_PROBES.get(name, 0)
        executables[name] = load(_module(n, body, _aliases(donated) if donated else ""),
                                         n, backend, donate=bool(donated))
    per_round: dict[str, list[float]] = {name: [] for name in executables}
    try:
        for _ in range(rounds):
            for name, executable in executables.items():
                args = [np.ones(shape.dims, numpy_dtype(shape.element_type))
                        for shape in executable.parameters]
                per_round[name].append(executable.time(*args, runs=runs, warmup=1,
                                                        pipelined=pipelined).median)
    finally:
        for executable in executables.values():
            executable.close()
    return {name: median(times) for name, times in per_round.items()}


def profile_from_measurements(n: int, t: dict[str, float]) -> dict:
    """Per-device rates implied by the probe times on ``n`` devices."""
    overhead = t["overhead"]
    e = ELEMENTS
    # A donated elementwise loop reads two arrays and writes the first in place.
    read = 3 * 4 * STREAM / max(t["stream"] - overhead, 1e-9)
    # The sum streams its input and adds (``overlaps_compute_and_memory`` is false).
    reduction = e / max(t["reduction"] - overhead - 4 * e / read, 1e-9)
    write = 4 * e / max(t["write"] - overhead, 1e-9)
    # The chains read x and write one result; the rest is arithmetic.
    streaming = 4 * e / read + 4 * e / write
    vector = 2 * CHAIN * e / max(t["vector"] - overhead - streaming, 1e-9)
    transcendental = CHAIN * e / max(t["transcendental"] - overhead - streaming, 1e-9)
    matrix = 2 * DOT ** 3 / max(t["matrix"] - overhead, 1e-9)
    b, hw, c = CONV
    convolution = 2 * b * hw * hw * c * c * 9 / max(t["convolution"] - overhead, 1e-9)
    # Each extra loop streams its 4 KiB in and out, and the concatenate copies it again.
    kernel = max((t["loops"] - t["loops_base"]) / (LOOPS - LOOPS_BASE) - 4 * 4 * SMALL / read, 0.0)
    # Each extra in-place loop of the kernels probe is a kernel, its streaming and an output.
    output = max((t["kernels"] - t["kernels_base"]) / (KERNELS - 1) - 2 * 4 * SMALL / read
                 - kernel, 0.0)
    cached = (CACHED_CHAIN - 1) * 3 * 4 * CACHED / max(t["cache"] - t["cache_base"], 1e-9)
    alpha = max(t["all_reduce_chain"] - t["small_all_reduce"], 0.0) / (ALL_REDUCE_CHAIN - 1)
    wire = 2 * (n - 1) / n * 4 * COLLECTIVE
    beta = wire / max(t["large_all_reduce"] - t["small_all_reduce"], 1e-9)
    link = {"alpha_s": alpha, "beta_bytes_per_s": beta}
    # The transposed reads' extra time over the same loops reading in order, in reads of
    # the matrices at the streaming rate; the smallest over the sizes (an input's
    # transposed reads priced too high would overstate what removing them gains).
    reordered = min(
        1 + max(t[f"reordered_{k}"] - t[f"reordered_base_{k}"], 0.0)
        / (_reordered_count(rows, columns) * 4 * rows * columns / read)
        for k, (rows, columns) in enumerate(REORDERED))
    return {
        "name": "cpu-local",
        "description": f"This machine ({platform.machine()}, {platform.processor() or 'cpu'}) "
                       f"as {n} XLA CPU devices sharing its cores, measured",
        "matrix_flops_per_s": {"f32": matrix, "default": matrix},
        "convolution_flops_per_s": {"f32": convolution, "default": convolution},
        "vector_flops_per_s": {"f32": vector, "default": vector},
        "transcendentals_per_s": transcendental,
        "reduction_elements_per_s": reduction,
        "memory_bandwidth_bytes_per_s": read,
        "memory_write_bandwidth_bytes_per_s": write,
        "cache_bytes": last_level_cache_bytes() // n,
        # Below the streaming rate, the probe measured its kernels' fixed costs rather
        # than the cache: kernels that fit run no slower than those that stream.
        "cache_bandwidth_bytes_per_s": max(cached, read),
        "upcasts_16bit_floats": True,
        "multi_output_fusion": False,
        "fused_concatenate_operands": 8,
        "row_major_reductions": True,
        "reordered_read_factor": reordered,
        "min_predicted_gain": 0.1,
        "overlaps_compute_and_memory": False,
        "combine_threshold_bytes": DEFAULT_COMBINE_THRESHOLD_BYTES,
        "fresh_temp_threshold_bytes": 32 << 20,
        "combined_collectives": ["all-reduce"],
        "kernel_overhead_s": kernel,
        "output_overhead_s": output,
        "step_overhead_s": overhead,
        "interconnect": {"algorithm": "shared-memory", "devices_per_node": 1 << 20,
                         "intra_node": link, "inter_node": link},
        "sources": [
            f"measured by hlo_shard.runtime.calibrate on {time.strftime('%Y-%m-%d')} with "
            f"{n} CPU devices (probe medians, seconds): "
            + ", ".join(f"{k} {v:.3g}" for k, v in t.items()),
            "rates are per device while all devices run at once; valid for this device count "
            "(the other counts measured are under at_device_counts)",
            "cache_bytes: the last-level cache (sysfs) over the devices",
            "XLA CPU runs no multi-output fusion (its pipeline has loop fusion only; Adam "
            "compiles to separate m, v and w loops)",
            "fused_concatenate_operands: XLA CPU fuses nothing into a concatenate of more "
            "than 8 operands (cpu_instruction_fusion.cc, kMaxConcatenateArguments)",
            "row_major_reductions: XLA CPU copies a reduce's operand laid out other than "
            "row-major into row-major first (a transpose_copy_fusion before the reduce)",
            "reordered_read_factor: the loop x + y with x read through a transpose over the "
            "same loop reading x in order, the difference in streaming reads of x, the "
            "smallest over 128 KiB to 8 MiB matrices (XLA CPU duplicates such a transpose "
            "into every fusion reading it)",
            "min_predicted_gain 0.10: the cost model's error on the zoo's small modules at "
            "N = 8 (forced sharding of the conv net predicted 0.92-0.94x, measured "
            "1.01-1.12x; of the transformer block gathered 0.97-0.99x, measured 1.01-1.04x), "
            "where the wide ones are predicted within 0.05 or pessimistically",
            "memory_bandwidth_bytes_per_s from the donated elementwise loop, "
            "reduction_elements_per_s from the sum (one chain of additions per output)",
            "overlaps_compute_and_memory false: the N devices share the host's cores, so a "
            "loop's streaming and arithmetic add up (the Adam update measures their sum)",
            "fresh_temp_threshold_bytes: glibc's largest mmap threshold (32 MiB): a larger "
            "temp allocation is mapped afresh every step",
            "XLA CPU combines all-reduces only (no all-gather or reduce-scatter combiner in "
            "its pipeline): each all-gather and reduce-scatter pays its own latency",
            "kernel_overhead_s: the cost of one more loop over 4 KiB beyond its streaming, "
            "among the operands of a concatenate too wide to fuse (once assumed to be 2 us)",
            "output_overhead_s: one more donated in-place loop over 4 KiB, returned, beyond "
            "its streaming and its kernel (priced as a kernel, the zoo's Adafactor modules "
            "were predicted 1.5x their measured step and their sharding's gain hidden)",
        ],
    }


#: The fields a device count's measurement sets (``at_device_counts``): the rest — the
#: backend's fusion rules, thresholds, notes — are the host's, the same at any count.
MEASURED_FIELDS = ("description", "matrix_flops_per_s", "convolution_flops_per_s",
                   "vector_flops_per_s", "transcendentals_per_s", "reduction_elements_per_s",
                   "memory_bandwidth_bytes_per_s", "memory_write_bandwidth_bytes_per_s",
                   "cache_bytes", "cache_bandwidth_bytes_per_s", "reordered_read_factor",
                   "kernel_overhead_s",
                   "output_overhead_s", "step_overhead_s", "interconnect")


def gpu_profile_from_measurements(n: int, t: dict[str, float], base: dict,
                                  sizes: GpuSizes = GPU_SIZES) -> dict:
    """A GPU profile: the rates the GPU probes on ``n`` devices measured (square dots
    and loops of ``sizes``), every other field from ``base`` (the published profile of
    that GPU, as a dict)."""
    overhead = t["overhead"]
    grown = sizes.stream_large - sizes.stream
    read = 3 * 4 * grown / max(t["stream_large"] - t["stream"], 1e-9)
    write = 4 * grown / max(t["write_large"] - t["write"], 1e-9)
    dots = {kind: 2 * sizes.dot ** 3 / max(t[f"matrix_{kind}"] - overhead, 1e-9)
            for kind in ("f32", "bf16")}
    measured = ["memory_bandwidth_bytes_per_s", "memory_write_bandwidth_bytes_per_s",
                "matrix_flops_per_s f32 and bf16", "step_overhead_s"]
    profile = {**base, "name": "gpu-local",
               "description": f"This machine's GPU ({n} device{'s' if n > 1 else ''}), measured "
                              f"where a probe separates the rate; the rest from {base['name']}",
               "matrix_flops_per_s": {**base["matrix_flops_per_s"], **dots},
               "memory_bandwidth_bytes_per_s": read,
               "memory_write_bandwidth_bytes_per_s": write,
               "step_overhead_s": overhead}
    if n > 1:
        alpha = max(t["all_reduce_chain"] - t["small_all_reduce"], 0.0) / (ALL_REDUCE_CHAIN - 1)
        wire = 2 * (n - 1) / n * 4 * COLLECTIVE
        beta = wire / max(t["large_all_reduce"] - t["small_all_reduce"], 1e-9)
        profile["interconnect"] = {**base["interconnect"],
                                   "intra_node": {"alpha_s": alpha, "beta_bytes_per_s": beta}}
        measured.append("interconnect intra_node (ring accounting)")
    profile["sources"] = [
        f"measured by hlo_shard.runtime.calibrate --backend gpu on {time.strftime('%Y-%m-%d')} "
        f"with {n} GPU device{'s' if n > 1 else ''} (probe medians, seconds): "
        + ", ".join(f"{k} {v:.3g}" for k, v in t.items()),
        "measured: " + ", ".join(measured),
        f"every other field from the {base['name']} profile (published figures and its "
        f"assumptions, below): the vector, transcendental and reduction rates hide behind "
        f"memory traffic in a GPU kernel, XLA GPU fuses the probes that count kernels on "
        f"CPU" + ("" if n > 1 else ", and one GPU has no interconnect to measure"),
        *base.get("sources", [])]
    return profile


def gpu_profile(devices: int, base_name: str, runs: int = 5, rounds: int = 3,
                backend: str = "gpu", sizes: GpuSizes = GPU_SIZES) -> dict:
    """Measure ``devices`` GPUs; ``base_name``: the profile (name or file) of the rest.
    (``backend`` and ``sizes``: the same probes elsewhere, as the tests run them on CPU.)"""
    load_profile(base_name)  # a bad base is one error before anything runs
    base, _ = profile_json(base_name)
    assert isinstance(base, dict)
    return gpu_profile_from_measurements(
        devices, measure(devices, runs, rounds, backend, _gpu_probes(devices, sizes),
                         GPU_PIPELINED), base, sizes)


def nvidia_gpus() -> list[str]:
    """The GPU names ``nvidia-smi`` lists (none where it is absent or fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()]


def gpu_base(names: list[str]) -> str:
    """The published profile for the first of ``names`` (the nearest one when none)."""
    return profile_for_device("gpu", names[0] if names else "")[0]


#: Fields of the CPU profile its probes cannot measure (they are compiled from unfused
#: text, so XLA fuses them itself): kept from the profile being replaced, at every
#: device count, so that ``--write`` does not drop them.
CARRIED_FIELDS = ("fused_kernel_overhead_s",)


def calibrated_profile(counts: list[int], runs: int = 5, rounds: int = 3,
                       previous: dict | None = None) -> dict:
    """The profile measured at the largest of ``counts``, with the measured fields at
    each other count under ``at_device_counts`` (N devices share the host's cores, so a
    device's rates and a rendezvous's cost depend on N), and the :data:`CARRIED_FIELDS`
    of ``previous`` (default: the shipped ``cpu-local`` profile)."""
    largest, *others = sorted(set(counts), reverse=True)
    profile = profile_from_measurements(largest, measure(largest, runs, rounds))
    profile["calibrated_devices"] = largest
    if others:
        profile["at_device_counts"] = {}
        for n in others:
            measured = profile_from_measurements(n, measure(n, runs, rounds))
            profile["at_device_counts"][str(n)] = {key: measured[key] for key in MEASURED_FIELDS}
            profile["sources"].insert(1, measured["sources"][0])
    return carry_unmeasured(profile, profile_json("cpu-local")[0] if previous is None
                            else previous)


def carry_unmeasured(profile: dict, previous: object) -> dict:
    """``profile`` with the :data:`CARRIED_FIELDS` ``previous`` has (top level and per
    device count it also has), each with a source line saying it was carried over."""
    if not isinstance(previous, dict):
        return profile
    sections = previous.get("at_device_counts")
    for key in CARRIED_FIELDS:
        if key not in previous:
            continue
        profile[key] = previous[key]
        for count, fields in profile.get("at_device_counts", {}).items():
            old = sections.get(count, {}) if isinstance(sections, dict) else {}
            if isinstance(old, dict) and key in old:
                fields[key] = old[key]
        profile.setdefault("sources", []).append(
            f"{key}: carried over from the profile this one replaces (calibrate's probes "
            f"are unfused modules and cannot measure it)")
    return profile


@dataclass(frozen=True)
class Backend:
    """How ``calibrate`` measures one backend."""

    #: The profile file ``--write`` stores.
    output: str
    #: ``--devices`` when not given (None: as many as the machine has).
    default_devices: str | None
    measure: Callable[[list[int], str | None, int, int], dict]


BACKENDS = {
    "cpu": Backend("cpu-local.json", "8,4",
                   lambda counts, base, runs, rounds: calibrated_profile(counts, runs, rounds)),
    "gpu": Backend("gpu-local.json", None,
                   lambda counts, base, runs, rounds: gpu_profile(
                       max(counts), base or gpu_base(nvidia_gpus()), runs, rounds)),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="cpu",
                        help="the devices to measure (gpu: through jax's GPU backend)")
    parser.add_argument("--devices", default=None,
                        help="device counts to measure at (comma-separated; the largest is "
                             "the profile's top level); cpu: 8,4, gpu: every GPU nvidia-smi "
                             "lists (the largest count only)")
    parser.add_argument("--base", default=None,
                        help="gpu: the published profile whose unmeasured fields are kept "
                             "(default: from the GPU's name, else h100)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true",
                        help="store in hlo_shard/profiles as cpu-local.json / gpu-local.json")
    parser.add_argument("--output", type=Path, default=None, help="also write the profile here")
    options = parser.parse_args(argv)
    backend = BACKENDS[options.backend]
    devices = options.devices or backend.default_devices or str(max(len(nvidia_gpus()), 1))
    try:
        counts = [int(n) for n in devices.split(",")]
    except ValueError:
        parser.error(f"--devices: expected counts such as 8,4, got {devices!r}")
    if min(counts) < 1:
        parser.error("--devices: a device count is at least 1")
    if options.runs < 1 or options.rounds < 1:
        parser.error("--runs and --rounds are at least 1")
    if options.base is not None and options.backend != "gpu":
        parser.error("--base: only with --backend gpu (a CPU profile is all measured)")
    try:
        profile = backend.measure(counts, options.base, options.runs, options.rounds)
    except HloShardError as err:
        print(f"calibrate: {str(err).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None
    text = json.dumps(profile, indent=2) + "\n"
    if options.write:
        (Path(profiles.__file__).parent / backend.output).write_text(text)
    if options.output is not None:
        options.output.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
