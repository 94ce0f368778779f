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
from absl.testing import parameterized
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import grad_name
from flax.nnx.sow import intervene
from flax.nnx.sow import perturb
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


def _sowing(x):
  return sow(x, name='h', grad=True)


# One program per construct around the sow: f(x) with x float32[4, 3]; each
# returns what the program gives when the sown value v is replaced by
# scale * v, computed by hand (the sow is linear in x here, so the result is
# the plain program's at scale * x, except where f differentiates).
def _plain(x):
  return jnp.sum(_sowing(x) ** 2)


def _jit(x):
  return jax.jit(lambda y: jnp.sum(_sowing(y) ** 2))(x)


def _scan(x):
  def body(c, row):
    return c + jnp.sum(_sowing(row) ** 2), None

  return lax.scan(body, 0.0, x)[0]


def _vmap(x):
  return jnp.sum(jax.vmap(lambda r: jnp.sum(_sowing(r) ** 2))(x))


def _vmap_of_scan(x):
  def one(col):  # float32[4]
    def body(c, xi):
      return c + _sowing(xi) ** 2, None

    return lax.scan(body, 0.0, col)[0]

  return jnp.sum(jax.vmap(one, in_axes=1)(x))


def _cond_on_a_batched_predicate(x):
  def one(r):
    return lax.cond(
        r[0] > 5.0,
        lambda y: jnp.sum(_sowing(y) ** 2),
        lambda y: jnp.sum(_sowing(y) ** 2),
        r,
    )

  return jnp.sum(jax.vmap(one)(x))


def _checkpoint(x):
  return jax.checkpoint(lambda y: jnp.sum(_sowing(y) ** 2))(x)


def _grad_inside(x):
  # d/dx sum((s x)^2) = 2 s^2 x under the replacement v -> s v: summed,
  # 2 s^2 sum(x).
  return jnp.sum(jax.grad(lambda y: jnp.sum(_sowing(y) ** 2))(x))


_PROGRAMS = (
    ('plain', _plain),
    ('jit', _jit),
    ('scan', _scan),
    ('vmap', _vmap),
    ('vmap_of_scan', _vmap_of_scan),
    ('cond_on_a_batched_predicate', _cond_on_a_batched_predicate),
    ('checkpoint', _checkpoint),
    ('grad_inside', _grad_inside),
)


def _expected(name, x, scale):
  x = np.asarray(x, np.float64)
  if name == 'grad_inside':
    return 2 * scale**2 * x.sum()
  return (scale**2) * (x**2).sum()


class GradNameIsNotAValueTest(parameterized.TestCase):
  """The name ``sow(..., grad=True)`` collects the gradient under holds
  cotangents: ``intervene`` refuses it as a key and hooks do not see it (its
  marker passes the sow's value through, so replacing it replaced the sown
  value a second time, silently)."""

  x = jnp.arange(12.0).reshape(4, 3)

  @parameterized.named_parameters(*_PROGRAMS)
  def test_a_hook_applies_once_per_sow(self, f):
    name = self._testMethodName.split('_sow_')[-1]
    seen = []

    def hook(n, v):
      seen.append(n)
      return 3.0 * v

    for wrap in (lambda g: g, jax.jit):
      seen.clear()
      out = wrap(intervene(f, hook))(self.x)
      np.testing.assert_allclose(
          out, _expected(name, self.x, 3.0), rtol=1e-5
      )
      self.assertEqual(set(seen), {'h'})

  @parameterized.named_parameters(*_PROGRAMS)
  def test_the_gradient_name_as_a_key_raises(self, f):
    name = self._testMethodName.split('_raises_')[-1]
    _, c = capture(f)(self.x)
    entries = c['h']
    for values in (
        {('grad', 'h'): entries},
        {'h': lambda v: v, ('grad', 'h'): entries},
        {('grad', 'h'): lambda v: 0 * v},
    ):
      for wrap in (lambda g: g, jax.jit):
        with self.assertRaisesRegex(
            ValueError,
            r"values has \('grad', 'h'\), the name under which"
            r" sow\(\.\.\., name='h', grad=True\).* use 'h'",
        ):
          wrap(intervene(f, values))(self.x)
    # The sow's own name replaces the value (scaled by 3 here), as before.
    np.testing.assert_allclose(
        intervene(f, {'h': lambda v: 3.0 * v})(self.x),
        _expected(name, self.x, 3.0),
        rtol=1e-5,
    )
    # Arrays are refused (with their own error) in a batched cond or scan.
    if name not in ('cond_on_a_batched_predicate', 'vmap_of_scan'):
      scaled = jax.tree.map(lambda e: 3.0 * e, entries)
      np.testing.assert_allclose(
          intervene(f, {'h': scaled})(self.x),
          _expected(name, self.x, 3.0) if name != 'grad_inside'
          # A constant replacement: its derivative is zero.
          else 0.0,
          rtol=1e-5,
      )

  def test_a_listed_gradient_name_raises(self):
    with self.assertRaisesRegex(ValueError, "names= lists \\('grad', 'h'\\)"):
      intervene(_plain, lambda n, v: v, names=[('grad', 'h')])(self.x)
    # Listing the sow's own name applies the hook there once.
    out = intervene(_plain, lambda n, v: 2.0 * v, names=['h'])(self.x)
    np.testing.assert_allclose(out, _expected('plain', self.x, 2.0))

  def test_a_perturb_of_that_name_stays_replaceable(self):
    # A standalone perturb is a value marker of its own, as documented.
    def f(x):
      return jnp.sum(perturb(x, name=('grad', 'h')) ** 2)

    out = intervene(f, {('grad', 'h'): (2.0 * self.x,)})(self.x)
    np.testing.assert_allclose(out, _expected('plain', self.x, 2.0))
    out = intervene(f, lambda n, v: 2.0 * v)(self.x)
    np.testing.assert_allclose(out, _expected('plain', self.x, 2.0))

  def test_the_cotangent_is_still_collected_after_a_hook(self):
    # grad of sum((3 x)^2) at the replaced value v' = 3 x: 2 v' = 6 x.
    _, c = capture(jax.grad(intervene(_plain, lambda n, v: 3.0 * v)))(self.x)
    np.testing.assert_allclose(c[('grad', 'h')][0], 6.0 * self.x)
    np.testing.assert_allclose(c['h'][0], 3.0 * self.x)


if __name__ == '__main__':
  absltest.main()
