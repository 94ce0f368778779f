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

"""Tests of the top level of a capture (``toplevel.py``).

``capture(f)`` runs ``f`` under a trace that passes every primitive to the
caller's trace (eagerly: on JAX's eval trace itself). These tests pin what
that means for a user: eagerly ``f`` sees concrete arrays and what has no sow
keeps JAX's fast dispatch, under ``jax.jit`` the captured program is the plain one
minus the sows, custom rules of functions called in ``f`` keep working when
the caller differentiates, JAX's trace state is restored after an error, and
``nnx.State`` arguments get their updates back. Expected values are computed
by hand or by the same computation written without ``sow``.
"""

from __future__ import annotations

from unittest import mock

from absl.testing import absltest
import jax
from jax._src import core as jax_core
from jax._src import pjit as pjit_lib
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax.nnx.sow import capture
from flax.nnx.sow import sow


class EagerTest(absltest.TestCase):

  def test_python_control_flow_on_values_runs_eagerly(self):
    def f(x):
      h = sow(jnp.tanh(x), name='h')
      if float(h.sum()) > 0:  # a concrete value, as without the capture
        return sow(h * 2.0, name='pos')
      return sow(h - 1.0, name='neg')

    out, collected = capture(f)(jnp.array([0.5, 1.0]))
    expected = np.tanh([0.5, 1.0])
    np.testing.assert_allclose(out, 2.0 * expected, rtol=1e-6)
    self.assertEqual(list(collected), ['h', 'pos'])
    out, collected = capture(f)(jnp.array([-0.5, -1.0]))
    np.testing.assert_allclose(out, np.tanh([-0.5, -1.0]) - 1.0, rtol=1e-6)
    self.assertEqual(list(collected), ['h', 'neg'])

  def test_numpy_arguments_and_outputs_stay_numpy(self):
    # Eagerly, f runs as f runs: on the caller's NumPy arrays, in float64.
    const = np.array([1.0, 2.0], np.float32)
    seen = []

    def f(x):
      seen.append(type(x))
      y = sow(x, name='x')
      seen.append(type(y))
      return x * 2.0, const

    (out, c), collected = capture(f)(np.array([3.0, 4.0], np.float32))
    self.assertEqual(seen, [np.ndarray, np.ndarray])
    self.assertIsInstance(out, np.ndarray)
    self.assertIs(c, const)
    self.assertIsInstance(collected['x'][0], jax.Array)
    np.testing.assert_allclose(out, [6.0, 8.0])
    np.testing.assert_allclose(collected['x'][0], [3.0, 4.0])
    # NumPy's precision is kept: 1 + 1e-9 - 1 is 1e-9 in float64, 0 in
    # float32.
    out, _ = capture(lambda a: float(np.sum(a) - 1.0))(np.array([1.0, 1e-9]))
    self.assertAlmostEqual(out, 1e-9, delta=1e-15)

  def test_trace_state_restored_after_an_error(self):
    def f(x):
      sow(x, name='x')
      raise KeyError('boom')

    with self.assertRaisesRegex(KeyError, 'boom'):
      capture(f)(jnp.ones(2))
    self.assertTrue(jax_core.trace_state_clean())
    # Plain JAX still works, with its fast paths.
    np.testing.assert_allclose(jax.jit(lambda x: x * 3)(jnp.ones(2)), [3, 3])
    np.testing.assert_allclose(jax.grad(lambda x: x**2)(3.0), 6.0)

  def test_runs_on_a_trace_of_its_own_that_keeps_jit_caches(self):
    # Eagerly f runs under a capture trace whose parent is JAX's eval trace.
    # A jitted function with no sow is traced once across captures: the
    # trace is reused, so JAX's tracing cache, keyed by the current trace,
    # keeps its entry.
    traced = []

    def times3(y):
      traced.append(1)
      return y * 3.0

    plain = jax.jit(times3)
    seen = []

    def f(x):
      seen.append(jax_core.trace_state_clean())
      for _ in range(3):
        x = plain(x)
      return sow(x, name='x')

    x = jnp.ones(2)
    for _ in range(3):
      out, collected = capture(f)(x)
      np.testing.assert_allclose(out, [27.0, 27.0])
      np.testing.assert_allclose(collected['x'][0], [27.0, 27.0])
    self.assertEqual(seen, [False, False, False])
    self.assertLen(traced, 1)
    self.assertTrue(jax_core.trace_state_clean())
    # Outside the capture, `plain` keeps JAX's C++ fast path.
    calls = []
    original = pjit_lib._run_python_pjit

    def counting(*args, **kwargs):
      calls.append(1)
      return original(*args, **kwargs)

    plain(x)
    with mock.patch.object(pjit_lib, '_run_python_pjit', counting):
      np.testing.assert_allclose(plain(x), [3.0, 3.0])
    self.assertEqual(calls, [])

  def test_a_jit_with_a_sow_collects_at_every_call(self):
    # Its program holds a sow, so it never takes the fast path inside a
    # capture: called before (outside any capture, where it has one),
    # twice in a capture, in a nested capture, and after.
    g = jax.jit(lambda y: sow(y * 2.0, name='g') + 1.0)
    x = jnp.array([1.0, 2.0])
    for _ in range(2):
      np.testing.assert_allclose(g(x), [3.0, 5.0])

    def f(x):
      return g(g(x))

    for _ in range(2):
      out, collected = capture(f)(x)
      np.testing.assert_allclose(out, [7.0, 11.0])
      np.testing.assert_allclose(collected['g'][0], [2.0, 4.0])
      np.testing.assert_allclose(collected['g'][1], [6.0, 10.0])
    (out, inner), outer = capture(lambda x: capture(f, tags=['t'])(x))(x)
    self.assertEqual(dict(inner), {})
    np.testing.assert_allclose(outer['g'][1], [6.0, 10.0])
    np.testing.assert_allclose(g(x), [3.0, 5.0])
    # The same function under a jit around the capture: the same values.
    out_j, collected_j = jax.jit(capture(f))(x)
    np.testing.assert_allclose(out_j, out)
    np.testing.assert_allclose(collected_j['g'][1], [6.0, 10.0])

  def test_ahead_of_time_compiled_function_is_refused(self):
    x = jnp.ones(2)
    compiled = jax.jit(lambda x: sow(x * 3, name='inner')).lower(x).compile()
    with self.assertRaisesRegex(TypeError, 'ahead-of-time compiled'):
      capture(lambda x: compiled(x))(x)
    np.testing.assert_allclose(compiled(x), [3.0, 3.0])  # fine outside
    _, collected = capture(jax.jit(lambda x: sow(x * 3, name='inner')))(x)
    np.testing.assert_allclose(collected['inner'][0], [3.0, 3.0])




class EagerConstructsTest(absltest.TestCase):
  """Eager captures of the staged constructs (they land with ``custom``)."""

  def test_control_flow_compiled_alone_is_rewritten(self):
    # Eagerly JAX compiles a scan, cond or while_loop alone: a sow inside is
    # collected, with the layout it has under jit.
    def f(x):
      c, _ = jax.lax.scan(
          lambda c, xi: (c + sow(xi * c, name='s'), None), 1.0, x
      )
      c = jax.lax.cond(
          c > 0, lambda c: sow(c, name='b') * 2, lambda c: sow(-c, name='b'), c
      )
      return jax.lax.while_loop(
          lambda c: c < 100.0,
          lambda c: sow(c, name='w', reduce_fn=jnp.add, init_fn=lambda: 0.0)
          * 3.0,
          c,
      )

    x = jnp.array([1.0, 2.0, 3.0])
    out, collected = capture(f)(x)
    # scan: c = 1, 2, 6, 24 with rows xi * c = 1, 4, 18; cond: 24 -> 48;
    # while: 48 -> 144, the accumulator 48.
    np.testing.assert_allclose(collected['s'][0], [1.0, 4.0, 18.0])
    np.testing.assert_allclose(collected['b'][0], 24.0)
    np.testing.assert_allclose(collected['w'], 48.0)
    np.testing.assert_allclose(out, 144.0)

  def test_error_in_a_custom_jvp_rule_names_the_users_line(self):
    @jax.custom_jvp
    def g(x):
      return 2 * sow(jnp.tanh(x), name='y')

    @g.defjvp
    def _g_jvp(primals, tangents):
      (x,), (t,) = primals, tangents
      sow(t, name='tangent')
      return g(x), 5.0 * t

    with self.assertRaisesRegex(
        NotImplementedError, r"sow 'tangent' \(at .*test_toplevel.py:\d+"
    ):
      jax.grad(lambda x: capture(lambda x: jnp.sum(g(x)))(x)[0])(
          jnp.array([0.1, -0.4])
      )


class UnderJitTest(absltest.TestCase):

  def test_captured_program_is_the_plain_one_without_sows(self):
    def f(x):
      h = sow(jnp.sin(x), name='h')
      y = jax.nn.relu(h) * 2.0
      return sow(y, name='y').sum()

    def by_hand(x):
      h = jnp.sin(x)
      y = jax.nn.relu(h) * 2.0
      return y.sum(), h, y

    x = jnp.arange(3.0)
    captured = jax.make_jaxpr(capture(f))(x)
    manual = jax.make_jaxpr(by_hand)(x)
    self.assertEqual(
        [str(e.primitive) for e in captured.eqns],
        [str(e.primitive) for e in manual.eqns],
    )
    out, collected = jax.jit(capture(f))(x)
    ref = by_hand(x)
    np.testing.assert_allclose(out, ref[0], rtol=1e-6)
    np.testing.assert_allclose(collected['h'][0], ref[1], rtol=1e-6)
    np.testing.assert_allclose(collected['y'][0], ref[2], rtol=1e-6)


@jax.custom_jvp
def half_grad(x):
  return sow(x, name='half_in')


@half_grad.defjvp
def _half_grad_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return half_grad(x), 0.5 * t


@jax.custom_vjp
def straight_through(x):
  return sow(jnp.round(x), name='rounded')


def _st_fwd(x):
  return straight_through(x), None


def _st_bwd(_, g):
  return (g,)


straight_through.defvjp(_st_fwd, _st_bwd)


class CustomRulesAroundTest(absltest.TestCase):
  """The caller differentiates a capture whose ``f`` calls custom rules."""

  def test_grad_of_capture_keeps_custom_jvp(self):
    def loss(x):
      return jnp.sum(half_grad(x) * 3.0)

    def captured_loss(x):
      out, collected = capture(loss)(x)
      return out, collected['half_in'][0]

    x = jnp.array([1.0, -2.0])
    g, sown = jax.grad(captured_loss, has_aux=True)(x)
    np.testing.assert_allclose(g, [1.5, 1.5])  # the rule halves 3.0
    np.testing.assert_allclose(sown, x)
    g = jax.jit(jax.grad(lambda x: capture(loss)(x)[0]))(x)
    np.testing.assert_allclose(g, [1.5, 1.5])

  def test_grad_of_capture_keeps_custom_vjp_and_relu_at_zero(self):
    def loss(x):
      return jnp.sum(straight_through(x) * jax.nn.relu(x))

    x = jnp.array([0.0, 1.4, 2.6])
    for transform in (jax.grad, lambda g: jax.jit(jax.grad(g))):
      g = transform(lambda x: capture(loss)(x)[0])(x)
      # d/dx round(x) * relu(x) with the straight-through rule, relu'(0)=0:
      # relu(x) + round(x) * relu'(x).
      expected = np.maximum(x, 0) + np.round(x) * (x > 0)
      np.testing.assert_allclose(g, expected, rtol=1e-6)
    _, collected = capture(loss)(x)
    np.testing.assert_allclose(collected['rounded'][0], np.round(x))

  def test_vmap_of_capture_with_custom_jvp(self):
    out, collected = jax.vmap(capture(lambda x: half_grad(x) + 1.0))(
        jnp.arange(3.0)
    )
    np.testing.assert_allclose(out, [1.0, 2.0, 3.0])
    np.testing.assert_allclose(collected['half_in'][0], [0.0, 1.0, 2.0])


class StateArgumentTest(absltest.TestCase):
  """An ``nnx.State`` among the arguments (Variables, no Module)."""

  def _model(self):
    class Net(nnx.Module):

      def __init__(self, rngs):
        self.linear = nnx.Linear(2, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, momentum=0.5, rngs=rngs)

      def __call__(self, x):
        return self.bn(sow(self.linear(x), name='pre'))

    return Net(nnx.Rngs(0))

  def test_updates_to_state_reach_the_callers_variables(self):
    model = self._model()
    graphdef, state = nnx.split(model)
    x = jnp.array([[1.0, 2.0], [3.0, -1.0]])
    kernel = np.asarray(state['linear']['kernel'].get_value())
    bias = np.asarray(state['linear']['bias'].get_value())
    pre = x @ kernel + bias

    def f(state, x):
      return nnx.merge(graphdef, state)(x)

    for run in (capture(f), nnx.jit(capture(f))):
      _, state = nnx.split(self._model())
      mean_before = state['bn']['mean']
      _, collected = run(state, x)
      np.testing.assert_allclose(collected['pre'][0], pre, rtol=1e-5)
      # The caller's Variable holds the new running mean (momentum 0.5),
      # as after the same call through nnx.jit.
      np.testing.assert_allclose(
          state['bn']['mean'].get_value(), 0.5 * pre.mean(0), rtol=1e-5
      )
      self.assertIs(state['bn']['mean'], mean_before)

    _, reference = nnx.split(self._model())
    nnx.jit(f)(reference, x)
    np.testing.assert_allclose(
        reference['bn']['mean'].get_value(), 0.5 * pre.mean(0), rtol=1e-5
    )

  def test_nnx_grad_inside_a_capture_inside_nnx_jit(self):
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    x = jnp.array([[1.0, 2.0], [3.0, 4.0]])

    def loss(m, x):
      return jnp.sum(sow(m(x), name='y'))

    grads, collected = nnx.jit(lambda m, x: capture(nnx.grad(loss))(m, x))(
        model, x
    )
    # d/dkernel sum(x @ k + b) = column sums of x; d/dbias = batch size.
    np.testing.assert_allclose(grads['kernel'].get_value(), [[4.0], [6.0]])
    np.testing.assert_allclose(grads['bias'].get_value(), [2.0])
    kernel = np.asarray(model.kernel.get_value())
    bias = np.asarray(model.bias.get_value())
    np.testing.assert_allclose(collected['y'][0], x @ kernel + bias, rtol=1e-6)

  def test_shared_variable_stays_shared(self):
    v = nnx.Param(jnp.ones(2))

    def f(a, b):
      assert a is b  # one Variable passed twice stays one object
      a.set_value(a.get_value() + sow(b.get_value(), name='b'))
      return a.get_value()

    out, collected = capture(f)(v, v)
    np.testing.assert_allclose(out, [2.0, 2.0])
    np.testing.assert_allclose(collected['b'][0], [1.0, 1.0])
    np.testing.assert_allclose(v.get_value(), [2.0, 2.0])


if __name__ == '__main__':
  absltest.main()
