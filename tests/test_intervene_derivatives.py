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

"""Tests of derivatives taken inside a function that ``intervene`` replaces
sows in: they are the derivatives of the replaced program.

Every expected value comes from the same program written by hand with the
replacement in place of the sown value (``h(y, r, mode)`` with ``mode`` the
replacement), never from a second call of ``intervene``.
"""

from __future__ import annotations

import itertools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.experimental import jet
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import loop_indices
from flax.nnx.sow import perturb
from flax.nnx.sow import sow

X = np.array([0.5, -1.0, 2.0], np.float32)
T = np.array([0.3, -0.7, 1.1], np.float32)  # a tangent / cotangent
C = np.array([5.0, -2.0, 3.0], np.float32)  # a constant replacement
CS = np.stack([C, C[::-1] * 0.5])  # stacked over 2 iterations / examples
FN = lambda v: jnp.sin(v) * v  # a callable replacement
FN2 = lambda v: v * v * v


def assert_close(actual, expected, rtol=1e-5, atol=1e-5):
  """Same pytree structure and leaves equal up to float tolerance."""
  a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
  e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
  assert a_tree == e_tree, f'structure {a_tree} != expected {e_tree}'
  for a, e in zip(a_leaves, e_leaves):
    np.testing.assert_allclose(
        np.asarray(a), np.asarray(e), rtol=rtol, atol=atol
    )


def h(y, r, mode):
  """The program: ``mode`` is ``'sow'`` (sows ``a``), ``'const'`` (the
  constant ``r`` in its place) or a callable applied in its place."""
  v = jnp.cos(y) * y
  if mode == 'sow':
    v = sow(v, name='a')
  elif mode == 'const':
    v = r
  else:
    v = mode(v)
  return jnp.tanh(v) * y + y * y


# ----------------------------------------------------------------------------
# Inner transforms: T(fun)(z) for a function fun of one array.


def _sum(fun):
  return lambda q: fun(q).sum()


TRANSFORMS = {
    'grad': lambda fun: lambda z: jax.grad(_sum(fun))(z),
    'value_and_grad': lambda fun: lambda z: (
        lambda v, g: v * g
    )(*jax.value_and_grad(_sum(fun))(z)),
    'jvp': lambda fun: lambda z: jnp.concatenate(
        jax.jvp(fun, (z,), (jnp.asarray(T),))
    ),
    'linearize': lambda fun: lambda z: (
        lambda out, lin: lin(jnp.asarray(T)) + out
    )(*jax.linearize(fun, z)),
    'vjp': lambda fun: lambda z: (
        lambda out, pullback: pullback(jnp.asarray(T))[0] * out
    )(*jax.vjp(fun, z)),
    'jacfwd': lambda fun: lambda z: jax.jacfwd(fun)(z),
}


# ----------------------------------------------------------------------------
# Placements: place(tr, mode) -> g(z, rs), with rs the constant replacement
# in the layout the placement sows it (for mode 'const').


def _plain(tr, mode):
  return lambda z, r: tr(lambda y: h(y, r, mode))(z)


def _jit(tr, mode):
  return lambda z, r: jax.jit(tr(lambda y: h(y, r, mode)))(z)


def _jit_inside(tr, mode):
  return lambda z, r: tr(jax.jit(lambda y: h(y, r, mode)))(z)


def _checkpoint(tr, mode):
  return lambda z, r: tr(jax.checkpoint(lambda y: h(y, r, mode)))(z)


def _cond(tr, mode):
  def g(z, r):
    return jax.lax.cond(
        jnp.sum(z) > 0,
        tr(lambda y: h(y, r, mode)),
        lambda y: tr(lambda q: h(q, r, mode))(y) * 2.0,
        z,
    )

  return g


def _scan(tr, mode):
  def g(z, rs):
    def body(c, r):
      out = tr(lambda y: h(y, r, mode))(c)
      return c * 0.9 + 0.01 * jnp.sum(out), out

    return jax.lax.scan(body, z, rs)[1]

  return g


def _vmap(tr, mode):
  def g(z, rs):
    return jax.vmap(lambda z1, r: tr(lambda y: h(y, r, mode))(z1))(
        jnp.stack([z, z * 0.5]), rs
    )

  return g


def _custom_jvp(tr, mode):
  def g(z, r):
    body = lambda y: h(y, r, mode)
    fun = jax.custom_jvp(body)
    fun.defjvp(lambda p, t: jax.jvp(body, p, t))
    return tr(fun)(z)

  return g


def _custom_vjp(tr, mode):
  # The forward rule takes a gradient of the body (and sows twice).
  def g(z, r):
    body = lambda y: h(y, r, mode)
    fun = jax.custom_vjp(body)
    fun.defvjp(
        lambda y: (body(y), jax.grad(lambda q: body(q).sum())(y)),
        lambda res, ct: (res * ct,),
    )
    return tr(fun)(z)

  return g


def _around_scan(tr, mode):
  # The derivative of a function that scans (not one inside the body).
  def g(z, rs):
    def run(y):
      body = lambda c, r: (c * 0.5, h(y * c, r, mode))
      return jax.lax.scan(body, 1.0, rs)[1].sum(0)

    return tr(run)(z)

  return g


def _around_vmap(tr, mode):
  def g(z, rs):
    run = lambda y: jax.vmap(lambda a, r: h(a, r, mode))(
        jnp.stack([y, y * 0.5]), rs
    ).sum(0)
    return tr(run)(z)

  return g


def _around_cond(tr, mode):
  def g(z, r):
    run = lambda y: jax.lax.cond(
        jnp.sum(y) > 0,
        lambda q: h(q, r, mode),
        lambda q: h(q, r, mode) * 2.0,
        y,
    )
    return tr(run)(z)

  return g


# name -> (place, constant layout: 'one' | 'stacked' | 'two')
PLACEMENTS = {
    'plain': (_plain, 'one'),
    'jit': (_jit, 'one'),
    'jit_inside': (_jit_inside, 'one'),
    'checkpoint': (_checkpoint, 'one'),
    'cond': (_cond, 'one'),
    'scan': (_scan, 'stacked'),
    'vmap': (_vmap, 'stacked'),
    'custom_jvp': (_custom_jvp, 'one'),
    'custom_vjp': (_custom_vjp, 'two'),
    'around_scan': (_around_scan, 'stacked'),
    'around_vmap': (_around_vmap, 'stacked'),
    'around_cond': (_around_cond, 'one'),
}


def _cases():
  for t, p, rep in itertools.product(TRANSFORMS, PLACEMENTS, ('const', 'fn')):
    if p == 'custom_vjp' and t in ('jvp', 'linearize', 'jacfwd'):
      continue  # JAX: no forward mode through a custom_vjp
    if t == 'jacfwd' and rep == 'const':
      # An array replacement under jacfwd's vmap has capture's layout, one
      # row per basis vector, so the primal would vary over the basis:
      # JAX's jacfwd raises (its primal must be unbatched).
      continue
    yield dict(testcase_name=f'_{t}_{p}_{rep}', tr=t, place=p, rep=rep)


def _constant(layout):
  rs = CS if layout == 'stacked' else C
  values = (rs, rs) if layout == 'two' else (rs,)
  return rs, values


class InnerDerivativeTest(parameterized.TestCase):

  @parameterized.named_parameters(*_cases())
  def test_matches_the_replaced_program(self, tr, place, rep):
    place_fn, layout = PLACEMENTS[place]
    tr = TRANSFORMS[tr]
    if rep == 'const':
      rs, values = _constant(layout)
      mode = 'const'
    else:
      rs, values, mode = CS if layout == 'stacked' else C, FN, FN
    sowing = place_fn(tr, 'sow')
    expected = place_fn(tr, mode)(jnp.asarray(X), rs)
    g = intervene(lambda z: sowing(z, rs), {'a': values})
    assert_close(g(X), expected)
    assert_close(jax.jit(g)(X), expected)

  def test_the_issue_example(self):
    x = jnp.array([1.0, 2.0])
    h1 = lambda y: sow(y, name='a') * 2.0
    g = lambda z: jax.grad(lambda q: h1(q).sum())(z)
    assert_close(intervene(g, {'a': (jnp.full(2, 5.0),)})(x), np.zeros(2))
    assert_close(intervene(g, {'a': lambda v: 0.5 * v})(x), np.ones(2))

  def test_two_callables_through_one_cached_inner_jit(self):
    # The inner jit is traced once (its cache key knows the names, not the
    # callables); each intervene applies its own callable's derivative.
    inner = jax.jit(jax.grad(_sum(lambda y: h(y, None, 'sow'))))
    g = lambda z: inner(z)
    for fn in (FN, FN2, FN):
      expected = jax.grad(_sum(lambda y: h(y, None, fn)))(X)
      assert_close(intervene(g, {'a': fn})(X), expected)
      assert_close(jax.jit(intervene(g, {'a': fn}))(X), expected)

  @parameterized.named_parameters(
      ('const', 'const', (C,)), ('fn', FN, FN), ('fn2', FN2, FN2)
  )
  def test_both_orders_agree(self, mode, values):
    loss = lambda y: h(y, C, mode).sum()
    expected = jax.grad(loss)(X)
    sowing = lambda y: h(y, C, 'sow').sum()
    assert_close(jax.grad(intervene(sowing, {'a': values}))(X), expected)
    inside = intervene(lambda z: jax.grad(sowing)(z), {'a': values})
    assert_close(inside(X), expected)
    assert_close(jax.jit(inside)(X), expected)

  @parameterized.named_parameters(('const', 'const', (C,)), ('fn', FN, FN))
  def test_capture_around_and_inside(self, mode, values):
    g = TRANSFORMS['grad'](lambda y: h(y, C, 'sow'))
    expected = TRANSFORMS['grad'](lambda y: h(y, C, mode))(X)
    sown = C if mode == 'const' else FN(np.cos(X) * X)
    for out, collected in (
        capture(intervene(g, {'a': values}))(X),
        intervene(capture(g), {'a': values})(X),
        jax.jit(capture(intervene(g, {'a': values})))(X),
    ):
      assert_close(out, expected)
      assert_close(collected['a'], (sown,))
    # A capture inside that does not accept the sow leaves it to intervene.
    other = lambda z: capture(g, tags=('other',))(z)[0]
    assert_close(intervene(other, {'a': values})(X), expected)

  @parameterized.product(
      rep=('const', 'fn'), remat=(False, True), tr=('grad', 'linearize')
  )
  def test_loop_invariant_sow_under_a_derivative_around_a_scan(
      self, rep, remat, tr
  ):
    # Scan's partial evaluation hoists loop-invariant work out of the loop;
    # what consumes a replaced sow must stay in it, to read each
    # iteration's replacement.
    def run(mode):
      def f(y):
        def body(c, r):
          inner = lambda q: h(q, r, mode)
          inner = jax.checkpoint(inner) if remat else inner
          return c * 0.5, inner(y) * c

        return jax.lax.scan(body, 1.0, CS)[1].sum(0)

      return TRANSFORMS[tr](f)

    values = (CS,) if rep == 'const' else FN
    expected = run('const' if rep == 'const' else FN)(jnp.asarray(X))
    g = intervene(run('sow'), {'a': values})
    assert_close(g(X), expected)
    assert_close(jax.jit(g)(X), expected)

  def test_transforms_around_an_intervene_with_a_derivative_inside(self):
    for values, mode in (((C,), 'const'), (FN, FN)):
      inner = TRANSFORMS['grad'](lambda y: h(y, C, 'sow'))
      by_hand = TRANSFORMS['grad'](lambda y: h(y, C, mode))
      g = intervene(inner, {'a': values})
      xs = np.stack([X, X * 2.0])
      assert_close(jax.vmap(g)(xs), jax.vmap(by_hand)(xs))
      assert_close(
          jax.grad(lambda x: g(x).sum())(X),
          jax.grad(lambda x: by_hand(x).sum())(X),
      )
    # With respect to the replacement, through the derivative inside.
    assert_close(
        jax.grad(lambda c: intervene(inner, {'a': (c,)})(X).sum())(C),
        jax.grad(
            lambda c: TRANSFORMS['grad'](lambda y: h(y, c, 'const'))(X).sum()
        )(C),
    )

  def test_while_loop_with_a_callable(self):
    def run(mode):
      def g(z, n):
        def body(_, c):
          return c - 0.1 * TRANSFORMS['grad'](lambda y: h(y, C, mode))(c)

        return jax.lax.fori_loop(0, n, body, z)

      return g

    expected = run(FN)(jnp.asarray(X), 3)
    sowing = run('sow')
    assert_close(intervene(sowing, {'a': FN})(X, 3), expected)
    assert_close(jax.jit(intervene(sowing, {'a': FN}))(X, 3), expected)

  @parameterized.named_parameters(('const', 'const', (C,)), ('fn', FN, FN))
  def test_replaced_perturb(self, mode, values):
    def prog(y, m):
      v = jnp.cos(y) * y
      if m == 'sow':
        v = perturb(v, name='p')
      elif m == 'const':
        v = jnp.asarray(C)
      else:
        v = m(v)
      return (jnp.tanh(v) * y).sum()

    expected = jax.grad(lambda y: prog(y, mode))(X)
    g = intervene(jax.grad(lambda y: prog(y, 'sow')), {'p': values})
    assert_close(g(X), expected)
    assert_close(jax.jit(g)(X), expected)

  def test_second_order_with_a_callable_raises(self):
    g = lambda z: jax.hessian(_sum(lambda y: h(y, None, 'sow')))(z)
    with self.assertRaisesRegex(NotImplementedError, "sow 'a'.*outside"):
      intervene(g, {'a': FN})(X)
    # The transform outside intervene is exact.
    expected = jax.hessian(_sum(lambda y: h(y, None, FN)))(X)
    outside = jax.hessian(intervene(_sum(lambda y: h(y, None, 'sow')), {'a': FN}))
    assert_close(outside(X), expected)

  def test_a_sow_left_unreplaced_with_strict_false(self):
    # Its derivative inside was taken to be a constant's: an error, not the
    # derivative of a program that differs from the one computed.
    def g(z):
      y = TRANSFORMS['grad'](lambda q: h(q, None, 'sow'))(z)
      return TRANSFORMS['grad'](lambda q: h(q, None, 'sow'))(y)

    with self.assertRaisesRegex(ValueError, "sow 'a'.*no entry left"):
      intervene(g, {'a': (C,)}, strict=False)(X)
    # Not differentiated inside, the second sow keeps its value.
    g2 = lambda z: h(z, None, 'sow') + h(z * 2.0, None, 'sow')
    expected = h(jnp.asarray(X), C, 'const') + h(jnp.asarray(X) * 2.0, None, 'sow')
    assert_close(intervene(g2, {'a': (C,)}, strict=False)(X), expected)

  def test_jet_inside(self):
    def g(mode):
      fun = lambda y: h(y, C, mode)
      ones = jnp.ones(3, jnp.float32)
      return lambda z: jet.jet(fun, (z,), ((ones, 0.5 * ones),))

    assert_close(
        intervene(g('sow'), {'a': (C,)})(X), g('const')(jnp.asarray(X))
    )
    with self.assertRaisesRegex(NotImplementedError, "sow 'a'.*jet outside"):
      intervene(g('sow'), {'a': FN})(X)

  def test_jacfwd_with_a_callable_keeps_the_primal_unbatched(self):
    # The callable applies to the unbatched value; a capture around still
    # sees it once per basis vector, as without intervene.
    g = lambda z: jax.jacfwd(lambda y: h(y, None, 'sow'))(z)
    out, collected = capture(intervene(g, {'a': FN}))(X)
    assert_close(out, jax.jacfwd(lambda y: h(y, None, FN))(X))
    assert_close(collected['a'], (np.stack([FN(np.cos(X) * X)] * 3),))

  def test_jacfwd_with_an_array_raises_naming_the_sow(self):
    # An array replacement carries jacfwd's basis axis (capture's layout),
    # which the primal, returned with out_axes=None, cannot have: an error
    # naming the sow and the fix, under jit and in a capture too.
    g = lambda z: jax.jacfwd(lambda y: h(y, None, 'sow'))(z)
    basis = jnp.stack([jnp.asarray(C)] * 3)
    for rep in (C, basis):
      for run in (
          intervene(g, {'a': (rep,)}),
          jax.jit(intervene(g, {'a': (rep,)})),
          lambda x: capture(intervene(g, {'a': (rep,)}))(x)[0],
      ):
        with self.assertRaisesRegex(
            ValueError, "sow 'a' sits in a `jax.vmap`.*callable.*outside"
        ):
          run(X)
    # The two fixes it names give the replaced program's derivative.
    expected = jax.jacfwd(lambda y: h(y, C, 'const'))(jnp.asarray(X))
    assert_close(intervene(g, {'a': lambda v: jnp.asarray(C)})(X), expected)
    outside = jax.jacfwd(intervene(lambda y: h(y, None, 'sow'), {'a': (C,)}))
    assert_close(outside(X), expected)
    # A vmap that maps its outputs takes a replacement per example.
    reps = basis * jnp.arange(1.0, 4.0)[:, None]
    per_example = intervene(
        lambda z: jax.vmap(lambda y: h(y, None, 'sow'))(z), {'a': (reps,)}
    )
    xs = np.stack([X] * 3)
    assert_close(
        per_example(xs), jax.vmap(lambda y, r: h(y, r, 'const'))(xs, reps)
    )

  def test_no_intervene_no_markers(self):
    # Outside intervene a derivative of a sow is the identity's.
    g = lambda z: jax.grad(_sum(lambda y: h(y, None, 'sow')))(z)
    text = str(jax.make_jaxpr(g)(X))
    self.assertIn('kind=value', text)  # the sow, as a jaxpr prints it
    self.assertNotIn('kind=jvp', text)
    self.assertNotIn('kind=vjp', text)
    assert_close(g(X), jax.grad(_sum(lambda y: h(y, None, lambda v: v)))(X))



class CustomJvpRuleThroughTheBodyTest(parameterized.TestCase):
  """A custom_jvp whose rule differentiates the sowing body: a derivative
  around intervene is that of the replaced program, as one inside is (the
  rule ignored the replacement there: silent)."""

  @staticmethod
  def _program(sow_fn):
    def body(x):
      return jnp.sin(sow_fn(2.0 * x))

    f = jax.custom_jvp(body)
    f.defjvp(lambda p, t: jax.jvp(body, p, t))
    return f

  def test_the_rule_sees_the_constant_it_multiplies(self):
    # The derivative depends on the replaced value itself: the rule got
    # the unreplaced value with a zero tangent (sin(2x), silent).
    def body(x):
      return jnp.sin(sow(2.0 * x, name='h')) * x

    f = jax.custom_jvp(body)
    f.defjvp(lambda p, t: jax.jvp(body, p, t))
    c = jnp.array([0.3, -0.7, 1.1])
    xs = jnp.array([0.4, -1.2, 0.9])
    values = {'h': (c,)}
    loss = lambda x: intervene(f, values)(x).sum()
    expected = np.sin(np.asarray(c))  # x -> sin(c) * x, by hand
    for got in (
        jax.grad(loss)(xs),
        jax.jit(jax.grad(loss))(xs),
        jax.grad(jax.checkpoint(loss))(xs),
        jax.linearize(intervene(f, values), xs)[1](jnp.ones(3)),
        jax.vjp(intervene(f, values), xs)[1](jnp.ones(3))[0],
        jax.grad(lambda x: jax.jit(intervene(f, values))(x).sum())(xs),
        intervene(jax.grad(lambda x: f(x).sum()), values)(xs),
    ):
      np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(
        intervene(f, values)(xs), np.sin(np.asarray(c)) * xs, rtol=1e-6
    )

  def test_callable_and_array_replacements(self):
    f = self._program(lambda v: sow(v, name='h'))
    x = jnp.array([0.3, 1.2])
    # By hand: h -> 0.5 h gives sin(x), derivative cos(x); a constant
    # replacement gives derivative 0.
    cases = (
        ({'h': lambda v: 0.5 * v}, jnp.cos(x)),
        ({'h': (jnp.array([5.0, 5.0]),)}, jnp.zeros(2)),
    )
    for values, expected in cases:
      loss = lambda x: intervene(f, values)(x).sum()
      for got in (
          jax.grad(loss)(x),
          jax.jit(jax.grad(loss))(x),
          jax.value_and_grad(loss)(x)[1],
          jax.linearize(intervene(f, values), x)[1](jnp.ones(2)),
          intervene(jax.grad(lambda x: f(x).sum()), values)(x),
      ):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)

  def test_under_other_transforms_and_closures(self):
    def body(x):
      return jnp.sin(sow(2.0 * x, name='h'))

    f = jax.custom_jvp(body)
    f.defjvp(lambda p, t: jax.jvp(body, p, t))
    xs = jnp.array([0.3, 1.2, -0.7])
    fn = {'h': lambda v: 0.5 * v}

    @jax.jit
    def closing_over(xs, s):  # the callable closes over a jit tracer
      return jax.vmap(jax.grad(intervene(f, {'h': lambda v: s * v})))(xs)

    scanned = lambda xs: jax.lax.scan(
        lambda c, x: (c + intervene(f, fn)(x), None), 0.0, xs)[0]
    for got in (
        jax.vmap(jax.grad(intervene(f, fn)))(xs),
        jax.vmap(jax.grad(jax.checkpoint(intervene(f, fn))))(xs),
        closing_over(xs, 0.5),
        jax.grad(scanned)(xs),
        jax.jacfwd(intervene(f, fn))(xs).diagonal(),
    ):
      np.testing.assert_allclose(got, jnp.cos(xs), rtol=1e-6)

  def test_a_rule_that_does_not_differentiate_the_body_is_kept(self):
    def body(x):
      return jnp.sin(sow(2.0 * x, name='h'))

    f = jax.custom_jvp(body)
    f.defjvp(lambda p, t: (f(p[0]), 3.0 * t[0]))
    x = jnp.array([0.3, 1.2])
    got = jax.grad(lambda x: intervene(f, {'h': lambda v: 0.5 * v})(x).sum())
    np.testing.assert_allclose(got(x), [3.0, 3.0], rtol=1e-6)

  def test_in_a_scan_with_loop_indices(self):
    from flax.nnx.sow import loop_indices  # pylint: disable=g-import-not-at-top

    f = self._program(lambda v: sow(v, name='h'))
    g = lambda xs: jax.lax.scan(lambda c, x: (c + f(x), None), 0.0, xs)[0]
    xs = jnp.array([0.3, 1.2, -0.4])
    row_1 = {'h': lambda v: jnp.where(loop_indices()[0] == 1, 0.5 * v, v)}
    # Row 1 is sin(x), the others sin(2x).
    expected = jnp.array([2.0, 0.5, 2.0]) * jnp.cos(
        jnp.array([2.0, 1.0, 2.0]) * xs
    ) * jnp.array([1.0, 2.0, 1.0])
    for got in (
        jax.grad(intervene(g, row_1))(xs),
        intervene(jax.grad(g), row_1)(xs),
    ):
      np.testing.assert_allclose(got, expected, rtol=1e-6)



class CustomVjpRuleThroughTheBodyTest(absltest.TestCase):
  """The custom_vjp twin: a backward rule that differentiates the sowing
  body sees the replacement around intervene, as inside (it did not:
  silent)."""

  def test_both_orders_agree_with_the_replaced_program(self):
    def body(x):
      return jnp.sin(sow(2.0 * x, name='h'))

    f = jax.custom_vjp(body)
    f.defvjp(
        lambda x: (body(x), x), lambda x, g: (jax.vjp(body, x)[1](g)[0],)
    )
    xs = jnp.array([0.3, 1.2, -0.7])
    cases = (({'h': lambda v: 0.5 * v}, jnp.cos(xs)),)  # sin(x)
    for values, expected in cases:
      loss = lambda x: intervene(f, values)(x).sum()
      for got in (
          jax.grad(loss)(xs),
          jax.jit(jax.grad(loss))(xs),
          jax.grad(jax.checkpoint(loss))(xs),
          jax.value_and_grad(loss)(xs)[1],
      ):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    # Inside, the staged program sows 'h' in the forward and the backward
    # rule: a callable serves both.
    inside = intervene(jax.grad(lambda x: f(x).sum()), cases[0][0])(xs)
    np.testing.assert_allclose(inside, jnp.cos(xs), rtol=1e-6)
    per_example = jax.vmap(jax.grad(intervene(f, cases[0][0])))(xs)
    np.testing.assert_allclose(per_example, jnp.cos(xs), rtol=1e-6)

  def test_an_array_entry_the_backward_rule_cannot_get_raises(self):
    # The backward rule runs the body again, on residuals and cotangents
    # only: an array entry cannot reach it (it gave the unreplaced value
    # there: silent).
    def body(x):
      return jnp.sin(sow(2.0 * x, name='h')) * x

    f = jax.custom_vjp(body)
    f.defvjp(
        lambda x: (body(x), x), lambda x, g: (jax.vjp(body, x)[1](g)[0],)
    )
    loss = lambda x: intervene(f, {'h': (jnp.full(3, 5.0),)})(x).sum()
    with self.assertRaisesRegex(ValueError, r"sow 'h'.*backward rule.*callable"):
      jax.grad(loss)(jnp.array([0.3, 1.2, -0.7]))

  def test_constant_entries_reach_a_forward_rule_and_its_pullback(self):
    c = jnp.array([0.3, -0.7, 1.1])

    def make(mark):
      def body(x):
        return jnp.sin(mark(2.0 * x)) * x

      f = jax.custom_vjp(body)
      f.defvjp(lambda x: jax.vjp(body, x), lambda pull, g: pull(g))
      return f

    f = make(lambda v: sow(v, name='h'))
    xs = jnp.array([0.4, -1.2, 0.9])
    loss = lambda x: intervene(f, {'h': (c,)})(x).sum()
    # The replaced program x -> sin(c) * x, by hand.
    expected = np.sin(np.asarray(c))
    for got in (
        jax.grad(loss)(xs),
        jax.jit(jax.grad(loss))(xs),
        jax.grad(jax.checkpoint(loss))(xs),
        intervene(jax.grad(lambda x: f(x).sum()), {'h': (c,)})(xs),
    ):
      np.testing.assert_allclose(got, expected, rtol=1e-6)

  def test_constant_entries_closed_over_from_jit_vmap_and_scan(self):
    # Both custom rules that differentiate the body; the constant is a
    # tracer of an enclosing jit, vmap or scan.
    def make(kind):
      def body(x):
        return jnp.sin(sow(2.0 * x, name='h')) * x

      if kind == 'jvp':
        f = jax.custom_jvp(body)
        f.defjvp(lambda p, t: jax.jvp(body, p, t))
      else:
        f = jax.custom_vjp(body)
        f.defvjp(lambda x: jax.vjp(body, x), lambda pull, g: pull(g))
      return f

    c = jnp.array([0.3, -0.7, 1.1])
    xs = jnp.array([0.4, -1.2, 0.9])
    expected = np.sin(np.asarray(c))  # x -> sin(c) * x, by hand
    for kind in ('jvp', 'vjp'):
      f = make(kind)
      grad_at = lambda cc, x: jax.grad(
          lambda x: intervene(f, {'h': (cc,)})(x).sum()
      )(x)
      per_example = jax.vmap(
          lambda x, cc: jax.grad(lambda x: intervene(f, {'h': (cc,)})(x))(x)
      )(xs, c)
      _, scanned = jax.lax.scan(
          lambda carry, _: (carry, grad_at(carry, xs)), c, None, length=2
      )
      for got in (jax.jit(grad_at)(c, xs), per_example, *scanned):
        np.testing.assert_allclose(got, expected, rtol=1e-6)

  def test_loop_indices_outside_any_loop_in_a_backward_rule(self):
    def body(x):
      return jnp.sin(sow(2.0 * x, name='h')) * x

    f = jax.custom_vjp(body)
    f.defvjp(lambda x: jax.vjp(body, x), lambda pull, g: pull(g))
    xs = jnp.array([0.4, -1.2, 0.9])
    seen = []

    def fn(v):
      seen.append(loop_indices())
      return v + 0.1

    got = jax.grad(lambda x: intervene(f, {'h': fn})(x).sum())(xs)
    # d/dx sin(2x + 0.1) * x, by hand.
    expected = np.sin(2 * xs + 0.1) + 2 * xs * np.cos(2 * xs + 0.1)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    self.assertTrue(seen)
    self.assertTrue(all(s == () for s in seen))

  def test_a_forward_rule_that_hands_on_its_pullback(self):
    def body(x):
      return jnp.sin(sow(2.0 * x, name='h'))

    f = jax.custom_vjp(body)
    f.defvjp(lambda x: jax.vjp(body, x), lambda pull, g: pull(g))
    xs = jnp.array([0.3, 1.2, -0.7])
    fn = {'h': lambda v: 0.5 * v}
    loss = lambda x: intervene(f, fn)(x).sum()
    for got in (
        jax.grad(loss)(xs),
        jax.jit(jax.grad(loss))(xs),
        jax.vmap(jax.grad(intervene(f, fn)))(xs),
        intervene(jax.grad(lambda x: f(x).sum()), fn)(xs),
    ):
      np.testing.assert_allclose(got, jnp.cos(xs), rtol=1e-6)

  def test_a_rule_that_does_not_differentiate_the_body_is_kept(self):
    def body(x):
      return jnp.sin(sow(2.0 * x, name='h'))

    f = jax.custom_vjp(body)
    f.defvjp(lambda x: (body(x), None), lambda _, g: (3.0 * g,))
    got = jax.grad(
        lambda x: intervene(f, {'h': lambda v: 0.5 * v})(x).sum()
    )(jnp.array([0.3, 1.2]))
    np.testing.assert_allclose(got, [3.0, 3.0], rtol=1e-6)


class RuleSkipsTheBodyTest(parameterized.TestCase):
  """A custom_jvp/custom_vjp whose rule does not call the sowing body,
  differentiated inside the intervened function: JAX runs the rule, not the
  body, so no sow of that name runs and intervene's name check raises,
  naming custom_jvp/custom_vjp as the likely cause (returning the
  unreplaced value would be silent). Around intervene the replacement
  holds."""

  @staticmethod
  def _programs():
    def body(x):
      return sow(jnp.sin(x), name='s') * 1.0

    f = jax.custom_jvp(body)
    f.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0] * 10.0))
    g = jax.custom_vjp(body)
    g.defvjp(
        lambda x: (jnp.sin(x), x),
        lambda r, ct: (jnp.cos(r) * ct * 10.0,),
    )
    return {'custom_jvp': f, 'custom_vjp': g}

  @parameterized.parameters('custom_jvp', 'custom_vjp')
  def test_a_derivative_inside_raises_naming_the_sow(self, kind):
    fn = self._programs()[kind]
    for values in ({'s': lambda v: v * 0.0 + 2.0}, {'s': (jnp.float32(2.0),)}):
      for wrap in (lambda h: h, jax.jit):
        with self.assertRaisesRegex(
            ValueError,
            r"no sow .* is named 's'.*`jax.custom_jvp`/`jax.custom_vjp`.*"
            r'does not run when its jvp/fwd rule does not call',
        ):
          intervene(wrap(jax.value_and_grad(fn)), values)(0.5)

  @parameterized.parameters('custom_jvp', 'custom_vjp')
  def test_name_also_sown_elsewhere_counts_the_entries(self, kind):
    # With entries, the sow that does not run is one entry too many.
    fn = self._programs()[kind]
    h = lambda x: sow(fn(x), name='s') * 1.0
    with self.assertRaisesRegex(
        ValueError,
        r"values\['s'\] has 2 entries, but the program sows 's' 1 times"
        r'.*`jax.custom_jvp`/`jax.custom_vjp`',
    ):
      intervene(jax.value_and_grad(h), {'s': (0.25, 2.0)})(0.5)

  @parameterized.parameters('custom_jvp', 'custom_vjp')
  def test_around_intervene_and_other_names_are_exact(self, kind):
    fn = self._programs()[kind]
    value, grad = jax.value_and_grad(
        intervene(fn, {'s': lambda v: v * 0.0 + 2.0})
    )(0.5)
    np.testing.assert_allclose(value, 2.0)  # the replaced body's value
    np.testing.assert_allclose(grad, 10.0 * np.cos(0.5), rtol=1e-6)
    # A sow outside the call is replaced as usual: 3 sin(x), 3 * 10 cos(x).
    h = lambda x: sow(fn(x), name='o')
    value, grad = intervene(
        jax.value_and_grad(h), {'o': lambda v: 3.0 * v}
    )(0.5)
    np.testing.assert_allclose(value, 3.0 * np.sin(0.5), rtol=1e-6)
    np.testing.assert_allclose(grad, 30.0 * np.cos(0.5), rtol=1e-6)


@jax.custom_jvp
def _rule_returns_call(x):
  return jnp.sin(sow(2.0 * x, name='a'))


@_rule_returns_call.defjvp
def _rule_returns_call_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return _rule_returns_call(x), 2.0 * jnp.cos(2.0 * x) * t


class RuleReturnsTheCallTest(absltest.TestCase):
  """The usual custom rule (``y = f(x); return y, tangent``) differentiated
  inside ``intervene``: the primal is the replaced one, the tangent the
  rule's. Under ``grad`` alone the primal call's outputs are unused in the
  staged program: a review found that an attempt to refuse rules that
  discard the call refused this too."""

  x = np.float32(0.3)
  values = {'a': (np.float32(1.0),)}

  def test_value_and_grad(self):
    value, grad = intervene(jax.value_and_grad(_rule_returns_call), self.values)(
        self.x
    )
    np.testing.assert_allclose(value, np.sin(1.0), rtol=1e-6)
    np.testing.assert_allclose(grad, 2.0 * np.cos(0.6), rtol=1e-6)

  def test_grad_and_tangent_alone(self):
    grad = intervene(jax.grad(_rule_returns_call), self.values)(self.x)
    np.testing.assert_allclose(grad, 2.0 * np.cos(0.6), rtol=1e-6)
    tangent = intervene(
        lambda x: jax.jvp(_rule_returns_call, (x,), (jnp.float32(1.0),))[1],
        self.values,
    )(self.x)
    np.testing.assert_allclose(tangent, 2.0 * np.cos(0.6), rtol=1e-6)


if __name__ == '__main__':
  absltest.main()
