"""The shard format: how one device's full value of a sharded leaf becomes its group's
chunks, stated once.

The weight-update pass emits HLO in this format (:mod:`hlo_shard.passes.weight_update`),
the runtime cuts and assembles numpy arrays in it (``runtime/manifest.py``), and the JAX
front end cuts and gathers device arrays in it (``jax/_program.py``). The math lives
here once, over an array namespace: numpy by default (:meth:`ShardFormat.to_shards` /
:meth:`ShardFormat.from_shards`), ``jax.numpy`` where the caller passes it (the front
end's jit-compiled converters), so the three never drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import Any

import numpy as np

from hlo_shard.ir import ArrayShape


def natural_perm(shape: ArrayShape) -> tuple[int, ...]:
    """Dimensions from most to least major in ``shape``'s layout (its physical order),
    canonical (size-1 dimensions first, as their place does not change the order)."""
    return canonical_perm(tuple(reversed(shape.minor_to_major())), shape.dims)


def canonical_perm(perm: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    ones = tuple(d for d in perm if dims[d] == 1)
    return tuple(sorted(ones)) + tuple(d for d in perm if dims[d] != 1)


def row_major_perm(dims: tuple[int, ...]) -> tuple[int, ...]:
    """The canonical perm of the logical (row-major) order of ``dims``."""
    return canonical_perm(tuple(range(len(dims))), dims)


@dataclass(frozen=True)
class ShardFormat:
    """A full value of ``dims``, flattened as ``ravel(transpose(value, perm))``, zero-padded
    to ``n × shard_len`` and cut into ``n`` chunks; the device at group position j holds
    chunk j as a 1-D ``[shard_len]`` array. Its sizes and block are worked out once per
    format (the pass asks them of every op of a region, in every trial of its planning)."""

    dims: tuple[int, ...]
    perm: tuple[int, ...]
    n: int

    def __post_init__(self) -> None:
        # A perm that is not an order of every dimension would flatten a value of other
        # dims than it says; caught here, not in the module it would be emitted into.
        if sorted(self.perm) != list(range(len(self.dims))):
            raise ValueError(f"perm {self.perm} is not an order of the dimensions {self.dims}")

    @cached_property
    def elements(self) -> int:
        return math.prod(self.dims)

    @cached_property
    def shard_len(self) -> int:
        return max(1, -(-self.elements // self.n))

    @cached_property
    def padded(self) -> int:
        return self.n * self.shard_len

    @cached_property
    def padding(self) -> int:
        return self.padded - self.elements

    @property
    def transposed_dims(self) -> tuple[int, ...]:
        return tuple(self.dims[p] for p in self.perm)

    @property
    def is_row_major(self) -> bool:
        return self.perm == row_major_perm(self.dims)

    @property
    def keeps_dimension_order(self) -> bool:
        """The value is flattened in its own dimension order: no transpose formats it."""
        return self.perm == tuple(range(len(self.dims)))

    @cached_property
    def block(self) -> tuple[int, int] | None:
        """``(dimension, rows)`` when every shard is a plain block of the value — rows
        ``[j·rows, (j+1)·rows)`` of the format's most-major dimension (no padding, the
        shard a whole number of slabs) — so slices and collectives can work on the value's
        own dimensions instead of a transposed flat copy; None otherwise."""
        major = next((d for d in self.perm if self.dims[d] != 1), None)
        if self.padding or major is None:
            return None
        slab = math.prod(self.dims[d] for d in self.perm[self.perm.index(major) + 1:])
        return (major, self.shard_len // slab) if self.shard_len % slab == 0 else None

    @property
    def known_block(self) -> tuple[int, int]:
        """:attr:`block`, where the caller has established that the shards are blocks."""
        if self.block is None:
            raise ValueError(f"{self} does not cut its value in blocks")
        return self.block

    def minor_to_major(self) -> tuple[int, ...]:
        """The layout whose physical order is this format's flat order."""
        return tuple(reversed(self.perm))

    @staticmethod
    def of(shape: ArrayShape, n: int, perm: tuple[int, ...] | None = None) -> ShardFormat:
        dims = tuple(shape.dims)
        chosen = natural_perm(shape) if perm is None else canonical_perm(perm, dims)
        return ShardFormat(dims, chosen, n)

    # ------------------------------------------------------------ the arrays
    def padded_flat(self, value: Any, xp: ModuleType = np) -> Any:
        """``value`` (of :attr:`dims`) flattened in the format's order and zero-padded
        to :attr:`padded` elements: the group's chunks back to back. ``xp``: the array
        namespace (numpy, or ``jax.numpy`` inside a jit)."""
        flat = xp.reshape(xp.transpose(xp.asarray(value), self.perm), (-1,))
        return xp.pad(flat, (0, self.padding)) if self.padding else flat

    def from_padded_flat(self, flat: Any, xp: ModuleType = np) -> Any:
        """The value of :attr:`dims` whose :meth:`padded_flat` begins ``flat`` (the
        padding, where present, dropped)."""
        stored = xp.reshape(flat[:self.elements], self.transposed_dims)
        return xp.transpose(stored, tuple(int(d) for d in np.argsort(self.perm)))

    def to_shards(self, value: Any) -> list[np.ndarray]:
        """The ``n`` chunks of ``value`` (numpy), chunk j for group position j."""
        flat = self.padded_flat(np.asarray(value))
        return [flat[j * self.shard_len:(j + 1) * self.shard_len] for j in range(self.n)]

    def from_shards(self, shards: list[np.ndarray]) -> np.ndarray:
        """The full value from its group's ``n`` chunks, in group order (numpy)."""
        if len(shards) != self.n:
            raise ValueError(f"{self} takes {self.n} shards, not {len(shards)}")
        flat = np.concatenate([np.ravel(np.asarray(s)) for s in shards])
        return np.asarray(self.from_padded_flat(flat))
