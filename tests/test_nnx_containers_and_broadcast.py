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

"""``nnx.capture`` of a container of modules, perturbations of a module an
``nnx.vmap`` broadcasts, and a sown name that is also a submodule's.

* ``nnx.capture(f, T)(modules, x)`` with ``modules`` a dict, list or tuple
  of modules (nested too) returns what Flax 0.12.8 returns: States keyed by
  each module's place in the container. Compared with Flax itself, in a
  subprocess that never imports ``flax.nnx.sow`` (the runner of
  ``test_nnx_flax_parity.py``).
* ``nnx.capture(nnx.grad(loss), nnx.Perturbation)`` where ``loss`` runs the
  model in an ``nnx.vmap`` that broadcasts it gives one perturbation for the
  module, the gradient summed over the examples: what step 1-3 of the
  four-step ``init=`` recipe give (with the shims and with Flax 0.12.8),
  and the gradient with respect to an additive zero, by hand.
* A module that sows under the attribute name of a submodule that sows:
  Flax 0.12.8 keeps the module's value and drops the submodule's silently;
  the shims raise, saying what to rename.
"""

from __future__ import annotations

import functools
import pathlib
import sys

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import flax.nnx.sow  # noqa: F401  (installs the shims)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
  # The runner that executes programs with and without the shims.
  from test_nnx_flax_parity import _run  # noqa: E402
finally:
  sys.path.remove(str(HERE))


PRELUDE = """
class L(nnx.Module):
  def __init__(self, seed):
    self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(seed))
  def __call__(self, x):
    y = self.lin(x)
    self.sow(nnx.Intermediate, 'y', y)
    return self.perturb('p', y)


class Stat(nnx.Variable):  # not an Intermediate: its own State in Flax too
  pass


class S(nnx.Module):
  def __init__(self, seed):
    self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(seed))
  def __call__(self, x):
    y = self.lin(x)
    self.sow(nnx.Intermediate, 'y', y)
    self.sow(Stat, 'm', jnp.mean(y))
    self.sow(nnx.Intermediate, 'tot', jnp.sum(y),
             init_fn=lambda: 0.0, reduce_fn=lambda a, b: a + b)
    return y


X = jnp.array([[1.0, -2.0], [0.5, 3.0]])
"""

CONTAINERS = {
    'dict': (
        """
d = {'enc': L(0), 'dec': L(1)}
out = nnx.capture(lambda ms, x: ms['dec'](ms['enc'](x)), nnx.Intermediate)(
    d, X)
"""
    ),
    'one_in_dict': (
        """
out = nnx.capture(lambda ms, x: ms['enc'](x), nnx.Intermediate)(
    {'enc': L(0)}, X)
"""
    ),
    'list': (
        """
out = nnx.capture(lambda ms, x: ms[1](ms[0](x)), nnx.Intermediate)(
    [L(0), L(1)], X)
"""
    ),
    'tuple': (
        """
out = nnx.capture(lambda ms, x: ms[1](ms[0](ms[1](x))), nnx.Intermediate)(
    (L(0), L(1)), X)
"""
    ),
    'nested': (
        """
d = {'a': [L(0), (L(1),)], 'b': {'c': L(2)}}
out = nnx.capture(
    lambda ms, x: ms['b']['c'](ms['a'][1][0](ms['a'][0](x))),
    nnx.Intermediate)(d, X)
"""
    ),
    'several_types_and_reduced': (
        """
d = {'enc': S(0), 'dec': [S(1)]}
out = nnx.capture(
    lambda ms, x: ms['dec'][0](ms['enc'](ms['dec'][0](x))),
    nnx.Intermediate, Stat)(d, X)
"""
    ),
    'nnx_jit_inside': (
        """
d = [L(0), {'x': L(1)}]
f = nnx.jit(lambda ms, x: ms[1]['x'](ms[0](x)))
out = nnx.capture(f, nnx.Intermediate)(d, X)
"""
    ),
    'nnx_jit_around': (
        """
d = {'enc': S(0), 'dec': S(1)}
out = nnx.jit(lambda ms, x: nnx.capture(
    lambda ms, x: ms['dec'](ms['enc'](x)), nnx.Intermediate, Stat)(ms, x))(
        d, X)
"""
    ),
    'method_outputs': (
        """
out = nnx.capture(lambda ms, x: ms[1](ms[0](x)), nnx.Intermediate,
                  method_outputs=nnx.Intermediate)((L(0), L(1)), X)
"""
    ),
    'perturbation_recipe': (
        """
d = {'enc': L(0), 'dec': [L(1)]}
fwd = lambda ms, x: jnp.sum(jnp.tanh(ms['dec'][0](ms['enc'](x))) ** 2)
_, perts = nnx.capture(fwd, nnx.Perturbation)(d, X)
def loss(ms, perts, x):
  return nnx.capture(fwd, nnx.Intermediate, init=perts)(ms, x)
(_, pg), sown = nnx.grad(loss, argnums=(0, 1), has_aux=True)(d, perts, X)
out = (perts, pg, sown)
"""
    ),
}

# Item 4 under Flax 0.12.8: the four-step recipe through an nnx.vmap that
# broadcasts the module (one perturbation, the gradient summed).
VMAP_RECIPE = """
class Dense(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.array([1.0, 2.0, 3.0]))
  def __call__(self, x):
    return jnp.sum(jnp.sin(self.perturb('h', x * self.w[...])))

XS = jnp.arange(12.0).reshape(4, 3) / 10.0
fwd = lambda m, xs: jnp.sum(
    nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, xs))
_, perts = nnx.capture(fwd, nnx.Perturbation)(Dense(), XS)
def loss(m, perts, xs):
  return nnx.capture(fwd, nnx.Intermediate, init=perts)(m, xs)
(_, pg), _ = nnx.grad(loss, argnums=(0, 1), has_aux=True)(Dense(), perts, XS)
out = (perts, pg)
"""

# Item 8 under Flax 0.12.8: 'block' is sown by Top and is the attribute of
# a submodule that sows.
NAME_CLASH = """
class Sub(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'inner', x * 2.0)
    return x * 2.0

class Top(nnx.Module):
  def __init__(self):
    self.block = Sub()
  def __call__(self, x):
    y = self.block(x)
    self.sow(nnx.Intermediate, 'block', y + 10.0)
    return y

import warnings
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter('always')
  _, state = nnx.capture(Top(), nnx.Intermediate)(jnp.array([1.0, 2.0]))
out = (state, len(caught))
"""


def _programs(shims: bool) -> dict[str, str]:
  programs = {name: PRELUDE + src for name, src in CONTAINERS.items()}
  programs['vmap_recipe'] = VMAP_RECIPE
  if not shims:  # Flax's side of the claims; the shims' are checked here
    programs['name_clash'] = NAME_CLASH
  return programs


@functools.cache
def _results(shims: bool) -> dict:
  return _run(_programs(shims), shims)


def _values(described) -> list[float]:
  """The numbers in a result of the runner, in order."""
  if isinstance(described, dict):
    if 'array' in described:
      return list(np.ravel(described['value']))
    return [v for x in described.values() for v in _values(x)]
  if isinstance(described, list):
    return [v for x in described for v in _values(x)]
  return []


class ContainerOfModulesTest(parameterized.TestCase):
  """``nnx.capture(f, T)(modules, ...)``: the same States as Flax 0.12.8."""

  @parameterized.named_parameters((name, name) for name in CONTAINERS)
  def test_same_as_flax(self, name):
    flax_result = _results(False)[name]
    self.assertNotIn('error', flax_result)
    self.assertEqual(_results(True)[name], flax_result)

  def test_paths_and_values_by_hand(self):
    enc, dec = nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear(
        2, 2, rngs=nnx.Rngs(1)
    )

    class Block(nnx.Module):

      def __init__(self, lin):
        self.lin = lin

      def __call__(self, x):
        y = self.lin(x)
        self.sow(nnx.Intermediate, 'y', y)
        return y

    x = jnp.array([[1.0, -2.0]])
    h = x @ enc.kernel[...] + enc.bias[...]
    y = h @ dec.kernel[...] + dec.bias[...]
    models = {'enc': Block(enc), 'dec': [Block(dec)]}
    f = lambda ms, x: ms['dec'][0](ms['enc'](x))
    for wrap in (lambda g: g, nnx.jit):
      out, st = nnx.capture(wrap(f), nnx.Intermediate)(models, x)
      np.testing.assert_allclose(out, y, rtol=1e-6)
      self.assertEqual(
          jax.tree.map(jnp.shape, nnx.to_pure_dict(st)),
          {'enc': {'y': ((1, 2),)}, 'dec': {0: {'y': ((1, 2),)}}},
      )
      np.testing.assert_allclose(st['enc']['y'][0], h, rtol=1e-6)
      np.testing.assert_allclose(st['dec'][0]['y'][0], y, rtol=1e-6)

  def test_direct_perturbation_of_a_container(self):
    # By hand: loss = sum(tanh(h2)^2), h2 = dec(h1), h1 = enc(x); the
    # perturbation of 'p' at h2 gets 2 tanh(h2) (1 - tanh(h2)^2), at h1
    # that times dec's kernel.

    class P(nnx.Module):

      def __init__(self, seed):
        self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(seed))

      def __call__(self, x):
        return self.perturb('p', self.lin(x))

    models = (P(0), P(1))
    x = jnp.array([[1.0, -2.0], [0.5, 3.0]])
    loss = lambda ms, x: jnp.sum(jnp.tanh(ms[1](ms[0](x))) ** 2)
    _, grads = nnx.capture(nnx.grad(loss), nnx.Perturbation)(models, x)
    k1, b1 = models[0].lin.kernel[...], models[0].lin.bias[...]
    k2, b2 = models[1].lin.kernel[...], models[1].lin.bias[...]
    h2 = (x @ k1 + b1) @ k2 + b2
    d2 = 2 * jnp.tanh(h2) * (1 - jnp.tanh(h2) ** 2)
    np.testing.assert_allclose(grads[1]['p'][...], d2, rtol=1e-5)
    np.testing.assert_allclose(grads[0]['p'][...], d2 @ k2.T, rtol=1e-5)

  def test_a_first_argument_without_modules_raises(self):
    with self.assertRaisesRegex(TypeError, 'dict, list or tuple of Modules'):
      nnx.capture(lambda d, x: x, nnx.Intermediate)({'a': jnp.ones(2)}, 1.0)


class Dense(nnx.Module):

  def __init__(self):
    self.w = nnx.Param(jnp.array([1.0, 2.0, 3.0]))

  def __call__(self, x):
    return jnp.sum(jnp.sin(self.perturb('h', x * self.w[...])))


XS = jnp.arange(12.0).reshape(4, 3) / 10.0
W = np.array([1.0, 2.0, 3.0])
# d/dp sum_e sum(sin(x_e * w + p)) at p = 0: the examples' cos, summed.
HAND = np.cos(np.asarray(XS) * W).sum(0)


def _vmapped(m, xs):
  return jnp.sum(nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, xs))


def _vmapped_axis_1(m, xs):
  return jnp.sum(nnx.vmap(lambda m, x: m(x), in_axes=(None, 1))(m, xs.T))


def _scanned(m, xs):
  body = lambda m, c, x: (c + m(x), None)
  return nnx.scan(body, in_axes=(None, nnx.Carry, 0))(m, 0.0, xs)[0]


def _lax_scanned(m, xs):
  return jax.lax.scan(lambda c, x: (c + m(x), None), 0.0, xs)[0]


def _jax_vmapped(m, xs):
  return jnp.sum(jax.vmap(lambda x: m(x))(xs))


def _recipe(fwd, model, xs):
  """Steps 1-3 of Flax's four-step recipe: the perturbations' gradient."""
  _, perts = nnx.capture(fwd, nnx.Perturbation)(model, xs)

  def loss(m, perts, xs):
    return nnx.capture(fwd, nnx.Intermediate, init=perts)(m, xs)

  (_, pg), _ = nnx.grad(loss, argnums=(0, 1), has_aux=True)(model, perts, xs)
  return perts, pg


class BroadcastPerturbationTest(parameterized.TestCase):
  """One perturbation for a module that the transform does not slice."""

  @parameterized.parameters(
      _vmapped, _vmapped_axis_1, _scanned, _lax_scanned, _jax_vmapped
  )
  def test_direct_form_equals_recipe_and_hand(self, fwd):
    model = Dense()
    _, direct = nnx.capture(nnx.grad(fwd), nnx.Perturbation)(model, XS)
    perts, recipe = _recipe(fwd, model, XS)
    self.assertEqual(perts['h'][...].shape, (3,))  # step 1: one, zeros
    np.testing.assert_array_equal(perts['h'][...], np.zeros(3))
    np.testing.assert_allclose(recipe['h'][...], HAND, rtol=1e-5)
    self.assertEqual(direct['h'][...].shape, (3,))
    np.testing.assert_allclose(direct['h'][...], HAND, rtol=1e-5)

  def test_under_jit(self):
    model = Dense()
    run = nnx.jit(
        lambda m, xs: nnx.capture(nnx.grad(_vmapped), nnx.Perturbation)(m, xs)
    )
    for _ in range(2):
      _, direct = run(model, XS)
      np.testing.assert_allclose(direct['h'][...], HAND, rtol=1e-5)

  def test_flax_recipe_gives_the_same(self):
    # Flax 0.12.8's own four-step recipe: one zero perturbation, and the
    # gradient summed over the examples.
    flax_perts, flax_pg = _results(False)['vmap_recipe']['tuple']
    self.assertEqual(_values(flax_perts), [0.0, 0.0, 0.0])
    np.testing.assert_allclose(_values(flax_pg), HAND, rtol=1e-5)
    # The shims' recipe gives what Flax's does; the direct form too.
    self.assertEqual(
        _results(True)['vmap_recipe'], _results(False)['vmap_recipe']
    )
    _, direct = nnx.capture(nnx.grad(_vmapped), nnx.Perturbation)(Dense(), XS)
    np.testing.assert_allclose(direct['h'][...], _values(flax_pg), rtol=1e-5)

  def test_sliced_layers_with_a_broadcast_vmap_and_a_loop_inside(self):
    # Sliced by nnx.scan (one perturbation per layer); inside each layer an
    # nnx.vmap that broadcasts it and a lax.scan: summed over both.

    class Layer(nnx.Module):

      def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (3,)))

      def __call__(self, x):  # (steps, 3)
        def body(c, xt):
          return self.perturb('h', jnp.tanh(xt * self.w[...] + c)), None

        return jax.lax.scan(body, jnp.zeros(3), x)[0]

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,))
    def make(rngs):
      return Layer(rngs)

    def fwd(layers, xs):
      @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
      def run(layer, xs):
        out = nnx.vmap(lambda l, x: l(x), in_axes=(None, 0))(layer, xs)
        return xs + out[:, None, :]

      return jnp.sum(run(layers, xs) ** 2)

    layers = make(nnx.Rngs(0))
    xs = jnp.linspace(-1.0, 1.0, 4 * 5 * 3).reshape(4, 5, 3)
    _, direct = nnx.capture(nnx.grad(fwd), nnx.Perturbation)(layers, xs)
    perts, recipe = _recipe(fwd, layers, xs)
    self.assertEqual(perts['h'][...].shape, (2, 3))
    self.assertEqual(direct['h'][...].shape, (2, 3))
    np.testing.assert_allclose(direct['h'][...], recipe['h'][...], rtol=1e-5)
    # By hand, with the perturbation an additive zero per layer.
    w = np.asarray(layers.w[...])

    def by_hand(p):
      h = xs
      for i in range(2):

        def body(c, xt, i=i):
          c = jnp.tanh(xt * w[i] + c) + p[i]
          return c, None

        out = jax.vmap(lambda x, i=i: jax.lax.scan(body, jnp.zeros(3), x)[0])(h)
        h = h + out[:, None, :]
      return jnp.sum(h**2)

    np.testing.assert_allclose(
        direct['h'][...], jax.grad(by_hand)(jnp.zeros((2, 3))), rtol=1e-4
    )


class NameClashTest(absltest.TestCase):
  """A sown name that is the attribute name of a submodule that sows."""

  def test_flax_drops_the_submodule_silently(self):
    state, warned = _results(False)['name_clash']['tuple']
    self.assertEqual(list(state['state']), ["'block'"])  # no 'inner'
    block = state['state']["'block'"]
    self.assertEqual(block['variable'], 'Intermediate')
    self.assertEqual(_values(block), [12.0, 14.0])  # Top's value: 2x + 10
    self.assertEqual(warned, {'py': 'int', 'value': 0})

  def test_the_shims_raise_saying_what_to_rename(self):

    class Sub(nnx.Module):

      def __call__(self, x):
        self.sow(nnx.Intermediate, 'inner', x * 2.0)
        return self.perturb('inner', x * 2.0)

    class Top(nnx.Module):

      def __init__(self):
        self.block = Sub()

      def __call__(self, x):
        y = self.block(x)
        self.sow(nnx.Intermediate, 'block', y + 10.0)
        return jnp.sum(self.perturb('block', y))

    x = jnp.array([1.0, 2.0])
    with self.assertRaisesRegex(
        ValueError,
        r"Module\.sow\(Intermediate, 'block'\) in Top .*attribute of the Sub"
        r".*\('block', 'inner'\).*Flax 0\.12\.8 keeps only the value sown"
        r" under 'block'.*Rename the sow \(e\.g\. self\.sow\(Intermediate,"
        r" 'block_out', \.\.\.\)\) or the attribute 'block'",
    ):
      nnx.capture(Top(), nnx.Intermediate)(x)
    with self.assertRaisesRegex(
        ValueError,
        r"Module\.perturb\(Perturbation, 'block'\) in Top .*Rename the sow"
        r" \(e\.g\. self\.perturb\('block_out', \.\.\.\)\)",
    ):
      nnx.capture(nnx.grad(lambda m, x: m(x)), nnx.Perturbation)(Top(), x)
    # The functional capture has no State to nest: both names come back.
    _, collected = flax.nnx.sow.capture(Top(), tags=[nnx.Intermediate])(x)
    self.assertEqual(list(collected), [('block', 'inner'), ('block',)])


if __name__ == '__main__':
  absltest.main()
