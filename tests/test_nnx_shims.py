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


"""Tests of the NNX shims: ``Module.sow``, ``Module.perturb``, ``nnx.capture``.

Every expected value is computed independently of the code under test: by
hand, or by the same computation written without sow (the module's own
weights and plain ``jnp``/``jax.grad``). The first seven test cases are the
ones Flax 0.12.8's ``nnx.capture`` gets wrong.
"""

from __future__ import annotations

import functools
import re
import warnings

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import flax.nnx.sow  # noqa: F401  (installs the shims)
from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow.nnx import shims as nnx_shims
from flax.nnx.sow import sow
from flax.nnx.sow.nnx import state as state_lib

nnx_shims.install()

W = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
B = np.array([0.25, -1.0], np.float32)


class Dense(nnx.Module):
  """``x @ W + B`` with fixed weights; sows its output as 'act'."""

  def __init__(self):
    self.w = nnx.Param(jnp.asarray(W))
    self.b = nnx.Param(jnp.asarray(B))

  def __call__(self, x):
    y = x @ self.w[...] + self.b[...]
    self.sow(nnx.Intermediate, 'act', y)
    return y


class Stack(nnx.Module):

  def __init__(self):
    self.blocks = nnx.List([Dense(), Dense()])

  def __call__(self, x):
    for block in self.blocks:
      x = jnp.tanh(block(x))
    self.sow(nnx.Intermediate, 'out', x)
    return x


def dense(x):
  return x @ W + B


def close(actual, expected):
  # float32 computations against float64 references.
  np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-6)


def no_attributes_added(test, module, before):
  for path, node in nnx.iter_graph(module, graph=True):
    if isinstance(node, nnx.Module):
      test.assertEqual(sorted(vars(node)), before[path], path)


def attribute_names(module):
  return {
      path: sorted(vars(node))
      for path, node in nnx.iter_graph(module, graph=True)
      if isinstance(node, nnx.Module)
  }


class FailsTodayTest(parameterized.TestCase):
  """The seven cases from the issue that fail with Flax 0.12.8."""

  def test_1_module_closed_over_by_jax_jit(self):
    model = Stack()
    x = np.array([[1.0, 2.0]], np.float32)
    y, state = jax.jit(lambda x: nnx.capture(model, nnx.Intermediate)(x))(x)
    h0 = np.tanh(dense(x))
    h1 = np.tanh(dense(h0))
    close(state['blocks'][0]['act'][0], dense(x))
    close(state['blocks'][1]['act'][0], dense(h0))
    close(state['out'][0], h1)
    close(y, h1)
    self.assertIsInstance(state['out'][0], jax.Array)
    self.assertNotIsInstance(state['out'][0], jax.core.Tracer)

  def test_2_sow_inside_plain_lax_scan(self):

    class Cell(nnx.Module):

      def __init__(self):
        self.dense = Dense()

      def __call__(self, xs):
        def body(h, x):
          h = jnp.tanh(self.dense(h) + x)
          self.sow(nnx.Intermediate, 'h', h)
          return h, None

        h, _ = jax.lax.scan(body, jnp.zeros(2), xs)
        return h

    xs = np.array([[0.1, 0.2], [0.3, -0.4], [1.0, 0.5]], np.float32)
    h, state = nnx.capture(Cell(), nnx.Intermediate)(xs)
    expected_h, expected_act, hk = [], [], np.zeros(2, np.float32)
    for x in xs:
      expected_act.append(dense(hk))
      hk = np.tanh(dense(hk) + x)
      expected_h.append(hk)
    close(state['h'][0], np.stack(expected_h))
    close(state['dense']['act'][0], np.stack(expected_act))
    close(h, hk)

  def test_3_nnx_scan_broadcast_cell(self):
    cell = Dense()

    @nnx.scan(in_axes=(None, nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def unroll(cell, h, x):
      h = jnp.tanh(cell(h) + x)
      return h, h

    def forward(cell, h0, xs):
      return unroll(cell, h0, xs)

    xs = np.array(
        [[0.5, -0.5], [0.25, 0.0], [0.0, 1.0], [2.0, 1.0]], np.float32
    )
    h0 = np.zeros(2, np.float32)
    (h, hs), state = nnx.capture(forward, nnx.Intermediate)(cell, h0, xs)
    acts, hk = [], h0
    for x in xs:
      acts.append(dense(hk))
      hk = np.tanh(dense(hk) + x)
    self.assertEqual(state['act'][0].shape, (4, 2))
    close(state['act'][0], np.stack(acts))
    close(h, hk)

  def test_4_nnx_vmap_with_broadcast_module(self):
    model = Dense()
    xs = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], np.float32)

    def forward(model, xs):
      return nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(model, xs)

    ys, state = nnx.capture(forward, nnx.Intermediate)(model, xs)
    self.assertEqual(state['act'][0].shape, (3, 2))
    close(state['act'][0], dense(xs))
    close(ys, dense(xs))

  def test_5_hijax_variables(self):

    class Counter(nnx.Module):

      def __init__(self):
        self.count = nnx.BatchStat(jnp.array(0.0))
        self.w = nnx.Param(jnp.asarray(W))

      def __call__(self, x):
        self.count[...] = self.count[...] + 1.0
        y = x @ self.w[...]
        self.sow(nnx.Intermediate, 'y', y)
        return y

    with nnx.var_defaults(hijax=True):
      model = Counter()
    self.assertTrue(model.count.hijax)
    x = np.array([2.0, 1.0], np.float32)
    _, state = nnx.capture(model, nnx.Intermediate)(x)
    close(state['y'][0], x @ W)
    self.assertEqual(float(model.count[...]), 1.0)
    _, state = jax.jit(lambda x: nnx.capture(model, nnx.Intermediate)(x))(x)
    close(state['y'][0], x @ W)
    self.assertEqual(float(model.count[...]), 2.0)
    # Also while Hijax is the default (the result State holds plain
    # Variables, which can be made inside jax.jit).
    with nnx.var_defaults(hijax=True):
      _, state = jax.jit(lambda x: nnx.capture(model, nnx.Intermediate)(x))(x)
    close(state['y'][0], x @ W)
    self.assertEqual(float(model.count[...]), 3.0)

  def test_6_exception_leaves_nothing(self):
    model = Stack()
    before = attribute_names(model)
    graphdef = nnx.graphdef(model)

    def boom(model, x):
      model(x)
      raise KeyError('boom')

    with self.assertRaisesRegex(KeyError, 'boom'):
      nnx.capture(boom, nnx.Intermediate)(model, np.ones((1, 2), np.float32))
    no_attributes_added(self, model, before)
    self.assertEqual(nnx.graphdef(model), graphdef)
    # The next capture is unaffected.
    x = np.ones((1, 2), np.float32)
    _, state = nnx.capture(model, nnx.Intermediate)(x)
    close(state['blocks'][0]['act'][0], dense(x))

  def test_7_nested_capture_same_module(self):

    class Metric(nnx.Intermediate):
      pass

    class Model(nnx.Module):

      def __init__(self):
        self.dense = Dense()

      def __call__(self, x):
        y = self.dense(x)
        self.sow(Metric, 'norm', jnp.sum(y * y))
        return y

    model = Model()
    x = np.array([1.0, -1.0], np.float32)

    def outer(model, x):
      y1 = model(x)  # sown in the outer capture only
      y2, inner = nnx.capture(model, nnx.Intermediate)(2 * x)
      return y1 + y2, inner

    (_, inner), outer_int, outer_metric = nnx.capture(
        outer, nnx.Intermediate, Metric
    )(model, x)
    # The innermost capture that requests a type receives the value.
    close(inner['dense']['act'][0], dense(2 * x))
    self.assertLen(inner['dense']['act'], 1)
    self.assertNotIn('norm', inner)
    self.assertLen(outer_int['dense']['act'], 1)
    close(outer_int['dense']['act'][0], dense(x))
    # Metric is not requested by the inner capture: the outer gets both.
    expected = [np.sum(dense(x) ** 2), np.sum(dense(2 * x) ** 2)]
    close(outer_metric['norm'], expected)


class ShimTest(parameterized.TestCase):

  def test_installed_and_idempotent(self):
    nnx_shims.install()
    nnx_shims.install()
    self.assertTrue(nnx_shims.installed())
    self.assertIs(nnx.capture, nnx_shims.capture)
    nnx_shims.uninstall()
    nnx_shims.uninstall()
    try:
      self.assertFalse(nnx_shims.installed())
      self.assertIsNot(nnx.capture, nnx_shims.capture)
    finally:
      nnx_shims.install()
    self.assertTrue(nnx_shims.installed())

  def test_return_structure_and_exact_types(self):

    class Metric(nnx.Intermediate):
      pass

    class Model(nnx.Module):

      def __init__(self):
        self.dense = Dense()

      def __call__(self, x):
        y = self.dense(x)
        self.sow(Metric, 'm', jnp.sum(y))
        return y

    x = np.array([1.0, 2.0], np.float32)
    model = Model()
    self.assertEqual(
        np.asarray(nnx.capture(model)(x)).tolist(), dense(x).tolist()
    )
    _, inter = nnx.capture(model, nnx.Intermediate)(x)
    self.assertEqual(list(inter), ['dense'])
    self.assertIs(type(inter['dense']['act']), nnx.Intermediate)
    _, metric = nnx.capture(model, Metric)(x)
    self.assertIs(type(metric['m']), Metric)
    close(metric['m'][0], np.sum(dense(x)))
    _, a, b = nnx.capture(model, nnx.Intermediate, Metric)(x)
    self.assertIsInstance(a, nnx.State)
    self.assertIsInstance(b, nnx.State)

  def test_bound_method_function_and_decorator(self):
    model = Stack()
    x = np.array([0.5, 0.5], np.float32)
    expected = dense(x)

    @nnx.capture(nnx.Intermediate)
    def run(model, x):
      return model(x)

    for fn, args in [
        (nnx.capture(model.__call__, nnx.Intermediate), (x,)),
        (nnx.capture(lambda m, x: m(x), nnx.Intermediate), (model, x)),
        (run, (model, x)),
    ]:
      _, state = fn(*args)
      close(state['blocks'][0]['act'][0], expected)

  def test_state_updates_reach_caller(self):

    class Model(nnx.Module):

      def __init__(self):
        self.bn = nnx.BatchNorm(2, momentum=0.5, rngs=nnx.Rngs(0))

      def __call__(self, x):
        y = self.bn(x)
        self.sow(nnx.Intermediate, 'y', y)
        return y

    model = Model()
    graphdef = nnx.graphdef(model)
    x = np.array([[1.0, 2.0], [3.0, 6.0]], np.float32)
    nnx.capture(model, nnx.Intermediate)(x)
    # momentum 0.5: mean = 0.5 * 0 + 0.5 * batch mean.
    close(model.bn.mean[...], [1.0, 2.0])
    self.assertEqual(nnx.graphdef(model), graphdef)

  @parameterized.parameters(True, False)
  def test_inside_nnx_jit(self, graph_mode):
    model = Stack()
    jitted = nnx.jit(
        lambda m, x: m(x), graph=graph_mode, graph_updates=graph_mode
    )
    x = np.array([1.0, 0.0], np.float32)
    _, state = nnx.capture(lambda m, x: jitted(m, x), nnx.Intermediate)(
        model, x
    )
    h0 = np.tanh(dense(x))
    close(state['blocks'][0]['act'][0], dense(x))
    close(state['blocks'][1]['act'][0], dense(h0))

  def test_no_deprecation_warning_inside_capture(self):
    with warnings.catch_warnings():
      warnings.simplefilter('error', DeprecationWarning)
      nnx.capture(Stack(), nnx.Intermediate)(np.ones(2, np.float32))

  def test_legacy_outside_capture(self):
    model = Dense()
    x = np.array([1.0, 1.0], np.float32)
    with self.assertWarns(DeprecationWarning):
      model(x)
    state = nnx.pop(model, nnx.Intermediate)
    close(state['act'][0], dense(x))
    self.assertFalse(hasattr(model, 'act'))

  def test_reduce_fn_init_fn(self):

    class Model(nnx.Module):

      def __call__(self, xs):
        for x in xs:
          self.sow(
              nnx.Intermediate,
              'total',
              x,
              init_fn=lambda: 0,
              reduce_fn=lambda a, b: a + b,
          )
        return xs

    xs = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    _, state = nnx.capture(Model(), nnx.Intermediate)(xs)
    close(state['total'][...], [4.0, 6.0])

  def test_method_outputs(self):

    class Model(nnx.Module):

      def __init__(self):
        self.dense = Dense()

      def features(self, x):
        return jnp.sin(x)

      def __call__(self, x):
        return self.dense(self.features(x))

    x = np.array([0.5, 1.0], np.float32)
    model = Model()
    y, state = nnx.capture(
        model, nnx.Intermediate, method_outputs=nnx.Intermediate
    )(x)
    close(state['features'][0], np.sin(x))
    close(state['__call__'][0], dense(np.sin(x)))
    close(state['dense']['__call__'][0], dense(np.sin(x)))
    self.assertNotIn(
        '_nnx_sow_method_output', getattr(Model.features, '__dict__', {})
    )

  def test_perturb_direct_and_four_step(self):

    class Model(nnx.Module):

      def __init__(self):
        self.dense = Dense()

      def __call__(self, x):
        h = self.perturb('h', self.dense(x))
        return jnp.sum(jnp.tanh(h))

    model = Model()
    x = np.array([1.0, -0.5], np.float32)
    expected = 1.0 - np.tanh(dense(x)) ** 2  # d sum(tanh(h)) / dh

    def loss(model, x):
      return model(x)

    _, grads = nnx.capture(nnx.grad(loss), nnx.Perturbation)(model, x)
    close(grads['h'][...], expected)

    _, zeros = nnx.capture(model, nnx.Perturbation)(x)
    close(zeros['h'][...], np.zeros(2))

    def step(model, perturbations, x):
      def f(model, perturbations, x):
        return nnx.capture(model, nnx.Intermediate, init=perturbations)(x)

      (_, perturb_grads), _ = nnx.grad(f, argnums=(0, 1), has_aux=True)(
          model, perturbations, x
      )
      return perturb_grads

    perturb_grads = step(model, zeros, x)
    close(perturb_grads['h'][...], expected)

  def test_multi_head_attention_sow_weights(self):
    layer = nnx.MultiHeadAttention(
        num_heads=2,
        in_features=4,
        qkv_features=4,
        decode=False,
        rngs=nnx.Rngs(0),
    )
    x = jnp.ones((1, 3, 4))
    _, state = nnx.capture(
        lambda m, x: m(x, sow_weights=True), nnx.Intermediate
    )(layer, x)
    weights = state['attention_weights'][0]
    self.assertEqual(weights.shape, (1, 2, 3, 3))
    close(jnp.sum(weights, -1), np.ones((1, 2, 3)))

  def test_bad_input(self):
    with self.assertRaisesRegex(TypeError, 'nnx.Variable subclass'):
      nnx.capture(Dense(), 'intermediates')
    with self.assertRaisesRegex(TypeError, 'first argument'):
      nnx.capture(lambda x: x, nnx.Intermediate)(np.ones(2))


class RepeatedJitCaptureTest(absltest.TestCase):
  """``nnx.capture`` around an ``nnx.jit`` step, called again and again."""

  def test_every_call_collects(self):
    class Net(nnx.Module):

      def __init__(self, rngs):
        self.lin = nnx.Linear(3, 2, rngs=rngs)

      def __call__(self, x):
        h = self.lin(x)
        self.sow(nnx.Intermediate, 'h', h)
        h = self.perturb('p', h)
        return h.sum()

    model = Net(nnx.Rngs(0))
    fwd = nnx.jit(lambda m, x: m(x))
    kernel, bias = model.lin.kernel[...], model.lin.bias[...]
    for i in range(3):  # the jit is traced on the first call only
      x = jnp.ones((2, 3)) * (i + 1)
      _, inter = nnx.capture(fwd, nnx.Intermediate)(model, x)
      self.assertEqual(list(inter.keys()), ['h'])
      np.testing.assert_allclose(
          inter['h'].get_value()[0], np.asarray(x) @ kernel + bias, rtol=1e-6
      )
      grads, perturbations = nnx.capture(
          nnx.jit(nnx.grad(lambda m, x: m(x))), nnx.Perturbation
      )(model, x)
      del grads
      self.assertEqual(list(perturbations.keys()), ['p'])
      np.testing.assert_allclose(
          perturbations['p'].get_value(), np.ones((2, 2))
      )


class GrowingReductionTest(absltest.TestCase):

  def test_flax_style_growing_reduce_fn(self):
    # Flax reduces sown values with any reduce_fn, also one whose
    # accumulator grows; the shim keeps that meaning.
    class Appends(nnx.Module):

      def __call__(self, x):
        kw = dict(reduce_fn=lambda c, v: (*c, v), init_fn=lambda: ())
        self.sow(nnx.Intermediate, 'a', x, **kw)
        self.sow(nnx.Intermediate, 'a', 2.0 * x, **kw)
        return x

    x = np.array([1.0, -1.0], np.float32)
    _, state = nnx.capture(Appends(), nnx.Intermediate)(x)
    value = state['a'].get_value()
    self.assertLen(value, 2)
    close(value[0], x)
    close(value[1], 2.0 * x)


def flax_original(fn):
  """``fn()`` with Flax 0.12.8's own ``Module.sow``/``perturb``/``capture``."""
  nnx_shims.uninstall()
  try:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', DeprecationWarning)
      return fn()
  finally:
    nnx_shims.install()


ZEROS, ONES = np.zeros(2, np.float32), np.ones(2, np.float32)


class Switch(nnx.Module):
  """Sows zeros then ones as 'h': reduced (keep the last) when ``flag``."""

  def __init__(self, init):
    self.flag = False
    self.init = init

  def __call__(self, x):
    for v in (0.0 * x, x):
      if self.flag:
        self.sow(
            nnx.Intermediate,
            'h',
            v,
            reduce_fn=lambda p, c: c,
            init_fn=self.init,
        )
      else:
        self.sow(nnx.Intermediate, 'h', v)
    return x


class NoLeakAcrossCallsTest(parameterized.TestCase):
  """What one capture saw never changes what a later capture returns."""

  @parameterized.product(
      init=['array', 'tuple', 'dict'], transform=['plain', 'nnx_jit', 'jit']
  )
  def test_alternating_reduction(self, init, transform):
    init_fn = {
        'array': lambda: jnp.zeros(2),
        'tuple': lambda: (),
        'dict': lambda: {},
    }[init]
    model = Switch(init_fn)
    if transform == 'plain':
      run = nnx.capture(model, nnx.Intermediate)
    elif transform == 'nnx_jit':
      run = functools.partial(
          nnx.capture(nnx.jit(lambda m, x: m(x)), nnx.Intermediate), model
      )
    else:
      run = lambda x: jax.jit(
          lambda x: nnx.capture(model, nnx.Intermediate)(x)
      )(x)
    for flag in (True, False, True, False, False, True):
      model.flag = flag
      _, state = run(jnp.ones(2))
      value = state['h'].get_value()
      if flag:  # reduce_fn keeps the last value
        close(value, ONES)
      else:  # Flax's default: a tuple of both values, in call order
        self.assertIsInstance(value, tuple)
        self.assertLen(value, 2)
        close(value[0], ZEROS)
        close(value[1], ONES)

  def test_same_as_flax(self):
    model = Switch(lambda: ())
    got, want = [], []
    for flag in (True, False):
      model.flag = flag
      got.append(nnx.capture(model, nnx.Intermediate)(jnp.ones(2))[1])
      want.append(
          flax_original(
              lambda: nnx.capture(model, nnx.Intermediate)(jnp.ones(2))[1]
          )
      )
    for g, w in zip(got, want):
      close(jax.tree.leaves(g), jax.tree.leaves(w))
      self.assertEqual(
          jax.tree.structure(g['h'].get_value()),
          jax.tree.structure(w['h'].get_value()),
      )


class Maximum(nnx.Module):

  def __call__(self, xs):
    for v in xs:
      self.sow(
          nnx.Intermediate,
          'h',
          v,
          init_fn=lambda: jnp.zeros(()),
          reduce_fn=jnp.maximum,
      )
    return xs


XS = np.array([[1.0, 5.0], [4.0, 2.0]], np.float32)


class TypeChangingReductionTest(parameterized.TestCase):
  """Outside loops a Module.sow fold may change the accumulator's type."""

  @parameterized.parameters('plain', 'nnx_jit', 'jit')
  def test_python_loop(self, transform):
    model = Maximum()
    if transform == 'plain':
      _, state = nnx.capture(model, nnx.Intermediate)(XS)
    elif transform == 'nnx_jit':
      _, state = nnx.capture(nnx.jit(lambda m, x: m(x)), nnx.Intermediate)(
          model, XS
      )
    else:
      _, state = jax.jit(lambda x: nnx.capture(model, nnx.Intermediate)(x))(XS)
    close(state['h'].get_value(), [4.0, 5.0])  # max(0, 1, 4), max(0, 5, 2)

  def test_same_as_flax(self):
    want = flax_original(lambda: nnx.capture(Maximum(), nnx.Intermediate)(XS))
    _, state = nnx.capture(Maximum(), nnx.Intermediate)(XS)
    close(state['h'].get_value(), want[1]['h'].get_value())

  def test_growing_tuple_under_nnx_jit(self):
    class Appends(nnx.Module):

      def __call__(self, x):
        kw = dict(reduce_fn=lambda c, v: (*c, v), init_fn=lambda: ())
        self.sow(nnx.Intermediate, 'a', x, **kw)
        self.sow(nnx.Intermediate, 'a', 2.0 * x, **kw)
        return x

    x = np.array([1.0, -1.0], np.float32)
    fwd = nnx.capture(nnx.jit(lambda m, x: m(x)), nnx.Intermediate)
    for _ in range(2):  # the second call hits nnx.jit's cache
      _, state = fwd(Appends(), x)
      value = state['a'].get_value()
      self.assertLen(value, 2)
      close(value[0], x)
      close(value[1], 2.0 * x)

  @parameterized.parameters('lax_scan', 'nnx_scan')
  def test_carried_by_a_loop_raises(self, loop):
    class Scanned(nnx.Module):

      def __call__(self, xs):
        def body(c, x):
          self.sow(
              nnx.Intermediate,
              'h',
              x,
              init_fn=lambda: jnp.zeros(()),
              reduce_fn=jnp.maximum,
          )
          return c, None

        if loop == 'lax_scan':
          return jax.lax.scan(body, 0.0, xs)[0]
        return nnx.scan(
            lambda m, c, x: body(c, x), in_axes=(None, nnx.Carry, 0)
        )(self, 0.0, xs)[0]

    with self.assertRaisesRegex(
        ValueError,
        r"sow \('h',\).*float32\[\]\] to .*float32\[2\].*Module.sow lets",
    ):
      nnx.capture(Scanned(), nnx.Intermediate)(XS)

  def test_functional_sow_keeps_the_fixed_type_rule(self):
    def f(xs):
      for v in xs:
        sow(v, name='h', init_fn=lambda: jnp.zeros(()), reduce_fn=jnp.maximum)
      return xs

    with self.assertRaisesRegex(
        ValueError, r"sow 'h'.*changed the accumulator"
    ):
      capture(f)(XS)


class PerturbSameNameTest(parameterized.TestCase):
  """``sow(Intermediate, 'h')`` and ``perturb('h')``: two types, two States."""

  class Model(nnx.Module):

    def __init__(self):
      self.w = nnx.Param(jnp.asarray([1.0, 2.0]))

    def __call__(self, x):
      h = x * self.w[...]
      self.sow(nnx.Intermediate, 'h', h)
      h = self.perturb('h', h)
      return jnp.sum(3.0 * h**2)

  X = np.array([0.5, -1.0], np.float32)

  def four_steps(self, model, jit):
    _, perturbations = nnx.capture(model, nnx.Perturbation)(self.X)

    def train_step(model, perturbations, x):
      def loss(model, perturbations, x):
        return nnx.capture(model, nnx.Intermediate, init=perturbations)(x)

      (_, perturb_grads), sown = nnx.grad(loss, argnums=(0, 1), has_aux=True)(
          model, perturbations, x
      )
      return perturbations, perturb_grads, sown

    if jit:
      train_step = nnx.jit(train_step)
    return train_step(model, perturbations, self.X)

  @parameterized.parameters(False, True)
  def test_four_steps(self, jit):
    model = self.Model()
    zeros, grads, sown = self.four_steps(model, jit)
    h = self.X * np.array([1.0, 2.0])
    close(zeros['h'].get_value(), np.zeros(2))
    close(grads['h'].get_value(), 6.0 * h)  # d sum(3 h^2) / dh
    self.assertLen(sown['h'].get_value(), 1)
    close(sown['h'].get_value()[0], h)
    want = flax_original(lambda: self.four_steps(self.Model(), jit))
    for got_state, want_state in zip((zeros, grads, sown), want):
      close(jax.tree.leaves(got_state), jax.tree.leaves(want_state))

  def test_direct(self):
    model = self.Model()
    h = self.X * np.array([1.0, 2.0])
    _, grads = nnx.capture(nnx.grad(lambda m, x: m(x)), nnx.Perturbation)(
        model, self.X
    )
    close(grads['h'].get_value(), 6.0 * h)
    _, grads, sown = nnx.capture(
        nnx.grad(lambda m, x: m(x)), nnx.Perturbation, nnx.Intermediate
    )(model, self.X)
    close(grads['h'].get_value(), 6.0 * h)
    close(sown['h'].get_value()[0], h)


class LegacyWarningTest(parameterized.TestCase):
  """Outside any capture: Flax's DeprecationWarning, so filters match."""

  class Both(nnx.Module):

    def __call__(self, x):
      self.sow(nnx.Intermediate, 'h', x)
      return self.perturb('q', x)

  def warnings_seen(self, message):
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter('error', DeprecationWarning)  # -W error::...
      warnings.filterwarnings(
          'ignore', message=message, category=DeprecationWarning
      )
      try:
        self.Both()(jnp.ones(2))
      except DeprecationWarning as e:
        return str(e).lstrip()[:32]
    return [str(w.message) for w in seen]

  @parameterized.parameters(
      re.escape("Using 'Module.sow()' outside of 'nnx.capture()'"),
      "Using 'Module.sow()' outside of 'nnx.capture()'",
      r"\s*Using 'Module.perturb\(\)' outside of 'nnx.capture\(\)'",
      r"\s*Using 'Module\.(sow|perturb)\(\)' outside of 'nnx.capture\(\)'",
  )
  def test_filters_match_as_for_flax(self, message):
    self.assertEqual(
        self.warnings_seen(message),
        flax_original(lambda: self.warnings_seen(message)),
    )

  def test_messages_begin_as_flax(self):
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter('always')
      self.Both()(jnp.ones(2))
    messages = [str(w.message) for w in seen]
    self.assertLen(messages, 2)
    self.assertTrue(
        messages[0].startswith(
            "Using 'Module.sow()' outside of 'nnx.capture()' is deprecated"
        )
    )
    self.assertTrue(
        messages[1].startswith(
            "\n      Using 'Module.perturb()' outside of 'nnx.capture()' is"
            ' deprecated'
        )
    )
    # Ignoring by Flax's text silences the shim's warnings.
    with warnings.catch_warnings():
      warnings.simplefilter('error', DeprecationWarning)
      warnings.filterwarnings(
          'ignore', message=r"\s*Using 'Module\.(sow|perturb)\(\)' outside"
      )
      self.Both()(jnp.ones(2))


class StateArgumentTest(parameterized.TestCase):
  """``intervene`` (which stages ``f``) on a function whose only graph leaves
  are the Variables of an ``nnx.State`` argument (``f(state, x)`` with
  ``nnx.merge`` inside): the Variables are rebuilt under the staging and what
  ``f`` writes to them reaches the caller's Variables, as without it."""

  @parameterized.named_parameters(('eager', False), ('jit', True))
  def test_updates_reach_the_callers_variables(self, jitted):
    class Net(nnx.Module):

      def __init__(self):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(2, momentum=0.5, rngs=nnx.Rngs(0))

    graphdef, state = nnx.split(Net())
    _, twin = nnx.split(Net())
    kernel = np.asarray(state['lin']['kernel'][...])
    x = np.arange(12.0, dtype=np.float32).reshape(4, 3)

    def f(state, x):
      net = nnx.merge(graphdef, state)
      return net.bn(sow(net.lin(x), name='pre'))

    def with_intervene(state, x):
      y = intervene(f, {'pre': lambda v: 2.0 * v})(state, x)
      return y, state['bn']['mean'][...]

    def by_hand(state, x):  # the replacement written into the program
      net = nnx.merge(graphdef, state)
      return net.bn(2.0 * net.lin(x)), state['bn']['mean'][...]

    run = jax.jit if jitted else (lambda fn: fn)
    y, mean = run(with_intervene)(state, x)
    expected_y, expected_mean = run(by_hand)(twin, x)
    np.testing.assert_allclose(y, expected_y, rtol=1e-6)
    # momentum 0.5 from zeros: half the batch mean of the replacement.
    np.testing.assert_allclose(
        mean, 0.5 * np.mean(2.0 * x @ kernel, axis=0), rtol=1e-5
    )
    np.testing.assert_allclose(mean, expected_mean, rtol=1e-6)
    if not jitted:  # the caller's Variables, as f(state, x) leaves them
      np.testing.assert_allclose(state['bn']['mean'][...], expected_mean)
      np.testing.assert_allclose(twin['bn']['mean'][...], expected_mean)


class StateConversionTest(absltest.TestCase):

  def test_round_trip(self):
    collected = {('blocks', 0, 'act'): (1.0,), 'head': (2.0,)}
    state = state_lib.collected_to_state(collected)
    self.assertIs(type(state['blocks'][0]['act']), nnx.Intermediate)
    self.assertEqual(state['head'].get_value(), (2.0,))
    self.assertEqual(state_lib.state_to_collected(state), collected)

  def test_conflicting_names(self):
    with self.assertRaisesRegex(ValueError, 'sown name'):
      state_lib.collected_to_state({'a': 1.0, ('a', 'b'): 2.0})
    with self.assertRaisesRegex(TypeError, 'str or a non-empty tuple'):
      state_lib.collected_to_state({3.5: 1.0})

  def test_variable_type_not_a_variable(self):
    for bad in (int, 3):
      with self.assertRaises(TypeError) as cm:
        state_lib.collected_to_state({'a': (1.0,)}, variable_type=bad)
      self.assertEqual(
          str(cm.exception),
          "collected_to_state: variable_type (used to wrap 'a') must be a"
          ' subclass of nnx.Variable (e.g. nnx.Intermediate) or a function'
          f' name -> Variable subclass, got {bad!r}.',
      )

  def test_flatten_names_bad_arguments(self):
    with self.assertRaises(TypeError) as cm:
      state_lib.flatten_names([1, 2])
    self.assertEqual(
        str(cm.exception),
        'flatten_names: collected must be the dict a capture returns (name'
        ' -> value), got a list.',
    )
    with self.assertRaisesRegex(TypeError, 'flatten_names: sep must be a str'):
      state_lib.flatten_names({'a': 1.0}, sep=0)

  def test_flatten_names_keeps_the_cotangent_mark(self):
    def loss(x):
      h = flax.nnx.sow.sow(jnp.sin(x), name=('block', 0, 'h'))
      h = flax.nnx.sow.perturb(h, name=('block', 0, 'dh'))
      return jnp.sum(h**2)

    x = jnp.asarray([0.5, -1.0])
    _, collected = flax.nnx.sow.capture(jax.grad(loss))(x)
    flat = state_lib.flatten_names(collected)
    self.assertEqual(list(flat), ['block/0/h', 'block/0/dh'])
    self.assertEqual(flat.cotangents, frozenset({'block/0/dh'}))
    close(flat['block/0/dh'][0], 2 * np.sin(np.asarray(x)))


if __name__ == '__main__':
  absltest.main()
