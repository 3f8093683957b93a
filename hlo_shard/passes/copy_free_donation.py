"""Drop the aliases that make XLA copy a donated parameter every step.

A sharded step all-gathers layer ``k``'s new weight after its own reduce-scatter, while
the backward product that reads the old weight (for layer ``k - 1``'s gradient) need
not have run: XLA then copies the donated weight at the top of the step so that it may
write the all-gather into the aliased buffer
(:mod:`hlo_shard.costmodel.aliasing`). Without the alias the all-gather writes a buffer
of its own and nothing is copied, but the parameter's buffer is no longer reused: the
step's peak memory grows by the weights unaliased (XLA's copy lived only until its
last reader). The wide LayerNorm MLP + Adam, sharded at N = 8: 0.78× the original's
step with the 4 + 1 MiB copies, 0.69× without them, peak 8.8 → 13.8 MiB (the
original's 21.1). So memory is traded for time only where the copies are a real part
of the step: at least ``MIN_STEP_SHARE`` of it on the target profile (XLA:CPU, where
a copy streams at a few GB/s; on a GPU or TPU a weight's copy is microseconds of HBM
traffic and the aliases stay).

Only ``may-alias`` entries are dropped (``must-alias`` is the producer's demand), and
only where the new output buffer costs nothing extra on the target: a profile whose
host allocator maps buffers above ``fresh_temp_threshold_bytes`` afresh each step keeps
the alias (and the copy) of larger ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hlo_shard.costmodel.aliasing import DonatedCopy, donated_parameter_copies
from hlo_shard.costmodel.network import combiner_buckets
from hlo_shard.costmodel.step_time import (donated_copy_seconds, estimate_step,
                                           step_seconds_floor)
from hlo_shard.graph import ModuleRewriter, reading_only
from hlo_shard.ir import Alias, InputOutputAlias, Module
from hlo_shard.passes.base import ModulePass
from hlo_shard.profiles import DEFAULT_PROFILE, HardwareProfile, resolve_profile

#: The share of the predicted step the copies must take for their aliases to go.
MIN_STEP_SHARE = 0.02


@dataclass(frozen=True)
class UnaliasedDonations:
    """The donated parameters whose alias was dropped, each with why XLA copied it."""

    dropped: tuple[DonatedCopy, ...]

    @property
    def notes(self) -> list[str]:
        """What ``--explain`` and ``--json`` say."""
        return [f"{copy.parameter} no longer aliased to its output: XLA would copy it "
                f"({copy.bytes} bytes) each step, as {copy.reader} reads it and need not "
                f"run before {copy.writer} writes the output" for copy in self.dropped]


@dataclass(frozen=True)
class CopyFreeDonation(ModulePass[UnaliasedDonations]):
    """Drop each ``may-alias`` entry whose donated parameter XLA would copy."""

    name: ClassVar[str] = "copy-free-donation"
    #: The target (a name or file is loaded when the pass is built).
    profile: HardwareProfile | str = DEFAULT_PROFILE

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", resolve_profile(self.profile))

    def apply(self, module: Module, rewriter: ModuleRewriter) -> UnaliasedDonations:
        aliases = module.header.get("input_output_alias")
        if not isinstance(aliases, InputOutputAlias) or \
                any(len(alias.output) > 1 for alias in aliases.entries):
            # None, or entries this pass does not read (nested tuple outputs): untouched.
            return UnaliasedDonations(())
        profile = resolve_profile(self.profile).for_devices(module.device_count)
        limit = profile.fresh_temp_threshold_bytes
        with reading_only():  # both read the entry's order and users
            buckets = combiner_buckets(module, module.entry, profile.combine_threshold_bytes,
                                       profile.combined_collectives)
            copied = {copy.parameter: copy for copy in donated_parameter_copies(module, buckets)
                      if not limit or copy.bytes <= limit}
        numbers = {p.parameter_number: p.name for p in module.entry.parameters()}
        kept: list[Alias] = []
        dropped: list[DonatedCopy] = []
        for alias in aliases.entries:
            copy = copied.get(numbers.get(alias.parameter, ""))
            if copy is not None and alias.may_alias:
                dropped.append(copy)
            else:
                kept.append(alias)
        if not dropped or not _copies_pay(module, profile, dropped):
            return UnaliasedDonations(())
        if kept:
            rewriter.set_header("input_output_alias", InputOutputAlias(tuple(kept)))
        else:
            rewriter.pop_header("input_output_alias")
        return UnaliasedDonations(tuple(dropped))


def _copies_pay(module: Module, profile: HardwareProfile, copies: list[DonatedCopy]) -> bool:
    """Whether the copies take at least ``MIN_STEP_SHARE`` of the predicted step. A
    few copies in a step of many kernels are a small share of it whatever the estimate
    says: a floor of the step (:func:`step_seconds_floor`) answers then, without the
    estimate (which the gate would otherwise pay in every pipeline run it prices)."""
    copying = sum(donated_copy_seconds(copy, profile) for copy in copies)
    if copying < MIN_STEP_SHARE * step_seconds_floor(module, profile):
        return False
    return copying >= MIN_STEP_SHARE * estimate_step(module, profile, {}).seconds


__all__ = ["CopyFreeDonation", "MIN_STEP_SHARE", "UnaliasedDonations"]
