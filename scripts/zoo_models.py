"""The model zoo of ``make bench`` (issue 12): models the pass had never seen, each with
the optimizers users train them with, dumped from real JAX + optax steps like the
fixtures (:mod:`fixture_models`, :mod:`hlo_dump`), never committed.

Three bodies — a small conv net, one pre-LN transformer block, a LayerNorm MLP — times
six optimizers (Adam, AdamW + global-norm clipping, Lion, LAMB, Adafactor, SGD with
momentum). Sizes are small enough that the whole zoo dumps, optimizes and times in a
few minutes on two cores, and large enough (≥ 128 rows: Adafactor factors its state)
that some of it is worth sharding.

Importing this file does not import jax.
"""

from __future__ import annotations

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

BLOCK = TransformerShape(vocab=256, d_model=128, heads=4, d_ff=512, layers=1, seq=32)
LN_MLP = (128, 256, 256, 64)
CONV_CHANNELS = (8, 64, 128)
CONV_CLASSES = 10


def _conv_params():
    c0, c1, c2 = CONV_CHANNELS
    return {"conv0_w": ((3, 3, c0, c1), "float32"), "conv0_b": ((c1,), "float32"),
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


def _ln_mlp_params():
    out = {}
    for i, (a, b) in enumerate(zip(LN_MLP, LN_MLP[1:])):
        out |= {f"l{i}_w": ((a, b), "float32"), f"l{i}_b": ((b,), "float32")}
        if i < len(LN_MLP) - 2:
            out |= {f"l{i}_ln_scale": ((b,), "float32"), f"l{i}_ln_bias": ((b,), "float32")}
    return out


def _ln_mlp_loss(p, batch):
    """Dense → LayerNorm → GELU per hidden layer, then a linear output; MSE."""
    import jax
    import jax.numpy as jnp

    h = batch["x"]
    layers = len(LN_MLP) - 1
    for i in range(layers):
        h = h @ p[f"l{i}_w"] + p[f"l{i}_b"]
        if i < layers - 1:
            h = jax.nn.gelu(_layer_norm(h, p[f"l{i}_ln_scale"], p[f"l{i}_ln_bias"]))
    return jnp.mean((h - batch["y"]) ** 2)


def _bodies() -> dict[str, dict]:
    """Model body → the ModelSpec fields that do not depend on the optimizer."""
    return {
        "conv": dict(params=_conv_params,
                     batch=lambda: {"images": ((2, 16, 16, CONV_CHANNELS[0]), "float32"),
                                    "labels": ((2,), "int32")},
                     loss=_conv_loss, batch_int_high={"labels": CONV_CLASSES}),
        "block": dict(params=_transformer_params(BLOCK),
                      batch=lambda: {"tokens": ((2, BLOCK.seq), "int32"),
                                     "targets": ((2, BLOCK.seq), "int32")},
                      loss=_transformer_loss(BLOCK, 0.0),
                      batch_int_high={"tokens": BLOCK.vocab, "targets": BLOCK.vocab}),
        "ln_mlp": dict(params=_ln_mlp_params,
                       batch=lambda: {"x": ((4, LN_MLP[0]), "float32"),
                                      "y": ((4, LN_MLP[-1]), "float32")},
                       loss=_ln_mlp_loss),
    }


ZOO_MODELS: dict[str, ModelSpec] = {
    f"zoo_{body}_{opt}": ModelSpec(name=f"zoo_{body}_{opt}", optimizer=OPTIMIZERS[opt][0],
                                   make_optimizer=OPTIMIZERS[opt][1], devices=ZOO_DEVICES,
                                   notes=f"model zoo: {body} x {opt}", **fields)
    for body, fields in _bodies().items() for opt in OPTIMIZERS
}
