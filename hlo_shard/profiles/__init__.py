"""Hardware profiles: the rates the cost model turns counts into seconds with.

Profiles are data (one JSON file per device kind in this package) so that a user can
copy one, change a number and pass the file with ``--profile FILE``. Every number is
*per device* — the unit a data-parallel replica runs on (a TPU v3 TensorCore, a GPU,
an XLA CPU device) — and every profile lists its ``sources``; numbers that are not
published are marked as assumptions there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from hlo_shard.errors import HloShardError
from hlo_shard.schema import REQUIRED, At, load_json


@dataclass(frozen=True, slots=True)
class Link:
    """α-β parameters of one level of the interconnect."""

    alpha_s: float  #: latency of one algorithm step (s)
    beta_bytes_per_s: float  #: bytes one device moves per second (bus bandwidth)


@dataclass(frozen=True, slots=True)
class Interconnect:
    #: ``ring``, ``tree``, ``torus2d``, ``torus3d`` or ``shared-memory`` (XLA's CPU
    #: devices; see collective_model).
    algorithm: str
    #: A group larger than this crosses the slower ``inter_node`` links.
    devices_per_node: int
    intra_node: Link
    inter_node: Link

    def link_for(self, group_size: int) -> Link:
        return self.intra_node if group_size <= self.devices_per_node else self.inter_node


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    description: str
    #: Dense matrix units (dot, convolution), by element type with a ``default``.
    matrix_flops_per_s: dict[str, float]
    #: Convolutions, by element type with a ``default`` (XLA CPU runs them through Eigen's
    #: spatial convolution, far below its dot rate); the matrix rates when not given.
    convolution_flops_per_s: dict[str, float]
    #: Everything else (elementwise, reductions), by element type with a ``default``.
    vector_flops_per_s: dict[str, float]
    transcendentals_per_s: float
    #: Elements per second a reduce consumes (XLA CPU keeps the order of floating-point
    #: sums, so its reductions do not vectorise: ~2 G elements/s against tens of GFLOP/s
    #: for elementwise loops, whichever dimensions they reduce); the vector rate when
    #: the profile does not say.
    reduction_elements_per_s: float
    memory_bandwidth_bytes_per_s: float
    #: Writes into freshly allocated buffers where they cost more than reads (a host's
    #: page faults); the memory bandwidth when the profile does not say.
    memory_write_bandwidth_bytes_per_s: float
    #: A device's share of the last-level cache (0: none modelled): a kernel whose
    #: reads and writes together fit moves them at ``cache_bandwidth_bytes_per_s``.
    cache_bytes: int
    cache_bandwidth_bytes_per_s: float
    #: Fixed cost per launched kernel (GPU launch, CPU thunk dispatch); 0 on TPU.
    kernel_overhead_s: float
    #: The same, per kernel of a module XLA has fused already (what XLA:CPU's pass hook
    #: sees): every kernel is then explicit, the forward pass's chains and loop bodies
    #: included, and a whole step measures a lower fixed cost per kernel than the probe
    #: of independent loops behind ``kernel_overhead_s``; that rate when not given.
    fused_kernel_overhead_s: float
    #: Fixed cost of one step whatever it computes (XLA CPU: dispatch, the devices'
    #: threads meeting); 0 when the profile does not say.
    step_overhead_s: float
    #: Fixed cost per leaf of the step's outputs (XLA CPU: a buffer per device, its
    #: event and array handed back — 13 us a leaf at N = 8, where a kernel costs 16);
    #: 0 when the profile does not say.
    output_overhead_s: float
    #: bf16/f16 arithmetic runs in f32 (XLA CPU), so such temporaries take 4 bytes.
    upcasts_16bit_floats: bool
    #: XLA fuses a producer into several readers' loop, or a value also needed in
    #: memory into its reader (multi-output fusion): GPU and TPU yes, CPU no.
    multi_output_fusion: bool
    #: The smallest predicted saving the pass acts on: below it a prediction is within
    #: the cost model's measured error on this hardware, and a user must never get a
    #: slower step.
    min_predicted_gain: float
    #: The most operands of a concatenate XLA fuses its producers into (XLA CPU: 8, a
    #: wider one copies them from memory); 0: no limit.
    fused_concatenate_operands: int
    #: XLA's reduction kernels read their operand in row-major order (XLA CPU): a reduce
    #: of a value laid out otherwise (a gradient computed transposed, summed for a global
    #: norm) first copies it into that order, a transposing kernel of its own.
    row_major_reductions: bool
    #: A kernel's arithmetic hides behind its memory traffic (or the reverse), so it
    #: takes the larger of the two (the roofline of a GPU or TPU); False: they add up
    #: (XLA CPU's N devices share the host's few cores, which issue both: a Adam loop
    #: measures the sum of its streaming and its arithmetic time).
    overlaps_compute_and_memory: bool
    #: XLA's collective combiners pack independent collectives into buckets this large.
    combine_threshold_bytes: int
    #: A step's temporary allocation larger than this is mapped afresh every step, its
    #: pages faulting in at the fresh-buffer write rate (XLA CPU allocates it with
    #: malloc per execution, and glibc serves blocks above its largest mmap threshold,
    #: 32 MiB, with mmap and unmaps them on free); 0: the allocator keeps its pages
    #: (the BFC allocators of GPU and TPU).
    fresh_temp_threshold_bytes: int
    #: The collective kinds a combiner exists for on this backend (XLA GPU and TPU:
    #: all-reduce, all-gather, reduce-scatter; XLA CPU: all-reduce only); the others run
    #: one collective, one latency, each.
    combined_collectives: frozenset[str]
    interconnect: Interconnect
    sources: tuple[str, ...]
    #: Memory one device may fill (its HBM; 0: not known, as for XLA CPU devices that
    #: share the host's memory): what decides for memory where speed does not.
    device_memory_bytes: int = 0
    #: How many times a streaming read a kernel's read of an operand in transposed order
    #: costs (XLA CPU's loops gather such an operand element by element, where a GPU's
    #: or TPU's transpose kernels tile it); 1 when the profile does not say.
    reordered_read_factor: float = 1.0
    #: The device count the rates were measured at, where N devices share one host's
    #: cores and every rate is a share of it (XLA CPU); 0: the same on any count.
    calibrated_devices: int = 0
    #: The same host measured at other device counts (the rates above at
    #: ``calibrated_devices``): a module's estimate takes the one nearest its own count.
    #: ``dataclasses.replace`` of a rate changes the top level only; clear this to price
    #: every device count with it.
    at_device_counts: tuple[HardwareProfile, ...] = ()

    def for_devices(self, devices: int) -> HardwareProfile:
        """This profile as measured at the device count nearest ``devices`` (itself where
        it was measured at one count only): at N = 4 on two cores a device runs about
        twice as fast as at N = 8, and a rendezvous costs a third."""
        if not self.at_device_counts:
            return self
        return min((self, *self.at_device_counts),
                   key=lambda p: (abs(p.calibrated_devices - devices), p.calibrated_devices))

    def memory_seconds(self, read_bytes: float, written_bytes: float,
                       resident: bool = False) -> float:
        """``resident``: the written buffer is a donated parameter's, whose pages are
        mapped already, so its stores stream at the read rate; the write rate is that of
        a fresh buffer (calibrate fills a new one: page faults on every page)."""
        if 0 < read_bytes + written_bytes <= self.cache_bytes:
            return (read_bytes + written_bytes) / self.cache_bandwidth_bytes_per_s
        write_rate = (self.memory_bandwidth_bytes_per_s if resident
                      else self.memory_write_bandwidth_bytes_per_s)
        return read_bytes / self.memory_bandwidth_bytes_per_s + written_bytes / write_rate

    def fresh_pages_seconds(self, temp_bytes: int) -> float:
        """What a temporary allocation of ``temp_bytes`` adds to a step by being mapped
        afresh (its writes were priced at the resident rate by the kernels)."""
        if not self.fresh_temp_threshold_bytes or temp_bytes <= self.fresh_temp_threshold_bytes:
            return 0.0
        return max(self.memory_seconds(0.0, temp_bytes) - self.memory_seconds(0.0, temp_bytes,
                                                                              True), 0.0)

    def matrix_rate(self, element_type: str) -> float:
        return self.matrix_flops_per_s.get(element_type, self.matrix_flops_per_s["default"])

    def convolution_rate(self, element_type: str) -> float:
        rates = self.convolution_flops_per_s
        return rates.get(element_type, rates["default"])

    def vector_rate(self, element_type: str) -> float:
        return self.vector_flops_per_s.get(element_type, self.vector_flops_per_s["default"])

    def with_algorithm(self, algorithm: str) -> HardwareProfile:
        return replace(self, interconnect=replace(self.interconnect, algorithm=algorithm),
                       at_device_counts=tuple(p.with_algorithm(algorithm)
                                              for p in self.at_device_counts))


ALGORITHMS = ("ring", "tree", "torus2d", "torus3d", "shared-memory")
#: ``min_predicted_gain`` where a profile does not give its own.
DEFAULT_MIN_PREDICTED_GAIN = 0.05
#: The collective kinds XLA has a combiner pass for (a profile's ``combined_collectives``
#: is a subset; all of them when it does not say).
COMBINABLE_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter")
#: ``combine_threshold_bytes`` where a profile does not give its own: XLA GPU's default
#: all-reduce combine threshold (``xla_gpu_all_reduce_combine_threshold_bytes``), the one
#: bucket size the cost model and the sharding pass's combined collectives agree on.
DEFAULT_COMBINE_THRESHOLD_BYTES = 30 << 20

#: The profile every command prices on unless told the target: the calibrated XLA CPU
#: devices (CPU being the default backend), so that ``optimize`` decides, and ``report``,
#: ``diff`` and ``scale`` estimate, on one and the same hardware.
DEFAULT_PROFILE = "cpu-local"


def available_profiles() -> list[str]:
    """Names of the profiles shipped with hlo-shard."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir()
                  if p.name.endswith(".json"))


def resolve_profile(profile: HardwareProfile | str | None = None) -> HardwareProfile:
    """The profile to price on: ``profile`` itself, the one of that name or file
    (:func:`load_profile`), or :data:`DEFAULT_PROFILE` when none is given."""
    if isinstance(profile, HardwareProfile):
        return profile
    return load_profile(DEFAULT_PROFILE if profile is None else profile)


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (``tpu-v3``), or a user profile from a JSON file."""
    return profile_from_dict(*profile_json(name_or_path))


def profile_json(name_or_path: str) -> tuple[object, str]:
    """The JSON of a shipped profile by name, or of a user's file, unchecked (what
    :func:`profile_from_dict` builds from), and where it came from."""
    shipped = resources.files(__name__) / f"{name_or_path}.json"
    if shipped.is_file():
        return json.loads(shipped.read_text(encoding="utf-8")), name_or_path
    path = Path(name_or_path)
    if not path.is_file():
        raise HloShardError(
            f"unknown profile {name_or_path!r}: not a file, and not one of "
            f"{', '.join(available_profiles())}")
    return load_json(path, "profile"), str(path)


def profile_from_dict(data: object, origin: str) -> HardwareProfile:
    """Validate and build a profile; a bad field is one error naming its place.
    ``at_device_counts`` maps a device count to the fields measured there, which
    replace the top level's in the profile :meth:`HardwareProfile.for_devices` returns."""
    at = At(f"profile {origin}")
    raw = at.object(data)
    sections = at.read(raw, "at_device_counts", At.object, default={})
    top = {k: v for k, v in raw.items() if k != "at_device_counts"}
    base = _profile_fields(at, top, origin)
    others = []
    for key, fields in sections.items():
        where = at.key("at_device_counts").key(key)
        if not key.isdigit() or int(key) < 1:
            where.fail(f"expected a device count, got {key!r}")
        others.append(_profile_fields(
            where, {**top, **where.object(fields), "calibrated_devices": int(key)}, origin))
    if others and not base.calibrated_devices:
        at.key("calibrated_devices").fail("needed with at_device_counts")
    return replace(base, at_device_counts=tuple(others))


def _profile_fields(at: At, raw: dict, origin: str) -> HardwareProfile:
    net = at.read(raw, "interconnect", At.object)
    net_at = at.key("interconnect")
    intra = net_at.read(net, "intra_node", _link)
    bandwidth = at.read(raw, "memory_bandwidth_bytes_per_s", At.number, positive=True)
    matrix = at.read(raw, "matrix_flops_per_s", _rates)
    vector = at.read(raw, "vector_flops_per_s", _rates)

    def rate(name: str, default: float | None = None) -> float:
        return at.read(raw, name, At.number, positive=True,
                       default=REQUIRED if default is None else default)

    def count(name: str, default: int) -> int:
        return int(at.read(raw, name, At.number, low=0, default=default))

    kernel_overhead = at.read(raw, "kernel_overhead_s", At.number, low=0, default=0.0)

    return HardwareProfile(
        name=at.read(raw, "name", At.string, default=origin),
        description=at.read(raw, "description", At.string, default=""),
        matrix_flops_per_s=matrix,
        convolution_flops_per_s=at.read(raw, "convolution_flops_per_s", _rates, default=matrix),
        vector_flops_per_s=vector,
        transcendentals_per_s=rate("transcendentals_per_s"),
        reduction_elements_per_s=rate("reduction_elements_per_s", vector["default"]),
        memory_bandwidth_bytes_per_s=bandwidth,
        memory_write_bandwidth_bytes_per_s=rate("memory_write_bandwidth_bytes_per_s", bandwidth),
        cache_bytes=count("cache_bytes", 0),
        cache_bandwidth_bytes_per_s=rate("cache_bandwidth_bytes_per_s", bandwidth),
        kernel_overhead_s=kernel_overhead,
        fused_kernel_overhead_s=at.read(raw, "fused_kernel_overhead_s", At.number, low=0,
                                        default=kernel_overhead),
        step_overhead_s=at.read(raw, "step_overhead_s", At.number, low=0, default=0.0),
        output_overhead_s=at.read(raw, "output_overhead_s", At.number, low=0, default=0.0),
        upcasts_16bit_floats=at.read(raw, "upcasts_16bit_floats", At.boolean, default=False),
        multi_output_fusion=at.read(raw, "multi_output_fusion", At.boolean, default=True),
        fused_concatenate_operands=count("fused_concatenate_operands", 0),
        row_major_reductions=at.read(raw, "row_major_reductions", At.boolean, default=False),
        reordered_read_factor=at.read(raw, "reordered_read_factor", At.number, low=1,
                                      default=1.0),
        min_predicted_gain=at.read(raw, "min_predicted_gain", At.number, low=0,
                                   default=DEFAULT_MIN_PREDICTED_GAIN),
        overlaps_compute_and_memory=at.read(raw, "overlaps_compute_and_memory", At.boolean,
                                            default=True),
        combine_threshold_bytes=count("combine_threshold_bytes", DEFAULT_COMBINE_THRESHOLD_BYTES),
        fresh_temp_threshold_bytes=count("fresh_temp_threshold_bytes", 0),
        combined_collectives=frozenset(
            at.key("combined_collectives").index(i).string(kind, COMBINABLE_COLLECTIVES)
            for i, kind in enumerate(at.read(raw, "combined_collectives", At.array,
                                             default=list(COMBINABLE_COLLECTIVES)))),
        interconnect=Interconnect(
            algorithm=net_at.read(net, "algorithm", At.string, ALGORITHMS, default="ring"),
            devices_per_node=net_at.read(net, "devices_per_node", At.integer, 1,
                                         default=1 << 30),
            intra_node=intra,
            inter_node=net_at.read(net, "inter_node", _link, default=intra),
        ),
        sources=tuple(at.key("sources").index(i).string(source) for i, source in
                      enumerate(at.read(raw, "sources", At.array, default=[]))),
        calibrated_devices=count("calibrated_devices", 0),
        device_memory_bytes=count("device_memory_bytes", 0),
    )


def _rates(at: At, value: object) -> dict[str, float]:
    rates = at.object(value)
    at.read(rates, "default", At.number, positive=True)
    return {key: at.key(key).number(rate, positive=True) for key, rate in rates.items()}


def _link(at: At, value: object) -> Link:
    link = at.object(value)
    return Link(alpha_s=at.read(link, "alpha_s", At.number, low=0),
                beta_bytes_per_s=at.read(link, "beta_bytes_per_s", At.number, positive=True))
