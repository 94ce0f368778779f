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

"""Faults an independent adversarial run found, each as a kind.

The run generated programs and compared them with its own NumPy interpreter;
every expected value here is computed by hand (the chain rule written out)
or by the same program written without ``sow``.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import perturb
from flax.nnx.sow import sow
from flax.nnx.sow.capturing import rewrite_program

_SUM = dict(reduce_fn=lambda a, v: a + jnp.sum(v), init_fn=lambda: 0.0)


def _while_sowing(x):
  def body(state):
    i, c = state
    sow(c, name='r', **_SUM)
    return i + 1, jnp.sin(c)

  return lax.while_loop(lambda s: s[0] < 2, body, (0, x))[1]


@jax.custom_jvp
def _rule_calls_primal(x):
  return sow(x, name='a') * 1.0


@_rule_calls_primal.defjvp
def _rule_calls_primal_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return _rule_calls_primal(x), t  # the usual idiom: the rule calls f


@jax.custom_vjp
def _fwd_calls_primal(x):
  return sow(x, name='b') * 1.0


_fwd_calls_primal.defvjp(
    lambda x: (_fwd_calls_primal(x), None), lambda _, g: (g,)
)


class MadeOutsideTheCaptureTest(parameterized.TestCase):
  """A linear function or pullback made before the capture holds its sows
  inert: applying it under a capture adds no primal entries (SPEC
  *Invariance*), however often."""

  def test_linearized_while_loop(self):
    x = jnp.array([0.5, -0.3])
    lin = jax.linearize(_while_sowing, x)[1]
    t = jnp.ones(2)
    out, collected = capture(lin)(t)
    self.assertEqual(dict(collected), {})
    # d/dx sin(sin(x)) = cos(sin(x)) cos(x), applied to ones.
    np.testing.assert_allclose(
        out, np.cos(np.sin(x)) * np.cos(x), rtol=1e-6
    )
    _, twice = capture(lambda t: lin(t) + lin(2.0 * t))(t)
    self.assertEqual(dict(twice), {})
    # Inside the capture the forward pass runs there: one fold per step,
    # x then sin(x).
    _, inside = capture(lambda x: jax.linearize(_while_sowing, x)[1](t))(x)
    np.testing.assert_allclose(
        inside['r'], np.sum(x) + np.sum(np.sin(x)), rtol=1e-6
    )

  @parameterized.named_parameters(
      ('custom_jvp', _rule_calls_primal, 'a'),
      ('custom_vjp', _fwd_calls_primal, 'b'),
  )
  def test_checkpoint_around_a_custom_rule_that_calls_the_function(
      self, fn, name
  ):
    g = jax.checkpoint(lambda x: jnp.sin(fn(x)))
    x = jnp.array([0.2, 0.9])
    pullback = jax.vjp(g, x)[1]
    (ct,), collected = capture(pullback)(jnp.ones(2))
    self.assertEqual(dict(collected), {})
    np.testing.assert_allclose(ct, np.cos(x), rtol=1e-6)
    _, twice = capture(lambda c: (pullback(c), pullback(2.0 * c)))(
        jnp.ones(2)
    )
    self.assertEqual(dict(twice), {})
    # Differentiated inside the capture: the primal sow, once.
    _, inside = capture(jax.grad(lambda x: g(x).sum()))(x)
    self.assertLen(inside[name], 1)
    np.testing.assert_allclose(inside[name][0], x)


def _p(x):
  return perturb(x, name='d')


class CotangentOrderAcrossCachedBranchesTest(parameterized.TestCase):
  """Cotangents of one name come back in perturb-call order also where a
  batched ``cond``'s branches come from JAX's trace cache (their ordinals
  were fixed by an earlier trace)."""

  @parameterized.parameters(1.0, 2.0, 5.0)
  def test_call_order(self, c0):
    def f(x):
      y = _p(_p(x))  # calls 1 and 2
      stacked = jnp.stack([y, -y])
      z = jax.vmap(lambda r: lax.cond(r.sum() > 0, _p, _p, r))(stacked)
      return jnp.sum(jnp.array([1.0, 2.0]) * (c0 * z[0] + 3.0 * z[1]))

    x = jnp.array([0.3, 0.4])
    _, collected = capture(jax.grad(f))(x)
    # dL/dz0 = c0 [1, 2], dL/dz1 = 3 [1, 2]; z1 = -y, so calls 1 and 2
    # get dz0 - dz1, call 3 the rows of z.
    dz0, dz1 = c0 * np.array([1.0, 2.0]), 3.0 * np.array([1.0, 2.0])
    self.assertEqual(
        [np.shape(e) for e in collected['d']], [(2,), (2,), (2, 2)]
    )
    np.testing.assert_allclose(collected['d'][0], dz0 - dz1)
    np.testing.assert_allclose(collected['d'][1], dz0 - dz1)
    np.testing.assert_allclose(collected['d'][2], np.stack([dz0, dz1]))


class KeyOrderOfMarkersInCondTest(parameterized.TestCase):
  """A perturbed name inside a ``cond`` keeps its place among the names
  (order of first sow as written)."""

  @parameterized.named_parameters(('plain', False), ('in_cond', True))
  def test_first_sow_first(self, in_cond):
    def block(x):
      x = sow(x, name='a')
      x = perturb(jnp.sin(x), name='d')
      return sow(x * 2.0, name='b')

    def f(x):
      if in_cond:
        return jnp.sum(lax.cond(x.sum() > 0, block, block, x))
      return jnp.sum(block(x))

    x = jnp.array([0.5, 1.0])
    grad, collected = capture(jax.grad(f))(x)
    self.assertEqual(list(collected), ['a', 'd', 'b'])
    np.testing.assert_allclose(grad, 2.0 * np.cos(x), rtol=1e-6)
    np.testing.assert_allclose(collected['d'][0], [2.0, 2.0])
    np.testing.assert_allclose(collected['b'][0], 2.0 * np.sin(x), rtol=1e-6)


_TWICE = dict(
    reduce_fn=lambda a, v: 2.0 * a + jnp.sum(v * v), init_fn=lambda: 0.0
)


@jax.custom_vjp
def _vjp_folding(x):
  sow(x, name='r', **_TWICE)
  return jnp.sin(x)


_vjp_folding.defvjp(
    lambda x: (_vjp_folding(x), jnp.cos(x)), lambda c, g: (g * c,)
)


@jax.custom_jvp
def _jvp_folding(x):
  sow(x, name='r', **_TWICE)
  return jnp.sin(x)


_jvp_folding.defjvp(
    lambda p, t: (_jvp_folding(p[0]), jnp.cos(p[0]) * t[0])
)


class AccumulatorThroughACustomCallTest(parameterized.TestCase):
  """An accumulator that enters a custom-derivative call keeps the
  derivative of what it held; only the body's own values have a zero
  tangent (the custom rule stands for the body)."""

  @parameterized.product(
      fn=(('custom_vjp', _vjp_folding), ('custom_jvp', _jvp_folding)),
      jit=(False, True),
  )
  def test_gradient_of_the_accumulator(self, fn, jit):
    _, custom = fn

    def f(x):
      sow(3.0 * x, name='r', **_TWICE)  # acc = sum(9 x^2)
      return custom(x)  # acc = 2 acc + sum(x^2), the body's fold

    def loss(x):
      out, collected = capture(f)(x)
      return jnp.sum(out) + collected['r']

    x = jnp.array([0.5, -1.0, 2.0])
    grad = (jax.jit(jax.grad(loss)) if jit else jax.grad(loss))(x)
    # d/dx [sum sin x + 2 * 9 sum x^2] = cos x + 36 x; the body's fold of
    # x^2 has a zero tangent.
    np.testing.assert_allclose(
        grad, np.cos(x) + 36.0 * np.asarray(x), rtol=1e-5
    )
    _, collected = capture(f)(x)
    np.testing.assert_allclose(
        collected['r'], 2.0 * 9.0 * np.sum(x * x) + np.sum(x * x), rtol=1e-5
    )


class ReusedBranchesUnderVmapOfGradTest(parameterized.TestCase):
  """Two batched ``cond`` calls that share their branch functions (one
  trace), differentiated inside the vmap: cotangents in call order."""

  @parameterized.named_parameters(('eager', False), ('jit', True))
  def test_call_order(self, jit):
    tb = lambda x: perturb(x, name='p') * 1.0
    fb = lambda x: perturb(x, name='p') * 3.0

    def f(x):
      y = lax.cond(x > 0, tb, fb, x)  # call 1: cotangent 1 or 3
      z = lax.cond(x < 0, tb, fb, x)  # call 2: cotangent 10 * (1 or 3)
      return y + 10.0 * z

    g = jax.vmap(jax.grad(f))
    _, collected = capture(jax.jit(g) if jit else g)(jnp.array([1.0, -1.0]))
    # x = 1 takes tb then fb; x = -1 takes fb then tb.
    self.assertLen(collected['p'], 2)
    np.testing.assert_allclose(collected['p'][0], [1.0, 3.0])
    np.testing.assert_allclose(collected['p'][1], [30.0, 10.0])


@jax.custom_jvp
def _cube_sowing(x):
  sow(x * x * x, name='s')
  return jnp.sin(x)


_cube_sowing.defjvp(lambda p, t: (_cube_sowing(p[0]), jnp.cos(p[0]) * t[0]))


def _product(a, v):
  return a * jnp.sum(v)


@jax.custom_jvp
def _folding_sin(x):
  sow(3.0 * jnp.sin(x), name='acc', reduce_fn=_product, init_fn=lambda: 1.0)
  return jnp.cos(x)


_folding_sin.defjvp(lambda p, t: (_folding_sin(p[0]), -jnp.sin(p[0]) * t[0]))


@jax.custom_vjp
def _vjp_sin_sowing(x):
  sow(3.0 * jnp.sin(x), name='s')
  return jnp.cos(x)


_vjp_sin_sowing.defvjp(
    lambda x: (_vjp_sin_sowing(x), x), lambda r, g: (-jnp.sin(r) * g,)
)


class SecondOrderThroughACustomBodyTest(absltest.TestCase):
  """The body's sown values are constants at every order of
  differentiation, not only the first."""

  def test_plain_value(self):
    s = lambda x: capture(_cube_sowing)(x)[1]['s'][0]
    # d/dx [x s(x)] = s + x ds/dx = s, and ds/dx = 0: the second derivative
    # is 0.
    x = jnp.float32(0.5)
    self.assertEqual(float(jax.grad(s)(x)), 0.0)
    self.assertEqual(float(jax.grad(jax.grad(lambda x: x * s(x)))(x)), 0.0)

  def test_hessian_of_an_accumulator(self):
    def f(x):
      sow(x * x, name='acc', reduce_fn=_product, init_fn=lambda: 1.0)
      return _folding_sin(x).sum()

    acc = lambda x: capture(f)(x)[1]['acc']
    x = jnp.array([0.5, -1.2])
    # acc = sum(x^2) * c with c = sum(3 sin x) held fixed: the hessian is
    # 2 c I.
    c = np.sum(3.0 * np.sin(np.asarray(x)))
    np.testing.assert_allclose(
        acc(x), np.sum(np.asarray(x) ** 2) * c, rtol=1e-5
    )
    np.testing.assert_allclose(
        jax.hessian(acc)(x), 2.0 * c * np.eye(2), rtol=1e-5, atol=1e-6
    )

  def test_custom_vjp_reverse_over_reverse(self):
    s = lambda x: capture(lambda x: _vjp_sin_sowing(x).sum())(x)[1]['s'][0]
    q = lambda x: jnp.sum(x * x) * jnp.sum(s(x))
    x = jnp.array([0.5, -1.2])
    c = np.sum(3.0 * np.sin(np.asarray(x)))
    np.testing.assert_allclose(
        jax.jacrev(jax.jacrev(q))(x), 2.0 * c * np.eye(2), rtol=1e-5, atol=1e-6
    )


@jax.custom_batching.custom_vmap
def _tanh_vmap_sowing(x):
  return jnp.tanh(sow(2.0 * x, name='pre'))


@_tanh_vmap_sowing.def_vmap
def _tanh_vmap_sowing_rule(axis_size, in_batched, xs):
  del axis_size
  return jnp.tanh(sow(2.0 * xs, name='pre')), in_batched[0]


@jax.custom_batching.custom_vmap
def _sum_vmap_sowing(x):
  return 2.0 * x + sow(x, name='tot', **_SUM)


@_sum_vmap_sowing.def_vmap
def _sum_vmap_sowing_rule(axis_size, in_batched, xs):
  del axis_size
  return 2.0 * xs + sow(xs, name='tot', **_SUM), in_batched[0]


class CustomVmapRuleUnderJvpTest(parameterized.TestCase):
  """JAX's JVP of a ``custom_vmap`` call runs the vmap rule under a vmap of
  its own that maps nothing here (every primal and tangent is batched): the
  rule's sows are what it sows, not broadcast over that vmap."""

  xs = jnp.array([0.5, -1.0])

  def _jvp(self, f):
    return lambda x: jax.jvp(f, (x,), (x,))

  @parameterized.named_parameters(
      ('vmap_inside', lambda f: capture(jax.vmap(f))),
      ('jit_vmap_inside', lambda f: capture(jax.jit(jax.vmap(f)))),
      ('vmap_around', lambda f: jax.vmap(capture(f))),
  )
  def test_plain_sow(self, arrange):
    (y, dy), got = arrange(self._jvp(_tanh_vmap_sowing))(self.xs)
    x = np.asarray(self.xs)
    np.testing.assert_allclose(y, np.tanh(2 * x), rtol=1e-6)
    np.testing.assert_allclose(dy, 2 * x / np.cosh(2 * x) ** 2, rtol=1e-5)
    (pre,) = got['pre']
    self.assertEqual(pre.shape, (2,))  # one per example, not (2, 2)
    np.testing.assert_allclose(pre, 2 * x, rtol=1e-6)

  def test_second_order(self):
    f = self._jvp(lambda y: self._jvp(_tanh_vmap_sowing)(y)[1])
    _, got = capture(jax.vmap(f))(self.xs)
    np.testing.assert_allclose(got['pre'][0], 2 * np.asarray(self.xs))

  def test_reduced_sow_folds_once(self):
    _, got = capture(jax.vmap(self._jvp(_sum_vmap_sowing)))(self.xs)
    # the rule folds sum(xs) = -0.5 once, as the call without jvp does
    _, plain = capture(jax.vmap(_sum_vmap_sowing))(self.xs)
    self.assertAlmostEqual(float(plain['tot']), -0.5)
    self.assertAlmostEqual(float(got['tot']), -0.5)


@jax.custom_batching.custom_vmap
def _counting_vmap(x):
  return jnp.sin(x)


@_counting_vmap.def_vmap
def _counting_vmap_rule(axis_size, in_batched, xs):
  del axis_size
  sow(jnp.sum(xs), name='s')
  sow(jnp.float32(1.0), name='n', **_SUM)
  return jnp.sin(xs), in_batched[0]


@jax.custom_batching.custom_vmap
def _product_vmap(x, y):
  return x * y


@_product_vmap.def_vmap
def _product_vmap_rule(axis_size, in_batched, x, y):
  del axis_size
  return sow(x * y, name='p'), in_batched[0] or in_batched[1]


class CustomVmapRuleMappedByItsJvpTest(absltest.TestCase):
  """Where JAX's JVP of a ``custom_vmap`` call maps the rule over arguments
  whose primal alone is batched, the rule runs per example, and its sows
  are batched as under any vmap."""

  xs = jnp.array([0.5, -1.0, 2.0])

  def test_unbatched_tangent(self):
    t = jnp.float32(1.5)
    jvp = lambda x: jax.jvp(_counting_vmap, (x,), (t,))
    (y, dy), got = capture(jax.vmap(jvp))(self.xs)
    x = np.asarray(self.xs)
    np.testing.assert_allclose(y, np.sin(x), rtol=1e-6)
    np.testing.assert_allclose(dy, 1.5 * np.cos(x), rtol=1e-6)
    # the rule sees one example at a time: sum(xs) is that example, and the
    # count folds once per example
    np.testing.assert_allclose(got['s'][0], x)
    self.assertEqual(float(got['n']), 3.0)

  def test_batched_tangent(self):
    jvp = lambda x: jax.jvp(_counting_vmap, (x,), (x,))
    _, got = capture(jax.vmap(jvp))(self.xs)
    # the rule sees the batch: one sum, one fold
    np.testing.assert_allclose(got['s'][0], 1.5, rtol=1e-6)
    self.assertEqual(float(got['n']), 1.0)

  def test_mixed_arguments_raise(self):
    t = jnp.float32(0.0)
    jvp = lambda x, y: jax.jvp(_product_vmap, (x, y), (x, t))
    with self.assertRaisesRegex(NotImplementedError, "sow 'p'.*custom_vmap"):
      capture(jax.vmap(jvp))(self.xs, self.xs)


@jax.custom_jvp
def _sin_sowing_tangent(x):
  return jnp.sin(x)


@_sin_sowing_tangent.defjvp
def _sin_sowing_tangent_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return _sin_sowing_tangent(x), sow(t, name='t') * jnp.cos(x)


@jax.custom_jvp
def _sin_rule_sowing_primal(x):
  return jnp.sin(x)


@_sin_rule_sowing_primal.defjvp
def _sin_rule_sowing_primal_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return _sin_rule_sowing_primal(x), sow(jnp.cos(x), name='c') * t


class SowOfATangentInACustomJvpRuleTest(parameterized.TestCase):
  """A sow of a tangent in a ``custom_jvp`` rule (a documented limit, no
  longer refused: the refusal needed a wrapper of JAX's custom_jvp bind) is
  collected as sown under jvp and per application under linearize, and is
  missing under grad/vjp (its value is transposed away); a sow of a primal
  value in the rule is collected once under each."""

  derivatives = (
      ('jvp', lambda f: lambda x: jax.jvp(f, (x,), (2 * x,))[1]),
      ('grad', jax.grad),
      ('jit_grad', lambda f: jax.jit(jax.grad(f))),
      ('linearize', lambda f: lambda x: jax.linearize(f, x)[1](x)),
      ('vjp', lambda f: lambda x: jax.vjp(f, x)[1](1.0)[0]),
  )

  @parameterized.named_parameters(*derivatives)
  def test_tangent_sow_is_the_documented_limit(self, d):
    x = jnp.float32(0.3)
    out, got = capture(d(_sin_sowing_tangent))(x)
    np.testing.assert_allclose(out, d(jnp.sin)(x), rtol=1e-6)
    name = self._testMethodName
    if name.endswith(('_jvp', '_linearize')) and not name.endswith('_vjp'):
      # The tangent the rule sows: 2 x under jvp, x under linearize.
      tangent = 2 * 0.3 if name.endswith('_jvp') else 0.3
      self.assertEqual(list(got), ['t'])
      self.assertLen(got['t'], 1)
      np.testing.assert_allclose(got['t'][0], tangent, rtol=1e-6)
    else:
      self.assertEqual(dict(got), {})  # transposed away: missing

  @parameterized.named_parameters(*derivatives)
  def test_primal_sow_in_the_rule(self, d):
    x = jnp.float32(0.3)
    _, got = capture(d(_sin_rule_sowing_primal))(x)
    self.assertEqual(list(got), ['c'])
    self.assertLen(got['c'], 1)
    np.testing.assert_allclose(got['c'][0], np.cos(0.3), rtol=1e-6)

  def test_undifferentiated(self):
    # the rule does not run: nothing to refuse, nothing collected
    out, got = capture(_sin_sowing_tangent)(jnp.float32(0.3))
    np.testing.assert_allclose(out, np.sin(0.3), rtol=1e-6)
    self.assertEqual(dict(got), {})


class RewriteProgramTest(parameterized.TestCase):
  """``rewrite_program`` (what the benchmarks time) collects the sows of a
  program staged outside any capture, whose sows are otherwise inert."""

  @parameterized.parameters(True, False)
  def test_collects_a_make_jaxpr_program(self, top_level):
    def f(x):
      h = sow(jnp.sin(x), name='h')
      return jax.jit(lambda h: sow(h * 2.0, name='y'))(h).sum()

    x = jnp.array([0.5, 1.0, 2.0])
    closed = jax.make_jaxpr(f)(x)
    new = rewrite_program(closed, top_level=top_level)
    out, h, y = jax.core.eval_jaxpr(new.jaxpr, new.consts, x)
    np.testing.assert_allclose(h, np.sin(x), rtol=1e-6)
    np.testing.assert_allclose(y, 2.0 * np.sin(x), rtol=1e-6)
    np.testing.assert_allclose(out, np.sum(2.0 * np.sin(x)), rtol=1e-6)


if __name__ == '__main__':
  absltest.main()
