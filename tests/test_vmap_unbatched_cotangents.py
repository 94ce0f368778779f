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

"""Values that a ``jax.vmap`` does not batch: their cotangents and their
replacements.

* A ``perturb`` (or ``sow(..., grad=True)``) of a value that a ``jax.vmap``
  inside the differentiated function does not batch gives one cotangent per
  example, mapped axis first, like a sown value (it was dropped).
* An ``intervene`` around a ``capture`` that does not accept a sow replaces
  that sow also where a ``jax.vmap`` around the capture batches it (it was
  ignored).

Every expected value is computed without the package: the cotangent of a
perturbed value ``v`` as the gradient with respect to ``eps`` in ``v + eps``,
``eps`` one row per example, and replaced programs by hand in NumPy.
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
from flax.nnx.sow import perturb
from flax.nnx.sow import sow
from flax.nnx.sow.name_hints import UnusedNameWarning

W = np.array([1.0, -2.0, 0.5], np.float32)
XS = np.arange(6.0, dtype=np.float32).reshape(2, 3) - 2.0  # 2 examples
STEPS = 4


def assert_close(actual, expected, **kw):
  kw.setdefault('rtol', 1e-5)
  kw.setdefault('atol', 1e-6)
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), **kw)


def at(v, eps, mode):
  """The site: ``perturb(v)`` (``mode='perturb'``), ``sow(v, grad=True)``
  (``'grad'``), or ``v + eps`` without the package (``'eps'``)."""
  if mode == 'eps':
    return v + eps
  if mode == 'grad':
    return sow(v, name='v', grad=True)
  return perturb(v, name='v')


def per_example(fn):
  """``fn(w, xi, ei)`` summed over the examples of a ``jax.vmap``."""
  return lambda w, xs, eps: jax.vmap(lambda xi, ei: fn(w, xi, ei))(
      xs, eps
  ).sum()


def expected_cotangent(loss, eps_shape):
  """d loss / d eps at ``eps = 0``, by plain ``jax.grad``."""
  return jax.grad(lambda e: loss('eps')(jnp.asarray(W), XS, e))(
      jnp.zeros(eps_shape, jnp.float32)
  )


# The losses, each a function of the mode of ``at``.


def plain(mode):
  return per_example(lambda w, x, e: jnp.sum(jnp.sin(at(w * 2, e, mode)) * x))


def vmap_in(wrap):
  def loss(mode):
    return lambda w, xs, eps: wrap(plain(mode))(w, xs, eps)

  return loss


def in_vmap(wrap):
  def loss(mode):
    return per_example(
        lambda w, x, e: wrap(
            lambda w, x, e: jnp.sum(jnp.sin(at(w * 2, e, mode)) * x)
        )(w, x, e)
    )

  return loss


def vmap_in_cond(mode):
  def loss(w, xs, eps):
    return lax.cond(
        w[0] > 0,
        lambda: plain(mode)(w, xs, eps),
        lambda: per_example(
            lambda w, x, e: jnp.sum(jnp.cos(at(w * 3, e, mode)) * x)
        )(w, xs, eps),
    )

  return loss


def cond_in_vmap(predicate):
  def loss(mode):
    def one(w, x, e):
      return lax.cond(
          predicate(w, x),
          lambda: jnp.sum(jnp.sin(at(w * 2, e, mode)) * x),
          lambda: jnp.sum(jnp.cos(at(w * 3, e, mode)) * x),
      )

    return per_example(one)

  return loss


def vmap_in_scan(mode):
  # eps: (steps, examples, 3); the cotangents are stacked per iteration.
  def loss(w, xs, eps):
    def body(c, e):
      out = jax.vmap(lambda xi, ei: jnp.sum(jnp.sin(at(w * c, ei, mode)) * xi))(
          xs, e
      )
      return c + 0.1 * out.sum(), None

    return lax.scan(body, jnp.float32(1.0), eps)[0]

  return loss


def scan_in_vmap(mode):
  # eps: (examples, steps, 3); the backward pass runs on the batched scan,
  # which stacks the cotangents steps first; they come back (examples,
  # steps, 3), laid out as the value the vmap batches.
  def one(w, x, e):
    def body(c, ei):  # 2 w does not vary over the vmap, c does
      return c + 0.1 * c * jnp.sum(jnp.sin(at(w * 2, ei, mode)) * x), None

    return lax.scan(body, jnp.float32(1.0), e)[0]

  return per_example(one)


TWICE_W = np.stack([2 * W] * 2)  # the value sown, one row per example

# (name, loss, shape of eps (the cotangent's layout), the value sown by
# hand, where it is 2 w or 3 w).
CASES = (
    ('plain', plain, (2, 3), TWICE_W),
    ('vmap_in_jit', vmap_in(jax.jit), (2, 3), TWICE_W),
    ('vmap_in_checkpoint', vmap_in(jax.checkpoint), (2, 3), TWICE_W),
    ('jit_in_vmap', in_vmap(jax.jit), (2, 3), TWICE_W),
    ('checkpoint_in_vmap', in_vmap(jax.checkpoint), (2, 3), TWICE_W),
    ('vmap_in_cond', vmap_in_cond, (2, 3), TWICE_W),  # w[0] > 0
    (
        'cond_in_vmap_unbatched_predicate',
        cond_in_vmap(lambda w, x: w[0] > 0),
        (2, 3),
        TWICE_W,
    ),
    (
        # XS[:, 0] is (-2, 1): each example takes its own branch.
        'cond_in_vmap_batched_predicate',
        cond_in_vmap(lambda w, x: x[0] > -1),
        (2, 3),
        np.stack([3 * W, 2 * W]),
    ),
    ('vmap_in_scan', vmap_in_scan, (STEPS, 2, 3), None),
    (
        'scan_in_vmap',
        scan_in_vmap,
        (2, STEPS, 3),
        np.broadcast_to(2 * W, (2, STEPS, 3)),  # sown (examples, steps, ...)
    ),
)

DERIVATIVES = (
    ('grad', lambda f: jax.grad(f)),
    ('value_and_grad', lambda f: lambda w: jax.value_and_grad(f)(w)[1]),
    ('jit_grad', lambda f: jax.jit(jax.grad(f))),
)


SOME = (
    'plain',
    'vmap_in_jit',
    'cond_in_vmap_batched_predicate',
    'scan_in_vmap',
)


class UnbatchedCotangentTest(parameterized.TestCase):

  def test_the_issue(self):
    # d/d(w2) of sum(w2 * xi) is xi: row i of the entry is xs[i].
    def loss(w, x):
      return jax.vmap(lambda xi: jnp.sum(perturb(w * 2, name='w2') * xi))(
          x
      ).sum()

    w, xs = jnp.ones(3), jnp.arange(6.0).reshape(2, 3)
    grad, collected = capture(jax.grad(loss))(w, xs)
    self.assertEqual(list(collected), ['w2'])
    self.assertEqual(collected.cotangents, frozenset({'w2'}))
    (entry,) = collected['w2']
    self.assertEqual(entry.shape, (2, 3))
    assert_close(entry, np.arange(6.0).reshape(2, 3))
    assert_close(grad, 2 * np.arange(6.0).reshape(2, 3).sum(0))

  def test_the_layout_of_intervene_gradients(self):
    # The gradient with respect to intervene's array at the same site has
    # the layout capture gives the cotangent: one row per example.
    def loss(w, site):
      return jax.vmap(lambda xi: jnp.sum(jnp.sin(site(w * 2)) * xi))(XS).sum()

    _, collected = capture(jax.grad(lambda w: loss(w, at_perturb)))(W)
    sown = lambda w: loss(w, lambda v: sow(v, name='v'))
    oracle = jax.grad(lambda r: intervene(sown, {'v': (r,)})(W))(
        jnp.broadcast_to(2 * W, (2, 3))
    )
    self.assertEqual(oracle.shape, (2, 3))
    assert_close(collected['v'][0], oracle)
    assert_close(oracle, np.cos(2 * W) * XS)  # by hand

  def test_an_unbatched_argument(self):
    # vmap(..., in_axes=(0, None)): w reaches the body unbatched.
    def loss(w):
      return jax.vmap(
          lambda xi, w: jnp.sum(jnp.sin(perturb(w, name='v')) * xi),
          in_axes=(0, None),
      )(XS, w).sum()

    _, collected = capture(jax.grad(loss))(W)
    assert_close(collected['v'][0], np.cos(W) * XS)

  def test_nested_vmaps(self):
    xss = np.stack([XS, 2 * XS, 3 * XS])  # (3, 2, 3)

    def loss(w):
      return jax.vmap(
          jax.vmap(lambda xi: jnp.sum(jnp.sin(perturb(w * 2, name='v')) * xi))
      )(xss).sum()

    _, collected = capture(jax.grad(loss))(W)
    assert_close(collected['v'][0], np.cos(2 * W) * xss)

  @parameterized.named_parameters(
      (f'{case[0]}_{d[0]}', *case[1:], d[1])
      for d in DERIVATIVES
      for case in CASES
      # Every construct under grad; the other derivatives on a few.
      if d[0] == 'grad' or case[0] in SOME
  )
  def test_perturb(self, loss, eps_shape, value, derivative):
    del value
    expected = expected_cotangent(loss, eps_shape)
    f = lambda w: loss('perturb')(w, XS, jnp.zeros(eps_shape))
    grad, collected = capture(derivative(f))(W)
    self.assertEqual(list(collected), ['v'])
    self.assertLen(collected['v'], 1)
    self.assertEqual(collected['v'][0].shape, expected.shape)
    assert_close(collected['v'][0], expected)
    # The parameter gradient is the one without the marker.
    assert_close(grad, jax.grad(f)(W))
    assert_close(
        grad,
        jax.grad(lambda w: loss('eps')(w, XS, jnp.zeros(eps_shape)))(W),
    )

  @parameterized.named_parameters(*CASES)
  def test_sow_grad_true(self, loss, eps_shape, value):
    expected = expected_cotangent(loss, eps_shape)
    f = lambda w: loss('grad')(w, XS, jnp.zeros(eps_shape))
    _, collected = capture(jax.grad(f))(W)
    self.assertEqual(list(collected), ['v', ('grad', 'v')])
    self.assertLen(collected['v'], 1)
    self.assertLen(collected[('grad', 'v')], 1)
    self.assertEqual(collected[('grad', 'v')][0].shape, expected.shape)
    assert_close(collected[('grad', 'v')][0], expected)
    if value is not None:  # one row per example, also where w is unbatched
      assert_close(collected['v'][0], value)

  def test_sow_grad_true_the_issue(self):
    def loss(w, x):
      return jax.vmap(
          lambda xi: jnp.sum(sow(w * 2, name='w2', grad=True) * xi)
      )(x).sum()

    w, xs = jnp.ones(3), jnp.arange(6.0).reshape(2, 3)
    _, collected = capture(jax.grad(loss))(w, xs)
    self.assertEqual(list(collected), ['w2', ('grad', 'w2')])
    assert_close(collected['w2'][0], np.full((2, 3), 2.0))
    assert_close(collected[('grad', 'w2')][0], np.arange(6.0).reshape(2, 3))

  def test_differentiated_inside_the_vmap_stays_unbatched(self):
    # A vmap around the differentiation: the cotangent is per example
    # where it is sown, and jacfwd keeps its primal unbatched.
    loss = lambda w, x: jnp.sum(jnp.sin(perturb(w * 2, name='v')) * x)
    _, collected = capture(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(W, XS)
    assert_close(collected['v'][0], np.cos(2 * W) * XS)
    jac, collected = capture(jax.jacfwd(lambda w: loss(w, XS[1])))(W)
    assert_close(jac, 2 * np.cos(2 * W) * XS[1])
    self.assertEqual(list(collected), [])

  def test_out_axes_none_names_the_perturb(self):
    # The value comes back broadcast, so a vmap cannot return what it flows
    # into unbatched: an error naming the perturb, not JAX's alone.
    def f(w):
      return jax.vmap(lambda xi: jnp.sum(perturb(w, name='v')), out_axes=None)(
          XS
      )

    for run in (capture(f), capture(jax.grad(f))):
      with self.assertRaisesRegex(
          ValueError, r"perturb 'v' sits in a `jax.vmap`.*out_axes=None"
      ):
        run(W)
    # Outside a capture the perturb is the identity.
    assert_close(f(W), np.sum(W))


# ----------------------------------------------------------------------------
# An intervene through a capture that does not accept the sow.


def at_perturb(v):
  return perturb(v, name='v')


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
