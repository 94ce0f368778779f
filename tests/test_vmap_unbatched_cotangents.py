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

"""Values that a ``jax.vmap`` does not batch: their replacements.

An ``intervene`` around a ``capture`` that does not accept a sow replaces
that sow also where a ``jax.vmap`` around the capture batches it (it was
ignored).

Every expected value is computed without the package: replaced programs by
hand in NumPy.
"""

import warnings

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import sow
from flax.nnx.sow.name_hints import UnusedNameWarning


def assert_close(actual, expected, **kw):
  kw.setdefault('rtol', 1e-5)
  kw.setdefault('atol', 1e-6)
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), **kw)


# ----------------------------------------------------------------------------
# An intervene through a capture that does not accept the sow.


def scan_body_sows(z):
  def body(c, _):
    c = sow(c * 2, name='c')
    return c, None

  return lax.scan(body, z, None, length=3)[0]


def fori_sows(z):
  return lax.fori_loop(0, 3, lambda i, c: sow(c * 2, name='c'), z)


def through_capture(g, wrap=lambda f: f):
  """``g`` inside a capture that collects another name."""

  def f(z):
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', UnusedNameWarning)
      return capture(wrap(g), names=['other'])(z)[0]

  return f


def doubled_three_times(z, fn):
  """``scan_body_sows`` with ``fn`` applied at the sow, by hand."""
  c = np.float32(z)
  for _ in range(3):
    c = fn(c * 2)
  return c


X = np.array([1.0, 2.0], np.float32)
HALF = lambda v: 0.5 * v


class OuterInterveneTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('scan', jax.vmap(through_capture(scan_body_sows))),
      ('fori_loop', jax.vmap(through_capture(fori_sows))),
      ('jit_around', jax.jit(jax.vmap(through_capture(scan_body_sows)))),
      (
          'jit_inside',
          jax.vmap(through_capture(scan_body_sows, wrap=jax.jit)),
      ),
      ('vmap_of_jit', jax.vmap(jax.jit(through_capture(scan_body_sows)))),
  )
  def test_a_callable_in_a_loop(self, g):
    expected = [doubled_three_times(z, HALF) for z in X]
    assert_close(intervene(g, {'c': HALF})(X), expected)
    assert_close(jax.jit(intervene(g, {'c': HALF}))(X), expected)
    assert_close(g(X), [doubled_three_times(z, lambda v: v) for z in X])

  def test_a_capture_around_sees_the_replaced_values(self):
    g = jax.vmap(through_capture(scan_body_sows))
    out, collected = capture(intervene(g, {'c': HALF}))(X)
    assert_close(out, X)  # each step doubles, then halves
    self.assertEqual(list(collected), ['c'])
    assert_close(collected['c'][0], np.broadcast_to(X[:, None], (2, 3)))

  def test_arrays_in_a_loop_raise(self):
    # As without the inner capture: capture's layout of a sow in a loop
    # under vmap cannot be told from the body, so a callable is asked for.
    g = jax.vmap(through_capture(scan_body_sows))
    with self.assertRaisesRegex(ValueError, r"sow 'c'.*`lax.scan`.*callable"):
      intervene(g, {'c': (np.zeros((2, 3), np.float32),)})(X)

  @parameterized.named_parameters(
      ('constant', lambda: jnp.float32(3.0)),
      ('closed_over', lambda y=jnp.float32(1.5): y * 2),
  )
  def test_an_unbatched_value(self, make):
    g = jax.vmap(through_capture(lambda z: sow(make(), name='k') * z))
    assert_close(g(X), 3.0 * X)
    for wrap in (lambda f: f, jax.jit):
      assert_close(wrap(intervene(g, {'k': HALF}))(X), 1.5 * X)
      # Arrays in capture's layout: one value per example.
      reps = np.array([10.0, 20.0], np.float32)
      assert_close(wrap(intervene(g, {'k': (reps,)}))(X), reps * X)
      assert_close(
          wrap(intervene(g, {'k': (np.zeros(2, np.float32),)}))(X),
          np.zeros(2),
      )
    # The round trip: the values capture collects give the program back.
    out, collected = capture(g)(X)
    self.assertEqual(collected['k'][0].shape, (2,))
    assert_close(intervene(g, collected)(X), out)
    assert_close(intervene(g, collected, strict=True)(X), 3.0 * X)
    with self.assertRaisesRegex(ValueError, "named 'kk'"):
      intervene(g, {'kk': (reps,)}, strict=True)(X)

  def test_a_batched_predicate(self):
    def inner(z):
      return lax.cond(
          z > 0,
          lambda: sow(z * 2, name='c') + 1,
          lambda: sow(z * 3, name='c') - 1,
      )

    g = jax.vmap(through_capture(inner))
    x = np.array([-1.0, 2.0], np.float32)
    # By hand: -1 takes the second branch, 10 * -3 - 1; 2 the first.
    assert_close(intervene(g, {'c': lambda v: 10 * v})(x), [-31.0, 41.0])
    with self.assertRaisesRegex(ValueError, r"sow 'c'.*`lax.cond`.*callable"):
      intervene(g, {'c': (np.zeros(2, np.float32),)})(x)

  def test_a_capture_that_accepts_the_sow_keeps_it(self):
    # The innermost transform that takes a sow decides: the capture
    # collects it, the intervene never sees it.
    def f(z):
      return capture(scan_body_sows, names=['c'])(z)[0]

    g = jax.vmap(f)
    with self.assertRaisesRegex(ValueError, "no sow .* named 'c'"):
      intervene(g, {'c': HALF})(X)
    assert_close(intervene(g, {'c': HALF}, strict=False)(X), 8 * X)


if __name__ == '__main__':
  absltest.main()
