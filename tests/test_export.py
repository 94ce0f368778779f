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

"""A capture exported with ``jax.export``, serialized and called back.

``Exported.serialize`` writes the in and out trees of the exported function,
so the ``Collected`` a capture returns must be registered for serialization
(with its key order and its ``cotangents`` mark). Each test exports
``jax.jit(capture(f))``, serializes it to bytes, deserializes the bytes and
calls the result; expected values are written out by hand with ``numpy``.
An intervened or captured function that leaves sows in place (names it does
not replace or collect) serializes too, in every construct.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import Collected
from flax.nnx.sow import capture
from flax.nnx.sow import collected_to_state
from flax.nnx.sow import intervene
from flax.nnx.sow import perturb
from flax.nnx.sow import sow

X = np.array([0.5, -1.0, 2.0], np.float32)
W = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
B = np.array([0.25, -1.0], np.float32)


def round_trip(fn, *args):
  """``fn`` exported for ``args``, serialized to bytes and read back."""
  exported = jax.export.export(jax.jit(fn))(*args)
  data = exported.serialize()
  assert isinstance(data, (bytes, bytearray)), type(data)
  return jax.export.deserialize(data)


def close(actual, expected):
  np.testing.assert_allclose(
      np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-6
  )


class PlainExportTest(absltest.TestCase):

  def test_plain_loop_and_reduced_names(self):
    def f(x):
      h = sow(jnp.sin(x), name='h')

      def body(carry, xi):
        y = sow(carry * xi, name=('loop', 0, 'y'))
        sow(xi, name='total', reduce_fn=lambda a, v: a + v, init_fn=lambda: 0.0)
        return carry + 1.0, y

      _, ys = jax.lax.scan(body, 1.0, x)
      return jnp.sum(h) + jnp.sum(ys)

    exported = round_trip(capture(f), X)
    for call in (exported.call, jax.jit(exported.call)):
      out, collected = call(X)
      self.assertIsInstance(collected, Collected)
      # Keys come back in order of first sow, tuple names as tuples.
      self.assertEqual(list(collected), ['h', ('loop', 0, 'y'), 'total'])
      self.assertEqual(collected.cotangents, frozenset())
      ys = np.array([1.0, 2.0, 3.0], np.float32) * X  # carry 1, 2, 3
      close(out, np.sum(np.sin(X)) + np.sum(ys))
      self.assertLen(collected['h'], 1)
      close(collected['h'][0], np.sin(X))
      self.assertLen(collected[('loop', 0, 'y')], 1)
      close(collected[('loop', 0, 'y')][0], ys)  # stacked per iteration
      close(collected['total'], np.sum(X))  # an accumulator, not a tuple

  def test_call_inside_jit_closing_over_a_tracer(self):
    def f(x):
      return jnp.sum(sow(x * x, name='sq'))

    exported = round_trip(capture(f), X)

    @jax.jit
    def outer(scale):
      return exported.call(scale * jnp.asarray(X))

    out, collected = outer(2.0)
    close(out, np.sum((2 * X) ** 2))
    self.assertEqual(list(collected), ['sq'])
    close(collected['sq'][0], (2 * X) ** 2)

  def test_cotangent_mark_survives(self):
    def loss(x):
      h = sow(jnp.sin(x), name='h')
      h = perturb(h, name='dh')
      return jnp.sum(h**2)

    exported = round_trip(capture(jax.value_and_grad(loss)), X)
    (value, grad), collected = exported.call(X)
    close(value, np.sum(np.sin(X) ** 2))
    close(grad, 2 * np.sin(X) * np.cos(X))
    self.assertEqual(list(collected), ['h', 'dh'])
    close(collected['h'][0], np.sin(X))
    close(collected['dh'][0], 2 * np.sin(X))  # dloss/dh
    self.assertEqual(collected.cotangents, frozenset({'dh'}))
    # The mark still keeps intervene from patching a gradient in.
    with self.assertRaisesRegex(ValueError, "values\\['dh'\\] holds the"):
      intervene(loss, collected)(X)

  def test_unserializable_key_names_the_key(self):
    def f(x):
      return x, Collected({1.5: (x,)})

    exported = jax.export.export(jax.jit(f))(X)
    with self.assertRaisesRegex(TypeError, 'the key 1.5 of type float'):
      exported.serialize()


@jax.custom_jvp
def _sin_sowing(x):
  return jnp.sin(sow(x, name='other'))


@_sin_sowing.defjvp
def _sin_sowing_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return _sin_sowing(x), jnp.cos(x) * t


def _scan(y):
  step = lambda c, yi: (c + sow(yi * c, name='other'), None)
  return jax.lax.scan(step, jnp.float32(1.0), y)[0]


def _scan_by_hand(y):
  c = np.float32(1.0)
  for yi in y:
    c = c + yi * c
  return c


def _while(y):
  body = lambda s: (s[0] + 1, s[1] * sow(jnp.float32(2.0), name='other'))
  return jax.lax.while_loop(lambda s: s[0] < 3, body, (0, y))[1]


def _cond(y):
  return jax.lax.cond(
      y.sum() > 0.0,
      lambda v: sow(v * 2.0, name='other'),
      lambda v: sow(v * 3.0, name='other'),
      y,
  )


# construct -> (g's tail after the replaced sow 'c', the same tail in NumPy)
_LEFT_IN_PLACE = {
    'scan': (_scan, _scan_by_hand),
    'while': (_while, lambda y: y * 8.0),
    'cond': (_cond, lambda y: y * (2.0 if y.sum() > 0 else 3.0)),
    'jit': (
        jax.jit(lambda y: sow(y * 2.0, name='other') + 1.0),
        lambda y: y * 2.0 + 1.0,
    ),
    'checkpoint': (
        jax.checkpoint(lambda y: jnp.sin(sow(y * 2.0, name='other'))),
        lambda y: np.sin(y * 2.0),
    ),
    'custom_jvp': (_sin_sowing, np.sin),
}


class SowsLeftInPlaceExportTest(parameterized.TestCase):
  """An intervened or captured function still holds the sows it does not
  replace or collect; it serializes with them (they carry ``Sow``, an
  effect ``jax.export`` can write and read back)."""

  @parameterized.named_parameters((c, c) for c in _LEFT_IN_PLACE)
  def test_intervene_leaves_a_sow(self, construct):
    tail, by_hand = _LEFT_IN_PLACE[construct]
    g = lambda x: tail(sow(x * 2.0, name='c'))
    for values in ({'c': lambda v: v + 1.0}, {'c': (X * 2.0 + 1.0,)}):
      exported = round_trip(intervene(g, values), X)
      for call in (exported.call, jax.jit(exported.call)):
        close(call(X), by_hand(X * 2.0 + 1.0))

  @parameterized.named_parameters((c, c) for c in _LEFT_IN_PLACE)
  def test_capture_leaves_a_sow(self, construct):
    tail, by_hand = _LEFT_IN_PLACE[construct]
    g = lambda x: tail(sow(x * 2.0, name='c'))
    exported = round_trip(capture(g, names=['c']), X)
    out, collected = exported.call(X)
    close(out, by_hand(X * 2.0))
    self.assertEqual(list(collected), ['c'])
    close(collected['c'][0], X * 2.0)

  def test_intervene_inside_a_capture(self):
    # The capture collects 'other' around an intervene that leaves it, and
    # the replacement at 'c'.
    g = lambda x: _scan(sow(x * 2.0, name='c'))
    fn = capture(intervene(g, {'c': lambda v: v + 1.0}))
    exported = round_trip(fn, X)
    out, collected = exported.call(X)
    y = X * 2.0 + 1.0
    close(out, _scan_by_hand(y))
    carries = np.cumprod(np.concatenate([[1.0], 1.0 + y[:-1]]))
    self.assertEqual(list(collected), ['c', 'other'])
    close(collected['c'][0], y)
    close(collected['other'][0], y * carries)


class Dense(nnx.Module):
  """``tanh(x @ W + B)``; sows its output as 'act'."""

  def __init__(self):
    self.w = nnx.Param(jnp.asarray(W))
    self.b = nnx.Param(jnp.asarray(B))

  def __call__(self, x):
    y = jnp.tanh(x @ self.w[...] + self.b[...])
    self.sow(nnx.Intermediate, 'act', y)
    return y


class Stack(nnx.Module):

  def __init__(self):
    # Attributes, not an nnx.List: jax.export serializes only dicts with str
    # keys, and nnx.to_pure_dict keys a List's entries by int.
    self.first = Dense()
    self.second = Dense()

  def __call__(self, x):
    return self.second(self.first(x))


class NNXStateExportTest(absltest.TestCase):
  """The model's state as the exported function's input.

  Flax's ``State`` and ``Variable`` types are not registered for
  serialization by Flax, so the state crosses the export as the pure dict of
  arrays ``nnx.to_pure_dict`` gives, as a checkpoint stores it.
  """

  def test_state_as_input(self):
    model = Stack()
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)

    def forward(params, x):
      state_copy = jax.tree.map(lambda v: v, state)
      nnx.replace_by_pure_dict(state_copy, params)
      return nnx.merge(graphdef, state_copy)(x)

    x = X[:2]
    exported = round_trip(capture(forward), params, x)
    # New weights through the same exported program: it reads its input.
    params2 = jax.tree.map(lambda p: 2 * p, params)
    out, collected = exported.call(params2, x)

    act0 = np.tanh(x @ (2 * W) + 2 * B)
    act1 = np.tanh(act0 @ (2 * W) + 2 * B)
    close(out, act1)
    self.assertIsInstance(collected, Collected)
    self.assertEqual(list(collected), [('first', 'act'), ('second', 'act')])
    close(collected[('first', 'act')][0], act0)
    close(collected[('second', 'act')][0], act1)
    # And as the State nnx.capture would give.
    view = collected_to_state(collected)
    close(view['second']['act'][0], act1)


if __name__ == '__main__':
  absltest.main()
