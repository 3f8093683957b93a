"""The pass inside XLA's compilation: ``install()`` and an unmodified ``jax.jit`` step is
compiled with its weight update sharded.

jax 0.10.2's public hook ``jax.extend.xla.register_hlo_module_transformation`` hands every
module being compiled (at the stage :data:`PLATFORM_HOOKS` names for the platform:
``PRE_SCHEDULER``, on CPU after SPMD partitioning, fusion and copy insertion, on GPU after
partitioning and simplification only) to a callback as serialized ``HloModuleProto`` bytes; the callback
returns new bytes or None. Ours parses the module's text once, hands it to the
optimizer's one entry point (:func:`~hlo_shard.passes.optimize.optimize`, the same gate
and checks as ``hlo-shard optimize``) and returns its text only when something was
sharded. The signature of a compiled function cannot change, so the state
is ``gathered`` (a training ``while`` loop compiled as one module keeps its state sharded in
the carry, as the pass does). The callback never raises into XLA: any exception or
refusal returns None with one line on the ``hlo_shard`` logger. A ``KeyboardInterrupt``
(Ctrl-C while the pass runs) or ``SystemExit`` would come out of XLA as an ``INTERNAL``
error, so the callback keeps it, returns None, and it is raised again on the Python side
once XLA has returned: by a ``jax.monitoring`` listener of jax's end-of-compile event
(``/jax/core/compile/backend_compile_duration``, recorded right after the backend compile
returns, in the thread that compiled). Proto ↔ text goes through jax's private
``xla_client``, behind the runtime's version check.

XLA compiles the same module again often (jax's caches cleared, an ahead-of-time
``lower().compile()`` next to the jit call, a step re-jitted in a loop): the outcome of
the latest :data:`MAX_REMEMBERED` modules is kept by the digest of their text (their
bytes differ in XLA's module id), for the current installation only (each ``install()``
starts afresh), and a module seen before gets it without being parsed or passed again.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import math
import re
import threading
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hlo_shard import __version__
from hlo_shard.analysis.collectives import recovered_device_counts
from hlo_shard.analysis.replication import ParamOverrides
from hlo_shard.errors import HloShardError
from hlo_shard.ir import Module
from hlo_shard.jax import _xla
from hlo_shard.jax._capture import StageSeconds
from hlo_shard.jax._step import FallbackWarning
from hlo_shard.parser import cyclic_gc_paused, grammar_digest
from hlo_shard.passes.optimize import checked_options
from hlo_shard.passes.speed_gate import not_faster
from hlo_shard.passes.weight_update import ShardingOptions, ShardingReport
from hlo_shard.profiles import HardwareProfile, resolve_profile
from hlo_shard.runtime._child import version_refusal, version_tuple

logger = logging.getLogger("hlo_shard")

#: The name the pass is registered under (one registration per process).
PASS_NAME = "hlo_shard.weight_update_sharding"
#: How many decisions :func:`decisions` keeps, the latest: a long-running process that
#: compiles without end (a server, a sweep) keeps a bounded record, not one per compile.
MAX_DECISIONS = 1000
#: How many modules' outcomes the hook remembers (by the digest of their text): the
#: latest, so a process compiling without end keeps a bounded set.
MAX_REMEMBERED = 16
#: Bytes every serialized module with an all-reduce contains (its opcode string): the
#: quick check that lets init functions and the like through without parsing.
_ALL_REDUCE = b"all-reduce"
#: The longest the interpreter's exit waits for a pass running on XLA's compile thread
#: to return (:meth:`_Hook.wait_until_idle`).
EXIT_WAIT_S = 60.0


class PlatformWarning(UserWarning):
    """``install()`` on a platform where the hook has not been seen to run: XLA may
    ignore it without a word, and every step then compiles as it was."""


@dataclass(frozen=True)
class PlatformHook:
    """Where the pass runs on one platform (jax's ``default_backend()`` name)."""

    #: The ``jax.extend.xla.PipelineStage`` it registers at.
    stage: str
    #: The oldest jaxlib release the hook was seen to run with there (None: never seen
    #: running). That release and newer ones give no warning: the support XLA added
    #: (the plugin's transform extension) is not taken out again.
    seen_running_with: str | None
    #: What ``install()`` warns when it was not (why the hook may be ignored).
    untested: str = ""


_UNTESTED = ("install(): the pass hook has not been run on {platform} with jaxlib {jaxlib}: "
             "{why}; if it is ignored, hlo_shard.jax.decisions() stays empty after the first "
             "step compiles and every step runs unsharded (scripts/device_check.sh checks it)")
#: The stage per platform. Each platform's PRE_SCHEDULER module is the form the pass
#: handles: XLA CPU's, fused and with the gradients combined, after copy insertion; XLA
#: GPU's, the partitioner's (plain all-reduces, no layouts, loops intact) at the end of
#: RunOptimizationPasses, before the combiners, async conversion and scheduler run on
#: what the pass emits; POST_SCHEDULER has async collectives the pass leaves alone.
PLATFORM_HOOKS: dict[str, PlatformHook] = {
    "cpu": PlatformHook("PRE_SCHEDULER", "0.10.2"),
    # Seen: scripts/device_check.sh on an H200 (jax-cuda13 plugin), 2026-12-04.
    "gpu": PlatformHook("PRE_SCHEDULER", "0.11.2",
                        "XLA GPU runs registered passes only since openxla/xla PR #43630 "
                        "(June 2026; the GPU plugin's transform extension with it), older "
                        "jaxlibs and CUDA plugins ignore the hook silently; it was seen "
                        "running with jaxlib 0.11.2"),
    "tpu": PlatformHook("PRE_SCHEDULER", None,
                        "the hook runs through the TPU plugin's transform extension, which "
                        "only recent libtpu releases provide"),
}
#: A platform not in the table (another PJRT plugin).
OTHER_PLATFORM = PlatformHook("PRE_SCHEDULER", None,
                              "no XLA backend but CPU, GPU and TPU is known to run it")


@dataclass
class HookSeconds(StageSeconds):
    """Where the hook's seconds on one module go, all inside XLA's compile: ``read``
    (XLA's proto to text, parsed), ``pass`` (the optimizer with its gate and output
    check) and ``write`` (the sharded text through XLA's parser back to a proto)."""

    read: float = 0.0
    pass_: float = 0.0
    write: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {"read": self.read, "pass": self.pass_, "write": self.write}


@dataclass(frozen=True)
class Decision:
    """What the hook did with one compiled module."""

    module: str
    #: The module XLA compiled is the sharded one.
    changed: bool
    #: Why it was left as it was ("" when changed).
    reason: str
    #: The pass report (None when the pass did not run to the end).
    report: ShardingReport | None
    seconds: float
    #: The outcome of the same module compiled before (not parsed or passed again).
    reused: bool = False
    #: Where the seconds went (None where the outcome was reused).
    split: HookSeconds | None = None

    @property
    def sharded_bytes(self) -> int:
        """The bytes of the gradient all-reduces the pass sharded (of :attr:`gradient_bytes`)."""
        return sum(e.bytes for e in self.report.explanations if e.sharded) if self.report else 0

    @property
    def gradient_bytes(self) -> int:
        """The bytes the step's gradient all-reduces sum, each counted: a weight whose
        gradient comes in two (a tied embedding: the lookup's and the output
        projection's, where XLA does not add them first) counts twice, as the wire
        carries it twice."""
        return sum(e.bytes for e in self.report.explanations) if self.report else 0

    def summary(self) -> str:
        """What the hook did, in the one line it logs. A module changed with no gradient
        sharded is the pipeline's moves (all-reduces out of accumulation loops and
        conditionals, all-reduce + slice pairs made reduce-scatters): it says so, where
        "sharded 0 of N gradient bytes" alone would read as nothing done."""
        if not self.changed:
            return f"{self.module} left unchanged: {(self.reason.splitlines() or [''])[0]}"
        sharded = self.sharded_bytes
        moves = "" if sharded else \
            " (changed by moving its gradient all-reduces out of accumulation loops or " \
            "conditionals, or making them reduce-scatters; the report's notes say which)"
        dropped = "; XLA drops its donation (the donated arguments stay alive)" \
            if self.donation_dropped else ""
        return (f"{self.module}: sharded {sharded} of {self.gradient_bytes} gradient "
                f"bytes{moves}{dropped}")

    @property
    def donation_dropped(self) -> bool:
        """The step donated arguments (its module aliased outputs to them) and XLA
        compiled the module returned: XLA's hook keeps no ``input_output_alias`` of a
        returned module (jaxlib 0.10.2 on CPU, even for the very bytes it handed over;
        ``docs/jax-hook.md``), so the donated arguments are not consumed: they stay
        alive beside the step's outputs."""
        return self.changed and self.report is not None and bool(self.report.feedback)


@dataclass(frozen=True)
class _Settings:
    options: ShardingOptions
    only: re.Pattern | None
    force: bool = False
    #: Installed before jax started its backend (a script that calls
    #: ``jax.distributed.initialize()`` after ``install()``, as ``python -m hlo_shard.jax``
    #: runs it, may not have it started): the platform's warning and, with
    #: ``device_profile``, the devices' profile are read at the first module the hook sees.
    platform_pending: bool = False
    device_profile: bool = False
    #: What install() adds to the key of jax's persistent compilation cache
    #: (:func:`_cache_key`).
    cache_key: str = ""


class _Hook:
    """The process-wide registration: at most one, whatever the number of installs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.settings: _Settings | None = None
        #: The stage the pass is registered at (None: not registered).
        self.registered: str | None = None
        self.decisions: deque[Decision] = deque(maxlen=MAX_DECISIONS)
        #: A KeyboardInterrupt or SystemExit the callback caught, raised again once XLA
        #: has returned (:func:`_raise_pending`).
        self.pending: BaseException | None = None
        self.listening = False
        #: Digest of a module's bytes → its outcome (:data:`MAX_REMEMBERED`, latest).
        self.outcomes: OrderedDict[bytes, _Outcome] = OrderedDict()
        #: Calls of :meth:`transform` in progress, and their end signalled.
        self.running = 0
        self.idle = threading.Condition(self.lock)

    def wait_until_idle(self) -> None:
        """At the interpreter's exit (``atexit``): wait, at most :data:`EXIT_WAIT_S`, for
        a pass running on XLA's compile thread. XLA calls the hook on a thread of its
        own while jax's thread waits; a Ctrl-C there ends the program, and an
        interpreter finalized under a thread still running Python aborts the process
        (SIGABRT or SIGSEGV instead of the KeyboardInterrupt's exit)."""
        with self.idle:
            self.idle.wait_for(lambda: self.running == 0, timeout=EXIT_WAIT_S)
            self.settings = None  # (a call from here on returns at once)
            stage, self.registered = self.registered, None
        # (no later stage of a compile calls into Python; where jax started no backend
        # nothing compiles, and unregistering would start them)
        if stage is not None and _xla.backends_started():
            _unregister(stage)

    def transform(self, data: bytes) -> bytes | None:
        """The callback XLA calls: never raises, None unless the module was sharded."""
        settings = self.settings
        if settings is None or _ALL_REDUCE not in data:
            return None
        with self.lock:
            self.running += 1
        try:
            return self._transform(data, settings)
        finally:
            with self.idle:
                self.running -= 1
                self.idle.notify_all()

    def _transform(self, data: bytes, settings: _Settings) -> bytes | None:
        if settings.platform_pending:
            settings = self.on_platform(settings)
        start = time.perf_counter()
        try:
            outcome, reused = self.outcome(data, settings)
        except BaseException as stop:  # Ctrl-C: XLA would turn it into INTERNAL
            with self.lock:
                self.pending = stop
            return None
        if outcome.skipped:
            return None
        name, report = outcome.name, outcome.sharded.report
        result, reason = _agree_across_processes(outcome)
        decision = Decision(name, result is not None, reason, report,
                            time.perf_counter() - start, reused,
                            None if reused else outcome.seconds)
        self.record(decision)
        logger.info("hlo_shard: %s", decision.summary())
        return result

    def on_platform(self, settings: _Settings) -> _Settings:
        """``settings`` completed now that jax's backend runs (XLA is compiling): the
        platform's warning given, the devices' profile taken where the user named none;
        as they were if that fails (it never goes into XLA)."""
        try:
            done, _ = _read_platform(settings)
        except Exception as err:  # noqa: BLE001 - nothing may propagate into XLA
            logger.warning("hlo_shard: install(): the platform could not be read (%s); "
                           "priced on %s", err,
                           getattr(settings.options.profile, "name", settings.options.profile))
            done = replace(settings, platform_pending=False, device_profile=False)
        with self.lock:
            if self.settings is settings:
                self.settings = done
        return done

    def cache_key(self) -> str:
        """What the installed settings add to jax's persistent cache keys ("" while not
        installed: the key jax gives without hlo-shard)."""
        settings = self.settings
        return settings.cache_key if settings is not None else ""

    def record(self, decision: Decision) -> None:
        """Keep ``decision`` (the oldest goes once :data:`MAX_DECISIONS` are kept)."""
        with self.lock:
            self.decisions.append(decision)

    def outcome(self, data: bytes, settings: _Settings) -> tuple[_Outcome, bool]:
        """What the pass makes of a serialized module, and whether it was remembered;
        any ``Exception`` becomes the reason it is kept (and is not remembered)."""
        name = "<module>"
        seconds = HookSeconds()
        try:
            xc = _xla_client()
            with seconds.timing("read"):
                hlo = xc.hlo.HloModule.from_serialized_hlo_module_proto(data)
                name = hlo.name
                if settings.only is not None and not settings.only.search(name):
                    return _Outcome(settings, name, _Sharded(None, None, "", 0), None,
                                    skipped=True), False
                text = _module_text(hlo)
                digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
            remembered = self.recall(digest, settings)
            if remembered is not None:
                return remembered, True
            # (the Python thread that asked XLA for this compile waits for it)
            with cyclic_gc_paused(caller_waits=True):
                sharded = _shard(text, name, settings.options, settings.force, seconds)
            out = sharded.text
            with seconds.timing("write"):
                result = None if out is None else \
                    xc.hlo.hlo_module_from_text(out).as_serialized_hlo_module_proto()
        except Exception as err:  # noqa: BLE001 - nothing may propagate into XLA
            failed = _Sharded(None, None, f"{type(err).__name__}: {err}", 0)
            return _Outcome(settings, name, failed, None, seconds=seconds), False
        outcome = _Outcome(settings, name, sharded, result, seconds=seconds)
        self.remember(digest, outcome)
        return outcome, False

    def recall(self, digest: bytes, settings: _Settings) -> _Outcome | None:
        with self.lock:
            outcome = self.outcomes.get(digest)
            if outcome is None or outcome.settings is not settings:
                return None  # (another installation's: installed while this compiled)
            self.outcomes.move_to_end(digest)
            return outcome

    def remember(self, digest: bytes, outcome: _Outcome) -> None:
        """Keep ``outcome`` (the least recently used goes beyond :data:`MAX_REMEMBERED`)."""
        with self.lock:
            self.outcomes[digest] = outcome
            while len(self.outcomes) > MAX_REMEMBERED:
                self.outcomes.popitem(last=False)


@dataclass(frozen=True)
class _Outcome:
    """What the pass made of one module's bytes under one installation's settings."""

    settings: _Settings
    name: str
    #: What the pass made of it (where it failed: the reason alone).
    sharded: _Sharded
    #: The sharded module's bytes (None: XLA compiles the module as it was).
    result: bytes | None
    #: Not for the hook (``only`` does not match its name): no decision recorded.
    skipped: bool = False
    seconds: HookSeconds | None = None


@dataclass(frozen=True)
class _Sharded:
    """What :func:`_shard` made of a module's text."""

    #: The sharded module's text (None: XLA compiles the module as it was).
    text: str | None
    report: ShardingReport | None
    #: Why it was not sharded ("" where it was).
    reason: str
    #: The devices the module runs on (:func:`_devices`; 0: not read).
    devices: int
    #: Under ``jax.distributed`` (else None): the digests processes agree on
    #: (:func:`~._distributed.program_digest`) of the module and of the sharded one.
    build: str | None = None
    program: str | None = None




_HOOK = _Hook()

#: jax's event recorded when a backend compile has returned (jax/_src/dispatch.py).
_COMPILE_DONE = "/jax/core/compile/backend_compile_duration"


def _raise_pending(event: str, duration_secs: float, **kwargs: str | int) -> None:
    """A ``jax.monitoring`` listener: the interrupt the callback kept, raised in Python
    right after XLA's compile returned (it propagates out of the ``jit`` call)."""
    if event != _COMPILE_DONE or _HOOK.pending is None:
        return
    with _HOOK.lock:
        stop, _HOOK.pending = _HOOK.pending, None
    if stop is not None:
        raise stop


def _xla_client() -> Any:
    from jax._src.lib import xla_client  # private API: behind the version check

    return xla_client


def _module_text(hlo: Any) -> str:
    """XLA's module as text, its constants in full (what the parser reads)."""
    print_options = _xla_client().hlo.HloPrintOptions()
    print_options.print_large_constants = True
    return hlo.to_string(print_options)


def _shard(text: str, name: str, options: ShardingOptions, force: bool = False,
           seconds: HookSeconds | None = None) -> _Sharded:
    """What the pass makes of the module ``text``; ``seconds``: the parse goes to its
    ``read``, the optimizer and its output check to its ``pass``."""
    from hlo_shard.jax import _distributed
    from hlo_shard.parser import parse
    from hlo_shard.passes.optimize import optimize

    seconds = seconds if seconds is not None else HookSeconds()
    with seconds.timing("read"):
        module = parse(text, path=f"<{name}>")
    devices = _devices(module)
    build = _distributed.program_digest(text) if _distributed.multi_process() else None
    with seconds.timing("pass_"):
        try:
            # (kept whole, XLA compiles the module as it was: nothing to write)
            result = optimize(module, options, force=force, write_kept_whole=False)
        except HloShardError as err:
            return _Sharded(None, None, str(err), devices, build)
        report = result.report
        if not result.rewritten:
            return _Sharded(None, report, "nothing sharded (" + (
                not_faster(result.decision) or report.whole_reasons() or
                "no gradient all-reduce") + ")", devices, build)
        out = result.xla_text
        return _Sharded(out, report, "", devices, build,
                        None if build is None else _distributed.program_digest(out))


def _devices(module: Module) -> int:
    """The devices ``module`` runs on: its header's replicas × partitions, or, as the
    module XLA hands the hook prints neither, the count its collectives' groups name
    (the largest device id + 1); 0 where nothing says."""
    if "replica_count" in module.header or "num_partitions" in module.header:
        return module.device_count
    counts = recovered_device_counts(module)
    return math.prod(counts.values()) if counts else 0


def _agree_across_processes(outcome: _Outcome) -> tuple[bytes | None, str]:
    """What XLA compiles of ``outcome`` (the sharded module's bytes, None: the module as
    it was) and why not the sharded one. Under ``jax.distributed`` every process compiles
    the step and runs this callback: a process returns a sharded module only where all
    return that one (:func:`~._distributed.agree_on_program`; a process running another
    program would wait in collectives forever). A module on no more devices than this
    process holds is this process's own (rank 0 computing a metric on its devices): no
    other process compiles it, so there is nothing to agree on. A failure of the
    agreement itself (never into XLA) runs the module as it was."""
    import jax

    from hlo_shard.jax import _distributed

    sharded = outcome.sharded
    if sharded.build is None or not _distributed.multi_process() or \
            0 < sharded.devices <= jax.local_device_count():
        return outcome.result, sharded.reason
    try:
        why = _distributed.agree_on_program(sharded.build, sharded.program)
    except Exception as err:  # noqa: BLE001 - nothing may propagate into XLA
        why = f"hlo_shard.jax: the processes could not agree ({type(err).__name__}: {err})"
    return (None, why) if why else (outcome.result, sharded.reason)


def platform_hook(platform: str, jaxlib: str) -> tuple[PlatformHook, str]:
    """The stage the pass registers at on ``platform`` (jax's ``default_backend()``)
    with ``jaxlib``, and the warning ``install()`` gives there ("" where the hook was
    seen to run with that jaxlib or an older one, and on CPU)."""
    hook = PLATFORM_HOOKS.get(platform, OTHER_PLATFORM)
    if not hook.untested or (hook.seen_running_with is not None and
                             version_tuple(jaxlib) >= version_tuple(hook.seen_running_with)):
        return hook, ""
    return hook, _UNTESTED.format(platform=platform, jaxlib=jaxlib, why=hook.untested)


def _read_platform(settings: _Settings, stacklevel: int = 2) -> tuple[_Settings, PlatformHook]:
    """``settings`` with the platform read (its :class:`PlatformWarning` given, at
    ``stacklevel`` from here) and, where ``device_profile`` asks, the profile of the
    devices jax compiles for (not the CPU's rates on a GPU); and the platform's hook."""
    import jax
    import jaxlib.version

    hook, warning = platform_hook(jax.default_backend(), jaxlib.version.__version__)
    if warning:
        warnings.warn(warning, PlatformWarning, stacklevel=stacklevel)
    options = replace(settings.options, profile=_xla.device_profile(jax.devices()[0])) \
        if settings.device_profile else settings.options
    return replace(settings, options=options, platform_pending=False,
                   device_profile=False), hook


def _cache_key(options: ShardingOptions, device_profile: bool, only: str | None,
               force: bool) -> str:
    """What install() adds to the key of jax's persistent compilation cache: the pass's
    build and its settings. Without it a step cached without the hook ran as cached under
    install() (the hook never called), one compiled under the hook ran sharded in a
    process without it, and one cached under another build or other settings stayed as
    it was. Read from the settings as asked (``device_profile``: the profile the devices
    give, which jax's key already tells apart by its platform)."""
    settings = json.dumps({"options": asdict(options), "device_profile": device_profile,
                           "only": only, "force": force},
                          sort_keys=True, default=lambda value: sorted(value))
    return f" hlo-shard {_build()} {hashlib.sha256(settings.encode()).hexdigest()[:16]}"


@functools.cache
def _build() -> str:
    """hlo-shard's release and a digest of its code, grammar and profiles."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(grammar_digest().encode())
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
            digest.update(path.relative_to(package).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:16]}"


class Installation:
    """What :func:`install` returns: ``with install(): ...`` uninstalls at the end."""

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        uninstall()


def install(*, state: str = "gathered", strategy: str = "auto",
            profile: HardwareProfile | str | None = None,
            min_shard_bytes: int = 0, only: str | None = None,
            force: bool = False, accumulator: str = "auto",
            pmap_replicated: bool = False) -> Installation:
    """Shard the weight update of every module jax compiles from now on (every backend
    jax knows); jax's in-memory caches of compiled functions are cleared, so a step
    jitted before compiles again. Installing again replaces the settings; the pass stays
    registered once. ``only``: a regex the module name (``jit_step``) must match. A
    module the cost model does not predict faster sharded compiles as it is, unless
    ``force`` (as ``optimize --force``). ``accumulator``: as for ``shard_weight_update``
    (``optimize --accumulator``). ``pmap_replicated``: every ``jax.pmap`` step holds the
    same copy of its weights and optimizer state on every device (as
    ``flax.jax_utils.replicate`` makes them); a pmap module cannot say so, and without
    it a pmap step compiles as it is (sharding the update of copies that differ would
    mix them)."""
    if state != "gathered":
        raise HloShardError("install(): state must be 'gathered' (the hook cannot change a "
                            "compiled function's signature; shard_weight_update can)")
    hardware = resolve_profile(profile)
    options = ShardingOptions(state=state, strategy=strategy, min_shard_bytes=min_shard_bytes,
                              profile=hardware, accumulator=accumulator,
                              overrides=ParamOverrides(pmap_replicated=pmap_replicated))
    options = checked_options(options)  # rejects bad options here, not inside XLA
    try:
        pattern = re.compile(only) if only is not None else None
    except re.error as err:
        raise HloShardError(f"install(only={only!r}): not a regular expression ({err})") from None
    problem = version_refusal()
    if problem is not None:  # jax compiles as before: a training script goes on unchanged
        warnings.warn(f"hlo_shard.jax.install() installed nothing: {problem}",
                      FallbackWarning, stacklevel=2)
        return Installation()
    from jax.extend import xla as jax_xla

    # The platform and its devices: read now where jax's backend runs already, else at
    # the first module the hook sees (reading them would start the backend, and
    # jax.distributed.initialize() refuses to run after that).
    settings = _Settings(options, pattern, force, platform_pending=True,
                         device_profile=profile is None,
                         cache_key=_cache_key(options, profile is None, only, force))
    stage = OTHER_PLATFORM.stage
    if _xla.backends_started():
        settings, platform = _read_platform(settings, stacklevel=3)
        stage = platform.stage

    if not _HOOK.listening:  # once per process (jax keeps its listeners)
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_raise_pending)
        atexit.register(_HOOK.wait_until_idle)
        _xla.add_to_cache_key(_HOOK.cache_key)
        _HOOK.listening = True
    with _HOOK.lock:
        changed = _HOOK.settings != settings
        _HOOK.settings = settings
        _HOOK.outcomes.clear()
        if not _HOOK.registered:
            try:
                jax_xla.register_hlo_module_transformation(
                    _HOOK.transform, name=PASS_NAME, stage=jax_xla.PipelineStage[stage])
            except (NotImplementedError, AttributeError) as err:  # jaxlib < 0.10.2
                _HOOK.settings = None
                raise HloShardError(f"install() needs jax's pass hook (jaxlib >= 0.10.2): "
                                    f"{err}") from None
            _HOOK.registered = stage
    if changed:
        _forget_executables()
    return Installation()


def _forget_executables() -> None:
    """jax reuses what it compiled for the same function and arguments: forget it, so the
    next call of a jitted step compiles (through the hook, or without it) again."""
    import jax

    jax.clear_caches()


def uninstall() -> None:
    """Stop sharding modules compiled from now on (a no-op when not installed); jax's
    caches are cleared again, so later calls compile without the pass."""
    with _HOOK.lock:
        _HOOK.settings = None
        _HOOK.outcomes.clear()
        if not _HOOK.registered:
            return
        _unregister(_HOOK.registered)
        _HOOK.registered = None
    _forget_executables()


def _unregister(stage: str) -> None:
    """Take the pass out of XLA's pipeline at ``stage``."""
    from jax.extend import xla as jax_xla

    jax_xla.clear_hlo_module_transformation(PASS_NAME, jax_xla.PipelineStage[stage])


def installed() -> bool:
    return _HOOK.settings is not None


def decisions(*, clear: bool = False) -> list[Decision]:
    """Per module compiled while installed that had an all-reduce and matched ``only``:
    what the hook did, the latest :data:`MAX_DECISIONS`, oldest first (``clear``: forget
    them)."""
    with _HOOK.lock:
        out = list(_HOOK.decisions)
        if clear:
            _HOOK.decisions.clear()
    return out


__all__ = ["MAX_DECISIONS", "MAX_REMEMBERED", "PASS_NAME", "Decision",
           "HookSeconds", "Installation", "PlatformWarning", "decisions", "install",
           "installed", "uninstall"]
