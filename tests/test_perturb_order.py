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

"""Cotangents of one name come back in the order of the ``perturb`` calls,
also where the calls go through one cached trace (a ``jax.jit`` or
``jax.checkpoint`` function called several times, or traced in an earlier
capture), whose perturbs then share the ordinal fixed when it was traced.

Expected values: the same program with a zero ``eps_i`` added in place of
each perturb, differentiated with respect to the ``eps`` (the definition of
the cotangent ``perturb`` collects).
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import perturb
from flax.nnx.sow import sow

X = jnp.array([0.1, -0.4])
WRAPS = {'jit': jax.jit, 'checkpoint': jax.checkpoint}


def _layer(mark):
  def layer(x, w):
    return jnp.tanh(mark(x * w))

  return layer


def _program(mark, wrap):
  """Three calls of one wrapped layer, with a perturb before them."""
  layer = wrap(_layer(mark))

  def loss(x):
    h = mark(x * 1.5)
    for w in (2.0, 3.0, -1.0):
      h = layer(h, w)
    return jnp.sum(h * h)

  return loss


def _expected():
  """d loss / d eps_i at eps = 0, the sites in call order."""

  def loss(x, eps):
    h = x * 1.5 + eps[0]
    for i, w in enumerate((2.0, 3.0, -1.0)):
      h = jnp.tanh(h * w + eps[i + 1])
    return jnp.sum(h * h)

  eps = [jnp.zeros_like(X)] * 4
  return jax.grad(loss, argnums=1)(X, eps)


class CachedTraceOrderTest(parameterized.TestCase):

  @parameterized.product(
      wrap=('jit', 'checkpoint'), form=('perturb', 'grad_sow')
  )
  def test_calls_through_one_trace_in_call_order(self, wrap, form):
    if form == 'perturb':
      mark, key = (lambda v: perturb(v, name='p')), 'p'
    else:
      mark, key = (lambda v: sow(v, name='p', grad=True)), ('grad', 'p')
    loss = _program(mark, WRAPS[wrap])
    expected = _expected()
    # The first capture traces the layer; the later ones reuse its trace
    # (with the ordinal of that first trace), eagerly and under jit.
    runs = [capture(jax.grad(loss)), jax.jit(capture(jax.grad(loss)))]
    for run in runs * 2:
      _, collected = run(X)
      self.assertLen(collected[key], 4)
      for got, want in zip(collected[key], expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  def test_a_pullback_applied_twice(self):
    loss = _program(lambda v: perturb(v, name='p'), jax.jit)
    expected = _expected()

    def f(x):
      y, pullback = jax.vjp(loss, x)
      return pullback(jnp.ones_like(y)), pullback(2.0 * jnp.ones_like(y))

    _, collected = capture(f)(X)
    self.assertLen(collected['p'], 8)
    for got, want in zip(collected['p'], [*expected, *(2 * e for e in expected)]):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  def test_perturbs_in_a_cond_called_in_a_python_loop(self):
    # lax.cond caches its branches' traces by function: one pair of branch
    # functions in a Python loop gives the perturbs of the three iterations
    # one ordinal each, eagerly and under jit.
    pos = lambda h: jnp.tanh(perturb(h * 2.0, name='p'))
    neg = lambda h: jnp.sin(perturb(h * 3.0, name='p'))

    def loss(x):
      h = x
      for _ in range(3):
        h = jax.lax.cond(h.sum() > 0, pos, neg, h)
      return jnp.sum(h * h)

    def loss_eps(x, eps):
      h = x
      for e in eps:
        h = jax.lax.cond(
            h.sum() > 0,
            lambda h: jnp.tanh(h * 2.0 + e),
            lambda h: jnp.sin(h * 3.0 + e),
            h,
        )
      return jnp.sum(h * h)

    x = jnp.array([0.3, -0.1])
    expected = jax.grad(loss_eps, argnums=1)(x, [jnp.zeros(2)] * 3)
    for run in (capture(jax.grad(loss)), jax.jit(capture(jax.grad(loss)))):
      for _ in range(2):
        _, collected = run(x)
        self.assertLen(collected['p'], 3)
        for got, want in zip(collected['p'], expected):
          np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  def test_undifferentiated_calls_of_one_trace_raise(self):
    # The second call's input does not depend on x: its perturb gets no
    # cotangent, and both calls share one ordinal, so which call the one
    # cotangent belongs to is unknown: an error, not a guess.
    layer = jax.jit(_layer(lambda v: perturb(v, name='p')))

    def loss(x):
      return jnp.sum(layer(x, 2.0) + layer(jnp.ones(2), 3.0))

    with self.assertRaisesRegex(ValueError, "perturb 'p' is called 2 times"):
      capture(jax.grad(loss))(X)
    # With a name per call, each gets its own entry.
    layer2 = jax.jit(
        lambda x, w, i: jnp.tanh(perturb(x * w, name=('p', i))),
        static_argnums=2,
    )
    loss2 = lambda x: jnp.sum(layer2(x, 2.0, 0) + layer2(jnp.ones(2), 3.0, 1))
    _, collected = capture(jax.grad(loss2))(X)
    np.testing.assert_allclose(
        collected[('p', 0)][0], 1.0 - np.tanh(2.0 * np.asarray(X)) ** 2,
        rtol=1e-5,
    )
    self.assertNotIn(('p', 1), collected)


if __name__ == '__main__':
  absltest.main()
