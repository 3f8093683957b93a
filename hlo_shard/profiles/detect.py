"""Which hardware a module was compiled for, read from the module itself.

The default profile prices XLA's CPU devices, but the modules users bring from real
training runs come from GPUs and TPUs: pricing those on the CPU's rates says nothing
true about them. A module names its platform in its custom-calls (cuBLAS, cuDNN,
Triton and cuRAND-style kernels on GPU; Mosaic/TPU kernels on TPU), and hints at an
accelerator in its collectives (hundreds of devices in one group: no host runs that
many XLA CPU devices). bf16 collectives and ``use_global_device_ids`` are no such
evidence: jax writes both for CPU devices too. :func:`detect_platform` applies the rules of :data:`RULES`, in
order; :func:`profile_for_module` turns the answer into the profile to price on, or a
one-line note where the platform is an accelerator of unknown kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hlo_shard.ir import Module, ReplicaGroups
from hlo_shard.profiles import DEFAULT_PROFILE, HardwareProfile, available_profiles, load_profile

#: Custom-call target prefixes XLA's GPU backend writes (``gpu_compiler.cc`` and
#: friends: cuBLAS/cuBLASLt GEMMs, cuDNN fusions and convolutions, Triton kernels,
#: the GPU threefry RNG, NCCL-backed collectives' helpers).
GPU_TARGETS = ("__cublas", "__cudnn", "__triton", "cu_threefry", "__gpu", "__nccl")
#: Custom-call targets of TPU programs (Pallas/Mosaic kernels, TPU-only ops).
TPU_TARGETS = ("tpu_custom_call", "__tpu")
#: A collective group this large is an accelerator cluster's (XLA CPU devices are
#: threads of one host: a handful, not hundreds).
ACCELERATOR_GROUP_SIZE = 64


@dataclass(frozen=True)
class ModuleFacts:
    """What the rules read, collected in one pass over the module."""

    custom_call_targets: frozenset[str]
    largest_group: int


@dataclass(frozen=True)
class PlatformRule:
    platform: str
    #: The shipped profiles to price such a module on, first available wins (none: the
    #: kind of accelerator is unknown, the default stays, with a note).
    profiles: tuple[str, ...]
    matches: Callable[[ModuleFacts], str | None]  #: the evidence, or None


def _targets(prefixes: tuple[str, ...]) -> Callable[[ModuleFacts], str | None]:
    def matches(facts: ModuleFacts) -> str | None:
        found = sorted(t for t in facts.custom_call_targets if t.startswith(prefixes))
        return f"custom-call {found[0]}" if found else None
    return matches


def _large_groups(facts: ModuleFacts) -> str | None:
    if facts.largest_group >= ACCELERATOR_GROUP_SIZE:
        return f"collective groups of {facts.largest_group} devices"
    return None


#: In order; the first rule whose evidence is found decides.
RULES: tuple[PlatformRule, ...] = (
    PlatformRule("GPU", ("h100", "a100"), _targets(GPU_TARGETS)),
    PlatformRule("TPU", ("tpu-v4", "tpu-v3"), _targets(TPU_TARGETS)),
    PlatformRule("GPU/TPU", (), _large_groups),
)


#: Per jax platform, a device's name (jax's ``device_kind``, as ``nvidia-smi`` also
#: prints it) → the published profile of that device; the first marker found in the
#: name wins.
DEVICE_PROFILES: dict[str, tuple[tuple[str, str], ...]] = {
    "gpu": (("H200", "h200"), ("H100", "h100"), ("A100", "a100")),
    "tpu": (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v4", "tpu-v4"), ("v3", "tpu-v3")),
}
#: The profile of a device of the platform whose name no marker matches.
NEAREST_DEVICE_PROFILE = {"gpu": "h100", "tpu": "tpu-v4"}


def profile_for_device(platform: str, device_kind: str) -> tuple[str, str | None]:
    """The shipped profile to price a step compiled for ``platform`` devices named
    ``device_kind`` on, and a line to tell the user where the name has no profile of its
    own. A step jax compiles for a GPU or TPU priced on the CPU's rates would be decided
    for the wrong machine; CPU devices (and unknown plugins) take the default."""
    if platform not in DEVICE_PROFILES:
        return DEFAULT_PROFILE, None
    for marker, name in DEVICE_PROFILES[platform]:
        if marker in device_kind:
            return name, None
    nearest = NEAREST_DEVICE_PROFILE[platform]
    return nearest, (f"no profile of {device_kind!r} is shipped: priced on {nearest} "
                     f"(profile= names another, or a file calibrate wrote)")


@dataclass(frozen=True)
class Detection:
    platform: str
    evidence: str
    #: The profile to price on (None: no shipped profile of that kind).
    profile: str | None


def module_facts(module: Module) -> ModuleFacts:
    targets: set[str] = set()
    largest = 0
    for comp in module.computations:
        for inst in comp.instructions:
            if inst.opcode == "custom-call":
                targets.add(getattr(inst.attr("custom_call_target"), "value", ""))
            groups = inst.attr("replica_groups")
            if isinstance(groups, ReplicaGroups) and groups.groups:
                largest = max(largest, max(len(g) for g in groups.groups))
    return ModuleFacts(frozenset(targets), largest)


def detect_platform(module: Module) -> Detection | None:
    """The accelerator ``module`` was compiled for, by the first matching rule of
    :data:`RULES`; None when nothing says it is not a CPU program."""
    facts = module_facts(module)
    shipped = set(available_profiles())
    for rule in RULES:
        evidence = rule.matches(facts)
        if evidence is not None:
            profile = next((name for name in rule.profiles if name in shipped), None)
            return Detection(rule.platform, evidence, profile)
    return None


def profile_for_module(requested: str | HardwareProfile | None, module: Module
                       ) -> tuple[HardwareProfile, str | None]:
    """The profile to price ``module`` on and a line to tell the user, if any: the
    ``requested`` one when given; else the accelerator's profile its custom-calls
    name, or :data:`DEFAULT_PROFILE` with a note when it is an accelerator program of
    unknown kind (or of a kind no profile is shipped for)."""
    if isinstance(requested, HardwareProfile):
        return requested, None
    if requested is not None:
        return load_profile(requested), None
    found = detect_platform(module)
    if found is None:
        return load_profile(DEFAULT_PROFILE), None
    if found.profile is not None:
        return load_profile(found.profile), (
            f"profile {found.profile}: the module is a {found.platform} program "
            f"({found.evidence}); --profile prices it on another")
    return load_profile(DEFAULT_PROFILE), (
        f"{DEFAULT_PROFILE} prices are being applied to a {found.platform} program "
        f"({found.evidence}); --profile NAME|FILE prices it on its hardware")


__all__ = ["DEVICE_PROFILES", "Detection", "NEAREST_DEVICE_PROFILE", "PlatformRule", "RULES",
           "detect_platform", "module_facts", "profile_for_device", "profile_for_module"]
