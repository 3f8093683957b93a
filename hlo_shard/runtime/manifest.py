"""The sharding manifest: how a candidate module's arrays relate to the original's.

``hlo-shard optimize --manifest M.json`` writes it next to a rewritten module;
``hlo-shard verify --manifest M.json`` reads it to feed the candidate the right
slices of the original's inputs and to gather its sharded outputs back.

Schema (JSON, version 1)::

    {
      "format": "hlo-shard-manifest",
      "version": 1,
      "devices": 4,                 # N the candidate was rewritten for
      "form": "spmd",               # optional, informational: "spmd" | "replica"
      "replica_groups": [[0, 1, 2, 3]],   # optional default for every shard below
      "parameters": [               # one record per CANDIDATE entry parameter
        {
          "index": 0,               # candidate parameter number
          "original": 0,            # original parameter number it stands for,
                                    #   or null for a parameter the original lacks
          "name": "w",              # optional, for messages: the HLO name
          "user_name": "p['w']",    # optional: the name in the user's program (its
                                    #   pytree path, from the op_name metadata); an
                                    #   output's is its parameter's (feedback)
          "kind": "sharded",        # "replicated" | "per-device" | "sharded"
          "shape": [16, 8],         # ORIGINAL (full, per-device) logical dims
          "element_type": "f32",
          "layout": [1, 0],         # original minor_to_major; flatten order below
          "shard": {                # only for kind "sharded"
            "length": 32,           # elements in each device's chunk
            "padding": 0,           # zeros appended before cutting: length*G - numel
            "replica_groups": [[0, 1, 2, 3]],  # optional; default: the top-level
                                    #   replica_groups, else one group of all N
            "flatten": "physical"   # optional: "physical" (default, the layout's
                                    #   order) or "logical" (row-major dims)
          }
        }
      ],
      "outputs": [                  # one record per CANDIDATE output leaf (depth-first
        {"index": 0, "original": 0, "kind": "sharded", ...}   #  order of the root tuple)
      ],
      "feedback": [                 # optional, for --steps: ORIGINAL output leaf
        {"output": 0, "parameter": 0}   # "output" becomes ORIGINAL parameter
      ]                             #   "parameter" at the next step (default: each
                                    #   replicated parameter takes the next output
                                    #   of its shape and type, in order)
    }

Meaning of ``kind``:

* ``replicated`` — the same value on every device (weights, optimizer state in the
  original); candidate shape == original shape.
* ``per-device`` — each device has its own value (batch data, local gradients);
  candidate shape == original shape.
* ``sharded`` — each device holds one contiguous chunk of the original value: the
  original value is flattened in its **physical order** (the order of ``layout``,
  minor_to_major: the most-major dimension varies slowest; ``"flatten": "logical"``
  means row-major over the logical dims instead), zero-padded at the end to
  ``length × G`` elements (G = group size, ``length`` = ⌈elements / G⌉: the
  :class:`~hlo_shard.shard_format.ShardFormat` the pass emits) and cut into G chunks
  of ``length``; the device at position *p* of its replica group holds chunk *p*. The
  candidate's own array (any dims whose element count is ``length``) holds the chunk
  in its own physical order. Outputs are gathered back the same way, padding dropped.

A manifest is only read here; :func:`manifest_to_json` writes one so the pass that
produces it and this reader share the format.
"""

from __future__ import annotations

from typing import Any
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Sequence

import numpy as np

from hlo_shard import limits
from hlo_shard.errors import HloShardError
from hlo_shard.ir import ELEMENT_BITS, ArrayShape, Layout
from hlo_shard.schema import At, load_json
from hlo_shard.shard_format import ShardFormat, natural_perm, row_major_perm

FORMAT = "hlo-shard-manifest"
VERSION = 1
KINDS = ("replicated", "per-device", "sharded")


@dataclass(frozen=True, slots=True)
class Shard:
    """A sharded record: its value's :class:`~hlo_shard.shard_format.ShardFormat` (dims,
    flatten order, group size: the chunk length and padding follow) and the replica
    groups whose positions hold the chunks."""

    format: ShardFormat
    #: Empty: one group holding every device.
    replica_groups: tuple[tuple[int, ...], ...] = ()

    def groups(self, devices: int) -> tuple[tuple[int, ...], ...]:
        return self.replica_groups or (tuple(range(devices)),)

    def position(self, device: int, devices: int) -> tuple[tuple[int, ...], int]:
        """(the group holding ``device``, the device's position in it)."""
        for group in self.groups(devices):
            if device in group:
                return group, group.index(device)
        raise HloShardError(f"manifest: device {device} is in no replica group of a shard")


@dataclass(frozen=True, slots=True)
class ArrayRecord:
    """One candidate entry parameter or output leaf."""

    index: int
    original: int | None
    kind: str
    shape: ArrayShape
    name: str = ""
    shard: Shard | None = None
    #: The name in the user's program (``params['w']``), "" where unknown.
    user_name: str = ""

    @property
    def label(self) -> str:
        base = self.name or str(self.index)
        return f"{base} ({self.user_name})" if self.user_name else base

    def require_shard(self) -> Shard:
        """The shard of a ``sharded`` record (asking another kind for one is a bug in
        the caller, not bad input: the reader gives every sharded record a shard)."""
        if self.shard is None:
            raise ValueError(f"manifest record {self.label} is {self.kind}, not sharded")
        return self.shard


@dataclass(frozen=True, slots=True)
class Manifest:
    devices: int
    parameters: tuple[ArrayRecord, ...]
    outputs: tuple[ArrayRecord, ...]
    #: (original output leaf, original parameter) pairs for --steps, or None.
    feedback: tuple[tuple[int, int], ...] | None = None
    path: str | None = None
    #: "spmd" | "replica" | "" (informational).
    form: str = ""

    def parameter(self, index: int) -> ArrayRecord | None:
        return next((r for r in self.parameters if r.index == index), None)


# -------------------------------------------------------------------------- reading


#: A manifest's ``flatten`` → the order (:attr:`ShardFormat.perm`) of a value of that shape.
FLATTEN_PERMS: dict[str, Callable[[ArrayShape], tuple[int, ...]]] = {
    "physical": natural_perm,
    "logical": lambda shape: row_major_perm(shape.dims),
}


def flatten_name(shard: Shard, shape: ArrayShape) -> str:
    """The manifest's word for ``shard``'s order over a ``shape`` value."""
    for name, perm in FLATTEN_PERMS.items():
        if shard.format.perm == perm(shape):
            return name
    raise HloShardError(f"a shard in order {shard.format.perm} of {shape.dims} is neither "
                        "physical nor logical: a manifest cannot describe it")


def _record(raw: Any, at: At, devices: int, default_groups: tuple) -> ArrayRecord:
    raw = at.object(raw)
    index = at.read(raw, "index", At.integer, 0)
    original = None if raw.get("original") is None else at.read(raw, "original", At.integer, 0)
    kind = at.read(raw, "kind", At.string, KINDS)
    element_type = at.read(raw, "element_type", At.string, tuple(ELEMENT_BITS))
    dims = at.read(raw, "shape", At.integers, 0)
    layout = at.read(raw, "layout", At.integers, 0,
                     default=tuple(range(len(dims) - 1, -1, -1)))
    if sorted(layout) != list(range(len(dims))):
        at.key("layout").fail(f"{list(layout)} is not a permutation of the {len(dims)} "
                              "dimensions")
    shape = ArrayShape(element_type, dims, (), Layout(layout))
    shard = None
    if kind == "sharded":
        shard = _shard(at.read(raw, "shard", At.object), at.key("shard"), devices,
                       default_groups, shape)
    elif "shard" in raw:
        at.key("shard").fail(f"only a sharded record has a shard, not a {kind} one")
    return ArrayRecord(index, original, kind, shape, at.read(raw, "name", At.string, default=""),
                       shard, at.read(raw, "user_name", At.string, default=""))


def _shard(raw: dict, at: At, devices: int, default_groups: tuple, shape: ArrayShape) -> Shard:
    length = at.read(raw, "length", At.integer, 1)
    padding = at.read(raw, "padding", At.integer, 0, default=0)
    groups = at.read(raw, "replica_groups", _groups, default=default_groups)
    flatten = at.read(raw, "flatten", At.string, tuple(FLATTEN_PERMS), default="physical")
    all_groups = groups or (tuple(range(devices)),)
    size = len(all_groups[0])
    if any(len(g) != size for g in all_groups):
        at.fail("replica groups must have equal sizes")
    if sorted(d for g in all_groups for d in g) != list(range(devices)):
        at.fail(f"replica groups must cover devices 0..{devices - 1} once")
    if length * size != shape.num_elements + padding:
        at.fail(f"length {length} × {size} devices != {shape.num_elements} elements "
                f"+ padding {padding}")
    fmt = ShardFormat(tuple(shape.dims), FLATTEN_PERMS[flatten](shape), size)
    if length != fmt.shard_len:
        at.fail(f"length {length} is not ⌈{shape.num_elements} elements / {size} devices⌉ "
                f"= {fmt.shard_len}")
    return Shard(fmt, groups)


def _groups(at: At, raw: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(at.index(i).integers(group, 0) for i, group in enumerate(at.array(raw)))


def _feedback(at: At, raw: Any) -> tuple[tuple[int, int], ...]:
    pairs = []
    for i, entry in enumerate(at.array(raw, non_empty=True)):
        where = at.index(i)
        entry = where.object(entry)
        pairs.append((where.read(entry, "output", At.integer, 0),
                      where.read(entry, "parameter", At.integer, 0)))
    return tuple(pairs)


def parse_manifest(data: Any, path: str | None = None) -> Manifest:
    at = At(f"manifest {path or '<manifest>'}")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        at.fail(f"not an {FORMAT} (missing \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        at.fail(f"version {data.get('version')!r} is not supported (this hlo-shard reads "
                f"{VERSION})")
    devices = at.read(data, "devices", At.integer, 1, limits.DEVICES.value())
    default_groups = at.read(data, "replica_groups", _groups, default=())
    records = {}
    for section in ("parameters", "outputs"):
        where = at.key(section)
        records[section] = tuple(_record(r, where.index(i), devices, default_groups)
                                 for i, r in enumerate(at.read(data, section, At.array,
                                                               default=[])))
        indices = [r.index for r in records[section]]
        if len(set(indices)) != len(indices):
            where.fail("duplicate index")
    feedback = at.read(data, "feedback", _feedback, default=None)
    return Manifest(devices, records["parameters"], records["outputs"], feedback, path,
                    at.read(data, "form", At.string, default=""))


def load_manifest(path: str | Path) -> Manifest:
    return parse_manifest(load_json(path, "manifest"), str(path))


def manifest_to_json(manifest: Manifest) -> dict:
    """The JSON object for ``manifest`` (what ``optimize --manifest`` writes)."""

    def record(r: ArrayRecord) -> dict[str, object]:
        out: dict[str, object] = {"index": r.index, "original": r.original, "kind": r.kind,
               "shape": list(r.shape.dims), "element_type": r.shape.element_type,
               "layout": list(r.shape.minor_to_major())}
        if r.name:
            out["name"] = r.name
        if r.user_name:
            out["user_name"] = r.user_name
        if r.shard is not None:
            fmt = r.shard.format
            shard: dict[str, object] = {"length": fmt.shard_len, "padding": fmt.padding}
            if r.shard.replica_groups:
                shard["replica_groups"] = [list(g) for g in r.shard.replica_groups]
            flatten = flatten_name(r.shard, r.shape)
            if flatten != "physical":
                shard["flatten"] = flatten
            out["shard"] = shard
        return out

    data = {"format": FORMAT, "version": VERSION, "devices": manifest.devices,
            **({"form": manifest.form} if manifest.form else {}),
            "parameters": [record(r) for r in manifest.parameters],
            "outputs": [record(r) for r in manifest.outputs]}
    if manifest.feedback is not None:
        data["feedback"] = [{"output": o, "parameter": p} for o, p in manifest.feedback]
    return data


# --------------------------------------------------------------------- the values


def shard_value(full: np.ndarray, record: ArrayRecord, device: int, devices: int,
                candidate: ArrayShape) -> np.ndarray:
    """Device ``device``'s chunk of the original value, in the candidate's shape."""
    shard = record.require_shard()
    _, position = shard.position(device, devices)
    return ShardFormat.of(candidate, 1).from_padded_flat(shard.format.to_shards(full)[position])


def gather_value(per_device: Sequence[np.ndarray], record: ArrayRecord, device: int,
                 candidate: ArrayShape) -> np.ndarray:
    """The full original-shaped value on ``device`` from its group's chunks."""
    shard = record.require_shard()
    group, _ = shard.position(device, len(per_device))
    own = ShardFormat.of(candidate, 1)
    return shard.format.from_shards([own.padded_flat(per_device[d]) for d in group])
