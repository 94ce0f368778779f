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

"""``patching_grid``: activation-patching grids against runs patched by hand."""

from absl.testing import absltest
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import module_outputs
from flax.nnx.sow import patching_grid
from flax.nnx.sow import sow

_W = jax.random.normal(jax.random.key(0), (2, 3, 3)) * 0.8


def _stream(x, patch=None):
  """A two-layer residual stream over positions, x (batch, pos, 3); the
  metric is the last position's sum. ``patch=(layer, pos, value)`` sets the
  stream after ``layer`` layers to ``value`` at ``pos`` (by hand)."""

  def mark(r, layer):
    if patch is not None and patch[0] == layer:
      r = r.at[:, patch[1]].set(patch[2][:, patch[1]])
    return sow(r, name=('resid', layer))

  r = mark(x, 0)
  for layer in range(2):
    h = jnp.tanh(r @ _W[layer])
    r = mark(r + 0.5 * jnp.cumsum(h, axis=1), layer + 1)
  return jnp.sum(r[:, -1] ** 2)


class ResidualGridTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.clean = jax.random.normal(jax.random.key(1), (2, 4, 3))
    self.corrupted = jax.random.normal(jax.random.key(2), (2, 4, 3))
    self.names = [('resid', layer) for layer in range(3)]

  def by_hand(self, acts):
    return np.array([
        [
            _stream(self.corrupted, (layer, pos, acts[name][0]))
            for pos in range(4)
        ]
        for layer, name in enumerate(self.names)
    ])

  def test_layer_by_position_against_runs_patched_by_hand(self):
    _, acts = capture(_stream)(self.clean)
    expected = self.by_hand(acts)
    # Patching the input at every position gives the clean run, and the
    # last layer at the last position too (the metric reads only it).
    self.assertAlmostEqual(expected[2, 3], float(_stream(self.clean)), 4)
    for batch_size in (None, 5):
      g = patching_grid(_stream, self.names, acts, axis=1,
                        batch_size=batch_size)
      for wrap in (lambda h: h, jax.jit):
        grid = wrap(g)(self.corrupted)
        self.assertEqual(grid.shape, (3, 4))
        np.testing.assert_allclose(grid, expected, rtol=1e-5, atol=1e-5)

  def test_negative_axis_and_a_subset_of_rows(self):
    _, acts = capture(_stream)(self.clean)
    grid = patching_grid(_stream, [('resid', 1)], acts, axis=-2)(
        self.corrupted)
    np.testing.assert_allclose(grid, self.by_hand(acts)[1:2], rtol=1e-5,
                               atol=1e-5)

  def test_errors(self):
    _, acts = capture(_stream)(self.clean)
    with self.assertRaisesRegex(ValueError, 'names is empty'):
      patching_grid(_stream, [], acts, axis=1)
    with self.assertRaisesRegex(ValueError, "no entry for 'h'"):
      patching_grid(_stream, ['h'], acts, axis=1)
    two = {('resid', 0): acts[('resid', 0)] * 2}
    with self.assertRaisesRegex(ValueError, 'must hold one entry.*got 2'):
      patching_grid(_stream, [('resid', 0)], two, axis=1)
    with self.assertRaisesRegex(ValueError, 'axis 5 is out of range'):
      patching_grid(_stream, self.names, acts, axis=5)
    uneven = dict(acts)
    uneven[('resid', 1)] = (acts[('resid', 1)][0][:, :3],)
    with self.assertRaisesRegex(ValueError, r'different sizes.*\[3, 4\]'):
      patching_grid(_stream, self.names, uneven, axis=1)


class Block(nnx.Module):

  def __init__(self, rngs):
    self.attn = nnx.MultiHeadAttention(
        num_heads=2, in_features=4, decode=False, rngs=rngs)
    self.mlp = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(x)
    return x + jnp.tanh(self.mlp(x))


class Model(nnx.Module):

  def __init__(self, rngs):
    self.blocks = nnx.List([Block(rngs) for _ in range(2)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return jnp.sum(x[:, -1])


def _model_by_hand(model, x, patch=None):
  """The model with ``patch=(layer, head, z)``: the per-head values that
  layer's output projection mixes get ``z``'s at ``head``."""
  for layer, b in enumerate(model.blocks):
    q, k, v = b.attn.query(x), b.attn.key(x), b.attn.value(x)
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(q.shape[-1])
    z = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(scores), v)
    if patch is not None and patch[0] == layer:
      z = z.at[:, :, patch[1]].set(patch[2][:, :, patch[1]])
    x = x + b.attn.out(z)
    x = x + jnp.tanh(b.mlp(x))
  return jnp.sum(x[:, -1])


class HeadGridTest(absltest.TestCase):

  def test_layer_by_head_on_an_nnx_model(self):
    model = Model(nnx.Rngs(0))
    clean = jax.random.normal(jax.random.key(3), (2, 5, 4))
    corrupted = jax.random.normal(jax.random.key(4), (2, 5, 4))
    is_out = lambda path, m: path[-1:] == ('out',)
    f = module_outputs(lambda m, x: m(x), is_out, inputs=True)
    names = [('blocks', i, 'attn', 'out', '__call__', 'input')
             for i in range(2)]
    _, acts = capture(f)(model, clean)
    expected = np.array([
        [_model_by_hand(model, corrupted, (i, h, acts[names[i]][0]))
         for h in range(2)]
        for i in range(2)
    ])
    g = patching_grid(f, names, acts, axis=-2)
    for wrap in (lambda h: h, nnx.jit):
      grid = wrap(g)(model, corrupted)
      np.testing.assert_allclose(grid, expected, rtol=1e-5, atol=1e-5)
    # The unpatched runs, by hand, are not the grid's cells.
    self.assertGreater(
        np.abs(expected - float(_model_by_hand(model, corrupted))).max(),
        1e-3)


if __name__ == '__main__':
  absltest.main()
