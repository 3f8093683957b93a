"""The model zoo of ``make bench`` (issue 12): models the pass had never seen, each with
the optimizers users train them with, dumped from real JAX + optax steps like the
fixtures (:mod:`fixture_models`, :mod:`hlo_dump`), never committed.

Three bodies — a conv net, one pre-LN transformer block, a LayerNorm MLP — times six
optimizers (Adam, AdamW + global-norm clipping, Lion, LAMB, Adafactor, SGD with
momentum), each in two sizes:

* ``zoo_<body>_<opt>``: 0.1–0.4 M parameters (≥ 128 rows: Adafactor factors its state).
  Collective latency outweighs the whole update at this size, so these mostly test the
  other half of the rule: that the pass keeps a module whole when sharding does not pay.
* ``zoo_<body>_wide_<opt>``: 0.4–2 M parameters, the size where a data-parallel job
  starts to spend real time in its optimizer, and where sharding has to pay off.

Both tiers dump, optimize and time in a few minutes on two cores.

Importing this file does not import jax.
"""

from __future__ import annotations

from dataclasses import dataclass

from fixture_models import (ModelSpec, TransformerShape, _layer_norm, _optax,
                            _transformer_loss, _transformer_params)

ZOO_DEVICES = (4, 8)

OPTIMIZERS = {
    "adam": _optax("adam(1e-3)", lambda o: o.adam(1e-3)),
    "adamw_clip": _optax("chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=1e-2))",
                         lambda o: o.chain(o.clip_by_global_norm(1.0),
                                           o.adamw(1e-3, weight_decay=1e-2))),
    "lion": _optax("lion(1e-4)", lambda o: o.lion(1e-4)),
    "lamb": _optax("lamb(1e-3)", lambda o: o.lamb(1e-3)),
    "adafactor": _optax("adafactor(1e-2)", lambda o: o.adafactor(1e-2)),
    "momentum": _optax("sgd(0.05, momentum=0.9)", lambda o: o.sgd(0.05, momentum=0.9)),
}

@dataclass(frozen=True)
class ZooSize:
    """One size tier of the three bodies."""

    suffix: str                     # "" or "_wide", inserted after the body's name
    block: TransformerShape
    ln_mlp: tuple[int, ...]         # layer widths, input first
    conv_channels: tuple[int, int, int]


SIZES = (
    ZooSize("", TransformerShape(vocab=256, d_model=128, heads=4, d_ff=512, layers=1, seq=32),
            (128, 256, 256, 64), (8, 64, 128)),
    ZooSize("_wide", TransformerShape(vocab=1024, d_model=256, heads=4, d_ff=1024, layers=1,
                                      seq=32),
            (512, 1024, 1024, 256), (16, 128, 256)),
)
CONV_CLASSES = 10


def _conv_params(channels: tuple[int, int, int]):
    c0, c1, c2 = channels
    return lambda: {
        "conv0_w": ((3, 3, c0, c1), "float32"), "conv0_b": ((c1,), "float32"),
        "conv1_w": ((3, 3, c1, c2), "float32"), "conv1_b": ((c2,), "float32"),
        "head_w": ((c2, CONV_CLASSES), "float32"), "head_b": ((CONV_CLASSES,), "float32")}


def _conv_loss(p, batch):
    """Two 3x3 convolutions (NHWC), ReLU, global average pool, linear head, softmax CE."""
    import jax
    import jax.numpy as jnp

    h = batch["images"]
    for i in range(2):
        h = jax.lax.conv_general_dilated(h, p[f"conv{i}_w"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jax.nn.relu(h + p[f"conv{i}_b"])
    logits = jnp.mean(h, axis=(1, 2)) @ p["head_w"] + p["head_b"]
    target = jax.nn.one_hot(batch["labels"], CONV_CLASSES)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * target, axis=-1))


def _ln_mlp_params(widths: tuple[int, ...]):
    def params():
        out = {}
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            out |= {f"l{i}_w": ((a, b), "float32"), f"l{i}_b": ((b,), "float32")}
            if i < len(widths) - 2:
                out |= {f"l{i}_ln_scale": ((b,), "float32"),
                        f"l{i}_ln_bias": ((b,), "float32")}
        return out
    return params


def _ln_mlp_loss(p, batch):
    """Dense → LayerNorm → GELU per hidden layer, then a linear output; MSE."""
    import jax
    import jax.numpy as jnp

    h = batch["x"]
    layers = sum(1 for name in p if name.endswith("_w"))
    for i in range(layers):
        h = h @ p[f"l{i}_w"] + p[f"l{i}_b"]
        if i < layers - 1:
            h = jax.nn.gelu(_layer_norm(h, p[f"l{i}_ln_scale"], p[f"l{i}_ln_bias"]))
    return jnp.mean((h - batch["y"]) ** 2)


def _bodies(size: ZooSize) -> dict[str, dict]:
    """Model body → the ModelSpec fields that do not depend on the optimizer."""
    block, widths = size.block, size.ln_mlp
    return {
        "conv": dict(params=_conv_params(size.conv_channels),
                     batch=lambda: {"images": ((2, 16, 16, size.conv_channels[0]), "float32"),
                                    "labels": ((2,), "int32")},
                     loss=_conv_loss, batch_int_high={"labels": CONV_CLASSES}),
        "block": dict(params=_transformer_params(block),
                      batch=lambda: {"tokens": ((2, block.seq), "int32"),
                                     "targets": ((2, block.seq), "int32")},
                      loss=_transformer_loss(block, 0.0),
                      batch_int_high={"tokens": block.vocab, "targets": block.vocab}),
        "ln_mlp": dict(params=_ln_mlp_params(widths),
                       batch=lambda: {"x": ((4, widths[0]), "float32"),
                                      "y": ((4, widths[-1]), "float32")},
                       loss=_ln_mlp_loss),
    }


ZOO_MODELS: dict[str, ModelSpec] = {
    name: ModelSpec(name=name, optimizer=OPTIMIZERS[opt][0], make_optimizer=OPTIMIZERS[opt][1],
                    devices=ZOO_DEVICES, notes=f"model zoo: {body}{size.suffix} x {opt}",
                    **fields)
    for size in SIZES for body, fields in _bodies(size).items() for opt in OPTIMIZERS
    for name in [f"zoo_{body}{size.suffix}_{opt}"]
}
