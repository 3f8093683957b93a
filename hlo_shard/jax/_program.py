"""One argument signature of a step, optimized and compiled: what ``fast`` runs.

The captured per-device module goes through the pass in-process behind the same
never-slower gate and output checks as ``hlo-shard optimize`` (a step not predicted
faster runs as ``fn``), is put into replica form with its donation
aliasing kept, and compiled for jit's own devices in jit's order. In
``state="sharded"`` the optimizer-state leaves the pass shards become jax Arrays of
shape ``[D·L]``, one ``[L]`` chunk per device (see :class:`StateLayout`); the chunks
are :class:`~hlo_shard.shard_format.ShardFormat`'s, cut with ``jax.numpy``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from hlo_shard.analysis.names import UserNames, user_names
from hlo_shard.errors import HloShardError
from hlo_shard.jax import _xla
from hlo_shard.jax._capture import Capture, FirstCallSeconds, Reason, Unsupported, describe
from hlo_shard.parser import parse
from hlo_shard.passes.optimize import ForExecutable, OptimizeResult, optimize, speed_json
from hlo_shard.passes.speed_gate import SpeedDecision, not_faster
from hlo_shard.passes.weight_update import ShardingOptions, ShardingReport
from hlo_shard.runtime.forms import check_executable
from hlo_shard.shard_format import ShardFormat


@dataclass(frozen=True)
class StateLayout:
    """A state leaf in the pass's shard format (:class:`ShardFormat`: a device's full
    value of the leaf, cut into the ``n`` chunks of its replica group) as a jax Array of
    shape ``[D·shard_len]`` (``D`` devices), one chunk per device in jit's order.

    With ``ranks`` None one group holds every device and device ``k`` holds chunk ``k``
    (``D = n``). Otherwise device ``k`` holds chunk ``ranks[k]`` (its place in its
    group: the data-axis groups of a mesh with more axes), of its block ``blocks[k]``
    (``(start, stop)`` per dimension) of the leaf as ``fn`` takes it, ``leaf_dims``
    (a tensor-parallel leaf's block differs along the model axis; None: every device
    holds the whole leaf)."""

    format: ShardFormat
    ranks: tuple[int, ...] | None = None
    leaf_dims: tuple[int, ...] | None = None
    blocks: tuple[tuple[tuple[int, int], ...], ...] | None = None
    #: Where the groups are the devices that differ only along some axes of the user's
    #: mesh (ranked row-major along them, the mesh ordering devices as jit does): those
    #: axes, and the leaf's full ``PartitionSpec`` on that mesh. The conversions are
    #: then per-device programs (``shard_map``: each device cuts its own block, or
    #: all-gathers its group's chunks) instead of a global gather of every block that
    #: the SPMD partitioner has to lower.
    mesh_axes: tuple[str, ...] | None = None
    full_spec: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        devices = self.format.n if self.ranks is None else len(self.ranks)
        return (devices * self.format.shard_len,)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The leaf's shape as ``fn`` takes it."""
        return self.format.dims if self.leaf_dims is None else self.leaf_dims


@dataclass
class Program:
    capture: Capture
    #: What the optimizer made of the captured module (its text is what is compiled).
    result: OptimizeResult
    options: ShardingOptions
    #: The user's names of the captured module, read before the pass rewrote it (jit's
    #: argument names replace the parameters' where given: :meth:`report_json`).
    names: UserNames
    executable: Any
    #: Flat argument index → its layout, for the leaves held as shards (sharded mode).
    state_args: dict[int, StateLayout]
    #: Output leaf index → its layout, for the outputs returned as shards.
    state_outputs: dict[int, StateLayout]
    #: The sharding of every shard-form leaf (None without any).
    shard_sharding: Any
    #: What the first call of this signature spent in capture, pass and compile.
    seconds: FirstCallSeconds
    #: (output leaf, entry parameter): the output is the parameter's next value.
    next_values: list[tuple[int, int]] = field(default_factory=list)
    #: Whether it ran once (a failing first run falls back to ``fn``).
    ran: bool = False
    _cache: dict = field(default_factory=dict)

    @property
    def report(self) -> ShardingReport:
        return self.result.report

    @property
    def decision(self) -> SpeedDecision:
        """The never-slower gate's decision (its estimates go into the report)."""
        assert self.result.decision is not None  # build_program runs the gate
        return self.result.decision

    @property
    def hlo_text(self) -> str:
        """The optimized module as compiled (replica form, validated)."""
        return self.result.xla_text

    # ---------------------------------------------------------------- placement
    def arg_sharding(self, index: int) -> Any:
        """The sharding argument ``index`` must have when handed to the executable."""
        if index in self.state_args:
            return self.shard_sharding
        return self.capture.in_shardings[index]

    @property
    def out_placements(self) -> list[tuple[tuple[int, ...], Any]]:
        """(global shape, sharding) of every output leaf as ``fast`` returns it."""
        found = self._cache.get("out")
        if found is None:
            found = [(self.state_outputs[k].shape, self.shard_sharding)
                     if k in self.state_outputs else (tuple(aval.shape), sharding)
                     for k, (aval, sharding) in enumerate(zip(self.capture.out_avals,
                                                              self.capture.out_shardings))]
            self._cache["out"] = found
        return found

    @property
    def out_handlers(self) -> list:
        """What makes each output's global Array of the executable's buffers."""
        found = self._cache.get("handlers")
        if found is None:
            found = _xla.result_handlers(
                [(shape, aval.dtype, sharding) for (shape, sharding), aval
                 in zip(self.out_placements, self.capture.out_avals)])
            self._cache["handlers"] = found
        return found

    def shard_key(self, key: tuple, leaves: list) -> tuple:
        """The signature ``key`` of the arguments ``leaves`` with the state leaves in
        shard form."""
        treedef, static, numbers = key
        return (treedef, static, tuple(
            _xla.leaf_number((self.state_args[i].shape, _xla.dtype_key(leaf),
                              _xla.placement(self.shard_sharding, 1)))
            if i in self.state_args else number for i, (leaf, number)
            in enumerate(zip(leaves, numbers))))

    def returns(self, treedef: Any, leaves: list, placed: bool) -> bool:
        """Whether ``leaves`` look like this program's outputs (shard forms included);
        ``placed``: and every shard-form leaf is placed as this program places shards."""
        if treedef != self.capture.out_tree or len(leaves) != len(self.out_placements):
            return False
        if any(tuple(getattr(leaf, "shape", ())) != shape
               for leaf, (shape, _) in zip(leaves, self.out_placements)):
            return False
        return not placed or all(_xla.same_placement(leaves[k], self.shard_sharding)
                                 for k in self.state_outputs)

    # --------------------------------------------------------------- converting
    def to_shards(self, leaves: list) -> list:
        """``leaves`` (this signature's flat arguments) with each state argument cut
        into its shard form."""
        indices = sorted(self.state_args)
        shards = convert([leaves[i] for i in indices], [self.state_args[i] for i in indices],
                         [self.shard_sharding] * len(indices), to_shards=True)
        out = list(leaves)
        for index, shard in zip(indices, shards):
            out[index] = shard
        return out

    def delete_donated_state(self, leaves: list) -> None:
        """Delete the full state leaves jit would have consumed (their shards were)."""
        for index in self.state_args:
            if self.capture.donated[index] and hasattr(leaves[index], "delete"):
                leaves[index].delete()

    def state_by_name(self, names: list[str]) -> dict[str, tuple[StateLayout, Any]]:
        """Argument name → (layout, full sharding) of each state argument."""
        return {names[i]: (layout, self.capture.in_shardings[i])
                for i, layout in self.state_args.items()}

    def gather_out_leaves(self, leaves: list) -> list:
        return self.gather_outputs_at(leaves, {k: k for k in self.state_outputs})

    def gather_outputs_at(self, leaves: list, outputs: dict[int, int]) -> list:
        """``leaves`` with each ``leaves[k]`` that is this program's state output
        ``outputs[k]`` gathered back to the full leaf."""
        indices = sorted(outputs)
        full = convert([leaves[k] for k in indices],
                       [self.state_outputs[outputs[k]] for k in indices],
                       [self.capture.out_shardings[outputs[k]] for k in indices],
                       to_shards=False)
        out = list(leaves)
        for index, value in zip(indices, full):
            out[index] = value
        return out

    # ------------------------------------------------------------------ report
    def report_json(self, names: list[str]) -> dict:
        """The pass's decisions (``optimize --json``'s content), each entry parameter
        and output leaf named by its path in the user's pytrees."""
        import jax

        from hlo_shard.printer import format_shape

        report, cap = self.report, self.capture
        paths = jax.tree_util.tree_flatten_with_path(
            jax.tree.unflatten(cap.out_tree, [0] * len(cap.out_avals)))[0]
        out_names = ["output" + jax.tree_util.keystr(path) for path, _ in paths]

        def entry(record: Any, name: str) -> dict:
            out = {"name": name, "hlo_name": record.name, "kind": record.kind,
                   "shape": format_shape(record.shape)}
            if record.format is not None:
                out["shard_length"] = record.format.shard_len
            return out

        users = replace(self.names, parameters={
            **self.names.parameters,
            **{p: names[arg] for p, arg in enumerate(cap.kept) if names[arg]}})
        return {
            **self.result.to_json(users, **_options_json(self.options), fallback=None,
                                  reason=""),
            "parameters": [entry(p, users.parameters.get(p.index, "")) for p in report.parameters],
            "outputs": [entry(o, out_names[o.index]) for o in report.outputs],
            "seconds": self.seconds.to_json(),
        }


def _options_json(options: ShardingOptions) -> dict:
    return {"state": options.state, "params": options.params, "strategy": options.strategy,
            "profile": getattr(options.profile, "name", options.profile)}


def fallback_json(why: Unsupported, options: ShardingOptions) -> dict:
    """``fast.report`` where ``fast`` runs ``fn``: the reason code and words, what
    the pass and its gate said where they ran (``speed`` None before that; the passes'
    notes, as ``--explain`` prints them) and the first call's seconds per stage as far
    as it got."""
    report = why.report
    return {**_options_json(options), "devices": None if report is None else report.devices,
            "fallback": why.code.value, "reason": str(why),
            "speed": None if why.decision is None else speed_json(why.decision),
            "sharded": 0, "gradients": None if report is None else len(report.explanations),
            "explanations": [] if report is None else [
                replace(why.names, moved=report.moved_from).explained(r.to_json())
                if why.names else r.to_json() for r in report.explanations],
            "notes": [] if report is None else list(report.notes),
            "seconds": None if why.seconds is None else why.seconds.to_json()}


def _whole(x: Any) -> Any:
    """``x`` (traced) replicated where its type is sharded over explicit mesh axes
    (``jax.make_mesh``'s default): jax types a slice of such a dimension that the mesh
    does not divide (a 10-wide bias's padded ``f32[16@data]``) as an error, where it
    all-gathers an array of an automatic mesh's sharding."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if sharding is None or spec is None or all(entry is None for entry in spec):
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))


def _shard(x: Any, layout: StateLayout) -> Any:
    """The jax adapter of :class:`ShardFormat`: ``x`` (the leaf as ``fn`` takes it) as
    its ``[D·shard_len]`` shard form, traced inside a jit."""
    import jax.numpy as jnp

    fmt = layout.format
    x = _whole(x)
    if layout.ranks is None:
        return fmt.padded_flat(x, jnp)
    flats: dict = {}
    chunks = []
    for k, rank in enumerate(layout.ranks):
        block = layout.blocks[k] if layout.blocks else None
        if block not in flats:
            flats[block] = fmt.padded_flat(x if block is None else x[_slices(block)], jnp)
        chunks.append(flats[block][rank * fmt.shard_len:(rank + 1) * fmt.shard_len])
    return jnp.concatenate(chunks)


def _gather(y: Any, layout: StateLayout) -> Any:
    """:func:`_shard`'s inverse: the leaf as ``fn`` takes it from its shard form."""
    import jax.numpy as jnp

    fmt = layout.format
    y = _whole(y)
    if layout.ranks is None:
        return fmt.from_padded_flat(y, jnp)
    chunks = y.reshape(len(layout.ranks), fmt.shard_len)
    holders: dict = {}  # block → rank → the first device holding that chunk of it
    for k, rank in enumerate(layout.ranks):
        holders.setdefault(layout.blocks[k] if layout.blocks else None, {}).setdefault(rank, k)
    out = None
    for block, by_rank in holders.items():
        local = fmt.from_padded_flat(jnp.concatenate([chunks[by_rank[r]] for r in range(fmt.n)]),
                                     jnp)
        if block is None:
            return local
        out = jnp.zeros(layout.full_shape, local.dtype) if out is None else out
        out = out.at[_slices(block)].set(local)
    return out


def _slices(block: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in block)


def convert(leaves: list, layouts: list[StateLayout], shardings: list,
            to_shards: bool) -> list:
    """``leaves`` cut into (or gathered from) their shard forms, on the devices, in one
    dispatch; results placed by ``shardings``."""
    if not leaves:
        return []
    return list(_converter(to_shards, tuple(layouts), tuple(shardings))(tuple(leaves)))


@functools.cache
def _converter(to_shards: bool, layouts: tuple, shardings: tuple) -> Callable:
    import jax

    def one(x: Any, layout: StateLayout, sharding: Any) -> Any:
        if layout.mesh_axes is not None:
            return (_shard_on_mesh if to_shards else _gather_on_mesh)(x, layout, sharding.mesh)
        return (_shard if to_shards else _gather)(x, layout)

    return jax.jit(lambda xs: tuple(one(x, layout, sharding)
                                    for x, layout, sharding in zip(xs, layouts, shardings)),
                   out_shardings=shardings)


def _shard_on_mesh(x: Any, layout: StateLayout, mesh: Any) -> Any:
    """:func:`_shard` where the groups run along ``layout.mesh_axes``: each device
    cuts its own rank's chunk of the block it holds (no data moves)."""
    import jax
    import jax.numpy as jnp

    fmt, axes = layout.format, layout.mesh_axes
    assert axes is not None

    def cut(block: Any) -> Any:
        rank = 0
        for axis in axes:  # row-major along the group's axes, as the groups rank devices
            rank = rank * mesh.shape[axis] + jax.lax.axis_index(axis)
        return jax.lax.dynamic_slice_in_dim(fmt.padded_flat(block, jnp), rank * fmt.shard_len,
                                            fmt.shard_len)

    return jax.shard_map(cut, mesh=mesh, in_specs=layout.full_spec,
                         out_specs=_chunk_spec(mesh), check_vma=False)(x)


def _gather_on_mesh(y: Any, layout: StateLayout, mesh: Any) -> Any:
    """:func:`_shard_on_mesh`'s inverse: each device all-gathers its group's chunks
    (in rank order) into the block it holds."""
    import jax
    import jax.numpy as jnp

    fmt, axes = layout.format, layout.mesh_axes
    assert axes is not None

    def whole(chunk: Any) -> Any:
        return fmt.from_padded_flat(jax.lax.all_gather(chunk, axes, tiled=True), jnp)

    return jax.shard_map(whole, mesh=mesh, in_specs=_chunk_spec(mesh),
                         out_specs=layout.full_spec, check_vma=False)(y)


def build_program(capture: Capture, options: ShardingOptions,
                  next_values: list[tuple[int, int]], seconds: FirstCallSeconds,
                  force: bool = False) -> Program:
    """Optimize and compile ``capture``; :class:`Unsupported` says why not (any exception
    of the parser, the pass or XLA's compile becomes one, with its :class:`Reason`).

    ``next_values``: (output leaf, entry parameter) pairs where the output is the
    parameter's value for the next step, as the step's pytrees say (``params`` out →
    ``params`` in): :func:`~hlo_shard.passes.optimize.optimize` pairs optimizer state
    with its next value through them, and the executable aliases what jit donates
    (:class:`~hlo_shard.passes.optimize.ForExecutable`). ``force``: shard every
    eligible gradient even where the never-slower gate would keep the step whole.
    ``seconds``: where the pass's and the compile's seconds go (they stay there when
    this raises).
    """
    with seconds.timing("pass_"):
        names, result, state_args, state_outputs, shard_sharding = _optimized(
            capture, options, next_values, force)
    with seconds.timing("compile"), \
            _stage(Reason.COMPILE_FAILED, "XLA did not compile the optimized module"):
        executable = _xla.compile_replica_text(result.xla_text, capture.devices)
    return Program(capture, result, options, names, executable, state_args, state_outputs,
                   shard_sharding, seconds, list(next_values))


def _optimized(capture: Capture, options: ShardingOptions, next_values: list[tuple[int, int]],
               force: bool) -> tuple[UserNames, OptimizeResult, dict[int, StateLayout],
                                     dict[int, StateLayout], Any]:
    """The captured module parsed, its user names, what the optimizer made of it, the
    state layouts and the sharding of their shard forms (None without any)
    (:class:`Unsupported` where it made nothing to run)."""
    with _stage(Reason.PARSE_FAILED, "hlo-shard cannot read the captured module"):
        module = parse(capture.text, path="<captured step>")
    if len(module.entry.parameters()) != len(capture.kept):
        raise Unsupported(f"the partitioned module has {len(module.entry.parameters())} "
                          f"parameters for {len(capture.kept)} arguments", Reason.PASS_FAILED)
    # The user's names, read before the pass rewrites the module (the report's).
    names = user_names(module, next_values)
    with _stage(Reason.PASS_FAILED, "the pass refused the step"):
        check_executable(module)
        # (kept whole, ``fast`` runs ``fn``: nothing to write)
        result = optimize(module, options, force=force,
                          executable=ForExecutable(tuple(next_values)), write_kept_whole=False)
    report, decision = result.report, result.decision
    assert decision is not None  # the gate ran
    if not result.rewritten and (verdict := not_faster(decision)):
        raise Unsupported(verdict, Reason.NOT_FASTER, report, decision, names)
    if not result.rewritten:
        raise Unsupported("nothing to shard: " + (report.whole_reasons() or
                                                  "the step has no gradient all-reduce"),
                          Reason.NOTHING_TO_SHARD, report, decision, names)
    with _stage(Reason.PASS_FAILED, "the pass refused the step"):
        _ = result.xla_text  # the output check, here: a module failing it is the pass's fault
        shard_sharding = _shard_sharding(capture)
        state_args, state_outputs = _state_layouts(report, capture, shard_sharding.mesh)
    return (names, result, state_args, state_outputs,
            shard_sharding if state_args else None)


@contextmanager
def _stage(code: Reason, what: str) -> Iterator[None]:
    """Any exception of this stage (ours or XLA's; RecursionError included) as
    :class:`Unsupported`: ``fast`` then runs ``fn``, the loop never breaks."""
    try:
        yield
    except Unsupported:
        raise
    except HloShardError as err:
        raise Unsupported(f"{what}: {err}", code) from None
    except Exception as err:  # noqa: BLE001 - XLA's errors are not importable stably
        raise Unsupported(f"{what}: {describe(err)}", code) from err


def _state_layouts(report: ShardingReport, capture: Capture, mesh: Any
                   ) -> tuple[dict[int, StateLayout], dict[int, StateLayout]]:
    """``mesh``: the shard form's (:func:`_shard_sharding`)."""
    devices = len(capture.devices)

    def layout(entry: Any, full_shape: tuple[int, ...], full_sharding: Any) -> StateLayout:
        plain = StateLayout(entry.format)
        if not entry.groups or entry.groups == (tuple(range(devices)),):
            return plain
        grouped = _grouped(plain, entry.groups, devices, full_shape, full_sharding, capture)
        axes = _group_axes(entry.groups, full_sharding, mesh)
        return grouped if axes is None else replace(grouped, mesh_axes=axes,
                                                    full_spec=full_sharding.spec)

    args = {capture.kept[p.index]: layout(p, capture.in_shapes[capture.kept[p.index]],
                                          capture.in_shardings[capture.kept[p.index]])
            for p in report.parameters if p.kind == "sharded"}
    outs = {o.index: layout(o, tuple(capture.out_avals[o.index].shape),
                            capture.out_shardings[o.index])
            for o in report.outputs if o.kind == "sharded"}
    return args, outs


def _grouped(plain: StateLayout, groups: tuple[tuple[int, ...], ...], devices: int,
             full_shape: tuple[int, ...], full_sharding: Any, capture: Capture) -> StateLayout:
    """``plain`` sharded over replica ``groups`` (device ids: jit's order) that are not
    one group of every device. Each device's value of the leaf is its block of the
    leaf ``fn`` takes (``full_sharding``); every device of a group must hold the same
    block, and every block its group's every chunk, or the step is refused."""
    ranks = [-1] * devices
    for group in groups:
        if len(group) != plain.format.n:
            raise Unsupported("state='sharded': replica groups of unequal sizes",
                              Reason.UNSUPPORTED_STEP)
        for rank, device in enumerate(group):
            ranks[device] = rank
    if -1 in ranks:
        raise Unsupported("state='sharded': replica groups that leave out devices",
                          Reason.UNSUPPORTED_STEP)
    indices = full_sharding.devices_indices_map(full_shape)
    blocks = tuple(tuple(index.indices(size)[:2] for index, size in zip(indices[d], full_shape))
                   for d in capture.devices)
    if any(tuple(stop - start for start, stop in block) != plain.format.dims
           for block in blocks) \
            or any(len({blocks[d] for d in group}) != 1 for group in groups):
        raise Unsupported("state='sharded': an optimizer-state leaf's blocks do not follow "
                          "the gradient's replica groups", Reason.UNSUPPORTED_STEP)
    whole = all(block == tuple((0, size) for size in full_shape) for block in blocks)
    return StateLayout(plain.format, tuple(ranks), None if whole else full_shape,
                       None if whole else blocks)


def _group_axes(groups: tuple[tuple[int, ...], ...], full_sharding: Any,
                mesh: Any) -> tuple[str, ...] | None:
    """The axes of ``mesh`` (the shard form's: the user's mesh where it orders devices
    as jit does) along which ``groups`` run, each group the devices that differ only
    along them, in row-major order; None where the groups are no such axes or the leaf
    is not laid out on that mesh."""
    import itertools

    import numpy as np
    from jax.sharding import NamedSharding

    if not isinstance(full_sharding, NamedSharding) or full_sharding.mesh != mesh:
        return None
    shape = mesh.devices.shape
    positions = np.arange(mesh.devices.size).reshape(shape)  # jit's order is the mesh's
    wanted = set(groups)
    for count in range(1, len(shape) + 1):
        for along in itertools.combinations(range(len(shape)), count):
            others = [axis for axis in range(len(shape)) if axis not in along]
            rows = np.transpose(positions, others + list(along)).reshape(
                -1, int(np.prod([shape[axis] for axis in along])))
            if {tuple(int(p) for p in row) for row in rows} == wanted:
                return tuple(mesh.axis_names[axis] for axis in along)
    return None


def _shard_sharding(capture: Capture) -> Any:
    """Every device holding one chunk, in jit's device order: over the user's mesh when
    its order is jit's, else over a one-axis mesh of the same devices."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    mesh = next((s.mesh for s in capture.in_shardings if isinstance(s, NamedSharding)), None)
    if mesh is None or tuple(mesh.devices.flat) != tuple(capture.devices):
        mesh = Mesh(np.array(capture.devices), ("hlo_shard",))
    return NamedSharding(mesh, _chunk_spec(mesh))


def _chunk_spec(mesh: Any) -> Any:
    """One chunk per device of ``mesh``, in its order: the shard form's spec."""
    from jax.sharding import PartitionSpec

    axes = tuple(mesh.axis_names)
    return PartitionSpec(axes if len(axes) > 1 else axes[0])
