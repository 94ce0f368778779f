# Copyright 2026 The Flax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Activation patching and attribution patching on an induction task.

Trains a two-layer attention-only transformer (Flax NNX, no MLPs) to do
induction: in a sequence of random tokens that contains a repeated segment,
the answer at position ``t`` is the token that followed the previous
occurrence of the token at ``t``. Then it asks where, in the residual
stream, the model carries the information that decides its answer:

* a *clean* prompt set and a *corrupted* one that differ in a single token:
  the one after the first occurrence of the final token (so the clean answer
  is ``A`` and the corrupted answer is ``B``);
* ``capture`` collects the clean residual stream, marked with ``sow`` after
  the embedding and after each layer;
* activation patching: ``patching_grid`` (on ``intervene``) runs the
  corrupted prompts with the clean residual at one (layer, position) cell,
  every cell in one batched run, and measures how much of the clean logit
  difference
  ``logit(A) - logit(B)`` comes back (0 = corrupted, 1 = clean);
* attribution patching: the first-order estimate of the same map from one
  backward pass, ``(clean - corrupted) . d metric / d residual``, with the
  gradients collected by ``capture(nnx.grad(metric))`` at the same markers
  (``sow(..., grad=True)``).

It prints the cells where the information flows and the correlation between
the two maps, and writes both maps side by side as heatmaps to
``activation_patching.png`` in the current directory (``--out PATH`` to
change it). The trained model's map has one hot cell per residual stream and
reads like the induction circuit of Olsson et al. (2022), "In-context Learning
and Induction Heads": the changed token's embedding (position 10); after the
first layer, still position 10, where a previous-token head has written the
final token (the one at position 9) for the second layer's induction head at
the final position to match and read position 10's token; after the second
layer, the final position. Attribution patching finds the same cells with
smaller values: the logit difference saturates, so its first-order estimate
falls short of the full effect.

Run ``python examples/activation_patching.py --help`` for the flags.
"""

from __future__ import annotations

import argparse
import os
import time
import typing as tp

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from flax.nnx.sow import capture, grad_name, patching_grid, sow

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)

VOCAB = 32
SEQ_LEN = 20

# The prompts of the patching experiment, all with the same layout: ten
# distinct tokens at positions 2..11 (after two of noise), then positions
# 12..19 repeat positions 2..9. The final token (position 19) repeats the
# one at position 9, so the answer is the token at position 10, which the
# corrupted prompts change.
PROMPT_START = 2
PROMPT_REPEAT = 12
CORRUPTED_POS = 10


# ---------------------------------------------------------------------------
# The task.
# ---------------------------------------------------------------------------


def induction_tokens(
    key: jax.Array, batch: int, repeat_at: jax.Array, start: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Random sequences with a repeated segment; (tokens, spare token).

  Positions ``[0, repeat_at)`` hold distinct random tokens; from
  ``repeat_at`` on, the sequence repeats the tokens from ``start`` with
  period ``repeat_at - start``. ``repeat_at`` and ``start`` are (batch,)
  int arrays. The spare token (batch,) appears nowhere in the sequence.
  """
  # A random permutation of the vocabulary per sequence: distinct tokens.
  order = jnp.argsort(jax.random.uniform(key, (batch, VOCAB)), axis=-1)
  t = jnp.arange(SEQ_LEN)[None, :]
  repeat_at, start = repeat_at[:, None], start[:, None]
  source = jnp.where(
      t < repeat_at, t, start + (t - repeat_at) % (repeat_at - start)
  )
  tokens = jnp.take_along_axis(order, source, axis=1)
  return tokens, order[:, SEQ_LEN]


def next_after_previous(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Targets and mask of the induction rule, computed from the tokens alone.

  ``targets[b, t]`` is the token that followed the latest earlier
  occurrence of ``tokens[b, t]``; ``mask[b, t]`` says whether there is one.
  """
  t = jnp.arange(tokens.shape[1])
  same = tokens[:, :, None] == tokens[:, None, :]  # [b, t, earlier s]
  earlier = same & (t[None, None, :] < t[None, :, None])
  mask = earlier.any(-1)
  previous = jnp.max(jnp.where(earlier, t, -1), axis=-1)
  follower = jnp.clip(previous + 1, 0, tokens.shape[1] - 1)
  targets = jnp.take_along_axis(tokens, follower, axis=1)
  return targets, mask


def training_batch(key: jax.Array, batch: int):
  """A batch with a random layout per sequence: (tokens, targets, mask)."""
  k_repeat, k_start, k_tokens = jax.random.split(key, 3)
  # The repeat starts after 6..16 distinct tokens, from 4..19 positions
  # before the end, with a period of at least 2: the distance back to the
  # previous occurrence varies, so the model cannot answer from positions
  # alone.
  repeat_at = jax.random.randint(k_repeat, (batch,), 6, SEQ_LEN - 3)
  start = jax.random.randint(k_start, (batch,), 0, repeat_at - 1)
  tokens, _ = induction_tokens(k_tokens, batch, repeat_at, start)
  targets, mask = next_after_previous(tokens)
  return tokens, targets, mask


def patching_prompts(key: jax.Array, batch: int):
  """Clean and corrupted prompts and their answers A and B, each (batch,)."""
  full = lambda v: jnp.full((batch,), v)
  clean, spare = induction_tokens(
      key, batch, full(PROMPT_REPEAT), full(PROMPT_START)
  )
  answer = clean[:, CORRUPTED_POS]
  corrupted = clean.at[:, CORRUPTED_POS].set(spare)
  return clean, corrupted, answer, spare


# ---------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------


def mark(x: jax.Array, layer: int) -> jax.Array:
  """Marks the residual stream after ``layer`` layers; returns it unchanged.

  One marker per site: ``capture`` collects the value under
  ``('resid', layer)`` and ``intervene`` replaces it there; with
  ``grad=True``, ``capture(jax.grad(...))`` also collects the gradient with
  respect to it, under ``grad_name(('resid', layer))``.
  """
  return sow(x, name=('resid', layer), grad=True)


class AttentionLayer(nnx.Module):
  """Pre-LayerNorm causal self-attention added to the residual stream."""

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(d_model, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=num_heads,
        in_features=d_model,
        decode=False,
        rngs=rngs,
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:-1], jnp.int32))
    return x + self.attention(self.norm(x), mask=mask)


class Transformer(nnx.Module):
  """Token and position embeddings, attention-only layers, an unembedding."""

  def __init__(
      self, *, d_model: int, num_heads: int, num_layers: int, rngs: nnx.Rngs
  ):
    self.embed = nnx.Embed(VOCAB, d_model, rngs=rngs)
    self.position = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, d_model))
    )
    self.layers = nnx.List(
        [
            AttentionLayer(d_model, num_heads, rngs=rngs)
            for _ in range(num_layers)
        ]
    )
    self.norm = nnx.LayerNorm(d_model, rngs=rngs)
    self.unembed = nnx.Linear(d_model, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """(batch, seq) int tokens -> (batch, seq, vocab) logits."""
    x = self.embed(tokens) + self.position[: tokens.shape[1]]
    x = mark(x, 0)
    for i, layer in enumerate(self.layers):
      x = mark(layer(x), i + 1)
    return self.unembed(self.norm(x))


# ---------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(mask, values, 0)) / jnp.maximum(mask.sum(), 1)


def loss_fn(model: Transformer, tokens, targets, mask):
  logits = model(tokens)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return masked_mean(losses, mask), logits


@nnx.jit(static_argnums=3)
def train_step(model, optimizer, key, batch: int):
  tokens, targets, mask = training_batch(key, batch)
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, tokens, targets, mask)
  optimizer.update(model, grads)
  accuracy = masked_mean(logits.argmax(-1) == targets, mask)
  return {'loss': loss, 'accuracy': accuracy}


@nnx.jit(static_argnums=2)
def induction_accuracy(model: Transformer, key: jax.Array, batch: int):
  """Accuracy on the induction positions of a fresh batch."""
  tokens, targets, mask = training_batch(key, batch)
  return masked_mean(model(tokens).argmax(-1) == targets, mask)


# ---------------------------------------------------------------------------
# Activation patching and attribution patching.
# ---------------------------------------------------------------------------


def logit_difference(logits, answer, spare) -> jax.Array:
  """Mean over prompts of logit(A) - logit(B) at the final position."""
  final = logits[:, -1]
  pick = lambda tok: jnp.take_along_axis(final, tok[:, None], axis=1)[:, 0]
  return jnp.mean(pick(answer) - pick(spare))


@nnx.jit
def patching_maps(model: Transformer, clean, corrupted, answer, spare):
  """Activation- and attribution-patching maps, each (layers + 1, seq).

  Cell (l, p) is the fraction of the clean logit difference recovered when
  the corrupted run gets the clean residual stream after ``l`` layers at
  position ``p`` (0 = corrupted, 1 = clean).
  """
  num_marks = len(model.layers) + 1
  names = [('resid', layer) for layer in range(num_marks)]

  def metric(model, tokens):
    return logit_difference(model(tokens), answer, spare)

  # Both residual streams, in the layout capture returns:
  # {('resid', l): (array (batch, seq, d_model),)}.
  clean_diff, clean_resid = capture(metric)(model, clean)
  corrupted_diff, corrupted_resid = capture(metric)(model, corrupted)
  recovered = lambda diff: (diff - corrupted_diff) / (
      clean_diff - corrupted_diff
  )

  # Activation patching: cell (l, p) runs the corrupted prompts with the
  # residual stream after l layers taking its clean value at position p
  # (axis 1 of (batch, seq, d_model)); every cell is one batched run.
  activation = recovered(
      patching_grid(metric, names, clean_resid, axis=1)(model, corrupted)
  )

  # Attribution patching: one backward pass on the corrupted prompts. The
  # markers' grad=True collects d metric / d residual; the first-order change of
  # the metric when cell (l, p) gets its clean value is the dot product of
  # that gradient with (clean - corrupted), summed over d_model and over the
  # prompts (the metric is their mean, so the gradient carries the 1/batch).
  _, grads = capture(nnx.grad(metric))(model, corrupted)
  rows = []
  for layer, name in enumerate(names):
    (grad,) = grads[grad_name(name)]
    (clean_x,) = clean_resid[name]
    (corrupted_x,) = corrupted_resid[name]
    estimate = jnp.sum((clean_x - corrupted_x) * grad, axis=(0, 2))
    rows.append(estimate / (clean_diff - corrupted_diff))
  attribution = jnp.stack(rows)
  return {
      'activation': activation,
      'attribution': attribution,
      'clean_diff': clean_diff,
      'corrupted_diff': corrupted_diff,
  }


# ---------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------


def flow(
    activation: np.ndarray, attribution: np.ndarray, threshold: float
) -> list[str]:
  """One line per residual stream: the cells that recover at least
  ``threshold`` of the logit difference under activation patching."""
  lines = []
  for layer, row in enumerate(activation):
    cells = [
        f'position {pos}: {row[pos]:.2f} (attribution'
        f' {attribution[layer, pos]:.2f})'
        for pos in np.argsort(-np.abs(row))
        if abs(row[pos]) >= threshold
    ]
    lines.append(f'{layer_label(layer):>13}: ' + (', '.join(cells) or '-'))
  return lines


def layer_label(layer: int) -> str:
  return 'embedding' if layer == 0 else f'after layer {layer}'


def plot(activation: np.ndarray, attribution: np.ndarray, path: str) -> None:
  limit = max(1.0, float(np.abs(activation).max()))
  limit = max(limit, float(np.abs(attribution).max()))
  fig, axes = plt.subplots(
      1, 2, figsize=(13, 3.4), sharey=True, layout='constrained'
  )
  panels = [
      (activation, 'activation patching (intervene)'),
      (attribution, 'attribution patching (perturb gradient)'),
  ]
  for ax, (grid, title) in zip(axes, panels):
    image = ax.imshow(grid, cmap='RdBu', vmin=-limit, vmax=limit, aspect='auto')
    ax.set_title(title)
    ax.set_xlabel(f'position (prompts differ at {CORRUPTED_POS})')
    ax.set_xticks(range(grid.shape[1]))
  axes[0].set_yticks(
      range(activation.shape[0]),
      [layer_label(layer) for layer in range(activation.shape[0])],
  )
  axes[0].set_ylabel('residual stream')
  fig.colorbar(image, ax=axes, label='logit difference recovered')
  fig.savefig(path, dpi=90)
  plt.close(fig)


def parse_args(argv: tp.Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=(
          'Train a two-layer attention-only NNX transformer on an induction'
          ' task, then map where it carries the answer with activation'
          ' patching (intervene) and attribution patching (perturb).'
      )
  )
  parser.add_argument(
      '--steps',
      type=int,
      default=None,
      help='training steps (default 800, or 400 with --quick)',
  )
  parser.add_argument(
      '--quick',
      action='store_true',
      help='a short run for smoke tests: fewer steps and prompts',
  )
  parser.add_argument('--batch-size', type=int, default=64)
  parser.add_argument(
      '--learning-rate', type=float, default=5e-3, help='Adam step size'
  )
  parser.add_argument('--d-model', type=int, default=64)
  parser.add_argument('--heads', type=int, default=4)
  parser.add_argument(
      '--prompts',
      type=int,
      default=None,
      help=(
          'clean/corrupted prompt pairs in the patching experiment (default'
          ' 128, or 32 with --quick)'
      ),
  )
  parser.add_argument(
      '--seed', type=int, default=0, help='seed for parameters and data'
  )
  parser.add_argument(
      '--out',
      metavar='PATH',
      default='activation_patching.png',
      help=(
          'where to write the PNG with the two heatmaps (default: %(default)s'
          ' in the current directory)'
      ),
  )
  parser.add_argument(
      '--no-progress', action='store_true', help='hide the progress bar'
  )
  args = parser.parse_args(argv)
  if args.steps is None:
    args.steps = 400 if args.quick else 800
  if args.prompts is None:
    args.prompts = 32 if args.quick else 128
  return args


def main(argv: tp.Sequence[str] | None = None) -> dict[str, tp.Any]:
  """Runs the example; returns the model, the prompts, both maps and the
  correlation between them."""
  args = parse_args(argv)
  start = time.perf_counter()
  key = jax.random.key(args.seed)
  init_key, train_key, eval_key, prompt_key = jax.random.split(key, 4)

  model = Transformer(
      d_model=args.d_model,
      num_heads=args.heads,
      num_layers=2,
      rngs=nnx.Rngs(init_key),
  )
  optimizer = nnx.Optimizer(
      model, optax.adam(args.learning_rate), wrt=nnx.Param
  )
  # The model and optimizer graph is traversed once here, not on every call.
  step = nnx.cached_partial(train_step, model, optimizer)
  with tqdm(
      jax.random.split(train_key, args.steps),
      desc='training',
      disable=args.no_progress,
  ) as bar:
    for i, step_key in enumerate(bar):
      metrics = step(step_key, args.batch_size)
      if i % 25 == 0 or i == args.steps - 1:
        bar.set_postfix(
            loss=f'{float(metrics["loss"]):.3f}',
            acc=f'{float(metrics["accuracy"]):.2f}',
        )
  accuracy = float(induction_accuracy(model, eval_key, 1024))
  trained = time.perf_counter()

  prompts = patching_prompts(prompt_key, args.prompts)
  maps = jax.device_get(patching_maps(model, *prompts))
  activation, attribution = maps['activation'], maps['attribution']
  correlation = float(
      np.corrcoef(activation.ravel(), attribution.ravel())[0, 1]
  )
  out = os.path.abspath(args.out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  plot(activation, attribution, out)
  done = time.perf_counter()

  print(
      f'trained {args.steps} steps in {trained - start:.1f} s; accuracy on'
      f' the induction positions of 1024 new sequences: {accuracy:.3f}'
  )
  print(
      f'logit(A) - logit(B) at the final position {SEQ_LEN - 1}, mean over'
      f' {args.prompts} prompts: clean {float(maps["clean_diff"]):.2f},'
      f' corrupted {float(maps["corrupted_diff"]):.2f}'
  )
  print(
      'where the information flows (logit difference recovered by patching'
      ' one residual-stream cell from the clean run into the corrupted one):'
  )
  for line in flow(activation, attribution, threshold=0.05):
    print('  ' + line)
  print(
      'correlation between activation and attribution patching:'
      f' {correlation:.3f}'
  )
  print(f'patching maps computed in {done - trained:.1f} s')
  print(f'figure written to {out}')
  return {
      'model': model,
      'prompts': prompts,
      'accuracy': accuracy,
      'activation': activation,
      'attribution': attribution,
      'correlation': correlation,
      'clean_diff': float(maps['clean_diff']),
      'corrupted_diff': float(maps['corrupted_diff']),
      'out': out,
  }


if __name__ == '__main__':
  main()
