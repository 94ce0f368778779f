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

"""NNX Variables (plain, ref and Hijax) read inside the constructs that a
capture or an intervene rewrites.

A Hijax Variable is a mutable JAX type whose structure travels as
quasi-dynamic data on each binder of a jaxpr; a rewritten body must keep it
or JAX cannot lower the ``scan``/``cond``/``while``/``jit`` that reads the
Variable (found by a fresh reviewer: each case below raised inside JAX under
``jax.jit``). Expected values are the same programs written without sow.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import sow

KINDS = (('plain', {}), ('ref', {'ref': True}), ('hijax', {'hijax': True}))
W = np.array([2.0, -1.0], np.float32)
XS = np.arange(6.0, dtype=np.float32).reshape(3, 2)
SUM = dict(reduce_fn=lambda a, v: a + v, init_fn=lambda: jnp.zeros(()))


def param(flags):
  return nnx.Param(jnp.asarray(W), **flags)


def three_ways(transform, f, x):
  """``transform(f)(x)`` eagerly, under ``jax.jit``, and inside a
  ``jax.jit`` with ``f`` closing over the jit's argument (a tracer of the
  enclosing trace)."""
  return [
      transform(f)(x),
      jax.jit(transform(f))(x),
      jax.jit(lambda y: transform(lambda: f(y))())(x),
  ]


class VariablesInConstructsTest(parameterized.TestCase):

  @parameterized.named_parameters(*KINDS)
  def test_scan_plain_and_reduced(self, flags):
    w = param(flags)

    def f(xs):
      def body(c, x):
        h = sow(x * w[...], name='h')
        sow(jnp.sum(h), name='total', **SUM)
        return c + jnp.sum(h), h

      return jax.lax.scan(body, 0.0, xs)

    for (carry, ys), got in three_ways(capture, f, XS):
      np.testing.assert_allclose(ys, XS * W)
      np.testing.assert_allclose(got['h'][0], XS * W)
      np.testing.assert_allclose(got['total'], np.sum(XS * W))
      np.testing.assert_allclose(carry, np.sum(XS * W))

  def test_reduce_fn_closing_over_a_plain_variable(self):
    w = param({})
    weighted = dict(
        reduce_fn=lambda a, v: a + v * w[...], init_fn=lambda: jnp.zeros(2)
    )

    def f(xs):
      body = lambda c, x: (c, sow(x, name='r', **weighted))
      return jax.lax.scan(body, 0.0, xs)

    for _, got in three_ways(capture, f, XS):
      np.testing.assert_allclose(got['r'], XS.sum(0) * W)

  @parameterized.named_parameters(*KINDS[1:])
  def test_reduce_fn_reading_a_mutable_variable_raises(self, flags):
    # The fold runs where the capture puts it, on values fixed at the sow; a
    # ref or Hijax Variable read there could see another value than at the
    # sow (a write earlier in the body gave the value before the loop, with
    # no error), so such a reduce_fn is refused, naming the sow and the fix.
    v = param(flags)

    def f(xs, read_before):
      def body(c, x):
        v[...] = v[...] + 1.0
        w = v[...]
        fold = (
            (lambda a, h: a + jnp.sum(h * w))
            if read_before
            else (lambda a, h: a + jnp.sum(h * v[...]))
        )
        return c, sow(x, name='r', reduce_fn=fold, init_fn=lambda: 0.0)

      return jax.lax.scan(body, 0.0, xs)

    refused = capture(lambda xs: f(xs, False))
    for how, run in (('eager', refused), ('jit', jax.jit(refused))):
      with (
          self.subTest(how),
          self.assertRaisesRegex(
              ValueError,
              r"sow 'r': its reduce_fn reads a ref or Hijax Variable.*"
              r'w = v\[...\]',
          ),
      ):
        run(XS)
    before = np.asarray(v[...])
    # The fix the message gives: read the Variable before the sow.
    _, got = jax.jit(capture(lambda xs: f(xs, True)))(XS)
    rows = [before + k for k in (1.0, 2.0, 3.0)]
    np.testing.assert_allclose(
        got['r'], sum(np.sum(x * r) for x, r in zip(XS, rows)), rtol=1e-6
    )

  @parameterized.named_parameters(*KINDS)
  def test_cond(self, flags):
    w = param(flags)

    def f(x):
      return jax.lax.cond(
          x[0] < 1.0,
          lambda: sow(jnp.sum(x * w[...]), name='r'),
          lambda: sow(jnp.sum(x), name='r'),
      )

    for x, expected in ((XS[0], np.sum(XS[0] * W)), (XS[1], np.sum(XS[1]))):
      for out, got in three_ways(capture, f, x):
        np.testing.assert_allclose(out, expected)
        np.testing.assert_allclose(got['r'][0], expected)

  @parameterized.named_parameters(*KINDS)
  def test_while_reduced(self, flags):
    w = param(flags)
    step = float(np.sum(W))  # 1.0 per iteration

    def f(x):
      def body(c):
        return sow(c + jnp.sum(w[...]), name='visits', **SUM)

      return jax.lax.while_loop(lambda c: c < 3.5, body, x)

    for out, got in three_ways(capture, f, jnp.float32(0.0)):
      np.testing.assert_allclose(out, 4 * step)
      np.testing.assert_allclose(got['visits'], 1.0 + 2.0 + 3.0 + 4.0)

  @parameterized.named_parameters(*KINDS)
  def test_inner_jit(self, flags):
    w = param(flags)
    f = lambda x: jax.jit(lambda x: sow(x * w[...], name='h'))(x)
    for out, got in three_ways(capture, f, XS[1]):
      np.testing.assert_allclose(out, XS[1] * W)
      np.testing.assert_allclose(got['h'][0], XS[1] * W)

  @parameterized.named_parameters(*KINDS)
  def test_intervene_in_scan(self, flags):
    w = param(flags)

    def f(xs):
      body = lambda c, x: (c, sow(x * w[...], name='h') + 1.0)
      return jax.lax.scan(body, 0.0, xs)[1]

    rows = np.full((3, 2), 5.0, np.float32)
    for values, expected in (
        ({'h': lambda v: 2.0 * v}, 2.0 * XS * W + 1.0),
        ({'h': (rows,)}, rows + 1.0),
    ):
      for out in three_ways(lambda g: intervene(g, values), f, XS):
        np.testing.assert_allclose(out, expected)

  @parameterized.named_parameters(*KINDS)
  def test_gradient_through_scan(self, flags):
    w = param(flags)

    def loss(xs):
      body = lambda c, x: (c + jnp.sum(sow(x * w[...], name='h') ** 2), None)
      total, _ = jax.lax.scan(body, 0.0, xs)
      return total

    grad = jax.jit(jax.grad(lambda xs: capture(loss)(xs)[0]))(XS)
    np.testing.assert_allclose(grad, 2.0 * XS * W * W)

  @parameterized.named_parameters(*KINDS)
  def test_module_sow_in_scan(self, flags):
    class Scale(nnx.Module):

      def __init__(self):
        self.w = param(flags)

      def __call__(self, xs):
        def body(c, x):
          h = x * self.w[...]
          self.sow(nnx.Intermediate, 'h', h)
          return c, h

        return jax.lax.scan(body, 0.0, xs)[1]

    model = Scale()
    ys, state = jax.jit(lambda xs: nnx.capture(model, nnx.Intermediate)(xs))(XS)
    np.testing.assert_allclose(ys, XS * W)
    np.testing.assert_allclose(state['h'].get_value()[0], XS * W)


if __name__ == '__main__':
  absltest.main()
