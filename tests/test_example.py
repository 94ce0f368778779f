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

"""Tests for examples/train_digits.py with a tiny budget.

The full run (and its accuracy) stays out of the suite; here the example runs
one epoch on a small subset, and one train step is checked against the same
statistics computed by hand from a plain forward pass without any capture.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import nnx
from matplotlib import image as mpl_image

ROOT = pathlib.Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def load_example():
  name = 'train_digits_example'
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(
      name, ROOT / 'examples' / 'train_digits.py'
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def numpy_stats(h: np.ndarray) -> dict[str, float]:
  """Mean, std and dead-unit fraction, written again with NumPy."""
  h = np.asarray(h, np.float64)
  units = h.reshape(-1, h.shape[-1])
  dead = (units <= 0).all(axis=0)
  return {'mean': h.mean(), 'std': h.std(), 'dead': dead.mean()}


def plain_forward(model, x):
  """The model's forward pass layer by layer, returning every activation."""
  h1 = nnx.relu(model.conv1.bn(model.conv1.conv(x)))
  h2 = nnx.relu(model.conv2.bn(model.conv2.conv(h1)))
  pooled = nnx.avg_pool(h2, window_shape=(2, 2), strides=(2, 2))
  h3 = nnx.relu(model.dense.linear(pooled.reshape(x.shape[0], -1)))
  return h1, h2, h3


class ExampleRunTest(absltest.TestCase):

  def test_tiny_run_writes_png_and_finite_statistics(self):
    example = load_example()
    with tempfile.TemporaryDirectory() as tmp:
      out = pathlib.Path(tmp) / 'figure.png'
      stdout = io.StringIO()
      with contextlib.redirect_stdout(stdout):
        result = example.main(
            [
                '--epochs=1',
                '--limit=160',
                '--batch-size=32',
                '--seed=3',
                f'--out={out}',
                '--no-progress',
            ]
        )
      data = out.read_bytes()
      self.assertEqual(data[:8], PNG_SIGNATURE)
      pixels = mpl_image.imread(out)
      self.assertEqual(pixels.ndim, 3)
      self.assertGreater(pixels.shape[0], 100)
      self.assertGreater(pixels.shape[1], 400)
      # Not a blank canvas.
      self.assertGreater(float(pixels[..., :3].std()), 0.01)

    printed = stdout.getvalue()
    self.assertIn('test accuracy: ', printed)
    self.assertIn(f'figure written to {out}', printed)
    self.assertEqual(result['out'], str(out))
    # What is timed is said: the training loop, apart from the whole run.
    self.assertIn('training loop: 5 steps in ', printed)
    self.assertIn('which compiles train_step', printed)

    history = result['history']
    steps = 160 // 32
    for layer in ('conv1', 'conv2', 'dense'):
      for key in ('mean', 'std', 'dead', 'grad_norm'):
        values = history[f'{layer}/{key}']
        self.assertEqual(values.shape, (steps,), f'{layer}/{key}')
        self.assertTrue(np.isfinite(values).all(), f'{layer}/{key}')
      self.assertTrue((history[f'{layer}/std'] > 0).all())
      self.assertTrue((history[f'{layer}/grad_norm'] > 0).all())
      dead = history[f'{layer}/dead']
      self.assertTrue(((dead >= 0) & (dead <= 1)).all())
    total = history['dead_units']
    self.assertEqual(total.dtype, np.int32)
    self.assertTrue(((total >= 0) & (total <= 16 + 32 + 64)).all())
    self.assertTrue(np.isfinite(history['loss']).all())
    self.assertBetween(result['test_accuracy'], 0.0, 1.0)

  def test_help_names_the_flags(self):
    example = load_example()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), self.assertRaises(SystemExit):
      example.parse_args(['--help'])
    for flag in ('--epochs', '--seed', '--out', '--limit'):
      self.assertIn(flag, stdout.getvalue())

  def test_figure_defaults_to_the_current_directory(self):
    # The rule all three examples share: <example name>.png, here.
    example = load_example()
    self.assertEqual(example.parse_args([]).out, 'train_digits.png')
    self.assertEqual(example.parse_args(['--out', 'a/b.png']).out, 'a/b.png')


class ExampleStatisticsTest(absltest.TestCase):
  """One step's captured values against a hand-written plain forward pass."""

  def setUp(self):
    super().setUp()
    self.example = load_example()
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (24, 8, 8, 1)).astype(np.float32)
    # A few exactly-zero images make some ReLUs dead on part of the batch.
    x[:4] = 0.0
    self.x = x
    self.y = rng.integers(0, 10, 24).astype(np.int32)

  def test_train_step_statistics_match_plain_forward(self):
    model = self.example.CNN(rngs=nnx.Rngs(1))
    model.train()
    # BatchNorm in training mode uses batch statistics, so a copy of the
    # model sees the same activations as the train step does.
    reference = nnx.clone(model)
    h1, h2, h3 = plain_forward(reference, self.x)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    metrics = self.example.train_step(model, optimizer, self.x, self.y)

    for layer, h in (('conv1', h1), ('conv2', h2), ('dense', h3)):
      expected = numpy_stats(np.asarray(h))
      for key, value in expected.items():
        np.testing.assert_allclose(
            metrics[f'{layer}/{key}'],
            value,
            rtol=1e-4,
            atol=1e-6,
            err_msg=f'{layer}/{key}',
        )
    dead_total = sum(
        int((np.asarray(h).reshape(-1, h.shape[-1]) <= 0).all(0).sum())
        for h in (h1, h2, h3)
    )
    self.assertEqual(int(metrics['dead_units']), dead_total)
    # The step's state updates reached the caller's model: new parameters
    # and BatchNorm running statistics (initialised to zero).
    self.assertFalse(
        np.allclose(
            model.conv1.conv.kernel.get_value(),
            reference.conv1.conv.kernel.get_value(),
        )
    )
    self.assertFalse(np.allclose(model.conv1.bn.mean.get_value(), 0.0))

  def test_activation_gradients_match_jax_grad(self):
    model = self.example.CNN(rngs=nnx.Rngs(2))
    # Evaluation mode: no dropout, BatchNorm with running statistics, so the
    # loss is a plain function of each activation.
    model.eval()
    h1, h2, h3 = plain_forward(model, self.x)

    def head_loss(h3):
      logits = model.head(h3)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, self.y
      ).mean()

    def from_h2(h2):
      pooled = nnx.avg_pool(h2, window_shape=(2, 2), strides=(2, 2))
      h3 = nnx.relu(model.dense.linear(pooled.reshape(h2.shape[0], -1)))
      return head_loss(h3)

    def from_h1(h1):
      return from_h2(nnx.relu(model.conv2.bn(model.conv2.conv(h1))))

    expected = {
        'conv1': jax.grad(from_h1)(h1),
        'conv2': jax.grad(from_h2)(h2),
        'dense': jax.grad(head_loss)(h3),
    }
    expected_loss = head_loss(h3)

    grad_fn = nnx.value_and_grad(self.example.loss_fn, has_aux=True)
    ((loss, _), _), collected = self.example.capture(grad_fn)(
        model, jnp.asarray(self.x), jnp.asarray(self.y)
    )
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for layer, cotangent in expected.items():
      (got,) = collected[(layer, 'grad')]
      self.assertEqual(got.shape, cotangent.shape)
      np.testing.assert_allclose(
          got, cotangent, rtol=1e-4, atol=1e-7, err_msg=layer
      )


if __name__ == '__main__':
  absltest.main()
