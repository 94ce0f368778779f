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


# ----------------------------------------------------------------------------
# The layout of a cotangent in a loop that a vmap inside the derivative
# batches: as the value's, mapped axes before the step axes of the loops
# inside them.

B1, B2, T_OUT, T_IN = 2, 3, 4, 5
_RNG = np.random.default_rng(7)
_W = np.float32(0.7)


def _site(h, e, mode):
  """The site: ``sow(h, grad=True)``, ``perturb(h)``, or ``h + e`` (by hand:
  the gradient with respect to ``e`` is the cotangent at the site)."""
  if mode == 'sow':
    return sow(h, name='h', grad=True)
  if mode == 'perturb':
    return perturb(h, name=grad_name('h'))
  return h + e


def _scan(body, init, xs, **kwargs):
  return lax.scan(body, init, xs, **kwargs)[0]


def _steps(w, x, e, mode, **kwargs):  # x, e: (T,)
  def body(c, a):
    return _site(jnp.sin(w * a[0] + c), a[1], mode), None

  return _scan(body, 0.0, (x, e), **kwargs)


def _invariant(w, x, e, mode):  # perturbs 2 w, the same in every step
  def body(c, a):
    return c + jnp.sin(_site(w * 2.0, a[1], mode) * a[0]), None

  return _scan(body, 0.0, (x, e))


def _checkpointed(w, x, e, mode):
  @jax.checkpoint
  def body(c, a):
    return _site(jnp.sin(w * a[0] + c), a[1], mode), None

  return _scan(body, 0.0, (x, e))


def _branches(w, x, e, mode):  # a cond on a batched predicate per step
  def body(c, a):
    h = lax.cond(
        a[0] > 0,
        lambda: _site(jnp.sin(w * a[0] + c), a[1], mode),
        lambda: _site(jnp.cos(w * a[0] + c), a[1], mode),
    )
    return h, None

  return _scan(body, 0.0, (x, e))


def _fori(w, x, e, mode):
  return lax.fori_loop(
      0, x.shape[0], lambda i, c: _site(jnp.sin(w * x[i] + c), e[i], mode), 0.0
  )


def _nested(w, x, e, mode):  # x, e: (T_OUT, T_IN)
  def outer(c, a):
    return _steps(w, a[0], a[1], mode) + c, None

  return _scan(outer, 0.0, (x, e))


def _vmap_between(w, x, e, mode):  # x, e: (T_OUT, B2, T_IN)
  def outer(c, a):
    inner = jax.vmap(lambda xi, ei: _steps(w, xi, ei, mode) + c)(a[0], a[1])
    return c + 0.1 * inner.sum(), None

  return _scan(outer, 0.0, (x, e))


def _vmap_inside(w, x, e, mode):  # x, e: (T_OUT, B2): a loop of vmaps
  def body(c, a):
    one = lambda xi, ei: _site(jnp.sin(w * xi + c), ei, mode)
    return c + 0.1 * jax.vmap(one)(a[0], a[1]).sum(), None

  return _scan(body, 0.0, (x, e))


def _per_example(one, vmaps=1):
  def loss(w, xs, eps, mode):
    f = lambda x, e: one(w, x, e, mode)
    for _ in range(vmaps):
      f = jax.vmap(f)
    return f(xs, eps).sum()

  return loss


# (name, loss(w, xs, eps, mode), the layout of xs and of the cotangent)
LAYOUT_CASES = (
    ('scan_in_vmap', _per_example(_steps), (B1, T_OUT)),
    (
        'reverse_scan_in_vmap',
        _per_example(lambda *a: _steps(*a, reverse=True)),
        (B1, T_OUT),
    ),
    ('invariant_perturb', _per_example(_invariant), (B1, T_OUT)),
    ('checkpointed_body', _per_example(_checkpointed), (B1, T_OUT)),
    ('batched_cond_in_body', _per_example(_branches), (B1, T_OUT)),
    ('fori_loop_in_vmap', _per_example(_fori), (B1, T_OUT)),
    ('nested_scans_in_vmap', _per_example(_nested), (B1, T_OUT, T_IN)),
    (
        'vmap_scan_vmap_scan',
        _per_example(_vmap_between),
        (B1, T_OUT, B2, T_IN),
    ),
    ('scan_in_two_vmaps', _per_example(_steps, vmaps=2), (B1, B2, T_OUT)),
    ('vmap_in_scan', lambda w, x, e, m: _vmap_inside(w, x, e, m), (T_OUT, B2)),
)

LAYOUT_DERIVATIVES = (
    ('grad', jax.grad),
    ('jit_grad', lambda f: jax.jit(jax.grad(f))),
    ('value_and_grad', lambda f: lambda w: jax.value_and_grad(f)(w)[1]),
    ('vjp', lambda f: lambda w: jax.vjp(f, w)[1](jnp.float32(1.0))[0]),
)


class LayoutUnderVmappedLoopTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f'{c[0]}_{d[0]}', c[1], c[2], d[1])
      for c in LAYOUT_CASES
      for d in LAYOUT_DERIVATIVES
  )
  def test_cotangent_laid_out_as_the_value(self, loss, shape, derivative):
    xs = jnp.asarray(_RNG.normal(size=shape), jnp.float32)
    zeros = jnp.zeros(shape, jnp.float32)
    expected = jax.grad(lambda e: loss(_W, xs, e, 'by_hand'))(zeros)
    want_grad = jax.grad(lambda w: loss(w, xs, zeros, 'by_hand'))(_W)
    for mode in ('sow', 'perturb'):
      f = lambda w, mode=mode: loss(w, xs, zeros, mode)
      for wrap in (lambda g: g, jax.jit):
        grad, collected = wrap(capture(derivative(f)))(_W)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5)
        cotangent = collected[grad_name('h')]
        self.assertLen(cotangent, 1)
        self.assertEqual(cotangent[0].shape, shape)
        np.testing.assert_allclose(cotangent[0], expected, rtol=1e-5,
                                   atol=1e-6)
        if mode == 'sow':  # the value, sown where the cotangent is
          self.assertEqual(collected['h'][0].shape, shape)

  @parameterized.named_parameters(('eager', lambda g: g), ('jit', jax.jit))
  def test_a_vmap_around_the_derivative_comes_first(self, wrap):
    # vmap over w of grad of vmap over xs of the loop: (w, xs, steps).
    ws = jnp.asarray([0.5, 0.7, 0.9], jnp.float32)
    xs = jnp.asarray(_RNG.normal(size=(B1, T_OUT)), jnp.float32)
    zeros = jnp.zeros((B1, T_OUT), jnp.float32)
    loss = _per_example(_steps)
    f = jax.vmap(jax.grad(lambda w: loss(w, xs, zeros, 'sow')))
    _, collected = wrap(capture(f))(ws)
    expected = jax.vmap(
        lambda w: jax.grad(lambda e: loss(w, xs, e, 'by_hand'))(zeros)
    )(ws)
    self.assertEqual(expected.shape, (3, B1, T_OUT))
    np.testing.assert_allclose(
        collected[grad_name('h')][0], expected, rtol=1e-5, atol=1e-6
    )
    self.assertEqual(collected['h'][0].shape, (3, B1, T_OUT))

  def test_by_hand(self):
    # One example, two steps: c1 = sin(w x0), c2 = sin(w x1 + c1), L = c2.
    # dL/dh1 = cos(w x1 + c1) and dL/dh2 = 1, laid out (examples, steps).
    xs = np.array([[0.3, -0.5], [1.0, 0.2]], np.float32)
    loss = _per_example(_steps)
    zeros = jnp.zeros(xs.shape, jnp.float32)
    _, collected = capture(jax.grad(lambda w: loss(w, xs, zeros, 'sow')))(_W)
    c1 = np.sin(_W * xs[:, 0])
    expected = np.stack([np.cos(_W * xs[:, 1] + c1), np.ones(2)], axis=1)
    np.testing.assert_allclose(
        collected[grad_name('h')][0], expected, rtol=1e-5
    )

  def test_a_pullback_made_before_the_capture(self):
    # Its vmap batched the perturb while no capture staged: with the loop
    # stacking the cotangents, their layout cannot be told, so it raises;
    # without a loop, or without a vmap, the cotangent is collected.
    xs = jnp.asarray(_RNG.normal(size=(B1, T_OUT)), jnp.float32)
    zeros = jnp.zeros((B1, T_OUT), jnp.float32)
    loss = _per_example(_steps)
    f = lambda w: loss(w, xs, zeros, 'perturb')
    _, pullback = jax.vjp(f, _W)
    with self.assertRaisesRegex(
        NotImplementedError, r"perturb \('grad', 'h'\).*before the capture"
    ):
      capture(pullback)(jnp.float32(1.0))
    _, linear = jax.linearize(f, _W)
    transposed = jax.linear_transpose(linear, _W)
    with self.assertRaisesRegex(NotImplementedError, 'jax.vjp'):
      capture(transposed)(jnp.float32(1.0))

    _, pullback = jax.vjp(lambda w: _steps(w, xs[0], zeros[0], 'perturb'), _W)
    _, collected = capture(pullback)(jnp.float32(1.0))
    expected = jax.grad(lambda e: _steps(_W, xs[0], e, 'by_hand'))(zeros[0])
    np.testing.assert_allclose(
        collected[grad_name('h')][0], expected, rtol=1e-5, atol=1e-6
    )

    one = lambda w, x: jnp.sin(_site(w * x, 0.0, 'perturb'))
    _, pullback = jax.vjp(lambda w: jax.vmap(lambda x: one(w, x))(xs).sum(), _W)
    _, collected = capture(pullback)(jnp.float32(1.0))
    np.testing.assert_allclose(  # d sin(h) / dh, per element
        collected[grad_name('h')][0], np.cos(_W * xs), rtol=1e-5
    )
