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

"""Module hook points behind a plain JAX transform given the model.

``jax.jit``, ``jax.vmap`` and ``jax.grad`` flatten a Module passed to them
as a pytree and call a copy. ``module_outputs`` names the copy's calls by
the original's path, so every program here collects (and ``intervene``
replaces) exactly what it does without the transform. Expected values are
computed by hand from the modules' kernels and biases.
"""

from absl.testing import absltest
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import module_outputs


def _linear(m, x):
  return x @ m.kernel.get_value() + m.bias.get_value()


def _call(m, x):
  return m(x)


def _close(test, got, want):
  test.assertEqual(list(got), list(want))
  for name, entries in want.items():
    test.assertLen(got[name], len(entries), name)
    for a, b in zip(got[name], entries):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


class Mlp(nnx.Module):

  def __init__(self, rngs):
    self.l1 = nnx.Linear(3, 3, rngs=rngs)
    self.l2 = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


class Act(nnx.Module):
  """A module that sets no attribute of its own."""

  def __call__(self, x):
    return jax.nn.relu(x)


class OneLinearTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    self.x = jnp.array([[1.0, -2.0], [0.5, 3.0]])
    self.want = {('__call__',): (_linear(self.m, self.x),)}

  def collect(self, f, *args):
    return capture(module_outputs(f, nnx.Linear))(*args)[1]

  def test_without_a_transform(self):
    _close(self, self.collect(_call, self.m, self.x), self.want)

  def test_jit_inside_module_outputs(self):
    out, got = capture(module_outputs(jax.jit(_call), nnx.Linear))(
        self.m, self.x
    )
    _close(self, got, self.want)
    np.testing.assert_allclose(out, self.want[('__call__',)][0], rtol=1e-6)

  def test_jit_around_module_outputs(self):
    f = jax.jit(module_outputs(_call, nnx.Linear))
    _close(self, capture(f)(self.m, self.x)[1], self.want)

  def test_closure_and_static_argnums(self):
    closed = lambda m, x: jax.jit(lambda x: m(x))(x)
    _close(self, self.collect(closed, self.m, self.x), self.want)
    static = jax.jit(_call, static_argnums=0)
    _close(self, self.collect(static, self.m, self.x), self.want)

  def test_nested_jit(self):
    inner = jax.jit(_call)
    outer = jax.jit(lambda m, x: inner(m, x))
    _close(self, self.collect(outer, self.m, self.x), self.want)

  def test_vmap(self):
    f = jax.vmap(_call, in_axes=(None, 0))
    _close(self, self.collect(f, self.m, self.x), self.want)
    # Without the vmap around it, the closure version gives the same.
    g = lambda m, x: jax.vmap(lambda r: m(r))(x)
    _close(self, self.collect(g, self.m, self.x), self.want)

  def test_grad_inside(self):
    f = jax.grad(lambda m, x: jnp.sum(m(x)))  # differentiates the copy
    _close(self, self.collect(f, self.m, self.x), self.want)

  def test_grad_around_the_capture(self):
    f = module_outputs(jax.jit(_call), nnx.Linear)

    def total(x):
      return capture(f)(self.m, x)[1][('__call__',)][0].sum()

    kernel = self.m.kernel.get_value()
    np.testing.assert_allclose(
        jax.grad(total)(self.x),
        jnp.ones((2, 3)) @ kernel.T,
        rtol=1e-6,
    )

  def test_cotangent_of_the_output(self):
    loss = lambda m, x: jnp.sum(m(x) ** 2)
    f = jax.grad(module_outputs(jax.jit(loss), nnx.Linear, grad=True))
    _, got = capture(f)(self.m, self.x)
    y = _linear(self.m, self.x)
    _close(self, got, {('__call__',): (y,), ('grad', '__call__'): (2 * y,)})

  def test_intervene_replaces_the_output(self):
    for wrap in (lambda f: f, jax.jit):
      f = module_outputs(wrap(lambda m, x: jnp.tanh(m(x)) + 1.0), nnx.Linear)
      zeroed = intervene(f, {('__call__',): (jnp.zeros((2, 3)),)})
      np.testing.assert_allclose(zeroed(self.m, self.x), jnp.ones((2, 3)))
    # jax.jit around the intervened function too.
    f = module_outputs(jax.jit(lambda m, x: m(x) * 2.0), nnx.Linear)
    doubled = jax.jit(intervene(f, {('__call__',): lambda v: v + 1.0}))
    np.testing.assert_allclose(
        doubled(self.m, self.x),
        2.0 * (self.want[('__call__',)][0] + 1.0),
        rtol=1e-6,
    )

  def test_repeated_calls_of_one_capture(self):
    f = capture(module_outputs(jax.jit(_call), nnx.Linear))
    for _ in range(3):
      _close(self, f(self.m, self.x)[1], self.want)


class TwoLayersTest(absltest.TestCase):
  """Per-module paths exactly as without the transform."""

  def setUp(self):
    super().setUp()
    self.mlp = Mlp(nnx.Rngs(1))
    self.x = jnp.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]])
    h = _linear(self.mlp.l1, self.x)
    self.h, self.y = h, _linear(self.mlp.l2, jax.nn.relu(h))

  def test_custom_module(self):
    want = {('l1', '__call__'): (self.h,), ('l2', '__call__'): (self.y,)}
    for f in (
        _call,
        jax.jit(_call),
        jax.jit(lambda m, x: m.l2(jax.nn.relu(m.l1(x)))),  # m is not called
        jax.vmap(_call, in_axes=(None, 0)),
    ):
      _, got = capture(module_outputs(f, nnx.Linear))(self.mlp, self.x)
      _close(self, got, want)
    _, got = capture(module_outputs(jax.jit(_call)))(self.mlp, self.x)
    want[('__call__',)] = (self.y,)
    _close(self, got, want)

  def test_sequential(self):
    seq = nnx.Sequential(self.mlp.l1, Act(), self.mlp.l2, Act())
    want = {
        ('layers', 0, '__call__'): (self.h,),
        ('layers', 1, '__call__'): (jax.nn.relu(self.h),),
        ('layers', 2, '__call__'): (self.y,),
        ('layers', 3, '__call__'): (jax.nn.relu(self.y),),
        ('__call__',): (jax.nn.relu(self.y),),
    }
    for f in (_call, jax.jit(_call), jax.jit(jax.jit(_call))):
      _, got = capture(module_outputs(f))(seq, self.x)
      _close(self, got, want)

  def test_module_with_no_attribute_of_its_own(self):
    model = nnx.Sequential(Act(), Act())
    x = jnp.array([-1.0, 2.0])
    apply_one = jax.jit(_call)
    f = module_outputs(lambda m, x: apply_one(m.layers[1], x) - 1.0, Act)
    out, got = capture(f)(model, x)
    _close(self, got, {('layers', 1, '__call__'): (jnp.array([0.0, 2.0]),)})
    np.testing.assert_allclose(out, [-1.0, 1.0])
    # A module made inside the call is no hook point, as without the jit.
    g = module_outputs(lambda m, x: apply_one(Act(), m(x)), Act)
    _, got = capture(g)(model, x)
    self.assertEqual(
        list(got), [('layers', 0, '__call__'), ('layers', 1, '__call__')]
    )

  def test_one_jitted_function_for_both_layers(self):
    # The second call may hit the jit cache of the first (equal pytree
    # structures): the names must still be each layer's.
    layer = jax.jit(_call)
    forward = lambda m, x: layer(m.l2, jax.nn.relu(layer(m.l1, x)))
    want = {('l1', '__call__'): (self.h,), ('l2', '__call__'): (self.y,)}
    f = capture(module_outputs(forward, nnx.Linear))
    for _ in range(2):
      _close(self, f(self.mlp, self.x)[1], want)
    l2_first = lambda m, x: layer(m.l1, layer(m.l2, x))
    h2 = _linear(self.mlp.l2, self.x)
    _, got = capture(module_outputs(l2_first, nnx.Linear))(self.mlp, self.x)
    _close(
        self,
        got,
        {
            ('l2', '__call__'): (h2,),
            ('l1', '__call__'): (_linear(self.mlp.l1, h2),),
        },
    )

  def test_intervene_ablates_the_hidden_layer(self):
    f = module_outputs(jax.jit(_call), nnx.Linear)
    ablated = intervene(f, {('l1', '__call__'): lambda h: jnp.zeros_like(h)})
    np.testing.assert_allclose(
        ablated(self.mlp, self.x),
        jnp.broadcast_to(self.mlp.l2.bias.get_value(), (2, 3)),
        rtol=1e-6,
    )


class NnxTransformInsideTest(absltest.TestCase):
  """A plain JAX transform given the model, with an NNX transform (or a
  split and merge) inside it: the NNX copy of the JAX copy keeps the path."""

  def setUp(self):
    super().setUp()
    self.mlp = Mlp(nnx.Rngs(2))
    self.x = jnp.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]])
    h = _linear(self.mlp.l1, self.x)
    self.want = {
        ('l1', '__call__'): (h,),
        ('l2', '__call__'): (_linear(self.mlp.l2, jax.nn.relu(h)),),
    }

  def test_nnx_inside_jax(self):
    nnx_jit = nnx.jit(_call)
    for f in (
        jax.jit(lambda m, x: nnx_jit(m, x)),
        jax.jit(lambda m, x: nnx.merge(*nnx.split(m))(x)),
        jax.jit(lambda m, x: nnx.vmap(_call, in_axes=(None, 0))(m, x)),
        jax.checkpoint(lambda m, x: nnx_jit(m, x)),
    ):
      _, got = capture(module_outputs(f, nnx.Linear))(self.mlp, self.x)
      _close(self, got, self.want)
    # Around module_outputs, and a vmap that broadcasts the model.
    f = jax.jit(module_outputs(nnx_jit, nnx.Linear))
    _close(self, capture(f)(self.mlp, self.x)[1], self.want)
    f = jax.vmap(lambda m, r: nnx_jit(m, r), in_axes=(None, 0))
    _, got = capture(module_outputs(f, nnx.Linear))(self.mlp, self.x)
    _close(self, got, self.want)

  def test_intervene_through_both(self):
    f = jax.jit(lambda m, x: nnx.jit(_call)(m, x))
    ablated = intervene(
        module_outputs(f, nnx.Linear),
        {('l1', '__call__'): lambda h: jnp.zeros_like(h)},
    )
    np.testing.assert_allclose(
        ablated(self.mlp, self.x),
        jnp.broadcast_to(self.mlp.l2.bias.get_value(), (2, 3)),
        rtol=1e-6,
    )


class CannotTellTest(absltest.TestCase):
  """A copy that could be of modules at several paths raises."""

  def test_a_table_shared_by_the_class(self):
    # Flax 0.12.8 gives every module it constructs a table of its own; a
    # module that had its class's would look like any other of its class.
    model = nnx.Sequential(Act(), Act())
    for act in model.layers:
      object.__setattr__(act, '_pytree__nodes', Act._pytree__nodes)
    x = jnp.array([-1.0, 2.0])
    apply_one = jax.jit(_call)
    f = module_outputs(lambda m, x: apply_one(m.layers[1], x), Act)
    with self.assertRaisesRegex(
        ValueError,
        r"module_outputs: the output of Act would be named \('layers', 0,"
        r" '__call__'\) or \('layers', 1, '__call__'\).*jax.jit.*shares its"
        r' attribute table.*nnx.jit',
    ):
      capture(f)(model, x)
    # Not selected: no hook point, no error.
    g = module_outputs(lambda m, x: apply_one(m.layers[1], x), nnx.Linear)
    self.assertEqual(dict(capture(g)(model, x)[1]), {})

  def test_two_roots_with_one_source(self):
    # nnx.clone before the capture: both roots hold the same tables.
    m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    twin = nnx.clone(m)
    x = jnp.ones((1, 2))
    f = module_outputs(lambda a, b, x: jax.jit(_call)(b, x), nnx.Linear)
    with self.assertRaisesRegex(
        ValueError, r"named \(0, '__call__'\) or \(1, '__call__'\).*nnx.jit"
    ):
      capture(f)(m, twin, x)
    # nnx.jit names it.
    g = module_outputs(lambda a, b, x: nnx.jit(_call)(b, x), nnx.Linear)
    _close(self, capture(g)(m, twin, x)[1], {(1, '__call__'): (m(x),)})


if __name__ == '__main__':
  absltest.main()
