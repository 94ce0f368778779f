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

"""Tests for examples/data_parallel.py with a tiny budget.

The example needs 8 devices; ``conftest.py`` gives the test processes 8
simulated CPU devices. One run of a few steps checks the figure and the
shape of the history; one train step's per-device statistics are checked
against the same statistics computed by hand from a plain forward pass of
the whole batch on one device, cut into the 8 devices' slices.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import sys
import tempfile

import jax
import numpy as np
import optax
from absl.testing import absltest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib import image as mpl_image

ROOT = pathlib.Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'
DEVICES = 8


def load_example():
  name = 'data_parallel_example'
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(
      name, ROOT / 'examples' / 'data_parallel.py'
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def numpy_stats(h: np.ndarray) -> dict[str, float]:
  """Mean, std and dead-unit fraction, written again with NumPy."""
  h = np.asarray(h, np.float64)
  units = h.reshape(-1, h.shape[-1])
  return {
      'mean': h.mean(),
      'std': h.std(),
      'dead': (units <= 0).all(axis=0).mean(),
  }


def plain_forward(model, x):
  """The model layer by layer on one device; BatchNorm over the batch."""
  h1 = nnx.relu(model.conv1.bn(model.conv1.conv(x)))
  h2 = nnx.relu(model.conv2.bn(model.conv2.conv(h1)))
  pooled = nnx.avg_pool(h2, window_shape=(2, 2), strides=(2, 2))
  h3 = nnx.relu(model.dense(pooled.reshape(x.shape[0], -1)))
  return {'conv1': h1, 'conv2': h2, 'dense': h3}


class ExampleRunTest(absltest.TestCase):

  def test_tiny_run_writes_png_and_per_device_history(self):
    example = load_example()
    with tempfile.TemporaryDirectory() as tmp:
      out = pathlib.Path(tmp) / 'figure.png'
      stdout = io.StringIO()
      with contextlib.redirect_stdout(stdout):
        result = example.main(
            [
                '--epochs=1',
                '--limit=128',
                '--batch-size=32',
                '--seed=3',
                f'--out={out}',
                '--no-progress',
            ]
        )
      self.assertEqual(out.read_bytes()[:8], PNG_SIGNATURE)
      pixels = mpl_image.imread(out)
      self.assertGreater(pixels.shape[0], 300)
      self.assertGreater(pixels.shape[1], 800)
      self.assertGreater(float(pixels[..., :3].std()), 0.01)

    printed = stdout.getvalue()
    self.assertIn(f'figure written to {out}', printed)
    self.assertIn('test accuracy: ', printed)
    self.assertIn('dead units per device: ', printed)
    self.assertEqual(result['out'], str(out))
    self.assertIn('training loop: 4 steps in ', printed)

    history = result['history']
    steps = 128 // 32
    for layer in ('conv1', 'conv2', 'dense'):
      for key in ('mean', 'std', 'dead', 'grad_norm'):
        values = history[f'{layer}/{key}']
        self.assertEqual(values.shape, (steps, DEVICES), f'{layer}/{key}')
        self.assertTrue(np.isfinite(values).all(), f'{layer}/{key}')
      self.assertTrue((history[f'{layer}/std'] > 0).all())
      self.assertTrue((history[f'{layer}/grad_norm'] > 0).all())
      dead = history[f'{layer}/dead']
      self.assertTrue(((dead >= 0) & (dead <= 1)).all())
    self.assertEqual(history['dead_units'].shape, (steps, DEVICES))
    self.assertEqual(history['dead_units'].dtype, np.int32)
    self.assertEqual(history['loss'].shape, (steps,))
    self.assertBetween(result['test_accuracy'], 0.0, 1.0)

  def test_help_names_the_flags(self):
    example = load_example()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), self.assertRaises(SystemExit):
      example.parse_args(['--help'])
    for flag in ('--epochs', '--seed', '--out', '--limit', '--batch-size'):
      self.assertIn(flag, stdout.getvalue())

  def test_figure_defaults_to_the_current_directory(self):
    example = load_example()
    self.assertEqual(example.parse_args([]).out, 'data_parallel.png')
    self.assertEqual(example.parse_args(['--out', 'a/b.png']).out, 'a/b.png')


class ExampleStatisticsTest(absltest.TestCase):

  def test_per_device_statistics_match_a_plain_forward_pass(self):
    example = load_example()
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (64, 8, 8, 1)).astype(np.float32)
    x[:8] = 0.0  # device 0 sees only blank images: more dead units there
    y = rng.integers(0, 10, 64).astype(np.int32)

    model = example.CNN(rngs=nnx.Rngs(1))
    # The same parameters, with BatchNorm over a batch on one device.
    reference = example.CNN(rngs=nnx.Rngs(1), axis_name=None)
    activations = plain_forward(reference, x)

    mesh = example.make_mesh()
    graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    optimizer = optax.adam(1e-3)
    replicated = NamedSharding(mesh, P())
    params, batch_stats = jax.device_put((params, batch_stats), replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    x_sharded, y_sharded = jax.device_put(
        (x, y), NamedSharding(mesh, P('data'))
    )
    step = example.make_train_step(graphdef, optimizer, mesh)
    *_, metrics = step(
        params, batch_stats, opt_state, x_sharded, y_sharded, jax.random.key(0)
    )
    metrics = jax.device_get(metrics)

    dead_units = np.zeros(DEVICES, np.int64)
    for layer, h in activations.items():
      shards = np.asarray(h).reshape(DEVICES, 8, *h.shape[1:])
      for d in range(DEVICES):
        expected = numpy_stats(shards[d])
        for key, value in expected.items():
          np.testing.assert_allclose(
              metrics[f'{layer}/{key}'][d],
              value,
              rtol=1e-4,
              atol=1e-5,
              err_msg=f'{layer}/{key} on device {d}',
          )
        units = shards[d].reshape(-1, h.shape[-1])
        dead_units[d] += (units <= 0).all(axis=0).sum()
      self.assertEqual(metrics[f'{layer}/grad_norm'].shape, (DEVICES,))
      self.assertTrue((np.asarray(metrics[f'{layer}/grad_norm']) > 0).all())
    np.testing.assert_array_equal(metrics['dead_units'], dead_units)
    # The statistics really are per device: device 0's blank images differ.
    self.assertGreater(dead_units[0], dead_units[1:].min())


if __name__ == '__main__':
  absltest.main()
