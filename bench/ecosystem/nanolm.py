"""optax's nanoLM: a character transformer (flax linen) trained with AdamW, data
parallel with ``jax.jit``.

Source (Apache License 2.0, Copyright DeepMind Technologies Limited):
https://github.com/google-deepmind/optax/blob/main/examples/nanolm.ipynb at
google-deepmind/optax 2edbcbe2390da13983b92cbef94ac0460ecde1c5 — ``NanoLM`` (without its
``generate`` method, text generation after training), ``loss_fun``, the initialisation
and ``opt = optax.adamw(learning_rate=LEARNING_RATE)``, and the jitted ``step``
unchanged except where its batch comes from: the notebook samples it inside the step
from the whole text (``get_batch(key, train_data)``); here it is an argument sharded
over a data axis (data parallel), and the step donates its state.

Cut for the CPU: 2 layers of width 64 (4 heads of 16), a context of 32 characters,
dropout as in the notebook, synthetic tokens from tiny shakespeare's 65-character
vocabulary, 2 sequences per device.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from bench.ecosystem import Program, data_mesh, replicated, sharded_batch

SEED = 42
LEARNING_RATE = 5e-3
DROPOUT_RATE = 0.2
BLOCK_SIZE = 32  # the notebook: 64
NUM_LAYERS = 2  # 6
EMBED_SIZE = 64  # 256
NUM_HEADS = 4  # 8
HEAD_SIZE = 16  # 32
VOCAB_SIZE = 65  # len(vocab) of tiny shakespeare

# ------------------------------------------------------------------- from nanolm.ipynb


class NanoLM(nn.Module):
  """NanoLM model."""
  vocab_size: int
  num_layers: int = 6
  num_heads: int = 8
  head_size: int = 32
  dropout_rate: float = 0.2
  embed_size: int = 256
  block_size: int = 64

  @nn.compact
  def __call__(self, x, training: bool):
    seq_len = x.shape[1]

    x = nn.Embed(self.vocab_size, self.embed_size)(x) + nn.Embed(
        self.block_size, self.embed_size
    )(jnp.arange(seq_len))
    for _ in range(self.num_layers):
      x_norm = nn.LayerNorm()(x)
      x = x + nn.MultiHeadDotProductAttention(
          num_heads=self.num_heads,
          qkv_features=self.head_size,
          out_features=self.head_size * self.num_heads,
          dropout_rate=self.dropout_rate,
      )(
          x_norm,
          x_norm,
          mask=jnp.tril(jnp.ones((x.shape[-2], x.shape[-2]))),
          deterministic=not training,
      )

      x = x + nn.Sequential([
          nn.Dense(4 * self.embed_size),
          nn.relu,
          nn.Dropout(self.dropout_rate, deterministic=not training),
          nn.Dense(self.embed_size),
      ])(nn.LayerNorm()(x))

    x = nn.LayerNorm()(x)
    return nn.Dense(self.vocab_size)(x)


model = NanoLM(
    vocab_size=VOCAB_SIZE,
    num_layers=NUM_LAYERS,
    num_heads=NUM_HEADS,
    head_size=HEAD_SIZE,
    dropout_rate=DROPOUT_RATE,
    embed_size=EMBED_SIZE,
    block_size=BLOCK_SIZE,
)

def loss_fun(params, x, y, dropout_key):
  logits = model.apply(params, x, training=True, rngs={"dropout": dropout_key})
  return optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=y
  ).mean()


opt = optax.adamw(learning_rate=LEARNING_RATE)

# ------------------------------------------------------------------------- the program

AXIS = "data"


def build(n: int, per_device: int = 2) -> Program:
    """The notebook's step on ``n`` devices, ``per_device`` sequences each."""
    mesh = data_mesh(n, AXIS)

    @partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, key, opt_state, batch):
      key, subkey = jax.random.split(key)
      loss, grad = jax.value_and_grad(loss_fun)(params, *batch, subkey)
      updates, opt_state = opt.update(grad, opt_state, params)
      params = optax.apply_updates(params, updates)
      return params, key, opt_state, loss

    def init():
        key = jax.random.PRNGKey(SEED)
        key, subkey = jax.random.split(key)
        var_params = model.init(
            key,
            jnp.ones((n * per_device, BLOCK_SIZE), dtype=jnp.int32),
            training=False,
        )
        opt_state = opt.init(var_params)
        return replicated(mesh, (var_params, key, opt_state))

    def batch(i: int):
        tokens = jax.random.randint(jax.random.PRNGKey(3000 + i),
                                    (n * per_device, BLOCK_SIZE + 1), 0, VOCAB_SIZE)
        return sharded_batch(mesh, (tokens[:, :-1], tokens[:, 1:]))

    return Program("optax nanoLM (flax linen)", mesh, step, init, batch,
                   opt_state_prefix="[2]")
