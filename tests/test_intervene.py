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

"""Tests of ``intervene``: sown values replaced, through every construct.

Every expected value comes from the same computation written by hand as a
function that takes the replacement as an argument (``f_with(x, r)``), never
from a second call of ``intervene``. Gradients with respect to replacements
are compared with ``jax.grad`` of those hand-written functions, and with the
cotangents ``perturb`` collects at the same sites.
"""

from __future__ import annotations

import functools
import gc
import weakref

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
from jax.experimental.scheduling_groups import xla_metadata_call
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import perturb
from flax.nnx.sow import sow

W = np.array(
    [[0.5, -1.0, 0.25], [1.5, 0.75, -0.5], [-0.3, 0.2, 1.0]], np.float32
)  # (3, 3)
X = np.array([0.3, -1.2, 0.7], np.float32)  # (3,)
XS = np.array([0.5, -1.0, 1.5, 0.25], np.float32)  # (4,) a loop's xs
R1 = np.array([2.0, -0.5, 0.1], np.float32)
R2 = np.array([-1.0, 0.25, 3.0], np.float32)


def assert_close(actual, expected, rtol=1e-5, atol=1e-6):
  """Same pytree structure and leaves equal up to float tolerance."""
  a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
  e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
  assert a_tree == e_tree, f'structure {a_tree} != expected {e_tree}'
  for a, e in zip(a_leaves, e_leaves):
    np.testing.assert_allclose(
        np.asarray(a), np.asarray(e), rtol=rtol, atol=atol
    )


def _primitive_names(jaxpr):
  return [eqn.primitive.name for eqn in jaxpr.eqns]


# ----------------------------------------------------------------------------
# A two-layer program with two sows of one name, and the same by hand.


def two_layers(x):
  h = sow(jnp.tanh(x @ W), name='h')
  g = sow(jnp.sin(h) * 2.0, name='h')
  return jnp.sum(g**2) + jnp.sum(h)


def two_layers_with(x, r1, r2):
  del x  # every path from x goes through a replaced sow
  return jnp.sum(r2**2) + jnp.sum(r1)


def two_layers_plain(x):
  h = jnp.tanh(x @ W)
  return jnp.sum((jnp.sin(h) * 2.0) ** 2) + jnp.sum(h)


class TopLevelTest(parameterized.TestCase):

  def test_several_sows_of_one_name(self):
    out = intervene(two_layers, {'h': (R1, R2)})(X)
    assert_close(out, two_layers_with(X, R1, R2))
    self.assertNotAlmostEqual(float(out), float(two_layers_plain(X)), 3)

  def test_one_replacement_changes_what_follows(self):
    def f(x):
      h = sow(jnp.tanh(x @ W), name='h')
      return sow(jnp.sin(h) * 2.0, name='g') * x

    def f_with(x, r):
      return jnp.sin(r) * 2.0 * x

    assert_close(intervene(f, {'h': (R1,)})(X), f_with(X, R1))

  def test_pytree_value(self):
    def f(x):
      d = sow({'a': x * 2.0, 'b': (x[0], x + 1.0)}, name='d')
      return d['a'] * d['b'][0] + d['b'][1]

    def f_with(x, r):
      del x
      return r['a'] * r['b'][0] + r['b'][1]

    r = {'a': R1, 'b': (np.float32(4.0), R2)}
    assert_close(intervene(f, {'d': (r,)})(X), f_with(X, r))

  def test_callable_applied_to_every_sow(self):
    def f_with(x, fn):
      h = fn(jnp.tanh(x @ W))
      g = fn(jnp.sin(h) * 2.0)
      return jnp.sum(g**2) + jnp.sum(h)

    fn = lambda v: -3.0 * v + 1.0
    assert_close(intervene(two_layers, {'h': fn})(X), f_with(X, fn))

  def test_other_names_and_tags_untouched(self):
    def f(x):
      a = sow(x * 2.0, name='a', tag='keep')
      b = sow(x + 1.0, name='b', tag='patch')
      c = sow(x - 1.0, name='b', tag='keep')
      return a * b * c

    def f_with(x, r):
      return (x * 2.0) * r * (x - 1.0)

    out = intervene(f, {'b': (R1,)}, tags=['patch'])(X)
    assert_close(out, f_with(X, R1))

  def test_python_scalar_entry(self):
    def f(x):
      return sow(jnp.sum(x), name='s') * x

    assert_close(intervene(f, {'s': (2.5,)})(X), 2.5 * X)

  def test_weakly_typed_entry_keeps_the_sown_type(self):
    def f(x):
      return sow(x * 2.0, name='h')

    out = intervene(f, {'h': (jnp.full(3, 5.0),)})(X)
    self.assertFalse(out.weak_type)
    self.assertEqual(out.dtype, jnp.float32)
    assert_close(out, np.full(3, 5.0, np.float32))

  def test_strict_false_ignores_unknown_names(self):
    out = intervene(two_layers, {'h': (R1, R2), 'absent': (R1,)}, strict=False)(
        X
    )
    assert_close(out, two_layers_with(X, R1, R2))

  def test_strict_false_replaces_the_first_sows(self):
    # One entry for two sows: the first is replaced, the second runs.
    def f_with(x, r1):
      del x
      return jnp.sum((jnp.sin(r1) * 2.0) ** 2) + jnp.sum(r1)

    out = intervene(two_layers, {'h': (R1,)}, strict=False)(X)
    assert_close(out, f_with(X, R1))

  def test_fresh_lambdas_per_call(self):
    # Each call's callable is used, not a rewrite cached for an earlier one
    # (the sows are inside a jit, whose rewrite is cached).
    g = jax.jit(two_layers)

    def f_with(x, c):
      h = jnp.tanh(x @ W) * c
      return jnp.sum((jnp.sin(h) * 2.0 * c) ** 2) + jnp.sum(h)

    for c in (1.0, 2.0, -0.5):
      out = intervene(g, {'h': lambda v, c=c: v * c})(X)
      assert_close(out, f_with(X, c))

  def test_new_values_same_layout_not_recompiled(self):
    calls = []

    @jax.jit
    def g(x):
      calls.append(None)
      return jnp.sum(sow(jnp.cos(x) * 3.0, name='h') * x)

    compiles = []

    def on_event(event, duration, **kwargs):
      del duration, kwargs
      if event == '/jax/core/compile/backend_compile_duration':
        compiles.append(event)

    def fn(v):  # one callable, passed again
      return v * 2.0

    class Steering:

      def add(self, v):
        return v + 1.0

    steering = Steering()  # steering.add is a new bound method every time
    h = np.cos(X) * 3.0
    doubled = intervene(g, {'h': fn})
    stepped = intervene(g, {'h': steering.add})
    assert_close(intervene(g, {'h': (R1,)})(X), np.sum(R1 * X))
    assert_close(doubled(X), np.sum(h * 2.0 * X))
    assert_close(stepped(X), np.sum((h + 1.0) * X))
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
      for r in (R2, R1 * 3.0):
        # New array values: a new intervene, the same compiled program.
        assert_close(intervene(g, {'h': (r,)})(X), np.sum(r * X))
        # An intervened function called again reuses its trace.
        assert_close(doubled(X), np.sum(h * 2.0 * X))
        assert_close(stepped(X), np.sum((h + 1.0) * X))
    finally:
      jax.monitoring.unregister_event_duration_listener(on_event)
    # g is traced once for array replacements and once for callables (which
    # names intervene replaces, and how, is part of jit's cache key), then
    # neither traced nor compiled again.
    self.assertLen(calls, 2)
    self.assertEqual(compiles, [])

  def test_new_intervene_traces_its_callable_again(self):
    # A sweep that builds intervene(...) per setting sees every setting, also
    # when the callable object is the same and f is jitted.
    g = jax.jit(two_layers)

    class Steering:
      alpha = 0.0

      def __call__(self, v):
        return v + self.alpha

    def by_hand(alpha):  # both sows of 'h' steered
      h = np.tanh(np.asarray(X) @ np.asarray(W)) + alpha
      second = np.sin(h) * 2.0 + alpha
      return np.sum(second**2) + np.sum(h)

    steer = Steering()
    for alpha in (0.0, 1.0, 2.5):
      steer.alpha = alpha
      assert_close(intervene(g, {'h': steer})(X), by_hand(alpha))

  def test_cache_does_not_keep_callables_alive(self):
    g = jax.jit(two_layers)
    big = np.full(3, 2.0, np.float32)  # what the callable closes over

    def make():
      return lambda v: v * big

    fn = make()
    ref = weakref.ref(fn)
    intervene(g, {'h': fn})(X)
    del fn
    gc.collect()
    self.assertIsNone(ref())

  def test_outside_arguments_and_non_array_arguments(self):
    def f(x, scale, training):
      h = sow(x * scale, name='h')
      return h + 1.0 if training else h

    assert_close(intervene(f, {'h': (R1,)})(X, 2.0, True), R1 + 1.0)
    assert_close(intervene(f, {'h': (R1,)})(X, 2.0, False), R1)


# ----------------------------------------------------------------------------
# jit


class JitTest(absltest.TestCase):

  def test_nested_jit_boundary_kept(self):
    @jax.jit
    def inner(x):
      return sow(jnp.tanh(x @ W), name='h') * 2.0

    @jax.jit
    def outer(x):
      return jnp.sin(sow(inner(x) + x, name='g'))

    def outer_with(x, rh, rg):
      del x, rh  # rh flows only into the replaced g
      return jnp.sin(rg)

    def outer_with_h(x, rh):
      return jnp.sin(rh * 2.0 + x)

    values = {'h': (R1,), 'g': (R2,)}
    assert_close(intervene(outer, values)(X), outer_with(X, R1, R2))
    assert_close(intervene(outer, {'h': (R1,)})(X), outer_with_h(X, R1))
    jaxpr = jax.make_jaxpr(intervene(outer, {'h': (R1,)}))(X)
    (outer_eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == 'jit']
    self.assertIn('jit', _primitive_names(outer_eqn.params['jaxpr'].jaxpr))

  def test_transforms_around_intervene(self):
    def f(x):
      h = sow(jnp.tanh(x @ W), name='h')
      return jnp.sum(jnp.sin(h) * x)

    def f_with(x, r):
      return jnp.sum(jnp.sin(r) * x)

    g = lambda x, r: intervene(f, {'h': (r,)})(x)
    assert_close(jax.jit(g)(X, R1), f_with(X, R1))
    assert_close(jax.grad(g)(X, R1), jax.grad(f_with)(X, R1))
    assert_close(jax.grad(g, 1)(X, R1), jnp.cos(R1) * X)
    xs, rs = np.stack([X, 2 * X]), np.stack([R1, R2])
    assert_close(jax.vmap(g)(xs, rs), jax.vmap(f_with)(xs, rs))
    assert_close(
        jax.vmap(g, (0, None))(xs, R1), jax.vmap(f_with, (0, None))(xs, R1)
    )

  def test_closure_over_enclosing_jit_tracers(self):
    def f_with(x, s, r):
      return jnp.sum(jax.lax.scan(lambda c, y: (c + r * s, None), 0.0, x)[0])

    @jax.jit
    def run(x, s):
      # f closes over s; the callable and the array replacement do too.
      @jax.jit
      def inner(y):
        return sow(y * s, name='h')

      def f(xs):
        def step(c, y):
          return c + inner(y) * s, None

        return jax.lax.scan(step, 0.0, xs)[0]

      by_fn = intervene(f, {'h': lambda v: v + s})(x)
      by_array = intervene(f, {'h': (x * s - 1.0,)})(x)
      return by_fn, by_array

    s = np.float32(1.5)
    by_fn, by_array = run(XS, s)
    # Iteration i sows y_i * s; the callable adds s; the array gives
    # x_i * s - 1.
    assert_close(by_fn, np.sum((XS * s + s) * s))
    assert_close(by_array, np.sum((XS * s - 1.0) * s))


# ----------------------------------------------------------------------------
# Loops


def cumulative(xs):
  def step(c, x):
    h = sow(jnp.tanh(c + x), name='h')
    return c + 2.0 * h, h * x

  return jax.lax.scan(step, 0.25, xs)


def cumulative_with(xs, rs, reverse=False):
  """``cumulative`` by hand; iteration ``i`` (over ``xs[i]``) uses ``rs[i]``."""
  c = np.float32(0.25)
  ys = [None] * len(xs)
  order = range(len(xs) - 1, -1, -1) if reverse else range(len(xs))
  for i in order:
    c = c + 2.0 * rs[i]
    ys[i] = rs[i] * xs[i]
  return c, np.stack(ys)


class LoopTest(parameterized.TestCase):

  RS = np.array([1.0, -2.0, 0.5, 3.0], np.float32)

  def test_scan_entry_i_replaces_iteration_i(self):
    out = intervene(cumulative, {'h': (self.RS,)})(XS)
    assert_close(out, cumulative_with(XS, self.RS))

  def test_scan_reverse(self):
    def rev(xs):
      def step(c, x):
        h = sow(jnp.tanh(c + x), name='h')
        return c + 2.0 * h, h * x

      return jax.lax.scan(step, 0.25, xs, reverse=True)

    out = intervene(rev, {'h': (self.RS,)})(XS)
    assert_close(out, cumulative_with(XS, self.RS, reverse=True))
    # The carry depends on the order: the final carry is the same sum, the
    # entries are where they belong.
    _, collected = capture(intervene(rev, {'h': (self.RS,)}))(XS)
    assert_close(collected['h'], (self.RS,))

  def test_scan_callable_per_iteration(self):
    def cumulative_fn(xs, fn):
      c, ys = np.float32(0.25), []
      for x in xs:
        h = fn(np.tanh(c + x))
        c, ys = c + 2.0 * h, ys + [h * x]
      return c, np.stack(ys)

    fn = lambda h: h * h - 1.0
    out = intervene(cumulative, {'h': fn})(XS)
    assert_close(out, cumulative_fn(XS, fn))

  def test_two_sites_in_a_scan_and_a_top_level_sow(self):
    def f(xs):
      a = sow(xs * 2.0, name='h')

      def step(c, x):
        u = sow(x + c, name='h')
        v = sow(u * 3.0, name='h')
        return c + v, u

      return jax.lax.scan(step, jnp.sum(a), xs)

    def f_with(xs, ra, ru, rv):
      c = np.sum(ra)
      ys = []
      for i in range(len(xs)):
        c, ys = c + rv[i], ys + [ru[i]]
      return c, np.stack(ys)

    ra, ru, rv = XS * 5.0, self.RS, self.RS[::-1].copy()
    out = intervene(f, {'h': (ra, ru, rv)})(XS)
    assert_close(out, f_with(XS, ra, ru, rv))

  def test_fori_loop_static_bounds(self):
    def f(x):
      return jax.lax.fori_loop(0, 4, lambda i, c: sow(c * 2.0, name='h') + i, x)

    def f_with(x, rs):
      c = x
      for i in range(4):
        c = rs[i] + i
      return c

    assert_close(intervene(f, {'h': (self.RS,)})(X[0]), f_with(X[0], self.RS))

  def test_lax_map(self):
    def f(xs):
      return jax.lax.map(lambda x: jnp.sin(sow(x * 2.0, name='h')), xs)

    assert_close(intervene(f, {'h': (self.RS,)})(XS), np.sin(self.RS))

  @parameterized.named_parameters(
      ('remainder', 3), ('divides', 2), ('one_batch', 4)
  )
  def test_lax_map_batch_size(self, k):
    def f(xs):
      return jax.lax.map(
          lambda x: jnp.sin(sow(x * 2.0, name='h')), xs, batch_size=k
      )

    # capture returns what ran: (n // k, k) from the scan over vmap, then
    # (n % k,) from the vmap over the rows left over.
    n = len(XS)
    expected = [(2.0 * XS[: n // k * k]).reshape(n // k, k)]
    if n % k:
      expected.append(2.0 * XS[n // k * k :])
    for run in (capture(f), jax.jit(capture(f))):
      out, collected = run(XS)
      assert_close(out, np.sin(2.0 * XS))
      self.assertEqual(list(collected), ['h'])
      assert_close(collected['h'], tuple(expected))

    # intervene refuses that layout as arrays, naming what the user wrote.
    for g in (
        intervene(f, collected),
        jax.jit(intervene(f, collected)),
        intervene(jax.jit(f), collected),
    ):
      with self.assertRaises(ValueError) as cm:
        g(XS)
      message = str(cm.exception)
      self.assertIn("sow 'h'", message)
      self.assertIn('`lax.map(..., batch_size=...)`', message)
      self.assertNotIn('`lax.scan` under `jax.vmap`', message)
    # A callable replaces every row; without batch_size the arrays work.
    assert_close(
        intervene(f, {'h': lambda v: v + 1.0})(XS), np.sin(2.0 * XS + 1.0)
    )
    unbatched = lambda xs: jax.lax.map(lambda x: sow(x, name='h') * 3.0, xs)
    assert_close(intervene(unbatched, {'h': (self.RS,)})(XS), 3.0 * self.RS)

  def test_scan_over_vmap_written_out_keeps_its_message(self):
    def f(xss):
      body = jax.vmap(lambda x: sow(x * 2.0, name='h'))
      return jax.lax.scan(lambda c, xs: (c, body(xs)), 0.0, xss)[1]

    xss = XS.reshape(2, 2)
    _, collected = capture(f)(xss)
    with self.assertRaisesRegex(
        ValueError, r"sow 'h' .*`lax.scan` under `jax.vmap`.*callable"
    ):
      intervene(f, collected)(xss)

  def test_nested_scans(self):
    def f(xs, ys):
      def outer(c, x):
        def inner(c2, y):
          h = sow(x * y + c2, name='h')
          return c2 + h, h * 2.0

        c2, hs = jax.lax.scan(inner, 0.0, ys)
        return c + c2, hs

      return jax.lax.scan(outer, 0.0, xs)

    def f_with(xs, ys, r):  # r: (outer, inner)
      del xs, ys
      return np.sum(r), r * 2.0

    ys = np.array([1.0, -1.0, 2.0], np.float32)
    r = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    assert_close(intervene(f, {'h': (r,)})(XS, ys), f_with(XS, ys, r))

  def test_jit_and_cond_inside_scan(self):
    @jax.jit
    def inner(c, x):
      return sow(jnp.tanh(c * x), name='h')

    def f(xs):
      def step(c, x):
        h = inner(c, x)
        g = jax.lax.cond(
            x > 0,
            lambda: sow(h + 1.0, name='g'),
            lambda: sow(h - 1.0, name='g'),
        )
        return c + g, g

      return jax.lax.scan(step, 0.5, xs)

    def f_with(xs, rh, rg):
      del rh  # only g feeds what follows, and g is replaced too
      return 0.5 + np.sum(rg), rg

    def f_with_h(xs, rh):
      c, ys = np.float32(0.5), []
      for i, x in enumerate(xs):
        g = rh[i] + 1.0 if x > 0 else rh[i] - 1.0
        c, ys = c + g, ys + [g]
      return c, np.stack(ys)

    rh, rg = self.RS, self.RS * 10.0
    assert_close(intervene(f, {'h': (rh,), 'g': (rg,)})(XS), f_with(XS, rh, rg))
    assert_close(intervene(f, {'h': (rh,)})(XS), f_with_h(XS, rh))

  def test_while_loop_callable(self):
    def f(x):
      return jax.lax.while_loop(
          lambda c: c < 50.0, lambda c: sow(c * 2.0, name='h') + 1.0, x
      )

    def f_with(x, fn):
      c = x
      while c < 50.0:
        c = fn(c * 2.0) + 1.0
      return c

    fn = lambda v: v * 1.5
    out = intervene(f, {'h': fn})(np.float32(1.0))
    assert_close(out, f_with(np.float32(1.0), fn))

  def test_fori_loop_traced_bounds_callable(self):
    def f(x, n):
      return jax.lax.fori_loop(
          0, n, lambda i, c: sow(c + 1.0, name='h') * 2.0, x
      )

    # h -> h + 3 each of n = 3 iterations: c -> (c + 4) * 2.
    c = np.float32(0.5)
    for _ in range(3):
      c = (c + 4.0) * 2.0
    out = intervene(f, {'h': lambda v: v + 3.0})(np.float32(0.5), jnp.int32(3))
    assert_close(out, c)


# ----------------------------------------------------------------------------
# Branches


class CondTest(parameterized.TestCase):

  @parameterized.parameters(1.0, -1.0)
  def test_cond_taken_branch_replaced(self, sign):
    def f(x):
      return jax.lax.cond(
          jnp.sum(x) > 0,
          lambda x: jnp.sin(sow(x * 2.0, name='h')),
          lambda x: jnp.cos(sow(x * 3.0, name='h')),
          x,
      )

    def f_with(x, r):
      return np.sin(r) if np.sum(x) > 0 else np.cos(r)

    x = sign * np.abs(X)
    assert_close(intervene(f, {'h': (R1,)})(x), f_with(x, R1))
    assert_close(jax.jit(intervene(f, {'h': (R1,)}))(x), f_with(x, R1))

  @parameterized.parameters(0, 1, 2)
  def test_switch(self, index):
    branches = [
        lambda x: sow(x, name='h') * 1.0,
        lambda x: sow(x + 1.0, name='h') * 2.0,
        lambda x: sow(x + 2.0, name='h') * 3.0,
    ]

    def f(i, x):
      return jax.lax.switch(i, branches, x)

    def f_with(i, x, r):
      del x
      return r * (i + 1.0)

    out = intervene(f, {'h': (R1,)})(jnp.int32(index), X)
    assert_close(out, f_with(index, X, R1))

  def test_branches_sowing_differently_with_callable(self):
    def f(x):
      return jax.lax.cond(
          jnp.sum(x) > 0,
          lambda x: sow(x, name='h') * 2.0,
          lambda x: x * 3.0,
          x,
      )

    fn = lambda v: v + 10.0
    assert_close(intervene(f, {'h': fn})(np.abs(X)), (np.abs(X) + 10.0) * 2.0)
    assert_close(intervene(f, {'h': fn})(-np.abs(X)), -np.abs(X) * 3.0)


# ----------------------------------------------------------------------------
# remat and custom derivative rules


class RematTest(absltest.TestCase):

  def test_checkpoint_value_and_grad(self):
    def f(x):
      return jnp.sum(
          jax.checkpoint(lambda x: jnp.sin(sow(x * 2.0, name='h')) * x)(x)
      )

    def f_with(x, r):
      return jnp.sum(jnp.sin(r) * x)

    g = lambda x, r: intervene(f, {'h': (r,)})(x)
    assert_close(g(X, R1), f_with(X, R1))
    assert_close(jax.grad(g)(X, R1), np.sin(R1))
    assert_close(jax.grad(g, 1)(X, R1), np.cos(R1) * X)
    # The checkpoint is kept (primitive ``remat2``), also under grad.
    for jaxpr in (jax.make_jaxpr(g)(X, R1), jax.make_jaxpr(jax.grad(g))(X, R1)):
      self.assertIn('remat2', _primitive_names(jaxpr.jaxpr))

  def test_checkpoint_callable_under_grad(self):
    def f(x):
      return jnp.sum(
          jax.checkpoint(lambda x: jnp.sin(sow(x * 2.0, name='h')))(x)
      )

    def f_with(x):
      return jnp.sum(jnp.sin((x * 2.0) ** 2))

    g = lambda x: intervene(f, {'h': lambda v: v * v})(x)
    assert_close(g(X), f_with(X))
    assert_close(jax.grad(g)(X), jax.grad(f_with)(X))


@jax.custom_jvp
def sowing_fn(x):
  return jnp.sin(sow(x * 2.0, name='inside'))


@sowing_fn.defjvp
def _sowing_fn_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return sowing_fn(x), 100.0 * t  # the custom rule, not d/dx sin(2x)


@jax.custom_vjp
def sowing_vjp(x):
  return jnp.sin(sow(x * 2.0, name='inside'))


sowing_vjp.defvjp(lambda x: (sowing_vjp(x), None), lambda _, g: (-7.0 * g,))


class CustomRuleTest(parameterized.TestCase):

  def test_relu_custom_rule_kept_for_tangents(self):
    def f(x):
      return jnp.sum(jax.nn.relu(sow(x - 1.0, name='h')) * 3.0)

    def f_with(x, r):
      del x
      return jnp.sum(jax.nn.relu(r) * 3.0)

    r = np.array([0.0, 2.0, -1.0], np.float32)  # relu'(0) = 0 by its rule
    g = lambda r: intervene(f, {'h': (r,)})(X)
    assert_close(g(r), f_with(X, r))
    assert_close(jax.grad(g)(r), np.array([0.0, 3.0, 0.0], np.float32))
    assert_close(jax.grad(g)(r), jax.grad(f_with, 1)(X, r))
    jaxpr = jax.make_jaxpr(g)(r)
    self.assertIn('custom_jvp_call', _primitive_names(jaxpr.jaxpr))

  @parameterized.named_parameters(
      ('custom_jvp', sowing_fn, 'custom_jvp_call', 100.0),
      ('custom_vjp', sowing_vjp, 'custom_vjp_call', -7.0),
  )
  def test_sow_inside_custom_rule(self, fn, primitive, slope):
    g = lambda x: jnp.sum(intervene(fn, {'inside': (R1,)})(x))
    assert_close(g(X), np.sum(np.sin(R1)))
    # The custom rule gives the derivative with respect to x.
    assert_close(jax.grad(g)(X), np.full(3, slope, np.float32))
    self.assertIn(primitive, _primitive_names(jax.make_jaxpr(g)(X).jaxpr))
    # A callable inside the custom function.
    out = intervene(fn, {'inside': lambda v: v + 1.0})(X)
    assert_close(out, np.sin(X * 2.0 + 1.0))
    # The rule says nothing about the replacement: its gradient is zero
    # (documented; perturb collects nothing there either).
    grad_r = jax.grad(lambda r: jnp.sum(intervene(fn, {'inside': (r,)})(X)))
    assert_close(grad_r(R1), np.zeros(3, np.float32))


# ----------------------------------------------------------------------------
# vmap inside f


class VmapInsideTest(absltest.TestCase):

  def test_mapped_axis_first(self):
    def f(m):  # maps over the columns of m
      return jax.vmap(
          lambda col: jnp.sum(sow(col * 2.0, name='h') ** 2),
          in_axes=1,
      )(m)

    def f_with(m, r):  # r: (columns, rows), the mapped axis first
      del m
      return np.sum(r**2, axis=1)

    r = np.arange(9.0, dtype=np.float32).reshape(3, 3) - 4.0
    assert_close(intervene(f, {'h': (r,)})(W), f_with(W, r))

  def test_value_not_varying_over_the_map(self):
    def f(xs):
      return jax.vmap(lambda x: x * sow(jnp.float32(2.0), name='c'))(xs)

    r = np.array([1.0, 2.0, 3.0, 4.0], np.float32)  # one per example
    assert_close(intervene(f, {'c': (r,)})(XS), XS * r)

  def test_callable_per_example(self):
    def f(m):
      return jax.vmap(lambda row: sow(row @ W, name='h'))(m)

    # Per example, v - mean(v) centres each row; over the batch it would
    # centre the whole matrix.
    out = intervene(f, {'h': lambda v: v - jnp.mean(v)})(W)
    rows = W @ W
    assert_close(out, rows - rows.mean(axis=1, keepdims=True))

  def test_callable_in_a_loop_under_vmap(self):
    def f(xss):
      return jax.vmap(cumulative)(xss)

    fn = lambda h: h * 0.5 + 1.0

    def by_hand(xs):
      c, ys = np.float32(0.25), []
      for x in xs:
        h = fn(np.tanh(c + x))
        c, ys = c + 2.0 * h, ys + [h * x]
      return c, np.stack(ys)

    xss = np.stack([XS, XS[::-1]])
    c, ys = intervene(f, {'h': fn})(xss)
    expected = [by_hand(xs) for xs in xss]
    assert_close(c, np.stack([e[0] for e in expected]))
    assert_close(ys, np.stack([e[1] for e in expected]))

  def test_unreplaced_unbatched_sows_stay_unbatched(self):
    # jacfwd maps over a tangent basis and wants the primal unbatched;
    # vmap(out_axes=None) wants an unbatched output. Sows intervene does
    # not replace keep that.
    def f(x):
      jac = jax.jacfwd(lambda y: sow(jnp.sin(y), name='inner'))(x)
      shared = jax.vmap(
          lambda r: sow(jnp.sum(x), name='shared'), out_axes=None
      )(W)
      return sow(jac @ x, name='h') * shared

    assert_close(intervene(f, {'h': (R1,)})(X), R1 * np.sum(X))

  def test_cond_on_a_batched_predicate(self):
    def f(xs):
      return jax.vmap(
          lambda x: jax.lax.cond(
              jnp.sum(x) > 0,
              lambda: sow(x, name='h') * 2.0,
              lambda: sow(-x, name='h') * 3.0,
          )
      )(xs)

    def f_with(x, fn):  # one example, the branch it takes
      return fn(x) * 2.0 if np.sum(x) > 0 else fn(-x) * 3.0

    fn = lambda v: v + 100.0
    xs = np.stack([X, -X, np.abs(X)])
    expected = np.stack([f_with(x, fn) for x in xs])
    assert_close(intervene(f, {'h': fn})(xs), expected)
    # vmap runs both branches and selects: an array cannot be matched to the
    # branch taken; around intervene it can.
    with self.assertRaisesRegex(
        ValueError, r"sow 'h' .*predicate batched by `jax.vmap`.*callable"
    ):
      intervene(f, {'h': (np.zeros((3, 3), np.float32),)})(xs)
    one = lambda x: jax.lax.cond(
        jnp.sum(x) > 0,
        lambda: sow(x, name='h') * 2.0,
        lambda: sow(-x, name='h') * 3.0,
    )
    out = jax.vmap(lambda x, r: intervene(one, {'h': (r,)})(x))(xs, xs * 10.0)
    assert_close(
        out, np.stack([x * 10.0 * (2.0 if np.sum(x) > 0 else 3.0) for x in xs])
    )

  def test_array_in_a_loop_under_vmap_raises(self):
    def f(xss):
      return jax.vmap(cumulative)(xss)

    xss = np.stack([XS, XS[::-1]])
    for r in (np.zeros((2, 4), np.float32), np.zeros((4, 2), np.float32)):
      with self.assertRaisesRegex(
          ValueError, r"sow 'h' .*`lax.scan` under `jax.vmap`.*callable"
      ):
        intervene(f, {'h': (r,)})(xss)

  def test_vmap_around_intervene_in_a_loop(self):
    rs = np.stack([LoopTest.RS, -LoopTest.RS])
    xss = np.stack([XS, XS * 2.0])
    c, ys = jax.vmap(lambda xs, r: intervene(cumulative, {'h': (r,)})(xs))(
        xss, rs
    )
    for i in range(2):
      ec, eys = cumulative_with(xss[i], rs[i])
      assert_close((c[i], ys[i]), (ec, eys))


# ----------------------------------------------------------------------------
# Gradients with respect to the replacements


def _marked_programs(mark):
  """Programs whose marked sites do not depend on one another.

  ``mark(value, name)`` is ``sow`` or ``perturb``. With independent sites
  the gradient with respect to one replaced site, the others replaced by
  their own values, is the total derivative ``perturb`` collects.
  """

  def top(x):
    h = mark(jnp.tanh(x @ W), 'h')
    g = mark(jnp.sin(x) * 2.0, 'h')
    return jnp.sum((g * h) ** 2)

  def in_jit(x):
    return jax.jit(top)(x)

  def in_scan(xs):
    def step(c, x):
      h = mark(jnp.tanh(x + 1.0), 'h')
      return c * h + h, None

    return jnp.sum(jax.lax.scan(step, 0.5, xs)[0] ** 2)

  def cond_in_scan(xs):
    def step(c, x):
      h = jax.lax.cond(
          x > 0.4, lambda: mark(jnp.tanh(x), 'h'), lambda: mark(x * 3.0, 'h')
      )
      return c * h + h, None

    return jnp.sum(jax.lax.scan(step, 0.5, xs)[0] ** 2)

  def in_checkpoint(x):
    return jax.checkpoint(top)(x)

  def in_vmap(x):
    return jnp.sum(jax.vmap(lambda r: mark(jnp.tanh(r @ x), 'h'))(W) ** 3)

  return dict(
      top=top,
      in_jit=in_jit,
      in_scan=in_scan,
      cond_in_scan=cond_in_scan,
      in_checkpoint=in_checkpoint,
      in_vmap=in_vmap,
  )


_SOWING = _marked_programs(lambda v, n: sow(v, name=n))
_PERTURBED = _marked_programs(lambda v, n: perturb(v, name=n))


class GradientTest(parameterized.TestCase):

  def test_grad_matches_hand_written(self):
    g = lambda r1, r2: intervene(two_layers, {'h': (r1, r2)})(X)
    assert_close(
        jax.grad(g, (0, 1))(R1, R2),
        jax.grad(two_layers_with, (1, 2))(X, R1, R2),
    )
    # A loop: d/d rs of cumulative's final carry and sum of ys.
    loss = lambda rs: jnp.sum(intervene(cumulative, {'h': (rs,)})(XS)[1]) + (
        intervene(cumulative, {'h': (rs,)})(XS)[0]
    )
    assert_close(jax.grad(loss)(LoopTest.RS), XS + 2.0)

  @parameterized.named_parameters(*[(k, k) for k in _SOWING])
  def test_grad_equals_perturb_cotangent(self, program):
    x = XS[:3] if program in ('in_scan', 'cond_in_scan') else X
    _, collected = capture(_SOWING[program])(x)
    v0 = collected['h']  # the program's own values: the same point
    loss = lambda v: intervene(_SOWING[program], {'h': v})(x)
    _, cotangents = capture(jax.grad(_PERTURBED[program]))(x)
    grads = jax.grad(loss)(v0)
    self.assertLen(grads, len(cotangents['h']))
    assert_close(grads, cotangents['h'], rtol=1e-5, atol=1e-5)
    assert_close(jax.jit(jax.grad(loss))(v0), cotangents['h'], atol=1e-5)


# ----------------------------------------------------------------------------
# capture and intervene together; patching one run into another


class CaptureCompositionTest(absltest.TestCase):

  def test_capture_of_intervene_collects_replaced_values(self):
    out, collected = capture(intervene(two_layers, {'h': (R1, R2)}))(X)
    assert_close(out, two_layers_with(X, R1, R2))
    self.assertEqual(list(collected), ['h'])
    assert_close(collected['h'], (R1, R2))

  def test_intervene_of_capture_collects_replaced_values(self):
    out, collected = intervene(capture(two_layers), {'h': (R1, R2)})(X)
    assert_close(out, two_layers_with(X, R1, R2))
    assert_close(collected['h'], (R1, R2))

  def test_callable_replacement_collected(self):
    def f(x):
      h = sow(jnp.tanh(x @ W), name='h')
      return sow(h * 2.0, name='g')

    fn = lambda v: v + 1.0
    out, collected = capture(intervene(f, {'h': fn}))(X)
    h = np.tanh(X @ W) + 1.0
    assert_close(out, h * 2.0)
    self.assertEqual(list(collected), ['h', 'g'])
    assert_close(collected['h'], (h,))
    assert_close(collected['g'], (h * 2.0,))

  def test_capture_in_a_loop_collects_replaced_values(self):
    _, collected = capture(intervene(cumulative, {'h': (LoopTest.RS,)}))(XS)
    assert_close(collected['h'], (LoopTest.RS,))

  def test_patch_from_another_run(self):
    def f(x):
      h = sow(jnp.tanh(x @ W), name=('layer', 0))
      g = sow(jnp.sin(h) @ W, name=('layer', 1))
      return jnp.sum(g**2)

    def f_plain(x):
      return jnp.sum((jnp.sin(jnp.tanh(x @ W)) @ W) ** 2)

    clean, corrupt = X, X[::-1] * 2.0
    _, collected = capture(f)(clean)
    patched = intervene(f, collected)(corrupt)
    assert_close(patched, f_plain(clean))
    # Only layer 0 from the clean run: the rest is computed from it.
    patched = intervene(f, {('layer', 0): collected[('layer', 0)]})(corrupt)
    assert_close(patched, f_plain(clean))

  def test_patch_from_another_run_in_a_loop(self):
    clean, corrupt = XS, XS * -3.0
    _, collected = capture(cumulative)(clean)
    c, ys = intervene(cumulative, collected)(corrupt)
    (h,) = collected['h']
    ec, eys = cumulative_with(corrupt, np.asarray(h))
    assert_close((c, ys), (ec, eys))
    # The carry depends only on the patched values: as in the clean run.
    assert_close(c, cumulative(clean)[0])

  def test_decorated_capture_is_not_taken_for_capture(self):
    # A wrapper that copied capture's attributes (functools.wraps) changes
    # the output; intervene must not skip it.
    def double_output(fn):
      @functools.wraps(fn)
      def wrapper(*args):
        out, collected = fn(*args)
        return out * 100.0, collected

      return wrapper

    with self.assertRaisesRegex(ValueError, r"named 'h'.*capture\(intervene"):
      intervene(double_output(capture(two_layers)), {'h': (R1, R2)})(X)
    out, _ = capture(intervene(two_layers, {'h': (R1, R2)}))(X)
    assert_close(out, two_layers_with(X, R1, R2))


# ----------------------------------------------------------------------------
# A capture around intervene, with jax.vmap inside f: the layouts of capture
# on the function with the replacement written by hand.

_BX = np.array([0.5, -1.0, 1.5], np.float32)  # (3,) examples of a vmap
_STEPS = 2  # != len(_BX): a transposed layout changes the shape
_FN = lambda v: v * 0.5 - 1.0  # noqa: E731
_FN2 = lambda v: v * v + 2.0  # noqa: E731


def _add(acc, v):
  return acc + v


def _zero():
  return jnp.zeros((), jnp.float32)


def _vmapped_loop(loop):
  """``sow(xs)``, then under ``jax.vmap`` a loop of ``_STEPS`` iterations
  whose carry is sown plain (``'c'``) and reduced (``'r'``)."""

  def step(c):
    h = sow(c * 2.0 + 0.25, name='c')
    sow(h, name='r', reduce_fn=_add, init_fn=_zero)
    return jnp.sin(h)

  def one(x):
    if loop == 'scan':
      return jax.lax.scan(lambda c, _: (step(c), None), x, None, _STEPS)[0]
    return jax.lax.fori_loop(0, _STEPS, lambda i, c: step(c), x)

  def f(xs):
    sow(xs, name='top')
    return jax.vmap(one)(xs)

  return f


def _vmapped_loop_by_hand(xs, fn):
  """NumPy: the loop with ``h = fn(c * 2 + 0.25)``, per example."""
  outs, hs, total = [], [], np.float32(0.0)
  for x in xs:
    c, row = x, []
    for _ in range(_STEPS):
      h = fn(c * 2.0 + 0.25)
      row.append(h)
      total = total + h
      c = np.sin(h)
    outs.append(c)
    hs.append(row)
  # capture's layout for a loop under vmap: (batch, steps).
  return np.stack(outs), np.asarray(hs, np.float32), total


def _vmapped_cond(xs):
  def one(x):
    return jax.lax.cond(
        x.sum() > 0,
        lambda x: sow(x * 2.0, name='k')
        + sow(x.sum(), name='m', reduce_fn=_add, init_fn=_zero),
        lambda x: sow(x * 3.0, name='k') - 1.0,
        x,
    )

  return jax.vmap(one)(xs)


_CX = np.array([[1.0, 2.0], [-1.0, -2.0], [0.5, -0.25]], np.float32)


def _vmapped_cond_by_hand(xs, fn):
  outs, ks, m = [], [], np.float32(0.0)
  for x in xs:
    if x.sum() > 0:
      k = fn(x * 2.0)
      outs.append(k + x.sum())
      m = m + x.sum()
    else:
      k = fn(x * 3.0)
      outs.append(k - 1.0)
    ks.append(k)
  return np.stack(outs), np.stack(ks), m


class CaptureOfInterveneUnderVmapTest(parameterized.TestCase):
  """A sow in a construct that ``jax.vmap`` batches inside the intervened
  function: intervene keeps it in place, and the capture around still gets
  it with the mapped axis first (only the branch taken, for a ``cond``)."""

  def _check(self, got, expected_out, expected):
    out, collected = got
    assert_close(out, expected_out)
    self.assertEqual(list(collected), list(expected))
    for name, value in expected.items():
      if isinstance(value, tuple):
        self.assertLen(collected[name], len(value))
        for a, e in zip(collected[name], value):
          self.assertEqual(np.shape(a), np.shape(e), name)
      assert_close(collected[name], value)

  @parameterized.parameters('scan', 'fori_loop')
  def test_loop_replaced(self, loop):
    f = _vmapped_loop(loop)
    out, hs, total = _vmapped_loop_by_hand(_BX, _FN)
    self.assertEqual(hs.shape, (3, _STEPS))
    expected = {'top': (_BX,), 'c': (hs,), 'r': total}
    for g in (
        capture(intervene(f, {'c': _FN})),
        intervene(capture(f), {'c': _FN}),
        jax.jit(capture(intervene(f, {'c': _FN}))),
    ):
      self._check(g(_BX), out, expected)

  @parameterized.parameters('scan', 'fori_loop')
  def test_loop_not_replaced(self, loop):
    f = _vmapped_loop(loop)
    out, hs, total = _vmapped_loop_by_hand(_BX, lambda v: v)
    expected = {'top': (_BX,), 'c': (hs,), 'r': total}
    for g in (
        capture(intervene(f, {})),
        capture(intervene(f, {'top': lambda v: v})),
        intervene(capture(f), {'top': lambda v: v}),
        jax.jit(capture(intervene(f, {'top': lambda v: v}))),
    ):
      self._check(g(_BX), out, expected)

  def test_loop_in_two_intervenes(self):
    # The inner intervene replaces first, the outer one replaces its result.
    f = _vmapped_loop('scan')
    out, hs, total = _vmapped_loop_by_hand(_BX, lambda v: _FN2(_FN(v)))
    g = capture(intervene(intervene(f, {'c': _FN}), {'c': _FN2}))
    self._check(g(_BX), out, {'top': (_BX,), 'c': (hs,), 'r': total})

  def test_nested_vmapped_loops(self):
    # vmap(scan(vmap(scan))): (batch, steps, batch, steps).
    def f(xss):
      def outer(xs):
        def s1(c, _):
          inner = jax.vmap(
              lambda x: jax.lax.scan(
                  lambda d, _: (jnp.cos(sow(d * 2.0 + c, name='c')), None),
                  x,
                  None,
                  2,
              )[0]
          )(xs)
          return c + inner.sum(), None

        return jax.lax.scan(s1, jnp.float32(0.0), None, 4)[0]

      return jax.vmap(outer)(xss)

    xss = np.arange(6.0, dtype=np.float32).reshape(2, 3) / 4.0
    outs, hs = [], np.zeros((2, 4, 3, 2), np.float32)
    for b1, xs in enumerate(xss):
      c = np.float32(0.0)
      for s1 in range(4):
        total = np.float32(0.0)
        for b2, x in enumerate(xs):
          d = x
          for s2 in range(2):
            h = _FN(d * 2.0 + c)
            hs[b1, s1, b2, s2] = h
            d = np.cos(h)
          total = total + d
        c = c + total
      outs.append(c)
    for g in (
        capture(intervene(f, {'c': _FN})),
        intervene(capture(f), {'c': _FN}),
    ):
      self._check(g(xss), np.stack(outs), {'c': (hs,)})

  def test_cond_in_a_vmapped_loop(self):
    # The predicate depends on the carry, so vmap batches the cond too.
    def f(xs):
      def step(c, _):
        c = jax.lax.cond(
            c > 0,
            lambda c: sow(c - 1.0, name='k'),
            lambda c: sow(c * -2.0, name='k'),
            c,
        )
        return c, None

      return jax.vmap(lambda x: jax.lax.scan(step, x, None, 3)[0])(xs)

    outs, ks = [], []
    for x in _BX:
      c, row = x, []
      for _ in range(3):
        c = _FN(c - 1.0) if c > 0 else _FN(c * -2.0)
        row.append(c)
      outs.append(c)
      ks.append(row)
    ks = np.asarray(ks, np.float32)  # (batch, steps)
    self.assertEqual(ks.shape, (3, 3))
    for g in (
        capture(intervene(f, {'k': _FN})),
        intervene(capture(f), {'k': _FN}),
    ):
      self._check(g(_BX), np.stack(outs), {'k': (ks,)})

  def test_cond_on_a_batched_predicate(self):
    for values, fn in (({'k': _FN}, _FN), ({}, lambda v: v)):
      out, ks, m = _vmapped_cond_by_hand(_CX, fn)
      expected = {'k': (ks,), 'm': m}
      for g in (
          capture(intervene(_vmapped_cond, values)),
          intervene(capture(_vmapped_cond), values),
          jax.jit(capture(intervene(_vmapped_cond, values))),
      ):
        self._check(g(_CX), out, expected)

  def test_cond_on_a_batched_predicate_plain_only(self):
    # (Was a NotImplementedError.) By hand: the taken branch's value plus 1.
    def f(x):
      return jax.lax.cond(
          x.sum() > 0,
          lambda x: sow(x * 2.0, name='k'),
          lambda x: sow(x * 3.0, name='k'),
          x,
      )

    xs = jnp.array([[1.0, 2.0], [-1.0, -2.0]])
    expected = np.array([[3.0, 5.0], [-2.0, -5.0]], np.float32)
    g = intervene(jax.vmap(f), {'k': lambda v: v + 1.0})
    self._check(capture(g)(xs), expected, {'k': (expected,)})
    assert_close(g(xs), expected)
    out, collected = jax.vmap(capture(intervene(f, {'k': lambda v: v + 1.0})))(
        xs
    )
    assert_close(out, expected)
    assert_close(collected['k'], (expected,))

  def test_gradient_through_the_collected_value(self):
    f = _vmapped_loop('scan')
    weights = np.arange(1.0, 7.0, dtype=np.float32).reshape(3, _STEPS)

    def by_hand(xs):  # the same program in jnp, with the replacement
      hs, c = [], xs
      for _ in range(_STEPS):
        h = _FN(c * 2.0 + 0.25)
        hs.append(h)
        c = jnp.sin(h)
      return jnp.sum(jnp.stack(hs, axis=1) * weights)

    grad = jax.grad(
        lambda xs: jnp.sum(
            capture(intervene(f, {'c': _FN}))(xs)[1]['c'][0] * weights
        )
    )(_BX)
    assert_close(grad, jax.grad(by_hand)(_BX))

  def test_custom_rule_that_skips_the_primal(self):
    # Under grad inside the capture/intervene, JAX runs this custom_jvp's
    # rule, not its body: its sows do not run (a missing name for capture,
    # an error naming custom_jvp for intervene). With grad around intervene,
    # intervene's rule evaluates the replaced body for the primal output,
    # so its split sows count as sown values.
    def make(fn):
      @jax.custom_jvp
      def g(xs):
        one = lambda x: jax.lax.scan(
            lambda c, _: (sow(fn(c * 2.0), name='c') + 1.0, None),
            x,
            None,
            _STEPS,
        )[0]
        return jax.vmap(one)(xs)

      g.defjvp(lambda p, t: (p[0] * 7.0, t[0]))  # never calls g
      return lambda xs: jnp.sum(g(xs))

    hs = []
    for x in _BX:
      c, row = x, []
      for _ in range(_STEPS):
        row.append(_FN(c * 2.0))
        c = row[-1] + 1.0
      hs.append(row)
    hs = np.asarray(hs, np.float32)  # (batch, steps)
    expected_grad = np.ones_like(_BX)  # the rule's tangent
    plain = make(lambda v: v)
    self._check(
        capture(jax.grad(make(_FN)))(_BX), expected_grad, {}
    )  # the replacement by hand: the body does not run
    for g in (
        capture(intervene(jax.grad(plain), {'c': _FN})),
        intervene(capture(jax.grad(plain)), {'c': _FN}),
    ):
      with self.assertRaisesRegex(
          ValueError, r"named 'c'.*`jax.custom_jvp`/`jax.custom_vjp`"
      ):
        g(_BX)
    g = capture(jax.grad(intervene(plain, {'c': _FN})))
    self._check(g(_BX), expected_grad, {'c': (hs,)})

  def test_array_replacement_in_a_vmapped_loop_raises(self):
    f = _vmapped_loop('scan')
    with self.assertRaisesRegex(
        ValueError, r"sow 'c' .*`lax.scan` under `jax.vmap`.*callable"
    ):
      capture(intervene(f, {'c': (np.zeros((3, _STEPS), np.float32),)}))(_BX)


# ----------------------------------------------------------------------------
# perturb names


class PerturbTest(absltest.TestCase):

  def loss(self, x):
    h = perturb(jnp.tanh(x @ W), name='h')
    return jnp.sum(h**2 * x)

  def loss_with(self, x, r):
    return jnp.sum(r**2 * x)

  def test_primal_replaced(self):
    assert_close(intervene(self.loss, {'h': (R1,)})(X), self.loss_with(X, R1))

  def test_cotangent_at_the_replacement(self):
    loss = lambda r: intervene(self.loss, {'h': (r,)})(X)
    grad_r, collected = capture(jax.grad(loss))(R1)
    # d loss / d h at the replacement, collected by perturb and returned.
    assert_close(grad_r, 2.0 * R1 * X)
    assert_close(collected['h'], (2.0 * R1 * X,))
    # x reaches the loss only directly once h is replaced.
    grad_x = jax.grad(intervene(self.loss, {'h': (R1,)}))(X)
    assert_close(grad_x, R1**2)


# ----------------------------------------------------------------------------
# NNX graph nodes and nnx.capture States


class Counter(nnx.Module):

  def __init__(self, **variable_kwargs):
    self.count = nnx.Variable(jnp.zeros((), jnp.int32), **variable_kwargs)
    self.w = nnx.Param(jnp.asarray(W))

  def __call__(self, x):
    self.count[...] += 1
    return jnp.sum(sow(x @ self.w[...], name='h') ** 2)


class BatchNormNet(nnx.Module):

  def __init__(self):
    self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    self.bn = nnx.BatchNorm(4, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.bn(sow(self.linear(x), name='pre'))


class PerturbedNet(nnx.Module):

  def __init__(self):
    self.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

  def __call__(self, x):
    h = self.perturb('h', self.linear(x))
    self.sow(nnx.Intermediate, 'i', h * 2.0)
    return jnp.sum(h**2)


class NnxTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('plain', {}), ('ref', {'ref': True}), ('hijax', {'hijax': True})
  )
  def test_counter_updated(self, variable_kwargs):
    model = Counter(**variable_kwargs)
    out = intervene(lambda m, x: m(x), {'h': (R1,)})(model, X)
    assert_close(out, np.sum(R1**2))
    self.assertEqual(int(model.count[...]), 1)
    intervened = lambda m, x: intervene(lambda m, x: m(x), {'h': (R1,)})(m, x)
    if variable_kwargs:  # ref and Hijax Variables are updated in place
      step = jax.jit(lambda x: intervened(model, x))(X)
    else:  # (nnx.jit rejects Hijax Variables in Flax 0.12.8)
      step = nnx.jit(intervened)(model, X)
    assert_close(step, np.sum(R1**2))
    self.assertEqual(int(model.count[...]), 2)

  def test_batch_norm_statistics_from_the_replacement(self):
    net = BatchNormNet()
    x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    r = np.array([[1.0, -2.0, 0.5, 3.0], [0.0, 4.0, -1.5, 1.0]], np.float32)
    out = intervene(lambda net, x: net(x), {'pre': (r,)})(net, x)
    mean, var = r.mean(0), r.var(0)
    assert_close(out, (r - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-5)
    # Running statistics (momentum 0.99) moved towards the replacement's.
    assert_close(net.bn.mean[...], 0.01 * mean, atol=1e-6)
    assert_close(net.bn.var[...], 0.99 + 0.01 * var, atol=1e-6)

  def _kernel_and_bias(self, net):
    return np.asarray(net.linear.kernel[...]), np.asarray(net.linear.bias[...])

  def test_intermediate_state_as_values(self):
    net = PerturbedNet()
    _, state = nnx.capture(net, nnx.Intermediate)(X)
    r = np.array([1.0, -2.0], np.float32)
    state['i'].set_value((r,))
    # Module.sow returns a bool, so the output is unchanged; what a capture
    # around collects is the replacement.
    out, collected = capture(intervene(lambda n, x: n(x), state))(net, X)
    kernel, bias = self._kernel_and_bias(net)
    assert_close(out, np.sum((X @ kernel + bias) ** 2))
    assert_close(collected[('i',)], (r,))

  def test_perturbation_state_as_values(self):
    net = PerturbedNet()
    _, state = nnx.capture(net, nnx.Perturbation)(X)  # zeros, Flax's step 1
    r = np.array([1.5, -0.5], np.float32)
    state['h'][...] = r
    out = intervene(lambda n, x: n(x), state)(net, X)
    assert_close(out, np.sum(r**2))
    # Also the State of the gradients (nnx.capture of nnx.grad).
    _, grads = nnx.capture(nnx.grad(lambda n, x: n(x)), nnx.Perturbation)(
        net, X
    )
    kernel, bias = self._kernel_and_bias(net)
    h = X @ kernel + bias
    assert_close(grads['h'][...], 2.0 * h)
    out = intervene(lambda n, x: n(x), grads)(net, X)
    assert_close(out, np.sum((2.0 * h) ** 2))

  def test_nnx_capture_of_intervened_function(self):
    net = PerturbedNet()
    r = np.array([3.0, 1.0], np.float32)
    f = intervene(lambda n, x: n(x), {('h',): (r,)})
    out, state = nnx.capture(f, nnx.Intermediate)(net, X)
    assert_close(out, np.sum(r**2))
    assert_close(state['i'].get_value(), (r * 2.0,))


# ----------------------------------------------------------------------------
# Errors: each names the sow, the construct and the fix.


class ErrorTest(parameterized.TestCase):

  def f(self, x):
    return sow(x * 2.0, name='h') + 1.0

  def test_wrong_shape(self):
    with self.assertRaisesRegex(
        ValueError,
        r"sow 'h' \(at .*test_intervene.py.*values\['h'\]\[0\] is .*"
        r'float32\[2\].*sown value is .*float32\[3\].*nothing is broadcast',
    ):
      intervene(self.f, {'h': (np.zeros(2, np.float32),)})(X)

  def test_wrong_dtype(self):
    with self.assertRaisesRegex(
        ValueError, r"values\['h'\]\[0\] is .*int32\[3\].*float32\[3\]"
    ):
      intervene(self.f, {'h': (np.zeros(3, np.int32),)})(X)

  def test_wrong_structure(self):
    with self.assertRaisesRegex(
        ValueError,
        r"values\['h'\]\[0\] is PyTreeDef\(\(\*, \*\)\).*sown value is"
        r' PyTreeDef\(\*\)',
    ):
      intervene(self.f, {'h': ((R1, R1),)})(X)

  def test_wrong_shape_from_callable(self):
    with self.assertRaisesRegex(
        ValueError, r"values\['h'\]\(value\) is .*float32\[2\]"
    ):
      intervene(self.f, {'h': lambda v: v[:2]})(X)

  def test_wrong_shape_in_a_loop(self):
    with self.assertRaisesRegex(
        ValueError,
        r"values\['h'\]\[0\] replaces a sow inside a loop of 4 iterations.*"
        r'leading axis of 4',
    ):
      intervene(cumulative, {'h': (np.zeros(3, np.float32),)})(XS)

  def test_wrong_dtype_in_nested_loops_names_the_row(self):
    # The check runs on one iteration's row; the message says so, since the
    # user passed the stacked (outer, inner) array.
    def nested(xs):
      inner = lambda c, y: (c, sow(y * 2.0, name='h'))
      outer = lambda c, row: (c, jax.lax.scan(inner, 0.0, row)[1])
      return jax.lax.scan(outer, 0.0, xs)[1]

    xs = np.ones((3, 2), np.float32)
    np.testing.assert_allclose(
        intervene(nested, {'h': (np.full((3, 2), 4.0, np.float32),)})(xs),
        np.full((3, 2), 4.0),
    )
    with self.assertRaisesRegex(
        ValueError,
        r"values\['h'\]\[0\] \(its row for one iteration of an enclosing"
        r' loop\) is .*float16\[\].*sown value is .*float32\[\]',
    ):
      intervene(nested, {'h': (np.zeros((3, 2), np.float16),)})(xs)
    with self.assertRaisesRegex(
        ValueError,
        r"values\['h'\]\[0\] \(its row for one iteration of an enclosing"
        r' loop\) replaces a sow inside a loop of 2 iterations',
    ):
      intervene(nested, {'h': (np.zeros((3, 1), np.float32),)})(xs)

  def test_unknown_name(self):
    with self.assertRaisesRegex(
        ValueError, r"no sow .* named 'k'.*strict=False"
    ):
      intervene(self.f, {'h': (R1,), 'k': (R1,)})(X)

  def test_too_few_entries(self):
    with self.assertRaisesRegex(
        ValueError,
        r"values\['h'\] has 1 entries, but the program sows 'h' at least 2"
        r' times.*Pass a tuple of that length',
    ):
      intervene(two_layers, {'h': (R1,)})(X)

  def test_too_many_entries(self):
    with self.assertRaisesRegex(
        ValueError,
        r"values\['h'\] has 3 entries, but the program sows 'h' 2 times",
    ):
      intervene(two_layers, {'h': (R1, R2, R1)})(X)

  def test_too_few_entries_for_a_jit(self):
    g = jax.jit(two_layers)
    with self.assertRaisesRegex(ValueError, r'has 1 entries.*at least 2'):
      intervene(g, {'h': (R1,)})(X)

  def test_reduced_name(self):
    def f(x):
      sow(x, name='r', reduce_fn=lambda a, v: a + v, init_fn=lambda: 0.0)
      return x

    for value in ((R1,), lambda v: v):
      with self.assertRaisesRegex(
          ValueError, r"sow 'r' \(at .*\) is reduced.*drop the name"
      ):
        intervene(f, {'r': value})(X)

  @parameterized.parameters('while', 'fori')
  def test_array_inside_while_loop(self, kind):
    def f(x, n):
      body = lambda c: sow(c * 2.0, name='h')
      if kind == 'while':
        return jax.lax.while_loop(lambda c: c < 10.0, body, x)
      return jax.lax.fori_loop(0, n, lambda i, c: body(c), x)

    with self.assertRaisesRegex(
        ValueError,
        r"sow 'h' \(at .*\) is inside `lax.while_loop`.*Pass a callable",
    ):
      intervene(f, {'h': (np.ones(3, np.float32),)})(
          np.float32(1.0), jnp.int32(3)
      )

  def test_branches_sowing_different_numbers_of_times(self):
    def f(x):
      return jax.lax.cond(
          jnp.sum(x) > 0, lambda: sow(x, name='h'), lambda: x * 2.0
      )

    with self.assertRaisesRegex(
        ValueError,
        r"sow 'h' .*branches of `lax.cond`/`lax.switch` sow it \[0, 1\]"
        r' times.*callable',
    ):
      intervene(f, {'h': (R1,)})(X)

  def test_construct_without_a_rule(self):
    def f(x):
      # A higher-order primitive that no construct file handles.
      return xla_metadata_call(
          lambda v: sow(v, name='h') * 2.0, scheduling_group='g'
      )(x)

    with self.assertRaisesRegex(
        NotImplementedError,
        r"sow 'h' \(at .*\) is inside `xla_metadata_call`.*no intervene rule"
        r'.*intervene_rules',
    ):
      intervene(f, {'h': lambda v: v})(X)
    # capture's error for the same construct comes from the same builder.
    with self.assertRaisesRegex(
        NotImplementedError,
        r"^capture: sow 'h' \(at .*\) is inside `xla_metadata_call`"
        r' \(primitive `xla_metadata_call` has no capture rule\), so'
        r' capture cannot collect it\..*collect_rules',
    ):
      capture(f)(X)

  def test_array_inside_shard_map(self):
    mesh = jax.make_mesh((2,), ('i',), devices=jax.devices()[:2])

    def f(x):
      return jax.shard_map(
          lambda x: sow(x * 2.0, name='h'),
          mesh=mesh,
          in_specs=jax.P(),
          out_specs=jax.P(),
      )(x)

    with self.assertRaisesRegex(
        NotImplementedError,
        r"sow 'h' \(at .*\) is inside `jax.shard_map`.*array replacements"
        r'.*callable',
    ):
      intervene(f, {'h': (X * 2.0,)})(X)
    # A callable is applied to each shard's value.
    assert_close(intervene(f, {'h': lambda v: v + 1.0})(X), X * 2.0 + 1.0)

  def test_values_not_a_mapping(self):
    with self.assertRaisesRegex(
        TypeError, r'values must be a mapping.*got list'
    ):
      intervene(self.f, [('h', (R1,))])

  def test_bare_array_instead_of_a_tuple(self):
    with self.assertRaisesRegex(
        TypeError,
        r"values\['h'\] must be a tuple .*wrap a single value as \(value,\)",
    ):
      intervene(self.f, {'h': jnp.asarray(R1)})

  def test_bad_tags(self):
    with self.assertRaisesRegex(TypeError, r"tags=\('a',\)"):
      intervene(self.f, {'h': (R1,)}, tags='a')

  def test_not_callable(self):
    with self.assertRaisesRegex(TypeError, 'f must be callable'):
      intervene(3, {'h': (R1,)})


if __name__ == '__main__':
  absltest.main()


def _pair(x):
  a, b = sow((x, 2.0 * x), name='pair')
  return a * b


def _pair_in_scan(xs):
  return jax.lax.scan(lambda c, x: (c + _pair(x), None), 0.0, xs)[0]


def _pair_in_cond(x):
  return jax.lax.cond(x.sum() > 0.0, _pair, lambda x: -_pair(x), x)


_TYPE_RULE = (
    r"(?s)sow 'pair'.*converted as jnp.asarray converts it.*must have the"
    r' structure \(a list is not a tuple\), shape and dtype'
)


class ReplacementConversionTest(parameterized.TestCase):
  """docs/guide.md: a replacement is converted as ``jnp.asarray`` converts
  it, then must have the sown value's structure, shape and dtype exactly;
  the same rule at top level, in a ``jit``, a ``scan`` (rows) and a
  ``cond``, for entries and for callables."""

  # program -> (its argument, whether its sow is in a loop (one row per
  # iteration), the output by hand for replacements a, b of the pair)
  PROGRAMS = {
      'top': (_pair, X, False, lambda a, b: a * b),
      'jit': (jax.jit(_pair), X, False, lambda a, b: a * b),
      'scan': (_pair_in_scan, XS, True, lambda a, b: 4 * a * b),
      # X sums to -0.2: the second branch runs.
      'cond': (_pair_in_cond, X, False, lambda a, b: -a * b),
  }

  @staticmethod
  def _entry(x, in_loop, leaves):
    shape = x.shape if not in_loop else (len(x),)
    full = lambda v: np.full(shape, v, np.asarray(v).dtype)
    return jax.tree.map(full, leaves)

  @parameterized.named_parameters((p, p) for p in PROGRAMS)
  def test_float64_numpy_becomes_float32(self, program):
    f, x, in_loop, by_hand = self.PROGRAMS[program]
    a, b = np.float64(0.5), np.float64(-3.0)
    entry = self._entry(x, in_loop, (a, b))
    self.assertEqual(entry[0].dtype, np.float64)
    g = intervene(f, {'pair': (entry,)})
    for run in (g, jax.jit(g)):
      out = run(x)
      self.assertEqual(out.dtype, jnp.float32)  # typed as in f
      want = by_hand(np.float32(a), np.float32(b))
      np.testing.assert_allclose(out, np.broadcast_to(want, out.shape))

  @parameterized.named_parameters((p, p) for p in PROGRAMS)
  def test_refused(self, program):
    f, x, in_loop, _ = self.PROGRAMS[program]
    one, i_one = np.float32(1.0), np.int32(1)
    wrong = {
        'int for float': (i_one, one),
        'list for tuple': [one, one],
        'dict for tuple': {'a': one, 'b': one},
    }
    for what, leaves in wrong.items():
      with self.subTest(what):
        entry = self._entry(x, in_loop, leaves)
        with self.assertRaisesRegex(ValueError, _TYPE_RULE):
          intervene(f, {'pair': (entry,)})(x)
        with self.assertRaisesRegex(ValueError, _TYPE_RULE):
          jax.jit(intervene(f, {'pair': (entry,)}))(x)

  @parameterized.named_parameters((p, p) for p in PROGRAMS)
  def test_callable_returning_a_list_is_refused(self, program):
    f, x, _, _ = self.PROGRAMS[program]
    with self.assertRaisesRegex(ValueError, _TYPE_RULE):
      intervene(f, {'pair': list})(x)

  def test_python_int_for_float_is_refused(self):
    h = lambda x: sow(jnp.sum(x), name='s') * 2.0
    with self.assertRaisesRegex(
        ValueError, r"(?s)sow 's'.*int32\[\].*float32\[\]"
    ):
      intervene(h, {'s': (3,)})(X)
    # A Python float is a float32 (weakly typed) and takes the sow's type.
    out = intervene(h, {'s': (3.0,)})(X)
    self.assertEqual(out.dtype, jnp.float32)
    np.testing.assert_allclose(out, 6.0)

  def test_float64_numpy_under_x64_is_refused(self):
    # With x64 on, jnp.asarray keeps float64: it is not the sown float32.
    with jax.enable_x64(True):
      with self.assertRaisesRegex(
          ValueError, r"(?s)sow 'pair'.*float64\[3\].*float32\[3\]"
      ):
        intervene(_pair, {'pair': ((np.ones(3), np.ones(3)),)})(X)

  def test_a_list_of_entries_is_read_as_the_tuple(self):
    h = lambda x: sow(x, name='h') + sow(2.0 * x, name='h')
    out = intervene(h, {'h': [R1, R2]})(X)
    np.testing.assert_allclose(out, R1 + R2)


class CollectedFromGradientRunTest(absltest.TestCase):

  def test_cotangents_are_not_patched_in_as_values(self):
    def loss(x):
      h = sow(jnp.tanh(x * 2.0), name='h')
      g = perturb(jnp.sin(h), name='g')
      return jnp.sum(g**2)

    clean, corrupt = jnp.array([1.0, 0.5]), jnp.array([-1.0, 2.0])
    _, collected = capture(jax.value_and_grad(loss))(clean)
    self.assertEqual(collected.cotangents, frozenset({'g'}))
    with self.assertRaisesRegex(
        ValueError, r"values\['g'\] holds the cotangents"
    ):
      intervene(loss, collected)(corrupt)
    values = {
        k: v for k, v in collected.items() if k not in collected.cotangents
    }
    expected = np.sum(np.sin(np.tanh(np.asarray(clean) * 2.0)) ** 2)
    assert_close(intervene(loss, values)(corrupt), expected)

  def test_functional_capture_of_module_perturb_has_no_internal_names(self):
    class Probe(nnx.Module):

      def __init__(self):
        self.scale = nnx.Param(jnp.float32(2.0))

      def __call__(self, x):
        return jnp.sum(self.perturb('h', x * self.scale[...]) ** 2)

    probe = Probe()
    x = jnp.array([1.0, 2.0])
    _, collected = capture(probe)(x)
    self.assertEqual(list(collected), [])
    _, collected = capture(jax.grad(lambda x: probe(x)))(x)
    self.assertEqual(list(collected), [('h',)])
    assert_close(collected[('h',)][0], 2.0 * np.asarray(x) * 2.0)
