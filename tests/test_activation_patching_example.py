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

"""Tests for examples/activation_patching.py with its --quick budget.

The example trains once; the checks cover the trained model's accuracy, the
PNG, and both patching maps against the same patching written by hand: a
plain layer-by-layer forward pass that takes the patched residual stream as
an argument, with no sow, capture or intervene.
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
from absl.testing import absltest
from matplotlib import image as mpl_image

ROOT = pathlib.Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def load_example():
  name = 'activation_patching_example'
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(
      name, ROOT / 'examples' / 'activation_patching.py'
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def python_induction_targets(tokens: np.ndarray):
  """The induction rule in plain Python: (targets, mask), -1 where none."""
  targets = np.full(tokens.shape, -1)
  for b, row in enumerate(tokens.tolist()):
    for t, token in enumerate(row):
      earlier = [s for s in range(t) if row[s] == token]
      if earlier:
        targets[b, t] = row[earlier[-1] + 1]
  return targets, targets >= 0


class TaskTest(absltest.TestCase):
  """The synthetic data, against the rule written in plain Python."""

  def setUp(self):
    super().setUp()
    self.example = load_example()

  def test_training_batch_targets_follow_the_previous_occurrence(self):
    tokens, targets, mask = self.example.training_batch(jax.random.key(5), 48)
    tokens, targets, mask = map(np.asarray, (tokens, targets, mask))
    expected, expected_mask = python_induction_targets(tokens)
    np.testing.assert_array_equal(mask, expected_mask)
    np.testing.assert_array_equal(targets[mask], expected[mask])
    # Every sequence has at least 4 induction positions, and the distance
    # back to the previous occurrence varies across the batch.
    self.assertTrue((mask.sum(1) >= 4).all())
    period = [
        t - max(s for s in range(t) if row[s] == row[t])
        for row, t in zip(tokens.tolist(), mask.argmax(1))
    ]
    self.assertGreater(len(set(period)), 3)
    self.assertGreaterEqual(min(period), 2)

  def test_prompts_differ_in_the_answer_only(self):
    ex = self.example
    clean, corrupted, answer, spare = map(
        np.asarray, ex.patching_prompts(jax.random.key(7), 16)
    )
    differs = clean != corrupted
    self.assertTrue(differs[:, ex.CORRUPTED_POS].all())
    differs[:, ex.CORRUPTED_POS] = False
    self.assertFalse(differs.any())
    np.testing.assert_array_equal(answer, clean[:, ex.CORRUPTED_POS])
    for row, token in zip(clean, spare):
      self.assertNotIn(token, row)
    # By the induction rule, the final position answers A in the clean
    # prompts and B in the corrupted ones.
    clean_targets, _ = python_induction_targets(clean)
    corrupted_targets, _ = python_induction_targets(corrupted)
    np.testing.assert_array_equal(clean_targets[:, -1], answer)
    np.testing.assert_array_equal(corrupted_targets[:, -1], spare)


class ExampleRunTest(absltest.TestCase):
  """One --quick run of the example, then checks of what it returned.

  The run is one test method (not ``setUpClass``) so that pytest-xdist,
  which may hand a class's methods to different workers, trains once.
  """

  def test_quick_run(self):
    self.example = load_example()
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
      # No --out: the figure goes to activation_patching.png in the current
      # directory, as for the other examples.
      self.out = pathlib.Path.cwd() / 'activation_patching.png'
      stdout = io.StringIO()
      with contextlib.redirect_stdout(stdout):
        self.result = self.example.main(
            ['--quick', '--seed=0', '--no-progress']
        )
      self.assertEqual(self.result['out'], str(self.out))
      self.printed = stdout.getvalue()
      with self.subTest('png and printed summary'):
        self.check_png_and_printed_summary()
    with self.subTest('trained model does induction'):
      self.check_trained_model_does_induction()
    with self.subTest('patching map structure'):
      self.check_patching_map_structure()
    with self.subTest('maps match patching written by hand'):
      self.check_maps_match_patching_written_by_hand()

  def check_trained_model_does_induction(self):
    self.assertGreater(self.result['accuracy'], 0.9)
    # The model answers A on the clean prompts and B on the corrupted ones.
    self.assertGreater(self.result['clean_diff'], 2.0)
    self.assertLess(self.result['corrupted_diff'], -2.0)

  def check_png_and_printed_summary(self):
    self.assertEqual(self.out.read_bytes()[:8], PNG_SIGNATURE)
    pixels = mpl_image.imread(self.out)
    self.assertGreater(pixels.shape[1], 2 * pixels.shape[0])  # side by side
    self.assertGreater(float(pixels[..., :3].std()), 0.01)
    for text in (
        'accuracy on the induction positions',
        'where the information flows',
        'after layer 2: position 19: 1.00',
        'correlation between activation and attribution patching: ',
        f'figure written to {self.out}',
    ):
      self.assertIn(text, self.printed)

  def check_patching_map_structure(self):
    ex = self.example
    activation = self.result['activation']
    attribution = self.result['attribution']
    self.assertEqual(activation.shape, (3, ex.SEQ_LEN))
    self.assertEqual(attribution.shape, (3, ex.SEQ_LEN))
    self.assertTrue(np.isfinite(activation).all())
    self.assertTrue(np.isfinite(attribution).all())
    # The clean embedding at the changed position, or the clean last
    # residual stream at the final position, restore the clean run.
    self.assertAlmostEqual(activation[0, ex.CORRUPTED_POS], 1.0, delta=1e-3)
    self.assertAlmostEqual(activation[-1, -1], 1.0, delta=1e-3)
    # Before the changed position the runs agree (attention is causal), so
    # patching there changes nothing; so does patching any other embedding,
    # and any last-layer position but the final one.
    np.testing.assert_allclose(activation[:, : ex.CORRUPTED_POS], 0, atol=1e-5)
    rest = np.delete(activation[0], ex.CORRUPTED_POS)
    np.testing.assert_allclose(rest, 0, atol=1e-5)
    np.testing.assert_allclose(activation[-1, :-1], 0, atol=1e-5)
    # After the first layer the answer still sits at the changed position,
    # where the second layer's induction head reads it.
    self.assertGreater(activation[1, ex.CORRUPTED_POS], 0.5)
    # The first-order estimate ranks the cells alike.
    self.assertTrue(np.isfinite(self.result['correlation']))
    self.assertGreater(self.result['correlation'], 0.8)

  def check_maps_match_patching_written_by_hand(self):
    model = self.result['model']
    clean, corrupted, answer, spare = self.result['prompts']
    num_layers = len(model.layers)

    def residuals(tokens):
      xs = [model.embed(tokens) + model.position[...]]
      for layer in model.layers:
        xs.append(layer(xs[-1]))
      return xs

    @jax.jit
    def from_residual(x, layer_index):
      # The rest of the forward pass from the residual stream after
      # ``layer_index`` layers, which is the argument here.
      for i in range(num_layers):
        x = jnp.where(i >= layer_index, model.layers[i](x), x)
      logits = model.unembed(model.norm(x))
      final = logits[:, -1]
      diff = final[jnp.arange(len(answer)), answer]
      return jnp.mean(diff - final[jnp.arange(len(spare)), spare])

    clean_xs, corrupted_xs = residuals(clean), residuals(corrupted)
    clean_diff = from_residual(clean_xs[0], 0)
    corrupted_diff = from_residual(corrupted_xs[0], 0)
    np.testing.assert_allclose(self.result['clean_diff'], clean_diff, rtol=1e-4)
    np.testing.assert_allclose(
        self.result['corrupted_diff'], corrupted_diff, rtol=1e-4
    )
    scale = clean_diff - corrupted_diff
    for layer in range(num_layers + 1):
      clean_x, corrupted_x = clean_xs[layer], corrupted_xs[layer]
      patched = [
          from_residual(corrupted_x.at[:, p].set(clean_x[:, p]), layer)
          for p in range(clean.shape[1])
      ]
      expected = (np.asarray(patched) - corrupted_diff) / scale
      np.testing.assert_allclose(
          self.result['activation'][layer],
          expected,
          atol=1e-4,
          err_msg=f'activation patching, residual {layer}',
      )
      grad = jax.grad(from_residual)(corrupted_x, layer)
      estimate = jnp.sum((clean_x - corrupted_x) * grad, axis=(0, 2)) / scale
      np.testing.assert_allclose(
          self.result['attribution'][layer],
          estimate,
          atol=1e-4,
          err_msg=f'attribution patching, residual {layer}',
      )

  def test_help_names_the_flags(self):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), self.assertRaises(SystemExit):
      load_example().parse_args(['--help'])
    for flag in ('--steps', '--quick', '--seed', '--out', '--prompts'):
      self.assertIn(flag, stdout.getvalue())

  def test_figure_defaults_to_the_current_directory(self):
    example = load_example()
    self.assertEqual(example.parse_args([]).out, 'activation_patching.png')
    self.assertEqual(example.parse_args(['--out', 'a/b.png']).out, 'a/b.png')


if __name__ == '__main__':
  absltest.main()
