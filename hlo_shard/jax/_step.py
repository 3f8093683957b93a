"""``ShardedStep``: the user's jit step, run through its optimized per-device module.

Like jit, one compiled program per argument signature (tree structure of the positional
and keyword arguments; each leaf's shape, dtype and sharding — device order included;
the static arguments' values). The first call of a signature captures, optimizes and
compiles (:mod:`._capture`, :mod:`._program`); later calls hand the caller's jax Arrays
straight to the executable. Whatever cannot take that path runs ``fn`` itself, after
one warning naming the reason: no exception of hlo-shard's own machinery (capture, pass,
compile, the first run, the outputs) reaches the loop; jax's errors in tracing the
user's function do, as jit raises them.

In ``state="sharded"`` a program answers two signatures: the full one (state leaves
as ``fn`` takes them, converted on the way in) and the shard form its outputs come
back in, so a loop written for ``fn`` runs unchanged after its first step. Which
program a shard-form leaf belongs to is read from the leaf's own sharding (steps on the
same mesh shape with the devices in another order have different shard placements).
"""

from __future__ import annotations

import sys
import types
import weakref
import warnings
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from hlo_shard.errors import HloShardError
from hlo_shard.jax import _distributed, _xla
from hlo_shard.jax._capture import (Capture, FirstCallSeconds, JitStep, Reason, Unsupported,
                                    capture, describe)
from hlo_shard.jax._program import Program, StateLayout, build_program, convert, fallback_json
from hlo_shard.parser import parse
from hlo_shard.passes.base import run_pass
from hlo_shard.passes.executable_aliases import DonatedNextValueAliases
from hlo_shard.passes.parameter_names import ParameterOpNames
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.printer import to_text
from hlo_shard.runtime._child import version_refusal


class FallbackWarning(UserWarning):
    """``fast`` runs the original step: the message says why, :attr:`code` is the
    :class:`~hlo_shard.jax._capture.Reason` (as ``fast.report["fallback"]``)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _Fallback:
    why: Unsupported
    #: jit's step of this signature where the capture lowered and compiled it (its
    #: executable runs instead of ``fn``, which would lower and compile it again), else
    #: None.
    jit: JitStep | None = None


@dataclass
class _Entry:
    """A signature's program and the form its state leaves take in that signature."""

    program: Program
    shards: bool


@dataclass
class _Call:
    """One call's arguments, split as jit splits them: dynamic leaves (positional, then
    keyword) and static values."""

    leaves: list
    treedef: Any
    static: tuple
    names: list[str] = field(default_factory=list)
    #: The report's names: ``names``, or under a library's jit wrapper each leaf as the
    #: user's own arguments name it, where the wrapper handed it on as it was.
    shown: list[str] = field(default_factory=list)
    #: The signature key, computed once per call.
    key: tuple | None = None

    def described(self) -> _Call:
        """This call with each leaf's shape and dtype in place of the leaf: what the
        wrapper keeps of a call after it, for the report's names and the next signature's
        error note (the user's arrays are not kept alive past their loop's use of them)."""
        leaves = [_Described(tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None))
                  for leaf in self.leaves]
        return _Call(leaves, self.treedef, self.static, self.names, self.shown, self.key)


@dataclass(frozen=True)
class _Described:
    """A leaf's shape and dtype (:meth:`_Call.described`)."""

    shape: tuple
    dtype: Any


@dataclass(frozen=True)
class _StateLeaf:
    """Where one optimizer-state leaf of one program lives, in both forms."""

    layout: StateLayout
    full: Any
    shards: Any

    def identity(self) -> tuple:
        return (self.layout, _xla.placement(self.full, len(self.layout.full_shape)),
                _xla.placement(self.shards, 1))


def _converted(leaves: list, chosen: list[tuple[int, _StateLeaf]], to_shards: bool) -> list:
    """``leaves`` with each chosen ``(index, state leaf)`` in its other form."""
    values = convert([leaves[i] for i, _ in chosen], [w.layout for _, w in chosen],
                     [w.shards if to_shards else w.full for _, w in chosen], to_shards)
    out = list(leaves)
    for (index, _), value in zip(chosen, values):
        out[index] = value
    return out


def _refuse_other_devices(name: str, leaf: Any, full: Any) -> None:
    """A full leaf committed to other devices than its program places it on (a
    checkpoint restored onto one device) is refused in the user's words: jit refuses a
    step's arguments on two sets of devices alike, and hlo-shard's conversion would
    say so of its own arguments."""
    if not getattr(leaf, "committed", False) or leaf.sharding.device_set == full.device_set:
        return
    ids = sorted(device.id for device in leaf.sharding.device_set)
    raise ValueError(f"hlo_shard.jax: {name} is on devices {ids}, the step's on "
                     f"{sorted(device.id for device in full.device_set)}: place it as the "
                     f"step's arguments are (jax.device_put with the step's sharding) or "
                     f"pass host arrays")


def _front_and_jit(fn: Callable, caller: str = "shard_weight_update"
                   ) -> tuple[Callable[[Callable], Callable] | None, Any]:
    """The ``jax.jit`` that compiles ``fn`` and, for a library's jit wrapper, how to call
    the wrapper with another function where it calls its ``jax.jit`` (its own pre- and
    post-processing of the arguments kept): flax's ``nnx.jit`` (``jitted_fn``), equinox's
    ``filter_jit`` (``_cached``). A method of a class whose function is one of those (a
    ``Trainer``'s ``@partial(jax.jit, static_argnums=0)`` step) is its function called
    with the instance first: jit counts ``self`` among its static arguments. A plain
    function is jitted here; anything else with a ``lower`` is refused now, not at the
    first step, in the words of ``caller`` (the function the user called)."""
    import jax

    if isinstance(fn, types.MethodType):
        front, jitted = _front_and_jit(fn.__func__, caller)
        return (lambda step: partial(front(step) if front is not None else step,
                                     fn.__self__)), jitted
    if _xla.is_jax_jit(fn):
        return None, fn
    for attribute in ("jitted_fn", "_cached"):
        inner = getattr(fn, attribute, None)
        if inner is not None and _xla.is_jax_jit(inner):
            return (lambda step, attribute=attribute: _calling(fn, attribute, step)), inner
    if hasattr(fn, "lower"):
        # (jax.pmap's result is a plain function with a ``lower``: name it for what it is)
        got = "a jax.pmap'ed function (written with jax.jit over a Mesh, as jax's pmap " \
              "migration guide shows, it is taken; install(pmap_replicated=True) shards " \
              "the pmap step as it is, and XLA's dump of it (XLA_FLAGS=--xla_dump_to=DIR) " \
              "is what hlo-shard optimize DIR reads)" if isinstance(fn, types.FunctionType) \
            else f"{type(fn).__module__}.{type(fn).__qualname__}"
        raise HloShardError(f"{caller} needs a jax.jit-wrapped function (or flax's nnx.jit, "
                            f"equinox's filter_jit, or the plain function); got {got}")
    if isinstance(fn, jax.stages.Compiled):
        raise HloShardError(f"{caller} needs the jax.jit-wrapped function, not its compiled "
                            f"executable (jit(f).lower(...).compile()): pass jit(f)")
    if not callable(fn):
        raise HloShardError(f"{caller} needs a function, got {type(fn).__name__}")
    return None, jax.jit(fn)


def per_device_hlo(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """The per-device module of ``fn`` (``jax.jit``, a library's jit wrapper as
    :func:`shard_weight_update` takes them, or a function jitted here) for these
    arguments, as ``hlo-shard optimize`` reads it: each donated argument whose next value
    the outputs' pytree names (``params`` out → ``params`` in) aliased to it, as
    :func:`shard_weight_update` pairs them. Compiles once (no computation runs).
    A wrapper (``nnx.jit``, ``eqx.filter_jit``) is called as the user calls it, its jit
    given the step that captures the arguments the wrapper makes for it."""
    front, jitted = _front_and_jit(fn, "per_device_hlo")
    # (how shard_weight_update splits and names jit's arguments, for the next values)
    pairing = ShardedStep(fn, ShardingOptions())

    def text_of(args: tuple, kwargs: dict) -> str:
        try:
            cap = capture(jitted, args, kwargs)
        except Unsupported as why:
            raise HloShardError(str(why)) from None
        call = pairing._split(args, kwargs)
        call.names = pairing._names(call)
        # (a wrapper's jit names its arguments its own way: the user's paths instead)
        shown = pairing._shown_names(call)
        renamed = tuple((number, shown[leaf]) for number, leaf in enumerate(cap.kept)
                        if shown[leaf] and shown[leaf] != call.names[leaf])
        return _with_next_values(cap, pairing._next_values(call, cap), renamed)

    if front is None:
        return text_of(args, kwargs)

    def captured(*jit_args: Any, **jit_kwargs: Any) -> Any:
        raise _Captured(text_of(jit_args, jit_kwargs))

    pairing._wrapped = (args, kwargs)  # the user's arguments, which name the leaves
    try:
        front(captured)(*args, **kwargs)
    except _Captured as got:
        return got.text
    raise HloShardError("the step's jit wrapper returned without calling its jax.jit")


def _with_next_values(cap: Capture, next_values: list[tuple[int, int]],
                      renamed: tuple[tuple[int, str], ...] = ()) -> str:
    """The captured module's text with each donated parameter whose next value the
    pytrees name aliased to it (:class:`DonatedNextValueAliases`): jit writes a bare
    ``buffer_donor``, from which ``hlo-shard optimize`` could only guess which output is
    which parameter's next value (a loss is a scalar parameter's, by its type); and the
    parameters ``renamed`` (number, the user's path) given that ``op_name``
    (:class:`ParameterOpNames`). Text the parser refuses goes out as jit wrote it:
    ``hlo-shard optimize`` then says where it stops reading, which is what a report of
    it needs."""
    try:
        module = parse(cap.text, path="<captured step>")
    except HloShardError:
        return cap.text
    aliased = run_pass(DonatedNextValueAliases(tuple(next_values)), module).changed
    if not (run_pass(ParameterOpNames(renamed), module).changed or aliased):
        return cap.text
    return to_text(module)


def _agreement(lowered: Any, program: Program | None) -> str:
    """Why this process runs ``fn`` instead of ``program`` under ``jax.distributed``: the
    other processes do not all build it (:func:`~._distributed.agree_on_program`); ""
    where they do, in one process, and for a step on this process's own devices (no
    other process builds it). ``program`` None: this process runs ``fn``, which the
    others learn at once. The step is named by jit's ``lowered`` form, which every
    process has before its capture can fail (a process whose capture failed has no
    partitioned module to name it by: the others waited for it until the timeout)."""
    if not _distributed.multi_process():
        return ""
    import jax

    try:
        me = jax.process_index()
        if all(getattr(device, "process_index", me) == me
               for device in _xla.device_assignment(lowered)):
            return ""
        return _distributed.agree_on_program(
            _distributed.program_digest(lowered.as_text()),
            None if program is None else _distributed.program_digest(program.hlo_text))
    except Exception as err:  # noqa: BLE001 - never into the loop: every process runs fn
        return (f"hlo_shard.jax: the processes could not agree on the step "
                f"({describe(err)}); it runs as fn")


class _Captured(Exception):
    """The module the wrapper's jit was called for, carried out through the wrapper
    (which would otherwise post-process what its jit returns)."""

    def __init__(self, text: str) -> None:
        super().__init__("captured")
        self.text = text


def _parameter_names(fn: Callable) -> tuple[str, ...]:
    """``fn``'s positional parameter names as its signature gives them (a method's
    instance among them, as jit counts it), or none where it has no signature."""
    import inspect

    try:
        signature = inspect.signature(fn.__func__ if isinstance(fn, types.MethodType) else fn)
    except (TypeError, ValueError):
        return ()
    return tuple(signature.parameters)


def _calling(wrapper: Any, attribute: str, step: Callable) -> Callable:
    """``wrapper`` calling ``step`` where it calls its ``attribute``. Equinox's wrapper is
    a frozen dataclass: a copy with the field replaced. Flax's tags its graph contexts
    with the wrapper object itself (its inner function looks them up by it), so a copy
    would not find them: the attribute is swapped for the duration of each call (a
    concurrent call of the user's own step from another thread would take ``step``)."""
    if attribute in getattr(wrapper, "__dataclass_fields__", {}):
        return replace(wrapper, **{attribute: step})

    def call(*args: Any, **kwargs: Any) -> Any:
        original = getattr(wrapper, attribute)
        setattr(wrapper, attribute, step)
        try:
            return wrapper(*args, **kwargs)
        finally:
            setattr(wrapper, attribute, original)
    return call


class ShardedStep:
    """``fn`` with its weight update sharded across the data-parallel devices.

    Call it as ``fn``. :attr:`report`, :attr:`hlo_text` and :attr:`original_hlo_text`
    describe the program of the latest new signature (:attr:`report` also where it
    runs ``fn``: the reason code and the gate's estimates); in ``state="sharded"``
    :meth:`shard_args`, :meth:`gather_args` and :meth:`gather_outputs` convert between
    full leaves and the per-device shards the optimizer state is kept in.
    """

    def __init__(self, fn: Callable, options: ShardingOptions, force: bool = False,
                 device_profile: bool = False) -> None:
        front, self._jitted = _front_and_jit(fn)
        #: A method's instance: the first argument of every call, never the user's.
        self._bound: tuple = (fn.__self__,) if isinstance(fn, types.MethodType) else ()
        #: A library wrapper's copy calling :meth:`_step` where it called its jax.jit.
        self._front = None if front is None else front(self._step)
        info = getattr(self._jitted, "_jit_info", None)
        self._static_argnums = tuple(getattr(info, "static_argnums", ()) or ())
        self._static_argnames = tuple(getattr(info, "static_argnames", ()) or ())
        signature = getattr(info, "fun_signature", None)
        self._arg_names = tuple(signature.parameters) if signature is not None else ()
        self.options = options
        #: Price on the profile of the devices the first captured step is compiled for
        #: (the user named none): ``options.profile`` is replaced then.
        self._device_profile = device_profile
        self.force = force
        self._entries: dict[tuple, _Entry | _Fallback] = {}
        self._warned: set[str] = set()
        self._latest: Program | Unsupported | None = None
        self._latest_call: _Call | None = None
        #: The shard-form state outputs of the latest run, by identity: (program, by
        #: array id its output number and a weak reference to the array — an id alone
        #: could be a later array's; holding the arrays would keep the loop's previous
        #: state alive after the loop dropped it).
        self._state_outputs: tuple[Program, dict[int, tuple[int, weakref.ref]]] | None = None
        #: Sharded mode: per program keeping state in shards, state leaf name → where.
        self._states: list[tuple[Program, dict[str, _StateLeaf]]] = []
        #: The names of the arguments those programs take whole (not state): a batch
        #: leaf whose shape and placement happen to be a state leaf's shard form is
        #: still the batch (never gathered as if it were shards).
        self._whole_names: set[str] = set()
        #: A library's jit wrapper's call in progress: the user's own arguments, and
        #: the names of the function's positional parameters (not its jit's).
        self._wrapped: tuple[tuple, dict] | None = None
        self._user_args = _parameter_names(fn)

    # --------------------------------------------------------------- the step
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._front is not None:
            self._wrapped = (args, kwargs)  # the user's names, read if this signature is new
            try:
                return self._front(*args, **kwargs)
            finally:
                self._wrapped = None
        return self._step(*args, **kwargs)

    def _shown_names(self, call: _Call) -> list[str]:
        """``call.names``, each leaf a library's jit wrapper passed on as the user gave
        it named by the user's own argument path instead (by identity: the wrapper's
        jit names its arguments its own way, ``dynamic_donate['first'][3]``)."""
        if self._wrapped is None:
            return call.names
        args, kwargs = self._wrapped
        user = self._split_user(self._bound + args, kwargs)
        by_leaf = {id(leaf): name for name, leaf in zip(self._names(user, self._user_args),
                                                         user.leaves)}
        return [by_leaf.get(id(leaf), name) for name, leaf in zip(call.names, call.leaves)]

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        call = self._split(args, kwargs)
        try:
            hash(call.static)
        except TypeError:  # jit refuses an unhashable static argument: its own error
            return self._jitted(*args, **kwargs)
        if _traced(call.leaves):
            self._warn(Unsupported(
                "called inside a jax transformation (jit, scan, vmap, eval_shape, grad): "
                "the step is traced as jit's, unsharded (call it from Python to shard it"
                + ("; its state goes in whole: fast.gather_args" if
                   self.options.state == "sharded" else "") + ")"))
            return self._jitted(*args, **kwargs)
        if self._states and self._key(call) not in self._entries:
            full = self._convert(call, to_shards=False)  # shards of a signature seen before
            if full is not None:
                call = full
                args, kwargs = self._rebuild(call, args, kwargs)
        entry = self._entry(call, args, kwargs)
        if isinstance(entry, _Fallback):
            return self._run_fn(entry, call, args, kwargs)
        if entry.program.ran or _distributed.multi_process():
            return self._run(entry, call)
        try:  # a first run that fails leaves the inputs intact: fn can still run them
            outs = self._run(entry, call)
        except Exception as err:  # noqa: BLE001 - never into the loop
            program = entry.program
            why = Unsupported(f"the optimized step failed to run: {describe(err)}",
                              Reason.RUN_FAILED, program.report, program.decision)
            why.seconds = program.seconds
            return self._run_fn(self._fall_back(self._key(call), why, program), call,
                                args, kwargs)
        entry.program.ran = True
        return outs

    def _run_fn(self, fallback: _Fallback, call: _Call, args: tuple, kwargs: dict) -> Any:
        """``fn``'s step: jit's executable of the capture's lowering for this signature
        (its arguments as jit hands them to it: the dynamic ones), else jit itself."""
        if fallback.jit is None:
            return self._jitted(*args, **kwargs)
        import jax

        dynamic, dyn_kwargs = jax.tree.unflatten(call.treedef, call.leaves)
        return fallback.jit.executable()(*dynamic, **dyn_kwargs)

    def _run(self, entry: _Entry, call: _Call) -> Any:
        import jax

        program, cap = entry.program, entry.program.capture
        leaves = call.leaves
        convert_state = bool(program.state_args) and not entry.shards
        if convert_state:
            leaves = program.to_shards(leaves)
        arrays = []
        for index in cap.kept:
            leaf = leaves[index]
            expected = program.arg_sharding(index)
            if not _xla.same_placement(leaf, expected):
                leaf = jax.device_put(leaf, expected)
            if cap.opaque[index]:
                leaf = _xla.base_array(leaf)
            arrays.append(leaf)
        outs = _xla.execute(program.executable, arrays, program.out_handlers)
        if program.state_outputs:
            self._state_outputs = (program, {id(outs[k]): (k, weakref.ref(outs[k]))
                                             for k in program.state_outputs})
        if convert_state:  # the step consumed their shards; jit would consume them
            program.delete_donated_state(call.leaves)
        return jax.tree.unflatten(cap.out_tree, outs)

    # ------------------------------------------------ converting state leaves
    def shard_args(self, *args: Any) -> Any:
        """``args`` (full leaves, as ``fn`` takes them) in the form ``fast`` takes:
        optimizer-state leaves as per-device shards. Leaves are matched by their
        position and path, so a prefix such as ``(params, opt_state)`` works once the
        step has run or been sharded once with all its arguments. Identity in
        gathered mode, where ``fast`` runs ``fn`` itself or keeps no state leaf sharded
        (after a step), and for a library's jit
        wrapper (its jit names the arguments otherwise, so no path of the user's names
        a state leaf: the step takes the full leaves as they are); before its first
        step such a wrapper's ``shard_args`` is refused (ValueError)."""
        # Captured before the first step only: a step that ran and keeps no state leaf
        # as shards (kept whole, fallen back) takes its leaves as they are.
        if not self._entries and self.options.state == "sharded":
            if self._front is not None:  # its jit takes arguments of the wrapper's making
                raise ValueError("hlo_shard.jax: shard_args before any step needs the "
                                 "step's own jax.jit; a library's jit wrapper (nnx.jit, "
                                 "eqx.filter_jit) hands its jit arguments of its own "
                                 "making: call the step with the full leaves first (the "
                                 "first call takes them)")
            bound = self._bound + args  # the first signature: capture it
            try:
                self._entry(self._split(bound, {}), bound, {})
            except TypeError as err:  # jax's, tracing the step with too few arguments
                if hasattr(err, "add_note"):  # (python 3.11+)
                    err.add_note("hlo_shard.jax: shard_args before any step captures the step "
                                 "from the arguments given: pass all of them, the batch "
                                 "too (fast.shard_args(params, opt_state, batch)), or run "
                                 "a step first")
                raise
        return self._convert_args(args, to_shards=True)

    def gather_args(self, *args: Any) -> Any:
        """``args`` with every shard-form state leaf gathered back to the full leaf
        (same shape, dtype and sharding as ``fn`` takes it); the inverse of
        :meth:`shard_args`, e.g. for checkpoints or to switch back to ``fn``. A leaf in
        the shard form of a state leaf but placed as no program places its shards is
        refused (ValueError), never returned as if it were the leaf."""
        return self._convert_args(args, to_shards=False)

    def gather_outputs(self, outs: Any) -> Any:
        """``fast``'s outputs with every shard-form leaf gathered back to the full leaf,
        by the program whose outputs they are (shapes and shard placement)."""
        import jax

        leaves, treedef = jax.tree.flatten(outs)
        for program, _ in self._states:
            if program.returns(treedef, leaves, placed=True):
                return jax.tree.unflatten(treedef, program.gather_out_leaves(leaves))
        if any(program.returns(treedef, leaves, placed=False) for program, _ in self._states):
            raise ValueError("hlo_shard.jax: these outputs have the shapes of a sharded step's "
                             "outputs but their shards are on devices (or in an order) no "
                             "program of this step uses; refusing to return shards as leaves")
        # A library's jit wrapper returns the step's outputs in a pytree of its own: the
        # latest run's state outputs by identity (a per-example output shaped and placed
        # as some state leaf's shards stays as it is), else each leaf by its form alone.
        latest = self._latest_state_outputs(leaves)
        if latest is not None:
            program, found = latest
            return jax.tree.unflatten(treedef, program.gather_outputs_at(leaves, found))
        chosen = [(k, where) for k, leaf in enumerate(leaves)
                  if (where := self._shards_by_form(f"output leaf {k}", leaf,
                                                    tuple(getattr(leaf, "shape", ()))))]
        return jax.tree.unflatten(treedef, _converted(leaves, chosen, to_shards=False))

    def _convert_args(self, args: tuple, to_shards: bool) -> tuple:
        bound = self._bound + args
        converted = self._convert(self._split_user(bound, {}), to_shards)
        return args if converted is None else \
            self._rebuild(converted, bound, {})[0][len(self._bound):]

    def _convert(self, call: _Call, to_shards: bool) -> _Call | None:
        """``call`` with every state leaf in the other form (None: none to convert). A
        shard no program knows by name (a library's jit wrapper names its arguments
        otherwise) that the latest run returned is gathered as the state output it is,
        by identity (leaves of different shapes can have one shard form); any other
        leaf by its name, else its form."""
        names = self._names(call)
        latest = None if to_shards else self._latest_state_outputs(call.leaves)
        outputs = {} if latest is None else {
            index: k for index, k in latest[1].items()
            if not any(names[index] in known for _, known in self._states)}
        chosen = []
        for index, (name, leaf) in enumerate(zip(names, call.leaves)):
            where = None if index in outputs else self._state_leaf(name, leaf, to_shards)
            if where is not None:
                chosen.append((index, where))
        if not chosen and not outputs:
            return None
        leaves = latest[0].gather_outputs_at(call.leaves, outputs) \
            if latest is not None and outputs else call.leaves
        return _Call(_converted(leaves, chosen, to_shards), call.treedef, call.static)

    def _latest_state_outputs(self, leaves: list) -> tuple[Program, dict[int, int]] | None:
        """The latest run's program and, per leaf that is one of its state outputs, which;
        None where no leaf is."""
        if self._state_outputs is None:
            return None
        program, outputs = self._state_outputs
        found = {}
        for k, leaf in enumerate(leaves):
            number, output = outputs.get(id(leaf), (0, None))
            if output is not None and output() is leaf:
                found[k] = number
        return (program, found) if found else None

    def _state_leaf(self, name: str, leaf: Any, to_shards: bool) -> _StateLeaf | None:
        """The state leaf ``leaf`` is (by name and shape) in the form to convert from: a
        full leaf by its shape (its placement decides between programs that differ), a
        shard by its shape and placement."""
        shape = tuple(getattr(leaf, "shape", ()))
        if not to_shards and not any(name in names for _, names in self._states):
            return None if name in self._whole_names else self._shards_by_form(name, leaf, shape)
        candidates = {}
        misplaced = False
        for _, names in self._states:
            where = names.get(name)
            if where is None:
                continue
            if to_shards and shape == where.layout.full_shape:
                candidates[where.identity()] = where
            elif not to_shards and shape == where.layout.shape:
                if _xla.same_placement(leaf, where.shards):
                    candidates[where.identity()] = where
                else:  # a 1-D leaf's full and shard shapes can be equal
                    misplaced |= shape != where.layout.full_shape
        if len(candidates) > 1:
            placed = [w for w in candidates.values() if _xla.same_placement(leaf, w.full)]
            if len(placed) == 1:
                return placed[0]
            raise ValueError(f"hlo_shard.jax: {name} could be the state leaf of programs on "
                             f"different devices; put it on the devices of the one it is "
                             f"for (jax.device_put) first")
        if to_shards and len(candidates) == 1:
            _refuse_other_devices(name, leaf, next(iter(candidates.values())).full)
        if not candidates and misplaced and not _fully_replicated(leaf):
            raise ValueError(f"hlo_shard.jax: {name} {list(shape)} has the shape of a state "
                             f"leaf's shards but is placed as no program of this step places "
                             f"them (devices or their order differ); refusing to treat shards "
                             f"as the leaf")
        return next(iter(candidates.values()), None)

    def _shards_by_form(self, name: str, leaf: Any, shape: tuple) -> _StateLeaf | None:
        """A leaf no program knows by name (a library's jit wrapper, e.g.
        ``eqx.filter_jit``, hands the step its arguments under its own names) that is in
        the shard form of state leaves, by shape and placement: gathered when every state
        leaf it can be the shards of gathers the same way, refused when they differ —
        never returned as if it were the leaf."""
        forms = {where.identity(): where for _, names in self._states
                 for where in names.values()
                 if shape == where.layout.shape and _xla.same_placement(leaf, where.shards)}
        if len(forms) > 1:
            raise ValueError(f"hlo_shard.jax: {name} {list(shape)} is in the shard form of "
                             f"state leaves of different shapes, and this step names its "
                             f"arguments otherwise; gather fast's outputs with "
                             f"gather_outputs instead")
        return next(iter(forms.values()), None)

    # ----------------------------------------------------- what it ran
    @property
    def report(self) -> dict | None:
        """The pass's decisions for the latest new signature, leaves named by their paths;
        where it runs ``fn``: ``fallback`` (the reason code), ``reason`` and the gate's
        estimates (``gate``: predictions, not measurements). None before the first call."""
        if isinstance(self._latest, Unsupported):
            return fallback_json(self._latest, self.options)
        if self._latest is None or self._latest_call is None:  # (set together)
            return None
        return self._latest.report_json(self._latest_call.shown or self._latest_call.names)

    @property
    def _program(self) -> Program | None:
        return self._latest if isinstance(self._latest, Program) else None

    @property
    def memory_stats(self) -> dict[str, int] | None:
        """XLA's compiled memory figures (bytes per device) of the latest program."""
        program = self._program
        return None if program is None else _xla.memory_stats(program.executable)

    @property
    def hlo_text(self) -> str | None:
        program = self._program
        return None if program is None else program.hlo_text

    @property
    def original_hlo_text(self) -> str | None:
        program = self._program
        return None if program is None else program.capture.text

    # ------------------------------------------------------------ signatures
    def _split(self, args: tuple, kwargs: dict) -> _Call:
        import jax

        if not self._static_argnums and not self._static_argnames:  # the common step
            leaves, treedef = jax.tree.flatten((args, kwargs))
            return _Call(leaves, treedef, ((), ()))
        count = len(args)
        static_nums = {n % count for n in self._static_argnums if -count <= n < count}
        dynamic = tuple(a for i, a in enumerate(args) if i not in static_nums)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        static = (tuple((i, args[i]) for i in sorted(static_nums)),
                  tuple(sorted((k, v) for k, v in kwargs.items()
                               if k in self._static_argnames)))
        leaves, treedef = jax.tree.flatten((dynamic, dyn_kwargs))
        return _Call(leaves, treedef, static)

    def _split_user(self, args: tuple, kwargs: dict) -> _Call:
        """The user's own arguments (``shard_args``/``gather_args``) as leaves. A
        library's jit wrapper hands its ``jax.jit`` arguments of its own making, and that
        jit's static arguments are its own (``eqx.filter_jit``'s ``_cached`` has
        ``static_argnums=2``): none of them says which of the user's arguments is static,
        so every leaf of theirs is looked at (a third positional argument, the optimizer
        state in ``step(model, state, opt_state, ...)``, was passed over whole)."""
        if self._front is None:
            return self._split(args, kwargs)
        import jax

        leaves, treedef = jax.tree.flatten((args, kwargs))
        return _Call(leaves, treedef, ((), ()))

    def _rebuild(self, call: _Call, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with their dynamic leaves those of ``call``."""
        import jax

        dynamic, dyn_kwargs = jax.tree.unflatten(call.treedef, call.leaves)
        dynamic = iter(dynamic)
        static = dict(call.static[0])
        return (tuple(static[i] if i in static else next(dynamic) for i in range(len(args))),
                {k: dyn_kwargs.get(k, v) for k, v in kwargs.items()})

    def _key(self, call: _Call) -> tuple:
        if call.key is None:
            call.key = (call.treedef, call.static, _xla.signature(call.leaves))
        return call.key

    def _entry(self, call: _Call, args: tuple, kwargs: dict) -> _Entry | _Fallback:
        key = self._key(call)
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        seconds = FirstCallSeconds()
        problem = version_refusal()
        if problem is not None:
            return self._fall_back(key, Unsupported(problem, Reason.UNSUPPORTED_JAX))
        try:
            with seconds.timing("capture"):
                cap = capture(self._jitted, args, kwargs)
        except Unsupported as why:
            why.seconds = seconds
            with suppress(Exception):  # (the report's profile: the default's if it fails)
                self._price_on(None)
            return self._fall_back(key, why, jit=why.jit, lowered=why.lowered)
        except Exception as err:
            if not self._traces(args, kwargs):  # jax's, tracing the user's function
                _name_the_argument(err, call, self._latest_call, self._names(call),
                                   shards=self.options.state == "sharded")
                raise
            # The function traces: jax's lowering API failed where jit's own call does not
            # go (a pytree whose unflattening checks its leaves, jmp's loss scale, is
            # rebuilt from ArgInfo placeholders there): jit runs the step.
            return self._fall_back(key, Unsupported(
                f"jax could not lower the step for capture ({describe(err)}); jit's own "
                f"call runs it", Reason.CAPTURE_FAILED))
        try:
            self._price_on(cap.devices[0])
            program = build_program(cap, self.options, self._next_values(call, cap),
                                    seconds, self.force)
            call.names = self._names(call)
            call.shown = self._shown_names(call)
            state = {name: _StateLeaf(layout, full, program.shard_sharding)
                     for name, (layout, full) in program.state_by_name(call.names).items()}
            shard_key = program.shard_key(key, call.leaves) \
                if program.state_args else None
        except Exception as err:  # noqa: BLE001 - ours: never into the loop
            refusal = err if isinstance(err, Unsupported) else Unsupported(
                f"hlo-shard failed on the step: {describe(err)}", Reason.PASS_FAILED)
            refusal.seconds = seconds
            return self._fall_back(key, refusal, jit=cap.jit, lowered=cap.jit.lowered)
        apart = _agreement(cap.jit.lowered, program)
        if apart:
            refusal = Unsupported(apart, Reason.PROCESSES_DISAGREE, program.report,
                                  program.decision)
            refusal.seconds = seconds
            return self._fall_back(key, refusal, jit=cap.jit)
        self._entries[key] = _Entry(program, shards=False)
        if shard_key is not None:
            self._entries[shard_key] = _Entry(program, shards=True)
            self._states.append((program, state))
            self._whole_names.update(name for name in call.names if name not in state)
        self._latest, self._latest_call = program, call.described()
        return self._entries[key]

    def _price_on(self, device: Any) -> None:
        """Where the user named no profile, take ``device``'s (the first device of the
        step's first capture; None: jax's first device, where the capture stopped before
        it knew the step's), once."""
        if self._device_profile:
            import jax

            self.options = replace(self.options, profile=_xla.device_profile(
                jax.devices()[0] if device is None else device))
            self._device_profile = False

    def _traces(self, args: tuple, kwargs: dict) -> bool:
        """Whether jit traces the user's function for these arguments (its errors are
        the user's, raised as jit raises them; a failure after tracing is jax's API's)."""
        try:
            self._jitted.trace(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the user's error: the caller raises its own
            return False
        return True

    def _fall_back(self, key: tuple, why: Unsupported, program: Program | None = None,
                   jit: JitStep | None = None, lowered: Any = None) -> _Fallback:
        """Run ``fn`` for this signature (and, for a program that failed its first run,
        for every signature it answered) from now on, after one warning: as ``jit``'s
        executable of the signature from the capture, where there is one (a failed
        program's full signature has its capture's; its shard form runs jit), compiled
        here where the capture stopped before it (its seconds in the first call's
        ``compile``). ``lowered``: jit's lowering of the step, where the capture or the
        pass refused it: the other processes learn at once that this one runs ``fn``."""
        if program is None:
            if lowered is not None:
                _agreement(lowered, None)
            runs = {key: jit}
        else:
            runs = {k: None if e.shards else program.capture.jit
                    for k, e in self._entries.items()
                    if isinstance(e, _Entry) and e.program is program}
            runs.setdefault(key, None)
        for k, run in runs.items():
            self._entries[k] = _Fallback(why, run)
        fallback = self._entries[key]
        assert isinstance(fallback, _Fallback)
        if fallback.jit is not None and fallback.jit.compiled is None and why.seconds is not None:
            with why.seconds.timing("compile"), suppress(Exception):
                fallback.jit.executable()  # (jit's own error: raised by the call, as jit's)
        self._states = [(p, names) for p, names in self._states if p is not program]
        self._latest = why
        self._warn(why)
        return fallback

    def _paths(self, call: _Call) -> list[tuple[int | str, str]]:
        """Each dynamic leaf as (argument number, path inside it): a keyword argument
        by the number of the parameter it names (``opt_state=`` is argument 1 of
        ``step(params, opt_state, batch)``, whose next value is output ``[1]``), only a
        keyword the signature does not list (``**kwargs``) by its name."""
        import jax

        static = {n for n, _ in call.static[0]}
        positions = [i for i in range(len(self._arg_names) + len(call.leaves))
                     if i not in static]
        numbers = {name: number for number, name in enumerate(self._arg_names)}
        paths = jax.tree_util.tree_flatten_with_path(
            jax.tree.unflatten(call.treedef, [0] * len(call.leaves)))[0]
        return [(positions[path[1].idx] if path[0].idx == 0
                 else numbers.get(path[1].key, path[1].key),
                 jax.tree_util.keystr(path[2:])) for path, _ in paths]

    def _names(self, call: _Call, arg_names: tuple[str, ...] | None = None) -> list[str]:
        """Each dynamic leaf's name as the user wrote it: ``params['l0']['w']``
        (positional arguments named by ``arg_names``, default jit's function's)."""
        arg_names = self._arg_names if arg_names is None else arg_names
        names = []
        for head, rest in self._paths(call):
            if isinstance(head, int):
                head = arg_names[head] if head < len(arg_names) else f"args[{head}]"
            names.append(head + rest)
        return names

    def _next_values(self, call: _Call, cap: Any) -> list[tuple[int, int]]:
        """(output leaf, entry parameter) pairs where output ``[j]<path>`` is argument
        ``j``'s leaf at ``<path>`` with the same shape and dtype: the training loop's
        feedback (``params, opt_state, loss = fast(params, opt_state, batch)``; a
        method's arguments counted after its instance)."""
        import jax

        parameter = {index: number for number, index in enumerate(cap.kept)}
        by_path = {path: index for index, path in enumerate(self._paths(call))}
        outs = jax.tree_util.tree_flatten_with_path(
            jax.tree.unflatten(cap.out_tree, [0] * len(cap.out_avals)))[0]
        pairs = []
        for k, (path, _) in enumerate(outs):
            if not path or not isinstance(getattr(path[0], "idx", None), int):
                continue
            index = by_path.get((path[0].idx + len(self._bound),
                                 jax.tree_util.keystr(path[1:])))
            if index is not None and index in parameter and _same_aval(call.leaves[index], cap.out_avals[k]):
                pairs.append((k, parameter[index]))
        return pairs

    def _warn(self, why: Unsupported) -> None:
        reason = str(why)
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(FallbackWarning(f"hlo_shard.jax: running the original step: "
                                          f"{reason}", why.code.value),
                          stacklevel=_callers_level())


#: Packages whose frames stand between the user's call and the warning: ours, the jit
#: wrappers :func:`_front_and_jit` calls through, and jax's tracing (``fast`` called
#: inside a transformation).
_CALLING_PACKAGES = frozenset({"hlo_shard", "equinox", "flax", "jax"})


def _callers_level() -> int:
    """``warnings.warn``'s ``stacklevel`` (from its caller) of the first frame outside
    :data:`_CALLING_PACKAGES`: the user's line, however many wrapper frames between."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and \
            frame.f_globals.get("__name__", "").partition(".")[0] in _CALLING_PACKAGES:
        frame, level = frame.f_back, level + 1
    return level


def _traced(leaves: list) -> bool:
    """Whether an argument is a tracer of an enclosing transformation: there is no
    array to run a compiled executable on, only a program to trace into."""
    import jax

    return any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)


def _same_aval(leaf: Any, aval: Any) -> bool:
    return tuple(getattr(leaf, "shape", ())) == tuple(aval.shape) \
        and str(getattr(leaf, "dtype", "")) == str(aval.dtype)


def _fully_replicated(leaf: Any) -> bool:
    sharding = getattr(leaf, "sharding", None)
    return sharding is None or bool(getattr(sharding, "is_fully_replicated", False))


#: The note on a shape error of a sharded-state wrapper's first call.
_FIRST_CALL_TAKES_WHOLE_LEAVES = (
    "hlo_shard.jax: this step has not run yet, so it takes whole leaves: state shards "
    "(the flat [N*L] leaves a sharded step returns) from another wrapper, or a "
    "checkpoint of them, go through that wrapper's gather_args first; checkpoint "
    "gather_args's whole leaves (docs/jax.md)")


def _name_the_argument(err: Exception, call: _Call, before: _Call | None,
                       names: list[str], shards: bool = False) -> None:
    """Add to jax's error which argument differs from the last signature that ran; before
    any ran, where the state is kept in ``shards``, that a wrapper's first call takes
    whole leaves (shards from another wrapper, or a checkpoint of them, met the user's
    function as they were: a bare shape error from inside it)."""
    if not hasattr(err, "add_note"):
        return
    if before is None:
        if shards:
            err.add_note(_FIRST_CALL_TAKES_WHOLE_LEAVES)
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
