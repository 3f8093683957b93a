"""``ShardedStep``: the user's jit step, run through its optimized per-device module.

Like jit, one compiled program per argument signature (tree structure; each leaf's
shape, dtype and sharding; the static arguments' values). The first call of a
signature captures, optimizes and compiles (:mod:`._capture`, :mod:`._program`);
later calls hand the caller's jax Arrays straight to the executable. Whatever cannot
take that path runs ``fn`` itself, after one warning naming the reason.

In ``state="sharded"`` a program answers two signatures: the full one (state leaves
as ``fn`` takes them, converted on the way in) and the shard form its outputs come
back in, so a loop written for ``fn`` runs unchanged after its first step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from hlo_shard.jax import _distributed, _xla
from hlo_shard.jax._capture import Unsupported, capture
from hlo_shard.jax._program import Program, build_program, convert
from hlo_shard.passes.weight_update_sharding import ShardingOptions


class FallbackWarning(UserWarning):
    """``fast`` runs the original step (the message says why)."""


@dataclass(frozen=True)
class _Fallback:
    reason: str


@dataclass
class _Entry:
    """A signature's program and the form its state leaves take in that signature."""

    program: Program
    shards: bool


@dataclass
class _Call:
    """One call's arguments, split as jit splits them: dynamic leaves and static values."""

    leaves: list
    treedef: Any
    static: tuple
    names: list[str] = field(default_factory=list)
    #: The signature key, computed once per call.
    key: tuple | None = None


class ShardedStep:
    """``fn`` with its weight update sharded across the data-parallel devices.

    Call it as ``fn``. :attr:`report`, :attr:`hlo_text` and :attr:`original_hlo_text`
    describe the program of the latest new signature; in ``state="sharded"``
    :meth:`shard_args`, :meth:`gather_args` and :meth:`gather_outputs` convert between
    full leaves and the per-device shards the optimizer state is kept in.
    """

    def __init__(self, fn: Callable, options: ShardingOptions, force: bool = False) -> None:
        import jax

        _xla.check_version()
        self._jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        info = getattr(self._jitted, "_jit_info", None)
        self._static_argnums = tuple(getattr(info, "static_argnums", ()) or ())
        self._static_argnames = tuple(getattr(info, "static_argnames", ()) or ())
        signature = getattr(info, "fun_signature", None)
        self._arg_names = tuple(signature.parameters) if signature is not None else ()
        self.options = options
        self.force = force
        self._entries: dict[tuple, _Entry | _Fallback] = {}
        self._warned: set[str] = set()
        self._latest: Program | None = None
        self._latest_call: _Call | None = None
        #: Sharded mode: state argument name → (layout, full sharding); where shards live.
        self._state: dict = {}
        self._shard_sharding = None

    # --------------------------------------------------------------- the step
    def __call__(self, *args, **kwargs):
        call = self._split(args, kwargs)
        if self._state and not kwargs and self._key(call) not in self._entries:
            full = self.gather_args(*args)  # shards of a signature seen before
            if full is not args:
                args, call = full, self._split(full, {})
        entry = self._entry(call, args, kwargs)
        if isinstance(entry, _Fallback):
            return self._jitted(*args, **kwargs)
        if entry.program.ran or entry.program.state_args or _distributed.multi_process():
            return self._run(entry, call)
        try:  # a first run that fails leaves the inputs intact: fn can still run them
            outs = self._run(entry, call)
        except Exception as err:
            reason = f"the optimized step failed to run: {str(err).splitlines()[0]}"
            self._warn(reason)
            self._entries[self._key(call)] = _Fallback(reason)
            return self._jitted(*args, **kwargs)
        entry.program.ran = True
        return outs

    def _run(self, entry: _Entry, call: _Call):
        import jax

        program, cap = entry.program, entry.program.capture
        leaves = call.leaves
        if program.state_args and not entry.shards:
            leaves = program.to_shards(leaves, donated=cap.donated)
        arrays = []
        for index in cap.kept:
            leaf = leaves[index]
            expected = program.arg_sharding(index)
            if not _xla.same_placement(leaf, expected):
                leaf = jax.device_put(leaf, expected)
            arrays.append(leaf)
        outs = _xla.execute(program.executable, arrays, program.out_handlers)
        return jax.tree.unflatten(cap.out_tree, outs)

    # ------------------------------------------------ converting state leaves
    def shard_args(self, *args):
        """``args`` (full leaves, as ``fn`` takes them) in the form ``fast`` takes:
        optimizer-state leaves as per-device shards. Leaves are matched by their
        position and path, so a prefix such as ``(params, opt_state)`` works once the
        step has run or been sharded once with all its arguments. Identity in
        gathered mode and where ``fast`` runs ``fn`` itself."""
        return self._convert_args(args, to_shards=True)

    def gather_args(self, *args):
        """``args`` with every shard-form state leaf gathered back to the full leaf
        (same shape, dtype and sharding as ``fn`` takes it); the inverse of
        :meth:`shard_args`, e.g. for checkpoints or to switch back to ``fn``."""
        return self._convert_args(args, to_shards=False)

    def gather_outputs(self, outs):
        """``fast``'s outputs with every shard-form leaf gathered back to the full leaf."""
        import jax

        leaves, treedef = jax.tree.flatten(outs)
        for entry in self._entries.values():
            if isinstance(entry, _Entry) and entry.program.returns(treedef, leaves):
                return jax.tree.unflatten(treedef, entry.program.gather_out_leaves(leaves))
        return outs

    def _convert_args(self, args: tuple, to_shards: bool) -> tuple:
        call = self._split(args, {})
        if not self._state:
            if not to_shards or self.options.state != "sharded":
                return args
            self._entry(call, args, {})  # the first signature: capture it now
        names = self._names(call)
        chosen = []
        for index, (name, leaf) in enumerate(zip(names, call.leaves)):
            found = self._state.get(name)
            if found is None:
                continue
            layout, sharding = found
            shard = _is_shard(leaf, layout, self._shard_sharding)
            full = not shard and tuple(getattr(leaf, "shape", ())) == tuple(layout.dims)
            if (full if to_shards else shard):
                chosen.append((index, layout, sharding))
        if not chosen:
            return args
        targets = [self._shard_sharding if to_shards else sharding for _, _, sharding in chosen]
        values = convert([call.leaves[i] for i, _, _ in chosen], [layout for _, layout, _ in chosen],
                         targets, to_shards)
        leaves = list(call.leaves)
        for (index, _, _), value in zip(chosen, values):
            leaves[index] = value
        return self._rebuild(call, leaves, args)

    # ----------------------------------------------------- what it ran
    @property
    def report(self) -> dict | None:
        """The pass's decisions for the latest signature, leaves named by their paths."""
        if self._latest is None or self._latest_call is None:  # (set together)
            return None
        return self._latest.report_json(self._latest_call.names)

    @property
    def memory_stats(self) -> dict[str, int] | None:
        """XLA's compiled memory figures (bytes per device) of the latest program."""
        return None if self._latest is None else _xla.memory_stats(self._latest.executable)

    @property
    def hlo_text(self) -> str | None:
        return None if self._latest is None else self._latest.hlo_text

    @property
    def original_hlo_text(self) -> str | None:
        return None if self._latest is None else self._latest.capture.text

    # ------------------------------------------------------------ signatures
    def _split(self, args: tuple, kwargs: dict) -> _Call:
        import jax

        count = len(args)
        static_nums = {n % count for n in self._static_argnums if -count <= n < count}
        dynamic = tuple(a for i, a in enumerate(args) if i not in static_nums)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        static = (tuple((i, args[i]) for i in sorted(static_nums)),
                  tuple(sorted((k, v) for k, v in kwargs.items()
                               if k in self._static_argnames)))
        leaves, treedef = jax.tree.flatten((dynamic, dyn_kwargs))
        return _Call(leaves, treedef, static)

    def _rebuild(self, call: _Call, leaves: list, args: tuple) -> tuple:
        import jax

        dynamic, _ = jax.tree.unflatten(call.treedef, leaves)
        dynamic = iter(dynamic)
        static = dict(call.static[0])
        return tuple(static[i] if i in static else next(dynamic) for i in range(len(args)))

    def _key(self, call: _Call) -> tuple:
        if call.key is None:
            call.key = (call.treedef, call.static,
                        tuple(_xla.leaf_key(x) for x in call.leaves))
        return call.key

    def _entry(self, call: _Call, args: tuple, kwargs: dict) -> _Entry | _Fallback:
        key = self._key(call)
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        try:
            cap = capture(self._jitted, args, kwargs)
            program = build_program(cap, self.options, self._next_values(call, cap),
                                    self.force)
        except Unsupported as why:
            _distributed.agree_on_program("fallback to fn", str(why))
            self._warn(str(why))
            self._entries[key] = _Fallback(str(why))
            return self._entries[key]
        except Exception as err:
            _name_the_argument(err, call, self._latest_call, self._names(call))
            raise
        _distributed.agree_on_program("optimized module", program.hlo_text)
        call.names = self._names(call)
        self._entries[key] = _Entry(program, shards=False)
        if program.state_args:
            self._entries[program.shard_key(call.treedef, call.static, call.leaves)] = \
                _Entry(program, shards=True)
            self._state.update(program.state_by_name(call.names))
            self._shard_sharding = program.shard_sharding
        self._latest, self._latest_call = program, call
        return self._entries[key]

    def _paths(self, call: _Call) -> list[tuple[int | str, str]]:
        """Each dynamic leaf as (argument number or keyword, path inside it)."""
        import jax

        static = {n for n, _ in call.static[0]}
        positions = [i for i in range(len(self._arg_names) + len(call.leaves))
                     if i not in static]
        paths = jax.tree_util.tree_flatten_with_path(
            jax.tree.unflatten(call.treedef, [0] * len(call.leaves)))[0]
        return [(positions[path[1].idx] if path[0].idx == 0 else path[1].key,
                 jax.tree_util.keystr(path[2:])) for path, _ in paths]

    def _names(self, call: _Call) -> list[str]:
        """Each dynamic leaf's name as the user wrote it: ``params['l0']['w']``."""
        names = []
        for head, rest in self._paths(call):
            if isinstance(head, int):
                head = self._arg_names[head] if head < len(self._arg_names) \
                    else f"args[{head}]"
            names.append(head + rest)
        return names

    def _next_values(self, call: _Call, cap) -> list[tuple[int, int]]:
        """(output leaf, entry parameter) pairs where output ``[j]<path>`` is argument
        ``j``'s leaf at ``<path>`` with the same shape and dtype: the training loop's
        feedback (``params, opt_state, loss = fast(params, opt_state, batch)``)."""
        import jax

        parameter = {index: number for number, index in enumerate(cap.kept)}
        by_path = {path: index for index, path in enumerate(self._paths(call))}
        outs = jax.tree_util.tree_flatten_with_path(
            jax.tree.unflatten(cap.out_tree, [0] * len(cap.out_avals)))[0]
        pairs = []
        for k, (path, _) in enumerate(outs):
            if not path or not isinstance(getattr(path[0], "idx", None), int):
                continue
            index = by_path.get((path[0].idx, jax.tree_util.keystr(path[1:])))
            if index is not None and index in parameter and _same_aval(call.leaves[index], cap.out_avals[k]):
                pairs.append((k, parameter[index]))
        return pairs

    def _warn(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"hlo_shard.jax: running the original step: {reason}",
                          FallbackWarning, stacklevel=4)


def _same_aval(leaf, aval) -> bool:
    return tuple(getattr(leaf, "shape", ())) == tuple(aval.shape) \
        and str(getattr(leaf, "dtype", "")) == str(aval.dtype)


def _is_shard(leaf, layout, shard_sharding) -> bool:
    """Whether ``leaf`` is in shard form (a 1-D full leaf can have the shard's shape;
    the sharding tells them apart)."""
    return tuple(getattr(leaf, "shape", ())) == layout.shape \
        and _xla.same_placement(leaf, shard_sharding)


def _name_the_argument(err: Exception, call: _Call, before: _Call | None,
                       names: list[str]) -> None:
    """Add to jax's error which argument differs from the last signature that ran."""
    if before is None or not hasattr(err, "add_note"):
        return
    if call.treedef != before.treedef:
        err.add_note(f"hlo_shard.jax: the arguments' tree structure differs from the "
                     f"previous call's:\n  now:    {call.treedef}\n  before: {before.treedef}")
        return
    for name, now, then in zip(names, call.leaves, before.leaves):
        shape_now, shape_then = getattr(now, "shape", ()), getattr(then, "shape", ())
        dtype_now, dtype_then = getattr(now, "dtype", None), getattr(then, "dtype", None)
        if tuple(shape_now) != tuple(shape_then) or dtype_now != dtype_then:
            err.add_note(f"hlo_shard.jax: argument {name} is {dtype_now}{list(shape_now)}, "
                         f"was {dtype_then}{list(shape_then)} in the previous call")
