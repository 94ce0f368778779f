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

"""``intervene(f, hook, names=...)``: one hook that knows where it is."""

import re

from absl.testing import absltest
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import as_path
from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import sow


def _blocks(x, scale=None):
  """Three blocks; ``scale[i]`` (by hand) multiplies block i's residual."""
  for i in range(3):
    x = jnp.tanh(x + i)
    if scale is None:
      x = sow(x, name=('blocks', i, 'resid'))
    else:
      x = x * scale[i]
    sow(x * 2, name=('blocks', i, 'attn'))
  sow(x.sum(), name='total', reduce_fn=lambda a, b: a + b, init_fn=lambda: 0.0)
  return x


def _ablate_layer_1(name, value):
  return value * 0.0 if name[1] == 1 else value


class HookTest(absltest.TestCase):

  def test_one_hook_for_every_layer_by_predicate(self):
    x = jnp.array([0.3, -0.2])
    ref = _blocks(x, scale=[1.0, 0.0, 1.0])
    resid = lambda n: as_path(n)[-1] == 'resid'
    for wrap in (lambda f: f, jax.jit):
      out = wrap(intervene(_blocks, _ablate_layer_1, names=resid))(x)
      np.testing.assert_allclose(out, ref, rtol=1e-6)

  def test_the_hook_receives_each_name_once_per_sow(self):
    seen = []

    def hook(name, value):
      seen.append(name)
      return value

    intervene(_blocks, hook)(jnp.zeros(2))
    # Every plain name, in program order; the reduced one is passed over.
    self.assertEqual(
        seen,
        [('blocks', i, k) for i in range(3) for k in ('resid', 'attn')],
    )

  def test_a_hook_in_a_scan_gets_each_iteration(self):
    def f(xs):
      def body(c, x):
        return c + sow(x * c, name='h'), None

      return lax.scan(body, 1.0, xs)[0]

    xs = jnp.array([1.0, 2.0, 3.0])
    out = intervene(f, lambda n, v: v + 1.0)(xs)
    c = 1.0
    for x in [1.0, 2.0, 3.0]:
      c = c + (x * c + 1.0)
    np.testing.assert_allclose(out, c)

  def test_iterable_names_and_typos(self):
    x = jnp.zeros(2)
    out = intervene(_blocks, _ablate_layer_1,
                    names=[('blocks', 1, 'resid')])(x)
    np.testing.assert_allclose(out, _blocks(x, scale=[1.0, 0.0, 1.0]),
                               rtol=1e-6)
    with self.assertRaisesRegex(
        ValueError, r"names= lists 'blocks/1/resid'.*Did you mean \('blocks',"
        r" 1, 'resid'\)"
    ):
      intervene(_blocks, _ablate_layer_1, names=['blocks/1/resid'])(x)
    # strict=False passes over it.
    out = intervene(_blocks, _ablate_layer_1, names=['blocks/1/resid'],
                    strict=False)(x)
    np.testing.assert_allclose(out, _blocks(x, scale=[1.0] * 3), rtol=1e-6)

  def test_an_identity_hook_compiles_to_the_program_without_it(self):
    x = jnp.zeros(2)
    ops = lambda f: sorted(
        re.findall(r'stablehlo\.\w+', jax.jit(f).lower(x).as_text())
    )
    plain = ops(_blocks)  # its sows are identities, compiled to nothing
    self.assertIn('stablehlo.tanh', plain)
    self.assertEqual(ops(intervene(_blocks, lambda n, v: v)), plain)
    # What is left of the sows is effect-free (dead-code eliminated).
    hooked = jax.make_jaxpr(intervene(_blocks, lambda n, v: v))(x)
    self.assertEqual(hooked.effects, set())

  def test_capture_around_sees_the_hooked_values(self):
    x = jnp.zeros(2)
    _, c = capture(intervene(_blocks, _ablate_layer_1))(x)
    np.testing.assert_allclose(c[('blocks', 1, 'resid')][0], [0.0, 0.0])

  def test_gradient_through_a_hook(self):
    x = jnp.array([0.1, 0.2])
    g = jax.grad(lambda x: intervene(_blocks, lambda n, v: 0.5 * v)(x).sum())
    ref = jax.grad(lambda x: _blocks(x, scale=[0.5] * 3).sum())
    np.testing.assert_allclose(g(x), ref(x), rtol=1e-5)

  def test_a_derivative_inside_sees_only_the_selected_replacements(self):
    def h(y):
      return sow(y, name='a') * 2.0 + sow(y * 3.0, name='b')

    g = lambda z: jax.grad(lambda q: h(q).sum())(z)
    x = jnp.array([1.0, 2.0])
    half = lambda n, v: 0.5 * v
    # By hand: d/dy of 2 a(y) + b(3y) with a or b halved.
    np.testing.assert_allclose(intervene(g, half, names=['a'])(x), [4.0, 4.0])
    np.testing.assert_allclose(
        intervene(g, half, names=lambda n: n == 'b')(x), [3.5, 3.5]
    )
    np.testing.assert_allclose(jax.jit(intervene(g, half))(x), [2.5, 2.5])

  def test_a_model_with_no_sow_points_to_module_outputs(self):
    with self.assertRaisesRegex(ValueError, 'module_outputs'):
      intervene(lambda x: x * 2, {'h': lambda v: v})(1.0)

  def test_names_needs_a_hook(self):
    with self.assertRaisesRegex(TypeError, 'names= selects the sows of a hook'):
      intervene(_blocks, {'a': lambda v: v}, names=['a'])
    with self.assertRaisesRegex(TypeError, 'wrap one name in a list'):
      intervene(_blocks, _ablate_layer_1, names='total')


if __name__ == '__main__':
  absltest.main()
