# ruff: noqa: F722, UP037  (jaxtyping shape strings in the notebook's annotations)
"""equinox's Vision Transformer example (CIFAR-10), trained data parallel as equinox's
parallelism example trains: ``eqx.filter_jit(donate="all")`` with ``eqx.filter_shard``.

Sources (patrick-kidger/equinox at 9336d820b2ef66b360fc6cb3611b3da5cefbb14d, Apache
License 2.0):

* https://github.com/patrick-kidger/equinox/blob/main/docs/examples/vision_transformer.ipynb
  — ``PatchEmbedding``, ``AttentionBlock``, ``VisionTransformer``, ``compute_grads``,
  ``step_model`` (here without its ``@eqx.filter_jit``: the parallel step below jits
  it), the model's construction, the optimizer (``optax.adamw``) and its ``init`` over
  ``eqx.filter(model, eqx.is_inexact_array)``, the per-example dropout keys
  (``jr.split(key, num=batch_size + 1)``): unchanged.
* https://github.com/patrick-kidger/equinox/blob/main/docs/examples/parallelism.ipynb
  — ``train_step``'s form: ``@eqx.filter_jit(donate="all")``, model and optimizer state
  ``eqx.filter_shard``-ed replicated, the batch over the ``"batch"`` axis; its body
  calls the ViT's ``step_model``.

Cut for the CPU: width 64 (the notebook: 512), MLP 128 (256), 4 heads (8), 2 layers
(6); 32x32x3 images in 4x4 patches as in the notebook; synthetic images and labels in
place of torchvision's CIFAR-10 loader, 2 per device.

Its vmapped ``Linear`` layers make the SPMD partitioner all-reduce their gradients over
``mesh['axis_0'=1,'axis_1'=N,'axis_2'=1] {'axis_1'}`` beside the loss's
``mesh['axis_0'=N] {'axis_0'}``: mixed mesh forms in one module.
"""

from __future__ import annotations

import einops  # https://github.com/arogozhnikov/einops
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax  # https://github.com/deepmind/optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray

from bench.ecosystem import Program, data_mesh

# ------------------------------------------------------- from vision_transformer.ipynb

# Hyperparameters
lr = 0.0001
dropout_rate = 0.1
beta1 = 0.9
beta2 = 0.999
patch_size = 4
num_patches = 64
image_size = (32, 32, 3)
embedding_dim = 128  # the notebook: 512
hidden_dim = 256
num_heads = 8
num_layers = 2  # 6
height, width, channels = image_size
num_classes = 10


class PatchEmbedding(eqx.Module):
    linear: eqx.nn.Embedding
    patch_size: int

    def __init__(
        self,
        input_channels: int,
        output_shape: int,
        patch_size: int,
        key: PRNGKeyArray,
    ):
        self.patch_size = patch_size

        self.linear = eqx.nn.Linear(
            self.patch_size**2 * input_channels,
            output_shape,
            key=key,
        )

    def __call__(
        self, x: Float[Array, "channels height width"]
    ) -> Float[Array, "num_patches embedding_dim"]:
        x = einops.rearrange(
            x,
            "c (h ph) (w pw) -> (h w) (c ph pw)",
            ph=self.patch_size,
            pw=self.patch_size,
        )
        x = jax.vmap(self.linear)(x)

        return x


class AttentionBlock(eqx.Module):
    layer_norm1: eqx.nn.LayerNorm
    layer_norm2: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    dropout1: eqx.nn.Dropout
    dropout2: eqx.nn.Dropout

    def __init__(
        self,
        input_shape: int,
        hidden_dim: int,
        num_heads: int,
        dropout_rate: float,
        key: PRNGKeyArray,
    ):
        key1, key2, key3 = jr.split(key, 3)

        self.layer_norm1 = eqx.nn.LayerNorm(input_shape)
        self.layer_norm2 = eqx.nn.LayerNorm(input_shape)
        self.attention = eqx.nn.MultiheadAttention(num_heads, input_shape, key=key1)

        self.linear1 = eqx.nn.Linear(input_shape, hidden_dim, key=key2)
        self.linear2 = eqx.nn.Linear(hidden_dim, input_shape, key=key3)
        self.dropout1 = eqx.nn.Dropout(dropout_rate)
        self.dropout2 = eqx.nn.Dropout(dropout_rate)

    def __call__(
        self,
        x: Float[Array, "num_patches embedding_dim"],
        enable_dropout: bool,
        key: PRNGKeyArray,
    ) -> Float[Array, "num_patches embedding_dim"]:
        input_x = jax.vmap(self.layer_norm1)(x)
        x = x + self.attention(input_x, input_x, input_x)

        input_x = jax.vmap(self.layer_norm2)(x)
        input_x = jax.vmap(self.linear1)(input_x)
        input_x = jax.nn.gelu(input_x)

        key1, key2 = jr.split(key, num=2)

        input_x = self.dropout1(input_x, inference=not enable_dropout, key=key1)
        input_x = jax.vmap(self.linear2)(input_x)
        input_x = self.dropout2(input_x, inference=not enable_dropout, key=key2)

        x = x + input_x

        return x


class VisionTransformer(eqx.Module):
    patch_embedding: PatchEmbedding
    positional_embedding: jnp.ndarray
    cls_token: jnp.ndarray
    attention_blocks: list[AttentionBlock]
    dropout: eqx.nn.Dropout
    mlp: eqx.nn.Sequential
    num_layers: int

    def __init__(
        self,
        embedding_dim: int,
        hidden_dim: int,
        num_heads: int,
        num_layers: int,
        dropout_rate: float,
        patch_size: int,
        num_patches: int,
        num_classes: int,
        key: PRNGKeyArray,
    ):
        key1, key2, key3, key4, key5 = jr.split(key, 5)

        self.patch_embedding = PatchEmbedding(channels, embedding_dim, patch_size, key1)

        self.positional_embedding = jr.normal(key2, (num_patches + 1, embedding_dim))

        self.cls_token = jr.normal(key3, (1, embedding_dim))

        self.num_layers = num_layers

        self.attention_blocks = [
            AttentionBlock(embedding_dim, hidden_dim, num_heads, dropout_rate, key4)
            for _ in range(self.num_layers)
        ]

        self.dropout = eqx.nn.Dropout(dropout_rate)

        self.mlp = eqx.nn.Sequential(
            [
                eqx.nn.LayerNorm(embedding_dim),
                eqx.nn.Linear(embedding_dim, num_classes, key=key5),
            ]
        )

    def __call__(
        self,
        x: Float[Array, "channels height width"],
        enable_dropout: bool,
        key: PRNGKeyArray,
    ) -> Float[Array, "num_classes"]:
        x = self.patch_embedding(x)

        x = jnp.concatenate((self.cls_token, x), axis=0)

        x += self.positional_embedding[
            : x.shape[0]
        ]  # Slice to the same length as x, as the positional embedding may be longer.

        dropout_key, *attention_keys = jr.split(key, num=self.num_layers + 1)

        x = self.dropout(x, inference=not enable_dropout, key=dropout_key)

        for block, attention_key in zip(self.attention_blocks, attention_keys):
            x = block(x, enable_dropout, key=attention_key)

        x = x[0]  # Select the CLS token.
        x = self.mlp(x)

        return x


@eqx.filter_value_and_grad
def compute_grads(
    model: VisionTransformer, images: jnp.ndarray, labels: jnp.ndarray, key
):
    logits = jax.vmap(model, in_axes=(0, None, 0))(images, True, key)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    return jnp.mean(loss)


def step_model(
    model: VisionTransformer,
    optimizer: optax.GradientTransformation,
    state: optax.OptState,
    images: jnp.ndarray,
    labels: jnp.ndarray,
    key,
):
    loss, grads = compute_grads(model, images, labels, key)
    updates, new_state = optimizer.update(grads, state, model)

    model = eqx.apply_updates(model, updates)

    return model, new_state, loss


# ------------------------------------------------------------------------- the program

AXIS = "batch"  # parallelism.ipynb's axis name


def _model_and_optimizer(**cut):
    """The notebook's model and optimizer; ``cut`` overrides hyperparameters (the fast
    test's smaller ViT)."""
    sizes = dict(embedding_dim=embedding_dim, hidden_dim=hidden_dim, num_heads=num_heads,
                 num_layers=num_layers) | cut
    key = jr.PRNGKey(2003)

    model = VisionTransformer(
        embedding_dim=sizes["embedding_dim"],
        hidden_dim=sizes["hidden_dim"],
        num_heads=sizes["num_heads"],
        num_layers=sizes["num_layers"],
        dropout_rate=dropout_rate,
        patch_size=patch_size,
        num_patches=num_patches,
        num_classes=num_classes,
        key=key,
    )

    optimizer = optax.adamw(
        learning_rate=lr,
        b1=beta1,
        b2=beta2,
    )
    return model, optimizer


def build(n: int, per_device: int = 2, **cut: int) -> Program:
    """The notebook's step on ``n`` devices, ``per_device`` images each, in the
    parallelism example's form; ``cut``: smaller ``embedding_dim``, ``hidden_dim``,
    ``num_heads``, ``num_layers``."""
    mesh = data_mesh(n, AXIS)
    data_sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    model_sharding = NamedSharding(mesh, PartitionSpec())
    _, optimizer = _model_and_optimizer(**cut)
    batch_size = n * per_device

    @eqx.filter_jit(donate="all")
    def train_step(model, state, batch):
        model, state = eqx.filter_shard((model, state), model_sharding)
        images, labels, subkeys = eqx.filter_shard(batch, data_sharding)
        model, state, loss = step_model(model, optimizer, state, images, labels, subkeys)
        model, state = eqx.filter_shard((model, state), model_sharding)
        return model, state, loss

    def init():
        model, _ = _model_and_optimizer(**cut)
        state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        return eqx.filter_shard((model, state), model_sharding)

    def batch(i: int):
        key = jr.fold_in(jr.PRNGKey(5000), i)
        images = jr.normal(key, (batch_size, channels, height, width))
        labels = jr.randint(jr.fold_in(key, 1), (batch_size,), 0, num_classes)
        key, *subkeys = jr.split(key, num=batch_size + 1)
        subkeys = jnp.array(subkeys)
        return eqx.filter_shard((images, labels, subkeys), data_sharding)

    # no opt_state_prefix: train_step pins its state replicated (eqx.filter_shard)
    return Program("equinox ViT", mesh, train_step, init, batch)
