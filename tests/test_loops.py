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

"""Tests of the loop and branch rules: ``scan``, ``while_loop``, ``cond``.

Covers the SPEC rows for ``lax.scan``/``fori_loop``/``lax.map``,
``lax.while_loop``, ``lax.cond``/``lax.switch`` and ``jax.vmap``, and the
``reduce_fn``/``init_fn`` part of ``sow``. Every expected value is computed
independently: by hand, with NumPy, or by the same loop written without
``sow`` (returning the value as ``ys`` or as a carry). No expected value comes
from a second call of ``capture``.
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

XS = np.array(
    [[0.5, -1.0], [1.5, 0.25], [-0.75, 2.0], [1.0, 1.0]], dtype=np.float32
)  # (4, 2)


class VmapReducedTest(absltest.TestCase):
  """Reductions under a vmap inside the capture: per example, or an error."""

  def test_reduced_sow_in_cond_on_batched_predicate(self):
    def f(x):
      def pos(x):
        sow(jnp.int32(1), name='n', reduce_fn=_add, init_fn=_zero_int)
        return x

      return jax.lax.cond(x > 0, pos, lambda x: x, x)

    # Inside: one count per example that takes `pos`, reduced over the batch.
    _, collected = capture(jax.vmap(f))(jnp.array([1.0, -1.0, 2.0]))
    np.testing.assert_array_equal(collected['n'], 2)
    # Around the capture: one accumulator per example.
    _, collected = jax.vmap(capture(f))(jnp.array([1.0, -1.0, 2.0]))
    np.testing.assert_array_equal(collected['n'], [1, 0, 1])

  def test_reduced_sow_nested_in_batched_cond_branch(self):
    def f(x):
      def pos(x):
        jax.jit(
            lambda: sow(
                jnp.int32(1), name='n', reduce_fn=_add, init_fn=_zero_int
            )
        )()
        return x

      return jax.lax.cond(x > 0, pos, lambda x: x, x)

    # Folded where it is, only for the examples that take `pos`.
    _, collected = capture(jax.vmap(f))(jnp.array([1.0, -1.0, 2.0]))
    np.testing.assert_array_equal(collected['n'], 2)

  def test_reduced_sow_in_while_on_batched_predicate(self):
    def steps(n):
      def body(s):
        sow(jnp.int32(1), name='steps', reduce_fn=_add, init_fn=_zero_int)
        return s - 1

      return jax.lax.while_loop(lambda s: s > 0, body, n)

    n = jnp.array([1, 3, 5], jnp.int32)
    with self.assertRaisesRegex(NotImplementedError, r"sow 'steps'.*vmap"):
      capture(jax.vmap(steps))(n)
    _, collected = jax.vmap(capture(steps))(n)
    np.testing.assert_array_equal(collected['steps'], [1, 3, 5])

  def test_name_order_under_vmapped_scan(self):
    def f(x):
      def step(c, t):
        sow(c, name='plain_first')
        sow(1, name='red', reduce_fn=_add, init_fn=_zero_int)
        return c + t, None

      return jax.lax.scan(step, 0.0, x)[0]

    _, collected = capture(jax.vmap(f))(jnp.ones((2, 3)))
    self.assertEqual(list(collected), ['plain_first', 'red'])
    np.testing.assert_array_equal(
        collected['plain_first'][0], [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    )
    self.assertEqual(int(collected['red']), 6)


class PerturbInVmappedScanTest(absltest.TestCase):

  def test_cotangents_collected_when_vmap_is_inside_grad(self):
    # vmap hoists plain sows out of the scan, but leaves perturb markers in
    # place, so the differentiation still sees them.
    def f(x):
      def step(c, t):
        h = perturb(jnp.sin(c * t), name='h')
        return c + h, None

      return jax.lax.scan(step, x, jnp.arange(1.0, 4.0))[0]

    xs = np.array([0.3, -0.2], np.float32)
    grad, collected = capture(jax.grad(lambda x: jax.vmap(f)(x).sum()))(xs)

    def backward(x):  # dL/dh_t for L = c_3, c_t = c_{t-1} + sin(c_{t-1} t)
      cs = [x]
      for t in (1.0, 2.0, 3.0):
        cs.append(cs[-1] + np.sin(cs[-1] * t))
      dc = 1.0
      dh = [0.0, 0.0, 0.0]
      for i, t in reversed(list(enumerate((1.0, 2.0, 3.0)))):
        dh[i] = dc  # c_{i+1} = c_i + h_i
        dc = dc * (1.0 + np.cos(cs[i] * t) * t)
      return np.array(dh), dc

    expected = [backward(float(x)) for x in xs]
    np.testing.assert_allclose(grad, [e[1] for e in expected], rtol=1e-5)
    # The transposed scan stacks them after vmap is gone, steps first; they
    # come back (batch, steps), as a value sown there.
    np.testing.assert_allclose(
        collected['h'][0], np.stack([e[0] for e in expected], 0), rtol=1e-5
    )


def _add(acc, v):
  return acc + v


def _zero():
  return jnp.float32(0.0)


def _count(acc, v):
  del v
  return acc + 1


def _zero_int():
  return jnp.int32(0)


def _max(acc, v):
  return jnp.maximum(acc, v)


def _neg_inf():
  return jnp.float32(-jnp.inf)


class ScanTest(parameterized.TestCase):

  @parameterized.parameters(False, True)
  def test_plain_sow_stacked_like_ys(self, reverse):
    def body(c, x):
      h = jnp.tanh(x * 2.0 + c)
      sow(h, name='h')
      return c + h.sum(), c * 3.0

    def f(xs):
      return jax.lax.scan(body, jnp.float32(0.5), xs, reverse=reverse)

    def plain_body(c, x):
      h = jnp.tanh(x * 2.0 + c)
      return c + h.sum(), (c * 3.0, h)

    (c, ys), collected = capture(f)(XS)
    c_ref, (ys_ref, h_ref) = jax.lax.scan(
        plain_body, jnp.float32(0.5), XS, reverse=reverse
    )
    self.assertEqual(list(collected), ['h'])
    self.assertLen(collected['h'], 1)
    self.assertEqual(collected['h'][0].shape, (4, 2))
    np.testing.assert_array_equal(collected['h'][0], h_ref)
    np.testing.assert_array_equal(c, c_ref)
    np.testing.assert_array_equal(ys, ys_ref)

  def test_reverse_lines_up_with_xs_by_hand(self):
    # Entry i is the value computed from xs[i], whichever way the scan runs.
    def f(xs):
      def body(c, x):
        sow(c, name='carry_in')
        return c + x, None

      return jax.lax.scan(body, jnp.float32(0.0), xs, reverse=True)[0]

    xs = np.array([1.0, 2.0, 4.0, 8.0], np.float32)
    out, collected = capture(f)(xs)
    # Reverse: step for xs[3] sees 0, xs[2] sees 8, xs[1] sees 12, xs[0] 14.
    np.testing.assert_array_equal(collected['carry_in'][0], [14, 12, 8, 0])
    self.assertEqual(float(out), 15.0)

  def test_two_sites_same_name_in_site_order(self):
    def f(xs):
      def body(c, x):
        sow(x + 1.0, name='a')
        sow(x * 10.0, name='b')
        sow(x * x, name='a')
        return c, None

      sow(jnp.float32(7.0), name='a')
      return jax.lax.scan(body, jnp.float32(0.0), xs)[0]

    xs = np.array([1.0, 2.0, 3.0], np.float32)
    _, collected = capture(f)(xs)
    self.assertEqual(list(collected), ['a', 'b'])
    self.assertLen(collected['a'], 3)
    np.testing.assert_array_equal(collected['a'][0], 7.0)
    np.testing.assert_array_equal(collected['a'][1], [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(collected['a'][2], [1.0, 4.0, 9.0])
    np.testing.assert_array_equal(collected['b'][0], [10.0, 20.0, 30.0])

  def test_nested_scans_outer_inner(self):
    xs = np.arange(24, dtype=np.float32).reshape(3, 4, 2)

    def f(xs):
      def outer(c, row):
        def inner(c2, x):
          sow(x * 2.0 + c2, name='v')
          return c2 + 1.0, None

        c2, _ = jax.lax.scan(inner, c, row)
        return c2, None

      return jax.lax.scan(outer, jnp.float32(0.0), xs)[0]

    out, collected = capture(f)(xs)
    expected = np.zeros((3, 4, 2), np.float32)
    c = 0.0
    for i in range(3):
      for j in range(4):
        expected[i, j] = xs[i, j] * 2.0 + c
        c += 1.0
    self.assertLen(collected['v'], 1)
    self.assertEqual(collected['v'][0].shape, (3, 4, 2))
    np.testing.assert_array_equal(collected['v'][0], expected)
    self.assertEqual(float(out), 12.0)

  def test_fori_loop_static_bounds(self):
    def f(x):
      def body(i, c):
        sow(c * i, name='ci')
        return c + 1.0

      return jax.lax.fori_loop(0, 5, body, x)

    out, collected = capture(f)(jnp.float32(2.0))
    self.assertEqual(float(out), 7.0)
    self.assertLen(collected['ci'], 1)
    np.testing.assert_array_equal(
        collected['ci'][0], [0.0, 3.0, 8.0, 15.0, 24.0]
    )

  def test_lax_map(self):
    def f(xs):
      def g(x):
        y = sow(jnp.sin(x).sum(), name='s')
        return y * 2.0

      return jax.lax.map(g, xs)

    out, collected = capture(f)(XS)
    expected = np.sin(XS).sum(axis=1)
    self.assertEqual(collected['s'][0].shape, (4,))
    np.testing.assert_allclose(collected['s'][0], expected, rtol=1e-6)
    np.testing.assert_allclose(out, 2.0 * expected, rtol=1e-6)

  def test_jit_in_body_cond_in_jit_jit_around(self):
    @jax.jit
    def step(c, x):
      h = sow(x * c, name='h')
      return jax.lax.cond(
          x.sum() > 0,
          lambda h: sow(h + 1.0, name='branch'),
          lambda h: sow(h - 1.0, name='branch'),
          h,
      )

    def f(xs):
      def body(c, x):
        y = step(c, x)
        return c + 1.0, y

      return jax.lax.scan(body, jnp.float32(1.0), xs)

    (c, ys), collected = jax.jit(capture(f))(XS)
    cs = np.arange(1.0, 5.0, dtype=np.float32)[:, None]
    h = XS * cs
    pos = XS.sum(axis=1, keepdims=True) > 0
    branch = np.where(pos, h + 1.0, h - 1.0)
    np.testing.assert_array_equal(collected['h'][0], h)
    np.testing.assert_array_equal(collected['branch'][0], branch)
    np.testing.assert_array_equal(ys, branch)
    self.assertEqual(float(c), 5.0)


class ReducedTest(parameterized.TestCase):

  def test_top_level(self):
    def f(x):
      sow(x, name='total', reduce_fn=_add, init_fn=_zero)
      sow(x * 2.0, name='total', reduce_fn=_add, init_fn=_zero)
      sow(x, name='n', reduce_fn=_count, init_fn=_zero_int)
      return x

    _, collected = capture(f)(jnp.float32(1.5))
    self.assertEqual(float(collected['total']), 4.5)
    self.assertEqual(int(collected['n']), 1)
    self.assertEqual(collected['n'].dtype, jnp.int32)

  def test_never_sown_in_top_level_cond_gives_init(self):
    def f(x):
      return jax.lax.cond(
          x > 100.0,
          lambda x: sow(x, name='big', reduce_fn=_add, init_fn=_zero),
          lambda x: x,
          x,
      )

    _, collected = jax.jit(capture(f))(jnp.float32(1.0))
    self.assertEqual(float(collected['big']), 0.0)

  def test_max_over_long_scan_is_scalar(self):
    n = 10_000
    xs = np.sin(np.arange(n, dtype=np.float32) * 0.37) * np.arange(n) / n
    xs = xs.astype(np.float32)

    def f(xs):
      def body(c, x):
        sow(x, name='max', reduce_fn=_max, init_fn=_neg_inf)
        return c + x, None

      return jax.lax.scan(body, jnp.float32(0.0), xs)[0]

    _, collected = capture(f)(xs)
    self.assertEqual(collected['max'].shape, ())
    self.assertEqual(float(collected['max']), float(xs.max()))

  def test_reduced_pytree_carried_through_scan(self):
    def init():
      return {'sum': jnp.zeros(2, jnp.float32), 'n': jnp.int32(0)}

    def reduce(acc, v):
      return {'sum': acc['sum'] + v, 'n': acc['n'] + 1}

    def f(xs):
      sow(jnp.ones(2), name='stats', reduce_fn=reduce, init_fn=init)

      def body(c, x):
        sow(x, name='stats', reduce_fn=reduce, init_fn=init)
        return c, None

      return jax.lax.scan(body, jnp.float32(0.0), xs)[0]

    _, collected = capture(f)(XS)
    np.testing.assert_allclose(collected['stats']['sum'], XS.sum(0) + 1.0)
    self.assertEqual(int(collected['stats']['n']), 5)

  @parameterized.parameters(0.5, 3.0, 17.25)
  def test_while_loop_sum_and_count_data_dependent(self, limit):
    def f(limit):
      def cond(c):
        return c[1] < limit

      def body(c):
        i, x = c
        sow(x, name='sum', reduce_fn=_add, init_fn=_zero)
        sow(x, name='count', reduce_fn=_count, init_fn=_zero_int)
        return i + 1, x + 0.75

      return jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.float32(0.25)))

    (i, x), collected = jax.jit(capture(f))(jnp.float32(limit))
    # By hand: x runs 0.25, 1.0, 1.75, ... while x < limit.
    values = []
    v = 0.25
    while v < limit:
      values.append(v)
      v += 0.75
    self.assertEqual(int(collected['count']), len(values))
    self.assertEqual(int(i), len(values))
    self.assertEqual(float(collected['sum']), sum(values))
    self.assertEqual(float(x), v)

  def test_while_loop_zero_iterations_gives_init(self):
    def init():
      return (jnp.float32(-3.0), jnp.zeros((2,), jnp.int32))

    def reduce(acc, v):
      return (acc[0] + v, acc[1] + 1)

    def f(x):
      def body(c):
        sow(c, name='acc', reduce_fn=reduce, init_fn=init)
        return c + 1.0

      return jax.lax.while_loop(lambda c: c < 0.0, body, x)

    out, collected = jax.jit(capture(f))(jnp.float32(5.0))
    self.assertEqual(float(out), 5.0)
    self.assertEqual(float(collected['acc'][0]), -3.0)
    np.testing.assert_array_equal(collected['acc'][1], [0, 0])

  def test_fori_loop_traced_bounds_reduced(self):
    def f(n):
      def body(i, c):
        sow(i, name='isum', reduce_fn=_add, init_fn=_zero_int)
        return c + i

      return jax.lax.fori_loop(0, n, body, jnp.int32(0))

    out, collected = jax.jit(capture(f))(jnp.int32(6))
    self.assertEqual(int(collected['isum']), 15)
    self.assertEqual(int(out), 15)

  @parameterized.named_parameters(
      ('shape', lambda acc, v: jnp.stack([acc, v])),
      ('dtype', lambda acc, v: (acc + v).astype(jnp.float16)),
  )
  def test_accumulator_type_change_is_value_error(self, reduce):
    def f(x):
      sow(x, name='bad_acc', reduce_fn=reduce, init_fn=_zero)
      return x

    with self.assertRaisesRegex(ValueError, 'bad_acc'):
      capture(f)(jnp.float32(1.0))

  @parameterized.named_parameters(
      ('shape', lambda acc, v: jnp.stack([acc, v])),
      ('dtype', lambda acc, v: (acc + v).astype(jnp.int32)),
  )
  def test_accumulator_type_change_in_scan_is_value_error(self, reduce):
    def f(xs):
      def body(c, x):
        sow(x, name='bad_scan_acc', reduce_fn=reduce, init_fn=_zero)
        return c, None

      return jax.lax.scan(body, jnp.float32(0.0), xs)[0]

    with self.assertRaisesRegex(ValueError, 'bad_scan_acc'):
      capture(f)(np.ones(3, np.float32))

  def test_accumulator_type_change_in_while_is_value_error(self):
    def f(x):
      def body(c):
        sow(
            c,
            name='bad_while_acc',
            reduce_fn=lambda a, v: a + v,
            init_fn=lambda: jnp.int32(0),
        )
        return c + 1.0

      return jax.lax.while_loop(lambda c: c < 3.0, body, x)

    with self.assertRaisesRegex(ValueError, 'bad_while_acc'):
      capture(f)(jnp.float32(0.0))

  def test_each_site_folds_with_its_own_reduce_fn(self):
    def f(x):
      sow(x, name='mixed', reduce_fn=_add, init_fn=_zero)
      sow(x * 3.0, name='mixed', reduce_fn=_max, init_fn=_neg_inf)
      return x

    # 0 + 2 = 2 (first site, init from its init_fn), then max(2, 6) = 6.
    _, collected = capture(f)(jnp.float32(2.0))
    self.assertEqual(float(collected['mixed']), 6.0)

  def test_sites_with_different_reduce_fns_across_scan(self):
    def f(xs):
      sow(xs[0], name='mixed_scan', reduce_fn=_add, init_fn=_zero)

      def body(c, x):
        sow(x, name='mixed_scan', reduce_fn=_max, init_fn=_neg_inf)
        return c, None

      return jax.lax.scan(body, jnp.float32(0.0), xs)[0]

    xs = np.array([5.0, 1.0, 7.0, 2.0], np.float32)
    _, collected = capture(f)(xs)
    # init 0 (first site's init_fn), + 5, then max over 5, 1, 7, 2.
    self.assertEqual(float(collected['mixed_scan']), 7.0)

  def test_reduced_and_plain_same_name_is_value_error(self):
    def f(x):
      sow(x, name='both')
      sow(x, name='both', reduce_fn=_add, init_fn=_zero)
      return x

    with self.assertRaisesRegex(ValueError, 'both'):
      capture(f)(jnp.float32(1.0))

  def test_reduce_fn_without_init_fn_is_type_error(self):
    with self.assertRaisesRegex(TypeError, 'lonely'):
      sow(jnp.float32(1.0), name='lonely', reduce_fn=_add)
    with self.assertRaisesRegex(TypeError, 'lonely'):
      capture(lambda x: sow(x, name='lonely', reduce_fn=_add))(jnp.float32(1.0))

  def test_init_fn_without_reduce_fn_is_type_error(self):
    with self.assertRaisesRegex(TypeError, 'orphan'):
      capture(lambda x: sow(x, name='orphan', init_fn=_zero))(jnp.float32(1.0))


class PlainInWhileTest(parameterized.TestCase):

  def _check(self, error, name):
    msg = str(error.exception)
    self.assertIn(repr(name), msg)
    self.assertIn('reduce_fn', msg)
    self.assertIn('init_fn', msg)

  def test_while_loop(self):
    def f(x):
      def body(c):
        sow(c, name='in_while')
        return c + 1.0

      return jax.lax.while_loop(lambda c: c < 3.0, body, x)

    with self.assertRaises(ValueError) as e:
      capture(f)(jnp.float32(0.0))
    self._check(e, 'in_while')

  def test_fori_loop_traced_bounds(self):
    def f(n):
      def body(i, c):
        sow(c, name=('loop', 0, 'c'))
        return c + 1.0

      return jax.lax.fori_loop(0, n, body, jnp.float32(0.0))

    with self.assertRaises(ValueError) as e:
      jax.jit(capture(f))(jnp.int32(3))
    self._check(e, ('loop', 0, 'c'))

  def test_nested_in_scan_inside_while(self):
    def f(x):
      def body(c):
        def inner(c2, _):
          sow(c2, name='deep')
          return c2, None

        return jax.lax.scan(inner, c + 1.0, None, length=2)[0]

      return jax.lax.while_loop(lambda c: c < 3.0, body, x)

    with self.assertRaises(ValueError) as e:
      capture(f)(jnp.float32(0.0))
    self._check(e, 'deep')


class CondTest(parameterized.TestCase):

  @parameterized.parameters(-2.0, 0.0, 3.0)
  def test_two_branches_traced_predicate(self, x):
    def f(x):
      return jax.lax.cond(
          x > 0.5,
          lambda x: sow(x * 2.0, name='v') + 1.0,
          lambda x: sow(x - 4.0, name='v') * 3.0,
          x,
      )

    out, collected = jax.jit(capture(f))(jnp.float32(x))
    v = x * 2.0 if x > 0.5 else x - 4.0
    o = v + 1.0 if x > 0.5 else v * 3.0
    self.assertLen(collected['v'], 1)
    self.assertEqual(float(collected['v'][0]), v)
    self.assertEqual(float(out), o)

  @parameterized.parameters(0, 1, 2, -1, 7)
  def test_switch_three_branches(self, index):
    def f(i, x):
      branches = [
          lambda x: sow(x + 1.0, name='s') * 2.0,
          lambda x: sow(x * x, name='s') - 1.0,
          lambda x: sow(-x, name='s'),
      ]
      return jax.lax.switch(i, branches, x)

    x = np.array([1.5, -2.0], np.float32)
    out, collected = jax.jit(capture(f))(jnp.int32(index), x)
    taken = int(np.clip(index, 0, 2))
    sown = [x + 1.0, x * x, -x][taken]
    expected = [sown * 2.0, sown - 1.0, sown][taken]
    np.testing.assert_array_equal(collected['s'][0], sown)
    np.testing.assert_array_equal(out, expected)

  def test_plain_name_in_one_branch_is_value_error(self):
    def f(x):
      return jax.lax.cond(
          x > 0.0,
          lambda x: x * 2.0,
          lambda x: sow(x, name='only_false'),
          x,
      )

    with self.assertRaises(ValueError) as e:
      jax.jit(capture(f))(jnp.float32(1.0))
    msg = str(e.exception)
    self.assertIn("'only_false'", msg)
    self.assertIn('branch', msg)

  def test_plain_name_in_two_of_three_branches_is_value_error(self):
    def f(i, x):
      return jax.lax.switch(
          i,
          [
              lambda x: sow(x, name='two_of_three'),
              lambda x: x + 1.0,
              lambda x: sow(x * 2.0, name='two_of_three'),
          ],
          x,
      )

    with self.assertRaises(ValueError) as e:
      jax.jit(capture(f))(jnp.int32(0), jnp.float32(1.0))
    msg = str(e.exception)
    self.assertIn("'two_of_three'", msg)
    self.assertIn('branch 1', msg)

  @parameterized.named_parameters(
      ('shape', lambda x: jnp.stack([x, x])),
      ('dtype', lambda x: x.astype(jnp.int32)),
  )
  def test_branches_type_mismatch_is_value_error(self, other):
    def f(x):
      return jax.lax.cond(
          x > 0.0,
          lambda x: sow(x, name='mismatch') + 0.0,
          lambda x: (sow(other(x), name='mismatch'), x)[1],
          x,
      )

    with self.assertRaises(ValueError) as e:
      jax.jit(capture(f))(jnp.float32(1.0))
    msg = str(e.exception)
    self.assertIn("'mismatch'", msg)
    self.assertIn('branch', msg)

  def test_reduced_in_subset_of_branches_counts_inside_scan(self):
    xs = np.array([3.0, -1.0, 0.5, -2.0, 4.0, 0.0, 1.0], np.float32)

    def f(xs):
      def body(c, x):
        def pos(x):
          sow(x, name='n_pos', reduce_fn=_count, init_fn=_zero_int)
          sow(x, name='sum_pos', reduce_fn=_add, init_fn=_zero)
          return x

        def neg(x):
          sow(x, name='n_neg', reduce_fn=_count, init_fn=_zero_int)
          return -x

        def zero(x):
          return x

        i = jnp.where(x > 0, 0, jnp.where(x < 0, 1, 2))
        y = jax.lax.switch(i, [pos, neg, zero], x)
        return c + y, None

      return jax.lax.scan(body, jnp.float32(0.0), xs)[0]

    out, collected = jax.jit(capture(f))(xs)
    self.assertEqual(int(collected['n_pos']), 4)
    self.assertEqual(int(collected['n_neg']), 2)
    self.assertEqual(float(collected['sum_pos']), 8.5)
    self.assertEqual(float(out), 11.5)

  def test_reduced_in_one_branch_of_cond_in_while(self):
    def f(n):
      def body(c):
        i, acc = c
        acc = jax.lax.cond(
            i % 3 == 0,
            lambda a: sow(
                a, name='every3', reduce_fn=_count, init_fn=_zero_int
            ),
            lambda a: a,
            acc,
        )
        return i + 1, acc + 1.0

      return jax.lax.while_loop(
          lambda c: c[0] < n, body, (jnp.int32(0), jnp.float32(0.0))
      )

    _, collected = jax.jit(capture(f))(jnp.int32(10))
    self.assertEqual(int(collected['every3']), 4)  # i = 0, 3, 6, 9


class VmapTest(parameterized.TestCase):

  def test_vmap_of_capture_cond_on_batched_predicate(self):
    def f(x, p):
      return jax.lax.cond(
          p > 0.0,
          lambda x: sow(x * 2.0, name='v') + 1.0,
          lambda x: sow(x - 1.0, name='v') * 5.0,
          x,
      )

    xs = np.array([[1.0, 2.0], [3.0, 4.0], [-1.0, 0.5]], np.float32)
    ps = np.array([1.0, -1.0, 2.0], np.float32)
    out, collected = jax.vmap(capture(f))(xs, ps)
    sel = (ps > 0)[:, None]
    v = np.where(sel, xs * 2.0, xs - 1.0)
    o = np.where(sel, v + 1.0, v * 5.0)
    self.assertLen(collected['v'], 1)
    self.assertEqual(collected['v'][0].shape, (3, 2))
    np.testing.assert_array_equal(collected['v'][0], v)
    np.testing.assert_array_equal(out, o)

  def test_vmap_of_capture_reduced_in_one_branch(self):
    def f(x):
      def body(c, x):
        jax.lax.cond(
            x > 0.0,
            lambda: sow(x, name='n', reduce_fn=_count, init_fn=_zero_int),
            lambda: x,
        )
        return c, None

      return jax.lax.scan(body, jnp.float32(0.0), x)[0]

    xs = np.array(
        [[1.0, -1.0, 2.0], [-1.0, -2.0, -3.0], [1.0, 1.0, 1.0]], np.float32
    )
    _, collected = jax.jit(jax.vmap(capture(f)))(xs)
    np.testing.assert_array_equal(collected['n'], [2, 0, 3])

  def test_vmap_inside_scan_axis_first(self):
    def f(xs):
      def body(c, x):
        y = jax.vmap(lambda r: sow(r * c, name='r'))(x)
        return c + 1.0, y.sum()

      return jax.lax.scan(body, jnp.float32(1.0), xs)

    xs = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    _, collected = capture(f)(xs)
    expected = xs * np.array([1.0, 2.0], np.float32)[:, None, None]
    self.assertEqual(collected['r'][0].shape, (2, 3, 2))
    np.testing.assert_array_equal(collected['r'][0], expected)


class VmapInsideCaptureTest(parameterized.TestCase):
  """``jax.vmap`` inside the captured function, around a loop or a branch."""

  def test_scan_inside_vmap_mapped_axis_first(self):
    # SPEC: values sown under vmap come back with the mapped axis first,
    # like vmap's outputs; here vmap is outer and the scan inner, so
    # (batch, steps, ...), lined up with the vmapped scan's ys.
    def per_example(x):
      def body(c, t):
        sow(c * t, name='v')
        return c + 1.0, c * t

      return jax.lax.scan(body, x, jnp.arange(3.0))

    def f(xs):
      return jax.vmap(per_example)(xs)

    xs = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    (_, ys), collected = capture(f)(xs)
    expected = np.stack(
        [np.stack([(x + t) * t for t in range(3)]) for x in xs]
    )  # (2, 3, 2)
    np.testing.assert_array_equal(ys, expected)
    self.assertEqual(collected['v'][0].shape, (2, 3, 2))
    np.testing.assert_array_equal(collected['v'][0], expected)

  def test_cond_on_batched_predicate_inside_vmap(self):
    # SPEC: a cond gives the value of the branch taken (one entry), with the
    # mapped axis first. vmap turns the cond into a select of both branches.
    def f(xs):
      return jax.vmap(
          lambda x: jax.lax.cond(
              x > 0.0,
              lambda x: sow(x * 2.0, name='v'),
              lambda x: sow(x - 1.0, name='v'),
              x,
          )
      )(xs)

    xs = np.array([1.0, -1.0, 3.0], np.float32)
    out, collected = capture(f)(xs)
    expected = np.where(xs > 0, xs * 2.0, xs - 1.0)
    np.testing.assert_array_equal(out, expected)
    self.assertLen(collected['v'], 1)
    np.testing.assert_array_equal(collected['v'][0], expected)

  def test_reduced_sow_inside_vmap_reduces_every_example(self):
    # A reduced sow under vmap inside the capture folds reduce_fn over the
    # examples in order, as if f had run once per example.
    def per_example(x):
      sow(jnp.sum(x > 0), name='positives', reduce_fn=_add, init_fn=_zero_int)
      sow(x, name='running_max', reduce_fn=jnp.maximum, init_fn=_neg_inf3)
      return x * 2.0

    xs = np.array([[1.0, -2.0, 3.0], [-1.0, -1.0, 5.0]], np.float32)
    out, collected = capture(jax.vmap(per_example))(xs)
    np.testing.assert_array_equal(out, xs * 2.0)
    self.assertEqual(int(collected['positives']), 3)
    np.testing.assert_array_equal(collected['running_max'], np.max(xs, axis=0))

  def test_reduced_count_in_scan_inside_vmap(self):
    def per_example(x):
      def body(c, t):
        sow(1, name='steps', reduce_fn=_add, init_fn=_zero_int)
        return c + t, None

      return jax.lax.scan(body, 0.0, x)[0]

    xs = np.arange(8.0, dtype=np.float32).reshape(2, 4)
    out, collected = capture(jax.vmap(per_example))(xs)
    np.testing.assert_array_equal(out, xs.sum(axis=1))
    self.assertEqual(int(collected['steps']), 2 * 4)


def _add(acc, v):
  return acc + v


def _zero_int():
  return jnp.int32(0)


def _neg_inf3():
  return jnp.full((3,), -jnp.inf, jnp.float32)


class NameOrderTest(parameterized.TestCase):
  """SPEC: ``collected`` has its keys in order of first sow."""

  @parameterized.named_parameters(
      ('top_level', lambda f: f),
      ('jit', jax.jit),
      (
          'scan',
          lambda f: lambda x: jax.lax.scan(
              lambda c, x: (f(x), None), jnp.float32(0.0), jnp.stack([x, x])
          )[0],
      ),
  )
  def test_reduced_then_plain(self, wrap):
    def f(x):
      sow(x, name='r', reduce_fn=_add, init_fn=_zero)
      sow(x, name='p')
      return x

    _, collected = capture(wrap(f))(jnp.float32(1.0))
    self.assertEqual(list(collected), ['r', 'p'])


class GradientTest(parameterized.TestCase):

  def test_perturb_in_rnn_scan_matches_backward_recursion(self):
    rng = np.random.RandomState(0)
    t_len, d, k = 5, 3, 2
    w = (rng.randn(d, d) * 0.5).astype(np.float32)
    u = (rng.randn(d, k) * 0.5).astype(np.float32)
    xs = rng.randn(t_len, k).astype(np.float32)
    targets = rng.randn(t_len, d).astype(np.float32)

    def loss(w, u, xs):
      def body(h, x):
        h = perturb(jnp.tanh(w @ h + u @ x), name='h')
        return h, h

      h_last, hs = jax.lax.scan(body, jnp.zeros(d, jnp.float32), xs)
      return jnp.sum(hs * targets) + 0.5 * jnp.sum(h_last**2)

    (gw, gu), collected = capture(jax.grad(loss, argnums=(0, 1)))(w, u, xs)

    # Forward in NumPy (float64).
    hs = np.zeros((t_len + 1, d))
    for t in range(t_len):
      hs[t + 1] = np.tanh(w @ hs[t] + u @ xs[t])
    # Backward recursion: g[t] = dL/dh_t (total), at the perturbed value.
    g = np.zeros((t_len, d))
    g[t_len - 1] = targets[t_len - 1] + hs[t_len]
    for t in range(t_len - 2, -1, -1):
      da = (1.0 - hs[t + 2] ** 2) * g[t + 1]
      g[t] = targets[t] + w.T @ da
    gw_ref = np.zeros((d, d))
    gu_ref = np.zeros((d, k))
    for t in range(t_len):
      da = (1.0 - hs[t + 1] ** 2) * g[t]
      gw_ref += np.outer(da, hs[t])
      gu_ref += np.outer(da, xs[t])

    self.assertLen(collected['h'], 1)
    self.assertEqual(collected['h'][0].shape, (t_len, d))
    np.testing.assert_allclose(collected['h'][0], g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, gw_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gu, gu_ref, rtol=1e-5, atol=1e-5)

  def test_perturb_in_reversed_scan_step_order(self):
    # loss = sum_t c_t * h_t with h_t = perturb(x_t): cotangent is c_t.
    cs = np.array([1.0, 2.0, 3.0, 4.0], np.float32)

    def loss(xs):
      def body(acc, xc):
        x, c = xc
        return acc + perturb(x, name='x') * c, None

      return jax.lax.scan(body, jnp.float32(0.0), (xs, cs), reverse=True)[0]

    g, collected = capture(jax.grad(loss))(np.ones(4, np.float32))
    np.testing.assert_array_equal(collected['x'][0], cs)
    np.testing.assert_array_equal(g, cs)

  @parameterized.parameters(
      None,
      jax.checkpoint_policies.nothing_saveable,
      jax.checkpoint_policies.everything_saveable,
  )
  def test_checkpoint_in_scan_under_jit_capture_grad(self, policy):
    n = 6
    xs = np.linspace(-1.0, 1.0, n).astype(np.float32)

    def make(sown):
      def f(w, xs):
        def step(h, x):
          a = jnp.sin(w * h + x)
          if sown:
            a = sow(a, name='a')
          return a * w

        step = jax.checkpoint(step, policy=policy)

        def body(h, x):
          h = step(h, x)
          return h, h

        h, hs = jax.lax.scan(body, jnp.float32(0.3), xs)
        return h + jnp.sum(hs**2)

      return f

    w = jnp.float32(0.7)
    g, collected = jax.jit(capture(jax.grad(make(True))))(w, xs)
    g_ref = jax.grad(make(False))(w, xs)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)

    # Forward values by hand, in NumPy.
    a_ref = np.zeros(n, np.float32)
    h = np.float32(0.3)
    for t in range(n):
      a_ref[t] = np.sin(np.float32(0.7) * h + xs[t])
      h = a_ref[t] * np.float32(0.7)
    self.assertEqual(list(collected), ['a'])
    self.assertLen(collected['a'], 1)
    self.assertEqual(collected['a'][0].shape, (n,))
    np.testing.assert_allclose(collected['a'][0], a_ref, rtol=1e-6)

  def test_grad_through_collected_scan_values(self):
    def g(w):
      def body(c, x):
        return c, sow(w * x, name='wx')

      return jax.lax.scan(body, jnp.float32(0.0), XS[:, 0])

    def f(w):
      _, collected = capture(g)(w)
      return jnp.sum(collected['wx'][0] ** 2)

    grad = jax.grad(f)(jnp.float32(2.0))
    # d/dw sum (w x)^2 = 2 w sum x^2
    np.testing.assert_allclose(grad, 4.0 * np.sum(XS[:, 0] ** 2), rtol=1e-6)


if __name__ == '__main__':
  absltest.main()
