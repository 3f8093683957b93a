"""haiku's transformer language model example, trained data parallel with ``jax.jit``.

Source: google-deepmind/dm-haiku at f4d858a5cbb29140855d68f81f5fd625e078a5ae,
https://github.com/google-deepmind/dm-haiku/tree/main/examples/transformer —
``model.py``'s ``_layer_norm``, ``Transformer`` and ``LanguageModel``; ``train.py``'s
``TrainingState``, ``forward_pass``, ``optimiser`` (global-norm clipping + Adam),
``loss_fn``, ``init`` and ``update``; ``dataset.py``'s ``Batch``, ``VOCAB_SIZE`` and
``PAD_TOKEN``: all unchanged (Apache License 2.0, Copyright 2020 DeepMind Technologies
Limited), except that ``update`` is jitted here with its state donated
(``jax.jit(update, donate_argnums=0)`` in place of ``@jax.jit``) and its batch sharded
over a data axis (data parallel); the files' module prefixes (``model.``,
``dataset.``) are dropped, all three being in this one module.

Cut for the CPU: 2 layers (train.py: 6), its width (128), heads (8 of 32) and context
(64 tokens); 4 sequences per device (train.py's ``BATCH_SIZE``: 2 on its one device);
synthetic ASCII tokens (no padding) in place of a text file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.ecosystem import Program, data_mesh, replicated, sharded_batch

# ------------------------------------------------------------------- from dataset.py

VOCAB_SIZE = 128  # Number of ASCII code points.
PAD_TOKEN = 0


class Batch(NamedTuple):
  inputs: np.ndarray  # Integer tokens, shape [B, T].
  targets: np.ndarray  # Integer tokens, shape [B, T].

# --------------------------------------------------------------------- from model.py


def _layer_norm(x: jax.Array) -> jax.Array:
  """Applies a unique LayerNorm to `x` with default settings."""
  ln = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)
  return ln(x)


@dataclasses.dataclass
class Transformer(hk.Module):
  """A transformer stack."""

  num_heads: int  # Number of attention heads.
  num_layers: int  # Number of transformer (attention + MLP) layers to stack.
  attn_size: int  # Size of the attention (key, query, value) vectors.
  dropout_rate: float  # Probability with which to apply dropout.
  widening_factor: int = 4  # Factor by which the MLP hidden layer widens.
  name: str | None = None  # Optional identifier for the module.

  def __call__(
      self,
      embeddings: jax.Array,  # [B, T, D]
      mask: jax.Array,  # [B, T]
  ) -> jax.Array:  # [B, T, D]
    """Transforms input embedding sequences to output embedding sequences."""

    initializer = hk.initializers.VarianceScaling(2 / self.num_layers)
    _, seq_len, model_size = embeddings.shape

    # Compute causal mask for autoregressive sequence modelling.
    mask = mask[:, None, None, :]  # [B, H=1, T'=1, T]
    causal_mask = np.tril(np.ones((1, 1, seq_len, seq_len)))  # [B=1, H=1, T, T]
    mask = mask * causal_mask  # [B, H=1, T, T]

    h = embeddings
    for _ in range(self.num_layers):
      # First the attention block.
      attn_block = hk.MultiHeadAttention(
          num_heads=self.num_heads,
          key_size=self.attn_size,
          model_size=model_size,
          w_init=initializer,
      )
      h_norm = _layer_norm(h)
      h_attn = attn_block(h_norm, h_norm, h_norm, mask=mask)
      h_attn = hk.dropout(hk.next_rng_key(), self.dropout_rate, h_attn)
      h = h + h_attn

      # Then the dense block.
      dense_block = hk.Sequential([
          hk.Linear(self.widening_factor * model_size, w_init=initializer),
          jax.nn.gelu,
          hk.Linear(model_size, w_init=initializer),
      ])
      h_norm = _layer_norm(h)
      h_dense = dense_block(h_norm)
      h_dense = hk.dropout(hk.next_rng_key(), self.dropout_rate, h_dense)
      h = h + h_dense

    return _layer_norm(h)


@dataclasses.dataclass
class LanguageModel(hk.Module):
  """An autoregressive transformer-based language model."""

  transformer: Transformer
  model_size: int  # Embedding size.
  vocab_size: int  # Size of the vocabulary.
  pad_token: int  # Identity of the padding token (used for masking inputs).
  name: str | None = None  # Optional identifier for the module.

  def __call__(
      self,
      tokens: jax.Array,  # Batch of sequences of input tokens, shape [B, T].
  ) -> jax.Array:  # Batch of sequences of output token logits, shape [B, T, V].
    """Forward pass, producing a sequence of logits."""
    input_mask = (tokens != self.pad_token)
    unused_batch_size, seq_len = tokens.shape

    # Embed the input tokens and positions.
    embed_init = hk.initializers.TruncatedNormal(stddev=0.02)
    token_embedding_map = hk.Embed(
        self.vocab_size, embed_dim=self.model_size, w_init=embed_init)
    token_embeddings = token_embedding_map(tokens)
    positional_embeddings = hk.get_parameter(
        'positional_embeddings', [seq_len, self.model_size], init=embed_init)
    input_embeddings = token_embeddings + positional_embeddings  # [B, T, D]

    # Run the transformer over the inputs.
    embeddings = self.transformer(input_embeddings, input_mask)  # [B, T, D]

    # Decode the embeddings (here, we use untied weights).
    return hk.Linear(self.vocab_size)(embeddings)  # [B, T, V]


# --------------------------------------------------------------------- from train.py

# Training hyperparameters.
SEQUENCE_LENGTH = 64
LEARNING_RATE = 3e-4
GRAD_CLIP_VALUE = 1
SEED = 0

# Model hyperparameters.
NUM_LAYERS = 2  # train.py: 6
NUM_HEADS = 8  # Number of attention heads.
MODEL_SIZE = 128
KEY_SIZE = 32
DROPOUT_RATE = 0.1

# Helpful type aliases.
_Batch = Batch
_Metrics = MutableMapping[str, Any]


class TrainingState(NamedTuple):
  """Container for the training state."""
  params: hk.Params  # Current network parameters.
  opt_state: optax.OptState  # Optimiser state (e.g. gradient moments).
  rng_key: jax.Array  # RNG used for e.g. dropout. Split on each update step.
  step: jax.Array  # Tracks the number of training steps.


def forward_pass(tokens: np.ndarray | jax.Array) -> jax.Array:
  """Defines the forward pass of the language model."""
  lm = LanguageModel(
      model_size=MODEL_SIZE,
      vocab_size=VOCAB_SIZE,
      pad_token=PAD_TOKEN,
      transformer=Transformer(
          num_heads=NUM_HEADS,
          num_layers=NUM_LAYERS,
          attn_size=KEY_SIZE,
          dropout_rate=DROPOUT_RATE,
      ),
  )
  return lm(tokens)  # Logits, shape [B, T, V].


def optimiser() -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(GRAD_CLIP_VALUE),
      optax.adam(LEARNING_RATE, b1=0.9, b2=0.99),
  )


@hk.transform
def loss_fn(data: _Batch) -> jax.Array:
  """Computes the (scalar) language modelling loss on `data` w.r.t. params."""
  logits = forward_pass(data.inputs)
  log_probs = jax.nn.log_softmax(logits)  # [B, T, V]
  onehot_targets = jax.nn.one_hot(data.targets, VOCAB_SIZE)
  log_likelihood = jnp.sum(onehot_targets * log_probs, axis=-1)  # [B, T]

  # Loss is the average negative log-likelihood per (non-masked) token.
  mask = jnp.not_equal(data.inputs, PAD_TOKEN)  # [B, T]
  return -jnp.sum(log_likelihood * mask) / jnp.sum(mask)  # []


@jax.jit
def init(rng: jax.Array, data: _Batch) -> TrainingState:
  """Makes an initial training state (random parameters)."""
  rng, init_rng = jax.random.split(rng)
  initial_params = loss_fn.init(init_rng, data)
  initial_opt_state = optimiser().init(initial_params)
  return TrainingState(
      params=initial_params,
      opt_state=initial_opt_state,
      rng_key=rng,
      step=jnp.array(0),
  )


def update(
    state: TrainingState, data: _Batch
) -> tuple[TrainingState, _Metrics]:
  """Does an SGD step, returning a new training state and metrics."""
  rng, net_rng = jax.random.split(state.rng_key)
  loss_and_grad_fn = jax.value_and_grad(loss_fn.apply)
  loss, gradients = loss_and_grad_fn(state.params, net_rng, data)

  updates, new_opt_state = optimiser().update(gradients, state.opt_state)
  new_params = optax.apply_updates(state.params, updates)

  new_state = TrainingState(
      params=new_params,  # pyrefly: ignore[bad-argument-type]
      opt_state=new_opt_state,
      rng_key=rng,
      step=state.step + 1,
  )

  metrics = {
      'step': state.step,
      'loss': loss,
  }
  return new_state, metrics

# ------------------------------------------------------------------------- the program

AXIS = "data"


def build(n: int, per_device: int = 4) -> Program:
    """train.py's step on ``n`` devices, ``per_device`` sequences each."""
    mesh = data_mesh(n, AXIS)
    step = jax.jit(update, donate_argnums=0)

    def batch(i: int) -> Batch:
        tokens = jax.random.randint(jax.random.PRNGKey(4000 + i),
                                    (n * per_device, SEQUENCE_LENGTH + 1), 1, VOCAB_SIZE)
        return sharded_batch(mesh, Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:]))

    def init_state():
        rng = jax.random.PRNGKey(SEED)
        return (replicated(mesh, init(rng, batch(0))),)

    return Program("haiku transformer LM", mesh, step, init_state, batch,
                   opt_state_prefix="[0].opt_state")
