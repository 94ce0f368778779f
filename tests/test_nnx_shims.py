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

import warnings

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import flax.nnx.sow  # noqa: F401  (installs the shims)
from flax.nnx.sow import nnx_shims
from flax.nnx.sow import state as state_lib

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
