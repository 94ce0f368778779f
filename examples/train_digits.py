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

"""A training monitor on scikit-learn's handwritten digits.

Trains a small Flax NNX CNN (Conv, BatchNorm, Dropout, Linear) on the 1,797
8x8 digit images bundled with scikit-learn and, inside the same jitted train
step, reads what the network does on the way:

* per-layer activation statistics (mean, std, fraction of dead ReLU units),
  marked with the free ``sow`` in the model code;
* the same statistics for the dense layer through the legacy
  ``self.sow(nnx.Intermediate, ...)`` path, read back with ``nnx.capture``;
* the gradient norm of each layer's activations, marked with ``perturb``;
* the number of dead ReLU units in the whole network, summed over layers in
  the staged program with ``reduce_fn``/``init_fn``.

The model returns logits and nothing else; the statistics come back from
``capture``. The script ends with the test accuracy and writes a figure of the
statistics over training steps to ``train_digits.png`` in the current
directory (``--out PATH`` to change it).

Run ``python examples/train_digits.py --help`` for the flags.
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
from sklearn import datasets, model_selection
from tqdm import tqdm

from flax.nnx.sow import capture, perturb, sow

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)

CONV_LAYERS = ('conv1', 'conv2')
LAYERS = CONV_LAYERS + ('dense',)


# ---------------------------------------------------------------------------
# What is measured. Plain functions of an activation; they run in the graph.
# ---------------------------------------------------------------------------


def dead_units(h: jax.Array) -> jax.Array:
  """Per unit (last axis): True where the ReLU is zero on the whole batch."""
  return jnp.all(h <= 0, axis=tuple(range(h.ndim - 1)))


def activation_stats(h: jax.Array) -> dict[str, jax.Array]:
  """Mean, standard deviation and dead-unit fraction of a ReLU activation."""
  return {'mean': h.mean(), 'std': h.std(), 'dead': dead_units(h).mean()}


def add_count(total: jax.Array, count: jax.Array) -> jax.Array:
  return total + count


def zero_count() -> jax.Array:
  return jnp.zeros((), jnp.int32)


def count_dead(h: jax.Array) -> None:
  """Adds this layer's dead units to the network-wide 'dead_units' count."""
  # A reduced sow: every layer adds its count to one int32 accumulator, so
  # the capture returns a single scalar for the whole network. All sites of
  # one name pass the same two functions (not a fresh lambda per call).
  sow(
      dead_units(h).sum(dtype=jnp.int32),
      name='dead_units',
      reduce_fn=add_count,
      init_fn=zero_count,
  )


def watch(h: jax.Array, layer: str) -> jax.Array:
  """Marks one layer's activation ``h``; returns ``h`` unchanged.

  Outside a ``capture`` every line below is the identity.
  """
  # A plain sow: one entry per call, collected under ('conv1', 'stats').
  sow(activation_stats(h), name=(layer, 'stats'))
  count_dead(h)
  # perturb: the cotangent d(loss)/dh is collected when differentiated.
  return perturb(h, name=(layer, 'grad'))


# ---------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------


class ConvBlock(nnx.Module):
  """Conv 3x3 -> BatchNorm -> ReLU, watched with the free ``sow``."""

  def __init__(self, cin: int, cout: int, *, label: str, rngs: nnx.Rngs):
    self.conv = nnx.Conv(cin, cout, kernel_size=(3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(cout, rngs=rngs)
    self.label = label

  def __call__(self, x: jax.Array) -> jax.Array:
    h = nnx.relu(self.bn(self.conv(x)))
    return watch(h, self.label)


class DenseBlock(nnx.Module):
  """Linear -> ReLU, watched with the legacy ``Module.sow``."""

  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(din, dout, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = nnx.relu(self.linear(x))
    # The NNX style: collected by nnx.capture(..., nnx.Intermediate) under
    # this module's path, {'dense': {'stats': Intermediate((stats,))}}.
    self.sow(nnx.Intermediate, 'stats', activation_stats(h))
    count_dead(h)  # the free style works next to it
    return perturb(h, name=('dense', 'grad'))


class CNN(nnx.Module):
  """Two conv blocks, 2x2 average pooling, a dense block and a linear head."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = ConvBlock(1, 16, label='conv1', rngs=rngs)
    self.conv2 = ConvBlock(16, 32, label='conv2', rngs=rngs)
    self.dense = DenseBlock(4 * 4 * 32, 64, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.head = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.conv2(self.conv1(x))
    x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = self.dense(x.reshape(x.shape[0], -1))
    return self.head(self.dropout(x))


# ---------------------------------------------------------------------------
# Training and evaluation steps.
# ---------------------------------------------------------------------------


def loss_fn(model: CNN, x: jax.Array, y: jax.Array):
  # The legacy path: nnx.capture collects Module.sow(nnx.Intermediate, ...).
  # The free sows and perturbs are not Intermediate-tagged, so they pass
  # through it to the outer capture in train_step.
  logits, intermediates = nnx.capture(model, nnx.Intermediate)(x)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  (dense_stats,) = intermediates['dense']['stats'].get_value()
  return loss, (logits, dense_stats)


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, x, y):
  """One Adam step; returns the loss, accuracy and every watched statistic."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  # capture around the gradient: the perturb cotangents are collected too.
  ((loss, (logits, dense_stats)), grads), collected = capture(grad_fn)(
      model, x, y
  )
  optimizer.update(model, grads)

  stats = {'dense': dense_stats}
  for layer in CONV_LAYERS:
    (stats[layer],) = collected[(layer, 'stats')]
  metrics = {
      'loss': loss,
      'accuracy': (logits.argmax(-1) == y).mean(),
      'dead_units': collected['dead_units'],
  }
  for layer in LAYERS:
    (cotangent,) = collected[(layer, 'grad')]
    metrics[f'{layer}/grad_norm'] = jnp.linalg.norm(cotangent)
    for key, value in stats[layer].items():
      metrics[f'{layer}/{key}'] = value
  return metrics


@nnx.jit
def predict(model: CNN, x: jax.Array) -> jax.Array:
  # Inside a capture the legacy sow leaves nothing behind on the module.
  logits, _ = nnx.capture(model, nnx.Intermediate)(x)
  return logits.argmax(-1)


# ---------------------------------------------------------------------------
# Data, the loop and the figure.
# ---------------------------------------------------------------------------


def load_data(limit: int | None):
  """The digits as (N, 8, 8, 1) float32 in [0, 1], a fixed 75/25 split."""
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      images,
      digits.target.astype(np.int32),
      test_size=0.25,
      random_state=0,
      stratify=digits.target,
  )
  if limit is not None:
    x_train, y_train = x_train[:limit], y_train[:limit]
    x_test, y_test = x_test[:limit], y_test[:limit]
  return x_train, y_train, x_test, y_test


# One colour and line style per layer in every panel, so lines that coincide
# (two layers with no dead units) stay visible: a dashed line over a solid one.
LAYER_STYLES = {
    'conv1': {'color': 'tab:blue', 'linestyle': '-', 'linewidth': 2.4},
    'conv2': {'color': 'tab:orange', 'linestyle': '--', 'linewidth': 1.8},
    'dense': {'color': 'tab:green', 'linestyle': ':', 'linewidth': 2.0},
}
SMOOTHING = 10  # steps in the trailing mean of the gradient-norm panel


def trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
  """Mean of the last ``window`` steps at each step (fewer at the start)."""
  total = np.cumsum(values, axis=0)
  out = total.copy()
  out[window:] = total[window:] - total[:-window]
  counts = np.minimum(np.arange(1, len(values) + 1), window)
  return out / counts


def plot(history: dict[str, np.ndarray], path: str) -> None:
  """Four panels over training steps, every axis labelled, one legend each."""
  fig, axes = plt.subplots(1, 4, figsize=(19, 4.2), layout='constrained')
  ax_std, ax_dead, ax_grad, ax_total = axes

  for layer in LAYERS:
    ax_std.plot(history[f'{layer}/std'], label=layer, **LAYER_STYLES[layer])
  ax_std.set_title('activation std (per batch)')
  ax_std.set_ylabel('standard deviation of the ReLU output')

  for layer in LAYERS:
    dead = 100 * history[f'{layer}/dead']
    ax_dead.plot(
        dead, label=f'{layer} (last: {dead[-1]:.0f}%)', **LAYER_STYLES[layer]
    )
  ax_dead.set_title('dead ReLU units per layer')
  ax_dead.set_ylabel('units zero on the whole batch (%)')
  # Room below 0 so that a layer with no dead units is not hidden by the axis.
  top = max(5.0, 1.1 * max(100 * history[f'{n}/dead'].max() for n in LAYERS))
  ax_dead.set_ylim(-0.04 * top, top)

  for layer in LAYERS:
    norms = history[f'{layer}/grad_norm']
    style = LAYER_STYLES[layer]
    ax_grad.plot(norms, color=style['color'], linewidth=0.8, alpha=0.25)
    # Geometric mean over the last steps: a mean of the logs, as plotted.
    smooth = np.exp(trailing_mean(np.log(norms), SMOOTHING))
    ax_grad.plot(smooth, label=layer, **style)
  ax_grad.set_yscale('log')
  ax_grad.set_title(
      f'activation-gradient norm ({SMOOTHING}-step mean; faint: per step)'
  )
  ax_grad.set_ylabel('||d loss / d activation||  (log scale)')

  ax_total.plot(
      history['dead_units'],
      color='k',
      linewidth=1.6,
      label='conv1 + conv2 + dense',
  )
  ax_total.set_title('dead ReLU units, all layers (reduced in-graph)')
  ax_total.set_ylabel('dead units (count)')
  ax_total.set_ylim(bottom=-0.5)

  for ax in axes:
    ax.set_xlabel('training step')
    ax.legend(fontsize=9, loc='best')
    ax.grid(alpha=0.3)
  fig.savefig(path, dpi=90)
  plt.close(fig)


def parse_args(argv: tp.Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=(
          'Train a small NNX CNN on scikit-learn digits and watch per-layer '
          'activation statistics and activation gradients with '
          'flax.nnx.sow.'
      )
  )
  parser.add_argument(
      '--epochs', type=int, default=12, help='passes over the training set'
  )
  parser.add_argument(
      '--seed',
      type=int,
      default=0,
      help='seed for parameter init, dropout and batch order',
  )
  parser.add_argument(
      '--out',
      metavar='PATH',
      default='train_digits.png',
      help=(
          'where to write the PNG figure of the statistics (default:'
          ' %(default)s in the current directory)'
      ),
  )
  parser.add_argument('--batch-size', type=int, default=64)
  parser.add_argument(
      '--learning-rate', type=float, default=3e-3, help='Adam step size'
  )
  parser.add_argument(
      '--limit',
      type=int,
      default=None,
      help=(
          'use only the first LIMIT training and test images (for quick'
          ' checks; the accuracy is then not meaningful)'
      ),
  )
  parser.add_argument(
      '--no-progress', action='store_true', help='hide the progress bar'
  )
  return parser.parse_args(argv)


def main(argv: tp.Sequence[str] | None = None) -> dict[str, tp.Any]:
  """Runs the example; returns the test accuracy and the per-step history."""
  args = parse_args(argv)
  run_start = time.perf_counter()
  x_train, y_train, x_test, y_test = load_data(args.limit)

  model = CNN(rngs=nnx.Rngs(args.seed))
  optimizer = nnx.Optimizer(
      model, optax.adam(args.learning_rate), wrt=nnx.Param
  )
  order_rng = np.random.default_rng(args.seed)
  batch = min(args.batch_size, len(x_train))
  steps_per_epoch = len(x_train) // batch

  records = []
  model.train()
  # The training loop alone is timed (its first step compiles train_step);
  # loading the data, evaluating and plotting are not.
  loop_start = time.perf_counter()
  first_step = None
  with tqdm(
      total=args.epochs * steps_per_epoch,
      desc='training',
      disable=args.no_progress,
  ) as bar:
    for _ in range(args.epochs):
      perm = order_rng.permutation(len(x_train))
      for i in range(steps_per_epoch):
        idx = perm[i * batch : (i + 1) * batch]
        records.append(train_step(model, optimizer, x_train[idx], y_train[idx]))
        if first_step is None:
          jax.block_until_ready(records[-1])
          first_step = time.perf_counter() - loop_start
        bar.update()
        if i % 5 == 0 or i == steps_per_epoch - 1:
          last = records[-1]
          bar.set_postfix(
              loss=f'{float(last["loss"]):.3f}',
              acc=f'{float(last["accuracy"]):.2f}',
          )

  jax.block_until_ready(records)  # steps still running count as training
  loop_time = time.perf_counter() - loop_start

  history = {
      key: np.asarray([r[key] for r in jax.device_get(records)])
      for key in records[0]
  }
  model.eval()
  predictions = predict(model, x_test)
  accuracy = float((np.asarray(predictions) == y_test).mean())

  out = os.path.abspath(args.out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  plot(history, out)
  run_time = time.perf_counter() - run_start
  print(f'figure written to {out}')
  for layer in LAYERS:
    print(
        f'{layer:>6}: activation std {history[f"{layer}/std"][-1]:.3f}, '
        f'dead {history[f"{layer}/dead"][-1]:.1%}, '
        f'activation-gradient norm {history[f"{layer}/grad_norm"][-1]:.2e}'
    )
  print(
      f'training loop: {len(records)} steps in {loop_time:.1f} s (the first,'
      f' which compiles train_step, {first_step:.1f} s); the whole run,'
      f' with loading the data, evaluating and plotting, {run_time:.1f} s'
  )
  print(
      f'test accuracy: {accuracy:.4f} '
      f'({int(round(accuracy * len(y_test)))}/{len(y_test)})'
  )
  return {'test_accuracy': accuracy, 'history': history, 'out': out}


if __name__ == '__main__':
  main()
