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

"""``sow(..., grad=True)``: a value and its cotangent from one marker."""

from absl.testing import absltest
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import grad_name
from flax.nnx.sow import intervene
from flax.nnx.sow import sow


def _loss(w, x):
  h = sow(jnp.tanh(w * x), name=('resid', 0), grad=True)
  return jnp.sum(h**2)


class SowGradTest(absltest.TestCase):

  def test_value_and_cotangent_under_their_names(self):
    x = jnp.arange(3.0)
    for wrap in (lambda f: f, jax.jit):
      g, c = wrap(capture(jax.grad(_loss)))(0.5, x)
      h = np.tanh(0.5 * np.arange(3.0))
      self.assertEqual(list(c), [('resid', 0), ('grad', 'resid', 0)])
      self.assertEqual(c.cotangents, frozenset({('grad', 'resid', 0)}))
      np.testing.assert_allclose(c[('resid', 0)][0], h, rtol=1e-6)
      np.testing.assert_allclose(c[grad_name(('resid', 0))][0], 2 * h,
                                 rtol=1e-6)
      # The parameter gradient is the one without the marker.
      np.testing.assert_allclose(
          g, np.sum(2 * h * (1 - h**2) * np.arange(3.0)), rtol=1e-6
      )

  def test_not_differentiated_collects_the_value_only(self):
    _, c = capture(_loss)(0.5, jnp.ones(2))
    self.assertEqual(list(c), [('resid', 0)])

  def test_stacked_in_a_scan(self):
    def loss(x):
      def body(c, xi):
        y = sow(c * xi, name='h', grad=True)
        return y, None

      return lax.scan(body, 1.0, x)[0]

    x = jnp.array([2.0, 3.0, 4.0])
    _, c = capture(jax.grad(loss))(x)
    np.testing.assert_allclose(c['h'][0], [2.0, 6.0, 24.0])
    # d out / d h_i = product of the later factors.
    np.testing.assert_allclose(c[('grad', 'h')][0], [12.0, 4.0, 1.0])

  def test_cotangent_at_an_intervened_value(self):
    x = jnp.arange(3.0)
    loss = intervene(_loss, {('resid', 0): lambda v: 0.5 * v})
    _, c = capture(jax.grad(loss))(0.5, x)
    h = np.tanh(0.5 * np.arange(3.0))
    np.testing.assert_allclose(c[('grad', 'resid', 0)][0], h, rtol=1e-6)
    # A constant replacement does not depend on w: no cotangent reaches it,
    # as for any perturb the differentiated inputs do not reach.
    loss = intervene(_loss, {('resid', 0): (jnp.ones(3),)})
    _, c = capture(jax.grad(loss))(0.5, x)
    self.assertEqual(list(c), [('resid', 0)])  # the replaced value
    np.testing.assert_allclose(c[('resid', 0)][0], np.ones(3))

  def test_reduced_sow_with_grad_is_an_error(self):
    with self.assertRaisesRegex(TypeError, "sow 't': grad=True"):
      sow(1.0, name='t', grad=True, reduce_fn=lambda a, b: a + b,
          init_fn=lambda: 0.0)


if __name__ == '__main__':
  absltest.main()
