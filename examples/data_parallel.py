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

"""Data-parallel training, watched per device from inside the sharded step.

The digits CNN of ``train_digits.py`` (Conv, BatchNorm, ReLU twice, average
pooling, a dense block, Dropout, a linear head) trained data-parallel with
``jax.shard_map`` on 8 devices (simulated on the CPU), with ``sow`` and
``perturb`` in the model code. Each device runs the forward and backward
pass on its slice of the batch; ``capture`` returns what was sown there as
arrays with a leading device axis, so every step logs, per layer and per
device:

* the activation statistics (mean, standard deviation, fraction of dead ReLU
  units on that device's examples);
* the norm of the gradient of that device's loss with respect to the
  activation (``perturb``);
* the number of dead ReLU units, summed over layers in the staged program
  with ``reduce_fn``/``init_fn`` (one accumulator per device).

BatchNorm normalises with the statistics of the whole batch (``axis_name``),
and the gradients are averaged over devices, so the model trains as it
would on one device. The script ends with the test accuracy, a table of the
last step's per-device statistics and a figure of the spread over devices
(min-max band, median and the device furthest from it) per layer, written
to ``data_parallel.png`` in the current directory (``--out PATH`` to change
it).

Run ``python examples/data_parallel.py --help`` for the flags.
"""

from __future__ import annotations

import os

DEVICES = 8
_COUNT_FLAG = '--xla_force_host_platform_device_count'
if _COUNT_FLAG not in os.environ.get('XLA_FLAGS', ''):
  # XLA reads this once, when JAX starts its CPU backend: before `import jax`.
  os.environ['XLA_FLAGS'] = (
      f'{os.environ.get("XLA_FLAGS", "")} {_COUNT_FLAG}={DEVICES}'.strip()
  )

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import time  # noqa: E402
import typing as tp  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn import datasets, model_selection  # noqa: E402
from tqdm import tqdm  # noqa: E402

from flax.nnx.sow import capture, perturb, sow  # noqa: E402

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)

LAYERS = ('conv1', 'conv2', 'dense')
STATS = ('mean', 'std', 'dead', 'grad_norm')


# ---------------------------------------------------------------------------
# What is measured: plain functions of one device's activation.
# ---------------------------------------------------------------------------


def dead_units(h: jax.Array) -> jax.Array:
  """Per unit (last axis): True where the ReLU is zero on all the examples."""
  return jnp.all(h <= 0, axis=tuple(range(h.ndim - 1)))


def activation_stats(h: jax.Array) -> dict[str, jax.Array]:
  return {'mean': h.mean(), 'std': h.std(), 'dead': dead_units(h).mean()}


def add_count(total: jax.Array, count: jax.Array) -> jax.Array:
  return total + count


def zero_count() -> jax.Array:
  return jnp.zeros((), jnp.int32)


def watch(h: jax.Array, layer: str) -> jax.Array:
  """Marks one layer's activation; the identity outside a ``capture``.

  Inside the ``shard_map`` body ``h`` is this device's activation, so the
  capture returns each value with a leading axis of one entry per device.
  """
  sow(activation_stats(h), name=(layer, 'stats'))
  sow(
      dead_units(h).sum(dtype=jnp.int32),
      name='dead_units',
      reduce_fn=add_count,
      init_fn=zero_count,
  )
  return perturb(h, name=(layer, 'grad'))


# ---------------------------------------------------------------------------
# The model: train_digits.py's CNN, with BatchNorm over the whole batch.
# ---------------------------------------------------------------------------


class ConvBlock(nnx.Module):
  """Conv 3x3 -> BatchNorm -> ReLU."""

  def __init__(self, cin, cout, *, label, axis_name, rngs: nnx.Rngs):
    self.conv = nnx.Conv(cin, cout, kernel_size=(3, 3), rngs=rngs)
    # axis_name: the batch statistics are averaged over the devices.
    self.bn = nnx.BatchNorm(cout, axis_name=axis_name, rngs=rngs)
    self.label = label

  def __call__(self, x):
    return watch(nnx.relu(self.bn(self.conv(x))), self.label)


class CNN(nnx.Module):
  """Two conv blocks, 2x2 average pooling, a dense block and a linear head.

  ``axis_name=None`` gives the same model for one device (the tests use it
  as the reference).
  """

  def __init__(self, *, rngs: nnx.Rngs, axis_name: str | None = 'data'):
    self.conv1 = ConvBlock(1, 16, label='conv1', axis_name=axis_name, rngs=rngs)
    self.conv2 = ConvBlock(
        16, 32, label='conv2', axis_name=axis_name, rngs=rngs
    )
    self.dense = nnx.Linear(4 * 4 * 32, 64, rngs=rngs)
    self.dropout = nnx.Dropout(0.2)
    self.head = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x, *, rngs: nnx.Rngs | None = None):
    x = self.conv2(self.conv1(x))
    x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = watch(nnx.relu(self.dense(x.reshape(x.shape[0], -1))), 'dense')
    return self.head(self.dropout(x, rngs=rngs))


# ---------------------------------------------------------------------------
# The sharded train step.
# ---------------------------------------------------------------------------


def make_mesh() -> jax.sharding.Mesh:
  if jax.device_count() < DEVICES:
    raise RuntimeError(
        f'this example needs {DEVICES} devices, found {jax.device_count()}:'
        f' JAX was started before XLA_FLAGS={_COUNT_FLAG}={DEVICES} was set.'
        ' Run the script directly, or set the flag before importing jax.'
    )
  return jax.make_mesh((DEVICES,), ('data',), axis_types=(AxisType.Explicit,))


def make_train_step(graphdef, optimizer, mesh):
  """A jitted step: ``(params, batch_stats, opt_state, x, y, key)`` to
  ``(params, batch_stats, opt_state, metrics)``.

  ``metrics`` holds the global loss and accuracy, and per device (a leading
  axis of 8) every layer's statistics and the dead-unit count.
  """

  def device_step(params, batch_stats, x, y, key):
    # One device's slice of the batch; its own dropout key.
    key = jax.random.fold_in(key, jax.lax.axis_index('data'))

    def loss_fn(params, batch_stats):
      # copy=True: fresh Variables at this trace, so BatchNorm may update
      # them under value_and_grad.
      model = nnx.merge(graphdef, params, batch_stats, copy=True)
      logits = model(x, rngs=nnx.Rngs(dropout=key))
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
      return loss.mean(), (logits, nnx.state(model, nnx.BatchStat))

    (loss, (logits, batch_stats)), grads = jax.value_and_grad(
        loss_fn, has_aux=True
    )(params, batch_stats)
    accuracy = (logits.argmax(-1) == y).mean()
    grads, loss, accuracy = jax.lax.pmean((grads, loss, accuracy), 'data')
    return grads, batch_stats, loss, accuracy

  sharded_step = jax.shard_map(
      device_step,
      mesh=mesh,
      in_specs=(P(), P(), P('data'), P('data'), P()),
      out_specs=P(),
  )

  @jax.jit
  def train_step(params, batch_stats, opt_state, x, y, key):
    (grads, batch_stats, loss, accuracy), collected = capture(sharded_step)(
        params, batch_stats, x, y, key
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {
        'loss': loss,
        'accuracy': accuracy,
        'dead_units': collected['dead_units'],  # (devices,)
    }
    for layer in LAYERS:
      (stats,) = collected[(layer, 'stats')]  # each (devices,)
      for key, value in stats.items():
        metrics[f'{layer}/{key}'] = value
      # (devices, examples per device, ...): each device's d(loss)/dh.
      (cotangent,) = collected[(layer, 'grad')]
      per_device = cotangent.reshape(cotangent.shape[0], -1)
      metrics[f'{layer}/grad_norm'] = jnp.linalg.norm(per_device, axis=1)
    return params, batch_stats, opt_state, metrics

  return train_step


@jax.jit
def predict(graphdef, params, batch_stats, x):
  model = nnx.merge(graphdef, params, batch_stats)
  model.eval()  # running BatchNorm statistics, no dropout
  return model(x).argmax(-1)


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


SMOOTHING = 10  # steps in the trailing mean of the gradient-norm panels


def trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
  """Mean of the last ``window`` steps at each step (fewer at the start)."""
  total = np.cumsum(values, axis=0)
  out = total.copy()
  out[window:] = total[window:] - total[:-window]
  counts = np.minimum(np.arange(1, len(values) + 1), window)
  return out / counts.reshape(-1, *([1] * (values.ndim - 1)))


def most_divergent(values: np.ndarray, log: bool = False) -> int:
  """The device whose curve lies furthest from the median, on average.

  ``values`` is ``(steps, devices)``; the distance is relative to the
  median's typical size (or taken between logarithms when ``log``).
  """
  if log:
    values = np.log(values)
  median = np.median(values, axis=1, keepdims=True)
  distance = np.abs(values - median).mean(axis=0)
  return int(np.argmax(distance))


def spread_panel(ax, values, *, color, log=False) -> None:
  """The min-max band over devices, their median and the most divergent one.

  ``values`` is ``(steps, devices)``.
  """
  steps = np.arange(len(values))
  ax.fill_between(
      steps,
      values.min(axis=1),
      values.max(axis=1),
      color=color,
      alpha=0.25,
      linewidth=0,
      label=f'min-max over {values.shape[1]} devices',
  )
  ax.plot(steps, np.median(values, axis=1), color=color, lw=2, label='median')
  d = most_divergent(values, log=log)
  ax.plot(
      steps,
      values[:, d],
      color='crimson',
      lw=1.0,
      label=f'device {d} (on average furthest from the median)',
  )
  if log:
    ax.set_yscale('log')
  ax.legend(fontsize=8, loc='best')


def plot(history: dict[str, np.ndarray], path: str) -> None:
  """Per layer: the spread over devices of the activation std (top row) and
  of the activation-gradient norm (bottom row, smoothed, log scale); then
  the dead-unit count per device and the loss."""
  colors = dict(zip(LAYERS, ('tab:blue', 'tab:orange', 'tab:green')))
  fig, axes = plt.subplots(
      2, 4, figsize=(19, 8), squeeze=False, layout='constrained'
  )
  for c, layer in enumerate(LAYERS):
    ax = axes[0, c]
    spread_panel(ax, history[f'{layer}/std'], color=colors[layer])
    ax.set_title(f'{layer}: activation std per device')
    ax.set_ylabel('standard deviation of the ReLU output')

    ax = axes[1, c]
    norms = history[f'{layer}/grad_norm']  # (steps, devices)
    # Geometric mean over the last steps (a mean of the logs, as plotted).
    smooth = np.exp(trailing_mean(np.log(norms), SMOOTHING))
    spread_panel(ax, smooth, color=colors[layer], log=True)
    ax.set_title(f'{layer}: activation gradient, {SMOOTHING}-step mean')
    ax.set_ylabel('||d device loss / d activation||  (log scale)')

  ax = axes[0, 3]
  spread_panel(ax, history['dead_units'].astype(np.float64), color='0.35')
  ax.set_title('dead ReLU units, all layers (reduced per device)')
  ax.set_ylabel('dead units on the device (count)')

  ax = axes[1, 3]
  loss = history['loss']
  ax.plot(loss, color='k', lw=0.8, alpha=0.3, label='per step')
  ax.plot(
      trailing_mean(loss, SMOOTHING),
      color='k',
      lw=2,
      label=f'{SMOOTHING}-step mean',
  )
  ax.set_title('loss (whole batch, averaged over devices)')
  ax.set_ylabel('cross-entropy')
  ax.legend(fontsize=8, loc='best')

  for ax in axes.flat:
    ax.set_xlabel('training step')
    ax.grid(alpha=0.3)
  fig.savefig(path, dpi=80)
  plt.close(fig)


def parse_args(argv: tp.Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=(
          'Train the digits CNN data-parallel on 8 simulated devices with'
          ' jax.shard_map and log per-layer, per-device activation'
          ' statistics captured inside the sharded step.'
      )
  )
  parser.add_argument(
      '--epochs', type=int, default=10, help='passes over the training set'
  )
  parser.add_argument(
      '--seed', type=int, default=0, help='seed for init, dropout and order'
  )
  parser.add_argument(
      '--out',
      metavar='PATH',
      default='data_parallel.png',
      help=(
          'where to write the PNG figure of the per-device statistics'
          ' (default: %(default)s in the current directory)'
      ),
  )
  parser.add_argument(
      '--batch-size',
      type=int,
      default=64,
      help=f'global batch, split over the {DEVICES} devices',
  )
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
  """Runs the example; returns the test accuracy and the per-step history.

  ``history[f'{layer}/{stat}']`` and ``history['dead_units']`` are
  ``(steps, devices)``; ``history['loss']`` and ``history['accuracy']``
  ``(steps,)``.
  """
  args = parse_args(argv)
  if args.batch_size % DEVICES:
    raise SystemExit(
        f'--batch-size must be a multiple of {DEVICES}, got {args.batch_size}'
    )
  run_start = time.perf_counter()
  mesh = make_mesh()
  x_train, y_train, x_test, y_test = load_data(args.limit)

  model = CNN(rngs=nnx.Rngs(args.seed))
  graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
  optimizer = optax.adam(args.learning_rate)
  replicated = NamedSharding(mesh, P())
  by_device = NamedSharding(mesh, P('data'))
  params, batch_stats = jax.device_put((params, batch_stats), replicated)
  opt_state = jax.device_put(optimizer.init(params), replicated)
  train_step = make_train_step(graphdef, optimizer, mesh)

  order_rng = np.random.default_rng(args.seed)
  dropout_key = jax.random.key(args.seed)
  batch = min(args.batch_size, len(x_train) // DEVICES * DEVICES)
  steps_per_epoch = len(x_train) // batch
  records = []
  # The training loop alone is timed (its first step compiles train_step).
  loop_start = time.perf_counter()
  first_step = None
  with tqdm(
      total=args.epochs * steps_per_epoch,
      desc='training on 8 devices',
      disable=args.no_progress,
  ) as bar:
    for _ in range(args.epochs):
      perm = order_rng.permutation(len(x_train))
      for i in range(steps_per_epoch):
        idx = perm[i * batch : (i + 1) * batch]
        x, y = jax.device_put((x_train[idx], y_train[idx]), by_device)
        key = jax.random.fold_in(dropout_key, len(records))
        params, batch_stats, opt_state, metrics = train_step(
            params, batch_stats, opt_state, x, y, key
        )
        records.append(metrics)
        if first_step is None:
          jax.block_until_ready(metrics)
          first_step = time.perf_counter() - loop_start
        bar.update()
        if i % 5 == 0 or i == steps_per_epoch - 1:
          bar.set_postfix(
              loss=f'{float(metrics["loss"]):.3f}',
              acc=f'{float(metrics["accuracy"]):.2f}',
          )

  jax.block_until_ready(records)  # steps still running count as training
  loop_time = time.perf_counter() - loop_start

  history = {
      key: np.stack([np.asarray(r[key]) for r in jax.device_get(records)])
      for key in records[0]
  }
  test = predict(graphdef, params, batch_stats, jnp.asarray(x_test))
  accuracy = float((np.asarray(test) == y_test).mean())

  out = os.path.abspath(args.out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  plot(history, out)
  run_time = time.perf_counter() - run_start
  print(f'figure written to {out}')
  print('last step, per device (activation std / dead fraction):')
  for layer in LAYERS:
    std, dead = history[f'{layer}/std'][-1], history[f'{layer}/dead'][-1]
    cells = ' '.join(f'{s:.2f}/{d:.0%}' for s, d in zip(std, dead))
    print(f'{layer:>6}: {cells}')
  print(f'dead units per device: {history["dead_units"][-1].tolist()}')
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
