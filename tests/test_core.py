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

"""Tests of the functional core: ``sow``, ``capture`` and ``perturb``.

Every expected value is computed independently of the code under test: by
hand, or by the same computation written without ``sow`` (plain ``jnp`` and
``jax.grad``). No expected value comes from a second call of ``capture``.
Loops and branches (``lax.scan``, ``while_loop``, ``cond``) are tested with
their rules, elsewhere.
"""

from __future__ import annotations

import threading

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import flax.nnx.sow
from flax.nnx.sow import capture
from flax.nnx.sow import sow

# ``perturb`` lands with the perturb pull request; the classes of this file
# that run on earlier prefixes (``tests/test_series.py``) do not use it.
perturb = getattr(flax.nnx.sow, 'perturb', None)

W1 = np.array(
    [[0.5, -1.0, 0.25], [1.5, 0.75, -0.5]], dtype=np.float32
)  # (2, 3)
W2 = np.array([[1.0], [-2.0], [0.5]], dtype=np.float32)  # (3, 1)
X = np.array([[0.1, -0.2], [0.3, 0.4]], dtype=np.float32)  # (2, 2)


def assert_close(actual, expected, rtol=1e-6, atol=1e-6):
  """Same pytree structure and leaves equal up to float tolerance."""
  a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
  e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
  assert a_tree == e_tree, f'structure {a_tree} != expected {e_tree}'
  for a, e in zip(a_leaves, e_leaves):
    np.testing.assert_allclose(
        np.asarray(a), np.asarray(e), rtol=rtol, atol=atol
    )


def assert_collected(test, collected, expected):
  """``collected`` has exactly ``expected``'s names, in order, and values."""
  test.assertIsInstance(collected, dict)
  test.assertEqual(list(collected), list(expected))
  for name, value in expected.items():
    if isinstance(value, tuple):
      test.assertIsInstance(collected[name], tuple, msg=repr(name))
      test.assertLen(collected[name], len(value), msg=repr(name))
    assert_close(collected[name], value)


def _eqn_names(jaxpr):
  return [eqn.primitive.name for eqn in jaxpr.eqns]


# ----------------------------------------------------------------------------
# 1. The seed example and the shape of ``collected``.


class SeedExampleTest(parameterized.TestCase):

  def test_seed_example(self):
    def layer(x):
      return jnp.tanh(x @ W1)

    def head(y):
      return y @ W2

    def f(x):
      y = layer(x)
      sow(y, name='features')
      return head(y)

    out, collected = capture(f)(X)
    y = np.tanh(X @ W1)  # computed without sow
    assert_close(out, y @ W2, rtol=1e-5)
    assert_close(out, f(X), rtol=1e-5)
    assert_collected(self, collected, {'features': (y,)})

  def test_same_name_twice_in_call_order(self):
    def f(x):
      a = sow(x * 2.0, name='a')
      b = sow(a + 1.0, name='a')
      return b * 3.0

    x = jnp.array([1.0, -2.0])
    out, collected = capture(f)(x)
    assert_close(out, (x * 2.0 + 1.0) * 3.0)
    assert_collected(self, collected, {'a': (x * 2.0, x * 2.0 + 1.0)})

  def test_pytree_value_keeps_structure(self):
    def f(x):
      tree = {'a': x, 'b': (x * 2.0, [x + 1.0])}
      tree = sow(tree, name='tree')
      return tree['b'][1][0]

    x = jnp.array([0.5, 1.5])
    out, collected = capture(f)(x)
    assert_close(out, x + 1.0)
    assert_collected(
        self,
        collected,
        {'tree': ({'a': x, 'b': (x * 2.0, [x + 1.0])},)},
    )

  def test_scalar_leaves_are_converted(self):
    def f(x):
      sow({'int': 3, 'float': 0.5, 'np': np.float32(2.0)}, name='s')
      return x

    _, collected = capture(f)(jnp.ones(()))
    value = collected['s'][0]
    self.assertEqual(value['int'].shape, ())
    self.assertEqual(int(value['int']), 3)
    self.assertEqual(float(value['float']), 0.5)
    self.assertEqual(float(value['np']), 2.0)

  @parameterized.parameters(
      ('blocks', 0, 'act'),
      ('a',),
      (1, 2),
  )
  def test_tuple_names(self, *name):
    def f(x):
      return sow(jnp.sin(x), name=name) + 1.0

    x = jnp.array([0.25, 0.5])
    out, collected = capture(f)(x)
    assert_close(out, np.sin(np.asarray(x)) + 1.0)
    assert_collected(self, collected, {name: (np.sin(np.asarray(x)),)})

  def test_keyword_arguments(self):
    def f(x, *, scale, offset=0.0):
      h = sow(x * scale, name='h')
      return h + offset

    x = jnp.array([1.0, 2.0])
    out, collected = capture(f)(x, scale=jnp.float32(3.0), offset=1.0)
    assert_close(out, x * 3.0 + 1.0)
    assert_collected(self, collected, {'h': (x * 3.0,)})

  @parameterized.parameters(True, False)
  def test_python_bool_reaches_f_as_bool(self, training):
    seen = []

    def f(x, training):
      seen.append(type(training))
      if training:  # would fail on a tracer
        x = sow(x * 2.0, name='train')
      return x + 1.0

    x = jnp.array([1.0, 2.0])
    out, collected = capture(f)(x, training)
    self.assertEqual(seen, [bool])
    if training:
      assert_close(out, x * 2.0 + 1.0)
      assert_collected(self, collected, {'train': (x * 2.0,)})
    else:
      assert_close(out, x + 1.0)
      assert_collected(self, collected, {})

  def test_non_array_leaves_reach_f_unchanged(self):
    marker = object()
    seen = {}

    def f(x, config):
      seen.update(config)
      sow(x * config['n'], name='h')
      return x, config['label']

    x = jnp.array([1.0, 2.0])
    config = {'n': 3, 'label': 'abc', 'none': None, 'obj': marker}
    (out, label), collected = capture(f)(x, config)
    self.assertIs(seen['obj'], marker)
    self.assertIs(type(seen['n']), int)
    self.assertIsNone(seen['none'])
    self.assertEqual(label, 'abc')
    assert_close(out, x)
    assert_collected(self, collected, {'h': (x * 3.0,)})

  def test_order_of_first_sow_with_mixed_names(self):
    def f(x):
      sow(x + 1.0, name='b')
      sow(x + 2.0, name='a')
      sow(x + 3.0, name='b')
      sow(x + 4.0, name=('t', 0))
      sow(x + 5.0, name='c')
      sow(x + 6.0, name=('t', 0))
      return x

    x = jnp.array([1.0, 2.0])
    expected = {
        'b': (x + 1.0, x + 3.0),
        'a': (x + 2.0,),
        ('t', 0): (x + 4.0, x + 6.0),
        'c': (x + 5.0,),
    }
    _, collected = capture(f)(x)
    assert_collected(self, collected, expected)
    _, collected = jax.jit(capture(f))(x)
    assert_collected(self, collected, expected)

  def test_no_sow_collects_nothing(self):
    out, collected = capture(lambda x: x * 2.0)(jnp.ones(2))
    assert_close(out, np.full(2, 2.0))
    self.assertEqual(collected, {})

  def test_reduced_name_top_level_and_in_jit(self):
    def add(acc, v):
      return acc + v

    def zeros():
      return jnp.zeros(2)

    def f(x):
      sow(x, name='s', reduce_fn=add, init_fn=zeros)
      x = jax.jit(
          lambda x: sow(x * 2.0, name='s', reduce_fn=add, init_fn=zeros)
      )(x)
      return x

    x = jnp.array([1.0, -1.0])
    out, collected = capture(f)(x)
    assert_close(out, x * 2.0)
    self.assertEqual(list(collected), ['s'])
    assert_close(collected['s'], x + x * 2.0)


# ----------------------------------------------------------------------------
# Outside a capture, sow is the identity under every transform.


class OutsideCaptureTest(absltest.TestCase):

  def test_identity_under_transforms(self):
    def f(x):
      h = sow(jnp.sin(x), name='h')
      return jnp.sum(h * x)

    x = jnp.array([0.3, -0.7])
    xn = np.asarray(x)
    expected_grad = np.cos(xn) * xn + np.sin(xn)
    assert_close(f(x), np.sum(np.sin(xn) * xn), rtol=1e-5)
    assert_close(jax.jit(f)(x), np.sum(np.sin(xn) * xn), rtol=1e-5)
    assert_close(jax.grad(f)(x), expected_grad, rtol=1e-5)
    assert_close(jax.vmap(f)(x[:, None]), np.sin(xn) * xn, rtol=1e-5)

  def test_jitted_sow_compiles_to_nothing(self):
    def f(x):
      return sow(x, name='h') * 2.0

    text = jax.jit(f).lower(jnp.ones(3)).as_text()
    self.assertNotIn('sow', text)

  def test_jit_outside_capture_has_no_effect(self):
    # Outside a capture nothing collects a sow, so a jitted function keeps
    # no effect (and JAX's C++ dispatch fast path); the same jitted function
    # still gives its unused sow to a capture, also under jax.grad.
    g = jax.jit(lambda x: (sow(x * 3.0, name='unused'), x)[1])
    x = jnp.array([1.0, 2.0])
    assert_close(g(x), np.array([1.0, 2.0]))
    self.assertFalse(jax.make_jaxpr(g)(x).effects)
    _, collected = capture(g)(x)
    assert_close(collected['unused'][0], np.array([3.0, 6.0]))
    grad, collected = capture(jax.grad(lambda x: g(x).sum()))(x)
    assert_close(grad, np.ones(2))
    assert_close(collected['unused'][0], np.array([3.0, 6.0]))


  def test_a_jaxpr_with_tuple_names_prints(self):
    # JAX's printer reads an equation's ``name`` param as a str (a jit's
    # name); a sow keeps its name under another key, so printing a program
    # with path names works, also under jit and jvp (a perturb's tangent).
    def f(x):
      return perturb(sow(x, name=('a', 0)), name=('g', 1)) * 2.0

    x = jnp.ones(2)
    jvp = lambda x: jax.jvp(f, (x,), (x,))
    for g in (f, jax.jit(f), jvp):
      text = str(jax.make_jaxpr(g)(x))
      self.assertIn("sow_name=('a', 0)", text)
      self.assertIn("sow_name=('g', 1)", text)
    self.assertIn('perturb_tangent', str(jax.make_jaxpr(jvp)(x)))

# ----------------------------------------------------------------------------
# 2. Unused sows and sown constants.


class UnusedAndConstantTest(absltest.TestCase):

  def test_unused_sow_top_level(self):
    def f(x):
      sow(x * 2.0, name='unused')
      return x + 1.0

    x = jnp.array([1.0, 2.0])
    out, collected = capture(f)(x)
    assert_close(out, x + 1.0)
    assert_collected(self, collected, {'unused': (x * 2.0,)})

  def test_unused_sow_in_jit(self):
    @jax.jit
    def inner(x):
      sow(x * 2.0, name='unused')
      return x + 1.0

    x = jnp.array([1.0, 2.0])
    out, collected = capture(lambda x: inner(x) * 3.0)(x)
    assert_close(out, (x + 1.0) * 3.0)
    assert_collected(self, collected, {'unused': (x * 2.0,)})

  def test_sown_constant_top_level(self):
    def f(x):
      sow(jnp.arange(3.0), name='const')
      return x

    out, collected = capture(f)(jnp.ones(2))
    assert_close(out, np.ones(2))
    assert_collected(self, collected, {'const': (np.arange(3.0),)})

  def test_sown_constant_in_jit(self):
    @jax.jit
    def inner(x):
      sow(jnp.arange(3.0) * 2.0, name='const')
      sow(np.float32(7.0), name='np_const')
      return x - 1.0

    out, collected = capture(inner)(jnp.ones(2))
    assert_close(out, np.zeros(2))
    assert_collected(
        self,
        collected,
        {'const': (np.arange(3.0) * 2.0,), 'np_const': (np.float32(7.0),)},
    )

  def test_sown_constant_in_checkpoint(self):
    @jax.checkpoint
    def inner(x):
      sow(jnp.full((2,), 4.0), name='const')
      return jnp.sin(x)

    x = jnp.array([0.1, 0.2])
    out, collected = capture(inner)(x)
    assert_close(out, np.sin(np.asarray(x)))
    assert_collected(self, collected, {'const': (np.full((2,), 4.0),)})


# ----------------------------------------------------------------------------
# 3. jit stays a jit and is not retraced or recompiled.


class JitTest(absltest.TestCase):

  def test_jit_equation_is_kept(self):
    @jax.jit
    def g(x):
      return sow(jnp.sin(x), name='h') * 2.0

    x = jnp.array([0.5, 1.0])
    jaxpr = jax.make_jaxpr(capture(g))(x)
    self.assertIn('jit', _eqn_names(jaxpr.jaxpr))
    self.assertNotIn('sow', _eqn_names(jaxpr.jaxpr))
    (jit_eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == 'jit']
    # The jit returns its output and the collected value.
    self.assertLen(jit_eqn.outvars, 2)

  def test_nested_jits_are_kept(self):
    @jax.jit
    def inner(x):
      return sow(x + 1.0, name='inner') * 2.0

    @jax.jit
    def outer(x):
      return sow(inner(x), name='outer') - 1.0

    x = jnp.array([1.0, 2.0])
    jaxpr = jax.make_jaxpr(capture(outer))(x)
    (outer_eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == 'jit']
    self.assertIn('jit', _eqn_names(outer_eqn.params['jaxpr'].jaxpr))
    out, collected = capture(outer)(x)
    assert_close(out, (x + 1.0) * 2.0 - 1.0)
    assert_collected(
        self, collected, {'inner': (x + 1.0,), 'outer': ((x + 1.0) * 2.0,)}
    )

  def test_no_retrace_or_recompile(self):
    calls = []

    def body(x):
      calls.append(None)
      return sow(jnp.cos(x) * 3.0, name='h') + x

    g = jax.jit(body)
    x = jnp.array([0.25, 0.5, 0.75])
    expected_h = np.cos(np.asarray(x)) * 3.0
    compiles = []

    def on_event(event, duration, **kwargs):
      del duration, kwargs
      if event == '/jax/core/compile/backend_compile_duration':
        compiles.append(event)

    captured = capture(g)
    out, collected = captured(x)  # traces and compiles once
    assert_close(out, expected_h + np.asarray(x))
    assert_collected(self, collected, {'h': (expected_h,)})
    self.assertLen(calls, 1)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
      for _ in range(3):
        out, collected = captured(x)
        assert_close(out, expected_h + np.asarray(x))
        assert_collected(self, collected, {'h': (expected_h,)})
      # A new capture object of the same jitted function hits the caches too.
      out, collected = capture(g)(x)
      assert_close(out, expected_h + np.asarray(x))
    finally:
      jax.monitoring.unregister_event_duration_listener(on_event)
    self.assertLen(calls, 1)
    self.assertEqual(compiles, [])


# ----------------------------------------------------------------------------
# 4. Custom derivative rules stay in force.


def relu_net(x):
  h = sow(jax.nn.relu(x), name='h')
  return jnp.sum(h * 2.0)


@jax.custom_jvp
def sowing_relu(x):
  y = jnp.maximum(x, 0.0)  # autodiff of this body gives 0.5 at 0
  sow(y, name='inside_jvp')
  return y


@sowing_relu.defjvp
def _sowing_relu_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return jnp.maximum(x, 0.0), jnp.where(x > 0, t, 0.0)


@jax.custom_vjp
def ste_round(x):
  return jnp.round(x)


def _ste_fwd(x):
  return jnp.round(x), None


def _ste_bwd(_, g):
  return (g,)


ste_round.defvjp(_ste_fwd, _ste_bwd)


@jax.custom_vjp
def sowing_ste_round(x):
  y = jnp.round(x)
  sow(y, name='inside_vjp')
  return y


sowing_ste_round.defvjp(_ste_fwd, _ste_bwd)


class EagerJittedTest(absltest.TestCase):
  """Eager ``capture(jax.jit(step))``: traced numbers as ``jax.jit`` does."""

  def test_numbers_keyed_by_type_and_not_recompiled(self):
    step = jax.jit(lambda x, s: sow(x * s, name='y') + 1)
    captured = capture(step)
    out, collected = captured(jnp.arange(3.0), 2.0)
    assert_close(out, np.array([1.0, 3.0, 5.0]))
    out, collected = captured(jnp.arange(3), 2)  # 2 == 2.0, but int
    self.assertEqual(out.dtype, jnp.int32)
    np.testing.assert_array_equal(out, [1, 3, 5])
    np.testing.assert_array_equal(collected['y'][0], [0, 2, 4])
    inv = capture(jax.jit(lambda x, s: sow(x / s, name='q')))
    self.assertEqual(float(inv(jnp.float32(1.0), 0.0)[0]), np.inf)
    self.assertEqual(float(inv(jnp.float32(1.0), -0.0)[0]), -np.inf)
    compiles = []

    def on_event(event, duration, **kwargs):
      del duration, kwargs
      if event == '/jax/core/compile/backend_compile_duration':
        compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
      for lr in (0.5, 0.25, 0.125):  # a new Python float per step
        out, collected = captured(jnp.arange(3.0), lr)
        assert_close(collected['y'][0], np.arange(3.0) * lr)
    finally:
      jax.monitoring.unregister_event_duration_listener(on_event)
    self.assertEqual(compiles, [])

  def test_static_argument_keyed_by_value(self):
    step = jax.jit(lambda x, n: sow(x * n, name='y'), static_argnums=1)
    captured = capture(step)
    for n in (2, 3):
      out, collected = captured(jnp.ones(2), n)
      np.testing.assert_allclose(out, [n, n])
      np.testing.assert_allclose(collected['y'][0], [n, n])


class CustomRuleTest(parameterized.TestCase):

  def test_relu_at_zero(self):
    x = jnp.float32(0.0)
    self.assertEqual(float(jax.grad(relu_net)(x)), 0.0)  # the reference
    grad = jax.grad(lambda x: capture(relu_net)(x)[0])(x)
    self.assertEqual(float(grad), 0.0)
    grad = jax.grad(lambda x: capture(jax.jit(relu_net))(x)[0])(x)
    self.assertEqual(float(grad), 0.0)

  def test_custom_jvp_with_sow_inside(self):
    def f(x):
      return jnp.sum(sowing_relu(x) * 3.0)

    x = jnp.array([0.0, 2.0, -1.0])
    # By the custom rule: 3 where x > 0, else 0 (0 at x = 0, not 1.5).
    expected = np.array([0.0, 3.0, 0.0])
    assert_close(jax.grad(f)(x), expected)
    grad = jax.grad(lambda x: capture(f)(x)[0])(x)
    assert_close(grad, expected)
    grad = jax.grad(lambda x: capture(jax.jit(f))(x)[0])(x)
    assert_close(grad, expected)

  @parameterized.parameters(False, True)
  def test_straight_through_round(self, with_sow):
    fn = sowing_ste_round if with_sow else ste_round

    def f(x):
      return jnp.sum(fn(x) * 2.0)

    x = jnp.array([0.3, 1.7, -0.6])
    expected = np.full(3, 2.0)  # straight through: 2, not 0
    assert_close(jax.grad(f)(x), expected)
    grad = jax.grad(lambda x: capture(f)(x)[0])(x)
    assert_close(grad, expected)
    grad = jax.grad(lambda x: capture(jax.jit(f))(x)[0])(x)
    assert_close(grad, expected)


# ----------------------------------------------------------------------------
# 5. Sows in custom derivative rules and bodies.


@jax.custom_vjp
def square_sowing_bwd(x):
  return x**2


def _square_fwd(x):
  return x**2, x


def _square_bwd(x, g):
  sow(2.0 * x, name='dh')
  return (g * 2.0 * x,)


square_sowing_bwd.defvjp(_square_fwd, _square_bwd)


class CustomBodyTest(absltest.TestCase):

  def test_sow_in_custom_vjp_bwd(self):
    out, collected = capture(jax.grad(square_sowing_bwd))(3.0)
    self.assertEqual(float(out), 6.0)
    assert_collected(self, collected, {'dh': (np.float32(6.0),)})

  def test_sow_in_custom_vjp_bwd_vector_under_jit(self):
    def loss(x):
      return jnp.sum(square_sowing_bwd(x))

    x = jnp.array([1.0, -2.0, 0.5])
    out, collected = capture(jax.jit(jax.grad(loss)))(x)
    assert_close(out, 2.0 * x)
    assert_collected(self, collected, {'dh': (2.0 * x,)})

  def test_no_differentiation_no_bwd_sow(self):
    out, collected = capture(square_sowing_bwd)(3.0)
    self.assertEqual(float(out), 9.0)
    self.assertEqual(collected, {})

  def test_sow_in_custom_jvp_primal_body(self):
    x = jnp.array([-1.0, 0.0, 2.0])
    out, collected = capture(sowing_relu)(x)
    expected = np.maximum(np.asarray(x), 0.0)
    assert_close(out, expected)
    assert_collected(self, collected, {'inside_jvp': (expected,)})

  def test_sow_in_custom_vjp_primal_body(self):
    x = jnp.array([0.3, 1.7, -0.6])
    out, collected = capture(sowing_ste_round)(x)
    expected = np.round(np.asarray(x))
    assert_close(out, expected)
    assert_collected(self, collected, {'inside_vjp': (expected,)})

  def test_custom_bodies_under_jit(self):
    def f(x):
      return sowing_relu(x) + sowing_ste_round(x)

    x = jnp.array([0.3, 1.7, -0.6])
    out, collected = capture(jax.jit(f))(x)
    xn = np.asarray(x)
    assert_close(out, np.maximum(xn, 0.0) + np.round(xn))
    assert_collected(
        self,
        collected,
        {'inside_jvp': (np.maximum(xn, 0.0),), 'inside_vjp': (np.round(xn),)},
    )


# ----------------------------------------------------------------------------
# 6. perturb.


def perturb_loss(w, x):
  h = perturb(jnp.tanh(w * x), name='h')
  return jnp.sum(jnp.sin(h))


def perturb_expected(w, x):
  """(loss, dloss/dw, dloss/dh), by hand."""
  w, x = np.float64(w), np.asarray(x, np.float64)
  h = np.tanh(w * x)
  dh = np.cos(h)
  dw = np.sum(dh * (1.0 - h**2) * x)
  return np.sum(np.sin(h)), dw, dh


class PerturbTest(absltest.TestCase):
  w = np.float32(0.7)
  x = np.array([0.5, -1.0, 2.0], np.float32)

  def test_forward_mode_is_identity(self):
    # sow and perturb stay identities under forward mode (jvp, jacfwd,
    # hessian), inside and outside a capture.
    def f(x):
      h = sow(jnp.sin(x), name='h')
      return jnp.sum(perturb(h, name='p') ** 2)

    x = jnp.array([0.3, -1.2])
    xn = np.asarray(x)
    grad = 2 * np.sin(xn) * np.cos(xn)
    assert_close(jax.jacfwd(f)(x), grad, rtol=1e-5)
    assert_close(jax.jacrev(f)(x), grad, rtol=1e-5)
    assert_close(
        jax.hessian(f)(x), np.diag(2 * np.cos(2 * xn)), rtol=1e-5, atol=1e-6
    )
    _, tangent = jax.jvp(f, (x,), (jnp.ones(2),))
    assert_close(tangent, grad.sum(), rtol=1e-5)
    out, collected = capture(jax.jacfwd(f))(x)
    assert_close(out, grad, rtol=1e-5)
    self.assertEqual(list(collected), ['h'])  # forward mode: no cotangent

  def test_unbatched_operand_stays_unbatched_under_vmap(self):
    f = lambda x, y: sow((x, y), name='h')[1]
    out = jax.vmap(f, in_axes=(0, None), out_axes=None)(jnp.ones(3), 2.0)
    self.assertEqual(float(out), 2.0)

  def test_cotangents_in_call_order(self):
    def loss(x):
      a = perturb(x * 2.0, name='h')
      b = perturb(x * 3.0, name='h')
      c = perturb(a * b, name='later')
      sow(c, name='value')
      return 10.0 * a + 100.0 * b + c

    _, collected = capture(jax.grad(loss))(1.0)
    # Names in order of first use in the forward pass; entries in call
    # order: dL/da = 10 + b = 13, dL/db = 100 + a = 102, dL/dc = 1.
    self.assertEqual(list(collected), ['h', 'later', 'value'])
    assert_close(collected['h'][0], 13.0)
    assert_close(collected['h'][1], 102.0)
    assert_close(collected['later'][0], 1.0)
    assert_close(collected['value'][0], 6.0)

  def test_sow_on_tangent_in_custom_jvp_rule(self):
    @jax.custom_jvp
    def h(x):
      return jnp.sin(x)

    @h.defjvp
    def _h_jvp(primals, tangents):
      sow(tangents[0], name='tangent')
      return jnp.sin(primals[0]), jnp.cos(primals[0]) * tangents[0]

    # Outside a capture the sow is the identity on the tangent.
    assert_close(jax.grad(h)(1.0), np.cos(1.0))
    # Inside one it is collected as sown under jax.jvp (the tangent), and
    # missing under jax.grad (transposed away): a documented limit, no longer
    # refused (that needed a wrapper of JAX's custom_jvp bind).
    out, collected = capture(jax.grad(h))(1.0)
    assert_close(out, np.cos(1.0))
    self.assertEqual(dict(collected), {})
    (_, out), collected = capture(lambda x: jax.jvp(h, (x,), (2.0 * x,)))(1.0)
    assert_close(out, 2.0 * np.cos(1.0))
    assert_close(collected['tangent'][0], 2.0)

  def test_capture_grad(self):
    _, dw, dh = perturb_expected(self.w, self.x)
    out, collected = capture(jax.grad(perturb_loss))(self.w, self.x)
    assert_close(out, dw, rtol=1e-5)
    assert_collected(self, collected, {'h': (dh,)})

  def test_capture_jit_grad(self):
    _, dw, dh = perturb_expected(self.w, self.x)
    out, collected = capture(jax.jit(jax.grad(perturb_loss)))(self.w, self.x)
    assert_close(out, dw, rtol=1e-5)
    assert_collected(self, collected, {'h': (dh,)})

  def test_capture_value_and_grad(self):
    loss, dw, dh = perturb_expected(self.w, self.x)
    (value, grad), collected = capture(jax.value_and_grad(perturb_loss))(
        self.w, self.x
    )
    assert_close(value, loss, rtol=1e-5)
    assert_close(grad, dw, rtol=1e-5)
    assert_collected(self, collected, {'h': (dh,)})

  def test_capture_jit_value_and_grad(self):
    loss, dw, dh = perturb_expected(self.w, self.x)
    (value, grad), collected = capture(
        jax.jit(jax.value_and_grad(perturb_loss))
    )(self.w, self.x)
    assert_close(value, loss, rtol=1e-5)
    assert_close(grad, dw, rtol=1e-5)
    assert_collected(self, collected, {'h': (dh,)})

  def test_not_differentiated_collects_nothing(self):
    loss, _, _ = perturb_expected(self.w, self.x)
    out, collected = capture(perturb_loss)(self.w, self.x)
    assert_close(out, loss, rtol=1e-5)
    self.assertEqual(collected, {})

  def test_grad_around_capture(self):
    _, dw, _ = perturb_expected(self.w, self.x)
    grad = jax.grad(lambda w: capture(perturb_loss)(w, self.x)[0])(self.w)
    assert_close(grad, dw, rtol=1e-5)

  def test_perturb_outside_capture_is_identity(self):
    loss, dw, _ = perturb_expected(self.w, self.x)
    assert_close(perturb_loss(self.w, self.x), loss, rtol=1e-5)
    assert_close(jax.grad(perturb_loss)(self.w, self.x), dw, rtol=1e-5)

  def test_pytree_value_and_tuple_name(self):
    def loss(x):
      tree = perturb({'a': x, 'b': x * 2.0}, name=('layer', 0))
      return jnp.sum(tree['a'] * 3.0 + tree['b'] ** 2)

    x = jnp.array([1.0, -0.5])
    out, collected = capture(jax.grad(loss))(x)
    # loss = sum(3x + 4x^2): dloss/dx = 3 + 8x; d/da = 3; d/db = 2b = 4x.
    assert_close(out, 3.0 + 8.0 * x)
    assert_collected(
        self,
        collected,
        {('layer', 0): ({'a': np.full(2, 3.0), 'b': 4.0 * x},)},
    )


# ----------------------------------------------------------------------------
# 7. checkpoint with a policy.


def _checkpointed():
  def block(x):
    h = sow(jnp.sin(x), name='h')
    return jnp.sum(jnp.cos(h))

  return jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)


class CheckpointTest(absltest.TestCase):
  x = np.array([0.2, -0.4, 1.1], np.float32)

  def test_collected_once_per_forward_call(self):
    f = _checkpointed()
    out, collected = capture(f)(self.x)
    assert_close(out, np.sum(np.cos(np.sin(self.x))), rtol=1e-5)
    assert_collected(self, collected, {'h': (np.sin(self.x),)})

  def test_two_calls_two_entries(self):
    f = _checkpointed()
    out, collected = capture(lambda x: f(x) + f(2.0 * x))(self.x)
    expected = np.sum(np.cos(np.sin(self.x))) + np.sum(
        np.cos(np.sin(2.0 * self.x))
    )
    assert_close(out, expected, rtol=1e-5)
    assert_collected(
        self, collected, {'h': (np.sin(self.x), np.sin(2.0 * self.x))}
    )

  def test_collected_once_under_grad(self):
    f = _checkpointed()
    grad, collected = capture(jax.grad(f))(self.x)
    expected_grad = -np.sin(np.sin(self.x)) * np.cos(self.x)
    assert_close(grad, expected_grad, rtol=1e-5)
    assert_collected(self, collected, {'h': (np.sin(self.x),)})

  def test_gradient_unchanged_around_capture(self):
    f = _checkpointed()
    expected_grad = -np.sin(np.sin(self.x)) * np.cos(self.x)
    grad = jax.grad(lambda x: capture(f)(x)[0])(self.x)
    assert_close(grad, expected_grad, rtol=1e-5)

  def test_policy_is_kept(self):
    policy = jax.checkpoint_policies.nothing_saveable
    f = _checkpointed()
    jaxpr = jax.make_jaxpr(capture(f))(self.x)
    remats = [
        e
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name in ('checkpoint', 'remat2')
    ]
    self.assertLen(remats, 1)
    self.assertIs(remats[0].params['policy'], policy)


# ----------------------------------------------------------------------------
# 8. vmap around and inside capture.


class VmapTest(absltest.TestCase):

  def test_vmap_of_capture_stacks_on_axis_0(self):
    def f(x):
      h = sow(jnp.sin(x) * 2.0, name='h')
      sow(jnp.arange(2.0), name='const')
      return jnp.sum(h)

    xs = np.arange(12.0, dtype=np.float32).reshape(4, 3) / 10.0
    out, collected = jax.vmap(capture(f))(xs)
    assert_close(out, np.sum(np.sin(xs) * 2.0, axis=1), rtol=1e-5)
    assert_collected(
        self,
        collected,
        {'h': (np.sin(xs) * 2.0,), 'const': (np.tile(np.arange(2.0), (4, 1)),)},
    )

  def test_capture_of_vmap_in_axes_1_mapped_axis_first(self):
    def f(col):  # col: (3,)
      h = sow(jnp.sin(col) * 2.0, name='h')
      sow(jnp.ones(2), name='unbatched')
      return jnp.sum(h)

    x = np.arange(12.0, dtype=np.float32).reshape(3, 4) / 10.0
    out, collected = capture(jax.vmap(f, in_axes=1))(x)
    assert_close(out, np.sum(np.sin(x) * 2.0, axis=0), rtol=1e-5)
    assert_collected(
        self,
        collected,
        {'h': ((np.sin(x) * 2.0).T,), 'unbatched': (np.ones((4, 2)),)},
    )


# ----------------------------------------------------------------------------
# 9. Gradients flow through collected values.


class GradThroughCollectedTest(absltest.TestCase):

  def test_grad_of_collected_value(self):
    def f(x):
      h = sow(jnp.sin(x) * x, name='h')
      return jnp.sum(h**2)

    x = np.array([0.3, -1.2, 2.0], np.float32)
    grad = jax.grad(lambda x: capture(f)(x)[1]['h'][0].sum())(x)
    # d/dx sum(sin(x) x) = cos(x) x + sin(x), written without sow.
    assert_close(grad, np.cos(x) * x + np.sin(x), rtol=1e-5)
    assert_close(
        grad, jax.grad(lambda x: jnp.sum(jnp.sin(x) * x))(x), rtol=1e-5
    )

  def test_grad_of_collected_value_from_jit(self):
    @jax.jit
    def f(x):
      h = sow(jnp.exp(x) * 2.0, name='h')
      return jnp.sum(h)

    x = np.array([0.3, -1.2], np.float32)
    grad = jax.grad(lambda x: capture(f)(x)[1]['h'][0].sum())(x)
    assert_close(grad, np.exp(x) * 2.0, rtol=1e-5)


# ----------------------------------------------------------------------------
# Differentiation inside the captured function collects the primal.


class AutodiffInsideTest(absltest.TestCase):

  def test_grad_inside_collects_primal_once(self):
    def f(x):
      h = sow(jnp.sin(x), name='h')
      return jnp.sum(h**2)

    x = np.array([0.3, -0.8], np.float32)
    grad, collected = capture(jax.grad(f))(x)
    assert_close(grad, 2.0 * np.sin(x) * np.cos(x), rtol=1e-5)
    assert_collected(self, collected, {'h': (np.sin(x),)})

  def test_jvp_inside_collects_primal_once(self):
    def f(x):
      return sow(x**3, name='h')

    x = np.array([2.0, -1.0], np.float32)
    t = np.array([1.0, 0.5], np.float32)
    (y, dy), collected = capture(lambda x: jax.jvp(f, (x,), (t,)))(x)
    assert_close(y, x**3)
    assert_close(dy, 3.0 * x**2 * t)
    assert_collected(self, collected, {'h': (x**3,)})


# ----------------------------------------------------------------------------
# 10. Bad input and exceptions.


class MyError(Exception):
  pass


class ErrorTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('none', None),
      ('float', 3.5),
      ('list', ['a', 'b']),
      ('empty_tuple', ()),
      ('tuple_with_float', ('a', 1.5)),
  )
  def test_bad_name(self, name):
    x = jnp.ones(2)
    with self.assertRaises(TypeError):
      sow(x, name=name)
    with self.assertRaises(TypeError):
      capture(lambda x: sow(x, name=name))(x)
    with self.assertRaises(TypeError):
      capture(jax.grad(lambda x: jnp.sum(perturb(x, name=name))))(x)

  def test_string_leaf_names_the_sow(self):
    def f(x):
      sow({'ok': x, 'bad': 'hello'}, name='my_value')
      return x

    with self.assertRaisesRegex(TypeError, 'my_value'):
      capture(f)(jnp.ones(2))
    with self.assertRaisesRegex(TypeError, 'my_value'):
      sow('hello', name='my_value')

  @parameterized.named_parameters(
      ('reduce_only', {'reduce_fn': lambda a, v: a + v}),
      ('init_only', {'init_fn': lambda: jnp.zeros(2)}),
  )
  def test_reduce_fn_and_init_fn_go_together(self, kwargs):
    with self.assertRaises(TypeError):
      capture(lambda x: sow(x, name='r', **kwargs))(jnp.ones(2))

  @parameterized.product(
      arg=['reduce_fn', 'init_fn'],
      wrap=['eager', 'capture', 'jit_capture', 'capture_grad'],
  )
  def test_reduce_fn_and_init_fn_must_be_callable(self, arg, wrap):
    kwargs = {'reduce_fn': lambda a, v: a + v, 'init_fn': lambda: 0.0}
    kwargs[arg] = 3

    def f(x):
      return jnp.sum(sow(x, name=('block', 0, 'r'), **kwargs))

    run = {
        'eager': f,
        'capture': capture(f),
        'jit_capture': jax.jit(capture(f)),
        'capture_grad': capture(jax.grad(f)),
    }[wrap]
    expected = {
        'reduce_fn': 'reduce_fn(acc, value) -> acc, got 3 of type int',
        'init_fn': 'init_fn() -> acc, got 3 of type int',
    }[arg]
    with self.assertRaises(TypeError) as cm:
      run(jnp.ones(2))
    message = str(cm.exception)
    self.assertStartsWith(message, f"sow ('block', 0, 'r'): {arg} must be")
    self.assertIn(expected, message)

  @parameterized.named_parameters(
      ('jit_capture', lambda f: jax.jit(capture(f))),
      ('capture', capture),
      ('capture_jit', lambda f: capture(jax.jit(f))),
      ('jit_capture_jit', lambda f: jax.jit(capture(jax.jit(f)))),
  )
  def test_exception_propagates_unchanged(self, wrap):
    message = 'boom: value 42 is wrong'

    def f(x):
      sow(x * 2.0, name='before')
      raise MyError(message)

    with self.assertRaises(MyError) as cm:
      wrap(f)(jnp.ones(3))
    self.assertIs(type(cm.exception), MyError)
    self.assertEqual(str(cm.exception), message)
    self.assertEqual(cm.exception.args, (message,))
    # JAX is usable afterwards: eager arithmetic gives concrete arrays.
    y = jnp.ones(3) + 1.0
    self.assertIsInstance(y, jax.Array)
    self.assertNotIsInstance(y, jax.core.Tracer)
    np.testing.assert_array_equal(np.asarray(y), np.full(3, 2.0))
    # And a capture afterwards works.
    out, collected = capture(lambda x: sow(x + 1.0, name='after'))(jnp.zeros(2))
    self.assertNotIsInstance(out, jax.core.Tracer)
    assert_close(out, np.ones(2))
    assert_collected(self, collected, {'after': (np.ones(2),)})

  def test_bad_tags_argument(self):
    with self.assertRaises(TypeError):
      capture(lambda x: x, tags=3)
    with self.assertRaisesRegex(TypeError, 'capture: every tag must be'):
      capture(lambda x: x, tags=[['t']])


# ----------------------------------------------------------------------------
# 11. Concurrent captures on several threads.


class ThreadTest(absltest.TestCase):

  def test_eight_threads_get_their_own_values(self):
    n = 8
    barrier = threading.Barrier(n, timeout=60)
    results = [None] * n
    errors = []

    def make(i):
      @jax.jit
      def inner(x):
        return sow(jnp.sin(x) * i, name='shared') + i

      def f(x):
        h = sow(x * i + i, name=f'own{i}')
        return inner(h)

      return f

    def expected(i, x):
      h = x * i + i
      return np.sin(h) * i + i, {f'own{i}': (h,), 'shared': (np.sin(h) * i,)}

    def worker(i):
      try:
        x = np.arange(i + 1, dtype=np.float32) / 4.0  # shape differs
        f = make(i)
        barrier.wait()
        runs = []
        for _ in range(3):
          runs.append(capture(f)(x))
        results[i] = (x, runs)
      except Exception as e:  # pylint: disable=broad-except  # noqa: BLE001
        errors.append((i, e))
        barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    self.assertEqual(errors, [])
    for i in range(n):
      x, runs = results[i]
      exp_out, exp_collected = expected(i, x)
      for out, collected in runs:
        assert_close(out, exp_out, rtol=1e-5)
        assert_collected(self, collected, exp_collected)


# ----------------------------------------------------------------------------
# 12. tags and nested captures.


def tagged(x):
  sow(x + 1.0, name='a', tag='x')
  sow(x + 2.0, name='b', tag='y')
  sow(x + 3.0, name='c')
  return x * 2.0


class NameKeysTest(absltest.TestCase):
  """A ``names=`` callable written inline at every call is a new object each
  time; the capture compares it by what it selects, so a ``jax.jit``
  function inside is traced once."""

  def test_inline_lambda_traces_a_jitted_function_once(self):
    traces = []

    @jax.jit
    def f(x):
      traces.append(None)
      return sow(x * 2.0, name='a') + sow(x, name='b')

    for i in range(4):
      x = jnp.full((2,), float(i))
      out, collected = capture(f, names=lambda n: n == 'a')(x)
      np.testing.assert_allclose(out, 3.0 * i)
      self.assertEqual(list(collected), ['a'])
      np.testing.assert_allclose(collected['a'][0], 2.0 * i)
    self.assertLen(traces, 1)

  def test_a_lambda_that_selects_other_names_is_honoured(self):
    f = jax.jit(lambda x: sow(x + 1.0, name='a') * sow(x, name='b'))
    x = jnp.ones(3)
    for wanted, value in (('a', 2.0), ('b', 1.0), ('a', 2.0)):
      _, collected = capture(f, names=lambda n, w=wanted: n == w)(x)
      self.assertEqual(list(collected), [wanted])
      np.testing.assert_allclose(collected[wanted][0], np.full(3, value))


class TagTest(absltest.TestCase):
  x = np.array([1.0, 2.0], np.float32)

  def test_no_tags_collects_all(self):
    out, collected = capture(tagged)(self.x)
    assert_close(out, self.x * 2.0)
    assert_collected(
        self,
        collected,
        {'a': (self.x + 1.0,), 'b': (self.x + 2.0,), 'c': (self.x + 3.0,)},
    )

  def test_tags_filter(self):
    _, collected = capture(tagged, tags=('x',))(self.x)
    assert_collected(self, collected, {'a': (self.x + 1.0,)})
    _, collected = capture(tagged, tags={'x', None})(self.x)
    assert_collected(
        self, collected, {'a': (self.x + 1.0,), 'c': (self.x + 3.0,)}
    )
    _, collected = capture(tagged, tags=['z'])(self.x)
    self.assertEqual(collected, {})

  def test_tags_filter_in_jit(self):
    _, collected = capture(jax.jit(tagged), tags=('y',))(self.x)
    assert_collected(self, collected, {'b': (self.x + 2.0,)})

  def test_nested_innermost_accepting_capture_collects(self):
    def outer_fn(x):
      out, inner = capture(tagged, tags=('x',))(x)
      return out, inner

    (out, inner), outer = capture(outer_fn)(self.x)
    assert_close(out, self.x * 2.0)
    assert_collected(self, inner, {'a': (self.x + 1.0,)})
    assert_collected(self, outer, {'b': (self.x + 2.0,), 'c': (self.x + 3.0,)})

  def test_nested_through_jit(self):
    @jax.jit
    def middle(x):
      return capture(jax.jit(tagged), tags=('y',))(x)

    (out, inner), outer = capture(middle, tags=('x', None))(self.x)
    assert_close(out, self.x * 2.0)
    assert_collected(self, inner, {'b': (self.x + 2.0,)})
    assert_collected(self, outer, {'a': (self.x + 1.0,), 'c': (self.x + 3.0,)})

  def test_same_tags_inner_takes_everything(self):
    (_, inner), outer = capture(lambda x: capture(tagged)(x))(self.x)
    self.assertEqual(list(inner), ['a', 'b', 'c'])
    self.assertEqual(outer, {})


if __name__ == '__main__':
  absltest.main()
