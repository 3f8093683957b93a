"""Random data-parallel training steps as HLO text, for differential fuzzing of the pass.

A case is a :class:`StepSpec` (plain data, JSON-serialisable, shrinkable) drawn by
:func:`random_step` from a seed, and rendered to text by :func:`render`. The step is
small but complete: per-device batch data → a ``dot`` and a ``reduce`` make every
device's gradients different → gradient all-reduce (tuple or per tensor, over a random
replica group in one of XLA's three group forms) → a random optimizer update (SGD,
momentum, Adam, RMSProp, Lion, Adafactor-like factored statistics; clipping by value
and by global norm, LAMB trust ratios, is-finite guards and skipped steps, weight decay,
reshape/transpose views, random elementwise mutations, mixed precision) → new weights
and optimizer state, optionally inside a training ``while`` loop, or with the gradients
of several microbatches all-reduced and summed in a ``while`` loop before the update
(gradient accumulation), in SPMD per-device or replica form.

Every update is written to stay finite and well conditioned (denominators bounded
away from zero, reductions accumulated in f32), so the only differences a correct
rewrite may introduce are the rounding of a reduction summed in another order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import dataclasses
import json
import math
import random
from dataclasses import dataclass, field

from hlo_shard.fuzz.emit import Emitter, Reducers, Sh, Val
from hlo_shard.ir import Alias, InputOutputAlias
from hlo_shard.printer import format_value

DEVICE_COUNTS = (2, 3, 4, 8)
FLOAT_TYPES = ("f32", "bf16", "f16")
OPTIMIZERS = ("sgd", "momentum", "adam", "rmsprop", "lion", "adafactor")
#: Optimizer → its full-shape state tensors (Adafactor's factored ones are separate).
FULL_STATE = {"sgd": (), "momentum": ("m",), "adam": ("m", "v"), "rmsprop": ("v",),
              "lion": ("m",), "adafactor": ()}
MUTATIONS = ("tanh", "axpy", "maximum", "minimum", "select", "clamp", "absmul", "negate",
             "divide", "expdecay", "roundtrip", "softabs", "isfinite")
#: 16-bit weights. Whatever a correct rewrite sums in another order (a clipping norm, a
#: LAMB ratio, Adafactor's mean) may round a 16-bit value one step the other way: within
#: its tolerance, but verify lets each module carry its own state, so at step 2 that
#: step is input (reported). Two rules keep such a step from growing past a tolerance:
#: the gradient of a 16-bit weight does not read the weight (else an f32 optimizer state
#: computed from it would differ beyond f32's tolerance), and its learning rate is scaled
#: down so that a rounding step of the update stays below the weight's own tolerance
#: where ``w - lr·u`` cancels. And its gradient is computed exactly (see
#: :meth:`_StepBody._gradient`).
LOW_PRECISION = ("bf16", "f16")
LOW_PRECISION_LR_SCALE = 0.1
_DIM_POOL = (1, 2, 3, 4, 5, 7, 8, 11, 13, 16, 17, 31, 32, 61, 64, 97, 128, 257)

@dataclass(frozen=True)
class Size:
    """How big the drawn cases are: ``FULL`` for ``make fuzz``, ``SMALL`` for the subset
    in ``make test`` (compile time grows with the number of tensors and ops)."""

    tensor_counts: tuple[int, ...]
    max_elements: int


FULL = Size((1, 1, 2, 2, 3, 3, 4, 6), 4096)
SMALL = Size((1, 1, 2, 2, 3), 512)


@dataclass
class Mutation:
    """One extra elementwise step on the update ``u``: ``op`` with ``operand`` (``w``,
    ``g`` or ``u0``, the update before mutations) and a constant ``k``."""

    op: str
    operand: str = "g"
    k: float = 0.5
    direction: str = "GT"


@dataclass
class TensorSpec:
    dims: list[int]
    dtype: str
    #: Element type of the update math and the optimizer state (f32: mixed precision).
    compute: str
    optimizer: str = "sgd"
    #: Non-default minor-to-major layout of the weight and its full-shape state.
    layout: list[int] | None = None
    lamb: bool = False
    clip_value: float | None = None
    sanitize: bool = False
    weight_decay: float = 0.0
    nesterov: bool = False
    #: The update computed in another view: ["reshape", dims] or ["transpose", perm].
    view: list | None = None
    mutations: list[Mutation] = field(default_factory=list)
    #: Scale the update by 1/(1+max|g|) ("maximum") or 1/(1+|min g|) ("minimum"): a
    #: max/min reduction, exact in any order.
    extremum: str | None = None
    #: The new weight is used after the update (a dot producing an extra output).
    post_use: bool = False

    @property
    def shape(self) -> Sh:
        return Sh(self.dtype, tuple(self.dims), tuple(self.layout) if self.layout else None)

    def state_shapes(self) -> list[tuple[str, Sh]]:
        """(name, shape) of the optimizer state tensors, in parameter order."""
        full = Sh(self.compute, tuple(self.dims), self.shape.layout)
        states = [(name, full) for name in FULL_STATE[self.optimizer]]
        if self.optimizer == "adafactor":
            dims = tuple(self.dims)
            states += [("r", Sh(self.compute, dims[:-1])),
                       ("c", Sh(self.compute, dims[:-2] + dims[-1:]))]
        return states


@dataclass
class StepSpec:
    seed: int
    devices: int
    form: str  # "spmd" | "replica"
    #: replica_groups text of the gradient all-reduces, and the size of each group.
    groups: str
    group_size: int
    tensors: list[TensorSpec]
    tuple_all_reduce: bool = False
    mean: bool = False
    global_clip: float | None = None
    skip_nonfinite: bool = False
    lr_param: bool = False
    step_counter: bool = True
    lr_schedule: bool = False
    bias_correction: bool = False
    #: Trip count of a training ``while`` loop around the step (0: no loop).
    loop_trips: int = 0
    shared_channel_ids: bool = False
    alias: bool = False
    replication_attr: bool = False
    batch: list[int] = field(default_factory=lambda: [2, 4])
    batch_position: int = -1
    device_noise: bool = False
    loss_output: bool = False
    norm_output: bool = False
    metric_all_reduce: bool = False
    #: Microbatches whose gradients a ``while`` loop all-reduces and sums into f32
    #: accumulators before the update (0: none; the gradient accumulation the
    #: accumulation motion moves). With ``tuple_all_reduce`` the loop's all-reduce also
    #: carries each microbatch's loss scale, kept as a maximum: an element that stays.
    microbatches: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> StepSpec:
        data = dict(data)
        tensors = []
        for t in data.pop("tensors"):
            t = dict(t)
            t["mutations"] = [Mutation(**m) for m in t.get("mutations", [])]
            tensors.append(TensorSpec(**t))
        return cls(tensors=tensors, **data)

    def describe(self) -> str:
        tensors = ", ".join(f"{t.dtype}[{','.join(map(str, t.dims))}]/{t.optimizer}"
                            for t in self.tensors)
        parts = [f"N={self.devices}", self.form, f"groups={self.groups}",
                 f"{len(self.tensors)} tensor(s): {tensors}"]
        flags = [name for name in ("tuple_all_reduce", "mean", "skip_nonfinite", "lr_param",
                                   "lr_schedule", "bias_correction", "shared_channel_ids",
                                   "alias", "loss_output", "norm_output", "metric_all_reduce")
                 if getattr(self, name)]
        if self.global_clip:
            flags.append("global_clip")
        if self.loop_trips:
            flags.append(f"while×{self.loop_trips}")
        if self.microbatches:
            flags.append(f"microbatches×{self.microbatches}")
        return "; ".join(parts + ([" ".join(flags)] if flags else []))


# ---------------------------------------------------------------------- random specs


def random_step(seed: int, size: Size = FULL) -> StepSpec:
    """The case of ``seed``: the same seed and size always give the same spec (and text)."""
    rng = random.Random(seed)
    n = rng.choice(DEVICE_COUNTS)
    form = rng.choice(("spmd", "replica"))
    groups, group_size = random_groups(rng, n, form)
    tensors = [random_tensor(rng, size.max_elements)
               for _ in range(rng.choice(size.tensor_counts))]
    loop = rng.random() < 0.2
    spec = StepSpec(
        seed=seed, devices=n, form=form, groups=groups, group_size=group_size,
        tensors=tensors,
        tuple_all_reduce=rng.random() < 0.4,
        mean=rng.random() < 0.5,
        global_clip=rng.choice((0.05, 0.5, 5.0)) if rng.random() < 0.3 else None,
        skip_nonfinite=rng.random() < 0.2,
        lr_param=rng.random() < 0.3,
        step_counter=rng.random() < 0.8,
        lr_schedule=rng.random() < 0.3,
        bias_correction=rng.random() < 0.3,
        loop_trips=rng.choice((1, 2, 3)) if loop else 0,
        shared_channel_ids=form == "spmd" and rng.random() < 0.3,
        alias=rng.random() < 0.3,
        replication_attr=form == "replica" and rng.random() < 0.5,
        batch=[rng.choice((1, 2, 3, 4)), rng.choice((1, 3, 4, 8))],
        device_noise=rng.random() < 0.3,
        loss_output=not loop and rng.random() < 0.2,
        norm_output=not loop and rng.random() < 0.2,
        metric_all_reduce=not loop and rng.random() < 0.15,
    )
    params = sum(1 + len(t.state_shapes()) for t in tensors) + spec.step_counter + spec.lr_param
    spec.batch_position = rng.randint(0, params)
    # (drawn last: every earlier draw, and so every older seed's spec, stays as it was)
    spec.microbatches = rng.choice((2, 3, 4)) if not loop and rng.random() < 0.25 else 0
    return normalized(spec)


def random_groups(rng: random.Random, n: int, form: str) -> tuple[str, int]:
    """replica_groups text (explicit, iota or mesh form) and the group size."""
    layouts = [("all", n)]
    if n % 2 == 0 and n >= 4:
        layouts += [("pairs", 2), ("halves", n // 2), ("strided", n // 2),
                    ("strided_pairs", 2)]
    kind, size = rng.choice(layouts)
    half = n // 2
    explicit = {
        "all": [list(range(n))],
        "pairs": [[i, i + 1] for i in range(0, n, 2)],
        "halves": [list(range(0, half)), list(range(half, n))],
        "strided": [list(range(0, n, 2)), list(range(1, n, 2))],
        "strided_pairs": [[i, i + half] for i in range(half)],
    }[kind]
    iota = {
        "all": f"[1,{n}]<=[{n}]",
        "pairs": f"[{half},2]<=[{n}]",
        "halves": f"[2,{half}]<=[{n}]",
        "strided": f"[2,{half}]<=[{half},2]T(1,0)",
        "strided_pairs": f"[{half},2]<=[2,{half}]T(1,0)",
    }[kind]
    mesh = {
        "all": f"mesh['x'={n}] {{'x'}}",
        "pairs": f"mesh['x'={half},'y'=2] {{'y'}}",
        "halves": f"mesh['x'=2,'y'={half}] {{'y'}}",
        "strided": f"mesh['x'={half},'y'=2] {{'x'}}",
        "strided_pairs": f"mesh['x'=2,'y'={half}] {{'x'}}",
    }[kind]
    texts = ["{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in explicit) + "}", iota,
             mesh]
    if kind == "all" and form == "replica":
        texts.append("{}")
    return rng.choice(texts), size


def random_dims(rng: random.Random, max_elements: int) -> list[int]:
    rank = rng.choices((0, 1, 2, 3), weights=(12, 35, 38, 15))[0]
    while True:
        dims = [rng.choice(_DIM_POOL) for _ in range(rank)]
        if math.prod(dims) <= max_elements:
            return dims


def random_tensor(rng: random.Random, max_elements: int) -> TensorSpec:
    dims = random_dims(rng, max_elements)
    dtype = rng.choices(FLOAT_TYPES, weights=(60, 25, 15))[0]
    compute = dtype if dtype == "f32" or rng.random() < 0.5 else "f32"
    choices = [o for o in OPTIMIZERS if o != "adafactor" or len(dims) >= 2]
    tensor = TensorSpec(
        dims=dims, dtype=dtype, compute=compute, optimizer=rng.choice(choices),
        layout=_random_layout(rng, len(dims)) if rng.random() < 0.3 else None,
        lamb=rng.random() < 0.25,
        clip_value=rng.choice((0.01, 0.1, 1.0)) if rng.random() < 0.2 else None,
        sanitize=rng.random() < 0.2,
        weight_decay=rng.choice((0.0, 0.01, 0.1)),
        nesterov=rng.random() < 0.3,
        view=_random_view(rng, dims) if rng.random() < 0.3 else None,
        mutations=[_random_mutation(rng) for _ in range(rng.choice((0, 0, 1, 2, 3)))],
        extremum=rng.choice(("maximum", "minimum")) if rng.random() < 0.25 else None,
        post_use=rng.random() < 0.1,
    )
    return tensor


def _random_layout(rng: random.Random, rank: int) -> list[int] | None:
    if rank < 2:
        return None
    order = list(range(rank))
    rng.shuffle(order)
    return order


def _random_view(rng: random.Random, dims: list[int]) -> list | None:
    if len(dims) >= 2 and rng.random() < 0.5:
        perm = list(range(len(dims)))
        while perm == sorted(perm):
            rng.shuffle(perm)
        return ["transpose", perm]
    total = math.prod(dims)
    factors = [d for d in range(1, total + 1) if total % d == 0]
    first = rng.choice(factors)
    view = [total] if rng.random() < 0.4 else [first, total // first]
    return ["reshape", view] if view != dims else None


def _random_mutation(rng: random.Random) -> Mutation:
    return Mutation(op=rng.choice(MUTATIONS), operand=rng.choice(("w", "g", "u0")),
                    k=rng.choice((0.01, 0.1, 0.5, 2.0)),
                    direction=rng.choice(("GT", "LT", "GE", "LE")))


def normalized(spec: StepSpec) -> StepSpec:
    """Drop combinations the renderer does not support (after random draws or shrinking)."""
    if spec.loop_trips:
        spec.loss_output = spec.norm_output = spec.metric_all_reduce = False
        spec.microbatches = 0
        for tensor in spec.tensors:
            tensor.post_use = False
    if spec.bias_correction or spec.lr_schedule:
        spec.step_counter = True
    if spec.lr_param and (spec.loss_output or spec.norm_output or spec.metric_all_reduce
                          or any(t.post_use for t in spec.tensors)):
        # Without an alias verify feeds each replicated parameter the next output of its
        # shape: lr would receive a scalar output (a per-device loss) at step 2.
        spec.alias = True
    for tensor in spec.tensors:
        if tensor.optimizer == "adafactor" and len(tensor.dims) < 2:
            tensor.optimizer = "rmsprop"
        if tensor.compute != "bf16" and (spec.global_clip or tensor.lamb
                                         or tensor.optimizer == "adafactor"):
            # A correct rewrite may sum the clipping norm, the LAMB ratio or Adafactor's
            # mean in another order: an ulp in the update, which a round trip through
            # bf16 turns into a bf16 step, beyond the weight's tolerance (seed 1429).
            tensor.mutations = [m for m in tensor.mutations if m.op != "roundtrip"]
        if tensor.layout is not None and len(tensor.layout) != len(tensor.dims):
            tensor.layout = None
    params = sum(1 + len(t.state_shapes()) for t in spec.tensors) + spec.step_counter \
        + spec.lr_param
    spec.batch_position = min(max(spec.batch_position, 0), params)
    return spec


# --------------------------------------------------------------------------- render


@dataclass
class _Param:
    key: str
    shape: Sh
    per_device: bool = False
    #: Key of the output that is this parameter's next value (None: not fed back).
    output: str | None = None


def _parameters(spec: StepSpec) -> list[_Param]:
    params = []
    for i, tensor in enumerate(spec.tensors):
        params.append(_Param(f"w{i}", tensor.shape, output=f"w{i}"))
        params += [_Param(f"{name}{i}", shape, output=f"{name}{i}")
                   for name, shape in tensor.state_shapes()]
    if spec.step_counter:
        params.append(_Param("step", Sh("s32"), output="step"))
    if spec.lr_param:
        params.append(_Param("lr", Sh("f32")))
    params.insert(spec.batch_position, _Param("x", Sh("f32", tuple(spec.batch)), per_device=True))
    return params


def render(spec: StepSpec) -> str:
    """The module text of ``spec``."""
    spec = normalized(spec)
    reducers = Reducers()
    params = _parameters(spec)
    n = spec.devices
    size_attr = f"num_partitions={n}" if spec.form == "spmd" else f"replica_count={n}"
    entry = Emitter(reducers)
    values = {}
    for number, param in enumerate(params):
        values[param.key] = entry.param(param.key if param.key != "x" else "batch",
                                        param.shape, number, _param_attrs(spec, param))
    computations: list[str] = []
    if spec.loop_trips:
        outputs = _render_loop(spec, params, values, entry, reducers, computations)
    else:
        outputs = _StepBody(spec, entry, computations).run(values)
    order = [p.output for p in params if p.output] + [k for k in outputs if k.startswith("extra")]
    root = entry.emit("result", "(" + ", ".join(outputs[k].shape.text() for k in order) + ")",
                      "tuple", [outputs[k] for k in order])
    header = f"HloModule fuzz_{spec.seed}"
    if spec.alias:
        aliases = tuple(Alias((order.index(p.output),), number)
                        for number, p in enumerate(params) if p.output)
        if aliases:
            header += f", input_output_alias={format_value(InputOutputAlias(aliases))}"
    header += f", {size_attr}"
    blocks = [header, reducers.text(), *computations,
              "ENTRY %main (" + ", ".join(f"{v.name}: {v.shape.text()}" for v in
                                          (values[p.key] for p in params))
              + f") -> {_tuple_text(outputs, order)} {{\n"
              + entry.body(root) + "\n}"]
    return "\n\n".join(b for b in blocks if b) + "\n"


def _tuple_text(outputs: dict[str, Val], order: list[str]) -> str:
    return "(" + ", ".join(outputs[k].shape.text() for k in order) + ")"


def _param_attrs(spec: StepSpec, param: _Param) -> str:
    if spec.form == "spmd":
        if param.per_device:
            tiles = ",".join([str(spec.devices)] + ["1"] * (param.shape.rank - 1))
            return f", sharding={{devices=[{tiles}]<=[{spec.devices}]}}"
        return ", sharding={replicated}"
    if spec.replication_attr:
        return f", parameter_replication={{{'false' if param.per_device else 'true'}}}"
    return ""


def _render_loop(spec: StepSpec, params: list[_Param], values: dict[str, Val], entry: Emitter,
                 reducers: Reducers, computations: list[str]) -> dict[str, Val]:
    """The step as the body of a ``while`` whose carry holds every parameter and a
    trip counter; the entry returns the final carry's fed-back values."""
    carry_shapes = [p.shape for p in params] + [Sh("s32")]
    carry_text = "(" + ", ".join(s.text() for s in carry_shapes) + ")"
    counter = len(params)

    cond = Emitter(reducers)
    state = cond.param("carry", carry_text, 0)
    i = cond.emit("i", Sh("s32"), "get-tuple-element", [state], f", index={counter}")
    limit = cond.constant(spec.loop_trips, "s32")
    done = cond.compare(i, limit, "LT")
    computations.append(f"%loop_cond (carry: {carry_text}) -> pred[] {{\n{cond.body(done)}\n}}")

    body = Emitter(reducers)
    state = body.param("carry", carry_text, 0)
    inner = {p.key: body.emit(p.key, p.shape, "get-tuple-element", [state], f", index={k}")
             for k, p in enumerate(params)}
    inner["iter"] = body.emit("i", Sh("s32"), "get-tuple-element", [state],
                              f", index={counter}")
    new = _StepBody(spec, body).run(inner)
    next_i = body.binary("add", inner["iter"], body.constant(1, "s32"))
    slots = [new[p.output] if p.output else inner[p.key] for p in params] + [next_i]
    out = body.emit("next", carry_text, "tuple", slots)
    computations.append(f"%loop_body (carry: {carry_text}) -> {carry_text} {{\n"
                        f"{body.body(out)}\n}}")

    zero = entry.constant(0, "s32")
    init = entry.emit("init", carry_text, "tuple", [values[p.key] for p in params] + [zero])
    loop = entry.emit("loop", carry_text, "while", [init],
                      ", condition=%loop_cond, body=%loop_body")
    return {p.output: entry.emit(f"final_{p.key}", p.shape, "get-tuple-element", [loop],
                                 f", index={k}")
            for k, p in enumerate(params) if p.output}


class _StepBody:
    """Forward/backward stand-in, gradient all-reduce and optimizer update, emitted
    into one computation (the entry or a loop body)."""

    def __init__(self, spec: StepSpec, em: Emitter,
                 computations: list[str] | None = None) -> None:
        self.spec = spec
        self.em = em
        self.channel = 0
        #: Where a microbatch loop's computations go (None: inside a training loop).
        self.computations = computations

    # Collectives ---------------------------------------------------------------
    def _collective_attrs(self, groups: str, dtype: str) -> str:
        spec = self.spec
        attrs = ""
        if spec.form == "spmd":
            self.channel += 1
            attrs += f", channel_id={1 if spec.shared_channel_ids else self.channel}"
        attrs += f", replica_groups={groups}"
        if spec.form == "spmd":
            attrs += ", use_global_device_ids=true"
        return attrs + f", to_apply=%{self.em.reducers.get('add', dtype)}"

    def _all_reduce(self, grads: list[Val]) -> list[Val]:
        em, spec = self.em, self.spec
        if not spec.tuple_all_reduce:
            return [em.emit("all_reduce", g.shape, "all-reduce", [g],
                            self._collective_attrs(spec.groups, g.shape.dtype)) for g in grads]
        out: dict[int, Val] = {}
        for dtype in dict.fromkeys(g.shape.dtype for g in grads):
            members = [i for i, g in enumerate(grads) if g.shape.dtype == dtype]
            shape = "(" + ", ".join(grads[i].shape.text() for i in members) + ")"
            ar = em.emit("all_reduce", shape, "all-reduce", [grads[i] for i in members],
                         self._collective_attrs(spec.groups, dtype))
            for index, i in enumerate(members):
                out[i] = em.emit("grad", grads[i].shape, "get-tuple-element", [ar],
                                 f", index={index}")
        return [out[i] for i in range(len(grads))]

    def _device_id(self) -> Val:
        opcode = "partition-id" if self.spec.form == "spmd" else "replica-id"
        return self.em.emit("device", Sh("u32"), opcode)

    # The step --------------------------------------------------------------------
    def run(self, ins: dict[str, Val]) -> dict[str, Val]:
        em, spec = self.em, self.spec
        x = ins["x"]
        batch, width = spec.batch
        sq = em.emit("dot", Sh("f32", (batch,)), "dot", [x, x],
                     ", lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={0}, "
                     "rhs_contracting_dims={1}")
        scale = em.binary("multiply", em.reduce(sq, "add"),
                          em.constant(1.0 / (batch * width * 0.01)))
        if spec.device_noise:
            noise = em.binary("multiply", em.convert(self._device_id(), "f32"),
                              em.constant(0.125))
            scale = em.binary("add", scale, noise)
        if "iter" in ins:
            step_factor = em.binary("add", em.constant(1.0), em.binary(
                "multiply", em.convert(ins["iter"], "f32"), em.constant(0.25)))
            scale = em.binary("multiply", scale, step_factor)
        if spec.microbatches and self.computations is not None:
            reduced = self._accumulated([ins[f"w{i}"] for i in range(len(spec.tensors))],
                                        scale)
        else:
            grads = [self._gradient(ins[f"w{i}"], scale, i) for i in range(len(spec.tensors))]
            reduced = self._all_reduce(grads)
        processed = [self._prepare(t, g) for t, g in zip(spec.tensors, reduced)]
        norm = self._global_norm(processed) if spec.global_clip or spec.norm_output else None
        clip = None
        if norm is not None and spec.global_clip:
            bound = em.binary("divide", em.constant(spec.global_clip),
                              em.binary("add", norm, em.constant(1e-6)))
            clip = em.binary("minimum", bound, em.constant(1.0))
        finite = self._all_finite(processed) if spec.skip_nonfinite else None
        lr = ins["lr"] if spec.lr_param else em.constant(0.05)
        step = ins.get("step")
        if spec.lr_schedule:  # normalized() gives such a step its counter
            lr = em.binary("multiply", lr, em.unary("rsqrt", em.binary(
                "add", em.convert(ins["step"], "f32"), em.constant(1.0))))
        out: dict[str, Val] = {}
        for i, (tensor, g) in enumerate(zip(spec.tensors, processed)):
            states = {name: ins[f"{name}{i}"] for name, _ in tensor.state_shapes()}
            new_w, new_states = _Update(self, tensor, step).run(ins[f"w{i}"], states, g, lr,
                                                                clip, finite)
            out[f"w{i}"] = new_w
            out.update({f"{name}{i}": v for name, v in new_states.items()})
            if tensor.post_use:
                out[f"extra_use{i}"] = self._post_use(new_w)
        if step is not None:
            out["step"] = em.binary("add", step, em.constant(1, "s32"))
        if norm is not None and spec.norm_output:
            out["extra_norm"] = norm
        if spec.loss_output:
            out["extra_loss"] = scale
        if spec.metric_all_reduce:
            every = "{" + "{" + ",".join(map(str, range(spec.devices))) + "}}"
            out["extra_metric"] = em.emit("metric", Sh("f32"), "all-reduce", [scale],
                                          self._collective_attrs(every, "f32"))
        return out

    def _accumulated(self, weights: list[Val], scale: Val) -> list[Val]:
        """The gradients summed over ``spec.microbatches`` in a ``while``: each
        microbatch's (its scale grown with the iteration) converted to f32, all-reduced
        and added into a zero-started f32 accumulator; the sums after the loop."""
        spec, entry = self.spec, self.em
        assert self.computations is not None
        count = len(weights)
        sums = [w.shape.of("f32") for w in weights]
        losses = [Sh("f32")] if spec.tuple_all_reduce else []
        shapes = [Sh("s32"), Sh("f32"), *(w.shape for w in weights), *sums, *losses]
        carry = "(" + ", ".join(shape.text() for shape in shapes) + ")"

        cond = Emitter(entry.reducers)
        state = cond.param("carry", carry, 0)
        i = cond.emit("i", Sh("s32"), "get-tuple-element", [state], ", index=0")
        done = cond.compare(i, cond.constant(spec.microbatches, "s32"), "LT")
        self.computations.append(f"%microbatch_cond (carry: {carry}) -> pred[] {{\n"
                                 f"{cond.body(done)}\n}}")

        body = Emitter(entry.reducers)
        state = body.param("carry", carry, 0)
        slots = [body.emit("slot", shape, "get-tuple-element", [state], f", index={k}")
                 for k, shape in enumerate(shapes)]
        i, base = slots[0], slots[1]
        self.em = body
        try:
            grown = body.binary("multiply", base, body.binary(
                "add", body.constant(1.0), body.binary(
                    "multiply", body.convert(i, "f32"), body.constant(0.5))))
            grads = [body.convert(self._gradient(w, grown, k), "f32")
                     for k, w in enumerate(slots[2:2 + count])]
            reduced = self._all_reduce(grads + ([grown] if losses else []))
        finally:
            self.em = entry
        added = [body.binary("add", total, value)
                 for total, value in zip(slots[2 + count:2 + 2 * count], reduced)]
        kept = [body.binary("maximum", slots[-1], reduced[-1])] if losses else []
        next_i = body.binary("add", i, body.constant(1, "s32"))
        out = body.emit("next", carry, "tuple",
                        [next_i, base, *slots[2:2 + count], *added, *kept])
        self.computations.append(f"%microbatch_body (carry: {carry}) -> {carry} {{\n"
                                 f"{body.body(out)}\n}}")

        starts = [entry.broadcast(entry.constant(0.0), shape) for shape in sums]
        init = entry.emit("microbatch_init", carry, "tuple",
                          [entry.constant(0, "s32"), scale, *weights, *starts,
                           *([entry.constant(0.0)] if losses else [])])
        loop = entry.emit("microbatches", carry, "while", [init],
                          ", condition=%microbatch_cond, body=%microbatch_body")
        return [entry.emit("accumulated", shape, "get-tuple-element", [loop],
                           f", index={2 + count + k}") for k, shape in enumerate(sums)]

    def _gradient(self, w: Val, scale: Val, index: int) -> Val:
        """A per-device gradient of ``w``'s shape: ``s·(base + ramp)`` with ``base`` the
        weight itself when it is f32, else a fixed pattern (see :data:`LOW_PRECISION`).

        A 16-bit gradient is exact up to its final roundings: a pattern of small binary
        fractions, times the scale in 16 bits. Computed in f32 (a sine, a multiply-add),
        the two modules' differently fused code may move a value by an f32 ulp, which
        rounds the 16-bit gradient one step the other way: f32 state computed from it then
        differs beyond f32's tolerance (found by the fuzzer, seed 66)."""
        em = self.em
        if w.shape.dtype not in LOW_PRECISION:
            g = w
            if w.shape.rank:
                g = em.binary("add", g, em.scale(em.iota(w.shape, w.shape.rank - 1), 0.01))
            return em.binary("multiply", g, em.broadcast(scale, w.shape))
        shape = w.shape.of("f32")
        flat = em.iota(Sh("f32", (w.shape.elements,)), 0)
        wave = em.binary("remainder", em.scale(em.offset(flat, float(index)), 7.0),
                         em.broadcast(em.constant(13.0), flat.shape))
        base = em.scale(em.emit("reshape", shape, "reshape", [em.offset(wave, -6.0)]), 1 / 64)
        if w.shape.rank:
            base = em.binary("add", base, em.scale(em.iota(shape, w.shape.rank - 1), 1 / 128))
        return em.binary("multiply", em.convert(base, w.shape.dtype),
                         em.broadcast(em.convert(scale, w.shape.dtype), w.shape))

    def _prepare(self, tensor: TensorSpec, g: Val) -> Val:
        em = self.em
        g = em.convert(g, tensor.compute)
        if self.spec.mean:
            g = em.scale(g, 1.0 / self.spec.group_size)
        return g

    def _sum_of_squares(self, value: Val) -> Val:
        wide = self.em.convert(value, "f32")
        return self.em.reduce(self.em.binary("multiply", wide, wide), "add")

    def _global_norm(self, grads: list[Val]) -> Val:
        em = self.em
        total = self._sum_of_squares(grads[0])
        for g in grads[1:]:
            total = em.binary("add", total, self._sum_of_squares(g))
        return em.unary("sqrt", total)

    def _all_finite(self, grads: list[Val]) -> Val:
        em = self.em
        result = em.reduce(em.is_finite(grads[0]), "and")
        for g in grads[1:]:
            result = em.binary("and", result, em.reduce(em.is_finite(g), "and"))
        return result

    def _post_use(self, w: Val) -> Val:
        em = self.em
        flat = em.reshape(em.convert(w, "f32"), (w.shape.elements,)) if w.shape.rank != 1 \
            else em.convert(w, "f32")
        return em.emit("use", Sh("f32"), "dot", [flat, flat],
                       ", lhs_contracting_dims={0}, rhs_contracting_dims={0}")


class _Update:
    """The optimizer update of one tensor."""

    def __init__(self, body: _StepBody, tensor: TensorSpec, step: Val | None) -> None:
        self.em = body.em
        self.spec = body.spec
        self.tensor = tensor
        self.step = step

    def full(self, value: float, like: Val) -> Val:
        return self.em.broadcast(self.em.constant(value, like.shape.dtype), like.shape)

    def run(self, w: Val, states: dict[str, Val], g: Val, lr: Val, clip: Val | None,
            finite: Val | None) -> tuple[Val, dict[str, Val]]:
        em, t = self.em, self.tensor
        c = t.compute
        if t.sanitize:
            g = em.select(em.is_finite(g), g, self.full(0.0, g))
        if t.clip_value:
            g = em.clamp(self.full(-t.clip_value, g), g, self.full(t.clip_value, g))
        if clip is not None:
            g = em.binary("multiply", g, em.broadcast(em.convert(clip, c), g.shape))
        wc = em.convert(w, c)
        factored = t.optimizer == "adafactor"
        view = t.view if not factored else None
        g_v, wc_v = self.to_view(g, view), self.to_view(wc, view)
        full_states = {k: self.to_view(v, view) for k, v in states.items() if k in ("m", "v")}
        u, new_states = self.core(g_v, full_states, states)
        u0 = u
        for mutation in t.mutations:
            u = self.mutate(u, mutation, {"w": wc_v, "g": g_v, "u0": u0})
        u = self.from_view(u, wc.shape, view)
        new_states = {k: self.from_view(v, states[k].shape, view) if k in ("m", "v") else v
                      for k, v in new_states.items()}
        if t.extremum:
            source = em.unary("abs", g) if t.extremum == "maximum" else g
            size = em.unary("abs", em.reduce(source, t.extremum))
            u = em.binary("multiply", u, em.broadcast(em.binary(
                "divide", em.constant(1.0, c), em.binary("add", size, em.constant(1.0, c))),
                u.shape))
        if t.lamb:
            u = em.binary("multiply", u, em.broadcast(self.trust_ratio(wc, u), u.shape))
        if t.weight_decay:
            u = em.binary("add", u, em.scale(wc, t.weight_decay))
        if t.dtype in LOW_PRECISION:
            lr = em.scale(lr, LOW_PRECISION_LR_SCALE)
        new_w = em.binary("subtract", wc, em.binary(
            "multiply", em.broadcast(em.convert(lr, c), u.shape), u))
        if finite is not None:
            keep = em.broadcast(finite, new_w.shape.of("pred"))
            new_w = em.select(keep, new_w, wc)
            new_states = {k: em.select(em.broadcast(finite, v.shape.of("pred")), v, states[k])
                          for k, v in new_states.items()}
        return em.convert(new_w, t.dtype), new_states

    # Views -------------------------------------------------------------------------
    def to_view(self, value: Val, view: list | None) -> Val:
        if view is None:
            return value
        kind, arg = view
        if kind == "transpose":
            return self.em.transpose(value, tuple(arg))
        return self.em.reshape(value, tuple(arg))

    def from_view(self, value: Val, shape: Sh, view: list | None) -> Val:
        if view is None:
            return value
        kind, arg = view
        if kind == "transpose":
            inverse = ",".join(str(arg.index(i)) for i in range(len(arg)))
            return self.em.emit("transpose", shape.of(value.shape.dtype), "transpose", [value],
                                f", dimensions={{{inverse}}}")
        return self.em.emit("reshape", shape.of(value.shape.dtype), "reshape", [value])

    # Optimizers ----------------------------------------------------------------------
    def core(self, g: Val, full: dict[str, Val], states: dict[str, Val]
             ) -> tuple[Val, dict[str, Val]]:
        em, t = self.em, self.tensor
        blend = self.blend
        if t.optimizer == "sgd":
            return g, {}
        if t.optimizer == "momentum":
            m = em.binary("add", em.scale(full["m"], 0.9), g)
            u = em.binary("add", g, em.scale(m, 0.9)) if t.nesterov else m
            return u, {"m": m}
        if t.optimizer == "adam":
            m = blend(full["m"], g, 0.9)
            v = blend(self.second_moment(full["v"]), em.binary("multiply", g, g), 0.999)
            m_hat, v_hat = m, v
            if self.spec.bias_correction:
                m_hat = em.binary("multiply", m, em.broadcast(self.correction(0.9), m.shape))
                v_hat = em.binary("multiply", v, em.broadcast(self.correction(0.999), v.shape))
            denom = em.binary("add", em.unary("sqrt", v_hat), self.full(1e-3, v))
            return em.binary("divide", m_hat, denom), {"m": m, "v": v}
        if t.optimizer == "rmsprop":
            v = blend(self.second_moment(full["v"]), em.binary("multiply", g, g), 0.9)
            return em.binary("multiply", g, em.unary("rsqrt", em.binary(
                "add", v, self.full(1e-3, v)))), {"v": v}
        if t.optimizer == "lion":
            direction = blend(full["m"], g, 0.9)
            return em.unary("sign", direction), {"m": blend(full["m"], g, 0.99)}
        return self.adafactor(g, states)

    def second_moment(self, state: Val) -> Val:
        """``|state|``: a mean of squares is never negative, but verify's inputs may be
        (it cannot see through a while loop that the state feeds a square root), and a
        square root at the edge of NaN turns rounding into NaN-position differences."""
        return self.em.unary("abs", state)

    def blend(self, old: Val, new: Val, beta: float) -> Val:
        return self.em.binary("add", self.em.scale(old, beta), self.em.scale(new, 1 - beta))

    def correction(self, beta: float) -> Val:
        """``1 / (1 - beta^step)`` as a scalar of the compute type (step ≥ 1)."""
        em, step = self.em, self.step
        assert step is not None, "normalized() gives bias correction its step counter"
        power = em.binary("power", em.constant(beta), em.convert(step, "f32"))
        scale = em.binary("divide", em.constant(1.0), em.binary("subtract", em.constant(1.0),
                                                               power))
        return em.convert(scale, self.tensor.compute)

    def adafactor(self, g: Val, states: dict[str, Val]) -> tuple[Val, dict[str, Val]]:
        em = self.em
        rank = g.shape.rank
        g2 = em.binary("add", em.binary("multiply", g, g), self.full(1e-2, g))
        row = self.mean(g2, rank - 1)
        col = self.mean(g2, rank - 2)
        r = self.blend(self.second_moment(states["r"]), row, 0.9)
        c = self.blend(self.second_moment(states["c"]), col, 0.9)
        r_mean = self.mean(r, rank - 2)
        full = g.shape
        batch = tuple(range(rank - 2))
        v = em.binary("multiply", em.broadcast_dims(r, full, tuple(range(rank - 1))),
                      em.broadcast_dims(c, full, batch + (rank - 1,)))
        v = em.binary("divide", v, em.broadcast_dims(r_mean, full, batch) if batch else
                      em.broadcast(r_mean, full))
        u = em.binary("multiply", g, em.unary("rsqrt", em.binary("add", v, self.full(0.1, v))))
        return u, {"r": r, "c": c}

    def mean(self, value: Val, dim: int) -> Val:
        """The mean along ``dim``, accumulated in f32 (a 16-bit sum in another order
        would differ by more than the dtype's tolerance)."""
        em = self.em
        total = em.reduce(em.convert(value, "f32"), "add", (dim,))
        return em.convert(em.scale(total, 1.0 / value.shape.dims[dim]), value.shape.dtype)

    def trust_ratio(self, w: Val, u: Val) -> Val:
        """LAMB's ``‖w‖ / ‖u‖`` (1 where either norm is zero), in the compute type."""
        em = self.em
        wn = em.unary("sqrt", em.reduce(em.binary("multiply", *(em.convert(w, "f32"),) * 2),
                                        "add"))
        un = em.unary("sqrt", em.reduce(em.binary("multiply", *(em.convert(u, "f32"),) * 2),
                                        "add"))
        zero = em.constant(0.0)
        ok = em.binary("and", em.compare(wn, zero, "GT"), em.compare(un, zero, "GT"))
        ratio = em.select(ok, em.binary("divide", wn, em.binary("maximum", un,
                                                                em.constant(1e-6))),
                          em.constant(1.0))
        return em.convert(ratio, self.tensor.compute)

    def one_plus_abs(self, x: Val) -> Val:
        return self.em.binary("add", self.em.unary("abs", x), self.full(1.0, x))

    def mutate(self, u: Val, m: Mutation, operands: dict[str, Val]) -> Val:
        em = self.em
        x = operands[m.operand]
        rule = {
            "tanh": lambda: em.unary("tanh", u),
            "axpy": lambda: em.binary("add", u, em.scale(x, m.k)),
            "maximum": lambda: em.binary("maximum", u, self.full(-m.k, u)),
            "minimum": lambda: em.binary("minimum", u, self.full(m.k, u)),
            "select": lambda: em.select(em.compare(u, x, m.direction), u, em.scale(x, m.k)),
            "clamp": lambda: em.clamp(self.full(-m.k, u), u, self.full(m.k, u)),
            "absmul": lambda: em.binary("multiply", u, self.one_plus_abs(x)),
            "negate": lambda: em.unary("negate", u),
            "divide": lambda: em.binary("divide", u, self.one_plus_abs(x)),
            "expdecay": lambda: em.binary("multiply", u, em.unary(
                "exponential", em.unary("negate", em.unary("abs", x)))),
            "roundtrip": lambda: em.convert(em.convert(u, "bf16" if u.shape.dtype != "bf16"
                                                       else "f32"), u.shape.dtype),
            "softabs": lambda: em.unary("sqrt", em.binary("add", em.binary("multiply", u, u),
                                                          self.full(m.k, u))),
            "isfinite": lambda: em.select(em.is_finite(x), u, self.full(0.0, u)),
        }[m.op]
        return rule()


# ------------------------------------------------------------------------- shrinking


def reductions(spec: StepSpec) -> Iterator[StepSpec]:
    """Smaller variants of ``spec`` (one simplification each), most drastic first."""
    def variant(edit: Callable[..., object]) -> StepSpec:
        copy = StepSpec.from_json(json.loads(json.dumps(spec.to_json())))
        edit(copy)
        return normalized(copy)

    if len(spec.tensors) > 1:
        for i in range(len(spec.tensors)):
            yield variant(lambda s, i=i: s.tensors.pop(i))
    switches: tuple[tuple[str, object], ...] = (
                      ("loop_trips", 0), ("global_clip", None), ("skip_nonfinite", False),
                      ("tuple_all_reduce", False), ("loss_output", False),
                      ("norm_output", False), ("metric_all_reduce", False),
                      ("lr_schedule", False), ("bias_correction", False), ("lr_param", False),
                      ("alias", False), ("mean", False), ("device_noise", False),
                      ("shared_channel_ids", False), ("replication_attr", False))
    for name, off in switches:
        if getattr(spec, name) != off:
            yield variant(lambda s, name=name, off=off: setattr(s, name, off))
    if spec.step_counter and not (spec.lr_schedule or spec.bias_correction):
        yield variant(lambda s: setattr(s, "step_counter", False))
    for i, tensor in enumerate(spec.tensors):
        if tensor.optimizer != "sgd":
            yield variant(lambda s, i=i: setattr(s.tensors[i], "optimizer", "sgd"))
        for k in range(len(tensor.mutations)):
            yield variant(lambda s, i=i, k=k: s.tensors[i].mutations.pop(k))
        tensor_switches: tuple[tuple[str, object], ...] = (
            ("view", None), ("layout", None), ("lamb", False), ("clip_value", None),
            ("sanitize", False), ("weight_decay", 0.0), ("nesterov", False), ("extremum", None),
            ("post_use", False))
        for name, off in tensor_switches:
            if getattr(tensor, name) != off:
                yield variant(lambda s, i=i, name=name, off=off:
                              setattr(s.tensors[i], name, off))
        if tensor.compute != tensor.dtype:
            yield variant(lambda s, i=i: setattr(s.tensors[i], "compute", s.tensors[i].dtype))
        if tensor.dtype != "f32":
            yield variant(lambda s, i=i: _to_f32(s.tensors[i]))
        smaller = [d if d <= 4 else (d + 1) // 2 for d in tensor.dims]
        if smaller != tensor.dims:
            yield variant(lambda s, i=i, dims=smaller: _resize(s.tensors[i], dims))


def _to_f32(tensor: TensorSpec) -> None:
    tensor.dtype = tensor.compute = "f32"


def _resize(tensor: TensorSpec, dims: list[int]) -> None:
    tensor.dims = dims
    if tensor.view and tensor.view[0] == "reshape":
        tensor.view = ["reshape", [math.prod(dims)]]
