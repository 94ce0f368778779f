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

"""``loop_indices()``: one intervene callable patching one iteration.

Every expected value is the same program written without ``sow``, with the
patched row replaced by hand (``xs.at[k].set``, a Python loop over layers).
"""

import copy

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import loop_indices
from flax.nnx.sow import module_outputs
from flax.nnx.sow import sow

_WRAPS = {'eager': lambda g: g, 'jit': jax.jit}


def _cumulative(xs, reverse=False):
  """``c = 2 c + x`` over ``xs``, each ``x`` sown as ``'x'``."""

  def body(c, x):
    return 2.0 * c + sow(x, name='x'), None

  return jax.lax.scan(body, 0.0, xs, reverse=reverse)[0]


def _cumulative_by_hand(xs, reverse=False):
  c = 0.0
  for x in (xs[::-1] if reverse else xs):
    c = 2.0 * c + x
  return c


def _at_row(k, new):
  return lambda v: jnp.where(loop_indices()[0] == k, new, v)


class ScanTest(parameterized.TestCase):

  @parameterized.product(wrap=list(_WRAPS), reverse=[False, True])
  def test_one_row_replaced(self, wrap, reverse):
    xs = jnp.arange(1.0, 6.0)
    g = _WRAPS[wrap](
        intervene(lambda xs: _cumulative(xs, reverse), {'x': _at_row(1, 9.0)})
    )
    # The row index is the index of xs, also when the scan runs backwards.
    expected = _cumulative_by_hand(xs.at[1].set(9.0), reverse)
    self.assertAlmostEqual(float(g(xs)), float(expected), places=4)
    # Called again on other values: nothing of the first trace is reused
    # wrongly.
    self.assertAlmostEqual(
        float(g(2 * xs)),
        float(_cumulative_by_hand((2 * xs).at[1].set(9.0), reverse)),
        places=4,
    )

  def test_fori_loop_with_static_bounds_counts_from_zero(self):
    def f(x):
      return jax.lax.fori_loop(
          3, 7, lambda i, c: c + sow(i * x, name='ix'), 0.0
      )

    # Iterations i = 3, 4, 5, 6 are rows 0..3; row 2 is i = 5.
    g = intervene(f, {'ix': lambda v: jnp.where(loop_indices()[0] == 2, 0.0, v)})
    self.assertAlmostEqual(float(g(1.0)), 3.0 + 4.0 + 6.0, places=5)

  def test_a_gradient_inside_and_around_sees_the_patched_row(self):
    xs = jnp.arange(1.0, 5.0)
    triple_row_2 = lambda v: jnp.where(loop_indices()[0] == 2, 3.0 * v, v)

    def by_hand(xs):
      return _cumulative_by_hand(xs * jnp.array([1.0, 1.0, 3.0, 1.0]))

    expected = jax.grad(by_hand)(xs)
    around = jax.grad(intervene(_cumulative, {'x': triple_row_2}))(xs)
    inside = intervene(lambda xs: jax.grad(_cumulative)(xs),
                       {'x': triple_row_2})(xs)
    for got in (around, inside, jax.jit(intervene(
        lambda xs: jax.value_and_grad(_cumulative)(xs)[1],
        {'x': triple_row_2}))(xs)):
      np.testing.assert_allclose(got, expected, rtol=1e-6)

  def test_nested_loops_and_constructs_inside_the_body(self):
    """Two scans with a jit, a checkpoint and a cond between them and the
    sow: the index pair (outer, inner) reaches the callable through each."""

    def f(xs):
      def outer(c, row):
        @jax.jit
        def inner_scan(row):
          def inner(c2, x):
            y = jax.checkpoint(lambda y: sow(y, name='y'))(x)
            y = jax.lax.cond(x > -100.0, lambda y: y, lambda y: -y, y)
            return c2 * 0.5 + y, None

          return jax.lax.scan(inner, 0.0, row)[0]

        return c + inner_scan(row), None

      return jax.lax.scan(outer, 0.0, xs)[0]

    def by_hand(xs):
      total = 0.0
      for row in xs:
        c2 = 0.0
        for x in row:
          c2 = c2 * 0.5 + x
        total = total + c2
      return total

    def patch(v):
      i, j = loop_indices()
      return jnp.where((i == 1) & (j == 2), 50.0, v)

    xs = jnp.arange(12.0).reshape(3, 4) / 4
    g = intervene(f, {'y': patch})
    for wrap in _WRAPS.values():
      for scale in (1.0, -2.0):
        np.testing.assert_allclose(
            wrap(g)(scale * xs),
            by_hand((scale * xs).at[1, 2].set(50.0)),
            rtol=1e-6,
        )

  def test_custom_rules_in_the_body_differentiated_later(self):
    """JAX traces a custom_jvp's rule (a custom_vjp's forward pass) when the
    program is differentiated, after the scan body's rewrite is done: the
    index reaches them as an operand (it was a stale tracer)."""

    @jax.custom_jvp
    def soft(x):
      return jnp.sin(sow(x, name='a'))

    soft.defjvp(lambda p, t: (soft(p[0]), jnp.cos(p[0]) * t[0]))

    @jax.custom_vjp
    def hard(x):
      return jnp.sin(sow(x, name='a'))

    hard.defvjp(lambda x: (hard(x), jnp.cos(x)), lambda c, g: (c * g,))

    xs = jnp.arange(1.0, 4.0)
    twice_row_1 = lambda v: jnp.where(loop_indices()[0] == 1, 2.0 * v, v)
    for fn in (soft, hard):
      f = lambda xs, fn=fn: jax.lax.scan(
          lambda c, x: (c + fn(x), None), 0.0, xs)[0]
      g = intervene(f, {'a': twice_row_1})
      patched = jnp.sin(xs * jnp.array([1.0, 2.0, 1.0]))
      self.assertAlmostEqual(float(g(xs)), float(patched.sum()), places=5)
      # A replacement inside a custom rule keeps the rule for the original
      # inputs (the guide's custom-derivative rule): d/dx sin = cos(x).
      for grad in (jax.grad(g), intervene(jax.grad(f), {'a': twice_row_1})):
        np.testing.assert_allclose(grad(xs), jnp.cos(xs), rtol=1e-6)
      value, grad = jax.jit(jax.value_and_grad(g))(xs)
      np.testing.assert_allclose(value, patched.sum(), rtol=1e-6)
      np.testing.assert_allclose(grad, jnp.cos(xs), rtol=1e-6)

  def test_vmap_inside_and_around(self):
    xs = jnp.arange(8.0).reshape(2, 4)  # (batch, steps) for the vmap around
    zero_row_3 = lambda v: jnp.where(loop_indices()[0] == 3, 0.0, v)
    around = jax.vmap(intervene(_cumulative, {'x': zero_row_3}))(xs)
    expected = jnp.stack(
        [_cumulative_by_hand(r.at[3].set(0.0)) for r in xs]
    )
    np.testing.assert_allclose(around, expected, rtol=1e-6)

    def inside(xs):  # (steps, batch): a vmap in the scan body
      def body(c, x):
        return 2.0 * c + jax.vmap(lambda e: sow(e, name='x'))(x), None

      return jax.lax.scan(body, jnp.zeros(2), xs)[0]

    got = intervene(inside, {'x': zero_row_3})(xs.T)
    np.testing.assert_allclose(got, expected, rtol=1e-6)

  def test_capture_of_the_patched_program_sees_the_row(self):
    xs = jnp.arange(1.0, 5.0)
    _, c = capture(intervene(_cumulative, {'x': _at_row(0, -1.0)}))(xs)
    np.testing.assert_allclose(c['x'][0], xs.at[0].set(-1.0))

  def test_outside_any_loop_it_is_empty(self):
    seen = []

    def fn(v):
      seen.append(loop_indices())
      return v + 1.0

    out = intervene(lambda x: sow(x, name='t') * 2.0, {'t': fn})(1.0)
    self.assertEqual(float(out), 4.0)
    self.assertEqual(seen, [()])

  def test_a_callable_that_does_not_ask_changes_no_scan(self):
    """The scan is rewritten as without loop_indices: no index xs."""
    xs = jnp.arange(4.0)
    jaxpr = jax.make_jaxpr(intervene(_cumulative, {'x': lambda v: 2.0 * v}))(
        xs
    )
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == 'scan']
    self.assertEqual([v.aval.dtype for v in scan.invars],
                     [jnp.float32, jnp.float32])
    jaxpr = jax.make_jaxpr(intervene(_cumulative, {'x': _at_row(0, 1.0)}))(xs)
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == 'scan']
    self.assertIn(jnp.int32, [v.aval.dtype for v in scan.invars])


class ErrorsTest(absltest.TestCase):

  def test_outside_a_callable(self):
    with self.assertRaisesRegex(RuntimeError, 'outside a callable'):
      loop_indices()
    with self.assertRaisesRegex(RuntimeError, 'outside a callable'):
      intervene(lambda x: sow(x, name='a') + loop_indices()[0], {})(1.0)

  def test_an_index_past_the_loops_names_the_sow(self):
    def at_outer_row(v):
      return v * loop_indices()[0]

    cases = [
        (lambda x: sow(x, name='t') * 2.0, {'t': at_outer_row}, 1.0,
         "loop_indices(): sow 't' is in no loop, so loop_indices() is ()"),
        (_cumulative, {'x': lambda v: v * loop_indices()[1]}, jnp.ones(3),
         "loop_indices(): sow 'x' is inside 1 loop(s)"),
    ]
    for f, values, arg, note in cases:
      for wrap in (lambda g: g, jax.jit):
        with self.assertRaisesRegex(IndexError, 'tuple index out of range'
                                   ) as raised:
          wrap(intervene(f, values))(arg)
        self.assertTrue(
            any(n.startswith(note) for n in raised.exception.__notes__),
            raised.exception.__notes__)
    # An IndexError of the callable's own is left alone.
    with self.assertRaises(IndexError) as raised:
      intervene(_cumulative, {'x': lambda v: v * ()[0]})(jnp.ones(3))
    self.assertFalse(getattr(raised.exception, '__notes__', []))

  def test_the_indices_are_a_plain_tuple(self):
    # Mixed with tuples in pytrees, branches and copies, as any tuple is.
    def fn(v):
      idx = loop_indices()
      self.assertIs(type(idx), tuple)
      below = jax.tree.map(lambda i, lim: i < lim, idx, (2,))
      row = jax.lax.cond(below[0], lambda: idx, lambda: (idx[0] * 0,))
      return v * (copy.deepcopy(row)[0] + 1)

    out = intervene(_cumulative, {'x': fn})(jnp.ones(3))
    # Rows 0 and 1 scaled by 1 and 2, row 2 (not below 2) by 1.
    self.assertEqual(float(out), _cumulative_by_hand([1.0, 2.0, 1.0]))

  def test_while_loop_names_the_sow_and_the_loop(self):
    def f(x):
      return jax.lax.while_loop(
          lambda c: c[0] < 3,
          lambda c: (c[0] + 1, c[1] + sow(c[1], name='w')),
          (0, x),
      )[1]

    with self.assertRaisesRegex(
        ValueError, r"sow 'w' is inside `lax.while_loop`.*Carry a counter"
    ):
      intervene(f, {'w': lambda v: v * loop_indices()[0]})(1.0)


class Stacked(nnx.Module):
  """Three stacked layers that ``nnx.scan`` runs, each under ``nnx.remat``."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,))
    def create(rngs):
      return nnx.Linear(4, 4, rngs=rngs)

    self.layers = create(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    @nnx.remat
    def forward(layer, x):
      return jnp.tanh(layer(x))

    return forward(self.layers, x)


class NnxScanOverLayersTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.model = Stacked(nnx.Rngs(0))
    self.x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)

  def _by_hand(self, x, layer_1_output=None):
    graphdef, state = nnx.split(self.model.layers)
    h = x
    for i in range(3):
      layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
      out = layer(h)
      if i == 1 and layer_1_output is not None:
        out = layer_1_output(out)
      h = jnp.tanh(out)
    return h

  def test_a_hook_patches_one_layer(self):
    name = ('layers', '__call__')
    f = module_outputs(lambda m, x: m(x), nnx.Linear)
    seen = []

    def hook(n, v):
      seen.append(n)
      (layer,) = loop_indices()
      return jnp.where(layer == 1, -v, v)

    g = intervene(f, hook, names=[name])
    expected = self._by_hand(self.x, lambda v: -v)
    for wrap in _WRAPS.values():
      np.testing.assert_allclose(
          wrap(g)(self.model, self.x), expected, rtol=1e-5, atol=1e-6
      )
    self.assertEqual(set(seen), {name})
    # The gradient with respect to the input, through the patched layer
    # (nnx.grad: a module closed over by jax.grad around an nnx.scan fails
    # in Flax itself).
    grad = nnx.grad(lambda x, m: g(m, x).sum())(self.x, self.model)
    expected_grad = jax.grad(
        lambda x: self._by_hand(x, lambda v: -v).sum()
    )(self.x)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)
    # And inside the intervened function.
    grad = intervene(
        lambda m, x: nnx.grad(lambda x, m: f(m, x).sum())(x, m),
        hook,
        names=[name],
    )(self.model, self.x)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)

  def test_patch_one_layer_with_a_clean_run(self):
    """Activation patching of layer 2 from another input's run."""
    name = ('layers', '__call__')
    f = module_outputs(lambda m, x: m(x), nnx.Linear)
    clean = 0.5 * self.x
    _, collected = capture(f)(self.model, clean)
    (rows,) = collected[name]
    patch = lambda v: jnp.where(
        loop_indices()[0] == 2, rows[loop_indices()[0]], v
    )
    got = intervene(f, {name: patch})(self.model, self.x)
    expected = jnp.tanh(rows[2])  # the last layer's output is the clean one
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


if __name__ == '__main__':
  absltest.main()
