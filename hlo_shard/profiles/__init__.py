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
    memory_bandwidth_bytes_per_s: float
    #: Writes into freshly allocated buffers where they cost more than reads (a host's
    #: page faults); the memory bandwidth when the profile does not say.
    memory_write_bandwidth_bytes_per_s: float
    memory_capacity_bytes: int
    #: A device's share of the last-level cache (0: none modelled): a kernel whose
    #: reads and writes together fit moves them at ``cache_bandwidth_bytes_per_s``.
    cache_bytes: int
    cache_bandwidth_bytes_per_s: float
    #: Fixed cost per launched kernel (GPU launch, CPU thunk dispatch); 0 on TPU.
    kernel_overhead_s: float
    #: Fixed cost of one step whatever it computes (XLA CPU: dispatch, the devices'
    #: threads meeting); 0 when the profile does not say.
    step_overhead_s: float
    #: bf16/f16 arithmetic runs in f32 (XLA CPU), so such temporaries take 4 bytes.
    upcasts_16bit_floats: bool
    #: XLA fuses a producer into several readers' loop, or a value also needed in
    #: memory into its reader (multi-output fusion): GPU and TPU yes, CPU no.
    multi_output_fusion: bool
    #: XLA's collective combiners pack independent collectives into buckets this large.
    combine_threshold_bytes: int
    interconnect: Interconnect
    sources: tuple[str, ...]

    def memory_seconds(self, read_bytes: float, written_bytes: float) -> float:
        if 0 < read_bytes + written_bytes <= self.cache_bytes:
            return (read_bytes + written_bytes) / self.cache_bandwidth_bytes_per_s
        return (read_bytes / self.memory_bandwidth_bytes_per_s
                + written_bytes / self.memory_write_bandwidth_bytes_per_s)

    def matrix_rate(self, element_type: str) -> float:
        return self.matrix_flops_per_s.get(element_type, self.matrix_flops_per_s["default"])

    def convolution_rate(self, element_type: str) -> float:
        rates = self.convolution_flops_per_s
        return rates.get(element_type, rates["default"])

    def vector_rate(self, element_type: str) -> float:
        return self.vector_flops_per_s.get(element_type, self.vector_flops_per_s["default"])

    def with_algorithm(self, algorithm: str) -> HardwareProfile:
        return replace(self, interconnect=replace(self.interconnect, algorithm=algorithm))


ALGORITHMS = ("ring", "tree", "torus2d", "torus3d", "shared-memory")

#: The profile every command prices on unless told the target: the calibrated XLA CPU
#: devices (CPU being the default backend), so that ``optimize`` decides, and ``report``,
#: ``diff`` and ``scale`` estimate, on one and the same hardware.
DEFAULT_PROFILE = "cpu-local"


def available_profiles() -> list[str]:
    """Names of the profiles shipped with hlo-shard."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir()
                  if p.name.endswith(".json"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (``tpu-v3``), or a user profile from a JSON file."""
    shipped = resources.files(__name__) / f"{name_or_path}.json"
    if shipped.is_file():
        return profile_from_dict(json.loads(shipped.read_text(encoding="utf-8")), name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise HloShardError(
            f"unknown profile {name_or_path!r}: not a file, and not one of "
            f"{', '.join(available_profiles())}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HloShardError(f"{path}: not a JSON profile: {err}") from None
    return profile_from_dict(data, str(path))


def profile_from_dict(data: object, origin: str) -> HardwareProfile:
    """Validate and build a profile; a bad field is one clear user error."""
    try:
        if not isinstance(data, dict):
            raise ValueError("the top level must be an object")
        net = data["interconnect"]
        algorithm = str(net.get("algorithm", "ring"))
        if algorithm not in ALGORITHMS:
            raise ValueError(f"interconnect.algorithm must be one of {', '.join(ALGORITHMS)}")
        profile = HardwareProfile(
            name=str(data.get("name", origin)),
            description=str(data.get("description", "")),
            matrix_flops_per_s=_rates(data["matrix_flops_per_s"], "matrix_flops_per_s"),
            convolution_flops_per_s=_rates(data.get("convolution_flops_per_s",
                                                    data["matrix_flops_per_s"]),
                                           "convolution_flops_per_s"),
            vector_flops_per_s=_rates(data["vector_flops_per_s"], "vector_flops_per_s"),
            transcendentals_per_s=_positive(data["transcendentals_per_s"]),
            memory_bandwidth_bytes_per_s=_positive(data["memory_bandwidth_bytes_per_s"]),
            memory_write_bandwidth_bytes_per_s=_positive(data.get(
                "memory_write_bandwidth_bytes_per_s", data["memory_bandwidth_bytes_per_s"])),
            memory_capacity_bytes=int(_positive(data["memory_capacity_bytes"])),
            cache_bytes=int(data.get("cache_bytes", 0)),
            cache_bandwidth_bytes_per_s=_positive(data.get(
                "cache_bandwidth_bytes_per_s", data["memory_bandwidth_bytes_per_s"])),
            kernel_overhead_s=float(data.get("kernel_overhead_s", 0.0)),
            step_overhead_s=float(data.get("step_overhead_s", 0.0)),
            upcasts_16bit_floats=bool(data.get("upcasts_16bit_floats", False)),
            multi_output_fusion=bool(data.get("multi_output_fusion", True)),
            combine_threshold_bytes=int(data.get("combine_threshold_bytes", 30 << 20)),
            interconnect=Interconnect(
                algorithm=algorithm,
                devices_per_node=int(net.get("devices_per_node", 1 << 30)),
                intra_node=_link(net["intra_node"]),
                inter_node=_link(net.get("inter_node", net["intra_node"])),
            ),
            sources=tuple(str(s) for s in data.get("sources", ())),
        )
    except KeyError as err:
        raise HloShardError(f"profile {origin}: missing field {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise HloShardError(f"profile {origin}: {err}") from None
    return profile


def _positive(value: object) -> float:
    number = float(value)  # type: ignore[arg-type]
    if not number > 0:
        raise ValueError(f"expected a positive number, got {value!r}")
    return number


def _rates(value: object, field: str) -> dict[str, float]:
    if not isinstance(value, dict) or "default" not in value:
        raise ValueError(f"{field} must be an object with a 'default' rate")
    return {str(k): _positive(v) for k, v in value.items()}


def _link(value: dict) -> Link:
    return Link(alpha_s=float(value["alpha_s"]), beta_bytes_per_s=_positive(value["beta_bytes_per_s"]))
