"""LLM-sized training steps (issue 23): a Llama-style decoder's per-device SPMD module.

    python scripts/llm_step.py OUT.hlo [--mesh data8|data2_fsdp4|data4_model2]
                               [--size default|large|scan] [--layers L] [--d-model D] ...

The model is a Llama-style decoder (RMSNorm, rotary attention, SwiGLU MLP, untied
embedding and head) written in plain jax after the structure of Meta's reference
``llama/model.py`` and MaxText's ``layers/llama2.py``: fp32 master weights cast to bf16
inside the loss (bf16 compute, fp32 cross-entropy), optax AdamW after global-norm
clipping (MaxText's defaults), one jitted step for 8 CPU virtual devices on one of three meshes:

* ``data8``: ``(data=8)``, weights replicated, the batch split: one gradient all-reduce
  per weight, the update replicated (what the pass shards);
* ``data2_fsdp4``: ``(data=2, fsdp=4)`` with MaxText-style FSDP annotations: matrices
  sharded over ``fsdp`` on their embed axis, cast to bf16 and all-gathered in bf16 before
  use (a sharding constraint on the cast, as MaxText's logical-axis rules get); norm
  scales replicated. The partitioner writes each matrix's gradient as an all-reduce and
  a ``dynamic-slice`` by partition id (its reduce-scatter form): already sharded;
* ``data4_model2``: ``(data=4, model=2)``, Megatron-style tensor-parallel weights
  (q/k/v/gate/up split on their output axis, o/down on their input axis), gradients
  all-reduced over the data groups.

The layers are unrolled unless ``--scan-layers 1`` (MaxText's ``scan_layers``: stacked
weights, one ``lax.scan``): module size grows with ``--layers`` while the
widths stay small, so dumping stays cheap on CPU. ``--size default`` gives a module of
about 1 MB, ``--size large`` about 4 MB (data8; the other meshes are of the same order),
``--size scan`` the default's 12 layers scanned. ``--experts E`` makes every MLP a
Mixtral-style mixture of E SwiGLU experts (top-2 routing, a load-balancing loss; the
experts' ``[E, d, f]`` weights FSDP-sharded on their embed axis like the dense ones):
``--size moe`` (12 layers, 1.4 MB) and ``moe-large`` (40 layers, 4.5 MB).

Importing this file does not import jax; ``main`` sets the device count before it does.
:func:`generate` runs the script in a child process (XLA reads the device count once).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

NUM_DEVICES = 8
REPO = Path(__file__).resolve().parent.parent
MESHES = {  # name -> axis sizes, in mesh order
    "data8": {"data": 8},
    # fsdp major: the weights' tile assignment is then the plain device order (with data
    # major the partitioner writes `device_ids=([2,4]T(1,0))` groups).
    "data2_fsdp4": {"fsdp": 4, "data": 2},
    "data4_model2": {"data": 4, "model": 2},
    # every device one FSDP shard: each gradient's slice is one block per device.
    "fsdp8": {"fsdp": 8},
}
#: The meshes whose matrices are FSDP-sharded (MaxText's "embed" axis over ``fsdp``).
FSDP_MESHES = ("data2_fsdp4", "fsdp8")


@dataclass(frozen=True)
class LlamaShape:
    """Sizes of the decoder; widths are small on purpose (layers give the module size)."""

    layers: int = 12
    d_model: int = 64
    heads: int = 4
    d_ff: int = 128
    vocab: int = 256
    seq: int = 16
    batch_per_device: int = 1
    #: MaxText's ``scan_layers``: the layers' weights stacked on a leading axis and the
    #: decoder a ``lax.scan`` over them (rematerialised), so the backward pass is a loop
    #: writing each layer's gradient into the stacked one.
    scan_layers: bool = False
    #: Mixtral's sparse MLP when above 0: this many SwiGLU experts per layer, each token
    #: routed to its ``top_k`` best by a linear router (softmax over the chosen logits)
    #: with Switch's load-balancing loss, computed densely as MaxText's
    #: ``sparse_matmul=False`` does (every expert on every token, weighted by the
    #: router's zeros and choices); 0: the dense SwiGLU MLP.
    experts: int = 0
    top_k: int = 2


SIZES = {"default": LlamaShape(layers=12), "large": LlamaShape(layers=48),
         "scan": LlamaShape(layers=12, scan_layers=True),
         "moe": LlamaShape(layers=12, experts=4),
         "moe-large": LlamaShape(layers=40, experts=4)}

#: Weight of the load-balancing loss (MaxText's ``load_balance_loss_weight``).
LOAD_BALANCE_WEIGHT = 0.01


# ----------------------------------------------------------------------------- the model

def _rms_norm(x, scale, eps=1e-6):
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def _rotary(x, positions):
    """Rotary position embedding (Su et al., RoFormer), half-split form as in MaxText."""
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]       # [S, half]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)
    return rotated.astype(x.dtype)


def _layer_shapes(t: LlamaShape) -> dict[str, tuple[int, ...]]:
    """One decoder layer's weights, by their name in the layer (a MoE layer's MLP
    weights have a leading expert axis, and it has a router)."""
    experts = (t.experts,) if t.experts else ()
    return {"attn_norm": (t.d_model,), "wq": (t.d_model, t.d_model),
            "wk": (t.d_model, t.d_model), "wv": (t.d_model, t.d_model),
            "wo": (t.d_model, t.d_model), "mlp_norm": (t.d_model,),
            **({"router": (t.d_model, t.experts)} if t.experts else {}),
            "w_gate": (*experts, t.d_model, t.d_ff), "w_up": (*experts, t.d_model, t.d_ff),
            "w_down": (*experts, t.d_ff, t.d_model)}


#: The prefix of the stacked layer weights (``scan_layers``): ``layers_wq`` is
#: ``[layers, d_model, d_model]``.
STACKED = "layers_"


def param_shapes(t: LlamaShape) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"embed": (t.vocab, t.d_model)}
    if t.scan_layers:
        shapes |= {STACKED + name: (t.layers, *shape)
                   for name, shape in _layer_shapes(t).items()}
    else:
        for i in range(t.layers):
            shapes |= {f"layer{i}_{name}": shape for name, shape in _layer_shapes(t).items()}
    return shapes | {"final_norm": (t.d_model,), "head": (t.d_model, t.vocab)}


def _loss(t: LlamaShape, gathered):
    """Next-token cross-entropy; ``gathered(name, w16)`` places a weight's bf16 copy (the
    FSDP mesh all-gathers it there, the others leave it as it is)."""
    import jax
    import jax.numpy as jnp

    hd = t.d_model // t.heads

    def layer(x, w, positions, causal):
        """One decoder layer; ``w``: its weights by their name in the layer."""
        b, s, _ = x.shape
        h = _rms_norm(x, w["attn_norm"])
        q, k, v = ((h @ w[f"w{n}"]).reshape(b, s, t.heads, hd) for n in "qkv")
        q, k = _rotary(q, positions), _rotary(k, positions)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd)
        scores = jnp.where(causal, scores, -1e9)
        probs = jax.nn.softmax(scores, axis=-1).astype(jnp.bfloat16)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, t.d_model)
        x = x + attn @ w["wo"]
        h = _rms_norm(x, w["mlp_norm"])
        if not t.experts:
            h = jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])
            return x + h @ w["w_down"], 0.0
        mlp, balance = moe(h, w)
        return x + mlp, balance

    def moe(h, w):
        """Mixtral's sparse MLP, dense form: (output, load-balancing loss)."""
        logits = (h @ w["router"]).astype(jnp.float32)                    # [b, s, E]
        chosen, experts = jax.lax.top_k(logits, t.top_k)                  # [b, s, k]
        gates = jax.nn.softmax(chosen, axis=-1)
        picked = jax.nn.one_hot(experts, t.experts, dtype=jnp.float32)    # [b, s, k, E]
        weights = jnp.einsum("bsk,bske->bse", gates, picked).astype(h.dtype)
        gate = jnp.einsum("bsd,edf->bsef", h, w["w_gate"])
        up = jnp.einsum("bsd,edf->bsef", h, w["w_up"])
        out = jnp.einsum("bsef,efd->bsed", jax.nn.silu(gate) * up, w["w_down"])
        # Switch Transformer's auxiliary loss: E * sum_e (tokens routed to e) * (mean
        # router probability of e), over the k choices.
        routed = jnp.mean(picked.sum(axis=2), axis=(0, 1)) / t.top_k
        probability = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=(0, 1))
        balance = t.experts * jnp.sum(routed * probability)
        return jnp.einsum("bsed,bse->bsd", out, weights), balance

    def loss(params, tokens, targets):
        p = {name: gathered(name, w.astype(jnp.bfloat16)) for name, w in params.items()}
        b, s = tokens.shape
        positions = jnp.arange(s)
        causal = jnp.tril(jnp.ones((s, s), bool))
        x = jnp.take(p["embed"], tokens, axis=0)
        balance = jnp.float32(0.0)
        if t.scan_layers and t.experts:
            stacked = {name: p[STACKED + name] for name in _layer_shapes(t)}
            (x, balance), _ = jax.lax.scan(jax.checkpoint(
                lambda carry, w: (_add_balance(layer(carry[0], w, positions, causal),
                                               carry[1]), None)), (x, balance), stacked)
        elif t.scan_layers:
            stacked = {name: p[STACKED + name] for name in _layer_shapes(t)}
            x, _ = jax.lax.scan(jax.checkpoint(
                lambda x, w: (layer(x, w, positions, causal)[0], None)), x, stacked)
        for i in range(0 if t.scan_layers else t.layers):
            x, extra = layer(x, {name: p[f"layer{i}_{name}"] for name in _layer_shapes(t)},
                             positions, causal)
            balance = balance + extra
        x = _rms_norm(x, p["final_norm"])
        logits = (x @ p["head"]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
        return nll + LOAD_BALANCE_WEIGHT * balance / t.layers if t.experts else nll

    return loss


def _add_balance(layer_out, balance):
    """A scanned layer's carry: its output and the load-balancing loss summed so far."""
    x, extra = layer_out
    return x, balance + extra


# ----------------------------------------------------------------------------- shardings

def _weight_spec(mesh_name: str, name: str, shape: tuple[int, ...]):
    """The PartitionSpec of a master weight (and its optimizer state) on this mesh; a
    stacked layer weight's leading (layer) axis is never sharded."""
    from jax.sharding import PartitionSpec as P

    if name.endswith("_norm") or mesh_name == "data8":
        return P()                                   # norm scales: replicated everywhere
    # a stacked layer's leading (layer) axis, a MoE weight's expert axis: never sharded
    layer_axes = (1 if name.startswith(STACKED) else 0) + \
        (1 if name.endswith(("_w_gate", "_w_up", "_w_down")) and
         len(shape) == 3 + name.startswith(STACKED) else 0)
    if mesh_name in FSDP_MESHES:
        # MaxText's "embed" logical axis -> fsdp: the d_model axis of every matrix.
        embed_axis = layer_axes + (1 if name == "embed" or name.endswith(("_wo", "_w_down"))
                                   else 0)
        return P(*("fsdp" if a == embed_axis else None for a in range(len(shape))))
    if name.endswith("_router"):
        return P()
    # data4_model2: Megatron column / row parallel.
    if name.endswith(("_wq", "_wk", "_wv", "_w_gate", "_w_up")) or name == "head":
        return P(*[None] * layer_axes, None, "model")
    if name.endswith(("_wo", "_w_down")):
        return P(*[None] * layer_axes, "model", None)
    return P()                                       # the embedding table: replicated


def build_step(mesh_name: str, t: LlamaShape):
    """(jitted step, abstract arguments) for one mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    axes = MESHES[mesh_name]
    mesh = Mesh(np.array(jax.devices()[:NUM_DEVICES]).reshape(tuple(axes.values())),
                tuple(axes))
    shapes = param_shapes(t)
    weight = {name: NamedSharding(mesh, _weight_spec(mesh_name, name, shape))
              for name, shape in shapes.items()}
    batch_axes = tuple(a for a in axes if a != "model")
    batch = NamedSharding(mesh, P(batch_axes, None))
    replicated = NamedSharding(mesh, P())

    def gathered(name, w16):
        if mesh_name not in FSDP_MESHES or w16.ndim == 1:
            return w16
        # FSDP: the bf16 copy is cast on the shard, then made whole on every device: a
        # bf16 all-gather over fsdp (the two constraints keep the cast before the gather).
        w16 = jax.lax.with_sharding_constraint(w16, weight[name])
        return jax.lax.with_sharding_constraint(w16, replicated)

    loss = _loss(t, gathered)
    # MaxText's default: clip by global norm (gradient_clipping_threshold 1.0), AdamW. On
    # the tensor-parallel mesh the norm's partial sums over model groups come out as
    # `mesh[…], device_ids=([4,2]T(1,0))` groups.
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(1e-3, weight_decay=1e-2))

    def step(params, opt_state, tokens, targets):
        grads = jax.grad(loss)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=weight[name])
              for name, shape in shapes.items()}
    opt_state = jax.eval_shape(optimizer.init, params)
    state_sharding = jax.tree.map(lambda leaf: replicated, opt_state)
    # mu and nu mirror the parameters' shardings (chain: clip's empty state, then
    # adamw's (ScaleByAdamState(count, mu, nu), ...)).
    adamw = state_sharding[-1]
    adam = adamw[0]._replace(mu=weight, nu=weight)
    state_sharding = (*state_sharding[:-1], (adam, *adamw[1:]))
    opt_state = jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                  sharding=s),
                             opt_state, state_sharding)
    global_batch = t.batch_per_device * NUM_DEVICES
    tokens = jax.ShapeDtypeStruct((global_batch, t.seq), jnp.int32, sharding=batch)
    jitted = jax.jit(step, in_shardings=(weight, state_sharding, batch, batch),
                     out_shardings=(weight, state_sharding), donate_argnums=(0, 1))
    return jitted, (params, opt_state, tokens, tokens)


def dump(mesh_name: str, t: LlamaShape) -> str:
    """The per-device SPMD module of the step (this process must own 8 CPU devices)."""
    from hlo_shard.jax import per_device_hlo

    jitted, args = build_step(mesh_name, t)
    return per_device_hlo(jitted, *args)


def generate(out: Path, mesh_name: str = "data8", size: str = "default",
             timeout_s: float = 1800, **overrides: int) -> Path:
    """Dump one step into ``out`` from a child process (which owns the XLA flags)."""
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in overrides.items()]
    subprocess.run([sys.executable, str(Path(__file__).resolve()), str(out), "--mesh",
                    mesh_name, "--size", size, *flags], check=True, timeout=timeout_s,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    return out


def _integer_as(kind: type, text: str) -> int | bool:
    """An override written as an integer, of its field's own type (0/1 for a flag)."""
    return kind(int(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the .hlo file to write")
    parser.add_argument("--mesh", choices=sorted(MESHES), default="data8")
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    for field, value in asdict(SIZES["default"]).items():
        parser.add_argument(f"--{field.replace('_', '-')}", default=None,
                            type=partial(_integer_as, type(value)),
                            help=f"override the size's {field} (default {value})")
    args = parser.parse_args()
    overrides = {f: getattr(args, f) for f in asdict(SIZES["default"])
                 if getattr(args, f) is not None}
    shape = LlamaShape(**(asdict(SIZES[args.size]) | overrides))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={NUM_DEVICES}")
    os.environ["JAX_PLATFORMS"] = "cpu"
    text = dump(args.mesh, shape)
    staging = args.out.with_name(args.out.name + ".partial")
    staging.write_text(text)
    staging.replace(args.out)
    print(f"{args.out}: {len(text) / 1e6:.2f} MB, mesh {args.mesh}, {shape}")


if __name__ == "__main__":
    main()
